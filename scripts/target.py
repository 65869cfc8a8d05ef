"""Rule `target`: materialise the target model as a plain HF directory."""

from pathlib import Path

from eagle3_pipeline import logs, target

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
params = snakemake.params
identity = target.materialise(params.source, Path(snakemake.output[0]), gguf_file=params.gguf_file,
                              revision=params.revision, trust_remote_code=params.trust_remote_code,
                              chat_template=params.chat_template)
log.info("target ready: %s (content hash %s)", snakemake.output[0], identity["content_hash"][:16])
