"""Drafter training throughput and MFU, in one run: the SmolLM2 drafter and an 8B-shaped drafter
(hidden 4096, 32k draft vocab, 128k target vocab) on random activations.

    python benchmarks/bench_train.py [--peak-tflops 989]

MFU = model FLOPs (forward + backward of every TTT step, plus the teacher head) / time / peak.
Each shape runs with the explicit-scores TTT attention ("eager", the baseline) and the fused flex kernel,
in the same run, after checking that both give the same loss and gradients; also the one-TTT-step rate.
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3_pipeline.model import Drafter, DrafterConfig, count_flops_per_token
from eagle3_pipeline.train import Teacher, TTTObjective


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


def random_batch(config: DrafterConfig, batch: int, length: int, device: str) -> dict[str, torch.Tensor]:
    valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    valid[-1, length * 3 // 4:] = False  # one padded row, like real batches
    return {
        "input_ids": torch.randint(0, config.vocab_size, (batch, length), device=device),
        "loss_mask": valid.clone(),
        "valid": valid,
        "aux": torch.randn(batch, length, 3 * config.target_hidden_size, device=device, dtype=torch.bfloat16),
        "last": torch.randn(batch, length, config.hidden_size, device=device, dtype=torch.bfloat16),
    }


def check_flex_matches_eager(config: DrafterConfig, ttt_steps: int, device: str) -> tuple[float, float]:
    """(relative loss difference, worst relative gradient difference) of flex vs eager on one batch."""
    results = []
    data = random_batch(config, 2, 512, device)
    for flex in (False, True):
        torch.manual_seed(0)
        model = Drafter(config).to(device)
        model.use_flex_attention(flex)
        lm_head = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
        teacher = Teacher(lm_head, torch.arange(config.draft_vocab_size, device=device) * 2)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = TTTObjective(model, teacher, ttt_steps, 0.8)(data)
        loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}))
    (eager_loss, eager_grads), (flex_loss, flex_grads) = results
    worst = max(float((flex_grads[n] - g).norm() / g.norm().clamp(min=1e-12)) for n, g in eager_grads.items())
    return abs(flex_loss - eager_loss) / abs(eager_loss), worst


def measure(config: DrafterConfig, ttt_steps: int, batch: int, length: int, device: str, steps: int,
            flex: bool) -> float:
    torch.manual_seed(0)
    model = Drafter(config).to(device)
    model.use_flex_attention(flex)
    lm_head = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
    teacher = Teacher(lm_head, torch.arange(config.draft_vocab_size, device=device) * 2)
    objective = TTTObjective(model, teacher, ttt_steps, 0.8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    data = random_batch(config, batch, length, device)

    def one_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = objective(data)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    for _ in range(3):
        one_step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    torch.cuda.synchronize()
    return batch * length * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 dense bf16 peak")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    for name, config in shapes().items():
        length = 2048
        batch = 8 if config.hidden_size < 1024 else 4
        per_token = args.ttt_steps * 3 * count_flops_per_token(config, length // 2) \
            + 2 * config.vocab_size * config.hidden_size
        loss_diff, grad_diff = check_flex_matches_eager(config, args.ttt_steps, "cuda")
        print(f"{name}: flex vs eager on one batch: loss differs by {loss_diff:.2e} (relative), "
              f"worst parameter gradient by {grad_diff:.2e}", flush=True)
        rates = {}
        for kernel in ("eager", "flex"):
            rates[kernel] = rate = measure(config, args.ttt_steps, batch, length, "cuda", args.steps, kernel == "flex")
            tflops = rate * per_token / 1e12
            print(f"{name} [{kernel}]: {rate:,.0f} tokens/s, {tflops:.0f} TFLOP/s, "
                  f"MFU {100 * tflops / args.peak_tflops:.1f}% of {args.peak_tflops:.0f}", flush=True)
        one = measure(config, 1, batch, length, "cuda", args.steps, True)
        print(f"{name}: flex / eager = {rates['flex'] / rates['eager']:.2f}x; one-TTT-step rate {one:,.0f} tokens/s "
              f"(7 steps cost {one / rates['flex']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
