#!/usr/bin/env bash
# Device window G5 (2026-12-06, right after G4 on the same warm machine): the server under 32 clients
# with 128-token prompts, dense f16 against the 4-bit dual-sparse pack, now with the batch layout
# (dev/window-f4.sh; window F4 before it: 3,586 against 2,024 tok/s). Carry .gpu-mb
# (.gpu stays from G4 on the warm machine).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p /tmp/m && cp .gpu-mb/* /tmp/m/   # the default model, second part (window G6)
nvidia-smi --query-gpu=name --format=csv,noheader
bash dev/window-f4.sh 2>&1 | grep -v "cannot stat"
