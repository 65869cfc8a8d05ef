"""Draft trees (runtime/tree.py): SGLang's settings and names, which nodes are kept, the drafter's and the target's
tree attention (each node sees only its ancestors, at position n + depth), and lossless tree decoding."""

from __future__ import annotations

import logging

import pytest
import torch

from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.logs import ClearError
from eagle3_pipeline.prompts import Prompt
from eagle3_pipeline.runtime import drafting, speculative
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.methods import Method, TreeSetting
from eagle3_pipeline.runtime.proposers import Draft, EagleChain, TargetAlone
from eagle3_pipeline.runtime.target.loading import load_model, load_tokenizer
from eagle3_pipeline.runtime.traces import acceptance_length
from eagle3_pipeline.runtime.tree import TreeDrafter
from eagle3_pipeline.runtime.tree_graph import keep_best
from tests.unit.conftest import tiny_llama


def test_settings_carry_sglang_flags_and_names_that_parse_back():
    setting = TreeSetting(5, 4, 8)
    assert setting.method() == "eagle3-tree(steps=5,topk=4,tokens=8)"
    assert TreeSetting.from_method(setting.method()) == setting
    assert Method.parse(setting.method()) == Method("eagle3", 5, setting)
    assert Method.parse(setting.method()).sglang_flags == ("--speculative-num-steps 5 --speculative-eagle-topk 4 "
                                                           "--speculative-num-draft-tokens 8")
    # a chain of k drafts is SGLang's topk-1 tree of depth k verifying k + 1 tokens
    assert Method.parse("eagle3@k=4").sglang_flags == TreeSetting(4, 1, 5).sglang_flags
    assert Method.parse("prompt-lookup@k=4").sglang_flags == Method.parse("eagle3-untrained@k=4").sglang_flags == ""
    assert TreeSetting.from_method("eagle3@k=4") is None
    # every name the evaluation writes parses back to the value it was made from
    for method in (Method("target"), Method("prompt-lookup", 4), Method("eagle3", 7), Method("eagle3-untrained", 4),
                   Method("eagle3", 5, setting)):
        assert Method.parse(method.name) == method
    assert [Method("target").name, Method("eagle3-untrained", 4).name] == ["target", "eagle3-untrained@k=4"]


@pytest.mark.parametrize(("steps", "topk", "tokens", "why"), [
    (2, 2, 8, "keeps num_draft_tokens - 1 = 7 nodes but drafts only 6"),
    (3, 1, 3, "SGLang sets num_draft_tokens to num_steps \\+ 1"),
    (3, 2, 1, "num_draft_tokens >= 2")])
def test_settings_sglang_would_not_run_as_given_are_refused(steps, topk, tokens, why):
    with pytest.raises(ClearError, match=f"evaluate.tree: .*{why}"):
        TreeSetting(steps, topk, tokens)


def tiny_drafter() -> Drafter:
    drafter = Drafter(DrafterConfig.from_target(tiny_llama(layers=2, hidden=32).config, 64, [1, 1, 2])).eval()
    drafter.t2d[:64] = True  # d2t 0: draft id = target id
    return drafter


@pytest.mark.parametrize("kept", range(1, 7))
def test_a_kept_node_always_comes_with_its_parent_even_at_ties(kept):
    """Candidates of a topk-2, depth-2 tree: c0 (0.0), c1 (-1.0) at depth 1; children c2, c3 of c0 and c4, c5 of
    c1. c2 ties its parent (a child of probability 1) and c4 ties c1, its parent: ties go to the parent."""
    candidates = [(torch.tensor([0.0, -1.0]), torch.tensor([10, 11]), torch.tensor([-1, -1])),
                  (torch.tensor([0.0, -2.0, -1.0, -3.0]), torch.tensor([12, 13, 14, 15]), torch.tensor([0, 0, 1, 1]))]
    tokens, parents, depths, scores = keep_best(tiny_drafter(), candidates, topk=2, kept=kept).tolist()
    tree = Draft([int(t) for t in tokens], [int(p) for p in parents], [int(d) for d in depths], scores)
    expected = [[10], [10, 12], [10, 11, 12], [10, 11, 12, 14], [10, 11, 12, 13, 14], [10, 11, 12, 13, 14, 15]]
    assert tree.tokens == expected[kept - 1]
    parent_token = {10: None, 11: None, 12: 10, 13: 10, 14: 11, 15: 11}
    for token, parent, depth in zip(tree.tokens, tree.parents, tree.depths, strict=True):
        assert (tree.tokens[parent - 1] if parent else None) == parent_token[token]
        assert depth == (1 if parent_token[token] is None else 2)


def test_acceptance_follows_the_targets_argmax_down_one_branch():
    # root -> a(5), b(6); a -> c(7); b -> d(8), e(9); d -> f(4)
    tree = Draft(tokens=[5, 6, 7, 8, 9, 4], parents=[0, 0, 1, 2, 2, 4], depths=[1, 1, 2, 2, 2, 3],
                     scores=[0.0] * 6)
    assert tree.visible()[6].tolist() == [True, False, True, False, True, False, True]
    # argmax at the root is 6 (b), at b is 8 (d), at d is 4 (f), at f is 3: all of b-d-f accepted, bonus 3
    assert tree.accept([6, 0, 8, 0, 4, 0, 3]) == ([2, 4, 6], 3)
    assert tree.accept([7, 0, 0, 0, 0, 0, 0]) == ([], 7)  # no depth-1 node matches: only the bonus


@pytest.fixture(scope="module")
def smollm2(target_dir):
    model = load_model(target_dir, "cpu", torch.float32)
    return TargetRuntime(model, [2, 15, 27]), load_tokenizer(target_dir)


def static_runtime(target: TargetRuntime, monkeypatch, static_layers_crop: bool) -> TargetRuntime:
    """The static-cache runtime (what the compiled step runs, uncompiled) on the same model; without
    `static_layers_crop` as in transformers 5.17 (the H200s'), whose StaticLayer has no crop."""
    from transformers.cache_utils import StaticLayer

    if not static_layers_crop:
        monkeypatch.delattr(StaticLayer, "crop", raising=False)  # 5.17 itself has none
    static = TargetRuntime(target.model, [2, 15, 27], static=True)
    static.prepare([3])
    return static


@pytest.mark.parametrize("cache", ["dynamic", "static", "static-5.17-like", "static-padded"])
@torch.inference_mode()
def test_each_verified_node_sees_its_ancestors_only(smollm2, monkeypatch, cache):
    """A tree verify's logits and aux features for each node equal a plain forward of prefix + root + its path;
    after keeping the prefix and one path the cache decodes on as if only that path had been fed (a static
    cache: the path's rows moved down to the slots after the root). `static-padded`: the tree padded to a fixed
    width of 10 rows (what the compiled verify runs), the padding rows dropped with the rejected ones."""
    target, tokenizer = smollm2
    if cache != "dynamic":
        target = static_runtime(target, monkeypatch, static_layers_crop=cache != "static-5.17-like")
    prefix = tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    root, n = prefix[-1], len(prefix) - 1
    words = tokenizer.encode(" Rome Milan, is and the")
    assert len(words) >= 6
    tree = Draft(tokens=words[:6], parents=[0, 0, 1, 1, 2, 3],
                     depths=[1, 1, 2, 2, 2, 3], scores=[0.0] * 6)
    kv = target.new_cache(64)
    target.forward(prefix[:-1], kv)
    logits, aux = target.forward_tree([root] + tree.tokens, [n + d for d in [0, *tree.depths]], tree.visible(), kv,
                                      width=10 if cache == "static-padded" else None)
    assert logits.shape[0] == aux.shape[0] == len(tree.tokens) + 1

    def path_to(node: int) -> list[int]:
        return [] if node == 0 else path_to(tree.parents[node - 1]) + [node]

    for node in range(len(tree.tokens) + 1):
        sequence = prefix + [tree.tokens[i - 1] for i in path_to(node)]
        plain_logits, plain_aux = smollm2[0].forward(sequence, smollm2[0].new_cache(64))
        torch.testing.assert_close(logits[node], plain_logits[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(aux[node], plain_aux[-1], rtol=1e-4, atol=1e-4)
    path = path_to(6)  # nodes 1, 3, 6
    target.keep_rows(kv, [*range(n), n, *(n + node for node in path)])
    assert int(kv.get_seq_length()) == n + 1 + len(path)
    following = tokenizer.encode(" city")[0]
    next_logits, _ = target.forward([following], kv)
    expected, _ = smollm2[0].forward(prefix + [tree.tokens[i - 1] for i in path] + [following],
                                     smollm2[0].new_cache(64))
    torch.testing.assert_close(next_logits[-1], expected[-1], rtol=1e-4, atol=1e-4)


def prompts_of(store, count: int = 4, length: int = 12) -> list[list[int]]:
    from eagle3_pipeline.formats.hidden_store import HiddenStore

    return [HiddenStore(store).sequence(j)["input_ids"][:length].tolist() for j in range(count)]


@torch.inference_mode()
def test_every_drafted_node_is_scored_along_its_own_path(trained_tiny):
    """The drafter's tree attention: a node's cumulative log-probability equals the chain drafted one row at a time
    down its path alone (DecodeKV, chain positions n-1+depth) - sibling and cousin rows are invisible to it."""
    target, drafter, store = trained_tiny
    ids = prompts_of(store, 1, 20)[0]
    _, features = target.forward(ids[:-1], target.new_cache(32))
    n = features.shape[0]
    tree = TreeDrafter(drafter, TreeSetting(4, 3, 16)).draft(ids, features)
    assert len(tree.tokens) == 15 and max(tree.depths) >= 2
    draft_id = {int(i + drafter.d2t[i]): i for i in range(drafter.config.draft_vocab_size)}
    first, hidden, real = drafter.decode(torch.tensor([ids[1:n + 1]]), features[None], torch.arange(n)[None])
    for node in range(1, len(tree.tokens) + 1):
        path = [node]
        while tree.parents[path[0] - 1]:
            path.insert(0, tree.parents[path[0] - 1])
        logits, state, cache, score = first[0, -1], hidden[:, -1:], real, 0.0
        for depth, step in enumerate(path, start=1):
            token = tree.tokens[step - 1]
            score += float(torch.log_softmax(logits.float(), -1)[draft_id[token]])
            out, state, cache = drafter.decode(torch.tensor([[token]]), state, torch.tensor([[n - 1 + depth]]), cache)
            logits = out[0, -1]
        assert tree.depths[node - 1] == len(path)
        assert score == pytest.approx(tree.scores[node - 1], abs=1e-4)


@pytest.mark.parametrize("setting", [TreeSetting(3, 2, 6), TreeSetting(4, 3, 12), TreeSetting(5, 4, 8)],
                         ids=lambda s: s.method())
def test_tree_decoding_is_lossless(trained_tiny, setting):
    target, drafter, store = trained_tiny
    tree_drafter = TreeDrafter(drafter, setting)
    accepted = []
    for i, ids in enumerate(prompts_of(store)):
        reference = speculative.decode(target, TargetAlone(), ids, 40, set(), str(i), "target")
        tree_drafter.reset()
        trace = speculative.decode(target, tree_drafter, ids, 40, set(), str(i), setting.method())
        speculative.check_lossless(trace, reference)
        assert len(trace.tokens) == 40 and max(trace.drafted) <= setting.num_steps
        accepted += trace.accepted
    assert max(accepted) >= 2  # the trained drafter's paths get accepted: the test exercises deep acceptance


@pytest.mark.parametrize("k", [2, 4])
def test_a_topk_1_tree_accepts_what_the_chain_accepts(trained_tiny, k):
    target, drafter, store = trained_tiny
    chain = EagleChain(drafting.DrafterProposer(drafter), k)
    tree_drafter = TreeDrafter(drafter, TreeSetting(k, 1, k + 1))
    for i, ids in enumerate(prompts_of(store, 3)):
        chain.reset()
        tree_drafter.reset()
        chained = speculative.decode(target, chain, ids, 30, set(), str(i), "chain")
        treed = speculative.decode(target, tree_drafter, ids, 30, set(), str(i), "tree")
        assert treed.tokens == chained.tokens and treed.accepted == chained.accepted
        assert treed.drafted == chained.drafted == [k] * len(chained.drafted)


def test_one_loop_decodes_the_target_alone_a_chain_and_a_topk_1_tree_alike(trained_tiny, monkeypatch):
    """The same host loop, three proposers: the same tokens; the chain and the topk-1 tree accept the same drafts, but
    only the tree is verified with a tree mask (a chain's draft goes through the plain causal forward)."""
    target, drafter, store = trained_tiny
    k, calls = 3, []
    forward, forward_tree = target.forward, target.forward_tree
    monkeypatch.setattr(target, "forward", lambda tokens, cache, **options: (
        calls.append(("plain", len(tokens))), forward(tokens, cache, **options))[1])
    monkeypatch.setattr(target, "forward_tree", lambda tokens, *rest, **options: (
        calls.append(("tree", len(tokens))), forward_tree(tokens, *rest, **options))[1])
    for i, ids in enumerate(prompts_of(store, 2)):
        runs, verifies = {}, {}
        for name, proposer in (("target", TargetAlone()), ("chain", EagleChain(drafting.DrafterProposer(drafter), k)),
                               ("tree", TreeDrafter(drafter, TreeSetting(k, 1, k + 1)))):
            proposer.reset()
            calls.clear()
            runs[name] = speculative.decode(target, proposer, ids, 30, set(), str(i), name)
            verifies[name] = set(calls[1:])  # after the prompt's forward
        assert runs["target"].tokens == runs["chain"].tokens == runs["tree"].tokens
        assert runs["chain"].accepted == runs["tree"].accepted and runs["chain"].drafted == runs["tree"].drafted
        assert verifies == {"target": {("plain", 1)}, "chain": {("plain", k + 1)}, "tree": {("tree", k + 1)}}
        assert runs["target"].accepted == runs["target"].drafted == [] and runs["target"].draft_seconds == 0
        assert runs["target"].verify_seconds == runs["target"].total_seconds
    chain = Draft.chain([7, 8, 9])  # a chain is the topk-1 tree: each node sees the root and the nodes before it
    assert not chain.tree and chain.parents == [0, 1, 2] and chain.depths == [1, 2, 3]
    assert torch.equal(chain.visible(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.accept([7, 8, 5, 6]) == Draft(chain.tokens, chain.parents, chain.depths).accept([7, 8, 5, 6]) == (
        [1, 2], 5)


def test_the_evaluation_names_trees_by_their_sglang_flags(trained_tiny):
    target, drafter, store = trained_tiny
    setting = TreeSetting(3, 2, 6)
    methods = speculative.method_table({"eagle3": drafter}, [2], trees=(setting,))
    by_method: dict[str, list] = {}
    for i, ids in enumerate(prompts_of(store, 2)):
        for method, trace in speculative.decode_prompt(target, methods, str(i), ids, 20, set(), True).items():
            by_method.setdefault(method, []).append(trace)
    summary = speculative.summarise_methods(by_method, logging.getLogger("test"))
    tree = summary[setting.method()]
    assert tree["sglang_flags"] == setting.sglang_flags and summary["eagle3@k=2"]["sglang_flags"]
    assert len(tree["acceptance_by_position"]) == 3
    assert tree["tau"] == acceptance_length(by_method[setting.method()]) >= 1.0
    assert "sglang_flags" not in summary["prompt-lookup@k=2"]


def test_trees_are_skipped_with_a_reason_where_the_target_cannot_verify_them(caplog):
    from transformers import MistralConfig, MistralForCausalLM

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    sliding = TargetRuntime(MistralForCausalLM(MistralConfig(sliding_window=16, **shape)), [1, 1, 2])
    assert speculative.usable_trees(sliding, (TreeSetting(2, 2, 4),), logging.getLogger("test")) == ()
    assert "sliding-window" in caplog.text
    for static in (False, True):
        usable = TargetRuntime(tiny_llama(layers=2, hidden=32), [1, 1, 2], static=static)
        assert speculative.usable_trees(usable, (TreeSetting(2, 2, 4),), logging.getLogger("test")) == (
            TreeSetting(2, 2, 4),)


@pytest.mark.parametrize("cache", ["dynamic", "static", "static-5.17-like"])
def test_smollm2_decodes_a_chat_prompt_losslessly_with_trees(smollm2, monkeypatch, cache):
    """The SmolLM2 target decodes a chat prompt with a (random-weight) drafter's trees losslessly, with the dynamic
    and the static cache."""
    target, tokenizer = smollm2
    reference_target = target
    if cache != "dynamic":
        target = static_runtime(target, monkeypatch, static_layers_crop=cache == "static")
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(target.model.config, 512, [2, 15, 27]))
    drafter.t2d[:512] = True
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    [(pid, ids)] = speculative.encode_prompts(tokenizer, [Prompt("p", [{"role": "user", "content": "Say hi."}])])
    reference = speculative.decode(reference_target, TargetAlone(), ids, 12, set(), pid, "target")
    for setting in (TreeSetting(2, 2, 4), TreeSetting(3, 3, 8)):
        trace = speculative.decode(target, TreeDrafter(drafter.eval(), setting), ids, 12, set(), pid, setting.method())
        speculative.check_lossless(trace, reference)
