"""Rule `evaluate_timing`: the timing pass - speeds of every method in one process, after the tau pass."""

from pathlib import Path

import torch

from eagle3_pipeline import logs
from eagle3_pipeline.formats import evaluation
from eagle3_pipeline.stages import evaluate

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
settings = snakemake.params.settings
torch.set_num_threads(snakemake.threads)
prompt_sets = {name: evaluate.load_prompts(Path(path), settings["timing"]["prompts"], settings["multi_turn"])
               for name, path in zip(snakemake.params.prompt_sets, snakemake.input.prompts, strict=True)}
log.info("timing pass: %d prompts from each of %s on %s (%s), %d new tokens, k in %s",
         settings["timing"]["prompts"], list(prompt_sets), settings["device"], settings["dtype"],
         settings["timing"]["max_new_tokens"], settings["draft_lengths"])
results = evaluate.run_timing(Path(snakemake.input.target), Path(snakemake.input.serving), prompt_sets, settings,
                              snakemake.params.trust_remote_code, log)
output = Path(snakemake.output[0])
evaluation.write_results(output, results)
