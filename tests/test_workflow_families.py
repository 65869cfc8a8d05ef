"""Target families through the real snakemake CLI: an unsupported target stops `snakemake -n` (and a real
run) with one line before any job."""

from __future__ import annotations

import pytest
import transformers

from .conftest import base_config, run_snakemake
from .test_workflow_data import tiny_dataset

pytestmark = pytest.mark.workflow


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
                          f"(default, llama3)"]
        assert not (tmp_path / "results").exists()
