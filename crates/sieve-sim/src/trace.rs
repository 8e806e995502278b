//! The trace the simulator consumes: the real RLC-CSC stream of each simulated thread block's
//! weight tile (encoded by `sieve_formats::rlc_csc`) and the activation mask of its columns.
//!
//! A block's tile is generated and encoded on its own (rows `row0 .. row0 + h`, columns
//! `col0 .. col0 + c`), which is exact: RLC-CSC segments never cross a row block or a column, so
//! the tile's segments are byte for byte the segments the full matrix would have if its values
//! in the tile were the same. Only the blocks of the simulated SM are generated, which is what
//! keeps the large LLaMA shapes cheap (see [`crate::sim`]).

use crate::error::{Result, SimError};
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::rlc_csc::{RlcCsc, RlcCscOptions, LANES, LANE_VECTOR, SLAB_ENTRIES};

/// The rows of one slab as a warp sees them: `stripes` (S) stripes of 32 lanes; lane `t` of
/// stripe `s` is logical entry `256 j + 32 s + t`; `valid[s]` has bit `t` set when that entry is
/// a real entry (value or gap padding), not tail padding; `rows[s][t]` its segment-relative row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlabTrace {
    pub stripes: usize,
    pub valid: [u32; LANE_VECTOR],
    pub rows: [[u32; LANES]; LANE_VECTOR],
}

/// Slabs of segment `seg`.
pub fn slab_count(f: &RlcCsc, seg: usize) -> usize {
    (f.slab_start()[seg + 1] - f.slab_start()[seg]) as usize
}

/// Reads slab `j` of segment `seg` from the stream exactly as the kernel does: cursor from
/// `slab_row`, rows by an inclusive prefix sum of `run + 1` in logical order.
pub fn slab_trace(f: &RlcCsc, seg: usize, j: usize) -> SlabTrace {
    let start = f.seg_start()[seg] as usize;
    let end = f.seg_start()[seg + 1] as usize;
    let len = f.seg_len()[seg] as usize;
    let base = start + SLAB_ENTRIES * j;
    let stripes = ((end - base) / LANES).min(LANE_VECTOR);
    let mut cursor = f.slab_row()[f.slab_start()[seg] as usize + j] as u32;
    let mut out = SlabTrace {
        stripes,
        valid: [0; LANE_VECTOR],
        rows: [[0; LANES]; LANE_VECTOR],
    };
    for s in 0..stripes {
        for t in 0..LANES {
            let logical = SLAB_ENTRIES * j + LANES * s + t;
            let pos = base + t * stripes + s;
            let row = cursor + f.run_at(pos);
            out.rows[s][t] = row;
            cursor = row + 1;
            if logical < len {
                out.valid[s] |= 1 << t;
            }
        }
    }
    out
}

/// Shared-memory passes a warp needs to touch `rows[t]` for the lanes in `mask` (32 banks of 4
/// bytes; distinct rows in one bank serialize). 0 when no lane is active.
pub fn bank_passes(rows: &[u32; LANES], mask: u32, banks: usize) -> u32 {
    let mut count = [0u32; 64];
    let banks = banks.clamp(1, 64);
    let mut worst = 0;
    for t in 0..LANES {
        if mask & (1 << t) != 0 {
            let b = rows[t] as usize % banks;
            count[b] += 1;
            worst = worst.max(count[b]);
        }
    }
    worst
}

/// The activation mask of a K-long activation vector with a fraction `dp` inactive (TEAL
/// threshold on |x|, as `sieve bench kernels` does).
pub fn activation_mask(k: usize, dp: f64, seed: u64) -> Result<Vec<bool>> {
    let x = activations(k, seed);
    let t = threshold_for_sparsity(&x, dp)?;
    Ok(match t {
        None => vec![true; k],
        Some(t) => x.iter().map(|v| v.abs() > t).collect(),
    })
}

/// One thread block's weight tile, encoded.
pub struct Tile {
    pub encoded: RlcCsc,
    pub rows: usize,
    pub cols: usize,
}

/// Generates the tile of rows `row0..row0+h`, columns `col0..col0+c` of a random unstructured
/// matrix with sparsity `sp` and encodes it with `block_rows`-row segments and 4-bit runs.
pub fn encode_tile(
    h: usize,
    c: usize,
    sp: f64,
    block_rows: usize,
    index_bits: u32,
    seed: u64,
) -> Result<Tile> {
    if h == 0 || c == 0 {
        return Err(SimError::Option(format!("empty tile {h} x {c}")));
    }
    let w = sparse_matrix(h, c, sp, Pattern::Unstructured, seed)?;
    let encoded = RlcCsc::encode(
        &w,
        &RlcCscOptions {
            index_bits,
            block_rows,
        },
    )?;
    Ok(Tile {
        encoded,
        rows: h,
        cols: c,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sieve_formats::matrix::DenseMatrix;

    #[test]
    fn dense_column_rows_are_consecutive_and_conflict_free() {
        let w = DenseMatrix::new(256, 1, vec![half::f16::ONE; 256]).unwrap();
        let f = RlcCsc::encode(&w, &RlcCscOptions::default()).unwrap();
        let sl = slab_trace(&f, 0, 0);
        assert_eq!(sl.stripes, 8);
        for s in 0..8 {
            assert_eq!(sl.valid[s], u32::MAX);
            for t in 0..32 {
                assert_eq!(sl.rows[s][t], (32 * s + t) as u32);
            }
            assert_eq!(bank_passes(&sl.rows[s], sl.valid[s], 32), 1);
        }
    }

    #[test]
    fn every_other_row_gives_two_way_conflicts() {
        // Nonzeros on even rows: a stripe of 32 entries spans 64 rows, two rows per bank.
        let data: Vec<half::f16> = (0..512)
            .map(|r| {
                if r % 2 == 0 {
                    half::f16::ONE
                } else {
                    half::f16::ZERO
                }
            })
            .collect();
        let w = DenseMatrix::new(512, 1, data).unwrap();
        let f = RlcCsc::encode(&w, &RlcCscOptions::default()).unwrap();
        let sl = slab_trace(&f, 0, 0);
        assert_eq!(sl.stripes, 8);
        assert_eq!(sl.rows[0][1], 2);
        assert_eq!(bank_passes(&sl.rows[0], sl.valid[0], 32), 2);
    }

    #[test]
    fn tail_entries_are_masked() {
        let data: Vec<half::f16> = (0..40).map(|_| half::f16::ONE).collect();
        let w = DenseMatrix::new(40, 1, data).unwrap();
        let f = RlcCsc::encode(&w, &RlcCscOptions::default()).unwrap();
        let sl = slab_trace(&f, 0, 0);
        assert_eq!(sl.stripes, 2);
        assert_eq!(sl.valid[0], u32::MAX);
        assert_eq!(sl.valid[1], 0xff);
    }
}
