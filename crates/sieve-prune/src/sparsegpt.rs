//! SparseGPT (Frantar & Alistarh 2023): prune a layer while re-fitting the remaining weights to
//! keep `W X` close to the dense output on calibration inputs.
//!
//! The layer-wise problem is `min ||W X - W' X||²` over masked `W'`. Its Hessian for every row is
//! `H = 2 Xᵀ X / n` (K x K), shared by all rows, so rows are independent and run in parallel.
//! The algorithm, as in the paper:
//!
//! 1. Dead inputs (`H_jj = 0`: the input was always zero on calibration data) get `H_jj = 1` so
//!    that `H` stays invertible. Their weights have no effect on calibration outputs, so they are
//!    scored 0 and pruned first, but only within the budget: unlike the reference code, which
//!    zeroes them outright, a dense target never drops them.
//! 2. Damping: `λ = 0.01 · mean(diag H)` is added to the diagonal. If the Cholesky factorisation
//!    still fails (the matrix is numerically not positive definite, e.g. from rounding on nearly
//!    collinear inputs or a caller-provided indefinite matrix), the damping is multiplied by 10
//!    and retried, up to [`SparseGptOptions::max_damping_retries`] times; the level used is
//!    reported. If every level fails, [`PruneError::NotPositiveDefinite`] is returned.
//! 3. `H⁻¹` from the Cholesky factor of `H`, then `U` = the upper Cholesky factor of `H⁻¹`
//!    (`H⁻¹ = Uᵀ U`); row `i` of `U` holds the sequential OBS update for eliminating column `i`
//!    after columns `< i` are fixed.
//! 4. Columns are swept in blocks of 128 (rounded down to a multiple of `m` for N:M so that
//!    groups never straddle a block). Within a block each column is fixed in turn: pruned weights
//!    become +0.0 and the error `e = (w - q) / U_ii` is spread over the rest of the block with
//!    `w_j -= e · U_ij`; the remaining columns receive the block's errors in one batched product
//!    `W[:, i2..] -= E · U[i1..i2, i2..]` (the paper's lazy batch update).
//! 5. Mask selection uses `w² / U_ii²` on the weights as updated so far. Unstructured: chosen at
//!    the start of each block **per row**: the row's remaining budget (so that every row ends
//!    with exactly `round(r·K)` zeros) is assigned to the lowest scores among *all* columns not
//!    yet fixed, which at a block start already hold every earlier error, and the choices inside
//!    the block are applied. This deviates from the reference code, which thresholds each block
//!    across all rows at the block's own ratio: a fixed ratio per 128-column block forbids
//!    moving the budget between blocks (costly when input scales differ along K), and per-row
//!    budgets are what the formats and the Wanda comparison use. N:M: chosen for each group of
//!    `m` columns when the sweep reaches the group, as in the paper. Balanced N:M (groups of `m`
//!    output rows down one column): chosen for column `i` when the sweep reaches it, per group
//!    of `m` rows, keeping the `n` highest `w² / U_ii²`. `U_ii` is one number for the whole
//!    column, so this is the top `n` of the updated `w²` in the group; the OBS compensation of
//!    the pruned weights over the later columns is unchanged (rows stay independent). The rows
//!    of one group must then sweep together, column by column: tasks take whole groups
//!    (`rows_per_task` rounded up to a multiple of `m`) and inside a block the loop runs
//!    group -> column -> row instead of row -> column.
//!
//! 6. Optionally ([`PreparedHessian::prune_on_grid`]) the kept weights are quantized in the same
//!    sweep, the paper's joint sparsification and quantization (§3.5, as GPTQ does for dense
//!    layers): when column `i` is fixed, a kept weight becomes its nearest grid point `q · s`
//!    (`|q| <= qmax`) and its rounding error `e = (w - q s) / U_ii` is compensated over the
//!    later columns exactly like a pruned weight's. Rounding after pruning instead leaves every
//!    rounding error uncompensated. Two kinds of grid ([`SweepGrid`]):
//!    * one given scale per row ([`RowGrid`], `--values int8`);
//!    * one scale per row and group of `G` consecutive columns (`0..G`, `G..2G`, ...; the last
//!      one may be partial), GPTQ's dynamic groups (`--values int4`): when the sweep reaches
//!      column `i` with `i % G == 0`, each row's scale for columns `i..i + G` is chosen from
//!      their **current** weights (every earlier column's error already added), as
//!      `Grid::snap_scale` of their largest magnitude. Only the columns of the current block
//!      are current (the later ones still wait for the lazy batch update), so `G` must divide
//!      the block; a group then never straddles two blocks.
//!
//! Arithmetic: `H`, its factorisations and the inverse are f64; the sweep runs in f32 like the
//! reference implementation.

use crate::error::{check_finite, check_matrix, check_ratio, PruneError, Result};
use crate::mask::{prune_group_balanced, prune_lowest, Mask};
use crate::methods::ColumnNorms;
use crate::pattern::{unstructured_prune_count, Pattern};
use faer::linalg::solvers::DenseSolveCore;
use faer::{Mat, Side};
use rayon::prelude::*;
use serde::Serialize;
use sieve_cpu::gemm::{self, gemm, View};
use sieve_formats::value_grid::Grid;

/// Rows of activations folded into one f32 Gram product before it is added to the f64 sum;
/// bounds the f32 rounding error of each partial sum.
const GRAM_CHUNK_ROWS: usize = 1024;

/// Gram-matrix rows per parallel task (one GEMM row block).
const HESSIAN_BAND: usize = gemm::MC;

/// Streams calibration activations into `Σ xᵀx` (K x K, f64).
#[derive(Clone, Debug)]
pub struct HessianAccumulator {
    cols: usize,
    rows_seen: usize,
    /// Row-major K x K sum of outer products; symmetric, but `add_rows` only maintains the
    /// upper triangle (`j >= i`), which is all that is read.
    gram: Vec<f64>,
}

impl HessianAccumulator {
    pub fn new(cols: usize) -> Result<Self> {
        if cols == 0 {
            return Err(PruneError::EmptyMatrix { rows: 0, cols });
        }
        let len = cols.checked_mul(cols).ok_or(PruneError::Shape {
            what: "K * K overflows",
            expected: usize::MAX,
            actual: cols,
        })?;
        Ok(Self {
            cols,
            rows_seen: 0,
            gram: vec![0.0; len],
        })
    }

    /// An accumulator from a known `Σ xᵀx` (row-major K x K, symmetric, finite) over
    /// `rows_seen` rows; for tests and for statistics computed elsewhere.
    pub fn from_gram(cols: usize, gram: Vec<f64>, rows_seen: usize) -> Result<Self> {
        let mut acc = Self::new(cols)?;
        if gram.len() != acc.gram.len() {
            return Err(PruneError::Shape {
                what: "Gram matrix length (K * K)",
                expected: acc.gram.len(),
                actual: gram.len(),
            });
        }
        if let Some(i) = gram.iter().position(|v| !v.is_finite()) {
            return Err(PruneError::NonFinite {
                what: "Gram matrix",
                index: i,
                value: gram[i] as f32,
            });
        }
        for i in 0..cols {
            for j in 0..i {
                let (a, b) = (gram[i * cols + j], gram[j * cols + i]);
                if (a - b).abs() > 1e-9 * a.abs().max(b.abs()).max(1.0) {
                    return Err(PruneError::Option(format!(
                        "Gram matrix is not symmetric at ({i}, {j}): {a} vs {b}"
                    )));
                }
            }
        }
        acc.gram = gram;
        acc.rows_seen = rows_seen;
        Ok(acc)
    }

    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn rows_seen(&self) -> usize {
        self.rows_seen
    }

    /// Adds `n` activation rows of K (`x.len() == n * K`, row-major).
    pub fn add_rows(&mut self, x: &[f32], n: usize) -> Result<()> {
        let k = self.cols;
        if x.len() != n.saturating_mul(k) {
            return Err(PruneError::Shape {
                what: "activation length (n * K)",
                expected: n.saturating_mul(k),
                actual: x.len(),
            });
        }
        check_finite("activations", x)?;
        // Only the upper triangle (j >= i) is accumulated: each task owns a band of
        // HESSIAN_BAND rows of the Gram matrix and computes its part right of the diagonal,
        // Xᵀ[band, :] · X[:, i0..], with the blocked GEMM; `hessian()` mirrors it.
        for chunk in x.chunks(GRAM_CHUNK_ROWS * k) {
            let rows = chunk.len() / k;
            self.gram
                .par_chunks_mut(HESSIAN_BAND * k)
                .enumerate()
                .for_each(|(band, gram_rows)| {
                    let i0 = band * HESSIAN_BAND;
                    let height = gram_rows.len() / k;
                    let width = k - i0;
                    let mut c = vec![0f32; height * width];
                    let xt = View::transposed(chunk, k).at(i0, 0);
                    let xs = View::row_major(chunk, k).at(0, i0);
                    // The views cover `chunk` by construction; an error would be a bug.
                    let ok = gemm(height, width, rows, xt, xs, &mut c, width, false, false).is_ok();
                    debug_assert!(ok);
                    for (i, (g, cr)) in gram_rows
                        .chunks_exact_mut(k)
                        .zip(c.chunks_exact(width))
                        .enumerate()
                    {
                        // Row i0 + i: columns from the diagonal on.
                        for (gv, cv) in g[i0 + i..].iter_mut().zip(&cr[i..]) {
                            *gv += f64::from(*cv);
                        }
                    }
                });
        }
        self.rows_seen += n;
        Ok(())
    }

    /// Adds another accumulator over the same inputs.
    pub fn merge(&mut self, other: &HessianAccumulator) -> Result<()> {
        if other.cols != self.cols {
            return Err(PruneError::Shape {
                what: "K of merged Hessian",
                expected: self.cols,
                actual: other.cols,
            });
        }
        for (a, b) in self.gram.iter_mut().zip(&other.gram) {
            *a += b;
        }
        self.rows_seen += other.rows_seen;
        Ok(())
    }

    /// `H = 2 Σ xᵀx / n` (row-major K x K), mirrored from the accumulated upper triangle.
    pub fn hessian(&self) -> Result<Vec<f64>> {
        if self.rows_seen == 0 {
            return Err(PruneError::NoCalibration(
                "the Hessian has seen no activation rows",
            ));
        }
        let k = self.cols;
        let scale = 2.0 / self.rows_seen as f64;
        let mut h = vec![0f64; k * k];
        for i in 0..k {
            for j in i..k {
                let v = self.gram[i * k + j] * scale;
                h[i * k + j] = v;
                h[j * k + i] = v;
            }
        }
        Ok(h)
    }

    /// `||X_j||_2` from the diagonal, for Wanda on the same statistics.
    pub fn column_norms(&self) -> Result<ColumnNorms> {
        let diag = (0..self.cols)
            .map(|j| self.gram[j * self.cols + j].max(0.0))
            .collect();
        ColumnNorms::from_sum_squares(diag, self.rows_seen)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SparseGptOptions {
    /// Columns per lazy-update block (128 in the paper).
    pub block_size: usize,
    /// Damping as a fraction of the mean Hessian diagonal (0.01 in the paper).
    pub damping: f64,
    /// How many times the damping may be multiplied by 10 when Cholesky fails.
    pub max_damping_retries: usize,
    /// Rows per parallel task; each task runs the whole column sweep for its rows.
    pub rows_per_task: usize,
}

impl Default for SparseGptOptions {
    fn default() -> Self {
        Self {
            block_size: 128,
            damping: 0.01,
            max_damping_retries: 4,
            rows_per_task: 64,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct SparseGptResult {
    /// Pruned and re-fitted weights; pruned entries are exactly +0.0.
    pub weights: Vec<f32>,
    pub mask: Mask,
    /// Damping actually used, as a fraction of the mean diagonal (> the requested one only
    /// after a Cholesky failure).
    pub damping_used: f64,
    /// Inputs that were always zero on the calibration data.
    pub dead_columns: usize,
    /// The paper's loss estimate `Σ (w - q)² / (2 U_ii²)` over all rows.
    pub estimated_loss: f64,
}

/// Per-row grids for the weights SparseGPT keeps (module docs, step 6): kept weight `w` of row
/// `r` becomes `q · scales[r]` with `q = round(w / scales[r])` clamped to `±qmax`; a row with
/// scale 0 becomes all zeros. Grid points that are 0 are +0.0.
#[derive(Clone, Copy, Debug)]
pub struct RowGrid<'a> {
    pub scales: &'a [f32],
    pub qmax: i32,
}

impl RowGrid<'_> {
    fn validate(&self, rows: usize) -> Result<()> {
        if self.scales.len() != rows {
            return Err(PruneError::Shape {
                what: "grid scales (one per row)",
                expected: rows,
                actual: self.scales.len(),
            });
        }
        if self.qmax < 1 {
            return Err(PruneError::Option(format!(
                "grid: qmax must be at least 1, got {}",
                self.qmax
            )));
        }
        if let Some(r) = self.scales.iter().position(|s| !s.is_finite() || *s < 0.0) {
            return Err(PruneError::Option(format!(
                "grid: row {r} has scale {}, expected a finite number >= 0",
                self.scales[r]
            )));
        }
        Ok(())
    }

    /// The grid point nearest `w` for scale `s`.
    #[inline]
    fn snap(w: f32, s: f32, qmax: i32) -> f32 {
        if s == 0.0 {
            return 0.0;
        }
        let q = (w / s).round().clamp(-(qmax as f32), qmax as f32);
        if q == 0.0 {
            0.0
        } else {
            q * s
        }
    }
}

/// The grid SparseGPT puts the kept weights on in its sweep (module docs, step 6).
#[derive(Clone, Copy, Debug)]
pub enum SweepGrid<'a> {
    /// One given scale per row.
    Rows(RowGrid<'a>),
    /// One scale per row and group of `group` consecutive columns (groups start at column 0),
    /// chosen by the sweep when it reaches the group's first column: `grid.snap_scale` of the
    /// largest current magnitude in the group; kept weights become `grid.snap(w, scale)`.
    /// `group` must divide the sweep's block (module docs, step 6).
    Groups { grid: Grid, group: usize },
}

impl<'a> From<RowGrid<'a>> for SweepGrid<'a> {
    fn from(grid: RowGrid<'a>) -> Self {
        Self::Rows(grid)
    }
}

impl SweepGrid<'_> {
    /// Checks the grid against the matrix (`rows`) and the sweep's effective `block`.
    fn validate(&self, rows: usize, block: usize, pattern: Pattern) -> Result<()> {
        match self {
            Self::Rows(g) => g.validate(rows),
            Self::Groups { grid, group } => {
                if grid.qmax < 1 {
                    return Err(PruneError::Option(format!(
                        "grid: qmax must be at least 1, got {}",
                        grid.qmax
                    )));
                }
                if *group == 0 || !block.is_multiple_of(*group) {
                    let rounded = match pattern {
                        Pattern::NM { m, .. } => {
                            format!(" (block_size rounded to a multiple of {m})")
                        }
                        _ => String::new(),
                    };
                    return Err(PruneError::Option(format!(
                        "grid groups of {group} columns must divide the SparseGPT block of \
                         {block} columns{rounded}: a group must not straddle two blocks, whose \
                         later columns are not yet updated when its scale is chosen"
                    )));
                }
                Ok(())
            }
        }
    }
}

/// The factorised Hessian of one layer input: everything SparseGPT needs that does not depend on
/// the weights. Matrices reading the same input (q/k/v, gate/up) share one.
#[derive(Clone, Debug)]
pub struct PreparedHessian {
    cols: usize,
    /// Row-major upper Cholesky factor of the damped `H⁻¹` (f32).
    upper: Vec<f32>,
    dead: Vec<bool>,
    damping_used: f64,
}

impl PreparedHessian {
    /// Fixes dead inputs, damps and factorises (module docs, steps 1-3).
    pub fn new(hessian: &HessianAccumulator, options: &SparseGptOptions) -> Result<Self> {
        options.validate()?;
        let cols = hessian.cols();
        let h = hessian.hessian()?;
        let mut dead = vec![false; cols];
        let mut h = Mat::<f64>::from_fn(cols, cols, |i, j| h[i * cols + j]);
        for j in 0..cols {
            // A zero diagonal means an always-zero input. A negative one cannot come from XᵀX;
            // it only appears in hand-made matrices, where the damping retries decide.
            if h[(j, j)] == 0.0 {
                dead[j] = true;
                h[(j, j)] = 1.0;
            }
        }
        let (upper, damping_used) = inverse_upper_cholesky(&h, options)?;
        Ok(Self {
            cols,
            upper,
            dead,
            damping_used,
        })
    }

    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Damping actually used, as a fraction of the mean diagonal.
    pub fn damping_used(&self) -> f64 {
        self.damping_used
    }
    /// Inputs that were always zero on the calibration data.
    pub fn dead_columns(&self) -> usize {
        self.dead.iter().filter(|d| **d).count()
    }

    /// Prunes `weights` (M x K row-major) against this Hessian (module docs, steps 4-5).
    pub fn prune(
        &self,
        weights: &[f32],
        rows: usize,
        cols: usize,
        pattern: Pattern,
        ratio: f64,
        options: &SparseGptOptions,
    ) -> Result<SparseGptResult> {
        self.prune_on_grid(weights, rows, cols, pattern, ratio, options, None)
    }

    /// [`Self::prune`], and with `grid` the kept weights quantized in the same sweep (module
    /// docs, step 6). A group grid whose group does not divide the effective block
    /// (`options.block_size`, rounded down to a multiple of `m` for N:M) is refused with
    /// [`PruneError::Option`].
    #[allow(clippy::too_many_arguments)]
    pub fn prune_on_grid(
        &self,
        weights: &[f32],
        rows: usize,
        cols: usize,
        pattern: Pattern,
        ratio: f64,
        options: &SparseGptOptions,
        grid: Option<SweepGrid<'_>>,
    ) -> Result<SparseGptResult> {
        check_matrix("weights", weights, rows, cols)?;
        check_ratio(ratio)?;
        options.validate()?;
        let pattern = pattern.validate()?;
        if self.cols != cols {
            return Err(PruneError::Shape {
                what: "Hessian size (K)",
                expected: cols,
                actual: self.cols,
            });
        }
        let block = match pattern {
            Pattern::Unstructured | Pattern::Balanced { .. } => options.block_size,
            Pattern::NM { m, .. } => (options.block_size / m).max(1) * m,
        };
        if let Some(g) = &grid {
            g.validate(rows, block, pattern)?;
        }
        let mut out = weights.to_vec();
        let mut keep = vec![true; rows * cols];
        // Balanced groups of rows never straddle two tasks (task starts are multiples of m).
        let rows_per_task = match pattern {
            Pattern::Balanced { m, .. } => options.rows_per_task.div_ceil(m) * m,
            _ => options.rows_per_task,
        };
        let task = rows_per_task * cols;
        let losses: Vec<f64> = out
            .par_chunks_mut(task)
            .zip(keep.par_chunks_mut(task))
            .enumerate()
            .map(|(t, (w, k))| {
                let row0 = t * rows_per_task;
                // This task's rows' grid.
                let grid = grid.map(|g| match g {
                    SweepGrid::Rows(g) => {
                        TaskGrid::Rows(&g.scales[row0..row0 + w.len() / cols.max(1)], g.qmax)
                    }
                    SweepGrid::Groups { grid, group } => TaskGrid::Groups(grid, group),
                });
                let sweep = Sweep {
                    cols,
                    upper: &self.upper,
                    dead: &self.dead,
                    pattern,
                    ratio,
                    block,
                    grid,
                    row0,
                };
                sweep.rows(w, k)
            })
            .collect::<Result<_>>()?;
        Ok(SparseGptResult {
            weights: out,
            mask: Mask::new(rows, cols, keep)?,
            damping_used: self.damping_used,
            dead_columns: self.dead_columns(),
            estimated_loss: losses.iter().sum(),
        })
    }
}

impl SparseGptOptions {
    fn validate(&self) -> Result<()> {
        if self.block_size == 0 || self.rows_per_task == 0 {
            return Err(PruneError::Option(
                "block_size and rows_per_task must be positive".into(),
            ));
        }
        if !(self.damping.is_finite() && self.damping >= 0.0) {
            return Err(PruneError::Option(format!(
                "damping {} must be finite and >= 0",
                self.damping
            )));
        }
        Ok(())
    }
}

/// Prunes `weights` (M x K row-major) with SparseGPT; see the module docs. To prune several
/// matrices that read the same input, build one [`PreparedHessian`] and call its `prune`.
pub fn prune_sparsegpt(
    weights: &[f32],
    rows: usize,
    cols: usize,
    hessian: &HessianAccumulator,
    pattern: Pattern,
    ratio: f64,
    options: &SparseGptOptions,
) -> Result<SparseGptResult> {
    check_matrix("weights", weights, rows, cols)?;
    check_ratio(ratio)?;
    pattern.validate()?;
    if hessian.cols() != cols {
        return Err(PruneError::Shape {
            what: "Hessian size (K)",
            expected: cols,
            actual: hessian.cols(),
        });
    }
    PreparedHessian::new(hessian, options)?.prune(weights, rows, cols, pattern, ratio, options)
}

/// Returns `U` (row-major f32, upper triangular) with `H⁻¹ = Uᵀ U` for `H + λ I`, raising `λ`
/// tenfold on each failure.
fn inverse_upper_cholesky(h: &Mat<f64>, options: &SparseGptOptions) -> Result<(Vec<f32>, f64)> {
    let k = h.nrows();
    let mean_diag = (0..k).map(|j| h[(j, j)]).sum::<f64>() / k as f64;
    // A positive base keeps the retries meaningful even if the mean diagonal is <= 0.
    let base = if mean_diag > 0.0 { mean_diag } else { 1.0 };
    let mut damping = options.damping;
    let attempts = options.max_damping_retries + 1;
    for attempt in 0..attempts {
        if attempt > 0 {
            damping = if damping > 0.0 { damping * 10.0 } else { 0.01 };
        }
        let mut damped = h.clone();
        for j in 0..k {
            damped[(j, j)] += damping * base;
        }
        let Ok(llt) = damped.llt(Side::Lower) else {
            continue;
        };
        let inv = llt.inverse();
        let Ok(inv_llt) = inv.llt(Side::Lower) else {
            continue;
        };
        // H⁻¹ = L Lᵀ, so U = Lᵀ: U[i][j] = L[j][i].
        let l = inv_llt.L();
        let mut upper = vec![0f32; k * k];
        for i in 0..k {
            let col = l.col(i);
            for j in i..k {
                upper[i * k + j] = col[j] as f32;
            }
        }
        if upper.iter().all(|v| v.is_finite()) && (0..k).all(|i| upper[i * k + i] > 0.0) {
            return Ok((upper, damping));
        }
    }
    Err(PruneError::NotPositiveDefinite { damping, attempts })
}

/// Where a kept weight goes when its column is fixed (module docs, step 6).
#[derive(Clone, Copy)]
enum Target {
    /// Stays as it is.
    Unchanged,
    /// The nearest point `q · scale`, `|q| <= qmax`, of a row grid ([`RowGrid::snap`]).
    Row { scale: f32, qmax: i32 },
    /// The nearest point of a group grid for the group's scale (`Grid::snap`).
    Group { grid: Grid, scale: f32 },
}

/// Fixes column `i` (in the block `i1..i2`) of one row: a pruned weight becomes +0.0, a kept
/// one becomes its `target`; the error `e = (w - target) / U_ii` is stored in `erow[i - i1]`
/// and spread over the rest of the block, `w_j -= e · U_ij`. `urow` is row `i` of `U`. Returns
/// the loss term `e² / 2`.
#[inline]
#[allow(clippy::too_many_arguments)]
fn fix_column(
    wrow: &mut [f32],
    kept: bool,
    target: Target,
    i: usize,
    i1: usize,
    i2: usize,
    urow: &[f32],
    erow: &mut [f32],
) -> f64 {
    let target = match (kept, target) {
        (false, _) => 0.0,
        (true, Target::Row { scale, qmax }) => RowGrid::snap(wrow[i], scale, qmax),
        (true, Target::Group { grid, scale }) => grid.snap(wrow[i], scale),
        (true, Target::Unchanged) => {
            erow[i - i1] = 0.0;
            return 0.0;
        }
    };
    let e = (wrow[i] - target) / urow[i];
    erow[i - i1] = e;
    wrow[i] = target;
    if e != 0.0 {
        for (wj, uj) in wrow[i + 1..i2].iter_mut().zip(&urow[i + 1..i2]) {
            *wj -= e * uj;
        }
    }
    f64::from(e) * f64::from(e) / 2.0
}

/// One task's part of a [`SweepGrid`].
#[derive(Clone, Copy)]
enum TaskGrid<'a> {
    /// The task's rows' scales and `qmax`.
    Rows(&'a [f32], i32),
    /// The grid and the group width.
    Groups(Grid, usize),
}

/// What the column sweep of one task needs besides its rows.
struct Sweep<'a> {
    cols: usize,
    upper: &'a [f32],
    dead: &'a [bool],
    pattern: Pattern,
    ratio: f64,
    block: usize,
    /// The task's rows' grid (module docs, step 6).
    grid: Option<TaskGrid<'a>>,
    /// The task's first row in the matrix (for error indices).
    row0: usize,
}

impl Sweep<'_> {
    /// At column `i` of row `r` (`wrow`): with a group grid, picks the row's scale for the
    /// group that starts at `i` from its current weights (module docs, step 6), into
    /// `group_scales[r]`. A weight that is no longer finite is refused.
    fn start_group(
        &self,
        wrow: &[f32],
        r: usize,
        i: usize,
        group_scales: &mut [f32],
    ) -> Result<()> {
        let Some(TaskGrid::Groups(grid, group)) = self.grid else {
            return Ok(());
        };
        if !i.is_multiple_of(group) {
            return Ok(());
        }
        let end = (i + group).min(self.cols);
        let run = &wrow[i..end];
        // f32::max skips NaN: look for a non-finite weight first.
        if let Some(j) = run.iter().position(|v| !v.is_finite()) {
            return Err(PruneError::NonFinite {
                what: "SparseGPT weights at the start of a grid group",
                index: (self.row0 + r) * self.cols + i + j,
                value: run[j],
            });
        }
        let max = run.iter().fold(0f32, |a, v| a.max(v.abs()));
        // Finite by the check above, so snap_scale answers.
        group_scales[r] = grid.snap_scale(max).unwrap_or(0.0);
        Ok(())
    }

    /// What a kept weight of row `r` becomes (`group_scales` from [`Self::start_group`]).
    #[inline]
    fn target(&self, r: usize, group_scales: &[f32]) -> Target {
        match self.grid {
            None => Target::Unchanged,
            Some(TaskGrid::Rows(scales, qmax)) => Target::Row {
                scale: scales[r],
                qmax,
            },
            Some(TaskGrid::Groups(grid, _)) => Target::Group {
                grid,
                scale: group_scales[r],
            },
        }
    }

    /// The column sweep for a contiguous set of rows (`w`, `keep`: R x K row-major).
    /// Returns the rows' loss estimate.
    fn rows(&self, w: &mut [f32], keep: &mut [bool]) -> Result<f64> {
        let Sweep {
            cols,
            upper,
            dead,
            pattern,
            ratio,
            block,
            ..
        } = *self;
        let rows = w.len() / cols;
        // Each row's scale for its current column group (group grids only).
        let mut group_scales = vec![0f32; rows];
        let mut err = vec![0f32; rows * block];
        let mut scores = vec![0f32; cols.max(block)];
        let mut lookahead = vec![true; cols];
        let row_budget = unstructured_prune_count(ratio, cols);
        let mut idx = Vec::with_capacity(block);
        let mut loss = 0f64;
        let score = |value: f32, j: usize| {
            if dead[j] {
                0.0
            } else {
                let d = upper[j * cols + j];
                value * value / (d * d)
            }
        };
        for i1 in (0..cols).step_by(block) {
            let i2 = (i1 + block).min(cols);
            let width = i2 - i1;
            if let Pattern::Balanced { n, m } = pattern {
                // Group -> column -> row: column i's choice needs every row of the group updated
                // through column i - 1 (module docs, step 5).
                let (mut col_scores, mut col_keep) = (Vec::new(), Vec::new());
                let mut row_scores = vec![0f32; m.min(rows)];
                let mut group_keep = vec![true; m.min(rows)];
                for g0 in (0..rows).step_by(m) {
                    let g1 = (g0 + m).min(rows);
                    let h = g1 - g0;
                    for i in i1..i2 {
                        for r in g0..g1 {
                            let wrow = &w[r * cols..(r + 1) * cols];
                            self.start_group(wrow, r, i, &mut group_scales)?;
                        }
                        for (r, s) in (g0..g1).zip(row_scores.iter_mut()) {
                            *s = score(w[r * cols + i], i);
                        }
                        group_keep[..h].iter_mut().for_each(|k| *k = true);
                        prune_group_balanced(
                            &row_scores[..h],
                            1,
                            n,
                            &mut group_keep[..h],
                            &mut col_scores,
                            &mut col_keep,
                            &mut idx,
                        );
                        for (r, &kept) in (g0..g1).zip(&group_keep[..h]) {
                            keep[r * cols + i] = kept;
                            loss += fix_column(
                                &mut w[r * cols..(r + 1) * cols],
                                kept,
                                self.target(r, &group_scales),
                                i,
                                i1,
                                i2,
                                &upper[i * cols..(i + 1) * cols],
                                &mut err[r * block..r * block + width],
                            );
                        }
                    }
                }
            } else {
                for r in 0..rows {
                    let wrow = &mut w[r * cols..(r + 1) * cols];
                    let krow = &mut keep[r * cols..(r + 1) * cols];
                    let erow = &mut err[r * block..r * block + width];
                    if pattern == Pattern::Unstructured {
                        // Every column >= i1 already holds all earlier errors (the trailing update
                        // ran), so the row's remaining budget is chosen among all remaining columns
                        // and the choices that fall into this block are applied now.
                        let pruned_so_far = krow[..i1].iter().filter(|k| !**k).count();
                        let budget = row_budget - pruned_so_far;
                        for j in i1..cols {
                            scores[j - i1] = score(wrow[j], j);
                        }
                        let rest = cols - i1;
                        lookahead[..rest].iter_mut().for_each(|k| *k = true);
                        prune_lowest(&scores[..rest], budget, &mut lookahead[..rest], &mut idx);
                        krow[i1..i2].copy_from_slice(&lookahead[..width]);
                    }
                    for i in i1..i2 {
                        self.start_group(wrow, r, i, &mut group_scales)?;
                        if let Pattern::NM { n, m } = pattern {
                            if i % m == 0 {
                                let g_end = (i + m).min(cols);
                                for j in i..g_end {
                                    scores[j - i] = score(wrow[j], j);
                                }
                                let g = g_end - i;
                                prune_lowest(
                                    &scores[..g],
                                    g.saturating_sub(n),
                                    &mut krow[i..g_end],
                                    &mut idx,
                                );
                            }
                        }
                        loss += fix_column(
                            wrow,
                            krow[i],
                            self.target(r, &group_scales),
                            i,
                            i1,
                            i2,
                            &upper[i * cols..(i + 1) * cols],
                            erow,
                        );
                    }
                }
            }
            if i2 < cols {
                // The lazy batch update W[:, i2..] -= E · U[i1..i2, i2..], one contiguous axpy per
                // (row, block column) so that it stays in safe, vectorisable slices.
                for r in 0..rows {
                    let wrest = &mut w[r * cols + i2..(r + 1) * cols];
                    for (c, &e) in err[r * block..r * block + width].iter().enumerate() {
                        if e != 0.0 {
                            let urow = &upper[(i1 + c) * cols + i2..(i1 + c + 1) * cols];
                            for (wj, uj) in wrest.iter_mut().zip(urow) {
                                *wj -= e * uj;
                            }
                        }
                    }
                }
            }
        }
        Ok(loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::methods::{prune_magnitude, prune_wanda};
    use sieve_formats::random::SplitMix64;

    /// n rows of K inputs with strongly correlated columns: a rank-`r` signal mixed into all
    /// columns, per-column scales, plus a little noise.
    fn correlated_activations(n: usize, k: usize, rank: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        let mix: Vec<f64> = (0..rank * k).map(|_| rng.normal()).collect();
        let col_scale: Vec<f64> = (0..k).map(|_| 0.2 + 2.0 * rng.next_f64()).collect();
        let mut x = vec![0f32; n * k];
        for t in 0..n {
            let z: Vec<f64> = (0..rank).map(|_| rng.normal()).collect();
            for j in 0..k {
                let signal: f64 = (0..rank).map(|a| z[a] * mix[a * k + j]).sum();
                x[t * k + j] = ((signal + 0.1 * rng.normal()) * col_scale[j]) as f32;
            }
        }
        x
    }

    fn random_weights(m: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..m * k).map(|_| rng.normal() as f32).collect()
    }

    /// ||W X - W' X||_F over calibration rows (x: n x K, W: M x K).
    fn reconstruction_error(w: &[f32], w2: &[f32], x: &[f32], m: usize, k: usize) -> f64 {
        let mut total = 0f64;
        for row in x.chunks_exact(k) {
            for i in 0..m {
                let d: f64 = (0..k)
                    .map(|j| f64::from(w[i * k + j] - w2[i * k + j]) * f64::from(row[j]))
                    .sum();
                total += d * d;
            }
        }
        total.sqrt()
    }

    fn hessian_of(x: &[f32], n: usize, k: usize) -> HessianAccumulator {
        let mut h = HessianAccumulator::new(k).unwrap();
        h.add_rows(x, n).unwrap();
        h
    }

    #[test]
    fn beats_wanda_and_magnitude_on_correlated_inputs() {
        let (m, k, n) = (24, 96, 400);
        let x = correlated_activations(n, k, 12, 11);
        let w = random_weights(m, k, 12);
        let h = hessian_of(&x, n, k);
        let norms = h.column_norms().unwrap();
        // a small block size exercises the lazy cross-block updates
        let opts = SparseGptOptions {
            block_size: 32,
            rows_per_task: 5,
            ..SparseGptOptions::default()
        };
        for (pattern, ratio) in [
            (Pattern::Unstructured, 0.5),
            (Pattern::Unstructured, 0.7),
            (Pattern::nm(2, 4).unwrap(), 0.0),
            (Pattern::slide(4).unwrap(), 0.0),
        ] {
            let sg = prune_sparsegpt(&w, m, k, &h, pattern, ratio, &opts).unwrap();
            let wa = prune_wanda(&w, m, k, &norms, pattern, ratio).unwrap();
            let mg = prune_magnitude(&w, m, k, pattern, ratio).unwrap();
            sg.mask.check(pattern, ratio).unwrap();
            // same budget
            assert_eq!(sg.mask.pruned_count(), wa.mask.pruned_count());
            assert_eq!(sg.mask.pruned_count(), mg.mask.pruned_count());
            for (v, keep) in sg.weights.iter().zip(sg.mask.keep()) {
                if !keep {
                    assert_eq!(v.to_bits(), 0);
                }
            }
            let e_sg = reconstruction_error(&w, &sg.weights, &x, m, k);
            let e_wa = reconstruction_error(&w, &wa.weights, &x, m, k);
            let e_mg = reconstruction_error(&w, &mg.weights, &x, m, k);
            assert!(
                e_sg < 0.8 * e_wa && e_sg < 0.8 * e_mg,
                "{pattern} {ratio}: sparsegpt {e_sg} wanda {e_wa} magnitude {e_mg}"
            );
            assert_eq!(sg.damping_used, 0.01);
            assert!(sg.estimated_loss > 0.0);
        }
    }

    /// Joint pruning and quantization (module docs, step 6): every kept weight lands on its
    /// row's grid, pruned ones are +0.0, and compensating the rounding errors in the sweep
    /// reconstructs the layer's output better than rounding the pruned weights afterwards, for
    /// the unstructured and the balanced patterns and a coarse (4-bit) and a fine (8-bit) grid.
    #[test]
    fn quantizing_in_the_sweep_beats_rounding_after() {
        let (m, k, n) = (40, 96, 400);
        let x = correlated_activations(n, k, 12, 41);
        let w = random_weights(m, k, 42);
        let h = hessian_of(&x, n, k);
        let opts = SparseGptOptions {
            block_size: 32,
            rows_per_task: 7,
            ..SparseGptOptions::default()
        };
        let prepared = PreparedHessian::new(&h, &opts).unwrap();
        for (pattern, ratio) in [
            (Pattern::Unstructured, 0.5),
            (Pattern::Balanced { n: 8, m: 16 }, 0.0),
        ] {
            for qmax in [7, 127] {
                let scales: Vec<f32> = w
                    .chunks_exact(k)
                    .map(|row| row.iter().fold(0f32, |a, v| a.max(v.abs())) / qmax as f32)
                    .collect();
                let grid = RowGrid {
                    scales: &scales,
                    qmax,
                };
                let joint = prepared
                    .prune_on_grid(&w, m, k, pattern, ratio, &opts, Some(grid.into()))
                    .unwrap();
                let plain = prepared.prune(&w, m, k, pattern, ratio, &opts).unwrap();
                let after: Vec<f32> = plain
                    .weights
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| RowGrid::snap(v, scales[i / k], qmax))
                    .collect();
                for (i, (v, keep)) in joint.weights.iter().zip(joint.mask.keep()).enumerate() {
                    // (q · s is rounded to f32 here: these scales have full mantissas.)
                    let q = v / scales[i / k];
                    assert!(
                        (q - q.round()).abs() < 1e-4 && q.round().abs() <= qmax as f32,
                        "{pattern} qmax {qmax}: {v} is not on row {}'s grid",
                        i / k
                    );
                    if !keep {
                        assert_eq!(v.to_bits(), 0, "a pruned weight is not +0.0");
                    }
                }
                let e_joint = reconstruction_error(&w, &joint.weights, &x, m, k);
                let e_after = reconstruction_error(&w, &after, &x, m, k);
                assert!(
                    e_joint < e_after,
                    "{pattern} qmax {qmax}: joint {e_joint} vs rounding after {e_after}"
                );
            }
        }
        // A grid for the wrong number of rows is refused.
        let short = vec![1.0f32; m - 1];
        let bad = RowGrid {
            scales: &short,
            qmax: 127,
        };
        assert!(prepared
            .prune_on_grid(
                &w,
                m,
                k,
                Pattern::Unstructured,
                0.5,
                &opts,
                Some(bad.into())
            )
            .is_err());
    }

    /// Joint pruning and quantization on group grids (module docs, step 6; `--values int4`):
    /// every kept weight of every (row, column group) lies on one INT4 grid (detected from
    /// the stored f16 values alone, and rebuilt exactly as `q · s`), pruned weights and
    /// weights rounded to 0 are +0.0, and compensating the rounding errors in the sweep
    /// reconstructs the layer's output better than rounding each group after pruning. K = 160
    /// leaves a partial last group (for G = 64, 128) and a partial last block.
    #[test]
    fn quantizing_groups_in_the_sweep_beats_rounding_each_group_after() {
        use half::f16;
        use sieve_formats::value_grid::INT4;
        let (m, k, n) = (40, 160, 400);
        let x = correlated_activations(n, k, 12, 43);
        let w = random_weights(m, k, 44);
        let h = hessian_of(&x, n, k);
        for (block, group) in [(64, 32), (64, 64), (128, 128)] {
            let opts = SparseGptOptions {
                block_size: block,
                rows_per_task: 7,
                ..SparseGptOptions::default()
            };
            let prepared = PreparedHessian::new(&h, &opts).unwrap();
            for (pattern, ratio) in [
                (Pattern::Unstructured, 0.5),
                (Pattern::Balanced { n: 8, m: 16 }, 0.0),
                (Pattern::nm(2, 4).unwrap(), 0.0),
            ] {
                let grid = SweepGrid::Groups { grid: INT4, group };
                let joint = prepared
                    .prune_on_grid(&w, m, k, pattern, ratio, &opts, Some(grid))
                    .unwrap();
                joint.mask.check(pattern, ratio).unwrap();
                let mut groups_seen = 0;
                for r in 0..m {
                    for g0 in (0..k).step_by(group) {
                        let g1 = (g0 + group).min(k);
                        let run = &joint.weights[r * k + g0..r * k + g1];
                        let kept = &joint.mask.keep()[r * k + g0..r * k + g1];
                        let mut stored = Vec::new();
                        for (&v, &keep) in run.iter().zip(kept) {
                            if !keep || v == 0.0 {
                                assert_eq!(v.to_bits(), 0, "a zero is not +0.0");
                                continue;
                            }
                            assert_eq!(f16::from_f32(v).to_f32(), v, "{v} is no f16");
                            stored.push(f16::from_f32(v));
                        }
                        let mut q = vec![0i8; stored.len()];
                        let s = INT4.detect(&stored, &mut q).unwrap_or_else(|| {
                            panic!("{pattern} G {group}: row {r} group {g0} is off INT4 grids")
                        });
                        for (v, &i) in stored.iter().zip(&q) {
                            assert!(i.unsigned_abs() <= 7);
                            assert_eq!(i as f64 * s as f64, v.to_f64());
                        }
                        groups_seen += usize::from(stored.len() > 2);
                    }
                }
                assert!(groups_seen > 0, "no group held enough values to check");
                let plain = prepared.prune(&w, m, k, pattern, ratio, &opts).unwrap();
                let mut after = plain.weights.clone();
                for row in after.chunks_mut(k) {
                    for run in row.chunks_mut(group) {
                        INT4.snap_row(run).unwrap();
                    }
                }
                let e_joint = reconstruction_error(&w, &joint.weights, &x, m, k);
                let e_after = reconstruction_error(&w, &after, &x, m, k);
                assert!(
                    e_joint < e_after,
                    "{pattern} G {group}: joint {e_joint} vs rounding after {e_after}"
                );
            }
        }
    }

    /// A group that does not divide the sweep's block (as given, or as rounded to a multiple
    /// of M for N:M) is refused: its later columns would not hold the block's errors yet when
    /// its scale is chosen.
    #[test]
    fn group_grids_must_divide_the_block() {
        use sieve_formats::value_grid::INT4;
        let (m, k, n) = (8, 96, 100);
        let x = correlated_activations(n, k, 6, 45);
        let w = random_weights(m, k, 46);
        let h = hessian_of(&x, n, k);
        for (block, pattern, group, why) in [
            (32, Pattern::Unstructured, 64, "block of 32"),
            (128, Pattern::nm(3, 6).unwrap(), 64, "multiple of 6"),
            (128, Pattern::Balanced { n: 8, m: 16 }, 48, "groups of 48"),
            (128, Pattern::Unstructured, 0, "groups of 0"),
        ] {
            let opts = SparseGptOptions {
                block_size: block,
                ..SparseGptOptions::default()
            };
            let prepared = PreparedHessian::new(&h, &opts).unwrap();
            let grid = SweepGrid::Groups { grid: INT4, group };
            match prepared.prune_on_grid(&w, m, k, pattern, 0.5, &opts, Some(grid)) {
                Err(PruneError::Option(msg)) => assert!(msg.contains(why), "{msg}"),
                other => panic!("{pattern} block {block} G {group}: {other:?}"),
            }
        }
    }

    /// Balanced N:16 (groups of output rows down each column), with M not a multiple of 16:
    /// the output obeys the pattern (mask and stored zeros), prunes exactly the pattern's
    /// count, does not depend on how rows are split into tasks, and reconstructs the layer's
    /// output better than magnitude (= Wanda, within a column) under the same pattern.
    #[test]
    fn balanced_is_valid_and_beats_magnitude_balanced() {
        let (m, k, n) = (40, 96, 400);
        let x = correlated_activations(n, k, 12, 31);
        let w = random_weights(m, k, 32);
        let h = hessian_of(&x, n, k);
        let norms = h.column_norms().unwrap();
        let opts = SparseGptOptions {
            block_size: 32,
            rows_per_task: 5,
            ..SparseGptOptions::default()
        };
        for sp in [0.5, 0.7, 0.3] {
            let pattern = Pattern::balanced_for_sp(sp).unwrap();
            let sg = prune_sparsegpt(&w, m, k, &h, pattern, 0.0, &opts).unwrap();
            sg.mask.check(pattern, 0.0).unwrap();
            Mask::from_weights(&sg.weights, m, k)
                .unwrap()
                .check(pattern, 0.0)
                .unwrap();
            assert_eq!(
                sg.mask.pruned_count(),
                pattern.pruned_count(0.0, m, k).unwrap()
            );
            for (v, keep) in sg.weights.iter().zip(sg.mask.keep()) {
                if !keep {
                    assert_eq!(v.to_bits(), 0);
                }
            }
            // tasks of 5 rows are rounded up to 16; one task of every row chooses the same
            for rows_per_task in [1, 16, 1000] {
                let other = SparseGptOptions {
                    rows_per_task,
                    ..opts.clone()
                };
                let again = prune_sparsegpt(&w, m, k, &h, pattern, 0.0, &other).unwrap();
                // (the loss estimate is summed per task, so only its rounding may differ)
                assert_eq!(again.weights, sg.weights, "rows_per_task {rows_per_task}");
                assert_eq!(again.mask, sg.mask, "rows_per_task {rows_per_task}");
            }
            let mg = prune_magnitude(&w, m, k, pattern, 0.0).unwrap();
            let wa = prune_wanda(&w, m, k, &norms, pattern, 0.0).unwrap();
            assert_eq!(mg.mask.pruned_count(), sg.mask.pruned_count());
            let e_sg = reconstruction_error(&w, &sg.weights, &x, m, k);
            let e_mg = reconstruction_error(&w, &mg.weights, &x, m, k);
            let e_wa = reconstruction_error(&w, &wa.weights, &x, m, k);
            assert!(
                e_sg < 0.8 * e_mg && e_sg < 0.8 * e_wa,
                "{pattern}: sparsegpt {e_sg} magnitude {e_mg} wanda {e_wa}"
            );
        }
        // a 16:16 target keeps everything unchanged
        let dense =
            prune_sparsegpt(&w, m, k, &h, Pattern::balanced(16, 16).unwrap(), 0.0, &opts).unwrap();
        assert_eq!(dense.weights, w);
    }

    #[test]
    fn dense_target_leaves_weights_unchanged() {
        let (m, k, n) = (8, 40, 100);
        let x = correlated_activations(n, k, 5, 1);
        let w = random_weights(m, k, 2);
        let out = prune_sparsegpt(
            &w,
            m,
            k,
            &hessian_of(&x, n, k),
            Pattern::Unstructured,
            0.0,
            &SparseGptOptions::default(),
        )
        .unwrap();
        assert_eq!(out.weights, w);
        assert_eq!(out.mask.pruned_count(), 0);
        // 4:4 is dense too
        let out = prune_sparsegpt(
            &w,
            m,
            k,
            &hessian_of(&x, n, k),
            Pattern::nm(4, 4).unwrap(),
            0.0,
            &SparseGptOptions::default(),
        )
        .unwrap();
        assert_eq!(out.weights, w);
    }

    #[test]
    fn two_four_output_is_valid_with_odd_shapes() {
        // K not a multiple of the block, nor of 4
        let (m, k, n) = (7, 203, 300);
        let x = correlated_activations(n, k, 20, 5);
        let w = random_weights(m, k, 6);
        let pattern = Pattern::nm(2, 4).unwrap();
        let out = prune_sparsegpt(
            &w,
            m,
            k,
            &hessian_of(&x, n, k),
            pattern,
            0.0,
            &SparseGptOptions::default(),
        )
        .unwrap();
        out.mask.check(pattern, 0.0).unwrap();
        Mask::from_weights(&out.weights, m, k)
            .unwrap()
            .check(pattern, 0.0)
            .unwrap();
        let out = prune_sparsegpt(
            &w,
            m,
            k,
            &hessian_of(&x, n, k),
            Pattern::Unstructured,
            0.37,
            &SparseGptOptions::default(),
        )
        .unwrap();
        out.mask.check(Pattern::Unstructured, 0.37).unwrap();
    }

    #[test]
    fn dead_columns_are_pruned_first_but_only_within_budget() {
        let (m, k, n) = (4, 16, 64);
        let mut x = correlated_activations(n, k, 16, 9);
        for row in x.chunks_mut(k) {
            row[3] = 0.0;
            row[10] = 0.0;
        }
        let mut w = random_weights(m, k, 10);
        for r in 0..m {
            w[r * k + 3] = 5.0; // large, but useless on this data
        }
        let h = hessian_of(&x, n, k);
        let dense = prune_sparsegpt(
            &w,
            m,
            k,
            &h,
            Pattern::Unstructured,
            0.0,
            &SparseGptOptions::default(),
        )
        .unwrap();
        assert_eq!(dense.dead_columns, 2);
        assert_eq!(dense.weights, w);
        let out = prune_sparsegpt(
            &w,
            m,
            k,
            &h,
            Pattern::Unstructured,
            0.25,
            &SparseGptOptions::default(),
        )
        .unwrap();
        for r in 0..m {
            assert!(!out.mask.is_kept(r, 3) && !out.mask.is_kept(r, 10));
        }
    }

    #[test]
    fn prepared_hessian_is_shared_across_matrices() {
        let (k, n) = (32, 120);
        let x = correlated_activations(n, k, 8, 21);
        let h = hessian_of(&x, n, k);
        let opts = SparseGptOptions::default();
        let prepared = PreparedHessian::new(&h, &opts).unwrap();
        for (m, seed) in [(5, 1u64), (9, 2)] {
            let w = random_weights(m, k, seed);
            let a = prepared
                .prune(&w, m, k, Pattern::Unstructured, 0.5, &opts)
                .unwrap();
            let b = prune_sparsegpt(&w, m, k, &h, Pattern::Unstructured, 0.5, &opts).unwrap();
            assert_eq!(a, b);
        }
        assert!(matches!(
            prepared.prune(&[1.0; 6], 2, 3, Pattern::Unstructured, 0.5, &opts),
            Err(PruneError::Shape { .. })
        ));
    }

    #[test]
    fn indefinite_hessian_falls_back_to_more_damping() {
        // eigenvalues 2.05 and -0.05: 1% damping is not enough, 10% is
        let h = HessianAccumulator::from_gram(2, vec![1.0, 1.05, 1.05, 1.0], 2).unwrap();
        let w = [1.0f32, 0.5, -0.3, 2.0];
        let out = prune_sparsegpt(
            &w,
            2,
            2,
            &h,
            Pattern::Unstructured,
            0.5,
            &SparseGptOptions::default(),
        )
        .unwrap();
        assert!(
            (out.damping_used - 0.1).abs() < 1e-12,
            "{}",
            out.damping_used
        );
        // eigenvalue -999 is beyond every damping level tried
        let h = HessianAccumulator::from_gram(2, vec![1.0, 1000.0, 1000.0, 1.0], 2).unwrap();
        let err = prune_sparsegpt(
            &w,
            2,
            2,
            &h,
            Pattern::Unstructured,
            0.5,
            &SparseGptOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, PruneError::NotPositiveDefinite { attempts: 5, .. }),
            "{err}"
        );
    }

    #[test]
    fn streaming_accumulation_matches_one_shot() {
        let (k, n) = (12, 50);
        let x = correlated_activations(n, k, 4, 3);
        let whole = hessian_of(&x, n, k);
        let mut parts = HessianAccumulator::new(k).unwrap();
        parts.add_rows(&x[..7 * k], 7).unwrap();
        let mut rest = HessianAccumulator::new(k).unwrap();
        rest.add_rows(&x[7 * k..], n - 7).unwrap();
        parts.merge(&rest).unwrap();
        let (a, b) = (whole.hessian().unwrap(), parts.hessian().unwrap());
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() <= 1e-4 * p.abs().max(1.0));
        }
        // H = 2 XᵀX / n, checked on one entry
        let direct: f64 = x
            .chunks(k)
            .map(|r| f64::from(r[2]) * f64::from(r[5]))
            .sum::<f64>()
            * 2.0
            / n as f64;
        assert!((a[2 * k + 5] - direct).abs() < 1e-4 * direct.abs().max(1.0));
        let mut norms = ColumnNorms::new(k).unwrap();
        norms.add_rows(&x, n).unwrap();
        for (p, q) in norms
            .norms()
            .iter()
            .zip(whole.column_norms().unwrap().norms())
        {
            assert!((p - q).abs() <= 1e-4 * p);
        }
    }

    /// The banded upper-triangle accumulation against a plain f64 `2 XᵀX / n`, with K spanning
    /// several bands (and not a multiple of one) and n spanning several f32 chunks.
    #[test]
    fn triangular_accumulation_matches_full_product() {
        let (k, n) = (HESSIAN_BAND * 2 + 13, GRAM_CHUNK_ROWS + 77);
        let x = correlated_activations(n, k, 6, 21);
        let h = hessian_of(&x, n, k).hessian().unwrap();
        let mut want = vec![0f64; k * k];
        for row in x.chunks(k) {
            for i in 0..k {
                let xi = f64::from(row[i]);
                for j in 0..k {
                    want[i * k + j] += xi * f64::from(row[j]);
                }
            }
        }
        let diag_max = (0..k).map(|i| want[i * k + i]).fold(0.0, f64::max);
        for i in 0..k {
            for j in 0..k {
                let w = want[i * k + j] * 2.0 / n as f64;
                let got = h[i * k + j];
                assert_eq!(got, h[j * k + i], "symmetric at ({i}, {j})");
                // f32 partial sums over 1024 rows: relative to the largest entry.
                assert!(
                    (got - w).abs() <= 1e-5 * diag_max * 2.0 / n as f64,
                    "({i}, {j}): {got} vs {w}"
                );
            }
        }
    }

    #[test]
    fn typed_errors() {
        let w = [1.0f32, 2.0, 3.0, 4.0];
        let h = HessianAccumulator::from_gram(2, vec![1.0, 0.0, 0.0, 1.0], 1).unwrap();
        let opts = SparseGptOptions::default();
        let h3 =
            HessianAccumulator::from_gram(3, vec![1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0], 1)
                .unwrap();
        assert!(matches!(
            prune_sparsegpt(&w, 2, 2, &h3, Pattern::Unstructured, 0.5, &opts),
            Err(PruneError::Shape { .. })
        ));
        assert!(matches!(
            prune_sparsegpt(&w, 2, 2, &h, Pattern::Unstructured, 1.0, &opts),
            Err(PruneError::Ratio(_))
        ));
        assert!(matches!(
            prune_sparsegpt(
                &[f32::NAN, 0.0, 0.0, 0.0],
                2,
                2,
                &h,
                Pattern::Unstructured,
                0.5,
                &opts
            ),
            Err(PruneError::NonFinite { .. })
        ));
        let empty = HessianAccumulator::new(2).unwrap();
        assert!(matches!(
            prune_sparsegpt(&w, 2, 2, &empty, Pattern::Unstructured, 0.5, &opts),
            Err(PruneError::NoCalibration(_))
        ));
        let bad = SparseGptOptions {
            block_size: 0,
            ..opts.clone()
        };
        assert!(matches!(
            prune_sparsegpt(&w, 2, 2, &h, Pattern::Unstructured, 0.5, &bad),
            Err(PruneError::Option(_))
        ));
        assert!(HessianAccumulator::from_gram(2, vec![1.0, 2.0, 3.0, 1.0], 1).is_err());
        assert!(HessianAccumulator::from_gram(2, vec![1.0, f64::NAN, f64::NAN, 1.0], 1).is_err());
        let mut acc = HessianAccumulator::new(2).unwrap();
        assert!(matches!(
            acc.add_rows(&[1.0; 3], 2),
            Err(PruneError::Shape { .. })
        ));
        assert!(matches!(
            acc.add_rows(&[1.0, f32::NAN], 1),
            Err(PruneError::NonFinite { .. })
        ));
        assert!(matches!(acc.merge(&h3), Err(PruneError::Shape { .. })));
    }
}
