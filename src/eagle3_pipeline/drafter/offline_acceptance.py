"""Offline acceptance estimate: the drafter's greedy chain acceptance on held-out hidden states, without decoding.

At every held-out position t where a draft is made (token t+2 is an assistant token), the drafter is unrolled
as in training-time test (engine positions, the data's tokens fed to the chain) and the leading steps whose
draft - its argmax over the draft vocab, mapped to a target id - equals the target's own greedy token at
t+1+k are counted. Greedy verification accepts exactly that prefix, so the expected tokens per target forward
at draft length k is tau(k) = 1 + mean(min(accepted, k)) (SpecForge's simulated acceptance length, per
position rather than from per-step averages).

What it cannot see: decoding feeds the chain the target's own greedy tokens, this estimate the data's tokens
(ShareGPT replies, or regenerated ones); and decoding drafts only at the start of each verify step, mostly just
after a token the drafter got wrong, this estimate at every position. On the GPU example it read 0.12-0.29 above
decoded held-out tau at k=4, ranking epochs and drafters as decoding did where they differed by more than ~0.02.
Replayed on the target's own text, the same unrolling gives every decoded verify step's accepted length exactly
(benchmarks/estimate_vs_decode.py, docs/results.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from eagle3_pipeline.drafter.attention import TTTKV, TTTKernel, explicit_ttt_attention
from eagle3_pipeline.drafter.batches import to_device
from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.drafter.objective import shift_left, target_argmax


@dataclass
class Estimate:
    positions: int  # draft opportunities scored
    tau: list[float]  # expected tokens per verify step (accepted + 1) at draft length k = 1..steps
    accuracy: list[float]  # top-1 agreement with the target's greedy token per chain step (teacher-forced)

    def row(self) -> dict[str, float]:
        return {"positions": self.positions} | {f"tau_k{k + 1}": t for k, t in enumerate(self.tau)} | {
            f"step_acc_{k}": a for k, a in enumerate(self.accuracy)}


@torch.no_grad()
def accepted_lengths(model: Drafter, batch: dict[str, torch.Tensor], greedy: torch.Tensor, steps: int,
                     attention: TTTKernel = explicit_ttt_attention) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted chain length per draft opportunity [n], per-step matches summed over them [steps]); `greedy`:
    the target's next token at every t of the batch."""
    ids, valid = batch["input_ids"], batch["valid"]
    batch_size, length = ids.shape
    positions = torch.arange(length, device=ids.device).expand(batch_size, length)
    hidden = batch["aux"].to(model.fc.weight.dtype)
    cache = TTTKV(attention)
    matches = torch.zeros(steps, batch_size, length, dtype=torch.bool, device=ids.device)
    for k in range(steps):
        logits, hidden, cache = model(shift_left(ids, 1 + k), hidden, positions + k, cache)
        span = max(length - 2 - k, 0)
        draft = model.draft_to_target(logits[:, :span].argmax(-1))
        matches[k, :, :span] = (draft == greedy[:, 1 + k: 1 + k + span]) & valid[:, 2 + k:]
    opportunities = torch.zeros_like(valid)
    opportunities[:, : max(length - 2, 0)] = (batch["loss_mask"] & valid)[:, 2:]
    chain = matches.cumprod(dim=0)  # step k accepted only if every earlier step was
    accepted = chain.sum(dim=0)[opportunities]
    per_step = matches[:, opportunities].sum(dim=1)
    return accepted, per_step


def estimate(model: Drafter, lm_head: torch.Tensor, batches: Iterable[dict[str, torch.Tensor]], steps: int,
             device: torch.device, attention: TTTKernel = explicit_ttt_attention,
             greedy: dict[int, torch.Tensor] | None = None) -> Estimate:
    """Acceptance over every held-out batch (the model is put in eval mode and left there); `attention` is the
    TTT kernel (training passes its own). `greedy`: the target's greedy tokens by batch index, filled on first use
    and read after (the same batches every epoch: their full-vocabulary argmax is computed once)."""
    model.eval()
    histogram = np.zeros(steps + 1)
    per_step = np.zeros(steps)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    for index, batch in enumerate(batches):
        batch = to_device(batch, device)
        if greedy is None or index not in greedy:  # softcap: the same argmax
            tokens = target_argmax(batch["last"], lm_head)
            if greedy is not None:
                greedy[index] = tokens
        else:
            tokens = greedy[index]
        with autocast:
            accepted, matched = accepted_lengths(model, batch, tokens, steps, attention)
        histogram += np.bincount(accepted.cpu().numpy(), minlength=steps + 1)
        per_step += matched.cpu().numpy()
    total = histogram.sum()
    lengths = np.arange(steps + 1)
    tau = [1.0 + float((np.minimum(lengths, k) * histogram).sum() / max(total, 1)) for k in range(1, steps + 1)]
    return Estimate(int(total), tau, [float(m / max(total, 1)) for m in per_step])
