//! The batched pass's element-wise row kernels (`kernels/prefill.cu`: RMSNorm, the masked f16
//! conversion of a GEMM input, SwiGLU, the embedding gather, zeroing) against the CPU on widths
//! that take their 16-byte path (multiples of 4 on aligned rows) and their one-column path (odd
//! widths, rows starting one float off alignment), with NaN canaries around what each may write.
//! Without a GPU each test prints a skip reason and passes, unless `SIEVE_REQUIRE_GPU=1`.

use half::f16;
use sieve_cuda::prefill::{embed_rows, rmsnorm_rows, rows_to_f16, silu_rows, zero_rows};
use sieve_cuda::{dev_ptr, gpu_or_skip};
use sieve_formats::random::Lcg as Rng;

/// (rows, width, row stride, offset of the first row in floats): aligned and vectorizable, odd
/// widths, strides wider than the rows, and a first row one float past 16-byte alignment.
const SHAPES: &[(usize, usize, usize, usize)] = &[
    (3, 4096, 4096, 0),
    (5, 1028, 1032, 0),
    (2, 4099, 4101, 0),
    (4, 64, 68, 1),
    (1, 3, 3, 0),
    (7, 2050, 2052, 1),
];

fn f16_bits(v: f32) -> u16 {
    f16::from_f32(v).to_bits()
}

#[test]
fn row_kernels_match_the_cpu() {
    let Some(gpu) = gpu_or_skip("row_kernels_match_the_cpu") else {
        return;
    };
    let mut rng = Rng(7);
    for &(n, k, ld, off) in SHAPES {
        let what = format!("{n} rows of {k}, stride {ld}, offset {off}");
        let len = off + n * ld + 4;
        let x = rng.vec(len, 3.0);
        let xd = gpu.upload(&x).unwrap();
        let x0 = dev_ptr(&gpu, &xd) + (off * 4) as u64;

        // rows_to_f16 under a threshold and without one; the output rows are k apart.
        for t in [None, Some(0.7f32)] {
            let out = gpu.upload(&vec![0xffffu16; n * k + 5]).unwrap();
            rows_to_f16(&gpu, x0, ld, dev_ptr(&gpu, &out), n, k, t).unwrap();
            let got = gpu.download(&out).unwrap();
            for r in 0..n {
                for c in 0..k {
                    let v = x[off + r * ld + c];
                    let v = match t {
                        Some(t) if v.abs() <= t => 0.0,
                        _ => v,
                    };
                    assert_eq!(got[r * k + c], f16_bits(v), "{what}, t {t:?}: ({r}, {c})");
                }
            }
            assert!(got[n * k..].iter().all(|&b| b == 0xffff), "{what}: wrote past the rows");
        }

        // RMSNorm reads rows of k packed one after another (its stride is its width).
        let w = rng.vec(k, 1.0);
        let wd = gpu.upload(&w).unwrap();
        let out = gpu.poisoned_f32(off + n * k + 4).unwrap();
        let o0 = dev_ptr(&gpu, &out) + (off * 4) as u64;
        rmsnorm_rows(&gpu, x0, dev_ptr(&gpu, &wd), o0, n, k, 1e-5).unwrap();
        let got = gpu.download(&out).unwrap();
        for r in 0..n {
            let row = &x[off + r * k..off + (r + 1) * k];
            let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
            let scale = 1.0 / (ss / k as f64 + 1e-5).sqrt();
            for c in 0..k {
                let want = row[c] as f64 * scale * w[c] as f64;
                let g = got[off + r * k + c] as f64;
                assert!(
                    (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{what}: norm ({r}, {c}) {g} against {want}"
                );
            }
        }
        assert!(got[..off].iter().all(|v| v.is_nan()), "{what}: norm wrote before the rows");
        assert!(
            got[off + n * k..].iter().all(|v| v.is_nan()),
            "{what}: norm wrote past the rows"
        );

        // SwiGLU over rows [gate | up] of 2k.
        let gu = rng.vec(off + n * 2 * k + 4, 4.0);
        let gud = gpu.upload(&gu).unwrap();
        silu_rows(&gpu, dev_ptr(&gpu, &gud) + (off * 4) as u64, n, k).unwrap();
        let got = gpu.download(&gud).unwrap();
        for r in 0..n {
            let base = off + r * 2 * k;
            for c in 0..k {
                let (g, u) = (gu[base + c] as f64, gu[base + k + c] as f64);
                let want = g / (1.0 + (-g).exp()) * u;
                let v = got[base + c] as f64;
                assert!(
                    (v - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{what}: silu ({r}, {c}) {v} against {want}"
                );
                assert_eq!(got[base + k + c], gu[base + k + c], "{what}: up changed");
            }
        }
        assert_eq!(got[..off], gu[..off], "{what}: silu wrote before the rows");
        assert_eq!(got[off + n * 2 * k..], gu[off + n * 2 * k..], "{what}: silu wrote past");

        // Zeroing n rows of k, ld apart: nothing between or around them changes.
        let yd = gpu.upload(&x).unwrap();
        zero_rows(&gpu, dev_ptr(&gpu, &yd) + (off * 4) as u64, ld, n, k).unwrap();
        let got = gpu.download(&yd).unwrap();
        for (i, (&g, &orig)) in got.iter().zip(&x).enumerate() {
            let in_row = i >= off && (i - off) / ld < n && (i - off) % ld < k;
            assert_eq!(g, if in_row { 0.0 } else { orig }, "{what}: zero at {i}");
        }

        // The embedding gather: tokens repeat and come in any order.
        let vocab = 5;
        let table: Vec<u16> = rng.vec(vocab * k, 2.0).iter().map(|&v| f16_bits(v)).collect();
        let tokens: Vec<i32> = (0..n).map(|r| ((r * 3 + 2) % vocab) as i32).collect();
        let (td, tokd) = (gpu.upload(&table).unwrap(), gpu.upload(&tokens).unwrap());
        let out = gpu.poisoned_f32(off + n * k + 4).unwrap();
        let o0 = dev_ptr(&gpu, &out) + (off * 4) as u64;
        embed_rows(&gpu, dev_ptr(&gpu, &td), dev_ptr(&gpu, &tokd), o0, n, k).unwrap();
        let got = gpu.download(&out).unwrap();
        for (r, &tok) in tokens.iter().enumerate() {
            for c in 0..k {
                let want = f16::from_bits(table[tok as usize * k + c]).to_f32();
                assert_eq!(got[off + r * k + c], want, "{what}: embed ({r}, {c})");
            }
        }
        assert!(
            got[off + n * k..].iter().all(|v| v.is_nan()),
            "{what}: embed wrote past"
        );
    }
}

#[test]
fn zero_rows_launch_nothing() {
    let Some(gpu) = gpu_or_skip("zero_rows_launch_nothing") else {
        return;
    };
    let x = vec![1.5f32; 64];
    let xd = gpu.upload(&x).unwrap();
    let p = dev_ptr(&gpu, &xd);
    zero_rows(&gpu, p, 16, 0, 16).unwrap();
    silu_rows(&gpu, p, 0, 16).unwrap();
    rmsnorm_rows(&gpu, p, p, p, 0, 16, 1e-5).unwrap();
    rows_to_f16(&gpu, p, 16, p, 0, 16, None).unwrap();
    assert_eq!(gpu.download(&xd).unwrap(), x, "a launch over 0 rows wrote");
}
