//! The kernel switches of the CPU backend, in one place.
//!
//! Each switch picks between kernels that compute the same product (to compare them on one
//! machine, or to rule one out when debugging); none changes what a layer means. The program
//! sets them from the top: the CLI's `--cpu-kernel KEY=VALUE` ([`CpuKernelOptions::with_switch`],
//! then [`CpuKernelOptions::install`] before any product is built); a variable of the
//! environment gives a switch no flag sets. They are fixed **once** for the process
//! ([`CpuKernelOptions::global`]) and passed down from here: no kernel reads the environment.
//!
//! | `--cpu-kernel` key | variable | field | values |
//! |---|---|---|---|
//! | `simd` | `SIEVE_CPU_SIMD` | [`CpuKernelOptions::simd_cap`] | `avx512`, `avx2`, `portable` cap the SIMD level ([`crate::simd`]); default `best`: the best the CPU has |
//! | `tiled-cbc` | `SIEVE_TCBC_CPU` | [`CpuKernelOptions::tiled_cbc`] | `columns`: the whole-column Tiled-CBC layout; default `rows`: the row-blocked one |
//! | `balanced-cbc` | `SIEVE_BCBC_CPU` | [`CpuKernelOptions::balanced_cbc`] | `f16`, `split` (f16 records, split arrangement), `int4-quads`; default `auto`: integer records when the grids allow |
//! | `ie-bme` | `SIEVE_IEBME_KERNEL` | [`CpuKernelOptions::ie_bme`] | `columns`: the f16 column kernel for IE-BME INT4 too; default `int4`: the integer kernel |
//!
//! (An unknown value of a variable means the default; an unknown key or value of the flag is an
//! error naming the choices.)

use crate::simd::SimdLevel;
use std::sync::OnceLock;

/// Which CPU layout a Tiled-CBC blob is built into ([`crate::tiled_cbc`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TiledCbcLayout {
    /// Blocks of 32 rows ([`crate::tiled_cbc::RowTiledCbc`]).
    #[default]
    Rows,
    /// Whole columns ([`crate::tiled_cbc::ColumnTiledCbc`]).
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
    /// The f16 column kernel over the dequantized matrix ([`crate::ie_bme::F16IeBme`]).
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
    /// The switches as the environment sets them (module notes), through the same value table
    /// as the flag ([`CpuKernelOptions::with_switch`]); an unknown value means the default.
    pub fn from_env() -> Self {
        const VARIABLES: [(&str, &str); 4] = [
            ("SIEVE_CPU_SIMD", "simd"),
            ("SIEVE_TCBC_CPU", "tiled-cbc"),
            ("SIEVE_BCBC_CPU", "balanced-cbc"),
            ("SIEVE_IEBME_KERNEL", "ie-bme"),
        ];
        VARIABLES.iter().fold(
            Self::default(),
            |options, (variable, key)| match std::env::var(variable) {
                Ok(value) => options.with_switch(key, &value).unwrap_or(options),
                Err(_) => options,
            },
        )
    }

    /// These options with one switch set from its flag form, `key` and `value` as in the module
    /// table (`simd=avx2`, `tiled-cbc=columns`, ...); an unknown key or value is an error that
    /// names the choices.
    pub fn with_switch(mut self, key: &str, value: &str) -> Result<Self, String> {
        let unknown =
            |choices: &str| format!("--cpu-kernel {key}={value}: {key} is one of {choices}");
        match key {
            "simd" => {
                self.simd_cap = match value {
                    "best" => SimdLevel::Avx512Vbmi2,
                    "avx512" => SimdLevel::Avx512,
                    "avx2" => SimdLevel::Avx2,
                    "portable" => SimdLevel::Portable,
                    _ => return Err(unknown("best, avx512, avx2, portable")),
                }
            }
            "tiled-cbc" => {
                self.tiled_cbc = match value {
                    "rows" => TiledCbcLayout::Rows,
                    "columns" => TiledCbcLayout::Columns,
                    _ => return Err(unknown("rows, columns")),
                }
            }
            "balanced-cbc" => {
                self.balanced_cbc = match value {
                    "auto" => BalancedCbcRecords::Auto,
                    "f16" => BalancedCbcRecords::F16,
                    "split" => BalancedCbcRecords::Split,
                    "int4-quads" => BalancedCbcRecords::Int4Quads,
                    _ => return Err(unknown("auto, f16, split, int4-quads")),
                }
            }
            "ie-bme" => {
                self.ie_bme = match value {
                    "int4" => IeBmeKernel::Int4,
                    "columns" => IeBmeKernel::Columns,
                    _ => return Err(unknown("int4, columns")),
                }
            }
            _ => {
                return Err(format!(
                    "--cpu-kernel {key}={value}: the keys are simd, tiled-cbc, balanced-cbc, ie-bme"
                ))
            }
        }
        Ok(self)
    }

    /// Fixes the process's options (what [`CpuKernelOptions::global`] returns from now on).
    /// Called by the program before any product is built; fails, returning the options, if
    /// they were already fixed (read once by a kernel, or installed before).
    pub fn install(options: CpuKernelOptions) -> Result<(), CpuKernelOptions> {
        OPTIONS.set(options)
    }

    /// The options [`CpuKernelOptions::install`] fixed, or else [`CpuKernelOptions::from_env`],
    /// read on first use and kept for the process: what the constructors without an options
    /// argument use.
    pub fn global() -> &'static CpuKernelOptions {
        OPTIONS.get_or_init(Self::from_env)
    }
}

static OPTIONS: OnceLock<CpuKernelOptions> = OnceLock::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_parse_and_unknown_ones_name_the_choices() {
        let base = CpuKernelOptions::default();
        let o = base
            .with_switch("simd", "avx2")
            .and_then(|o| o.with_switch("tiled-cbc", "columns"))
            .and_then(|o| o.with_switch("balanced-cbc", "int4-quads"))
            .and_then(|o| o.with_switch("ie-bme", "columns"))
            .unwrap();
        assert_eq!(o.simd_cap, SimdLevel::Avx2);
        assert_eq!(o.tiled_cbc, TiledCbcLayout::Columns);
        assert_eq!(o.balanced_cbc, BalancedCbcRecords::Int4Quads);
        assert_eq!(o.ie_bme, IeBmeKernel::Columns);
        // The defaults by name.
        let d = o
            .with_switch("simd", "best")
            .and_then(|o| o.with_switch("tiled-cbc", "rows"))
            .and_then(|o| o.with_switch("balanced-cbc", "auto"))
            .and_then(|o| o.with_switch("ie-bme", "int4"))
            .unwrap();
        assert_eq!(d, base);
        let e = base.with_switch("simd", "sse2").unwrap_err();
        assert!(
            e.contains("simd is one of best, avx512, avx2, portable"),
            "{e}"
        );
        let e = base.with_switch("tcbc", "columns").unwrap_err();
        assert!(
            e.contains("the keys are simd, tiled-cbc, balanced-cbc, ie-bme"),
            "{e}"
        );
    }
}
