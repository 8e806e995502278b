//! Generation and perplexity on the GPU: the CPU path's loop (`sieve_model::generate`) with the
//! step and the sampler on the device. The host reads one token id per step, detokenizes,
//! and watches for EOS and stop strings.

use crate::error::Result;
use crate::runner::{sample_args, GpuModel};
use sieve_model::generate::{
    perplexity_over, token_nll, GenerateOptions, PerplexityResult, StopReason,
};
use sieve_model::sampling::StopMatcher;
use sieve_model::tokenizer::Tokenizer;
use std::time::Instant;

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

/// Generates from `prompt` on the GPU, streaming text through `on_text`.
pub fn generate(
    model: &mut GpuModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    options: &GenerateOptions,
    mut on_text: impl FnMut(&str) -> Result<()>,
) -> Result<GpuGeneration> {
    options.sampling.validate()?;
    if prompt.len() >= model.capacity() {
        return Err(sieve_model::ModelError::ContextOverflow {
            tokens: prompt.len(),
            context: model.capacity(),
        }
        .into());
    }
    model.set_sampling(sample_args(&options.sampling));
    let mut stops = StopMatcher::new(options.stop_strings.iter().cloned())?;
    let mut stream = tokenizer.stream(true);
    let is_eos = |id: u32| tokenizer.is_eos(id) || options.extra_eos_ids.contains(&id);
    let mut out = GpuGeneration {
        text: String::new(),
        tokens: Vec::new(),
        prompt_tokens: prompt.len(),
        ttft_s: 0.0,
        step_s: Vec::new(),
        stop_reason: StopReason::MaxTokens,
    };
    if options.max_tokens == 0 {
        return Ok(out);
    }
    let started = Instant::now();
    let mut id = model.prefill(prompt)?;
    out.ttft_s = started.elapsed().as_secs_f64();
    loop {
        out.tokens.push(id);
        if is_eos(id) {
            out.stop_reason = StopReason::Eos;
            break;
        }
        if let Some(piece) = stream.push(id)? {
            let step = stops.push(&piece);
            if !step.emit.is_empty() {
                on_text(&step.emit)?;
                out.text.push_str(&step.emit);
            }
            if step.stopped {
                out.stop_reason = StopReason::StopString;
                break;
            }
        }
        if out.tokens.len() >= options.max_tokens {
            break;
        }
        if model.len() >= model.capacity() {
            out.stop_reason = StopReason::ContextFull;
            break;
        }
        let t = Instant::now();
        id = model.next_token()?;
        out.step_s.push(t.elapsed().as_secs_f64());
    }
    if out.stop_reason != StopReason::StopString {
        let mut rest = stream
            .finish()
            .map(|tail| stops.push(&tail).emit)
            .unwrap_or_default();
        rest.push_str(&stops.finish());
        if !rest.is_empty() {
            on_text(&rest)?;
            out.text.push_str(&rest);
        }
    }
    Ok(out)
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
