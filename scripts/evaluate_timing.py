"""Rule `evaluate_timing`: the timing pass - speeds of every method in one process, after the tau pass."""

from eagle3_pipeline.gpu_claims import claim_for_job

claim_for_job(globals()["snakemake"])  # first: CUDA reads the visible devices once, when the stage starts it
from eagle3_pipeline.stages import evaluate_timing  # noqa: E402

evaluate_timing.run_from_snakemake(globals()["snakemake"])
