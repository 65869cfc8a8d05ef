"""The draft vocabulary: `vocab/draft_vocab.safetensors`.

Tensors:
    d2t          int64 [K]  target_id = i + d2t[i] for draft id i (SGLang/vLLM convention)
    t2d          bool  [V]  True exactly for target ids in the draft vocab
    token_counts int64 [V]  frequency of each target id over loss-masked (assistant) tokens
Metadata (strings): draft_vocab_size, vocab_size, coverage (share of counted tokens inside the vocab).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file  # numpy, not torch: the vocab job need not import torch

TENSORS = ("d2t", "t2d", "token_counts")


class InvalidDraftVocab(ValueError):
    pass


@dataclass
class DraftVocab:
    draft_ids: np.ndarray  # int64 [K], ascending target ids
    counts: np.ndarray  # int64 [V]

    @property
    def d2t(self) -> np.ndarray:
        return self.draft_ids - np.arange(len(self.draft_ids), dtype=np.int64)

    @property
    def t2d(self) -> np.ndarray:
        mask = np.zeros(len(self.counts), dtype=bool)
        mask[self.draft_ids] = True
        return mask

    @property
    def coverage(self) -> float:
        total = self.counts.sum()
        return float(self.counts[self.draft_ids].sum() / total) if total else 0.0


def write(path: Path, vocab: DraftVocab) -> None:
    tensors = {
        "d2t": vocab.d2t,
        "t2d": vocab.t2d,
        "token_counts": vocab.counts,
    }
    metadata = {"draft_vocab_size": str(len(vocab.draft_ids)), "vocab_size": str(len(vocab.counts)),
                "coverage": f"{vocab.coverage:.6f}"}
    save_file(tensors, str(path), metadata=metadata)


def identity(path: Path) -> str:
    """A hash of the file's tensors: what the vocab is. Not the file's bytes: safetensors writes the metadata
    keys in a different order each time, so a rerun of the vocab rule would look like a new vocab."""
    tensors = load_file(str(path))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + str(tuple(tensors[name].shape)).encode() + tensors[name].tobytes())
    return digest.hexdigest()


def read(path: Path) -> DraftVocab:
    tensors = load_file(str(path))
    d2t = tensors["d2t"]
    draft_ids = d2t + np.arange(len(d2t), dtype=np.int64)
    return DraftVocab(draft_ids, tensors["token_counts"])


def validate(path: Path) -> DraftVocab:
    """Raise InvalidDraftVocab naming the file and reason unless it holds a consistent draft vocab."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise InvalidDraftVocab(f"{path}: not a readable safetensors file ({exc})") from None
    missing = [name for name in TENSORS if name not in tensors]
    if missing:
        raise InvalidDraftVocab(f"{path}: tensors {missing} missing")
    vocab = read(path)
    ids = vocab.draft_ids
    if len(ids) == 0 or np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= len(vocab.counts):
        raise InvalidDraftVocab(f"{path}: d2t does not map to ascending target ids below {len(vocab.counts)}")
    if not np.array_equal(tensors["t2d"], vocab.t2d):
        raise InvalidDraftVocab(f"{path}: t2d disagrees with d2t")
    return vocab
