//! Automatic kernel choice per layer: which GPU kernel runs a pruned weight matrix fastest at
//! its activation sparsity, from time models fitted to measured runs.
//!
//! Run 3 (docs/BENCHMARKS.md) showed that neither kernel wins everywhere: the sparse
//! `tiled-cbc/lane8` kernel pays per active column tile (its decode is instruction bound), so at
//! low weight sparsity the dense column-major kernel, which stores the pruned matrix with its
//! zeros and only skips inactive columns, is faster; at high dual sparsity on large shapes
//! lane8 wins. The models are linear in the work each kernel does (µs; MB = 10^6 bytes):
//!
//! ```text
//!   dense-colmajor:  t = 6.636 + 0.2263 * MB(dense f16 of the active columns) + 0.0013 * row tiles
//!   tiled-cbc/lane8: t = 9.186 + 0.2125 * MB(Tiled-CBC encoding) * (1 - dp)
//!                              + 0.0474 * (active column tiles / 1000)
//! ```
//!
//! fitted by `scripts/fit-kernel-model.py docs/bench/gpu-run3-*.json` (median error 2.3% and
//! 3.4%); on those 144 measured points the choice lands within 3% of the faster kernel 138
//! times. Refit when the kernels change.

use crate::dense::GpuDenseColMajor;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::product::GpuMatVec;
use crate::tiled_cbc::GpuTiledCbc;
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::{DenseMatrix, WeightFormat};

/// A kernel the choice can pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelChoice {
    /// The pruned matrix stored dense (column-major f16), inactive columns skipped.
    DenseColMajor,
    /// Tiled-CBC under the lane-per-8-rows kernel.
    TiledCbcLane8,
}

/// What the models need to know about a layer.
#[derive(Clone, Copy, Debug)]
pub struct LayerShape {
    pub rows: usize,
    pub cols: usize,
    /// Bytes of the Tiled-CBC encoding (values, bitmaps, ColInfo, TileOffsets).
    pub tiled_cbc_bytes: usize,
}

impl LayerShape {
    pub fn of(w: &DenseMatrix) -> Result<Self> {
        Ok(LayerShape {
            rows: w.rows(),
            cols: w.cols(),
            tiled_cbc_bytes: TiledCbc::encode(w)?.storage().total_bytes(),
        })
    }
}

/// Predicted time (µs) of `kernel` on `layer` when a fraction `dp` of the activations is
/// inactive. Tiled-CBC bytes scale with the active columns (unstructured pruning spreads the
/// nonzeros evenly over columns).
pub fn predicted_us(kernel: KernelChoice, layer: &LayerShape, dp: f64) -> f64 {
    let active = (1.0 - dp.clamp(0.0, 1.0)).max(0.0);
    let row_tiles = layer.rows.div_ceil(256) as f64;
    match kernel {
        KernelChoice::DenseColMajor => {
            let mb = (layer.rows * layer.cols * 2) as f64 * active / 1e6;
            6.636 + 0.2263 * mb + 0.0013 * row_tiles
        }
        KernelChoice::TiledCbcLane8 => {
            let mb = layer.tiled_cbc_bytes as f64 * active / 1e6;
            let tiles = row_tiles * layer.cols as f64 * active;
            9.186 + 0.2125 * mb + 0.0474 * tiles / 1e3
        }
    }
}

/// The kernel with the smaller predicted time.
pub fn choose(layer: &LayerShape, dp: f64) -> KernelChoice {
    let dense = predicted_us(KernelChoice::DenseColMajor, layer, dp);
    let lane8 = predicted_us(KernelChoice::TiledCbcLane8, layer, dp);
    if lane8 < dense {
        KernelChoice::TiledCbcLane8
    } else {
        KernelChoice::DenseColMajor
    }
}

/// Uploads `w` in the representation [`choose`] picks for activation sparsity `dp`.
pub fn upload_chosen(gpu: &Gpu, w: &DenseMatrix, dp: f64) -> Result<Box<dyn GpuMatVec>> {
    let encoded = TiledCbc::encode(w)?;
    let layer = LayerShape {
        rows: w.rows(),
        cols: w.cols(),
        tiled_cbc_bytes: encoded.storage().total_bytes(),
    };
    Ok(match choose(&layer, dp) {
        KernelChoice::DenseColMajor => Box::new(GpuDenseColMajor::upload(gpu, w)?),
        KernelChoice::TiledCbcLane8 => Box::new(GpuTiledCbc::upload(gpu, &encoded)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sieve_formats::random::{sparse_matrix, Pattern};

    /// One measured point of run 3.
    #[derive(serde::Deserialize)]
    struct Row {
        format: String,
        m: usize,
        k: usize,
        sp: f64,
        dp: f64,
        us: f64,
        bytes: usize,
    }

    fn rows() -> Vec<Row> {
        #[derive(serde::Deserialize)]
        struct Report {
            rows: Vec<Row>,
        }
        let mut out = Vec::new();
        for text in [
            include_str!("../../../docs/bench/gpu-run3-7b-13b-l3.json"),
            include_str!("../../../docs/bench/gpu-run3-70b.json"),
        ] {
            let r: Report = serde_json::from_str(text).expect("run 3 json");
            out.extend(r.rows);
        }
        out
    }

    /// Against the measurements the models were fitted to: the chosen kernel is within 3% of
    /// the faster one at >= 90% of the points, and never more than 25% slower.
    #[test]
    fn choice_matches_run3_measurements() {
        let rows = rows();
        let (mut good, mut total) = (0, 0);
        for r in rows
            .iter()
            .filter(|r| r.format == "tiled-cbc/lane8" && r.sp > 0.0)
        {
            let Some(dense) = rows
                .iter()
                .find(|d| d.format == "dense-colmajor" && (d.m, d.k) == (r.m, r.k) && d.dp == r.dp)
            else {
                continue;
            };
            // The model wants the whole encoding: the bytes recorded at dp = 0.
            let Some(full) = rows.iter().find(|f| {
                f.format == r.format && (f.m, f.k) == (r.m, r.k) && f.sp == r.sp && f.dp == 0.0
            }) else {
                continue;
            };
            let layer = LayerShape {
                rows: r.m,
                cols: r.k,
                tiled_cbc_bytes: full.bytes,
            };
            let got = match choose(&layer, r.dp) {
                KernelChoice::DenseColMajor => dense.us,
                KernelChoice::TiledCbcLane8 => r.us,
            };
            let best = dense.us.min(r.us);
            assert!(
                got <= best * 1.25,
                "{}x{} sp {} dp {}: {got} vs {best}",
                r.m,
                r.k,
                r.sp,
                r.dp
            );
            good += usize::from(got <= best * 1.03);
            total += 1;
        }
        assert!(total >= 100, "run 3 points: {total}");
        assert!(good * 10 >= total * 9, "choice within 3%: {good}/{total}");
    }

    #[test]
    fn dense_at_low_sparsity_sparse_at_high_dual_sparsity() {
        let low = sparse_matrix(1024, 1024, 0.3, Pattern::Unstructured, 1).expect("matrix");
        let high = sparse_matrix(1024, 1024, 0.8, Pattern::Unstructured, 2).expect("matrix");
        let low = LayerShape::of(&low).expect("shape");
        let high = LayerShape::of(&high).expect("shape");
        assert_eq!(choose(&low, 0.3), KernelChoice::DenseColMajor);
        let big = LayerShape {
            rows: 8192,
            cols: 28672,
            tiled_cbc_bytes: high.tiled_cbc_bytes * 224,
        };
        assert_eq!(choose(&big, 0.7), KernelChoice::TiledCbcLane8);
        // Fewer active columns never make a kernel slower.
        for kernel in [KernelChoice::DenseColMajor, KernelChoice::TiledCbcLane8] {
            assert!(predicted_us(kernel, &big, 0.7) < predicted_us(kernel, &big, 0.3));
        }
    }
}
