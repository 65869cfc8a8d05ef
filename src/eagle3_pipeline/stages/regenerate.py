"""Regenerate assistant replies with the target itself (synthetic training data).

A drafter learns to predict the target; replies written by other models (ShareGPT is ChatGPT's) teach it
a distribution the target does not produce at serving time. Here every assistant turn is rewritten by the
target, conditioned on the regenerated history; system and user turns are kept. Two engines share one
driver: HF `generate` (batched, left padded; CPU or GPU) and any OpenAI-compatible server (SGLang, vLLM,
llama.cpp) with bounded concurrency, retries with backoff and timeouts.

Loops: a small target decoding greedily often repeats itself until max_new_tokens (on an H200 run, 65 % of
SmolLM2-135M's greedy replies had over 30 % repeated word 4-grams, against 2 % of ShareGPT's). Such replies
are easy to predict, so they lift training accuracy, but they teach little about fresh prompts. Every reply
is measured; the summary counts those over `repetition_threshold`, and `drop_repetitive` ends the
conversation before such a reply instead of keeping it.

Resume: finished conversations are appended to `<output>.progress.jsonl` as they finish (first line: a
fingerprint of the input and the settings). A rerun after a kill keeps them and regenerates the rest; a
changed input or setting discards the file. The output is written atomically at the end, in input order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from eagle3_pipeline import systemic
from eagle3_pipeline.formats import conversation_shards, journal
from eagle3_pipeline.logs import Progress
from eagle3_pipeline.tokenization import TemplateError, character_bound, render

RETRIED_HTTP_CODES = {408, 409, 425, 429, 500, 502, 503, 504}


@dataclass
class Settings:
    engine: str = "hf"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    thinking: bool | None = None
    max_context_tokens: int = 2048
    batch_size: int = 16
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    concurrency: int = 8
    timeout_s: float = 300.0
    max_retries: int = 6
    backoff_s: float = 1.0
    repetition_threshold: float = 0.3
    drop_repetitive: bool = False

    @classmethod
    def from_config(cls, section: dict[str, Any], max_seq_len: int) -> Settings:
        server = section.get("server") or {}
        repetition = section.get("repetition") or {}
        return cls(engine=section["engine"], max_new_tokens=section["max_new_tokens"],
                   temperature=section["temperature"], top_p=section["top_p"], thinking=section.get("thinking"),
                   max_context_tokens=section.get("max_context_tokens") or max_seq_len,
                   batch_size=section["batch_size"], seed=section["seed"], device=section["device"],
                   dtype=section["dtype"], url=server.get("url"), model=server.get("model"),
                   api_key_env=server.get("api_key_env"), concurrency=server.get("concurrency", 8),
                   timeout_s=server.get("timeout_s", 300.0), max_retries=server.get("max_retries", 6),
                   backoff_s=server.get("backoff_s", 1.0),
                   repetition_threshold=repetition.get("threshold", 0.3), drop_repetitive=repetition.get("drop", False))

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


# ---------------------------------------------------------------------------------------------- engines
class HFEngine:
    """Batched `generate` on the target directory; histories sorted by length so padding stays small."""

    def __init__(self, target_dir: Path, settings: Settings, trust_remote_code: bool = False):
        import torch

        from eagle3_pipeline.runtime.backends.hf import pick_device
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


# ---------------------------------------------------------------------------------------------- driver
@dataclass
class _InProgress:
    index: int
    source: dict[str, Any]
    messages: list[dict[str, str]] = field(default_factory=list)
    cursor: int = 0
    dropped: str | None = None
    done: bool = False

    def next_history(self) -> list[dict[str, str]] | None:
        """Copy kept turns up to the next point where the assistant speaks; None when nothing is left."""
        original = self.source["messages"]
        while self.cursor < len(original) and original[self.cursor]["role"] != "assistant":
            self.messages.append(dict(original[self.cursor]))
            self.cursor += 1
        self.cursor += 1  # skip the original reply (or run past the end)
        if self.messages and self.messages[-1]["role"] == "user":  # a trailing user turn gets a reply too
            return self.messages
        self.done = True
        return None

    def end_before_last_turn(self) -> None:
        """Stop here, without the user turn just asked (it and everything after it are left out)."""
        self.messages.pop()
        self.done = True


def regenerate_conversations(conversations: list[dict[str, Any]], engine: Engine, settings: Settings,
                             count_tokens: Any, progress_path: Path, fingerprint: str, log: logging.Logger,
                             pool_size: int, rolling: bool = True) -> tuple[list[dict[str, Any]], Counter]:
    """Regenerate every conversation; resumable through `progress_path`. Returns kept conversations + counts.

    Up to `pool_size` conversations are in progress; every round asks the engine for the next reply of each.
    `rolling` refills the pool as conversations finish, so rounds stay full whatever the number of turns;
    without it the pool is refilled only when empty (chunks wait for their longest conversation)."""
    finished = _load_progress(progress_path, fingerprint, log)
    counts: Counter = Counter(resumed=len(finished))
    waiting = deque(i for i in range(len(conversations)) if i not in finished)
    log.info("%d conversations, %d already done (resumed), %d to regenerate", len(conversations),
             len(finished), len(waiting))
    progress = Progress(log, "regenerate", len(waiting))
    active: list[_InProgress] = []
    with open(progress_path, "a", encoding="utf-8") as sink:
        if progress_path.stat().st_size == 0:
            journal.append(sink, [{"fingerprint": fingerprint}])
        while waiting or active:
            if rolling or not active:
                while waiting and len(active) < pool_size:
                    index = waiting.popleft()
                    active.append(_InProgress(index, conversations[index]))
            tokens = _advance(active, engine, settings, count_tokens, counts, log)
            done = [state for state in active if state.done]
            for state in done:
                finished[state.index] = _finished_record(state)
            if done:
                journal.append(sink, ({"index": state.index, **finished[state.index]} for state in done))
            active = [state for state in active if not state.done]
            progress.update(len(done), tokens)
    progress.finish()
    kept = [finished[i]["conversation"] for i in range(len(conversations)) if "conversation" in finished[i]]
    counts["kept"] = len(kept)
    counts.update(f"dropped_{record['dropped']}" for record in finished.values() if "dropped" in record)
    return kept, counts


def _advance(active: list[_InProgress], engine: Engine, settings: Settings, count_tokens: Any, counts: Counter,
             log: logging.Logger) -> int:
    """One round: the next reply of every active conversation (those with nothing left are marked done)."""
    asking, histories = [], []
    for state in active:
        history = state.next_history()
        if history is None:
            continue
        try:
            context = count_tokens(history)
        except TemplateError as exc:
            state.dropped, state.done = "template_error", True
            log.warning("conversation %s: %s", state.source["id"], exc)
            continue
        if context + settings.max_new_tokens > settings.max_context_tokens:
            counts["cut_at_context_limit"] += 1
            state.end_before_last_turn()  # the user turn would not fit
            continue
        asking.append(state)
        histories.append(list(history))
    if not asking:
        return 0
    generated = 0
    seeds = [settings.seed * 1_000_003 + state.index * 101 + len(state.messages) for state in asking]
    for state, reply in zip(asking, engine.reply(histories, seeds), strict=True):
        if isinstance(reply, RequestRejected):
            log.warning("conversation %s (record %d): rejected: %s", state.source["id"], state.index, reply)
            state.dropped, state.done = "rejected_by_engine", True
            continue
        generated += reply.tokens
        if not reply.text:
            counts["empty_reply"] += 1
            state.end_before_last_turn()
            continue
        repetitive = repeated_ngram_share(reply.text) > settings.repetition_threshold
        if repetitive and settings.drop_repetitive:
            counts["cut_at_repetitive_reply"] += 1
            state.end_before_last_turn()
            continue
        counts["replies"] += 1
        counts["replies_repetitive"] += repetitive
        counts["replies_cut_at_max_new_tokens"] += not reply.finished
        state.messages.append({"role": "assistant", "content": reply.text})
    return generated


def repeated_ngram_share(text: str, n: int = 4) -> float:
    """Share of the reply's word n-grams that already occurred earlier in it (0 for a reply with none)."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def warn_if_repetitive(counts: Counter, settings: Settings, log: logging.Logger) -> None:
    replies = counts["replies"] + counts["cut_at_repetitive_reply"]
    looping = counts["replies_repetitive"] + counts["cut_at_repetitive_reply"]
    if replies and looping / replies > 0.2:
        log.warning("%d of %d replies (%.0f %%) repeat over %.0f %% of their word 4-grams: the target loops (greedy "
                    "decoding of a small model does); such data lifts training accuracy more than acceptance. "
                    "Consider regenerate.temperature > 0 or regenerate.repetition.drop: true", looping, replies,
                    100 * looping / replies, 100 * settings.repetition_threshold)


def _finished_record(state: _InProgress) -> dict[str, Any]:
    while state.messages and state.messages[-1]["role"] != "assistant":
        state.messages.pop()  # a trailing user turn without a reply teaches nothing
    if state.dropped is None and not any(m["role"] == "assistant" for m in state.messages):
        state.dropped = "no_reply"
    if state.dropped:
        return {"dropped": state.dropped, "id": state.source["id"]}
    return {"conversation": {**state.source, "messages": state.messages}}


def _load_progress(path: Path, fingerprint: str, log: logging.Logger) -> dict[int, dict[str, Any]]:
    """Finished conversations from an earlier, killed run of the same job; a torn last line is ignored."""
    if not path.exists():
        return {}
    lines, intact_bytes = journal.read_intact(path)
    header = lines[0] if lines and isinstance(lines[0], dict) else {}
    if header.get("fingerprint") != fingerprint:
        log.warning("%s: written for other input or settings; starting over", path)
        path.unlink()
        return {}
    finished = {record.pop("index"): record for record in lines[1:]}
    with open(path, "r+b") as handle:  # drop the torn tail so appends start on a clean line
        handle.truncate(intact_bytes)
    log.info("%s: resuming with %d finished conversations", path, len(finished))
    return finished


def fingerprint(conversation_file: Path, settings: Settings, target_identity: str) -> str:
    digest = hashlib.sha256(Path(conversation_file).read_bytes())
    digest.update(json.dumps(settings.output_defining(), sort_keys=True).encode())
    digest.update(target_identity.encode())
    return digest.hexdigest()[:24]


REGENERATE_FIXES = {
    "dropped_template_error": "set target.chat_template (a Jinja template file, or a built-in name: chatml)",
    "dropped_rejected_by_engine": "check regenerate.server.model and the server's limits (the log shows the "
                                  "first rejection)",
    "dropped_no_reply": "raise regenerate.max_context_tokens (the first turn does not fit) or "
                        "regenerate.max_new_tokens (empty replies)",
}


def run_shard(conversation_file: Path, output: Path, target_dir: Path, settings: Settings, log: logging.Logger,
              trust_remote_code: bool = False) -> dict[str, Any]:
    """The `regenerate` rule: one conversation shard in, one regenerated shard out (atomic)."""
    from eagle3_pipeline.formats.target_dir import read_identity
    from eagle3_pipeline.runtime.loading import load_tokenizer

    identity = read_identity(target_dir)["content_hash"]
    tokenizer = load_tokenizer(target_dir, trust_remote_code)

    bound = character_bound(tokenizer, settings.max_context_tokens)

    def count_tokens(history: list[dict[str, str]]) -> int:
        if sum(len(m["content"]) for m in history) > bound:
            return bound  # surely over max_context_tokens: no need to tokenize megabytes to know it
        text = render(tokenizer, history, True, **settings.template_kwargs())
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    if settings.engine == "hf":
        engine: Engine = HFEngine(target_dir, settings, trust_remote_code)
        pool_size = settings.batch_size * 4
        log.info("engine: HF generate on %s, batch %d", engine.device, settings.batch_size)
    else:
        engine = OpenAIEngine(settings, log)
        pool_size = settings.concurrency * 4
        log.info("engine: OpenAI-compatible server %s, model %s, concurrency %d", engine.endpoint,
                 settings.model or "default", settings.concurrency)
    source = conversation_shards.read(conversation_file)
    progress_path = output.with_name(output.name + ".progress.jsonl")
    kept, counts = regenerate_conversations(source, engine, settings, count_tokens, progress_path,
                                            fingerprint(conversation_file, settings, identity), log, pool_size)
    warn_if_repetitive(counts, settings, log)
    systemic.check("regenerate", str(conversation_file), len(source), len(kept),
                   {key: counts[key] for key in REGENERATE_FIXES}, REGENERATE_FIXES, "see the warnings above")
    conversation_shards.write(output, kept)
    progress_path.unlink()
    summary = {"conversations_in": len(source), **{key: int(value) for key, value in sorted(counts.items())}}
    log.info("wrote %s: %s", output, summary)
    return summary
