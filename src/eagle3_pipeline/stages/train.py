"""Rule `train`: the drafter trained on the hidden-state stores, in this process or one torchrun process per
GPU; resumes from train_state/ after a kill. The loop is training/loop.py, resume training/resume.py, the
held-out selection training/selection.py; the objective and batches live with the drafter (drafter/)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagle3_pipeline import logs
from eagle3_pipeline.formats import drafter_weights, jobs, metrics, reports
from eagle3_pipeline.runtime.target.devices import describe, process_device
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.training import windows
from eagle3_pipeline.training.loop import DATA_ERRORS, data_error_line, train
from eagle3_pipeline.training.selection import summary
from eagle3_pipeline.training.settings import TrainSettings

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the rule's job: one process, or torchrun



@dataclass(frozen=True)
class TrainJob:
    """What every training process reads and writes; under torchrun it travels as JSON
    (`python -m eagle3_pipeline.stages.train JOB.json`, one process per GPU)."""
    stores: tuple[Path, ...]
    heldout: tuple[Path, ...]  # stores of the held-out conversations: the offline estimate picks the weights
    target: Path
    vocab: Path
    state_dir: Path  # checkpoints, metrics and the train log's history: kept across kills
    weights: Path
    summary: Path
    log: Path
    settings: TrainSettings

    def as_json(self) -> str:
        paths = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "settings"}
        return json.dumps({key: [str(p) for p in value] if isinstance(value, tuple) else str(value)
                           for key, value in paths.items()} | {"settings": asdict(self.settings)})

    @classmethod
    def from_json(cls, text: str) -> TrainJob:
        values = json.loads(text)
        return cls(stores=tuple(Path(p) for p in values["stores"]),
                   heldout=tuple(Path(p) for p in values.get("heldout", [])),
                   **{key: Path(values[key]) for key in ("target", "vocab", "state_dir", "weights", "summary", "log")},
                   settings=from_section(TrainSettings, values["settings"]))


def run_process(job: TrainJob) -> None:
    """One training process (rank 0 writes the weights and the summary)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    log = logs.setup(str(job.log) if rank == 0 else None, name="train",
                     history=job.state_dir / "train.log" if rank == 0 else None)
    if world > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    started = time.monotonic()
    try:
        try:
            model = train(list(job.stores), job.target, job.vocab, job.state_dir, job.settings,
                          heldout_paths=list(job.heldout))
        except DATA_ERRORS as error:
            log.error("training stopped: %s", data_error_line(error))
            raise SystemExit(1) from None
        if rank == 0:
            weights = {k: v.contiguous().cpu() for k, v in model.trainable_state_dict().items()}
            drafter_weights.write_trained(job.weights, weights, model.config.as_dict())
            # the report's line on the run: this job's wall time (a resumed job's, not the killed attempts')
            result = summary(job.state_dir, job.settings) | {
                "train_seconds": time.monotonic() - started,
                "device": describe(str(process_device(job.settings.device)), world)}
            metrics.write_summary(job.summary, result)
            log.info("done: %s", result)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(job: TrainJob, gpus: int, metrics_output: Path) -> None:
    """Train in this process, or with more than one GPU in one torchrun process per GPU; then publish the
    metrics of the run (train_state/ keeps the history a resume appends to)."""
    if gpus > 1:
        job_path = job.state_dir / "args.json"
        job_path.parent.mkdir(parents=True, exist_ok=True)
        jobs.write(job_path, job.as_json())
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                        "-m", "eagle3_pipeline.stages.train", str(job_path)], check=True)
    else:
        run_process(job)
    shutil.copyfile(job.state_dir / metrics.METRICS_FILE, metrics_output)


def run_from_snakemake(snakemake: Any) -> None:
    torch.set_num_threads(snakemake.threads)
    if hasattr(snakemake.input, "last_pass"):  # trained in windows under a disk budget: publish the last pass
        return publish_windowed(snakemake)
    reports.write_yaml(Path(snakemake.output.config), dict(snakemake.params.provenance))
    settings = from_section(TrainSettings, snakemake.config["train"])
    job = TrainJob(stores=tuple(Path(p) for p in snakemake.input.stores),
                   heldout=tuple(Path(p) for p in snakemake.input.heldout), target=Path(snakemake.input.target),
                   vocab=Path(snakemake.input.vocab), state_dir=Path(snakemake.params.state_dir),
                   weights=Path(snakemake.output.weights), summary=Path(snakemake.output.summary),
                   log=Path(snakemake.log[0]), settings=settings)
    run(job, int(snakemake.resources.get("gpu", 0)), Path(snakemake.output.metrics))


def publish_windowed(snakemake: Any) -> None:
    """Rule `train` under a disk budget: the last pass's checkpoint in (rules/windows.smk), the usual outputs out."""
    state_dir = Path(snakemake.params.state_dir)
    logs.setup(snakemake.log[0], name="train", history=state_dir / "train.log")
    reports.write_yaml(Path(snakemake.output.config), dict(snakemake.params.provenance))
    windows.finish(Path(snakemake.input.last_pass), Path(snakemake.input.target), Path(snakemake.input.vocab),
                   state_dir, from_section(TrainSettings, snakemake.config["train"]),
                   Path(snakemake.output.weights), Path(snakemake.output.summary), bool(snakemake.input.heldout))
    shutil.copyfile(state_dir / metrics.METRICS_FILE, snakemake.output.metrics)


if __name__ == "__main__":
    run_process(TrainJob.from_json(jobs.read(Path(sys.argv[1]))))
