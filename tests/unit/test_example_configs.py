"""Every shipped config validates against the schema as the workflow reads it: each user example in
config/examples/ on its own (a --configfile run starts from the schema's defaults, not config/config.yaml), and the
GPU-session overlays in benchmarks/configs/ over the GPU example, its CPU overlays over config/config.yaml
(a renamed or retyped key fails here, naming the file, before anyone spends a GPU session on it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3_pipeline import config_schema
from tests.conftest import REPO

SCHEMA = REPO / "config" / "schema.yaml"
EXAMPLES = sorted((REPO / "config" / "examples").glob("*.yaml"))
OVERLAY_DIR = REPO / "benchmarks" / "configs"
OVERLAYS = sorted(OVERLAY_DIR.glob("gpu-smollm2-*.yaml"))
CPU_OVERLAYS = sorted(OVERLAY_DIR.glob("cpu-*.yaml"))
GPU_EXAMPLE = REPO / "config" / "examples" / "gpu-smollm2.yaml"
DEFAULT_CONFIG = REPO / "config" / "config.yaml"


def merged(*paths: Path) -> dict[str, Any]:
    """The files merged in order, mappings key by key (as --configfile does)."""
    config: dict[str, Any] = {}
    for path in paths:
        deep_update(config, yaml.safe_load(path.read_text()) or {})
    return config


def deep_update(base: dict[str, Any], overlay: dict[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = value


def test_the_user_examples_and_the_session_overlays_are_where_users_and_benchmarks_look():
    assert {p.name for p in EXAMPLES} == {"gpu-smollm2.yaml", "llama31-8b-slurm.yaml", "kimi-k2-1t-slurm.yaml",
                                          "sharegpt-full-data.yaml"}
    assert OVERLAYS and CPU_OVERLAYS and set(OVERLAY_DIR.glob("*.yaml")) == set(OVERLAYS) | set(CPU_OVERLAYS)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_each_user_example_validates(example):
    config_schema.check_schema(merged(example), SCHEMA)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_each_session_overlay_validates_over_the_gpu_example(overlay):
    config_schema.check_schema(merged(GPU_EXAMPLE, overlay), SCHEMA)


@pytest.mark.parametrize("overlay", CPU_OVERLAYS, ids=lambda p: p.name)
def test_each_cpu_overlay_validates_over_the_default_config(overlay):
    config_schema.check_schema(merged(DEFAULT_CONFIG, overlay), SCHEMA)


def test_a_misspelt_key_in_an_overlay_fails_naming_it(tmp_path):
    overlay = tmp_path / "typo.yaml"
    overlay.write_text("train:\n  epoch: 4\n")
    with pytest.raises(config_schema.ConfigError, match="train.epoch"):
        config_schema.check_schema(merged(GPU_EXAMPLE, overlay), SCHEMA)
