"""Rule `extract`: run the target over one token shard and write its hidden-state store."""

from eagle3_pipeline.stages import extract

extract.run_from_snakemake(globals()["snakemake"])
