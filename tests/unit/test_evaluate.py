"""Speculative decoding: lossless equality, tau arithmetic, per-position rates, baselines."""

from __future__ import annotations

import logging

import pytest
import torch

from eagle3_pipeline.config_schema import schema_defaults
from eagle3_pipeline.formats import serving_dir as serving_dir_format
from eagle3_pipeline.prompts import Prompt, load_prompts
from eagle3_pipeline.runtime import drafting, speculative
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.proposers import EagleChain, PromptLookup, TargetAlone
from eagle3_pipeline.runtime.speculative import Trace, acceptance_by_position, summarise, timing_summary
from eagle3_pipeline.runtime.target.loading import load_model, load_tokenizer
from eagle3_pipeline.runtime.traces import vocabulary_stops
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.stages import evaluate, evaluate_timing
from tests.unit.conftest import smollm2_serving_dir


def test_tau_and_acceptance_by_position_on_a_hand_made_trace():
    # k=3; verify steps accepted 3, 1, 0, 2 drafts (each adds accepted + 1 bonus token)
    trace = Trace("p", "m", tokens=list(range(1 + 4 + 2 + 1 + 3)), accepted=[3, 1, 0, 2], drafted=[3, 3, 3, 3],
                  target_forwards=4)
    # position 1 reached 4 times, accepted 3; position 2 reached 3, accepted 2; position 3 reached 2, accepted 1
    assert acceptance_by_position([trace], 3) == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert summarise([trace], 3)["tau"] == pytest.approx(10 / 4)  # per verify step; the prefill's token is none's
    assert Trace("p", "target", tokens=list(range(11)), target_forwards=10).tau == 1.0
    baseline = Trace("p", "target", tokens=list(range(11)), target_forwards=11, total_seconds=2.0)
    trace.total_seconds, trace.draft_seconds, trace.verify_seconds = 1.0, 0.2, 0.6
    trace.prompt_draft_seconds = 0.08
    speed = timing_summary([trace], [baseline])
    assert speed["speedup_vs_target"] == pytest.approx(2.0)
    assert speed["draft_ms_per_step"] == pytest.approx(50.0) and speed["verify_ms_per_step"] == pytest.approx(150.0)
    assert speed["prompt_draft_ms_per_prompt"] == pytest.approx(80.0)


def test_vocabulary_stops_count_the_steps_rejected_at_a_token_no_draft_could_propose():
    # prefill token 0; steps: accepted 1 of 2 (rejected at token 5), 2 of 2 (no rejection; the target's token 2
    # follows), 0 of 2 (rejected at token 7), 0 of 2 with its tokens cut (its rejected token is not in the trace)
    trace = Trace("p", "eagle3@k=2", tokens=[0, 4, 5, 6, 3, 2, 7], accepted=[1, 2, 0, 0], drafted=[2, 2, 2, 2])
    in_draft = [True] * 8
    assert vocabulary_stops([trace], in_draft) == 0.0
    in_draft[5] = False
    assert vocabulary_stops([trace], in_draft) == 1 / 4
    in_draft[7] = False
    assert vocabulary_stops([trace], in_draft) == 2 / 4
    in_draft[2] = False  # after a step that accepted every draft: no draft was rejected there
    assert vocabulary_stops([trace], in_draft) == 2 / 4


def test_worker_processes_take_each_prompt_exactly_once(tmp_path):
    first, second = evaluate.claimer(tmp_path), evaluate.claimer(tmp_path)  # two workers sharing one directory
    assert [first(0), second(0), second(1), first(1), second(2)] == [True, False, True, False, True]


def test_prompt_lookup_copies_what_followed_the_last_match():
    propose = PromptLookup(3, max_ngram=3)
    context = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert propose.draft(context, torch.zeros(0)).tokens == [8, 9, 1]
    assert propose.draft([1, 2, 3], torch.zeros(0)).tokens == []


@pytest.mark.parametrize("k", [1, 4, 7])
def test_every_method_is_lossless(trained_tiny, k):
    target, drafter, store = trained_tiny
    from eagle3_pipeline.formats.hidden_store import HiddenStore

    prompts = [HiddenStore(store).sequence(j)["input_ids"][:12].tolist() for j in range(4)]
    untrained = drafting.untrained_like(drafter)
    proposers = {"eagle3": EagleChain(drafting.DrafterProposer(drafter), k),
                 "untrained": EagleChain(drafting.DrafterProposer(untrained), k), "prompt-lookup": PromptLookup(k)}
    taus = {}
    for name, propose in proposers.items():
        traces = []
        for i, ids in enumerate(prompts):
            reference = speculative.decode(target, TargetAlone(), ids, 40, set(), str(i), "target")
            propose.reset()
            trace = speculative.decode(target, propose, ids, 40, set(), str(i), name)
            speculative.check_lossless(trace, reference)
            assert len(trace.tokens) == 40
            traces.append(trace)
        taus[name] = sum(len(t.tokens) for t in traces) / sum(t.target_forwards for t in traces)
    # the motif data is learnable: the trained drafter beats the untrained one
    if k > 1:
        assert taus["eagle3"] > taus["untrained"]


def test_a_mismatch_names_the_prompt():
    with pytest.raises(speculative.LosslessViolation, match="prompt q7"):
        speculative.check_lossless(Trace("q7", "eagle3@k=4", [1, 2, 3]), Trace("q7", "target", [1, 2, 4]))


def test_prompt_files(tmp_path):
    mt = tmp_path / "q.jsonl"
    mt.write_text('{"question_id": 81, "turns": ["a", "b"]}\n{"question_id": 82, "turns": ["c", "d"]}\n')
    assert [p.messages for p in load_prompts(mt, None)] == [[{"role": "user", "content": "a"}],
                                                                     [{"role": "user", "content": "c"}]]
    assert len(load_prompts(mt, 1, multi_turn=True)[0].messages) == 2
    held = tmp_path / "eval.jsonl"
    held.write_text('{"id": "x", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},'
                    ' {"role": "assistant", "content": "r"}]}\n')
    assert [m["role"] for m in load_prompts(held, None)[0].messages] == ["system", "user"]


def vllm_style_chain(drafter, context: list[int], features: torch.Tensor, k: int, advance: int = 1):
    """The chain as vLLM's EagleProposer.propose drafts it, written out independently: every real row at its
    own position, the first draft from the last real row, then `positions += 1` before every further step
    (`advance=0`: our old rule, every chain row at the last real position)."""
    n = features.shape[0]
    positions = torch.arange(n)[None]
    logits, hidden, cache = drafter.decode(torch.tensor([context[1:n + 1]]), features[None], positions)
    position, hidden = positions[:, -1:], hidden[:, -1:]
    tokens, chain_logits = [], []
    for _ in range(k):
        chain_logits.append(logits[0, -1])
        token = drafter.draft_to_target(logits[0, -1].argmax())
        tokens.append(int(token))
        position = position + advance
        logits, hidden, cache = drafter.decode(token.view(1, 1), hidden, position, cache)
    return tokens, torch.stack(chain_logits)


@torch.inference_mode()
def test_chain_positions_match_a_vllm_style_rule(trained_tiny):
    target, drafter, store = trained_tiny
    from eagle3_pipeline.formats.hidden_store import HiddenStore

    ids = HiddenStore(store).sequence(1)["input_ids"][:30].tolist()
    _, features = target.forward(ids, target.new_cache(len(ids)))
    proposer = drafting.DrafterProposer(drafter)
    static = drafting.DrafterProposer(drafter, static=True)  # the compiled path's cache and padding, uncompiled
    k = 5
    for n in (10, 11, 14, 15, 19):  # the real rows grow by 1..4 between calls, as after verify steps
        expected_drafts, expected_logits = vllm_style_chain(drafter, ids[:n + 1], features[:n], k)
        for drafter_proposer in (proposer, static):
            drafts, logits = drafter_proposer.chain(ids[:n + 1], features[:n], k)
            assert drafts.tolist() == expected_drafts
            torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    # a sequence that outgrows its static cache moves to the next size with its rows, and drafts on unchanged
    static._reserve(static.cache.capacity + 1)
    assert static.cache.capacity == 1024 and sorted(static.static_caches) == [512, 1024]
    n = 23
    expected_drafts, _ = vllm_style_chain(drafter, ids[:n + 1], features[:n], k)
    assert static.chain(ids[:n + 1], features[:n], k)[0].tolist() == expected_drafts
    # the comparison can fail: the old rule (chain rows at the last real position) gives other logits
    _, old_logits = vllm_style_chain(drafter, ids[:20], features[:19], k, advance=0)
    assert torch.equal(old_logits[0], expected_logits[0])
    assert not torch.allclose(old_logits[1:], expected_logits[1:], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_a_prompt_goes_into_the_static_cache_in_chunks_of_one_shape(trained_tiny, monkeypatch):
    """Prompts of any length write their rows in forwards of PROMPT_CHUNK rows (the last one padded), so a prompt of
    a new length meets no new shape inside a timed decode; the chain after it drafts what vLLM's rule drafts."""
    target, drafter, store = trained_tiny
    from eagle3_pipeline.formats.hidden_store import HiddenStore

    widths = []
    write_rows = drafting.write_rows
    monkeypatch.setattr(drafting, "write_rows", lambda integers, hidden, *rest: widths.append(hidden.shape[1])
                        or write_rows(integers, hidden, *rest))
    stored = HiddenStore(store).sequence(1)["input_ids"].tolist()
    ids = (stored * (200 // len(stored) + 1))[:200]
    _, features = target.forward(ids, target.new_cache(len(ids)))
    k = 4
    for n in (30, 70, 150):  # one chunk, two (the last padded), three
        widths.clear()
        proposer = drafting.DrafterProposer(drafter, static=True)
        proposer.reset(256)
        drafts, logits = proposer.chain(ids[:n + 1], features[:n], k)
        assert widths == [drafting.PROMPT_CHUNK] * -(-(n - k - 1) // drafting.PROMPT_CHUNK)
        expected_drafts, expected_logits = vllm_style_chain(drafter, ids[:n + 1], features[:n], k)
        assert drafts.tolist() == expected_drafts
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
        # the next verify step's rows (3 accepted + bonus) still draft as vLLM does: the padding was overwritten
        drafts, _ = proposer.chain(ids[:n + 5], features[:n + 4], k)
        assert drafts.tolist() == vllm_style_chain(drafter, ids[:n + 5], features[:n + 4], k)[0]


@pytest.mark.slow
@torch.inference_mode()
def test_the_fused_chain_drafts_what_the_eager_chain_drafts(trained_tiny):
    """On a GPU the captured chain records `fused(chain_drafts)` (inductor's kernels); here the same compiled
    function runs on the CPU against the eager one, from a fresh static cache each time."""
    from eagle3_pipeline.formats.hidden_store import HiddenStore
    from eagle3_pipeline.runtime.draft_graph import chain_drafts, fused

    target, drafter, store = trained_tiny
    ids = HiddenStore(store).sequence(1)["input_ids"][:30].tolist()
    _, features = target.forward(ids, target.new_cache(len(ids)))
    k, n = 3, 20

    def arguments() -> dict:
        proposer = drafting.DrafterProposer(drafter, static=True)
        proposer.reset(64)
        integers, hidden = proposer.real_rows(ids[:n + 1], features[:n], k)
        return {"drafter": drafter, "integers": integers, "hidden": hidden, "cache": proposer.cache, "k": k}

    eager_drafts, eager_logits = chain_drafts(**arguments())
    fused_drafts, fused_logits = fused(chain_drafts)(**arguments())
    assert fused_drafts.tolist() == eager_drafts.tolist() and len(eager_drafts) == k
    torch.testing.assert_close(fused_logits, eager_logits, rtol=1e-4, atol=1e-4)
    explained = torch._dynamo.explain(chain_drafts)(**arguments())
    assert explained.graph_count == 1 and explained.graph_break_count == 0  # the whole chain is one graph


def test_low_precision_counts_divergence_where_fp32_raises():
    reference = [Trace("a", "target", [1, 2, 3, 4], total_seconds=1.0), Trace("b", "target", [5, 6], total_seconds=1.0)]
    drafted = [Trace("b", "eagle3@k=2", [5, 6], accepted=[1], drafted=[2], target_forwards=1, total_seconds=1.0),
               Trace("a", "eagle3@k=2", [1, 2, 9, 9], accepted=[1, 1], drafted=[2, 2], target_forwards=2,
                     total_seconds=1.0)]
    with pytest.raises(speculative.LosslessViolation, match="prompt a: eagle3@k=2 .* at token 2"):
        speculative.check_lossless(drafted[1], reference[0])
    summary = speculative.summarise_methods({"target": reference, "eagle3@k=2": drafted}, logging.getLogger("test"))
    assert summary["eagle3@k=2"]["diverged_share"] == 0.5
    assert summary["eagle3@k=2"]["first_divergence"] == {"a": 2}
    assert summary["eagle3@k=2"]["tau"] == 6 / 3  # from the method's own run


@pytest.mark.slow
def test_a_bfloat16_evaluation_completes_and_reports_its_divergence(target_dir, tmp_path):
    serving = smollm2_serving_dir(target_dir, tmp_path / "serving")
    prompts = [Prompt("p1", [{"role": "user", "content": "Name three rivers in Europe."}]),
               Prompt("p2", [{"role": "user", "content": "Count from one to ten in words."}])]
    settings = from_section(evaluate.Settings, schema_defaults("evaluate") | {
        "device": "cpu", "dtype": "bfloat16", "max_new_tokens": 16, "draft_lengths": [3],
        "tree": [{"num_steps": 2, "topk": 2, "num_draft_tokens": 4}], "untrained_baseline": False, "workers": 1},
        trust_remote_code=False)
    log = logging.getLogger("test")
    result = evaluate.run_job(target_dir, serving, prompts, settings, str(tmp_path / "log"), log,
                              tmp_path / "progress")
    tokens = {(t["prompt_id"], t["method"]): t["tokens"] for t in result["traces"]}
    for method in ("eagle3@k=3", "prompt-lookup@k=3", "eagle3-tree(steps=2,topk=2,tokens=4)"):
        diverged = {p.prompt_id for p in prompts if tokens[p.prompt_id, method] != tokens[p.prompt_id, "target"]}
        assert result["summary"][method]["diverged_share"] == len(diverged) / 2
        assert set(result["summary"][method]["first_divergence"]) == diverged
    in_draft = serving_dir_format.draft_vocabulary_mask(serving)
    for method in ("eagle3@k=3", "eagle3-tree(steps=2,topk=2,tokens=4)"):
        traces = [Trace(**{k: v for k, v in t.items() if k != "tau"}) for t in result["traces"]
                  if t["method"] == method]
        assert result["summary"][method]["vocabulary_stops"] == vocabulary_stops(traces, in_draft)
    assert "vocabulary_stops" not in result["summary"]["prompt-lookup@k=3"]


@pytest.mark.slow
def test_the_timing_pass_times_every_method_on_every_set(target_dir, tmp_path):
    serving = smollm2_serving_dir(target_dir, tmp_path / "serving")
    prompt_sets = {"a": [Prompt("a1", [{"role": "user", "content": "Say hello."}])],
                   "b": [Prompt("b1", [{"role": "user", "content": "List two colours."}])]}
    settings = evaluate_timing.timing_settings(schema_defaults("evaluate") | {
        "device": "cpu", "dtype": "float32", "draft_lengths": [2, 3],
        "timing": {"prompts": 1, "max_new_tokens": 8, "device_loops": True, "trees": True},
        "tree": [{"num_steps": 2, "topk": 2, "num_draft_tokens": 4}]}, trust_remote_code=False)
    result = evaluate_timing.run_timing(target_dir, serving, prompt_sets, settings, logging.getLogger("test"))
    assert result["pass"] == "timing" and set(result["sets"]) == {"a", "b"}
    assert result["compiled"] is False  # auto: eager on a CPU
    assert list(result["warm_up_seconds"]) == ["eager"] and result["warm_up_seconds"]["eager"] > 0  # apart
    for speeds in result["sets"].values():
        assert set(speeds) == {"target", "eagle3@k=2", "eagle3@k=3", "prompt-lookup@k=2", "prompt-lookup@k=3",
                               "eagle3-tree(steps=2,topk=2,tokens=4)"}
        assert speeds["target"]["speedup_vs_target"] == 1.0
        assert {speed["loop"] for speed in speeds.values()} == {"host"}  # eager: no device-resident loops
        for method, speed in speeds.items():
            assert speed["tokens"] == speeds["target"]["tokens"] and speed["tokens_per_s"] > 0, method  # lossless
            assert speed["speedup_vs_target"] == pytest.approx(speed["tokens_per_s"] / speeds["target"]["tokens_per_s"])


@pytest.mark.slow
@pytest.mark.parametrize("failing", ["trees", "every method"])
def test_the_timing_pass_falls_back_to_host_loops_when_the_device_resident_ones_fail(target_dir, tmp_path,
                                                                                    monkeypatch, caplog, failing):
    """A failing device-resident tree step sends the trees to the host loop (chains and the target alone stay on the
    device); a loop that fails for every method sends them all there."""
    from eagle3_pipeline.runtime import device_tree
    from eagle3_pipeline.runtime.methods import TreeSetting

    def raising(*args, **kwargs):
        raise RuntimeError("capture failed")

    if failing == "trees":  # the device tree step raising, as one whose CUDA graph cannot be recorded does
        monkeypatch.setattr(device_tree, "verified_tree_step", raising)
    else:
        monkeypatch.setattr(speculative, "decode_on_device", raising)
    model = load_model(target_dir, "cpu", torch.float32)
    target = TargetRuntime(model, [2, 15, 27], static=True)  # the compiled runtime's static caches, uncompiled
    target.device_loops = True
    drafter = drafting.load_served_for(target_dir, smollm2_serving_dir(target_dir, tmp_path / "serving"), torch.float32)
    prompt_sets = {"a": [Prompt("a1", [{"role": "user", "content": "Say hello."}])]}
    tree = TreeSetting(2, 2, 4)
    with caplog.at_level(logging.WARNING):
        sets = evaluate_timing.timing_pass(target, load_tokenizer(target_dir), prompt_sets, drafter, [2], 8, True,
                                           logging.getLogger("test"), (tree,))
    assert ("device-resident loop failed in the warm-up (RuntimeError: capture failed); timing the draft trees in "
            "the host loop instead") in caplog.text
    speeds = sets["a"]
    if failing == "trees":
        assert target.device_loops is True and target.device_trees is False
        assert {method: speed["loop"] for method, speed in speeds.items()} == {
            "target": "device", "eagle3@k=2": "device", "prompt-lookup@k=2": "host", tree.method(): "host"}
    else:
        assert "timing every method in the host loop instead" in caplog.text and target.device_loops is False
        assert {speed["loop"] for speed in speeds.values()} == {"host"}
    assert speeds["eagle3@k=2"]["tokens"] == speeds[tree.method()]["tokens"] == speeds["target"]["tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("static_layers_crop", [True, False], ids=["transformers-5.24", "transformers-5.17-like"])
def test_static_cache_decoding_equals_eager_greedy_on_smollm2(target_dir, tmp_path, monkeypatch, static_layers_crop):
    from transformers.cache_utils import StaticLayer

    from eagle3_pipeline.runtime.target.loading import load_tokenizer

    if not static_layers_crop:  # as in transformers 5.17 (the H200s' version): StaticLayer has no crop
        monkeypatch.delattr(StaticLayer, "crop")

    model = load_model(target_dir, "cpu", torch.float32)
    tokenizer = load_tokenizer(target_dir)
    eager = TargetRuntime(model, [2, 15, 27])
    static = TargetRuntime(model, [2, 15, 27], static=True)  # what the compiled step runs, uncompiled
    static.prefill_width = 16  # prompts of 31-60 tokens go in chunks, the last one padded
    static.prepare([3])
    static.smallest_cache = 32  # the two prompts decode in caches of two sizes
    drafter = drafting.load_served(smollm2_serving_dir(target_dir, tmp_path / "serving"),
                          embedding=model.get_input_embeddings().weight.detach())
    prompts = [Prompt("long", [{"role": "user", "content": "Write a long story about a red fox who lives at the edge "
                                                         "of a quiet forest, and tell how it finds its way home."}]),
               Prompt("short", [{"role": "user", "content": "Hi"}])]  # the reused cache is reset
    for pid, ids in speculative.encode_prompts(tokenizer, prompts):
        reference = speculative.decode(eager, TargetAlone(), ids, 16, set(), pid, "target")
        assert speculative.decode(static, TargetAlone(), ids, 16, set(), pid, "target").tokens == reference.tokens
        # speculative steps: 1..k+1 tokens padded to k+1, rejected rows cropped
        static_drafter = drafting.DrafterProposer(drafter, static=True)
        static_drafter.reset(static.cache_size(len(ids) + 16))
        for name, propose in (("prompt-lookup", PromptLookup(3)),
                              ("eagle3", EagleChain(drafting.DrafterProposer(drafter), 3)),
                              ("eagle3-static", EagleChain(static_drafter, 3))):
            trace = speculative.decode(static, propose, ids, 16, set(), pid, name)
            speculative.check_lossless(trace, reference)
        _, eager_aux = eager.forward(ids, eager.new_cache(len(ids)))
        _, static_aux = static.forward(ids, static.new_cache(len(ids)))
        # chunks round differently from one forward (other matmul shapes); a wrong position would be off by O(1)
        torch.testing.assert_close(static_aux, eager_aux, rtol=1e-4, atol=1e-3)
    assert sorted(static.static_caches) == [64, 128]  # each prompt in the smallest cache that holds it
    assert static.widths == [1, 4, 16]


@torch.inference_mode()
def test_a_fresh_static_cache_takes_its_first_step_eagerly(target_dir):
    """transformers allocates a static cache on first use and marks its tensors as static addresses only outside
    a compiled region; allocated inside one, CUDA graphs are skipped for every step that mutates the cache (seen on
    the H200). The compiled step is stood in for by the model's own forward, recording the widths it ran."""
    model = load_model(target_dir, "cpu", torch.float32)
    runtime = TargetRuntime(model, [2, 15, 27], static=True)
    runtime.prepare([3])
    widths: list[int] = []

    def step(**inputs):
        widths.append(inputs["input_ids"].shape[1])
        return model.forward(**inputs)

    runtime.step = step
    prompt = list(range(100, 200))  # two prefill chunks of 64
    cache = runtime.new_cache(len(prompt) + 8)
    logits, _ = runtime.forward(prompt, cache)
    assert widths == [64]  # the first chunk ran eagerly, the second (36 tokens, padded) through the step
    runtime.forward([int(logits[-1].argmax())], cache)
    assert widths == [64, 1] and int(cache.get_seq_length()) == 101
    runtime.forward(prompt[:30], runtime.new_cache(40))  # the reused cache is allocated: straight to the step
    assert widths == [64, 1, 64]


@torch.inference_mode()
def test_a_compiled_step_that_fails_part_way_leaves_the_cache_as_it_was(target_dir):
    """A failing compiled step (here: the model's forward, which writes every layer's rows, then an error, as a
    failed CUDA-graph capture would) is rewound and run eagerly: the same logits and cache length as eager."""
    model = load_model(target_dir, "cpu", torch.float32)
    runtime, eager = TargetRuntime(model, [2, 15, 27], static=True), TargetRuntime(model, [2, 15, 27])
    runtime.prepare([3])

    def failing_step(**inputs):
        model.forward(**inputs)
        raise RuntimeError("capture failed")

    prompt = list(range(100, 140))
    cache = runtime.new_cache(len(prompt) + 8)
    runtime.forward(prompt, cache)  # a fresh cache's first step is eager
    runtime.step = failing_step
    logits, _ = runtime.forward([7, 8, 9], cache)
    assert runtime.step is None and int(cache.get_seq_length()) == len(prompt) + 3
    reference = eager.new_cache(0)
    eager.forward(prompt, reference)
    torch.testing.assert_close(logits, eager.forward([7, 8, 9], reference)[0], rtol=1e-3, atol=1e-3)


def test_a_model_gets_one_compiled_runtime_per_process():
    from eagle3_pipeline.logs import ClearError
    from tests.unit.conftest import tiny_llama

    model = tiny_llama(layers=2, hidden=32)
    TargetRuntime(model, [1, 1, 2])  # eager runtimes share a model freely
    TargetRuntime(model, [1, 1, 2], compiled=True)
    with pytest.raises(ClearError, match="already has a compiled target runtime"):
        TargetRuntime(model, [1, 1, 2], compiled=True)
    assert TargetRuntime(tiny_llama(layers=2, hidden=32), [1, 1, 2], compiled=True).compiled  # a model of its own


def test_compile_auto_means_the_timing_pass_on_cuda():
    from eagle3_pipeline.runtime.compilation import compile_decision

    assert [compile_decision("auto", device, timing)[0] for device, timing in
            (("cuda", True), ("cuda:1", True), ("cuda", False), ("cpu", True))] == [True, True, False, False]
    assert compile_decision(True, "cpu", False)[0] and not compile_decision(False, "cuda", True)[0]
    assert "off on cpu" in compile_decision("auto", "cpu", True)[1]


def test_a_sliding_window_target_decodes_eagerly_even_when_compilation_is_asked(caplog):
    """A sliding-window layer rolls its static buffer: rows pushed out by rejected drafts cannot be restored,
    so the runtime keeps the dynamic cache (and says why) instead of decoding wrongly."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from eagle3_pipeline.runtime.decode import TargetRuntime

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2)
    sliding = TargetRuntime(MistralForCausalLM(MistralConfig(sliding_window=16, **shape)), [2, 2, 3], static=True,
                            log=logging.getLogger("test"))
    assert not sliding.static and not sliding.compiled
    assert "sliding-window" in caplog.text
    assert TargetRuntime(LlamaForCausalLM(LlamaConfig(**shape)), [2, 2, 3], static=True).static
