"""Drafter training with training-time test (TTT), resumable checkpoints and optional DDP (torchrun).

The objective (drafter/objective.py) and the batch schedule (drafter/batches.py) live with the drafter; this
module runs them: set-up, the loop, checkpoints and resume, the held-out selection, metrics.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from eagle3_pipeline import logs
from eagle3_pipeline.drafter import offline_acceptance
from eagle3_pipeline.drafter.attention import TTTKernel, choose_ttt_attention
from eagle3_pipeline.drafter.batches import BatchSchedule
from eagle3_pipeline.drafter.model import Drafter, DrafterConfig, count_flops_per_token
from eagle3_pipeline.drafter.objective import Teacher, TTTObjective, compiled_loss
from eagle3_pipeline.formats import draft_vocab, drafter_weights, hidden_store, metrics, train_state, zarr_io
from eagle3_pipeline.formats.target_dir import content_hash, file_sha256, read_head
from eagle3_pipeline.runtime.devices import process_device

log = logging.getLogger(__name__)
NOT_FINGERPRINTED = frozenset({"log_every", "checkpoint_every", "num_workers"})  # do not change the weights


@dataclass(frozen=True)
class TrainSettings:
    """The `train` config section as training uses it (no defaults here: they are config/schema.yaml's)."""
    ttt_steps: int
    step_weight_decay: float
    learning_rate: float
    warmup_steps: int
    epochs: int
    max_steps: int | None
    batch_tokens: int
    max_seq_len: int  # null in the config means data.max_seq_len: workflow_config fills it in
    weight_decay: float
    grad_clip: float
    seed: int
    checkpoint_every: int
    log_every: int
    num_workers: int
    device: str
    attention: str  # TTT attention: "flex" (fused kernel, GPU), "eager" (explicit scores); auto = flex on GPU
    compile: str | bool  # torch.compile the loss: "on", "off"; auto = on GPU
    feature_noise: float  # Gaussian noise on the aux features, relative to each row's RMS
    heldout_select_k: int  # keep the weights with the best offline tau at this draft length
    pad_multiple: int  # batch widths are rounded up to this (few shapes: compiled kernels and masks are reused)
    drafter_intermediate_size: int | None  # the drafter's MLP width; None = the target's

    # keys of the section that are not the training process's: the rule's resources and inputs use them
    NOT_SETTINGS: ClassVar[frozenset[str]] = frozenset({"gpus", "threads", "heldout_estimate"})

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> TrainSettings:
        """From the validated section; a key neither a setting nor in NOT_SETTINGS is an error, not dropped."""
        unknown = set(section) - {f.name for f in fields(cls)} - cls.NOT_SETTINGS
        if unknown:
            raise ValueError(f"train settings: unknown keys {sorted(unknown)}")
        return cls(**{f.name: section[f.name] for f in fields(cls)})


# ---------------------------------------------------------------- set-up helpers

def build_drafter(target_dir: Path, vocab_path: Path, aux_layer_ids: list[int], seed: int,
                  intermediate_size: int | None = None) -> Drafter:
    from eagle3_pipeline.runtime.loading import load_config

    draft = draft_vocab.read(vocab_path)
    config = DrafterConfig.from_target(load_config(target_dir), len(draft.draft_ids), aux_layer_ids)
    if intermediate_size:  # a wider MLP than the target's: the exported config says so, and both engines read it
        config = replace(config, intermediate_size=intermediate_size)
    torch.manual_seed(seed)
    model = Drafter(config)
    embed, _ = read_head(target_dir)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.float())
        model.d2t.copy_(torch.from_numpy(draft.d2t))
        model.t2d.copy_(torch.from_numpy(draft.t2d))
    return model


def cosine_with_warmup(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


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


# ---------------------------------------------------------------- what a checkpoint may be resumed for

def run_fingerprint(store_paths: list[Path], target_dir: Path, vocab_path: Path, settings: TrainSettings,
                    world_size: int) -> dict[str, Any]:
    """Everything that decides the trained weights: the settings that change them, the world size, each
    hidden store's content identity, the draft vocab's and the target's content hashes."""
    fingerprint = {
        "settings": {k: v for k, v in asdict(settings).items() if k not in NOT_FINGERPRINTED},
        "world_size": world_size,
        "stores": [{"name": Path(p).name, "identity": hidden_store.identity(p)} for p in store_paths],
        "draft_vocab": file_sha256(Path(vocab_path)),
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


# ---------------------------------------------------------------- the loop

def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def train(store_paths: list[Path], target_dir: Path, vocab_path: Path, state_dir: Path,
          settings: TrainSettings, stop_after_step: int | None = None,
          heldout_paths: list[Path] | None = None) -> Drafter:
    """Train (or resume) until done; returns the model. `stop_after_step` simulates a kill in tests.

    With `heldout_paths`, the offline acceptance estimate runs after every epoch and the returned weights are
    those with the best estimate (see HeldoutSelection)."""
    stores = [hidden_store.validate(p) for p in store_paths]  # refuse invalid stores up front
    aux_layer_ids = stores[0]["aux_layer_ids"]
    if any(s["aux_layer_ids"] != aux_layer_ids for s in stores):
        raise ValueError("hidden-state stores disagree on aux_layer_ids; they come from different extractions")
    device = process_device(settings.device)
    distributed = dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    model = build_drafter(target_dir, vocab_path, aux_layer_ids, settings.seed,
                          settings.drafter_intermediate_size).to(device)
    attention = choose_ttt_attention(settings.attention, device, log)
    _, lm_head = read_head(target_dir)
    teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = Teacher(lm_head.to(device, teacher_dtype), model.draft_to_target(
        torch.arange(model.config.draft_vocab_size, device=device)))
    schedule = BatchSchedule(store_paths, settings)
    steps_total = len(schedule) // world
    if settings.max_steps:
        steps_total = min(steps_total, settings.max_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, settings.warmup_steps, steps_total))
    state_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_path, metrics_path = state_dir / train_state.CHECKPOINT_FILE, state_dir / metrics.METRICS_FILE
    start = 0
    # the held-out stores choose which epoch's weights are returned, so they are part of what decides them
    fingerprint = run_fingerprint([*store_paths, *(heldout_paths or [])], target_dir, vocab_path, settings, world)
    checkpoint = resumable_checkpoint(state_dir, fingerprint, steps_total)
    if distributed:
        dist.barrier()  # every rank has read the checkpoint before the main process may discard it
    if checkpoint is None and is_main_process():
        start_fresh(state_dir, fingerprint)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"], strict=False)
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        set_rng_state(checkpoint["rng"])
        start = checkpoint["step"]
        log.info("resuming from %s at step %d of %d", checkpoint_path, start, steps_total)
    if is_main_process():
        metrics.truncate(metrics_path, start)
    selection = HeldoutSelection(heldout_paths, settings, teacher.lm_head, state_dir, start, device, attention) \
        if heldout_paths and is_main_process() else None
    # step s consumes batches (s-1)*world .. s*world-1: an epoch's last batch is in step ceil(end / world)
    epoch_end_steps = {min(-(-end // world), steps_total): epoch + 1 for epoch, end in enumerate(schedule.epoch_ends)}
    epoch_end_steps[steps_total] = epoch_end_steps.get(steps_total, settings.epochs)
    objective = TTTObjective(model, teacher, settings.ttt_steps, settings.step_weight_decay,
                             compiled_loss(settings.compile, device, log), attention)
    if distributed:
        objective = torch.nn.parallel.DistributedDataParallel(objective)
    loader = torch.utils.data.DataLoader(
        schedule, batch_size=None, num_workers=settings.num_workers, pin_memory=device.type == "cuda",
        sampler=range(start * world + rank, steps_total * world, world),
        persistent_workers=False, prefetch_factor=4 if settings.num_workers else None)
    log.info("training %d steps (%d batches/epoch over %d GPUs/processes), TTT %d steps, %d sequences",
             steps_total, len(schedule) // max(settings.epochs, 1), world, settings.ttt_steps,
             sum(len(x) for x in schedule.lengths))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    window = MetricsWindow(settings.ttt_steps)
    flops_per_token = 3 * sum(count_flops_per_token(model.config, 1024) for _ in range(settings.ttt_steps))
    step = start
    tick = time.perf_counter()
    model.train()
    for batch in loader:
        tokens = int(batch["valid"].sum())
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        if settings.feature_noise:
            batch["aux"] = with_feature_noise(batch["aux"], settings.feature_noise)
        with autocast:
            loss, step_metrics = objective(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, settings.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        window.add(step_metrics, loss.detach(), tokens)
        if step % settings.log_every == 0 or step == steps_total:
            elapsed = time.perf_counter() - tick
            row = window.flush(step, scheduler.get_last_lr()[0], float(grad_norm), elapsed, steps_total - step,
                               flops_per_token, world)
            if is_main_process():
                metrics.append_row(metrics_path, row)
                log.info(format_row(row, steps_total))
            tick = time.perf_counter()
        if selection and step in epoch_end_steps:
            selection.evaluate(model, step, epoch_end_steps[step])
            model.train()
            tick = time.perf_counter()
        if step % settings.checkpoint_every == 0 and step < steps_total and is_main_process():
            save_checkpoint(checkpoint_path, model, optimizer, scheduler, step, settings)
        if stop_after_step is not None and step >= stop_after_step:
            if is_main_process():
                save_checkpoint(checkpoint_path, model, optimizer, scheduler, step, settings)
            return model
    if is_main_process():
        save_checkpoint(checkpoint_path, model, optimizer, scheduler, step, settings)
    if selection:
        selection.restore_best(model)
    return model


def with_feature_noise(aux: torch.Tensor, relative_std: float) -> torch.Tensor:
    """aux + N(0, (relative_std * RMS of each feature vector)^2): the drafter learns to tolerate the small
    differences between the features it trains on and those a serving engine computes (other kernels, dtypes)."""
    rms = aux.float().pow(2).mean(-1, keepdim=True).sqrt()
    return (aux.float() + torch.randn_like(aux, dtype=torch.float32) * rms * relative_std).to(aux.dtype)


class HeldoutSelection:
    """The offline acceptance estimate after every epoch (train_state/heldout_estimate.csv) and the weights with
    the best tau at `heldout_select_k` (train_state/best.safetensors), which training returns at the end.
    Resuming at step s keeps the rows and best weights of steps <= s (later ones are recomputed identically)."""

    def __init__(self, paths: list[Path], settings: TrainSettings, lm_head: torch.Tensor, state_dir: Path,
                 start: int, device: torch.device, attention: TTTKernel):
        self.schedule = BatchSchedule(paths, replace(settings, epochs=1))
        self.settings, self.lm_head, self.device = settings, lm_head, device
        self.attention = attention  # the training's TTT kernel: the estimate unrolls the drafter the same way
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
                                             self.attention)
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
        if not self.best_path.exists():
            return
        log.info("keeping the weights of step %d: best held-out tau at k=%d, %.3f", self.best_step,
                 self.settings.heldout_select_k, self.best_tau)
        model.load_state_dict(drafter_weights.read_weights(self.best_path, str(next(model.parameters()).device)),
                              strict=False)


class MetricsWindow:
    def __init__(self, steps: int):
        self.steps = steps
        self.reset()

    def reset(self) -> None:
        self.sums = [{"loss": 0.0, "correct": 0.0, "accept": 0.0, "count": 0.0} for _ in range(self.steps)]
        self.loss, self.batches, self.tokens = 0.0, 0, 0

    def add(self, step_metrics: list[dict[str, torch.Tensor]], loss: torch.Tensor, tokens: int) -> None:
        for total, m in zip(self.sums, step_metrics, strict=True):
            for key in total:
                total[key] = total[key] + m[key]
        self.loss += loss
        self.batches += 1
        self.tokens += tokens

    def flush(self, step: int, lr: float, grad_norm: float, elapsed: float, remaining: int,
              flops_per_token: float, world: int) -> dict[str, float]:
        tokens_per_s = self.tokens * world / max(elapsed, 1e-9)
        row = {"step": step, "lr": lr, "loss": float(self.loss) / max(self.batches, 1), "grad_norm": grad_norm,
               "tokens_per_s": tokens_per_s, "tflops": tokens_per_s * flops_per_token / 1e12,
               "eta_s": remaining * elapsed / max(self.batches, 1)}
        for k, sums in enumerate(self.sums):
            n = max(float(sums["count"]), 1.0)
            row[f"loss_{k}"] = float(sums["loss"]) / n
            row[f"acc_{k}"] = float(sums["correct"]) / n
            row[f"accept_{k}"] = float(sums["accept"]) / n
        self.reset()
        return row


def format_row(row: dict[str, float], total: int) -> str:
    accs = " ".join(f"{row[f'acc_{k}']:.3f}" for k in range(sum(1 for key in row if key.startswith("acc_"))))
    return (f"step {int(row['step'])}/{total} loss {row['loss']:.4f} lr {row['lr']:.2e} acc/step [{accs}] "
            f"{row['tokens_per_s']:,.0f} tokens/s, ETA {row['eta_s'] / 60:.1f} min")


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


# ---------------------------------------------------------------- the rule's job: one process, or torchrun

# Bad data, not a bug: one line naming store, array and chunk (or what is wrong), not a traceback.
DATA_ERRORS = (hidden_store.InvalidStore, zarr_io.CorruptChunk)


@dataclass(frozen=True)
class TrainJob:
    """What every training process reads and writes; under torchrun it travels as JSON
    (`python -m eagle3_pipeline.stages.train JOB.json`, one process per GPU)."""
    stores: tuple[Path, ...]
    heldout: tuple[Path, ...]  # stores of the held-out conversations: the offline estimate picks the weights
    target: Path
    vocab: Path
    state_dir: Path  # checkpoints, metrics and the train log's history: kept across kills
    weights: Path
    summary: Path
    log: Path
    settings: TrainSettings

    def as_json(self) -> str:
        paths = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "settings"}
        return json.dumps({key: [str(p) for p in value] if isinstance(value, tuple) else str(value)
                           for key, value in paths.items()} | {"settings": asdict(self.settings)})

    @classmethod
    def from_json(cls, text: str) -> TrainJob:
        values = json.loads(text)
        return cls(stores=tuple(Path(p) for p in values["stores"]),
                   heldout=tuple(Path(p) for p in values.get("heldout", [])),
                   **{key: Path(values[key]) for key in ("target", "vocab", "state_dir", "weights", "summary", "log")},
                   settings=TrainSettings.from_config(values["settings"]))


def data_error_line(error: Exception) -> str:
    """The error's own line; a DataLoader worker's error arrives with the worker's traceback prepended and
    its own `module.Class: message` line last."""
    last = str(error).strip().splitlines()[-1]
    prefix = f"{type(error).__module__}.{type(error).__name__}: "
    return last.removeprefix(prefix)


def run_process(job: TrainJob) -> None:
    """One training process (rank 0 writes the weights and the summary)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    log = logs.setup(str(job.log) if rank == 0 else None, name="train",
                     history=job.state_dir / "train.log" if rank == 0 else None)
    if world > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    try:
        try:
            model = train(list(job.stores), job.target, job.vocab, job.state_dir, job.settings,
                          heldout_paths=list(job.heldout))
        except DATA_ERRORS as error:
            log.error("training stopped: %s", data_error_line(error))
            raise SystemExit(1) from None
        if rank == 0:
            weights = {k: v.contiguous().cpu() for k, v in model.trainable_state_dict().items()}
            drafter_weights.write_trained(job.weights, weights, model.config.as_dict())
            result = summary(job.state_dir, job.settings)
            metrics.write_summary(job.summary, result)
            log.info("done: %s", result)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(job: TrainJob, gpus: int, metrics_output: Path) -> None:
    """Train in this process, or with more than one GPU in one torchrun process per GPU; then publish the
    metrics of the run (train_state/ keeps the history a resume appends to)."""
    if gpus > 1:
        job_path = job.state_dir / "args.json"
        job_path.parent.mkdir(parents=True, exist_ok=True)
        job_path.write_text(job.as_json())
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                        "-m", "eagle3_pipeline.stages.train", str(job_path)], check=True)
    else:
        run_process(job)
    shutil.copyfile(job.state_dir / metrics.METRICS_FILE, metrics_output)


def run_from_snakemake(snakemake: Any) -> None:
    import yaml

    torch.set_num_threads(snakemake.threads)
    Path(snakemake.output.config).write_text(yaml.safe_dump(dict(snakemake.params.provenance), sort_keys=False))
    job = TrainJob(stores=tuple(Path(p) for p in snakemake.input.stores),
                   heldout=tuple(Path(p) for p in snakemake.input.heldout), target=Path(snakemake.input.target),
                   vocab=Path(snakemake.input.vocab), state_dir=Path(snakemake.params.state_dir),
                   weights=Path(snakemake.output.weights), summary=Path(snakemake.output.summary),
                   log=Path(snakemake.log[0]), settings=TrainSettings.from_config(dict(snakemake.params.settings)))
    run(job, int(snakemake.resources.get("gpu", 0)), Path(snakemake.output.metrics))


if __name__ == "__main__":
    run_process(TrainJob.from_json(Path(sys.argv[1]).read_text()))
