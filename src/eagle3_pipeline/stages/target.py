"""Rule `target`: materialise the target model once as a plain HF directory (config, tokenizer, safetensors)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import logs
from eagle3_pipeline import target as target_model
from eagle3_pipeline.families import target_support_problem


@dataclass(frozen=True)
class Settings:
    source: str  # an alias, a .gguf file, an HF directory or a hub id
    gguf_file: str | None
    revision: str | None
    trust_remote_code: bool
    chat_template: str | None  # a Jinja file or a built-in name, for a tokenizer without a template

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> Settings:
        return cls(source=section["source"], gguf_file=section["gguf_file"], revision=section["revision"],
                   trust_remote_code=section["trust_remote_code"], chat_template=section["chat_template"])


def run(output: Path, settings: Settings, log: logging.Logger) -> dict[str, Any]:
    """The target directory; SystemExit with the reason when no served drafter can be trained for it."""
    identity = target_model.materialise(settings.source, output, gguf_file=settings.gguf_file,
                                        revision=settings.revision, trust_remote_code=settings.trust_remote_code,
                                        chat_template=settings.chat_template)
    problem = target_support_problem(json.loads((output / "config.json").read_text()))
    if problem:  # a hub id or GGUF seen for the first time: stop before any extraction
        message = f"Target {settings.source!r} cannot get a served EAGLE-3 drafter: {problem}"
        log.error(message)
        raise SystemExit(message)
    log.info("target ready: %s (content hash %s)", output, identity["content_hash"][:16])
    return identity


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    params = snakemake.params
    settings = Settings(source=params.source, gguf_file=params.gguf_file, revision=params.revision,
                        trust_remote_code=params.trust_remote_code, chat_template=params.chat_template)
    run(Path(snakemake.output[0]), settings, log)
