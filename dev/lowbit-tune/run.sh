#!/usr/bin/env bash
# Builds tune.cu under several compile-time settings and runs each (GPU machine, nvcc needed).
#   bash dev/lowbit-tune/run.sh [layers] [model]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}/lowbit-tune
mkdir -p "$out"
settings=("" "-DLB_MIN_BLOCKS=3" "-DLB_MIN_BLOCKS_W4G128=2")
i=0
for s in "${settings[@]}"; do
  nvcc -O3 -arch=sm_90 -std=c++17 $s -o "$out/tune$i" dev/lowbit-tune/tune.cu 2> "$out/build$i.log" &
  i=$((i + 1))
done
wait
i=0
for s in "${settings[@]}"; do
  echo "== settings: ${s:-defaults}"
  "$out/tune$i" "${1:-32}" "${2:-7b}"
  i=$((i + 1))
done
