//! The decode engine seam: what the scheduler needs from a model, whatever runs it. The CPU
//! engine is [`CpuEngine`]; a GPU runner plugs in by implementing [`DecodeEngine`] over its own
//! device-resident caches.

use sieve_model::llama::{KvCache, Logits, Model};
use sieve_model::{ModelError, Result};

/// A model with a fixed pool of per-sequence KV cache slots, sized at start-up.
///
/// Slots are numbered `0..slots()`; the scheduler decides which slot a sequence uses and never
/// hands one slot to two live sequences.
pub trait DecodeEngine: Send {
    /// Logits per token.
    fn vocab_size(&self) -> usize;
    /// Cache slots in the pool.
    fn slots(&self) -> usize;
    /// Positions one slot holds (the server's context length).
    fn slot_capacity(&self) -> usize;
    /// Positions slot `slot` holds now.
    fn slot_len(&self, slot: usize) -> usize;
    /// Empties slot `slot`, runs `prompt` into it and returns the last token's logits `[V]`.
    fn prefill(&mut self, slot: usize, prompt: &[u32]) -> Result<Vec<f32>>;
    /// A chunk of a prompt that is not its last: keeps the first `start` positions of slot
    /// `slot` (at most what it holds) and runs `tokens` into the cache at positions `start ..`
    /// (no logits).
    fn extend(&mut self, _slot: usize, _start: usize, _tokens: &[u32]) -> Result<()> {
        Err(ModelError::Unsupported(
            "this engine prefills whole prompts only".into(),
        ))
    }
    /// The last chunk of a prompt: [`DecodeEngine::extend`], then the logits after its last
    /// token. A prompt prefilled in chunks this way gives the logits of one
    /// [`DecodeEngine::prefill`] (up to the kernels a chunk's size selects).
    fn prefill_from(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        if start == 0 {
            return self.prefill(slot, tokens);
        }
        Err(ModelError::Unsupported(
            "this engine prefills whole prompts only".into(),
        ))
    }
    /// The prompt chunks of one scheduler step, each on its own slot (distinct): for each,
    /// what [`DecodeEngine::prefill_from`] (when `last`) or [`DecodeEngine::extend`] returns,
    /// in order. The default runs them one after another; an engine that can run them together
    /// (the GPU engine: one batched pass reads the weights once for all of them) overrides it,
    /// keeping each chunk's answer and its own error for a chunk it refuses.
    fn prefill_chunks(&mut self, chunks: &[PromptChunk<'_>]) -> Vec<Result<Option<Vec<f32>>>> {
        each_chunk_alone(self, chunks)
    }
    /// One decode step: for each `(slot, token)` runs `token` at the slot's next position and
    /// returns `[n][V]` logits in the order given. Slots must be distinct.
    fn decode(&mut self, batch: &[(usize, u32)]) -> Result<Vec<f32>>;
    /// [`DecodeEngine::decode`] for a batch whose sequences all decode greedily without a
    /// repetition penalty: each sequence's next token (the argmax of its logits, the CPU
    /// sampler's rule) chosen by the engine, so that no logits leave a device. `None` when
    /// the engine has no such path (the scheduler then calls `decode` and samples itself).
    /// Each sequence's token, or why its logits had none (NaN, +inf, all -inf): one bad row
    /// fails its own sequence only.
    fn decode_argmax(&mut self, _batch: &[(usize, u32)]) -> Option<Result<Vec<Result<u32>>>> {
        None
    }
    /// [`DecodeEngine::decode`] with each sequence's next token drawn by the engine with
    /// `sampling[i]` (its settings and recent tokens), so that no logits leave a device; one
    /// result per sequence. `None` when the engine has no such path (the scheduler then
    /// samples from `decode`'s logits). An engine's draw may differ from the CPU sampler's for
    /// the same seed (its own generator).
    fn decode_sampled(
        &mut self,
        _batch: &[(usize, u32)],
        _sampling: &[RowSampling<'_>],
    ) -> Option<Result<Vec<Result<u32>>>> {
        None
    }
    /// True when [`DecodeEngine::extend`] works, so long prompts may go in chunks; otherwise
    /// the scheduler prefills every prompt whole.
    fn prefills_in_chunks(&self) -> bool {
        false
    }
    /// Bytes of the KV cache pool (on the device that holds it), for `/metrics`.
    fn kv_cache_bytes(&self) -> usize {
        0
    }
}

/// One prompt chunk of [`DecodeEngine::prefill_chunks`]: `tokens` into slot `slot` at
/// positions `start ..`; `last` when it ends the prompt (its logits are wanted).
#[derive(Clone, Copy, Debug)]
pub struct PromptChunk<'a> {
    pub slot: usize,
    pub start: usize,
    pub tokens: &'a [u32],
    pub last: bool,
}

/// [`DecodeEngine::prefill_chunks`] one chunk after another: [`DecodeEngine::prefill_from`]
/// for a prompt's last chunk, [`DecodeEngine::extend`] for the others.
pub fn each_chunk_alone<E: DecodeEngine + ?Sized>(
    engine: &mut E,
    chunks: &[PromptChunk<'_>],
) -> Vec<Result<Option<Vec<f32>>>> {
    chunks
        .iter()
        .map(|c| {
            if c.last {
                engine.prefill_from(c.slot, c.start, c.tokens).map(Some)
            } else {
                engine.extend(c.slot, c.start, c.tokens).map(|()| None)
            }
        })
        .collect()
}

/// How one sequence of a [`DecodeEngine::decode_sampled`] step draws its token.
#[derive(Clone, Copy, Debug)]
pub struct RowSampling<'a> {
    pub params: &'a sieve_model::sampling::SamplingParams,
    /// The tokens its repetition penalty looks back over.
    pub recent: &'a [u32],
}

/// The CPU engine: sieve-model's forward pass, one [`KvCache`] per slot, batched decode
/// through [`Model::decode_batch`].
pub struct CpuEngine {
    model: Model,
    caches: Vec<KvCache>,
    capacity: usize,
}

impl CpuEngine {
    /// `slots` caches of `context` positions each (capped at the model's context). The cache
    /// memory is allocated zeroed and only touched as positions fill.
    pub fn new(model: Model, slots: usize, context: usize) -> Result<Self> {
        if slots == 0 {
            return Err(ModelError::InvalidArgument(
                "the KV cache pool needs at least one slot".into(),
            ));
        }
        if context < 2 {
            return Err(ModelError::InvalidArgument(format!(
                "the context must hold at least 2 positions, got {context}"
            )));
        }
        let caches = (0..slots)
            .map(|_| model.try_new_cache(context))
            .collect::<Result<Vec<KvCache>>>()?;
        let capacity = caches[0].capacity();
        Ok(Self {
            model,
            caches,
            capacity,
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.caches.len() {
            return Err(ModelError::InvalidArgument(format!(
                "slot {slot} does not exist (the pool has {})",
                self.caches.len()
            )));
        }
        Ok(())
    }
}

impl DecodeEngine for CpuEngine {
    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }
    fn slots(&self) -> usize {
        self.caches.len()
    }
    fn slot_capacity(&self) -> usize {
        self.capacity
    }
    fn slot_len(&self, slot: usize) -> usize {
        self.caches.get(slot).map_or(0, KvCache::len)
    }

    fn prefill(&mut self, slot: usize, prompt: &[u32]) -> Result<Vec<f32>> {
        self.check_slot(slot)?;
        let cache = &mut self.caches[slot];
        cache.clear();
        self.model.forward(prompt, cache, Logits::Last)
    }

    fn extend(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<()> {
        self.prefill_from(slot, start, tokens).map(drop)
    }

    fn prefill_from(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_slot(slot)?;
        let cache = &mut self.caches[slot];
        cache.truncate(start)?;
        self.model.forward(tokens, cache, Logits::Last)
    }

    fn decode(&mut self, batch: &[(usize, u32)]) -> Result<Vec<f32>> {
        for (i, &(slot, _)) in batch.iter().enumerate() {
            self.check_slot(slot)?;
            if batch[..i].iter().any(|&(s, _)| s == slot) {
                return Err(ModelError::InvalidArgument(format!(
                    "slot {slot} appears twice in one decode step"
                )));
            }
        }
        // Hand out each slot's cache in batch order.
        let mut by_slot: Vec<Option<&mut KvCache>> = self.caches.iter_mut().map(Some).collect();
        let mut caches: Vec<&mut KvCache> = Vec::with_capacity(batch.len());
        for &(slot, _) in batch {
            if let Some(cache) = by_slot[slot].take() {
                caches.push(cache);
            }
        }
        let tokens: Vec<u32> = batch.iter().map(|&(_, t)| t).collect();
        // One step is ~150 short parallel regions: keep the pool's workers hot through it.
        let model = &self.model;
        sieve_model::generate::with_hot_workers(|| model.decode_batch(&tokens, &mut caches))
    }

    fn kv_cache_bytes(&self) -> usize {
        self.caches.iter().map(KvCache::bytes).sum()
    }

    /// The same greedy rule as the scheduler's sampler, applied here: the CPU gains nothing
    /// from it, but every greedy request on the CPU then takes the path a GPU engine takes.
    fn decode_argmax(&mut self, batch: &[(usize, u32)]) -> Option<Result<Vec<Result<u32>>>> {
        let vocab = self.vocab_size();
        Some(self.decode(batch).and_then(|logits| {
            let mut greedy = sieve_model::sampling::Sampler::new(
                sieve_model::sampling::SamplingParams::greedy(),
            )?;
            Ok(logits
                .chunks_exact(vocab)
                .map(|row| greedy.sample(row, &[]))
                .collect())
        }))
    }

    fn prefills_in_chunks(&self) -> bool {
        true
    }
}
