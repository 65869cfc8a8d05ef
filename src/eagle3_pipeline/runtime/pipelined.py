"""The decoding loop with its state on the device (compiled runtimes): the twin of speculative.py's host loop.

The host loop (speculative.py `decode`) reads every step's outcome back - the argmax, the accepted drafts -
before it launches the next step, so the device idles while Python dispatches it: on an H200 the compiled SmolLM2
step is 1.4 ms of kernels and ~0.9 ms of host work, one after the other. Here each step's inputs are computed on the
device from the last step's outputs, and the host reads a step's tokens back one step late (a non-blocking copy
into pinned memory): it dispatches step t+1 while the device runs step t, as a server's overlap scheduler does.

One loop (`decode_on_device`) runs every method whose drafts come from the device; a method's `DeviceSteps` say
how it verifies and advances:
- `GreedySteps`, the target alone: each step's input is the last step's argmax (so the speedups compare like with
  like);
- `ChainSteps`, an EAGLE-3 chain of k: the compiled target verify of [bonus, d1..dk], then one recorded graph
  (`verified_step`): the accepted count and the bonus token from the verify's argmax, the target cache's rejected
  rows forgotten, the new real rows (accepted drafts and bonus, padded to k + 1 as `DrafterProposer.real_rows` pads
  them) into the drafter's cache, the next k drafts, and the next verify's ids written into the loop's state;
- `device_tree.TreeSteps`, an EAGLE-3 draft tree (SGLang's setting): the compiled target verify of the tree with its
  mask, then one recorded graph that accepts the path, moves its rows down the target cache, drafts the next tree
  and writes the next verify's inputs.
The tokens, accepted counts and verify forwards are those of the host loop (tested). A step launched while the
host has not yet read that the sequence ended is dropped uncounted; its time counts. Draft and verify times per
step are the device's (CUDA events), since the host no longer waits for either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.draft_graph import RecordedStep, Restore, chain_steps, saved
from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.kv_cache import length_tensors
from eagle3_pipeline.runtime.traces import PhaseClock, Trace, append_until_eos, prefill, synchronize


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


class DeviceSteps(Protocol):
    """A method's steps in the device-resident loop. `drafting` False: the target alone; `width`: integers each
    step reports to the host."""
    drafting: bool
    width: int

    def begin(self, target: TargetRuntime, cache: Any, context: list[int], features: torch.Tensor) -> None:
        """The loop's state after the prompt (a drafting method: its first drafts, from the prompt's rows)."""
        ...

    def verify(self, target: TargetRuntime, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward over the state's next verify ids: logits and aux features."""
        ...

    def advance(self, logits: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """Accept, commit and draft on the device, the next verify's inputs into the state: the step's report."""
        ...

    def read(self, values: list[int]) -> tuple[int, int, list[int]]:
        """A report read back: (drafts accepted, longest path offered, the step's new tokens)."""
        ...

    def end(self) -> None:
        """After the sequence (a drafter's rows were written on the device: the host's count of them is stale)."""
        ...

    def cached_rows(self) -> int | None:
        """The target cache's rows as the loop state counts them (read once the device is idle), None where the
        state does not count them: the cache must hold as many."""
        ...


@torch.inference_mode()  # the caches' tensors are inference tensors
def decode_on_device(target: TargetRuntime, steps: DeviceSteps, prompt_ids: list[int], max_new: int, eos: set[int],
                     prompt_id: str, method: str) -> Trace:
    """Decode one prompt with the loop's state on the device: prefill, begin, then verify -> advance steps launched
    one ahead of reading their reports (`run_ahead`), until max_new tokens or the end of the sequence."""
    trace = Trace(prompt_id, method, [], loop="device")
    start = time.perf_counter()
    cache, features, context = prefill(target, prompt_ids, max_new, trace)
    clock, drafting = PhaseClock(target.device), steps.drafting
    if drafting:
        clock.start()
    steps.begin(target, cache, context, features)
    if drafting:
        clock.mark("draft")  # the prompt's rows, then the first drafts
    reader = LateReader(steps.width, target.device)

    def launch() -> None:
        clock.start()
        logits, aux = steps.verify(target, cache)
        clock.mark("verify")
        reader.push(steps.advance(logits, aux))
        if drafting:
            clock.mark("draft")

    def record(values: list[int]) -> None:
        accepted, drafted, tokens = steps.read(values)
        if drafting:
            trace.accepted.append(accepted)
            trace.drafted.append(drafted)
        trace.target_forwards += 1
        append_until_eos(trace, context, tokens, eos)

    run_ahead(trace, launch, reader, record, max_new, eos)
    synchronize(target.device)
    check_rows(steps, cache, method)
    steps.end()
    return finish(trace, clock, drafting, start, max_new)


def check_rows(steps: DeviceSteps, cache: Any, method: str) -> None:
    """Raise where the target cache's length and the loop state's row count differ after a prompt: a recorded step
    moved rows or rewound lengths wrongly, and the timing would be of a broken decode (the timing pass's warm-up
    then times the method in the host loop)."""
    if (rows := steps.cached_rows()) is None:
        return
    held = sorted(set(torch.cat([lengths.reshape(-1) for lengths in length_tensors(cache)]).tolist()))  # one read
    if held != [rows]:  # every layer's length: a step that rewound some layers and not others is caught too
        raise RuntimeError(f"{method}: after the device-resident loop the target cache holds "
                           f"{' / '.join(map(str, held))} rows, the loop state counts {rows}")


def finish(trace: Trace, clock: PhaseClock, drafting: bool, start: float, max_new: int) -> Trace:
    """The trace's tokens cut at max_new and its seconds: the whole, and per phase from the device's clock."""
    trace.tokens = trace.tokens[:max_new]
    trace.total_seconds = time.perf_counter() - start  # a step launched past the end included: it was paid for
    first = 1 if drafting else 0  # a drafting method's clock starts with the prompt's drafting
    seconds = clock.totals(first + trace.target_forwards)
    trace.verify_seconds = seconds["verify"]
    if drafting:
        trace.draft_seconds = seconds["draft"]
        trace.prompt_draft_seconds = clock.totals(1)["draft"]
    else:
        trace.target_forwards = max(trace.target_forwards, 1)  # as the host loop counts a prompt ended by its prefill
    return trace


def run_ahead(trace: Trace, launch: Callable[[], None], reader: LateReader, record: Callable[[list[int]], None],
              max_new: int, eos: set[int]) -> None:
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


class GreedySteps:
    """The target alone: each step's input is the last step's argmax, on the device."""
    drafting = False
    width = 1

    def begin(self, target: TargetRuntime, cache: Any, context: list[int], features: torch.Tensor) -> None:
        self.token = torch.tensor([[context[-1]]], device=target.device)

    def verify(self, target: TargetRuntime, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return target.forward_device(self.token, cache)

    def advance(self, logits: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        self.token = logits[-1:].argmax(-1, keepdim=True)
        return self.token[0]

    def read(self, values: list[int]) -> tuple[int, int, list[int]]:
        return 0, 0, values

    def end(self) -> None:
        pass

    def cached_rows(self) -> None:
        return None  # the compiled target step counts its own rows


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


class ChainSteps:
    """An EAGLE-3 chain of k in the device-resident loop. Its state [n, x_n, d1..dk] and recorded step
    (`verified_step`) are kept with the proposer (`DrafterProposer.recorded_step`)."""
    drafting = True

    def __init__(self, proposer: DrafterProposer, k: int, log: Any = None):
        if proposer.recorded_step is None:
            proposer.recorded_step = RecordedStep(verified_step, proposer.captured is not None,
                                                  "device-resident chain step", log)
        self.proposer, self.k, self.recorded = proposer, k, proposer.recorded_step
        self.width = k + 2

    def begin(self, target: TargetRuntime, cache: Any, context: list[int], features: torch.Tensor) -> None:
        k = self.k
        if 4 * k + 2 > target.headroom:  # never with the 64-token prefill width, which sets the headroom
            raise ValueError(f"the device-resident chain at k={k} runs steps past the end (one past the sequence, two "
                             f"more while recording): its caches need {4 * k + 2} slots beyond the sequence, they "
                             f"keep {target.headroom}")
        drafts, _ = self.proposer.chain(context, features, k)  # the prompt's rows, then the first chain
        self.state = self.recorded.buffer((k,), lambda: torch.empty(k + 2, dtype=torch.int64, device=drafts.device))
        self.state[:2].copy_(torch.tensor([len(context) - 1, context[-1]]), non_blocking=True)
        self.state[2:].copy_(drafts)
        self.lengths = length_tensors(cache)
        self.key = self.recorded.graph_key(self.proposer.cache, k, self.lengths)

    def verify(self, target: TargetRuntime, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return target.forward_device(self.state[1:][None], cache)

    def advance(self, logits: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return self.recorded(self.key, {"logits": logits, "aux": aux}, self.snapshot, state=self.state,
                             lengths=self.lengths, drafter=self.proposer.drafter, cache=self.proposer.cache, k=self.k)

    def snapshot(self) -> Restore:
        return saved((self.state, *self.lengths))  # (the target cache's rows: the step only forgets some)

    def read(self, values: list[int]) -> tuple[int, int, list[int]]:
        return values[0], self.k, values[1:values[0] + 2]

    def cached_rows(self) -> int:
        return int(self.state[0])

    def end(self) -> None:
        self.proposer.reset()
