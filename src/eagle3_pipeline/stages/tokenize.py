"""Rule `tokenize`: one conversation shard -> one token shard (chat template + assistant loss mask)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import logs, systemic
from eagle3_pipeline.formats import conversation_shards, token_shards
from eagle3_pipeline.formats.target_dir import read_identity
from eagle3_pipeline.logs import Progress
from eagle3_pipeline.runtime.target.loading import load_tokenizer
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.tokenization import character_bound, end_of_turn_marker, template_hash, tokenize_or_drop


@dataclass(frozen=True)
class Settings:
    max_seq_len: int
    overlength: str  # "truncate" or "drop"
    end_of_turn: str | None  # None: the tokenizer's EOS token
    trust_remote_code: bool


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
        outcome = tokenize_or_drop(tokenizer, conversation, marker, bound, max_seq_len, overlength)
        if outcome.cut_before_tokenizing:
            counts["cut_before_tokenizing"] += 1
        if outcome.dropped:
            counts[outcome.dropped] += 1
        if outcome.template_error:
            first_template_error = first_template_error or f"record {index}: {outcome.template_error}"
            if counts["dropped_template_error"] <= 5:
                log.warning("%s record %d (id %s): dropped: %s", source_name, index, conversation["id"],
                            outcome.template_error)
        elif not outcome.dropped:
            counts["truncated"] += outcome.tokenized.truncated
            sequences.append(outcome.tokenized)
        progress.update(1, len(outcome.tokenized.input_ids) if outcome.tokenized else 0)
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


def run(conversations_path: Path, target_dir: Path, output: Path, settings: Settings,
        log: logging.Logger) -> dict[str, Any]:
    return tokenize_shard(
        conversation_shards.read(conversations_path),
        tokenizer=load_tokenizer(target_dir, settings.trust_remote_code),
        target_dir=target_dir,
        output=output,
        max_seq_len=settings.max_seq_len,
        overlength=settings.overlength,
        end_of_turn=settings.end_of_turn,
        source_name=str(conversations_path),
        log=log,
    )


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    settings = from_section(Settings, snakemake.params.data, trust_remote_code=snakemake.params.trust_remote_code)
    run(Path(snakemake.input.conversations), Path(snakemake.input.target), Path(snakemake.output[0]), settings, log)
