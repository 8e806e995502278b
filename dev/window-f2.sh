#!/usr/bin/env bash
# Device window F, second call (warm machine from dev/window-f1.sh; carry .gpu-mb): llama.cpp
# and sieve on the same 7B shape and files (dev/window-d2.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
cp .gpu-mb/* /tmp/m/
bash dev/window-d2.sh
