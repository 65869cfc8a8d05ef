"""The target stage through the real snakemake CLI: a copy of another run's target leaves that run alone."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.conftest import base_config, run_snakemake

pytestmark = pytest.mark.workflow


def file_digests(directory) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir()) if f.is_file()}


def test_copying_another_runs_target_changes_none_of_its_files(tmp_path, target_dir):
    before = file_digests(target_dir)
    run_snakemake(tmp_path, base_config(run="copy", target={"source": str(target_dir)}), "results/copy/target")
    copy = tmp_path / "results" / "copy" / "target"
    assert file_digests(target_dir) == before  # the other run's identity.json included
    assert json.loads((target_dir / "identity.json").read_text())["source"]["kind"] == "gguf"
    identity = json.loads((copy / "identity.json").read_text())
    assert identity["source"] == {"kind": "hf-directory", "path": str(target_dir)}
    assert identity["content_hash"] == json.loads((target_dir / "identity.json").read_text())["content_hash"]
    # only files nothing rewrites may share an inode with the source
    shared = {f.name for f in copy.iterdir() if (target_dir / f.name).exists()
              and (target_dir / f.name).stat().st_ino == f.stat().st_ino}
    assert "identity.json" not in shared and "model.safetensors" in shared  # the weights are linked, not copied
    assert shared <= set(before) - {"identity.json"}
