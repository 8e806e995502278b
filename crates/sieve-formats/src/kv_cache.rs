//! What one position of the KV cache stores: f16, or 8-bit integers with one scale per KV head.
//!
//! At long contexts the cache, not the weights, is what a decode step reads: SmolLM2-135M at
//! 8192 positions holds 30 layers x 8192 x 3 KV heads x 64 dims x 2 (K and V) x 2 bytes = 189 MB
//! of f16, against 270 MB of f16 weights (81 MB as Q4_1). The 8-bit cache stores each row of one
//! KV head (`head_dim` values of one position) as `i8` with one f32 scale:
//!
//! ```text
//!   f16 cache, one position of one layer:  [Hkv][hd] f16                    2·hd bytes per head
//!   int8 cache:                            [Hkv][hd] i8  +  [Hkv] f32 scale   hd + 4 bytes per head
//! ```
//!
//! (0.53x the bytes at hd = 64, 0.52x at 128). The scale is per (position, KV head) because keys
//! differ by orders of magnitude between heads (a few outlier channels per head, after RoPE) and
//! a position's scale can be fixed when it is written, so nothing is ever requantized.
//!
//! The rule ([`quantize_row`]), which the CPU and GPU caches apply identically:
//! `scale = max|x| / 127` (f32), `q = clamp(round_half_even(x / scale), -127, 127)`, and
//! `scale = 0, q = 0` for an all-zero row; a row is read back as `q · scale`. Non-finite inputs
//! (a broken model) give scale `inf`/NaN and read back as NaN rather than as plausible numbers.

/// How the cache stores keys and values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvPrecision {
    /// f16 (the reference; what llama.cpp keeps by default).
    #[default]
    F16,
    /// i8 with one f32 scale per (position, KV head) (module notes).
    Int8,
}

impl KvPrecision {
    /// The names the command line takes.
    pub const NAMES: [&'static str; 2] = ["f16", "int8"];

    pub fn parse(name: &str) -> Option<KvPrecision> {
        match name {
            "f16" => Some(KvPrecision::F16),
            "int8" | "i8" | "q8" => Some(KvPrecision::Int8),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvPrecision::F16 => "f16",
            KvPrecision::Int8 => "int8",
        }
    }

    /// Bytes one KV head's row (`head_dim` values of one position, K or V) takes.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvPrecision::F16 => 2 * head_dim,
            KvPrecision::Int8 => head_dim + std::mem::size_of::<f32>(),
        }
    }
}

impl std::fmt::Display for KvPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The largest stored magnitude.
pub const QMAX: f32 = 127.0;

/// Quantizes one KV head's row `x` into `q` (same length) and returns its scale (module notes).
pub fn quantize_row(x: &[f32], q: &mut [i8]) -> f32 {
    debug_assert_eq!(x.len(), q.len());
    // `f32::max` ignores NaN; a NaN input is caught below by the scale test instead.
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if x.iter().any(|v| v.is_nan()) {
        q.fill(0);
        return f32::NAN;
    }
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let scale = amax / QMAX;
    for (qv, &v) in q.iter_mut().zip(x) {
        // `as` saturates (and maps NaN to 0); the clamp keeps -128 out of the grid.
        *qv = (v / scale).round_ties_even().clamp(-QMAX, QMAX) as i8;
    }
    scale
}

/// `out[i] = q[i] · scale`.
pub fn dequantize_row(q: &[i8], scale: f32, out: &mut [f32]) {
    debug_assert_eq!(q.len(), out.len());
    for (o, &v) in out.iter_mut().zip(q) {
        *o = v as f32 * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_round_trip_and_sizes_are_what_the_notes_say() {
        for name in KvPrecision::NAMES {
            assert_eq!(KvPrecision::parse(name).unwrap().name(), name);
        }
        assert_eq!(KvPrecision::parse("f32"), None);
        assert_eq!(KvPrecision::F16.row_bytes(64), 128);
        assert_eq!(KvPrecision::Int8.row_bytes(64), 68);
    }

    #[test]
    fn zero_and_nan_rows_have_defined_results() {
        let mut q = [5i8; 4];
        assert_eq!(quantize_row(&[0.0; 4], &mut q), 0.0);
        assert_eq!(q, [0; 4]);
        let s = quantize_row(&[1.0, f32::NAN, 0.0, 2.0], &mut q);
        assert!(s.is_nan());
        let mut back = [0f32; 4];
        dequantize_row(&q, s, &mut back);
        assert!(back.iter().all(|v| v.is_nan()));
    }

    #[test]
    fn the_largest_magnitude_lands_on_the_grid_end() {
        let mut q = [0i8; 3];
        let s = quantize_row(&[-4.0, 1.0, 2.0], &mut q);
        assert_eq!(s, 4.0 / 127.0);
        assert_eq!(q[0], -127);
        assert_eq!(q[2], 64); // 2 / (4/127) = 63.5, half to even
    }

    proptest! {
        /// Every value reads back within half a grid step, and the row's largest magnitude
        /// reads back within f32 rounding of itself.
        #[test]
        fn read_back_is_within_half_a_step(x in proptest::collection::vec(-1e4f32..1e4, 1..256)) {
            let mut q = vec![0i8; x.len()];
            let s = quantize_row(&x, &mut q);
            let mut back = vec![0f32; x.len()];
            dequantize_row(&q, s, &mut back);
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in x.iter().zip(&back) {
                prop_assert!((a - b).abs() <= 0.5 * s * (1.0 + 1e-5) + amax * 1e-6, "{a} read back as {b}, scale {s}");
            }
            prop_assert!(q.iter().all(|&v| v != i8::MIN));
        }
    }
}
