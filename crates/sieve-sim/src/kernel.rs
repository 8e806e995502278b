//! Warp programs of the Celty spMspV kernel, built from a block's real RLC-CSC tile and mask.
//!
//! [`Mapping::Kernel`] follows `crates/sieve-cuda/kernels/rlc_csc_spmspv.cu` line by line (the
//! kernel whose H200 times calibrate the model): a block owns `block_rows` rows and
//! `cols_per_block` columns; for every 32 columns it loads `x` and the active columns' segment
//! metadata; for every active column all warps broadcast the column's metadata and deal its slabs
//! round-robin with a running pair counter; a warp loads its slab (fast path: one 128-bit value
//! load and one 32-bit run load per lane when the slab has 8 stripes and n = 4; otherwise one
//! 16-bit value and one run load per stripe) and consumes the previous one: row reconstruction
//! by intra-warp inclusive scans (three packed scans on the fast path, one per stripe otherwise),
//! then one shared-memory float atomicAdd per stripe. The block then adds its accumulator to `y`
//! with one global atomic per row.
//!
//! [`Mapping::CeltyTile`] is Celty's own warp tile (paper section 3): 256-row segments, warp `w`
//! of a block owns row segment `w` (so sub-partition `w`'s register file can hold its outputs),
//! iterates the block's columns, and loads any slab with one vector load per lane.
//!
//! The Celty hardware ([`Features`]) replaces the scans by the RLC decoder (8 runs per cycle,
//! 3-stage pipeline, one per sub-partition) and the shared-memory atomics of rows that fall in
//! the warp's register partition by a register-file accumulate; other rows fall back to shared
//! memory.

use crate::cost::CostModel;
use crate::error::{Result, SimError};
use crate::sm::{Block, Level, Op};
use crate::trace::{bank_passes, slab_count, slab_trace, SlabTrace, Tile};
use serde::Serialize;
use sieve_formats::rlc_csc::LANES;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Mapping {
    /// sieve's H200 kernel (the measured one).
    Kernel,
    /// Celty's 256-row-per-warp tile.
    CeltyTile,
}

/// Which stages run (Celty Fig. 5 method: leave one out).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Stage {
    Full,
    NoRecon,
    NoAccum,
    LoadsOnly,
}

impl Stage {
    /// Full, no reconstruction, no accumulation, loads only (the measured variants' order).
    pub const ALL: [Stage; 4] = [
        Stage::Full,
        Stage::NoRecon,
        Stage::NoAccum,
        Stage::LoadsOnly,
    ];
    fn recon(self) -> bool {
        matches!(self, Stage::Full | Stage::NoAccum)
    }
    fn accum(self) -> bool {
        matches!(self, Stage::Full | Stage::NoRecon)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct KernelConfig {
    pub mapping: Mapping,
    /// Rows per block (Kernel: the RLC-CSC row block; CeltyTile: 256 per warp).
    pub block_rows: usize,
    pub cols_per_block: usize,
    pub warps: usize,
    pub index_bits: u32,
    /// Whether a warp waits for each slab's loads before issuing the next slab's. In sieve's
    /// kernel the `pend = cur` register copy is a use of the loaded registers, so it does (this
    /// is what the calibration selects: with two slabs in flight the dp dependence of the
    /// measured times cannot be reproduced). Celty's tile is modelled double-buffered.
    pub serialized_loads: bool,
}

impl KernelConfig {
    /// The configuration of the measured kernel (`rlc-csc/b1024/c64/w4`).
    pub fn measured() -> Self {
        Self {
            mapping: Mapping::Kernel,
            block_rows: 1024,
            cols_per_block: 64,
            warps: 4,
            index_bits: 4,
            serialized_loads: true,
        }
    }
    /// Celty's tile: 4 warps x 256 rows, 64-column inner loop, two slabs in flight per warp.
    pub fn celty() -> Self {
        Self {
            mapping: Mapping::CeltyTile,
            block_rows: 1024,
            cols_per_block: 64,
            warps: 4,
            index_bits: 4,
            serialized_loads: false,
        }
    }
    /// Rows of the RLC-CSC segments the tile is encoded with.
    pub fn segment_rows(&self) -> usize {
        match self.mapping {
            Mapping::Kernel => self.block_rows,
            Mapping::CeltyTile => 256,
        }
    }
    pub fn validate(&self) -> Result<()> {
        if self.warps == 0 || self.warps > 16 {
            return Err(SimError::Option(format!(
                "warps per block {} outside 1..=16",
                self.warps
            )));
        }
        if self.cols_per_block == 0 {
            return Err(SimError::Option("cols per block must be positive".into()));
        }
        if self.block_rows == 0 || !self.block_rows.is_multiple_of(256) || self.block_rows > 65536 {
            return Err(SimError::Option(format!(
                "block rows {} must be a positive multiple of 256, at most 65536",
                self.block_rows
            )));
        }
        if self.mapping == Mapping::CeltyTile && self.block_rows != 256 * self.warps {
            return Err(SimError::Option(format!(
                "Celty's tile has 256 rows per warp: block rows {} != 256 x {} warps",
                self.block_rows, self.warps
            )));
        }
        if !(2..=8).contains(&self.index_bits) {
            return Err(SimError::Option(format!(
                "index bits {} outside 2..=8",
                self.index_bits
            )));
        }
        Ok(())
    }
}

/// The Celty hardware and stage switches.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Features {
    pub decoder: bool,
    /// Fraction of each sub-partition's output rows held in its register file (0..=1).
    pub reg_fraction: f64,
    pub stage: Stage,
}

impl Features {
    pub fn baseline() -> Self {
        Self {
            decoder: false,
            reg_fraction: 0.0,
            stage: Stage::Full,
        }
    }
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.reg_fraction) || self.reg_fraction.is_nan() {
            return Err(SimError::Option(format!(
                "register fraction {} outside [0, 1]",
                self.reg_fraction
            )));
        }
        Ok(())
    }
}

/// Where a block's entries were accumulated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct AccumStats {
    /// Real entries (nonzeros and gap padding) multiplied by an active activation.
    pub entries: u64,
    pub to_registers: u64,
    /// Shared-memory accumulations: rows of the warp's partition beyond the register fraction.
    pub to_shared_partition: u64,
    /// Shared-memory fallback for rows outside the warp's partition.
    pub to_shared_other: u64,
    pub slabs: u64,
    /// Slabs with fewer than 8 stripes (the kernel's slow path).
    pub short_slabs: u64,
    /// Shared-memory atomic instructions and their bank passes.
    pub atomic_instr: u64,
    pub atomic_passes: u64,
}

impl AccumStats {
    pub fn add(&mut self, o: &AccumStats) {
        self.entries += o.entries;
        self.to_registers += o.to_registers;
        self.to_shared_partition += o.to_shared_partition;
        self.to_shared_other += o.to_shared_other;
        self.slabs += o.slabs;
        self.short_slabs += o.short_slabs;
        self.atomic_instr += o.atomic_instr;
        self.atomic_passes += o.atomic_passes;
    }
}

const TOK_X: u8 = 0;
const TOK_META: u8 = 1;
const TOK_SLAB: [u8; 2] = [2, 3];
const TOK_SHFL: u8 = 4;
const TOK_DEC: u8 = 5;
const TOK_LDS: u8 = 6;
/// ALU instructions of the per-column bookkeeping (ffs, mask update, two signed modulos).
const COLUMN_ALU: u16 = 24;

/// The register partition of a warp: rows `[lo, lo + reg)` are in its sub-partition's register
/// file, rows `[lo, hi)` are its partition.
#[derive(Clone, Copy)]
struct Partition {
    lo: u32,
    hi: u32,
    reg: u32,
}

impl Partition {
    fn of(lo: usize, len: usize, fraction: f64) -> Self {
        Self {
            lo: lo as u32,
            hi: (lo + len) as u32,
            reg: (fraction * len as f64).floor() as u32,
        }
    }
}

struct Builder<'a> {
    cfg: &'a KernelConfig,
    feat: &'a Features,
    banks: usize,
    ops: Vec<Op>,
    stats: AccumStats,
}

impl Builder<'_> {
    fn alu(&mut self, n: u16) {
        if n > 0 {
            self.ops.push(Op::Alu(n));
        }
    }

    /// Loads of one slab into token `tok`. `vector_any` loads a short slab with one vector
    /// load per lane (Celty's tile) instead of the kernel's per-stripe loads.
    fn load_slab(&mut self, sl: &SlabTrace, tok: u8, vector_any: bool) {
        let s = sl.stripes;
        self.alu(8);
        self.ops.push(Op::Clear(tok));
        // slab_row cursor: one broadcast 2-byte load.
        self.ops.push(Op::Ldg {
            lines: 1,
            bytes: 32,
            level: Level::Dram,
            tok,
        });
        let value_bytes = (2 * LANES * s) as u16;
        let run_bytes = (self.cfg.index_bits as usize * LANES * s / 8) as u16;
        let lines = (value_bytes as usize).div_ceil(128).max(1) as u8;
        if self.fast(s) || vector_any {
            self.ops.push(Op::Ldg {
                lines,
                bytes: value_bytes,
                level: Level::Dram,
                tok,
            });
            self.ops.push(Op::Ldg {
                lines: 1,
                bytes: run_bytes,
                level: Level::Dram,
                tok,
            });
        } else {
            for st in 0..s {
                self.alu(8);
                self.ops.push(Op::Ldg {
                    lines: lines + 1,
                    bytes: if st == 0 { value_bytes } else { 0 },
                    level: Level::Dram,
                    tok,
                });
                self.ops.push(Op::Ldg {
                    lines: 1,
                    bytes: if st == 0 { run_bytes } else { 0 },
                    level: Level::Dram,
                    tok,
                });
            }
        }
    }

    fn fast(&self, stripes: usize) -> bool {
        stripes == 8 && self.cfg.index_bits == 4
    }

    fn consume(&mut self, sl: &SlabTrace, tok: u8, part: Partition, packed_any: bool) {
        let s = sl.stripes;
        let stage = self.feat.stage;
        self.ops.push(Op::Wait(tok));
        if stage.recon() {
            if self.feat.decoder {
                // Runs go to the decoder straight from the loaded word; the decoder adds the
                // broadcast base itself.
                self.alu(1);
                for _ in 0..s {
                    self.ops.push(Op::Decode {
                        lanes: LANES as u8,
                        tok: TOK_DEC,
                    });
                }
                self.ops.push(Op::Wait(TOK_DEC));
            } else if self.fast(s) || packed_any {
                // Packed scans: three 10-bit fields per 32-bit word, ceil(S / 3) scans.
                let n = s.div_ceil(3);
                self.alu(2 * s as u16);
                self.ops.push(Op::Clear(TOK_SHFL));
                for _ in 0..5 {
                    for _ in 0..n {
                        self.ops.push(Op::Shfl(TOK_SHFL));
                    }
                    self.ops.push(Op::Wait(TOK_SHFL));
                    self.alu(2 * n as u16);
                }
                for _ in 0..n {
                    self.ops.push(Op::Shfl(TOK_SHFL));
                }
                self.ops.push(Op::Wait(TOK_SHFL));
                self.alu(4 * s as u16);
            } else {
                for _ in 0..s {
                    self.alu(3);
                    self.ops.push(Op::Clear(TOK_SHFL));
                    for _ in 0..5 {
                        self.ops.push(Op::Shfl(TOK_SHFL));
                        self.ops.push(Op::Wait(TOK_SHFL));
                        self.alu(2);
                    }
                    self.ops.push(Op::Shfl(TOK_SHFL));
                    self.ops.push(Op::Wait(TOK_SHFL));
                    self.alu(3);
                }
            }
        } else {
            self.alu(s as u16);
        }
        for st in 0..s {
            let valid = sl.valid[st];
            if valid == 0 {
                continue;
            }
            self.stats.entries += valid.count_ones() as u64;
            if !stage.accum() {
                self.alu(3);
                continue;
            }
            self.alu(4);
            // Without reconstruction the kernel scatters to the logical index (consecutive).
            let rows: [u32; LANES] = if stage.recon() {
                sl.rows[st]
            } else {
                std::array::from_fn(|t| (LANES * st + t) as u32)
            };
            let (mut rf, mut sh) = (0u32, 0u32);
            for t in 0..LANES {
                if valid & (1 << t) == 0 {
                    continue;
                }
                let r = rows[t];
                if r >= part.lo && r < part.lo + part.reg {
                    rf |= 1 << t;
                    self.stats.to_registers += 1;
                } else {
                    sh |= 1 << t;
                    if r >= part.lo && r < part.hi {
                        self.stats.to_shared_partition += 1;
                    } else {
                        self.stats.to_shared_other += 1;
                    }
                }
            }
            if rf != 0 {
                self.ops.push(Op::RfAcc);
            }
            if sh != 0 {
                let passes = bank_passes(&rows, sh, self.banks);
                self.stats.atomic_instr += 1;
                self.stats.atomic_passes += passes as u64;
                self.ops.push(Op::AtomS(passes.min(255) as u8));
            }
        }
    }

    fn prologue(&mut self, h: usize) {
        self.alu(6);
        for _ in 0..h.div_ceil(LANES * self.cfg.warps) {
            self.alu(2);
            self.ops.push(Op::Sts);
        }
        self.ops.push(Op::Bar);
    }

    fn epilogue(&mut self, h: usize) {
        if !self.feat.stage.accum() {
            self.alu(2);
        }
        self.ops.push(Op::Bar);
        for _ in 0..h.div_ceil(LANES * self.cfg.warps) {
            self.ops.push(Op::Clear(TOK_LDS));
            self.ops.push(Op::Lds(TOK_LDS));
            self.ops.push(Op::Wait(TOK_LDS));
            self.alu(2);
            self.ops.push(Op::Red);
        }
        self.ops.push(Op::Exit);
    }

    /// `x` and the segment metadata of one group of up to 32 columns.
    fn group_loads(&mut self, any_active: bool) {
        self.alu(6);
        self.ops.push(Op::Clear(TOK_X));
        self.ops.push(Op::Ldg {
            lines: 1,
            bytes: 128,
            level: Level::L2,
            tok: TOK_X,
        });
        self.ops.push(Op::Wait(TOK_X));
        self.alu(4);
        if any_active {
            self.ops.push(Op::Clear(TOK_META));
            // seg_start[seg], seg_start[seg + 1], seg_len, slab_start[seg], slab_start[seg + 1].
            for bytes in [128u16, 0, 128, 128, 0] {
                self.ops.push(Op::Ldg {
                    lines: 1,
                    bytes,
                    level: Level::Dram,
                    tok: TOK_META,
                });
            }
            self.ops.push(Op::Wait(TOK_META));
        }
        self.alu(3);
    }
}

/// Builds the block whose tile is `tile` and whose columns' activity is `active` (one flag per
/// tile column).
pub fn build_block(
    tile: &Tile,
    active: &[bool],
    cfg: &KernelConfig,
    feat: &Features,
    cost: &CostModel,
    banks: usize,
) -> Result<(Block, AccumStats)> {
    cfg.validate()?;
    feat.validate()?;
    if active.len() != tile.cols {
        return Err(SimError::Option(format!(
            "mask has {} columns, tile {}",
            active.len(),
            tile.cols
        )));
    }
    let f = &tile.encoded;
    let h = tile.rows;
    let c = tile.cols;
    let nw = cfg.warps;
    let mut stats = AccumStats::default();
    let mut warps = Vec::with_capacity(nw);
    for w in 0..nw {
        let mut b = Builder {
            cfg,
            feat,
            banks,
            ops: Vec::new(),
            stats: AccumStats::default(),
        };
        b.prologue(h);
        let mut pend: Option<(SlabTrace, u8)> = None;
        let mut next_tok = 0usize;
        let mut pair = 0usize;
        let (part, vector_any) = match cfg.mapping {
            Mapping::Kernel => {
                let nsub = 4usize.min(nw).max(1);
                let len = h.div_ceil(nsub);
                let p = w % nsub;
                (
                    Partition::of(
                        (p * len).min(h),
                        len.min(h - (p * len).min(h)),
                        feat.reg_fraction,
                    ),
                    false,
                )
            }
            Mapping::CeltyTile => (Partition::of(0, 256, feat.reg_fraction), true),
        };
        for g0 in (0..c).step_by(LANES) {
            let g1 = (g0 + LANES).min(c);
            let any = active[g0..g1].iter().any(|&a| a);
            b.group_loads(any);
            for col in g0..g1 {
                if !active[col] {
                    continue;
                }
                let (seg, mine): (Option<usize>, Vec<usize>) = match cfg.mapping {
                    Mapping::Kernel => {
                        let seg = col; // one row block per tile
                        let ns = slab_count(f, seg);
                        b.alu(3);
                        b.ops.push(Op::Clear(TOK_SHFL));
                        b.ops.push(Op::Shfl(TOK_SHFL));
                        b.ops.push(Op::Wait(TOK_SHFL));
                        b.alu(1);
                        if ns == 0 {
                            continue;
                        }
                        for _ in 0..5 {
                            b.ops.push(Op::Shfl(TOK_SHFL));
                        }
                        b.ops.push(Op::Wait(TOK_SHFL));
                        b.alu(COLUMN_ALU);
                        b.ops
                            .push(Op::Lat(cost.column_chain.min(u16::MAX as u32) as u16));
                        let j0 = (w + nw - pair % nw) % nw;
                        pair += ns;
                        (Some(seg), (j0..ns).step_by(nw).collect())
                    }
                    Mapping::CeltyTile => {
                        b.alu(4);
                        if w >= f.row_blocks() {
                            continue;
                        }
                        let seg = w * c + col;
                        (Some(seg), (0..slab_count(f, seg)).collect())
                    }
                };
                let Some(seg) = seg else { continue };
                for j in mine {
                    let sl = slab_trace(f, seg, j);
                    let tok = TOK_SLAB[next_tok % 2];
                    next_tok += 1;
                    b.stats.slabs += 1;
                    if !(sl.stripes == 8 && cfg.index_bits == 4) {
                        b.stats.short_slabs += 1;
                    }
                    b.load_slab(&sl, tok, vector_any);
                    if let Some((p, ptok)) = pend.take() {
                        b.consume(&p, ptok, part, vector_any);
                    }
                    if cfg.serialized_loads {
                        b.ops.push(Op::Wait(tok));
                    }
                    pend = Some((sl, tok));
                }
            }
        }
        if let Some((p, ptok)) = pend.take() {
            b.consume(&p, ptok, part, vector_any);
        }
        b.epilogue(h);
        stats.add(&b.stats);
        warps.push(b.ops);
    }
    Ok((
        Block {
            warps,
            shared_bytes: h * 4,
        },
        stats,
    ))
}
