#!/usr/bin/env bash
# Device window D, second call (machine still warm from dev/window-d1.sh): llama.cpp and sieve in
# one session on the same GPU: llama-bench F16 at 128 and 2048 prompt tokens and Q4_0, sieve's
# TTFT and TPOT on the same shape and file, the 4-bit TEAL step, then both servers under the same
# load (dense f16 7B, 1 and 32 clients).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
date -u +%T
B=vendor/llama.cpp/build/bin/llama-bench
timeout 100 $B -m /tmp/g/7b-q4_0.gguf -ngl 99 -fa 1 -p 128 -n 256 -r 3 2>&1 | tee "$OUT/llama-q4_0.txt" | grep -E "^\|"
timeout 150 $B -m /tmp/g/7b-f16.gguf -ngl 99 -fa 1 -p 128,2048 -n 256 -r 3 2>&1 | tee "$OUT/llama-f16.txt" | grep -E "^\|"
date -u +%T
S=.gpu/bin/sieve
timeout 100 $S bench decode --model /tmp/g/7b-q4_0.gguf --prompt 128 --tokens 256 2>&1 | tee "$OUT/decode-gguf-q4_0.log" | grep -E "TPOT|TTFT|error|prefill of" | head -5
timeout 100 $S bench decode --synthetic llama2-7b --sp 0 --dp 0 --prompt 128 --tokens 256 2>&1 | tee "$OUT/decode-f16-128.log" | grep -E "TPOT|TTFT|error|prefill of" | head -5
timeout 100 $S bench decode --synthetic llama2-7b --sp 0 --dp 0 --prompt 2048 --tokens 16 2>&1 | tee "$OUT/decode-f16-2048.log" | grep -E "TPOT|TTFT|error|prefill of" | head -5
# The 2048-token prompt in passes of 2048 tokens (SIEVE_PREFILL_CHUNK; 256 by default).
SIEVE_PREFILL_CHUNK=2048 timeout 100 $S bench decode --synthetic llama2-7b --sp 0 --dp 0 --prompt 2048 --tokens 16 2>&1 | tee "$OUT/decode-f16-2048-chunk2048.log" | grep -E "TTFT|error" | sed "s/^/chunk 2048: /" | head -3


date -u +%T
$S serve --synthetic llama2-7b --device cuda --port 8090 --max-batch 32 --ctx 1024 > "$OUT/serve-sieve.log" 2>&1 &
sp=$!
vendor/llama.cpp/build/bin/llama-server -m /tmp/g/7b-f16.gguf --host 127.0.0.1 --port 8091 -ngl 99 --parallel 32 -c 32768 > "$OUT/llama-server.log" 2>&1 &
lp=$!
for _ in $(seq 1 240); do
  curl -sf http://127.0.0.1:8090/health > /dev/null && curl -sf http://127.0.0.1:8091/health > /dev/null && break
  sleep 0.5
done
date -u +%T
timeout 200 $S bench serve --url http://127.0.0.1:8090 --url http://127.0.0.1:8091 --clients 1,32 --requests 2 --max-tokens 256 --prompt-words 90 --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.txt" | tail -16
curl -s http://127.0.0.1:8090/metrics > "$OUT/metrics-sieve.txt"; grep -E "^sieve_(batch|prefill|engine|decode)" "$OUT/metrics-sieve.txt" | head -30
kill -TERM $sp $lp; wait $sp $lp 2>/dev/null
tail -3 "$OUT/serve-sieve.log"
date -u +%T
