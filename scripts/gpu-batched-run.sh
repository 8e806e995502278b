#!/usr/bin/env bash
# The GPU-machine runs for batched serving (issue 28), in phases, one device call each
# (carry .gpu from `SERVE=1 scripts/gpu-runner-bundle.sh`; `vendor` from
# scripts/llama-cpp/fetch.sh for the llama-server phase). Logs and JSON go to $OUT.
#
#   PHASE=tests  the GPU tests first (runner: batched steps against single steps and the CPU,
#                argmax_rows; sieve-cuda kernels, low-bit, IE-BME; the server tests against
#                the GPU engine, default model at $SIEVE_HOME/models)            ~3 min
#   PHASE=bench  Tiled-CBC's two ways for N tokens (`bench gemm`: the batched crossover),
#                `sieve bench decode --batch` on the 7B shape: dense f16, W4A16, Tiled-CBC
#                0.5 / 0.5, each at 1, 2, 8, 32, 64 sequences                       ~7 min
#   PHASE=serve  llama.cpp builds in the background while a random-weight 7B f16 GGUF is
#                written and `sieve serve --model` on it takes `sieve bench serve` at 1, 8,
#                32 clients; then llama-server on the same file under the same load  ~9 min
#   PHASE=smol   the default model: sieve serve --device cuda against llama-server (built in
#                an earlier call on the same warm machine) at 1, 8, 32, 64 clients    ~3 min
#   PHASE=kv8    the 8-bit KV cache (issue 26): its kernel tests, then `bench decode` on the
#                7B shape at 8192 positions with the f16 and the int8 cache, and the default
#                model's perplexity on the GPU with each (the CPU's: 21.316 / 21.266)  ~4 min
#   PHASE=ttft   time to first token, same run: llama.cpp's llama-bench (built in an earlier
#                call) on a random-weight 7B f16 GGUF at 128 and 2048 prompt tokens, and
#                `sieve bench decode` on the 7B shape (dense and Tiled-CBC 0.5 / 0.5)   ~3 min
#   PHASE=persistent  the persistent step (issue 27): its runner test against the graph step,
#                then `bench decode --step persistent,graph` on the dense 7B shape and the
#                default model, with traces (SVG) in $OUT                         ~3 min
#   PHASE=decoder  Tiled-CBC's decode-then-GEMM against per-token products (`bench gemm`, 7B
#                shapes, sp 0.5) and `bench decode --batch` of a Tiled-CBC 0.5 / 0.5 model
#                around the one-pass crossover (DECODED_MIN_BATCH); then the 8-bit cache's
#                decode at 8192 positions against the f16 cache's                    ~4 min
#   PHASE=cols   the column-major 4-bit kernel (TEAL column skipping, issue 26): its tests and the
#                runner's Q4_0 models, then `bench gemm` at N = 1 on the 7B shapes against
#                cuBLAS f16 and the tensor-core W4A16 / Q4_0 kernels                   ~3 min
#   PHASE=cols-decode  `bench decode` on the 7B shape with int4 and q4_0 values at sp / dp
#                0 / 0, 0.5 / 0.5, 0.5 / 0.7, and 0.5 / 0.5 in the tensor-core layout  ~7 min
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export SIEVE_HOME=${SIEVE_HOME:-/tmp/sieve-home}
sieve=.gpu/bin/sieve
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader

wait_health() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
    sleep 0.5
  done
  echo "no /health on port $1"; return 1
}

# load PORT NAME CLIENTS...: sieve bench serve, 256 tokens a request, ~128-token prompts.
load() {
  local port=$1 name=$2; shift 2
  for c in "$@"; do
    $sieve bench serve --url "http://127.0.0.1:$port" --clients "$c" --requests "${REQUESTS:-2}" \
      --max-tokens "${MAX_TOKENS:-256}" --prompt-words "${PROMPT_WORDS:-90}" \
      --json "$OUT/load-$name-$c.json" 2>&1 | tail -2
  done
}

case "${PHASE:-tests}" in
tests)
  # ONLY=regex: just the test executables whose names match (e.g. ONLY='runner|serve').
  while IFS=$'\t' read -r exe dir; do
    [[ -n "${ONLY:-}" && ! "$exe" =~ ${ONLY:-} ]] && continue
    dir="crates/${dir##*/crates/}"  # staged with the build machine's absolute path
    (cd "$dir" && SIEVE_REQUIRE_GPU=1 SIEVE_SERVE_TEST_DEVICE=cuda "$OLDPWD/.gpu/tests/$exe") \
      > "$OUT/$exe.log" 2>&1
    echo "$exe: exit $?"
    grep -E "^test result|FAILED|panicked|batched_slot|max error" "$OUT/$exe.log" | head -20
  done < .gpu/tests.tsv
  ;;
bench)
  $sieve bench gemm --shapes llama2-7b --precision f16,tcbc-per-token,tcbc-decode-gemm --n 1,2,4,8,16,32 \
    --sp 0.5,0.7 --graph --json "$OUT/gemm-tcbc.json" 2>&1 | tail -60 | tee "$OUT/gemm-tcbc.log"
  $sieve bench decode --synthetic llama2-7b --sp 0,0.5 --dp 0,0.5 --values f16 \
    --batch 1,2,8,32,64 --prompt 128 --tokens 128 --json "$OUT/batch-f16.json" 2>&1 | tee "$OUT/batch-f16.log"
  $sieve bench decode --synthetic llama2-7b --sp 0 --dp 0 --values int4 \
    --batch 1,2,8,32,64 --prompt 128 --tokens 128 --json "$OUT/batch-int4.json" 2>&1 | tee "$OUT/batch-int4.log"
  ;;
serve)
  # The llama.cpp build runs beside sieve's load (BUILD_STARTED=1: the caller started it, with
  # /tmp/llama-build.log and /tmp/llama-build.done, e.g. beside PHASE=tests in the same call).
  if [ "${BUILD_STARTED:-0}" != 1 ]; then
    (TARGETS=llama-server nice -n 5 bash scripts/llama-cpp/build.sh > /tmp/llama-build.log 2>&1
     echo "build rc $?" >> /tmp/llama-build.log; touch /tmp/llama-build.done) &
  fi
  mkdir -p /tmp/g
  python3 scripts/llama-cpp/random_gguf.py --shape llama2-7b --type f16 -o /tmp/g/7b-f16.gguf > "$OUT/gen.log" 2>&1 \
    || { tail -3 "$OUT/gen.log"; exit 1; }
  $sieve serve --model /tmp/g/7b-f16.gguf --device cuda --port 8090 --max-batch 32 --ctx 1024 \
    > "$OUT/serve-sieve-7b.log" 2>&1 &
  pid=$!
  wait_health 8090 && load 8090 sieve-7b 1 8 32
  curl -s http://127.0.0.1:8090/metrics > "$OUT/metrics-sieve-7b.txt"
  kill -TERM $pid; wait $pid
  for _ in $(seq 1 600); do [ -e /tmp/llama-build.done ] && break; sleep 1; done
  cp /tmp/llama-build.log "$OUT/build.log"; tail -2 "$OUT/build.log"
  server=vendor/llama.cpp/build/bin/llama-server
  "$server" -m /tmp/g/7b-f16.gguf --host 127.0.0.1 --port 8091 -ngl 99 --parallel 32 -c 32768 \
    > "$OUT/llama-server-7b.log" 2>&1 &
  pid=$!
  wait_health 8091 && load 8091 llama-7b 1 8 32
  kill -TERM $pid; wait $pid
  ;;
smol)
  model=$SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
  $sieve serve --model "$model" --device cuda --port 8090 --max-batch 64 --ctx 1024 \
    > "$OUT/serve-sieve-smol.log" 2>&1 &
  pid=$!
  wait_health 8090 && load 8090 sieve-smol 1 8 32 64
  curl -s http://127.0.0.1:8090/metrics > "$OUT/metrics-sieve-smol.txt"
  kill -TERM $pid; wait $pid
  vendor/llama.cpp/build/bin/llama-server -m "$model" --host 127.0.0.1 --port 8091 -ngl 99 \
    --parallel 64 -c 65536 > "$OUT/llama-server-smol.log" 2>&1 &
  pid=$!
  wait_health 8091 && load 8091 llama-smol 1 8 32 64
  kill -TERM $pid; wait $pid
  ;;
kv8)
  while IFS=$'\t' read -r exe dir; do
    case "$exe" in kv_cache-*|runner-*) ;; *) continue ;; esac
    dir="crates/${dir##*/crates/}"
    (cd "$dir" && SIEVE_REQUIRE_GPU=1 "$OLDPWD/.gpu/tests/$exe" kv int8 batched_slot_steps rope_and_attention) > "$OUT/kv8-$exe.log" 2>&1
    echo "$exe: exit $?"
    grep -E "^test result|FAILED|panicked|max error" "$OUT/kv8-$exe.log" | head -20
  done < .gpu/tests.tsv
  for kv in f16 int8; do
    $sieve bench decode --synthetic llama2-7b --sp 0,0.5 --dp 0,0.5 --context 8192 --kv-cache $kv \
      --prompt 128 --tokens 128 --json "$OUT/kv8-decode-$kv.json" 2>&1 | tee "$OUT/kv8-decode-$kv.log"
    $sieve eval ppl --device cuda --kv-cache $kv --ctx 1024 --max-tokens 4096 2>&1 | tail -1
  done
  ;;
persistent)
  source scripts/gpu-quick.sh
  run_t runner 240 persistent_step --nocapture
  grep -E "max logit|step_us|persistent_step" "$OUT/runner.log" | head -12
  $sieve bench decode --synthetic llama2-7b --sp 0 --dp 0 --step persistent,graph --prompt 128 \
    --tokens 256 --trace "$OUT/trace-7b.svg" --json "$OUT/persistent-7b.json" 2>&1 | tee "$OUT/persistent-7b.log"
  $sieve bench decode --model "$SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf" --f16-weights --step persistent,graph \
    --prompt 128 --tokens 256 --trace "$OUT/trace-smol.svg" --json "$OUT/persistent-smol.json" 2>&1 \
    | tee "$OUT/persistent-smol.log"
  for step in persistent graph; do
    echo "ppl, step $step: $($sieve eval ppl --device cuda --f16-weights --step $step --ctx 1024 --max-tokens 4096 2>&1 | tail -1)"
  done
  ;;
ttft)
  mkdir -p /tmp/g
  [ -e /tmp/g/7b-f16.gguf ] || python3 scripts/llama-cpp/random_gguf.py --shape llama2-7b --type f16 \
    -o /tmp/g/7b-f16.gguf > "$OUT/gen.log" 2>&1 || { tail -3 "$OUT/gen.log"; exit 1; }
  vendor/llama.cpp/build/bin/llama-bench -m /tmp/g/7b-f16.gguf -ngl 99 -fa 1 -p 128,2048 -n 0 -r 5 \
    2>&1 | tee "$OUT/ttft-llama.log" | grep -E "model|---|pp"
  $sieve bench decode --synthetic llama2-7b --sp 0,0.5 --dp 0,0.5 --prompt 128 --tokens 64 \
    --json "$OUT/ttft-128.json" 2>&1 | tee "$OUT/ttft-128.log" | grep -iE "ttft|tpot|sp "
  $sieve bench decode --synthetic llama2-7b --sp 0 --dp 0 --prompt 2048 --tokens 64 \
    --json "$OUT/ttft-2048.json" 2>&1 | tee "$OUT/ttft-2048.log" | grep -iE "ttft|tpot|sp "
  ;;
decoder)
  $sieve bench gemm --shapes llama2-7b --precision f16,tcbc-per-token,tcbc-decode-gemm --n 1,4,8,32 \
    --sp 0.5 --graph --json "$OUT/decoder-gemm.json" 2>&1 | tail -40 | tee "$OUT/decoder-gemm.log"
  $sieve bench decode --synthetic llama2-7b --sp 0,0.5 --dp 0,0.5 --values f16 \
    --batch 1,2,4,5,8,16,32,64 --prompt 128 --tokens 128 --json "$OUT/decoder-batch.json" 2>&1 \
    | tee "$OUT/decoder-batch.log"
  for kv in f16 int8; do
    $sieve bench decode --synthetic llama2-7b --sp 0 --dp 0 --context 8192 --kv-cache $kv \
      --prompt 128 --tokens 128 --json "$OUT/kv8-decode-$kv.json" 2>&1 | tee "$OUT/kv8-decode-$kv.log"
  done
  ;;
cols)
  source scripts/gpu-quick.sh
  run_t lowbit_cols 120
  run_t runner 300 tiny_gguf_block_models_match_cpu
  $sieve bench gemm --shapes llama2-7b --precision f16,w4a16,gguf-q4_0,w4a16-cols,q4_0-cols --n 1 \
    --sp 0,0.5 --dp 0,0.5,0.7 --graph --json "$OUT/cols-gemm.json" 2>&1 | grep -vE "^(device|copy|empty)" \
    | tee "$OUT/cols-gemm.log"
  ;;
cols-decode)
  # TEAL on 4-bit weights in the whole step: the column layout against the tensor-core layout
  # (SIEVE_LOWBIT_COLS=off: the input masked, every weight read), W4A16 g128 and Q4_0.
  $sieve bench decode --synthetic llama2-7b --format dense --values int4 --sp 0,0.5,0.5 --dp 0,0.5,0.7 --prompt 128 \
    --tokens 256 --json "$OUT/cols-decode-int4.json" 2>&1 | tee "$OUT/cols-decode-int4.log" | grep -E "TPOT|error"
  SIEVE_LOWBIT_COLS=off $sieve bench decode --synthetic llama2-7b --format dense --values int4 --sp 0.5 --dp 0.5 \
    --prompt 128 --tokens 256 --json "$OUT/cols-decode-int4-tc.json" 2>&1 | tee "$OUT/cols-decode-int4-tc.log" \
    | grep -E "TPOT|error"
  $sieve bench decode --synthetic llama2-7b --format dense --values q4_0 --sp 0,0.5 --dp 0,0.5 --prompt 128 \
    --tokens 256 --json "$OUT/cols-decode-q4_0.json" 2>&1 | tee "$OUT/cols-decode-q4_0.log" | grep -E "TPOT|error"
  ;;
*) echo "PHASE is tests, bench, serve, smol, kv8, persistent, ttft, decoder, cols or cols-decode"; exit 2 ;;
esac
