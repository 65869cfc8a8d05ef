"""Conversations that must stay on one side of the split between training and the held-out sets.

ShareGPT's split files cut a long conversation into parts named `<id>_0`, `<id>_1`, ...; datasets also hold exact
copies of a conversation. A held-out conversation whose other parts or copies are trained on measures recall, not
drafting (the bundled ShareGPT has 9,431 conversations in 17,345 parts, up to 89 parts each, and 743 extra
copies), so parts and copies form one group and the split places whole groups. A stem that more than `MAX_SHARE`
of an input's records share is that dataset's own numbering (`item_0` ... `item_9999`), not parts, and a text
repeated in more than that share of all records is a template: neither groups (a group that size would leave most
of the data out)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from typing import Any

MAX_SHARE = 0.01
_PART = re.compile(r"(.+)_(\d+)(?:@\d+)?")  # `@<n>`: ingest's rename of an id an earlier input has


def part_of(conversation_id: str) -> tuple[str, int] | None:
    """(stem, part number) of an id of the `<stem>_<n>` shape, else None."""
    match = _PART.fullmatch(conversation_id)
    return (match.group(1), int(match.group(2))) if match else None


def limit(records: int) -> int:
    """The most records one conversation's parts, or one text's copies, may hold among `records`."""
    return max(2, int(MAX_SHARE * records))


def groups(conversations: list[dict[str, Any]]) -> list[int]:
    """A group number per conversation: the parts of one conversation and identical conversations share one."""
    parent = list(range(len(conversations)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    parts = [("stem", part[0]) if (part := part_of(conversation["id"])) else None for conversation in conversations]
    contents = [("content", hashlib.sha256(json.dumps(conversation["messages"]).encode()).hexdigest())
                for conversation in conversations]
    inputs = Counter(conversation.get("source") for conversation in conversations)
    per_input = Counter((conversation.get("source"), key)
                        for conversation, key in zip(conversations, parts, strict=True))
    numbering = {key for (source, key), count in per_input.items() if key and count > limit(inputs[source])}
    copies = Counter(contents)
    first_with: dict[tuple[str, str], int] = {}
    for i in range(len(conversations)):
        # more than a share of an input holding one stem: its numbering; of all records one text: a template
        for key in (parts[i] if parts[i] not in numbering else None,
                    contents[i] if copies[contents[i]] <= limit(len(conversations)) else None):
            if key:
                parent[root(i)] = root(first_with.setdefault(key, i))
    return [root(i) for i in range(len(conversations))]


def representatives(conversations: list[dict[str, Any]], group: list[int]) -> dict[int, int]:
    """Per group, the conversation a held-out set takes: the first part (the later ones continue it, and their first
    user turn is often just "continue"), else the first in input order."""
    ranks = [(part[1] if (part := part_of(conversation["id"])) else 0, i)
             for i, conversation in enumerate(conversations)]
    chosen: dict[int, int] = {}
    for i, g in enumerate(group):
        if g not in chosen or ranks[i] < ranks[chosen[g]]:
            chosen[g] = i
    return chosen
