"""Normalized conversation shards: `conversations/shard-{i:05d}.jsonl`, `conversations/eval.jsonl` and
`conversations/selection.jsonl` (ingest) and `regenerated/shard-{i:05d}.jsonl` (regenerate), all the same format.

One JSON object per line, UTF-8 (not ASCII-escaped): `id` (string), `source` (the input file's name),
`messages` (a list of `{"role": "system"|"user"|"assistant", "content": str}`), in shard order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.formats.atomic import atomic_file


class InvalidConversationShard(ValueError):
    pass


def write(path: Path, conversations: list[dict[str, Any]]) -> None:
    """Write atomically: a killed job never leaves a half-written file under the final name."""
    with atomic_file(Path(path)) as partial, open(partial, "w", encoding="utf-8") as handle:
        for conversation in conversations:
            handle.write(json.dumps(conversation, ensure_ascii=False) + "\n")


def read(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def validate(path: Path) -> int:
    """Raise InvalidConversationShard naming file, line and reason unless every line is a conversation;
    return the number of conversations."""
    count = 0
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidConversationShard(f"{path} line {number}: not JSON ({exc.msg})") from None
            problem = _record_problem(record)
            if problem:
                raise InvalidConversationShard(f"{path} line {number}: {problem}")
            count += 1
    return count


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return "not an object with a string id"
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        return f"conversation {record['id']!r} has no messages list"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) or "role" not in message:
            return f"conversation {record['id']!r} message {index} lacks role or string content"
    return None
