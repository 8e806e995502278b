//! Reordering numbers for IE-BME on a random matrix:
//! `cargo run --release -p sieve-formats --example ie_bme_reorder -- [rows] [cols] [sparsity]`
//! (default 4096 x 11008 at 50%). Prints active union entries before/after and timings for the
//! exact DP, the greedy heuristic, and the default options, plus a matvec timing.

use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Payload, Reorder};
use sieve_formats::random::{self, Pattern};
use sieve_formats::WeightFormat;
use std::time::Instant;

/// CPU seconds (user + system) this process has used, from /proc (0 where unavailable): on a
/// shared, overloaded machine wall time says little, CPU time says what the work costs.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("stats") {
        return stats_line();
    }
    let rows: usize = args.get(1).map_or(Ok(4096), |s| s.parse())?;
    let cols: usize = args.get(2).map_or(Ok(11008), |s| s.parse())?;
    let sparsity: f64 = args.get(3).map_or(Ok(0.5), |s| s.parse())?;
    let w = random::sparse_matrix(rows, cols, sparsity, Pattern::Unstructured, 0)?;
    println!(
        "matrix {rows} x {cols}, sparsity {:.3}, threads {}",
        w.sparsity(),
        rayon::current_num_threads()
    );
    for (name, payload) in [
        ("f16", Payload::F16),
        ("int4/g128", Payload::Int4 { group_size: 128 }),
    ] {
        for (rname, reorder) in [
            ("off", Reorder::Off),
            ("greedy", Reorder::Greedy),
            ("dp(no budget)", Reorder::Dp { time_budget: None }),
        ] {
            let opts = IeBmeOptions {
                payload,
                reorder,
                ..IeBmeOptions::default()
            };
            let (t0, c0) = (Instant::now(), cpu_seconds());
            let enc = IeBme::encode(&w, &opts)?;
            let total = t0.elapsed();
            let cpu = cpu_seconds() - c0;
            let s = enc.storage();
            let line = match enc.reorder_stats() {
                Some(st) => format!(
                    "before {} after {} ({:+.2}%), dp tiles {}, greedy tiles {}, reorder+tile pass {:.2} s",
                    st.active_before,
                    st.active_after,
                    100.0 * (st.active_after as f64 / st.active_before as f64 - 1.0),
                    st.dp_tiles,
                    st.greedy_tiles,
                    st.elapsed.as_secs_f64()
                ),
                None => format!("active entries {}", enc.total_active_entries()),
            };
            println!(
                "{name:10} reorder {rname:14} {line}; encode {:.2} s wall, {cpu:.2} s cpu; payload {} B, metadata {} B, pmr {:.3}, paper pmr {:.3}",
                total.as_secs_f64(),
                s.payload_bytes,
                s.metadata_bytes,
                s.pmr(),
                enc.paper_pmr()
            );
            if rname == "off" {
                let x = random::activations(cols, 1);
                let mut y = vec![0f32; rows];
                enc.matvec(&x, None, &mut y)?;
                let (t, c) = (Instant::now(), cpu_seconds());
                for _ in 0..5 {
                    enc.matvec(&x, None, &mut y)?;
                }
                let mv = t.elapsed().as_secs_f64() / 5.0;
                let mv_cpu = (cpu_seconds() - c) / 5.0;
                let thr = random::threshold_for_sparsity(&x, 0.5)?;
                let t = Instant::now();
                for _ in 0..5 {
                    enc.matvec(&x, thr, &mut y)?;
                }
                let mvt = t.elapsed().as_secs_f64() / 5.0;
                let n = 8;
                let xs: Vec<f32> = (0..n).flat_map(|i| random::activations(cols, i)).collect();
                let mut ys = vec![0f32; n as usize * rows];
                let t = Instant::now();
                enc.matmul(&xs, n as usize, None, &mut ys)?;
                let mm = t.elapsed().as_secs_f64();
                println!(
                    "{name:10} matvec {:.1} ms wall ({:.1} ms cpu), matvec (50% inputs skipped) {:.1} ms, matmul n=8 {:.1} ms",
                    mv * 1e3,
                    mv_cpu * 1e3,
                    mvt * 1e3,
                    mm * 1e3
                );
            }
        }
    }
    Ok(())
}

/// The `ie-bme` line of `sieve formats stats --rows 4096 --cols 4096 --sparsity 0.5` (seed 0),
/// computed the same way (default encoding, `Storage`), for machines where the CLI is not built.
fn stats_line() -> Result<(), Box<dyn std::error::Error>> {
    use sieve_formats::{registry, FormatKind};
    let (rows, cols) = (4096, 4096);
    let w = random::sparse_matrix(rows, cols, 0.5, Pattern::Unstructured, 0)?;
    let packed = registry::encode_default(FormatKind::IeBme, &w)?;
    let s = packed.storage();
    println!(
        "{{\"format\":\"ie-bme\",\"rows\":{rows},\"cols\":{cols},\"sparsity\":{},\"payload_bytes\":{},\"metadata_bytes\":{},\"total_bytes\":{},\"dense_bytes\":{},\"ratio_to_dense\":{},\"pmr\":{}}}",
        w.sparsity(),
        s.payload_bytes,
        s.metadata_bytes,
        s.total_bytes(),
        w.dense_bytes(),
        s.total_bytes() as f64 / w.dense_bytes() as f64,
        s.pmr()
    );
    Ok(())
}
