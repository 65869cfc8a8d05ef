"""What the disk plan samples before the token shards exist: conversations of the conversation shards, or records of
the raw inputs read and normalised by ingest's own code, and how many training conversations ingest's split makes
of the records it keeps. The split holds out whole groups (a conversation's parts), so the records it takes out of
training are estimated from the parts seen in the sample; repeated ids, which ingest drops, and copies of held-out
conversations, which the split leaves out too, are not seen in a sample (the plan is that much high)."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.conversation_groups import limit, part_of


def sample_from_shards(paths: list[Path], count: int, seed: int) -> tuple[list[int], list[dict[str, Any]]]:
    """(conversations per shard, a seeded sample of them) from conversation shards (formats/conversation_shards)."""
    lines = [[line for line in p.read_bytes().split(b"\n") if line.strip()] for p in paths]
    pooled = [line for shard in lines for line in shard]  # shards are dealt round-robin: one population
    chosen = sorted(random.Random(seed).sample(range(len(pooled)), min(count, len(pooled))))
    return list(map(len, lines)), [json.loads(pooled[i]) for i in chosen]


def record_reader(path: Path) -> tuple[int, Callable[[int], list[Any]]]:
    """(records in the input, record index -> its RawRecord) with ingest's reader; only sampled records are
    parsed, except in a one-line JSON array, which is parsed whole."""
    from eagle3_pipeline.raw_records import DropReport, RecordSlices, iter_records_in, read_input

    data = read_input(path)
    slices = RecordSlices.of(data)
    if slices is None:
        records = list(iter_records_in(path, data, DropReport()))
        return len(records), lambda index: [records[index]]
    return len(slices), lambda index: list(iter_records_in(path, slices[index], DropReport()))


@dataclass
class InputSample:
    name: str  # the input's file name: what data.weights are matched by
    records: int
    sampled: int
    kept: list[dict[str, Any]]  # the sampled records ingest keeps, normalised

    @property
    def group_starts(self) -> int:
        """Kept records that start a group of the split (conversation_groups): every record but the later parts
        `<stem>_<n>`, n > 0, of a conversation; a stem held by more than a share of the sample is the input's
        numbering, not parts. Copies, which group too, are not seen in a sample."""
        parts = [part_of(conversation["id"]) for conversation in self.kept]
        stems = Counter(part[0] for part in parts if part)
        numbering = {stem for stem, count in stems.items() if count > limit(len(self.kept))}
        return sum(1 for part in parts if part is None or part[1] == 0 or part[0] in numbering)


def sample_from_raw(inputs: list[Path], count: int, seed: int) -> list[InputSample]:
    """A seeded sample of each input's records, `count` in all, each input's share its share of the records
    (an input's records are counted exactly, so only its keep rate and its tokens are sampled)."""
    from eagle3_pipeline.conversations import normalize_record
    from eagle3_pipeline.raw_records import DropReport

    readers = [record_reader(path) for path in inputs]
    total, rng, samples = sum(size for size, _ in readers), random.Random(seed), []
    for path, (size, read) in zip(inputs, readers, strict=True):
        share = min(size, max(1, round(count * size / total))) if size else 0
        kept, report = [], DropReport()
        for index in sorted(rng.sample(range(size), share)):
            kept += [c for c in (normalize_record(r, report) for r in read(index)) if c is not None]
        samples.append(InputSample(path.name, size, share, kept))
    return samples


def split_counts(total: int, num_shards: int) -> list[int]:
    """Conversations per shard when ingest deals `total` round-robin (conversations.split)."""
    return [total // num_shards + (shard < total % num_shards) for shard in range(num_shards)]


def training_conversations(kept: float, weight_mean: float, data: dict[str, Any], group_size: float) -> int:
    """How many training conversations ingest writes out of `kept` ones: the two held-out sets first (each held-out
    conversation takes its group, `group_size` records on average, out of training), then data.train_conversations,
    then each repeated by its source's weight (on average `weight_mean`)."""
    held_out = data["eval_conversations"] + data["selection_conversations"]
    available = max(kept - held_out * group_size, 0)
    train = min(data["train_conversations"], available) if data["train_conversations"] is not None else available
    return round(train * weight_mean)
