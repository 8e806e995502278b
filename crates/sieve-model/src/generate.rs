//! The generation loop: prefill the prompt, then decode, sample and stream text until an EOS
//! token, a stop string, the token limit or the end of the context. Written once
//! ([`generate_with`]) over a backend's [`Executor`]: the CPU's here ([`generate`]), the GPU's in
//! `sieve_gpu::generate`; perplexity likewise ([`perplexity_over`]).

use std::time::Instant;

use crate::error::{ModelError, Result};
use crate::llama::{KvCache, Logits, Model};
use crate::sampling::SamplingParams;
use crate::sequence::Sequence;
use crate::tokenizer::Tokenizer;
use crate::weights::{TensorSource, TokenizerSource};

/// Tokens the repetition penalty looks back over (prompt and generated text alike).
pub const REPETITION_WINDOW: usize = 64;

#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops before any of these strings; they are not part of the output.
    pub stop_strings: Vec<String>,
    /// Extra token ids that end generation besides the tokenizer's EOS ids.
    pub extra_eos_ids: Vec<u32>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            sampling: SamplingParams::greedy(),
            stop_strings: Vec::new(),
            extra_eos_ids: Vec::new(),
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    StopString,
    MaxTokens,
    /// The KV cache (the model's context) is full.
    ContextFull,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Wall time of the prompt's forward pass (and the first sample).
    pub prefill_seconds: f64,
    /// Single-token forward passes after the prefill, and their wall time (with sampling and
    /// detokenization).
    pub decode_steps: usize,
    pub decode_seconds: f64,
    /// Each decode step's forward pass alone (the backend's [`Executor::step`]), in order.
    pub step_seconds: Vec<f64>,
    pub stop_reason: StopReason,
}

impl GenerationStats {
    pub fn prefill_tokens_per_second(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_seconds)
    }
    pub fn decode_tokens_per_second(&self) -> f64 {
        rate(self.decode_steps, self.decode_seconds)
    }
    /// `prompt tokens: N, generated: N, prefill: X tok/s, decode: Y tok/s`.
    pub fn summary(&self) -> String {
        format!(
            "prompt tokens: {}, generated: {}, prefill: {:.1} tok/s, decode: {:.1} tok/s",
            self.prompt_tokens,
            self.generated_tokens,
            self.prefill_tokens_per_second(),
            self.decode_tokens_per_second()
        )
    }
}

fn rate(count: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The text shown (stop strings excluded).
    pub text: String,
    /// Every sampled id, including a final EOS id.
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
}

/// Builds the tokenizer a model source describes.
pub fn load_tokenizer(source: &dyn TensorSource) -> Result<Tokenizer> {
    match source.tokenizer_source()? {
        Some(TokenizerSource::Gguf(spec)) => Tokenizer::from_gguf_spec(&spec),
        Some(TokenizerSource::TokenizerJson { tokenizer_json, .. }) => {
            Tokenizer::from_file(tokenizer_json)
        }
        None => Err(ModelError::Tokenizer(
            "the model file does not say where its tokenizer is".into(),
        )),
    }
}

/// Generates from `prompt` (token ids, BOS already added if wanted), calling `on_text` with each
/// piece of text as soon as it is settled. The KV cache holds the prompt plus `max_tokens`,
/// capped at the model's context; a prompt longer than the context is
/// [`ModelError::ContextOverflow`].
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    options: &GenerateOptions,
    on_text: impl FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    with_hot_workers(|| generate_on_this_thread(model, tokenizer, prompt, options, on_text))
}

/// Runs `work` on this thread while the pool's other workers spin, taking parallel tasks the
/// moment they appear (`rayon::yield_now`), instead of sleeping between parallel regions.
///
/// A decode step is a few hundred short parallel regions (SmolLM2-135M: ~150 per token, most
/// 10-60 us long); a rayon worker that finds no work yields to the OS some 30 times and then
/// sleeps, and waking it costs more than a small region's whole product (measured on the 2-core
/// machine: a region of 6 us of work takes 4.3 us warm, 7.7 us after a 30 us gap and 15 us
/// after 100 us). The helpers burn their cores until `work` returns, which a generation
/// (a few seconds of full load anyway) can afford. Outside a pool of two or more threads, in a
/// pool with more threads than cores, or when `work` panics, it behaves like calling `work`
/// directly.
pub fn with_hot_workers<R>(work: impl FnOnce() -> R) -> R {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    // Only when every worker has a core: with `--threads` above the core count, spinners take
    // the cores from the threads doing the work (measured, 8 threads on 2 cores: 90 tok/s with
    // 7 spinners, 79-85 with 1, 89-115 with none).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = rayon::current_num_threads();
    let helpers = threads.saturating_sub(1);
    if helpers == 0 || threads > cores || rayon::current_thread_index().is_none() {
        return work();
    }
    let stop = AtomicBool::new(false);
    let started = AtomicUsize::new(0);
    /// Stops the helpers when `work` ends, also by a panic (else the scope would wait forever).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let this_worker = rayon::current_thread_index();
    rayon::in_place_scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| {
                // Picked up by this thread itself (while it waits inside `work`): spinning here
                // would stop `work`, so this helper does nothing.
                if rayon::current_thread_index() == this_worker {
                    return;
                }
                started.fetch_add(1, Ordering::AcqRel);
                while !stop.load(Ordering::Acquire) {
                    if !matches!(rayon::yield_now(), Some(rayon::Yield::Executed)) {
                        for _ in 0..32 {
                            std::hint::spin_loop();
                        }
                    }
                }
            });
        }
        let _stop = StopOnDrop(&stop);
        // Until every helper runs on another worker (they wake for the spawned jobs); bounded,
        // in case they are all busy elsewhere (then `work` runs with fewer).
        let waiting = Instant::now();
        while started.load(Ordering::Acquire) < helpers
            && waiting.elapsed() < std::time::Duration::from_millis(50)
        {
            std::hint::spin_loop();
        }
        work()
    })
}

fn generate_on_this_thread(
    model: &Model,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    options: &GenerateOptions,
    on_text: impl FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(ModelError::InvalidArgument(
            "the prompt has no tokens".into(),
        ));
    }
    let context = model.config().max_position_embeddings;
    if prompt.len() > context {
        return Err(ModelError::ContextOverflow {
            tokens: prompt.len(),
            context,
        });
    }
    let sequence = Sequence::new(tokenizer, prompt, options)?;
    // Saturating: `max_tokens` may be any usize; the cache is capped at the context anyway.
    let cache = model.try_new_cache(prompt.len().saturating_add(options.max_tokens))?;
    generate_with(&mut CpuExecutor { model, cache }, sequence, prompt, on_text)
}

/// The CPU's side of [`generate_with`]: forward passes over one KV cache, logits to the host's
/// sampler.
struct CpuExecutor<'m> {
    model: &'m Model,
    cache: KvCache,
}

impl Executor for CpuExecutor<'_> {
    type Error = ModelError;
    fn prefill(&mut self, prompt: &[u32]) -> Result<Next> {
        let logits = self.model.forward(prompt, &mut self.cache, Logits::Last)?;
        Ok(Next::Logits(logits))
    }
    fn step(&mut self, token: u32) -> Result<Next> {
        let logits = self
            .model
            .forward(&[token], &mut self.cache, Logits::Last)?;
        Ok(Next::Logits(logits))
    }
    fn has_room(&self) -> bool {
        self.cache.len() < self.cache.capacity()
    }
    fn prefill_done(&mut self) {
        // `--profile` shows the decode steps only.
        crate::llama::phases::reset();
    }
}

/// What a forward pass hands the generation loop: logits for the host's sampler, or the token a
/// backend already sampled itself (the GPU samples on the device and reads back one id).
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    Logits(Vec<f32>),
    Token(u32),
}

/// One backend's forward passes, as [`generate_with`] drives them over one sequence.
pub trait Executor {
    type Error: From<ModelError>;
    /// Runs the whole prompt from position 0 and returns what follows its last token.
    fn prefill(&mut self, prompt: &[u32]) -> std::result::Result<Next, Self::Error>;
    /// Runs `token` at the next position and returns what follows it.
    fn step(&mut self, token: u32) -> std::result::Result<Next, Self::Error>;
    /// Whether the KV cache can take one more position.
    fn has_room(&self) -> bool;
    /// Called once, when the first generated token is known (before any [`Executor::step`]).
    fn prefill_done(&mut self) {}
}

/// The generation loop of every backend: prefill `prompt`, then take each next token (sampled
/// by `sequence` from logits, or as the backend sampled it) and step it until `sequence` ends it
/// (EOS, a stop string, `max_tokens`, or no room left in the cache), streaming settled text
/// through `on_text`. `sequence` is [`Sequence::new`] over the same `prompt`; the backend
/// refuses a prompt it cannot hold before it calls this. Timing: the prefill up to the first
/// token known (sampled), the decode from there to the end, and each [`Executor::step`] alone.
pub fn generate_with<X: Executor>(
    executor: &mut X,
    mut sequence: Sequence<'_>,
    prompt: &[u32],
    mut on_text: impl FnMut(&str) -> std::result::Result<(), X::Error>,
) -> std::result::Result<Generation, X::Error> {
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        generated_tokens: 0,
        prefill_seconds: 0.0,
        decode_steps: 0,
        decode_seconds: 0.0,
        step_seconds: Vec::new(),
        stop_reason: StopReason::MaxTokens,
    };
    if sequence.finished().is_some() {
        // `max_tokens` 0: nothing is run.
        return Ok(Generation {
            text,
            tokens,
            stats,
        });
    }

    let started = Instant::now();
    let mut next = executor.prefill(prompt)?;
    let mut decode_started = None;
    loop {
        let token = match next {
            Next::Logits(logits) => sequence.sample(&logits)?,
            Next::Token(token) => token,
        };
        if decode_started.is_none() {
            stats.prefill_seconds = started.elapsed().as_secs_f64();
            decode_started = Some(Instant::now());
            executor.prefill_done();
        }
        let step = sequence.accept(token, executor.has_room())?;
        tokens.push(step.token);
        stats.generated_tokens += 1;
        if !step.text.is_empty() {
            on_text(&step.text)?;
            text.push_str(&step.text);
        }
        if let Some(reason) = step.finished {
            stats.stop_reason = reason;
            break;
        }
        let step_started = Instant::now();
        next = executor.step(step.token)?;
        stats
            .step_seconds
            .push(step_started.elapsed().as_secs_f64());
        stats.decode_steps += 1;
    }
    if let Some(started) = decode_started {
        stats.decode_seconds = started.elapsed().as_secs_f64();
    }
    Ok(Generation {
        text,
        tokens,
        stats,
    })
}

/// Most worker threads `--threads` accepts. Every matvec is a parallel region (~240 per decoded
/// token), so threads beyond the cores only add hand-offs: 2000 threads on 2 cores took over a
/// minute for 4 tokens, 65535 never finished starting. 256 covers the largest CPUs sold today.
pub const MAX_THREADS: usize = 256;

/// `--threads` must be in `1..=MAX_THREADS`.
pub fn check_threads(threads: usize) -> Result<()> {
    if threads == 0 || threads > MAX_THREADS {
        return Err(ModelError::InvalidArgument(format!(
            "--threads {threads} is outside 1..={MAX_THREADS}"
        )));
    }
    Ok(())
}

/// Runs `work` inside a rayon pool of `threads` workers (default: one per core). Starting from
/// a pool worker matters for decode: every matvec and attention step is its own parallel
/// region (~240 per token), and regions started from an outside thread are each injected into
/// the pool and joined with sleeping/waking hand-offs (28% of decode CPU time in `perf`, see
/// docs/BENCHMARKS.md); started from a worker, the caller works on the region itself.
pub fn run_in_pool<R: Send>(threads: Option<usize>, work: impl FnOnce() -> R + Send) -> Result<R> {
    Ok(thread_pool(threads)?.install(work))
}

/// The pool [`run_in_pool`] runs in, built (and `threads` checked) without running anything
/// yet: a caller that must report start-up failures before it starts serving builds it first.
pub fn thread_pool(threads: Option<usize>) -> Result<rayon::ThreadPool> {
    if let Some(n) = threads {
        check_threads(n)?;
    }
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(n) = threads {
        builder = builder.num_threads(n);
    }
    builder
        .build()
        .map_err(|e| ModelError::InvalidArgument(format!("thread pool: {e}")))
}

/// Sizes rayon's global pool; call before any model work. Fails if the pool already exists.
pub fn init_threads(threads: usize) -> Result<()> {
    check_threads(threads)?;
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .map_err(|e| ModelError::InvalidArgument(format!("thread pool: {e}")))
}

/// Summed negative log-likelihood over the scored tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct PerplexityResult {
    pub scored_tokens: usize,
    pub total_nll: f64,
}

impl PerplexityResult {
    /// Mean NLL per scored token (nats).
    pub fn mean_nll(&self) -> f64 {
        self.total_nll / self.scored_tokens as f64
    }
    pub fn perplexity(&self) -> f64 {
        self.mean_nll().exp()
    }
}

/// `-log softmax(logits)[target]`, in f64.
pub fn token_nll(logits: &[f32], target: u32) -> Result<f64> {
    let t = target as usize;
    if t >= logits.len() {
        return Err(ModelError::InvalidArgument(format!(
            "token {target} is outside {} logits",
            logits.len()
        )));
    }
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    Ok(max + sum.ln() - logits[t] as f64)
}

/// A perplexity window must hold 2..=context tokens (checked before any text is read).
pub fn check_window(config: &crate::config::ModelConfig, ctx: usize) -> Result<()> {
    if ctx < 2 {
        return Err(ModelError::InvalidArgument(format!(
            "ctx must be at least 2, got {ctx}"
        )));
    }
    let context = config.max_position_embeddings;
    if ctx > context {
        return Err(ModelError::InvalidArgument(format!(
            "window length (ctx) {ctx} is longer than the model's context of {context} positions"
        )));
    }
    Ok(())
}

/// Perplexity of `tokens` in non-overlapping windows of `ctx` tokens, each scored on every
/// position after its first (the first token of a window has no context). A last window shorter
/// than 2 tokens is dropped. `progress(tokens_done, running_ppl)` is called after every window.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    progress: impl FnMut(usize, f64),
) -> Result<PerplexityResult> {
    perplexity_by(model, tokens, ctx, false, progress)
}

/// [`perplexity`] with every window run one token at a time, each position a decode step
/// over the cache (`Logits::Last`), as the GPU scores: it separates the order of the work from
/// the device when the two disagree. Same windows, same scored positions.
pub fn perplexity_per_token(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    progress: impl FnMut(usize, f64),
) -> Result<PerplexityResult> {
    perplexity_by(model, tokens, ctx, true, progress)
}

fn perplexity_by(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    per_token: bool,
    progress: impl FnMut(usize, f64),
) -> Result<PerplexityResult> {
    check_window(model.config(), ctx)?;
    let vocab = model.config().vocab_size;
    let mut cache = model.try_new_cache(ctx)?;
    perplexity_over(
        tokens,
        ctx,
        |window| {
            cache.clear();
            let mut nll = 0.0;
            if per_token {
                for (i, &next) in window.iter().enumerate().skip(1) {
                    let logits = model.forward(&window[i - 1..i], &mut cache, Logits::Last)?;
                    nll += token_nll(&logits, next)?;
                }
            } else {
                let logits = model.forward(window, &mut cache, Logits::All)?;
                for (i, &next) in window.iter().enumerate().skip(1) {
                    nll += token_nll(&logits[(i - 1) * vocab..i * vocab], next)?;
                }
            }
            Ok(nll)
        },
        progress,
    )
}

/// The perplexity loop of every backend: `tokens` in windows of `ctx`, each window (2 tokens or
/// more) scored by `window_nll`, the summed negative log-likelihood of its tokens after the
/// first; `progress(tokens_done, running_ppl)` after every window. The backend checks `ctx`
/// against its context first.
pub fn perplexity_over<E: From<ModelError>>(
    tokens: &[u32],
    ctx: usize,
    mut window_nll: impl FnMut(&[u32]) -> std::result::Result<f64, E>,
    mut progress: impl FnMut(usize, f64),
) -> std::result::Result<PerplexityResult, E> {
    if ctx < 2 {
        return Err(
            ModelError::InvalidArgument(format!("ctx must be at least 2, got {ctx}")).into(),
        );
    }
    let mut result = PerplexityResult {
        scored_tokens: 0,
        total_nll: 0.0,
    };
    let mut done = 0;
    for window in tokens.chunks(ctx) {
        done += window.len();
        if window.len() < 2 {
            continue;
        }
        result.total_nll += window_nll(window)?;
        result.scored_tokens += window.len() - 1;
        progress(done, result.perplexity());
    }
    if result.scored_tokens == 0 {
        return Err(ModelError::InvalidArgument(
            "the text has fewer than 2 tokens; nothing to score".into(),
        )
        .into());
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn hot_workers_run_the_work_and_its_parallel_regions() {
        for threads in [1, 2, 3] {
            let got = run_in_pool(Some(threads), || {
                with_hot_workers(|| {
                    // Many short regions, as a decode step has; every task must run once.
                    (0..200)
                        .map(|r| (0..16u64).into_par_iter().map(|i| i * r).sum::<u64>())
                        .sum::<u64>()
                })
            })
            .unwrap();
            assert_eq!(got, 120 * (0..200).sum::<u64>(), "{threads} threads");
        }
        // Outside a pool (this test thread) it is a plain call.
        assert_eq!(with_hot_workers(|| 7), 7);
    }

    #[test]
    fn a_panic_in_the_work_stops_the_helpers_and_propagates() {
        let caught = run_in_pool(Some(2), || {
            std::panic::catch_unwind(|| with_hot_workers(|| panic!("boom")))
        })
        .unwrap();
        assert!(caught.is_err());
        // The pool is usable afterwards (no helper left spinning forever).
        let sum = run_in_pool(Some(2), || {
            with_hot_workers(|| (0..100u32).into_par_iter().sum::<u32>())
        })
        .unwrap();
        assert_eq!(sum, 4950);
    }

    #[test]
    fn nll_is_the_negative_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&v| (v as f64).exp()).sum();
        let want = -(3f64.exp() / z).ln();
        assert!((token_nll(&logits, 2).unwrap() - want).abs() < 1e-12);
        assert!(token_nll(&logits, 3).is_err());
    }

    #[test]
    fn perplexity_windows_score_all_but_their_first_token() {
        let src = crate::llama::tests::random_source(crate::llama::tests::tiny_config(), 7);
        let model = Model::from_source(&src).unwrap();
        let tokens: Vec<u32> = (0..21).map(|i| (i * 7 % 37) as u32).collect();
        let mut calls = 0;
        let r = perplexity(&model, &tokens, 8, |_, _| calls += 1).unwrap();
        // Windows of 8, 8, 5 tokens: 7 + 7 + 4 predictions.
        assert_eq!(r.scored_tokens, 18);
        assert_eq!(calls, 3);
        // The same NLL computed position by position through the decode path, by hand and by
        // `perplexity_per_token`.
        let mut total = 0.0;
        for window in tokens.chunks(8) {
            let mut cache = model.new_cache(8);
            for i in 0..window.len() - 1 {
                let l = model
                    .forward(&window[i..i + 1], &mut cache, Logits::Last)
                    .unwrap();
                total += token_nll(&l, window[i + 1]).unwrap();
            }
        }
        assert!(
            (r.total_nll - total).abs() < 1e-3 * total.abs().max(1.0),
            "{} vs {total}",
            r.total_nll
        );
        let mut calls = 0;
        let stepped = perplexity_per_token(&model, &tokens, 8, |_, _| calls += 1).unwrap();
        assert_eq!((stepped.scored_tokens, calls), (18, 3));
        assert!((stepped.total_nll - total).abs() < 1e-9 * total.abs().max(1.0));
        assert!(perplexity_per_token(&model, &tokens, 65, |_, _| {}).is_err());
        assert!(r.perplexity().is_finite() && r.perplexity() > 1.0);
        assert!(perplexity(&model, &tokens, 1, |_, _| {}).is_err());
        assert!(perplexity(&model, &tokens, 65, |_, _| {}).is_err());
        assert!(perplexity(&model, &tokens[..1], 8, |_, _| {}).is_err());
    }

    #[test]
    fn windows_and_limits_past_the_context_are_clear_errors() {
        let src = crate::llama::tests::random_source(crate::llama::tests::tiny_config(), 7);
        let model = Model::from_source(&src).unwrap();
        let tokens: Vec<u32> = (0..21).collect();
        for ctx in [1_000_000_000, 4611686018427387904, usize::MAX] {
            let err = perplexity(&model, &tokens, ctx, |_, _| {})
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("window length (ctx) {ctx}")) && err.contains("64 positions"),
                "{err}"
            );
        }
        // `max_tokens` near usize::MAX must neither wrap nor size an unbounded cache.
        let tokenizer = tiny_tokenizer();
        let options = GenerateOptions {
            max_tokens: usize::MAX,
            ..GenerateOptions::default()
        };
        let out = generate(&model, &tokenizer, &[1, 3, 5], &options, |_| Ok(())).unwrap();
        assert!(out.stats.generated_tokens <= 64 - 3 + 1, "{:?}", out.stats);
    }

    fn tiny_tokenizer() -> Tokenizer {
        let spec = crate::tokenizer::GgufTokenizerSpec {
            model: "gpt2".into(),
            pre: "smollm".into(),
            tokens: ["a", "b", "ab"]
                .into_iter()
                .map(String::from)
                .chain((3..37).map(|i| format!("x{i}")))
                .collect(),
            merges: vec!["a b".into()],
            ..Default::default()
        };
        Tokenizer::from_gguf_spec(&spec).unwrap()
    }

    /// A backend that samples on its side (as the GPU does) and hands the loop token ids.
    struct SamplesItself<'m> {
        cpu: CpuExecutor<'m>,
        sampler: crate::sampling::Sampler,
    }

    impl Executor for SamplesItself<'_> {
        type Error = ModelError;
        fn prefill(&mut self, prompt: &[u32]) -> Result<Next> {
            let next = self.cpu.prefill(prompt)?;
            self.sample(next)
        }
        fn step(&mut self, token: u32) -> Result<Next> {
            let next = self.cpu.step(token)?;
            self.sample(next)
        }
        fn has_room(&self) -> bool {
            self.cpu.has_room()
        }
    }

    impl SamplesItself<'_> {
        fn sample(&mut self, next: Next) -> Result<Next> {
            match next {
                Next::Logits(logits) => Ok(Next::Token(self.sampler.sample(&logits, &[])?)),
                token => Ok(token),
            }
        }
    }

    #[test]
    fn a_backend_that_samples_itself_generates_the_same() {
        let src = crate::llama::tests::random_source(crate::llama::tests::tiny_config(), 7);
        let model = Model::from_source(&src).unwrap();
        let tokenizer = tiny_tokenizer();
        let prompt = [1, 3, 5];
        // The token limit, and the end of the 64-position context.
        for (max_tokens, reason) in [(9, StopReason::MaxTokens), (100, StopReason::ContextFull)] {
            let options = GenerateOptions {
                max_tokens,
                ..GenerateOptions::default()
            };
            let mut streamed = String::new();
            let want = generate(&model, &tokenizer, &prompt, &options, |piece| {
                streamed.push_str(piece);
                Ok(())
            })
            .unwrap();
            assert_eq!(want.stats.stop_reason, reason);
            assert_eq!(streamed, want.text);
            assert_eq!(want.stats.step_seconds.len(), want.stats.decode_steps);

            let mut executor = SamplesItself {
                cpu: CpuExecutor {
                    model: &model,
                    cache: model.try_new_cache(prompt.len() + max_tokens).unwrap(),
                },
                sampler: crate::sampling::Sampler::new(options.sampling.clone()).unwrap(),
            };
            let sequence = Sequence::new(&tokenizer, &prompt, &options).unwrap();
            let mut streamed = String::new();
            let got = generate_with(&mut executor, sequence, &prompt, |piece| {
                streamed.push_str(piece);
                Ok::<_, ModelError>(())
            })
            .unwrap();
            assert_eq!(got.tokens, want.tokens);
            assert_eq!(got.text, want.text);
            assert_eq!(streamed, want.text);
            assert_eq!(got.stats.stop_reason, reason);
            assert_eq!(got.stats.generated_tokens, want.stats.generated_tokens);
            assert_eq!(got.stats.decode_steps, want.stats.decode_steps);
        }
    }

    #[test]
    fn thread_counts_are_capped() {
        assert!(check_threads(1).is_ok() && check_threads(MAX_THREADS).is_ok());
        for n in [0, MAX_THREADS + 1, 65535] {
            let err = run_in_pool(Some(n), || ()).unwrap_err().to_string();
            assert!(err.contains(&format!("--threads {n}")), "{err}");
        }
    }
}
