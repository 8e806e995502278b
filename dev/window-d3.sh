#!/usr/bin/env bash
# Device window D, third call (warm machine; .gpu and vendor from window-d1.sh, the default model
# carried in parts: .gpu-ma and .gpu-mb by dev/window-f1.sh and f2.sh into /tmp/m, .gpu-mc with this one).
# The default model (SmolLM2-135M-Instruct Q4_1, real weights) on the GPU beside llama.cpp:
# perplexity GPU against CPU (the GGUF in its blocks, and a dense int4 SparseGPT 0.5 / TEAL 0.3
# pack made here), decode speed graph and persistent, llama-bench on the same file, and both
# servers under 1 and 64 clients.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$SIEVE_HOME/models" "$OUT"
M=$SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
cp .gpu-mc/* /tmp/m/ && cat /tmp/m/smolpart0[0-6] > "$M"
md5sum "$M"
bash scripts/fetch-model.sh
S=.gpu/bin/sieve
date -u +%T
ppl() { timeout 200 $S eval ppl --max-tokens 4096 "$@" 2>&1 | tail -1; }
echo "gguf cpu:       $(ppl --device cpu)"
echo "gguf cuda:      $(ppl --device cuda)"
echo "gguf f16 cpu:   $(ppl --device cpu --f16-weights)"
echo "gguf f16 cuda:  $(ppl --device cuda --f16-weights)"
P=/tmp/pack-int4.sieve
timeout 200 $S pack --out $P --method sparsegpt --sp 0.5 --dp 0.3 --format dense --values int4:128 --calib-samples 16 --calib-len 512 2>&1 | tail -3
echo "pack cpu:       $(ppl --model $P --device cpu)"
echo "pack cuda:      $(ppl --model $P --device cuda)"
date -u +%T
timeout 120 $S bench decode --model "$M" --step persistent,graph --prompt 128 --tokens 256 2>&1 | tee "$OUT/decode-smol.log" | grep -E "TPOT|TTFT|error" | head -6
timeout 60 vendor/llama.cpp/build/bin/llama-bench -m "$M" -ngl 99 -fa 1 -p 128 -n 256 -r 3 2>&1 | tee "$OUT/llama-smol.txt" | grep -E "^\|"
date -u +%T
$S serve --device cuda --port 8090 --max-batch 64 --ctx 1024 > "$OUT/serve-sieve-smol.log" 2>&1 &
sp=$!
vendor/llama.cpp/build/bin/llama-server -m "$M" --host 127.0.0.1 --port 8091 -ngl 99 --parallel 64 -c 65536 > "$OUT/llama-server-smol.log" 2>&1 &
lp=$!
for _ in $(seq 1 240); do
  curl -sf http://127.0.0.1:8090/health > /dev/null && curl -sf http://127.0.0.1:8091/health > /dev/null && break
  sleep 0.5
done
timeout 200 $S bench serve --url http://127.0.0.1:8090 --url http://127.0.0.1:8091 --clients 1,64 --requests 2 --max-tokens 256 --prompt-words 90 --json "$OUT/serve-smol.json" 2>&1 | tee "$OUT/serve-smol.txt" | tail -16
curl -s http://127.0.0.1:8090/metrics > "$OUT/metrics-sieve-smol.txt"; grep -E "^sieve_(batch|prefill|engine|decode)" "$OUT/metrics-sieve-smol.txt" | head -30
kill -TERM $sp $lp; wait $sp $lp 2>/dev/null
date -u +%T
