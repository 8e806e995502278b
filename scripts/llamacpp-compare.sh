#!/usr/bin/env bash
# CPU speed (and optionally perplexity) of sieve against llama.cpp on the same GGUF file, the same
# machine and the same thread count. Results: docs/BENCHMARKS.md, "CPU: sieve vs llama.cpp".
#
# usage: scripts/llamacpp-compare.sh LLAMA_CPP_BUILD_DIR [SIEVE_BINARY]
#   LLAMA_CPP_BUILD_DIR holds bin/llama-bench (and bin/llama-perplexity for PPL=1); a lean
#   CPU-only build: cmake -S llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
#   -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
#   -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF && ninja -C build llama-bench llama-perplexity
#   SIEVE_BINARY defaults to $CARGO_TARGET_DIR/release/sieve (or target/release/sieve).
# environment:
#   MODEL (default $SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf), THREADS (2), REPS (5: interleaved rounds),
#   IDLE_PCT (90: wait until the CPUs are at least this idle before each measurement, since a
#   busy-waiting thread pool such as llama.cpp's loses most of its speed to any other process),
#   IDLE_WAIT_S (900: give up waiting and measure anyway, flagged), PPL=1 to add perplexity over
#   PPL_CHUNKS (16) windows of CTX (1024) tokens of DATA (data/wikitext-2/test.txt).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
llama_build="${1:?usage: $0 LLAMA_CPP_BUILD_DIR [SIEVE_BINARY]}"
sieve="${2:-${CARGO_TARGET_DIR:-$repo/target}/release/sieve}"
model="${MODEL:-${SIEVE_HOME:-$HOME/.cache/sieve}/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
threads="${THREADS:-2}"
reps="${REPS:-5}"
idle_pct="${IDLE_PCT:-90}"
idle_wait_s="${IDLE_WAIT_S:-900}"
data="${DATA:-$repo/data/wikitext-2/test.txt}"
ctx="${CTX:-1024}"
chunks="${PPL_CHUNKS:-16}"

for f in "$llama_build/bin/llama-bench" "$sieve" "$model"; do
    [[ -e "$f" ]] || { echo "missing: $f" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Percentage of CPU time idle over two seconds (all cores).
idle_now() {
    local a b
    read -r _ a1 a2 a3 a4 a5 a6 a7 a8 _ < /proc/stat
    sleep 2
    read -r _ b1 b2 b3 b4 b5 b6 b7 b8 _ < /proc/stat
    a=$((a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8))
    b=$((b1 + b2 + b3 + b4 + b5 + b6 + b7 + b8))
    echo $(( 100 * ((b4 + b5) - (a4 + a5)) / (b - a > 0 ? b - a : 1) ))
}

# Waits for an idle machine; prints the idle percentage and load average it started at.
wait_idle() {
    local waited=0 idle
    while :; do
        idle="$(idle_now)"
        if (( idle >= idle_pct )); then
            echo "idle ${idle}%, load $(cut -d' ' -f1-3 /proc/loadavg)"
            return
        fi
        if (( waited >= idle_wait_s )); then
            echo "NOT IDLE (${idle}% idle after ${waited} s), load $(cut -d' ' -f1-3 /proc/loadavg)"
            return
        fi
        sleep 10
        waited=$((waited + 12))
    done
}

# Prompts of 64 and 512 tokens (SmolLM2 tokenizer), the lengths llama-bench's -p 64,512 uses:
# fixed prose, and the first 379 words of WikiText-2 test paragraphs without <unk>, detokenized.
printf '%s' "The history of the city begins with a small fishing village on the river bank. Over the following centuries, merchants built warehouses along the harbour, and the town grew into a busy trading port. In the nineteenth century the railway arrived, and with it new factories, schools and churches. Today the city is best known for its" > "$work/p64.txt"
python3 - "$data" "$work/p512.txt" <<'EOF'
import sys
lines = open(sys.argv[1], encoding="utf-8").read().split("\n")
paras = [p.strip() for p in lines if len(p) > 400 and not p.strip().startswith("=") and "<unk>" not in p]
text = " ".join(paras[10:])
for a, b in [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" ,", ","), (" .", "."), (" 's", "'s"), (" ;", ";"), (" :", ":")]:
    text = text.replace(a, b)
open(sys.argv[2], "w", encoding="utf-8").write(" ".join(text.split()[:379]))
EOF

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "# SIMD: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|avx2|fma|f16c|avx512f|avx512bw|avx512_vnni|avx_vnni)$' | tr '\n' ' ')"
echo "# llama.cpp: $("$llama_build/bin/llama-bench" --version 2>&1 | head -1)"
echo "# sieve: $sieve (built $(date -u -r "$sieve" '+%Y-%m-%d %H:%M UTC'); repository at $(git -C "$repo" log -1 --format=%h))"
echo "# model: $model, threads $threads, $reps repetitions (medians)"

median() { python3 -c 'import sys,statistics; v=[float(x) for x in sys.argv[1:]]; print(f"{statistics.median(v):.1f}")' "$@"; }

# Interleaved: each repetition runs every llama.cpp test once and sieve once per prompt, one
# after the other, so that slow drifts of a shared machine (a VM's neighbours, clocks) hit both
# sides alike; the ratio of each pair is kept beside the medians.
# tg128@dN decodes 128 tokens after N tokens already in the KV cache, as sieve does after its prompt.
declare -A llama_runs sieve_pp_runs sieve_tg_runs pair_ratios
run_llama() {  # $1 = llama-bench arguments, prints tok/s of its one sample
    # shellcheck disable=SC2086
    "$llama_build/bin/llama-bench" -m "$model" -t "$threads" $1 -r 1 -o json 2>/dev/null \
        | python3 -c 'import json,sys; r=json.load(sys.stdin)[0]; print("%.1f" % r["samples_ts"][0])'
}
for rep in $(seq "$reps"); do
    for test in "-p 64 -n 0:pp64" "-p 512 -n 0:pp512" "-p 0 -n 128:tg128"; do
        args="${test%%:*}"; name="${test##*:}"
        state="$(wait_idle)"
        v="$(run_llama "$args")"
        llama_runs[$name]+=" $v"
        echo "rep $rep llama.cpp $name: $v tok/s [$state]"
    done
    for p in 64 512; do
        state="$(wait_idle)"
        v="$(run_llama "-p 0 -n 128 -d $p")"
        llama_runs[tg128@d$p]+=" $v"
        echo "rep $rep llama.cpp tg128@d$p: $v tok/s [$state]"
        state="$(wait_idle)"
        line="$("$sieve" generate --model "$model" --max-tokens 128 --threads "$threads" "$(cat "$work/p$p.txt")" 2>&1 >/dev/null | tail -1)"
        echo "rep $rep sieve p$p: $line [$state]"
        pp="$(sed -E 's/.*prefill: ([0-9.]+) tok\/s.*/\1/' <<< "$line")"
        tg="$(sed -E 's/.*decode: ([0-9.]+) tok\/s.*/\1/' <<< "$line")"
        sieve_pp_runs[$p]+=" $pp"
        sieve_tg_runs[$p]+=" $tg"
        pair_ratios[$p]+=" $(python3 -c "print(f'{$tg / $v:.3f}')")"
    done
done
declare -A llama sieve_pp sieve_tg
for name in "${!llama_runs[@]}"; do
    # shellcheck disable=SC2086
    llama[$name]="$(median ${llama_runs[$name]})"
done
for p in 64 512; do
    # shellcheck disable=SC2086
    sieve_pp[$p]="$(median ${sieve_pp_runs[$p]})"
    # shellcheck disable=SC2086
    sieve_tg[$p]="$(median ${sieve_tg_runs[$p]})"
done

ratio() { python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "$1" "$2"; }
echo
echo "| test | llama.cpp tok/s | sieve tok/s | sieve / llama.cpp (of medians) | per pair (median; runs) |"
echo "|---|---|---|---|---|"
echo "| prefill 64 | ${llama[pp64]} | ${sieve_pp[64]} | $(ratio "${sieve_pp[64]}" "${llama[pp64]}") | |"
echo "| prefill 512 | ${llama[pp512]} | ${sieve_pp[512]} | $(ratio "${sieve_pp[512]}" "${llama[pp512]}") | |"
for p in 64 512; do
    # shellcheck disable=SC2086
    echo "| decode 128 after $p tokens (llama.cpp tg128@d$p) | ${llama[tg128@d$p]} | ${sieve_tg[$p]} | $(ratio "${sieve_tg[$p]}" "${llama[tg128@d$p]}") | $(python3 -c 'import sys,statistics; print(f"{statistics.median(map(float, sys.argv[1:])):.2f}")' ${pair_ratios[$p]});${pair_ratios[$p]} |"
done
echo "| (llama.cpp tg128 from an empty cache) | ${llama[tg128]} | | | |"

if [[ "${PPL:-0}" == 1 ]]; then
    tokens=$((chunks * ctx))
    echo
    state="$(wait_idle)"
    start=$(date +%s)
    # Default llama.cpp scoring: each window of $ctx tokens scores only its second half.
    "$llama_build/bin/llama-perplexity" -m "$model" -f "$data" -c "$ctx" --chunks "$chunks" -t "$threads" 2>&1 \
        | grep -E 'Final estimate|tokenizes|calculating perplexity' || true
    echo "llama-perplexity (second half of each window): $(( $(date +%s) - start )) s [$state]"
    # Strided mode with stride ctx-1: windows of ctx tokens scored on every position after the
    # first, sieve's scoring (windows start one token earlier each time: i*(ctx-1), not i*ctx).
    # The tool widens the context by stride/2, so ask for ctx - (ctx-1)/2 to get windows of ctx.
    state="$(wait_idle)"
    start=$(date +%s)
    "$llama_build/bin/llama-perplexity" -m "$model" -f "$data" -c $((ctx - (ctx - 1) / 2)) -b "$ctx" \
        --ppl-stride $((ctx - 1)) --chunks "$chunks" -t "$threads" > "$work/strided.log" 2>&1 || true
    grep -E 'computing over|adjusting' "$work/strided.log" || true
    # This mode prints only running values "[chunk]ppl,"; the last one is the result.
    echo "running ppl after the last window: $(grep -oE '\[[0-9]+\][0-9.]+' "$work/strided.log" | tail -1)"
    echo "llama-perplexity --ppl-stride $((ctx - 1)) (all positions): $(( $(date +%s) - start )) s [$state]"
    state="$(wait_idle)"
    start=$(date +%s)
    "$sieve" eval ppl --model "$model" --data "$data" --ctx "$ctx" --max-tokens "$tokens" --threads "$threads" 2>/dev/null
    echo "sieve eval ppl (all positions): $(( $(date +%s) - start )) s [$state]"
fi
