#!/bin/bash
# One run on a Hopper GPU machine: cold compile, precompile, timings, then the GPU test tier.
# usage (from the repo root): bash tests/gpu/run_device.sh [LOG_DIR]   (logs go to LOG_DIR, default .)
OUT=${1:-.}
filter() { grep -v "TileLang:"; }
timeout 120 python tests/gpu/device_check.py --cold --precompile --bench "16/64 4x8192" "16/32 4x8192" "16/64 8x1024" "32/32 1x4096" "2/8 1x32768" --no-fla --out "$OUT" 2>&1 | filter > "$OUT/bench.log"
tail -12 "$OUT/bench.log"
timeout ${PYTEST_TIMEOUT:-240} python -m pytest tests/gpu -q -p no:cacheprovider -rA --durations=8 2>&1 | filter > "$OUT/pytest.log"
grep -E "passed|failed|PASSED|FAILED|Error|error" "$OUT/pytest.log" | tail -40
