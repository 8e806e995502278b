//! The GPU engine: [`DecodeEngine`] over `sieve-gpu`'s [`GpuModel`] with a pool of KV cache
//! slots on the device.
//!
//! A decode step of several running sequences is one batched pass through every layer
//! ([`GpuModel::step_slots`]): the products read their weights once for the whole batch
//! (cuBLAS GEMMs for f16 weights, the low-bit and IE-BME kernels' token batches), each row's
//! RoPE, cache write and attention go to its own slot and position. Models whose formats have
//! no token-batch path (RLC-CSC, Balanced-CBC), steps of one sequence, and Tiled-CBC steps of
//! fewer than `DECODED_MIN_BATCH` sequences replay each slot's captured single-sequence step
//! instead. Either way each sequence's next token is chosen on the device (argmax, or its own
//! sampling settings) and the host reads one id per sequence.
//!
//! The prompt chunks of one scheduler step share batched passes too
//! ([`GpuModel::extend_slots`]): each chunk's RoPE, cache writes and attention are its own
//! slot's, the products read the weights once for all of them.

use crate::engine::{DecodeEngine, PromptChunk, RowSampling};
use sieve_cuda::sampling::SampleArgs;
use sieve_gpu::runner::SlotChunk;
use sieve_gpu::tensor_parallel::TensorParallelGpu;
use sieve_gpu::{GpuError, GpuModel};
use sieve_model::config::ModelConfig;
use sieve_model::llama::Model;
use sieve_model::{ModelError, Result};

/// What the engine asks of the device: one GPU's [`GpuModel`], or a model split over several
/// ([`TensorParallelGpu`], each call then made by every rank and rank 0's answer kept; the
/// tokens every rank chose checked to agree).
pub trait SlotModel: Send {
    fn config(&self) -> &ModelConfig;
    fn capacity(&self) -> usize;
    fn slots(&self) -> usize;
    /// Bytes of the KV cache pool (every rank's together).
    fn kv_cache_bytes(&self) -> usize;
    fn set_slots(&mut self, slots: usize) -> sieve_gpu::Result<()>;
    fn capture_slots(&mut self) -> sieve_gpu::Result<()>;
    fn reserve_scratch(&mut self) -> sieve_gpu::Result<()>;
    fn check_span(&self, slot: usize, start: usize, tokens: &[u32]) -> sieve_gpu::Result<()>;
    fn prefill_slot(&mut self, slot: usize, prompt: &[u32]) -> sieve_gpu::Result<Vec<f32>>;
    fn fill_slot(&mut self, slot: usize, start: usize, tokens: &[u32]) -> sieve_gpu::Result<()>;
    fn extend_slot(
        &mut self,
        slot: usize,
        start: usize,
        tokens: &[u32],
    ) -> sieve_gpu::Result<Vec<f32>>;
    fn extend_slots(
        &mut self,
        chunks: &[SlotChunk<'_>],
    ) -> sieve_gpu::Result<Vec<Option<Vec<f32>>>>;
    fn step_slots(&mut self, batch: &[(usize, usize, u32)]) -> sieve_gpu::Result<Vec<f32>>;
    fn step_slots_argmax(
        &mut self,
        batch: &[(usize, usize, u32)],
    ) -> sieve_gpu::Result<Vec<sieve_gpu::Result<u32>>>;
    fn step_slots_sampled(
        &mut self,
        batch: &[(usize, usize, u32)],
        sampling: &[(SampleArgs, &[u32])],
    ) -> sieve_gpu::Result<Vec<sieve_gpu::Result<u32>>>;
}

impl SlotModel for GpuModel {
    fn config(&self) -> &ModelConfig {
        GpuModel::config(self)
    }
    fn capacity(&self) -> usize {
        GpuModel::capacity(self)
    }
    fn slots(&self) -> usize {
        GpuModel::slots(self)
    }
    fn kv_cache_bytes(&self) -> usize {
        self.report().kv_cache_bytes
    }
    fn set_slots(&mut self, slots: usize) -> sieve_gpu::Result<()> {
        GpuModel::set_slots(self, slots)
    }
    fn capture_slots(&mut self) -> sieve_gpu::Result<()> {
        GpuModel::capture_slots(self).map(|_| ())
    }
    fn reserve_scratch(&mut self) -> sieve_gpu::Result<()> {
        GpuModel::reserve_scratch(self)
    }
    fn check_span(&self, slot: usize, start: usize, tokens: &[u32]) -> sieve_gpu::Result<()> {
        GpuModel::check_span(self, slot, start, tokens)
    }
    fn prefill_slot(&mut self, slot: usize, prompt: &[u32]) -> sieve_gpu::Result<Vec<f32>> {
        GpuModel::prefill_slot(self, slot, prompt)
    }
    fn fill_slot(&mut self, slot: usize, start: usize, tokens: &[u32]) -> sieve_gpu::Result<()> {
        GpuModel::fill_slot(self, slot, start, tokens)
    }
    fn extend_slot(
        &mut self,
        slot: usize,
        start: usize,
        tokens: &[u32],
    ) -> sieve_gpu::Result<Vec<f32>> {
        GpuModel::extend_slot(self, slot, start, tokens)
    }
    fn extend_slots(
        &mut self,
        chunks: &[SlotChunk<'_>],
    ) -> sieve_gpu::Result<Vec<Option<Vec<f32>>>> {
        GpuModel::extend_slots(self, chunks)
    }
    fn step_slots(&mut self, batch: &[(usize, usize, u32)]) -> sieve_gpu::Result<Vec<f32>> {
        GpuModel::step_slots(self, batch)
    }
    fn step_slots_argmax(
        &mut self,
        batch: &[(usize, usize, u32)],
    ) -> sieve_gpu::Result<Vec<sieve_gpu::Result<u32>>> {
        GpuModel::step_slots_argmax(self, batch)
    }
    fn step_slots_sampled(
        &mut self,
        batch: &[(usize, usize, u32)],
        sampling: &[(SampleArgs, &[u32])],
    ) -> sieve_gpu::Result<Vec<sieve_gpu::Result<u32>>> {
        GpuModel::step_slots_sampled(self, batch, sampling)
    }
}

/// Rank 0's answer of a call every rank made.
fn first<T>(answers: Vec<T>) -> sieve_gpu::Result<T> {
    answers
        .into_iter()
        .next()
        .ok_or_else(|| GpuError::InvalidArgument("a split model without ranks".into()))
}

/// Each sequence's token, which every rank must have chosen alike (the same tokens, the same
/// rows refused); if not, the ranks' histories now differ and the split is given up.
fn agreed_tokens(
    split: &mut TensorParallelGpu,
    answers: Vec<Vec<sieve_gpu::Result<u32>>>,
) -> sieve_gpu::Result<Vec<sieve_gpu::Result<u32>>> {
    let mut ranks = answers.into_iter();
    let rank0 = ranks
        .next()
        .ok_or_else(|| GpuError::InvalidArgument("a split model without ranks".into()))?;
    for (r, other) in ranks.enumerate() {
        let same = other.len() == rank0.len()
            && rank0.iter().zip(&other).all(|(a, b)| match (a, b) {
                (Ok(a), Ok(b)) => a == b,
                (Err(_), Err(_)) => true,
                _ => false,
            });
        if !same {
            let show = |v: &[sieve_gpu::Result<u32>]| -> Vec<Option<u32>> {
                v.iter().map(|t| t.as_ref().ok().copied()).collect()
            };
            return Err(split.give_up(format!(
                "rank 0 chose {:?}, rank {} {:?}",
                show(&rank0),
                r + 1,
                show(&other)
            )));
        }
    }
    Ok(rank0)
}

/// The split model's ranks each run the call; the slices a call borrows are copied once into
/// it (every rank's thread reads them).
impl SlotModel for TensorParallelGpu {
    fn config(&self) -> &ModelConfig {
        TensorParallelGpu::config(self)
    }
    fn capacity(&self) -> usize {
        TensorParallelGpu::capacity(self)
    }
    fn slots(&self) -> usize {
        self.slot_count()
    }
    fn kv_cache_bytes(&self) -> usize {
        self.report().rank_kv_bytes.iter().sum()
    }
    fn set_slots(&mut self, slots: usize) -> sieve_gpu::Result<()> {
        self.on_every_rank(move |m| m.set_slots(slots))?;
        self.set_slot_count(slots);
        Ok(())
    }
    fn capture_slots(&mut self) -> sieve_gpu::Result<()> {
        self.on_every_rank(|m| m.capture_slots().map(|_| ()))
            .map(|_| ())
    }
    fn reserve_scratch(&mut self) -> sieve_gpu::Result<()> {
        self.on_every_rank(|m| m.reserve_scratch()).map(|_| ())
    }
    fn check_span(&self, slot: usize, start: usize, tokens: &[u32]) -> sieve_gpu::Result<()> {
        // What each rank would check, from the pool's shape (the same on every rank).
        sieve_gpu::runner::check_span_of(
            self.slot_count(),
            self.capacity(),
            self.config().vocab_size,
            slot,
            start,
            tokens,
        )
    }
    fn prefill_slot(&mut self, slot: usize, prompt: &[u32]) -> sieve_gpu::Result<Vec<f32>> {
        let prompt = prompt.to_vec();
        first(self.on_every_rank(move |m| m.prefill_slot(slot, &prompt))?)
    }
    fn fill_slot(&mut self, slot: usize, start: usize, tokens: &[u32]) -> sieve_gpu::Result<()> {
        let tokens = tokens.to_vec();
        self.on_every_rank(move |m| m.fill_slot(slot, start, &tokens))
            .map(|_| ())
    }
    fn extend_slot(
        &mut self,
        slot: usize,
        start: usize,
        tokens: &[u32],
    ) -> sieve_gpu::Result<Vec<f32>> {
        let tokens = tokens.to_vec();
        first(self.on_every_rank(move |m| m.extend_slot(slot, start, &tokens))?)
    }
    fn extend_slots(
        &mut self,
        chunks: &[SlotChunk<'_>],
    ) -> sieve_gpu::Result<Vec<Option<Vec<f32>>>> {
        let owned: Vec<(usize, usize, Vec<u32>, bool)> = chunks
            .iter()
            .map(|c| (c.slot, c.start, c.tokens.to_vec(), c.logits))
            .collect();
        first(self.on_every_rank(move |m| {
            let spans: Vec<SlotChunk<'_>> = owned
                .iter()
                .map(|(slot, start, tokens, logits)| SlotChunk {
                    slot: *slot,
                    start: *start,
                    tokens,
                    logits: *logits,
                })
                .collect();
            m.extend_slots(&spans)
        })?)
    }
    fn step_slots(&mut self, batch: &[(usize, usize, u32)]) -> sieve_gpu::Result<Vec<f32>> {
        let batch = batch.to_vec();
        first(self.on_every_rank(move |m| m.step_slots(&batch))?)
    }
    fn step_slots_argmax(
        &mut self,
        batch: &[(usize, usize, u32)],
    ) -> sieve_gpu::Result<Vec<sieve_gpu::Result<u32>>> {
        let batch = batch.to_vec();
        let answers = self.on_every_rank(move |m| m.step_slots_argmax(&batch))?;
        agreed_tokens(self, answers)
    }
    fn step_slots_sampled(
        &mut self,
        batch: &[(usize, usize, u32)],
        sampling: &[(SampleArgs, &[u32])],
    ) -> sieve_gpu::Result<Vec<sieve_gpu::Result<u32>>> {
        let batch = batch.to_vec();
        let sampling: Vec<(SampleArgs, Vec<u32>)> =
            sampling.iter().map(|(a, r)| (*a, r.to_vec())).collect();
        let answers = self.on_every_rank(move |m| {
            let rows: Vec<(SampleArgs, &[u32])> =
                sampling.iter().map(|(a, r)| (*a, r.as_slice())).collect();
            m.step_slots_sampled(&batch, &rows)
        })?;
        agreed_tokens(self, answers)
    }
}

pub struct GpuEngine<M: SlotModel = GpuModel> {
    model: M,
    /// Positions each slot holds.
    lens: Vec<usize>,
}

/// The serving seam speaks `ModelError`: a device error keeps its message and cause chain.
fn model_error(e: GpuError) -> ModelError {
    match e {
        GpuError::Model(e) => e,
        other => {
            let mut message = other.to_string();
            let mut cause = std::error::Error::source(&other);
            while let Some(c) = cause {
                message.push_str(": ");
                message.push_str(&c.to_string());
                cause = c.source();
            }
            ModelError::Device(message)
        }
    }
}

impl GpuEngine<GpuModel> {
    /// Uploads `model` to `gpu` with `slots` KV caches of `context` positions (capped at the
    /// model's context), storing what the model is set to ([`Model::set_kv_precision`]).
    /// Fails with the bytes needed when model and pool do not fit.
    /// `prompt16`: keep the prompt passes' f16 copies resident ([`sieve_gpu::matrix::Layouts::prompt16`]).
    pub fn new(
        model: &Model,
        gpu: sieve_cuda::Gpu,
        slots: usize,
        context: usize,
        prompt16: bool,
    ) -> Result<Self> {
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
        // More than one slot: column-major 4-bit matrices keep their tensor-core layout too,
        // for the batch's products (`Layouts::batch`).
        let layouts = sieve_gpu::matrix::Layouts {
            batch: slots > 1,
            prompt16,
            ..Default::default()
        };
        let mut model =
            GpuModel::from_model_with_layouts(gpu, model, context, model.kv_precision(), layouts)
                .and_then(|m| m.with_slots(slots))
                .map_err(model_error)?;
        // Every slot's graph now (about a tenth of a second each), not in a request's TTFT,
        // and the batch scratch, so that what does not fit fails here.
        model.capture_slots().map_err(model_error)?;
        model.reserve_scratch().map_err(model_error)?;
        warm_up(&mut model).map_err(model_error)?;
        Ok(Self {
            lens: vec![0; slots],
            model,
        })
    }

    /// An engine over a model already on the device (a synthetic model of a real shape, built
    /// there layer by layer): its cache becomes a pool of `slots` slots, every slot's step
    /// captured now.
    pub fn from_gpu_model(mut model: GpuModel, slots: usize) -> Result<Self> {
        if slots == 0 {
            return Err(ModelError::InvalidArgument(
                "the KV cache pool needs at least one slot".into(),
            ));
        }
        model.set_slots(slots).map_err(model_error)?;
        model.capture_slots().map_err(model_error)?;
        model.reserve_scratch().map_err(model_error)?;
        warm_up(&mut model).map_err(model_error)?;
        Ok(Self {
            lens: vec![0; slots],
            model,
        })
    }

    /// The device model (upload report, configuration).
    pub fn model(&self) -> &GpuModel {
        &self.model
    }
}

impl GpuEngine<TensorParallelGpu> {
    /// `model` split over GPUs `0..world` (`sieve_gpu::tensor_parallel`), each rank with
    /// `slots` KV cache slots of `context` positions for its KV heads; every slot's step
    /// captured on every rank now.
    pub fn split(
        model: &Model,
        world: usize,
        slots: usize,
        context: usize,
        prompt16: bool,
    ) -> Result<Self> {
        check_pool(slots, context)?;
        let layouts = sieve_gpu::matrix::Layouts {
            batch: slots > 1,
            prompt16,
            ..Default::default()
        };
        let split = TensorParallelGpu::new(model, world, context, model.kv_precision(), layouts)
            .map_err(model_error)?;
        Self::start(split, slots)
    }

    /// A synthetic model of a real shape split over GPUs `0..world`
    /// (`TensorParallelGpu::synthetic`).
    pub fn split_synthetic(
        name: &str,
        options: &sieve_gpu::synthetic::SyntheticOptions,
        world: usize,
        slots: usize,
        context: usize,
        kv: sieve_model::llama::KvPrecision,
    ) -> Result<Self> {
        check_pool(slots, context)?;
        let split =
            TensorParallelGpu::synthetic(name, options, world, context, kv).map_err(model_error)?;
        Self::start(split, slots)
    }

    /// The split model (its report: ranks, memory, bytes sent).
    pub fn model(&self) -> &TensorParallelGpu {
        &self.model
    }
}

/// A pool the engine can hold: a slot or more, of 2 positions or more.
fn check_pool(slots: usize, context: usize) -> Result<()> {
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
    Ok(())
}

impl<M: SlotModel> GpuEngine<M> {
    /// The pool of `slots` slots on `model`, every slot's step captured now (about a tenth of
    /// a second each, not in a request's TTFT), the batch scratch reserved (so that what does
    /// not fit fails here), and the kernels warmed up.
    fn start(mut model: M, slots: usize) -> Result<Self> {
        model.set_slots(slots).map_err(model_error)?;
        model.capture_slots().map_err(model_error)?;
        model.reserve_scratch().map_err(model_error)?;
        warm_up(&mut model).map_err(model_error)?;
        Ok(Self {
            lens: vec![0; slots],
            model,
        })
    }
}

/// Prompt lengths the start-up warm-up prefills: one per kind of batched pass (a few rows,
/// the prompt-attention kernel's 16+, the Tiled-CBC SpMM's last single tile, decode + GEMM past
/// it), so that the kernels and cuBLAS's lazily loaded GEMMs of a first request are loaded
/// before it (a cold first request's TTFT was 294 ms on the 7B shape, H100, 2026-12-05).
const WARM_UP_PROMPTS: [usize; 4] = [2, 17, 64, 128];

/// Runs the warm-up prompts through slot 0 and one decode step of every slot (each slot
/// prefilled with two tokens first). What the slots hold afterwards is overwritten by the
/// requests, which start at position 0.
fn warm_up<M: SlotModel>(model: &mut M) -> sieve_gpu::Result<()> {
    let capacity = model.capacity();
    let vocab = model.config().vocab_size as u32;
    let tokens = |n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i + 1) % vocab).collect() };
    for n in WARM_UP_PROMPTS {
        if n < capacity {
            model.prefill_slot(0, &tokens(n))?;
        }
    }
    if capacity > 3 {
        let mut batch = Vec::with_capacity(model.slots());
        for slot in 0..model.slots() {
            model.prefill_slot(slot, &tokens(2))?;
            batch.push((slot, 2, 1 % vocab));
        }
        for result in model.step_slots_argmax(&batch)? {
            result?;
        }
    }
    Ok(())
}

impl<M: SlotModel> DecodeEngine for GpuEngine<M> {
    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }
    fn slots(&self) -> usize {
        self.model.slots()
    }
    fn slot_capacity(&self) -> usize {
        self.model.capacity()
    }
    fn slot_len(&self, slot: usize) -> usize {
        self.lens.get(slot).copied().unwrap_or(0)
    }

    fn prefill(&mut self, slot: usize, prompt: &[u32]) -> Result<Vec<f32>> {
        if let Some(len) = self.lens.get_mut(slot) {
            *len = 0;
        }
        let logits = self.model.prefill_slot(slot, prompt).map_err(model_error)?;
        self.lens[slot] = prompt.len();
        Ok(logits)
    }

    fn extend(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<()> {
        self.check_start(slot, start)?;
        // From here the device may overwrite positions from `start` on.
        self.lens[slot] = start;
        self.model
            .fill_slot(slot, start, tokens)
            .map_err(model_error)?;
        self.lens[slot] = start + tokens.len();
        Ok(())
    }

    fn prefill_from(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_start(slot, start)?;
        self.lens[slot] = start;
        let logits = self
            .model
            .extend_slot(slot, start, tokens)
            .map_err(model_error)?;
        self.lens[slot] = start + tokens.len();
        Ok(logits)
    }

    /// The chunks share batched passes ([`GpuModel::extend_slots`]): the weights are read once
    /// per pass, not once per prompt. Each chunk is checked alone first, so a bad one fails
    /// by itself; a device error fails every chunk of the call (their slots then hold their
    /// positions before the chunk, and the scheduler frees them).
    fn prefill_chunks(&mut self, chunks: &[PromptChunk<'_>]) -> Vec<Result<Option<Vec<f32>>>> {
        if !shared_prompt_passes() {
            return crate::engine::each_chunk_alone(self, chunks);
        }
        let mut results: Vec<Option<Result<Option<Vec<f32>>>>> = Vec::with_capacity(chunks.len());
        let mut runnable: Vec<usize> = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let checked = self.check_chunk(c).and_then(|()| {
                if runnable.iter().any(|&r| chunks[r].slot == c.slot) {
                    return Err(ModelError::InvalidArgument(format!(
                        "slot {} appears twice in one step's prompt chunks",
                        c.slot
                    )));
                }
                Ok(())
            });
            match checked {
                Ok(()) => {
                    runnable.push(i);
                    results.push(None);
                }
                Err(e) => results.push(Some(Err(e))),
            }
        }
        let spans: Vec<SlotChunk<'_>> = runnable
            .iter()
            .map(|&i| SlotChunk {
                slot: chunks[i].slot,
                start: chunks[i].start,
                tokens: chunks[i].tokens,
                logits: chunks[i].last,
            })
            .collect();
        // From here the device may overwrite each slot's positions from its chunk's start on.
        for s in &spans {
            self.lens[s.slot] = s.start;
        }
        match self.model.extend_slots(&spans) {
            Ok(logits) => {
                for ((&i, s), l) in runnable.iter().zip(&spans).zip(logits) {
                    self.lens[s.slot] = s.start + s.tokens.len();
                    results[i] = Some(Ok(l));
                }
            }
            Err(e) => {
                let message = match model_error(e) {
                    ModelError::Device(m) => m,
                    other => other.to_string(),
                };
                for &i in &runnable {
                    results[i] = Some(Err(ModelError::Device(message.clone())));
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(ModelError::Device("a chunk was not run".into()))))
            .collect()
    }

    fn decode(&mut self, batch: &[(usize, u32)]) -> Result<Vec<f32>> {
        let rows = self.rows(batch)?;
        let logits = self.model.step_slots(&rows).map_err(model_error)?;
        self.advance(batch);
        Ok(logits)
    }

    fn kv_cache_bytes(&self) -> usize {
        self.model.kv_cache_bytes()
    }

    fn decode_argmax(&mut self, batch: &[(usize, u32)]) -> Option<Result<Vec<Result<u32>>>> {
        Some(self.rows(batch).and_then(|rows| {
            let tokens = self.model.step_slots_argmax(&rows).map_err(model_error)?;
            self.advance(batch);
            Ok(tokens.into_iter().map(|t| t.map_err(model_error)).collect())
        }))
    }

    fn decode_sampled(
        &mut self,
        batch: &[(usize, u32)],
        sampling: &[RowSampling<'_>],
    ) -> Option<Result<Vec<Result<u32>>>> {
        Some(self.rows(batch).and_then(|rows| {
            let args: Vec<(sieve_cuda::sampling::SampleArgs, &[u32])> = sampling
                .iter()
                .map(|s| (sieve_gpu::runner::sample_args(s.params), s.recent))
                .collect();
            let tokens = self
                .model
                .step_slots_sampled(&rows, &args)
                .map_err(model_error)?;
            self.advance(batch);
            Ok(tokens.into_iter().map(|t| t.map_err(model_error)).collect())
        }))
    }

    fn prefills_in_chunks(&self) -> bool {
        true
    }
}

/// `SIEVE_SHARED_PROMPT_PASSES=off` in the environment (read once) runs each prompt chunk of
/// a scheduler step in a pass of its own, as before the shared passes: a switch for measuring
/// one against the other, not a setting.
fn shared_prompt_passes() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SIEVE_SHARED_PROMPT_PASSES").as_deref() != Ok("off"))
}

impl<M: SlotModel> GpuEngine<M> {
    /// `(slot, position, token)` of each sequence of a decode step; slots checked.
    fn rows(&self, batch: &[(usize, u32)]) -> Result<Vec<(usize, usize, u32)>> {
        for (i, &(slot, _)) in batch.iter().enumerate() {
            if slot >= self.lens.len() {
                return Err(ModelError::InvalidArgument(format!(
                    "slot {slot} does not exist (the pool has {})",
                    self.lens.len()
                )));
            }
            if batch[..i].iter().any(|&(s, _)| s == slot) {
                return Err(ModelError::InvalidArgument(format!(
                    "slot {slot} appears twice in one decode step"
                )));
            }
        }
        Ok(batch
            .iter()
            .map(|&(slot, token)| (slot, self.lens[slot], token))
            .collect())
    }

    /// A prompt chunk the device would refuse, refused here by itself: its slot, start,
    /// positions and tokens, and that it has some.
    fn check_chunk(&self, c: &PromptChunk<'_>) -> Result<()> {
        if c.slot >= self.lens.len() {
            return Err(ModelError::InvalidArgument(format!(
                "slot {} does not exist (the pool has {})",
                c.slot,
                self.lens.len()
            )));
        }
        if c.tokens.is_empty() {
            return Err(ModelError::InvalidArgument(format!(
                "the prompt chunk for slot {} has no tokens",
                c.slot
            )));
        }
        self.check_start(c.slot, c.start)?;
        self.model
            .check_span(c.slot, c.start, c.tokens)
            .map_err(model_error)
    }

    /// A chunk goes to a slot of the pool and starts at most where the slot's sequence ends.
    fn check_start(&self, slot: usize, start: usize) -> Result<()> {
        if slot >= self.lens.len() {
            return Err(ModelError::InvalidArgument(format!(
                "slot {slot} does not exist (the pool has {})",
                self.lens.len()
            )));
        }
        let held = self.slot_len(slot);
        if start > held {
            return Err(ModelError::InvalidArgument(format!(
                "slot {slot} holds {held} positions; a chunk cannot start at {start}"
            )));
        }
        Ok(())
    }

    /// Every sequence of a finished step holds one position more.
    fn advance(&mut self, batch: &[(usize, u32)]) {
        for &(slot, _) in batch {
            self.lens[slot] += 1;
        }
    }
}
