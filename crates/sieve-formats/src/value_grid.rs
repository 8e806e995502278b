//! Symmetric integer grids for f16 weights: snapping (`sieve pack --values int8|int4`) and
//! detection (the CPU product of Balanced-CBC keeps 8-bit or 4-bit records when every stored
//! value lies on one).
//!
//! A run of values (an int8 row, or an int4 group of one row's columns) lies on a grid when
//! every stored value is `v = q · s` **exactly**, with an integer `|q| <= qmax` and one f32
//! scale `s` for the run. Exactness (not "rounds to the same f16") is what lets an integer
//! kernel sum `q · x` and multiply by `s` once at the end while agreeing with the f16 kernels up
//! to f32 rounding: if `q · s` were only the nearest f16 of the stored value, each weight would
//! differ from what the f16 products and the prefill GEMM multiply by up to 2^-11 relative.
//!
//! Two grids ([`Grid`]):
//! * [`INT8`], `qmax = 127`, one scale per row;
//! * [`INT4`], `qmax = 7`, one scale per row and group of consecutive input columns (GPTQ's
//!   groups; the 4-bit records of Balanced-CBC store the scales as f16, so an INT4 scale must
//!   be an f16 exactly).
//!
//! The snapper therefore picks `s` as `max|w| / qmax` rounded **up** to a number `m · 2^e`
//! with an integer `m` of a few bits (`m <= 16` for INT8, `m <= 256` for INT4) and `e >= -24`:
//! then `q · m < 2^11` and every `q · s` is an f16 (normal or subnormal) exactly, and so is `s`
//! itself when it is below f16's largest value. The cost is a slightly coarser grid than
//! `max / qmax`: for INT8 the largest weight of a row lands on `|q|` in 113..=127 instead of 127
//! (at worst 1/8 of the resolution), for INT4 the grid is at most 1/128 coarser.
//!
//! The detector does not need to know how a scale was chosen: it tries the scales `max / q`
//! for every `q` in 1..=qmax (`max` the run's largest stored magnitude) and accepts the run
//! when one of them puts every stored value on its grid exactly.

use half::f16;

/// A symmetric integer grid (module notes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Grid {
    /// The largest magnitude of a grid point index.
    pub qmax: i32,
    /// Snapped scales are `m · 2^e` with `span / 2 < m <= span`.
    span: f64,
    /// Whether a detected scale must be an f16 exactly (the 4-bit records store f16 scales).
    f16_scale: bool,
}

/// 8-bit grids: `|q| <= 127`, one scale per row.
pub const INT8: Grid = Grid {
    qmax: 127,
    span: 16.0,
    f16_scale: false,
};

/// 4-bit grids: `|q| <= 7`, one f16 scale per row and group of input columns.
pub const INT4: Grid = Grid {
    qmax: 7,
    span: 256.0,
    f16_scale: true,
};

/// The int8 grid's largest index (`INT8.qmax`).
pub const QMAX: i32 = INT8.qmax;

/// Smallest exponent of a scale: `2^-24` is the spacing of f16 subnormals, so every multiple of
/// it below 2^-14 is still an f16 exactly.
const MIN_EXP: i32 = -24;

impl Grid {
    /// The scale of a run whose largest magnitude is `max_abs` (module notes): the smallest
    /// `m · 2^e >= max_abs / qmax` with `m <= span`, `e >= -24`; 0 for a run of zeros. `None`
    /// when `max_abs` is not finite.
    pub fn snap_scale(&self, max_abs: f32) -> Option<f32> {
        if !max_abs.is_finite() {
            return None;
        }
        if max_abs == 0.0 {
            return Some(0.0);
        }
        let t = max_abs.abs() as f64 / self.qmax as f64;
        let half = self.span / 2.0;
        // The exponent that puts t / 2^e in (span / 2, span], so that m = ceil(t / 2^e) has
        // the grid's bits, or the smallest exponent for tiny runs. Adjusted by steps: log2 is
        // only a first guess.
        let mut e = (t.log2().floor() as i32 - half.log2() as i32).max(MIN_EXP);
        while t / 2f64.powi(e) > self.span {
            e += 1;
        }
        while e > MIN_EXP && t / 2f64.powi(e) <= half {
            e -= 1;
        }
        let unit = 2f64.powi(e);
        let m = (t / unit).ceil();
        debug_assert!((1.0..=self.span).contains(&m));
        Some((m * unit) as f32)
    }

    /// The grid index of `v` for scale `s > 0`: `round(v / s)`, clamped to +-qmax.
    fn index(&self, v: f64, s: f64) -> i32 {
        ((v / s).round() as i32).clamp(-self.qmax, self.qmax)
    }

    /// Snaps one run in place onto its grid (module notes) and returns its scale: each value
    /// becomes the f32 of the f16 `q · s`. Values whose `q` is 0 become +0 (never -0, which the
    /// Balanced-CBC encoder would count as stored). A run with a value that is not finite is
    /// left alone and gives `None`.
    pub fn snap_row(&self, row: &mut [f32]) -> Option<f32> {
        // f32::max skips NaN: refuse non-finite runs first.
        if row.iter().any(|v| !v.is_finite()) {
            return None;
        }
        let max = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        let s = self.snap_scale(max)?;
        if s == 0.0 {
            // All zeros (of either sign): +0 throughout, as every other snapped zero.
            row.fill(0.0);
            return Some(0.0);
        }
        for v in row.iter_mut() {
            *v = self.snap(*v, s);
        }
        Some(s)
    }

    /// The grid point nearest `v` for the snapped scale `s` (from [`Self::snap_scale`]), as
    /// an f32 that is an f16 exactly; +0 for index 0 and for `s == 0`.
    pub fn snap(&self, v: f32, s: f32) -> f32 {
        if s == 0.0 {
            return 0.0;
        }
        let mut q = self.index(v as f64, s as f64);
        // Only a run whose maximum is within s/2 of f16's largest value can round past it.
        while q != 0 && !f16::from_f64(q as f64 * s as f64).is_finite() {
            q -= q.signum();
        }
        if q == 0 {
            0.0
        } else {
            // Exact: q · s is an f16 (module notes).
            f16::from_f64(q as f64 * s as f64).to_f32()
        }
    }

    /// The grid index of every stored value of a run: `Some(scale)` when one scale puts all
    /// of `values` on the grid exactly (module notes), the indices written to `q` (same length
    /// as `values`). A run without values has scale 0. Zeros of either sign among `values` are
    /// refused: a stored -0 could not be rebuilt bit for bit as `0 · s`.
    pub fn detect(&self, values: &[f16], q: &mut [i8]) -> Option<f32> {
        debug_assert_eq!(values.len(), q.len());
        let mut max = 0f64;
        for v in values {
            let x = v.to_f64();
            if !x.is_finite() || x == 0.0 {
                return None;
            }
            max = max.max(x.abs());
        }
        if values.is_empty() {
            return Some(0.0);
        }
        // Finest grid first: the largest |q| of the maximum.
        for qm in (1..=self.qmax).rev() {
            let s = (max / qm as f64) as f32;
            if s == 0.0 || !s.is_finite() || s as f64 * qm as f64 != max {
                continue;
            }
            if self.f16_scale && f16::from_f32(s).to_f32() != s {
                continue;
            }
            let s64 = s as f64;
            let qmax = self.qmax as f64;
            let fits = values.iter().zip(q.iter_mut()).all(|(v, qv)| {
                let x = v.to_f64();
                let i = (x / s64).round();
                if i.abs() > qmax || i * s64 != x {
                    return false;
                }
                *qv = i as i8;
                true
            });
            if fits {
                return Some(s);
            }
        }
        None
    }
}

/// [`INT8`]`.snap_scale`.
pub fn snap_scale(max_abs: f32) -> Option<f32> {
    INT8.snap_scale(max_abs)
}

/// [`INT8`]`.snap_row`.
pub fn snap_row(row: &mut [f32]) -> Option<f32> {
    INT8.snap_row(row)
}

/// [`INT8`]`.detect`.
pub fn detect_row(values: &[f16], q: &mut [i8]) -> Option<f32> {
    INT8.detect(values, q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn detect(row: &[f32]) -> Option<(f32, Vec<i8>)> {
        let stored: Vec<f16> = row
            .iter()
            .map(|&v| f16::from_f32(v))
            .filter(|v| v.to_bits() != 0)
            .collect();
        let mut q = vec![0i8; stored.len()];
        let s = detect_row(&stored, &mut q)?;
        // Every index rebuilds its value exactly.
        for (v, &i) in stored.iter().zip(&q) {
            assert_eq!(i as f64 * s as f64, v.to_f64());
        }
        Some((s, q))
    }

    #[test]
    fn scales_have_four_significant_bits_and_cover_the_maximum() {
        for &max in &[
            1.0f32, 0.02, 3.7e-3, 127.0, 1e-9, 6e-8, 65504.0, 0.5, 15.999, 16.0,
        ] {
            let s = snap_scale(max).unwrap();
            assert!(s as f64 * 127.0 >= max as f64, "{max}: {s}");
            assert!(s as f64 * 127.0 < max as f64 * 1.126 + 127.0 * 2f64.powi(-24));
            // m · 2^e with m <= 15: the low 20 mantissa bits are clear, and no finer than 2^-24.
            assert_eq!(s.to_bits() & ((1 << 20) - 1), 0, "{max}: {s}");
            assert!(s >= 2f32.powi(-24));
        }
        assert_eq!(snap_scale(0.0), Some(0.0));
        assert_eq!(snap_scale(f32::INFINITY), None);
        assert_eq!(snap_scale(f32::NAN), None);
    }

    #[test]
    fn snapped_rows_are_f16_and_detected() {
        let mut row = vec![0.013f32, -0.5, 0.25, 1e-6, -3.3e-3, 0.0, -0.0, 0.49];
        let s = snap_row(&mut row).unwrap();
        assert!(s > 0.0);
        for v in &row {
            assert_eq!(f16::from_f32(*v).to_f32(), *v, "{v} is an f16");
            assert_ne!(v.to_bits(), (-0.0f32).to_bits(), "no negative zero");
        }
        // 1e-6 is below half a step: a zero now.
        assert_eq!(row[3], 0.0);
        let (_, q) = detect(&row).unwrap();
        assert!(q.iter().any(|&i| i.unsigned_abs() >= 113));
    }

    #[test]
    fn the_detector_refuses_an_off_grid_value() {
        let mut row: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) * 0.0173).collect();
        snap_row(&mut row).unwrap();
        assert!(detect(&row).is_some());
        // Half a step off is on no grid of the same maximum.
        let s = snap_scale(row.iter().fold(0f32, |a, v| a.max(v.abs()))).unwrap();
        row[5] += s / 2.0;
        assert!(detect(&row).is_none());
        // Arbitrary f16 values are (almost always) on no int8 grid.
        let row: Vec<f32> = (1..40).map(|i| 1.0 + i as f32 * 0.01).collect();
        assert!(detect(&row).is_none());
    }

    #[test]
    fn the_detector_handles_empty_zero_and_non_finite_rows() {
        assert_eq!(detect_row(&[], &mut []), Some(0.0));
        let mut q = [0i8; 2];
        assert_eq!(detect_row(&[f16::NEG_ZERO, f16::ONE], &mut q), None);
        assert_eq!(detect_row(&[f16::INFINITY, f16::ONE], &mut q), None);
        assert_eq!(detect_row(&[f16::NAN, f16::ONE], &mut q), None);
        let mut zeros = vec![0.0f32, -0.0, 0.0];
        assert_eq!(snap_row(&mut zeros), Some(0.0));
        assert!(zeros.iter().all(|v| v.to_bits() == 0));
        let mut bad = vec![1.0f32, f32::NAN];
        assert_eq!(snap_row(&mut bad), None);
    }

    #[test]
    fn the_largest_f16_values_stay_finite() {
        let mut row = vec![65504.0f32, -65504.0, 1000.0];
        snap_row(&mut row).unwrap();
        assert!(row.iter().all(|v| f16::from_f32(*v).is_finite()));
        assert!(detect(&row).is_some());
    }

    #[test]
    fn int4_scales_are_f16_with_eight_bits_and_cover_the_maximum() {
        for &max in &[
            1.0f32, 0.02, 3.7e-3, 7.0, 1e-9, 6e-8, 0.5, 15.999, 16.0, 1000.0,
        ] {
            let s = INT4.snap_scale(max).unwrap();
            assert!(s as f64 * 7.0 >= max as f64, "{max}: {s}");
            assert!(s as f64 * 7.0 < max as f64 * (1.0 + 1.0 / 128.0) + 7.0 * 2f64.powi(-24));
            assert_eq!(f16::from_f32(s).to_f32(), s, "{max}: {s} is an f16");
            // m · 2^e with m <= 256: the low 15 mantissa bits are clear.
            assert_eq!(s.to_bits() & ((1 << 15) - 1), 0, "{max}: {s}");
        }
    }

    #[test]
    fn int4_detection_needs_an_f16_scale_and_small_indices() {
        let mut row = vec![0.31f32, -0.07, 0.002, 0.2, -0.29];
        let s = INT4.snap_row(&mut row).unwrap();
        let stored: Vec<f16> = row
            .iter()
            .filter(|v| **v != 0.0)
            .map(|&v| f16::from_f32(v))
            .collect();
        let mut q = vec![0i8; stored.len()];
        let found = INT4.detect(&stored, &mut q).unwrap();
        for (v, &i) in stored.iter().zip(&q) {
            assert!(i.unsigned_abs() <= 7);
            assert_eq!(i as f64 * found as f64, v.to_f64());
        }
        assert_eq!(found, s);
        // An int8 row with many levels is on no 4-bit grid.
        let mut fine: Vec<f32> = (0..40).map(|i| (i as f32 - 20.0) * 0.013).collect();
        snap_row(&mut fine).unwrap();
        let stored: Vec<f16> = fine
            .iter()
            .filter(|v| **v != 0.0)
            .map(|&v| f16::from_f32(v))
            .collect();
        let mut q = vec![0i8; stored.len()];
        assert_eq!(INT4.detect(&stored, &mut q), None);
        // A scale that is no f16 is refused although the indices fit: for the value 2^-24,
        // 2^-26 (q = 4) and 2^-25 (q = 2) rebuild it exactly but are below f16's range.
        let tiny = [f16::from_bits(1)];
        let mut q = [0i8; 1];
        assert_eq!(INT4.detect(&tiny, &mut q), Some(2f32.powi(-24)));
        assert_eq!(q[0], 1);
        // The int8 grid keeps f32 scales and takes the finest: q = 64.
        assert_eq!(INT8.detect(&tiny, &mut q), Some(2f32.powi(-30)));
        assert_eq!(q[0], 64);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Snapping then detecting round-trips: every snapped row is on a grid, and the grid
        /// indices rebuild the snapped values exactly (checked in `detect`); snapping moves a
        /// value by at most half a step.
        #[test]
        fn snapping_then_detecting_round_trips(
            row in proptest::collection::vec(-1.0f32..1.0, 1..80),
            scale in prop_oneof![Just(1e-6f32), Just(1e-3), Just(1.0), Just(300.0)],
        ) {
            let orig: Vec<f32> = row.iter().map(|v| v * scale).collect();
            let mut row = orig.clone();
            snap_row(&mut row).unwrap();
            prop_assert!(detect(&row).is_some());
            // Each value moved by at most half a step.
            let s = snap_scale(orig.iter().fold(0f32, |a, v| a.max(v.abs()))).unwrap();
            for (a, b) in orig.iter().zip(&row) {
                prop_assert!(((a - b).abs() as f64) <= s as f64 / 2.0 * (1.0 + 1e-6), "{} -> {}", a, b);
            }
        }

        /// The same for 4-bit grids over groups of a row (what `--values int4` does).
        #[test]
        fn int4_group_snapping_then_detecting_round_trips(
            row in proptest::collection::vec(-1.0f32..1.0, 1..80),
            scale in prop_oneof![Just(1e-6f32), Just(1e-3), Just(1.0), Just(300.0)],
            group in prop_oneof![Just(8usize), Just(32), Just(64)],
        ) {
            let orig: Vec<f32> = row.iter().map(|v| v * scale).collect();
            let mut row = orig.clone();
            for (chunk, src) in row.chunks_mut(group).zip(orig.chunks(group)) {
                let s = INT4.snap_row(chunk).unwrap();
                let stored: Vec<f16> = chunk.iter().filter(|v| **v != 0.0).map(|&v| f16::from_f32(v)).collect();
                let mut q = vec![0i8; stored.len()];
                let found = INT4.detect(&stored, &mut q);
                prop_assert!(found.is_some(), "{:?} not detected", chunk);
                for (v, &i) in stored.iter().zip(&q) {
                    prop_assert_eq!(i as f64 * found.unwrap() as f64, v.to_f64());
                }
                for (a, b) in src.iter().zip(chunk.iter()) {
                    prop_assert!(((a - b).abs() as f64) <= s as f64 / 2.0 * (1.0 + 1e-6), "{} -> {}", a, b);
                }
            }
        }
    }
}
