//! Throughput of the batched dense product (`FastDense::matmul`, the GEMM behind prefill and
//! calibration) on SmolLM2-135M projection shapes.
//!
//! `cargo run --release -p sieve-model --example gemm_bench -- [tokens] [threads]`

use sieve_cpu::dense::FastDense;
use sieve_formats::{DenseMatrix, WeightFormat};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    if let Some(t) = args.next().and_then(|a| a.parse::<usize>().ok()) {
        // Ignore the error: the global pool may only be built once.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global();
    }
    for (m, k) in [
        (576, 576),
        (192, 576),
        (1536, 576),
        (576, 1536),
        (49152, 576),
    ] {
        let data: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let w = FastDense::new(DenseMatrix::from_f32(m, k, &data).expect("finite weights"));
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 997) as f32 / 997.0 - 0.5)
            .collect();
        let mut y = vec![0f32; n * m];
        w.matmul(&x, n, None, &mut y).expect("shapes match");
        let reps = (2e10 / (2.0 * (n * m * k) as f64)).clamp(1.0, 50.0) as usize;
        let t = Instant::now();
        for _ in 0..reps {
            w.matmul(&x, n, None, &mut y).expect("shapes match");
        }
        let s = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "M={m:6} K={k:5} n={n:5}: {:8.2} ms  {:6.1} GFLOP/s",
            s * 1e3,
            2.0 * (n * m * k) as f64 / s / 1e9
        );
    }
}
