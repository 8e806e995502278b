//! The CPU backend: the SIMD products of every weight format, one module per format under the
//! format's own name, and the kernels they share. Each format's CPU type keeps the kind,
//! storage and blob of the `sieve_formats` matrix it was built from; only the in-memory layout
//! differs (built at load, [`format_from_blob`]).
//!
//! | module | job |
//! |---|---|
//! | [`options`] | the kernel switches (`SIEVE_CPU_SIMD`, `SIEVE_TCBC_CPU`, `SIEVE_BCBC_CPU`, `SIEVE_IEBME_KERNEL`), read once |
//! | [`simd`] | the SIMD level every kernel uses, chosen once per process; the only place that asks the CPU |
//! | [`kernels`] | f16/f32 dot products, conversions, softmax and SwiGLU (AVX2/FMA/F16C and portable) |
//! | [`gemm`] | the cache-blocked f32 GEMM of the batched paths (prefill, calibration) |
//! | [`attention`] | decode-time grouped-query attention over an f16 KV cache (AVX-512, AVX2, portable) |
//! | [`dense`] | dense f16 rows (`FastDense`) and the column-major dense layout |
//! | [`tiled_cbc`] | Tiled-CBC: the row-blocked layout (default) and the whole-column one |
//! | [`balanced_cbc`] | Balanced-CBC: row groups of 16 with f16, 8-bit or 4-bit records |
//! | [`ie_bme`] | IE-BME: INT4 integer products, the dequantized column fallback |
//! | [`gguf_blocks`] | GGUF quantized blocks multiplied in place (Q4_0 ... Q6_K), their dequantization |
//! | [`error`] | `CpuError` |

pub mod attention;
pub mod balanced_cbc;
pub mod dense;
pub mod error;
pub mod gemm;
pub mod gguf_blocks;
pub mod ie_bme;
pub mod kernels;
pub mod options;
pub mod simd;
#[cfg(test)]
mod test_support;
pub mod tiled_cbc;

pub use error::{CpuError, Result};
pub use options::CpuKernelOptions;

use options::{IeBmeKernel, TiledCbcLayout};
use sieve_formats::balanced_cbc::BalancedCbc;
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::{FormatError, FormatKind, WeightFormat};

/// IE-BME INT4 gets the integer kernel ([`ie_bme::Int4IeBme`]); other payloads, or every IE-BME
/// layer when `SIEVE_IEBME_KERNEL=columns` (to compare the two paths), the f16 column kernel
/// over the dequantized matrix ([`ie_bme::F16IeBme`]).
fn ie_bme_layer(
    ie: sieve_formats::ie_bme::IeBme,
    options: &CpuKernelOptions,
) -> std::result::Result<Box<dyn WeightFormat>, FormatError> {
    let columns = options.ie_bme == IeBmeKernel::Columns;
    if !columns && matches!(ie.payload(), sieve_formats::ie_bme::Payload::Int4 { .. }) {
        return Ok(Box::new(ie_bme::Int4IeBme::new(ie)?));
    }
    Ok(Box::new(ie_bme::F16IeBme::new(ie)?))
}

/// Tiled-CBC gets the row-blocked bitmap layout ([`tiled_cbc::RowTiledCbc`]: blocks of 32 rows,
/// each one sequential stream, inactive inputs' columns not visited inside it);
/// `SIEVE_TCBC_CPU=columns` the whole-column layout ([`tiled_cbc::ColumnTiledCbc`], which skips
/// inactive inputs' columns over the whole matrix but breaks the prefetchers' streams), to
/// compare the two (docs/BENCHMARKS.md, issue 12).
fn tiled_cbc_layer(tiled: TiledCbc, options: &CpuKernelOptions) -> Box<dyn WeightFormat> {
    if options.tiled_cbc == TiledCbcLayout::Columns {
        Box::new(tiled_cbc::ColumnTiledCbc::new(tiled))
    } else {
        Box::new(tiled_cbc::RowTiledCbc::new(&tiled))
    }
}

/// A weight blob (`WeightFormat::to_bytes`) read into the format whose CPU product a loaded
/// pack runs, under the process's switches ([`CpuKernelOptions::global`]): what
/// `sieve pack --format auto` times for each candidate.
pub fn format_from_blob(bytes: &[u8]) -> std::result::Result<Box<dyn WeightFormat>, FormatError> {
    format_from_blob_with(bytes, CpuKernelOptions::global())
}

/// [`format_from_blob`] under the given switches: dense layers get [`dense::FastDense`],
/// Tiled-CBC [`tiled_cbc::RowTiledCbc`] (see [`tiled_cbc_layer`]), Balanced-CBC
/// [`balanced_cbc::FastBalancedCbc`] (row groups of 16, fixed-size records), IE-BME INT4
/// [`ie_bme::Int4IeBme`] (integer products against 8-bit activations, see [`ie_bme_layer`]);
/// other formats keep their reference kernels.
pub fn format_from_blob_with(
    bytes: &[u8],
    options: &CpuKernelOptions,
) -> std::result::Result<Box<dyn WeightFormat>, FormatError> {
    let (tag, payload) = sieve_formats::blob::unframe(bytes)?;
    let mut r = sieve_formats::blob::ByteReader::new(payload);
    Ok(match FormatKind::from_tag(tag) {
        Ok(FormatKind::TiledCbc) => {
            let tiled = TiledCbc::read_payload(&mut r)?;
            r.finish()?;
            tiled_cbc_layer(tiled, options)
        }
        Ok(FormatKind::BalancedCbc) => {
            let balanced = BalancedCbc::read_payload(&mut r)?;
            r.finish()?;
            Box::new(balanced_cbc::FastBalancedCbc::with_options(
                &balanced, options,
            ))
        }
        Ok(FormatKind::IeBme) => {
            let ie = sieve_formats::ie_bme::IeBme::read_payload(&mut r)?;
            r.finish()?;
            ie_bme_layer(ie, options)?
        }
        _ => {
            let format = sieve_formats::registry::from_bytes(bytes)?;
            match format.kind() {
                FormatKind::Dense => Box::new(dense::FastDense::new(format.decode())),
                _ => format,
            }
        }
    })
}
