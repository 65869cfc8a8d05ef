"""Generation with the target for data regeneration: the engines' settings and what they return. The engines:
`hf.HFEngine` (HF `generate`, batched, left padded; CPU or GPU) and `server.OpenAIEngine` (any OpenAI-compatible
server: SGLang, vLLM, llama.cpp; bounded concurrency, retries with backoff and timeouts). The settings are the
`regenerate` rule's (stages/regenerate.py drives the engines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from eagle3_pipeline.settings import setting

# how the HF engine turns a row's seed into its draws (hf.RowSeededSampling); a sampled run's journal records it
HF_SAMPLER = "inverse-cdf"


@dataclass(frozen=True)
class Settings:
    """The `regenerate` config section, flattened (no defaults here: they are config/schema.yaml's);
    max_context_tokens null in the config means data.max_seq_len (the stage passes it)."""
    engine: str
    max_new_tokens: int
    temperature: float
    top_p: float
    samples: int  # replies per conversation, each kept as its own conversation
    thinking: bool | None
    max_context_tokens: int
    batch_size: int
    compile: str | bool  # hf: static caches and a compiled decode step (auto: on CUDA)
    seed: int
    device: str
    dtype: str
    url: str | None = setting(key="server.url")
    model: str | None = setting(key="server.model")
    api_key_env: str | None = setting(key="server.api_key_env")
    concurrency: int = setting(key="server.concurrency")
    timeout_s: float = setting(key="server.timeout_s")
    max_retries: int = setting(key="server.max_retries")
    backoff_s: float = setting(key="server.backoff_s")
    repetition_threshold: float = setting(key="repetition.threshold")
    drop_repetitive: bool = setting(key="repetition.drop")
    trust_remote_code: bool

    def output_defining(self) -> dict[str, Any]:
        """The settings that change what is generated (not how fast): they decide whether to resume."""
        keys = ["engine", "max_new_tokens", "temperature", "top_p", "thinking", "max_context_tokens", "seed", "model"]
        if self.samples != 1:  # only when set: a journal written before the setting existed stays resumable
            keys.append("samples")
        if self.drop_repetitive:
            keys += ["drop_repetitive", "repetition_threshold"]
        defining = {key: getattr(self, key) for key in keys}
        if self.engine == "hf" and self.temperature > 0:  # the same seed draws other replies under another sampler
            defining["sampler"] = HF_SAMPLER
        return defining

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
