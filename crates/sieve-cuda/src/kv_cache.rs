//! One layer's KV cache as the RoPE and attention kernels address it: f16 rows, or i8 rows with
//! one f32 scale per (position, KV head) (the row rule of [`sieve_formats::kv_cache`]).
//!
//! ```text
//!   F16:   k, v         f16 [position][Hkv][hd]
//!   Int8:  k, v         i8  [position][Hkv][hd]
//!          k_scales,    f32 [position][Hkv]      (row (p, h) of k reads back as k[p][h][..] * k_scales[p][h])
//!          v_scales
//! ```
//!
//! The scales run parallel to the values, one per `hd` of them, so an offset into the cache
//! (a layer, a slot) counted in values moves the scales by that count over `hd`
//! ([`KvCache::advanced`]).

use crate::error::{CudaError, Result};
use crate::product::DevPtr;
pub use sieve_formats::kv_cache::KvPrecision;

/// Device addresses of one layer's (of one slot's) K and V caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCache {
    /// f16 `[position][Hkv][hd]` each.
    F16 { k: DevPtr, v: DevPtr },
    /// i8 `[position][Hkv][hd]` each, with f32 `[position][Hkv]` scales.
    Int8 {
        k: DevPtr,
        v: DevPtr,
        k_scales: DevPtr,
        v_scales: DevPtr,
    },
}

impl KvCache {
    pub fn precision(&self) -> KvPrecision {
        match self {
            KvCache::F16 { .. } => KvPrecision::F16,
            KvCache::Int8 { .. } => KvPrecision::Int8,
        }
    }

    /// This view `values` cache values further on (`values` a whole number of rows of
    /// `head_dim`, so that the scales move by one entry per row).
    pub fn advanced(self, values: usize, head_dim: usize) -> Result<KvCache> {
        if head_dim == 0 || !values.is_multiple_of(head_dim) {
            return Err(CudaError::Unsupported(format!(
                "a KV cache offset of {values} values is not a whole number of rows of {head_dim}"
            )));
        }
        let bytes = |count: usize, size: usize| -> Result<DevPtr> {
            count
                .checked_mul(size)
                .and_then(|b| DevPtr::try_from(b).ok())
                .ok_or_else(|| {
                    CudaError::Unsupported(format!("a KV cache offset of {values} values"))
                })
        };
        Ok(match self {
            KvCache::F16 { k, v } => {
                let off = bytes(values, 2)?;
                KvCache::F16 {
                    k: k + off,
                    v: v + off,
                }
            }
            KvCache::Int8 {
                k,
                v,
                k_scales,
                v_scales,
            } => {
                let (off, scale_off) = (bytes(values, 1)?, bytes(values / head_dim, 4)?);
                KvCache::Int8 {
                    k: k + off,
                    v: v + off,
                    k_scales: k_scales + scale_off,
                    v_scales: v_scales + scale_off,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_move_the_scales_by_one_entry_per_row() {
        let f = KvCache::F16 { k: 1000, v: 5000 };
        assert_eq!(
            f.advanced(128, 64).unwrap(),
            KvCache::F16 { k: 1256, v: 5256 }
        );
        let q = KvCache::Int8 {
            k: 1000,
            v: 2000,
            k_scales: 3000,
            v_scales: 4000,
        };
        assert_eq!(
            q.advanced(192, 64).unwrap(),
            KvCache::Int8 {
                k: 1192,
                v: 2192,
                k_scales: 3012,
                v_scales: 4012
            }
        );
        assert_eq!(q.precision(), KvPrecision::Int8);
        assert!(q.advanced(100, 64).is_err());
        assert!(q.advanced(64, 0).is_err());
    }
}
