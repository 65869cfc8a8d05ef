"""Rule `ingest`: read raw conversations, normalise, report drops, split into shards + eval."""

from eagle3_pipeline.stages import ingest

ingest.run_from_snakemake(globals()["snakemake"])
