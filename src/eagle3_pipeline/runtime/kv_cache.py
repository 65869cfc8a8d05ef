"""KV-cache arithmetic shared by the target and drafter runtimes: static cache sizes, forgetting rows of a
transformers cache in every 5.x version (static layers keep their length in a tensor, which CUDA graphs read), and
a static cache's layers stacked into one buffer (`stack_layers`), so that a recorded step moves and forgets rows of
every layer in one kernel instead of one per layer."""

from __future__ import annotations

from dataclasses import dataclass
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
    lengths in tensors: one multi-tensor kernel rewinds them all (one subtraction when stacked), where a crop per
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


@dataclass(frozen=True)
class StackedLayers:
    """A static cache's layers as views of two tensors: `rows` [2 x layers, batch, kv_heads, slots, head_dim]
    (layer i's keys at 2i, its values at 2i + 1) and `lengths` [layers] (each layer's `cumulative_length`)."""
    rows: torch.Tensor
    lengths: torch.Tensor


STACKED = "_eagle3_stacked_layers"  # where a stacked cache keeps its StackedLayers


def stack_layers(cache: Any) -> bool:
    """Point an initialised static cache's layers at views of one buffer (`StackedLayers`), their rows and lengths
    copied in; transformers keeps updating each layer in place through its views. Returns whether the cache is
    stacked (layers of different shapes, or not all static and initialised, stay as they are). Stack before any
    CUDA graph records the cache: a graph keeps the addresses it saw."""
    if stacked(cache) is not None:
        return True
    layers = getattr(cache, "layers", [])
    if not layers or not all(is_static_layer(layer) for layer in layers):
        return False
    if len({(layer.keys.shape, layer.values.shape, layer.keys.dtype) for layer in layers}) != 1 \
            or layers[0].keys.shape != layers[0].values.shape:
        return False
    stack = StackedLayers(torch.stack([tensor for layer in layers for tensor in (layer.keys, layer.values)]),
                          torch.stack([layer.cumulative_length for layer in layers]))
    for index, layer in enumerate(layers):
        layer.keys, layer.values = stack.rows[2 * index], stack.rows[2 * index + 1]
        layer.cumulative_length = stack.lengths[index]
        for tensor in (layer.keys, layer.values, layer.cumulative_length):
            torch._dynamo.mark_static_address(tensor)
    setattr(cache, STACKED, stack)
    return True


def stacked(cache: Any) -> StackedLayers | None:
    return getattr(cache, STACKED, None)


def length_tensors(cache: Any) -> list[torch.Tensor]:
    """What a recorded step rewinds: a stacked cache's one lengths vector, else every static layer's length."""
    if (stack := stacked(cache)) is not None:
        return [stack.lengths]
    return [layer.cumulative_length for layer in cache.layers]


def row_tensors(cache: Any) -> list[torch.Tensor]:
    """What a recorded step moves rows of, each [.., .., slots, head_dim] (rows on dim 2): a stacked cache's one
    buffer, else every layer's keys and values."""
    if (stack := stacked(cache)) is not None:
        return [stack.rows.flatten(0, 1)]
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]
