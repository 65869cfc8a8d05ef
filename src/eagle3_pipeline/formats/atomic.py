"""The one commit step every artifact shares: build it under `<name>.partial`, then `os.replace` it into place.

A killed job leaves at most a `.partial` sibling, never a half-written file or directory under the final
name, so Snakemake (and every reader) sees either the old state or the finished artifact. A leftover
`.partial` directory is removed before a new one is started (unless a writer resumes inside it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_SUFFIX = ".partial"


def partial_path(final: Path) -> Path:
    """The sibling an artifact is built in."""
    final = Path(final)
    return final.with_name(final.name + PARTIAL_SUFFIX)


def start_partial_dir(final: Path) -> Path:
    """The sibling directory to build `final` in, with an old leftover removed."""
    partial = partial_path(final)
    if partial.exists():
        shutil.rmtree(partial)
    return partial


def commit_dir(partial: Path, final: Path, replace: bool = False) -> None:
    """Move a finished directory into place (same filesystem, one rename). An existing `final` is refused,
    or removed first when `replace` (a rule that rebuilds its own output)."""
    final = Path(final)
    if final.exists():
        if not replace:
            raise FileExistsError(f"{final} already exists; refusing to overwrite a finished store")
        shutil.rmtree(final)
    os.replace(partial, final)


@contextmanager
def atomic_dir(final: Path, replace: bool = False) -> Iterator[Path]:
    """Yield the `.partial` directory path (not created: writers create it their own way) and rename it to
    `final` when the block ends without an error; on an error the partial directory stays for inspection
    and is removed by the next attempt."""
    partial = start_partial_dir(final)
    yield partial
    commit_dir(partial, final, replace)


@contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Yield the `.partial` file path for writers that need a file name (safetensors, torch.save, streamed
    text); it replaces `final` when the block ends without an error."""
    partial = partial_path(final)
    yield partial
    os.replace(partial, final)


def atomic_write(final: Path, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) to `final` through its `.partial` sibling."""
    with atomic_file(final) as partial:
        if isinstance(data, str):
            partial.write_text(data, encoding="utf-8")
        else:
            partial.write_bytes(data)
