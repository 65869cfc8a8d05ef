"""The training loop: set-up (drafter, teacher, optimizer, batches), resume from a checkpoint, steps with
training-time test (TTT) under optional DDP, metrics, checkpoints and the held-out selection."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3_pipeline.drafter.attention import choose_ttt_attention
from eagle3_pipeline.drafter.batches import BatchSchedule, to_device
from eagle3_pipeline.drafter.model import Drafter, DrafterConfig, count_flops_per_token
from eagle3_pipeline.drafter.objective import Teacher, TTTObjective, compiled_loss
from eagle3_pipeline.families import final_logit_softcap
from eagle3_pipeline.formats import draft_vocab, hidden_store, metrics, train_state, zarr_io
from eagle3_pipeline.formats.target_dir import read_config, read_head
from eagle3_pipeline.runtime.target.devices import process_device
from eagle3_pipeline.training.inputs import PassJob, TrainingData
from eagle3_pipeline.training.resume import is_main_process, run_fingerprint, save_checkpoint, starting_point
from eagle3_pipeline.training.selection import HeldoutSelection
from eagle3_pipeline.training.settings import TrainSettings

log = logging.getLogger("eagle3_pipeline.stages.train")  # the train job's log names, as before the split


# Bad data, not a bug: one line naming store, array and chunk (or what is wrong), not a traceback.
DATA_ERRORS = (hidden_store.InvalidStore, zarr_io.CorruptChunk)


def data_error_line(error: Exception) -> str:
    """The error's own line; a DataLoader worker's error arrives with the worker's traceback prepended and
    its own `module.Class: message` line last."""
    last = str(error).strip().splitlines()[-1]
    prefix = f"{type(error).__module__}.{type(error).__name__}: "
    return last.removeprefix(prefix)


def build_drafter(target_dir: Path, vocab_path: Path, aux_layer_ids: list[int], seed: int,
                  intermediate_size: int | None = None, head_init: str = "random") -> Drafter:
    """A fresh drafter: the target's embedding (frozen), the draft vocabulary's maps, and a head drawn at random or
    (`head_init` "target") the target's lm_head rows of the draft vocabulary (train.head_init)."""
    from eagle3_pipeline.runtime.target.loading import load_config

    draft = draft_vocab.read(vocab_path)
    config = DrafterConfig.from_target(load_config(target_dir), len(draft.draft_ids), aux_layer_ids)
    if intermediate_size:  # a wider MLP than the target's: the exported config says so, and both engines read it
        config = replace(config, intermediate_size=intermediate_size)
    torch.manual_seed(seed)
    model = Drafter(config)
    embed, lm_head = read_head(target_dir)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.float())
        model.d2t.copy_(torch.from_numpy(draft.d2t))
        model.t2d.copy_(torch.from_numpy(draft.t2d))
        if head_init == "target":
            model.lm_head.weight.copy_(lm_head[model.draft_to_target(torch.arange(len(draft.d2t)))].float())
    return model


def build_teacher(target_dir: Path, model: Drafter, device: torch.device, temperature: float = 1.0) -> Teacher:
    """The target's lm_head over the drafter's vocab, softcapped as the target softcaps its logits (Gemma 2), at
    `train.teacher_temperature`."""
    _, lm_head = read_head(target_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    draft_ids = model.draft_to_target(torch.arange(model.config.draft_vocab_size, device=device))
    return Teacher(lm_head.to(device, dtype), draft_ids, final_logit_softcap(read_config(target_dir)),
                   temperature=temperature)


def cosine_with_warmup(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(store_paths: list[Path], target_dir: Path, vocab_path: Path, state_dir: Path,
          settings: TrainSettings, stop_after_step: int | None = None,
          heldout_paths: list[Path] | None = None) -> Drafter:
    """Train (or resume) until done; returns the model. `stop_after_step` simulates a kill in tests.

    With `heldout_paths`, the offline acceptance estimate runs after every epoch and the returned weights are
    those with the best estimate (see HeldoutSelection)."""
    data = whole_store_data(store_paths, heldout_paths or [], target_dir, vocab_path, settings)
    run = set_up(data, target_dir, vocab_path, state_dir, settings, heldout_paths)
    loop(run, stop_after_step)
    if run.selection and stop_after_step is None:
        run.selection.restore_best(run.model)
    return run.model


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def whole_store_data(store_paths: list[Path], heldout_paths: list[Path], target_dir: Path, vocab_path: Path,
                     settings: TrainSettings) -> TrainingData:
    aux_layer_ids = aux_layers_of(store_paths)
    # the held-out stores choose which epoch's weights are returned, so they are part of what decides them
    fingerprint = run_fingerprint([*store_paths, *heldout_paths], target_dir, vocab_path, settings, world_size())
    return TrainingData(BatchSchedule(store_paths, settings), aux_layer_ids, fingerprint)


@dataclass
class TrainingRun:
    """Everything the loop needs, built once (and resumed from the checkpoint) by `set_up`."""
    settings: TrainSettings
    model: Drafter
    objective: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: torch.utils.data.DataLoader
    trainable: list[torch.nn.Parameter]
    device: torch.device
    world: int
    start: int
    end: int  # the step this job stops at: the run's last, or its pass's last
    steps_total: int
    epoch_end_steps: dict[int, int]
    checkpoint_path: Path  # the periodic checkpoint (the state dir's)
    final_checkpoint_path: Path  # where the job's last step is saved: the periodic one's place, or the pass output
    metrics_path: Path
    selection: HeldoutSelection | None


def aux_layers_of(store_paths: list[Path]) -> list[int]:
    started = time.monotonic()
    stores = hidden_store.validate_all(store_paths)  # refuse invalid stores up front
    log.info("checked %d hidden-state stores (%s tokens) in %.1f s", len(stores),
             f"{sum(s['num_tokens'] for s in stores):,}", time.monotonic() - started)
    aux_layer_ids = stores[0]["aux_layer_ids"]
    if any(s["aux_layer_ids"] != aux_layer_ids for s in stores):
        raise ValueError("hidden-state stores disagree on aux_layer_ids; they come from different extractions")
    return aux_layer_ids


def set_up(data: TrainingData, target_dir: Path, vocab_path: Path, state_dir: Path, settings: TrainSettings,
           heldout_paths: list[Path] | None, pass_job: PassJob | None = None) -> TrainingRun:
    device = process_device(settings.device)
    distributed = dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    model = build_drafter(target_dir, vocab_path, data.aux_layer_ids, settings.seed,
                          settings.drafter_intermediate_size, settings.head_init).to(device)
    attention = choose_ttt_attention(settings.attention, device, log)
    teacher = build_teacher(target_dir, model, device, settings.teacher_temperature)
    schedule = data.schedule
    steps_total = len(schedule) // world
    if settings.max_steps:
        steps_total = min(steps_total, settings.max_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, settings.warmup_steps, steps_total))
    state_dir.mkdir(parents=True, exist_ok=True)
    start, end, final = starting_point(state_dir, data, pass_job, steps_total, (model, optimizer, scheduler))
    selection = HeldoutSelection(heldout_paths, settings, teacher.lm_head, state_dir, start, device, attention) \
        if heldout_paths and is_main_process() else None
    # step s consumes batches (s-1)*world .. s*world-1: an epoch's last batch is in step ceil(end / world)
    epoch_end_steps = {min(-(-end // world), steps_total): epoch + 1 for epoch, end in enumerate(schedule.epoch_ends)}
    epoch_end_steps[steps_total] = epoch_end_steps.get(steps_total, settings.epochs)
    objective = TTTObjective(model, teacher, settings.ttt_steps, settings.step_weight_decay,
                             compiled_loss(settings.compile, device, log), attention, settings.off_path_weight)
    if distributed:
        objective = torch.nn.parallel.DistributedDataParallel(objective)
    loader = torch.utils.data.DataLoader(
        schedule, batch_size=None, num_workers=settings.num_workers, pin_memory=device.type == "cuda",
        sampler=range(start * world + rank, end * world, world),
        persistent_workers=False, prefetch_factor=4 if settings.num_workers else None)
    log.info("training %d steps (%d batches/epoch over %d GPUs/processes), TTT %d steps, %d sequences",
             steps_total, len(schedule) // max(settings.epochs, 1), world, settings.ttt_steps,
             schedule.sequences_per_epoch)
    return TrainingRun(settings, model, objective, optimizer, scheduler, loader, trainable, device, world, start,
                       end, steps_total, epoch_end_steps, state_dir / train_state.CHECKPOINT_FILE, final,
                       state_dir / metrics.METRICS_FILE, selection)


def loop(run: TrainingRun, stop_after_step: int | None) -> None:
    settings, model, optimizer, scheduler = run.settings, run.model, run.optimizer, run.scheduler
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if run.device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    window = MetricsWindow(settings.ttt_steps)
    flops_per_token = 3 * sum(count_flops_per_token(model.config, 1024) for _ in range(settings.ttt_steps))
    step = run.start
    tick = time.perf_counter()
    model.train()
    for batch in run.loader:
        tokens = int(batch["valid"].sum())
        batch = to_device(batch, run.device)
        if settings.feature_noise:
            batch["aux"] = with_feature_noise(batch["aux"], settings.feature_noise)
        with autocast:
            loss, step_metrics = run.objective(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(run.trainable, settings.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        window.add(step_metrics, loss.detach(), tokens)
        if step % settings.log_every == 0 or step == run.steps_total:
            elapsed = time.perf_counter() - tick
            row = window.flush(step, scheduler.get_last_lr()[0], float(grad_norm), elapsed, run.steps_total - step,
                               flops_per_token, run.world)
            if is_main_process():
                metrics.append_row(run.metrics_path, row)
                log.info(format_row(row, run.steps_total))
            tick = time.perf_counter()
        if run.selection and step in run.epoch_end_steps:
            run.selection.evaluate(model, step, run.epoch_end_steps[step])
            model.train()
            tick = time.perf_counter()
        if step % settings.checkpoint_every == 0 and step < run.end and is_main_process():
            save_checkpoint(run.checkpoint_path, model, optimizer, scheduler, step, settings)
        if stop_after_step is not None and step >= stop_after_step:
            if is_main_process():
                save_checkpoint(run.checkpoint_path, model, optimizer, scheduler, step, settings)
            return
    if is_main_process():
        save_checkpoint(run.final_checkpoint_path, model, optimizer, scheduler, step, settings)


def with_feature_noise(aux: torch.Tensor, relative_std: float) -> torch.Tensor:
    """aux + N(0, (relative_std * RMS of each feature vector)^2): the drafter learns to tolerate the small
    differences between the features it trains on and those a serving engine computes (other kernels, dtypes)."""
    rms = aux.float().pow(2).mean(-1, keepdim=True).sqrt()
    return (aux.float() + torch.randn_like(aux, dtype=torch.float32) * rms * relative_std).to(aux.dtype)


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
