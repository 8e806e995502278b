#!/usr/bin/env bash
# The test command (README, CI): formatting, lints, then every test in the workspace.
# Fetches the default model first because the model golden tests run on it. Last, `sieve serve`
# meets clients nobody here wrote (the openai Python package, headless Chromium), installed
# when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-model.sh >/dev/null
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace --quiet
bash scripts/test-serve-clients.sh
