//! Calibration windows: `count` windows of `len` consecutive tokens cut from one token stream
//! (a tokenized calibration text).
//!
//! Two placements, both deterministic:
//!
//! * [`Placement::Spread`]: windows that never overlap, spread evenly over the whole text. With
//!   `T` tokens, window `i` starts at `floor(i · (T - len) / (count - 1))` (a single window
//!   starts at 0), so the first window starts the text and the last one ends it. Requires
//!   `T >= count · len`; anything shorter would force overlapping (duplicated) calibration data,
//!   so it is refused.
//! * [`Placement::Random { seed }`]: starts drawn uniformly from `0..=T - len` with SplitMix64,
//!   the sampling SparseGPT and Wanda use on C4; windows may overlap. Requires `T >= len`.

use crate::error::{PruneError, Result};
use sieve_formats::random::SplitMix64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    Spread,
    Random { seed: u64 },
}

/// Start offsets of the windows (see the module docs).
pub fn window_starts(
    tokens: usize,
    count: usize,
    len: usize,
    placement: Placement,
) -> Result<Vec<usize>> {
    if count == 0 || len == 0 {
        return Err(PruneError::Option(format!(
            "calibration needs at least one window of at least one token (got {count} windows of {len})"
        )));
    }
    let needed = match placement {
        Placement::Spread => count.checked_mul(len).ok_or_else(|| {
            PruneError::Option(format!("{count} windows of {len} tokens overflow"))
        })?,
        Placement::Random { .. } => len,
    };
    if tokens < needed {
        return Err(PruneError::TextTooShort {
            tokens,
            count,
            len,
            needed,
        });
    }
    let span = tokens - len;
    Ok(match placement {
        Placement::Spread if count == 1 => vec![0],
        Placement::Spread => (0..count)
            .map(|i| ((i as u128 * span as u128) / (count as u128 - 1)) as usize)
            .collect(),
        Placement::Random { seed } => {
            let mut rng = SplitMix64::new(seed);
            (0..count).map(|_| rng.below(span + 1)).collect()
        }
    })
}

/// The windows themselves, borrowed from `tokens`.
pub fn calibration_windows(
    tokens: &[u32],
    count: usize,
    len: usize,
    placement: Placement,
) -> Result<Vec<&[u32]>> {
    Ok(window_starts(tokens.len(), count, len, placement)?
        .into_iter()
        .map(|s| &tokens[s..s + len])
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn spread_windows_are_disjoint_and_cover_the_ends(count in 1usize..40, len in 1usize..50, extra in 0usize..500) {
            let total = count * len + extra;
            let tokens: Vec<u32> = (0..total as u32).collect();
            let windows = calibration_windows(&tokens, count, len, Placement::Spread).unwrap();
            prop_assert_eq!(windows.len(), count);
            prop_assert_eq!(windows[0][0], 0);
            if count > 1 {
                prop_assert_eq!(*windows[count - 1].last().unwrap() as usize, total - 1);
            }
            for w in &windows {
                prop_assert_eq!(w.len(), len);
            }
            for pair in windows.windows(2) {
                prop_assert!(pair[1][0] as usize >= pair[0][0] as usize + len);
            }
        }

        #[test]
        fn random_windows_are_in_range_and_seeded(count in 1usize..40, len in 1usize..50, extra in 0usize..500, seed in any::<u64>()) {
            let total = len + extra;
            let starts = window_starts(total, count, len, Placement::Random { seed }).unwrap();
            prop_assert_eq!(starts.len(), count);
            prop_assert!(starts.iter().all(|&s| s + len <= total));
            prop_assert_eq!(starts, window_starts(total, count, len, Placement::Random { seed }).unwrap());
        }
    }

    #[test]
    fn too_short_is_an_error() {
        let tokens = vec![1u32; 100];
        let err = calibration_windows(&tokens, 4, 32, Placement::Spread).unwrap_err();
        assert_eq!(
            err,
            PruneError::TextTooShort {
                tokens: 100,
                count: 4,
                len: 32,
                needed: 128
            }
        );
        assert!(err.to_string().contains("too short"));
        assert!(calibration_windows(&tokens, 4, 101, Placement::Random { seed: 1 }).is_err());
        assert_eq!(
            calibration_windows(&tokens, 4, 100, Placement::Random { seed: 1 })
                .unwrap()
                .len(),
            4
        );
        assert!(matches!(
            window_starts(100, 0, 10, Placement::Spread),
            Err(PruneError::Option(_))
        ));
        assert!(matches!(
            window_starts(100, 1, 0, Placement::Spread),
            Err(PruneError::Option(_))
        ));
        assert!(window_starts(10, usize::MAX, 2, Placement::Spread).is_err());
    }
}
