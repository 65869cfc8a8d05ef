"""Decode speed of the evaluator's target runtime: eager (dynamic KV cache) vs compiled (static KV cache, CUDA
graphs), in one run, fp32 and bf16, on MT-bench prompts; plus the drafter chain's cost per verify step.

    python benchmarks/bench_decode.py --target smollm2-gguf [--prompts 10] [--max-new 128] [--tau 1.715]
        [--modes eager compiled long-cache] [--loops host device] [--long-cache 4096] [--profile]
        [--trees 5,4,8 5,8,32]

`compiled` times the host loops (a host read after every step), then the device-resident loops (pipelined.py, the
timing pass's) on the same runtime; `--loops device` times the device loops alone, as the timing pass meets its
prompts (a host pass first has already decoded them once: every prompt length's first-time costs paid).
`long-cache`: the compiled runtime with every sequence in one cache of --long-cache slots (what the timing pass did
before caches were sized per sequence): attention reads every slot, so the ratio to `compiled` is what a cache
sized for the longest prompt costs the others. `--profile`: the kernels of 32 compiled target-only tokens (GPU time
vs wall time says whether a step waits on the host or on the device), and of the fused drafter chains.

`--trees S,K,T ...`: those draft trees (SGLang's num_steps, topk, num_draft_tokens) are timed too, in each loop:
with `--loops host device`, each tree's device-loop tokens/s over its host-loop tokens/s on the same runtime.

`--serving DIR` times a trained drafter (its speedups are real ones). By default the drafter is untrained (random
weights, the target's shape and embedding): its acceptance is ~0, so the timing pass's speedup for it means
nothing, but its cost per verify step is what a trained drafter's is. With --tau (a tau measured by the
evaluation, e.g. the run's MT-bench k=4), the projected speedup of a drafter with that tau is printed:
tau x (target ms per token) / (ms per verify step of the chain).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from eagle3_pipeline import assets
from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.formats.target_dir import read_head
from eagle3_pipeline.prompts import load_prompts
from eagle3_pipeline.runtime import decode as runtime
from eagle3_pipeline.runtime import draft_graph
from eagle3_pipeline.runtime.drafting import DrafterProposer, load_served_for
from eagle3_pipeline.runtime.methods import TreeSetting
from eagle3_pipeline.runtime.speculative import synchronize
from eagle3_pipeline.runtime.target import loading
from eagle3_pipeline.runtime.tree import TreeDrafter
from eagle3_pipeline.stages import evaluate_timing, target


def target_directory(source: str, scratch: Path) -> Path:
    path = assets.resolve(source)
    if path.is_dir() and (path / "config.json").exists():
        return path
    target.materialise(source, scratch / "target")
    return scratch / "target"


def untrained_drafter(target_dir: Path, draft_vocab: int, device: str, dtype: torch.dtype,
                      intermediate_size: int | None = None) -> Drafter:
    config = loading.load_config(target_dir)
    layers = config.num_hidden_layers
    shape = DrafterConfig.from_target(config, draft_vocab, [2, layers // 2, layers - 3])
    drafter = Drafter(replace(shape, intermediate_size=intermediate_size or shape.intermediate_size))
    embedding, _ = read_head(target_dir)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embedding.float())
    return drafter.to(device, dtype).eval()


@torch.inference_mode()
def time_chains(proposer: DrafterProposer, ids: list[int], features: torch.Tensor, k: int, start: int
                ) -> tuple[float, list[list[int]]]:
    """ms per chain of k drafts over a sequence growing by 2 real rows per step (as after a verify accepting
    one draft), and the drafts (the same drafter must draft the same tokens whichever way it runs)."""
    proposer.reset()
    proposer.chain(ids[:start + 1], features[:start], k)  # prefill: as many real rows as the prompt
    proposer.chain(ids[:start + 3], features[:start + 2], k)  # the first chain of the timed width: compiled, recorded
    drafts, steps = [], range(start + 4, len(ids) - 1, 2)
    synchronize(features.device)
    tick = time.perf_counter()
    for n in steps:
        drafts.append(proposer.chain(ids[:n + 1], features[:n], k)[0])
    synchronize(features.device)
    return 1000 * (time.perf_counter() - tick) / max(len(steps), 1), [d.tolist() for d in drafts]


def compare_chains(decoder: runtime.TargetRuntime, tokenizer, prompt, drafter: Drafter, k: int, log,
                   profile: bool = False) -> None:
    """The drafter's chain eagerly (static cache, one launch per kernel) vs replayed from one CUDA graph of the
    same kernels vs one of inductor's fused kernels (what the timing pass runs); `profile`: the kernels of the
    fused arm's chains."""
    ids = tokenizer.apply_chat_template(prompt.messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)[:200]
    _, features = decoder.forward(ids, decoder.new_cache(len(ids) + 8))
    start = len(ids) // 2
    arms = {"eager": DrafterProposer(drafter, static=True),
            "CUDA graph": DrafterProposer(drafter, compiled=True, log=log, fuse=False),
            "CUDA graph of fused kernels": DrafterProposer(drafter, compiled=True, log=log)}
    timed = {name: time_chains(proposer, ids, features, k, start) for name, proposer in arms.items()}
    eager_ms, eager = timed["eager"]
    print(f"  drafter chain of {k}: " + ", ".join(
        f"{name} {ms:.2f} ms ({eager_ms / ms:.1f}x eager, same drafts in "
        f"{sum(a == b for a, b in zip(eager, drafts, strict=True))} of {len(eager)} chains)"
        for name, (ms, drafts) in timed.items()), flush=True)
    if profile:
        fused = arms["CUDA graph of fused kernels"]
        chains = len(eager) + 3  # time_chains' prefill and recording calls included
        profiled(lambda: time_chains(fused, ids, features, k, start), chains, "fused drafter chain")


def profiled(run, count: int, what: str) -> None:
    """Wall time of `run` (`count` steps) against the device time of its kernels, and the costliest kernels:
    whether a step waits on the host or on the device, and on which kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        tick = time.perf_counter()
        run()
        synchronize(torch.device("cuda"))
        wall = time.perf_counter() - tick
    events = trace.key_averages()
    # kernels and copies only: a CPU-side op (an aten call, a compiled graph's call) also carries its kernels' time
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU)
    print(f"  profile, {what}: {1000 * wall / count:.2f} ms wall per step (profiler on), "
          f"{kernel_us / 1000 / count:.2f} ms of device time per step", flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=15), flush=True)


def profile_greedy(decoder: runtime.TargetRuntime, tokenizer, prompt) -> None:
    """Kernel time of 32 target-only tokens (the runtime's loops) against their wall time, and the costliest
    kernels."""
    from eagle3_pipeline.runtime.pipelined import GreedySteps, decode_on_device
    from eagle3_pipeline.runtime.proposers import TargetAlone
    from eagle3_pipeline.runtime.speculative import decode, encode_prompts

    (pid, ids), = encode_prompts(tokenizer, [prompt])

    def greedy():
        if decoder.device_loops:
            return decode_on_device(decoder, GreedySteps(), ids, 32, set(), pid, "target")
        return decode(decoder, TargetAlone(), ids, 32, set(), pid, "target")

    greedy()  # warm
    profiled(greedy, 32, "target-only token (prefill included)")


def compare_trees(decoder: runtime.TargetRuntime, tokenizer, prompt, drafter: Drafter, log) -> None:
    """SGLang's default tree drafted eagerly (tensors only, one launch per kernel) vs replayed from one CUDA
    graph, over a sequence growing by 2 real rows per step (the same drafter must draft the same trees); then
    the target's verify of that tree against a chain's verify of k + 1 tokens (both compiled where it is)."""
    setting = TreeSetting(5, 4, 8)
    ids = tokenizer.apply_chat_template(prompt.messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)[:200]
    cache = decoder.new_cache(len(ids) + 8)
    _, features = decoder.forward(ids, cache)
    start, timings, trees = len(ids) // 2, {}, {}
    for name, compiled in (("eager", False), ("CUDA graph of fused kernels", True)):
        tree_drafter = TreeDrafter(drafter, setting, compiled=compiled, log=log)
        tree_drafter.draft(ids[:start + 1], features[:start])  # prefill: as many real rows as the prompt
        tree_drafter.draft(ids[:start + 3], features[:start + 2])  # the first tree of the timed width: recorded
        steps = range(start + 4, len(ids) - 1, 2)
        synchronize(features.device)
        tick = time.perf_counter()
        trees[name] = [tree_drafter.draft(ids[:n + 1], features[:n]) for n in steps]
        synchronize(features.device)
        timings[name] = 1000 * (time.perf_counter() - tick) / max(len(steps), 1)
    same = sum((a.tokens, a.parents) == (b.tokens, b.parents) for a, b in zip(*trees.values(), strict=True))
    fused_ms = timings["CUDA graph of fused kernels"]
    print(f"  draft tree {setting.as_dict()}: eager {timings['eager']:.2f} ms, CUDA graph of fused kernels "
          f"{fused_ms:.2f} ms ({timings['eager'] / fused_ms:.1f}x); same trees in {same} of {len(trees['eager'])}",
          flush=True)
    tree, n, chain = trees["eager"][-1], len(ids), min(w for w in decoder.widths if w > 1)
    verifies = {f"chain of {chain}": lambda: decoder.forward(ids[-chain:], cache)[0],
                f"tree of {setting.num_draft_tokens}": lambda: decoder.forward_tree(
                    [ids[-1]] + tree.tokens, [n + d for d in [0, *tree.depths]], tree.visible(), cache,
                    width=setting.num_draft_tokens)[0]}
    for name, verify in verifies.items():
        for _round in range(2):  # the first pass compiles and captures, the second is timed
            synchronize(features.device)
            tick = time.perf_counter()
            for _ in range(30):
                verify().argmax(-1).tolist()
                decoder.crop(cache, n)
            timings[name] = 1000 * (time.perf_counter() - tick) / 30
    print("  target verify per step: " + ", ".join(f"{name} {timings[name]:.2f} ms" for name in verifies), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-gguf", help="alias, .gguf file or HF directory")
    parser.add_argument("--prompts", type=int, default=10, help="MT-bench first turns")
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tau", type=float, help="a measured tau at this k, for the projected speedup")
    parser.add_argument("--serving", type=Path, help="a trained drafter's serving directory (default: an untrained "
                        "drafter of the target's shape, whose drafts are rejected)")
    parser.add_argument("--drafter-intermediate-size", type=int,
                        help="the untrained drafter's MLP width (train.drafter_intermediate_size; default the "
                             "target's): a run's shape, so that this run's compiled kernels serve its timing pass")
    parser.add_argument("--draft-vocab", type=int, default=32768,
                        help="the untrained drafter's draft vocabulary (vocab.draft_vocab_size; default the GPU "
                             "example's)")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"],
                        choices=["eager", "compiled", "long-cache"], help="eager alone is a CPU smoke run")
    parser.add_argument("--long-cache", type=int, default=4096, help="slots of the long-cache mode's one cache")
    parser.add_argument("--loops", nargs="+", default=["host", "device"], choices=["host", "device"],
                        help="compiled mode: which decoding loops to time, in this order")
    parser.add_argument("--trees", nargs="*", default=[], metavar="S,K,T",
                        help="draft trees to time too: num_steps,topk,num_draft_tokens")
    parser.add_argument("--no-combo-kernels", action="store_true",
                        help="the drafter's fused steps without inductor's combo kernels (the default fuses "
                             "independent kernels side by side, e.g. a tree step's per-layer KV moves)")
    parser.add_argument("--timing-only", action="store_true",
                        help="the timing pass alone, without the chain and tree comparisons after it (e.g. to fill "
                             "the compile cache for a run's timing pass)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the compiled target-only decode and the fused drafter chain")
    args = parser.parse_args()
    draft_graph.COMBO_KERNELS = not args.no_combo_kernels
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("bench_decode")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = load_prompts(assets.resolve("mtbench-package"), args.prompts)
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as scratch:
        target_dir = target_directory(args.target, Path(scratch))
        tokenizer = loading.load_tokenizer(target_dir)
        for dtype_name in args.dtypes:
            rates = {mode: bench_mode(mode, target_dir, tokenizer, prompts, getattr(torch, dtype_name), device, args,
                                      log) for mode in args.modes}
            for mode in ("compiled", "long-cache"):
                if mode in rates and "eager" in rates:
                    print(f"{dtype_name}: {mode} / eager target-only = {rates[mode] / rates['eager']:.2f}x", flush=True)
            if "compiled" in rates and "long-cache" in rates:
                print(f"{dtype_name}: caches sized per sequence / one {args.long_cache}-slot cache, target-only = "
                      f"{rates['compiled'] / rates['long-cache']:.2f}x", flush=True)


def bench_mode(mode: str, target_dir: Path, tokenizer, prompts, dtype: torch.dtype, device: str,
               args: argparse.Namespace, log) -> float:
    """One runtime's timing pass (target-only and the chain at k) on the prompts: target-only tokens/s."""
    model = loading.load_model(target_dir, device=device, dtype=dtype)
    drafter = (load_served_for(target_dir, args.serving, dtype).to(device) if args.serving
               else untrained_drafter(target_dir, args.draft_vocab, device, dtype, args.drafter_intermediate_size))
    decoder = runtime.TargetRuntime(model, drafter.config.aux_layer_ids, compiled=mode != "eager", log=log)
    if mode == "long-cache":
        decoder.smallest_cache = args.long_cache
    label = {"eager": "eager", "compiled": "compiled, static caches sized per sequence",
             "long-cache": f"compiled, one static cache of {args.long_cache} slots"}[mode]
    rates, tree_rates = {}, {}
    trees = tuple(TreeSetting(*(int(x) for x in tree.split(","))) for tree in args.trees)
    # compiled: the host loops and/or the loops with their state on the device (the timing pass's), one runtime
    for device_loops in ([loop == "device" for loop in args.loops] if mode == "compiled" else [decoder.device_loops]):
        decoder.device_loops = device_loops
        result = evaluate_timing.timing_pass(decoder, tokenizer, {"mtbench": prompts}, drafter, [args.k],
                                             args.max_new, False, log, trees)["mtbench"]
        only, chain = result["target"], result[f"eagle3@k={args.k}"]
        loops = (" + device-resident loops" if device_loops else " + host loops") if mode == "compiled" else ""
        failed = " (compilation failed: eager)" if mode != "eager" and not decoder.compiled else ""
        step_ms = 1000 * chain["tokens"] / chain["tokens_per_s"] / chain["verify_steps"]
        draft, verify = chain["draft_ms_per_step"], chain["verify_ms_per_step"]
        split = (f"of which the device spent {draft:.2f} ms drafting and {verify:.2f} ms verifying" if device_loops
                 else f"{draft:.2f} ms drafting + {verify:.2f} ms verifying")
        split += f" (each prompt's first drafting {chain['prompt_draft_ms_per_prompt']:.2f} ms)"
        print(f"{str(dtype).removeprefix('torch.')} [{label}{loops}{failed}]: target-only {only['tokens_per_s']:.1f} "
              f"tokens/s ({1000 / only['tokens_per_s']:.2f} ms per token); chain of {args.k}: {step_ms:.2f} ms per "
              f"verify step, {split}", flush=True)
        if args.tau:  # a drafter with that tau: tau tokens per verify step of this one's cost
            print(f"  projected speedup of a drafter with tau {args.tau}: "
                  f"{args.tau * (1000 / only['tokens_per_s']) / step_ms:.2f}x", flush=True)
        rates[device_loops] = only["tokens_per_s"]
        for tree in trees:
            timed = result[tree.method()]
            tree_rates.setdefault(tree.method(), {})[timed["loop"]] = timed["tokens_per_s"]
            print(f"  {tree.method()} ({timed['loop']} loop): {timed['tokens_per_s']:.1f} tokens/s, "
                  f"{timed['speedup_vs_target']:.2f}x target-only, {timed['draft_ms_per_step']:.2f} ms drafting + "
                  f"{timed['verify_ms_per_step']:.2f} ms verifying per step", flush=True)
    for method, loops in tree_rates.items():
        if {"host", "device"} <= set(loops):
            print(f"  {method}: device loop / host loop = {loops['device'] / loops['host']:.2f}x", flush=True)
    if mode == "compiled" and not args.timing_only:
        compare_chains(decoder, tokenizer, prompts[0], drafter, args.k, log, args.profile)
        compare_trees(decoder, tokenizer, prompts[0], drafter, log)
        if args.profile:
            profile_greedy(decoder, tokenizer, prompts[0])
    rate = rates[decoder.device_loops]
    del model, drafter, decoder
    if device == "cuda":
        torch.cuda.empty_cache()
    return rate


if __name__ == "__main__":
    main()
