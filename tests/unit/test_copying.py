"""How much a conversation's replies copy from the user (copying.py), and `data.copying_weight` repeating such
conversations in the training split (conversations.split) while the held-out sets stay as they are."""

from __future__ import annotations

import pytest

from eagle3_pipeline.conversations import split
from eagle3_pipeline.copying import CopyBoost, copied_share

PARAGRAPH = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat"


def conversation(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "source": "chats.json", "messages": [{"role": r, "content": c} for r, c in turns]}


def test_a_reply_that_quotes_the_user_copies_and_one_in_its_own_words_does_not():
    quoting = conversation("q", ("user", f"Fix the grammar: {PARAGRAPH}"), ("assistant", PARAGRAPH.capitalize() + "."))
    own_words = conversation("o", ("user", f"Summarise: {PARAGRAPH}"),
                             ("assistant", "An animal leaps; another one naps."))
    assert copied_share(quoting["messages"]) == 1.0
    assert copied_share(own_words["messages"]) == 0.0
    half = conversation("h", ("user", PARAGRAPH), ("assistant", "the quick brown fox jumps and then something else "
                                                               "entirely new happens"))
    assert copied_share(half["messages"]) == pytest.approx(2 / 9)  # 2 of its 9 word 4-grams are the user's


def test_the_assistants_own_earlier_text_is_not_a_source():
    looping = conversation("l", ("user", "Tell me a story."), ("assistant", PARAGRAPH), ("user", "Again?"),
                           ("assistant", PARAGRAPH))
    assert copied_share(looping["messages"]) == 0.0  # repeating itself is not copying the user
    system = conversation("s", ("system", PARAGRAPH), ("user", "Repeat the rule."), ("assistant", PARAGRAPH))
    assert copied_share(system["messages"]) == 1.0
    assert copied_share(conversation("t", ("user", PARAGRAPH), ("assistant", "Yes, the lazy dog."))["messages"]) == 0


def test_copying_weight_repeats_only_the_training_conversations_that_copy():
    plain = [conversation(f"p{i}", ("user", f"Question {i}?"), ("assistant", f"Answer number {i} is here now."))
             for i in range(60)]
    copying = [conversation(f"c{i}", ("user", f"Fix: {PARAGRAPH} {i}"), ("assistant", PARAGRAPH)) for i in range(20)]
    every = plain + copying
    boosted = split(every, 2, 10, 5, None, seed=3, copying=CopyBoost(min_share=0.5, weight=2.0))
    unboosted = split(every, 2, 10, 5, None, seed=3, copying=CopyBoost(min_share=0.5, weight=1.0))
    assert boosted.evaluation == unboosted.evaluation and boosted.selection == unboosted.selection
    trained = [c["id"] for shard in boosted.shards for c in shard]
    once = [c["id"] for shard in unboosted.shards for c in shard]
    copies = sorted(i for i in trained if "#" in i)
    assert copies == sorted(f"{i}#2" for i in once if i.startswith("c"))  # each copying one twice, nothing else
    assert len(trained) == len(once) + len(copies)
    both = split(every, 2, 10, 5, None, seed=3, weights={"chats.json": 2.0}, copying=CopyBoost(0.5, 2.0))
    ids = [c["id"] for shard in both.shards for c in shard]
    assert sum(i.startswith("c") for i in ids) == 4 * sum(i.startswith("c") for i in once)  # weights multiply


def test_the_data_rules_params_leave_copying_out_while_it_is_off():
    """A results directory from before the copying keys existed keeps its ingest and tokenize params (no rerun)
    unless copying is switched on; the stage reads what it was given."""
    from eagle3_pipeline.copying import rule_params

    data = {"inputs": ["a.json"], "seed": 1, "copying_weight": 1.0, "copying_min_share": 0.2}
    assert rule_params(data) == {"inputs": ["a.json"], "seed": 1}
    assert not CopyBoost.of(rule_params(data)).active
    on = data | {"copying_weight": 3.0}
    assert rule_params(on) == on and CopyBoost.of(rule_params(on)) == CopyBoost(min_share=0.2, weight=3.0)
