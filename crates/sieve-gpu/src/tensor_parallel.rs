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
//! At world size 1 the single rank is the one-GPU model as packed, with no communicator: the
//! step is the one-GPU step. Above 1 the heads and the MLP width must split evenly.

use crate::error::{GpuError, Result};
use crate::matrix::Layouts;
use crate::runner::GpuModel;
use sieve_cuda::collective;
use sieve_cuda::sampling::SampleArgs;
use sieve_cuda::KvPrecision;
use sieve_model::config::ModelConfig;
use sieve_model::llama::tensor_parallel::{CommVolume, ShardLayout, TensorParallelModel};
use sieve_model::llama::Model;
use std::any::Any;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// A call of every rank's model ([`TensorParallelGpu::on_every_rank`]).
type RankCall = Arc<dyn Fn(&mut GpuModel) -> Result<Box<dyn Any + Send>> + Send + Sync>;

enum Command {
    Prefill(Vec<u32>),
    Next,
    Sampling(SampleArgs),
    TimeAllReduces(usize),
    Call(RankCall),
}

enum Answer {
    Token(u32),
    Micros(Option<f64>),
    Done,
    Value(Box<dyn Any + Send>),
}

struct Worker {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    /// Left behind on drop (not joined): its rank never answered, stuck in a collective.
    abandon: bool,
}

/// The least time the other ranks get to answer once one has ([`TensorParallelGpu::every_rank`]).
const STRAGGLERS_AT_LEAST: std::time::Duration = std::time::Duration::from_secs(60);

/// A rank's answer to a command.
struct Reply {
    rank: usize,
    answer: Result<Answer>,
    /// The command panicked (the answer is the panic's message): the rank's state is unknown.
    panicked: bool,
}

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
    /// Every rank's answers.
    answers: Receiver<Reply>,
    config: ModelConfig,
    capacity: usize,
    /// Positions in the ranks' caches (as [`GpuModel::len`]).
    len: usize,
    /// Why the ranks can no longer be used together (a rank failed, another never answered).
    stuck: Option<String>,
    /// KV cache slots of every rank ([`GpuModel::set_slots`], set through
    /// [`Self::on_every_rank`] and recorded with [`Self::set_slot_count`]).
    slots: usize,
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
        // What the split needs of the model, and the GPUs, before the slow work of cutting.
        ShardLayout::new(model.config(), world)?;
        if !model.config().intermediate_size.is_multiple_of(world) {
            return Err(uneven_mlp(model.config(), world));
        }
        let ranks = collective::open_ranks(world)?;
        let mut models = Vec::with_capacity(world);
        if world == 1 {
            // One rank is the one-GPU model, as packed (no cut and re-encoding).
            for rank in ranks {
                let g = GpuModel::from_model_with_layouts(rank.gpu, model, capacity, kv, layouts)?;
                models.push((g, rank.comm));
            }
        } else {
            let shards = TensorParallelModel::shard(model, world)?;
            for (r, rank) in ranks.into_iter().enumerate() {
                let g = GpuModel::from_shard(rank.gpu, &shards, r, capacity, kv, layouts)?;
                models.push((g, rank.comm));
            }
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
        if !config.intermediate_size.is_multiple_of(world) {
            return Err(uneven_mlp(&config, world));
        }
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
        let (outbox, answers) = channel();
        for (r, (mut g, comm)) in models.into_iter().enumerate() {
            g.set_tensor_parallel(comm)?;
            weights.push(g.report().weight_bytes);
            caches.push(g.report().kv_cache_bytes);
            capacity = capacity.min(g.capacity());
            workers.push(Worker::spawn(r, g, outbox.clone())?);
        }
        // Only the workers hold senders: if every thread is gone, receiving says so.
        drop(outbox);
        // The LM head is whole on every rank: no logits cross GPUs, only the all-reduces.
        let volume = CommVolume::per_token(
            &ModelConfig {
                vocab_size: 0,
                ..config.clone()
            },
            world,
            4,
        );
        let mut split = Self {
            workers,
            answers,
            capacity,
            len: 0,
            stuck: None,
            slots: 1,
            report: TensorParallelReport {
                world,
                rank_weight_bytes: weights,
                rank_kv_bytes: caches,
                volume,
            },
            config,
        };
        // The first collectives eagerly on every rank, before any rank captures a graph with
        // them in it.
        split.all_reduce_us_per_step(1)?;
        Ok(split)
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
    pub fn slot_count(&self) -> usize {
        self.slots
    }
    /// Records the slots every rank now has (after their `set_slots` through
    /// [`Self::on_every_rank`]).
    pub fn set_slot_count(&mut self, slots: usize) {
        self.slots = slots;
    }
    pub fn report(&self) -> &TensorParallelReport {
        &self.report
    }

    /// Gives every rank `command()` and collects their answers in rank order.
    ///
    /// The ranks do the same work and meet in its collectives, so once one has answered the
    /// others follow closely. A rank that failed before a collective leaves its peers waiting
    /// in it on their GPUs, where only their own threads may end their communicators (NCCL
    /// forbids ending one another thread is calling). So after the first answer the others
    /// get twice the time it took, at least [`STRAGGLERS_AT_LEAST`]; a rank that still has not
    /// answered is left behind (its thread not joined on drop) and the split is given up with
    /// the reason. It is also given up when the ranks ended differently (some failed, or one
    /// panicked): only a request every rank refused alike (the same error on each) leaves it
    /// usable.
    fn every_rank(&mut self, command: impl Fn() -> Command) -> Result<Vec<Answer>> {
        if let Some(why) = &self.stuck {
            return Err(GpuError::InvalidArgument(format!(
                "the split model is unusable: {why}"
            )));
        }
        let world = self.workers.len();
        for r in 0..world {
            if self.workers[r].commands.send(command()).is_err() {
                return Err(self.give_up(format!("rank {r}'s thread has stopped")));
            }
        }
        let start = std::time::Instant::now();
        let mut got: Vec<Option<Reply>> = (0..world).map(|_| None).collect();
        let mut received = 0;
        let mut deadline: Option<std::time::Instant> = None;
        while received < world {
            let next = match deadline {
                None => self
                    .answers
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => self
                    .answers
                    .recv_timeout(d.saturating_duration_since(std::time::Instant::now())),
            };
            let Ok(reply) = next else { break };
            if deadline.is_none() {
                let wait = (start.elapsed() * 2).max(STRAGGLERS_AT_LEAST);
                deadline = Some(std::time::Instant::now() + wait);
            }
            let r = reply.rank;
            if got[r].replace(reply).is_none() {
                received += 1;
            }
        }
        if received == world && got.iter().flatten().all(|reply| reply.answer.is_ok()) {
            return Ok(got
                .into_iter()
                .flatten()
                .filter_map(|reply| reply.answer.ok())
                .collect());
        }
        let missing: Vec<usize> = (0..world).filter(|&r| got[r].is_none()).collect();
        let replies: Vec<Reply> = got.into_iter().flatten().collect();
        let panicked = replies.iter().any(|reply| reply.panicked);
        let errors: Vec<(usize, GpuError)> = replies
            .into_iter()
            .filter_map(|reply| reply.answer.err().map(|e| (reply.rank, e)))
            .collect();
        let alike = errors.len() == world
            && !panicked
            && errors
                .iter()
                .all(|(_, e)| e.to_string() == errors[0].1.to_string());
        let mut errors = errors.into_iter();
        let (rank, first) = errors.next().unwrap_or((0, stopped()));
        if alike {
            return Err(first);
        }
        for &r in &missing {
            self.workers[r].abandon = true;
        }
        let others = errors.len();
        Err(self.give_up(format!(
            "rank {rank} failed ({first}){}{}",
            if others > 0 {
                format!(", and {others} other rank(s)")
            } else {
                String::new()
            },
            if missing.is_empty() {
                String::new()
            } else {
                format!("; ranks {missing:?} never answered (waiting in a collective)")
            }
        )))
    }

    /// Marks the split unusable and returns the error saying why; no rank's thread is joined
    /// on drop from here on (one may wait in a collective forever).
    pub fn give_up(&mut self, why: String) -> GpuError {
        self.stuck = Some(why.clone());
        for w in &mut self.workers {
            w.abandon = true;
        }
        GpuError::InvalidArgument(format!("tensor parallelism: {why}"))
    }

    /// The ranks' tokens, which must agree (if not, their histories differ from here on and
    /// the split is given up).
    fn agreed_token(&mut self, answers: Vec<Answer>) -> Result<u32> {
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
            _ => Err(self.give_up(format!(
                "the ranks chose different tokens ({tokens:?}): their logits differ"
            ))),
        }
    }

    /// Runs `prompt` from position 0 on every rank and returns the first token sampled.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<u32> {
        self.len = 0;
        let answers = self.every_rank(|| Command::Prefill(prompt.to_vec()))?;
        let token = self.agreed_token(answers)?;
        self.len = prompt.len();
        Ok(token)
    }

    /// One decode step on every rank: the next token.
    pub fn next_token(&mut self) -> Result<u32> {
        let answers = self.every_rank(|| Command::Next)?;
        let token = self.agreed_token(answers)?;
        self.len += 1;
        Ok(token)
    }

    /// The sampling rule of every rank (the same seed on each, so they draw the same token).
    pub fn set_sampling(&mut self, args: SampleArgs) -> Result<()> {
        self.every_rank(|| Command::Sampling(args)).map(|_| ())
    }

    /// `call` on every rank's model at once (each in its thread), the answers in rank order:
    /// how a caller runs any [`GpuModel`] method over the split (the serving engine's slot
    /// calls). Every rank must make the same collectives: `call` must do the same on each.
    pub fn on_every_rank<T: Send + 'static>(
        &mut self,
        call: impl Fn(&mut GpuModel) -> Result<T> + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        let call: RankCall =
            Arc::new(move |m: &mut GpuModel| call(m).map(|v| Box::new(v) as Box<dyn Any + Send>));
        self.every_rank(|| Command::Call(call.clone()))?
            .into_iter()
            .map(|a| match a {
                Answer::Value(v) => v.downcast::<T>().map(|b| *b).map_err(|_| {
                    GpuError::InvalidArgument("a rank answered with another type".into())
                }),
                _ => Err(GpuError::InvalidArgument(
                    "a rank answered out of turn".into(),
                )),
            })
            .collect()
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

/// The GPU split takes equal MLP slices: every rank's matrices then have the same shapes, so
/// the shape-dependent choices of the runner (batched passes, kernel paths) are the same on
/// every rank and their collectives pair up.
fn uneven_mlp(config: &ModelConfig, world: usize) -> GpuError {
    GpuError::Unsupported(format!(
        "--tensor-parallel {world}: the MLP width {} must split evenly over the GPUs (equal \
         slices keep every rank's kernel choices, and so its all-reduces, the same)",
        config.intermediate_size
    ))
}

fn stopped() -> GpuError {
    GpuError::InvalidArgument("a tensor-parallel rank's thread stopped".into())
}

impl Worker {
    fn spawn(rank: usize, mut model: GpuModel, outbox: Sender<Reply>) -> Result<Self> {
        let (commands, inbox) = channel::<Command>();
        let thread = std::thread::Builder::new()
            .name(format!("sieve-rank-{rank}"))
            .spawn(move || {
                for command in inbox {
                    // A panic answers as an error (the driver must hear from every rank).
                    let run = std::panic::AssertUnwindSafe(|| match command {
                        Command::Prefill(prompt) => model.prefill(&prompt).map(Answer::Token),
                        Command::Next => model.next_token().map(Answer::Token),
                        Command::Sampling(args) => {
                            model.set_sampling(args);
                            Ok(Answer::Done)
                        }
                        Command::TimeAllReduces(reps) => {
                            model.time_all_reduces(reps).map(Answer::Micros)
                        }
                        Command::Call(call) => call(&mut model).map(Answer::Value),
                    });
                    let reply = match std::panic::catch_unwind(run) {
                        Ok(answer) => Reply {
                            rank,
                            answer,
                            panicked: false,
                        },
                        Err(panic) => {
                            let what = panic
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| panic.downcast_ref::<String>().cloned())
                                .unwrap_or_default();
                            Reply {
                                rank,
                                answer: Err(GpuError::InvalidArgument(format!(
                                    "rank {rank} panicked: {what}"
                                ))),
                                panicked: true,
                            }
                        }
                    };
                    if outbox.send(reply).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| {
                GpuError::InvalidArgument(format!("starting rank {rank}'s thread: {e}"))
            })?;
        Ok(Self {
            commands,
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
