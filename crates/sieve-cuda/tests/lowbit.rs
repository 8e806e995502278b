//! The low-bit kernels against their f64 CPU references with the same quantization (odd
//! shapes, every N = 1..32, partial row tiles and K groups), NaN-poisoned outputs. Without a
//! GPU each test prints a skip reason and passes, unless `SIEVE_REQUIRE_GPU=1`.

use half::f16;
use sieve_cuda::gpu_or_skip;
use sieve_cuda::lowbit::{
    pad_activations, quantize_q4_0, quantize_q8_0, GpuLowBit, LowBitKind, LowBitMatrix,
};
use sieve_formats::random::{activations, sparse_matrix, Pattern};
use sieve_formats::reference::max_rel_error;

const TOL: f64 = 1e-4;

fn x16(n: usize, k: usize, seed: u64) -> Vec<f16> {
    activations(n * k, seed)
        .into_iter()
        .map(f16::from_f32)
        .collect()
}

/// Runs `m` on `n` tokens (plain and accumulating) and compares with the reference.
fn check(gpu: &sieve_cuda::Gpu, m: &LowBitMatrix, d: &GpuLowBit, n: usize, seed: u64, what: &str) {
    let (rows, cols) = (m.rows(), m.cols());
    let x = x16(n, cols, seed);
    let want = m.reference(&x, n);
    let xp = gpu
        .upload(&pad_activations(&x, n, cols, d.padded_cols()))
        .unwrap();
    let mut y = gpu.poisoned_f32(n * rows).unwrap();
    d.launch(gpu, &xp, n, &mut y, false).unwrap();
    gpu.synchronize().unwrap();
    let got = gpu.download(&y).unwrap();
    let e = max_rel_error(&got[..n * rows], &want);
    assert!(e < TOL, "{what} n={n}: rel error {e}");
    // Accumulate: y += W x on top of the first product.
    d.launch(gpu, &xp, n, &mut y, true).unwrap();
    gpu.synchronize().unwrap();
    let got = gpu.download(&y).unwrap();
    let twice: Vec<f64> = want.iter().map(|v| 2.0 * v).collect();
    let e = max_rel_error(&got[..n * rows], &twice);
    assert!(e < TOL, "{what} n={n} accumulate: rel error {e}");
}

const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (7, 5),
    (17, 130),
    (33, 200),
    (300, 1000),
    (257, 4104),
    (4096, 4096),
];

#[test]
fn gpu_lowbit_kernels_match_reference() {
    let Some(gpu) = gpu_or_skip("gpu_lowbit_kernels_match_reference") else {
        return;
    };
    // Under compute-sanitizer (`SIEVE_SANITIZE_SMALL=1`): the small shapes (one, two and an
    // odd number of row tiles) and one N per kernel instance (NT = 1, 2, 3, 4).
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for kind in LowBitKind::ALL {
        for (si, &(rows, cols)) in SHAPES.iter().enumerate() {
            if small_only && rows * cols > 100_000 {
                continue;
            }
            let seed = 11 + si as u64;
            let w = sparse_matrix(rows, cols, 0.0, Pattern::Unstructured, seed).unwrap();
            let m = LowBitMatrix::quantize(&w, kind);
            let d = GpuLowBit::upload(&gpu, &m).unwrap();
            let ns: Vec<usize> = if small_only {
                vec![1, 9, 17, 32]
            } else if rows * cols > 1_000_000 {
                vec![1, 4, 9, 17, 32]
            } else {
                (1..=32).collect()
            };
            for n in ns {
                check(
                    &gpu,
                    &m,
                    &d,
                    n,
                    seed ^ n as u64,
                    &format!("{} {rows}x{cols}", kind.name()),
                );
            }
        }
    }
}

#[test]
fn gpu_gguf_blocks_match_reference() {
    let Some(gpu) = gpu_or_skip("gpu_gguf_blocks_match_reference") else {
        return;
    };
    for &(rows, cols) in &[(1usize, 32usize), (19, 96), (300, 1024), (4096, 4096)] {
        let w = sparse_matrix(rows, cols, 0.0, Pattern::Unstructured, 5).unwrap();
        let b4 = quantize_q4_0(&w).unwrap();
        let m4 = LowBitMatrix::from_q4_0(rows, cols, &b4).unwrap();
        let d4 = GpuLowBit::upload_q4_0(&gpu, rows, cols, &b4).unwrap();
        let b8 = quantize_q8_0(&w).unwrap();
        let m8 = LowBitMatrix::from_q8_0(rows, cols, &b8).unwrap();
        let d8 = GpuLowBit::upload_q8_0(&gpu, rows, cols, &b8).unwrap();
        for n in [1usize, 2, 3, 8, 13, 32] {
            check(
                &gpu,
                &m4,
                &d4,
                n,
                3 + n as u64,
                &format!("q4_0 {rows}x{cols}"),
            );
            check(
                &gpu,
                &m8,
                &d8,
                n,
                4 + n as u64,
                &format!("q8_0 {rows}x{cols}"),
            );
        }
    }
}

/// Every GGUF type the kernels take, from random blocks (sieve-cpu's generator: real-model
/// scale magnitudes, uniformly random codes), against the reference of the parsed matrix.
#[test]
fn gpu_every_gguf_type_matches_reference() {
    use sieve_cpu::gguf_blocks::test_blocks::random_blocks;
    use sieve_cpu::gguf_blocks::BlockType;
    let Some(gpu) = gpu_or_skip("gpu_every_gguf_type_matches_reference") else {
        return;
    };
    for (ti, ty) in BlockType::ALL.into_iter().enumerate() {
        for &(rows, cols) in &[(1usize, 256usize), (19, 768), (300, 1280), (4096, 4096)] {
            let blocks = random_blocks(ty, rows, cols, 40 + ti as u64);
            let m = LowBitMatrix::from_gguf(&format!("{ty:?}"), rows, cols, &blocks).unwrap();
            let d = GpuLowBit::upload(&gpu, &m).unwrap();
            for n in [1usize, 2, 3, 8, 13, 32] {
                check(
                    &gpu,
                    &m,
                    &d,
                    n,
                    7 + n as u64,
                    &format!("{ty:?} {rows}x{cols}"),
                );
            }
        }
    }
}

/// The batched prefill's f16 copy of a low-bit Balanced-CBC matrix (`decode_transposed`):
/// column-major, equal to the snapped matrix (zeros below M), int8 and every int4 group, odd
/// shapes and slot counts; the output starts as NaN, so nothing may be left unwritten.
#[test]
fn gpu_balanced_lowbit_decode_transposed_is_the_matrix() {
    use sieve_cuda::balanced_lowbit::{snap_balanced, GpuBalancedLowBit, LowBitValues};
    use sieve_formats::random::balanced_matrix;
    let Some(gpu) = gpu_or_skip("gpu_balanced_lowbit_decode_transposed_is_the_matrix") else {
        return;
    };
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for (si, &(rows, cols)) in [(1usize, 1usize), (33, 63), (513, 300), (1100, 129)]
        .iter()
        .enumerate()
    {
        if small_only && rows * cols > 100_000 {
            continue;
        }
        for slots in [1usize, 5, 8, 9, 16] {
            let w = balanced_matrix(rows, cols, slots, 300 + si as u64 + slots as u64).unwrap();
            for values in [
                LowBitValues::Int8,
                LowBitValues::Int4 { group: 32 },
                LowBitValues::Int4 { group: 128 },
            ] {
                let (enc, snapped) = snap_balanced(&w, slots, values).unwrap();
                let g = GpuBalancedLowBit::upload(&gpu, &enc).unwrap();
                let mp = g.padded_rows();
                let got = gpu
                    .f16_written_by(cols * mp, |out| g.decode_transposed(&gpu, out))
                    .unwrap();
                for c in 0..cols {
                    for r in 0..mp {
                        let want = if r < rows {
                            snapped.get(r, c)
                        } else {
                            f16::ZERO
                        };
                        assert_eq!(
                            got[c * mp + r].to_f32(),
                            want.to_f32(),
                            "{rows}x{cols} n={slots} {}: ({r}, {c})",
                            values.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_balanced_lowbit_matches_reference() {
    use sieve_cuda::balanced_lowbit::{snap_balanced, GpuBalancedLowBit, LowBitValues};
    use sieve_cuda::{matvec_host, GpuAccumulate, GpuMatVec};
    use sieve_formats::random::{balanced_matrix, threshold_for_sparsity};
    use sieve_formats::reference::matvec_f64;
    let Some(gpu) = gpu_or_skip("gpu_balanced_lowbit_matches_reference") else {
        return;
    };
    let shapes: &[(usize, usize)] = &[
        (1, 1),
        (7, 5),
        (33, 63),
        (513, 300),
        (1100, 129),
        (4096, 4096),
    ];
    for (si, &(rows, cols)) in shapes.iter().enumerate() {
        let big = rows * cols > 1_000_000;
        let slot_set: &[usize] = if big {
            &[8]
        } else {
            &[1, 3, 4, 5, 8, 9, 12, 16]
        };
        for &slots in slot_set {
            let w = balanced_matrix(rows, cols, slots, 100 + si as u64 + slots as u64).unwrap();
            for values in [
                LowBitValues::Int8,
                LowBitValues::Int4 { group: 32 },
                LowBitValues::Int4 { group: 64 },
                LowBitValues::Int4 { group: 128 },
            ] {
                let (enc, snapped) = snap_balanced(&w, slots, values).unwrap();
                let mut d = GpuBalancedLowBit::upload(&gpu, &enc).unwrap();
                let cpws: &[usize] = if big { &[0] } else { &[0, 16, 32] };
                for &cpw in cpws {
                    d.cols_per_warp = cpw;
                    for dp in [0.0, 0.5, 0.9] {
                        let x = activations(cols, 7 + slots as u64);
                        let t = threshold_for_sparsity(&x, dp).unwrap();
                        let want = matvec_f64(&snapped, &x, t);
                        let got = matvec_host(&gpu, &d, &x, t).unwrap();
                        let e = max_rel_error(&got, &want);
                        let what = format!(
                            "{rows}x{cols} n={slots} {} cpw={cpw} dp={dp}",
                            values.name()
                        );
                        assert!(e < TOL, "{what}: rel error {e}");
                        // Accumulating form: y (holding the product) += product.
                        let xd = gpu.upload(&x).unwrap();
                        let y = gpu.upload(&got).unwrap();
                        d.launch_add(
                            &gpu,
                            sieve_cuda::dev_ptr(&gpu, &xd),
                            t,
                            sieve_cuda::dev_ptr(&gpu, &y),
                        )
                        .unwrap();
                        gpu.synchronize().unwrap();
                        let twice: Vec<f64> = want.iter().map(|v| 2.0 * v).collect();
                        let e = max_rel_error(&gpu.download(&y).unwrap(), &twice);
                        assert!(e < TOL, "{what} accumulate: rel error {e}");
                        assert_eq!(d.rows(), rows);
                    }
                }
            }
        }
    }
}

/// The prefill's f16 copy of a low-bit matrix (`decode_rows_f16`): every weight equals the
/// CPU's `dequantize` rounded to f16 (f32 scale arithmetic on both sides: 1 f16 rounding
/// apart at most), padding rows are zero, and no element of the padded output is left
/// unwritten (the output starts as NaN).
fn check_decode(gpu: &sieve_cuda::Gpu, m: &LowBitMatrix, d: &GpuLowBit, what: &str) {
    let (rows, cols) = (m.rows(), m.cols());
    let (mp, kp) = (d.padded_rows(), d.padded_cols());
    let got = gpu
        .f16_written_by(mp * kp, |out| d.decode_rows_f16(gpu, out))
        .unwrap();
    let want = m.dequantize();
    for r in 0..mp {
        for k in 0..kp {
            let g = got[r * kp + k];
            assert!(
                !g.is_nan(),
                "{what}: ({r}, {k}) of the padded copy not written"
            );
            if r >= rows {
                assert_eq!(g.to_f32(), 0.0, "{what}: padding row {r} column {k}");
                continue;
            }
            if k >= cols {
                continue;
            }
            let w = want[r * cols + k];
            let (g, w16) = (g.to_f32(), f16::from_f32(w).to_f32());
            assert!(
                (g - w16).abs() <= w.abs() * 1e-3 + 1e-7,
                "{what}: ({r}, {k}) is {g}, dequantized {w} (f16 {w16})"
            );
        }
    }
}

#[test]
fn gpu_lowbit_decode_to_f16_matches_dequantize() {
    use sieve_cpu::gguf_blocks::test_blocks::random_blocks;
    use sieve_cpu::gguf_blocks::BlockType;
    let Some(gpu) = gpu_or_skip("gpu_lowbit_decode_to_f16_matches_dequantize") else {
        return;
    };
    let small_only = std::env::var("SIEVE_SANITIZE_SMALL").as_deref() == Ok("1");
    for kind in LowBitKind::ALL {
        for (si, &(rows, cols)) in [
            (1usize, 1usize),
            (7, 5),
            (33, 200),
            (300, 1000),
            (257, 4104),
        ]
        .iter()
        .enumerate()
        {
            if small_only && rows * cols > 100_000 {
                continue;
            }
            let w = sparse_matrix(rows, cols, 0.3, Pattern::Unstructured, 70 + si as u64).unwrap();
            let m = LowBitMatrix::quantize(&w, kind);
            let d = GpuLowBit::upload(&gpu, &m).unwrap();
            check_decode(&gpu, &m, &d, &format!("{} {rows}x{cols}", kind.name()));
        }
    }
    for (ti, ty) in BlockType::ALL.into_iter().enumerate() {
        for &(rows, cols) in &[(19usize, 768usize), (300, 1280)] {
            let blocks = random_blocks(ty, rows, cols, 90 + ti as u64);
            let m = LowBitMatrix::from_gguf(&format!("{ty:?}"), rows, cols, &blocks).unwrap();
            let d = GpuLowBit::upload(&gpu, &m).unwrap();
            check_decode(&gpu, &m, &d, &format!("{ty:?} {rows}x{cols}"));
        }
    }
}

/// The low-bit kernels' f16 input under a TEAL threshold: each token's row masked by its own
/// values (`|x| > t` on the f32), rounded to f16, zeros past K; exactly the CPU's masking. The
/// batched decode step of a 4-bit TEAL model reads its rows through this (`Layouts::batch`).
#[test]
fn gpu_activations_to_f16_mask_each_token() {
    use sieve_cuda::lowbit::activations_to_f16;
    use sieve_cuda::product::dev_ptr;
    use sieve_formats::random::threshold_for_sparsity;
    let Some(gpu) = gpu_or_skip("gpu_activations_to_f16_mask_each_token") else {
        return;
    };
    let (n, k, ldin, ldx) = (5usize, 200usize, 211usize, 256usize);
    let x = activations(n * ldin, 7);
    let t = threshold_for_sparsity(&x, 0.5).unwrap();
    let xd = gpu.upload(&x).unwrap();
    for threshold in [t, None, Some(0.0)] {
        let got = gpu
            .f16_written_by(n * ldx, |out| {
                activations_to_f16(&gpu, dev_ptr(&gpu, &xd), k, ldin, ldx, n, threshold, out)
            })
            .unwrap();
        let mut active = 0usize;
        for row in 0..n {
            for col in 0..ldx {
                let want = if col < k {
                    let v = x[row * ldin + col];
                    if threshold.is_none_or(|t| v.abs() > t) {
                        active += 1;
                        f16::from_f32(v)
                    } else {
                        f16::ZERO
                    }
                } else {
                    f16::ZERO
                };
                assert_eq!(
                    got[row * ldx + col].to_bits(),
                    want.to_bits(),
                    "threshold {threshold:?}: token {row}, column {col}"
                );
            }
        }
        // The median threshold leaves about half of the inputs active, none leaves all.
        let expect = if threshold == t { n * k / 2 } else { n * k };
        assert!(
            active.abs_diff(expect) <= n * k / 10,
            "{threshold:?}: {active} active"
        );
    }
}
