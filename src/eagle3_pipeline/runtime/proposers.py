"""What the one decoding loop (speculative.py `decode`) asks of a method: a proposer drafts, per verify step, a
`Draft` below the root (the target's next token, not yet seen by it); the draft verifies itself through the target,
accepts what the target's argmax agrees with and commits the accepted rows to the target's cache.

A chain of k drafts is SGLang's topk-1 tree (node i's parent is node i-1), accepted as the longest prefix equal to
the target's argmax; it is verified as a plain sequence (`target.forward([root] + drafts)`, no tree mask) and its
rejected rows forgotten (`target.forget`). A tree (tree.py `TreeDrafter`) is verified with its visibility mask at
positions n + depth (`target.forward_tree`) and keeps its accepted path's rows (`target.keep_rows`). The target
alone is the proposer that drafts nothing: a one-token verify per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.pipelined import ChainSteps, DeviceSteps, GreedySteps


@dataclass(frozen=True)
class Draft:
    """Nodes 1..T-1 of a verify step (node 0 is the root): target ids, parent node, depth (position relative to the
    root), in parent-first order. `tree`: verified with a tree mask and committed by keeping the path's rows (padded
    to `width` rows on a static cache); False: a chain, verified as a plain sequence and committed by forgetting
    the rejected rows."""
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability (trees)
    tree: bool = True
    width: int | None = None

    @classmethod
    def chain(cls, tokens: list[int]) -> Draft:
        return cls(tokens, list(range(len(tokens))), list(range(1, len(tokens) + 1)), tree=False)

    @property
    def depth(self) -> int:
        """The longest path offered (a chain: its length)."""
        return max(self.depths, default=0)

    def visible(self) -> torch.Tensor:
        """[T, T]: node i sees node j when j is i or one of its ancestors (the root is everyone's)."""
        size = len(self.tokens) + 1
        seen = torch.eye(size, dtype=torch.bool)
        for node, parent in enumerate(self.parents, start=1):
            seen[node] |= seen[parent]  # parents come first, so their rows are complete
        return seen

    def verify(self, target: Any, cache: Any, context: list[int]) -> tuple[list[int], torch.Tensor]:
        """One target forward over [root, nodes...] (context ends in the root): the target's argmax at every node
        and the nodes' aux features."""
        n = len(context) - 1  # rows the target has seen
        if self.tree:
            logits, aux = target.forward_tree([context[-1]] + self.tokens, [n + d for d in [0, *self.depths]],
                                              self.visible(), cache, width=self.width)
        else:
            logits, aux = target.forward([context[-1]] + self.tokens, cache)
        return logits.argmax(-1).tolist(), aux

    def accept(self, predictions: list[int]) -> tuple[list[int], int]:
        """The longest path of nodes whose tokens equal the target's argmax at their parent, and the bonus token
        (the argmax at the path's last node). Siblings hold distinct tokens (a top-k), so the path is unique."""
        if not self.tree:
            accepted = 0
            while accepted < len(self.tokens) and self.tokens[accepted] == predictions[accepted]:
                accepted += 1
            return list(range(1, accepted + 1)), predictions[accepted]
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents, start=1):
            children.setdefault(parent, []).append(node)
        path, node = [], 0
        while (step := next((c for c in children.get(node, []) if self.tokens[c - 1] == predictions[node]),
                            None)) is not None:
            path.append(step)
            node = step
        return path, predictions[node]

    def commit(self, target: Any, cache: Any, n: int, path: list[int], aux: torch.Tensor) -> torch.Tensor:
        """Keep the root's and the path's rows in the target's cache (it had seen n rows before the verify): their
        aux features, for the drafter."""
        if not self.tree:
            target.forget(cache, len(self.tokens) - len(path))  # the verify wrote 1 + len(tokens) rows
            return aux[: len(path) + 1]
        target.keep_rows(cache, [*range(n), n, *(n + node for node in path)])
        return aux[[0, *path]]


class Proposer(Protocol):
    """Drafts per verify step. `drafting` False: the target alone (nothing drafted, no phases timed, no features
    kept, no acceptance counted)."""
    drafting: bool

    def reset(self, rows: int = 0) -> None: ...

    def draft(self, context: list[int], features: torch.Tensor) -> Draft:
        """context = tokens x_0..x_n (x_n, the root, not yet seen by the target); features = f_0..f_{n-1}."""
        ...

    def device_steps(self, target: Any) -> DeviceSteps | None:
        """Its steps in the device-resident loop (pipelined.py) of a runtime that has one; None: host loop only."""
        ...


NOTHING = Draft.chain([])


class TargetAlone:
    """Greedy decoding: no drafts, one token per target forward."""
    drafting = False

    def reset(self, rows: int = 0) -> None:
        pass

    def draft(self, context: list[int], features: torch.Tensor) -> Draft:
        return NOTHING

    def device_steps(self, target: Any) -> DeviceSteps | None:
        return GreedySteps()


class PromptLookup:
    """Up to k drafts copied from the context after the most recent earlier match of its last n tokens."""
    drafting = True

    def __init__(self, k: int, max_ngram: int = 3):
        self.k, self.max_ngram = k, max_ngram

    def reset(self, rows: int = 0) -> None:
        pass

    def draft(self, context: list[int], features: torch.Tensor) -> Draft:
        for n in range(self.max_ngram, 0, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start: start + n] == tail:
                    follow = context[start + n: start + n + self.k]
                    if follow:
                        return Draft.chain(follow)
        return NOTHING

    def device_steps(self, target: Any) -> DeviceSteps | None:
        return None  # its drafts come from the host's context


class EagleChain:
    """Chains of k drafts from an EAGLE-3 drafter (its KV cache kept by `proposer` across verify steps)."""
    drafting = True

    def __init__(self, proposer: DrafterProposer, k: int):
        self.proposer, self.k = proposer, k

    def reset(self, rows: int = 0) -> None:
        self.proposer.reset(rows)

    def draft(self, context: list[int], features: torch.Tensor) -> Draft:
        return Draft.chain(self.proposer(context, features, self.k)[: self.k])

    def device_steps(self, target: Any) -> DeviceSteps | None:
        return ChainSteps(self.proposer, self.k, target.log)
