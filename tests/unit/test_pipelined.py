"""The device-resident decoding loop (runtime/pipelined.py) decodes exactly what the host loop decodes: the target
alone, EAGLE-3 chains and draft trees; its recorded steps accept, commit and draft as the host loop does."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from eagle3_pipeline.formats.hidden_store import HiddenStore
from eagle3_pipeline.runtime.compilation import steps_without_cuda_graphs
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.methods import Method, TreeSetting
from eagle3_pipeline.runtime.proposers import Draft, EagleChain
from eagle3_pipeline.runtime.speculative import decode_prompt
from eagle3_pipeline.runtime.tree import TreeDrafter

TREES = (TreeSetting(3, 2, 5), TreeSetting(2, 3, 6))


def both_loops(runtime: TargetRuntime, drafter, ids: list[int], k: int, max_new: int, eos: set[int]
               ) -> tuple[dict, dict, dict]:
    """Target-only, the chain at k and the TREES on one prompt, with the host loop and with the device-resident one
    (a compiled runtime's: its steps recorded in CUDA graphs); and the device-resident run's methods."""
    runs = []
    for device_loops in (False, True):
        runtime.device_loops = device_loops
        log = logging.getLogger("test")
        methods = {Method("eagle3", k): EagleChain(DrafterProposer(drafter, static=True, compiled=runtime.compiled,
                                                                   log=log), k)}
        for setting in TREES:
            methods[Method("eagle3", setting.num_steps, setting)] = TreeDrafter(drafter, setting, runtime.compiled,
                                                                                log)
        runs.append(decode_prompt(runtime, methods, "p", ids, max_new, eos, strict=True))  # strict: lossless
    return runs[0], runs[1], methods


@pytest.mark.parametrize("k", [1, 4])
def test_the_device_resident_loops_decode_what_the_host_loops_decode(trained_tiny, k):
    target, drafter, store = trained_tiny
    # the compiled runtime's static caches, uncompiled: the loops are the same on a GPU, where they are recorded
    runtime = TargetRuntime(target.model, drafter.config.aux_layer_ids, static=True)
    check_loops(runtime, drafter, store, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the compiled step need a GPU")
def test_the_recorded_device_resident_loops_decode_what_the_host_loops_decode(trained_tiny):
    target, drafter, store = trained_tiny
    model, drafter = copy.deepcopy(target.model).cuda(), copy.deepcopy(drafter).cuda()
    runtime = TargetRuntime(model, drafter.config.aux_layer_ids, compiled=True, log=logging.getLogger("test"))
    check_loops(runtime, drafter, store, 4)
    assert runtime.compiled and steps_without_cuda_graphs() == 0  # no step fell back to eager or to launches


def check_loops(runtime: TargetRuntime, drafter, store, k: int) -> None:
    runtime.prepare([k], [tree.rows_ahead for tree in TREES])
    accepted = {}
    for j in range(3):
        ids = HiddenStore(store).sequence(j)["input_ids"][:12].tolist()
        host, device, methods = both_loops(runtime, drafter, ids, k, 24, set())
        for method in host:
            assert device[method].loop == "device" and host[method].loop == "host"
            assert device[method].tokens == host[method].tokens, method  # lossless both (strict), and the same
            fields = ("accepted", "drafted", "target_forwards")
            if runtime.compiled and "tree" in method:
                # on a GPU the two loops draft trees through differently fused kernels (the host loop's graph of
                # tree_drafts, the device loop's of verified_tree_step), whose rounding may reorder two near-tied
                # candidates: a node can differ, and with it a step's acceptance, the text cannot
                forwards = device[method].target_forwards, host[method].target_forwards
                assert abs(forwards[0] - forwards[1]) <= max(2, forwards[1] // 10), (method, forwards)
                continue
            assert [getattr(device[method], f) for f in fields] == [getattr(host[method], f) for f in fields], method
            accepted[method] = accepted.get(method, 0) + sum(device[method].accepted)
        assert len(device["target"].tokens) == 24 and device["target"].target_forwards == 23
        if runtime.compiled:  # every method's steps replayed the one graph recorded for this cache, not eager kernels
            for proposer in methods.values():
                recorded = (proposer if isinstance(proposer, TreeDrafter) else proposer.proposer).recorded_step
                assert recorded.calls is not None and len(recorded.calls.graphs) == 1
        # an end-of-sequence token ends both loops at the same token (the device loop has one step in flight then)
        eos = {host["target"].tokens[9]}
        host_eos, device_eos, _ = both_loops(runtime, drafter, ids, k, 24, eos)
        for method in host_eos:
            assert device_eos[method].tokens == host_eos[method].tokens
            assert device_eos[method].target_forwards == host_eos[method].target_forwards
            assert device_eos[method].tokens[-1] in eos and len(device_eos[method].tokens) <= 10
    # the trained drafter's drafts are accepted: the acceptance arithmetic ran on real matches, chain and trees
    assert all(count > 0 for method, count in accepted.items() if method != "target"), accepted


@pytest.mark.slow
@torch.inference_mode()
def test_the_fused_verified_step_equals_the_eager_one_as_one_graph(trained_tiny):
    """On a GPU the device-resident chain records `fused(verified_step)` (inductor's kernels); here the same compiled
    function runs on the CPU against the eager one, from the same state, as one graph without breaks."""
    from eagle3_pipeline.runtime.draft_graph import fused
    from eagle3_pipeline.runtime.pipelined import verified_step

    target, drafter, store = trained_tiny
    ids = HiddenStore(store).sequence(0)["input_ids"][:16].tolist()

    def arguments() -> dict:
        """A verify of [x_n, d1..d3] right after the prompt, the drafter's cache holding the prompt's rows (a runtime
        of its own each time: a runtime reuses its caches)."""
        runtime = TargetRuntime(target.model, drafter.config.aux_layer_ids, static=True)
        runtime.prepare([3])
        cache = runtime.new_cache(len(ids) + 8)
        _, features = runtime.forward(ids[:-1], cache)
        proposer = DrafterProposer(drafter, static=True)
        proposer.reset(64)
        drafts, _ = proposer.chain(ids, features, 3)
        state = torch.cat([torch.tensor([len(ids) - 1, ids[-1]]), drafts])
        logits, aux = runtime.forward_device(state[1:][None], cache)
        return {"logits": logits, "aux": aux, "state": state, "drafter": drafter, "cache": proposer.cache, "k": 3,
                "lengths": [layer.cumulative_length for layer in cache.layers]}

    eager_arguments, fused_arguments = arguments(), arguments()
    (eager,) = verified_step(**eager_arguments)
    (compiled,) = fused(verified_step)(**fused_arguments)
    assert torch.equal(compiled, eager) and torch.equal(fused_arguments["state"], eager_arguments["state"])
    assert [int(t) for t in fused_arguments["lengths"]] == [int(t) for t in eager_arguments["lengths"]]
    assert int(eager_arguments["lengths"][0]) == len(ids) + int(eager[0])  # the prompt's rows, accepted and bonus
    explained = torch._dynamo.explain(verified_step)(**arguments())
    assert explained.graph_count == 1 and explained.graph_break_count == 0


@torch.inference_mode()
@pytest.mark.parametrize("accepted", [0, 1, 3, 4])
def test_the_verified_step_accepts_the_matching_prefix_and_the_bonus_token(trained_tiny, accepted):
    """Every accepted count at k=4, forced through the verify's logits: the step's report, the loop state and the
    target cache's lengths follow the host loop's arithmetic."""
    from eagle3_pipeline.runtime.pipelined import verified_step

    _, drafter, _ = trained_tiny
    k, n, vocab = 4, 20, drafter.embed_tokens.weight.shape[0]
    drafts, other = [11, 12, 13, 14], 40
    predictions = drafts[:accepted] + [other] * (k + 1 - accepted)  # the target's argmax after x_n, d1, ..
    logits = torch.nn.functional.one_hot(torch.tensor(predictions), vocab).float()
    state = torch.tensor([n, 7, *drafts])
    lengths = [torch.tensor(n + k + 1) for _ in range(3)]  # the verify wrote k + 1 rows
    proposer = DrafterProposer(drafter, static=True)
    proposer.reset(64)
    aux = torch.randn(k + 1, 3 * drafter.config.target_hidden_size)
    (report,) = verified_step(logits, aux, state, lengths, drafter, proposer.cache, k)
    bonus = predictions[accepted]
    assert report.tolist() == [accepted, *drafts[:accepted], *[bonus] * (k + 1 - accepted)]
    assert state[:2].tolist() == [n + accepted + 1, bonus] and [int(x) for x in lengths] == [n + accepted + 1] * 3


def oracle_tree() -> Draft:
    """root -> 1 (a), 2 (b); 1 -> 3 (c), 4 (d); 2 -> 5 (e); 3 -> 6 (f): tokens 11..16, depths up to 3."""
    return Draft(tokens=[11, 12, 13, 14, 15, 16], parents=[0, 0, 1, 1, 2, 3], depths=[1, 1, 2, 2, 2, 3])


def test_the_tree_state_on_the_device_is_the_host_loops_tree(trained_tiny):
    """The ancestry and the verify's mask and positions that the device-resident loop computes equal the host
    loop's (Draft.visible, TargetRuntime.forward_tree's inputs)."""
    from eagle3_pipeline.runtime.device_tree import TreeState, ancestry

    target, _, _ = trained_tiny
    runtime = TargetRuntime(target.model, [1, 2, 3], static=True)
    tree, n = oracle_tree(), 9
    assert torch.equal(ancestry(torch.tensor([0, *tree.parents]), 3), tree.visible())
    cache = runtime.new_cache(16)
    runtime.forward(list(range(1, n + 1)), cache)  # n rows cached
    host = runtime._tree_inputs([5, *tree.tokens], [n + d for d in [0, *tree.depths]], tree.visible(), cache, 7)
    state = TreeState.empty(7, int(cache.get_max_length()), torch.float32, torch.device("cpu"))
    state.set(torch.tensor([n]), torch.tensor([5, *tree.tokens]), torch.tensor([0, *tree.parents]),
              torch.tensor([0, *tree.depths]), 3)
    assert torch.equal(state.mask, host["attention_mask"]) and torch.equal(state.positions, host["position_ids"])


@torch.inference_mode()
@pytest.mark.parametrize(("predictions", "path"), [
    ([11, 13, 15, 16, 40, 40, 41], [1, 3, 6]),  # a -> c -> f, bonus from f
    ([12, 40, 15, 40, 40, 40, 40], [2, 5]),  # b -> e, bonus from e
    ([11, 14, 40, 40, 40, 40, 40], [1, 4]),  # a -> d
    ([40, 40, 40, 40, 40, 40, 40], []),  # nothing: the root's bonus
])
def test_the_verified_tree_step_accepts_the_matching_path_and_moves_its_rows(trained_tiny, predictions, path):
    """Every kind of path through a 7-node tree, forced through the verify's logits: the step's report, the target
    cache's rows (the path's moved down after the root's) and lengths, and the next tree's state follow the host
    loop's arithmetic (Draft.accept, keep_rows)."""
    from eagle3_pipeline.runtime.device_tree import TreeState, verified_tree_step
    from eagle3_pipeline.runtime.tree_graph import TreeRows

    _, drafter, _ = trained_tiny
    tree, n, width, steps, slots = oracle_tree(), 20, 7, 3, 64
    vocab = drafter.embed_tokens.weight.shape[0]
    logits = torch.nn.functional.one_hot(torch.tensor(predictions), vocab).float()
    state = TreeState.empty(width, slots, torch.float32, torch.device("cpu"))
    state.set(torch.tensor([n]), torch.tensor([7, *tree.tokens]), torch.tensor([0, *tree.parents]),
              torch.tensor([0, *tree.depths]), steps)
    layers = [torch.randn(1, 2, slots, 4) for _ in range(4)]  # two layers' keys and values
    lengths = [torch.tensor(n + width) for _ in range(2)]  # the verify wrote the tree's rows
    before = [tensor.clone() for tensor in layers]
    proposer = DrafterProposer(drafter, static=True)
    proposer.reset(slots)
    rows = TreeRows.empty(drafter, (steps - 1) * 2)
    aux = torch.randn(width, 3 * drafter.config.target_hidden_size)
    (report,) = verified_tree_step(logits, aux, state, lengths, layers, drafter, proposer.cache, rows, steps, 2)
    expected_path, bonus = tree.accept(predictions)
    assert expected_path == path
    accepted = len(path)
    tokens = [tree.tokens[node - 1] for node in path] + [bonus] * (steps + 1 - accepted)
    assert report.tolist() == [accepted, 3, *tokens]
    assert torch.cat([length.reshape(-1) for length in lengths]).tolist() == [n + 1 + accepted] * 2
    for moved, original in zip(layers, before, strict=True):
        kept = [*range(n + 1), *(n + node for node in path)]
        assert torch.equal(moved[:, :, :n + 1 + accepted], original[:, :, kept])
    assert int(state.n) == n + accepted + 1 and int(state.ids[0, 0]) == bonus
    assert state.positions[0].tolist() == [n + accepted + 1 + d for d in state.depths.tolist()]
    assert int(state.depths[0]) == 0 and (state.depths[1:] >= 1).all() and state.visible[:, 0].all()


@pytest.mark.slow
@torch.inference_mode()
def test_the_fused_verified_tree_step_equals_the_eager_one_as_one_graph(trained_tiny):
    """On a GPU the device-resident tree records `fused(verified_tree_step)` (inductor's kernels); here the same
    compiled function runs on the CPU against the eager one, from the same state, as one graph without breaks."""
    from eagle3_pipeline.runtime.device_tree import TreeSteps, verified_tree_step
    from eagle3_pipeline.runtime.draft_graph import fused

    target, drafter, store = trained_tiny
    ids = HiddenStore(store).sequence(0)["input_ids"][:16].tolist()
    setting = TreeSetting(3, 2, 5)

    def arguments() -> dict:
        """A tree's verify right after the prompt (a runtime and tree drafter of their own each time)."""
        runtime = TargetRuntime(target.model, drafter.config.aux_layer_ids, static=True)
        runtime.prepare([3], [setting.rows_ahead])
        cache = runtime.new_cache(len(ids) + 8)
        _, features = runtime.forward(ids[:-1], cache)
        tree_drafter = TreeDrafter(drafter, setting)
        tree_drafter.reset(64)
        steps = TreeSteps(tree_drafter)
        steps.begin(runtime, cache, list(ids), features)
        logits, aux = steps.verify(runtime, cache)
        return {"logits": logits, "aux": aux, "tree": steps.state, "lengths": steps.lengths, "layers": steps.layers,
                "drafter": drafter, "cache": tree_drafter.proposer.cache, "rows": tree_drafter.rows,
                "steps": setting.num_steps, "topk": setting.topk}

    eager_arguments, fused_arguments = arguments(), arguments()
    (eager,) = verified_tree_step(**eager_arguments)
    (compiled,) = fused(verified_tree_step)(**fused_arguments)
    assert torch.equal(compiled, eager)
    for mine, theirs in zip(fused_arguments["tree"].tensors(), eager_arguments["tree"].tensors(), strict=True):
        assert torch.equal(mine, theirs)
    assert [int(t) for t in fused_arguments["lengths"]] == [int(t) for t in eager_arguments["lengths"]]
    explained = torch._dynamo.explain(verified_tree_step)(**arguments())
    assert explained.graph_count == 1 and explained.graph_break_count == 0


@torch.inference_mode()
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_a_steps_snapshot_puts_back_everything_the_step_changes(trained_tiny, method):
    """Recording a step's CUDA graph runs it three times, each from the snapshot's state: what the step changes (the
    loop state, the target cache's lengths and, for a tree, the rows it moves) must all come back, or the recorded
    runs would walk the sequence past its cache."""
    from eagle3_pipeline.runtime.device_tree import TreeSteps
    from eagle3_pipeline.runtime.pipelined import ChainSteps

    target, drafter, store = trained_tiny
    ids = HiddenStore(store).sequence(1)["input_ids"][:16].tolist()
    setting = TreeSetting(3, 2, 5)
    runtime = TargetRuntime(target.model, drafter.config.aux_layer_ids, static=True)
    runtime.prepare([3], [setting.rows_ahead])
    cache = runtime.new_cache(len(ids) + 24)
    _, features = runtime.forward(ids[:-1], cache)
    if method == "chain":
        proposer = DrafterProposer(drafter, static=True)
        proposer.reset(64)
        steps = ChainSteps(proposer, 3)
    else:
        tree_drafter = TreeDrafter(drafter, setting)
        tree_drafter.reset(64)
        steps = TreeSteps(tree_drafter)
    steps.begin(runtime, cache, list(ids), features)
    logits, aux = steps.verify(runtime, cache)
    layers = [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]
    state = steps.state.tensors() if method == "tree" else (steps.state,)
    before = [tensor.clone() for tensor in (*state, *steps.lengths, *layers)]
    restore = steps.snapshot()
    steps.advance(logits, aux)
    after = [tensor.clone() for tensor in (*state, *steps.lengths, *layers)]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # the step did change them
    restore()
    for now, then in zip((*state, *steps.lengths, *layers), before, strict=True):
        assert torch.equal(now, then)


@torch.inference_mode()
def test_a_target_cache_that_disagrees_with_the_loop_state_stops_the_device_loop(trained_tiny):
    """After a prompt the device-resident loop checks that the target cache holds the rows its state counts: a
    recorded step that rewound a length wrongly raises (the timing pass then times that method in the host loop)
    instead of timing a broken decode."""
    from eagle3_pipeline.runtime.pipelined import GreedySteps, check_rows

    target, _, _ = trained_tiny
    runtime = TargetRuntime(target.model, [1, 2, 3], static=True)
    cache = runtime.new_cache(32)
    runtime.forward(list(range(1, 10)), cache)  # 9 rows

    class Counted(GreedySteps):
        def __init__(self, rows: int):
            self.rows = rows

        def cached_rows(self) -> int:
            return self.rows

    check_rows(Counted(9), cache, "eagle3@k=4")
    check_rows(GreedySteps(), cache, "target")  # the target alone counts nothing
    with pytest.raises(RuntimeError, match="eagle3@k=4: .* holds 9 rows, the loop state counts 183"):
        check_rows(Counted(183), cache, "eagle3@k=4")
