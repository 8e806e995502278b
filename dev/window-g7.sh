#!/usr/bin/env bash
# Device window G7 (2026-12-06; carry .gpu with the sieve binary alone): window G4 found the
# W4A16 g128 instances for NT = 2..4 spilling (3 blocks per SM leave 80 registers) and Q4_0's
# one-row-tile kernel (2 blocks, no spills) faster at 24-32 tokens than W4A16's two-row-tile
# one. Now W4A16's NT = 2..4 run at 2 blocks per SM (no spills): one row tile
# (SIEVE_LOWBIT_ROW_TILES=1) against two, same call.
# (After this run the two-row-tile kernels were removed, and SIEVE_LOWBIT_ROW_TILES with
# them: one row tile at 2 blocks per SM won at every shape. This script records what ran.)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
S=.gpu/bin/sieve
for rt in 1 2; do
  echo "== row tiles $rt"
  env $([ $rt = 1 ] && echo SIEVE_LOWBIT_ROW_TILES=1) timeout 100 $S bench gemm --shapes llama2-7b --precision f16,w4a16,gguf-q4_0 --n 8,16,24,32 --graph > "$OUT/gemm-rt$rt.txt" 2>&1
  grep -E "^\| (w4a16|gguf-q4_0|f16) " "$OUT/gemm-rt$rt.txt" | awk -F'|' '{print $2,$3,$4,$7,$11}'
done
