#!/usr/bin/env bash
# Device window J3 (2026-12-06; carry .gpu): after J1 (docs/BENCHMARKS.md, "Union products"),
# the Tiled-CBC union capped at 4 tokens and the Balanced-CBC union taking up to 8 in launches
# of 4: their kernel tests again (J1's failures were the test's: a token scaled by 1e-6 added
# to a base of magnitude 2 lost its digits in f32), the runner's few-sequence cases, and the
# Balanced-CBC step at 2..12 sequences (9 and 12: its f16 copy, the pass without the union).
# Then the SlideSparse prompt path's f16 copy (window I1's kernel tests).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
source scripts/gpu-quick.sh
run_t kernels 150 union_matches
run_t runner 150 batched_slot_steps --test-threads 1
S=.gpu/bin/sieve
timeout 150 $S bench decode --synthetic llama2-7b --format balanced-cbc --sp 0.5 --dp 0.5 --prompt 128 --tokens 32 --batch 1,2,4,6,8,9,12 2>&1 \
  | grep -E "batch" | cut -c1-150 | sed "s/^/balanced: /"
timeout 120 $S bench decode --synthetic llama2-7b --format tiled-cbc --sp 0.5 --dp 0.5 --prompt 128 --tokens 32 --batch 2,4,5 2>&1 \
  | grep -E "batch" | cut -c1-150 | sed "s/^/tiled: /"
run_t lowbit_cols 90
run_t slide 120 --test-threads 1
run_t runner 200 long_prompts_of_low_bit_models_match_cpu tiny_slide_models_match_cpu --test-threads 1
date -u +%T
