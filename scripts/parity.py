"""Rule `parity`: the configured backend against an fp32 HF reference on a few sequences of shard 0."""

from eagle3_pipeline.stages import parity

parity.run_from_snakemake(globals()["snakemake"])
