#!/usr/bin/env bash
# Device window L3 (2026-12-06): window L2's W4A8 measurements (issue 26) and the first run of
# SlideSparse on cuSPARSELt and the dense 8-bit cuBLASLt baseline (issue 29).
#   PART=a  the w4a8 and slide_lt tests, bench gemm W4A8 at N <= 32, bench gemm of the
#           slide-lt / cublaslt rows on the 7B's shapes at 2:4 and 6:8 up to 8192 tokens
#   PART=c  after window L3a (cuSPARSELt 0.8's search faulted on the first f16 plan): the
#           slide_lt tests per precision in separate processes, f16 with and without the
#           search; bench gemm of the library rows (8-bit first); the runner's slide test on
#           cuSPARSELt
#   PART=d  TTFT of a 6:8 7B at 2,048 tokens: the f16 copy against cuSPARSELt
#   PART=b  the 7B step with int8 against f16 activations at batch 1, memcheck of the w4a8
#           tests, the runner's W4A8 test
# Carry .gpu from `KEEP="w4a8 lowbit runner slide_lt" bash scripts/gpu-runner-bundle.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/window.log") 2>&1
start=$(date +%s)
at() { echo "--- $1 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=.gpu/bin/sieve
export SIEVE_CUSPARSELT=${SIEVE_CUSPARSELT:-$(find / -name 'libcusparseLt.so.0' -not -path '/proc/*' 2>/dev/null | head -1)}
echo "cuSPARSELt: $SIEVE_CUSPARSELT"
exe() { echo "$PWD/.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 "^$1-")"; }
t() {  # t NAME SECONDS [filter] [crate dir]
  local bin; bin=$(exe "$1")
  (cd crates/${4:-sieve-cuda} && SIEVE_REQUIRE_GPU=1 timeout "$2" "$bin" ${3:-} --test-threads 1 > "$OUT/t-$1.log" 2>&1; echo "$1: exit $?")
  grep -E "^test |test result|panicked|worst|cuSPARSELt [0-9]" "$OUT/t-$1.log" | cut -c1-300 | head -40
}
PART=${PART:-a}
if [ "$PART" = c ]; then
  at tests
  SIEVE_LT_PRECISIONS=int8,fp8 t slide_lt 70
  SIEVE_LT_PRECISIONS=f16 SIEVE_CUSPARSELT_SEARCH=off t slide_lt 45 gpu_slide_on_cusparselt_matches
  cp "$OUT/t-slide_lt.log" "$OUT/t-slide_lt-f16-nosearch.log"
  SIEVE_LT_PRECISIONS=f16 t slide_lt 45 gpu_slide_on_cusparselt_matches
  if grep -q "test result: ok" "$OUT/t-slide_lt.log"; then search=on; else search=off; fi
  echo "search for the rest: $search"
  export SIEVE_CUSPARSELT_SEARCH=$search
  at gemm-lt
  timeout 160 $S bench gemm --shapes llama2-7b --precision f16,slide-lt-int8,slide-lt-fp8,cublaslt-int8,cublaslt-fp8,slide-lt-f16,slide-f16-copy \
    --pattern 2:4,6:8 --n 512,4096,8192 --reps 10 --json "$OUT/gemm-lt.json" > "$OUT/gemm-lt.log" 2>&1; echo "exit $?"
  grep -E "^\||cuSPARSELt|alone|rror" "$OUT/gemm-lt.log" | cut -c1-170
  at runner
  t runner 60 slide_prompts_on_cusparselt_match_cpu sieve-gpu
  at end
  exit 0
fi
if [ "$PART" = e ]; then
  # Part c within ~280 s: no search-off run unless the searched f16 test fails, 6:8 only.
  at tests
  SIEVE_LT_PRECISIONS=int8,fp8 t slide_lt 60
  SIEVE_LT_PRECISIONS=f16 t slide_lt 40 gpu_slide_on_cusparselt_matches
  if grep -q "test result: ok" "$OUT/t-slide_lt.log"; then search=on; else search=off
    SIEVE_LT_PRECISIONS=f16 SIEVE_CUSPARSELT_SEARCH=off t slide_lt 40 gpu_slide_on_cusparselt_matches
  fi
  export SIEVE_CUSPARSELT_SEARCH=$search
  at gemm-lt
  timeout 110 $S bench gemm --shapes llama2-7b --precision f16,slide-lt-int8,slide-lt-fp8,cublaslt-int8,cublaslt-fp8,slide-lt-f16,slide-f16-copy \
    --pattern 6:8 --n 4096,8192 --reps 10 --json "$OUT/gemm-lt.json" > "$OUT/gemm-lt.log" 2>&1; echo "exit $?"
  grep -E "^\||cuSPARSELt|alone|rror" "$OUT/gemm-lt.log" | cut -c1-170
  at runner
  t runner 50 slide_prompts_on_cusparselt_match_cpu sieve-gpu
  at end
  exit 0
fi
if [ "$PART" = d ]; then
  for mode in copy cusparselt; do
    echo "== SIEVE_SLIDE_PROMPT=$mode"
    SIEVE_SLIDE_PROMPT=$mode timeout 200 $S bench decode --synthetic llama2-7b --format slide --pattern 6:8 --sp 0.25 --dp 0 \
      --prompt 2048 --tokens 16 > "$OUT/ttft-$mode.log" 2>&1; echo "exit $?"
    grep -E "TTFT|TPOT|rror" "$OUT/ttft-$mode.log" | cut -c1-300
  done
  exit 0
fi
if [ "$PART" = a ]; then
  at tests
  t w4a8 45
  t slide_lt 120
  at gemm-w4a8
  timeout 70 $S bench gemm --shapes llama2-7b --precision f16,w4a16,w4a8,gguf-q4_0,q4_0-a8 --n 1,4,16,32 \
    --reps 50 --json "$OUT/gemm-w4a8.json" > "$OUT/gemm.log" 2>&1; echo "exit $?"
  grep -E "^\||device|copy|alone" "$OUT/gemm.log" | grep -v "^| f16" | cut -c1-150
  at gemm-lt
  timeout 240 $S bench gemm --shapes llama2-7b --precision f16,slide-lt-f16,slide-lt-int8,slide-lt-fp8,cublaslt-int8,cublaslt-fp8 \
    --pattern 2:4,6:8 --n 512,4096,8192 --reps 10 --json "$OUT/gemm-lt.json" > "$OUT/gemm-lt.log" 2>&1; echo "exit $?"
  grep -E "^\||cuSPARSELt|alone|rror" "$OUT/gemm-lt.log" | cut -c1-170
  at end
  exit 0
fi
at model
for a in int8 f16; do
  echo "== bench decode --values int4 --activations $a"
  timeout 150 $S bench decode --synthetic llama2-7b --format dense --values int4 --sp 0 --dp 0 --activations $a \
    --prompt 128 --tokens 64 > "$OUT/decode-$a.log" 2>&1; echo "exit $?"
  grep -E "TPOT|rror" "$OUT/decode-$a.log" | cut -c1-420
done
at sanitize
bin=$(exe w4a8)
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 80 compute-sanitizer --tool memcheck \
  "$bin" --test-threads 1 > "$OUT/san-memcheck-w4a8.log" 2>&1; echo "memcheck w4a8: exit $?")
grep -E "ERROR SUMMARY|test result" "$OUT/san-memcheck-w4a8.log" | head -3
t runner 90 tiny_int4_models_with_int8_activations_run_w4a8 sieve-gpu
grep -E "W4A8 against" "$OUT/t-runner.log"
at end
