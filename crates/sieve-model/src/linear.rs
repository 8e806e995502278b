//! `Linear`: the seam where any weight format plugs into the model.
//!
//! A `Linear` is `y = W · x (+ b)` with `W` (M outputs x K inputs) held as a
//! `Box<dyn WeightFormat>`, so a dense layer, a pruned layer in any sparse format, or a layer
//! loaded from a packed blob all look the same to the forward pass. An optional TEAL threshold
//! `t` makes the format skip inputs with `|x| <= t`.
//!
//! Dense layers built here use [`FastDense`]: the same f16 row-major matrix and the same blob
//! payload as `sieve_formats::dense::Dense` (so a blob written by one reads back as the other),
//! but with explicit AVX2/F16C kernels. Decoding one token is bound by memory bandwidth, and f16
//! halves the bytes per token against an f32 copy; converting with `vcvtph2ps` in the kernel
//! costs nothing measurable, while `half`'s per-element `to_f32` (a runtime CPU check per value)
//! blocks vectorisation and was several times slower.

use crate::error::{ModelError, Result};
use crate::weights::Tensor;
use rayon::prelude::*;
use sieve_formats::blob::ByteWriter;
use sieve_formats::format::{check_product_args, check_threshold, is_active};
use sieve_formats::{DenseMatrix, FormatKind, Storage, Threshold, WeightFormat};

pub mod balanced_rows;
pub mod gemm;
pub mod ie_bme_int;
pub mod quantized;
pub mod simd;
pub mod sparse;
pub mod tcbc_rows;

use quantized::QuantMatrix;

/// One linear layer: a packed weight matrix, an optional bias and an optional activation threshold.
#[derive(Debug)]
pub struct Linear {
    weight: Weight,
    bias: Option<Vec<f32>>,
    threshold: Threshold,
}

/// GGUF blocks are held by type so that [`Linear::forward_group`] can fuse their products;
/// every other format behind the trait.
#[derive(Debug)]
enum Weight {
    Blocks(QuantMatrix),
    Format(Box<dyn WeightFormat>),
}

impl Weight {
    fn format(&self) -> &dyn WeightFormat {
        match self {
            Weight::Blocks(q) => q,
            Weight::Format(f) => f.as_ref(),
        }
    }
}

impl Linear {
    /// Wraps any packed weight matrix (M x K).
    pub fn from_format(weight: Box<dyn WeightFormat>) -> Self {
        Self {
            weight: Weight::Format(weight),
            bias: None,
            threshold: None,
        }
    }

    /// Wraps a matrix of GGUF quantized blocks.
    pub fn from_quantized(weight: QuantMatrix) -> Self {
        Self {
            weight: Weight::Blocks(weight),
            bias: None,
            threshold: None,
        }
    }

    /// Builds a dense f16 layer from a row-major f32 matrix of `rows` x `cols`.
    pub fn from_dense_f32(rows: usize, cols: usize, data: &[f32]) -> Result<Self> {
        let matrix = DenseMatrix::from_f32(rows, cols, data)?;
        Ok(Self::from_format(Box::new(FastDense::new(matrix))))
    }

    /// Builds a dense f16 layer from a 2-D tensor of shape `[out_features, in_features]`.
    pub fn from_tensor(name: &str, tensor: &Tensor) -> Result<Self> {
        match tensor.shape.as_slice() {
            [rows, cols] => Self::from_dense_f32(*rows, *cols, &tensor.data),
            _ => Err(ModelError::InvalidArgument(format!(
                "tensor '{name}' has shape {:?}, a linear layer needs 2 dimensions",
                tensor.shape
            ))),
        }
    }

    /// Adds (or replaces) the bias; its length must be M.
    pub fn with_bias(mut self, bias: Vec<f32>) -> Result<Self> {
        if bias.len() != self.rows() {
            return Err(ModelError::InvalidArgument(format!(
                "bias has {} elements, the layer has {} outputs",
                bias.len(),
                self.rows()
            )));
        }
        if bias.iter().any(|b| !b.is_finite()) {
            return Err(ModelError::InvalidArgument(
                "bias has a non-finite value".into(),
            ));
        }
        self.bias = Some(bias);
        Ok(self)
    }

    /// Sets the TEAL activation threshold (`None` uses every input).
    pub fn set_threshold(&mut self, threshold: Threshold) -> Result<()> {
        check_threshold(threshold)?;
        self.threshold = threshold;
        Ok(())
    }

    pub fn threshold(&self) -> Threshold {
        self.threshold
    }
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }
    pub fn format(&self) -> &dyn WeightFormat {
        self.weight.format()
    }
    /// Whether the weights are GGUF quantized blocks (whose `format().kind()` reads as dense,
    /// the format they serialize to).
    pub fn is_quantized_blocks(&self) -> bool {
        matches!(self.weight, Weight::Blocks(_))
    }
    /// The GGUF block type, when the weights are quantized blocks.
    pub fn block_type(&self) -> Option<quantized::BlockType> {
        match &self.weight {
            Weight::Blocks(q) => Some(q.block_type()),
            _ => None,
        }
    }
    /// Replaces the weight matrix, keeping bias and threshold; the shape must not change.
    pub fn replace_format(&mut self, weight: Box<dyn WeightFormat>) -> Result<()> {
        if weight.rows() != self.rows() || weight.cols() != self.cols() {
            return Err(ModelError::InvalidArgument(format!(
                "replacement weight is {}x{}, the layer is {}x{}",
                weight.rows(),
                weight.cols(),
                self.rows(),
                self.cols()
            )));
        }
        self.weight = Weight::Format(weight);
        Ok(())
    }
    /// M, the number of outputs.
    pub fn rows(&self) -> usize {
        self.format().rows()
    }
    /// K, the number of inputs.
    pub fn cols(&self) -> usize {
        self.format().cols()
    }

    /// `Y = X · Wᵀ + b` for `n` rows of activations: `x` is n x K, `y` is n x M (row-major).
    /// One row goes through the format's `matvec`, several through its `matmul`.
    pub fn forward(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        if n == 1 {
            self.format().matvec(x, self.threshold, y)?;
        } else {
            self.format().matmul(x, n, self.threshold, y)?;
        }
        self.add_bias(y);
        Ok(())
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(bias.len()) {
                for (o, b) in row.iter_mut().zip(bias) {
                    *o += b;
                }
            }
        }
    }

    /// `ys[i] = linears[i].forward(x)` for layers that share their input (q/k/v, gate/up).
    /// Through GGUF blocks under one threshold, `x` is quantized once for all of them (and for
    /// one token a single parallel pass covers all their rows); otherwise each runs on its own.
    pub fn forward_group(
        linears: &[&Linear],
        x: &[f32],
        n: usize,
        ys: &mut [&mut [f32]],
    ) -> Result<()> {
        if linears.len() != ys.len() {
            return Err(ModelError::InvalidArgument(format!(
                "{} linears but {} outputs",
                linears.len(),
                ys.len()
            )));
        }
        let blocks: Option<Vec<&QuantMatrix>> = linears
            .iter()
            .map(|l| match &l.weight {
                Weight::Blocks(q) if l.threshold == linears[0].threshold => Some(q),
                _ => None,
            })
            .collect();
        if n == 1 {
            if let Some(mats) = int4_ie_bme_group(linears) {
                ie_bme_int::matvec_group(&mats, x, linears[0].threshold, ys)?;
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.add_bias(y);
                }
                return Ok(());
            }
            if let Some(mats) = format_group::<balanced_rows::FastBalancedCbc>(linears) {
                balanced_rows::matvec_group(&mats, x, linears[0].threshold, ys)?;
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.add_bias(y);
                }
                return Ok(());
            }
        }
        match blocks {
            Some(mats) => {
                let threshold = linears[0].threshold;
                for (m, y) in mats.iter().zip(ys.iter()) {
                    check_product_args(m.rows(), m.cols(), x, n, threshold, y)?;
                }
                if n == 1 {
                    quantized::matvec_group(&mats, x, threshold, ys);
                } else {
                    quantized::matmul_group(&mats, x, n, threshold, ys)?;
                }
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.add_bias(y);
                }
            }
            _ => {
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.forward(x, n, y)?;
                }
            }
        }
        Ok(())
    }
}

/// The IE-BME INT4 matrices of `linears` when every one of them is one and they share a
/// threshold (what [`ie_bme_int::matvec_group`] needs).
fn int4_ie_bme_group<'a>(linears: &[&'a Linear]) -> Option<Vec<&'a ie_bme_int::Int4IeBme>> {
    format_group(linears)
}

/// The weights of `linears` as `F` when every one of them is an `F` and they share a
/// threshold (what the group products of the fast formats need).
fn format_group<'a, F: 'static>(linears: &[&'a Linear]) -> Option<Vec<&'a F>> {
    linears
        .iter()
        .map(|l| match &l.weight {
            Weight::Format(f) if l.threshold == linears[0].threshold => {
                f.as_any()?.downcast_ref::<F>()
            }
            _ => None,
        })
        .collect()
}

/// Dense f16 weights with SIMD kernels; kind, storage and blob payload are those of
/// `sieve_formats::dense::Dense`.
#[derive(Clone, Debug, PartialEq)]
pub struct FastDense {
    matrix: DenseMatrix,
}

/// Weight rows per parallel task in the products: enough work per task to amortise rayon's
/// scheduling, few enough tasks to balance two to a few dozen threads.
const ROWS_PER_TASK: usize = 32;

impl FastDense {
    pub fn new(matrix: DenseMatrix) -> Self {
        Self { matrix }
    }
    pub fn matrix(&self) -> &DenseMatrix {
        &self.matrix
    }
}

fn masked(x: &[f32], threshold: Threshold) -> Vec<f32> {
    x.iter()
        .map(|&v| if is_active(v, threshold) { v } else { 0.0 })
        .collect()
}

impl WeightFormat for FastDense {
    fn kind(&self) -> FormatKind {
        FormatKind::Dense
    }
    fn rows(&self) -> usize {
        self.matrix.rows()
    }
    fn cols(&self) -> usize {
        self.matrix.cols()
    }
    fn storage(&self) -> Storage {
        Storage {
            payload_bytes: self.matrix.dense_bytes(),
            metadata_bytes: 0,
        }
    }
    fn decode(&self) -> DenseMatrix {
        self.matrix.clone()
    }

    fn matvec(
        &self,
        x: &[f32],
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), sieve_formats::FormatError> {
        let (m, k) = (self.rows(), self.cols());
        check_product_args(m, k, x, 1, threshold, y)?;
        let xm;
        let x = if threshold.is_some() {
            xm = masked(x, threshold);
            &xm[..]
        } else {
            x
        };
        let w = self.matrix.data();
        y.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(chunk, out)| {
                let r0 = chunk * ROWS_PER_TASK;
                for (i, o) in out.iter_mut().enumerate() {
                    let r = r0 + i;
                    *o = kernels::dot_f16_f32(&w[r * k..(r + 1) * k], x);
                }
            });
        Ok(())
    }

    fn matmul(
        &self,
        x: &[f32],
        n: usize,
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), sieve_formats::FormatError> {
        let (m, k) = (self.rows(), self.cols());
        check_product_args(m, k, x, n, threshold, y)?;
        let xm;
        let x = if threshold.is_some() {
            xm = masked(x, threshold);
            &xm[..]
        } else {
            x
        };
        // Y (n x M) = X (n x K) · Wᵀ: the GEMM reads W (M x K row-major) as its transpose and
        // converts it to f32 once while packing.
        let w = self.matrix.data();
        gemm::gemm(
            n,
            m,
            k,
            gemm::View::row_major(x, k),
            gemm::View::transposed(w, k),
            y,
            m,
            false,
            true,
        )
        .map_err(|e| sieve_formats::FormatError::Option(e.to_string()))?;
        Ok(())
    }

    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows() as u64);
        w.u64(self.cols() as u64);
        w.f16s(self.matrix.data());
    }
}

/// Dot products and conversions with a runtime-selected AVX2/FMA/F16C path and a portable one.
pub mod kernels {
    use half::f16;

    #[cfg(target_arch = "x86_64")]
    fn has_avx2() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }

    /// `Σ w[i] · x[i]` with f16 weights; `w.len() == x.len()`.
    pub fn dot_f16_f32(w: &[f16], x: &[f32]) -> f32 {
        debug_assert_eq!(w.len(), x.len());
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports the features the function is compiled for.
            return unsafe { x86::dot_f16_f32(w, x) };
        }
        w.iter().zip(x).map(|(a, b)| a.to_f32() * b).sum()
    }

    /// `Σ a[i] · b[i]` in f32.
    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        debug_assert_eq!(a.len(), b.len());
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
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
        if has_avx2() {
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
        if has_avx2() {
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
        if has_avx2() {
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
        if has_avx2() {
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
    mod x86 {
        use half::f16;
        use std::arch::x86_64::*;

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn hsum(v: __m256) -> f32 {
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
                    *c =
                        _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(o)), _mm256_loadu_ps(bp.add(o)), *c);
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
}

/// Products over the rows of several independent sequences (one decode token each), where
/// every output row must equal a one-row [`Linear::forward`] of that row bit for bit: a
/// batched server's greedy answer is then the single-request answer. GGUF blocks run the
/// small-batch integer kernel (each weight row read once for up to
/// [`quantized::SMALL_BATCH`] tokens); any other format runs one `matvec` per row.
impl Linear {
    /// `Y = X · Wᵀ + b` for `n` independent rows, each bit-identical to `forward(row, 1)`.
    pub fn forward_rows(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        Self::forward_rows_group(&[self], x, n, &mut [y])
    }

    /// [`Linear::forward_group`] with the guarantee of [`Linear::forward_rows`].
    pub fn forward_rows_group(
        linears: &[&Linear],
        x: &[f32],
        n: usize,
        ys: &mut [&mut [f32]],
    ) -> Result<()> {
        if linears.len() != ys.len() {
            return Err(ModelError::InvalidArgument(format!(
                "{} linears but {} outputs",
                linears.len(),
                ys.len()
            )));
        }
        let Some(first) = linears.first() else {
            return Ok(());
        };
        let k = first.cols();
        for (l, y) in linears.iter().zip(ys.iter()) {
            check_product_args(l.rows(), l.cols(), x, n, l.threshold, y)?;
        }
        let blocks: Option<Vec<&QuantMatrix>> = linears
            .iter()
            .map(|l| match &l.weight {
                Weight::Blocks(q) if l.threshold == first.threshold => Some(q),
                _ => None,
            })
            .collect();
        match blocks {
            Some(mats) => {
                // Chunks of at most SMALL_BATCH rows take the per-token decode kernel.
                let step = quantized::SMALL_BATCH;
                for r0 in (0..n).step_by(step) {
                    let rows = step.min(n - r0);
                    let mut chunk: Vec<&mut [f32]> = ys
                        .iter_mut()
                        .zip(&mats)
                        .map(|(y, m)| &mut y[r0 * m.rows()..(r0 + rows) * m.rows()])
                        .collect();
                    quantized::matmul_group(
                        &mats,
                        &x[r0 * k..(r0 + rows) * k],
                        rows,
                        first.threshold,
                        &mut chunk,
                    )?;
                }
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    l.add_bias(y);
                }
            }
            None => {
                for (l, y) in linears.iter().zip(ys.iter_mut()) {
                    let m = l.rows();
                    for r in 0..n {
                        l.forward(&x[r * k..(r + 1) * k], 1, &mut y[r * m..(r + 1) * m])?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sieve_formats::dense::Dense;
    use sieve_formats::registry;

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

    /// f64 reference of `Y = X · Wᵀ` with the f16-rounded weights.
    fn reference(w: &DenseMatrix, x: &[f32], n: usize, t: Threshold) -> Vec<f32> {
        let (m, k) = (w.rows(), w.cols());
        let mut y = vec![0f32; n * m];
        for tok in 0..n {
            for r in 0..m {
                let mut s = 0f64;
                for c in 0..k {
                    let xv = x[tok * k + c];
                    if is_active(xv, t) {
                        s += w.get(r, c).to_f32() as f64 * xv as f64;
                    }
                }
                y[tok * m + r] = s as f32;
            }
        }
        y
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "element {i}: {x} vs {y}"
            );
        }
    }

    #[test]
    fn fast_dense_matches_reference_on_odd_shapes() {
        // Shapes with remainders in every blocking dimension (rows % 4, tokens % 2, K % 8, K % 32).
        for &(m, k, n) in &[(1, 1, 1), (7, 13, 3), (37, 70, 5), (64, 96, 2), (33, 41, 1)] {
            let w = DenseMatrix::from_f32(m, k, &random(m * k, m as u64 * 31 + k as u64)).unwrap();
            let x = random(n * k, 99 + n as u64);
            let fast = FastDense::new(w.clone());
            for t in [None, Some(0.2f32)] {
                let mut y = vec![f32::NAN; n * m];
                fast.matmul(&x, n, t, &mut y).unwrap();
                close(&y, &reference(&w, &x, n, t), 1e-5);
                let mut yv = vec![f32::NAN; m];
                fast.matvec(&x[..k], t, &mut yv).unwrap();
                close(&yv, &reference(&w, &x[..k], 1, t), 1e-5);
            }
        }
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
            kernels::softmax_scaled(&mut row, scale);
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
        kernels::softmax_scaled(&mut row, 1.0);
        assert_eq!(row, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn silu_mul_matches_f64() {
        let gate: Vec<f32> = random(203, 4).iter().map(|v| 40.0 * v).collect();
        let up = random(203, 5);
        let mut got = gate.clone();
        kernels::silu_mul(&mut got, &up);
        for ((g, u), o) in gate.iter().zip(&up).zip(&got) {
            let (g, u) = (*g as f64, *u as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (*o as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{o} vs {want}"
            );
        }
        let mut extreme = vec![-200.0f32, 200.0, 0.0, -90.0, 90.0, 1.0, -1.0, 3.0];
        kernels::silu_mul(&mut extreme, &[1.0; 8]);
        assert!(extreme[0].abs() < 1e-30 && extreme[1] == 200.0 && extreme[2] == 0.0);
        assert!(extreme.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn fast_dense_agrees_with_the_formats_dense_and_shares_its_blob() {
        let (m, k) = (19, 45);
        let w = DenseMatrix::from_f32(m, k, &random(m * k, 5)).unwrap();
        let fast = FastDense::new(w.clone());
        let plain = Dense::encode(&w).unwrap();
        let x = random(3 * k, 6);
        let (mut a, mut b) = (vec![0f32; 3 * m], vec![0f32; 3 * m]);
        fast.matmul(&x, 3, None, &mut a).unwrap();
        plain.matmul(&x, 3, None, &mut b).unwrap();
        close(&a, &b, 1e-5);
        let back = registry::from_bytes(&fast.to_bytes()).unwrap();
        assert_eq!(back.decode(), w);
        assert_eq!(fast.storage(), plain.storage());
    }

    #[test]
    fn linear_adds_bias_and_routes_one_row_to_matvec() {
        let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let lin = Linear::from_dense_f32(2, 3, &w)
            .unwrap()
            .with_bias(vec![0.5, -1.0])
            .unwrap();
        let mut y = [0f32; 2];
        lin.forward(&[1.0, 0.0, -1.0], 1, &mut y).unwrap();
        assert_eq!(y, [1.0 - 3.0 + 0.5, 4.0 - 6.0 - 1.0]);
        let mut y2 = [0f32; 4];
        lin.forward(&[1.0, 0.0, -1.0, 0.0, 1.0, 0.0], 2, &mut y2)
            .unwrap();
        assert_eq!(y2, [-1.5, -3.0, 2.5, 4.0]);
    }

    #[test]
    fn linear_threshold_skips_small_inputs() {
        let mut lin = Linear::from_dense_f32(1, 3, &[1.0, 10.0, 100.0]).unwrap();
        lin.set_threshold(Some(0.5)).unwrap();
        let mut y = [0f32; 1];
        lin.forward(&[1.0, 0.25, -0.75], 1, &mut y).unwrap();
        assert_eq!(y, [1.0 - 75.0]);
        assert!(lin.set_threshold(Some(f32::NAN)).is_err());
        assert!(lin.set_threshold(Some(-1.0)).is_err());
    }

    /// Q8_0 blocks with scale 0.01 and pseudo-random quants.
    fn q8_0_linear(rows: usize, cols: usize, seed: u64) -> Linear {
        let mut s = seed;
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / 32 {
            bytes.extend_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
            bytes.extend((0..32).map(|_| (lcg(&mut s) * 255.0) as i8 as u8));
        }
        Linear::from_quantized(
            QuantMatrix::new(quantized::BlockType::Q8_0, rows, cols, bytes).unwrap(),
        )
    }

    #[test]
    fn grouped_forward_equals_one_forward_each() {
        let (q, k, v) = (
            q8_0_linear(96, 64, 1).with_bias(random(96, 2)).unwrap(),
            q8_0_linear(32, 64, 3),
            q8_0_linear(40, 64, 4),
        );
        let dense = Linear::from_dense_f32(32, 64, &random(32 * 64, 5)).unwrap();
        let x = random(2 * 64, 6);
        for n in [1, 2] {
            for group in [[&q, &k, &v], [&q, &dense, &v]] {
                let mut want: Vec<Vec<f32>> =
                    group.iter().map(|l| vec![0f32; n * l.rows()]).collect();
                for (l, y) in group.iter().zip(&mut want) {
                    l.forward(&x[..n * 64], n, y).unwrap();
                }
                let mut got: Vec<Vec<f32>> =
                    group.iter().map(|l| vec![f32::NAN; n * l.rows()]).collect();
                let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|y| &mut y[..]).collect();
                Linear::forward_group(&group, &x[..n * 64], n, &mut outs).unwrap();
                assert_eq!(got, want);
            }
        }
        let mut short = vec![0f32; 95];
        let mut ok = vec![0f32; 32];
        assert!(Linear::forward_group(&[&q, &k], &x[..64], 1, &mut [&mut short, &mut ok]).is_err());
        assert!(Linear::forward_group(&[&q, &k], &x[..64], 1, &mut [&mut ok]).is_err());
    }

    #[test]
    fn row_products_equal_one_row_forward_bit_for_bit() {
        let (q, k) = (
            q8_0_linear(96, 64, 11).with_bias(random(96, 12)).unwrap(),
            q8_0_linear(40, 64, 13),
        );
        let dense = Linear::from_dense_f32(32, 64, &random(32 * 64, 14)).unwrap();
        // More rows than one small batch, so the chunking is exercised too.
        let n = quantized::SMALL_BATCH + 3;
        let x = random(n * 64, 15);
        for group in [vec![&q, &k], vec![&q, &dense], vec![&dense]] {
            let mut got: Vec<Vec<f32>> =
                group.iter().map(|l| vec![f32::NAN; n * l.rows()]).collect();
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|y| &mut y[..]).collect();
            Linear::forward_rows_group(&group, &x, n, &mut outs).unwrap();
            for (l, y) in group.iter().zip(&got) {
                let m = l.rows();
                for r in 0..n {
                    let mut one = vec![0f32; m];
                    l.forward(&x[r * 64..(r + 1) * 64], 1, &mut one).unwrap();
                    assert_eq!(&y[r * m..(r + 1) * m], &one[..], "row {r}");
                }
            }
        }
        let mut short = vec![0f32; 95];
        assert!(q.forward_rows(&x[..64], 1, &mut short).is_err());
        let mut ok = vec![0f32; 96];
        assert!(Linear::forward_rows_group(&[&q, &k], &x[..64], 1, &mut [&mut ok]).is_err());
    }

    #[test]
    fn linear_refuses_bad_shapes() {
        let lin = Linear::from_dense_f32(2, 3, &[0.0; 6]).unwrap();
        let mut y = [0f32; 2];
        assert!(lin.forward(&[0.0; 4], 1, &mut y).is_err());
        assert!(lin.forward(&[0.0; 6], 2, &mut y).is_err());
        assert!(Linear::from_dense_f32(2, 3, &[0.0; 5]).is_err());
        assert!(Linear::from_dense_f32(1, 1, &[f32::NAN]).is_err());
        assert!(Linear::from_dense_f32(2, 3, &[0.0; 6])
            .unwrap()
            .with_bias(vec![0.0; 3])
            .is_err());
        let t = Tensor {
            shape: vec![6],
            data: vec![0.0; 6],
        };
        assert!(Linear::from_tensor("x", &t).is_err());
        let mut lin = lin;
        let other = FastDense::new(DenseMatrix::zeros(3, 2).unwrap());
        assert!(lin.replace_format(Box::new(other)).is_err());
    }
}
