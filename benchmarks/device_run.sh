#!/usr/bin/env bash
# GPU session helper (H200s), run after ../shared/hooks/device-stage.sh --with-snakemake and
# benchmarks/device-stage-extra.sh have staged, and .device/{1,2,3}/unpack.sh have unpacked, the model and wheels
# into /opt/e3. Usage: bash benchmarks/device_run.sh STAGE OUTDIR
# A session's calls must follow each other within ~30 s (the machine forgets everything once idle): repeat the
# same command at once, LIMIT ~540 with the call's timeout ~590 s; read the results after the last call.
#   compare   config/examples/gpu-smollm2.yaml on GPU 0 and a second run on GPU 1 (last GPU),
#             each through evaluation and its HTML report. The second run's overlays are $SECOND (default: the
#             data-size control benchmarks/configs/gpu-smollm2-8k.yaml), given after $DEVICE_CONFIG, so they may override it.
#             BENCH=1 first runs bench_extract.py --only-big on GPU 1; CONTROL=0 skips the second run.
#             Calls stop at $LIMIT seconds; the same command in the next call resumes both runs
#             (regeneration and evaluation keep finished work while the machine stays warm).
#   single    config/examples/gpu-smollm2.yaml plus the overlays in $SECOND (e.g. benchmarks/configs/gpu-smollm2-2gpu.yaml), every GPU
#             visible to the one run; resumable across calls like compare; ends with its HTML report.
#             BENCH_DECODE=1 then runs bench_decode.py alone on the GPU, in the call that finishes the run;
#             PROFILE=1 then (or in the next call) benchmarks/profile_loops.py on the run's drafter ($PROFILE_ARGS,
#             default 4 prompts), its output in the bundle under logs/profile/.
#             The trained drafter's weights come back in parts (drafter-part-*, drafter.sha256) for
#             bench_decode.py --serving in a later session. GPU_TESTS=1: the CUDA-only test modules, each in a
#             pytest process of its own (a CUDA fault in one would break the other's context), beside the data
#             stage of the first call; their output in the bundle under logs/gpu-tests/.
#             VLLM_SMOKE=1: vLLM (benchmarks/device-stage-vllm.sh, /opt/e3/vllm on PYTHONPATH) on the run's target
#             beside the data stage (benchmarks/vllm_smoke.py), its output in logs/vllm-smoke.txt.
#             BENCH_REGEN=1: bench_regenerate.py, eager vs compiled engine, sampled ($REGEN_ARGS) beside the data stage,
#             into logs/bench-regenerate.txt (REGEN_ARGS="... --compiled --vllm": the compiled HF engine vs vLLM's,
#             with vLLM staged and /opt/e3/vllm on PYTHONPATH).
#             WARM_COMPILE=1: the timing pass's compiling, beside training, on an untrained drafter of the run's
#             shape (warm_compile below; $WARM_ARGS must match the run's evaluate and train settings).
#             DETACH=1: snakemake runs in a process session of its own, which outlives the call while the machine
#             stays warm; the same command in the next call waits on it (nothing killed, nothing resumed). Checked on
#             the H200: a setsid process ran on across two calls 6 s apart.
#   pair      an ablation and its control on two GPUs, sharing one data stage: the example (plus $FIRST overlays)
#             runs to its hidden stores on GPU 0, a hard-linked copy of its run directory becomes the second run's
#             (no second copy of the stores on disk), then each run trains, evaluates and reports on its own GPU.
#             The second run's overlays are $SECOND; resumable across calls like compare. BENCH_DECODE=1 runs
#             bench_decode.py (bf16) on the last GPU while the data stage runs on GPU 0.
#   sequel    one GPU: the example (+ $FIRST overlays) through its report, then the same trained drafter evaluated
#             again under $SECOND overlays (e.g. bf16) in a hard-linked copy of the run; BENCH_DECODE=1 then runs
#             bench_decode.py when time is left; resumable across calls like compare.
#   arms      data ablations side by side: $ARMS lists the arms, separated by ';', each its overlays (the last
#             `run:` among them names it); $COMMON's overlays follow every arm's (the session's sizes win, e.g.
#             benchmarks/configs/gpu-smollm2-ablation-arms.yaml). Every arm runs detached, the arms' GPUs taken in
#             turn, to its tau pass (--omit-from evaluate_timing: no arm times while another computes); the same
#             command in the next call waits on them; an arm that failed stays failed (rm -r /tmp/e3-detached/<run>
#             to retry it). GPU_TESTS=1 as in single ($GPU_TEST_MODULES picks modules; 10 minutes each at most).
#             SHARED_DATA=1: arms that differ in training or draft vocabulary only: the first arm's data stage runs
#             once, to its stores (resumable across calls), and a hard-linked copy of its run directory up to the
#             stores becomes each other arm's; each arm builds its own vocabulary. Nothing checks that the arms'
#             data and extract settings agree: an arm that changes them trains on the first arm's stores all the
#             same. BENCH_REGEN=1: as in single, on the first arm's data.
#   benches   bench_train.py on GPU 0 while bench_extract.py --only-big runs on GPU 1. The device copy has no git
#             history: carry the baseline as .bench-baseline (git archive COMMIT src/eagle3_pipeline config | tar -x
#             -C .bench-baseline, ignored in .git/info/exclude); $BENCH_TRAIN_ARGS adds arguments (--only example)
#   evaluate  the tau pass alone, on a drafter that an earlier session's `single` call trained and brought back
#             ($DRAFTER, as trees): the run of the example plus $SECOND, with only ingest, target and evaluate allowed
#   ddp       benchmarks/compare_ddp.py (1 vs 2 GPUs) on the example's hidden stores
#   trees     a trained drafter carried in ($DRAFTER: a folder with an earlier `single` call's drafter-part-*,
#             drafter.sha256 and its serving config.json), timed without a pipeline run: the CUDA-only test modules,
#             bench_topk.py, bench_decode.py --trees (host then device loop, $TREE_ARGS; LOOPS=device: the device
#             loop alone); each a job in a process session of its own, so the same command in the next call waits
#             on the one still running (outputs under $OUT as <job>.txt). ~10 minutes on a fresh H200 with
#             LOOPS=device (the tests 3.5, the timing pass's compile 2.5-4.5)
# Every stage: compile caches in /tmp/e3-inductor, back in $OUT as compile-cache-part-* where they fit (8 files,
# 64 MiB); COMPILE_CACHE=<folder of those parts, carried> unpacks them before the first compile of a fresh machine.
# The overlays sized for these sessions live in benchmarks/configs/.
# Extra config comes from $DEVICE_CONFIG (default benchmarks/device-pool.yaml: the target's device path): files
# appended to every --configfile list.
# $SNAKEMAKE_ARGS: more snakemake options for every run (word-split). $PRIORITY_SET (e.g. mtbench-package): every
# run's tau pass of that prompt set first (-P results/RUN/evaluation/SET.json per run: one run's path is no target
# of another's, which Snakemake refuses).
# bench_decode.py's arguments: $BENCH_ARGS (default: 3 prompts x 64 tokens, bf16, eager and compiled).
set -uo pipefail
stage=$1 out=$2
export PYTHONPATH=/opt/e3/site:$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# inductor's and Triton's caches in one folder, so that a session's compiled kernels can come back and be carried
# into the next one ($COMPILE_CACHE: a folder with an earlier call's compile-cache-part-*): a fresh GPU otherwise
# compiles every step again (5 of the timing pass's 6 minutes)
export TORCHINDUCTOR_CACHE_DIR=/tmp/e3-inductor TRITON_CACHE_DIR=/tmp/e3-inductor/triton
if [ -n "${COMPILE_CACHE:-}" ] && [ ! -d /tmp/e3-inductor ] && ls "$COMPILE_CACHE"/compile-cache-part-* >/dev/null 2>&1
then
  mkdir -p /tmp/e3-inductor
  if cat "$COMPILE_CACHE"/compile-cache-part-* | tar xzf - -C /tmp/e3-inductor; then
    echo "compile cache: $(du -sh /tmp/e3-inductor | cut -f1) unpacked from $COMPILE_CACHE"
  else
    rm -rf /tmp/e3-inductor; echo "compile cache: unpacking $COMPILE_CACHE failed; compiling afresh"
  fi
fi
limit=${LIMIT:-500}  # leave the call ~100 s for stopping, reports and the archive
deadline=$((SECONDS + limit))
last_gpu=$(($(nvidia-smi --list-gpus | wc -l) - 1))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
example=config/examples/gpu-smollm2.yaml
arm_names=()  # the arms stage's runs (keep bundles them)
run_logs=$out  # where a run's Snakemake log goes (the arms stage: into the bundle; $OUT takes 8 files)
run_name() {  # run_name OVERLAYS...: the run the example plus OVERLAYS names (the last `run:` among them)
  grep -h '^run:' "$example" "$@" | tail -1 | awk '{print $2}'
}
read -ra second <<< "${SECOND:-benchmarks/configs/gpu-smollm2-8k.yaml}"
second_name=$(run_name "${second[@]}")

snakemake_for() {  # snakemake_for OVERLAYS...: sets $cmd, one run's snakemake command line (on top of the example)
  cmd=(python3 -m snakemake --configfile $example ${DEVICE_CONFIG:-benchmarks/device-pool.yaml} "$@" --cores all --resources gpu=4
       --scheduler greedy --rerun-incomplete ${SNAKEMAKE_ARGS:-})  # priorities: $PRIORITY_SET (pipeline)
}

bench_extract() {  # the 8B shape: as in earlier sessions (64 sequences), then 3x longer (fill/drain weigh less)
  for sequences in 64 192; do
    timeout 150 python3 benchmarks/bench_extract.py --only-big --writer-threads 16 --big-sequences $sequences 2>&1 \
      | grep -v Warning
  done
}

pipeline() {  # pipeline NAME OVERLAYS...: run to the end (or the deadline), then the report if it finished
  local name=$1; shift
  local left=$((deadline - SECONDS)) cmd
  [ $left -gt 30 ] || { echo "$name: no time left in this call"; return; }
  snakemake_for "$@" ${PRIORITY_SET:+-P "results/$name/evaluation/$PRIORITY_SET.json"}
  if [ "${DETACH:-0}" = 1 ]; then
    detached "$name" || return 0
  else
    until_deadline "$name"
  fi
  if [ "${REPORT:-1}" = 1 ] && "${cmd[@]}" -n 2>/dev/null | grep -q "Nothing to be done"; then
    "${cmd[@]}" --report "$out/$name-report.html" >> "$run_logs/$name.log" 2>&1 && echo "$name: report written"
  fi
}

until_deadline() {  # until_deadline NAME: $cmd until this call's deadline, its output in NAME's log
  # SIGTERM first (snakemake marks its jobs incomplete), SIGKILL 20 s later: on an H200
  # snakemake outlived a plain `timeout` by over 30 s and the call lost its results
  timeout -k 20 $((deadline - SECONDS)) "${cmd[@]}" >> "$run_logs/$1.log" 2>&1
  echo "$1: snakemake exit $? at $SECONDS s"; tail -3 "$run_logs/$1.log"
}

detached() {  # detached NAME: $cmd in a process session of its own (setsid), which the device lets run on after the
  # call returns, for as long as the machine stays warm: the next call waits on it instead of killing and resuming
  # it (a resume costs a minute or more: Snakemake's start, the stores' checks, the compile, the lost steps).
  # Returns 0 once it has ended (its exit status in the log), 1 while it still runs at this call's deadline.
  local name=$1 state=/tmp/e3-detached/$1
  mkdir -p "$state"
  if [ ! -e "$state/pid" ]; then
    # its own stdout too: an inherited pipe (device_run.sh ... | tail) would stay open until the job ends
    setsid bash -c '"$@" > "$0/log" 2>&1; echo $? > "$0/rc"' "$state" "${cmd[@]}" < /dev/null > "$state/start.log" 2>&1 &
    echo $! > "$state/pid"
    echo "$name: started in its own session (pid $(cat "$state/pid")) at $SECONDS s"
  fi
  while [ ! -e "$state/rc" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
    sleep 5
  done
  cp "$state/log" "$run_logs/$name.log" 2>/dev/null
  if [ -e "$state/rc" ]; then
    echo "$name: snakemake exit $(cat "$state/rc") at $SECONDS s"; tail -3 "$run_logs/$name.log"; return 0
  fi
  if ! kill -0 "$(cat "$state/pid")" 2>/dev/null; then  # it never started, or was killed before its status
    echo "$name: ended without an exit status: $(cat "$state/start.log")"; return 0
  fi
  echo "$name: still running at $SECONDS s (the next call waits on it)"; tail -2 "$run_logs/$name.log"; return 1
}

two_runs() {  # the first run ($FIRST overlays) and the second ($SECOND): names, locks left by a stopped call, plan
  read -ra first <<< "${FIRST:-}"
  first_name=$(run_name "${first[@]}")
  for overlays in "${first[*]}" "${second[*]}"; do
    snakemake_for $overlays; "${cmd[@]}" --unlock >/dev/null 2>&1
  done
  snakemake_for "${first[@]}"  # $cmd is the first run's from here
  "${cmd[@]}" -n 2>&1 | grep -A6 "Disk plan" > "$out/plan.txt"; cat "$out/plan.txt"
}

link_run() {  # link_run FROM TO SKIPPED...: results/FROM's entries but SKIPPED as hard links in results/TO (no disk)
  local from=$1 to=$2 entry; shift 2
  mkdir -p "results/$to"
  for entry in results/$from/*; do
    [[ " $* " == *" $(basename "$entry") "* ]] || cp -al "$entry" "results/$to/"
  done
}

job() {  # job NAME COMMAND...: COMMAND once in a process session of its own; returns 0 once it ended (its output in
  # $out/NAME.txt), 1 while it still runs at this call's deadline (the next call waits on it)
  local name=$1 state=/tmp/e3-jobs/$1; shift
  mkdir -p "$state"
  if [ ! -e "$state/pid" ]; then
    touch "$state/log"
    setsid bash -c '"$@" >> "$0/log" 2>&1; echo $? > "$0/rc"' "$state" "$@" < /dev/null > "$state/start.log" 2>&1 &
    echo $! > "$state/pid"
  fi
  while [ ! -e "$state/rc" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
    sleep 3
  done
  cp "$state/log" "$out/$name.txt"
  if [ ! -e "$state/rc" ] && ! kill -0 "$(cat "$state/pid")" 2>/dev/null; then
    echo "$name: ended without an exit status: $(cat "$state/start.log")"; return 0
  fi
  [ -e "$state/rc" ] || { echo "$name: still running at $SECONDS s (the next call waits on it)"; return 1; }
  echo "$name: exit $(cat "$state/rc") at $SECONDS s"
}

served_drafter() {  # the carried drafter's serving directory, joined from its parts and checked: /tmp/e3-serving
  local serving=/tmp/e3-serving
  if [ ! -e $serving/model.safetensors ]; then
    mkdir -p $serving && cat "$DRAFTER"/drafter-part-* > $serving/model.safetensors
    cp "$DRAFTER/config.json" $serving/
    [ "$(sha256sum < $serving/model.safetensors | cut -d' ' -f1)" = "$(cat "$DRAFTER/drafter.sha256")" ] \
      || { echo "the joined drafter's sha256 differs from $DRAFTER/drafter.sha256" >&2; rm -rf $serving; exit 1; }
  fi
  echo $serving
}

bench_decode() {  # bench_decode SECONDS: bench_decode.py with $BENCH_ARGS into $out/bench_decode.txt, once per lease
  [ -e "$out/bench_decode.txt" ] && return
  timeout "$1" python3 benchmarks/bench_decode.py --target /opt/e3/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    ${BENCH_ARGS:---prompts 3 --max-new 64 --dtypes bfloat16 --tau 2.1} > "$out/bench_decode.txt" 2>&1
  grep -v Warning "$out/bench_decode.txt" | tail -40
}

profile_loops() {  # profile_loops SECONDS: profile_loops.py on the run's drafter into logs/profile/, once per lease
  # ($OUT brings back at most 8 files: the profile travels inside the bundle that `keep` writes last)
  [ -e logs/profile/profile.txt ] && return
  mkdir -p logs/profile
  timeout "$1" python3 benchmarks/profile_loops.py --target /opt/e3/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    --serving "results/$second_name/serving/drafter" --out logs/profile ${PROFILE_ARGS:---prompts 4} \
    > logs/profile/profile.txt 2>&1
  grep -v "Warning\|warn\|Converting\|Loading\|Writing" logs/profile/profile.txt | tail -70
}

warm_compile() {  # once the run's training starts, its timing pass's compiling on an untrained drafter of the run's
  # shape ($WARM_ARGS: the example's), through the timing pass's own code on its prompts, in a process session of its
  # own: the kernels land in the compile cache that the run's timing pass then finds (minutes of a fresh GPU's
  # compiling off the critical path, spent beside training). Output in logs/warm-compile.txt, with its start and end.
  # It is stopped if the run's timing pass starts first (the timings must have the GPU to themselves).
  local pidfile=/tmp/e3-warm-$second_name.pid train_log=logs/$second_name/train.log
  local timing_log=logs/$second_name/evaluate_timing.log
  [ -e "$pidfile" ] || [ -e "results/$second_name/serving" ] && return
  mkdir -p logs
  setsid bash -c '
    train_log=$0 timing_log=$1; shift
    while [ ! -e "$train_log" ]; do sleep 10; done
    echo "started $(date +%T)"; "$@" & job=$!
    while kill -0 $job 2>/dev/null; do
      [ -e "$timing_log" ] && { kill $job; echo "stopped $(date +%T): the timing pass began"; break; }
      sleep 2
    done
    wait $job; rc=$?; echo "ended $(date +%T), exit $rc"' "$train_log" "$timing_log" \
    python3 benchmarks/bench_decode.py --target "results/$second_name/target" --timing-only --modes compiled \
    --loops device --dtypes bfloat16 \
    ${WARM_ARGS:---prompts 20 --max-new 128 --k 4 --trees 5,8,32 --drafter-intermediate-size 6144 --draft-vocab 32768} \
    < /dev/null > logs/warm-compile.txt 2>&1 &
  echo $! > "$pidfile"
  echo "warm compile: waits for $train_log (pid $(cat "$pidfile"))"
}

keep() {  # what a closing note needs, as one archive ($OUT brings back at most 8 files)
  local files=()
  for run in results/smollm2-gpu results/${first_name:-smollm2-gpu} results/$second_name \
             ${arm_names[@]/#/results/}; do
    for f in conversations/ingest_report.json vocab/data_stats.json parity reports \
             train/summary.json train/metrics.csv train/config_snapshot.yaml evaluation timing report engine_check \
             serving/drafter/config.json; do
      [ -e "$run/$f" ] && files+=("$run/$f")
    done
  done
  for run in results/*/; do  # the first 200 kB of every run's first regenerated shard
    [ -e "$run/regenerated/shard-00000.jsonl" ] || continue
    head -c 200000 "$run/regenerated/shard-00000.jsonl" > "regenerated-sample-$(basename "$run").jsonl"
    files+=("regenerated-sample-$(basename "$run").jsonl")
  done
  tar czf "$out/$stage-bundle.tar.gz" logs "${files[@]}" /tmp/ddp/*.txt /tmp/ddp/*/train.log 2>/dev/null
  keep_drafter
  keep_compile_cache
}

in_parts() {  # in_parts FILE NAME: FILE into $OUT as NAME-part-00, -01, ... of 15 MiB ($OUT takes files up to 16 MiB)
  rm -f "$out/$2"-part-*
  split -b 15M -d "$1" "$out/$2-part-"
}

keep_compile_cache() {  # the compile caches back in 15 MiB parts, where they fit what $OUT still takes (8 files,
  # 64 MiB); carried into the next session's calls as $COMPILE_CACHE
  [ -d /tmp/e3-inductor ] || return 0
  local archive=/tmp/e3-compile-cache.tar.gz files used parts
  files=$(find "$out" -maxdepth 1 -type f | wc -l)
  used=$(du -cb "$out"/* 2>/dev/null | tail -1 | cut -f1)
  if [ "$(du -sb /tmp/e3-inductor | cut -f1)" -gt $((4 * (63 * 1048576 - used))) ]; then  # gzip will not fit it
    echo "compile cache: $(du -sh /tmp/e3-inductor | cut -f1), too big for what \$OUT has left"; return 0
  fi
  tar czf $archive -C /tmp/e3-inductor . 2>/dev/null
  parts=$(( ($(stat -c %s $archive) + 15728639) / 15728640 ))
  if [ $((files + parts)) -le 8 ] && [ $((used + $(stat -c %s $archive))) -le $((63 * 1048576)) ]; then
    in_parts $archive compile-cache
    echo "compile cache: $(du -sh /tmp/e3-inductor | cut -f1), $parts part(s) of $(du -h $archive | cut -f1) in \$OUT"
  else
    echo "compile cache: $(du -sh /tmp/e3-inductor | cut -f1) ($(du -h $archive | cut -f1) packed) does not fit \$OUT"
  fi
}

keep_drafter() {  # single: the trained drafter's weights back in parts of 15 MiB ($OUT takes files up to 16 MiB), so a
  # later session can time it (bench_decode.py --serving) without retraining; join: cat drafter-part-* (sha256 in
  # drafter.sha256, config.json in the bundle). A call that ends in training brings back the best epoch so far
  # instead, exported as training's export would (benchmarks/serving_from_best.py): best-part-*, best.sha256; the
  # same script gives the joined weights their config.json elsewhere
  local weights=results/$second_name/serving/drafter/model.safetensors best=results/$second_name/train_state/best.safetensors
  [ "$stage" = single ] || return 0
  if [ ! -e "$weights" ] && [ -e "$best" ] && rm -rf /tmp/e3-best-serving \
       && python3 benchmarks/serving_from_best.py "$best" "results/$second_name/target" /tmp/e3-best-serving; then
    in_parts /tmp/e3-best-serving/model.safetensors best
    sha256sum /tmp/e3-best-serving/model.safetensors | cut -d' ' -f1 > "$out/best.sha256"
  elif [ -e "$weights" ]; then
    in_parts "$weights" drafter
    sha256sum "$weights" | cut -d' ' -f1 > "$out/drafter.sha256"
  fi
}

gpu_tests() {  # GPU_TESTS=1: the CUDA-only test modules ($GPU_TEST_MODULES), each in a pytest process of its own (a
  # CUDA fault in one would break the other's context), in the background; output under logs/gpu-tests/
  [ "${GPU_TESTS:-0}" = 1 ] && [ ! -e logs/gpu-tests ] || return 0
  mkdir -p logs/gpu-tests
  # test_regenerate_vllm skips itself unless vLLM is staged (benchmarks/device-stage-vllm.sh)
  (for module in ${GPU_TEST_MODULES:-test_pipelined test_tree_graph test_regenerate_vllm}; do
     # not slow: the inductor-on-CPU checks run in CI (one aborted the device's pytest once, its report lost);
     # -rfE --tb=short: each failure's reason in the log
     E3_TARGET_SOURCE=/opt/e3/models/SmolLM2-135M-Instruct.Q4_1.gguf timeout 600 \
       python3 -m pytest -q -p no:cacheprovider -m "not slow" -rfE --tb=short "tests/unit/$module.py" \
       > "logs/gpu-tests/$module.txt" 2>&1
   done) &
}

bench_regen() {  # bench_regen RUN: BENCH_REGEN=1: eager vs compiled regeneration throughput (bench_regenerate.py,
  # $REGEN_ARGS) on RUN's first conversation shard, in the background beside the data stage (both engines under the
  # same load); bench_regen_result waits for it
  [ "${BENCH_REGEN:-0}" = 1 ] && [ ! -e logs/bench-regenerate.txt ] || return 0
  mkdir -p logs
  (shard=results/$1/conversations/shard-00000.jsonl
   while { [ ! -e "$shard" ] || [ ! -e "results/$1/target/identity.json" ]; } \
         && [ $SECONDS -lt $((deadline - 200)) ]; do sleep 5; done
   timeout $((deadline - SECONDS > 310 ? 300 : deadline - SECONDS - 10)) python3 benchmarks/bench_regenerate.py \
     --target "results/$1/target" --conversations "$shard" \
     ${REGEN_ARGS:---count 128 --batch 128 --max-new 256 --temperature 0.8 --compiled} \
     > logs/bench-regenerate.txt 2>&1) &
  regen=$!
}

bench_regen_result() {
  [ -n "${regen:-}" ] || return 0
  wait "$regen"; grep -v "Warning\|warn\|Loading" logs/bench-regenerate.txt | tail -6
}

shared_data() {  # shared_data NAME...: the first run's data stage ($data_overlays), once, to its hidden stores; then
  # its run directory up to the stores, hard-linked, becomes every other run's (one copy on disk): runs that differ in
  # training or in their draft vocabulary only (pair; arms with SHARED_DATA=1). Returns 1 while the data stage is
  # unfinished (the next call resumes it).
  local first=$1 name status linked=results/$1/.shared-data-linked; shift
  [ $# -ge 1 ] || { echo "SHARED_DATA=1 needs two arms or more"; return 1; }
  [ -e "$linked" ] && return 0  # a kill while linking leaves no stamp: linking again over the same links is harmless
  snakemake_for "${data_overlays[@]}"
  # --until extract: the stores (disk_report waits for the whole DAG); exit 0 once every store exists
  timeout -k 20 $((deadline - SECONDS)) "${cmd[@]}" --until extract >> "$run_logs/$first-data.log" 2>&1
  status=$?; echo "shared data stage: exit $status at $SECONDS s"; tail -3 "$run_logs/$first-data.log"
  [ $status = 0 ] || return 1
  for name in "$@"; do  # each arm builds its own draft vocabulary (seconds; an arm may change its size)
    link_run "$first" "$name" vocab train train_state serving evaluation timing report reports engine_check
  done
  touch "$linked"
}

run_arms() {  # the arms stage: each arm of $ARMS (';'-separated overlay lists, $COMMON after each) detached
  local arm overlays data_overlays name index=0 gpus=$((last_gpu + 1)) pids=() linked=()
  IFS=';' read -ra arm_list <<< "${ARMS:?ARMS lists the arms, separated by ;}"
  # --unlock clears every run's locks (one .snakemake folder): once, and only while no detached arm holds any
  if ! ls /tmp/e3-detached/*/pid >/dev/null 2>&1; then
    snakemake_for; "${cmd[@]}" --unlock >/dev/null 2>&1
  fi
  for arm in "${arm_list[@]}"; do
    read -ra overlays <<< "$arm ${COMMON:-}"
    arm_names+=("$(run_name "${overlays[@]}")")
  done
  read -ra data_overlays <<< "${arm_list[0]} ${COMMON:-}"
  bench_regen "${arm_names[0]}"
  if [ "${SHARED_DATA:-0}" = 1 ]; then
    # the linked arms' copied files have no Snakemake metadata under their paths: judged by time stamps
    shared_data "${arm_names[@]}" || return 0
    linked=(--rerun-triggers mtime)
  fi
  for arm in "${arm_list[@]}"; do
    read -ra overlays <<< "$arm ${COMMON:-}"
    name=${arm_names[$index]}
    [ $index -ge 1 ] && overlays+=(${linked[@]+"${linked[@]}"})
    (export CUDA_VISIBLE_DEVICES=$((index % gpus)) DETACH=1
     if [ ! -e "/tmp/e3-detached/$name/pid" ]; then
       snakemake_for "${overlays[@]}" --omit-from evaluate_timing
       { echo "== $name"; "${cmd[@]}" -n 2>&1 | grep -A9 "Disk plan (bytes"; } > "/tmp/e3-plan-$name.txt"
     fi
     pipeline "$name" "${overlays[@]}" --omit-from evaluate_timing) &
    pids+=($!)
    index=$((index + 1))
  done
  wait "${pids[@]}"  # the arms only: the GPU tests run on in the background
  for name in "${arm_names[@]}"; do cat "/tmp/e3-plan-$name.txt" 2>/dev/null; done | tee "$out/plan.txt"
}

case $stage in
  compare)
    for overlays in "" "${second[*]}"; do
      snakemake_for $overlays
      "${cmd[@]}" --unlock >/dev/null 2>&1  # a call stopped at its limit leaves the locks behind
      "${cmd[@]}" -n 2>&1 | grep -A6 "Disk plan" >> "$out/plan.txt"
    done
    (export CUDA_VISIBLE_DEVICES=0; pipeline smollm2-gpu) &
    (export CUDA_VISIBLE_DEVICES=$last_gpu
     [ "${BENCH:-0}" = 1 ] && bench_extract > "$out/bench_extract.txt"
     [ "${CONTROL:-1}" = 1 ] && pipeline "$second_name" "${second[@]}") &
    wait
    cat "$out/plan.txt" "$out/bench_extract.txt" 2>/dev/null
    ;;
  single)
    gpu_tests
    # VLLM_SMOKE=1: once the run's target directory exists, vLLM (staged by device-stage-vllm.sh) on it alone,
    # beside the data stage: a missing wheel shows in the first call, not after training
    if [ "${VLLM_SMOKE:-0}" = 1 ] && [ ! -e logs/vllm-smoke.txt ]; then
      mkdir -p logs
      (while [ ! -e "results/$second_name/target/identity.json" ] && [ $SECONDS -lt $((deadline - 120)) ]; do sleep 5; done
       timeout $((deadline - SECONDS > 250 ? 240 : deadline - SECONDS - 10)) python3 benchmarks/vllm_smoke.py "results/$second_name/target" > logs/vllm-smoke.txt 2>&1
       echo "vllm smoke exit $?" >> logs/vllm-smoke.txt) &
      smoke=$!
    fi
    bench_regen "$second_name"
    [ "${WARM_COMPILE:-0}" = 1 ] && warm_compile
    snakemake_for "${second[@]}"
    if [ ! -e "/tmp/e3-detached/$second_name/pid" ]; then  # not while a detached run holds the locks
      "${cmd[@]}" --unlock >/dev/null 2>&1
      # ingest first (seconds): the run's disk check then samples the ingested conversations, not the raw records
      # (the openings overlay: 29.16 M tokens planned against 30.23 M, 28.67 M counted); the targets go before
      # $cmd's options (python3 -m snakemake), since --resources and --omit-from take lists
      [ -e "results/$second_name/conversations/ingest_report.json" ] \
        || { mkdir -p logs; "${cmd[@]:0:3}" "results/$second_name/conversations/ingest_report.json" \
               "results/$second_name/target" "${cmd[@]:3}" > "logs/$second_name-ingest.txt" 2>&1; }
      "${cmd[@]}" -n 2>&1 | grep -A8 "Disk plan (bytes" > "$out/plan.txt"; cat "$out/plan.txt"
      df -h . | tail -1
    fi
    pipeline "$second_name" "${second[@]}"
    [ -n "${smoke:-}" ] && { wait "$smoke"; grep -v "Warning\|warn" logs/vllm-smoke.txt | tail -25; }
    bench_regen_result
    # BENCH_DECODE=1: bench_decode.py once the run is done, alone on the GPU, when the call has time left
    [ "${BENCH_DECODE:-0}" = 1 ] && [ -e "$out/$second_name-report.html" ] && [ $((deadline - SECONDS)) -gt 150 ] \
      && bench_decode $((deadline - SECONDS - 20))
    # PROFILE=1: where the loops' step time goes (profile_loops.py), alone on the GPU, when the call has time left
    [ "${PROFILE:-0}" = 1 ] && [ -e "$out/$second_name-report.html" ] && [ $((deadline - SECONDS)) -gt 200 ] \
      && profile_loops $((deadline - SECONDS - 20))
    ;;
  pair)
    two_runs
    linked=results/$first_name/.shared-data-linked
    if [ ! -e "$linked" ]; then  # the shared data stage, once
      # BENCH_DECODE=1: the evaluator's decode speeds (bf16) on the other GPU while the data stage runs
      [ "${BENCH_DECODE:-0}" = 1 ] && (export CUDA_VISIBLE_DEVICES=$last_gpu; bench_decode 300 > /dev/null) &
      data_overlays=("${first[@]}")
      (export CUDA_VISIBLE_DEVICES=0; shared_data "$first_name" "$second_name")
      wait; grep -v Warning "$out/bench_decode.txt" 2>/dev/null | tail -8
    fi
    if [ -e "$linked" ]; then
      (export CUDA_VISIBLE_DEVICES=0; pipeline "$first_name" "${first[@]}") &
      # the copied files have no Snakemake metadata under the second run's paths: judge them by time stamps
      (export CUDA_VISIBLE_DEVICES=$last_gpu; pipeline "$second_name" "${second[@]}" --rerun-triggers mtime) &
      wait
    fi
    ;;
  sequel)
    # one GPU: the example (+ $FIRST overlays) to its report, then the SAME drafter evaluated again under
    # $SECOND (e.g. bf16): its run directory is a hard-linked copy of the first (nothing retrained)
    two_runs
    pipeline "$first_name" "${first[@]}"
    if [ ! -d "results/$second_name" ] && "${cmd[@]}" -n 2>/dev/null | grep -q "Nothing to be done"; then
      link_run "$first_name" "$second_name" evaluation timing report reports
    fi
    [ -d "results/$second_name" ] && pipeline "$second_name" "${second[@]}" --rerun-triggers mtime
    [ "${BENCH_DECODE:-0}" = 1 ] && [ $((deadline - SECONDS)) -gt 200 ] && bench_decode $((deadline - SECONDS - 20))
    ;;
  arms)
    run_logs=logs/arms REPORT=0; mkdir -p $run_logs  # four arms' logs and reports would overflow $OUT's 8 files
    gpu_tests
    run_arms
    bench_regen_result
    ;;
  benches)
    (export CUDA_VISIBLE_DEVICES=$last_gpu; bench_extract > "$out/bench_extract.txt") &
    CUDA_VISIBLE_DEVICES=0 timeout $((limit - 20)) python3 benchmarks/bench_train.py --baseline-src .bench-baseline \
      ${BENCH_TRAIN_ARGS:-} > "$out/bench_train.txt" 2>&1
    wait; cat "$out/bench_train.txt" "$out/bench_extract.txt"
    ;;
  trees)
    serving=$(served_drafter) || exit 1
    gguf=/opt/e3/models/SmolLM2-135M-Instruct.Q4_1.gguf
    decode=(python3 benchmarks/bench_decode.py --target $gguf --serving "$serving" --prompts 20 --max-new 128
            --dtypes bfloat16 --modes compiled)
    quiet() { grep -v "Warning\|warn\|Converting\|Loading\|Writing\|softmax\|split the reduction\|important use" "$@"; }
    for module in test_pipelined test_tree_graph; do
      job "$module" timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not slow" -rfE --tb=short \
        "tests/unit/$module.py" || exit 0
      tail -4 "$out/$module.txt"
    done
    job topk timeout 150 python3 benchmarks/bench_topk.py || exit 0
    quiet "$out/topk.txt"
    job trees timeout 1000 "${decode[@]}" ${LOOPS:+--loops $LOOPS} ${TREE_ARGS:---trees 5,4,8 5,8,32 6,10,64} \
      || exit 0
    quiet "$out/trees.txt" | grep -v "^timing pass" | tail -20
    keep_compile_cache
    exit 0
    ;;
  evaluate)
    # the tau pass of the run that the example plus $SECOND names, on a drafter carried in ($DRAFTER, as trees: an
    # earlier `single` call's drafter-part-*, drafter.sha256 and config.json), with no data stage and no training: for
    # a run whose training ended in a session with no time left for its tau pass. Its serving directory is put in
    # place, and snakemake may run only the rules the tau pass needs (ingest: the held-out prompts; target;
    # evaluate), towards the results of $PROMPT_SETS (default: the example's three). The same command resumes.
    serving=$(served_drafter) || exit 1
    run_dir=results/$second_name
    [ -e "$run_dir/serving/drafter" ] || { mkdir -p "$run_dir/serving"; cp -r "$serving" "$run_dir/serving/drafter"; }
    targets=()
    for set in ${PROMPT_SETS:-mtbench-package held-out humaneval-package}; do
      targets+=("$run_dir/evaluation/$set.json")
    done
    snakemake_for "${second[@]}" --allowed-rules ingest target evaluate
    cmd=("${cmd[@]:0:3}" "${targets[@]}" "${cmd[@]:3}")  # the targets before the options that take lists
    "${cmd[@]}" --unlock >/dev/null 2>&1
    until_deadline "$second_name"
    ;;
  ddp)
    mkdir -p /tmp/ddp
    timeout $limit python3 benchmarks/compare_ddp.py --run-dir results/smollm2-gpu --gpus 2 \
      --steps "${DDP_STEPS:-100}" --out /tmp/ddp > "$out/ddp.txt" 2>&1
    tail -25 "$out/ddp.txt"; cp /tmp/ddp/ddp_loss_curves.png "$out/" 2>/dev/null
    ;;
esac
keep
exit 0
