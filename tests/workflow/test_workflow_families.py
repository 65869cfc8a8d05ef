"""Non-Llama targets through the real snakemake CLI: tiny random-weight Qwen3 and Gemma 3 models (with the
SmolLM2 tokenizer, so the vocabularies match) run tokenize -> parity -> extract -> train -> export -> evaluate;
an unsupported target stops `snakemake -n` with one line before any job."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from tests.conftest import base_config, run_snakemake, tiny_family_config
from tests.workflow.conftest import tiny_dataset

pytestmark = pytest.mark.workflow
MODEL_FILES = ("config.json", "generation_config.json", "identity.json")


def tiny_family_target(path, family: str, smollm2_dir) -> None:
    """A 6-block random-weight model of `family` with SmolLM2's tokenizer files (vocab 49152) beside it."""
    path.mkdir()
    for file in smollm2_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in MODEL_FILES:
            shutil.copy(file, path / file.name)
    config = tiny_family_config(family, vocab_size=49152, hidden_size=64, num_hidden_layers=6)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a confident teacher, like a real LM (random init is near uniform)
        model.get_output_embeddings().weight.mul_(40)
    model.save_pretrained(path)


def family_run_config(tmp_path, target) -> dict:
    tiny_dataset(tmp_path / "chats.json")
    return base_config(
        run="fam", target={"source": str(target)},
        data={"inputs": [str(tmp_path / "chats.json")], "num_shards": 1, "train_conversations": None,
              "eval_conversations": 2, "max_seq_len": 96},
        vocab={"draft_vocab_size": 200},
        extract={"token_budget": 1024, "threads": 2},
        train={"ttt_steps": 2, "epochs": 1, "batch_tokens": 512, "max_seq_len": 96, "warmup_steps": 1,
               "checkpoint_every": 50, "log_every": 1, "num_workers": 0, "threads": 2, "heldout_estimate": False},
        evaluate={"prompts": ["held-out"], "max_prompts": 2, "max_new_tokens": 6, "draft_lengths": [2],
                  "device": "cpu", "workers": 1, "untrained_baseline": False,
                  "timing": {"prompts": 1, "max_new_tokens": 6}})


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_non_llama_target_runs_the_whole_workflow(tmp_path, target_dir, family):
    target = tmp_path / f"tiny-{family}"
    tiny_family_target(target, family, target_dir)
    config = family_run_config(tmp_path, target)
    results = tmp_path / "results" / "fam"
    run_snakemake(tmp_path, config, "results/fam/evaluation/held-out.json")
    parity = json.loads((results / "parity" / "hf.json").read_text())
    assert parity["passed"] and parity["aux_layer_ids"] == [2, 3, 3]
    served = json.loads((results / "serving" / "drafter" / "config.json").read_text())
    assert served["head_dim"] == 16 and served["target_hidden_size"] == 64 and served["vocab_size"] == 49152
    expected_rope = {"qwen3": (1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
                     "gemma3": (1e6, {"rope_type": "linear", "factor": 8.0})}[family]
    assert (served["rope_theta"], served["rope_scaling"]) == expected_rope
    evaluation = json.loads((results / "evaluation" / "held-out.json").read_text())
    traces = {(t["prompt_id"], t["method"]): t for t in evaluation["traces"]}
    eagle3 = [t for t in evaluation["traces"] if t["method"] == "eagle3@k=2"]
    assert len(eagle3) == 2
    for trace in eagle3:  # fp32 greedy verification is lossless for any family: the target's own tokens
        assert trace["tokens"] == traces[trace["prompt_id"], "target"]["tokens"]


def test_an_unsupported_target_stops_the_dry_run_with_one_line(tmp_path):
    target = tmp_path / "phi3-128k"
    transformers.Phi3Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, pad_token_id=0, max_position_embeddings=4096,
                            original_max_position_embeddings=512,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
                            ).save_pretrained(target)
    config = family_run_config(tmp_path, target)
    for args in (["-n"], []):
        result = run_snakemake(tmp_path, config, *args, check=False)
        assert result.returncode != 0 and "Traceback" not in result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("Config error")]
        assert errors == [f"Config error: config key target.source: {str(target)!r}: model_type 'phi3': "
                          f"rope type 'longrope' is not one the drafter supports "
                          f"(default, linear, dynamic, yarn, llama3)"]
        assert not (tmp_path / "results").exists()
