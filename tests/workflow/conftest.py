"""Helpers of the workflow tests: tiny datasets and configs, the one finished tiny pipeline run that tests reading
its outputs share (`finished_tiny_run`) and cheap copies of it for tests that change a run, runs started in the
background and killed when an event of their own happens (a journal line, a checkpoint, a finished shard), never at
a clock time."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from eagle3_pipeline.formats import journal
from tests.conftest import (
    base_config,
    built_once,
    run_snakemake,
    sharegpt_record,
    snakemake_command,
    tiny_conversations,
    wait_for_event,
)


def tiny_dataset(path: Path, count: int = 40) -> int:
    """A ShareGPT-shaped file with bad records and a truncated tail, like the real package."""
    records = tiny_conversations(count)
    records.insert(3, sharegpt_record("empty", []))
    records.insert(7, sharegpt_record("only_gpt", [("gpt", "hello"), ("gpt", "again")]))
    records.insert(9, sharegpt_record("tool", [("human", "q"), ("function", "x"), ("gpt", "r")]))
    text = json.dumps(records, indent=2)
    path.write_text(text[: len(text) - 80])  # truncated inside the last record
    return count - 1  # conversations that must survive


def tiny_data_config(tmp_path: Path, target_dir: Path, shards: int = 2, **data) -> tuple[dict, int]:
    """The data stage (ingest, tokenize, vocab) on `tiny_dataset`; returns the config and the conversations kept."""
    expected = tiny_dataset(tmp_path / "chats.json")
    config = base_config(run="tiny", target={"source": str(target_dir)},
                         data={"inputs": [str(tmp_path / "chats.json")], "num_shards": shards,
                               "train_conversations": None, "eval_conversations": 4, "max_seq_len": 256, **data},
                         vocab={"draft_vocab_size": 500})
    return config, expected


def tiny_run_config(tmp_path: Path, target_dir: Path) -> dict:
    """The whole pipeline, small enough for CPU: 2 shards, 2 TTT steps, one epoch, 2 prompts per set."""
    tiny_dataset(tmp_path / "chats.json")
    return base_config(**tiny_run_sections(tmp_path / "chats.json", target_dir))


def tiny_run_sections(chats: Path, target_dir: Path) -> dict:
    """What `tiny_run_config` changes in the shipped config (tools/compare_artifacts.py runs it too)."""
    return dict(
        run="tiny", target={"source": str(target_dir)},
        data={"inputs": [str(chats)], "num_shards": 2, "train_conversations": None,
              "eval_conversations": 4, "max_seq_len": 128},
        vocab={"draft_vocab_size": 300},
        extract={"token_budget": 1024, "threads": 2},
        train={"ttt_steps": 2, "epochs": 1, "batch_tokens": 512, "max_seq_len": 128, "warmup_steps": 1,
               "checkpoint_every": 5, "log_every": 1, "num_workers": 0, "threads": 2},
        evaluate={"prompts": ["mtbench-package", "held-out"], "max_prompts": 2, "max_new_tokens": 6,
                  "draft_lengths": [2], "tree": [{"num_steps": 2, "topk": 2, "num_draft_tokens": 4}],
                  "device": "cpu", "workers": 2,
                  "timing": {"prompts": 1, "max_new_tokens": 6}})


class TinyRun(NamedTuple):
    """A workdir holding a tiny pipeline run and the config it ran with (run name "tiny")."""

    workdir: Path
    config: dict

    @property
    def results(self) -> Path:
        return self.workdir / "results" / "tiny"


@pytest.fixture(scope="session")
def finished_tiny_run(tmp_path_factory, target_dir) -> TinyRun:
    """The whole pipeline on `tiny_run_config`, run once per session to its end (every prompt set evaluated and
    timed, the report's inputs written). Tests only read it; a test that changes a run works on `copy_run` of it."""
    with built_once(tmp_path_factory, "finished-tiny-run") as (workdir, built):
        if not built:
            run_snakemake(workdir, tiny_run_config(workdir, target_dir))
    return TinyRun(workdir, base_config(**tiny_run_sections(workdir / "chats.json", target_dir)))


@pytest.fixture(scope="session")
def finished_tiny_run_report(finished_tiny_run, tmp_path_factory) -> Path:
    """`snakemake --report` of `finished_tiny_run`, built once (it writes nothing inside the run)."""
    with built_once(tmp_path_factory, "tiny-report") as (folder, built):
        if not built:
            run_snakemake(finished_tiny_run.workdir, finished_tiny_run.config, "--report", str(folder / "report.html"))
    return folder / "report.html"


def copy_run(run: TinyRun, destination: Path, drop: tuple[str, ...] = ()) -> TinyRun:
    """A copy of `run` at `destination` (file times and Snakemake's metadata kept, so nothing reruns), with the
    paths in `drop` (relative to the workdir) removed, as if those jobs had never run; its config is a deep copy.
    Files the pipeline already shares by hard link (the target's weights, linked from their source) are linked
    again rather than copied: nothing writes them in place."""
    shutil.copytree(run.workdir, destination, symlinks=True, copy_function=link_if_shared)
    for relative in drop:
        path = destination / relative
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return TinyRun(destination, copy.deepcopy(run.config))


def link_if_shared(source: str, destination: str) -> None:
    if os.stat(source).st_nlink > 1:
        os.link(source, destination)
    else:
        shutil.copy2(source, destination)


def incomplete_marker(workdir: Path, output: str) -> Path:
    """Snakemake's flag for an output whose job has not finished (it stays when Snakemake is killed)."""
    return workdir / ".snakemake" / "incomplete" / base64.b64encode(output.encode()).decode()


def journal_records(path: Path) -> list:
    """The intact records of a job's resume journal; none while it is not there (not yet, or not any more)."""
    try:
        return journal.read_intact(path)[0]
    except FileNotFoundError:
        return []


def json_file(path: Path) -> dict | None:
    """A JSON file a running job replaces atomically, or None while it is not there."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def start_snakemake(workdir: Path, config: dict, *args: str) -> subprocess.Popen:
    """The real CLI in its own process group, so that one kill takes Snakemake and all its jobs."""
    return subprocess.Popen(snakemake_command(workdir, config, *args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def kill_when(process: subprocess.Popen, event: str, happened: Callable[[], bool]) -> None:
    """SIGKILL the run (Snakemake and its jobs) as soon as `happened()` or the run ended by itself; the caller
    then asserts the kill landed where it wanted. Slow machines only take longer to get there."""
    try:
        wait_for_event(event, happened, process)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the run (and all its jobs) ended already
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
