"""Multi-process training through torchrun (gloo on CPU): the same code path a multi-GPU rule starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle3_pipeline.config_schema import schema_defaults
from eagle3_pipeline.formats.metrics import read as read_metrics
from tests.conftest import SAFETY_TIMEOUT_S
from tests.unit.conftest import tiny_target_with_store


@pytest.mark.slow
def test_torchrun_two_processes_trains_and_writes_one_result(tmp_path):
    target_dir, store, vocab_path = tiny_target_with_store(tmp_path, sequences=32)
    settings = schema_defaults("train") | {
        "ttt_steps": 2, "learning_rate": 3e-3, "warmup_steps": 1, "epochs": 4, "batch_tokens": 256, "max_seq_len": 64,
        "checkpoint_every": 4, "log_every": 1, "num_workers": 0, "device": "cpu"}
    args = {"stores": [str(store)], "target": str(target_dir), "vocab": str(vocab_path),
            "state_dir": str(tmp_path / "state"), "settings": settings,
            "weights": str(tmp_path / "drafter.safetensors"),
            "summary": str(tmp_path / "summary.json"), "log": str(tmp_path / "train.log")}
    (tmp_path / "args.json").write_text(json.dumps(args))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "-m", "eagle3_pipeline.stages.train", str(tmp_path / "args.json")], check=True,
                   timeout=SAFETY_TIMEOUT_S)  # waits for torchrun to end; the timeout only catches a hang
    rows = read_metrics(tmp_path / "state" / "metrics.csv")
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "over 2 GPUs/processes" in (tmp_path / "train.log").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == int(rows[-1]["step"])
    assert (tmp_path / "drafter.safetensors").stat().st_size > 0
