"""Generation with the target for data regeneration: HF `generate` (batched, left padded; CPU or GPU) or any
OpenAI-compatible server (SGLang, vLLM, llama.cpp) with bounded concurrency, retries with backoff and timeouts.
The settings are the `regenerate` rule's (stages/regenerate.py drives the engines)."""

from __future__ import annotations

import json
import logging
import os
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eagle3_pipeline.tokenization import render

RETRIED_HTTP_CODES = {408, 409, 425, 429, 500, 502, 503, 504}


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


class HFEngine:
    """Batched `generate` on the target directory; histories sorted by length so padding stays small."""

    def __init__(self, target_dir: Path, settings: Settings, trust_remote_code: bool = False):
        import torch

        from eagle3_pipeline.runtime.devices import pick_device
        from eagle3_pipeline.runtime.loading import load_model, load_tokenizer

        self.torch = torch
        device = pick_device(settings.device)
        dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
        self.settings, self.device = settings, device
        self.tokenizer = load_tokenizer(target_dir, trust_remote_code)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_model(target_dir, device, dtype, trust_remote_code)
        configured = self.model.generation_config.eos_token_id
        configured = configured if isinstance(configured, list) else [configured]
        self.stop_ids = sorted({i for i in [self.tokenizer.eos_token_id, *configured] if i is not None})

    def reply(self, histories: list[list[dict[str, str]]], seeds: list[int]) -> list[Reply | RequestRejected]:
        prompts = [render(self.tokenizer, history, True, **self.settings.template_kwargs()) for history in histories]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Reply | RequestRejected] = [RequestRejected("not generated")] * len(prompts)
        for start in range(0, len(order), self.settings.batch_size):
            batch = order[start:start + self.settings.batch_size]
            for index, reply in zip(batch, self._generate([prompts[i] for i in batch], seeds[batch[0]]), strict=True):
                results[index] = reply
        return results

    def _generate(self, prompts: list[str], seed: int) -> list[Reply]:
        torch, settings = self.torch, self.settings
        encoded = self.tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to(self.device)
        sampling = settings.temperature > 0
        if sampling:
            torch.manual_seed(seed)
        with torch.inference_mode():
            output = self.model.generate(
                **encoded, max_new_tokens=settings.max_new_tokens, do_sample=sampling,
                temperature=settings.temperature if sampling else None, top_p=settings.top_p if sampling else None,
                top_k=None, pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.stop_ids)
        new_tokens = output[:, encoded["input_ids"].shape[1]:].tolist()
        replies = []
        for tokens in new_tokens:
            stop_at = next((i for i, token in enumerate(tokens) if token in self.stop_ids), None)
            kept = tokens if stop_at is None else tokens[:stop_at]
            text = self.tokenizer.decode(kept, skip_special_tokens=True).strip()
            replies.append(Reply(text, finished=stop_at is not None, tokens=len(kept)))
        return replies


class OpenAIEngine:
    """Chat completions from an OpenAI-compatible server; one request per history, `concurrency` at a time."""

    def __init__(self, settings: Settings, log: logging.Logger):
        if not settings.url:
            raise ValueError("regenerate.server.url is required for engine 'openai'")
        base = settings.url.rstrip("/")
        self.endpoint = (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"
        self.settings, self.log = settings, log
        self.api_key = os.environ.get(settings.api_key_env, "") if settings.api_key_env else ""
        self.pool = ThreadPoolExecutor(max_workers=settings.concurrency, thread_name_prefix="regenerate")

    def reply(self, histories: list[list[dict[str, str]]], seeds: list[int]) -> list[Reply | RequestRejected]:
        futures = [self.pool.submit(self._one, history, seed) for history, seed in zip(histories, seeds, strict=True)]
        results: list[Reply | RequestRejected] = []
        for future in futures:
            try:
                results.append(future.result())
            except RequestRejected as exc:
                results.append(exc)
        return results

    def request_body(self, history: list[dict[str, str]], seed: int) -> dict[str, Any]:
        settings = self.settings
        body: dict[str, Any] = {"model": settings.model or "default", "messages": history,
                                "max_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                                "top_p": settings.top_p, "seed": seed, "stream": False}
        if settings.thinking is not None:
            body["chat_template_kwargs"] = settings.template_kwargs()
        return body

    def _one(self, history: list[dict[str, str]], seed: int) -> Reply:
        data = json.dumps(self.request_body(history, seed)).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        jitter = random.Random(seed)
        for attempt in range(self.settings.max_retries + 1):
            request = urllib.request.Request(self.endpoint, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.settings.timeout_s) as response:
                    return parse_chat_completion(json.loads(response.read()), self.settings.thinking)
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode(errors="replace")
                if exc.code not in RETRIED_HTTP_CODES:
                    raise RequestRejected(f"HTTP {exc.code} from {self.endpoint}: {detail}") from exc
                problem = f"HTTP {exc.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt == self.settings.max_retries:
                break
            delay = min(60.0, self.settings.backoff_s * 2 ** attempt) * (0.5 + jitter.random())
            self.log.warning("%s (attempt %d of %d); retrying in %.1f s", problem, attempt + 1,
                             self.settings.max_retries + 1, delay)
            time.sleep(delay)
        raise ServerUnavailable(f"{self.endpoint}: still failing after {self.settings.max_retries + 1} attempts "
                                f"({problem}); finished conversations are kept, rerun to resume")


def parse_chat_completion(payload: dict[str, Any], thinking: bool | None) -> Reply:
    try:
        choice = payload["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise RequestRejected(f"response has no choices[0].message: {str(payload)[:300]}") from exc
    text = (message.get("content") or "").strip()
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if thinking and reasoning:  # servers split the thinking out; the training text keeps it where the model wrote it
        text = f"<think>\n{reasoning.strip()}\n</think>\n\n{text}"
    tokens = (payload.get("usage") or {}).get("completion_tokens", 0)
    return Reply(text, finished=choice.get("finish_reason") == "stop", tokens=int(tokens or 0))
