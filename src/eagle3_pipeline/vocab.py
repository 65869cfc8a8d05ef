"""The draft vocabulary: `vocab/draft_vocab.safetensors`.

Tensors:
    d2t          int64 [K]  target_id = i + d2t[i] for draft id i (SGLang/vLLM convention)
    t2d          bool  [V]  True exactly for target ids in the draft vocab
    token_counts int64 [V]  frequency of each target id over loss-masked (assistant) tokens
Metadata (strings): draft_vocab_size, vocab_size, coverage (share of counted tokens inside the vocab).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


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


def count_tokens(input_ids: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.bincount(input_ids[loss_mask.astype(bool)], minlength=vocab_size).astype(np.int64)


def select(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """Top-K ids by frequency (ties broken by lower id, so the choice is deterministic), sorted ascending."""
    if not 0 < draft_vocab_size <= len(counts):
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{len(counts)}")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    draft_ids = np.sort(order[:draft_vocab_size]).astype(np.int64)
    return DraftVocab(draft_ids, counts.astype(np.int64))


def save(vocab: DraftVocab, path: Path) -> None:
    tensors = {
        "d2t": torch.from_numpy(vocab.d2t),
        "t2d": torch.from_numpy(vocab.t2d),
        "token_counts": torch.from_numpy(vocab.counts),
    }
    metadata = {"draft_vocab_size": str(len(vocab.draft_ids)), "vocab_size": str(len(vocab.counts)),
                "coverage": f"{vocab.coverage:.6f}"}
    save_file(tensors, str(path), metadata=metadata)


def load(path: Path) -> DraftVocab:
    tensors = load_file(str(path))
    d2t = tensors["d2t"].numpy()
    draft_ids = d2t + np.arange(len(d2t), dtype=np.int64)
    return DraftVocab(draft_ids, tensors["token_counts"].numpy())
