"""Drafter training throughput and MFU against the training path of an earlier commit, in one run.

    python benchmarks/bench_train.py [--baseline-commit ee0ee61 | --baseline-src DIR] [--only example]
                                     [--peak-tflops 989] [--device cuda]

Each path is measured in a Python process of its own: this checkout's package, and the package as it was at
`--baseline-commit` (`git archive` of its `src/` and `config/` into a temporary directory) or in `--baseline-src`
(a folder holding a copy of both, for a machine without the git history), its `src/` first on that process's
PYTHONPATH. Both processes train the same drafter shapes, from the same seeded weights, on the same random
activations:

- full rows: every batch 8 (or 4) x 2048 real tokens, 75 % of them the assistant's - the kernels alone;
- ShareGPT-like lengths: the same sequence lengths (log-normal, median 600, capped at 2048) batched by the path's
  own batch schedule - what a real epoch sees. Rates count real (unpadded) tokens.

Every batch starts on the host, pinned, and each step copies it to the GPU, as the training loop does with what
its loader hands over (earlier versions of this benchmark kept the batches on the GPU).

The first 25 % of every row are prompt tokens (no loss), as in the GPU example's data (75 % of its tokens are the
assistant's): a path may skip work on them. Both paths' TTT step-0 loss on one batch is printed first: the
objective is the same, so they must agree. MFU = model FLOPs (forward + backward of every TTT step over every
position, plus the teacher head) / time / peak, so a path that skips positions is credited with their FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
ASSISTANT_SHARE = 0.75
SHAPES = {  # name: (DrafterConfig fields, tokens per batch)
    "smollm2": (dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, vocab_size=49152, draft_vocab_size=16384, target_hidden_size=576,
                     aux_layer_ids=[2, 15, 27], rope_theta=100000.0), 16384),
    "example": (dict(hidden_size=576, intermediate_size=6144, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, vocab_size=49152, draft_vocab_size=32768, target_hidden_size=576,
                     aux_layer_ids=[2, 15, 27], rope_theta=100000.0), 16384),
    "8b": (dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                aux_layer_ids=[2, 16, 29], rope_theta=500000.0), 8192),
}
TITLES = {"smollm2": "SmolLM2-135M drafter (target-width MLP, K=16384)",
          "example": "SmolLM2-135M drafter as the GPU example trains it (4x MLP, K=32768)",
          "8b": "8B-shaped drafter (K=32000)"}


def sharegpt_like_lengths(count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=np.log(600), sigma=0.9, size=count), 32, 2048).astype(np.int64)


def random_batch(config, rows: list[int], width: int, device: str) -> dict[str, torch.Tensor]:
    """A collated batch as the training loader hands it over: on the host (pinned for a GPU), with the counted
    positions listed (`predicted`, as `collate` lists them; a path that finds them itself ignores the key)."""
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    loss_mask = valid.clone()
    for row, length in enumerate(rows):
        valid[row, :length] = True
        loss_mask[row, round((1 - ASSISTANT_SHARE) * length): length] = True
    dtype = torch.bfloat16
    batch = {"input_ids": torch.randint(0, config.vocab_size, (len(rows), width)),
             "loss_mask": loss_mask, "valid": valid,
             "predicted": torch.stack((loss_mask & valid).nonzero(as_tuple=True)),
             "aux": torch.randn(len(rows), width, 3 * config.target_hidden_size, dtype=dtype),
             "last": torch.randn(len(rows), width, config.hidden_size, dtype=dtype)}
    return {key: value.pin_memory() for key, value in batch.items()} if device == "cuda" else batch


def measure(shape: str, ttt_steps: int, sequences: int, device: str, batch_tokens: int | None = None
            ) -> dict[str, float]:
    """One path (the package on this process's path) on one shape: step-0 loss, full-row and epoch rates."""
    import logging

    from eagle3_pipeline.config_schema import schema_defaults
    from eagle3_pipeline.drafter import objective
    from eagle3_pipeline.drafter.attention import choose_ttt_attention
    from eagle3_pipeline.drafter.batches import epoch_batches, padded_width, to_device
    from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
    from eagle3_pipeline.settings import from_section
    from eagle3_pipeline.training.settings import TrainSettings

    fields, shape_tokens = SHAPES[shape]
    batch_tokens = batch_tokens or shape_tokens
    config = DrafterConfig(**fields)
    settings = from_section(TrainSettings, schema_defaults("train") | {
        "ttt_steps": ttt_steps, "batch_tokens": batch_tokens, "max_seq_len": 2048})
    log = logging.getLogger("bench_train")
    torch.manual_seed(0)
    model = Drafter(config).to(device)
    lm_head = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
    spread = torch.arange(config.draft_vocab_size, device=device) * config.vocab_size // config.draft_vocab_size
    teacher = objective.Teacher(lm_head, spread)  # draft ids spread over the vocabulary
    attention = choose_ttt_attention("auto", torch.device(device), log)
    loss = objective.compiled_loss(settings.compile, torch.device(device), log)
    ttt = objective.TTTObjective(model, teacher, ttt_steps, 0.8, loss, attention)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                  fused=device == "cuda")

    def step(batch: dict[str, torch.Tensor]) -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            total, metrics = ttt(to_device(batch, device))  # each step's copy to the GPU, as in training
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        return metrics[0]["loss"] / metrics[0]["count"].clamp(min=1)

    def rate(batches: list[dict[str, torch.Tensor]], repeats: int) -> float:
        for batch in batches[:3]:  # warm-up: compilation, autotuning, mask caches
            step(batch)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            for batch in batches:
                step(batch)
        synchronize(device)
        return sum(int(b["valid"].sum()) for b in batches) * repeats / (time.perf_counter() - start)

    torch.manual_seed(1)
    full = random_batch(config, [2048] * max(batch_tokens // 2048, 1), 2048, device)
    step0 = float(step(full))
    lengths = sharegpt_like_lengths(sequences)
    rows = [[int(lengths[j]) for _, j in batch] for batch in epoch_batches([lengths], settings, 0)]
    width = [padded_width(max(r), settings.pad_multiple) for r in rows]
    real = [random_batch(config, r, w, device) for r, w in zip(rows, width, strict=True)]
    fill = sum(int(b["valid"].sum()) for b in real) / sum(b["valid"].numel() for b in real)
    per_token = ttt_steps * 3 * flops_per_token(config) + 2 * config.vocab_size * config.hidden_size
    import eagle3_pipeline
    return {"step0_loss": step0, "full": rate([full] * 4, 2), "epoch": rate(real, 1), "fill": fill,
            "flops_per_token": per_token, "package": eagle3_pipeline.__file__}


def flops_per_token(config) -> float:
    from eagle3_pipeline.drafter.model import count_flops_per_token
    return count_flops_per_token(config, 1024)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def baseline_source(commit: str | None, root: Path | None) -> Path:
    """The baseline's `src/` (the package reads its defaults from `config/` beside it)."""
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
        archive = subprocess.run(["git", "archive", commit, "src/eagle3_pipeline", "config"], check=True,
                                 capture_output=True, cwd=REPO).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root / "src"


def run_path(src: Path, shape: str, args: argparse.Namespace) -> dict[str, float]:
    """`measure` in a fresh process with `src` first on its path (its own compiler caches, its own package)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, __file__, "--measure", shape, "--ttt-steps", str(args.ttt_steps),
               "--sequences", str(args.sequences), "--device", args.device]
    command += ["--batch-tokens", str(args.batch_tokens)] if args.batch_tokens else []
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{shape} with {src}: exit {done.returncode}\n{done.stderr[-3000:]}")
    for line in done.stderr.splitlines():  # a fallback to eager loss or attention would skew the comparison
        if "unavailable" in line:
            print(f"  [{src}] {line.strip()}", flush=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["package"]).resolve().is_relative_to(src.resolve()):  # an installed copy came first
        sys.exit(f"{shape}: measured {result['package']}, not the package in {src}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline-commit", default="ee0ee61", help="the training path to compare against")
    parser.add_argument("--baseline-src", type=Path, help="a folder with that commit's src/ and config/")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 dense bf16 peak")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--sequences", type=int, default=400, help="ShareGPT-like sequences per measurement")
    parser.add_argument("--only", choices=sorted(SHAPES), action="append", help="these drafter shapes only")
    parser.add_argument("--batch-tokens", type=int, help="tokens per batch (default: the shape's, 16,384 or 8,192)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu checks that both paths run (small sizes)")
    parser.add_argument("--measure", choices=sorted(SHAPES), help=argparse.SUPPRESS)  # the per-path process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.ttt_steps, args.sequences, args.device, args.batch_tokens)))
        return
    paths = {"baseline": baseline_source(args.baseline_commit, args.baseline_src), "ours": REPO / "src"}
    for shape in args.only or ["example", "8b"]:
        results = {name: run_path(src, shape, args) for name, src in paths.items()}
        print(f"{TITLES[shape]}: TTT step-0 loss on one batch, baseline {results['baseline']['step0_loss']:.5f} "
              f"vs ours {results['ours']['step0_loss']:.5f}", flush=True)
        for name, r in results.items():
            mfu = [100 * r[key] * r["flops_per_token"] / 1e12 / args.peak_tflops for key in ("full", "epoch")]
            print(f"  [{name}] full rows {r['full']:,.0f} tok/s (MFU {mfu[0]:.1f}%), ShareGPT-like batches "
                  f"{r['epoch']:,.0f} real tok/s ({100 * r['fill']:.0f}% of batch slots real, MFU {mfu[1]:.1f}%)",
                  flush=True)
        base, ours = results["baseline"], results["ours"]
        print(f"  ours / baseline = {ours['full'] / base['full']:.2f}x on full rows, "
              f"{ours['epoch'] / base['epoch']:.2f}x on ShareGPT-like batches", flush=True)


if __name__ == "__main__":
    main()
