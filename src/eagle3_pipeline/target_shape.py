"""The target's shape (hidden size, layers, MLP width, heads, vocabulary) from whatever is local before the
target rule has run: the materialised copy, the source directory, the local HF cache, or a GGUF file's header.
The disk plan and the parse-time checks read it; nothing is downloaded."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any


def target_config(target_dir: Path, source: str, revision: str | None) -> dict[str, Any] | None:
    """The target's config.json: materialised copy, else the source directory, else the local HF cache."""
    from eagle3_pipeline.formats.target_dir import read_config

    for directory in (Path(target_dir), Path(source)):
        config = read_config(directory)
        if config is not None:
            return config
    if source.count("/") == 1 and not Path(source).exists():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json", revision=revision)
        if isinstance(cached, str):
            return json.loads(Path(cached).read_text())
    return None


@lru_cache(maxsize=4)
def gguf_reader(path: Path) -> Any:
    """One parse of a GGUF header per process (seconds for a big file): the plan and the family check share it."""
    from gguf import GGUFReader

    return GGUFReader(str(path))


def gguf_path(source: str, gguf_file: str | None) -> Path | None:
    path = Path(source) / gguf_file if gguf_file else Path(source)
    return path if path.suffix == ".gguf" and path.is_file() else None


def target_dims(target_dir: Path, source: str, gguf_file: str | None = None,
                revision: str | None = None) -> dict[str, int] | None:
    """The target's shape (hidden size, layers, MLP width, heads, vocab) or None when nothing local says."""
    config = target_config(target_dir, source, revision)
    if config is not None:
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        return {"hidden_size": int(config["hidden_size"]), "num_layers": int(config["num_hidden_layers"]),
                "intermediate_size": int(config.get("intermediate_size") or 4 * config["hidden_size"]),
                "heads": heads, "kv_heads": int(config.get("num_key_value_heads") or heads),
                "head_dim": int(config.get("head_dim") or config["hidden_size"] // heads),
                "vocab_size": int(config["vocab_size"])}
    gguf = gguf_path(source, gguf_file)
    if gguf is None:
        return None
    reader = gguf_reader(gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field_value(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    hidden, heads = field_value("embedding_length"), field_value("attention.head_count")
    return {"hidden_size": hidden, "num_layers": field_value("block_count"),
            "intermediate_size": field_value("feed_forward_length"), "heads": heads,
            "kv_heads": field_value("attention.head_count_kv"), "head_dim": hidden // heads,
            "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data)}


def target_shape(target_dir: Path, source: str, gguf_file: str | None = None) -> tuple[int, int] | None:
    """(hidden_size, num_layers) from the materialised target, else from the source, else None."""
    dims = target_dims(target_dir, source, gguf_file)
    return (dims["hidden_size"], dims["num_layers"]) if dims else None
