"""Extraction throughput, all in one run, as ratios (absolute times on shared machines mean little).

    python benchmarks/bench_extract.py --target results/<run>/target --tokens results/<run>/tokens/shard-00000.zarr

Rows: seed-style baseline (one sequence at a time, output_hidden_states=True, copy to host); forward-only
ceiling (our batches, hooks, no copy, no write); ours end to end (extract_shard, zarr write included).
With --big, the same on an 8B-shaped Llama with random weights and 2048-token sequences.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eagle3_pipeline import plan
from eagle3_pipeline.formats import hidden_store, token_shards, zarr_io
from eagle3_pipeline.formats.hidden_store import storage_order
from eagle3_pipeline.runtime.extraction.hf import HFBackend, pick_device, pick_dtype
from eagle3_pipeline.stages.extract import extract_shard, plan_batches
from eagle3_pipeline.tokenization import TokenizedConversation

log = logging.getLogger("bench")


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def seed_style(model, sequences, aux_ids, device) -> float:
    """What the seed did: one sequence per forward, every layer materialised, copied to the host."""
    start, tokens = time.perf_counter(), 0
    with torch.inference_mode():
        for ids in sequences:
            out = model(torch.from_numpy(ids.astype(np.int64))[None].to(device), output_hidden_states=True)
            states = [out.hidden_states[i][0].cpu() for i in aux_ids] + [out.hidden_states[-1][0].cpu()]
            tokens += len(ids)
            del states
    sync(device)
    return tokens / (time.perf_counter() - start)


def forward_ceiling(backend, sequences, budget, device) -> float:
    lengths = np.array([len(s) for s in sequences])
    order = storage_order(lengths)
    ordered = [sequences[i] for i in order]
    batches = plan_batches(lengths[order], budget)
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        backend.forward([ordered[j] for j in batch.sequences])
    sync(device)
    return int(lengths.sum()) / (time.perf_counter() - start)


def ours(backend, shard_path, budget, writer_threads, workdir) -> tuple[float, int, int]:
    out = workdir / "bench.zarr"
    if out.exists():
        shutil.rmtree(out)
    start = time.perf_counter()
    attrs = extract_shard(backend, shard_path, out, budget, writer_threads, {}, log)
    elapsed = time.perf_counter() - start
    return attrs["num_tokens"] / elapsed, attrs["num_tokens"], zarr_io.directory_bytes(out)


def disk_write_rate(workdir: Path, total_bytes: int, threads: int, piece: int = 64 << 20) -> float:
    """Bytes/s of plain file writes (64 MiB files, `threads` at once, no fsync: like the store writer)."""
    from concurrent.futures import ThreadPoolExecutor

    target = workdir / "disk-ceiling"
    target.mkdir(exist_ok=True)
    data = np.random.default_rng(0).integers(0, 255, piece, dtype=np.uint8).tobytes()
    count = max(1, total_bytes // piece)

    def write(i: int) -> None:
        with open(target / f"f{i}", "wb") as handle:
            handle.write(data)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(count)))
    rate = count * piece / (time.perf_counter() - start)
    shutil.rmtree(target)
    return rate


def report(name, baseline, ceiling, ours_rate, tokens, disk, hidden):
    raw = tokens * plan.hidden_bytes_per_token(hidden, 1)[0]
    print(f"\n== {name} ({tokens:,} tokens)")
    print(f"  {'seed-style baseline':<28}{baseline:>14,.0f} tokens/s   1.00x")
    print(f"  {'forward-only ceiling':<28}{ceiling:>14,.0f} tokens/s   {ceiling / baseline:.2f}x")
    print(f"  {'ours end to end (zarr)':<28}{ours_rate:>14,.0f} tokens/s   {ours_rate / baseline:.2f}x "
          f"baseline, {ours_rate / ceiling:.2f}x ceiling")
    print(f"  bytes/token on disk {disk / tokens:,.0f} vs raw {raw / tokens:,.0f}: compression {raw / disk:.3f}x, "
          f"write rate {disk / (tokens / ours_rate) / 1e9:.2f} GB/s on disk, "
          f"{raw / (tokens / ours_rate) / 1e9:.2f} GB/s raw")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=Path)
    parser.add_argument("--tokens", type=Path)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--budget", type=int, default=65536)
    parser.add_argument("--writer-threads", type=int, nargs="+", default=[1, 8],
                        help="the 8B run is repeated for each count; the SmolLM2 run uses the largest")
    parser.add_argument("--baseline-sequences", type=int, default=200)
    parser.add_argument("--big", action="store_true", help="also the 8B-shaped random Llama")
    parser.add_argument("--big-sequences", type=int, default=64,
                        help="more sequences weigh the pipeline's fill and drain (one batch each) less")
    parser.add_argument("--only-big", action="store_true", help="only the 8B-shaped run (no --target/--tokens)")
    args = parser.parse_args()
    if not args.only_big and not (args.target and args.tokens):
        parser.error("--target and --tokens are required unless --only-big")
    logging.basicConfig(level=logging.WARNING)
    device = pick_device(args.device)
    workdir = Path(tempfile.mkdtemp(prefix="bench-extract-"))

    if args.only_big:
        big(args, device, workdir)
        shutil.rmtree(workdir)
        return
    from eagle3_pipeline.runtime.target.loading import load_model

    model = load_model(args.target, device=device, dtype=pick_dtype("auto", device))
    backend = HFBackend(model)
    shard = token_shards.read(args.tokens)
    sequences = [shard.sequence(j)[0] for j in range(len(shard))]
    aux = list(backend.info.aux_layer_ids)
    forward_ceiling(backend, sequences[:50], args.budget, device)  # warm-up
    baseline = seed_style(model, sequences[: args.baseline_sequences], aux, device)
    ceiling = forward_ceiling(backend, sequences, args.budget, device)
    rate, tokens, disk = ours(backend, args.tokens, args.budget, max(args.writer_threads), workdir)
    report(f"SmolLM2-135M, real ShareGPT shard {args.tokens.name}, {device}", baseline, ceiling, rate, tokens, disk,
           backend.info.hidden_size)
    del model, backend
    if args.big:
        big(args, device, workdir)
    shutil.rmtree(workdir)


def big(args, device, workdir) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 128256, 2048).astype(np.int32) for _ in range(args.big_sequences)]
    shard_path = workdir / "big-tokens.zarr"
    token_shards.write(shard_path, [TokenizedConversation(f"r{i}", s, np.ones(2048, np.uint8))
                                    for i, s in enumerate(sequences)], {})
    backend = HFBackend(model)
    forward_ceiling(backend, sequences[:8], 16384, device)
    baseline = seed_style(model, sequences[:8], list(backend.info.aux_layer_ids), device)
    ceiling = forward_ceiling(backend, sequences, 16384, device)
    for threads in sorted(set(args.writer_threads)):
        rate, tokens, disk = ours(backend, shard_path, 16384, threads, workdir)
        report(f"8B-shaped Llama (random weights, 2048-token sequences), {device}, {threads} writer thread(s)",
               baseline, ceiling, rate, tokens, disk, 4096)
        hidden_store.validate(workdir / "bench.zarr")
        print(f"  plain file writes of the same bytes, {threads} thread(s): "
              f"{disk_write_rate(workdir, disk, threads) / 1e9:.2f} GB/s (this disk's ceiling for the writer)")


if __name__ == "__main__":
    main()
