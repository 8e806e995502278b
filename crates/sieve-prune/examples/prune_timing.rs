//! Times one layer's worth of pruning work at SmolLM2-135M sizes (hidden 576, MLP 1536):
//! Hessian accumulation over 32 x 1024 calibration rows, SparseGPT on a 1536 x 576 and a
//! 576 x 1536 matrix, and Wanda on the same matrices.
//!
//! `cargo run --release -p sieve-prune --example prune_timing [rows_of_calibration]`

use sieve_formats::random::SplitMix64;
use sieve_prune::{prune_sparsegpt, ColumnNorms, HessianAccumulator, Pattern, SparseGptOptions};
use std::time::Instant;

fn random(len: usize, rng: &mut SplitMix64) -> Vec<f32> {
    (0..len).map(|_| rng.normal() as f32).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let calib_rows: usize = match std::env::args().nth(1) {
        Some(s) => s.parse()?,
        None => 32 * 1024,
    };
    let mut rng = SplitMix64::new(42);
    println!("threads: {}", rayon::current_num_threads());
    for (m, k) in [(1536usize, 576usize), (576, 1536)] {
        let x = random(calib_rows * k, &mut rng);
        let w = random(m * k, &mut rng);

        let t = Instant::now();
        let mut h = HessianAccumulator::new(k)?;
        // stream like a forward pass would: one 1024-token window at a time
        for chunk in x.chunks(1024 * k) {
            h.add_rows(chunk, chunk.len() / k)?;
        }
        let t_hessian = t.elapsed();

        let t = Instant::now();
        let mut norms = ColumnNorms::new(k)?;
        for chunk in x.chunks(1024 * k) {
            norms.add_rows(chunk, chunk.len() / k)?;
        }
        let t_norms = t.elapsed();

        for (pattern, ratio) in [(Pattern::Unstructured, 0.5), (Pattern::nm(2, 4)?, 0.0)] {
            let t = Instant::now();
            let out = prune_sparsegpt(&w, m, k, &h, pattern, ratio, &SparseGptOptions::default())?;
            let t_sg = t.elapsed();
            let t = Instant::now();
            let wa = sieve_prune::methods::prune_wanda(&w, m, k, &norms, pattern, ratio)?;
            let t_wa = t.elapsed();
            println!(
                "{m}x{k} {pattern:>12} ratio {ratio}: hessian({calib_rows} rows) {:.3}s  sparsegpt {:.3}s  \
                 column norms {:.3}s  wanda {:.3}s  (sparsity {:.3} / {:.3})",
                t_hessian.as_secs_f64(),
                t_sg.as_secs_f64(),
                t_norms.as_secs_f64(),
                t_wa.as_secs_f64(),
                out.mask.sparsity(),
                wa.mask.sparsity(),
            );
        }
    }
    Ok(())
}
