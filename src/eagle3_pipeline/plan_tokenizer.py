"""The target's tokenizer before the target rule has run, for the disk plan's token estimate: from the
materialised copy, a GGUF file's header, a local HF directory or the local HF cache (nothing is downloaded).
The target's weights are never loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.formats.atomic import atomic_dir
from eagle3_pipeline.formats.target_dir import COPIED_FILES, is_materialised, read_identity
from eagle3_pipeline.target_shape import gguf_path

TOKENIZER_FILES = tuple(pattern for pattern in COPIED_FILES if pattern != "*.safetensors")


class NoTokenizer(Exception):
    """The tokenizer cannot be loaded here; the message says why."""


def file_stamp(path: Path) -> list[Any]:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


@dataclass(frozen=True)
class TokenizerSource:
    """Where the tokenize stage's tokenizer will come from (the `target` config section, resolved)."""

    target_dir: Path
    source: str  # a .gguf file, a directory holding `gguf_file`, an HF directory or a hub id
    gguf_file: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    chat_template: str | None = None  # `target.chat_template`: the target rule installs it

    def identity(self) -> list[Any]:
        """What decides the tokenizer, from file names, sizes and times only (cheap: no tokenizer is loaded)."""
        template = self.chat_template
        if template and Path(template).expanduser().is_file():
            template = file_stamp(Path(template).expanduser())
        if is_materialised(self.target_dir):
            return ["target", read_identity(self.target_dir)["content_hash"]]
        gguf = gguf_path(self.source, self.gguf_file)
        if gguf is not None:
            return ["gguf", file_stamp(gguf), template]
        folder = Path(self.source)
        if folder.is_dir():
            files = sorted({f for pattern in TOKENIZER_FILES for f in folder.glob(pattern)})
            return ["directory", [file_stamp(f) for f in files], template, self.trust_remote_code]
        return ["hub", self.source, self.revision, self._cached_hub_file(), template, self.trust_remote_code]

    def _cached_hub_file(self) -> str | None:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(self.source, "tokenizer_config.json", revision=self.revision)
        return cached if isinstance(cached, str) else None

    def load(self, saved_dir: Path) -> Any:
        """The tokenizer with the chat template the tokenize stage will use. A GGUF's tokenizer takes seconds to
        build, so it is saved once under `saved_dir` (as the target rule saves it) and read from there after.
        Raises NoTokenizer."""
        try:
            return self._load(saved_dir)
        except NoTokenizer:
            raise
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError... by tokenizer kind
            raise NoTokenizer(f"{type(exc).__name__}: {exc}") from exc

    def _load(self, saved_dir: Path) -> Any:
        if is_materialised(self.target_dir):  # what the tokenize stage itself loads
            return counting_tokenizer(self.target_dir, self.trust_remote_code)
        gguf = gguf_path(self.source, self.gguf_file)
        if gguf is not None:
            tokenizer = saved_gguf_tokenizer(gguf, saved_dir)
        elif Path(self.source).is_dir():
            tokenizer = counting_tokenizer(Path(self.source), self.trust_remote_code)
        elif self._cached_hub_file() is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.source, revision=self.revision, local_files_only=True,
                                                      trust_remote_code=self.trust_remote_code)
        else:
            raise NoTokenizer(f"{self.source!r} is neither a local file nor in the local HF cache")
        if self.chat_template:
            from eagle3_pipeline.tokenization import chat_template_text

            tokenizer.chat_template = chat_template_text(self.chat_template)
        return tokenizer


def counting_tokenizer(directory: Path, trust_remote_code: bool = False) -> Any:
    """A directory's tokenizer for counting tokens. With a tokenizer.json and no remote code: transformers' generic
    fast tokenizer over it (the vocabulary, merges, special tokens and chat template the tokenize stage's
    AutoTokenizer uses), loaded in about a second; AutoTokenizer takes ~4 s on a small CPU (it imports torch and
    scans every model family to pick its class), paid by every `snakemake` run in a fresh directory before the
    plan could print."""
    if not trust_remote_code and (directory / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast  # (importing AutoTokenizer alone costs ~2 s)

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)


def saved_gguf_tokenizer(gguf: Path, saved_dir: Path) -> Any:
    """The GGUF's tokenizer, built from its header once and then read from its saved copy."""
    if saved_dir.is_dir():
        return counting_tokenizer(saved_dir)
    from transformers import AutoTokenizer  # (~2 s: only where the header is read)

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with atomic_dir(saved_dir, replace=True) as partial:
        tokenizer.save_pretrained(str(partial))
    return tokenizer
