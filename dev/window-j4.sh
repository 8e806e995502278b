#!/usr/bin/env bash
# Device window J4 (2026-12-06; carry a slim .gpu and vendor): windows J3 and J2 in one call
# (a machine start costs ~4 of the session's device minutes). llama.cpp's llama-server builds
# and its random-weight 7B f16 GGUF is written in the background while J3's union checks run
# (kernel tests, the runner's few-sequence cases, Balanced-CBC at 2..12 sequences); then both
# servers under the issue's workload (J2).
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
run_t kernels 150 union_matches
run_t runner 150 batched_slot_steps --test-threads 1
# The union kernels under compute-sanitizer (small shapes).
k=.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 '^kernels-')
for tool in memcheck racecheck; do
  (cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 120 compute-sanitizer --tool $tool "$OLDPWD/$k" union_matches --test-threads 1 2>&1 \
    | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result|Hazard" | head -4 | sed "s/^/sanitizer $tool: /")
done
S=.gpu/bin/sieve
timeout 150 $S bench decode --synthetic llama2-7b --format balanced-cbc --sp 0.5 --dp 0.5 --prompt 128 --tokens 32 --batch 1,2,4,6,8,9,12 2>&1 \
  | grep -E "batch" | cut -c1-150 | sed "s/^/balanced: /"
echo "J3 done at $(( $(date +%s) - start )) s"
wait_health() { for _ in $(seq 1 400); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0; sleep 0.5; done; return 1; }
load() { timeout 150 $S bench serve --url "http://127.0.0.1:$1" --clients "$2" --requests 2 --max-tokens 256 --prompt-words "$3" 2>&1 | grep -E "clients," | sed "s/^/$4: /"; }
$S serve --synthetic llama2-7b --device cuda --port 8090 --max-batch 32 --ctx 512 --sp 0 --dp 0 > "$OUT/serve-sieve.log" 2>&1 &
sp=$!
wait_health 8090 && load 8090 1,32 16 "sieve dense"
kill -TERM $sp; wait $sp 2>/dev/null
wait $gen; tail -1 "$OUT/gen.log"
wait $build; tail -2 "$OUT/build.log"
echo "servers start at $(( $(date +%s) - start )) s"
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
# (the slide tests: no device time left this session)
echo "end at $(( $(date +%s) - start )) s"
