"""Drafter training throughput and MFU against the training path of an earlier commit, in one run.

    python benchmarks/bench_train.py [--baseline-commit 82e602d | --baseline-src DIR] [--peak-tflops 989]

The baseline is the package as it was at `--baseline-commit` (extracted with `git archive` into a temporary
directory and imported under another name), or a copy of it in `--baseline-src` (a machine without the git
history). Both paths train the same drafter shapes on the same random activations:

- full rows: every batch 8 (or 4) x 2048 real tokens - the kernels alone;
- ShareGPT-like lengths: the same sequence lengths (log-normal, median 600, capped at 2048) batched by each
  path's own batch schedule and padding rule - what a real epoch sees. Rates count real (unpadded) tokens.

Before timing, both paths' losses on one batch are compared (same weights; the paths differ only in rotary
positions of TTT steps >= 1, so only step 0's loss must agree). MFU = model FLOPs (forward + backward of every
TTT step, plus the teacher head) / time / peak.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from eagle3_pipeline.config_schema import schema_defaults
from eagle3_pipeline.drafter import model as current_model
from eagle3_pipeline.drafter import objective
from eagle3_pipeline.drafter.attention import flex_ttt_attention
from eagle3_pipeline.drafter.batches import epoch_batches
from eagle3_pipeline.drafter.model import DrafterConfig, count_flops_per_token
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.training.settings import TrainSettings

BASELINE_PACKAGE = "baseline_eagle3_pipeline"


def shapes() -> dict[str, DrafterConfig]:
    return {
        "SmolLM2-135M drafter (K=16384)": DrafterConfig(
            hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            vocab_size=49152, draft_vocab_size=16384, target_hidden_size=576, aux_layer_ids=[2, 15, 27],
            rope_theta=100000.0),
        "8B-shaped drafter (K=32000)": DrafterConfig(
            hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096, aux_layer_ids=[2, 16, 29],
            rope_theta=500000.0),
    }


def load_baseline(commit: str | None, source: Path | None) -> ModuleType:
    """The baseline package imported as BASELINE_PACKAGE (its modules import each other relatively)."""
    if source is None:
        scratch = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
        archive = subprocess.run(["git", "archive", commit, "src/eagle3_pipeline"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
        source = scratch / "src" / "eagle3_pipeline"
    spec = importlib.util.spec_from_file_location(BASELINE_PACKAGE, source / "__init__.py",
                                                  submodule_search_locations=[str(source)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[BASELINE_PACKAGE] = package
    spec.loader.exec_module(package)
    for name in ("model", "train"):
        __import__(f"{BASELINE_PACKAGE}.{name}")
    return package


def sharegpt_like_lengths(count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=np.log(600), sigma=0.9, size=count), 32, 2048).astype(np.int64)


def random_batch(config: DrafterConfig, rows: list[int], width: int, device: str) -> dict[str, torch.Tensor]:
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for row, length in enumerate(rows):
        valid[row, :length] = True
    return {
        "input_ids": torch.randint(0, config.vocab_size, (len(rows), width), device=device),
        "loss_mask": valid.clone(),
        "valid": valid,
        "aux": torch.randn(len(rows), width, 3 * config.target_hidden_size, device=device, dtype=torch.bfloat16),
        "last": torch.randn(len(rows), width, config.hidden_size, device=device, dtype=torch.bfloat16),
    }


class TrainingPath:
    """One training path: its drafter, objective and batch geometry. `baseline` is the old package (its flat
    `model` and `train` modules), None for ours."""

    def __init__(self, name: str, baseline: ModuleType | None, config: DrafterConfig, settings, device: str):
        torch.manual_seed(0)
        self.name, self.baseline, self.settings = name, baseline, settings
        model_module = current_model if baseline is None else baseline.model
        self.model = model_module.Drafter(model_module.DrafterConfig(**config.as_dict())).to(device)
        lm_head = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
        draft_ids = torch.arange(config.draft_vocab_size, device=device) * 2
        if baseline is None:
            loss = objective.compiled_loss(settings.compile, torch.device(device), _PrintLog())
            self.objective = objective.TTTObjective(self.model, objective.Teacher(lm_head, draft_ids),
                                                    settings.ttt_steps, 0.8, loss, flex_ttt_attention)
        else:
            self.model.use_flex_attention(True)
            self.objective = baseline.train.TTTObjective(self.model, baseline.train.Teacher(lm_head, draft_ids),
                                                         settings.ttt_steps, 0.8)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4,
                                           fused=True)

    def epoch_rows(self, lengths: np.ndarray) -> list[list[int]]:
        """Row lengths of every batch of one epoch, as this path's schedule packs them (no stores needed)."""
        if self.baseline is None:
            packed = epoch_batches([lengths], self.settings, 0)
        else:
            schedule = object.__new__(self.baseline.train.BatchSchedule)
            schedule.settings, schedule.lengths = self.settings, [lengths]
            packed = schedule._epoch(0)
        return [[int(lengths[j]) for _, j in batch] for batch in packed]

    def width(self, rows: list[int]) -> int:
        multiple = getattr(self.settings, "pad_multiple", 1)
        return -(-max(rows) // multiple) * multiple

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, metrics = self.objective(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
        self.optimizer.step()
        return metrics[0]["loss"] / metrics[0]["count"].clamp(min=1)


class _PrintLog:
    def info(self, message, *args):
        print("  " + message % args, flush=True)

    warning = info


def rate(path: TrainingPath, batches: list[dict[str, torch.Tensor]], repeats: int) -> float:
    for batch in batches[:3]:  # warm-up: compilation, autotuning, mask caches
        path.step(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        for batch in batches:
            path.step(batch)
    torch.cuda.synchronize()
    real_tokens = sum(int(b["valid"].sum()) for b in batches) * repeats
    return real_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline-commit", default="82e602d", help="the training path to compare against")
    parser.add_argument("--baseline-src", type=Path, help="that commit's src/eagle3_pipeline, copied")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 dense bf16 peak")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--sequences", type=int, default=400, help="ShareGPT-like sequences per measurement")
    parser.add_argument("--only", choices=["small", "big"], help="one drafter shape only")
    args = parser.parse_args()
    baseline = load_baseline(args.baseline_commit, args.baseline_src)
    device = "cuda"
    for name, config in shapes().items():
        if args.only and (args.only == "big") != (config.hidden_size >= 1024):
            continue
        batch_tokens = 16384 if config.hidden_size < 1024 else 8192
        per_token = (args.ttt_steps * 3 * count_flops_per_token(config, 1024)
                     + 2 * config.vocab_size * config.hidden_size)
        lengths = sharegpt_like_lengths(args.sequences if config.hidden_size < 1024 else args.sequences // 4)
        paths = [
            TrainingPath("baseline", baseline, config,
                         baseline.train.TrainSettings(ttt_steps=args.ttt_steps, batch_tokens=batch_tokens), device),
            TrainingPath("ours", None, config, from_section(TrainSettings,
                schema_defaults("train") | {"ttt_steps": args.ttt_steps, "batch_tokens": batch_tokens,
                                            "max_seq_len": 2048}), device),
        ]
        full = random_batch(config, [2048] * (batch_tokens // 2048), 2048, device)
        step0 = [float(p.step(full)) for p in paths]
        print(f"{name}: TTT step-0 loss on one batch, baseline {step0[0]:.5f} vs ours {step0[1]:.5f}", flush=True)
        results = {}
        for path in paths:
            # A fresh compiler cache per path: flex_attention's recompile budget is per process, and a path
            # measured after many shapes would otherwise fall back to the uncompiled kernel.
            torch._dynamo.reset()
            batches_rows = path.epoch_rows(lengths)
            real = [random_batch(config, rows, path.width(rows), device) for rows in batches_rows]
            padded = sum(b["valid"].numel() for b in real)
            results[path.name] = (rate(path, [full] * 4, 2), rate(path, real, 1),
                                  sum(int(b["valid"].sum()) for b in real) / padded)
            kernel, epoch, fill = results[path.name]
            mfu = [100 * r * per_token / 1e12 / args.peak_tflops for r in (kernel, epoch)]
            print(f"{name} [{path.name}]: full rows {kernel:,.0f} tok/s (MFU {mfu[0]:.1f}%), ShareGPT-like batches "
                  f"{epoch:,.0f} real tok/s ({100 * fill:.0f}% of batch slots real, MFU {mfu[1]:.1f}%)", flush=True)
        (base_kernel, base_epoch, _), (our_kernel, our_epoch, _) = results["baseline"], results["ours"]
        print(f"{name}: ours / baseline = {our_kernel / base_kernel:.2f}x on full rows, "
              f"{our_epoch / base_epoch:.2f}x on ShareGPT-like batches", flush=True)
        del paths, full, real
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
