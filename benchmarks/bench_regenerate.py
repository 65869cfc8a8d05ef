"""Regeneration throughput, rolling pool vs fixed chunks, in one run (HF engine; CPU or GPU).

    python benchmarks/bench_regenerate.py --target results/<run>/target \\
        --conversations results/<run>/conversations/shard-00000.jsonl [--count 32 --batch 4 --max-new 24]

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

from eagle3_pipeline.formats import conversation_shards
from eagle3_pipeline.stages import regenerate
from eagle3_pipeline.tokenization import render
from eagle3_pipeline.workflow_config import schema_defaults


class CountingEngine:
    """The HF engine, counting rounds and histories (what a schedule buys is fuller rounds)."""

    def __init__(self, engine: regenerate.HFEngine):
        self.engine, self.rounds, self.histories, self.calls = engine, 0, 0, 0

    def reply(self, histories, seeds):
        self.rounds += 1
        self.histories += len(histories)
        self.calls += -(-len(histories) // self.engine.settings.batch_size)  # generate calls this round
        return self.engine.reply(histories, seeds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--conversations", type=Path, required=True)
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=24)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    log = logging.getLogger("bench")
    chats = conversation_shards.read(args.conversations)[: args.count]
    turns = sum(m["role"] == "assistant" for c in chats for m in c["messages"])
    settings = dataclasses.replace(regenerate.regenerate_settings(schema_defaults("regenerate"), max_seq_len=2048),
                                   max_new_tokens=args.max_new, batch_size=args.batch, device=args.device)
    engine = regenerate.HFEngine(args.target, settings)
    tokenizer = engine.tokenizer

    def count_tokens(history):
        return len(tokenizer(render(tokenizer, history, True), add_special_tokens=False)["input_ids"])

    engine.reply([chats[0]["messages"][:1]], [0])  # warm-up
    print(f"{len(chats)} conversations, {turns} assistant turns, batch {args.batch}, pool {4 * args.batch}, "
          f"up to {args.max_new} new tokens, {engine.device}")
    rates = {}
    for name, rolling in (("chunks", False), ("rolling", True)):
        counting = CountingEngine(engine)
        with tempfile.TemporaryDirectory() as scratch:
            start = time.perf_counter()
            _, counts = regenerate.regenerate_conversations(chats, counting, settings, count_tokens,
                                                            Path(scratch) / "progress.jsonl", name, log,
                                                            pool_size=4 * args.batch, rolling=rolling)
            elapsed = time.perf_counter() - start
        replies = counts["replies"]
        rates[name] = replies / elapsed
        print(f"  {name:<8} {elapsed:7.1f} s  {replies / elapsed:6.2f} replies/s  rounds {counting.rounds:3d}  "
              f"histories per round {counting.histories / max(counting.rounds, 1):5.1f}  generate calls "
              f"{counting.calls:3d} ({replies / max(counting.calls, 1):.2f} histories each)")
    print(f"  rolling / chunks = {rates['rolling'] / rates['chunks']:.2f}x")


if __name__ == "__main__":
    main()
