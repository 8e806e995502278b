//! Times the decode-step products of the packed column formats on SmolLM2-135M's layer shapes:
//! one token through the 30 layers' 7 projections (q, k, v, o: 576 x 576 / 192 x 576;
//! gate, up: 1536 x 576; down: 576 x 1536), each matrix a fresh random one (so the 30 layers'
//! weights, like the model's, do not fit in cache), for every SIMD level and format.
//! `tiled-cbc rows` is the row-major bitmap layout (`RowTiledCbc`, what packs run), `tiled-cbc`
//! the whole-column one (`ColumnTiledCbc`, `--cpu-kernel tiled-cbc=columns`).
//! Prints the best of `REPS` passes in ms per token and the GB/s of bytes the format must read.
//! `cargo run --release -p sieve-model --example sparse_bench -- THREADS SP DP [REPS]`

use sieve_cpu::dense::DenseColumns;
use sieve_cpu::dense::FastDense;
use sieve_cpu::simd::SimdLevel;
use sieve_cpu::tiled_cbc::ColumnTiledCbc;
use sieve_cpu::tiled_cbc::RowTiledCbc;
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::WeightFormat;
use sieve_model::generate::run_in_pool;
use std::time::Instant;

/// CPU time of the calling thread (`/proc/thread-self/schedstat`, ns on the CPU): with one
/// worker thread this is the product's CPU time, free of the time other processes take the
/// core away on a loaded machine. 0 where unavailable.
fn thread_cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map_or(0.0, |ns| ns * 1e-9)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args[1].parse()?;
    let sp: f64 = args[2].parse()?;
    let dp: f64 = args[3].parse()?;
    let reps: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(20);
    let layers: usize = std::env::var("LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let shapes = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    let mut mats = Vec::new();
    for l in 0..layers {
        for (i, &(m, k)) in shapes.iter().enumerate() {
            let w = sparse_matrix(m, k, sp, Pattern::Unstructured, (l * 7 + i) as u64)?;
            let x = activations(k, (l * 7 + i) as u64 ^ 99);
            let t = threshold_for_sparsity(&x, dp)?;
            mats.push((w, x, t));
        }
    }
    let tiled: Vec<ColumnTiledCbc> = mats
        .iter()
        .map(|(w, _, _)| ColumnTiledCbc::new(TiledCbc::encode(w).unwrap()))
        .collect();
    let rows: Vec<RowTiledCbc> = mats
        .iter()
        .map(|(w, _, _)| RowTiledCbc::new(&TiledCbc::encode(w).unwrap()))
        .collect();
    let cols: Vec<DenseColumns> = mats.iter().map(|(w, _, _)| DenseColumns::new(w)).collect();
    let dense: Vec<FastDense> = mats
        .iter()
        .map(|(w, _, _)| FastDense::new(w.clone()))
        .collect();
    // Bytes each format must read for the active columns (values, bitmaps and tile metadata).
    let active: Vec<f64> = mats
        .iter()
        .map(|(_, x, t)| {
            x.iter()
                .filter(|v| **v != 0.0 && t.is_none_or(|t| v.abs() > t))
                .count() as f64
                / x.len() as f64
        })
        .collect();
    let gb = |bytes: &dyn Fn(usize) -> f64| (0..mats.len()).map(bytes).sum::<f64>() / 1e9;
    let tiled_bytes = gb(&|i| tiled[i].storage().total_bytes() as f64 * active[i]);
    let col_bytes = gb(&|i| cols[i].storage().total_bytes() as f64 * active[i]);
    let rows_bytes = gb(&|i| rows[i].cpu_layout_bytes() as f64);
    let dense_bytes = gb(&|i| dense[i].storage().total_bytes() as f64);
    let mut y: Vec<Vec<f32>> = mats.iter().map(|(w, _, _)| vec![0f32; w.rows()]).collect();
    println!(
        "sp {sp} dp {dp}, {threads} threads, best of {reps} (ms per token, GB/s of the bytes read)"
    );
    run_in_pool(Some(threads), || {
        let only = std::env::var("ONLY").unwrap_or_default();
        let mut time = |name: &str, bytes: f64, f: &mut dyn FnMut(usize, &mut [f32])| {
            if !name.contains(only.as_str()) {
                return;
            }
            let (mut best, mut best_cpu) = (f64::MAX, f64::MAX);
            for _ in 0..reps {
                let (t, c) = (Instant::now(), thread_cpu_seconds());
                for (i, yi) in y.iter_mut().enumerate() {
                    f(i, yi);
                }
                best = best.min(t.elapsed().as_secs_f64());
                best_cpu = best_cpu.min(thread_cpu_seconds() - c);
            }
            println!(
                "{name:28} {:7.3} ms  {:6.1} GB/s  ({:.1} MB)   this thread's CPU time {:7.3} ms",
                best * 1e3,
                bytes / best,
                bytes * 1e3,
                best_cpu * 1e3
            );
        };
        time("dense f16 rows (masked x)", dense_bytes, &mut |i, yi| {
            dense[i].matvec(&mats[i].1, mats[i].2, yi).unwrap()
        });
        for level in SimdLevel::available() {
            time(
                &format!("dense columns {}", level.name()),
                col_bytes,
                &mut |i, yi| {
                    cols[i]
                        .matvec_with(level, &mats[i].1, mats[i].2, yi)
                        .unwrap()
                },
            );
            time(
                &format!("tiled-cbc rows {}", level.name()),
                rows_bytes,
                &mut |i, yi| {
                    rows[i]
                        .matvec_with(level, &mats[i].1, mats[i].2, yi)
                        .unwrap()
                },
            );
            time(
                &format!("tiled-cbc {}", level.name()),
                tiled_bytes,
                &mut |i, yi| {
                    tiled[i]
                        .matvec_with(level, &mats[i].1, mats[i].2, yi)
                        .unwrap()
                },
            );
        }
    })?;
    Ok(())
}
