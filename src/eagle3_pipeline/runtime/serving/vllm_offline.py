"""One vLLM engine in a process of its own: the target alone or with the exported drafter (EAGLE-3, k drafts),
greedy, one prompt per call (batch 1), over the engine check's prompt sets. It records per set the outputs' token
ids, the generate calls' wall time and the spec-decode counters' increase, for the set and for each prompt; the
engine's start (load, compile, CUDA-graph capture) is timed apart.

Run as `python -m eagle3_pipeline.runtime.serving.vllm_offline JOB.json RESULT.json`: a fresh process per
engine, because a vLLM engine does not give its GPU memory back to the process that made it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from eagle3_pipeline.formats import engine_check

# What vLLM's spec-decode counters are called (vllm/v1/spec_decode/metrics.py) and what we call them.
COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
MISSING_VLLM = ("engine_check needs the vllm package, which this environment lacks: install vllm==0.26.0 (its "
                "torch pin must match the environment's torch; envs/vllm.yaml) or set engine_check.enabled: false")


def counters(metrics: list[Any]) -> dict[str, Any]:
    """The spec-decode counters of a metrics snapshot (`LLM.get_metrics()`), summed over engines."""
    totals: dict[str, Any] = {name: 0 for name in COUNTERS.values()} | {"accepted_per_position": []}
    for metric in metrics:
        if metric.name in COUNTERS:
            totals[COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POSITION:
            values = [int(v) for v in metric.values]
            have = totals["accepted_per_position"]
            totals["accepted_per_position"] = [a + b for a, b in zip(have + [0] * len(values), values, strict=False)]
    return totals


def increase(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What a prompt set added to the (cumulative) counters."""
    grown = {name: after[name] - before[name] for name in COUNTERS.values()}
    earlier = before["accepted_per_position"] + [0] * len(after["accepted_per_position"])
    grown["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"], earlier, strict=False)]
    return grown


def engine_arguments(job: dict[str, Any]) -> dict[str, Any]:
    """vLLM's LLM(...) arguments for a job: greedy batch-1 serving of the run's target, with the drafter when
    `draft_length` is set."""
    arguments = {
        "model": job["target_dir"], "tokenizer": job["target_dir"], "dtype": job["dtype"], "seed": 0,
        "enforce_eager": not job["cuda_graphs"], "gpu_memory_utilization": job["gpu_memory_utilization"],
        "max_model_len": job["max_model_len"], "max_num_seqs": 1, "enable_prefix_caching": False,
        "disable_log_stats": False,  # the spec-decode counters are stats
        "generation_config": "vllm",  # vLLM's default sampling, not the checkpoint's (for calls without any)
        "trust_remote_code": job["trust_remote_code"],
    }
    if job["draft_length"]:
        arguments["speculative_config"] = {"method": "eagle3", "model": job["serving_dir"],
                                           "num_speculative_tokens": job["draft_length"]}
    return arguments


def run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is optional; greedy needs no sampler
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as exc:
        raise SystemExit(f"{MISSING_VLLM} ({exc})") from None
    started = time.perf_counter()
    llm = LLM(**engine_arguments(job))
    start_seconds = time.perf_counter() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], detokenize=False)
    first = next(iter(job["sets"].values()))[0]
    llm.generate([TokensPrompt(prompt_token_ids=first["ids"])], greedy, use_tqdm=False)  # warm-up: lazy set-up
    results = {}
    for name, prompts in job["sets"].items():
        results[name] = decode_set(llm, prompts, greedy, TokensPrompt)
        print(f"{name}: {len(prompts)} prompts, {results[name]['output_tokens']} tokens in "
              f"{results[name]['seconds']:.2f} s", flush=True)
    return {"vllm_version": vllm.__version__, "draft_length": job["draft_length"],
            "start_seconds": start_seconds, "sets": results}


def decode_set(llm: Any, prompts: list[dict[str, Any]], greedy: Any, tokens_prompt: Any) -> dict[str, Any]:
    """One prompt set, a prompt per call (batch 1): its outputs, the generate calls' seconds, and the spec-decode
    counters' increase for the set and for each prompt (the check compares prompt by prompt where texts agree)."""
    seconds, tokens, per_prompt = 0.0, {}, {}
    start = before = counters(llm.get_metrics())
    for prompt in prompts:
        began = time.perf_counter()
        (output,) = llm.generate([tokens_prompt(prompt_token_ids=prompt["ids"])], greedy, use_tqdm=False)
        seconds += time.perf_counter() - began
        tokens[prompt["prompt_id"]] = list(output.outputs[0].token_ids)
        after = counters(llm.get_metrics())
        per_prompt[prompt["prompt_id"]] = increase(after, before)
        before = after
    return {"seconds": seconds, "tokens": tokens, "output_tokens": sum(map(len, tokens.values())),
            "counters": increase(before, start), "per_prompt": per_prompt}


def main(argv: list[str]) -> None:
    job_path, result_path = map(Path, argv)
    engine_check.write_engine_run(result_path, run(json.loads(job_path.read_text())))


if __name__ == "__main__":
    main(sys.argv[1:])
