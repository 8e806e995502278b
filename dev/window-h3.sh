#!/usr/bin/env bash
# Device window H3 (after H1 and H2 on the same warm machine; carry .gpu-mc, the default
# model's last part): the server test suite against the GPU engine (SIEVE_SERVE_TEST_DEVICE=
# cuda), not run since the batch layout (window G) and the shared prompt passes (window H1);
# every greedy answer under concurrency must equal its single-request answer.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$SIEVE_HOME/models" "$OUT"
M=$SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/m/smolA /tmp/m/smolB .gpu-mc/smolC > "$M"
md5sum "$M"   # a1231443440b107ff29f02bdb38c9d0a
bash scripts/fetch-model.sh > /dev/null
source scripts/gpu-quick.sh
run_t serve 400 --test-threads 1
date -u +%T
