"""Greedy speculative decoding with the HF target and the exported drafter: acceptance length and speed.

Methods, all in one run on the same prompts: `target` (plain greedy, the speed baseline and the
reference output), `eagle3` (our exported drafter), `eagle3-untrained` (same shape, random weights) and
`prompt-lookup` (n-gram drafts copied from the context). In fp32 every speculative method must reproduce the
target's greedy tokens exactly (lossless); a mismatch raises naming the prompt. In bf16/fp16 a (k+1)-token
verify may round differently from a one-token step at a near tie: the share of prompts that diverged and
where is reported instead.

Per verify step the target processes [next token, d1..dk] in one forward (KV cache), accepts the longest
prefix of drafts equal to its own argmax, and adds one bonus token: tau = tokens per target forward.
The drafter keeps its own KV cache of real (target-feature) rows; chain rows are dropped after each verify.

Resume: every finished prompt (all its methods' traces) is appended to `<output>.progress/`; a rerun after a
kill decodes only the prompts not there. A fingerprint of the drafter's weights, the target and the
output-defining settings guards it: anything else changed starts over.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_pipeline.drafter.attention import DecodeKV, StaticKV
from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.formats import journal
from eagle3_pipeline.logs import Progress
from eagle3_pipeline.runtime.decode import TargetRuntime


class LosslessViolation(AssertionError):
    pass


@dataclass
class Prompt:
    prompt_id: str
    messages: list[dict[str, str]]


@dataclass
class Trace:
    prompt_id: str
    method: str
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step
    drafted: list[int] = field(default_factory=list)  # drafts proposed per verify step
    target_forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Tokens per target forward after the prefill (the bonus token included)."""
        return len(self.tokens) / max(self.target_forwards, 1)


# ---------------------------------------------------------------- prompts

def load_prompts(path: Path, limit: int | None, multi_turn: bool = False) -> list[Prompt]:
    """MT-bench `question.jsonl` (turns), held-out conversations (messages), {"id", "prompt"} lines or HumanEval
    problems ({"task_id", "prompt"}: a Python signature and docstring to complete); gzipped when *.gz."""
    prompts = []
    opener = gzip.open if Path(path).suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            record = json.loads(line)
            prompt_id = str(record.get("question_id", record.get("id", index)))
            if "turns" in record:
                turns = record["turns"] if multi_turn else record["turns"][:1]
                prompts.append(Prompt(prompt_id, [{"role": "user", "content": t} for t in turns]))
            elif "messages" in record:
                messages = record["messages"]
                first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
                prompts.append(Prompt(prompt_id, messages[:first_reply]))
            elif "task_id" in record and "prompt" in record:
                prompt_id = str(record["task_id"])
                content = f"Complete this Python function.\n\n```python\n{record['prompt']}```"
                prompts.append(Prompt(prompt_id, [{"role": "user", "content": content}]))
            elif "prompt" in record:
                prompts.append(Prompt(prompt_id, [{"role": "user", "content": record["prompt"]}]))
            else:
                raise ValueError(f"{path} line {index + 1}: no 'turns', 'messages' or 'prompt'")
            if limit and len(prompts) >= limit:
                break
    return prompts


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- decoding loops

def greedy(target: TargetRuntime, prompt_ids: list[int], max_new: int, eos: set[int], prompt_id: str) -> Trace:
    trace = Trace(prompt_id, "target", [])
    start = time.perf_counter()
    cache = target.new_cache(len(prompt_ids) + max_new)
    logits, _ = target.forward(prompt_ids, cache)
    token = int(logits[-1].argmax())
    trace.tokens.append(token)
    while len(trace.tokens) < max_new and token not in eos:
        logits, _ = target.forward([token], cache)
        trace.target_forwards += 1
        token = int(logits[-1].argmax())
        trace.tokens.append(token)
    synchronize(target.device)
    trace.total_seconds = trace.verify_seconds = time.perf_counter() - start
    trace.target_forwards = max(trace.target_forwards, 1)
    return trace


DraftFn = Callable[[list[int], torch.Tensor, int], list[int]]


class DrafterProposer:
    """Chain drafts from an EAGLE-3 drafter, keeping its KV cache of real rows across verify steps.

    `static`: the cache is a preallocated StaticKV and the verified rows of a step are padded to k + 1, so a
    compiled (`compiled`: CUDA-graph) step sees two shapes only - k + 1 real rows and one chain row. Padding
    rows sit beyond the last real position, where the chain and the next step overwrite them."""

    def __init__(self, drafter: Drafter, static: bool = False, compiled: bool = False, log: Any = None):
        self.drafter = drafter.eval()
        self.device = next(drafter.parameters()).device
        self.cache: DecodeKV | StaticKV | None = None
        self.done = 0  # rows (f_t, x_{t+1}) already in the cache
        self.static = static or compiled
        self.static_cache: StaticKV | None = None
        self.step = torch.compile(drafter.decode, mode="reduce-overhead", dynamic=False) if compiled else None
        self.log = log

    def reset(self) -> None:
        self.cache, self.done = None, 0

    @torch.inference_mode()
    def __call__(self, context: list[int], features: torch.Tensor, k: int) -> list[int]:
        """context = tokens x_0..x_n (x_n not yet seen by the target); features = f_0..f_{n-1}."""
        drafts, _ = self.chain(context, features, k)
        # One device-to-host copy for the whole chain: a sync per draft token would stall the GPU k times
        # (and, with other processes on the GPU, wait for a time slice each time).
        return drafts.tolist()

    @torch.inference_mode()
    def chain(self, context: list[int], features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft target ids [k] and the draft-vocab logits [k, K] they were chosen from.

        Positions as served (vLLM `EagleProposer.propose`, SGLang `draft_forward`): real row p (token x_{p+1},
        feature f_p) at position p; the first draft comes from the last real row (position n-1); chain row i
        (fed draft i) at position n-1+i."""
        n = features.shape[0]
        new = n - self.done
        width = k + 1 if self.static and new <= k + 1 else new
        dtype = self.drafter.fc.weight.dtype
        tokens = context[self.done + 1: n + 1]
        new_tokens = torch.tensor([tokens + [tokens[-1]] * (width - new)], device=self.device)
        positions = torch.arange(self.done, self.done + width, device=self.device)[None]
        hidden = features[self.done:n].to(self.device, dtype)
        if width > new:
            hidden = torch.cat([hidden, hidden[-1:].expand(width - new, -1)])
        hidden = hidden[None]
        if self.static:
            self._reserve(max(self.done + width, n + k))
        logits, hidden, self.cache = self._decode(new_tokens, hidden, positions, compiled=width == k + 1)
        self.done = n
        real = self.cache
        hidden, logits = hidden[:, new - 1:new], logits[0, new - 1]
        token = self.drafter.draft_to_target(logits.argmax())
        drafts, chain_logits = [token], [logits]
        for step in range(1, k):
            position = torch.full((1, 1), n - 1 + step, device=self.device)
            logits, hidden, self.cache = self._decode(token.view(1, 1), hidden, position, compiled=True)
            logits = logits[0, -1]
            token = self.drafter.draft_to_target(logits.argmax())
            drafts.append(token)
            chain_logits.append(logits)
        self.cache = real  # chain rows are speculative; the next call appends the verified real rows
        return torch.stack(drafts), torch.stack(chain_logits)

    def _reserve(self, rows: int) -> None:
        """A static cache of at least `rows` slots (powers of two: few sizes, few recompilations)."""
        if self.static_cache is None or self.static_cache.capacity < rows:
            grown = StaticKV.empty(self.drafter.config, 1 << max(8, (rows - 1).bit_length()), self.device,
                                   self.drafter.fc.weight.dtype)
            if self.static_cache is not None:
                kept = self.static_cache.capacity
                grown.keys[:, :, :kept] = self.static_cache.keys
                grown.values[:, :, :kept] = self.static_cache.values
            self.static_cache = grown
        self.cache = self.static_cache

    def _decode(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, compiled: bool):
        if self.step is None or not compiled:
            return self.drafter.decode(ids, hidden, positions, self.cache)
        try:
            logits, hidden, cache = self.step(ids, hidden, positions, self.cache)
        except Exception as exc:  # no Triton, unsupported op, compiler error: draft eagerly instead
            if self.log is not None:
                self.log.warning("compiled drafter step failed (%s: %s); drafting eagerly", type(exc).__name__,
                                 str(exc)[:300])
            self.step = None  # rows are written at their positions, so running the step again is harmless
            return self.drafter.decode(ids, hidden, positions, self.cache)
        # CUDA-graph outputs are overwritten by the next replay: keep copies
        return logits.clone(), hidden.clone(), cache


def prompt_lookup(max_ngram: int = 3) -> DraftFn:
    """Drafts copied from the context after the most recent earlier match of its last n tokens."""
    def propose(context: list[int], _features: torch.Tensor, k: int) -> list[int]:
        for n in range(max_ngram, 0, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start: start + n] == tail:
                    follow = context[start + n: start + n + k]
                    if follow:
                        return follow
        return []
    return propose


def speculative(target: TargetRuntime, propose: DraftFn, prompt_ids: list[int], k: int, max_new: int, eos: set[int],
                prompt_id: str, method: str) -> Trace:
    trace = Trace(prompt_id, method, [])
    start = time.perf_counter()
    cache = target.new_cache(len(prompt_ids) + max_new + k + 1)
    logits, features = target.forward(prompt_ids, cache)
    context = list(prompt_ids) + [int(logits[-1].argmax())]
    trace.tokens.append(context[-1])
    while len(trace.tokens) < max_new and context[-1] not in eos:
        n = len(context) - 1  # rows the target has seen
        tick = time.perf_counter()
        drafts = propose(context, features, k)[:k]
        synchronize(target.device)
        middle = time.perf_counter()
        logits, new_features = target.forward([context[-1]] + drafts, cache)
        predictions = logits.argmax(-1).tolist()
        synchronize(target.device)
        trace.draft_seconds += middle - tick
        trace.verify_seconds += time.perf_counter() - middle
        trace.target_forwards += 1
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == predictions[accepted]:
            accepted += 1
        trace.accepted.append(accepted)
        trace.drafted.append(len(drafts))
        new = drafts[:accepted] + [predictions[accepted]]
        target.crop(cache, n + accepted + 1)
        features = torch.cat([features, new_features[: accepted + 1]])
        for token in new:
            context.append(token)
            trace.tokens.append(token)
            if token in eos:
                break
    trace.tokens = trace.tokens[:max_new]
    trace.total_seconds = time.perf_counter() - start
    return trace


def untrained_like(drafter: Drafter, seed: int = 0) -> Drafter:
    """The same drafter shape with fresh random weights, sharing the embedding and the vocab mapping."""
    torch.manual_seed(seed)
    untrained = Drafter(drafter.config)
    untrained.load_state_dict({k: v for k, v in drafter.state_dict().items()
                               if k.startswith("embed_tokens") or k in ("d2t", "t2d")}, strict=False)
    return untrained.to(next(drafter.parameters()).device, drafter.fc.weight.dtype).eval()


# ---------------------------------------------------------------- summaries

def acceptance_by_position(traces: list[Trace], k: int) -> list[float]:
    """P(draft i accepted | drafts before it accepted), i = 1..k."""
    reached, accepted = np.zeros(k), np.zeros(k)
    for trace in traces:
        for got, offered in zip(trace.accepted, trace.drafted, strict=True):
            for i in range(min(got + 1, offered)):
                reached[i] += 1
                accepted[i] += i < got
    return [float(a / r) if r else 0.0 for a, r in zip(accepted, reached, strict=True)]


def summarise(traces: list[Trace], k: int) -> dict[str, Any]:
    """The tau pass's figures: they count tokens and target forwards, so they do not depend on timing."""
    tokens = sum(len(t.tokens) for t in traces)
    forwards = sum(t.target_forwards for t in traces)
    return {
        "prompts": len(traces), "tokens": tokens, "k": k,
        "tau": tokens / max(forwards, 1),
        "acceptance_by_position": acceptance_by_position(traces, k),
    }


def timing_summary(traces: list[Trace], baseline: list[Trace]) -> dict[str, Any]:
    """The timing pass's figures: tokens/s, speedup over target-only greedy on the same prompts, and the time
    per verify step spent drafting and verifying (for `target`: per one-token forward)."""
    tokens = sum(len(t.tokens) for t in traces)
    rate = tokens / max(sum(t.total_seconds for t in traces), 1e-9)
    base_rate = sum(len(t.tokens) for t in baseline) / max(sum(t.total_seconds for t in baseline), 1e-9)
    steps = max(sum(t.target_forwards for t in traces), 1)
    return {
        "prompts": len(traces), "tokens": tokens, "tokens_per_s": rate, "speedup_vs_target": rate / base_rate,
        "verify_steps": steps, "draft_ms_per_step": 1000 * sum(t.draft_seconds for t in traces) / steps,
        "verify_ms_per_step": 1000 * sum(t.verify_seconds for t in traces) / steps,
    }


def first_divergence(trace: Trace, reference: Trace) -> int | None:
    """Index of the first token where `trace` differs from the target's own greedy output, None if equal."""
    if trace.tokens == reference.tokens:
        return None
    return next((i for i, (a, b) in enumerate(zip(trace.tokens, reference.tokens, strict=False)) if a != b),
                min(len(trace.tokens), len(reference.tokens)))


def check_lossless(trace: Trace, reference: Trace) -> None:
    at = first_divergence(trace, reference)
    if at is not None:
        raise LosslessViolation(f"prompt {trace.prompt_id}: {trace.method} output differs from the target's greedy "
                                f"output at token {at}")


def divergence(traces: list[Trace], reference: dict[str, Trace]) -> dict[str, Any]:
    """Low precision: the share of prompts whose output left the target's greedy decode, and where. A (k+1)-token
    verify and a one-token step may round differently at a near tie; the speculative run then goes on from its
    own token (tau stays that run's own)."""
    first = {t.prompt_id: at for t in traces if (at := first_divergence(t, reference[t.prompt_id])) is not None}
    return {"diverged_share": len(first) / max(len(traces), 1), "first_divergence": first}


def encode_prompts(tokenizer: Any, prompts: list[Prompt]) -> list[tuple[str, list[int]]]:
    encoded = [(p.prompt_id, tokenizer.apply_chat_template(p.messages, tokenize=True, add_generation_prompt=True,
                                                           return_dict=False)) for p in prompts]
    return [(pid, list(ids["input_ids"] if isinstance(ids, dict) else ids)) for pid, ids in encoded]


def decode_all(target: TargetRuntime, tokenizer: Any, prompts: list[Prompt], drafters: dict[str, Drafter],
               ks: list[int], max_new: int, log: Any, on_prompt: Callable[[dict[str, Trace]], None],
               strict: bool = True) -> None:
    """Every method on every prompt; `on_prompt` gets each prompt's traces by method ("target", "eagle3@k=4",
    ...) as soon as the prompt is done. With `strict` (fp32), lossless is checked here; in low precision
    divergence is counted afterwards (`divergence`).

    Prompts are the outer loop: all methods run on one prompt back to back, so every method is timed under
    the same load (a shared GPU or host speeds up and slows down over a run; ratios stay fair)."""
    eos = end_of_sequence(tokenizer)
    methods = method_table(drafters, ks, target.compiled, log)
    target.prepare(ks)
    progress = Progress(log, "prompts (all methods)", len(prompts))
    for pid, ids in encode_prompts(tokenizer, prompts):
        finished = decode_prompt(target, methods, pid, ids, max_new, eos, strict)
        on_prompt(finished)
        progress.update(1, len(finished["target"].tokens))


def end_of_sequence(tokenizer: Any) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


def method_table(drafters: dict[str, Drafter], ks: list[int], compiled: bool = False, log: Any = None
                 ) -> dict[str, tuple[DraftFn, int]]:
    """The speculative methods by name ("prompt-lookup@k=4", "eagle3@k=4", ...): each with its proposer and k.
    `compiled`: drafters decode with a static cache through a compiled step, like the target."""
    methods: dict[str, tuple[DraftFn, int]] = {}
    for k in ks:
        methods[f"prompt-lookup@k={k}"] = (prompt_lookup(), k)
        for name, drafter in drafters.items():
            if name.endswith("untrained") and k != ks[0]:
                continue  # a baseline near tau=1: one draft length is enough
            methods[f"{name}@k={k}"] = (DrafterProposer(drafter, compiled=compiled, log=log), k)
    return methods


def decode_prompt(target: TargetRuntime, methods: dict[str, tuple[DraftFn, int]], prompt_id: str, ids: list[int],
                  max_new: int, eos: set[int], strict: bool) -> dict[str, Trace]:
    """Target-only greedy, then every method, back to back on one prompt; lossless checked when `strict`."""
    reference = greedy(target, ids, max_new, eos, prompt_id)
    finished = {"target": reference}
    for method, (propose, k) in methods.items():
        if isinstance(propose, DrafterProposer):
            propose.reset()
        finished[method] = trace = speculative(target, propose, ids, k, max_new, eos, prompt_id, method)
        if strict:
            check_lossless(trace, reference)
    return finished


def timing_pass(target: TargetRuntime, tokenizer: Any, prompt_sets: dict[str, list[Prompt]], drafter: Drafter,
                ks: list[int], max_new: int, strict: bool, log: Any) -> dict[str, dict[str, Any]]:
    """Speeds, per prompt set and method, measured in this one process (run it with nothing else of ours on the
    device): every method on the same prompt back to back, after a warm-up run of every method that is not
    counted (it pays for lazy initialisation and, where compiled, for compilation and graph capture)."""
    eos = end_of_sequence(tokenizer)
    methods = method_table({"eagle3": drafter}, ks, target.compiled, log)
    target.prepare(ks)
    encoded = {name: encode_prompts(tokenizer, prompts) for name, prompts in prompt_sets.items()}
    # Size the static caches for the longest prompt before the warm-up: a cache that grew during the run would
    # change the compiled steps' shapes, and their recompilation would be timed.
    capacity = max(len(ids) for prompts in encoded.values() for _, ids in prompts) + max_new + max(ks) + 1
    target.new_cache(capacity)
    for propose, _ in methods.values():
        if isinstance(propose, DrafterProposer) and propose.static:
            propose._reserve(capacity + max(ks))
    warm_up_ids = next(iter(encoded.values()))[0][1]
    decode_prompt(target, methods, "warm-up", warm_up_ids, min(max_new, 16), eos, strict)
    results = {}
    for name, prompts in encoded.items():
        by_method: dict[str, list[Trace]] = {}
        for pid, ids in prompts:
            for method, trace in decode_prompt(target, methods, pid, ids, max_new, eos, strict).items():
                by_method.setdefault(method, []).append(trace)
        results[name] = {method: timing_summary(traces, by_method["target"]) for method, traces in by_method.items()}
        for method, summary in results[name].items():
            log.info("timing pass, %s, %s: %.1f tokens/s, speedup %.2fx, per verify step %.2f ms drafting + %.2f ms "
                     "verifying", name, method, summary["tokens_per_s"], summary["speedup_vs_target"],
                     summary["draft_ms_per_step"], summary["verify_ms_per_step"])
    return results


def summarise_methods(by_method: dict[str, list[Trace]], log: Any) -> dict[str, Any]:
    reference = by_method["target"]
    reference_by_prompt = {t.prompt_id: t for t in reference}
    results: dict[str, Any] = {"target": {"prompts": len(reference), "tokens": sum(len(t.tokens) for t in reference)}}
    for method, traces in by_method.items():
        if method == "target":
            continue
        k = int(method.rsplit("@k=", 1)[1])
        results[method] = summary = summarise(traces, k) | divergence(traces, reference_by_prompt)
        log.info("%s: tau %.3f, acceptance by position %s; %d of %d prompts diverged from the target's greedy "
                 "output%s", method, summary["tau"], [round(a, 3) for a in summary["acceptance_by_position"]],
                 len(summary["first_divergence"]), len(traces),
                 f" (first divergence at token, by prompt: {summary['first_divergence']})"
                 if summary["first_divergence"] else "")
    return results


# ---------------------------------------------------------------- resume after a kill

def prompt_digest(prompt: Prompt) -> str:
    return hashlib.sha256(json.dumps(prompt.messages, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(target_dir: Path, serving_dir: Path, settings: dict[str, Any]) -> str:
    """What decides the traces: the drafter's files, the target and the output-defining settings."""
    from eagle3_pipeline.formats.target_dir import read_identity

    digest = hashlib.sha256(read_identity(target_dir)["content_hash"].encode())
    for path in sorted(Path(serving_dir).iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    defining = {key: settings.get(key) for key in ("dtype", "max_new_tokens", "draft_lengths", "untrained_baseline")}
    digest.update(json.dumps(defining, sort_keys=True).encode())
    return digest.hexdigest()[:24]


class PromptProgress:
    """`<output>.progress/`: a fingerprint file and one append-only JSONL file per writing process (workers
    never share a file, so lines cannot interleave). A torn last line (a kill mid-write) is ignored."""

    def __init__(self, directory: Path, fingerprint: str, log: Any):
        self.directory = Path(directory)
        stamp = self.directory / "fingerprint"
        if self.directory.exists() and (not stamp.exists() or stamp.read_text() != fingerprint):
            log.warning("%s: written for another drafter, target or settings; starting over", self.directory)
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        stamp.write_text(fingerprint)

    def finished(self, prompts: list[Prompt]) -> dict[str, dict[str, Trace]]:
        """Traces by prompt id, for prompts whose text is unchanged."""
        digests = {p.prompt_id: prompt_digest(p) for p in prompts}
        done: dict[str, dict[str, Trace]] = {}
        for part in sorted(self.directory.glob("*.jsonl")):
            for record in journal.read_intact(part)[0]:
                if digests.get(record["prompt_id"]) == record["digest"]:
                    done[record["prompt_id"]] = {m: Trace(**t) for m, t in record["traces"].items()}
        return done

    def appender(self, prompts: list[Prompt]) -> Callable[[dict[str, Trace]], None]:
        """A callback for decode_all writing this process's own file, flushed to disk per prompt."""
        digests = {p.prompt_id: prompt_digest(p) for p in prompts}
        path = self.directory / f"{os.getpid()}-{time.time_ns()}.jsonl"

        def append(traces: dict[str, Trace]) -> None:
            prompt_id = traces["target"].prompt_id
            record = {"prompt_id": prompt_id, "digest": digests[prompt_id],
                      "traces": {m: asdict(t) for m, t in traces.items()}}
            with open(path, "a", encoding="utf-8") as handle:
                journal.append(handle, [record])
        return append


# ---------------------------------------------------------------- the rule's job, optionally in worker processes

def load_models(target_dir: Path, serving_dir: Path, settings: dict[str, Any], trust_remote_code: bool, log: Any,
                timing_pass: bool = False) -> tuple[TargetRuntime, Any, dict[str, Drafter]]:
    """The target runtime (aux capture; compiled where `evaluate.compile` says), its tokenizer and the drafters,
    all loaded from disk as a server would."""
    from eagle3_pipeline.formats.target_dir import read_head
    from eagle3_pipeline.runtime import decode as runtime
    from eagle3_pipeline.runtime.backends.hf import pick_device
    from eagle3_pipeline.stages import export

    device = pick_device(settings["device"])
    dtype = getattr(torch, settings["dtype"])
    embedding, _ = read_head(target_dir)
    drafter = export.load(serving_dir, embedding=embedding.float(), dtype=dtype).to(device)
    drafters = {"eagle3": drafter}
    if settings["untrained_baseline"]:
        drafters["eagle3-untrained"] = untrained_like(drafter)
    target, tokenizer = runtime.load(target_dir, drafter.config.aux_layer_ids, device, dtype,
                                     settings.get("compile", "auto"), timing_pass, trust_remote_code, log)
    return target, tokenizer, drafters


def worker_main(job_path: Path) -> None:
    """One worker process: `python -m eagle3_pipeline.stages.evaluate JOB.json` (see run_job). Its traces go to
    the progress directory, prompt by prompt."""
    from eagle3_pipeline import logs

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    log = logs.setup(job["log"], name=f"evaluate.worker{job['index']}", append=True)
    prompts = [Prompt(**p) for p in job["prompts"]]
    progress = PromptProgress(Path(job["progress_dir"]), job["fingerprint"], log)
    _decode(Path(job["target_dir"]), Path(job["serving_dir"]), prompts, job["settings"], job["trust"],
            progress, log)


def _decode(target_dir: Path, serving_dir: Path, prompts: list[Prompt], settings: dict[str, Any],
            trust_remote_code: bool, progress: PromptProgress, log: Any) -> None:
    target, tokenizer, drafters = load_models(target_dir, serving_dir, settings, trust_remote_code, log)
    decode_all(target, tokenizer, prompts, drafters, settings["draft_lengths"], settings["max_new_tokens"], log,
               on_prompt=progress.appender(prompts), strict=settings["dtype"] == "float32")


def _run_workers(job: dict[str, Any], prompts: list[Prompt], workers: int) -> None:
    """Plain subprocesses (not multiprocessing: its spawn re-runs the rule's script in every child)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="evaluate-") as scratch:
        running = []
        for i in range(workers):
            job_path = Path(scratch) / f"job{i}.json"
            job_path.write_text(json.dumps({**job, "index": i, "prompts": [asdict(p) for p in prompts[i::workers]],
                                            "threads": max(1, torch.get_num_threads() // workers)}))
            running.append(subprocess.Popen([sys.executable, "-m", "eagle3_pipeline.stages.evaluate", str(job_path)]))
        failed = [i for i, process in enumerate(running) if process.wait() != 0]
    if failed:
        raise RuntimeError(f"evaluation workers {failed} failed; their errors are in {job['log']} "
                           "(finished prompts are kept: rerun to resume)")


def run_job(target_dir: Path, serving_dir: Path, prompts: list[Prompt], settings: dict[str, Any],
            trust_remote_code: bool, log_path: str, log: Any, progress_dir: Path) -> dict[str, Any]:
    """Evaluate; with `settings["workers"] > 1`, prompts are split over that many processes sharing the device.

    Decoding a small target is bound by Python and kernel launches, not by the GPU, so workers scale almost
    linearly; each worker times every method on its own prompts under the same load, so ratios stay fair.
    Prompts finished by an earlier, killed run (in `progress_dir`) are not decoded again."""
    stamp = fingerprint(target_dir, serving_dir, settings)
    progress = PromptProgress(progress_dir, stamp, log)
    already = progress.finished(prompts)
    todo = [p for p in prompts if p.prompt_id not in already]
    if len(todo) < len(prompts):
        log.info("resuming: %d of %d prompts already decoded (%s)", len(prompts) - len(todo), len(prompts),
                 progress_dir)
    workers = min(settings.get("workers", 1), len(todo))
    if workers == 1:
        _decode(target_dir, serving_dir, todo, settings, trust_remote_code, progress, log)
    elif workers > 1:
        job = {"target_dir": str(target_dir), "serving_dir": str(serving_dir), "settings": settings,
               "trust": trust_remote_code, "log": log_path, "progress_dir": str(progress_dir),
               "fingerprint": stamp}
        _run_workers(job, todo, workers)
    finished = progress.finished(prompts)
    missing = [p.prompt_id for p in prompts if p.prompt_id not in finished]
    if missing:
        raise RuntimeError(f"{progress_dir}: no traces for prompts {missing[:5]} after decoding")
    by_method: dict[str, list[Trace]] = {}
    for prompt in prompts:
        for method, trace in finished[prompt.prompt_id].items():
            by_method.setdefault(method, []).append(trace)
    from eagle3_pipeline.runtime.backends.hf import pick_device

    return {"pass": "tau", "about": TAU_PASS_ABOUT, "summary": summarise_methods(by_method, log),
            "workers": max(workers, 1), "device": pick_device(settings["device"]),
            "traces": [asdict(t) | {"tau": t.tau} for traces in by_method.values() for t in traces]}


TAU_PASS_ABOUT = ("tau pass: tau, acceptance by position and divergence from every prompt, decoded by parallel "
                  "workers; its per-trace seconds are contended and not a speed measurement (speeds: the timing "
                  "pass)")
TIMING_PASS_ABOUT = ("timing pass: one process on the device after the tau pass, every method on the same prompts "
                     "back to back, warm-up excluded; speeds only (tau: the tau pass)")


def run_timing(target_dir: Path, serving_dir: Path, prompt_sets: dict[str, list[Prompt]], settings: dict[str, Any],
               trust_remote_code: bool, log: Any) -> dict[str, Any]:
    """The timing pass's results JSON: speeds by prompt set and method."""
    from eagle3_pipeline.runtime.backends.hf import pick_device

    target, tokenizer, drafters = load_models(target_dir, serving_dir, settings | {"untrained_baseline": False},
                                              trust_remote_code, log, timing_pass=True)
    timing = settings["timing"]
    sets = timing_pass(target, tokenizer, prompt_sets, drafters["eagle3"], settings["draft_lengths"],
                       timing["max_new_tokens"], settings["dtype"] == "float32", log)
    return {"pass": "timing", "about": TIMING_PASS_ABOUT, "device": pick_device(settings["device"]),
            "dtype": settings["dtype"], "prompts_per_set": timing["prompts"],
            "max_new_tokens": timing["max_new_tokens"], "sets": sets}


if __name__ == "__main__":
    import sys

    worker_main(Path(sys.argv[1]))
