#!/usr/bin/env python3
"""cuSPARSELt 2:4 against dense of the same precision, through PyTorch (issue 29's baseline).

Issue 29 asks for SlideSparse's 2:4 and (2N-2):2N products measured against dense products of
the same precision (f16, INT8, FP8 e4m3) at N up to 8192, and against cuSPARSELt. sieve's own
kernels are measured by `sieve bench gemm`; this script measures what PyTorch on the GPU machine
reaches with NVIDIA's libraries, in the same call:

  dense   f16: torch.mm (cuBLAS) | int8: torch._int_mm (int32 out) | fp8: torch._scaled_mm (f16 out)
  2:4     torch._cslt_compress + torch._cslt_sparse_mm (cuSPARSELt), same input and output types

Y^T (M x N) = W (M x K) . X^T (K x N), W pruned 2:4 along K (the two largest |w| of every four).
Each product is checked against the dense product of the same pruned matrix before it is timed;
times are CUDA-event medians over rotating copies of the weights (more bytes than 4x the L2),
after warm-up. A path the installed PyTorch / cuSPARSELt refuses is reported with its error,
not skipped silently.

  python3 dev/cusparselt/bench.py [--shapes 7b] [--n 8,32,128,512,2048,4096,8192] [--json OUT]
"""
import json
import sys

import torch

from common import L2_BYTES, SHAPES, arguments, prune_2_4, rel_err, timed


def run_precision(prec, m, k, n, reps):
    dev = "cuda"
    w16 = prune_2_4(torch.randn(m, k, device=dev, dtype=torch.float16) * 0.02)
    x16 = torch.randn(n, k, device=dev, dtype=torch.float16)
    # X^T is handed over as a K x N column-major view (K contiguous): cuSPARSELt takes INT8 and
    # FP8 only in that layout (a K x N row-major copy gave "operation not supported" for INT8,
    # and sent torch._int_mm down a slow path: 2026-12-06, window H4).
    if prec == "f16":
        w, xt = w16, x16.t()
        dense = lambda a, b: torch.mm(a, b)
        sparse = lambda c, b: torch._cslt_sparse_mm(c, b)
        bytes_w = m * k * 2
    elif prec == "int8":
        w = (w16 * 2000).round().clamp(-127, 127).to(torch.int8)
        xt = (x16 * 40).round().clamp(-127, 127).to(torch.int8).t()
        dense = lambda a, b: torch._int_mm(a, b)
        sparse = lambda c, b: torch._cslt_sparse_mm(c, b, out_dtype=torch.int32)
        bytes_w = m * k
    elif prec == "fp8":
        f8 = torch.float8_e4m3fn
        w = (w16 * 50).to(f8)
        xt = x16.to(f8).t()
        one = torch.ones((), device=dev, dtype=torch.float32)
        dense = lambda a, b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float16)
        sparse = lambda c, b: torch._cslt_sparse_mm(c, b, out_dtype=torch.float16)
        bytes_w = m * k
    else:
        raise ValueError(prec)
    copies = max(1, -(-4 * L2_BYTES // bytes_w))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    row = {"precision": prec, "m": m, "k": k, "n": n, "copies": copies}
    want = dense(ws[0], xt)
    row["dense_us"] = timed(lambda i: dense(ws[i], xt), copies, reps)
    try:
        cs = [torch._cslt_compress(wi) for wi in ws]
        got = sparse(cs[0], xt)
        row["rel_error"] = rel_err(got, want)
        if row["rel_error"] > (0 if prec == "int8" else 2e-2):
            row["error"] = f"cuSPARSELt disagrees with the dense product: {row['rel_error']:.2e}"
        else:
            row["sparse_us"] = timed(lambda i: sparse(cs[i], xt), copies, reps)
            row["speedup"] = row["dense_us"] / row["sparse_us"]
    except Exception as e:  # the installed library's refusal, reported as such
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def main():
    a = arguments()
    try:
        cslt = torch.backends.cusparselt.version()
    except Exception as e:  # no cuSPARSELt in this PyTorch: every sparse row says so
        cslt = f"unavailable ({type(e).__name__})"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuSPARSELt {cslt}")
    print("| precision | M x K | N | dense us | cuSPARSELt 2:4 us | speedup | note |")
    print("|---|---|---:|---:|---:|---:|---|")
    rows = []
    for s in a.shapes.split(","):
        for m, k in SHAPES[s]:
            for prec in a.precision.split(","):
                for n in map(int, a.n.split(",")):
                    try:
                        r = run_precision(prec, m, k, n, a.reps)
                    except Exception as e:
                        r = {"precision": prec, "m": m, "k": k, "n": n,
                             "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                    rows.append(r)
                    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "-"
                    print(f"| {prec} | {m} x {k} | {n} | {fmt(r.get('dense_us'))} | "
                          f"{fmt(r.get('sparse_us'))} | "
                          f"{('%.2fx' % r['speedup']) if 'speedup' in r else '-'} | {r.get('error', '')} |",
                          flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
