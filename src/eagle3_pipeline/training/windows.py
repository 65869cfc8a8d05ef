"""Training under a disk budget (plan.disk_budget_gb): one job per pass over a window of shards, each from the
checkpoint the pass before ended with, and a last step that publishes the kept weights.

The schedule of the whole run is known in every pass without the other windows' stores (they do not exist):
a pass's batches follow from its window's sequence lengths, read from the token shards in store order.
With one window the schedule, and so the checkpoint, equals training on the whole store."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_pipeline.drafter.batches import BatchSchedule, Segment, store_lengths
from eagle3_pipeline.formats import drafter_weights, hidden_store, metrics, token_shards, train_state
from eagle3_pipeline.plan_windows import extraction_groups
from eagle3_pipeline.training.inputs import PassJob, TrainingData
from eagle3_pipeline.training.loop import aux_layers_of, build_drafter, loop, set_up
from eagle3_pipeline.training.resume import windowed_fingerprint
from eagle3_pipeline.training.selection import restore_best, summary
from eagle3_pipeline.training.settings import TrainSettings

log = logging.getLogger("eagle3_pipeline.stages.train")


@dataclass(frozen=True)
class Windows:
    """The window plan as the rules pass it (plan_windows.WindowPlan.as_dict) and where its stores live."""
    windows: list[list[str]]  # shard names per window
    passes: list[list[int]]  # (epoch, window) per pass
    token_shards: dict[str, Path]  # shard name -> token shard
    store: str  # a window store's path, with {group} and {shard}

    def as_dict(self) -> dict[str, list]:
        return {"windows": self.windows, "passes": self.passes}

    def pass_stores(self, index: int) -> tuple[Path, ...]:
        group = next(g for g in extraction_groups(self.passes) if index in g.passes)
        return tuple(Path(self.store.format(group=group.index, shard=shard)) for shard in self.windows[group.window])


@cache
def planned_lengths(token_shard: Path, max_seq_len: int) -> np.ndarray:
    """A store's sequence lengths before it exists: its token shard's, in the store's order."""
    lengths = token_shards.read(token_shard).lengths()
    return np.minimum(lengths[hidden_store.storage_order(lengths)], max_seq_len)


def segments(windows: Windows, max_seq_len: int) -> list[Segment]:
    """One segment per pass. With one window the random key is the whole store's, (seed, epoch)."""
    keyed = len(windows.windows) > 1
    return [Segment(epoch, window if keyed else None, windows.pass_stores(index),
                    tuple(planned_lengths(windows.token_shards[s], max_seq_len) for s in windows.windows[window]))
            for index, (epoch, window) in enumerate(windows.passes)]


def windowed_data(windows: Windows, index: int, heldout_paths: list[Path], extract: dict[str, Any],
                  target_dir: Path, vocab_path: Path, settings: TrainSettings) -> TrainingData:
    """Pass `index`'s view of the run: the whole schedule, and this pass's stores checked against the plan."""
    plan = segments(windows, settings.max_seq_len)
    current = plan[index]
    aux_layer_ids = aux_layers_of(list(current.paths))  # validates them
    for path, lengths in zip(current.paths, current.lengths, strict=True):
        found = store_lengths(path, settings.max_seq_len)
        if not np.array_equal(found, lengths):
            raise hidden_store.InvalidStore(f"{path}: its sequences differ from its token shard's; delete it")
    fingerprint = windowed_fingerprint([windows.token_shards[s] for s in windows.token_shards], heldout_paths,
                                       extract, windows.as_dict(), target_dir, vocab_path, settings)
    return TrainingData(BatchSchedule([], settings, plan), aux_layer_ids, fingerprint)


def train_pass(windows: Windows, pass_job: PassJob, heldout_paths: list[Path], extract: dict[str, Any],
               target_dir: Path, vocab_path: Path, state_dir: Path, settings: TrainSettings,
               stop_after_step: int | None = None) -> None:
    """Train pass `pass_job.index` (resuming inside it after a kill) and save its last step to its output."""
    data = windowed_data(windows, pass_job.index, heldout_paths, extract, target_dir, vocab_path, settings)
    run = set_up(data, target_dir, vocab_path, state_dir, settings, heldout_paths, pass_job)
    loop(run, stop_after_step)


def finish(last_pass: Path, target_dir: Path, vocab_path: Path, state_dir: Path, settings: TrainSettings,
           weights: Path, summary_path: Path, heldout: bool) -> dict[str, Any]:
    """The drafter of the last pass, or the weights the held-out selection kept, published like whole-store
    training publishes them (weights and summary)."""
    checkpoint = train_state.validate_checkpoint(last_pass)
    model = build_drafter(target_dir, vocab_path, checkpoint["aux_layer_ids"], settings.seed,
                          settings.drafter_intermediate_size)
    model.load_state_dict(checkpoint["model"], strict=False)
    if heldout:
        restore_best(model, state_dir, settings)
    drafter_weights.write_trained(weights, {k: v.contiguous().cpu() for k, v in model.trainable_state_dict().items()},
                                  model.config.as_dict())
    result = summary(state_dir, settings)
    metrics.write_summary(summary_path, result)
    log.info("done: %s", result)
    return result
