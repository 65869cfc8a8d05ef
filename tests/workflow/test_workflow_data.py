"""The data stage through the real snakemake CLI on a tiny config in a temp directory."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3_pipeline.formats import conversation_shards, draft_vocab, journal, token_shards
from tests.conftest import base_config, run_snakemake
from tests.workflow.conftest import (
    incomplete_marker,
    journal_records,
    kill_when,
    start_snakemake,
    tiny_data_config,
)

pytestmark = pytest.mark.workflow


@pytest.fixture(scope="module")
def data_stage_run(tmp_path_factory, target_dir) -> tuple:
    """The data stage (2 shards, up to the draft vocab) run once for the tests that only read it: (workdir, config,
    conversations that must survive ingest)."""
    workdir = tmp_path_factory.mktemp("data-stage")
    config, expected = tiny_data_config(workdir, target_dir)
    run_snakemake(workdir, config, "results/tiny/vocab/draft_vocab.safetensors")
    return workdir, config, expected


def test_data_stage_end_to_end(data_stage_run):
    workdir, config, expected = data_stage_run
    results = workdir / "results" / "tiny"
    report = json.loads((results / "conversations" / "ingest_report.json").read_text())
    assert report["conversations_kept"] == expected
    assert report["dropped"] == {"empty_conversation": 1, "no_user_turn": 1, "unknown_role": 1,
                                 "truncated_record": 1}
    assert report["eval_conversations"] == report["selection_conversations"] == 4  # the selection set follows
    assert report["train_conversations"] == expected - 8
    total = 0
    for shard in ("00000", "00001"):
        data = token_shards.read(results / "tokens" / f"shard-{shard}.zarr")
        assert data.attrs["num_sequences"] == len(data) > 0 and data.loss_mask.any()
        assert data.attrs["target_hash"] and data.attrs["end_of_turn"] == "<|im_end|>"
        total += len(data)
        assert (workdir / "logs" / "tiny" / "tokenize" / f"shard-{shard}.log").read_text().count("tokens/s")
    assert total == expected - 8
    draft = draft_vocab.read(results / "vocab" / "draft_vocab.safetensors")
    assert len(draft.draft_ids) == 500 and len(draft.counts) == 49152
    stats = json.loads((results / "vocab" / "data_stats.json").read_text())
    assert stats["total_tokens"] == sum(s["num_tokens"] for s in stats["shards"].values())
    # Nothing left to do on a rerun.
    again = run_snakemake(workdir, config, "results/tiny/vocab/draft_vocab.safetensors", "-n")
    assert "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
def test_killed_run_resumes_without_rewriting_finished_shards(tmp_path, target_dir):
    config, _ = tiny_data_config(tmp_path, target_dir, shards=3)
    run_snakemake(tmp_path, config, "results/tiny/conversations/ingest_report.json")
    process = start_snakemake(tmp_path, config, "--cores", "1", "results/tiny/vocab/draft_vocab.safetensors")
    tokens = tmp_path / "results" / "tiny" / "tokens"

    def finished_shards():
        return [p for p in tokens.glob("shard-*.zarr")
                if not incomplete_marker(tmp_path, f"results/tiny/tokens/{p.name}").exists()]
    kill_when(process, "a finished token shard", lambda: bool(finished_shards()))
    finished = {p.name: p.stat().st_mtime_ns for p in finished_shards()}
    assert finished, "no shard finished before the kill"
    assert len(finished) < 3, "the run finished before it was killed; the test proves nothing"
    run_snakemake(tmp_path, config, "--unlock")
    run_snakemake(tmp_path, config, "results/tiny/vocab/draft_vocab.safetensors")
    for name, mtime in finished.items():
        assert (tokens / name).stat().st_mtime_ns == mtime, f"{name} was rewritten"
    assert sorted(p.name for p in tokens.iterdir()) == [f"shard-0000{i}.zarr" for i in range(3)]
    for i in range(3):
        token_shards.validate(tokens / f"shard-0000{i}.zarr")


@pytest.mark.parametrize(("override", "message"), [
    ({"data": {"inputs": ["x.json"], "colour": "blue"}}, "colour"),
    ({"data": {"inputs": ["x.json"], "num_shards": "four"}}, "four"),
    ({"target": {"source": "/nonexistent/model"}}, "target.source"),
    ({"data": {"inputs": ["/nonexistent/chats.json"]}}, "data.inputs[0]"),
])
def test_bad_config_fails_before_any_job_naming_the_key(tmp_path, override, message):
    (tmp_path / "x.json").write_text("[]")
    config = base_config(run="bad", **override)
    result = run_snakemake(tmp_path, config, "-n", check=False)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


def test_shard_tokens_match_the_conversations(data_stage_run):
    """Decode each sequence's masked tokens: they are the assistant replies of that conversation."""
    workdir = data_stage_run[0]
    from eagle3_pipeline.runtime.target.loading import load_tokenizer

    tokenizer = load_tokenizer(workdir / "results" / "tiny" / "target")
    convs = {c["id"]: c for c in conversation_shards.read(
        workdir / "results" / "tiny" / "conversations" / "shard-00001.jsonl")}
    shard = token_shards.read(workdir / "results" / "tiny" / "tokens" / "shard-00001.zarr")
    for j, sample_id in enumerate(shard.sample_ids):
        ids, mask = shard.sequence(j)
        replies = "".join(m["content"] + "<|im_end|>" for m in convs[sample_id]["messages"]
                          if m["role"] == "assistant")
        assert tokenizer.decode(ids[mask.astype(bool)]) == replies
        assert np.all(ids >= 0)


@pytest.mark.slow
def test_regenerated_replies_feed_tokenize_and_a_killed_job_resumes(tmp_path, target_dir):
    config, expected = tiny_data_config(tmp_path, target_dir, shards=2, train_conversations=16)
    config["regenerate"] = {**config["regenerate"], "enabled": True, "max_new_tokens": 12, "batch_size": 1,
                            "device": "cpu", "dtype": "float32"}  # 4 conversations in progress at a time
    results = tmp_path / "results" / "tiny"
    run_snakemake(tmp_path, config, "results/tiny/conversations/ingest_report.json")
    progress = results / "regenerated" / "shard-00000.jsonl.progress.jsonl"
    process = start_snakemake(tmp_path, config, "results/tiny/regenerated/shard-00000.jsonl")
    kill_when(process, "two regenerated conversations in the progress journal",
              lambda: len(journal_records(progress)) >= 3)  # the fingerprint line first
    finished_before = journal.read_intact(progress)[0][1:]  # after the fingerprint line
    assert 2 <= len(finished_before) < 8, "the kill did not land while the shard was being regenerated"
    run_snakemake(tmp_path, config, "--unlock")
    run_snakemake(tmp_path, config, "results/tiny/tokens/shard-00000.zarr")
    log = (tmp_path / "logs" / "tiny" / "regenerate" / "shard-00000.log").read_text()
    assert f"resuming with {len(finished_before)} finished conversations" in log and "tokens/s" in log
    original = {c["id"]: c for c in conversation_shards.read(results / "conversations" / "shard-00000.jsonl")}
    regenerated = conversation_shards.read(results / "regenerated" / "shard-00000.jsonl")
    assert [c["id"] for c in regenerated] == list(original)
    for record in finished_before:  # kept as they were, not redone
        assert regenerated[record["index"]] == record["conversation"]
    for conversation in regenerated:
        replies = [m["content"] for m in conversation["messages"] if m["role"] == "assistant"]
        assert replies and "interesting" not in " ".join(replies)  # the dataset's own answers are gone
        users = [m for m in conversation["messages"] if m["role"] == "user"]
        assert users == [m for m in original[conversation["id"]]["messages"] if m["role"] == "user"][: len(users)]
    shard = token_shards.read(results / "tokens" / "shard-00000.zarr")
    assert shard.attrs["conversations_in"] == len(regenerated) == 8
    assert not progress.exists()
    # the held-out store that picks the epoch is tokenized from the selection conversations, regenerated too
    plan = run_snakemake(tmp_path, config, "results/tiny/tokens/shard-heldout.zarr", "-n").stdout
    assert "input: results/tiny/conversations/selection.jsonl" in plan
    assert "results/tiny/regenerated/shard-heldout.jsonl" in plan.split("rule tokenize:")[1]
    config["regenerate"] |= {"samples": 2, "temperature": 1.0}  # training samples; the selection's stay one, greedy
    run_snakemake(tmp_path, config, "results/tiny/tokens/shard-heldout.zarr")
    selection = conversation_shards.read(results / "conversations" / "selection.jsonl")
    heldout = conversation_shards.read(results / "regenerated" / "shard-heldout.jsonl")
    assert [c["id"] for c in heldout] == [c["id"] for c in selection]
    assert token_shards.read(results / "tokens" / "shard-heldout.zarr").attrs["conversations_in"] == len(heldout)
    assert f"{len(selection)} conversations x 1 samples" in (tmp_path / "logs/tiny/regenerate/shard-heldout.log"
                                                           ).read_text()
    # a mixture: each training conversation as ingested, then the target's first reply beside it; the selection
    # conversations are tokenized as ingested (no regenerate job for them)
    config["regenerate"] |= {"samples": 1, "temperature": 0.0, "keep_original": True, "turns": 1}
    plan = run_snakemake(tmp_path, config, "results/tiny/tokens/shard-heldout.zarr", "-n", "--forceall").stdout
    assert "rule regenerate:" not in plan and "input: results/tiny/conversations/selection.jsonl" in plan
    run_snakemake(tmp_path, config, "results/tiny/tokens/shard-00001.zarr")
    ingested = conversation_shards.read(results / "conversations" / "shard-00001.jsonl")
    mixture = conversation_shards.read(results / "regenerated" / "shard-00001.jsonl")
    assert mixture[0::2] == ingested and [c["id"] for c in mixture[1::2]] == [f"{c['id']}#s1" for c in ingested]
    assert all(sum(m["role"] == "assistant" for m in c["messages"]) == 1 for c in mixture[1::2])
    assert token_shards.read(results / "tokens" / "shard-00001.zarr").attrs["conversations_in"] == 16
