"""GPU claims on a machine of several GPUs: jobs spread over the devices they may use, share only when they
outnumber them, and a claim ends with its process (lock files and a stand-in for Snakemake's script object: no GPU
needed to test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from eagle3_pipeline import gpu_claims
from tests.conftest import REPO, rules_taking_a_gpu


def test_jobs_take_the_least_claimed_gpus_and_share_only_when_they_outnumber_them(tmp_path):
    first, first_files = gpu_claims.claim(1, ["0", "1"], tmp_path)
    second, second_files = gpu_claims.claim(1, ["0", "1"], tmp_path)
    third, third_files = gpu_claims.claim(1, ["0", "1"], tmp_path)
    assert (first, second, third) == (["0"], ["1"], ["0"])
    assert gpu_claims.held_slots(tmp_path, "0") == 2 and gpu_claims.held_slots(tmp_path, "1") == 1
    for handle in first_files + third_files:
        handle.close()  # those jobs ended
    pair, pair_files = gpu_claims.claim(2, ["0", "1", "2", "3"], tmp_path)
    assert pair == ["0", "2"]  # GPU 1 is still held: a DDP job gets two free ones
    for handle in second_files + pair_files:
        handle.close()


def test_a_claim_ends_with_its_process_however_it_ends(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from eagle3_pipeline import gpu_claims\n"
        f"chosen, files = gpu_claims.claim(1, ['0', '1'], Path({str(tmp_path)!r}))\n"
        "print(chosen, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={"PYTHONPATH": str(REPO / "src")})
    assert holder.stdout.readline().strip() == "['0']"
    assert gpu_claims.claim(1, ["0", "1"], tmp_path)[0] == ["1"]  # ours, closed when its files are collected
    holder.kill()
    holder.wait()
    assert gpu_claims.held_slots(tmp_path, "0") == 0


def test_a_job_chooses_among_the_gpus_it_was_given():
    assert gpu_claims.machine_gpus({"CUDA_VISIBLE_DEVICES": "3"}) == ["3"]
    assert gpu_claims.machine_gpus({"CUDA_VISIBLE_DEVICES": "2, 5,-1,6"}) == ["2", "5"]  # CUDA stops at -1 too
    assert gpu_claims.machine_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def job(rule: str, gpu: int, device: str = "auto") -> SimpleNamespace:
    """What a rule's script gets as `snakemake`, as far as claims read it."""
    section = gpu_claims.DEVICE_SECTION[rule]
    return SimpleNamespace(rule=rule, resources={"gpu": gpu}, config={section: {"device": device}} if section else {})


@pytest.fixture
def claims_machine(tmp_path, monkeypatch):
    """A private temporary directory for the claims; the process's claims are dropped afterwards."""
    monkeypatch.setattr(gpu_claims.tempfile, "tempdir", str(tmp_path))
    held: list = []
    monkeypatch.setattr(gpu_claims, "_held", held)
    yield tmp_path
    for handle in held:
        handle.close()


def claimed(monkeypatch, visible: str, snakemake: SimpleNamespace) -> str:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpu_claims.claim_for_job(snakemake)
    return os.environ["CUDA_VISIBLE_DEVICES"]


def test_claim_for_job_gives_single_device_stages_one_gpu_and_training_its_gpus(claims_machine, monkeypatch):
    assert claimed(monkeypatch, "4,5", job("extract", 1)) == "4"
    assert claimed(monkeypatch, "4,5", job("evaluate", 1)) == "5"
    assert claimed(monkeypatch, "4,5,6,7", job("parity", 2)) == "6"  # a share above one: still one device
    assert claimed(monkeypatch, "4,5,6,7", job("train", 2)) == "4,7"  # 7 free, then the first of the least held
    assert claimed(monkeypatch, "4,5", job("extract", 1, device="cuda:1")) == "4,5"  # the config chose: untouched
    assert claimed(monkeypatch, "4,5", job("extract", 0)) == "4,5"  # takes no GPU
    assert claimed(monkeypatch, "4", job("train", 2)) == "4"  # one visible: nothing to choose
    assert oct(claims_machine.joinpath(f"eagle3-gpu-claims-{os.getuid()}").stat().st_mode & 0o777) == "0o700"


def test_a_claims_directory_others_can_write_is_refused(claims_machine):
    shared = claims_machine / f"eagle3-gpu-claims-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(gpu_claims.ClaimsDirError, match="no one else can write"):
        gpu_claims.claims_dir()
    shared.rmdir()
    shared.symlink_to(claims_machine)
    with pytest.raises(gpu_claims.ClaimsDirError):
        gpu_claims.claims_dir()


def test_every_rule_that_takes_a_gpu_claims_it_before_its_stage_starts():
    for name, block in rules_taking_a_gpu().items():
        assert name in gpu_claims.DEVICE_SECTION, f"rule {name}: gpu_claims does not know its device setting"
        script = REPO / "scripts" / re.search(r'"\.\./scripts/(\w+\.py)"', block).group(1)
        code = script.read_text()
        assert code.index("claim_for_job(") < code.index("eagle3_pipeline.stages"), f"rule {name}"
