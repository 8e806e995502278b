//! `sieve serve`: an OpenAI-compatible HTTP server over a sieve model with continuous batching.
//!
//! | module | job |
//! |---|---|
//! | [`api`] | the OpenAI wire format: request parsing, JSON errors, responses and stream chunks |
//! | [`engine`] | `DecodeEngine`, the seam a model runner implements (CPU: `CpuEngine`) |
//! | [`gpu_engine`] | `GpuEngine`: the GPU runner's slots behind the same seam (`--device cuda`) |
//! | [`scheduler`] | the bounded queue and the continuous-batching loop that owns the engine |
//! | [`metrics`] | counters, gauges and histograms in the Prometheus text format |
//! | [`server`] | axum routes, API key, limits, SSE streaming |
//! | [`connections`] | the accept loop: connection cap, header/idle and write timeouts |
//! | [`load`] | the other side: load on any OpenAI-compatible server (`sieve bench serve`) |
//!
//! Threads: one scheduler thread (inside a rayon pool, which the model's products use) owns
//! the engine; a small tokio runtime runs HTTP. They meet in the [`scheduler::Queue`] (jobs in)
//! and one unbounded channel per request (events out), so HTTP never waits on the model.
//! Start-up fails (with the message) if the scheduler cannot start; if it stops later, `/health`
//! answers 503, queued requests fail, and the server shuts down with the scheduler's error.

pub mod api;
pub mod connections;
pub mod engine;
pub mod gpu_engine;
pub mod load;
pub mod metrics;
pub mod scheduler;
pub mod server;

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sieve_gpu::tensor_parallel::TensorParallelGpu;
use sieve_model::tokenizer::Tokenizer;
use thiserror::Error;

use crate::connections::{ConnectionLimits, Connections};
use crate::engine::{CpuEngine, DecodeEngine};
use crate::metrics::Metrics;
use crate::scheduler::Queue;
use crate::server::AppState;

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("invalid setting: {0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] sieve_model::ModelError),
    #[error(transparent)]
    Gpu(#[from] sieve_gpu::GpuError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Runtime(String),
}

pub type Result<T, E = ServeError> = std::result::Result<T, E>;

/// Server settings (the `sieve serve` flags).
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    /// The name `/v1/models` lists and requests may give as `model`.
    pub model_name: String,
    /// Sequences decoded together, and KV cache slots in the pool.
    pub max_batch: usize,
    /// Positions per cache slot (prompt and completion together); capped at the model's.
    pub context: usize,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_cap: usize,
    /// Requests that may wait for a slot before new ones get 503.
    pub queue_capacity: usize,
    pub api_key: Option<String>,
    /// Largest request body, bytes.
    pub body_limit: usize,
    /// Model threads (default: one per core).
    pub threads: Option<usize>,
    /// After a shutdown signal, how long in-flight requests may take to finish.
    pub drain_timeout: Duration,
    /// Connections served at once (lowered to stay below the open-file limit); beyond it new
    /// connections get 503.
    pub max_connections: usize,
    /// Time to receive a request's headers; also how long an idle keep-alive connection stays.
    pub header_timeout: Duration,
    /// Time to receive a request's whole body once its headers are in.
    pub body_timeout: Duration,
    /// Longest a response write may make no progress (a client that stopped reading).
    pub write_timeout: Duration,
    /// Prompt tokens prefilled per scheduler step, and the chunk a longer prompt is cut into
    /// (see [`scheduler`]).
    pub prefill_chunk: usize,
    /// What the KV cache slots store (`--kv-cache`).
    pub kv_cache: sieve_model::llama::KvPrecision,
    /// GPU engine: keep the prompt passes' f16 copies of sparse and low-bit matrices resident
    /// (`--prompt-precision f16-resident`, [`sieve_gpu::matrix::Layouts::prompt16`]).
    pub prompt16: bool,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            model_name: "sieve".into(),
            max_batch: 8,
            context: 2048,
            max_tokens_cap: 1024,
            queue_capacity: 64,
            api_key: None,
            body_limit: 1 << 20,
            threads: None,
            drain_timeout: Duration::from_secs(30),
            max_connections: 512,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(60),
            prefill_chunk: scheduler::PREFILL_CHUNK,
            kv_cache: sieve_model::llama::KvPrecision::F16,
            prompt16: false,
        }
    }
}

impl ServeConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(ServeError::Config(m.into()));
        if self.max_batch == 0 {
            return bad("--max-batch must be at least 1");
        }
        if self.context < 2 {
            return bad("--ctx must be at least 2");
        }
        if self.max_tokens_cap == 0 {
            return bad("--max-tokens-cap must be at least 1");
        }
        if self.queue_capacity == 0 {
            return bad("--queue must be at least 1");
        }
        if self.prefill_chunk == 0 {
            return bad("--prefill-chunk must be at least 1");
        }
        if self.body_limit < 64 {
            return bad("--body-limit must be at least 64 bytes");
        }
        if let Some(threads) = self.threads {
            sieve_model::generate::check_threads(threads)
                .map_err(|e| ServeError::Config(e.to_string()))?;
        }
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return bad(
                "the API key (--api-key or SIEVE_API_KEY) is empty or blank; give a key, or \
                 leave both unset to serve without one",
            );
        }
        connections::connection_cap(self.max_connections, None).map_err(ServeError::Config)?;
        for (name, value) in [
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
            ("--write-timeout", self.write_timeout),
        ] {
            if value.is_zero() {
                return Err(ServeError::Config(format!("{name} must be positive")));
            }
        }
        Ok(())
    }
}

/// The model name for a model file: its file name without the `.gguf`/`.sieve` extension.
pub fn model_name_for(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "sieve".into());
    for ext in [".gguf", ".sieve"] {
        if let Some(stem) = name.strip_suffix(ext) {
            return stem.to_owned();
        }
    }
    name
}

/// Loads a model file into a CPU engine with `config.max_batch` slots of `config.context`.
pub fn load_cpu_engine(path: &Path, config: &ServeConfig) -> Result<(CpuEngine, Tokenizer)> {
    config.validate()?;
    let (mut model, tokenizer) = sieve_model::packed::load_model_and_tokenizer(path)?;
    model.set_kv_precision(config.kv_cache);
    let engine = CpuEngine::new(model, config.max_batch, config.context)?;
    Ok((engine, tokenizer))
}

/// Loads a model file into a GPU engine on `gpu` with `config.max_batch` device KV cache
/// slots of `config.context` positions.
pub fn load_gpu_engine(
    path: &Path,
    config: &ServeConfig,
    gpu: sieve_cuda::Gpu,
) -> Result<(gpu_engine::GpuEngine, Tokenizer)> {
    config.validate()?;
    let (mut model, tokenizer) = sieve_model::packed::load_model_and_tokenizer(path)?;
    model.set_kv_precision(config.kv_cache);
    let engine = gpu_engine::GpuEngine::new(
        &model,
        gpu,
        config.max_batch,
        config.context,
        config.prompt16,
    )?;
    Ok((engine, tokenizer))
}

/// A synthetic model of a real shape (`sieve_gpu::synthetic`: random weights pruned and
/// stored as `options` say, built on `gpu` layer by layer) in a GPU engine, with the byte
/// tokenizer ([`Tokenizer::bytes`]): for load tests at real scale without a model file.
pub fn load_synthetic_gpu_engine(
    name: &str,
    options: &sieve_gpu::synthetic::SyntheticOptions,
    config: &ServeConfig,
    gpu: sieve_cuda::Gpu,
) -> Result<(gpu_engine::GpuEngine, Tokenizer)> {
    config.validate()?;
    let shape = sieve_gpu::synthetic::config(name)?;
    let tokenizer = Tokenizer::bytes(shape.vocab_size)?;
    let context = config.context.min(shape.max_position_embeddings);
    let model = sieve_gpu::synthetic::build_with(gpu, name, options, context, config.kv_cache)?;
    let engine = gpu_engine::GpuEngine::from_gpu_model(model, config.max_batch)?;
    Ok((engine, tokenizer))
}

/// [`load_gpu_engine`] with the model split over GPUs `0..world` (tensor parallelism:
/// `sieve_gpu::tensor_parallel`), each with `config.max_batch` slots for its KV heads.
pub fn load_split_gpu_engine(
    path: &Path,
    config: &ServeConfig,
    world: usize,
) -> Result<(gpu_engine::GpuEngine<TensorParallelGpu>, Tokenizer)> {
    config.validate()?;
    let (mut model, tokenizer) = sieve_model::packed::load_model_and_tokenizer(path)?;
    model.set_kv_precision(config.kv_cache);
    let engine = gpu_engine::GpuEngine::split(
        &model,
        world,
        config.max_batch,
        config.context,
        config.prompt16,
    )?;
    Ok((engine, tokenizer))
}

/// [`load_synthetic_gpu_engine`] split over GPUs `0..world` (each rank's slices generated on
/// its GPU; `options.dp` must be 0).
pub fn load_synthetic_split_gpu_engine(
    name: &str,
    options: &sieve_gpu::synthetic::SyntheticOptions,
    config: &ServeConfig,
    world: usize,
) -> Result<(gpu_engine::GpuEngine<TensorParallelGpu>, Tokenizer)> {
    config.validate()?;
    let shape = sieve_gpu::synthetic::config(name)?;
    let tokenizer = Tokenizer::bytes(shape.vocab_size)?;
    let context = config.context.min(shape.max_position_embeddings);
    let engine = gpu_engine::GpuEngine::split_synthetic(
        name,
        options,
        world,
        config.max_batch,
        context,
        config.kv_cache,
    )?;
    Ok((engine, tokenizer))
}

/// A running server: its address, and the way to stop it.
pub struct Server {
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    limits: ConnectionLimits,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    http: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Server {
    /// Binds, starts the scheduler and HTTP threads, and returns once it accepts connections.
    pub fn start(
        engine: Box<dyn DecodeEngine>,
        tokenizer: Tokenizer,
        config: &ServeConfig,
    ) -> Result<Self> {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        Self::start_with_shutdown(engine, tokenizer, config, async move {
            let _ = rx.await;
        })
        .map(|mut s| {
            s.stop = Some(tx);
            s
        })
    }

    /// [`Server::start`], draining when `shutdown` completes (e.g. on SIGTERM).
    ///
    /// Start-up order: settings checked; the scheduler thread builds its thread pool and
    /// reports back (a failure there, e.g. a pool that cannot be built, is this function's
    /// error and nothing listens); the open-file limit is raised and the connection cap set
    /// below it; then the port is bound.
    pub fn start_with_shutdown(
        mut engine: Box<dyn DecodeEngine>,
        tokenizer: Tokenizer,
        config: &ServeConfig,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<Self> {
        config.validate()?;
        let max_connections = connections::connection_cap(
            config.max_connections,
            connections::raise_open_file_limit(),
        )
        .map_err(ServeError::Config)?;
        let limits = ConnectionLimits {
            max_connections,
            header_timeout: config.header_timeout,
            write_timeout: config.write_timeout,
        };

        let metrics = Arc::new(Metrics::new());
        let queue = Arc::new(Queue::new(config.queue_capacity, metrics.clone()));
        let tokenizer = Arc::new(tokenizer);
        let context = engine.slot_capacity();
        metrics
            .slots_total
            .store(engine.slots() as u64, std::sync::atomic::Ordering::Relaxed);

        // The scheduler starts first and says whether it could; its end (normal or not) is
        // seen by the HTTP side through `exited`.
        let (threads, prefill_chunk) = (config.threads, config.prefill_chunk);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let (exited_tx, exited_rx) = tokio::sync::oneshot::channel::<()>();
        let scheduler = {
            let (queue, metrics, tokenizer) = (queue.clone(), metrics.clone(), tokenizer.clone());
            std::thread::Builder::new()
                .name("sieve-scheduler".into())
                .spawn(move || -> sieve_model::Result<()> {
                    let _exited = exited_tx;
                    let pool = match sieve_model::generate::thread_pool(threads) {
                        Ok(pool) => pool,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return Err(e);
                        }
                    };
                    let _life = scheduler::SchedulerLife::start(&queue);
                    let _ = ready_tx.send(Ok(()));
                    pool.install(|| {
                        scheduler::run(engine.as_mut(), &tokenizer, &queue, &metrics, prefill_chunk)
                    });
                    Ok(())
                })
                .map_err(|e| ServeError::Runtime(format!("scheduler thread: {e}")))?
        };
        let stop_scheduler = |scheduler: std::thread::JoinHandle<_>| {
            queue.close();
            let _ = scheduler.join();
        };
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(message)) => {
                stop_scheduler(scheduler);
                return Err(ServeError::Runtime(format!(
                    "the scheduler could not start: {message}"
                )));
            }
            Err(_) => {
                stop_scheduler(scheduler);
                return Err(ServeError::Runtime(
                    "the scheduler thread ended during start-up".into(),
                ));
            }
        }

        let bound = std::net::TcpListener::bind((config.host.as_str(), config.port))
            .and_then(|l| l.local_addr().map(|a| (l, a)))
            .and_then(|(l, a)| l.set_nonblocking(true).map(|()| (l, a)));
        let (listener, addr) = match bound {
            Ok(bound) => bound,
            Err(source) => {
                stop_scheduler(scheduler);
                return Err(ServeError::Bind {
                    addr: format!("{}:{}", config.host, config.port),
                    source,
                });
            }
        };

        let state = Arc::new(AppState::new(
            queue.clone(),
            metrics.clone(),
            tokenizer.clone(),
            config.model_name.clone(),
            config.api_key.clone(),
            context,
            config.max_tokens_cap,
            config.body_limit,
            config.body_timeout,
        ));
        let app = server::router(state, config.body_limit);
        let drain_timeout = config.drain_timeout;
        let http_metrics = metrics.clone();
        let http = std::thread::Builder::new()
            .name("sieve-http".into())
            .spawn(move || -> Result<()> {
                let served = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .map_err(|e| ServeError::Runtime(format!("tokio runtime: {e}")))
                    .and_then(|runtime| {
                        let connections = Connections::new(limits, http_metrics);
                        runtime.block_on(serve(
                            listener,
                            app,
                            queue.clone(),
                            connections,
                            shutdown,
                            exited_rx,
                            drain_timeout,
                        ))
                    });
                // Whatever happened to HTTP, the scheduler must see a closed queue to exit.
                queue.close();
                let scheduled = match scheduler.join() {
                    Ok(result) => result.map_err(ServeError::from),
                    Err(panic) => Err(ServeError::Runtime(format!(
                        "the scheduler thread panicked: {}",
                        panic_message(panic.as_ref())
                    ))),
                };
                served.and(scheduled)
            })
            .map_err(|e| ServeError::Runtime(format!("http thread: {e}")))?;
        Ok(Self {
            addr,
            metrics,
            limits,
            stop: None,
            http: Some(http),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The connection limits in force (`max_connections` already lowered below the open-file
    /// limit).
    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    /// Stops accepting, lets in-flight requests finish (within the drain timeout), and waits.
    pub fn shutdown(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.wait()
    }

    /// Waits until the server has stopped (after its shutdown future completed, or after the
    /// scheduler stopped on its own: then its error).
    pub fn wait(mut self) -> Result<()> {
        match self.http.take().map(std::thread::JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(ServeError::Runtime("the HTTP thread panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(http) = self.http.take() {
            let _ = http.join();
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Serves until `shutdown` completes or the scheduler exits, then drains: the queue is closed
/// (new generation requests get 503), connections finish their request in flight, and after
/// `drain_timeout` what is left is failed.
async fn serve(
    listener: std::net::TcpListener,
    app: axum::Router,
    queue: Arc<Queue>,
    connections: Connections,
    shutdown: impl Future<Output = ()> + Send + 'static,
    scheduler_exited: tokio::sync::oneshot::Receiver<()>,
    drain_timeout: Duration,
) -> Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)
        .map_err(|e| ServeError::Runtime(format!("listener: {e}")))?;
    tokio::select! {
        () = connections.accept_loop(&listener, &app) => {}
        () = shutdown => {}
        _ = scheduler_exited => {}
    }
    drop(listener);
    // New generation requests get 503 from now on; queued and running ones finish.
    queue.close();
    connections.shutdown();
    if tokio::time::timeout(drain_timeout, connections.closed())
        .await
        .is_err()
    {
        // Out of time: fail what is left so its connections end, then stop.
        queue.abort();
        let _ = tokio::time::timeout(Duration::from_secs(5), connections.closed()).await;
    }
    // The scheduler exits once the queue is closed and empty.
    queue.close();
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
