//! Times the decode-step products of Balanced-CBC's CPU records on SmolLM2-135M's layer shapes:
//! one token through the 30 layers' 7 projections (576 x 576, 192 x 576, 1536 x 576,
//! 576 x 1536), each a fresh random balanced N:16 matrix snapped onto int8 grids (what
//! `sieve pack --values int8` stores) or onto 4-bit grids of 64 or 128 columns (`--values
//! int4:G`), for the f16 records, the 8-bit records, the 8-bit records padded to 8 bytes and the
//! 4-bit records. Prints the best of `REPS` passes in ms per token and the GB/s of the records
//! read.
//! `cargo run --release -p sieve-model --example balanced_bench -- THREADS N DP [REPS]`

use sieve_cpu::balanced_cbc::{Arrangement, FastBalancedCbc, Int4Layout};
use sieve_cpu::simd::SimdLevel;
use sieve_formats::balanced_cbc::BalancedCbc;
use sieve_formats::random::{activations, balanced_matrix, threshold_for_sparsity};
use sieve_formats::value_grid::{INT4, INT8};
use sieve_formats::{DenseMatrix, WeightFormat};
use sieve_model::generate::run_in_pool;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: balanced_bench THREADS N DP [REPS]";
    let threads: usize = args.get(1).ok_or(usage)?.parse()?;
    let slots: usize = args.get(2).ok_or(usage)?.parse()?;
    let dp: f64 = args.get(3).ok_or(usage)?.parse()?;
    let reps: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(20);
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
    for l in 0..30 {
        for (i, &(m, k)) in shapes.iter().enumerate() {
            let seed = (l * 7 + i) as u64;
            let w = balanced_matrix(m, k, slots, seed)?;
            let v: Vec<f32> = w.data().iter().map(|x| x.to_f32()).collect();
            // The same weights on int8 row grids and on 4-bit grids of 64 and 128 columns.
            let mut snapped = Vec::new();
            for columns in [k, 64, 128] {
                let mut v = v.clone();
                for row in v.chunks_mut(k) {
                    for run in row.chunks_mut(columns) {
                        let grid = if columns == k { INT8 } else { INT4 };
                        grid.snap_row(run).ok_or("a non-finite weight")?;
                    }
                }
                snapped.push(BalancedCbc::encode_with_slots(
                    &DenseMatrix::from_f32(m, k, &v)?,
                    slots,
                )?);
            }
            let x = activations(k, seed ^ 99);
            let t = threshold_for_sparsity(&x, dp)?;
            mats.push((snapped, x, t));
        }
    }
    let mut layouts: Vec<(String, Vec<FastBalancedCbc>)> = vec![(
        "f16 records".into(),
        mats.iter()
            .map(|(w, _, _)| FastBalancedCbc::with_arrangement(&w[0], Arrangement::Interleaved))
            .collect(),
    )];
    for align in [1, 8] {
        let fast = mats
            .iter()
            .map(|(w, _, _)| FastBalancedCbc::with_int8_aligned(&w[0], align).ok_or("off grid"))
            .collect::<Result<Vec<_>, _>>()?;
        layouts.push((format!("int8 records, align {align}"), fast));
    }
    for (i, columns) in [(1, 64), (2, 128)] {
        for layout in [Int4Layout::Columns, Int4Layout::Quads] {
            let fast = mats
                .iter()
                .map(|(w, _, _)| FastBalancedCbc::with_int4_layout(&w[i], layout))
                .collect::<Option<Vec<_>>>();
            match fast {
                Some(fast) => layouts.push((format!("int4 {layout:?}, G {columns}"), fast)),
                None => println!("int4 {layout:?}: not on this CPU"),
            }
        }
    }
    let mut y: Vec<Vec<f32>> = mats
        .iter()
        .map(|(w, _, _)| vec![0f32; w[0].rows()])
        .collect();
    println!("N {slots} dp {dp}, {threads} threads, best of {reps} (ms per token, GB/s)");
    let level = SimdLevel::detect();
    run_in_pool(Some(threads), || {
        // Two rounds, alternating layouts, against drift on a shared machine.
        for _ in 0..2 {
            for (name, fast) in &layouts {
                let bytes: usize = fast.iter().map(|f| f.cpu_layout_bytes()).sum();
                let mut best = f64::MAX;
                for _ in 0..reps {
                    let t = Instant::now();
                    for (i, yi) in y.iter_mut().enumerate() {
                        fast[i]
                            .matvec_with(level, &mats[i].1, mats[i].2, yi)
                            .expect("shapes match");
                    }
                    best = best.min(t.elapsed().as_secs_f64());
                }
                println!(
                    "{name:26} {:7.3} ms  {:6.1} GB/s  ({:.1} MB)",
                    best * 1e3,
                    bytes as f64 / best / 1e9,
                    bytes as f64 / 1e6
                );
            }
        }
    })?;
    Ok(())
}
