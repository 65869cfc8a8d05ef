"""Parse-time config checks, called directly: the schema's messages name the key and the fix, and the checks the
schema cannot express (files, counts, required URLs, a template that must parse) name the key too."""

from __future__ import annotations

import importlib.util
import re

import pytest
import yaml

from eagle3_pipeline import workflow_config
from eagle3_pipeline.config_schema import ConfigError, check_schema
from eagle3_pipeline.workflow_config import check
from tests.conftest import REPO, base_config

SCHEMA = REPO / "config" / "schema.yaml"


def schema_error(config: dict) -> str:
    with pytest.raises(ConfigError) as error:
        check_schema(config, SCHEMA)
    return str(error.value)


def test_the_shipped_config_passes_the_schema():
    check_schema(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), SCHEMA)


def restated_defaults(config: dict, defaults: dict, prefix: str = "") -> list[str]:
    """Keys of `config` whose value is the schema's default (nested mappings compared key by key)."""
    found = []
    for key, value in config.items():
        if key not in defaults:
            continue
        if isinstance(value, dict) and isinstance(defaults[key], dict) and defaults[key]:
            found += restated_defaults(value, defaults[key], f"{prefix}{key}.")
        elif value == defaults[key]:
            found.append(f"{prefix}{key}: {value!r}")
    return found


def schema_default_values(schema: dict) -> dict:
    """Every key's default, nested: a section's defaults are its properties' defaults."""
    values = {}
    for key, spec in schema.get("properties", {}).items():
        if spec.get("type") == "object" and "properties" in spec:
            values[key] = schema_default_values(spec)
        elif "default" in spec:
            values[key] = spec["default"]
    return values


def test_the_shipped_config_holds_only_its_own_choices():
    """A default lives in the schema alone: config/config.yaml restating one would be a second place to change."""
    shipped = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert not restated_defaults(shipped, schema_default_values(yaml.safe_load(SCHEMA.read_text())))


def test_a_restated_default_is_found():
    defaults = schema_default_values(yaml.safe_load(SCHEMA.read_text()))
    assert restated_defaults({"train": {"ttt_steps": 7, "epochs": 3}, "evaluate": {"timing": {"prompts": 20}}},
                             defaults) == ["train.ttt_steps: 7", "evaluate.timing.prompts: 20"]


def test_an_unknown_key_is_named_with_the_keys_allowed_there():
    config = base_config()
    config["data"] = {**config["data"], "colour": "blue"}
    message = schema_error(config)
    assert message.startswith("config key data.colour: unknown key (allowed here: ")
    assert "num_shards" in message and "\n" not in message


def test_a_value_of_the_wrong_type_is_named_with_its_key():
    config = base_config(data={"num_shards": "four"})
    assert schema_error(config) == "config key data.num_shards: 'four' is not of type 'integer'"


def test_yaml_reading_an_exponent_without_a_dot_as_a_string_gets_the_fix():
    shipped = (REPO / "config" / "config.yaml").read_text()
    text = re.sub(r"(?m)^(  learning_rate:) \S+", r"\1 3e-4", shipped)  # whatever rate the default ships
    assert text != shipped
    config = yaml.safe_load(text)
    assert config["train"]["learning_rate"] == "3e-4"  # PyYAML follows YAML 1.1
    message = schema_error(config)
    assert message.startswith("config key train.learning_rate: '3e-4' is not of type 'number'")
    assert message.endswith("; YAML reads 3e-4 as a string - write 3.0e-4 (with a dot) for a number")


def test_many_problems_show_three_and_count_the_rest():
    config = base_config(data={"num_shards": "a", "seed": "b", "max_seq_len": "c", "eval_conversations": "d"})
    lines = schema_error(config).splitlines()
    assert len(lines) == 4 and lines[-1] == "(1 more problems)"
    assert all(line.startswith("config key data.") for line in lines[:3])


def checked_config(tmp_path, **sections) -> dict:
    """A config whose target and input are real local files (no alias, no hub lookup)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "chats.json").write_text("[]")
    return base_config(target={"source": str(tmp_path / "model")},
                       data={"inputs": [str(tmp_path / "chats.json")], **sections.pop("data", {})}, **sections)


def check_error(config: dict) -> str:
    with pytest.raises(ConfigError) as error:
        check(config)
    return str(error.value)


def test_local_files_pass_and_come_back_resolved(tmp_path):
    settings = check(checked_config(tmp_path))
    assert settings.data_inputs == [str(tmp_path / "chats.json")] and settings.target_source == str(tmp_path / "model")
    assert settings.warnings == [] and settings.chat_template_file is None


@pytest.mark.parametrize(("change", "expected"), [
    ({"target": {"source": "/nonexistent/model"}}, "config key target.source: '/nonexistent/model' does not exist"),
    ({"target": {"gguf_file": "model.gguf"}}, "config key target.gguf_file: 'model.gguf' not found in "),
    ({"data": {"inputs": ["{tmp}"]}}, "config key data.inputs[0]: '{tmp}' is a directory, not a JSON/JSONL file"),
    ({"data": {"weights": [1.0, 2.0]}}, "config key data.weights: 2 weights for 1 inputs"),
    ({"data": {"train_conversations": 3, "num_shards": 4}},
     "config key data.train_conversations: 3 is fewer than data.num_shards (4)"),
    ({"regenerate": {"enabled": True, "engine": "openai"}},
     "config key regenerate.server.url: required when regenerate.engine is 'openai'"),
    ({"regenerate": {"enabled": True, "engine": "vllm", "device": "cpu"}},
     "config key regenerate.device: 'cpu', but engine 'vllm' runs on CUDA GPUs"),
    ({"regenerate": {"enabled": True, "engine": "vllm", "temperature": 2.5}},
     "config key regenerate.temperature: 2.5; vLLM samples up to 2"),
    ({"regenerate": {"enabled": True, "max_new_tokens": 256}, "data": {"max_seq_len": 256}},
     "config key regenerate.max_new_tokens: 256 leaves no room for a history within regenerate.max_context_tokens "
     "(256; null = data.max_seq_len)"),
    ({"regenerate": {"samples": 2, "temperature": 0.0}},
     "config key regenerate.samples: 2 samples need regenerate.temperature > 0 (greedy samples would be identical)"),
    ({"extract": {"backend": "sglang", "sglang": {"aux_url": "http://127.0.0.1:1"}}},
     "config key extract.sglang.final_url: required when extract.backend is 'sglang'"),
])
def test_what_the_schema_cannot_say_is_named_by_key(tmp_path, change, expected):
    config = checked_config(tmp_path)
    for section, values in change.items():
        values = {key: [v.format(tmp=tmp_path) for v in value] if key == "inputs" else value
                  for key, value in values.items()}
        config[section] = {**config[section], **values}
    assert check_error(config).startswith(expected.format(tmp=tmp_path))


def test_the_vllm_engine_is_checked_for_before_any_job_runs(tmp_path):
    config = checked_config(tmp_path, regenerate={"enabled": True, "engine": "vllm"})
    warned = [w for w in check(config).warnings if w.startswith("regenerate.engine 'vllm'")]
    assert len(warned) == (importlib.util.find_spec("vllm") is None)


def test_the_selection_set_is_as_large_as_the_evaluation_set_unless_set(tmp_path):
    config = checked_config(tmp_path, data={"eval_conversations": 7, "selection_conversations": None})
    check(config)
    assert config["data"]["selection_conversations"] == 7
    config = checked_config(tmp_path, data={"eval_conversations": 7, "selection_conversations": 3})
    check(config)
    assert config["data"]["selection_conversations"] == 3


def test_a_chat_template_must_exist_and_parse(tmp_path):
    config = checked_config(tmp_path)
    config["target"] = {**config["target"], "chat_template": str(tmp_path / "missing.jinja")}
    message = check_error(config)
    assert message.startswith("config key target.chat_template: ") and "is neither a file nor a built-in" in message
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}\n{{ message['content'] }}\n")  # no endfor
    config["target"]["chat_template"] = str(broken)
    assert check_error(config).startswith(f"config key target.chat_template: {broken} line ")
    good = tmp_path / "good.jinja"
    good.write_text("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    config["target"]["chat_template"] = str(good)
    assert check(config).chat_template_file == str(good)


def test_the_timing_pass_times_the_named_prompt_sets_or_all():
    evaluated, key = ["mtbench-package", "held-out"], "evaluate.timing.prompt_sets"
    assert workflow_config.chosen_sets({"evaluate": {"timing": {"prompt_sets": None}}}, key, evaluated) == evaluated
    assert workflow_config.chosen_sets({"evaluate": {}}, key, evaluated) == evaluated
    assert workflow_config.chosen_sets({"evaluate": {"timing": {"prompt_sets": ["held-out"]}}}, key, evaluated) == [
        "held-out"]
    with pytest.raises(ConfigError, match=r"evaluate\.timing\.prompt_sets: \['humaneval'\] are not prompt sets"):
        workflow_config.chosen_sets({"evaluate": {"timing": {"prompt_sets": ["humaneval"]}}}, key, evaluated)
