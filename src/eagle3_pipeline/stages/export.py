"""The serving directory SGLang and vLLM load: `config.json` + `model.safetensors` (+ d2t/t2d inside).

Weight names (no embedding; the server shares the target's):
  fc.weight, midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
  midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
  norm.weight, lm_head.weight, d2t (int64 [K]), t2d (bool [V]).
SGLang:  --speculative-algorithm EAGLE3 --speculative-draft-model-path DIR
vLLM:    --speculative-config '{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline import logs
from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.formats import zarr_io
from eagle3_pipeline.runtime.backends import sglang_layer_ids

EXPORTED_NAMES = (
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
)
DRAFTER_CONFIG_KEY = "eagle3_pipeline_drafter_config"


@dataclass(frozen=True)
class Settings:
    dtype: str  # of the served weights: bfloat16, float16 or float32

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> Settings:
        return cls(dtype=section["dtype"])


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
    partial = zarr_io.start_partial(out_dir)
    partial.mkdir(parents=True)
    state = model.trainable_state_dict()
    if set(state) != set(EXPORTED_NAMES):
        raise ValueError(f"unexpected drafter weights: {sorted(set(state) ^ set(EXPORTED_NAMES))}")
    cast = getattr(torch, dtype)
    tensors = {k: (v.to(cast) if v.is_floating_point() else v).contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(serving_config(model.config, dtype), indent=2))
    zarr_io.commit(partial, out_dir)


def load(serving_dir: Path, embedding: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> Drafter:
    """Load an exported drafter (from the export, as a server would); the embedding comes from the target."""
    config_json = json.loads((Path(serving_dir) / "config.json").read_text())
    config = DrafterConfig(**config_json[DRAFTER_CONFIG_KEY])
    model = Drafter(config)
    state = load_file(str(Path(serving_dir) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"embed_tokens.weight"}:
        raise ValueError(f"{serving_dir}: missing {missing}, unexpected {unexpected}")
    if embedding is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embedding)
    return model.to(dtype).eval()


def load_trained(weights_path: Path) -> Drafter:
    """The training rule's output (weights + the drafter config in the safetensors metadata)."""
    from safetensors import safe_open

    with safe_open(str(weights_path), framework="pt") as handle:
        config = DrafterConfig(**json.loads(handle.metadata()["drafter_config"]))
    model = Drafter(config)
    model.load_state_dict(load_file(str(weights_path)), strict=False)
    return model


def run(weights: Path, output: Path, settings: Settings, log: logging.Logger) -> None:
    export(load_trained(weights), output, dtype=settings.dtype)
    log.info("exported %s (%s): SGLang --speculative-algorithm EAGLE3 --speculative-draft-model-path %s",
             output, settings.dtype, output)


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    run(Path(snakemake.input.weights), Path(snakemake.output[0]), Settings(dtype=snakemake.params.dtype), log)
