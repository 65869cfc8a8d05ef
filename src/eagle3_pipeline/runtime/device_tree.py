"""An EAGLE-3 draft tree's steps in the device-resident decoding loop (pipelined.py `decode_on_device`): the twin of
what the host loop does with a drafted tree (proposers.Draft `accept`/`commit`, tree.TreeDrafter), on the device.

A step is the compiled target verify of the tree (`TargetRuntime.forward_tree_device`: ids, positions n + depth and
the additive mask over the static cache, all from `TreeState`), then one recorded graph (`verified_tree_step`): the
accepted path from the verify's argmax and the tree's ancestry, its rows moved down the target cache (the rest
forgotten), the path's real rows into the drafter's cache, the next tree (tree_graph.tree_steps), and the next
verify's ids, positions and mask written into the loop's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.draft_graph import RecordedStep, Restore, saved
from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.kv_cache import length_tensors, row_tensors
from eagle3_pipeline.runtime.methods import TreeSetting
from eagle3_pipeline.runtime.target_attention import tree_mask
from eagle3_pipeline.runtime.tree_graph import TreeRows, tree_steps


class TreeDrafting(Protocol):
    """What the tree's steps need of its drafter (tree.TreeDrafter, which builds them)."""
    setting: TreeSetting
    proposer: DrafterProposer  # the drafter's static cache of real rows
    rows: TreeRows
    recorded_step: RecordedStep | None  # kept across prompts

    def packed(self, context: list[int], features: torch.Tensor, fused: bool = True) -> torch.Tensor: ...

    def reset(self, rows: int = 0) -> None: ...


@dataclass(frozen=True)
class TreeState:
    """A draft tree's loop state on the device, node 0 the root (the target's next token): the verify's inputs (ids
    [1,T], positions [1,T], additive mask [1,1,T,slots]) and what accepting needs (rows the target has seen `n` [1],
    parent node [T] - the root its own -, depth [T], ancestry [T,T])."""
    n: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    visible: torch.Tensor

    @classmethod
    def empty(cls, width: int, slots: int, dtype: torch.dtype, device: torch.device) -> TreeState:
        def integers(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)
        return cls(integers(1), integers(1, width), integers(1, width),
                   torch.zeros(1, 1, width, slots, dtype=dtype, device=device), integers(width), integers(width),
                   torch.zeros(width, width, dtype=torch.bool, device=device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.n, self.ids, self.positions, self.mask, self.parents, self.depths, self.visible

    def set(self, n: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, depth: int
            ) -> None:
        """A tree of ids/parents/depths [T] (the root first), at most `depth` deep, verified after n ([1]) cached
        rows."""
        visible = ancestry(parents, depth)
        self.n.copy_(n)
        self.ids.copy_(ids[None])
        self.positions.copy_((n + depths)[None])
        self.mask.copy_(tree_mask(n, visible, self.mask.shape[-1], self.mask.dtype))
        self.parents.copy_(parents)
        self.depths.copy_(depths)
        self.visible.copy_(visible)


def ancestry(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[T, T] bool: node i sees node j when j is i or one of its ancestors (Draft.visible on the device; parents[0]
    = 0, the root its own parent; `depth`: the tree's deepest level)."""
    nodes = torch.arange(parents.shape[0], device=parents.device)
    seen, ancestor = nodes[:, None] == nodes[None], nodes
    for _ in range(depth):
        ancestor = parents.index_select(0, ancestor)
        seen = seen | (ancestor[:, None] == nodes[None])
    return seen


def verified_tree_step(logits: torch.Tensor, aux: torch.Tensor, tree: TreeState, lengths: list[torch.Tensor],
                       layers: list[torch.Tensor], drafter: Any, cache: Any, rows: TreeRows, steps: int, topk: int
                       ) -> tuple[torch.Tensor]:
    """After the verify of `tree` (logits [T, V], aux features [T, 3H], written at target cache slots n..n+T-1):
    the longest path whose every node's token is the target's argmax at its parent, and the bonus token; the
    path's rows moved down to slots n+1.. of the target cache (`layers`: every layer's keys and values), the rest
    forgotten (`lengths`); the path's real rows into the drafter's `cache` and the next tree drafted from them
    (tree_graph.tree_steps); the next tree written into `tree`. Returns [accepted, the verified tree's depth, the
    steps + 1 new tokens: the path's, then the bonus token repeated]."""
    width = tree.parents.shape[0]
    n, ids, device = tree.n, tree.ids[0], tree.n.device
    nodes = torch.arange(width, device=device)
    predictions = logits.argmax(-1)
    matches = (ids == predictions.index_select(0, tree.parents)) | (nodes == 0)
    on_path = ~(tree.visible & ~matches[None]).any(1)  # every node from the root down to it matches
    accepted = on_path.long().sum() - 1
    levels = torch.arange(1, steps + 1, device=device)
    path = (on_path[None] & (tree.depths[None] == levels[:, None])).long().argmax(1)  # node at depth d; 0 past it
    last = (on_path.long() * (tree.depths + 1)).argmax()  # the deepest node on the path (siblings differ)
    bonus = predictions.index_select(0, last.view(1))
    index = torch.arange(steps + 1, device=device)
    tokens = torch.where(index < accepted, torch.cat([ids.index_select(0, path), bonus]), bonus)
    drafted = tree.depths.max().view(1)
    source, moved = n + path, n + 1 + index[:steps]  # past the path: the root's row, into slots forgotten below
    for tensor in layers:
        tensor.index_copy_(2, moved, tensor.index_select(2, source))
    # layer by layer, not one multi-tensor subtraction: fused for the H200, that one subtracted the wrong operand in
    # the GPU test (width - 1 - the path's first token, not the rejected rows), and the lengths ran off the cache
    rejected = width - 1 - accepted
    for length in lengths:
        length.sub_(rejected)
    real_rows = torch.cat([nodes[:1], path]).index_select(0, torch.minimum(index, accepted))  # root, path, padding
    hidden = aux.index_select(0, real_rows).to(drafter.fc.weight.dtype)
    (packed,) = tree_steps(drafter, tokens[None], hidden[None], (n + index)[None], accepted.view(1), cache, rows,
                           steps, topk, width - 1)
    root = nodes[:1]
    tree.set(n + accepted + 1, torch.cat([bonus, packed[0].long()]), torch.cat([root, packed[1].long()]),
             torch.cat([root, packed[2].long()]), steps)
    return (torch.cat([accepted.view(1), drafted, tokens]),)


class TreeSteps:
    """An EAGLE-3 draft tree in the device-resident loop: the first tree drafted as the host loop drafts it
    (`TreeDrafter.packed`, left on the device), then verify -> `verified_tree_step`. The recorded
    step and the loop states are kept with the tree drafter (`recorded_step`)."""
    drafting = True

    def __init__(self, tree_drafter: TreeDrafting, log: Any = None):
        setting, proposer = tree_drafter.setting, tree_drafter.proposer
        if tree_drafter.recorded_step is None:
            tree_drafter.recorded_step = RecordedStep(verified_tree_step, proposer.captured is not None,
                                                      "device-resident tree step", log)
        self.tree_drafter, self.proposer, self.recorded = tree_drafter, proposer, tree_drafter.recorded_step
        self.steps, self.topk, self.tokens = setting.num_steps, setting.topk, setting.num_draft_tokens
        self.width = self.steps + 3

    def begin(self, target: TargetRuntime, cache: Any, context: list[int], features: torch.Tensor) -> None:
        if (needed := self.tree_drafter.setting.rows_ahead) > target.headroom:
            raise ValueError(f"the device-resident tree (steps={self.steps}, tokens={self.tokens}) runs a step past "
                             f"the end: its caches need {needed} slots beyond the sequence, they keep "
                             f"{target.headroom}")
        packed = self.tree_drafter.packed(context, features, fused=False)  # the prompt's rows, then the first tree
        slots, device = int(cache.get_max_length()), target.device
        self.state = self.recorded.buffer((self.tokens, slots), lambda: TreeState.empty(
            self.tokens, slots, target.model.get_input_embeddings().weight.dtype, device))
        n, root = torch.tensor([len(context) - 1, context[-1]]).to(device, non_blocking=True)
        zero = torch.zeros(1, dtype=torch.int64, device=device)  # the root is its own parent, at depth 0
        ids, parents, depths = (torch.cat([first, column.long()]) for first, column in
                                zip((root.view(1), zero, zero), packed[:3], strict=True))
        self.state.set(n.view(1), ids, parents, depths, self.steps)  # nothing read back to the host
        self.lengths, self.layers = length_tensors(cache), row_tensors(cache)
        self.key = self.recorded.graph_key(self.proposer.cache, self.tokens, self.lengths)

    def verify(self, target: TargetRuntime, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return target.forward_tree_device(self.state.ids, self.state.positions, self.state.mask, cache)

    def advance(self, logits: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return self.recorded(self.key, {"logits": logits, "aux": aux}, self.snapshot, tree=self.state,
                             lengths=self.lengths, layers=self.layers, drafter=self.proposer.drafter,
                             cache=self.proposer.cache, rows=self.tree_drafter.rows, steps=self.steps,
                             topk=self.topk)

    def snapshot(self) -> Restore:
        """The loop state, the cache lengths and the target cache's rows n..n+T-1 (the verified tree's, within which
        the step moves the path's rows): a window, not the whole cache, and nothing read back to the host."""
        slots = self.state.n + torch.arange(self.tokens, device=self.state.n.device)
        windows = [tensor.index_select(2, slots) for tensor in self.layers]
        restore_state = saved((*self.state.tensors(), *self.lengths))

        def restore() -> None:
            restore_state()
            for tensor, window in zip(self.layers, windows, strict=True):
                tensor.index_copy_(2, slots, window)
        return restore

    def read(self, values: list[int]) -> tuple[int, int, list[int]]:
        return values[0], values[1], values[2:values[0] + 3]

    def cached_rows(self) -> int:
        return int(self.state.n)

    def end(self) -> None:
        self.tree_drafter.reset()
