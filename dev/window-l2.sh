#!/usr/bin/env bash
# Device window L2 (2026-12-06): the W4A8 kernels' first run (issue 26, "8-bit activations and
# IMMA"): their tests against the CPU reference, compute-sanitizer, and `bench gemm` beside
# cuBLAS f16 and the W4A16 kernel on the same bytes; the low-bit tests again, now that
# max_rel_error counts an unwritten (NaN) output as an infinite error.
# Then the model: `--activations int8` in the decode runner's test and `bench decode` on the 7B
# shape against `--activations f16` (same run).
# PART=1 runs the kernel tests, bench gemm and the sanitizers, PART=2 the model (each < 600 s);
# PART=short a little of each in one call.
# Carry .gpu from `KEEP="w4a8 lowbit runner" bash scripts/gpu-runner-bundle.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/window.log") 2>&1
start=$(date +%s)
at() { echo "--- $1 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=.gpu/bin/sieve
exe() { echo "$PWD/.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 "^$1-")"; }
t() {  # t NAME SECONDS [filter] [crate dir]
  local bin; bin=$(exe "$1")
  (cd crates/${4:-sieve-cuda} && SIEVE_REQUIRE_GPU=1 timeout "$2" "$bin" ${3:-} --test-threads 1 > "$OUT/t-$1.log" 2>&1; echo "$1: exit $?")
  grep -E "^test |test result|panicked" "$OUT/t-$1.log" | cut -c1-300 | head -12
}
sanitize() {  # sanitize TOOL NAME SECONDS
  local bin; bin=$(exe "$2")
  (cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout "$3" compute-sanitizer --tool "$1" \
    "$bin" --test-threads 1 > "$OUT/san-$1-$2.log" 2>&1; echo "$1 $2: exit $?")
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$OUT/san-$1-$2.log" | head -3
}
PART=${PART:-all}
if [ "$PART" = tests ]; then
  t w4a8 55
  exit 0
fi
if [ "$PART" = short ]; then
  # One call when little device time is left: tests, bench gemm, the 7B step f16 vs int8 at
  # batch 1, memcheck, then the runner's test with what remains.
  at tests
  t w4a8 45
  at bench
  timeout 70 $S bench gemm --shapes llama2-7b --precision f16,w4a16,w4a8,gguf-q4_0,q4_0-a8 --n 1,4,16,32 \
    --reps 50 --json "$OUT/gemm-w4a8.json" > "$OUT/gemm.log" 2>&1
  grep -E "^\||device|copy|alone" "$OUT/gemm.log" | grep -v "^| f16" | cut -c1-130
  at model
  for a in int8 f16; do
    echo "== bench decode --values int4 --activations $a"
    timeout 170 $S bench decode --synthetic llama2-7b --format dense --values int4 --sp 0 --dp 0 --activations $a \
      --prompt 128 --tokens 64 > "$OUT/decode-$a.log" 2>&1; echo "exit $?"
    grep -E "TPOT|rror" "$OUT/decode-$a.log" | cut -c1-420
  done
  at sanitize
  sanitize memcheck w4a8 80
  t runner 60 tiny_int4_models_with_int8_activations_run_w4a8 sieve-gpu
  grep -E "W4A8 against" "$OUT/t-runner.log"
  at end
  exit 0
fi
PART=${PART:-all}
if [ "$PART" != 2 ]; then
at tests
t w4a8 90
at bench
timeout 150 $S bench gemm --shapes llama2-7b --precision f16,w4a16,w4a8,gguf-q4_0,q4_0-a8 --n 1,2,4,8,16,32 \
  --reps 50 --json "$OUT/gemm-w4a8.json" > "$OUT/gemm.log" 2>&1
grep -E "^\||device|copy|alone" "$OUT/gemm.log" | grep -v "^| f16" | cut -c1-130
at sanitize
sanitize memcheck w4a8 120
sanitize racecheck w4a8 150
t lowbit 120 gpu_lowbit_kernels_match_reference
fi
if [ "$PART" != 1 ]; then
at model
for cfg in "--values int4 --sp 0 --dp 0 --activations f16" "--values int4 --sp 0 --dp 0 --activations int8"; do
  echo "== bench decode $cfg"
  timeout 200 $S bench decode --synthetic llama2-7b --format dense $cfg --prompt 128 --tokens 64 --batch 1,32 \
    > "$OUT/decode.log" 2>&1; echo "exit $?"
  grep -E "TPOT|batch|rror" "$OUT/decode.log" | cut -c1-400
  tail -c 300 "$OUT/decode.log"
done
at runner
t runner 200 tiny_int4_models_with_int8_activations_run_w4a8 sieve-gpu
grep -E "W4A8 against" "$OUT/t-runner.log"
fi
at end
