#!/usr/bin/env bash
# Device window F, first of three back-to-back calls on one warm machine (2026-12-06): llama.cpp
# builds and the random 7B GGUFs are written on the CPU while the GPU runs the prompt passes of
# Balanced-CBC and the 4-bit TEAL step (dev/window-d4.sh). The default model travels in parts
# (.gpu-ma here, .gpu-mb and .gpu-mc with the next two calls) into /tmp/m.
# Carry .gpu (the sieve binary), vendor (scripts/llama-cpp/fetch.sh) and .gpu-ma.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p /tmp/g /tmp/wd /tmp/m "$OUT"
cp .gpu-ma/* /tmp/m/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(TARGETS="llama-bench llama-server" JOBS=12 nice -n 5 bash scripts/llama-cpp/build.sh > /tmp/wd/build.log 2>&1; echo "build rc $? $(date -u +%T)" >> /tmp/wd/build.log) &
(for t in q4_0 f16; do nice -n 5 python3 scripts/llama-cpp/random_gguf.py --shape llama2-7b --type $t -o /tmp/g/7b-$t.gguf >> /tmp/wd/gen.log 2>&1; echo "gen $t rc $? $(date -u +%T)" >> /tmp/wd/gen.log; done) &
bash dev/window-d4.sh
wait
tail -2 /tmp/wd/build.log; grep gen /tmp/wd/gen.log; cp /tmp/wd/*.log "$OUT/"
date -u +%T
