#!/usr/bin/env bash
# On the GPU machine: llama.cpp's llama-server on the default model under the same load client
# (`sieve bench serve`) and request mix as sieve serve (scripts/gpu-serve-run.sh): clients in
# CLIENTS (default "1 8 32"), --parallel 32, continuous batching (llama-server's default),
# every layer on the GPU. Expects llama-server built by scripts/llama-cpp/build.sh
# (TARGETS=llama-server is enough). Logs and JSON to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
model=${SIEVE_HOME:-/tmp/sieve-home}/models/SmolLM2-135M-Instruct.Q4_1.gguf
server=vendor/llama.cpp/build/bin/llama-server
[ -x "$server" ] || { echo "serve-compare: no $server (build failed?)"; exit 1; }
port=8091
"$server" -m "$model" --host 127.0.0.1 --port $port -ngl 99 --parallel 32 -c 32768 \
  > "$OUT/llama-server.log" 2>&1 &
pid=$!
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  sleep 0.5
done
for clients in ${CLIENTS:-1 8 32}; do
  .gpu/bin/sieve bench serve --url "http://127.0.0.1:$port" --clients "$clients" \
    --requests "${REQUESTS:-2}" --max-tokens "${MAX_TOKENS:-128}" \
    --json "$OUT/llama-server-$clients.json" 2>&1 | tail -3
done
kill -TERM $pid; wait $pid
