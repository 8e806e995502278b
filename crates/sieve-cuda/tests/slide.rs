//! The SlideSparse kernels against the CPU: the upload re-layout read back (no GPU needed), the
//! lifting bit for bit, and the product against the f64 product of W with the masked
//! activations rounded to f16 (what the kernel multiplies), within the worst-case error of an
//! f32 sum. (2N-2):2N for N = 2, 3, 4, 8, odd shapes, 1..130 tokens, TEAL thresholds, written and
//! accumulated outputs, every K split. NaN-poisoned outputs and strided rows. The prompts' f16
//! copy bit for bit against the format's decode. Without a GPU each
//! GPU test prints a skip reason and passes, unless `SIEVE_REQUIRE_GPU=1`.

use half::f16;
use sieve_cuda::gpu_or_skip;
use sieve_cuda::slide::{
    f32_sum_error_bound, lifted_rows_reference, reference, GpuSlide, SlideDevice,
};
use sieve_cuda::Gpu;
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::slide::{prune_to_pattern, Slide, SlideOptions};
use sieve_formats::{Threshold, WeightFormat};

/// A random (2N-2):2N matrix: full blocks (exactly 2N-2 nonzeros each) for even seeds, a 60%
/// sparse matrix pruned to the pattern (blocks with fewer nonzeros, placeholder slots) for odd.
fn slide_matrix(m: usize, k: usize, n: usize, seed: u64) -> Slide {
    let w = if seed.is_multiple_of(2) {
        sparse_matrix(
            m,
            k,
            0.0,
            Pattern::NM {
                n: 2 * n - 2,
                m: 2 * n,
            },
            seed,
        )
        .unwrap()
    } else {
        let dense = sparse_matrix(m, k, 0.6, Pattern::Unstructured, seed).unwrap();
        prune_to_pattern(&dense, n).unwrap()
    };
    Slide::encode(&w, &SlideOptions { n }).unwrap()
}

#[test]
fn upload_relayout_is_a_lossless_permutation() {
    for (m, k, n) in [
        (1, 1, 2),
        (17, 30, 3),
        (200, 300, 4),
        (33, 1000, 8),
        (64, 256, 2),
        (100, 97, 5),
    ] {
        let s = slide_matrix(m, k, n, (m * k + n) as u64);
        let d = SlideDevice::new(&s).unwrap();
        let back = d.read_back();
        let what = format!("{m} x {k}, N = {n}");
        assert_eq!(back.miscounted, 0, "{what}: slots not mapped exactly once");
        assert_eq!(
            back.dirty_padding, 0,
            "{what}: padding not +0 under nibble 0x4"
        );
        assert!(
            back.values
                .iter()
                .zip(s.values())
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: values differ after the round trip"
        );
        assert_eq!(back.values.len(), s.values().len(), "{what}");
        assert_eq!(back.metadata, s.metadata(), "{what}: metadata differs");
    }
}

#[test]
fn lifted_reference_matches_the_format_lift() {
    // The device order is the format's lift with each 32-column window permuted.
    let s = slide_matrix(8, 300, 4, 3);
    let x = activations(2 * 310, 5);
    let dev = lifted_rows_reference(&s, &x, 310, 2, None);
    let kp = dev.len() / 2;
    for row in 0..2 {
        let plain = s.lift(&x[row * 310..row * 310 + 300]).unwrap();
        for (k, &v) in plain.iter().enumerate() {
            let at = k / 32 * 32 + sieve_cuda::slide::stored_offset(k % 32);
            assert_eq!(dev[row * kp + at], f16::from_f32(v), "row {row}, k' {k}");
        }
        assert!(
            dev[row * kp + plain.len().next_multiple_of(32)..(row + 1) * kp]
                .iter()
                .all(|v| v.to_bits() == 0)
        );
    }
}

/// One launch on host data, checked: `n` tokens with rows `ldx` / `ldy` apart, the output
/// poisoned with NaN (or holding `base` when accumulating). Returns the worst error over the
/// bound, printing the shape on failure.
#[allow(clippy::too_many_arguments)]
fn check(
    gpu: &Gpu,
    s: &Slide,
    dev: &GpuSlide,
    n: usize,
    threshold_dp: f64,
    accumulate: bool,
    seed: u64,
    what: &str,
) {
    let (m, k) = (s.rows(), s.cols());
    let (ldx, ldy) = (k + 3, m + 5);
    let x = activations(n * ldx, seed);
    let t: Threshold = threshold_for_sparsity(&x[..k], threshold_dp).unwrap();
    let (want, abs) = reference(s, &x, ldx, n, t);
    let base: Vec<f32> = (0..n * ldy)
        .map(|i| {
            if accumulate {
                (i % 7) as f32 - 3.0
            } else {
                f32::NAN
            }
        })
        .collect();
    let xd = gpu.upload(&x).unwrap();
    let yd = gpu.upload(&base).unwrap();
    let lifted = gpu.upload(&vec![0u16; dev.lifted_len(n)]).unwrap();
    let (xp, yp, lp) = (
        sieve_cuda::dev_ptr(gpu, &xd),
        sieve_cuda::dev_ptr(gpu, &yd),
        sieve_cuda::dev_ptr(gpu, &lifted),
    );
    dev.launch_rows(gpu, xp, ldx, n, t, lp, yp, ldy, accumulate)
        .unwrap();
    gpu.synchronize().unwrap();
    let y = gpu.download(&yd).unwrap();
    let splits = dev.k_splits(n).unwrap();
    let terms = dev.lifted_row_len() + splits + 2;
    let mut worst = (0.0f64, 0.0f64, 0usize, 0usize);
    for tok in 0..n {
        for r in 0..m {
            let got = y[tok * ldy + r] as f64;
            let b = if accumulate {
                base[tok * ldy + r] as f64
            } else {
                0.0
            };
            let expect = want[tok * m + r] + b;
            let bound = f32_sum_error_bound(terms, abs[tok * m + r] + b.abs());
            let err = (got - expect).abs();
            assert!(
                err <= bound,
                "{what}: n = {n}, dp {threshold_dp}, accumulate {accumulate}, {splits} K \
                 split(s): y[{tok}][{r}] = {got}, expected {expect}, error {err:e} > bound \
                 {bound:e} (Σ|w·x| = {:e}, {terms} terms)",
                abs[tok * m + r]
            );
            if err > worst.0 {
                worst = (err, bound, tok, r);
            }
        }
        // Past M nothing is written.
        assert!(
            y[tok * ldy + m..(tok + 1) * ldy]
                .iter()
                .zip(&base[tok * ldy + m..(tok + 1) * ldy])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: n = {n}: a write past row M in token {tok}"
        );
    }
    eprintln!(
        "{what}: n = {n}, dp {threshold_dp}, accumulate {accumulate}, {splits} K split(s): max \
         error {:e} (bound there {:e}) at y[{}][{}]",
        worst.0, worst.1, worst.2, worst.3
    );
}

#[test]
fn gpu_slide_lift_matches_the_reference() {
    let Some(gpu) = gpu_or_skip("gpu_slide_lift_matches_the_reference") else {
        return;
    };
    for (m, k, n, tokens) in [(40, 300, 4, 7), (16, 4096, 8, 33), (8, 5, 2, 1)] {
        let s = slide_matrix(m, k, n, 11);
        let dev = GpuSlide::upload(&gpu, &s).unwrap();
        let ldx = k + 1;
        let x = activations(tokens * ldx, 13);
        for dp in [0.0, 0.5] {
            let t = threshold_for_sparsity(&x[..k], dp).unwrap();
            let want = lifted_rows_reference(&s, &x, ldx, tokens, t);
            let xd = gpu.upload(&x).unwrap();
            // Poisoned with f16 NaNs: every element must be written.
            let lifted = gpu
                .upload(&vec![0x7e00u16; dev.lifted_len(tokens)])
                .unwrap();
            dev.lift_rows(
                &gpu,
                sieve_cuda::dev_ptr(&gpu, &xd),
                ldx,
                tokens,
                t,
                sieve_cuda::dev_ptr(&gpu, &lifted),
            )
            .unwrap();
            gpu.synchronize().unwrap();
            let got = gpu.download(&lifted).unwrap();
            let bad = got.iter().zip(&want).position(|(a, b)| *a != b.to_bits());
            assert!(
                bad.is_none(),
                "{m} x {k} N = {n}, {tokens} tokens, dp {dp}: lifted element {bad:?} is {:#06x}, \
                 expected {:#06x}",
                got[bad.unwrap_or(0)],
                want[bad.unwrap_or(0)].to_bits()
            );
        }
    }
}

/// The f16 copy the prompt path multiplies past `DECODE_MIN_TOKENS` (`slide_to_f16_rows`),
/// bit for bit against the format's decode, into an output poisoned with f16 NaNs (the
/// launcher zeroes it first; the K-padding columns must read 0).
#[test]
fn gpu_slide_f16_copy_is_the_format_s_decode() {
    let Some(gpu) = gpu_or_skip("gpu_slide_f16_copy_is_the_format_s_decode") else {
        return;
    };
    for (m, k, n, seed) in [
        (40, 300, 4, 2),
        (100, 97, 5, 3),
        (33, 4096, 8, 4),
        (17, 30, 2, 5),
    ] {
        let s = slide_matrix(m, k, n, seed);
        let dev = GpuSlide::upload(&gpu, &s).unwrap();
        let ld = dev.decoded_ld();
        let out = gpu.upload(&vec![0x7e00u16; m * ld]).unwrap();
        dev.decode_rows_f16(&gpu, sieve_cuda::dev_ptr(&gpu, &out), ld)
            .unwrap();
        gpu.synchronize().unwrap();
        let got = gpu.download(&out).unwrap();
        let want = s.decode();
        for r in 0..m {
            for c in 0..ld {
                let expected = if c < k { want.get(r, c).to_bits() } else { 0 };
                assert_eq!(got[r * ld + c], expected, "{m} x {k} N = {n}: W[{r}][{c}]");
            }
        }
    }
}

#[test]
fn gpu_slide_matches_the_dense_product() {
    let Some(gpu) = gpu_or_skip("gpu_slide_matches_the_dense_product") else {
        return;
    };
    let mut seed = 0;
    for n in [2, 3, 4, 8] {
        for (m, k) in [(200usize, 300usize), (37, 1000), (4096, 4096)] {
            seed += 1;
            let s = slide_matrix(m, k, n, seed);
            let dev = GpuSlide::upload(&gpu, &s).unwrap();
            let what = format!("{}:{} {m} x {k}", 2 * n - 2, 2 * n);
            let tokens: &[usize] = if m * k > 1 << 20 {
                &[1, 8, 33, 130]
            } else {
                &[1, 7, 8, 33, 130]
            };
            for &tok in tokens {
                for (dp, accumulate) in [(0.0, false), (0.5, true), (0.5, false), (0.0, true)] {
                    check(
                        &gpu,
                        &s,
                        &dev,
                        tok,
                        dp,
                        accumulate,
                        seed ^ tok as u64,
                        &what,
                    );
                }
            }
        }
    }
}

#[test]
fn gpu_slide_every_k_split() {
    let Some(gpu) = gpu_or_skip("gpu_slide_every_k_split") else {
        return;
    };
    // K = 2000 at 6:8: K' = 3000 -> 3072, 24 stages; splits that divide it and that do not.
    let s = slide_matrix(300, 2000, 4, 21);
    let mut dev = GpuSlide::upload(&gpu, &s).unwrap();
    for split in [1, 2, 5, 24] {
        dev.split_k = split;
        for (tok, accumulate) in [(1, false), (9, true), (40, false), (65, true)] {
            check(&gpu, &s, &dev, tok, 0.3, accumulate, 99, "6:8 300 x 2000");
        }
    }
}

#[test]
fn gpu_slide_rejects_bad_launches() {
    let Some(gpu) = gpu_or_skip("gpu_slide_rejects_bad_launches") else {
        return;
    };
    let s = slide_matrix(40, 100, 4, 2);
    let mut dev = GpuSlide::upload(&gpu, &s).unwrap();
    let x = gpu.upload(&vec![0f32; 200]).unwrap();
    let y = gpu.upload(&vec![0f32; 80]).unwrap();
    let lifted = gpu.upload(&vec![0u16; dev.lifted_len(2)]).unwrap();
    let (xp, yp, lp) = (
        sieve_cuda::dev_ptr(&gpu, &x),
        sieve_cuda::dev_ptr(&gpu, &y),
        sieve_cuda::dev_ptr(&gpu, &lifted),
    );
    let err = |r: sieve_cuda::Result<()>| r.unwrap_err().to_string();
    assert!(err(dev.launch_rows(&gpu, xp, 100, 0, None, lp, yp, 40, false)).contains("token"));
    assert!(err(dev.launch_rows(&gpu, xp, 99, 2, None, lp, yp, 40, false)).contains("stride"));
    assert!(err(dev.launch_rows(&gpu, xp, 100, 2, None, lp, yp, 39, false)).contains("stride"));
    assert!(err(dev.launch_rows(&gpu, xp, 100, 2, None, lp + 2, yp, 40, false)).contains("align"));
    assert!(dev
        .launch_rows(&gpu, xp, 100, 2, Some(-1.0), lp, yp, 40, false)
        .is_err());
    dev.split_k = 1000;
    assert!(err(dev.launch_rows(&gpu, xp, 100, 2, None, lp, yp, 40, false)).contains("split_k"));
}
