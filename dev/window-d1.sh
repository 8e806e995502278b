#!/usr/bin/env bash
# Device window D, first call (2026-12-05/06 night): the whole runner suite on the GPU (two of its
# tests were changed without a device last session) while llama.cpp builds and the random 7B
# GGUFs are written for the second call (dev/window-d2.sh, same warm machine).
# Carry .gpu (sieve + the runner test executable only) and vendor (scripts/llama-cpp/fetch.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
source scripts/gpu-quick.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
mkdir -p /tmp/g /tmp/wd
(TARGETS="llama-bench llama-server" JOBS=10 nice -n 5 bash scripts/llama-cpp/build.sh > /tmp/wd/build.log 2>&1; echo "build rc $? $(date -u +%T)" >> /tmp/wd/build.log) &
(for t in q4_0 f16; do nice -n 5 python3 scripts/llama-cpp/random_gguf.py --shape llama2-7b --type $t -o /tmp/g/7b-$t.gguf >> /tmp/wd/gen.log 2>&1; echo "gen $t rc $? $(date -u +%T)" >> /tmp/wd/gen.log; done) &
date -u +%T
run_t prefill_rows 60
run_t runner 300 --test-threads 1
grep -E "^test .*(ok|FAILED)$" "$OUT/runner.log" | sed 's/^/  /' | head -60
date -u +%T
date -u +%T
wait
tail -2 /tmp/wd/build.log; cat /tmp/wd/gen.log | grep gen; cp /tmp/wd/*.log "$OUT/"
date -u +%T
