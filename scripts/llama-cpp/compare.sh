#!/usr/bin/env bash
# llama.cpp's speed on the GPU for each GGUF given: llama-bench, full offload, FlashAttention on,
# prompt 128 tokens and 256 generated tokens, 3 repetitions. Runs ON the GPU machine after
# scripts/llama-cpp/build.sh. JSON per model: $OUT/llama-bench-<name>.json (OUT defaults to
# ./llama-bench-out); one summary line per model on stdout.
#
# usage: scripts/llama-cpp/compare.sh MODEL.gguf [MODEL.gguf ...]
# env: OUT, PROMPT (128), GEN (256), REPS (3), BENCH_ARGS (extra llama-bench flags)
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
bench="$repo/vendor/llama.cpp/build/bin/llama-bench"
out="${OUT:-$PWD/llama-bench-out}"
[ $# -gt 0 ] || { echo "usage: $0 MODEL.gguf [MODEL.gguf ...]" >&2; exit 2; }
[ -x "$bench" ] || { echo "no $bench: run scripts/llama-cpp/build.sh first" >&2; exit 1; }
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

status=0
for model in "$@"; do
    name="$(basename "$model" .gguf)"
    json="$out/llama-bench-$name.json"
    # shellcheck disable=SC2086
    if ! "$bench" -m "$model" -ngl 99 -fa 1 -p "${PROMPT:-128}" -n "${GEN:-256}" -r "${REPS:-3}" \
            -o json ${BENCH_ARGS:-} >"$json" 2>"$out/llama-bench-$name.log"; then
        echo "$name: llama-bench failed, see $out/llama-bench-$name.log:"; tail -5 "$out/llama-bench-$name.log"
        status=1
        continue
    fi
    python3 - "$json" "$name" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
pp = [r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0]
tg = [r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0]
line = f"{sys.argv[2]}:"
if pp:
    line += f" prompt {pp[0]['avg_ts']:.1f} ± {pp[0]['stddev_ts']:.1f} tok/s (pp{pp[0]['n_prompt']}),"
if tg:
    g = tg[0]["avg_ts"]
    line += f" gen {g:.1f} ± {tg[0]['stddev_ts']:.1f} tok/s (tg{tg[0]['n_gen']}), TPOT {1000 / g:.2f} ms"
print(line, f"[{rows[0].get('model_type', '')}, {rows[0].get('gpu_info', '')}, build {rows[0].get('build_commit', '')}]")
PY
done
exit $status
