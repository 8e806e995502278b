//! The runner's KV cache pool on the device: one cache per slot, f16 or 8-bit
//! ([`KvPrecision`]), K and V apart, in the layout sieve-cuda's kernels address
//! ([`sieve_cuda::KvCache`]):
//!
//! ```text
//!   values   [slot][layer][position][Hkv][hd]   f16, or i8
//!   scales   [slot][layer][position][Hkv]       f32, 8-bit only: one per row of hd values
//! ```
//!
//! A (slot, layer) cache starts `(slot * layers + layer) * capacity * Hkv * hd` values into
//! the pool and its scales that count over `hd` entries into theirs.

use crate::error::{GpuError, Result};
use cudarc::driver::{CudaSlice, CudaStream};
use half::f16;
use sieve_cuda::{dev_ptr, DriverContext, Gpu, KvCache, KvPrecision};
use std::sync::Arc;

/// Device buffers of the pool.
pub(crate) enum DeviceKvCache {
    F16 {
        k: CudaSlice<f16>,
        v: CudaSlice<f16>,
    },
    Int8 {
        k: CudaSlice<i8>,
        v: CudaSlice<i8>,
        k_scales: CudaSlice<f32>,
        v_scales: CudaSlice<f32>,
    },
}

impl DeviceKvCache {
    /// Bytes of a pool of `rows` rows of `head_dim` values (K and V, scales included), or
    /// `None` past the address space.
    pub(crate) fn bytes_for(precision: KvPrecision, rows: usize, head_dim: usize) -> Option<usize> {
        rows.checked_mul(precision.row_bytes(head_dim))?
            .checked_mul(2)
    }

    /// A zeroed pool of `rows` rows of `head_dim` values each for K and for V (at least one
    /// row, so that a freed pool still has buffers to point at).
    pub(crate) fn allocate(
        stream: &Arc<CudaStream>,
        precision: KvPrecision,
        rows: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let rows = rows.max(1);
        let values = rows.checked_mul(head_dim).ok_or_else(|| {
            GpuError::InvalidArgument(format!(
                "a KV cache of {rows} rows of {head_dim} overflows the address space"
            ))
        })?;
        Ok(match precision {
            KvPrecision::F16 => DeviceKvCache::F16 {
                k: stream
                    .alloc_zeros::<f16>(values)
                    .during("allocating the K cache")?,
                v: stream
                    .alloc_zeros::<f16>(values)
                    .during("allocating the V cache")?,
            },
            KvPrecision::Int8 => DeviceKvCache::Int8 {
                k: stream
                    .alloc_zeros::<i8>(values)
                    .during("allocating the 8-bit K cache")?,
                v: stream
                    .alloc_zeros::<i8>(values)
                    .during("allocating the 8-bit V cache")?,
                k_scales: stream
                    .alloc_zeros::<f32>(rows)
                    .during("allocating the K cache's scales")?,
                v_scales: stream
                    .alloc_zeros::<f32>(rows)
                    .during("allocating the V cache's scales")?,
            },
        })
    }

    pub(crate) fn precision(&self) -> KvPrecision {
        match self {
            DeviceKvCache::F16 { .. } => KvPrecision::F16,
            DeviceKvCache::Int8 { .. } => KvPrecision::Int8,
        }
    }

    /// Rows of `head_dim` values the pool holds (per K or V).
    pub(crate) fn rows(&self, head_dim: usize) -> usize {
        match self {
            DeviceKvCache::F16 { k, .. } => k.len() / head_dim.max(1),
            DeviceKvCache::Int8 { k_scales, .. } => k_scales.len(),
        }
    }

    /// The kernels' view of the pool `values` cache values from its start (a whole number of
    /// rows of `head_dim`).
    pub(crate) fn view_at(&self, gpu: &Gpu, values: usize, head_dim: usize) -> Result<KvCache> {
        let base = match self {
            DeviceKvCache::F16 { k, v } => KvCache::F16 {
                k: dev_ptr(gpu, k),
                v: dev_ptr(gpu, v),
            },
            DeviceKvCache::Int8 {
                k,
                v,
                k_scales,
                v_scales,
            } => KvCache::Int8 {
                k: dev_ptr(gpu, k),
                v: dev_ptr(gpu, v),
                k_scales: dev_ptr(gpu, k_scales),
                v_scales: dev_ptr(gpu, v_scales),
            },
        };
        Ok(base.advanced(values, head_dim)?)
    }
}
