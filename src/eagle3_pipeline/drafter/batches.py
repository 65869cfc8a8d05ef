"""Length-grouped batches: the training schedule over hidden-state stores, and the greedy packer it shares
with extraction (stages/extract.plan_batches)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from eagle3_pipeline.formats import hidden_store

GROUP_BATCHES = 64  # length-sorting window of the batch schedule, in batches


class PackingSettings(Protocol):
    """What the schedule reads from the training settings (train.TrainSettings has these fields)."""
    batch_tokens: int
    max_seq_len: int
    pad_multiple: int  # batch widths are rounded up to this (few shapes: compiled kernels and masks are reused)
    seed: int
    epochs: int


def pack_greedy(widths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Consecutive runs of indices into `widths`: a batch closes when one more row would make its padded size
    (rows x widest row) exceed the budget. A row wider than the budget gets a batch of its own."""
    batches: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for index, width in enumerate(widths):
        if current and (len(current) + 1) * max(widest, width) > token_budget:
            batches.append(current)
            current, widest = [], 0
        current.append(index)
        widest = max(widest, width)
    return batches + ([current] if current else [])


def padded_width(length: int, multiple: int) -> int:
    return -(-int(length) // multiple) * multiple


def epoch_batches(lengths: list[np.ndarray], settings: PackingSettings, epoch: int,
                  window: int | None = None) -> list[list[tuple[int, int]]]:
    """One epoch's batches of (store, sequence) items, a pure function of (seed, epoch[, window]): shuffle, then
    sort by length inside windows of about GROUP_BATCHES batches before packing, then shuffle the batches. Batches
    hold sequences of similar length (little padding) while every epoch still mixes the whole data set (or, with
    a disk budget, the whole window of shards)."""
    items = [(s, j) for s, store_lengths in enumerate(lengths) for j in range(len(store_lengths))]
    widths = [padded_width(lengths[s][j], settings.pad_multiple) for s, j in items]
    rng = np.random.default_rng([settings.seed, epoch] + ([] if window is None else [window]))
    order = rng.permutation(len(items))
    mean_width = max(1.0, float(np.mean(widths))) if items else 1.0
    group_size = max(1, int(GROUP_BATCHES * settings.batch_tokens / mean_width))
    batches: list[list[tuple[int, int]]] = []
    for start in range(0, len(order), group_size):
        group = sorted(order[start:start + group_size], key=lambda i: -widths[i])  # stable: ties keep shuffled order
        batches += [[items[group[m]] for m in members]
                    for members in pack_greedy([widths[i] for i in group], settings.batch_tokens)]
    return [batches[i] for i in rng.permutation(len(batches))]


@dataclass(frozen=True)
class Segment:
    """A stretch of the schedule: one epoch over some stores (all of them; with a disk budget, one window's).
    `lengths` are the stores' sequence lengths in store order, known without opening a store."""
    epoch: int
    window: int | None  # None: the whole data set (the batches' random key is (seed, epoch))
    paths: tuple[Path, ...]
    lengths: tuple[np.ndarray, ...]


def store_lengths(path: Path, max_seq_len: int) -> np.ndarray:
    """A store's sequence lengths as batches see them; the store was validated by whoever chose it (training
    checks all its stores at once, in parallel)."""
    return np.minimum(hidden_store.HiddenStore(path, validate_store=False).lengths(), max_seq_len)


class BatchSchedule(torch.utils.data.Dataset):
    """Item i is training batch i: a deterministic function of (seed, epoch), so a resumed run sees the
    same batches, and DataLoader workers read the zarr stores in parallel. Built from stores (every epoch over
    all of them) or from segments (a disk budget's passes); a store is opened only when a batch reads it."""

    def __init__(self, store_paths: list[Path], settings: PackingSettings, segments: list[Segment] | None = None):
        if segments is None:
            paths = tuple(Path(p) for p in store_paths)
            lengths = tuple(store_lengths(p, settings.max_seq_len) for p in paths)
            segments = [Segment(epoch, None, paths, lengths) for epoch in range(settings.epochs)]
        self.settings = settings
        self.paths = list(dict.fromkeys(p for segment in segments for p in segment.paths))
        self.sequences_per_epoch = sum(len(x) for segment in segments if segment.epoch == 0 for x in segment.lengths)
        self.stores: dict[int, hidden_store.HiddenStore] = {}  # opened lazily, once per worker
        self.batches: list[list[tuple[int, int]]] = []
        self.segment_ends: list[int] = []  # batch count at the end of each segment
        self.epoch_ends: list[int] = []  # batch count at the end of each epoch
        for index, segment in enumerate(segments):
            where = [self.paths.index(p) for p in segment.paths]
            self.batches += [[(where[s], j) for s, j in batch] for batch in
                             epoch_batches(list(segment.lengths), settings, segment.epoch, segment.window)]
            self.segment_ends.append(len(self.batches))
            if index + 1 == len(segments) or segments[index + 1].epoch != segment.epoch:
                self.epoch_ends.append(len(self.batches))

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sequences = [self.store(s).sequence(j) for s, j in self.batches[index]]
        return collate(sequences, self.settings.max_seq_len, self.settings.pad_multiple)

    def store(self, index: int) -> hidden_store.HiddenStore:
        if index not in self.stores:
            self.stores[index] = hidden_store.HiddenStore(self.paths[index], validate_store=False)
        return self.stores[index]


# a sequence's arrays (formats/hidden_store) -> the batch's keys; the scales come with fp8 stores only
BATCH_KEYS = {"aux_hidden_states": "aux", "last_hidden_states": "last",
              "aux_scales": "aux_scales", "last_scales": "last_scales"}


def collate(sequences: list[dict[str, torch.Tensor]], max_seq_len: int, pad_multiple: int = 1
            ) -> dict[str, torch.Tensor]:
    """Right-padded rows, the width rounded up to `pad_multiple`: few distinct shapes, so compiled kernels and
    cached attention masks are reused across batches. aux is [B, W, 3H] (the layers in order, as SGLang
    concatenates them). `predicted` [2, N] lists the (row, position) of every token the loss counts, found here on
    the host: on the device, finding them would stop the host until the GPU had caught up, every step. The states
    stay as the store keeps them (fp8 bits and their scales cross to the device at half the bytes): `to_device`
    decodes them there."""
    lengths = [min(len(s["input_ids"]), max_seq_len) for s in sequences]
    width, batch = padded_width(max(lengths), pad_multiple), len(sequences)
    out = {"input_ids": torch.zeros(batch, width, dtype=torch.long),
           "loss_mask": torch.zeros(batch, width, dtype=torch.bool),
           "valid": torch.zeros(batch, width, dtype=torch.bool)}
    arrays = {name: key for name, key in BATCH_KEYS.items() if name in sequences[0]}
    for name, key in arrays.items():
        first = sequences[0][name]
        row_shape = (first[0].numel(),) if key == "aux" else first.shape[1:]  # aux: [3, H] -> [3H]
        out[key] = torch.zeros(batch, width, *row_shape, dtype=first.dtype)
    for row, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
        out["input_ids"][row, :n] = seq["input_ids"][:n]
        out["loss_mask"][row, :n] = seq["loss_mask"][:n].bool()
        out["valid"][row, :n] = True
        for name, key in arrays.items():
            out[key][row, :n] = seq[name][:n].reshape(n, *out[key].shape[2:])
    out["predicted"] = counted_positions(out["loss_mask"], out["valid"])
    return out


def counted_positions(loss_mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[2, N]: the (row, position) of every token the loss counts, row-major."""
    return torch.stack((loss_mask & valid).nonzero(as_tuple=True))


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """A collated batch on the device, its states decoded there to bf16 (fp8 stores) or left as they are."""
    moved = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
    for key in ("aux", "last"):
        scales = moved.pop(f"{key}_scales", None)
        if scales is not None:  # aux's 3H values per token carry one scale per layer
            if key == "aux":
                moved[key] = hidden_store.decode(moved[key].unflatten(-1, (scales.shape[-1], -1)), scales).flatten(-2)
            else:
                moved[key] = hidden_store.decode(moved[key], scales)
    return moved
