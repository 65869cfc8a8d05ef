"""The target's attention when it decodes over a static KV cache: `grouped_attention` in place of SDPA.

Profiled on an H200 (`benchmarks/profile_loops.py`): over SmolLM2's 512-slot static cache SDPA sends the
k+1-token verify to cuDNN's prefill kernel - a memset, ~5 us of launch gap and 10 us of kernel per layer, twice the
one-token step's attention - after four copy kernels per layer that repeat every key and value head over the whole
cache. The verify step cost 1.73 ms against 1.54 ms for a one-token step, most of the difference in that kernel.
Two matmuls and one fused softmax read the un-repeated cache whatever the width. Registered with transformers'
attention and mask interfaces under ATTENTION (the float mask of its eager attention); a feature it does not model
(Gemma 2's logit softcap, attention sinks, dropout) goes to transformers' own SDPA attention.

`tree_mask` builds a draft tree's additive mask, for both decoding loops (host: TargetRuntime.forward_tree; device:
device_tree.TreeState).
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_pipeline.drafter.attention import grouped_attention

ATTENTION = "eagle3_grouped"


def static_cache_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, heads, T, d], key/value [B, kv_heads, S, d] ->
    ([B, T, heads, d], no weights)."""
    unsupported = dropout > 0 or any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks"))
    if unsupported:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = grouped_attention(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """ATTENTION in transformers' interfaces (idempotent), for `config._attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, static_cache_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)
    return ATTENTION


def default(model: torch.nn.Module, static: bool) -> str:
    """A runtime's attention: ATTENTION over static caches, else the implementation the model was loaded with."""
    return register() if static else model.config._attn_implementation


def use(model: torch.nn.Module, attention: str) -> None:
    """`attention` for the model's next forward. A runtime sets it before each of its forwards, so that runtimes
    sharing a model (tests; a static runtime beside an eager one) each keep their own."""
    if model.config._attn_implementation != attention:
        model.config._attn_implementation = attention


def tree_mask(n: torch.Tensor, visible: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [1, 1, T, slots] of a tree of T rows verified at cache slots n..n+T-1 (n: [1] or [], on
    the device): every cached row, then the rows `visible` [T, T] gives each (its ancestors and itself)."""
    width = visible.shape[0]
    relative = torch.arange(slots, device=n.device) - n  # a slot's place in the tree, negative: cached
    seen = visible.index_select(1, relative.clamp(0, width - 1))
    allowed = (relative < 0)[None] | ((relative < width)[None] & seen)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=n.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
