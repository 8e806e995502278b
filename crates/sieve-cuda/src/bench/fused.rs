//! Multi-matrix launches (`--fused`): the projections that read the same input, q|k|v and
//! gate|up, as ONE packed matrix (rows concatenated, one launch) against separate launches of
//! each matrix, at the shapes of each named model (k and v have fewer rows in grouped-query
//! models: 1024 in llama3-8b and llama2-70b).
//!
//! Both sides are measured the same way as the per-shape rows: a "launch" is the whole group
//! (three or two kernels for the separate side, one for the packed side), copies rotate so
//! that no weights stay L2-resident, event timing around each group and, with `graph`, graph
//! replays; every output is checked against the f64 reference in both modes. Dense-storage
//! kernels and cuBLAS run on the unpruned matrices (their time does not depend on the weight
//! values), the sparse formats at every `sp`; cuBLAS, which does not skip inactive inputs, at
//! dp = 0 only.

use super::shapes::ModelDims;
use super::{check, f16_rounded, upload_format, Bench, KernelFormat, Measured};
use crate::dense::{to_f16, zeroed_f16, Cublas, GpuDense};
use crate::error::{CudaError, Result};
use crate::product::{active_mask, GpuMatVec};
use cudarc::driver::CudaSlice;
use serde::Serialize;
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::reference::{matvec_f64, max_rel_error};
use sieve_formats::{DenseMatrix, Threshold};

/// A group of projections that read the same input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedGroup {
    /// q, k and v of attention.
    Qkv,
    /// gate and up of the MLP.
    GateUp,
}

impl FusedGroup {
    pub const ALL: [FusedGroup; 2] = [FusedGroup::Qkv, FusedGroup::GateUp];

    pub fn name(self) -> &'static str {
        match self {
            FusedGroup::Qkv => "qkv",
            FusedGroup::GateUp => "gateup",
        }
    }

    /// The rows of each matrix of the group in `model`, in packing order (all have
    /// `model.hidden` columns).
    pub fn part_rows(self, model: &ModelDims) -> Vec<usize> {
        match self {
            FusedGroup::Qkv => vec![model.hidden, model.kv_rows, model.kv_rows],
            FusedGroup::GateUp => vec![model.intermediate, model.intermediate],
        }
    }
}

impl std::str::FromStr for FusedGroup {
    type Err = CudaError;
    fn from_str(s: &str) -> Result<Self> {
        FusedGroup::ALL
            .into_iter()
            .find(|g| g.name() == s)
            .ok_or_else(|| {
                CudaError::Option(format!("unknown fused group '{s}' (known: qkv, gateup)"))
            })
    }
}

impl std::fmt::Display for FusedGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The formats the comparison can time (besides cuBLAS, which always runs).
pub const FORMATS: [KernelFormat; 6] = [
    KernelFormat::Dense,
    KernelFormat::DenseColMajor,
    KernelFormat::TiledCbc,
    KernelFormat::TiledCbcRr,
    KernelFormat::TiledCbcSpdp,
    KernelFormat::RlcCsc,
];

/// The formats of `opts` the comparison times.
pub fn formats(opts: &super::KernelBenchOptions) -> Vec<KernelFormat> {
    opts.formats
        .iter()
        .copied()
        .filter(|f| FORMATS.contains(f))
        .collect()
}

/// One group at one point: separate launches against the packed matrix.
#[derive(Serialize, Clone, Debug)]
pub struct FusedRow {
    pub model: String,
    pub group: String,
    /// Rows of each matrix, in packing order; the packed matrix has their sum.
    pub parts: Vec<usize>,
    pub k: usize,
    /// The kernel (label), or `cublas`.
    pub format: String,
    pub sp: f64,
    pub dp: f64,
    /// Median event time of one group of separate launches.
    pub separate_us: f64,
    /// Median event time of the packed launch.
    pub packed_us: f64,
    pub separate_over_packed: f64,
    /// Graph mode: time per group of separate launches, per packed launch, and their ratio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_separate_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_packed_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_separate_over_packed: Option<f64>,
    /// Bytes both sides must read (the same weights; the separate side reads x once per
    /// matrix).
    pub separate_bytes: usize,
    pub packed_bytes: usize,
    /// Largest relative error of any output against the f64 reference, over both sides and
    /// both modes.
    pub rel_error: f64,
}

impl FusedRow {
    fn new(
        model: &ModelDims,
        group: FusedGroup,
        format: String,
        (sp, dp): (f64, f64),
        (sep, packed): (Measured, Measured),
        (separate_bytes, packed_bytes): (usize, usize),
        checks: &[f64],
    ) -> Self {
        let graph = |m: &Measured| m.graph.map(|g| g.timing.median_us);
        let (gs, gp) = (graph(&sep), graph(&packed));
        let mut errs: Vec<f64> = checks.to_vec();
        errs.extend(
            [sep.graph, packed.graph]
                .into_iter()
                .flatten()
                .filter_map(|g| g.rel_error),
        );
        FusedRow {
            model: model.name.to_string(),
            group: group.name().to_string(),
            parts: group.part_rows(model),
            k: model.hidden,
            format,
            sp,
            dp,
            separate_us: sep.event.median_us,
            packed_us: packed.event.median_us,
            separate_over_packed: sep.event.median_us / packed.event.median_us,
            graph_separate_us: gs,
            graph_packed_us: gp,
            graph_separate_over_packed: gs.zip(gp).map(|(s, p)| s / p),
            separate_bytes,
            packed_bytes,
            rel_error: super::worst_error(errs),
        }
    }

    /// One progress line.
    pub fn progress_line(&self) -> String {
        let mut l = format!(
            "fused {} {} {:<24} sp={:.2} dp={:.2} separate {:>9.2} us packed {:>9.2} us ({:.2}x)",
            self.model,
            self.group,
            self.format,
            self.sp,
            self.dp,
            self.separate_us,
            self.packed_us,
            self.separate_over_packed
        );
        if let (Some(s), Some(p), Some(r)) = (
            self.graph_separate_us,
            self.graph_packed_us,
            self.graph_separate_over_packed,
        ) {
            l += &format!("; graph {s:.2} / {p:.2} us ({r:.2}x)");
        }
        l + &format!("  err {:.1e}", self.rel_error)
    }
}

/// The matrices of `group` at weight sparsity `sp` and their packed concatenation.
fn matrices(
    model: &ModelDims,
    group: FusedGroup,
    sp: f64,
    seed: u64,
) -> Result<(Vec<DenseMatrix>, DenseMatrix)> {
    let k = model.hidden;
    let parts: Vec<DenseMatrix> = group
        .part_rows(model)
        .into_iter()
        .enumerate()
        .map(|(j, rows)| sparse_matrix(rows, k, sp, Pattern::Unstructured, seed ^ (j as u64 * 31)))
        .collect::<std::result::Result<_, _>>()?;
    Ok((parts.clone(), pack(&parts)?))
}

/// Rows of `parts` (same columns) concatenated into one matrix.
pub fn pack(parts: &[DenseMatrix]) -> Result<DenseMatrix> {
    let Some(first) = parts.first() else {
        return Err(CudaError::Option("nothing to pack".into()));
    };
    let cols = first.cols();
    if parts.iter().any(|p| p.cols() != cols) {
        return Err(CudaError::Option(
            "packed matrices must share their columns".into(),
        ));
    }
    let rows = parts.iter().map(|p| p.rows()).sum();
    let mut data = Vec::with_capacity(rows * cols);
    for p in parts {
        data.extend_from_slice(p.data());
    }
    Ok(DenseMatrix::new(rows, cols, data)?)
}

fn poisoned(bench: &Bench, rows: &[usize]) -> Result<Vec<CudaSlice<f32>>> {
    rows.iter().map(|&r| bench.gpu.poisoned_f32(r)).collect()
}

/// Every format of the options (and cuBLAS) on `group` of `model`.
pub(crate) fn bench_group(
    bench: &mut Bench,
    model: &ModelDims,
    group: FusedGroup,
    seed: u64,
) -> Result<Vec<FusedRow>> {
    let fmts = formats(bench.opts);
    let mut out = Vec::new();

    // Dense storage and cuBLAS on the unpruned matrices, then the sparse formats at every sp.
    let mut points: Vec<(f64, Vec<KernelFormat>)> = vec![(
        0.0,
        fmts.iter()
            .copied()
            .filter(|f| f.is_dense_storage())
            .collect(),
    )];
    let sparse: Vec<KernelFormat> = fmts
        .iter()
        .copied()
        .filter(|f| !f.is_dense_storage())
        .collect();
    if !sparse.is_empty() {
        points.extend(bench.opts.sp.iter().map(|&sp| (sp, sparse.clone())));
    }
    for (pi, (sp, formats)) in points.into_iter().enumerate() {
        let (parts, packed) = matrices(model, group, sp, seed ^ (0x10 + pi as u64))?;
        if pi == 0 {
            out.push(cublas_row(bench, model, group, &parts, &packed, seed)?);
        }
        if formats.is_empty() {
            continue;
        }
        // Activations and references per dp, shared by every format at this sp.
        let mut inputs = Vec::with_capacity(bench.opts.dp.len());
        for (di, &dp) in bench.opts.dp.iter().enumerate() {
            let x = activations(model.hidden, seed ^ (0x100 + di as u64));
            let t = threshold_for_sparsity(&x, dp)?;
            let want: Vec<Vec<f64>> = parts.iter().map(|w| matvec_f64(w, &x, t)).collect();
            inputs.push(Input { dp, x, t, want });
        }
        for format in formats {
            out.extend(format_rows(
                bench,
                model,
                group,
                format,
                sp,
                (&parts, &packed),
                &inputs,
            )?);
        }
    }
    Ok(out)
}

/// One activation vector of a point, its threshold and the products of each part.
struct Input {
    dp: f64,
    x: Vec<f32>,
    t: Threshold,
    want: Vec<Vec<f64>>,
}

/// One format at weight sparsity `sp`, every dp (our row-major GEMV, which cannot skip
/// columns, at the first only).
fn format_rows(
    bench: &mut Bench,
    model: &ModelDims,
    group: FusedGroup,
    format: KernelFormat,
    sp: f64,
    (parts, packed): (&[DenseMatrix], &DenseMatrix),
    inputs: &[Input],
) -> Result<Vec<FusedRow>> {
    let (gpu, opts) = (bench.gpu, bench.opts);
    let k = model.hidden;
    let upload = |w: &DenseMatrix| -> Result<Box<dyn GpuMatVec>> {
        upload_format(gpu, opts, format, w)?
            .ok_or_else(|| CudaError::Option(format!("{format} has no fixed kernel to fuse")))
    };
    let all = vec![true; k];
    // Separate: sets of one device matrix per part, enough sets to exceed the L2.
    let first_set: Vec<Box<dyn GpuMatVec>> = parts.iter().map(upload).collect::<Result<_>>()?;
    let set_bytes: usize = first_set.iter().map(|w| w.bytes_for(&all)).sum();
    let mut sets = vec![first_set];
    for _ in 1..bench.copies_for(set_bytes) {
        sets.push(parts.iter().map(upload).collect::<Result<_>>()?);
    }
    let first_packed = upload(packed)?;
    let packed_bytes_all = first_packed.bytes_for(&all);
    let mut packs = vec![first_packed];
    for _ in 1..bench.copies_for(packed_bytes_all) {
        packs.push(upload(packed)?);
    }
    let label = packs[0].label();
    let part_rows: Vec<usize> = parts.iter().map(|p| p.rows()).collect();
    let mut sep_out = poisoned(bench, &part_rows)?;
    let mut packed_out = poisoned(bench, &[packed.rows()])?;
    let mut rows = Vec::new();
    for (di, input) in inputs.iter().enumerate() {
        if format == KernelFormat::Dense && di > 0 {
            break;
        }
        let (dp, x, t, want) = (input.dp, &input.x, input.t, &input.want);
        let xd = gpu.upload(x)?;
        let mask = active_mask(x, t);
        let want_packed = vec![want.concat()];
        let mut checks = Vec::new();
        for (w, want) in sets[0].iter().zip(want) {
            checks.push(check(gpu, w.as_ref(), x, t, want)?);
        }
        checks.push(check(gpu, packs[0].as_ref(), x, t, &want_packed[0])?);
        let n = sets.len();
        let sep = bench.measure(&mut sep_out, Some(want), n, |i, ys| {
            for (w, y) in sets[i % n].iter().zip(ys.iter_mut()) {
                w.launch(gpu, &xd, t, y)?;
            }
            Ok(())
        })?;
        let np = packs.len();
        let pk = bench.measure(&mut packed_out, Some(&want_packed), np, |i, ys| {
            packs[i % np].launch(gpu, &xd, t, &mut ys[0])
        })?;
        let bytes = (
            sets[0].iter().map(|w| w.bytes_for(&mask)).sum(),
            packs[0].bytes_for(&mask),
        );
        let row = FusedRow::new(
            model,
            group,
            label.clone(),
            (sp, dp),
            (sep, pk),
            bytes,
            &checks,
        );
        (bench.progress)(&row.progress_line());
        rows.push(row);
    }
    Ok(rows)
}

/// cuBLAS: one GEMM per part against one GEMM on the packed matrix, dp = 0.
fn cublas_row(
    bench: &mut Bench,
    model: &ModelDims,
    group: FusedGroup,
    parts: &[DenseMatrix],
    packed: &DenseMatrix,
    seed: u64,
) -> Result<FusedRow> {
    let gpu = bench.gpu;
    let k = model.hidden;
    let upload_set = || -> Result<Vec<(GpuDense, Cublas)>> {
        parts
            .iter()
            .map(|w| {
                let d = GpuDense::upload(gpu, w)?;
                let b = Cublas::new(gpu, &d)?;
                Ok((d, b))
            })
            .collect()
    };
    let set_bytes: usize = parts.iter().map(|p| p.rows() * k * 2).sum();
    let mut sets = vec![upload_set()?];
    for _ in 1..bench.copies_for(set_bytes) {
        sets.push(upload_set()?);
    }
    let mut packs = Vec::new();
    for _ in 0..bench.copies_for(packed.rows() * k * 2) {
        let d = GpuDense::upload(gpu, packed)?;
        let b = Cublas::new(gpu, &d)?;
        packs.push((d, b));
    }
    let x = activations(k, seed ^ 7);
    let xd = gpu.upload(&x)?;
    let mut x16 = zeroed_f16(gpu, k)?;
    to_f16(gpu, &xd, &mut x16)?;
    let xr = f16_rounded(&x);
    let want: Vec<Vec<f64>> = parts.iter().map(|w| matvec_f64(w, &xr, None)).collect();
    let want_packed = vec![want.concat()];
    let part_rows: Vec<usize> = parts.iter().map(|p| p.rows()).collect();
    let mut sep_out = poisoned(bench, &part_rows)?;
    let mut packed_out = poisoned(bench, &[packed.rows()])?;
    // Eager checks, one launch each into poisoned outputs.
    let mut checks = Vec::new();
    for ((d, b), (y, w)) in sets[0].iter().zip(sep_out.iter_mut().zip(&want)) {
        b.gemm(gpu, d, &x16, 1, y)?;
        checks.push(max_rel_error(&gpu.download(y)?, w));
    }
    let (d, b) = &packs[0];
    b.gemm(gpu, d, &x16, 1, &mut packed_out[0])?;
    checks.push(max_rel_error(
        &gpu.download(&packed_out[0])?,
        &want_packed[0],
    ));
    let n = sets.len();
    let sep = bench.measure(&mut sep_out, Some(&want), n, |i, ys| {
        for ((d, b), y) in sets[i % n].iter().zip(ys.iter_mut()) {
            b.gemm(gpu, d, &x16, 1, y)?;
        }
        Ok(())
    })?;
    let np = packs.len();
    let pk = bench.measure(&mut packed_out, Some(&want_packed), np, |i, ys| {
        let (d, b) = &packs[i % np];
        b.gemm(gpu, d, &x16, 1, &mut ys[0])
    })?;
    let sep_bytes = parts
        .iter()
        .map(|p| p.rows() * k * 2 + k * 2 + p.rows() * 4)
        .sum();
    let packed_bytes = packed.rows() * k * 2 + k * 2 + packed.rows() * 4;
    let row = FusedRow::new(
        model,
        group,
        "cublas".into(),
        (0.0, 0.0),
        (sep, pk),
        (sep_bytes, packed_bytes),
        &checks,
    );
    (bench.progress)(&row.progress_line());
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::shapes::model;

    #[test]
    fn group_shapes_follow_the_model() {
        let l2 = model("llama2-7b").unwrap();
        assert_eq!(FusedGroup::Qkv.part_rows(&l2), vec![4096, 4096, 4096]);
        assert_eq!(FusedGroup::GateUp.part_rows(&l2), vec![11008, 11008]);
        // Grouped-query attention: k and v have 8 heads of 128.
        let l3 = model("llama3-8b").unwrap();
        assert_eq!(FusedGroup::Qkv.part_rows(&l3), vec![4096, 1024, 1024]);
        assert_eq!(FusedGroup::GateUp.part_rows(&l3), vec![14336, 14336]);
        let l70 = model("llama2-70b").unwrap();
        assert_eq!(FusedGroup::Qkv.part_rows(&l70), vec![8192, 1024, 1024]);
        assert_eq!(l70.hidden, 8192);
    }

    #[test]
    fn groups_parse_by_name() {
        assert_eq!("qkv".parse::<FusedGroup>().unwrap(), FusedGroup::Qkv);
        assert_eq!("gateup".parse::<FusedGroup>().unwrap(), FusedGroup::GateUp);
        let e = "qk".parse::<FusedGroup>().unwrap_err().to_string();
        assert!(e.contains("qk") && e.contains("gateup"), "{e}");
    }

    /// The packed matrix's product is the separate products one after the other.
    #[test]
    fn packing_concatenates_rows() {
        let a = sparse_matrix(3, 5, 0.3, Pattern::Unstructured, 1).unwrap();
        let b = sparse_matrix(2, 5, 0.3, Pattern::Unstructured, 2).unwrap();
        let p = pack(&[a.clone(), b.clone()]).unwrap();
        assert_eq!((p.rows(), p.cols()), (5, 5));
        let x = activations(5, 3);
        let mut want = matvec_f64(&a, &x, None);
        want.extend(matvec_f64(&b, &x, None));
        assert_eq!(matvec_f64(&p, &x, None), want);
        let c = sparse_matrix(2, 4, 0.3, Pattern::Unstructured, 2).unwrap();
        assert!(pack(&[a, c]).is_err());
        assert!(pack(&[]).is_err());
    }

    #[test]
    fn the_comparison_times_fixed_kernels_only() {
        let o = super::super::KernelBenchOptions {
            formats: vec![KernelFormat::Auto, KernelFormat::TiledCbc],
            ..Default::default()
        };
        assert_eq!(formats(&o), vec![KernelFormat::TiledCbc]);
    }
}
