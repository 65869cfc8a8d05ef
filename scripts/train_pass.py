"""Rule `train_pass`: one pass over one window's hidden-state stores (training under a disk budget)."""

from eagle3_pipeline.gpu_claims import claim_for_job

claim_for_job(globals()["snakemake"])  # first: CUDA reads the visible devices once, when the stage starts it
from eagle3_pipeline.stages import train_pass  # noqa: E402

train_pass.run_from_snakemake(globals()["snakemake"])
