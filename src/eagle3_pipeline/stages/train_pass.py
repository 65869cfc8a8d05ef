"""Rule `train_pass` (training under a disk budget, rules/windows.smk): one pass over one window's stores, from
the previous pass's checkpoint to this pass's (rule `train` then publishes the last one). The training itself is
training/windows.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline import logs
from eagle3_pipeline.formats import reports, zarr_io
from eagle3_pipeline.plan import human_bytes
from eagle3_pipeline.plan_windows import GB
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.training.inputs import PassJob
from eagle3_pipeline.training.loop import DATA_ERRORS, data_error_line
from eagle3_pipeline.training.settings import TrainSettings
from eagle3_pipeline.training.windows import Windows, train_pass

STORE_BYTES_LINE = "hidden stores on disk at the start of pass"  # the line the budget's workflow test reads


def remove_stale_stores(log: logging.Logger, windows_dir: Path, stores: tuple[Path, ...]) -> None:
    """Delete window stores other than this pass's: the window before was consumed (Snakemake deleted it) and
    the next is extracted only after this pass, so any other store was left by an earlier window plan (the
    token counts changed it) or a killed extraction, and no rule would ever delete it."""
    keep = {Path(p).resolve() for p in stores}
    for path in sorted(windows_dir.glob("x*/shard-*")) if windows_dir.is_dir() else []:
        if path.resolve() not in keep:
            log.warning("removing %s: not a store of this pass's window (left by an earlier plan or run)", path)
            shutil.rmtree(path)


def record_disk(log: logging.Logger, index: int, stores: tuple[Path, ...], windows_dir: Path, heldout: list[Path],
                budget_bytes: int, output: Path) -> dict[str, Any]:
    """Write (and log) what the budget bounds, as this pass starts: the hidden-store bytes on disk (every
    window's directory and the held-out stores) and the size of each of this pass's stores."""
    windowed = zarr_io.directory_bytes(windows_dir) if windows_dir.is_dir() else 0
    held_out = sum(zarr_io.directory_bytes(p) for p in heldout)
    record = {"pass": index, "on_disk_bytes": windowed + held_out, "windows_bytes": windowed,
              "heldout_bytes": held_out, "budget_bytes": budget_bytes,
              "stores": {path.name.removeprefix("shard-").removesuffix(".zarr"):
                         {"bytes": zarr_io.directory_bytes(path), "hidden_size": zarr_io.attrs(path)["hidden_size"]}
                         for path in stores}}
    log.info("%s %d: %d bytes (windows %s, held-out %s; budget %s)", STORE_BYTES_LINE, index,
             record["on_disk_bytes"], human_bytes(windowed), human_bytes(held_out), human_bytes(budget_bytes))
    reports.write(output, record)
    return record


def run_from_snakemake(snakemake: Any) -> None:
    params = snakemake.params
    state_dir = Path(params.state_dir)
    log = logs.setup(snakemake.log[0], name="train", history=state_dir / "train.log")
    torch.set_num_threads(snakemake.threads)
    index = int(snakemake.wildcards.index)
    heldout = [Path(p) for p in snakemake.input.heldout]
    budget_bytes = int(snakemake.config["plan"]["disk_budget_gb"] * GB)
    remove_stale_stores(log, Path(params.windows_dir), tuple(Path(p) for p in snakemake.input.stores))
    record_disk(log, index, tuple(Path(p) for p in snakemake.input.stores), Path(params.windows_dir), heldout,
                budget_bytes, Path(snakemake.output.record))
    windows = Windows(params.windows["windows"], params.windows["passes"],
                      dict(zip(params.shards, (Path(p) for p in snakemake.input.tokens), strict=True)),
                      params.window_store)
    previous = Path(snakemake.input.previous) if hasattr(snakemake.input, "previous") else None
    try:
        train_pass(windows, PassJob(index, previous, Path(snakemake.output.checkpoint)), heldout, dict(params.extract),
                   Path(snakemake.input.target), Path(snakemake.input.vocab), state_dir,
                   from_section(TrainSettings, snakemake.config["train"]))
    except DATA_ERRORS as error:
        log.error("training stopped: %s", data_error_line(error))
        raise SystemExit(1) from None
