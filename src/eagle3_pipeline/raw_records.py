"""Raw input records: JSON arrays and JSON lines (gzipped when named *.gz) read record by record, recovering from
truncation and bad lines, with the report of what was read, changed and dropped (by reason, with a few examples
each: file, record index, byte offset, why). Normalising the records is conversations.py's part."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.logs import ClearError

EXAMPLES_PER_REASON = 5
UTF8_BOM = b"\xef\xbb\xbf"
UNDECODABLE_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of invalid UTF-8 bytes


class IngestError(ClearError, ValueError):
    """A whole input cannot be read (not a single bad record)."""


@dataclass
class DropReport:
    """Counts of what was read, kept, changed and dropped, by reason, with a few examples each."""

    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    dropped: Counter = field(default_factory=Counter)
    modified: Counter = field(default_factory=Counter)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    read: int = 0
    kept: int = 0

    def drop(self, reason: str, source: str, index: int, detail: str, offset: int | None = None) -> None:
        self.dropped[reason] += 1
        self._example(reason, source, index, detail, offset)

    def modify(self, what: str, source: str, index: int, detail: str) -> None:
        self.modified[what] += 1
        self._example(what, source, index, detail, None)

    def _example(self, reason: str, source: str, index: int, detail: str, offset: int | None) -> None:
        bucket = self.examples.setdefault(reason, [])
        if len(bucket) < EXAMPLES_PER_REASON:
            example = {"file": source, "record": index, "reason": detail}
            if offset is not None:
                example["byte_offset"] = offset
            bucket.append(example)

    def as_dict(self) -> dict[str, Any]:
        return {
            "records_read": self.read,
            "conversations_kept": self.kept,
            "dropped_total": sum(self.dropped.values()),
            "dropped": dict(sorted(self.dropped.items())),
            "modified": dict(sorted(self.modified.items())),
            "files": self.files,
            "examples": self.examples,
        }

    def summary_lines(self) -> list[str]:
        lines = [f"read {self.read} records, kept {self.kept} conversations, "
                 f"dropped {sum(self.dropped.values())}"]
        lines += [f"  dropped {count:>7} {reason}" for reason, count in sorted(self.dropped.items())]
        lines += [f"  changed {count:>7} {what}" for what, count in sorted(self.modified.items())]
        for name, info in self.files.items():
            if info.get("truncated"):
                lines.append(f"  {name}: truncated at byte {info['truncated_at_byte']} "
                             f"after {info['records']} complete records ({info['truncation_detail']})")
        return lines


@dataclass
class RawRecord:
    source: str
    index: int
    offset: int
    value: Any = None
    error: str | None = None  # set when the record could not be decoded at all
    reason: str = "malformed_json"
    undecodable_bytes: bool = False  # the raw record holds bytes that are not UTF-8 (JSON arrays only)


# ---------------------------------------------------------------- reading raw records

def iter_raw_records(path: Path, report: DropReport) -> Iterator[RawRecord]:
    """Yield records from a JSON array or JSONL file (gzip-compressed when named *.gz), recovering from
    truncation and bad lines."""
    yield from iter_records_in(path, read_input(path), report)


def read_input(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def iter_records_in(path: Path, data: bytes, report: DropReport) -> Iterator[RawRecord]:
    """The records of `data`, the content of input `path` (or a part of it: see `split_records`)."""
    bom = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    if bom:  # editors on Windows write one; JSON forbids it, so it is dropped (and noted) rather than fatal
        data = data[bom:]
        report.modify("utf8_bom_stripped", str(path), 0, "the file starts with a UTF-8 byte order mark")
    head = data.lstrip()[:1]
    if head == b"[":
        yield from _iter_json_array(path, data, report, bom)
    elif head == b"{":
        yield from _iter_jsonl(path, data, report, bom)
    elif not head:
        raise IngestError(f"{path}: file is empty")
    else:
        raise IngestError(f"{path}: neither a JSON array nor JSON lines (starts with {head!r})")


def _iter_jsonl(path: Path, data: bytes, report: DropReport, offset: int = 0) -> Iterator[RawRecord]:
    info = report.files.setdefault(str(path), {"format": "jsonl", "records": 0, "truncated": False})
    if offset:
        info["utf8_bom_stripped"] = True
    index = 0
    lines = data.split(b"\n")
    for line_number, line in enumerate(lines, start=1):
        start = offset
        offset += len(line) + 1
        if not line.strip():
            continue
        record = RawRecord(str(path), index, start)
        index += 1
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            record.error, record.reason = f"line {line_number}: not valid UTF-8 ({exc.reason})", "invalid_utf8"
            yield record
            continue
        try:
            record.value = json.loads(text)
            info["records"] += 1
        except json.JSONDecodeError as exc:
            is_last = line_number >= len(lines) - 1 and not data.endswith(b"\n")
            record.error = f"line {line_number}: {exc.msg} at column {exc.colno}"
            if is_last:
                info.update(truncated=True, truncated_at_byte=start, truncation_detail=record.error)
                record.reason = "truncated_record"
        yield record


def _iter_json_array(path: Path, data: bytes, report: DropReport, bom: int = 0) -> Iterator[RawRecord]:
    info = report.files.setdefault(str(path), {"format": "json-array", "records": 0, "truncated": False})
    if bom:
        info["utf8_bom_stripped"] = True
    # surrogateescape keeps undecodable bytes visible per record instead of failing the whole file.
    text = data.decode("utf-8", errors="surrogateescape")
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    record_prefix = _record_prefix(text, position)
    offsets = _ByteOffsets(text, bom)
    index = 0
    while True:
        position = _skip_whitespace(text, position)
        if position >= len(text):
            info.update(truncated=True, truncated_at_byte=offsets.at(position),
                        truncation_detail="file ends before the closing ']'")
            return
        if text[position] == "]":
            return
        if text[position] == "," and index > 0:
            position = _skip_whitespace(text, position + 1)
        record = RawRecord(str(path), index, offsets.at(position))
        index += 1
        try:
            start = position
            record.value, position = decoder.raw_decode(text, position)
            record.undecodable_bytes = UNDECODABLE_BYTE.search(text, start, position) is not None
            info["records"] += 1
            yield record
            continue
        except json.JSONDecodeError as exc:
            record.error = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
        resume = text.find(record_prefix, position + 1) if record_prefix else -1
        if resume < 0:
            info.update(truncated=True, truncated_at_byte=record.offset, truncation_detail=record.error)
            record.reason = "truncated_record"
            yield record
            return
        yield record
        position = resume + 1  # just after the ',' that precedes the next record


class _ByteOffsets:
    """Character position -> byte offset for increasing positions, in linear total time."""

    def __init__(self, text: str, first_byte: int = 0):
        self.text, self.char, self.byte = text, 0, first_byte

    def at(self, position: int) -> int:
        self.byte += len(self.text[self.char:position].encode("utf-8", errors="surrogateescape"))
        self.char = position
        return self.byte


class RecordSlices:
    """The records of an input as byte ranges, found without parsing them: the lines of JSON lines, or the
    elements of a pretty-printed JSON array (split where the array's record separator stands: a newline cannot
    stand inside a JSON string, so the separator never stands inside a record). `slices[i]` is record i on its
    own, which `iter_records_in` reads back (an array element comes wrapped in brackets)."""

    def __init__(self, data: bytes, spans: list[tuple[int, int]], array: bool):
        self.data, self.spans, self.array = data, spans, array

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, index: int) -> bytes:
        start, end = self.spans[index]
        return b"[" + self.data[start:end] + b"]" if self.array else self.data[start:end]

    @classmethod
    def of(cls, data: bytes) -> RecordSlices | None:
        """None for a one-line JSON array: its separators cannot be told from text without parsing."""
        data = data[len(UTF8_BOM):] if data.startswith(UTF8_BOM) else data
        head = data.lstrip()[:1]
        if head != b"[":
            lines = re.finditer(rb"[^\n]*[^\s][^\n]*", data) if head == b"{" else ()
            return cls(data, [m.span() for m in lines], array=False)
        start = data.index(b"[") + 1
        prefix = _record_prefix(data[start:start + 4096].decode("utf-8", errors="surrogateescape"), 0)
        if prefix is None:
            return None
        separator = prefix[:-1].encode()  # the separator ends with the next record's "{"
        starts = [start] + [m.start() + len(separator) for m in re.finditer(re.escape(prefix.encode()), data)]
        end = len(data.rstrip())
        end -= data[end - 1:end] == b"]"  # a truncated file has no closing bracket
        ends = [s - len(separator) for s in starts[1:]] + [end]
        return cls(data, list(zip(starts, ends, strict=True)), array=True)


def _record_prefix(text: str, position: int) -> str | None:
    """The text that separates records in a pretty-printed array (',\\n  {'), used to resynchronise."""
    start = _skip_whitespace(text, position)
    indent = text[position:start]
    return ("," + indent + "{") if "\n" in indent else None


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position
