"""Rule `export`: write the serving directory SGLang and vLLM load."""

from pathlib import Path

from eagle3_pipeline import logs
from eagle3_pipeline.stages import export

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
model = export.load_trained(Path(snakemake.input.weights))
export.export(model, Path(snakemake.output[0]), dtype=snakemake.params.dtype)
log.info("exported %s (%s): SGLang --speculative-algorithm EAGLE3 --speculative-draft-model-path %s",
         snakemake.output[0], snakemake.params.dtype, snakemake.output[0])
