//! SlideSparse through cuSPARSELt against the CPU: f16 against the f64 product of W with the
//! masked activations rounded to f16 (plus the f16 output's rounding), INT8 and FP8 (e4m3)
//! against `eight_bit_reference` (the same per-row and per-token quantization in f64), for
//! 2:4, 6:8 and 14:16, odd shapes, 1..130 tokens, TEAL thresholds, written and accumulated
//! outputs, NaN-poisoned outputs and strided rows; and the dense 8-bit baseline (cuBLASLt) on
//! the expanded matrix against the same reference. Without a GPU each test prints a skip reason
//! and passes, unless `SIEVE_REQUIRE_GPU=1`, which also makes a missing cuSPARSELt a failure.

use sieve_cuda::cusparselt::{CusparseLt, LtPrecision, LtProduct};
use sieve_cuda::dense8::{Dense8, DenseLt8};
use sieve_cuda::slide::{eight_bit_reference, f32_sum_error_bound, reference, Eight};
use sieve_cuda::slide_lt::{quantize_rows, scale_outputs, LtScratch, SlideLt};
use sieve_cuda::{dev_ptr, gpu_or_skip, Gpu};
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::slide::{Slide, SlideOptions};
use sieve_formats::{Threshold, WeightFormat};
use std::sync::Arc;

fn library(gpu: &Gpu, test: &str) -> Option<Arc<CusparseLt>> {
    match CusparseLt::load(gpu) {
        Ok(lt) => {
            eprintln!(
                "{test}: cuSPARSELt {} from {}",
                lt.version,
                lt.path.display()
            );
            Some(lt)
        }
        Err(e) => {
            if std::env::var("SIEVE_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: SIEVE_REQUIRE_GPU=1 but cuSPARSELt did not load: {e}");
            }
            eprintln!("{test}: skipped, no cuSPARSELt: {e}");
            None
        }
    }
}

/// The precisions to check, 8-bit first (`SIEVE_LT_PRECISIONS=f16,int8,fp8` picks some): a
/// fault inside the library ends the process's context, so each can run alone.
fn precisions() -> Vec<LtPrecision> {
    let all = [
        ("int8", LtPrecision::Int8),
        ("fp8", LtPrecision::E4m3),
        ("f16", LtPrecision::F16),
    ];
    match std::env::var("SIEVE_LT_PRECISIONS") {
        Ok(list) => all
            .iter()
            .filter(|(name, _)| list.split(',').any(|w| w == *name))
            .map(|&(_, p)| p)
            .collect(),
        Err(_) => all.iter().map(|&(_, p)| p).collect(),
    }
}

fn slide_matrix(m: usize, k: usize, n: usize, seed: u64) -> Slide {
    let p = Pattern::NM {
        n: 2 * n - 2,
        m: 2 * n,
    };
    Slide::encode(
        &sparse_matrix(m, k, 0.0, p, seed).unwrap(),
        &SlideOptions { n },
    )
    .unwrap()
}

/// What a product must equal per output `[token][row]`, and how far it may be from it.
struct Want {
    y: Vec<f64>,
    bound: Vec<f64>,
}

fn want(s: &Slide, x: &[f32], ldx: usize, n: usize, t: Threshold, p: LtPrecision) -> Want {
    match p {
        LtPrecision::F16 => {
            let (y, abs) = reference(s, x, ldx, n, t);
            let terms = s.expanded_cols() + 2;
            // f32 sums, then the library's f16 output: half an f16 ulp of the result.
            let bound = y
                .iter()
                .zip(&abs)
                .map(|(v, a)| f32_sum_error_bound(terms, *a) + v.abs() * f64::powi(2.0, -11) + 1e-7)
                .collect();
            Want { y, bound }
        }
        LtPrecision::Int8 | LtPrecision::E4m3 => {
            let eight = if p == LtPrecision::Int8 {
                Eight::Int8
            } else {
                Eight::E4m3
            };
            let y = eight_bit_reference(s, x, ldx, n, t, eight);
            // INT8 sums are exact in i32. The library's sparse FP8 sums keep fewer bits than
            // f32 (window L3, H100, cuSPARSELt 0.8: 2.5e-3 to 3.0e-3 of the largest output on
            // the 7B's shapes, where cuBLASLt's dense FP8 on the same codes is within 1.3e-4):
            // 1e-2 of the token's largest output.
            let rel = if p == LtPrecision::Int8 { 1e-6 } else { 1e-2 };
            let m = s.rows();
            let bound = (0..n * m)
                .map(|i| {
                    let tok = i / m;
                    let top = y[tok * m..(tok + 1) * m]
                        .iter()
                        .fold(0f64, |a, v| a.max(v.abs()));
                    rel * top + 1e-7
                })
                .collect();
            Want { y, bound }
        }
    }
}

fn compare(
    got: &[f32],
    ldy: usize,
    base: &[f32],
    accumulate: bool,
    w: &Want,
    m: usize,
    n: usize,
    what: &str,
) {
    let mut worst = 0f64;
    for tok in 0..n {
        for r in 0..m {
            let g = got[tok * ldy + r] as f64;
            let b = if accumulate {
                base[tok * ldy + r] as f64
            } else {
                0.0
            };
            let e = w.y[tok * m + r] + b;
            let err = (g - e).abs();
            let bound = w.bound[tok * m + r] + b.abs() * 1e-7;
            assert!(
                err <= bound,
                "{what}: y[{tok}][{r}] = {g}, expected {e}, error {err:e} > {bound:e}"
            );
            worst = worst.max(err / bound.max(1e-30));
        }
        // The row stride's gap is never written.
        for r in m..ldy {
            let g = got[tok * ldy + r];
            assert!(
                g.to_bits() == base[tok * ldy + r].to_bits(),
                "{what}: wrote y[{tok}][{r}] past the {m} rows"
            );
        }
    }
    eprintln!("{what}: worst error {worst:.3} of the bound");
}

#[allow(clippy::too_many_arguments)]
fn check(
    gpu: &Gpu,
    s: &Slide,
    dev: &SlideLt,
    p: &LtProduct,
    sc: &LtScratch,
    n: usize,
    dp: f64,
    accumulate: bool,
    seed: u64,
    what: &str,
) {
    let (m, k) = (s.rows(), s.cols());
    let (ldx, ldy) = (k + 3, m + 5);
    let x = activations(n * ldx, seed);
    let t = threshold_for_sparsity(&x[..k], dp).unwrap();
    let w = want(s, &x, ldx, n, t, dev.precision());
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
    dev.launch_rows(
        gpu,
        p,
        sc,
        dev_ptr(gpu, &xd),
        ldx,
        n,
        t,
        dev_ptr(gpu, &yd),
        ldy,
        accumulate,
    )
    .unwrap();
    gpu.synchronize().unwrap();
    let got = gpu.download(&yd).unwrap();
    let what = format!(
        "{what}, {:?} out {:?}, n = {n}, dp {dp}, accumulate {accumulate}",
        dev.precision(),
        p.out
    );
    compare(&got, ldy, &base, accumulate, &w, m, n, &what);
}

#[test]
fn gpu_slide_on_cusparselt_matches_the_references() {
    let test = "gpu_slide_on_cusparselt_matches_the_references";
    let Some(gpu) = gpu_or_skip(test) else { return };
    let Some(lt) = library(&gpu, test) else {
        return;
    };
    let mut seed = 0;
    for precision in precisions() {
        for n in [2, 4, 8] {
            for (m, k) in [(200usize, 300usize), (37, 1000), (1024, 2048)] {
                seed += 1;
                let s = slide_matrix(m, k, n, seed);
                let what = format!("{}:{} {m} x {k}", 2 * n - 2, 2 * n);
                eprintln!("{test}: {precision:?} {what}");
                let dev = SlideLt::upload(&gpu, &lt, &s, precision).unwrap();
                for tok in [1usize, 7, 33, 130] {
                    // One plan per token count, the compressed weights shared.
                    let (p, sc) = dev.plan(&gpu, tok).unwrap();
                    for (dp, accumulate) in [(0.0, false), (0.5, true)] {
                        check(
                            &gpu,
                            &s,
                            &dev,
                            &p,
                            &sc,
                            tok,
                            dp,
                            accumulate,
                            seed ^ tok as u64,
                            &what,
                        );
                    }
                    // A plan serves fewer tokens than it was made for.
                    if tok > 1 {
                        check(&gpu, &s, &dev, &p, &sc, tok - 1, 0.3, false, seed, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_dense_eight_bit_baseline_matches_the_reference() {
    let test = "gpu_dense_eight_bit_baseline_matches_the_reference";
    let Some(gpu) = gpu_or_skip(test) else { return };
    // The lifting of the slide path and cuBLASLt on the expanded matrix W' (dense, 2:4 zeros
    // stored): the same product as the sparse one, so the same reference.
    let Some(lt) = library(&gpu, test) else {
        return;
    };
    for precision in [LtPrecision::Int8, LtPrecision::E4m3] {
        for (m, k, n, tok) in [(256usize, 512usize, 4usize, 16usize), (200, 300, 2, 40)] {
            let s = slide_matrix(m, k, n, 7 + tok as u64);
            let w = s.expanded();
            let (mp, kp, np) = LtProduct::padded(m, w.cols(), tok, precision);
            let (bytes, scales) = quantize_rows(w.data(), m, w.cols(), kp, mp, precision);
            let wd = gpu.upload(&bytes).unwrap();
            let wsd = gpu.upload(&scales).unwrap();
            let dense = DenseLt8::new(&gpu, mp, kp, np, precision).unwrap();
            // The slide path's lifter and scratch of the same shape.
            let sparse = SlideLt::upload(&gpu, &lt, &s, precision).unwrap();
            let (p, sc) = sparse.plan(&gpu, tok).unwrap();
            assert_eq!((p.m, p.k, p.n), (mp, kp, np));
            let ldx = k + 1;
            let x = activations(tok * ldx, 3);
            let t = threshold_for_sparsity(&x[..k], 0.4).unwrap();
            let want = want(&s, &x, ldx, tok, t, precision);
            let xd = gpu.upload(&x).unwrap();
            let yd = gpu.upload(&vec![f32::NAN; tok * m]).unwrap();
            sparse
                .lift(&gpu, dev_ptr(&gpu, &xd), ldx, tok, t, &sc)
                .unwrap();
            dense
                .run(
                    &gpu,
                    dev_ptr(&gpu, &wd),
                    dev_ptr(&gpu, &sc.codes),
                    dev_ptr(&gpu, &sc.acc),
                )
                .unwrap();
            scale_outputs(
                &gpu,
                dense.out,
                dense.alpha,
                &sc,
                mp,
                m,
                tok,
                Some(&wsd),
                dev_ptr(&gpu, &yd),
                m,
                false,
            )
            .unwrap();
            gpu.synchronize().unwrap();
            let got = gpu.download(&yd).unwrap();
            let base = vec![f32::NAN; tok * m];
            let what = format!(
                "dense {precision:?} out {:?} {m} x {k}, n = {tok}",
                dense.out
            );
            compare(&got, m, &base, false, &want, m, tok, &what);
        }
    }
}

/// The model's W8A8 prompt products (`Dense8`: codes made on upload, the lifter, cuBLASLt, the
/// scaling, into caller-owned scratch): the slide matrix's decoded values (zeros stored) give
/// the same per-row maxima, so `eight_bit_reference` of the slide is their product too. Odd
/// shapes, strided rows, a threshold, written and accumulated outputs, fewer tokens than the
/// plan; cuBLASLt only (no cuSPARSELt needed).
#[test]
fn gpu_dense8_prompt_products_match_the_reference() {
    let test = "gpu_dense8_prompt_products_match_the_reference";
    let Some(gpu) = gpu_or_skip(test) else { return };
    for precision in [LtPrecision::Int8, LtPrecision::E4m3] {
        for (m, k, tok, accumulate) in [(200usize, 300usize, 37usize, false), (64, 512, 64, true)] {
            let s = slide_matrix(m, k, 4, 11 + tok as u64);
            let values = s.decode();
            let dense = Dense8::upload(&gpu, values.data(), m, k, precision).unwrap();
            let (mp, kp) = dense.plan_shape();
            let np = tok.next_multiple_of(32);
            let plan = dense.plan(&gpu, np).unwrap();
            let codes = gpu.alloc_bytes(np * kp).unwrap();
            let acc = gpu.alloc_bytes(np * mp * 4).unwrap();
            let scales = gpu.upload(&vec![0f32; np]).unwrap();
            let (ldx, ldy) = (k + 3, m + 5);
            let x = activations(tok * ldx, 5);
            let t = threshold_for_sparsity(&x[..k], 0.3).unwrap();
            let want = want(&s, &x, ldx, tok, t, precision);
            let base: Vec<f32> = (0..tok * ldy).map(|i| (i % 7) as f32 - 3.0).collect();
            let xd = gpu.upload(&x).unwrap();
            let yd = gpu.upload(&base).unwrap();
            dense
                .launch_rows_to(
                    &gpu,
                    &plan,
                    dev_ptr(&gpu, &codes),
                    dev_ptr(&gpu, &acc),
                    dev_ptr(&gpu, &scales),
                    dev_ptr(&gpu, &xd),
                    ldx,
                    tok,
                    t,
                    dev_ptr(&gpu, &yd),
                    ldy,
                    accumulate,
                )
                .unwrap();
            gpu.synchronize().unwrap();
            let got = gpu.download(&yd).unwrap();
            let what =
                format!("Dense8 {precision:?} {m} x {k}, n = {tok}, accumulate {accumulate}");
            compare(&got, ldy, &base, accumulate, &want, m, tok, &what);
            // A plan of another matrix's shape is refused.
            let other = Dense8::upload(
                &gpu,
                &vec![half::f16::ONE; 64 * (kp + 64)],
                64,
                kp + 64,
                precision,
            )
            .unwrap();
            let p2 = other.plan(&gpu, np).unwrap();
            let e = dense
                .launch_rows_to(
                    &gpu,
                    &p2,
                    0,
                    0,
                    0,
                    dev_ptr(&gpu, &xd),
                    ldx,
                    tok,
                    t,
                    dev_ptr(&gpu, &yd),
                    ldy,
                    false,
                )
                .unwrap_err()
                .to_string();
            assert!(e.contains("plan"), "{what}: {e}");
        }
    }
    assert!(Dense8::upload(&gpu, &[half::f16::ONE; 4], 2, 2, LtPrecision::F16).is_err());
    assert!(Dense8::upload(&gpu, &[half::f16::ONE; 3], 2, 2, LtPrecision::Int8).is_err());
}

#[test]
fn gpu_slide_on_cusparselt_rejects_bad_launches() {
    let test = "gpu_slide_on_cusparselt_rejects_bad_launches";
    let Some(gpu) = gpu_or_skip(test) else { return };
    let Some(lt) = library(&gpu, test) else {
        return;
    };
    let s = slide_matrix(64, 128, 4, 1);
    let dev = SlideLt::upload(&gpu, &lt, &s, LtPrecision::Int8).unwrap();
    let (p, sc) = dev.plan(&gpu, 8).unwrap();
    let x = gpu.upload(&vec![1f32; 64 * 128]).unwrap();
    let y = gpu.upload(&vec![0f32; 64 * 64]).unwrap();
    let (xp, yp) = (dev_ptr(&gpu, &x), dev_ptr(&gpu, &y));
    // More tokens than the plan, a short row stride, a bad threshold, unpadded sizes.
    assert!(dev
        .launch_rows(&gpu, &p, &sc, xp, 128, 40, None, yp, 64, false)
        .is_err());
    assert!(dev
        .launch_rows(&gpu, &p, &sc, xp, 100, 4, None, yp, 64, false)
        .is_err());
    assert!(dev
        .launch_rows(&gpu, &p, &sc, xp, 128, 4, Some(f32::NAN), yp, 64, false)
        .is_err());
    assert!(dev
        .launch_rows(&gpu, &p, &sc, xp, 128, 4, None, yp, 10, false)
        .is_err());
    assert!(LtProduct::new(&gpu, &lt, 100, 128, 32, LtPrecision::Int8).is_err());
    // A plan of another matrix.
    let other =
        SlideLt::upload(&gpu, &lt, &slide_matrix(128, 128, 4, 2), LtPrecision::Int8).unwrap();
    let (q, qs) = other.plan(&gpu, 8).unwrap();
    assert!(dev.multiply(&gpu, &q, &qs).is_err());
    gpu.synchronize().unwrap();
}
