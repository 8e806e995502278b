#!/usr/bin/env bash
# Tests `sieve serve` with clients nobody here wrote: the official `openai` Python package and
# the chat page in headless Chromium. Installs them when missing (pip; Debian's chromium and
# chromium-driver through apt-get), starts the server on a free loopback port, runs
# scripts/serve_clients_test.py against it and stops the server with SIGTERM.
#
#   bash scripts/test-serve-clients.sh [--screenshot PATH]
#
# SIEVE_BIN picks the binary (default: $CARGO_TARGET_DIR or target, /debug/sieve, built here if missing). The browser
# test is skipped, with the reason printed, only when Chromium cannot be installed at all.
set -euo pipefail
cd "$(dirname "$0")/.."

screenshot=""
if [[ "${1:-}" == "--screenshot" ]]; then
    screenshot="$2"
fi
bin="${SIEVE_BIN:-${CARGO_TARGET_DIR:-target}/debug/sieve}"
if [[ ! -x "$bin" ]]; then
    cargo build --quiet -p sieve
fi

log() { echo "test-serve-clients: $*"; }

if ! python3 -c "import openai" 2>/dev/null; then
    log "installing the openai Python package"
    python3 -m pip install --quiet --disable-pip-version-check openai
fi

skip_browser=""
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    log "installing chromium and chromium-driver (Debian)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            chromium chromium-driver fonts-dejavu-core >/dev/null; }; then
        skip_browser="apt-get could not install chromium/chromium-driver"
    fi
fi
if [[ -z "$skip_browser" ]] && ! python3 -c "import selenium" 2>/dev/null; then
    log "installing the selenium Python package"
    python3 -m pip install --quiet --disable-pip-version-check selenium \
        || skip_browser="pip could not install selenium"
fi

key="clients-test-key"
errlog="$(mktemp)"
SIEVE_API_KEY="$key" "$bin" serve --port 0 --max-batch 4 --drain-timeout 20 2>"$errlog" &
server=$!
stop_server() {
    if kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
    fi
}
trap stop_server EXIT

base=""
for _ in $(seq 1 600); do
    base="$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' "$errlog" | head -n 1)"
    [[ -n "$base" ]] && break
    if ! kill -0 "$server" 2>/dev/null; then
        cat "$errlog"
        log "sieve serve exited before listening"
        exit 1
    fi
    sleep 0.1
done
if [[ -z "$base" ]]; then
    cat "$errlog"
    log "sieve serve did not start within 60 s"
    exit 1
fi
log "server at $base"

args=("$base" "$key")
[[ -n "$screenshot" ]] && args+=(--screenshot "$screenshot")
[[ -n "$skip_browser" ]] && args+=(--skip-browser "$skip_browser")
status=0
timeout 600 python3 scripts/serve_clients_test.py "${args[@]}" || status=$?

kill -TERM "$server"
if ! timeout 30 tail --pid="$server" -f /dev/null; then
    log "sieve serve did not exit within 30 s of SIGTERM"
    status=1
fi
wait "$server" || { log "sieve serve exited with an error"; cat "$errlog"; status=1; }
trap - EXIT
exit "$status"
