//! Random GGUF blocks of every type, with scales of a real model's size: for the kernel tests
//! here and for the GGUF loader tests of `sieve-model`.

use super::{offset_blocks, BlockType, BLOCK};
use half::f16;

pub struct Lcg(pub u64);

impl Lcg {
    pub fn next_u32(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    /// Uniform in [-0.5, 0.5).
    pub fn unit(&mut self) -> f32 {
        self.next_u32() as f32 / (1u64 << 31) as f32 - 0.5
    }
}

/// Random blocks of `ty` with scales of a real model's size (|d| up to ~0.02, |m| up to ~0.15)
/// and uniformly random quants.
pub fn random_blocks(ty: BlockType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    if offset_blocks::handles(ty) {
        return random_offset_blocks(ty, rows, cols, seed);
    }
    let mut rng = Lcg(seed);
    let mut out = Vec::new();
    for _ in 0..rows * cols / BLOCK {
        let d = f16::from_f32(0.04 * rng.unit());
        out.extend_from_slice(&d.to_bits().to_le_bytes());
        if ty == BlockType::Q4_1 {
            let m = f16::from_f32(0.3 * rng.unit());
            out.extend_from_slice(&m.to_bits().to_le_bytes());
        }
        for _ in 0..ty.block_bytes() - ty.header_bytes() {
            out.push(rng.next_u32() as u8);
        }
    }
    out
}

/// Where each offset type keeps its f16 scales, and their magnitude in a real model (K types:
/// `d`, `dmin` of about max|w| / (63 · 15)).
pub fn f16_fields(ty: BlockType) -> &'static [(usize, f32)] {
    match ty {
        BlockType::Q5_0 => &[(0, 0.04)],
        BlockType::Q5_1 => &[(0, 0.02), (2, 0.3)],
        BlockType::Q4_K | BlockType::Q5_K => &[(0, 0.0008), (2, 0.002)],
        BlockType::Q6_K => &[(208, 0.0006)],
        _ => &[],
    }
}

/// The bytes of a block of `ty` that hold its quants (the rest are scales).
pub fn quant_bytes(ty: BlockType) -> std::ops::Range<usize> {
    match ty {
        BlockType::Q5_0 => 2..22,
        BlockType::Q5_1 => 4..24,
        BlockType::Q4_K => 16..144,
        BlockType::Q5_K => 16..176,
        BlockType::Q6_K => 0..192,
        _ => ty.header_bytes()..ty.block_bytes(),
    }
}

/// Uniformly random bytes (quants, packed 6-bit scales, i8 scales) with f16 scales of a real
/// model's size.
pub fn random_offset_blocks(ty: BlockType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut rng = Lcg(seed);
    let bb = ty.block_bytes();
    let mut out = vec![0u8; rows * cols / ty.block_elems() * bb];
    for blk in out.chunks_exact_mut(bb) {
        for v in blk.iter_mut() {
            *v = rng.next_u32() as u8;
        }
        for &(at, amp) in f16_fields(ty) {
            let v = f16::from_f32(2.0 * amp * rng.unit());
            blk[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    out
}

/// Activations like a normed hidden state: mostly of order 1, with a few outliers.
pub fn random_x(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Lcg(seed);
    (0..len)
        .map(|i| {
            let v = 2.0 * rng.unit();
            if i % 37 == 5 {
                20.0 * v
            } else {
                v
            }
        })
        .collect()
}
