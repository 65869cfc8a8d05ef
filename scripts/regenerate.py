"""Rule `regenerate`: one conversation shard -> the same conversations with the target's own replies."""

from eagle3_pipeline.gpu_claims import claim_for_job

claim_for_job(globals()["snakemake"])  # first: CUDA reads the visible devices once, when the stage starts it
from eagle3_pipeline.stages import regenerate  # noqa: E402

regenerate.run_from_snakemake(globals()["snakemake"])
