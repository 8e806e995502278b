//! The next token, chosen on the GPU (`kernels/sampling.cu`): repetition penalty, then greedy
//! argmax or temperature / top-k / top-p sampling, written into the step state so that the
//! next step's embedding reads it without the host. The CPU reference is `sieve-model`'s
//! sampler (the GPU tests of `sieve-gpu` compare the two).

use crate::error::{DriverContext, Result};
use crate::gpu::{grid_cfg, i32_arg, Gpu, KernelFamily};
use crate::product::DevPtr;
use cudarc::driver::PushKernelArg;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "sampling",
    source: include_str!("../kernels/sampling.cu"),
};

/// Sampling parameters as the kernel takes them (sieve-gpu builds them from `sieve-model`'s
/// validated `SamplingParams`; `temperature` 0 is greedy).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleArgs {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub repetition_penalty: f32,
    pub window: usize,
    pub seed: u64,
}

/// Picks the next token from `logits` (V f32, modified in place by the penalty), writes it to
/// `history[state[0] + 1]` and `state[1]`, and advances `state[0]` (see `sampling.cu`).
pub fn sample_token(
    gpu: &Gpu,
    logits: DevPtr,
    vocab: usize,
    args: &SampleArgs,
    state: DevPtr,
    history: DevPtr,
    capacity: usize,
) -> Result<()> {
    let f = gpu.function(&FAMILY, "sample_token")?;
    let v = i32_arg("vocabulary", vocab)?;
    let (k, w, c) = (
        i32_arg("top-k", args.top_k)?,
        i32_arg("penalty window", args.window.min(1024))?,
        i32_arg("context", capacity)?,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&logits)
        .arg(&v)
        .arg(&args.temperature)
        .arg(&k)
        .arg(&args.top_p)
        .arg(&args.repetition_penalty)
        .arg(&w)
        .arg(&args.seed)
        .arg(&state)
        .arg(&history)
        .arg(&c);
    unsafe { b.launch(grid_cfg((1, 1), 1024, 0)) }.during("launching sample_token")?;
    Ok(())
}

/// What [`argmax_rows`] writes for a row whose logits are all -inf.
pub const ARGMAX_ALL_NEG_INF: i32 = -1;
/// What [`argmax_rows`] writes for a row with a NaN or +inf logit.
pub const ARGMAX_NOT_FINITE: i32 = -2;

/// The greedy token of each of `n` rows of `vocab` logits (`[n][vocab]` f32) into `out`
/// (`n` i32): the lowest id of the largest value, or [`ARGMAX_ALL_NEG_INF`] /
/// [`ARGMAX_NOT_FINITE`] (see `sampling.cu`; [`reference::argmax_row`] is the rule).
pub fn argmax_rows(gpu: &Gpu, logits: DevPtr, vocab: usize, n: usize, out: DevPtr) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&FAMILY, "argmax_rows")?;
    let v = i32_arg("vocabulary", vocab)?;
    let rows = u32::try_from(n).map_err(|_| {
        crate::error::CudaError::Unsupported(format!("{n} rows of logits in one launch"))
    })?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&logits).arg(&v).arg(&out);
    unsafe { b.launch(grid_cfg((rows, 1), 1024, 0)) }.during("launching argmax_rows")?;
    Ok(())
}

/// CPU references.
pub mod reference {
    use super::{ARGMAX_ALL_NEG_INF, ARGMAX_NOT_FINITE};

    /// The greedy rule of the CPU sampler: the largest value wins, ties keep the lowest id,
    /// -inf never wins; a NaN or +inf logit makes the row an error.
    pub fn argmax_row(row: &[f32]) -> i32 {
        if row.iter().any(|l| l.is_nan() || *l == f32::INFINITY) {
            return ARGMAX_NOT_FINITE;
        }
        let mut best: Option<(f32, usize)> = None;
        for (id, &l) in row.iter().enumerate() {
            if l > f32::NEG_INFINITY && best.is_none_or(|(b, _)| l > b) {
                best = Some((l, id));
            }
        }
        best.map_or(ARGMAX_ALL_NEG_INF, |(_, id)| id as i32)
    }
}

/// Most recent tokens a row of [`sample_rows`] passes for its repetition penalty (the kernel
/// gives each one thread of its block).
pub const MAX_SAMPLE_WINDOW: usize = 1024;

/// One row's arguments of [`sample_rows`], laid out as `SampleRowArgs` in `sampling.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleRowArgs {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub penalty: f32,
    /// Tokens of the row's window in `recent` (at most the launch's window).
    pub recent_len: i32,
    /// Position of the token that produced the row's logits (the draw's hash input).
    pub position: i32,
    pub seed: u64,
}

// SAFETY: plain old data, the layout of the kernel's struct (checked by a test); all-zero
// bits are a valid value.
unsafe impl cudarc::driver::DeviceRepr for SampleRowArgs {}
unsafe impl cudarc::driver::ValidAsZeroBits for SampleRowArgs {}

impl SampleRowArgs {
    /// The kernel's arguments for `args` at `position` with `recent_len` window tokens.
    pub fn new(args: &SampleArgs, position: usize, recent_len: usize) -> Result<Self> {
        Ok(Self {
            temperature: args.temperature,
            // Any top-k from the vocabulary up keeps every token, as 0 does.
            top_k: i32::try_from(args.top_k).unwrap_or(0),
            top_p: args.top_p,
            penalty: args.repetition_penalty,
            recent_len: i32_arg("penalty window", recent_len.min(MAX_SAMPLE_WINDOW))?,
            position: i32_arg("position", position)?,
            seed: args.seed,
        })
    }
}

/// What [`sample_rows`] writes for a row whose logits are all -inf.
pub const SAMPLE_ALL_NEG_INF: i32 = -1;
/// What [`sample_rows`] writes for a row with a NaN or +inf logit.
pub const SAMPLE_NOT_FINITE: i32 = -2;

/// Each of `n` rows of `vocab` logits (`[n][vocab]` f32, modified in place by the penalties)
/// sampled with its own arguments (`args`: `n` [`SampleRowArgs`] on the device; `recent`: `n`
/// rows of `window` i32, row `r`'s first `args[r].recent_len` its penalty window) into `out`
/// (`n` i32, [`SAMPLE_ALL_NEG_INF`] for a row of -inf only, [`SAMPLE_NOT_FINITE`] for one
/// with NaN or +inf). The rule is `sample_token`'s. `window` is the row stride of `recent`,
/// at most [`MAX_SAMPLE_WINDOW`].
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(
    gpu: &Gpu,
    logits: DevPtr,
    vocab: usize,
    args: DevPtr,
    recent: DevPtr,
    window: usize,
    n: usize,
    out: DevPtr,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&FAMILY, "sample_rows")?;
    let v = i32_arg("vocabulary", vocab)?;
    if window > MAX_SAMPLE_WINDOW {
        return Err(crate::error::CudaError::Unsupported(format!(
            "a penalty window of {window} tokens (at most {MAX_SAMPLE_WINDOW})"
        )));
    }
    let w = i32_arg("penalty window", window)?;
    let rows = u32::try_from(n).map_err(|_| {
        crate::error::CudaError::Unsupported(format!("{n} rows of logits in one launch"))
    })?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&logits)
        .arg(&v)
        .arg(&args)
        .arg(&recent)
        .arg(&w)
        .arg(&out);
    unsafe { b.launch(grid_cfg((rows, 1), 1024, 0)) }.during("launching sample_rows")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `SampleRowArgs` has the layout of the kernel's struct: 4-byte fields, then the u64 seed
    /// at byte 24, 32 bytes in all.
    #[test]
    fn sample_row_args_match_the_kernel_struct() {
        assert_eq!(std::mem::size_of::<SampleRowArgs>(), 32);
        assert_eq!(std::mem::align_of::<SampleRowArgs>(), 8);
        assert_eq!(std::mem::offset_of!(SampleRowArgs, position), 20);
        assert_eq!(std::mem::offset_of!(SampleRowArgs, seed), 24);
        let args = SampleArgs {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            window: 64,
            seed: 9,
        };
        let row = SampleRowArgs::new(&args, 17, 5000).unwrap();
        assert_eq!(row.recent_len as usize, MAX_SAMPLE_WINDOW);
        assert_eq!((row.top_k, row.position, row.seed), (40, 17, 9));
        assert!(SampleRowArgs::new(&args, usize::MAX, 1).is_err());
        let huge = SampleArgs {
            top_k: usize::MAX,
            ..args
        };
        assert_eq!(SampleRowArgs::new(&huge, 1, 1).unwrap().top_k, 0);
    }
}
