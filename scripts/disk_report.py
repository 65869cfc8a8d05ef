"""Rule `disk_report`: planned (from exact token counts) vs actual bytes of every hidden-state store."""

import json
from pathlib import Path

from eagle3_pipeline import logs, plan
from eagle3_pipeline.formats import token_shards, zarr_io

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
rows = {}
for store, tokens in zip(snakemake.input.stores, snakemake.input.tokens, strict=True):
    attrs = token_shards.validate(Path(tokens))
    hidden_size = zarr_io.attrs(Path(store))["hidden_size"]
    _, per_token = plan.hidden_bytes_per_token(hidden_size, snakemake.params.compression)
    planned = int(attrs["num_tokens"] * per_token)
    actual = zarr_io.directory_bytes(Path(store))
    rows[Path(store).name] = {"tokens": attrs["num_tokens"], "planned_bytes": planned, "actual_bytes": actual,
                              "actual_over_planned": actual / planned,
                              "raw_bytes": attrs["num_tokens"] * plan.hidden_bytes_per_token(hidden_size, 1)[0]}
    log.info("%s: planned %s, actual %s (%.3f), %.2fx smaller than raw", Path(store).name,
             plan.human_bytes(planned), plan.human_bytes(actual), actual / planned,
             rows[Path(store).name]["raw_bytes"] / actual)
total_planned = sum(r["planned_bytes"] for r in rows.values())
total_actual = sum(r["actual_bytes"] for r in rows.values())
summary = {"shards": rows, "planned_bytes": total_planned, "actual_bytes": total_actual,
           "actual_over_planned": total_actual / total_planned,
           "within_10_percent": abs(total_actual / total_planned - 1) <= 0.10}
log.info("total: planned %s, actual %s, actual/planned %.3f", plan.human_bytes(total_planned),
         plan.human_bytes(total_actual), summary["actual_over_planned"])
Path(snakemake.output[0]).write_text(json.dumps(summary, indent=2))
