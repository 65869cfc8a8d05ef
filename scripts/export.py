"""Rule `export`: write the serving directory SGLang and vLLM load."""

from eagle3_pipeline.stages import export

export.run_from_snakemake(globals()["snakemake"])
