"""Hidden-store write throughput, as ratios measured in one run.

    python benchmarks/bench_store_write.py [--hidden 4096] [--tokens 16384] [--threads 8]

Baseline: zarr's own write path (`array[a:b] = block`, one whole shard at a time), which is what the store
used before. Then our StoreWriter (shards encoded by numcodecs in writer threads) with 1 and N threads.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zarr

from eagle3_pipeline.formats import hidden_store, zarr_io


def activations(tokens: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    values = torch.from_numpy(rng.standard_normal((tokens, 4 * hidden), dtype=np.float32)).bfloat16()
    return (zarr_io.bf16_to_u16(values[:, : 3 * hidden].reshape(tokens, 3, hidden)),
            zarr_io.bf16_to_u16(values[:, 3 * hidden:]))


def zarr_baseline(workdir: Path, aux: np.ndarray, last: np.ndarray) -> float:
    layout = hidden_store.Layout.for_hidden_size(last.shape[1])
    group = zarr.open_group(str(workdir / "baseline.zarr"), mode="w")
    arrays = []
    for name, data in (("aux", aux), ("last", last)):
        arrays.append((group.create_array(name, shape=data.shape, dtype="uint16",
                                          chunks=(layout.chunk_rows,) + data.shape[1:],
                                          shards=(layout.rows_per_shard,) + data.shape[1:],
                                          compressors=zarr_io.chunk_codecs(2)), data))
    start = time.perf_counter()
    for row in range(0, len(aux), layout.rows_per_shard):
        for array, data in arrays:
            array[row: row + layout.rows_per_shard] = data[row: row + layout.rows_per_shard]
    return time.perf_counter() - start


def ours(workdir: Path, aux: np.ndarray, last: np.ndarray, threads: int) -> float:
    tokens, hidden = last.shape
    sequences = {"input_ids": np.zeros(tokens, np.int32), "loss_mask": np.ones(tokens, np.uint8),
                 "seq_offsets": np.array([0, tokens]), "sample_ids": ["all"]}
    out = workdir / f"ours-{threads}.zarr"
    writer = hidden_store.StoreWriter(out, tokens, hidden, {"num_sequences": 1}, sequences, writer_threads=threads)
    start = time.perf_counter()
    for row in range(0, tokens, 2048):  # batches arrive as extraction produces them
        writer.append({"aux_hidden_states": aux[row: row + 2048], "last_hidden_states": last[row: row + 2048]})
    writer.finish({})
    elapsed = time.perf_counter() - start
    hidden_store.validate(out)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    aux, last = activations(args.tokens, args.hidden)
    raw = aux.nbytes + last.nbytes
    workdir = Path(tempfile.mkdtemp(prefix="bench-store-"))
    try:
        base = zarr_baseline(workdir, aux, last)
        print(f"{raw / 1e9:.2f} GB raw bf16, hidden {args.hidden}")
        print(f"  zarr write path (baseline)  {raw / base / 1e9:6.2f} GB/s   1.00x")
        for threads in sorted({1, args.threads}):
            elapsed = ours(workdir, aux, last, threads)
            print(f"  ours, {threads:>2} writer threads     {raw / elapsed / 1e9:6.2f} GB/s   {base / elapsed:.2f}x")
    finally:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
