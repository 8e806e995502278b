//! `sieve sim celty`: the trace-driven model of Celty's sparse SIMT core (crates/sieve-sim).
//! This file only parses, runs the library's sweep (`sieve_sim::sweep`) and prints.

use super::report_files::ReportFiles;
use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use sieve_sim::area::{DecoderDesign, PAPER_HOPPER_PERCENT};
use sieve_sim::measured::Calibration;
use sieve_sim::paper::Comparison;
use sieve_sim::shapes::{parse_shape, shapes_of};
use sieve_sim::{run_sweep, GpuSpec, KernelConfig, SimResult, SweepOptions};

#[derive(Subcommand, Debug)]
pub enum SimCommand {
    /// Celty's sparse SIMT core (RLC decoder + register-file accumulation) on the H200, driven
    /// by real RLC-CSC streams and activation masks, calibrated on the measured kernel.
    Celty(CeltyArgs),
}

pub fn run(cmd: SimCommand) -> Result<()> {
    match cmd {
        SimCommand::Celty(a) => run_celty(a),
    }
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum MappingArg {
    /// sieve's measured kernel: 1024-row blocks, slabs dealt round-robin over 4 warps.
    Kernel,
    /// Celty's warp tile: 256 rows per warp, 4 warps per block.
    Celty,
}

#[derive(Args, Debug)]
pub struct CeltyArgs {
    /// One product shape MxK (overrides --shapes).
    #[arg(long)]
    shape: Option<String>,
    /// Shape sets: llama2-7b, llama2-13b, llama3-8b, llama2-70b, or MxK.
    #[arg(long, value_delimiter = ',', default_value = "llama2-7b")]
    shapes: Vec<String>,
    /// Weight sparsities, each in [0, 1).
    #[arg(long, value_delimiter = ',', default_value = "0.5")]
    sp: Vec<f64>,
    /// Activation sparsities, each in [0, 1).
    #[arg(long, value_delimiter = ',', default_value = "0.5")]
    dp: Vec<f64>,
    /// Fraction of each sub-partition's output rows accumulated in its register file.
    #[arg(long, default_value_t = 0.0)]
    reg_fraction: f64,
    /// The hardware RLC decoder.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    decoder: OnOff,
    /// Thread mapping.
    #[arg(long, value_enum, default_value_t = MappingArg::Kernel)]
    mapping: MappingArg,
    /// Print the calibration against every measured H200 point of the requested shapes (decoder
    /// off, no registers, sieve's kernel), with the Fig. 5 stage split where measured.
    #[arg(long)]
    calibrate: bool,
    /// Print the predictions beside Celty's Figures 5, 6, 11, 12, Table 1 and the LLaMA-2-7B
    /// TPOT, over the requested shapes.
    #[arg(long)]
    paper: bool,
    /// Write every result as JSON.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write the comparison with the paper's figures as SVG (implies --paper).
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn run_celty(a: CeltyArgs) -> Result<()> {
    let mut options = SweepOptions {
        shapes: Vec::new(),
        weight_sparsities: a.sp.clone(),
        activation_sparsities: a.dp.clone(),
        reg_fraction: a.reg_fraction,
        decoder: a.decoder == OnOff::On,
        config: match a.mapping {
            MappingArg::Kernel => KernelConfig::measured(),
            MappingArg::Celty => KernelConfig::celty(),
        },
        calibrate: a.calibrate,
        compare_with_paper: a.paper || a.plot.is_some(),
        seed: a.seed,
    };
    // Ranges first, then shapes, then the report files: the order of refusals is unchanged.
    options.validate()?;
    if let Some(s) = &a.shape {
        options.shapes.push(parse_shape(s)?);
    } else {
        for s in &a.shapes {
            options.shapes.extend(shapes_of(s)?);
        }
    }
    let mut files = ReportFiles::open(a.json.as_deref(), a.plot.as_deref(), &[])?;
    let gpu = GpuSpec::h200();
    let features = options.features();
    println!(
        "model: {} ({} SMs x {} sub-partitions, {:.0} MHz, copy {:.0} GB/s measured); mapping {:?}, \
         decoder {}, registers {:.0}%",
        gpu.name,
        gpu.sms,
        gpu.sub_partitions,
        gpu.clock_mhz,
        gpu.copy_gbs,
        options.config.mapping,
        if features.decoder { "on" } else { "off" },
        100.0 * features.reg_fraction
    );

    let sweep = run_sweep(&options, &mut |p| {
        print_point(&p.result, p.measured_us, p.cublas_us, p.cublas_measured)
    })?;
    if let Some(c) = &sweep.calibration {
        print_calibration(c);
    }
    if let Some(c) = &sweep.comparison {
        print_comparison(c);
        let d = DecoderDesign::celty();
        println!(
            "\nTable 1 (area): decoder {:.0} gate equivalents, {:.1} µm² at N7; paper: at most \
             {PAPER_HOPPER_PERCENT}% on Hopper",
            d.gate_equivalents(),
            d.area_um2(sieve_sim::area::NAND2_UM2_N7, sieve_sim::area::UTILIZATION)
        );
        for (name, pct) in &sweep.area {
            println!("  {name:<32} {pct:.4}%");
        }
    }

    files.write_plot(|| {
        let c = sweep
            .comparison
            .as_ref()
            .context("comparison computed for --plot")?;
        let label = if a.shape.is_some() {
            a.shape.clone().unwrap_or_default()
        } else {
            a.shapes.join(", ")
        };
        let err = sweep.calibration.as_ref().map(|c| c.mean_abs_error);
        Ok(sieve_sim::svg::render(c, &label, err))
    })?;
    files.write_json(|| Ok(serde_json::to_string_pretty(&sweep)?))?;
    Ok(())
}

fn print_point(r: &SimResult, measured: Option<f64>, cublas: f64, cublas_measured: bool) {
    let p = r.point;
    let meas = match measured {
        Some(m) => format!(
            " (measured {m:.1} µs, model error {:+.1}%)",
            100.0 * (r.us / m - 1.0)
        ),
        None => String::new(),
    };
    println!(
        "\n{}x{} sp {:.2} dp {:.2}: {:.1} µs{meas}; cuBLAS {:.1} µs{} -> {:.2}x; roofline {:.1} µs \
         ({:.0} MB at the copy bandwidth)",
        p.m,
        p.k,
        p.sp,
        p.dp,
        r.us,
        cublas,
        if cublas_measured { "" } else { " (estimated)" },
        cublas / r.us,
        r.roofline_us,
        r.dram_bytes / 1e6
    );
    println!(
        "  grid {} blocks; simulated SM: {} blocks ({} warps, up to {} resident), {} cycles, issue \
         busy {:.0}%, MIO busy {:.0}%",
        r.grid_blocks,
        r.simulated_blocks,
        r.warps_simulated,
        r.max_resident_blocks,
        r.sm_cycles,
        100.0 * r.issue_busy,
        100.0 * r.mio_busy
    );
    let w = r.warps_simulated.max(1) as f64;
    let i = &r.instr;
    println!(
        "  instructions per warp: alu {:.0}, ldg {:.0}, shfl {:.0}, lds/sts {:.0}, shared atomics \
         {:.0}, rf-acc {:.0}, rlc-decode {:.0}, global red {:.0}, bar {:.0} (total {:.0})",
        i.alu as f64 / w,
        i.ldg as f64 / w,
        i.shfl as f64 / w,
        i.lds_sts as f64 / w,
        i.atoms as f64 / w,
        i.rf_acc as f64 / w,
        i.decode as f64 / w,
        i.red as f64 / w,
        i.bar as f64 / w,
        r.instr_per_warp
    );
    let a = &r.accum;
    let e = a.entries.max(1) as f64;
    println!(
        "  slabs {} ({} short); entries {}: registers {:.1}%, shared (own partition) {:.1}%, \
         shared fallback {:.1}%; shared atomics {:.2} bank passes each ({:.0}% of passes from \
         conflicts)",
        a.slabs,
        a.short_slabs,
        a.entries,
        100.0 * a.to_registers as f64 / e,
        100.0 * a.to_shared_partition as f64 / e,
        100.0 * a.to_shared_other as f64 / e,
        a.atomic_passes as f64 / a.atomic_instr.max(1) as f64,
        100.0 * r.conflict_share
    );
}

fn print_calibration(c: &Calibration) {
    println!(
        "\ncalibration (decoder off, registers 0, sieve kernel b1024/c64/w4) vs measured H200:"
    );
    println!("| M x K | sp | dp | measured µs | model µs | error |");
    println!("|---|---|---|---|---|---|");
    for p in &c.points {
        println!(
            "| {}x{} | {:.1} | {:.1} | {:.1} | {:.1} | {:+.1}% |",
            p.point.m,
            p.point.k,
            p.point.sp,
            p.point.dp,
            p.measured_us,
            p.model_us,
            100.0 * p.error
        );
    }
    println!(
        "calibration error: mean |error| {:.1}%, max {:.1}%, {} of {} points within 20%",
        100.0 * c.mean_abs_error,
        100.0 * c.max_abs_error,
        c.within_20pct,
        c.points.len()
    );
    if !c.stages.is_empty() {
        println!("\nFig. 5 stage variants (µs, measured / model): full, no reconstruction, no accumulation, loads only; reconstruction share");
        for ((p, m, s), (rm, rs)) in c.stages.iter().zip(c.reconstruction_shares()) {
            println!(
                "  {}x{} sp {:.1} dp {:.1}: {:.1}/{:.1}  {:.1}/{:.1}  {:.1}/{:.1}  {:.1}/{:.1}; recon {:.0}%/{:.0}%",
                p.m, p.k, p.sp, p.dp, m[0], s[0], m[1], s[1], m[2], s[2], m[3], s[3], 100.0 * rm, 100.0 * rs
            );
        }
        let (measured, model) = c.mean_reconstruction_share();
        println!(
            "  mean reconstruction share: measured {:.0}%, model {:.0}%",
            100.0 * measured,
            100.0 * model
        );
    }
}

fn print_comparison(c: &Comparison) {
    println!("\nspeedup over cuBLAS (mean over the shapes; paper: Fig. 6 SMEM kernel 1.49x/2.19x at 50/70%, sparse SIMT core 1.78x/2.73x/4.06x at 30/50/70%):");
    println!("| variant | 30% | 50% | 70% | max |");
    println!("|---|---|---|---|---|");
    let names = c.variant_names();
    for n in &names {
        let cells: Vec<String> = c
            .rows_of(n)
            .map(|r| format!("{:.2}x", r.mean_speedup))
            .collect();
        let max = c.max_speedup_of(n);
        println!("| {n} | {} | {max:.2}x |", cells.join(" | "));
    }
    println!("\nover Macko's bandwidth bound (weight-only SpMV at copy bandwidth; paper Fig. 11: 2.3x / 2.5x at 50/70%):");
    for n in &names {
        let cells: Vec<String> = c
            .rows_of(n)
            .map(|r| format!("{:.2}x", r.mean_vs_macko_bound))
            .collect();
        println!("  {n}: {}", cells.join(" / "));
    }
    println!("\nFig. 12, 5120x5120, Celty tile + decoder, speedup over register fraction 0 (paper in brackets):");
    for p in &c.fig12 {
        println!(
            "  {:.0}% sparsity, registers {:>3.0}%: {:.1} µs, {:.2}x{}; shared-memory share of entries {:.0}%",
            100.0 * p.sparsity,
            100.0 * p.reg_fraction,
            p.us,
            p.speedup,
            p.paper.map(|v| format!(" [{v:.2}x]")).unwrap_or_default(),
            100.0 * p.fallback_share
        );
    }
    println!("\nFig. 5, reconstruction / accumulation share of the kernel time, 4096x11008 (paper: reconstruction up to 40% once accumulation is cheap):");
    for f in &c.fig5 {
        println!(
            "  {} sp=dp={:.1}: reconstruction {:.0}%, accumulation {:.0}%",
            f.variant,
            f.point.sp,
            100.0 * f.recon_share,
            100.0 * f.accum_share
        );
    }
    println!("\nLLaMA-2-7B decode, linear layers of one token (224 products; attention, norms and the LM head not included):");
    for t in &c.tpot {
        println!(
            "  {} at {:.0}%: {:.2} ms vs cuBLAS {:.2} ms -> {:.2}x",
            t.variant,
            100.0 * t.sparsity,
            t.linear_ms,
            t.dense_ms,
            t.speedup
        );
    }
}
