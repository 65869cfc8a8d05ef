"""Append-only JSONL journals: how long jobs keep finished work across a kill (regeneration, evaluation).

One JSON value per line; lines are written whole and synced to disk before the work counts as kept. A kill
can leave the last line torn - cut short, or written without its newline - and readers stop there:
everything from that line on is unfinished work.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from eagle3_pipeline.formats.atomic import atomic_write

STAMP_FILE = "fingerprint"  # a progress directory's: what its records were decoded for


def write_stamp(directory: Path, fingerprint: str) -> None:
    """Whole or not at all (atomic_write), so a reader never sees it half-written."""
    atomic_write(Path(directory) / STAMP_FILE, fingerprint)


def read_stamp(directory: Path) -> str | None:
    stamp = Path(directory) / STAMP_FILE
    return stamp.read_text() if stamp.exists() else None


def append(handle: TextIO, records: Iterable[Any]) -> None:
    """Write `records` to the journal open in `handle` (append mode), one per line, and sync them to disk."""
    for record in records:
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def read_intact(path: Path) -> tuple[list[Any], int]:
    """The values of the lines before the first torn one, and the bytes those lines take (where to
    truncate before appending again)."""
    data = Path(path).read_bytes()
    values: list[Any] = []
    end = 0
    while (newline := data.find(b"\n", end)) >= 0:
        try:
            values.append(json.loads(data[end:newline]))
        except json.JSONDecodeError:
            break
        end = newline + 1
    return values, end


def resume(path: Path, fingerprint: str, log: logging.Logger) -> list[Any]:
    """The records of a journal whose first line is {"fingerprint": ...}, written by an earlier, killed run of the
    same job; [] when there is none. A journal written for another fingerprint is removed; a torn tail is cut off,
    so appends start on a clean line."""
    if not path.exists():
        return []
    lines, intact_bytes = read_intact(path)
    header = lines[0] if lines and isinstance(lines[0], dict) else {}
    if header.get("fingerprint") != fingerprint:
        log.warning("%s: written for other input or settings; starting over", path)
        path.unlink()
        return []
    with open(path, "r+b") as handle:
        handle.truncate(intact_bytes)
    return lines[1:]
