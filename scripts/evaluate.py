"""Rule `evaluate`: speculative decoding on one prompt set with the exported drafter and the baselines."""

import shutil
from pathlib import Path

import torch

from eagle3_pipeline import logs
from eagle3_pipeline.formats import evaluation
from eagle3_pipeline.stages import evaluate

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
settings = snakemake.params.settings
torch.set_num_threads(snakemake.threads)
prompts = evaluate.load_prompts(Path(snakemake.input.prompts), settings["max_prompts"], settings["multi_turn"])
log.info("evaluating %d prompts from %s on %s (%s), k in %s, %d worker process(es)", len(prompts),
         snakemake.input.prompts, settings["device"], settings["dtype"], settings["draft_lengths"],
         settings["workers"])
output = Path(snakemake.output[0])
progress_dir = output.with_name(output.name + ".progress")  # beside the output: kept when the job is killed
results = evaluate.run_job(Path(snakemake.input.target), Path(snakemake.input.serving), prompts, settings,
                           snakemake.params.trust_remote_code, snakemake.log[0], log, progress_dir)
results["prompt_file"] = str(snakemake.input.prompts)
evaluation.write_results(output, results)
shutil.rmtree(progress_dir)
