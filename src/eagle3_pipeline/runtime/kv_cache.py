"""KV-cache arithmetic shared by the target and drafter runtimes: static cache sizes, forgetting rows of a
transformers cache in every 5.x version (static layers keep their length in a tensor, which CUDA graphs read), and
the tensors a recorded step moves rows of and rewinds."""

from __future__ import annotations

from typing import Any

import torch

# slots: chat prompts with 128 new tokens fit one size (each size compiles every width again, ~20 s each)
SMALLEST_CACHE = 512


def static_size(rows: int, smallest: int = SMALLEST_CACHE) -> int:
    """A static cache's slots for `rows` rows: the next power of two, at least `smallest`."""
    return max(smallest, 1 << (rows - 1).bit_length())


def has_sliding_layers(model: torch.nn.Module) -> bool:
    """Whether transformers' StaticCache would give this model sliding-window layers (they roll their buffer,
    so rows pushed out by rejected drafts or padding are lost)."""
    from transformers import StaticCache

    probe = StaticCache(config=model.config, max_cache_len=8)
    return any(getattr(layer, "is_sliding", False) for layer in getattr(probe, "layers", []))


def rewind(cache: Any, rows: int) -> None:
    """Every layer of `cache` back to `rows` rows (after a step that failed part-way, some layers may have
    advanced and others not)."""
    for layer in cache.layers:
        if (extra := int(layer.get_seq_length()) - rows) > 0:
            drop_rows(layer, extra)


def remove_last_rows(cache: Any, count: int) -> None:
    """Forget the last `count` rows of a KV cache (the next update overwrites them). Static layers keep their
    lengths in tensors: one multi-tensor kernel rewinds them all, where a crop per
    layer launches a kernel per layer (30 for SmolLM2) after every verify step, while the GPU waits for them."""
    layers = getattr(cache, "layers", [])
    if layers and all(is_static_layer(layer) for layer in layers):
        torch._foreach_sub_(length_tensors(cache), count)
        return
    if all(hasattr(layer, "crop") for layer in layers):
        cache.crop(-count)
        return
    for layer in cache.layers:
        drop_rows(layer, count)


def is_static_layer(layer: Any) -> bool:
    """A full-attention static layer: its length is the tensor `cumulative_length` (transformers 5.17 and 5.2x)."""
    from transformers.cache_utils import StaticLayer

    return (type(layer) is StaticLayer and bool(getattr(layer, "is_initialized", False))
            and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor))


def drop_rows(layer: Any, count: int) -> None:
    """Forget a cache layer's last `count` rows. A negative argument to `crop` means "remove this many" in every
    transformers version; static layers learnt `crop` only in 5.2x (5.17, on the H200s, raises AttributeError),
    but all keep their length in the tensor `cumulative_length`, which an in-place subtraction rewinds without
    moving the address CUDA graphs captured."""
    if hasattr(layer, "crop"):
        layer.crop(-count)
    else:
        layer.cumulative_length.sub_(count)


def length_tensors(cache: Any) -> list[torch.Tensor]:
    """What a recorded step rewinds: every static layer's length."""
    return [layer.cumulative_length for layer in cache.layers]


def row_tensors(cache: Any) -> list[torch.Tensor]:
    """What a recorded step moves rows of, each [.., .., slots, head_dim] (rows on dim 2): every layer's keys and
    values."""
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]
