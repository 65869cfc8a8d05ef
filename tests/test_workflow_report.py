"""The whole pipeline through the real snakemake CLI on a tiny config, ending in `snakemake --report`."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time

import pytest

from eagle3_pipeline import journal

from .conftest import base_config, run_snakemake, snakemake_command
from .test_workflow_data import tiny_dataset

pytestmark = pytest.mark.workflow


def tiny_run_config(tmp_path, target_dir) -> dict:
    tiny_dataset(tmp_path / "chats.json")
    return base_config(
        run="tiny", target={"source": str(target_dir)},
        data={"inputs": [str(tmp_path / "chats.json")], "num_shards": 2, "train_conversations": None,
              "eval_conversations": 4, "max_seq_len": 128},
        vocab={"draft_vocab_size": 300},
        extract={"token_budget": 1024, "threads": 2},
        train={"ttt_steps": 2, "epochs": 1, "batch_tokens": 512, "max_seq_len": 128, "warmup_steps": 1,
               "checkpoint_every": 5, "log_every": 1, "num_workers": 0, "threads": 2},
        evaluate={"prompts": ["mtbench-package", "held-out"], "max_prompts": 2, "max_new_tokens": 6,
                  "draft_lengths": [2], "device": "cpu", "workers": 2})


def test_tiny_end_to_end_run_builds_the_html_report(tmp_path, target_dir):
    config = tiny_run_config(tmp_path, target_dir)
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

    # what `make run` prints last: every prompt set and method with the tau and speedup of its JSON
    headline = subprocess.run([sys.executable, "-m", "eagle3_pipeline.plots", "results/tiny"], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout
    lines = [line.split() for line in headline.splitlines()[2:]]
    for prompt_set in ("mtbench-package", "held-out"):
        summary = json.loads((results / "evaluation" / f"{prompt_set}.json").read_text())["summary"]
        shown = {line[1]: line for line in lines if line[0] == prompt_set}
        assert set(shown) == set(summary)
        for method, values in summary.items():
            assert shown[method][2] == f"{values.get('tau', 1.0):.3f}"
            assert shown[method][4] == f"{values.get('speedup_vs_target', 1.0):.3f}"


def test_a_killed_evaluation_resumes_with_the_prompts_it_finished(tmp_path, target_dir):
    config = tiny_run_config(tmp_path, target_dir)
    config["evaluate"] = {**config["evaluate"], "prompts": ["mtbench-package"], "max_prompts": 5,
                          "max_new_tokens": 24, "workers": 1}
    run_snakemake(tmp_path, config, "results/tiny/serving/drafter")
    output = tmp_path / "results" / "tiny" / "evaluation" / "mtbench-package.json"
    progress = output.with_name(output.name + ".progress")
    process = subprocess.Popen(snakemake_command(tmp_path, config, str(output.relative_to(tmp_path))),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and sum(len(f.read_text().splitlines()) for f in progress.glob("*.jsonl")) < 2:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    before = {record["prompt_id"]: record["traces"]
              for part in progress.glob("*.jsonl") for record in journal.read_intact(part)[0]}
    assert 2 <= len(before) < 5 and not output.exists(), "the kill did not land during the evaluation"
    run_snakemake(tmp_path, config, "--unlock")
    run_snakemake(tmp_path, config, str(output.relative_to(tmp_path)))
    log = (tmp_path / "logs" / "tiny" / "evaluate" / "mtbench-package.log").read_text()
    assert f"resuming: {len(before)} of 5 prompts already decoded" in log
    traces = json.loads(output.read_text())["traces"]
    assert sorted(t["prompt_id"] for t in traces if t["method"] == "target") == sorted(
        t["prompt_id"] for t in traces if t["method"] == "eagle3@k=2")
    assert len([t for t in traces if t["method"] == "target"]) == 5
    for trace in traces:  # finished prompts are kept as they were (their timings too), not decoded again
        if trace["prompt_id"] in before:
            assert trace["total_seconds"] == before[trace["prompt_id"]][trace["method"]]["total_seconds"]
    assert not progress.exists()
