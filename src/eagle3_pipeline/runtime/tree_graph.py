"""A whole draft tree (tree.py's rule: SGLang's EAGLE-2/3 dynamic tree) as tensors only, so that one CUDA graph
can replay it, as draft_graph.py does for the chain.

Every shape is fixed by the setting (steps, topk, tokens): the frontier is always `topk` nodes, a depth after
the first adds topk * topk candidates (topk + (steps - 1) * topk^2 in all), and the drafter's tree rows (`topk`
per expanded depth) live in fixed buffers (`TreeRows`) beside the real rows' StaticKV (real row p in slot p).
Which real row starts the tree, the frontier's choice and the kept nodes are index tensors; nothing is read
back to the host until the whole tree is packed into one [4, tokens - 1] tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagle3_pipeline.drafter.attention import StaticKV, grouped_attention
from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.runtime.draft_graph import CapturedCalls, cache_key, split_rows, to_target


@dataclass(frozen=True)
class TreeRows:
    """The drafter's keys and values of a tree's rows, [1, kv_heads, (steps - 1) * topk, head_dim]: the rows of
    depth d (d = 1..steps-1, the nodes expanded there) at (d - 1) * topk .. d * topk - 1."""
    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def empty(cls, drafter: Drafter, rows: int) -> TreeRows:
        config, weight = drafter.config, drafter.fc.weight
        shape = (1, config.num_key_value_heads, rows, config.head_dim)
        return cls(torch.zeros(shape, device=weight.device, dtype=weight.dtype),
                   torch.zeros(shape, device=weight.device, dtype=weight.dtype))


@dataclass(frozen=True)
class TreeDepthKV:
    """The cache one depth's rows attend through: they are written to the tree rows from `start` on and see the
    columns where `visible` [rows, real capacity + tree rows] is true (the real rows, their ancestors, themselves)."""
    real: StaticKV
    rows: TreeRows
    start: int
    visible: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, TreeDepthKV]:
        end = self.start + k.shape[2]
        self.rows.keys[:, :, self.start:end].copy_(k)
        self.rows.values[:, :, self.start:end].copy_(v)
        keys = torch.cat([self.real.keys, self.rows.keys], dim=2)
        values = torch.cat([self.real.values, self.rows.values], dim=2)
        return grouped_attention(q, keys, values, self.visible), self


def tree_steps(drafter: Drafter, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               last: torch.Tensor, cache: StaticKV, rows: TreeRows, steps: int, topk: int, kept: int
               ) -> tuple[torch.Tensor]:
    """Real rows (ids [1,W], features [1,W,3H], positions [1,W]) into `cache`, then the tree from real row `last`
    ([1] long): its `kept` best nodes as one float64 tensor [4, kept] (target id, parent node - 0 is the root -,
    depth, cumulative draft log-probability) in candidate order, parents first."""
    logits, hidden, _ = drafter.decode(ids, hidden, positions, cache)
    position = positions.index_select(1, last)  # [1,1]: n-1, the last real row's
    scores, draft_ids = top_k(torch.log_softmax(logits[0].index_select(0, last).float(), -1), topk)
    scores, draft_ids = scores[0], draft_ids[0]
    parents = torch.full((topk,), -1, device=ids.device)
    candidates = [(scores, draft_ids, parents)]
    frontier_index, frontier_hidden = torch.arange(topk, device=ids.device), hidden.index_select(1, last)
    frontier_hidden, parent_row = frontier_hidden.expand(1, topk, -1), parents
    tree_rows = rows.keys.shape[2]
    real_visible = (torch.arange(cache.capacity, device=ids.device)[None] <= position[0]).expand(topk, -1)
    seen = torch.zeros(tree_rows, tree_rows, dtype=torch.bool, device=ids.device)  # tree row i sees row j
    for depth in range(1, steps):
        start = (depth - 1) * topk
        new = (seen.index_select(0, parent_row) if depth > 1
               else torch.zeros(topk, tree_rows, dtype=torch.bool, device=ids.device))
        new[:, start:start + topk] = torch.eye(topk, dtype=torch.bool, device=ids.device)
        seen[start:start + topk] = new
        depth_cache = TreeDepthKV(cache, rows, start, torch.cat([real_visible, new], dim=1))
        logits, out_hidden, _ = drafter.decode(to_target(drafter, draft_ids)[None], frontier_hidden,
                                               (position + depth).expand(1, topk), depth_cache)
        child_scores, child_ids = top_k(torch.log_softmax(logits[0].float(), -1), topk)
        child_scores, child_ids = (scores[:, None] + child_scores).flatten(), child_ids.flatten()
        candidates.append((child_scores, child_ids, frontier_index.repeat_interleave(topk)))
        # the next frontier: the best `topk` children (stable: ties go to the earlier child)
        best = torch.sort(child_scores, descending=True, stable=True).indices[:topk]
        first = topk + (depth - 1) * topk * topk  # candidate index of this depth's first child
        frontier_index, parent_row = first + best, start + best // topk
        scores, draft_ids = child_scores.index_select(0, best), child_ids.index_select(0, best)
        frontier_hidden = out_hidden.index_select(1, best // topk)
    return (keep_best(drafter, candidates, topk, kept),)


def top_k(scores: torch.Tensor, k: int, slice_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores.topk(k)` over the rows of [rows, width], in two passes on a GPU when the rows are wide: the best k of
    every `slice_width` columns (default 1024), then the best k of those. torch's top-k gives a row one GPU block,
    which made it the costliest kernel of a tree step (80 us for 8 rows of a 16k draft vocabulary on an H200, more
    than the drafter's forward); slices spread the first pass over many blocks. On a CPU one pass is faster.
    Which of equal scores wins is unspecified, as in torch.topk."""
    rows, width = scores.shape
    if slice_width is None:
        slice_width = 1024 if scores.device.type == "cuda" else width
    slices = -(-width // slice_width)
    if slices < 4 or k > slice_width:
        return scores.topk(k)
    padded = torch.nn.functional.pad(scores, (0, slices * slice_width - width), value=float("-inf"))
    values, columns = padded.view(rows, slices, slice_width).topk(k)  # [rows, slices, k]
    columns = columns + torch.arange(0, slices * slice_width, slice_width, device=scores.device)[:, None]
    best, chosen = values.view(rows, slices * k).topk(k)
    return best, columns.view(rows, slices * k).gather(1, chosen)


def keep_best(drafter: Drafter, candidates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], topk: int,
              kept: int) -> torch.Tensor:
    """The best `kept` candidates (scores, draft ids, parent candidate -1 for the root's children, per depth) by
    cumulative log-probability, in candidate (parent-first) order, packed as `tree_steps` returns them. Ties go
    to the earlier candidate (a stable sort), and a child's score is never above its parent's, so a node never
    comes without its parent."""
    scores, ids, parents = (torch.cat(parts) for parts in zip(*candidates, strict=True))
    best = torch.sort(scores, descending=True, stable=True).indices[:kept].sort().values
    parent = parents.index_select(0, best)
    node = torch.where(parent < 0, 0, torch.searchsorted(best, parent.clamp(min=0)) + 1)
    depth = torch.where(best < topk, 1, 2 + (best - topk) // (topk * topk))
    columns = [to_target(drafter, ids.index_select(0, best)), node, depth, scores.index_select(0, best)]
    return torch.stack([column.double() for column in columns])  # float64 holds every token id exactly


def tree_drafts(integers: torch.Tensor, hidden: torch.Tensor, **fixed: Any) -> tuple[torch.Tensor]:
    """`tree_steps` from packed integer inputs (`draft_graph.split_rows`): what a recorded tree runs."""
    ids, positions, last = split_rows(integers, hidden.shape[1])
    return tree_steps(ids=ids, hidden=hidden, positions=positions, last=last, **fixed)


class CapturedTree:
    """`tree_drafts` for a StaticKV cache with steps + 1 real rows, replayed from CUDA graphs recorded on first use
    (one per cache; a setting's tree rows are its drafter's own). `fuse`: of inductor's kernels (compiled on first
    use); False: the eager kernels recorded as they are (nothing to compile)."""

    def __init__(self, drafter: Drafter, rows: TreeRows, steps: int, topk: int, kept: int, log: Any = None,
                 fuse: bool = True):
        self.fixed = {"drafter": drafter, "rows": rows, "steps": steps, "topk": topk, "kept": kept}
        self.calls = CapturedCalls(tree_drafts, fuse=fuse, log=log)

    def __call__(self, integers: torch.Tensor, hidden: torch.Tensor, cache: StaticKV) -> torch.Tensor:
        (packed,) = self.calls(cache_key(cache), {"integers": integers, "hidden": hidden}, cache=cache, **self.fixed)
        return packed
