"""Rule `ingest`: read raw conversations, normalise, report drops, split into shards + held-out."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import conversations, logs
from eagle3_pipeline.formats import conversation_shards, reports
from eagle3_pipeline.settings import from_section, setting


@dataclass(frozen=True)
class Settings:
    num_shards: int
    eval_conversations: int
    train_conversations: int | None
    seed: int
    weights: tuple[float, ...] | None = setting(convert=tuple)  # one per input; None: every input once


def run(inputs: list[Path], shard_outputs: list[Path], eval_output: Path, report_output: Path,
        settings: Settings, log: logging.Logger) -> dict[str, Any]:
    kept, report = conversations.ingest(inputs)
    for line in report.summary_lines():
        log.info(line)
    conversations.check_systemic(report)
    weights = None
    if settings.weights:  # by source file name: normalized conversations record the file they came from
        weights = {path.name: w for path, w in zip(inputs, settings.weights, strict=True)}
    shards, held_out = conversations.split(kept, settings.num_shards, settings.eval_conversations,
                                           settings.train_conversations, settings.seed, weights)
    for shard, path in zip(shards, shard_outputs, strict=True):
        conversation_shards.write(path, shard)
    conversation_shards.write(eval_output, held_out)
    summary = report.as_dict() | {"train_conversations": sum(map(len, shards)), "eval_conversations": len(held_out),
                                  "conversations_per_shard": [len(s) for s in shards]}
    reports.write(report_output, summary)
    log.info("wrote %d shards (%s conversations) and %d held-out", len(shards),
             summary["conversations_per_shard"], len(held_out))
    return summary


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    run([Path(p) for p in snakemake.input], [Path(p) for p in snakemake.output.shards],
        Path(snakemake.output.eval), Path(snakemake.output.report), from_section(Settings, snakemake.params.data), log)
