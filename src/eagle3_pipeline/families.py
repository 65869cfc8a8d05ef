"""Which targets a served EAGLE-3 drafter can follow, read from the target's config.json alone (no torch):
the parse-time check and `DrafterConfig.from_target` share these rules, so they cannot disagree."""

from __future__ import annotations

from typing import Any

# Text model types whose causal LM SGLang and vLLM serve with an EAGLE-3 drafter (`LlamaForCausalLMEagle3`).
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3_text", "phi3")
# Rope variants both engines' Llama drafter builds from the exported rope_scaling (get_rope), and that we train.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "rms_norm_eps",
                   "max_position_embeddings")


class UnsupportedTarget(ValueError):
    pass


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a target config.json (multimodal configs nest it under text_config)."""
    return config.get("text_config") or config


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """One flat rope dict (with rope_theta) from either config.json format: transformers 5 `rope_parameters`
    (flat, or per layer type as in Gemma 3) or the older `rope_theta` + `rope_scaling`."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params and all(isinstance(value, dict) for value in params.values()):  # per layer type
        if "full_attention" not in params:
            raise UnsupportedTarget(f"per-layer-type rope parameters {sorted(params)} have no 'full_attention' "
                                    f"entry, which the drafter's full-context attention would use")
        params = params["full_attention"]  # the drafter attends over the whole context, like these layers
    params = dict(params)
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    return params


def drafter_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) of the drafter for a target config dict; UnsupportedTarget when the
    drafter cannot reproduce what the engines would build."""
    params = _rope_parameters(config)
    kind = params["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedTarget(f"rope type {kind!r} is not one the drafter supports "
                                f"({', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise UnsupportedTarget(f"partial_rotary_factor {partial}: the drafter rotates the whole head")
    theta = float(params.pop("rope_theta"))
    if kind == "default":
        return theta, None
    if kind in ("llama3", "yarn") and not params.get("original_max_position_embeddings"):
        # transformers' default: Phi-3 keeps it at the top level, others mean the model's own maximum
        params["original_max_position_embeddings"] = (config.get("original_max_position_embeddings")
                                                      or config["max_position_embeddings"])
    if not params.get("factor"):
        raise UnsupportedTarget(f"rope type {kind!r} without a 'factor'")
    if kind == "yarn":
        custom = [key for key in ("attention_factor", "mscale", "mscale_all_dim") if params.get(key) is not None]
        if custom:
            raise UnsupportedTarget(f"yarn rope with {', '.join(custom)}: the engines' Llama drafter derives "
                                    f"YaRN's attention factor from 'factor' alone")
    return theta, params


def target_support_problem(config: dict[str, Any]) -> str | None:
    """Why no served EAGLE-3 drafter can be trained for this target config.json (dict), or None."""
    config = text_config(config)
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        return (f"model_type {family!r} is not a supported target family ({', '.join(SUPPORTED_FAMILIES)}): "
                f"its drafter's attention, rope and served config were never checked")
    missing = [key for key in REQUIRED_FIELDS if config.get(key) is None]
    if missing:
        return f"model_type {family!r} config lacks {', '.join(missing)}, which the drafter's shape needs"
    try:
        drafter_rope(config)
    except UnsupportedTarget as exc:
        return f"model_type {family!r}: {exc}"
    return None


def final_logit_softcap(config: dict[str, Any]) -> float | None:
    """The target's `final_logit_softcapping` (Gemma 2: 30): its logits are cap * tanh(logits / cap), so the
    teacher's distribution must be too. The served drafter's own logits are not softcapped: neither engine's Eagle3
    Llama drafter is given the field (the export leaves it out), and an argmax does not change under it."""
    cap = text_config(config).get("final_logit_softcapping")
    return float(cap) if cap else None
