#!/usr/bin/env bash
# Device window F, fifth call (warm machine from dev/window-f4.sh, which left the default model's
# first part in /tmp/m; carry .gpu-mb): why the GPU's perplexity of a dense int4 TEAL pack is
# 1.3% below the CPU's (44.122 against 44.705, window D3). The same pack made here, then on the
# GPU: as loaded; with --f16-weights (the tied head dense f16 instead of Q8_0: on the CPU it
# moved 44.705 -> 44.653); with SIEVE_LOWBIT_COLS=off (the tensor-core W4A16 kernel, f32
# accumulation, instead of the column-major 4-bit kernel's f16 partial sums).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$SIEVE_HOME/models" "$OUT"
M=$SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/m/smolA .gpu-mb/smolB > "$M"
md5sum "$M"
bash scripts/fetch-model.sh > /dev/null
S=.gpu/bin/sieve
P=/tmp/pack-int4.sieve
timeout 120 $S pack --out $P --method sparsegpt --sp 0.5 --dp 0.3 --format dense --values int4:128 --calib-samples 16 --calib-len 512 2>&1 | tail -1
ppl() { timeout 100 $S eval ppl --max-tokens 4096 --model $P "$@" 2>&1 | tail -1; }
echo "cuda:                      $(ppl --device cuda)"
echo "cuda --f16-weights:        $(ppl --device cuda --f16-weights)"
echo "cuda SIEVE_LOWBIT_COLS=off: $(SIEVE_LOWBIT_COLS=off ppl --device cuda)"
echo "cuda both:                 $(SIEVE_LOWBIT_COLS=off ppl --device cuda --f16-weights)"
echo "cuda --step persistent:    $(ppl --device cuda --f16-weights --step persistent)"
date -u +%T
