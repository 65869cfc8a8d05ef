"""An ablation's arms against their control, as a markdown table: what each arm trained on, its held-out estimate
and its decoded tau per prompt set (EAGLE-3 chain and prompt lookup at k), each as a ratio against the control,
which is the first run given. Regenerating arms also get their regeneration's figures from the job logs.

    python benchmarks/compare_arms.py results/smollm2-arm-control results/smollm2-gpu-regen-vllm ... \\
        [--logs logs] [--k 4]

Decoded tau is the comparable figure: a regenerating arm's selection conversations are regenerated too, so its
held-out estimate measures other text than the control's (a mixture's, regenerate.keep_original, are not: its
estimate compares).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

DONE_LINE = re.compile(r"regenerate: (\d+)/\d+ .*?, (\d+) tokens, ([\d,]+) tokens/s, elapsed ([\d:]+), ETA \S+ - done")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def data_figures(run: Path) -> dict[str, Any]:
    stats = read_json(run / "vocab" / "data_stats.json")
    if not stats:  # an arm that stopped before its vocabulary
        return {}
    sequences = sum(shard["num_sequences"] for shard in stats["shards"].values())
    return {"sequences": sequences, "tokens": stats["total_tokens"], "loss_tokens": stats["total_loss_tokens"]}


def heldout_by_epoch(run: Path) -> str:
    """The held-out estimate after each epoch at the draft length that selects the kept weights, the kept one in
    bold: whether an arm's lead grows or fades with training shows here, not in the kept figure alone."""
    estimate = read_json(run / "train" / "summary.json").get("heldout_estimate") or {}
    kept, key = estimate.get("kept") or {}, estimate.get("selected_by")
    epochs = [row for row in estimate.get("by_epoch", []) if key in row]
    if not epochs:
        return "-"
    return " / ".join(f"**{row[key]:.3f}**" if row.get("step") == kept.get("step") else f"{row[key]:.3f}"
                      for row in epochs)


def decoded_tau(run: Path, k: int) -> dict[str, dict[str, float]]:
    """Per prompt set: the chain's and prompt lookup's tau at k (absent methods left out)."""
    taus = {}
    for path in sorted((run / "evaluation").glob("*.json")):
        summary = read_json(path).get("summary", {})
        taus[path.stem] = {name: summary[key]["tau"] for name, key in
                           (("chain", f"eagle3@k={k}"), ("lookup", f"prompt-lookup@k={k}")) if key in summary}
    return taus


def regeneration(logs: Path, run_name: str) -> dict[str, Any] | None:
    """Generated tokens and the jobs' tokens/s (each job on its own clock) from regenerate's job logs, else from the
    run's Snakemake log that `device_run.sh arms` keeps (logs/arms/<run>.log: every job's stderr)."""
    jobs = []
    texts = [path.read_text(errors="replace") for path in sorted((logs / run_name / "regenerate").glob("*.log"))]
    if not all(DONE_LINE.search(text) for text in texts) and (logs / "arms" / f"{run_name}.log").exists():
        texts = [(logs / "arms" / f"{run_name}.log").read_text(errors="replace")]
    for text in texts:
        for match in DONE_LINE.finditer(text):
            jobs.append((int(match[2]), float(match[3].replace(",", "")), match[4]))
    if not jobs:
        return None
    return {"jobs": len(jobs), "tokens": sum(tokens for tokens, _, _ in jobs),
            "tokens_per_s": [rate for _, rate, _ in jobs], "elapsed": [elapsed for _, _, elapsed in jobs]}


def ratio(value: float | None, control: float | None) -> str:
    if value is None:
        return "-"
    if not control:
        return f"{value:.3f}"
    return f"{value:.3f} ({value / control:.3f}x)"


def table(runs: list[Path], k: int) -> list[str]:
    rows = [(run.name, data_figures(run), heldout_by_epoch(run), decoded_tau(run, k)) for run in runs]
    control = rows[0]
    sets = sorted({name for row in rows for name in row[3]})
    head = ["arm", "sequences", "tokens (loss)", "held-out estimate by epoch (own text; kept in bold)"]
    head += [f"{name} chain k={k}" for name in sets] + [f"{name} lookup k={k}" for name in sets]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, data, estimate, taus in rows:
        cells = [name, f"{data['sequences']:,}" if data else "-",
                 f"{data['tokens']:,} ({data['loss_tokens']:,})" if data else "-",
                 estimate]
        for method in ("chain", "lookup"):
            cells += [ratio(taus.get(s, {}).get(method), control[3].get(s, {}).get(method)) for s in sets]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run directories; the first is the control")
    parser.add_argument("--logs", type=Path, default=Path("logs"), help="the workflow's log folder")
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    print("\n".join(table(args.runs, args.k)))
    for run in args.runs:
        regen = regeneration(args.logs, run.name)
        if regen:
            rates = ", ".join(f"{rate:,.0f}" for rate in regen["tokens_per_s"])
            print(f"\n{run.name}: {regen['jobs']} regenerate jobs (with the selection's, if it finished), "
                  f"{regen['tokens']:,} generated tokens; "
                  f"tokens/s per job: {rates}; elapsed per job: {', '.join(regen['elapsed'])}")


if __name__ == "__main__":
    main()
