"""Target-only greedy and the EAGLE-3 chain with the decoding loop's state on the device (compiled runtimes).

The host loop (speculative.py `decode`) reads every step's outcome back - the argmax, the accepted drafts -
before it launches the next step, so the device idles while Python dispatches it: on an H200 the compiled SmolLM2
step is 1.4 ms of kernels and ~0.9 ms of host work, one after the other. Here each step's inputs are computed on the
device from the last step's outputs, and the host reads a step's tokens back one step late (a non-blocking copy
into pinned memory): it dispatches step t+1 while the device runs step t, as a server's overlap scheduler does.
Target-only greedy runs the same way, so the speedups compare like with like.

A chain step after the first is the compiled target verify of [bonus, d1..dk], then one recorded graph
(`verified_step`): the accepted count and the bonus token from the verify's argmax, the target cache's rejected
rows forgotten, the new real rows (accepted drafts and bonus, padded to k + 1 as `DrafterProposer.real_rows` pads
them) into the drafter's cache, the next k drafts, and the next verify's ids written into the loop's state.
The tokens, accepted counts and verify forwards are those of the host loops (tested). A step launched while the
host has not yet read that the sequence ended is dropped uncounted; its time counts. Draft and verify times per
step are the device's (CUDA events), since the host no longer waits for either.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.draft_graph import CapturedCalls, cache_key, chain_steps
from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.traces import Trace, append_until_eos, prefill, synchronize


def verified_step(logits: torch.Tensor, aux: torch.Tensor, state: torch.Tensor, lengths: list[torch.Tensor],
                  drafter: Any, cache: Any, k: int) -> tuple[torch.Tensor]:
    """After the verify of state[1:] = [x_n, d1..dk] (logits [k+1, V], aux features [k+1, 3H]) at rows
    state[0] = n..n+k: forget the rejected rows (`lengths`: the target cache layers' lengths), draft the next k from
    the accepted rows, and write [n + accepted + 1, bonus, next drafts] into `state`. Returns [accepted, the k + 1
    new tokens: the accepted drafts, then the bonus token repeated]."""
    n, verified = state[0], state[1:]
    predictions = logits.argmax(-1)
    accepted = (verified[1:] == predictions[:k]).long().cumprod(0).sum()
    bonus = predictions.index_select(0, accepted.view(1))
    index = torch.arange(k + 1, device=state.device)
    tokens = torch.where(index < accepted, torch.cat([verified[1:], bonus]), bonus)
    # one multi-tensor kernel for every layer's length, not one per layer (a tensor list: a 0-d tensor operand
    # would be read back to the host, a graph break)
    torch._foreach_sub_(lengths, [k - accepted] * len(lengths))
    hidden = aux.index_select(0, torch.minimum(index, accepted)).to(drafter.fc.weight.dtype)
    drafts, _, _ = chain_steps(drafter, tokens[None], hidden[None], (n + index)[None], accepted.view(1), cache, k)
    state.copy_(torch.cat([(n + accepted + 1).view(1), bonus, drafts]))
    return (torch.cat([accepted.view(1), tokens]),)


class VerifiedSteps:
    """`verified_step` with a drafter's static cache: on CUDA replayed from a CUDA graph of inductor's kernels,
    recorded on first use per (drafter cache, k, target cache's length tensors); eagerly elsewhere. Kept with its
    proposer (`DrafterProposer.device_steps`), with one loop state per k, so that every prompt replays the same
    graphs."""

    def __init__(self, proposer: DrafterProposer, log: Any = None):
        self.proposer, self.log = proposer, log
        self.calls = CapturedCalls(verified_step, fuse=True, log=log) if proposer.captured is not None else None
        self.states: dict[int, torch.Tensor] = {}
        self.lengths: list[torch.Tensor] | None = None
        self.lengths_key: tuple[int, ...] = ()

    @classmethod
    def of(cls, proposer: DrafterProposer, log: Any = None) -> VerifiedSteps:
        if proposer.device_steps is None:
            proposer.device_steps = cls(proposer, log)
        return proposer.device_steps

    def start(self, n: int, token: int, drafts: torch.Tensor) -> torch.Tensor:
        """The loop state [n, x_n, d1..dk] of a sequence whose target has seen n rows (x_n not yet)."""
        k = len(drafts)
        if k not in self.states:
            self.states[k] = torch.empty(k + 2, dtype=torch.int64, device=drafts.device)
        state = self.states[k]
        state[:2].copy_(torch.tensor([n, token]), non_blocking=True)
        state[2:].copy_(drafts)
        return state

    def __call__(self, logits: torch.Tensor, aux: torch.Tensor, state: torch.Tensor, lengths: list[torch.Tensor],
                 k: int) -> torch.Tensor:
        fixed = {"state": state, "lengths": lengths, "drafter": self.proposer.drafter, "cache": self.proposer.cache,
                 "k": k}
        if self.calls is None:
            return verified_step(logits, aux, **fixed)[0]
        if lengths is not self.lengths:  # a sequence's target cache: its layers' length tensors, by address
            self.lengths, self.lengths_key = lengths, tuple(length.data_ptr() for length in lengths)
        key = (*cache_key(self.proposer.cache), k, *self.lengths_key)
        if key not in self.calls.graphs and not self._record(key, logits, aux, fixed):
            return verified_step(logits, aux, **fixed)[0]
        return self.calls(key, {"logits": logits, "aux": aux}, **fixed)[0]

    def _record(self, key: tuple[int, ...], logits: torch.Tensor, aux: torch.Tensor, fixed: dict[str, Any]) -> bool:
        """Record the graph for `key` (it runs the step three times, whose effects on the loop state and the target
        cache's lengths are undone); False, logged, where recording fails: the steps run eagerly from then on."""
        mutated = (fixed["state"], *fixed["lengths"])
        saved = [tensor.clone() for tensor in mutated]
        try:
            self.calls(key, {"logits": logits, "aux": aux}, **fixed)
        except Exception as exc:  # capture unsupported here (the drafter cache's rows land at their positions again)
            if self.log is not None:
                self.log.warning("device-resident chain step: CUDA graph failed (%s: %s); running it eagerly",
                                 type(exc).__name__, str(exc)[:300])
            self.calls = None
        for tensor, value in zip(mutated, saved, strict=True):
            tensor.copy_(value)
        return self.calls is not None


class LateReader:
    """Each step's small integer result copied to pinned host memory without waiting; `pull` returns the oldest
    one, waiting only until the device has produced it."""

    def __init__(self, width: int, device: torch.device, depth: int = 2):
        on_gpu = device.type == "cuda"
        self.rows = torch.empty((depth, width), dtype=torch.int64, pin_memory=on_gpu)
        self.events = [torch.cuda.Event() for _ in range(depth)] if on_gpu else None
        self.pushed = self.pulled = 0

    def push(self, values: torch.Tensor) -> None:
        slot = self.pushed % len(self.rows)
        self.rows[slot].copy_(values, non_blocking=True)
        if self.events is not None:
            self.events[slot].record()
        self.pushed += 1

    def pull(self) -> list[int]:
        slot = self.pulled % len(self.rows)
        if self.events is not None:
            self.events[slot].synchronize()
        self.pulled += 1
        return self.rows[slot].tolist()


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


def run_ahead(trace: Trace, launch: Any, reader: LateReader, record: Any, max_new: int, eos: set[int]) -> None:
    """Launch steps one ahead of reading them: `launch()` queues a step and pushes its result, `record(values)` takes
    a read result into the trace. A step read after the sequence ended (max_new tokens or end of sequence) is
    dropped."""
    in_flight = 0

    def ended() -> bool:
        return len(trace.tokens) >= max_new or trace.tokens[-1] in eos

    while True:
        if not ended() and len(trace.tokens) + in_flight < max_new:
            launch()
            in_flight += 1
            if in_flight < 2:
                continue  # keep the device one step ahead of the host
        if in_flight == 0:
            return
        values = reader.pull()
        in_flight -= 1
        if not ended():
            record(values)


@torch.inference_mode()  # the caches' tensors are inference tensors
def greedy_on_device(target: TargetRuntime, prompt_ids: list[int], max_new: int, eos: set[int], prompt_id: str
                     ) -> Trace:
    """Target-only greedy decoding, each step's input the last step's argmax on the device."""
    trace = Trace(prompt_id, "target", [], loop="device")
    start = time.perf_counter()
    cache, _, context = prefill(target, prompt_ids, max_new, trace)
    token = torch.tensor([[context[-1]]], device=target.device)
    reader, clock = LateReader(1, target.device), PhaseClock(target.device)

    def launch() -> None:
        nonlocal token
        clock.start()
        logits, _ = target.forward_device(token, cache)
        token = logits[-1:].argmax(-1, keepdim=True)
        clock.mark("verify")
        reader.push(token[0])

    def record(values: list[int]) -> None:
        trace.target_forwards += 1
        append_until_eos(trace, context, values, eos)

    run_ahead(trace, launch, reader, record, max_new, eos)
    synchronize(target.device)
    trace.total_seconds = time.perf_counter() - start  # a step launched past the end included: it was paid for
    trace.verify_seconds = clock.totals(trace.target_forwards)["verify"]
    trace.target_forwards = max(trace.target_forwards, 1)  # as the host loop counts a prompt ended by its prefill
    return trace


@torch.inference_mode()
def chain_on_device(target: TargetRuntime, proposer: DrafterProposer, prompt_ids: list[int], k: int, max_new: int,
                    eos: set[int], prompt_id: str, method: str) -> Trace:
    """EAGLE-3 chain decoding, each verify step's drafts and the next verify's ids computed on the device."""
    if 4 * k + 2 > target.headroom:  # never with the 64-token prefill width, which sets the headroom
        raise ValueError(f"the device-resident chain at k={k} runs steps past the end (one past the sequence, two "
                         f"more while recording): its caches need {4 * k + 2} slots beyond the sequence, they keep "
                         f"{target.headroom}")
    trace = Trace(prompt_id, method, [], loop="device")
    start = time.perf_counter()
    cache, features, context = prefill(target, prompt_ids, max_new, trace)
    clock = PhaseClock(target.device)
    clock.start()
    drafts, _ = proposer.chain(context, features, k)  # the prompt's rows, then the first chain
    clock.mark("draft")
    steps, reader = VerifiedSteps.of(proposer, target.log), LateReader(k + 2, target.device)
    state = steps.start(len(context) - 1, context[-1], drafts)
    lengths = [layer.cumulative_length for layer in cache.layers]

    def launch() -> None:
        clock.start()
        logits, aux = target.forward_device(state[1:][None], cache)
        clock.mark("verify")
        reader.push(steps(logits, aux, state, lengths, k))
        clock.mark("draft")

    def record(values: list[int]) -> None:
        accepted = values[0]
        trace.accepted.append(accepted)
        trace.drafted.append(k)
        trace.target_forwards += 1
        append_until_eos(trace, context, values[1:accepted + 2], eos)

    run_ahead(trace, launch, reader, record, max_new, eos)
    synchronize(target.device)
    trace.tokens = trace.tokens[:max_new]
    trace.total_seconds = time.perf_counter() - start  # a step launched past the end included: it was paid for
    seconds = clock.totals(1 + trace.target_forwards)  # the prompt's chain, then the recorded steps
    trace.draft_seconds, trace.verify_seconds = seconds["draft"], seconds["verify"]
    trace.prompt_draft_seconds = clock.totals(1)["draft"]  # the prompt's rows and first chain
    proposer.reset()  # its rows were written on the device: the host's count of them is stale
    return trace

