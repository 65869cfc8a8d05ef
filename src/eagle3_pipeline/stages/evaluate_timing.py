"""Rule `evaluate_timing` (the timing pass): speeds of every method in one process, after the tau pass."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline import logs
from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.formats import evaluation
from eagle3_pipeline.prompts import Prompt, load_prompts
from eagle3_pipeline.runtime.compilation import steps_without_cuda_graphs
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.drafting import load_models
from eagle3_pipeline.runtime.methods import Method, TreeSetting, parse_settings
from eagle3_pipeline.runtime.speculative import (
    Trace,
    decode_prompt,
    encode_prompts,
    end_of_sequence,
    prepared_methods,
    timing_summary,
)
from eagle3_pipeline.runtime.target.devices import describe, pick_device
from eagle3_pipeline.settings import from_section, setting


@dataclass(frozen=True)
class Settings:
    prompts: int = setting(key="timing.prompts")  # timed per prompt set (the first ones)
    max_new_tokens: int = setting(key="timing.max_new_tokens")
    multi_turn: bool
    draft_lengths: tuple[int, ...] = setting(convert=tuple)
    device: str
    dtype: str
    compile: str | bool
    trust_remote_code: bool
    trees: tuple[TreeSetting, ...]  # none where evaluate.timing.trees is false
    # compiled: the target alone, the chains and the trees decode with the loop's state on the device
    device_loops: bool = setting(key="timing.device_loops")


def timing_settings(section: dict[str, Any], trust_remote_code: bool) -> Settings:
    """The `evaluate` section as the timing pass reads it: the trees are timed unless evaluate.timing.trees is off."""
    trees = parse_settings(section["tree"]) if section["timing"]["trees"] else ()
    return from_section(Settings, section, trees=trees, trust_remote_code=trust_remote_code)

def timing_pass(target: TargetRuntime, tokenizer: Any, prompt_sets: dict[str, list[Prompt]], drafter: Drafter,
                ks: list[int], max_new: int, strict: bool, log: Any, trees: tuple[TreeSetting, ...] = (),
                warm_up_seconds: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Speeds, per prompt set and method, measured in this one process (run it with nothing else of ours on the
    device): every method on the same prompt back to back, after a warm-up run of every method that is not
    counted (it pays for lazy initialisation and, where compiled, for compilation and graph capture; its seconds
    per static cache size go into `warm_up_seconds` when given)."""
    eos = end_of_sequence(tokenizer)
    methods = prepared_methods(target, {"eagle3": drafter}, ks, log, trees)
    encoded = {name: encode_prompts(tokenizer, prompts) for name, prompts in prompt_sets.items()}
    sizes = warm_up_prompts(target, encoded, max_new)
    while True:  # a size that fell back to the host loop: the sizes warmed before it never ran that loop's steps
        loops = (target.device_loops, target.device_trees)
        warm_up_sizes(target, methods, sizes, max_new, eos, strict, log, warm_up_seconds)
        if (target.device_loops, target.device_trees) == loops or len(sizes) == 1:
            break
        log.info("timing pass: warming every cache size again for the loops now in use")
    if target.compiled and (skipped := steps_without_cuda_graphs()):
        log.warning("timing pass: %d compiled step(s) run without CUDA graphs (torch's [__cudagraphs] log lines say "
                    "why): their speeds are launch-bound, not a captured step's", skipped)
    results = {}
    for name, prompts in encoded.items():
        by_method: dict[str, list[Trace]] = {}
        for pid, ids in prompts:
            for method, trace in decode_prompt(target, methods, pid, ids, max_new, eos, strict).items():
                by_method.setdefault(method, []).append(trace)
        results[name] = {method: timing_summary(traces, by_method["target"]) for method, traces in by_method.items()}
        for method, summary in results[name].items():
            log.info("timing pass, %s, %s (%s loop): %.1f tokens/s, speedup %.2fx, per verify step %.2f ms drafting + "
                     "%.2f ms verifying; each prompt's first drafting %.2f ms", name, method, summary["loop"],
                     summary["tokens_per_s"], summary["speedup_vs_target"], summary["draft_ms_per_step"],
                     summary["verify_ms_per_step"], summary["prompt_draft_ms_per_prompt"])
    return results


def warm_up_sizes(target: TargetRuntime, methods: dict[Method, Any], sizes: dict[int, list[int]], max_new: int,
                  eos: set[int], strict: bool, log: Any, warm_up_seconds: dict[str, float] | None) -> None:
    """The untimed warm-up, one prompt per static cache size (size 0: eager, lazy set-up only)."""
    for size, ids in sizes.items():
        log.info("timing pass: warm-up (not timed)%s", f" for static caches of {size} slots" if size else "")
        started = time.perf_counter()
        warm_up(target, methods, ids, max_new if size else min(max_new, 16), eos, strict, log)
        seconds = time.perf_counter() - started
        log.info("timing pass: warm-up took %.1f s (%s)", seconds, "compilation and graph capture included"
                 if target.compiled else "lazy set-up")
        if warm_up_seconds is not None:  # a second warm-up after a fallback adds to the first
            key = f"{size} slots" if size else "eager"
            warm_up_seconds[key] = warm_up_seconds.get(key, 0.0) + seconds


def warm_up(target: TargetRuntime, methods: dict[Method, Any], ids: list[int], max_new: int, eos: set[int],
            strict: bool, log: Any) -> None:
    """Decode one prompt with every method, untimed. Should the device-resident loop fail here (a step whose CUDA
    graph cannot be recorded raises), the pass goes on and says so, rather than losing the timing of every method:
    first with the trees in the host loop (the newest steps), then with every method there."""
    while True:
        try:
            decode_prompt(target, methods, "warm-up", ids, max_new, eos, strict)
            return
        except Exception as error:
            if not target.device_loops:
                raise
            trees = target.device_trees and any(method.tree for method in methods)
            log.exception("timing pass: the device-resident loop failed in the warm-up (%s: %s); timing %s in the "
                          "host loop instead (results name each method's loop)", type(error).__name__, error,
                          "the draft trees" if trees else "every method")
            if trees:
                target.device_trees = False
            else:
                target.device_loops = False


def warm_up_prompts(target: TargetRuntime, encoded: dict[str, list[tuple[str, list[int]]]], max_new: int
                    ) -> dict[int, list[int]]:
    """One prompt per static cache size the timed prompts decode in (one prompt in all when eager): decoding it to
    the end records every graph that size needs, so no compilation or capture is timed."""
    prompts = [ids for sets in encoded.values() for _, ids in sets]
    if not target.static:
        return {0: prompts[0]}
    by_size: dict[int, list[int]] = {}
    for ids in prompts:
        by_size.setdefault(target.cache_size(len(ids) + max_new), ids)
    return by_size


TIMING_PASS_ABOUT = ("timing pass: one process on the device after the tau pass, every method on the same prompts "
                     "back to back, warm-up excluded; speeds only (tau: the tau pass)")


def run_timing(target_dir: Path, serving_dir: Path, prompt_sets: dict[str, list[Prompt]], settings: Settings,
               log: Any) -> dict[str, Any]:
    """The timing pass's results JSON: speeds by prompt set and method."""
    target, tokenizer, drafters = load_models(target_dir, serving_dir, settings.device, settings.dtype, False,
                                              settings.compile, settings.trust_remote_code, log, timing_pass=True)
    target.device_loops = target.compiled and settings.device_loops
    warm_ups: dict[str, float] = {}
    sets = timing_pass(target, tokenizer, prompt_sets, drafters["eagle3"], list(settings.draft_lengths),
                       settings.max_new_tokens, settings.dtype == "float32", log, settings.trees, warm_ups)
    device = pick_device(settings.device)
    return {"pass": "timing", "about": TIMING_PASS_ABOUT, "device": device, "device_name": describe(device),
            "dtype": settings.dtype, "prompts_per_set": settings.prompts,
            "max_new_tokens": settings.max_new_tokens, "compiled": target.compiled,
            "compiled_steps_without_cuda_graphs": steps_without_cuda_graphs() if target.compiled else 0,
            "tree_verify_eager": bool(target.compiled and settings.trees and target.tree_step_failed),
            "warm_up_seconds": warm_ups, "sets": sets}


def run(target_dir: Path, serving_dir: Path, prompt_files: dict[str, Path], output: Path, settings: Settings,
        log: Any) -> dict[str, Any]:
    prompt_sets = {name: load_prompts(path, settings.prompts, settings.multi_turn)
                   for name, path in prompt_files.items()}
    log.info("timing pass: %d prompts from each of %s on %s (%s), %d new tokens, k in %s",
             settings.prompts, list(prompt_sets), settings.device, settings.dtype,
             settings.max_new_tokens, list(settings.draft_lengths))
    results = run_timing(target_dir, serving_dir, prompt_sets, settings, log)
    evaluation.write_results(output, results)
    return results


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    torch.set_num_threads(snakemake.threads)
    prompt_files = {name: Path(path) for name, path in
                    zip(snakemake.params.prompt_sets, snakemake.input.prompts, strict=True)}
    run(Path(snakemake.input.target), Path(snakemake.input.serving), prompt_files, Path(snakemake.output[0]),
        timing_settings(snakemake.params.settings, snakemake.params.trust_remote_code), log)
