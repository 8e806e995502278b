//! Dot products and conversions with an AVX2/FMA/F16C path and a portable one, chosen by the
//! process's SIMD level ([`crate::simd`]): the vector kernels of
//! [`crate::dense::FastDense`], the GEMM's f16 packing and the forward pass's attention
//! (softmax) and SwiGLU.

#[cfg(target_arch = "x86_64")]
use crate::simd::SimdLevel;
use half::f16;

/// Whether the AVX2 kernels run: the level is AVX2 or above. A level [`SimdLevel::detect`]
/// returns is supported by this CPU and includes AVX2, FMA and F16C, every feature the `x86`
/// functions below are compiled for.
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    SimdLevel::detect() >= SimdLevel::Avx2
}

/// `Σ w[i] · x[i]` with f16 weights; `w.len() == x.len()`.
pub fn dot_f16_f32(w: &[f16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the level includes the features the function is compiled for (`avx2`).
        return unsafe { x86::dot_f16_f32(w, x) };
    }
    w.iter().zip(x).map(|(a, b)| a.to_f32() * b).sum()
}

/// `Σ a[i] · b[i]` in f32.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as above.
        return unsafe { x86::dot_f32(a, b) };
    }
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `y[i] += alpha · x[i]`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += alpha * v;
    }
}

/// Converts f16 to f32; `dst.len() == src.len()`.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as above.
        return unsafe { x86::f16_to_f32(src, dst) };
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// `gate[i] = silu(gate[i]) · up[i]`, the SwiGLU product (`silu(g) = g / (1 + e^-g)`);
/// `gate.len() == up.len()`. Vectorised like [`softmax_scaled`]: a scalar `exp` per element
/// was a visible share of prefill and calibration.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as above.
        return unsafe { x86::silu_mul(gate, up) };
    }
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `row[i] = exp(row[i] - max)` in place, returning `Σ row[i]`: the unnormalised softmax of a
/// span whose partial sums are merged later (decode attention). Same exponential as
/// [`softmax_scaled`].
pub fn exp_shifted_sum(row: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as above.
        unsafe { x86::exp_scaled_shifted(row, 1.0, max) };
        return row.iter().sum();
    }
    row.iter_mut().for_each(|v| *v = (*v - max).exp());
    row.iter().sum()
}

/// Softmax of `scale · row` in place: `row[i] = exp(scale · (row[i] - max)) / Σ`.
/// `scale` must be positive (it is `1/sqrt(head_dim)`), so the maximum of the scaled row is
/// `scale · max`. The exponential is a polynomial approximation within a few ulp of `expf`
/// on AVX2 machines: a scalar `exp` per score was a large share of long-window attention.
pub fn softmax_scaled(row: &mut [f32], scale: f32) {
    if row.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as above.
        unsafe {
            let max = x86::max(row);
            x86::exp_scaled_shifted(row, scale, max);
        }
    } else {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        row.iter_mut().for_each(|v| *v = (scale * (*v - max)).exp());
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        row.iter_mut().for_each(|v| *v = (scale * (*v - max)).exp());
    }
    let sum: f32 = row.iter().sum();
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    /// The sum of the 8 lanes (the one horizontal sum of the crate's AVX2 kernels).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_f32(w: &[f16], x: &[f32]) -> f32 {
        let len = w.len().min(x.len());
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= len {
            for (j, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * j;
                *a = _mm256_fmadd_ps(load_f16(wp.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
            }
            i += 32;
        }
        while i + 8 <= len {
            acc[0] = _mm256_fmadd_ps(load_f16(wp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(sum);
        while i < len {
            s += w[i].to_f32() * x[i];
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let len = a.len().min(b.len());
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= len {
            for (j, c) in acc.iter_mut().enumerate() {
                let o = i + 8 * j;
                *c = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(o)), _mm256_loadu_ps(bp.add(o)), *c);
            }
            i += 32;
        }
        while i + 8 <= len {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(ap.add(i)),
                _mm256_loadu_ps(bp.add(i)),
                acc[0],
            );
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(sum);
        while i < len {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// `exp(x)` for `x` in [-87, 88] (clamped): Cephes-style range reduction
    /// `x = n·ln2 + r`, a degree-5 polynomial for `exp(r)` on |r| <= ln2/2, and `2^n` built
    /// in the exponent bits; within a few ulp of `expf`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp256(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
            _mm256_set1_ps(88.0),
        );
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(-2.121_944_4e-4),
            _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x),
        );
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3f32,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        y = _mm256_fmadd_ps(
            y,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let bits = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        );
        _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
    }

    /// `row[i] = exp(scale · (row[i] - max))`, flushed to 0 below `exp(-87)`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_scaled_shifted(row: &mut [f32], scale: f32, max: f32) {
        let len = row.len();
        let p = row.as_mut_ptr();
        let (vs, vm, lo) = (
            _mm256_set1_ps(scale),
            _mm256_set1_ps(max),
            _mm256_set1_ps(-87.0),
        );
        let mut i = 0;
        while i + 8 <= len {
            let x = _mm256_mul_ps(vs, _mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vm));
            let underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
            _mm256_storeu_ps(p.add(i), _mm256_andnot_ps(underflow, exp256(x)));
            i += 8;
        }
        while i < len {
            *p.add(i) = (scale * (*p.add(i) - max)).exp();
            i += 1;
        }
    }

    /// The largest element (`-inf` for an empty slice; NaN-free inputs).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn max(row: &[f32]) -> f32 {
        let len = row.len();
        let p = row.as_ptr();
        let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 8 <= len {
            acc = _mm256_max_ps(acc, _mm256_loadu_ps(p.add(i)));
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut m = lanes.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        for v in &row[i..] {
            m = m.max(*v);
        }
        m
    }

    /// `gate[i] = silu(gate[i]) · up[i]` with `silu(g) = g / (1 + exp(-g))`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
        let len = gate.len().min(up.len());
        let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i + 8 <= len {
            let gv = _mm256_loadu_ps(g.add(i));
            let e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(g.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.add(i))));
            i += 8;
        }
        while i < len {
            let gv = *g.add(i);
            *g.add(i) = gv / (1.0 + (-gv).exp()) * *u.add(i);
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        let len = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= len {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_f16(src.as_ptr().add(i)));
            i += 8;
        }
        while i < len {
            dst[i] = src[i].to_f32();
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len).map(|_| lcg(&mut s)).collect()
    }

    #[test]
    fn softmax_matches_f64_exp() {
        for len in [1usize, 7, 8, 9, 40, 1000] {
            let mut row: Vec<f32> = random(len, len as u64).iter().map(|v| 60.0 * v).collect();
            let scale = 0.125f32;
            let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
            let e: Vec<f64> = row
                .iter()
                .map(|v| (0.125 * (*v as f64 - max)).exp())
                .collect();
            let sum: f64 = e.iter().sum();
            softmax_scaled(&mut row, scale);
            for (got, want) in row.iter().zip(&e) {
                let want = want / sum;
                assert!(
                    (*got as f64 - want).abs() <= 1e-6 * want + 1e-30,
                    "{got} vs {want}"
                );
            }
        }
        // Far below the maximum the weights underflow to exactly 0.
        let mut row = vec![
            0.0f32, -2000.0, -2000.0, -2000.0, -2000.0, -2000.0, -2000.0, -2000.0,
        ];
        softmax_scaled(&mut row, 1.0);
        assert_eq!(row, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn silu_mul_matches_f64() {
        let gate: Vec<f32> = random(203, 4).iter().map(|v| 40.0 * v).collect();
        let up = random(203, 5);
        let mut got = gate.clone();
        silu_mul(&mut got, &up);
        for ((g, u), o) in gate.iter().zip(&up).zip(&got) {
            let (g, u) = (*g as f64, *u as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (*o as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{o} vs {want}"
            );
        }
        let mut extreme = vec![-200.0f32, 200.0, 0.0, -90.0, 90.0, 1.0, -1.0, 3.0];
        silu_mul(&mut extreme, &[1.0; 8]);
        assert!(extreme[0].abs() < 1e-30 && extreme[1] == 200.0 && extreme[2] == 0.0);
        assert!(extreme.iter().all(|v| v.is_finite()));
    }
}
