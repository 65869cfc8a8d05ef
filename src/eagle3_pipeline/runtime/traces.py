"""What one decoding method leaves per prompt: its trace (tokens, accepted drafts per verify step, seconds), shared
by the chain methods (runtime/speculative.py) and the draft trees (runtime/tree.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Tokens per target forward after the prefill (the bonus token included)."""
        return len(self.tokens) / max(self.target_forwards, 1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
