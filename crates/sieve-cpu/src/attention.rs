//! Decode-time attention over the f16 KV cache, with grouped reads.
//!
//! After a long prompt the attention of one decode step reads the whole cache of every layer:
//! at 512 positions SmolLM2-135M's f32 cache was 23.6 MB per token (30 layers x 512 x 3 KV heads
//! x 64 dims x 2 x 4 bytes), a quarter of the Q4_1 weights, and each of the 3 query heads of a
//! KV head read it again. Here the cache holds f16 (half the bytes), and one task reads each
//! cached key and value row once for all the query heads that share its KV head: the row is
//! widened to f32 in L1 and used by every head of the group.
//!
//! Work is split over (KV head, span of positions) tasks, each with its own softmax maximum and
//! sum; the spans are merged exactly (flash-decoding): with per-span maxima `m_s`, sums `l_s` and
//! unnormalised outputs `o_s`, the result is `Σ e^(m_s - M) o_s / Σ e^(m_s - M) l_s` with
//! `M = max m_s`. So two threads share even a model with fewer KV heads than threads, and the
//! result equals the single-pass softmax up to f32 rounding.
//!
//! A task's two loops (scores, then the weighted values) come in three versions ([`Loops`]):
//! AVX-512, AVX2 + F16C and portable, picked once per call from the process's SIMD level
//! ([`crate::simd`]) and the head dimension; the portable loops are the reference the others
//! are tested against.
//!
//! The cache may also hold 8-bit rows ([`CachedLayer::Int8`], the rule in
//! [`sieve_formats::kv_cache`]): each row is widened from i8 without its scale, and the scale is
//! folded into the scalar each row meets anyway: `score = (scale · s_k) · q · k_int` and
//! `out += (p · s_v) · v_int`. Half the bytes per cached row; the same task split and merge.

use crate::kernels;
use crate::simd::SimdLevel;
use half::f16;
use rayon::prelude::*;

/// The fewest positions a task takes: below this the task's fixed costs (a rayon split, the
/// merge) outweigh the rows it reads.
const MIN_SPAN: usize = 64;

/// Attention geometry: query heads, KV heads, head dimension.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// One layer's cached keys and values, positions `[pos][Hkv][hd]`, as the cache stores them.
#[derive(Clone, Copy, Debug)]
pub enum CachedLayer<'a> {
    F16 {
        keys: &'a [f16],
        values: &'a [f16],
    },
    /// i8 rows with one f32 scale per (position, KV head): `key_scales[pos · Hkv + kv head]`.
    Int8 {
        keys: &'a [i8],
        values: &'a [i8],
        key_scales: &'a [f32],
        value_scales: &'a [f32],
    },
}

/// One span's share of the attention of the query heads of one KV head.
struct Partial {
    /// Per head of the group: the largest scaled score of the span.
    max: Vec<f32>,
    /// Per head: `Σ e^(s - max)` over the span.
    sum: Vec<f32>,
    /// Per head, `head_dim` values: `Σ e^(s - max) · v`.
    out: Vec<f32>,
}

/// Attention of one query token (`q`: `[H][hd]`) over the first `visible` positions of one
/// layer's cache (`cache`: `[pos][Hkv][hd]`), into `att` (`[H][hd]`). Query head `h` reads KV
/// head `h / (H / Hkv)`.
pub fn attend_one(heads: Heads, q: &[f32], cache: CachedLayer, visible: usize, att: &mut [f32]) {
    let Heads {
        q_heads: nh,
        kv_heads: nkv,
        head_dim: hd,
    } = heads;
    let group = nh / nkv;
    let row = nkv * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let loops = Loops::of(SimdLevel::detect(), hd);
    // Enough tasks to keep every thread busy (four per thread), none shorter than MIN_SPAN.
    let want = (4 * rayon::current_num_threads()).div_ceil(nkv).max(1);
    let spans = (visible / MIN_SPAN).clamp(1, want);
    let span = visible.div_ceil(spans);
    let spans = visible.div_ceil(span);
    let partials: Vec<Partial> = (0..nkv * spans)
        .into_par_iter()
        .map(|task| {
            let (kvh, s) = (task / spans, task % spans);
            let (start, end) = (s * span, ((s + 1) * span).min(visible));
            let len = end - start;
            let qs = &q[kvh * group * hd..(kvh + 1) * group * hd];
            let mut scores = vec![0f32; group * len];
            let mut out = vec![0f32; group * hd];
            // Per head of the group: the span's largest score and `Σ e^(s - max)`, the
            // scores turned into those unnormalised probabilities in place.
            let probabilities = |scores: &mut [f32]| {
                let mut max = vec![f32::NEG_INFINITY; group];
                let mut sum = vec![0f32; group];
                for g in 0..group {
                    let sc = &mut scores[g * len..(g + 1) * len];
                    max[g] = sc.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
                    sum[g] = kernels::exp_shifted_sum(sc, max[g]);
                }
                (max, sum)
            };
            let offset = kvh * hd;
            let (max, sum) = match cache {
                CachedLayer::F16 { keys, values } => {
                    let rows = Rows {
                        keys,
                        values,
                        row,
                        offset,
                        start,
                        end,
                    };
                    loops.scores(qs, &rows, hd, scale, &mut scores);
                    let parts = probabilities(&mut scores);
                    loops.accumulate(&scores, &rows, hd, &mut out);
                    parts
                }
                CachedLayer::Int8 {
                    keys,
                    values,
                    key_scales,
                    value_scales,
                } => {
                    let rows = Rows {
                        keys,
                        values,
                        row,
                        offset,
                        start,
                        end,
                    };
                    let scales = Scales {
                        keys: key_scales,
                        values: value_scales,
                        kv_heads: nkv,
                        head: kvh,
                    };
                    loops.scores_i8(qs, &rows, &scales, hd, scale, &mut scores);
                    let parts = probabilities(&mut scores);
                    loops.accumulate_i8(&scores, &rows, &scales, hd, &mut out);
                    parts
                }
            };
            Partial { max, sum, out }
        })
        .collect();
    for kvh in 0..nkv {
        let parts = &partials[kvh * spans..(kvh + 1) * spans];
        for g in 0..group {
            let h = kvh * group + g;
            let top = parts.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.max[g]));
            let o = &mut att[h * hd..(h + 1) * hd];
            o.fill(0.0);
            let mut denom = 0f32;
            for p in parts {
                let w = (p.max[g] - top).exp();
                denom += w * p.sum[g];
                kernels::axpy(w, &p.out[g * hd..(g + 1) * hd], o);
            }
            let inv = 1.0 / denom;
            o.iter_mut().for_each(|v| *v *= inv);
        }
    }
}

/// The cached rows one task reads: positions `start..end` of one KV head (`offset` into each
/// `row`-wide position).
struct Rows<'a, T> {
    keys: &'a [T],
    values: &'a [T],
    row: usize,
    offset: usize,
    start: usize,
    end: usize,
}

/// The scales of an 8-bit cache's rows of one KV head (`head` of `kv_heads`).
struct Scales<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    kv_heads: usize,
    head: usize,
}

impl Scales<'_> {
    fn key(&self, position: usize) -> f32 {
        self.keys[position * self.kv_heads + self.head]
    }
    fn value(&self, position: usize) -> f32 {
        self.values[position * self.kv_heads + self.head]
    }
}

/// `scores[g · len + i] = scale · q_g · k_(start + i)` for each query head `g` of the group,
/// each key row widened once.
fn scores_portable(qs: &[f32], rows: &Rows<f16>, hd: usize, scale: f32, scores: &mut [f32]) {
    let len = rows.end - rows.start;
    let mut wide = vec![0f32; hd];
    for (i, p) in (rows.start..rows.end).enumerate() {
        let at = p * rows.row + rows.offset;
        kernels::f16_to_f32(&rows.keys[at..at + hd], &mut wide);
        for (g, qv) in qs.chunks_exact(hd).enumerate() {
            scores[g * len + i] = kernels::dot_f32(qv, &wide) * scale;
        }
    }
}

/// `out_g += Σ_i weights[g · len + i] · v_(start + i)`, each value row widened once.
fn accumulate_portable(weights: &[f32], rows: &Rows<f16>, hd: usize, out: &mut [f32]) {
    let len = rows.end - rows.start;
    let mut wide = vec![0f32; hd];
    for (i, p) in (rows.start..rows.end).enumerate() {
        let at = p * rows.row + rows.offset;
        kernels::f16_to_f32(&rows.values[at..at + hd], &mut wide);
        for (g, o) in out.chunks_exact_mut(hd).enumerate() {
            kernels::axpy(weights[g * len + i], &wide, o);
        }
    }
}

/// `wide[j] = q[j]` as f32 (the row's scale is applied by the caller).
fn widen_i8(q: &[i8], wide: &mut [f32]) {
    for (w, &v) in wide.iter_mut().zip(q) {
        *w = v as f32;
    }
}

/// [`scores_portable`] over 8-bit rows: `scale · s_k(p) · q_g · k_int(p)`.
fn scores_portable_i8(
    qs: &[f32],
    rows: &Rows<i8>,
    scales: &Scales,
    hd: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let len = rows.end - rows.start;
    let mut wide = vec![0f32; hd];
    for (i, p) in (rows.start..rows.end).enumerate() {
        let at = p * rows.row + rows.offset;
        widen_i8(&rows.keys[at..at + hd], &mut wide);
        let row_scale = scale * scales.key(p);
        for (g, qv) in qs.chunks_exact(hd).enumerate() {
            scores[g * len + i] = kernels::dot_f32(qv, &wide) * row_scale;
        }
    }
}

/// [`accumulate_portable`] over 8-bit rows: `out_g += (w · s_v(p)) · v_int(p)`.
fn accumulate_portable_i8(
    weights: &[f32],
    rows: &Rows<i8>,
    scales: &Scales,
    hd: usize,
    out: &mut [f32],
) {
    let len = rows.end - rows.start;
    let mut wide = vec![0f32; hd];
    for (i, p) in (rows.start..rows.end).enumerate() {
        let at = p * rows.row + rows.offset;
        widen_i8(&rows.values[at..at + hd], &mut wide);
        let row_scale = scales.value(p);
        for (g, o) in out.chunks_exact_mut(hd).enumerate() {
            kernels::axpy(weights[g * len + i] * row_scale, &wide, o);
        }
    }
}

/// Which version of a task's two loops runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loops {
    Portable,
    /// AVX2 + FMA + F16C, head dims a multiple of 8.
    Avx2,
    /// AVX-512 F (+ AVX2, FMA, F16C), head dims a multiple of 16.
    Avx512,
}

impl Loops {
    /// The widest loops `level` runs for head dim `hd`. `level` is capped by what this CPU
    /// supports ([`SimdLevel::best`]), so a SIMD version is only chosen where the CPU has
    /// every feature it is compiled for (the invariant the `unsafe` calls below rely on).
    fn of(level: SimdLevel, hd: usize) -> Loops {
        let level = level.min(SimdLevel::best());
        if hd.is_multiple_of(16) && level >= SimdLevel::Avx512 {
            Loops::Avx512
        } else if hd.is_multiple_of(8) && level >= SimdLevel::Avx2 {
            Loops::Avx2
        } else {
            Loops::Portable
        }
    }

    /// `scores[g · len + i] = scale · q_g · k_(start + i)` ([`scores_portable`]).
    fn scores(self, qs: &[f32], rows: &Rows<f16>, hd: usize, scale: f32, scores: &mut [f32]) {
        match self {
            // SAFETY: `Loops::of` chose this version, so the CPU has AVX-512 F, AVX2, FMA and
            // F16C, and `hd` is a multiple of 16; every row read lies inside `keys` / `values`
            // (`Rows` positions below what the caller made visible), and the buffers have the
            // sizes the kernel indexes (`group · len` scores, `hd`-wide q's).
            #[cfg(target_arch = "x86_64")]
            Loops::Avx512 => unsafe { x86::scores_avx512(qs, rows, hd, scale, scores) },
            // SAFETY: as above, with AVX2, FMA and F16C and `hd` a multiple of 8.
            #[cfg(target_arch = "x86_64")]
            Loops::Avx2 => unsafe { x86::scores(qs, rows, hd, scale, scores) },
            _ => scores_portable(qs, rows, hd, scale, scores),
        }
    }

    /// `out_g += Σ_i weights[g · len + i] · v_(start + i)` ([`accumulate_portable`]).
    fn accumulate(self, weights: &[f32], rows: &Rows<f16>, hd: usize, out: &mut [f32]) {
        match self {
            // SAFETY: as in `scores` (`group · len` weights, `group · hd` outputs).
            #[cfg(target_arch = "x86_64")]
            Loops::Avx512 => unsafe { x86::accumulate_avx512(weights, rows, hd, out) },
            // SAFETY: as in `scores`.
            #[cfg(target_arch = "x86_64")]
            Loops::Avx2 => unsafe { x86::accumulate(weights, rows, hd, out) },
            _ => accumulate_portable(weights, rows, hd, out),
        }
    }

    /// [`Self::scores`] over 8-bit rows ([`scores_portable_i8`]); the AVX-512 level runs the
    /// AVX2 loops (the widening, not the FMAs, is what an i8 row costs).
    fn scores_i8(
        self,
        qs: &[f32],
        rows: &Rows<i8>,
        scales: &Scales,
        hd: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        match self {
            // SAFETY: `Loops::of` chose AVX2 or AVX-512 (each level includes AVX2, FMA and
            // F16C), so the CPU has them, and `hd` is a multiple of 8; the rows read lie inside `keys`
            // and the scales inside `scales.keys` (positions below what the caller made
            // visible); `scores` holds `group · len` values.
            #[cfg(target_arch = "x86_64")]
            Loops::Avx2 | Loops::Avx512 => unsafe {
                x86::scores_i8(qs, rows, scales, hd, scale, scores)
            },
            _ => scores_portable_i8(qs, rows, scales, hd, scale, scores),
        }
    }

    /// [`Self::accumulate`] over 8-bit rows ([`accumulate_portable_i8`]).
    fn accumulate_i8(
        self,
        weights: &[f32],
        rows: &Rows<i8>,
        scales: &Scales,
        hd: usize,
        out: &mut [f32],
    ) {
        match self {
            // SAFETY: as in `scores_i8` (`group · len` weights, `group · hd` outputs).
            #[cfg(target_arch = "x86_64")]
            Loops::Avx2 | Loops::Avx512 => unsafe {
                x86::accumulate_i8(weights, rows, scales, hd, out)
            },
            _ => accumulate_portable_i8(weights, rows, scales, hd, out),
        }
    }
}

/// The two loops of a task with AVX2 + F16C, for head dims that are a multiple of 8: rows are
/// widened four at a time into an L1 tile (f16 by `vcvtph2ps`, i8 by `vpmovsxbd`), then every
/// head of the group takes the tile: the scores of four rows share each load of q and one
/// horizontal reduction, and the weighted values of four rows share each load and store of the
/// output (against one reduction, and one output load and store, per row before: decode at
/// 8000 positions 1.17x with either cache, docs/BENCHMARKS.md).
/// With AVX-512 (head dims a multiple of 16) each row is widened 16 values at a time straight
/// into registers (`vcvtph2ps` from memory), no buffer: half the instructions per cached row.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Rows, Scales};
    use half::f16;
    use std::arch::x86_64::*;

    /// Rows per tile of the AVX2 loops.
    const TILE: usize = 4;

    /// Where a task's cached rows are: f16, or i8 widened without their scale.
    #[derive(Clone, Copy)]
    enum Src {
        F16(*const f16),
        I8(*const i8),
    }

    /// Widens the row at element `at` of `src` into `dst` (`hd` floats, a multiple of 8).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen(src: Src, at: usize, dst: *mut f32, hd: usize) {
        match src {
            Src::F16(p) => {
                for j in (0..hd).step_by(8) {
                    let v = _mm256_cvtph_ps(_mm_loadu_si128(p.add(at + j) as *const __m128i));
                    _mm256_storeu_ps(dst.add(j), v);
                }
            }
            Src::I8(p) => {
                for j in (0..hd).step_by(8) {
                    let bytes = _mm_loadl_epi64(p.add(at + j) as *const __m128i);
                    _mm256_storeu_ps(dst.add(j), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
                }
            }
        }
    }

    /// Widens the tile's `n <= TILE` rows from position `p` into `wide` (`TILE · hd` floats);
    /// rows past `n` are zeroed so that the tile's sums stay finite.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_tile<T>(
        src: Src,
        rows: &Rows<T>,
        p: usize,
        n: usize,
        wide: &mut [f32],
        hd: usize,
    ) {
        for r in 0..TILE {
            let dst = wide.as_mut_ptr().add(r * hd);
            if r < n {
                widen(src, (p + r) * rows.row + rows.offset, dst, hd);
            } else {
                std::ptr::write_bytes(dst, 0, hd);
            }
        }
    }

    /// `q · w_r` for the tile's four widened rows `w_r = w + r · hd`: one load of q per 8
    /// values for four rows, and one horizontal reduction for the four sums.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot4(q: *const f32, w: *const f32, hd: usize) -> __m128 {
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        for j in (0..hd).step_by(8) {
            let qv = _mm256_loadu_ps(q.add(j));
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(w.add(j)), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(w.add(hd + j)), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(w.add(2 * hd + j)), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(w.add(3 * hd + j)), a3);
        }
        // Within each 128-bit lane: [Σa0, Σa1, Σa2, Σa3] of its half; then the halves added.
        let h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1))
    }

    /// Scores of the task's rows, four at a time: `scores[g · len + i] = row_scale(i) · q_g ·
    /// k_i`, with `row_scale` the attention scale times the row's key scale (8-bit rows).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_tiled<T>(
        src: Src,
        qs: &[f32],
        rows: &Rows<T>,
        scales: Option<&Scales>,
        hd: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        let len = rows.end - rows.start;
        let group = qs.len() / hd;
        let mut wide = vec![0f32; TILE * hd];
        let mut tile_scale = [scale; TILE];
        for t in (0..len).step_by(TILE) {
            let n = (len - t).min(TILE);
            let p = rows.start + t;
            widen_tile(src, rows, p, n, &mut wide, hd);
            if let Some(s) = scales {
                for (r, ts) in tile_scale.iter_mut().enumerate().take(n) {
                    *ts = scale * s.key(p + r);
                }
            }
            let row_scale = _mm_loadu_ps(tile_scale.as_ptr());
            for g in 0..group {
                let s = _mm_mul_ps(dot4(qs.as_ptr().add(g * hd), wide.as_ptr(), hd), row_scale);
                let mut four = [0f32; TILE];
                _mm_storeu_ps(four.as_mut_ptr(), s);
                scores[g * len + t..g * len + t + n].copy_from_slice(&four[..n]);
            }
        }
    }

    /// `out_g += Σ_i weights[g · len + i] · row_scale(i) · v_i`, four rows at a time: each
    /// output chunk loaded and stored once per tile, not once per row.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate_tiled<T>(
        src: Src,
        weights: &[f32],
        rows: &Rows<T>,
        scales: Option<&Scales>,
        hd: usize,
        out: &mut [f32],
    ) {
        let len = rows.end - rows.start;
        let group = out.len() / hd;
        let mut wide = vec![0f32; TILE * hd];
        let w = wide.as_ptr();
        for t in (0..len).step_by(TILE) {
            let n = (len - t).min(TILE);
            let p = rows.start + t;
            widen_tile(src, rows, p, n, &mut wide, hd);
            for g in 0..group {
                let mut f = [0f32; TILE];
                for (r, fr) in f.iter_mut().enumerate().take(n) {
                    let value_scale = scales.map_or(1.0, |s| s.value(p + r));
                    *fr = weights[g * len + t + r] * value_scale;
                }
                let (f0, f1, f2, f3) = (
                    _mm256_set1_ps(f[0]),
                    _mm256_set1_ps(f[1]),
                    _mm256_set1_ps(f[2]),
                    _mm256_set1_ps(f[3]),
                );
                let o = out.as_mut_ptr().add(g * hd);
                for j in (0..hd).step_by(8) {
                    let mut acc = _mm256_loadu_ps(o.add(j));
                    acc = _mm256_fmadd_ps(f0, _mm256_loadu_ps(w.add(j)), acc);
                    acc = _mm256_fmadd_ps(f1, _mm256_loadu_ps(w.add(hd + j)), acc);
                    acc = _mm256_fmadd_ps(f2, _mm256_loadu_ps(w.add(2 * hd + j)), acc);
                    acc = _mm256_fmadd_ps(f3, _mm256_loadu_ps(w.add(3 * hd + j)), acc);
                    _mm256_storeu_ps(o.add(j), acc);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores(qs: &[f32], rows: &Rows<f16>, hd: usize, scale: f32, scores: &mut [f32]) {
        scores_tiled(
            Src::F16(rows.keys.as_ptr()),
            qs,
            rows,
            None,
            hd,
            scale,
            scores,
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn accumulate(weights: &[f32], rows: &Rows<f16>, hd: usize, out: &mut [f32]) {
        accumulate_tiled(Src::F16(rows.values.as_ptr()), weights, rows, None, hd, out)
    }

    /// [`scores`] over 8-bit rows (the module notes of the file: the scale joins `scale`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores_i8(
        qs: &[f32],
        rows: &Rows<i8>,
        scales: &Scales,
        hd: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        scores_tiled(
            Src::I8(rows.keys.as_ptr()),
            qs,
            rows,
            Some(scales),
            hd,
            scale,
            scores,
        )
    }

    /// [`accumulate`] over 8-bit rows: each weight times the row's value scale.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn accumulate_i8(
        weights: &[f32],
        rows: &Rows<i8>,
        scales: &Scales,
        hd: usize,
        out: &mut [f32],
    ) {
        accumulate_tiled(
            Src::I8(rows.values.as_ptr()),
            weights,
            rows,
            Some(scales),
            hd,
            out,
        )
    }

    /// [`scores`] with 512-bit registers (`hd` a multiple of 16).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn scores_avx512(
        qs: &[f32],
        rows: &Rows<f16>,
        hd: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        let len = rows.end - rows.start;
        let group = qs.len() / hd;
        for (i, p) in (rows.start..rows.end).enumerate() {
            let k = rows.keys.as_ptr().add(p * rows.row + rows.offset);
            for g in 0..group {
                let q = qs.as_ptr().add(g * hd);
                let mut acc = _mm512_setzero_ps();
                for j in (0..hd).step_by(16) {
                    let kv = _mm512_cvtph_ps(_mm256_loadu_si256(k.add(j) as *const __m256i));
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(j)), kv, acc);
                }
                *scores.get_unchecked_mut(g * len + i) = _mm512_reduce_add_ps(acc) * scale;
            }
        }
    }

    /// [`accumulate`] with 512-bit registers (`hd` a multiple of 16).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn accumulate_avx512(weights: &[f32], rows: &Rows<f16>, hd: usize, out: &mut [f32]) {
        let len = rows.end - rows.start;
        let group = out.len() / hd;
        for (i, p) in (rows.start..rows.end).enumerate() {
            let v = rows.values.as_ptr().add(p * rows.row + rows.offset);
            for j in (0..hd).step_by(16) {
                let vv = _mm512_cvtph_ps(_mm256_loadu_si256(v.add(j) as *const __m256i));
                for g in 0..group {
                    let s = _mm512_set1_ps(*weights.get_unchecked(g * len + i));
                    let o = out.as_mut_ptr().add(g * hd + j);
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(s, vv, _mm512_loadu_ps(o)));
                }
            }
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
        (*seed >> 33) as f32 / (1u64 << 31) as f32 - 0.5
    }

    /// The plain f64 softmax attention of one query token over f32 keys and values.
    fn reference(heads: Heads, q: &[f32], k: &[f32], v: &[f32], visible: usize) -> Vec<f64> {
        let Heads {
            q_heads: nh,
            kv_heads: nkv,
            head_dim: hd,
        } = heads;
        let row = nkv * hd;
        let mut out = vec![0f64; nh * hd];
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let s: Vec<f64> = (0..visible)
                .map(|p| {
                    (0..hd)
                        .map(|i| q[h * hd + i] as f64 * k[p * row + kvh * hd + i] as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for p in 0..visible {
                let w = (s[p] - m).exp() / z;
                for i in 0..hd {
                    out[h * hd + i] += w * v[p * row + kvh * hd + i] as f64;
                }
            }
        }
        out
    }

    /// Every SIMD version of a task's two loops against the portable one on the same rows.
    #[test]
    fn every_kernel_matches_the_portable_loops() {
        let mut seed = 11u64;
        for &(nkv, group, hd, visible, start) in &[
            (3, 3, 64, 133, 5),
            (2, 2, 16, 40, 0),
            (1, 4, 32, 7, 3),
            (2, 3, 64, 23, 2),
            (1, 1, 8, 3, 1),
        ] {
            let row = nkv * hd;
            let keys = round16(
                &(0..visible * row)
                    .map(|_| 4.0 * lcg(&mut seed))
                    .collect::<Vec<_>>(),
            );
            let values = round16(
                &(0..visible * row)
                    .map(|_| 2.0 * lcg(&mut seed))
                    .collect::<Vec<_>>(),
            );
            let qs: Vec<f32> = (0..group * hd).map(|_| 3.0 * lcg(&mut seed)).collect();
            let rows = Rows {
                keys: &keys,
                values: &values,
                row,
                offset: (nkv - 1) * hd,
                start,
                end: visible,
            };
            let len = visible - start;
            let weights: Vec<f32> = (0..group * len).map(|_| lcg(&mut seed).abs()).collect();
            let mut want_s = vec![0f32; group * len];
            scores_portable(&qs, &rows, hd, 0.125, &mut want_s);
            let mut want_o = vec![0.5f32; group * hd];
            accumulate_portable(&weights, &rows, hd, &mut want_o);
            let close = |a: &[f32], b: &[f32], what: &str| {
                for (x, y) in a.iter().zip(b) {
                    assert!(
                        (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                        "{what}: {x} vs {y}"
                    );
                }
            };
            // The same rows in 8 bits: the int8 loops against their portable version.
            let widen = |x: &[f16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            let (keys8, key_scales) = quantize8(&widen(&keys), hd);
            let (values8, value_scales) = quantize8(&widen(&values), hd);
            let rows8 = Rows {
                keys: &keys8,
                values: &values8,
                row,
                offset: (nkv - 1) * hd,
                start,
                end: visible,
            };
            let scales = Scales {
                keys: &key_scales,
                values: &value_scales,
                kv_heads: nkv,
                head: nkv - 1,
            };
            let mut want_s8 = vec![0f32; group * len];
            scores_portable_i8(&qs, &rows8, &scales, hd, 0.125, &mut want_s8);
            let mut want_o8 = vec![0.5f32; group * hd];
            accumulate_portable_i8(&weights, &rows8, &scales, hd, &mut want_o8);
            // The 8-bit rows are close to the f16 ones (half a grid step per value), so the
            // portable int8 loops are not trivially equal to themselves only.
            for (x, y) in want_s8.iter().zip(&want_s) {
                assert!(
                    (x - y).abs() <= 0.05 * (1.0 + y.abs()),
                    "int8 score {x} vs f16 {y}"
                );
            }
            for level in SimdLevel::available() {
                let loops = Loops::of(level, hd);
                let mut s = vec![0f32; group * len];
                let mut o = vec![0.5f32; group * hd];
                loops.scores(&qs, &rows, hd, 0.125, &mut s);
                loops.accumulate(&weights, &rows, hd, &mut o);
                close(&s, &want_s, &format!("{loops:?} scores"));
                close(&o, &want_o, &format!("{loops:?} accumulate"));
                let mut s = vec![0f32; group * len];
                let mut o = vec![0.5f32; group * hd];
                loops.scores_i8(&qs, &rows8, &scales, hd, 0.125, &mut s);
                loops.accumulate_i8(&weights, &rows8, &scales, hd, &mut o);
                close(&s, &want_s8, &format!("{loops:?} int8 scores"));
                close(&o, &want_o8, &format!("{loops:?} int8 accumulate"));
            }
        }
    }

    /// `[pos][Hkv][hd]` f32 rows quantized by the cache's rule, one scale per `hd` values.
    fn quantize8(x: &[f32], hd: usize) -> (Vec<i8>, Vec<f32>) {
        let mut q = vec![0i8; x.len()];
        let scales = x
            .chunks_exact(hd)
            .zip(q.chunks_exact_mut(hd))
            .map(|(xr, qr)| sieve_formats::kv_cache::quantize_row(xr, qr))
            .collect();
        (q, scales)
    }

    fn dequantize8(q: &[i8], scales: &[f32], hd: usize) -> Vec<f32> {
        let mut out = vec![0f32; q.len()];
        for ((qr, o), &s) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).zip(scales) {
            sieve_formats::kv_cache::dequantize_row(qr, s, o);
        }
        out
    }

    fn round16(x: &[f32]) -> Vec<f16> {
        x.iter().map(|&v| f16::from_f32(v)).collect()
    }

    /// Against f64 attention over the same stored (f16 or 8-bit) keys and values: only f32
    /// rounding and the span merge separate them. Against f64 attention over the f32 keys and
    /// values before storage: within the bound the storage allows, derived per query head from
    /// the data: each score moves by at most `δ = Σ|q_i| · max|k - k_stored| / sqrt(hd)`, which
    /// scales every softmax weight by a factor in `[e^-2δ, e^2δ]`, so the output moves by at
    /// most `(e^2δ - 1) · max|v| + max|v - v_stored|`.
    fn check_cache_attention_against_references(int8: bool) {
        let mut seed = 7u64;
        for &(nh, nkv, hd, visible) in &[
            (9, 3, 64, 512),
            (9, 3, 64, 1),
            (4, 2, 6, 37),
            (4, 4, 8, 200),
            (8, 1, 16, 1000),
        ] {
            let heads = Heads {
                q_heads: nh,
                kv_heads: nkv,
                head_dim: hd,
            };
            let row = nkv * hd;
            let q: Vec<f32> = (0..nh * hd).map(|_| 3.0 * lcg(&mut seed)).collect();
            let k: Vec<f32> = (0..visible * row).map(|_| 4.0 * lcg(&mut seed)).collect();
            let v: Vec<f32> = (0..visible * row).map(|_| 2.0 * lcg(&mut seed)).collect();
            let (k16, v16) = (round16(&k), round16(&v));
            let (k8, ks) = quantize8(&k, hd);
            let (v8, vs) = quantize8(&v, hd);
            let mut att = vec![f32::NAN; nh * hd];
            let widen = |x: &[f16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            let (cache, k_stored, v_stored) = if int8 {
                let cache = CachedLayer::Int8 {
                    keys: &k8,
                    values: &v8,
                    key_scales: &ks,
                    value_scales: &vs,
                };
                (cache, dequantize8(&k8, &ks, hd), dequantize8(&v8, &vs, hd))
            } else {
                let cache = CachedLayer::F16 {
                    keys: &k16,
                    values: &v16,
                };
                (cache, widen(&k16), widen(&v16))
            };
            attend_one(heads, &q, cache, visible, &mut att);
            let exact_stored = reference(heads, &q, &k_stored, &v_stored, visible);
            let exact32 = reference(heads, &q, &k, &v, visible);
            let err = |a: &[f32], b: &[f32]| {
                a.iter().zip(b).fold(0f64, |m, (x, y)| {
                    m.max((*x as f64 - y.to_owned() as f64).abs())
                })
            };
            let k_err = err(&k, &k_stored);
            let v_err = err(&v, &v_stored);
            let v_max = v.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
            for h in 0..nh {
                let q_l1: f64 = q[h * hd..(h + 1) * hd].iter().map(|x| x.abs() as f64).sum();
                let delta = q_l1 * k_err / (hd as f64).sqrt();
                let bound = (2.0 * delta).exp_m1() * v_max + v_err;
                for i in 0..hd {
                    let got = att[h * hd + i] as f64;
                    let tight = 1e-5 * v_max;
                    assert!(
                        (got - exact_stored[h * hd + i]).abs() <= tight,
                        "int8 {int8} {nh}/{nkv}/{hd} @{visible} head {h}: {got} vs {}",
                        exact_stored[h * hd + i]
                    );
                    assert!(
                        (got - exact32[h * hd + i]).abs() <= bound + tight,
                        "int8 {int8} {nh}/{nkv}/{hd} @{visible} head {h}: {got} vs f32 {} (bound {bound})",
                        exact32[h * hd + i]
                    );
                }
            }
        }
    }

    #[test]
    fn f16_cache_attention_matches_the_f32_path_within_the_rounding_bound() {
        check_cache_attention_against_references(false);
    }

    #[test]
    fn int8_cache_attention_matches_the_f32_path_within_the_rounding_bound() {
        check_cache_attention_against_references(true);
    }
}
