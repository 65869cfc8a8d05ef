import numpy as np
import pytest
import zarr

from eagle3_pipeline import vocab
from eagle3_pipeline.formats import draft_vocab, token_shards
from eagle3_pipeline.tokenization import TokenizedConversation


def sequences(rng, count=5):
    out = []
    for i in range(count):
        length = int(rng.integers(3, 20))
        out.append(TokenizedConversation(f"s{i}", rng.integers(0, 100, size=length).astype(np.int32),
                                         rng.integers(0, 2, size=length).astype(np.uint8)))
    return out


def test_token_shard_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    data = sequences(rng)
    path = tmp_path / "shard-00000.zarr"
    token_shards.write(path, data, {"template_hash": "abc"})
    shard = token_shards.read(path)
    assert shard.sample_ids == [s.sample_id for s in data]
    for j, s in enumerate(data):
        ids, mask = shard.sequence(j)
        assert np.array_equal(ids, s.input_ids) and np.array_equal(mask, s.loss_mask)
    assert shard.attrs["num_tokens"] == sum(len(s.input_ids) for s in data)
    assert shard.attrs["complete"] is True and shard.attrs["template_hash"] == "abc"
    assert not (tmp_path / "shard-00000.zarr.partial").exists()
    with pytest.raises(FileExistsError):
        token_shards.write(path, data, {})


def test_validator_rejects_incomplete_and_inconsistent_shards(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "s.zarr"
    token_shards.write(path, sequences(rng), {})
    group = zarr.open_group(str(path), mode="r+")
    group.attrs["num_tokens"] = 1
    with pytest.raises(token_shards.InvalidTokenShard, match="token count"):
        token_shards.validate(path)
    group.attrs["complete"] = False
    with pytest.raises(token_shards.InvalidTokenShard, match="not a complete"):
        token_shards.validate(path)
    with pytest.raises(token_shards.InvalidTokenShard, match="does not exist"):
        token_shards.validate(tmp_path / "missing.zarr")


def test_draft_vocab_mapping_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    ids = rng.zipf(1.3, size=5000).clip(max=999).astype(np.int32)
    mask = (rng.random(5000) < 0.7).astype(np.uint8)
    counts = vocab.count_tokens(ids, mask, vocab_size=1000)
    draft = vocab.select(counts, 64)
    assert np.all(np.diff(draft.draft_ids) > 0)
    d2t, t2d = draft.d2t, draft.t2d
    assert np.array_equal(np.arange(64) + d2t, draft.draft_ids)
    assert t2d.dtype == bool and t2d.sum() == 64 and np.array_equal(np.flatnonzero(t2d), draft.draft_ids)
    # every chosen id is at least as frequent as every id left out
    assert counts[draft.draft_ids].min() >= np.delete(counts, draft.draft_ids).max()
    path = tmp_path / "v.safetensors"
    draft_vocab.write(path, draft)
    loaded = draft_vocab.read(path)
    assert np.array_equal(loaded.draft_ids, draft.draft_ids) and np.array_equal(loaded.counts, counts)


def test_draft_vocab_counts_only_masked_tokens():
    ids = np.array([5, 5, 5, 7, 7, 9], dtype=np.int32)
    mask = np.array([0, 0, 0, 1, 1, 1], dtype=np.uint8)
    draft = vocab.select(vocab.count_tokens(ids, mask, 10), 2)
    assert draft.draft_ids.tolist() == [7, 9]
    with pytest.raises(ValueError):
        vocab.select(np.zeros(10, dtype=np.int64), 11)


def test_systemic_failures_stop_the_job_and_a_few_bad_records_do_not():
    from eagle3_pipeline import systemic

    fixes = {"dropped_template_error": "set target.chat_template"}
    systemic.check("tokenize", "s", 100, 96, {"dropped_template_error": 4}, fixes, "x")  # a few: counted
    systemic.check("tokenize", "s", 8, 4, {"dropped_template_error": 4}, fixes, "x")  # half of a handful
    with pytest.raises(systemic.SystemicFailure, match=r"60 of 100 records failed with dropped_template_error"
                                                       r".*Fix: set target.chat_template"):
        systemic.check("tokenize", "s", 100, 40, {"dropped_template_error": 60, "dropped_overlength": 0}, fixes, "x")
    with pytest.raises(systemic.SystemicFailure, match="3 of 3 .*nothing is left"):
        systemic.check("tokenize", "s", 3, 0, {"dropped_template_error": 3}, fixes, "x")


def test_vocab_refuses_shards_without_assistant_tokens(tmp_path, target_dir):
    from eagle3_pipeline.logs import ClearError
    from eagle3_pipeline.stages import vocab as vocab_stage

    rng = np.random.default_rng(0)
    data = sequences(rng)
    for s in data:
        s.loss_mask[:] = 0
    token_shards.write(tmp_path / "shard-00000.zarr", data, {})
    import logging

    with pytest.raises(ClearError, match="no assistant tokens"):
        vocab_stage.build_vocab([tmp_path / "shard-00000.zarr"], target_dir, 100, tmp_path / "v.safetensors",
                                logging.getLogger("test"))
    assert not (tmp_path / "v.safetensors").exists()


def test_vocab_reads_a_multimodal_targets_nested_vocabulary(tmp_path):
    """Gemma 3's image-text config keeps vocab_size under text_config, none at the top level."""
    import logging

    from transformers import Gemma3Config, Gemma3TextConfig

    from eagle3_pipeline.stages import vocab as vocab_stage

    target = tmp_path / "target"
    Gemma3Config(text_config=Gemma3TextConfig(vocab_size=1000)).save_pretrained(target)
    token_shards.write(tmp_path / "shard-00000.zarr", sequences(np.random.default_rng(0)), {})
    stats = vocab_stage.build_vocab([tmp_path / "shard-00000.zarr"], target, 100, tmp_path / "v.safetensors",
                                    logging.getLogger("test"))
    assert stats["vocab_size"] == 1000 and stats["draft_vocab_size"] <= 100
