use criterion::{criterion_group, criterion_main, Criterion};
use sieve_formats::{random, registry, FormatKind};

fn bench_matvec(c: &mut Criterion) {
    let (m, k) = (4096, 4096);
    let w = random::sparse_matrix(m, k, 0.5, random::Pattern::Unstructured, 7).expect("matrix");
    let x = random::activations(k, 11);
    let t = random::threshold_for_sparsity(&x, 0.5).expect("threshold");
    let mut y = vec![0f32; m];
    let mut group = c.benchmark_group("matvec_4096x4096_sp0.5_dp0.5");
    for kind in FormatKind::ALL {
        let Ok(packed) = registry::encode_default(kind, &w) else {
            continue;
        };
        group.bench_function(kind.name(), |b| {
            b.iter(|| packed.matvec(&x, t, &mut y).expect("matvec"))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_matvec);
criterion_main!(benches);
