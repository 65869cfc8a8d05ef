"""What one decoding method leaves per prompt: its trace (tokens, accepted drafts per verify step, seconds) and the
clock of its phases, shared by the host decoding loop (runtime/speculative.py) and the device-resident loops
(runtime/pipelined.py)."""

from __future__ import annotations

import time
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
        """Acceptance length: tokens per verify step, the accepted drafts plus the bonus token (1.0 without drafts)."""
        return acceptance_length([self])


def acceptance_length(traces: list[Trace]) -> float:
    """Tokens per verify step over the traces, as engines count it: accepted drafts + 1 per step (a method that
    never drafts right, or does not draft, has 1.0). The prefill's token is no step's, and a last step's tokens
    past max_new or an end of sequence still count: the step produced them."""
    steps = sum(len(trace.accepted) for trace in traces)
    return 1 + sum(sum(trace.accepted) for trace in traces) / steps if steps else 1.0


def vocabulary_stops(traces: list[Trace], in_draft: list[bool]) -> float:
    """The share of verify steps whose drafts stopped at a token outside the draft vocabulary (`in_draft`, by target
    id): no draft could have proposed the target's token there, however good the drafter; only a larger
    `vocab.draft_vocab_size` lets such a step go on. A trace's first token is the prefill's; each step then adds
    its accepted drafts and the target's own token, where a step that stopped short of its drafts was rejected."""
    steps = stopped = 0
    for trace in traces:
        position = 1
        for accepted, drafted in zip(trace.accepted, trace.drafted, strict=True):
            rejected_at = position + accepted
            if accepted < drafted and rejected_at < len(trace.tokens):  # (a last step's tokens may be cut)
                stopped += not in_draft[trace.tokens[rejected_at]]
            steps += 1
            position = rejected_at + 1
    return stopped / max(steps, 1)


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


class PhaseClock:
    """Time per phase of each step: on a GPU spans of the device's timeline between CUDA events (idle gaps included
    where the host is behind), read once at the end; wall time where there is no GPU."""

    def __init__(self, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self.steps: list[list[tuple[str | None, Any]]] = []

    def start(self) -> None:
        """A new step."""
        self.steps.append([(None, self._now())])

    def mark(self, phase: str) -> None:
        """The end of `phase` in the current step."""
        self.steps[-1].append((phase, self._now()))

    def _now(self) -> Any:
        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def totals(self, steps: int) -> dict[str, float]:
        """Seconds per phase over the first `steps` steps (not a step launched past the end and dropped)."""
        seconds = {"draft": 0.0, "verify": 0.0}
        for marks in self.steps[:steps]:
            for (_, begin), (phase, end) in zip(marks, marks[1:], strict=False):
                seconds[phase] += begin.elapsed_time(end) / 1000 if self.on_gpu else end - begin
        return seconds
