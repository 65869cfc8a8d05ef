"""Bad inputs and systemic failures through the real snakemake CLI: a counted recovery or a short error
naming the key or the fix - never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from eagle3_pipeline.formats import conversation_shards, token_shards
from eagle3_pipeline.tokenization import BUILTIN_CHAT_TEMPLATES
from tests.conftest import base_config, run_snakemake, snakemake_command, tiny_conversations

pytestmark = pytest.mark.workflow
SNAKEMAKE_HEADER = ("Using workflow specific profile", "Config file ")


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(SNAKEMAKE_HEADER)]


def data_config(tmp_path, target_source, inputs, **data) -> dict:
    return base_config(run="bad", target={"source": str(target_source)},
                       data={"inputs": [str(p) for p in inputs], "num_shards": 1, "train_conversations": None,
                             "eval_conversations": 0, "max_seq_len": 256, **data},
                       vocab={"draft_vocab_size": 200})


def test_bom_surrogates_content_parts_and_a_giant_record_are_recovered(tmp_path, target_dir):
    records = [json.dumps(r) for r in tiny_conversations(8)]
    records.append('{"id": "lone", "conversations": [{"from": "human", "value": "half a pair: \\ud800"}, '
                   '{"from": "gpt", "value": "noted"}]}')
    records.append(json.dumps({"id": "parts", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]}]}))
    giant_reply = "All work and no play makes a long record. " * 50_000  # 2.1 MB in one record
    records.append(json.dumps({"id": "giant", "messages": [{"role": "user", "content": "Go on."},
                                                           {"role": "assistant", "content": giant_reply}]}))
    path = tmp_path / "chats.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(records).encode() + b"\n")
    config = data_config(tmp_path, target_dir, [path])
    result = run_snakemake(tmp_path, config, "results/bad/tokens/shard-00000.zarr")
    assert "Traceback" not in result.stderr
    report = json.loads((tmp_path / "results/bad/conversations/ingest_report.json").read_text())
    assert report["conversations_kept"] == 11 and report["dropped_total"] == 0
    assert report["modified"] == {"utf8_bom_stripped": 1, "lone_surrogates_replaced": 1,
                                  "content_parts_joined": 2, "non_text_content_parts_dropped": 1}
    kept = {c["id"]: c for c in conversation_shards.read(tmp_path / "results/bad/conversations/shard-00000.jsonl")}
    assert kept["lone"]["messages"][0]["content"] == "half a pair: \ufffd"
    shard = token_shards.read(tmp_path / "results/bad/tokens/shard-00000.zarr")
    assert shard.attrs["cut_before_tokenizing"] == 1 and shard.attrs["truncated"] == 1
    ids, mask = shard.sequence(shard.sample_ids.index("giant"))
    assert len(ids) == 256 and mask.any()

    config["data"]["overlength"] = "drop"
    run_snakemake(tmp_path, config, "results/bad/tokens/shard-00000.zarr")
    shard = token_shards.read(tmp_path / "results/bad/tokens/shard-00000.zarr")
    assert shard.attrs["dropped_overlength"] == 1 and "giant" not in shard.sample_ids and len(shard) == 10


@pytest.mark.parametrize(("case", "key", "hint"), [
    ("inputs_directory", "data.inputs[0]", "is a directory"),
    ("yaml_exponent", "train.learning_rate", "write 3.0e-4"),
    ("unknown_top_level_key", "colour", "unknown key"),
    ("relative_target_that_does_not_exist", "target.source", "not in the local Hugging Face cache"),
    ("template_file_missing", "target.chat_template", "neither a file nor a built-in"),
    ("tree_keeping_more_than_it_drafts", "evaluate.tree[1]", "keeps num_draft_tokens - 1 = 8 nodes but drafts only 6"),
])
def test_config_errors_are_a_few_lines_naming_the_key(tmp_path, case, key, hint):
    (tmp_path / "inputs").mkdir()
    (tmp_path / "x.jsonl").write_text(json.dumps(tiny_conversations(1)[0]) + "\n")
    config = base_config(run="bad", data={"inputs": [str(tmp_path / "x.jsonl")]})
    if case == "inputs_directory":
        config["data"]["inputs"] = [str(tmp_path / "inputs")]
    elif case == "yaml_exponent":
        config["train"]["learning_rate"] = "3e-4"  # what PyYAML makes of `learning_rate: 3e-4`
    elif case == "unknown_top_level_key":
        config["colour"] = "blue"
    elif case == "relative_target_that_does_not_exist":
        config["target"]["source"] = "models/my-model"
    elif case == "tree_keeping_more_than_it_drafts":
        config["evaluate"]["tree"] = [{"num_steps": 3, "topk": 1, "num_draft_tokens": 4},
                                      {"num_steps": 2, "topk": 2, "num_draft_tokens": 9}]
    else:
        config["target"]["chat_template"] = "templates/mine.jinja"
    env = os.environ | {"HF_HUB_OFFLINE": "1"}  # the cache answers; no hub lookup in a test
    for args in (["-n"], []):
        result = subprocess.run(snakemake_command(tmp_path, config, *args), capture_output=True, text=True, env=env)
        lines = error_lines(result)
        if case == "relative_target_that_does_not_exist" and args == ["-n"]:
            assert result.returncode == 0 and f"WARNING: config key {key}" in result.stderr  # a dry run warns
            continue
        assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
        assert 1 <= len(lines) <= 3 and key in lines[0] and hint in lines[0], lines
    assert not (tmp_path / "results").exists()


def template_less_copy(target_dir, destination):
    """SmolLM2 as a base model would ship: the same tokenizer and weights, no chat template."""
    destination.mkdir()
    for file in target_dir.iterdir():
        if file.name in ("chat_template.jinja", "identity.json") or file.name.startswith("."):
            continue
        if file.suffix == ".safetensors":
            os.link(file, destination / file.name)
        else:
            shutil.copy(file, destination / file.name)
    assert "chat_template" not in json.loads((destination / "tokenizer_config.json").read_text())
    return destination


def test_a_template_less_target_stops_at_tokenize_naming_the_setting(tmp_path, target_dir):
    base_model = template_less_copy(target_dir, tmp_path / "base-model")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in tiny_conversations(12)))
    config = data_config(tmp_path, base_model, [chats], end_of_turn="<|im_end|>")
    failed = run_snakemake(tmp_path, config, "results/bad/vocab/draft_vocab.safetensors", check=False)
    assert failed.returncode != 0 and "Traceback" not in failed.stderr
    assert "Error in rule tokenize" in failed.stderr + failed.stdout
    assert "12 of 12 records failed with dropped_template_error" in failed.stderr
    assert "no chat template" in failed.stderr and "Fix: set target.chat_template" in failed.stderr
    assert not (tmp_path / "results/bad/tokens/shard-00000.zarr").exists()

    template = tmp_path / "chatml.jinja"
    template.write_text(BUILTIN_CHAT_TEMPLATES["chatml"])
    config["target"]["chat_template"] = str(template)
    run_snakemake(tmp_path, config, "results/bad/vocab/draft_vocab.safetensors")
    target = tmp_path / "results/bad/target"
    assert (target / "chat_template.jinja").read_text() == template.read_text()
    assert not (base_model / "chat_template.jinja").exists()  # the source directory is untouched
    from eagle3_pipeline.runtime.target import loading

    tokenizer = loading.load_tokenizer(target)
    convs = {c["id"]: c for c in conversation_shards.read(tmp_path / "results/bad/conversations/shard-00000.jsonl")}
    shard = token_shards.read(tmp_path / "results/bad/tokens/shard-00000.zarr")
    assert len(shard) == 12
    for j, sample_id in enumerate(shard.sample_ids):
        ids, mask = shard.sequence(j)
        replies = "".join(m["content"] + "<|im_end|>" for m in convs[sample_id]["messages"]
                          if m["role"] == "assistant")
        assert tokenizer.decode(ids[mask.astype(bool)]) == replies and np.all(ids >= 0)
        assert "SmolLM" not in tokenizer.decode(ids)  # chatml, not SmolLM2's template (its default system prompt)


def test_ingest_of_the_wrong_record_shape_stops_naming_the_reason(tmp_path):
    path = tmp_path / "chats.jsonl"
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": {"text": "q"}},
                                            {"role": "assistant", "content": "a"}]} for i in range(9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records + tiny_conversations(2)))
    config = base_config(run="bad", data={"inputs": [str(path)], "num_shards": 1, "eval_conversations": 0,
                                          "train_conversations": None})
    result = run_snakemake(tmp_path, config, "results/bad/conversations/ingest_report.json", check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "9 of 11 records failed with non_string_content" in result.stderr
    assert f"{path} record 0" in result.stderr and "Fix: turn contents must be strings" in result.stderr


def test_regeneration_with_a_template_less_target_stops_naming_the_setting(tmp_path, target_dir):
    base_model = template_less_copy(target_dir, tmp_path / "base-model")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in tiny_conversations(8)))
    config = data_config(tmp_path, base_model, [chats])
    config["regenerate"] = {**config["regenerate"], "enabled": True, "max_new_tokens": 8, "batch_size": 2,
                            "device": "cpu", "dtype": "float32"}
    failed = run_snakemake(tmp_path, config, "results/bad/regenerated/shard-00000.jsonl", check=False)
    assert failed.returncode != 0 and "Traceback" not in failed.stderr
    assert "Error in rule regenerate" in failed.stderr + failed.stdout
    assert "8 of 8 records failed with dropped_template_error" in failed.stderr
    assert "Fix: set target.chat_template" in failed.stderr
    assert not (tmp_path / "results/bad/regenerated/shard-00000.jsonl").exists()
