#!/usr/bin/env bash
# GPU session helper (one H200): run after ../shared/hooks/device-stage.sh --with-snakemake has unpacked
# the model and wheels into /opt/e3. Usage: bash benchmarks/device_run.sh pipeline|evaluate|bench OUTDIR
# `pipeline` runs config/examples/gpu-smollm2.yaml through export; `evaluate` adds evaluation, plots and
# the HTML report; `bench` runs both benchmarks. Extra config (device paths) comes from $DEVICE_CONFIG.
set -uo pipefail
stage=$1 out=$2
export PYTHONPATH=/opt/e3/site:$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
run=results/smollm2-gpu
smk=(python3 -m snakemake --configfile config/examples/gpu-smollm2.yaml ${DEVICE_CONFIG:-} --cores 16
     --resources gpu=${GPUS:-1} --scheduler greedy --rerun-incomplete)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $stage in
  pipeline)
    "${smk[@]}" -n 2>&1 | grep -A8 "Disk plan"
    /usr/bin/time -v "${smk[@]}" $run/serving/drafter $run/reports/disk_plan_vs_actual.json > "$out/pipeline.log" 2>&1
    echo "snakemake exit $?"; tail -5 "$out/pipeline.log"; grep -E "Elapsed \(wall" "$out/pipeline.log"
    ;;
  evaluate)
    timeout ${EVAL_TIMEOUT:-520} "${smk[@]}" > "$out/evaluate.log" 2>&1; echo "snakemake exit $?"; tail -5 "$out/evaluate.log"
    "${smk[@]}" --report "$out/report.html" >> "$out/evaluate.log" 2>&1
    ;;
  bench)
    python3 benchmarks/bench_train.py 2>&1 | tee "$out/bench_train.txt"
    python3 benchmarks/bench_extract.py --target $run/target --tokens $run/tokens/shard-00000.zarr --big \
      2>&1 | grep -v Warning | tee "$out/bench_extract.txt"
    ;;
esac
mkdir -p "$out/results" && cp -r logs "$out/" 2>/dev/null
for f in conversations/ingest_report.json vocab/data_stats.json reports train/summary.json train/metrics.csv \
         evaluation report serving/drafter/config.json; do
  [ -e "$run/$f" ] && mkdir -p "$out/results/$(dirname $f)" && cp -r "$run/$f" "$out/results/$(dirname $f)/"
done
exit 0
