"""Tokens per shard before the token shards exist: a seeded sample of conversations tokenized with the target's own
tokenizer and chat template through the tokenize stage's own function (same template, same truncation at
data.max_seq_len, same drops), times the conversations each shard will hold.

The sample comes from the conversation shards once ingest has written them (their conversation counts are then
exact); before that from the raw inputs: a seeded sample of records read and normalised by ingest's own code
(records it drops count as dropped), scaled to the records ingest keeps and then to the training split as ingest
makes it (plan_samples). With regeneration on, the ingested replies stand in for the regenerated ones until those
exist: each conversation cut as a sample is (its first `regenerate.turns` replies, each at most
`regenerate.max_new_tokens` tokens), counted `regenerate.samples` times, plus the conversation itself with
`regenerate.keep_original`. The estimate is cached under `cache_dir`, keyed by the inputs' sizes and times, the
tokenizer and the settings, so only the first plan pays for it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from eagle3_pipeline.copying import CopyBoost
from eagle3_pipeline.formats import reports
from eagle3_pipeline.plan_samples import sample_from_raw, sample_from_shards, split_counts, training_conversations
from eagle3_pipeline.plan_tokenizer import NoTokenizer, TokenizerSource, file_stamp

SAMPLE_SIZE = 400  # seven seeds on the GPU example: 0.98-1.04 of the exact count; ~8 s to tokenize on one core
ESTIMATE_VERSION = 4  # bump when the way an estimate is made changes: cached ones are then ignored
DATA_KEYS = ("max_seq_len", "overlength", "end_of_turn", "train_conversations", "eval_conversations",
             "selection_conversations", "weights", "copying_weight", "copying_min_share", "seed", "num_shards")


@dataclass
class SampledTokens:
    conversations: dict[str, float]  # per shard: the conversations tokenize (or, before it, regenerate) will read
    tokens_per_conversation: float  # mean over the sample, a conversation's samples and original together; a
    # conversation tokenize drops counts 0
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


@dataclass(frozen=True)
class Regeneration:
    """What the regenerate stage makes of one ingested conversation (the `regenerate` section, when on)."""
    samples: int = 1
    keep_original: bool = False
    turns: int | None = None
    max_new_tokens: int | None = None
    max_context_tokens: int | None = None  # null in the config: data.max_seq_len
    thinking: bool | None = None  # the chat template's enable_thinking (null: the template's default)

    def stand_in(self, conversation: dict[str, Any], tokenizer: Any, bound: int | None = None) -> dict[str, Any]:
        """The conversation cut as the regenerate stage cuts a sample: its first `turns` replies (replies in a row
        count as one), each cut at `max_new_tokens` tokens, ending before a turn whose history and reply would not
        fit `max_context_tokens`. The data's replies stand in for the target's, which do not exist yet."""
        source, messages, replies, i = conversation["messages"], [], 0, 0
        while i < len(source) and (self.turns is None or replies < self.turns):
            while i < len(source) and source[i]["role"] != "assistant":
                messages.append(source[i])
                i += 1
            reply = source[i] if i < len(source) else None  # a trailing user turn: no stand-in for its reply
            while i < len(source) and source[i]["role"] == "assistant":
                i += 1
            if reply is None or not messages or not self.fits(messages, tokenizer, bound):
                break
            messages.append(self.cut(reply, tokenizer))
            replies += 1
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()  # the stage ends a sample with its last reply
        return {**conversation, "messages": messages}

    def fits(self, history: list[dict[str, str]], tokenizer: Any, bound: int | None = None) -> bool:
        """Whether the stage asks for this reply: the history as the stage renders and bounds it (its own
        tokenize_histories; a template error or a history over `bound` characters does not fit), plus
        max_new_tokens."""
        from eagle3_pipeline.runtime.generation import Prompt, template_kwargs, tokenize_histories

        if self.max_context_tokens is None:
            return True
        bound = bound or self.character_bound(tokenizer)
        [prompt] = tokenize_histories(tokenizer, [history], template_kwargs(self.thinking), bound)
        return isinstance(prompt, Prompt) and \
            len(prompt.token_ids) + (self.max_new_tokens or 0) <= self.max_context_tokens

    def character_bound(self, tokenizer: Any) -> int | None:
        """The stage's bound on a history's characters (tokenization.character_bound), None without a limit."""
        from eagle3_pipeline.tokenization import character_bound

        return None if self.max_context_tokens is None else character_bound(tokenizer, self.max_context_tokens)

    def cut(self, reply: dict[str, str], tokenizer: Any) -> dict[str, str]:
        ids = tokenizer(reply["content"], add_special_tokens=False)["input_ids"]
        if self.max_new_tokens is None or len(ids) <= self.max_new_tokens:
            return reply
        return {**reply, "content": tokenizer.decode(ids[:self.max_new_tokens])}

    def tokens(self, tokenizer: Any, conversations: list[dict[str, Any]], data: dict[str, Any]) -> list[float]:
        """The tokens each ingested conversation becomes in the regenerated shard."""
        bound = self.character_bound(tokenizer)  # once: it reads the whole vocabulary (~40 ms)
        stand_ins = sample_tokens(tokenizer, [self.stand_in(c, tokenizer, bound) for c in conversations], data)
        originals = sample_tokens(tokenizer, conversations, data) if self.keep_original else [0] * len(stand_ins)
        return [original + self.samples * sample for original, sample in zip(originals, stand_ins, strict=True)]


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
    regeneration: Regeneration | None = None  # the regenerate section, when on

    def sampled_shards(self) -> list[Path] | None:
        """The conversation files to sample: the first kind every shard has; None before ingest."""
        for choice in range(min(map(len, self.shard_paths), default=0)):
            files = [paths[choice] for paths in self.shard_paths]
            if all(f.is_file() for f in files):
                return files
        return None

    def cache_key(self, shard_files: list[Path] | None, regeneration: Regeneration | None) -> str:
        where = [file_stamp(f) for f in shard_files] if shard_files else [file_stamp(p) for p in self.inputs]
        weights = dict(zip([p.name for p in self.inputs], self.data.get("weights") or [], strict=False))
        key = [ESTIMATE_VERSION, self.sample_size, self.shards, where, self.tokenizer.identity(),
               {k: self.data.get(k) for k in DATA_KEYS}, weights, regeneration and asdict(regeneration)]
        return stable_hash(key)

    @cached_property
    def estimate(self) -> SampledTokens | None:
        shard_files = self.sampled_shards()
        read_by_tokenize = shard_files is not None and shard_files == [paths[0] for paths in self.shard_paths]
        # ingested conversations (or raw records) stand in for what regeneration will make of them
        return self.sampled(shard_files, None if read_by_tokenize else self.regeneration)

    def sampled(self, shard_files: list[Path] | None, regeneration: Regeneration | None) -> SampledTokens | None:
        """The estimate from `shard_files` (None: the raw inputs), from the cache when it was made before."""
        cached = self.cache_dir / "token-estimates" / f"{self.cache_key(shard_files, regeneration)}.json"
        if cached.is_file():
            return SampledTokens(**reports.read(cached))
        if not self.may_compute:
            self.fallback = "characters: no cached sample in this job"
            return None
        try:
            tokenizer = self.tokenizer.load(self.cache_dir / "tokenizers" / stable_hash(self.tokenizer.identity()))
        except NoTokenizer as exc:
            self.fallback = "characters: no tokenizer"
            print(f"Disk plan: the tokenizer of {self.tokenizer.source!r} cannot be loaded ({exc}); tokens are "
                  f"estimated from characters", file=sys.stderr)
            return None
        print(f"Disk plan: tokenizing a sample of {self.sample_size} conversations with the target's tokenizer "
              f"(once; cached under {self.cache_dir})", file=sys.stderr)
        try:
            result = self.from_shards(tokenizer, shard_files, regeneration) if shard_files \
                else self.from_raw(tokenizer, regeneration)
        except (OSError, ValueError) as exc:  # an unreadable input: the ingest job reports it properly
            self.fallback = "characters: sample unreadable"
            print(f"Disk plan: the sample could not be read ({exc}); tokens are estimated from characters",
                  file=sys.stderr)
            return None
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            reports.write(cached, asdict(result))
        except OSError:  # a read-only working directory: the next plan samples again
            pass
        return result

    def tokens(self, tokenizer: Any, conversations: list[dict[str, Any]],
               regeneration: Regeneration | None) -> list[float]:
        if regeneration is None:
            return list(map(float, sample_tokens(tokenizer, conversations, self.data)))
        return regeneration.tokens(tokenizer, conversations, self.data)

    def from_shards(self, tokenizer: Any, files: list[Path], regeneration: Regeneration | None) -> SampledTokens:
        counts, sample = sample_from_shards(files, self.sample_size, self.data["seed"])
        tokens = self.tokens(tokenizer, sample, regeneration)
        return SampledTokens({name: float(n) for name, n in zip(self.shards, counts, strict=True)},
                             sum(tokens) / max(len(tokens), 1), len(sample))

    def from_raw(self, tokenizer: Any, regeneration: Regeneration | None) -> SampledTokens:
        samples = sample_from_raw(self.inputs, self.sample_size, self.data["seed"])
        weight_of = dict(zip([p.name for p in self.inputs], self.data.get("weights") or [], strict=False))
        kept, groups, weighted, weighted_tokens = 0.0, 0.0, 0.0, 0.0
        copying = CopyBoost.of(self.data)
        for sample in samples:
            tokens = self.tokens(tokenizer, sample.kept, regeneration)
            per_record = sample.records / max(sample.sampled, 1)  # the input's records one sampled record stands for
            weight = float(weight_of.get(sample.name, 1.0))
            groups += per_record * sample.group_starts
            for conversation, count in zip(sample.kept, tokens, strict=True):
                repeats = weight * copying.factor(conversation)  # as ingest repeats it (conversations.split)
                kept += per_record
                weighted += repeats * per_record
                weighted_tokens += repeats * per_record * count
        group_size = kept / groups if groups else 1.0  # the split orders groups, not records: any is as likely
        total = training_conversations(kept, weighted / kept if kept else 0.0, self.data, group_size)
        counts = split_counts(total, len(self.shards))
        return SampledTokens({name: float(n) for name, n in zip(self.shards, counts, strict=True)},
                             weighted_tokens / weighted if weighted else 0.0, sum(s.sampled for s in samples))


def stable_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, default=str).encode()).hexdigest()[:20]


