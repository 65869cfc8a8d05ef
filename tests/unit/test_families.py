"""Target families: a tiny random-weight model per family, built from its transformers config class.

For each: the drafter config derives from the target (or the support check names what is not supported),
the drafter's rotary cos/sin equal the target's own rotary module (transformers' rope init) at the same
positions, and the served config carries what SGLang's/vLLM's Eagle3 Llama loader reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eagle3_pipeline import vocab
from eagle3_pipeline.drafter.config import DrafterConfig
from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.drafter.objective import Teacher, target_argmax
from eagle3_pipeline.families import UnsupportedTarget, final_logit_softcap, target_support_problem
from eagle3_pipeline.formats import draft_vocab
from eagle3_pipeline.formats.target_dir import read_head
from eagle3_pipeline.stages import export
from eagle3_pipeline.training.loop import build_drafter, build_teacher
from tests.conftest import TINY_FAMILY_SIZES as TINY
from tests.conftest import eagle3_loader_problems, tiny_family_config

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
    assert eagle3_loader_problems(served, drafter_config) == []
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


def test_the_loader_field_check_names_what_an_engine_would_misread():
    """The export check can fail: a served config without head_dim, or with the target's softcap, reads wrongly."""
    drafter_config = DrafterConfig.from_target(tiny_family_config("qwen3"), 100, [1, 2, 2])
    served = export.serving_config(drafter_config, "bfloat16")
    del served["head_dim"]  # the engines would derive hidden / heads = 8, not Qwen3's 16
    served["final_logit_softcapping"] = 30.0  # SGLang's logits processor would softcap the drafter's logits
    del served["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert eagle3_loader_problems(served, drafter_config) == [
        "sglang: head_dim reads as None, the drafter needs 16",
        "sglang: final_logit_softcapping reads as 30.0, the drafter needs None",
        "sglang: eagle_config.eagle_aux_hidden_state_layer_ids is missing",
        "vllm: head_dim reads as None, the drafter needs 16"]


def saved_target(path, family: str, scale: float = 1.0, **sizes) -> transformers.PreTrainedModel:
    """A tiny random `family` model saved as a target directory (config.json + safetensors); its output head
    (tied to the embedding in Gemma) scaled by `scale` for confident logits."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_family_config(family, **sizes)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(path)
    return model


def test_gemma2_teacher_is_the_softcapped_target_distribution(tmp_path):
    """Gemma 2 softcaps its logits (30 tanh(x / 30)); the teacher training builds from the target directory gives the
    target's own distribution over the draft vocab, which an uncapped softmax does not."""
    target = saved_target(tmp_path, "gemma2", scale=300.0)
    assert final_logit_softcap(target.config.to_dict()) == 30.0
    drafter = Drafter(DrafterConfig.from_target(target.config, 100, [1, 1, 1]))  # draft ids 0..99 (d2t zeros)
    teacher = build_teacher(tmp_path, drafter, torch.device("cpu"))
    ids = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        last = target.model(ids).last_hidden_state
        target_logits = target(ids).logits  # transformers' Gemma 2 applies the softcap
    assert target_logits.abs().max() < 30 < (last @ target.lm_head.weight.T).abs().max()  # the cap is in play
    probs, argmax_in_draft, _ = teacher.targets(last)
    torch.testing.assert_close(probs, torch.softmax(target_logits[..., :100], -1), rtol=1e-4, atol=1e-6)
    assert torch.equal(argmax_in_draft, target_logits.argmax(-1) < 100)
    uncapped = Teacher(teacher.lm_head, teacher.draft_ids).targets(last)[0]
    assert not torch.allclose(uncapped, probs, rtol=1e-2, atol=1e-3)
    assert [final_logit_softcap(tiny_family_config(f).to_dict()) for f in ("gemma3", "llama3")] == [None, None]


def test_a_262k_vocabulary_never_makes_full_vocabulary_logits():
    """Gemma 3's 262,144-token vocabulary: the teacher's argmax over the whole vocabulary (and the held-out
    estimate's greedy token, the same function) runs over chunks of rows: no [tokens, V] tensor is allocated,
    and the results equal the plain computation."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    target = transformers.AutoModelForCausalLM.from_config(
        tiny_family_config("gemma3", vocab_size=262144, hidden_size=16, num_hidden_layers=2)).eval()
    head = target.get_output_embeddings().weight.detach()
    with torch.no_grad():
        last = target.model(torch.randint(0, 262144, (1, 256))).last_hidden_state  # 256 tokens
    expected = torch.cat([(rows @ head.T).argmax(-1) for rows in last.reshape(-1, 16).split(64)]).reshape(1, 256)
    draft_ids = torch.unique(torch.cat([expected[0, :100], torch.arange(5, 262144, 331)]))  # some argmaxes inside
    budget = 1 << 19  # logit elements per chunk: 2048 rows of 256 tokens
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        probs, argmax_in_draft, _ = Teacher(head, draft_ids, chunk_elements=budget).targets(last)
        greedy = target_argmax(last, head, budget)
    largest = max(event.cpu_memory_usage for event in profiler.events())
    assert largest <= 256 * 2048 * 4 < 256 * 262144 * 4 // 100
    assert torch.equal(greedy, expected)
    in_draft = torch.zeros(262144, dtype=torch.bool)
    in_draft[draft_ids] = True
    assert torch.equal(argmax_in_draft, in_draft[expected]) and 0 < argmax_in_draft.sum() < 256
    torch.testing.assert_close(probs, torch.softmax(last @ head[draft_ids].T, -1))


def test_the_drafter_embeds_with_the_raw_rows_as_the_engines_hand_them(tmp_path):
    """Gemma scales its input embeddings by sqrt(hidden) inside the model; SGLang hands the drafter the raw
    embed_tokens weight and vLLM shares the target's embed_tokens module (the scale is applied in the model's
    forward), so the drafter embeds unscaled rows - in training (build_drafter) and evaluation (read_head)."""
    target = saved_target(tmp_path, "gemma3")
    raw = target.model.embed_tokens.weight.detach()
    ids = torch.arange(10)
    with torch.no_grad():
        torch.testing.assert_close(target.get_input_embeddings()(ids), raw[ids] * 32 ** 0.5)  # what the target adds
    embedding, _ = read_head(tmp_path)
    assert torch.equal(embedding, raw)
    draft_vocab.write(tmp_path / "vocab.safetensors", vocab.select(np.arange(320, dtype=np.int64), 50))
    drafter = build_drafter(tmp_path, tmp_path / "vocab.safetensors", [1, 1, 1], seed=0)
    assert torch.equal(drafter.embed_tokens.weight, raw)
