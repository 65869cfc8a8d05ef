"""Regenerate assistant replies with the target itself (synthetic training data).

A drafter learns to predict the target; replies written by other models (ShareGPT is ChatGPT's) teach it
a distribution the target does not produce at serving time. Here every assistant turn is rewritten by the
target, conditioned on the regenerated history; system and user turns are kept. Three engines
(runtime/generation/) share one driver, here: HF `generate`, vLLM's offline engine and any OpenAI-compatible
server.

Loops: a small target decoding greedily often repeats itself until max_new_tokens (on an H200 run, 65 % of
SmolLM2-135M's greedy replies had over 30 % repeated word 4-grams, against 2 % of ShareGPT's). Such replies
are easy to predict, so they lift training accuracy, but they teach little about fresh prompts. Every reply
is measured; the summary counts those over `repetition_threshold`, and `drop_repetitive` ends the
conversation before such a reply instead of keeping it.

Samples: with `samples` N > 1 (and temperature > 0) every conversation is regenerated N times, each kept as
its own conversation (ids `<id>`, `<id>#s2`, ...). Each reply has its own seed (`reply_seed`: regenerate.seed,
the conversation id, the sample, the turn), which the engines draw from (the HF engine per row: hf.py says what
reproduces).

Mixture: `keep_original` keeps each conversation as the data has it, its samples after it (ids `<id>#s1`, ...);
`turns` ends each sample after its first N replies (with a short `max_new_tokens`: the opening of the target's
answer, before a small target's greedy loops set in).

Resume: finished conversations are appended to `<output>.progress.jsonl` as they finish (first line: a
fingerprint of the input and the settings). A rerun after a kill keeps them and regenerates the rest; a
changed input or setting discards the file. The output is written atomically at the end, in input order.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_pipeline import logs, systemic
from eagle3_pipeline.copying import repeated_ngram_share
from eagle3_pipeline.formats import conversation_shards, journal
from eagle3_pipeline.logs import Progress
from eagle3_pipeline.runtime.generation import (  # noqa: F401 - the engines' errors, part of this stage's contract
    Engine,
    Prompt,
    Reply,
    RequestRejected,
    ServerUnavailable,
    Settings,
    open_engine,
    tokenize_histories,
)
from eagle3_pipeline.runtime.generation.conversation import InProgress
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.tokenization import TemplateError, character_bound

# a round's histories as prompts: generation.tokenize_histories with the run's tokenizer and limits
Prepare = Callable[[list[list[dict[str, str]]]], list[Prompt | TemplateError | None]]


def reply_seed(seed: int, conversation_id: str, sample: int, turn: int) -> int:
    """The seed of one reply: a hash of regenerate.seed, the conversation, the sample and the turn, so it does not
    depend on where the conversation sits in its shard or batch. 31 bits: every server takes it."""
    digest = hashlib.sha256(json.dumps([seed, conversation_id, sample, turn]).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFF_FFFF


def regenerate_conversations(conversations: list[dict[str, Any]], engine: Engine, settings: Settings,
                             prepare: Prepare, progress_path: Path, fingerprint: str, log: logging.Logger,
                             pool_size: int, rolling: bool = True) -> tuple[list[dict[str, Any]], Counter]:
    """Regenerate every conversation `settings.samples` times; resumable through `progress_path`. Returns the kept
    conversations (in input order, a conversation's samples together, after the conversation itself with
    keep_original) and the counts (`kept`: the regenerated samples kept).

    Up to `pool_size` conversations are in progress; every round asks the engine for the next reply of each.
    `rolling` refills the pool as conversations finish, so rounds stay full whatever the number of turns;
    without it the pool is refilled only when empty (chunks wait for their longest conversation)."""
    work = [(i, sample) for i in range(len(conversations)) for sample in range(1, settings.samples + 1)]
    finished = _load_progress(progress_path, fingerprint, log)
    counts: Counter = Counter(resumed=len(finished))
    waiting = deque(i for i in range(len(work)) if i not in finished)
    log.info("%d conversations x %d samples, %d already done (resumed), %d to regenerate", len(conversations),
             settings.samples, len(finished), len(waiting))
    progress = Progress(log, "regenerate", len(waiting))
    active: list[InProgress] = []
    with open(progress_path, "a", encoding="utf-8") as sink:
        if progress_path.stat().st_size == 0:
            journal.append(sink, [{"fingerprint": fingerprint}])
        while waiting or active:
            if rolling or not active:
                while waiting and len(active) < pool_size:
                    index = waiting.popleft()
                    conversation, sample = work[index]
                    active.append(InProgress(index, conversations[conversation], sample, settings.turns,
                                             settings.keep_original))
            tokens = _advance(active, engine, settings, prepare, counts, log)
            done = [state for state in active if state.done]
            for state in done:
                finished[state.index] = state.record()
            if done:
                journal.append(sink, ({"index": state.index, **finished[state.index]} for state in done))
            active = [state for state in active if not state.done]
            progress.update(len(done), tokens)
    progress.finish()
    counts.update(f"dropped_{record['dropped']}" for record in finished.values() if "dropped" in record)
    counts["kept"] = sum("conversation" in record for record in finished.values())
    counts["originals_kept"] = len(conversations) if settings.keep_original else 0
    return _in_input_order(conversations, work, finished, settings.keep_original), counts


def _in_input_order(conversations: list[dict[str, Any]], work: list[tuple[int, int]],
                    finished: dict[int, dict[str, Any]], keep_original: bool) -> list[dict[str, Any]]:
    """The output: each conversation's kept samples in order, after the conversation itself with keep_original."""
    kept: list[dict[str, Any]] = []
    for index, (conversation, sample) in enumerate(work):
        if keep_original and sample == 1:
            kept.append(conversations[conversation])
        if "conversation" in finished[index]:
            kept.append(finished[index]["conversation"])
    return kept


def _advance(active: list[InProgress], engine: Engine, settings: Settings, prepare: Prepare, counts: Counter,
             log: logging.Logger) -> int:
    """One round: the next reply of every active conversation; each is marked done with its last reply."""
    candidates = [(state, history) for state in active if (history := state.next_history()) is not None]
    asking, prompts = [], []
    for (state, _), prompt in zip(candidates, prepare([history for _, history in candidates]), strict=True):
        if isinstance(prompt, TemplateError):
            log.warning("conversation %s: %s", state.id, prompt)
            if any(message["role"] == "assistant" for message in state.messages):
                counts["cut_at_template_error"] += 1  # a later turn the template refuses: keep the replies so far
                state.end_before_last_turn()
            else:
                state.dropped, state.done = "template_error", True
            continue
        if prompt is None or len(prompt.token_ids) + settings.max_new_tokens > settings.max_context_tokens:
            counts["cut_at_context_limit"] += 1
            state.end_before_last_turn()  # the user turn would not fit
            continue
        asking.append(state)
        prompts.append(prompt)
    if not asking:
        return 0
    generated = 0
    seeds = [reply_seed(settings.seed, state.source["id"], state.sample, len(state.messages)) for state in asking]
    for state, reply in zip(asking, engine.reply(prompts, seeds), strict=True):
        if isinstance(reply, RequestRejected):
            log.warning("conversation %s: rejected: %s", state.id, reply)
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
        # done in the round of its last reply: its slot refills at once and the progress line counts it now
        state.done = not state.has_turn_left()
    return generated


def warn_if_repetitive(counts: Counter, settings: Settings, log: logging.Logger) -> None:
    replies = counts["replies"] + counts["cut_at_repetitive_reply"]
    looping = counts["replies_repetitive"] + counts["cut_at_repetitive_reply"]
    if replies and looping / replies > 0.2:
        log.warning("%d of %d replies (%.0f %%) repeat over %.0f %% of their word 4-grams: the target loops (greedy "
                    "decoding of a small model does); such data lifts training accuracy more than acceptance. "
                    "Consider regenerate.temperature > 0 or regenerate.repetition.drop: true", looping, replies,
                    100 * looping / replies, 100 * settings.repetition_threshold)


def _load_progress(path: Path, fingerprint: str, log: logging.Logger) -> dict[int, dict[str, Any]]:
    """Finished conversations from an earlier, killed run of the same job."""
    finished = {record.pop("index"): record for record in journal.resume(path, fingerprint, log)}
    if finished:
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


def run_shard(conversation_file: Path, output: Path, target_dir: Path, settings: Settings,
              log: logging.Logger) -> dict[str, Any]:
    """The `regenerate` rule: one conversation shard in, one regenerated shard out (atomic)."""
    from eagle3_pipeline.formats.target_dir import read_identity
    from eagle3_pipeline.runtime.target.loading import load_tokenizer

    identity = read_identity(target_dir)["content_hash"]
    tokenizer = load_tokenizer(target_dir, settings.trust_remote_code)
    bound = character_bound(tokenizer, settings.max_context_tokens)

    def prepare(histories: list[list[dict[str, str]]]) -> list[Prompt | TemplateError | None]:
        return tokenize_histories(tokenizer, histories, settings.template_kwargs(), bound)

    engine, pool_size = open_engine(target_dir, settings, log)
    source = conversation_shards.read(conversation_file)
    progress_path = output.with_name(output.name + ".progress.jsonl")
    kept, counts = regenerate_conversations(source, engine, settings, prepare, progress_path,
                                            fingerprint(conversation_file, settings, identity), log, pool_size)
    warn_if_repetitive(counts, settings, log)
    systemic.check("regenerate", str(conversation_file), len(source) * settings.samples, counts["kept"],
                   {key: counts[key] for key in REGENERATE_FIXES}, REGENERATE_FIXES, "see the warnings above")
    conversation_shards.write(output, kept)
    progress_path.unlink()
    summary = {"conversations_in": len(source), **{key: int(value) for key, value in sorted(counts.items())}}
    log.info("wrote %s: %s", output, summary)
    return summary


def run(conversation_file: Path, target_dir: Path, output: Path, settings: Settings,
        log: logging.Logger) -> dict[str, Any]:
    return run_shard(conversation_file, output, target_dir, settings, log)


def regenerate_settings(section: dict[str, Any], max_seq_len: int, trust_remote_code: bool = False) -> Settings:
    """The `regenerate` section as the engines read it; max_context_tokens null means data.max_seq_len."""
    return from_section(Settings, {**Settings.NEUTRAL, **section}, trust_remote_code=trust_remote_code,
                        max_context_tokens=section["max_context_tokens"] or max_seq_len)


def run_from_snakemake(snakemake: Any) -> None:
    import torch

    log = logs.setup(snakemake.log[0])
    torch.set_num_threads(snakemake.threads)
    params = snakemake.params
    settings = regenerate_settings(params.regenerate, params.max_seq_len, params.trust_remote_code)
    run(Path(snakemake.input.conversations), Path(snakemake.input.target), Path(snakemake.output[0]), settings, log)
