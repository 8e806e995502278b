//! Tensor-parallel decode on the GPUs of one machine (issue 31): the model split as
//! `sieve_model::llama::tensor_parallel` describes (and runs on the CPU as the reference), one
//! [`GpuModel`] per rank, each driven by a thread of its own.
//!
//! ```text
//!   caller ── command ──▶ thread 0: GpuModel of shard 0 (GPU 0) ──┐ the all-reduces after o
//!          ── command ──▶ thread 1: GpuModel of shard 1 (GPU 1) ──┤ and down, inside each
//!          ◀── replies ── (each rank's token, checked to agree)   ┘ rank's graph (NCCL)
//! ```
//!
//! Every rank gets every command, in the same order, so their collectives pair up. Each rank
//! computes the whole LM head (it is replicated, not split: 2% of a 7B step's bytes per rank,
//! and no all-gather of logits) and samples from logits that are the same on every rank
//! (the all-reduce leaves the same sums everywhere), so the ranks choose the same token; the
//! driver checks that they did and fails the step if not.
//!
//! Why threads, not processes: one process holds the host model once and splits it once; a
//! thread per rank lets each enqueue its prompt pass and its graph replays at the same time,
//! which NCCL needs (a rank's all-reduce waits for its peers' inside the GPU), and leaves
//! `GpuModel` unchanged but for its two all-reduces.
//!
//! At world size 1 the single rank has no communicator at all: the step is the one-GPU step.

use crate::error::{GpuError, Result};
use crate::matrix::Layouts;
use crate::runner::GpuModel;
use sieve_cuda::collective;
use sieve_cuda::sampling::SampleArgs;
use sieve_cuda::KvPrecision;
use sieve_model::config::ModelConfig;
use sieve_model::llama::tensor_parallel::{CommVolume, ShardLayout, TensorParallelModel};
use sieve_model::llama::Model;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

enum Command {
    Prefill(Vec<u32>),
    Next,
    Sampling(SampleArgs),
    TimeAllReduces(usize),
}

enum Answer {
    Token(u32),
    Micros(Option<f64>),
    Done,
}

struct Worker {
    commands: Sender<Command>,
    answers: Receiver<Result<Answer>>,
    thread: Option<JoinHandle<()>>,
    /// Left behind on drop (not joined): its rank is stuck in a collective.
    abandon: bool,
}

/// How long the other ranks get to answer once one rank has failed.
const STUCK_AFTER_A_FAILURE: std::time::Duration = std::time::Duration::from_secs(20);

/// What a tensor-parallel model holds and moves, for the report.
#[derive(Clone, Debug)]
pub struct TensorParallelReport {
    pub world: usize,
    /// Weight bytes on each rank's GPU (its shard, the replicated embeddings and LM head).
    pub rank_weight_bytes: Vec<usize>,
    /// KV cache bytes on each rank (its KV heads).
    pub rank_kv_bytes: Vec<usize>,
    /// What each rank sends per decode step (f32 partial sums, ring all-reduce).
    pub volume: CommVolume,
}

/// A model split over `world` GPUs ([module notes](self)).
pub struct TensorParallelGpu {
    workers: Vec<Worker>,
    config: ModelConfig,
    capacity: usize,
    /// Positions in the ranks' caches (as [`GpuModel::len`]).
    len: usize,
    /// Why the ranks can no longer be used together (a rank failed, another never answered).
    stuck: Option<String>,
    report: TensorParallelReport,
}

impl TensorParallelGpu {
    /// Splits `model` over GPUs `0..world` (heads and KV heads must divide by `world`: the
    /// error names what does not) and uploads each rank's shard with a KV cache of `capacity`
    /// positions stored as `kv` says.
    pub fn new(
        model: &Model,
        world: usize,
        capacity: usize,
        kv: KvPrecision,
        layouts: Layouts,
    ) -> Result<Self> {
        let shards = TensorParallelModel::shard(model, world)?;
        let ranks = collective::open_ranks(world)?;
        let mut models = Vec::with_capacity(world);
        for (r, rank) in ranks.into_iter().enumerate() {
            let g = GpuModel::from_shard(rank.gpu, &shards, r, capacity, kv, layouts)?;
            models.push((g, rank.comm));
        }
        Self::from_ranks(model.config().clone(), models)
    }

    /// The synthetic model `name` (`crate::synthetic`) split over GPUs `0..world`, each rank's
    /// slices generated on its own (`synthetic::build_shard`: `opts.dp` must be 0).
    pub fn synthetic(
        name: &str,
        opts: &crate::synthetic::SyntheticOptions,
        world: usize,
        capacity: usize,
        kv: KvPrecision,
    ) -> Result<Self> {
        let config = crate::synthetic::config(name)?;
        let layout = ShardLayout::new(&config, world)?;
        let ranks = collective::open_ranks(world)?;
        let mut models = Vec::with_capacity(world);
        for (r, rank) in ranks.into_iter().enumerate() {
            let g = crate::synthetic::build_shard(rank.gpu, name, opts, capacity, kv, &layout, r)?;
            models.push((g, rank.comm));
        }
        Self::from_ranks(config, models)
    }

    /// Starts a thread per rank model (`config` is the whole model's).
    fn from_ranks(
        config: ModelConfig,
        models: Vec<(GpuModel, collective::Communicator)>,
    ) -> Result<Self> {
        let world = models.len();
        let (mut weights, mut caches) = (Vec::new(), Vec::new());
        let mut capacity = usize::MAX;
        let mut workers = Vec::with_capacity(world);
        for (r, (mut g, comm)) in models.into_iter().enumerate() {
            g.set_tensor_parallel(comm)?;
            weights.push(g.report().weight_bytes);
            caches.push(g.report().kv_cache_bytes);
            capacity = capacity.min(g.capacity());
            workers.push(Worker::spawn(r, g)?);
        }
        let volume = CommVolume::per_token(&config, world, 4);
        Ok(Self {
            workers,
            capacity,
            len: 0,
            stuck: None,
            report: TensorParallelReport {
                world,
                rank_weight_bytes: weights,
                rank_kv_bytes: caches,
                volume,
            },
            config,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn report(&self) -> &TensorParallelReport {
        &self.report
    }

    /// Gives every rank `command()` and collects their answers in rank order; the first
    /// rank's error if any failed.
    ///
    /// A rank that fails before its collective leaves the others waiting inside it on their
    /// GPUs: once one rank has failed, the others get [`STUCK_AFTER_A_FAILURE`] to answer, and
    /// if they do not, the split is marked stuck (its threads are left behind, not joined, on
    /// drop) and the error says so instead of hanging the caller.
    fn every_rank(&mut self, command: impl Fn() -> Command) -> Result<Vec<Answer>> {
        if let Some(why) = &self.stuck {
            return Err(GpuError::InvalidArgument(format!(
                "the split model is unusable: {why}"
            )));
        }
        for w in &self.workers {
            w.commands.send(command()).map_err(|_| stopped())?;
        }
        let mut answers = Vec::with_capacity(self.workers.len());
        let mut first_error: Option<(usize, GpuError)> = None;
        for (r, w) in self.workers.iter().enumerate() {
            let answer = if first_error.is_some() {
                match w.answers.recv_timeout(STUCK_AFTER_A_FAILURE) {
                    Ok(a) => a,
                    Err(_) => {
                        let (failed, e) = first_error.take().unwrap_or((r, stopped()));
                        let why = format!(
                            "rank {failed} failed ({e}) and rank {r} did not answer within {} s \
                             (it waits in a collective for the failed rank)",
                            STUCK_AFTER_A_FAILURE.as_secs()
                        );
                        self.stuck = Some(why.clone());
                        for w in &mut self.workers {
                            w.abandon = true;
                        }
                        return Err(GpuError::InvalidArgument(why));
                    }
                }
            } else {
                w.answers.recv().map_err(|_| stopped())?
            };
            match answer {
                Ok(a) => answers.push(a),
                Err(e) => {
                    first_error.get_or_insert((r, e));
                }
            }
        }
        match first_error {
            Some((_, e)) => Err(e),
            None => Ok(answers),
        }
    }

    /// The ranks' tokens, which must agree.
    fn agreed_token(answers: Vec<Answer>) -> Result<u32> {
        let tokens: Vec<u32> = answers
            .into_iter()
            .map(|a| match a {
                Answer::Token(t) => Ok(t),
                _ => Err(GpuError::InvalidArgument(
                    "a rank answered out of turn".into(),
                )),
            })
            .collect::<Result<_>>()?;
        match tokens.first() {
            Some(&t) if tokens.iter().all(|&u| u == t) => Ok(t),
            _ => Err(GpuError::InvalidArgument(format!(
                "the ranks chose different tokens ({tokens:?}): their logits differ"
            ))),
        }
    }

    /// Runs `prompt` from position 0 on every rank and returns the first token sampled.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<u32> {
        self.len = 0;
        let token = Self::agreed_token(self.every_rank(|| Command::Prefill(prompt.to_vec()))?)?;
        self.len = prompt.len();
        Ok(token)
    }

    /// One decode step on every rank: the next token.
    pub fn next_token(&mut self) -> Result<u32> {
        let token = Self::agreed_token(self.every_rank(|| Command::Next)?)?;
        self.len += 1;
        Ok(token)
    }

    /// The sampling rule of every rank (the same seed on each, so they draw the same token).
    pub fn set_sampling(&mut self, args: SampleArgs) -> Result<()> {
        self.every_rank(|| Command::Sampling(args)).map(|_| ())
    }

    /// Microseconds of one decode step's all-reduces, the slowest rank's (None at world 1).
    pub fn all_reduce_us_per_step(&mut self, reps: usize) -> Result<Option<f64>> {
        let answers = self.every_rank(|| Command::TimeAllReduces(reps))?;
        Ok(answers
            .into_iter()
            .filter_map(|a| match a {
                Answer::Micros(us) => us,
                _ => None,
            })
            .reduce(f64::max))
    }
}

fn stopped() -> GpuError {
    GpuError::InvalidArgument("a tensor-parallel rank's thread stopped".into())
}

impl Worker {
    fn spawn(rank: usize, mut model: GpuModel) -> Result<Self> {
        let (commands, inbox) = channel::<Command>();
        let (outbox, answers) = channel::<Result<Answer>>();
        let thread = std::thread::Builder::new()
            .name(format!("sieve-rank-{rank}"))
            .spawn(move || {
                for command in inbox {
                    let answer = match command {
                        Command::Prefill(prompt) => model.prefill(&prompt).map(Answer::Token),
                        Command::Next => model.next_token().map(Answer::Token),
                        Command::Sampling(args) => {
                            model.set_sampling(args);
                            Ok(Answer::Done)
                        }
                        Command::TimeAllReduces(reps) => {
                            model.time_all_reduces(reps).map(Answer::Micros)
                        }
                    };
                    if outbox.send(answer).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| {
                GpuError::InvalidArgument(format!("starting rank {rank}'s thread: {e}"))
            })?;
        Ok(Self {
            commands,
            answers,
            thread: Some(thread),
            abandon: false,
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the command channel ends the thread's loop; its model (and communicator)
        // is dropped there.
        let (dead, _) = channel();
        drop(std::mem::replace(&mut self.commands, dead));
        if let Some(t) = self.thread.take() {
            if !self.abandon {
                let _ = t.join();
            }
        }
    }
}
