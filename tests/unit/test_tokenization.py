"""Loss mask = exactly the assistant-produced text plus its end-of-turn token, on three real templates."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from eagle3_pipeline.tokenization import (
    TemplateError,
    assistant_spans,
    end_of_turn_marker,
    tokenize_conversation,
)
from tests.conftest import DATA

CONVERSATION = {
    "id": "t1",
    "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4. Anything else?"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sky.\n\nAnd the sea."},
    ],
}
TEMPLATES = {
    # name: (template file or None for the model's own, special tokens to add, end-of-turn marker)
    "smollm2": (None, [], "<|im_end|>"),
    "llama3_style": ("llama3_style.jinja", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                            "<|eot_id|>"], "<|eot_id|>"),
    "qwen_style": ("qwen_style.jinja", [], "<|im_end|>"),
}


@pytest.fixture(params=list(TEMPLATES))
def tokenizer_and_marker(request, target_dir):
    template_file, specials, marker = TEMPLATES[request.param]
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    if template_file:
        tokenizer.chat_template = (DATA / "templates" / template_file).read_text()
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer, marker


def masked_runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    runs, current = [], []
    for token, bit in zip(ids.tolist(), mask.tolist(), strict=True):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_masked_tokens_are_exactly_the_assistant_replies(tokenizer_and_marker):
    tokenizer, marker = tokenizer_and_marker
    result = tokenize_conversation(tokenizer, CONVERSATION, marker, max_seq_len=4096, overlength="truncate")
    runs = masked_runs(result.input_ids, result.loss_mask)
    replies = [m["content"] for m in CONVERSATION["messages"] if m["role"] == "assistant"]
    assert [tokenizer.decode(run) for run in runs] == [reply + marker for reply in replies]
    # Everything else (system prompt, user turns, role headers, glue) is unmasked.
    full = tokenizer.decode(result.input_ids)
    assert full == tokenizer.apply_chat_template(CONVERSATION["messages"], tokenize=False)
    assert not result.truncated


def test_smollm2_default_system_prompt_is_rendered_and_unmasked(smollm2_tokenizer):
    text, spans = assistant_spans(smollm2_tokenizer, CONVERSATION["messages"], "<|im_end|>")
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert all(text[start:end].endswith("<|im_end|>") for start, end in spans)
    assert end_of_turn_marker(smollm2_tokenizer) == "<|im_end|>"


def test_overlength_policy(smollm2_tokenizer):
    full = tokenize_conversation(smollm2_tokenizer, CONVERSATION, "<|im_end|>", 4096, "truncate")
    cut = tokenize_conversation(smollm2_tokenizer, CONVERSATION, "<|im_end|>", 50, "truncate")
    assert cut.truncated and len(cut.input_ids) == 50
    assert np.array_equal(cut.input_ids, full.input_ids[:50]) and np.array_equal(cut.loss_mask, full.loss_mask[:50])
    assert tokenize_conversation(smollm2_tokenizer, CONVERSATION, "<|im_end|>", 50, "drop") is None


def test_template_that_rewrites_history_is_rejected(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    original = tokenizer.chat_template
    # Drops earlier assistant turns, as thinking-model templates do: not prefix-stable.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    try:
        with pytest.raises(TemplateError, match="prefix-stable"):
            tokenize_conversation(tokenizer, CONVERSATION, "<|im_end|>", 4096, "truncate")
    finally:
        tokenizer.chat_template = original


def test_a_giant_record_is_cut_before_tokenizing_and_keeps_the_same_tokens(smollm2_tokenizer):
    import random

    from eagle3_pipeline.tokenization import character_bound, cut_to_characters

    words = ["river", "stone", "quietly", "42", "naïve", "über", "\n\n", "(see below)", "tokens,"]
    rng = random.Random(0)
    giant_reply = " ".join(rng.choice(words) for _ in range(60_000))  # ~400k characters
    giant = {"id": "giant", "messages": [{"role": "user", "content": "Tell me everything."},
                                         {"role": "assistant", "content": giant_reply}]}
    bound = character_bound(smollm2_tokenizer, 64)
    cut = cut_to_characters(giant, bound)
    assert cut is not None and sum(len(m["content"]) for m in cut["messages"]) == bound < len(giant_reply)
    full = tokenize_conversation(smollm2_tokenizer, giant, "<|im_end|>", 64, "truncate")
    short = tokenize_conversation(smollm2_tokenizer, cut, "<|im_end|>", 64, "truncate")
    assert np.array_equal(full.input_ids, short.input_ids) and np.array_equal(full.loss_mask, short.loss_mask)
    assert full.truncated and len(full.input_ids) == 64
    assert cut_to_characters(CONVERSATION, bound) is None  # normal records are never touched


def test_the_builtin_chatml_template_serves_a_tokenizer_without_one(target_dir):
    from eagle3_pipeline.tokenization import chat_template_text

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    tokenizer.chat_template = None
    with pytest.raises(TemplateError, match="chat template failed"):
        tokenize_conversation(tokenizer, CONVERSATION, "<|im_end|>", 4096, "truncate")
    tokenizer.chat_template = chat_template_text("chatml")
    result = tokenize_conversation(tokenizer, CONVERSATION, "<|im_end|>", 4096, "truncate")
    assert [tokenizer.decode(run) for run in masked_runs(result.input_ids, result.loss_mask)] == [
        "It is 4. Anything else?<|im_end|>", "Blue, like the sky.\n\nAnd the sea.<|im_end|>"]
