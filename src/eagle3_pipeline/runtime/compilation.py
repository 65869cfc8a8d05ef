"""Compiling the target's decode step: when to (`compile_decision`), one compiled runtime per model and process
(`claim_for_compilation`), and how many compiled graphs ran without CUDA graphs (`steps_without_cuda_graphs`)."""

from __future__ import annotations

import torch

from eagle3_pipeline.logs import ClearError


def claim_for_compilation(model: torch.nn.Module) -> None:
    """A model gets one compiled runtime per process. torch.compile keys its graphs on the model object and
    outlives the runtime; dynamo does not guard on forward hooks, so a second runtime's compiled steps would
    replay the first's graphs, with the first runtime's aux hooks (its own would never see the compiled step's
    layers) and CUDA graphs recorded on the first runtime's cache addresses. Load the model again instead."""
    if getattr(model, "_eagle3_compiled_runtime", False):
        raise ClearError("this model already has a compiled target runtime in this process; a second one would "
                         "replay the first one's graphs (its hooks, its cache addresses): load the model again")
    model._eagle3_compiled_runtime = True


def compile_decision(requested: str | bool, device: str, timing_pass: bool) -> tuple[bool, str]:
    """(compile?, why): `auto` compiles the timing pass on CUDA only. On a CPU the compiled step is not faster
    for a small target and compiling costs minutes of a short run; the tau pass's many worker processes would
    each compile at once (minutes of every CPU core), for figures that do not depend on speed."""
    if requested != "auto":
        return bool(requested), f"evaluate.compile: {requested}"
    if not device.startswith("cuda"):
        return False, f"evaluate.compile: auto is off on {device} (eager decoding, dynamic KV cache)"
    if not timing_pass:
        return False, "evaluate.compile: auto compiles the timing pass only (the tau pass decodes eagerly)"
    return True, "evaluate.compile: auto, timing pass on CUDA"


def steps_without_cuda_graphs() -> int:
    """How many compiled graphs of this process inductor runs without CUDA graphs (torch logs each reason under
    `[__cudagraphs]`): such a step pays one launch per kernel, so its timing is not a captured step's."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))
