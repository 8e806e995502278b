#!/usr/bin/env bash
# Device window K1 (written 2026-12-06 for the next session; carry a slim .gpu — bin/sieve and
# the kernels, runner and slide test executables of scripts/gpu-runner-bundle.sh — and vendor
# from scripts/llama-cpp/fetch.sh: together under 64 MiB with the tree). What session J left:
# 1. issue 28's llama-server comparison under the issue's workload (llama-server
#    builds and its random 7B f16 GGUF is written in the background meanwhile);
# 2. the union tests after J5's test fix, and compute-sanitizer racecheck on them;
# 3. the union products' first bench gemm rows (tcbc-union, bcbc-union; built without a device);
# 4. the SlideSparse prompt path's f16 copy (window I1's kernel part: its kernel test, the
#    long-prompt runner test, the bench gemm crossover that sets slide::DECODE_MIN_TOKENS).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT" /tmp/g
start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
(TARGETS=llama-server nice -n 5 bash scripts/llama-cpp/build.sh > "$OUT/build.log" 2>&1; echo "build rc $?" >> "$OUT/build.log") &
build=$!
(python3 scripts/llama-cpp/random_gguf.py --shape llama2-7b --type f16 -o /tmp/g/7b-f16.gguf > "$OUT/gen.log" 2>&1; echo "gen rc $?" >> "$OUT/gen.log") &
gen=$!
source scripts/gpu-quick.sh
S=.gpu/bin/sieve
run_t kernels 100 union_matches
k=.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 '^kernels-')
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 90 compute-sanitizer --tool racecheck "$OLDPWD/$k" union_matches --test-threads 1 2>&1 \
  | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" | head -3 | sed "s/^/sanitizer racecheck: /")
run_t slide 90 --test-threads 1
run_t runner 150 long_prompts_of_low_bit_models_match_cpu tiny_slide_models_match_cpu --test-threads 1
timeout 90 $S bench gemm --shapes llama2-7b --precision f16,slide-f16,slide-f16-copy --pattern 6:8 --n 32,128,256,512,2048 --reps 20 2>&1 | grep -E "slide" | cut -c1-110
timeout 90 $S bench gemm --shapes llama2-7b --precision f16,tcbc-union,bcbc-union,tcbc-spmm,tcbc-per-token --n 1,2,4,8 --sp 0.5 --dp 0,0.5 --reps 20 2>&1 | grep -E "union|spmm|per-token|error" | cut -c1-120
echo "checks done at $(( $(date +%s) - start )) s"
wait_health() { for _ in $(seq 1 400); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0; sleep 0.5; done; return 1; }
load() { timeout 150 $S bench serve --url "http://127.0.0.1:$1" --clients "$2" --requests 2 --max-tokens 256 --prompt-words "$3" 2>&1 | grep -E "clients," | sed "s/^/$4: /"; }
$S serve --synthetic llama2-7b --device cuda --port 8090 --max-batch 32 --ctx 512 --sp 0 --dp 0 > "$OUT/serve-sieve.log" 2>&1 &
sp=$!
wait_health 8090 && load 8090 1,32 16 "sieve dense"
kill -TERM $sp; wait $sp 2>/dev/null
wait $gen; tail -1 "$OUT/gen.log"
wait $build; tail -2 "$OUT/build.log"
echo "servers at $(( $(date +%s) - start )) s"
server=vendor/llama.cpp/build/bin/llama-server
if [ -x "$server" ]; then
  "$server" -m /tmp/g/7b-f16.gguf --host 127.0.0.1 --port 8091 -ngl 99 --parallel 32 -c 32768 > "$OUT/llama-server.log" 2>&1 &
  lp=$!
  if wait_health 8091; then
    load 8091 1,32 40 "llama-server 40w"
    load 8091 32 48 "llama-server 48w"
  else
    tail -5 "$OUT/llama-server.log"
  fi
  kill -TERM $lp; wait $lp 2>/dev/null
fi
echo "end at $(( $(date +%s) - start )) s"
