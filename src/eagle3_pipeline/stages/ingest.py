"""Rule `ingest`: read raw conversations, normalise, report drops, split into shards and two held-out sets
(evaluation; selection of the epoch)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import conversations, logs
from eagle3_pipeline.copying import CopyBoost
from eagle3_pipeline.formats import conversation_shards, reports
from eagle3_pipeline.settings import from_section, setting


@dataclass(frozen=True)
class Settings:
    num_shards: int
    eval_conversations: int
    selection_conversations: int
    train_conversations: int | None
    seed: int
    weights: tuple[float, ...] | None = setting(convert=tuple)  # one per input; None: every input once
    copying: CopyBoost  # conversations whose replies copy from the user, counted more often


def ingest_settings(data: dict[str, Any]) -> Settings:
    """From the data section or the rule's params (which leave the copying keys out while copying is off)."""
    return from_section(Settings, data, copying=CopyBoost.of(data))


def run(inputs: list[Path], shard_outputs: list[Path], eval_output: Path, selection_output: Path,
        report_output: Path, settings: Settings, log: logging.Logger) -> dict[str, Any]:
    kept, report = conversations.ingest(inputs)
    for line in report.summary_lines():
        log.info(line)
    conversations.check_systemic(report)
    weights = None
    if settings.weights:  # by source file name: normalized conversations record the file they came from
        weights = {path.name: w for path, w in zip(inputs, settings.weights, strict=True)}
    parts = conversations.split(kept, settings.num_shards, settings.eval_conversations,
                                settings.selection_conversations, settings.train_conversations, settings.seed, weights,
                                settings.copying)
    for shard, path in zip(parts.shards, shard_outputs, strict=True):
        conversation_shards.write(path, shard)
    conversation_shards.write(eval_output, parts.evaluation)
    conversation_shards.write(selection_output, parts.selection)
    summary = report.as_dict() | {"train_conversations": sum(map(len, parts.shards)),
                                  "eval_conversations": len(parts.evaluation),
                                  "selection_conversations": len(parts.selection),
                                  "left_out_parts_and_copies_of_held_out": parts.left_out,
                                  "conversations_per_shard": [len(s) for s in parts.shards]}
    reports.write(report_output, summary)
    log.info("wrote %d shards (%s conversations), %d held out for evaluation and %d for selection (their other "
             "parts and copies, %d, in no set)", len(parts.shards), summary["conversations_per_shard"],
             len(parts.evaluation), len(parts.selection), parts.left_out)
    return summary


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    output = snakemake.output
    run([Path(p) for p in snakemake.input], [Path(p) for p in output.shards], Path(output.eval),
        Path(output.selection), Path(output.report), ingest_settings(snakemake.params.data), log)
