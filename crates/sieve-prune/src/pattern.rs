//! Where the zeros of a pruned matrix may fall.
//!
//! N:M patterns are read along K (the inputs) within one output row, the direction the CPU
//! formats and the 2:4 sparse tensor cores group by. N:M keeps at most `n` of every `m`
//! consecutive inputs; the SlideSparse family (2N-2):2N (6:8, 14:16, ...) is the N:M case with
//! `m = 2N` and `n = 2N - 2`, which decomposes into N-1 overlapping 2:4 windows.
//!
//! The balanced pattern ("Balanced Sparsity", Yao et al., AAAI 2019) groups the other way:
//! down each input column, every group of `m` consecutive output rows keeps at most `n`
//! (`balanced:8:16`), so that the threads of a GPU kernel that each own a group of outputs get
//! the same work for every input. `balanced` alone in [`Pattern::parse_with_sp`] means
//! `m = 16` ([`BALANCED_GROUP`]) and `n` from the sparsity ([`balanced_slots_for`]).

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
    /// At most `n` nonzeros in every group of `m` consecutive **outputs** (rows) of each input
    /// column (`0 < n <= m`): rows `m·g .. m·g + m - 1` of column k. A trailing partial group
    /// of `w < m` rows keeps at most `min(n, w)`.
    Balanced { n: usize, m: usize },
}

/// Output rows per group of the balanced pattern the GPU format (`balanced-cbc`) reads.
pub const BALANCED_GROUP: usize = 16;

/// Kept entries per group of [`BALANCED_GROUP`] rows for target sparsity `sp`:
/// `round(16 · (1 - sp))` clamped to `1..=16` (0.5 -> 8:16, 0.7 -> 5:16, realised 0.6875;
/// 0.3 -> 11:16, realised 0.3125). `sp` must be in [0, 1).
pub fn balanced_slots_for(sp: f64) -> Result<usize> {
    check_ratio(sp)?;
    let g = BALANCED_GROUP as f64;
    Ok(((g * (1.0 - sp)).round() as usize).clamp(1, BALANCED_GROUP))
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

    /// A balanced pattern, validated: `0 < n <= m <= MAX_GROUP` (groups of `m` output rows).
    pub fn balanced(n: usize, m: usize) -> Result<Self> {
        if n == 0 || m == 0 || n > m {
            return Err(PruneError::Pattern(format!(
                "balanced:{n}:{m}: need 0 < N <= M (N kept of every M outputs of a column)"
            )));
        }
        if m > MAX_GROUP {
            return Err(PruneError::Pattern(format!(
                "balanced:{n}:{m}: group size M must be at most {MAX_GROUP}"
            )));
        }
        Ok(Pattern::Balanced { n, m })
    }

    /// The balanced N:16 pattern for target sparsity `sp` (`n` from [`balanced_slots_for`]).
    pub fn balanced_for_sp(sp: f64) -> Result<Self> {
        Self::balanced(balanced_slots_for(sp)?, BALANCED_GROUP)
    }

    /// Parses like [`FromStr`], and also accepts `balanced` alone: N:16 balanced with `n` from
    /// `sp` ([`Pattern::balanced_for_sp`]). This is what `sieve pack --pattern` reads.
    pub fn parse_with_sp(s: &str, sp: f64) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("balanced") {
            return Self::balanced_for_sp(sp);
        }
        s.parse()
    }

    /// Whether the groups run down the output rows of a column ([`Pattern::Balanced`]).
    pub fn is_balanced(self) -> bool {
        matches!(self, Pattern::Balanced { .. })
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
            Pattern::Balanced { n, m } => Self::balanced(n, m),
        }
    }

    /// The sparsity a mask of this pattern has on `cols` inputs: `ratio` for unstructured (as
    /// realised per row: `round(ratio * cols) / cols`), fixed by the pattern for N:M (the
    /// `ratio` argument is then ignored, as in `sieve_formats::random::sparse_matrix`).
    /// Balanced patterns fix no per-row count (see [`Pattern::matrix_sparsity`]): an error.
    pub fn row_sparsity(self, ratio: f64, cols: usize) -> Result<f64> {
        check_ratio(ratio)?;
        if cols == 0 {
            return Ok(0.0);
        }
        Ok(self.pruned_per_row(ratio, cols)? as f64 / cols as f64)
    }

    /// Exact number of inputs pruned in each row of `cols` inputs. Balanced patterns fix the
    /// count per column group, not per row: an error (use [`Pattern::pruned_count`]).
    pub fn pruned_per_row(self, ratio: f64, cols: usize) -> Result<usize> {
        check_ratio(ratio)?;
        Ok(match self.validate()? {
            Pattern::Unstructured => unstructured_prune_count(ratio, cols),
            Pattern::NM { n, m } => grouped_prune_count(n, m, cols),
            Pattern::Balanced { n, m } => {
                return Err(PruneError::Pattern(format!(
                    "balanced:{n}:{m} fixes the zeros of every group of {m} outputs of a column, \
                     not of a row: use the whole matrix's count"
                )))
            }
        })
    }

    /// Exact number of entries a mask of this pattern prunes in a `rows x cols` matrix, as
    /// [`crate::select_mask`] chooses it (`ratio` only matters for unstructured). Balanced:
    /// `cols` times the count of one column of `rows` outputs.
    pub fn pruned_count(self, ratio: f64, rows: usize, cols: usize) -> Result<usize> {
        check_ratio(ratio)?;
        Ok(match self.validate()? {
            Pattern::Unstructured | Pattern::NM { .. } => {
                rows * self.pruned_per_row(ratio, cols)?
            }
            Pattern::Balanced { n, m } => cols * grouped_prune_count(n, m, rows),
        })
    }

    /// The realised sparsity of a `rows x cols` mask of this pattern: for balanced N:M with
    /// `m` dividing `rows`, `1 - n/m` (8:16: 0.5, 5:16: 0.6875); a trailing partial group of
    /// `w` rows prunes `w - n` only when `w > n`, so the sparsity is lower otherwise.
    pub fn matrix_sparsity(self, ratio: f64, rows: usize, cols: usize) -> Result<f64> {
        let total = rows.saturating_mul(cols);
        if total == 0 {
            check_ratio(ratio)?;
            return Ok(0.0);
        }
        Ok(self.pruned_count(ratio, rows, cols)? as f64 / total as f64)
    }
}

/// Entries pruned along a line of `len` split into groups of `m` keeping at most `n` each.
fn grouped_prune_count(n: usize, m: usize, len: usize) -> usize {
    (len / m) * (m - n) + (len % m).saturating_sub(n)
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
            Pattern::Balanced { n, m } => write!(f, "balanced:{n}:{m}"),
        }
    }
}

impl FromStr for Pattern {
    type Err = PruneError;
    /// `unstructured` (case-insensitive), `N:M` such as `2:4`, `6:8`, `14:16` (along the
    /// inputs of a row) or `balanced:N:M` such as `balanced:8:16` (down the outputs of a
    /// column). `balanced` alone needs the sparsity: [`Pattern::parse_with_sp`].
    fn from_str(s: &str) -> Result<Self> {
        let trimmed = s.trim();
        if trimmed.eq_ignore_ascii_case("unstructured") {
            return Ok(Pattern::Unstructured);
        }
        if trimmed.eq_ignore_ascii_case("balanced") {
            return Err(PruneError::Pattern(format!(
                "'{s}': bare 'balanced' takes N from the sparsity (sieve pack --sp); \
                 write balanced:N:M such as balanced:8:16 here"
            )));
        }
        let prefix = "balanced:";
        if trimmed.len() > prefix.len()
            && trimmed.is_char_boundary(prefix.len())
            && trimmed[..prefix.len()].eq_ignore_ascii_case(prefix)
        {
            let bad = || {
                PruneError::Pattern(format!(
                    "'{s}': expected balanced:N:M such as balanced:8:16 (N kept of every M \
                     outputs of a column)"
                ))
            };
            let (n, m) = trimmed[prefix.len()..].split_once(':').ok_or_else(bad)?;
            let n: usize = n.trim().parse().map_err(|_| bad())?;
            let m: usize = m.trim().parse().map_err(|_| bad())?;
            return Self::balanced(n, m);
        }
        let bad = || {
            PruneError::Pattern(format!(
                "'{s}': expected 'unstructured', N:M such as 2:4, 6:8, 14:16, or balanced:N:M \
                 such as balanced:8:16"
            ))
        };
        let (n, m) = trimmed.split_once(':').ok_or_else(bad)?;
        let n: usize = n.trim().parse().map_err(|_| bad())?;
        let m: usize = m.trim().parse().map_err(|_| bad())?;
        Self::nm(n, m)
    }
}

impl TryFrom<Pattern> for sieve_formats::random::Pattern {
    type Error = PruneError;
    /// The random-matrix generator has no balanced pattern: refused.
    fn try_from(p: Pattern) -> Result<Self> {
        match p {
            Pattern::Unstructured => Ok(sieve_formats::random::Pattern::Unstructured),
            Pattern::NM { n, m } => Ok(sieve_formats::random::Pattern::NM { n, m }),
            Pattern::Balanced { .. } => Err(PruneError::Pattern(format!(
                "{p}: sieve_formats::random has no balanced pattern"
            ))),
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
        let f = sieve_formats::random::Pattern::try_from(p).unwrap();
        assert_eq!(Pattern::try_from(f).unwrap(), p);
        assert!(
            sieve_formats::random::Pattern::try_from(Pattern::balanced(8, 16).unwrap()).is_err()
        );
    }

    #[test]
    fn balanced_parses_and_displays() {
        for s in [
            "balanced:8:16",
            "balanced:5:16",
            "balanced:1:1",
            "balanced:16:16",
        ] {
            let p: Pattern = s.parse().unwrap();
            assert!(p.is_balanced());
            assert_eq!(p.to_string(), s);
            assert_eq!(p.to_string().parse::<Pattern>().unwrap(), p);
            assert_eq!(
                Pattern::parse_with_sp(s, 0.9).unwrap(),
                p,
                "explicit N wins"
            );
        }
        assert_eq!(
            " Balanced: 8 : 16 ".parse::<Pattern>().unwrap(),
            Pattern::Balanced { n: 8, m: 16 }
        );
        assert_eq!(
            Pattern::parse_with_sp("balanced", 0.5).unwrap(),
            Pattern::Balanced { n: 8, m: 16 }
        );
        assert_eq!(
            Pattern::parse_with_sp(" BALANCED ", 0.7).unwrap(),
            Pattern::Balanced { n: 5, m: 16 }
        );
        assert_eq!(
            Pattern::parse_with_sp("2:4", 0.7).unwrap(),
            Pattern::NM { n: 2, m: 4 }
        );
        assert_eq!(
            Pattern::parse_with_sp("unstructured", 0.7).unwrap(),
            Pattern::Unstructured
        );
    }

    #[test]
    fn balanced_rejects_bad_strings_clearly() {
        for s in [
            "balanced:",
            "balanced:8",
            "balanced:0:16",
            "balanced:17:16",
            "balanced:8:0",
            "balanced:8:16:4",
            "balanced:a:16",
            "balanced:1:2000",
            "balancedx:8:16",
        ] {
            let err = s.parse::<Pattern>().unwrap_err();
            assert!(matches!(err, PruneError::Pattern(_)), "{s:?}: {err}");
            assert!(err.to_string().contains("balanced"), "{s:?}: {err}");
        }
        // Bare `balanced` needs the sparsity, and says where it comes from.
        let err = "balanced".parse::<Pattern>().unwrap_err().to_string();
        assert!(
            err.contains("--sp") && err.contains("balanced:8:16"),
            "{err}"
        );
        assert!(matches!(
            Pattern::parse_with_sp("balanced", 1.0),
            Err(PruneError::Ratio(_))
        ));
        assert!(matches!(
            Pattern::Balanced { n: 0, m: 16 }.validate(),
            Err(PruneError::Pattern(_))
        ));
    }

    #[test]
    fn balanced_slots() {
        assert_eq!(balanced_slots_for(0.5).unwrap(), 8);
        assert_eq!(balanced_slots_for(0.7).unwrap(), 5);
        assert_eq!(balanced_slots_for(0.3).unwrap(), 11);
        assert_eq!(balanced_slots_for(0.0).unwrap(), 16);
        assert_eq!(
            balanced_slots_for(0.99).unwrap(),
            1,
            "clamped to at least 1"
        );
        assert!(balanced_slots_for(1.0).is_err());
        assert!(balanced_slots_for(-0.1).is_err());
        assert!(balanced_slots_for(f64::NAN).is_err());
        let p = Pattern::balanced_for_sp(0.7).unwrap();
        assert_eq!(p, Pattern::Balanced { n: 5, m: 16 });
        assert_eq!(p.matrix_sparsity(0.0, 576, 576).unwrap(), 0.6875);
        assert_eq!(
            Pattern::balanced_for_sp(0.3)
                .unwrap()
                .matrix_sparsity(0.0, 64, 3)
                .unwrap(),
            0.3125
        );
    }

    #[test]
    fn balanced_counts() {
        let p = Pattern::balanced(8, 16).unwrap();
        assert_eq!(p.pruned_count(0.0, 32, 5).unwrap(), 5 * 16);
        assert_eq!(p.matrix_sparsity(0.0, 32, 5).unwrap(), 0.5);
        // 40 rows = 2 groups + a tail of 8 (<= 8 kept, nothing pruned there)
        assert_eq!(p.pruned_count(0.0, 40, 3).unwrap(), 3 * 16);
        // tail of 12 prunes 4
        assert_eq!(p.pruned_count(0.0, 44, 3).unwrap(), 3 * 20);
        assert!(matches!(
            p.pruned_per_row(0.0, 16),
            Err(PruneError::Pattern(_))
        ));
        assert!(p.row_sparsity(0.0, 16).is_err());
        // the other patterns: the whole matrix is rows x the per-row count
        assert_eq!(
            Pattern::nm(2, 4).unwrap().pruned_count(0.0, 3, 8).unwrap(),
            12
        );
        assert_eq!(
            Pattern::Unstructured.matrix_sparsity(0.5, 3, 8).unwrap(),
            0.5
        );
    }
}
