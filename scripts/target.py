"""Rule `target`: materialise the target model as a plain HF directory."""

from eagle3_pipeline.stages import target

target.run_from_snakemake(globals()["snakemake"])
