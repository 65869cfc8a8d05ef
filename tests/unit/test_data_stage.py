"""The data stage's functions called directly on a tiny input with the real SmolLM2 tokenizer: ingest and split a
raw ShareGPT file, tokenize a shard (an over-long conversation dropped and counted), build the draft vocab."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from eagle3_pipeline import conversations
from eagle3_pipeline.formats import draft_vocab, token_shards
from eagle3_pipeline.formats.target_dir import read_identity
from eagle3_pipeline.logs import ClearError
from eagle3_pipeline.stages import tokenize as tokenize_stage
from eagle3_pipeline.stages import vocab as vocab_stage
from eagle3_pipeline.tokenization import TokenizedConversation
from tests.conftest import sharegpt_record, tiny_conversations

LOG = logging.getLogger("test")
LONG_REPLY = "word " * 600  # ~600 tokens: over max_seq_len below


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[list[dict]]:
    """12 tiny conversations and one over-long one, ingested from a real file and split into 2 shards."""
    raw = tmp_path_factory.mktemp("raw") / "chats.json"
    records = tiny_conversations(12) + [sharegpt_record("long", [("human", "Talk."), ("gpt", LONG_REPLY)])]
    raw.write_text(json.dumps(records))
    kept, report = conversations.ingest([raw])
    assert len(kept) == 13 and report.as_dict()["conversations_kept"] == 13
    train, held_out, selection, _ = conversations.split(kept, num_shards=2, eval_count=0, selection_count=0,
                                                     train_count=None, seed=0)
    assert held_out == selection == [] and sorted(len(s) for s in train) == [6, 7]
    return train


def tokenize(shard: list[dict], tokenizer, target_dir, output):
    return tokenize_stage.tokenize_shard(shard, tokenizer, target_dir, output, max_seq_len=256, overlength="drop",
                               end_of_turn=None, source_name="shard", log=LOG)


def test_a_shard_holds_each_conversations_tokens_with_the_replies_masked(shards, smollm2_tokenizer, target_dir,
                                                                         tmp_path):
    for i, shard in enumerate(shards):
        attrs = tokenize(shard, smollm2_tokenizer, target_dir, tmp_path / f"shard-{i}.zarr")
        written = token_shards.read(tmp_path / f"shard-{i}.zarr")
        has_long = any(c["id"].endswith("long") for c in shard)
        assert attrs["conversations_in"] == len(shard) and len(written) == len(shard) - has_long
        assert attrs.get("dropped_overlength", 0) == has_long
        assert attrs["target_hash"] == read_identity(target_dir)["content_hash"]
        assert attrs["end_of_turn"] == "<|im_end|>" and attrs["num_tokens"] == len(written.input_ids)
        by_id = {c["id"]: c for c in shard}
        for j, sample_id in enumerate(written.sample_ids):
            ids, mask = written.sequence(j)
            replies = "".join(m["content"] + "<|im_end|>" for m in by_id[sample_id]["messages"]
                              if m["role"] == "assistant")
            assert smollm2_tokenizer.decode(ids[mask.astype(bool)]) == replies


def test_the_draft_vocab_is_the_most_frequent_reply_tokens(shards, smollm2_tokenizer, target_dir, tmp_path):
    paths = [tmp_path / f"shard-{i}.zarr" for i in range(len(shards))]
    for shard, path in zip(shards, paths, strict=True):
        tokenize(shard, smollm2_tokenizer, target_dir, path)
    stats = vocab_stage.build_vocab(paths, target_dir, 50, tmp_path / "vocab.safetensors", LOG)
    draft = draft_vocab.read(tmp_path / "vocab.safetensors")
    masked = np.concatenate([s.input_ids[s.loss_mask.astype(bool)] for s in map(token_shards.read, paths)])
    counts = np.bincount(masked, minlength=49152)
    assert np.array_equal(draft.counts, counts)
    assert len(draft.draft_ids) == 50 and np.all(np.diff(draft.draft_ids) > 0)
    chosen = np.zeros(49152, bool)
    chosen[draft.draft_ids] = True
    assert counts[chosen].min() >= counts[~chosen].max()  # no id left out is more frequent than one kept
    assert stats["coverage"] == pytest.approx(counts[chosen].sum() / counts.sum())
    assert stats["total_loss_tokens"] == len(masked) and stats["distinct_assistant_tokens"] == int((counts > 0).sum())


def test_shards_without_assistant_tokens_stop_the_vocab_naming_the_settings(target_dir, tmp_path):
    path = tmp_path / "no-loss.zarr"
    token_shards.write(path, [TokenizedConversation("a", np.arange(5, dtype=np.int32), np.zeros(5, np.uint8))], {})
    with pytest.raises(ClearError, match=r"no assistant tokens \(1 shards\).*data.end_of_turn, target.chat_template"):
        vocab_stage.build_vocab([path], target_dir, 50, tmp_path / "vocab.safetensors", LOG)
    assert not (tmp_path / "vocab.safetensors").exists()
