//! What `sieve pack` asks of the pipeline ([`PipelineOptions`]), and which pattern each
//! `--format` can store: [`pattern_for_format`] picks the pattern from `--pattern`, `--sp` and
//! `--format`, and [`check_pattern_for_format`] refuses a pattern the format cannot store before
//! any pruning. The `--values` grids and their own check are in `value_grid.rs`, the `--format`
//! choice in `format_choice.rs`.

use super::{FormatChoice, TealAllocation, ValueGrid};
use crate::error::{PruneError, Result};
use crate::methods::Method;
use crate::pattern::Pattern;
use crate::sparsegpt::SparseGptOptions;

#[derive(Clone, Debug)]
pub struct PipelineOptions {
    pub method: Method,
    pub pattern: Pattern,
    /// Static (weight) sparsity per linear.
    pub sp: f64,
    /// Target dynamic (activation) sparsity per site; 0 sets no threshold.
    pub dp: f64,
    pub format: FormatChoice,
    pub sparsegpt: SparseGptOptions,
    /// Activation rows per site kept for the dual-sparsity report.
    pub report_tokens: usize,
    /// How `dp` is spread over each layer's input sites.
    pub teal_allocation: TealAllocation,
    /// What the kept weights are snapped to (int8 and int4 grids only with Balanced-CBC).
    pub values: ValueGrid,
}

/// Name of the GPU format that stores balanced N:16 masks (`balanced-cbc`). It is matched by
/// name so that [`pattern_for_format`] and [`check_pattern_for_format`] already apply to it
/// wherever the format is known by that name.
pub const BALANCED_FORMAT_NAME: &str = "balanced-cbc";

fn is_balanced_format(format: &str) -> bool {
    format.trim().eq_ignore_ascii_case(BALANCED_FORMAT_NAME)
}

/// The pattern `sieve pack` prunes with, from `--pattern` (`None` when not given), `--sp` and
/// the `--format` name:
/// * `--format balanced-cbc`: balanced N:16 with `N` from `sp` by default (and for bare
///   `balanced`); an explicit pattern must be `balanced:N:16` ([`check_pattern_for_format`]);
/// * any other format: unstructured by default, else the pattern as parsed by
///   [`Pattern::parse_with_sp`] (bare `balanced` is N:16 with `N` from `sp`).
pub fn pattern_for_format(pattern: Option<&str>, sp: f64, format: &str) -> Result<Pattern> {
    let chosen = match pattern {
        Some(p) => Pattern::parse_with_sp(p, sp)?,
        None if is_balanced_format(format) => Pattern::balanced_for_sp(sp)?,
        None => Pattern::Unstructured,
    };
    check_pattern_for_format(chosen, format)?;
    Ok(chosen)
}

/// Refuses a pattern the named format cannot store, before any pruning: `balanced-cbc` needs
/// `balanced:N:16` (groups of [`crate::pattern::BALANCED_GROUP`] outputs); `slide` needs a mask
/// with at most 6 nonzeros in every aligned 8 inputs of a row (6:8, or an N:M whose groups tile
/// 8 inputs within that, e.g. 2:4); every other format stores any mask.
pub fn check_pattern_for_format(pattern: Pattern, format: &str) -> Result<()> {
    if format.trim().eq_ignore_ascii_case("slide") {
        let block = 2 * sieve_formats::slide::SlideOptions::default().n;
        let kept = block - 2;
        return match pattern.validate()? {
            Pattern::NM { n, m } if block % m == 0 && n * (block / m) <= kept => Ok(()),
            other => Err(PruneError::Option(format!(
                "--format slide stores {kept}:{block} masks (at most {kept} nonzeros in every \
                 {block} consecutive inputs of a row), which {other} does not guarantee: use \
                 --pattern {kept}:{block} (or 2:4)"
            ))),
        };
    }
    if !is_balanced_format(format) {
        return Ok(());
    }
    let group = crate::pattern::BALANCED_GROUP;
    match pattern.validate()? {
        Pattern::Balanced { m, .. } if m == group => Ok(()),
        other => Err(PruneError::Option(format!(
            "--format {BALANCED_FORMAT_NAME} stores balanced N:{group} masks (at most N nonzeros in \
             every {group} consecutive outputs of an input column), not {other}: use --pattern \
             balanced (N from --sp) or balanced:N:{group}, or leave --pattern out"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_follows_the_format() {
        let b = |n| Pattern::Balanced { n, m: 16 };
        assert_eq!(
            pattern_for_format(None, 0.5, "dense").unwrap(),
            Pattern::Unstructured
        );
        assert_eq!(
            pattern_for_format(None, 0.5, "auto").unwrap(),
            Pattern::Unstructured
        );
        assert_eq!(
            pattern_for_format(Some("balanced"), 0.7, "dense").unwrap(),
            b(5)
        );
        assert_eq!(
            pattern_for_format(Some("2:4"), 0.7, "tiled-cbc").unwrap(),
            Pattern::NM { n: 2, m: 4 }
        );
        // balanced-cbc: the balanced pattern by default, N from --sp
        assert_eq!(
            pattern_for_format(None, 0.5, BALANCED_FORMAT_NAME).unwrap(),
            b(8)
        );
        assert_eq!(
            pattern_for_format(None, 0.3, "Balanced-CBC").unwrap(),
            b(11)
        );
        assert_eq!(
            pattern_for_format(Some("balanced"), 0.7, BALANCED_FORMAT_NAME).unwrap(),
            b(5)
        );
        assert_eq!(
            pattern_for_format(Some("balanced:12:16"), 0.5, BALANCED_FORMAT_NAME).unwrap(),
            b(12)
        );
        for bad in ["unstructured", "2:4", "8:16", "balanced:4:8"] {
            let err = pattern_for_format(Some(bad), 0.5, BALANCED_FORMAT_NAME)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("--format balanced-cbc") && err.contains("--pattern balanced"),
                "{bad}: {err}"
            );
        }
        assert!(check_pattern_for_format(Pattern::Unstructured, "dense").is_ok());
        // Slide: checked before pruning (issue 30: refused only after it).
        for good in ["6:8", "2:4", "3:4", "1:2", "4:8"] {
            let p = Pattern::parse_with_sp(good, 0.5).unwrap();
            assert!(check_pattern_for_format(p, "slide").is_ok(), "{good}");
        }
        for bad in [
            "unstructured",
            "7:8",
            "12:16",
            "14:16",
            "2:3",
            "balanced:8:16",
        ] {
            let err = pattern_for_format(Some(bad), 0.5, "slide")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("--format slide") && err.contains("6:8"),
                "{bad}: {err}"
            );
        }
        let err = pattern_for_format(None, 0.5, "Slide")
            .unwrap_err()
            .to_string();
        assert!(err.contains("--pattern 6:8"), "{err}");
    }
}
