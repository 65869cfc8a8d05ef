"""Rule `engine_check`: the exported drafter served by a real engine (vLLM's offline engine), its acceptance
measured on the tau pass's own prompts and set beside the evaluator's.

vLLM runs once for the target alone and once per draft length, each in a process of its own
(runtime/serving/vllm_offline.py), greedy and one sequence at a time, on the prompt token ids the evaluator
decoded. From vLLM's spec-decode counters: acceptance length (1 + accepted drafts per verify step) and acceptance
by position; the same arithmetic on the evaluator's traces gives ours. The check fails where they differ by more
than `tolerance`: an engine reading the export differently from how it was trained (aux layer ids, d2t offsets,
positions, norms) shows up here, not in our own decoder. Outputs are compared with vLLM's own target-only
outputs (lossless in the engine's precision, or the share that diverged); tokens/s with and without the drafter
come from the same engine build, its start (load, compile, CUDA-graph capture) timed apart.

Resume: each engine's result is kept in `<output>.parts/` under a fingerprint of the drafter, the target and the
job; a rerun after a kill starts only the engines that had not finished.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import engine_comparison, logs
from eagle3_pipeline.formats import engine_check, evaluation, jobs
from eagle3_pipeline.formats import serving_dir as serving_dir_format
from eagle3_pipeline.prompts import load_prompts
from eagle3_pipeline.runtime.methods import TARGET, Method
from eagle3_pipeline.runtime.speculative import encode_prompts
from eagle3_pipeline.settings import from_section, setting


@dataclass(frozen=True)
class Settings:
    NOT_SETTINGS = ("enabled", "threads")  # the rule's switch and the job's size

    engine: str
    prompt_sets: tuple[str, ...] | None = setting(key="prompts", convert=tuple)  # None: every evaluated set
    max_prompts: int | None
    draft_lengths: tuple[int, ...] | None = setting(convert=tuple)  # None: the tau pass's
    cuda_graphs: bool
    dtype: str
    gpu_memory_utilization: float
    tolerance: float
    fail_on_gap: bool
    trust_remote_code: bool


@dataclass(frozen=True)
class EngineJob:
    """One engine's run: `draft_length` None is the target alone."""

    name: str
    draft_length: int | None


def engine_jobs(draft_lengths: tuple[int, ...]) -> list[EngineJob]:
    return [EngineJob(TARGET, None), *(EngineJob(Method("eagle3", k).name, k) for k in draft_lengths)]


def job_fingerprint(target_dir: Path, serving_dir: Path, job: dict[str, Any]) -> str:
    digest = serving_dir_format.drafter_and_target_digest(serving_dir, target_dir)
    digest.update(json.dumps({k: v for k, v in job.items() if k not in ("target_dir", "serving_dir")},
                             sort_keys=True).encode())
    return digest.hexdigest()[:16]


def run_engine(job: dict[str, Any], parts: Path, name: str, fingerprint: str, log: Any) -> dict[str, Any]:
    """The engine's result from `parts/` when an earlier run finished it, else from a fresh process whose output
    goes to the log as it comes (vLLM's start, then a line per prompt set)."""
    stem = name.replace("@", "-").replace("=", "")
    result_path = parts / f"{stem}-{fingerprint}.json"
    if result_path.exists():
        log.info("%s: finished by an earlier run (%s)", name, result_path)
        return engine_check.read_engine_run(result_path)
    for stale in parts.glob(f"{stem}-*.json"):  # another drafter's, target's or job's
        stale.unlink()
    job_path = parts / f"{stem}-{fingerprint}.job"
    jobs.write(job_path, json.dumps(job))
    log.info("%s: starting vLLM (%s)", name, "CUDA graphs" if job["cuda_graphs"] else "eager")
    command = [sys.executable, "-m", "eagle3_pipeline.runtime.serving.vllm_offline", str(job_path), str(result_path)]
    last = "no output"
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout or ():
            if line.strip():
                last = line.strip()
                log.info("[%s] %s", name, last)
    if process.returncode != 0:
        raise logs.ClearError(f"engine_check: vLLM ({name}) failed with exit {process.returncode}: {last} "
                              "(its whole output is in this job's log; finished engines are kept: rerun to resume)")
    job_path.unlink()
    return engine_check.read_engine_run(result_path)


def serve_command(target_dir: Path, serving_dir: Path, k: int) -> str:
    """The `vllm serve` line that serves what the check ran (the README's serving section shows it)."""
    speculative = json.dumps({"method": "eagle3", "model": str(serving_dir), "num_speculative_tokens": k})
    return f"vllm serve {target_dir} --speculative-config {shlex.quote(speculative)}"


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for name, values in result["sets"].items():
        for method, figures in values["methods"].items():
            lines.append(f"{name} {method}: engine {figures['engine_acceptance_length']:.3f} vs evaluator "
                         f"{figures['evaluator_acceptance_length']:.3f} ({figures['gap']:+.1%}) on "
                         f"{figures['judged_on']}; on all prompts {figures['engine_acceptance_length_all']:.3f} vs "
                         f"{figures['evaluator_acceptance_length_all']:.3f}; outputs identical "
                         f"to the engine's target-only {figures['identical_share']:.0%}, "
                         f"{figures['tokens_per_s']:.0f} tokens/s = {figures['speedup_vs_target']:.2f}x the target "
                         f"alone ({values['target']['tokens_per_s']:.0f} tokens/s)")
    return lines


@dataclass(frozen=True)
class Inputs:
    target_dir: Path
    serving_dir: Path
    prompt_files: dict[str, Path]  # by prompt set
    evaluations: dict[str, Path]  # the tau pass's results, by prompt set


@dataclass(frozen=True)
class EvaluatedWith:
    """The tau pass's settings the engine check must decode with (the same prompts and lengths)."""

    max_prompts: int | None
    multi_turn: bool
    max_new_tokens: int
    draft_lengths: tuple[int, ...]


def run(inputs: Inputs, output: Path, settings: Settings, evaluated_with: EvaluatedWith, log: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    evaluations = {name: evaluation.read_results(path) for name, path in inputs.evaluations.items()}
    tokenizer = AutoTokenizer.from_pretrained(inputs.target_dir, trust_remote_code=settings.trust_remote_code)
    limit = min(filter(None, (settings.max_prompts, evaluated_with.max_prompts)), default=None)
    encoded = {name: encode_prompts(tokenizer, load_prompts(path, limit, evaluated_with.multi_turn))
               for name, path in inputs.prompt_files.items()}
    longest = max(len(ids) for prompts in encoded.values() for _, ids in prompts)
    job = {"target_dir": str(inputs.target_dir), "serving_dir": str(inputs.serving_dir), "dtype": settings.dtype,
           "cuda_graphs": settings.cuda_graphs, "gpu_memory_utilization": settings.gpu_memory_utilization,
           "max_new_tokens": evaluated_with.max_new_tokens, "trust_remote_code": settings.trust_remote_code,
           "max_model_len": longest + evaluated_with.max_new_tokens + 16,  # room for a last step's drafts
           "sets": {name: [{"prompt_id": pid, "ids": ids} for pid, ids in prompts]
                    for name, prompts in encoded.items()}}
    parts = Path(f"{output}.parts")
    parts.mkdir(parents=True, exist_ok=True)
    engines = {}
    for engine in engine_jobs(settings.draft_lengths or evaluated_with.draft_lengths):
        one = job | {"draft_length": engine.draft_length}
        engines[engine.name] = run_engine(one, parts, engine.name, job_fingerprint(inputs.target_dir,
                                                                                   inputs.serving_dir, one), log)
    prompt_ids = {name: [pid for pid, _ in prompts] for name, prompts in encoded.items()}
    result = {"engine": settings.engine, "dtype": settings.dtype, "cuda_graphs": settings.cuda_graphs} | \
        engine_comparison.compare(prompt_ids, engines, evaluations, settings.tolerance)
    result["serve_command"] = serve_command(inputs.target_dir, inputs.serving_dir,
                                            max(settings.draft_lengths or evaluated_with.draft_lengths))
    for line in summary_lines(result):
        log.info("%s", line)
    for start, seconds in result["start_seconds"].items():
        log.info("vLLM start (load, compile, capture) for %s: %.1f s", start, seconds)
    return result


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    params = snakemake.params
    settings = from_section(Settings, params.settings, trust_remote_code=params.trust_remote_code)
    evaluated = params.evaluated
    evaluated_with = EvaluatedWith(evaluated["max_prompts"], evaluated["multi_turn"], evaluated["max_new_tokens"],
                                   tuple(evaluated["draft_lengths"]))
    sets = list(params.prompt_sets)
    inputs = Inputs(Path(snakemake.input.target), Path(snakemake.input.serving),
                    dict(zip(sets, map(Path, snakemake.input.prompts), strict=True)),
                    dict(zip(sets, map(Path, snakemake.input.evaluations), strict=True)))
    output = Path(snakemake.output[0])
    result = run(inputs, output, settings, evaluated_with, log)
    kept = output.with_name(output.stem + ".failed.json")  # Snakemake removes a failed job's output; this stays
    if result["passed"] or not settings.fail_on_gap:
        for failure in result["failures"]:
            log.warning("engine check: %s", failure)
        kept.unlink(missing_ok=True)  # an earlier failure's figures, now superseded
        engine_check.write(output, result)
        log.info("engine check %s: %s", "passed" if result["passed"] else "FAILED (fail_on_gap: false)", output)
        return
    engine_check.write(kept, result)
    raise logs.ClearError("engine check failed (figures in " + str(kept) + "):\n  " + "\n  ".join(result["failures"]))
