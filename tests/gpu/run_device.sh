#!/bin/bash
# One call on a Hopper GPU machine: precompile the GPU tier's kernels in parallel, then run the tier
# file by file with per-test output (-v -s) under a time box each, so that a timeout loses one file's
# summary, not the whole tier's. Logs go to LOG_DIR (default .); prints a short summary last.
#
# usage (from the repo root): bash tests/gpu/run_device.sh [LOG_DIR] [FILE ...]
#   FILE: test files under tests/gpu (default: fwd, bwd, autograd, cp, cp_kernels, qwen3_next)
#   PRECOMPILE=0 skips the precompile step; BOX=<seconds> sets each file's time box (default 300: the forward tier alone takes over 200 s on an H100).
#   SANITIZE=1 adds a last stage: benchmarks/experiments/sanitize.py (forward + backward on tiny edge
#   shapes against fp64, every kernel kind launched) once plainly, which builds its kernels, then under
#   compute-sanitizer's memcheck (every case) and racecheck (--race: the cases that launch every
#   kernel kind), each with PYTORCH_NO_CUDA_MEMORY_CACHING=1; SANITIZE_LONG=1 adds the long case
#   (--long: T = 2^21, cp on) plainly against cp off and then under memcheck.
#   SANITIZE=only runs that stage alone. Time boxes: SANITIZE_BOX (plain run, 150 s), MEMCHECK_BOX (240 s), RACECHECK_BOX (240 s), LONG_BOX (240 s);
#   COMPUTE_SANITIZER=<path> if it is not on the PATH. Logs: sanitize.log, sanitize_memcheck.log,
#   sanitize_racecheck.log (rc 3: the sanitizer reported an error; rc 1: a case failed its check).
#
# FLA's Triton kernels (the tier's FLA comparisons) compile and autotune on first use on a fresh
# machine; their cache is kept in TRITON_CACHE_DIR (default /tmp/triton-cache), unpacked from
# .device/triton-cache.tar.xz when that exists, and SAVE_TRITON=1 packs it into
# OUT/triton-cache.tar.xz at the end (xz -3; not written past 16 MB) for the next call's carry.
# Each test's duration is printed as it ends (`tests/gpu/conftest.py`), so that a file cut by its box
# still shows where the time went.
#
# Why: the tier builds ~6 kernels per (H, HV, N, packed, dtype) configuration, ~40 s when built one
# after another; the precompile step (tests/gpu/precompile.py --tier) builds every configuration the
# tier uses in worker processes (TileLang's disk cache), and the tests then only load them. Cheaper
# still: build them on the CPU machine and ship the cache (precompile.py --pack, see its docstring).
OUT=${1:-.}
shift || true
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=(test_fwd_gpu.py test_bwd_gpu.py test_autograd_gpu.py test_cp_gpu.py test_cp_kernels_gpu.py test_qwen3_next_gpu.py)
if [ "${SANITIZE:-0}" = only ]; then FILES=(); PRECOMPILE=0; fi
filter() { grep -v "TileLang:"; }
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
if [ -f .device/triton-cache.tar.xz ] && [ ! -d "$TRITON_CACHE_DIR" ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xJf .device/triton-cache.tar.xz -C "$TRITON_CACHE_DIR"
fi

if [ "${PRECOMPILE:-1}" != 0 ]; then
  timeout 200 python tests/gpu/precompile.py --tier --workers 8 2>&1 | filter | tail -3
fi

for f in "${FILES[@]}"; do
  name=${f%.py}
  start=$(date +%s)
  timeout ${BOX:-300} python -m pytest "tests/gpu/$f" -v -s -p no:cacheprovider --tb=short --durations=5 2>&1 | filter > "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  echo "== $f: rc $rc, $(( $(date +%s) - start )) s: $(grep -cE '(^| )PASSED( |$)' "$OUT/$name.log") passed, $(grep -cE '(^| )FAILED( |$)' "$OUT/$name.log") failed"
  grep -E "^FAILED|^E  " "$OUT/$name.log" | cut -c1-240 | head -8
done

if [ "${SANITIZE:-0}" != 0 ]; then
  SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
  verdict() { grep -E 'cases passed' "$1" | tail -1 | grep . || tail -1 "$1" | cut -c1-200; }
  start=$(date +%s)
  timeout ${SANITIZE_BOX:-150} python benchmarks/experiments/sanitize.py 2>&1 | filter > "$OUT/sanitize.log"
  rc=${PIPESTATUS[0]}
  echo "== sanitize.py (plain, builds the kernels): rc $rc, $(( $(date +%s) - start )) s: $(verdict "$OUT/sanitize.log")"
  grep -E "FAILED" "$OUT/sanitize.log" | cut -c1-240 | head -8
  if [ ! -x "$SAN" ]; then
    echo "== compute-sanitizer not found (set COMPUTE_SANITIZER=<path>): memcheck and racecheck skipped"
  else
    stages=(memcheck racecheck)
    if [ "${SANITIZE_LONG:-0}" = 1 ]; then
      start=$(date +%s)
      timeout ${LONG_BOX:-240} python benchmarks/experiments/sanitize.py --long --long-compare 2>&1 | filter > "$OUT/sanitize_long_plain.log"
      echo "== sanitize.py --long --long-compare (plain): rc ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s: $(verdict "$OUT/sanitize_long_plain.log")"
      grep -E "FAILED|^long" "$OUT/sanitize_long_plain.log" | cut -c1-240 | head -8
      stages+=(long)
    fi
    for stage in "${stages[@]}"; do
      case $stage in
        memcheck) tool=memcheck; args=(); box=${MEMCHECK_BOX:-240};;
        racecheck) tool=racecheck; args=(--race); box=${RACECHECK_BOX:-240};;
        long) tool=memcheck; args=(--long); box=${LONG_BOX:-240};;
      esac
      start=$(date +%s)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $box "$SAN" --tool $tool --error-exitcode 3 \
        python benchmarks/experiments/sanitize.py "${args[@]}" 2>&1 | filter > "$OUT/sanitize_$stage.log"
      rc=${PIPESTATUS[0]}
      echo "== compute-sanitizer --tool $tool ${args[*]}: rc $rc, $(( $(date +%s) - start )) s: $(grep -E 'SUMMARY' "$OUT/sanitize_$stage.log" | tail -1 | sed 's/^=* *//'); $(verdict "$OUT/sanitize_$stage.log")"
      grep -E "^=+ +(Invalid|Error|Warning|Program hit|Race|Uninitialized)" "$OUT/sanitize_$stage.log" | cut -c1-240 | head -8
      grep -E "FAILED|never launched" "$OUT/sanitize_$stage.log" | cut -c1-240 | head -4
    done
  fi
fi

if [ "${SAVE_TRITON:-0}" = 1 ] && [ -d "$TRITON_CACHE_DIR" ]; then
  tar -cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -3 > "$OUT/triton-cache.tar.xz"
  size=$(stat -c %s "$OUT/triton-cache.tar.xz")
  if [ "$size" -gt 16000000 ]; then rm -f "$OUT/triton-cache.tar.xz"; echo "== triton cache $size B: over 16 MB, not saved"
  else echo "== triton cache saved: $OUT/triton-cache.tar.xz ($size B)"; fi
fi
