"""Rule `tokenize`: one conversation shard -> one token shard (chat template + assistant loss mask)."""

from eagle3_pipeline.stages import tokenize

tokenize.run_from_snakemake(globals()["snakemake"])
