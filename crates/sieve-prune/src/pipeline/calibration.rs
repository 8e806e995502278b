//! Calibration windows for `sieve pack`: tokenized from a file or a string and cut into windows
//! spread over the text ([`calibration_windows_from_file`], [`calibration_windows_from_text`];
//! the cutting is [`crate::calib`]'s), and [`check_calibration`], which refuses windows the
//! model cannot run as trained before any text is read.

use crate::error::{PruneError, Result};

/// Refuses calibration windows the model cannot run as trained: `len` tokens past its context
/// (positions it never saw), or no window at all. Checked before the text is read.
pub fn check_calibration(
    config: &sieve_model::config::ModelConfig,
    count: usize,
    len: usize,
) -> Result<()> {
    if count == 0 || len == 0 {
        return Err(PruneError::Option(format!(
            "calibration needs at least one window of at least one token (got {count} windows of {len})"
        )));
    }
    let context = config.max_position_embeddings;
    if len > context {
        return Err(PruneError::Option(format!(
            "calibration windows of {len} tokens are longer than the model's context of {context} \
             positions; use --calib-len {context} or less"
        )));
    }
    Ok(())
}

/// Calibration text tokenized per needed token at most: [`calibration_windows_from_file`]
/// spreads the windows over the first `16 x count x len` tokens of the file (all of it for the
/// WikiText-2 validation split at the default 32 x 1024), so a huge file costs no more.
pub const CALIB_TOKENS_PER_NEEDED: usize = 16;

/// [`calibration_windows_from_text`] on a file read in bounded chunks
/// ([`sieve_model::tokenizer::Tokenizer::encode_file`]), tokenizing at most
/// [`CALIB_TOKENS_PER_NEEDED`] x `count` x `len` tokens. Returns the windows and the number of
/// tokens they were spread over.
pub fn calibration_windows_from_file(
    tokenizer: &sieve_model::tokenizer::Tokenizer,
    path: &std::path::Path,
    count: usize,
    len: usize,
) -> Result<(Vec<Vec<u32>>, usize)> {
    let needed = count.saturating_mul(len);
    let tokens = tokenizer
        .encode_file(
            path,
            false,
            Some(needed.saturating_mul(CALIB_TOKENS_PER_NEEDED)),
        )
        .map_err(|e| {
            PruneError::Option(format!(
                "tokenizing the calibration text: {}",
                e.with_causes()
            ))
        })?;
    let windows =
        crate::calib::calibration_windows(&tokens, count, len, crate::calib::Placement::Spread)?
            .into_iter()
            .map(<[u32]>::to_vec)
            .collect();
    Ok((windows, tokens.len()))
}

/// Tokenizes `text` and cuts `count` non-overlapping windows of `len` tokens spread evenly over
/// it ([`crate::calib::Placement::Spread`]).
pub fn calibration_windows_from_text(
    tokenizer: &sieve_model::tokenizer::Tokenizer,
    text: &str,
    count: usize,
    len: usize,
) -> Result<Vec<Vec<u32>>> {
    let tokens = tokenizer
        .encode(text, false)
        .map_err(|e| PruneError::Option(format!("tokenizing the calibration text: {e}")))?;
    Ok(
        crate::calib::calibration_windows(&tokens, count, len, crate::calib::Placement::Spread)?
            .into_iter()
            .map(<[u32]>::to_vec)
            .collect(),
    )
}
