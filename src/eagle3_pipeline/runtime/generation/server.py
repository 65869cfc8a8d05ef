"""The server engine: chat completions from any OpenAI-compatible server (SGLang, vLLM, llama.cpp), with bounded
concurrency, retries with backoff and timeouts."""

from __future__ import annotations

import json
import logging
import os
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eagle3_pipeline.runtime.generation import Prompt, Reply, RequestRejected, ServerUnavailable, Settings

RETRIED_HTTP_CODES = {408, 409, 425, 429, 500, 502, 503, 504}


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

    def reply(self, prompts: list[Prompt], seeds: list[int]) -> list[Reply | RequestRejected]:
        """The server renders the chat template itself: each request sends the prompt's messages."""
        futures = [self.pool.submit(self._one, prompt.messages, seed)
                   for prompt, seed in zip(prompts, seeds, strict=True)]
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
