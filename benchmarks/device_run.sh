#!/usr/bin/env bash
# GPU session helper (H200; two GPUs for `train`): run after ../shared/hooks/device-stage.sh --with-snakemake has
# unpacked the model and wheels into /opt/e3. Usage: bash benchmarks/device_run.sh data|train|evaluate OUTDIR
#   data      config/examples/gpu-smollm2.yaml through the hidden stores (regenerate, tokenize, parity, extract)
#             on GPU 0, while GPU 1 runs benchmarks/bench_train.py and bench_extract.py --only-big
#   train     training + export on GPU 0, while benchmarks/compare_ddp.py trains 1-GPU and 2-GPU runs
#   evaluate  evaluation, plots and the HTML report
# Extra config (device paths) comes from $DEVICE_CONFIG (e.g. "--configfile .device/3/device.yaml").
set -uo pipefail
stage=$1 out=$2
export PYTHONPATH=/opt/e3/site:$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
run=results/smollm2-gpu
smk=(python3 -m snakemake --configfile config/examples/gpu-smollm2.yaml ${DEVICE_CONFIG:-} --cores all
     --resources gpu=4 --scheduler greedy --rerun-incomplete)
limit=${LIMIT:-540}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m snakemake --unlock --configfile config/examples/gpu-smollm2.yaml ${DEVICE_CONFIG:-} >/dev/null 2>&1
keep() {  # what a closing note needs, as one archive ($OUT brings back at most 8 files)
  files=(logs)
  for f in conversations/ingest_report.json vocab/data_stats.json parity reports train/summary.json \
           train/metrics.csv train/config_snapshot.yaml evaluation report serving/drafter/config.json; do
    [ -e "$run/$f" ] && files+=("$run/$f")
  done
  [ -e $run/regenerated/shard-00000.jsonl ] && head -c 200000 $run/regenerated/shard-00000.jsonl > regenerated-sample.jsonl \
    && files+=(regenerated-sample.jsonl)
  tar czf "$out/$stage-bundle.tar.gz" "${files[@]}" /tmp/ddp/*.txt /tmp/ddp/*/train.log /tmp/ddp/*/metrics.csv 2>/dev/null
}
case $stage in
  data)
    (export CUDA_VISIBLE_DEVICES=1
     timeout $((limit - 20)) python3 benchmarks/bench_train.py > "$out/bench_train.txt" 2>&1
     timeout 200 python3 benchmarks/bench_extract.py --only-big --writer-threads 16 2>&1 | grep -v Warning \
       > "$out/bench_extract.txt") &
    "${smk[@]}" -n 2>&1 | grep -A5 "Disk plan" > "$out/plan.txt"
    CUDA_VISIBLE_DEVICES=0 timeout $limit "${smk[@]}" $run/reports/disk_plan_vs_actual.json > "$out/data.log" 2>&1
    echo "snakemake exit $?"; tail -4 "$out/data.log"
    wait; cat "$out/plan.txt" "$out/bench_train.txt" "$out/bench_extract.txt"
    ;;
  train)
    mkdir -p /tmp/ddp
    (timeout $limit python3 benchmarks/compare_ddp.py --run-dir $run --gpus 2 --steps ${DDP_STEPS:-100} \
       --out /tmp/ddp > "$out/ddp.txt" 2>&1) &
    CUDA_VISIBLE_DEVICES=0 timeout $limit "${smk[@]}" $run/serving/drafter > "$out/train.log" 2>&1
    echo "snakemake exit $?"; tail -4 "$out/train.log"
    wait; tail -25 "$out/ddp.txt"; cp /tmp/ddp/ddp_loss_curves.png "$out/" 2>/dev/null
    ;;
  evaluate)
    CUDA_VISIBLE_DEVICES=0 timeout $limit "${smk[@]}" > "$out/evaluate.log" 2>&1; echo "snakemake exit $?"
    tail -4 "$out/evaluate.log"
    "${smk[@]}" --report "$out/report.html" >> "$out/evaluate.log" 2>&1
    ;;
esac
keep
exit 0
