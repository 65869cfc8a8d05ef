"""Conversations that must stay on one side of the split between training and the held-out sets.

ShareGPT's split files cut a long conversation into parts named `<id>_0`, `<id>_1`, ...; datasets also hold exact
copies of a conversation. A held-out conversation whose other parts or copies are trained on measures recall, not
drafting (the bundled ShareGPT has 9,431 conversations in 17,345 parts, up to 89 parts each, and 743 extra
copies), so parts and copies form one group and the split places whole groups. A stem that more than `MAX_SHARE`
of all records share is a dataset's own numbering (`item_0` ... `item_9999`), not parts, and a text repeated that
often is the dataset's template: neither groups (a group that size would leave most of the data out)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from typing import Any

MAX_SHARE = 0.01
_PART = re.compile(r"(.+)_(\d+)")


def part_of(conversation_id: str) -> tuple[str, int] | None:
    """(stem, part number) of an id of the `<stem>_<n>` shape, else None."""
    match = _PART.fullmatch(conversation_id)
    return (match.group(1), int(match.group(2))) if match else None


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
    sizes = Counter(key for key in parts + contents if key)
    largest = max(2, int(MAX_SHARE * len(conversations)))
    first_with: dict[tuple[str, str], int] = {}
    for i in range(len(conversations)):
        for key in (parts[i], contents[i]):
            if key and sizes[key] <= largest:  # more: a dataset's numbering, or a template repeated throughout
                parent[root(i)] = root(first_with.setdefault(key, i))
    return [root(i) for i in range(len(conversations))]


def representatives(conversations: list[dict[str, Any]], group: list[int]) -> dict[int, int]:
    """Per group, the conversation a held-out set takes: the first part (the later ones continue it, and their first
    user turn is often just "continue"), else the first in input order."""
    def rank(i: int) -> tuple[int, int]:
        part = part_of(conversations[i]["id"])
        return (part[1] if part else 0, i)

    chosen: dict[int, int] = {}
    for i, g in enumerate(group):
        if g not in chosen or rank(i) < rank(chosen[g]):
            chosen[g] = i
    return chosen
