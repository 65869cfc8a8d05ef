"""Rule `evaluate` (the tau pass): speculative decoding on one prompt set with the exported drafter and the
baselines (runtime/speculative.py), optionally in worker processes sharing the device.

Resume: every finished prompt (all its methods' traces) is appended to `<output>.progress/`; a rerun after a
kill decodes only the prompts not there. A fingerprint of the drafter's weights, the target and the
output-defining settings guards it: anything else changed starts over.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline import logs
from eagle3_pipeline.formats import evaluation, jobs, journal
from eagle3_pipeline.formats import serving_dir as serving_dir_format
from eagle3_pipeline.prompts import Prompt, load_prompts
from eagle3_pipeline.runtime.drafting import load_models
from eagle3_pipeline.runtime.methods import Method, TreeSetting, parse_settings
from eagle3_pipeline.runtime.speculative import Trace, decode_all, summarise_methods
from eagle3_pipeline.runtime.target.devices import pick_device
from eagle3_pipeline.runtime.traces import vocabulary_stops
from eagle3_pipeline.settings import from_section, setting


@dataclass(frozen=True)
class Settings:
    max_prompts: int | None
    multi_turn: bool
    max_new_tokens: int
    draft_lengths: tuple[int, ...] = setting(convert=tuple)
    device: str
    dtype: str
    untrained_baseline: bool
    workers: int
    compile: str | bool
    trust_remote_code: bool
    trees: tuple[TreeSetting, ...] = setting(key="tree", convert=parse_settings)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> Settings:
        return cls(**(values | {"draft_lengths": tuple(values["draft_lengths"]),
                                "trees": parse_settings(values["trees"])}))


def prompt_digest(prompt: Prompt) -> str:
    return hashlib.sha256(json.dumps(prompt.messages, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(target_dir: Path, serving_dir: Path, settings: Settings) -> str:
    """What decides the traces: the drafter's files, the target and the output-defining settings."""
    digest = serving_dir_format.drafter_and_target_digest(serving_dir, target_dir)
    defining = {key: getattr(settings, key)
                for key in ("dtype", "max_new_tokens", "draft_lengths", "untrained_baseline")}
    defining["trees"] = [tree.as_dict() for tree in settings.trees]
    digest.update(json.dumps(defining, sort_keys=True).encode())
    return digest.hexdigest()[:24]


class PromptProgress:
    """`<output>.progress/`: a fingerprint file and one append-only JSONL file per writing process (workers
    never share a file, so lines cannot interleave). A torn last line (a kill mid-write) is ignored."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    @classmethod
    def started(cls, directory: Path, fingerprint: str, log: Any) -> PromptProgress:
        """The directory for this fingerprint, emptied if another drafter, target or settings wrote it. Only the
        job's own process calls this, before any worker starts: workers open it as it is (one worker's check,
        reading the stamp while another rewrote it, once emptied it under the others' feet)."""
        progress = cls(directory)
        if progress.directory.exists() and journal.read_stamp(progress.directory) != fingerprint:
            log.warning("%s: written for another drafter, target or settings; starting over", directory)
            shutil.rmtree(progress.directory)
        progress.directory.mkdir(parents=True, exist_ok=True)
        journal.write_stamp(progress.directory, fingerprint)
        return progress

    def finished(self, prompts: list[Prompt]) -> dict[str, dict[str, Trace]]:
        """Traces by prompt id, for prompts whose text is unchanged."""
        digests = {p.prompt_id: prompt_digest(p) for p in prompts}
        done: dict[str, dict[str, Trace]] = {}
        for part in sorted(self.directory.glob("*.jsonl")):
            for record in journal.read_intact(part)[0]:
                if digests.get(record["prompt_id"]) == record["digest"]:
                    done[record["prompt_id"]] = {m: Trace(**t) for m, t in record["traces"].items()}
        return done

    def appender(self, prompts: list[Prompt]) -> Callable[[dict[str, Trace]], None]:
        """A callback for decode_all writing this process's own file, flushed to disk per prompt."""
        digests = {p.prompt_id: prompt_digest(p) for p in prompts}
        path = self.directory / f"{os.getpid()}-{time.time_ns()}.jsonl"

        def append(traces: dict[str, Trace]) -> None:
            prompt_id = traces["target"].prompt_id
            record = {"prompt_id": prompt_id, "digest": digests[prompt_id],
                      "traces": {m: asdict(t) for m, t in traces.items()}}
            with open(path, "a", encoding="utf-8") as handle:
                journal.append(handle, [record])
        return append


def worker_main(job_path: Path) -> None:
    """One worker process: `python -m eagle3_pipeline.stages.evaluate JOB.json` (see run_job). Its traces go to
    the progress directory, prompt by prompt."""
    job = json.loads(jobs.read(job_path))
    torch.set_num_threads(job["threads"])
    log = logs.setup(job["log"], name=f"evaluate.worker{job['index']}", append=True)
    prompts = [Prompt(**p) for p in job["prompts"]]
    progress = PromptProgress(Path(job["progress_dir"]))  # started by the job's process
    _decode(Path(job["target_dir"]), Path(job["serving_dir"]), prompts, Settings.from_json(job["settings"]),
            progress, log, claimer(Path(job["claims"])))


def claimer(directory: Path) -> Callable[[int], bool]:
    """Workers share one list of prompts and take them as they come free: prompt i is decoded by the worker that
    creates `directory/i` first (O_EXCL: exactly one does). A fixed split could leave a worker idle while the
    other decodes a long prompt (a minute of one core in the CPU default's held-out set)."""
    def claim(index: int) -> bool:
        try:
            os.close(os.open(directory / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True
    return claim


def _decode(target_dir: Path, serving_dir: Path, prompts: list[Prompt], settings: Settings,
            progress: PromptProgress, log: Any, claim: Callable[[int], bool] | None = None) -> None:
    target, tokenizer, drafters = load_models(target_dir, serving_dir, settings.device, settings.dtype,
                                              settings.untrained_baseline, settings.compile,
                                              settings.trust_remote_code, log)
    decode_all(target, tokenizer, prompts, drafters, list(settings.draft_lengths), settings.max_new_tokens, log,
               on_prompt=progress.appender(prompts), strict=settings.dtype == "float32", trees=settings.trees,
               claim=claim)


def _run_workers(job: dict[str, Any], prompts: list[Prompt], workers: int) -> None:
    """Plain subprocesses (not multiprocessing: its spawn re-runs the rule's script in every child)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="evaluate-") as scratch:
        running = []
        (Path(scratch) / "claims").mkdir()  # this run's claims: prompts a killed run claimed are decoded again
        for i in range(workers):
            job_path = Path(scratch) / f"job{i}.json"
            jobs.write(job_path, json.dumps({**job, "index": i, "prompts": [asdict(p) for p in prompts],
                                            "claims": str(Path(scratch) / "claims"),
                                            "threads": max(1, torch.get_num_threads() // workers)}))
            running.append(subprocess.Popen([sys.executable, "-m", "eagle3_pipeline.stages.evaluate", str(job_path)]))
        failed = [i for i, process in enumerate(running) if process.wait() != 0]
    if failed:
        raise RuntimeError(f"evaluation workers {failed} failed; their errors are in {job['log']} "
                           "(finished prompts are kept: rerun to resume)")


def run_job(target_dir: Path, serving_dir: Path, prompts: list[Prompt], settings: Settings, log_path: str,
            log: Any, progress_dir: Path) -> dict[str, Any]:
    """Evaluate; with `settings.workers > 1`, that many processes sharing the device take the prompts in turn.

    Decoding a small target is bound by Python and kernel launches, not by the GPU, so workers scale almost
    linearly; each worker times every method on its own prompts under the same load, so ratios stay fair.
    Prompts finished by an earlier, killed run (in `progress_dir`) are not decoded again."""
    stamp = fingerprint(target_dir, serving_dir, settings)
    progress = PromptProgress.started(progress_dir, stamp, log)
    already = progress.finished(prompts)
    todo = [p for p in prompts if p.prompt_id not in already]
    if len(todo) < len(prompts):
        log.info("resuming: %d of %d prompts already decoded (%s)", len(prompts) - len(todo), len(prompts),
                 progress_dir)
    workers = min(settings.workers, len(todo))
    if workers == 1:
        _decode(target_dir, serving_dir, todo, settings, progress, log)
    elif workers > 1:
        job = {"target_dir": str(target_dir), "serving_dir": str(serving_dir), "settings": asdict(settings),
               "log": log_path, "progress_dir": str(progress_dir)}
        _run_workers(job, todo, workers)
    finished = progress.finished(prompts)
    missing = [p.prompt_id for p in prompts if p.prompt_id not in finished]
    if missing:
        raise RuntimeError(f"{progress_dir}: no traces for prompts {missing[:5]} after decoding")
    by_method: dict[str, list[Trace]] = {}
    for prompt in prompts:
        for method, trace in finished[prompt.prompt_id].items():
            by_method.setdefault(method, []).append(trace)
    summary = summarise_methods(by_method, log)
    add_vocabulary_stops(summary, by_method, serving_dir, log)
    return {"pass": "tau", "about": TAU_PASS_ABOUT, "summary": summary,
            "workers": max(workers, 1), "device": pick_device(settings.device),
            "traces": [asdict(t) | {"tau": t.tau} for traces in by_method.values() for t in traces]}


def add_vocabulary_stops(summary: dict[str, Any], by_method: dict[str, list[Trace]], serving_dir: Path,
                         log: Any) -> None:
    """Each EAGLE-3 method's share of verify steps stopped by the draft vocabulary (`vocabulary_stops`)."""
    in_draft = serving_dir_format.draft_vocabulary_mask(serving_dir)
    for method, traces in by_method.items():
        if Method.parse(method).drafter:
            share = summary[method]["vocabulary_stops"] = vocabulary_stops(traces, in_draft)
            log.info("%s: %.1f %% of verify steps stopped at a target token outside the draft vocabulary", method,
                     100 * share)


TAU_PASS_ABOUT = ("tau pass: tau, acceptance by position and divergence from every prompt, decoded by parallel "
                  "workers; its per-trace seconds are contended and not a speed measurement (speeds: the timing "
                  "pass)")


def run(target_dir: Path, serving_dir: Path, prompt_file: Path, output: Path, settings: Settings, log_path: str,
        log: Any) -> dict[str, Any]:
    prompts = load_prompts(prompt_file, settings.max_prompts, settings.multi_turn)
    log.info("evaluating %d prompts from %s on %s (%s), k in %s, trees %s, %d worker process(es)", len(prompts),
             prompt_file, settings.device, settings.dtype, list(settings.draft_lengths),
             [tree.as_dict() for tree in settings.trees], settings.workers)
    progress_dir = output.with_name(output.name + ".progress")  # beside the output: kept when the job is killed
    results = run_job(target_dir, serving_dir, prompts, settings, log_path, log, progress_dir)
    results["prompt_file"] = str(prompt_file)
    evaluation.write_results(output, results)
    shutil.rmtree(progress_dir)
    return results


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    torch.set_num_threads(snakemake.threads)
    settings = from_section(Settings, snakemake.params.settings, trust_remote_code=snakemake.params.trust_remote_code)
    run(Path(snakemake.input.target), Path(snakemake.input.serving), Path(snakemake.input.prompts),
        Path(snakemake.output[0]), settings, snakemake.log[0], log)


if __name__ == "__main__":
    import sys

    worker_main(Path(sys.argv[1]))
