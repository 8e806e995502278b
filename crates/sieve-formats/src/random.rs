//! Deterministic random matrices for tests, benchmarks and `sieve formats stats`.
//! A small SplitMix64 generator keeps the crate free of an RNG dependency and the streams
//! identical on every platform.

use crate::error::{FormatError, Result};
use crate::matrix::DenseMatrix;
use half::f16;

/// A 64-bit linear congruential generator (Knuth's MMIX constants) of uniform f32 in [-1, 1):
/// the GPU tests' inputs (attention, KV cache, runner kernels), one stream for all of them.
#[derive(Clone, Debug)]
pub struct Lcg(pub u64);

impl Lcg {
    /// The next value, uniform in [-1, 1) (24 bits).
    pub fn uniform(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// `n` values times `scale`.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_f64() * n as f64) as usize % n.max(1)
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(1e-300);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// Where the zeros of a pruned matrix may fall.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Any position; exactly `round(sparsity * K)` zeros per row.
    Unstructured,
    /// `n` nonzeros (at most) in every group of `m` consecutive columns of a row.
    NM { n: usize, m: usize },
}

impl std::str::FromStr for Pattern {
    type Err = FormatError;
    fn from_str(s: &str) -> Result<Self> {
        if s == "unstructured" {
            return Ok(Pattern::Unstructured);
        }
        let bad =
            || FormatError::Pattern(format!("'{s}': expected 'unstructured' or N:M such as 2:4"));
        let (n, m) = s.split_once(':').ok_or_else(bad)?;
        let n: usize = n.trim().parse().map_err(|_| bad())?;
        let m: usize = m.trim().parse().map_err(|_| bad())?;
        if m == 0 || n == 0 || n > m {
            return Err(FormatError::Pattern(format!("'{s}': need 0 < N <= M")));
        }
        Ok(Pattern::NM { n, m })
    }
}

/// A nonzero weight value: roughly N(0, 0.02), never zero, finite in f16.
pub fn weight_value(rng: &mut SplitMix64) -> f16 {
    loop {
        let v = f16::from_f64(rng.normal() * 0.02);
        if v.to_bits() != 0 && v.to_bits() != 0x8000 && v.is_finite() {
            return v;
        }
    }
}

/// A random M x K matrix with the given sparsity and pattern. For `NM` the sparsity is fixed by
/// the pattern (1 - n/m) and `sparsity` is ignored.
pub fn sparse_matrix(
    rows: usize,
    cols: usize,
    sparsity: f64,
    pattern: Pattern,
    seed: u64,
) -> Result<DenseMatrix> {
    if !(0.0..1.0).contains(&sparsity) {
        return Err(FormatError::Sparsity(sparsity));
    }
    if rows == 0 || cols == 0 {
        return Err(FormatError::EmptyMatrix { rows, cols });
    }
    let len = crate::size::product("random matrix rows x cols", &[rows, cols])?;
    let mut data = Vec::new();
    data.try_reserve_exact(len).map_err(|_| {
        FormatError::Size(format!(
            "a {rows} x {cols} f16 matrix ({} bytes) cannot be allocated",
            len.saturating_mul(2)
        ))
    })?;
    data.resize(len, f16::ZERO);
    let mut rng = SplitMix64::new(seed);
    let mut cols_perm: Vec<usize> = (0..cols).collect();
    for r in 0..rows {
        let row = &mut data[r * cols..(r + 1) * cols];
        match pattern {
            Pattern::Unstructured => {
                let keep = cols - ((sparsity * cols as f64).round() as usize).min(cols);
                rng.shuffle(&mut cols_perm);
                for &c in &cols_perm[..keep] {
                    row[c] = weight_value(&mut rng);
                }
            }
            Pattern::NM { n, m } => {
                for g in (0..cols).step_by(m) {
                    let width = m.min(cols - g);
                    let mut idx: Vec<usize> = (0..width).collect();
                    rng.shuffle(&mut idx);
                    for &i in idx.iter().take(n.min(width)) {
                        row[g + i] = weight_value(&mut rng);
                    }
                }
            }
        }
    }
    DenseMatrix::new(rows, cols, data)
}

/// A random M x K matrix with balanced sparsity along the outputs: in every column, each group
/// of 16 consecutive rows (the last one possibly shorter) holds `slots` nonzeros (at most its
/// height) at random rows. The pattern `sieve_formats::balanced_cbc` stores without padding.
pub fn balanced_matrix(rows: usize, cols: usize, slots: usize, seed: u64) -> Result<DenseMatrix> {
    const GROUP: usize = 16;
    if slots == 0 || slots > GROUP {
        return Err(FormatError::Option(format!(
            "balanced matrix: slots per 16 rows must be in 1..=16, got {slots}"
        )));
    }
    let dense = sparse_matrix(rows, cols, 0.0, Pattern::Unstructured, seed)?;
    let mut data = dense.data().to_vec();
    let mut rng = SplitMix64::new(seed ^ 0x6a09_e667_f3bc_c908);
    let mut idx: Vec<usize> = Vec::with_capacity(GROUP);
    for c in 0..cols {
        for g in (0..rows).step_by(GROUP) {
            let height = GROUP.min(rows - g);
            idx.clear();
            idx.extend(0..height);
            rng.shuffle(&mut idx);
            for &i in idx.iter().skip(slots.min(height)) {
                data[(g + i) * cols + c] = f16::ZERO;
            }
        }
    }
    DenseMatrix::new(rows, cols, data)
}

/// A random activation vector of length `len`, roughly N(0, 1), never all zero.
pub fn activations(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed ^ 0xa5a5_a5a5_a5a5_a5a5);
    (0..len).map(|_| rng.normal() as f32).collect()
}

/// The threshold that makes a fraction `dp` of `x` inactive (|x| <= t), the empirical quantile
/// of |x|. `dp == 0` gives `None` (dense activations).
pub fn threshold_for_sparsity(x: &[f32], dp: f64) -> Result<Option<f32>> {
    if !(0.0..1.0).contains(&dp) {
        return Err(FormatError::Sparsity(dp));
    }
    if dp == 0.0 || x.is_empty() {
        return Ok(None);
    }
    let mut mags: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    mags.sort_by(f32::total_cmp);
    let k = ((dp * x.len() as f64).round() as usize).clamp(1, x.len());
    Ok(Some(mags[k - 1]))
}

/// A matrix for bit-exactness tests: a fraction `zero_fraction` of +0, the rest half special
/// values (-0, subnormals, ±65504, ±min normal) and half random finite f16 bit patterns.
pub fn extreme_matrix(
    rows: usize,
    cols: usize,
    zero_fraction: f64,
    seed: u64,
) -> Result<DenseMatrix> {
    const SPECIAL: [u16; 9] = [
        0x8000, 0x0001, 0x8001, 0x03ff, 0x83ff, 0x7bff, 0xfbff, 0x0400, 0x8400,
    ];
    let mut rng = SplitMix64::new(seed);
    let data = (0..rows * cols)
        .map(|_| {
            if rng.next_f64() < zero_fraction {
                f16::ZERO
            } else if rng.next_f64() < 0.5 {
                f16::from_bits(SPECIAL[rng.below(SPECIAL.len())])
            } else {
                // Any finite bit pattern: exponent field 0x1f (inf/NaN) is remapped.
                let bits = rng.next_u64() as u16;
                f16::from_bits(if bits & 0x7c00 == 0x7c00 {
                    bits & !0x4000
                } else {
                    bits
                })
            }
        })
        .collect();
    DenseMatrix::new(rows, cols, data)
}

#[cfg(test)]
mod lcg_tests {
    use super::Lcg;

    #[test]
    fn lcg_values_are_uniform_in_the_unit_interval_and_repeat_by_seed() {
        let a = Lcg(7).vec(10_000, 1.0);
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.03, "mean {mean}");
        let below_zero = a.iter().filter(|v| **v < 0.0).count();
        assert!((4_700..5_300).contains(&below_zero), "{below_zero}");
        assert_eq!(a, Lcg(7).vec(10_000, 1.0));
        assert_ne!(a, Lcg(8).vec(10_000, 1.0));
    }
}
