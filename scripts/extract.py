"""Rule `extract`: run the target over one token shard and write its hidden-state store."""

from pathlib import Path

import torch

from eagle3_pipeline import logs
from eagle3_pipeline.formats.target_dir import read_identity
from eagle3_pipeline.runtime import backends
from eagle3_pipeline.stages import extract as extract_stage

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
settings = snakemake.params.extract
torch.set_num_threads(snakemake.threads)
target_dir = Path(snakemake.input.target)
backend = backends.from_config(settings, target_dir, snakemake.params.trust_remote_code)
identity = read_identity(target_dir)
attrs = extract_stage.extract_shard(
    backend, Path(snakemake.input.tokens), Path(snakemake.output[0]), settings["token_budget"],
    settings["writer_threads"],
    {"target_hash": identity["content_hash"], "target_revision": identity["source"].get("revision"),
     "device": str(backend.device)},
    log,
    store_shard_bytes=settings["store_shard_mb"] << 20,
)
log.info("store complete: %d sequences, %d tokens", attrs["num_sequences"], attrs["num_tokens"])
