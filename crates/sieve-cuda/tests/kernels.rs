//! GPU kernels against the f64 CPU reference, on fresh random inputs, with NaN-poisoned
//! outputs. Without a GPU each test prints a skip reason and passes, unless
//! `SIEVE_REQUIRE_GPU=1` (then it fails).

use half::f16;
use sieve_cuda::balanced_cbc::{BcbcKernel, GpuBalancedCbc};
use sieve_cuda::dense::{compact_active, GpuDense, GpuDenseColMajor};
use sieve_cuda::rlc_csc::GpuRlcCsc;
use sieve_cuda::tiled_cbc::{GpuTiledCbc, Lane8Shape, TcbcKernel};
use sieve_cuda::{gpu_or_skip, matvec_host, Gpu, GpuAccumulate, GpuMatVec};
use sieve_formats::balanced_cbc::BalancedCbc;
use sieve_formats::random::{
    activations, balanced_matrix, sparse_matrix, threshold_for_sparsity, Pattern,
};
use sieve_formats::reference::{matvec_f64, max_rel_error};
use sieve_formats::rlc_csc::{RlcCsc, RlcCscOptions};
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::{DenseMatrix, Threshold};
use std::sync::atomic::{AtomicU64, Ordering};

const TOL: f64 = 1e-3;

/// Odd shapes (not multiples of any tile, K < 64, M = 1) and a LLaMA shape.
const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (1, 300),
    (7, 5),
    (33, 63),
    (257, 129),
    (300, 1000),
    (1000, 72),
    (513, 4104),
    (4096, 4096),
];
const SPARSITIES: &[f64] = &[0.0, 0.3, 0.5, 0.7, 0.95];
const ACT_SPARSITIES: &[f64] = &[0.0, 0.5, 0.9, 0.99];

/// A fresh seed per call, so that reruns and tests never reuse inputs.
fn seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ COUNTER
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Every (shape, weight sparsity, activation sparsity) case; big shapes only at a few points
/// to keep the suite short.
fn cases() -> Vec<(DenseMatrix, Vec<f32>, Threshold, String)> {
    // Under compute-sanitizer kernels run 10-100x slower: small shapes only.
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    let mut out = Vec::new();
    for &(m, k) in SHAPES {
        let big = m * k > 1_000_000;
        if big && small_only {
            continue;
        }
        for &sp in SPARSITIES {
            if big && sp != 0.5 {
                continue;
            }
            let s = seed();
            let w = sparse_matrix(m, k, sp, Pattern::Unstructured, s).expect("valid shape");
            for &dp in ACT_SPARSITIES {
                let x = activations(k, s ^ 0x55);
                let t = threshold_for_sparsity(&x, dp).expect("valid dp");
                out.push((w.clone(), x, t, format!("{m}x{k} sp={sp} dp={dp} seed={s}")));
            }
        }
    }
    // Everything inactive: the output must be exactly zero, not garbage.
    let w = sparse_matrix(70, 90, 0.3, Pattern::Unstructured, seed()).expect("valid");
    let x = activations(90, seed());
    out.push((w, x, Some(f32::MAX), "70x90 all inactive".into()));
    out
}

fn check<F: GpuMatVec + ?Sized>(
    gpu: &Gpu,
    w: &F,
    m: &DenseMatrix,
    x: &[f32],
    t: Threshold,
    what: &str,
) {
    let got = matvec_host(gpu, w, x, t).unwrap_or_else(|e| panic!("{what} {}: {e}", w.label()));
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what} {}: unwritten (NaN) output",
        w.label()
    );
    let want = matvec_f64(m, x, t);
    let err = max_abs_error(&got, &want) / error_scale(m, x, t, &want);
    assert!(err < TOL, "{what} {}: rel error {err}", w.label());
}

/// What an error is relative to: the largest |y_r|, but at least 1% of the largest sum of
/// |w_rc x_c| over a row. A product of few rows whose terms cancel (a 1-row matrix at dp 0.9
/// can sum 9 terms to nearly zero) has f32 rounding of its terms' size, not of its result's.
fn error_scale(m: &DenseMatrix, x: &[f32], t: Threshold, want: &[f64]) -> f64 {
    let abs_w = DenseMatrix::new(
        m.rows(),
        m.cols(),
        m.data()
            .iter()
            .map(|v| f16::from_f32(v.to_f32().abs()))
            .collect(),
    )
    .expect("same shape");
    // Inputs a threshold drops stay dropped: |x| keeps |x| <= t inactive.
    let abs_x: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let terms = matvec_f64(&abs_w, &abs_x, t)
        .into_iter()
        .fold(0.0f64, f64::max);
    let result = want.iter().fold(0.0f64, |a, v| a.max(v.abs()));
    result.max(0.01 * terms).max(1e-6)
}

fn max_abs_error(got: &[f32], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0f64, f64::max)
}

#[test]
fn dense_gemv_matches_reference() {
    let Some(gpu) = gpu_or_skip("dense_gemv_matches_reference") else {
        return;
    };
    for (m, x, t, what) in cases() {
        let d = GpuDense::upload(&gpu, &m).expect("upload");
        check(&gpu, &d, &m, &x, t, &what);
    }
}

#[test]
fn dense_colmajor_matches_reference() {
    let Some(gpu) = gpu_or_skip("dense_colmajor_matches_reference") else {
        return;
    };
    for (m, x, t, what) in cases() {
        let mut d = GpuDenseColMajor::upload(&gpu, &m).expect("upload");
        for cpw in [0, 32, 64, 256] {
            d.cols_per_warp = cpw;
            check(&gpu, &d, &m, &x, t, &what);
        }
    }
}

#[test]
fn compacted_list_matches_reference() {
    let Some(gpu) = gpu_or_skip("compacted_list_matches_reference") else {
        return;
    };
    for (m, x, t, what) in cases() {
        let d = GpuDenseColMajor::upload(&gpu, &m).expect("upload");
        let xd = gpu.upload(&x).expect("x");
        let mut cols = gpu.upload(&vec![0i32; x.len()]).expect("cols");
        let mut n = gpu.upload(&[0i32]).expect("n");
        compact_active(&gpu, &xd, t, &mut cols, &mut n).expect("compact");
        let mut y = gpu.poisoned_f32(m.rows()).expect("y");
        d.launch_list(&gpu, &xd, &cols, &n, &mut y).expect("launch");
        let got = gpu.download(&y).expect("download");
        let want = matvec_f64(&m, &x, t);
        let err = max_rel_error(&got, &want);
        assert!(err < TOL, "{what} list: rel error {err}");
        let count = gpu.download(&n).expect("n")[0] as usize;
        let expect = x
            .iter()
            .filter(|v| sieve_formats::format::is_active(**v, t))
            .count();
        assert_eq!(count, expect, "{what}: active count");
    }
}

#[test]
fn cublas_matches_reference() {
    let Some(gpu) = gpu_or_skip("cublas_matches_reference") else {
        return;
    };
    for &(m, k) in &[(1usize, 8usize), (33, 63), (4096, 4096)] {
        for n in [1usize, 3, 16] {
            let w = sparse_matrix(m, k, 0.5, Pattern::Unstructured, seed()).expect("w");
            let x: Vec<f32> = (0..n)
                .flat_map(|i| activations(k, seed() + i as u64))
                .collect();
            // cuBLAS takes f16 activations: compare against the reference on rounded inputs.
            let xr: Vec<f32> = x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
            let d = GpuDense::upload(&gpu, &w).expect("upload");
            let blas = sieve_cuda::dense::Cublas::new(&gpu, &d).expect("cublas");
            let xd = gpu.upload(&x).expect("x");
            let mut x16 = gpu.upload(&vec![half::f16::ZERO; n * k]).expect("x16");
            sieve_cuda::dense::to_f16(&gpu, &xd, &mut x16).expect("to_f16");
            let mut y = gpu.poisoned_f32(n * m).expect("y");
            blas.gemm(&gpu, &d, &x16, n, &mut y).expect("gemm");
            let got = gpu.download(&y).expect("y");
            let want = sieve_formats::reference::matmul_f64(&w, &xr, n, None);
            let err = max_rel_error(&got, &want);
            assert!(err < TOL, "cublas {m}x{k} n={n}: rel error {err}");
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(gpu) = gpu_or_skip("bad_inputs_are_typed_errors") else {
        return;
    };
    let w = sparse_matrix(16, 16, 0.5, Pattern::Unstructured, 1).expect("w");
    let d = GpuDense::upload(&gpu, &w).expect("upload");
    assert!(matvec_host(&gpu, &d, &[1.0; 15], None).is_err());
    assert!(matvec_host(&gpu, &d, &[1.0; 16], Some(f32::NAN)).is_err());
    assert!(matvec_host(&gpu, &d, &[f32::NAN; 16], None).is_err());
}

#[test]
fn rlc_csc_matches_reference() {
    let Some(gpu) = gpu_or_skip("rlc_csc_matches_reference") else {
        return;
    };
    for (m, x, t, what) in cases() {
        // Default 4-bit runs (the fast path) at two block heights, plus 2- and 7-bit runs (the
        // generic decode path, runs straddling words).
        for (bits, block_rows) in [(4u32, 256usize), (4, 4096), (2, 512), (7, 1024)] {
            let opts = RlcCscOptions {
                index_bits: bits,
                block_rows,
            };
            let f = RlcCsc::encode(&m, &opts).expect("encode");
            let mut g = GpuRlcCsc::upload(&gpu, &f).expect("upload");
            for (cols, warps) in [(64usize, g.warps), (32, 4), (200, 16)] {
                g.cols_per_warp = cols;
                g.warps = warps;
                check(
                    &gpu,
                    &g,
                    &m,
                    &x,
                    t,
                    &format!("{what} bits={bits} B={block_rows}"),
                );
            }
        }
    }
}

#[test]
fn rlc_csc_list_matches_reference() {
    let Some(gpu) = gpu_or_skip("rlc_csc_list_matches_reference") else {
        return;
    };
    for (m, x, t, what) in cases() {
        let f = RlcCsc::encode(&m, &RlcCscOptions::default()).expect("encode");
        let g = GpuRlcCsc::upload(&gpu, &f).expect("upload");
        let xd = gpu.upload(&x).expect("x");
        let mut cols = gpu.upload(&vec![0i32; x.len()]).expect("cols");
        let mut n = gpu.upload(&[0i32]).expect("n");
        compact_active(&gpu, &xd, t, &mut cols, &mut n).expect("compact");
        let mut y = gpu.poisoned_f32(m.rows()).expect("y");
        g.launch_list(&gpu, &xd, &cols, &n, &mut y).expect("launch");
        let got = gpu.download(&y).expect("download");
        let err = max_rel_error(&got, &matvec_f64(&m, &x, t));
        assert!(err < TOL, "{what} rlc list: rel error {err}");
    }
}

#[test]
fn tiled_cbc_matches_reference() {
    let Some(gpu) = gpu_or_skip("tiled_cbc_matches_reference") else {
        return;
    };
    for (m, x, t, what) in cases() {
        let f = TiledCbc::encode(&m).expect("encode");
        let mut g = GpuTiledCbc::upload(&gpu, &f).expect("upload");
        g.kernel = TcbcKernel::Spdp;
        for gpb in [0usize, 1, 3, 64] {
            g.gtiles_per_block = gpb;
            check(&gpu, &g, &m, &x, t, &format!("{what} spdp g{gpb}"));
        }
        for kernel in [TcbcKernel::Lane8, TcbcKernel::RoundRobin] {
            g.kernel = kernel;
            for shape in Lane8Shape::ALL {
                g.lane8_shape = shape;
                for gpb in [0usize, 1, 3, 32] {
                    g.gtiles_per_block = gpb;
                    check(
                        &gpu,
                        &g,
                        &m,
                        &x,
                        t,
                        &format!("{what} {kernel:?} {shape:?} g{gpb}"),
                    );
                }
            }
        }
    }
}

/// The batched prefill's f16 copy of an RLC-CSC matrix (`decode_transposed`): column k's rows
/// contiguous, equal to the matrix; odd shapes, short last row blocks, run widths 2..5 (gap
/// padding at high sparsity), multi-slab segments. The output starts as NaN: the launcher's
/// zeroing and the kernel's writes must cover it.
#[test]
fn rlc_csc_decode_transposed_is_the_matrix() {
    let Some(gpu) = gpu_or_skip("rlc_csc_decode_transposed_is_the_matrix") else {
        return;
    };
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for &(rows, cols) in &[(1usize, 1usize), (33, 63), (700, 90), (4100, 300)] {
        if small_only && rows * cols > 100_000 {
            continue;
        }
        for (sp, bits, block_rows) in [(0.0, 4, 256), (0.5, 2, 512), (0.9, 3, 4096), (0.99, 5, 256)]
        {
            let m = sparse_matrix(rows, cols, sp, Pattern::Unstructured, seed()).expect("matrix");
            let opts = RlcCscOptions {
                index_bits: bits,
                block_rows,
            };
            let f = RlcCsc::encode(&m, &opts).expect("encode");
            let g = GpuRlcCsc::upload(&gpu, &f).expect("upload");
            let got = gpu
                .f16_written_by(rows * cols, |out| g.decode_transposed(&gpu, out))
                .expect("decode");
            for c in 0..cols {
                for r in 0..rows {
                    assert_eq!(
                        got[c * rows + r].to_bits(),
                        m.get(r, c).to_bits(),
                        "{rows}x{cols} sp {sp} n {bits} B {block_rows}: ({r}, {c})"
                    );
                }
            }
        }
    }
}

/// The batched prefill's f16 copy of a Balanced-CBC matrix (`decode_transposed`): column k's
/// padded rows contiguous, equal to the matrix (zeros below M), in both device layouts, every
/// slot count, partial tiles, and an unstructured matrix (padding slots); the output starts as
/// NaN, so nothing may be left unwritten.
#[test]
fn balanced_cbc_decode_transposed_is_the_matrix() {
    let Some(gpu) = gpu_or_skip("balanced_cbc_decode_transposed_is_the_matrix") else {
        return;
    };
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for &(rows, cols) in &[
        (1usize, 1usize),
        (33, 63),
        (576, 200),
        (1100, 37),
        (4096, 512),
    ] {
        if small_only && rows * cols > 100_000 {
            continue;
        }
        let mut cases: Vec<(DenseMatrix, BalancedCbc)> = [1usize, 5, 8, 9, 16]
            .iter()
            .map(|&slots| {
                let m = balanced_matrix(rows, cols, slots, seed()).expect("matrix");
                let f = BalancedCbc::encode_with_slots(&m, slots).expect("encode");
                (m, f)
            })
            .collect();
        let m = sparse_matrix(rows, cols, 0.6, Pattern::Unstructured, seed()).expect("matrix");
        let f = BalancedCbc::encode(&m).expect("encode");
        cases.push((m, f));
        for (m, f) in &cases {
            for kernel in [BcbcKernel::Chain, BcbcKernel::Idx] {
                let g = GpuBalancedCbc::upload_for(&gpu, f, kernel).expect("upload");
                let mp = g.padded_rows();
                assert!(
                    mp >= rows && mp.is_multiple_of(16),
                    "{rows}: padded rows {mp}"
                );
                let got = gpu
                    .f16_written_by(cols * mp, |out| g.decode_transposed(&gpu, out))
                    .expect("decode");
                for c in 0..cols {
                    for r in 0..mp {
                        let want = if r < rows { m.get(r, c) } else { f16::ZERO };
                        assert_eq!(
                            got[c * mp + r].to_f32(),
                            want.to_f32(),
                            "{rows}x{cols} n={} {kernel:?}: ({r}, {c})",
                            f.slots()
                        );
                    }
                }
            }
        }
    }
}

/// Balanced-CBC over every slot count, odd shapes (M not a multiple of the 512-row tile or of
/// the 16-row group, K below one warp slice), column slices from 1 to 64, in both the zeroing
/// and the accumulating launch; and unstructured matrices (padded slots) through the same kernel.
#[test]
fn balanced_cbc_matches_reference() {
    let Some(gpu) = gpu_or_skip("balanced_cbc_matches_reference") else {
        return;
    };
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    let mut shapes: Vec<(usize, usize)> = vec![
        (1, 1),
        (7, 5),
        (33, 63),
        (513, 129),
        (576, 200),
        (1000, 300),
    ];
    if !small_only {
        shapes.push((4096, 4096));
    }
    for &(rows, cols) in &shapes {
        for slots in 1..=16usize {
            if rows * cols > 1_000_000 && ![1, 5, 8, 16].contains(&slots) {
                continue;
            }
            let s = seed();
            let m = balanced_matrix(rows, cols, slots, s).expect("matrix");
            let f = BalancedCbc::encode_with_slots(&m, slots).expect("encode");
            for kernel in [BcbcKernel::Chain, BcbcKernel::Idx] {
                let mut g = GpuBalancedCbc::upload_for(&gpu, &f, kernel).expect("upload");
                for &dp in ACT_SPARSITIES {
                    let x = activations(cols, s ^ 0x77);
                    let t = threshold_for_sparsity(&x, dp).expect("dp");
                    for cpw in [0usize, 1, 13, 32, 64] {
                        g.cols_per_warp = cpw;
                        let what =
                            format!("{rows}x{cols} n={slots} dp={dp} c{cpw} {kernel:?} seed={s}");
                        check(&gpu, &g, &m, &x, t, &what);
                    }
                }
                // Accumulating launch: y starts at 1.0, must end at 1 + W x.
                let x = activations(cols, s ^ 0x99);
                let want: Vec<f64> = matvec_f64(&m, &x, None).iter().map(|v| v + 1.0).collect();
                let xd = gpu.upload(&x).expect("x");
                let yd = gpu.upload(&vec![1.0f32; rows]).expect("y");
                g.cols_per_warp = 0;
                g.launch_add(
                    &gpu,
                    sieve_cuda::dev_ptr(&gpu, &xd),
                    None,
                    sieve_cuda::dev_ptr(&gpu, &yd),
                )
                .expect("launch_add");
                gpu.synchronize().expect("sync");
                let got = gpu.download(&yd).expect("download");
                let err = max_rel_error(&got, &want);
                assert!(
                    err < TOL,
                    "{rows}x{cols} n={slots} {kernel:?} accumulate: rel error {err}"
                );
            }
        }
        // An unstructured matrix is stored with N = its fullest group (padding slots).
        let s = seed();
        let m = sparse_matrix(rows, cols, 0.7, Pattern::Unstructured, s).expect("matrix");
        let f = BalancedCbc::encode(&m).expect("encode");
        let g = GpuBalancedCbc::upload(&gpu, &f).expect("upload");
        let x = activations(cols, s ^ 3);
        let t = threshold_for_sparsity(&x, 0.5).expect("dp");
        check(
            &gpu,
            &g,
            &m,
            &x,
            t,
            &format!("{rows}x{cols} unstructured seed={s}"),
        );
    }
}

/// Kernels that zero their output themselves (fused zeroing with per-tile epoch flags) must
/// give the same result when launched again into the same, already written output.
#[test]
fn fused_zeroing_survives_relaunch_into_the_same_output() {
    let Some(gpu) = gpu_or_skip("fused_zeroing_survives_relaunch_into_the_same_output") else {
        return;
    };
    for &(rows, cols, sp, dp) in &[
        (4096usize, 4096usize, 0.5, 0.5),
        (1000, 300, 0.3, 0.0),
        (257, 129, 0.7, 0.9),
    ] {
        let s = seed();
        let m = sparse_matrix(rows, cols, sp, Pattern::Unstructured, s).expect("matrix");
        let x = activations(cols, s ^ 1);
        let t = threshold_for_sparsity(&x, dp).expect("threshold");
        let want = matvec_f64(&m, &x, t);
        let xd = gpu.upload(&x).expect("x");
        let f = TiledCbc::encode(&m).expect("encode");
        let tcbc = GpuTiledCbc::upload(&gpu, &f).expect("upload");
        let mut tcbc_rr = GpuTiledCbc::upload(&gpu, &f).expect("upload");
        tcbc_rr.kernel = TcbcKernel::RoundRobin;
        let mut cm = GpuDenseColMajor::upload(&gpu, &m).expect("upload");
        cm.cols_per_warp = 32;
        let bal = GpuBalancedCbc::upload(&gpu, &BalancedCbc::encode(&m).expect("encode"))
            .expect("upload");
        let bal_idx = GpuBalancedCbc::upload_for(
            &gpu,
            &BalancedCbc::encode(&m).expect("encode"),
            BcbcKernel::Idx,
        )
        .expect("upload");
        let kernels: [&dyn GpuMatVec; 5] = [&tcbc, &tcbc_rr, &cm, &bal, &bal_idx];
        for k in kernels {
            let mut y = gpu.poisoned_f32(rows).expect("y");
            for launch in 0..3 {
                k.launch(&gpu, &xd, t, &mut y).expect("launch");
                gpu.synchronize().expect("sync");
                let got = gpu.download(&y).expect("download");
                let err = max_rel_error(&got, &want);
                assert!(
                    err < TOL,
                    "{} {rows}x{cols} sp {sp} dp {dp}, launch {launch}: rel error {err:.3e}",
                    k.label()
                );
            }
        }
    }
}

/// Single-column RLC-CSC matrices around the block-row and warp boundaries: every row must
/// match (the failing rows are listed in the message).
#[test]
fn rlc_csc_single_column_edges() {
    let Some(gpu) = gpu_or_skip("rlc_csc_single_column_edges") else {
        return;
    };
    for (m, br) in [
        (32usize, 256usize),
        (64, 256),
        (255, 256),
        (256, 256),
        (257, 4096),
        (512, 4096),
        (300, 256),
    ] {
        let w = sparse_matrix(m, 1, 0.0, Pattern::Unstructured, 3).expect("w");
        let x = vec![1.0f32];
        let f = RlcCsc::encode(
            &w,
            &RlcCscOptions {
                index_bits: 4,
                block_rows: br,
            },
        )
        .expect("enc");
        let g = GpuRlcCsc::upload(&gpu, &f).expect("upload");
        let got = matvec_host(&gpu, &g, &x, None).expect("run");
        let want = matvec_f64(&w, &x, None);
        let bad: Vec<String> = got
            .iter()
            .zip(&want)
            .enumerate()
            .filter(|(_, (g, w))| (**g as f64 - **w).abs() > 1e-3 * w.abs().max(1e-3))
            .take(12)
            .map(|(i, (g, w))| format!("row {i}: got {g} want {w}"))
            .collect();
        assert!(
            bad.is_empty(),
            "rlc-csc {m}x1, block rows {br}, warps {}: {bad:?}",
            g.warps
        );
    }
}

/// Dense (sp = 0) LLaMA-sized matrices with every column active: the fullest column tiles
/// (256 nonzeros, 32 chunks) and the longest active lists, for every sparse kernel.
#[test]
fn sparse_kernels_on_unpruned_llama_shape() {
    let Some(gpu) = gpu_or_skip("sparse_kernels_on_unpruned_llama_shape") else {
        return;
    };
    let s = seed();
    let m = sparse_matrix(4096, 4096, 0.0, Pattern::Unstructured, s).expect("matrix");
    let x = activations(4096, s ^ 3);
    for dp in [0.0, 0.5] {
        let t = threshold_for_sparsity(&x, dp).expect("threshold");
        let what = format!("4096x4096 sp 0 dp {dp}");
        let f = TiledCbc::encode(&m).expect("encode");
        let mut g = GpuTiledCbc::upload(&gpu, &f).expect("upload");
        for kernel in [TcbcKernel::Lane8, TcbcKernel::RoundRobin] {
            g.kernel = kernel;
            for shape in Lane8Shape::ALL {
                g.lane8_shape = shape;
                check(&gpu, &g, &m, &x, t, &format!("{what} {kernel:?} {shape:?}"));
            }
        }
        g.kernel = TcbcKernel::Spdp;
        check(&gpu, &g, &m, &x, t, &format!("{what} spdp"));
        let opts = RlcCscOptions {
            index_bits: 4,
            block_rows: 1024,
        };
        let r = RlcCsc::encode(&m, &opts).expect("encode");
        let gr = GpuRlcCsc::upload(&gpu, &r).expect("upload");
        check(&gpu, &gr, &m, &x, t, &format!("{what} rlc-csc"));
    }
}

/// The tensor-core SpMM over Tiled-CBC (`tcbc_spmm`) for 1..130 tokens against the f64 product
/// of W with the f16 activations it multiplies: odd M, K a multiple of 8 (its requirement),
/// padded activation and output strides, written (NaN-poisoned) and accumulated outputs, every
/// token-tile kernel and multi-tile grids.
#[test]
fn tiled_cbc_spmm_matches_reference() {
    let Some(gpu) = gpu_or_skip("tiled_cbc_spmm_matches_reference") else {
        return;
    };
    use sieve_cuda::product::dev_ptr;
    let shapes: &[(usize, usize, &[usize])] = &[
        (1, 8, &[1, 3]),
        (7, 16, &[1, 8, 9]),
        (33, 64, &[2, 17, 64, 65]),
        (257, 136, &[5, 33, 130]),
        (300, 1000, &[1, 16, 40]),
        (1000, 72, &[8, 64]),
        (513, 4104, &[3, 24, 65]),
        (4096, 4096, &[1, 17]),
    ];
    for &(m, k, ns) in shapes {
        for sp in [0.0, 0.5, 0.95] {
            let s = seed();
            let w = sparse_matrix(m, k, sp, Pattern::Unstructured, s).expect("valid shape");
            let f = TiledCbc::encode(&w).expect("encode");
            let g = GpuTiledCbc::upload(&gpu, &f).expect("upload");
            for &n in ns {
                // Activation rows 8 elements longer than K, output rows 3 floats longer than M.
                let (lda, ldy) = (k + 8, m + 3);
                assert!(g.spmm_supports(lda));
                let mut a = vec![f16::ZERO; n * lda];
                let mut want = vec![0.0f64; n * m];
                let mut scale = 0.0f64;
                for tok in 0..n {
                    let x: Vec<f32> = activations(k, s ^ (0x77 + tok as u64))
                        .iter()
                        .map(|v| f16::from_f32(*v).to_f32())
                        .collect();
                    for (c, v) in x.iter().enumerate() {
                        a[tok * lda + c] = f16::from_f32(*v);
                    }
                    let yt = matvec_f64(&w, &x, None);
                    scale = scale.max(error_scale(&w, &x, None, &yt));
                    want[tok * m..(tok + 1) * m].copy_from_slice(&yt);
                }
                let ad = gpu.upload(&a).expect("upload a");
                for accumulate in [false, true] {
                    let what = format!("{m}x{k} sp={sp} n={n} accumulate={accumulate} seed={s}");
                    // Written: NaN everywhere first; accumulated: a known base per element.
                    let base: Vec<f32> = (0..n * ldy)
                        .map(|i| {
                            if accumulate {
                                (i % 7) as f32 - 3.0
                            } else {
                                f32::NAN
                            }
                        })
                        .collect();
                    let yd = gpu.upload(&base).expect("upload y");
                    g.spmm_rows(
                        &gpu,
                        dev_ptr(&gpu, &ad),
                        lda,
                        n,
                        dev_ptr(&gpu, &yd),
                        ldy,
                        accumulate,
                    )
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let got = gpu.download(&yd).expect("download");
                    let mut err = 0.0f64;
                    for tok in 0..n {
                        for r in 0..m {
                            let b = if accumulate {
                                base[tok * ldy + r] as f64
                            } else {
                                0.0
                            };
                            let v = got[tok * ldy + r] as f64;
                            assert!(v.is_finite(), "{what}: token {tok} row {r} unwritten");
                            err = err.max((v - b - want[tok * m + r]).abs());
                        }
                        // The padding past M is never written.
                        for r in m..ldy {
                            assert_eq!(
                                got[tok * ldy + r].to_bits(),
                                base[tok * ldy + r].to_bits(),
                                "{what}: token {tok} wrote past M at {r}"
                            );
                        }
                    }
                    assert!(err / scale < TOL, "{what}: rel error {}", err / scale);
                }
            }
        }
    }
    // Its requirements are typed errors, not wrong answers.
    let w = sparse_matrix(40, 20, 0.5, Pattern::Unstructured, seed()).expect("valid");
    let g = GpuTiledCbc::upload(&gpu, &TiledCbc::encode(&w).expect("encode")).expect("upload");
    assert!(!g.spmm_supports(20));
    let a = gpu.upload(&[f16::ZERO; 40]).expect("upload");
    let y = gpu.poisoned_f32(80).expect("alloc");
    assert!(g
        .spmm_rows(&gpu, dev_ptr(&gpu, &a), 20, 2, dev_ptr(&gpu, &y), 40, false)
        .is_err());
}

/// Runs `union` (a format's union product: x, ldx, n, threshold, y, ldy) on 1..=`most` tokens
/// of `w` at activation sparsities 0, 0.5 and 0.9 and checks every token against the f64
/// product of that token alone under the same threshold: tokens with different active columns
/// (one all below the threshold, one with exact zeros), padded strides, an output added to a
/// known base. Row padding and one spare row past the n tokens hold large active inputs in x
/// and sentinels in y: a kernel that reads past K or past n tokens, or writes past M or n,
/// changes the results or the sentinels.
fn check_union_rows(
    gpu: &Gpu,
    w: &DenseMatrix,
    most: usize,
    what: &str,
    union: &dyn Fn(u64, usize, usize, Threshold, u64, usize) -> sieve_cuda::Result<()>,
) {
    use sieve_cuda::product::dev_ptr;
    let (m, k) = (w.rows(), w.cols());
    let s = seed();
    // Under compute-sanitizer every launch is slow: the first, the second-largest and the
    // largest token counts only (the latter two cover a partial and a full last launch).
    let counts: Vec<usize> = if std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1") {
        let mut c = vec![1, most.saturating_sub(1).max(1), most];
        c.dedup();
        c
    } else {
        (1..=most).collect()
    };
    for dp in [0.0, 0.5, 0.9] {
        // Each token's activations and f64 reference do not depend on how many tokens share
        // the launch: computed once per dp (window K1: recomputing them per count made the
        // 4096 x 4096 case run past its time limit).
        let rows: Vec<Vec<f32>> = (0..most)
            .map(|tok| {
                let mut xt = activations(k, s ^ (0x91 + 7 * tok as u64));
                if tok == 1 {
                    // Below the threshold at dp 0.5 and 0.9 (|x| < 0.05), active at dp 0.
                    xt.iter_mut().for_each(|v| *v *= 0.01);
                }
                if tok == 2 {
                    xt.iter_mut().step_by(3).for_each(|v| *v = 0.0);
                }
                xt
            })
            .collect();
        let t = threshold_for_sparsity(&rows[0], dp).expect("valid dp");
        let wants: Vec<(Vec<f64>, f64)> = rows
            .iter()
            .map(|xt| {
                let want = matvec_f64(w, xt, t);
                let scale = error_scale(w, xt, t, &want);
                (want, scale)
            })
            .collect();
        for &n in &counts {
            let (ldx, ldy) = (k + 3, m + 5);
            let mut x = vec![1e4f32; (n + 1) * ldx];
            for (tok, xt) in rows.iter().take(n).enumerate() {
                x[tok * ldx..tok * ldx + k].copy_from_slice(xt);
            }
            let what = format!("{what} dp={dp} n={n} seed={s}");
            let base: Vec<f32> = (0..(n + 1) * ldy).map(|i| (i % 5) as f32 - 2.0).collect();
            let xd = gpu.upload(&x).expect("upload x");
            let yd = gpu.upload(&base).expect("upload y");
            union(dev_ptr(gpu, &xd), ldx, n, t, dev_ptr(gpu, &yd), ldy)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let got = gpu.download(&yd).expect("download");
            for (tok, (want, scale)) in wants.iter().take(n).enumerate() {
                let scale = *scale;
                let mut err = 0.0f64;
                for r in 0..m {
                    let b = base[tok * ldy + r] as f64;
                    let v = got[tok * ldy + r] as f64 - b;
                    assert!(v.is_finite(), "{what}: token {tok} row {r} not finite");
                    // The sum is stored as base + y in f32: its rounding at the base's magnitude
                    // is no error of the kernel's (window J5: a K = 1 product of a quiet token,
                    // y ~ 1e-5 against a base of 2, was "0.5% off" by that rounding alone).
                    let rounding = 2.0 * f32::EPSILON as f64 * (b.abs() + want[r].abs());
                    err = err.max(((v - want[r]).abs() - rounding).max(0.0));
                }
                assert!(
                    err / scale < TOL,
                    "{what}: token {tok} rel error {}",
                    err / scale
                );
            }
            // Nothing written past M in any row, nor in the spare row.
            for (i, (g, b)) in got.iter().zip(&base).enumerate() {
                let (row, col) = (i / ldy, i % ldy);
                if row == n || col >= m {
                    assert_eq!(
                        g.to_bits(),
                        b.to_bits(),
                        "{what}: wrote row {row} col {col}"
                    );
                }
            }
        }
    }
}

/// The limits every union product states as typed errors: one token too many, strides below
/// K or M, a negative threshold.
fn check_union_limits(
    gpu: &Gpu,
    most: usize,
    union: &dyn Fn(u64, usize, usize, Threshold, u64, usize) -> sieve_cuda::Result<()>,
) {
    use sieve_cuda::product::dev_ptr;
    let x = gpu.upload(&vec![1.0f32; 20 * (most + 1)]).expect("upload");
    let y = gpu.upload(&vec![0.0f32; 40 * (most + 1)]).expect("upload");
    let (xp, yp) = (dev_ptr(gpu, &x), dev_ptr(gpu, &y));
    assert!(
        union(xp, 20, most + 1, None, yp, 40).is_err(),
        "{} tokens",
        most + 1
    );
    assert!(union(xp, 19, 2, None, yp, 40).is_err(), "x stride below K");
    assert!(union(xp, 20, 2, None, yp, 39).is_err(), "y stride below M");
    assert!(
        union(xp, 20, 2, Some(-0.5), yp, 40).is_err(),
        "negative threshold"
    );
}

/// The union product over Tiled-CBC (`tcbc_spmspv_union_n*`) for 1..4 tokens.
#[test]
fn tiled_cbc_union_matches_each_token_alone() {
    let Some(gpu) = gpu_or_skip("tiled_cbc_union_matches_each_token_alone") else {
        return;
    };
    use sieve_cuda::tiled_cbc::UNION_MAX_TOKENS;
    let shapes: &[(usize, usize)] = &[
        (1, 1),
        (7, 5),
        (33, 63),
        (257, 600),
        (513, 4104),
        (4096, 4096),
    ];
    // Under compute-sanitizer kernels run 10-100x slower: small shapes only.
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for &(m, k) in shapes {
        if small_only && m * k > 1_000_000 {
            continue;
        }
        for sp in [0.0, 0.5, 0.9] {
            let s = seed();
            let w = sparse_matrix(m, k, sp, Pattern::Unstructured, s).expect("valid shape");
            let g =
                GpuTiledCbc::upload(&gpu, &TiledCbc::encode(&w).expect("encode")).expect("upload");
            check_union_rows(
                &gpu,
                &w,
                UNION_MAX_TOKENS,
                &format!("{m}x{k} sp={sp}"),
                &|x, ldx, n, t, y, ldy| g.union_rows(&gpu, x, ldx, n, t, y, ldy),
            );
        }
    }
    let w = sparse_matrix(40, 20, 0.5, Pattern::Unstructured, seed()).expect("valid");
    let g = GpuTiledCbc::upload(&gpu, &TiledCbc::encode(&w).expect("encode")).expect("upload");
    check_union_limits(&gpu, UNION_MAX_TOKENS, &|x, ldx, n, t, y, ldy| {
        g.union_rows(&gpu, x, ldx, n, t, y, ldy)
    });
}

/// The union product over Balanced-CBC (`bcbc_union_n*`, `bcbc_idx_union_n*`) for 1..8 tokens
/// (two launches from 5), both layouts, slot counts 1..16, a last row tile with few lanes.
#[test]
fn balanced_cbc_union_matches_each_token_alone() {
    let Some(gpu) = gpu_or_skip("balanced_cbc_union_matches_each_token_alone") else {
        return;
    };
    use sieve_cuda::balanced_cbc::UNION_MAX_TOKENS;
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for &(rows, cols) in &[
        (16usize, 1usize),
        (45, 70),
        (576, 200),
        (1000, 300),
        (4096, 4096),
    ] {
        for slots in [1usize, 3, 8, 9, 16] {
            if rows * cols > 1_000_000 && (slots != 8 || small_only) {
                continue;
            }
            // racecheck runs each launch with 64 KB of shared memory slowly: two slot counts,
            // one per kernel template below and above 8, are enough for it.
            if small_only && slots != 3 && slots != 9 {
                continue;
            }
            let m = balanced_matrix(rows, cols, slots, seed()).expect("matrix");
            let f = BalancedCbc::encode_with_slots(&m, slots).expect("encode");
            for kernel in [BcbcKernel::Chain, BcbcKernel::Idx] {
                let g = GpuBalancedCbc::upload_for(&gpu, &f, kernel).expect("upload");
                let what = format!("{rows}x{cols} n={slots} {kernel:?}");
                check_union_rows(
                    &gpu,
                    &m,
                    UNION_MAX_TOKENS,
                    &what,
                    &|x, ldx, n, t, y, ldy| g.union_rows(&gpu, x, ldx, n, t, y, ldy),
                );
            }
        }
    }
    let m = balanced_matrix(40, 20, 4, seed()).expect("matrix");
    let g = GpuBalancedCbc::upload(
        &gpu,
        &BalancedCbc::encode_with_slots(&m, 4).expect("encode"),
    )
    .expect("upload");
    check_union_limits(&gpu, UNION_MAX_TOKENS, &|x, ldx, n, t, y, ldy| {
        g.union_rows(&gpu, x, ldx, n, t, y, ldy)
    });
}
