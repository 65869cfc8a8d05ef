"""Draft trees at fixed shapes (runtime/tree_graph.py, TargetRuntime.forward_tree's padded static path): a tree
holding the target's own continuation is accepted down that branch, step after step, through a static cache
(and, on a GPU, the compiled verify); on a GPU the drafting replayed from a CUDA graph drafts the eager trees, and
tree decoding with the compiled target and the captured drafter stays lossless."""

from __future__ import annotations

import logging

import pytest
import torch

from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.runtime import speculative, tree_graph
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.methods import TreeSetting
from eagle3_pipeline.runtime.proposers import Draft, TargetAlone
from eagle3_pipeline.runtime.tree import TreeDrafter
from tests.unit.conftest import tiny_llama

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the compiled step need a GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
AUX_LAYERS = [1, 2, 3]


def confident_target() -> torch.nn.Module:
    target = tiny_llama(layers=4, hidden=64, vocab=256, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(40)  # a confident target: no near ties between a 1-row and a tree forward
    return target.to(DEVICE)


@pytest.fixture(scope="module")
def model():
    return confident_target()


def random_drafter(model, seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter(DrafterConfig.from_target(model.config, 128, AUX_LAYERS))
    drafter.t2d[:128] = True  # d2t 0: draft id = target id
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    return drafter.to(DEVICE).eval()


def prompt(length: int = 20, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def oracle_tree(continuation: list[int], vocab: int) -> Draft:
    """root -> g1, x; g1 -> g2, y; x -> z; g2 -> g3: the target's next three tokens on one branch, wrong
    tokens (never the target's) beside them."""
    g1, g2, g3 = continuation
    return Draft(tokens=[g1, (g1 + 1) % vocab, g2, (g2 + 1) % vocab, (g1 + 2) % vocab, g3],
                     parents=[0, 0, 1, 1, 2, 3], depths=[1, 1, 2, 2, 2, 3], scores=[0.0] * 6)


@pytest.mark.parametrize("mode", ["static", pytest.param("compiled", marks=needs_cuda)])
@torch.inference_mode()
def test_a_tree_holding_the_targets_continuation_is_accepted_down_that_branch(model, mode):
    """Each step verifies a 7-node tree padded to 10 rows; the branch of the target's own tokens is accepted
    (path 1-3-6, then the bonus), the padding and the other rows dropped, for 8 steps: the output is the target's
    greedy output, so every verify saw exactly its ancestors."""
    ids = prompt()
    eager = TargetRuntime(model, AUX_LAYERS)
    reference = speculative.decode(eager, TargetAlone(), ids, 40, set(), "p", "target").tokens
    # a compiled runtime gets a model of its own (one per model and process: compilation.claim_for_compilation)
    target = TargetRuntime(confident_target() if mode == "compiled" else model, AUX_LAYERS, static=True,
                           compiled=mode == "compiled", log=logging.getLogger("test"))
    target.prepare([3])
    cache = target.new_cache(len(ids) + 48)
    logits, _ = target.forward(ids, cache)
    out = [int(logits[-1].argmax())]
    for _ in range(8):
        n = len(ids) + len(out) - 1  # rows the target has seen
        tree = oracle_tree(reference[len(out):len(out) + 3], 256)
        logits, aux = target.forward_tree([out[-1]] + tree.tokens, [n + d for d in [0, *tree.depths]],
                                          tree.visible(), cache, width=10)
        assert logits.shape[0] == aux.shape[0] == 7
        path, bonus = tree.accept(logits.argmax(-1).tolist())
        assert path == [1, 3, 6]
        target.keep_rows(cache, [*range(n), n, *(n + node for node in path)])
        out += [tree.tokens[node - 1] for node in path] + [bonus]
    assert out == reference[:len(out)]
    assert not target.tree_step_failed


@needs_cuda
@torch.inference_mode()
def test_captured_tree_drafting_drafts_the_eager_trees(model):
    """The same drafter on the same real rows (a sequence growing by 1 to 4 rows per step): the tree replayed from
    a CUDA graph equals the tree drafted eagerly, node for node."""
    drafter = random_drafter(model)
    ids = prompt(60, seed=1)
    _, features = TargetRuntime(model, AUX_LAYERS).forward(ids, TargetRuntime(model, AUX_LAYERS).new_cache(80))
    setting = TreeSetting(5, 4, 8)
    eager, captured = TreeDrafter(drafter, setting), TreeDrafter(drafter, setting, compiled=True)
    n, grown = 20, 0
    while n < len(ids) - 1:
        trees = [tree_drafter.draft(ids[:n + 1], features[:n]) for tree_drafter in (eager, captured)]
        assert (trees[0].tokens, trees[0].parents, trees[0].depths) == (
            trees[1].tokens, trees[1].parents, trees[1].depths)
        assert trees[0].scores == pytest.approx(trees[1].scores, abs=1e-4)
        grown += 1
        n += 1 + grown % 4
    assert captured.captured and len(captured.captured[True].calls.graphs) == 1


@needs_cuda
def test_tree_decoding_with_the_compiled_target_and_the_captured_drafter_is_lossless(model):
    drafter = random_drafter(model)
    eager = TargetRuntime(model, AUX_LAYERS)
    compiled = TargetRuntime(confident_target(), AUX_LAYERS, compiled=True, log=logging.getLogger("test"))
    compiled.prepare([3])
    for setting in (TreeSetting(5, 4, 8), TreeSetting(3, 2, 6)):
        for seed in range(2):
            ids = prompt(24, seed=seed)
            reference = speculative.decode(eager, TargetAlone(), ids, 32, set(), str(seed), "target")
            captured = TreeDrafter(drafter, setting, compiled=True)
            trace = speculative.decode(compiled, captured, ids, 32, set(), str(seed), setting.method())
            speculative.check_lossless(trace, reference)
            assert captured.captured  # a failed capture falls back to eager drafting: not tested then
            plain = speculative.decode(eager, TreeDrafter(drafter, setting), ids, 32, set(), str(seed), "eager")
            assert trace.accepted == plain.accepted
    assert compiled.compiled and not compiled.tree_step_failed


@pytest.mark.slow
@torch.inference_mode()
def test_fused_tree_drafting_drafts_the_eager_trees(model):
    """On a GPU the captured tree drafting records `fused(tree_drafts)` (inductor's kernels); here the same compiled
    function runs on the CPU against the eager one, from a fresh static cache each time, as one graph."""
    from eagle3_pipeline.runtime.draft_graph import fused
    from eagle3_pipeline.runtime.tree_graph import tree_drafts

    setting, ids, drafter = TreeSetting(3, 2, 5), prompt(), random_drafter(model)
    target = TargetRuntime(model, AUX_LAYERS)
    _, features = target.forward(ids, target.new_cache(len(ids)))

    def arguments() -> dict:
        tree = TreeDrafter(drafter, setting)
        tree.reset(64)
        integers, hidden = tree.proposer.real_rows(ids, features[:-1], setting.num_steps)
        return {"drafter": drafter, "integers": integers, "hidden": hidden, "cache": tree.proposer.cache,
                "rows": tree.rows, "steps": setting.num_steps, "topk": setting.topk,
                "kept": setting.num_draft_tokens - 1}

    (eager,) = tree_drafts(**arguments())
    (fused_tree,) = fused(tree_drafts)(**arguments())
    assert torch.equal(fused_tree[:3], eager[:3])  # tokens, parents, depths
    torch.testing.assert_close(fused_tree[3], eager[3], rtol=1e-4, atol=1e-4)  # cumulative log-probabilities
    explained = torch._dynamo.explain(tree_drafts)(**arguments())
    assert explained.graph_count == 1 and explained.graph_break_count == 0


@pytest.mark.parametrize("width", [64, 200, 4096 + 7])
def test_top_k_in_two_rounds_picks_what_torch_topk_picks(width):
    scores = torch.randn(8, width, generator=torch.Generator().manual_seed(width)).to(DEVICE)
    expected_values, expected_columns = scores.topk(5)
    for slice_width in (16, 1024):
        values, columns = tree_graph.top_k(scores, 5, slice_width)
        assert torch.equal(values, expected_values)
        assert torch.equal(columns, expected_columns)  # random scores: no ties
        assert torch.equal(scores.gather(1, columns), values)

