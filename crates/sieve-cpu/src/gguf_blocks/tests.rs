use super::*;
use crate::gguf_blocks::dequant::dequantize;
use proptest::prelude::*;
use sieve_formats::registry;

const TYPES: [BlockType; 3] = [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0];
/// The types of `offset_blocks`.
const OFFSET_TYPES: [BlockType; 5] = [
    BlockType::Q5_0,
    BlockType::Q5_1,
    BlockType::Q4_K,
    BlockType::Q5_K,
    BlockType::Q6_K,
];

use super::test_blocks::{f16_fields, quant_bytes, random_blocks, random_x, Lcg};

fn random_matrix(ty: BlockType, rows: usize, cols: usize, seed: u64) -> QuantMatrix {
    QuantMatrix::new(ty, rows, cols, random_blocks(ty, rows, cols, seed)).unwrap()
}

fn reference_weights(w: &QuantMatrix) -> Vec<f32> {
    dequantize(w.block_type().ggml(), w.blocks(), w.rows * w.cols).unwrap()
}

/// f64 `W · x` over the f32 dequantized weights, and the bound on how far the 8-bit activations
/// may move it: rounding moves each x by at most half its block's step `dx / 2`, so output r
/// moves by at most `Σ_b (dx_b / 2) Σ_{i in b} |w_ri|`. Plus f32 summation slack relative to
/// `Σ |w x|`.
fn reference_with_bound(w: &QuantMatrix, x: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let wf = reference_weights(w);
    let k = w.cols;
    let steps: Vec<f64> = x
        .chunks_exact(BLOCK)
        .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0)
        .collect();
    let mut y = Vec::new();
    let mut bound = Vec::new();
    for r in 0..w.rows {
        let row = &wf[r * k..(r + 1) * k];
        let (mut s, mut quant, mut mag) = (0f64, 0f64, 0f64);
        for (i, (&wi, &xi)) in row.iter().zip(x).enumerate() {
            s += wi as f64 * xi as f64;
            quant += steps[i / BLOCK] / 2.0 * (wi as f64).abs();
            mag += (wi as f64 * xi as f64).abs();
        }
        y.push(s);
        bound.push(quant * (1.0 + 1e-5) + 1e-5 * mag + 1e-30);
    }
    (y, bound)
}

#[test]
fn rows_dequantize_exactly_like_the_gguf_reader() {
    for ty in TYPES {
        let w = random_matrix(ty, 5, 96, 3);
        let want = reference_weights(&w);
        let mut row = vec![0f32; 96];
        for r in 0..5 {
            w.dequantize_row(r, &mut row);
            assert_eq!(row, want[r * 96..(r + 1) * 96], "{ty:?} row {r}");
            row.fill(f32::NAN);
            w.dequantize_row_portable(r, &mut row);
            assert_eq!(row, want[r * 96..(r + 1) * 96], "{ty:?} row {r}");
        }
        let decoded = w.decode();
        let want16: Vec<f16> = want.iter().map(|&v| f16::from_f32(v)).collect();
        assert_eq!(decoded.data(), &want16[..]);
    }
}

#[test]
fn matvec_is_within_the_activation_quantization_bound() {
    for ty in TYPES {
        for &(m, k) in &[(1, 32), (7, 64), (70, 576), (33, 1536)] {
            let w = random_matrix(ty, m, k, (m * k) as u64);
            let x = random_x(k, m as u64 + 7);
            let mut y = vec![f32::NAN; m];
            w.matvec(&x, None, &mut y).unwrap();
            let (want, bound) = reference_with_bound(&w, &x);
            for r in 0..m {
                let err = (y[r] as f64 - want[r]).abs();
                assert!(
                    err <= bound[r],
                    "{ty:?} {m}x{k} row {r}: {} vs {} (err {err}, bound {})",
                    y[r],
                    want[r],
                    bound[r]
                );
            }
        }
    }
}

#[test]
fn matvec_equals_f32_products_with_the_quantized_activations() {
    // With x replaced by exactly the values its 8-bit blocks stand for, only f32 rounding
    // separates the integer path from an f64 product.
    for ty in TYPES {
        let (m, k) = (40, 320);
        let w = random_matrix(ty, m, k, 11);
        let x = random_x(k, 12);
        let mut q = Q8Activations::default();
        q.quantize(&x);
        let mut xhat = vec![0f32; k];
        q.dequantize_into(&mut xhat);
        let wf = reference_weights(&w);
        let mut y = vec![0f32; m];
        w.matvec(&x, None, &mut y).unwrap();
        for r in 0..m {
            let row = &wf[r * k..(r + 1) * k];
            let want: f64 = row
                .iter()
                .zip(&xhat)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            let mag: f64 = row
                .iter()
                .zip(&xhat)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            assert!(
                (y[r] as f64 - want).abs() <= 2e-6 * mag + 1e-30,
                "{ty:?} row {r}: {} vs {want}",
                y[r]
            );
            // The portable path gives the same up to f32 summation order.
            let portable = dot_row_portable(ty, w.row(r), &q);
            assert!((portable as f64 - want).abs() <= 2e-6 * mag + 1e-30);
        }
    }
}

#[test]
fn the_simd_quantizer_matches_the_portable_one_bit_for_bit() {
    let mut x = random_x(32 * 40, 5);
    // Exact ties (x / d = k + 0.5) round to even in both.
    x[0] = 127.0;
    x[1] = 0.5;
    x[2] = 1.5;
    x[3] = -2.5;
    // An all-zero block and a block of values too small to invert the scale of.
    x[32..64].fill(0.0);
    x[64..96].fill(1e-38);
    let mut q = Q8Activations::default();
    q.quantize(&x);
    let mut quants = vec![0i8; 32];
    for b in 0..40 {
        let (d, s) = quantize_block_portable(&x[b * 32..(b + 1) * 32], &mut quants);
        assert_eq!(q.scales[b].to_bits(), d.to_bits(), "block {b}");
        assert_eq!(q.sums[b].to_bits(), s.to_bits(), "block {b}");
        assert_eq!(&q.quants[b * 32..(b + 1) * 32], &quants[..], "block {b}");
    }
    assert_eq!(&q.quants[..4], &[127, 0, 2, -2]);
    assert!(q.quants[32..96].iter().all(|&v| v == 0));
}

#[test]
fn non_finite_activations_propagate() {
    let w = random_matrix(BlockType::Q4_1, 3, 64, 1);
    for bad in [f32::NAN, f32::INFINITY] {
        let mut x = random_x(64, 2);
        x[40] = bad;
        let mut y = [0f32; 3];
        w.matvec(&x, None, &mut y).unwrap();
        assert!(y.iter().all(|v| v.is_nan()), "{y:?}");
    }
}

#[test]
fn matmul_rows_agree_with_matvec_and_thresholds_apply() {
    for ty in TYPES {
        let (m, k, n) = (37, 96, SMALL_BATCH + 3);
        let w = random_matrix(ty, m, k, 21);
        let x = random_x(n * k, 22);
        for t in [None, Some(0.3f32)] {
            let mut y = vec![f32::NAN; n * m];
            w.matmul(&x, n, t, &mut y).unwrap();
            for tok in 0..n {
                let mut yv = vec![0f32; m];
                w.matvec(&x[tok * k..(tok + 1) * k], t, &mut yv).unwrap();
                for r in 0..m {
                    let (a, b) = (y[tok * m + r], yv[r]);
                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{ty:?} {a} vs {b}");
                }
            }
            // Small batches run the matvec kernel itself: bit-identical.
            let small = SMALL_BATCH.min(3);
            let mut ys = vec![f32::NAN; small * m];
            w.matmul(&x[..small * k], small, t, &mut ys).unwrap();
            for tok in 0..small {
                let mut yv = vec![0f32; m];
                w.matvec(&x[tok * k..(tok + 1) * k], t, &mut yv).unwrap();
                assert_eq!(&ys[tok * m..(tok + 1) * m], &yv[..]);
            }
        }
        // The threshold is the same as zeroing the inactive inputs.
        let mut masked = x[..k].to_vec();
        masked.iter_mut().for_each(|v| {
            if v.abs() <= 0.3 {
                *v = 0.0
            }
        });
        let (mut a, mut b) = (vec![0f32; m], vec![0f32; m]);
        w.matvec(&x[..k], Some(0.3), &mut a).unwrap();
        w.matvec(&masked, None, &mut b).unwrap();
        assert_eq!(a, b);
    }
}

#[test]
fn bad_blocks_and_shapes_are_refused() {
    let good = random_blocks(BlockType::Q4_1, 2, 64, 1);
    assert!(QuantMatrix::new(BlockType::Q4_1, 2, 64, good.clone()).is_ok());
    assert!(QuantMatrix::new(BlockType::Q4_1, 2, 60, good.clone()).is_err());
    assert!(QuantMatrix::new(BlockType::Q4_1, 0, 64, vec![]).is_err());
    assert!(QuantMatrix::new(BlockType::Q4_1, 2, 64, good[..79].to_vec()).is_err());
    assert!(QuantMatrix::new(BlockType::Q8_0, 2, 64, good.clone()).is_err());
    for bad_scale in [f16::NAN, f16::INFINITY, f16::from_f32(60000.0)] {
        let mut b = good.clone();
        b[20..22].copy_from_slice(&bad_scale.to_bits().to_le_bytes());
        assert!(QuantMatrix::new(BlockType::Q4_1, 2, 64, b).is_err());
    }
    // An offset alone can push Q4_1 weights out of the f16 range.
    let mut b = good;
    b[0..2].copy_from_slice(&f16::from_f32(0.01).to_bits().to_le_bytes());
    b[2..4].copy_from_slice(&f16::from_f32(-65504.0).to_bits().to_le_bytes());
    assert!(QuantMatrix::new(BlockType::Q4_1, 2, 64, b).is_err());
    let w = random_matrix(BlockType::Q8_0, 2, 64, 3);
    let mut y = [0f32; 2];
    assert!(w.matvec(&[0.0; 63], None, &mut y).is_err());
    assert!(w.matvec(&[0.0; 64], Some(f32::NAN), &mut y).is_err());
    assert!(w.matmul(&[0.0; 64], 2, None, &mut [0f32; 4]).is_err());
}

#[test]
fn storage_counts_the_blocks() {
    let w = random_matrix(BlockType::Q4_1, 3, 64, 1);
    let s = w.storage();
    assert_eq!(s.total_bytes(), 3 * 2 * 20);
    assert_eq!(s.metadata_bytes, 3 * 2 * 4);
}

/// A value at a tie of `v / d` (d = 78.074974, v = -7924.6094 ≈ -101.5 d): the rounded
/// `1 / d` and the product `d · q` put it just over half a step from the original (the case
/// that made `activation_blocks_round_trip` fail), but within a few ulp of it.
#[test]
fn activation_rounding_at_a_tie_stays_within_a_few_ulp_of_half_a_step() {
    let (amax, v) = (9915.521f32, -7924.6094f32);
    let mut x = [0f32; BLOCK];
    x[0] = amax;
    x[1] = v;
    let mut q = Q8Activations::default();
    q.quantize(&x);
    let d = q.scales[0];
    assert_eq!(d, 78.074974);
    let mut back = [0f32; BLOCK];
    q.dequantize_into(&mut back);
    let err = (v - back[1]).abs();
    assert!(
        err > d * 0.5 * (1.0 + 1e-5),
        "no longer over half a step: {err}"
    );
    assert!(err <= d * 0.5 * (1.0 + 1e-5) + 4.0 * f32::EPSILON * v.abs().max(back[1].abs()));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The activation blocks: each value within half a step of the original, quants in range,
    /// sums consistent, the largest magnitude of each block kept exactly (up to f32 rounding).
    #[test]
    fn activation_blocks_round_trip(
        x in proptest::collection::vec(-1e4f32..1e4, 1..6usize)
            .prop_flat_map(|v| proptest::collection::vec(-1e4f32..1e4, v.len() * BLOCK))
    ) {
        let mut q = Q8Activations::default();
        q.quantize(&x);
        let mut back = vec![0f32; x.len()];
        q.dequantize_into(&mut back);
        for (b, block) in x.chunks_exact(BLOCK).enumerate() {
            let d = q.scales[b];
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            prop_assert!((d - amax / 127.0).abs() <= f32::EPSILON * d);
            let qs = &q.quants[b * BLOCK..(b + 1) * BLOCK];
            prop_assert!(qs.iter().all(|&v| v != i8::MIN));
            let sum: i32 = qs.iter().map(|&v| v as i32).sum();
            prop_assert_eq!(q.sums[b], d * sum as f32);
            for i in 0..BLOCK {
                let (orig, got) = (block[i], back[b * BLOCK + i]);
                // q = round(v · fl(1/d)) and d · q each round once more: a few ulp of the value.
                let slack = 4.0 * f32::EPSILON * orig.abs().max(got.abs());
                prop_assert!((orig - got).abs() <= d * 0.5 * (1.0 + 1e-5) + slack, "{} vs {}", orig, got);
            }
        }
    }

    /// Random blocks of any type survive the `.sieve` blob as their f16 decode, and the
    /// matrix-vector product stays within the quantization bound.
    #[test]
    fn random_blocks_serialize_and_multiply(
        ty in prop::sample::select(TYPES.to_vec()),
        rows in 1usize..9,
        blocks_per_row in 1usize..5,
        seed in any::<u64>(),
    ) {
        let cols = blocks_per_row * BLOCK;
        let w = random_matrix(ty, rows, cols, seed);
        let back = registry::from_bytes(&w.to_bytes()).unwrap();
        prop_assert_eq!(back.decode(), w.decode());
        let x = random_x(cols, seed ^ 0x5eed);
        let mut y = vec![0f32; rows];
        w.matvec(&x, None, &mut y).unwrap();
        let (want, bound) = reference_with_bound(&w, &x);
        for r in 0..rows {
            prop_assert!((y[r] as f64 - want[r]).abs() <= bound[r]);
        }
    }
}
#[test]
fn q8_0_quantization_recovers_the_quants_of_a_dequantized_q8_0_matrix() {
    // Blocks as llama.cpp writes them (max |q| = 127), dequantized to f16 like a pack's head.
    let (rows, cols) = (3, 64);
    let mut bytes = Vec::new();
    let mut rng = Lcg(7);
    for b in 0..rows * cols / BLOCK {
        let d = f16::from_f32(0.001 + 0.0007 * b as f32);
        bytes.extend_from_slice(&d.to_bits().to_le_bytes());
        for j in 0..BLOCK {
            let q = if j == 5 {
                127
            } else {
                (rng.next_u32() % 255) as i32 - 127
            };
            bytes.push(q as i8 as u8);
        }
    }
    let original = QuantMatrix::new(BlockType::Q8_0, rows, cols, bytes).unwrap();
    let f16s: Vec<f16> = original.decode().data().to_vec();
    let again = QuantMatrix::quantize_q8_0(rows, cols, &f16s).unwrap();
    for b in 0..rows * cols / BLOCK {
        let x = &original.blocks()[b * 34..(b + 1) * 34];
        let y = &again.blocks()[b * 34..(b + 1) * 34];
        assert_eq!(x[2..], y[2..], "block {b}: quants");
        let (dx, dy) = (read_f16(x, 0), read_f16(y, 0));
        assert!(
            (dx - dy).abs() <= dx * 2e-3,
            "block {b}: scale {dx} vs {dy}"
        );
    }
    assert!(QuantMatrix::quantize_q8_0(2, 48, &[f16::ZERO; 96]).is_err());
    assert!(QuantMatrix::quantize_q8_0(2, 64, &[f16::ZERO; 100]).is_err());
    let zeros = QuantMatrix::quantize_q8_0(1, 32, &[f16::ZERO; 32]).unwrap();
    assert!(zeros.decode().data().iter().all(|v| v.to_f32() == 0.0));
}

#[test]
fn q4_1_quantization_is_within_half_a_step_and_multiplies_as_q4_1() {
    let (rows, cols) = (5, 96);
    let mut rng = Lcg(11);
    let w: Vec<f16> = (0..rows * cols)
        .map(|i| {
            let v = (rng.next_u32() % 2001) as f32 / 1000.0 - 1.0;
            // Blocks of very different ranges, one constant block.
            if i / BLOCK == 3 {
                f16::from_f32(0.25)
            } else {
                f16::from_f32(v * (1 + i / BLOCK) as f32 * 0.01)
            }
        })
        .collect();
    let q = QuantMatrix::quantize_q4_1(rows, cols, &w).unwrap();
    assert_eq!(q.block_type(), BlockType::Q4_1);
    assert_eq!(q.blocks().len(), rows * cols / BLOCK * 20);
    let back = q.decode();
    for (b, (orig, got)) in w.chunks(BLOCK).zip(back.data().chunks(BLOCK)).enumerate() {
        let d = read_f16(&q.blocks()[b * 20..], 0);
        for (o, g) in orig.iter().zip(got) {
            // Half a step, plus the f16 rounding of d, m and the result.
            let tol = d / 2.0 + 16.0 * d * 1e-3 + o.to_f32().abs() * 2e-3 + 1e-6;
            assert!(
                (o.to_f32() - g.to_f32()).abs() <= tol,
                "block {b}: {o} -> {g} (d {d})"
            );
        }
    }
    // The product is the GGUF Q4_1 product of those blocks: against the decoded matrix.
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut y = vec![0f32; rows];
    q.matvec(&x, None, &mut y).unwrap();
    let want = sieve_formats::reference::matvec_f64(&back, &x, None);
    let e = sieve_formats::reference::max_rel_error(&y, &want);
    assert!(e < 2e-2, "error {e} (8-bit activations)");
    assert!(QuantMatrix::quantize_q4_1(2, 48, &[f16::ZERO; 96]).is_err());
    assert!(QuantMatrix::quantize_q4_1(2, 64, &[f16::ZERO; 100]).is_err());
    let mut bad = vec![f16::ZERO; 32];
    bad[3] = f16::INFINITY;
    assert!(QuantMatrix::quantize_q4_1(1, 32, &bad).is_err());
    let zeros = QuantMatrix::quantize_q4_1(1, 32, &[f16::ZERO; 32]).unwrap();
    assert!(zeros.decode().data().iter().all(|v| v.to_f32() == 0.0));
}

/// Per element, `|w| + |offset|`: the magnitudes of the two terms the offset kernels add in f32
/// (the offset being the weight of a zero quant), which bound their rounding.
fn term_magnitudes(w: &QuantMatrix) -> Vec<f32> {
    let ty = w.block_type();
    let mut zeroed = w.blocks().to_vec();
    for blk in zeroed.chunks_exact_mut(ty.block_bytes()) {
        blk[quant_bytes(ty)].fill(0);
    }
    let offsets = dequantize(ty.ggml(), &zeroed, w.rows * w.cols).unwrap();
    reference_weights(w)
        .iter()
        .zip(&offsets)
        .map(|(a, b)| a.abs() + b.abs())
        .collect()
}

/// Every available kernel path on `w · x`, against (1) the f64 product over the dequantized
/// weights and the original `x`, within the 8-bit activation bound, and (2) the f64 product
/// with the activations the 8-bit blocks stand for, within f32 rounding of the kernel's terms.
fn check_offset_paths(w: &QuantMatrix, x: &[f32]) -> std::result::Result<(), String> {
    let (m, k, ty) = (w.rows, w.cols, w.block_type());
    let (want, bound) = reference_with_bound(w, x);
    let mut q = Q8Activations::default();
    q.quantize(x);
    let mut xhat = vec![0f32; k];
    q.dequantize_into(&mut xhat);
    let wf = reference_weights(w);
    let mags = term_magnitudes(w);
    for path in DotPath::available() {
        let mut y = vec![f32::NAN; m];
        offset_blocks::rows_into(path, ty, w.blocks(), w.row_bytes(), &q, &mut y);
        for r in 0..m {
            let row = r * k..(r + 1) * k;
            let exact: f64 = wf[row.clone()]
                .iter()
                .zip(&xhat)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            let mag: f64 = mags[row]
                .iter()
                .zip(&xhat)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            let slack = 1e-5 * mag + 1e-30;
            let got = y[r] as f64;
            if (got - exact).abs() > slack {
                return Err(format!(
                    "{ty:?} {m}x{k} {} row {r}: {got} vs {exact} with the 8-bit x (slack {slack})",
                    path.name()
                ));
            }
            if (got - want[r]).abs() > bound[r] + slack {
                return Err(format!(
                    "{ty:?} {m}x{k} {} row {r}: {got} vs {} (bound {})",
                    path.name(),
                    want[r],
                    bound[r]
                ));
            }
        }
    }
    Ok(())
}

#[test]
fn offset_types_match_the_reference_on_every_path() {
    assert!(DotPath::available().contains(&DotPath::Portable));
    assert!(DotPath::detect().supported());
    for ty in OFFSET_TYPES {
        let e = ty.block_elems();
        for &(m, blocks) in &[(1, 1), (2, 2), (7, 3), (33, 6), (70, 18 * 32 / e.max(32))] {
            let k = blocks * e;
            let w = random_matrix(ty, m, k, (m * k) as u64 + ty as u64);
            let x = random_x(k, m as u64 + 7);
            check_offset_paths(&w, &x).unwrap();
        }
    }
}

#[test]
fn offset_kernels_do_not_saturate_at_the_extremes() {
    // Every quant at its largest value against activations of ±127 (the i16 pair sums of
    // `vpmaddubsw` are the tightest spot: 2 · 63 · 127 < 32767).
    for ty in OFFSET_TYPES {
        let (m, k) = (3, 2 * ty.block_elems());
        let mut blocks = random_blocks(ty, m, k, 9);
        for blk in blocks.chunks_exact_mut(ty.block_bytes()) {
            blk[quant_bytes(ty)].fill(0xFF);
        }
        let w = QuantMatrix::new(ty, m, k, blocks).unwrap();
        for sign in [1.0f32, -1.0] {
            let x: Vec<f32> = (0..k).map(|i| sign * (1.0 + (i % 3) as f32)).collect();
            check_offset_paths(&w, &x).unwrap();
        }
    }
}

#[test]
fn offset_types_dequantize_like_the_gguf_reader_and_multiply_through_the_format() {
    for ty in OFFSET_TYPES {
        let (m, k) = (37, 2 * ty.block_elems().max(128));
        let w = random_matrix(ty, m, k, 31);
        let want = reference_weights(&w);
        let mut row = vec![0f32; k];
        for r in 0..m {
            w.dequantize_row(r, &mut row);
            assert_eq!(row, want[r * k..(r + 1) * k], "{ty:?} row {r}");
            row.fill(f32::NAN);
            w.dequantize_row_portable(r, &mut row);
            assert_eq!(row, want[r * k..(r + 1) * k], "{ty:?} row {r}");
        }
        let want16: Vec<f16> = want.iter().map(|&v| f16::from_f32(v)).collect();
        assert_eq!(w.decode().data(), &want16[..]);
        // matvec (the detected path) within the bound; matmul rows agree with it, the small
        // batch bit for bit.
        let n = SMALL_BATCH + 2;
        let x = random_x(n * k, 32);
        let mut yv = vec![0f32; m];
        w.matvec(&x[..k], None, &mut yv).unwrap();
        let (want_y, bound) = reference_with_bound(&w, &x[..k]);
        let mags = term_magnitudes(&w);
        for r in 0..m {
            let mag: f64 = (0..k)
                .map(|i| (mags[r * k + i] as f64 * x[i] as f64).abs())
                .sum();
            assert!(
                (yv[r] as f64 - want_y[r]).abs() <= bound[r] + 1e-5 * mag,
                "{ty:?} row {r}"
            );
        }
        let mut y = vec![f32::NAN; n * m];
        w.matmul(&x, n, None, &mut y).unwrap();
        for tok in 0..n {
            let mut yt = vec![0f32; m];
            w.matvec(&x[tok * k..(tok + 1) * k], None, &mut yt).unwrap();
            for r in 0..m {
                let (a, b) = (y[tok * m + r], yt[r]);
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{ty:?} {a} vs {b}");
            }
        }
        let mut ys = vec![f32::NAN; 2 * m];
        w.matmul(&x[..2 * k], 2, Some(0.2), &mut ys).unwrap();
        let mut y0 = vec![0f32; m];
        w.matvec(&x[..k], Some(0.2), &mut y0).unwrap();
        assert_eq!(&ys[..m], &y0[..]);
        // Storage: the block bytes, scales as metadata.
        let s = w.storage();
        assert_eq!(s.total_bytes(), m * k / ty.block_elems() * ty.block_bytes());
        assert_eq!(
            s.metadata_bytes,
            m * k / ty.block_elems() * ty.header_bytes()
        );
    }
}

#[test]
fn offset_types_refuse_bad_scales_and_shapes() {
    for ty in OFFSET_TYPES {
        let k = ty.block_elems();
        let good = random_blocks(ty, 2, k, 4);
        assert!(QuantMatrix::new(ty, 2, k, good.clone()).is_ok());
        assert!(QuantMatrix::new(ty, 2, k + 32, good.clone()).is_err() || k == 32);
        assert!(QuantMatrix::new(ty, 2, k, good[..good.len() - 1].to_vec()).is_err());
        let bb = ty.block_bytes();
        for (field, &(at, _)) in f16_fields(ty).iter().enumerate() {
            // A huge `d` takes any block out of range (an offset alone may stay inside it).
            let huge = (field == 0).then_some(f16::from_f32(60000.0));
            for bad in [Some(f16::NAN), Some(f16::INFINITY), huge]
                .into_iter()
                .flatten()
            {
                let mut b = good.clone();
                b[bb + at..bb + at + 2].copy_from_slice(&bad.to_bits().to_le_bytes());
                let err = QuantMatrix::new(ty, 2, k, b).unwrap_err().to_string();
                assert!(err.contains("block 0 of row 1"), "{ty:?}: {err}");
            }
        }
    }
    // K types need whole super-blocks of 256 columns.
    let b = random_blocks(BlockType::Q4_K, 2, 256, 1);
    assert!(QuantMatrix::new(BlockType::Q4_K, 4, 128, b).is_err());
}

#[test]
fn non_finite_activations_propagate_through_offset_types() {
    for ty in OFFSET_TYPES {
        let k = ty.block_elems();
        let w = random_matrix(ty, 3, k, 1);
        let mut x = random_x(k, 2);
        x[k - 3] = f32::INFINITY;
        let mut q = Q8Activations::default();
        q.quantize(&x);
        for path in DotPath::available() {
            let mut y = [0f32; 3];
            offset_blocks::rows_into(path, ty, w.blocks(), w.row_bytes(), &q, &mut y);
            assert!(
                y.iter().all(|v| v.is_nan()),
                "{ty:?} {}: {y:?}",
                path.name()
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random blocks of every offset type, random shapes: each path within the bounds of
    /// `check_offset_paths`.
    #[test]
    fn random_offset_blocks_multiply_within_the_bounds(
        ty in prop::sample::select(OFFSET_TYPES.to_vec()),
        rows in 1usize..7,
        blocks_per_row in 1usize..4,
        seed in any::<u64>(),
    ) {
        let k = blocks_per_row * ty.block_elems();
        let w = random_matrix(ty, rows, k, seed);
        let x = random_x(k, seed ^ 0x5eed);
        prop_assert!(check_offset_paths(&w, &x).is_ok(), "{:?}", check_offset_paths(&w, &x));
    }
}
