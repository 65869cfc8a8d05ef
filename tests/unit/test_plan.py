"""Disk-plan sizes of the stages that do not scale with tokens, against the real artifacts they plan."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from eagle3_pipeline import assets, plan, plan_fixed, target_shape
from eagle3_pipeline.config_schema import schema_defaults
from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.runtime.target.loading import load_config
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.stages import train
from eagle3_pipeline.training import resume


def test_target_copy_estimate_matches_the_materialised_gguf_target(target_dir, tmp_path):
    planned = plan_fixed.target_copy(tmp_path / "not-yet", str(assets.resolve("smollm2-gguf")), None, None)
    actual = plan_fixed.directory_bytes(target_dir)
    assert planned.pending_bytes == planned.total_bytes and 0.97 < actual / planned.total_bytes < 1.03
    done = plan_fixed.target_copy(target_dir, "unused", None, None)
    assert done.total_bytes == actual and done.pending_bytes == 0


def test_drafter_estimates_match_a_real_checkpoint_weights_and_export(target_dir, tmp_path):
    dims = target_shape.target_dims(target_dir, "unused")
    gguf_dims = target_shape.target_dims(tmp_path, str(assets.resolve("smollm2-gguf")))
    assert dims == gguf_dims  # the GGUF's header and the converted config agree
    draft_vocab = 4096
    model = Drafter(DrafterConfig.from_target(load_config(target_dir), draft_vocab, [2, 15, 27]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == plan_fixed.drafter_parameters(dims, draft_vocab)
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates both AdamW moments for every trainable weight
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    checkpoint = tmp_path / "checkpoint.pt"
    resume.save_checkpoint(checkpoint, model, optimizer, scheduler, 1,
                          from_section(train.TrainSettings, schema_defaults("train") | {"max_seq_len": 2048}))
    weights = tmp_path / "drafter.safetensors"
    save_file({k: v.contiguous() for k, v in model.trainable_state_dict().items()}, str(weights),
              metadata={"drafter_config": json.dumps(model.config.as_dict())})
    export = tmp_path / "export.safetensors"
    save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in model.trainable_state_dict().items()}, str(export))
    train_stage, serving = plan_fixed.drafter_stages(dims, draft_vocab, "bfloat16", tmp_path / "w", tmp_path / "s")
    actual_train = checkpoint.stat().st_size + weights.stat().st_size
    assert 0.97 < actual_train / train_stage.total_bytes < 1.03
    assert 0.97 < export.stat().st_size / serving.total_bytes < 1.03


def test_a_configured_hidden_size_the_target_overrides_is_warned_about():
    dims = {"hidden_size": 576}
    assert plan_fixed.planned_hidden_size(dims, None, "x") == (576, [])
    assert plan_fixed.planned_hidden_size(dims, 576, "x") == (576, [])
    size, warnings = plan_fixed.planned_hidden_size(dims, 4096, "x")
    assert size == 576 and "plan.target_hidden_size (4096) is ignored" in warnings[0]
    size, warnings = plan_fixed.planned_hidden_size(None, None, "org/model")
    assert size is None and "plan.target_hidden_size" in warnings[0]


def test_the_preflight_counts_only_the_stages_that_will_run(tmp_path):
    tokens = plan.StagePlan("tokens", 5, 2.5, [plan.ShardPlan("00000", 1000, False)])
    hidden = plan.StagePlan("hidden", 4613, 3300, [plan.ShardPlan("00000", 1000, False)])
    target = plan.FixedStage("target", 10_000, 0, "estimate")
    disk = plan.DiskPlan([tokens, hidden], tmp_path, free=5_000, fixed=[target])
    assert not disk.fits and disk.pending == 2500 + 3_300_000 + 10_000
    assert not disk.fits_for({"ingest", "tokenize", "vocab", "target"})  # the target copy alone is 10 kB
    assert disk.fits_for({"ingest", "tokenize", "vocab"})
    assert "not run" in "\n".join(disk.lines({"tokenize"}))
    blind = plan.DiskPlan([tokens], tmp_path, free=5_000, hidden_size_unknown=True)
    assert blind.blind_for(None) and blind.blind_for({"extract"}) and not blind.blind_for({"tokenize", "vocab"})
