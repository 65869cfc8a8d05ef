"""Rule `regenerate`: one conversation shard -> the same conversations with the target's own replies."""

from pathlib import Path

import torch

from eagle3_pipeline import logs
from eagle3_pipeline.stages import regenerate

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
torch.set_num_threads(snakemake.threads)
regenerate.run_shard(
    Path(snakemake.input.conversations),
    Path(snakemake.output[0]),
    Path(snakemake.input.target),
    regenerate.Settings.from_config(snakemake.params.regenerate, snakemake.params.max_seq_len),
    log,
    trust_remote_code=snakemake.params.trust_remote_code,
)
