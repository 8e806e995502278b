//! Table 1 of Celty: the area the sparse SIMT core adds to a GPU, per generation.
//!
//! The paper scales one decoder's area "by the number of SIMT cores per chip" (one decoder per
//! SM sub-partition; register-file accumulation reuses the existing register file and adds only
//! the address path). The decoder is counted here from its description (section 4, Figure 7):
//! 8 run-lengths in, 3 pipeline stages, a modified parallel-prefix adder tree with the seventh
//! output back-calculated by a subtractor, and the decoded offsets added to a broadcast base
//! pointer. Its gate equivalents times one reference-node NAND2 area give its silicon area;
//! times the SIMT cores over the die area, the overhead.
//!
//! Of Table 1 only Hopper's entry (0.009%, "at most") is in the text this project has; it is
//! the test. The constants are textbook values, stated below; the result moves with them (a
//! different utilization or gate count scales it linearly), so the test pins the table's
//! precision, not more: registering 14-bit addresses instead of 8-bit offsets after stage 3,
//! for instance, gives 0.0097% (0.010%).

use serde::Serialize;

/// The decoder as described in the paper, parametrised by its widths.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct DecoderDesign {
    /// Run-lengths ingested per cycle.
    pub width: u32,
    /// Bits per run (RLC n).
    pub index_bits: u32,
    /// Bits of a register-file address (a sub-partition's 16K registers: 14 bits).
    pub address_bits: u32,
}

impl DecoderDesign {
    pub fn celty() -> Self {
        Self {
            width: 8,
            index_bits: 4,
            address_bits: 14,
        }
    }

    /// Adder bits: (adders, bits each) of the prefix tree, the back-calculating subtractor, the
    /// base-pointer adders and the running base.
    pub fn adders(&self) -> Vec<(u32, u32)> {
        let c = self.index_bits + 1; // run + 1
        let w = self.width;
        // Stage 1: pairwise sums x0+x1, x2+x3, ... (w/2 adders, c+1 bits).
        // Stage 2: y2 = s01 + x2, y3 = s01 + s23, s47 = s45 + s67 (3 adders, c+2 bits).
        // Stage 3: y4 = y3 + x4, y5 = y3 + s45, y7 = y3 + s47 (3 adders) and the subtractor
        // y6 = y7 - x7 (1), c+3 bits.
        let log_w = 32 - (w.max(2) - 1).leading_zeros(); // 3 for 8
        vec![
            (w / 2, c + 1),
            (3, c + 2),
            (4, c + log_w),
            // Offsets + broadcast base pointer, and base += y7 for the next group.
            (w + 1, self.address_bits),
        ]
    }

    /// Flip-flop bits of the three pipeline registers and the base register.
    pub fn register_bits(&self) -> u32 {
        let c = self.index_bits + 1;
        let w = self.width;
        // After stage 1: w/2 pair sums (c+1) and the buffered x0, x2, x4, x6, x7 (c each).
        let s1 = w / 2 * (c + 1) + 5 * c;
        // After stage 2: y0 (c), y1 (c+1), y2, y3, s47 (c+2), s45 (c+1), x4, x7 (c).
        let s2 = c + (c + 1) + 3 * (c + 2) + (c + 1) + 2 * c;
        // After stage 3: the w decoded offsets (c + log2 w bits); the base-pointer add that
        // follows is in the register-address path.
        let log_w = 32 - (w.max(2) - 1).leading_zeros();
        let s3 = w * (c + log_w);
        s1 + s2 + s3 + self.address_bits
    }

    /// 2:1 multiplexer bits selecting the decoded address over the instruction's register
    /// operand (dense/sparse mode).
    pub fn mux_bits(&self) -> u32 {
        self.width * self.address_bits
    }

    /// NAND2 gate equivalents: full adder 6 GE per bit, D flip-flop 5 GE per bit, 2:1 mux 2 GE
    /// per bit (common standard-cell ratios).
    pub fn gate_equivalents(&self) -> f64 {
        let adder_bits: u32 = self.adders().iter().map(|(n, b)| n * b).sum();
        6.0 * adder_bits as f64 + 5.0 * self.register_bits() as f64 + 2.0 * self.mux_bits() as f64
    }

    /// Area of one decoder in µm² at `nand2_um2` per gate equivalent and placement
    /// `utilization`.
    pub fn area_um2(&self, nand2_um2: f64, utilization: f64) -> f64 {
        self.gate_equivalents() * nand2_um2 / utilization
    }
}

/// NAND2 area of the reference node: TSMC N7's 91.2 MTr/mm² logic density at 4 transistors per
/// NAND2 (4 / 91.2e6 mm² = 0.0439 µm²).
pub const NAND2_UM2_N7: f64 = 4.0 / 91.2e6 * 1e6;
/// Standard-cell placement utilization.
pub const UTILIZATION: f64 = 0.75;

/// One GPU generation of Table 1.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Generation {
    pub name: &'static str,
    pub chip: &'static str,
    pub sms: u32,
    pub die_mm2: f64,
}

/// The datacenter generations (enabled SMs of the shipping part, die area of the chip).
pub const GENERATIONS: [Generation; 3] = [
    Generation {
        name: "Volta",
        chip: "GV100 (V100)",
        sms: 80,
        die_mm2: 815.0,
    },
    Generation {
        name: "Ampere",
        chip: "GA100 (A100)",
        sms: 108,
        die_mm2: 826.0,
    },
    Generation {
        name: "Hopper",
        chip: "GH100 (H100 SXM / H200)",
        sms: 132,
        die_mm2: 814.0,
    },
];

/// Table 1's only entry in the text: Hopper, 0.009%.
pub const PAPER_HOPPER_PERCENT: f64 = 0.009;

/// Overhead of the sparse SIMT core on `gen`, percent of the die:
/// `4 SIMT cores per SM x SMs x decoder area / die area`.
pub fn overhead_percent(gen: &Generation, design: &DecoderDesign) -> f64 {
    let cores = 4.0 * gen.sms as f64;
    let area_mm2 = design.area_um2(NAND2_UM2_N7, UTILIZATION) * 1e-6;
    100.0 * cores * area_mm2 / gen.die_mm2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoder_counts_match_the_paper_structure() {
        let d = DecoderDesign::celty();
        let adders: u32 = d.adders().iter().map(|(n, _)| n).sum();
        // 4 + 3 + 3 adders and one subtractor in the tree, 9 address adders.
        assert_eq!(adders, 4 + 3 + 4 + 9);
        assert_eq!(d.adders()[2].1, 8); // outputs up to 8 x 16 = 128 need 8 bits
        assert_eq!(
            d.register_bits(),
            (4 * 6 + 5 * 5) + (5 + 6 + 3 * 7 + 6 + 10) + 8 * 8 + 14
        );
    }

    #[test]
    fn table1_hopper_entry_and_ordering() {
        let d = DecoderDesign::celty();
        let hopper = overhead_percent(&GENERATIONS[2], &d);
        // The table gives 0.009% (three decimals).
        assert_eq!(
            (hopper * 1000.0).round() / 1000.0,
            PAPER_HOPPER_PERCENT,
            "Hopper overhead {hopper}%"
        );
        // "reaching at most 0.009% on Hopper": every other generation is below.
        for g in &GENERATIONS[..2] {
            assert!(overhead_percent(g, &d) < hopper, "{}", g.name);
        }
    }
}
