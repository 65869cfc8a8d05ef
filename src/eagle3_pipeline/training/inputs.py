"""What a training run is given besides its settings: the data it trains on and, under a disk budget, the pass
of the window schedule it runs (the loop, resume and windows modules all read them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.drafter.batches import BatchSchedule


@dataclass(frozen=True)
class TrainingData:
    """What a run trains on: its batch schedule, the stores' aux layers, and its fingerprint (what decides the
    weights; a checkpoint is resumed only under the same one)."""
    schedule: BatchSchedule
    aux_layer_ids: list[int]
    fingerprint: dict[str, Any]


@dataclass(frozen=True)
class PassJob:
    """One pass of training under a disk budget (segment `index` of the schedule), from the checkpoint the pass
    before ended with (`previous`; None for the first pass) to `output`."""
    index: int
    previous: Path | None
    output: Path
