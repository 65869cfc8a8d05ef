"""The disk plan's arithmetic on a known layout of real files: one shard tokenized (exact), one with its
conversation shard only (estimated from characters), one with nothing yet (estimated from the raw input's size).
Every number below is worked out by hand from the documented rules (plan.py: 4.1 characters per token, 5
template tokens per message and one more per conversation, 2.5 bytes per token in a token shard)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3_pipeline import plan
from eagle3_pipeline.formats import token_shards
from eagle3_pipeline.tokenization import TokenizedConversation

SHARDS = ["00000", "00001", "00002"]
MAX_SEQ_LEN = 256


def token_shard(path, lengths: list[int]) -> None:
    token_shards.write(path, [TokenizedConversation(f"s{i}", np.arange(n, dtype=np.int32), np.ones(n, np.uint8))
                              for i, n in enumerate(lengths)], {})


def conversation(chars_per_message: list[int]) -> dict:
    roles = ["user", "assistant"] * len(chars_per_message)
    return {"id": "c", "messages": [{"role": role, "content": "x" * n}
                                    for role, n in zip(roles, chars_per_message, strict=False)]}


@pytest.fixture
def layout(tmp_path):
    run = tmp_path / "results" / "run"
    paths = {"token_shard": str(run / "tokens" / "shard-{shard}.zarr"),
             "conversation_shard": str(run / "conversations" / "shard-{shard}.jsonl"),
             "hidden_store": str(run / "hidden" / "shard-{shard}.zarr")}
    token_shard(run / "tokens" / "shard-00000.zarr", [10, 20, 30])
    (run / "conversations").mkdir(parents=True)
    # 100 chars, 2 messages: 100/4.1 + 5*3 = 39.4 -> 39; 4 x 400 chars: 1600/4.1 + 25 = 415 -> capped at 256
    lines = [json.dumps(conversation([60, 40])), json.dumps(conversation([400] * 4))]
    (run / "conversations" / "shard-00001.jsonl").write_text("\n".join(lines) + "\n")
    raw = tmp_path / "chats.json"
    raw.write_text(json.dumps([{"conversations": [{"from": "human", "value": "y" * 500}]}] * 10))
    return tmp_path, run, paths, raw


def build(tmp_path, paths, raw, hidden_size: int | None = 64):
    data = {"max_seq_len": MAX_SEQ_LEN, "num_shards": 3, "train_conversations": None}
    return plan.build(SHARDS, paths, [raw], data, hidden_size, 1.4, tmp_path / "results")


def test_tokens_are_exact_where_shards_exist_and_estimated_otherwise(layout):
    tmp_path, run, paths, raw = layout
    tokens = build(tmp_path, paths, raw).stages[0]
    raw_estimate = int(min(raw.stat().st_size / 10 / 4.1, MAX_SEQ_LEN) * 10 / 3)  # 10 records over 3 shards
    assert [(s.name, s.tokens, s.exact, s.exists) for s in tokens.shards] == [
        ("00000", 60, True, True), ("00001", 39 + 256, False, False), ("00002", raw_estimate, False, False)]
    assert tokens.source == "exact+estimate (characters)" and tokens.tokens == 60 + 295 + raw_estimate
    assert (tokens.raw_bytes_per_token, tokens.expected_bytes_per_token) == (5, 2.5)
    assert tokens.total_bytes == int(tokens.tokens * 2.5)
    assert tokens.pending_bytes == int((295 + raw_estimate) * 2.5)  # shard 00000 is written already
    assert tokens.shard_bytes("00001") == int(295 * 2.5)


def test_hidden_bytes_per_token_follow_the_hidden_size(layout):
    tmp_path, run, paths, raw = layout
    disk = build(tmp_path, paths, raw)
    tokens, hidden = disk.stages
    # 4 bf16 vectors of 64 (3 aux + last) = 512 bytes + id and mask = 5; on disk the hidden part compressed
    # 1.4x, id + mask 2x, and a 4-byte crc32c per chunk of each hidden array (2 MiB of aux rows = 4096 rows)
    assert hidden.raw_bytes_per_token == 517
    assert hidden.expected_bytes_per_token == pytest.approx(512 / 1.4 + 2.5 + 2 * 4 / 4096)
    assert [s.tokens for s in hidden.shards] == [s.tokens for s in tokens.shards]
    assert hidden.pending_bytes == hidden.total_bytes == int(tokens.tokens * hidden.expected_bytes_per_token)
    assert disk.pending == tokens.pending_bytes + hidden.pending_bytes
    assert disk.fits == (disk.pending <= disk.free) and not disk.hidden_size_unknown


def test_the_printed_plan_shows_the_same_numbers(layout):
    tmp_path, run, paths, raw = layout
    disk = build(tmp_path, paths, raw)
    tokens, hidden = disk.stages
    rows = {line.split()[0]: line for line in disk.lines()[2:4]}
    assert rows["tokens"].split()[1] == f"{tokens.tokens:,}" and rows["tokens"].endswith("exact+estimate (characters)")
    assert rows["hidden"].split()[2:4] == ["517.0", f"{hidden.expected_bytes_per_token:.1f}"]
    assert disk.lines()[-1].endswith(f"{plan.human_bytes(disk.pending)} -> {'fits' if disk.fits else 'DOES NOT FIT'}")


def test_once_every_shard_is_tokenized_the_plan_is_exact_and_only_hidden_bytes_remain(layout):
    tmp_path, run, paths, raw = layout
    token_shard(run / "tokens" / "shard-00001.zarr", [7, 8])
    token_shard(run / "tokens" / "shard-00002.zarr", [100])
    tokens, hidden = build(tmp_path, paths, raw).stages
    assert [s.tokens for s in tokens.shards] == [60, 15, 100] and tokens.source == hidden.source == "exact"
    assert tokens.pending_bytes == 0 and hidden.pending_bytes == int(175 * hidden.expected_bytes_per_token)


def test_an_unknown_hidden_size_leaves_the_hidden_stage_out_and_says_so(layout):
    tmp_path, run, paths, raw = layout
    disk = build(tmp_path, paths, raw, hidden_size=None)
    assert [s.stage for s in disk.stages] == ["tokens"] and disk.hidden_size_unknown
    assert disk.blind_for({"extract"}) and not disk.blind_for({"tokenize"})
