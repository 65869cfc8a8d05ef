"""The parity check through the real snakemake CLI: a planted off-by-one stops the run before extraction, and
an SGLang backend without its server URLs is refused at parse time."""

from __future__ import annotations

import pytest

from eagle3_pipeline.runtime.target.loading import load_model
from tests.conftest import base_config, run_snakemake, sglang_server_info, sglang_servers
from tests.workflow.conftest import tiny_data_config

pytestmark = pytest.mark.workflow
HF_IDS = [2, 15, 27]  # SmolLM2's defaults (30 blocks)


def test_snakemake_stops_at_parity_before_extracting(tmp_path, target_dir):
    config, _ = tiny_data_config(tmp_path, target_dir, shards=1)
    info = sglang_server_info("aux")
    info.pop("return_aux_hidden_state_layer_ids")
    aux, last = sglang_servers(load_model(target_dir, "cpu"), HF_IDS, aux_info=info)  # the planted off-by-one
    config["extract"] = {**config["extract"], "backend": "sglang",  # a generous request timeout: no race on a slow CPU
                         "sglang": {"aux_url": aux.url, "final_url": last.url, "timeout_s": 600, "retries": 0}}
    config["parity"] = {**config["parity"], "sequences": 2, "max_tokens": 48}
    try:
        result = run_snakemake(tmp_path, config, "results/tiny/hidden/shard-00000.zarr", check=False)
    finally:
        aux.close(), last.close()
    assert result.returncode != 0
    log = (tmp_path / "logs" / "tiny" / "parity.log").read_text()
    assert "parity check FAILED for backend sglang" in log and "off by +1" in log
    assert not (tmp_path / "results" / "tiny" / "hidden").exists()
    assert not (tmp_path / "results" / "tiny" / "parity" / "sglang.json").exists()


def test_sglang_config_without_urls_is_rejected_at_parse_time(tmp_path):
    config = base_config(extract={"backend": "sglang"})
    result = run_snakemake(tmp_path, config, "-n", check=False)
    assert result.returncode != 0 and "extract.sglang.aux_url" in result.stderr + result.stdout
