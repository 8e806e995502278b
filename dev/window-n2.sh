#!/usr/bin/env bash
# Device window N2 (2026-12-07): where a 7B decode step's time goes, kernel by kernel, from
# Nsight Systems with CUDA graph nodes traced (issue 27's question: which of the ~450 us outside
# the products is which kernel), for the dense 4-bit step and the 4-bit TEAL step at the
# runner's L2 prefetch; then the prefetch sizes on dense f16 and Tiled-CBC.
#   PART=combine  attention's combine by the last split block (tests, then the 7B step with
#                 it and with the combine kernel, SIEVE_ATTENTION_COMBINE=kernel, each at
#                 --prefetch off,on). Run once (08:58 UTC); the fused combine was removed after
#                 it, so both halves now measure the combine kernel.
# (nsys is not on the device image: the trace part prints "nsys: none"; ncu's per-kernel
# durations of a step came from `ncu --graph-profiling node`, docs/BENCHMARKS.md "Window N2".)
# Carry .gpu from `KEEP="runner kv_cache" bash scripts/gpu-runner-bundle.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
PART=${PART:-trace}
exec > >(tee "$OUT/window-n2-$PART.log") 2>&1
. dev/window-lib.sh
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/*/bin/nsys /usr/local/cuda*/nsight-systems*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}"
trace() {  # trace LABEL ARGS...
  local label=$1; shift
  timeout 200 "$NSYS" profile --cuda-graph-trace=node --trace=cuda -o "$OUT/$label" -f true \
    $S bench decode --synthetic llama2-7b --prompt 128 --tokens 24 "$@" > "$OUT/nsys-$label.log" 2>&1
  echo "$label: exit $?"; grep -E "TPOT" "$OUT/nsys-$label.log" | cut -c1-200
  timeout 120 "$NSYS" stats -r cuda_gpu_trace -f csv -o "$OUT/$label" "$OUT/$label.nsys-rep" > /dev/null 2>&1
  timeout 60 "$NSYS" stats -r cuda_gpu_kern_sum "$OUT/$label.nsys-rep" 2>&1 | head -40 | cut -c1-220
  xz -T4 -6 "$OUT/${label}_cuda_gpu_trace.csv" 2>/dev/null; rm -f "$OUT/$label.nsys-rep" "$OUT/$label.sqlite"
  ls -la "$OUT" | grep "$label"
}
if [ "$PART" = trace ] && [ -n "$NSYS" ]; then
  trace int4 --format dense --values int4 --sp 0 --dp 0 --prefetch ${PF:-2}
  trace int4-teal --format dense --values int4 --sp 0.5 --dp 0.5 --prefetch ${PF:-2}
fi
if [ "$PART" = sizes ]; then
  dec f16 --format dense --sp 0 --dp 0 --prefetch off,1,2,4
  dec tcbc --sp 0.5 --dp 0.5 --prefetch off,1,2,4
  dec int4 --format dense --values int4 --sp 0,0.5 --dp 0,0.5 --prefetch off,1,2
fi
if [ "$PART" = combine ]; then
  t runner 60 rope_and_attention_match_reference sieve-gpu
  t kv_cache 90 int8_attention_matches_reference sieve-cuda
  t runner 90 l2_prefetch_changes_no_result sieve-gpu
  for m in fused kernel; do
    export SIEVE_ATTENTION_COMBINE=$m
    dec int4-$m --format dense --values int4 --sp 0,0.5 --dp 0,0.5 --prefetch off,on
  done
  for m in fused kernel; do
    export SIEVE_ATTENTION_COMBINE=$m
    dec f16-$m --format dense --sp 0 --dp 0 --prefetch off,on
  done
  [ -n "${FULL:-}" ] && t runner 240 "" sieve-gpu
fi
if [ "$PART" = final ]; then
  # The tree as committed after the combine experiment: the split kernel with one barrier
  # fewer and its former arguments; racecheck on it; the prefetch default on Tiled-CBC; the
  # persistent step's trace on the 7B shape and the step at 8,192 positions (issue 27).
  t runner 60 rope_and_attention_match_reference sieve-gpu
  t kv_cache 90 int8_attention_matches_reference sieve-cuda
  t runner 90 l2_prefetch_changes_no_result sieve-gpu
  sanitize racecheck kv_cache 120 int8_attention_matches_reference sieve-cuda
  dec tcbc --sp 0.5 --dp 0.5 --prefetch off,on
  timeout 120 $S bench decode --synthetic llama2-7b --sp 0 --dp 0 --prompt 128 --tokens 64 \
    --step persistent,graph --trace "$OUT/persistent-7b.svg" > "$OUT/persistent-7b.log" 2>&1; echo "persistent 7b: exit $?"
  grep -vE "^\s*$" "$OUT/persistent-7b.log" | cut -c1-300 | tail -30
  timeout 150 $S bench decode --synthetic llama2-7b --sp 0 --dp 0 --prompt 8128 --tokens 48 --context 8192 \
    --step persistent,graph > "$OUT/persistent-8192.log" 2>&1; echo "persistent 8192: exit $?"
  grep -E "TPOT|rror" "$OUT/persistent-8192.log" | cut -c1-300
fi
