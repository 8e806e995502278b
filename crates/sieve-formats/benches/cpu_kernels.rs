//! CPU reference kernels of every format at 4096 x 4096.
//!
//! Weights: unstructured 50% sparsity; slide, which needs (2N-2):2N, gets a 6:8 matrix (25%
//! sparsity) instead, so its numbers are not at the same weight sparsity as the others.
//! Activations: dp = 0 (dense, no threshold) and dp = 0.5 (TEAL threshold at the median |x|).
//! Run: `cargo bench -p sieve-formats -- --warm-up-time 1 --measurement-time 3`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sieve_formats::random::{self, Pattern};
use sieve_formats::{registry, DenseMatrix, FormatKind, WeightFormat};

const M: usize = 4096;
const K: usize = 4096;
const SPARSITY: f64 = 0.5;
const BATCH: usize = 8;

/// Every format available in this build, each with the matrix it is benchmarked on.
fn packed_formats() -> Vec<(FormatKind, Box<dyn WeightFormat>)> {
    let unstructured = random::sparse_matrix(M, K, SPARSITY, Pattern::Unstructured, 7)
        .expect("unstructured matrix");
    let six_eight: DenseMatrix =
        random::sparse_matrix(M, K, 0.0, Pattern::NM { n: 6, m: 8 }, 7).expect("6:8 matrix");
    FormatKind::ALL
        .into_iter()
        .filter_map(|kind| {
            let w = if kind == FormatKind::Slide {
                &six_eight
            } else {
                &unstructured
            };
            match registry::encode_default(kind, w) {
                Ok(p) => Some((kind, p)),
                Err(e) => {
                    eprintln!("{}: skipped: {e}", kind.name());
                    None
                }
            }
        })
        .collect()
}

fn bench_kernels(c: &mut Criterion) {
    let formats = packed_formats();
    let x = random::activations(K * BATCH, 11);
    let mut y = vec![0f32; M * BATCH];
    for dp in [0.0, 0.5] {
        let t = random::threshold_for_sparsity(&x[..K], dp).expect("threshold");
        let mut group = c.benchmark_group(format!("matvec_{M}x{K}_sp{SPARSITY}_dp{dp}"));
        group.throughput(Throughput::Elements((M * K) as u64));
        for (kind, packed) in &formats {
            group.bench_function(kind.name(), |b| {
                b.iter(|| packed.matvec(&x[..K], t, &mut y[..M]).expect("matvec"))
            });
        }
        group.finish();

        let mut group = c.benchmark_group(format!("matmul_n{BATCH}_{M}x{K}_sp{SPARSITY}_dp{dp}"));
        group.throughput(Throughput::Elements((M * K * BATCH) as u64));
        // A batched product takes tens of ms on 2 cores; 10 samples keep the run short.
        group.sample_size(10);
        for (kind, packed) in &formats {
            group.bench_function(kind.name(), |b| {
                b.iter(|| packed.matmul(&x, BATCH, t, &mut y).expect("matmul"))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench_kernels);
criterion_main!(benches);
