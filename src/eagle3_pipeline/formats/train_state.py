"""Training state (`results/<run>/train_state/`, outside Snakemake's outputs so a dead job keeps it).

`checkpoint.pt`   torch.save of {"model": trainable weights, "optimizer", "scheduler", "rng", "step",
                  "settings"}; read with weights_only=True (a checkpoint is data, never code).
`fingerprint.json` what the checkpoint beside it was trained on (settings that change the weights, world
                  size, store identities, vocab and target hashes); a resume needs it to match this run.
The metrics CSVs and the best weights beside them: formats/metrics, formats/drafter_weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.formats.atomic import atomic_file, atomic_write

CHECKPOINT_FILE = "checkpoint.pt"
FINGERPRINT_FILE = "fingerprint.json"  # what the checkpoint beside it was trained on
CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "rng", "step", "settings")


class InvalidCheckpoint(ValueError):
    pass


def write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    import torch

    with atomic_file(Path(path)) as partial:
        torch.save(state, partial)


def read_checkpoint(path: Path) -> dict[str, Any]:
    import torch

    # weights_only: a checkpoint is data, never code
    return torch.load(path, map_location="cpu", weights_only=True)


def validate_checkpoint(path: Path) -> dict[str, Any]:
    """Raise InvalidCheckpoint naming the file and reason unless it loads and holds every part; return it."""
    try:
        state = read_checkpoint(path)
    except Exception as exc:  # torch raises several types for a torn or foreign file
        raise InvalidCheckpoint(f"{path}: unreadable checkpoint ({type(exc).__name__}: {str(exc)[:200]})") from None
    missing = [key for key in CHECKPOINT_KEYS if key not in state]
    if missing:
        raise InvalidCheckpoint(f"{path}: checkpoint lacks {missing}")
    return state


def write_fingerprint(state_dir: Path, fingerprint: dict[str, Any]) -> None:
    atomic_write(Path(state_dir) / FINGERPRINT_FILE, json.dumps(fingerprint, indent=1))


def read_fingerprint(state_dir: Path) -> dict[str, Any] | None:
    """The recorded fingerprint, or None when there is none (a checkpoint from an older version)."""
    path = Path(state_dir) / FINGERPRINT_FILE
    return json.loads(path.read_text()) if path.is_file() else None
