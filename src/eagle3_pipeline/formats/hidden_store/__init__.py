"""The hidden-state store format: `hidden/shard-{i:05d}.zarr` (zarr v3 group), one per token shard.

Token-major and concatenated, in the store's own sequence order (longest first, ties by index:
`storage_order`; the order extraction runs in, so rows arrive in storage order and every zarr shard is
written exactly once):
    aux_hidden_states  [N_tok, 3, H]  the 3 aux layers' outputs
    last_hidden_states [N_tok, H]     the final hidden state AFTER the final norm
    input_ids int32 [N_tok], loss_mask uint8 [N_tok], seq_offsets int64 [N+1], sample_ids string [N]
The attr `hidden_dtype` says how the hidden arrays hold the states (`rows.py`): `bfloat16` keeps bf16 bits
as uint16 (zarr has no bf16; `torch.from_numpy(u16).view(torch.bfloat16)` recovers them for free);
`float8_e4m3fn` keeps fp8 bits as uint8 beside `aux_scales` float32 [N_tok, 3] and `last_scales` float32
[N_tok], one scale per row. Attrs: format, schema_version, complete (set last), counts, hidden_size,
hidden_dtype, aux_layer_ids (HF indices), final_norm, target_hash, target_revision, backend, rows_per_shard,
pipeline_version. Every chunk of every array ends with a crc32c of its compressed bytes, so every read
verifies it; a bad chunk raises `zarr_io.CorruptChunk` naming it. Schema versions: 3 adds the store dtype
(fp8); 2 (bf16 only, the same arrays as a bf16 store of version 3) is still read; 1 had no checksums and is
refused. Writing: `writer.StoreWriter`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from eagle3_pipeline.formats import zarr_io
from eagle3_pipeline.formats.hidden_store.rows import STORE_DTYPES, decode, encode, hidden_arrays  # noqa: F401

if TYPE_CHECKING:
    import torch

FORMAT = "eagle3-hidden-store"
SCHEMA_VERSION = 3  # 2: a crc32c on every chunk; 3: the store dtype (bf16 bits, or fp8 with row scales)
READABLE_VERSIONS = (2, 3)
PROGRESS_FILE = "progress.json"
CHUNK_BYTES = 2 << 20  # ~2 MiB raw per chunk: small enough for random sequence reads
SHARD_BYTES = 64 << 20  # ~64 MiB raw per zarr shard: a store is tens of files, not millions
TOKEN_ROW_BYTES = 4 + 1  # input_ids int32 + loss_mask uint8 per token row, before compression


class InvalidStore(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    chunk_rows: int
    rows_per_shard: int

    @classmethod
    def for_hidden_size(cls, hidden_size: int, shard_bytes: int = SHARD_BYTES) -> Layout:
        row_bytes = hidden_row_bytes(hidden_size)  # the aux array sets the pace
        chunk_bytes = min(CHUNK_BYTES, shard_bytes)
        chunk_rows = 2 ** max(0, round(math.log2(max(1, chunk_bytes // (3 * hidden_size * 2)))))
        chunks_per_shard = max(1, shard_bytes // (chunk_rows * row_bytes))
        return cls(chunk_rows, chunk_rows * chunks_per_shard)


def hidden_row_bytes(hidden_size: int) -> int:
    """One token row of the hidden arrays in bf16, aux (3H) + last (H): what sizes chunks and zarr shards (in
    rows, the same for every store dtype)."""
    return 4 * hidden_size * 2


def checksum_bytes_per_row(hidden_size: int, store_dtype: str = "bfloat16") -> float:
    """The crc32c every chunk of the hidden arrays ends with, spread over the chunk's rows."""
    arrays = len(hidden_arrays(store_dtype, hidden_size))
    return arrays * zarr_io.CHECKSUM_BYTES / Layout.for_hidden_size(hidden_size).chunk_rows


def store_dtype_of(attrs: dict[str, Any]) -> str:
    return attrs.get("hidden_dtype", "bfloat16")  # a version-2 store holds bf16 bits


def storage_order(lengths: np.ndarray) -> np.ndarray:
    """The store's order of its token shard's sequences: longest first (an out-of-memory shows up at once), ties
    by index. Deterministic: training knows a store's lengths before the store exists."""
    return np.lexsort((np.arange(len(lengths)), -lengths))


# ---------------------------------------------------------------- reading and validation

class HiddenStore:
    """Read access for training: one sequence's arrays as tensors, the hidden states as stored (bf16, or fp8
    bits with their scales: `decode` turns them into bf16, on the device that trains)."""

    def __init__(self, path: Path, validate_store: bool = True):
        self.path = Path(path)
        self.attrs = validate(self.path) if validate_store else zarr_io.attrs(self.path)
        self.store_dtype = store_dtype_of(self.attrs)
        group = zarr_io.open_readonly(self.path)
        self.hidden = {spec.name: group[spec.name]
                       for spec in hidden_arrays(self.store_dtype, self.attrs["hidden_size"])}
        self.input_ids, self.loss_mask, self.seq_offsets = (self._read(name, group[name], 0, group[name].shape[0])
                                                            for name in ("input_ids", "loss_mask", "seq_offsets"))

    def __len__(self) -> int:
        return len(self.seq_offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)

    def sequence(self, j: int) -> dict[str, torch.Tensor]:
        """input_ids, loss_mask and every hidden array of sequence j: bf16 states (a bf16 store), or uint8 fp8
        bits plus `aux_scales`/`last_scales` (an fp8 store)."""
        import torch

        start, end = int(self.seq_offsets[j]), int(self.seq_offsets[j + 1])
        rows = {name: torch.from_numpy(np.ascontiguousarray(self._read(name, array, start, end)))
                for name, array in self.hidden.items()}
        if self.store_dtype == "bfloat16":
            rows = {name: decode(bits, None) for name, bits in rows.items()}
        return {"input_ids": torch.from_numpy(self.input_ids[start:end].astype(np.int64)),
                "loss_mask": torch.from_numpy(self.loss_mask[start:end].copy()), **rows}

    def _read(self, name: str, array: zarr.Array, start: int, end: int) -> np.ndarray:
        return zarr_io.read_rows(self.path, name, array, start, end)  # CorruptChunk names store, array, chunk


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def identity(path: Path) -> str:
    """A cheap content hash of a complete store: its attrs, its small arrays, and the checksum every chunk of
    the hidden arrays carries (a few bytes per chunk read, not the activations)."""
    import hashlib

    path = Path(path)
    group = zarr_io.open_readonly(path)
    attrs = dict(group.attrs)
    digest = hashlib.sha256(json.dumps(jsonable(attrs), sort_keys=True).encode())
    for name in ("input_ids", "loss_mask", "seq_offsets"):
        digest.update(np.ascontiguousarray(zarr_io.read_rows(path, name, group[name], 0, group[name].shape[0])))
    digest.update("\0".join(str(s) for s in group["sample_ids"][...]).encode())
    chunks_per_shard = attrs["rows_per_shard"] // attrs["chunk_rows"]
    for name in (spec.name for spec in hidden_arrays(store_dtype_of(attrs), attrs["hidden_size"])):
        files = (path / name / "c").rglob("*")
        for file in sorted((f for f in files if f.is_file()), key=lambda f: f.relative_to(path).parts):
            digest.update(str(file.relative_to(path)).encode())
            digest.update(zarr_io.stored_chunk_checksums(file, chunks_per_shard))
    return digest.hexdigest()


def validate(path: Path) -> dict[str, Any]:
    """Raise InvalidStore unless the store is complete and internally consistent; return its attrs."""
    path = Path(path)
    group, attrs = zarr_io.open_complete(path, FORMAT, "hidden-state store", InvalidStore, READABLE_VERSIONS,
                                         job="extract")
    num_tokens, hidden, store_dtype = attrs["num_tokens"], attrs["hidden_size"], store_dtype_of(attrs)
    if store_dtype not in STORE_DTYPES:
        raise InvalidStore(f"{path}: unknown hidden_dtype {store_dtype!r} (this pipeline reads "
                           f"{', '.join(STORE_DTYPES)})")
    hidden_specs = hidden_arrays(store_dtype, hidden)
    expected_shapes = {spec.name: (num_tokens, *spec.row_shape) for spec in hidden_specs}
    expected_shapes |= {"input_ids": (num_tokens,), "loss_mask": (num_tokens,),
                        "seq_offsets": (attrs["num_sequences"] + 1,), "sample_ids": (attrs["num_sequences"],)}
    for name, shape in expected_shapes.items():
        if name not in group or group[name].shape != shape:
            raise InvalidStore(f"{path}: array {name} missing or of the wrong shape (expected {shape})")
    offsets = group["seq_offsets"][...]
    if offsets[0] != 0 or offsets[-1] != num_tokens or np.any(np.diff(offsets) <= 0):
        raise InvalidStore(f"{path}: seq_offsets do not cover {num_tokens} tokens")
    rows_per_shard = attrs["rows_per_shard"]
    for name in (spec.name for spec in hidden_specs):
        ndim = group[name].ndim
        for index in range(math.ceil(num_tokens / rows_per_shard)):
            key = Path(name, zarr_io.shard_key(index, ndim))
            if not (path / key).is_file():  # zarr would read a missing shard file as zeros
                raise InvalidStore(f"{path}: zarr shard file {key} is missing")
    try:  # bounded: a sample of chunks of every array, one in every shard file (checks its index)
        zarr_io.verify_sample(path, group, tuple(expected_shapes))
    except zarr_io.CorruptChunk as exc:
        raise InvalidStore(str(exc)) from exc
    return attrs


def validate_all(paths: list[Path], threads: int = 8) -> list[dict[str, Any]]:
    """`validate` for many stores at once (reading their sample chunks is I/O and decompression: threads
    overlap it), in the order given; the first invalid store's error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths)))) as pool:
        return list(pool.map(validate, paths))


from eagle3_pipeline.formats.hidden_store.writer import StoreWriter  # noqa: E402, F401 (needs the names above)
