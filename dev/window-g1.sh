#!/usr/bin/env bash
# Device window G1, first call (2026-12-06): the batch layout of column-major 4-bit matrices
# (`Layouts::batch`, built without a device). The runner test that covers it
# (`batched_slot_steps_match_single_steps`, entry "int4 teal, batch layout") and compute-sanitizer
# on it, then the 7B int4 g128 sp 0.5 / dp 0.5 step at batches of 1, 8, 32 against dense f16
# (window F4: 13.5 ms a step at 31 sequences through the f16 copy, dense 7.7 ms). The server
# under load follows in dev/window-f4.sh. Carry .gpu (scripts/gpu-runner-bundle.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p /tmp/m && cp .gpu-ma/* /tmp/m/   # the default model, first part (window G6)
source scripts/gpu-quick.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run_t runner 240 batched_slot_steps --test-threads 1
grep -E "^test .*(ok|FAILED)$|panicked" "$OUT/runner.log" | head -5
(cd crates/sieve-gpu && SIEVE_REQUIRE_GPU=1 timeout 150 compute-sanitizer --tool memcheck "../../.gpu/tests/$(cut -f1 ../../.gpu/tests.tsv | grep -m1 '^runner-')" batched_slot_steps --test-threads 1 > "$OUT/memcheck-batched.log" 2>&1; echo "memcheck exit $?")
grep -E "ERROR SUMMARY|test result" "$OUT/memcheck-batched.log" | head -3
S=.gpu/bin/sieve
for cfg in "--sp 0 --dp 0" "--format dense --values int4 --sp 0.5 --dp 0.5"; do
  echo "== $cfg"
  timeout 150 $S bench decode --synthetic llama2-7b $cfg --prompt 128 --tokens 64 --batch 1,8,32 > "$OUT/decode-${cfg// /_}.log" 2>&1
  grep -vE "^\s*$" "$OUT/decode-${cfg// /_}.log" | tail -12
done
