"""The split places whole groups: the parts of one conversation (`<id>_0`, `<id>_1`, ... as in ShareGPT's split
files) and identical conversations never sit on both sides of training and the held-out sets."""

from __future__ import annotations

import random

from eagle3_pipeline import conversation_groups
from eagle3_pipeline.conversations import split


def chat(conversation_id: str, text: str | None = None) -> dict:
    return {"id": conversation_id, "messages": [{"role": "user", "content": text or f"about {conversation_id}"},
                                                {"role": "assistant", "content": "r"}]}


def corpus() -> list[dict]:
    """1,200 single conversations, 20 conversations of 2-6 parts, 10 copies of single ones, a dataset's own
    numbering (item_0 ... item_99: more than 1 % of the records, too many for one conversation's parts) and one
    text 100 times (a template, not copies to keep together)."""
    rng = random.Random(0)
    records = [chat(f"s{i}") for i in range(1200)]
    records += [chat(f"long{g}_{p}") for g in range(20) for p in rng.sample(range(6), rng.randint(2, 6))]
    records += [chat(f"copy{i}", f"about s{i * 7}") for i in range(10)]
    records += [chat(f"item_{i}") for i in range(100)]
    records += [chat(f"tpl{i}", "Fill in the form.") for i in range(100)]  # a template repeated throughout
    return records


def group_key(conversation: dict) -> str:
    """What the test knows belongs together: a copy with its original, a part with its conversation."""
    cid = conversation["id"]
    if cid.startswith("copy"):
        return f"s{int(cid[4:]) * 7}"
    return cid.split("_")[0] if cid.startswith("long") else cid


def test_held_out_sets_share_no_conversation_part_or_copy_with_training():
    records, left_out = corpus(), 0
    for seed in range(20):
        parts = split(records, num_shards=4, eval_count=30, selection_count=30, train_count=None, seed=seed)
        training = {group_key(c) for shard in parts.shards for c in shard}
        evaluation = [group_key(c) for c in parts.evaluation]
        selection = [group_key(c) for c in parts.selection]
        assert len(evaluation) == len(set(evaluation)) == 30 and len(selection) == len(set(selection)) == 30
        assert not (set(evaluation) & training) and not (set(selection) & training)
        assert not set(evaluation) & set(selection)
        for held in parts.evaluation + parts.selection:  # the first part of a long conversation, never a later one
            if held["id"].startswith("long"):
                stem = held["id"].split("_")[0]
                assert held["id"] == min((c["id"] for c in records if c["id"].startswith(stem + "_")),
                                         key=lambda cid: int(cid.split("_")[1]))
        placed = sum(map(len, parts.shards)) + 60 + parts.left_out
        assert placed == len(records)
        left_out += parts.left_out
    assert left_out > 0  # some seeds held out a long conversation or a copy


def test_a_datasets_numbering_or_template_is_not_taken_for_one_conversation():
    group = conversation_groups.groups(corpus())
    for prefix in ("item_", "tpl"):  # 100 records of one stem or one text: more than 1 % of 1,430, so no grouping
        assert len({g for c, g in zip(corpus(), group, strict=True) if c["id"].startswith(prefix)}) == 100


def test_without_parts_or_copies_the_split_is_the_seeded_order():
    """Data with neither keeps the split it had before groups existed: the seeded order's first conversations."""
    records = [chat(f"c{i}") for i in range(50)]
    order = list(range(50))
    random.Random(3).shuffle(order)
    parts = split(records, num_shards=2, eval_count=5, selection_count=5, train_count=None, seed=3)
    assert [c["id"] for c in parts.evaluation] == [f"c{i}" for i in order[:5]]
    assert [c["id"] for c in parts.selection] == [f"c{i}" for i in order[5:10]]
    assert parts.shards[0] + parts.shards[1] != [] and parts.left_out == 0


def test_a_small_inputs_numbering_is_its_own_and_a_renamed_part_stays_with_its_conversation():
    """A 150-record input numbered q_0 ... q_149 beside 17,000 records is that input's numbering (over 1 % of it),
    not 150 parts of one conversation; `abc_1@2` (ingest's rename of an id an earlier input has) is still a part
    of conversation abc."""
    large = [{**chat(f"s{i}"), "source": "large.json"} for i in range(17000)]
    small = [{**chat(f"q_{i}"), "source": "small.json"} for i in range(150)]
    renamed = [{**chat("abc_0"), "source": "large.json"}, {**chat("abc_1@2", "more"), "source": "copy.json"}]
    group = conversation_groups.groups(large + small + renamed)
    assert len(set(group[17000:17150])) == 150 and group[-1] == group[-2]


def test_a_long_conversation_is_no_likelier_to_be_held_out_than_a_short_one():
    """Each group counts once in the seeded order: picking records instead would hold out a 20-part conversation 20
    times as often, and leave its 19 other parts out of training (on ShareGPT that cost 11 % of the training text)."""
    records = [chat(f"s{i}") for i in range(1000)] + [chat(f"long{g}_{p}") for g in range(100) for p in range(20)]
    long_held, held, left_out = 0, 0, 0
    for seed in range(10):
        parts = split(records, num_shards=4, eval_count=50, selection_count=50, train_count=None, seed=seed)
        long_held += sum(c["id"].startswith("long") for c in parts.evaluation + parts.selection)
        held += len(parts.evaluation) + len(parts.selection)
        left_out += parts.left_out
    assert 0.04 < long_held / held < 0.16  # 100 of 1,100 conversations are long: ~9 % (by records it was ~67 %)
    assert left_out == 19 * long_held
