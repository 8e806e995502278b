//! `sieve pack`: prune a model on calibration text, set TEAL thresholds, write a `.sieve` file.
//! This file only parses, runs the library's assembly (`sieve_prune::pack`) and prints.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use sieve_model::generate::init_threads;
use sieve_model::packed::HeadBlocks;
use sieve_prune::pack::{pack, PackEvent, PackOptions};
use sieve_prune::pipeline::{check_values_for_format, pattern_for_format, FormatChoice, ValueGrid};
use sieve_prune::{Method, Pattern};
use std::path::PathBuf;

/// Calibration text used when `--calib` is not given (never the test split).
/// WikiText-2's validation split (`model_path::default_text` says where it is looked for).
const DEFAULT_CALIB: &str = "valid.txt";

#[derive(Args)]
pub struct PackArgs {
    /// Model file or directory (default: $SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Output `.sieve` file.
    #[arg(long)]
    out: PathBuf,
    /// magnitude | wanda | sparsegpt
    #[arg(long, default_value = "wanda")]
    method: String,
    /// Weight sparsity per linear in [0, 1) (unstructured, and bare `--pattern balanced`;
    /// N:M and balanced:N:M patterns fix their own).
    #[arg(long, default_value_t = 0.5)]
    sp: f64,
    /// unstructured | N:M (at most N of every M consecutive inputs of a row: 2:4, 6:8, 14:16,
    /// ...) | balanced (at most N of every 16 consecutive outputs of an input column, N =
    /// round(16 (1 - sp)) clamped to 1..=16: sp 0.5 -> 8:16, 0.7 -> 5:16) | balanced:N:M.
    /// Default: unstructured (balanced with --format balanced-cbc, which takes only balanced:N:16).
    #[arg(long)]
    pattern: Option<String>,
    /// Target activation sparsity per linear input in [0, 1) (TEAL thresholds; 0 = none).
    #[arg(long, default_value_t = 0.0)]
    dp: f64,
    /// auto | dense | rlc-csc | tiled-cbc | ie-bme | slide
    #[arg(long, default_value = "auto")]
    format: String,
    /// f16 | int8 | int4 | int4:G: int8 snaps each row's kept weights to a symmetric int8 grid
    /// (one scale per row, still stored as f16), so that the CPU product of balanced-cbc streams
    /// 1-byte values; int4:G snaps them to symmetric 4-bit grids with one f16 scale per row and
    /// group of G consecutive input columns (G = 32, 64 or 128; int4 = int4:64), for 4-bit
    /// records. SparseGPT rounds in its sweep and compensates the rounding errors. With
    /// --format balanced-cbc; also --format dense with int4:128, stored as f16 (the CPU
    /// multiplies f16) and multiplied from its 4-bit integers on the GPU (W4A16; column-major,
    /// reading only active columns, when the pack has TEAL thresholds).
    #[arg(long, default_value = "f16")]
    values: String,
    /// q8_0 | q4_1: the blocks the CPU multiplies a dense LM head in when the pack is loaded
    /// (q4_1: 5 bits per weight instead of 8.5, the head being a fifth to a quarter of a
    /// decode step; costs some quality, docs/BENCHMARKS.md).
    #[arg(long, default_value = "q8_0")]
    head: String,
    /// Calibration text (default: WikiText-2 valid, from $SIEVE_HOME/data/wikitext-2/).
    #[arg(long)]
    calib: Option<PathBuf>,
    /// Calibration windows.
    #[arg(long, default_value_t = 32)]
    calib_samples: usize,
    /// Tokens per calibration window.
    #[arg(long, default_value_t = 1024)]
    calib_len: usize,
    /// Spread --dp over each layer's input sites with TEAL's block-wise greedy allocation
    /// (instead of every site at --dp).
    #[arg(long)]
    teal_greedy: bool,
    /// Activation rows per input site kept for the dual-sparsity report.
    #[arg(long, default_value_t = 2048)]
    report_tokens: usize,
    /// Worker threads (default: one per core; at most 256).
    #[arg(long)]
    threads: Option<usize>,
    /// Also print the per-linear report as JSON lines.
    #[arg(long)]
    verbose: bool,
}

pub fn run(args: PackArgs) -> Result<()> {
    if let Some(n) = args.threads {
        init_threads(n)?;
    }
    let method: Method = args.method.parse()?;
    // Before the format is parsed: the pattern a format needs (balanced-cbc) follows its name.
    let pattern: Pattern = pattern_for_format(args.pattern.as_deref(), args.sp, &args.format)?;
    let format: FormatChoice = args.format.parse()?;
    let values: ValueGrid = args.values.parse()?;
    check_values_for_format(values, format)?;
    let head: HeadBlocks = args.head.parse()?;
    for (what, v) in [("--sp", args.sp), ("--dp", args.dp)] {
        if !(0.0..1.0).contains(&v) {
            bail!("{what} {v} is outside [0, 1)");
        }
    }
    let calib = match args.calib {
        Some(c) => c,
        None => super::model_path::default_text(DEFAULT_CALIB).context("no --calib given")?,
    };
    let path = super::model_path::resolve_model(args.model.as_deref())?;
    let options = PackOptions {
        model: path,
        calib,
        out: args.out,
        method,
        pattern,
        sp: args.sp,
        dp: args.dp,
        format,
        values,
        head,
        calib_samples: args.calib_samples,
        calib_len: args.calib_len,
        teal_greedy: args.teal_greedy,
        report_tokens: args.report_tokens,
    };
    let mut bar: Option<ProgressBar> = None;
    let report = pack(&options, &mut |event| match event {
        PackEvent::StaleOutputRemoved(stale) => eprintln!(
            "pack: removed {}, a partial output left by a process that no longer runs",
            stale.display()
        ),
        PackEvent::Calibrated {
            windows,
            text_tokens,
        } => {
            print_start(&options, windows, text_tokens);
            let b = ProgressBar::new(1);
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar = Some(b);
        }
        PackEvent::Progress(p) => {
            if let Some(bar) = &bar {
                bar.set_length(p.total);
                bar.set_position(p.done);
                bar.set_message(format!("layer {} {}", p.layer, p.stage));
            }
        }
        PackEvent::Pruned => {
            if let Some(bar) = bar.take() {
                bar.finish_and_clear();
            }
        }
    })?;
    let out = &options.out;
    if args.verbose {
        for l in &report.linears {
            println!("{}", serde_json::to_string(l)?);
        }
    }
    print!("{}", report.summary());
    if let Some(products) = report.product_seconds {
        print!("{}", report.measured_choices());
        println!(
            "predicted decode: the projections' products take {:.2} ms per token here \
             (measured, cold caches, {} threads): at most {:.0} tok/s before the LM head and \
             attention",
            products * 1e3,
            report.threads,
            1.0 / products.max(1e-12)
        );
    }
    let size = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    println!(
        "wrote {} ({:.1} MB) in {:.1} s of pruning",
        out.display(),
        size as f64 / 1e6,
        report.seconds
    );
    Ok(())
}

/// What is about to be pruned, on what calibration (stderr), and the note on balanced patterns.
fn print_start(o: &PackOptions, windows: usize, text_tokens: usize) {
    eprintln!(
        "pack: {} {} sp={} dp={} format={} values={} head={} on {} x {} tokens spread over {text_tokens} tokens of {}",
        o.method,
        o.pattern,
        o.sp,
        o.dp,
        o.format,
        o.values,
        o.head,
        windows,
        o.calib_len,
        o.calib.display()
    );
    if o.pattern.is_balanced() && o.method != Method::SparseGpt {
        // Within one column group every score carries the same activation norm, so Wanda
        // chooses what magnitude does (docs/QUALITY.md: 3.6x the unstructured perplexity at 8:16).
        eprintln!(
            "pack: note: with the balanced pattern {} keeps the largest weights of each group; \
             sparsegpt compensates the pruned ones and loses far less perplexity (docs/QUALITY.md)",
            o.method
        );
    }
}
