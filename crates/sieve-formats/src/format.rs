//! The one trait every weight format implements, and the pieces of its contract.

use crate::blob;
use crate::error::{FormatError, Result};
use crate::matrix::DenseMatrix;
use half::f16;
use rayon::prelude::*;
use serde::Serialize;

/// Which format a blob or a layer uses. The discriminant is the on-disk tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u16)]
pub enum FormatKind {
    Dense = 1,
    RlcCsc = 2,
    TiledCbc = 3,
    IeBme = 4,
    Slide = 5,
    BalancedCbc = 6,
}

impl FormatKind {
    pub const ALL: [FormatKind; 6] = [
        FormatKind::Dense,
        FormatKind::RlcCsc,
        FormatKind::TiledCbc,
        FormatKind::IeBme,
        FormatKind::Slide,
        FormatKind::BalancedCbc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FormatKind::Dense => "dense",
            FormatKind::RlcCsc => "rlc-csc",
            FormatKind::TiledCbc => "tiled-cbc",
            FormatKind::IeBme => "ie-bme",
            FormatKind::Slide => "slide",
            FormatKind::BalancedCbc => "balanced-cbc",
        }
    }

    pub fn from_tag(tag: u16) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| *k as u16 == tag)
            .ok_or_else(|| FormatError::Corrupt(format!("unknown format tag {tag}")))
    }

    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                FormatError::Option(format!(
                    "unknown format '{name}' (known: dense, rlc-csc, tiled-cbc, ie-bme, slide, balanced-cbc)"
                ))
            })
    }
}

/// Bytes a format stores, split the way the papers account for them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Storage {
    /// Weight values as stored (including zero padding the format needs).
    pub payload_bytes: usize,
    /// Everything else: indices, bitmaps, offsets, scales.
    pub metadata_bytes: usize,
}

impl Storage {
    pub fn total_bytes(&self) -> usize {
        self.payload_bytes + self.metadata_bytes
    }
    /// Payload-to-metadata ratio (UnionSparse's PMR): payload bytes / metadata bytes.
    /// Infinite when a format has no metadata.
    pub fn pmr(&self) -> f64 {
        if self.metadata_bytes == 0 {
            f64::INFINITY
        } else {
            self.payload_bytes as f64 / self.metadata_bytes as f64
        }
    }
}

/// TEAL-style activation sparsity: an input element with `|x| <= t` is treated as exactly zero
/// and its weight column is skipped. `None` uses every element (zeros still contribute nothing).
pub type Threshold = Option<f32>;

/// Validates a threshold: finite and non-negative.
pub fn check_threshold(t: Threshold) -> Result<()> {
    match t {
        Some(v) if !(v.is_finite() && v >= 0.0) => Err(FormatError::Threshold(v)),
        _ => Ok(()),
    }
}

/// True when input element `x` is active (contributes) under threshold `t`.
#[inline(always)]
pub fn is_active(x: f32, t: Threshold) -> bool {
    match t {
        Some(t) => x.abs() > t,
        None => true,
    }
}

/// A packed weight matrix `W` (M x K) that can multiply activations on the CPU.
///
/// This trait is object safe: the model's `Linear` layer holds a `Box<dyn WeightFormat>`.
/// Construction is per format (`Type::encode(&DenseMatrix, &Options)`), deserialization goes
/// through [`crate::registry::from_bytes`].
pub trait WeightFormat: Send + Sync + std::fmt::Debug {
    fn kind(&self) -> FormatKind;
    /// M, the number of outputs.
    fn rows(&self) -> usize;
    /// K, the number of inputs.
    fn cols(&self) -> usize;
    fn storage(&self) -> Storage;
    /// The dense matrix this format holds (dequantized for quantized payloads).
    fn decode(&self) -> DenseMatrix;
    /// `y = W · x` for one activation vector (`x.len() == K`, `y.len() == M`), fp32 accumulation,
    /// elements inactive under `threshold` skipped. `y` is overwritten.
    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<()>;
    /// `Y = X · Wᵀ` for `n` activation rows: `x` is n x K row-major, `y` is n x M row-major.
    /// The threshold applies element-wise, per token. `y` is overwritten.
    fn matmul(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<()>;
    /// Appends this format's payload (everything needed to rebuild it) to `out`.
    fn write_payload(&self, out: &mut blob::ByteWriter);

    /// Bytes this matrix holds in memory for its products: what one matrix-vector product
    /// streams at most. The stored bytes unless a CPU layout built at load differs from the
    /// blob (the 8-bit and 4-bit Balanced-CBC records, for instance).
    fn cpu_bytes(&self) -> usize {
        self.storage().total_bytes()
    }

    /// The concrete type, for callers that run several matrices of one implementation
    /// together (e.g. products that share one quantized input). `None` unless overridden.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// The framed, checksummed serialization (see [`crate::blob`]).
    fn to_bytes(&self) -> Vec<u8> {
        let mut w = blob::ByteWriter::new();
        self.write_payload(&mut w);
        blob::frame(self.kind() as u16, &w.buf)
    }
}

/// Checks the slice lengths and threshold of a `matvec`/`matmul` call.
pub fn check_product_args(
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    threshold: Threshold,
    y: &[f32],
) -> Result<()> {
    check_threshold(threshold)?;
    if x.len() != n * cols {
        return Err(FormatError::Shape {
            what: "activation length (n * K)",
            expected: n * cols,
            actual: x.len(),
        });
    }
    if y.len() != n * rows {
        return Err(FormatError::Shape {
            what: "output length (n * M)",
            expected: n * rows,
            actual: y.len(),
        });
    }
    Ok(())
}

/// Checks a one-token product group (matrices sharing the input `x`, as q|k|v): one output
/// per matrix (`shapes` holds each matrix's `(rows, cols)`), each as [`check_product_args`].
pub fn check_group_args(
    shapes: &[(usize, usize)],
    x: &[f32],
    threshold: Threshold,
    ys: &[&mut [f32]],
) -> Result<()> {
    if shapes.len() != ys.len() {
        return Err(FormatError::Shape {
            what: "outputs of a matrix group",
            expected: shapes.len(),
            actual: ys.len(),
        });
    }
    for (&(rows, cols), y) in shapes.iter().zip(ys) {
        check_product_args(rows, cols, x, 1, threshold, y)?;
    }
    Ok(())
}

/// Default batched product built from `matvec`, for formats without a specialised one.
pub fn matmul_by_rows<F: WeightFormat + ?Sized>(
    w: &F,
    x: &[f32],
    n: usize,
    threshold: Threshold,
    y: &mut [f32],
) -> Result<()> {
    use rayon::prelude::*;
    check_product_args(w.rows(), w.cols(), x, n, threshold, y)?;
    let (m, k) = (w.rows(), w.cols());
    y.par_chunks_mut(m)
        .zip(x.par_chunks(k))
        .try_for_each(|(yr, xr)| w.matvec(xr, threshold, yr))
}

/// Column formats' first step: the columns with at least one active element among the `n`
/// tokens of `x` (n x K), and for each such column its `n` masked values (inactive -> 0),
/// column-major: `active_x[i * n + t]` is token `t` of `active_cols[i]`.
pub fn compact_active_columns(
    x: &[f32],
    n: usize,
    k: usize,
    threshold: Threshold,
) -> (Vec<usize>, Vec<f32>) {
    let mut active_cols = Vec::new();
    let mut active_x = Vec::new();
    let mut xs = vec![0f32; n];
    for col in 0..k {
        let mut any = false;
        for (t, xv) in xs.iter_mut().enumerate() {
            let v = x[t * k + col];
            *xv = if is_active(v, threshold) && v != 0.0 {
                any = true;
                v
            } else {
                0.0
            };
        }
        if any {
            active_cols.push(col);
            active_x.extend_from_slice(&xs);
        }
    }
    (active_cols, active_x)
}

/// A column-compressed layout cut into row blocks: the walk the shared CPU product needs.
pub(crate) trait ColumnBlocks: Sync {
    /// Rows per block (the last block may be shorter).
    fn block_rows(&self) -> usize;
    /// Calls `f(row_in_block, value)` for every stored entry of column `col` in row block
    /// `block` (stored zeros included), in any order.
    fn walk<F: FnMut(usize, f16)>(&self, block: usize, col: usize, f: F);
}

/// The CPU product of the column-compressed formats (RLC-CSC, Tiled-CBC, Balanced-CBC):
/// `y (n x M) = mask(x) (n x K) · Wᵀ`. Active columns are compacted first; row blocks run in
/// parallel, and when there are fewer blocks than threads the active columns are also split
/// (split-K), each chunk accumulating into its own buffer that is then summed.
pub(crate) fn column_block_product<W: ColumnBlocks>(
    w: &W,
    (m, k): (usize, usize),
    x: &[f32],
    n: usize,
    threshold: Threshold,
    y: &mut [f32],
) -> Result<()> {
    check_product_args(m, k, x, n, threshold, y)?;
    if n == 0 {
        return Ok(());
    }
    let (active_cols, active_x) = compact_active_columns(x, n, k, threshold);
    let b_rows = w.block_rows();
    let blocks = m.div_ceil(b_rows);
    let workers = rayon::current_num_threads().max(1);
    let chunks_per_block = (4 * workers).div_ceil(blocks).max(1);
    let chunk = active_cols.len().div_ceil(chunks_per_block).max(32);
    // Accumulators are laid out row-major by weight row (n contiguous tokens per row).
    let block_sums: Vec<Vec<f32>> = (0..blocks)
        .into_par_iter()
        .map(|b| {
            let height = b_rows.min(m - b * b_rows);
            active_cols
                .par_chunks(chunk)
                .zip(active_x.par_chunks(chunk * n))
                .map(|(cols, xv)| {
                    let mut acc = vec![0f32; height * n];
                    for (ci, &col) in cols.iter().enumerate() {
                        if n == 1 {
                            let xk = xv[ci];
                            w.walk(b, col, |row, v| acc[row] += v.to_f32() * xk);
                        } else {
                            let xk = &xv[ci * n..(ci + 1) * n];
                            w.walk(b, col, |row, v| {
                                let wv = v.to_f32();
                                for (a, &xt) in acc[row * n..(row + 1) * n].iter_mut().zip(xk) {
                                    *a += wv * xt;
                                }
                            });
                        }
                    }
                    acc
                })
                .reduce(
                    || vec![0f32; height * n],
                    |mut a, b| {
                        a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                        a
                    },
                )
        })
        .collect();
    for (b, sums) in block_sums.iter().enumerate() {
        let r0 = b * b_rows;
        let height = b_rows.min(m - r0);
        for t in 0..n {
            for (r, yv) in y[t * m + r0..t * m + r0 + height].iter_mut().enumerate() {
                *yv = sums[r * n + t];
            }
        }
    }
    Ok(())
}
