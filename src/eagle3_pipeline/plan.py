"""The disk plan: how many bytes each stage will write, against the free space where results live.

Token counts are exact where token shards exist and estimated otherwise: from a seeded sample tokenized
with the target's tokenizer (plan_tokens), else, without a tokenizer, from characters (the normalized
conversation shards, else the raw inputs' size); the plan says which. Stages whose size does not grow
with tokens (the target copy, training state and weights, the export, evaluation results) are sized
from the target's shape. `snakemake -n` prints it before the job table; a real run refuses to start
when the stages it will run do not fit, or when it would extract hidden states of unknown size
(see rules/common.smk).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3_pipeline.plan_tokens import TokenEstimator

STAGE_RULES = {"tokens": "tokenize", "hidden": "extract", "target": "target", "train": "train",
               "serving": "export", "evaluation": "evaluate"}  # which rule writes each stage's bytes
CHARS_PER_TOKEN = 4.1  # measured: ShareGPT V3 under SmolLM2's tokenizer, 400 conversations (docs/design.md)
TEMPLATE_TOKENS_PER_TURN = 5  # role header and end-of-turn markers


@dataclass
class ShardPlan:
    name: str
    tokens: int
    exact: bool
    exists: bool = False
    method: str = ""  # how an estimate was made, e.g. "sample of 400"


@dataclass
class StagePlan:
    stage: str
    raw_bytes_per_token: float
    expected_bytes_per_token: float
    shards: list[ShardPlan] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return int(self.tokens * self.expected_bytes_per_token)

    @property
    def pending_bytes(self) -> int:
        return int(sum(s.tokens for s in self.shards if not s.exists) * self.expected_bytes_per_token)

    def shard_bytes(self, name: str) -> int:
        shard = next(s for s in self.shards if s.name == name)
        return int(shard.tokens * self.expected_bytes_per_token)

    @property
    def estimate(self) -> str | None:
        """How the estimated shards were sized, e.g. "estimate (sample of 400)"; None when every count is exact."""
        if all(s.exact for s in self.shards):
            return None
        methods = sorted({s.method for s in self.shards if not s.exact and s.method})
        return "estimate" + (f" ({', '.join(methods)})" if methods else "")

    @property
    def source(self) -> str:
        estimate = self.estimate
        if estimate is None:
            return "exact"
        return estimate if not any(s.exact for s in self.shards) else f"exact+{estimate}"


def hidden_bytes_per_token(hidden_size: int, compression: float | None,
                           store_dtype: str = "bfloat16") -> tuple[float, float]:
    """(raw, expected on disk) bytes per token of a hidden-state store: its row size (formats/hidden_store:
    4 state vectors in the store dtype, their scales if any, id + mask), and on disk the hidden arrays
    compressed (by `compression`, or when None by the ratio measured for the store dtype) plus each chunk's
    crc32c."""
    from eagle3_pipeline.formats.hidden_store import TOKEN_ROW_BYTES, checksum_bytes_per_row, rows

    hidden, tokens = rows.raw_row_bytes(store_dtype, hidden_size), TOKEN_ROW_BYTES
    ratio = compression or rows.EXPECTED_COMPRESSION[store_dtype]
    return hidden + tokens, hidden / ratio + tokens / 2 + checksum_bytes_per_row(hidden_size, store_dtype)


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(count) < 1000 or unit == "PB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1000
    return f"{count:.1f} PB"


def free_bytes(path: Path) -> int:
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


# ---------------------------------------------------------------- token counts

def conversation_tokens(conversation: dict[str, Any], max_seq_len: int) -> int:
    chars = sum(len(m["content"]) for m in conversation["messages"])
    estimate = chars / CHARS_PER_TOKEN + TEMPLATE_TOKENS_PER_TURN * (len(conversation["messages"]) + 1)
    return int(min(estimate, max_seq_len))


def estimate_from_conversations(path: Path, max_seq_len: int) -> int:
    with open(path, encoding="utf-8") as handle:
        return sum(conversation_tokens(json.loads(line), max_seq_len) for line in handle if line.strip())


def estimate_from_raw(inputs: list[Path], train_conversations: int | None, num_shards: int,
                      max_seq_len: int) -> int:
    """Rough tokens per shard from raw file sizes (no parsing: this runs at parse time)."""
    total_bytes = sum(p.stat().st_size for p in inputs)
    records = 0
    for path in inputs:
        data = path.read_bytes()
        records += data.count(b'"conversations"') + data.count(b'"messages"')
    records = max(records, 1)
    per_conversation = min(total_bytes / records / CHARS_PER_TOKEN, max_seq_len)
    conversations = min(train_conversations or records, records)
    return int(per_conversation * conversations / num_shards)


def shard_token_counts(shard_names: list[str], token_shard: str, conversation_shard: str,
                       inputs: list[Path], data: dict[str, Any], sampler: TokenEstimator | None = None
                       ) -> list[ShardPlan]:
    """Exact counts where token shards exist; else the sampler's estimate (plan_tokens), else characters."""
    from eagle3_pipeline.formats import token_shards

    plans, raw_estimate = [], None
    for name in shard_names:
        shard_path = Path(token_shard.format(shard=name))
        conversation_path = Path(conversation_shard.format(shard=name))
        if shard_path.is_dir():
            try:
                attrs = token_shards.validate(shard_path)
                plans.append(ShardPlan(name, int(attrs["num_tokens"]), exact=True))
                continue
            except token_shards.InvalidTokenShard:
                pass
        sampled = sampler.estimate if sampler is not None else None
        if sampled is not None:
            plans.append(ShardPlan(name, sampled.tokens(name), False, method=sampled.label))
            continue
        method = sampler.fallback if sampler is not None else "characters"
        if conversation_path.is_file():
            plans.append(ShardPlan(name, estimate_from_conversations(conversation_path, data["max_seq_len"]), False,
                                   method=method))
            continue
        if raw_estimate is None:
            raw_estimate = estimate_from_raw(inputs, data.get("train_conversations"), data["num_shards"],
                                             data["max_seq_len"])
        plans.append(ShardPlan(name, raw_estimate, exact=False, method=method))
    return plans


# ---------------------------------------------------------------- the plan

@dataclass
class FixedStage:
    """A stage whose bytes do not scale with tokens; `total_bytes` None when they cannot be known yet."""

    stage: str
    total_bytes: int | None
    done_bytes: int  # the part already written (outputs that exist)
    source: str

    @property
    def pending_bytes(self) -> int:
        return 0 if self.total_bytes is None else max(self.total_bytes - self.done_bytes, 0)


@dataclass
class DiskPlan:
    stages: list[StagePlan]
    results_dir: Path
    free: int
    fixed: list[FixedStage] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    hidden_size_unknown: bool = False
    hidden_peak: int | None = None  # under a disk budget's windows: the most hidden-store bytes at once

    @property
    def hidden(self) -> StagePlan | None:
        """The hidden stores' stage; None when the target's hidden size is unknown."""
        return next((s for s in self.stages if s.stage == "hidden"), None)

    def _needed(self, stage: str, rules: set[str] | None) -> bool:
        rule = "extract_window" if stage == "hidden" and self.hidden_peak is not None else STAGE_RULES[stage]
        return rules is None or rule in rules

    def _pending(self, stage: StagePlan | FixedStage) -> int:
        if stage.stage == "hidden" and self.hidden_peak is not None:  # written and deleted window by window
            return min(stage.pending_bytes, self.hidden_peak)
        return stage.pending_bytes

    def pending_for(self, rules: set[str] | None = None) -> int:
        """Bytes still to write by the stages whose rules will run (all stages when `rules` is None)."""
        return sum(self._pending(s) for s in [*self.stages, *self.fixed] if self._needed(s.stage, rules))

    @property
    def pending(self) -> int:
        return self.pending_for(None)

    def fits_for(self, rules: set[str] | None = None) -> bool:
        return self.pending_for(rules) <= self.free

    @property
    def fits(self) -> bool:
        return self.fits_for(None)

    def refusal(self, rules: set[str] | None, data_stage_target: str) -> str:
        """Why a run will not start when its plan exceeds free space, and what the user can do about it."""
        message = (f"Refusing to start: the disk plan exceeds free space ({human_bytes(self.pending_for(rules))} "
                   f"to write, {human_bytes(self.free)} free).")
        hidden = self.hidden
        if hidden is not None and self._needed("hidden", rules) and hidden.estimate is not None:
            partly = " partly" if any(s.exact for s in hidden.shards) else ""
            message += (f" The hidden stores are sized{partly} from an {hidden.estimate}, "
                        f"which can be several percent off: the same command with the target {data_stage_target} "
                        "runs the data stage alone (no hidden stores) and makes the token counts exact.")
        return message + (" Otherwise free space, store fp8 states (extract.store_dtype), train in windows under "
                          "plan.disk_budget_gb, lower data.train_conversations or data.max_seq_len, or set "
                          "plan.allow_exceeding_free_space: true.")

    def blind_for(self, rules: set[str] | None = None) -> bool:
        """True when extraction will run but the hidden stage could not be sized."""
        return self.hidden_size_unknown and self._needed("hidden", rules)

    def lines(self, rules: set[str] | None = None) -> list[str]:
        out = ["Disk plan (bytes to be written; tokens exact where token shards exist):",
               f"  {'stage':<10} {'tokens':>14} {'raw B/tok':>10} {'disk B/tok':>10} {'per shard':>11} "
               f"{'total':>11} {'to write':>11}  source"]
        for stage in self.stages:
            per_shard = stage.total_bytes / max(len(stage.shards), 1)
            pending = human_bytes(self._pending(stage)) if self._needed(stage.stage, rules) else "not run"
            out.append(f"  {stage.stage:<10} {stage.tokens:>14,} {stage.raw_bytes_per_token:>10.1f} "
                       f"{stage.expected_bytes_per_token:>10.1f} {human_bytes(per_shard):>11} "
                       f"{human_bytes(stage.total_bytes):>11} {pending:>11}  {stage.source}")
        for item in self.fixed:
            total = human_bytes(item.total_bytes) if item.total_bytes is not None else "unknown"
            pending = human_bytes(item.pending_bytes) if self._needed(item.stage, rules) else "not run"
            out.append(f"  {item.stage:<10} {'-':>14} {'-':>10} {'-':>10} {'-':>11} {total:>11} {pending:>11}"
                       f"  {item.source}")
        verdict = "fits" if self.fits_for(rules) else "DOES NOT FIT"
        scope = "" if rules is None else " (stages this run needs)"
        out.append(f"  free space under {self.results_dir}: {human_bytes(self.free)}; to write{scope}: "
                   f"{human_bytes(self.pending_for(rules))} -> {verdict}")
        out += [f"  WARNING: {warning}" for warning in self.warnings]
        return out


def build(shard_names: list[str], paths: dict[str, str], inputs: list[Path], data: dict[str, Any],
          hidden_size: int | None, compression: float | None, results_dir: Path,
          fixed: list[FixedStage] | None = None, warnings: list[str] | None = None,
          store_dtype: str = "bfloat16", sampler: TokenEstimator | None = None) -> DiskPlan:
    from eagle3_pipeline.formats.token_shards import BYTES_PER_TOKEN

    counts = shard_token_counts(shard_names, paths["token_shard"], paths["conversation_shard"], inputs, data,
                                sampler)
    tokens = StagePlan("tokens", BYTES_PER_TOKEN, BYTES_PER_TOKEN / 2,
                       [replace(c, exists=Path(paths["token_shard"].format(shard=c.name)).exists()) for c in counts])
    stages = [tokens]
    if hidden_size:
        raw, expected = hidden_bytes_per_token(hidden_size, compression, store_dtype)
        stages.append(StagePlan("hidden", raw, expected,
                                [replace(c, exists=Path(paths["hidden_store"].format(shard=c.name)).exists())
                                 for c in counts]))
    return DiskPlan(stages, results_dir, free_bytes(results_dir), fixed or [], warnings or [],
                    hidden_size_unknown=not hidden_size)
