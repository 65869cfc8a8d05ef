"""Chat-template tokenization with a template-agnostic assistant loss mask.

The mask marks exactly the tokens the assistant produces: its reply text plus the end-of-turn token it
emits. It is found without knowing the template: for the k-th message (an assistant turn) we render
`messages[:k]` with the generation prompt and `messages[:k+1]` without it; the first is a prefix of the
second and the difference is what the assistant wrote, followed by template glue. The glue after the
end-of-turn marker (e.g. a newline) is cut. Tokens whose character span starts inside an assistant span
get mask 1. Templates that rewrite earlier turns (the rendered prefix is not a prefix of the full text)
are rejected per conversation with a counted reason rather than masked wrongly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Templates for targets whose tokenizer has none (`target.chat_template: <name>`); a file path works too.
BUILTIN_CHAT_TEMPLATES = {
    "chatml": (
        "{%- for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
}
# A record this many times longer (in characters) than max_seq_len tokens can cover is cut or dropped
# before tokenizing: a 50 MB record took a minute and 9 GB to tokenize only to be dropped.
CHARACTER_BOUND_MARGIN = 2


class TemplateError(ValueError):
    """The chat template cannot be rendered or is not prefix-stable for this conversation."""


def chat_template_text(setting: str) -> str:
    """`target.chat_template`: a built-in name or a path to a Jinja file."""
    if setting in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[setting]
    return Path(setting).expanduser().read_text(encoding="utf-8")


def character_bound(tokenizer: Any, max_seq_len: int) -> int:
    """Characters that surely hold more than `max_seq_len` tokens, twice over.

    No token covers more characters than its vocabulary string is long (byte-level strings have one
    character per byte), so text longer than `max_seq_len * longest` has more than `max_seq_len` tokens."""
    longest = max(len(token) for token in tokenizer.get_vocab())
    return CHARACTER_BOUND_MARGIN * max_seq_len * longest


def cut_to_characters(conversation: dict[str, Any], bound: int) -> dict[str, Any] | None:
    """The conversation cut to `bound` characters of content, or None when it is within the bound.

    Tokens of the kept prefix are those of the whole conversation far before the cut, and the bound is
    twice what `max_seq_len` tokens can span, so truncation to `max_seq_len` keeps the same tokens."""
    if sum(len(m["content"]) for m in conversation["messages"]) <= bound:
        return None
    messages, left = [], bound
    for message in conversation["messages"]:
        messages.append({**message, "content": message["content"][:left]})
        left -= len(messages[-1]["content"])
        if left <= 0:
            break
    return {**conversation, "messages": messages}


@dataclass
class TokenizedConversation:
    sample_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool = False


def end_of_turn_marker(tokenizer: Any, override: str | None = None) -> str | None:
    """The string the assistant emits to end its turn: config override, else the tokenizer's EOS."""
    return override or getattr(tokenizer, "eos_token", None)


def template_hash(tokenizer: Any) -> str:
    """Identity of everything that decides token ids: vocab, template, special tokens."""
    digest = hashlib.sha256()
    digest.update((tokenizer.chat_template or "").encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.all_special_tokens).encode())
    return digest.hexdigest()[:16]


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool,
           **template_kwargs: Any) -> str:
    """The chat template's text; `template_kwargs` reach the template (e.g. `enable_thinking`)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except Exception as exc:  # jinja raises TemplateError, ValueError, ... depending on the template
        raise TemplateError(f"chat template failed: {exc}") from exc


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]], end_marker: str | None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return its text and the [start, end) character spans of assistant output."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:k], add_generation_prompt=True)
        through = render(tokenizer, messages[: k + 1], add_generation_prompt=False)
        if not through.startswith(before) or not full.startswith(through):
            raise TemplateError(f"template is not prefix-stable at message {k}")
        start, end = len(before), len(through)
        content = message["content"]
        content_at = full.find(content, start, end)
        if content_at < 0:  # some templates trim the reply
            content = content.strip()
            content_at = full.find(content, start, end)
        if content_at < 0:
            raise TemplateError(f"assistant message {k} does not appear verbatim in the rendered text")
        content_end = content_at + len(content)
        if end_marker:
            marker_at = full.find(end_marker, content_end, end)
            end = marker_at + len(end_marker) if marker_at >= 0 else content_end
        else:
            end = content_end
        spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer: Any, conversation: dict[str, Any], end_marker: str | None,
                          max_seq_len: int, overlength: str) -> TokenizedConversation | None:
    """Tokenize one normalized conversation. Returns None when `overlength == 'drop'` and it is too long."""
    text, spans = assistant_spans(tokenizer, conversation["messages"], end_marker)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int32)
    starts = np.asarray([s for s, _ in encoded["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for start, end in spans:
        mask[(starts >= start) & (starts < end)] = 1
    truncated = len(ids) > max_seq_len
    if truncated:
        if overlength == "drop":
            return None
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    return TokenizedConversation(conversation["id"], ids, mask, truncated)


@dataclass
class TokenizeOutcome:
    """What the tokenize stage makes of one conversation: its tokens, or the counted reason it is dropped."""

    tokenized: TokenizedConversation | None  # also set when dropped for having no loss tokens
    dropped: str | None = None  # dropped_overlength, dropped_template_error or dropped_no_loss_tokens
    cut_before_tokenizing: bool = False
    template_error: str | None = None

    @property
    def kept_tokens(self) -> int:
        """Tokens this conversation adds to its token shard (0 when dropped)."""
        return 0 if self.dropped or self.tokenized is None else len(self.tokenized.input_ids)


def tokenize_or_drop(tokenizer: Any, conversation: dict[str, Any], end_marker: str | None, bound: int,
                     max_seq_len: int, overlength: str) -> TokenizeOutcome:
    """One conversation as the tokenize stage keeps or drops it; `bound` is `character_bound(...)`.

    The disk plan tokenizes its sample through here too, so its estimate drops what the stage drops."""
    cut = cut_to_characters(conversation, bound)
    if cut is not None:  # surely over max_seq_len: decided without tokenizing megabytes
        if overlength == "drop":
            return TokenizeOutcome(None, "dropped_overlength")
        conversation = cut
    try:
        tokenized = tokenize_conversation(tokenizer, conversation, end_marker, max_seq_len, overlength)
    except TemplateError as exc:
        return TokenizeOutcome(None, "dropped_template_error", cut is not None, str(exc))
    if tokenized is None:
        return TokenizeOutcome(None, "dropped_overlength", cut is not None)
    if not tokenized.loss_mask.any():  # e.g. truncation cut every assistant token
        return TokenizeOutcome(tokenized, "dropped_no_loss_tokens", cut is not None)
    return TokenizeOutcome(tokenized, None, cut is not None)
