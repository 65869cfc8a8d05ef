"""Generation with the target for data regeneration: the engines' settings and what they return. The engines:
`hf.HFEngine` (HF `generate`, batched, left padded; CPU or GPU) and `server.OpenAIEngine` (any OpenAI-compatible
server: SGLang, vLLM, llama.cpp; bounded concurrency, retries with backoff and timeouts). The settings are the
`regenerate` rule's (stages/regenerate.py drives the engines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Settings:
    """The `regenerate` config section, flattened (no defaults here: they are config/schema.yaml's)."""
    engine: str
    max_new_tokens: int
    temperature: float
    top_p: float
    thinking: bool | None
    max_context_tokens: int
    batch_size: int
    seed: int
    device: str
    dtype: str
    url: str | None
    model: str | None
    api_key_env: str | None
    concurrency: int
    timeout_s: float
    max_retries: int
    backoff_s: float
    repetition_threshold: float
    drop_repetitive: bool
    trust_remote_code: bool

    @classmethod
    def from_config(cls, section: dict[str, Any], max_seq_len: int, trust_remote_code: bool = False) -> Settings:
        """From the validated section; max_context_tokens null means data.max_seq_len."""
        server, repetition = section["server"], section["repetition"]
        return cls(engine=section["engine"], max_new_tokens=section["max_new_tokens"],
                   temperature=section["temperature"], top_p=section["top_p"], thinking=section["thinking"],
                   max_context_tokens=section["max_context_tokens"] or max_seq_len,
                   batch_size=section["batch_size"], seed=section["seed"], device=section["device"],
                   dtype=section["dtype"], url=server["url"], model=server["model"],
                   api_key_env=server["api_key_env"], concurrency=server["concurrency"],
                   timeout_s=server["timeout_s"], max_retries=server["max_retries"], backoff_s=server["backoff_s"],
                   repetition_threshold=repetition["threshold"], drop_repetitive=repetition["drop"],
                   trust_remote_code=trust_remote_code)

    def output_defining(self) -> dict[str, Any]:
        """The settings that change what is generated (not how fast): they decide whether to resume."""
        keys = ["engine", "max_new_tokens", "temperature", "top_p", "thinking", "max_context_tokens", "seed", "model"]
        if self.drop_repetitive:
            keys += ["drop_repetitive", "repetition_threshold"]
        return {key: getattr(self, key) for key in keys}

    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.thinking is None else {"enable_thinking": self.thinking}


@dataclass
class Reply:
    text: str
    finished: bool  # ended by the model (end of turn), not by max_new_tokens
    tokens: int


class RequestRejected(ValueError):
    """The engine refused this one conversation (e.g. a 400 from the server): skip it, count it."""


class ServerUnavailable(RuntimeError):
    """The server kept failing after every retry: stop the job; finished conversations are kept."""


class Engine(Protocol):
    def reply(self, histories: list[list[dict[str, str]]], seeds: list[int]) -> list[Reply | RequestRejected]:
        ...
