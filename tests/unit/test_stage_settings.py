"""Stage settings: built once from the validated config, every key read; stages do not import each other."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from eagle3_pipeline import workflow_config
from eagle3_pipeline.config_schema import ConfigError, schema_defaults
from eagle3_pipeline.settings import from_section, setting
from eagle3_pipeline.stages import (
    disk_report,
    engine_check,
    evaluate,
    evaluate_timing,
    export,
    extract,
    ingest,
    parity,
    regenerate,
    target,
    tokenize,
    train,
    vocab,
)
from tests.conftest import base_config

ROOT = Path(__file__).resolve().parents[2]
STAGES = ROOT / "src" / "eagle3_pipeline" / "stages"
def embedded_config() -> dict:
    """config/config.yaml with the schema's defaults filled in, as the workflow sees it."""
    config = base_config()
    for section, values in config.items():
        if isinstance(values, dict):
            defaults = schema_defaults(section)
            config[section] = defaults | {key: defaults[key] | value if isinstance(value, dict) else value
                                          for key, value in values.items()}
    workflow_config.link_max_seq_len(config)
    workflow_config.link_selection_conversations(config["data"])
    return config


def test_every_stage_builds_its_settings_from_the_embedded_config():
    config = embedded_config()
    built = [
        ingest.ingest_settings(config["data"]),
        from_section(tokenize.Settings, config["data"], trust_remote_code=False),
        from_section(vocab.Settings, config["vocab"]),
        from_section(target.Settings, config["target"]),
        from_section(parity.Settings, config["parity"], backend=config["extract"], trust_remote_code=False),
        from_section(extract.Settings, config["extract"], backend=config["extract"], trust_remote_code=False),
        regenerate.regenerate_settings(config["regenerate"], config["data"]["max_seq_len"]),
        from_section(train.TrainSettings, config["train"]),
        from_section(export.Settings, config["export"]),
        from_section(evaluate.Settings, config["evaluate"], trust_remote_code=False),
        evaluate_timing.timing_settings(config["evaluate"], trust_remote_code=False),
        from_section(disk_report.Settings, {"compression": config["plan"]["expected_compression"],
                                            "store_dtype": config["extract"]["store_dtype"]}),
        from_section(engine_check.Settings, config["engine_check"], trust_remote_code=False),
    ]
    for settings in built:
        assert dataclasses.is_dataclass(settings)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(settings, dataclasses.fields(settings)[0].name, None)
    data_len = config["data"]["max_seq_len"]  # train.max_seq_len and regenerate.max_context_tokens: null follows it
    assert built[7].max_seq_len == data_len and built[6].max_context_tokens == data_len
    assert built[0].selection_conversations == built[0].eval_conversations  # null: the evaluation set's size
    assert built[10].prompts == config["evaluate"]["timing"]["prompts"]


def test_the_timing_pass_times_the_trees_unless_told_not_to():
    section = embedded_config()["evaluate"]
    assert section["tree"] and section["timing"]["trees"] is True
    timed = evaluate_timing.timing_settings(section, trust_remote_code=False)
    assert len(timed.trees) == len(section["tree"])
    untimed = section | {"timing": section["timing"] | {"trees": False}}
    assert evaluate_timing.timing_settings(untimed, trust_remote_code=False).trees == ()
    # the tau pass keeps them
    assert from_section(evaluate.Settings, untimed, trust_remote_code=False).trees == timed.trees


def test_stage_settings_have_no_defaults_of_their_own():
    classes = [ingest.Settings, tokenize.Settings, vocab.Settings, target.Settings, parity.Settings,
               extract.Settings, regenerate.Settings, train.TrainSettings, export.Settings, evaluate.Settings,
               evaluate_timing.Settings, disk_report.Settings, engine_check.Settings]
    for cls in classes:
        with_default = [f.name for f in dataclasses.fields(cls)
                        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert not with_default, f"{cls.__module__}.{cls.__name__}: {with_default}"


def test_train_settings_refuse_a_key_instead_of_dropping_it():
    section = embedded_config()["train"] | {"learning_rte": 1.0e-3}
    with pytest.raises(ValueError, match="learning_rte"):
        from_section(train.TrainSettings, section)


@pytest.mark.parametrize(("train_len", "effective"), [(None, 512), (256, 256)])
def test_train_max_seq_len_follows_data_or_cuts_further(train_len, effective):
    config = {"data": {"max_seq_len": 512}, "train": {"max_seq_len": train_len}}
    workflow_config.link_max_seq_len(config)
    assert config["train"]["max_seq_len"] == effective


def test_train_max_seq_len_over_the_data_length_is_refused_naming_both_keys():
    config = {"data": {"max_seq_len": 512}, "train": {"max_seq_len": 2048}}
    with pytest.raises(ConfigError, match=r"train\.max_seq_len: 2048 .* data\.max_seq_len \(512\)"):
        workflow_config.link_max_seq_len(config)


def stage_imports(path: Path) -> set[str]:
    """The stage modules `path` imports (at any depth: function-local imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "eagle3_pipeline.stages":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eagle3_pipeline.stages."):
            found.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("eagle3_pipeline.stages.")}
    return found


def test_no_stage_imports_another_stage():
    crossings = {(path.stem, imported) for path in STAGES.glob("*.py") for imported in stage_imports(path)
                 if imported != path.stem}
    assert not crossings, sorted(crossings)


def test_every_rule_script_is_a_short_adapter():
    for script in (ROOT / "scripts").glob("*.py"):
        code = [line for line in script.read_text().splitlines() if line.strip()]
        assert len(code) <= 5 and f"stages import {script.stem}" in "\n".join(code), script.name


@dataclasses.dataclass(frozen=True)
class Example:
    name: str
    url: str | None = setting(key="server.url")
    sizes: tuple[int, ...] | None = setting(convert=tuple)
    trust_remote_code: bool


def test_from_section_reads_names_dotted_keys_and_conversions_and_takes_the_rest_as_given():
    built = from_section(Example, {"name": "a", "server": {"url": "http://x"}, "sizes": [1, 2], "other": 1},
                         trust_remote_code=True)
    assert built == Example(name="a", url="http://x", sizes=(1, 2), trust_remote_code=True)
    assert from_section(Example, {"name": "a", "server": {"url": None}, "sizes": None},
                        trust_remote_code=False).sizes is None  # null stays null: no conversion


def test_from_section_names_a_missing_key_an_unknown_one_and_a_stray_given():
    with pytest.raises(KeyError, match=r"Example: the config section has no key 'server.url'"):
        from_section(Example, {"name": "a", "server": {}, "sizes": []}, trust_remote_code=False)
    with pytest.raises(ValueError, match=r"unknown config keys \['nme'\]"):
        from_section(Example, {"name": "a", "nme": "b", "server": {"url": None}, "sizes": []},
                     unread={"other"}, trust_remote_code=False)
    with pytest.raises(TypeError, match=r"no fields \['colour'\]"):
        from_section(Example, {"name": "a", "server": {"url": None}, "sizes": []}, trust_remote_code=False,
                     colour="red")


def test_settings_left_out_of_params_at_their_neutral_value_are_the_schema_defaults():
    """A setting added after runs were made is left out of its rule's params at its neutral value (so finished jobs
    do not rerun); the neutral value must be the default, and the regenerate job must fill it back in."""
    config = embedded_config()
    for section, neutral in (("train", train.TrainSettings.NEUTRAL), ("regenerate", regenerate.Settings.NEUTRAL)):
        assert {key: config[section][key] for key in neutral} == neutral, section
    without = {key: value for key, value in config["regenerate"].items() if key not in regenerate.Settings.NEUTRAL}
    max_seq_len = config["data"]["max_seq_len"]
    assert regenerate.regenerate_settings(without, max_seq_len) == \
        regenerate.regenerate_settings(config["regenerate"], max_seq_len)
