"""Shared fixtures: the real SmolLM2 target (materialised once by the real `target` rule) and a
helper that runs the real snakemake CLI on a config in a temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
DATA = Path(__file__).parent / "data"


def base_config(**sections) -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def snakemake_command(workdir: Path, config: dict, *args: str) -> list[str]:
    config_path = workdir / "test_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return [SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
            "--configfile", str(config_path), "--workflow-profile", str(REPO / "profiles" / "default"),
            "--cores", "2", *args]


def run_snakemake(workdir: Path, config: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(snakemake_command(workdir, config, *args), capture_output=True, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-8000:]}")
    return result


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a plain HF directory, produced by the real `target` rule from the GGUF."""
    workdir = tmp_path_factory.mktemp("target")
    config = base_config(run="target")
    run_snakemake(workdir, config, "results/target/target")
    path = workdir / "results" / "target" / "target"
    assert json.loads((path / "identity.json").read_text())["source"]["kind"] == "gguf"
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_dir))


def sharegpt_record(record_id: str, turns: list[tuple[str, object]]) -> dict:
    return {"id": record_id, "conversations": [{"from": role, "value": value} for role, value in turns]}


def send_json(handler, code: int, payload) -> None:
    """Answer a request of a test HTTP server (BaseHTTPRequestHandler) with a JSON body."""
    data = json.dumps(payload).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def tiny_conversations(count: int, seed: int = 0) -> list[dict]:
    """Short, varied real-looking conversations (user/assistant, some with a system prompt)."""
    import random

    rng = random.Random(seed)
    topics = ["rivers", "prime numbers", "bread", "volcanoes", "chess", "the moon", "tea", "bridges"]
    records = []
    for i in range(count):
        topic = rng.choice(topics)
        turns: list[tuple[str, object]] = []
        if i % 5 == 0:
            turns.append(("system", "Answer briefly."))
        for turn in range(rng.randint(1, 3)):
            turns.append(("human", f"Question {turn} about {topic}, number {i}?"))
            turns.append(("gpt", f"Here is answer {turn} about {topic}: it is interesting ({i})."))
        records.append(sharegpt_record(f"conv{i}", turns))
    return records
