//! The kernel switches of the CPU backend, in one place.
//!
//! Each switch picks between kernels that compute the same product (to compare them on one
//! machine, or to rule one out when debugging); none changes what a layer means. They are read
//! from the environment **once** ([`CpuKernelOptions::global`]) and passed down from here: no
//! kernel reads the environment itself.
//!
//! | variable | field | values |
//! |---|---|---|
//! | `SIEVE_CPU_SIMD` | [`CpuKernelOptions::simd_cap`] | `avx512`, `avx2`, `portable` cap the SIMD level ([`crate::simd`]); unset: the best the CPU has |
//! | `SIEVE_TCBC_CPU` | [`CpuKernelOptions::tiled_cbc`] | `columns`: the whole-column Tiled-CBC layout; unset: the row-blocked one |
//! | `SIEVE_BCBC_CPU` | [`CpuKernelOptions::balanced_cbc`] | `f16`, `split` (f16 records, split arrangement), `int4-quads`; unset: integer records when the grids allow |
//! | `SIEVE_IEBME_KERNEL` | [`CpuKernelOptions::ie_bme`] | `columns`: the f16 column kernel for IE-BME INT4 too; unset: the integer kernel |

use crate::simd::SimdLevel;
use std::sync::OnceLock;

/// Which CPU layout a Tiled-CBC blob is built into ([`crate::tiled_cbc`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TiledCbcLayout {
    /// Blocks of 32 rows ([`crate::tiled_cbc::RowTiledCbc`]).
    #[default]
    Rows,
    /// Whole columns ([`crate::tiled_cbc::FastTiledCbc`]).
    Columns,
}

/// Which records a Balanced-CBC matrix is built into ([`crate::balanced_cbc`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BalancedCbcRecords {
    /// 4-bit or 8-bit records when every row lies on integer grids, else interleaved f16.
    #[default]
    Auto,
    /// f16 records, interleaved.
    F16,
    /// f16 records in the split arrangement.
    Split,
    /// As [`BalancedCbcRecords::Auto`], with 4-bit records in quads of columns where the CPU
    /// runs their kernel.
    Int4Quads,
}

/// Which kernel an IE-BME INT4 matrix runs ([`crate::ie_bme`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IeBmeKernel {
    /// Integer products against 8-bit activations ([`crate::ie_bme::Int4IeBme`]).
    #[default]
    Int4,
    /// The f16 column kernel over the dequantized matrix ([`crate::ie_bme::DequantizedIeBme`]).
    Columns,
}

/// The kernel switches of the CPU backend (module notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuKernelOptions {
    /// The highest SIMD level the products may use (never above what the CPU supports).
    pub simd_cap: SimdLevel,
    pub tiled_cbc: TiledCbcLayout,
    pub balanced_cbc: BalancedCbcRecords,
    pub ie_bme: IeBmeKernel,
}

impl Default for CpuKernelOptions {
    fn default() -> Self {
        Self {
            simd_cap: SimdLevel::Avx512Vbmi2,
            tiled_cbc: TiledCbcLayout::default(),
            balanced_cbc: BalancedCbcRecords::default(),
            ie_bme: IeBmeKernel::default(),
        }
    }
}

impl CpuKernelOptions {
    /// The switches as the environment sets them (module notes); unknown values mean the default.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        Self {
            simd_cap: match var("SIEVE_CPU_SIMD").as_deref() {
                Some("portable") => SimdLevel::Portable,
                Some("avx2") => SimdLevel::Avx2,
                Some("avx512") => SimdLevel::Avx512,
                _ => SimdLevel::Avx512Vbmi2,
            },
            tiled_cbc: match var("SIEVE_TCBC_CPU").as_deref() {
                Some("columns") => TiledCbcLayout::Columns,
                _ => TiledCbcLayout::Rows,
            },
            balanced_cbc: match var("SIEVE_BCBC_CPU").as_deref() {
                Some("f16") => BalancedCbcRecords::F16,
                Some("split") => BalancedCbcRecords::Split,
                Some("int4-quads") => BalancedCbcRecords::Int4Quads,
                _ => BalancedCbcRecords::Auto,
            },
            ie_bme: match var("SIEVE_IEBME_KERNEL").as_deref() {
                Some("columns") => IeBmeKernel::Columns,
                _ => IeBmeKernel::Int4,
            },
        }
    }

    /// [`CpuKernelOptions::from_env`], read on first use and kept for the process: what the
    /// constructors without an options argument use.
    pub fn global() -> &'static CpuKernelOptions {
        static OPTIONS: OnceLock<CpuKernelOptions> = OnceLock::new();
        OPTIONS.get_or_init(Self::from_env)
    }
}
