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
BLOSC_CNAME, BLOSC_CLEVEL = "zstd", 1  # one definition for zarr's metadata and our own shard encoder


def blosc(typesize: int, clevel: int = BLOSC_CLEVEL, cname: str = BLOSC_CNAME, shuffle: str = "shuffle") -> BloscCodec:
    return BloscCodec(cname=cname, clevel=clevel, shuffle=BloscShuffle(shuffle), typesize=typesize,
                      blocksize=BLOSC_BLOCKSIZE)


EMPTY_CHUNK = np.iinfo(np.uint64).max


def encode_whole_shard(data: np.ndarray, chunk_rows: int, rows_per_shard: int) -> list[bytes]:
    """One zarr v3 `sharding_indexed` shard file for rows [0, len(data)) of a shard, encoded here.

    zarr's own write path runs every chunk through one event loop and reaches ~0.25 GB/s whatever the
    number of writer threads; numcodecs releases the GIL, so shards encoded here in threads scale with
    cores. The layout is the one zarr writes for our arrays (inner codecs bytes+blosc; index of
    (offset, nbytes) uint64 pairs at the end, then its crc32c): `test_direct_shard_bytes_equal_zarr`.
    A last, short shard pads its final chunk with the fill value (0) and marks absent chunks empty.
    """
    import google_crc32c
    from numcodecs import Blosc

    # must match blosc(typesize=2), the codec the hidden arrays declare in their zarr.json
    codec = Blosc(cname=BLOSC_CNAME, clevel=BLOSC_CLEVEL, shuffle=Blosc.SHUFFLE, blocksize=BLOSC_BLOCKSIZE)
    chunks_per_shard = rows_per_shard // chunk_rows
    index = np.full((chunks_per_shard, 2), EMPTY_CHUNK, dtype="<u8")
    pieces, offset = [], 0
    for c in range(-(-len(data) // chunk_rows)):
        chunk = data[c * chunk_rows: (c + 1) * chunk_rows]
        if len(chunk) < chunk_rows:
            chunk = np.concatenate([chunk, np.zeros((chunk_rows - len(chunk),) + chunk.shape[1:], chunk.dtype)])
        if not chunk.any():
            continue  # zarr leaves all-fill chunks unwritten (write_empty_chunks=False)
        encoded = codec.encode(np.ascontiguousarray(chunk, dtype="<u2"))
        index[c] = (offset, len(encoded))
        pieces.append(encoded)
        offset += len(encoded)
    index_bytes = index.tobytes()
    checksum = np.uint32(google_crc32c.value(index_bytes)).tobytes()
    return [*pieces, index_bytes, checksum]  # written one after another: no joined copy of the shard


def write_whole_shard(array_dir: Path, shard_index: int, trailing_dims: int, pieces: list[bytes]) -> None:
    """Write a shard file under zarr's default key encoding (c/<i>/0/...), atomically."""
    key = Path(array_dir, "c", str(shard_index), *(["0"] * trailing_dims))
    key.parent.mkdir(parents=True, exist_ok=True)
    tmp = key.with_name(key.name + ".tmp")
    with open(tmp, "wb") as handle:
        for piece in pieces:
            handle.write(piece)
    os.replace(tmp, key)


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
