"""Every supported target family through the real snakemake CLI: a tiny random-weight model of each (built from its
transformers config, with the SmolLM2 tokenizer so the vocabularies match). Each family's test checks what that
family changes (head_dim, rope, biases, tied embeddings, softcap, sliding windows, fused projections, experts) in
the target and in the served config. An unsupported target stops `snakemake -n` with one line before any job.

The families whose modelling code differs run the whole workflow, tokenize -> parity -> extract -> train -> export
-> evaluate. Three close cousins of those (qwen2: llama with biases; qwen3: q/k norms and yarn; mixtral: experts
like qwen3_moe) run the stages that touch the target's own code, target conversion -> tokenize -> parity; their
served configs are checked against transformers in tests/unit/test_families.py.

CI time: the runs are built and started once per module, two at a time (each job uses one thread, the CI box has
two cores), on one shard, one epoch, one evaluation prompt and no timing pass."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from eagle3_pipeline.drafter.model import DrafterConfig
from tests.conftest import (
    base_config,
    eagle3_loader_problems,
    run_snakemake,
    tiny_conversations,
    tiny_family_config,
)
from tests.workflow.conftest import tiny_dataset

pytestmark = pytest.mark.workflow
MODEL_FILES = ("config.json", "generation_config.json", "identity.json")
EVALUATION = "results/fam/evaluation/held-out.json"
PARITY = "results/fam/parity/hf.json"
SIZES = {"vocab_size": 49152, "hidden_size": 32, "num_hidden_layers": 4}  # head_dim 16 where set: != 32 / 4 heads
CONCURRENT_RUNS = 2


def frequent_reply_tokens(tokenizer, count: int = 64) -> list[int]:
    """The most frequent token ids of the tiny dataset's assistant replies (what the draft vocabulary will hold)."""
    replies = [turn["value"] for record in tiny_conversations(40) for turn in record["conversations"]
               if turn["from"] == "gpt"]
    counts = Counter(token for reply in replies for token in tokenizer(reply)["input_ids"])
    return [token for token, _ in counts.most_common(count)]


def tiny_family_target(path: Path, family: str, smollm2_dir: Path, likely_ids: list[int]) -> None:
    """A 4-block random-weight model of `family` with SmolLM2's tokenizer files (vocab 49152) beside it. Its head
    favours `likely_ids`, so the teacher's argmax lies in the draft vocabulary, as with a real LM (a random head's
    argmax over 49152 tokens almost never does, and training would then count no position)."""
    path.mkdir()
    for file in smollm2_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in MODEL_FILES:
            shutil.copy(file, path / file.name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_family_config(family, **SIZES))
    with torch.no_grad():  # (tied in Gemma: the same input rows grow too)
        head = model.get_output_embeddings().weight
        head[likely_ids] *= 100
    model.save_pretrained(path)


def family_run_config(workdir: Path, target: Path) -> dict:
    tiny_dataset(workdir / "chats.json")
    return base_config(
        run="fam", target={"source": str(target)},
        data={"inputs": [str(workdir / "chats.json")], "num_shards": 1, "train_conversations": None,
              "eval_conversations": 1, "max_seq_len": 96},
        vocab={"draft_vocab_size": 200},
        parity={"sequences": 2, "max_tokens": 64, "threads": 1},
        extract={"token_budget": 1024, "threads": 1, "writer_threads": 1},
        train={"ttt_steps": 2, "epochs": 1, "batch_tokens": 512, "max_seq_len": 96, "warmup_steps": 1,
               "checkpoint_every": 50, "log_every": 1, "num_workers": 0, "threads": 1, "heldout_estimate": False},
        evaluate={"prompts": ["held-out"], "max_prompts": 1, "max_new_tokens": 6, "draft_lengths": [2],
                  "device": "cpu", "workers": 1, "threads": 1, "untrained_baseline": False,
                  "timing": {"prompts": 1, "max_new_tokens": 6}})


def weight_names(directory: Path) -> set[str]:
    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names


# What each family changes, as the target's config.json and weight names show it and as the served config must carry it.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
FAMILIES = {
    "llama3": {"rope": (500000.0, LLAMA3_ROPE)},
    "qwen2": {"rope": (1e6, None), "target_weights": ["self_attn.q_proj.bias"]},
    "qwen3": {"rope": (1e6, QWEN3_YARN), "head_dim": 16},
    "qwen3_moe": {"rope": (10000.0, None), "head_dim": 16, "target_weights": ["experts.0."]},
    "mistral": {"rope": (10000.0, None), "head_dim": 16, "target_config": {"sliding_window": 64}},
    "mixtral": {"rope": (1e6, None), "target_weights": ["experts.0."]},
    "gemma2": {"rope": (10000.0, None), "head_dim": 16,
               "target_config": {"final_logit_softcapping": 30.0, "tie_word_embeddings": True}},
    "gemma3": {"rope": (1e6, {"rope_type": "linear", "factor": 8.0}), "head_dim": 16,
               "target_config": {"tie_word_embeddings": True}},
    "phi3": {"rope": (10000.0, None),
             "target_weights": ["self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"]},  # fused
}
UP_TO_PARITY = {"qwen2", "qwen3", "mixtral"}  # cousins of whole-workflow families (see the module's docstring)


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory, target_dir, smollm2_tokenizer) -> dict[str, tuple[Path, object]]:
    """family -> (its workdir, its finished snakemake run): up to the evaluation, or up to parity (`UP_TO_PARITY`)."""
    likely_ids = frequent_reply_tokens(smollm2_tokenizer)
    runs = {}
    for family in FAMILIES:
        workdir = tmp_path_factory.mktemp(f"family-{family}")
        tiny_family_target(workdir / "target", family, target_dir, likely_ids)
        runs[family] = (workdir, family_run_config(workdir, workdir / "target"))
    with ThreadPoolExecutor(CONCURRENT_RUNS) as pool:
        finished = {family: pool.submit(run_snakemake, workdir, config,
                                        PARITY if family in UP_TO_PARITY else EVALUATION, check=False)
                    for family, (workdir, config) in runs.items()}
        return {family: (runs[family][0], future.result()) for family, future in finished.items()}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_runs_through_the_workflow(family_runs, family):
    workdir, result = family_runs[family]
    assert result.returncode == 0, f"snakemake failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    expected = FAMILIES[family]
    results = workdir / "results" / "fam"
    target_config = json.loads((results / "target" / "config.json").read_text())
    assert target_config.items() >= expected.get("target_config", {}).items()
    target_weights = weight_names(results / "target")
    for part in expected.get("target_weights", []):  # experts, fused projections, biases (names as saved)
        assert any(part in name for name in target_weights), part

    parity = json.loads((results / "parity" / "hf.json").read_text())
    assert parity["passed"] and parity["aux_layer_ids"] == [2, 2, 1]
    if family in UP_TO_PARITY:
        assert not (results / "hidden").exists()
        return

    served = json.loads((results / "serving" / "drafter" / "config.json").read_text())
    drafter = DrafterConfig.from_target(target_config, served["draft_vocab_size"], parity["aux_layer_ids"])
    assert eagle3_loader_problems(served, drafter) == []
    assert (served["rope_theta"], served["rope_scaling"]) == expected["rope"]
    assert served["head_dim"] == expected.get("head_dim", 8) and served["vocab_size"] == 49152
    assert served["target_hidden_size"] == 32 and served["intermediate_size"] == 64  # a MoE's dense width
    drafter_weights = weight_names(results / "serving" / "drafter")
    assert "midlayer.self_attn.q_proj.weight" in drafter_weights and not any("bias" in n for n in drafter_weights)

    summary = json.loads((results / "train" / "summary.json").read_text())
    assert summary["final_loss"] > 0  # positions counted: the teacher's argmax fell inside the draft vocabulary
    evaluation = json.loads((results / "evaluation" / "held-out.json").read_text())
    target_tokens = {t["prompt_id"]: t["tokens"] for t in evaluation["traces"] if t["method"] == "target"}
    eagle3 = [t for t in evaluation["traces"] if t["method"] == "eagle3@k=2"]
    assert len(eagle3) == 1 and len(target_tokens) == 1
    for trace in eagle3:  # fp32 greedy verification is lossless for any family: the target's own tokens
        assert trace["tokens"] == target_tokens[trace["prompt_id"]]


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
