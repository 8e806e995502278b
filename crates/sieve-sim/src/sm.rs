//! The cycle model of one SM: four sub-partitions (Celty's SIMT cores), each with one warp
//! scheduler issuing at most one instruction per cycle from its resident warps, in order per
//! warp; a shared MIO pipe (shared memory, shuffles, L1) serving one wavefront per cycle for the
//! whole SM (Celty's "one SMEM bank group shared across four SIMT cores"); the SM's share of the
//! DRAM bandwidth as a queue in front of a fixed latency; one RLC decoder per sub-partition when
//! the Celty hardware is on. Blocks are admitted as warps, shared memory and registers allow.
//!
//! Warps run *programs* of [`Op`]s built from the real RLC-CSC stream by [`crate::kernel`].
//! Time advances cycle by cycle while some warp can issue and jumps to the next ready time when
//! none can, so long latency-bound runs cost little to simulate.

use crate::cost::CostModel;
use crate::gpu::GpuSpec;
use serde::Serialize;

/// Token slots a warp program may use to name outstanding results.
pub const TOKENS: usize = 8;

/// Where a global load is served from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Dram,
    L2,
}

/// One step of a warp program. Ops marked "free" take no issue slot.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    /// `n` independent ALU instructions (one issue slot each).
    Alu(u16),
    /// Free: a dependent-latency bubble of `c` cycles after the previous instruction.
    Lat(u16),
    /// Free: forget token `t` (start of a new load group).
    Clear(u8),
    /// Free: wait until token `t` is ready.
    Wait(u8),
    /// Global load: one instruction touching `lines` 128-byte lines, `bytes` new bytes from `level`;
    /// completes token `tok`.
    Ldg {
        lines: u8,
        bytes: u16,
        level: Level,
        tok: u8,
    },
    /// Warp shuffle completing token `tok`.
    Shfl(u8),
    /// Shared-memory store (one wavefront), no result.
    Sts,
    /// Shared-memory load (one wavefront) completing token `tok`.
    Lds(u8),
    /// Shared-memory float atomicAdd of one warp instruction needing `wavefronts` bank passes;
    /// the warp waits for it.
    AtomS(u8),
    /// Celty register-file accumulate of one stripe (one instruction, no MIO traffic).
    RfAcc,
    /// Celty hardware RLC decode of `lanes` run-lengths, completing token `tok`.
    Decode { lanes: u8, tok: u8 },
    /// Global atomicAdd (one warp instruction, 32 consecutive rows).
    Red,
    /// Block barrier.
    Bar,
    /// End of the warp's program.
    Exit,
}

/// Issued warp instructions by class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct InstrCounts {
    pub alu: u64,
    pub ldg: u64,
    pub shfl: u64,
    pub lds_sts: u64,
    pub atoms: u64,
    pub rf_acc: u64,
    pub decode: u64,
    pub red: u64,
    pub bar: u64,
}

impl InstrCounts {
    pub fn total(&self) -> u64 {
        self.alu
            + self.ldg
            + self.shfl
            + self.lds_sts
            + self.atoms
            + self.rf_acc
            + self.decode
            + self.red
            + self.bar
    }
    pub fn add(&mut self, o: &InstrCounts) {
        self.alu += o.alu;
        self.ldg += o.ldg;
        self.shfl += o.shfl;
        self.lds_sts += o.lds_sts;
        self.atoms += o.atoms;
        self.rf_acc += o.rf_acc;
        self.decode += o.decode;
        self.red += o.red;
        self.bar += o.bar;
    }
    /// Counts of one program, without running it (what the warp will issue).
    pub fn of_program(ops: &[Op]) -> Self {
        let mut c = Self::default();
        for op in ops {
            match *op {
                Op::Alu(n) => c.alu += n as u64,
                Op::Ldg { .. } => c.ldg += 1,
                Op::Shfl(_) => c.shfl += 1,
                Op::Sts | Op::Lds(_) => c.lds_sts += 1,
                Op::AtomS(_) => c.atoms += 1,
                Op::RfAcc => c.rf_acc += 1,
                Op::Decode { .. } => c.decode += 1,
                Op::Red => c.red += 1,
                Op::Bar => c.bar += 1,
                Op::Lat(_) | Op::Clear(_) | Op::Wait(_) | Op::Exit => {}
            }
        }
        c
    }
}

/// A thread block: its warps' programs and the resources it holds while resident.
#[derive(Clone, Debug)]
pub struct Block {
    pub warps: Vec<Vec<Op>>,
    pub shared_bytes: usize,
}

/// What one SM did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SmResult {
    pub cycles: u64,
    pub instr: InstrCounts,
    /// Cycles the MIO pipe (shared memory, shuffles, L1 wavefronts) was busy.
    pub mio_busy: u64,
    /// Extra shared-memory wavefronts caused by bank conflicts.
    pub conflict_wavefronts: u64,
    pub dram_bytes: u64,
    /// Cycles in which at least one sub-partition issued.
    pub issue_cycles: u64,
    /// Largest number of blocks resident at once.
    pub max_resident_blocks: usize,
}

struct Warp {
    ops: Vec<Op>,
    pc: usize,
    alu_left: u16,
    ready: u64,
    tok: [u64; TOKENS],
    block: usize,
    sub: usize,
    at_bar: bool,
    done: bool,
}

const NEVER: u64 = u64::MAX / 4;

/// Runs `blocks` (in launch order) on one SM with `active_sms` SMs sharing DRAM.
pub fn run_sm(blocks: Vec<Block>, gpu: &GpuSpec, cost: &CostModel, active_sms: usize) -> SmResult {
    let bpc = gpu.dram_bytes_per_cycle(active_sms, cost.dram_efficiency);
    let nsub = gpu.sub_partitions;
    let mut res = SmResult::default();
    let mut warps: Vec<Warp> = Vec::new();
    // Per block: resident warps' indices, live warp count, barrier arrivals.
    let mut block_warps: Vec<Vec<usize>> = Vec::new();
    let mut live: Vec<usize> = Vec::new();
    let mut arrived: Vec<usize> = Vec::new();
    let mut block_shared: Vec<usize> = Vec::new();
    let mut pending: std::collections::VecDeque<(usize, Block)> =
        blocks.into_iter().enumerate().collect();
    let nblocks = pending.len();
    block_warps.resize(nblocks, Vec::new());
    live.resize(nblocks, 0);
    arrived.resize(nblocks, 0);
    block_shared.resize(nblocks, 0);

    let (mut used_warps, mut used_blocks, mut used_shared, mut used_regs) = (0usize, 0, 0, 0);
    let mut sub_lists: Vec<Vec<usize>> = vec![Vec::new(); nsub];
    let mut rr = vec![0usize; nsub];
    let mut mio_free: u64 = 0;
    let mut dram_free: f64 = 0.0;
    let mut dec_free = vec![0u64; nsub];
    let mut red_free: u64 = 0;
    let mut drain: u64 = 0;
    let mut t: u64 = 0;
    let mut finished = 0usize;
    let regs_per_warp = cost.regs_per_thread as usize * 32;

    loop {
        // Admit blocks while they fit.
        while let Some((_, b)) = pending.front() {
            let nw = b.warps.len();
            let fits = used_warps + nw <= gpu.max_warps_per_sm
                && used_blocks < gpu.max_blocks_per_sm
                && used_shared + b.shared_bytes <= gpu.shared_bytes_per_sm
                && used_regs + nw * regs_per_warp <= gpu.registers_per_sm;
            if !fits && used_blocks > 0 {
                break;
            }
            let (id, b) = pending.pop_front().expect("front exists");
            used_warps += nw;
            used_blocks += 1;
            used_shared += b.shared_bytes;
            used_regs += nw * regs_per_warp;
            res.max_resident_blocks = res.max_resident_blocks.max(used_blocks);
            live[id] = nw;
            block_shared[id] = b.shared_bytes;
            for (wi, ops) in b.warps.into_iter().enumerate() {
                // Warps of a block go to consecutive sub-partitions (warp id mod 4).
                let sub = wi % nsub;
                let idx = warps.len();
                warps.push(Warp {
                    ops,
                    pc: 0,
                    alu_left: 0,
                    ready: t + cost.block_launch_cycles as u64,
                    tok: [0; TOKENS],
                    block: id,
                    sub,
                    at_bar: false,
                    done: false,
                });
                sub_lists[sub].push(idx);
                block_warps[id].push(idx);
            }
        }
        if finished == nblocks {
            break;
        }
        let mut issued = false;
        for sub in 0..nsub {
            let list = &sub_lists[sub];
            if list.is_empty() {
                continue;
            }
            let n = list.len();
            let mut pick = None;
            for i in 0..n {
                let w = list[(rr[sub] + i) % n];
                if warps[w].ready <= t {
                    pick = Some((w, (rr[sub] + i) % n));
                    break;
                }
            }
            let Some((w, pos)) = pick else { continue };
            // Greedy-then-oldest flavour: keep issuing from the same warp while it is ready.
            rr[sub] = pos;
            issued = true;
            let wp = &mut warps[w];
            let op = wp.ops[wp.pc];
            wp.ready = t + 1;
            match op {
                Op::Alu(n) => {
                    if wp.alu_left == 0 {
                        wp.alu_left = n;
                    }
                    wp.alu_left -= 1;
                    res.instr.alu += 1;
                    if wp.alu_left == 0 {
                        wp.pc += 1;
                    }
                }
                Op::Ldg {
                    lines,
                    bytes,
                    level,
                    tok,
                } => {
                    res.instr.ldg += 1;
                    let start = mio_free.max(t);
                    mio_free = start + lines.max(1) as u64;
                    res.mio_busy += lines.max(1) as u64;
                    let ready = match level {
                        Level::L2 => mio_free + cost.l2_latency as u64,
                        Level::Dram => {
                            res.dram_bytes += bytes as u64;
                            let s = dram_free.max(mio_free as f64);
                            dram_free = s + bytes as f64 / bpc;
                            dram_free.ceil() as u64 + cost.dram_latency as u64
                        }
                    };
                    let slot = &mut wp.tok[tok as usize];
                    *slot = (*slot).max(ready);
                    wp.pc += 1;
                }
                Op::Shfl(tok) => {
                    res.instr.shfl += 1;
                    let start = mio_free.max(t);
                    mio_free = start + 1;
                    res.mio_busy += 1;
                    let slot = &mut wp.tok[tok as usize];
                    *slot = (*slot).max(start + cost.shfl_latency as u64);
                    wp.pc += 1;
                }
                Op::Sts => {
                    res.instr.lds_sts += 1;
                    let start = mio_free.max(t);
                    mio_free = start + 1;
                    res.mio_busy += 1;
                    wp.pc += 1;
                }
                Op::Lds(tok) => {
                    res.instr.lds_sts += 1;
                    let start = mio_free.max(t);
                    mio_free = start + 1;
                    res.mio_busy += 1;
                    let slot = &mut wp.tok[tok as usize];
                    *slot = (*slot).max(start + cost.lds_latency as u64);
                    wp.pc += 1;
                }
                Op::AtomS(wf) => {
                    res.instr.atoms += 1;
                    let wf = wf.max(1) as u64;
                    res.conflict_wavefronts += wf - 1;
                    // Load and compare-and-swap passes, each `wf` wavefronts.
                    let start = mio_free.max(t);
                    mio_free = start + 2 * wf;
                    res.mio_busy += 2 * wf;
                    wp.ready = start
                        + cost.atom_latency as u64
                        + (wf - 1) * cost.atom_conflict_cycles as u64;
                    wp.pc += 1;
                }
                Op::RfAcc => {
                    res.instr.rf_acc += 1;
                    wp.ready = t + cost.rf_acc_latency.max(1) as u64;
                    wp.pc += 1;
                }
                Op::Decode { lanes, tok } => {
                    res.instr.decode += 1;
                    let start = dec_free[wp.sub].max(t);
                    let busy = (lanes as u64).div_ceil(cost.decoder_width.max(1) as u64);
                    dec_free[wp.sub] = start + busy;
                    let slot = &mut wp.tok[tok as usize];
                    *slot = (*slot).max(start + busy + cost.decoder_stages as u64);
                    wp.pc += 1;
                }
                Op::Red => {
                    res.instr.red += 1;
                    let start = mio_free.max(t);
                    mio_free = start + 1;
                    res.mio_busy += 1;
                    let rs = red_free.max(start);
                    red_free = rs + cost.red_cycles as u64;
                    drain = drain.max(red_free + cost.dram_latency as u64);
                    wp.pc += 1;
                }
                Op::Bar => {
                    res.instr.bar += 1;
                    wp.pc += 1;
                    wp.at_bar = true;
                    wp.ready = NEVER;
                    let b = wp.block;
                    arrived[b] += 1;
                    if arrived[b] == live[b] {
                        arrived[b] = 0;
                        for &o in &block_warps[b] {
                            let ow = &mut warps[o];
                            if ow.at_bar {
                                ow.at_bar = false;
                                ow.ready = t + 1;
                            }
                        }
                    }
                }
                Op::Lat(_) | Op::Clear(_) | Op::Wait(_) | Op::Exit => {
                    unreachable!("free ops are consumed after each issue")
                }
            }
            // Consume the free ops that follow.
            let wp = &mut warps[w];
            loop {
                match wp.ops.get(wp.pc).copied() {
                    Some(Op::Lat(c)) => {
                        wp.ready = wp.ready.max(t + c as u64);
                        wp.pc += 1;
                    }
                    Some(Op::Clear(k)) => {
                        wp.tok[k as usize] = 0;
                        wp.pc += 1;
                    }
                    Some(Op::Wait(k)) => {
                        wp.ready = wp.ready.max(wp.tok[k as usize]);
                        wp.pc += 1;
                    }
                    Some(Op::Exit) | None => {
                        wp.done = true;
                        wp.ready = NEVER;
                        break;
                    }
                    _ => break,
                }
            }
            if warps[w].done {
                let b = warps[w].block;
                let sublist = &mut sub_lists[warps[w].sub];
                if let Some(p) = sublist.iter().position(|&x| x == w) {
                    sublist.remove(p);
                    if rr[sub] >= sublist.len() {
                        rr[sub] = 0;
                    }
                }
                live[b] -= 1;
                // A barrier waiting only on exited warps would otherwise hang.
                if live[b] > 0 && arrived[b] == live[b] {
                    arrived[b] = 0;
                    for &o in &block_warps[b] {
                        let ow = &mut warps[o];
                        if ow.at_bar {
                            ow.at_bar = false;
                            ow.ready = t + 1;
                        }
                    }
                }
                if live[b] == 0 {
                    finished += 1;
                    let nw = block_warps[b].len();
                    used_warps -= nw;
                    used_blocks -= 1;
                    used_regs -= nw * regs_per_warp;
                    used_shared -= block_shared[b];
                    for &o in &block_warps[b] {
                        warps[o].ops = Vec::new();
                    }
                }
            }
        }
        if issued {
            res.issue_cycles += 1;
            t += 1;
        } else {
            let next = sub_lists
                .iter()
                .flatten()
                .map(|&w| warps[w].ready)
                .min()
                .unwrap_or(NEVER);
            if next >= NEVER {
                if finished == nblocks {
                    break;
                }
                // Nothing resident can run and nothing is pending: a program bug.
                if pending.is_empty() {
                    break;
                }
                t += 1;
            } else {
                t = next.max(t + 1);
            }
        }
    }
    res.cycles = t.max(drain);
    res
}
