#!/usr/bin/env bash
# 2026-12-05 21:30 UTC window, call 1: the GPU tests of the f16 copies (built without a device
# earlier in the session), compute-sanitizer on them, the decode-gemm crossover.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
source scripts/gpu-quick.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u +%T
run_t lowbit 150 decode; cp "$OUT/lowbit.log" "$OUT/lowbit-decode.log"
run_t kernels 150 decode_transposed; cp "$OUT/kernels.log" "$OUT/kernels-decode.log"
run_t ie_bme 150 decode_rows; cp "$OUT/ie_bme.log" "$OUT/ie_bme-decode.log"
for f in long_prompts tiny_balanced tiny_rlc_csc tiny_ie_bme four_bit; do
  run_t runner 120 $f; cp "$OUT/runner.log" "$OUT/runner-$f.log"
done
date -u +%T
for t in lowbit:decode_to_f16 kernels:decode_transposed ie_bme:decode_rows; do
  exe=$(cut -f1 .gpu/tests.tsv | grep -m1 "^${t%%:*}-")
  (cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 60 compute-sanitizer --tool memcheck "../../.gpu/tests/$exe" "${t##*:}" > "$OUT/memcheck-${t%%:*}.log" 2>&1; echo "memcheck ${t}: exit $?")
  grep -E "ERROR SUMMARY|test result" "$OUT/memcheck-${t%%:*}.log" | head -3
done
date -u +%T
timeout 120 .gpu/bin/sieve bench gemm --shapes llama2-7b --precision f16,w4a16,w4a16-decode-gemm,q4_k-kernel,q4_k-decode-gemm \
  --n 32,64,128 --graph 2>&1 | tee "$OUT/gemm-decode.log" | grep -vE "^(device|copy|empty)" | tail -40
date -u +%T
run_t runner 150 batched_slot_steps; cp "$OUT/runner.log" "$OUT/runner-batched_slot_steps.log"
date -u +%T
