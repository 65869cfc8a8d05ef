"""Rule `train_pass`: one pass over one window's hidden-state stores (training under a disk budget)."""

from eagle3_pipeline.stages import train_pass

train_pass.run_from_snakemake(globals()["snakemake"])
