"""Which GPUs a job uses on a machine with several, when nothing else decides.

Snakemake counts GPUs (`--resources gpu=N`) but does not say which device a job gets, so on a machine of eight
GPUs without a cluster scheduler every job would land on the first. A GPU job's script claims its devices before
anything starts CUDA: the least-claimed ones, through lock files under the system's temporary directory (shared by
every run on the machine, released when the job's process ends, however it ends), and hides the others from it
with CUDA_VISIBLE_DEVICES. Jobs share a GPU only when there are more jobs than GPUs (small targets: the GPU
example runs four jobs on one). Nothing is claimed where the devices are already chosen (CUDA_VISIBLE_DEVICES set,
as SLURM does) or where no NVIDIA GPU is listed."""

from __future__ import annotations

import fcntl
import getpass
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver knows, read without starting CUDA
SLOTS_PER_GPU = 64  # more jobs than this on one GPU share a slot's count (harmless: the count only ranks GPUs)

_held: list[IO[str]] = []  # the open lock files: the claims last as long as the process


def claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"eagle3-gpu-claims-{getpass.getuser()}"


def machine_gpus(environ: Mapping[str, str] = os.environ) -> list[int]:
    """The GPUs to choose from: none where the devices are already chosen or the driver lists none."""
    if environ.get("CUDA_VISIBLE_DEVICES") is not None or not NVIDIA_GPUS.is_dir():
        return []
    return list(range(len(list(NVIDIA_GPUS.iterdir()))))


def claim(count: int, gpus: list[int], directory: Path) -> tuple[list[int], list[IO[str]]]:
    """Claim `count` of `gpus` (distinct while there are enough): the ones fewest live jobs hold, lowest first;
    the claims are the open files returned. The choice and the claim happen under one lock, so jobs starting
    together spread out."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "choosing.lock", "w") as choosing:
        fcntl.flock(choosing, fcntl.LOCK_EX)
        load = {gpu: held_slots(directory, gpu) for gpu in gpus}
        chosen = sorted(gpus, key=lambda gpu: (load[gpu], gpu))[:count]
        return sorted(chosen), [take_slot(directory, gpu) for gpu in chosen]


def held_slots(directory: Path, gpu: int) -> int:
    """How many of the GPU's slot files a live process holds (a slot we can lock is free; we unlock it again)."""
    held = 0
    for slot in range(SLOTS_PER_GPU):
        path = directory / f"gpu-{gpu}-slot-{slot}.lock"
        if not path.exists():
            break  # slots are taken lowest first, so no higher one was ever used
        with open(path, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held += 1
    return held


def take_slot(directory: Path, gpu: int) -> IO[str]:
    for slot in range(SLOTS_PER_GPU):
        handle = open(directory / f"gpu-{gpu}-slot-{slot}.lock", "a")  # noqa: SIM115 - held open on purpose
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            handle.close()
    return open(directory / f"gpu-{gpu}-slot-{SLOTS_PER_GPU - 1}.lock", "a")  # every slot held: share, unlocked


def claim_for_job(snakemake: Any) -> None:
    """At the start of a GPU job's script, before CUDA starts: claim the job's `gpu` resource in devices and make
    them the only visible ones (the job's log names them: logs.setup)."""
    count = int(snakemake.resources.get("gpu", 0))
    gpus = machine_gpus()
    if count >= 1 and len(gpus) >= 2:
        chosen, handles = claim(min(count, len(gpus)), gpus, claims_dir())
        _held.extend(handles)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, chosen))
