#!/usr/bin/env bash
# The "Low-bit values" table of docs/QUALITY.md (issue 26): perplexity on wikitext-2 test of
# Balanced-CBC packs whose kept values are snapped to 4-bit grids (`--values int4:128`, one f16
# scale per row and 128 columns; SparseGPT rounds in its sweep and compensates), dense (16:16)
# and SparseGPT 50% (8:16) with TEAL 0 / 0.3 / 0.5, beside the f16-valued packs of the same
# settings, and optionally a GGUF file as it is (GGUF=path); FORMAT=dense: dense int4:128 packs,
# unstructured SparseGPT, with TEAL (below). Same helpers and settings as
# scripts/quality-table.sh (calibration on wikitext-2 *valid*).
#
# Environment: as scripts/quality-table.sh (SIEVE, MODEL, TOKENS, CALIB_SAMPLES, CALIB_LEN,
# OUT), plus GGUF, and ONLY="METHOD SP DP VALUES" to run that one row (e.g. ONLY="sparsegpt 0.5
# 0.3 int4:128"). The documented run used TOKENS=4096 CALIB_SAMPLES=16 CALIB_LEN=512.
set -euo pipefail
source "$(dirname "$0")/quality-common.sh" /tmp/sieve-quality-lowbit

# FORMAT=dense: dense packs with unstructured sparsity instead (what the GPU multiplies 4-bit
# from int4:128 values, column-major under TEAL: "TEAL on 4-bit weights" in docs/BENCHMARKS.md).
format=${FORMAT:-balanced-cbc}
pattern_args=(--pattern balanced)
[ "$format" = dense ] && pattern_args=()

row() { # row METHOD SP DP VALUES
  local method=$1 sp=$2 dp=$3 values=$4
  [ -n "${ONLY:-}" ] && [ "$ONLY" != "$method $sp $dp $values" ] && return 0
  local file="$out/${format}-${method}-sp${sp}-dp${dp}-${values//:/-}.sieve"
  local t0 t1 stats
  t0=$(date +%s)
  stats=$("$sieve" pack "${model_args[@]}" --out "$file" --method "$method" "${pattern_args[@]}" \
    --sp "$sp" --dp "$dp" --format "$format" --values "$values" --calib-samples "$samples" \
    --calib-len "$len" 2>/dev/null | awk '$1 == "all" {print $2}')
  t1=$(date +%s)
  echo "| $method | $sp | $dp | $values | $stats | $(ppl_of "$file") | $((t1 - t0)) s |"
}

echo "ppl on the first $tokens tokens of wikitext-2 test (ctx 1024); calibration $samples x $len tokens of wikitext-2 valid; format $format"
echo "started $(date -u '+%Y-%m-%d %H:%M UTC') on $(nproc) cores, $(uptime | sed 's/.*load/load/')"
echo
echo "| method | sp | dp | values | measured sp | ppl | pack time |"
echo "|---|---|---|---|---|---|---|"
if [ "$format" = dense ]; then
  row sparsegpt 0 0.5 int4:128
  row sparsegpt 0.5 0 int4:128
  row sparsegpt 0.5 0.3 int4:128
  row sparsegpt 0.5 0.5 int4:128
else
  row magnitude 0 0 int4:128
  row sparsegpt 0 0 int4:128
  row sparsegpt 0.5 0 int4:128
  row sparsegpt 0.5 0.3 int4:128
  row sparsegpt 0.5 0.5 int4:128
  row sparsegpt 0.5 0.5 f16
fi
if [ -n "${GGUF:-}" ]; then
  echo "| GGUF file as it is: $(basename "$GGUF") | | | | | $(ppl_of "$GGUF") | - |"
fi
echo
echo "finished $(date -u '+%Y-%m-%d %H:%M UTC'), $(uptime | sed 's/.*load/load/')"
