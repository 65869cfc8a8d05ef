"""Does multi-GPU training (DDP through torchrun) follow the single-GPU loss curve? One run, three trainings on
the same hidden-state stores:

    A  1 GPU,  seed 0, batch B tokens            (the reference)
    A' 1 GPU,  seed 1, batch B tokens            (run-to-run noise: another init and data order)
    D  N GPUs, seed 0, batch B/N tokens per GPU  (the same global batch per step)

    python benchmarks/compare_ddp.py --run-dir results/smollm2-gpu --gpus 2 --steps 120 --out OUT

Prints the loss at every logged step, the mean relative gap |D-A|/A and the noise |A'-A|/A over the second half,
the verdict, and writes OUT/ddp_loss_curves.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from eagle3_pipeline import workflow_config
from eagle3_pipeline.config_schema import schema_defaults
from eagle3_pipeline.formats.metrics import read as read_metrics


def train_once(run_dir: Path, out: Path, name: str, settings: dict, gpus: int) -> list[dict[str, float]]:
    state = out / name
    state.mkdir(parents=True, exist_ok=True)
    args = {"stores": sorted(str(p) for p in (run_dir / "hidden").glob("shard-*.zarr")),
            "target": str(run_dir / "target"), "vocab": str(run_dir / "vocab" / "draft_vocab.safetensors"),
            "state_dir": str(state), "settings": settings, "weights": str(state / "drafter.safetensors"),
            "summary": str(state / "summary.json"), "log": str(state / "train.log")}
    (state / "args.json").write_text(json.dumps(args))
    command = [sys.executable, "-m", "eagle3_pipeline.stages.train", str(state / "args.json")]
    if gpus > 1:
        command[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m"]
    subprocess.run(command, check=True)
    return read_metrics(state / "metrics.csv")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True, help="results/<run> with hidden/, vocab/, target/")
    parser.add_argument("--config", type=Path, default=Path("config/examples/gpu-smollm2.yaml"))
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())  # over the schema's defaults, as the workflow reads it
    config["data"] = schema_defaults("data") | config.get("data", {})
    workflow_config.link_max_seq_len(config)  # train.max_seq_len: null follows data.max_seq_len
    base = schema_defaults("train") | config["train"]
    base |= {"max_steps": args.steps, "log_every": 10, "checkpoint_every": 10 ** 9, "epochs": 50}
    batch = base["batch_tokens"]
    curves = {
        "A: 1 GPU, seed 0": train_once(args.run_dir, args.out, "single_seed0", base | {"seed": 0}, 1),
        "A': 1 GPU, seed 1": train_once(args.run_dir, args.out, "single_seed1", base | {"seed": 1}, 1),
        f"D: {args.gpus} GPUs, seed 0": train_once(args.run_dir, args.out, "ddp_seed0",
                                                   base | {"seed": 0, "batch_tokens": batch // args.gpus},
                                                   args.gpus),
    }
    (reference, noise, ddp) = curves.values()
    print(f"{'step':>6} " + " ".join(f"{name:>22}" for name in curves))
    for rows in zip(*curves.values(), strict=False):
        print(f"{int(rows[0]['step']):>6} " + " ".join(f"{r['loss']:>22.4f}" for r in rows))
    half = len(reference) // 2

    def gap(other: list[dict[str, float]]) -> float:
        pairs = list(zip(reference[half:], other[half:], strict=False))
        return sum(abs(o["loss"] - r["loss"]) / r["loss"] for r, o in pairs) / len(pairs)

    ddp_gap, noise_gap = gap(ddp), gap(noise)
    speed = {name: sum(r["tokens_per_s"] for r in rows[1:]) / max(len(rows) - 1, 1) for name, rows in curves.items()}
    print(f"second half: mean |D-A|/A = {ddp_gap:.4f}, noise |A'-A|/A = {noise_gap:.4f} -> "
          f"{'within noise' if ddp_gap <= max(noise_gap, 0.01) * 1.5 else 'OUTSIDE noise'}")
    print("tokens/s: " + ", ".join(f"{name} {rate:,.0f}" for name, rate in speed.items()))
    for name, rows in curves.items():
        accuracies = " ".join(f"{rows[-1]['acc_' + str(k)]:.3f}" for k in range(base["ttt_steps"]))
        print(f"final per-step accuracy, {name}: [{accuracies}]")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, rows in curves.items():
        axis.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name)
    axis.set_xlabel("step (same global batch)")
    axis.set_ylabel("TTT loss")
    axis.set_title(f"DDP vs single GPU: gap {ddp_gap:.3f}, noise {noise_gap:.3f}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out / "ddp_loss_curves.png", dpi=120)


if __name__ == "__main__":
    main()
