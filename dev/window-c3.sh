#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
source scripts/gpu-quick.sh
run_t runner 120 tiny_balanced_cbc_model; grep -vE "^\s*$" "$OUT/runner.log" | grep -vE "^ +[0-9]+:|^ +at " | tail -25
bash dev/window-c2.sh
