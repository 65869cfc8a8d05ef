"""Target families: which target configs a served drafter can follow, named in one line when not."""

from __future__ import annotations

import pytest

from eagle3_pipeline.families import target_support_problem
from eagle3_pipeline.model import DrafterConfig, UnsupportedTarget

TINY = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "rms_norm_eps": 1e-6}


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
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not one the drafter supports"),
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
