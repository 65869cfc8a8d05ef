"""Rule `disk_report`: planned (from exact token counts) vs actual bytes of every hidden-state store."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import logs, plan
from eagle3_pipeline.formats import reports, token_shards, zarr_io


@dataclass(frozen=True)
class Settings:
    expected_compression: float | None  # what the plan assumed: raw bytes / stored bytes (None: the codec's)
    store_dtype: str

    @classmethod
    def from_config(cls, plan_section: dict[str, Any], extract_section: dict[str, Any]) -> Settings:
        return cls(expected_compression=plan_section["expected_compression"],
                   store_dtype=extract_section["store_dtype"])

    @classmethod
    def from_params(cls, params: Any) -> Settings:
        """From the rule's params (only what the report depends on: a change reruns it)."""
        return cls(expected_compression=params.compression, store_dtype=params.store_dtype)


def shard_row(store: Path, tokens: Path, settings: Settings, log: logging.Logger) -> dict[str, Any]:
    attrs = token_shards.validate(tokens)
    hidden_size = zarr_io.attrs(store)["hidden_size"]
    raw_per_token, per_token = plan.hidden_bytes_per_token(hidden_size, settings.expected_compression,
                                                           settings.store_dtype)
    planned = int(attrs["num_tokens"] * per_token)
    actual = zarr_io.directory_bytes(store)
    row = {"tokens": attrs["num_tokens"], "planned_bytes": planned, "actual_bytes": actual,
           "actual_over_planned": actual / planned,
           "raw_bytes": attrs["num_tokens"] * raw_per_token, "store_dtype": settings.store_dtype}
    log.info("%s: planned %s, actual %s (%.3f), %.2fx smaller than raw", store.name,
             plan.human_bytes(planned), plan.human_bytes(actual), actual / planned, row["raw_bytes"] / actual)
    return row


def run(stores: list[Path], token_shard_paths: list[Path], output: Path, settings: Settings,
        log: logging.Logger) -> dict[str, Any]:
    rows = {store.name: shard_row(store, tokens, settings, log)
            for store, tokens in zip(stores, token_shard_paths, strict=True)}
    total_planned = sum(r["planned_bytes"] for r in rows.values())
    total_actual = sum(r["actual_bytes"] for r in rows.values())
    summary = {"shards": rows, "planned_bytes": total_planned, "actual_bytes": total_actual,
               "actual_over_planned": total_actual / total_planned,
               "within_10_percent": abs(total_actual / total_planned - 1) <= 0.10}
    log.info("total: planned %s, actual %s, actual/planned %.3f", plan.human_bytes(total_planned),
             plan.human_bytes(total_actual), summary["actual_over_planned"])
    reports.write(output, summary)
    return summary


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    run([Path(p) for p in snakemake.input.stores], [Path(p) for p in snakemake.input.tokens],
        Path(snakemake.output[0]), Settings.from_params(snakemake.params), log)
