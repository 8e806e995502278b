//! The W4A8 kernels (4-bit weights, activations quantized to INT8 on the device) against their
//! f64 CPU reference with the same quantization: odd shapes, every N = 1..32, partial row tiles
//! and groups, TEAL thresholds, strided inputs and outputs, NaN-poisoned outputs; the device's
//! activation codes equal the CPU's bit for bit. Without a GPU each test prints a skip reason
//! and passes, unless `SIEVE_REQUIRE_GPU=1`.

use sieve_cuda::gpu_or_skip;
use sieve_cuda::lowbit::{quantize_q4_0, LowBitKind, LowBitMatrix};
use sieve_cuda::product::dev_ptr;
use sieve_cuda::w4a8::{quantize_reference, reference, GpuW4A8, Int8Activations};
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::reference::max_rel_error;
use sieve_formats::Threshold;

const TOL: f64 = 1e-4;

const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (7, 5),
    (17, 130),
    (33, 200),
    (300, 1000),
    (257, 4104),
    (4096, 4096),
];

fn small_only() -> bool {
    std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1")
}

fn matrix(kind: LowBitKind, rows: usize, cols: usize, seed: u64) -> LowBitMatrix {
    let w = sparse_matrix(rows, cols, 0.0, Pattern::Unstructured, seed).unwrap();
    match kind {
        // GGUF Q4_0 blocks as a file holds them (K a multiple of 32), else sieve's quantizer.
        LowBitKind::W4G32 if cols.is_multiple_of(32) => {
            LowBitMatrix::from_q4_0(rows, cols, &quantize_q4_0(&w).unwrap()).unwrap()
        }
        _ => LowBitMatrix::quantize(&w, kind),
    }
}

/// Quantizes `n` tokens on the device (rows `ldin` apart), checks the codes and scales against
/// the CPU's, runs the product plain and accumulating into rows of `ldy`, and compares.
#[allow(clippy::too_many_arguments)]
fn check(
    gpu: &sieve_cuda::Gpu,
    m: &LowBitMatrix,
    d: &GpuW4A8,
    n: usize,
    seed: u64,
    threshold: Threshold,
    strided: bool,
    what: &str,
) {
    let (rows, cols) = (m.rows(), m.cols());
    let x = activations(n * cols, seed);
    let want = reference(m, &x, n, threshold).unwrap();
    let (ldin, ldy) = if strided {
        (cols + 3, rows + 5)
    } else {
        (cols, rows)
    };
    let mut xs = vec![f32::NAN; n * ldin];
    for t in 0..n {
        xs[t * ldin..t * ldin + cols].copy_from_slice(&x[t * cols..(t + 1) * cols]);
    }
    let xd = gpu.upload(&xs).unwrap();
    let acts = Int8Activations::new(gpu, n, d.matrix().padded_cols()).unwrap();
    acts.quantize(gpu, dev_ptr(gpu, &xd), cols, ldin, n, threshold)
        .unwrap();
    gpu.synchronize().unwrap();
    let got = acts.download(gpu, n, cols).unwrap();
    let cpu = quantize_reference(&x, n, cols, threshold);
    for t in 0..n {
        let bits = |r: &sieve_formats::eight_bit::GroupedRow8| {
            r.scales.iter().map(|s| s.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(
            bits(&got[t]),
            bits(&cpu[t]),
            "{what} n={n} token {t}: scales"
        );
        assert_eq!(got[t].codes, cpu[t].codes, "{what} n={n} token {t}: codes");
    }
    let y = gpu.poisoned_f32(n * ldy).unwrap();
    let yp = dev_ptr(gpu, &y);
    let compare = |scale: f64, label: &str| {
        let all = gpu.download(&y).unwrap();
        let got: Vec<f32> = (0..n)
            .flat_map(|t| all[t * ldy..t * ldy + rows].iter().copied())
            .collect();
        let want: Vec<f64> = want.iter().map(|v| scale * v).collect();
        let e = max_rel_error(&got, &want);
        assert!(e < TOL, "{what} n={n} {label}: rel error {e}");
        if strided {
            for t in 0..n {
                assert!(
                    all[t * ldy + rows..(t + 1) * ldy]
                        .iter()
                        .all(|v| v.is_nan()),
                    "{what} n={n}: wrote past M in row {t}"
                );
            }
        }
    };
    d.launch_ptr(gpu, &acts, n, yp, ldy, false).unwrap();
    gpu.synchronize().unwrap();
    compare(1.0, "");
    d.launch_ptr(gpu, &acts, n, yp, ldy, true).unwrap();
    gpu.synchronize().unwrap();
    compare(2.0, "accumulate");
}

#[test]
fn gpu_w4a8_matches_reference() {
    let Some(gpu) = gpu_or_skip("gpu_w4a8_matches_reference") else {
        return;
    };
    for kind in [LowBitKind::W4G128, LowBitKind::W4G32] {
        for (si, &(rows, cols)) in SHAPES.iter().enumerate() {
            if small_only() && rows * cols > 100_000 {
                continue;
            }
            let seed = 31 + si as u64;
            let m = matrix(kind, rows, cols, seed);
            let d = GpuW4A8::upload(&gpu, &m).unwrap();
            let ns: Vec<usize> = if small_only() {
                vec![1, 9, 17, 32]
            } else if rows * cols > 1_000_000 {
                vec![1, 4, 9, 17, 32]
            } else {
                (1..=32).collect()
            };
            for n in ns {
                let what = format!("{} {rows}x{cols}", kind.name());
                check(&gpu, &m, &d, n, seed ^ n as u64, None, false, &what);
            }
        }
    }
}

#[test]
fn gpu_w4a8_teal_and_strides() {
    let Some(gpu) = gpu_or_skip("gpu_w4a8_teal_and_strides") else {
        return;
    };
    for kind in [LowBitKind::W4G128, LowBitKind::W4G32] {
        for &(rows, cols) in &[(33, 200), (300, 1000)] {
            let m = matrix(kind, rows, cols, 77);
            let d = GpuW4A8::upload(&gpu, &m).unwrap();
            let probe = activations(cols, 5);
            for dp in [0.3, 0.7] {
                let thr = threshold_for_sparsity(&probe, dp).unwrap();
                for n in [1, 3, 8, 13, 32] {
                    let what = format!("{} {rows}x{cols} dp {dp}", kind.name());
                    check(&gpu, &m, &d, n, 90 + n as u64, thr, true, &what);
                }
            }
            // A row of zeros (every input under the threshold) has scale 0 and gives y = 0.
            check(
                &gpu,
                &m,
                &d,
                2,
                3,
                Some(f32::MAX),
                false,
                &format!("{} all inactive", kind.name()),
            );
        }
    }
}

#[test]
fn gpu_w4a8_refuses_bad_launches() {
    let Some(gpu) = gpu_or_skip("gpu_w4a8_refuses_bad_launches") else {
        return;
    };
    let m = matrix(LowBitKind::W4G128, 40, 300, 1);
    let d = GpuW4A8::upload(&gpu, &m).unwrap();
    let kp = d.matrix().padded_cols();
    assert!(Int8Activations::new(&gpu, 0, kp).is_err());
    assert!(Int8Activations::new(&gpu, 2, 100).is_err());
    let acts = Int8Activations::new(&gpu, 2, kp).unwrap();
    let x = gpu.upload(&vec![1f32; 2 * 300]).unwrap();
    let xp = dev_ptr(&gpu, &x);
    assert!(acts.quantize(&gpu, xp, 300, 300, 3, None).is_err());
    assert!(acts.quantize(&gpu, xp, kp + 1, kp + 1, 1, None).is_err());
    assert!(acts.quantize(&gpu, xp, 300, 299, 1, None).is_err());
    acts.quantize(&gpu, xp, 300, 300, 2, None).unwrap();
    let mut y = gpu.poisoned_f32(2 * 40).unwrap();
    assert!(d.launch(&gpu, &acts, 3, &mut y, false).is_err());
    assert!(d.launch(&gpu, &acts, 0, &mut y, false).is_err());
    let yp = dev_ptr(&gpu, &y);
    assert!(d.launch_ptr(&gpu, &acts, 1, yp, 39, false).is_err());
    let other = Int8Activations::new(&gpu, 2, kp + 128).unwrap();
    assert!(d.launch(&gpu, &other, 1, &mut y, false).is_err());
    assert!(GpuW4A8::upload(&gpu, &matrix(LowBitKind::W8Row, 4, 64, 2)).is_err());
    d.launch(&gpu, &acts, 2, &mut y, false).unwrap();
    gpu.synchronize().unwrap();
}
