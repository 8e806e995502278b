//! Which format each pruned linear is stored in: [`FormatChoice`] (`--format NAME|auto`) and
//! [`encode_choice`], which encodes a linear in the named format or, under `auto`, in the
//! candidate whose CPU product measures fastest on this machine. The timing (cache eviction, a
//! synthetic input at the target activation sparsity) lives here, apart from the pruning.
//!
//! # Format choice (`--format auto`)
//!
//! Each linear is encoded in every format that accepts it, and the one whose CPU product (the
//! kernel a loaded pack runs: `sieve_cpu::format_from_blob`) is fastest on this
//! machine is kept: a short calibration times one matrix-vector product of each candidate,
//! best of [`PRODUCT_REPS`], with the matrix pushed out of the caches first (decode streams
//! weights from memory), on the pack's threads, against a synthetic input whose fraction `dp`
//! of entries falls under the threshold. The sum of the chosen products is the pack's
//! predicted decode time in its projections ([`super::PipelineReport::product_seconds`]).

use crate::error::{PruneError, Result};
use rayon::prelude::*;
use sieve_formats::{DenseMatrix, FormatKind, WeightFormat};
use std::fmt;
use std::str::FromStr;

/// The format every pruned linear is stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatChoice {
    Fixed(FormatKind),
    /// Per linear, the format with the fastest measured CPU product (module docs).
    Auto,
}

impl FromStr for FormatChoice {
    type Err = PruneError;
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        let names: Vec<&str> = FormatKind::ALL.iter().map(|k| k.name()).collect();
        FormatKind::from_name(s.trim())
            .map(Self::Fixed)
            .map_err(|_| {
                PruneError::Option(format!(
                    "unknown format '{}' (known: auto, {})",
                    s.trim(),
                    names.join(", ")
                ))
            })
    }
}

impl fmt::Display for FormatChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Fixed(k) => f.write_str(k.name()),
        }
    }
}

/// Timed products per candidate under `--format auto` (the best one counts).
pub const PRODUCT_REPS: usize = 3;

/// Bytes read between timed products to push the matrix out of every cache level (twice the
/// 32 MiB L3 of the machine this was tuned on).
const EVICT_BYTES: usize = 64 << 20;

/// A linear in its chosen format, with the measured time of its CPU product when the choice
/// was measured (`--format auto`).
pub struct Encoded {
    pub format: Box<dyn WeightFormat>,
    pub product_seconds: Option<f64>,
}

/// Reads a buffer larger than the caches, so that the next product finds its matrix in memory.
fn evict_caches() {
    static BUFFER: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let buf = BUFFER.get_or_init(|| vec![1u8; EVICT_BYTES]);
    let mut sum = 0u8;
    for line in buf.chunks(64) {
        sum = sum.wrapping_add(line[0]);
    }
    std::hint::black_box(sum);
}

/// A deterministic input of `cols` values spread like a normed hidden state (a sum of three
/// uniforms), and the threshold under which a fraction `dp` of them falls (none for `dp` 0).
fn timing_input(cols: usize, dp: f64) -> (Vec<f32>, Option<f32>) {
    let mut s = 0x5eed_u64;
    let mut unit = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let x: Vec<f32> = (0..cols).map(|_| unit() + unit() + unit()).collect();
    if dp <= 0.0 {
        return (x, None);
    }
    let mut mags: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    mags.sort_by(f32::total_cmp);
    let k = ((dp * cols as f64).round() as usize).clamp(1, cols);
    (x, Some(mags[k - 1]))
}

/// The cold-cache time of one matrix-vector product of `format`'s CPU kernel (best of
/// [`PRODUCT_REPS`], after one untimed run).
pub fn time_cpu_product(format: &dyn WeightFormat, dp: f64) -> Result<f64> {
    let fast = sieve_cpu::format_from_blob(&format.to_bytes())?;
    let (x, threshold) = timing_input(fast.cols(), dp);
    let mut y = vec![0f32; fast.rows()];
    fast.matvec(&x, threshold, &mut y)?;
    let mut best = f64::MAX;
    for _ in 0..PRODUCT_REPS {
        evict_caches();
        let start = std::time::Instant::now();
        fast.matvec(&x, threshold, &mut y)?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Encodes `w` in the chosen format (for `Auto`, the one of those that accept it whose CPU
/// product measures fastest; `dp` is the target fraction of inactive inputs).
pub fn encode_choice(w: &DenseMatrix, choice: FormatChoice, dp: f64) -> Result<Encoded> {
    match choice {
        FormatChoice::Fixed(kind) => Ok(Encoded {
            format: sieve_formats::registry::encode_default(kind, w)?,
            product_seconds: None,
        }),
        FormatChoice::Auto => {
            let candidates: Vec<Box<dyn WeightFormat>> = FormatKind::ALL
                .par_iter()
                .filter_map(|&k| match k {
                    // Balanced-CBC stores N slots of every 16 rows, N = the fullest group: on a
                    // matrix not pruned to the balanced pattern N is 16, more bytes than dense
                    // f16, and timing it would only cost pack time.
                    FormatKind::BalancedCbc => {
                        let b = sieve_formats::balanced_cbc::BalancedCbc::encode(w).ok()?;
                        (b.slots() < sieve_formats::balanced_cbc::MAX_SLOTS)
                            .then(|| Box::new(b) as Box<dyn WeightFormat>)
                    }
                    _ => sieve_formats::registry::encode_default(k, w).ok(),
                })
                .collect();
            // One at a time: the products must not share the machine with each other.
            let mut best: Option<Encoded> = None;
            for format in candidates {
                let t = time_cpu_product(format.as_ref(), dp)?;
                if best.as_ref().is_none_or(|b| b.product_seconds > Some(t)) {
                    best = Some(Encoded {
                        format,
                        product_seconds: Some(t),
                    });
                }
            }
            best.ok_or_else(|| PruneError::Option("no format accepts this matrix".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::prune_model;
    use super::super::test_model::{options, source, windows};
    use super::*;
    use crate::methods::Method;
    use sieve_model::llama::Model;

    #[test]
    fn timing_input_puts_dp_of_its_entries_under_the_threshold() {
        for (cols, dp) in [(576, 0.5), (1536, 0.3), (64, 0.9)] {
            let (x, t) = timing_input(cols, dp);
            let t = t.unwrap();
            let off = x.iter().filter(|v| v.abs() <= t).count() as f64 / cols as f64;
            assert!(
                (off - dp).abs() <= 1.0 / cols as f64 + 1e-9,
                "{cols} {dp}: {off}"
            );
        }
        assert!(timing_input(32, 0.0).1.is_none());
    }

    /// `--format auto` times every candidate's CPU product and keeps the fastest: every linear
    /// reports a positive time, the pack's prediction is their sum, the kept format is lossless
    /// or IE-BME (the one lossy candidate), and the per-layer listing names every projection.
    #[test]
    fn auto_keeps_a_measured_format_per_linear() {
        let src = source();
        let mut model = Model::from_source(&src).unwrap();
        let opts = options(Method::Magnitude, "unstructured", 0.5, 0.5, "auto");
        let report = prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
        let mut sum = 0.0;
        for l in &report.linears {
            let t = l.product_seconds.expect("auto measures every linear");
            assert!(t > 0.0 && t < 1.0, "{}: {t}", l.name);
            sum += t;
        }
        assert!((report.product_seconds.unwrap() - sum).abs() <= 1e-12);
        let listing = report.measured_choices();
        assert_eq!(listing.lines().count(), model.layers().len(), "{listing}");
        assert!(
            listing.contains("q_proj ") && listing.contains("down_proj "),
            "{listing}"
        );
        // A fixed format measures nothing.
        let mut model = Model::from_source(&src).unwrap();
        let opts = options(Method::Magnitude, "unstructured", 0.5, 0.0, "dense");
        let report = prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
        assert!(report.product_seconds.is_none());
        assert!(report.measured_choices().is_empty());
        // The timing runs the kernel a loaded pack would, for any candidate.
        let w = model.layers()[0].q_proj.format().decode();
        for kind in FormatKind::ALL {
            if let Ok(f) = sieve_formats::registry::encode_default(kind, &w) {
                let t = time_cpu_product(f.as_ref(), 0.5).unwrap();
                assert!(t > 0.0, "{kind:?}");
            }
        }
    }
}
