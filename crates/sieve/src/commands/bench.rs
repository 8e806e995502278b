//! `sieve bench kernels`: GPU spMspV / GEMV kernels against cuBLAS on LLaMA layer shapes.
//!
//! For every shape and weight sparsity `sp` a random unstructured matrix is encoded once per
//! format; its device copies rotate so that the weights read per launch are never L2-resident
//! (copies together exceed 4x the L2). For every activation sparsity `dp` a fresh random
//! activation vector gets the threshold that masks a fraction `dp` of it. Each timing is the
//! median of `--reps` CUDA-event-timed launches after warm-up; output zeroing is inside the
//! timed region. Bytes per row are what the format must read at that sp/dp (weights of active
//! columns with their metadata, plus x and y); GB/s is over those bytes, and `%copy` compares
//! with a device-to-device copy measured in the same run.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde::Serialize;
use sieve_cuda::choice::upload_chosen;
use sieve_cuda::dense::{to_f16, zeroed_f16, Cublas, GpuDense, GpuDenseColMajor};
use sieve_cuda::product::{active_mask, GpuMatVec};
use sieve_cuda::rlc_csc::{GpuRlcCsc, Stages};
use sieve_cuda::tiled_cbc::{GpuTiledCbc, Lane8Shape, TcbcKernel};
use sieve_cuda::timing::{copy_bandwidth_gbs, time_launches};
use sieve_cuda::{DeviceInfo, Gpu};
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::reference::{matvec_f64, max_rel_error};
use sieve_formats::rlc_csc::{RlcCsc, RlcCscOptions};
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::DenseMatrix;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Time the GPU kernels of every format against cuBLAS on LLaMA layer shapes.
    Kernels(KernelsArgs),
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Kernels(a) => run_kernels(a),
    }
}

#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// Model shape sets: llama2-7b, llama2-13b, llama3-8b, llama2-70b, or MxK (e.g. 4096x4096).
    #[arg(long, value_delimiter = ',', default_value = "llama2-7b")]
    shapes: Vec<String>,
    /// Weight sparsities (fractions of zero weights), each in [0, 1).
    #[arg(long, value_delimiter = ',', default_value = "0,0.3,0.5,0.7")]
    sp: Vec<f64>,
    /// Activation sparsities (fractions of inactive inputs), each in [0, 1).
    #[arg(long, value_delimiter = ',', default_value = "0,0.3,0.5,0.7")]
    dp: Vec<f64>,
    /// Kernels: dense (our GEMV), dense-colmajor (TEAL alone), rlc-csc (Celty), tiled-cbc
    /// (sieve's lane-per-8-rows kernel), tiled-cbc-spdp (SPDP's thread-per-row kernel), auto
    /// (the per-layer choice of sieve_cuda::choice between dense-colmajor and tiled-cbc).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "dense,dense-colmajor,rlc-csc,tiled-cbc,tiled-cbc-spdp"
    )]
    formats: Vec<String>,
    /// Timed launches per measurement (median reported).
    #[arg(long, default_value_t = 100)]
    reps: usize,
    /// Also time RLC-CSC with one stage left out (Celty Fig. 5), at every point.
    #[arg(long)]
    stages: bool,
    /// Also time a small sweep of tuning knobs (RLC-CSC block rows / inner loop, Tiled-CBC
    /// split-K), labelled per variant.
    #[arg(long)]
    tune: bool,
    /// RLC-CSC row-block height (multiple of 256) for the default variant.
    #[arg(long, default_value_t = 1024)]
    rlc_block_rows: usize,
    /// RLC-CSC inner-loop size (columns per block) for the default variant.
    #[arg(long, default_value_t = 64)]
    rlc_cols: usize,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Serialize, Clone)]
struct Row {
    format: String,
    model: String,
    m: usize,
    k: usize,
    sp: f64,
    dp: f64,
    total_sparsity: f64,
    us: f64,
    us_min: f64,
    speedup_vs_cublas: f64,
    bytes: usize,
    gbs: f64,
    pct_copy_bw: f64,
    /// Relative error of this kernel's output against the f64 reference (checked once per
    /// point, outside the timed loop); absent for stage-skipping variants.
    rel_error: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    device: DeviceInfo,
    copy_gbs: f64,
    /// Median time of an empty kernel under the same event bracketing: the floor every row's
    /// µs includes.
    empty_launch_us: f64,
    reps: usize,
    cublas: Vec<(String, usize, usize, f64)>,
    rows: Vec<Row>,
}

fn shapes_of(name: &str) -> Result<Vec<(String, usize, usize)>> {
    let s = |m, k| (name.to_string(), m, k);
    Ok(match name {
        "llama2-7b" => vec![s(4096, 4096), s(11008, 4096), s(4096, 11008)],
        "llama2-13b" => vec![s(5120, 5120), s(13824, 5120), s(5120, 13824)],
        "llama3-8b" => vec![s(1024, 4096), s(14336, 4096), s(4096, 14336)],
        "llama2-70b" => vec![s(8192, 8192), s(28672, 8192), s(8192, 28672)],
        other => {
            let (m, k) = other
                .split_once('x')
                .with_context(|| format!("unknown shape set '{other}'"))?;
            let (m, k): (usize, usize) = (m.parse()?, k.parse()?);
            if m == 0 || k == 0 {
                bail!("shape {other} has a zero dimension");
            }
            vec![("custom".to_string(), m, k)]
        }
    })
}

/// One kernel variant: the copy it is checked on, and the further copies timed launches rotate
/// over.
type Rotation = (Box<dyn GpuMatVec>, Vec<Box<dyn GpuMatVec>>);

/// Every value `--formats` accepts.
const KERNEL_FORMATS: [&str; 6] = [
    "dense",
    "dense-colmajor",
    "rlc-csc",
    "tiled-cbc",
    "tiled-cbc-spdp",
    "auto",
];

/// Copies of a buffer of `bytes` needed so that one pass over them exceeds 4x the L2.
fn copies_for(bytes: usize, l2: usize) -> usize {
    (4 * l2).div_ceil(bytes.max(1)).clamp(1, 64)
}

pub fn run_kernels(a: KernelsArgs) -> Result<()> {
    for v in a.sp.iter().chain(&a.dp) {
        if !(0.0..1.0).contains(v) {
            bail!("sparsity {v} outside [0, 1)");
        }
    }
    if a.reps == 0 {
        bail!("--reps must be positive");
    }
    for f in &a.formats {
        if !KERNEL_FORMATS.contains(&f.as_str()) {
            bail!(
                "unknown kernel format '{f}' (known: {})",
                KERNEL_FORMATS.join(", ")
            );
        }
    }
    let has = |f: &str| a.formats.iter().any(|x| x == f);
    let gpu = Gpu::new(0).context("sieve bench kernels needs a CUDA GPU")?;
    let info = gpu.info().clone();
    let l2 = info.l2_bytes.max(1 << 20);
    eprintln!(
        "device: {} (sm_{}{}), {} SMs, L2 {} MB",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.multiprocessors,
        l2 >> 20
    );
    let copy_gbs = copy_bandwidth_gbs(&gpu, 1 << 30, 20)?;
    eprintln!("copy bandwidth (read + write): {copy_gbs:.0} GB/s");
    let empty_launch_us =
        time_launches(&gpu, 10, 200, |_| sieve_cuda::timing::spin(&gpu, 0))?.median_us;
    eprintln!("empty kernel launch (event-bracketed median): {empty_launch_us:.2} µs");

    let mut shapes = Vec::new();
    for s in &a.shapes {
        shapes.extend(shapes_of(s)?);
    }
    let mut rows: Vec<Row> = Vec::new();
    let mut cublas_times = Vec::new();
    let warmup = 10;
    for (si, (model, m, k)) in shapes.iter().enumerate() {
        let (m, k) = (*m, *k);
        let seed = a.seed.wrapping_add(si as u64 * 1000);
        // cuBLAS and our dense GEMV on the unpruned matrix: what a dense model runs.
        let w0 = sparse_matrix(m, k, 0.0, Pattern::Unstructured, seed)?;
        let dense_copies: Vec<GpuDense> = (0..copies_for(m * k * 2, l2))
            .map(|_| GpuDense::upload(&gpu, &w0))
            .collect::<sieve_cuda::Result<_>>()?;
        let blas = Cublas::new(&gpu, &dense_copies[0])?;
        let x0 = activations(k, seed ^ 7);
        let xd = gpu.upload(&x0)?;
        let mut x16 = zeroed_f16(&gpu, k)?;
        to_f16(&gpu, &xd, &mut x16)?;
        let mut y = gpu.poisoned_f32(m)?;
        let nd = dense_copies.len();
        let t_blas = time_launches(&gpu, warmup, a.reps, |i| {
            blas.gemm(&gpu, &dense_copies[i % nd], &x16, 1, &mut y)
        })?;
        cublas_times.push((model.clone(), m, k, t_blas.median_us));
        let dense_bytes = m * k * 2 + k * 2 + m * 4;
        let push =
            |rows: &mut Vec<Row>,
             format: String,
             sp: f64,
             dp: f64,
             t: sieve_cuda::timing::Timing,
             bytes: usize,
             err: Option<f64>| {
                let gbs = bytes as f64 / (t.median_us * 1e-6) / 1e9;
                let row = Row {
                    format,
                    model: model.clone(),
                    m,
                    k,
                    sp,
                    dp,
                    total_sparsity: 1.0 - (1.0 - sp) * (1.0 - dp),
                    us: t.median_us,
                    us_min: t.min_us,
                    speedup_vs_cublas: t_blas.median_us / t.median_us,
                    bytes,
                    gbs,
                    pct_copy_bw: 100.0 * gbs / copy_gbs,
                    rel_error: err,
                };
                eprintln!(
                "{:<28} {:>6}x{:<6} sp={:.2} dp={:.2} {:>9.2} us {:>6.2}x {:>7.0} GB/s {:>5.1}%{}",
                row.format, m, k, sp, dp, row.us, row.speedup_vs_cublas, row.gbs, row.pct_copy_bw,
                err.map(|e| format!("  err {e:.1e}")).unwrap_or_default()
            );
                rows.push(row);
            };
        push(
            &mut rows,
            "cublas".into(),
            0.0,
            0.0,
            t_blas,
            dense_bytes,
            None,
        );

        let check = |gpu: &Gpu, w: &dyn GpuMatVec, dm: &DenseMatrix, x: &[f32], t| -> Result<f64> {
            let got = sieve_cuda::matvec_host(gpu, w, x, t)?;
            Ok(max_rel_error(&got, &matvec_f64(dm, x, t)))
        };

        for (di, &dp) in a.dp.iter().enumerate() {
            let x = activations(k, seed ^ (0x100 + di as u64));
            let t = threshold_for_sparsity(&x, dp)?;
            let xd = gpu.upload(&x)?;
            let mask = active_mask(&x, t);
            if has("dense") && di == 0 {
                let err = check(&gpu, &dense_copies[0], &w0, &x, t)?;
                let tm = time_launches(&gpu, warmup, a.reps, |i| {
                    dense_copies[i % nd].launch(&gpu, &xd, t, &mut y)
                })?;
                push(
                    &mut rows,
                    "dense-gemv".into(),
                    0.0,
                    dp,
                    tm,
                    dense_copies[0].bytes_for(&mask),
                    Some(err),
                );
            }
            if has("dense-colmajor") {
                let cm = GpuDenseColMajor::upload(&gpu, &w0)?;
                let bytes = cm.bytes_for(&vec![true; k]);
                let mut cms = vec![cm];
                for _ in 1..copies_for(bytes, l2) {
                    cms.push(GpuDenseColMajor::upload(&gpu, &w0)?);
                }
                let n = cms.len();
                let cpws: &[usize] = if a.tune { &[0, 64, 128] } else { &[0] };
                for &cpw in cpws {
                    for c in cms.iter_mut() {
                        c.cols_per_warp = cpw;
                    }
                    let err = check(&gpu, &cms[0], &w0, &x, t)?;
                    let tm = time_launches(&gpu, warmup, a.reps, |i| {
                        cms[i % n].launch(&gpu, &xd, t, &mut y)
                    })?;
                    push(
                        &mut rows,
                        cms[0].label(),
                        0.0,
                        dp,
                        tm,
                        cms[0].bytes_for(&mask),
                        Some(err),
                    );
                }
            }
        }

        for (pi, &sp) in a.sp.iter().enumerate() {
            if !(has("rlc-csc") || has("tiled-cbc") || has("tiled-cbc-spdp") || has("auto")) {
                break;
            }
            let w = sparse_matrix(m, k, sp, Pattern::Unstructured, seed ^ (0x10 + pi as u64))?;
            let mut variants: Vec<Rotation> = Vec::new();
            if has("rlc-csc") {
                let mut configs = vec![(a.rlc_block_rows, a.rlc_cols)];
                if a.tune {
                    for br in [1024usize, 4096] {
                        for c in [32usize, 64, 128] {
                            if !configs.contains(&(br, c)) {
                                configs.push((br, c));
                            }
                        }
                    }
                }
                let mut encoded: Vec<(usize, RlcCsc)> = Vec::new();
                for &(br, c) in &configs {
                    if !encoded.iter().any(|(b, _)| *b == br) {
                        let opts = RlcCscOptions {
                            index_bits: 4,
                            block_rows: br,
                        };
                        encoded.push((br, RlcCsc::encode(&w, &opts)?));
                    }
                    let f = &encoded.iter().find(|(b, _)| *b == br).context("encoded")?.1;
                    let bytes = sieve_formats::WeightFormat::storage(f).total_bytes();
                    let mut copies: Vec<Box<dyn GpuMatVec>> = Vec::new();
                    let mut stage_variants = Vec::new();
                    for ci in 0..copies_for(bytes, l2) {
                        let mut g = GpuRlcCsc::upload(&gpu, f)?;
                        g.cols_per_warp = c;
                        if a.stages && ci == 0 && (br, c) == configs[0] {
                            for st in [
                                Stages::NoReconstruction,
                                Stages::NoAccumulation,
                                Stages::LoadsOnly,
                            ] {
                                let mut v = GpuRlcCsc::upload(&gpu, f)?;
                                v.cols_per_warp = c;
                                v.stages = st;
                                stage_variants.push(v);
                            }
                        }
                        copies.push(Box::new(g));
                    }
                    let first = copies.remove(0);
                    variants.push((first, copies));
                    // Stage variants share the full kernel's rotation (same bytes, same
                    // addresses pattern): one copy rotated with the full kernel's copies.
                    for v in stage_variants {
                        let extra: Vec<Box<dyn GpuMatVec>> = Vec::new();
                        variants.push((Box::new(v), extra));
                    }
                }
            }
            if has("tiled-cbc") || has("tiled-cbc-spdp") {
                let f = TiledCbc::encode(&w)?;
                let bytes = sieve_formats::WeightFormat::storage(&f).total_bytes();
                // (kernel, gtiles per block (0 = auto), lane8 waves, lane8 pipeline shape)
                let lane8 = Lane8Shape::DEFAULT;
                let mut configs = Vec::new();
                if has("tiled-cbc") {
                    configs.push((TcbcKernel::Lane8, 0usize, 1usize, lane8));
                    if a.tune {
                        configs.push((TcbcKernel::Lane8, 0, 2, lane8));
                        for shape in &Lane8Shape::ALL[1..] {
                            configs.push((TcbcKernel::Lane8, 0, 1, *shape));
                        }
                    }
                }
                if has("tiled-cbc-spdp") {
                    configs.push((TcbcKernel::Spdp, 0, 1, lane8));
                    if a.tune {
                        configs.push((TcbcKernel::Spdp, 16, 1, lane8));
                    }
                }
                for (kernel, gpb, waves, shape) in configs {
                    let mut copies: Vec<Box<dyn GpuMatVec>> = Vec::new();
                    for _ in 0..copies_for(bytes, l2) {
                        let mut g = GpuTiledCbc::upload(&gpu, &f)?;
                        g.kernel = kernel;
                        g.gtiles_per_block = gpb;
                        g.lane8_waves = waves;
                        g.lane8_shape = shape;
                        copies.push(Box::new(g));
                    }
                    let first = copies.remove(0);
                    variants.push((first, copies));
                }
            }
            for (di, &dp) in a.dp.iter().enumerate() {
                let x = activations(k, seed ^ (0x100 + di as u64));
                let t = threshold_for_sparsity(&x, dp)?;
                let xd = gpu.upload(&x)?;
                let mask = active_mask(&x, t);
                for (first, rest) in &variants {
                    let label = first.label();
                    let full = !label.contains("/no-") && !label.contains("/loads-only");
                    let err = if full {
                        Some(check(&gpu, first.as_ref(), &w, &x, t)?)
                    } else {
                        None
                    };
                    let n = rest.len() + 1;
                    let tm = time_launches(&gpu, warmup, a.reps, |i| {
                        let r = i % n;
                        let f: &dyn GpuMatVec = if r == 0 {
                            first.as_ref()
                        } else {
                            rest[r - 1].as_ref()
                        };
                        f.launch(&gpu, &xd, t, &mut y)
                    })?;
                    push(&mut rows, label, sp, dp, tm, first.bytes_for(&mask), err);
                }
                if has("auto") {
                    // The per-layer choice (sieve_cuda::choice) for this sp and dp, rotated
                    // over enough copies like every other kernel.
                    let first = upload_chosen(&gpu, &w, dp)?;
                    let bytes = first.bytes_for(&vec![true; k]);
                    let mut copies = vec![first];
                    for _ in 1..copies_for(bytes, l2) {
                        copies.push(upload_chosen(&gpu, &w, dp)?);
                    }
                    let err = check(&gpu, copies[0].as_ref(), &w, &x, t)?;
                    let n = copies.len();
                    let tm = time_launches(&gpu, warmup, a.reps, |i| {
                        copies[i % n].launch(&gpu, &xd, t, &mut y)
                    })?;
                    let label = format!("auto:{}", copies[0].label());
                    push(
                        &mut rows,
                        label,
                        sp,
                        dp,
                        tm,
                        copies[0].bytes_for(&mask),
                        Some(err),
                    );
                }
            }
        }
    }

    print_table(&rows, copy_gbs);
    if let Some(p) = &a.json {
        let report = Report {
            device: info.clone(),
            copy_gbs,
            empty_launch_us,
            reps: a.reps,
            cublas: cublas_times,
            rows: rows.clone(),
        };
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.plot {
        std::fs::write(p, svg_plot(&rows, &info.name))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    let worst = rows
        .iter()
        .filter_map(|r| r.rel_error)
        .fold(0.0f64, f64::max);
    if worst >= 1e-3 {
        bail!("a kernel disagreed with the reference: max rel error {worst:.2e}");
    }
    Ok(())
}

fn print_table(rows: &[Row], copy_gbs: f64) {
    println!("copy bandwidth {copy_gbs:.0} GB/s");
    println!("| format | M x K | sp | dp | µs | vs cuBLAS | MB read | GB/s | % copy | rel err |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {}x{} | {:.2} | {:.2} | {:.2} | {:.2}x | {:.1} | {:.0} | {:.0}% | {} |",
            r.format,
            r.m,
            r.k,
            r.sp,
            r.dp,
            r.us,
            r.speedup_vs_cublas,
            r.bytes as f64 / 1e6,
            r.gbs,
            r.pct_copy_bw,
            r.rel_error
                .map(|e| format!("{e:.1e}"))
                .unwrap_or_else(|| "-".into())
        );
    }
}

/// Speedup over cuBLAS against total sparsity 1 - (1 - sp)(1 - dp), one colour per format
/// (kernel family), points averaged over shapes. Plain SVG written by hand.
fn svg_plot(rows: &[Row], device: &str) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write;
    let family = |f: &str| f.split('/').next().unwrap_or(f).to_string();
    let mut series: BTreeMap<String, BTreeMap<i64, (f64, usize)>> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.rel_error.is_some() || r.format == "cublas")
    {
        let key = (r.total_sparsity * 1000.0).round() as i64;
        let e = series
            .entry(family(&r.format))
            .or_default()
            .entry(key)
            .or_insert((0.0, 0));
        e.0 += r.speedup_vs_cublas;
        e.1 += 1;
    }
    let (w, h, pad) = (760.0, 480.0, 60.0);
    let ymax = series
        .values()
        .flat_map(|s| s.values().map(|(v, n)| v / *n as f64))
        .fold(1.0f64, f64::max)
        .ceil()
        .max(2.0);
    let px = |x: f64| pad + x * (w - 2.0 * pad);
    let py = |y: f64| h - pad - y / ymax * (h - 2.0 * pad);
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf",
    ];
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">Speedup over cuBLAS vs total sparsity ({device}), mean over shapes</text>"#,
        w / 2.0
    );
    for i in 0..=10 {
        let x = i as f64 / 10.0;
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#eee"/><text x="{0}" y="{3}" text-anchor="middle">{x:.1}</text>"##,
            px(x),
            py(0.0),
            py(ymax),
            h - pad + 16.0
        );
    }
    let ysteps = ymax as usize;
    for i in 0..=ysteps {
        let y = i as f64;
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="{3}"/><text x="{4}" y="{5}" text-anchor="end">{y:.0}x</text>"##,
            px(0.0),
            py(y),
            px(1.0),
            if i == 1 { "#999" } else { "#eee" },
            pad - 6.0,
            py(y) + 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">total sparsity 1-(1-sp)(1-dp)</text>"#,
        w / 2.0,
        h - 14.0
    );
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let path: Vec<String> = pts
            .iter()
            .map(|(k, (v, n))| format!("{:.1},{:.1}", px(*k as f64 / 1000.0), py(v / *n as f64)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for p in &path {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{c}"/>"#);
        }
        let ly = pad + 16.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<rect x="{}" y="{}" width="12" height="12" fill="{c}"/><text x="{}" y="{}">{name}</text>"#,
            px(0.0) + 10.0,
            ly,
            px(0.0) + 28.0,
            ly + 10.0
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse() {
        assert_eq!(shapes_of("llama2-7b").unwrap().len(), 3);
        assert_eq!(shapes_of("300x70").unwrap()[0].1, 300);
        assert!(shapes_of("nope").is_err());
        assert!(shapes_of("0x5").is_err());
    }

    #[test]
    fn rotation_exceeds_l2() {
        let l2 = 60 << 20;
        assert!(copies_for(32 << 20, l2) * (32 << 20) >= 4 * l2);
        assert_eq!(copies_for(1 << 30, l2), 1);
    }

    #[test]
    fn svg_is_well_formed_enough() {
        let r = Row {
            format: "rlc-csc/b1024/c64/w8".into(),
            model: "m".into(),
            m: 1,
            k: 1,
            sp: 0.5,
            dp: 0.5,
            total_sparsity: 0.75,
            us: 1.0,
            us_min: 1.0,
            speedup_vs_cublas: 2.0,
            bytes: 1,
            gbs: 1.0,
            pct_copy_bw: 1.0,
            rel_error: Some(0.0),
        };
        let s = svg_plot(&[r], "gpu");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("rlc-csc"));
    }
}
