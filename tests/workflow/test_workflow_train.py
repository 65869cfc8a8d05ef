"""Training through the real snakemake CLI: what a rerun resumes, retrains, and refuses.

Each test works on a copy of the shared finished tiny run (file times and Snakemake's metadata included) without
its training outputs, so it starts where the training stage would: target, data and extraction done."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from eagle3_pipeline import plan
from eagle3_pipeline.formats import hidden_store
from tests.conftest import flip_bytes_inside_a_chunk, run_snakemake
from tests.workflow.conftest import TinyRun, copy_run, kill_when, start_snakemake

pytestmark = [pytest.mark.workflow, pytest.mark.slow]  # each test needs the finished tiny run
WEIGHTS = "results/tiny/train/drafter.safetensors"
STATE = "results/tiny/train_state"
LOG = "logs/tiny/train.log"
TRAINING_OUTPUTS = ("results/tiny/train", STATE, LOG)


@pytest.fixture
def prepared(finished_tiny_run) -> TinyRun:
    """The finished run, its config set to train for ~18 steps (training settings only: nothing upstream reruns)."""
    config = {**finished_tiny_run.config}
    config["train"] = {**config["train"], "epochs": 1, "batch_tokens": 256, "checkpoint_every": 3}
    return TinyRun(finished_tiny_run.workdir, config)


def copy_of(prepared: TinyRun, tmp_path) -> TinyRun:
    """A copy of the prepared run without its training outputs (the hidden stores and draft vocab kept)."""
    return copy_run(prepared, tmp_path / "run", drop=TRAINING_OUTPUTS)


def weights(workdir) -> dict[str, torch.Tensor]:
    return load_file(str(workdir / WEIGHTS))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_changed_settings_retrain_and_minus_r_trains_from_step_0(prepared, finished_tiny_run, tmp_path):
    # the finished run's training state kept: its checkpoint was written with other settings
    workdir, config = copy_run(prepared, tmp_path / "run", drop=("results/tiny/train", LOG))
    old_rate = config["train"]["learning_rate"]
    config["train"] = {**config["train"], "learning_rate": 1e-3, "seed": 1}
    first = run_snakemake(workdir, config, WEIGHTS)
    assert "rule train" in first.stdout + first.stderr and "rule extract" not in first.stdout + first.stderr
    log = (workdir / LOG).read_text()
    assert "changed since it was written: " in log and "training from step 0" in log and "step 1/" in log
    assert f"train.learning_rate: {old_rate!r} -> 0.001" in log and "train.seed: 0 -> 1" in log
    changed = weights(workdir)
    assert not same(weights(finished_tiny_run.workdir), changed)

    forced = run_snakemake(workdir, config, WEIGHTS, "-R", "train")
    assert "rule train" in forced.stdout + forced.stderr
    log = (workdir / LOG).read_text()
    assert "it is the end of a finished run" in log
    assert same(changed, weights(workdir))  # trained again from scratch, deterministically


def test_a_jobs_size_reruns_nothing_but_a_training_setting_retrains(finished_tiny_run, tmp_path):
    workdir, config = copy_run(finished_tiny_run, tmp_path / "run")
    sized = {section: {**config[section], **sizes} for section, sizes in {
        "extract": {"threads": 1, "writer_threads": 3}, "parity": {"threads": 1},
        # teacher_temperature 1.0, head_init random and off_path_weight 1.0 train as before the settings existed:
        # not in the run's params
        "train": {"threads": 1, "num_workers": 1, "log_every": 7, "checkpoint_every": 11, "teacher_temperature": 1.0,
                  "head_init": "random", "off_path_weight": 1.0},
        "evaluate": {"threads": 1}}.items()}
    planned = set(re.findall(r"^rule (\w+):", run_snakemake(workdir, config | sized, "-n").stdout, flags=re.M))
    assert planned <= {"plots", "all"}  # the report's page lists the whole config: seconds to redraw
    sharpened = {**sized, "train": {**sized["train"], "teacher_temperature": 0.5}}
    assert "train" in set(re.findall(r"^rule (\w+):", run_snakemake(workdir, config | sharpened, "-n").stdout,
                                     flags=re.M))
    sized["train"]["learning_rate"] = 2.0e-3
    planned = set(re.findall(r"^rule (\w+):", run_snakemake(workdir, config | sized, "-n").stdout, flags=re.M))
    assert "train" in planned and "extract" not in planned


def test_a_killed_training_resumes_bit_identically(prepared, tmp_path):
    interrupted, config = copy_of(prepared, tmp_path / "interrupted")
    straight, _ = copy_of(prepared, tmp_path / "straight")
    # One CPU thread: a multi-threaded CPU reduction splits its sum by thread count, so two straight runs
    # already differ in the last bit when the effective count differs (seen once in four CI runs).
    config["train"] = {**config["train"], "threads": 1}
    checkpoint = interrupted / STATE / "checkpoint.pt"
    process = start_snakemake(interrupted, config, WEIGHTS)
    kill_when(process, f"the first training checkpoint ({STATE}/checkpoint.pt)", checkpoint.exists)
    assert checkpoint.exists() and not (interrupted / WEIGHTS).exists(), "the kill did not land during training"

    run_snakemake(interrupted, config, "--unlock")
    run_snakemake(interrupted, config, WEIGHTS)
    log = (interrupted / LOG).read_text()
    assert "resuming from" in log and "training from step 0" not in log
    run_snakemake(straight, config, WEIGHTS)
    assert same(weights(interrupted), weights(straight))
    assert (interrupted / "results/tiny/train/metrics.csv").read_text().count("\n") == \
        (straight / "results/tiny/train/metrics.csv").read_text().count("\n")


def test_a_corrupt_chunk_stops_training_naming_store_array_and_chunk(prepared, tmp_path):
    workdir, config = copy_of(prepared, tmp_path)
    store = workdir / "results/tiny/hidden/shard-00001.zarr"
    attrs = hidden_store.validate(store)
    chunk = flip_bytes_inside_a_chunk(store / "aux_hidden_states", 0, attrs["rows_per_shard"] // attrs["chunk_rows"])
    result = run_snakemake(workdir, config, WEIGHTS, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and not (workdir / WEIGHTS).exists()
    line = (f"training stopped: {store.relative_to(workdir)}: array aux_hidden_states, chunk {chunk} (rows "
            f"{chunk * attrs['chunk_rows']}-")
    assert line in output and "(checksum mismatch); delete the store" in output
    assert line in (workdir / LOG).read_text()
    assert "Traceback" not in output


def test_fp8_stores_re_extract_and_train_at_about_0_6x_the_bytes(prepared, tmp_path):
    """Switching extract.store_dtype re-extracts every store (the store's params changed) and trains on the
    fp8 stores; the disk plan follows the store dtype."""
    workdir, config = copy_of(prepared, tmp_path)
    stores = ["results/tiny/hidden/shard-00000.zarr", "results/tiny/hidden/shard-00001.zarr"]
    bf16_bytes = sum(hidden_store.zarr_io.directory_bytes(workdir / s) for s in stores)
    config["extract"] = {**config["extract"], "store_dtype": "float8_e4m3fn"}
    run_snakemake(workdir, config, WEIGHTS, "results/tiny/reports/disk_plan_vs_actual.json")
    fp8_bytes = sum(hidden_store.zarr_io.directory_bytes(workdir / s) for s in stores)
    assert all(hidden_store.validate(workdir / s)["hidden_dtype"] == "float8_e4m3fn" for s in stores)
    assert 0.5 < fp8_bytes / bf16_bytes < 0.68
    report = json.loads((workdir / "results/tiny/reports/disk_plan_vs_actual.json").read_text())
    # the plan follows the store dtype (tiny conversations repeat the system prompt's states, which compress
    # better than real data's: planned and actual bytes agree within 10 % on real data, not on these)
    row = report["shards"]["shard-00000.zarr"]
    bf16_planned = row["tokens"] * plan.hidden_bytes_per_token(576, None, "bfloat16")[1]
    assert row["store_dtype"] == "float8_e4m3fn" and 0.55 < row["planned_bytes"] / bf16_planned < 0.65
    assert "stored as float8_e4m3fn" in (workdir / "logs/tiny/extract/shard-00000.log").read_text()
    assert weights(workdir)["fc.weight"].isfinite().all()
