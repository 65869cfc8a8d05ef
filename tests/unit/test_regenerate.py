"""Regeneration: the target's own replies (HF engine on the real SmolLM2), resume, and the server engine's
retries/timeouts/rejections against a real local HTTP server. The llama.cpp server test is opt-in."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import socket
import subprocess
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3_pipeline import assets, copying
from eagle3_pipeline.formats import conversation_shards
from eagle3_pipeline.formats.target_dir import read_identity
from eagle3_pipeline.runtime.generation import tokenize_histories
from eagle3_pipeline.runtime.generation.conversation import sample_id
from eagle3_pipeline.runtime.generation.hf import HFEngine
from eagle3_pipeline.runtime.generation.server import OpenAIEngine
from eagle3_pipeline.stages import regenerate
from eagle3_pipeline.tokenization import TemplateError, render
from tests.conftest import SAFETY_TIMEOUT_S, send_json, wait_for_event
from tests.unit.conftest import CHATS, regeneration_settings, target_prompts, word_prompts

LOG = logging.getLogger("test")

@pytest.fixture(scope="module")
def loaded_engine(target_dir) -> HFEngine:
    return HFEngine(target_dir, regeneration_settings())


@pytest.fixture
def hf_engine(loaded_engine) -> HFEngine:
    """The HF engine on SmolLM2, loaded once for the module; a test may set the settings it generates with (they
    are reset to `regeneration_settings()` before each)."""
    loaded_engine.settings = regeneration_settings()
    return loaded_engine


def test_hf_engine_replies_are_the_targets_greedy_output(tmp_path, hf_engine):
    engine = hf_engine
    kept, counts = regenerate.regenerate_conversations(
        CHATS, engine, engine.settings, target_prompts(engine.tokenizer), tmp_path / "progress.jsonl", "fp", LOG,
        pool_size=8)
    assert [c["id"] for c in kept] == ["a", "b", "c"] and counts["kept"] == 3
    for original, new in zip(CHATS, kept, strict=True):
        kept_turns = [m for m in new["messages"] if m["role"] != "assistant"]
        assert kept_turns == [m for m in original["messages"] if m["role"] != "assistant"]
        assert new["messages"][-1]["role"] == "assistant"
        assert all(m["content"] for m in new["messages"])
    assert sum(m["role"] == "assistant" for m in kept[2]["messages"]) == 2  # the trailing user turn was answered
    assert counts["replies"] == 5
    # Each reply is what the target itself says greedily to the regenerated history, one prompt at a time.
    tokenizer, model = engine.tokenizer, engine.model
    for new in kept:
        messages = new["messages"]
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            ids = tokenizer(render(tokenizer, messages[:k], True), add_special_tokens=False,
                            return_tensors="pt")["input_ids"]
            output = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=engine.stop_ids,
                                    pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
            output = [t for t in output if t not in engine.stop_ids]
            assert message["content"] == tokenizer.decode(output, skip_special_tokens=True).strip()


def test_samples_are_separate_conversations_each_drawn_from_its_own_seed(tmp_path, hf_engine):
    engine = hf_engine
    engine.settings = regeneration_settings(temperature=1.0, samples=2, max_new_tokens=8)

    def sampled(**changes):
        engine.settings = dataclasses.replace(engine.settings, **changes)
        progress = tmp_path / f"progress-{len(list(tmp_path.iterdir()))}.jsonl"
        return regenerate.regenerate_conversations(CHATS[1:], engine, engine.settings, target_prompts(engine.tokenizer),
                                                   progress, "fp",
                                                   LOG, pool_size=8)

    kept, counts = sampled()
    assert [c["id"] for c in kept] == ["b", "b#s2", "c", "c#s2"] and counts["kept"] == 4 and counts["replies"] == 6
    replies = [[m["content"] for m in c["messages"] if m["role"] == "assistant"] for c in kept]
    assert replies[0] != replies[1] and replies[2][0] != replies[3][0]  # the same history, two draws
    assert sampled(batch_size=4)[0] == kept  # the same seeds in other batches (other padding): the same replies
    other_seed = sampled(seed=1)[0]
    assert [c["id"] for c in other_seed] == [c["id"] for c in kept] and other_seed != kept
    assert sample_id("x#2", 3) == "x#2#s3"  # a data.weights copy's samples keep both marks


def test_static_caches_and_padded_batches_give_the_dynamic_caches_replies(hf_engine):
    """The compiled engine's batches (static caches, every batch padded to batch_size rows) reply what the eager
    engine replies: here without compiling, greedy and sampled, three histories in batches of two (the second
    padded), then two in a batch of three (a padding row to drop) after the batch size changed."""
    prompts = target_prompts(hf_engine.tokenizer)([chat["messages"][:1] for chat in CHATS])
    for temperature in (0.0, 1.0):
        hf_engine.settings = regeneration_settings(temperature=temperature)
        eager = hf_engine.reply(prompts, [1, 2, 3])
        hf_engine.static = True
        try:
            static = hf_engine.reply(prompts, [1, 2, 3])
            hf_engine.settings = regeneration_settings(temperature=temperature, batch_size=3)
            pair = hf_engine.reply(prompts[:2], [1, 2])  # rows h1, h2 and a copy of h2: the copy is dropped
        finally:
            hf_engine.static = False
        assert [reply.text for reply in static] == [reply.text for reply in eager]
        assert [reply.text for reply in pair] == [reply.text for reply in eager[:2]] and eager[0].text != eager[1].text
        assert all(reply.tokens > 0 for reply in static)
    # the smallest static size held these histories and 10 new tokens, for each batch; generate filled them
    assert sorted(hf_engine.caches) == [(2, 512), (3, 512)]
    assert all(int(cache.get_seq_length()) > 10 for cache in hf_engine.caches.values())


def test_a_failed_compiled_generate_goes_on_eagerly_and_gives_back_the_static_caches(hf_engine, caplog):
    """A compiled engine whose generate raises (a compiler error, memory) logs why, drops its static caches and
    replies eagerly - what the eager engine replies - from then on."""
    prompts = target_prompts(hf_engine.tokenizer)([chat["messages"][:1] for chat in CHATS])
    expected = [reply.text for reply in hf_engine.reply(prompts, [0, 0, 0])]
    decode, calls = hf_engine._decode, []

    def fails_when_static(encoded, seeds):
        calls.append(hf_engine.static)
        if hf_engine.static:
            hf_engine.caches[(0, 0)] = "a static cache"
            raise RuntimeError("out of memory (simulated)")
        return decode(encoded, seeds)

    hf_engine._decode, hf_engine.compiled, hf_engine.static = fails_when_static, True, True
    try:
        with caplog.at_level(logging.WARNING):
            hf_engine.log = LOG
            replies = hf_engine.reply(prompts, [0, 0, 0])
    finally:
        hf_engine._decode, hf_engine.log = decode, None
    assert [reply.text for reply in replies] == expected and calls[:2] == [True, False] and not any(calls[1:])
    assert not hf_engine.compiled and not hf_engine.static and hf_engine.caches == {}
    assert hf_engine.model.generation_config.compile_config is None
    assert "compiled generate failed (RuntimeError: out of memory (simulated)); generating eagerly" in caplog.text


@pytest.mark.slow
def test_the_compiled_engine_replies_what_the_eager_engine_replies(target_dir, hf_engine):
    """regenerate.compile on a CPU (auto compiles on CUDA only): transformers' generate takes the static caches and
    runs its decode step through torch.compile; two calls with other histories reuse the one compiled graph."""
    from torch._dynamo.utils import counters

    compiled = HFEngine(target_dir, regeneration_settings(compile=True, max_new_tokens=6), log=LOG)
    hf_engine.settings = regeneration_settings(max_new_tokens=6)
    prompts = target_prompts(hf_engine.tokenizer)([chat["messages"][:1] for chat in CHATS])
    before = counters["stats"]["unique_graphs"]
    first = compiled.reply(prompts[:2], [0, 0])
    graphs = counters["stats"]["unique_graphs"] - before
    assert compiled.compiled and graphs >= 1  # compiled, not fallen back to eager
    assert [r.text for r in first] == [r.text for r in hf_engine.reply(prompts[:2], [0, 0])]
    assert [r.text for r in compiled.reply(prompts[1:], [0, 0])] == \
        [r.text for r in hf_engine.reply(prompts[1:], [0, 0])]
    assert counters["stats"]["unique_graphs"] - before == graphs  # other histories, the same graph


def test_row_seeded_sampling_draws_from_the_tempered_distribution_and_each_row_from_its_own_seed():
    """The sampler's draws: frequencies over 20,000 seeded rows match softmax(logits / T) (a chi-square test at
    p = 1e-4: a sampler off by a few percent on any token fails it), top-p never draws outside its nucleus, a row
    draws the same alone as in a batch, and its next step draws anew."""
    import torch

    from eagle3_pipeline.runtime.generation.hf import RowSeededSampling

    logits, temperature, rows = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0]), 0.8, 20_000
    expected = torch.softmax(logits / temperature, -1) * rows

    def draws(seeds, top_p=1.0, steps=1):
        sampler = RowSeededSampling(seeds, temperature, top_p)
        scores = logits.repeat(len(seeds), 1)
        for _ in range(steps):
            allowed = sampler(None, scores)
        assert torch.equal((allowed == 0).sum(-1), torch.ones(len(seeds), dtype=torch.long))  # one token a row
        return allowed.argmax(-1)

    counts = torch.bincount(draws(list(range(rows))), minlength=6).double()
    kept = expected > 5  # the -30 logit's token: expected ~1e-14 times, drawn never
    statistic = float((((counts - expected) ** 2) / expected)[kept].sum())
    assert int(kept.sum()) == 5 and counts[~kept].sum() == 0
    assert statistic < 23.51  # the chi-square distribution's 1 - 1e-4 quantile at 4 degrees of freedom
    nucleus = draws(list(range(2000)), top_p=0.8)  # tokens 0 and 1 hold 0.83 of the mass, token 0 alone 0.65
    assert set(nucleus.tolist()) == {0, 1}
    batch = draws([11, 12, 13, 14])
    assert [int(draws([seed])[0]) for seed in (11, 12, 13, 14)] == batch.tolist()
    assert draws(list(range(200)), steps=2).tolist() != draws(list(range(200))).tolist()


def test_context_limit_cuts_the_conversation_before_the_turn_that_does_not_fit(tmp_path, hf_engine):
    engine = hf_engine
    prepare = target_prompts(engine.tokenizer)
    first_turn = len(prepare([CHATS[0]["messages"][:1]])[0].token_ids)
    engine.settings = regeneration_settings(max_context_tokens=first_turn + 10 + 2)  # the first turn and its reply
    kept, counts = regenerate.regenerate_conversations(
        CHATS[:1], engine, engine.settings, prepare, tmp_path / "progress.jsonl", "fp", LOG, pool_size=8)
    assert counts["cut_at_context_limit"] == 1
    assert [m["role"] for m in kept[0]["messages"]] == ["user", "assistant"]


def test_a_mixture_keeps_each_conversation_and_adds_the_targets_first_reply_beside_it(tmp_path, hf_engine):
    """keep_original + turns=1: the data's conversations unchanged, each followed by a sample that ends after the
    target's own first reply; the first reply is the one full regeneration gives."""
    engine = hf_engine
    full, _ = regenerate.regenerate_conversations(CHATS, engine, engine.settings, target_prompts(engine.tokenizer),
                                                  tmp_path / "full.jsonl", "fp", LOG, pool_size=8)
    engine.settings = regeneration_settings(keep_original=True, turns=1)
    kept, counts = regenerate.regenerate_conversations(
        CHATS, engine, engine.settings, target_prompts(engine.tokenizer), tmp_path / "mixture.jsonl", "fp", LOG,
        pool_size=8)
    assert [c["id"] for c in kept] == ["a", "a#s1", "b", "b#s1", "c", "c#s1"]
    assert kept[0::2] == CHATS
    assert counts["kept"] == 3 and counts["originals_kept"] == 3 and counts["replies"] == 3
    for sample, regenerated in zip(kept[1::2], full, strict=True):
        assert [m["role"] for m in sample["messages"]][-1] == "assistant"
        assert sum(m["role"] == "assistant" for m in sample["messages"]) == 1
        first = next(i for i, m in enumerate(regenerated["messages"]) if m["role"] == "assistant")
        assert sample["messages"] == regenerated["messages"][:first + 1]
    assert "keep_original" in engine.settings.output_defining()  # the ids change: no resuming across it
    assert "keep_original" not in regeneration_settings().output_defining()  # older journals stay resumable
    assert regeneration_settings(turns=2).output_defining() != regeneration_settings(turns=1).output_defining()
    engine.settings = regeneration_settings(keep_original=True, samples=2, temperature=1.0, max_new_tokens=4)
    kept, counts = regenerate.regenerate_conversations(
        CHATS[:2], engine, engine.settings, target_prompts(engine.tokenizer), tmp_path / "two.jsonl", "fp", LOG,
        pool_size=8)
    assert [c["id"] for c in kept] == ["a", "a#s1", "a#s2", "b", "b#s1", "b#s2"] and counts["kept"] == 4
    assert kept[0] == CHATS[0] and kept[3] == CHATS[1]


def test_rerun_resumes_from_progress_and_a_changed_setting_starts_over(tmp_path, target_dir):
    shard = tmp_path / "shard.jsonl"
    conversation_shards.write(shard, CHATS)
    output = tmp_path / "out.jsonl"
    progress = tmp_path / "out.jsonl.progress.jsonl"
    chosen = regeneration_settings(engine="hf")
    fingerprint = regenerate.fingerprint(shard, chosen, read_identity(target_dir)["content_hash"])
    marked = {**CHATS[1], "messages": CHATS[1]["messages"][:2] + [{"role": "assistant", "content": "RESUMED"}]}
    progress.write_text(json.dumps({"fingerprint": fingerprint}) + "\n"
                        + json.dumps({"index": 1, "conversation": marked}) + "\n"
                        + '{"index": 2, "conversation": {"id": "c", "mess')  # the line a kill cut short
    summary = regenerate.run_shard(shard, output, target_dir, chosen, LOG)
    result = conversation_shards.read(output)
    assert [c["id"] for c in result] == ["a", "b", "c"] and summary["resumed"] == 1
    assert result[1]["messages"][-1]["content"] == "RESUMED"  # kept, not regenerated
    assert result[2]["messages"][-1]["content"] not in ("", "RESUMED")  # the torn record was redone
    assert not progress.exists()
    # Other settings: the old progress is for other output and must not be reused.
    progress.write_text(json.dumps({"fingerprint": fingerprint}) + "\n"
                        + json.dumps({"index": 1, "conversation": marked}) + "\n")
    summary = regenerate.run_shard(shard, output, target_dir, regeneration_settings(max_new_tokens=6), LOG)
    assert summary["resumed"] == 0
    sampling = regeneration_settings(temperature=0.5)
    assert regenerate.fingerprint(shard, dataclasses.replace(sampling, samples=2), "t") != \
        regenerate.fingerprint(shard, sampling, "t")  # samples change the output: no resume across them
    assert regenerate.fingerprint(shard, dataclasses.replace(sampling, dtype="float32"), "t") != \
        regenerate.fingerprint(shard, dataclasses.replace(sampling, dtype="bfloat16"), "t")  # nor across precisions
    # auto counts as before dtype did (journals from then stay resumable); the server engine's precision is its own
    assert "dtype" not in dataclasses.replace(sampling, dtype="auto").output_defining()
    assert "dtype" not in dataclasses.replace(sampling, engine="openai").output_defining()
    assert conversation_shards.read(output)[1]["messages"][-1]["content"] != "RESUMED"


class FlakyChatServer:
    """A real HTTP server speaking the chat-completions shape: fails the first `failures` requests with 503,
    answers 400 to any conversation that says REJECT, loops when asked to LOOP, and echoes otherwise. With
    `silent`, it answers nothing until it is closed (a hung server, whatever the machine's speed)."""

    def __init__(self, failures: int = 0, silent: bool = False):
        self.requests: list[dict] = []
        self.failed = 0
        self.closing = threading.Event()
        lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if silent:
                    owner.closing.wait()
                    return
                last = body["messages"][-1]["content"]
                with lock:
                    owner.requests.append(body)
                    fail = owner.failed < failures
                    owner.failed += fail
                if fail:
                    return send_json(self, 503, {"error": "warming up"})
                if "REJECT" in last:
                    return send_json(self, 400, {"error": "prompt is too long"})
                reply = "the cat sat on the mat and " * 8 if "LOOP" in last else f"echo {last}"
                return send_json(self, 200, {"choices": [{"message": {"role": "assistant", "content": reply},
                                                     "finish_reason": "stop"}],
                                        "usage": {"completion_tokens": 3}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.closing.set()
        self.server.shutdown()


def test_server_engine_retries_then_answers_and_skips_a_rejected_conversation(tmp_path):
    server = FlakyChatServer(failures=2)
    chats = CHATS + [{"id": "bad", "messages": [{"role": "user", "content": "REJECT me"},
                                                {"role": "assistant", "content": "x"}]}]
    try:
        chosen = regeneration_settings(engine="openai", url=server.url, concurrency=2, backoff_s=0.01, thinking=False)
        engine = OpenAIEngine(chosen, LOG)
        kept, counts = regenerate.regenerate_conversations(
            chats, engine, chosen, word_prompts, tmp_path / "progress.jsonl", "fp", LOG, pool_size=8)
    finally:
        server.close()
    assert [c["id"] for c in kept] == ["a", "b", "c"]
    assert counts["dropped_rejected_by_engine"] == 1 and counts["replies"] == 5
    assert kept[0]["messages"][3]["content"] == "echo And of Italy?"
    assert kept[0]["messages"][2:] == [{"role": "user", "content": "And of Italy?"},
                                       {"role": "assistant", "content": "echo And of Italy?"}]
    first = server.requests[-1]
    assert first["max_tokens"] == 10 and first["temperature"] == 0.0
    assert first["chat_template_kwargs"] == {"enable_thinking": False}
    # 5 replies + 1 rejection + the 2 failed attempts that were retried
    assert len(server.requests) == 8


class RoundRecorder:
    """The server engine, recording how many prompts each round sent."""

    def __init__(self, engine):
        self.engine, self.rounds = engine, []

    def reply(self, prompts, seeds):
        self.rounds.append(len(prompts))
        return self.engine.reply(prompts, seeds)


def test_a_conversation_frees_its_slot_in_the_round_of_its_last_reply(tmp_path):
    """Two slots, conversations of 2, 1 and 2 replies: b ends with its one reply, so c starts in the next engine
    call beside a's second turn (3 rounds, every one full but the last) and b's record is the journal's first."""
    server = FlakyChatServer()
    try:
        chosen = regeneration_settings(engine="openai", url=server.url, concurrency=2)
        engine = RoundRecorder(OpenAIEngine(chosen, LOG))
        progress = tmp_path / "progress.jsonl"
        kept, counts = regenerate.regenerate_conversations(CHATS, engine, chosen, word_prompts, progress, "fp", LOG,
                                                           pool_size=2)
    finally:
        server.close()
    assert engine.rounds == [2, 2, 1] and counts["replies"] == 5
    assert [c["id"] for c in kept] == ["a", "b", "c"]
    journal_ids = [json.loads(line).get("index") for line in progress.read_text().splitlines()[1:]]
    assert journal_ids == [1, 0, 2]  # b first: finished with its one reply


def test_server_engine_gives_up_with_a_clear_error_and_keeps_finished_work(tmp_path):
    server = FlakyChatServer(failures=1000)
    try:
        chosen = regeneration_settings(engine="openai", url=server.url + "/v1", max_retries=2, backoff_s=0.01)
        engine = OpenAIEngine(chosen, LOG)
        with pytest.raises(regenerate.ServerUnavailable, match="still failing after 3 attempts.*HTTP 503"):
            regenerate.regenerate_conversations(CHATS, engine, chosen, word_prompts, tmp_path / "p.jsonl", "fp",
                                                LOG, pool_size=8)
    finally:
        server.close()
    assert json.loads((tmp_path / "p.jsonl").read_text().splitlines()[0]) == {"fingerprint": "fp"}


def test_server_engine_times_out(tmp_path):
    server = FlakyChatServer(silent=True)
    try:
        chosen = regeneration_settings(engine="openai", url=server.url, max_retries=0, timeout_s=0.3)
        engine = OpenAIEngine(chosen, LOG)
        with pytest.raises(regenerate.ServerUnavailable, match="TimeoutError|timed out"):
            engine.reply(word_prompts([CHATS[1]["messages"][:2]]), [0])
    finally:
        server.close()


def test_repeated_ngram_share_on_hand_made_replies():
    share = copying.repeated_ngram_share
    assert share("a b c d e f g h") == 0.0
    assert share("a b c") == 0.0  # too short for a 4-gram
    assert share("a b c d a b c d") == pytest.approx(1 / 5)  # 5 grams, "a b c d" seen before once
    assert share("x y " * 50) == pytest.approx(1 - 2 / 97)


LOOPING = CHATS[:2] + [{"id": "loop", "messages": [{"role": "user", "content": "Tell me a story."},
                                                   {"role": "assistant", "content": "Once..."},
                                                   {"role": "user", "content": "LOOP please"},
                                                   {"role": "assistant", "content": "..."}]}]


@pytest.mark.parametrize("drop", [False, True])
def test_looping_replies_are_counted_and_optionally_cut(tmp_path, caplog, drop):
    server = FlakyChatServer()
    try:
        chosen = regeneration_settings(engine="openai", url=server.url, backoff_s=0.01, drop_repetitive=drop)
        engine = OpenAIEngine(chosen, LOG)
        kept, counts = regenerate.regenerate_conversations(
            LOOPING, engine, chosen, word_prompts, tmp_path / "progress.jsonl", "fp", LOG, pool_size=8)
    finally:
        server.close()
    loop = next(c for c in kept if c["id"] == "loop")["messages"]
    if drop:  # cut before the looping reply: the first exchange stays
        assert counts["cut_at_repetitive_reply"] == 1 and counts["replies_repetitive"] == 0
        assert [m["content"] for m in loop] == ["Tell me a story.", "echo Tell me a story."]
    else:
        assert counts["replies_repetitive"] == 1 and counts["cut_at_repetitive_reply"] == 0
        assert loop[-1]["content"].startswith("the cat sat on the mat")
    assert counts["replies"] == 4 + (not drop)
    caplog.set_level(logging.WARNING)
    regenerate.warn_if_repetitive(counts, chosen, LOG)
    assert "word 4-grams" not in caplog.text  # 1 of 5 replies: not over the warning's 20 %
    counts["replies_repetitive"] += 1
    regenerate.warn_if_repetitive(counts, chosen, LOG)
    assert "repeat over 30 % of their word 4-grams" in caplog.text


def answers(port: int) -> bool:
    try:  # refused at once until the server listens; the timeout only guards against a hung one
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=SAFETY_TIMEOUT_S)
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not os.environ.get("E3_LLAMA_CPP_PYTHON"),
                    reason="opt-in: set E3_LLAMA_CPP_PYTHON to a python with llama-cpp-python[server]")
def test_against_a_real_llama_cpp_server(tmp_path, target_dir):
    port = free_port()
    gguf = assets.resolve("smollm2-gguf")
    server = subprocess.Popen([os.environ["E3_LLAMA_CPP_PYTHON"], "-m", "llama_cpp.server", "--model", str(gguf),
                               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_event(f"llama.cpp server answering on port {port}", lambda: answers(port), server)
        assert server.poll() is None, "the llama.cpp server exited before it answered"
        shard = tmp_path / "shard.jsonl"
        conversation_shards.write(shard, CHATS)
        chosen = regeneration_settings(engine="openai", url=f"http://127.0.0.1:{port}", concurrency=2,
                                       max_new_tokens=16)
        summary = regenerate.run_shard(shard, tmp_path / "out.jsonl", target_dir, chosen, LOG)
    finally:
        server.kill()
        server.wait()
    result = conversation_shards.read(tmp_path / "out.jsonl")
    assert summary["kept"] == 3 and summary["replies"] == 5
    assert all(m["content"] for c in result for m in c["messages"])
    print(json.dumps([c["messages"] for c in result], indent=1))


def test_a_round_is_rendered_and_tokenized_once_as_the_target_reads_it(smollm2_tokenizer):
    """tokenize_histories: each history's ids are its chat-template text tokenized (what the local engines feed the
    target and the context limit counts); a template that fails names the history's error; a history over the
    character bound is not tokenized at all."""
    histories = [chat["messages"][:1] for chat in CHATS] + [CHATS[0]["messages"][:3]]
    prompts = tokenize_histories(smollm2_tokenizer, histories, {}, max_characters=10**6)
    for history, prompt in zip(histories, prompts, strict=True):
        text = render(smollm2_tokenizer, history, True)
        assert prompt.messages == history
        assert prompt.token_ids == smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    long = [{"role": "user", "content": "word " * 50}]
    too_long, fine = tokenize_histories(smollm2_tokenizer, [long, histories[0]], {}, max_characters=100)
    assert too_long is None and fine == prompts[0]
    strict = copy.copy(smollm2_tokenizer)  # a template that refuses what it is given, as some refuse system turns
    strict.chat_template = "{{ raise_exception('this template takes no such turn') }}"
    refused, = tokenize_histories(strict, histories[:1], {}, max_characters=100)
    assert isinstance(refused, TemplateError) and "no such turn" in str(refused)


def test_replies_in_a_row_are_regenerated_as_one_and_a_system_turn_mid_conversation_is_answered(tmp_path):
    """Inputs other than ShareGPT can hold two assistant turns in a row or a system turn after a reply: every user
    (or system) turn still gets its regenerated reply, and nothing after them is lost."""
    turns = {"u1": "user", "u2": "user", "sys": "system", "a": "assistant"}
    chats = [{"id": cid, "messages": [{"role": turns[name], "content": name} for name in names]}
             for cid, names in (("twice", ["u1", "a", "a", "u2", "a"]), ("system", ["u1", "a", "sys", "a", "u2", "a"]))]
    server = FlakyChatServer()
    try:
        chosen = regeneration_settings(engine="openai", url=server.url, backoff_s=0.01)
        kept, counts = regenerate.regenerate_conversations(
            chats, OpenAIEngine(chosen, LOG), chosen, word_prompts, tmp_path / "progress.jsonl", "fp", LOG, pool_size=8)
    finally:
        server.close()
    assert [[m["content"] for m in c["messages"]] for c in kept] == [
        ["u1", "echo u1", "u2", "echo u2"], ["u1", "echo u1", "sys", "echo sys", "u2", "echo u2"]]
    assert counts["replies"] == 5


def test_a_turn_the_template_refuses_after_replies_keeps_the_replies(tmp_path):
    """A template that refuses a system turn after the start (as Mistral's do) ends the conversation there: the
    replies regenerated before it are kept and the cut counted; refused at its first turn, it is dropped."""
    def refuses_late_system_turns(histories):
        return [TemplateError("system turns only at the start") if history[-1]["role"] == "system" else prompt
                for history, prompt in zip(histories, word_prompts(histories), strict=True)]

    chats = [{"id": "late", "messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a"},
                                         {"role": "system", "content": "sys"}, {"role": "assistant", "content": "a"}]},
             {"id": "first", "messages": [{"role": "system", "content": "sys"}, {"role": "assistant", "content": "a"},
                                          {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}]
    server = FlakyChatServer()
    try:
        chosen = regeneration_settings(engine="openai", url=server.url, backoff_s=0.01)
        kept, counts = regenerate.regenerate_conversations(
            chats, OpenAIEngine(chosen, LOG), chosen, refuses_late_system_turns, tmp_path / "progress.jsonl", "fp",
            LOG, pool_size=8)
    finally:
        server.close()
    assert [[m["content"] for m in c["messages"]] for c in kept] == [["u1", "echo u1"]]
    assert counts["cut_at_template_error"] == 1 and counts["dropped_template_error"] == 1
