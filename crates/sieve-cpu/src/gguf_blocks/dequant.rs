//! GGML tensor types and dequantization of GGUF block formats to f32.
//!
//! Block layouts follow the GGML spec (ggml-common.h / gguf-py `quants.py`), all little-endian:
//!
//! | type | elements/block | bytes/block | layout |
//! |---|---|---|---|
//! | Q4_0 | 32 | 18 | f16 d, 16 B nibbles; x = (q - 8) d |
//! | Q4_1 | 32 | 20 | f16 d, f16 m, 16 B nibbles; x = q d + m |
//! | Q5_0 | 32 | 22 | f16 d, u32 high bits, 16 B nibbles; x = (q - 16) d |
//! | Q5_1 | 32 | 24 | f16 d, f16 m, u32 high bits, 16 B nibbles; x = q d + m |
//! | Q8_0 | 32 | 34 | f16 d, 32 x i8; x = q d |
//! | Q4_K | 256 | 144 | f16 d, f16 dmin, 12 B packed 6-bit (scale, min) x 8, 128 B nibbles |
//! | Q5_K | 256 | 176 | as Q4_K plus 32 B of fifth bits before the nibbles |
//! | Q6_K | 256 | 210 | 128 B low nibbles, 64 B high 2-bit pairs, 16 x i8 scales, f16 d |
//!
//! In the 32-element formats, byte j holds element j in its low nibble and element j + 16 in its
//! high nibble. In the K formats, each 64-element chunk uses 32 bytes of nibbles: low nibbles for
//! its first 32 elements, high nibbles for the next 32.

use crate::error::{CpuError, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// Every tensor type id a GGUF file may carry (gguf-py `GGMLQuantizationType`). Knowing the block
/// geometry of all of them lets the reader bounds-check any file, even one whose tensors it cannot
/// dequantize.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

const QK_K: usize = 256;

impl GgmlType {
    const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
        GgmlType::NVFP4,
        GgmlType::Q1_0,
    ];

    /// The numeric id stored in GGUF tensor infos.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
            NVFP4 => 40,
            Q1_0 => 41,
        }
    }

    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            NVFP4 => "NVFP4",
            Q1_0 => "Q1_0",
        }
    }

    /// (elements per block, bytes per block), as in gguf-py's `GGML_QUANT_SIZES`.
    pub fn block_geometry(self) -> (usize, usize) {
        use GgmlType::*;
        match self {
            F32 => (1, 4),
            F16 => (1, 2),
            Q4_0 => (32, 2 + 16),
            Q4_1 => (32, 2 + 2 + 16),
            Q5_0 => (32, 2 + 4 + 16),
            Q5_1 => (32, 2 + 2 + 4 + 16),
            Q8_0 => (32, 2 + 32),
            Q8_1 => (32, 4 + 4 + 32),
            Q2_K => (QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Q3_K => (QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Q4_K => (QK_K, 2 + 2 + QK_K / 2 + 12),
            Q5_K => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
            Q6_K => (QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            Q8_K => (QK_K, 4 + QK_K + QK_K / 8),
            IQ2_XXS => (QK_K, 2 + QK_K / 4),
            IQ2_XS => (QK_K, 2 + QK_K / 4 + QK_K / 32),
            IQ3_XXS => (QK_K, 2 + QK_K / 4 + QK_K / 8),
            IQ1_S => (QK_K, 2 + QK_K / 8 + QK_K / 16),
            IQ4_NL => (32, 2 + 16),
            IQ3_S => (QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            IQ2_S => (QK_K, 2 + QK_K / 4 + QK_K / 16),
            IQ4_XS => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            F64 => (1, 8),
            IQ1_M => (QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            BF16 => (1, 2),
            TQ1_0 => (QK_K, 2 + 4 * 13),
            TQ2_0 => (QK_K, 2 + 64),
            MXFP4 => (32, 1 + 16),
            NVFP4 => (64, 4 + 32),
            Q1_0 => (128, 2 + 16),
        }
    }

    pub fn block_size(self) -> usize {
        self.block_geometry().0
    }

    /// Bytes for `n_elements` values, or `None` when the count is not a whole number of blocks or
    /// the size overflows.
    pub fn byte_size(self, n_elements: u64) -> Option<u64> {
        let (block, bytes) = self.block_geometry();
        let block = block as u64;
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(bytes as u64)
    }

    /// Whether [`dequantize`] handles this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q5_K | Q6_K
        )
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Dequantizes `data` (a whole number of blocks of `ty`) into `n_elements` f32 values.
pub fn dequantize(ty: GgmlType, data: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n_elements];
    dequantize_into(ty, data, &mut out)?;
    Ok(out)
}

/// Dequantizes `data` into `out`; `data` must hold exactly `out.len()` elements of `ty`.
pub fn dequantize_into(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let Some(kernel) = block_kernel(ty) else {
        return Err(CpuError::Unsupported(format!(
            "dequantization of ggml type {} (id {}); supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, \
             Q5_1, Q8_0, Q4_K, Q5_K, Q6_K",
            ty.name(),
            ty.id()
        )));
    };
    let (block_elems, block_bytes) = ty.block_geometry();
    let expected = ty.byte_size(out.len() as u64);
    if expected != Some(data.len() as u64) {
        let need = match expected {
            Some(bytes) => format!("{bytes} bytes"),
            None => format!("a multiple of {block_elems} elements"),
        };
        return Err(CpuError::InvalidArgument(format!(
            "{} elements of {} need {need}, got {} bytes",
            out.len(),
            ty.name(),
            data.len()
        )));
    }
    // Group blocks so each rayon task does a meaningful amount of work (~16K elements).
    let blocks_per_task = (16384 / block_elems).max(1);
    out.par_chunks_mut(block_elems * blocks_per_task)
        .zip(data.par_chunks(block_bytes * blocks_per_task))
        .for_each(|(out_group, data_group)| {
            for (o, b) in out_group
                .chunks_exact_mut(block_elems)
                .zip(data_group.chunks_exact(block_bytes))
            {
                kernel(b, o);
            }
        });
    Ok(())
}

/// Dequantizes one block (its bytes) into its values.
pub(crate) type BlockKernel = fn(&[u8], &mut [f32]);

/// The function that dequantizes one block of `ty` (`block_geometry().1` bytes) into its
/// `block_geometry().0` values, for the types [`GgmlType::can_dequantize`] lists.
pub(crate) fn block_kernel(ty: GgmlType) -> Option<BlockKernel> {
    let kernel: BlockKernel = match ty {
        GgmlType::F32 => |b, o| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, o| o[0] = read_f16(b, 0),
        GgmlType::BF16 => |b, o| o[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q4_0 => block_q4_0,
        GgmlType::Q4_1 => block_q4_1,
        GgmlType::Q5_0 => block_q5_0,
        GgmlType::Q5_1 => block_q5_1,
        GgmlType::Q8_0 => block_q8_0,
        GgmlType::Q4_K => block_q4_k,
        GgmlType::Q5_K => block_q5_k,
        GgmlType::Q6_K => block_q6_k,
        _ => return None,
    };
    Some(kernel)
}

/// The 8 (scale, min) 6-bit pairs of a Q4_K/Q5_K block's 12 packed bytes.
pub(crate) fn k_scales_and_mins(packed: &[u8]) -> [(u8, u8); 8] {
    k_scale_min(packed)
}

fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

fn block_q4_0(b: &[u8], out: &mut [f32]) {
    let d = read_f16(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        out[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn block_q4_1(b: &[u8], out: &mut [f32]) {
    let d = read_f16(b, 0);
    let m = read_f16(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        out[j] = (qs[j] & 0x0F) as f32 * d + m;
        out[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// Element j's fifth bit is bit j of the little-endian u32 `qh`.
fn q5_values(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        let high_lo = ((qh >> j) & 1) as u8;
        let high_hi = ((qh >> (j + 16)) & 1) as u8;
        q[j] = (qs[j] & 0x0F) | (high_lo << 4);
        q[j + 16] = (qs[j] >> 4) | (high_hi << 4);
    }
    q
}

fn block_q5_0(b: &[u8], out: &mut [f32]) {
    let d = read_f16(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let q = q5_values(qh, &b[6..22]);
    for j in 0..32 {
        out[j] = (q[j] as i32 - 16) as f32 * d;
    }
}

fn block_q5_1(b: &[u8], out: &mut [f32]) {
    let d = read_f16(b, 0);
    let m = read_f16(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let q = q5_values(qh, &b[8..24]);
    for j in 0..32 {
        out[j] = q[j] as f32 * d + m;
    }
}

fn block_q8_0(b: &[u8], out: &mut [f32]) {
    let d = read_f16(b, 0);
    for j in 0..32 {
        out[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// The 8 (scale, min) 6-bit pairs of a Q4_K/Q5_K block. Bytes 0..4 hold scales 0..4 in their low
/// 6 bits, bytes 4..8 mins 0..4; scales/mins 4..8 take their low 4 bits from the nibbles of bytes
/// 8..12 and their top 2 bits from the top 2 bits of bytes 0..4 (scales) / 4..8 (mins).
fn k_scale_min(packed: &[u8]) -> [(u8, u8); 8] {
    let mut pairs = [(0u8, 0u8); 8];
    for j in 0..8 {
        pairs[j] = if j < 4 {
            (packed[j] & 63, packed[j + 4] & 63)
        } else {
            (
                (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4),
                (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
            )
        };
    }
    pairs
}

fn block_q4_k(b: &[u8], out: &mut [f32]) {
    let d = read_f16(b, 0);
    let dmin = read_f16(b, 2);
    let pairs = k_scale_min(&b[4..16]);
    let qs = &b[16..144];
    for chunk in 0..4 {
        let q = &qs[chunk * 32..chunk * 32 + 32];
        let (sc_lo, m_lo) = pairs[2 * chunk];
        let (sc_hi, m_hi) = pairs[2 * chunk + 1];
        let (d_lo, min_lo) = (d * sc_lo as f32, dmin * m_lo as f32);
        let (d_hi, min_hi) = (d * sc_hi as f32, dmin * m_hi as f32);
        let o = &mut out[chunk * 64..chunk * 64 + 64];
        for l in 0..32 {
            o[l] = d_lo * (q[l] & 0x0F) as f32 - min_lo;
            o[l + 32] = d_hi * (q[l] >> 4) as f32 - min_hi;
        }
    }
}

fn block_q5_k(b: &[u8], out: &mut [f32]) {
    let d = read_f16(b, 0);
    let dmin = read_f16(b, 2);
    let pairs = k_scale_min(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for chunk in 0..4 {
        let q = &qs[chunk * 32..chunk * 32 + 32];
        // Sub-block s (of 8, 32 elements each) takes its fifth bit from bit s of qh[l].
        let (bit_lo, bit_hi) = (2 * chunk, 2 * chunk + 1);
        let (sc_lo, m_lo) = pairs[bit_lo];
        let (sc_hi, m_hi) = pairs[bit_hi];
        let (d_lo, min_lo) = (d * sc_lo as f32, dmin * m_lo as f32);
        let (d_hi, min_hi) = (d * sc_hi as f32, dmin * m_hi as f32);
        let o = &mut out[chunk * 64..chunk * 64 + 64];
        for l in 0..32 {
            let lo = (q[l] & 0x0F) | (((qh[l] >> bit_lo) & 1) << 4);
            let hi = (q[l] >> 4) | (((qh[l] >> bit_hi) & 1) << 4);
            o[l] = d_lo * lo as f32 - min_lo;
            o[l + 32] = d_hi * hi as f32 - min_hi;
        }
    }
}

fn block_q6_k(b: &[u8], out: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = read_f16(b, 208);
    // Two halves of 128 elements; each uses 64 bytes of ql, 32 of qh and 8 scales (one per 16).
    for half in 0..2 {
        let ql = &ql[half * 64..half * 64 + 64];
        let qh = &qh[half * 32..half * 32 + 32];
        let o = &mut out[half * 128..half * 128 + 128];
        for l in 0..32 {
            let quads = [
                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &q) in quads.iter().enumerate() {
                let idx = l + 32 * k;
                let scale = scales[half * 8 + idx / 16] as i8 as f32;
                o[idx] = d * scale * (q as i32 - 32) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn type_ids_round_trip_and_sizes_match_the_spec() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None, "id 4 (old Q4_2) is retired");
        assert_eq!(GgmlType::Q4_K.block_geometry(), (256, 144));
        assert_eq!(GgmlType::Q5_K.block_geometry(), (256, 176));
        assert_eq!(GgmlType::Q6_K.block_geometry(), (256, 210));
        assert_eq!(GgmlType::Q8_0.byte_size(64), Some(68));
        assert_eq!(GgmlType::Q8_0.byte_size(33), None);
        assert_eq!(GgmlType::F32.byte_size(u64::MAX), None);
    }

    #[test]
    fn plain_float_types() {
        let mut bytes = Vec::new();
        for v in [1.5f32, -2.0, 0.0] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(
            dequantize(GgmlType::F32, &bytes, 3).unwrap(),
            [1.5, -2.0, 0.0]
        );
        // f16 0x3C00 = 1.0, 0xC000 = -2.0; bf16 0x3FC0 = 1.5, 0xC040 = -3.0.
        let f16s = [0x00, 0x3C, 0x00, 0xC0];
        assert_eq!(dequantize(GgmlType::F16, &f16s, 2).unwrap(), [1.0, -2.0]);
        let bf16s = [0xC0, 0x3F, 0x40, 0xC0];
        assert_eq!(dequantize(GgmlType::BF16, &bf16s, 2).unwrap(), [1.5, -3.0]);
    }

    #[test]
    fn q4_0_block() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16_bytes(0.5));
        // byte j: low nibble j % 16, high nibble 15 - j.
        for j in 0..16 {
            b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let out = dequantize(GgmlType::Q4_0, &b, 32).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(out[j + 16], (15.0 - j as f32 - 8.0) * 0.5);
        }
    }

    #[test]
    fn q4_1_block() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16_bytes(0.25));
        b[2..4].copy_from_slice(&f16_bytes(-1.0));
        b[4] = 0xF3; // element 0 = 3, element 16 = 15
        b[19] = 0x1A; // element 15 = 10, element 31 = 1
        let out = dequantize(GgmlType::Q4_1, &b, 32).unwrap();
        assert_eq!(out[0], 3.0 * 0.25 - 1.0);
        assert_eq!(out[16], 15.0 * 0.25 - 1.0);
        assert_eq!(out[15], 10.0 * 0.25 - 1.0);
        assert_eq!(out[31], 0.25 - 1.0);
        assert_eq!(out[1], -1.0);
    }

    #[test]
    fn q5_0_and_q5_1_blocks() {
        let mut b = vec![0u8; 22];
        b[0..2].copy_from_slice(&f16_bytes(2.0));
        // Fifth bits set for elements 1 and 17.
        b[2..6].copy_from_slice(&((1u32 << 1) | (1u32 << 17)).to_le_bytes());
        b[6 + 1] = 0x52; // element 1 low nibble 2, element 17 low nibble 5
        let out = dequantize(GgmlType::Q5_0, &b, 32).unwrap();
        assert_eq!(out[1], ((2 + 16) as f32 - 16.0) * 2.0);
        assert_eq!(out[17], ((5 + 16) as f32 - 16.0) * 2.0);
        assert_eq!(out[0], -16.0 * 2.0);

        let mut b = vec![0u8; 24];
        b[0..2].copy_from_slice(&f16_bytes(0.5));
        b[2..4].copy_from_slice(&f16_bytes(3.0));
        b[4..8].copy_from_slice(&(1u32 << 31).to_le_bytes());
        b[8 + 15] = 0x70; // element 31 low nibble 7 (+16 from the fifth bit), element 15 = 0
        let out = dequantize(GgmlType::Q5_1, &b, 32).unwrap();
        assert_eq!(out[31], 23.0 * 0.5 + 3.0);
        assert_eq!(out[15], 3.0);
    }

    #[test]
    fn q8_0_block() {
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&f16_bytes(0.125));
        b[2] = (-128i8) as u8;
        b[3] = 127;
        b[33] = (-1i8) as u8;
        let out = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        assert_eq!(out[0], -16.0);
        assert_eq!(out[1], 127.0 * 0.125);
        assert_eq!(out[31], -0.125);
        assert_eq!(out[2], 0.0);
    }

    /// Packs 8 (scale, min) 6-bit pairs the way `k_scale_min` unpacks them.
    fn pack_k_scales(pairs: [(u8, u8); 8]) -> [u8; 12] {
        let mut p = [0u8; 12];
        for j in 0..4 {
            p[j] = pairs[j].0 | ((pairs[j + 4].0 >> 4) << 6);
            p[j + 4] = pairs[j].1 | ((pairs[j + 4].1 >> 4) << 6);
            p[j + 8] = (pairs[j + 4].0 & 0x0F) | ((pairs[j + 4].1 & 0x0F) << 4);
        }
        p
    }

    const PAIRS: [(u8, u8); 8] = [
        (1, 2),
        (3, 4),
        (63, 0),
        (10, 20),
        (17, 33),
        (48, 5),
        (63, 63),
        (0, 49),
    ];

    #[test]
    fn k_scale_packing_round_trips() {
        assert_eq!(k_scale_min(&pack_k_scales(PAIRS)), PAIRS);
    }

    #[test]
    fn q4_k_block() {
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&f16_bytes(0.5));
        b[2..4].copy_from_slice(&f16_bytes(0.25));
        b[4..16].copy_from_slice(&pack_k_scales(PAIRS));
        // chunk 2 (elements 128..192): byte 64 + 5 -> element 133 (sub-block 4) low nibble 9,
        // element 165 (sub-block 5) high nibble 14.
        b[16 + 64 + 5] = 0xE9;
        let out = dequantize(GgmlType::Q4_K, &b, 256).unwrap();
        assert_eq!(out[133], 0.5 * 17.0 * 9.0 - 0.25 * 33.0);
        assert_eq!(out[165], 0.5 * 48.0 * 14.0 - 0.25 * 5.0);
        // An all-zero nibble yields -dmin * min of its sub-block.
        assert_eq!(out[0], -0.25 * 2.0);
        assert_eq!(out[255], -0.25 * 49.0);
        assert_eq!(out[200], -0.25 * 63.0);
    }

    #[test]
    fn q5_k_block() {
        let mut b = vec![0u8; 176];
        b[0..2].copy_from_slice(&f16_bytes(1.0));
        b[2..4].copy_from_slice(&f16_bytes(0.5));
        b[4..16].copy_from_slice(&pack_k_scales(PAIRS));
        // Element 7 + 32*s takes bit s of qh[7]: set bits 1 (sub-block 1) and 6 (sub-block 6).
        b[16 + 7] = (1 << 1) | (1 << 6);
        // chunk 0 byte 7: element 7 low nibble 4, element 39 high nibble 2.
        b[48 + 7] = 0x24;
        // chunk 3 byte 7: element 199 (sub-block 6) low nibble 1.
        b[48 + 96 + 7] = 0x01;
        let out = dequantize(GgmlType::Q5_K, &b, 256).unwrap();
        assert_eq!(out[7], 1.0 * 4.0 - 0.5 * 2.0);
        assert_eq!(out[39], 3.0 * (2.0 + 16.0) - 0.5 * 4.0);
        assert_eq!(out[199], 63.0 * (1.0 + 16.0) - 0.5 * 63.0);
        assert_eq!(out[231], -0.5 * 49.0);
    }

    #[test]
    fn q6_k_block() {
        let mut b = vec![0u8; 210];
        for (i, s) in b[192..208].iter_mut().enumerate() {
            *s = (i as i8 - 8) as u8; // scales -8..8, one per 16 elements
        }
        b[208..210].copy_from_slice(&f16_bytes(0.5));
        // second half, l = 3: ql[64+3] low nibble -> element 131, high nibble -> element 195;
        // ql[64+35] low -> element 163, high -> element 227; qh[32+3] two bits each.
        b[64 + 3] = 0xA5;
        b[64 + 35] = 0x3C;
        b[128 + 32 + 3] = 0b11_10_01_00;
        let out = dequantize(GgmlType::Q6_K, &b, 256).unwrap();
        let value = |idx: usize, q: i32| 0.5 * ((idx / 16) as f32 - 8.0) * (q - 32) as f32;
        assert_eq!(out[131], value(131, 0x5));
        assert_eq!(out[163], value(163, 0xC | (1 << 4)));
        assert_eq!(out[195], value(195, 0xA | (2 << 4)));
        assert_eq!(out[227], value(227, 0x3 | (3 << 4)));
        assert_eq!(out[0], value(0, 0));
        assert_eq!(out[0], 0.5 * -8.0 * -32.0);
    }

    #[test]
    fn unsupported_type_and_bad_length_are_errors() {
        let err = dequantize(GgmlType::IQ2_XXS, &[0u8; 66], 256).unwrap_err();
        assert!(matches!(err, CpuError::Unsupported(ref m) if m.contains("IQ2_XXS")));
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], 32).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], 31).is_err());
    }
}
