//! Balanced-CBC: balanced sparsity (Yao et al. 2019, "Balanced Sparsity for Efficient DNN
//! Inference on GPU") on Celty-style column tiles. Every group of 16 consecutive output rows of
//! one input column keeps at most N nonzeros (N:16 along the outputs) and is stored in exactly N
//! slots, so a warp lane that owns 16 rows reads a fixed N f16 values per active input column
//! with fully coalesced loads and no per-column metadata (no offsets, no counts).
//!
//! # Tiling
//!
//! ```text
//!  W is M x K (rows = outputs, cols = inputs), f16
//!  lane group G = 16 rows; row tile T = 512 rows = up to 32 lanes x 16 rows
//!  RT = ceil(M / 512) row tiles
//!  lanes of tile rt: L(rt) = 32 for rt < RT - 1, and for the last tile
//!                    L(RT - 1) = ceil((M - 512 (RT - 1)) / 16)   (1..=32)
//!  group (k, g) = column k, rows 16 g .. 16 g + 15
//!
//!            k=0     k=1          k=K-1
//!          +-----+ +-----+      +-----+
//!  rt=0    |lane0| |lane0|      |lane0|     rows    0 ..  15
//!          |lane1| |lane1| ...  |lane1|     rows   16 ..  31
//!          | ... | | ... |      | ... |
//!          |ln 31| |ln 31|      |ln 31|     rows  496 .. 511
//!          +-----+ +-----+      +-----+
//!  rt=1    (full tiles as rt=0)             rows  512 .. 1023
//!  ...
//!  rt=RT-1 |lane0| |lane0|      |lane0|     only lanes 0 .. L-1: no lane is stored past the
//!          | ... | | ... |  ... | ... |     last one holding a row < M; rows >= M of that
//!          |lnL-1| |lnL-1|      |lnL-1|     last lane are zero rows
//!          +-----+ +-----+      +-----+
//!  block (rt, k) covers rows 512 rt .. 512 rt + 16 L(rt) - 1 of column k
//! ```
//!
//! E.g. M = 576: tile 0 has 32 lanes, tile 1 has 4 (rows 512..575); M = 520: tile 1 has 1 lane
//! (rows 512..527, rows 520.. zero rows); M = 192: one tile of 12 lanes.
//!
//! # Slots
//!
//! N (1..=16) is one number for the whole matrix: every group holds at most N nonzeros and is
//! stored with exactly N slots, its nonzeros plus `N - count` padding slots at the lowest-row
//! positions of the group whose weight is +0 and that are not already slots (padding value +0).
//! So every lane bitmap has exactly N bits set. Slot i of a lane is its i-th set bit in
//! ascending row order. As in every sieve format only +0 is a zero ([`crate::matrix::is_zero`]):
//! a -0 weight is a nonzero and takes a slot, so decode is bit-exact.
//!
//! # Block of a tile with L lanes
//!
//! ```text
//!  raw(L)    = L (2 N + 2) bytes
//!  stored(L) = raw(L) rounded up to a multiple of 16 (the fill bytes are zero)
//!  full tile: stored(32) = raw(32) = 64 N + 64, a multiple of 64 (block_bytes)
//!
//!  byte offset             size               content (lane j = 0..L-1: rows 512 rt + 16 j ..)
//!  0                       floor(N/2) * 4 L   words: u32 index w * L + j (little-endian) holds
//!                                             slot 2w (low 16 bits) and slot 2w + 1 (high 16
//!                                             bits) of lane j, f16 bits
//!  floor(N/2) * 4 L        2 L (N odd only)   tail: u16 entry j = slot N - 1 of lane j
//!  2 L N                   2 L                bitmaps: u16 entry j, bit r set <=> row
//!                                             512 rt + 16 j + r is a slot of lane j
//!  2 L N + 2 L = raw(L)    stored - raw       zero fill (0..=14 bytes; none when L = 32)
//!
//!  +-------+-------+-----+-------------+------+--------+------+
//!  | w0 xL | w1 xL | ... | w(N/2-1) xL | tail | bitmap | fill |   one block, (rt, k)
//!  +-------+-------+-----+-------------+------+--------+------+
//!   4L B    4L B          4L B          2L B   2L B
//!
//!  N even: N/2 * 4L + 2L = 2 L N + 2 L;  N odd: (N-1)/2 * 4L + 2L + 2L = 2 L N + 2 L
//! ```
//!
//! Blocks are stored rt-major then k: block (rt, k) at byte offset
//! `rt * K * (64 N + 64) + k * stored(L(rt))` (every tile before the last is full), so the image
//! is `(RT - 1) * K * (64 N + 64) + K * stored(L(RT - 1))` bytes; [`BalancedCbc::blocks`] is
//! that whole image, which a GPU uploads as-is. [`BalancedCbc::lanes_in_tile`] and
//! [`BalancedCbc::tile_block_bytes`] give L(rt) and stored(L(rt)).
//!
//! # Storage
//!
//! With S = 32 (RT - 1) + L(RT - 1) stored lanes per column:
//! payload = `S K N 2` bytes (the slot values, padding slots included),
//! metadata = the rest of the image: `S K 2` bytes of lane bitmaps plus `K (stored - raw)` fill
//! bytes of the last tile's blocks, so payload + metadata = `blocks().len()`.

use crate::blob::{ByteReader, ByteWriter};
use crate::error::{FormatError, Result};
use crate::format::{
    column_block_product, ColumnBlocks, FormatKind, Storage, Threshold, WeightFormat,
};
use crate::matrix::{is_zero, DenseMatrix};
use half::f16;
use rayon::prelude::*;

/// Rows a warp lane owns: one group.
pub const LANE_ROWS: usize = 16;
/// Lanes per row tile (one warp).
pub const LANES: usize = 32;
/// Rows per row tile, `LANES * LANE_ROWS`.
pub const TILE_ROWS: usize = LANES * LANE_ROWS;
/// The largest slot count N (a group has 16 rows).
pub const MAX_SLOTS: usize = LANE_ROWS;

/// Stored blocks are padded with zero bytes to a multiple of this many bytes.
pub const BLOCK_ALIGN: usize = 16;

/// Bytes of one full-tile (32-lane) block for `n` slots: `64 n + 64`.
pub const fn block_bytes_for(n: usize) -> usize {
    64 * n + 64
}

/// Bytes of the used part of a block with `lanes` lanes and `n` slots, `lanes (2 n + 2)`.
const fn raw_block_bytes(n: usize, lanes: usize) -> usize {
    lanes * (2 * n + 2)
}

/// Stored bytes of a block with `lanes` lanes (1..=32) and `n` slots: `lanes (2 n + 2)` rounded
/// up to a multiple of 16. `tile_block_bytes_for(n, 32) == block_bytes_for(n)`.
pub const fn tile_block_bytes_for(n: usize, lanes: usize) -> usize {
    raw_block_bytes(n, lanes).next_multiple_of(BLOCK_ALIGN)
}

/// Lanes stored in the last row tile of an M-row matrix: `ceil((M - 512 (RT - 1)) / 16)`.
/// Requires `m >= 1`.
const fn last_tile_lanes(m: usize) -> usize {
    (m - (m - 1) / TILE_ROWS * TILE_ROWS).div_ceil(LANE_ROWS)
}

/// Byte offset inside a block with `l` lanes and `n` slots of slot `i` of lane `lane` (an f16,
/// little-endian).
#[inline(always)]
fn slot_offset(n: usize, l: usize, lane: usize, i: usize) -> usize {
    if i < n & !1 {
        ((i / 2) * l + lane) * 4 + (i % 2) * 2
    } else {
        (n / 2) * 4 * l + 2 * lane
    }
}

/// Byte offset inside a block with `l` lanes and `n` slots of the bitmap of lane `lane`.
#[inline(always)]
fn bitmap_offset(n: usize, l: usize, lane: usize) -> usize {
    2 * l * n + 2 * lane
}

#[inline(always)]
fn read_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

#[inline(always)]
fn write_u16(bytes: &mut [u8], at: usize, v: u16) {
    bytes[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

/// The lane bitmap of a group with nonzero rows `nz` stored in `n` slots: `nz` plus the
/// lowest `n - popcount(nz)` rows not in `nz`. Requires `popcount(nz) <= n <= 16`.
fn slot_bitmap(nz: u16, n: usize) -> u16 {
    let mut bitmap = nz;
    let mut free = !nz;
    for _ in nz.count_ones() as usize..n {
        bitmap |= free & free.wrapping_neg();
        free &= free - 1;
    }
    bitmap
}

/// The slot count N for a target sparsity: `round(16 (1 - sp))` clamped to `1..=16`, i.e. the
/// N of the N:16 pattern whose density is closest to `1 - sp` (sp 0.5 -> 8, 0.7 -> 5,
/// 0.75 -> 4, 0.99 -> 1). `sp` outside `[0, 1)` (or NaN) is [`FormatError::Sparsity`].
pub fn slots_for_sparsity(sp: f64) -> Result<usize> {
    if !(0.0..1.0).contains(&sp) {
        return Err(FormatError::Sparsity(sp));
    }
    Ok(((LANE_ROWS as f64 * (1.0 - sp)).round() as usize).clamp(1, MAX_SLOTS))
}

/// A matrix in Balanced-CBC. See the module documentation for the exact layout.
#[derive(Clone, Debug, PartialEq)]
pub struct BalancedCbc {
    rows: usize,
    cols: usize,
    slots: usize,
    blocks: Vec<u8>,
}

/// Nonzero masks of every group, `masks[g * K + k]` for group `g` (rows 16 g ..) of column k,
/// bit r set <=> `W[16 g + r][k]` is not +0. Groups of rows >= M are not included.
fn group_masks(w: &DenseMatrix) -> Vec<u16> {
    let (m, k) = (w.rows(), w.cols());
    let mut masks = vec![0u16; m.div_ceil(LANE_ROWS) * k];
    masks.par_chunks_mut(k).enumerate().for_each(|(g, out)| {
        for r in 0..LANE_ROWS.min(m - g * LANE_ROWS) {
            for (mask, &v) in out.iter_mut().zip(w.row(g * LANE_ROWS + r)) {
                if !is_zero(v) {
                    *mask |= 1 << r;
                }
            }
        }
    });
    masks
}

impl BalancedCbc {
    /// Encodes `w` with N = the largest nonzero count of any group (at least 1).
    pub fn encode(w: &DenseMatrix) -> Result<Self> {
        let masks = group_masks(w);
        let n = masks
            .par_iter()
            .map(|m| m.count_ones() as usize)
            .max()
            .unwrap_or(0)
            .max(1);
        Self::encode_masks(w, &masks, n)
    }

    /// Encodes `w` with `n` slots per group. `n` outside `1..=16` is [`FormatError::Option`];
    /// a group with more than `n` nonzeros is [`FormatError::Pattern`] naming the first one (in
    /// row-group then column order).
    pub fn encode_with_slots(w: &DenseMatrix, n: usize) -> Result<Self> {
        if !(1..=MAX_SLOTS).contains(&n) {
            return Err(FormatError::Option(format!(
                "balanced-cbc: {n} slots per group, expected 1..={MAX_SLOTS}"
            )));
        }
        let masks = group_masks(w);
        if let Some(i) = masks.iter().position(|m| m.count_ones() as usize > n) {
            let (g, k) = (i / w.cols(), i % w.cols());
            let r0 = g * LANE_ROWS;
            return Err(FormatError::Pattern(format!(
                "balanced-cbc with {n} slots: column {k}, group {g} (rows {r0}..{}) has {} \
                 nonzeros, more than {n} of 16",
                (r0 + LANE_ROWS).min(w.rows()),
                masks[i].count_ones()
            )));
        }
        Self::encode_masks(w, &masks, n)
    }

    fn encode_masks(w: &DenseMatrix, masks: &[u16], n: usize) -> Result<Self> {
        let (m, k) = (w.rows(), w.cols());
        let rt_count = m.div_ceil(TILE_ROWS);
        let last_lanes = last_tile_lanes(m);
        let full = crate::size::product(
            "balanced-cbc blocks",
            &[rt_count - 1, k, block_bytes_for(n)],
        )?;
        let len = crate::size::product(
            "balanced-cbc blocks",
            &[k, tile_block_bytes_for(n, last_lanes)],
        )?
        .checked_add(full)
        .ok_or_else(|| FormatError::Size("balanced-cbc blocks overflow".into()))?;
        let mut blocks = Vec::new();
        blocks.try_reserve_exact(len).map_err(|_| {
            FormatError::Size(format!("balanced-cbc: {len} bytes cannot be allocated"))
        })?;
        blocks.resize(len, 0u8);
        let groups = m.div_ceil(LANE_ROWS);
        // Every group (rt, lane) of the stored lanes holds rows < M except possibly the last
        // lane's rows >= M; the fill bytes stay zero.
        let fill = |rt: usize, col: usize, lanes: usize, block: &mut [u8]| {
            for lane in 0..lanes {
                let g = rt * LANES + lane;
                debug_assert!(g < groups);
                let nz = masks[g * k + col];
                let bitmap = slot_bitmap(nz, n);
                write_u16(block, bitmap_offset(n, lanes, lane), bitmap);
                let mut bits = bitmap;
                let mut slot = 0;
                while bits != 0 {
                    let r = bits.trailing_zeros() as usize;
                    if nz & (1 << r) != 0 {
                        let v = w.get(g * LANE_ROWS + r, col).to_bits();
                        write_u16(block, slot_offset(n, lanes, lane, slot), v);
                    }
                    slot += 1;
                    bits &= bits - 1;
                }
            }
        };
        let (head, last) = blocks.split_at_mut(full);
        head.par_chunks_mut(block_bytes_for(n))
            .enumerate()
            .for_each(|(b, block)| fill(b / k, b % k, LANES, block));
        last.par_chunks_mut(tile_block_bytes_for(n, last_lanes))
            .enumerate()
            .for_each(|(col, block)| fill(rt_count - 1, col, last_lanes, block));
        Ok(Self {
            rows: m,
            cols: k,
            slots: n,
            blocks,
        })
    }

    /// N, the slots stored per group (every lane bitmap has exactly N bits set).
    pub fn slots(&self) -> usize {
        self.slots
    }
    /// Row tiles, `ceil(M / 512)`.
    pub fn row_tiles(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS)
    }
    /// Bytes of one block of a full (32-lane) row tile, `64 N + 64`. Every tile but the last
    /// is full; the last tile's blocks may be shorter, see [`Self::tile_block_bytes`].
    pub fn block_bytes(&self) -> usize {
        block_bytes_for(self.slots)
    }
    /// Lanes stored in row tile `rt` (`rt < row_tiles()`, panics otherwise): 32 for every tile
    /// but the last, `ceil((M - 512 (RT - 1)) / 16)` (1..=32) for the last.
    pub fn lanes_in_tile(&self, rt: usize) -> usize {
        let rt_count = self.row_tiles();
        assert!(rt < rt_count, "row tile {rt} of {rt_count}");
        if rt + 1 < rt_count {
            LANES
        } else {
            last_tile_lanes(self.rows)
        }
    }
    /// Stored bytes of one block of row tile `rt` (`rt < row_tiles()`): `L (2 N + 2)` rounded
    /// up to a multiple of 16 with `L = lanes_in_tile(rt)`; `block_bytes()` for full tiles.
    pub fn tile_block_bytes(&self, rt: usize) -> usize {
        tile_block_bytes_for(self.slots, self.lanes_in_tile(rt))
    }
    /// The whole device image: block (rt, k) at byte offset
    /// `rt * K * block_bytes() + k * tile_block_bytes(rt)`, `tile_block_bytes(rt)` long
    /// (module documentation).
    pub fn blocks(&self) -> &[u8] {
        &self.blocks
    }

    /// Block (rt, col) and its lane count.
    #[inline(always)]
    fn block(&self, rt: usize, col: usize) -> (&[u8], usize) {
        let lanes = self.lanes_in_tile(rt);
        let bb = tile_block_bytes_for(self.slots, lanes);
        let at = rt * self.cols * self.block_bytes() + col * bb;
        (&self.blocks[at..at + bb], lanes)
    }

    pub fn read_payload(r: &mut ByteReader) -> Result<Self> {
        let corrupt = |msg: String| FormatError::Corrupt(format!("balanced-cbc payload: {msg}"));
        let rows = r.usize()?;
        let cols = r.usize()?;
        let slots = r.usize()?;
        if rows == 0 || cols == 0 {
            return Err(corrupt(format!("empty shape {rows} x {cols}")));
        }
        if rows
            .checked_mul(cols)
            .is_none_or(|e| e > isize::MAX as usize / 2)
        {
            return Err(corrupt(format!("shape {rows} x {cols} too large")));
        }
        if !(1..=MAX_SLOTS).contains(&slots) {
            return Err(corrupt(format!(
                "{slots} slots per group, expected 1..={MAX_SLOTS}"
            )));
        }
        // (RT - 1) K (64 N + 64) + K stored(L(RT - 1)), every step checked.
        let len = (rows.div_ceil(TILE_ROWS) - 1)
            .checked_mul(cols)
            .and_then(|b| b.checked_mul(block_bytes_for(slots)))
            .and_then(|full| {
                cols.checked_mul(tile_block_bytes_for(slots, last_tile_lanes(rows)))
                    .and_then(|last| full.checked_add(last))
            })
            .ok_or_else(|| corrupt(format!("{rows} x {cols} with {slots} slots overflows")))?;
        // `bytes` checks the length against what remains before anything is allocated.
        let blocks = r.bytes(len)?.to_vec();
        let out = Self {
            rows,
            cols,
            slots,
            blocks,
        };
        out.validate_blocks().map_err(corrupt)?;
        Ok(out)
    }

    /// Checks every lane of every block: N bits set, finite values, no nonzero at rows >= M, and
    /// padding slots (+0 values) exactly at the lowest free rows, as [`Self::encode`] places
    /// them, and zero fill bytes, so that a blob that loads re-encodes to the same bytes.
    /// Requires `blocks.len()` to be the image length for the shape and N.
    fn validate_blocks(&self) -> std::result::Result<(), String> {
        let (n, k) = (self.slots, self.cols);
        let rt_count = self.row_tiles();
        let last_lanes = last_tile_lanes(self.rows);
        let (head, last) = self
            .blocks
            .split_at((rt_count - 1) * k * self.block_bytes());
        head.par_chunks(self.block_bytes())
            .enumerate()
            .try_for_each(|(b, block)| self.validate_block(b / k, b % k, LANES, block))?;
        last.par_chunks(tile_block_bytes_for(n, last_lanes))
            .enumerate()
            .try_for_each(|(col, block)| self.validate_block(rt_count - 1, col, last_lanes, block))
    }

    fn validate_block(
        &self,
        rt: usize,
        col: usize,
        lanes: usize,
        block: &[u8],
    ) -> std::result::Result<(), String> {
        let n = self.slots;
        let b = rt * self.cols + col;
        let at = |lane: usize| format!("block {b} (row tile {rt}, column {col}) lane {lane}");
        if let Some(i) = block[raw_block_bytes(n, lanes)..]
            .iter()
            .position(|&x| x != 0)
        {
            return Err(format!(
                "block {b} (row tile {rt}, column {col}): fill byte {} is not zero",
                raw_block_bytes(n, lanes) + i
            ));
        }
        for lane in 0..lanes {
            let bitmap = read_u16(block, bitmap_offset(n, lanes, lane));
            if bitmap.count_ones() as usize != n {
                return Err(format!(
                    "{}: bitmap has {} bits set, expected {n}",
                    at(lane),
                    bitmap.count_ones()
                ));
            }
            let row0 = rt * TILE_ROWS + lane * LANE_ROWS;
            let mut nz = 0u16;
            let mut bits = bitmap;
            for slot in 0..n {
                let r = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let v = f16::from_bits(read_u16(block, slot_offset(n, lanes, lane, slot)));
                if !v.is_finite() {
                    return Err(format!("{}: slot {slot} is not finite", at(lane)));
                }
                if is_zero(v) {
                    continue;
                }
                if row0 + r >= self.rows {
                    return Err(format!(
                        "{}: slot {slot} at row {} (>= M = {}) is not +0",
                        at(lane),
                        row0 + r,
                        self.rows
                    ));
                }
                nz |= 1 << r;
            }
            if slot_bitmap(nz, n) != bitmap {
                return Err(format!(
                    "{}: padding slots are not the lowest zero rows (bitmap {bitmap:#06x}, \
                     nonzeros {nz:#06x})",
                    at(lane)
                ));
            }
        }
        Ok(())
    }
}

impl ColumnBlocks for BalancedCbc {
    fn block_rows(&self) -> usize {
        TILE_ROWS
    }
    /// Stored +0 (padding) slots are not reported: they add nothing, and those of rows >= M
    /// lie outside the block's live height.
    #[inline(always)]
    fn walk<F: FnMut(usize, f16)>(&self, block: usize, col: usize, mut f: F) {
        let n = self.slots;
        let (data, lanes) = self.block(block, col);
        for lane in 0..lanes {
            let mut bits = read_u16(data, bitmap_offset(n, lanes, lane));
            for slot in 0..n {
                let r = bits.trailing_zeros() as usize;
                bits &= bits.wrapping_sub(1);
                let v = read_u16(data, slot_offset(n, lanes, lane, slot));
                if v != 0 {
                    f(lane * LANE_ROWS + r, f16::from_bits(v));
                }
            }
        }
    }
}

impl WeightFormat for BalancedCbc {
    fn kind(&self) -> FormatKind {
        FormatKind::BalancedCbc
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> Storage {
        // Stored lanes over all tiles, times K columns.
        let lanes = (self.row_tiles() - 1) * LANES + last_tile_lanes(self.rows);
        let payload_bytes = lanes * self.cols * self.slots * 2;
        Storage {
            payload_bytes,
            // Lane bitmaps plus the last tile's zero fill: the rest of the image.
            metadata_bytes: self.blocks.len() - payload_bytes,
        }
    }
    fn decode(&self) -> DenseMatrix {
        let (m, k) = (self.rows, self.cols);
        let mut data = vec![f16::ZERO; m * k];
        for rt in 0..self.row_tiles() {
            for col in 0..k {
                self.walk(rt, col, |row, v| {
                    data[(rt * TILE_ROWS + row) * k + col] = v;
                });
            }
        }
        DenseMatrix::new(m, k, data).expect("validated on encode/read: shape and finite values")
    }
    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<()> {
        column_block_product(self, (self.rows, self.cols), x, 1, threshold, y)
    }
    fn matmul(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<()> {
        column_block_product(self, (self.rows, self.cols), x, n, threshold, y)
    }
    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows as u64);
        w.u64(self.cols as u64);
        w.u64(self.slots as u64);
        w.buf.extend_from_slice(&self.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_arithmetic() {
        for n in 1..=MAX_SLOTS {
            let bb = block_bytes_for(n);
            assert_eq!(bb % 64, 0);
            assert_eq!(
                tile_block_bytes_for(n, LANES),
                bb,
                "a full tile has no fill"
            );
            let values_end = (n / 2) * 128 + if n % 2 == 1 { 64 } else { 0 };
            assert_eq!(values_end, 64 * n, "values fill 0..64 N for N = {n}");
            for l in 1..=LANES {
                let raw = raw_block_bytes(n, l);
                let stored = tile_block_bytes_for(n, l);
                assert!(
                    stored.is_multiple_of(BLOCK_ALIGN)
                        && stored >= raw
                        && stored - raw < BLOCK_ALIGN
                );
                // Every slot of every lane has its own two bytes below the bitmaps, and the
                // bitmaps end exactly at raw.
                let mut seen = vec![false; raw];
                for lane in 0..l {
                    for i in 0..n {
                        let o = slot_offset(n, l, lane, i);
                        assert!(o + 2 <= 2 * l * n);
                        assert!(!seen[o] && !seen[o + 1]);
                        seen[o] = true;
                        seen[o + 1] = true;
                    }
                    let o = bitmap_offset(n, l, lane);
                    assert!(o + 2 <= raw && !seen[o] && !seen[o + 1]);
                    seen[o] = true;
                    seen[o + 1] = true;
                }
                assert!(
                    seen.iter().all(|&s| s),
                    "N = {n}, L = {l}: the raw block is exactly covered"
                );
            }
        }
    }

    #[test]
    fn last_tile_lane_counts() {
        for (m, l) in [
            (1, 1),
            (16, 1),
            (17, 2),
            (192, 12),
            (511, 32),
            (512, 32),
            (513, 1),
            (520, 1),
            (528, 1),
            (529, 2),
            (576, 4),
            (1000, 31),
            (1024, 32),
            (1025, 1),
        ] {
            assert_eq!(last_tile_lanes(m), l, "M = {m}");
        }
    }

    #[test]
    fn slot_bitmap_pads_lowest_free_rows() {
        assert_eq!(slot_bitmap(0, 3), 0b111);
        assert_eq!(slot_bitmap(0b1010, 4), 0b1111);
        assert_eq!(slot_bitmap(0b1000_0000_0000_0000, 2), 0b1000_0000_0000_0001);
        assert_eq!(slot_bitmap(0b0110, 2), 0b0110);
        assert_eq!(slot_bitmap(0, 16), 0xffff);
        assert_eq!(slot_bitmap(0x00ff, 16), 0xffff);
    }

    #[test]
    fn slots_for_sparsity_rounds_and_clamps() {
        assert_eq!(slots_for_sparsity(0.0).unwrap(), 16);
        assert_eq!(slots_for_sparsity(0.5).unwrap(), 8);
        assert_eq!(slots_for_sparsity(0.7).unwrap(), 5);
        assert_eq!(slots_for_sparsity(0.75).unwrap(), 4);
        assert_eq!(slots_for_sparsity(0.99).unwrap(), 1);
        for bad in [-0.1, 1.0, 2.0, f64::NAN] {
            assert!(matches!(
                slots_for_sparsity(bad),
                Err(FormatError::Sparsity(_))
            ));
        }
    }
}
