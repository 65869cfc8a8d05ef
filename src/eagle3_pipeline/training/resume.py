"""What a training checkpoint may be resumed for: the run's fingerprint (settings that change the weights,
world size, store, vocab and target identities), the checkpoint with its RNG states, and starting over; under a
disk budget, the checkpoint a pass starts from (its own periodic one after a kill, else the pass before's)."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.formats import draft_vocab, drafter_weights, hidden_store, metrics, token_shards, train_state
from eagle3_pipeline.formats.target_dir import content_hash
from eagle3_pipeline.training.inputs import PassJob, TrainingData
from eagle3_pipeline.training.settings import TrainSettings

log = logging.getLogger("eagle3_pipeline.stages.train")


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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
                                        "settings": asdict(settings),
                                        "aux_layer_ids": list(model.config.aux_layer_ids)})


def run_fingerprint(store_paths: list[Path], target_dir: Path, vocab_path: Path, settings: TrainSettings,
                    world_size: int) -> dict[str, Any]:
    """Everything that decides the trained weights: the settings that change them, the world size, each
    hidden store's content identity, the draft vocab's and the target's content hashes."""
    fingerprint = {
        "settings": {k: v for k, v in asdict(settings).items() if TrainSettings.shapes_weights(k, v)},
        "world_size": world_size,
        "stores": [{"name": Path(p).name, "identity": hidden_store.identity(p)} for p in store_paths],
        "draft_vocab": draft_vocab.identity(Path(vocab_path)),
        "target": content_hash(target_dir),  # hashed here for a hand-made target directory
    }
    return json.loads(json.dumps(fingerprint))  # as read back from the file (lists, not tuples)


def windowed_fingerprint(token_paths: list[Path], heldout_paths: list[Path], extract: dict[str, Any],
                         windows: dict[str, Any], target_dir: Path, vocab_path: Path, settings: TrainSettings
                         ) -> dict[str, Any]:
    """The fingerprint of training under a disk budget: the windows' stores never all exist, so what they hold
    is named by their token shards' identities and the extract settings (the target's hash is there already),
    and the window plan (windows and pass order) joins the settings."""
    fingerprint = run_fingerprint(heldout_paths, target_dir, vocab_path, settings, 1)
    fingerprint["stores"] += [{"name": Path(p).name, "identity": token_shards.identity(p)} for p in token_paths]
    return fingerprint | json.loads(json.dumps({"extract": extract, "windows": windows}))


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
    changes += [f"{what}" for key, what in (("extract", "extract settings"), ("windows", "window plan"))
                if recorded.get(key) != current.get(key)]
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
    checkpoint = train_state.read_checkpoint(checkpoint_path) | {"path": checkpoint_path}
    if checkpoint["step"] >= steps_total:
        log.warning("not resuming %s: it is the end of a finished run (step %d of %d) and the job runs again "
                    "(forced with -R, or its outputs are gone); training from step 0", checkpoint_path,
                    checkpoint["step"], steps_total)
        return None
    return checkpoint


def pass_checkpoint(state_dir: Path, fingerprint: dict[str, Any], first: int, last: int, previous: Path | None
                    ) -> dict[str, Any] | None:
    """The checkpoint a pass over steps first+1..last starts from: the state dir's periodic one when it lies
    inside the pass (the pass was killed), else the one the pass before ended with; None for a fresh start."""
    periodic = state_dir / train_state.CHECKPOINT_FILE
    if periodic.exists() and train_state.read_fingerprint(state_dir) == fingerprint:
        checkpoint = train_state.read_checkpoint(periodic) | {"path": periodic}
        if first < checkpoint["step"] < last:
            return checkpoint
    if previous is None:
        return None
    checkpoint = train_state.validate_checkpoint(previous) | {"path": previous}
    if checkpoint["step"] != first:
        raise train_state.InvalidCheckpoint(f"{previous}: ends at step {checkpoint['step']}, the pass after it "
                                            f"starts at {first}; delete it to retrain from the pass before")
    if train_state.read_fingerprint(state_dir) != fingerprint:  # the periodic checkpoints to come are of this run
        train_state.write_fingerprint(state_dir, fingerprint)
    return checkpoint


def start_fresh(state_dir: Path, fingerprint: dict[str, Any]) -> None:
    """Discard an earlier run's checkpoint, metrics and held-out selection, then record what the coming
    checkpoints are of."""
    for name in (train_state.CHECKPOINT_FILE, metrics.METRICS_FILE, metrics.HELDOUT_FILE,
                 drafter_weights.BEST_WEIGHTS_FILE):
        (state_dir / name).unlink(missing_ok=True)
    train_state.write_fingerprint(state_dir, fingerprint)


def starting_point(state_dir: Path, data: TrainingData, pass_job: PassJob | None, steps_total: int,
                   training: tuple[Drafter, Any, Any]) -> tuple[int, int, Path]:
    """(first step, step to stop at, where the last step's checkpoint goes), with the state to start from
    loaded into (model, optimizer, scheduler): the whole run's, or one pass's under a disk budget."""
    if pass_job is None:
        start = resume(state_dir, resumable_checkpoint(state_dir, data.fingerprint, steps_total), data.fingerprint,
                       *training)
        return start, steps_total, state_dir / train_state.CHECKPOINT_FILE
    if dist.is_initialized():
        raise ValueError("training in windows (plan.disk_budget_gb) runs in one process (train.gpus <= 1)")
    ends = [0, *data.schedule.segment_ends]  # one process: step s trains batch s - 1
    first, last = min(ends[pass_job.index], steps_total), min(ends[pass_job.index + 1], steps_total)
    checkpoint = pass_checkpoint(state_dir, data.fingerprint, first, last, pass_job.previous)
    start = resume(state_dir, checkpoint, data.fingerprint, *training)
    log.info("pass %d trains steps %d-%d of %d", pass_job.index, first + 1, last, steps_total)
    return start, last, pass_job.output


def resume(state_dir: Path, checkpoint: dict[str, Any] | None, fingerprint: dict[str, Any], model: Drafter,
           optimizer: Any, scheduler: Any) -> int:
    """The step to start from: the checkpoint's, loaded into model, optimizer, scheduler and RNGs, or 0."""
    metrics_path = state_dir / metrics.METRICS_FILE
    start = 0
    if dist.is_initialized():
        dist.barrier()  # every rank has read the checkpoint before the main process may discard it
    if checkpoint is None and is_main_process():
        start_fresh(state_dir, fingerprint)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"], strict=False)
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        set_rng_state(checkpoint["rng"])
        start = checkpoint["step"]
        log.info("resuming from %s at step %d", checkpoint["path"], start)
    if is_main_process():
        metrics.truncate(metrics_path, start)
    return start
