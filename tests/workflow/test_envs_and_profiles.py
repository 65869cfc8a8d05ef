"""Conda environments agree with pyproject; every rule names its env; the SLURM profile plans GPU jobs."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, SNAKEMAKE, rules_taking_a_gpu


def pip_requirements(env_file: Path) -> list[str]:
    env = yaml.safe_load(env_file.read_text())
    pip = [entry for entry in env["dependencies"] if isinstance(entry, dict)]
    assert len(pip) == 1, f"{env_file}: one pip section expected"
    return pip[0]["pip"]


def normalised(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement).lower()


def test_pipeline_env_matches_pyproject():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    env = pip_requirements(REPO / "envs" / "pipeline.yaml")
    assert sorted(map(normalised, env)) == sorted(map(normalised, declared))
    python = next(d for d in yaml.safe_load((REPO / "envs" / "pipeline.yaml").read_text())["dependencies"]
                  if isinstance(d, str) and d.startswith("python"))
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert python == "python" + requires


def test_sglang_env_pins_a_version_with_aux_hidden_states():
    (requirement,) = pip_requirements(REPO / "envs" / "sglang.yaml")
    assert requirement.startswith("sglang") and ">=0.5.23" in requirement


def test_every_rule_runs_in_a_named_env():
    for smk in sorted((REPO / "rules").glob("*.smk")):
        text = smk.read_text()
        rules = re.findall(r"^rule (\w+):", text, flags=re.M)
        blocks = re.split(r"^rule \w+:", text, flags=re.M)[1:]
        for name, block in zip(rules, blocks, strict=True):
            match = re.search(r'conda:\n\s+"([^"]+)"', block)
            assert match, f"{smk.name}: rule {name} has no conda: directive"
            assert (smk.parent / match.group(1)).resolve().is_file(), f"rule {name}: {match.group(1)} missing"


# regenerate takes a GPU only with the hf and vllm engines; the profile's example (the 8B) regenerates through
# an OpenAI-compatible server that holds the GPUs, so the job stays on the CPU partition (the profile says so)
ON_CPU_PARTITION = {"regenerate"}


def test_the_slurm_profile_sends_every_rule_that_can_take_a_gpu_to_the_gpu_partition():
    profiled = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())["set-resources"]
    for name in rules_taking_a_gpu():  # other rules fit the profile's CPU defaults
        assert name in profiled, f"rule {name} takes a GPU but profiles/slurm sizes it not"
        partition = profiled[name].get("slurm_partition", "cpu")
        assert partition == ("cpu" if name in ON_CPU_PARTITION else "gpu"), f"rule {name}: partition {partition}"


def slurm_dry_run(tmp_path: Path, example: str) -> str:
    result = subprocess.run([SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                             "--workflow-profile", str(REPO / "profiles" / "slurm"),
                             "--configfile", str(REPO / "config" / "examples" / example), "-n"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def job_resources(output: str, rule: str) -> list[str]:
    return re.findall(rf"rule {rule}:\n(?:    .*\n)*?    resources: (.*)", output)


@pytest.mark.workflow
def test_slurm_profile_plans_gpu_jobs_for_the_8b_example(tmp_path):
    output = slurm_dry_run(tmp_path, "llama31-8b-slurm.yaml")
    assert "Disk plan" in output and "hidden" in output
    train = job_resources(output, "train")
    assert len(train) == 1 and "gpu=2" in train[0] and "slurm_partition=gpu" in train[0]
    assert "runtime=1440" in train[0] and "mem_mb=128000" in train[0]
    extract = job_resources(output, "extract")
    # 32 training shards and the held-out store; SGLang holds the GPUs
    assert len(extract) == 33 and all("gpu=0" in r and "disk_mb=" in r for r in extract)
    assert all("gpu=1" in r for r in job_resources(output, "parity") + job_resources(output, "evaluate"))
    assert all("slurm_partition=gpu" in r for rule in ("parity", "evaluate", "evaluate_timing")
               for r in job_resources(output, rule))
    assert len(job_resources(output, "regenerate")) == 33  # the 32 training shards and the selection conversations


@pytest.mark.workflow
def test_slurm_profile_gives_hf_extraction_one_gpu_per_shard(tmp_path):
    output = slurm_dry_run(tmp_path, "gpu-smollm2.yaml")
    extract = job_resources(output, "extract")
    # 8 training shards and the held-out store
    assert len(extract) == 9 and all("gpu=1" in r and "slurm_partition=gpu" in r for r in extract)
