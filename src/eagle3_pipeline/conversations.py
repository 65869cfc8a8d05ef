"""Conversation ingest: raw JSON/JSONL in ShareGPT or OpenAI shape -> normalized conversations
(`{"id", "source", "messages": [{"role", "content"}, ...]}`, written by formats/conversation_shards).

Every dropped record is counted under a reason and the first few of each reason are kept as examples
(file, record index, byte offset, why), so a user can find them. Truncated files keep every complete record.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from eagle3_pipeline import conversation_groups
from eagle3_pipeline.copying import CopyBoost
from eagle3_pipeline.raw_records import UNDECODABLE_BYTE, DropReport, IngestError, RawRecord, iter_raw_records

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}
TEXT_PART_TYPES = ("text", "input_text", "output_text")  # OpenAI chat / responses content parts
_SURROGATE = re.compile("[\ud800-\udfff]")


# ---------------------------------------------------------------- normalising one record

def _has_surrogates(value: str) -> bool:
    return UNDECODABLE_BYTE.search(value) is not None


def _replace_lone_surrogates(value: str) -> tuple[str, int]:
    """JSON may escape half of a UTF-16 pair ("\\ud800"); such a string cannot be written as UTF-8."""
    return _SURROGATE.subn("\ufffd", value)


def normalize_record(record: RawRecord, report: DropReport) -> dict[str, Any] | None:
    """Return the normalized conversation, or None after counting why it was dropped."""
    where = (record.source, record.index)
    if record.error is not None:
        report.drop(record.reason, *where, record.error, record.offset)
        return None
    value = record.value
    if not isinstance(value, dict):
        report.drop("malformed_record", *where, f"record is a {type(value).__name__}, not an object",
                    record.offset)
        return None
    turns = value.get("conversations", value.get("messages"))
    if turns is None:
        turns = task_turns(value)
    if turns is None:
        report.drop("malformed_record", *where, "no 'conversations' or 'messages' field", record.offset)
        return None
    if not isinstance(turns, list):
        report.drop("malformed_record", *where, "'conversations'/'messages' is not a list", record.offset)
        return None
    if not turns:
        report.drop("empty_conversation", *where, "no turns", record.offset)
        return None
    messages = []
    for turn_index, turn in enumerate(turns):
        message, problem = _normalize_turn(turn, record.undecodable_bytes, report, where, turn_index)
        if problem:
            reason, detail = problem
            report.drop(reason, *where, f"turn {turn_index}: {detail}", record.offset)
            return None
        messages.append(message)
    replaced = 0
    for message in messages:
        message["content"], count = _replace_lone_surrogates(message["content"])
        replaced += count
    messages = _trim(messages, report, *where)
    roles = {m["role"] for m in messages}
    if "assistant" not in roles:
        report.drop("no_assistant_turn", *where, "no assistant reply with content", record.offset)
        return None
    if "user" not in roles:
        report.drop("no_user_turn", *where, "only assistant/system turns", record.offset)
        return None
    record_id = value.get("id")
    record_id = str(record_id) if record_id not in (None, "") else f"{Path(record.source).name}:{record.index}"
    record_id, count = _replace_lone_surrogates(record_id)
    replaced += count
    # '#' and '@' mark ids the pipeline derives (data.weights' copies `<id>#<n>`, regenerate.samples' `<id>#s<k>`,
    # an id an earlier input has `<id>@<input>`): an input id holding one is escaped, so no derived id is an input's
    record_id = record_id.replace("%", "%25").replace("#", "%23").replace("@", "%40")
    if replaced:
        report.modify("lone_surrogates_replaced", *where, f"{replaced} lone UTF-16 surrogate(s) -> U+FFFD")
    return {"id": record_id, "source": Path(record.source).name, "messages": messages}


def task_turns(value: dict[str, Any]) -> list[dict[str, str]] | None:
    """A task-and-solution record as one user turn and one assistant turn, for the instruction sets that ship
    that way: CodeI/O (`task_description`, `input_output_spec`, `code_sample`; in reasoning-gym) and
    Alpaca-style (`instruction`, optional `input`, `output`). None for any other shape."""
    if isinstance(value.get("task_description"), str) and isinstance(value.get("code_sample"), str):
        spec = value.get("input_output_spec")
        task = value["task_description"] + (f"\n\n{spec}" if isinstance(spec, str) and spec.strip() else "")
        return [{"role": "user", "content": task + "\n\nWrite a Python solution."},
                {"role": "assistant", "content": f"```python\n{value['code_sample'].strip()}\n```"}]
    if isinstance(value.get("instruction"), str) and isinstance(value.get("output"), str):
        extra = value.get("input")
        task = value["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
        return [{"role": "user", "content": task}, {"role": "assistant", "content": value["output"]}]
    return None


def _normalize_turn(turn: Any, undecodable_bytes: bool, report: DropReport, where: tuple[str, int],
                    turn_index: int) -> tuple[dict[str, str] | None, tuple[str, str] | None]:
    if not isinstance(turn, dict):
        return None, ("malformed_record", f"turn is a {type(turn).__name__}, not an object")
    raw_role = turn.get("from", turn.get("role"))
    content = turn.get("value", turn.get("content"))
    if not isinstance(raw_role, str):
        return None, ("malformed_record", "turn has no 'from'/'role'")
    role = ROLE_MAP.get(raw_role.strip().lower())
    if role is None:
        return None, ("unknown_role", f"unknown role {raw_role!r}")
    if isinstance(content, list):
        content, problem = _join_content_parts(content, report, where, turn_index)
        if problem:
            return None, problem
    if not isinstance(content, str):
        return None, ("non_string_content", f"content is {type(content).__name__}, not a string")
    if undecodable_bytes and _has_surrogates(content):
        return None, ("invalid_utf8", "content holds bytes that are not valid UTF-8")
    return {"role": role, "content": content}, None


def _join_content_parts(parts: list[Any], report: DropReport, where: tuple[str, int], turn_index: int
                        ) -> tuple[str, tuple[str, str] | None]:
    """OpenAI content parts: the text parts joined by newlines (as vLLM does); others counted and dropped."""
    texts, dropped = [], Counter()
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and isinstance(part.get("type"), str):
            dropped[part["type"]] += 1
        else:
            return "", ("malformed_record", "a content part is neither a string nor an object with a 'type'")
    report.modify("content_parts_joined", *where, f"turn {turn_index}: {len(texts)} text part(s)")
    if dropped:
        report.modify("non_text_content_parts_dropped", *where,
                      f"turn {turn_index}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(dropped.items())))
    return "\n".join(texts), None


def _trim(messages: list[dict[str, str]], report: DropReport, source: str, index: int) -> list[dict[str, str]]:
    """Drop empty system turns, cut at the first other empty turn, drop leading assistant and trailing user turns."""
    if any(m["role"] == "system" and not m["content"].strip() for m in messages):
        report.modify("empty_system_turn_removed", source, index, "an empty system prompt")
        messages = [m for m in messages if m["role"] != "system" or m["content"].strip()]
    for position, message in enumerate(messages):
        if not message["content"].strip():
            report.modify("cut_at_empty_turn", source, index, f"turn {position} is empty")
            messages = messages[:position]
            break
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    leading = 0
    while leading < len(rest) and rest[leading]["role"] == "assistant":
        leading += 1
    if leading and leading < len(rest):
        report.modify("leading_assistant_turns_removed", source, index, f"{leading} turn(s)")
        rest = rest[leading:]
    while rest and rest[-1]["role"] != "assistant":
        rest = rest[:-1]
    return system + rest


# ---------------------------------------------------------------- the whole stage

def ingest(paths: list[Path]) -> tuple[list[dict[str, Any]], DropReport]:
    """Read every input; return kept conversations in input order and the report."""
    report = DropReport()
    kept: list[dict[str, Any]] = []
    seen_ids: dict[str, int] = {}  # id -> the input it came from
    for position, path in enumerate(paths):
        if not path.is_file():
            raise IngestError(f"{path}: input file does not exist")
        for record in iter_raw_records(path, report):
            report.read += 1
            conversation = normalize_record(record, report)
            if conversation is None:
                continue
            record_id = conversation["id"]
            if seen_ids.get(record_id, position) != position:  # datasets number their records alike: keep both
                conversation["id"] = f"{record_id}@{position + 1}"
            if conversation["id"] in seen_ids:
                report.drop("duplicate_id", record.source, record.index, f"id {record_id!r} seen before")
                continue
            if conversation["id"] != record_id:
                report.modify("id_renamed", record.source, record.index,
                              f"id {record_id!r} is an earlier input's: {conversation['id']!r}")
            seen_ids[conversation["id"]] = position
            kept.append(conversation)
    report.kept = len(kept)
    return kept, report


RECORD_SHAPES = ("ShareGPT {conversations: [{from, value}]}, OpenAI {messages: [{role, content}]} or task/solution "
                 "(CodeI/O, Alpaca) records, one JSON object per line or a JSON array")
INGEST_FIXES = {
    "malformed_json": f"data.inputs must hold {RECORD_SHAPES}",
    "malformed_record": f"data.inputs must hold {RECORD_SHAPES}",
    "non_string_content": "turn contents must be strings or OpenAI content-part lists",
    "invalid_utf8": "re-encode the input as UTF-8",
    "unknown_role": f"roles must be one of {', '.join(sorted(ROLE_MAP))}",
}


def check_systemic(report: DropReport) -> None:
    """Stop when most records were dropped for one reason: a wrong file or format, not a few bad records."""
    from eagle3_pipeline import systemic

    reason = max(report.dropped, key=report.dropped.get) if report.dropped else None
    example = None
    if reason and report.examples.get(reason):
        first = report.examples[reason][0]
        example = f"{first['file']} record {first['record']}: {first['reason']}"
    systemic.check("ingest", "of data.inputs", report.read, report.kept, report.dropped, INGEST_FIXES,
                   f"check data.inputs ({RECORD_SHAPES})", example)


Conversations = list[dict[str, Any]]


class Split(NamedTuple):
    shards: list[Conversations]  # training, `num_shards` near-equal shards
    evaluation: Conversations  # the `held-out` prompt set: never trained on, never used to pick weights
    selection: Conversations  # the offline acceptance estimate that picks the epoch: never trained on
    left_out: int  # other parts and copies of held-out conversations: in no set


def split(conversations: Conversations, num_shards: int, eval_count: int, selection_count: int,
          train_count: int | None, seed: int, weights: dict[str, float] | None = None,
          copying: CopyBoost | None = None) -> Split:
    """Deterministic seeded split into two disjoint held-out sets and `num_shards` near-equal training shards.

    One seeded order of the groups (conversation_groups: the parts of one conversation, identical copies; each group
    counts once, however many parts it has, so long conversations are not favoured) places them: the first
    `eval_count` groups are the evaluation set (the same for a seed whatever `selection_count` is), the next
    `selection_count` the selection set, the rest (at most `train_count` conversations) training. A held-out set
    takes one conversation of a group (its first part); the group's others are left out. `weights` (by source file
    name) repeats a source's training conversations: weight 2.5 puts each in twice and a seeded half of them a
    third time (copies get ids `<id>#2`, ...); 0 leaves the source out of training. `copying` multiplies the weight
    of conversations whose replies copy from the user (copying.CopyBoost)."""
    group = conversation_groups.groups(conversations)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        members.setdefault(g, []).append(i)
    order = list(members)  # by each group's first conversation: without groups, the conversations' own order
    random.Random(seed).shuffle(order)
    first = conversation_groups.representatives(conversations, group)
    held_out = eval_count + selection_count
    eval_ids = [first[g] for g in order[:eval_count]]
    selection_ids = [first[g] for g in order[eval_count:held_out]]
    train_ids = [i for g in order[held_out:] for i in members[g]]
    left_out = len(conversations) - len(eval_ids) - len(selection_ids) - len(train_ids)
    if train_count is not None:
        train_ids = train_ids[:train_count]
    training = [conversations[i] for i in train_ids]
    if weights or (copying is not None and copying.active):
        training = _repeat_by_weight(training, weights or {}, seed, copying)
    if len(training) < num_shards:
        raise IngestError(f"only {len(training)} training conversations for {num_shards} shards (after "
                          f"{len(eval_ids)} held out for evaluation and {len(selection_ids)} for selection)")
    shards = [training[s::num_shards] for s in range(num_shards)]
    return Split(shards, [conversations[i] for i in eval_ids], [conversations[i] for i in selection_ids], left_out)


def _repeat_by_weight(training: Conversations, weights: dict[str, float], seed: int,
                      copying: CopyBoost | None = None) -> Conversations:
    rng = random.Random(seed + 1)
    weighted = []
    for conversation in training:
        weight = weights.get(conversation["source"], 1.0) * (copying.factor(conversation) if copying else 1.0)
        copies = int(weight) + (rng.random() < weight - int(weight))
        weighted += [conversation if n == 1 else conversation | {"id": f"{conversation['id']}#{n}"}
                     for n in range(1, copies + 1)]
    order = list(range(len(weighted)))
    random.Random(seed + 2).shuffle(order)  # copies spread over the shards
    return [weighted[i] for i in order]
