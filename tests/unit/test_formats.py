"""One round trip per artifact format (write -> read -> equal) and a broken file rejected by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from eagle3_pipeline.formats import (
    atomic,
    conversation_shards,
    draft_vocab,
    drafter_weights,
    evaluation,
    hidden_store,
    journal,
    metrics,
    serving_dir,
    target_dir,
    token_shards,
    train_state,
)
from eagle3_pipeline.tokenization import TokenizedConversation


def truncate(path, keep: int = 40) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# ---------------------------------------------------------------- the commit step

def test_atomic_write_replaces_the_file_and_leaves_no_partial(tmp_path):
    path = tmp_path / "a.json"
    atomic.atomic_write(path, "first")
    atomic.atomic_write(path, b"\x00second")
    assert path.read_bytes() == b"\x00second"
    assert not atomic.partial_path(path).exists()


def test_atomic_dir_commits_only_a_finished_directory(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic.atomic_dir(final) as partial:
        partial.mkdir()
        raise RuntimeError("killed")
    assert not final.exists() and partial.exists()  # the next attempt removes the leftover
    with atomic.atomic_dir(final) as partial:
        partial.mkdir()
        (partial / "x").write_text("done")
    assert (final / "x").read_text() == "done" and not partial.exists()
    with pytest.raises(FileExistsError, match=str(final)), atomic.atomic_dir(final) as partial:
        partial.mkdir()
    with atomic.atomic_dir(final, replace=True) as partial:
        partial.mkdir()
    assert not (final / "x").exists()


# ---------------------------------------------------------------- data

def test_conversation_shard_round_trip_and_a_broken_line(tmp_path):
    path = tmp_path / "shard-00000.jsonl"
    records = [{"id": "a", "source": "x.json", "messages": [{"role": "user", "content": "héllo ✓"},
                                                            {"role": "assistant", "content": "hi"}]}]
    conversation_shards.write(path, records)
    assert conversation_shards.read(path) == records
    assert "héllo ✓" in path.read_text(encoding="utf-8")  # UTF-8, not escaped
    assert conversation_shards.validate(path) == 1
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"id": "b", "messages": [{"role": "user"}]}\n')
    with pytest.raises(conversation_shards.InvalidConversationShard, match=rf"{path} line 2: .*'b'"):
        conversation_shards.validate(path)


def test_token_shard_round_trip_and_a_missing_array(tmp_path):
    path = tmp_path / "shard-00000.zarr"
    sequences = [TokenizedConversation("s0", np.arange(5, dtype=np.int32), np.array([0, 0, 1, 1, 1], np.uint8)),
                 TokenizedConversation("s1", np.arange(3, dtype=np.int32), np.ones(3, np.uint8))]
    token_shards.write(path, sequences, {"template_hash": "t"})
    shard = token_shards.read(path)
    assert shard.sample_ids == ["s0", "s1"] and shard.attrs["template_hash"] == "t"
    for j, sequence in enumerate(sequences):
        ids, mask = shard.sequence(j)
        assert np.array_equal(ids, sequence.input_ids) and np.array_equal(mask, sequence.loss_mask)
    shutil.rmtree(path / "seq_offsets")
    with pytest.raises(token_shards.InvalidTokenShard, match=str(path)):
        token_shards.validate(path)


def small_bf16_store(path, offsets: np.ndarray, seed: int, hidden: int = 16):
    """A real bf16 store of random states in two sequences, 4 KiB zarr shard files (many files, one chunk or a
    few each): (aux, last, the sequences' arrays)."""
    rng = np.random.default_rng(seed)
    tokens = int(offsets[-1])
    aux = torch.from_numpy(rng.standard_normal((tokens, 3, hidden), dtype=np.float32)).bfloat16()
    last = torch.from_numpy(rng.standard_normal((tokens, hidden), dtype=np.float32)).bfloat16()
    sequences = {"input_ids": rng.integers(0, 50, tokens).astype(np.int32), "loss_mask": np.ones(tokens, np.uint8),
                 "seq_offsets": offsets, "sample_ids": ["a", "b"]}
    writer = hidden_store.StoreWriter(path, tokens, hidden, {"num_sequences": 2, "aux_layer_ids": [1, 2, 3]},
                                      sequences, writer_threads=2, shard_bytes=4 << 10)
    writer.append(hidden_store.encode(aux, last, "bfloat16"))
    writer.finish({})
    return aux, last, sequences


def test_hidden_store_round_trip_and_a_missing_shard_file(tmp_path):
    path = tmp_path / "shard-00000.zarr"
    aux, last, sequences = small_bf16_store(path, np.array([0, 40, 100], np.int64), seed=0)
    store = hidden_store.HiddenStore(path)
    second = store.sequence(1)
    assert torch.equal(second["aux_hidden_states"].view(torch.int16), aux[40:].view(torch.int16))
    assert torch.equal(second["last_hidden_states"].view(torch.int16), last[40:].view(torch.int16))
    assert torch.equal(second["input_ids"], torch.from_numpy(sequences["input_ids"][40:].astype(np.int64)))
    (path / "last_hidden_states" / "c" / "1" / "0").unlink()
    with pytest.raises(hidden_store.InvalidStore, match=rf"{path}: zarr shard file .* is missing"):
        hidden_store.validate(path)


def test_hidden_store_validation_checks_every_shard_files_index(tmp_path):
    """validate decodes a sample of chunks, but reads the index of every zarr shard file: a damaged index in a
    file none of the sampled chunks live in is still refused, naming the file."""
    from eagle3_pipeline.formats import zarr_io

    path = tmp_path / "shard-00000.zarr"
    small_bf16_store(path, np.array([0, 700, 2000], np.int64), seed=1)
    hidden_store.validate(path)
    file = path / "aux_hidden_states" / "c" / "1" / "0" / "0"  # chunk 1 of 63: not among the 16 sampled
    original = file.read_bytes()
    index_start = len(original) - 16 - zarr_io.CHECKSUM_BYTES  # one chunk per file here: one (offset, size)
    file.write_bytes(original[:index_start] + bytes([original[index_start] ^ 1]) + original[index_start + 1:])
    with pytest.raises(hidden_store.InvalidStore, match=r"aux_hidden_states/c/1/0/0 is corrupt \(its index fails"):
        hidden_store.validate(path)
    past_end = np.array([[0, index_start + 1]], dtype="<u8").tobytes()  # a well-formed index, one byte too long
    file.write_bytes(original[:index_start] + past_end + zarr_io.crc32c_bytes(past_end))
    with pytest.raises(hidden_store.InvalidStore, match=r"c/1/0/0 is corrupt \(its index points past"):
        hidden_store.validate(path)
    file.write_bytes(original)
    hidden_store.validate(path)


def test_draft_vocab_identity_is_its_content_not_its_header_bytes(tmp_path):
    vocab = draft_vocab.DraftVocab(np.array([1, 4, 7], np.int64), np.arange(10, dtype=np.int64))
    paths = [tmp_path / f"vocab{i}.safetensors" for i in range(6)]
    for path in paths:
        draft_vocab.write(path, vocab)
    assert len({draft_vocab.identity(path) for path in paths}) == 1  # whatever order the header keys took
    other = tmp_path / "other.safetensors"
    draft_vocab.write(other, draft_vocab.DraftVocab(np.array([1, 4, 8], np.int64), np.arange(10, dtype=np.int64)))
    assert draft_vocab.identity(other) != draft_vocab.identity(paths[0])


def test_draft_vocab_round_trip_and_inconsistent_tensors(tmp_path):
    vocab = draft_vocab.DraftVocab(np.array([1, 4, 7], np.int64), np.arange(10, dtype=np.int64))
    path = tmp_path / "draft_vocab.safetensors"
    draft_vocab.write(path, vocab)
    loaded = draft_vocab.validate(path)
    assert np.array_equal(loaded.draft_ids, vocab.draft_ids) and np.array_equal(loaded.counts, vocab.counts)
    save_file({"d2t": torch.from_numpy(vocab.d2t), "t2d": torch.zeros(10, dtype=torch.bool),
               "token_counts": torch.from_numpy(vocab.counts)}, str(path))
    with pytest.raises(draft_vocab.InvalidDraftVocab, match=rf"{path}: t2d disagrees"):
        draft_vocab.validate(path)
    truncate(path)
    with pytest.raises(draft_vocab.InvalidDraftVocab, match=str(path)):
        draft_vocab.validate(path)


def test_journal_round_trip_stops_at_a_torn_line(tmp_path):
    path = tmp_path / "progress.jsonl"
    with open(path, "a", encoding="utf-8") as handle:
        journal.append(handle, [{"i": 0}, {"i": 1}])
    values, end = journal.read_intact(path)
    assert values == [{"i": 0}, {"i": 1}] and end == path.stat().st_size
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"i": 2')
    assert journal.read_intact(path) == (values, end)


# ---------------------------------------------------------------- the target

def test_target_directory_identity_and_head(tmp_path):
    directory = tmp_path / "target"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"hidden_size": 4, "num_hidden_layers": 2}))
    embed = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"model.embed_tokens.weight": embed}, str(directory / "model.safetensors"))
    assert target_dir.content_hash(directory) == target_dir.directory_hash(directory)  # hand-made: hashed
    target_dir.write_identity(directory, {"content_hash": target_dir.directory_hash(directory)})
    assert target_dir.is_materialised(directory)
    assert target_dir.validate(directory) == target_dir.read_identity(directory)
    assert target_dir.read_config(directory)["num_hidden_layers"] == 2
    read_embed, lm_head = target_dir.read_head(directory)
    assert torch.equal(read_embed, embed) and torch.equal(lm_head, embed)  # tied embeddings
    (directory / "config.json").write_text("{}")
    with pytest.raises(target_dir.InvalidTargetDir, match=rf"{directory}: files changed"):
        target_dir.validate(directory)


# ---------------------------------------------------------------- training and export

def drafter_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(4, 4, generator=generator) for name in serving_dir.EXPORTED_NAMES}
    tensors["d2t"], tensors["t2d"] = torch.zeros(4, dtype=torch.int64), torch.ones(8, dtype=torch.bool)
    return tensors


def test_trained_and_best_weights_round_trip(tmp_path):
    tensors, config = drafter_tensors(), {"hidden_size": 4, "aux_layer_ids": [1, 2, 3]}
    trained, best = tmp_path / "drafter.safetensors", tmp_path / drafter_weights.BEST_WEIGHTS_FILE
    drafter_weights.write_trained(trained, tensors, config)
    read_config, read_tensors = drafter_weights.read_trained(trained)
    assert read_config == config and all(torch.equal(read_tensors[k], v) for k, v in tensors.items())
    assert drafter_weights.read_best(best) is None
    drafter_weights.write_best(best, tensors, step=12, tau=1.625)
    assert drafter_weights.read_best(best) == (12, 1.625)
    assert drafter_weights.validate(best, ("step", "tau"))["step"] == "12"
    with pytest.raises(drafter_weights.InvalidWeights, match=rf"{best}: metadata \['drafter_config'\] missing"):
        drafter_weights.validate(best)
    truncate(trained)
    with pytest.raises(drafter_weights.InvalidWeights, match=str(trained)):
        drafter_weights.validate(trained)


def test_serving_directory_round_trip_and_a_foreign_config(tmp_path):
    tensors = drafter_tensors()
    config = {"architectures": ["LlamaForCausalLMEagle3"], serving_dir.DRAFTER_CONFIG_KEY: {"hidden_size": 4}}
    out = tmp_path / "drafter"
    serving_dir.write(out, tensors, config)
    assert serving_dir.validate(out) == config
    read_config, read_tensors = serving_dir.read(out)
    assert read_config == config and all(torch.equal(read_tensors[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="unexpected drafter weights"):
        serving_dir.write(tmp_path / "other", tensors | {"extra": torch.zeros(1)}, config)
    (out / serving_dir.CONFIG_FILE).write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(serving_dir.InvalidServingDir, match=str(out / serving_dir.CONFIG_FILE)):
        serving_dir.validate(out)


def test_checkpoint_and_fingerprint_round_trip(tmp_path):
    state = {"model": drafter_tensors(), "optimizer": {"state": {}, "param_groups": []}, "scheduler": {},
             "rng": {"torch": torch.get_rng_state()}, "step": 3, "settings": {"epochs": 1}}
    path = tmp_path / train_state.CHECKPOINT_FILE
    train_state.write_checkpoint(path, state)
    loaded = train_state.validate_checkpoint(path)
    assert loaded["step"] == 3 and all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    assert train_state.read_fingerprint(tmp_path) is None
    train_state.write_fingerprint(tmp_path, {"world_size": 1, "stores": []})
    assert train_state.read_fingerprint(tmp_path) == {"world_size": 1, "stores": []}
    truncate(path)
    with pytest.raises(train_state.InvalidCheckpoint, match=str(path)):
        train_state.validate_checkpoint(path)


def test_metrics_csv_and_summary_round_trip(tmp_path):
    path = tmp_path / metrics.METRICS_FILE
    rows = [{"step": float(s), "loss": 1.0 / s, "acc_0": 0.5} for s in (1, 2, 3)]
    for row in rows:
        metrics.append_row(path, row)
    assert metrics.validate(path) == rows
    metrics.truncate(path, 2)
    assert metrics.read(path) == rows[:2]
    with open(path, "a") as handle:
        handle.write("3,not-a-number,0.5\n")
    with pytest.raises(metrics.InvalidMetrics, match=rf"{path} line 4"):
        metrics.validate(path)
    summary = {"steps": 2, "final_loss": 0.5, "acc_per_step": [0.5], "expected_acceptance_per_step": [0.4]}
    metrics.write_summary(tmp_path / "summary.json", summary)
    assert metrics.read_summary(tmp_path / "summary.json") == summary
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(metrics.InvalidMetrics, match="summary.json: training summary lacks"):
        metrics.read_summary(tmp_path / "summary.json")


# ---------------------------------------------------------------- evaluation reports

def test_evaluation_results_timing_and_tau_table_round_trip(tmp_path):
    results = {"summary": {"eagle3-k4": {"tau": 1.5, "prompts": 2}, "target": {"tau": 1.0, "prompts": 2}}}
    timing = {"sets": {"mtbench": {"eagle3-k4": {"tokens_per_s": 10.0, "speedup_vs_target": 1.2,
                                                 "draft_ms_per_step": 1.0, "verify_ms_per_step": 2.0,
                                                 "prompts": 1}}}}
    evaluation.write_results(tmp_path / "mtbench.json", results)
    evaluation.write_results(tmp_path / "timing.json", timing)
    assert evaluation.validate_results(tmp_path / "mtbench.json") == results
    assert evaluation.read_evaluations([tmp_path / "mtbench.json"]) == {"mtbench": results}
    assert evaluation.read_results(tmp_path / "timing.json") == timing
    table = tmp_path / "tau_and_speedup.csv"
    evaluation.write_tau_table(table, {"mtbench": results}, timing)
    rows = evaluation.read_tau_table(table)
    assert [(r["method"], r["tau (tau pass)"], r["speedup_vs_target (timing pass)"]) for r in rows] == [
        ("eagle3-k4", "1.500", "1.200"), ("target", "1.000", "")]
    (tmp_path / "mtbench.json").write_text(json.dumps({"traces": []}))
    with pytest.raises(evaluation.InvalidReport, match=rf"{tmp_path / 'mtbench.json'}: no summary"):
        evaluation.validate_results(tmp_path / "mtbench.json")
