"""What a training checkpoint may be resumed for: the run's fingerprint (settings that change the weights,
world size, store, vocab and target identities), the checkpoint with its RNG states, and starting over."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.formats import draft_vocab, drafter_weights, hidden_store, metrics, train_state
from eagle3_pipeline.formats.target_dir import content_hash

if TYPE_CHECKING:
    from eagle3_pipeline.stages.train import TrainSettings

log = logging.getLogger("eagle3_pipeline.stages.train")
NOT_FINGERPRINTED = frozenset({"log_every", "checkpoint_every", "num_workers"})  # do not change the weights


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, model: Drafter, optimizer, scheduler, step: int, settings: TrainSettings) -> None:
    train_state.write_checkpoint(path, {"model": model.trainable_state_dict(), "optimizer": optimizer.state_dict(),
                                        "scheduler": scheduler.state_dict(), "rng": rng_state(), "step": step,
                                        "settings": asdict(settings)})


def run_fingerprint(store_paths: list[Path], target_dir: Path, vocab_path: Path, settings: TrainSettings,
                    world_size: int) -> dict[str, Any]:
    """Everything that decides the trained weights: the settings that change them, the world size, each
    hidden store's content identity, the draft vocab's and the target's content hashes."""
    fingerprint = {
        "settings": {k: v for k, v in asdict(settings).items() if k not in NOT_FINGERPRINTED},
        "world_size": world_size,
        "stores": [{"name": Path(p).name, "identity": hidden_store.identity(p)} for p in store_paths],
        "draft_vocab": draft_vocab.identity(Path(vocab_path)),
        "target": content_hash(target_dir),  # hashed here for a hand-made target directory
    }
    return json.loads(json.dumps(fingerprint))  # as read back from the file (lists, not tuples)


def fingerprint_changes(recorded: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """What differs between the fingerprint a checkpoint was written under and this run's, in words."""
    if recorded is None:
        return ["no fingerprint recorded (written by an older version)"]
    changes = [f"train.{key}: {recorded['settings'].get(key)!r} -> {value!r}"
               for key, value in current["settings"].items() if recorded["settings"].get(key) != value]
    if recorded["world_size"] != current["world_size"]:
        changes.append(f"world size: {recorded['world_size']} -> {current['world_size']}")
    if [s["name"] for s in recorded["stores"]] != [s["name"] for s in current["stores"]]:
        changes.append(f"hidden stores: {len(recorded['stores'])} -> {len(current['stores'])}")
    else:
        changes += [f"hidden store {new['name']} content" for old, new in
                    zip(recorded["stores"], current["stores"], strict=True) if old != new]
    changes += [f"{what} content" for key, what in (("draft_vocab", "draft vocab"), ("target", "target model"))
                if recorded[key] != current[key]]
    return changes


def resumable_checkpoint(state_dir: Path, fingerprint: dict[str, Any], steps_total: int) -> dict[str, Any] | None:
    """The checkpoint to resume from, or None: none there, one trained on anything else (logged, naming
    what changed), or the last step of a finished run (the job running again means `-R` or new inputs)."""
    checkpoint_path = state_dir / train_state.CHECKPOINT_FILE
    if not checkpoint_path.exists():
        return None
    recorded = train_state.read_fingerprint(state_dir)
    changes = fingerprint_changes(recorded, fingerprint)
    if changes:
        log.warning("not resuming %s, changed since it was written: %s; training from step 0", checkpoint_path,
                    "; ".join(changes))
        return None
    checkpoint = train_state.read_checkpoint(checkpoint_path)
    if checkpoint["step"] >= steps_total:
        log.warning("not resuming %s: it is the end of a finished run (step %d of %d) and the job runs again "
                    "(forced with -R, or its outputs are gone); training from step 0", checkpoint_path,
                    checkpoint["step"], steps_total)
        return None
    return checkpoint


def start_fresh(state_dir: Path, fingerprint: dict[str, Any]) -> None:
    """Discard an earlier run's checkpoint, metrics and held-out selection, then record what the coming
    checkpoints are of."""
    for name in (train_state.CHECKPOINT_FILE, metrics.METRICS_FILE, metrics.HELDOUT_FILE,
                 drafter_weights.BEST_WEIGHTS_FILE):
        (state_dir / name).unlink(missing_ok=True)
    train_state.write_fingerprint(state_dir, fingerprint)
