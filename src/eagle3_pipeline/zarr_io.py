"""Shared zarr plumbing: the codec, atomic directory commits and store-level checks.

The two on-disk formats (token shards, hidden-state stores) are defined in `token_shards` and
`hidden_store`; this module only holds what both need.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BloscShuffle

BLOSC_BLOCKSIZE = 1 << 20  # 1 MiB: Blosc's automatic block size loses ~15% of the ratio on activations


def blosc(typesize: int, clevel: int = 1, cname: str = "zstd", shuffle: str = "shuffle") -> BloscCodec:
    return BloscCodec(cname=cname, clevel=clevel, shuffle=BloscShuffle(shuffle), typesize=typesize,
                      blocksize=BLOSC_BLOCKSIZE)


def partial_path(final: Path) -> Path:
    return final.with_name(final.name + ".partial")


def start_partial(final: Path, keep_existing: bool = False) -> Path:
    """The sibling directory a store is built in; an old leftover is removed unless resuming."""
    partial = partial_path(final)
    if partial.exists() and not keep_existing:
        shutil.rmtree(partial)
    return partial


def commit(partial: Path, final: Path) -> None:
    """Atomically move a finished store into place (same filesystem, one rename)."""
    if final.exists():
        raise FileExistsError(f"{final} already exists; refusing to overwrite a finished store")
    os.replace(partial, final)


def write_array(group: zarr.Group, name: str, data: np.ndarray, chunk_rows: int = 1 << 16,
                compressor: BloscCodec | None = None) -> zarr.Array:
    """Write a whole 1-D/2-D array in one go (small arrays: ids, masks, offsets)."""
    rows = max(1, min(chunk_rows, len(data)))
    chunks = (rows,) + tuple(data.shape[1:])
    compressor = compressor or blosc(typesize=data.dtype.itemsize)
    array = group.create_array(name, shape=data.shape, dtype=data.dtype, chunks=chunks,
                               compressors=compressor)
    if len(data):
        array[...] = data
    return array


def write_strings(group: zarr.Group, name: str, values: list[str]) -> zarr.Array:
    from zarr.core.dtype import VariableLengthUTF8

    array = group.create_array(name, shape=(len(values),), dtype=VariableLengthUTF8(),
                               chunks=(max(1, len(values)),))
    if values:
        array[...] = np.asarray(values, dtype=object)
    return array


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def open_readonly(path: Path) -> zarr.Group:
    return zarr.open_group(str(path), mode="r")


def open_complete(path: Path, expected_format: str, what: str, error: type[Exception],
                  hint: str = "") -> tuple[zarr.Group, dict[str, Any]]:
    """Open a store of `expected_format` whose `complete` attr is set, or raise `error` saying why."""
    if not Path(path).is_dir():
        raise error(f"{path}: {what} does not exist")
    try:
        group = open_readonly(path)
        found = dict(group.attrs)
    except Exception as exc:
        raise error(f"{path}: not a readable zarr group ({exc})") from exc
    if found.get("format") != expected_format or found.get("complete") is not True:
        raise error(f"{path}: not a complete {what} (format={found.get('format')}, "
                    f"complete={found.get('complete')}){hint}")
    return group, found


def attrs(path: Path) -> dict[str, Any]:
    return dict(open_readonly(path).attrs)
