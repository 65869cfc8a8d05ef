"""Rule `regenerate`: one conversation shard -> the same conversations with the target's own replies."""

from eagle3_pipeline.stages import regenerate

regenerate.run_from_snakemake(globals()["snakemake"])
