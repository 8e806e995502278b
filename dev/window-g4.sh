#!/usr/bin/env bash
# Device window G4 (2026-12-06; carry .gpu and .gpu-ma): two row tiles per k tile in the
# low-bit kernels above 16 tokens (`_nt3_rt2`, `_nt4_rt2`: the x fragments loaded once for
# two row tiles; at N = 32 they were 4x the weight bytes), and the batch layout's runner test
# with thresholds of 0 (window G1: real thresholds flip inputs between the two layouts'
# kernels). Kernel tests, racecheck and memcheck on them, `bench gemm` with one and two row
# tiles in the same call, then the 7B step at batches of 1, 8, 32 (dense f16 and the 4-bit
# dual-sparse pack). Window G1 before this (H100): 4-bit batch 32 7.665 ms, dense 6.852 ms.
# (After window G7 the two-row-tile kernels were removed again, and SIEVE_LOWBIT_ROW_TILES
# with them: one row tile without spills was faster. This script records what ran.)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p /tmp/m && cp .gpu-ma/* /tmp/m/   # the default model, first part (window G6)
source scripts/gpu-quick.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run_t lowbit 200 --test-threads 1
run_t runner 200 batched_slot_steps --test-threads 1
grep -E "int4 teal" "$OUT/runner.log" | head -3
exe=$(cut -f1 .gpu/tests.tsv | grep -m1 '^lowbit-')
for tool in racecheck memcheck; do
  (cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 120 compute-sanitizer --tool $tool "../../.gpu/tests/$exe" gpu_lowbit_kernels_match_reference --test-threads 1 > "$OUT/$tool-lowbit.log" 2>&1; echo "$tool exit $?")
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$OUT/$tool-lowbit.log" | head -3
done
S=.gpu/bin/sieve
for rt in 1 2; do
  echo "== row tiles $rt"
  env $([ $rt = 1 ] && echo SIEVE_LOWBIT_ROW_TILES=1) timeout 120 $S bench gemm --shapes llama2-7b --precision f16,w4a16,gguf-q4_0,gguf-q8_0 --n 16,24,32 --graph > "$OUT/gemm-rt$rt.txt" 2>&1
  grep -vE "^\s*$" "$OUT/gemm-rt$rt.txt" | tail -16
done
for cfg in "--sp 0 --dp 0" "--format dense --values int4 --sp 0.5 --dp 0.5"; do
  echo "== $cfg"
  timeout 150 $S bench decode --synthetic llama2-7b $cfg --prompt 128 --tokens 64 --batch 1,8,32 > "$OUT/decode-${cfg// /_}.log" 2>&1
  grep -E "TPOT|batch " "$OUT/decode-${cfg// /_}.log" | cut -c1-200
done
