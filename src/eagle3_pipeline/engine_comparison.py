"""The engine check's arithmetic: vLLM's spec-decode counters beside the evaluator's traces of the same prompts.

Acceptance length is vLLM's (1 + accepted drafts per verify step), computed the same way from the traces. The
verdict rests on the prompts whose text both decoders agree on (same_text) where there are enough of them, so a
precision difference that sends a near tie the other way does not count as the engine reading the export wrongly.
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.runtime.speculative import acceptance_by_position, first_divergence
from eagle3_pipeline.runtime.traces import Trace, acceptance_length

MIN_SAME_TEXT = 10  # fewer same-text prompts than this: the verdict rests on every prompt instead
LIKELY_CAUSES = ("the aux layer ids the engine read (eagle_aux_hidden_state_layer_ids in the drafter's config.json) "
                 "are not the layers it was trained on; d2t offsets (draft id + d2t[id] must be the target id); "
                 "positions (the drafter's position ids shifted by one); norms (hidden_norm and input_layernorm "
                 "swapped, or the final norm applied twice)")


def evaluator_figures(traces: list[Trace], k: int) -> dict[str, Any]:
    """The evaluator's traces in vLLM's arithmetic: acceptance length = 1 + accepted drafts per verify step."""
    return {"evaluator_acceptance_length": acceptance_length(traces),
            "evaluator_acceptance_by_position": acceptance_by_position(traces, k)}


def engine_figures(counters: dict[str, Any]) -> dict[str, Any]:
    """vLLM's counters as acceptance length and acceptance by position (P(draft i accepted | the drafts before it
    were), as the evaluator reports it; vLLM's per-position counters count every accepted draft at i)."""
    drafts = counters["drafts"]
    reached = [drafts, *counters["accepted_per_position"][:-1]]
    return {"engine_acceptance_length": 1 + counters["accepted_tokens"] / max(drafts, 1),
            "engine_acceptance_by_position": [a / r if r else 0.0 for a, r in
                                              zip(counters["accepted_per_position"], reached, strict=True)],
            "drafts": drafts, "draft_tokens": counters["draft_tokens"],
            "accepted_tokens": counters["accepted_tokens"]}


def summed(counters: list[dict[str, Any]]) -> dict[str, Any]:
    """Several prompts' counters as one."""
    total = {key: sum(c[key] for c in counters) for key in ("drafts", "draft_tokens", "accepted_tokens")}
    positions = max((len(c["accepted_per_position"]) for c in counters), default=0)
    total["accepted_per_position"] = [sum(c["accepted_per_position"][i] for c in counters
                                          if i < len(c["accepted_per_position"])) for i in range(positions)]
    return total


def same_text(prompt_ids: list[str], engine_target: dict[str, list[int]], engine_run: dict[str, list[int]],
              evaluator_target: dict[str, Trace]) -> list[str]:
    """Prompts whose text both decoders agree on: the engine's output with and without the drafter, and the
    evaluator's target alone, are the same tokens. There both drafters were asked the same questions, so their
    acceptance differs only by the drafter's computation; elsewhere (another precision: a near tie went the other
    way) they drafted for different texts."""
    return [pid for pid in prompt_ids
            if pid in evaluator_target and engine_run[pid] == engine_target[pid] == evaluator_target[pid].tokens]


def judged(prompt_ids: list[str], same: list[str], run: dict[str, Any]) -> tuple[list[str], dict[str, Any], str]:
    """The prompts the verdict rests on, the engine's counters over them, and what they are."""
    if "per_prompt" in run and len(same) >= MIN_SAME_TEXT:
        return same, summed([run["per_prompt"][pid] for pid in same]), f"{len(same)} same-text prompts"
    reason = "no per-prompt counters" if "per_prompt" not in run else f"only {len(same)} same-text prompts"
    return prompt_ids, run["counters"], f"all {len(prompt_ids)} prompts ({reason})"


def method_figures(prompt_ids: list[str], engine_target: dict[str, Any], run: dict[str, Any], k: int,
                   traces: dict[str, dict[str, Trace]], method: str, tolerance: float) -> dict[str, Any]:
    """One draft length on one prompt set: the engine beside the evaluator on the judged prompts, and on all."""
    same = same_text(prompt_ids, engine_target["tokens"], run["tokens"], traces["target"])
    basis, counters, judged_on = judged(prompt_ids, same, run)
    figures = engine_figures(counters) | evaluator_figures([traces[method][p] for p in basis], k)
    gap = figures["engine_acceptance_length"] / figures["evaluator_acceptance_length"] - 1
    every = engine_figures(run["counters"])["engine_acceptance_length"], \
        evaluator_figures([traces[method][p] for p in prompt_ids], k)["evaluator_acceptance_length"]
    diverged = {pid: at for pid in prompt_ids if (at := first_divergence(
        Trace(pid, method, run["tokens"][pid]), Trace(pid, "target", engine_target["tokens"][pid]))) is not None}
    rate = run["output_tokens"] / max(run["seconds"], 1e-9)
    target_rate = engine_target["output_tokens"] / max(engine_target["seconds"], 1e-9)
    return figures | {
        "gap": gap, "passed": abs(gap) <= tolerance, "judged_on": judged_on, "same_text_prompts": len(same),
        "engine_acceptance_length_all": every[0], "evaluator_acceptance_length_all": every[1],
        "identical_share": 1 - len(diverged) / max(len(prompt_ids), 1), "first_divergence": diverged,
        "tokens_per_s": rate, "speedup_vs_target": rate / max(target_rate, 1e-9)}


def compare_set(name: str, prompt_ids: list[str], engines: dict[str, dict[str, Any]],
                evaluated: dict[str, Any], tolerance: float) -> tuple[dict[str, Any], list[str]]:
    """One prompt set: every draft length's engine figures beside the evaluator's, and the failures found."""
    traces: dict[str, dict[str, Trace]] = {}
    for record in evaluated["traces"]:
        record = {key: value for key, value in record.items() if key != "tau"}
        traces.setdefault(record["method"], {})[record["prompt_id"]] = Trace(**record)
    target = engines["target"]["sets"][name]
    matches = [target["tokens"][pid] == traces["target"][pid].tokens for pid in prompt_ids if pid in traces["target"]]
    alone = {"tokens_per_s": target["output_tokens"] / max(target["seconds"], 1e-9),
             "output_tokens": target["output_tokens"]}
    result: dict[str, Any] = {"prompts": len(prompt_ids), "target": alone, "methods": {},
                              "target_matches_evaluator_share": sum(matches) / max(len(matches), 1)}
    failures = []
    for method, engine in engines.items():
        if engine["draft_length"] is None:
            continue
        missing = [pid for pid in prompt_ids if pid not in traces.get(method, {})]
        if missing:
            failures.append(f"{name}: the tau pass did not decode prompts {missing[:5]} with {method}")
            continue
        figures = method_figures(prompt_ids, target, engine["sets"][name], engine["draft_length"], traces, method,
                                 tolerance)
        result["methods"][method] = figures
        if not figures["passed"]:
            failures.append(f"{name}, {method}: engine acceptance length {figures['engine_acceptance_length']:.3f} "
                            f"vs the evaluator's {figures['evaluator_acceptance_length']:.3f} on "
                            f"{figures['judged_on']} ({figures['gap']:+.1%}, more than {tolerance:.0%}); likely "
                            f"causes: {LIKELY_CAUSES}")
    return result, failures


def compare(prompt_ids: dict[str, list[str]], engines: dict[str, dict[str, Any]],
            evaluations: dict[str, dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """The check's result (formats/engine_check.py) from every engine's run and the tau pass's results."""
    sets, failures = {}, []
    for name, ids in prompt_ids.items():
        sets[name], found = compare_set(name, ids, engines, evaluations[name], tolerance)
        failures += found
    versions = {engine.get("vllm_version") for engine in engines.values()}
    return {"engine_version": ", ".join(sorted(filter(None, versions))), "tolerance": tolerance,
            "passed": not failures, "failures": failures,
            "start_seconds": {name: engine["start_seconds"] for name, engine in engines.items()}, "sets": sets}
