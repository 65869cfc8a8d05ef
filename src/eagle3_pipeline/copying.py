"""How much a conversation's replies copy from the user: the share of the replies' word 4-grams that already appear
in the user's (and the system's) earlier turns. Replies that quote, edit, translate or rewrite the prompt teach a
drafter to copy from its context, which an EAGLE-3 drafter can see through the target's hidden states; prompts with
explicit constraints (words to include, formats to follow) reward it. `data.copying_weight` uses such conversations
more often in training (conversations.split), as `data.weights` does for a whole input.

Earlier replies are not a source: a reply repeating the assistant's own text (a loop) is not copying the user."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

WORD = re.compile(r"\w+")
SPAN = 4  # words: long enough that common phrases ("it is a", "in order to") rarely match by chance


def word_spans(text: str) -> list[tuple[str, ...]]:
    words = WORD.findall(text.lower())
    return [tuple(words[i:i + SPAN]) for i in range(len(words) - SPAN + 1)]


def copied_share(messages: list[dict[str, str]]) -> float:
    """Of every reply's word 4-grams, the share already in the user's or system's turns before that reply (0 for
    replies shorter than four words)."""
    prompt: set[tuple[str, ...]] = set()
    copied = total = 0
    for message in messages:
        spans = word_spans(message["content"])
        if message["role"] == "assistant":
            total += len(spans)
            copied += sum(span in prompt for span in spans)
        else:
            prompt.update(spans)
    return copied / total if total else 0.0


def repeated_ngram_share(text: str, n: int = 4) -> float:
    """Share of a reply's word n-grams (split at whitespace) that already occurred earlier in it: how much it loops
    (0 for a reply with none)."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


@dataclass(frozen=True)
class CopyBoost:
    """Conversations whose replies copy at least `min_share` of their 4-grams from the user count `weight` times
    (`data.copying_weight`, `data.copying_min_share`)."""
    min_share: float
    weight: float

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> CopyBoost:
        """From the data section, or from the data rules' params, which leave the copying keys out while copying is
        off (`rule_params`)."""
        if "copying_weight" not in data:
            return cls(min_share=1.0, weight=1.0)  # off
        return cls(data["copying_min_share"], data["copying_weight"])

    @property
    def active(self) -> bool:
        return self.weight != 1.0

    def factor(self, conversation: dict[str, Any]) -> float:
        """The conversation's weight from copying: `weight` if it copies enough, else 1."""
        if not self.active:
            return 1.0
        return self.weight if copied_share(conversation["messages"]) >= self.min_share else 1.0


def rule_params(data: dict[str, Any]) -> dict[str, Any]:
    """The data section as the data rules' params: without the copying keys while copying is off (weight 1), so a
    results directory written before they existed is not redone from ingest on for a setting that changes nothing
    (Snakemake reruns a rule whose params changed)."""
    if data.get("copying_weight", 1.0) != 1.0:
        return data
    return {key: value for key, value in data.items() if key not in ("copying_weight", "copying_min_share")}
