#!/usr/bin/env bash
# Device window D, first call (2026-12-05/06 night): the runner tests of the batched pass on the
# GPU (two were changed without a device last session), the new row kernels' test and memcheck, while llama.cpp builds and the random 7B
# GGUFs are written for the second call (dev/window-d2.sh, same warm machine).
# Carry .gpu (sieve + the runner test executable only) and vendor (scripts/llama-cpp/fetch.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
source scripts/gpu-quick.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
mkdir -p /tmp/g /tmp/wd
(TARGETS="llama-bench llama-server" JOBS=10 nice -n 5 bash scripts/llama-cpp/build.sh > /tmp/wd/build.log 2>&1; echo "build rc $? $(date -u +%T)" >> /tmp/wd/build.log) &
(for t in q4_0 f16; do nice -n 5 python3 scripts/llama-cpp/random_gguf.py --shape llama2-7b --type $t -o /tmp/g/7b-$t.gguf >> /tmp/wd/gen.log 2>&1; echo "gen $t rc $? $(date -u +%T)" >> /tmp/wd/gen.log; done) &
date -u +%T
run_t prefill_rows 60
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 timeout 120 compute-sanitizer --tool memcheck "../../.gpu/tests/$(cut -f1 ../../.gpu/tests.tsv | grep -m1 '^prefill_rows-')" > "$OUT/memcheck-prefill_rows.log" 2>&1; echo "memcheck prefill_rows exit $?")
grep -E "ERROR SUMMARY|test result" "$OUT/memcheck-prefill_rows.log" | head -3
# The runner tests that go through the batched pass (prefill, slots, every format), the two
# changed without a device last session first, one at a time.
for f in tiny_balanced_cbc_model_matches_cpu tiny_dense_int4_packs_run_four_bit tiny_tiled_cbc tiny_dense_model_matches_cpu \
         prefill_profile long_prompts prompts_in_chunks batched_slot_steps slot_pool tiny_slide tiny_k_quant tiny_rlc_csc tiny_ie_bme; do
  run_t runner 120 $f --test-threads 1 | sed "s/^/$f: /"
  grep -E "^test .*(ok|FAILED)$" "$OUT/runner.log" | sed 's/^/  /'
  cp "$OUT/runner.log" "$OUT/runner-$f.log"
done
date -u +%T
date -u +%T
wait
tail -2 /tmp/wd/build.log; cat /tmp/wd/gen.log | grep gen; cp /tmp/wd/*.log "$OUT/"
date -u +%T
