#!/usr/bin/env bash
# llama.cpp and sieve on the same random-weight Llama-2-7B GGUFs, in one device call (the
# machine is given back after 30 s idle, taking the build and the files with it): llama.cpp
# builds at nice 5 while the files are written and sieve measures them, then llama-bench
# measures the same files. Runs ON the GPU machine with `.gpu` (scripts/gpu-runner-bundle.sh)
# and `vendor` (scripts/llama-cpp/fetch.sh) carried; ~8-9 minutes for three types.
#
# usage: OUT=$OUT bash scripts/llama-cpp/session.sh [TYPES]   (default "q4_0 q8_0 q4_k_m")
# env: EXTRA: a command run after sieve's GGUF runs while the build goes on (e.g. more benches)
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
types=${1:-"q4_0 q8_0 q4_k_m"}
out=${OUT:-/tmp/llama-session}
mkdir -p /tmp/g "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
(nice -n 5 bash scripts/llama-cpp/build.sh >"$out/build.log" 2>&1; echo "build rc $?" >>"$out/build.log") &
build=$!
for t in $types; do
    python3 scripts/llama-cpp/random_gguf.py --shape llama2-7b --type "$t" -o "/tmp/g/7b-$t.gguf" >>"$out/gen.log" 2>&1 \
        || { echo "writing the $t file failed:"; tail -3 "$out/gen.log"; exit 1; }
done
date -u
for t in $types; do
    .gpu/bin/sieve bench decode --model "/tmp/g/7b-$t.gguf" --prompt 128 --tokens 256 2>&1 | tee -a "$out/sieve.log"
done
date -u
[ -n "${EXTRA:-}" ] && bash -c "$EXTRA"
wait "$build"
tail -2 "$out/build.log"
date -u
files=()
for t in $types; do files+=("/tmp/g/7b-$t.gguf"); done
OUT="$out" bash scripts/llama-cpp/compare.sh "${files[@]}" | tee "$out/llama.txt"
date -u
