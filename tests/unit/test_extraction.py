"""HF backend hooks, the hidden-state store (round trip, validation, resume) and NaN rejection."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
import zarr

from eagle3_pipeline.formats import hidden_store, token_shards, zarr_io
from eagle3_pipeline.formats.hidden_store import storage_order
from eagle3_pipeline.runtime.extraction import BackendInfo, check_aux_layer_ids, default_aux_layer_ids
from eagle3_pipeline.runtime.extraction.hf import HFBackend
from eagle3_pipeline.stages.extract import NonFiniteActivations, extract_shard, plan_batches
from eagle3_pipeline.tokenization import TokenizedConversation
from tests.conftest import flip_bytes_inside_a_chunk
from tests.unit.conftest import tiny_llama

LOG = logging.getLogger("test")


def test_hooks_equal_output_hidden_states_at_the_chosen_indices():
    model = tiny_llama(layers=6)
    backend = HFBackend(model, aux_layer_ids=[1, 3, 4])
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, 256, size=n).astype(np.int32) for n in (17, 5, 11)]
    states = backend.extract(batch)
    for ids, state in zip(batch, states, strict=True):
        with torch.no_grad():
            reference = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
        for slot, index in enumerate([1, 3, 4]):
            torch.testing.assert_close(state.aux[:, slot].float(), reference[index][0].bfloat16().float())
        # the last state is the final-norm output (hidden_states[L] in HF), not the last block's raw output
        torch.testing.assert_close(state.last.float(), reference[6][0].bfloat16().float())
        assert state.aux.dtype == torch.bfloat16 and state.aux.shape == (len(ids), 3, 64)


def test_aux_layer_ids_defaults_and_validation():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert check_aux_layer_ids([2, 15, 27], 30) == [2, 15, 27]
    with pytest.raises(ValueError, match="out of range"):
        check_aux_layer_ids([0, 15, 30], 30)
    with pytest.raises(ValueError, match="exactly 3"):
        check_aux_layer_ids([2, 15], 30)


def test_batches_respect_the_token_budget_and_cover_every_sequence():
    lengths = np.array([5, 300, 40, 40, 7, 1000, 2])
    order = storage_order(lengths)
    assert lengths[order].tolist() == [1000, 300, 40, 40, 7, 5, 2]
    batches = plan_batches(lengths[order], token_budget=400)
    assert [b.sequences for b in batches] == [[0], [1], [2, 3, 4, 5, 6]]
    assert all(len(b.sequences) * lengths[order][b.sequences].max() <= 400 or len(b.sequences) == 1
               for b in batches)
    assert batches[-1].end_row == lengths.sum()


def random_sequences(rng, count, vocab=256):
    lengths = rng.integers(4, 60, size=count)
    return [TokenizedConversation(f"s{i}", rng.integers(0, vocab, size=int(n)).astype(np.int32),
                                  np.ones(int(n), np.uint8)) for i, n in enumerate(lengths)]


@pytest.fixture
def token_shard(tmp_path):
    path = tmp_path / "tokens.zarr"
    token_shards.write(path, random_sequences(np.random.default_rng(3), 40), {"template_hash": "t"})
    return path


def run_extract(backend, token_shard, out, **kwargs):
    return extract_shard(backend, token_shard, out, token_budget=256, writer_threads=2, metadata={"target_hash": "x"},
                         log=LOG, store_shard_bytes=kwargs.pop("shard_bytes", 1 << 16), **kwargs)


def test_store_round_trip_is_bit_exact(tmp_path):
    rng = np.random.default_rng(5)
    lengths = [7, 130, 1, 64, 300]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens, hidden = int(offsets[-1]), 32
    aux = torch.from_numpy(rng.standard_normal((tokens, 3, hidden)).astype(np.float32) * 50).bfloat16()
    last = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)).bfloat16()
    aux[0, 0, :4] = torch.tensor([-0.0, 1e-40, 3e38, -3e38])  # signed zero, subnormal, extremes survive
    sequences = {"input_ids": rng.integers(0, 100, tokens).astype(np.int32),
                 "loss_mask": rng.integers(0, 2, tokens).astype(np.uint8), "seq_offsets": offsets,
                 "sample_ids": [f"id{i}" for i in range(len(lengths))]}
    out = tmp_path / "store.zarr"
    writer = hidden_store.StoreWriter(out, tokens, hidden, {"num_sequences": len(lengths)}, sequences,
                                      writer_threads=3, shard_bytes=8 << 10)
    for start, end in [(0, 5), (5, 200), (200, 201), (201, tokens)]:  # uneven appends
        writer.append(hidden_store.encode(aux[start:end], last[start:end], "bfloat16"))
    writer.finish({})
    store = hidden_store.HiddenStore(out)
    assert store.attrs["rows_per_shard"] < tokens
    for j in range(len(lengths)):
        seq = store.sequence(j)
        rows = slice(offsets[j], offsets[j + 1])
        assert torch.equal(seq["aux_hidden_states"].view(torch.int16), aux[rows].view(torch.int16))
        assert torch.equal(seq["last_hidden_states"].view(torch.int16), last[rows].view(torch.int16))
        assert np.array_equal(seq["input_ids"].numpy(), sequences["input_ids"][rows])


def test_extracted_store_matches_the_backend(tmp_path, token_shard):
    backend = HFBackend(tiny_llama(layers=6), aux_layer_ids=[2, 3, 3])
    out = tmp_path / "hidden.zarr"
    attrs = run_extract(backend, token_shard, out)
    assert attrs["complete"] and attrs["aux_layer_ids"] == [2, 3, 3] and attrs["hidden_dtype"] == "bfloat16"
    assert attrs["rows_per_shard"] < attrs["num_tokens"]  # several zarr shards were written
    store = hidden_store.HiddenStore(out)
    shard = token_shards.read(token_shard)
    by_id = {sid: j for j, sid in enumerate(shard.sample_ids)}
    sample_ids = [str(s) for s in hidden_store.zarr_io.open_readonly(out)["sample_ids"][...]]
    assert sorted(sample_ids) == sorted(shard.sample_ids)
    assert np.all(np.diff(store.lengths()) <= 0)  # stored longest first
    for j in range(len(store)):
        seq = store.sequence(j)
        ids, _ = shard.sequence(by_id[sample_ids[j]])
        assert np.array_equal(seq["input_ids"].numpy(), ids)
        expected = backend.extract([ids])[0]  # alone, unpadded: equal up to bf16 rounding
        torch.testing.assert_close(seq["aux_hidden_states"], expected.aux, atol=0.02, rtol=0.02)
        torch.testing.assert_close(seq["last_hidden_states"], expected.last, atol=0.05, rtol=0.02)
    files = [f for f in out.rglob("*") if f.is_file()]
    assert len(files) < 40  # zarr shards, not one file per chunk or per sample


def test_validator_catches_killed_truncated_and_missing_shards(tmp_path, token_shard):
    backend = HFBackend(tiny_llama(layers=6))
    out = tmp_path / "hidden.zarr"
    run_extract(backend, token_shard, out)
    hidden_store.validate(out)
    shard_file = out / "last_hidden_states" / "c" / "1" / "0"
    data = shard_file.read_bytes()
    shard_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(hidden_store.InvalidStore, match=r"array last_hidden_states, file last_hidden_states/c/1/0 is "
                                                        r"corrupt"):
        hidden_store.validate(out)
    shard_file.unlink()
    with pytest.raises(hidden_store.InvalidStore, match="missing"):
        hidden_store.validate(out)
    with pytest.raises(hidden_store.InvalidStore, match="does not exist"):
        hidden_store.validate(tmp_path / "never.zarr")


def random_store(out, tokens: int = 5000, hidden: int = 512, shard_bytes: int = 8 << 20) -> dict:
    """A real store of random activations, several chunks per zarr shard file (4 here), several files."""
    rng = np.random.default_rng(7)
    offsets = np.arange(0, tokens + 1, 100, dtype=np.int64)
    sequences = {"input_ids": rng.integers(0, 100, tokens).astype(np.int32), "loss_mask": np.ones(tokens, np.uint8),
                 "seq_offsets": offsets, "sample_ids": [f"id{i}" for i in range(len(offsets) - 1)]}
    writer = hidden_store.StoreWriter(out, tokens, hidden, {"num_sequences": len(offsets) - 1}, sequences,
                                      shard_bytes=shard_bytes)
    values = torch.from_numpy(rng.standard_normal((tokens, 4, hidden), dtype=np.float32))
    writer.append(hidden_store.encode(values[:, :3], values[:, 3], "bfloat16"))
    writer.finish({})
    attrs = hidden_store.validate(out)
    assert attrs["rows_per_shard"] // attrs["chunk_rows"] > 1 and attrs["rows_per_shard"] < tokens
    return attrs


def test_flipped_bytes_inside_a_chunk_fail_validation_naming_the_chunk(tmp_path):
    out = tmp_path / "hidden.zarr"
    attrs = random_store(out)
    chunk = flip_bytes_inside_a_chunk(out / "aux_hidden_states", 1, attrs["rows_per_shard"] // attrs["chunk_rows"])
    with pytest.raises(hidden_store.InvalidStore) as error:
        hidden_store.validate(out)
    assert f"{out}: array aux_hidden_states, chunk {chunk} (rows {chunk * attrs['chunk_rows']}-" in str(error.value)
    assert "(checksum mismatch); delete the store" in str(error.value) and "\n" not in str(error.value)


def test_every_read_verifies_its_chunks(tmp_path):
    """Chunks the validator does not sample are still checked when training reads them."""
    out = tmp_path / "hidden.zarr"
    attrs = random_store(out)
    chunk = flip_bytes_inside_a_chunk(out / "last_hidden_states", 1, attrs["rows_per_shard"] // attrs["chunk_rows"],
                                      chunk_in_file=1)
    store = hidden_store.HiddenStore(out, validate_store=False)
    j = int(np.searchsorted(store.seq_offsets, chunk * attrs["chunk_rows"], side="right") - 1)
    with pytest.raises(zarr_io.CorruptChunk, match=rf"array last_hidden_states, chunk {chunk} .*checksum mismatch"):
        store.sequence(j)
    store.sequence(0)  # other chunks still read


def test_a_store_of_the_old_schema_is_refused_with_the_remedy(tmp_path, token_shard):
    out = tmp_path / "hidden.zarr"
    run_extract(HFBackend(tiny_llama(layers=6)), token_shard, out)
    zarr.open_group(str(out), mode="r+").attrs["schema_version"] = 1
    with pytest.raises(hidden_store.InvalidStore, match="schema version 1.*delete it and rerun its extract job"):
        hidden_store.validate(out)


class Interrupt(Exception):
    pass


class FailingBackend:
    """Wraps a real backend and dies after a number of batches, like a killed job."""

    def __init__(self, backend, fail_after):
        self.inner, self.info, self.calls, self.fail_after = backend, backend.info, 0, fail_after

    def extract(self, batch):
        self.calls += 1
        if self.calls > self.fail_after:
            raise Interrupt()
        return self.inner.extract(batch)


def test_resume_after_interruption_is_bit_identical(tmp_path, token_shard):
    backend = HFBackend(tiny_llama(layers=6))
    reference = tmp_path / "reference.zarr"
    run_extract(backend, token_shard, reference)
    resumed = tmp_path / "resumed.zarr"
    with pytest.raises(Interrupt):
        run_extract(FailingBackend(backend, fail_after=4), token_shard, resumed)
    progress = json.loads((tmp_path / "resumed.zarr.partial" / "progress.json").read_text())
    batches = plan_batches(np.sort(token_shards.read(token_shard).lengths())[::-1], 256)
    shard_rows = hidden_store.Layout.for_hidden_size(64, 1 << 16).rows_per_shard
    # Batches 1-3 were written (the 4th was still in flight when the 5th forward died): every whole zarr
    # shard they cover is durable, the partly filled one is not.
    assert progress["rows_written"] == batches[2].end_row // shard_rows * shard_rows > 0
    counting = FailingBackend(backend, fail_after=10**9)
    run_extract(counting, token_shard, resumed)
    assert counting.calls < len(batches)  # it did not start over
    for name in ("aux_hidden_states", "last_hidden_states", "input_ids", "seq_offsets"):
        a = hidden_store.zarr_io.open_readonly(reference)[name][...]
        b = hidden_store.zarr_io.open_readonly(resumed)[name][...]
        assert np.array_equal(a, b), name


class NaNBackend:
    def __init__(self, backend, bad_sample_length):
        self.inner, self.info, self.bad = backend, backend.info, bad_sample_length

    def extract(self, batch):
        states = self.inner.extract(batch)
        for ids, state in zip(batch, states, strict=True):
            if len(ids) == self.bad:
                state.aux[1, 2, 0] = float("nan")
        return states


def test_nan_activations_are_rejected_naming_the_sample(tmp_path, token_shard):
    shard = token_shards.read(token_shard)
    lengths = shard.lengths()
    target = int(lengths[7])
    expected_ids = {shard.sample_ids[j] for j in np.flatnonzero(lengths == target)}
    backend = NaNBackend(HFBackend(tiny_llama(layers=6)), target)
    with pytest.raises(NonFiniteActivations) as error:
        run_extract(backend, token_shard, tmp_path / "nan.zarr")
    assert any(repr(s) in str(error.value) for s in expected_ids)
    assert not (tmp_path / "nan.zarr").exists()


def test_backend_info_attrs():
    info = BackendInfo("hf", "1", (2, 15, 27), 576, 30)
    assert info.as_attrs() == {"backend_name": "hf", "backend_version": "1", "aux_layer_ids": [2, 15, 27],
                               "hidden_size": 576, "num_layers": 30, "final_norm": "post"}


def test_direct_shard_bytes_equal_zarr(tmp_path):
    """Our whole-shard encoder writes exactly the bytes zarr writes, and zarr reads them back."""
    layout = hidden_store.Layout.for_hidden_size(32, shard_bytes=8 << 20)
    assert layout.rows_per_shard >= 4 * layout.chunk_rows
    rows = 2 * layout.rows_per_shard + layout.chunk_rows + 5  # a short last shard with a partial chunk
    rng = np.random.default_rng(0)
    data = zarr_io.bf16_to_u16(torch.from_numpy(rng.standard_normal((rows, 3, 32), dtype=np.float32)))
    data[layout.chunk_rows: 2 * layout.chunk_rows] = 0  # an all-fill chunk is left out, as zarr does
    arrays = {}
    for name in ("by_zarr", "direct"):
        group = zarr.open_group(str(tmp_path / f"{name}.zarr"), mode="w")
        arrays[name] = group.create_array("a", shape=data.shape, dtype="uint16", chunks=(layout.chunk_rows, 3, 32),
                                          shards=(layout.rows_per_shard, 3, 32), compressors=zarr_io.chunk_codecs(2))
    arrays["by_zarr"][...] = data
    for shard in range(-(-rows // layout.rows_per_shard)):
        block = data[shard * layout.rows_per_shard: (shard + 1) * layout.rows_per_shard]
        payload = zarr_io.encode_whole_shard(block, layout.chunk_rows, layout.rows_per_shard)
        zarr_io.write_whole_shard(tmp_path / "direct.zarr" / "a", shard, 2, payload)
        key = f"a/c/{shard}/0/0"
        assert (tmp_path / "direct.zarr" / key).read_bytes() == (tmp_path / "by_zarr.zarr" / key).read_bytes()
    assert np.array_equal(zarr.open_array(str(tmp_path / "direct.zarr" / "a"), mode="r")[...], data)
