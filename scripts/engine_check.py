"""Rule `engine_check`: the exported drafter served by vLLM, its acceptance beside the evaluator's."""

from eagle3_pipeline.gpu_claims import claim_for_job

claim_for_job(globals()["snakemake"])  # first: CUDA reads the visible devices once, when the stage starts it
from eagle3_pipeline.stages import engine_check  # noqa: E402

engine_check.run_from_snakemake(globals()["snakemake"])
