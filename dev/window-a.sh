#!/usr/bin/env bash
# Device window A, planned 2026-12-05 evening (no machine was lent; the next session runs it):
# the GPU tests of what was built without a device (the low-bit and Balanced-CBC f16 copies for
# long prompts, the 4-bit TEAL path), compute-sanitizer on the new kernels, the 7B step with
# t2r8 and the prompts' TTFT, while llama.cpp builds for window B (dev/window-b.sh, the next
# call on the same warm machine). Carry .gpu and vendor (64 MiB in all: after
# scripts/gpu-runner-bundle.sh keep only the kernels, ie_bme, lowbit, lowbit_cols and runner test
# executables in .gpu/tests and .gpu/tests.tsv; vendor from scripts/llama-cpp/fetch.sh).
# Logs in $OUT. About 12 minutes: split it at the benches if the 10-minute call limit bites.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
source scripts/gpu-quick.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
mkdir -p /tmp/g /tmp/wa
(TARGETS="llama-bench llama-server" JOBS=12 nice -n 5 bash scripts/llama-cpp/build.sh > /tmp/wa/build.log 2>&1; echo "build rc $?" >> /tmp/wa/build.log) &
(for t in q4_0 f16; do nice -n 5 python3 scripts/llama-cpp/random_gguf.py --shape llama2-7b --type $t -o /tmp/g/7b-$t.gguf >> /tmp/wa/gen.log 2>&1; echo "gen $t rc $? $(date -u +%T)" >> /tmp/wa/gen.log; done) &
date -u +%T
for v in t1r16 t2r8; do echo "variant $v"; SIEVE_LOWBIT_COLS_VARIANT=$v run_t lowbit_cols 90; cp "$OUT/lowbit_cols.log" "$OUT/lowbit_cols-$v.log"; done
run_t lowbit 120 decode; cp "$OUT/lowbit.log" "$OUT/lowbit-decode.log"
run_t kernels 120 decode_transposed; cp "$OUT/kernels.log" "$OUT/kernels-decode.log"
run_t ie_bme 120 decode_rows; cp "$OUT/ie_bme.log" "$OUT/ie_bme-decode.log"
for f in four_bit long_prompts balanced rlc_csc ie_bme k_quant batched_slot_steps; do
  run_t runner 240 $f; cp "$OUT/runner.log" "$OUT/runner-$f.log"
done
exe=$(cut -f1 .gpu/tests.tsv | grep -m1 '^lowbit-')
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 timeout 120 compute-sanitizer --tool memcheck "../../.gpu/tests/$exe" decode > "$OUT/memcheck-decode.log" 2>&1; echo "memcheck decode exit $?")
grep -E "ERROR SUMMARY|test result" "$OUT/memcheck-decode.log" | head
exe=$(cut -f1 .gpu/tests.tsv | grep -m1 '^kernels-')
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 timeout 120 compute-sanitizer --tool memcheck "../../.gpu/tests/$exe" decode_transposed > "$OUT/memcheck-bcbc-decode.log" 2>&1; echo "memcheck bcbc decode exit $?")
grep -E "ERROR SUMMARY|test result" "$OUT/memcheck-bcbc-decode.log" | head
exe=$(cut -f1 .gpu/tests.tsv | grep -m1 '^ie_bme-')
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 timeout 120 compute-sanitizer --tool memcheck "../../.gpu/tests/$exe" decode_rows > "$OUT/memcheck-iebme-decode.log" 2>&1; echo "memcheck ie-bme decode exit $?")
grep -E "ERROR SUMMARY|test result" "$OUT/memcheck-iebme-decode.log" | head
exe=$(cut -f1 .gpu/tests.tsv | grep -m1 '^lowbit_cols-')
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_LOWBIT_COLS_VARIANT=t2r8 timeout 150 compute-sanitizer --tool memcheck "../../.gpu/tests/$exe" --test-threads 1 > "$OUT/memcheck.log" 2>&1; echo "memcheck exit $?")
grep -E "ERROR SUMMARY|test result" "$OUT/memcheck.log" | head
date -u +%T
# Where the f16 copy pays (LOWBIT_DECODE_MIN_TOKENS = 65 is from the H200 kernel table).
.gpu/bin/sieve bench gemm --shapes llama2-7b --precision f16,w4a16,w4a16-decode-gemm,q4_k-kernel,q4_k-decode-gemm \
  --n 32,64,96,128 --graph 2>&1 | tee "$OUT/gemm-decode.log" | grep -vE "^(device|copy|empty)" | tail -30
S=".gpu/bin/sieve bench decode --synthetic llama2-7b --format dense --prompt 128 --tokens 256"
$S --values int4 --sp 0,0.5,0.5 --dp 0,0.5,0.7 2>&1 | tee "$OUT/decode-int4.log" | grep -E "TPOT|error"
SIEVE_LOWBIT_PREFILL=kernel $S --values int4 --sp 0 --dp 0 --tokens 16 2>&1 | tee "$OUT/decode-int4-kernel-prefill.log" | grep -E "TPOT|error"
B=".gpu/bin/sieve bench decode --synthetic llama2-7b --format balanced-cbc --prompt 128 --tokens 64 --sp 0.5 --dp 0.5"
$B 2>&1 | tee "$OUT/decode-bcbc.log" | grep -E "TPOT|error"
$B --values int4 2>&1 | tee "$OUT/decode-bcbc-int4.log" | grep -E "TPOT|error"
I=".gpu/bin/sieve bench decode --synthetic llama2-7b --format ie-bme --values int4 --prompt 128 --tokens 64 --sp 0.5 --dp 0.5"
$I 2>&1 | tee "$OUT/decode-iebme.log" | grep -E "TPOT|error"
SIEVE_LOWBIT_PREFILL=kernel $I 2>&1 | tee "$OUT/decode-iebme-kernel-prefill.log" | grep -E "TPOT|error"
date -u +%T
wait
tail -3 /tmp/wa/build.log; grep gen /tmp/wa/gen.log; cp /tmp/wa/*.log "$OUT/"
date -u +%T
