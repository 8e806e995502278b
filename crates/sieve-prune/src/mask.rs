//! Choosing which weights to drop from a score matrix, and checking that a mask obeys a pattern.
//!
//! Scores are "importance": the lowest scores are pruned. Comparison groups follow Wanda: an
//! unstructured mask compares weights **within each output row** and prunes exactly
//! `round(ratio * K)` of them in every row; an N:M mask compares within each group of `m`
//! consecutive inputs of a row and prunes `m - n` of them (a trailing partial group of width
//! `w` prunes `w - n` when `w > n`). Ties are broken by input index (the lower index is pruned
//! first) so that masks are deterministic.
//!
//! A balanced mask ([`Pattern::Balanced`]) compares within each group of `m` consecutive output
//! rows of one input column and keeps the `n` highest scores there (a trailing partial group of
//! `w` rows keeps `min(n, w)`); ties keep the lower row (the higher row is pruned first).

use crate::error::{check_matrix, check_ratio, PruneError, Result};
use crate::pattern::{unstructured_prune_count, Pattern};
use rayon::prelude::*;
use std::cmp::Ordering;

/// Rows below this many elements are processed on the calling thread; spawning tasks for them
/// costs more than the work.
const PAR_MIN_ELEMENTS: usize = 1 << 15;

/// A keep/prune mask over an M x K weight matrix, row-major (`true` = weight kept).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mask {
    rows: usize,
    cols: usize,
    keep: Vec<bool>,
}

impl Mask {
    pub fn new(rows: usize, cols: usize, keep: Vec<bool>) -> Result<Self> {
        if rows == 0 || cols == 0 {
            return Err(PruneError::EmptyMatrix { rows, cols });
        }
        if keep.len() != rows.saturating_mul(cols) {
            return Err(PruneError::Shape {
                what: "mask length (rows * cols)",
                expected: rows.saturating_mul(cols),
                actual: keep.len(),
            });
        }
        Ok(Self { rows, cols, keep })
    }

    /// A mask keeping everything.
    pub fn dense(rows: usize, cols: usize) -> Result<Self> {
        Self::new(rows, cols, vec![true; rows.saturating_mul(cols)])
    }

    /// The mask of a (pruned) weight matrix: a weight is kept when it is not zero (either sign).
    pub fn from_weights(weights: &[f32], rows: usize, cols: usize) -> Result<Self> {
        check_matrix("weights", weights, rows, cols)?;
        Self::new(rows, cols, weights.iter().map(|&w| w != 0.0).collect())
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Row-major keep flags.
    pub fn keep(&self) -> &[bool] {
        &self.keep
    }
    pub fn row(&self, row: usize) -> &[bool] {
        &self.keep[row * self.cols..(row + 1) * self.cols]
    }
    pub fn is_kept(&self, row: usize, col: usize) -> bool {
        self.keep[row * self.cols + col]
    }
    pub fn pruned_count(&self) -> usize {
        self.keep.iter().filter(|k| !**k).count()
    }
    /// Fraction of pruned entries.
    pub fn sparsity(&self) -> f64 {
        self.pruned_count() as f64 / self.keep.len() as f64
    }
    /// Number of pruned entries in each input column (used by the dual-sparsity report).
    pub fn pruned_per_column(&self) -> Vec<usize> {
        let mut counts = vec![0usize; self.cols];
        for row in self.keep.chunks_exact(self.cols) {
            for (c, k) in counts.iter_mut().zip(row) {
                *c += usize::from(!*k);
            }
        }
        counts
    }

    /// Writes +0.0 into every pruned position of `weights` (M x K row-major).
    pub fn apply(&self, weights: &mut [f32]) -> Result<()> {
        if weights.len() != self.keep.len() {
            return Err(PruneError::Shape {
                what: "weights length (mask rows * cols)",
                expected: self.keep.len(),
                actual: weights.len(),
            });
        }
        for (w, k) in weights.iter_mut().zip(&self.keep) {
            if !*k {
                *w = 0.0;
            }
        }
        Ok(())
    }

    /// Checks that the mask obeys `pattern`: unstructured masks must prune exactly
    /// `round(ratio * K)` entries in every row; N:M masks must keep at most `n` entries in every
    /// group of `m` (pruning more is still a valid N:M matrix; `ratio` is ignored for N:M);
    /// balanced masks must keep at most `n` entries in every group of `m` consecutive rows of
    /// each column (again, pruning more is valid; `ratio` is ignored).
    pub fn check(&self, pattern: Pattern, ratio: f64) -> Result<()> {
        check_ratio(ratio)?;
        let violation = |detail: String| PruneError::MaskViolation {
            pattern: pattern.to_string(),
            detail,
        };
        match pattern.validate()? {
            Pattern::Unstructured => {
                let want = unstructured_prune_count(ratio, self.cols);
                for r in 0..self.rows {
                    let pruned = self.row(r).iter().filter(|k| !**k).count();
                    if pruned != want {
                        return Err(violation(format!(
                            "row {r} prunes {pruned} of {} entries, ratio {ratio} needs {want}",
                            self.cols
                        )));
                    }
                }
            }
            Pattern::NM { n, m } => {
                for r in 0..self.rows {
                    for (g, group) in self.row(r).chunks(m).enumerate() {
                        let kept = group.iter().filter(|k| **k).count();
                        if kept > n {
                            return Err(violation(format!(
                                "row {r}, group {g} (columns {}..{}) keeps {kept} > {n}",
                                g * m,
                                g * m + group.len()
                            )));
                        }
                    }
                }
            }
            Pattern::Balanced { n, m } => {
                let mut kept = vec![0usize; self.cols];
                for (g, group) in self.keep.chunks(m * self.cols).enumerate() {
                    kept.iter_mut().for_each(|c| *c = 0);
                    for row in group.chunks_exact(self.cols) {
                        for (c, k) in kept.iter_mut().zip(row) {
                            *c += usize::from(*k);
                        }
                    }
                    if let Some(col) = kept.iter().position(|&c| c > n) {
                        return Err(violation(format!(
                            "column {col}, rows {}..{} keeps {} > {n}",
                            g * m,
                            g * m + group.len() / self.cols,
                            kept[col]
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Total order on (score, index): lower score first, then lower index.
#[inline]
pub(crate) fn score_order(scores: &[f32], a: usize, b: usize) -> Ordering {
    scores[a].total_cmp(&scores[b]).then(a.cmp(&b))
}

/// Marks the `count` lowest-scoring entries of `scores` as pruned (`keep[i] = false`); the
/// others are left untouched. `idx` is scratch space reused across calls.
pub(crate) fn prune_lowest(scores: &[f32], count: usize, keep: &mut [bool], idx: &mut Vec<usize>) {
    let len = scores.len();
    if count == 0 {
        return;
    }
    if count >= len {
        keep.iter_mut().for_each(|k| *k = false);
        return;
    }
    idx.clear();
    idx.extend(0..len);
    idx.select_nth_unstable_by(count - 1, |&a, &b| score_order(scores, a, b));
    for &i in &idx[..count] {
        keep[i] = false;
    }
}

/// Prunes within one row of scores according to an N:M pattern (`m - n` lowest per group).
pub(crate) fn prune_row_nm(
    scores: &[f32],
    n: usize,
    m: usize,
    keep: &mut [bool],
    idx: &mut Vec<usize>,
) {
    for (sg, kg) in scores.chunks(m).zip(keep.chunks_mut(m)) {
        prune_lowest(sg, sg.len().saturating_sub(n), kg, idx);
    }
}

/// Prunes within one group of rows (`scores`, `keep`: `h x cols` row-major, `h <= m`) for the
/// balanced pattern: in every column, all but the `n` highest scores. Ties keep the lower row.
/// `col_scores`, `col_keep` and `idx` are scratch space reused across calls.
pub(crate) fn prune_group_balanced(
    scores: &[f32],
    cols: usize,
    n: usize,
    keep: &mut [bool],
    col_scores: &mut Vec<f32>,
    col_keep: &mut Vec<bool>,
    idx: &mut Vec<usize>,
) {
    let h = scores.len() / cols;
    let count = h.saturating_sub(n);
    if count == 0 {
        return;
    }
    for c in 0..cols {
        // Rows in reverse order: `prune_lowest` prunes the lower index first among equal
        // scores, which is then the higher row.
        col_scores.clear();
        col_scores.extend((0..h).rev().map(|r| scores[r * cols + c]));
        col_keep.clear();
        col_keep.resize(h, true);
        prune_lowest(col_scores, count, col_keep, idx);
        for (t, r) in (0..h).rev().enumerate() {
            keep[r * cols + c] = col_keep[t];
        }
    }
}

/// Chooses the mask of an M x K score matrix (row-major) for `pattern`; `ratio` is the
/// unstructured sparsity (ignored for N:M, whose sparsity the pattern fixes). Per-layer ratios
/// are the caller's choice: call this once per matrix.
pub fn select_mask(
    scores: &[f32],
    rows: usize,
    cols: usize,
    pattern: Pattern,
    ratio: f64,
) -> Result<Mask> {
    check_matrix("scores", scores, rows, cols)?;
    check_ratio(ratio)?;
    let pattern = pattern.validate()?;
    let mut keep = vec![true; rows * cols];
    if let Pattern::Balanced { n, m } = pattern {
        let per_group = |(sg, kg): (&[f32], &mut [bool])| {
            let (mut col_scores, mut col_keep, mut idx) = (Vec::new(), Vec::new(), Vec::new());
            prune_group_balanced(sg, cols, n, kg, &mut col_scores, &mut col_keep, &mut idx);
        };
        let chunk = m * cols;
        if rows * cols >= PAR_MIN_ELEMENTS {
            scores
                .par_chunks(chunk)
                .zip(keep.par_chunks_mut(chunk))
                .for_each(per_group);
        } else {
            scores
                .chunks(chunk)
                .zip(keep.chunks_mut(chunk))
                .for_each(per_group);
        }
        return Mask::new(rows, cols, keep);
    }
    let per_row = |(srow, krow): (&[f32], &mut [bool])| {
        let mut idx = Vec::with_capacity(cols);
        match pattern {
            Pattern::Unstructured => {
                prune_lowest(srow, unstructured_prune_count(ratio, cols), krow, &mut idx)
            }
            Pattern::NM { n, m } => prune_row_nm(srow, n, m, krow, &mut idx),
            Pattern::Balanced { .. } => unreachable!("balanced masks are chosen above"),
        }
    };
    if rows * cols >= PAR_MIN_ELEMENTS {
        scores
            .par_chunks(cols)
            .zip(keep.par_chunks_mut(cols))
            .for_each(per_row);
    } else {
        scores
            .chunks(cols)
            .zip(keep.chunks_mut(cols))
            .for_each(per_row);
    }
    Mask::new(rows, cols, keep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// (rows, cols, scores) with rows and cols drawn from the given ranges.
    fn shaped_scores(
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
        (rows, cols).prop_flat_map(|(r, c)| {
            (
                Just(r),
                Just(c),
                proptest::collection::vec(-4.0f32..4.0, r * c),
            )
        })
    }

    fn scores_strategy() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
        shaped_scores(1..6, 1..70)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn unstructured_exact_per_row((rows, cols, scores) in scores_strategy(), ratio in 0.0f64..0.999) {
            let mask = select_mask(&scores, rows, cols, Pattern::Unstructured, ratio).unwrap();
            mask.check(Pattern::Unstructured, ratio).unwrap();
            let want = unstructured_prune_count(ratio, cols);
            for r in 0..rows {
                let row = &scores[r * cols..(r + 1) * cols];
                let kr = mask.row(r);
                prop_assert_eq!(kr.iter().filter(|k| !**k).count(), want);
                // every kept score is >= every pruned score
                let min_kept = row.iter().zip(kr).filter(|(_, k)| **k).map(|(s, _)| *s).fold(f32::INFINITY, f32::min);
                let max_pruned = row.iter().zip(kr).filter(|(_, k)| !**k).map(|(s, _)| *s).fold(f32::NEG_INFINITY, f32::max);
                prop_assert!(max_pruned <= min_kept);
            }
        }

        #[test]
        fn nm_valid_in_every_group((rows, cols, scores) in scores_strategy(), m in 1usize..17, n_frac in 0.0f64..1.0) {
            let n = ((n_frac * m as f64) as usize).clamp(1, m);
            let pattern = Pattern::nm(n, m).unwrap();
            let mask = select_mask(&scores, rows, cols, pattern, 0.0).unwrap();
            mask.check(pattern, 0.0).unwrap();
            prop_assert_eq!(mask.pruned_count(), rows * pattern.pruned_per_row(0.0, cols).unwrap());
            for r in 0..rows {
                for (sg, kg) in scores[r * cols..(r + 1) * cols].chunks(m).zip(mask.row(r).chunks(m)) {
                    prop_assert_eq!(kg.iter().filter(|k| **k).count(), n.min(sg.len()));
                }
            }
        }

        #[test]
        fn slide_masks_accepted(big_n in 2usize..=8, groups in 1usize..6, rows in 1usize..4, seed in any::<u64>()) {
            let pattern = Pattern::slide(big_n).unwrap();
            let cols = groups * 2 * big_n;
            let mut rng = sieve_formats::random::SplitMix64::new(seed);
            let scores: Vec<f32> = (0..rows * cols).map(|_| rng.normal() as f32).collect();
            let mask = select_mask(&scores, rows, cols, pattern, 0.0).unwrap();
            mask.check(pattern, 0.0).unwrap();
            prop_assert_eq!(mask.sparsity(), 1.0 / big_n as f64);
        }
    }

    fn balanced_strategy() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
        // rows up to 70: several groups of 16 and trailing partial groups of every width
        shaped_scores(1..70, 1..12)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn balanced_keeps_the_largest_per_column_group(
            (rows, cols, scores) in balanced_strategy(),
            m in prop::sample::select(vec![1usize, 4, 7, 16]),
            n_frac in 0.0f64..1.0,
            ratio in 0.0f64..0.99,
        ) {
            let n = ((n_frac * m as f64) as usize).clamp(1, m);
            let pattern = Pattern::balanced(n, m).unwrap();
            let mask = select_mask(&scores, rows, cols, pattern, ratio).unwrap();
            mask.check(pattern, ratio).unwrap();
            prop_assert_eq!(mask.pruned_count(), pattern.pruned_count(ratio, rows, cols).unwrap());
            for c in 0..cols {
                for g0 in (0..rows).step_by(m) {
                    let g1 = (g0 + m).min(rows);
                    let kept: Vec<usize> = (g0..g1).filter(|&r| mask.is_kept(r, c)).collect();
                    prop_assert_eq!(kept.len(), n.min(g1 - g0));
                    // every kept score beats every pruned one, ties going to the lower row
                    for r in g0..g1 {
                        if mask.is_kept(r, c) {
                            continue;
                        }
                        for &k in &kept {
                            let (sk, sr) = (scores[k * cols + c], scores[r * cols + c]);
                            prop_assert!(sk > sr || (sk == sr && k < r), "col {} kept row {} ({}) over row {} ({})", c, k, sk, r, sr);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn balanced_keeps_largest_in_each_group_of_16() {
        // 40 x 2: groups rows 0..16, 16..32 and a tail 32..40; 5:16 keeps 5, 5, 5.
        let (rows, cols) = (40, 2);
        let scores: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                // column 0 grows with the row, column 1 shrinks
                if c == 0 {
                    r as f32
                } else {
                    -(r as f32)
                }
            })
            .collect();
        let p = Pattern::balanced_for_sp(0.7).unwrap();
        let mask = select_mask(&scores, rows, cols, p, 0.0).unwrap();
        mask.check(p, 0.0).unwrap();
        let kept = |c: usize| -> Vec<usize> { (0..rows).filter(|&r| mask.is_kept(r, c)).collect() };
        assert_eq!(
            kept(0),
            vec![11, 12, 13, 14, 15, 27, 28, 29, 30, 31, 35, 36, 37, 38, 39]
        );
        assert_eq!(
            kept(1),
            vec![0, 1, 2, 3, 4, 16, 17, 18, 19, 20, 32, 33, 34, 35, 36]
        );
        // ties: the lower rows are kept
        let mask = select_mask(&[1.0; 16], 16, 1, Pattern::balanced(3, 16).unwrap(), 0.0).unwrap();
        assert_eq!(
            (0..16).filter(|&r| mask.is_kept(r, 0)).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        // a large matrix takes the parallel path and chooses the same
        let (rows, cols) = (100, 400);
        let mut rng = sieve_formats::random::SplitMix64::new(7);
        let scores: Vec<f32> = (0..rows * cols).map(|_| rng.normal() as f32).collect();
        let p = Pattern::balanced(8, 16).unwrap();
        let mask = select_mask(&scores, rows, cols, p, 0.0).unwrap();
        mask.check(p, 0.0).unwrap();
        for c in [0, 199, 399] {
            let col: Vec<f32> = (0..rows).map(|r| scores[r * cols + c]).collect();
            let sub = select_mask(&col, rows, 1, p, 0.0).unwrap();
            for r in 0..rows {
                assert_eq!(sub.is_kept(r, 0), mask.is_kept(r, c));
            }
        }
    }

    #[test]
    fn checker_rejects_balanced_violations() {
        let p = Pattern::balanced(2, 4).unwrap();
        // 6 x 2: column 1 keeps 3 of rows 0..4
        let keep = vec![
            true, true, //
            false, true, //
            true, true, //
            false, false, //
            true, true, //
            true, true, //
        ];
        let mask = Mask::new(6, 2, keep).unwrap();
        let err = mask.check(p, 0.0).unwrap_err();
        assert!(
            err.to_string().contains("column 1, rows 0..4 keeps 3 > 2"),
            "{err}"
        );
        // a row-wise 2:4 mask is not balanced, and the other way around
        let rowwise = Mask::new(4, 4, [true, true, false, false].repeat(4)).unwrap();
        rowwise.check(Pattern::nm(2, 4).unwrap(), 0.0).unwrap();
        assert!(rowwise.check(p, 0.0).is_err());
        let mut colwise = vec![false; 16];
        for c in 0..4 {
            colwise[c] = true;
            colwise[4 + c] = true;
        }
        let colwise = Mask::new(4, 4, colwise).unwrap();
        colwise.check(p, 0.0).unwrap();
        assert!(colwise.check(Pattern::nm(2, 4).unwrap(), 0.0).is_err());
        // the trailing partial group (rows 4..6, both kept) is within min(n, w)
        let tail = Mask::new(6, 1, vec![true, true, false, false, true, true]).unwrap();
        tail.check(p, 0.0).unwrap();
        let tail = Mask::new(6, 1, vec![true, true, false, false, true, true]).unwrap();
        assert!(tail.check(Pattern::balanced(1, 4).unwrap(), 0.0).is_err());
    }

    #[test]
    fn checker_rejects_violations() {
        // 3 kept in a group of 4 is not 2:4
        let mask = Mask::new(
            1,
            8,
            vec![true, true, true, false, true, false, false, true],
        )
        .unwrap();
        let err = mask.check(Pattern::nm(2, 4).unwrap(), 0.0).unwrap_err();
        assert!(matches!(err, PruneError::MaskViolation { .. }), "{err}");
        assert!(mask.check(Pattern::nm(3, 4).unwrap(), 0.0).is_ok());
        // 6:8 with 7 kept
        let mask = Mask::new(1, 8, vec![true, true, true, true, true, true, true, false]).unwrap();
        assert!(mask.check(Pattern::slide(4).unwrap(), 0.0).is_err());
        assert!(mask.check(Pattern::Unstructured, 0.125).is_ok());
        assert!(mask.check(Pattern::Unstructured, 0.25).is_err());
    }

    #[test]
    fn ties_broken_by_index() {
        let mask = select_mask(&[1.0; 4], 1, 4, Pattern::Unstructured, 0.5).unwrap();
        assert_eq!(mask.keep(), &[false, false, true, true]);
    }

    #[test]
    fn typed_errors() {
        assert!(matches!(
            select_mask(&[1.0, 2.0], 1, 2, Pattern::Unstructured, 1.0),
            Err(PruneError::Ratio(_))
        ));
        assert!(matches!(
            select_mask(&[1.0, 2.0], 1, 2, Pattern::Unstructured, -0.1),
            Err(PruneError::Ratio(_))
        ));
        assert!(matches!(
            select_mask(&[1.0, f32::NAN], 1, 2, Pattern::Unstructured, 0.5),
            Err(PruneError::NonFinite { index: 1, .. })
        ));
        assert!(matches!(
            select_mask(&[1.0, 2.0, 3.0], 1, 2, Pattern::Unstructured, 0.5),
            Err(PruneError::Shape { .. })
        ));
        assert!(matches!(
            select_mask(&[], 0, 2, Pattern::Unstructured, 0.5),
            Err(PruneError::EmptyMatrix { .. })
        ));
        assert!(matches!(
            select_mask(&[1.0, 2.0], 1, 2, Pattern::NM { n: 3, m: 2 }, 0.0),
            Err(PruneError::Pattern(_))
        ));
        let mask = Mask::dense(2, 2).unwrap();
        assert!(matches!(
            mask.apply(&mut [0.0; 3]),
            Err(PruneError::Shape { .. })
        ));
    }

    #[test]
    fn apply_writes_positive_zero() {
        let mask = Mask::new(1, 3, vec![true, false, false]).unwrap();
        let mut w = [1.0f32, -2.0, -0.0];
        mask.apply(&mut w).unwrap();
        assert_eq!(w.map(f32::to_bits), [1.0f32.to_bits(), 0, 0]);
        assert_eq!(Mask::from_weights(&w, 1, 3).unwrap(), mask);
        assert_eq!(mask.pruned_per_column(), vec![0, 1, 1]);
    }
}
