//! `sieve serve`: the OpenAI-compatible HTTP server (the server itself is `sieve-serve`).

use super::device::{self, Device};
use anyhow::{bail, Context, Result};
use clap::Args;
use sieve_serve::engine::DecodeEngine;
use sieve_serve::{
    load_cpu_engine, load_gpu_engine, load_synthetic_gpu_engine, model_name_for, shutdown_signal,
    ServeConfig, Server,
};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    /// Model file or directory (default: $SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long, conflicts_with = "synthetic")]
    model: Option<PathBuf>,
    /// Serve a synthetic model of a real shape instead (llama2-7b, llama2-13b, llama3-8b,
    /// llama2-70b: random weights built on the GPU, a byte tokenizer, no end of text) for load
    /// tests at real scale. GPU only.
    #[arg(long)]
    synthetic: Option<String>,
    /// Weight sparsity of the synthetic model's projections.
    #[arg(long, default_value_t = 0.0, requires = "synthetic")]
    sp: f64,
    /// Activation sparsity (TEAL thresholds) of the synthetic model.
    #[arg(long, default_value_t = 0.0, requires = "synthetic")]
    dp: f64,
    /// Format of a sparse synthetic model: tiled-cbc, rlc-csc, balanced-cbc, ie-bme, dense.
    #[arg(long, default_value = "tiled-cbc", requires = "synthetic")]
    format: String,
    /// What the synthetic model's kept weights are stored as (as `sieve bench decode --values`).
    #[arg(long, default_value = "f16", requires = "synthetic")]
    values: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Sequences decoded together (and KV cache slots in the pool).
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Positions per KV cache slot, prompt and completion together (capped at the model's).
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Largest max_tokens a request may ask for.
    #[arg(long, default_value_t = 1024)]
    max_tokens_cap: usize,
    /// Requests that may wait for a slot; beyond it new ones get 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    body_limit: usize,
    /// Require `Authorization: Bearer KEY` on /v1/* (default: $SIEVE_API_KEY when set). An
    /// empty or blank key is an error, not "no key".
    #[arg(long, env = "SIEVE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Model worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Prompt tokens prefilled per scheduler step; longer prompts go in chunks of this size
    /// between the decode steps of the running sequences.
    #[arg(long, default_value_t = sieve_serve::scheduler::PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// What the KV cache slots store: f16, or int8 (one scale per position and KV head;
    /// about half the memory per slot).
    #[arg(long, value_enum, default_value_t = super::device::KvCache::F16)]
    kv_cache: super::device::KvCache,
    /// Split the model over this many GPUs of the machine (tensor parallelism over NCCL, each
    /// GPU holding its heads' KV cache slots); GPU only. Synthetic models take --dp 0 only.
    #[arg(long)]
    tensor_parallel: Option<usize>,
    /// GPU only: f16, or f16-resident (the f16 copy a prompt pass of a sparse or low-bit matrix
    /// multiplies, decoded once at start instead of once per pass: a dense model's time to
    /// first token, 2 more bytes per weight of GPU memory).
    #[arg(long, value_enum, default_value_t = super::device::PromptPrecision::F16)]
    prompt_precision: super::device::PromptPrecision,
    /// Seconds in-flight requests may take to finish after SIGTERM.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    /// Connections served at once (lowered to stay below the open-file limit); more get 503.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Seconds to receive a request's headers; also how long an idle keep-alive connection stays.
    #[arg(long, default_value_t = 10)]
    header_timeout: u64,
    /// Seconds to receive a request's body once its headers are in (408 beyond).
    #[arg(long, default_value_t = 30)]
    body_timeout: u64,
    /// Seconds a response write may make no progress (a client that stopped reading).
    #[arg(long, default_value_t = 60)]
    write_timeout: u64,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let mut config = ServeConfig {
        host: args.host.clone(),
        port: args.port,
        model_name: String::new(),
        max_batch: args.max_batch,
        context: args.ctx,
        max_tokens_cap: args.max_tokens_cap,
        queue_capacity: args.queue,
        // Given but empty (`--api-key ''`, `SIEVE_API_KEY=`) stays given: `validate` refuses it.
        api_key: args.api_key.clone(),
        body_limit: args.body_limit,
        threads: args.threads,
        drain_timeout: Duration::from_secs(args.drain_timeout),
        max_connections: args.max_connections,
        header_timeout: Duration::from_secs(args.header_timeout),
        body_timeout: Duration::from_secs(args.body_timeout),
        write_timeout: Duration::from_secs(args.write_timeout),
        prefill_chunk: args.prefill_chunk,
        kv_cache: args.kv_cache.precision(),
        prompt16: args.prompt_precision.resident_f16(),
    };
    config.validate()?;
    if args.prompt_precision.eight_bit().is_some() {
        bail!(
            "sieve serve --prompt-precision takes f16 or f16-resident (8-bit prompt passes are for generate and bench decode)"
        );
    }
    if config.prompt16 && args.device == Device::Cpu {
        bail!("--prompt-precision f16-resident keeps copies in GPU memory: it needs --device cuda or auto with a GPU");
    }
    if args.tensor_parallel.is_some() && args.device == Device::Cpu {
        bail!("--tensor-parallel splits the model over GPUs: it needs --device cuda or auto with GPUs");
    }
    if let Some(name) = &args.synthetic {
        return serve_synthetic(name, &args, config);
    }
    let path = super::model_path::resolve_model(args.model.as_deref())?;
    config.model_name = model_name_for(&path);
    if let Some(world) = args.tensor_parallel {
        let (engine, tokenizer) = sieve_serve::load_split_gpu_engine(&path, &config, world)
            .with_context(|| format!("opening {} over {world} GPU(s)", path.display()))?;
        device::print_split_report(engine.model());
        let on = format!("{world} GPU(s), tensor parallel");
        return listen(Box::new(engine), tokenizer, config, &on);
    }
    let gpu = device::open(args.device)?;
    let on = match &gpu {
        Some(g) => g.info().name.clone(),
        None => "cpu".to_owned(),
    };
    let (engine, tokenizer): (Box<dyn DecodeEngine>, _) = match gpu {
        Some(gpu) => {
            let (engine, tokenizer) = load_gpu_engine(&path, &config, gpu)
                .with_context(|| format!("opening {} on the GPU", path.display()))?;
            device::print_report(engine.model());
            (Box::new(engine), tokenizer)
        }
        None => {
            if config.prompt16 {
                bail!("--prompt-precision f16-resident keeps copies in GPU memory: it needs --device cuda or auto with a GPU (this run found none)");
            }
            let (engine, tokenizer) = load_cpu_engine(&path, &config)
                .with_context(|| format!("opening {}", path.display()))?;
            (Box::new(engine), tokenizer)
        }
    };
    listen(engine, tokenizer, config, &on)
}

/// `--synthetic NAME`: the model is built on the GPU from the shape and the settings given.
fn serve_synthetic(name: &str, args: &ServeArgs, mut config: ServeConfig) -> Result<()> {
    use sieve_formats::FormatKind;
    use sieve_gpu::synthetic::{SyntheticOptions, SyntheticValues};
    for (flag, v) in [("--sp", args.sp), ("--dp", args.dp)] {
        if !(0.0..1.0).contains(&v) {
            bail!("{flag} {v} is outside [0, 1)");
        }
    }
    // A dense configuration is stored dense whatever --format says (as in bench decode).
    let format = if args.sp == 0.0 {
        FormatKind::Dense
    } else {
        FormatKind::from_name(&args.format)?
    };
    sieve_gpu::synthetic::config(name)?;
    let values: SyntheticValues = args.values.parse()?;
    values.check(format)?;
    let options = SyntheticOptions {
        sp: args.sp,
        pattern: sieve_formats::random::Pattern::Unstructured,
        dp: args.dp,
        format,
        values,
        seed: 0,
        calib_tokens: 16,
        // More than one slot: keep the batch layout of column-major 4-bit matrices.
        layouts: sieve_gpu::matrix::Layouts {
            batch: config.max_batch > 1,
            prompt16: config.prompt16,
            ..Default::default()
        },
    };
    config.model_name = format!(
        "synthetic-{name}-sp{}-dp{}-{}-{}",
        args.sp,
        args.dp,
        format.name(),
        values.name()
    );
    if let Some(world) = args.tensor_parallel {
        config.model_name.push_str(&format!("-tp{world}"));
        eprintln!(
            "sieve serve: building {} over {world} GPU(s)",
            config.model_name
        );
        let (engine, tokenizer) =
            sieve_serve::load_synthetic_split_gpu_engine(name, &options, &config, world)
                .with_context(|| format!("building the synthetic {name} over {world} GPU(s)"))?;
        device::print_split_report(engine.model());
        let on = format!("{world} GPU(s), tensor parallel");
        return listen(Box::new(engine), tokenizer, config, &on);
    }
    let Some(gpu) = device::open(args.device)? else {
        bail!("--synthetic models are built on the GPU; this run has none (--device cuda on a machine with one)");
    };
    let on = gpu.info().name.clone();
    eprintln!("sieve serve: building {} on {on}", config.model_name);
    let (engine, tokenizer) = load_synthetic_gpu_engine(name, &options, &config, gpu)
        .with_context(|| format!("building the synthetic {name} on the GPU"))?;
    device::print_report(engine.model());
    listen(Box::new(engine), tokenizer, config, &on)
}

/// Starts the server on `engine` and blocks until it stops.
fn listen(
    engine: Box<dyn DecodeEngine>,
    tokenizer: sieve_model::tokenizer::Tokenizer,
    config: ServeConfig,
    on: &str,
) -> Result<()> {
    let positions = engine.slot_capacity();
    let server = Server::start_with_shutdown(engine, tokenizer, &config, async {
        shutdown_signal().await;
        eprintln!("sieve serve: shutting down, finishing requests in flight");
    })?;
    let limits = server.limits();
    eprintln!(
        "sieve serve: model {} on {on}, {} slots of {} positions, at most {} connections, \
         listening on http://{}",
        config.model_name,
        config.max_batch,
        positions,
        limits.max_connections,
        server.addr()
    );
    server.wait()?;
    eprintln!("sieve serve: stopped");
    Ok(())
}
