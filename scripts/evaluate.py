"""Rule `evaluate`: speculative decoding on one prompt set with the exported drafter and the baselines."""

import json
from pathlib import Path

import torch

from eagle3_pipeline import evaluate, export, logs, target
from eagle3_pipeline.backends.hf import pick_device
from eagle3_pipeline.train import read_target_head

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
settings = snakemake.params.settings
torch.set_num_threads(snakemake.threads)
device = pick_device(settings["device"])
dtype = getattr(torch, settings["dtype"])
target_dir = Path(snakemake.input.target)
tokenizer = target.load_tokenizer(target_dir, snakemake.params.trust_remote_code)
model = target.load_model(target_dir, device=device, dtype=dtype, trust_remote_code=snakemake.params.trust_remote_code)
embedding, _ = read_target_head(target_dir)
drafter = export.load(Path(snakemake.input.serving), embedding=embedding.float(), dtype=dtype).to(device)
drafters = {"eagle3": drafter}
if settings["untrained_baseline"]:
    drafters["eagle3-untrained"] = evaluate.untrained_like(drafter)
prompts = evaluate.load_prompts(Path(snakemake.input.prompts), settings["max_prompts"], settings["multi_turn"])
log.info("evaluating %d prompts from %s on %s (%s), k in %s", len(prompts), snakemake.input.prompts, device,
         settings["dtype"], settings["draft_lengths"])
results = evaluate.run(evaluate.Target(model, drafter.config.aux_layer_ids), tokenizer, prompts, drafters,
                       settings["draft_lengths"], settings["max_new_tokens"], log)
results["device"] = str(device)
results["prompt_file"] = str(snakemake.input.prompts)
Path(snakemake.output[0]).write_text(json.dumps(results, indent=2))
