#!/usr/bin/env python3
"""cuSPARSELt 2:4 called directly, its plan made once (issue 29's library baseline).

Through PyTorch (`bench.py` beside this file) every `torch._cslt_sparse_mm` call builds its
plan again: window H4 (2026-12-06, H200) measured a fixed ~400 us per call, which hides what the
library does at N <= 4096. This script loads libcusparseLt with ctypes, builds each product's
descriptors and plan once, picks the algorithm with `cusparseLtMatmulSearch`, compresses the
weights once per copy, and then times `cusparseLtMatmul` alone: what sieve would get by loading
the library at run time (issue 29, item 2). PyTorch only allocates memory, prunes and gives the
dense baselines: torch.mm (f16), torch._int_mm (INT8, int32 out), torch._scaled_mm (FP8 e4m3,
f16 out), each in the K-contiguous layout cuBLASLt wants.

The product, in cuSPARSELt's column-major terms ("TN", the only layout it takes for INT8 and
FP8): D (M x N, ld M) = op(A) . B with A the weights W stored K x M (W row-major, K contiguous,
pruned 2:4 along K: the two largest |w| of every four), opA = T, and B the activations X stored
K x N (X row-major [N][K]), opB = N. D is Y row-major [N][M]. Every product is checked against
the dense product of the same pruned matrix before it is timed (f16 / FP8 within 2e-2 of the
largest output, INT8 within the f16 output's rounding); times are CUDA-event medians over
rotating copies of the weights (more bytes than 4x the L2), after warm-up. An unsupported
combination is reported with the library's status, not skipped.

  python3 dev/cusparselt/direct.py [--shapes 7b] [--n 8,128,512,4096,8192] [--precision f16,int8,fp8] [--json OUT]
  SIEVE_CUSPARSELT=/path/libcusparseLt.so.0 ...   (else found under the Python packages)
"""
import ctypes
import glob
import json
import os
import site
import sys

import torch

from common import L2_BYTES, SHAPES, arguments, prune_2_4, rel_err, timed


# cudaDataType (library_types.h), cusparseOrder_t / cusparseOperation_t (cusparse.h),
# cusparseComputeType (cusparseLt.h of 0.6 onwards: 32I, 16F, 32F).
CUDA_R_32F, CUDA_R_16F, CUDA_R_8I, CUDA_R_32I, CUDA_R_8F_E4M3 = 0, 2, 3, 10, 28
ORDER_COL = 1
OP_N, OP_T = 0, 1
COMPUTE_32I, COMPUTE_16F, COMPUTE_32F = 0, 1, 2
SPARSITY_50 = 0
ALG_DEFAULT = 0
# The opaque structs are 512 bytes in 0.10 and were 1024 before: 1024 serves both.
OPAQUE = 1024


def find_library():
    explicit = os.environ.get("SIEVE_CUSPARSELT")
    if explicit:
        return explicit
    roots = list(site.getsitepackages()) + [site.getusersitepackages()]
    for root in roots:
        for pattern in ("nvidia/cusparselt/lib/libcusparseLt.so*", "nvidia/cu1*/lib/libcusparseLt.so*",
                        "torch/lib/libcusparseLt.so*"):
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                return hits[0]
    return "libcusparseLt.so.0"


class Lt:
    """The library and one handle; `call` raises with the function's name and status."""

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.cusparseLtGetErrorString.restype = ctypes.c_char_p
        self.handle = ctypes.create_string_buffer(OPAQUE)
        self.call("cusparseLtInit", self.handle)
        v = ctypes.c_int(0)
        self.call("cusparseLtGetVersion", self.handle, ctypes.byref(v))
        self.version = v.value

    def call(self, name, *args):
        status = getattr(self.lib, name)(*args)
        if status != 0:
            text = self.lib.cusparseLtGetErrorString(status).decode(errors="replace")
            raise RuntimeError(f"{name}: {text} ({status})")


class SparseProduct:
    """D = op(A) . B for one shape and type, described, planned and searched once."""

    def __init__(self, lt, m, k, n, in_type, out_type, compute):
        self.lt = lt
        i64, u32 = ctypes.c_int64, ctypes.c_uint32
        h = lt.handle
        self.a, self.b, self.c = (ctypes.create_string_buffer(OPAQUE) for _ in range(3))
        self.matmul = ctypes.create_string_buffer(OPAQUE)
        self.alg = ctypes.create_string_buffer(OPAQUE)
        self.plan = ctypes.create_string_buffer(OPAQUE)
        lt.call("cusparseLtStructuredDescriptorInit", h, self.a, i64(k), i64(m), i64(k), u32(16),
                ctypes.c_int(in_type), ctypes.c_int(ORDER_COL), ctypes.c_int(SPARSITY_50))
        lt.call("cusparseLtDenseDescriptorInit", h, self.b, i64(k), i64(n), i64(k), u32(16),
                ctypes.c_int(in_type), ctypes.c_int(ORDER_COL))
        lt.call("cusparseLtDenseDescriptorInit", h, self.c, i64(m), i64(n), i64(m), u32(16),
                ctypes.c_int(out_type), ctypes.c_int(ORDER_COL))
        lt.call("cusparseLtMatmulDescriptorInit", h, self.matmul, ctypes.c_int(OP_T), ctypes.c_int(OP_N),
                self.a, self.b, self.c, self.c, ctypes.c_int(compute))
        lt.call("cusparseLtMatmulAlgSelectionInit", h, self.alg, self.matmul, ctypes.c_int(ALG_DEFAULT))
        lt.call("cusparseLtMatmulPlanInit", h, self.plan, self.matmul, self.alg)
        size = ctypes.c_size_t(0)
        lt.call("cusparseLtMatmulGetWorkspace", h, self.plan, ctypes.byref(size))
        self.workspace = torch.empty(max(size.value, 1), dtype=torch.uint8, device="cuda")
        compressed, buffer = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lt.call("cusparseLtSpMMACompressedSize", h, self.plan, ctypes.byref(compressed), ctypes.byref(buffer))
        self.compressed_bytes, self.buffer_bytes = compressed.value, buffer.value
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def stream(self):
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def compress(self, w):
        out = torch.empty(self.compressed_bytes, dtype=torch.uint8, device="cuda")
        buf = torch.empty(max(self.buffer_bytes, 1), dtype=torch.uint8, device="cuda")
        self.lt.call("cusparseLtSpMMACompress", self.lt.handle, self.plan, ctypes.c_void_p(w.data_ptr()),
                     ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(buf.data_ptr()), self.stream())
        return out

    def _args(self, a, x, y):
        streams = (ctypes.c_void_p * 1)(torch.cuda.current_stream().cuda_stream)
        return (self.lt.handle, self.plan, ctypes.byref(self.alpha), ctypes.c_void_p(a.data_ptr()),
                ctypes.c_void_p(x.data_ptr()), ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()),
                ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(self.workspace.data_ptr()), streams,
                ctypes.c_int32(1))

    def search(self, a, x, y):
        """Lets the library time its algorithms on these operands and keep the fastest."""
        self.lt.call("cusparseLtMatmulSearch", *self._args(a, x, y))

    def run(self, a, x, y):
        self.lt.call("cusparseLtMatmul", *self._args(a, x, y))


def operands(prec, m, k, n):
    """Weights W [M][K] (pruned 2:4 along K), activations X [N][K], the dense baseline and
    the reference Y [N][M] in f64, and cuSPARSELt's (input, output, compute) types."""
    w16 = prune_2_4(torch.randn(m, k, device="cuda", dtype=torch.float16) * 0.02)
    x16 = torch.randn(n, k, device="cuda", dtype=torch.float16)
    if prec == "f16":
        w, x = w16, x16
        dense = lambda wi: torch.mm(x, wi.t())
        types = (CUDA_R_16F, CUDA_R_16F, COMPUTE_32F)
    elif prec == "int8":
        # Small enough that every sum fits the f16 output (window L1: codes near +-127 made
        # sums past 65504, an f16 infinity, so every int8 row read "disagrees: inf").
        w = (w16 * 300).round().clamp(-127, 127).to(torch.int8)
        x = (x16 * 8).round().clamp(-127, 127).to(torch.int8)
        dense = lambda wi: torch._int_mm(x, wi.t())
        types = (CUDA_R_8I, CUDA_R_16F, COMPUTE_32I)
    elif prec == "fp8":
        f8 = torch.float8_e4m3fn
        w, x = (w16 * 50).to(f8), x16.to(f8)
        one = torch.ones((), device="cuda", dtype=torch.float32)
        dense = lambda wi: torch._scaled_mm(x, wi.t(), scale_a=one, scale_b=one, out_dtype=torch.float16)
        types = (CUDA_R_8F_E4M3, CUDA_R_16F, COMPUTE_32F)
    else:
        raise ValueError(prec)
    want = x.double() @ w.double().t()
    return w, x, dense, want, types


def run_one(lt, prec, m, k, n, reps):
    row = {"precision": prec, "m": m, "k": k, "n": n}
    w, x, dense, want, (tin, tout, comp) = operands(prec, m, k, n)
    bytes_w = w.numel() * w.element_size()
    copies = max(1, -(-4 * L2_BYTES // bytes_w))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    row["copies"] = copies
    try:
        got = dense(ws[0])
        row["dense_rel_error"] = rel_err(got, want)
        row["dense_us"] = timed(lambda i: dense(ws[i]), copies, reps)
    except Exception as e:  # torch's own refusal (e.g. N below its minimum), reported
        row["dense_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    try:
        p = SparseProduct(lt, m, k, n, tin, tout, comp)
        cs = [p.compress(wi) for wi in ws]
        y = torch.empty(n, m, device="cuda", dtype=torch.float16)
        p.search(cs[0], x, y)
        p.run(cs[0], x, y)
        torch.cuda.synchronize()
        row["rel_error"] = rel_err(y, want)
        if row["rel_error"] > 2e-2:
            row["error"] = f"cuSPARSELt disagrees with the dense product: {row['rel_error']:.2e}"
        else:
            row["sparse_us"] = timed(lambda i: p.run(cs[i], x, y), copies, reps)
            if "dense_us" in row:
                row["speedup"] = row["dense_us"] / row["sparse_us"]
    except Exception as e:  # the library's status, reported as such
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def main():
    a = arguments()
    path = find_library()
    try:
        lt = Lt(path)
    except (OSError, RuntimeError) as e:
        print(f"cannot use cuSPARSELt at {path}: {e} (set SIEVE_CUSPARSELT to the library's path)",
              file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {path}, cuSPARSELt {lt.version}")
    print("| precision | M x K | N | dense us | cuSPARSELt 2:4 us (plan once) | speedup | note |")
    print("|---|---|---:|---:|---:|---:|---|")
    rows = []
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "-"
    for s in a.shapes.split(","):
        for m, k in SHAPES[s]:
            for prec in a.precision.split(","):
                for n in map(int, a.n.split(",")):
                    try:
                        r = run_one(lt, prec, m, k, n, a.reps)
                    except Exception as e:
                        r = {"precision": prec, "m": m, "k": k, "n": n,
                             "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                    rows.append(r)
                    note = "; ".join(v for v in (r.get("error"), r.get("dense_error")) if v)
                    print(f"| {prec} | {m} x {k} | {n} | {fmt(r.get('dense_us'))} | {fmt(r.get('sparse_us'))} | "
                          f"{('%.2fx' % r['speedup']) if 'speedup' in r else '-'} | {note} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
