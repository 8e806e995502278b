use super::*;
use proptest::prelude::*;
use sieve_formats::ie_bme::{IeBmeOptions, Reorder};
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};

fn encode(rows: usize, cols: usize, sp: f64, group_size: usize, seed: u64) -> IeBme {
    let w = sparse_matrix(rows, cols, sp, Pattern::Unstructured, seed).unwrap();
    let opts = IeBmeOptions {
        payload: Payload::Int4 { group_size },
        reorder: if seed.is_multiple_of(2) {
            Reorder::Greedy
        } else {
            Reorder::Off
        },
        ..IeBmeOptions::default()
    };
    IeBme::encode(&w, &opts).unwrap()
}

fn masked(x: &[f32], t: Threshold) -> Vec<f32> {
    x.iter()
        .map(|&v| if is_active(v, t) { v } else { 0.0 })
        .collect()
}

/// For one token: (f64 `W · mask_t(x)` over the dequantized weights, the bound of the 8-bit
/// activation error — the one the Q4_1 tests use: half a quantization step per weight, plus
/// 1e-5 of the magnitude for f32 sums —, and the f64 product over the *quantized* activations,
/// which the integer kernels must match to f32 rounding).
fn reference(w: &DenseMatrix, x: &[f32], t: Threshold) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (m, k) = (w.rows(), w.cols());
    let kp = k.div_ceil(COLS) * COLS;
    let mut xm = masked(x, t);
    xm.resize(kp, 0.0);
    let steps: Vec<f64> = xm
        .chunks(BLOCK)
        .map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0)
        .collect();
    let mut q = Q8Activations::default();
    q.quantize(&xm);
    let mut xq = vec![0f32; kp];
    q.dequantize_into(&mut xq);
    let (mut want, mut bound, mut exact) = (vec![], vec![], vec![]);
    for r in 0..m {
        let (mut s, mut sq, mut quant, mut mag) = (0f64, 0f64, 0f64, 0f64);
        for (i, wv) in w.row(r).iter().enumerate() {
            let wi = wv.to_f64();
            s += wi * xm[i] as f64;
            sq += wi * xq[i] as f64;
            quant += steps[i / BLOCK] / 2.0 * wi.abs();
            mag += (wi * xm[i] as f64).abs() + (wi * xq[i] as f64).abs();
        }
        want.push(s);
        bound.push(quant * (1.0 + 1e-5) + 1e-5 * mag + 1e-30);
        exact.push(sq);
    }
    (want, bound, exact)
}

fn slack(w: &DenseMatrix, x: &[f32], r: usize) -> f64 {
    let mag: f64 = w
        .row(r)
        .iter()
        .zip(x)
        .map(|(a, b)| (a.to_f64() * *b as f64).abs())
        .sum();
    1e-5 * 2.0 * mag + 1e-30
}

fn check(rows: usize, cols: usize, sp: f64, dp: f64, tokens: usize, gs: usize, seed: u64) {
    let ie = encode(rows, cols, sp, gs, seed);
    let dense = ie.decode();
    let fast = Int4IeBme::new(ie.clone()).unwrap();
    let x = activations(cols * tokens, seed ^ 7);
    let t = threshold_for_sparsity(&x, dp).unwrap();
    let refs: Vec<_> = x
        .chunks(cols.max(1))
        .take(tokens)
        .map(|xt| reference(&dense, xt, t))
        .collect();
    for level in SimdLevel::available() {
        let mut y = vec![f32::NAN; rows];
        fast.matvec_with(level, &x[..cols], t, &mut y).unwrap();
        let (want, bound, exact) = &refs[0];
        for r in 0..rows {
            let got = y[r] as f64;
            assert!(
                (got - want[r]).abs() <= bound[r],
                "{level:?} {rows}x{cols} sp {sp} dp {dp} row {r}: {got} vs {} (bound {})",
                want[r],
                bound[r]
            );
            let s = slack(&dense, &x[..cols], r) + 1e-6 * bound[r];
            assert!(
                (got - exact[r]).abs() <= s,
                "{level:?} {rows}x{cols} row {r}: {got} vs quantized-x product {}",
                exact[r]
            );
        }
        let mut ym = vec![f32::NAN; rows * tokens];
        fast.matmul_with(level, &x, tokens, t, &mut ym).unwrap();
        for (tok, xt) in x.chunks(cols.max(1)).take(tokens).enumerate() {
            let mut yv = vec![f32::NAN; rows];
            fast.matvec_with(level, xt, t, &mut yv).unwrap();
            assert_eq!(
                &ym[tok * rows..(tok + 1) * rows],
                &yv[..],
                "{level:?} token {tok}"
            );
        }
    }
}

#[test]
fn every_level_matches_the_f64_reference_within_the_8_bit_activation_bound() {
    for &(m, k) in &[
        (1, 1),
        (7, 13),
        (16, 64),
        (17, 65),
        (33, 130),
        (96, 576),
        (5, 200),
        (64, 129),
    ] {
        for (i, &sp) in [0.0, 0.5, 0.9, 0.99].iter().enumerate() {
            for (j, &dp) in [0.0, 0.5, 0.95].iter().enumerate() {
                let tokens = [1, 3, 9][(i + j) % 3];
                let gs = if (i + j) % 2 == 0 { 64 } else { 128 };
                check(m, k, sp, dp, tokens, gs, (m * 1000 + k + i * 7 + j) as u64);
            }
        }
    }
}

#[test]
fn the_layer_keeps_the_ie_bme_blob_and_decodes_to_it() {
    let ie = encode(40, 300, 0.5, 128, 3);
    let fast = Int4IeBme::new(ie.clone()).unwrap();
    assert_eq!(fast.to_bytes(), ie.to_bytes());
    assert_eq!(fast.decode(), ie.decode());
    assert_eq!(fast.kind(), FormatKind::IeBme);
    assert_eq!((fast.rows(), fast.cols()), (40, 300));
    // The CPU layout stores only the nonzero codes: at most half a byte each (+ odd padding).
    let nnz = ie.decode().nnz();
    assert!(fast.codes.len() - 32 <= nnz.div_ceil(2) + fast.masks.len());
    assert!(fast.codes.len() - 32 >= nnz.div_ceil(2));
}

#[test]
fn non_int4_payloads_and_bad_arguments_are_errors() {
    let w = sparse_matrix(16, 64, 0.5, Pattern::Unstructured, 1).unwrap();
    for payload in [Payload::F16, Payload::Int8 { group_size: 64 }] {
        let opts = IeBmeOptions {
            payload,
            reorder: Reorder::Off,
            ..IeBmeOptions::default()
        };
        let err = Int4IeBme::new(IeBme::encode(&w, &opts).unwrap()).unwrap_err();
        assert!(err.to_string().contains("not INT4"), "{err}");
    }
    let fast = Int4IeBme::new(encode(16, 64, 0.5, 64, 2)).unwrap();
    let mut y = vec![0f32; 16];
    assert!(fast.matvec(&[0.0; 63], None, &mut y).is_err());
    assert!(fast.matvec(&[0.0; 64], None, &mut y[..15]).is_err());
    assert!(fast.matvec(&[0.0; 64], Some(f32::NAN), &mut y).is_err());
    let mut ym = vec![0f32; 32];
    assert!(fast.matmul(&[0.0; 127], 2, None, &mut ym).is_err());
}

#[test]
fn non_finite_activations_reach_the_rows_that_use_them() {
    let ie = encode(16, 128, 0.0, 64, 4);
    let fast = Int4IeBme::new(ie).unwrap();
    let mut x = activations(128, 9);
    x[70] = f32::INFINITY;
    for level in SimdLevel::available() {
        let mut y = vec![0f32; 16];
        fast.matvec_with(level, &x, None, &mut y).unwrap();
        assert!(y.iter().all(|v| v.is_nan()), "{level:?} {y:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_shapes_match_the_reference(
        rows in 1usize..40,
        cols in 1usize..300,
        sp in 0.0f64..1.0,
        dp in 0.0f64..1.0,
        tokens in 1usize..5,
        wide in any::<bool>(),
        seed in any::<u64>(),
    ) {
        check(rows, cols, sp, dp, tokens, if wide { 128 } else { 64 }, seed);
    }
}

#[test]
fn a_group_equals_one_product_per_matrix_and_checks_its_shapes() {
    // q/k/v-like: different row counts (one not a multiple of the kernel's 4 rows), shared K.
    let mats: Vec<Int4IeBme> = [(37, 0.5, 64), (12, 0.7, 128), (5, 0.3, 64)]
        .iter()
        .enumerate()
        .map(|(i, &(rows, sp, gs))| {
            Int4IeBme::new(encode(rows, 200, sp, gs, 40 + i as u64)).unwrap()
        })
        .collect();
    let refs: Vec<&Int4IeBme> = mats.iter().collect();
    let x = activations(200, 41);
    for t in [None, threshold_for_sparsity(&x, 0.5).unwrap()] {
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; m.rows()]).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
        matvec_group(&refs, &x, t, &mut outs).unwrap();
        for (m, y) in mats.iter().zip(&ys) {
            let mut want = vec![f32::NAN; m.rows()];
            m.matvec(&x, t, &mut want).unwrap();
            assert_eq!(y, &want, "threshold {t:?}");
        }
    }
    let mut short = vec![0f32; 36];
    let mut y1 = vec![0f32; 12];
    let mut y2 = vec![0f32; 5];
    assert!(matvec_group(&refs, &x, None, &mut [&mut short, &mut y1, &mut y2]).is_err());
    assert!(matvec_group(&refs, &x, None, &mut [&mut y1, &mut y2]).is_err());
    assert!(matvec_group(&refs, &x[..199], None, &mut [&mut short, &mut y1, &mut y2]).is_err());
}
