#!/usr/bin/env bash
# Device window M1 (2026-12-07): W8A8 prompts in the model (issue 29's "prefill of 2,048 tokens,
# 6:8 slide INT8 against dense INT8" row) and the checks issues 26, 27 and 29 still owe a device.
#   PART=tests     the slide_lt tests with the model's Dense8, the runner's 8-bit prompt test,
#                  the slide-on-cuSPARSELt runner test, the persistent step against the graph
#                  step on today's tree, the W4A8 runner test; memcheck on the SpMM, W4A8 and
#                  persistent kernels
#   PART=ttft      TTFT of 2,048 tokens on the 7B shape: dense f16 / int8 / fp8 prompts, and a
#                  6:8 slide model (sp 0.25) with the f16 copy / cuSPARSELt int8 / fp8
#   PART=core      what must run if only one call gets a machine: the Dense8 and FP8 slide_lt
#                  tests, the runner's 8-bit prompt and persistent tests, TTFT of 2,048 tokens
#                  dense f16 / int8 and slide 6:8 int8 / f16 copy
#   PART=more      the column-format SpMM at N >= 512; the persistent step at 8,192 positions;
#                  the 4-bit step with int8 against f16 activations; racecheck and synccheck
# Carry .gpu from `KEEP="slide_lt runner w4a8 kernels slide" bash scripts/gpu-runner-bundle.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
PART=${PART:-tests}
exec > >(tee "$OUT/window-$PART.log") 2>&1
start=$(date +%s)
at() { echo "--- $1 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=.gpu/bin/sieve
export SIEVE_CUSPARSELT=${SIEVE_CUSPARSELT:-$(find / -name 'libcusparseLt.so.0' -not -path '/proc/*' 2>/dev/null | head -1)}
exe() { echo "$PWD/.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 "^$1-")"; }
t() {  # t NAME SECONDS FILTER CRATE-DIR
  local bin; bin=$(exe "$1")
  (cd "crates/$4" && SIEVE_REQUIRE_GPU=1 timeout "$2" "$bin" $3 --test-threads 1 --nocapture > "$OUT/t-$1-${3:-all}.log" 2>&1; echo "$1 ${3:-all}: exit $?")
  grep -E "^test |test result|panicked|worst|relative RMS|logit" "$OUT/t-$1-${3:-all}.log" | cut -c1-260 | head -30
}
sanitize() {  # sanitize TOOL NAME SECONDS FILTER CRATE-DIR
  local bin; bin=$(exe "$2")
  (cd "crates/$5" && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout "$3" compute-sanitizer --tool "$1" \
    "$bin" "$4" --test-threads 1 > "$OUT/san-$1-$2-$4.log" 2>&1; echo "$1 $2 $4: exit $?")
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY|test result" "$OUT/san-$1-$2-$4.log" | head -3
}
ttft() {  # ttft LABEL ARGS...
  local label=$1; shift
  timeout 170 env "$@" > "$OUT/ttft-$label.log" 2>&1; echo "$label: exit $?"
  grep -E "TTFT|TPOT|weights|rror" "$OUT/ttft-$label.log" | cut -c1-300 | head -6
}
if [ "$PART" = core ]; then
  at tests
  t slide_lt 60 gpu_dense8 sieve-cuda
  SIEVE_LT_PRECISIONS=fp8 t slide_lt 60 gpu_slide_on_cusparselt_matches sieve-cuda
  t runner 120 eight_bit_prompts_stay_near_the_cpu sieve-gpu
  t runner 60 persistent_step_matches_the_graph_step sieve-gpu
  common="--synthetic llama2-7b --prompt 2048 --tokens 8"
  at ttft
  for p in f16 int8; do ttft "dense-$p" $S bench decode $common --sp 0 --dp 0 --prompt-precision $p; done
  ttft slide-int8 $S bench decode $common --format slide --pattern 6:8 --sp 0.25 --dp 0 --prompt-precision int8
  ttft slide-copy $S bench decode $common --format slide --pattern 6:8 --sp 0.25 --dp 0
  at end
fi
if [ "$PART" = fp8 ]; then
  # After PART=core: the FP8 rows, and one-chunk prompts (1,024 tokens) whose TTFT line splits
  # the pass by kind of work, f16 against int8.
  common="--synthetic llama2-7b --prompt 2048 --tokens 8"
  ttft dense-fp8 $S bench decode $common --sp 0 --dp 0 --prompt-precision fp8
  ttft slide-fp8 $S bench decode $common --format slide --pattern 6:8 --sp 0.25 --dp 0 --prompt-precision fp8
  for p in f16 int8; do
    ttft "dense-1024-$p" $S bench decode --synthetic llama2-7b --prompt 1024 --tokens 8 --sp 0 --dp 0 --prompt-precision $p
    grep -iE "prefill|linear|attention" "$OUT/ttft-dense-1024-$p.log" | cut -c1-400 | head -4
  done
  at end
fi
if [ "$PART" = tests ]; then
  at tests
  SIEVE_LT_PRECISIONS=int8,fp8 t slide_lt 120 "" sieve-cuda
  t runner 150 eight_bit_prompts_stay_near_the_cpu sieve-gpu
  t runner 60 persistent_step_matches_the_graph_step sieve-gpu
  t runner 150 slide_prompts_on_cusparselt_match_cpu sieve-gpu
  t runner 90 tiny_int4_models_with_int8_activations_run_w4a8 sieve-gpu
  at memcheck
  sanitize memcheck kernels 60 tiled_cbc_spmm sieve-cuda
  sanitize memcheck w4a8 60 "" sieve-cuda
  sanitize memcheck runner 90 persistent_step_matches_the_graph_step sieve-gpu
  at end
fi
if [ "$PART" = ttft ]; then
  common="--synthetic llama2-7b --prompt 2048 --tokens 8"
  at dense
  for p in f16 int8 fp8; do ttft "dense-$p" $S bench decode $common --sp 0 --dp 0 --prompt-precision $p; done
  at slide
  ttft slide-copy $S bench decode $common --format slide --pattern 6:8 --sp 0.25 --dp 0
  for p in int8 fp8; do
    ttft "slide-$p" $S bench decode $common --format slide --pattern 6:8 --sp 0.25 --dp 0 --prompt-precision $p
  done
  at end
fi
if [ "$PART" = more ]; then
  at gemm
  timeout 120 $S bench gemm --shapes llama2-7b --precision f16,tcbc-spmm,tcbc-decode-gemm --sp 0.5 \
    --n 512,2048,8192 --reps 10 > "$OUT/gemm-tcbc.log" 2>&1; echo "gemm: exit $?"
  grep -E "^\||rror" "$OUT/gemm-tcbc.log" | cut -c1-150
  at persistent-8192
  timeout 150 $S bench decode --synthetic llama2-7b --sp 0 --dp 0 --prompt 128 --tokens 64 --context 8192 \
    --step persistent,graph > "$OUT/persistent-8192.log" 2>&1; echo "persistent 8192: exit $?"
  grep -E "TPOT|rror|trace|barrier" "$OUT/persistent-8192.log" | cut -c1-300
  at w4a8-step
  for a in int8 f16; do
    timeout 120 $S bench decode --synthetic llama2-7b --format dense --values int4 --sp 0 --dp 0 --activations $a \
      --prompt 128 --tokens 64 > "$OUT/decode-$a.log" 2>&1; echo "activations $a: exit $?"
    grep -E "TPOT|rror" "$OUT/decode-$a.log" | cut -c1-300
  done
  at sanitizers
  sanitize racecheck kernels 90 tiled_cbc_spmm sieve-cuda
  sanitize racecheck runner 120 persistent_step_matches_the_graph_step sieve-gpu
  sanitize synccheck runner 120 persistent_step_matches_the_graph_step sieve-gpu
  at end
fi
