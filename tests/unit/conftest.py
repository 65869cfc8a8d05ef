"""Helpers of the unit tests: tiny random-weight Llama targets built in memory (for hook/parity and model tests),
a real target directory with a token shard, its hidden-state store and a draft vocab, and one drafter trained on it
that the decoding tests share (`trained_tiny`), and the regeneration tests' conversations and settings."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_pipeline.config_schema import schema_defaults
from eagle3_pipeline.runtime.generation import Prompt, tokenize_histories
from eagle3_pipeline.stages import regenerate


def tiny_llama(layers: int = 6, hidden: int = 64, vocab: int = 256, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def tiny_target_with_store(tmp_path, sequences: int = 24, layers: int = 6, hidden: int = 64, vocab: int = 256,
                           draft_vocab: int = 200, seed: int = 0):
    """A real (random-weight) target directory, one token shard, its hidden-state store and a draft vocab."""
    import logging

    import numpy as np

    from eagle3_pipeline import vocab as vocab_module
    from eagle3_pipeline.formats import draft_vocab as draft_vocab_format
    from eagle3_pipeline.formats import token_shards
    from eagle3_pipeline.runtime.extraction.hf import HFBackend
    from eagle3_pipeline.stages.extract import extract_shard
    from eagle3_pipeline.tokenization import TokenizedConversation

    model = tiny_llama(layers=layers, hidden=hidden, vocab=vocab, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # a confident teacher, like a real LM (random init is near uniform)
    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir)
    rng = np.random.default_rng(seed)
    # Repetitive sequences (a few motifs) so there is something learnable.
    motifs = [rng.integers(0, vocab, size=8) for _ in range(4)]
    data = []
    for i in range(sequences):
        ids = np.concatenate([motifs[(i + j) % 4] for j in range(int(rng.integers(3, 8)))]).astype(np.int32)
        mask = np.ones(len(ids), np.uint8)
        mask[:4] = 0
        data.append(TokenizedConversation(f"s{i}", ids, mask))
    shard_path = tmp_path / "tokens.zarr"
    token_shards.write(shard_path, data, {})
    store = tmp_path / "hidden.zarr"
    extract_shard(HFBackend(model), shard_path, store, token_budget=512, writer_threads=2, metadata={},
                  log=logging.getLogger("tiny"))
    counts = vocab_module.count_tokens(np.concatenate([d.input_ids for d in data]),
                                       np.concatenate([d.loss_mask for d in data]), vocab)
    vocab_path = tmp_path / "vocab.safetensors"
    draft_vocab_format.write(vocab_path, vocab_module.select(counts, draft_vocab))
    return target_dir, store, vocab_path


def build_trained_tiny(folder):
    """A drafter trained (8 epochs, 3 TTT steps) on `tiny_target_with_store`'s motif data and exported, all under
    `folder` (target/, hidden.zarr, serving/)."""
    from eagle3_pipeline.config_schema import schema_defaults
    from eagle3_pipeline.settings import from_section
    from eagle3_pipeline.stages import export
    from eagle3_pipeline.training.loop import train
    from eagle3_pipeline.training.settings import TrainSettings

    target_dir, store, vocab_path = tiny_target_with_store(folder)
    model = train([store], target_dir, vocab_path, folder / "state",
                  from_section(TrainSettings, schema_defaults("train") | dict(
                      ttt_steps=3, learning_rate=3e-3, warmup_steps=2, epochs=8, batch_tokens=256, max_seq_len=64,
                      checkpoint_every=100, log_every=5, num_workers=0, device="cpu")))
    export.export(model, folder / "serving", dtype="float32")


def load_trained_tiny(folder):
    """`build_trained_tiny`'s drafter loaded as a server would, with its target's runtime and store: (target
    runtime, drafter, store path)."""
    from eagle3_pipeline.runtime import drafting
    from eagle3_pipeline.runtime.decode import TargetRuntime
    from eagle3_pipeline.runtime.target.loading import load_model

    drafter = drafting.load_served_for(folder / "target", folder / "serving", torch.float32)
    target = TargetRuntime(load_model(folder / "target", "cpu", torch.float32), drafter.config.aux_layer_ids)
    return target, drafter, folder / "hidden.zarr"


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """The tiny trained drafter, built once per test run (the pytest workers share it) and loaded by each worker:
    the decoding tests only read it (each builds the runtimes and proposers it needs around the shared target model
    and drafter)."""
    from tests.conftest import built_once

    with built_once(tmp_path_factory, "trained-tiny") as (folder, built):
        if not built:
            build_trained_tiny(folder)
    return load_trained_tiny(folder)


def smollm2_serving_dir(target_dir, out, draft_vocab_size: int = 2048, seed: int = 0):
    """An untrained SmolLM2-shaped drafter, exported as the pipeline exports a trained one."""
    from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
    from eagle3_pipeline.runtime.target.loading import load_config
    from eagle3_pipeline.stages import export

    torch.manual_seed(seed)
    config = DrafterConfig.from_target(load_config(target_dir), draft_vocab_size, [2, 15, 27])
    drafter = Drafter(config)
    drafter.t2d[:draft_vocab_size] = True  # the draft vocab: the first ids (d2t stays 0)
    export.export(drafter, out, dtype="float32")
    return out


# ------------------------------------------------------------------ regeneration
CHATS = [
    {"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"},
                             {"role": "assistant", "content": "Paris."},
                             {"role": "user", "content": "And of Italy?"},
                             {"role": "assistant", "content": "Rome."}]},
    {"id": "b", "messages": [{"role": "system", "content": "Answer in one word."},
                             {"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": "Blue."}]},
    {"id": "c", "messages": [{"role": "user", "content": "Say hello."},
                             {"role": "assistant", "content": "Hello!"},
                             {"role": "user", "content": "Now count to three."}]},  # trailing user turn
]


def regeneration_settings(**overrides) -> regenerate.Settings:
    """The regenerate section's defaults, sized for tests on a CPU (10 new tokens, batches of 2, fp32)."""
    defaults = regenerate.regenerate_settings(schema_defaults("regenerate"), max_seq_len=512)
    return dataclasses.replace(defaults, **{"max_new_tokens": 10, "batch_size": 2, "device": "cpu",
                                            "dtype": "float32", **overrides})


def word_prompts(histories):
    """Prompts for the server engine, which sends the messages and reads no token ids: a stand-in for the
    tokenizer's ids, a token per word plus a template's few per message (what the context limit counts)."""
    return [Prompt(list(history), [0] * sum(len(message["content"].split()) + 4 for message in history))
            for history in histories]


def target_prompts(tokenizer):
    """What the stage prepares a round's histories with: rendered with the target's chat template, tokenized."""
    return lambda histories: tokenize_histories(tokenizer, histories, {}, max_characters=10**9)
