"""Run the tiny workflow at two git commits and compare what they wrote: a check that a refactor kept behaviour.

Each commit is checked out in its own temporary clone and run with this checkout's .venv (the clone's own `src/`
first on PYTHONPATH, as its Snakefile sets it): first the `target` rule as the tests' `target_dir` fixture runs
it, then the whole pipeline on the tiny config of the workflow tests (tests/workflow/conftest.py,
`tiny_run_sections`, over the commit's own config/config.yaml). Both runs use the same absolute paths, one after
the other, so nothing differs by where it ran.

One line per artifact under results/: data artifacts (conversation shards, token shards, hidden stores' chunks,
the draft vocab, the target copy) must be byte-identical; weights (safetensors, checkpoints) `torch.equal`;
JSON, YAML and CSV equal apart from timing fields (seconds, tokens/s, speedups, ETA). Exit status 1 on any
difference or any artifact only one side wrote.

    .venv/bin/python tools/compare_artifacts.py BASE [HEAD] [--keep DIR]
    .venv/bin/python tools/compare_artifacts.py --results BASE_RESULTS HEAD_RESULTS   (compare kept runs again)
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' tiny config is the input: one definition, in tests/

from tests.conftest import base_config  # noqa: E402
from tests.workflow.conftest import tiny_dataset, tiny_run_sections  # noqa: E402

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
TIMING = re.compile(r"seconds|per_s\b|_ms\b|ms_per|speedup|eta_s|tflops|elapsed|timestamp")
BYTE_IDENTICAL_STAGES = {"conversations", "regenerated", "tokens", "vocab", "target"}


# ---------------------------------------------------------------- running one commit

def checkout(commit: str, clone: Path) -> str:
    """A clone of this repository at `commit` (objects shared, nothing copied); returns the full hash."""
    subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", "--detach", commit], check=True)
    return subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def snakemake(clone: Path, workdir: Path, config: dict, *targets: str) -> None:
    config_path = workdir / "compare_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = os.environ | {"PYTHONPATH": str(clone / "src"), "PYTHONUNBUFFERED": "1"}
    command = [SNAKEMAKE, "--snakefile", str(clone / "Snakefile"), "--directory", str(workdir), "--configfile",
               str(config_path), "--workflow-profile", str(clone / "profiles" / "default"), "--cores", "2", *targets]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"snakemake failed in {clone} ({' '.join(targets) or 'all'}):\n{result.stderr[-4000:]}")


def run_commit(commit: str, scratch: Path) -> tuple[str, Path]:
    """Run the tiny workflow at `commit` in scratch/repo + scratch/work; returns the hash and its results."""
    clone, workdir = scratch / "repo", scratch / "work"
    workdir.mkdir(parents=True)
    full = checkout(commit, clone)
    defaults = clone / "config" / "config.yaml"
    snakemake(clone, workdir, base_config(defaults, run="target"), "results/target/target")
    tiny_dataset(workdir / "chats.json")
    snakemake(clone, workdir, base_config(defaults, **tiny_run_sections(workdir / "chats.json",
                                                                       workdir / "results/target/target")))
    return full, workdir / "results"


# ---------------------------------------------------------------- comparing what two runs wrote

def without_timing(value: Any, dropped: set[str]) -> Any:
    """`value` with every dict key that names a timing figure removed (their names collected in `dropped`)."""
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            if TIMING.search(str(key)):
                dropped.add(str(key))
            else:
                kept[key] = without_timing(item, dropped)
        return kept
    if isinstance(value, list):
        return [without_timing(item, dropped) for item in value]
    return value


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{where or '/'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{where}/{key}: only in {'head' if key not in a else 'base'}"
            found = first_difference(a[key], b[key], f"{where}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
        return next((f for i, (x, y) in enumerate(zip(a, b, strict=True))
                     if (f := first_difference(x, y, f"{where}[{i}]"))), None)
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return None if same else f"{where}: tensors differ"
    return None if a == b else f"{where}: {str(a)[:60]!r} vs {str(b)[:60]!r}"


def structured(path: Path) -> Any:
    """The file's content as Python values, or None where bytes are all there is to compare."""
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix in (".yaml", ".yml"):
        return yaml.safe_load(path.read_text())
    if path.suffix == ".csv":  # as a list of column -> value rows, so timing columns drop out by name
        return list(csv.DictReader(io.StringIO(path.read_text())))
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata()
        return {"metadata": metadata, "tensors": load_file(str(path))}
    if path.suffix == ".pt":
        return torch.load(path, map_location="cpu", weights_only=True)
    return None


# Fields that differ between two runs of the same commit, each for a known reason (reported when dropped).
RUN_TO_RUN = {
    "checkpoint.pt": ("rng", "python"),  # Python's RNG state is saved for resume but never seeded (and unused)
    "fingerprint.json": ("draft_vocab",),  # the vocab file's sha256: see UNORDERED_HEADER
}
# safetensors writes `metadata` in a random order (a Rust HashMap), so a file with more than one metadata key
# (the draft vocab) differs in its header bytes between runs of the same commit; its content is compared instead.
UNORDERED_HEADER = "tensors and metadata equal, header bytes differ (safetensors orders metadata randomly)"


def without_run_to_run(name: str, values: Any, dropped: set[str]) -> Any:
    path = RUN_TO_RUN.get(name)
    if path is None or not isinstance(values, dict):
        return values
    inner = values
    for key in path[:-1]:
        inner = inner.get(key) if isinstance(inner, dict) else None
    if isinstance(inner, dict) and path[-1] in inner:
        inner.pop(path[-1])
        dropped.add("/".join(path) + " (run-to-run)")
    return values


def compare_file(a: Path, b: Path, bytes_only: bool, dropped: set[str]) -> tuple[str | None, str]:
    """(difference or None, how they were found equal)."""
    if a.read_bytes() == b.read_bytes():
        return None, "byte-identical"
    if bytes_only and a.suffix != ".safetensors":
        return f"{a.name}: bytes differ", ""
    values = structured(a)
    if values is None:
        return f"{a.name}: bytes differ", ""
    cleaned = [without_timing(without_run_to_run(a.name, v, dropped), dropped) for v in (values, structured(b))]
    difference = first_difference(*cleaned)
    if bytes_only:
        how = UNORDERED_HEADER
    else:
        how = "torch.equal" if a.suffix in (".safetensors", ".pt") else "equal apart from timing"
    return (f"{a.name}{difference}" if difference else None), how


def compare_artifact(a: Path, b: Path, stage: str) -> tuple[str | None, str]:
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} if a.is_dir() else {Path()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()} if b.is_dir() else {Path()}
    if files_a != files_b:
        return f"files differ: only base {sorted(map(str, files_a - files_b))[:3]}, " \
               f"only head {sorted(map(str, files_b - files_a))[:3]}", ""
    ways: dict[str, int] = {}
    dropped: set[str] = set()
    for relative in sorted(files_a):
        if (a / relative).suffix == ".log":  # a job's log kept beside its state: timings and paths, not results
            ways["skipped (log)"] = ways.get("skipped (log)", 0) + 1
            continue
        chunk = "c" in relative.parts  # a zarr chunk file (arrays/<name>/c/...)
        bytes_only = stage in BYTE_IDENTICAL_STAGES or (stage == "hidden" and chunk)
        difference, how = compare_file(a / relative, b / relative, bytes_only, dropped)
        if difference:
            return (difference if relative == Path() else f"{relative.parent}/{difference}"), ""
        ways[how] = ways.get(how, 0) + 1
    summary = ", ".join(f"{how} ({count} file{'s' * (count > 1)})" for how, count in sorted(ways.items()))
    return None, summary + (f" (ignored: {', '.join(sorted(dropped))})" if dropped else "")


def artifacts(results: Path) -> set[Path]:
    """results/<run>/<stage>/<name> for every run and stage; a zarr store, a directory and a stage that is one
    directory output (the target copy) each count as one."""
    found = set()
    for stage in (stage for run in results.iterdir() for stage in run.iterdir() if stage.is_dir()):
        if (stage / ".snakemake_timestamp").exists():
            found.add(stage.relative_to(results))
        else:
            found |= {p.relative_to(results) for p in stage.iterdir() if not p.name.endswith(".partial")}
    return found


def compare(base: Path, head: Path) -> int:
    differences = 0
    for relative in sorted(artifacts(base) | artifacts(head)):
        a, b = base / relative, head / relative
        if not (a.exists() and b.exists()):
            differences += 1
            print(f"DIFF  {relative}: only in {'base' if a.exists() else 'head'}")
            continue
        difference, how = compare_artifact(a, b, relative.parts[1])
        differences += difference is not None
        print(f"DIFF  {relative}: {difference}" if difference else f"same  {relative}: {how}")
    return differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the commit before the change, e.g. 19445b5")
    parser.add_argument("head", nargs="?", default="HEAD", help="the commit after it (default: HEAD)")
    parser.add_argument("--keep", type=Path, help="move both runs' clones and results here instead of deleting")
    parser.add_argument("--results", action="store_true",
                        help="BASE and HEAD are results/ directories of earlier runs (e.g. kept): only compare")
    args = parser.parse_args(argv)
    if args.results:
        differences = compare(Path(args.base), Path(args.head))
        print(f"{differences} artifact(s) differ" if differences else "all artifacts equal")
        return 1 if differences else 0
    scratch = Path(tempfile.mkdtemp(prefix="compare-artifacts-"))
    runs = {}
    try:
        for label, commit in (("base", args.base), ("head", args.head)):
            full, _ = run_commit(commit, scratch / "run")
            (scratch / "run").rename(scratch / label)  # the next run gets the same paths
            runs[label] = full
            print(f"{label}: {full}", flush=True)
        differences = compare(scratch / "base" / "work" / "results", scratch / "head" / "work" / "results")
    finally:
        if args.keep:
            shutil.move(str(scratch), str(args.keep))
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"{differences} artifact(s) differ between {runs['base'][:9]} and {runs['head'][:9]}" if differences
          else f"all artifacts equal between {runs['base'][:9]} and {runs['head'][:9]}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
