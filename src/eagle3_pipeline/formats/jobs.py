"""Job files: what a rule hands the worker processes it starts (evaluation workers, torchrun training
processes) as one JSON document each; transient, written whole before the process starts."""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.formats.atomic import atomic_write


def write(path: Path, document: str) -> None:
    atomic_write(Path(path), document)


def read(path: Path) -> str:
    return Path(path).read_text()
