#!/usr/bin/env bash
# One GPU-machine call for `sieve serve --device cuda` (carry .gpu, built by
# `SERVE=1 scripts/gpu-runner-bundle.sh`; the default model assembled first at
# $SIEVE_HOME/models, e.g. from parts sent in earlier calls):
#   1. the runner tests (the slot pool against the CPU among them) and the server tests against
#      the GPU engine (SIEVE_SERVE_TEST_DEVICE=cuda);
#   2. batch-1 TPOT of the model from `sieve bench decode --model`;
#   3. `sieve serve --device cuda` (then `--device cpu` on the same cores) under
#      `sieve bench serve` with 1, 8 and 32 concurrent streams.
# Logs and JSON go to $OUT; the summary lines are printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export SIEVE_HOME=${SIEVE_HOME:-/tmp/sieve-home}
model=$SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  while IFS=$'\t' read -r exe dir; do
    case "$exe" in runner-*|serve-*) ;; *) continue ;; esac
    dir="crates/${dir##*/crates/}"  # staged with this machine's absolute path
    (cd "$dir" && SIEVE_REQUIRE_GPU=1 SIEVE_SERVE_TEST_DEVICE=cuda "$OLDPWD/.gpu/tests/$exe") \
      > "$OUT/$exe.log" 2>&1
    echo "$exe: exit $?"
    grep -E "^test result|FAILED|panicked|slot_pool.*error" "$OUT/$exe.log" | head -20
  done < .gpu/tests.tsv
fi
.gpu/bin/sieve bench decode --model "$model" --prompt 128 --tokens 256 --json "$OUT/decode.json" \
  > "$OUT/decode.log" 2>&1
echo "bench decode: exit $?"; grep -iE "tpot|ttft" "$OUT/decode.log" | head -6
for dev in cuda cpu; do
  port=8090
  .gpu/bin/sieve serve --model "$model" --device "$dev" --port $port --max-batch 32 --ctx 1024 \
    > "$OUT/serve-$dev.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    sleep 0.5
  done
  head -3 "$OUT/serve-$dev.log"
  clients_list=${CLIENTS:-"1 8 32"}
  [ "$dev" = cpu ] && clients_list=${CPU_CLIENTS:-"1 8"}
  for clients in $clients_list; do
    .gpu/bin/sieve bench serve --url "http://127.0.0.1:$port" --clients "$clients" \
      --requests "${REQUESTS:-2}" --max-tokens "${MAX_TOKENS:-128}" \
      --json "$OUT/serve-$dev-$clients.json" 2>&1 | tail -3
  done
  curl -s "http://127.0.0.1:$port/metrics" > "$OUT/metrics-$dev.txt"
  kill -TERM $pid; wait $pid; echo "serve $dev: exit $?"
  tail -2 "$OUT/serve-$dev.log"
done
