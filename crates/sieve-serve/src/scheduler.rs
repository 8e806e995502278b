//! Continuous batching. One scheduler thread owns the [`DecodeEngine`]: each iteration it
//! drops sequences whose client went away, admits waiting requests into free cache slots,
//! runs up to `prefill_chunk` prompt tokens of the admitted prompts (a long prompt goes in
//! chunks of that size over several iterations, so it holds up the running sequences' next
//! token by one chunk's time, not its whole prefill; the step's chunks reach the engine in one
//! call, which the GPU engine runs as one batched pass), then runs one batched decode step over
//! every running sequence. A finished sequence leaves the batch and frees its slot at once;
//! waiting requests sit in a bounded [`Queue`].
//!
//! Chunk boundaries are fixed by the prompt alone, never by the load, so a request's tokens do
//! not depend on what else runs: a prompt longer than `prefill_chunk` is cut into the fewest
//! chunks of at most that size, equal within one token ([`chunk_ends`]). None is tiny, so every
//! chunk runs the kernels a whole prompt runs (the CPU switches to its 8-token batch kernel
//! below 9 tokens: with `prefill_chunk` of 18 or more a chunked prompt's answer equals the
//! whole prompt's).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use sieve_model::generate::{GenerateOptions, StopReason};
use sieve_model::sequence::Sequence;
use sieve_model::tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::{DecodeEngine, PromptChunk, RowSampling};
use crate::metrics::Metrics;

/// What the scheduler sends back for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Text that is safe to show.
    Text(String),
    /// Generation ended normally.
    Done {
        reason: StopReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// Generation failed (the message is for the client).
    Failed(String),
}

/// One admitted request.
pub struct Job {
    pub prompt: Vec<u32>,
    pub options: GenerateOptions,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

/// Why a job was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejected {
    Full,
    ShuttingDown,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The bounded queue between the HTTP handlers and the scheduler. Admission counts free cache
/// slots too: a job is refused only when the jobs already waiting fill every free slot and the
/// queue's own `capacity` beyond them, so a burst no larger than the pool is never refused
/// while slots are free.
pub struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
    capacity: usize,
    metrics: Arc<Metrics>,
    /// Set when draining ran out of time: running sequences are failed and the loop exits.
    abort: AtomicBool,
    /// Cache slots not held by a running sequence (published by the scheduler).
    free_slots: AtomicUsize,
    /// True while the scheduler thread runs ([`SchedulerLife`]).
    alive: AtomicBool,
}

impl Queue {
    pub fn new(capacity: usize, metrics: Arc<Metrics>) -> Self {
        Self {
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
            capacity,
            metrics,
            abort: AtomicBool::new(false),
            free_slots: AtomicUsize::new(0),
            alive: AtomicBool::new(false),
        }
    }

    /// Whether the scheduler thread is running (false before it started and after it ended,
    /// normally or not).
    pub fn scheduler_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    fn set_free_slots(&self, free: usize) {
        self.free_slots.store(free, Ordering::Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job`, or refuses it when the queue is full or closed.
    pub fn submit(&self, job: Job) -> Result<(), Rejected> {
        let mut s = self.lock();
        if s.closed {
            return Err(Rejected::ShuttingDown);
        }
        let free = self.free_slots.load(Ordering::Relaxed);
        if s.jobs.len() >= self.capacity.saturating_add(free) {
            return Err(Rejected::Full);
        }
        s.jobs.push_back(job);
        self.metrics
            .queue_depth
            .store(s.jobs.len() as u64, Ordering::Relaxed);
        self.ready.notify_one();
        Ok(())
    }

    /// Refuses new jobs from now on; queued ones are still served.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    pub fn is_empty(&self) -> bool {
        self.lock().jobs.is_empty()
    }

    /// Stops the scheduler without finishing its work (after a drain timeout).
    pub fn abort(&self) {
        self.abort.store(true, Ordering::SeqCst);
        self.close();
    }

    fn aborted(&self) -> bool {
        self.abort.load(Ordering::SeqCst)
    }

    /// The next job if its prompt has at most `max_prompt` tokens; with `wait`, blocks until
    /// there is a job or the queue is closed and empty.
    fn pop(&self, wait: bool, max_prompt: usize) -> Option<Job> {
        let mut s = self.lock();
        loop {
            if s.jobs.front().is_some_and(|j| j.prompt.len() > max_prompt) {
                return None;
            }
            if let Some(job) = s.jobs.pop_front() {
                self.metrics
                    .queue_depth
                    .store(s.jobs.len() as u64, Ordering::Relaxed);
                return Some(job);
            }
            if !wait || s.closed {
                return None;
            }
            s = self.ready.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Every queued job (for an abort).
    fn drain(&self) -> Vec<Job> {
        let mut s = self.lock();
        let jobs = s.jobs.drain(..).collect();
        self.metrics.queue_depth.store(0, Ordering::Relaxed);
        jobs
    }
}

/// Marks the scheduler alive for as long as it lives. Dropped when the scheduler thread ends
/// for any reason (its loop returned, a panic unwound it): the queue is closed, jobs still
/// queued are failed with a message, and `/health` reports it, so no request waits for a
/// scheduler that is gone.
pub struct SchedulerLife<'q> {
    queue: &'q Queue,
}

impl<'q> SchedulerLife<'q> {
    pub fn start(queue: &'q Queue) -> Self {
        queue.alive.store(true, Ordering::SeqCst);
        queue.metrics.scheduler_up.store(1, Ordering::Relaxed);
        Self { queue }
    }
}

impl Drop for SchedulerLife<'_> {
    fn drop(&mut self) {
        let queue = self.queue;
        queue.alive.store(false, Ordering::SeqCst);
        queue.metrics.scheduler_up.store(0, Ordering::Relaxed);
        queue.set_free_slots(0);
        queue.close();
        for job in queue.drain() {
            let _ = job.events.send(Event::Failed(
                "the server's model scheduler stopped before this started".into(),
            ));
        }
    }
}

/// Prompt tokens prefilled per scheduler step by default (`--prefill-chunk`): bounds how long
/// one step's prefills hold up the running sequences' next token.
pub const PREFILL_CHUNK: usize = 256;

/// A request whose prompt is being prefilled into its slot, chunk by chunk.
struct Prefilling<'t> {
    slot: usize,
    job: Job,
    sequence: Sequence<'t>,
    /// Where each chunk of the prompt ends ([`chunk_ends`]).
    ends: Vec<usize>,
    /// Chunks already in the slot.
    chunks_done: usize,
    /// When its first chunk ran.
    admitted: Option<Instant>,
}

impl Prefilling<'_> {
    /// Prompt tokens already in the slot.
    fn done(&self) -> usize {
        match self.chunks_done {
            0 => 0,
            i => self.ends[i - 1],
        }
    }
}

/// The ends of the chunks a prompt of `len` tokens is prefilled in: the fewest chunks of at
/// most `chunk` tokens, their sizes equal within one token (the longer ones first).
pub fn chunk_ends(len: usize, chunk: usize) -> Vec<usize> {
    let count = len.div_ceil(chunk.max(1)).max(1);
    let (base, longer) = (len / count, len % count);
    let mut end = 0;
    (0..count)
        .map(|i| {
            end += base + usize::from(i < longer);
            end
        })
        .collect()
}

/// A sequence in the running batch.
struct Running<'t> {
    slot: usize,
    sequence: Sequence<'t>,
    events: UnboundedSender<Event>,
    /// The last sampled token, to be run next.
    next: u32,
    prompt_tokens: usize,
    /// Positions this sequence may use: its prompt plus `max_tokens`, within the slot.
    limit: usize,
    admitted: Instant,
    last_token: Instant,
}

/// Runs until the queue is closed and every job is done (or the queue is aborted). Each
/// iteration prefills at most `prefill_chunk` prompt tokens (at least one chunk).
pub fn run(
    engine: &mut dyn DecodeEngine,
    tokenizer: &Tokenizer,
    queue: &Queue,
    metrics: &Metrics,
    prefill_chunk: usize,
) {
    let prefill_chunk = prefill_chunk.max(1);
    let slots = engine.slots();
    metrics.slots_total.store(slots as u64, Ordering::Relaxed);
    metrics
        .kv_cache_bytes
        .store(engine.kv_cache_bytes() as u64, Ordering::Relaxed);
    let mut free: Vec<usize> = (0..slots).rev().collect();
    let mut running: Vec<Running<'_>> = Vec::new();
    let mut prefilling: VecDeque<Prefilling<'_>> = VecDeque::new();
    // Slots in use: the running sequences' and the prompts being prefilled.
    let publish = |running: &Vec<Running<'_>>, prefilling: &VecDeque<Prefilling<'_>>| {
        metrics
            .running
            .store(running.len() as u64, Ordering::Relaxed);
        metrics
            .prefilling
            .store(prefilling.len() as u64, Ordering::Relaxed);
        let in_use = running.len() + prefilling.len();
        metrics.slots_in_use.store(in_use as u64, Ordering::Relaxed);
        queue.set_free_slots(slots.saturating_sub(in_use));
    };
    publish(&running, &prefilling);
    loop {
        if queue.aborted() {
            for r in running.drain(..) {
                let _ = r.events.send(Event::Failed(
                    "the server shut down before this finished".into(),
                ));
            }
            for p in prefilling.drain(..) {
                let _ = p.job.events.send(Event::Failed(
                    "the server shut down before this started".into(),
                ));
            }
            for job in queue.drain() {
                let _ = job.events.send(Event::Failed(
                    "the server shut down before this started".into(),
                ));
            }
            publish(&running, &prefilling);
            return;
        }
        // Clients that went away: stop their generation (or prefill) and free their slot.
        running.retain(|r| {
            let gone = r.events.is_closed();
            if gone {
                free.push(r.slot);
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            !gone
        });
        prefilling.retain(|p| {
            let gone = p.job.events.is_closed();
            if gone {
                free.push(p.slot);
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            !gone
        });
        publish(&running, &prefilling);

        // Busy time: from here when there is work (the admissions below then never wait),
        // else from the end of the admissions, where an idle scheduler waits.
        let busy_since = (!running.is_empty() || !prefilling.is_empty()).then(Instant::now);

        // Admissions: every waiting request a free slot can take; with nothing else to do,
        // wait for one.
        while let Some(&slot) = free.last() {
            let idle = running.is_empty() && prefilling.is_empty();
            let Some(job) = queue.pop(idle, usize::MAX) else {
                break;
            };
            if job.events.is_closed() {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let chunk = engine.prefills_in_chunks().then_some(prefill_chunk);
            if let Some(p) = start_prefill(tokenizer, job, slot, engine.slot_capacity(), chunk) {
                free.pop();
                prefilling.push_back(p);
            }
            publish(&running, &prefilling);
        }

        let _busy = BusyTimer {
            since: busy_since.unwrap_or_else(Instant::now),
            nanos: &metrics.busy_nanos,
        };

        // Prefill: one chunk each of the admitted prompts in admission order, up to
        // `prefill_chunk` tokens this step (always at least one chunk); a prompt whose next
        // chunk does not fit what is left waits for the next step, and shorter ones behind it
        // may use the rest. The step's chunks go to the engine together, which may run them
        // in one pass (each on its own slot).
        let mut budget = prefill_chunk;
        let mut picked: Vec<usize> = Vec::new();
        for (i, p) in prefilling.iter_mut().enumerate() {
            if budget == 0 {
                break;
            }
            let chunk = p.ends[p.chunks_done] - p.done();
            if !picked.is_empty() && chunk > budget {
                continue;
            }
            budget = budget.saturating_sub(chunk);
            p.admitted.get_or_insert_with(Instant::now);
            picked.push(i);
        }
        if !picked.is_empty() {
            let chunks: Vec<PromptChunk<'_>> = picked
                .iter()
                .map(|&i| {
                    let p = &prefilling[i];
                    let (start, end) = (p.done(), p.ends[p.chunks_done]);
                    PromptChunk {
                        slot: p.slot,
                        start,
                        tokens: &p.job.prompt[start..end],
                        last: end == p.job.prompt.len(),
                    }
                })
                .collect();
            let started = Instant::now();
            let mut results = engine.prefill_chunks(&chunks);
            Metrics::add_time(&metrics.prefill_nanos, started.elapsed());
            // One result per chunk, logits exactly for the prompts' last chunks: an engine
            // that breaks this fails the requests concerned, not the scheduler.
            results.truncate(chunks.len());
            results.resize_with(chunks.len(), || {
                Err(sieve_model::ModelError::Device(
                    "the engine returned no result for this prompt chunk".into(),
                ))
            });
            for (result, chunk) in results.iter_mut().zip(&chunks) {
                let broken = match result {
                    Ok(None) if chunk.last => "no logits for a prompt's last chunk",
                    Ok(Some(_)) if !chunk.last => "logits for a chunk that is not a prompt's last",
                    _ => continue,
                };
                *result = Err(sieve_model::ModelError::Device(format!(
                    "the engine returned {broken}"
                )));
            }
            drop(chunks);
            // In admission order; `removed` counts the prompts taken out before index i.
            let mut removed = 0;
            for (&i, result) in picked.iter().zip(results) {
                let at = i - removed;
                match result {
                    Err(e) => {
                        if let Some(p) = prefilling.remove(at) {
                            removed += 1;
                            let _ = p
                                .job
                                .events
                                .send(Event::Failed(format!("prefill failed: {e}")));
                            free.push(p.slot);
                        }
                    }
                    Ok(None) => {
                        metrics.prefill_chunks.fetch_add(1, Ordering::Relaxed);
                        prefilling[at].chunks_done += 1;
                    }
                    Ok(Some(logits)) => {
                        metrics.prefill_chunks.fetch_add(1, Ordering::Relaxed);
                        if let Some(p) = prefilling.remove(at) {
                            removed += 1;
                            let slot = p.slot;
                            match finish_prefill(engine, metrics, p, &logits) {
                                Some(r) => running.push(r),
                                None => free.push(slot),
                            }
                        }
                    }
                }
            }
            publish(&running, &prefilling);
        }

        if running.is_empty() {
            if prefilling.is_empty() && queue.is_closed() && queue.is_empty() {
                // Closed and empty: drained.
                return;
            }
            continue;
        }

        let batch: Vec<(usize, u32)> = running.iter().map(|r| (r.slot, r.next)).collect();
        metrics.observe_batch(batch.len());
        // The engine may choose the tokens itself (on its device): greedy batches by argmax,
        // others by each sequence's own sampling settings.
        let by_argmax = running.iter().all(|r| r.sequence.decodes_by_argmax());
        let started = Instant::now();
        let chosen = if by_argmax {
            engine.decode_argmax(&batch)
        } else {
            let sampling: Vec<RowSampling<'_>> = running
                .iter()
                .map(|r| RowSampling {
                    params: r.sequence.sampling(),
                    recent: r.sequence.recent_tokens(),
                })
                .collect();
            engine.decode_sampled(&batch, &sampling)
        };
        let outcome = match chosen {
            Some(Ok(tokens)) => {
                metrics.engine_chosen_steps.fetch_add(1, Ordering::Relaxed);
                Ok(Decoded::Tokens(tokens))
            }
            Some(Err(e)) => Err(e),
            None => engine.decode(&batch).map(Decoded::Logits),
        };
        Metrics::add_time(&metrics.decode_nanos, started.elapsed());
        let decoded = match outcome {
            Ok(d) => d,
            Err(e) => {
                for r in running.drain(..) {
                    let _ = r.events.send(Event::Failed(format!("decode failed: {e}")));
                    free.push(r.slot);
                }
                publish(&running, &prefilling);
                continue;
            }
        };
        // Each sequence's token: the engine's, or sampled here from its logits, every sequence
        // on its own pool thread (top-p over a large vocabulary sorts it: ~1 ms a sequence).
        let vocab = engine.vocab_size();
        let sampled: Vec<sieve_model::Result<u32>> = match decoded {
            Decoded::Tokens(tokens) => tokens,
            Decoded::Logits(logits) => {
                use rayon::prelude::*;
                running
                    .par_iter_mut()
                    .zip(logits.par_chunks(vocab))
                    .map(|(r, row)| r.sequence.sample(row))
                    .collect()
            }
        };
        let mut sampled = sampled.into_iter();
        running.retain_mut(|r| {
            let next = match sampled.next() {
                Some(Ok(token)) => Next::Token(token),
                Some(Err(e)) => Next::Failed(e),
                None => Next::Failed(sieve_model::ModelError::InvalidArgument(
                    "the decode step returned fewer rows than sequences".into(),
                )),
            };
            let room = engine.slot_len(r.slot) < r.limit;
            let keep = advance(r, next, room, metrics);
            if !keep {
                free.push(r.slot);
            }
            keep
        });
        publish(&running, &prefilling);
    }
}

/// Adds the time from `since` to `nanos` when dropped: one scheduler iteration's busy time,
/// whichever way the iteration ends.
struct BusyTimer<'m> {
    since: Instant,
    nanos: &'m AtomicU64,
}

impl Drop for BusyTimer<'_> {
    fn drop(&mut self) {
        Metrics::add_time(self.nanos, self.since.elapsed());
    }
}

/// Checks `job` and makes it a prompt to prefill into `slot` (of `capacity` positions) in
/// chunks of at most `chunk` tokens (`None`: whole); `None` when it is already done (its
/// answer or error sent).
fn start_prefill<'t>(
    tokenizer: &'t Tokenizer,
    job: Job,
    slot: usize,
    capacity: usize,
    chunk: Option<usize>,
) -> Option<Prefilling<'t>> {
    let sequence = match Sequence::new(tokenizer, &job.prompt, &job.options) {
        Ok(s) => s,
        Err(e) => {
            let _ = job.events.send(Event::Failed(e.to_string()));
            return None;
        }
    };
    if job.options.max_tokens == 0 {
        let _ = job.events.send(Event::Done {
            reason: StopReason::MaxTokens,
            prompt_tokens: job.prompt.len(),
            completion_tokens: 0,
        });
        return None;
    }
    if job.prompt.is_empty() {
        let _ = job
            .events
            .send(Event::Failed("the prompt has no tokens".into()));
        return None;
    }
    if job.prompt.len() > capacity {
        let _ = job.events.send(Event::Failed(format!(
            "the prompt has {} tokens; a cache slot holds {capacity}",
            job.prompt.len()
        )));
        return None;
    }
    Some(Prefilling {
        slot,
        ends: match chunk {
            Some(chunk) => chunk_ends(job.prompt.len(), chunk),
            None => vec![job.prompt.len()],
        },
        job,
        sequence,
        chunks_done: 0,
        admitted: None,
    })
}

/// A prompt fully in its slot: samples its first token from `logits` and makes it a running
/// sequence; `None` when it already finished.
fn finish_prefill<'t>(
    engine: &mut dyn DecodeEngine,
    metrics: &Metrics,
    p: Prefilling<'t>,
    logits: &[f32],
) -> Option<Running<'t>> {
    let prompt_tokens = p.job.prompt.len();
    let limit = (prompt_tokens + p.job.options.max_tokens).min(engine.slot_capacity());
    metrics
        .prompt_tokens
        .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
    let admitted = p.admitted.unwrap_or_else(Instant::now);
    let mut running = Running {
        slot: p.slot,
        sequence: p.sequence,
        events: p.job.events,
        next: 0,
        prompt_tokens,
        limit,
        admitted,
        last_token: admitted,
    };
    metrics.ttft.observe(p.job.enqueued.elapsed().as_secs_f64());
    let room = engine.slot_len(p.slot) < limit;
    advance(&mut running, Next::Logits(logits), room, metrics).then_some(running)
}

/// What a decode step gave the scheduler: every sequence's logits, or (greedy batches on an
/// engine that chooses them) every sequence's next token.
enum Decoded {
    Logits(Vec<f32>),
    /// One result per sequence: a bad row fails only its own sequence.
    Tokens(Vec<sieve_model::Result<u32>>),
}

/// One sequence's next token: logits to sample from, the token itself (chosen by the engine or
/// already sampled), or why there is none.
enum Next<'a> {
    Logits(&'a [f32]),
    Token(u32),
    Failed(sieve_model::ModelError),
}

/// Takes `r`'s next token (sampled here from its logits, or chosen by the engine) and sends
/// its text; `false` when `r` is finished (its last event sent) or failed.
fn advance(r: &mut Running<'_>, next: Next<'_>, room: bool, metrics: &Metrics) -> bool {
    let step = match next {
        Next::Logits(logits) => r.sequence.step(logits, room),
        Next::Token(token) => r.sequence.accept(token, room),
        Next::Failed(e) => Err(e),
    };
    let step = match step {
        Ok(s) => s,
        Err(e) => {
            let _ = r
                .events
                .send(Event::Failed(format!("sampling failed: {e}")));
            return false;
        }
    };
    metrics.completion_tokens.fetch_add(1, Ordering::Relaxed);
    let now = Instant::now();
    if r.sequence.generated_tokens() > 1 {
        metrics.tpot.observe((now - r.last_token).as_secs_f64());
    }
    r.last_token = now;
    r.next = step.token;
    if !step.text.is_empty() && r.events.send(Event::Text(step.text)).is_err() {
        // The client is gone; the next iteration frees the slot.
        return true;
    }
    match step.finished {
        Some(reason) => {
            metrics.latency.observe(r.admitted.elapsed().as_secs_f64());
            let _ = r.events.send(Event::Done {
                reason,
                prompt_tokens: r.prompt_tokens,
                completion_tokens: r.sequence.generated_tokens(),
            });
            false
        }
        None => true,
    }
}

/// Runs the scheduler for `engine` on the calling thread inside a rayon pool of `threads`
/// (see `sieve_model::generate::run_in_pool`: decode is much faster started from a worker).
pub fn run_in_pool(
    engine: &mut dyn DecodeEngine,
    tokenizer: &Tokenizer,
    queue: &Queue,
    metrics: &Metrics,
    threads: Option<usize>,
) -> sieve_model::Result<()> {
    sieve_model::generate::run_in_pool(threads, move || {
        run(engine, tokenizer, queue, metrics, PREFILL_CHUNK)
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn chunks_are_the_fewest_and_equal_within_one_token() {
        assert_eq!(super::chunk_ends(5, 256), vec![5]);
        assert_eq!(super::chunk_ends(256, 256), vec![256]);
        assert_eq!(super::chunk_ends(257, 256), vec![129, 257]);
        assert_eq!(super::chunk_ends(10, 3), vec![3, 6, 8, 10]);
        assert_eq!(super::chunk_ends(1, 1), vec![1]);
        for len in 1..200 {
            for chunk in 1..40 {
                let ends = super::chunk_ends(len, chunk);
                assert_eq!(ends.len(), len.div_ceil(chunk), "{len} {chunk}");
                assert_eq!(*ends.last().unwrap(), len);
                let sizes: Vec<usize> = ends
                    .iter()
                    .scan(0, |prev, &e| {
                        let size = e - *prev;
                        *prev = e;
                        Some(size)
                    })
                    .collect();
                let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(*hi <= chunk && hi - lo <= 1, "{len} {chunk}: {sizes:?}");
            }
        }
    }
}
