"""Figures and tables for `snakemake --report` (matplotlib, Agg backend: no display needed), and the
headline table `make run` ends with: `python -m eagle3_pipeline.stages.plots RUN_DIR` (or `--config FILE...`)
prints tau and speedup per prompt set and method from RUN_DIR/evaluation/*.json (reporting/terminal.py); the
report's first page is reporting/front_page.py's fragment."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from eagle3_pipeline import logs  # noqa: E402
from eagle3_pipeline.formats import engine_check, metrics, reports  # noqa: E402
from eagle3_pipeline.formats.evaluation import (  # noqa: E402
    read_evaluations,
    read_results,
    write_tau_table,
)
from eagle3_pipeline.formats.target_dir import read_identity  # noqa: E402
from eagle3_pipeline.layout import RunLayout  # noqa: E402
from eagle3_pipeline.reporting.front_page import RunFacts, front_page  # noqa: E402
from eagle3_pipeline.reporting.terminal import headline_table  # noqa: E402


@dataclass(frozen=True)
class Settings:
    config: dict[str, Any]  # the whole run config, recorded in the provenance


@dataclass(frozen=True)
class Inputs:
    evaluations: list[Path]
    timing: Path
    metrics: Path
    summary: Path
    disk: Path
    config_snapshot: Path
    target: Path
    data_stats: Path  # vocab/data_stats.json: the training shards' sequences and tokens
    engine_check: Path | None = None  # engine_check/<engine>.json where the run has one


@dataclass(frozen=True)
class Outputs:
    acceptance: Path
    tau: Path
    training: Path
    disk: Path
    provenance: Path
    front_page: Path  # the HTML fragment report/workflow.rst embeds


def acceptance_figure(evaluations: dict[str, dict[str, Any]], out: Path) -> None:
    sets = list(evaluations)
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, name in zip(axes[0], sets, strict=True):
        for method, values in evaluations[name]["summary"].items():
            rates = values.get("acceptance_by_position")
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{method} (tau {values['tau']:.2f})")
        ax.set(title=f"Acceptance by draft position: {name}", xlabel="draft position", ylabel="acceptance rate",
               ylim=(0, 1))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    reports.write_figure(fig, out)
    plt.close(fig)


def training_figure(metrics_path: Path, out: Path, train_summary: dict[str, Any] | None = None) -> None:
    """Loss and per-step accuracy; with a held-out estimate in the training summary, a third panel: estimated
    tau per epoch for every draft length (the kept epoch marked)."""
    rows = metrics.read(metrics_path)
    steps = [r["step"] for r in rows]
    ttt = sum(1 for key in rows[0] if key.startswith("acc_"))
    estimate = (train_summary or {}).get("heldout_estimate")
    fig, axes = plt.subplots(1, 3 if estimate else 2, figsize=(18 if estimate else 12, 4))
    loss_ax, acc_ax = axes[0], axes[1]
    loss_ax.plot(steps, [r["loss"] for r in rows])
    loss_ax.set(title="Training loss (weighted over TTT steps)", xlabel="step", ylabel="loss")
    for k in range(ttt):
        acc_ax.plot(steps, [r[f"acc_{k}"] for r in rows], label=f"TTT step {k}")
    acc_ax.set(title="Top-1 accuracy vs the target, per TTT step", xlabel="step", ylabel="accuracy", ylim=(0, 1))
    acc_ax.legend(fontsize=8)
    if estimate:
        heldout_panel(axes[2], estimate)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    reports.write_figure(fig, out)
    plt.close(fig)


def heldout_panel(ax: Any, estimate: dict[str, Any]) -> None:
    by_epoch = estimate["by_epoch"]
    epochs = [r["epoch"] for r in by_epoch]
    lengths = sorted(int(key[5:]) for key in by_epoch[0] if key.startswith("tau_k"))
    for k in lengths:
        ax.plot(epochs, [r[f"tau_k{k}"] for r in by_epoch], marker="o", label=f"k={k}")
    kept = estimate["kept"]
    if kept:  # none when the held-out split had no draft positions
        ax.axvline(kept["epoch"], color="grey", linestyle="--", label=f"kept (epoch {int(kept['epoch'])})")
    ax.set_xticks(epochs)
    ax.set(title="Offline acceptance estimate on held-out data", xlabel="epoch", ylabel="estimated tau")
    ax.legend(fontsize=8)


def disk_figure(disk_report: dict[str, Any], out: Path) -> None:
    shards = list(disk_report["shards"])
    planned = [disk_report["shards"][s]["planned_bytes"] / 1e6 for s in shards]
    actual = [disk_report["shards"][s]["actual_bytes"] / 1e6 for s in shards]
    fig, ax = plt.subplots(figsize=(max(6, len(shards) * 0.6), 4))
    positions = range(len(shards))
    ax.bar([p - 0.2 for p in positions], planned, width=0.4, label="planned")
    ax.bar([p + 0.2 for p in positions], actual, width=0.4, label="actual")
    ax.set_xticks(list(positions), [s.replace(".zarr", "") for s in shards], rotation=45, fontsize=7)
    ax.set(title=f"Hidden-state stores: actual/planned = {disk_report['actual_over_planned']:.3f}", ylabel="MB")
    ax.legend()
    fig.tight_layout()
    reports.write_figure(fig, out)
    plt.close(fig)


def provenance(config: dict[str, Any], training_snapshot: Path, target_dir: Path) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version


    packages = {}
    for name in ("eagle3-pipeline", "snakemake", "torch", "transformers", "zarr", "numcodecs", "safetensors",
                 "tokenizers", "gguf"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    identity = read_identity(target_dir)
    return {"config": config, "training_config": reports.read_yaml(training_snapshot),
            "target": identity, "packages": packages}


def run_facts(config: dict[str, Any], train_summary: dict[str, Any], data_stats: dict[str, Any],
              timing: dict[str, Any], evaluations: dict[str, dict[str, Any]]) -> RunFacts:
    """The front page's line on the run, from the run's own records (the config for its names)."""
    layout = RunLayout.of(config)
    tau_pass = next(iter(evaluations.values()), {})
    eval_device = timing.get("device_name") or timing.get("device") or tau_pass.get("device", "?")
    return RunFacts(run=config["run"], target=str(config["target"]["source"]),
                    conversations=sum(s["num_sequences"] for s in data_stats["shards"].values()),
                    tokens=data_stats["total_tokens"], epochs=config["train"]["epochs"],
                    steps=train_summary["steps"], train_seconds=train_summary.get("train_seconds"),
                    train_device=train_summary.get("device"),
                    eval_device=f"{eval_device}, {config['evaluate']['dtype']}",
                    target_dir=layout.target_dir, drafter_dir=layout.serving_dir)


def run(inputs: Inputs, outputs: Outputs, settings: Settings) -> None:
    evaluations = read_evaluations(inputs.evaluations)
    timing = read_results(inputs.timing)
    train_summary = metrics.read_summary(inputs.summary)
    disk = reports.read(inputs.disk)
    acceptance_figure(evaluations, outputs.acceptance)
    write_tau_table(outputs.tau, evaluations, timing)
    training_figure(inputs.metrics, outputs.training, train_summary)
    disk_figure(disk, outputs.disk)
    reports.write(outputs.provenance, provenance(settings.config, inputs.config_snapshot, inputs.target))
    facts = run_facts(settings.config, train_summary, reports.read(inputs.data_stats), timing, evaluations)
    checked = engine_check.read(inputs.engine_check) if inputs.engine_check else None
    reports.write_html(outputs.front_page, front_page(evaluations, timing, facts, disk, checked))


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    given = snakemake.input
    inputs = Inputs([Path(p) for p in given.evaluations], Path(given.timing), Path(given.metrics),
                    Path(given.summary), Path(given.disk), Path(given.config), Path(given.target),
                    Path(given.data_stats), next(map(Path, given.engine_check), None))
    made = snakemake.output
    outputs = Outputs(Path(made.acceptance), Path(made.tau), Path(made.training), Path(made.disk),
                      Path(made.provenance), Path(made.front_page))
    run(inputs, outputs, Settings(config=dict(snakemake.params.full_config)))
    log.info("wrote %s", ", ".join(snakemake.output))


def run_directory(configs: list[Path]) -> Path:
    """results/<run> of a config (later files override earlier ones, as with snakemake --configfile)."""
    import yaml

    from eagle3_pipeline.config_schema import schema_top_level_default

    config: dict[str, Any] = {}
    for path in configs:
        config |= yaml.safe_load(Path(path).read_text())
    return Path(RunLayout(config.get("results_dir") or schema_top_level_default("results_dir"), config["run"]).root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print tau and speedup per prompt set and method of a run.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("run_dir", nargs="?", type=Path, help="results/<run>")
    where.add_argument("--config", nargs="+", type=Path, help="the run's config file(s), e.g. config/config.yaml")
    args = parser.parse_args(argv)
    run_dir = args.run_dir or run_directory(args.config)
    layout = RunLayout(str(run_dir.parent), run_dir.name)
    paths = sorted(Path(layout.evaluation_dir).glob("*.json"))
    if not paths:
        print(f"{layout.evaluation_dir}: no evaluation results yet", file=sys.stderr)
        return 1
    timing_path = Path(layout.timing_results)
    timing = read_results(timing_path) if timing_path.exists() else {}
    print(f"tau and speedup of {run_dir} (every column: its report/tau_and_speedup.csv)\n\n"
          f"{headline_table(read_evaluations(paths), timing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
