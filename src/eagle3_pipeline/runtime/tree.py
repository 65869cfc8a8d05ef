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

Verifying: one target forward over [root, nodes...] at positions n + depth, each attending to the cached prefix,
the root and its own ancestors. The longest root-to-leaf path whose every token equals the target's argmax at its
parent is accepted, plus the target's token after it (the bonus); the target's cache keeps the prefix and that
path (a static cache: the tree, padded to num_draft_tokens rows and verified by the compiled step where there is
one, was written at slots n..n+T-1 and the path's rows are moved down to n+1..), and the path's aux features go
to the drafter.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.logs import ClearError
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.kv_cache import has_sliding_layers
from eagle3_pipeline.runtime.traces import Trace, append_until_eos, prefill, synchronize
from eagle3_pipeline.runtime.tree_graph import CapturedTree, TreeRows, tree_drafts
from eagle3_pipeline.workflow_config import tree_setting_problem

METHOD_PATTERN = re.compile(r"^[\w-]+-tree\(steps=(?P<steps>\d+),topk=(?P<topk>\d+),tokens=(?P<tokens>\d+)\)$")


@dataclass(frozen=True)
class TreeSetting:
    """One SGLang tree setting: depth, branching factor, verified tokens per step (the root included)."""
    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        if problem := tree_setting_problem(self.num_steps, self.topk, self.num_draft_tokens):
            raise ClearError(f"evaluate.tree: {self.as_dict()} {problem}")

    def as_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps, "topk": self.topk, "num_draft_tokens": self.num_draft_tokens}

    def method(self, drafter: str = "eagle3") -> str:
        return f"{drafter}-tree(steps={self.num_steps},topk={self.topk},tokens={self.num_draft_tokens})"

    @property
    def sglang_flags(self) -> str:
        return (f"--speculative-num-steps {self.num_steps} --speculative-eagle-topk {self.topk} "
                f"--speculative-num-draft-tokens {self.num_draft_tokens}")

    @classmethod
    def from_method(cls, method: str) -> TreeSetting | None:
        """The setting a tree method's name carries; None for other methods."""
        match = METHOD_PATTERN.match(method)
        return cls(int(match["steps"]), int(match["topk"]), int(match["tokens"])) if match else None


def sglang_flags(method: str) -> str:
    """SGLang's flags for an EAGLE-3 method of the report ("eagle3@k=4" is the topk-1 tree of depth 4); "" for
    methods SGLang does not serve this way (prompt lookup, the untrained baseline)."""
    if method.startswith("eagle3@k="):
        k = int(method.rsplit("@k=", 1)[1])
        return TreeSetting(k, 1, k + 1).sglang_flags
    setting = TreeSetting.from_method(method) if method.startswith("eagle3-tree(") else None
    return setting.sglang_flags if setting else ""


def tree_problem(target: TargetRuntime) -> str | None:
    """Why trees cannot be verified on this target runtime, None when they can."""
    if has_sliding_layers(target.model):
        return "a sliding-window cache cannot drop a tree's rejected rows"
    return None


@dataclass(frozen=True)
class DraftTree:
    """Nodes 1..T-1 of a verify step (node 0 is the root): target ids, parent node, depth, in parent-first order."""
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]  # cumulative draft log-probability

    def visible(self) -> torch.Tensor:
        """[T, T]: node i sees node j when j is i or one of its ancestors (the root is everyone's)."""
        size = len(self.tokens) + 1
        seen = torch.eye(size, dtype=torch.bool)
        for node, parent in enumerate(self.parents, start=1):
            seen[node] |= seen[parent]  # parents come first, so their rows are complete
        return seen

    def accept(self, predictions: list[int]) -> tuple[list[int], int]:
        """The longest path of nodes whose tokens equal the target's argmax at their parent, and the bonus token
        (the argmax at the path's last node). Siblings hold distinct tokens (a top-k), so the path is unique."""
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents, start=1):
            children.setdefault(parent, []).append(node)
        path, node = [], 0
        while (step := next((c for c in children.get(node, []) if self.tokens[c - 1] == predictions[node]),
                            None)) is not None:
            path.append(step)
            node = step
        return path, predictions[node]


class TreeDrafter:
    """Dynamic trees from an EAGLE-3 drafter: its real rows in a DrafterProposer's static cache (padded to steps + 1
    rows, one shape per setting), the whole tree drafted by `tree_graph.tree_steps` with one device-to-host copy.
    `compiled` (CUDA): that drafting is recorded once per cache as a CUDA graph and replayed."""

    def __init__(self, drafter: Drafter, setting: TreeSetting, compiled: bool = False, log: Any = None):
        self.rows = TreeRows.empty(drafter, (setting.num_steps - 1) * setting.topk)
        self.captured = (CapturedTree(drafter, self.rows, setting.num_steps, setting.topk,
                                      setting.num_draft_tokens - 1, log)
                         if compiled and self.rows.keys.device.type == "cuda" else None)
        self.log = log
        self.proposer = DrafterProposer(drafter, static=True, compiled=compiled, log=log)  # prompts: its graphs
        self.drafter = self.proposer.drafter
        self.setting = setting

    def reset(self, rows: int = 0) -> None:
        self.proposer.reset(rows)

    @torch.inference_mode()
    def draft(self, context: list[int], features: torch.Tensor) -> DraftTree:
        """context = tokens x_0..x_n (x_n, the root, not yet seen by the target); features = f_0..f_{n-1}."""
        steps = self.setting.num_steps
        integers, hidden = self.proposer.real_rows(context, features, steps)
        cache, packed = self.proposer.cache, None
        if self.captured is not None and hidden.shape[1] == steps + 1:
            try:
                packed = self.captured(integers, hidden, cache)
            except Exception as exc:  # capture unsupported here: draft eagerly (rows land at their positions)
                if self.log is not None:
                    self.log.warning("draft tree CUDA graph failed (%s: %s); drafting trees eagerly",
                                     type(exc).__name__, str(exc)[:300])
                self.captured = None
        if packed is None:
            (packed,) = tree_drafts(integers, hidden, drafter=self.drafter, cache=cache, rows=self.rows, steps=steps,
                                    topk=self.setting.topk, kept=self.setting.num_draft_tokens - 1)
        tokens, parents, depths, scores = packed.tolist()  # the one device-to-host copy of the step
        return DraftTree([int(t) for t in tokens], [int(p) for p in parents], [int(d) for d in depths], scores)


def tree_speculative(target: TargetRuntime, drafter: TreeDrafter, prompt_ids: list[int], max_new: int,
                     eos: set[int], prompt_id: str, method: str) -> Trace:
    """Decode with draft trees: per verify step one drafted tree, one target forward, the accepted path plus the
    bonus token. `accepted`: path length per step; `drafted`: the tree's depth (the longest path it offered)."""
    trace = Trace(prompt_id, method, [])
    start = time.perf_counter()
    cache, features, context = prefill(target, prompt_ids, max_new, trace)
    while len(trace.tokens) < max_new and context[-1] not in eos:
        n = len(context) - 1  # rows the target has seen
        tick = time.perf_counter()
        tree = drafter.draft(context, features)
        synchronize(target.device)
        middle = time.perf_counter()
        logits, aux = target.forward_tree([context[-1]] + tree.tokens, [n + d for d in [0, *tree.depths]],
                                          tree.visible(), cache, width=drafter.setting.num_draft_tokens)
        predictions = logits.argmax(-1).tolist()
        synchronize(target.device)
        trace.draft_seconds += middle - tick
        if trace.target_forwards == 0:  # the prompt's rows went into the drafter's cache first
            trace.prompt_draft_seconds = middle - tick
        trace.verify_seconds += time.perf_counter() - middle
        trace.target_forwards += 1
        path, bonus = tree.accept(predictions)
        trace.accepted.append(len(path))
        trace.drafted.append(max(tree.depths))
        target.keep_rows(cache, [*range(n), n, *(n + node for node in path)])
        features = torch.cat([features, aux[[0, *path]]])
        append_until_eos(trace, context, [tree.tokens[node - 1] for node in path] + [bonus], eos)
    trace.tokens = trace.tokens[:max_new]
    trace.total_seconds = time.perf_counter() - start
    return trace


def parse_settings(entries: list[dict[str, Any]]) -> tuple[TreeSetting, ...]:
    """`evaluate.tree` entries as settings (checked: ClearError naming a setting SGLang would not run as given)."""
    return tuple(TreeSetting(int(e["num_steps"]), int(e["topk"]), int(e["num_draft_tokens"])) for e in entries)
