//! IE-BME, UnionSparse's Index-Efficient Bitmap Encoding (UnionSparse §V, Fig. 7), with the
//! paper's bitmap-aware row reordering (§V-B, Algorithm 1, see [`reorder`]).
//!
//! # Idea
//! The matrix is cut into local tiles (LTs) of `H_L x K_L = 16 x 64`. Each LT is split into an
//! `RA x CA` grid of areas (default 2 x 2, so `Q = RA * CA = 4` areas of `H_B x K_B = 8 x 32`).
//! Position `(i, j)` of every area forms one *grouped position*; one bit of the LT's *union
//! bitmap* says whether any of its `Q` values is nonzero (the paper's
//! `B_t(i, j) = OR_q [W_t^(q)(i, j) != 0]`). For every set bit, each of the `Q` aligned area
//! streams gets one value, zeros included, so one rank indexes all `Q` streams.
//! Before encoding, the 16 rows of each LT are permuted so that fewer union bits are set.
//!
//! # Geometry
//! ```text
//!   M_pad = ceil(M / 16) * 16, K_pad = ceil(K / 64) * 64   (padding rows/cols hold +0)
//!   tiles: T_R = M_pad / 16 tile rows, T_C = K_pad / 64 tile cols, T = T_R * T_C,
//!          tile t = tr * T_C + tc covers rows 16 tr .. 16 tr + 16, cols 64 tc .. 64 tc + 64
//!          (row-major over tiles, K fastest: one 16-row block's tiles are contiguous)
//!   areas: RA | 16 (1, 2, 4, 8, 16), CA | 64 (1, 2, .., 64), Q = RA * CA,
//!          H_B = 16 / RA, K_B = 64 / CA; area q = a * CA + c covers reordered tile rows
//!          a*H_B .. (a+1)*H_B and tile cols c*K_B .. (c+1)*K_B
//!
//!   one tile, RA = CA = 2 (reordered rows):         union bitmap (H_B x K_B = 8 x 32)
//!          cols 0..32        cols 32..64
//!        +-------------+-------------+               bit (i, j) = OR of the 4 values
//!   0..8 |  area 0     |  area 1     |                 area0(i,j) area1(i,j)
//!        |  (a=0,c=0)  |  (a=0,c=1)  |                 area2(i,j) area3(i,j)
//!        +-------------+-------------+               = W'(i, j)    W'(i, j+32)
//!  8..16 |  area 2     |  area 3     |                 W'(i+8, j)  W'(i+8, j+32)
//!        |  (a=1,c=0)  |  (a=1,c=1)  |               where W' is the row-permuted tile
//!        +-------------+-------------+
//! ```
//!
//! # Arrays (all public through accessors, little-endian when serialized)
//! * `union_bitmaps: [u64; T * WPT]`, `WPT = max(1, H_B * K_B / 64)` words per tile (4 for
//!   2 x 2). Logical bit `b = i * K_B + j` of tile `t` is bit `b % 64` (LSB first) of word
//!   `t * WPT + b / 64`: the union mask scanned row-major, leftmost column = least significant
//!   bit, as in the paper. `K_B` divides 64, so a logical row never straddles two words (for
//!   2 x 2, word `w` holds logical rows `2w` in bits 0..32 and `2w + 1` in bits 32..64).
//!   When `H_B * K_B < 64` the high bits of the single word are 0.
//! * `P_t = popcount(tile t's words)`, the active union entries; the rank of active bit `(i, j)`
//!   is `ρ(i, j)` = number of set bits before it in that row-major order.
//! * `S_t = round_up(P_t, stream_align)`, the stream stride (`stream_align = 1`, the default,
//!   is exactly the paper's layout; a larger value pads each stream with zeros, e.g. 32 INT4
//!   values so that every stream starts on a 16-byte boundary for `cp.async`).
//! * `offsets: [u32; T]`, Union Value Offsets, in *values* (not bytes):
//!   `offsets[t] = Σ_{τ<t} Q * S_τ` (the paper's `o_t = Σ Q P_τ` when `stream_align = 1`).
//! * `values`, Compressed Values: stream `q` of tile `t` is
//!   `values[offsets[t] + q * S_t .. offsets[t] + q * S_t + P_t]`, element `ρ(i, j)` holding
//!   `W'(a * H_B + i, c * K_B + j)` for `q = a * CA + c`; elements `P_t .. S_t` are 0.
//!   Encoding per [`Payload`]:
//!   - `F16`: `u16` bit patterns (exact; `-0` is a stored nonzero, only `+0` is zero).
//!   - `Int8`: `i8` two's complement, range `-127..=127`.
//!   - `Int4`: two's complement nibbles, range `-7..=7`; value `e` is in byte `e / 2`, low
//!     nibble when `e` is even. A tile's streams may start mid-byte when `Q * S_t` is odd
//!     (only possible when `Q` is odd or `stream_align` is odd and `Q = 1`); unused high nibble
//!     of the last byte is 0.
//! * `permutations: [u64; T]` (present iff the encoding was reordered): nibble `p`
//!   (bits `4p .. 4p + 4`) of tile `t`'s word is the original tile row stored at reordered row
//!   `p`; the output row of reordered row `p` is `16 * tr + nibble(p)`. Absent means identity.
//! * `scales: [f16; M * G]` (INT payloads only), `G = ceil(K / group_size)`: symmetric scale of
//!   original row `r`, columns `g * group_size .. (g + 1) * group_size`, at `scales[r * G + g]`
//!   (original row order: the permutation differs per tile, a row's scale does not).
//!   `group_size` is a multiple of 64, so every (row, tile) pair has exactly one scale:
//!   `g = 64 * tc / group_size`. The dequantized weight is `q * scale`.
//!
//! # Quantization (INT payloads)
//! Symmetric round-to-nearest per (row, group): `scale >= max|w| / qmax` and
//! `q = clamp(round(w / scale), ±qmax)`, so `|w - q * scale| <= scale / 2` and `+0` stays `+0`
//! (`-0` becomes `+0`). The union bitmap is built from the *quantized* tile (the paper encodes
//! `W_t ∈ Q_b^{H_L x K_L}`), so weights that round to 0 are dropped. Scales are f16 rounded
//! *up* to at most 8 (INT4) or 4 (INT8) significant bits so that `q * scale` is exact in f16
//! for every `q`: the decoded matrix is the quantized representation bit for bit, and a kernel
//! that accumulates `Σ q x` and multiplies by the scale once computes the same thing. Cost: the
//! quantization step is at most 2^-7 (INT4) / 2^-3 (INT8) coarser than `max|w| / qmax`.
//! Where `qmax * scale` would overflow f16 (`max|w|` within a few % of 65504) the scale is
//! rounded down instead, which keeps the `scale / 2` bound for INT4. The one exception: INT8
//! groups where no 4-significant-bit scale can do that; there `q` is clamped to
//! `65504 / scale` and the error is at most `scale`.
//!
//! # Storage accounting
//! [`Storage`]: `payload_bytes` = the compressed values as stored (area zeros and stream
//! padding included); `metadata_bytes` = union bitmaps + offsets + permutations + scales
//! (scales are "everything else" in the crate-wide [`Storage`] convention).
//! The paper's PMR (Eq. 1) is `Bw * NNZ / Stor_meta` with `Bw * NNZ` the *useful* payload (the
//! nonzeros of the stored, quantized matrix at `Bw` = 2, 1, 0.5 bytes) and `Stor_meta` the
//! metadata "required to locate these payloads": bitmaps + offsets, plus the permutation which
//! locates a payload's output row. Scales are quantization parameters, outside both terms of
//! Eq. 1. [`IeBme::paper_pmr`] computes that; [`Storage::pmr`] is the crate-wide stored
//! payload / all metadata. [`IeBme::storage_breakdown`] gives every term.
//!
//! # Serialized payload (after the blob frame)
//! ```text
//! u32 layout version (1) | u64 M | u64 K | u8 RA | u8 CA | u8 payload (0 f16, 1 int8, 2 int4)
//! | u8 reordered (0/1) | u32 group_size (0 for f16) | u32 stream_align
//! | u64s union_bitmaps | u32s offsets | u64s permutations (empty if not reordered)
//! | u16s scales (f16 bits) | values: f16s (F16) or length-prefixed bytes (INT8, INT4)
//! ```
//! Every field is checked on read (shape, offsets against bitmap popcounts, permutations,
//! scales, value ranges, zeros in padding, no all-zero active group): a corrupt blob is a
//! [`FormatError`], and no allocation exceeds what the blob's own length implies.

pub mod reorder;

use crate::blob::{ByteReader, ByteWriter};
use crate::error::{FormatError, Result};
use crate::format::{check_product_args, is_active, FormatKind, Storage, Threshold, WeightFormat};
use crate::matrix::DenseMatrix;
use half::f16;
use rayon::prelude::*;
use reorder::{dp_grouping, greedy_grouping, permutation_cost, DpScratch};
use serde::Serialize;
use std::time::{Duration, Instant};

/// Local tile height `H_L`.
pub const TILE_ROWS: usize = 16;
/// Local tile width `K_L`.
pub const TILE_COLS: usize = 64;
/// Version of the serialized payload layout.
pub const LAYOUT_VERSION: u32 = 1;
/// Largest accepted `stream_align` (values).
pub const MAX_STREAM_ALIGN: usize = 1024;

/// Largest finite f16.
const F16_MAX: f64 = 65504.0;

/// How the stored values are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload {
    /// Raw f16 bits, lossless.
    F16,
    /// Signed 8-bit with one f16 scale per row and `group_size` columns.
    Int8 { group_size: usize },
    /// Signed 4-bit with one f16 scale per row and `group_size` columns (the paper's W4).
    Int4 { group_size: usize },
}

impl Payload {
    fn tag(self) -> u8 {
        match self {
            Payload::F16 => 0,
            Payload::Int8 { .. } => 1,
            Payload::Int4 { .. } => 2,
        }
    }
    /// Bits per stored value.
    pub fn bits(self) -> usize {
        match self {
            Payload::F16 => 16,
            Payload::Int8 { .. } => 8,
            Payload::Int4 { .. } => 4,
        }
    }
    pub fn group_size(self) -> Option<usize> {
        match self {
            Payload::F16 => None,
            Payload::Int8 { group_size } | Payload::Int4 { group_size } => Some(group_size),
        }
    }
    /// Largest |q| of the integer payloads.
    pub fn qmax(self) -> Option<i32> {
        match self {
            Payload::F16 => None,
            Payload::Int8 { .. } => Some(127),
            Payload::Int4 { .. } => Some(7),
        }
    }
    /// Significant bits a scale may have so that `q * scale` is exact in f16 (11 - bits(qmax)).
    fn scale_significant_bits(self) -> u32 {
        match self {
            Payload::F16 => 11,
            Payload::Int8 { .. } => 4,
            Payload::Int4 { .. } => 8,
        }
    }
}

/// Row reordering inside each local tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reorder {
    /// Keep the original row order (no permutation stored).
    Off,
    /// The fast heuristic only (greedy grouping + 2-exchange).
    Greedy,
    /// The paper's exact subset DP per tile. With a `time_budget`, tiles started after the
    /// budget has elapsed (wall clock, whole matrix) use the greedy heuristic instead; the
    /// encoding then depends on machine speed. `None` runs the DP on every tile.
    Dp { time_budget: Option<Duration> },
}

/// Encoding options.
#[derive(Clone, Debug, PartialEq)]
pub struct IeBmeOptions {
    /// `RA`, row partitions of a tile (divides 16).
    pub area_rows: usize,
    /// `CA`, column partitions of a tile (divides 64).
    pub area_cols: usize,
    pub payload: Payload,
    pub reorder: Reorder,
    /// Each area stream's length is rounded up to a multiple of this many values.
    pub stream_align: usize,
}

impl Default for IeBmeOptions {
    /// The paper's configuration: 2 x 2 areas, INT4 with groups of 128 along K (Atom's W4
    /// groups), DP reordering (30 s budget per matrix), unpadded streams.
    fn default() -> Self {
        Self {
            area_rows: 2,
            area_cols: 2,
            payload: Payload::Int4 { group_size: 128 },
            reorder: Reorder::Dp {
                time_budget: Some(Duration::from_secs(30)),
            },
            stream_align: 1,
        }
    }
}

impl IeBmeOptions {
    /// Default options with the lossless f16 payload.
    pub fn lossless() -> Self {
        Self {
            payload: Payload::F16,
            ..Self::default()
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !(self.area_rows.is_power_of_two() && self.area_rows <= TILE_ROWS) {
            return Err(FormatError::Option(format!(
                "ie-bme area_rows {} must divide {TILE_ROWS}",
                self.area_rows
            )));
        }
        if !(self.area_cols.is_power_of_two() && self.area_cols <= TILE_COLS) {
            return Err(FormatError::Option(format!(
                "ie-bme area_cols {} must divide {TILE_COLS}",
                self.area_cols
            )));
        }
        if let Some(gs) = self.payload.group_size() {
            if gs == 0 || !gs.is_multiple_of(TILE_COLS) || gs > u32::MAX as usize {
                return Err(FormatError::Option(format!(
                    "ie-bme group_size {gs} must be a positive multiple of {TILE_COLS}"
                )));
            }
        }
        if !(1..=MAX_STREAM_ALIGN).contains(&self.stream_align) {
            return Err(FormatError::Option(format!(
                "ie-bme stream_align {} must be in 1..={MAX_STREAM_ALIGN}",
                self.stream_align
            )));
        }
        Ok(())
    }
}

/// What reordering achieved during `encode` (not serialized).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReorderStats {
    /// Active union entries with the original row order.
    pub active_before: u64,
    /// Active union entries after reordering.
    pub active_after: u64,
    /// Tiles solved exactly by the DP.
    pub dp_tiles: usize,
    /// Tiles solved by the greedy heuristic (by choice or after the time budget).
    pub greedy_tiles: usize,
    /// Wall time of the reordering + tile encoding pass.
    pub elapsed: Duration,
}

/// Every term of the storage, in bytes unless named otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct IeBmeStorage {
    pub union_bitmap_bytes: usize,
    pub offset_bytes: usize,
    pub permutation_bytes: usize,
    pub scale_bytes: usize,
    /// Compressed values as stored, area zeros and stream padding included.
    pub value_bytes: usize,
    /// Stored values (area zeros and padding included), count.
    pub stored_values: usize,
    /// Nonzero stored values (the paper's NNZ of the quantized matrix), count.
    pub nnz: usize,
    /// Active union-mask entries, `Σ P_t`.
    pub active_entries: usize,
    /// `Bw * NNZ` in bytes (fractional for INT4).
    pub useful_payload_bytes: f64,
}

/// Layout parameters derived from the shape and the area grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    rows: usize,
    cols: usize,
    ra: usize,
    ca: usize,
    hb: usize,
    kb: usize,
    q: usize,
    tile_rows: usize,
    tile_cols: usize,
    words_per_tile: usize,
}

impl Geometry {
    fn new(rows: usize, cols: usize, ra: usize, ca: usize) -> Result<Self> {
        if rows == 0 || cols == 0 {
            return Err(FormatError::EmptyMatrix { rows, cols });
        }
        let tile_rows = rows.div_ceil(TILE_ROWS);
        let tile_cols = cols.div_ceil(TILE_COLS);
        tile_rows
            .checked_mul(tile_cols)
            .and_then(|t| t.checked_mul(TILE_ROWS * TILE_COLS))
            .ok_or_else(|| {
                FormatError::Option(format!("ie-bme shape {rows} x {cols} too large"))
            })?;
        let (hb, kb) = (TILE_ROWS / ra, TILE_COLS / ca);
        Ok(Self {
            rows,
            cols,
            ra,
            ca,
            hb,
            kb,
            q: ra * ca,
            tile_rows,
            tile_cols,
            words_per_tile: (hb * kb).div_ceil(64),
        })
    }
    fn tiles(&self) -> usize {
        self.tile_rows * self.tile_cols
    }
    /// Mask of one logical row (`K_B` bits).
    fn row_mask(&self) -> u64 {
        if self.kb == 64 {
            u64::MAX
        } else {
            (1u64 << self.kb) - 1
        }
    }
    /// Logical union-mask row `i` of a tile's words.
    #[inline]
    fn logical_row(&self, words: &[u64], i: usize) -> u64 {
        let b = i * self.kb;
        (words[b / 64] >> (b % 64)) & self.row_mask()
    }
    /// OR of a tile row's `CA` column parts.
    #[inline]
    fn fold(&self, row_mask: u64) -> u64 {
        (0..self.ca).fold(0u64, |acc, c| {
            acc | ((row_mask >> (c * self.kb)) & self.row_mask())
        })
    }
}

/// The compressed values, by payload.
#[derive(Clone, PartialEq)]
enum Values {
    F16(Vec<f16>),
    Int8(Vec<i8>),
    /// Packed nibbles and the number of values.
    Int4(Vec<u8>, usize),
}

/// Borrowed view of the compressed values for kernels.
#[derive(Clone, Copy, Debug)]
pub enum ValuesRef<'a> {
    F16(&'a [f16]),
    Int8(&'a [i8]),
    /// Packed nibbles (value `e` in byte `e / 2`, low nibble first) and the value count.
    Int4 {
        packed: &'a [u8],
        len: usize,
    },
}

/// A matrix in IE-BME.
#[derive(Clone, PartialEq)]
pub struct IeBme {
    geo: Geometry,
    payload: Payload,
    stream_align: usize,
    bitmaps: Vec<u64>,
    offsets: Vec<u32>,
    perms: Option<Vec<u64>>,
    scales: Vec<f16>,
    values: Values,
    /// `P_t` per tile (derived).
    active: Vec<u32>,
    reorder_stats: Option<ReorderStats>,
}

impl std::fmt::Debug for IeBme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IeBme")
            .field("rows", &self.geo.rows)
            .field("cols", &self.geo.cols)
            .field("areas", &(self.geo.ra, self.geo.ca))
            .field("payload", &self.payload)
            .field("stream_align", &self.stream_align)
            .field("reordered", &self.perms.is_some())
            .field("active_entries", &self.total_active_entries())
            .finish_non_exhaustive()
    }
}

/// One encoded tile, before concatenation.
struct TileOut {
    words: [u64; 16],
    perm: u64,
    codes: Vec<u16>,
    before: u32,
    after: u32,
    used_dp: bool,
}

/// Smallest f16 `s >= max_abs / qmax` of the form `m * 2^e`, `m < 2^sig_bits`, `e >= -24`
/// (so `q * s` is exact in f16 for `|q| <= qmax`); 0 when `max_abs` is 0.
fn choose_scale(max_abs: f64, qmax: i32, sig_bits: u32) -> f16 {
    if max_abs <= 0.0 {
        return f16::ZERO;
    }
    let target = max_abs / qmax as f64;
    let mut e = (target.log2().floor() as i32 - (sig_bits as i32 - 1)).max(-24);
    let mut m = (target / 2f64.powi(e)).ceil();
    if m >= 2f64.powi(sig_bits as i32) {
        m = 2f64.powi(sig_bits as i32 - 1);
        e += 1;
    }
    let up = m * 2f64.powi(e);
    if up * qmax as f64 > F16_MAX {
        // `qmax * up` would overflow. Rounding the scale down instead keeps every code usable
        // and, when the significand is wide enough (INT4), still bounds the error by scale/2;
        // otherwise (INT8) keep `up` and let `q_limit` clamp the codes (error <= scale).
        let down = (target / 2f64.powi(e)).floor() * 2f64.powi(e);
        if down > 0.0 && max_abs - qmax as f64 * down <= down / 2.0 {
            return f16::from_f64(down);
        }
    }
    f16::from_f64(up)
}

/// True when `s` is a valid stored scale for `payload`: +0 or positive finite with at most
/// the allowed significant bits.
fn scale_is_valid(s: f16, payload: Payload) -> bool {
    let bits = s.to_bits();
    if bits & 0x8000 != 0 || !s.is_finite() {
        return false;
    }
    let exp = (bits >> 10) & 0x1f;
    let mant = (bits & 0x3ff) as u32;
    let significand = if exp == 0 { mant } else { mant | 0x400 };
    significand == 0
        || (significand >> significand.trailing_zeros())
            < (1u32 << payload.scale_significant_bits())
}

/// Largest |q| allowed with scale `s` (qmax, or less where `q * s` would overflow f16).
fn q_limit(s: f16, qmax: i32) -> i32 {
    let s = s.to_f64();
    if s == 0.0 {
        0
    } else {
        ((F16_MAX / s).floor() as i64).clamp(0, qmax as i64) as i32
    }
}

fn quantize(v: f16, s: f16, qlim: i32) -> i32 {
    let s = s.to_f64();
    if s == 0.0 {
        return 0;
    }
    ((v.to_f64() / s).round() as i64).clamp(-(qlim as i64), qlim as i64) as i32
}

/// Reads stored value `idx` as f32 (the integer code for INT payloads).
trait ValueSource: Sync {
    fn code(&self, idx: usize) -> f32;
}
struct F16Src<'a>(&'a [f16]);
struct I8Src<'a>(&'a [i8]);
struct I4Src<'a>(&'a [u8]);
impl ValueSource for F16Src<'_> {
    #[inline(always)]
    fn code(&self, idx: usize) -> f32 {
        f16_to_f32(self.0[idx])
    }
}

/// f16 -> f32 with an inlinable fast path for normal numbers (exact: rebias the exponent,
/// widen the mantissa); zeros, subnormals and non-finite values take `half`'s conversion,
/// whose hardware path is an out-of-line call per value.
#[inline(always)]
fn f16_to_f32(v: f16) -> f32 {
    let bits = v.to_bits() as u32;
    let exp = bits & 0x7c00;
    if exp != 0 && exp != 0x7c00 {
        f32::from_bits(((bits & 0x8000) << 16) | (((bits & 0x7fff) + 0x1_c000) << 13))
    } else {
        v.to_f32()
    }
}
impl ValueSource for I8Src<'_> {
    #[inline(always)]
    fn code(&self, idx: usize) -> f32 {
        self.0[idx] as f32
    }
}
impl ValueSource for I4Src<'_> {
    #[inline(always)]
    fn code(&self, idx: usize) -> f32 {
        nibble(self.0, idx) as f32
    }
}

#[inline(always)]
fn nibble(packed: &[u8], idx: usize) -> i8 {
    let b = packed[idx >> 1];
    let n = if idx & 1 == 0 { b << 4 } else { b & 0xf0 };
    (n as i8) >> 4
}

impl IeBme {
    /// Encodes `w` with `opts` (see the module header).
    pub fn encode(w: &DenseMatrix, opts: &IeBmeOptions) -> Result<Self> {
        opts.validate()?;
        let geo = Geometry::new(w.rows(), w.cols(), opts.area_rows, opts.area_cols)?;
        let payload = opts.payload;
        let scales = compute_scales(w, payload);
        let reorder = if geo.ra > 1 {
            opts.reorder
        } else {
            Reorder::Off
        };
        let start = Instant::now();
        let deadline = match reorder {
            Reorder::Dp {
                time_budget: Some(b),
            } => Some(start + b),
            _ => None,
        };
        let tiles: Vec<TileOut> = (0..geo.tiles())
            .into_par_iter()
            .with_min_len(16)
            .map_init(
                || None::<DpScratch>,
                |scratch, t| {
                    encode_tile(
                        w,
                        &geo,
                        payload,
                        &scales,
                        t,
                        reorder,
                        deadline,
                        opts.stream_align,
                        scratch,
                    )
                },
            )
            .collect();
        let elapsed = start.elapsed();

        let mut bitmaps = Vec::with_capacity(geo.tiles() * geo.words_per_tile);
        let mut offsets = Vec::with_capacity(geo.tiles());
        let mut perms = (reorder != Reorder::Off).then(|| Vec::with_capacity(geo.tiles()));
        let mut stats = ReorderStats {
            elapsed,
            ..ReorderStats::default()
        };
        let mut total: usize = 0;
        for tile in &tiles {
            let p = tile.words[..geo.words_per_tile]
                .iter()
                .map(|w| w.count_ones() as usize)
                .sum::<usize>();
            let stride = p.div_ceil(opts.stream_align) * opts.stream_align;
            debug_assert_eq!(tile.codes.len(), geo.q * stride);
            offsets.push(u32::try_from(total).map_err(|_| too_many_values())?);
            total += tile.codes.len();
            bitmaps.extend_from_slice(&tile.words[..geo.words_per_tile]);
            if let Some(p) = perms.as_mut() {
                p.push(tile.perm);
            }
            stats.active_before += tile.before as u64;
            stats.active_after += tile.after as u64;
            if tile.used_dp {
                stats.dp_tiles += 1;
            } else if reorder != Reorder::Off {
                stats.greedy_tiles += 1;
            }
        }
        u32::try_from(total).map_err(|_| too_many_values())?;
        let codes = tiles.into_iter().flat_map(|t| t.codes);
        let values = match payload {
            Payload::F16 => Values::F16(codes.map(f16::from_bits).collect()),
            Payload::Int8 { .. } => Values::Int8(codes.map(|c| c as i16 as i8).collect()),
            Payload::Int4 { .. } => {
                let mut packed = vec![0u8; total.div_ceil(2)];
                for (e, c) in codes.enumerate() {
                    packed[e / 2] |= ((c as u8) & 0x0f) << (4 * (e % 2));
                }
                Values::Int4(packed, total)
            }
        };
        let mut out = Self {
            geo,
            payload,
            stream_align: opts.stream_align,
            bitmaps,
            offsets,
            perms,
            scales,
            values,
            active: Vec::new(),
            reorder_stats: (reorder != Reorder::Off).then_some(stats),
        };
        out.active = out.compute_active();
        Ok(out)
    }

    fn compute_active(&self) -> Vec<u32> {
        self.bitmaps
            .chunks(self.geo.words_per_tile)
            .map(|w| w.iter().map(|x| x.count_ones()).sum())
            .collect()
    }

    /// Reads a payload written by [`WeightFormat::write_payload`], validating every field.
    pub fn read_payload(r: &mut ByteReader) -> Result<Self> {
        let version = r.u32()?;
        if version != LAYOUT_VERSION {
            return Err(FormatError::Version {
                found: version,
                supported: LAYOUT_VERSION,
            });
        }
        let rows = r.usize()?;
        let cols = r.usize()?;
        let ra = r.u8()? as usize;
        let ca = r.u8()? as usize;
        let payload_tag = r.u8()?;
        let reordered = r.u8()?;
        let group_size = r.u32()? as usize;
        let stream_align = r.u32()? as usize;
        let payload = match payload_tag {
            0 if group_size == 0 => Payload::F16,
            1 => Payload::Int8 { group_size },
            2 => Payload::Int4 { group_size },
            _ => {
                return Err(corrupt(format!(
                    "payload tag {payload_tag} with group size {group_size}"
                )))
            }
        };
        if reordered > 1 {
            return Err(corrupt(format!("reordered flag {reordered}")));
        }
        IeBmeOptions {
            area_rows: ra,
            area_cols: ca,
            payload,
            reorder: Reorder::Off,
            stream_align,
        }
        .validate()
        .map_err(|e| corrupt(e.to_string()))?;
        let geo = Geometry::new(rows, cols, ra, ca).map_err(|e| corrupt(e.to_string()))?;
        let bitmaps = r.u64s()?;
        let offsets = r.u32s()?;
        let perms = r.u64s()?;
        let scales: Vec<f16> = r.u16s()?.into_iter().map(f16::from_bits).collect();
        let values = match payload {
            Payload::F16 => Values::F16(r.f16s()?),
            Payload::Int8 { .. } => {
                Values::Int8(r.byte_vec()?.into_iter().map(|b| b as i8).collect())
            }
            Payload::Int4 { .. } => {
                let packed = r.byte_vec()?;
                // The value count is implied by the offsets; checked in `validate`.
                let len = packed.len() * 2;
                Values::Int4(packed, len)
            }
        };
        let perms = match (reordered, perms.is_empty()) {
            (1, _) => Some(perms),
            (0, true) => None,
            _ => {
                return Err(corrupt(
                    "permutations present without the reordered flag".into(),
                ))
            }
        };
        let mut out = Self {
            geo,
            payload,
            stream_align,
            bitmaps,
            offsets,
            perms,
            scales,
            values,
            active: Vec::new(),
            reorder_stats: None,
        };
        out.validate()?;
        Ok(out)
    }

    /// Checks every array against the geometry and the invariants of the encoder.
    fn validate(&mut self) -> Result<()> {
        let geo = self.geo;
        let tiles = geo.tiles();
        if self.bitmaps.len() != tiles * geo.words_per_tile {
            return Err(corrupt(format!(
                "{} bitmap words, expected {}",
                self.bitmaps.len(),
                tiles * geo.words_per_tile
            )));
        }
        let used_bits = geo.hb * geo.kb;
        if used_bits < 64 {
            let unused = !((1u64 << used_bits) - 1);
            if self.bitmaps.iter().any(|w| w & unused != 0) {
                return Err(corrupt("bits set beyond the union mask".into()));
            }
        }
        self.active = self.compute_active();
        if self.offsets.len() != tiles {
            return Err(corrupt(format!(
                "{} offsets, expected {tiles}",
                self.offsets.len()
            )));
        }
        let mut total: usize = 0;
        for t in 0..tiles {
            if self.offsets[t] as usize != total {
                return Err(corrupt(format!(
                    "offset of tile {t} is {}, expected {total}",
                    self.offsets[t]
                )));
            }
            total += geo.q * self.stride(t);
            if total > u32::MAX as usize {
                return Err(corrupt("value count exceeds u32 offsets".into()));
            }
        }
        let stored = match &mut self.values {
            Values::F16(v) => v.len(),
            Values::Int8(v) => v.len(),
            Values::Int4(packed, len) => {
                if packed.len() != total.div_ceil(2) {
                    return Err(corrupt(format!(
                        "{} INT4 bytes, expected {}",
                        packed.len(),
                        total.div_ceil(2)
                    )));
                }
                if !total.is_multiple_of(2) && packed.last().is_some_and(|b| b >> 4 != 0) {
                    return Err(corrupt("unused INT4 nibble is not zero".into()));
                }
                *len = total;
                total
            }
        };
        if stored != total {
            return Err(corrupt(format!("{stored} values, expected {total}")));
        }
        if let Some(perms) = &self.perms {
            if perms.len() != tiles {
                return Err(corrupt(format!(
                    "{} permutations, expected {tiles}",
                    perms.len()
                )));
            }
            for (t, &p) in perms.iter().enumerate() {
                let seen = (0..TILE_ROWS).fold(0u32, |acc, k| acc | 1 << ((p >> (4 * k)) & 0xf));
                if seen != 0xffff {
                    return Err(corrupt(format!(
                        "tile {t}: permutation {p:#018x} is not one"
                    )));
                }
            }
        }
        let expected_scales = match self.payload.group_size() {
            Some(gs) => geo.rows * geo.cols.div_ceil(gs),
            None => 0,
        };
        if self.scales.len() != expected_scales {
            return Err(corrupt(format!(
                "{} scales, expected {expected_scales}",
                self.scales.len()
            )));
        }
        if let Some(i) = self
            .scales
            .iter()
            .position(|&s| !scale_is_valid(s, self.payload))
        {
            return Err(corrupt(format!(
                "invalid scale {:#06x} at {i}",
                self.scales[i].to_bits()
            )));
        }
        (0..tiles)
            .into_par_iter()
            .try_for_each(|t| self.validate_tile(t))
    }

    /// Values of one tile: zero padding, zeros outside the matrix, in-range codes, and at least
    /// one nonzero per active group.
    fn validate_tile(&self, t: usize) -> Result<()> {
        let geo = &self.geo;
        let (tr, tc) = (t / geo.tile_cols, t % geo.tile_cols);
        let (p_t, stride, base) = (
            self.active[t] as usize,
            self.stride(t),
            self.offsets[t] as usize,
        );
        for q in 0..geo.q {
            for e in p_t..stride {
                if !self.code_is_zero(base + q * stride + e) {
                    return Err(corrupt(format!("tile {t}: nonzero stream padding")));
                }
            }
        }
        let words = &self.bitmaps[t * geo.words_per_tile..(t + 1) * geo.words_per_tile];
        let mut rank = 0;
        for i in 0..geo.hb {
            let mut bits = geo.logical_row(words, i);
            while bits != 0 {
                let j = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let mut any_nonzero = false;
                for a in 0..geo.ra {
                    let row = tr * TILE_ROWS + self.perm_row(t, a * geo.hb + i);
                    for c in 0..geo.ca {
                        let col = tc * TILE_COLS + c * geo.kb + j;
                        let idx = base + (a * geo.ca + c) * stride + rank;
                        if self.code_is_zero(idx) {
                            continue;
                        }
                        any_nonzero = true;
                        if row >= geo.rows || col >= geo.cols {
                            return Err(corrupt(format!("tile {t}: nonzero value in padding")));
                        }
                        self.check_code(idx, row, col)?;
                    }
                }
                if !any_nonzero {
                    return Err(corrupt(format!(
                        "tile {t}: active union entry with no value"
                    )));
                }
                rank += 1;
            }
        }
        Ok(())
    }

    fn code_is_zero(&self, idx: usize) -> bool {
        match &self.values {
            Values::F16(v) => v[idx].to_bits() == 0,
            Values::Int8(v) => v[idx] == 0,
            Values::Int4(p, _) => nibble(p, idx) == 0,
        }
    }

    fn check_code(&self, idx: usize, row: usize, col: usize) -> Result<()> {
        let q = match &self.values {
            Values::F16(v) => {
                return if v[idx].is_finite() {
                    Ok(())
                } else {
                    Err(corrupt(format!("non-finite value at ({row}, {col})")))
                }
            }
            Values::Int8(v) => v[idx] as i32,
            Values::Int4(p, _) => nibble(p, idx) as i32,
        };
        let qmax = self.payload.qmax().unwrap_or(0);
        let lim = q_limit(self.scale(row, col / TILE_COLS), qmax);
        if q.abs() > lim {
            return Err(corrupt(format!(
                "code {q} at ({row}, {col}) outside ±{lim}"
            )));
        }
        Ok(())
    }

    /// Stream stride `S_t` of tile `t`.
    pub fn stride(&self, t: usize) -> usize {
        (self.active[t] as usize).div_ceil(self.stream_align) * self.stream_align
    }

    /// Original tile row stored at reordered row `p` of tile `t`.
    #[inline]
    pub fn perm_row(&self, t: usize, p: usize) -> usize {
        match &self.perms {
            Some(perms) => ((perms[t] >> (4 * p)) & 0xf) as usize,
            None => p,
        }
    }

    /// Scale of original row `row` in tile column `tc` (1 for the f16 payload).
    #[inline]
    fn scale(&self, row: usize, tc: usize) -> f16 {
        match self.payload.group_size() {
            Some(gs) => {
                let groups = self.geo.cols.div_ceil(gs);
                self.scales[row * groups + tc * TILE_COLS / gs]
            }
            None => f16::ONE,
        }
    }

    // ----- accessors for kernels -----

    pub fn area_rows(&self) -> usize {
        self.geo.ra
    }
    pub fn area_cols(&self) -> usize {
        self.geo.ca
    }
    /// `Q = RA * CA`.
    pub fn areas(&self) -> usize {
        self.geo.q
    }
    /// `H_B = 16 / RA`, rows of the union mask.
    pub fn logical_rows(&self) -> usize {
        self.geo.hb
    }
    /// `K_B = 64 / CA`, columns of the union mask.
    pub fn logical_cols(&self) -> usize {
        self.geo.kb
    }
    /// Tile rows `T_R = ceil(M / 16)`.
    pub fn tile_rows(&self) -> usize {
        self.geo.tile_rows
    }
    /// Tile columns `T_C = ceil(K / 64)`.
    pub fn tile_cols(&self) -> usize {
        self.geo.tile_cols
    }
    pub fn words_per_tile(&self) -> usize {
        self.geo.words_per_tile
    }
    pub fn payload(&self) -> Payload {
        self.payload
    }
    pub fn stream_align(&self) -> usize {
        self.stream_align
    }
    pub fn union_bitmaps(&self) -> &[u64] {
        &self.bitmaps
    }
    pub fn offsets(&self) -> &[u32] {
        &self.offsets
    }
    /// Packed per-tile permutations, `None` when not reordered.
    pub fn permutations(&self) -> Option<&[u64]> {
        self.perms.as_deref()
    }
    /// `M x G` row-major f16 scales (empty for the f16 payload).
    pub fn scales(&self) -> &[f16] {
        &self.scales
    }
    /// `G = ceil(K / group_size)`, 0 for the f16 payload.
    pub fn scale_groups(&self) -> usize {
        self.payload
            .group_size()
            .map_or(0, |gs| self.geo.cols.div_ceil(gs))
    }
    pub fn values(&self) -> ValuesRef<'_> {
        match &self.values {
            Values::F16(v) => ValuesRef::F16(v),
            Values::Int8(v) => ValuesRef::Int8(v),
            Values::Int4(p, len) => ValuesRef::Int4 {
                packed: p,
                len: *len,
            },
        }
    }
    /// `P_t`, active union entries of tile `t`.
    pub fn active_entries(&self, t: usize) -> usize {
        self.active[t] as usize
    }
    /// `Σ P_t`.
    pub fn total_active_entries(&self) -> usize {
        self.active.iter().map(|&p| p as usize).sum()
    }
    /// What reordering did during `encode` (`None` when not reordered or read from bytes).
    pub fn reorder_stats(&self) -> Option<ReorderStats> {
        self.reorder_stats
    }

    fn stored_values(&self) -> usize {
        match &self.values {
            Values::F16(v) => v.len(),
            Values::Int8(v) => v.len(),
            Values::Int4(_, len) => *len,
        }
    }

    pub fn storage_breakdown(&self) -> IeBmeStorage {
        let nnz = (0..self.stored_values())
            .filter(|&i| !self.code_is_zero(i))
            .count();
        IeBmeStorage {
            union_bitmap_bytes: self.bitmaps.len() * 8,
            offset_bytes: self.offsets.len() * 4,
            permutation_bytes: self.perms.as_ref().map_or(0, |p| p.len() * 8),
            scale_bytes: self.scales.len() * 2,
            value_bytes: (self.stored_values() * self.payload.bits()).div_ceil(8),
            stored_values: self.stored_values(),
            nnz,
            active_entries: self.total_active_entries(),
            useful_payload_bytes: nnz as f64 * self.payload.bits() as f64 / 8.0,
        }
    }

    /// The paper's PMR (Eq. 1): `Bw * NNZ / (bitmaps + offsets + permutations)`, see the module
    /// header. Infinite for an empty metadata (impossible: there is always a bitmap word).
    pub fn paper_pmr(&self) -> f64 {
        let s = self.storage_breakdown();
        s.useful_payload_bytes
            / (s.union_bitmap_bytes + s.offset_bytes + s.permutation_bytes) as f64
    }

    /// Calls `f(reordered_row, tile_col, value_index)` for every stored value of tile `t`
    /// (active union entries only, all `Q` areas).
    #[inline]
    fn for_each_stored(&self, t: usize, mut f: impl FnMut(usize, usize, usize)) {
        let geo = &self.geo;
        let (stride, base) = (self.stride(t), self.offsets[t] as usize);
        let words = &self.bitmaps[t * geo.words_per_tile..(t + 1) * geo.words_per_tile];
        let mut rank = 0;
        for i in 0..geo.hb {
            let mut bits = geo.logical_row(words, i);
            while bits != 0 {
                let j = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                for a in 0..geo.ra {
                    for c in 0..geo.ca {
                        f(
                            a * geo.hb + i,
                            c * geo.kb + j,
                            base + (a * geo.ca + c) * stride + rank,
                        );
                    }
                }
                rank += 1;
            }
        }
    }

    /// Dequantized value `idx` stored for original row `row` in tile column `tc`.
    fn dequantized(&self, idx: usize, row: usize, tc: usize) -> f16 {
        match &self.values {
            Values::F16(v) => v[idx],
            // Exact: scales are chosen so that every q * scale is an f16 (module header).
            Values::Int8(v) => f16::from_f32(v[idx] as f32 * self.scale(row, tc).to_f32()),
            Values::Int4(p, _) => {
                f16::from_f32(nibble(p, idx) as f32 * self.scale(row, tc).to_f32())
            }
        }
    }

    /// Accumulates `Σ code * x` of tile `t` into `acc` (by reordered row), visiting only
    /// grouped columns where some area's activation is nonzero (`folded_active`).
    #[inline]
    fn tile_partial<V: ValueSource>(
        &self,
        src: &V,
        t: usize,
        xseg: &[f32],
        folded_active: u64,
        acc: &mut [f32; TILE_ROWS],
    ) {
        let geo = &self.geo;
        let (stride, base) = (self.stride(t), self.offsets[t] as usize);
        let words = &self.bitmaps[t * geo.words_per_tile..(t + 1) * geo.words_per_tile];
        let mut rank_base = 0;
        for i in 0..geo.hb {
            let bits = geo.logical_row(words, i);
            let mut sel = bits & folded_active;
            while sel != 0 {
                let j = sel.trailing_zeros() as usize;
                sel &= sel - 1;
                let rank = rank_base + (bits & ((1u64 << j) - 1)).count_ones() as usize;
                for a in 0..geo.ra {
                    let mut s = 0f32;
                    for c in 0..geo.ca {
                        s += src.code(base + (a * geo.ca + c) * stride + rank)
                            * xseg[c * geo.kb + j];
                    }
                    acc[a * geo.hb + i] += s;
                }
            }
            rank_base += bits.count_ones() as usize;
        }
    }

    fn matvec_with<V: ValueSource>(&self, src: &V, xm: &[f32], y: &mut [f32]) {
        let geo = &self.geo;
        // Which columns of each tile have a nonzero activation, folded onto grouped columns.
        let folded_active: Vec<u64> = xm
            .chunks(TILE_COLS)
            .map(|seg| {
                let act = seg
                    .iter()
                    .enumerate()
                    .fold(0u64, |m, (c, &v)| m | (((v != 0.0) as u64) << c));
                geo.fold(act)
            })
            .collect();
        y.par_chunks_mut(TILE_ROWS)
            .enumerate()
            .for_each(|(tr, ychunk)| {
                let mut out = [0f32; TILE_ROWS];
                for tc in 0..geo.tile_cols {
                    let t = tr * geo.tile_cols + tc;
                    if folded_active[tc] == 0 || self.active[t] == 0 {
                        continue;
                    }
                    let mut acc = [0f32; TILE_ROWS];
                    let xseg = &xm[tc * TILE_COLS..(tc + 1) * TILE_COLS];
                    self.tile_partial(src, t, xseg, folded_active[tc], &mut acc);
                    for (p, &v) in acc.iter().enumerate() {
                        let r = self.perm_row(t, p);
                        if r < ychunk.len() {
                            out[r] += v * self.scale(tr * TILE_ROWS + r, tc).to_f32();
                        }
                    }
                }
                ychunk.copy_from_slice(&out[..ychunk.len()]);
            });
    }

    /// Activations masked by the threshold and zero-padded to `K_pad` columns, per token.
    fn masked_padded(&self, x: &[f32], n: usize, threshold: Threshold) -> Vec<f32> {
        let (k, kp) = (self.geo.cols, self.geo.tile_cols * TILE_COLS);
        let mut xm = vec![0f32; n * kp];
        for (dst, src) in xm.chunks_mut(kp).zip(x.chunks(k)) {
            for (d, &v) in dst.iter_mut().zip(src) {
                *d = if is_active(v, threshold) { v } else { 0.0 };
            }
        }
        xm
    }

    /// Tile `t` as dense f32 (original tile-row order, scales applied); returns which rows
    /// hold a nonzero.
    fn tile_dense(&self, t: usize, dense: &mut [[f32; TILE_COLS]; TILE_ROWS]) -> u32 {
        let tr = t / self.geo.tile_cols;
        let tc = t % self.geo.tile_cols;
        let mut rows_used = 0u32;
        for row in dense.iter_mut() {
            row.fill(0.0);
        }
        let mut row_scale = [0f32; TILE_ROWS];
        for (r, s) in row_scale.iter_mut().enumerate() {
            let gr = tr * TILE_ROWS + r;
            *s = if gr < self.geo.rows {
                self.scale(gr, tc).to_f32()
            } else {
                0.0
            };
        }
        self.for_each_stored(t, |p, col, idx| {
            let r = self.perm_row(t, p);
            let v = match &self.values {
                Values::F16(v) => f16_to_f32(v[idx]),
                Values::Int8(v) => v[idx] as f32,
                Values::Int4(pk, _) => nibble(pk, idx) as f32,
            };
            if v != 0.0 {
                dense[r][col] = v * row_scale[r];
                rows_used |= 1 << r;
            }
        });
        rows_used
    }
}

fn corrupt(msg: String) -> FormatError {
    FormatError::Corrupt(format!("ie-bme: {msg}"))
}

fn too_many_values() -> FormatError {
    FormatError::Option("ie-bme: more than 2^32 stored values, offsets would overflow u32".into())
}

/// Per (row, group) scales, `M x G` row-major; empty for the f16 payload.
fn compute_scales(w: &DenseMatrix, payload: Payload) -> Vec<f16> {
    let (Some(gs), Some(qmax)) = (payload.group_size(), payload.qmax()) else {
        return Vec::new();
    };
    let groups = w.cols().div_ceil(gs);
    let mut scales = vec![f16::ZERO; w.rows() * groups];
    scales
        .par_chunks_mut(groups)
        .enumerate()
        .for_each(|(r, out)| {
            for (g, chunk) in w.row(r).chunks(gs).enumerate() {
                let max_abs = chunk.iter().fold(0f64, |m, v| m.max(v.to_f64().abs()));
                out[g] = choose_scale(max_abs, qmax, payload.scale_significant_bits());
            }
        });
    scales
}

/// Encodes tile `t`: quantize, reorder, build the union bitmap and the Q aligned streams.
fn encode_tile(
    w: &DenseMatrix,
    geo: &Geometry,
    payload: Payload,
    scales: &[f16],
    t: usize,
    reorder: Reorder,
    deadline: Option<Instant>,
    align: usize,
    scratch: &mut Option<DpScratch>,
) -> TileOut {
    let (tr, tc) = (t / geo.tile_cols, t % geo.tile_cols);
    let mut codes = [[0u16; TILE_COLS]; TILE_ROWS];
    let mut row_masks = [0u64; TILE_ROWS];
    let qmax = payload.qmax().unwrap_or(0);
    for r in 0..TILE_ROWS {
        let gr = tr * TILE_ROWS + r;
        if gr >= geo.rows {
            break;
        }
        let c0 = tc * TILE_COLS;
        let row = &w.row(gr)[c0..(c0 + TILE_COLS).min(geo.cols)];
        let scale = payload.group_size().map(|gs| {
            let s = scales[gr * geo.cols.div_ceil(gs) + c0 / gs];
            (s, q_limit(s, qmax))
        });
        for (c, &v) in row.iter().enumerate() {
            let code = match scale {
                None => v.to_bits(),
                Some((s, lim)) => quantize(v, s, lim) as i16 as u16,
            };
            if code != 0 {
                codes[r][c] = code;
                row_masks[r] |= 1u64 << c;
            }
        }
    }
    let folded: Vec<u64> = row_masks.iter().map(|&m| geo.fold(m)).collect();
    let identity: Vec<u8> = (0..TILE_ROWS as u8).collect();
    let before = permutation_cost(&folded, &identity, geo.ra);
    let mut perm = identity;
    let mut after = before;
    let mut used_dp = false;
    if reorder != Reorder::Off && before > 0 {
        let use_dp =
            matches!(reorder, Reorder::Dp { .. }) && deadline.is_none_or(|d| Instant::now() < d);
        let (candidate, cost) = if use_dp {
            used_dp = true;
            dp_grouping(&folded, geo.ra, scratch.get_or_insert_with(DpScratch::new))
        } else {
            greedy_grouping(&folded, geo.ra)
        };
        // Keep the original order unless the new one is strictly better.
        if cost < before {
            perm = candidate;
            after = cost;
        }
    }
    let mut words = [0u64; 16];
    for i in 0..geo.hb {
        let bits = (0..geo.ra).fold(0u64, |acc, a| acc | folded[perm[a * geo.hb + i] as usize]);
        let b = i * geo.kb;
        words[b / 64] |= bits << (b % 64);
    }
    let p_t: usize = words.iter().map(|w| w.count_ones() as usize).sum();
    debug_assert_eq!(p_t as u32, after);
    let stride = p_t.div_ceil(align) * align;
    let mut out_codes = vec![0u16; geo.q * stride];
    let mut rank = 0;
    for i in 0..geo.hb {
        let b = i * geo.kb;
        let mut bits = (words[b / 64] >> (b % 64)) & geo.row_mask();
        while bits != 0 {
            let j = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            for a in 0..geo.ra {
                let src_row = perm[a * geo.hb + i] as usize;
                for c in 0..geo.ca {
                    out_codes[(a * geo.ca + c) * stride + rank] = codes[src_row][c * geo.kb + j];
                }
            }
            rank += 1;
        }
    }
    let perm_word = perm
        .iter()
        .enumerate()
        .fold(0u64, |acc, (p, &r)| acc | (r as u64) << (4 * p));
    TileOut {
        words,
        perm: perm_word,
        codes: out_codes,
        before,
        after,
        used_dp,
    }
}

impl WeightFormat for IeBme {
    fn kind(&self) -> FormatKind {
        FormatKind::IeBme
    }
    fn rows(&self) -> usize {
        self.geo.rows
    }
    fn cols(&self) -> usize {
        self.geo.cols
    }
    fn storage(&self) -> Storage {
        let s = self.storage_breakdown();
        Storage {
            payload_bytes: s.value_bytes,
            metadata_bytes: s.union_bitmap_bytes
                + s.offset_bytes
                + s.permutation_bytes
                + s.scale_bytes,
        }
    }

    fn decode(&self) -> DenseMatrix {
        let geo = &self.geo;
        let (m, k) = (geo.rows, geo.cols);
        let mut data = vec![f16::ZERO; m * k];
        data.par_chunks_mut(TILE_ROWS * k)
            .enumerate()
            .for_each(|(tr, block)| {
                for tc in 0..geo.tile_cols {
                    let t = tr * geo.tile_cols + tc;
                    self.for_each_stored(t, |p, col, idx| {
                        let r = self.perm_row(t, p);
                        let (gr, gc) = (tr * TILE_ROWS + r, tc * TILE_COLS + col);
                        if gr < m && gc < k && !self.code_is_zero(idx) {
                            block[r * k + gc] = self.dequantized(idx, gr, tc);
                        }
                    });
                }
            });
        // Cannot fail: the shape was checked at construction and every value is finite
        // (encoded from a finite matrix, or checked by `validate` when read).
        DenseMatrix::new(m, k, data).expect("ie-bme holds a valid finite matrix")
    }

    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<()> {
        check_product_args(self.rows(), self.cols(), x, 1, threshold, y)?;
        let xm = self.masked_padded(x, 1, threshold);
        match &self.values {
            Values::F16(v) => self.matvec_with(&F16Src(v), &xm, y),
            Values::Int8(v) => self.matvec_with(&I8Src(v), &xm, y),
            Values::Int4(p, _) => self.matvec_with(&I4Src(p), &xm, y),
        }
        Ok(())
    }

    fn matmul(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<()> {
        let (m, _) = (self.rows(), self.cols());
        check_product_args(m, self.cols(), x, n, threshold, y)?;
        if n == 1 {
            return self.matvec(x, threshold, y);
        }
        let kp = self.geo.tile_cols * TILE_COLS;
        let xm = self.masked_padded(x, n, threshold);
        let geo = &self.geo;
        let blocks: Vec<Vec<f32>> = (0..geo.tile_rows)
            .into_par_iter()
            .map(|tr| {
                let mut out = vec![0f32; n * TILE_ROWS];
                let mut dense = [[0f32; TILE_COLS]; TILE_ROWS];
                for tc in 0..geo.tile_cols {
                    let t = tr * geo.tile_cols + tc;
                    if self.active[t] == 0 {
                        continue;
                    }
                    let rows_used = self.tile_dense(t, &mut dense);
                    for tok in 0..n {
                        let xs = &xm[tok * kp + tc * TILE_COLS..tok * kp + (tc + 1) * TILE_COLS];
                        let mut used = rows_used;
                        while used != 0 {
                            let r = used.trailing_zeros() as usize;
                            used &= used - 1;
                            out[tok * TILE_ROWS + r] += crate::dense::dot_f32(&dense[r], xs);
                        }
                    }
                }
                out
            })
            .collect();
        for (tr, out) in blocks.iter().enumerate() {
            for tok in 0..n {
                for r in 0..TILE_ROWS {
                    let gr = tr * TILE_ROWS + r;
                    if gr < m {
                        y[tok * m + gr] = out[tok * TILE_ROWS + r];
                    }
                }
            }
        }
        Ok(())
    }

    fn write_payload(&self, w: &mut ByteWriter) {
        w.u32(LAYOUT_VERSION);
        w.u64(self.geo.rows as u64);
        w.u64(self.geo.cols as u64);
        w.u8(self.geo.ra as u8);
        w.u8(self.geo.ca as u8);
        w.u8(self.payload.tag());
        w.u8(self.perms.is_some() as u8);
        w.u32(self.payload.group_size().unwrap_or(0) as u32);
        w.u32(self.stream_align as u32);
        w.u64s(&self.bitmaps);
        w.u32s(&self.offsets);
        w.u64s(self.perms.as_deref().unwrap_or(&[]));
        w.u16s(&self.scales.iter().map(|s| s.to_bits()).collect::<Vec<_>>());
        match &self.values {
            Values::F16(v) => w.f16s(v),
            Values::Int8(v) => w.bytes(&v.iter().map(|&b| b as u8).collect::<Vec<_>>()),
            Values::Int4(p, _) => w.bytes(p),
        }
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

#[cfg(test)]
mod tests;
