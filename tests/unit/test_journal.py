"""The append-only JSONL journals that regeneration and evaluation resume from."""

from __future__ import annotations

from eagle3_pipeline.formats import journal


def test_appended_records_read_back_with_the_bytes_they_take(tmp_path):
    path = tmp_path / "j.jsonl"
    with open(path, "a", encoding="utf-8") as handle:
        journal.append(handle, [{"fingerprint": "abc"}])
        journal.append(handle, ({"index": i, "text": "héllo"} for i in range(3)))
    values, intact = journal.read_intact(path)
    assert values == [{"fingerprint": "abc"}] + [{"index": i, "text": "héllo"} for i in range(3)]
    assert intact == path.stat().st_size  # bytes, not characters (the é is two)


def test_reading_stops_at_a_torn_or_unterminated_line(tmp_path):
    path = tmp_path / "j.jsonl"
    whole = b'{"a": 1}\n{"b": 2}\n'
    cut_short = whole + b'{"c": 3\n{"d": 4}\n'  # nothing after a torn line counts
    unterminated = whole + b'{"c": 3}'  # an append would join the next record onto it
    for data in (cut_short, unterminated):
        path.write_bytes(data)
        assert journal.read_intact(path) == ([{"a": 1}, {"b": 2}], len(whole))
    path.write_bytes(b"")
    assert journal.read_intact(path) == ([], 0)
