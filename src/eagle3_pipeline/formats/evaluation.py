"""Evaluation reports: `evaluation/<prompt set>.json` (the tau pass, rule `evaluate`), `timing/timing.json` (the timing
pass, rule `evaluate_timing`) and the report's `report/tau_and_speedup.csv` (rule `plots`).

Results JSON (indent 2): `summary` {method: {tau, prompts, acceptance_by_position, diverged_share, ...; EAGLE-3
methods also vocabulary_stops: the share of verify steps stopped at a target token outside the draft vocabulary}}, the
per-prompt traces, settings, `prompt_file`. Timing JSON: `sets` {prompt set: {method: {tokens_per_s,
speedup_vs_target, draft_ms_per_step, verify_ms_per_step, prompt_draft_ms_per_prompt, prompts, loop}}} (loop
"device": the device-resident loop, whose draft/verify ms are device time; prompt_draft_ms_per_prompt: of the
drafting, each prompt's first, which writes its rows into the drafter's cache), the settings, `compiled` and
`compiled_steps_without_cuda_graphs` (non-zero: some compiled steps ran launch by launch, their speeds suspect),
`tree_verify_eager` (true: the trees' verify failed to compile and ran eagerly, their speeds suspect) and
`warm_up_seconds` {static cache size ("2048 slots"), or "eager": the untimed warm-up's seconds, compilation and
graph capture included on a fresh GPU}. The CSV has TAU_COLUMNS, one row per prompt set and method: tau from the tau
pass, speeds from the timing pass (empty where it did not run that method, e.g. the untrained baseline), and for
EAGLE-3 chains and trees the SGLang flags of that setting (the summary's `sglang_flags`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.formats.atomic import atomic_write

TAU_COLUMNS = ("prompt_set", "method", "tau (tau pass)", "diverged_share (tau pass)", "prompts (tau pass)",
               "tokens_per_s (timing pass)", "speedup_vs_target (timing pass)", "draft_ms_per_step (timing pass)",
               "verify_ms_per_step (timing pass)", "prompts (timing pass)", "loop (timing pass)", "sglang_flags")


class InvalidReport(ValueError):
    pass


def write_results(path: Path, results: dict[str, Any]) -> None:
    """A tau pass's or the timing pass's results, atomically."""
    atomic_write(Path(path), json.dumps(results, indent=2))


def read_results(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def read_evaluations(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Evaluation results (evaluation/<prompt set>.json, written by the `evaluate` rule) by prompt set."""
    return {Path(p).stem: read_results(p) for p in paths}


def validate_results(path: Path) -> dict[str, Any]:
    """Raise InvalidReport naming the file and reason unless it is a tau pass's results; return them."""
    try:
        results = read_results(path)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidReport(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    summary = results.get("summary") if isinstance(results, dict) else None
    if not isinstance(summary, dict) or not summary:
        raise InvalidReport(f"{path}: no summary by method")
    for method, values in summary.items():
        if "prompts" not in values:
            raise InvalidReport(f"{path}: method {method!r} has no prompt count")
    return results


def tau_rows(evaluations: dict[str, dict[str, Any]], timing: dict[str, Any]) -> list[list[Any]]:
    """One row per prompt set and method, in TAU_COLUMNS order: tau from the tau pass, speeds from the timing
    pass (empty where the timing pass did not run that method, e.g. the untrained baseline)."""
    rows = []
    for name, result in evaluations.items():
        for method, values in result["summary"].items():
            speed = timing.get("sets", {}).get(name, {}).get(method)
            speeds = ([f"{speed['tokens_per_s']:.1f}", f"{speed['speedup_vs_target']:.3f}",
                       f"{speed['draft_ms_per_step']:.2f}", f"{speed['verify_ms_per_step']:.2f}", speed["prompts"],
                       speed.get("loop", "host")]
                      if speed else [""] * 6)
            rows.append([name, method, f"{values.get('tau', 1.0):.3f}", f"{values.get('diverged_share', 0):.3f}",
                         values["prompts"], *speeds, values.get("sglang_flags", "")])
    return rows


def write_tau_table(path: Path, evaluations: dict[str, dict[str, Any]], timing: dict[str, Any]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TAU_COLUMNS)
        writer.writerows(tau_rows(evaluations, timing))


def read_tau_table(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    if rows and tuple(rows[0]) != TAU_COLUMNS:
        raise InvalidReport(f"{path}: columns {list(rows[0])} are not {list(TAU_COLUMNS)}")
    return rows
