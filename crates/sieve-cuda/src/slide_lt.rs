//! SlideSparse on cuSPARSELt (issue 29, item 2: "cuSPARSELt loaded at run time ... f16, INT8
//! and FP8 (e4m3) paths"): a (2N-2):2N matrix expanded by its sliding windows into the 2:4
//! matrix W' (M x K', `Slide::expanded`), compressed once by the library, and multiplied by the
//! lifted activations `lift(mask_t(x))`. Three launches a product (`kernels/slide_lt.cu` draws
//! the two of sieve's):
//!
//! 1. `lt_lift_*`: each token's f32 row masked, lifted through the window map and written as f16
//!    or as 8-bit codes with one scale per token;
//! 2. `cusparseLtMatmul` ([`crate::cusparselt::LtProduct`]);
//! 3. `lt_scale_*`: the accumulators times the row's and the token's scales into f32 outputs.
//!
//! The 8-bit weights carry one scale per row, from the expanded row's values (each original
//! weight sits in W' exactly once, so it is the original row's maximum), as
//! [`crate::slide::eight_bit_reference`] quantizes them. [`Lifter`] with the identity map is
//! also what the dense 8-bit baseline ([`crate::dense8`]) quantizes its activations with.

use crate::cusparselt::{CusparseLt, LtOut, LtPrecision, LtProduct};
use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{grid_cfg, grid_stride, i32_arg, Gpu, KernelFamily};
use crate::product::{dev_ptr, threshold_arg, DevPtr};
use cudarc::driver::{CudaSlice, PushKernelArg};
use half::f16;
use sieve_formats::eight_bit::{e4m3_row, int8_row};
use sieve_formats::format::check_threshold;
use sieve_formats::slide::{Slide, LIFT_PAD};
use sieve_formats::{DenseMatrix, Threshold, WeightFormat};
use std::sync::Arc;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "slide_lt",
    source: include_str!("../kernels/slide_lt.cu"),
};

/// Whether a plan of `precision` times the library's candidate algorithms
/// (`cusparseLtMatmulSearch`) or keeps its default one. By default the 8-bit plans search and
/// the f16 ones do not: on an H100 with cuSPARSELt 0.8 (window L3) the search of an f16 plan
/// faulted inside one of the library's kernels ("internal error", then
/// `CUDA_ERROR_ILLEGAL_INSTRUCTION` for the whole context) on a 256 x 320 x 16 product, while
/// every INT8 and FP8 search passed. `SIEVE_CUSPARSELT_SEARCH=on|off` (read once) sets it for
/// every precision.
fn search_enabled(precision: LtPrecision) -> bool {
    static SETTING: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let setting =
        *SETTING.get_or_init(
            || match std::env::var("SIEVE_CUSPARSELT_SEARCH").as_deref() {
                Ok("on") => Some(true),
                Ok("off") => Some(false),
                _ => None,
            },
        );
    setting.unwrap_or(precision != LtPrecision::F16)
}

/// The device buffers of one token count: the lifted (or quantized) activations, their
/// per-token scales and the library's accumulators.
pub struct LtScratch {
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<f32>,
    pub acc: CudaSlice<u8>,
    /// Rows of the plan (N padded).
    pub np: usize,
}

impl LtScratch {
    pub fn new(gpu: &Gpu, product: &LtProduct) -> Result<Self> {
        Self::sized(
            gpu,
            product.n,
            product.k,
            product.m,
            product.precision,
            product.out,
        )
    }

    /// For `np` tokens of `kp` (lifted) columns and `mp` output rows.
    pub fn sized(
        gpu: &Gpu,
        np: usize,
        kp: usize,
        mp: usize,
        precision: LtPrecision,
        out: LtOut,
    ) -> Result<Self> {
        Ok(Self {
            codes: gpu.alloc_bytes(np * kp * precision.input_bytes())?,
            scales: gpu.upload(&vec![0f32; np])?,
            acc: gpu.alloc_bytes(np * mp * out.bytes())?,
            np,
        })
    }
}

/// The lifting (and quantizing) kernel of one precision over one column map.
pub struct Lifter {
    map: CudaSlice<u32>,
    /// Original columns (what the 8-bit maximum is taken over).
    k: usize,
    /// Padded lifted columns.
    kp: usize,
    precision: LtPrecision,
}

impl Lifter {
    /// `map[k']` = the original column of lifted column k', or [`LIFT_PAD`]; padded with
    /// [`LIFT_PAD`] to `kp`.
    pub fn new(
        gpu: &Gpu,
        mut map: Vec<u32>,
        k: usize,
        kp: usize,
        precision: LtPrecision,
    ) -> Result<Self> {
        if map.len() > kp || !kp.is_multiple_of(64) {
            return Err(CudaError::Option(format!(
                "lift map of {} columns into {kp} (a multiple of 64)",
                map.len()
            )));
        }
        if let Some(&bad) = map.iter().find(|&&c| c != LIFT_PAD && c as usize >= k) {
            return Err(CudaError::Option(format!(
                "lift map names column {bad} of a {k}-column input"
            )));
        }
        map.resize(kp, LIFT_PAD);
        gpu.function(&FAMILY, Self::kernel(precision))?;
        Ok(Self {
            map: gpu.upload(&map)?,
            k,
            kp,
            precision,
        })
    }

    /// The identity map over `k` columns: per-token quantization for a dense product.
    pub fn identity(gpu: &Gpu, k: usize, kp: usize, precision: LtPrecision) -> Result<Self> {
        Self::new(gpu, (0..k as u32).collect(), k, kp, precision)
    }

    fn kernel(precision: LtPrecision) -> &'static str {
        match precision {
            LtPrecision::F16 => "lt_lift_f16",
            LtPrecision::Int8 => "lt_lift_i8",
            LtPrecision::E4m3 => "lt_lift_e4m3",
        }
    }

    /// Writes `s.np` rows of lifted values (rows `n..np` zero) and, for 8-bit, their scales.
    pub fn run(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        s: &LtScratch,
    ) -> Result<()> {
        let need = s.np * self.kp * self.precision.input_bytes();
        if s.codes.len() < need {
            return Err(CudaError::Shape {
                what: "lifted activations (bytes)",
                expected: need,
                actual: s.codes.len(),
            });
        }
        let codes = dev_ptr(gpu, &s.codes);
        self.run_to(
            gpu,
            x,
            ldx,
            n,
            s.np,
            threshold,
            codes,
            dev_ptr(gpu, &s.scales),
        )
    }

    /// [`Self::run`] into caller-owned buffers: `codes` holds `np` rows of the padded lifted
    /// length in the input type, `scales` `np` f32 (unused for f16).
    #[allow(clippy::too_many_arguments)]
    pub fn run_to(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        ldx: usize,
        n: usize,
        np: usize,
        threshold: Threshold,
        codes: DevPtr,
        scales: DevPtr,
    ) -> Result<()> {
        check_threshold(threshold)?;
        if n == 0 || n > np || ldx < self.k {
            return Err(CudaError::Option(format!(
                "lifting {n} tokens (row stride {ldx}, {} columns) into a plan of {np}",
                self.k
            )));
        }
        let f = gpu.function(&FAMILY, Self::kernel(self.precision))?;
        let (ldx, k, kp, ni) = (
            i32_arg("x row stride", ldx)?,
            i32_arg("columns", self.k)?,
            i32_arg("lifted columns", self.kp)?,
            i32_arg("tokens", n)?,
        );
        let t = threshold_arg(threshold);
        let cfg = grid_cfg((i32_arg("plan tokens", np)? as u32, 1), 256, 0);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&x).arg(&ldx);
        if self.precision != LtPrecision::F16 {
            b.arg(&k);
        }
        b.arg(&self.map).arg(&kp).arg(&ni).arg(&t).arg(&codes);
        if self.precision != LtPrecision::F16 {
            b.arg(&scales);
        }
        unsafe { b.launch(cfg) }.during("launching the cuSPARSELt lifting")?;
        Ok(())
    }
}

/// `y[t][r] (+)= acc[t][r] · post · ws[r] · xs[t]` for `n` tokens and `m` rows (the
/// accumulators `mp` apart); `ws` is `None` for the f16 path (no scales).
#[allow(clippy::too_many_arguments)]
pub fn scale_outputs(
    gpu: &Gpu,
    out: LtOut,
    alpha: f32,
    s: &LtScratch,
    mp: usize,
    m: usize,
    n: usize,
    ws: Option<&CudaSlice<f32>>,
    y: DevPtr,
    ldy: usize,
    accumulate: bool,
) -> Result<()> {
    if n > s.np {
        return Err(CudaError::Option(format!(
            "scaling {n} tokens from a plan of {}",
            s.np
        )));
    }
    let scales = ws.map(|w| (dev_ptr(gpu, w), dev_ptr(gpu, &s.scales)));
    let acc = dev_ptr(gpu, &s.acc);
    scale_outputs_from(gpu, out, alpha, acc, mp, m, n, scales, y, ldy, accumulate)
}

/// [`scale_outputs`] from caller-owned accumulators (`acc`, rows `mp` apart) and scales
/// (`(row scales, token scales)`, `None` for f16).
#[allow(clippy::too_many_arguments)]
pub fn scale_outputs_from(
    gpu: &Gpu,
    out: LtOut,
    alpha: f32,
    acc: DevPtr,
    mp: usize,
    m: usize,
    n: usize,
    scales: Option<(DevPtr, DevPtr)>,
    y: DevPtr,
    ldy: usize,
    accumulate: bool,
) -> Result<()> {
    if n == 0 || m > mp || ldy < m {
        return Err(CudaError::Option(format!(
            "scaling {n} x {m} outputs (row stride {ldy}) from accumulators {mp} apart"
        )));
    }
    let name = match out {
        LtOut::I32 => "lt_scale_i32",
        LtOut::F32 => "lt_scale_f32",
        LtOut::F16 => "lt_scale_f16",
    };
    let f = gpu.function(&FAMILY, name)?;
    let (mpi, mi, ni, ldyi) = (
        i32_arg("plan rows", mp)?,
        i32_arg("rows", m)?,
        i32_arg("tokens", n)?,
        i32_arg("y row stride", ldy)?,
    );
    let post = 1.0 / alpha;
    let add: i32 = accumulate.into();
    let (wsp, xsp) = scales.unwrap_or((0, 0));
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&acc)
        .arg(&mpi)
        .arg(&mi)
        .arg(&ni)
        .arg(&post)
        .arg(&wsp)
        .arg(&xsp)
        .arg(&y)
        .arg(&ldyi)
        .arg(&add);
    unsafe { b.launch(grid_cfg(grid_stride(n * m), 256, 0)) }
        .during("launching the cuSPARSELt output scaling")?;
    Ok(())
}

/// Host bytes of `rows` rows of `vals` quantized per row to `precision` (f16 bits, INT8 or
/// e4m3 codes), each row padded to `ld` elements, and the rows' scales (empty for f16).
pub fn quantize_rows(
    vals: &[f16],
    rows: usize,
    cols: usize,
    ld: usize,
    pad_rows: usize,
    precision: LtPrecision,
) -> (Vec<u8>, Vec<f32>) {
    use rayon::prelude::*;
    let eb = precision.input_bytes();
    let mut bytes = vec![0u8; pad_rows * ld * eb];
    let mut scales = vec![
        0f32;
        if precision == LtPrecision::F16 {
            0
        } else {
            pad_rows
        }
    ];
    // One row per task, in parallel: a 7B's layers are 6.5 G weights.
    let quantize_row = |r: usize, dst: &mut [u8]| -> f32 {
        let row = &vals[r * cols..(r + 1) * cols];
        let dst = &mut dst[..cols * eb];
        match precision {
            LtPrecision::F16 => {
                for (d, v) in dst.chunks_exact_mut(2).zip(row) {
                    d.copy_from_slice(&v.to_bits().to_le_bytes());
                }
                0.0
            }
            LtPrecision::Int8 => {
                let f: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
                let q = int8_row(&f);
                for (d, c) in dst.iter_mut().zip(&q.codes) {
                    *d = *c as u8;
                }
                q.scale
            }
            LtPrecision::E4m3 => {
                let f: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
                let q = e4m3_row(&f);
                dst.copy_from_slice(&q.codes);
                q.scale
            }
        }
    };
    let dst_rows = bytes
        .par_chunks_mut((ld * eb).max(1))
        .take(rows)
        .enumerate();
    if scales.is_empty() {
        dst_rows.for_each(|(r, dst)| {
            quantize_row(r, dst);
        });
    } else {
        dst_rows
            .zip(scales.par_iter_mut())
            .for_each(|((r, dst), s)| *s = quantize_row(r, dst));
    }
    (bytes, scales)
}

/// A slide matrix on cuSPARSELt: W' compressed by the library, its row scales (8-bit), and the
/// lifting of its window map. Plans are per token count ([`Self::plan`]); the compressed
/// weights serve every plan of the same W' (the library's compressed layout depends on the
/// sparse matrix's descriptor only; every plan's product is checked against the reference in
/// the tests and the benchmark).
pub struct SlideLt {
    lt: Arc<CusparseLt>,
    rows: usize,
    mp: usize,
    kp: usize,
    precision: LtPrecision,
    lifter: Lifter,
    weights: CudaSlice<u8>,
    w_scales: Option<CudaSlice<f32>>,
}

impl SlideLt {
    /// Expands, quantizes (8-bit: per row) and compresses `s` for `precision`.
    pub fn upload(
        gpu: &Gpu,
        lt: &Arc<CusparseLt>,
        s: &Slide,
        precision: LtPrecision,
    ) -> Result<Self> {
        let expanded = s.expanded();
        let lifter_map = s.lift_map();
        Self::upload_2_4(gpu, lt, &expanded, lifter_map, s.cols(), precision)
    }

    /// The same for a matrix already 2:4 along its columns (`map` takes the input's columns to
    /// its columns: the identity for a plain 2:4 matrix).
    pub fn upload_2_4(
        gpu: &Gpu,
        lt: &Arc<CusparseLt>,
        w: &DenseMatrix,
        map: Vec<u32>,
        input_cols: usize,
        precision: LtPrecision,
    ) -> Result<Self> {
        let (rows, cols) = (w.rows(), w.cols());
        let (mp, kp, np) = LtProduct::padded(rows, cols, 1, precision);
        let lifter = Lifter::new(gpu, map, input_cols, kp, precision)?;
        let (bytes, scales) = quantize_rows(w.data(), rows, cols, kp, mp, precision);
        let dense = gpu.upload(&bytes)?;
        let plan = LtProduct::new(gpu, lt, mp, kp, np, precision)?;
        let weights = plan.compress(gpu, dev_ptr(gpu, &dense))?;
        drop(dense);
        let w_scales = if precision == LtPrecision::F16 {
            None
        } else {
            Some(gpu.upload(&scales)?)
        };
        gpu.function(&FAMILY, "lt_scale_i32")?;
        gpu.function(&FAMILY, "lt_scale_f32")?;
        gpu.function(&FAMILY, "lt_scale_f16")?;
        Ok(Self {
            lt: lt.clone(),
            rows,
            mp,
            kp,
            precision,
            lifter,
            weights,
            w_scales,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn precision(&self) -> LtPrecision {
        self.precision
    }
    /// Bytes of the compressed weights (values and the library's metadata) and the row scales.
    pub fn device_bytes(&self) -> usize {
        self.weights.len() + self.w_scales.as_ref().map_or(0, |s| s.len() * 4)
    }
    pub fn weights_ptr(&self, gpu: &Gpu) -> DevPtr {
        dev_ptr(gpu, &self.weights)
    }

    /// A plan for up to `n` tokens, with the library's fastest algorithm picked on these
    /// weights, and its scratch.
    pub fn plan(&self, gpu: &Gpu, n: usize) -> Result<(LtProduct, LtScratch)> {
        let (_, _, np) = LtProduct::padded(self.mp, self.kp, n, self.precision);
        let mut p = LtProduct::new(gpu, &self.lt, self.mp, self.kp, np, self.precision)?;
        let s = LtScratch::new(gpu, &p)?;
        if search_enabled(self.precision) {
            p.search(
                gpu,
                dev_ptr(gpu, &self.weights),
                dev_ptr(gpu, &s.codes),
                dev_ptr(gpu, &s.acc),
            )?;
        }
        Ok((p, s))
    }

    /// (Rows, padded lifted columns) of the library's product: an [`LtProduct`] of this
    /// matrix has `m, k` equal to these.
    pub fn plan_shape(&self) -> (usize, usize) {
        (self.mp, self.kp)
    }

    /// A plan for `np` tokens (already padded), searched on these weights with the caller's
    /// buffers (`codes`: `np` lifted rows of the input type, `acc`: `np` x M of any output
    /// type the plan may pick, so 4 bytes each).
    pub fn plan_with(&self, gpu: &Gpu, np: usize, codes: DevPtr, acc: DevPtr) -> Result<LtProduct> {
        let mut p = LtProduct::new(gpu, &self.lt, self.mp, self.kp, np, self.precision)?;
        if search_enabled(self.precision) {
            p.search(gpu, dev_ptr(gpu, &self.weights), codes, acc)?;
        }
        Ok(p)
    }

    /// The three steps into caller-owned buffers (see [`Self::plan_with`]); `scales` holds
    /// `p.n` f32 (8-bit only).
    #[allow(clippy::too_many_arguments)]
    pub fn launch_rows_to(
        &self,
        gpu: &Gpu,
        p: &LtProduct,
        codes: DevPtr,
        acc: DevPtr,
        scales: DevPtr,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        if p.m != self.mp || p.k != self.kp || p.precision != self.precision {
            return Err(self.plan_mismatch(p));
        }
        self.lifter
            .run_to(gpu, x, ldx, n, p.n, threshold, codes, scales)?;
        p.run(gpu, dev_ptr(gpu, &self.weights), codes, acc)?;
        let both = self.w_scales.as_ref().map(|w| (dev_ptr(gpu, w), scales));
        scale_outputs_from(
            gpu, p.out, p.alpha, acc, self.mp, self.rows, n, both, y, ldy, accumulate,
        )
    }

    /// Step 1 of a product: the lifted activations of `n` tokens into `s`.
    pub fn lift(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        s: &LtScratch,
    ) -> Result<()> {
        self.lifter.run(gpu, x, ldx, n, threshold, s)
    }

    /// Step 2: the library's product into `s.acc`.
    pub fn multiply(&self, gpu: &Gpu, p: &LtProduct, s: &LtScratch) -> Result<()> {
        self.check_plan(p, s)?;
        p.run(
            gpu,
            dev_ptr(gpu, &self.weights),
            dev_ptr(gpu, &s.codes),
            dev_ptr(gpu, &s.acc),
        )
    }

    /// Step 3: `y` (f32, `n` rows `ldy` apart) written or added to from the accumulators.
    #[allow(clippy::too_many_arguments)]
    pub fn finish(
        &self,
        gpu: &Gpu,
        p: &LtProduct,
        s: &LtScratch,
        n: usize,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        scale_outputs(
            gpu,
            p.out,
            p.alpha,
            s,
            self.mp,
            self.rows,
            n,
            self.w_scales.as_ref(),
            y,
            ldy,
            accumulate,
        )
    }

    /// The three steps: `Y[t] (+)= W · q(mask_t(X[t]))` for `n` tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_rows(
        &self,
        gpu: &Gpu,
        p: &LtProduct,
        s: &LtScratch,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.lift(gpu, x, ldx, n, threshold, s)?;
        self.multiply(gpu, p, s)?;
        self.finish(gpu, p, s, n, y, ldy, accumulate)
    }

    fn check_plan(&self, p: &LtProduct, s: &LtScratch) -> Result<()> {
        if p.m != self.mp || p.k != self.kp || p.precision != self.precision || s.np != p.n {
            return Err(self.plan_mismatch(p));
        }
        Ok(())
    }

    fn plan_mismatch(&self, p: &LtProduct) -> CudaError {
        CudaError::Option(format!(
            "a cuSPARSELt plan of {} x {} x {} ({:?}) for a {} x {} {:?} matrix",
            p.m, p.k, p.n, p.precision, self.mp, self.kp, self.precision
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_rows_are_the_eight_bit_codes_padded() {
        let vals: Vec<f16> = [0.5f32, -1.0, 0.0, 0.25, 2.0, 0.0, -0.125, 1.0]
            .iter()
            .map(|&v| f16::from_f32(v))
            .collect();
        let (b, s) = quantize_rows(&vals, 2, 4, 8, 3, LtPrecision::Int8);
        assert_eq!(b.len(), 3 * 8);
        assert_eq!(s.len(), 3);
        let q0 = int8_row(&[0.5, -1.0, 0.0, 0.25]);
        assert_eq!(s[0], q0.scale);
        let codes0: Vec<i8> = b[..4].iter().map(|&c| c as i8).collect();
        assert_eq!(codes0, q0.codes);
        assert!(b[4..8].iter().all(|&c| c == 0), "row padding is zero");
        assert!(b[16..].iter().all(|&c| c == 0), "padding rows are zero");
        let (b16, s16) = quantize_rows(&vals, 2, 4, 4, 2, LtPrecision::F16);
        assert!(s16.is_empty());
        assert_eq!(
            u16::from_le_bytes([b16[2], b16[3]]),
            f16::from_f32(-1.0).to_bits()
        );
        let (b8, s8) = quantize_rows(&vals, 2, 4, 4, 2, LtPrecision::E4m3);
        let q1 = e4m3_row(&[2.0, 0.0, -0.125, 1.0]);
        assert_eq!((&b8[4..8], s8[1]), (&q1.codes[..], q1.scale));
    }
}
