"""Rule `evaluate`: speculative decoding on one prompt set with the exported drafter and the baselines."""

from eagle3_pipeline.stages import evaluate

evaluate.run_from_snakemake(globals()["snakemake"])
