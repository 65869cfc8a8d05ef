"""The held-out selection: the offline acceptance estimate after every epoch, the best weights it keeps, and
the run's summary (the last metrics and the estimates)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.drafter import offline_acceptance
from eagle3_pipeline.drafter.attention import TTTKernel
from eagle3_pipeline.drafter.batches import BatchSchedule
from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.formats import drafter_weights, hidden_store, metrics
from eagle3_pipeline.training.settings import TrainSettings

log = logging.getLogger("eagle3_pipeline.stages.train")


class HeldoutSelection:
    """The offline acceptance estimate after every epoch (train_state/heldout_estimate.csv) and the weights with
    the best tau at `heldout_select_k` (train_state/best.safetensors), which training returns at the end.
    Resuming at step s keeps the rows and best weights of steps <= s (later ones are recomputed identically)."""

    def __init__(self, paths: list[Path], settings: TrainSettings, lm_head: torch.Tensor, state_dir: Path,
                 start: int, device: torch.device, attention: TTTKernel):
        hidden_store.validate_all(paths)  # refused before the first epoch, not after it
        self.schedule = BatchSchedule(paths, replace(settings, epochs=1))
        self.settings, self.lm_head, self.device = settings, lm_head, device
        self.attention = attention  # the training's TTT kernel: the estimate unrolls the drafter the same way
        self.greedy: dict[int, torch.Tensor] = {}  # the target's greedy tokens per batch: one argmax for all epochs
        self.csv, self.best_path = state_dir / metrics.HELDOUT_FILE, state_dir / drafter_weights.BEST_WEIGHTS_FILE
        metrics.truncate(self.csv, start)
        self.best_step, self.best_tau = self._read_best(start)

    def _read_best(self, start: int) -> tuple[int, float]:
        best = drafter_weights.read_best(self.best_path)
        if best is None:
            return 0, float("-inf")
        if best[0] > start:  # written after the checkpoint being resumed: it will be recomputed
            self.best_path.unlink()
            return 0, float("-inf")
        return best

    def evaluate(self, model: Drafter, step: int, epoch: int) -> None:
        tick = time.perf_counter()
        batches = (self.schedule[i] for i in range(len(self.schedule)))
        result = offline_acceptance.estimate(model, self.lm_head, batches, self.settings.ttt_steps, self.device,
                                             self.attention, self.greedy)
        k = min(self.settings.heldout_select_k, len(result.tau))
        tau = result.tau[k - 1]
        metrics.append_row(self.csv, {"step": step, "epoch": epoch} | result.row())
        log.info("held-out estimate after epoch %d (step %d, %d draft positions, %.1f s): tau %s; "
                 "top-1 per chain step %s", epoch, step, result.positions, time.perf_counter() - tick,
                 " ".join(f"k={i + 1}:{t:.3f}" for i, t in enumerate(result.tau)),
                 " ".join(f"{a:.3f}" for a in result.accuracy))
        if result.positions == 0:  # nothing to judge by (an empty held-out split): keep training's own weights
            log.warning("held-out estimate: no draft positions in %s; not selecting by it", self.schedule.paths)
            return
        if tau > self.best_tau:
            self.best_step, self.best_tau = step, tau
            weights = {name: t.detach().contiguous().cpu() for name, t in model.trainable_state_dict().items()}
            drafter_weights.write_best(self.best_path, weights, step, tau)

    def restore_best(self, model: Drafter) -> None:
        restore_best(model, self.best_path.parent, self.settings)


def restore_best(model: Drafter, state_dir: Path, settings: TrainSettings) -> None:
    """Load the weights the held-out selection kept into `model` (none kept: leave it as it is)."""
    path = state_dir / drafter_weights.BEST_WEIGHTS_FILE
    best = drafter_weights.read_best(path)
    if best is None:
        return
    log.info("keeping the weights of step %d: best held-out tau at k=%d, %.3f", best[0], settings.heldout_select_k,
             best[1])
    model.load_state_dict(drafter_weights.read_weights(path, str(next(model.parameters()).device)), strict=False)


def summary(state_dir: Path, settings: TrainSettings) -> dict[str, Any]:
    rows = metrics.read(state_dir / metrics.METRICS_FILE)
    last = rows[-1]
    result = {"steps": int(last["step"]), "final_loss": last["loss"],
              "acc_per_step": [last[f"acc_{k}"] for k in range(settings.ttt_steps)],
              "expected_acceptance_per_step": [last[f"accept_{k}"] for k in range(settings.ttt_steps)]}
    if (state_dir / metrics.HELDOUT_FILE).exists():
        estimates = metrics.read(state_dir / metrics.HELDOUT_FILE)
        key = f"tau_k{min(settings.heldout_select_k, settings.ttt_steps)}"
        # the weights training returned, not a re-derived maximum
        best = drafter_weights.read_best(state_dir / drafter_weights.BEST_WEIGHTS_FILE)
        kept = next((row for row in estimates if int(row["step"]) == best[0]), None) if best else None
        result["heldout_estimate"] = {"by_epoch": estimates, "kept": kept, "selected_by": key}
    return result
