"""The whole pipeline through the real snakemake CLI on a tiny config, ending in `snakemake --report`: what the one
shared finished run (`finished_tiny_run`) wrote, and an evaluation killed and resumed in a copy of it."""

from __future__ import annotations

import base64
import csv
import json
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from eagle3_pipeline.formats import conversation_shards, token_shards
from tests.conftest import JOB_THREADS, run_snakemake
from tests.workflow.conftest import copy_run, journal_records, kill_when, start_snakemake

pytestmark = [pytest.mark.workflow, pytest.mark.slow]  # each test needs the finished tiny run


def acceptance_by_position_from_steps(traces: list[dict], k: int) -> list[float]:
    """P(draft i accepted | drafts 1..i-1 accepted), counted from each verify step's accepted and drafted counts."""
    steps = [(accepted, drafted) for t in traces for accepted, drafted in zip(t["accepted"], t["drafted"], strict=True)]
    rates = []
    for i in range(1, k + 1):
        reached = [accepted for accepted, drafted in steps if accepted >= i - 1 and drafted >= i]
        rates.append(sum(accepted >= i for accepted in reached) / len(reached) if reached else 0.0)
    return rates


TREE = "eagle3-tree(steps=2,topk=2,tokens=4)"  # the tiny run's one tree setting


def check_evaluation(evaluation: dict) -> None:
    """tau and acceptance by position as the traces' tokens and per-step accepted counts give them, for the chain
    and the tree (whose `drafted` is the tree's depth)."""
    assert {"target", "eagle3@k=2", "prompt-lookup@k=2", "eagle3-untrained@k=2", TREE} <= set(evaluation["summary"])
    for method in ("eagle3@k=2", TREE):
        check_method(evaluation, method)
    assert evaluation["summary"][TREE]["sglang_flags"] == ("--speculative-num-steps 2 --speculative-eagle-topk 2 "
                                                           "--speculative-num-draft-tokens 4")
    assert evaluation["workers"] == 2 and sum(t["method"] == "target" for t in evaluation["traces"]) == 2


def check_method(evaluation: dict, method: str) -> None:
    traces = {(t["prompt_id"], t["method"]): t for t in evaluation["traces"]}
    eagle3 = [t for t in evaluation["traces"] if t["method"] == method]
    assert evaluation["summary"][method]["tau"] == pytest.approx(  # accepted drafts + 1 per verify step
        1 + sum(sum(t["accepted"]) for t in eagle3) / sum(len(t["accepted"]) for t in eagle3))
    for trace in eagle3:  # fp32: lossless, so the traces are the target's own tokens
        assert trace["tokens"] == traces[trace["prompt_id"], "target"]["tokens"]
        assert trace["target_forwards"] == len(trace["accepted"])
        # the prefill gives the first token, each verify step its accepted drafts and one target token;
        # only the last step may be cut short (end of turn, max_new_tokens)
        kept = [accepted + 1 for accepted in trace["accepted"]]
        assert 1 + sum(kept[:-1]) < len(trace["tokens"]) <= 1 + sum(kept) if kept else len(trace["tokens"]) == 1
    assert evaluation["summary"][method]["acceptance_by_position"] == pytest.approx(
        acceptance_by_position_from_steps(eagle3, 2))


def test_the_tiny_run_evaluates_and_times_every_method_and_tabulates_both_passes(finished_tiny_run):
    results = finished_tiny_run.results
    for prompt_set in ("mtbench-package", "held-out"):
        check_evaluation(json.loads((results / "evaluation" / f"{prompt_set}.json").read_text()))
    timing = json.loads((results / "timing" / "timing.json").read_text())
    assert timing["pass"] == "timing" and set(timing["sets"]) == {"mtbench-package", "held-out"}
    assert set(timing["sets"]["held-out"]) == {"target", "eagle3@k=2", "prompt-lookup@k=2", TREE}
    table = list(csv.DictReader((results / "report" / "tau_and_speedup.csv").open()))
    for row in table:  # tau from the tau pass, speeds from the timing pass, each named by its pass
        summary = json.loads((results / "evaluation" / f"{row['prompt_set']}.json").read_text())["summary"]
        assert float(row["tau (tau pass)"]) == pytest.approx(summary[row["method"]].get("tau", 1.0), abs=1e-3)
        speed = timing["sets"][row["prompt_set"]].get(row["method"])
        assert row["speedup_vs_target (timing pass)"] == (f"{speed['speedup_vs_target']:.3f}" if speed else "")
    assert len(table) == 2 * 5
    flags = {row["method"]: row["sglang_flags"] for row in table}
    assert flags[TREE].startswith("--speculative-num-steps 2 ") and flags["prompt-lookup@k=2"] == ""


def test_the_tiny_run_checks_parity_estimates_each_epoch_and_exports_for_serving(finished_tiny_run):
    results = finished_tiny_run.results
    parity = json.loads((results / "parity" / "hf.json").read_text())
    assert parity["passed"] and parity["aux_layer_ids"] == [2, 15, 27]
    train_summary = json.loads((results / "train" / "summary.json").read_text())
    timing = json.loads((results / "timing" / "timing.json").read_text())
    # the report's line on the run: the training job's wall time and device
    assert train_summary["train_seconds"] > 0 and train_summary["device"] == f"CPU, {JOB_THREADS} threads"
    assert timing["device_name"] == f"CPU, {JOB_THREADS} threads"
    estimate = train_summary["heldout_estimate"]
    assert [row["epoch"] for row in estimate["by_epoch"]] == [1]  # one epoch, one offline estimate
    heldout = token_shards.read(results / "tokens" / "shard-heldout.zarr")
    parts = {name: {c["id"] for c in conversation_shards.read(results / "conversations" / f"{name}.jsonl")}
             for name in ("eval", "selection", "shard-00000", "shard-00001")}
    assert all(parts.values()) and sum(map(len, parts.values())) == len(set().union(*parts.values()))  # disjoint
    assert set(heldout.sample_ids) == parts["selection"]  # the epoch is picked on the selection set, not eval
    masks = np.split(heldout.loss_mask, heldout.seq_offsets[1:-1])
    # a draft is made at t whenever token t+2 is an assistant token: every held-out loss token past the second
    assert estimate["by_epoch"][0]["positions"] == sum(int(mask[2:].sum()) for mask in masks)
    served = json.loads((results / "serving" / "drafter" / "config.json").read_text())
    assert served["architectures"] == ["LlamaForCausalLMEagle3"]


def test_the_tiny_run_builds_the_html_report(finished_tiny_run_report):
    html = finished_tiny_run_report.read_text()
    pngs = [base64.b64decode(m) for m in re.findall(r"(iVBORw0KGgo[A-Za-z0-9+/=]+)", html)]
    assert len(pngs) == 3  # acceptance by position, training curves, disk plan vs actual
    for png in pngs:
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])
        assert width > 300 and height > 200
    for name in ("acceptance_by_position.png", "training_curves.png", "disk_plan_vs_actual.png",
                 "tau_and_speedup.csv", "provenance.json", "mtbench-package.json", "timing.json"):
        assert name in html


def test_the_headline_shows_every_method_with_its_tau_and_speedup(finished_tiny_run):
    """What `make run` prints last: every prompt set and method with the tau and speedup of its JSON, in 120
    columns."""
    results = finished_tiny_run.results
    timing = json.loads((results / "timing" / "timing.json").read_text())
    headline = subprocess.run([sys.executable, "-m", "eagle3_pipeline.stages.plots", "results/tiny"],
                              cwd=finished_tiny_run.workdir, capture_output=True, text=True, check=True).stdout
    lines = headline.splitlines()
    assert max(len(line) for line in lines) <= 120  # a 120-column terminal
    assert lines[lines.index(f"  {TREE}") + 1] == (
        "      --speculative-num-steps 2 --speculative-eagle-topk 2 --speculative-num-draft-tokens 4")
    for prompt_set in ("mtbench-package", "held-out"):
        summary = json.loads((results / "evaluation" / f"{prompt_set}.json").read_text())["summary"]
        title = next(i for i, line in enumerate(lines) if line.startswith(f"{prompt_set}: tau over 2 prompts"))
        shown = {cells[0]: cells for cells in map(str.split, lines[title + 2: title + 2 + len(summary)])}
        assert set(shown) == set(summary)
        for method, values in summary.items():  # tau from the tau pass, speedup from the timing pass
            assert shown[method][1] == f"{values.get('tau', 1.0):.3f}"
            speed = timing["sets"][prompt_set].get(method)
            # the untrained baseline is not timed: its speed cells say so
            assert shown[method][2] == (f"{speed['speedup_vs_target']:.2f}x" if speed else "-")


def finished_prompts(progress) -> int:
    return sum(len(journal_records(part)) for part in progress.glob("*.jsonl"))


def test_a_killed_evaluation_resumes_with_the_prompts_it_finished(finished_tiny_run, tmp_path):
    # the finished run up to its exported drafter: only the evaluate rule's settings change below
    run = copy_run(finished_tiny_run, tmp_path / "run", drop=("results/tiny/evaluation", "logs/tiny/evaluate"))
    workdir, config = run.workdir, run.config
    config["evaluate"] = {**config["evaluate"], "prompts": ["mtbench-package"], "max_prompts": 5,  # resume only:
                          "max_new_tokens": 24, "workers": 1, "tree": [], "untrained_baseline": False}  # 3 methods
    output = workdir / "results" / "tiny" / "evaluation" / "mtbench-package.json"
    progress = output.with_name(output.name + ".progress")
    process = start_snakemake(workdir, config, str(output.relative_to(workdir)))
    kill_when(process, "two decoded prompts in the evaluation journal", lambda: finished_prompts(progress) >= 2)
    before = {record["prompt_id"]: record["traces"]
              for part in progress.glob("*.jsonl") for record in journal_records(part)}
    assert 2 <= len(before) < 5 and not output.exists(), "the kill did not land during the evaluation"
    run_snakemake(workdir, config, "--unlock")
    run_snakemake(workdir, config, str(output.relative_to(workdir)))
    log = (workdir / "logs" / "tiny" / "evaluate" / "mtbench-package.log").read_text()
    assert f"resuming: {len(before)} of 5 prompts already decoded" in log
    traces = json.loads(output.read_text())["traces"]
    assert sorted(t["prompt_id"] for t in traces if t["method"] == "target") == sorted(
        t["prompt_id"] for t in traces if t["method"] == "eagle3@k=2")
    assert len([t for t in traces if t["method"] == "target"]) == 5
    for trace in traces:  # finished prompts are kept as they were (their timings too), not decoded again
        if trace["prompt_id"] in before:
            assert trace["total_seconds"] == before[trace["prompt_id"]][trace["method"]]["total_seconds"]
    assert not progress.exists()


def decoded(evaluation: dict) -> list[tuple]:
    """What the tau pass decided, without its timings: each prompt's and method's tokens and accepted counts."""
    return sorted((t["prompt_id"], t["method"], t["tokens"], t["accepted"], t["drafted"]) for t in evaluation["traces"])


def test_the_tau_pass_alone_evaluates_a_copied_drafter_as_its_run_did(finished_tiny_run, tmp_path):
    # another machine, or the stores deleted: the exported drafter alone, no Snakemake records of the run
    workdir = tmp_path / "elsewhere"
    shutil.copytree(finished_tiny_run.results / "serving", workdir / "results" / "tiny" / "serving")
    outputs = [f"results/tiny/evaluation/{name}.json" for name in ("mtbench-package", "held-out")]
    result = run_snakemake(workdir, finished_tiny_run.config, *outputs,
                           "--allowed-rules", "ingest", "target", "evaluate")
    assert not {"tokens", "hidden", "vocab", "train"} & {p.name for p in (workdir / "results" / "tiny").iterdir()}
    assert "rule train" not in result.stdout + result.stderr
    for output in outputs:
        assert decoded(json.loads((workdir / output).read_text())) == decoded(
            json.loads((finished_tiny_run.workdir / output).read_text()))
