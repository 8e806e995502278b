#!/usr/bin/env bash
# Device window E1 (one call, no llama.cpp: the device was scarce this session): the new row
# kernels' and chunk setting's tests on the GPU, the two runner tests changed without a device
# last session, then the prefill before and after (the previous binary in .gpu-before, same call),
# passes of 2048 tokens, and the 4-bit TEAL step. Carry .gpu and .gpu-before.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
source scripts/gpu-quick.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
date -u +%T
run_t prefill_rows 60
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 timeout 90 compute-sanitizer --tool memcheck "../../.gpu/tests/$(cut -f1 ../../.gpu/tests.tsv | grep -m1 '^prefill_rows-')" > "$OUT/memcheck-prefill_rows.log" 2>&1; echo "memcheck prefill_rows exit $?")
grep -E "ERROR SUMMARY|test result" "$OUT/memcheck-prefill_rows.log" | head -3
for f in tiny_balanced_cbc_model_matches_cpu tiny_dense_int4_packs_run_four_bit prompts_in_chunks prefill_profile \
         long_prompts batched_slot_steps tiny_dense_model_matches_cpu tiny_tiled_cbc; do
  run_t runner 90 $f --test-threads 1 | sed "s/^/$f: /"
  cp "$OUT/runner.log" "$OUT/runner-$f.log"
done
date -u +%T
S=.gpu/bin/sieve
B=.gpu-before/sieve
D="bench decode --synthetic llama2-7b --sp 0 --dp 0 --tokens 16"
for bin in $S $B; do
  for P in 128 2048; do
    timeout 80 $bin $D --prompt $P 2>&1 | grep -E "TTFT|error|prefill of" | sed "s|^|$bin $P: |" | head -3
  done
done
for C in 1024 2048; do
  SIEVE_PREFILL_CHUNK=$C timeout 80 $S $D --prompt 2048 2>&1 | grep -E "TTFT|error|prefill of" | sed "s/^/chunk $C: /" | head -3
done
date -u +%T
# (Cut for the device time left: Balanced-CBC passes of 256 / 2048 and the 4-bit TEAL step are in dev/window-d4.sh.)
