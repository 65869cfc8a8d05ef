"""Where a job runs: one rule for every stage ("auto" = CUDA when present, else the CPU)."""

from __future__ import annotations

import os

import torch


def pick_device(requested: str = "auto") -> str:
    """The device name a job loads its models on (also what result files record)."""
    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def process_device(requested: str = "auto") -> torch.device:
    """This process's device: under torchrun, "auto" means CUDA device LOCAL_RANK (one GPU per process)."""
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def describe(device: str, processes: int = 1) -> str:
    """A device as the report names it: the GPU's model ("NVIDIA H200", "2x NVIDIA H200") or "CPU, N threads"."""
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device))
        return f"{processes}x {name}" if processes > 1 else name
    return f"CPU, {torch.get_num_threads()} threads"
