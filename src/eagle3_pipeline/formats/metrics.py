"""Training metrics: `train_state/metrics.csv` (one row per logging window), `train_state/heldout_estimate.csv`
(one row per epoch: step, epoch, tau_k1.., accuracy per chain step) and the train rule's `train/summary.json`.

The CSVs are appended a row at a time (header first); a resume truncates rows logged after its checkpoint.
Every value reads back as a float. summary.json: steps, final_loss, acc_per_step,
expected_acceptance_per_step, train_seconds (wall time of the job that finished training), device (the GPU's
model or "CPU, N threads") and, with a held-out split, heldout_estimate {by_epoch, kept, selected_by}.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.formats.atomic import atomic_write

METRICS_FILE = "metrics.csv"
HELDOUT_FILE = "heldout_estimate.csv"
SUMMARY_KEYS = ("steps", "final_loss", "acc_per_step", "expected_acceptance_per_step")


class InvalidMetrics(ValueError):
    pass


def append_row(path: Path, row: dict[str, float]) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


def truncate(path: Path, step: int) -> None:
    """Drop metric rows logged after the checkpoint being resumed (they will be logged again)."""
    if not path.exists():
        return
    with open(path, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if float(r["step"]) <= step]
    path.unlink()
    for row in rows:
        append_row(path, row)


def read(path: Path) -> list[dict[str, float]]:
    with open(path, newline="") as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def validate(path: Path) -> list[dict[str, float]]:
    """Raise InvalidMetrics naming file, row and reason unless every row has a step and numbers only."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames or "step" not in reader.fieldnames:
            raise InvalidMetrics(f"{path}: no header with a step column")
        rows = []
        for number, row in enumerate(reader, start=2):
            try:
                rows.append({k: float(v) for k, v in row.items()})
            except (TypeError, ValueError):
                raise InvalidMetrics(f"{path} line {number}: a missing or non-numeric value") from None
    return rows


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    atomic_write(Path(path), json.dumps(summary, indent=2))


def read_summary(path: Path) -> dict[str, Any]:
    summary = json.loads(Path(path).read_text())
    missing = [key for key in SUMMARY_KEYS if key not in summary]
    if missing:
        raise InvalidMetrics(f"{path}: training summary lacks {missing}")
    return summary
