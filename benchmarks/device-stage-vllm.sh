#!/usr/bin/env bash
# Stage vLLM 0.26.0 for the GPU device (no network; Python 3.12, torch 2.11.0+cu130 and the image's packages)
# in pieces that fit the 64 MiB carry limit. Run it after ../shared/hooks/device-stage.sh (which empties
# .device), never before: it leaves .device/1 .. .device/3 alone.
#
# Run from the project root:   benchmarks/device-stage-vllm.sh
# It fills .device/4 .. .device/N (git-ignored), each holding one equal chunk (at most PART_MIB, default 60, MiB
# with its unpack.sh; the repo's own files travel beside it) of one tar.xz of a site directory (about 375 MB
# unpacked, 124 MB packed: two parts), and prints the calls to make. It takes about 3 minutes (xz -9).
# Each .device/N/unpack.sh, run on the device from the repo root, copies its chunk to $E3_ROOT/vllm-parts
# (E3_ROOT defaults to /opt/e3); the last one joins the chunks, checks the sha256 and extracts with python3's
# tarfile (stdlib only) into
#   /opt/e3/vllm          (vllm and what it imports that the image lacks)
# Make the calls back to back: the device keeps /opt only while it stays warm (about 30 s after a call returns).
# After the last part:  export PYTHONPATH=/opt/e3/vllm:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
#
# Staged (cp312 / abi3 manylinux x86_64 wheels, --no-deps; pins satisfy vllm 0.26.0's Requires-Dist):
#   vllm 0.26.0 minus: vllm_flash_attn/_vllm_fa2_C*.so (305 MB; its import is guarded and an H200 (sm_90) takes
#     FA3, _vllm_fa3_C, which stays), the vllm-rs frontend binary (43 MB, only for the Rust serve frontend),
#     deep_gemm's _C for Pythons other than 3.12, and the bundled C/C++ headers (include/ dirs, *.h, *.cuh:
#     deep_gemm's and fmha_sm100's JIT sources, used only for FP8 block GEMMs and Blackwell MLA)
#   module-level imports on the path  from vllm import LLM -> engine start -> LLM.generate (eagle3):
#     pydantic 2.14.4 + pydantic-core 2.50.5, annotated-types 0.8.0, typing-inspection 0.4.5,
#     typing-extensions 4.16.0 (pydantic needs >= 4.16), msgspec 0.23.0, pyzmq 27.3.0, cachetools 8.0.2,
#     cbor2 6.3.0, pybase64 1.5.1, partial-json-parser 0.2.1.1.post7, openai-harmony 0.0.8,
#     openai 2.54.0 (the last 2.x: 3.x needs httpx2) + jiter 0.19.0, sniffio 1.3.1, distro 1.9.0,
#     httpx 0.29.0, httpcore 1.0.9, h11 0.16.0, anyio 4.16.0 (the image has these four; staged so that openai's
#     requirements hold whatever versions it has), fastapi 0.136.3 + starlette 1.10.0, annotated-doc 0.0.7
#   imported inside functions on that path: depyf 0.20.0 (+ astor 0.8.1, dill 0.4.1; torch.compile's
#     decompile), setproctitle 1.3.8 (worker titles; guarded), blake3 1.0.11 (multimodal input hashing)
#   structured-output backends (imported through LazyLoader when a request or the engine asks for one):
#     xgrammar 0.2.7 (0.2.8+ need apache-tvm-ffi >= 0.1.11, vllm pins 0.1.10) + apache-tvm-ffi 0.1.10,
#     llguidance 1.7.6 (manylinux_2_31: needs glibc >= 2.31 there), outlines-core 0.2.14,
#     lm-format-enforcer 0.11.3 + interegular 0.3.3
# Not staged:
#   in the image already (KINDS.md's package list; imported at module top on the path): torch, triton,
#     transformers (5.17.0 >= vllm's 5.5.3), tokenizers, huggingface_hub, numpy, regex, requests, urllib3,
#     psutil, packaging, pyyaml, jinja2, tqdm, safetensors, aiohttp, cloudpickle, py-cpuinfo, pillow,
#     prometheus-client, uvloop, einops, filelock, sentencepiece, protobuf, tiktoken, setuptools, six, certifi,
#     idna, numba (ngram proposer only; the image has it), opencv-python-headless (imported guarded anyway)
#   guarded or only imported off this path: flashinfer (the run sets VLLM_USE_FLASHINFER_SAMPLER=0; the
#     FlashInfer backend is not chosen on Hopper), ray (ray_utils, guarded), xformers, mistral_common and ijson
#     (Mistral tokenizers/tool parser), compressed-tensors (quantized checkpoints), gguf, torchao, tilelang,
#     quack, nvidia-cutlass-dsl (FA4/Blackwell paths), humming-kernels, tokenspeed-mla (MLA), deep_ep,
#     fastsafetensors, runai, tensorizer, opentelemetry (guarded), modelscope (VLLM_USE_MODELSCOPE only),
#     torchaudio/torchvision/torchcodec/PyNvVideoCodec/av/soundfile/soxr/scipy (multimodal; guarded),
#     mcp, anthropic, prometheus-fastapi-instrumentator, model-hosting-container-standards, watchfiles,
#     python-json-logger, lark, jsonschema, uvicorn (the OpenAI server, `vllm serve`, and its tools; without
#     them vllm.entrypoints.openai.api_server does not import, which the offline LLM never does)
#   lm-format-enforcer 0.11.3's vllm integration (lmformatenforcer.integrations.vllm) fails to import against
#     vllm 0.26.0 itself (it wants vllm.transformers_utils.tokenizer.MistralTokenizer): that backend only serves
#     requests that ask for guided_decoding_backend lm-format-enforcer; xgrammar and guidance are unaffected
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
git check-ignore -q .device/4 || echo '/.device/' >> "$(git rev-parse --git-path info/exclude)"

first=4                                   # .device/1 .. .device/3 belong to ../shared/hooks/device-stage.sh
max_bytes=$(( ${PART_MIB:-60} * 1024 * 1024 - 65536 ))   # a chunk, leaving room for its unpack.sh
cache=${E3_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/e3-device-wheels}   # downloads survive reruns
mkdir -p "$cache"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. the wheels (pip download skips a file already in $cache). VLLM_WHEEL=path uses a wheel downloaded before.
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
pins=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0 msgspec==0.23.0 pyzmq==27.3.0 cachetools==8.0.2 cbor2==6.3.0 pybase64==1.5.1
      partial-json-parser==0.2.1.1.post7 openai-harmony==0.0.8 openai==2.54.0 jiter==0.19.0 sniffio==1.3.1
      distro==1.9.0 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 fastapi==0.136.3 starlette==1.10.0
      annotated-doc==0.0.7 depyf==0.20.0 astor==0.8.1 dill==0.4.1 setproctitle==1.3.8 blake3==1.0.11
      xgrammar==0.2.7 apache-tvm-ffi==0.1.10 llguidance==1.7.6 outlines-core==0.2.14 lm-format-enforcer==0.11.3
      interegular==0.3.3)
vllm_whl=${VLLM_WHEEL:-$cache/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl}
if [[ ! -f "$vllm_whl" ]]; then
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$cache" vllm==0.26.0 2>&1 \
    | grep -v "^WARNING: Location" || true
fi
python3 -m pip download -q --no-deps "${plat[@]}" -d "$cache" "${pins[@]}" 2>&1 | grep -v "^WARNING: Location" || true
[[ -f "$vllm_whl" ]] || { echo "no vllm wheel at $vllm_whl"; exit 1; }

# 2. one site directory: each pinned wheel (exactly one file per pin) plus vllm, unzipped
site=$tmp/site
mkdir -p "$site"
wheels=("$vllm_whl")
for p in "${pins[@]}"; do
  stem=${p%%==*}; stem=${stem,,}; stem=${stem//-/_}-${p#*==}-   # a wheel's file name: name_with_underscores-ver-
  found=()
  for w in "$cache"/*.whl; do
    b=$(basename "$w")
    if [[ ${b,,} == "$stem"* ]]; then found+=("$w"); fi
  done
  (( ${#found[@]} == 1 )) || { echo "expected one wheel for $p in $cache, found ${#found[@]}"; exit 1; }
  wheels+=("${found[0]}")
done
for w in "${wheels[@]}"; do
  python3 -m zipfile -e "$w" "$site"
done
# a wheel's .data/purelib and platlib belong in the site dir; its scripts and headers are not needed
for d in "$site"/*.data; do
  [[ -d "$d" ]] || continue
  for lib in purelib platlib; do
    [[ -d "$d/$lib" ]] && cp -a "$d/$lib/." "$site/"
  done
  rm -rf "$d"
done

# 3. strip what an H200 run does not load
rm -f "$site"/vllm/vllm_flash_attn/_vllm_fa2_C*.so "$site"/vllm/vllm-rs
find "$site/vllm/third_party/deep_gemm" -maxdepth 1 -name '_C.cpython-*.so' ! -name '_C.cpython-312-*' -delete
find "$site" -type d -name include -prune -exec rm -rf {} +
find "$site" -type f \( -name '*.h' -o -name '*.cuh' \) -delete
find "$site" -type d -name __pycache__ -prune -exec rm -rf {} +
find "$site" -depth -type d -empty -delete
echo "staged site: $(du -sh "$site" | cut -f1)"

# 4. one tar.xz (files grouped by suffix, so that like compresses with like), split into chunks
(cd "$site" && find . -type f | awk -F/ '{n=$NF; s=(n ~ /\./) ? n : ""; sub(/^[^.]*/, "", s); print s "\t" $0}' \
  | LC_ALL=C sort | cut -f2- > "$tmp/files")
tar -C "$site" --owner=0 --group=0 --numeric-owner -cf - --no-recursion -T "$tmp/files" \
  | xz -9 -T0 > "$tmp/vllm.tar.xz"
sum=$(sha256sum "$tmp/vllm.tar.xz" | cut -d' ' -f1)
total=$(stat -c %s "$tmp/vllm.tar.xz")
n=$(( (total + max_bytes - 1) / max_bytes ))               # as few parts as fit, all of one size
split -b $(( (total + n - 1) / n )) -d -a 2 "$tmp/vllm.tar.xz" "$tmp/vllm.tar.xz.part"
chunks=("$tmp"/vllm.tar.xz.part*)
last=$(( first + n - 1 ))

# 5. .device/4 .. .device/$last, rebuilt from scratch (higher-numbered leftovers of an earlier run go too)
mkdir -p .device
for d in .device/*/; do
  i=$(basename "$d")
  if [[ $i =~ ^[0-9]+$ ]] && (( i >= first )); then rm -rf "$d"; fi
done
names=""
for (( k = 0; k < n; k++ )); do
  names+=" $(basename "${chunks[k]}")"
done
for (( k = 0; k < n; k++ )); do
  i=$(( first + k ))
  mkdir -p ".device/$i"
  mv "${chunks[k]}" ".device/$i/"
  {
    echo "# part $i of .device/$first .. .device/$last (benchmarks/device-stage-vllm.sh); run from the repo root"
    echo "set -euo pipefail"
    echo "part=$i; first=$first; last=$last; sum=$sum; names=\"${names# }\""
    cat <<'UNPACK'
E3_ROOT=${E3_ROOT:-/opt/e3}
parts=$E3_ROOT/vllm-parts
if [[ $part == "$first" ]]; then rm -rf "$parts"; fi
mkdir -p "$parts"
cp .device/"$part"/vllm.tar.xz.part* "$parts/"
if [[ $part == "$last" ]]; then
  for f in $names; do
    [[ -f $parts/$f ]] || { echo "missing $f: run .device/$first .. .device/$last unpack.sh back to back"; exit 1; }
  done
  (cd "$parts" && cat $names) > "$E3_ROOT/vllm.tar.xz"
  echo "$sum  $E3_ROOT/vllm.tar.xz" | sha256sum -c -
  rm -rf "$parts" "$E3_ROOT/vllm"
  python3 - "$E3_ROOT/vllm.tar.xz" "$E3_ROOT/vllm" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
PY
  rm -f "$E3_ROOT/vllm.tar.xz"
  echo "vllm staged in $E3_ROOT/vllm: export PYTHONPATH=$E3_ROOT/vllm:\${PYTHONPATH:-}"
fi
echo "part $part unpacked"
UNPACK
  } > ".device/$i/unpack.sh"
done

du -sh .device/*
echo "Make these device runs back to back (the device forgets /opt once it goes cold):"
for (( i = first; i < last; i++ )); do
  echo "  run(carry=[\".device/$i\"], command=\"bash .device/$i/unpack.sh\")"
done
echo "  run(carry=[\".device/$last\"], command=\"bash .device/$last/unpack.sh && export PYTHONPATH=/opt/e3/vllm:\$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 && python3 -c 'import vllm; from vllm import LLM; print(vllm.__version__)'\")"
echo "then in the same or the next call: export PYTHONPATH=/opt/e3/vllm:\$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0; <your command>"
