"""The materialised target directory (`results/<run>/target/`): a plain HF model directory plus our identity.

Files: `config.json`, the `*.safetensors` weights, the tokenizer files, an optional `chat_template.jinja`
(written when `target.chat_template` is set), and `identity.json`: the source it came from, the library
versions, and `content_hash`, the hash of every other file's name and content in name order - what every
downstream artifact records as the target it was made with. A local HF directory is copied by its
`COPIED_FILES` (hard-linked where it can be), so nothing linked is ever written in place: files we write
here are new files renamed over the name (`write_new_file`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

IDENTITY_FILE = "identity.json"
CONFIG_FILE = "config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
COPIED_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py")
EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_NAME = "lm_head.weight"


class InvalidTargetDir(ValueError):
    pass


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def directory_hash(path: Path) -> str:
    """Hash of every file's name and content, in name order (the identity of the materialised target)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.name != IDENTITY_FILE):
        digest.update(file.name.encode())
        digest.update(file_sha256(file).encode())
    return digest.hexdigest()


def write_new_file(path: Path, text: str) -> None:
    """Write `text` as a new file (a new inode) and rename it over `path`: a hard link at `path` is
    replaced, never written through, so a file shared with another directory stays as it was."""
    fresh = path.with_name(path.name + ".new")
    fresh.unlink(missing_ok=True)
    fresh.write_text(text)
    os.replace(fresh, path)


def write_identity(target_dir: Path, identity: dict[str, Any]) -> None:
    write_new_file(Path(target_dir) / IDENTITY_FILE, json.dumps(identity, indent=2))


def read_identity(target_dir: Path) -> dict[str, Any]:
    return json.loads((Path(target_dir) / IDENTITY_FILE).read_text())


def is_materialised(target_dir: Path) -> bool:
    """True once the `target` rule has finished the directory (identity.json is written last)."""
    return (Path(target_dir) / IDENTITY_FILE).is_file()


def content_hash(target_dir: Path) -> str:
    """The recorded content hash; a hand-made target directory (no identity.json) is hashed here."""
    if is_materialised(target_dir):
        return read_identity(target_dir)["content_hash"]
    return directory_hash(Path(target_dir))


def read_config(model_dir: Path) -> dict[str, Any] | None:
    """config.json of a target (or any HF) directory as a dict, or None when there is none."""
    path = Path(model_dir) / CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def read_head(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V,H], lm_head [V,H]) from the target's safetensors, without loading the whole model."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    wanted = {name: "embed" for name in EMBEDDING_NAMES} | {LM_HEAD_NAME: "lm_head"}
    for file in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in wanted:
                    tensors[wanted[name]] = handle.get_tensor(name)
    if "embed" not in tensors:
        raise ValueError(f"{target_dir}: no embed_tokens weight found in its safetensors")
    return tensors["embed"], tensors.get("lm_head", tensors["embed"])  # tied embeddings


def validate(target_dir: Path) -> dict[str, Any]:
    """Raise InvalidTargetDir unless the directory is a finished target whose files match its recorded
    content hash; return its identity."""
    target_dir = Path(target_dir)
    for name in (CONFIG_FILE, IDENTITY_FILE):
        if not (target_dir / name).is_file():
            raise InvalidTargetDir(f"{target_dir}: {name} missing (rerun the target rule)")
    if not list(target_dir.glob("*.safetensors")):
        raise InvalidTargetDir(f"{target_dir}: no *.safetensors weights")
    try:
        identity = read_identity(target_dir)
    except json.JSONDecodeError as exc:
        raise InvalidTargetDir(f"{target_dir / IDENTITY_FILE}: not JSON ({exc})") from None
    if identity.get("content_hash") != directory_hash(target_dir):
        raise InvalidTargetDir(f"{target_dir}: files changed since {IDENTITY_FILE} recorded their content hash")
    return identity
