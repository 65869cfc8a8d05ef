"""The serving directory SGLang and vLLM load (`serving/drafter/`): `config.json` + `model.safetensors`.

Weight names (no embedding; the server shares the target's):
  fc.weight, midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
  midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
  norm.weight, lm_head.weight, d2t (int64 [K]), t2d (bool [V]).
config.json: the engines' keys (built by stages/export.serving_config) plus our own drafter config under
DRAFTER_CONFIG_KEY, so the directory alone rebuilds the drafter.
SGLang:  --speculative-algorithm EAGLE3 --speculative-draft-model-path DIR
vLLM:    --speculative-config '{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eagle3_pipeline.formats.atomic import atomic_dir
from eagle3_pipeline.formats.target_dir import read_identity

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EXPORTED_NAMES = (
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
)
DRAFTER_CONFIG_KEY = "eagle3_pipeline_drafter_config"


class InvalidServingDir(ValueError):
    pass


def write(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write the serving directory atomically."""
    if set(tensors) != set(EXPORTED_NAMES):
        raise ValueError(f"unexpected drafter weights: {sorted(set(tensors) ^ set(EXPORTED_NAMES))}")
    with atomic_dir(Path(out_dir)) as partial:
        partial.mkdir(parents=True)
        save_file(tensors, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
        (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def read(serving_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as a dict, the weights)."""
    config = json.loads((Path(serving_dir) / CONFIG_FILE).read_text())
    return config, load_file(str(Path(serving_dir) / WEIGHTS_FILE))


def draft_vocabulary_mask(serving_dir: Path) -> list[bool]:
    """`t2d` alone, as a list by target id (whether each target token is in the draft vocabulary), without loading
    the other weights."""
    with safe_open(str(Path(serving_dir) / WEIGHTS_FILE), "pt") as weights:
        return weights.get_tensor("t2d").tolist()


def validate(serving_dir: Path) -> dict[str, Any]:
    """Raise InvalidServingDir naming the directory and reason unless an engine could load it; return config."""
    serving_dir = Path(serving_dir)
    try:
        config, tensors = read(serving_dir)
    except (OSError, json.JSONDecodeError, SafetensorError) as exc:
        raise InvalidServingDir(f"{serving_dir}: unreadable ({type(exc).__name__}: {exc})") from None
    if config.get("architectures") != ["LlamaForCausalLMEagle3"] or DRAFTER_CONFIG_KEY not in config:
        raise InvalidServingDir(f"{serving_dir / CONFIG_FILE}: not an exported EAGLE-3 drafter config")
    if set(tensors) != set(EXPORTED_NAMES):
        raise InvalidServingDir(f"{serving_dir / WEIGHTS_FILE}: weights differ from the exported names "
                                f"({sorted(set(tensors) ^ set(EXPORTED_NAMES))})")
    return config


def drafter_and_target_digest(serving_dir: Path, target_dir: Path) -> Any:
    """A sha256 (still open to more updates) of the target's identity and every file of the serving directory, in
    name order: what a decode with this drafter depends on besides its own settings."""
    digest = hashlib.sha256(read_identity(target_dir)["content_hash"].encode())
    for path in sorted(Path(serving_dir).iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest
