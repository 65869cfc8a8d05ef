"""The append-only JSONL journals that regeneration and evaluation resume from."""

from __future__ import annotations

import subprocess
import sys

from eagle3_pipeline.formats import journal
from tests.conftest import REPO


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


def test_a_stamp_read_while_another_process_rewrites_it_is_always_whole(tmp_path):
    # the evaluation's workers read the progress directory's stamp while the job's process may write it; a reader
    # that once saw it empty (written in place) took the directory for another drafter's and deleted it
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys\n"
        "from pathlib import Path\n"
        "from eagle3_pipeline.formats import journal\n"
        "directory = Path(sys.argv[1])\n"
        "journal.write_stamp(directory, 'a' * 24)\n"
        "print('ready', flush=True)\n"
        "for i in range(3000):\n"
        "    journal.write_stamp(directory, 'ab'[i % 2] * 24)\n"), str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO / "src")})
    assert writer.stdout.readline().strip() == "ready"
    seen = set()
    while True:  # until the writer has made its (finite) rewrites, however long that takes here
        seen.add(journal.read_stamp(tmp_path))
        if writer.poll() is not None:
            break
    assert writer.wait() == 0, "the writer failed"
    assert seen <= {"a" * 24, "b" * 24} and seen, f"a reader saw a partial stamp: {seen - {'a' * 24, 'b' * 24}}"
    assert [p.name for p in tmp_path.iterdir()] == [journal.STAMP_FILE]  # no partial file left beside it
