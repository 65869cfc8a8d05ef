"""A decoding method as a small typed value: which proposer drafts (none, prompt lookup, an EAGLE-3 drafter), its
draft length k and, for a draft tree, SGLang's tree setting. The value's `name` is the method's key in traces,
results, reports and CSVs ("target", "prompt-lookup@k=4", "eagle3@k=4", "eagle3-untrained@k=4",
"eagle3-tree(steps=5,topk=8,tokens=32)"); `Method.parse` is the one reader of those names, for figures that come
back from files (resumed traces, results) with names only."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.logs import ClearError

TREE_NAME = re.compile(r"^(?P<drafter>[\w-]+)-tree\(steps=(?P<steps>\d+),topk=(?P<topk>\d+),tokens=(?P<tokens>\d+)\)$")
CHAIN_NAME = re.compile(r"^(?P<proposer>[\w-]+)@k=(?P<k>\d+)$")
TARGET = "target"
PROMPT_LOOKUP = "prompt-lookup"


def tree_setting_problem(num_steps: int, topk: int, num_draft_tokens: int) -> str | None:
    """Why SGLang would not serve this draft-tree setting as given (None: it would); the config check and
    `TreeSetting` both ask."""
    candidates = topk + (num_steps - 1) * topk ** 2
    if min(num_steps, topk) < 1 or num_draft_tokens < 2:
        return "needs num_steps >= 1, topk >= 1 and num_draft_tokens >= 2"
    if num_draft_tokens - 1 > candidates:
        return (f"keeps num_draft_tokens - 1 = {num_draft_tokens - 1} nodes but drafts only {candidates} "
                "(topk + (num_steps - 1) * topk^2)")
    if topk == 1 and num_draft_tokens != num_steps + 1:
        return "with topk 1 is a chain: SGLang sets num_draft_tokens to num_steps + 1"
    return None


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
        return Method(drafter, self.num_steps, self).name

    @property
    def rows_ahead(self) -> int:
        """Cache slots a step of this tree may use beyond a sequence: its verify's rows, after the tokens of a step
        the device-resident loop launched before it read that the sequence ended."""
        return self.num_draft_tokens + self.num_steps

    @property
    def sglang_flags(self) -> str:
        return (f"--speculative-num-steps {self.num_steps} --speculative-eagle-topk {self.topk} "
                f"--speculative-num-draft-tokens {self.num_draft_tokens}")

    @classmethod
    def from_method(cls, method: str) -> TreeSetting | None:
        """The setting a tree method's name carries; None for other methods."""
        match = TREE_NAME.match(method)
        return cls(int(match["steps"]), int(match["topk"]), int(match["tokens"])) if match else None


@dataclass(frozen=True)
class Method:
    """`proposer`: "target" (the target alone, drafting nothing), "prompt-lookup", or an EAGLE-3 drafter's name
    ("eagle3", "eagle3-untrained"); `k`: drafts per verify step (a tree: its depth); `tree`: the draft tree's
    setting, None for a chain (SGLang's topk-1 tree, verified as a plain sequence)."""
    proposer: str
    k: int = 0
    tree: TreeSetting | None = None

    @property
    def name(self) -> str:
        if (tree := self.tree) is not None:
            return f"{self.proposer}-tree(steps={tree.num_steps},topk={tree.topk},tokens={tree.num_draft_tokens})"
        return TARGET if self.proposer == TARGET else f"{self.proposer}@k={self.k}"

    @property
    def drafter(self) -> bool:
        """Whether an EAGLE-3 drafter drafts (a chain or a tree)."""
        return self.proposer not in (TARGET, PROMPT_LOOKUP)

    @property
    def sglang_flags(self) -> str:
        """SGLang's flags for the trained EAGLE-3 drafter's chains and trees (a chain of k drafts is the topk-1 tree
        of depth k verifying k + 1 tokens); "" for methods SGLang does not serve this way (the target alone, prompt
        lookup, the untrained baseline)."""
        if self.proposer != "eagle3":
            return ""
        return (self.tree or TreeSetting(self.k, 1, self.k + 1)).sglang_flags

    @classmethod
    def parse(cls, name: str) -> Method:
        """The method a name stands for (names read back from traces and results files)."""
        if name == TARGET:
            return cls(TARGET)
        if setting := TreeSetting.from_method(name):
            return cls(name.split("-tree(", 1)[0], setting.num_steps, setting)
        if chain := CHAIN_NAME.match(name):
            return cls(chain["proposer"], int(chain["k"]))
        raise ValueError(f"not a decoding method's name: {name!r}")


def parse_settings(entries: list[dict[str, Any]]) -> tuple[TreeSetting, ...]:
    """`evaluate.tree` entries as settings (checked: ClearError naming a setting SGLang would not run as given)."""
    return tuple(TreeSetting(int(e["num_steps"]), int(e["topk"]), int(e["num_draft_tokens"])) for e in entries)
