#!/usr/bin/env bash
# Device window H2 (right after H1 on the same warm machine; carry .gpu-mb): the issue-28
# serving workload (32 clients, 128-token prompts, 256 tokens each; dev/window-f4.sh's client)
# now that a scheduler step's prompts share one batched pass, at the default step budget of
# 256 prompt tokens (two prompts a pass) and at 1,024 (eight), dense f16 against the 4-bit
# dual-sparse pack. Window G5 before it (H100, one prompt a pass): 3,658 against 3,854 tok/s,
# prompts 0.48 against 0.85 s of engine time.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT" /tmp/m && cp .gpu-mb/* /tmp/m/ 2>/dev/null   # the default model, second part (window H3)
nvidia-smi --query-gpu=name --format=csv,noheader
S=.gpu/bin/sieve
serve_one() {
  local name=$1; shift
  $S serve --synthetic llama2-7b --device cuda --port 8090 --max-batch 32 --ctx 512 "$@" > "$OUT/serve-$name.log" 2>&1 &
  local sp=$!
  for _ in $(seq 1 300); do curl -sf http://127.0.0.1:8090/health > /dev/null && break; sleep 0.5; done
  date -u +%T
  timeout 120 $S bench serve --url http://127.0.0.1:8090 --clients 32 --requests 2 --max-tokens 256 --prompt-words 16 2>&1 | grep -E "clients," | sed "s/^/$name: /"
  curl -s http://127.0.0.1:8090/metrics > "$OUT/metrics-$name.txt"
  grep -E "^sieve_(prompt_tokens_total|decode_steps_total|prefill_chunks_total|engine_|scheduler_busy)" "$OUT/metrics-$name.txt" | sed "s/^/$name: /"
  kill -TERM $sp; wait $sp 2>/dev/null
}
# One prompt a pass (the engine before the shared passes), then shared passes at two budgets.
[ "${UNSHARED:-1}" = 1 ] && (export SIEVE_SHARED_PROMPT_PASSES=off; serve_one int4-sparse-256-unshared --format dense --values int4 --sp 0.5 --dp 0.5)
for budget in ${BUDGETS:-256 1024}; do  # BUDGETS=1024 UNSHARED=0: the short form
  serve_one dense-$budget --sp 0 --dp 0 --prefill-chunk $budget
  serve_one int4-sparse-$budget --format dense --values int4 --sp 0.5 --dp 0.5 --prefill-chunk $budget
done
date -u +%T
