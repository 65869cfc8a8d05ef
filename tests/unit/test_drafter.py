"""The drafter: TTT attention, metrics, training, resume equivalence, export for SGLang/vLLM."""

from __future__ import annotations

import functools
import json
import logging
import math

import numpy as np
import pytest
import torch
import zarr
from safetensors import safe_open

from eagle3_pipeline.config_schema import schema_defaults
from eagle3_pipeline.drafter.attention import TTTKV, choose_ttt_attention, explicit_ttt_attention, flex_ttt_attention
from eagle3_pipeline.drafter.batches import collate, epoch_batches, pack_greedy, padded_width
from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.drafter.objective import Teacher, shift_left, step_metrics, ttt_forward
from eagle3_pipeline.formats import hidden_store, zarr_io
from eagle3_pipeline.formats.metrics import read as read_metrics
from eagle3_pipeline.formats.target_dir import read_head
from eagle3_pipeline.runtime import drafting
from eagle3_pipeline.runtime.target.loading import load_config
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.stages import export
from eagle3_pipeline.stages.train import data_error_line
from eagle3_pipeline.training.loop import build_drafter, train
from eagle3_pipeline.training.resume import fingerprint_changes, run_fingerprint
from eagle3_pipeline.training.selection import summary
from eagle3_pipeline.training.settings import TrainSettings
from tests.unit.conftest import tiny_target_with_store


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=100, draft_vocab_size=40, target_hidden_size=32, aux_layer_ids=[2, 3, 4])
    return DrafterConfig(**(values | overrides))


def test_ttt_attention_matches_an_explicitly_masked_reference():
    torch.manual_seed(0)
    model = Drafter(tiny_config()).eval()
    batch, length, steps = 2, 9, 3
    ids = torch.randint(0, 100, (batch, length))
    positions = torch.arange(length).expand(batch, length)
    hidden = torch.randn(batch, length, 96)
    cache = TTTKV(explicit_ttt_attention)
    outputs = []
    with torch.no_grad():
        h = hidden
        for _ in range(steps):
            _, h, cache = model(ids, h, positions, cache)
            outputs.append(h)
        # Reference: recompute the last step's attention with one explicit mask over all steps' keys.
        attn = model.midlayer.self_attn
        queries_input = torch.cat([model.midlayer.input_layernorm(model.embed_tokens(ids)),
                                   model.midlayer.hidden_norm(outputs[-2])], -1)
        cos, sin = model.rotary(positions, hidden.dtype)

        def project(proj, x, heads):
            y = proj(x).view(batch, length, heads, 8).transpose(1, 2)
            return y

        q = project(attn.q_proj, queries_input, 4)
        q = q * cos + (torch.cat([-q[..., 4:], q[..., :4]], -1)) * sin
        keys = torch.cat([k for k, _ in cache.steps], dim=2)  # [B,kv_heads,steps*T,d]
        values = torch.cat([v for _, v in cache.steps], dim=2)
        mask = torch.zeros(length, steps * length, dtype=torch.bool)
        for t in range(length):
            mask[t, : t + 1] = True  # step 0: causal prefix
            for j in range(1, steps):
                mask[t, j * length + t] = True  # later steps: own position only
        reference = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        reference = attn.o_proj(reference.transpose(1, 2).reshape(batch, length, -1))
        residual = outputs[-2]
        expected = residual + reference
        expected = expected + model.midlayer.mlp(model.midlayer.post_attention_layernorm(expected))
    torch.testing.assert_close(outputs[-1], expected, atol=1e-5, rtol=1e-5)


def test_ttt_steps_equal_a_served_chain_with_engine_positions():
    """TTT step k at position t must compute what a server computes for draft k+1: real rows 0..t (token x[p+1],
    target feature f[p], rotary position p), then one chain row per draft, each one position further on
    (vLLM EagleProposer.propose: `positions += 1` per step). The chain is fed the data tokens, as TTT is."""
    torch.manual_seed(0)
    model = Drafter(tiny_config()).eval()
    length, steps, t = 12, 4, 6
    ids = torch.randint(0, 100, (1, length))
    aux = torch.randn(1, length, 96)
    batch = {"input_ids": ids, "aux": aux, "last": torch.randn(1, length, 32),
             "loss_mask": torch.ones(1, length, dtype=torch.bool), "valid": torch.ones(1, length, dtype=torch.bool)}
    teacher = Teacher(torch.randn(100, 32), torch.arange(40))
    trained_logits = []

    def recording_loss(logits, probs, counts):  # rows are the predicted positions p; step k predicts p = t+2+k at t
        trained_logits.append(logits[t + 2 + len(trained_logits)])
        return step_metrics(logits, probs, counts)

    with torch.no_grad():
        ttt_forward(model, batch, teacher, steps, 0.8, recording_loss)
        logits, hidden, kv = model.decode(ids[:, 1:t + 2], aux[:, :t + 1], torch.arange(t + 1)[None])
        served = [logits[0, -1]]
        hidden, position = hidden[:, -1:], t
        fixed_position = served.copy()
        fixed_hidden, fixed_kv = hidden, kv
        for k in range(1, steps):
            position += 1
            token = ids[:, t + 1 + k: t + 2 + k]
            logits, hidden, kv = model.decode(token, hidden, torch.tensor([[position]]), kv)
            served.append(logits[0, -1])
            logits, fixed_hidden, fixed_kv = model.decode(token, fixed_hidden, torch.tensor([[t]]), fixed_kv)
            fixed_position.append(logits[0, -1])
    for k in range(steps):
        torch.testing.assert_close(trained_logits[k], served[k], atol=1e-5, rtol=1e-5)
        assert trained_logits[k].argmax() == served[k].argmax()
    # the check can fail: a chain that keeps the last real position (the old rule) computes other logits
    assert not torch.allclose(trained_logits[steps - 1], fixed_position[steps - 1], atol=1e-3)


def dense_ttt_reference(model, batch, teacher, steps, decay):
    """The objective over every position [B, T, K], with the counted positions masked: what the head on the
    counted rows alone must equal."""
    ids = batch["input_ids"]
    batch_size, length = ids.shape
    positions = torch.arange(length).expand(batch_size, length)
    probs, in_draft, _ = teacher.targets(batch["last"])
    predictable = batch["loss_mask"] & batch["valid"]
    hidden, cache, total, metrics = batch["aux"], TTTKV(explicit_ttt_attention), torch.zeros(()), []
    for k in range(steps):
        span = max(length - 2 - k, 0)
        logits, hidden, cache = model(shift_left(ids, 1 + k), hidden, positions + k, cache)
        counts = predictable[:, 2 + k:] & in_draft[:, 1 + k: 1 + k + span]
        step = step_metrics(logits[:, :span], probs[:, 1 + k: 1 + k + span], counts)
        total = total + decay ** k * step.pop("mean_loss")
        metrics.append(step)
    return total, metrics


@pytest.mark.parametrize("argmax_outside", [True, False], ids=["some-argmax-outside", "every-argmax-inside"])
def test_the_head_on_counted_rows_equals_the_objective_over_every_position(argmax_outside):
    torch.manual_seed(3)
    model = Drafter(tiny_config())
    batch_size, length, steps = 3, 14, 4
    loss_mask = torch.rand(batch_size, length) < 0.6
    loss_mask[:, :2] = True  # positions too early for a step must not count
    loss_mask[:, -1] = True  # the last position counts
    valid = torch.ones(batch_size, length, dtype=torch.bool)
    valid[1, 9:] = False  # a padded row, its padding marked as loss positions: only `valid` keeps them out
    loss_mask[1, 9:] = True
    batch = {"input_ids": torch.randint(0, 100, (batch_size, length)), "aux": torch.randn(batch_size, length, 96),
             "last": torch.randn(batch_size, length, 32), "loss_mask": loss_mask, "valid": valid}
    draft_ids, head = torch.arange(0, 80, 2), torch.randn(100, 32)
    if not argmax_outside:  # rows outside the draft give logit 0, below the best of 40 random draft logits
        head[~torch.isin(torch.arange(100), draft_ids)] = 0
    teacher = Teacher(head, draft_ids)
    assert teacher.targets(batch["last"])[1].all() != argmax_outside
    results = []
    for objective in (ttt_forward, dense_ttt_reference):
        model.zero_grad()
        total, metrics = objective(model, batch, teacher, steps, 0.8)
        total.backward()
        results.append((total, metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (sparse, sparse_metrics, sparse_grads), (dense, dense_metrics, dense_grads) = results
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)
    for ours, reference in zip(sparse_metrics, dense_metrics, strict=True):
        assert ours["count"] == reference["count"] and ours["correct"] == reference["correct"]
        torch.testing.assert_close(ours["loss"], reference["loss"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours["accept"], reference["accept"], rtol=1e-5, atol=1e-5)
    assert sparse_grads.keys() == dense_grads.keys() and "lm_head.weight" in sparse_grads
    for name, grad in sparse_grads.items():
        torch.testing.assert_close(grad, dense_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_collate_lists_the_counted_positions_the_objective_would_find_on_the_device():
    torch.manual_seed(4)
    lengths, masks = [7, 11, 4], [[0, 0, 1, 1, 0, 1, 1], [0] * 3 + [1] * 8, [1, 0, 0, 1]]
    sequences = [{"input_ids": torch.randint(0, 100, (n,)), "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                  "aux_hidden_states": torch.randn(n, 3, 32), "last_hidden_states": torch.randn(n, 32)}
                 for n, mask in zip(lengths, masks, strict=True)]
    batch = collate(sequences, max_seq_len=10, pad_multiple=4)  # the second row cut at 10, rows padded to 12
    expected = [(row, t) for row, mask in enumerate(masks) for t, counted in enumerate(mask[:10]) if counted]
    assert [tuple(pair) for pair in batch["predicted"].T.tolist()] == expected
    model, teacher = Drafter(tiny_config()), Teacher(torch.randn(100, 32), torch.arange(0, 80, 2))
    listed, _ = ttt_forward(model, batch, teacher, 3, 0.8)
    found, _ = ttt_forward(model, {k: v for k, v in batch.items() if k != "predicted"}, teacher, 3, 0.8)
    assert torch.equal(listed, found)


def test_shift_left_pads_with_the_fill_value():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 2, 9).tolist() == [[3, 4, 9, 9]]
    assert shift_left(x, 0) is x


def test_step_metrics_on_a_hand_made_case():
    # 3 positions, draft vocab of 3. Position 2 does not count.
    logits = torch.log(torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]]))
    teacher = torch.tensor([[[0.6, 0.3, 0.1], [0.5, 0.25, 0.25], [0.0, 0.0, 1.0]]])
    counts = torch.tensor([[True, True, False]])
    metrics = step_metrics(logits, teacher, counts)
    assert float(metrics["count"]) == 2
    assert float(metrics["correct"]) == 1  # position 0 right (0 vs 0), position 1 wrong (2 vs 0)
    # sum(min(p, q)): position 0: .6+.2+.1 = .9; position 1: .1+.1+.25 = .45
    assert math.isclose(float(metrics["accept"]), 0.9 + 0.45, rel_tol=1e-5)
    expected_loss = -(0.6 * math.log(0.7) + 0.3 * math.log(0.2) + 0.1 * math.log(0.1)) \
        - (0.5 * math.log(0.1) + 0.25 * math.log(0.1) + 0.25 * math.log(0.8))
    assert math.isclose(float(metrics["loss"]), expected_loss, rel_tol=1e-5)


def test_a_cooler_teacher_sharpens_towards_the_same_argmax():
    torch.manual_seed(0)
    head, draft_ids, last = torch.randn(100, 32), torch.arange(40), torch.randn(2, 5, 32)
    plain, in_draft, _ = Teacher(head, draft_ids).targets(last)
    sharp, sharp_in_draft, _ = Teacher(head, draft_ids, temperature=0.5).targets(last)
    assert torch.equal(plain.argmax(-1), sharp.argmax(-1)) and torch.equal(in_draft, sharp_in_draft)
    # softmax(z / 0.5) is softmax(z) squared, renormalised
    torch.testing.assert_close(sharp, plain ** 2 / (plain ** 2).sum(-1, keepdim=True))
    assert bool((sharp.max(-1).values > plain.max(-1).values).all())
    capped = Teacher(head, draft_ids, softcap=5.0, temperature=0.5).targets(last)[0]  # cap first, as the target
    logits = 5.0 * torch.tanh((last @ head[draft_ids].T) / 5.0)
    torch.testing.assert_close(capped, torch.softmax(logits / 0.5, dim=-1))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return tiny_target_with_store(tmp_path_factory.mktemp("tiny"))


def schedule_settings(seed: int) -> TrainSettings:
    return from_section(TrainSettings, schema_defaults("train") | {"batch_tokens": 8192, "pad_multiple": 64,
                                                                 "max_seq_len": 2048, "seed": seed})


def settings(**overrides) -> TrainSettings:
    return from_section(TrainSettings, schema_defaults("train") | {
        "ttt_steps": 3, "learning_rate": 3e-3, "warmup_steps": 2, "epochs": 6, "batch_tokens": 256, "max_seq_len": 64,
        "checkpoint_every": 3, "log_every": 1, "num_workers": 0, "device": "cpu"} | overrides)


def test_loss_decreases_and_metrics_are_logged(tiny_run, tmp_path):
    target_dir, store, vocab_path = tiny_run
    train([store], target_dir, vocab_path, tmp_path / "state", settings())
    rows = read_metrics(tmp_path / "state" / "metrics.csv")
    assert len(rows) >= 10
    first, last = rows[0], rows[-1]
    assert last["loss"] < 0.7 * first["loss"]
    assert last["acc_0"] > first["acc_0"]
    assert {"acc_0", "acc_2", "accept_1", "loss_2", "tokens_per_s"} <= set(last)


def test_resume_after_a_kill_ends_with_the_same_weights(tiny_run, tmp_path):
    target_dir, store, vocab_path = tiny_run
    straight = train([store], target_dir, vocab_path, tmp_path / "straight", settings(num_workers=1))
    train([store], target_dir, vocab_path, tmp_path / "resumed", settings(num_workers=1), stop_after_step=4)
    resumed = train([store], target_dir, vocab_path, tmp_path / "resumed", settings(num_workers=1))
    for name, tensor in straight.trainable_state_dict().items():
        assert torch.equal(tensor, resumed.trainable_state_dict()[name]), name
    straight_rows = read_metrics(tmp_path / "straight" / "metrics.csv")
    resumed_rows = read_metrics(tmp_path / "resumed" / "metrics.csv")
    assert [r["step"] for r in resumed_rows] == [r["step"] for r in straight_rows]
    assert [r["loss"] for r in resumed_rows] == pytest.approx([r["loss"] for r in straight_rows], rel=1e-6)


def same_weights(a, b) -> bool:
    return all(torch.equal(tensor, b.trainable_state_dict()[name]) for name, tensor in a.trainable_state_dict().items())


def test_a_finished_run_or_changed_settings_train_from_step_0(tiny_run, tmp_path, caplog):
    target_dir, store, vocab_path = tiny_run
    state = tmp_path / "state"
    first = train([store], target_dir, vocab_path, state, settings(epochs=2))
    steps = [r["step"] for r in read_metrics(state / "metrics.csv")]
    assert steps == list(range(1, len(steps) + 1))
    with caplog.at_level(logging.WARNING, logger="eagle3_pipeline.stages.train"):
        again = train([store], target_dir, vocab_path, state, settings(epochs=2, log_every=2))  # e.g. `-R train`
    assert "it is the end of a finished run" in caplog.text and "training from step 0" in caplog.text
    assert same_weights(first, again)  # trained again from scratch, deterministically
    assert [r["step"] for r in read_metrics(state / "metrics.csv")] == steps[1::2]
    caplog.clear()
    train([store], target_dir, vocab_path, state, settings(epochs=2), stop_after_step=3)  # a killed run
    with caplog.at_level(logging.WARNING, logger="eagle3_pipeline.stages.train"):
        changed = train([store], target_dir, vocab_path, state, settings(epochs=2, learning_rate=1e-3, seed=1))
    assert "changed since it was written: train.learning_rate: 0.003 -> 0.001; train.seed: 0 -> 1;" in caplog.text
    assert not same_weights(first, changed)
    fresh = train([store], target_dir, vocab_path, tmp_path / "fresh", settings(epochs=2, learning_rate=1e-3, seed=1))
    assert same_weights(fresh, changed)
    changed_rows, fresh_rows = read_metrics(state / "metrics.csv"), read_metrics(tmp_path / "fresh" / "metrics.csv")
    assert [(r["step"], r["loss"]) for r in changed_rows] == [(r["step"], r["loss"]) for r in fresh_rows]


def test_the_fingerprint_names_changed_stores_vocab_and_target(tiny_run, tmp_path):
    target_dir, store, vocab_path = tiny_run
    other_target, other_store, other_vocab = tiny_target_with_store(tmp_path, seed=1)
    base = run_fingerprint([store], target_dir, vocab_path, settings(), 1)
    assert fingerprint_changes(base, run_fingerprint([store], target_dir, vocab_path, settings(num_workers=3,
                                                     log_every=5, checkpoint_every=7), 1)) == []
    assert fingerprint_changes(base, run_fingerprint([other_store], other_target, other_vocab, settings(), 2)) == [
        "world size: 1 -> 2", "hidden store hidden.zarr content", "draft vocab content", "target model content"]
    assert fingerprint_changes(base, run_fingerprint([store, other_store], target_dir, vocab_path, settings(), 1)) \
        == ["hidden stores: 1 -> 2"]
    assert fingerprint_changes(None, base) == ["no fingerprint recorded (written by an older version)"]
    # a setting added since a checkpoint was written, at the value that trains as before, is no change to it
    assert "teacher_temperature" not in base["settings"]
    assert fingerprint_changes(base, run_fingerprint([store], target_dir, vocab_path, settings(teacher_temperature=0.5),
                                                     1)) == ["train.teacher_temperature: None -> 0.5"]


def test_a_data_error_in_a_loader_worker_is_one_line():
    """What a DataLoader worker's error looks like in the training process, reduced to its own line."""
    loader = torch.utils.data.DataLoader(CorruptDataset(), batch_size=None, num_workers=1)
    with pytest.raises(zarr_io.CorruptChunk) as error:
        next(iter(loader))
    assert "Traceback" in str(error.value)
    assert data_error_line(error.value) == "store.zarr: array aux_hidden_states, chunk 3 is corrupt"


class CorruptDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int):
        raise zarr_io.CorruptChunk("store.zarr: array aux_hidden_states, chunk 3 is corrupt")


def test_training_refuses_an_invalid_store(tiny_run, tmp_path):
    target_dir, store, vocab_path = tiny_run
    broken = tmp_path / "broken.zarr"
    import shutil

    shutil.copytree(store, broken)
    zarr.open_group(str(broken), mode="r+").attrs["complete"] = False
    with pytest.raises(hidden_store.InvalidStore, match="not a complete"):
        train([broken], target_dir, vocab_path, tmp_path / "state", settings())


def test_export_has_exact_names_shapes_dtypes_and_same_logits(tiny_run, tmp_path):
    target_dir, store, vocab_path = tiny_run
    model = train([store], target_dir, vocab_path, tmp_path / "state", settings(epochs=1)).eval()
    config = model.config
    h, k, v = config.hidden_size, config.draft_vocab_size, config.vocab_size
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    expected_shapes = {
        "fc.weight": (h, 3 * config.target_hidden_size), "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,), "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h), "midlayer.self_attn.o_proj.weight": (h, heads * d),
        "midlayer.mlp.gate_proj.weight": (config.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (config.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, config.intermediate_size), "norm.weight": (h,),
        "lm_head.weight": (k, h), "d2t": (k,), "t2d": (v,),
    }
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        out = tmp_path / f"serving-{dtype}"
        export.export(model, out, dtype=dtype)
        with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
            names = set(handle.keys())
            assert names == set(expected_shapes)
            for name, shape in expected_shapes.items():
                tensor = handle.get_tensor(name)
                assert tuple(tensor.shape) == shape, name
                expected_dtype = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch_dtype)
                assert tensor.dtype == expected_dtype, name
        served = json.loads((out / "config.json").read_text())
        assert served["architectures"] == ["LlamaForCausalLMEagle3"] and served["num_hidden_layers"] == 1
        assert served["draft_vocab_size"] == k and served["vocab_size"] == v
        assert served["target_hidden_size"] == config.target_hidden_size and served["tie_word_embeddings"] is False
        assert served["eagle_aux_hidden_state_layer_ids"] == config.aux_layer_ids
        assert served["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in config.aux_layer_ids]
        assert served["torch_dtype"] == dtype
        loaded = drafting.load_served(out, embedding=model.embed_tokens.weight.detach())
        sequence = hidden_store.HiddenStore(store).sequence(0)
        ids = sequence["input_ids"][None]
        aux = sequence["aux_hidden_states"].reshape(1, len(ids[0]), -1).float()
        positions = torch.arange(ids.shape[1])[None]
        with torch.no_grad():
            reference = model(ids, aux, positions)[0]
            served_logits = loaded(ids, aux, positions)[0]
        if dtype == "float32":
            assert torch.equal(reference, served_logits)
        else:
            torch.testing.assert_close(served_logits, reference, atol=0.1, rtol=0.05)
        assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)



def test_a_wider_drafter_mlp_is_trained_exported_and_fingerprinted(tiny_run, tmp_path):
    target_dir, store, vocab_path = tiny_run
    target_width = load_config(target_dir).intermediate_size
    model = train([store], target_dir, vocab_path, tmp_path / "state",
                  settings(drafter_intermediate_size=3 * target_width)).eval()
    assert model.midlayer.mlp.up_proj.weight.shape[0] == 3 * target_width
    export.export(model, tmp_path / "serving", dtype="float32")
    assert json.loads((tmp_path / "serving" / "config.json").read_text())["intermediate_size"] == 3 * target_width
    reloaded = drafting.load_served(tmp_path / "serving", embedding=model.embed_tokens.weight.detach())
    assert torch.equal(reloaded.midlayer.mlp.down_proj.weight, model.midlayer.mlp.down_proj.weight)
    fingerprint = json.loads((tmp_path / "state" / "fingerprint.json").read_text())
    assert fingerprint["settings"]["drafter_intermediate_size"] == 3 * target_width


def test_chains_off_the_targets_greedy_path_weigh_what_off_path_weight_says():
    """Step k's position p is on the path when the drafted tokens p-k .. p-1 are the target's greedy tokens (and
    assistant tokens): the weights the loss gets are 1 there and off_path_weight elsewhere, so the loss can only
    fall as chains leave the path, and a batch wholly on the path trains as the plain objective does."""
    torch.manual_seed(5)
    model = Drafter(tiny_config())
    batch_size, length, steps, broken, prompt = 2, 16, 4, (0, 7), (1, 9)
    teacher = Teacher(torch.randn(100, 32), torch.arange(0, 80, 2))
    last = torch.randn(batch_size, length, 32)
    greedy = teacher.targets(last)[2]
    ids = torch.randint(0, 100, (batch_size, length))
    ids[:, 1:] = greedy[:, :-1]  # every token the target's greedy one after its prefix
    batch = {"input_ids": ids, "aux": torch.randn(batch_size, length, 96), "last": last,
             "loss_mask": torch.ones(batch_size, length, dtype=torch.bool),
             "valid": torch.ones(batch_size, length, dtype=torch.bool)}
    rows, predicted = batch["loss_mask"].nonzero(as_tuple=True)

    def loss_with(weight: float, recorded: list) -> torch.Tensor:
        def recording(logits, probs, counts, weights=None):
            recorded.append(torch.ones_like(counts, dtype=torch.float) if weights is None else weights)
            return step_metrics(logits, probs, counts, weights)
        with torch.no_grad():
            return ttt_forward(model, batch, teacher, steps, 0.8, recording, off_path_weight=weight)[0]

    plain, on_path = loss_with(1.0, []), []
    torch.testing.assert_close(loss_with(0.0, on_path), plain)
    assert all(bool((w[predicted >= 2 + k] == 1).all()) for k, w in enumerate(on_path))  # the counted rows
    ids[broken] = (greedy[broken[0], broken[1] - 1] + 1) % 100  # a data token the target would not draft
    batch["loss_mask"][prompt] = False  # a prompt token: never drafted
    rows, predicted = batch["loss_mask"].nonzero(as_tuple=True)
    weights = []
    off = loss_with(0.25, weights)
    for k, step_weights in enumerate(weights):
        counted, off_path = predicted >= 2 + k, torch.zeros_like(predicted, dtype=torch.bool)
        for (b, q) in (broken, prompt):
            off_path |= (rows == b) & (predicted - k <= q) & (predicted - 1 >= q)
        assert int((off_path & counted).sum()) == 2 * k  # k positions of each row see q among their drafts
        assert bool((step_weights[off_path & counted] == 0.25).all())
        assert bool((step_weights[~off_path & counted] == 1).all())
    assert off < loss_with(1.0, [])
    # a weight scales its position's share of the step's mean over every counted position
    logits, probs = torch.randn(5, 40), torch.softmax(torch.randn(5, 40), -1)
    counts = torch.tensor([True, True, True, False, True])
    weights = torch.tensor([1.0, 0.25, 0.0, 1.0, 1.0])
    cross_entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(step_metrics(logits, probs, counts, weights)["mean_loss"],
                               (cross_entropy * weights)[counts].sum() / 4)


def test_a_head_started_from_the_target_holds_its_rows_of_the_draft_vocabulary(tiny_run, tmp_path):
    target_dir, store, vocab_path = tiny_run
    _, lm_head = read_head(target_dir)
    from_target = build_drafter(target_dir, vocab_path, [1, 2, 3], seed=0, head_init="target")
    draft_rows = lm_head[from_target.draft_to_target(torch.arange(from_target.config.draft_vocab_size))].float()
    assert torch.equal(from_target.lm_head.weight, draft_rows)
    assert not torch.allclose(build_drafter(target_dir, vocab_path, [1, 2, 3], seed=0).lm_head.weight, draft_rows)
    train([store], target_dir, vocab_path, tmp_path / "state", settings(epochs=1, head_init="target"))
    fingerprint = json.loads((tmp_path / "state" / "fingerprint.json").read_text())
    assert fingerprint["settings"]["head_init"] == "target"
    # at "random" it trains as before the setting existed: no change to a checkpoint written then
    assert "head_init" not in run_fingerprint([store], target_dir, vocab_path, settings(), 1)["settings"]


@pytest.mark.slow
def test_flex_ttt_attention_equals_the_explicit_one():
    """The fused kernel's block mask (GPU training) against the explicit scores, on CPU (forward only:
    flex has no CPU backward) through flex's eager implementation: inductor's CPU flex kernel, which training
    never uses, gave wrong rows for some shapes on an AVX2-only host (torch 2.13). Padding included: only
    valid rows are compared."""
    torch.manual_seed(0)
    model = Drafter(tiny_config()).eval()
    batch, length = 2, 40
    ids = torch.randint(0, 100, (batch, length))
    positions = torch.arange(length).expand(batch, length)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, 29:] = False
    hidden = torch.randn(batch, length, 96)

    @torch.no_grad()
    def unroll(flex: bool) -> list[torch.Tensor]:
        kernel = functools.partial(flex_ttt_attention, compiled=False) if flex else explicit_ttt_attention
        cache, h, logits = TTTKV(kernel), hidden, []
        for _ in range(4):
            out, h, cache = model(ids, h, positions, cache)
            logits.append(out[valid])
        return logits

    for eager, flex in zip(unroll(False), unroll(True), strict=True):
        torch.testing.assert_close(flex, eager, atol=1e-5, rtol=1e-5)



@pytest.mark.slow
def test_flex_attention_where_it_cannot_train_falls_back_to_the_explicit_kernel(caplog):
    """CPU flex_attention has no backward: asked for flex there, training gets the explicit kernel and says why."""
    with caplog.at_level(logging.INFO, logger="test"):
        kernel = choose_ttt_attention("flex", torch.device("cpu"), logging.getLogger("test"))
    assert kernel is explicit_ttt_attention
    assert "flex attention unavailable on cpu" in caplog.text and "backward" in caplog.text
    assert choose_ttt_attention("auto", torch.device("cpu"), logging.getLogger("test")) is explicit_ttt_attention


def test_the_greedy_packer_closes_a_batch_when_rows_times_widest_exceed_the_budget():
    assert pack_greedy([5, 4, 4, 3, 1], 12) == [[0, 1], [2, 3, 4]]  # 3 x 5 > 12; then 3 x 4 = 12 fits
    assert pack_greedy([20, 3, 3], 12) == [[0], [1, 2]]  # a row wider than the budget travels alone
    assert pack_greedy([], 12) == []


def test_the_batch_schedule_covers_each_epoch_once_within_the_budget_and_groups_lengths():
    """Every sequence once per epoch, batches within batch_tokens at the padded width, a pure function of
    (seed, epoch); on ShareGPT-like lengths, grouping by length fills far more batch slots with real tokens
    than packing the shuffled order as it comes."""
    rng = np.random.default_rng(0)
    lengths = [np.clip(rng.lognormal(np.log(600), 0.9, size=n), 32, 2048).astype(np.int64) for n in (300, 100)]
    settings = schedule_settings(seed=3)
    batches = epoch_batches(lengths, settings, 0)
    items = [(s, j) for s in (0, 1) for j in range(len(lengths[s]))]
    assert sorted(item for batch in batches for item in batch) == items
    assert all(len(batch) * max(padded_width(lengths[s][j], 64) for s, j in batch) <= 8192 for batch in batches)
    assert epoch_batches(lengths, settings, 0) == batches
    assert epoch_batches(lengths, settings, 1) != batches
    assert epoch_batches(lengths, schedule_settings(seed=4), 0) != batches

    def real_share(packed: list[list[tuple[int, int]]]) -> float:
        slots = sum(len(batch) * max(padded_width(lengths[s][j], 64) for s, j in batch) for batch in packed)
        return sum(int(lengths[s][j]) for batch in packed for s, j in batch) / slots

    shuffled = [items[i] for i in rng.permutation(len(items))]
    ungrouped = [[shuffled[m] for m in members] for members in
                 pack_greedy([padded_width(lengths[s][j], 64) for s, j in shuffled], 8192)]
    assert real_share(batches) > 0.85 and real_share(ungrouped) < 0.65

def test_offline_acceptance_counts_the_leading_matching_drafts():
    """A hand-made case: the drafter's chain matches the target's greedy tokens for exactly a known number of
    steps at each position, so tau(k) is known in closed form."""
    from eagle3_pipeline.drafter import offline_acceptance

    torch.manual_seed(0)
    model = Drafter(tiny_config()).eval()
    model.d2t.zero_()  # draft id i is target id i
    length, steps = 10, 3
    ids = torch.randint(0, 100, (1, length))
    batch = {"input_ids": ids, "aux": torch.randn(1, length, 96), "last": torch.randn(1, length, 32),
             "loss_mask": torch.ones(1, length, dtype=torch.bool), "valid": torch.ones(1, length, dtype=torch.bool)}
    drafts = []
    with torch.no_grad():  # what the drafter proposes at every (step, position), engine positions
        hidden, cache = batch["aux"], TTTKV()
        for k in range(steps):
            logits, hidden, cache = model(shift_left(ids, 1 + k), hidden, torch.arange(length)[None] + k, cache)
            drafts.append(logits[0].argmax(-1))
    # The target's greedy token at t+1+k is made the step-k draft at t for the first positions (later positions
    # overwrite earlier ones, so the expected lengths are counted below); `last` rows are one-hot position codes.
    greedy = torch.full((length,), 99)
    for t in range(4):
        for k in range(steps):
            greedy[t + 1 + k] = drafts[k][t]  # later positions overwrite earlier ones: compute expectations below
    lm_head = torch.zeros(100, length)  # [V, H]
    batch["last"] = torch.eye(length)[None]  # position p's state is one-hot p
    for p in range(length):
        lm_head[int(greedy[p]), p] = 1.0
    expected = []
    for t in range(length - 2):
        accepted = 0
        while accepted < steps and t + 2 + accepted < length \
                and int(drafts[accepted][t]) == int(greedy[t + 1 + accepted]):
            accepted += 1
        expected.append(accepted)
    result = offline_acceptance.estimate(model, lm_head, [batch], steps, torch.device("cpu"))
    assert result.positions == length - 2
    for k in range(1, steps + 1):
        assert math.isclose(result.tau[k - 1], 1 + sum(min(a, k) for a in expected) / len(expected), rel_tol=1e-6)
    assert result.tau[0] > 1.0  # the planted matches are found
    # the greedy tokens of a batch index: computed on first use, read after (the held-out batches every epoch)
    kept: dict[int, torch.Tensor] = {}
    assert offline_acceptance.estimate(model, lm_head, [batch], steps, torch.device("cpu"), greedy=kept) == result
    assert torch.equal(kept[0], greedy[None])
    kept[0] = torch.full_like(kept[0], 98)  # no draft is 98: a read cache matches nothing
    assert offline_acceptance.estimate(model, lm_head, [batch], steps, torch.device("cpu"), greedy=kept).tau[0] == 1.0


def test_heldout_estimate_every_epoch_keeps_the_best_weights_and_resumes(tiny_run, tmp_path):
    from safetensors.torch import load_file

    target_dir, store, vocab_path = tiny_run
    straight = train([store], target_dir, vocab_path, tmp_path / "straight", settings(), heldout_paths=[store])
    rows = read_metrics(tmp_path / "straight" / "heldout_estimate.csv")
    assert [int(r["epoch"]) for r in rows] == list(range(1, 7))
    assert rows[-1]["tau_k1"] > rows[0]["tau_k1"]  # training moved the estimate
    best = max(rows, key=lambda r: r["tau_k3"])  # settings(): 3 TTT steps, so select_k 4 is capped at 3
    kept = load_file(str(tmp_path / "straight" / "best.safetensors"))
    for name, tensor in straight.trainable_state_dict().items():
        assert torch.equal(tensor, kept[name]), name
    result = summary(tmp_path / "straight", settings())
    assert result["heldout_estimate"]["kept"]["step"] == best["step"]
    train([store], target_dir, vocab_path, tmp_path / "resumed", settings(), stop_after_step=5,
          heldout_paths=[store])
    resumed = train([store], target_dir, vocab_path, tmp_path / "resumed", settings(), heldout_paths=[store])
    assert read_metrics(tmp_path / "resumed" / "heldout_estimate.csv") == rows
    for name, tensor in straight.trainable_state_dict().items():
        assert torch.equal(tensor, resumed.trainable_state_dict()[name]), name
