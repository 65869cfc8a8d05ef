"""The parity check (HF reference vs backend) and the SGLang client against responses in SGLang's shape
(the same through snakemake: tests/workflow/test_workflow_parity.py)."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest

from eagle3_pipeline.runtime.extraction import sglang_layer_ids
from eagle3_pipeline.runtime.extraction.hf import HFBackend
from eagle3_pipeline.runtime.extraction.sglang import SGLangBackend, SGLangError, prefill_states
from eagle3_pipeline.runtime.target import loading
from eagle3_pipeline.stages import parity
from tests.conftest import DATA, sglang_server_info, sglang_servers

LOG = logging.getLogger("test")
HF_IDS = [2, 15, 27]  # SmolLM2's defaults (30 blocks)


@pytest.fixture(scope="module")
def model(target_dir):
    return loading.load_model(target_dir, "cpu")


@pytest.fixture(scope="module")
def sequences(smollm2_tokenizer):
    texts = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
             "Paris is the capital of France, and Rome is the capital of Italy."]
    return [np.asarray(smollm2_tokenizer(t)["input_ids"], dtype=np.int32) for t in texts]


def test_hf_backend_passes(model, sequences):
    report = parity.check(HFBackend(model, HF_IDS), model, sequences, LOG)
    assert report.passed, report.problems
    assert report.aux_cosine["15"]["15"] > 0.9999 and report.argmax_agreement == 1.0
    assert report.last_cosine_post_norm > 0.9999 > report.last_cosine_pre_norm


def test_catches_a_planted_off_by_one_layer_id(model, sequences):
    shifted = HFBackend(model, [3, 15, 27])  # captures HF index 3 ...
    shifted.info = dataclasses.replace(shifted.info, aux_layer_ids=(2, 15, 27))  # ... but says it is 2
    try:
        report = parity.check(shifted, model, sequences, LOG)
    finally:
        for hook in shifted.hooks:
            hook.remove()
    assert not report.passed and len(report.problems) == 1
    assert "labelled HF index 2 but matches HF index 3" in report.problems[0]
    assert "off by +1" in report.problems[0]


def test_sglang_response_shape_is_parsed():
    response = json.loads((DATA / "sglang" / "generate_response_shape.json").read_text())["response"]
    assert prefill_states(response[0], 3, 6, "u", 0).shape == (3, 6)
    assert prefill_states(response[1], 2, 6, "u", 1)[1].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    with pytest.raises(SGLangError, match=r"shape \(2, 6\), expected \(3, 6\).*prefix cache"):
        prefill_states(response[1], 3, 6, "u", 1)


def test_sglang_client_reproduces_hf_states_and_passes_parity(model, sequences):
    aux, last = sglang_servers(model, sglang_layer_ids(HF_IDS))
    try:
        backend = SGLangBackend(aux.url, last.url, HF_IDS, 30, 576)
        states = backend.extract(sequences)
        report = parity.check(backend, model, sequences, LOG)
    finally:
        aux.close(), last.close()
    assert backend.info.name == "sglang" and backend.info.version == "0.5.23"
    assert states[0].aux.shape == (len(sequences[0]), 3, 576) and states[0].last.shape == (len(sequences[0]), 576)
    assert aux.requests == last.requests == 2  # one batched request per server and call
    assert report.passed, report.problems


def test_sglang_server_given_hf_indices_is_caught(model, sequences):
    # The classic mistake: HF indices passed to --return-aux-hidden-state-layer-ids. A server that reports
    # its ids fails the flag check at once; one that does not is caught by parity.
    with pytest.raises(SGLangError, match=r"layer-ids is \[2, 15, 27\], expected \[1, 14, 26\]"):
        reports_hf_ids = sglang_server_info("aux", return_aux_hidden_state_layer_ids=HF_IDS)
        aux, last = sglang_servers(model, HF_IDS, aux_info=reports_hf_ids)
        try:
            SGLangBackend(aux.url, last.url, HF_IDS, 30, 576)
        finally:
            aux.close(), last.close()
    info = sglang_server_info("aux")
    info.pop("return_aux_hidden_state_layer_ids")
    aux, last = sglang_servers(model, HF_IDS, aux_info=info)
    try:
        report = parity.check(SGLangBackend(aux.url, last.url, HF_IDS, 30, 576), model, sequences, LOG)
    finally:
        aux.close(), last.close()
    assert len(report.problems) == 3 and all("off by +1" in p for p in report.problems)


def test_sglang_pre_norm_final_state_is_caught(model, sequences):
    aux, last = sglang_servers(model, sglang_layer_ids(HF_IDS), final="pre_norm")
    try:
        report = parity.check(SGLangBackend(aux.url, last.url, HF_IDS, 30, 576), model, sequences, LOG)
    finally:
        aux.close(), last.close()
    assert any("BEFORE the final norm" in p for p in report.problems)
    assert report.argmax_agreement < parity.ARGMAX_AGREEMENT, report.argmax_agreement
    print("pre-norm argmax agreement", report.argmax_agreement)


def test_sglang_wrong_flags_fail_before_any_work(model):
    aux, last = sglang_servers(model, sglang_layer_ids(HF_IDS),
                               aux_info=sglang_server_info("aux", chunked_prefill_size=8192),
                               final_info=sglang_server_info("final", disable_radix_cache=False))
    try:
        with pytest.raises(SGLangError) as error:
            SGLangBackend(aux.url, last.url, HF_IDS, 30, 576)
    finally:
        aux.close(), last.close()
    assert "--chunked-prefill-size -1" in str(error.value) and "--disable-radix-cache" in str(error.value)
    assert aux.requests == last.requests == 0


@pytest.mark.skipif(not __import__("os").environ.get("E3_SGLANG_AUX_URL"),
                    reason="opt-in: set E3_SGLANG_AUX_URL, E3_SGLANG_FINAL_URL and E3_SGLANG_TARGET_DIR")
def test_real_sglang_servers():
    import os
    from pathlib import Path

    target_dir = Path(os.environ["E3_SGLANG_TARGET_DIR"])
    config = loading.load_config(target_dir)
    ids = [2, config.num_hidden_layers // 2, config.num_hidden_layers - 3]
    backend = SGLangBackend(os.environ["E3_SGLANG_AUX_URL"], os.environ["E3_SGLANG_FINAL_URL"], ids,
                            config.num_hidden_layers, config.hidden_size)
    reference = loading.load_model(target_dir, "cuda" if __import__("torch").cuda.is_available() else "cpu")
    tokenizer = loading.load_tokenizer(target_dir)
    sequences = [np.asarray(tokenizer("Speculative decoding drafts tokens.")["input_ids"], dtype=np.int32)]
    report = parity.check(backend, reference, sequences, LOG)
    assert report.passed, report.problems
