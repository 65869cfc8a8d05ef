"""Rule `vocab`: count assistant tokens over all token shards and pick the draft vocabulary."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_pipeline import logs, vocab
from eagle3_pipeline.formats import draft_vocab, reports, token_shards
from eagle3_pipeline.logs import ClearError
from eagle3_pipeline.runtime.target.loading import load_config
from eagle3_pipeline.settings import from_section


@dataclass(frozen=True)
class Settings:
    draft_vocab_size: int  # at most the target's vocabulary


def build_vocab(shard_paths: list[Path], target_dir: Path, draft_vocab_size: int, output: Path,
                log: logging.Logger) -> dict[str, Any]:
    vocab_size = load_config(target_dir).get_text_config().vocab_size  # multimodal configs nest it
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


def run(shard_paths: list[Path], target_dir: Path, ingest_report: Path, vocab_output: Path, stats_output: Path,
        settings: Settings, log: logging.Logger) -> dict[str, Any]:
    stats = build_vocab(shard_paths, target_dir, settings.draft_vocab_size, vocab_output, log)
    stats["ingest"] = reports.read(ingest_report)
    reports.write(stats_output, stats)
    return stats


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    settings = from_section(Settings, dict(snakemake.params.items()))
    run([Path(p) for p in snakemake.input.shards], Path(snakemake.input.target), Path(snakemake.input.ingest_report),
        Path(snakemake.output.vocab), Path(snakemake.output.stats), settings, log)
