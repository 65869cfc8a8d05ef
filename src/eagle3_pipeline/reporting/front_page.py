"""The report's first page, as an HTML fragment that `report/workflow.rst` embeds: per prompt set the setting
to serve and the headline table (target alone, prompt lookup, best chain, best tree), the commands that serve
it, one line on the run, the disk plan against the bytes on disk, and what the run did not measure."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

from eagle3_pipeline.reporting.headline import (
    KINDS,
    Figures,
    Headline,
    best_drafter,
    fastest,
    headlines,
    sglang_command,
    verdict,
    vllm_command,
)

# The report's page holds this in a narrow column centred in a fixed-height box (whose overflow would be cut
# at the top): widen the column, start it at the top, and drop the backticks the prose style adds to code.
STYLE = """<style>
.prose.max-w-lg:has(.e3-front) { max-width: 50rem; }
.items-center:has(.e3-front) { align-items: flex-start; }
.prose:has(.e3-front) h1 { font-size: 1.45rem; margin-bottom: 0.5em; }
.e3-front code::before, .e3-front code::after { content: none; }
.e3-front table { margin: 0.4em 0 0.8em 0; font-size: 0.85rem; }
.e3-front th, .e3-front td { padding: 0.15em 0.6em !important; }
.e3-front td.num, .e3-front th.num { text-align: right; font-variant-numeric: tabular-nums; }
.e3-front tr.set td { font-weight: 600; background: #f3f4f6; }
.e3-front tr.pick td { font-weight: 600; color: #065f46; }
.e3-front pre { font-size: 0.72rem; white-space: pre-wrap; word-break: break-all; margin: 0.2em 0 0.6em 0;
                padding: 0.4em 0.6em; }
.e3-front p { margin: 0.3em 0; }
.e3-front .verdict { font-size: 0.95rem; }
.e3-front .missing { color: #92400e; }
.e3-front .note { font-size: 0.75rem; color: #4b5563; margin-top: -0.6em; }
.e3-front .yes { font-weight: 700; color: #065f46; }
.e3-front .no { font-weight: 700; color: #991b1b; }
</style>"""


@dataclass(frozen=True)
class RunFacts:
    """What the one line on the run says."""

    run: str
    target: str  # the config's target source
    conversations: int  # training conversations (token shards' sequences)
    tokens: int  # their tokens
    epochs: int
    steps: int
    train_seconds: float | None  # wall time of the training job that finished (None: not recorded)
    train_device: str | None
    eval_device: str  # where the timing pass (else the tau pass) ran, with its dtype
    target_dir: str  # results/<run>/target: the HF directory the engines load
    drafter_dir: str  # results/<run>/serving/drafter


def number(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "not timed" if value is None else f"{value:.{digits}f}{suffix}"


def table_row(kind: str, setting: Figures | None, picked: bool) -> str:
    if setting is None:
        return f'<tr><td>{kind}</td><td colspan="4" class="missing">not evaluated in this run</td></tr>'
    cells = [f"{kind}: <code>{escape(setting.method)}</code>" if kind != "target alone" else kind,
             f'<td class="num">{setting.tau:.3f}</td>', f'<td class="num">{number(setting.speedup, 2, "x")}</td>',
             f'<td class="num">{number(setting.tokens_per_s, 1)}</td>']
    return f'<tr{" class=pick" if picked else ""}><td>{cells[0]}</td>{"".join(cells[1:])}</tr>'


def headline_table(lines: list[Headline]) -> str:
    rows = ['<table><thead><tr><th>setting</th><th class="num">tau</th><th class="num">speedup</th>'
            '<th class="num">tokens/s</th></tr></thead><tbody>']
    for line in lines:
        timed = f"{line.timed_prompts} timed" if line.timed_prompts else "no timing pass"
        rows.append(f'<tr class="set"><td colspan="4">{escape(line.prompt_set)} '
                    f'<span style="font-weight:400">({line.prompts} prompts, {timed})</span></td></tr>')
        pick = fastest(line)
        rows += [table_row(kind, line.best[kind], pick is not None and line.best[kind] == pick) for kind in KINDS]
    rows += ["</tbody></table>", '<p class="note">tau: tokens per verify step (tau pass); speedup and tokens/s: '
             "the timing pass, against the target alone on the same prompts; green: the fastest measured setting of "
             "its prompt set. Every method, k and tree: the Evaluation category.</p>"]
    return "\n".join(rows)


def verdicts(lines: list[Headline]) -> str:
    said = []
    for line in lines:
        label, sentence = verdict(line)
        tone = "yes" if label == "Serve" else "no"
        said.append(f'<p class="verdict"><b>{escape(line.prompt_set)}</b>: <span class="{tone}">{escape(label)}'
                    f"</span>: {escape(sentence)}.</p>")
    return "\n".join(said)


def serving(lines: list[Headline], facts: RunFacts) -> str:
    """The commands for the first prompt set's best setting (SGLang) and best chain (vLLM serves chains)."""
    first = lines[0]
    parts = []
    if (pick := best_drafter(first)) is not None:
        parts += [f"<p>Serve with SGLang ({escape(pick.method)}, best on {escape(first.prompt_set)}):</p>",
                  f"<pre>{escape(sglang_command(facts.target_dir, facts.drafter_dir, pick))}</pre>"]
    if (chain := first.best["EAGLE-3 chain"]) is not None:
        parts += [f"<p>or with vLLM, which serves chains ({escape(chain.method)}):</p>",
                  f"<pre>{escape(vllm_command(facts.target_dir, facts.drafter_dir, chain))}</pre>"]
    return "\n".join(parts)


def setting_row(prompt_set: str, engine: str, setting: Figures | None, label: str) -> str:
    if setting is None:
        return (f"<tr><td>{escape(prompt_set)}</td><td>{engine}</td>"
                '<td colspan="4" class="missing">not evaluated</td></tr>')
    ms = ("not timed" if setting.draft_ms is None or setting.verify_ms is None
          else f"{setting.draft_ms:.2f} / {setting.verify_ms:.2f}")
    return (f"<tr><td>{escape(prompt_set)}</td><td>{engine}</td><td><code>{escape(label)}</code></td>"
            f'<td class="num">{setting.tau:.3f}</td><td class="num">{number(setting.speedup, 2, "x")}</td>'
            f'<td class="num">{ms}</td></tr>')


def recommendations(lines: list[Headline]) -> str:
    """Per prompt set, what to serve: the fastest measured EAGLE-3 setting with its SGLang flags, and the fastest
    chain for vLLM (k = num_speculative_tokens), each with its tau, speedup and draft / verify ms per step."""
    rows = ['<table><thead><tr><th>prompt set</th><th>engine</th><th>setting</th><th class="num">tau</th>'
            '<th class="num">speedup</th><th class="num">draft / verify ms</th></tr></thead><tbody>']
    for line in lines:
        pick, chain = best_drafter(line), line.best["EAGLE-3 chain"]
        rows.append(setting_row(line.prompt_set, "SGLang", pick, pick.sglang_flags if pick else ""))
        rows.append(setting_row(line.prompt_set, "vLLM", chain,
                                f'"num_speculative_tokens": {chain.k}' if chain else ""))
    return ("<p><b>Serving settings by prompt set</b> (the fastest the timing pass measured; by tau where it "
            "timed none):</p>\n" + "\n".join(rows) + "</tbody></table>")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "training time not recorded"
    return f"trained in {seconds / 60:.1f} min" if seconds < 5400 else f"trained in {seconds / 3600:.1f} h"


def run_line(facts: RunFacts) -> str:
    on = f" on {facts.train_device}" if facts.train_device else ""
    return (f"<p><b>Run</b> <code>{escape(facts.run)}</code>: target <code>{escape(facts.target)}</code>; "
            f"{facts.conversations:,} training conversations ({facts.tokens:,} tokens); "
            f"{plural(facts.epochs, 'epoch')}, {facts.steps:,} steps, {duration(facts.train_seconds)}{escape(on)}; "
            f"evaluated on {escape(facts.eval_device)}.</p>")


def disk_line(disk: dict[str, Any]) -> str:
    planned, actual = disk["planned_bytes"], disk["actual_bytes"]
    return (f"<p><b>Disk</b>: the plan gave the hidden-state stores {planned / 1e6:,.1f} MB; they hold "
            f"{actual / 1e6:,.1f} MB on disk ({disk['actual_over_planned']:.2f} of the plan, "
            f"{len(disk['shards'])} stores).</p>")


def engine_line(check: dict[str, Any]) -> str:
    """The engine check's verdict: the engine's acceptance length beside the evaluator's, per set and chain."""
    figures = [f"{name} {method}: {m['engine_acceptance_length']:.3f} vs {m['evaluator_acceptance_length']:.3f} "
               f"({m['gap']:+.1%} on {m['judged_on']}), {m['identical_share']:.0%} of outputs identical to its "
               "target alone, "
               f"{m['speedup_vs_target']:.2f}x its target alone"
               for name, values in check["sets"].items() for method, m in values["methods"].items()]
    verdict = '<span class="yes">passed</span>' if check["passed"] else '<span class="no">FAILED</span>'
    return (f"<p><b>Engine check</b> ({escape(check['engine'])} {escape(check['engine_version'])}, "
            f"{check['dtype']}, {'CUDA graphs' if check['cuda_graphs'] else 'eager'}): {verdict} - acceptance "
            f"length in the engine vs this pipeline's evaluator, {escape('; '.join(figures))}.</p>")


def gaps(timing: dict[str, Any], engine_check: dict[str, Any] | None) -> str:
    """What the run did not measure, said rather than left out."""
    said = []
    if not timing.get("sets"):
        said.append("<b>Timing pass</b>: none in this run, so no speeds: tau alone does not say whether drafting "
                    "pays for itself on a device.")
    if engine_check is None:
        said.append("<b>Engine check</b>: none in this run: tau and speeds come from this pipeline's own decoder "
                    "(lossless against the target in fp32), not from inside SGLang or vLLM.")
    return "\n".join(f'<p class="missing">{line}</p>' for line in said)


def front_page(evaluations: dict[str, dict[str, Any]], timing: dict[str, Any], facts: RunFacts,
               disk: dict[str, Any], engine_check: dict[str, Any] | None = None) -> str:
    lines = headlines(evaluations, timing)
    engine = [engine_line(engine_check)] if engine_check else []
    return "\n".join([STYLE, '<div class="e3-front">', verdicts(lines), headline_table(lines),
                      serving(lines, facts), recommendations(lines), run_line(facts), disk_line(disk), *engine,
                      gaps(timing, engine_check), "</div>"])
