"""The report's table and figures from a hand-made results directory: the headline table `make run` prints and
the CSV carry the tau pass's tau and the timing pass's speeds (empty where a method was not timed); each figure
is a real PNG with one panel per prompt set (or per training view) and the plotted lines in it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from eagle3_pipeline.formats import evaluation
from eagle3_pipeline.reporting import terminal
from eagle3_pipeline.stages import plots

DPI = 110  # plots.py saves every figure at this resolution
LINE_BLUE = np.array([0x1F, 0x77, 0xB4]) / 255  # matplotlib's first line colour


def method(tau: float | None, rates: list[float] | None = None, diverged: float = 0.0) -> dict:
    values = {"prompts": 2, "tokens": 40}
    if tau is not None:
        values |= {"k": 2, "tau": tau, "acceptance_by_position": rates, "diverged_share": diverged}
    return values


def speed(tokens_per_s: float, speedup: float, loop: str | None = None) -> dict:
    values = {"tokens_per_s": tokens_per_s, "speedup_vs_target": speedup, "draft_ms_per_step": 1.5,
              "verify_ms_per_step": 20.25, "prompts": 1}
    return values | ({"loop": loop} if loop else {})  # no loop: a timing.json from before the device-resident loops


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "results" / "tiny"
    (run / "evaluation").mkdir(parents=True)
    for name, tau in (("mtbench-package", 2.5), ("held-out", 1.75)):
        summary = {"target": method(None), "eagle3@k=2": method(tau, [0.8, 0.5], diverged=0.5),
                   "prompt-lookup@k=2": method(1.125, [0.25, 0.1])}
        (run / "evaluation" / f"{name}.json").write_text(json.dumps({"summary": summary, "traces": []}))
    (run / "timing").mkdir()
    (run / "timing" / "timing.json").write_text(json.dumps({"pass": "timing", "sets": {
        "mtbench-package": {"target": speed(10.0, 1.0), "eagle3@k=2": speed(21.0, 2.1, "device")},
        "held-out": {"target": speed(12.0, 1.0)}}}))
    return run


def table_rows(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    """The headline's table rows by (prompt set, method): each set's title line, then a header and its rows."""
    rows, prompt_set = {}, None
    for line in lines:
        if line and not line.startswith(" ") and ": tau over " in line:
            prompt_set = line.split(":")[0]
        elif prompt_set and line.startswith("  ") and line.split()[0] != "method":
            cells = line.split()
            rows[prompt_set, cells[0]] = cells[1:]
        elif not line:
            prompt_set = None
    return rows


def test_the_headline_table_shows_tau_and_the_timed_speedups(run_dir, capsys):
    assert plots.main([str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"tau and speedup of {run_dir}")
    assert "mtbench-package: tau over 2 prompts (tau pass), speeds over 1 (timing pass)" in lines
    rows = table_rows(lines)
    assert set(rows) == {(s, m) for s in ("mtbench-package", "held-out")
                         for m in ("target", "eagle3@k=2", "prompt-lookup@k=2")}
    # tau, speedup, tokens/s, draft and verify ms per step, divergence share
    assert rows["mtbench-package", "eagle3@k=2"] == ["2.500", "2.10x", "21.0", "1.5", "20.2", "50%"]
    assert rows["mtbench-package", "target"] == ["1.000", "1.00x", "10.0", "1.5", "20.2", "0%"]
    assert rows["held-out", "eagle3@k=2"] == ["1.750", "-", "-", "-", "-", "50%"]  # not timed
    assert rows["held-out", "prompt-lookup@k=2"] == ["1.125", "-", "-", "-", "-", "0%"]
    verdicts = lines[lines.index(next(line for line in lines if line.startswith("Verdict"))) + 1:]
    assert verdicts[0] == ("  held-out: Not timed: eagle3@k=2, tau 1.75 (the highest tau); the timing pass did not "
                           "time it, so its speed is unknown")
    assert verdicts[1] == "  mtbench-package: Serve: eagle3@k=2, tau 2.50: 2.10x the target alone"


def test_the_run_directory_of_the_shipped_config_takes_results_dir_from_the_schema(tmp_path):
    """`make run` ends with `plots --config config/config.yaml`, which leaves results_dir to the schema."""
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("run: other\n")
    shipped = Path(__file__).resolve().parents[2] / "config" / "config.yaml"
    assert plots.run_directory([shipped]) == Path("results/smollm2-default")
    assert plots.run_directory([shipped, overlay]) == Path("results/other")
    overlay.write_text("run: other\nresults_dir: /scratch/runs\n")
    assert plots.run_directory([shipped, overlay]) == Path("/scratch/runs/other")


def test_the_headline_without_results_says_where_it_looked(tmp_path, capsys):
    assert plots.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == f"{tmp_path / 'evaluation'}: no evaluation results yet"


def test_the_csv_table_has_one_row_per_set_and_method(run_dir, tmp_path):
    evaluations = evaluation.read_evaluations(sorted((run_dir / "evaluation").glob("*.json")))
    timing = json.loads((run_dir / "timing" / "timing.json").read_text())
    evaluation.write_tau_table(tmp_path / "tau.csv", evaluations, timing)
    rows = list(csv.DictReader((tmp_path / "tau.csv").open()))
    assert len(rows) == 6 and list(rows[0]) == list(evaluation.TAU_COLUMNS)
    eagle3 = next(r for r in rows if (r["prompt_set"], r["method"]) == ("mtbench-package", "eagle3@k=2"))
    assert eagle3["tau (tau pass)"] == "2.500" and eagle3["speedup_vs_target (timing pass)"] == "2.100"
    untimed = next(r for r in rows if (r["prompt_set"], r["method"]) == ("held-out", "prompt-lookup@k=2"))
    assert untimed["tokens_per_s (timing pass)"] == "" and untimed["tau (tau pass)"] == "1.125"


def test_eagle3_settings_carry_their_sglang_flags_in_the_csv_and_below_the_headline(tmp_path):
    tree, flags = "eagle3-tree(steps=5,topk=4,tokens=8)", ("--speculative-num-steps 5 --speculative-eagle-topk 4 "
                                                            "--speculative-num-draft-tokens 8")
    summary = {"target": method(None), "prompt-lookup@k=2": method(1.2, [0.2, 0.1]),
               tree: method(2.75, [0.9, 0.6]) | {"sglang_flags": flags}}
    evaluations = {"mtbench-package": {"summary": summary}}
    evaluation.write_tau_table(tmp_path / "tau.csv", evaluations, {})
    rows = {r["method"]: r for r in csv.DictReader((tmp_path / "tau.csv").open())}
    assert rows[tree]["sglang_flags"] == flags and rows["prompt-lookup@k=2"]["sglang_flags"] == ""
    table, _, below = terminal.headline_table(evaluations, {}).partition("\nSGLang: ")
    assert tree in table and "--speculative" not in table
    assert below.splitlines()[2:4] == [f"  {tree}", f"      {flags}"]


def test_the_headline_warns_when_compiled_steps_ran_without_cuda_graphs():
    evaluations = {"mtbench-package": {"summary": {"target": method(None)}}}
    timing = {"sets": {"mtbench-package": {"target": speed(10.0, 1.0)}}}
    assert "WARNING" not in terminal.headline_table(evaluations, timing | {"compiled_steps_without_cuda_graphs": 0})
    warned = terminal.headline_table(evaluations, timing | {"compiled_steps_without_cuda_graphs": 2})
    assert "\n\nWARNING: 2 compiled step(s) of the timing pass ran without CUDA graphs" in warned


SGLANG_DEFAULT_TREES = [(3, 1, 4), (5, 4, 8), (5, 8, 32), (6, 10, 64)]


def realistic_results() -> tuple[dict, dict]:
    """A GPU example's results: three prompt sets, chains at k=4 and 7, four trees, baselines, every method but
    the untrained baseline timed, and a warning about CUDA graphs."""
    evaluations, timing = {}, {"compiled_steps_without_cuda_graphs": 3, "sets": {}}
    for index, name in enumerate(("mtbench-package", "held-out", "instruction-following-heldback")):
        summary = {"target": method(None)}
        speeds = {"target": speed(812.3, 1.0, "device")}
        for k in (4, 7):
            summary[f"prompt-lookup@k={k}"] = method(1.3 + index / 10, [0.2] * k)
            summary[f"eagle3@k={k}"] = method(2.0 + k / 10, [0.7] * k) | {"k": k, "sglang_flags": (
                f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")}
            summary[f"eagle3-untrained@k={k}"] = method(1.01, [0.01] * k, diverged=0.125)
            speeds |= {f"prompt-lookup@k={k}": speed(1004.5, 1.237), f"eagle3@k={k}": speed(1480.25, 1.822, "device")}
        for steps, topk, tokens in SGLANG_DEFAULT_TREES:
            tree = f"eagle3-tree(steps={steps},topk={topk},tokens={tokens})"
            summary[tree] = method(2.0 + topk / 10, [0.8] * steps) | {"sglang_flags": (
                f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} "
                f"--speculative-num-draft-tokens {tokens}")}
            speeds[tree] = speed(1725.75 - tokens, 2.125 - tokens / 100)
        evaluations[name] = {"summary": summary}
        timing["sets"][name] = speeds
    return evaluations, timing


def test_the_headline_of_a_realistic_run_fits_a_120_column_terminal_and_the_csv_keeps_every_column(tmp_path):
    evaluations, timing = realistic_results()
    text = terminal.headline_table(evaluations, timing)
    too_wide = [line for line in text.splitlines() if len(line) > 120]
    assert not too_wide, "\n".join(too_wide)
    rows = table_rows(text.splitlines())
    assert len(rows) == 3 * 11  # every method of every set, each on one line
    assert rows["held-out", "eagle3-tree(steps=6,topk=10,tokens=64)"] == ["3.000", "1.48x", "1661.8", "1.5", "20.2",
                                                                          "0%"]
    assert "  eagle3-tree(steps=6,topk=10,tokens=64)" in text.splitlines()
    assert text.splitlines()[-4].endswith("with K in [4, 7]")  # vLLM serves the chains
    evaluation.write_tau_table(tmp_path / "tau.csv", evaluations, timing)
    written = list(csv.DictReader((tmp_path / "tau.csv").open()))
    assert len(written) == 33 and list(written[0]) == list(evaluation.TAU_COLUMNS)
    tree = next(r for r in written if r["method"] == "eagle3-tree(steps=6,topk=10,tokens=64)")
    assert tree["sglang_flags"].endswith("--speculative-num-draft-tokens 64") and tree["loop (timing pass)"] == "host"


def png(path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(str(path))[..., :3]


def blue_pixels(image: np.ndarray) -> int:
    return int((np.abs(image - LINE_BLUE).max(axis=-1) < 0.05).sum())


def test_the_acceptance_figure_has_a_panel_per_prompt_set(run_dir, tmp_path):
    evaluations = evaluation.read_evaluations(sorted((run_dir / "evaluation").glob("*.json")))
    plots.acceptance_figure(evaluations, tmp_path / "acceptance.png")
    image = png(tmp_path / "acceptance.png")
    assert image.shape[:2] == (4 * DPI, 2 * 6 * DPI)
    left, right = image[:, : image.shape[1] // 2], image[:, image.shape[1] // 2:]
    assert blue_pixels(left) > 200 and blue_pixels(right) > 200  # eagle3's line in both panels


def metrics_csv(path, steps: int = 6) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "lr", "loss", "acc_0", "acc_1"])
        for step in range(1, steps + 1):
            writer.writerow([step, 1e-3, 5.0 / step, 0.1 * step / steps, 0.05 * step / steps])


@pytest.mark.parametrize("with_estimate", [False, True])
def test_the_training_figure_adds_the_held_out_panel_when_there_is_an_estimate(tmp_path, with_estimate):
    metrics_csv(tmp_path / "metrics.csv")
    estimate = {"by_epoch": [{"epoch": 1, "tau_k2": 1.4}, {"epoch": 2, "tau_k2": 1.6}],
                "kept": {"epoch": 2}, "selected_by": "tau_k2"}
    summary = {"heldout_estimate": estimate} if with_estimate else {}
    plots.training_figure(tmp_path / "metrics.csv", tmp_path / "training.png", summary)
    image = png(tmp_path / "training.png")
    assert image.shape[:2] == (4 * DPI, (18 if with_estimate else 12) * DPI)
    assert blue_pixels(image[:, : image.shape[1] // 3]) > 100  # the loss curve


def test_the_disk_figure_compares_planned_and_actual_per_shard(tmp_path):
    shards = {f"shard-0000{i}.zarr": {"planned_bytes": 4e6, "actual_bytes": 3.6e6} for i in range(3)}
    plots.disk_figure({"shards": shards, "actual_over_planned": 0.9}, tmp_path / "disk.png")
    image = png(tmp_path / "disk.png")
    assert image.shape[:2] == (4 * DPI, 6 * DPI)
    assert blue_pixels(image) > 10_000  # the planned bars (the legend alone has a few hundred)
