"""Tokens per shard before the token shards exist: a seeded sample of conversations tokenized with the
target's own tokenizer and chat template through the tokenize stage's own function (same template, same
truncation at data.max_seq_len, same drops), times the conversations each shard will hold.

The sample comes from the conversation shards once ingest has written them (their conversation counts are
then exact); before that from the raw inputs: a seeded sample of records read and normalised by ingest's own
code (records it drops count as dropped), scaled to the records ingest keeps and then to the training split
as ingest makes it (data.eval_conversations first, then data.train_conversations, then data.weights).
Duplicate ids, which ingest drops, are not seen in a sample. The estimate is cached under `cache_dir`,
keyed by the inputs' sizes and times, the tokenizer and the settings, so only the first plan pays for it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from eagle3_pipeline.plan_tokenizer import NoTokenizer, TokenizerSource, file_stamp

SAMPLE_SIZE = 400  # about 3 % standard error on ShareGPT at 2,048 tokens; ~8 s to tokenize on one core
ESTIMATE_VERSION = 1  # bump when the way an estimate is made changes: cached ones are then ignored
DATA_KEYS = ("max_seq_len", "overlength", "end_of_turn", "train_conversations", "eval_conversations", "weights",
             "seed", "num_shards")


@dataclass
class SampledTokens:
    conversations: dict[str, float]  # per shard: the conversations tokenize will read
    tokens_per_conversation: float  # mean over the sample; a conversation tokenize drops counts 0
    sample_size: int

    def tokens(self, shard: str) -> int:
        return round(self.conversations[shard] * self.tokens_per_conversation)

    @property
    def label(self) -> str:
        return f"sample of {self.sample_size}"


def sample_tokens(tokenizer: Any, conversations: list[dict[str, Any]], data: dict[str, Any]) -> list[int]:
    """The tokens each conversation adds to its token shard, as the tokenize stage decides."""
    from eagle3_pipeline.tokenization import character_bound, end_of_turn_marker, tokenize_or_drop

    marker = end_of_turn_marker(tokenizer, data["end_of_turn"])
    bound = character_bound(tokenizer, data["max_seq_len"])
    return [tokenize_or_drop(tokenizer, c, marker, bound, data["max_seq_len"], data["overlength"]).kept_tokens
            for c in conversations]


# ---------------------------------------------------------------- samples

def seeded_positions(sizes: list[int], count: int, seed: int) -> list[tuple[int, int]]:
    """`count` distinct (part, index) positions drawn uniformly over parts of `sizes` items, in order."""
    total, ends = sum(sizes), [sum(sizes[:i + 1]) for i in range(len(sizes))]
    chosen = sorted(random.Random(seed).sample(range(total), min(count, total)))
    positions = []
    for flat in chosen:
        part = bisect.bisect_right(ends, flat)
        positions.append((part, flat - (ends[part - 1] if part else 0)))
    return positions


def sample_from_shards(paths: list[Path], count: int, seed: int) -> tuple[list[int], list[dict[str, Any]]]:
    """(conversations per shard, a seeded sample of them) from conversation shards (formats/conversation_shards)."""
    lines = [[line for line in p.read_bytes().split(b"\n") if line.strip()] for p in paths]
    sample = [json.loads(lines[shard][index]) for shard, index in seeded_positions(list(map(len, lines)), count, seed)]
    return list(map(len, lines)), sample


def record_reader(path: Path) -> tuple[int, Callable[[int], list[Any]]]:
    """(records in the input, record index -> its RawRecord) with ingest's reader; only sampled records are
    parsed, except in a one-line JSON array, which is parsed whole."""
    from eagle3_pipeline.raw_records import DropReport, RecordSlices, iter_records_in, read_input

    data = read_input(path)
    slices = RecordSlices.of(data)
    if slices is None:
        records = list(iter_records_in(path, data, DropReport()))
        return len(records), lambda index: [records[index]]
    return len(slices), lambda index: list(iter_records_in(path, slices[index], DropReport()))


def sample_from_raw(inputs: list[Path], count: int, seed: int) -> tuple[int, int, list[dict[str, Any]]]:
    """(records in all inputs, records sampled, the sampled records ingest keeps, normalised)."""
    from eagle3_pipeline.conversations import normalize_record
    from eagle3_pipeline.raw_records import DropReport

    readers = [record_reader(path) for path in inputs]
    positions = seeded_positions([size for size, _ in readers], count, seed)
    kept, report = [], DropReport()
    for part, index in positions:
        for record in readers[part][1](index):
            conversation = normalize_record(record, report)
            if conversation is not None:
                kept.append(conversation)
    return sum(size for size, _ in readers), len(positions), kept


def split_counts(total: int, num_shards: int) -> list[int]:
    """Conversations per shard when ingest deals `total` round-robin (conversations.split)."""
    return [total // num_shards + (shard < total % num_shards) for shard in range(num_shards)]


def training_conversations(kept: float, weight_mean: float, data: dict[str, Any]) -> int:
    """How many training conversations ingest writes out of `kept` ones: the held-out split first, then
    data.train_conversations, then each repeated by its source's weight (on average `weight_mean`)."""
    available = max(kept - data["eval_conversations"], 0)
    train = min(data["train_conversations"], available) if data["train_conversations"] is not None else available
    return round(train * weight_mean)


# ---------------------------------------------------------------- the estimate

@dataclass
class TokenEstimator:
    """The sampled estimate, made on first use (`estimate`); None where it cannot be made (`fallback`)."""

    shards: list[str]
    shard_paths: list[list[Path]]  # per shard: conversation files tokenize may read, in order of preference
    inputs: list[Path]
    data: dict[str, Any]
    tokenizer: TokenizerSource
    cache_dir: Path
    may_compute: bool = True  # False: a cached estimate or none (e.g. inside a cluster job)
    sample_size: int = SAMPLE_SIZE
    fallback: str = ""

    def sampled_shards(self) -> list[Path] | None:
        """The conversation files to sample: the first kind every shard has; None before ingest."""
        for choice in range(min(map(len, self.shard_paths), default=0)):
            files = [paths[choice] for paths in self.shard_paths]
            if all(f.is_file() for f in files):
                return files
        return None

    def cache_key(self, shard_files: list[Path] | None) -> str:
        where = [file_stamp(f) for f in shard_files] if shard_files else [file_stamp(p) for p in self.inputs]
        weights = dict(zip([p.name for p in self.inputs], self.data.get("weights") or [], strict=False))
        key = [ESTIMATE_VERSION, self.sample_size, self.shards, where, self.tokenizer.identity(),
               {k: self.data.get(k) for k in DATA_KEYS}, weights]
        return stable_hash(key)

    @cached_property
    def estimate(self) -> SampledTokens | None:
        shard_files = self.sampled_shards()
        cached = self.cache_dir / "token-estimates" / f"{self.cache_key(shard_files)}.json"
        if cached.is_file():
            return SampledTokens(**json.loads(cached.read_text()))
        if not self.may_compute:
            self.fallback = "characters: no cached sample in this job"
            return None
        print(f"Disk plan: tokenizing a sample of {self.sample_size} conversations with the target's tokenizer "
              f"(once; cached under {self.cache_dir})", file=sys.stderr)
        try:
            tokenizer = self.tokenizer.load(self.cache_dir / "tokenizers" / stable_hash(self.tokenizer.identity()))
        except NoTokenizer as exc:
            self.fallback = "characters: no tokenizer"
            print(f"Disk plan: the tokenizer of {self.tokenizer.source!r} cannot be loaded ({exc}); tokens are "
                  f"estimated from characters", file=sys.stderr)
            return None
        result = self.from_shards(tokenizer, shard_files) if shard_files else self.from_raw(tokenizer)
        write_json(cached, asdict(result))
        return result

    def from_shards(self, tokenizer: Any, files: list[Path]) -> SampledTokens:
        counts, sample = sample_from_shards(files, self.sample_size, self.data["seed"])
        tokens = sample_tokens(tokenizer, sample, self.data)
        return SampledTokens({name: float(n) for name, n in zip(self.shards, counts, strict=True)},
                             sum(tokens) / max(len(tokens), 1), len(sample))

    def from_raw(self, tokenizer: Any) -> SampledTokens:
        records, sampled, kept = sample_from_raw(self.inputs, self.sample_size, self.data["seed"])
        by_name = dict(zip([p.name for p in self.inputs], self.data.get("weights") or [], strict=False))
        weights = [float(by_name.get(c["source"], 1.0)) for c in kept]
        tokens = sample_tokens(tokenizer, kept, self.data)
        weight_sum = sum(weights)
        per_conversation = sum(w * t for w, t in zip(weights, tokens, strict=True)) / weight_sum if weight_sum else 0.0
        kept_records = records * len(kept) / max(sampled, 1)
        total = training_conversations(kept_records, weight_sum / max(len(kept), 1), self.data)
        counts = split_counts(total, len(self.shards))
        return SampledTokens({name: float(n) for name, n in zip(self.shards, counts, strict=True)},
                             per_conversation, sampled)


def stable_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, default=str).encode()).hexdigest()[:20]


def write_json(path: Path, value: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(value))
    os.replace(partial, partial.with_name(path.name))
