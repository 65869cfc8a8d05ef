"""Parse-time checks of the config that the JSON schema cannot express (paths, model depth, ...).

Errors name the config key, so a bad config fails before any job runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import assets


class ConfigError(ValueError):
    pass


@dataclass
class Settings:
    data_inputs: list[str]
    target_source: str


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or value.endswith((".gguf", ".json", ".jsonl")) \
        or value.count("/") != 1


def resolve_input(key: str, value: str) -> str:
    try:
        path = assets.resolve(value)
    except assets.MissingAsset as exc:
        raise ConfigError(f"config key {key}: {exc}") from exc
    if not path.exists():
        raise ConfigError(f"config key {key}: {value!r} does not exist")
    return str(path)


def check(config: dict[str, Any]) -> Settings:
    target = config["target"]
    source = target["source"]
    if assets.is_alias(source) or _looks_like_path(source):
        target_source = resolve_input("target.source", source)
        gguf_file = target.get("gguf_file")
        if gguf_file and not (Path(target_source) / gguf_file).is_file():
            raise ConfigError(f"config key target.gguf_file: {gguf_file!r} not found in {target_source}")
    else:
        target_source = source  # a hub id, resolved from the local HF cache when the target rule runs
    data = config["data"]
    inputs = [resolve_input(f"data.inputs[{i}]", value) for i, value in enumerate(data["inputs"])]
    if data.get("weights") is not None:
        if len(data["weights"]) != len(inputs):
            raise ConfigError(f"config key data.weights: {len(data['weights'])} weights for {len(inputs)} inputs")
        names = [Path(p).name for p in inputs]
        if len(set(names)) != len(names):  # conversations record their source by file name
            raise ConfigError("config key data.weights: inputs need distinct file names to be weighted")
    if data.get("train_conversations") is not None and data["train_conversations"] < data["num_shards"]:
        raise ConfigError(f"config key data.train_conversations: {data['train_conversations']} is fewer "
                          f"than data.num_shards ({data['num_shards']})")
    regenerate = config.get("regenerate") or {}
    server_url = (regenerate.get("server") or {}).get("url")
    if regenerate.get("enabled") and regenerate.get("engine") == "openai" and not server_url:
        raise ConfigError("config key regenerate.server.url: required when regenerate.engine is 'openai'")
    extract = config.get("extract") or {}
    if extract.get("backend") == "sglang":
        for key in ("aux_url", "final_url"):
            if not (extract.get("sglang") or {}).get(key):
                raise ConfigError(f"config key extract.sglang.{key}: required when extract.backend is 'sglang'")
    return Settings(data_inputs=inputs, target_source=target_source)
