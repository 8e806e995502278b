#!/usr/bin/env python3
"""Compiles one sieve-cuda kernel family to an sm_90a CUBIN with NVRTC (no GPU needed) and prints
its SASS, so instruction counts and load widths can be read without device time.

  LIBNVRTC=/path/libnvrtc.so.13 CUOBJDUMP=/path/cuobjdump \
      scripts/kernel-sass.py crates/sieve-cuda/kernels/tiled_cbc_spmspv.cu [kernel-name-filter]

libnvrtc comes with the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel; cuobjdump with the
toolkit or Triton's wheel (triton/backends/nvidia/bin). Options match crates/sieve-cuda/src/gpu.rs.
"""
import ctypes, os, subprocess, sys, tempfile

def main():
    src_path = sys.argv[1]
    want = sys.argv[2] if len(sys.argv) > 2 else None
    root = os.path.dirname(os.path.abspath(src_path))
    common = open(os.path.join(root, "common.cuh")).read()
    src = common + "\n" + open(src_path).read()
    nvrtc = ctypes.CDLL(os.environ.get("LIBNVRTC", "libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram {rc}"
    opts = [b"--gpu-architecture=sm_90a", b"--std=c++17", b"--use_fast_math", b"-Xptxas=-v"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    sys.stderr.write(log.value.decode())
    if rc != 0:
        sys.exit(f"compile failed ({rc})")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin.raw)
    args = [os.environ.get("CUOBJDUMP", "cuobjdump"), "-sass"]
    if want:
        args += ["-fun", want]
    print(subprocess.run(args + [f.name], capture_output=True, text=True).stdout)

main()
