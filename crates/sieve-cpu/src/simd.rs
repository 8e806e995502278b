//! Which SIMD instruction set the fast products use, chosen once per process: the one place
//! that asks the CPU what it supports.
//!
//! Every kernel of this crate comes in up to three versions: AVX-512 (F + BW + VL, for
//! `vexpandps` and masked loads; with VBMI2, `vpexpandw`), AVX2 (+ FMA, F16C, BMI2, POPCNT) and
//! a portable one. [`SimdLevel::detect`] picks the best the CPU supports;
//! `SIEVE_CPU_SIMD=avx512|avx2|portable` ([`crate::options`]) caps it (to compare the paths on
//! one machine, or to rule a path out when debugging). A level above what the CPU supports is
//! never used, whatever the variable says.
//!
//! Kernels ask the level, never the CPU: the shared vector kernels ([`crate::kernels`], the
//! [`crate::gemm`] micro-kernel, [`crate::attention`], [`crate::gguf_blocks`]) take their SIMD
//! paths when `SimdLevel::detect()` is at or above the level those need, the format kernels
//! match on the level, and the extensions some AVX-512 kernels add (VNNI, VBMI) are asked of
//! the level too ([`SimdLevel::vnni`], [`SimdLevel::vbmi`]). The CPU's answers are read once
//! ([`CpuFeatures::get`]); no other module calls `is_x86_feature_detected!`.
//!
//! Safety of the `#[target_feature]` calls rests on one invariant: a level the dispatch acts on
//! is supported by this CPU ([`SimdLevel::detect`] and [`SimdLevel::available`] return only
//! such levels, [`SimdLevel::best`] caps any other), and a supported level includes the
//! features of every lower one, so `level >= L` means the CPU has everything `L` names.

use crate::options::CpuKernelOptions;
use std::sync::OnceLock;

/// The x86 extensions the kernels use, as this CPU reports them (all false elsewhere).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub bmi2: bool,
    pub popcnt: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512vbmi: bool,
    pub avx512vbmi2: bool,
    pub avx512vnni: bool,
}

impl CpuFeatures {
    /// The CPU's features, read on first use and kept for the process.
    pub fn get() -> &'static CpuFeatures {
        static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
        FEATURES.get_or_init(Self::read)
    }

    #[cfg(target_arch = "x86_64")]
    fn read() -> CpuFeatures {
        use std::arch::is_x86_feature_detected as has;
        CpuFeatures {
            avx2: has!("avx2"),
            fma: has!("fma"),
            f16c: has!("f16c"),
            bmi2: has!("bmi2"),
            popcnt: has!("popcnt"),
            avx512f: has!("avx512f"),
            avx512bw: has!("avx512bw"),
            avx512vl: has!("avx512vl"),
            avx512vbmi: has!("avx512vbmi"),
            avx512vbmi2: has!("avx512vbmi2"),
            avx512vnni: has!("avx512vnni"),
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn read() -> CpuFeatures {
        CpuFeatures::default()
    }
}

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
    /// Every level, from the least to the most capable.
    pub const ALL: [SimdLevel; 4] = [
        SimdLevel::Portable,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
        SimdLevel::Avx512Vbmi2,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Portable => "portable",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Avx512Vbmi2 => "avx512-vbmi2",
        }
    }

    /// This level if this CPU can run it, else the portable kernel.
    pub fn or_portable(self) -> SimdLevel {
        if self.supported() {
            self
        } else {
            SimdLevel::Portable
        }
    }

    /// Whether this CPU can run the kernels of `self` (and so, of every lower level).
    pub fn supported(self) -> bool {
        let f = CpuFeatures::get();
        match self {
            SimdLevel::Portable => true,
            SimdLevel::Avx2 => f.avx2 && f.fma && f.f16c && f.bmi2 && f.popcnt,
            SimdLevel::Avx512 => {
                SimdLevel::Avx2.supported() && f.avx512f && f.avx512bw && f.avx512vl
            }
            SimdLevel::Avx512Vbmi2 => SimdLevel::Avx512.supported() && f.avx512vbmi2,
        }
    }

    /// Whether the kernels of `self` may use AVX-512 VNNI (`vpdpbusd`): `self` is an AVX-512
    /// level this CPU supports, and the CPU has VNNI.
    pub fn vnni(self) -> bool {
        self >= SimdLevel::Avx512 && self.supported() && CpuFeatures::get().avx512vnni
    }

    /// Whether the kernels of `self` may use AVX-512 VBMI (`vpermb`): `self` is an AVX-512
    /// level this CPU supports, and the CPU has VBMI.
    pub fn vbmi(self) -> bool {
        self >= SimdLevel::Avx512 && self.supported() && CpuFeatures::get().avx512vbmi
    }

    /// Every level this CPU supports (for tests that check each path against the reference).
    pub fn available() -> Vec<SimdLevel> {
        Self::ALL.into_iter().filter(|l| l.supported()).collect()
    }

    /// The best level this CPU supports, whatever `SIEVE_CPU_SIMD` says (`level.min(best())`
    /// is a level the CPU runs).
    pub fn best() -> SimdLevel {
        Self::ALL
            .into_iter()
            .rev()
            .find(|l| l.supported())
            .unwrap_or(SimdLevel::Portable)
    }

    /// The level the products use, chosen once per process: the best supported one, capped by
    /// `SIEVE_CPU_SIMD` ([`CpuKernelOptions::simd_cap`]).
    pub fn detect() -> SimdLevel {
        static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
        *LEVEL.get_or_init(|| Self::best().min(CpuKernelOptions::global().simd_cap))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detected_level_is_supported() {
        assert!(SimdLevel::detect().supported());
        assert!(SimdLevel::detect() <= SimdLevel::best());
        assert!(SimdLevel::available().contains(&SimdLevel::Portable));
        assert!(SimdLevel::available().iter().all(|l| l.supported()));
        assert_eq!(SimdLevel::available().last(), Some(&SimdLevel::best()));
    }

    /// A supported level implies every lower one (what `level >= L` guards rely on), and the
    /// extensions are never granted below AVX-512 or above what the CPU runs.
    #[test]
    fn levels_nest_and_extensions_follow_the_level() {
        for (i, l) in SimdLevel::ALL.iter().enumerate() {
            if l.supported() {
                assert!(SimdLevel::ALL[..i].iter().all(|lower| lower.supported()));
            }
            if l.vnni() || l.vbmi() {
                assert!(*l >= SimdLevel::Avx512 && l.supported());
            }
        }
        assert!(!SimdLevel::Portable.vnni() && !SimdLevel::Avx2.vbmi());
    }
}
