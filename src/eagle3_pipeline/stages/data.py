"""The data stage's jobs: tokenize one conversation shard, build the draft vocabulary."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_pipeline import systemic, vocab
from eagle3_pipeline.formats import draft_vocab, token_shards
from eagle3_pipeline.formats.target_dir import read_identity
from eagle3_pipeline.logs import ClearError, Progress
from eagle3_pipeline.runtime.loading import load_config
from eagle3_pipeline.tokenization import (
    TemplateError,
    character_bound,
    cut_to_characters,
    end_of_turn_marker,
    template_hash,
    tokenize_conversation,
)

TOKENIZE_FIXES = {
    "dropped_template_error": "set target.chat_template (a Jinja template file, or a built-in name: chatml)",
    "dropped_overlength": "raise data.max_seq_len, or set data.overlength: truncate",
    "dropped_no_loss_tokens": "raise data.max_seq_len (truncation cut every assistant token)",
}


def tokenize_shard(conversations: list[dict[str, Any]], tokenizer: Any, target_dir: Path, output: Path,
                   max_seq_len: int, overlength: str, end_of_turn: str | None, source_name: str,
                   log: logging.Logger) -> dict[str, Any]:
    marker = end_of_turn_marker(tokenizer, end_of_turn)
    bound = character_bound(tokenizer, max_seq_len)
    counts: Counter = Counter()
    sequences = []
    first_template_error = None
    progress = Progress(log, "tokenize", len(conversations))
    for index, conversation in enumerate(conversations):
        cut = cut_to_characters(conversation, bound)
        if cut is not None:  # surely over max_seq_len: decided without tokenizing megabytes
            if overlength == "drop":
                counts["dropped_overlength"] += 1
                progress.update(1)
                continue
            counts["cut_before_tokenizing"] += 1
            conversation = cut
        try:
            tokenized = tokenize_conversation(tokenizer, conversation, marker, max_seq_len, overlength)
        except TemplateError as exc:
            counts["dropped_template_error"] += 1
            first_template_error = first_template_error or f"record {index}: {exc}"
            if counts["dropped_template_error"] <= 5:
                log.warning("%s record %d (id %s): dropped: %s", source_name, index, conversation["id"], exc)
            continue
        if tokenized is None:
            counts["dropped_overlength"] += 1
        elif not tokenized.loss_mask.any():
            counts["dropped_no_loss_tokens"] += 1  # e.g. truncation cut every assistant token
        else:
            counts["truncated"] += tokenized.truncated
            sequences.append(tokenized)
        progress.update(1, len(tokenized.input_ids) if tokenized else 0)
    progress.finish()
    failures = {key: counts[key] for key in TOKENIZE_FIXES}
    if not getattr(tokenizer, "chat_template", None):
        first_template_error = "the target's tokenizer has no chat template"
    systemic.check("tokenize", source_name, len(conversations), len(sequences), failures, TOKENIZE_FIXES,
                   "see the warnings above", first_template_error if failures["dropped_template_error"] else None)
    attrs = {
        "template_hash": template_hash(tokenizer),
        "target_hash": read_identity(target_dir)["content_hash"],
        "end_of_turn": marker,
        "max_seq_len": max_seq_len,
        "overlength": overlength,
        "conversations_in": len(conversations),
        **{key: int(value) for key, value in counts.items()},
    }
    token_shards.write(output, sequences, attrs)
    written = token_shards.read_attrs(output)
    log.info("wrote %s: %d sequences, %d tokens (%d loss tokens); %s", output, written["num_sequences"],
             written["num_tokens"], written["num_loss_tokens"], dict(counts))
    return written


def build_vocab(shard_paths: list[Path], target_dir: Path, draft_vocab_size: int, output: Path,
                log: logging.Logger) -> dict[str, Any]:
    vocab_size = load_config(target_dir).vocab_size
    counts = np.zeros(vocab_size, dtype=np.int64)
    per_shard = {}
    for path in shard_paths:
        shard = token_shards.read(path)
        counts += vocab.count_tokens(shard.input_ids, shard.loss_mask, vocab_size)
        per_shard[path.name] = {key: shard.attrs[key] for key in ("num_sequences", "num_tokens",
                                                                  "num_loss_tokens")}
    if not counts.any():
        raise ClearError(f"vocab: the token shards hold no assistant tokens ({len(shard_paths)} shards); "
                         f"see the tokenize logs (an end-of-turn or template problem: data.end_of_turn, "
                         f"target.chat_template)")
    draft = vocab.select(counts, min(draft_vocab_size, vocab_size))
    draft_vocab.write(output, draft)
    distinct = int((counts > 0).sum())
    log.info("draft vocab: %d of %d ids; %d distinct assistant tokens seen; coverage of assistant tokens %.4f",
             len(draft.draft_ids), vocab_size, distinct, draft.coverage)
    return {"vocab_size": vocab_size, "draft_vocab_size": len(draft.draft_ids), "coverage": draft.coverage,
            "distinct_assistant_tokens": distinct, "shards": per_shard,
            "total_tokens": int(sum(s["num_tokens"] for s in per_shard.values())),
            "total_loss_tokens": int(sum(s["num_loss_tokens"] for s in per_shard.values()))}
