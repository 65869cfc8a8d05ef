"""Shared zarr plumbing: the codecs, bf16 stored as uint16 bits and store-level checks (the atomic
directory commit is `formats/atomic`).

The two on-disk formats (token shards, hidden-state stores) are defined in `token_shards` and
`hidden_store`; this module only holds what both need. Every stored chunk ends with a crc32c of its
compressed bytes (zarr v3's `crc32c` codec after Blosc), so every read verifies the chunk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec, ZstdCodec

if TYPE_CHECKING:
    import torch

BLOSC_BLOCKSIZE = 1 << 20  # 1 MiB: Blosc's automatic block size loses ~15% of the ratio on activations
BLOSC_CNAME, BLOSC_CLEVEL = "zstd", 1  # one definition for zarr's metadata and our own shard encoder


def blosc(typesize: int, clevel: int = BLOSC_CLEVEL, cname: str = BLOSC_CNAME, shuffle: str = "shuffle") -> BloscCodec:
    return BloscCodec(cname=cname, clevel=clevel, shuffle=BloscShuffle(shuffle), typesize=typesize,
                      blocksize=BLOSC_BLOCKSIZE)


def chunk_codecs(typesize: int, shuffle: str = "shuffle") -> tuple[BloscCodec, Crc32cCodec]:
    """The bytes-to-bytes codecs of every numeric array we store: Blosc, then a crc32c of its output."""
    return blosc(typesize, shuffle=shuffle), Crc32cCodec()


CHECKSUM_BYTES = 4  # what the crc32c codec appends to each chunk (and zarr to each shard index)
EMPTY_CHUNK = np.iinfo(np.uint64).max


def crc32c_bytes(data: bytes) -> bytes:
    """The 4 bytes zarr's crc32c codec appends: the checksum as a little-endian uint32."""
    import google_crc32c

    return np.array([google_crc32c.value(data)], dtype="<u4").tobytes()


def encode_whole_shard(data: np.ndarray, chunk_rows: int, rows_per_shard: int,
                       codec: BloscCodec | None = None) -> list[bytes]:
    """One zarr v3 `sharding_indexed` shard file for rows [0, len(data)) of a shard, encoded here.

    zarr's own write path runs every chunk through one event loop and reaches ~0.25 GB/s whatever the
    number of writer threads; numcodecs releases the GIL, so shards encoded here in threads scale with
    cores. The layout is the one zarr writes for our arrays (inner codecs bytes+blosc+crc32c, i.e. each
    chunk is its Blosc bytes then their crc32c; index of (offset, nbytes) uint64 pairs at the end, then
    its crc32c): `test_direct_shard_bytes_equal_zarr`. `codec` must be the Blosc codec the array declares
    in its zarr.json (default: `blosc(typesize=2)`, the bf16 bits' codec).
    A last, short shard pads its final chunk with the fill value (0) and marks absent chunks empty.
    """
    encoder = numcodecs_blosc(codec or blosc(typesize=2))
    little_endian = data.dtype.newbyteorder("<")
    chunks_per_shard = rows_per_shard // chunk_rows
    index = np.full((chunks_per_shard, 2), EMPTY_CHUNK, dtype="<u8")
    pieces, offset = [], 0
    for c in range(-(-len(data) // chunk_rows)):
        chunk = data[c * chunk_rows: (c + 1) * chunk_rows]
        if len(chunk) < chunk_rows:
            chunk = np.concatenate([chunk, np.zeros((chunk_rows - len(chunk),) + chunk.shape[1:], chunk.dtype)])
        if not chunk.any():
            continue  # zarr leaves all-fill chunks unwritten (write_empty_chunks=False)
        encoded = encoder.encode(np.ascontiguousarray(chunk, dtype=little_endian))
        index[c] = (offset, len(encoded) + CHECKSUM_BYTES)
        pieces += [encoded, crc32c_bytes(encoded)]
        offset += len(encoded) + CHECKSUM_BYTES
    index_bytes = index.tobytes()
    return [*pieces, index_bytes, crc32c_bytes(index_bytes)]  # written one after another: no joined copy


def numcodecs_blosc(codec: BloscCodec):
    """numcodecs' Blosc with the parameters of zarr's BloscCodec: the same bytes zarr would write."""
    from numcodecs import Blosc

    shuffle = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
    return Blosc(cname=codec.cname.value, clevel=codec.clevel, shuffle=shuffle[codec.shuffle.value],
                 blocksize=codec.blocksize)


def stored_chunk_checksums(shard_file: Path, chunks_per_shard: int) -> bytes:
    """The crc32c each stored chunk of a zarr shard file ends with, in chunk order: an identity of the file's
    data that reads a few bytes per chunk (the index, then 4 bytes per chunk), not the whole file."""
    with open(shard_file, "rb") as handle:
        handle.seek(-(16 * chunks_per_shard + CHECKSUM_BYTES), os.SEEK_END)
        index = np.frombuffer(handle.read(16 * chunks_per_shard), dtype="<u8").reshape(-1, 2)
        checksums = []
        for offset, size in index:
            if offset != EMPTY_CHUNK:
                handle.seek(int(offset + size) - CHECKSUM_BYTES)
                checksums.append(handle.read(CHECKSUM_BYTES))
    return b"".join(checksums)


def shard_key(shard_index: int, ndim: int) -> str:
    """Where zarr's default key encoding keeps shard file `shard_index` of an array of `ndim` dimensions,
    sharded along the first only: c/<i>/0/..."""
    return "/".join(["c", str(shard_index)] + ["0"] * (ndim - 1))


def write_whole_shard(array_dir: Path, shard_index: int, trailing_dims: int, pieces: list[bytes]) -> None:
    """Write a shard file under zarr's default key encoding (c/<i>/0/...), atomically."""
    key = Path(array_dir, shard_key(shard_index, trailing_dims + 1))
    key.parent.mkdir(parents=True, exist_ok=True)
    tmp = key.with_name(key.name + ".tmp")
    with open(tmp, "wb") as handle:
        for piece in pieces:
            handle.write(piece)
    os.replace(tmp, key)


# torch is imported where used: the disk plan reads these modules at Snakefile parse time, which must stay cheap
def bf16_to_u16(tensor: torch.Tensor) -> np.ndarray:
    """zarr has no bf16: the bits are stored as uint16."""
    import torch

    return tensor.to(torch.bfloat16).contiguous().view(torch.uint16).numpy()


def u16_to_bf16(array: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).view(torch.bfloat16)


def write_array(group: zarr.Group, name: str, data: np.ndarray, chunk_rows: int = 1 << 16,
                compressor: BloscCodec | None = None) -> zarr.Array:
    """Write a whole 1-D/2-D array in one go (small arrays: ids, masks, offsets)."""
    rows = max(1, min(chunk_rows, len(data)))
    chunks = (rows,) + tuple(data.shape[1:])
    compressors = (compressor, Crc32cCodec()) if compressor else chunk_codecs(typesize=data.dtype.itemsize)
    array = group.create_array(name, shape=data.shape, dtype=data.dtype, chunks=chunks,
                               compressors=compressors)
    if len(data):
        array[...] = data
    return array


def write_strings(group: zarr.Group, name: str, values: list[str]) -> zarr.Array:
    from zarr.core.dtype import VariableLengthUTF8

    array = group.create_array(name, shape=(len(values),), dtype=VariableLengthUTF8(),
                               chunks=(max(1, len(values)),), compressors=(ZstdCodec(), Crc32cCodec()))
    if values:
        array[...] = np.asarray(values, dtype=object)
    return array


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def open_readonly(path: Path) -> zarr.Group:
    return zarr.open_group(str(path), mode="r")


def open_complete(path: Path, expected_format: str, what: str, error: type[Exception],
                  schema_version: int | tuple[int, ...], job: str) -> tuple[zarr.Group, dict[str, Any]]:
    """Open a complete store of `expected_format` and a readable `schema_version` (one, or the versions this
    code still reads), or raise `error` saying why. `job` is the rule that writes it (named in the remedy)."""
    if not Path(path).is_dir():
        raise error(f"{path}: {what} does not exist")
    try:
        group = open_readonly(path)
        found = dict(group.attrs)
    except Exception as exc:
        raise error(f"{path}: not a readable zarr group ({exc})") from exc
    if found.get("format") != expected_format or found.get("complete") is not True:
        raise error(f"{path}: not a complete {what} (format={found.get('format')}, "
                    f"complete={found.get('complete')}); rerun its {job} job")
    readable = schema_version if isinstance(schema_version, tuple) else (schema_version,)
    if found.get("schema_version") not in readable:
        versions = " or ".join(str(v) for v in readable)
        raise error(f"{path}: {what} of schema version {found.get('schema_version')}, written by another "
                    f"pipeline (this one reads version {versions}, whose chunks carry checksums); "
                    f"delete it and rerun its {job} job")
    return group, found


class CorruptChunk(ValueError):
    """A stored chunk that fails its checksum or does not decode; the message names store, array, chunk."""


def read_rows(store: Path, name: str, array: zarr.Array, start: int, stop: int) -> np.ndarray:
    """array[start:stop], or CorruptChunk naming the first chunk in that range that does not verify."""
    try:
        return array[start:stop]
    except Exception as exc:
        bad = _first_bad_chunk(array, start, stop)
        if bad is None:
            raise  # not a chunk's fault
        raise CorruptChunk(describe_bad_chunk(store, name, array, *bad)) from exc


def _first_bad_chunk(array: zarr.Array, start: int, stop: int) -> tuple[int, Exception] | None:
    rows = array.chunks[0]
    for chunk in range(start // rows, -(-stop // rows)):
        try:
            array[chunk * rows: (chunk + 1) * rows]
        except Exception as exc:
            return chunk, exc
    return None


def describe_bad_chunk(store: Path, name: str, array: zarr.Array, chunk: int, exc: Exception) -> str:
    """One line: store, array, chunk (its rows and the file holding it) and why it failed."""
    rows = array.chunks[0]
    file_rows = (array.shards or array.chunks)[0]  # a zarr shard file holds several chunks
    key = shard_key(chunk * rows // file_rows, array.ndim)
    reason = "checksum mismatch" if "checksum" in str(exc) else f"{type(exc).__name__}: {str(exc)[:120]}"
    end = min(array.shape[0], (chunk + 1) * rows) - 1
    return (f"{store}: array {name}, chunk {chunk} (rows {chunk * rows}-{end}, file {name}/{key}) is corrupt "
            f"({reason}); delete the store and rerun the job that wrote it")


def verify_sample(store: Path, group: zarr.Group, names: tuple[str, ...], per_array: int = 16) -> None:
    """Decode (and so checksum) a bounded sample of chunks of every named array, `per_array` chunks spread
    evenly over it, and check the index of every zarr shard file (its crc32c and that its entries lie in the
    file): what any read of the file would check first, at a few bytes per file."""
    for name in names:
        array = group[name]
        rows = array.chunks[0]
        count = -(-array.shape[0] // rows)
        if count == 0:
            continue
        if array.shards:
            verify_shard_indexes(store, name, array)
        for chunk in sorted(set(np.linspace(0, count - 1, num=min(per_array, count)).round().astype(int).tolist())):
            read_rows(store, name, array, chunk * rows, min(array.shape[0], (chunk + 1) * rows))


def verify_shard_indexes(store: Path, name: str, array: zarr.Array) -> None:
    """CorruptChunk naming the first zarr shard file of `array` whose index fails its crc32c or points outside
    the file (a missing file is the caller's check: zarr reads one as zeros)."""
    per_file = array.shards[0] // array.chunks[0]
    index_bytes = 16 * per_file
    for number in range(-(-array.shape[0] // array.shards[0])):
        key = shard_key(number, array.ndim)
        file = Path(store, name, key)
        if not file.is_file():
            continue
        size = file.stat().st_size
        with open(file, "rb") as handle:
            handle.seek(max(0, size - index_bytes - CHECKSUM_BYTES))
            tail = handle.read()
        index, checksum = tail[:index_bytes], tail[index_bytes:]
        entries = np.frombuffer(index, dtype="<u8").reshape(-1, 2) if len(index) == index_bytes else None
        if entries is None or crc32c_bytes(index) != checksum:
            problem = "its index fails its checksum"
        elif any(offset != EMPTY_CHUNK and offset + length > size - len(tail) for offset, length in entries):
            problem = "its index points past the chunks it holds"
        else:
            continue
        raise CorruptChunk(f"{store}: array {name}, file {name}/{key} is corrupt ({problem}); delete the store "
                           f"and rerun the job that wrote it")


def attrs(path: Path) -> dict[str, Any]:
    return dict(open_readonly(path).attrs)
