"""Rule `parity`: the configured backend against an fp32 HF reference on a few sequences of shard 0."""

from eagle3_pipeline.gpu_claims import claim_for_job

claim_for_job(globals()["snakemake"])  # first: CUDA reads the visible devices once, when the stage starts it
from eagle3_pipeline.stages import parity  # noqa: E402

parity.run_from_snakemake(globals()["snakemake"])
