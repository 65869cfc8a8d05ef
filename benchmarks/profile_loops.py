"""Where a device-resident decode step's time goes: the timing pass's loop (target-only greedy, the EAGLE-3 chain
and draft trees, pipelined.py) under the profiler, kernel by kernel, after the timing pass itself has run (warm-up
and compilation done, every graph recorded).

    python benchmarks/profile_loops.py --target smollm2-gguf --serving results/<run>/serving/drafter \
        [--prompts 4] [--max-new 128] [--dtype bfloat16] [--out DIR] [--target-attention sdpa] [--trees 5,8,32]

It prints the timing pass (target-only, the chain and the trees, as the pipeline runs them), then per method:
steps, kernels per step, device-busy time per step (kernels and copies), the step's span on the device's timeline
(busy + idle) and the costliest kernels per step. `--out` also gets each method's Chrome trace (gzipped) and a
per-step table of kernel names and durations (JSON), for reading offline. GPU only: on a CPU there are no device
kernels to read.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from bench_decode import target_directory  # a sibling script: benchmarks/ is on the path of either

from eagle3_pipeline import assets
from eagle3_pipeline.prompts import load_prompts
from eagle3_pipeline.runtime import decode as runtime
from eagle3_pipeline.runtime.device_tree import TreeSteps
from eagle3_pipeline.runtime.drafting import DrafterProposer, load_served_for
from eagle3_pipeline.runtime.methods import TreeSetting
from eagle3_pipeline.runtime.pipelined import ChainSteps, GreedySteps, decode_on_device
from eagle3_pipeline.runtime.speculative import encode_prompts, end_of_sequence
from eagle3_pipeline.runtime.target import loading
from eagle3_pipeline.runtime.tree import TreeDrafter
from eagle3_pipeline.stages import evaluate_timing


def device_kernels(trace: bytes) -> list[dict]:
    """Kernels and memory copies/sets of a Chrome trace, in timeline order: name, start and duration (us)."""
    events = json.loads(trace)["traceEvents"]
    kept = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])} for e in kept),
                  key=lambda e: e["ts"])


def summarise(name: str, kernels: list[dict], steps: int, rows: int = 25) -> dict:
    """Per step: kernels, busy us, span us (first kernel's start to last kernel's end over all steps, per step),
    and the costliest kernels by total time."""
    busy = sum(k["dur"] for k in kernels)
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) if kernels else 0.0
    by_name: dict[str, list[float]] = defaultdict(list)
    for kernel in kernels:
        by_name[kernel["name"]].append(kernel["dur"])
    table = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    print(f"\n== {name}: {steps} steps, {len(kernels) / steps:.1f} kernels per step, {busy / steps:.1f} us busy and "
          f"{span / steps:.1f} us of timeline per step (idle {100 * (1 - busy / span) if span else 0:.0f} %)")
    print(f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  kernel")
    for kernel, durations in table[:rows]:
        print(f"{sum(durations) / steps:9.1f} {len(durations) / steps:10.2f} {sum(durations) / len(durations):8.2f}"
              f"  {kernel[:110]}")
    return {"steps": steps, "kernels": len(kernels), "busy_us": busy, "span_us": span,
            "by_name": {kernel: [len(d), sum(d)] for kernel, d in table}}


def profiled(run, out: Path, name: str) -> tuple[list[dict], object]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = run()
        torch.cuda.synchronize()
    path = out / f"{name}.trace.json"
    prof.export_chrome_trace(str(path))
    trace = path.read_bytes()
    path.unlink()
    with gzip.open(f"{path}.gz", "wb") as packed:
        packed.write(trace)
    return device_kernels(trace), result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-gguf", help="alias, .gguf file or HF directory")
    parser.add_argument("--serving", type=Path, required=True, help="a trained drafter's serving directory")
    parser.add_argument("--prompts", type=int, default=4, help="MT-bench first turns for the timing pass")
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("profile-loops"))
    parser.add_argument("--trees", nargs="*", default=[], metavar="S,K,T",
                        help="draft trees to profile too: num_steps,topk,num_draft_tokens")
    parser.add_argument("--target-attention", default=None,
                        help="transformers attention implementation of the target (default: the runtime's, grouped "
                             "matmuls over its static caches; `sdpa` for the comparison)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_loops.py reads device kernels: it needs a GPU")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("profile_loops")
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    prompts = load_prompts(assets.resolve("mtbench-package"), args.prompts)
    with tempfile.TemporaryDirectory(prefix="profile-loops-") as scratch:
        target_dir = target_directory(args.target, Path(scratch))
        tokenizer = loading.load_tokenizer(target_dir)
        model = loading.load_model(target_dir, device="cuda", dtype=dtype)
        drafter = load_served_for(target_dir, args.serving, dtype).to("cuda")
        decoder = runtime.TargetRuntime(model, drafter.config.aux_layer_ids, compiled=True, log=log,
                                        attention=args.target_attention)
        print(f"target attention: {decoder.attention}", flush=True)
        # the pipeline's timing pass first: its warm-up compiles and records every graph the loops replay
        trees = tuple(TreeSetting(*(int(x) for x in tree.split(","))) for tree in args.trees)
        results = evaluate_timing.timing_pass(decoder, tokenizer, {"mtbench": prompts}, drafter, [args.k],
                                              args.max_new, False, log, trees)["mtbench"]
        proposer = DrafterProposer(drafter, compiled=True, log=log)  # its own graphs, recorded below
        eos = end_of_sequence(tokenizer)
        (pid, ids), = encode_prompts(tokenizer, prompts[:1])
        size = decoder.cache_size(len(ids) + args.max_new)
        report = {"timing_pass": results}

        def greedy():
            return decode_on_device(decoder, GreedySteps(), ids, args.max_new, eos, pid, "target")

        def chain():
            proposer.reset(size)
            return decode_on_device(decoder, ChainSteps(proposer, args.k, log), ids, args.max_new, eos, pid,
                                    f"eagle3@k={args.k}")

        def tree_run(setting: TreeSetting):
            tree_drafter = TreeDrafter(drafter, setting, compiled=True, log=log)  # its own graphs

            def run():
                tree_drafter.reset(size)
                return decode_on_device(decoder, TreeSteps(tree_drafter, log), ids, args.max_new, eos, pid,
                                        setting.method())
            return run

        arms = [("target-only", greedy), ("chain", chain)]
        arms += [(f"tree-{s.num_steps}-{s.topk}-{s.num_draft_tokens}", tree_run(s)) for s in trees]
        for name, run in arms:
            run()  # this proposer's graphs recorded, outside the profile
            kernels, trace = profiled(run, args.out, name)
            steps = trace.target_forwards
            print(f"{name}: {len(trace.tokens)} tokens in {steps} verify steps, {trace.total_seconds * 1000:.1f} ms "
                  f"wall (profiler on), device spans per step: {1000 * trace.verify_seconds / steps:.3f} ms "
                  f"verify + {1000 * trace.draft_seconds / steps:.3f} ms draft", flush=True)
            report[name] = summarise(name, kernels, steps)
            (args.out / f"{name}.kernels.json").write_text(json.dumps(kernels))
        (args.out / "summary.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
