"""The disk budget: its window plan (windows, passes, extraction groups, refusals) and training in passes, which
with one window must give the checkpoint training on the whole store gives."""

from __future__ import annotations

import pytest
import torch

from eagle3_pipeline import plan as disk_plan
from eagle3_pipeline import plan_windows
from eagle3_pipeline.config_schema import schema_defaults
from eagle3_pipeline.formats import train_state
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.training.inputs import PassJob
from eagle3_pipeline.training.loop import train
from eagle3_pipeline.training.settings import TrainSettings
from eagle3_pipeline.training.windows import Windows, train_pass
from tests.unit.conftest import tiny_target_with_store

MB = 1_000_000


def shards(*sizes_mb: float) -> dict[str, int]:
    return {f"{i:05d}": int(size * MB) for i, size in enumerate(sizes_mb)}


def test_windows_are_consecutive_shards_that_fit_beside_the_held_out_store():
    assert plan_windows.group_windows(shards(3, 3, 3, 3, 3), 1 * MB, 8 * MB) == [
        ("00000", "00001"), ("00002", "00003"), ("00004",)]
    assert plan_windows.group_windows(shards(4, 1, 1, 4), 0, 6 * MB) == [("00000", "00001", "00002"), ("00003",)]
    assert plan_windows.group_windows(shards(3, 3), 1 * MB, 100 * MB) == [("00000", "00001")]


def test_a_budget_below_one_shard_is_refused_naming_the_numbers():
    with pytest.raises(plan_windows.WindowError) as error:
        plan_windows.group_windows(shards(3, 5, 3), 1 * MB, 4 * MB)
    assert str(error.value) == ("plan.disk_budget_gb 0.004 holds no window: shard 00001's hidden store (5.0 MB) plus "
                                "the held-out store (1.0 MB) need 6.0 MB; raise data.num_shards (to about 5) or the "
                                "budget")
    with pytest.raises(plan_windows.WindowError, match="the held-out store alone fills it"):
        plan_windows.group_windows(shards(1), 2 * MB, 2 * MB)


@pytest.mark.parametrize(("windows", "epochs", "seed"), [(2, 2, 0), (3, 4, 1), (5, 3, 7), (1, 3, 0)])
def test_every_epoch_visits_every_window_and_starts_where_the_last_ended(windows, epochs, seed):
    passes = plan_windows.pass_order(windows, epochs, seed)
    assert [e for e, _ in passes] == [e for e in range(epochs) for _ in range(windows)]
    for epoch in range(epochs):
        assert sorted(w for e, w in passes if e == epoch) == list(range(windows))
    for epoch in range(1, epochs):
        assert passes[epoch * windows][1] == passes[epoch * windows - 1][1]
    groups = plan_windows.extraction_groups(passes)
    assert len(groups) == (epochs * windows - epochs + 1 if windows > 1 else 1)
    assert [p for g in groups for p in g.passes] == list(range(len(passes)))
    assert plan_windows.pass_order(windows, epochs, seed) == passes


def test_the_window_order_follows_the_seed():
    orders = {tuple(plan_windows.pass_order(6, 2, seed)) for seed in range(5)}
    assert len(orders) > 1


def test_the_plan_prints_windows_passes_groups_peak_and_extra_extraction():
    plan = plan_windows.plan(shards(3, 3, 3, 3), 1 * MB, 0.008, epochs=2, seed=0, exact=True)
    assert plan.windows == (("00000", "00001"), ("00002", "00003")) and plan.windowed
    assert plan.peak_bytes == 7 * MB and len(plan.groups) == 3 and plan.extraction_ratio == 1.5
    text = "\n".join(plan.lines())
    assert "2 windows of consecutive shards" in text
    assert "w0: shards 00000-00001 (2), 6.0 MB; extract_window disk_mb 3-3 per shard" in text
    assert "4 passes over 2 epochs" in text and "3 extraction groups" in text
    assert "peak hidden-store disk: 7.0 MB (largest window + held-out) vs budget 8.0 MB" in text
    assert "extra extraction work: 1.50x (3 window extractions for 2 windows)" in text
    assert not plan_windows.plan(shards(3, 3), 1 * MB, 1.0, epochs=2, seed=0, exact=False).windowed


def test_under_windows_the_disk_plan_counts_the_peak_when_windows_are_extracted(tmp_path):
    hidden = disk_plan.StagePlan("hidden", 4613, 3300, [disk_plan.ShardPlan(f"{i:05d}", 1000, True) for i in range(4)])
    windowed = disk_plan.DiskPlan([hidden], tmp_path, free=10**12, hidden_peak=4_000_000)
    assert windowed.pending == 4_000_000 and windowed.pending_for({"extract_window", "train_pass"}) == 4_000_000
    assert windowed.pending_for({"extract", "train"}) == 0  # without extract_window no training store is written
    assert "4.0 MB" in "\n".join(windowed.lines()) and "13.2 MB" in "\n".join(windowed.lines())


# ---------------------------------------------------------------- training in passes

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return tiny_target_with_store(tmp_path_factory.mktemp("tiny"))


def settings(**overrides) -> TrainSettings:
    return from_section(TrainSettings, schema_defaults("train") | {
        "ttt_steps": 2, "learning_rate": 3e-3, "warmup_steps": 2, "epochs": 2, "batch_tokens": 256, "max_seq_len": 64,
        "checkpoint_every": 2, "log_every": 1, "num_workers": 0, "device": "cpu"} | overrides)


def test_one_window_trained_pass_by_pass_ends_with_the_whole_store_checkpoint(tiny_run, tmp_path):
    """Two passes (one per epoch) through the pass jobs' code, the second killed inside and resumed, against
    training on the whole store: the same checkpoint, tensor for tensor."""
    target_dir, store, vocab_path = tiny_run
    train([store], target_dir, vocab_path, tmp_path / "whole", settings())
    window_store = tmp_path / "hidden_windows" / "x0" / "shard-00000.zarr"
    window_store.parent.mkdir(parents=True)
    window_store.symlink_to(store)
    windows = Windows([["00000"]], [[0, 0], [1, 0]], {"00000": store.parent / "tokens.zarr"},
                      str(tmp_path / "hidden_windows" / "x{group}" / "shard-{shard}.zarr"))
    state = tmp_path / "passes"
    first = tmp_path / "pass-000.pt"
    train_pass(windows, PassJob(0, None, first), [], {}, target_dir, vocab_path, state, settings())
    second = tmp_path / "pass-001.pt"
    middle = train_state.read_checkpoint(first)["step"] + 1
    train_pass(windows, PassJob(1, first, second), [], {}, target_dir, vocab_path, state, settings(),
               stop_after_step=middle)  # killed inside the second pass: it resumes from the state dir
    assert not second.exists() and train_state.read_checkpoint(state / "checkpoint.pt")["step"] == middle
    train_pass(windows, PassJob(1, first, second), [], {}, target_dir, vocab_path, state, settings())
    whole, passed = (train_state.read_checkpoint(p) for p in (tmp_path / "whole" / "checkpoint.pt", second))
    assert passed["step"] == whole["step"] > middle
    assert whole["model"].keys() == passed["model"].keys()
    assert all(torch.equal(whole["model"][name], passed["model"][name]) for name in whole["model"])
    moments = [(a, b) for key in whole["optimizer"]["state"] for a, b in
               zip(whole["optimizer"]["state"][key].values(), passed["optimizer"]["state"][key].values(), strict=True)]
    assert moments and all(torch.equal(a, b) for a, b in moments)
    lines = [(path / "metrics.csv").read_text().count("\n") for path in (tmp_path / "whole", state)]
    assert lines[0] == lines[1]
