"""What one decoding method leaves per prompt: its trace (tokens, accepted drafts per verify step, seconds), shared
by the host decoding loop (runtime/speculative.py) and the device-resident loops (runtime/pipelined.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Trace:
    prompt_id: str
    method: str
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step
    drafted: list[int] = field(default_factory=list)  # drafts proposed per verify step (a tree: its depth)
    target_forwards: int = 0
    draft_seconds: float = 0.0
    prompt_draft_seconds: float = 0.0  # of draft_seconds, the first drafting: the prompt's rows, then drafts
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    loop: str = "host"  # "device": the device-resident loop (pipelined.py), whose draft/verify times are the device's

    @property
    def tau(self) -> float:
        """Tokens per target forward after the prefill (the bonus token included)."""
        return len(self.tokens) / max(self.target_forwards, 1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def append_until_eos(trace: Trace, context: list[int], tokens: list[int], eos: set[int]) -> None:
    """A verify step's tokens (accepted drafts, then the target's own) into the context and the trace, up to
    and including an end-of-sequence token."""
    for token in tokens:
        context.append(token)
        trace.tokens.append(token)
        if token in eos:
            break


def prefill(target: Any, prompt_ids: list[int], max_new: int, trace: Trace) -> tuple[Any, torch.Tensor, list[int]]:
    """The prompt through the target (a TargetRuntime) into a fresh KV cache for it and `max_new` tokens: the
    cache, the prompt's aux features and the context ending in the target's first token (also the trace's first)."""
    cache = target.new_cache(len(prompt_ids) + max_new)
    logits, features = target.forward(prompt_ids, cache, last_only=True)
    context = list(prompt_ids) + [int(logits[-1].argmax())]
    trace.tokens.append(context[-1])
    return cache, features, context
