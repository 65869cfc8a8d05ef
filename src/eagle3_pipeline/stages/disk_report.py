"""Rule `disk_report`: planned (from exact token counts) vs actual bytes of every hidden-state store."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import logs, plan
from eagle3_pipeline.formats import reports, token_shards, zarr_io
from eagle3_pipeline.settings import from_section, setting


@dataclass(frozen=True)
class Settings:
    # what the plan assumed: raw bytes / stored bytes (None: the codec's)
    expected_compression: float | None = setting(key="compression")
    store_dtype: str


def shard_row(store: Path, tokens: Path, settings: Settings, log: logging.Logger) -> dict[str, Any]:
    return measured_row(store.name, tokens, zarr_io.attrs(store)["hidden_size"], zarr_io.directory_bytes(store),
                        settings, log)


def measured_row(name: str, tokens: Path, hidden_size: int, actual: int, settings: Settings,
                 log: logging.Logger) -> dict[str, Any]:
    attrs = token_shards.validate(tokens)
    raw_per_token, per_token = plan.hidden_bytes_per_token(hidden_size, settings.expected_compression,
                                                           settings.store_dtype)
    planned = int(attrs["num_tokens"] * per_token)
    row = {"tokens": attrs["num_tokens"], "planned_bytes": planned, "actual_bytes": actual,
           "actual_over_planned": actual / planned,
           "raw_bytes": attrs["num_tokens"] * raw_per_token, "store_dtype": settings.store_dtype}
    log.info("%s: planned %s, actual %s (%.3f), %.2fx smaller than raw", name,
             plan.human_bytes(planned), plan.human_bytes(actual), actual / planned, row["raw_bytes"] / actual)
    return row


def run(stores: list[Path], token_shard_paths: list[Path], output: Path, settings: Settings,
        log: logging.Logger) -> dict[str, Any]:
    rows = {store.name: shard_row(store, tokens, settings, log)
            for store, tokens in zip(stores, token_shard_paths, strict=True)}
    return write_summary(rows, output, log)


def write_summary(rows: dict[str, dict[str, Any]], output: Path, log: logging.Logger,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    total_planned = sum(r["planned_bytes"] for r in rows.values())
    total_actual = sum(r["actual_bytes"] for r in rows.values())
    summary = {"shards": rows, "planned_bytes": total_planned, "actual_bytes": total_actual,
               "actual_over_planned": total_actual / total_planned,
               "within_10_percent": abs(total_actual / total_planned - 1) <= 0.10, **(extra or {})}
    log.info("total: planned %s, actual %s, actual/planned %.3f", plan.human_bytes(total_planned),
             plan.human_bytes(total_actual), summary["actual_over_planned"])
    reports.write(output, summary)
    return summary


def run_windowed(pass_records: list[Path], token_shard_paths: list[Path], output: Path, settings: Settings,
                 log: logging.Logger) -> dict[str, Any]:
    """Under a disk budget the stores never exist at once: each pass recorded the sizes of its window's stores
    (one extraction of a shard is as large as any other) and the hidden-store bytes on disk when it started."""
    records = [reports.read(path) for path in pass_records]
    stores = {name: store for record in records for name, store in record["stores"].items()}
    rows = {f"shard-{name}.zarr": measured_row(f"shard-{name}.zarr", tokens, stores[name]["hidden_size"],
                                                stores[name]["bytes"], settings, log)
            for name, tokens in zip(sorted(stores), token_shard_paths, strict=True)}
    peak, budget = max(r["on_disk_bytes"] for r in records), records[0]["budget_bytes"]
    log.info("windows: at most %s of hidden stores on disk at a pass's start; budget %s", plan.human_bytes(peak),
             plan.human_bytes(budget))
    windows = {"peak_on_disk_bytes": peak, "budget_bytes": budget, "within_budget": peak <= budget}
    return write_summary(rows, output, log, {"windows": windows})


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    settings = from_section(Settings, dict(snakemake.params.items()))
    if hasattr(snakemake.input, "passes"):  # trained in windows under a disk budget
        return run_windowed([Path(p) for p in snakemake.input.passes], [Path(p) for p in snakemake.input.tokens],
                            Path(snakemake.output[0]), settings, log)
    run([Path(p) for p in snakemake.input.stores], [Path(p) for p in snakemake.input.tokens],
        Path(snakemake.output[0]), settings, log)
