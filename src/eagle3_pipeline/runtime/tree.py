"""EAGLE-2/3 dynamic draft trees, drafted and verified as SGLang serves EAGLE-3 (`--speculative-num-steps`,
`--speculative-eagle-topk`, `--speculative-num-draft-tokens`).

Drafting (SGLang `draft_forward` / `select_top_k_tokens` / `organize_draft_results`): depth 1 is the top-`topk` of
the first draft distribution (from the last real row). At each further depth the `topk` best nodes of the previous
depth (by cumulative log-probability) are expanded, each with its top-`topk` children; a node's drafter row is fed
its token at rotary position n-1+depth (the chain's rule) and attends to the real rows plus its own ancestors' rows.
After `num_steps` depths the best `num_draft_tokens - 1` of all candidates are kept (`num_draft_tokens` counts the
root: the target's own next token, which is verified with them). A child's cumulative log-probability is never above
its parent's and ties go to the earlier (shallower) candidate, so a kept node's ancestors are always kept. The
drafting runs as tensors only at shapes fixed by the setting (tree_graph.py), replayed from a CUDA graph on GPU.

Verifying (a drafted tree is a proposers.Draft, decoded by the one loop of speculative.py; with a compiled
runtime by its device-resident twin, device_tree.TreeSteps, which does the same on the device): one target forward
over [root, nodes...] at positions n + depth, each attending to the cached prefix, the root and its own ancestors.
The longest root-to-leaf path whose every token equals the target's argmax at its
parent is accepted, plus the target's token after it (the bonus); the target's cache keeps the prefix and that
path (a static cache: the tree, padded to num_draft_tokens rows and verified by the compiled step where there is
one, was written at slots n..n+T-1 and the path's rows are moved down to n+1..), and the path's aux features go
to the drafter.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.device_tree import TreeSteps
from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.kv_cache import has_sliding_layers
from eagle3_pipeline.runtime.methods import TreeSetting
from eagle3_pipeline.runtime.pipelined import DeviceSteps
from eagle3_pipeline.runtime.proposers import Draft
from eagle3_pipeline.runtime.tree_graph import CapturedTree, TreeRows, tree_drafts


def tree_problem(target: TargetRuntime) -> str | None:
    """Why trees cannot be verified on this target runtime, None when they can."""
    if has_sliding_layers(target.model):
        return "a sliding-window cache cannot drop a tree's rejected rows"
    return None


class TreeDrafter:
    """Dynamic trees from an EAGLE-3 drafter: its real rows in a DrafterProposer's static cache (padded to steps + 1
    rows, one shape per setting), the whole tree drafted by `tree_graph.tree_steps` with one device-to-host copy.
    `compiled` (CUDA): that drafting is recorded once per cache as a CUDA graph and replayed. A proposer of the
    decoding loop (proposers.Proposer): its drafts are verified with their tree mask."""
    drafting = True

    def __init__(self, drafter: Drafter, setting: TreeSetting, compiled: bool = False, log: Any = None):
        self.rows = TreeRows.empty(drafter, (setting.num_steps - 1) * setting.topk)
        on_cuda = compiled and self.rows.keys.device.type == "cuda"
        shape = (drafter, self.rows, setting.num_steps, setting.topk, setting.num_draft_tokens - 1, log)
        # by `fused`: inductor's kernels for the host loop, which drafts every step here; the device-resident loop
        # drafts only a prompt's first tree here (its own step drafts the rest): the eager kernels recorded, so that
        # a fresh GPU does not compile the drafting twice
        self.captured = {fused: CapturedTree(*shape, fuse=fused) for fused in (True, False)} if on_cuda else {}
        self.log = log
        self.proposer = DrafterProposer(drafter, static=True, compiled=compiled, log=log)  # prompts: its graphs
        self.drafter = self.proposer.drafter
        self.setting = setting
        self.recorded_step: Any = None  # draft_graph.RecordedStep: the device-resident tree step's graphs

    def reset(self, rows: int = 0) -> None:
        self.proposer.reset(rows)

    def device_steps(self, target: Any) -> DeviceSteps | None:
        return TreeSteps(self, target.log) if target.device_trees else None

    @torch.inference_mode()
    def draft(self, context: list[int], features: torch.Tensor) -> Draft:
        """context = tokens x_0..x_n (x_n, the root, not yet seen by the target); features = f_0..f_{n-1}."""
        tokens, parents, depths, scores = self.packed(context, features).tolist()  # the step's one copy to the host
        return Draft([int(t) for t in tokens], [int(p) for p in parents], [int(d) for d in depths], scores,
                     width=self.setting.num_draft_tokens)

    @torch.inference_mode()
    def packed(self, context: list[int], features: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """The tree below the root x_n as `tree_graph.tree_steps` packs it, on the device: [4, num_draft_tokens - 1]
        (target id, parent node, depth, cumulative log-probability)."""
        steps = self.setting.num_steps
        integers, hidden = self.proposer.real_rows(context, features, steps)
        cache = self.proposer.cache
        if (captured := self.captured.get(fused)) is not None and hidden.shape[1] == steps + 1:
            try:
                return captured(integers, hidden, cache)
            except Exception as exc:  # capture unsupported here: draft eagerly (rows land at their positions)
                if self.log is not None:
                    self.log.warning("draft tree CUDA graph failed (%s: %s); drafting trees eagerly",
                                     type(exc).__name__, str(exc)[:300])
                self.captured = {}
        (packed,) = tree_drafts(integers, hidden, drafter=self.drafter, cache=cache, rows=self.rows, steps=steps,
                                topk=self.setting.topk, kept=self.setting.num_draft_tokens - 1)
        return packed
