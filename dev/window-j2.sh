#!/usr/bin/env bash
# Device window J2 (2026-12-06; carry .gpu and vendor): issue 28's table row "Llama-2-7B shape
# dense f16, 32 concurrent, >= 1.5x llama-server" with the issue's workload (128-token prompts,
# 256 tokens each), both servers in one call under the same client. llama-server builds (nice 5)
# while its random-weight f16 GGUF is written and sieve serves its own synthetic 7B; then
# llama-server (--parallel 32) at two prompt lengths in words, since its tokenizer (the GGUF
# script's two-symbol BPE) makes fewer tokens of a word than the synthetic shapes' byte-level
# one: the client prints the prompt tokens each server counted.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT" /tmp/g
nvidia-smi --query-gpu=name --format=csv,noheader
(TARGETS=llama-server nice -n 5 bash scripts/llama-cpp/build.sh > "$OUT/build.log" 2>&1; echo "build rc $?" >> "$OUT/build.log") &
build=$!
(python3 scripts/llama-cpp/random_gguf.py --shape llama2-7b --type f16 -o /tmp/g/7b-f16.gguf > "$OUT/gen.log" 2>&1; echo "gen rc $?" >> "$OUT/gen.log") &
gen=$!
S=.gpu/bin/sieve
wait_health() { for _ in $(seq 1 400); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0; sleep 0.5; done; return 1; }
load() { timeout 150 $S bench serve --url "http://127.0.0.1:$1" --clients "$2" --requests 2 --max-tokens 256 --prompt-words "$3" 2>&1 | grep -E "clients,|prompt" | sed "s/^/$4: /"; }
$S serve --synthetic llama2-7b --device cuda --port 8090 --max-batch 32 --ctx 512 --sp 0 --dp 0 > "$OUT/serve-sieve.log" 2>&1 &
sp=$!
wait_health 8090 && { load 8090 1,32 16 "sieve dense"; }
kill -TERM $sp; wait $sp 2>/dev/null
wait $gen; tail -1 "$OUT/gen.log"
wait $build; tail -2 "$OUT/build.log"
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
date -u +%T
