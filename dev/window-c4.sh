#!/usr/bin/env bash
# Call 3: the low-bit copy with 32-byte row stores, and the runner tests that failed in call 1.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
source scripts/gpu-quick.sh
date -u +%T
run_t lowbit 150 decode
exe=$(cut -f1 .gpu/tests.tsv | grep -m1 "^lowbit-")
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 60 compute-sanitizer --tool memcheck "../../.gpu/tests/$exe" decode_to_f16 > "$OUT/memcheck.log" 2>&1; echo "memcheck: exit $?")
grep -E "ERROR SUMMARY" "$OUT/memcheck.log"
timeout 100 .gpu/bin/sieve bench gemm --shapes llama2-7b --precision f16,w4a16,w4a16-decode-gemm,q4_k-kernel,q4_k-decode-gemm \
  --n 64,128 --graph 2>&1 | tee "$OUT/gemm-decode.log" | grep -E "^\| (f16|w4a16|q4_k)" | tail -30
for f in tiny_balanced_cbc four_bit tiny_gguf_block long_prompts; do
  run_t runner 120 $f; grep -E "logit error|allowed|CPU against itself" "$OUT/runner.log" | head -8
done
D=".gpu/bin/sieve bench decode --synthetic llama2-7b --prompt 128 --tokens 32 --format dense --values int4 --sp 0 --dp 0"
$D 2>&1 | grep -E "TPOT|error"
SIEVE_LOWBIT_PREFILL=kernel $D 2>&1 | grep -E "TPOT|error"
date -u +%T
