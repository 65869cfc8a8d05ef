"""Rule `extract`: run the target over one token shard and write its hidden-state store."""

from eagle3_pipeline.gpu_claims import claim_for_job

claim_for_job(globals()["snakemake"])  # first: CUDA reads the visible devices once, when the stage starts it
from eagle3_pipeline.stages import extract  # noqa: E402

extract.run_from_snakemake(globals()["snakemake"])
