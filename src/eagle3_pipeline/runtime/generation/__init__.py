"""Generation with the target for data regeneration: the engines' settings and what they return. The engines:
`hf.HFEngine` (HF `generate`, batched, left padded; CPU or GPU), `vllm_local.VLLMEngine` (vLLM's offline engine in
the job's own process: continuous batching and prefix caching on a GPU, no server to run) and
`server.OpenAIEngine` (any OpenAI-compatible server: SGLang, vLLM, llama.cpp; bounded concurrency, retries with
backoff and timeouts). The settings are the `regenerate` rule's (stages/regenerate.py drives the engines, a pool
of `conversation.InProgress` at a time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from eagle3_pipeline.settings import setting
from eagle3_pipeline.tokenization import TemplateError, render

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
    keep_original: bool  # the data's conversation stays beside its regenerated samples
    turns: int | None  # replies regenerated per conversation (the sample ends after them); None = every turn
    thinking: bool | None
    max_context_tokens: int
    batch_size: int
    compile: str | bool  # hf: static caches and a compiled decode step (auto: on CUDA); vllm: false = eager
    gpu_memory_utilization: float  # vllm: the share of the GPU's memory that must be free at its start
    kv_cache_gb: float | None  # vllm: a KV cache of this size, not sized by profiling
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
    # settings added after runs were regenerated, at the value that regenerates as before: left out of the rule's
    # params at that value (Snakemake's params trigger would rerun finished jobs) and filled in from here
    NEUTRAL: ClassVar[dict[str, object]] = {"keep_original": False, "turns": None}

    def output_defining(self) -> dict[str, Any]:
        """The settings that change what is generated (not how fast): they decide whether to resume."""
        keys = ["engine", "max_new_tokens", "temperature", "top_p", "thinking", "max_context_tokens", "seed", "model"]
        if self.samples != 1:  # only when set: a journal written before the setting existed stays resumable
            keys.append("samples")
        if self.engine != "openai" and self.dtype != "auto":  # the in-job engines' precision rounds near ties
            keys.append("dtype")  # another way (auto: as before dtype counted, so such journals stay resumable)
        if self.drop_repetitive:
            keys += ["drop_repetitive", "repetition_threshold"]
        keys += [key for key in ("keep_original", "turns") if getattr(self, key)]  # ids and lengths change
        defining = {key: getattr(self, key) for key in keys}
        if self.engine == "hf" and self.temperature > 0:  # the same seed draws other replies under another sampler
            defining["sampler"] = HF_SAMPLER
        if self.engine == "vllm" and self.temperature > 0:
            from importlib.metadata import PackageNotFoundError, version

            try:
                defining["sampler"] = f"vllm {version('vllm')}"
            except PackageNotFoundError:  # the engine says so when it starts
                defining["sampler"] = "vllm"
        return defining

    def template_kwargs(self) -> dict[str, Any]:
        return template_kwargs(self.thinking)


def template_kwargs(thinking: bool | None) -> dict[str, Any]:
    """What the chat template is given beside the history: `regenerate.thinking` (None: the template's default)."""
    return {} if thinking is None else {"enable_thinking": thinking}


@dataclass
class Reply:
    text: str
    finished: bool  # ended by the model (end of turn), not by max_new_tokens
    tokens: int


class RequestRejected(ValueError):
    """The engine refused this one conversation (e.g. a 400 from the server): skip it, count it."""


class ServerUnavailable(RuntimeError):
    """The server kept failing after every retry: stop the job; finished conversations are kept."""


@dataclass(frozen=True)
class Prompt:
    """A history to reply to: its messages (what an OpenAI-compatible server takes) and the same rendered with the
    chat template and tokenized (what the local engines feed the target), rendered once, where its length is checked
    against the context limit."""
    messages: list[dict[str, str]]
    token_ids: list[int]


class Engine(Protocol):
    def reply(self, prompts: list[Prompt], seeds: list[int]) -> list[Reply | RequestRejected]:
        ...


def tokenize_histories(tokenizer: Any, histories: list[list[dict[str, str]]], template_kwargs: dict[str, Any],
                       max_characters: int) -> list[Prompt | TemplateError | None]:
    """Each history as a Prompt (one batched tokenizer call for all), its TemplateError where the chat template
    fails on it, or None where its content alone is over `max_characters` (surely too long: no need to tokenize
    megabytes to know it)."""
    results: list[Prompt | TemplateError | None] = []
    texts, rendered = [], []
    for history in histories:
        if sum(len(message["content"]) for message in history) > max_characters:
            results.append(None)
            continue
        try:
            texts.append(render(tokenizer, history, True, **template_kwargs))
        except TemplateError as exc:
            results.append(exc)
            continue
        rendered.append(len(results))
        results.append(None)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for index, ids in zip(rendered, encoded, strict=True):
        results[index] = Prompt(list(histories[index]), list(ids))
    return results


def stop_token_ids(tokenizer: Any, configured: int | list[int] | None) -> list[int]:
    """The tokens that end a reply: the tokenizer's end of sequence and the generation config's (a chat model's end
    of turn is often only there)."""
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({i for i in [tokenizer.eos_token_id, *configured] if i is not None})


def decode_reply(tokenizer: Any, tokens: list[int], stop_ids: list[int]) -> Reply:
    """A reply from its generated tokens: up to the first stop token (finished) or all of them (cut)."""
    stop_at = next((i for i, token in enumerate(tokens) if token in stop_ids), None)
    kept = tokens if stop_at is None else tokens[:stop_at]
    text = tokenizer.decode(kept, skip_special_tokens=True).strip()
    return Reply(text, finished=stop_at is not None, tokens=len(kept))


def open_engine(target_dir: Any, settings: Settings, log: Any) -> tuple[Engine, int]:
    """The configured engine and how many conversations to keep in progress for it (each round asks it for the next
    reply of each: enough for full batches while some conversations finish)."""
    if settings.engine == "hf":
        from eagle3_pipeline.runtime.generation.hf import HFEngine

        engine: Any = HFEngine(target_dir, settings, settings.trust_remote_code, log)
        log.info("engine: HF generate on %s, batch %d, %s", engine.device, settings.batch_size,
                 "compiled over static caches" if engine.compiled else "eager")
        return engine, settings.batch_size * 4
    if settings.engine == "vllm":
        from eagle3_pipeline.runtime.generation.vllm_local import VLLMEngine

        engine = VLLMEngine(target_dir, settings, log)
        return engine, settings.batch_size * 16  # queued histories cost vLLM nothing; a round ends with its longest
    from eagle3_pipeline.runtime.generation.server import OpenAIEngine

    engine = OpenAIEngine(settings, log)
    log.info("engine: OpenAI-compatible server %s, model %s, concurrency %d", engine.endpoint,
             settings.model or "default", settings.concurrency)
    return engine, settings.concurrency * 4
