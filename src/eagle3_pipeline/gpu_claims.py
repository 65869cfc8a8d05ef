"""Which GPUs a job uses on a machine with several, when nothing else decides.

Snakemake counts GPUs (`--resources gpu=N`) but does not say which device a job gets, so on a machine of eight
GPUs without a cluster scheduler every job would land on the first. A GPU job's script claims its devices before
anything starts CUDA: the least-claimed of the GPUs it may use (CUDA_VISIBLE_DEVICES' entries where that is set,
as SLURM or a container does, else every GPU the driver lists), through lock files under the system's temporary
directory (shared by every run of the same user with the same TMPDIR, released when the job's process ends,
however it ends), and hides the others from it with CUDA_VISIBLE_DEVICES. Jobs share a GPU only when there are
more jobs than GPUs (small targets: the GPU example runs four jobs on one). Training claims `train.gpus` devices
(one process each); every other stage runs on one device whatever its `gpu` share. Nothing is claimed where a job
may use fewer than two GPUs or its config names one (`cuda:N`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver knows, read without starting CUDA
SLOTS_PER_GPU = 64  # more jobs than this on one GPU share a slot's count (harmless: the count only ranks GPUs)
DEVICE_SECTION = {  # rule -> the config section whose `device` it runs on (None: the rule has no such setting)
    "extract": "extract", "extract_window": "extract", "parity": "parity", "regenerate": "regenerate",
    "evaluate": "evaluate", "evaluate_timing": "evaluate", "engine_check": None, "train": "train",
    "train_pass": "train"}
ONE_PROCESS_PER_GPU = frozenset({"train"})  # torchrun's DDP: the job's `gpu` resource in devices (windows: one)

_held: list[IO[str]] = []  # the open lock files: the claims last as long as the process


class ClaimsDirError(PermissionError):
    """The claims directory is not a private directory of this user's (someone else's, a link, writable by others)."""


def claims_dir() -> Path:
    """This user's private directory of claims (created 0700; refused if another user or a link holds the name)."""
    directory = Path(tempfile.gettempdir()) / f"eagle3-gpu-claims-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ClaimsDirError(f"{directory}: GPU claims need a directory of this user's that no one else can write "
                             f"(found owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}); remove it or "
                             "point TMPDIR elsewhere")
    return directory


def machine_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs a job may use, as CUDA_VISIBLE_DEVICES names them: its entries up to the first invalid one (CUDA
    ignores the rest) where it is set, else the driver's GPUs by index."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(index) for index in range(len(list(NVIDIA_GPUS.iterdir())))] if NVIDIA_GPUS.is_dir() else []
    entries = []
    for entry in (part.strip() for part in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


def _private(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)  # a planted link must not redirect our writes


def _lock_file(directory: Path, name: str) -> IO[str]:
    return open(directory / name, "a", opener=_private)  # noqa: SIM115 - "a": opening never truncates


def _slot_name(gpu: str, slot: int) -> str:
    return f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', gpu)}-slot-{slot}.lock"  # entries may be UUIDs or MIG names


def claim(count: int, gpus: list[str], directory: Path) -> tuple[list[str], list[IO[str]]]:
    """Claim `count` of `gpus` (distinct while there are enough): the ones fewest live jobs hold, in their listed
    order among equals; the claims are the open files returned. The choice and the claim happen under one lock, so
    jobs starting together spread out."""
    with _lock_file(directory, "choosing.lock") as choosing:
        fcntl.flock(choosing, fcntl.LOCK_EX)
        load = {gpu: held_slots(directory, gpu) for gpu in gpus}
        least_held = set(sorted(gpus, key=load.__getitem__)[:count])  # a stable sort: listed order among equals
        chosen = [gpu for gpu in gpus if gpu in least_held]
        return chosen, [take_slot(directory, gpu) for gpu in chosen]


def held_slots(directory: Path, gpu: str) -> int:
    """How many of the GPU's slot files a live process holds (a slot we can lock is free; we unlock it again)."""
    held = 0
    for slot in range(SLOTS_PER_GPU):
        if not (directory / _slot_name(gpu, slot)).exists():
            break  # slots are taken lowest first, so no higher one was ever used
        with _lock_file(directory, _slot_name(gpu, slot)) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held += 1
    return held


def take_slot(directory: Path, gpu: str) -> IO[str]:
    for slot in range(SLOTS_PER_GPU):
        handle = _lock_file(directory, _slot_name(gpu, slot))
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            handle.close()
    return _lock_file(directory, _slot_name(gpu, SLOTS_PER_GPU - 1))  # every slot held: share, unlocked


def devices_wanted(snakemake: Any) -> int:
    """How many devices the job uses: 0 where it takes no GPU or its config names one (`cuda:N`, the user's
    choice), `gpu` for training's one process per GPU, else one (a `gpu` share above one still runs on one)."""
    share = int(snakemake.resources.get("gpu", 0))
    if share < 1:
        return 0
    section = DEVICE_SECTION[snakemake.rule]
    if section and ":" in str(snakemake.config[section].get("device", "auto")):
        return 0
    return share if snakemake.rule in ONE_PROCESS_PER_GPU else 1


def claim_for_job(snakemake: Any) -> None:
    """At the start of a GPU job's script, before CUDA starts: claim the job's devices and make them the only
    visible ones (the job's log names them: logs.setup)."""
    wanted = devices_wanted(snakemake)
    gpus = machine_gpus()
    if wanted >= 1 and len(gpus) >= 2:
        chosen, handles = claim(min(wanted, len(gpus)), gpus, claims_dir())
        _held.extend(handles)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)
