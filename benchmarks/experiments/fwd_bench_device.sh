#!/bin/bash
# The forward benchmark on the GPU machine, resumable across calls of one warm machine.
#
# usage (repo root, after `source .device/on-device.sh` and, for FlashInfer, `source .device-fi/on-device-fi.sh`):
#   bash benchmarks/experiments/fwd_bench_device.sh OUT COMMIT BUDGET_S [bench args ...]
#
# The results CSVs live in /tmp/bench-results on the machine (seeded once from benchmarks/results), so
# a second call on the same warm machine resumes where the first stopped (the benchmark skips rows
# already measured for this environment key and commit). Each call runs
# `python -m flashqla.bench --results-dir /tmp/bench-results --commit COMMIT --time-budget BUDGET_S ...`,
# then copies the CSVs and pages it wrote to OUT/results and the log to OUT/bench.log, and prints the log's tail.
OUT=${1:?OUT}; COMMIT=${2:?COMMIT}; BUDGET=${3:?BUDGET_S}; shift 3
RES=/tmp/bench-results
if [ ! -d "$RES" ]; then
  mkdir -p "$RES" && cp benchmarks/results/*.csv benchmarks/results/*.md "$RES"/ 2>/dev/null
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
touch /tmp/bench-start
python -m flashqla.bench --results-dir "$RES" --commit "$COMMIT" --time-budget "$BUDGET" --no-plot "$@" \
  > "$OUT/bench.log" 2>&1
rc=$?
mkdir -p "$OUT/results" && find "$RES" -maxdepth 1 -type f -newer /tmp/bench-start -exec cp {} "$OUT/results/" \;
grep -v "TileLang:" "$OUT/bench.log" | grep -v "it/s\]\|s/row\]" | tail -40
echo "bench rc=$rc"
