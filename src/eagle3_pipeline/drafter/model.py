"""The EAGLE-3 drafter (Llama family), in one readable file.

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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_pipeline.families import UnsupportedTarget, drafter_rope, target_support_problem, text_config


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # HF hidden_states indices
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    extra: dict[str, Any] = field(default_factory=dict)  # target config fields copied into the export

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: list[int]) -> DrafterConfig:
        """From the target's transformers config (or its config.json as a dict); UnsupportedTarget when no drafter
        that SGLang/vLLM serve can be built for it (see `target_support_problem`)."""
        config = text_config(target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config))
        problem = target_support_problem(config)
        if problem:
            raise UnsupportedTarget(problem)
        heads = config["num_attention_heads"]
        theta, scaling = drafter_rope(config)
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=config["hidden_size"],
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config["max_position_embeddings"],
            extra={k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                   if config.get(k) is not None},
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


KVCache = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, kv_heads, T, head_dim]


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
    """Attention whose queries/keys/values come from the 2H concat; keys of earlier TTT steps are cached."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.implementation = "eager"  # or "flex" (GPU): see Drafter.use_flex_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        """x [B,T,2H]. With `cache` (TTT), step k attends to step 0 causally and to its own position at steps 1..k.

        Rows are right-padded: a real query sees only earlier positions, so padding needs no mask."""
        batch, length, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        if cache is not None:
            cache.append((k, v))  # un-repeated keys/values of this step
        if self.implementation == "flex" and cache is not None:
            out = ttt_flex_attention(q, cache)
        elif cache is None or len(cache) == 1:
            out = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), is_causal=True)
        else:
            out = self._ttt_attention(q, cache)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B,heads,T,d], k and v [B,kv_heads,T,d], rotary applied to q and k."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.heads // self.kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               past: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """Inference with a KV cache: new rows attend to every cached row and causally to each other."""
        batch, length, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        cached = k.shape[2] - length
        mask = torch.ones(length, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=cached)
        out = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), (k, v)

    def decode_static(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKV,
                      positions: torch.Tensor) -> torch.Tensor:
        """`decode` into a StaticKV: rows written at their positions [T]; each attends to slots <= its position."""
        batch, length, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        cache.keys.index_copy_(2, positions, k)
        cache.values.index_copy_(2, positions, v)
        mask = torch.arange(cache.capacity, device=x.device)[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(q, self._repeat(cache.keys), self._repeat(cache.values), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _ttt_attention(self, q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Reference TTT attention (CPU, and the check for the flex kernel): explicit scores."""
        scale = 1.0 / math.sqrt(self.head_dim)
        k0, v0 = self._repeat(cache[0][0]), self._repeat(cache[0][1])
        length = q.shape[2]
        prefix = (q @ k0.transpose(-1, -2)) * scale  # [B,h,T,T] against the real-feature step
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        prefix = prefix.masked_fill(~causal, float("-inf"))
        later_k = torch.stack([self._repeat(ck) for ck, _ in cache[1:]], dim=-2)  # [B,h,T,S,d], one key per step
        later_v = torch.stack([self._repeat(cv) for _, cv in cache[1:]], dim=-2)
        diagonal = (q.unsqueeze(-2) * later_k).sum(-1) * scale  # [B,h,T,S]
        weights = torch.softmax(torch.cat([prefix, diagonal], dim=-1).float(), dim=-1).to(q.dtype)
        return weights[..., :length] @ v0 + (weights[..., length:].unsqueeze(-1) * later_v).sum(-2)


@lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_attention_problem(device: torch.device) -> str | None:
    """None when the fused kernel compiles and runs forward and backward here, else why not (once per process)."""
    try:
        q = torch.randn(1, 2, 128, 16, device=device, requires_grad=True)
        steps = [(torch.randn(1, 1, 128, 16, device=device), torch.randn(1, 1, 128, 16, device=device))
                 for _ in range(2)]
        ttt_flex_attention(q, steps).sum().backward()
        return None
    except Exception as exc:  # missing Triton, unsupported device, compiler errors: all mean "use eager"
        return f"{type(exc).__name__}: {str(exc)[:300]}"


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


def ttt_flex_attention(q: torch.Tensor, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The same attention as `Attention._ttt_attention` as one fused kernel (GPU): the extra steps cost a few
    diagonal tiles instead of a materialised [T, T] score matrix."""
    keys = torch.cat([k for k, _ in steps], dim=2)
    values = torch.cat([v for _, v in steps], dim=2)
    mask = ttt_block_mask(q.shape[2], len(steps), q.device)
    return _compiled_flex_attention()(q, keys, values, block_mask=mask, enable_gqa=keys.shape[1] != q.shape[1])


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

    def forward(self, embeds, hidden, cos, sin, cache):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


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

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             cache: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft position for every token: returns (draft-vocab logits [B,T,K], pre-norm hidden [B,T,H]).

        `hidden` is either the target's aux features (width 3H, projected by fc) or a previous step's output.
        """
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(positions, hidden.dtype)
        hidden = self.midlayer(embeds, hidden, cos, sin, cache)
        return self.lm_head(self.norm(hidden)), hidden

    def decode(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               past: KVCache | StaticKV | None = None):
        """Inference step with a KV cache (what a server runs): returns (logits, pre-norm hidden, new cache).
        A StaticKV is updated in place (batch 1) and returned as is."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        layer = self.midlayer
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(positions, hidden.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        if isinstance(past, StaticKV):
            attended, cache = layer.self_attn.decode_static(x, cos, sin, past, positions[0]), past
        else:
            attended, cache = layer.self_attn.decode(x, cos, sin, past)
        hidden = hidden + attended
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.lm_head(self.norm(hidden)), hidden, cache

    def use_flex_attention(self, enabled: bool = True) -> None:
        """Training-time test attention through torch's flex_attention kernel (needs a GPU and Triton)."""
        self.midlayer.self_attn.implementation = "flex" if enabled else "eager"

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that is exported: all weights but the embedding, plus d2t/t2d."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


def shift_left(x: torch.Tensor, by: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t+by] (padded with `fill`): the token a chain step at position t is fed, by step."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


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
