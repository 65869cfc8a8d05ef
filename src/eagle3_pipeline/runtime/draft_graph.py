"""A drafter's whole chain of k steps as tensors only, so that one CUDA graph can replay it.

`chain_steps` is the chain `DrafterProposer` drafts (served positions: real row p at position p, the first
draft from the last real row, chain row i at position n-1+i), written without reading any value back to the
host: which real row starts the chain is an index tensor, and draft ids map to target ids by `index_select`.
Eagerly it is the chain itself; on CUDA `CapturedChain` records it once per (k, cache) and replays it, so a
k-step chain costs one graph launch instead of ~60 kernel launches and a Python round trip per step (what
servers do: SGLang and vLLM capture their draft steps in CUDA graphs too). `CapturedCalls` is that recording and
replaying for any tensors-only drafting function (draft trees use it too: tree_graph.py); `RecordedStep`, for a
device-resident decoding loop's step, which also advances the loop's state (pipelined.py, device_tree.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eagle3_pipeline.drafter.attention import StaticKV
from eagle3_pipeline.drafter.model import Drafter


def chain_steps(drafter: Drafter, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                last: torch.Tensor, cache: Any, k: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Real rows (ids [1,W], features [1,W,3H], positions [1,W]) into `cache`, then k drafts from row `last`
    ([1] long): (draft target ids [k], their draft-vocab logits [k, K], the cache with the real rows)."""
    logits, hidden, cache = drafter.decode(ids, hidden, positions, cache)
    real = cache
    hidden = hidden.index_select(1, last)  # [1,1,H]
    logits = logits[0].index_select(0, last)[0]  # [K]
    position = positions.index_select(1, last)  # [1,1]: n-1
    drafts, chain_logits = [], []
    for step in range(k):
        token = to_target(drafter, logits.argmax().view(1))
        drafts.append(token)
        chain_logits.append(logits)
        if step + 1 < k:
            logits, hidden, cache = drafter.decode(token.view(1, 1), hidden, position + step + 1, cache)
            logits = logits[0, -1]
    return torch.cat(drafts), torch.stack(chain_logits), real


def to_target(drafter: Drafter, draft_ids: torch.Tensor) -> torch.Tensor:
    """`drafter.draft_to_target` without advanced indexing (a 0-d index would be read back to the host)."""
    return draft_ids + drafter.d2t.index_select(0, draft_ids)


def cache_key(cache: StaticKV) -> tuple[int, int]:
    """A static cache as a captured graph sees it: the address and the number of slots it reads and writes (a
    cache of the same size later allocated at the same address is, to the graph, the same cache)."""
    return cache.keys.data_ptr(), cache.capacity


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces (around every capture, as inductor's CUDA-graph trees do). A
    workspace first allocated inside a capture lives in that graph's private pool, but cuBLAS keeps using it for
    later work on the stream: once the graph is freed (and `torch.cuda.graph` empties the cache before the next
    capture) the next GEMM on that stream writes to unmapped memory - the illegal address the tree GPU test met
    after an earlier test's captured trees were freed. Cleared, each graph owns the workspace it recorded."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private API: absent on CPU builds
    if clear is not None:
        clear()


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]


# inductor's combo kernels (independent kernels fused side by side, e.g. a tree step's per-layer KV moves): on an
# H200 they cut the 5/8/32 tree's drafting from 0.75 to 0.65 ms per step (bench_decode.py --no-combo-kernels)
COMBO_KERNELS = True


def fused(steps: Callable[..., Any]) -> Callable[..., Any]:
    """`steps` compiled by inductor without CUDA graphs of its own (ours record it): a drafter step's norms,
    rotary and elementwise ops fuse into a few kernels instead of ~60 launches of tiny ones. One compilation per
    shape (k, cache size, tree setting)."""
    return torch.compile(steps, dynamic=False, options={"combo_kernels": True} if COMBO_KERNELS else None)


class CapturedCalls:
    """Calls of a tensors-only function `steps(**inputs, **fixed) -> tensors`, replayed from CUDA graphs recorded
    on first use, one per key. A key names what a graph reads and writes besides its inputs: the cache, by
    address and size (`cache_key`; graphs stay while the caller keeps caches of several sizes), and any length
    that shapes it. Inputs are copied into the graph's buffers, outputs copied out (the next replay overwrites
    them). `fuse`: the graphs record the inductor-compiled function (`fused`); where it fails to compile, the
    eager kernels, with the reason logged."""

    def __init__(self, steps: Callable[..., tuple[torch.Tensor, ...]], fuse: bool = False, log: Any = None):
        self.steps = steps
        self.fused = fused(steps) if fuse else None
        self.log = log
        self.graphs: dict[tuple[int, ...], _Graph] = {}

    def __call__(self, key: tuple[int, ...], inputs: dict[str, torch.Tensor],
                 reset: Callable[[], None] | None = None, **fixed: Any) -> tuple[torch.Tensor, ...]:
        """`reset`: puts back what a run changes besides its outputs, before each of the recording's runs (a step
        that advances a loop's state; drafting functions, which write the same rows each time, need none)."""
        if key not in self.graphs:
            self.graphs[key] = self._record(inputs, fixed, reset)
        recorded = self.graphs[key]
        for name, value in inputs.items():
            recorded.inputs[name].copy_(value)
        recorded.graph.replay()
        return tuple(output.clone() for output in recorded.outputs)

    def _record(self, inputs: dict[str, torch.Tensor], fixed: dict[str, Any],
                reset: Callable[[], None] | None) -> _Graph:
        inputs = {name: value.clone() for name, value in inputs.items()}
        if self.fused is not None:
            try:
                return self._capture(self._warm_up(self.fused, inputs, fixed, reset), inputs, fixed, reset)
            except Exception as exc:  # no Triton, an unsupported op, a compiler error, a failed capture
                if self.log is not None:
                    self.log.warning("fusing or recording the drafter's fused kernels failed (%s: %s); its CUDA "
                                     "graphs record the eager kernels", type(exc).__name__, str(exc)[:300])
                self.fused = None  # rerunning is safe: rows land at their positions again, `reset` undoes the rest
        return self._capture(self._warm_up(self.steps, inputs, fixed, reset), inputs, fixed, reset)

    @staticmethod
    def _capture(steps: Callable[..., Any], inputs: dict[str, torch.Tensor], fixed: dict[str, Any],
                 reset: Callable[[], None] | None = None) -> _Graph:
        if reset is not None:
            reset()  # before the capture: its copies are not part of the graph
        graph = torch.cuda.CUDAGraph()
        clear_cublas_workspaces()
        try:
            with torch.cuda.graph(graph):
                outputs = steps(**inputs, **fixed)
        finally:
            clear_cublas_workspaces()
        return _Graph(graph, inputs, outputs)

    @staticmethod
    def _warm_up(steps: Callable[..., Any], inputs: dict[str, torch.Tensor], fixed: dict[str, Any],
                 reset: Callable[[], None] | None = None) -> Callable[..., Any]:
        """`steps` after two runs on a side stream (compilation, library handles, workspaces; each from the same
        state: it writes the same rows, and `reset` puts back the rest), ready to record."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                if reset is not None:
                    reset()
                steps(**inputs, **fixed)
        torch.cuda.current_stream().wait_stream(side)
        return steps


def split_rows(integers: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A drafting step's integer inputs, packed by `DrafterProposer.real_rows` into one tensor [2W+1]: ids [1,W],
    positions [1,W] and the index of the last real row [1]."""
    return integers[:width][None], integers[width:2 * width][None], integers[2 * width:]


def chain_drafts(drafter: Drafter, integers: torch.Tensor, hidden: torch.Tensor, cache: Any, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`chain_steps` from packed integer inputs, without the cache it returns: what a recorded chain runs."""
    ids, positions, last = split_rows(integers, hidden.shape[1])
    return chain_steps(drafter, ids, hidden, positions, last, cache, k)[:2]


def write_rows(integers: torch.Tensor, hidden: torch.Tensor, drafter: Drafter, cache: StaticKV) -> tuple[()]:
    """Real rows from packed integer inputs into a static `cache`, without drafting (a prompt's rows)."""
    ids, positions, _ = split_rows(integers, hidden.shape[1])
    drafter.decode(ids, hidden, positions, cache)
    return ()


class CapturedChain:
    """`chain_drafts` for a StaticKV cache with k+1 real rows, replayed from CUDA graphs recorded on first use
    (one per k and cache); `fuse`: of its inductor-compiled kernels."""

    def __init__(self, drafter: Drafter, fuse: bool = True, log: Any = None):
        self.drafter = drafter
        self.calls = CapturedCalls(chain_drafts, fuse, log)

    def __call__(self, integers: torch.Tensor, hidden: torch.Tensor, cache: StaticKV, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        drafts, logits = self.calls((*cache_key(cache), k), {"integers": integers, "hidden": hidden},
                                    drafter=self.drafter, cache=cache, k=k)
        return drafts, logits


Restore = Callable[[], None]  # puts back what a step changed


class RecordedStep:
    """A loop's step (a tensors-only function returning one tensor) replayed on CUDA from CUDA graphs (of inductor's
    kernels, or of the eager ones where fusing fails), recorded on first use per key (what the graph reads and
    writes besides its inputs: the caches and the loop state); eagerly elsewhere. Kept with its proposer, with the
    loop states (`buffers`, by shape), so that every prompt replays the same graphs. A step that cannot be recorded
    on CUDA raises (the timing pass's warm-up then decodes that method in the host loop): run eagerly, hundreds of
    launches per step, it would be timed as the device-resident loop without being one."""

    def __init__(self, step: Callable[..., tuple[torch.Tensor]], on_cuda: bool, what: str, log: Any = None):
        self.step, self.what = step, what
        self.calls = CapturedCalls(step, fuse=True, log=log) if on_cuda else None
        self.buffers: dict[tuple[int, ...], Any] = {}

    def buffer(self, key: tuple[int, ...], make: Callable[[], Any]) -> Any:
        """The loop state kept under `key` (made on first use): the addresses a recorded graph writes to."""
        if key not in self.buffers:
            self.buffers[key] = make()
        return self.buffers[key]

    def graph_key(self, drafter_cache: StaticKV, shape: int, lengths: list[torch.Tensor]) -> tuple[int, ...]:
        """What a step's graph reads and writes besides its inputs: the drafter's cache, the step's shape (k, or a
        tree's tokens) and the target cache, by its layers' length tensors."""
        return (*cache_key(drafter_cache), shape, *(length.data_ptr() for length in lengths))

    def __call__(self, key: tuple[int, ...], inputs: dict[str, torch.Tensor], snapshot: Callable[[], Restore],
                 **fixed: Any) -> torch.Tensor:
        """`snapshot()` saves what the step changes besides its output (loop state, cache lengths and rows) and
        returns what puts it back: recording runs the step three times, each from the state it was called in."""
        if self.calls is None:
            return self.step(**inputs, **fixed)[0]
        if key not in self.calls.graphs:
            restore = snapshot()
            try:
                self.calls(key, inputs, reset=restore, **fixed)
            except Exception as exc:  # capture unsupported here
                raise RuntimeError(f"{self.what}: recording its CUDA graph failed ({type(exc).__name__}: "
                                   f"{str(exc)[:300]})") from exc
            finally:
                restore()
        return self.calls(key, inputs, **fixed)[0]



def saved(tensors: tuple[torch.Tensor, ...]) -> Restore:
    """A copy of `tensors` now, and what copies it back."""
    copies = [tensor.clone() for tensor in tensors]

    def restore() -> None:
        for tensor, copy in zip(tensors, copies, strict=True):
            tensor.copy_(copy)
    return restore
