"""The device-resident decoding loops (runtime/pipelined.py) decode exactly what the host loops decode."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from eagle3_pipeline.formats.hidden_store import HiddenStore
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.drafting import DrafterProposer
from eagle3_pipeline.runtime.speculative import decode_prompt
from tests.unit.conftest import trained_tiny_drafter


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_tiny_drafter(tmp_path_factory.mktemp("pipelined"))


def both_loops(runtime: TargetRuntime, drafter, ids: list[int], k: int, max_new: int, eos: set[int]) -> list[dict]:
    """Target-only and the chain at k on one prompt, with the host loops and with the device-resident ones (a
    compiled runtime's: its chain recorded in CUDA graphs)."""
    runs = []
    for device_loops in (False, True):
        runtime.device_loops = device_loops
        proposer = DrafterProposer(drafter, static=True, compiled=runtime.compiled, log=logging.getLogger("test"))
        methods = {f"eagle3@k={k}": (proposer, k)}
        runs.append(decode_prompt(runtime, methods, "p", ids, max_new, eos, strict=True))  # strict: lossless
    return runs


@pytest.mark.parametrize("k", [1, 4])
def test_the_device_resident_loops_decode_what_the_host_loops_decode(trained, k):
    target, drafter, store = trained
    # the compiled runtime's static caches, uncompiled: the loops are the same on a GPU, where they are recorded
    runtime = TargetRuntime(target.model, drafter.config.aux_layer_ids, static=True)
    check_loops(runtime, drafter, store, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the compiled step need a GPU")
def test_the_recorded_device_resident_loops_decode_what_the_host_loops_decode(trained):
    target, drafter, store = trained
    model, drafter = copy.deepcopy(target.model).cuda(), copy.deepcopy(drafter).cuda()
    runtime = TargetRuntime(model, drafter.config.aux_layer_ids, compiled=True, log=logging.getLogger("test"))
    check_loops(runtime, drafter, store, 4)
    assert runtime.compiled  # no step fell back to eager


def check_loops(runtime: TargetRuntime, drafter, store, k: int) -> None:
    runtime.prepare([k])
    accepted = 0
    for j in range(3):
        ids = HiddenStore(store).sequence(j)["input_ids"][:12].tolist()
        host, device = both_loops(runtime, drafter, ids, k, 24, set())
        for method in host:
            fields = ("tokens", "accepted", "drafted", "target_forwards")
            assert [getattr(device[method], f) for f in fields] == [getattr(host[method], f) for f in fields], method
        assert len(device["target"].tokens) == 24 and device["target"].target_forwards == 23
        accepted += sum(device[f"eagle3@k={k}"].accepted)
        # an end-of-sequence token ends both loops at the same token (the device loop has one step in flight then)
        eos = {host["target"].tokens[9]}
        host_eos, device_eos = both_loops(runtime, drafter, ids, k, 24, eos)
        for method in host_eos:
            assert device_eos[method].tokens == host_eos[method].tokens
            assert device_eos[method].target_forwards == host_eos[method].target_forwards
            assert device_eos[method].tokens[-1] in eos and len(device_eos[method].tokens) <= 10
    assert accepted > 0  # the trained drafter's drafts are accepted: the acceptance arithmetic ran on real matches
