//! Bitmap-aware row reordering inside one local tile (UnionSparse §V-B, Algorithm 1).
//!
//! A local tile has `n` rows (16 in IE-BME). Its rows are split into `n / RA` groups of `RA`
//! rows; group `i` becomes logical union-mask row `i` and its rows land in row partitions
//! `0..RA` (reordered rows `a * H_B + i`). The union-mask row of a group is the OR of its rows'
//! *folded* masks, where a row's folded mask is the OR of its `CA` column parts (bit `j` set when
//! any of columns `j, j + K_B, ...` is nonzero). The cost of a grouping is the number of active
//! union-mask entries, `Σ_groups popcount(OR folded[r])` (the paper's Eq. 3-4), and reordering
//! looks for the grouping of least cost.
//!
//! * [`dp_grouping`]: the paper's grouped subset DP, exact. `F(S)` is the least cost of the row
//!   set `S`; the smallest row of `S` is always grouped first, so every partition is reached once
//!   (Eq. 5). Memoised top-down over `u16` subsets with generation stamps so the 2^16 tables are
//!   never cleared between tiles.
//! * [`greedy_grouping`]: the fast fallback. Groups are grown from the lowest free row by adding
//!   the row that activates the fewest new entries, then improved by swapping rows between
//!   groups while any swap lowers the cost (a 2-exchange local search).
//!
//! Both results are canonicalised as the paper does (rows sorted inside a group, groups sorted
//! lexicographically) and turned into a permutation by concatenating rows partition-wise:
//! `perm[a * (n / RA) + g] = groups[g][a]`. The identity permutation is the grouping
//! `{i, i + H_B, ..}`; callers compare against it so that reordering never adds entries.

/// Most rows a tile may have (subsets are `u16` masks).
pub const MAX_ROWS: usize = 16;

/// Cost of one group: number of union-mask entries it activates.
#[inline]
fn group_cost(folded: &[u64], group_mask: u32) -> u32 {
    let mut or = 0u64;
    let mut m = group_mask;
    while m != 0 {
        or |= folded[m.trailing_zeros() as usize];
        m &= m - 1;
    }
    or.count_ones()
}

/// Active union-mask entries of the permutation `perm` (`perm[p]` = original row at reordered
/// position `p`), for `RA = ra` row partitions.
pub fn permutation_cost(folded: &[u64], perm: &[u8], ra: usize) -> u32 {
    let hb = perm.len() / ra;
    (0..hb)
        .map(|i| {
            let or = (0..ra).fold(0u64, |acc, a| acc | folded[perm[a * hb + i] as usize]);
            or.count_ones()
        })
        .sum()
}

/// Canonical permutation of a grouping (see the module header).
pub fn grouping_to_permutation(groups: &mut [Vec<u8>]) -> Vec<u8> {
    for g in groups.iter_mut() {
        g.sort_unstable();
    }
    groups.sort();
    let ra = groups.first().map_or(0, |g| g.len());
    let mut perm = Vec::with_capacity(groups.len() * ra);
    for a in 0..ra {
        perm.extend(groups.iter().map(|g| g[a]));
    }
    perm
}

/// Scratch tables of the subset DP, reused across tiles (one per worker thread).
pub struct DpScratch {
    cost: Vec<u16>,
    choice: Vec<u16>,
    stamp: Vec<u32>,
    generation: u32,
}

impl Default for DpScratch {
    fn default() -> Self {
        Self::new()
    }
}

impl DpScratch {
    pub fn new() -> Self {
        Self {
            cost: vec![0; 1 << MAX_ROWS],
            choice: vec![0; 1 << MAX_ROWS],
            stamp: vec![0; 1 << MAX_ROWS],
            generation: 0,
        }
    }
}

/// Calls `f(mask)` for every `k`-subset of the set bits of `pool`.
fn for_each_subset(pool: u32, k: usize, f: &mut impl FnMut(u32)) {
    fn rec(pool: u32, k: usize, acc: u32, f: &mut impl FnMut(u32)) {
        if k == 0 {
            f(acc);
            return;
        }
        if (pool.count_ones() as usize) < k {
            return;
        }
        let low = pool & pool.wrapping_neg();
        let rest = pool & !low;
        rec(rest, k - 1, acc | low, f);
        rec(rest, k, acc, f);
    }
    rec(pool, k, 0, f);
}

fn dp_solve(folded: &[u64], ra: usize, set: u32, s: &mut DpScratch) -> u16 {
    if set == 0 {
        return 0;
    }
    if s.stamp[set as usize] == s.generation {
        return s.cost[set as usize];
    }
    let lowest = set & set.wrapping_neg();
    let rest = set & !lowest;
    let mut best = u16::MAX;
    let mut best_group = 0u16;
    let mut try_group = |group: u32, s: &mut DpScratch| {
        let here = group_cost(folded, group) as u16;
        // Costs are non-negative, so a group alone as costly as the best total cannot win.
        if here >= best {
            return;
        }
        let total = here + dp_solve(folded, ra, set & !group, s);
        if total < best {
            best = total;
            best_group = group as u16;
        }
    };
    if ra == 2 {
        // The common case, without collecting candidates.
        let mut m = rest;
        while m != 0 {
            let partner = m & m.wrapping_neg();
            m &= m - 1;
            try_group(lowest | partner, s);
        }
    } else {
        let mut candidates = Vec::new();
        for_each_subset(rest, ra - 1, &mut |g| candidates.push(g | lowest));
        for group in candidates {
            try_group(group, s);
        }
    }
    s.stamp[set as usize] = s.generation;
    s.cost[set as usize] = best;
    s.choice[set as usize] = best_group;
    best
}

/// Exact least-cost grouping by the paper's subset DP. `folded.len()` rows (at most 16, a
/// multiple of `ra`). Returns the canonical permutation and its cost.
pub fn dp_grouping(folded: &[u64], ra: usize, scratch: &mut DpScratch) -> (Vec<u8>, u32) {
    let n = folded.len();
    debug_assert!(n <= MAX_ROWS && ra >= 1 && n.is_multiple_of(ra));
    scratch.generation = scratch.generation.wrapping_add(1);
    if scratch.generation == 0 {
        // Stamps wrapped around: old stamps could alias the new generation.
        scratch.stamp.iter_mut().for_each(|v| *v = 0);
        scratch.generation = 1;
    }
    let full: u32 = if n == 32 { u32::MAX } else { (1u32 << n) - 1 };
    let cost = dp_solve(folded, ra, full, scratch);
    let mut groups = Vec::with_capacity(n / ra);
    let mut set = full;
    while set != 0 {
        let g = scratch.choice[set as usize] as u32;
        groups.push(mask_rows(g));
        set &= !g;
    }
    (grouping_to_permutation(&mut groups), cost as u32)
}

fn mask_rows(mut m: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(m.count_ones() as usize);
    while m != 0 {
        v.push(m.trailing_zeros() as u8);
        m &= m - 1;
    }
    v
}

/// Fast heuristic grouping: greedy growth plus 2-exchange local search. Returns the canonical
/// permutation and its cost (not necessarily optimal).
pub fn greedy_grouping(folded: &[u64], ra: usize) -> (Vec<u8>, u32) {
    let n = folded.len();
    let mut free: u32 = (1u32 << n) - 1;
    let mut groups: Vec<Vec<u8>> = Vec::with_capacity(n / ra);
    while free != 0 {
        let first = free.trailing_zeros() as usize;
        free &= !(1 << first);
        let mut members = vec![first as u8];
        let mut or = folded[first];
        while members.len() < ra {
            let mut best: Option<(u32, u32, usize)> = None;
            let mut m = free;
            while m != 0 {
                let r = m.trailing_zeros() as usize;
                m &= m - 1;
                // Fewest new entries first; among equals prefer the sparser row, which keeps
                // denser rows available to absorb each other later.
                let key = ((or | folded[r]).count_ones(), folded[r].count_ones(), r);
                if best.is_none_or(|b| key < b) {
                    best = Some(key);
                }
            }
            let Some((_, _, r)) = best else { break };
            free &= !(1 << r);
            members.push(r as u8);
            or |= folded[r];
        }
        groups.push(members);
    }
    let group_or = |g: &[u8]| g.iter().fold(0u64, |a, &r| a | folded[r as usize]);
    // 2-exchange: swap one row of group A with one row of group B when that lowers the total.
    let mut improved = ra > 1 && groups.len() > 1;
    let mut rounds = 0;
    while improved && rounds < 8 {
        improved = false;
        rounds += 1;
        for ga in 0..groups.len() {
            for gb in ga + 1..groups.len() {
                for ia in 0..ra {
                    for ib in 0..ra {
                        let before =
                            group_or(&groups[ga]).count_ones() + group_or(&groups[gb]).count_ones();
                        let (ra_row, rb_row) = (groups[ga][ia], groups[gb][ib]);
                        groups[ga][ia] = rb_row;
                        groups[gb][ib] = ra_row;
                        let after =
                            group_or(&groups[ga]).count_ones() + group_or(&groups[gb]).count_ones();
                        if after < before {
                            improved = true;
                        } else {
                            groups[ga][ia] = ra_row;
                            groups[gb][ib] = rb_row;
                        }
                    }
                }
            }
        }
    }
    let cost = groups.iter().map(|g| group_or(g).count_ones()).sum();
    (grouping_to_permutation(&mut groups), cost)
}

/// Exhaustive search over every partition into groups of `ra` (for tests on small tiles).
pub fn brute_force_cost(folded: &[u64], ra: usize) -> u32 {
    fn rec(folded: &[u64], ra: usize, set: u32) -> u32 {
        if set == 0 {
            return 0;
        }
        let lowest = set & set.wrapping_neg();
        let mut best = u32::MAX;
        let mut all = Vec::new();
        for_each_subset(set & !lowest, ra - 1, &mut |g| all.push(g | lowest));
        for g in all {
            best = best.min(group_cost(folded, g) + rec(folded, ra, set & !g));
        }
        best
    }
    rec(folded, ra, (1u32 << folded.len()) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::SplitMix64;
    use proptest::prelude::*;

    fn random_folded(rng: &mut SplitMix64, n: usize, bits: u32, density: f64) -> Vec<u64> {
        (0..n)
            .map(|_| {
                (0..bits).fold(0u64, |acc, b| {
                    acc | (((rng.next_f64() < density) as u64) << b)
                })
            })
            .collect()
    }

    fn is_permutation(p: &[u8]) -> bool {
        let mut seen = vec![false; p.len()];
        p.iter().all(|&r| {
            let r = r as usize;
            r < seen.len() && !std::mem::replace(&mut seen[r], true)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn dp_matches_brute_force_on_small_tiles(
            seed in any::<u64>(),
            shape in prop::sample::select(vec![(4usize, 2usize), (6, 2), (8, 2), (8, 4), (9, 3), (10, 2), (12, 4), (6, 3)]),
            density in 0.05f64..0.9,
        ) {
            let (n, ra) = shape;
            let mut rng = SplitMix64::new(seed);
            let folded = random_folded(&mut rng, n, 12, density);
            let mut scratch = DpScratch::new();
            let (perm, cost) = dp_grouping(&folded, ra, &mut scratch);
            prop_assert!(is_permutation(&perm));
            prop_assert_eq!(permutation_cost(&folded, &perm, ra), cost);
            prop_assert_eq!(cost, brute_force_cost(&folded, ra));
            let (gperm, gcost) = greedy_grouping(&folded, ra);
            prop_assert!(is_permutation(&gperm));
            prop_assert_eq!(permutation_cost(&folded, &gperm, ra), gcost);
            prop_assert!(gcost >= cost);
        }
    }

    #[test]
    fn dp_matches_brute_force_on_a_full_tile() {
        let mut rng = SplitMix64::new(42);
        let mut scratch = DpScratch::new();
        for density in [0.2, 0.5] {
            let folded = random_folded(&mut rng, 16, 32, density);
            let (perm, cost) = dp_grouping(&folded, 2, &mut scratch);
            assert!(is_permutation(&perm));
            assert_eq!(cost, brute_force_cost(&folded, 2));
            assert!(cost <= permutation_cost(&folded, &(0..16).collect::<Vec<u8>>(), 2));
        }
    }

    #[test]
    fn identity_grouping_is_identity_permutation() {
        let mut groups: Vec<Vec<u8>> = (0..8).map(|i| vec![i + 8, i]).rev().collect();
        assert_eq!(
            grouping_to_permutation(&mut groups),
            (0..16).collect::<Vec<u8>>()
        );
    }

    #[test]
    fn complementary_rows_are_paired() {
        // Rows 0..8 use bits 0..8, rows 8..16 duplicate rows 0..8: pairing row r with r + 8
        // (the identity) is optimal at 8 entries; pairing equal rows is also 8. A shuffled
        // layout where equal rows sit in the same partition must be fixed by the DP.
        let folded: Vec<u64> = (0..16).map(|r| 1u64 << (r / 2)).collect();
        let identity: Vec<u8> = (0..16).collect();
        assert_eq!(permutation_cost(&folded, &identity, 2), 16);
        let (perm, cost) = dp_grouping(&folded, 2, &mut DpScratch::new());
        assert_eq!(cost, 8);
        assert_eq!(permutation_cost(&folded, &perm, 2), 8);
        assert_eq!(greedy_grouping(&folded, 2).1, 8);
    }
}
