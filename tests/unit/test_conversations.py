import json

import pytest

from eagle3_pipeline import raw_records
from eagle3_pipeline.conversations import ingest, split
from eagle3_pipeline.formats import conversation_shards
from eagle3_pipeline.raw_records import IngestError
from tests.conftest import sharegpt_record, tiny_conversations


def write_array(path, records, cut_bytes: int = 0):
    text = json.dumps(records, indent=2).encode()
    path.write_bytes(text[: len(text) - cut_bytes] if cut_bytes else text)
    return path


def test_roles_are_normalised(tmp_path):
    record = sharegpt_record("a", [("system", "s"), ("Human", "q"), ("chatgpt", "r1"), ("user", "q2"),
                                   ("bard", "r2"), ("human", "q3"), ("bing", "r3")])
    kept, report = ingest([write_array(tmp_path / "x.json", [record])])
    assert [m["role"] for m in kept[0]["messages"]] == ["system", "user", "assistant", "user", "assistant",
                                                        "user", "assistant"]
    assert report.kept == 1 and not report.dropped


def test_openai_messages_shape_in_jsonl(tmp_path):
    line = {"id": "o1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(line) + "\n")
    kept, _ = ingest([path])
    assert kept == [{"id": "o1", "source": "x.jsonl", "messages": line["messages"]}]


def test_truncated_array_keeps_every_complete_record(tmp_path):
    records = tiny_conversations(30)
    path = write_array(tmp_path / "cut.json", records, cut_bytes=60)  # cut inside the last record
    kept, report = ingest([path])
    assert [c["id"] for c in kept] == [r["id"] for r in records[:-1]]
    assert report.dropped == {"truncated_record": 1}
    info = report.files[str(path)]
    assert info["truncated"] and info["records"] == 29
    assert report.examples["truncated_record"][0]["record"] == 29


def test_array_cut_between_records_is_reported(tmp_path):
    records = tiny_conversations(5)
    text = json.dumps(records, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex("}") + 1])  # no closing ']'
    kept, report = ingest([path])
    assert len(kept) == 5 and report.files[str(path)]["truncated"]


def test_malformed_record_mid_array_is_skipped_and_the_rest_kept(tmp_path):
    records = tiny_conversations(6)
    text = json.dumps(records, indent=2)
    broken = text.replace('"id": "conv2"', '"id": "conv2" "oops": 1', 1)
    path = tmp_path / "broken.json"
    path.write_text(broken)
    kept, report = ingest([path])
    assert [c["id"] for c in kept] == ["conv0", "conv1", "conv3", "conv4", "conv5"]
    assert report.dropped == {"malformed_json": 1}
    assert report.examples["malformed_json"][0]["record"] == 2


def test_bad_records_are_each_skipped_with_a_counted_reason(tmp_path):
    good = tiny_conversations(3)
    lines = [json.dumps(r).encode() for r in good]
    lines.insert(1, b'{"id": "broken", "conversations": [')  # invalid JSON line
    lines.insert(2, json.dumps(sharegpt_record("nonstr", [("human", "q"), ("gpt", {"text": "r"})])).encode())
    lines.insert(3, json.dumps(sharegpt_record("only_gpt", [("gpt", "a"), ("gpt", "b")])).encode())
    lines.insert(4, b'{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}]}')
    lines.insert(5, json.dumps(sharegpt_record("tool", [("human", "q"), ("tool", "x"), ("gpt", "r")])).encode())
    lines.insert(6, json.dumps(sharegpt_record("empty", [])).encode())
    lines.insert(7, json.dumps(sharegpt_record("no_reply", [("human", "q")])).encode())
    lines.insert(8, b"[1, 2]")
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    kept, report = ingest([path])
    assert [c["id"] for c in kept] == [r["id"] for r in good]
    assert report.dropped == {"malformed_json": 1, "non_string_content": 1, "no_user_turn": 1, "invalid_utf8": 1,
                              "unknown_role": 1, "empty_conversation": 1, "no_assistant_turn": 1,
                              "malformed_record": 1}
    assert report.read == len(lines)
    example = report.examples["invalid_utf8"][0]
    assert example["file"] == str(path) and example["record"] == 4 and "UTF-8" in example["reason"]


def test_non_utf8_bytes_inside_a_json_array_drop_only_that_record(tmp_path):
    records = tiny_conversations(3)
    text = json.dumps(records, indent=2).encode().replace(b"number 1?", b"number \xff1?")
    path = tmp_path / "bytes.json"
    path.write_bytes(text)
    kept, report = ingest([path])
    assert [c["id"] for c in kept] == ["conv0", "conv2"] and report.dropped == {"invalid_utf8": 1}


def test_turns_are_trimmed_to_a_trainable_conversation(tmp_path):
    record = sharegpt_record("t", [("gpt", "lead"), ("human", "q"), ("gpt", "r"), ("human", "q2"), ("gpt", ""),
                                   ("human", "after empty")])
    kept, report = ingest([write_array(tmp_path / "t.json", [record])])
    assert [m["content"] for m in kept[0]["messages"]] == ["q", "r"]
    assert report.modified == {"cut_at_empty_turn": 1, "leading_assistant_turns_removed": 1}


def test_unreadable_inputs_raise_a_clear_error(tmp_path):
    with pytest.raises(IngestError, match="does not exist"):
        ingest([tmp_path / "missing.json"])
    (tmp_path / "text.txt").write_text("hello")
    with pytest.raises(IngestError, match="neither a JSON array nor JSON lines"):
        ingest([tmp_path / "text.txt"])


def test_split_is_deterministic_and_its_three_parts_disjoint():
    conversations_ = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(113)]
    parts = split(conversations_, num_shards=4, eval_count=10, selection_count=10, train_count=None, seed=7)
    assert parts == split(conversations_, num_shards=4, eval_count=10, selection_count=10, train_count=None, seed=7)
    ids = {name: [c["id"] for c in part] for name, part in
           [("train", [c for shard in parts.shards for c in shard]), ("eval", parts.evaluation),
            ("selection", parts.selection)]}
    assert len(ids["eval"]) == len(ids["selection"]) == 10
    assert sorted(sum(ids.values(), [])) == sorted(c["id"] for c in conversations_)  # each in exactly one part
    assert {len(s) for s in parts.shards} <= {23, 24}
    fewer = split(conversations_, num_shards=4, eval_count=10, selection_count=3, train_count=None, seed=7)
    assert fewer.evaluation == parts.evaluation  # the evaluation set does not move with the selection set's size
    other = split(conversations_, num_shards=4, eval_count=10, selection_count=10, train_count=None, seed=8)
    assert other.shards != parts.shards and other.selection != parts.selection


def test_jsonl_round_trip_is_atomic(tmp_path):
    path = tmp_path / "out.jsonl"
    data = [{"id": "x", "source": "s", "messages": [{"role": "user", "content": "é\n"}]}]
    conversation_shards.write(path, data)
    assert conversation_shards.read(path) == data
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_lone_surrogates_are_replaced_and_counted_not_fatal(tmp_path):
    good = tiny_conversations(2)
    lone = '{"id": "sur\\udc80", "conversations": [{"from": "human", "value": "hi \\ud800 there"}, ' \
           '{"from": "gpt", "value": "ok \\udfff"}]}'
    path = tmp_path / "surrogates.jsonl"
    path.write_text("\n".join([json.dumps(good[0]), lone, json.dumps(good[1])]) + "\n")
    kept, report = ingest([path])
    assert [c["id"] for c in kept] == ["conv0", "sur\ufffd", "conv1"]
    assert [m["content"] for m in kept[1]["messages"]] == ["hi \ufffd there", "ok \ufffd"]
    assert report.modified == {"lone_surrogates_replaced": 1} and not report.dropped
    conversation_shards.write(tmp_path / "out.jsonl", kept)  # writes as UTF-8 now
    assert conversation_shards.read(tmp_path / "out.jsonl") == kept


def test_escaped_surrogate_in_an_array_is_replaced_while_raw_bad_bytes_still_drop(tmp_path):
    records = tiny_conversations(3)
    records[0]["conversations"][0]["value"] = "escaped \udc80"  # json.dumps writes it as \udc80
    text = json.dumps(records, indent=2).encode().replace(b"number 1?", b"number \xff1?")
    kept, report = ingest([_write(tmp_path, text)])
    assert [c["id"] for c in kept] == ["conv0", "conv2"]
    assert report.dropped == {"invalid_utf8": 1} and report.modified == {"lone_surrogates_replaced": 1}


def _write(tmp_path, data: bytes):
    path = tmp_path / "data.json"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("shape", ["jsonl", "array"])
def test_a_utf8_bom_is_stripped_and_noted_and_every_record_kept(tmp_path, shape):
    records = tiny_conversations(4)
    body = ("\n".join(json.dumps(r) for r in records) + "\n") if shape == "jsonl" else json.dumps(records, indent=2)
    path = tmp_path / f"bom.{shape}"
    path.write_bytes(raw_records.UTF8_BOM + body.encode())
    kept, report = ingest([path])
    assert [c["id"] for c in kept] == [r["id"] for r in records] and not report.dropped
    assert report.modified == {"utf8_bom_stripped": 1} and report.files[str(path)]["utf8_bom_stripped"]


def test_openai_content_parts_are_joined_and_non_text_parts_counted(tmp_path):
    record = {"id": "parts", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look at this"},
                                     {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                                     {"type": "text", "text": "and describe it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
    broken = {"id": "broken", "messages": [{"role": "user", "content": [42]}, {"role": "assistant", "content": "x"}]}
    path = tmp_path / "parts.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps(broken) + "\n")
    kept, report = ingest([path])
    assert [m["content"] for m in kept[0]["messages"]] == ["Look at this\nand describe it.", "A cat."]
    assert report.modified == {"content_parts_joined": 2, "non_text_content_parts_dropped": 1}
    assert report.dropped == {"malformed_record": 1}
    assert "image_url" in report.examples["non_text_content_parts_dropped"][0]["reason"]


def test_input_ids_cannot_collide_with_the_ids_the_pipeline_derives(tmp_path):
    # `a#2` and `a#s2` are what data.weights and regenerate.samples would call copies of `a`
    records = [{"id": name, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]}
               for name in ("a", "a#2", "a#s2", "a%23s2")]
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(records))
    kept, report = ingest([path])
    assert [c["id"] for c in kept] == ["a", "a%232", "a%23s2", "a%2523s2"] and report.kept == 4


def test_an_id_an_earlier_input_has_is_renamed_and_a_repeat_within_one_input_dropped(tmp_path):
    """Two datasets numbering their records alike (or two files of one name, whose fallback ids are
    `<file name>:<index>`) keep every record; an input that repeats its own id loses the repeat, counted."""
    first = tmp_path / "a" / "train.jsonl"
    second = tmp_path / "b" / "train.jsonl"
    for path, text in ((first, "first"), (second, "second")):
        path.parent.mkdir()
        lines = [{"messages": [{"role": "user", "content": f"{text} {i}"}, {"role": "assistant", "content": "r"}]}
                 for i in range(3)]
        lines.append({"id": "x@1", **lines[0]})  # an input's own '@' is escaped: no renamed id can be it
        path.write_text("\n".join(json.dumps(line) for line in lines + [{"id": "n", **lines[1]}] * 2) + "\n")
    kept, report = ingest([first, second])
    ids = [c["id"] for c in kept]
    assert ids == ["train.jsonl:0", "train.jsonl:1", "train.jsonl:2", "x%401", "n",
                   "train.jsonl:0@2", "train.jsonl:1@2", "train.jsonl:2@2", "x%401@2", "n@2"]
    assert report.modified["id_renamed"] == 5 and report.dropped == {"duplicate_id": 2}


def test_an_empty_system_turn_is_removed_not_a_cut(tmp_path):
    record = {"id": "s", "messages": [{"role": "system", "content": " "}, {"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "r"}]}
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(record) + "\n")
    kept, report = ingest([path])
    assert [m["role"] for m in kept[0]["messages"]] == ["user", "assistant"]
    assert report.modified == {"empty_system_turn_removed": 1} and not report.dropped
