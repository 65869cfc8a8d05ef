"""Rule `evaluate_timing`: the timing pass - speeds of every method in one process, after the tau pass."""

from eagle3_pipeline.stages import evaluate_timing

evaluate_timing.run_from_snakemake(globals()["snakemake"])
