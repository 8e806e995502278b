//! `sieve bench decode`: whole-model decode on the GPU (logic in `sieve_gpu::bench`).

use anyhow::{bail, Context, Result};
use clap::Args;
use sieve_cuda::persistent::{ClassBandwidth, TraceSummary};
use sieve_cuda::tiled_cbc::TcbcKernel;
use sieve_formats::random::Pattern;
use sieve_formats::FormatKind;
use sieve_gpu::bench::{self, DecodeBenchOptions, DecodeResult, LeftOut};
use sieve_gpu::runner::StepMode;
use std::path::PathBuf;

use super::report_files::ReportFiles;

#[derive(Args, Debug)]
pub struct DecodeArgs {
    /// A synthetic model of a real shape: llama2-7b, llama2-13b, llama3-8b, llama2-70b,
    /// smollm2-135m.
    #[arg(long, conflicts_with = "model")]
    synthetic: Option<String>,
    /// A real model (GGUF, safetensors directory or .sieve pack), measured as it is packed.
    #[arg(long)]
    model: Option<PathBuf>,
    /// With --model X.gguf: dequantize its blocks to dense f16 on loading (the f16 model of
    /// the same weights, e.g. for the persistent step) instead of multiplying the blocks.
    #[arg(long, requires = "model")]
    f16_weights: bool,
    /// Weight sparsities of the synthetic configurations, paired with --dp.
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,0.7")]
    sp: Vec<f64>,
    /// Activation sparsities, paired with --sp.
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,0.7")]
    dp: Vec<f64>,
    /// Format of the sparse configurations: tiled-cbc, rlc-csc, balanced-cbc, ie-bme (with
    /// --values int4[:64|128] or int8), slide (with --pattern (2N-2):2N, e.g. 6:8 or 2:4),
    /// dense.
    #[arg(long, default_value = "tiled-cbc")]
    format: String,
    /// What the synthetic models' kept weights are stored as, one model each: f16, int8, int4
    /// (dense: W8A16, W4A16 g128; balanced-cbc: int8, int4[:32|64|128] values; ie-bme: int8,
    /// int4[:64|128]), q4_0, q8_0 (dense GGUF blocks).
    #[arg(long, value_delimiter = ',', default_value = "f16")]
    values: Vec<String>,
    /// Pruning pattern of the synthetic weights: unstructured or N:M.
    #[arg(long, default_value = "unstructured")]
    pattern: String,
    /// Prompt tokens (random ids).
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Generated tokens timed.
    #[arg(long, default_value_t = 256)]
    tokens: usize,
    /// Also time decode at this position (e.g. 8192); 0 skips it.
    #[arg(long, default_value_t = 0)]
    context: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tiled-CBC kernels, each measured on the same model: lane8 (a lane per 8 rows) and/or rr
    /// (round-robin rows, conflict-free shared loads).
    #[arg(long, value_delimiter = ',', default_value = "lane8")]
    tcbc_kernel: Vec<String>,
    /// Programmatic dependent launch between the step's kernels: on, off, or off,on (both
    /// measured on the same model).
    #[arg(long, value_delimiter = ',', default_value = "on")]
    pdl: Vec<String>,
    /// How much of each product's weights the small kernel before it asks L2 for in the graph
    /// step (RMSNorm, RoPE, SwiGLU run while DRAM would idle): off, on (the default: 2 MB), or
    /// a size in MB; several (e.g. off,on,16) are each measured on the same model. Default: the
    /// runner's setting.
    #[arg(long, value_delimiter = ',')]
    prefetch: Vec<String>,
    /// Also time the serving path's decode step of this many sequences at once, one
    /// measurement per value (e.g. 1,8,32,64): aggregate tokens per second.
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// What the KV cache stores: f16, or int8 (one scale per position and KV head).
    #[arg(long, value_enum, default_value_t = super::device::KvCache::F16)]
    kv_cache: super::device::KvCache,
    /// What the 4-bit matrices multiply: f16 inputs, or int8 (each token's input quantized
    /// with one scale per 128 columns, on the integer tensor cores: W4A8).
    #[arg(long, value_enum, default_value_t = super::device::Activations::F16)]
    activations: super::device::Activations,
    /// What prompt passes of 512 tokens or more multiply in (the TTFT): f16, or W8A8 (int8 or
    /// fp8: dense and SlideSparse matrices also kept in 8 bits, each token's input quantized);
    /// f16-resident keeps the f16 copy every prompt pass of a sparse or low-bit matrix
    /// multiplies, decoded once at upload instead of once per pass (2 more bytes a weight).
    #[arg(long, value_enum, default_value_t = super::device::PromptPrecision::F16)]
    prompt_precision: super::device::PromptPrecision,
    /// How the decode step runs: graph (a CUDA graph of the plan's kernels), persistent (one
    /// kernel for the whole step: dense f16 and Tiled-CBC models with the f16 cache;
    /// Balanced-CBC with SIEVE_PERSISTENT_BCBC=1), or persistent,graph (both measured on the
    /// same model).
    #[arg(long, value_delimiter = ',', default_value = "graph")]
    step: Vec<String>,
    /// Also time the graph step leaving out each op of every layer in turn (and the head):
    /// what each costs inside the step, overlap with its neighbours included.
    #[arg(long)]
    leave_out: bool,
    /// Write each persistent result's traced step as an SVG timeline (a row per SM) here;
    /// with several persistent results, the second goes to NAME-2.svg and so on.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Split the model over this many GPUs of the machine (tensor parallelism over NCCL: q|k|v
    /// and gate|up by rows, o and down by columns, an all-reduce after each); prints the ranks'
    /// memory and the all-reduce time per step. Synthetic models take --dp 0 only.
    #[arg(long)]
    tensor_parallel: Option<usize>,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn print_tensor_parallel_row(r: &bench::TensorParallelResult) {
    let gb = |v: &[usize]| {
        v.iter()
            .map(|b| format!("{:.2}", *b as f64 / 1e9))
            .collect::<Vec<_>>()
            .join("/")
    };
    let all_reduce = match r.all_reduce_us_per_step {
        Some(us) => format!(
            "{us:.0} us a step ({:.1}% of TPOT)",
            us / 10.0 / r.tpot_ms_median
        ),
        None => "none (one rank)".into(),
    };
    println!(
        "{:<11} sp {:<4} dp {:<4} {:<15} {:<8} TP {} ranks TPOT {:>7.3} ms (p10 {:.3}, p90 {:.3}) {:>7.1} tok/s | TTFT {:>8.2} ms | all-reduces {all_reduce} | per rank: weights {} GB, KV cache {} GB, sends {:.1} KB/token | setup {:.0} s",
        r.model,
        r.sp,
        r.dp,
        r.format,
        r.values,
        r.world,
        r.tpot_ms_median,
        r.tpot_ms_p10,
        r.tpot_ms_p90,
        1e3 / r.tpot_ms_median,
        r.ttft_ms,
        gb(&r.rank_weight_bytes),
        gb(&r.rank_kv_bytes),
        r.bytes_sent_per_rank as f64 / 1e3,
        r.setup_s,
    );
}

/// `--tensor-parallel N`: the model split over N GPUs, measured by [`bench::measure_tensor_parallel`].
fn run_tensor_parallel(
    a: &DecodeArgs,
    world: usize,
    opts: &DecodeBenchOptions,
    files: &mut ReportFiles,
) -> Result<()> {
    if !a.batch.is_empty()
        || a.leave_out
        || a.trace.is_some()
        || a.step.iter().any(|s| s != "graph")
    {
        bail!("--tensor-parallel measures the graph step alone: no --batch, --leave-out, --trace or --step persistent");
    }
    if a.plot.is_some() {
        bail!("--tensor-parallel writes --json only (no --plot)");
    }
    let kv = a.kv_cache.precision();
    let results = match (&a.synthetic, &a.model) {
        (Some(name), _) => {
            let configs: Vec<(f64, f64)> = a.sp.iter().copied().zip(a.dp.iter().copied()).collect();
            bench::run_synthetic_tensor_parallel(
                name,
                &configs,
                opts,
                kv,
                world,
                print_tensor_parallel_row,
            )?
        }
        (None, Some(path)) => {
            let (mut model, _tok) =
                sieve_model::packed::load_model_and_tokenizer_with(path, a.f16_weights)
                    .with_context(|| format!("opening {}", path.display()))?;
            model.set_kv_precision(kv);
            opts.check_context(
                model.config().max_position_embeddings,
                &path.display().to_string(),
            )?;
            let t = std::time::Instant::now();
            let layouts = sieve_gpu::matrix::Layouts {
                prompt8: opts.prompt8,
                prompt16: opts.prompt16,
                ..Default::default()
            };
            let mut tp = sieve_gpu::tensor_parallel::TensorParallelGpu::new(
                &model,
                world,
                opts.positions_needed(),
                kv,
                layouts,
            )?;
            drop(model);
            let label = path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            let o = DecodeBenchOptions {
                format: FormatKind::Dense,
                ..opts.clone()
            };
            let setup_s = t.elapsed().as_secs_f64();
            let r = bench::measure_tensor_parallel(
                &mut tp,
                &label,
                0.0,
                0.0,
                "as packed",
                setup_s,
                &o,
            )?;
            print_tensor_parallel_row(&r);
            vec![r]
        }
        (None, None) => bail!("give --synthetic NAME or --model PATH"),
    };
    files.write_json(|| Ok(serde_json::to_string_pretty(&results)?))?;
    Ok(())
}

/// `--prefetch` values: off (0 bytes), on (the runner's default: `None`), or megabytes.
fn parse_prefetch(s: &str) -> Result<Option<usize>> {
    match s {
        "off" => Ok(Some(0)),
        "on" => Ok(None),
        mb => match mb.parse::<f64>() {
            Ok(v) if v.is_finite() && (0.0..=65536.0).contains(&v) => {
                Ok(Some((v * 1e6).round() as usize))
            }
            _ => bail!("--prefetch {mb}: expected off, on or a size in MB (0 to 65536)"),
        },
    }
}

fn print_row(r: &DecodeResult) {
    let ctx = if r.context > 0 {
        format!(" | @{}: {:.3} ms", r.context, r.tpot_ms_at_context)
    } else {
        String::new()
    };
    println!(
        "{:<11} sp {:<4} dp {:<4} {:<15} {:<8} kv {:<4} {:<10} PDL {:<3} L2 ahead {:>4.0} MB TPOT {:>7.3} ms (p10 {:.3}, p90 {:.3}) {:>7.1} tok/s | TTFT {:>8.2} ms | {:>6.2} GB/token {:>7.0} GB/s ({:>4.1}% of copy) | graph step {:.0} us: products alone {:.0}, all but products {:.0}, all but attention {:.0} | eager split linear {:>4.1}% attention {:>4.1}% other {:>4.1}% | {} launches | setup {:.0} s{ctx}",
        r.model,
        r.sp,
        r.dp,
        r.format,
        r.values,
        r.kv_cache,
        r.step.name(),
        if r.pdl { "on" } else { "off" },
        r.l2_prefetch_bytes as f64 / 1e6,
        r.tpot_ms_median,
        r.tpot_ms_p10,
        r.tpot_ms_p90,
        r.tokens_per_s,
        r.ttft_ms,
        r.weight_bytes_per_token as f64 / 1e9,
        r.bandwidth_gbs,
        r.pct_of_copy,
        r.graph_step_us,
        r.graph_linear_only_us,
        r.graph_no_linear_us,
        r.graph_no_attention_us,
        100.0 * r.share_linear,
        100.0 * r.share_attention,
        100.0 * r.share_other,
        r.launches_per_step,
        r.setup_s
    );
    if let Some(note) = &r.step_note {
        println!("{:<11}   {note}", r.model);
    }
    for line in left_out_table(r.graph_step_us, &r.left_out) {
        println!("{:<11}   {line}", r.model);
    }
    if let Some(t) = &r.persistent_trace {
        for line in trace_table(t, r.copy_bandwidth_gbs) {
            println!("{:<11}   {line}", r.model);
        }
    }
    if let Some(p) = &r.prefill_profile {
        let parts: Vec<String> = p
            .by_op
            .iter()
            .map(|(kind, us)| format!("{kind} {:.0}", us))
            .collect();
        println!(
            "{:<11}   prefill of {} tokens on the GPU {:.0} us: {}; last row's logits and sampling {:.0}",
            r.model,
            p.batched_tokens,
            p.total_us(),
            parts.join(", "),
            p.head_us
        );
    }
    for b in &r.batched {
        println!(
            "{:<11}   batch {:>3} ({}): step {:>8.3} ms (p10 {:.3}, p90 {:.3}), {:>9.1} tok/s over all sequences",
            r.model,
            b.batch,
            if b.one_pass { "one pass" } else { "per sequence" },
            b.step_ms_median,
            b.step_ms_p10,
            b.step_ms_p90,
            b.tokens_per_s
        );
    }
}

/// The leave-one-out breakdown (`--leave-out`) as a table: per op, the graph step without it,
/// what leaving it out saved, and that per place it runs (per layer).
fn left_out_table(step_us: f64, left_out: &[LeftOut]) -> Vec<String> {
    if left_out.is_empty() {
        return vec![];
    }
    let mut lines = vec![
        format!("graph step {step_us:.1} us, each op left out of it in turn:"),
        format!(
            "  {:<20} {:>10} {:>10} {:>10}",
            "op left out", "step us", "saved us", "each us"
        ),
    ];
    let mut saved_total = 0.0;
    for l in left_out {
        let saved = step_us - l.step_us;
        saved_total += saved;
        lines.push(format!(
            "  {:<20} {:>10.1} {:>10.1} {:>10.2}",
            l.op,
            l.step_us,
            saved,
            saved / l.count.max(1) as f64
        ));
    }
    lines.push(format!(
        "  the savings add up to {saved_total:.1} us of the step's {step_us:.1}"
    ));
    lines
}

/// The traced persistent step as one table: per stage class its work (the slowest block's,
/// summed over the class's stages), the bytes it reads and their rate against the copy
/// bandwidth; then what the step costs beyond its bytes, and how idle the SMs' blocks are.
fn trace_table(t: &TraceSummary, copy_gbs: f64) -> Vec<String> {
    let idle = &t.idle_per_block;
    let idle_line = format!(
        "idle per block (one per SM): min {:.1} us, median {:.1}, max {:.1} (block {}); mean {:.0}% of the step",
        idle.min_us,
        idle.median_us,
        idle.max_us,
        idle.worst_block,
        100.0 * t.idle_fraction
    );
    let Some(c) = t.against_copy(copy_gbs) else {
        let work: Vec<String> = t
            .work_us
            .iter()
            .map(|(kind, us)| format!("{kind} {us:.0}"))
            .collect();
        return vec![
            format!(
                "persistent step traced: {:.0} us; stage work (slowest block, summed) {}; barriers {:.0} us; no copy bandwidth to set the bytes against",
                t.step_us,
                work.join(", "),
                t.barrier_us
            ),
            idle_line,
        ];
    };
    let row = |class: &str, k: &ClassBandwidth| {
        format!(
            "  {class:<22} {:>9.1} {:>10.3} {:>8.0} {:>7.1}%",
            k.us,
            k.bytes as f64 / 1e6,
            k.gbs,
            100.0 * k.of_copy
        )
    };
    let mut lines = vec![
        format!(
            "persistent step traced at {} positions, copy bandwidth {:.0} GB/s:",
            t.positions, copy_gbs
        ),
        format!(
            "  {:<22} {:>9} {:>10} {:>8} {:>8}",
            "class", "work us", "MB read", "GB/s", "of copy"
        ),
    ];
    lines.extend(c.classes.iter().map(|k| row(k.class, k)));
    lines.push(row(
        &format!("step (barriers {:.0} us)", t.barrier_us),
        &c.step,
    ));
    lines.push(format!(
        "fixed cost {:.1} us: the step's {:.1} us minus its {:.3} MB at copy bandwidth ({:.1} us)",
        c.fixed_cost_us,
        t.step_us,
        c.step.bytes as f64 / 1e6,
        c.byte_floor_us
    ));
    lines.push(idle_line);
    lines
}

pub fn run(a: DecodeArgs) -> Result<()> {
    if a.sp.len() != a.dp.len() {
        bail!(
            "--sp has {} values and --dp {}: they pair up one to one",
            a.sp.len(),
            a.dp.len()
        );
    }
    for &v in a.sp.iter().chain(&a.dp) {
        if !(0.0..1.0).contains(&v) {
            bail!("sparsity {v} is outside [0, 1)");
        }
    }
    if a.tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    if let Some(&b) = a
        .batch
        .iter()
        .find(|&&b| b == 0 || b > sieve_gpu::runner::MAX_BATCH_SLOTS)
    {
        bail!(
            "--batch {b}: batch sizes go from 1 to {}",
            sieve_gpu::runner::MAX_BATCH_SLOTS
        );
    }
    let format = FormatKind::from_name(&a.format)?;
    let pattern: Pattern = a.pattern.parse()?;
    let inputs: Vec<&std::path::Path> = a.model.iter().map(|p| p.as_path()).collect();
    if let (Some(t), Some(m)) = (&a.trace, &a.model) {
        if t == m || (t.exists() && t.canonicalize().ok() == m.canonicalize().ok()) {
            bail!(
                "--trace {} names the model: it would be overwritten",
                t.display()
            );
        }
    }
    let mut files = ReportFiles::open(a.json.as_deref(), a.plot.as_deref(), &inputs)?;
    let opts = DecodeBenchOptions {
        prompt: a.prompt.max(1),
        tokens: a.tokens,
        context: a.context,
        format,
        pattern,
        values: a
            .values
            .iter()
            .map(|v| v.parse())
            .collect::<std::result::Result<_, _>>()?,
        seed: a.seed,
        tcbc_kernels: a
            .tcbc_kernel
            .iter()
            .map(|k| match k.as_str() {
                "lane8" => Ok(TcbcKernel::Lane8),
                "rr" => Ok(TcbcKernel::RoundRobin),
                other => bail!("--tcbc-kernel {other}: expected lane8 or rr"),
            })
            .collect::<Result<_>>()?,
        pdl: a
            .pdl
            .iter()
            .map(|p| match p.as_str() {
                "on" => Ok(true),
                "off" => Ok(false),
                other => bail!("--pdl {other}: expected on or off"),
            })
            .collect::<Result<_>>()?,
        prefetch: a
            .prefetch
            .iter()
            .map(|p| parse_prefetch(p))
            .collect::<Result<_>>()?,
        batches: a.batch.clone(),
        int8_activations: a.activations.int8(),
        prompt8: a.prompt_precision.eight_bit(),
        prompt16: a.prompt_precision.resident_f16(),
        leave_out: a.leave_out,
        steps: a
            .step
            .iter()
            .map(|s| match s.as_str() {
                "graph" => Ok(StepMode::Graph),
                "persistent" => Ok(StepMode::Persistent),
                other => bail!("--step {other}: expected graph or persistent"),
            })
            .collect::<Result<_>>()?,
    };
    if let Some(world) = a.tensor_parallel {
        return run_tensor_parallel(&a, world, &opts, &mut files);
    }
    let results = match (&a.synthetic, &a.model) {
        (Some(name), _) => {
            let configs: Vec<(f64, f64)> = a.sp.iter().copied().zip(a.dp.iter().copied()).collect();
            bench::run_synthetic_with(name, &configs, &opts, a.kv_cache.precision(), print_row)?
        }
        (None, Some(path)) => {
            let (mut model, _tok) =
                sieve_model::packed::load_model_and_tokenizer_with(path, a.f16_weights)
                    .with_context(|| format!("opening {}", path.display()))?;
            model.set_kv_precision(a.kv_cache.precision());
            let context = model.config().max_position_embeddings;
            opts.check_context(context, &path.display().to_string())?;
            let capacity = opts.positions_needed();
            let gpu = sieve_cuda::Gpu::new(0).context("bench decode needs a GPU")?;
            let copy = sieve_cuda::timing::copy_bandwidth_gbs(&gpu, 1 << 30, 20)?;
            let t = std::time::Instant::now();
            // Batched steps measured: the layouts a server keeps.
            let layouts = sieve_gpu::matrix::Layouts {
                batch: opts.batches.iter().any(|&b| b > 1),
                int8_activations: opts.int8_activations,
                prompt8: opts.prompt8,
                prompt16: opts.prompt16,
                ..Default::default()
            };
            let mut m = super::device::upload_with(gpu, &model, capacity, layouts)?;
            drop(model);
            super::device::print_report(&m);
            let label = path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            let o = DecodeBenchOptions {
                format: FormatKind::Dense,
                ..opts.clone()
            };
            let setup_s = t.elapsed().as_secs_f64();
            let mut out = Vec::new();
            bench::measure_steps(&mut m, &label, 0.0, 0.0, setup_s, &o, copy, |r| {
                print_row(&r);
                out.push(r);
            })?;
            out
        }
        (None, None) => bail!("give --synthetic NAME or --model PATH"),
    };
    if let Some(path) = &a.trace {
        let svgs: Vec<&String> = results
            .iter()
            .filter_map(|r| r.trace_svg.as_ref())
            .collect();
        if svgs.is_empty() {
            eprintln!("--trace: no persistent step was measured, nothing written");
        }
        for (i, svg) in svgs.iter().enumerate() {
            let file = if i == 0 {
                path.clone()
            } else {
                let stem = path.file_stem().unwrap_or_default().to_string_lossy();
                path.with_file_name(format!("{stem}-{}.svg", i + 1))
            };
            std::fs::write(&file, svg).with_context(|| format!("writing {}", file.display()))?;
            println!("trace: {}", file.display());
        }
    }
    files.write_json(|| Ok(serde_json::to_string_pretty(&results)?))?;
    files.write_plot(|| Ok(bench::plot_svg(&results)))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sieve_cuda::persistent::IdleSpread;

    fn traced() -> TraceSummary {
        TraceSummary {
            step_us: 6.0,
            work_us: vec![("norm+qkv+rope", 2.0), ("norm+head", 3.0)],
            barrier_us: 1.0,
            idle_fraction: 0.25,
            idle_per_block: IdleSpread {
                min_us: 1.0,
                median_us: 1.5,
                max_us: 2.0,
                worst_block: 3,
            },
            positions: 129,
            read_bytes: vec![("norm+qkv+rope", 4_000_000), ("norm+head", 6_000_000)],
        }
    }

    #[test]
    fn the_trace_table_sets_each_class_against_the_copy_bandwidth() {
        let lines = trace_table(&traced(), 4000.0);
        let text = lines.join("\n");
        assert_eq!(lines.len(), 7, "{text}");
        assert!(
            lines[0].contains("129 positions, copy bandwidth 4000 GB/s"),
            "{text}"
        );
        // 4 MB in 2 us: 2000 GB/s, half the copy bandwidth.
        assert!(lines[2].starts_with("  norm+qkv+rope"), "{text}");
        assert!(
            lines[2].ends_with("2.0      4.000     2000    50.0%"),
            "{text}"
        );
        // 10 MB over the 6 us step, of which 2.5 us at 4000 GB/s.
        assert!(lines[4].contains("step (barriers 1 us)"), "{text}");
        assert!(
            lines[4].ends_with("6.0     10.000     1667    41.7%"),
            "{text}"
        );
        assert!(lines[5].starts_with("fixed cost 3.5 us:"), "{text}");
        assert!(lines[6].contains("max 2.0 (block 3); mean 25%"), "{text}");
    }

    #[test]
    fn prefetch_settings_parse_and_bad_ones_are_named() {
        assert_eq!(parse_prefetch("off").unwrap(), Some(0));
        assert_eq!(parse_prefetch("on").unwrap(), None);
        assert_eq!(parse_prefetch("16").unwrap(), Some(16_000_000));
        assert_eq!(parse_prefetch("0.5").unwrap(), Some(500_000));
        for bad in ["-1", "NaN", "inf", "lots", "", "70000"] {
            let e = parse_prefetch(bad).unwrap_err().to_string();
            assert!(e.contains("--prefetch"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_leave_out_table_shows_each_ops_saving_per_place() {
        assert!(left_out_table(100.0, &[]).is_empty());
        let rows = [
            LeftOut {
                op: "attention".into(),
                step_us: 80.0,
                count: 32,
            },
            LeftOut {
                op: "final norm + head".into(),
                step_us: 96.0,
                count: 1,
            },
        ];
        let lines = left_out_table(100.0, &rows);
        let text = lines.join("\n");
        assert_eq!(lines.len(), 5, "{text}");
        assert!(lines[0].starts_with("graph step 100.0 us"), "{text}");
        // 20 us saved over 32 layers: 0.625 us each.
        assert!(lines[2].starts_with("  attention"), "{text}");
        assert!(lines[2].ends_with("80.0       20.0       0.62"), "{text}");
        assert!(lines[3].ends_with("96.0        4.0       4.00"), "{text}");
        assert!(
            lines[4].contains("add up to 24.0 us of the step's 100.0"),
            "{text}"
        );
    }

    #[test]
    fn without_a_copy_bandwidth_the_trace_is_work_and_idle_only() {
        let lines = trace_table(&traced(), 0.0);
        assert_eq!(lines.len(), 2);
        assert!(lines[0].contains("no copy bandwidth"), "{}", lines[0]);
    }
}
