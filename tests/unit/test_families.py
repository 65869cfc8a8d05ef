"""Target families: a tiny random-weight model per family, built from its transformers config class.

For each: the drafter config derives from the target (or the support check names what is not supported),
the drafter's rotary cos/sin equal the target's own rotary module (transformers' rope init) at the same
positions, and the served config carries what SGLang's/vLLM's Eagle3 Llama loader reads."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eagle3_pipeline.drafter.model import Drafter, DrafterConfig, UnsupportedTarget
from eagle3_pipeline.families import target_support_problem
from eagle3_pipeline.stages import export
from tests.conftest import TINY_FAMILY_SIZES as TINY
from tests.conftest import tiny_family_config

FAMILIES = ["llama3", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3", "phi3"]


def target_cos_sin(model, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, positions.shape[-1], model.config.hidden_size)
    if isinstance(model.config, transformers.Gemma3TextConfig):
        return model.model.rotary_emb(x, positions, layer_type="full_attention")
    return model.model.rotary_emb(x, positions)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_follows_each_family(family):
    torch.manual_seed(0)
    config = tiny_family_config(family)
    target = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert target_support_problem(config.to_dict()) is None
    drafter_config = DrafterConfig.from_target(config, draft_vocab_size=100, aux_layer_ids=[1, 2, 2])
    assert drafter_config.head_dim == (getattr(config, "head_dim", None) or 32 // 4)
    assert (drafter_config.vocab_size, drafter_config.hidden_size) == (320, 32)
    positions = torch.arange(0, 400, 7)[None]
    cos, sin = target_cos_sin(target, positions)
    own_cos, own_sin = Drafter(drafter_config).rotary(positions, torch.float32)
    torch.testing.assert_close(own_cos[:, 0], cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(own_sin[:, 0], sin, rtol=1e-5, atol=1e-5)

    served = export.serving_config(drafter_config, "bfloat16")
    assert served["architectures"] == ["LlamaForCausalLMEagle3"] and served["head_dim"] == drafter_config.head_dim
    assert served["attention_bias"] is False and served["hidden_act"] == "silu"
    assert served["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    assert served["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    # What a loader builds from the served config (a LlamaConfig): the same rotary as the drafter trained with.
    loaded = transformers.LlamaConfig(**{k: v for k, v in served.items() if k != "architectures"})
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(loaded)
    served_cos, _ = rotary(torch.zeros(1, 1, 32), positions)
    torch.testing.assert_close(own_cos[:, 0], served_cos, rtol=1e-5, atol=1e-5)


def llama_with_rope(rope: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**{**TINY, "num_attention_heads": 2, "num_key_value_heads": 2},
                                    rope_parameters={"rope_theta": 10000.0, **rope})


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
])
def test_rope_variants_match_transformers_rope_init(rope):
    config = llama_with_rope(rope)
    expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    drafter = Drafter(DrafterConfig.from_target(config, 50, [1, 1, 2]))
    torch.testing.assert_close(drafter.inv_freq, expected, rtol=1e-6, atol=0)
    assert drafter.rope_attention_factor == pytest.approx(attention_factor, rel=1e-9)
    if rope["rope_type"] == "yarn":
        assert attention_factor > 1.0  # the scaled cos/sin are exercised, not a no-op


def test_dynamic_rope_is_static_ntk_at_factor_times_max_positions():
    """SGLang and vLLM build dynamic NTK once for factor x max_position_embeddings; transformers at that length
    gives the same frequencies (and the plain ones for shorter sequences, which the served drafter never sees)."""
    config = llama_with_rope({"rope_type": "dynamic", "factor": 4.0})
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=4 * config.max_position_embeddings)
    drafter = Drafter(DrafterConfig.from_target(config, 50, [1, 1, 2]))
    torch.testing.assert_close(drafter.inv_freq, expected, rtol=1e-6, atol=0)
    plain, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu")
    assert not torch.allclose(drafter.inv_freq, plain)


def test_older_config_json_formats_give_the_same_drafter():
    """config.json written by transformers 4 (rope_theta + rope_scaling with 'type') reads like rope_parameters."""
    old = {**TINY, "model_type": "qwen2", "rope_theta": 1e6,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}
    new = {**TINY, "model_type": "qwen2", "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128}}
    assert DrafterConfig.from_target(old, 50, [1, 1, 2]) == DrafterConfig.from_target(new, 50, [1, 1, 2])
    phi3_longctx = {**TINY, "model_type": "phi3", "original_max_position_embeddings": 64,
                    "rope_scaling": {"type": "yarn", "factor": 2.0}}
    assert DrafterConfig.from_target(phi3_longctx, 50, [1, 1, 2]).rope_scaling == {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}


def test_gemma3_per_layer_type_rope_uses_the_full_attention_parameters():
    config = {**TINY, "model_type": "gemma3_text", "head_dim": 16, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}
    drafter = DrafterConfig.from_target({"model_type": "gemma3", "text_config": config}, 50, [1, 1, 2])
    assert (drafter.rope_theta, drafter.rope_scaling, drafter.head_dim) == (1e6, None, 16)


@pytest.mark.parametrize(("change", "named"), [
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not a supported target family"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                                             "long_factor": [2.0] * 4}},
     "rope type 'longrope' is not one the drafter supports"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
     "yarn rope with mscale, mscale_all_dim"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "chunked_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "no 'full_attention' entry"),
    ({"rms_norm_eps": None}, "lacks rms_norm_eps"),
])
def test_unsupported_targets_are_named_in_one_line(change, named):
    config = {**TINY, "model_type": "llama", **change}
    problem = target_support_problem(config)
    assert named in problem and "\n" not in problem
    with pytest.raises(UnsupportedTarget, match="model_type"):
        DrafterConfig.from_target(config, 50, [1, 1, 2])
