"""Rule `parity`: the configured backend against an fp32 HF reference on a few sequences of shard 0."""

import json
from pathlib import Path

import torch

from eagle3_pipeline import logs
from eagle3_pipeline.formats import token_shards
from eagle3_pipeline.runtime import backends
from eagle3_pipeline.runtime.backends.hf import pick_device
from eagle3_pipeline.runtime.loading import load_model
from eagle3_pipeline.stages import parity

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
settings = snakemake.params.parity
torch.set_num_threads(snakemake.threads)
target_dir = Path(snakemake.input.target)
trust = snakemake.params.trust_remote_code
shard = token_shards.read(Path(snakemake.input.tokens))
sequences = [shard.sequence(i)[0][: settings["max_tokens"]] for i in range(min(settings["sequences"], len(shard)))]
backend = backends.from_config(snakemake.params.extract, target_dir, trust)
reference = load_model(target_dir, device=pick_device(settings["device"]), dtype=torch.float32,
                       trust_remote_code=trust)
report = parity.check(backend, reference, sequences, log)
if not report.passed:
    log.error("parity check FAILED for backend %s:\n  %s", report.backend, "\n  ".join(report.problems))
    raise parity.ParityError(f"backend {report.backend} disagrees with the HF reference "
                             f"(see {snakemake.log[0]}):\n  " + "\n  ".join(report.problems))
Path(snakemake.output[0]).write_text(json.dumps(report.as_dict(), indent=2))
log.info("parity check passed on %d sequences (%d tokens)", report.sequences, report.tokens)
