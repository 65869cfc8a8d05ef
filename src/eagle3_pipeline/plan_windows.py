"""The disk budget's window plan: when the hidden-state stores a run needs exceed `plan.disk_budget_gb`, training
goes through rolling windows of consecutive shards. Each window's stores are extracted, trained on, deleted.

Every epoch visits every window once, in a seeded order; an epoch starts with the window the previous one
ended with, so those two passes share one extraction. An extraction group is a maximal run of consecutive
passes over one window: its stores are extracted once and deleted after its last pass. The extra extraction
work over a run without a budget is (groups / windows). Planned at parse time from the disk plan's per-shard
bytes (exact where token shards exist), so `snakemake -n` shows it and the rules (rules/windows.smk) follow it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from eagle3_pipeline.plan import human_bytes

GB = 1_000_000_000  # the disk plan's units (human_bytes): decimal
WINDOW_ORDER_KEY = 0x57494E  # the windows' order draws from (seed, epoch, this): apart from the batches' draws


class WindowError(ValueError):
    """The budget holds no window (the message names the numbers and what to change)."""


@dataclass(frozen=True)
class Group:
    """One extraction of a window's stores, serving consecutive passes over that window."""
    index: int
    window: int
    passes: tuple[int, ...]


@dataclass(frozen=True)
class WindowPlan:
    budget_bytes: int
    windows: tuple[tuple[str, ...], ...]  # shard names per window, consecutive
    shard_bytes: dict[str, int]  # each shard's planned hidden store
    heldout_bytes: int  # the held-out store: it stays on disk through training
    passes: tuple[tuple[int, int], ...]  # (epoch, window) in training order
    exact: bool  # planned from exact token counts (token shards exist)

    @property
    def windowed(self) -> bool:
        return len(self.windows) > 1

    def window_bytes(self, window: int) -> int:
        return sum(self.shard_bytes[shard] for shard in self.windows[window])

    @property
    def peak_bytes(self) -> int:
        return max(self.window_bytes(w) for w in range(len(self.windows))) + self.heldout_bytes

    @cached_property
    def groups(self) -> tuple[Group, ...]:
        return extraction_groups(self.passes)

    def group_of_pass(self, index: int) -> Group:
        return next(group for group in self.groups if index in group.passes)

    @property
    def extraction_ratio(self) -> float:
        return len(self.groups) / len(self.windows)

    def as_dict(self) -> dict[str, list]:
        """What decides the training (rule params and the training fingerprint): windows and pass order."""
        return {"windows": [list(w) for w in self.windows], "passes": [list(p) for p in self.passes]}

    def lines(self) -> list[str]:
        total = sum(self.shard_bytes.values())
        counts = "exact" if self.exact else "estimated"
        out = [f"Window plan (plan.disk_budget_gb {self.budget_bytes / GB:g}: the hidden stores, "
               f"{human_bytes(total)} + held-out {human_bytes(self.heldout_bytes)}, exceed it; token counts "
               f"{counts}):",
               f"  {len(self.windows)} windows of consecutive shards:"]
        for window, shards in enumerate(self.windows):
            sizes_mb = [disk_mb(self.shard_bytes[shard]) for shard in shards]
            names = f"shard {shards[0]}" if len(shards) == 1 else f"shards {shards[0]}-{shards[-1]} ({len(shards)})"
            out.append(f"    w{window}: {names}, "
                       f"{human_bytes(self.window_bytes(window))}; extract_window disk_mb "
                       f"{min(sizes_mb)}-{max(sizes_mb)} per shard")
        epochs = sorted({epoch for epoch, _ in self.passes})
        order = " | ".join(f"epoch {e}: " + " ".join(f"w{w}" for pe, w in self.passes if pe == e) for e in epochs)
        out.append(f"  {len(self.passes)} passes over {len(epochs)} epochs: {order}")
        out.append(f"  {len(self.groups)} extraction groups: " + "; ".join(
            f"x{g.index} w{g.window} passes {g.passes[0]}-{g.passes[-1]}" for g in self.groups))
        out.append(f"  peak hidden-store disk: {human_bytes(self.peak_bytes)} (largest window + held-out) vs "
                   f"budget {human_bytes(self.budget_bytes)}")
        out.append(f"  extra extraction work: {self.extraction_ratio:.2f}x ({len(self.groups)} window "
                   f"extractions for {len(self.windows)} windows)")
        return out


def extraction_groups(passes: tuple[tuple[int, int], ...] | list[list[int]]) -> tuple[Group, ...]:
    """Maximal runs of consecutive passes over the same window, from (epoch, window) per pass."""
    groups: list[Group] = []
    for index, (_, window) in enumerate(passes):
        if groups and groups[-1].window == window:
            groups[-1] = Group(groups[-1].index, window, (*groups[-1].passes, index))
        else:
            groups.append(Group(len(groups), window, (index,)))
    return tuple(groups)


def disk_mb(size: int) -> int:
    """A job's `disk_mb` resource for `size` bytes: at least 1."""
    return max(1, math.ceil(size / 1_000_000))


def group_windows(shard_bytes: dict[str, int], heldout_bytes: int, budget_bytes: int) -> list[tuple[str, ...]]:
    """Consecutive shards, as many per window as fit the budget beside the held-out store."""
    room = budget_bytes - heldout_bytes
    largest = max(shard_bytes.values())
    if largest > room:
        widest = max(shard_bytes, key=shard_bytes.__getitem__)
        needed = math.ceil(len(shard_bytes) * largest / room) if room > 0 else None
        advice = (f"raise data.num_shards (to about {needed}) or the budget" if needed
                  else "the held-out store alone fills it: raise the budget")
        raise WindowError(f"plan.disk_budget_gb {budget_bytes / GB:g} holds no window: shard {widest}'s hidden store "
                          f"({human_bytes(largest)}) plus the held-out store ({human_bytes(heldout_bytes)}) need "
                          f"{human_bytes(largest + heldout_bytes)}; {advice}")
    windows: list[list[str]] = [[]]
    for shard, size in shard_bytes.items():
        if windows[-1] and sum(shard_bytes[s] for s in windows[-1]) + size > room:
            windows.append([])
        windows[-1].append(shard)
    return [tuple(window) for window in windows]


def pass_order(windows: int, epochs: int, seed: int) -> list[tuple[int, int]]:
    """(epoch, window) for every pass: each epoch a seeded permutation of the windows, rotated so that it
    starts with the window the epoch before ended with (one extraction serves both passes)."""
    passes: list[tuple[int, int]] = []
    for epoch in range(epochs):
        order = [int(w) for w in np.random.default_rng([seed, epoch, WINDOW_ORDER_KEY]).permutation(windows)]
        if passes:
            order.remove(passes[-1][1])
            order.insert(0, passes[-1][1])
        passes += [(epoch, window) for window in order]
    return passes


def plan(shard_bytes: dict[str, int], heldout_bytes: int, budget_gb: float, epochs: int, seed: int,
         exact: bool) -> WindowPlan:
    """The window plan for `shard_bytes` (planned hidden-store bytes per training shard, in shard order)."""
    budget = int(budget_gb * GB)
    windows = group_windows(shard_bytes, heldout_bytes, budget)
    return WindowPlan(budget, tuple(windows), dict(shard_bytes), heldout_bytes,
                      tuple(pass_order(len(windows), epochs, seed)), exact)


def heldout_tokens(token_shard: Path, conversations: Path, count: int, max_seq_len: int) -> tuple[int, bool]:
    """(tokens of the held-out store, exact?): its token shard's count, else estimated from its conversations
    (data.selection_conversations), else at most `count` conversations at full length."""
    from eagle3_pipeline import plan as disk_plan
    from eagle3_pipeline.formats import token_shards

    if token_shard.is_dir():
        try:
            return int(token_shards.validate(token_shard)["num_tokens"]), True
        except token_shards.InvalidTokenShard:
            pass
    if conversations.is_file():
        return disk_plan.estimate_from_conversations(conversations, max_seq_len), False
    return count * max_seq_len, False
