#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-quantize and llama-server with CUDA (sm_90, H200) from
# the trimmed tree that scripts/llama-cpp/fetch.sh left in vendor/llama.cpp. Runs ON the GPU
# machine (no internet needed). Binaries: vendor/llama.cpp/build/bin/.
#
# usage: scripts/llama-cpp/build.sh
# env: CUDA=OFF for a CPU-only check build (what can be tried without nvcc), JOBS (16),
#      TARGETS ("llama-bench llama-quantize llama-server"), CUDA_ARCH (90)
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
src="$repo/vendor/llama.cpp"
build="$src/build"
cuda="${CUDA:-ON}"
jobs="${JOBS:-16}"
targets="${TARGETS:-llama-bench llama-quantize llama-server}"
arch="${CUDA_ARCH:-90}"

die() { echo "build.sh: $*" >&2; exit 1; }
[ -f "$src/CMakeLists.txt" ] || die "no $src: run scripts/llama-cpp/fetch.sh here first and carry vendor/ (carry: [\"vendor\"])"
command -v cmake >/dev/null || die "cmake not found (pip install cmake, or apt-get install cmake)"
cmake_ver="$(cmake --version | head -1 | awk '{print $3}')"
printf '%s\n3.18\n' "$cmake_ver" | sort -V -C 2>/dev/null && [ "$cmake_ver" != 3.18 ] && die "cmake $cmake_ver is older than 3.18"
if [ "$cuda" = ON ]; then
    if ! command -v nvcc >/dev/null; then
        for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
    fi
    command -v nvcc >/dev/null || die "nvcc not found (CUDA toolkit missing or not on PATH)"
    export CUDACXX="$(command -v nvcc)"
    nvcc --version | tail -2
fi
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

echo "llama.cpp (llama-cpp-python $(cat "$src/LLAMA_CPP_PYTHON_VERSION" 2>/dev/null || echo '?')), cmake $cmake_ver, CUDA=$cuda, -j $jobs"
start=$(date +%s)
# Cuts to CUDA compile time: one architecture (sm_90 only, not the default fat list), FlashAttention
# kernels only for the default F16/Q8_0/Q4_0 KV combos (GGML_CUDA_FA_ALL_QUANTS=OFF), no NCCL, no
# tests/examples/UI. Offline: no curl, no OpenSSL, no prebuilt-UI download.
cmake -S "$src" -B "$build" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA="$cuda" -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DGGML_CUDA_FA=ON -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_NCCL=OFF \
    -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DBUILD_SHARED_LIBS=OFF >"$build.configure.log" 2>&1 \
    || { tail -40 "$build.configure.log"; die "configure failed (log: $build.configure.log)"; }
grep -E "CUDA Toolkit|CMAKE_CUDA_ARCHITECTURES|CUDA found" "$build.configure.log" || true
echo "configured in $(( $(date +%s) - start )) s"
# shellcheck disable=SC2086
cmake --build "$build" --config Release -j "$jobs" --target $targets
for t in $targets; do [ -x "$build/bin/$t" ] || die "missing $build/bin/$t"; done
echo "built $targets in $(( $(date +%s) - start )) s: $build/bin"
