#!/usr/bin/env bash
# Device window G6 (2026-12-06, after G4 and G5 on the same warm machine; carry .gpu-mc, the
# default model's last part): why the GPU's perplexity of the TEAL int4 pack (sparsegpt sp 0.5
# dp 0.3 int4:128) is 0.5-1.3% below the CPU's (44.27 / 44.12 against 44.705). The thresholds
# reach both devices alike (same sites, same |x| > t on f32), so the suspects are the 4-bit GPU
# products' f16 arithmetic (an f16 input, f16 partial sums in the column-major kernel) with TEAL
# amplifying it, and run-to-run spread (split-K atomics). On the CPU alone the TEAL pack's
# 4,096-token perplexity moves by 1.6% when the masked inputs are rounded to f16 (44.705 ->
# 43.990) and by 0.1% over 32,768 tokens (42.498 -> 42.452): a flipped mask early in a window
# carries through its cache, and 4 windows do not average it out. So: the TEAL pack over 32,768
# tokens on both devices, and the same pack without TEAL (int4, dp 0: CPU 41.939 at home) over
# 4,096, both made here and scored on the CPU (16 threads) and the GPU. Device G6 (device
# windows G4, G5 first on the same warm machine).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$SIEVE_HOME/models" "$OUT"
M=$SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/m/smolA /tmp/m/smolB .gpu-mc/smolC > "$M"
md5sum "$M"   # a1231443440b107ff29f02bdb38c9d0a
bash scripts/fetch-model.sh > /dev/null
S=.gpu/bin/sieve
mk() { local p=$1; shift; timeout 150 $S pack --out "$p" --method sparsegpt --sp 0.5 --format dense --calib-samples 16 --calib-len 512 "$@" 2>&1 | tail -1; }
ppl() { local n=$1; shift; timeout 150 $S eval ppl --max-tokens $n "$@" 2>&1 | tail -1; }
mk /tmp/p-teal-int4.sieve --dp 0.3 --values int4:128 &
mk /tmp/p-int4.sieve --dp 0 --values int4:128 &
wait
ls -la /tmp/p-*.sieve
echo "p-int4 4096 cpu:  $(ppl 4096 --model /tmp/p-int4.sieve --device cpu)"
echo "p-int4 4096 cuda: $(ppl 4096 --model /tmp/p-int4.sieve --device cuda)"
echo "p-teal-int4 4096 cuda: $(ppl 4096 --model /tmp/p-teal-int4.sieve --device cuda)"
echo "p-teal-int4 32768 cuda: $(ppl 32768 --model /tmp/p-teal-int4.sieve --device cuda)"
echo "p-teal-int4 32768 cpu:  $(ppl 32768 --model /tmp/p-teal-int4.sieve --device cpu)"
date -u +%T
