"""Rule `train`: train the drafter on the hidden-state stores (resumes from train_state/ after a kill)."""

from eagle3_pipeline.gpu_claims import claim_for_job

claim_for_job(globals()["snakemake"])  # first: CUDA reads the visible devices once, when the stage starts it
from eagle3_pipeline.stages import train  # noqa: E402

train.run_from_snakemake(globals()["snakemake"])
