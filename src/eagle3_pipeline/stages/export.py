"""Rule `export`: the trained drafter as the serving directory SGLang and vLLM load (formats/serving_dir)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline import logs
from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.formats import drafter_weights, serving_dir
from eagle3_pipeline.formats.serving_dir import DRAFTER_CONFIG_KEY
from eagle3_pipeline.runtime.extraction import sglang_layer_ids
from eagle3_pipeline.settings import from_section


@dataclass(frozen=True)
class Settings:
    dtype: str  # of the served weights: bfloat16, float16 or float32


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


def load_trained(weights_path: Path) -> Drafter:
    """The training rule's output (weights + the drafter config in the safetensors metadata)."""
    config, weights = drafter_weights.read_trained(weights_path)
    model = Drafter(DrafterConfig(**config))
    model.load_state_dict(weights, strict=False)
    return model


def run(weights: Path, output: Path, settings: Settings, log: logging.Logger) -> None:
    export(load_trained(weights), output, dtype=settings.dtype)
    log.info("exported %s (%s): SGLang --speculative-algorithm EAGLE3 --speculative-draft-model-path %s",
             output, settings.dtype, output)


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    settings = from_section(Settings, dict(snakemake.params.items()))
    run(Path(snakemake.input.weights), Path(snakemake.output[0]), settings, log)
