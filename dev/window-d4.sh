#!/usr/bin/env bash
# Device window D, fourth call (warm machine): prompt passes of 1024 and 2048 tokens against
# 256 for a dense and a Balanced-CBC 0.5 / 0.5 7B (a sparse model's f16 copies are made once
# per pass), then the 4-bit TEAL step of issue 26.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
S=.gpu/bin/sieve
date -u +%T
SIEVE_PREFILL_CHUNK=1024 timeout 100 $S bench decode --synthetic llama2-7b --sp 0 --dp 0 --prompt 2048 --tokens 16 2>&1 | grep -E "TTFT|error" | sed "s/^/dense chunk 1024: /" | head -2
for C in 256 2048; do
  SIEVE_PREFILL_CHUNK=$C timeout 150 $S bench decode --synthetic llama2-7b --format balanced-cbc --sp 0.5 --dp 0.5 --prompt 2048 --tokens 16 2>&1 | tee "$OUT/decode-bcbc-2048-chunk$C.log" | grep -E "TTFT|error" | sed "s/^/bcbc chunk $C: /" | head -2
done
date -u +%T
timeout 150 $S bench decode --synthetic llama2-7b --format dense --values int4 --sp 0,0.5,0.5 --dp 0,0.5,0.7 --prompt 128 --tokens 256 2>&1 | tee "$OUT/decode-int4.log" | grep -E "TPOT|TTFT|error" | head -8
date -u +%T
