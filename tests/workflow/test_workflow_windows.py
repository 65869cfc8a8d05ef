"""A disk budget smaller than the hidden-state stores, through the real snakemake CLI: the window plan `-n`
prints, the hidden-store bytes each pass found on disk under the budget, a kill inside a pass and a rerun that
redoes only unfinished work, the temp stores gone at the end and nothing left to do."""

from __future__ import annotations

import json
import re

import pytest

from eagle3_pipeline import plan
from eagle3_pipeline.formats import token_shards
from tests.conftest import run_snakemake
from tests.workflow.conftest import kill_when, start_snakemake, tiny_run_config

pytestmark = pytest.mark.workflow
RESULTS = "results/tiny"
WEIGHTS = f"{RESULTS}/train/drafter.safetensors"
DISK_REPORT = f"{RESULTS}/reports/disk_plan_vs_actual.json"
SMOLLM2_HIDDEN_SIZE = 576


def planned_bytes(workdir, shard: str, config: dict) -> int:
    """What the disk plan expects of a shard's hidden store (the config's compression, else its store dtype's)."""
    tokens = token_shards.validate(workdir / f"{RESULTS}/tokens/shard-{shard}.zarr")["num_tokens"]
    per_token = plan.hidden_bytes_per_token(SMOLLM2_HIDDEN_SIZE, config["plan"].get("expected_compression"),
                                            config["extract"].get("store_dtype", "bfloat16"))[1]
    return int(tokens * per_token)


@pytest.fixture
def tokenized(tmp_path, target_dir):
    """Token shards and the draft vocab built; a budget that holds the held-out store and one training shard's
    store (35 % to spare) but not both: two windows of one shard, two epochs."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    config = tiny_run_config(workdir, target_dir)
    config["train"] = {**config["train"], "epochs": 2, "checkpoint_every": 2}
    run_snakemake(workdir, config, *(f"{RESULTS}/tokens/shard-{s}.zarr" for s in ("00000", "00001", "heldout")),
                  f"{RESULTS}/vocab/draft_vocab.safetensors")
    shards = [planned_bytes(workdir, s, config) for s in ("00000", "00001")]
    heldout = planned_bytes(workdir, "heldout", config)
    budget = heldout + int(1.35 * max(shards))
    assert budget < heldout + sum(shards)
    config["plan"] = {**config["plan"], "disk_budget_gb": budget / 1e9}
    return workdir, config, budget, heldout + max(shards)


def jobs_run(output: str, rule: str) -> list[str]:
    """The wildcards of each `rule` job a run (or dry run) lists, in order."""
    return re.findall(rf"rule {rule}:\n(?:    .*\n)*?    wildcards: (.*)\n", output)


def test_a_budget_below_the_stores_trains_in_windows_and_a_killed_pass_resumes(tokenized):
    workdir, config, budget, heldout_and_largest = tokenized
    dry = run_snakemake(workdir, config, WEIGHTS, DISK_REPORT, "-n")
    text = dry.stdout + dry.stderr
    for line in ("2 windows of consecutive shards", "w0: shard 00000", "w1: shard 00001", "4 passes over 2 epochs",
                 "3 extraction groups", "extra extraction work: 1.50x (3 window extractions for 2 windows)",
                 "token counts exact"):
        assert line in text, line
    assert f"peak hidden-store disk: {plan.human_bytes(heldout_and_largest)}" in text
    assert f"vs budget {plan.human_bytes(budget)}" in text
    assert len(jobs_run(text, "extract_window")) == 3 and len(jobs_run(text, "train_pass")) == 4
    assert re.search(r"rule extract_window:\n(?:    .*\n)*?    resources: .*disk_mb=\d+", text)

    passes = workdir / f"{RESULTS}/train_state/passes"
    periodic = workdir / f"{RESULTS}/train_state/checkpoint.pt"
    second_pass = workdir / f"{RESULTS}/reports/windows/pass-001.json"

    def inside_the_second_pass() -> bool:  # its record is written as it starts; then a periodic checkpoint
        try:
            return periodic.stat().st_mtime_ns > second_pass.stat().st_mtime_ns
        except FileNotFoundError:
            return False

    process = start_snakemake(workdir, config, WEIGHTS, DISK_REPORT)
    kill_when(process, "a periodic checkpoint inside the second pass", inside_the_second_pass)
    assert inside_the_second_pass() and not (passes / "pass-001.pt").exists(), "the kill did not land in pass 1"

    run_snakemake(workdir, config, "--unlock")
    rerun = run_snakemake(workdir, config, WEIGHTS, DISK_REPORT)
    output = rerun.stdout + rerun.stderr
    assert jobs_run(output, "train_pass") == ["index=001", "index=002", "index=003"]  # pass 0 is not redone
    assert jobs_run(output, "extract_window") == ["group=2, shard=00000"]  # x1 survived the kill; x0 was consumed
    assert "resuming from" in (workdir / "logs/tiny/train_passes/pass-001.log").read_text()

    records = [json.loads((workdir / f"{RESULTS}/reports/windows/pass-{i:03d}.json").read_text()) for i in range(4)]
    assert all(0 < r["on_disk_bytes"] <= budget for r in records), [r["on_disk_bytes"] for r in records]
    report = json.loads((workdir / DISK_REPORT).read_text())
    assert report["windows"]["within_budget"] and set(report["shards"]) == {"shard-00000.zarr", "shard-00001.zarr"}
    assert (workdir / WEIGHTS).is_file()
    assert not list((workdir / f"{RESULTS}/hidden_windows").rglob("*.zarr")) and not list(passes.glob("*.pt"))

    again = run_snakemake(workdir, config, WEIGHTS, DISK_REPORT)
    assert "Nothing to be done" in again.stdout + again.stderr
