"""The data stage's jobs: tokenize one conversation shard, build the draft vocabulary."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from . import target, token_shards, vocab
from .logs import Progress
from .tokenization import TemplateError, end_of_turn_marker, template_hash, tokenize_conversation


def tokenize_shard(conversations: list[dict[str, Any]], tokenizer: Any, target_dir: Path, output: Path,
                   max_seq_len: int, overlength: str, end_of_turn: str | None, source_name: str,
                   log: logging.Logger) -> dict[str, Any]:
    marker = end_of_turn_marker(tokenizer, end_of_turn)
    counts: Counter = Counter()
    sequences = []
    progress = Progress(log, "tokenize", len(conversations))
    for index, conversation in enumerate(conversations):
        try:
            tokenized = tokenize_conversation(tokenizer, conversation, marker, max_seq_len, overlength)
        except TemplateError as exc:
            counts["dropped_template_error"] += 1
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
    attrs = {
        "template_hash": template_hash(tokenizer),
        "target_hash": target.read_identity(target_dir)["content_hash"],
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
    vocab_size = target.load_config(target_dir).vocab_size
    counts = np.zeros(vocab_size, dtype=np.int64)
    per_shard = {}
    for path in shard_paths:
        shard = token_shards.read(path)
        counts += vocab.count_tokens(shard.input_ids, shard.loss_mask, vocab_size)
        per_shard[path.name] = {key: shard.attrs[key] for key in ("num_sequences", "num_tokens",
                                                                  "num_loss_tokens")}
    draft = vocab.select(counts, min(draft_vocab_size, vocab_size))
    vocab.save(draft, output)
    distinct = int((counts > 0).sum())
    log.info("draft vocab: %d of %d ids; %d distinct assistant tokens seen; coverage of assistant tokens %.4f",
             len(draft.draft_ids), vocab_size, distinct, draft.coverage)
    return {"vocab_size": vocab_size, "draft_vocab_size": len(draft.draft_ids), "coverage": draft.coverage,
            "distinct_assistant_tokens": distinct, "shards": per_shard,
            "total_tokens": int(sum(s["num_tokens"] for s in per_shard.values())),
            "total_loss_tokens": int(sum(s["num_loss_tokens"] for s in per_shard.values()))}
