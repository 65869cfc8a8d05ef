"""The training-time test (TTT) objective: the drafter unrolled over k draft steps against the frozen target.

Targets: at step k the drafter sees token x[t+1+k] and (step 0) the target's aux features at t, or (k>0)
its own previous output, and must match the target's distribution at position t+1+k, i.e. predict
x[t+2+k]. The teacher is the frozen target lm_head applied to the stored post-norm final state
(softcapped where the target softcaps its logits), restricted (renormalised) to the draft vocab. A position
counts when the predicted token is an assistant token and the teacher's full-vocab argmax lies inside the
draft vocab.
"""

from __future__ import annotations

import logging

import torch

from eagle3_pipeline.drafter.attention import TTTKV, TTTKernel, explicit_ttt_attention
from eagle3_pipeline.drafter.batches import counted_positions
from eagle3_pipeline.drafter.model import Drafter


def shift_left(x: torch.Tensor, by: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t+by] (padded with `fill`): the token a chain step at position t is fed, by step."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


# Logit elements one vocabulary chunk may hold ([tokens, rows]): the full [tokens, V] logits of Gemma's 262k
# vocabulary at 16k tokens per batch would be 8 GiB in bf16, on top of the target head itself.
LOGIT_CHUNK_ELEMENTS = 1 << 26
MIN_CHUNK_ROWS = 1024


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap): Gemma 2's `final_logit_softcapping`, applied as the target applies it."""
    return logits if not cap else cap * torch.tanh(logits / cap)


@torch.no_grad()
def target_argmax(last: torch.Tensor, lm_head: torch.Tensor, chunk_elements: int = LOGIT_CHUNK_ELEMENTS
                  ) -> torch.Tensor:
    """argmax over the whole vocabulary of `last @ lm_head.T` ([..., H] -> [...]), computed over chunks of
    vocabulary rows so that [tokens, V] logits never exist; the first index wins a tie, as in `argmax`.
    A softcap is monotone, so the argmax is the softcapped target's too."""
    flat = last.reshape(-1, last.shape[-1]).to(lm_head.dtype)
    rows = max(chunk_elements // max(flat.shape[0], 1), MIN_CHUNK_ROWS)
    best_value = best_index = None
    for start in range(0, lm_head.shape[0], rows):
        logits = flat @ lm_head[start: start + rows].T
        index = logits.argmax(-1, keepdim=True)
        value = logits.gather(-1, index)[:, 0]
        if best_value is None:
            best_value, best_index = value, index[:, 0] + start
            continue
        better = value > best_value  # strictly: an earlier chunk keeps a tie
        best_value = torch.where(better, value, best_value)
        best_index = torch.where(better, index[:, 0] + start, best_index)
    return best_index.reshape(last.shape[:-1])


class Teacher:
    """The frozen target lm_head, giving draft-vocab probabilities and whether the argmax is in the draft.

    Only the draft vocabulary's rows make logits that are kept ([..., K] for states [..., H]); the full-vocabulary
    argmax runs over chunks (`target_argmax`). `softcap` is the target's `final_logit_softcapping` (Gemma 2): the
    target's distribution is the softmax of its softcapped logits, so the teacher's is too. `temperature` below 1
    sharpens the teacher towards its argmax (`train.teacher_temperature`): greedy verification accepts only the
    argmax, and a drafter too small to match the whole distribution then spends less of itself on the tail."""

    def __init__(self, lm_head: torch.Tensor, draft_ids: torch.Tensor, softcap: float | None = None,
                 chunk_elements: int = LOGIT_CHUNK_ELEMENTS, temperature: float = 1.0):
        self.lm_head = lm_head  # [V, H]
        self.chunk_elements = chunk_elements
        self.draft_ids = draft_ids  # [K]
        self.draft_head = lm_head[draft_ids]  # [K, H]
        self.softcap = softcap
        self.temperature = temperature
        self.in_draft = torch.zeros(lm_head.shape[0], dtype=torch.bool, device=lm_head.device)
        self.in_draft[draft_ids] = True

    @torch.no_grad()
    def targets(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft-vocab probabilities [..., K], whether the full-vocab argmax is in the draft, and that argmax
        (the target's greedy token: the one greedy verification accepts)."""
        last = last.to(self.lm_head.dtype)
        greedy = target_argmax(last, self.lm_head, self.chunk_elements)
        logits = softcapped((last @ self.draft_head.T).float(), self.softcap)  # [..., K]
        return torch.softmax(logits / self.temperature, dim=-1), self.in_draft[greedy], greedy


def on_greedy_path(batch: dict[str, torch.Tensor], rows: torch.Tensor, predicted: torch.Tensor,
                   greedy: torch.Tensor) -> torch.Tensor:
    """[B, T]: whether the data's token at each predictable position is the target's greedy token there. A chain
    step fed a data token that is not can never be reached by decoding with greedy verification, which would have
    fed (or rejected at) the target's own token instead; prompt positions are never drafted, so never on the path."""
    aligned = torch.zeros_like(batch["loss_mask"])
    aligned[rows, predicted] = batch["input_ids"][rows, predicted] == greedy
    return aligned


def predicted_positions(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, positions) of the tokens the loss counts: as `collate` listed them on the host, or found here (a
    device sync) for a batch built otherwise."""
    listed = batch["predicted"] if "predicted" in batch else counted_positions(batch["loss_mask"], batch["valid"])
    return listed[0], listed[1]


def ttt_forward(model: Drafter, batch: dict[str, torch.Tensor], teacher: Teacher, steps: int, decay: float,
                loss_fn=None, attention: TTTKernel = explicit_ttt_attention, off_path_weight: float = 1.0
                ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Unrolled training-time test. Returns the weighted loss and per-step metrics (sums and counts).

    Step k at sequence position t is rotated at position t + k: a serving engine advances the rotary position
    by one per draft step (vLLM `EagleProposer.propose`, SGLang `draft_forward`), so training must too.
    Step k's prediction at t is of the token at p = t+2+k, against the teacher at p-1. Only the predictable
    positions p (assistant tokens inside the sequence) are ever counted, so the head, the teacher and the loss
    run on those rows alone ([N, K] rather than [B, T, K]: prompts and padding cost no vocabulary work); the
    teacher's rows are the same for every step, so it runs once.

    `off_path_weight` (`train.off_path_weight`) below 1 weighs down step k's positions whose k drafted tokens are
    not all the target's greedy tokens (`on_greedy_path`): the chains greedy decoding never reaches (as GRIFFIN's
    token-alignable training masks misaligned tokens). Each step's loss stays a mean over all its counted
    positions, so a step whose chains mostly leave the path weighs less as a whole."""
    loss_fn = loss_fn or step_metrics
    device = batch["input_ids"].device
    batch_size, length = batch["input_ids"].shape
    positions = torch.arange(length, device=device).expand(batch_size, length)
    rows, predicted = predicted_positions(batch)  # the positions p, once
    probs, argmax_in_draft, greedy = teacher.targets(batch["last"][rows, (predicted - 1).clamp(min=0)])
    aligned = on_greedy_path(batch, rows, predicted, greedy) if off_path_weight < 1 else None
    on_path = torch.ones_like(argmax_in_draft) if aligned is not None else None  # step 0 drafts nothing
    hidden = batch["aux"].to(model.fc.weight.dtype)
    cache = TTTKV(attention)
    total = torch.zeros((), device=device)
    metrics = []
    for k in range(steps):
        hidden, cache = model.step(shift_left(batch["input_ids"], 1 + k), hidden, positions + k, cache)
        # row p is predicted at t = p-2-k; a p too early for this step has no t and does not count
        logits = model.head(hidden[rows, (predicted - 2 - k).clamp(min=0)])
        counts = argmax_in_draft & (predicted >= 2 + k)  # and the teacher's argmax must be drafter-reachable
        if aligned is None:
            step = loss_fn(logits, probs, counts)
        else:
            if k:  # step k's drafted tokens sit at p-k .. p-1
                on_path = on_path & aligned[rows, (predicted - k).clamp(min=0)]
            step = loss_fn(logits, probs, counts, torch.where(on_path, 1.0, off_path_weight))
        total = total + (decay ** k) * step.pop("mean_loss")
        metrics.append(step)
    return total, metrics


def step_metrics(logits: torch.Tensor, target_probs: torch.Tensor, counts: torch.Tensor,
                 weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Soft cross-entropy (mean over the counted positions, each times its `weight` where given; differentiable)
    plus sums over counted positions: loss, correct top-1, expected acceptance sum(min(p_draft, q_teacher)),
    count. Masked sums, not boolean indexing: indexing by a mask waits for the GPU to know the count; sums stay
    tensors for the same reason."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    n = counts.sum()
    per_position = torch.where(counts, -(target_probs * log_q).sum(-1), 0.0)
    weighted = per_position if weights is None else per_position * weights
    mean_loss = weighted.sum() / n.clamp(min=1)
    with torch.no_grad():
        correct = ((logits.argmax(-1) == target_probs.argmax(-1)) & counts).sum()
        accept = torch.where(counts, torch.minimum(log_q.exp(), target_probs).sum(-1), 0.0).sum()
    return {"mean_loss": mean_loss, "loss": per_position.detach().sum(), "correct": correct, "accept": accept,
            "count": n}


class TTTObjective(torch.nn.Module):
    """The drafter plus its training objective, as one module so DDP's gradient hooks see the whole step."""

    def __init__(self, drafter: Drafter, teacher: Teacher, steps: int, decay: float, loss_fn=None,
                 attention: TTTKernel = explicit_ttt_attention, off_path_weight: float = 1.0):
        super().__init__()
        self.drafter, self.teacher, self.steps, self.decay = drafter, teacher, steps, decay
        self.loss_fn = loss_fn or step_metrics
        self.attention = attention
        self.off_path_weight = off_path_weight

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        return ttt_forward(self.drafter, batch, self.teacher, self.steps, self.decay, self.loss_fn, self.attention,
                           self.off_path_weight)


def compiled_loss(mode: str | bool, device: torch.device, log: logging.Logger):
    """`step_metrics` through torch.compile where `mode` (`train.compile`: "on", "off", "auto" = on GPU) asks:
    the soft cross-entropy, top-1 and acceptance sums then read the [N, K] logits and teacher once, fused,
    instead of in a dozen passes. Falls back to eager, saying why, when compilation fails here."""
    if mode in ("off", False) or (mode == "auto" and device.type != "cuda"):
        return step_metrics
    compiled = torch.compile(step_metrics, dynamic=True)
    try:  # the probe's random numbers must not shift the training RNG (a resumed run would diverge)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            logits = torch.randn(3, 8, device=device, requires_grad=True)  # [N, K], as ttt_forward calls it
            probs = torch.softmax(torch.randn(3, 8, device=device), -1)
            counts = torch.ones(3, dtype=torch.bool, device=device)
            compiled(logits, probs, counts)["mean_loss"].backward()
            compiled(logits, probs, counts, torch.full((3,), 0.5, device=device))["mean_loss"].backward()  # weighed
    except Exception as exc:  # no compiler toolchain, unsupported device: eager gives the same numbers
        log.warning("torch.compile unavailable on %s (%s: %s); the loss runs eagerly", device,
                    type(exc).__name__, str(exc)[:300])
        return step_metrics
    log.info("loss compiled with torch.compile")
    return compiled
