//! `sieve bench decode`: the decode speed of whole models on the GPU, dense and sparse
//! configurations in one process. Per configuration: TTFT of a random prompt, TPOT over the
//! generated tokens (host wall time per token, the graph replay plus the read of the token id:
//! what a user waits for), weight bytes read per token and the bandwidth they imply against
//! the copy bandwidth measured in the same run, and the step's split between linear layers,
//! attention and the rest from an event-bracketed eager step.

use crate::error::{GpuError, Result};
use crate::runner::{GpuModel, StepMode, StepPart, StepProfile};
use crate::synthetic::{self, SyntheticOptions, SyntheticValues};
use serde::Serialize;
use sieve_cuda::tiled_cbc::TcbcKernel;
use sieve_cuda::{Gpu, KvPrecision};
use sieve_formats::random::Pattern;
use sieve_formats::FormatKind;
use std::time::Instant;

/// Prefills of the prompt the reported TTFT is the median of.
const TTFT_RUNS: usize = 5;

#[derive(Clone, Debug)]
pub struct DecodeBenchOptions {
    pub prompt: usize,
    pub tokens: usize,
    /// Decode position for the long-context measurement (0: none).
    pub context: usize,
    pub format: FormatKind,
    pub pattern: Pattern,
    /// What the synthetic models' kept weights are stored as, one model each (empty: f16).
    pub values: Vec<SyntheticValues>,
    pub seed: u64,
    /// Tiled-CBC kernels to measure on each sparse Tiled-CBC model, one result each (the
    /// model is built once).
    pub tcbc_kernels: Vec<TcbcKernel>,
    /// Programmatic dependent launch settings to measure (each a result on the same model).
    pub pdl: Vec<bool>,
    /// L2 prefetch settings of the graph step to measure, each a result on the same model
    /// (bytes of each product's weights asked for ahead of it, `GpuModel::set_l2_prefetch`;
    /// `None` is `GpuModel::default_l2_prefetch`); empty: the runner's default.
    pub prefetch: Vec<Option<usize>>,
    /// Sequences decoded together, one measurement each (the serving path's greedy batched
    /// step, [`GpuModel::step_slots_argmax`]); empty: none.
    pub batches: Vec<usize>,
    /// How the decode step runs, one result each (empty: the graph step). A model the
    /// persistent step cannot run is measured with the graph step only, the result saying why.
    pub steps: Vec<StepMode>,
    /// 4-bit matrices multiply INT8 activations (W4A8) where they have the kernels.
    pub int8_activations: bool,
    /// Prompt passes of 512 tokens or more multiply 8-bit copies (W8A8,
    /// [`crate::matrix::Layouts::prompt8`]).
    pub prompt8: Option<sieve_cuda::cusparselt::LtPrecision>,
    /// Keep the prompt passes' f16 copies resident ([`crate::matrix::Layouts::prompt16`]).
    pub prompt16: bool,
    /// Also time the graph step leaving out each op of every layer in turn, and the head
    /// ([`DecodeResult::left_out`]).
    pub leave_out: bool,
}

impl DecodeBenchOptions {
    /// KV-cache positions a measurement uses: the prompt and the timed tokens, or the
    /// long-context position, with a margin.
    pub fn positions_needed(&self) -> usize {
        (self.prompt + self.tokens).max(self.context + 64) + 16
    }

    /// Refuses, before any GPU work, a run that needs more positions than `context`, the
    /// context of `model`.
    pub fn check_context(&self, context: usize, model: &str) -> Result<()> {
        let needed = self.positions_needed();
        if needed > context {
            return Err(GpuError::InvalidArgument(format!(
                "a prompt of {} + {} tokens (or the position {}) need {needed} positions; {model} \
                 has a context of {context}",
                self.prompt, self.tokens, self.context
            )));
        }
        Ok(())
    }
}

/// One configuration's numbers.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeResult {
    pub model: String,
    pub sp: f64,
    pub dp: f64,
    pub format: String,
    /// What the kept weights are stored as (f16, int8, int4:G, q4_0, ...).
    pub values: String,
    /// How the KV cache stores keys and values (f16, int8).
    pub kv_cache: String,
    pub kernels: Vec<String>,
    pub setup_s: f64,
    pub ttft_ms: f64,
    /// The TTFT's batched prefill by kind of work (prompts of one chunk).
    pub prefill_profile: Option<crate::runner::PrefillProfile>,
    pub tpot_ms_median: f64,
    pub tpot_ms_p10: f64,
    pub tpot_ms_p90: f64,
    pub tokens_per_s: f64,
    /// TPOT when decoding at position `context` (0 when not measured).
    pub context: usize,
    pub tpot_ms_at_context: f64,
    pub weight_bytes_per_token: usize,
    pub bandwidth_gbs: f64,
    pub copy_bandwidth_gbs: f64,
    pub pct_of_copy: f64,
    pub launches_per_step: usize,
    /// Programmatic dependent launch between the step's kernels.
    pub pdl: bool,
    /// Bytes of each product's weights asked of L2 ahead of it (0: none).
    pub l2_prefetch_bytes: usize,
    /// How the step ran (graph, persistent), and why not persistent when that was asked for
    /// and the model cannot.
    pub step: StepMode,
    pub step_note: Option<String>,
    /// The persistent step's stamped stages (one traced step after the timed ones).
    pub persistent_trace: Option<sieve_cuda::persistent::TraceSummary>,
    /// The same step as an SVG timeline (written by the CLI's `--trace`).
    #[serde(skip)]
    pub trace_svg: Option<String>,
    pub breakdown: StepProfile,
    /// Graph replays of parts of the step (µs per step): everything, the products alone,
    /// everything but the products, everything but attention.
    pub graph_step_us: f64,
    pub graph_linear_only_us: f64,
    pub graph_no_linear_us: f64,
    pub graph_no_attention_us: f64,
    /// With `leave_out`: the graph step without each op of every layer in turn (in the
    /// plan's order), then without the final norm and the LM head; empty otherwise.
    pub left_out: Vec<LeftOut>,
    /// Share of the eager step: linear, attention, other.
    pub share_linear: f64,
    pub share_attention: f64,
    pub share_other: f64,
    /// The batched decode step at each size of `--batch`.
    pub batched: Vec<BatchPoint>,
}

/// One row of the leave-one-out breakdown: the graph step's time (µs, replays of the same
/// graph as [`DecodeResult::graph_step_us`] less `op`'s launches), and in how many places of
/// the step `op` ran (the layers, or 1 for the head). The data the kept kernels read stays what
/// the last whole step left, so a TEAL product still sees a realistic input.
#[derive(Clone, Debug, Serialize)]
pub struct LeftOut {
    pub op: String,
    pub step_us: f64,
    pub count: usize,
}

/// One batch size of the serving path's decode step: `batch` sequences, each at its own
/// position after its own prompt, stepped together; the time is host wall time of the call
/// (the pass, the greedy choice on the device and one token id per sequence copied to the host,
/// as the server's greedy requests run it).
#[derive(Clone, Debug, Serialize)]
pub struct BatchPoint {
    pub batch: usize,
    /// One pass for the whole batch (false: the format has no token-batch path, so the step
    /// replays each sequence's single-sequence graph).
    pub one_pass: bool,
    pub step_ms_median: f64,
    pub step_ms_p10: f64,
    pub step_ms_p90: f64,
    /// Generated tokens per second over all sequences (`batch` / median step).
    pub tokens_per_s: f64,
}

/// What the weights are stored as, read from the q|k|v kernel's label (`q|k|v: lowbit/q4_0`,
/// `q|k|v: balanced-cbc/int8`).
fn values_of(label: Option<&str>) -> String {
    let kernel = label.and_then(|l| l.split(": ").nth(1)).unwrap_or("");
    if let Some(kind) = kernel.strip_prefix("lowbit/") {
        return kind.to_string();
    }
    for bits in ["int8", "int4"] {
        if kernel.ends_with(bits) {
            return bits.to_string();
        }
    }
    "f16".to_string()
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// The PDL settings to measure: as asked, or the runner's default (on).
pub fn pdl_settings(opts: &DecodeBenchOptions) -> &[bool] {
    if opts.pdl.is_empty() {
        &[true]
    } else {
        &opts.pdl
    }
}

/// The step modes to measure: as asked, or the graph step.
pub fn step_settings(opts: &DecodeBenchOptions) -> &[StepMode] {
    if opts.steps.is_empty() {
        &[StepMode::Graph]
    } else {
        &opts.steps
    }
}

/// Measures `model` once per step mode of `opts` (and PDL setting, for the graph step),
/// handing each result to `on_result`. A model the persistent step cannot run gets the reason
/// in its graph result, or an error when persistent was the only mode asked for.
pub fn measure_steps(
    model: &mut GpuModel,
    label: &str,
    sp: f64,
    dp: f64,
    setup_s: f64,
    opts: &DecodeBenchOptions,
    copy_gbs: f64,
    mut on_result: impl FnMut(DecodeResult),
) -> Result<()> {
    let modes = step_settings(opts);
    let why_not = model.persistent_unsupported();
    if let (Some(why), [StepMode::Persistent]) = (&why_not, modes) {
        return Err(GpuError::Unsupported(format!(
            "the persistent step cannot run {label}: {why}"
        )));
    }
    for &mode in modes {
        if mode == StepMode::Persistent && why_not.is_some() {
            continue;
        }
        model.set_step_mode(mode)?;
        let pdls: &[bool] = if mode == StepMode::Graph {
            pdl_settings(opts)
        } else {
            &[true]
        };
        let default_prefetch = [Some(model.l2_prefetch())];
        let prefetches: &[Option<usize>] = if mode == StepMode::Graph && !opts.prefetch.is_empty() {
            &opts.prefetch
        } else {
            &default_prefetch
        };
        let initial_prefetch = model.l2_prefetch();
        for &pdl in pdls {
            model.set_pdl(pdl);
            for &prefetch in prefetches {
                model.set_l2_prefetch(prefetch.unwrap_or_else(|| model.default_l2_prefetch()));
                let mut r = measure(model, label, sp, dp, setup_s, opts, copy_gbs)?;
                if modes.contains(&StepMode::Persistent) {
                    r.step_note = why_not.as_ref().map(|w| format!("not persistent: {w}"));
                }
                on_result(r);
            }
        }
        model.set_l2_prefetch(initial_prefetch);
    }
    model.set_step_mode(StepMode::Graph)
}

/// Times `tokens` decode steps (one host read per token) and returns the per-token seconds.
fn time_decode(model: &mut GpuModel, tokens: usize) -> Result<Vec<f64>> {
    let mut steps = Vec::with_capacity(tokens);
    for _ in 0..tokens {
        let t = Instant::now();
        model.next_token()?;
        steps.push(t.elapsed().as_secs_f64());
    }
    Ok(steps)
}

/// Measures an uploaded model (see the module header). `label`/`sp`/`dp` are for the table.
pub fn measure(
    model: &mut GpuModel,
    label: &str,
    sp: f64,
    dp: f64,
    setup_s: f64,
    opts: &DecodeBenchOptions,
    copy_gbs: f64,
) -> Result<DecodeResult> {
    let vocab = model.config().vocab_size as u64;
    let prompt: Vec<u32> = (0..opts.prompt.max(1) as u64)
        .map(|i| ((i * 7919 + opts.seed * 104_729 + 13) % vocab) as u32)
        .collect();
    if prompt.len() + opts.tokens + 2 > model.capacity()
        || opts.context + opts.tokens.min(64) + 2 > model.capacity()
    {
        return Err(GpuError::InvalidArgument(format!(
            "prompt {} + tokens {} (or context {}) exceed the KV cache of {}",
            prompt.len(),
            opts.tokens,
            opts.context,
            model.capacity()
        )));
    }
    // Warm-up with the prompt itself: compiles kernels, captures both graphs, and lets cuBLAS
    // load the GEMM kernels of this prompt length (lazily loaded on first use: a cold first
    // prefill measured 21 ms where the GPU worked 8.3, H100, 2026-12-05).
    model.prefill(&prompt)?;
    model.next_token()?;

    // The median of a few prefills of the same prompt (as llama-bench repeats its -p run).
    let mut ttfts = Vec::with_capacity(TTFT_RUNS);
    for _ in 0..TTFT_RUNS {
        let started = Instant::now();
        model.prefill(&prompt)?;
        ttfts.push(started.elapsed().as_secs_f64() * 1e3);
    }
    ttfts.sort_by(f64::total_cmp);
    let ttft_ms = ttfts[TTFT_RUNS / 2];
    // Where the TTFT goes, for a prompt that fits one batched chunk.
    let prefill_profile = if (2..=model.prefill_chunk_tokens()).contains(&prompt.len())
        && model.prefill_is_batched()
    {
        Some(model.profile_prefill(&prompt)?)
    } else {
        None
    };
    let mut steps = time_decode(model, opts.tokens)?;
    steps.sort_by(f64::total_cmp);
    let total: f64 = steps.iter().sum();

    // Breakdown and bytes: median of a few eager profiled steps after the prompt.
    model.prefill(&prompt)?;
    let mut profiles: Vec<StepProfile> = (0..5)
        .map(|_| model.profile_step())
        .collect::<Result<_>>()?;
    profiles.sort_by(|a, b| a.total_us().total_cmp(&b.total_us()));
    let breakdown = profiles[profiles.len() / 2].clone();

    // Graph-mode split: replays of the step with parts left out (teacher-forced from the prompt).
    let reps = 32usize
        .min(model.capacity().saturating_sub(prompt.len() + 8) / 5)
        .max(1);
    let mut part_us = [0.0f64; 4];
    for (i, part) in [
        StepPart::All,
        StepPart::LinearOnly,
        StepPart::NoLinear,
        StepPart::NoAttention,
    ]
    .into_iter()
    .enumerate()
    {
        model.prefill(&prompt)?;
        part_us[i] = model.time_step_part(part, reps)?;
    }
    let mut left_out = Vec::new();
    if opts.leave_out {
        let layers = model.config().num_layers;
        let parts = sieve_model::plan::LAYER
            .into_iter()
            .map(|op| (StepPart::Without(op), op.name(), layers))
            .chain([(StepPart::WithoutHead, "final norm + head", 1)]);
        for (part, op, count) in parts {
            model.prefill(&prompt)?;
            left_out.push(LeftOut {
                op: op.to_string(),
                step_us: model.time_step_part(part, reps)?,
                count,
            });
        }
    }

    let mut tpot_ctx = 0.0;
    if opts.context > 0 {
        let n = opts.tokens.clamp(8, 64);
        model.seek(opts.context, prompt[0])?;
        let mut s = time_decode(model, n)?;
        s.sort_by(f64::total_cmp);
        tpot_ctx = percentile(&s, 0.5) * 1e3;
    }
    // One traced persistent step after the prompt: where its time goes.
    let (persistent_trace, trace_svg) = if model.step_mode() == StepMode::Persistent {
        model.set_persistent_trace(true);
        model.prefill(&prompt)?;
        model.next_token()?;
        let trace = model.last_trace()?;
        model.set_persistent_trace(false);
        match trace {
            Some(t) => (Some(t.summary()), Some(t.svg())),
            None => (None, None),
        }
    } else {
        (None, None)
    };
    let tpot = percentile(&steps, 0.5);
    let bw = breakdown.weight_bytes as f64 / tpot / 1e9;
    let t = breakdown.total_us().max(1e-9);
    Ok(DecodeResult {
        model: label.to_string(),
        sp,
        dp,
        kv_cache: model.kv_precision().name().to_string(),
        // Tiled-CBC: the format with its kernel (lane8 or rr), SlideSparse with its pattern
        // (slide/6:8), from the q|k|v product's label.
        format: match model.report().kernels.first() {
            Some(k) if matches!(opts.format, FormatKind::TiledCbc | FormatKind::Slide) => k
                .split(": ")
                .nth(1)
                .unwrap_or(opts.format.name())
                .to_string(),
            _ => opts.format.name().to_string(),
        },
        values: values_of(model.report().kernels.first().map(String::as_str)),
        kernels: model.report().kernels.clone(),
        setup_s,
        ttft_ms,
        prefill_profile,
        tpot_ms_median: tpot * 1e3,
        tpot_ms_p10: percentile(&steps, 0.1) * 1e3,
        tpot_ms_p90: percentile(&steps, 0.9) * 1e3,
        tokens_per_s: steps.len() as f64 / total.max(1e-12),
        context: opts.context,
        tpot_ms_at_context: tpot_ctx,
        weight_bytes_per_token: breakdown.weight_bytes,
        bandwidth_gbs: bw,
        copy_bandwidth_gbs: copy_gbs,
        pct_of_copy: 100.0 * bw / copy_gbs,
        launches_per_step: model.report().launches_per_step,
        pdl: model.pdl(),
        l2_prefetch_bytes: if model.step_mode() == StepMode::Graph {
            model.l2_prefetch()
        } else {
            0
        },
        step: model.step_mode(),
        step_note: None,
        persistent_trace,
        trace_svg,
        graph_step_us: part_us[0],
        graph_linear_only_us: part_us[1],
        graph_no_linear_us: part_us[2],
        graph_no_attention_us: part_us[3],
        left_out,
        share_linear: breakdown.linear_us / t,
        share_attention: breakdown.attention_us / t,
        share_other: breakdown.other_us / t,
        breakdown,
        batched: measure_batches(model, &prompt, opts)?,
    })
}

/// The serving path's step at every size of `opts.batches` (see [`BatchPoint`]): the model's
/// KV cache becomes a pool of the largest size's slots, each slot gets a distinct prompt of
/// `opts.prompt` tokens, then `min(tokens, 128)` steps of the batch are timed, each fed its
/// sequences' greedy tokens (chosen on the host outside the timed call).
fn measure_batches(
    model: &mut GpuModel,
    prompt: &[u32],
    opts: &DecodeBenchOptions,
) -> Result<Vec<BatchPoint>> {
    let Some(&most) = opts.batches.iter().max() else {
        return Ok(Vec::new());
    };
    let steps = opts.tokens.clamp(1, 128);
    // The prompt, one untimed step and the timed ones.
    if prompt.len() + steps + 1 > model.capacity() {
        return Err(GpuError::InvalidArgument(format!(
            "batched steps need {} positions per slot; the cache holds {}",
            prompt.len() + steps + 1,
            model.capacity()
        )));
    }
    model.set_slots(most)?;
    let points = time_batches(model, prompt, opts, steps);
    // Back to one sequence, as the model was (also after a failure).
    let restored = model.set_slots(1);
    let points = points?;
    restored?;
    Ok(points)
}

/// The timing loop of [`measure_batches`] on a pool of enough slots.
fn time_batches(
    model: &mut GpuModel,
    prompt: &[u32],
    opts: &DecodeBenchOptions,
    steps: usize,
) -> Result<Vec<BatchPoint>> {
    let vocab = model.config().vocab_size;
    let argmax = |l: &[f32]| {
        (0..l.len())
            .max_by(|&a, &b| l[a].total_cmp(&l[b]))
            .unwrap_or(0) as u32
    };
    let mut out = Vec::new();
    for &batch in &opts.batches {
        let mut rows: Vec<(usize, usize, u32)> = Vec::with_capacity(batch);
        for slot in 0..batch {
            // Distinct prompts: the bench prompt rotated by the slot.
            let mut p = prompt.to_vec();
            let shift = slot % p.len().max(1);
            p.rotate_left(shift);
            if let Some(first) = p.first_mut() {
                *first = ((*first as usize + slot) % vocab) as u32;
            }
            let logits = model.prefill_slot(slot, &p)?;
            rows.push((slot, p.len(), argmax(&logits)));
        }
        // The server's greedy step: the tokens chosen on the device, one id per sequence back
        // (the logits of 32 sequences are 4 MB a step to copy).
        let mut step = |rows: &mut Vec<(usize, usize, u32)>| -> Result<()> {
            let tokens = model.step_slots_argmax(rows)?;
            for (r, t) in rows.iter_mut().zip(tokens) {
                *r = (r.0, r.1 + 1, t?);
            }
            Ok(())
        };
        // One untimed step (first launches, cuBLAS heuristics).
        step(&mut rows)?;
        let mut times = Vec::with_capacity(steps);
        for _ in 0..steps {
            let t = Instant::now();
            step(&mut rows)?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let median = percentile(&times, 0.5);
        out.push(BatchPoint {
            batch,
            one_pass: model.batch_pays(batch),
            step_ms_median: median * 1e3,
            step_ms_p10: percentile(&times, 0.1) * 1e3,
            step_ms_p90: percentile(&times, 0.9) * 1e3,
            tokens_per_s: batch as f64 / median.max(1e-12),
        });
    }
    Ok(out)
}

/// Builds and measures the synthetic model `name` at each `(sp, dp)` with an f16 KV cache;
/// `on_result` sees each configuration as it finishes (the CLI prints it).
pub fn run_synthetic(
    name: &str,
    configs: &[(f64, f64)],
    opts: &DecodeBenchOptions,
    on_result: impl FnMut(&DecodeResult),
) -> Result<Vec<DecodeResult>> {
    run_synthetic_with(name, configs, opts, KvPrecision::F16, on_result)
}

/// One (sp, dp) configuration of a synthetic run: its sparsities, the format it is stored
/// in, and the value kinds each measured.
type SyntheticRun = (f64, f64, FormatKind, Vec<SyntheticValues>);

/// The synthetic models `configs` and `opts` ask for, every one checked before any is built;
/// a dense configuration is stored dense whatever `--format` says.
fn synthetic_runs(configs: &[(f64, f64)], opts: &DecodeBenchOptions) -> Result<Vec<SyntheticRun>> {
    let values = if opts.values.is_empty() {
        vec![SyntheticValues::F16]
    } else {
        opts.values.clone()
    };
    configs
        .iter()
        .map(|&(sp, dp)| {
            let format = if sp == 0.0 {
                FormatKind::Dense
            } else {
                opts.format
            };
            for &v in &values {
                v.check(format)?;
            }
            synthetic::check_pattern(format, opts.pattern)?;
            Ok((sp, dp, format, values.clone()))
        })
        .collect()
}

/// The synthetic model of one run of `opts` (seeded by `opts.seed`, 16 calibration tokens).
fn synthetic_options(
    opts: &DecodeBenchOptions,
    sp: f64,
    dp: f64,
    format: FormatKind,
    values: SyntheticValues,
    layouts: crate::matrix::Layouts,
) -> SyntheticOptions {
    SyntheticOptions {
        sp,
        pattern: opts.pattern,
        dp,
        format,
        values,
        seed: opts.seed,
        calib_tokens: 16,
        layouts,
    }
}

/// [`run_synthetic`] with the KV cache stored as `kv` says.
pub fn run_synthetic_with(
    name: &str,
    configs: &[(f64, f64)],
    opts: &DecodeBenchOptions,
    kv: KvPrecision,
    mut on_result: impl FnMut(&DecodeResult),
) -> Result<Vec<DecodeResult>> {
    let config = synthetic::config(name)?;
    opts.check_context(
        config.max_position_embeddings,
        &format!("the synthetic {name}"),
    )?;
    let capacity = opts.positions_needed();
    let mut out = Vec::new();
    let mut copy_gbs = 0.0;
    for (sp, dp, format, values) in synthetic_runs(configs, opts)? {
        for v in values {
            let gpu = Gpu::new(0)?;
            if copy_gbs == 0.0 {
                copy_gbs = sieve_cuda::timing::copy_bandwidth_gbs(&gpu, 1 << 30, 20)?;
            }
            // Batched steps measured: the layouts a server keeps.
            let layouts = crate::matrix::Layouts {
                batch: opts.batches.iter().any(|&b| b > 1),
                int8_activations: opts.int8_activations,
                prompt8: opts.prompt8,
                prompt16: opts.prompt16,
                ..Default::default()
            };
            let synth = synthetic_options(opts, sp, dp, format, v, layouts);
            let t = Instant::now();
            let mut model = synthetic::build_with(gpu, name, &synth, capacity, kv)?;
            let setup_s = t.elapsed().as_secs_f64();
            let o = DecodeBenchOptions {
                format,
                ..opts.clone()
            };
            let kernels = if format == FormatKind::TiledCbc && !opts.tcbc_kernels.is_empty() {
                opts.tcbc_kernels.clone()
            } else {
                vec![TcbcKernel::Lane8]
            };
            for kernel in kernels {
                if format == FormatKind::TiledCbc {
                    model.set_tcbc_kernel(kernel)?;
                }
                measure_steps(&mut model, name, sp, dp, setup_s, &o, copy_gbs, |mut r| {
                    r.values = v.name();
                    on_result(&r);
                    out.push(r);
                })?;
            }
        }
    }
    Ok(out)
}

/// An SVG bar chart of median TPOT per configuration (p10-p90 whiskers).
pub fn plot_svg(results: &[DecodeResult]) -> String {
    let (w, h, left, bottom) = (720.0, 360.0, 70.0, 60.0);
    let max = results
        .iter()
        .map(|r| r.tpot_ms_p90)
        .fold(0.0f64, f64::max)
        .max(1e-6)
        * 1.15;
    let bw = (w - left - 20.0) / results.len().max(1) as f64;
    let y = |v: f64| h - bottom - v / max * (h - bottom - 30.0);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<text x=\"{}\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">decode TPOT (ms, median, p10-p90)</text>\n<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
        w / 2.0,
        h - bottom,
        w - 10.0,
        h - bottom
    );
    for i in 0..=4 {
        let v = max * i as f64 / 4.0;
        s += &format!(
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.2}</text><line x1=\"{left}\" y1=\"{:.1}\" x2=\"{}\" y2=\"{:.1}\" stroke=\"#ddd\"/>\n",
            left - 6.0,
            y(v) + 4.0,
            y(v),
            w - 10.0,
            y(v)
        );
    }
    for (i, r) in results.iter().enumerate() {
        let x = left + i as f64 * bw + bw * 0.15;
        let bwid = bw * 0.7;
        s += &format!(
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{bwid:.1}\" height=\"{:.1}\" fill=\"#4a7ab5\"/>\n",
            y(r.tpot_ms_median),
            h - bottom - y(r.tpot_ms_median)
        );
        let cx = x + bwid / 2.0;
        s += &format!(
            "<line x1=\"{cx:.1}\" y1=\"{:.1}\" x2=\"{cx:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\n<text x=\"{cx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{:.3}</text>\n",
            y(r.tpot_ms_p10),
            y(r.tpot_ms_p90),
            y(r.tpot_ms_p90) - 4.0,
            r.tpot_ms_median
        );
        s += &format!(
            "<text x=\"{cx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{} sp {} dp {}</text>\n",
            h - bottom + 18.0,
            r.model,
            r.sp,
            r.dp
        );
        s += &format!(
            "<text x=\"{cx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
            h - bottom + 34.0,
            r.format
        );
    }
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(prompt: usize, tokens: usize, context: usize) -> DecodeBenchOptions {
        DecodeBenchOptions {
            prompt,
            tokens,
            context,
            format: FormatKind::TiledCbc,
            pattern: Pattern::Unstructured,
            values: vec![],
            seed: 0,
            tcbc_kernels: vec![TcbcKernel::Lane8],
            pdl: vec![true],
            prefetch: vec![],
            batches: vec![],
            steps: vec![],
            int8_activations: false,
            prompt8: None,
            prompt16: false,
            leave_out: false,
        }
    }

    #[test]
    fn bad_runs_are_refused_before_the_gpu_is_opened() {
        // These return before `Gpu::new`, so they hold on a machine without a GPU too.
        let ok = options(128, 256, 8192);
        assert_eq!(ok.positions_needed(), 8192 + 64 + 16);
        assert!(ok.check_context(32768, "m").is_ok());
        let e = options(30000, 3000, 0).check_context(32768, "the synthetic llama2-7b");
        let e = e.unwrap_err().to_string();
        assert!(
            e.contains("33016 positions") && e.contains("context of 32768"),
            "{e}"
        );
        let e = run_synthetic("llama-9000", &[(0.0, 0.0)], &ok, |_| {}).unwrap_err();
        assert!(
            e.to_string()
                .contains("unknown synthetic model 'llama-9000'"),
            "{e}"
        );
        let e = run_synthetic("llama2-7b", &[(0.0, 0.0)], &options(1, 1, 40000), |_| {});
        assert!(e.unwrap_err().to_string().contains("context of 32768"));
    }
}

/// One model measured split over GPUs (`sieve bench decode --tensor-parallel N`, issue 31).
#[derive(Clone, Debug, serde::Serialize)]
pub struct TensorParallelResult {
    pub model: String,
    pub sp: f64,
    pub dp: f64,
    pub format: String,
    pub values: String,
    pub world: usize,
    /// Wall time of the whole split step as the caller sees it (every rank's step, the
    /// all-reduces inside them, and the ranks' threads handing back their tokens).
    pub tpot_ms_median: f64,
    pub tpot_ms_p10: f64,
    pub tpot_ms_p90: f64,
    /// Median of three prompt passes.
    pub ttft_ms: f64,
    /// One step's 2L all-reduces of the hidden size, timed alone on each rank (slowest rank);
    /// None at world size 1.
    pub all_reduce_us_per_step: Option<f64>,
    pub rank_weight_bytes: Vec<usize>,
    pub rank_kv_bytes: Vec<usize>,
    /// What each rank sends per token (ring all-reduce of f32 partial sums).
    pub bytes_sent_per_rank: usize,
    pub setup_s: f64,
}

/// Measures a split model as [`measure`] does a whole one: the same prompt, three prompt
/// passes for TTFT, then `opts.tokens` steps each timed by wall clock with its token read back.
pub fn measure_tensor_parallel(
    tp: &mut crate::tensor_parallel::TensorParallelGpu,
    label: &str,
    sp: f64,
    dp: f64,
    values: &str,
    setup_s: f64,
    opts: &DecodeBenchOptions,
) -> Result<TensorParallelResult> {
    let vocab = tp.config().vocab_size as u64;
    let prompt: Vec<u32> = (0..opts.prompt.max(1) as u64)
        .map(|i| ((i * 7919 + opts.seed * 104_729 + 13) % vocab) as u32)
        .collect();
    if prompt.len() + opts.tokens + 2 > tp.capacity() {
        return Err(GpuError::InvalidArgument(format!(
            "prompt {} + tokens {} exceed the KV cache of {}",
            prompt.len(),
            opts.tokens,
            tp.capacity()
        )));
    }
    // Warm-up: kernels, cuBLAS's GEMMs of this prompt length, both graphs of every rank.
    tp.prefill(&prompt)?;
    for _ in 0..2 {
        tp.next_token()?;
    }
    let mut ttfts = Vec::with_capacity(3);
    for _ in 0..3 {
        let t = Instant::now();
        tp.prefill(&prompt)?;
        ttfts.push(t.elapsed().as_secs_f64());
    }
    let mut steps = Vec::with_capacity(opts.tokens);
    for _ in 0..opts.tokens {
        let t = Instant::now();
        tp.next_token()?;
        steps.push(t.elapsed().as_secs_f64());
    }
    // percentile() reads sorted samples.
    steps.sort_by(f64::total_cmp);
    ttfts.sort_by(f64::total_cmp);
    let all_reduce = tp.all_reduce_us_per_step(20)?;
    let report = tp.report();
    Ok(TensorParallelResult {
        model: label.to_string(),
        sp,
        dp,
        format: opts.format.name().to_string(),
        values: values.to_string(),
        world: report.world,
        tpot_ms_median: percentile(&steps, 0.5) * 1e3,
        tpot_ms_p10: percentile(&steps, 0.1) * 1e3,
        tpot_ms_p90: percentile(&steps, 0.9) * 1e3,
        ttft_ms: percentile(&ttfts, 0.5) * 1e3,
        all_reduce_us_per_step: all_reduce,
        rank_weight_bytes: report.rank_weight_bytes.clone(),
        rank_kv_bytes: report.rank_kv_bytes.clone(),
        bytes_sent_per_rank: report.volume.bytes_sent_per_rank,
        setup_s,
    })
}

/// [`run_synthetic_with`] split over `world` GPUs: each (sp, dp) configuration and value kind
/// built rank by rank (`TensorParallelGpu::synthetic`) and measured.
pub fn run_synthetic_tensor_parallel(
    name: &str,
    configs: &[(f64, f64)],
    opts: &DecodeBenchOptions,
    kv: KvPrecision,
    world: usize,
    mut on_result: impl FnMut(&TensorParallelResult),
) -> Result<Vec<TensorParallelResult>> {
    let config = synthetic::config(name)?;
    opts.check_context(
        config.max_position_embeddings,
        &format!("the synthetic {name}"),
    )?;
    // Refused before anything is built: a split the heads do not allow, TEAL thresholds.
    sieve_model::llama::tensor_parallel::ShardLayout::new(&config, world)?;
    if let Some(&(_, dp)) = configs.iter().find(|&&(_, dp)| dp != 0.0) {
        return Err(GpuError::Unsupported(format!(
            "--tensor-parallel {world} --dp {dp}: synthetic models split with --dp 0 only (TEAL \
             thresholds are calibrated on one GPU's whole model)"
        )));
    }
    let capacity = opts.positions_needed();
    let mut out = Vec::new();
    for (sp, dp, format, values) in synthetic_runs(configs, opts)? {
        for v in values {
            let layouts = crate::matrix::Layouts {
                prompt8: opts.prompt8,
                prompt16: opts.prompt16,
                ..Default::default()
            };
            let synth = synthetic_options(opts, sp, dp, format, v, layouts);
            let t = Instant::now();
            let mut tp = crate::tensor_parallel::TensorParallelGpu::synthetic(
                name, &synth, world, capacity, kv,
            )?;
            let setup_s = t.elapsed().as_secs_f64();
            let o = DecodeBenchOptions {
                format,
                ..opts.clone()
            };
            let r = measure_tensor_parallel(&mut tp, name, sp, dp, &v.name(), setup_s, &o)?;
            on_result(&r);
            out.push(r);
        }
    }
    Ok(out)
}
