"""Rule `export`: the trained drafter as the serving directory SGLang and vLLM load (formats/serving_dir)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.formats import drafter_weights, serving_dir
from eagle3_pipeline.formats.serving_dir import DRAFTER_CONFIG_KEY
from eagle3_pipeline.runtime.backends import sglang_layer_ids


def serving_config(config: DrafterConfig, dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,  # vLLM builds q/k/v (and o) biases from it; our drafter has none for any family
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        # SGLang numbers decoder-block outputs (HF index - 1); vLLM reads HF hidden_states indices.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(config.aux_layer_ids),
                         "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        DRAFTER_CONFIG_KEY: config.as_dict(),
        **config.extra,
    }


def export(model: Drafter, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Write the serving directory atomically."""
    cast = getattr(torch, dtype)
    tensors = {k: (v.to(cast) if v.is_floating_point() else v).contiguous().cpu()
               for k, v in model.trainable_state_dict().items()}
    serving_dir.write(out_dir, tensors, serving_config(model.config, dtype))


def load(directory: Path, embedding: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> Drafter:
    """Load an exported drafter (from the export, as a server would); the embedding comes from the target."""
    config_json, state = serving_dir.read(directory)
    model = Drafter(DrafterConfig(**config_json[DRAFTER_CONFIG_KEY]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"embed_tokens.weight"}:
        raise ValueError(f"{directory}: missing {missing}, unexpected {unexpected}")
    if embedding is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embedding)
    return model.to(dtype).eval()


def load_trained(weights_path: Path) -> Drafter:
    """The training rule's output (weights + the drafter config in the safetensors metadata)."""
    config, weights = drafter_weights.read_trained(weights_path)
    model = Drafter(DrafterConfig(**config))
    model.load_state_dict(weights, strict=False)
    return model
