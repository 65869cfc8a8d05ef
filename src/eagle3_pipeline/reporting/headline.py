"""The headline of a run, per prompt set: the target alone, the best prompt-lookup setting, the best EAGLE-3
chain and the best EAGLE-3 tree, each with its tau (tau pass) and, where the timing pass ran it, its speed.

"Best" is the fastest measured setting when the timing pass ran any setting of that kind, else the highest tau
(then the figure says it was not timed). Methods are read by their names in the result files (`target`,
`prompt-lookup@k=N`, `eagle3@k=N` (a chain), `eagle3-tree(steps=S,topk=K,tokens=T)`, `eagle3-untrained@k=N`) with
the one reader of names, runtime/methods.py `Method.parse`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.logs import ClearError
from eagle3_pipeline.runtime.methods import PROMPT_LOOKUP, TARGET, Method

KINDS = ("target alone", "prompt lookup", "EAGLE-3 chain", "EAGLE-3 tree")


@dataclass(frozen=True)
class Figures:
    """One method on one prompt set."""

    method: str
    tau: float
    k: int | None  # draft length (a tree's depth); None for the target alone
    speedup: float | None  # vs the target alone, from the timing pass; None where it did not time the method
    tokens_per_s: float | None
    sglang_flags: str  # EAGLE-3 settings only: SGLang's flags beside the draft model path
    draft_ms: float | None = None  # per verify step, from the timing pass
    verify_ms: float | None = None
    loop: str | None = None  # the timing pass's loop: "device" (device-resident) or "host"


@dataclass(frozen=True)
class Headline:
    """One prompt set: the best setting of each kind (None where the run evaluated no setting of it)."""

    prompt_set: str
    prompts: int  # decoded by the tau pass
    timed_prompts: int | None  # timed by the timing pass; None when it did not time this set
    best: dict[str, Figures | None]  # by KINDS


def kind(method: str) -> str | None:
    """The KINDS entry of a method name; None for the untrained baseline and names of no known kind."""
    try:
        value = Method.parse(method)
    except (ValueError, ClearError):
        return None
    if value.proposer == "eagle3":
        return "EAGLE-3 tree" if value.tree else "EAGLE-3 chain"
    return {TARGET: "target alone", PROMPT_LOOKUP: "prompt lookup"}.get(value.proposer)


def figures(method: str, values: dict[str, Any], speed: dict[str, Any] | None) -> Figures:
    return Figures(method=method, tau=values.get("tau", 1.0), k=values.get("k"),
                   speedup=speed["speedup_vs_target"] if speed else None,
                   tokens_per_s=speed["tokens_per_s"] if speed else None,
                   sglang_flags=values.get("sglang_flags", ""),
                   draft_ms=speed.get("draft_ms_per_step") if speed else None,
                   verify_ms=speed.get("verify_ms_per_step") if speed else None,
                   loop=speed.get("loop") if speed else None)


def best_of(candidates: list[Figures]) -> Figures | None:
    """The fastest timed candidate; with none timed, the one of highest tau."""
    timed = [c for c in candidates if c.speedup is not None]
    if timed:
        return max(timed, key=lambda c: c.speedup)
    return max(candidates, key=lambda c: c.tau, default=None)


def headline(prompt_set: str, result: dict[str, Any], timing: dict[str, Any]) -> Headline:
    speeds = timing.get("sets", {}).get(prompt_set, {})
    by_kind: dict[str, list[Figures]] = {name: [] for name in KINDS}
    for method, values in result["summary"].items():
        if (found := kind(method)) is not None:
            by_kind[found].append(figures(method, values, speeds.get(method)))
    timed = [speed["prompts"] for speed in speeds.values()]
    return Headline(prompt_set=prompt_set, prompts=max(v["prompts"] for v in result["summary"].values()),
                    timed_prompts=max(timed) if timed else None,
                    best={name: best_of(found) for name, found in by_kind.items()})


def headlines(evaluations: dict[str, dict[str, Any]], timing: dict[str, Any]) -> list[Headline]:
    """One headline per prompt set, in the evaluations' order."""
    return [headline(name, result, timing) for name, result in evaluations.items()]


def best_drafter(line: Headline) -> Figures | None:
    """The setting to serve on this prompt set: the faster of the best chain and the best tree (by tau when
    neither was timed)."""
    return best_of([f for f in (line.best["EAGLE-3 chain"], line.best["EAGLE-3 tree"]) if f is not None])


def sglang_command(target_dir: str, drafter_dir: str, setting: Figures) -> str:
    return (f"python -m sglang.launch_server --model-path {target_dir} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {drafter_dir} {setting.sglang_flags}").rstrip()


def vllm_command(target_dir: str, drafter_dir: str, chain: Figures) -> str:
    """vLLM serves EAGLE-3 chains: the draft length is its num_speculative_tokens."""
    speculative = {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": chain.k}
    return f"vllm serve {target_dir} --speculative-config '{json.dumps(speculative)}'"


def verdict(line: Headline) -> tuple[str, str]:
    """The answer for this prompt set, as a short label and a sentence with the figures behind it."""
    drafter = best_drafter(line)
    if drafter is None:
        return "No drafter evaluated", "the run evaluated no EAGLE-3 setting on this prompt set"
    figures = f"{drafter.method}, tau {drafter.tau:.2f}"
    if drafter.speedup is None:
        return "Not timed", f"{figures} (the highest tau); the timing pass did not time it, so its speed is unknown"
    gain = f"{figures}: {drafter.speedup:.2f}x the target alone"
    lookup = line.best["prompt lookup"]
    if lookup is None or lookup.speedup is None:
        return ("Serve" if drafter.speedup > 1 else "Not faster here"), gain
    target = line.best["target alone"]
    baseline_loop = target.loop if target is not None else None
    loops = (f", timed in the {lookup.loop} loop against the target alone in the {baseline_loop} loop"
             if lookup.loop and baseline_loop and lookup.loop != baseline_loop else "")
    gain += (f", {drafter.speedup / lookup.speedup:.2f}x prompt lookup's speed (prompt lookup: {lookup.speedup:.2f}x"
             f"{loops})")
    if drafter.speedup <= 1:
        return "Not faster here", gain + "; decoding without a drafter is faster"
    if lookup.speedup > drafter.speedup:
        return "Prompt lookup is faster here", gain
    return "Serve", gain


def fastest(line: Headline) -> Figures | None:
    """The setting with the highest measured speedup on this prompt set (the target alone included)."""
    return best_of([f for f in line.best.values() if f is not None and f.speedup is not None])
