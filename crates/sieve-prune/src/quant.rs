//! Round-to-nearest quantization after pruning (the SP → quantization order SPDP evaluates):
//! INT4 weights per group along K, INT8 activations per token.
//!
//! # Pruned zeros stay exactly zero
//!
//! Every INT4 group's grid contains 0 exactly: the asymmetric range is widened to include 0
//! (`lo = min(min w, 0)`, `hi = max(max w, 0)`) and the zero point is an integer code, so a
//! weight of 0 gets code `zero` and dequantizes to `(zero - zero) · scale = +0.0`. The symmetric
//! grid is `{-8..7} · scale` with code 8 as its zero point. A kept weight smaller than half a
//! step also rounds to zero, so quantization may add zeros, never remove them. A group whose
//! weights are all zero (fully pruned) gets scale 0.
//!
//! # Error bound
//!
//! Every element of a group is within `scale / 2` of its dequantized value (up to f32 rounding
//! of a few ulp): the asymmetric zero point is rounded, which shifts the grid by at most half a
//! step, and both range ends are still within half a step of a grid point.
//!
//! Scales are kept in f32 here; a format that stores them in f16 adds its own rounding.

use crate::error::{check_matrix, PruneError, Result};
use serde::Serialize;

/// Group size along K used by default (the common GPTQ/AWQ choice).
pub const DEFAULT_GROUP_SIZE: usize = 128;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Int4Mode {
    /// Scale and integer zero point per group; codes 0..=15 span [min, max] ∪ {0}.
    Asymmetric,
    /// Scale per group, zero point fixed at 8; codes 0..=15 mean -8..=7 steps, scale = absmax/7.
    Symmetric,
}

/// INT4 codes of an M x K matrix, one code (0..=15) per byte, with per-group parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Int4Weights {
    pub rows: usize,
    pub cols: usize,
    pub group_size: usize,
    pub mode: Int4Mode,
    /// Row-major codes, one per element, each in 0..=15.
    pub codes: Vec<u8>,
    /// `rows * groups_per_row` scales, row-major by group.
    pub scales: Vec<f32>,
    /// Zero point of each group (always 8 in symmetric mode).
    pub zeros: Vec<u8>,
}

impl Int4Weights {
    pub fn groups_per_row(&self) -> usize {
        self.cols.div_ceil(self.group_size)
    }

    /// `(code - zero) · scale` for every element.
    pub fn dequantize(&self) -> Vec<f32> {
        let gpr = self.groups_per_row();
        let mut out = Vec::with_capacity(self.codes.len());
        for (r, row) in self.codes.chunks_exact(self.cols).enumerate() {
            for (g, group) in row.chunks(self.group_size).enumerate() {
                let scale = self.scales[r * gpr + g];
                let zero = i32::from(self.zeros[r * gpr + g]);
                out.extend(group.iter().map(|&q| (i32::from(q) - zero) as f32 * scale));
            }
        }
        out
    }

    /// Codes packed two per byte, row-major, the even column in the low nibble; an odd total
    /// leaves the last high nibble 0.
    pub fn packed_codes(&self) -> Vec<u8> {
        self.codes
            .chunks(2)
            .map(|p| p[0] | (p.get(1).copied().unwrap_or(0) << 4))
            .collect()
    }
}

/// Quantizes `weights` (M x K row-major) to INT4 per group of `group_size` consecutive inputs of
/// a row (a trailing partial group is its own group). Returns the codes and the dequantized
/// matrix.
pub fn quantize_int4(
    weights: &[f32],
    rows: usize,
    cols: usize,
    group_size: usize,
    mode: Int4Mode,
) -> Result<(Int4Weights, Vec<f32>)> {
    check_matrix("weights", weights, rows, cols)?;
    if group_size == 0 {
        return Err(PruneError::Option(
            "INT4 group size must be positive".into(),
        ));
    }
    let gpr = cols.div_ceil(group_size);
    let mut codes = Vec::with_capacity(weights.len());
    let mut scales = Vec::with_capacity(rows * gpr);
    let mut zeros = Vec::with_capacity(rows * gpr);
    for row in weights.chunks_exact(cols) {
        for group in row.chunks(group_size) {
            let (scale, zero) = match mode {
                Int4Mode::Asymmetric => {
                    let lo = group.iter().copied().fold(0.0f32, f32::min);
                    let hi = group.iter().copied().fold(0.0f32, f32::max);
                    if hi > lo {
                        let scale = (hi - lo) / 15.0;
                        (scale, (-lo / scale).round().clamp(0.0, 15.0) as u8)
                    } else {
                        (0.0, 0)
                    }
                }
                Int4Mode::Symmetric => {
                    let absmax = group.iter().fold(0.0f32, |a, w| a.max(w.abs()));
                    (absmax / 7.0, 8)
                }
            };
            scales.push(scale);
            zeros.push(zero);
            codes.extend(group.iter().map(|&w| {
                if scale == 0.0 {
                    zero
                } else {
                    ((w / scale).round() + f32::from(zero)).clamp(0.0, 15.0) as u8
                }
            }));
        }
    }
    let quant = Int4Weights {
        rows,
        cols,
        group_size,
        mode,
        codes,
        scales,
        zeros,
    };
    let dequantized = quant.dequantize();
    Ok((quant, dequantized))
}

/// Symmetric INT8 codes of `n` activation rows, one absmax scale per token (row).
#[derive(Clone, Debug, PartialEq)]
pub struct Int8Activations {
    pub rows: usize,
    pub cols: usize,
    /// Row-major codes in -127..=127 (-128 is never used, keeping the grid symmetric).
    pub codes: Vec<i8>,
    /// `absmax / 127` per row; 0 for an all-zero row.
    pub scales: Vec<f32>,
}

impl Int8Activations {
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes
            .chunks_exact(self.cols)
            .zip(&self.scales)
            .flat_map(|(row, &s)| row.iter().map(move |&q| f32::from(q) * s))
            .collect()
    }
}

/// Quantizes `n` rows of K activations to INT8 per token (symmetric, absmax). Every element is
/// within `scale / 2` of its dequantized value; zeros stay zero.
pub fn quantize_int8_per_token(
    x: &[f32],
    n: usize,
    k: usize,
) -> Result<(Int8Activations, Vec<f32>)> {
    check_matrix("activations", x, n, k)?;
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(n);
    for row in x.chunks_exact(k) {
        let absmax = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let scale = absmax / 127.0;
        scales.push(scale);
        codes.extend(row.iter().map(|&v| {
            if scale == 0.0 {
                0
            } else {
                (v / scale).round().clamp(-127.0, 127.0) as i8
            }
        }));
    }
    let quant = Int8Activations {
        rows: n,
        cols: k,
        codes,
        scales,
    };
    let dequantized = quant.dequantize();
    Ok((quant, dequantized))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::methods::prune_magnitude;
    use crate::pattern::Pattern;
    use proptest::prelude::*;

    /// `|a - b| <= bound`, up to the f32 rounding of the quantizer's own arithmetic: `v / scale`
    /// and `code * scale` each round to within half an ulp of a value as large as `a`, so the
    /// slack is a few ulp of `|a|` (a relative slack of `bound` alone is too small when `a` is
    /// 127 steps from zero: seed 836c005b of the INT8 test).
    fn within(a: f32, b: f32, bound: f32) -> bool {
        (a - b).abs() <= bound * (1.0 + 1e-5) + 4.0 * f32::EPSILON * a.abs().max(b.abs()) + 1e-30
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn int4_error_bound_and_zeros_kept(
            rows in 1usize..5, cols in 1usize..300, group in prop::sample::select(vec![1usize, 7, 32, 128]),
            ratio in 0.0f64..0.95, seed in any::<u64>(), sym in any::<bool>(), offset in -0.05f32..0.05,
        ) {
            let mut rng = sieve_formats::random::SplitMix64::new(seed);
            // an offset makes some groups one-signed, exercising the widened asymmetric range
            let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal() as f32 * 0.02 + offset).collect();
            let pruned = prune_magnitude(&w, rows, cols, Pattern::Unstructured, ratio).unwrap();
            let mode = if sym { Int4Mode::Symmetric } else { Int4Mode::Asymmetric };
            let (q, deq) = quantize_int4(&pruned.weights, rows, cols, group, mode).unwrap();
            prop_assert_eq!(q.dequantize(), deq.clone());
            let gpr = q.groups_per_row();
            for r in 0..rows {
                for c in 0..cols {
                    let i = r * cols + c;
                    let scale = q.scales[r * gpr + c / group];
                    prop_assert!(q.codes[i] <= 15);
                    prop_assert!(within(pruned.weights[i], deq[i], scale / 2.0),
                        "w {} deq {} scale {}", pruned.weights[i], deq[i], scale);
                    if !pruned.mask.is_kept(r, c) {
                        prop_assert_eq!(deq[i].to_bits(), 0);
                    }
                }
            }
            // packing round trip
            let packed = q.packed_codes();
            prop_assert_eq!(packed.len(), q.codes.len().div_ceil(2));
            for (i, &c) in q.codes.iter().enumerate() {
                prop_assert_eq!((packed[i / 2] >> (4 * (i % 2))) & 0xf, c);
            }
        }

        #[test]
        fn int8_round_trip_bound(n in 1usize..6, k in 1usize..200, seed in any::<u64>(), scale in 0.001f32..100.0) {
            let mut rng = sieve_formats::random::SplitMix64::new(seed);
            let mut x: Vec<f32> = (0..n * k).map(|_| rng.normal() as f32 * scale).collect();
            x[0] = 0.0;
            let (q, deq) = quantize_int8_per_token(&x, n, k).unwrap();
            prop_assert_eq!(deq[0], 0.0);
            for (t, row) in x.chunks(k).enumerate() {
                let s = q.scales[t];
                let absmax = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                prop_assert!(within(s * 127.0, absmax, absmax * 1e-6));
                for (j, &v) in row.iter().enumerate() {
                    prop_assert!(within(v, deq[t * k + j], s / 2.0));
                    prop_assert!(q.codes[t * k + j] >= -127);
                }
            }
        }
    }

    #[test]
    fn all_zero_groups_and_rows() {
        let (q, deq) = quantize_int4(&[0.0; 8], 2, 4, 4, Int4Mode::Asymmetric).unwrap();
        assert_eq!(q.scales, vec![0.0, 0.0]);
        assert!(deq.iter().all(|v| v.to_bits() == 0));
        let (q, deq) = quantize_int4(&[0.0, 0.0, 1.0, -1.0], 1, 4, 2, Int4Mode::Symmetric).unwrap();
        assert_eq!(q.zeros, vec![8, 8]);
        assert_eq!(deq, vec![0.0, 0.0, 1.0, -1.0]);
        let (q, deq) = quantize_int8_per_token(&[0.0; 4], 2, 2).unwrap();
        assert_eq!(q.scales, vec![0.0, 0.0]);
        assert_eq!(deq, vec![0.0; 4]);
    }

    #[test]
    fn typed_errors() {
        assert!(matches!(
            quantize_int4(&[1.0; 4], 2, 2, 0, Int4Mode::Symmetric),
            Err(PruneError::Option(_))
        ));
        assert!(matches!(
            quantize_int4(&[1.0; 3], 2, 2, 2, Int4Mode::Symmetric),
            Err(PruneError::Shape { .. })
        ));
        assert!(matches!(
            quantize_int4(&[1.0, f32::NAN], 1, 2, 2, Int4Mode::Asymmetric),
            Err(PruneError::NonFinite { .. })
        ));
        assert!(matches!(
            quantize_int8_per_token(&[1.0; 3], 2, 2),
            Err(PruneError::Shape { .. })
        ));
        assert!(matches!(
            quantize_int8_per_token(&[f32::INFINITY], 1, 1),
            Err(PruneError::NonFinite { .. })
        ));
    }
}
