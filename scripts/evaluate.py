"""Rule `evaluate`: speculative decoding on one prompt set with the exported drafter and the baselines."""

from eagle3_pipeline.gpu_claims import claim_for_job

claim_for_job(globals()["snakemake"])  # first: CUDA reads the visible devices once, when the stage starts it
from eagle3_pipeline.stages import evaluate  # noqa: E402

evaluate.run_from_snakemake(globals()["snakemake"])
