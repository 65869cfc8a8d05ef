"""Regeneration throughput, rolling pool vs fixed chunks, in one run (HF engine; CPU or GPU); with
--temperature T, greedy vs sampled replies (T, --samples N per conversation) instead, both in rolling pools;
with --compiled, the eager engine (dynamic cache) vs the compiled one (static caches, padded batches, the decode
step through torch.compile: regenerate.compile), both in rolling pools at --temperature (default greedy); with
--vllm, the HF engine (compiled with --compiled, else eager) vs vLLM's offline engine (regenerate.engine: vllm; a
CUDA GPU and the vllm package; CUDA graphs with --compiled, else eager) with --batch sequences at once and the
stage's pool for it (16 x batch), each engine's start and warm-up excluded.

    python benchmarks/bench_regenerate.py --target results/<run>/target \\
        --conversations results/<run>/conversations/shard-00000.jsonl [--count 32 --batch 4 --max-new 24]
        [--temperature 0.8 --samples 2] [--compiled] [--vllm]

Both schedules regenerate the same conversations with the same settings. "chunks" refills its pool of
conversations only when all have finished (a chunk waits for its longest conversation); "rolling" refills
as conversations finish, so every round asks for a full pool of replies. Prints generated tokens/s,
rounds, generate calls and histories per call, and the ratio. On a GPU a `generate` call costs about
the same for 1 or `batch` histories, so calls (not rounds) are what the schedule should reduce.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
import time
from pathlib import Path

from eagle3_pipeline.config_schema import schema_defaults
from eagle3_pipeline.formats import conversation_shards
from eagle3_pipeline.runtime.generation import tokenize_histories
from eagle3_pipeline.runtime.generation.hf import HFEngine
from eagle3_pipeline.stages import regenerate


class CountingEngine:
    """An engine, counting rounds, histories and generate calls (what a schedule buys is fuller rounds)."""

    def __init__(self, engine, calls_per_round=None):
        self.engine, self.rounds, self.histories, self.calls = engine, 0, 0, 0
        # HF: a generate call per batch_size histories; vLLM: one per round
        self.calls_per_round = calls_per_round or (lambda n: -(-n // engine.settings.batch_size))

    def reply(self, prompts, seeds):
        self.rounds += 1
        self.histories += len(prompts)
        self.calls += self.calls_per_round(len(prompts))
        return self.engine.reply(prompts, seeds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--conversations", type=Path, required=True)
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=24)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--temperature", type=float, help="compare greedy with sampled replies at this temperature")
    parser.add_argument("--samples", type=int, default=1, help="replies per conversation when sampling")
    parser.add_argument("--compiled", action="store_true",
                        help="compare the eager engine with the compiled one (its compile time excluded)")
    parser.add_argument("--vllm", action="store_true",
                        help="compare the HF engine (compiled with --compiled) with vLLM's offline engine")
    parser.add_argument("--kv-cache-gb", type=float, default=8.0,
                        help="vLLM's KV cache in GiB (regenerate.kv_cache_gb): a fixed size, not one profiled while "
                             "other jobs on the GPU take or free memory, which stops vLLM's start")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    log = logging.getLogger("bench")
    chats = conversation_shards.read(args.conversations)[: args.count]
    turns = sum(m["role"] == "assistant" for c in chats for m in c["messages"])
    settings = dataclasses.replace(regenerate.regenerate_settings(schema_defaults("regenerate"), max_seq_len=2048),
                                   max_new_tokens=args.max_new, batch_size=args.batch, device=args.device,
                                   compile=False)
    engine = HFEngine(args.target, settings)
    tokenizer = engine.tokenizer

    def prepare(histories):
        return tokenize_histories(tokenizer, histories, {}, max_characters=10**9)

    engines = {"eager": engine}
    arms = [("chunks", settings, False), ("rolling", settings, True)]
    if args.temperature is not None:
        sampled = dataclasses.replace(settings, temperature=args.temperature, samples=args.samples)
        arms = [("greedy", settings, True), (f"T={args.temperature} x{args.samples}", sampled, True)]
    arm = dataclasses.replace(settings, temperature=args.temperature or 0.0, samples=args.samples)
    if args.compiled:
        engines["compiled"] = HFEngine(args.target, dataclasses.replace(arm, compile=True))
        arms = [("eager", arm, True), ("compiled", arm, True)]
    if args.vllm:
        from eagle3_pipeline.runtime.generation.vllm_local import VLLMEngine

        hf = "compiled" if args.compiled else "eager"
        served = dataclasses.replace(arm, engine="vllm", device="auto", compile=args.compiled,
                                     kv_cache_gb=args.kv_cache_gb)
        engines["vllm"] = VLLMEngine(args.target, served, log)
        arms = [(hf, arm, True), ("vllm", served, True)]
    for name, warm in engines.items():  # warm-up: a history per static cache size (each compiles once)
        start = time.perf_counter()
        for size in (512, 1024, 2048):
            words = size - args.max_new - 40  # ~a token a word: a history that needs this size
            warm.reply(prepare([[{"role": "user", "content": "word " * words}]]), [0])
        print(f"  warm-up {name}: {time.perf_counter() - start:.1f} s")
    print(f"{len(chats)} conversations, {turns} assistant turns, batch {args.batch}, pool {4 * args.batch} (vLLM's "
          f"{16 * args.batch}), "
          f"up to {args.max_new} new tokens, {engine.device}")
    rates = {}
    for name, arm, rolling in arms:
        engine = engines.get(name, engines["eager"])
        counting = CountingEngine(engine, (lambda n: 1) if name == "vllm" else None)
        if name != "vllm":
            engine.settings = dataclasses.replace(arm, compile=engine.compiled)
        with tempfile.TemporaryDirectory() as scratch:
            start = time.perf_counter()
            kept, counts = regenerate.regenerate_conversations(chats, counting, arm, prepare,
                                                               Path(scratch) / "progress.jsonl", name, log,
                                                               pool_size=(16 if name == "vllm" else 4) * args.batch,
                                                               rolling=rolling)
            elapsed = time.perf_counter() - start
        replies = counts["replies"]
        tokens = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                     for c in kept for m in c["messages"] if m["role"] == "assistant")
        rates[name] = tokens / elapsed
        print(f"  {name:<10} {elapsed:7.1f} s  {replies / elapsed:6.2f} replies/s  {tokens / elapsed:8.1f} reply "
              f"tokens/s  rounds {counting.rounds:3d}  histories per round "
              f"{counting.histories / max(counting.rounds, 1):5.1f}  generate calls {counting.calls:3d} "
              f"({replies / max(counting.calls, 1):.2f} histories each)")
    (base, _, _), (other, _, _) = arms
    print(f"  {other} / {base} = {rates[other] / rates[base]:.2f}x (reply tokens/s)")
    # the useful work: 2 FLOPs per weight per kept reply token (attention and padded rows left out)
    weights = sum(parameter.numel() for parameter in engines["eager"].model.parameters())
    for name, rate in rates.items():
        print(f"  {name}: {2 * weights * rate / 1e12:.3f} TFLOP/s of reply tokens ({weights / 1e6:.0f} M weights; an "
              f"H200's dense bf16 peak is ~989)")

if __name__ == "__main__":
    main()
