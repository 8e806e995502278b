#!/usr/bin/env bash
# Fetch llama.cpp's source (from the llama-cpp-python sdist on PyPI, which vendors it) into
# vendor/llama.cpp and trim it to what a CUDA build of llama-bench, llama-quantize and
# llama-server needs. Runs HERE (internet); the device machine has none, so the trimmed tree
# travels with the run (carry: ["vendor"], since /vendor/ is git-ignored).
#
# usage: scripts/llama-cpp/fetch.sh            (LLAMA_CPP_PYTHON_VERSION overrides the pin)
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # pinned; vendors llama.cpp as of that release
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$repo/vendor/llama.cpp"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "llama-cpp-python $version: downloading the sdist"
# --no-binary for this package only: its build dependencies (cmake, ninja, scikit-build-core)
# may come as wheels; ':all:' would compile cmake from source just to prepare metadata.
pip download --quiet --no-deps --no-binary llama-cpp-python -d "$tmp" "llama-cpp-python==$version"
sdist="$(ls "$tmp"/llama_cpp_python-*.tar.gz)"
tar -xzf "$sdist" -C "$tmp"
src="$tmp/llama_cpp_python-$version/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in $sdist" >&2; exit 1; }

rm -rf "$dest"
mkdir -p "$repo/vendor"
mv "$src" "$dest"
cd "$dest"

# Top level: docs, models, assets, tests, examples, CI, python conversion scripts.
# (LLAMA_BUILD_TESTS/EXAMPLES=OFF in build.sh, so tests/, examples/ and pocs/ are never added.)
rm -rf .git .github .devops .gemini .pi ci docs models media tests examples pocs benches \
       conversion skills requirements grammars flake.nix build-xcframework.sh \
       convert_*.py requirements.txt

# ggml: keep the CPU backend (always built) and CUDA; drop every other backend. ggml-hip and
# ggml-musa only *reuse* ggml-cuda's sources, ggml-cuda needs nothing from them.
for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
    rm -rf "ggml/src/ggml-$b"
done

# CPU backend: keep the x86 and arm kernels (the device may be either); drop other ISAs and
# the vendor add-ons that are off by default (KleidiAI, SpacemiT).
rm -rf ggml/src/ggml-cpu/arch/{loongarch,powerpc,riscv,s390,wasm} ggml/src/ggml-cpu/kleidiai ggml/src/ggml-cpu/spacemit

# scripts/: CMake only reads scripts/*.cmake (ui-assets.cmake); the rest is dev tooling.
find scripts -mindepth 1 ! -name '*.cmake' -exec rm -rf {} + 2>/dev/null || true

# tools: every tools/*/CMakeLists.txt is added when LLAMA_BUILD_TOOLS=ON, so the small tool
# dirs stay; trim their test media. The web UI: keep only what tools/ui/CMakeLists.txt and
# scripts/ui-assets.cmake read (with LLAMA_BUILD_UI=OFF and LLAMA_USE_PREBUILT_UI=OFF the
# server embeds an empty asset table).
rm -rf tools/mtmd/test-* tools/mtmd/tests tools/mtmd/legacy-models tools/server/tests \
       tools/server/webui tools/server/public* tools/tts/*.wav
( cd tools/ui && find . -mindepth 1 -maxdepth 1 \
    ! -name CMakeLists.txt ! -name sources.cmake ! -name 'ui.*.in' -exec rm -rf {} + )
rm -rf gguf-py/tests

# Anything large that is not source (binary assets, archives, media).
find . -type f \( -name '*.gguf' -o -name '*.png' -o -name '*.jpg' -o -name '*.jpeg' -o -name '*.gif' \
    -o -name '*.mp3' -o -name '*.mp4' -o -name '*.wav' -o -name '*.ico' -o -name '*.webp' -o -name '*.pdf' \) -delete

echo "$version" > LLAMA_CPP_PYTHON_VERSION
echo "llama.cpp from llama-cpp-python $version in $dest"
echo "trimmed size: $(du -sh . | cut -f1) ($(find . -type f | wc -l) files)"
