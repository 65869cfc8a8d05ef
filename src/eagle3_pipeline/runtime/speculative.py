"""Greedy speculative decoding with the HF target: the methods, their traces and the figures drawn from them.

Methods, all in one run on the same prompts: `target` (plain greedy, the speed baseline and the
reference output), `eagle3` (our exported drafter), `eagle3-untrained` (same shape, random weights) and
`prompt-lookup` (n-gram drafts copied from the context). In fp32 every speculative method must reproduce the
target's greedy tokens exactly (lossless); a mismatch raises naming the prompt. In bf16/fp16 a (k+1)-token
verify may round differently from a one-token step at a near tie: the share of prompts that diverged and
where is reported instead.

One host loop decodes every method (`decode`, after EAGLE's `eagenerate`): per verify step the method's proposer
drafts (proposers.py: nothing for the target alone, a chain for prompt lookup and EAGLE-3, a tree for
`eagle3-tree(steps=..,topk=..,tokens=..)`, SGLang's settings, tree.py), the target processes [next token, drafts]
in one forward (KV cache), accepts the longest path of drafts equal to its own argmax plus one bonus token, and its
cache keeps those rows: tau = tokens per verify step. A method is a typed value (methods.py `Method`); its name
keys the traces and results. Compiled runtimes decode the target alone, the EAGLE-3 chains and the trees with the
loop's state on the device instead (pipelined.py `decode_on_device`, the same loop's twin; `decode_one` picks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from eagle3_pipeline.drafter.model import Drafter
from eagle3_pipeline.logs import Progress
from eagle3_pipeline.prompts import Prompt
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.methods import PROMPT_LOOKUP, TARGET, Method, TreeSetting
from eagle3_pipeline.runtime.pipelined import DeviceSteps, decode_on_device
from eagle3_pipeline.runtime.proposers import Draft, EagleChain, PromptLookup, Proposer, TargetAlone
from eagle3_pipeline.runtime.traces import Trace, acceptance_length, append_until_eos, prefill, synchronize
from eagle3_pipeline.runtime.tree import TreeDrafter, tree_problem


class LosslessViolation(AssertionError):
    pass


def decode(target: TargetRuntime, proposer: Proposer, prompt_ids: list[int], max_new: int, eos: set[int],
           prompt_id: str, method: str) -> Trace:
    """Decode one prompt with one method: draft, verify, accept, commit, record, until max_new tokens or the end of
    the sequence. The target alone (a proposer drafting nothing) is timed as a whole: its verify time is the total
    (prefill included) and a prompt ended by its prefill counts one forward."""
    trace = Trace(prompt_id, method, [])
    start = time.perf_counter()
    cache, features, context = prefill(target, prompt_ids, max_new, trace)
    while len(trace.tokens) < max_new and context[-1] not in eos:
        tick = time.perf_counter()
        draft = proposer.draft(context, features)
        middle = step_clock(target, proposer)
        predictions, aux = draft.verify(target, cache, context)
        count_forward(trace, proposer, middle - tick, step_clock(target, proposer) - middle)
        path, bonus = draft.accept(predictions)
        features = commit(target, cache, proposer, draft, path, aux, features, len(context) - 1)
        record(trace, context, proposer, draft, path, bonus, eos)
    return finish(trace, target, proposer, start, max_new)


def step_clock(target: TargetRuntime, proposer: Proposer) -> float:
    """Now, once the device has done what was queued (the target alone is not timed per step: 0)."""
    if not proposer.drafting:
        return 0.0
    synchronize(target.device)
    return time.perf_counter()


def count_forward(trace: Trace, proposer: Proposer, draft_seconds: float, verify_seconds: float) -> None:
    trace.target_forwards += 1
    if proposer.drafting:
        trace.draft_seconds += draft_seconds
        if trace.target_forwards == 1:  # the prompt's rows went into the drafter's cache first
            trace.prompt_draft_seconds = draft_seconds
        trace.verify_seconds += verify_seconds


def commit(target: TargetRuntime, cache: Any, proposer: Proposer, draft: Draft, path: list[int], aux: torch.Tensor,
           features: torch.Tensor, n: int) -> torch.Tensor:
    """The target's cache keeps the root's and the accepted path's rows (it had seen n rows); the features, their
    aux rows appended where the proposer drafts from them."""
    kept = draft.commit(target, cache, n, path, aux)
    return torch.cat([features, kept]) if proposer.drafting else features


def record(trace: Trace, context: list[int], proposer: Proposer, draft: Draft, path: list[int], bonus: int,
           eos: set[int]) -> None:
    """The step's tokens (the accepted drafts, then the bonus) into the context and the trace; `accepted`: the path's
    length, `drafted`: the longest path offered (a chain: its length)."""
    if proposer.drafting:
        trace.accepted.append(len(path))
        trace.drafted.append(draft.depth)
    append_until_eos(trace, context, [draft.tokens[node - 1] for node in path] + [bonus], eos)


def finish(trace: Trace, target: TargetRuntime, proposer: Proposer, start: float, max_new: int) -> Trace:
    trace.tokens = trace.tokens[:max_new]
    if proposer.drafting:
        trace.total_seconds = time.perf_counter() - start
        return trace
    synchronize(target.device)
    trace.total_seconds = trace.verify_seconds = time.perf_counter() - start
    trace.target_forwards = max(trace.target_forwards, 1)
    return trace


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
    return {
        "prompts": len(traces), "tokens": sum(len(t.tokens) for t in traces), "k": k,
        "tau": acceptance_length(traces),
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
        # of the drafting, each prompt's first (its rows into the drafter's cache): a per-prompt cost, not a step's
        "prompt_draft_ms_per_prompt": 1000 * sum(t.prompt_draft_seconds for t in traces) / max(len(traces), 1),
        "loop": traces[0].loop if traces else "host",  # device: draft/verify ms are device time, steps overlap
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
               strict: bool = True, trees: tuple[TreeSetting, ...] = (),
               claim: Callable[[int], bool] | None = None) -> None:
    """Every method on every prompt; `on_prompt` gets each prompt's traces by method ("target", "eagle3@k=4",
    ...) as soon as the prompt is done. With `strict` (fp32), lossless is checked here; in low precision
    divergence is counted afterwards (`divergence`). `claim(i)`: whether this process decodes prompt i (worker
    processes sharing the prompts); None: all of them.

    Prompts are the outer loop: all methods run on one prompt back to back, so every method is timed under
    the same load (a shared GPU or host speeds up and slows down over a run; ratios stay fair)."""
    eos = end_of_sequence(tokenizer)
    methods = prepared_methods(target, drafters, ks, log, trees)
    progress = Progress(log, "prompts (all methods)", len(prompts))
    for index, (pid, ids) in enumerate(encode_prompts(tokenizer, prompts)):
        if claim is not None and not claim(index):
            progress.update(1)  # another worker's: the shared list moves on, so this log's share and ETA stay true
            continue
        finished = decode_prompt(target, methods, pid, ids, max_new, eos, strict)
        on_prompt(finished)
        progress.update(1, len(finished[TARGET].tokens))


def end_of_sequence(tokenizer: Any) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


def method_table(drafters: dict[str, Drafter], ks: list[int], compiled: bool = False, log: Any = None,
                 trees: tuple[TreeSetting, ...] = (), static: bool = False) -> dict[Method, Proposer]:
    """The speculative methods (prompt lookup and each drafter's chains at every k, the trained drafter's trees) with
    their proposers. `static` (a static target cache): chain drafters decode with a static cache too; `compiled`:
    their chain is also replayed from a CUDA graph on GPU, as the target's steps are compiled. Trees: the trained
    drafter only, one method per setting."""
    methods: dict[Method, Proposer] = {}
    for k in ks:
        methods[Method(PROMPT_LOOKUP, k)] = PromptLookup(k)
        for name, drafter in drafters.items():
            if name.endswith("untrained") and k != ks[0]:
                continue  # a baseline near tau=1: one draft length is enough
            methods[Method(name, k)] = EagleChain(DrafterProposer(drafter, static, compiled, log), k)
    for setting in trees if "eagle3" in drafters else ():
        tree = Method("eagle3", setting.num_steps, setting)
        methods[tree] = TreeDrafter(drafters["eagle3"], setting, compiled, log)
    return methods


def prepared_methods(target: TargetRuntime, drafters: dict[str, Drafter], ks: list[int], log: Any,
                     trees: tuple[TreeSetting, ...] = ()) -> dict[Method, Proposer]:
    """The method table (trees this runtime can verify) and the target prepared for their step widths."""
    trees = usable_trees(target, trees, log)
    target.prepare(ks, [tree.rows_ahead for tree in trees])
    return method_table(drafters, ks, target.compiled, log, trees, target.static)


def usable_trees(target: TargetRuntime, trees: tuple[TreeSetting, ...], log: Any) -> tuple[TreeSetting, ...]:
    """The tree settings this target runtime can verify (none, with the reason logged, where it cannot)."""
    problem = tree_problem(target) if trees else None
    if problem:
        log.warning("tree methods skipped: %s", problem)
        return ()
    return trees


def decode_prompt(target: TargetRuntime, methods: dict[Method, Proposer], prompt_id: str, ids: list[int],
                  max_new: int, eos: set[int], strict: bool) -> dict[str, Trace]:
    """The target alone, then every method, back to back on one prompt: traces by method name; lossless checked when
    `strict`. Where the runtime keeps its loops on the device (compiled), the target alone, the EAGLE-3 chains and
    trees decode there (pipelined.py); prompt lookup, whose drafting reads the host's context, in the host loop."""
    reference = decode_one(target, TargetAlone(), ids, max_new, eos, prompt_id, TARGET)
    finished = {TARGET: reference}
    for method, proposer in methods.items():
        # static: the drafter's cache of the target's size (an eager target's tau pass: grown as needed)
        proposer.reset(target.cache_size(len(ids) + max_new) if target.static else 0)
        finished[method.name] = trace = decode_one(target, proposer, ids, max_new, eos, prompt_id, method.name)
        if strict:
            check_lossless(trace, reference)
    return finished


def decode_one(target: TargetRuntime, proposer: Proposer, ids: list[int], max_new: int, eos: set[int],
               prompt_id: str, method: str) -> Trace:
    """One prompt with one method, in the device-resident loop where the runtime and the method allow it."""
    if (steps := device_steps(target, proposer)) is not None:
        return decode_on_device(target, steps, ids, max_new, eos, prompt_id, method)
    return decode(target, proposer, ids, max_new, eos, prompt_id, method)


def device_steps(target: TargetRuntime, proposer: Proposer) -> DeviceSteps | None:
    """How `proposer` decodes in the device-resident loop, None for the host loop: a runtime without those loops
    (eager, or turned off), prompt lookup, trees where `target.device_trees` is off."""
    if not (target.static and target.device_loops):
        return None
    return proposer.device_steps(target)


def summarise_methods(by_method: dict[str, list[Trace]], log: Any) -> dict[str, Any]:
    """The tau pass's figures by method name (names as the traces carry them, possibly read back from files)."""
    reference = by_method[TARGET]
    reference_by_prompt = {t.prompt_id: t for t in reference}
    results: dict[str, Any] = {"target": {"prompts": len(reference), "tokens": sum(len(t.tokens) for t in reference)}}
    for method, traces in by_method.items():
        if method == TARGET:
            continue
        value = Method.parse(method)
        results[method] = summary = summarise(traces, value.k) | divergence(traces, reference_by_prompt)
        if flags := value.sglang_flags:
            summary["sglang_flags"] = flags
        log.info("%s: tau %.3f, acceptance by position %s; %d of %d prompts diverged from the target's greedy "
                 "output%s", method, summary["tau"], [round(a, 3) for a in summary["acceptance_by_position"]],
                 len(summary["first_divergence"]), len(traces),
                 f" (first divergence at token, by prompt: {summary['first_divergence']})"
                 if summary["first_divergence"] else "")
    return results
