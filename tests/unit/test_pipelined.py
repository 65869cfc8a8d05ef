"""The device-resident decoding loops (runtime/pipelined.py) decode exactly what the host loops decode."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from eagle3_pipeline.formats.hidden_store import HiddenStore
from eagle3_pipeline.runtime.decode import TargetRuntime, steps_without_cuda_graphs
from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.methods import Method
from eagle3_pipeline.runtime.proposers import EagleChain
from eagle3_pipeline.runtime.speculative import decode_prompt


def both_loops(runtime: TargetRuntime, drafter, ids: list[int], k: int, max_new: int, eos: set[int]
               ) -> tuple[dict, dict, DrafterProposer]:
    """Target-only and the chain at k on one prompt, with the host loops and with the device-resident ones (a
    compiled runtime's: its chain recorded in CUDA graphs); and the device-resident run's proposer."""
    runs = []
    for device_loops in (False, True):
        runtime.device_loops = device_loops
        proposer = DrafterProposer(drafter, static=True, compiled=runtime.compiled, log=logging.getLogger("test"))
        methods = {Method("eagle3", k): EagleChain(proposer, k)}
        runs.append(decode_prompt(runtime, methods, "p", ids, max_new, eos, strict=True))  # strict: lossless
    return runs[0], runs[1], proposer


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
    runtime.prepare([k])
    accepted = 0
    for j in range(3):
        ids = HiddenStore(store).sequence(j)["input_ids"][:12].tolist()
        host, device, proposer = both_loops(runtime, drafter, ids, k, 24, set())
        for method in host:
            fields = ("tokens", "accepted", "drafted", "target_forwards")
            assert [getattr(device[method], f) for f in fields] == [getattr(host[method], f) for f in fields], method
        assert len(device["target"].tokens) == 24 and device["target"].target_forwards == 23
        accepted += sum(device[f"eagle3@k={k}"].accepted)
        if runtime.compiled:  # the chain's steps replayed the one graph recorded for this cache, not eager kernels
            assert proposer.device_steps.calls is not None and len(proposer.device_steps.calls.graphs) == 1
        # an end-of-sequence token ends both loops at the same token (the device loop has one step in flight then)
        eos = {host["target"].tokens[9]}
        host_eos, device_eos, _ = both_loops(runtime, drafter, ids, k, 24, eos)
        for method in host_eos:
            assert device_eos[method].tokens == host_eos[method].tokens
            assert device_eos[method].target_forwards == host_eos[method].target_forwards
            assert device_eos[method].tokens[-1] in eos and len(device_eos[method].tokens) <= 10
    assert accepted > 0  # the trained drafter's drafts are accepted: the acceptance arithmetic ran on real matches


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
