"""The whole pipeline through the real snakemake CLI on a tiny config, ending in `snakemake --report`."""

from __future__ import annotations

import base64
import json
import re
import struct

import pytest

from .conftest import base_config, run_snakemake
from .test_workflow_data import tiny_dataset

pytestmark = pytest.mark.workflow


def test_tiny_end_to_end_run_builds_the_html_report(tmp_path, target_dir):
    tiny_dataset(tmp_path / "chats.json")
    config = base_config(
        run="tiny", target={"source": str(target_dir)},
        data={"inputs": [str(tmp_path / "chats.json")], "num_shards": 2, "train_conversations": None,
              "eval_conversations": 4, "max_seq_len": 128},
        vocab={"draft_vocab_size": 300},
        extract={"token_budget": 1024, "threads": 2},
        train={"ttt_steps": 2, "epochs": 1, "batch_tokens": 512, "max_seq_len": 128, "warmup_steps": 1,
               "checkpoint_every": 5, "log_every": 1, "num_workers": 0, "threads": 2},
        evaluate={"prompts": ["mtbench-package", "held-out"], "max_prompts": 2, "max_new_tokens": 6,
                  "draft_lengths": [2], "device": "cpu", "workers": 2})
    run_snakemake(tmp_path, config)
    results = tmp_path / "results" / "tiny"
    for prompt_set in ("mtbench-package", "held-out"):
        evaluation = json.loads((results / "evaluation" / f"{prompt_set}.json").read_text())
        assert {"target", "eagle3@k=2", "prompt-lookup@k=2", "eagle3-untrained@k=2"} <= set(evaluation["summary"])
        assert evaluation["summary"]["eagle3@k=2"]["tau"] >= 1.0
        assert evaluation["workers"] == 2 and sum(t["method"] == "target" for t in evaluation["traces"]) == 2
    parity = json.loads((results / "parity" / "hf.json").read_text())
    assert parity["passed"] and parity["aux_layer_ids"] == [2, 15, 27]
    served = json.loads((results / "serving" / "drafter" / "config.json").read_text())
    assert served["architectures"] == ["LlamaForCausalLMEagle3"]
    report = tmp_path / "report.html"
    run_snakemake(tmp_path, config, "--report", str(report))
    html = report.read_text()
    pngs = [base64.b64decode(m) for m in re.findall(r"(iVBORw0KGgo[A-Za-z0-9+/=]+)", html)]
    assert len(pngs) == 3  # acceptance by position, training curves, disk plan vs actual
    for png in pngs:
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])
        assert width > 300 and height > 200
    for name in ("acceptance_by_position.png", "training_curves.png", "disk_plan_vs_actual.png",
                 "tau_and_speedup.csv", "provenance.json", "mtbench-package.json"):
        assert name in html
