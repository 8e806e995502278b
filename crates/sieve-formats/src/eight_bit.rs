//! 8-bit activations for the tensor cores' integer and FP8 paths (issue 29: SlideSparse and the
//! dense baselines in INT8 and FP8 e4m3): each token's row quantized with one f32 scale, as the
//! per-token quantization kernel on the GPU must do it, bit for bit.
//!
//! * INT8: `q = rne(x / s)` in -127..=127 with `s = max|x| / 127` (PTX `cvt.rni.s8.f32`
//!   rounds to nearest, ties to even; -128 is never used, so the grid is symmetric).
//! * FP8 e4m3 (the OCP "E4M3FN" that Hopper's `cvt.rn.satfinite.e4m3x2.f32` writes): 1 sign,
//!   4 exponent bits (bias 7), 3 mantissa bits; normal values `2^(e-7) (1 + m/8)` up to 448,
//!   subnormals `2^-6 m/8` down to 2^-9, no infinities, `S.1111.111` is NaN. Rounding is to
//!   nearest, ties to even; magnitudes from 448 up (infinity too) saturate to 448. With
//!   `s = max|x| / 448` the largest input of a row maps to 448 exactly.
//!
//! A row of zeros gets scale 0 and codes 0. Dequantized, `q · s` is within half a step of `x`:
//! `s / 2` for INT8; for e4m3 half the code spacing at `x / s` times `s` (relative 2^-4 for
//! normals).

/// The largest finite e4m3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// The e4m3 code of NaN (sign bit clear).
pub const E4M3_NAN: u8 = 0x7f;

/// `v` rounded to the nearest e4m3 (ties to even), saturated to ±448; NaN stays NaN.
pub fn e4m3_from_f32(v: f32) -> u8 {
    if v.is_nan() {
        return E4M3_NAN;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = f64::from(v.abs());
    if a >= f64::from(E4M3_MAX) {
        return sign | 0x7e;
    }
    // Scaled by powers of two only: every step below is exact in f64.
    let code = if a < 2f64.powi(-6) {
        // Subnormal: a count of 2^-9 steps; 8 steps is the smallest normal, code 0x08.
        (a * 512.0).round_ties_even() as u8
    } else {
        let mut e = a.log2().floor() as i32;
        // log2 of a value just below a power of two may round up: keep a / 2^e in [1, 2).
        if a < 2f64.powi(e) {
            e -= 1;
        }
        let mut r = (a / 2f64.powi(e - 3)).round_ties_even() as u32; // 8..=16
        if r == 16 {
            e += 1;
            r = 8;
        }
        (((e + 7) as u32) << 3 | (r - 8)) as u8
    };
    sign | code
}

/// The value of an e4m3 code.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let (e, m) = (i32::from((code >> 3) & 0x0f), f32::from(code & 7));
    if e == 15 && m == 7.0 {
        return f32::NAN;
    }
    let magnitude = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * magnitude
}

/// One row's 8-bit codes and its scale.
#[derive(Clone, Debug, PartialEq)]
pub struct Row8<T> {
    pub codes: Vec<T>,
    pub scale: f32,
}

/// INT8 codes of a row: `rne(x / s)`, `s = max|x| / 127` (0 for a row of zeros or an empty one).
/// Non-finite inputs are the caller's to refuse; here they make the scale non-finite.
pub fn int8_row(x: &[f32]) -> Row8<i8> {
    let scale = max_abs(x) / 127.0;
    let codes = x
        .iter()
        .map(|&v| {
            if scale == 0.0 {
                0
            } else {
                (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8
            }
        })
        .collect();
    Row8 { codes, scale }
}

/// Columns per activation scale of [`int8_groups`]: the GPU's W4A8 kernels quantize each
/// token's input in groups of this many columns (one of their weight groups, or four of GGUF
/// Q4_0's), and the CPU rounds the same way to measure what that costs in quality.
pub const INT8_ACTIVATION_GROUP: usize = 128;

/// A row's INT8 codes with one scale per `group` columns (the last group may be shorter).
#[derive(Clone, Debug, PartialEq)]
pub struct GroupedRow8 {
    pub codes: Vec<i8>,
    pub scales: Vec<f32>,
    pub group: usize,
}

/// INT8 codes of a row in groups of `group` columns, each group by [`int8_row`] (its own
/// `max|x| / 127`). A `group` of 0 is taken as the whole row.
pub fn int8_groups(x: &[f32], group: usize) -> GroupedRow8 {
    let group = if group == 0 { x.len().max(1) } else { group };
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len().div_ceil(group));
    for part in x.chunks(group) {
        let r = int8_row(part);
        codes.extend(r.codes);
        scales.push(r.scale);
    }
    GroupedRow8 {
        codes,
        scales,
        group,
    }
}

impl GroupedRow8 {
    /// The scale of column `col`.
    pub fn scale_of(&self, col: usize) -> f32 {
        self.scales[col / self.group]
    }
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes
            .iter()
            .enumerate()
            .map(|(k, &q)| f32::from(q) * self.scale_of(k))
            .collect()
    }
}

/// e4m3 codes of a row: `e4m3(x / s)`, `s = max|x| / 448` (0 for a row of zeros or an empty one).
pub fn e4m3_row(x: &[f32]) -> Row8<u8> {
    let scale = max_abs(x) / E4M3_MAX;
    let codes = x
        .iter()
        .map(|&v| {
            if scale == 0.0 {
                0
            } else {
                e4m3_from_f32(v / scale)
            }
        })
        .collect();
    Row8 { codes, scale }
}

impl Row8<i8> {
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes
            .iter()
            .map(|&q| f32::from(q) * self.scale)
            .collect()
    }
}

impl Row8<u8> {
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes
            .iter()
            .map(|&q| e4m3_to_f32(q) * self.scale)
            .collect()
    }
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Each group is its own INT8 row: codes within [-127, 127], every input within half a
        /// step of its group's scale, and a group's largest |x| coded as ±127.
        #[test]
        fn int8_groups_round_each_group_by_its_own_scale(
            x in proptest::collection::vec(-50f32..50.0, 0..400),
            group in prop_oneof![Just(32usize), Just(128), Just(7)],
        ) {
            let g = int8_groups(&x, group);
            prop_assert_eq!(g.codes.len(), x.len());
            prop_assert_eq!(g.scales.len(), x.len().div_ceil(group));
            let back = g.dequantize();
            for (k, (&v, &b)) in x.iter().zip(&back).enumerate() {
                let s = g.scale_of(k);
                prop_assert!((v - b).abs() <= s * 0.5 * (1.0 + 1e-5) + 1e-7, "{k}: {v} vs {b}, scale {s}");
            }
            for (i, part) in x.chunks(group).enumerate() {
                let m = max_abs(part);
                prop_assert_eq!(g.scales[i], m / 127.0);
                if m > 0.0 {
                    let top = g.codes[i * group..i * group + part.len()].iter().map(|c| c.unsigned_abs()).max();
                    prop_assert_eq!(top, Some(127));
                }
            }
        }
    }

    /// Every finite e4m3 value in increasing order, with its code.
    fn finite_values() -> Vec<(f32, u8)> {
        let mut v: Vec<(f32, u8)> = (0u8..=255)
            .filter(|&c| c & 0x7f != E4M3_NAN)
            .map(|c| (e4m3_to_f32(c), c))
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    }

    #[test]
    fn e4m3_table_is_the_ocp_e4m3fn_one() {
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x39), 1.125);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        // 253 finite magnitudes and signs: 254 codes minus the duplicate zero.
        let v = finite_values();
        assert_eq!(v.len(), 254);
        assert!(v
            .windows(2)
            .all(|w| w[0].0 < w[1].0 || (w[0].0 == 0.0 && w[1].0 == 0.0)));
    }

    #[test]
    fn every_code_round_trips_and_edges_saturate() {
        for (value, code) in finite_values() {
            assert_eq!(e4m3_from_f32(value), code, "{value}");
        }
        assert_eq!(e4m3_from_f32(f32::NAN), E4M3_NAN);
        for big in [448.0, 460.0, 464.0, 1e6, f32::INFINITY] {
            assert_eq!(e4m3_from_f32(big), 0x7e, "{big}");
            assert_eq!(e4m3_from_f32(-big), 0xfe, "-{big}");
        }
        // Halfway between 2^-9 and 0 is a tie: to the even code, zero.
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0);
        assert_eq!(e4m3_from_f32(1.5 * 2f32.powi(-9)), 0x02);
        // 1.0625 is halfway between 1.0 (even mantissa 0) and 1.125.
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.1875), 0x3a);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The code is the nearest finite value (ties to the even code) of any input below 448.
        #[test]
        fn e4m3_rounds_to_the_nearest(v in -450.0f32..450.0) {
            let got = e4m3_to_f32(e4m3_from_f32(v));
            if v.abs() >= E4M3_MAX {
                prop_assert_eq!(got.abs(), E4M3_MAX);
            } else {
                let err = (got - v).abs();
                for (value, code) in finite_values() {
                    let other = (value - v).abs();
                    prop_assert!(
                        err < other || (err == other && (got == value || code & 1 == 1 || value == 0.0)),
                        "{} -> {} but {} is nearer", v, got, value
                    );
                }
            }
        }

        #[test]
        fn rows_keep_zeros_and_their_largest_value(
            x in prop::collection::vec(-100.0f32..100.0, 0..70), zeros in 0usize..4,
        ) {
            let mut x = x;
            let len = x.len();
            for i in 0..zeros.min(len) {
                x[i * 7 % len] = 0.0;
            }
            let m = max_abs(&x);
            let q8 = int8_row(&x);
            let f8 = e4m3_row(&x);
            prop_assert_eq!(q8.codes.len(), x.len());
            for (i, &v) in x.iter().enumerate() {
                let d8 = f32::from(q8.codes[i]) * q8.scale;
                prop_assert!((d8 - v).abs() <= q8.scale / 2.0 * (1.0 + 1e-5) + 1e-6 * m, "int8 {} -> {}", v, d8);
                let df = e4m3_to_f32(f8.codes[i]) * f8.scale;
                // Half a step at the code's binade: 2^-4 relative for normals, 2^-10 s below.
                let step = (v.abs() / 8.0).max(f8.scale * 2f32.powi(-9));
                prop_assert!((df - v).abs() <= step * (1.0 + 1e-5) + 1e-6 * m, "e4m3 {} -> {}", v, df);
                if v == 0.0 {
                    prop_assert_eq!((q8.codes[i], f8.codes[i] & 0x7f), (0, 0));
                }
            }
            if m > 0.0 {
                let top = x.iter().position(|v| v.abs() == m).unwrap();
                prop_assert_eq!(q8.codes[top].unsigned_abs(), 127);
                prop_assert_eq!(f8.codes[top] & 0x7f, 0x7e);
            } else {
                prop_assert_eq!((q8.scale, f8.scale), (0.0, 0.0));
            }
        }
    }
}
