"""Top-k over a draft vocabulary, as a draft tree takes it every depth: torch.topk against tree_graph.top_k's two
passes (the best k of each slice, then of those), per shape and slice width, in one run. On a GPU each variant is
recorded in a CUDA graph of `--calls` calls and replayed (kernel time, no launch overhead: what the device-resident
loop pays); on a CPU it runs eagerly.

    python benchmarks/bench_topk.py [--calls 50] [--repeats 20]

Prints per shape: torch.topk's us per call, then each slice width's us per call and its ratio to torch.topk (above
1.00x: faster), and checks both pick the same values.
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3_pipeline.runtime.tree_graph import top_k

# (rows, width): the first depth's one row and a later depth's topk rows, over SmolLM2's 16k draft vocabulary and a
# Llama-3 drafter's 32k; one row over a whole 128k target vocabulary
SHAPES = [(1, 16384), (8, 16384), (10, 16384), (8, 32000), (10, 32000), (1, 128256)]
SLICE_WIDTHS = [256, 512, 1024, 2048]


def per_call_us(function, calls: int, repeats: int) -> float:
    """Median us per call over `repeats` timings of `calls` calls (a replayed CUDA graph on a GPU)."""
    if torch.cuda.is_available():
        for _ in range(3):
            function()  # warm-up on a side stream, as graph capture wants
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                function()
        run = graph.replay
    else:
        def run() -> None:
            for _ in range(calls):
                function()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[len(times) // 2] / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=50, help="calls per timing (per recorded graph on a GPU)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, k={args.k}, us per call")
    for rows, width in SHAPES:
        scores = torch.log_softmax(torch.randn(rows, width, device=device), -1)
        baseline = per_call_us(lambda scores=scores: scores.topk(args.k), args.calls, args.repeats)
        line = f"[{rows:>2} x {width:>6}] torch.topk {baseline:7.1f}"
        for slice_width in SLICE_WIDTHS:
            values, _ = top_k(scores, args.k, slice_width)
            if not torch.equal(values, scores.topk(args.k).values):
                raise SystemExit(f"top_k with slices of {slice_width} picked other values for [{rows}, {width}]")
            us = per_call_us(lambda scores=scores, w=slice_width: top_k(scores, args.k, w), args.calls, args.repeats)
            line += f" | {slice_width}: {us:6.1f} ({baseline / us:5.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
