//! Choosing the next token from logits (greedy, temperature, top-k, top-p, repetition penalty)
//! and stop-string detection for streamed text.

use std::collections::HashSet;

use sieve_formats::random::SplitMix64;

use crate::error::{ModelError, Result};

/// Temperatures below this decode greedily (on the CPU and the GPU sampler alike): at
/// `T = 1e-6` a logit gap of 0.0001 already weighs `e^-100`, so the draw is the argmax in all
/// but exact ties, and `1 / T` stays far from overflowing f32 (at `T = 1e-40` it is `inf`, and
/// `0 * inf` is NaN). At and above it the CPU scales `(logit - max) / T` in f64 and the GPU
/// `(logit - max) * (1 / T)` in f32, neither of which can overflow.
pub const GREEDY_BELOW_TEMPERATURE: f32 = 1e-6;

/// A `top_p` given in f64 (JSON, the command line) as the f32 the samplers take. A positive
/// value below f32's smallest normal keeps only the most likely token, exactly as that
/// smallest normal does, so it becomes that instead of rounding to 0 (which is refused).
/// Anything else converts as is (NaN and out-of-range values stay refused by `validate`).
pub fn top_p_from_f64(top_p: f64) -> f32 {
    if top_p > 0.0 && top_p < f64::from(f32::MIN_POSITIVE) {
        f32::MIN_POSITIVE
    } else {
        top_p as f32
    }
}

/// How the next token is drawn. The neutral value of every filter switches it off:
/// `temperature = 0` (or below [`GREEDY_BELOW_TEMPERATURE`]) is greedy, `top_k = 0` keeps every token, `top_p = 1` keeps the whole
/// distribution, `repetition_penalty = 1` leaves logits alone.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Logits are divided by it before the softmax; 0 (or anything below
    /// [`GREEDY_BELOW_TEMPERATURE`]) means argmax.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1].
    pub top_p: f32,
    /// CTRL-style penalty (> 0) on tokens in the recent window: positive logits are divided by
    /// it, negative ones multiplied, so values above 1 make repeats less likely.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    /// Deterministic argmax decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(ModelError::InvalidArgument(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::InvalidArgument(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return Err(ModelError::InvalidArgument(format!(
                "repetition_penalty must be a finite number > 0, got {}",
                self.repetition_penalty
            )));
        }
        Ok(())
    }

    /// Argmax decoding: a temperature below [`GREEDY_BELOW_TEMPERATURE`] or `top_k = 1`.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW_TEMPERATURE || self.top_k == 1
    }
}

/// Draws token ids from logits with a seeded generator, so a seed replays the same sequence.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    /// Reused between calls: (scaled logit, id) candidates, then their probabilities.
    candidates: Vec<(f32, u32)>,
    probabilities: Vec<f64>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = SplitMix64::new(params.seed);
        Ok(Self {
            params,
            rng,
            candidates: Vec::new(),
            probabilities: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `recent_tokens` are the ids the repetition penalty applies to
    /// (each counted once however often it occurs). Logits may hold `-inf` for banned tokens;
    /// NaN, `+inf` or all tokens banned is an error.
    pub fn sample(&mut self, logits: &[f32], recent_tokens: &[u32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(ModelError::InvalidArgument(
                "sampling from empty logits".into(),
            ));
        }
        if u32::try_from(logits.len()).is_err() {
            return Err(ModelError::InvalidArgument(format!(
                "{} logits do not fit u32 token ids",
                logits.len()
            )));
        }
        if let Some(bad) = logits
            .iter()
            .position(|l| l.is_nan() || *l == f32::INFINITY)
        {
            return Err(ModelError::InvalidArgument(format!(
                "logit {bad} is {}",
                logits[bad]
            )));
        }
        if let Some(id) = recent_tokens
            .iter()
            .find(|&&id| id as usize >= logits.len())
        {
            return Err(ModelError::InvalidArgument(format!(
                "recent token {id} outside the {} logits",
                logits.len()
            )));
        }

        let penalty = self.params.repetition_penalty;
        let penalized: HashSet<u32> = if penalty != 1.0 {
            recent_tokens.iter().copied().collect()
        } else {
            HashSet::new()
        };
        let adjusted = |id: usize, logit: f32| -> f32 {
            if penalized.contains(&(id as u32)) {
                let value = if logit > 0.0 {
                    logit / penalty
                } else {
                    logit * penalty
                };
                // A tiny or huge penalty must not turn a finite logit into an infinity.
                if logit.is_finite() {
                    value.clamp(-f32::MAX, f32::MAX)
                } else {
                    value
                }
            } else {
                logit
            }
        };

        if self.params.is_greedy() {
            let mut best: Option<(f32, usize)> = None;
            for (id, &logit) in logits.iter().enumerate() {
                let value = adjusted(id, logit);
                // Strictly greater: on ties the lowest id stays.
                if value > f32::NEG_INFINITY && best.is_none_or(|(b, _)| value > b) {
                    best = Some((value, id));
                }
            }
            return best
                .map(|(_, id)| id as u32)
                .ok_or_else(|| ModelError::InvalidArgument("every logit is -inf".into()));
        }

        // Candidates keep their (penalized) logits; dividing by T > 0 keeps the order.
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .map(|(id, &l)| (adjusted(id, l), id as u32))
                .filter(|(l, _)| *l > f32::NEG_INFINITY),
        );
        if self.candidates.is_empty() {
            return Err(ModelError::InvalidArgument("every logit is -inf".into()));
        }
        let by_likelihood =
            |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = self.params.top_k;
        if k > 0 && k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(k - 1, by_likelihood);
            self.candidates.truncate(k);
        }
        self.candidates.sort_unstable_by(by_likelihood);

        // (l - max) / T in f64: the difference is finite and <= 0, and f64 holds its quotient
        // by any accepted temperature (>= 1e-6), so the largest weight is exactly 1 and no
        // weight is NaN.
        let max = f64::from(self.candidates[0].0);
        let temperature = f64::from(self.params.temperature);
        self.probabilities.clear();
        self.probabilities.extend(
            self.candidates
                .iter()
                .map(|(l, _)| ((f64::from(*l) - max) / temperature).exp()),
        );
        let total: f64 = self.probabilities.iter().sum();

        let top_p = f64::from(self.params.top_p);
        let mut kept = self.probabilities.len();
        if top_p < 1.0 {
            let mut cumulative = 0.0;
            for (index, p) in self.probabilities.iter().enumerate() {
                cumulative += p / total;
                if cumulative >= top_p {
                    kept = index + 1;
                    break;
                }
            }
        }
        let kept_total: f64 = self.probabilities[..kept].iter().sum();
        let mut target = self.rng.next_f64() * kept_total;
        for (index, p) in self.probabilities[..kept].iter().enumerate() {
            if target < *p {
                return Ok(self.candidates[index].1);
            }
            target -= p;
        }
        // Rounding can leave target a hair above the last weight.
        Ok(self.candidates[kept - 1].1)
    }
}

/// What to do with streamed text given the stop strings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopCheck {
    /// No stop string yet; the first `safe_len` bytes may be shown, the rest could be the start
    /// of a stop string and must be held back.
    Continue { safe_len: usize },
    /// A stop string starts at byte `text_len`: show the text up to there and stop.
    Stop { text_len: usize },
}

/// Watches generated text for stop strings, holding back any tail that might grow into one.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    longest: usize,
    text: String,
    emitted: usize,
    stopped: bool,
}

/// Result of [`StopMatcher::push`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopStep {
    /// Text that is now safe to show.
    pub emit: String,
    /// A stop string was reached; `emit` ends right before it and nothing more will come.
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are refused: they would match before any text.
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Result<Self> {
        let stops: Vec<String> = stops.into_iter().map(Into::into).collect();
        if stops.iter().any(String::is_empty) {
            return Err(ModelError::InvalidArgument("empty stop string".into()));
        }
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        Ok(Self {
            stops,
            longest,
            ..Self::default()
        })
    }

    /// Looks at the whole text generated so far.
    pub fn check(&self, text: &str) -> StopCheck {
        self.check_from(text, 0)
    }

    /// Like [`check`](Self::check), knowing no stop string starts before byte `search_from`.
    fn check_from(&self, text: &str, search_from: usize) -> StopCheck {
        let mut search_from = search_from.min(text.len());
        while !text.is_char_boundary(search_from) {
            search_from -= 1;
        }
        let earliest = self
            .stops
            .iter()
            .filter_map(|stop| text[search_from..].find(stop.as_str()))
            .min();
        if let Some(at) = earliest {
            return StopCheck::Stop {
                text_len: search_from + at,
            };
        }
        // The longest tail of the text that is a proper prefix of some stop string. A byte
        // match can only start on a character boundary, since stops begin with a lead byte.
        let hold = (1..self.longest.min(text.len() + 1))
            .rev()
            .find(|&len| {
                let tail = &text.as_bytes()[text.len() - len..];
                self.stops
                    .iter()
                    .any(|stop| stop.len() > len && stop.as_bytes().starts_with(tail))
            })
            .unwrap_or(0);
        StopCheck::Continue {
            safe_len: text.len() - hold,
        }
    }

    /// Adds a decoded piece; returns what can be shown now.
    pub fn push(&mut self, piece: &str) -> StopStep {
        if self.stopped {
            return StopStep {
                emit: String::new(),
                stopped: true,
            };
        }
        // A stop string not found before this piece must end inside it.
        let search_from = self
            .text
            .len()
            .saturating_sub(self.longest.saturating_sub(1));
        self.text.push_str(piece);
        let (end, stopped) = match self.check_from(&self.text, search_from) {
            StopCheck::Stop { text_len } => (text_len, true),
            StopCheck::Continue { safe_len } => (safe_len, false),
        };
        self.stopped = stopped;
        let end = end.max(self.emitted);
        let emit = self.text[self.emitted..end].to_owned();
        self.emitted = end;
        StopStep { emit, stopped }
    }

    /// Generation ended without a stop string: the held-back tail is ordinary text after all.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let rest = self.text[self.emitted..].to_owned();
        self.emitted = self.text.len();
        rest
    }

    /// All text shown so far.
    pub fn emitted_text(&self) -> &str {
        &self.text[..self.emitted]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty: 1.0,
            seed,
        };
        match Sampler::new(params) {
            Ok(s) => s,
            Err(e) => panic!("valid parameters refused: {e}"),
        }
    }

    fn draw(s: &mut Sampler, logits: &[f32]) -> u32 {
        match s.sample(logits, &[]) {
            Ok(id) => id,
            Err(e) => panic!("sampling failed: {e}"),
        }
    }

    #[test]
    fn validation_rejects_each_bad_parameter() {
        let bad = [
            SamplingParams {
                temperature: -0.1,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: f32::INFINITY,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                top_p: 0.0,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                top_p: 1.5,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                top_p: f32::NAN,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                repetition_penalty: -1.0,
                ..SamplingParams::greedy()
            },
        ];
        for params in bad {
            assert!(
                matches!(
                    Sampler::new(params.clone()),
                    Err(ModelError::InvalidArgument(_))
                ),
                "{params:?} accepted"
            );
        }
        assert!(Sampler::new(SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            seed: 3
        })
        .is_ok());
    }

    #[test]
    fn tiny_temperatures_draw_the_argmax_never_garbage() {
        // Issue 30: 1 / 1e-40 is inf in f32 and 0 * inf is NaN, which drew arbitrary tokens.
        let mut rng = SplitMix64::new(5);
        let temperatures = [
            f32::from_bits(1), // the smallest positive f32 (a subnormal)
            1e-45,
            1e-40,
            1e-38,
            f32::MIN_POSITIVE,
            1e-30,
            1e-7,
            GREEDY_BELOW_TEMPERATURE * 0.5,
            GREEDY_BELOW_TEMPERATURE,
            1e-5,
            1e-3,
        ];
        for &t in &temperatures {
            assert!(
                SamplingParams {
                    temperature: t,
                    ..SamplingParams::greedy()
                }
                .validate()
                .is_ok(),
                "{t} refused"
            );
            let mut greedy = sampler(0.0, 0, 1.0, 0);
            for seed in 0..20 {
                let mut s = sampler(t, 0, 1.0, seed);
                let mut nucleus = sampler(t, 0, 1e-30, seed);
                // Model-like logits: the best leads the second by at least 0.05.
                let mut logits: Vec<f32> = (0..500).map(|_| rng.normal() as f32 * 4.0).collect();
                let best = draw(&mut greedy, &logits) as usize;
                logits[best] += 0.05;
                assert_eq!(draw(&mut s, &logits) as usize, best, "T = {t:e}");
                assert_eq!(draw(&mut nucleus, &logits) as usize, best, "T = {t:e}");
            }
        }
        // Huge logits at a tiny temperature: still the argmax.
        let mut s = sampler(GREEDY_BELOW_TEMPERATURE, 0, 1.0, 3);
        assert_eq!(draw(&mut s, &[-f32::MAX, f32::MAX, 3.0e38, 0.0]), 1);
        assert!(SamplingParams {
            temperature: 1e-7,
            ..SamplingParams::greedy()
        }
        .is_greedy());
        assert!(!SamplingParams {
            temperature: GREEDY_BELOW_TEMPERATURE,
            ..SamplingParams::greedy()
        }
        .is_greedy());
    }

    #[test]
    fn tiny_top_p_keeps_the_best_token_and_is_not_rounded_to_zero() {
        for v in [1e-300, 1e-45, 1e-39] {
            let top_p = top_p_from_f64(v);
            assert!(top_p > 0.0, "{v}");
            let mut s = sampler(1.0, 0, top_p, 9);
            for _ in 0..100 {
                assert_eq!(draw(&mut s, &[0.0, 2.0, 1.9]), 1);
            }
        }
        assert_eq!(top_p_from_f64(0.5), 0.5);
        assert_eq!(top_p_from_f64(0.0), 0.0);
        assert!(top_p_from_f64(f64::NAN).is_nan());
    }

    #[test]
    fn extreme_repetition_penalties_keep_logits_finite() {
        for penalty in [1e-38f32, 1e38] {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                repetition_penalty: penalty,
                seed: 1,
                ..SamplingParams::greedy()
            })
            .ok()
            .unwrap_or_else(|| panic!("refused"));
            for _ in 0..100 {
                let id = s.sample(&[1e3, -1e3, 0.5], &[0, 1]);
                assert!(matches!(id, Ok(0..=2)), "{penalty}: {id:?}");
            }
        }
    }

    #[test]
    fn greedy_picks_the_argmax_and_the_lowest_id_on_ties() {
        let mut s = sampler(0.0, 0, 1.0, 0);
        assert_eq!(draw(&mut s, &[0.1, 2.5, -1.0, 2.4]), 1);
        assert_eq!(draw(&mut s, &[1.0, 3.0, 3.0, 3.0]), 1);
        assert_eq!(
            draw(&mut s, &[f32::NEG_INFINITY, -5.0, f32::NEG_INFINITY]),
            1
        );
    }

    #[test]
    fn top_k_one_equals_greedy_at_any_temperature() {
        let mut rng = SplitMix64::new(11);
        let mut greedy = sampler(0.0, 0, 1.0, 0);
        let mut top1 = sampler(1.7, 1, 1.0, 99);
        for _ in 0..50 {
            let logits: Vec<f32> = (0..64).map(|_| rng.normal() as f32 * 3.0).collect();
            assert_eq!(draw(&mut top1, &logits), draw(&mut greedy, &logits));
        }
    }

    #[test]
    fn top_p_keeps_only_the_minimal_nucleus() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 needs the first two (0.8 >= 0.75).
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let mut s = sampler(1.0, 0, 0.75, 5);
        let mut seen = [0usize; 4];
        for _ in 0..4000 {
            seen[draw(&mut s, &logits) as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        // Renormalized inside the nucleus: 0.5 / 0.8 = 0.625.
        let share = seen[0] as f64 / 4000.0;
        assert!((share - 0.625).abs() < 0.03, "{seen:?}");
        // Exactly reaching top_p with the first token keeps only it.
        let mut single = sampler(1.0, 0, 0.5, 5);
        for _ in 0..200 {
            assert_eq!(draw(&mut single, &logits), 0);
        }
    }

    #[test]
    fn top_k_never_draws_outside_the_k_best() {
        let logits = [1.0f32, 4.0, 3.0, 0.0, 3.5, 2.0];
        let mut s = sampler(5.0, 3, 1.0, 8);
        for _ in 0..2000 {
            let id = draw(&mut s, &logits);
            assert!([1, 2, 4].contains(&id), "drew {id}");
        }
    }

    #[test]
    fn same_seed_same_sequence_other_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = sampler(1.0, 0, 1.0, seed);
            (0..200).map(|_| draw(&mut s, &logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn repetition_penalty_lowers_repeated_tokens() {
        let params = |penalty| SamplingParams {
            repetition_penalty: penalty,
            ..SamplingParams::greedy()
        };
        let mut plain = Sampler::new(params(1.0))
            .ok()
            .unwrap_or_else(|| panic!("refused"));
        let mut penalized = Sampler::new(params(2.0))
            .ok()
            .unwrap_or_else(|| panic!("refused"));
        // Token 0 leads by a little; penalizing it hands the argmax to token 1.
        let logits = [3.0f32, 2.0, -1.0];
        assert_eq!(plain.sample(&logits, &[0]).ok(), Some(0));
        assert_eq!(penalized.sample(&logits, &[0]).ok(), Some(1));
        // Negative logits get more negative, not closer to zero.
        let negative = [-1.0f32, -1.5, -3.0];
        assert_eq!(penalized.sample(&negative, &[0, 0, 0]).ok(), Some(1));

        // Under sampling, the penalized token's frequency drops.
        let count = |penalty| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                repetition_penalty: penalty,
                seed: 4,
                ..SamplingParams::greedy()
            })
            .ok()
            .unwrap_or_else(|| panic!("refused"));
            (0..3000)
                .filter(|_| s.sample(&[2.0, 1.0, 1.0], &[0]).ok() == Some(0))
                .count()
        };
        assert!(count(1.5) + 300 < count(1.0));
    }

    #[test]
    fn sampled_frequencies_follow_the_softmax() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 1.5];
        let temperature = 0.8f64;
        let weights: Vec<f64> = logits
            .iter()
            .map(|&l| (f64::from(l) / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut s = sampler(temperature as f32, 0, 1.0, 2024);
        let draws = 10_000;
        let mut counts = [0usize; 5];
        for _ in 0..draws {
            counts[draw(&mut s, &logits) as usize] += 1;
        }
        for (id, w) in weights.iter().enumerate() {
            let expected = w / total;
            let observed = counts[id] as f64 / draws as f64;
            // Five standard deviations of a binomial proportion.
            let tolerance = 5.0 * (expected * (1.0 - expected) / draws as f64).sqrt();
            assert!(
                (observed - expected).abs() < tolerance,
                "token {id}: {observed} vs {expected}"
            );
        }
    }

    #[test]
    fn bad_logits_are_errors_not_panics() {
        let mut s = sampler(1.0, 0, 1.0, 0);
        assert!(s.sample(&[], &[]).is_err());
        assert!(s.sample(&[0.0, f32::NAN], &[]).is_err());
        assert!(s.sample(&[0.0, f32::INFINITY], &[]).is_err());
        assert!(s.sample(&[f32::NEG_INFINITY; 3], &[]).is_err());
        assert!(s.sample(&[0.0, 1.0], &[2]).is_err());
        let mut g = sampler(0.0, 0, 1.0, 0);
        assert!(g.sample(&[f32::NEG_INFINITY; 3], &[]).is_err());
        // Masked tokens are never drawn.
        for _ in 0..500 {
            assert_eq!(
                s.sample(&[f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY], &[])
                    .ok(),
                Some(1)
            );
        }
    }

    #[test]
    fn stop_check_finds_a_stop_and_holds_back_a_partial_one() {
        let m = StopMatcher::new(["</s>", "\nUser:"])
            .ok()
            .unwrap_or_default();
        assert_eq!(m.check("hello"), StopCheck::Continue { safe_len: 5 });
        assert_eq!(m.check("hello</"), StopCheck::Continue { safe_len: 5 });
        assert_eq!(m.check("hello\nUse"), StopCheck::Continue { safe_len: 5 });
        assert_eq!(m.check("hello</s> more"), StopCheck::Stop { text_len: 5 });
        assert_eq!(m.check("a\nUser: b</s>"), StopCheck::Stop { text_len: 1 });
        // "<" alone is held, "<x" is not a prefix of any stop.
        assert_eq!(m.check("1 < 2"), StopCheck::Continue { safe_len: 5 });
        assert_eq!(m.check("1 <"), StopCheck::Continue { safe_len: 2 });
    }

    #[test]
    fn stop_matcher_streams_everything_but_the_stop() {
        let mut m = StopMatcher::new(["END"]).ok().unwrap_or_default();
        let pieces = ["Hello E", "N", "ding E", "N", "D tail"];
        let mut shown = String::new();
        let mut stopped = false;
        for p in pieces {
            let step = m.push(p);
            // Nothing that is still a possible start of "END" may have been shown.
            assert!(!step.emit.ends_with('E') || step.emit.ends_with("Hello E") || stopped);
            shown.push_str(&step.emit);
            if step.stopped {
                stopped = true;
                break;
            }
        }
        assert!(stopped);
        assert_eq!(shown, "Hello ENding ");
        assert_eq!(m.emitted_text(), "Hello ENding ");
        assert_eq!(m.push("more").emit, "");
    }

    #[test]
    fn stop_matcher_flushes_a_held_tail_when_generation_ends() {
        let mut m = StopMatcher::new(["<|im_end|>"]).ok().unwrap_or_default();
        assert_eq!(m.push("answer <|im").emit, "answer ");
        assert_eq!(m.finish(), "<|im");
        assert!(StopMatcher::new([""]).is_err());
    }

    #[test]
    fn stop_matcher_with_multibyte_text() {
        let mut m = StopMatcher::new(["日本"]).ok().unwrap_or_default();
        assert_eq!(m.push("café 日").emit, "café ");
        let step = m.push("本語");
        assert_eq!(
            step,
            StopStep {
                emit: String::new(),
                stopped: true
            }
        );
    }

    proptest::proptest! {
        /// However text is cut into pieces, the streamed output equals the text up to the first
        /// stop string (or all of it), and nothing shown is later retracted.
        #[test]
        fn streamed_stop_output_is_independent_of_chunking(
            text in "[abE N日]{0,30}",
            cuts in proptest::collection::vec(0usize..40, 0..6),
        ) {
            let stops = ["EN", "b日a", "NNN"];
            let reference = StopMatcher::new(stops).ok().unwrap_or_default();
            let expected = match reference.check(&text) {
                StopCheck::Stop { text_len } => text[..text_len].to_owned(),
                StopCheck::Continue { .. } => text.clone(),
            };
            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c.min(text.len())).filter(|&c| text.is_char_boundary(c)).collect();
            bounds.sort_unstable();
            let mut m = StopMatcher::new(stops).ok().unwrap_or_default();
            let mut shown = String::new();
            let mut last = 0;
            let mut stopped = false;
            for cut in bounds.into_iter().chain([text.len()]) {
                let step = m.push(&text[last..cut]);
                shown.push_str(&step.emit);
                last = cut;
                if step.stopped { stopped = true; break; }
            }
            if !stopped { shown.push_str(&m.finish()); }
            proptest::prop_assert_eq!(shown, expected);
        }
    }
}
