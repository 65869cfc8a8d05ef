"""Choosing the draft vocabulary: count assistant tokens, keep the top K (the file: formats/draft_vocab)."""

from __future__ import annotations

import numpy as np

from eagle3_pipeline.formats.draft_vocab import DraftVocab


def count_tokens(input_ids: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.bincount(input_ids[loss_mask.astype(bool)], minlength=vocab_size).astype(np.int64)


def select(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """Top-K ids by frequency (ties broken by lower id, so the choice is deterministic), sorted ascending."""
    if not 0 < draft_vocab_size <= len(counts):
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{len(counts)}")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    draft_ids = np.sort(order[:draft_vocab_size]).astype(np.int64)
    return DraftVocab(draft_ids, counts.astype(np.int64))
