"""Trained drafter weights (safetensors): the `train` rule's `train/drafter.safetensors` and the held-out
selection's `train_state/best.safetensors`.

Both hold the drafter's trainable tensors by the names training gives them (`fc.weight`, `midlayer.*`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`; never the frozen embedding, which comes from the target). Metadata:
  trained weights  `drafter_config`: the DrafterConfig as JSON (enough to rebuild the model)
  best weights     `step` (the training step they were taken at) and `tau` (its estimated acceptance, repr)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eagle3_pipeline.formats.atomic import atomic_file

if TYPE_CHECKING:
    import torch

BEST_WEIGHTS_FILE = "best.safetensors"  # in train_state/
CONFIG_KEY = "drafter_config"


class InvalidWeights(ValueError):
    pass


def write_trained(path: Path, weights: dict[str, torch.Tensor], drafter_config: dict[str, Any]) -> None:
    with atomic_file(Path(path)) as partial:
        save_file(weights, str(partial), metadata={CONFIG_KEY: json.dumps(drafter_config)})


def read_trained(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(drafter config as a dict, weights) of the training rule's output."""
    with safe_open(str(path), framework="pt") as handle:
        config = json.loads(handle.metadata()[CONFIG_KEY])
    return config, load_file(str(path))


def write_best(path: Path, weights: dict[str, torch.Tensor], step: int, tau: float) -> None:
    with atomic_file(Path(path)) as partial:
        save_file(weights, str(partial), metadata={"step": str(step), "tau": repr(tau)})


def read_best(path: Path) -> tuple[int, float] | None:
    """(step, estimated tau) recorded in the kept weights' metadata, or None when there are none."""
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    return int(meta["step"]), float(meta["tau"])


def read_weights(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    return load_file(str(path), device=device)


def validate(path: Path, metadata_keys: tuple[str, ...] = (CONFIG_KEY,)) -> dict[str, str]:
    """Raise InvalidWeights naming the file and reason unless it is readable safetensors with the given
    metadata keys (trained weights: the drafter config; best weights: pass ("step", "tau")); return it."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            names = list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise InvalidWeights(f"{path}: not a readable safetensors file ({exc})") from None
    missing = [key for key in metadata_keys if key not in meta]
    if missing or not names:
        raise InvalidWeights(f"{path}: {'metadata ' + str(missing) + ' missing' if missing else 'no tensors'}")
    return meta
