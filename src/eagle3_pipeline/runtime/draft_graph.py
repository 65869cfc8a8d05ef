"""A drafter's whole chain of k steps as tensors only, so that one CUDA graph can replay it.

`chain_steps` is the chain `DrafterProposer` drafts (served positions: real row p at position p, the first
draft from the last real row, chain row i at position n-1+i), written without reading any value back to the
host: which real row starts the chain is an index tensor, and draft ids map to target ids by `index_select`.
Eagerly it is the chain itself; on CUDA `CapturedChain` records it once per (k, cache) and replays it, so a
k-step chain costs one graph launch instead of ~30 kernel launches and a Python round trip per step (what
servers do: SGLang and vLLM capture their draft steps in CUDA graphs too).
"""

from __future__ import annotations

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


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    drafts: torch.Tensor
    logits: torch.Tensor


class CapturedChain:
    """`chain_steps` for a StaticKV cache with k+1 real rows, replayed from CUDA graphs recorded on first use
    (one per k and cache size). Inputs are copied into the graph's buffers, outputs
    copied out (the next replay overwrites them)."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def __call__(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                 cache: StaticKV, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (k, cache.keys.data_ptr())  # the proposer keeps its caches: an address is never reused
        if key not in self.graphs:
            self.graphs[key] = self._record(ids, hidden, positions, last, cache, k)
        recorded = self.graphs[key]
        for name, value in (("ids", ids), ("hidden", hidden), ("positions", positions), ("last", last)):
            recorded.inputs[name].copy_(value)
        recorded.graph.replay()
        return recorded.drafts.clone(), recorded.logits.clone()

    def _record(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                cache: StaticKV, k: int) -> _Graph:
        inputs = {"ids": ids.clone(), "hidden": hidden.clone(), "positions": positions.clone(), "last": last.clone()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (library handles, workspaces): it writes the same rows twice
            for _ in range(2):
                chain_steps(self.drafter, **inputs, cache=cache, k=k)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            drafts, logits, _ = chain_steps(self.drafter, **inputs, cache=cache, k=k)
        return _Graph(graph, inputs, drafts, logits)
