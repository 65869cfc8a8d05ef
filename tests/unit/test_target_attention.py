"""Grouped matmul attention (drafter/attention.py) and the target's static-cache attention built on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3_pipeline.drafter.attention import grouped_attention, repeat_kv
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.target_attention import ATTENTION
from tests.unit.conftest import tiny_llama


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_grouped_attention_equals_sdpa_over_repeated_heads(queries, mask_kind):
    torch.manual_seed(0)
    heads, kv_heads, slots, dim = 9, 3, 40, 16
    q = torch.randn(1, heads, queries, dim, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, slots, dim, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(queries, slots) < 0.6
    visible[:, 0] = True  # every query sees a slot
    mask = {"bool": visible, "none": None,
            "additive": torch.zeros(1, 1, queries, slots, dtype=torch.float64).masked_fill(~visible, -1e30)}[mask_kind]
    expected = F.scaled_dot_product_attention(q, repeat_kv(k, heads), repeat_kv(v, heads), attn_mask=mask)
    assert torch.allclose(grouped_attention(q, k, v, mask), expected, atol=1e-10)


def test_a_static_runtime_attends_with_grouped_matmuls_and_leaves_a_shared_models_eager_runtime_its_own():
    model = tiny_llama(layers=2, hidden=64).double()
    default = model.config._attn_implementation
    eager, static = TargetRuntime(model, [1, 1, 2]), TargetRuntime(model, [1, 1, 2], static=True)
    ids = list(range(3, 40))
    static_logits, static_aux = static.forward(ids, static.new_cache(len(ids)))
    assert model.config._attn_implementation == ATTENTION
    eager_logits, eager_aux = eager.forward(ids, eager.new_cache(len(ids)))
    assert model.config._attn_implementation == default != ATTENTION
    assert torch.allclose(static_logits, eager_logits, atol=1e-9) and torch.allclose(static_aux, eager_aux, atol=1e-9)
    # a five-token verify over the cached rows, as the chain's: the same as the eager runtime's
    cache, reference = static.new_cache(len(ids) + 8), eager.new_cache(len(ids) + 8)
    static.forward(ids, cache), eager.forward(ids, reference)
    verify = [5, 6, 7, 8, 9]
    assert torch.allclose(static.forward(verify, cache)[0], eager.forward(verify, reference)[0], atol=1e-9)
    asked = TargetRuntime(model, [1, 1, 2], static=True, attention="sdpa")  # what profile_loops compares against
    asked_logits, _ = asked.forward(ids, asked.new_cache(len(ids)))
    assert model.config._attn_implementation == "sdpa" and torch.allclose(asked_logits, static_logits, atol=1e-9)


def test_a_prefill_asks_the_eager_runtime_for_the_last_rows_logits_alone():
    """A prefill reads only the last row's logits: eagerly the LM head runs on that row (one row of [n, V]); the aux
    features are every row's, and the cache holds the prompt either way."""
    model = tiny_llama(layers=2, hidden=64).double()
    runtime, ids = TargetRuntime(model, [1, 1, 2]), list(range(3, 40))
    full_cache, last_cache = runtime.new_cache(len(ids)), runtime.new_cache(len(ids))
    logits, aux = runtime.forward(ids, full_cache)
    last_logits, last_aux = runtime.forward(ids, last_cache, last_only=True)
    assert last_logits.shape == (1, logits.shape[1]) and torch.allclose(last_logits[-1], logits[-1], atol=1e-9)
    assert torch.equal(last_aux, aux) and last_cache.get_seq_length() == full_cache.get_seq_length() == len(ids)
    assert torch.allclose(runtime.forward([5], last_cache)[0], runtime.forward([5], full_cache)[0], atol=1e-9)


def test_the_static_step_with_grouped_attention_compiles_to_one_graph():
    """What the timing pass compiles on a GPU: the static-cache step, traced without graph breaks."""
    runtime = TargetRuntime(tiny_llama(layers=2, hidden=64), [1, 1, 2], static=True)
    cache = runtime.new_cache(16)
    runtime.forward([3, 4, 5], cache)  # the cache's tensors allocated eagerly, as the runtime does
    with torch.inference_mode():
        explained = torch._dynamo.explain(runtime.model.forward)(
            input_ids=torch.tensor([[6]]), use_cache=True, **{runtime.cache_argument: cache})
    assert explained.graph_break_count == 0 and explained.graph_count == 1
