"""Rule `train`: train the drafter on the hidden-state stores (resumes from train_state/ after a kill)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from eagle3_pipeline.stages import train_main

snakemake = globals()["snakemake"]
torch.set_num_threads(snakemake.threads)
Path(snakemake.output.config).write_text(yaml.safe_dump(dict(snakemake.params.provenance), sort_keys=False))
args = {
    "stores": list(snakemake.input.stores), "heldout": list(snakemake.input.heldout),
    "target": snakemake.input.target, "vocab": snakemake.input.vocab,
    "state_dir": snakemake.params.state_dir, "settings": dict(snakemake.params.settings),
    "weights": snakemake.output.weights, "summary": snakemake.output.summary, "log": snakemake.log[0],
}
gpus = int(snakemake.resources.get("gpu", 0))
if gpus > 1:
    # One process per GPU; torchrun sets RANK/WORLD_SIZE/LOCAL_RANK for train_main.
    args_path = Path(snakemake.params.state_dir) / "args.json"
    args_path.parent.mkdir(parents=True, exist_ok=True)
    args_path.write_text(json.dumps(args))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                    "-m", "eagle3_pipeline.stages.train_main", str(args_path)], check=True)
else:
    train_main.run(args)
shutil.copyfile(Path(snakemake.params.state_dir) / "metrics.csv", snakemake.output.metrics)
