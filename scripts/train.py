"""Rule `train`: train the drafter on the hidden-state stores (resumes from train_state/ after a kill)."""

from eagle3_pipeline.stages import train

train.run_from_snakemake(globals()["snakemake"])
