"""Extraction through the real snakemake CLI: disk plan, kill + resume, plan vs actual, refusal.

The data stage runs once for the module (`tokenized`); each test that extracts works on a copy of it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3_pipeline.formats import hidden_store, zarr_io
from tests.conftest import base_config, run_snakemake
from tests.workflow.conftest import (
    TinyRun,
    copy_run,
    incomplete_marker,
    json_file,
    kill_when,
    start_snakemake,
    tiny_dataset,
)

pytestmark = pytest.mark.workflow
STORES = ["results/tiny/hidden/shard-00000.zarr", "results/tiny/hidden/shard-00001.zarr"]


def extract_config(workdir, target_dir, **plan):
    tiny_dataset(workdir / "chats.json")
    return base_config(
        run="tiny", target={"source": str(target_dir)},
        data={"inputs": [str(workdir / "chats.json")], "num_shards": 2, "train_conversations": None,
              "eval_conversations": 4, "max_seq_len": 256},
        vocab={"draft_vocab_size": 500},
        extract={"token_budget": 256, "store_shard_mb": 1, "threads": 1, "writer_threads": 2},
        plan={"expected_compression": 1.4, "allow_exceeding_free_space": False, **plan})


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, target_dir) -> TinyRun:
    """A workdir where `extract_config`'s data stage has run: the token shards extraction reads."""
    workdir = tmp_path_factory.mktemp("tokenized")
    config = extract_config(workdir, target_dir)
    run_snakemake(workdir, config, *[s.replace("hidden", "tokens") for s in STORES])
    return TinyRun(workdir, config)


def test_dry_run_prints_the_disk_plan_estimate_then_exact(tmp_path, target_dir, tokenized):
    config = extract_config(tmp_path, target_dir)
    before = run_snakemake(tmp_path, config, "-n")
    text = before.stderr + before.stdout
    assert "Disk plan" in text and text.index("Disk plan") < text.index("Job stats")
    assert "estimate" in text and "fits" in text
    assert "extract" in text and "disk_mb=" in text
    after = run_snakemake(tokenized.workdir, tokenized.config, "-n")  # the same config, its token shards written
    hidden_line = next(line for line in after.stderr.splitlines() if line.strip().startswith("hidden"))
    assert hidden_line.rstrip().endswith("exact")


@pytest.mark.slow
def test_killed_extraction_resumes_and_matches_an_uninterrupted_run(tmp_path, tokenized):
    interrupted, config = copy_run(tokenized, tmp_path / "interrupted")
    clean, clean_config = copy_run(tokenized, tmp_path / "clean")
    process = start_snakemake(interrupted, config, "--cores", "1", *STORES)
    caught: dict[str, object] = {}

    def one_store_done_and_the_other_partly_written() -> bool:
        done = [s for s in STORES if (interrupted / s).exists() and not incomplete_marker(interrupted, s).exists()]
        if done:
            caught.setdefault("first_done", done[0])
        if "first_done" in caught:
            other = next(s for s in STORES if s != caught["first_done"])
            progress = json_file(interrupted / (other + ".partial") / "progress.json")
            if progress and progress["rows_written"] > 0:
                caught["partial_progress"] = progress["rows_written"]
        return "partial_progress" in caught

    kill_when(process, "one finished store and rows written to the other",
              one_store_done_and_the_other_partly_written)
    first_done = caught.get("first_done")
    assert first_done and caught.get("partial_progress"), "did not catch the run between shards"
    other = next(s for s in STORES if s != first_done)
    assert not (interrupted / other).exists()
    finished_files = {f: f.stat().st_mtime_ns for f in (interrupted / first_done).rglob("*") if f.is_file()}

    run_snakemake(interrupted, config, "--unlock")
    run_snakemake(interrupted, config, *STORES)
    assert {f: f.stat().st_mtime_ns for f in (interrupted / first_done).rglob("*") if f.is_file()} == finished_files
    log = (interrupted / "logs" / "tiny" / "extract" / f"{other.split('/')[-1][:-5]}.log").read_text()
    assert "resuming" in log and "tokens/s" in log and "ETA" in log

    run_snakemake(clean, clean_config, *STORES)
    for store in STORES:
        hidden_store.validate(interrupted / store)
        for name in ("aux_hidden_states", "last_hidden_states", "input_ids", "loss_mask", "seq_offsets"):
            a = zarr_io.open_readonly(interrupted / store)[name][...]
            b = zarr_io.open_readonly(clean / store)[name][...]
            assert np.array_equal(a, b), f"{store}/{name} differs from the uninterrupted run"

    run_snakemake(clean, clean_config, "results/tiny/reports/disk_plan_vs_actual.json")
    report = json.loads((clean / "results/tiny/reports/disk_plan_vs_actual.json").read_text())
    for name, row in report["shards"].items():
        assert row["actual_bytes"] == zarr_io.directory_bytes(clean / "results/tiny/hidden" / name)
        assert 0.5 < row["actual_over_planned"] < 1.5  # tiny stores: metadata files weigh more than at scale
        assert row["raw_bytes"] > row["actual_bytes"]


def test_real_run_refuses_to_start_when_the_plan_exceeds_free_space(tmp_path, target_dir):
    config = extract_config(tmp_path, target_dir, expected_compression=1e-9)
    result = run_snakemake(tmp_path, config, check=False)
    assert result.returncode != 0
    assert "DOES NOT FIT" in result.stderr and "Refusing to start" in result.stderr
    assert not (tmp_path / "results").exists()
    dry = run_snakemake(tmp_path, config, "-n")  # a dry run only reports
    assert "DOES NOT FIT" in dry.stderr
