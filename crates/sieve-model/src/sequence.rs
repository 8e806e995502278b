//! One sequence's generation state, apart from the model: sampling, EOS and stop strings,
//! detokenization and the token limit. [`crate::generate::generate_with`] drives one of these
//! with single-sequence forward passes (a backend that samples on its device hands it tokens
//! instead of logits: [`Sequence::accept`]); a batching server drives many with one batched
//! decode step, and both produce the same text for the same logits.

use crate::error::Result;
use crate::generate::{GenerateOptions, StopReason, REPETITION_WINDOW};
use crate::sampling::{Sampler, StopMatcher};
use crate::tokenizer::{TokenStream, Tokenizer};

/// What one [`Sequence::step`] produced.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceStep {
    /// The sampled token (also when it is an EOS id).
    pub token: u32,
    /// Text that became safe to show (may be empty).
    pub text: String,
    /// Set when generation is over; otherwise `token` must be run through the model next.
    pub finished: Option<StopReason>,
}

/// The state of one generation between forward passes.
pub struct Sequence<'t> {
    tokenizer: &'t Tokenizer,
    sampler: Sampler,
    stops: StopMatcher,
    stream: Option<TokenStream<'t>>,
    extra_eos_ids: Vec<u32>,
    max_tokens: usize,
    /// The prompt and every sampled token (the repetition penalty's window looks back over it).
    history: Vec<u32>,
    generated: usize,
    finished: Option<StopReason>,
}

impl<'t> Sequence<'t> {
    /// Checks the sampling parameters and stop strings; `prompt` is the token ids already run.
    pub fn new(
        tokenizer: &'t Tokenizer,
        prompt: &[u32],
        options: &GenerateOptions,
    ) -> Result<Self> {
        Ok(Self {
            tokenizer,
            sampler: Sampler::new(options.sampling.clone())?,
            stops: StopMatcher::new(options.stop_strings.iter().cloned())?,
            stream: Some(tokenizer.stream(true)),
            extra_eos_ids: options.extra_eos_ids.clone(),
            max_tokens: options.max_tokens,
            history: prompt.to_vec(),
            generated: 0,
            finished: (options.max_tokens == 0).then_some(StopReason::MaxTokens),
        })
    }

    /// Tokens sampled so far (an EOS id included).
    pub fn generated_tokens(&self) -> usize {
        self.generated
    }

    /// Why generation ended, once it has.
    pub fn finished(&self) -> Option<StopReason> {
        self.finished
    }

    /// Samples the next token from `logits` (the model's output after the last token run).
    /// `cache_has_room` says whether the KV cache can take one more position: without room a
    /// token that does not end generation otherwise ends it as [`StopReason::ContextFull`].
    /// When the step finishes the sequence, its text includes everything still held back.
    pub fn step(&mut self, logits: &[f32], cache_has_room: bool) -> Result<SequenceStep> {
        let token = self.sample(logits)?;
        self.accept(token, cache_has_room)
    }

    /// The sampling settings of this sequence.
    pub fn sampling(&self) -> &crate::sampling::SamplingParams {
        self.sampler.params()
    }

    /// The tokens the repetition penalty looks back over (the prompt's and the accepted ones,
    /// the last [`REPETITION_WINDOW`]), for a backend that samples on its device.
    pub fn recent_tokens(&self) -> &[u32] {
        &self.history[self.history.len().saturating_sub(REPETITION_WINDOW)..]
    }

    /// True when this sequence's next token is always the argmax of its logits (greedy, no
    /// repetition penalty), so a backend may choose it on its device and pass it to
    /// [`Sequence::accept`].
    pub fn decodes_by_argmax(&self) -> bool {
        let p = self.sampler.params();
        p.is_greedy() && p.repetition_penalty == 1.0
    }

    /// Draws the next token from `logits` with this sequence's sampler (the repetition penalty
    /// looking back over the prompt and the tokens accepted so far); [`Sequence::accept`] then
    /// takes it. [`Sequence::step`] is the two together.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        self.check_running()?;
        let recent = &self.history[self.history.len().saturating_sub(REPETITION_WINDOW)..];
        self.sampler.sample(logits, recent)
    }

    /// Takes `token` as the next generated token, whoever sampled it (this sequence's
    /// [`Sequence::sample`], or a backend that samples on its device): EOS, stop strings, the
    /// token limit and `cache_has_room` as in [`Sequence::step`].
    pub fn accept(&mut self, token: u32, cache_has_room: bool) -> Result<SequenceStep> {
        self.check_running()?;
        self.history.push(token);
        self.generated += 1;
        let mut text = String::new();
        let is_eos = self.tokenizer.is_eos(token) || self.extra_eos_ids.contains(&token);
        let mut finished = None;
        if is_eos {
            finished = Some(StopReason::Eos);
        } else {
            let piece = match self.stream.as_mut() {
                Some(stream) => stream.push(token)?,
                None => None,
            };
            if let Some(piece) = piece {
                let step = self.stops.push(&piece);
                text.push_str(&step.emit);
                if step.stopped {
                    finished = Some(StopReason::StopString);
                }
            }
            if finished.is_none() && self.generated >= self.max_tokens {
                finished = Some(StopReason::MaxTokens);
            }
            if finished.is_none() && !cache_has_room {
                finished = Some(StopReason::ContextFull);
            }
        }
        if let Some(reason) = finished {
            self.finished = Some(reason);
            if reason != StopReason::StopString {
                let tail = self.stream.take().and_then(TokenStream::finish);
                if let Some(tail) = tail {
                    text.push_str(&self.stops.push(&tail).emit);
                }
                text.push_str(&self.stops.finish());
            }
        }
        Ok(SequenceStep {
            token,
            text,
            finished,
        })
    }

    fn check_running(&self) -> Result<()> {
        match self.finished {
            Some(reason) => Err(crate::ModelError::InvalidArgument(format!(
                "the sequence already ended ({reason:?})"
            ))),
            None => Ok(()),
        }
    }
}
