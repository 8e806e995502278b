#!/usr/bin/env bash
# 2026-12-05 window, call 2: time to first token with the f16 copies against without them
# (SIEVE_LOWBIT_PREFILL=kernel) and the 4-bit TEAL step with t2r8, 7B shape.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
date -u +%T
D=".gpu/bin/sieve bench decode --synthetic llama2-7b --prompt 128 --tokens 64"
$D --format dense --values int4 --sp 0 --dp 0 2>&1 | tee "$OUT/int4-copy.log" | grep -E "TPOT|error"
SIEVE_LOWBIT_PREFILL=kernel $D --format dense --values int4 --sp 0 --dp 0 2>&1 | tee "$OUT/int4-kernel.log" | grep -E "TPOT|error"
date -u +%T
$D --format balanced-cbc --sp 0.5 --dp 0.5 2>&1 | tee "$OUT/bcbc.log" | grep -E "TPOT|error"
date -u +%T
$D --format ie-bme --values int4 --sp 0.5 --dp 0.5 2>&1 | tee "$OUT/iebme.log" | grep -E "TPOT|error"
date -u +%T
.gpu/bin/sieve bench decode --synthetic llama2-7b --prompt 128 --tokens 256 --format dense --values int4 --sp 0.5,0.5 --dp 0.5,0.7 2>&1 | tee "$OUT/int4-teal.log" | grep -E "TPOT|error"
date -u +%T
