"""What the drafter's queries attend to: the attention kernels, and the KV caches that pick among them.

The layer projects q/k/v and hands them to its cache, or without one to plain causal attention. Each kind of
cache is one way of running the drafter, fixed when the cache is made (nothing is switched later):

- `TTTKV`, training-time test: step k's queries attend to step 0's keys causally and to their own position's
  keys at steps 1..k. Its kernel is `explicit_ttt_attention` (explicit scores: CPU, and the reference) or
  `flex_ttt_attention` (one fused flex_attention kernel: GPU); `choose_ttt_attention` picks one.
- `DecodeKV`, what a server runs: new rows attend to every cached row and causally to each other. Attending
  returns a new cache and leaves the old one valid, so speculative chain rows are dropped by keeping it.
- `StaticKV`: the same in a fixed-capacity cache updated in place (compiled CUDA-graph decoding), attended by
  `grouped_attention` (matmuls over the un-repeated cache, no SDPA kernel choice).

Keys and values are kept un-repeated, [B, kv_heads, T, d]; grouped-query heads are repeated where attending
(`grouped_attention`, the static caches' kernel, stacks each key/value head's query heads instead).
Right-padded rows need no padding mask anywhere: a real query only sees earlier positions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from eagle3_pipeline.drafter.config import DrafterConfig

KVPair = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, kv_heads, T, head_dim]
TTTKernel = Callable[[torch.Tensor, Sequence[KVPair]], torch.Tensor]  # (queries, every step's keys/values) -> out


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, kv_heads, T, d] -> [B, heads, T, d]: each key/value head serves heads / kv_heads query heads."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None = None) -> torch.Tensor:
    """q [B, heads, T, d] against un-repeated k/v [B, kv_heads, S, d]; `mask` broadcastable to [B, 1, T, S], bool
    (True: visible) or additive float -> [B, heads, T, d]. Two matmuls and one softmax, the query heads of each
    key/value head stacked as rows, for decoding over a static cache: SDPA repeats every key and value head over
    the whole cache first, and on an H200 sends a few-query verify to cuDNN's prefill kernel (a memset, ~5 us of
    launch gap and 10 us per call; benchmarks/profile_loops.py). Scores and softmax in float32 at least."""
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    rows = q.reshape(batch, kv_heads, groups * length, dim)  # query head h = kv head h // groups, as repeat_kv
    scores = rows @ k.transpose(-1, -2)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul(scale)
    scores = scores.view(batch, kv_heads, groups, length, -1)
    if mask is not None:
        mask = mask[:, :, None] if mask.dim() == 4 else mask  # [B, 1, 1, T, S] against [B, kv, groups, T, S]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask.to(scores.dtype)
    weights = scores.softmax(-1).to(v.dtype).view(batch, kv_heads, groups * length, -1)
    return (weights @ v).view(batch, heads, length, dim)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over one set of rows: no cache, or the first training-time-test step."""
    heads = q.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, heads), repeat_kv(v, heads), is_causal=True)


# ---------------------------------------------------------------- training-time test kernels

def explicit_ttt_attention(q: torch.Tensor, steps: Sequence[KVPair]) -> torch.Tensor:
    """Training-time test attention with explicit scores (CPU, and the reference for the fused kernel).
    With step 0 alone it is plain causal attention."""
    if len(steps) == 1:
        return causal_attention(q, *steps[0])
    heads, length = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = repeat_kv(steps[0][0], heads), repeat_kv(steps[0][1], heads)
    prefix = (q @ k0.transpose(-1, -2)) * scale  # [B,h,T,T] against the real-feature step
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    prefix = prefix.masked_fill(~causal, float("-inf"))
    later_k = torch.stack([repeat_kv(k, heads) for k, _ in steps[1:]], dim=-2)  # [B,h,T,S,d], one key per step
    later_v = torch.stack([repeat_kv(v, heads) for _, v in steps[1:]], dim=-2)
    diagonal = (q.unsqueeze(-2) * later_k).sum(-1) * scale  # [B,h,T,S]
    weights = torch.softmax(torch.cat([prefix, diagonal], dim=-1).float(), dim=-1).to(q.dtype)
    return weights[..., :length] @ v0 + (weights[..., length:].unsqueeze(-1) * later_v).sum(-2)


@lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@lru_cache(maxsize=256)
def ttt_block_mask(length: int, steps: int, device: torch.device):
    """Keys of every step side by side, [step 0 | step 1 | ... | step k], each `length` long: step 0 causal,
    steps >= 1 only the query's own position. It depends on (length, steps) alone (right padding needs no mask),
    so it is built once per padded batch width and reused by every batch of that width."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_index, kv_index):
        position = kv_index % length
        return torch.where(kv_index < length, position <= q_index, position == q_index)

    return create_block_mask(visible, None, None, length, steps * length, device=device)


def flex_ttt_attention(q: torch.Tensor, steps: Sequence[KVPair], compiled: bool = True) -> torch.Tensor:
    """The same attention as `explicit_ttt_attention` as one fused kernel (GPU): the extra steps cost a few
    diagonal tiles instead of a materialised [T, T] score matrix. `compiled=False`: flex's eager reference
    implementation of the same mask (tests on a CPU, where inductor's flex kernel is not used for training)."""
    from torch.nn.attention.flex_attention import flex_attention

    keys = torch.cat([k for k, _ in steps], dim=2)
    values = torch.cat([v for _, v in steps], dim=2)
    mask = ttt_block_mask(q.shape[2], len(steps), q.device)
    attend = _compiled_flex_attention() if compiled else flex_attention
    return attend(q, keys, values, block_mask=mask, enable_gqa=keys.shape[1] != q.shape[1])


def flex_attention_problem(device: torch.device) -> str | None:
    """None when the fused kernel compiles and runs forward and backward here, else why not (once per process)."""
    try:
        q = torch.randn(1, 2, 128, 16, device=device, requires_grad=True)
        steps = [(torch.randn(1, 1, 128, 16, device=device), torch.randn(1, 1, 128, 16, device=device))
                 for _ in range(2)]
        flex_ttt_attention(q, steps).sum().backward()
        return None
    except Exception as exc:  # missing Triton, unsupported device, compiler errors: all mean "use eager"
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def choose_ttt_attention(requested: str, device: torch.device, log: logging.Logger) -> TTTKernel:
    """The kernel for `train.attention`: "flex", "eager", or "auto" (flex on GPU). Flex only where its probe
    passes; otherwise the explicit one, with the reason logged."""
    use_flex = requested == "flex" or (requested == "auto" and device.type == "cuda")
    problem = flex_attention_problem(device) if use_flex else None
    if problem:
        log.warning("flex attention unavailable on %s (%s); using the explicit TTT attention", device, problem)
    kernel = flex_ttt_attention if use_flex and problem is None else explicit_ttt_attention
    log.info("TTT attention: %s", "flex (fused kernel)" if kernel is flex_ttt_attention else "eager")
    return kernel


# ---------------------------------------------------------------- caches

@dataclass(frozen=True)
class TTTKV:
    """The keys/values of the training-time-test steps so far; `kernel` is how a step attends to them."""
    kernel: TTTKernel = explicit_ttt_attention
    steps: tuple[KVPair, ...] = ()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, TTTKV]:
        cache = TTTKV(self.kernel, (*self.steps, (k, v)))
        return self.kernel(q, cache.steps), cache


@dataclass(frozen=True)
class DecodeKV:
    """A growing inference cache: every row so far, at rotary positions 0..rows-1 (empty: no rows yet)."""
    keys: torch.Tensor | None = None  # [B, kv_heads, rows, head_dim]
    values: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, DecodeKV]:
        """New rows attend to every cached row and causally to each other; returns the cache with them added."""
        if self.keys is not None and self.values is not None:
            k, v = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        heads, length = q.shape[1], q.shape[2]
        cached = k.shape[2] - length
        mask = torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=cached)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, heads), repeat_kv(v, heads), attn_mask=mask)
        return out, DecodeKV(k, v)


@dataclass
class StaticKV:
    """A fixed-capacity drafter KV cache for compiled (CUDA-graph) decoding: the row at rotary position p lives
    in slot p, so slots beyond a query's position are masked, and stale ones are overwritten when reached."""
    keys: torch.Tensor  # [1, kv_heads, capacity, head_dim]
    values: torch.Tensor

    @classmethod
    def empty(cls, config: DrafterConfig, capacity: int, device: torch.device, dtype: torch.dtype) -> StaticKV:
        shape = (1, config.num_key_value_heads, capacity, config.head_dim)
        cache = cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
        for tensor in (cache.keys, cache.values):  # updated in place: CUDA graphs need fixed addresses
            torch._dynamo.mark_static_address(tensor)
        return cache

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, StaticKV]:
        """Rows written at their positions (batch 1: positions [1, T]); each attends to slots <= its position.
        The cache is updated in place and returned as is."""
        slots = positions[0]
        self.keys.index_copy_(2, slots, k)
        self.values.index_copy_(2, slots, v)
        mask = torch.arange(self.capacity, device=q.device)[None, :] <= slots[:, None]
        return grouped_attention(q, self.keys, self.values, mask), self


KVCache = TTTKV | DecodeKV | StaticKV
