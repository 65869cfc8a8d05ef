"""The drafter's shape, derived from the target's config: what the model (model.py), its caches (attention.py) and
the export (config.json of serving/drafter) are built from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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
