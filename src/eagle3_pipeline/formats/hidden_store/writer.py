"""Writing a hidden-state store: rows stream in (in storage order) and leave as whole zarr shards, in parallel.

Crash safety: the store is built in `<name>.partial`; `progress.json` there records how many rows are
durably written (whole zarr shards only), so a killed job resumes where it stopped. The store is renamed
into place after `complete` is set.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from eagle3_pipeline import __version__
from eagle3_pipeline.formats import atomic, zarr_io
from eagle3_pipeline.formats.hidden_store import FORMAT, PROGRESS_FILE, SCHEMA_VERSION, SHARD_BYTES, Layout, jsonable
from eagle3_pipeline.formats.hidden_store.rows import ArraySpec, hidden_arrays


class StoreWriter:
    """Streams rows (in storage order) into a partial store; writes only whole zarr shards, in parallel."""

    def __init__(self, final: Path, num_tokens: int, hidden_size: int, metadata: dict[str, Any],
                 sequences: dict[str, np.ndarray | list[str]], writer_threads: int = 4,
                 shard_bytes: int = SHARD_BYTES, store_dtype: str = "bfloat16"):
        self.final, self.partial = final, atomic.partial_path(final)
        self.num_tokens, self.hidden_size, self.store_dtype = num_tokens, hidden_size, store_dtype
        self.arrays = {spec.name: spec for spec in hidden_arrays(store_dtype, hidden_size)}
        self.layout = Layout.for_hidden_size(hidden_size, shard_bytes)
        self.metadata = {**metadata, "hidden_dtype": store_dtype}  # a partial store of another dtype restarts
        self.rows_written = self._resume_point(sequences)
        if self.rows_written == 0:
            self._create(sequences)
        self.group = zarr.open_group(str(self.partial), mode="r+")
        self.buffer_start = self.rows_written
        self.buffers: dict[str, list[np.ndarray]] = {name: [] for name in self.arrays}
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
                and progress.get("metadata") == jsonable(self.metadata)
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
        for spec in self.arrays.values():  # the codecs zarr_io.encode_whole_shard writes with
            group.create_array(spec.name, shape=(self.num_tokens, *spec.row_shape), dtype=spec.dtype,
                               chunks=(chunk, *spec.row_shape), shards=(shard, *spec.row_shape),
                               compressors=zarr_io.chunk_codecs(spec.itemsize, spec.shuffle))
        zarr_io.write_array(group, "input_ids", sequences["input_ids"].astype(np.int32))
        zarr_io.write_array(group, "loss_mask", sequences["loss_mask"].astype(np.uint8))
        zarr_io.write_array(group, "seq_offsets", sequences["seq_offsets"].astype(np.int64))
        zarr_io.write_strings(group, "sample_ids", list(sequences["sample_ids"]))
        self._save_progress(0)

    def _save_progress(self, rows: int) -> None:
        progress = {"rows_written": rows, "schema_version": SCHEMA_VERSION, "num_tokens": self.num_tokens,
                    "metadata": jsonable(self.metadata),
                    "layout": [self.layout.chunk_rows, self.layout.rows_per_shard]}
        atomic.atomic_write(self.partial / PROGRESS_FILE, json.dumps(progress))

    # -- streaming
    def append(self, rows: dict[str, Any]) -> None:
        """Add rows that follow the rows already given, in storage order: one array (numpy, or a CPU tensor) per
        store array, as `rows.encode` returns them."""
        if rows.keys() != self.arrays.keys():
            raise ValueError(f"rows for {sorted(rows)}; a {self.store_dtype} store holds {sorted(self.arrays)}")
        for name, data in rows.items():
            self.buffers[name].append(data.numpy() if hasattr(data, "numpy") else data)
        self.buffered += len(next(iter(rows.values())))
        shard = self.layout.rows_per_shard
        while self.buffered >= shard or (self.buffered and self.buffer_start + self.buffered >= self.num_tokens):
            self._submit(self._take(min(shard, self.buffered)))

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
        end = start + len(next(iter(block.values())))
        self.buffer_start = end
        future = self.pool.submit(self._write_block, start, block)
        self.pending.append((end, future))
        self._retire(block_when_over=2 * self.writer_threads)

    def _write_block(self, start: int, block: dict[str, np.ndarray]) -> None:
        """Runs in a writer thread: encode and write one whole zarr shard of every hidden array."""
        shard = start // self.layout.rows_per_shard
        for name, data in block.items():
            spec = self.arrays[name]
            payload = zarr_io.encode_whole_shard(data.astype(spec.dtype, copy=False), self.layout.chunk_rows,
                                                 self.layout.rows_per_shard, _codec(spec))
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
                 "num_tokens": self.num_tokens, "hidden_size": self.hidden_size,
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


def _codec(spec: ArraySpec) -> zarr_io.BloscCodec:
    return zarr_io.chunk_codecs(spec.itemsize, spec.shuffle)[0]


