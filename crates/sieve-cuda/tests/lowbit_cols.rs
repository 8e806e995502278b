//! The column-major 4-bit kernel (TEAL column skipping) against the f64 reference of the same
//! quantized matrix and masked input, and against its CPU emulation (same f16 roundings, so a
//! much tighter bound): odd shapes (partial row tiles and slots), both kinds, activation
//! sparsities 0..0.999 and no threshold, huge inputs, accumulation into y, and the f16 decode
//! the batched prefill multiplies. The kernel variant is the one the matrix's rows pick, or
//! `SIEVE_LOWBIT_COLS_VARIANT`'s (run the test once per variant). Without a GPU each test prints a skip reason and passes,
//! unless `SIEVE_REQUIRE_GPU=1`.

use half::f16;
use sieve_cuda::gpu_or_skip;
use sieve_cuda::lowbit::{LowBitKind, LowBitMatrix};
use sieve_cuda::lowbit_cols::{emulate, reference, ColumnLayout, GpuLowBitCols};
use sieve_cuda::{dev_ptr, GpuAccumulate};
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::reference::max_rel_error;

/// Against the f64 reference: f16 partial sums of 16 products (the emulation's own test).
const TOL_REFERENCE: f64 = 2e-3;
/// Against the emulation: only the order of f32 additions differs.
const TOL_EMULATION: f64 = 1e-5;

const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (7, 33),
    (255, 64),
    (257, 200),
    (300, 1000),
    (1024, 4096),
    (4096, 4128),
];

#[test]
fn gpu_lowbit_cols_match_reference_and_emulation() {
    let Some(gpu) = gpu_or_skip("gpu_lowbit_cols_match_reference_and_emulation") else {
        return;
    };
    // Under compute-sanitizer (SIEVE_SANITIZE_SMALL=1): the shapes up to 300 x 1000.
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for kind in [LowBitKind::W4G128, LowBitKind::W4G32] {
        for (si, &(rows, cols)) in SHAPES.iter().enumerate() {
            if small_only && rows * cols > 300_000 {
                continue;
            }
            let w = sparse_matrix(rows, cols, 0.5, Pattern::Unstructured, 3 + si as u64).unwrap();
            let m = LowBitMatrix::quantize(&w, kind);
            let l = ColumnLayout::new(&m).unwrap();
            let d = GpuLowBitCols::upload_layout(&gpu, &l).unwrap();
            let mut x = activations(cols, 50 + si as u64);
            if cols > 40 {
                // Llama-like outliers beside ordinary inputs.
                x[3] = 3000.0;
                x[cols - 2] = -1500.0;
            }
            let xd = gpu.upload(&x).unwrap();
            for dp in [None, Some(0.0), Some(0.5), Some(0.9), Some(0.999)] {
                let t = match dp {
                    None => None,
                    Some(dp) => threshold_for_sparsity(&x, dp).unwrap(),
                };
                let what = format!("{kind:?} {rows}x{cols} dp {dp:?}");
                let wanted = reference(&m, &x, t);
                let emulated = emulate(&l, &x, t, d.variant()).unwrap();
                let mut y = gpu.poisoned_f32(rows).unwrap();
                sieve_cuda::GpuMatVec::launch(&d, &gpu, &xd, t, &mut y).unwrap();
                gpu.synchronize().unwrap();
                let got = gpu.download(&y).unwrap();
                let e_ref = max_rel_error(&got, &wanted);
                let emu: Vec<f64> = emulated.iter().map(|v| *v as f64).collect();
                let e_emu = max_rel_error(&got, &emu);
                // With every input inactive the product is exactly zero.
                if wanted.iter().all(|v| *v == 0.0) {
                    assert!(got.iter().all(|v| *v == 0.0), "{what}: {got:?}");
                    continue;
                }
                assert!(
                    e_ref < TOL_REFERENCE,
                    "{what}: rel error {e_ref} against the reference"
                );
                assert!(
                    e_emu < TOL_EMULATION,
                    "{what}: rel error {e_emu} against the emulation"
                );
                // Accumulate: a second launch adds the product again.
                d.launch_add(&gpu, dev_ptr(&gpu, &xd), t, dev_ptr(&gpu, &y))
                    .unwrap();
                gpu.synchronize().unwrap();
                let got2 = gpu.download(&y).unwrap();
                let twice: Vec<f64> = wanted.iter().map(|v| 2.0 * v).collect();
                let e2 = max_rel_error(&got2, &twice);
                assert!(e2 < TOL_REFERENCE, "{what} accumulate: rel error {e2}");
            }
        }
    }
}

#[test]
fn gpu_lowbit_cols_decode_to_f16_matches_the_matrix() {
    let Some(gpu) = gpu_or_skip("gpu_lowbit_cols_decode_to_f16_matches_the_matrix") else {
        return;
    };
    for kind in [LowBitKind::W4G128, LowBitKind::W4G32] {
        let (rows, cols) = (300, 200);
        let w = sparse_matrix(rows, cols, 0.5, Pattern::Unstructured, 9).unwrap();
        let m = LowBitMatrix::quantize(&w, kind);
        let d = GpuLowBitCols::upload(&gpu, &m).unwrap();
        let (mp, kp) = (d.padded_rows(), d.padded_cols());
        let out = gpu.upload(&vec![f16::from_f32(7.0); mp * kp]).unwrap();
        d.decode_transposed(&gpu, dev_ptr(&gpu, &out)).unwrap();
        gpu.synchronize().unwrap();
        let got = gpu.download(&out).unwrap();
        for k in 0..kp {
            for r in 0..mp {
                let want = if r < rows && k < cols {
                    f16::from_f32(m.scale(r, k) * m.q()[r * cols + k] as f32)
                } else {
                    f16::ZERO
                };
                assert_eq!(
                    got[k * mp + r].to_bits(),
                    want.to_bits(),
                    "{kind:?} ({r}, {k})"
                );
            }
        }
    }
}
