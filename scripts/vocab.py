"""Rule `vocab`: count assistant tokens over all token shards and pick the draft vocabulary."""

from eagle3_pipeline.stages import vocab

vocab.run_from_snakemake(globals()["snakemake"])
