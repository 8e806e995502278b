//! Where the zeros of a pruned matrix may fall.
//!
//! Patterns are always read along K (the inputs) within one output row, the direction every
//! format and the 2:4 sparse tensor cores group by. N:M keeps at most `n` of every `m`
//! consecutive inputs; the SlideSparse family (2N-2):2N (6:8, 14:16, ...) is the N:M case with
//! `m = 2N` and `n = 2N - 2`, which decomposes into N-1 overlapping 2:4 windows.

use crate::error::{check_ratio, PruneError, Result};
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    /// Any position; the sparsity ratio is chosen by the caller (per layer if wanted).
    Unstructured,
    /// At most `n` nonzeros in every group of `m` consecutive inputs of a row
    /// (`0 < n <= m`). A trailing partial group of width `w < m` keeps at most `min(n, w)`.
    NM { n: usize, m: usize },
}

/// Largest group width accepted; far beyond any hardware pattern, it only keeps group
/// bookkeeping (and nonsense like `1:100000000`) bounded.
pub const MAX_GROUP: usize = 1024;

impl Pattern {
    /// An N:M pattern, validated: `0 < n <= m <= MAX_GROUP`.
    pub fn nm(n: usize, m: usize) -> Result<Self> {
        if n == 0 || m == 0 || n > m {
            return Err(PruneError::Pattern(format!("{n}:{m}: need 0 < N <= M")));
        }
        if m > MAX_GROUP {
            return Err(PruneError::Pattern(format!(
                "{n}:{m}: group size M must be at most {MAX_GROUP}"
            )));
        }
        Ok(Pattern::NM { n, m })
    }

    /// The SlideSparse pattern (2N-2):2N for `N >= 2` (N = 2 is 2:4, 4 is 6:8, 8 is 14:16).
    pub fn slide(big_n: usize) -> Result<Self> {
        if big_n < 2 {
            return Err(PruneError::Pattern(format!(
                "(2N-2):2N needs N >= 2, got N = {big_n}"
            )));
        }
        let m = big_n
            .checked_mul(2)
            .ok_or_else(|| PruneError::Pattern(format!("(2N-2):2N with N = {big_n} overflows")))?;
        Self::nm(m - 2, m)
    }

    /// `Some(N)` when this is a (2N-2):2N pattern (including 2:4 as N = 2).
    pub fn slide_n(self) -> Option<usize> {
        match self {
            Pattern::NM { n, m } if m >= 4 && m % 2 == 0 && n == m - 2 => Some(m / 2),
            _ => None,
        }
    }

    /// Checks the pattern's own invariants (useful for values built with the enum literal).
    pub fn validate(self) -> Result<Self> {
        match self {
            Pattern::Unstructured => Ok(self),
            Pattern::NM { n, m } => Self::nm(n, m),
        }
    }

    /// The sparsity a mask of this pattern has on `cols` inputs: `ratio` for unstructured (as
    /// realised per row: `round(ratio * cols) / cols`), fixed by the pattern for N:M (the
    /// `ratio` argument is then ignored, as in `sieve_formats::random::sparse_matrix`).
    pub fn row_sparsity(self, ratio: f64, cols: usize) -> Result<f64> {
        check_ratio(ratio)?;
        if cols == 0 {
            return Ok(0.0);
        }
        Ok(self.pruned_per_row(ratio, cols)? as f64 / cols as f64)
    }

    /// Exact number of inputs pruned in each row of `cols` inputs.
    pub fn pruned_per_row(self, ratio: f64, cols: usize) -> Result<usize> {
        check_ratio(ratio)?;
        Ok(match self.validate()? {
            Pattern::Unstructured => unstructured_prune_count(ratio, cols),
            Pattern::NM { n, m } => {
                let full = cols / m;
                let tail = cols % m;
                full * (m - n) + tail.saturating_sub(n)
            }
        })
    }
}

/// `round(ratio * cols)`, never more than `cols`. Shared by mask selection and checks so that
/// both agree to the element.
pub fn unstructured_prune_count(ratio: f64, cols: usize) -> usize {
    ((ratio * cols as f64).round() as usize).min(cols)
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pattern::Unstructured => f.write_str("unstructured"),
            Pattern::NM { n, m } => write!(f, "{n}:{m}"),
        }
    }
}

impl FromStr for Pattern {
    type Err = PruneError;
    /// `unstructured` (case-insensitive) or `N:M` such as `2:4`, `6:8`, `14:16`.
    fn from_str(s: &str) -> Result<Self> {
        let trimmed = s.trim();
        if trimmed.eq_ignore_ascii_case("unstructured") {
            return Ok(Pattern::Unstructured);
        }
        let bad = || {
            PruneError::Pattern(format!(
                "'{s}': expected 'unstructured' or N:M such as 2:4, 6:8, 14:16"
            ))
        };
        let (n, m) = trimmed.split_once(':').ok_or_else(bad)?;
        let n: usize = n.trim().parse().map_err(|_| bad())?;
        let m: usize = m.trim().parse().map_err(|_| bad())?;
        Self::nm(n, m)
    }
}

impl From<Pattern> for sieve_formats::random::Pattern {
    fn from(p: Pattern) -> Self {
        match p {
            Pattern::Unstructured => sieve_formats::random::Pattern::Unstructured,
            Pattern::NM { n, m } => sieve_formats::random::Pattern::NM { n, m },
        }
    }
}

impl TryFrom<sieve_formats::random::Pattern> for Pattern {
    type Error = PruneError;
    fn try_from(p: sieve_formats::random::Pattern) -> Result<Self> {
        match p {
            sieve_formats::random::Pattern::Unstructured => Ok(Pattern::Unstructured),
            sieve_formats::random::Pattern::NM { n, m } => Pattern::nm(n, m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_displays() {
        for s in ["unstructured", "2:4", "6:8", "14:16", "1:1"] {
            let p: Pattern = s.parse().unwrap();
            assert_eq!(p.to_string(), s);
        }
        assert_eq!(
            " 2 : 4 ".parse::<Pattern>().unwrap(),
            Pattern::NM { n: 2, m: 4 }
        );
        assert_eq!(
            "Unstructured".parse::<Pattern>().unwrap(),
            Pattern::Unstructured
        );
    }

    #[test]
    fn rejects_bad_strings() {
        for s in [
            "", "dense", "2:", ":4", "0:4", "5:4", "2:0", "-1:4", "2:4:8", "a:b", "1:2000",
        ] {
            assert!(
                matches!(s.parse::<Pattern>(), Err(PruneError::Pattern(_))),
                "{s:?} should be refused"
            );
        }
    }

    #[test]
    fn slide_family() {
        assert_eq!(Pattern::slide(2).unwrap(), Pattern::NM { n: 2, m: 4 });
        assert_eq!(Pattern::slide(4).unwrap(), Pattern::NM { n: 6, m: 8 });
        assert_eq!(Pattern::slide(8).unwrap(), Pattern::NM { n: 14, m: 16 });
        assert!(Pattern::slide(1).is_err());
        assert!(Pattern::slide(usize::MAX).is_err());
        for big_n in 2..=8 {
            assert_eq!(Pattern::slide(big_n).unwrap().slide_n(), Some(big_n));
        }
        assert_eq!(Pattern::NM { n: 1, m: 4 }.slide_n(), None);
        assert_eq!(Pattern::Unstructured.slide_n(), None);
    }

    #[test]
    fn pruned_counts() {
        assert_eq!(Pattern::Unstructured.pruned_per_row(0.5, 7).unwrap(), 4);
        assert_eq!(Pattern::Unstructured.pruned_per_row(0.0, 7).unwrap(), 0);
        let p68 = Pattern::nm(6, 8).unwrap();
        assert_eq!(p68.pruned_per_row(0.0, 16).unwrap(), 4);
        // 19 = 2 full groups + tail of 3 (<= 6 kept, nothing pruned)
        assert_eq!(p68.pruned_per_row(0.0, 19).unwrap(), 4);
        assert_eq!(
            Pattern::nm(2, 4).unwrap().pruned_per_row(0.3, 7).unwrap(),
            2 + 1
        );
        assert!(Pattern::Unstructured.pruned_per_row(1.0, 7).is_err());
        assert!(Pattern::Unstructured.pruned_per_row(f64::NAN, 7).is_err());
        assert!(Pattern::NM { n: 5, m: 4 }.pruned_per_row(0.0, 8).is_err());
    }

    #[test]
    fn converts_to_formats_pattern() {
        let p = Pattern::nm(6, 8).unwrap();
        let f: sieve_formats::random::Pattern = p.into();
        assert_eq!(Pattern::try_from(f).unwrap(), p);
    }
}
