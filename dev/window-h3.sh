#!/usr/bin/env bash
# Device window H3 (after H1 and H2 on the same warm machine; carry .gpu-ma and .gpu-mc, the default
# model's last part): the server test suite against the GPU engine (SIEVE_SERVE_TEST_DEVICE=
# cuda), not run since the batch layout (window G) and the shared prompt passes (window H1);
# every greedy answer under concurrency must equal its single-request answer.
# Ran 2026-12-06 10:14-10:33 UTC (docs/BENCHMARKS.md, "Windows H1-H4"); the t1r16s2 and
# t1r16f32 variants it measures were removed after it (an unknown variant name now runs the
# default rule).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$SIEVE_HOME/models" "$OUT"
M=$SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
cat .gpu-ma/smolA /tmp/m/smolB .gpu-mc/smolC > "$M"
md5sum "$M"   # a1231443440b107ff29f02bdb38c9d0a
bash scripts/fetch-model.sh > /dev/null
source scripts/gpu-quick.sh
run_t serve 400 --test-threads 1
date -u +%T
# The TEAL int4 pack's perplexity over 32,768 tokens with f32 sums in the column-major kernel
# (t1r16f32) against the default variants (window G6: GPU 42.339, CPU 42.498, CPU with
# f16-rounded inputs 42.452): is the 0.27% the f16 partial sums?
S=.gpu/bin/sieve
timeout 150 $S pack --out /tmp/p-teal-int4.sieve --method sparsegpt --sp 0.5 --format dense --calib-samples 16 --calib-len 512 --dp 0.3 --values int4:128 2>&1 | tail -1
echo "default variants: $(timeout 150 $S eval ppl --max-tokens 32768 --model /tmp/p-teal-int4.sieve --device cuda 2>&1 | tail -1)"
echo "t1r16f32: $(SIEVE_LOWBIT_COLS_VARIANT=t1r16f32 timeout 150 $S eval ppl --max-tokens 32768 --model /tmp/p-teal-int4.sieve --device cuda 2>&1 | tail -1)"
date -u +%T
