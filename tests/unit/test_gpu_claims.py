"""GPU claims on a machine of several GPUs: jobs spread over the devices, share only when they outnumber them,
and a claim ends with its process (lock files, no GPU needed to test)."""

from __future__ import annotations

import re
import subprocess
import sys

from eagle3_pipeline import gpu_claims
from tests.conftest import REPO


def test_jobs_take_the_least_claimed_gpus_and_share_only_when_they_outnumber_them(tmp_path):
    first, first_files = gpu_claims.claim(1, [0, 1], tmp_path)
    second, second_files = gpu_claims.claim(1, [0, 1], tmp_path)
    third, third_files = gpu_claims.claim(1, [0, 1], tmp_path)
    assert (first, second, third) == ([0], [1], [0])
    assert gpu_claims.held_slots(tmp_path, 0) == 2 and gpu_claims.held_slots(tmp_path, 1) == 1
    for handle in first_files + third_files:
        handle.close()  # those jobs ended
    pair, pair_files = gpu_claims.claim(2, [0, 1, 2, 3], tmp_path)
    assert pair == [0, 2]  # GPU 1 is still held: a DDP job gets two free ones
    for handle in second_files + pair_files:
        handle.close()


def test_a_claim_ends_with_its_process_however_it_ends(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from eagle3_pipeline import gpu_claims\n"
        f"chosen, files = gpu_claims.claim(1, [0, 1], Path({str(tmp_path)!r}))\n"
        "print(chosen, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={"PYTHONPATH": str(REPO / "src")})
    assert holder.stdout.readline().strip() == "[0]"
    assert gpu_claims.claim(1, [0, 1], tmp_path)[0] == [1]  # ours, closed when its files are collected
    holder.kill()
    holder.wait()
    assert gpu_claims.held_slots(tmp_path, 0) == 0


def test_nothing_is_claimed_where_the_devices_are_already_chosen():
    assert gpu_claims.machine_gpus({"CUDA_VISIBLE_DEVICES": "3"}) == []


def test_every_rule_that_takes_a_gpu_claims_it_before_its_stage_starts():
    for smk in sorted((REPO / "rules").glob("*.smk")):
        text = smk.read_text()
        names = re.findall(r"^\s*rule (\w+):", text, flags=re.M)
        for name, block in zip(names, re.split(r"^\s*rule \w+:", text, flags=re.M)[1:], strict=True):
            if re.search(r"^\s+gpu=", block, flags=re.M):
                script = REPO / "scripts" / re.search(r'"\.\./scripts/(\w+\.py)"', block).group(1)
                code = script.read_text()
                assert code.index("claim_for_job(") < code.index("eagle3_pipeline.stages"), f"rule {name}"
