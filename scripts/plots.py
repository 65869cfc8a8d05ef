"""Rule `plots`: the report's figures, table and provenance."""

from eagle3_pipeline.stages import plots

plots.run_from_snakemake(globals()["snakemake"])
