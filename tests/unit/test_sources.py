"""More data sources: gzipped inputs, task/solution records (CodeI/O, Alpaca), weights, HumanEval prompts."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from eagle3_pipeline import assets, conversations
from eagle3_pipeline.prompts import load_prompts


def test_codeio_package_records_become_two_turn_conversations():
    kept, report = conversations.ingest([assets.resolve("codeio-package")])
    assert len(kept) == 3002 and report.kept == 3002  # every record of the package is a complete task
    first = kept[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant"]
    assert first[0]["content"].endswith("Write a Python solution.")
    assert first[1]["content"].startswith("```python\n") and "def main_solution" in first[1]["content"]


def test_gzipped_jsonl_and_alpaca_records(tmp_path):
    path = tmp_path / "alpaca.jsonl.gz"
    records = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
               {"instruction": "Say hi.", "output": "Hi!"}, {"instruction": "no output"}]
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    kept, report = conversations.ingest([path])
    assert [c["messages"][0]["content"] for c in kept] == ["Add the numbers.\n\n2 and 3", "Say hi."]
    assert [c["messages"][1]["content"] for c in kept] == ["5", "Hi!"]
    assert report.as_dict()["dropped"] == {"malformed_record": 1}


def conversation(source: str, index: int) -> dict:
    return {"id": f"{source}:{index}", "source": source,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def test_weights_repeat_a_source_and_leave_held_out_and_unweighted_data_alone():
    data = [conversation("a.json", i) for i in range(400)] + [conversation("b.json", i) for i in range(100)]
    unweighted = conversations.split(data, 4, 20, 10, None, seed=7)
    shards, held_out, selection, _ = conversations.split(data, 4, 20, 10, None, seed=7,
                                                      weights={"b.json": 2.5, "a.json": 1.0})
    assert (held_out, selection) == unweighted[1:3]  # the held-out sets do not depend on weights
    training = [c for shard in shards for c in shard]
    plain = [c for shard in unweighted.shards for c in shard]
    by_source = Counter(c["source"] for c in training)
    plain_b = sum(c["source"] == "b.json" for c in plain)
    assert by_source["a.json"] == sum(c["source"] == "a.json" for c in plain)
    assert 2 * plain_b < by_source["b.json"] < 3 * plain_b  # twice each, a seeded share a third time
    assert len({c["id"] for c in training}) == len(training)  # copies get their own ids
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    none_of_b = conversations.split(data, 4, 20, 10, None, seed=7, weights={"b.json": 0}).shards
    assert all(c["source"] == "a.json" for shard in none_of_b for c in shard)


def test_humaneval_package_prompts_ask_to_complete_the_function():
    prompts = load_prompts(assets.resolve("humaneval-package"), None)
    assert len(prompts) == 164 and prompts[0].prompt_id == "HumanEval/0"
    text = prompts[0].messages[0]["content"]
    assert text.startswith("Complete this Python function.") and "def has_close_elements" in text


@pytest.mark.parametrize("weights, message", [([1.0], "1 weights for 2 inputs")])
def test_weights_must_match_the_inputs(weights, message, tmp_path):
    from eagle3_pipeline import workflow_config

    for name in ("x.jsonl", "y.jsonl"):
        (tmp_path / name).write_text("")
    config = {"target": {"source": "smollm2-gguf"},
              "data": {"inputs": [str(tmp_path / "x.jsonl"), str(tmp_path / "y.jsonl")], "weights": weights,
                       "num_shards": 1}}
    with pytest.raises(workflow_config.ConfigError, match=message):
        workflow_config.check(config)
