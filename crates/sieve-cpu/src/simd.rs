//! Which SIMD instruction set the fast products use, chosen once per process.
//!
//! The kernels of the packed formats ([`crate::tiled_cbc`], [`crate::balanced_cbc`],
//! [`crate::ie_bme`], [`crate::gguf_blocks`]) come in three versions: AVX-512 (F + BW + VL, for
//! `vexpandps` and masked loads; with VBMI2, `vpexpandw`), AVX2 (+ FMA, F16C, BMI2) and a
//! portable one. [`SimdLevel::detect`] picks the best the CPU supports;
//! `SIEVE_CPU_SIMD=avx512|avx2|portable` ([`crate::options`]) caps it (to compare the paths on
//! one machine, or to rule a path out when debugging). A level above what the CPU supports is
//! never used, whatever the variable says.

use crate::options::CpuKernelOptions;
use std::sync::OnceLock;

/// An instruction-set level of the fast products, ordered from the least to the most capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    Portable,
    Avx2,
    Avx512,
    /// AVX-512 with VBMI2: `vpexpandw` places 32 f16 values per instruction.
    Avx512Vbmi2,
}

impl SimdLevel {
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Portable => "portable",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Avx512Vbmi2 => "avx512-vbmi2",
        }
    }

    /// Whether this CPU can run the kernels of `self`.
    /// This level if this CPU can run it, else the portable kernel.
    pub fn or_portable(self) -> SimdLevel {
        if self.supported() {
            self
        } else {
            SimdLevel::Portable
        }
    }

    pub fn supported(self) -> bool {
        match self {
            SimdLevel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("bmi2")
                    && std::arch::is_x86_feature_detected!("popcnt")
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => {
                SimdLevel::Avx2.supported()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vbmi2 => {
                SimdLevel::Avx512.supported() && std::arch::is_x86_feature_detected!("avx512vbmi2")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every level this CPU supports (for tests that check each path against the reference).
    pub fn available() -> Vec<SimdLevel> {
        [
            SimdLevel::Portable,
            SimdLevel::Avx2,
            SimdLevel::Avx512,
            SimdLevel::Avx512Vbmi2,
        ]
        .into_iter()
        .filter(|l| l.supported())
        .collect()
    }

    /// The level the products use: the best supported one, capped by `SIEVE_CPU_SIMD`
    /// ([`CpuKernelOptions::simd_cap`]).
    pub fn detect() -> SimdLevel {
        static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
        *LEVEL.get_or_init(|| {
            let best = Self::available()
                .into_iter()
                .max()
                .unwrap_or(SimdLevel::Portable);
            best.min(CpuKernelOptions::global().simd_cap)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detected_level_is_supported() {
        assert!(SimdLevel::detect().supported());
        assert!(SimdLevel::available().contains(&SimdLevel::Portable));
        assert!(SimdLevel::available().iter().all(|l| l.supported()));
    }
}
