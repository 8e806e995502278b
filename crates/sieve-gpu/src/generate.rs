//! Generation and perplexity on the GPU: the loops of every backend
//! (`sieve_model::generate::generate_with` and `perplexity_over`) with the step and the sampler
//! on the device. The host reads one token id per step, detokenizes, and watches for EOS and
//! stop strings.

use crate::error::{GpuError, Result};
use crate::runner::{sample_args, GpuModel};
use sieve_model::generate::{
    generate_with, perplexity_over, token_nll, Executor, GenerateOptions, Next, PerplexityResult,
    StopReason,
};
use sieve_model::sequence::Sequence;
use sieve_model::tokenizer::Tokenizer;

/// A finished generation with the timing a GPU user looks at.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuGeneration {
    pub text: String,
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    /// Prompt in, first token out (seconds).
    pub ttft_s: f64,
    /// Per generated token after the first (seconds), in order.
    pub step_s: Vec<f64>,
    #[serde(skip)]
    pub stop_reason: StopReason,
}

impl GpuGeneration {
    pub fn tpot_median_s(&self) -> f64 {
        let mut v = self.step_s.clone();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            0.0
        } else {
            v[v.len() / 2]
        }
    }
    /// `prompt tokens: N, generated: N, TTFT: X ms, TPOT: Y ms (median), decode: Z tok/s`.
    pub fn summary(&self) -> String {
        let total: f64 = self.step_s.iter().sum();
        let rate = if total > 0.0 {
            self.step_s.len() as f64 / total
        } else {
            0.0
        };
        format!(
            "prompt tokens: {}, generated: {}, TTFT: {:.2} ms, TPOT: {:.3} ms (median), decode: {:.1} tok/s",
            self.prompt_tokens,
            self.tokens.len(),
            self.ttft_s * 1e3,
            self.tpot_median_s() * 1e3,
            rate
        )
    }
}

/// Generates from `prompt` on the GPU, streaming text through `on_text`: the loop of every
/// backend (`sieve_model::generate::generate_with`) over the device's step, which samples.
pub fn generate(
    model: &mut GpuModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    options: &GenerateOptions,
    on_text: impl FnMut(&str) -> Result<()>,
) -> Result<GpuGeneration> {
    check_request(prompt, model.capacity(), options)?;
    model.set_sampling(sample_args(&options.sampling));
    run(&mut GpuExecutor(model), tokenizer, prompt, options, on_text)
}

/// [`generate`] on a model split over GPUs (`crate::tensor_parallel`): the same loop, each
/// step run by every rank.
pub fn generate_split(
    model: &mut crate::tensor_parallel::TensorParallelGpu,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    options: &GenerateOptions,
    on_text: impl FnMut(&str) -> Result<()>,
) -> Result<GpuGeneration> {
    check_request(prompt, model.capacity(), options)?;
    model.set_sampling(sample_args(&options.sampling))?;
    run(
        &mut SplitExecutor(model),
        tokenizer,
        prompt,
        options,
        on_text,
    )
}

/// The sampling settings, and a prompt that leaves room for a token.
fn check_request(prompt: &[u32], capacity: usize, options: &GenerateOptions) -> Result<()> {
    options.sampling.validate()?;
    if prompt.len() >= capacity {
        return Err(sieve_model::ModelError::ContextOverflow {
            tokens: prompt.len(),
            context: capacity,
        }
        .into());
    }
    Ok(())
}

/// The loop of every backend over `executor`.
fn run(
    executor: &mut impl Executor<Error = GpuError>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    options: &GenerateOptions,
    on_text: impl FnMut(&str) -> Result<()>,
) -> Result<GpuGeneration> {
    let sequence = Sequence::new(tokenizer, prompt, options)?;
    Ok(GpuGeneration::from(generate_with(
        executor, sequence, prompt, on_text,
    )?))
}

impl From<sieve_model::generate::Generation> for GpuGeneration {
    fn from(out: sieve_model::generate::Generation) -> Self {
        GpuGeneration {
            text: out.text,
            tokens: out.tokens,
            prompt_tokens: out.stats.prompt_tokens,
            ttft_s: out.stats.prefill_seconds,
            step_s: out.stats.step_seconds,
            stop_reason: out.stats.stop_reason,
        }
    }
}

/// [`GpuExecutor`] of a split model.
struct SplitExecutor<'m>(&'m mut crate::tensor_parallel::TensorParallelGpu);

impl Executor for SplitExecutor<'_> {
    type Error = GpuError;
    fn prefill(&mut self, prompt: &[u32]) -> Result<Next> {
        Ok(Next::Token(self.0.prefill(prompt)?))
    }
    fn step(&mut self, _token: u32) -> Result<Next> {
        Ok(Next::Token(self.0.next_token()?))
    }
    fn has_room(&self) -> bool {
        self.0.len() < self.0.capacity()
    }
}

/// The GPU's side of `generate_with`: the prompt and each step on the device, which samples
/// the next token itself (one id read back per step).
struct GpuExecutor<'m>(&'m mut GpuModel);

impl Executor for GpuExecutor<'_> {
    type Error = GpuError;
    fn prefill(&mut self, prompt: &[u32]) -> Result<Next> {
        Ok(Next::Token(self.0.prefill(prompt)?))
    }
    fn step(&mut self, _token: u32) -> Result<Next> {
        // The device's step state already holds the token it sampled.
        Ok(Next::Token(self.0.next_token()?))
    }
    fn has_room(&self) -> bool {
        self.0.len() < self.0.capacity()
    }
}

/// Perplexity over non-overlapping windows of `ctx` tokens: the CPU's loop
/// (`sieve_model::generate::perplexity_over`), each window's logits from the GPU.
pub fn perplexity(
    model: &mut GpuModel,
    tokens: &[u32],
    ctx: usize,
    progress: impl FnMut(usize, f64),
) -> Result<PerplexityResult> {
    if ctx > model.capacity() {
        return Err(sieve_model::ModelError::ContextOverflow {
            tokens: ctx,
            context: model.capacity(),
        }
        .into());
    }
    perplexity_over(
        tokens,
        ctx,
        |window| {
            let mut nll = 0.0;
            model.logits_all(window, |i, logits| {
                if i + 1 < window.len() {
                    nll += token_nll(logits, window[i + 1])?;
                }
                Ok(())
            })?;
            Ok(nll)
        },
        progress,
    )
}
