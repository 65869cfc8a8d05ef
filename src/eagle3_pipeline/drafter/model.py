"""The EAGLE-3 drafter (Llama family): its rotary embedding and its one decoder layer (its shape: config.py).

    aux features (3 target layers, 3H) --fc--> h                     token embedding (frozen target copy)
                                               |                               |
                                          hidden_norm                    input_layernorm
                                               \\______ concat (2H) ______/
                                                          |
                               midlayer: self_attn (q/k/v from 2H, o to H) + residual(h)
                                         post_attention_layernorm -> SwiGLU MLP + residual
                                                          |
                                         norm -> lm_head [K, H] over the draft vocab

The midlayer's pre-norm output is the drafter's own "hidden state": training-time test (TTT) feeds it
back as `h` for the next draft position, exactly as SGLang/vLLM do when drafting a chain.
Weight names match what SGLang's and vLLM's `LlamaForCausalLMEagle3` load (see export.py).

Training and decoding run the same layer (`Drafter.step`); only the KV cache passed in differs (attention.py:
the training-time-test steps' keys, a growing decode cache, or a static one). Decoding applies the head to every
row (`forward`), training only to the rows its loss counts; the TTT objective that unrolls it is objective.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_pipeline.drafter.attention import DecodeKV, KVCache, StaticKV, causal_attention
from eagle3_pipeline.drafter.config import DrafterConfig
from eagle3_pipeline.families import UnsupportedTarget


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: DrafterConfig) -> torch.Tensor:
    """The drafter's rotary frequencies: what SGLang's/vLLM's get_rope builds from the exported rope_scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":  # Llama-3.1 long-context scaling
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        smooth = (original / wavelength - low) / (high - low)
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        medium = (wavelength <= original / low) & (wavelength >= original / high)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "linear":  # positions divided by factor
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "dynamic":
        # The engines build dynamic NTK once, statically, for factor x max positions; transformers would
        # recompute it per sequence length. The drafter runs inside the engine, so it follows the engine.
        factor = scaling["factor"]
        base = config.rope_theta * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    elif kind == "yarn":
        inv_freq = _yarn_inverse_frequencies(inv_freq, config.rope_theta, dim, scaling)
    elif scaling:
        raise UnsupportedTarget(f"rope scaling {scaling} is not supported by the drafter")
    return inv_freq.float()


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, theta: float, dim: int,
                              scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, blend linearly between beta_fast/beta_slow."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(scaling.get("beta_fast") or 32), dimension_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(config: DrafterConfig) -> float:
    """YaRN scales cos/sin (hence attention logits) by 0.1 ln(factor) + 1; other variants by 1."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "yarn" or scaling["factor"] <= 1:
        return 1.0
    return 0.1 * math.log(scaling["factor"]) + 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    """Queries/keys/values from the 2H concat, rotary on q and k; the cache, if any, decides what they attend to
    (attention.py); without one the rows attend causally to each other."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache | None]:
        """x [B,T,2H] -> ([B,T,H], the cache with these rows added)."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is None:
            out = causal_attention(q, k, v)
        else:
            out, cache = cache.attend(q, k, v, positions)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), cache


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache | None]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attended, cache = self.self_attn(x, cos, sin, positions, cache)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), cache


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's; never exported
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.rope_attention_factor = rope_attention_factor(config)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[..., None] * self.inv_freq  # [B,T,d/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B,1,T,d]
        scale = self.rope_attention_factor
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor, KVCache | None]:
        """One draft position for every token: (draft-vocab logits [B,T,K], pre-norm hidden [B,T,H], the cache
        with these rows added). Training-time test passes a TTTKV, decoding a DecodeKV or StaticKV.

        `hidden` is either the target's aux features (width 3H, projected by fc) or a previous step's output.
        """
        hidden, cache = self.step(input_ids, hidden, positions, cache)
        return self.head(hidden), hidden, cache

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache | None]:
        """`forward` without the head: the pre-norm hidden [B,T,H] and the cache. Training applies `head` only to
        the rows its loss counts."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(positions, hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, positions, cache)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of pre-norm hidden states ([..., H] -> [..., K])."""
        return self.lm_head(self.norm(hidden))

    def decode(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               past: DecodeKV | StaticKV | None = None) -> tuple[torch.Tensor, torch.Tensor, KVCache | None]:
        """What a server runs: `forward` with a KV cache, a new DecodeKV when `past` is None. A StaticKV is
        updated in place (batch 1) and returned as is; a DecodeKV is returned extended, `past` left as it was."""
        return self(input_ids, hidden, positions, DecodeKV() if past is None else past)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that is exported: all weights but the embedding, plus d2t/t2d."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


def count_flops_per_token(config: DrafterConfig, length: int) -> float:
    """Forward FLOPs per token of one drafter step (matmuls only; attention over `length` keys)."""
    h, d = config.hidden_size, config.head_dim
    linear = (3 * config.target_hidden_size * h  # fc
              + 2 * h * (config.num_attention_heads + 2 * config.num_key_value_heads) * d  # q, k, v from 2H
              + config.num_attention_heads * d * h  # o
              + 3 * h * config.intermediate_size  # mlp
              + h * config.draft_vocab_size)  # lm_head
    attention = 2 * config.num_attention_heads * d * length  # scores + weighted values
    return 2.0 * (linear + attention)
