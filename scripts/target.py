"""Rule `target`: materialise the target model as a plain HF directory."""

import sys
from pathlib import Path

from eagle3_pipeline import logs
from eagle3_pipeline.families import target_support_problem
from eagle3_pipeline.formats.target_dir import read_config
from eagle3_pipeline.stages import target

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
params = snakemake.params
identity = target.materialise(params.source, Path(snakemake.output[0]), gguf_file=params.gguf_file,
                              revision=params.revision, trust_remote_code=params.trust_remote_code,
                              chat_template=params.chat_template)
problem = target_support_problem(read_config(Path(snakemake.output[0])))
if problem:  # a hub id or GGUF seen for the first time: stop before any extraction
    message = f"Target {params.source!r} cannot get a served EAGLE-3 drafter: {problem}"
    log.error(message)
    sys.exit(message)
log.info("target ready: %s (content hash %s)", snakemake.output[0], identity["content_hash"][:16])
