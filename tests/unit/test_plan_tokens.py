"""The disk plan's sampled token estimate against the exact count the real ingest and tokenize stages produce,
on a slice of the packaged data (ShareGPT as a pretty-printed JSON array, CodeI/O as gzipped JSON lines)
with SmolLM2's own tokenizer, read from its GGUF file as the plan reads it before the target exists."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import shutil
from pathlib import Path

import pytest

from eagle3_pipeline import assets, plan, plan_samples, plan_tokenizer, plan_tokens
from eagle3_pipeline.plan_tokenizer import TokenizerSource
from eagle3_pipeline.raw_records import DropReport, RecordSlices, iter_raw_records, iter_records_in, read_input
from eagle3_pipeline.runtime.target.loading import load_tokenizer
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.stages import ingest, tokenize
from eagle3_pipeline.tokenization import template_hash

SHARDS = ["00000", "00001"]
DATA = {"num_shards": 2, "eval_conversations": 20, "selection_conversations": 10, "train_conversations": 300, "seed": 7,
        "weights": [1.0, 2.0], "copying_weight": 1.0, "copying_min_share": 0.2, "max_seq_len": 384,
        "overlength": "truncate", "end_of_turn": None}
SAMPLE = 150


@pytest.fixture(scope="module")
def package_slice(tmp_path_factory):
    """500 ShareGPT records (the last one cut short, as the package's last one is) and 150 CodeI/O tasks."""
    folder = tmp_path_factory.mktemp("slice")
    sharegpt = RecordSlices.of(read_input(assets.resolve("sharegpt-package")))
    records = [json.loads(sharegpt[i])[0] for i in range(500)]
    text = json.dumps(records, indent=2, ensure_ascii=False)
    (folder / "sharegpt.json").write_text(text[:-200], encoding="utf-8")  # truncated inside the last record
    codeio = gzip.decompress(assets.resolve("codeio-package").read_bytes()).split(b"\n")[:150]
    (folder / "codeio.jsonl.gz").write_bytes(gzip.compress(b"\n".join(codeio) + b"\n"))
    return [folder / "sharegpt.json", folder / "codeio.jsonl.gz"]


def test_record_slices_read_back_as_the_records_ingest_reads(package_slice, tmp_path):
    compact = tmp_path / "compact.json"
    compact.write_text(json.dumps([{"messages": []}] * 3))
    assert RecordSlices.of(compact.read_bytes()) is None  # a one-line array cannot be split without parsing
    for path in package_slice:
        whole = list(iter_raw_records(path, DropReport()))
        slices = RecordSlices.of(read_input(path))
        alone = [record for i in range(len(slices)) for record in iter_records_in(path, slices[i], DropReport())]
        assert len(slices) == len(whole) and [r.value for r in alone] == [r.value for r in whole]
        assert [r.error is None for r in alone] == [r.error is None for r in whole]


def exact_tokens(inputs, target_dir, folder) -> tuple[list[int], list[int]]:
    """(conversations, tokens) per shard, written by the real ingest and tokenize stages."""
    log = logging.getLogger("test")
    shards = [folder / f"shard-{name}.jsonl" for name in SHARDS]
    ingest.run(inputs, shards, folder / "eval.jsonl", folder / "selection.jsonl", folder / "report.json",
               ingest.ingest_settings(DATA), log)
    settings = from_section(tokenize.Settings, DATA, trust_remote_code=False)
    written = [tokenize.run(path, target_dir, folder / f"{path.stem}.zarr", settings, log) for path in shards]
    return [w["conversations_in"] for w in written], [w["num_tokens"] for w in written]


@pytest.fixture(scope="module")
def saved_gguf_tokenizer(tmp_path_factory):
    """The plan's tokenizers folder after the GGUF's tokenizer was built once (it takes seconds)."""
    folder = tmp_path_factory.mktemp("tokenizers")
    source = TokenizerSource(folder / "no-target-yet", str(assets.resolve("smollm2-gguf")))
    plan_tokenizer.saved_gguf_tokenizer(Path(source.source), folder / plan_tokens.stable_hash(source.identity()))
    return folder


def estimator(inputs, cache_dir, shard_files=(), may_compute=True) -> plan_tokens.TokenEstimator:
    gguf = TokenizerSource(cache_dir / "no-target-yet", str(assets.resolve("smollm2-gguf")))
    return plan_tokens.TokenEstimator(SHARDS, [list(shard_files)[i:i + 1] for i in range(len(SHARDS))], inputs, DATA,
                                      gguf, cache_dir, may_compute=may_compute, sample_size=SAMPLE)


def test_the_sampled_estimate_is_within_10_percent_of_what_tokenize_writes(package_slice, saved_gguf_tokenizer,
                                                                            target_dir, tmp_path):
    shutil.copytree(saved_gguf_tokenizer, tmp_path / "cache" / "tokenizers")
    before = estimator(package_slice, tmp_path / "cache").estimate  # from the raw inputs: nothing ingested yet
    conversations, tokens = exact_tokens(package_slice, target_dir, tmp_path)
    assert before.sample_size == SAMPLE and before.label == "sample of 150"
    assert abs(sum(before.conversations.values()) / sum(conversations) - 1) < 0.03  # weights 1 and 2 applied
    assert abs(sum(before.tokens(s) for s in SHARDS) / sum(tokens) - 1) < 0.10
    after = estimator(package_slice, tmp_path / "cache", [tmp_path / f"shard-{s}.jsonl" for s in SHARDS]).estimate
    assert list(after.conversations.values()) == conversations  # counted in the conversation shards
    read_by_tokenize = estimator(package_slice, tmp_path / "cache", [tmp_path / f"shard-{s}.jsonl" for s in SHARDS])
    regenerated = dataclasses.replace(read_by_tokenize, regeneration=plan_tokens.Regeneration(samples=2))
    assert regenerated.estimate == after  # they hold every sample already
    assert abs(sum(after.tokens(s) for s in SHARDS) / sum(tokens) - 1) < 0.10
    saved = next((tmp_path / "cache").glob("tokenizers/*"))  # the GGUF's tokenizer, as the target rule saves it
    assert template_hash(load_tokenizer(saved)) == template_hash(load_tokenizer(target_dir))
    print(f"estimate {sum(before.tokens(s) for s in SHARDS)} / {sum(after.tokens(s) for s in SHARDS)}, exact "
          f"{sum(tokens)}; conversations {sum(before.conversations.values())}, exact {sum(conversations)}")


def test_the_estimate_counts_the_copies_of_conversations_that_copy_from_the_user(package_slice, saved_gguf_tokenizer,
                                                                                  target_dir, tmp_path):
    """data.copying_weight repeats the conversations whose replies copy from the user: the estimate from the raw
    inputs counts their copies as ingest writes them."""
    shutil.copytree(saved_gguf_tokenizer, tmp_path / "cache" / "tokenizers")
    boosted = dataclasses.replace(estimator(package_slice, tmp_path / "cache"),
                                  data=DATA | {"copying_weight": 3.0, "copying_min_share": 0.2})
    plain = estimator(package_slice, tmp_path / "cache").estimate
    log = logging.getLogger("test")
    shards = [tmp_path / f"shard-{name}.jsonl" for name in SHARDS]
    written = ingest.run(package_slice, shards, tmp_path / "eval.jsonl", tmp_path / "selection.jsonl",
                         tmp_path / "report.json", ingest.ingest_settings(boosted.data), log)
    exact = written["train_conversations"]
    estimated = sum(boosted.estimate.conversations.values())
    assert exact > sum(plain.conversations.values()) * 1.1  # the slice's copying replies: more than a few
    assert abs(estimated / exact - 1) < 0.05


def test_a_held_out_conversation_takes_its_other_parts_out_of_the_estimated_training_set(saved_gguf_tokenizer,
                                                                                         tmp_path):
    """ShareGPT's parts `<id>_0`, `<id>_1`, ... of one conversation go to one side of the split: 20 held-out
    conversations of three parts each leave 60 records out of training, not 20. A sample of the whole input sees
    the parts and gives the exact count; numbered ids (`item_<n>` on most records) are not parts."""
    shutil.copytree(saved_gguf_tokenizer, tmp_path / "cache" / "tokenizers")
    records = [{"id": f"c{k}_{part}", "conversations": [{"from": "human", "value": f"Question {k}, part {part}?"},
                                                       {"from": "gpt", "value": f"Answer {k}.{part}."}]}
               for k in range(140) for part in range(3)]
    inputs = [tmp_path / "parts.jsonl"]
    inputs[0].write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    data = DATA | {"train_conversations": None, "weights": None, "eval_conversations": 10,
                   "selection_conversations": 10}
    whole = dataclasses.replace(estimator(inputs, tmp_path / "cache"), data=data, sample_size=len(records))
    written = ingest.run(inputs, [tmp_path / f"shard-{name}.jsonl" for name in SHARDS], tmp_path / "eval.jsonl",
                         tmp_path / "selection.jsonl", tmp_path / "report.json", ingest.ingest_settings(data),
                         logging.getLogger("test"))
    assert written["train_conversations"] == 420 - 20 * 3
    assert sum(whole.estimate.conversations.values()) == written["train_conversations"]
    numbered = [{"id": f"item_{n}", "messages": [{"role": "user", "content": "q"}]} for n in range(1, 50)]
    assert plan_samples.InputSample("numbered.jsonl", 49, 49, numbered).group_starts == 49


def test_the_same_seed_gives_the_same_estimate_and_a_job_reads_the_cached_one(package_slice, saved_gguf_tokenizer,
                                                                              tmp_path):
    shutil.copytree(saved_gguf_tokenizer, tmp_path / "cache" / "tokenizers")
    first = estimator(package_slice, tmp_path / "cache").estimate
    in_a_job = estimator(package_slice, tmp_path / "cache", may_compute=False)
    assert in_a_job.estimate == first  # read from the cache: a job never tokenizes
    shutil.rmtree(tmp_path / "cache" / "token-estimates")
    assert estimator(package_slice, tmp_path / "cache").estimate == first  # made again, same sample
    twice = dataclasses.replace(estimator(package_slice, tmp_path / "cache"), regeneration=plan_tokens.Regeneration(2))
    assert twice.estimate.tokens(SHARDS[0]) == pytest.approx(2 * first.tokens(SHARDS[0]), abs=1)  # 2 samples each
    nothing_cached = estimator(package_slice, tmp_path / "elsewhere", may_compute=False)
    assert nothing_cached.estimate is None and nothing_cached.fallback == "characters: no cached sample in this job"


def test_a_mixture_counts_the_data_and_its_regenerated_openings(package_slice, saved_gguf_tokenizer, target_dir,
                                                                 tmp_path):
    """regenerate.keep_original with turns 1 and 32 new tokens: each conversation plus its first exchange with the
    reply cut at 32 tokens; the stand-in is cut where the stage would cut the target's reply."""
    shutil.copytree(saved_gguf_tokenizer, tmp_path / "cache" / "tokenizers")
    plain = estimator(package_slice, tmp_path / "cache").estimate
    mixture = plan_tokens.Regeneration(samples=1, keep_original=True, turns=1, max_new_tokens=32)
    mixed = dataclasses.replace(estimator(package_slice, tmp_path / "cache"), regeneration=mixture).estimate
    openings = dataclasses.replace(mixture, keep_original=False)
    alone = dataclasses.replace(estimator(package_slice, tmp_path / "cache"), regeneration=openings).estimate
    for shard in SHARDS:
        assert mixed.tokens(shard) == pytest.approx(plain.tokens(shard) + alone.tokens(shard), abs=2)
        assert 0.02 * plain.tokens(shard) < alone.tokens(shard) < 0.5 * plain.tokens(shard)
    tokenizer = load_tokenizer(target_dir)
    conversation = {"id": "x", "messages": [{"role": "user", "content": "Tell me a long story."},
                                            {"role": "assistant", "content": "Once upon a time " * 40},
                                            {"role": "user", "content": "Another."},
                                            {"role": "assistant", "content": "No."}]}
    stand_in = mixture.stand_in(conversation, tokenizer)["messages"]
    assert [m["role"] for m in stand_in] == ["user", "assistant"]
    assert len(tokenizer(stand_in[1]["content"], add_special_tokens=False)["input_ids"]) == 32
    no_room = dataclasses.replace(mixture, max_context_tokens=40)  # the template's system turn alone is longer
    assert no_room.stand_in(conversation, tokenizer)["messages"] == []  # the stage drops such a sample
    in_a_row = {"id": "y", "messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                                        {"role": "assistant", "content": "How can I help?"},
                                        {"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2"},
                                        {"role": "user", "content": "More."}]}
    two_turns = dataclasses.replace(mixture, turns=2).stand_in(in_a_row, tokenizer)["messages"]
    assert [m["content"] for m in two_turns] == ["Hi.", "Hello.", "Count.", "1 2"]  # replies in a row: one turn


def test_without_a_tokenizer_the_plan_estimates_from_characters_and_says_so(package_slice, tmp_path):
    source = TokenizerSource(tmp_path / "no-target-yet", "someorg/never-downloaded")  # a hub id in no local cache
    sampler = plan_tokens.TokenEstimator(SHARDS, [[], []], package_slice, DATA, source, tmp_path / "cache")
    paths = {"token_shard": str(tmp_path / "tokens-{shard}.zarr"),
             "conversation_shard": str(tmp_path / "conversations-{shard}.jsonl"),
             "hidden_store": str(tmp_path / "hidden-{shard}.zarr")}
    disk = plan.build(SHARDS, paths, package_slice, DATA, 576, 1.4, tmp_path, sampler=sampler)
    assert sampler.estimate is None and disk.stages[0].source == "estimate (characters: no tokenizer)"
    assert disk.stages[0].tokens > 0
