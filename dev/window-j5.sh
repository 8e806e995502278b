#!/usr/bin/env bash
# Device window J5 (2026-12-06; carry .gpu): the union checks of a window that also drove llama-server, without it (three failed
# machine starts left ~3 minutes of device time): the union kernels' tests, under
# compute-sanitizer memcheck too, the runner's few-sequence cases, and Balanced-CBC's step at
# 2..12 sequences (the union up to 8 in launches of 4; 9 and 12: its f16 copy).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
source scripts/gpu-quick.sh
run_t kernels 100 union_matches
S=.gpu/bin/sieve
timeout 100 $S bench decode --synthetic llama2-7b --format balanced-cbc --sp 0.5 --dp 0.5 --prompt 128 --tokens 16 --batch 2,4,6,8,9,12 2>&1 \
  | grep -E "batch" | cut -c1-150 | sed "s/^/balanced: /"
run_t runner 100 batched_slot_steps --test-threads 1
k=.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 '^kernels-')
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 60 compute-sanitizer --tool memcheck "$OLDPWD/$k" union_matches --test-threads 1 2>&1 \
  | grep -E "ERROR SUMMARY|test result" | head -3 | sed "s/^/sanitizer memcheck: /")
