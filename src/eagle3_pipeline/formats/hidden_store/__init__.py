"""The hidden-state store format: `hidden/shard-{i:05d}.zarr` (zarr v3 group), one per token shard.

Token-major and concatenated, in the store's own sequence order (longest first, the order extraction
runs in, so rows arrive in storage order and every zarr shard is written exactly once):
    aux_hidden_states  uint16 [N_tok, 3, H]  bf16 bits of the 3 aux layers' outputs
    last_hidden_states uint16 [N_tok, H]     bf16 bits of the final hidden state AFTER the final norm
    input_ids int32 [N_tok], loss_mask uint8 [N_tok], seq_offsets int64 [N+1], sample_ids string [N]
zarr has no bf16: `torch.from_numpy(u16).view(torch.bfloat16)` recovers the values for free.
Attrs: format, schema_version, complete (set last), counts, hidden_size, hidden_dtype, aux_layer_ids
(HF indices), final_norm, target_hash, target_revision, backend, rows_per_shard, pipeline_version.
Every chunk of every array ends with a crc32c of its compressed bytes (schema version 2; version 1 had
none and is refused), so every read verifies it; a bad chunk raises `zarr_io.CorruptChunk` naming it.

Crash safety: the store is built in `<name>.partial`; `progress.json` there records how many rows are
durably written (whole zarr shards only), so a killed job resumes where it stopped. The store is renamed
into place after `complete` is set.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from eagle3_pipeline import __version__
from eagle3_pipeline.formats import atomic, zarr_io
from eagle3_pipeline.formats.zarr_io import bf16_to_u16, u16_to_bf16  # noqa: F401 (the store's bf16 bits)

if TYPE_CHECKING:
    import torch

FORMAT = "eagle3-hidden-store"
SCHEMA_VERSION = 2  # 2: a crc32c on every chunk
PROGRESS_FILE = "progress.json"
HIDDEN_ARRAYS = ("aux_hidden_states", "last_hidden_states")
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
    return 4 * hidden_size * 2  # one token row of the hidden arrays: aux (3H) + last (H), bf16


def checksum_bytes_per_row(hidden_size: int) -> float:
    """The crc32c every chunk of the two hidden arrays ends with, spread over the chunk's rows."""
    return len(HIDDEN_ARRAYS) * zarr_io.CHECKSUM_BYTES / Layout.for_hidden_size(hidden_size).chunk_rows


class StoreWriter:
    """Streams rows (in storage order) into a partial store; writes only whole zarr shards, in parallel."""

    def __init__(self, final: Path, num_tokens: int, hidden_size: int, metadata: dict[str, Any],
                 sequences: dict[str, np.ndarray | list[str]], writer_threads: int = 4,
                 shard_bytes: int = SHARD_BYTES):
        self.final, self.partial = final, atomic.partial_path(final)
        self.num_tokens, self.hidden_size = num_tokens, hidden_size
        self.layout = Layout.for_hidden_size(hidden_size, shard_bytes)
        self.metadata = metadata
        self.rows_written = self._resume_point(sequences)
        if self.rows_written == 0:
            self._create(sequences)
        self.group = zarr.open_group(str(self.partial), mode="r+")
        self.buffer_start = self.rows_written
        self.buffers: dict[str, list[np.ndarray]] = {name: [] for name in HIDDEN_ARRAYS}
        self.buffered = 0
        self.writer_threads = writer_threads
        self.pool = ThreadPoolExecutor(max_workers=writer_threads)
        self.pending: list[tuple[int, Future]] = []

    # -- set-up and resume
    def _resume_point(self, sequences: dict[str, Any]) -> int:
        progress_path = self.partial / PROGRESS_FILE
        if not progress_path.is_file():
            atomic.start_partial_dir(self.final)
            return 0
        progress = json.loads(progress_path.read_text())
        same = (progress.get("schema_version") == SCHEMA_VERSION  # an older partial store lacks checksums
                and progress.get("metadata") == _jsonable(self.metadata)
                and progress.get("num_tokens") == self.num_tokens
                and progress.get("layout") == [self.layout.chunk_rows, self.layout.rows_per_shard]
                and np.array_equal(zarr.open_group(str(self.partial), mode="r")["input_ids"][...],
                                   sequences["input_ids"]))
        if not same:  # written by other code or other inputs: start over
            atomic.start_partial_dir(self.final)
            return 0
        return int(progress["rows_written"])

    def _create(self, sequences: dict[str, Any]) -> None:
        group = zarr.open_group(str(self.partial), mode="w")
        chunk, shard = self.layout.chunk_rows, self.layout.rows_per_shard
        codecs = zarr_io.chunk_codecs(typesize=2)  # what zarr_io.encode_whole_shard writes
        group.create_array("aux_hidden_states", shape=(self.num_tokens, 3, self.hidden_size), dtype="uint16",
                           chunks=(chunk, 3, self.hidden_size), shards=(shard, 3, self.hidden_size),
                           compressors=codecs)
        group.create_array("last_hidden_states", shape=(self.num_tokens, self.hidden_size), dtype="uint16",
                           chunks=(chunk, self.hidden_size), shards=(shard, self.hidden_size), compressors=codecs)
        zarr_io.write_array(group, "input_ids", sequences["input_ids"].astype(np.int32))
        zarr_io.write_array(group, "loss_mask", sequences["loss_mask"].astype(np.uint8))
        zarr_io.write_array(group, "seq_offsets", sequences["seq_offsets"].astype(np.int64))
        zarr_io.write_strings(group, "sample_ids", list(sequences["sample_ids"]))
        self._save_progress(0)

    def _save_progress(self, rows: int) -> None:
        progress = {"rows_written": rows, "schema_version": SCHEMA_VERSION, "num_tokens": self.num_tokens,
                    "metadata": _jsonable(self.metadata),
                    "layout": [self.layout.chunk_rows, self.layout.rows_per_shard]}
        atomic.atomic_write(self.partial / PROGRESS_FILE, json.dumps(progress))

    # -- streaming
    def append(self, aux: np.ndarray, last: np.ndarray) -> None:
        """Add rows (uint16 bf16 bits) that follow the rows already given, in storage order."""
        self.buffers["aux_hidden_states"].append(aux)
        self.buffers["last_hidden_states"].append(last)
        self.buffered += len(aux)
        shard = self.layout.rows_per_shard
        while self.buffered >= shard or (self.buffered and self.buffer_start + self.buffered >= self.num_tokens):
            rows = min(shard, self.buffered)
            self._submit(self._take(rows))

    def _take(self, rows: int) -> dict[str, np.ndarray]:
        """The next `rows` buffered rows. Views where they lie in one appended batch; only a block that
        straddles two batches is copied (copying every batch cost the main thread as much as the forward)."""
        taken = {}
        for name, parts in self.buffers.items():
            pieces, needed = [], rows
            while needed:
                head = parts[0]
                if len(head) <= needed:
                    pieces.append(parts.pop(0))
                    needed -= len(head)
                else:
                    pieces.append(head[:needed])
                    parts[0] = head[needed:]
                    needed = 0
            taken[name] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        self.buffered -= rows
        return taken

    def _submit(self, block: dict[str, np.ndarray]) -> None:
        start = self.buffer_start
        end = start + len(block["aux_hidden_states"])
        self.buffer_start = end
        future = self.pool.submit(self._write_block, start, end, block)
        self.pending.append((end, future))
        self._retire(block_when_over=2 * self.writer_threads)

    def _write_block(self, start: int, end: int, block: dict[str, np.ndarray]) -> None:
        """Runs in a writer thread: encode and write one whole zarr shard of every hidden array."""
        shard = start // self.layout.rows_per_shard
        for name, data in block.items():
            payload = zarr_io.encode_whole_shard(data, self.layout.chunk_rows, self.layout.rows_per_shard)
            zarr_io.write_whole_shard(self.partial / name, shard, data.ndim - 1, payload)

    def _retire(self, block_when_over: int) -> None:
        """Record progress for the finished prefix of writes; wait if too many are in flight."""
        while self.pending and (self.pending[0][1].done() or len(self.pending) > block_when_over):
            end, future = self.pending.pop(0)
            future.result()
            self.rows_written = end
            self._save_progress(end)

    def finish(self, extra_attrs: dict[str, Any]) -> None:
        if self.buffered:
            raise RuntimeError(f"{self.buffered} rows still buffered at finish")
        self._retire(block_when_over=0)
        self.pool.shutdown()
        if self.rows_written != self.num_tokens:
            raise RuntimeError(f"wrote {self.rows_written} of {self.num_tokens} rows")
        attrs = {**self.metadata, **extra_attrs, "format": FORMAT, "schema_version": SCHEMA_VERSION,
                 "num_tokens": self.num_tokens, "hidden_size": self.hidden_size, "hidden_dtype": "bfloat16",
                 "rows_per_shard": self.layout.rows_per_shard, "chunk_rows": self.layout.chunk_rows,
                 "pipeline_version": __version__}
        self.group.attrs.update(attrs)
        (self.partial / PROGRESS_FILE).unlink()
        self.group.attrs["complete"] = True  # last
        atomic.commit_dir(self.partial, self.final)

    def abort(self) -> None:
        """On an error elsewhere: let submitted shard writes land and record them, so a rerun resumes after them."""
        try:
            self._retire(block_when_over=0)
        finally:
            self.pool.shutdown(wait=True)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# ---------------------------------------------------------------- reading and validation

class HiddenStore:
    """Read access for training: one sequence's arrays as tensors."""

    def __init__(self, path: Path, validate_store: bool = True):
        self.path = Path(path)
        self.attrs = validate(self.path) if validate_store else zarr_io.attrs(self.path)
        group = zarr_io.open_readonly(self.path)
        self.aux, self.last = group["aux_hidden_states"], group["last_hidden_states"]
        self.input_ids, self.loss_mask, self.seq_offsets = (self._read(name, group[name], 0, group[name].shape[0])
                                                            for name in ("input_ids", "loss_mask", "seq_offsets"))

    def __len__(self) -> int:
        return len(self.seq_offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)

    def sequence(self, j: int) -> dict[str, torch.Tensor]:
        import torch

        start, end = int(self.seq_offsets[j]), int(self.seq_offsets[j + 1])
        return {
            "input_ids": torch.from_numpy(self.input_ids[start:end].astype(np.int64)),
            "loss_mask": torch.from_numpy(self.loss_mask[start:end].copy()),
            "aux_hidden_states": u16_to_bf16(self._read("aux_hidden_states", self.aux, start, end)),
            "last_hidden_states": u16_to_bf16(self._read("last_hidden_states", self.last, start, end)),
        }

    def _read(self, name: str, array: zarr.Array, start: int, end: int) -> np.ndarray:
        return zarr_io.read_rows(self.path, name, array, start, end)  # CorruptChunk names store, array, chunk


def identity(path: Path) -> str:
    """A cheap content hash of a complete store: its attrs, its small arrays, and the checksum every chunk of
    the hidden arrays carries (a few bytes per chunk read, not the activations)."""
    import hashlib

    path = Path(path)
    group = zarr_io.open_readonly(path)
    attrs = dict(group.attrs)
    digest = hashlib.sha256(json.dumps(_jsonable(attrs), sort_keys=True).encode())
    for name in ("input_ids", "loss_mask", "seq_offsets"):
        digest.update(np.ascontiguousarray(zarr_io.read_rows(path, name, group[name], 0, group[name].shape[0])))
    digest.update("\0".join(str(s) for s in group["sample_ids"][...]).encode())
    chunks_per_shard = attrs["rows_per_shard"] // attrs["chunk_rows"]
    for name in HIDDEN_ARRAYS:
        files = (path / name / "c").rglob("*")
        for file in sorted((f for f in files if f.is_file()), key=lambda f: f.relative_to(path).parts):
            digest.update(str(file.relative_to(path)).encode())
            digest.update(zarr_io.stored_chunk_checksums(file, chunks_per_shard))
    return digest.hexdigest()


def validate(path: Path) -> dict[str, Any]:
    """Raise InvalidStore unless the store is complete and internally consistent; return its attrs."""
    path = Path(path)
    group, attrs = zarr_io.open_complete(path, FORMAT, "hidden-state store", InvalidStore, SCHEMA_VERSION,
                                         job="extract")
    num_tokens, hidden = attrs["num_tokens"], attrs["hidden_size"]
    expected_shapes = {"aux_hidden_states": (num_tokens, 3, hidden), "last_hidden_states": (num_tokens, hidden),
                       "input_ids": (num_tokens,), "loss_mask": (num_tokens,),
                       "seq_offsets": (attrs["num_sequences"] + 1,), "sample_ids": (attrs["num_sequences"],)}
    for name, shape in expected_shapes.items():
        if name not in group or group[name].shape != shape:
            raise InvalidStore(f"{path}: array {name} missing or of the wrong shape (expected {shape})")
    offsets = group["seq_offsets"][...]
    if offsets[0] != 0 or offsets[-1] != num_tokens or np.any(np.diff(offsets) <= 0):
        raise InvalidStore(f"{path}: seq_offsets do not cover {num_tokens} tokens")
    rows_per_shard = attrs["rows_per_shard"]
    for name in HIDDEN_ARRAYS:
        for index in range(math.ceil(num_tokens / rows_per_shard)):
            key = Path(name, "c", str(index), *["0"] * (group[name].ndim - 1))
            if not (path / key).is_file():  # zarr would read a missing shard file as zeros
                raise InvalidStore(f"{path}: zarr shard file {key} is missing")
    try:  # bounded: a sample of chunks of every array, one in every shard file (checks its index)
        zarr_io.verify_sample(path, group, tuple(expected_shapes))
    except zarr_io.CorruptChunk as exc:
        raise InvalidStore(str(exc)) from exc
    return attrs
