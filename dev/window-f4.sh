#!/usr/bin/env bash
# Device window F, fourth call (sieve alone, 2026-12-06): the issue's serving workload with
# 128-token prompts (16 words: the synthetic shapes' tokenizer is byte-level, ~6 tokens a
# word; window F2's 90 words were ~580 tokens), dense f16 against the 4-bit dual-sparse pack
# (int4 g128, sp 0.5 / dp 0.5), 1 and 32 clients, /metrics after each. Carry .gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT" /tmp/m && cp .gpu-ma/* /tmp/m/   # the default model's first part, for window-f5.sh
S=.gpu/bin/sieve
serve_one() {
  local name=$1; shift
  $S serve --synthetic llama2-7b --device cuda --port 8090 --max-batch 32 --ctx 512 "$@" > "$OUT/serve-$name.log" 2>&1 &
  local sp=$!
  for _ in $(seq 1 300); do curl -sf http://127.0.0.1:8090/health > /dev/null && break; sleep 0.5; done
  date -u +%T
  timeout 120 $S bench serve --url http://127.0.0.1:8090 --clients 1,32 --requests 2 --max-tokens 256 --prompt-words 16 2>&1 | grep -E "clients," | sed "s/^/$name: /"
  curl -s http://127.0.0.1:8090/metrics > "$OUT/metrics-$name.txt"
  grep -E "^sieve_(prompt_tokens_total|completion_tokens_total|decode_steps_total|engine_|scheduler_busy|batch_size_sum)" "$OUT/metrics-$name.txt" | sed "s/^/$name: /"
  kill -TERM $sp; wait $sp 2>/dev/null
}
serve_one dense --sp 0 --dp 0
serve_one int4-sparse --format dense --values int4 --sp 0.5 --dp 0.5
date -u +%T
