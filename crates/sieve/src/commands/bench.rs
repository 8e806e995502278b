//! `sieve bench kernels`: parses the flags into [`sieve_cuda::bench::KernelBenchOptions`], runs
//! the benchmark of `sieve_cuda::bench` and prints its tables (progress on stderr).

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use sieve_cuda::bench::{FusedGroup, KernelBenchOptions, KernelFormat};

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Time the GPU kernels of every format against cuBLAS on LLaMA layer shapes.
    Kernels(KernelsArgs),
    /// Time the low-bit products (W4A16, W8A16, GGUF Q4_0/Q8_0, Balanced-CBC int8/int4)
    /// against cuBLAS f16 at N = 1..32 tokens.
    Gemm(GemmArgs),
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Kernels(a) => run_kernels(a),
        BenchCommand::Gemm(a) => run_gemm(a),
    }
}

#[derive(Args, Debug)]
pub struct GemmArgs {
    /// Model shape sets (llama2-7b, llama2-13b, llama3-8b, llama2-70b) or MxK shapes.
    #[arg(long, value_delimiter = ',', default_value = "llama2-7b")]
    shapes: Vec<String>,
    /// Tokens per product (1..=16384: the rows of f16, the slide and the decode-gemm precisions
    /// take prompts of any of these sizes; the other kernels' rows stop at 256, IE-BME's at 32).
    /// Past 256 tokens each product is checked on a spread of its tokens' rows.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    n: Vec<usize>,
    /// Weight sparsities of the Balanced-CBC rows (N = round(16 (1 - sp)) of every 16 rows) and
    /// of the IE-BME and Tiled-CBC rows (unstructured).
    #[arg(long, value_delimiter = ',', default_value = "0.5")]
    sp: Vec<f64>,
    /// Activation sparsities (TEAL) of the Balanced-CBC and column-major 4-bit rows and of the
    /// IE-BME rows at N = 1.
    #[arg(long, value_delimiter = ',', default_value = "0,0.5")]
    dp: Vec<f64>,
    /// (2N-2):2N patterns of the slide rows (2:4, 4:6, 6:8, ... 14:16).
    #[arg(long, value_delimiter = ',', default_value = "6:8")]
    pattern: Vec<sieve_formats::random::Pattern>,
    /// Precisions: f16 (cuBLAS, always timed as the baseline), w8a16, w4a16 (group 128),
    /// gguf-q4_0, gguf-q8_0, the kernels of the other GGUF types on sieve's quantization
    /// (q4_k-kernel, q5_k-kernel, q6_k-kernel, q4_1-kernel), bcbc-int8, bcbc-int4 (group 128),
    /// bcbc-f16 (N = 1 only), ie-bme-int4, ie-bme-int8 (UnionSparse's union bitmaps, 2 x 2
    /// areas, group 128, every N), tcbc-per-token and tcbc-decode-gemm (Tiled-CBC f16 at sp:
    /// N one-token products, or decoded to f16 then one cuBLAS GEMM, the batched serving
    /// step's way), slide-f16 (SlideSparse: a --pattern matrix lifted to 2:4 on the sparse
    /// tensor cores, the activation lifting timed with it), slide-f16-copy (the same matrix
    /// written as f16 rows, then cuBLAS: the prompt path from 512 tokens), slide-lt-f16,
    /// slide-lt-int8, slide-lt-fp8 (the lifted matrix on cuSPARSELt) beside cublaslt-int8 and
    /// cublaslt-fp8 (the dense 8-bit baselines), tcbc-spmm and tcbc-union (Tiled-CBC on the
    /// tensor cores; the union of a few tokens' active columns), w4a16-decode-gemm and
    /// q4_k-decode-gemm (decoded to f16, then cuBLAS), w4a8 and q4_0-a8 (4-bit weights times
    /// INT8 inputs), w4a16-cols and q4_0-cols (4-bit column-major under a TEAL threshold, N =
    /// 1 at every --sp and --dp: inactive columns never read). docs/USAGE.md lists them all.
    /// (default: f16,w8a16,w4a16,gguf-q4_0,gguf-q8_0 unless --formats is given)
    #[arg(long, value_delimiter = ',')]
    precision: Vec<sieve_cuda::bench::gemm::Precision>,
    /// Weight formats whose every precision runs beside --precision: dense, balanced-cbc,
    /// ie-bme, tiled-cbc, slide, lowbit-cols (`--formats tiled-cbc` = tcbc-per-token,
    /// tcbc-decode-gemm, tcbc-spmm, tcbc-union).
    #[arg(long, value_delimiter = ',')]
    formats: Vec<String>,
    #[arg(long, default_value_t = 100)]
    reps: usize,
    /// Also time every product as CUDA graph replays.
    #[arg(long)]
    graph: bool,
    #[arg(long, default_value_t = 64)]
    graph_launches: usize,
    #[arg(long, default_value_t = 20)]
    graph_replays: usize,
    /// Write every row (and device facts) as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write an SVG plot of speedup over cuBLAS f16 against N here.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl GemmArgs {
    /// --precision, or its default when neither it nor --formats is given, then the precisions
    /// of --formats not already named.
    fn precisions(&self) -> Result<Vec<sieve_cuda::bench::gemm::Precision>> {
        use sieve_cuda::bench::gemm::Precision;
        let mut precisions = self.precision.clone();
        if precisions.is_empty() && self.formats.is_empty() {
            precisions = vec![
                Precision::F16,
                Precision::W8A16,
                Precision::W4A16,
                Precision::GgufQ4_0,
                Precision::GgufQ8_0,
            ];
        }
        for p in Precision::of_formats(&self.formats)? {
            if !precisions.contains(&p) {
                precisions.push(p);
            }
        }
        Ok(precisions)
    }

    fn options(&self) -> Result<sieve_cuda::bench::gemm::GemmBenchOptions> {
        Ok(sieve_cuda::bench::gemm::GemmBenchOptions {
            shapes: self.shapes.clone(),
            n: self.n.clone(),
            sp: self.sp.clone(),
            dp: self.dp.clone(),
            patterns: self.pattern.clone(),
            precisions: self.precisions()?,
            reps: self.reps,
            graph: self.graph,
            graph_launches: self.graph_launches,
            graph_replays: self.graph_replays,
            seed: self.seed,
        })
    }
}

pub fn run_gemm(a: GemmArgs) -> Result<()> {
    let opts = a.options()?;
    opts.validate()?;
    let mut files = ReportFiles::open(a.json.as_deref(), a.plot.as_deref(), &[])?;
    let report = sieve_cuda::bench::gemm::run(&opts, &mut |line| eprintln!("{line}"))
        .context("sieve bench gemm (needs a CUDA GPU)")?;
    print!("{}", report.markdown());
    files.write_json(|| Ok(report.to_json()?))?;
    files.write_plot(|| Ok(report.plot()))?;
    report.check_correct()?;
    Ok(())
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
    /// (sieve's lane-per-8-rows kernel), tiled-cbc-spdp (SPDP's thread-per-row kernel),
    /// tiled-cbc-rr (lane8 with the round-robin decode), auto (the per-layer choice of
    /// sieve_cuda::choice between dense-colmajor and tiled-cbc), balanced-cbc (lane per 16
    /// rows over balanced sparsity: N = round(16 (1 - sp)) of every 16 rows per column, timed on
    /// its own balanced random matrix).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "dense,dense-colmajor,rlc-csc,tiled-cbc,tiled-cbc-spdp,balanced-cbc"
    )]
    formats: Vec<KernelFormat>,
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
    /// Write every row (and device facts) as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write an SVG plot of speedup against total sparsity here.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also time every measurement as CUDA graph replays (time per launch = replay / launches),
    /// beside the per-launch event figures.
    #[arg(long)]
    graph: bool,
    /// Launches per graph (raised to a multiple of the rotated weight copies, two per copy at
    /// least).
    #[arg(long, default_value_t = 64)]
    graph_launches: usize,
    /// Timed replays per graph measurement (median reported).
    #[arg(long, default_value_t = 20)]
    graph_replays: usize,
    /// Multi-matrix groups, qkv and/or gateup: the group as one packed matrix against separate
    /// launches, at the shapes of each named model in --shapes.
    #[arg(long, value_delimiter = ',')]
    fused: Vec<FusedGroup>,
    /// Only the --fused comparison, not the per-shape table.
    #[arg(long)]
    fused_only: bool,
}

impl KernelsArgs {
    fn options(&self) -> KernelBenchOptions {
        KernelBenchOptions {
            shapes: self.shapes.clone(),
            sp: self.sp.clone(),
            dp: self.dp.clone(),
            formats: self.formats.clone(),
            reps: self.reps,
            stages: self.stages,
            tune: self.tune,
            rlc_block_rows: self.rlc_block_rows,
            rlc_cols: self.rlc_cols,
            seed: self.seed,
            graph: self.graph,
            graph_launches: self.graph_launches,
            graph_replays: self.graph_replays,
            fused: self.fused.clone(),
            fused_only: self.fused_only,
        }
    }
}

use super::report_files::ReportFiles;

pub fn run_kernels(a: KernelsArgs) -> Result<()> {
    let opts = a.options();
    opts.validate()?;
    let mut files = ReportFiles::open(a.json.as_deref(), a.plot.as_deref(), &[])?;
    let report = sieve_cuda::bench::run(&opts, &mut |line| eprintln!("{line}"))
        .context("sieve bench kernels (needs a CUDA GPU)")?;
    print!("{}", report.markdown());
    files.write_json(|| Ok(report.to_json()?))?;
    files.write_plot(|| Ok(report.plot()))?;
    report.check_correct()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: BenchCommand,
    }

    fn parse(args: &[&str]) -> std::result::Result<KernelBenchOptions, clap::Error> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))?;
        let BenchCommand::Kernels(a) = cli.command else {
            panic!("not bench kernels");
        };
        Ok(a.options())
    }

    /// The CLI's defaults are the library's.
    #[test]
    fn defaults_match_the_library() {
        assert_eq!(parse(&["kernels"]).unwrap(), KernelBenchOptions::default());
    }

    #[test]
    fn flags_reach_the_options() {
        let o = parse(&[
            "kernels",
            "--shapes",
            "llama3-8b,300x70",
            "--formats",
            "tiled-cbc,auto",
            "--sp",
            "0.5",
            "--reps",
            "7",
            "--tune",
        ])
        .unwrap();
        assert_eq!(o.shapes, vec!["llama3-8b", "300x70"]);
        assert_eq!(o.formats, vec![KernelFormat::TiledCbc, KernelFormat::Auto]);
        assert_eq!((o.sp.clone(), o.reps, o.tune), (vec![0.5], 7, true));
        assert_eq!(o.validate().unwrap().len(), 4);
    }

    #[test]
    fn graph_and_fused_flags() {
        let o = parse(&[
            "kernels",
            "--graph",
            "--graph-launches",
            "32",
            "--fused",
            "qkv,gateup",
            "--fused-only",
            "--shapes",
            "llama3-8b",
        ])
        .unwrap();
        assert!(o.graph && o.fused_only);
        assert_eq!((o.graph_launches, o.graph_replays), (32, 20));
        assert_eq!(o.fused, vec![FusedGroup::Qkv, FusedGroup::GateUp]);
        assert!(o.validate().is_ok());
        assert!(parse(&["kernels", "--fused", "qkvo"]).is_err());
        let custom = parse(&["kernels", "--fused", "qkv", "--shapes", "64x64"]).unwrap();
        assert!(custom.validate().is_err());
    }

    #[test]
    fn gemm_takes_a_plot_path() {
        let gemm = |args: &[&str]| {
            let cli =
                Cli::try_parse_from(["bench", "gemm"].into_iter().chain(args.iter().copied()))?;
            let BenchCommand::Gemm(a) = cli.command else {
                panic!("not bench gemm");
            };
            Ok::<_, clap::Error>(a)
        };
        let a = gemm(&["--plot", "x.svg", "--json", "r.json", "--n", "1,8"]).unwrap();
        assert_eq!(a.plot.as_deref(), Some(std::path::Path::new("x.svg")));
        assert_eq!(a.json.as_deref(), Some(std::path::Path::new("r.json")));
        assert_eq!(a.options().unwrap().n, vec![1, 8]);
        assert!(gemm(&[]).unwrap().plot.is_none());
        assert!(gemm(&["--plot"]).is_err(), "--plot needs a path");
    }

    #[test]
    fn gemm_formats_add_their_precisions_to_the_default_or_the_named_ones() {
        use sieve_cuda::bench::gemm::Precision;
        let precisions = |args: &[&str]| {
            let cli =
                Cli::try_parse_from(["bench", "gemm"].into_iter().chain(args.iter().copied()))
                    .unwrap();
            let BenchCommand::Gemm(a) = cli.command else {
                panic!("not bench gemm");
            };
            a.options().map(|o| o.precisions)
        };
        let default = precisions(&[]).unwrap();
        assert_eq!(default.len(), 5);
        assert_eq!(default[0], Precision::F16);
        // --formats alone: only its precisions (the f16 baseline is timed in any case).
        let slide = [
            Precision::SlideF16,
            Precision::SlideF16Copy,
            Precision::SlideLtF16,
            Precision::SlideLtInt8,
            Precision::SlideLtFp8,
        ];
        assert_eq!(precisions(&["--formats", "slide"]).unwrap(), slide.to_vec());
        // Beside --precision, without repeating one named there.
        let mut named = vec![Precision::F16];
        named.extend(slide);
        assert_eq!(
            precisions(&["--precision", "f16,slide-f16", "--formats", "slide"]).unwrap(),
            named
        );
        let e = precisions(&["--formats", "csr"]).unwrap_err().to_string();
        assert!(e.contains("unknown format 'csr'"), "{e}");
    }

    #[test]
    fn unknown_format_is_a_parse_error_naming_the_known_ones() {
        let e = parse(&["kernels", "--formats", "dense,csr"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("csr") && e.contains("tiled-cbc-spdp"), "{e}");
    }
}
