"""The disk plan's refusals through the real snakemake CLI: a blind plan, and a preflight scoped to the
stages the requested targets need."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tests.conftest import REPO, base_config, run_snakemake, send_json, snakemake_command, tiny_conversations

pytestmark = pytest.mark.workflow


def tiny_plan_config(tmp_path, target_source, **plan_settings) -> dict:
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in tiny_conversations(12)))
    return base_config(run="tiny", target={"source": str(target_source)},
                       data={"inputs": [str(chats)], "num_shards": 2, "train_conversations": None,
                             "eval_conversations": 2, "max_seq_len": 128},
                       vocab={"draft_vocab_size": 200},
                       plan={"expected_compression": 1.4, "allow_exceeding_free_space": False, **plan_settings})


def test_the_data_stage_alone_passes_the_preflight_that_refuses_the_whole_run(tmp_path, target_dir):
    # A compression this absurd makes the hidden stores larger than any disk; nothing else changes.
    config = tiny_plan_config(tmp_path, target_dir, expected_compression=1.0e-12)
    whole = run_snakemake(tmp_path, config, check=False)
    assert whole.returncode != 0 and "Refusing to start: the disk plan exceeds free space" in whole.stderr
    # the estimate's uncertainty and the way to an exact plan: the data stage alone
    assert "sized from an estimate (sample of" in whole.stderr
    assert "the same command with the target results/tiny/vocab/draft_vocab.safetensors" in whole.stderr
    assert not (tmp_path / "results" / "tiny").exists()  # refused before any job
    data_only = run_snakemake(tmp_path, config, "results/tiny/vocab/draft_vocab.safetensors")
    assert "(stages this run needs)" in data_only.stderr and "-> fits" in data_only.stderr
    hidden_row = next(line for line in data_only.stderr.splitlines() if line.strip().startswith("hidden"))
    assert "not run" in hidden_row
    assert (tmp_path / "results/tiny/vocab/draft_vocab.safetensors").is_file()
    # with the token shards written the plan is exact: the refusal stands, without the estimate's advice
    exact = run_snakemake(tmp_path, config, check=False)
    assert exact.returncode != 0 and "Refusing to start: the disk plan exceeds free space" in exact.stderr
    hidden_row = next(line for line in exact.stderr.splitlines() if line.strip().startswith("hidden"))
    assert hidden_row.rstrip().endswith("exact") and "sized from an estimate" not in exact.stderr


def test_until_beside_omit_from_is_planned_as_the_stages_it_runs(tmp_path, target_dir):
    # With --omit-from beside it, --until leaves every later job in Snakemake's DAG (Snakemake 9 then ends with
    # "Out of jobs ready to be started" once the named jobs are done); the preflight must not count their stages.
    config = tiny_plan_config(tmp_path, target_dir, expected_compression=1.0e-12)
    until = run_snakemake(tmp_path, config, "--until", "tokenize", "--omit-from", "export", check=False)
    assert "Refusing to start" not in until.stderr and "-> fits" in until.stderr, until.stderr[-2000:]
    assert (tmp_path / "results/tiny/tokens/shard-00000.zarr").is_dir()
    assert not (tmp_path / "results/tiny/hidden").exists()


def planned_jobs(tmp_path, config: dict, *args: str) -> dict[str, int]:
    result = run_snakemake(tmp_path, config, "-n", *args)
    return {name: int(count) for name, count in re.findall(r"^(\w+)\s+(\d+)$", result.stdout, flags=re.M)}


def test_a_configfile_starts_from_the_schemas_defaults_not_the_cpu_demo(tmp_path, target_dir):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in tiny_conversations(12)))
    mine = {"run": "mine", "target": {"source": str(target_dir)},
            "data": {"inputs": [str(chats)], "eval_conversations": 2, "max_seq_len": 128}}
    # the schema's 4 shards, not the demo's 2 (nor its 160 conversations, 4,096-token vocabulary, ...), and the
    # selection conversations' shard
    assert planned_jobs(tmp_path, mine)["tokenize"] == 4 + 1
    layered = planned_jobs(tmp_path, mine, "--configfile", str(REPO / "config" / "config.yaml"),
                           str(tmp_path / "test_config.yaml"))  # the demo named first: mine over it
    assert layered["tokenize"] == 2 + 1
    # a config that leans on the demo without naming it is told how to build on it
    bare = run_snakemake(tmp_path, {"run": "mine", "data": mine["data"]}, "-n", check=False)
    assert bare.returncode != 0 and "'target' is a required property" in bare.stderr
    assert "give config/config.yaml first to build on the demo" in bare.stderr


class FakeHubModelInfo(BaseHTTPRequestHandler):
    """The hub's model-info endpoint for one repository: it exists, nothing of it is cached here."""

    def do_GET(self):  # noqa: N802 - the http.server API
        if self.path.startswith("/api/models/someorg/base-model"):
            send_json(self, 200, {"id": "someorg/base-model", "sha": "0" * 40, "siblings": []})
        else:
            send_json(self, 404, {"error": "Repository not found"})

    def log_message(self, *args):
        pass


def test_a_hub_id_target_of_unknown_hidden_size_fails_the_plan(tmp_path):
    server = HTTPServer(("127.0.0.1", 0), FakeHubModelInfo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = os.environ | {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
                        "HF_HUB_CACHE": str(tmp_path / "empty-hf-cache")}
    env.pop("HF_HUB_OFFLINE", None)
    config = tiny_plan_config(tmp_path, "someorg/base-model")
    try:
        dry = subprocess.run(snakemake_command(tmp_path, config, "-n"), capture_output=True, text=True, env=env)
        assert dry.returncode == 0 and "WARNING: the hidden stage is NOT in this plan" in dry.stderr
        assert "plan.target_hidden_size" in dry.stderr
        real = subprocess.run(snakemake_command(tmp_path, config), capture_output=True, text=True, env=env)
        assert real.returncode != 0 and "Traceback" not in real.stderr
        assert "Refusing to start: extraction would write hidden states of unknown size" in real.stderr
        assert "plan.target_hidden_size" in real.stderr and not (tmp_path / "results").exists()
        config["plan"]["target_hidden_size"] = 576
        planned = subprocess.run(snakemake_command(tmp_path, config, "-n"), capture_output=True, text=True, env=env)
        assert planned.returncode == 0 and "NOT in this plan" not in planned.stderr
        assert any(line.strip().startswith("hidden") for line in planned.stderr.splitlines())
    finally:
        server.shutdown()


def test_an_enabled_engine_check_is_planned_after_the_timing_pass_and_warned_without_vllm(tmp_path, target_dir):
    config = tiny_plan_config(tmp_path, target_dir)
    config["engine_check"] = {"enabled": True, "draft_lengths": [4]}
    planned = run_snakemake(tmp_path, config, "-n")
    assert "rule engine_check:" in planned.stdout and "engine_check.enabled: the vllm package is not installed" \
        in planned.stderr  # this environment has no vLLM: said before any job runs
    assert "results/tiny/engine_check/vllm.json" in planned.stdout
    config["engine_check"]["prompts"] = ["humaneval-package"]
    refused = run_snakemake(tmp_path, config, "-n", check=False)
    assert refused.returncode != 0 and "engine_check.prompts: ['humaneval-package'] are not prompt sets" \
        in refused.stderr
