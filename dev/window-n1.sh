#!/usr/bin/env bash
# Device window N1 (2026-12-07): the decode step's L2 prefetch of the next product's weights
# (issues 26 and 27: the ~0.5 ms of every step in which DRAM reads no weights).
#   PART=core   the tests that launch the changed kernels (RMSNorm, SwiGLU, RoPE with a span to
#               prefetch; a whole step with and without it), then the 7B shape's TPOT with
#               --prefetch off,on,16 for dense f16, dense int4 g128, int4 + 50% + TEAL 50% and
#               Tiled-CBC 0.5 / 0.5, each pair measured on one model in one process; and the
#               dense int4 step with the prefetch but none from attention (SIEVE_PREFETCH_ATTENTION=off)
#   PART=min    the tests, then --prefetch off,on for dense int4, int4 + TEAL and dense f16
#   PART=more   GGUF Q4_0 blocks and the 0.7 / 0.7 Tiled-CBC point with and without it, other
#               sizes, and the 4-bit TEAL step at 32 sequences (the serving path's batched pass)
# After it, dev/window-m1.sh's PART=tests / fp8 / more run from the same bundle.
# Carry .gpu from `KEEP="runner kv_cache prefill_rows slide_lt w4a8 kernels slide" bash scripts/gpu-runner-bundle.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
PART=${PART:-core}
exec > >(tee "$OUT/window-n1-$PART.log") 2>&1
start=$(date +%s)
at() { echo "--- $1 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=.gpu/bin/sieve
exe() { echo "$PWD/.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 "^$1-")"; }
t() {  # t NAME SECONDS FILTER CRATE-DIR
  local bin; bin=$(exe "$1")
  (cd "crates/$4" && SIEVE_REQUIRE_GPU=1 timeout "$2" "$bin" $3 --test-threads 1 --nocapture > "$OUT/t-$1-${3:-all}.log" 2>&1; echo "$1 ${3:-all}: exit $?")
  grep -E "^test |test result|panicked|same tokens|differ" "$OUT/t-$1-${3:-all}.log" | cut -c1-260 | head -20
}
dec() {  # dec LABEL ARGS...
  local label=$1; shift
  timeout 240 $S bench decode --synthetic llama2-7b --prompt 128 --tokens 128 "$@" > "$OUT/dec-$label.log" 2>&1
  echo "$label: exit $?"
  grep -E "TPOT|rror" "$OUT/dec-$label.log" | sed -E 's/\| eager split.*//' | cut -c1-330
}
if [ "$PART" = core ]; then
  at tests
  t runner 90 l2_prefetch_changes_no_result sieve-gpu
  t runner 30 rmsnorm_and_silu_match_reference sieve-gpu
  t runner 30 rope_and_attention_match_reference sieve-gpu
  t prefill_rows 60 "" sieve-cuda
  t kv_cache 60 "" sieve-cuda
  at decode
  dec dense-f16 --format dense --sp 0 --dp 0 --prefetch off,on,16
  dec int4 --format dense --values int4 --sp 0,0.5 --dp 0,0.5 --prefetch off,on,16
  dec tcbc --sp 0.5 --dp 0.5 --prefetch off,on
  SIEVE_PREFETCH_ATTENTION=off dec int4-no-attention-prefetch --format dense --values int4 --sp 0 --dp 0 --prefetch on
  at end
fi
if [ "$PART" = min ]; then  # what a short window must show: correctness, then the 4-bit and f16 pairs
  at tests
  t runner 90 l2_prefetch_changes_no_result sieve-gpu
  at decode
  dec int4 --format dense --values int4 --sp 0,0.5 --dp 0,0.5 --prefetch off,on
  dec dense-f16 --format dense --sp 0 --dp 0 --prefetch off,on
  at end
fi
if [ "$PART" = more ]; then
  dec q4_0 --format dense --values q4_0 --sp 0 --dp 0 --prefetch off,on
  dec tcbc-07 --sp 0.7 --dp 0.7 --prefetch off,on
  dec int4-8 --format dense --values int4 --sp 0 --dp 0 --prefetch off,on,8,32
  dec batch32 --format dense --values int4 --sp 0.5 --dp 0.5 --prefetch off,on --batch 32
  at end
fi
