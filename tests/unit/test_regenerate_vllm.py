"""Regeneration through vLLM's offline engine (regenerate.engine: vllm) on SmolLM2: CUDA and the vllm package only
(benchmarks/device_run.sh runs this module on the device, with vLLM staged by benchmarks/device-stage-vllm.sh)."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

from eagle3_pipeline.runtime.generation import RequestRejected, decode_reply
from eagle3_pipeline.stages import regenerate
from eagle3_pipeline.tokenization import render
from tests.unit.conftest import CHATS, regeneration_settings, target_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs a CUDA GPU and the vllm package")
# torch.cuda.is_available() above leaves a forked child unable to use CUDA without torch.cuda.is_initialized()
# turning true, so vLLM's own check does not switch to spawn and its forked engine process failed ("Cannot
# re-initialize CUDA in forked subprocess", one H100, 2026-12-05); the fp32 scorer below initialises CUDA outright.
# The engine process is spawned. A pipeline job does not touch CUDA before the engine starts, so it may fork.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
LOG = logging.getLogger("test")


def vllm_settings(**overrides):
    # eager: no compile or graph capture at the start; a KV cache of its own size, not profiled (other CUDA tests
    # may hold or free memory meanwhile)
    return regeneration_settings(**{"engine": "vllm", "device": "auto", "dtype": "bfloat16", "max_new_tokens": 24,
                                    "batch_size": 8, "compile": False, "gpu_memory_utilization": 0.1,
                                    "kv_cache_gb": 2.0, **overrides})


@pytest.fixture(scope="module")
def vllm_engine(target_dir):
    from eagle3_pipeline.runtime.generation.vllm_local import VLLMEngine

    engine = VLLMEngine(target_dir, vllm_settings(), LOG)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def scorer(target_dir):
    """The target in HF transformers, fp32 on the GPU: what vLLM's greedy tokens are checked against."""
    from eagle3_pipeline.runtime.target.loading import load_model

    return load_model(target_dir, "cuda", torch.float32, False)


def test_greedy_replies_are_the_targets_own_choices(vllm_engine, scorer):
    """The tokens vLLM picks greedily (bf16) for a rendered history are the fp32 target's top token (nine in ten at
    least; bf16's rounding may break a near tie) and always among its top three, within a logit of the top; the
    engine's replies are those tokens up to the end of turn, decoded without special tokens."""
    engine = vllm_engine
    engine.settings = vllm_settings()
    histories = [chat["messages"][:1] for chat in CHATS] + [CHATS[1]["messages"][:2]]
    prompts = [engine.tokenizer(render(engine.tokenizer, history, True), add_special_tokens=False)["input_ids"]
               for history in histories]
    raw = engine.llm.generate([engine.tokens_prompt(prompt_token_ids=ids) for ids in prompts],
                              [engine.sampling(0)] * len(prompts), use_tqdm=False)
    replies = engine.reply(target_prompts(engine.tokenizer)(histories), [0] * len(histories))
    exact = total = same_text = 0
    for prompt, output, reply in zip(prompts, raw, replies, strict=True):
        assert not isinstance(reply, RequestRejected) and reply.text and "<|" not in reply.text
        expected = decode_reply(engine.tokenizer, list(output.outputs[0].token_ids), engine.stop_ids)
        same_text += expected.text == reply.text  # (a near tie may break the other way with the prefix cached)
        generated = list(output.outputs[0].token_ids)[:expected.tokens]
        with torch.inference_mode():
            logits = scorer(torch.tensor([prompt + generated], device="cuda")).logits[0, len(prompt) - 1:-1]
        picked = torch.tensor(generated, device="cuda")
        chosen = logits.gather(-1, picked[:, None])[:, 0]
        assert torch.all(chosen >= logits.max(-1).values - 1.0), (prompt, generated)
        assert torch.all((logits.topk(3, -1).indices == picked[:, None]).any(-1)), (prompt, generated)
        exact, total = exact + int((logits.argmax(-1) == picked).sum()), total + len(generated)
    assert exact >= 0.9 * total and same_text >= len(histories) - 1
    assert any(reply.finished for reply in replies)  # "Name a colour." in one word ends well before 24 tokens


def test_samples_draw_from_their_own_seeds_and_reproduce(tmp_path, vllm_engine):
    engine = vllm_engine

    def sampled(**changes):
        engine.settings = vllm_settings(max_new_tokens=16, temperature=1.0, samples=2, **changes)
        engine.llm.reset_prefix_cache()  # a cached prefix is computed in other shapes: other last bits of the logits
        progress = tmp_path / f"progress-{len(list(tmp_path.iterdir()))}.jsonl"
        return regenerate.regenerate_conversations(CHATS, engine, engine.settings, target_prompts(engine.tokenizer),
                                                   progress, "fp", LOG,
                                                   pool_size=8)[0]

    kept = sampled()
    assert [c["id"] for c in kept] == ["a", "a#s2", "b", "b#s2", "c", "c#s2"]
    first_replies = [next(m["content"] for m in c["messages"] if m["role"] == "assistant") for c in kept]
    assert sum(first_replies[i] != first_replies[i + 1] for i in (0, 2, 4)) >= 2  # two draws per history
    assert sampled() == kept  # the same seeds: the same replies
    assert sampled(seed=1) != kept


def test_a_history_too_long_for_the_engine_is_rejected_alone(vllm_engine):
    engine = vllm_engine
    engine.settings = vllm_settings()
    too_long = [{"role": "user", "content": "word " * engine.settings.max_context_tokens}]
    replies = engine.reply(target_prompts(engine.tokenizer)([too_long, CHATS[0]["messages"][:1]]), [0, 0])
    assert isinstance(replies[0], RequestRejected) and "exceed max_model_len" in str(replies[0])
    assert not isinstance(replies[1], RequestRejected) and replies[1].text


def test_the_jobs_log_keeps_its_lines_after_the_engine_starts(tmp_path, target_dir, monkeypatch):
    """A regenerate job's `log:` file kept only its first line once vLLM had started (logs.reattach)."""
    import sys

    from eagle3_pipeline import logs
    from eagle3_pipeline.runtime.generation.vllm_local import VLLMEngine

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # setup's force=True closes nothing of pytest's; they come back after
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(logs, "_job_handlers", [])
    path = tmp_path / "job.log"
    log = logs.setup(path)
    engine = VLLMEngine(target_dir, vllm_settings(), log)
    try:
        log.info("after the engine's start")
    finally:
        engine.close()
    assert "engine: vLLM on" in path.read_text() and "after the engine's start" in path.read_text()
