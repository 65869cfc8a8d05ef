"""The headline `make run` ends with, for a 120-column terminal: per prompt set, a table of every method's tau
and speed (the columns a reader compares; the report's CSV keeps every column), the setting to serve, and below,
the SGLang and vLLM flags of each EAGLE-3 setting."""

from __future__ import annotations

import textwrap
from typing import Any

from eagle3_pipeline.reporting.headline import Headline, headlines, kind, verdict

WIDTH = 120
COLUMNS = ("method", "tau", "speedup", "tokens/s", "draft ms", "verify ms", "diverged")
UNTIMED = "-"


def method_cells(method: str, values: dict[str, Any], speed: dict[str, Any] | None) -> list[str]:
    """tau and divergence from the tau pass, speeds (per verify step: ms drafting, ms verifying) from the timing
    pass; "-" where the timing pass did not run the method."""
    timed = ([f"{speed['speedup_vs_target']:.2f}x", f"{speed['tokens_per_s']:.1f}",
              f"{speed['draft_ms_per_step']:.1f}", f"{speed['verify_ms_per_step']:.1f}"]
             if speed else [UNTIMED] * 4)
    return [method, f"{values.get('tau', 1.0):.3f}", *timed, f"{values.get('diverged_share', 0.0):.0%}"]


def aligned(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Text columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in rows]


def set_table(line: Headline, result: dict[str, Any], timing: dict[str, Any]) -> list[str]:
    """The prompt set's title (its counts are the headline's) and a row per method."""
    speeds = timing.get("sets", {}).get(line.prompt_set, {})
    title = (f"{line.prompt_set}: tau over {line.prompts} prompts (tau pass), "
             + (f"speeds over {line.timed_prompts} (timing pass)" if line.timed_prompts else "no timing pass"))
    rows = [list(COLUMNS)] + [method_cells(method, values, speeds.get(method))
                              for method, values in result["summary"].items()]
    return [title, *aligned(rows)]


def flag_lines(evaluations: dict[str, dict[str, Any]]) -> list[str]:
    """SGLang's flags for every EAGLE-3 setting (chains and trees), each under its name: a tree's name and
    flags together pass 120 columns."""
    flags = {method: values["sglang_flags"] for result in evaluations.values()
             for method, values in result["summary"].items() if values.get("sglang_flags")}
    if not flags:
        return []
    lines = ["", "SGLang: python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3",
             "        --speculative-draft-model-path DRAFTER, and per setting:"]
    for method, flag in flags.items():
        lines += [f"  {method}", f"      {flag}"]
    chains = sorted({values["k"] for result in evaluations.values()
                     for method, values in result["summary"].items() if kind(method) == "EAGLE-3 chain"})
    if chains:
        lines += ["vLLM (chains): vllm serve TARGET --speculative-config \\",
                  "  '{\"method\": \"eagle3\", \"model\": \"DRAFTER\", \"num_speculative_tokens\": K}'"
                  f" with K in {chains}"]
    return lines


def headline_table(evaluations: dict[str, dict[str, Any]], timing: dict[str, Any]) -> str:
    """Every line fits WIDTH columns (a long warning is wrapped)."""
    lines: list[str] = []
    sets = headlines(evaluations, timing)
    for line in sets:
        lines += [*set_table(line, evaluations[line.prompt_set], timing), ""]
    lines += ["Verdict (per prompt set, the fastest measured EAGLE-3 setting against the target and prompt lookup):"]
    for line in sets:
        label, sentence = verdict(line)
        lines.append(textwrap.fill(f"{label}: {sentence}", WIDTH, initial_indent=f"  {line.prompt_set}: ",
                                   subsequent_indent="    "))
    lines += flag_lines(evaluations)
    if skipped := timing.get("compiled_steps_without_cuda_graphs"):
        lines += ["", textwrap.fill(
            f"WARNING: {skipped} compiled step(s) of the timing pass ran without CUDA graphs, launch by launch: "
            "its speeds are not a captured decoder's (torch's [__cudagraphs] log lines say why)", WIDTH)]
    if timing.get("tree_verify_eager"):
        lines += ["", textwrap.fill(
            "WARNING: the draft trees' verify could not be compiled and ran eagerly in the timing pass (its log "
            "says why): their speeds are not a compiled decoder's, and the verdict may pass them over", WIDTH)]
    return "\n".join(lines)
