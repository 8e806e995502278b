//! Property tests of the Slide format: round trips, 2:4 compliance of the windows, the lifting
//! identity W'·lift(x) = W·x, products against the f64 reference, and corrupt blobs.

use half::f16;
use proptest::prelude::*;
use sieve_formats::random::{self, Pattern};
use sieve_formats::reference::{matmul_f64, matvec_f64, max_rel_error};
use sieve_formats::slide::{
    encode_or_prune, prune_to_pattern, Slide, SlideGeometry, SlideOptions, LIFT_PAD,
};
use sieve_formats::{registry, DenseMatrix, FormatError, Threshold, WeightFormat};

/// A (2N-2):2N matrix whose nonzeros cluster adversarially: random blocks get their nonzeros at
/// the block edges (positions seen by one window only) as well as random ones.
fn slide_matrix(rows: usize, cols: usize, n: usize, seed: u64) -> DenseMatrix {
    let mut rng = random::SplitMix64::new(seed);
    let block = 2 * n;
    let mut data = vec![f16::ZERO; rows * cols];
    for r in 0..rows {
        for start in (0..cols).step_by(block) {
            let width = block.min(cols - start);
            let mut pos: Vec<usize> = (0..width).collect();
            match rng.below(3) {
                // Keep the outermost positions: fills windows 0 and N-2 first.
                0 => pos.sort_by_key(|&p| p.min(block - 1 - p)),
                // Leftmost first: maximal spilling to the right.
                1 => {}
                _ => rng.shuffle(&mut pos),
            }
            let keep = rng.below((block - 2).min(width) + 1);
            for &p in pos.iter().take(keep) {
                data[r * cols + start + p] = match rng.below(10) {
                    0 => f16::NEG_ZERO,
                    _ => random::weight_value(&mut rng),
                };
            }
        }
    }
    DenseMatrix::new(rows, cols, data).unwrap()
}

/// max |got - want| of a `tokens`-row product relative to the largest output's term sizes
/// `Σ |w| |x|` (inputs with |x| <= t inactive) or the largest |want|, at least 1e-6: f32
/// rounding scales with the terms, and one row's sum can cancel to almost nothing.
fn error_of_terms(
    got: &[f32],
    want: &[f64],
    w: &DenseMatrix,
    x: &[f32],
    tokens: usize,
    t: Threshold,
) -> f64 {
    let abs: Vec<f32> = w.data().iter().map(|v| v.to_f32().abs()).collect();
    let wa = DenseMatrix::from_f32(w.rows(), w.cols(), &abs).unwrap();
    // |x| > t is the same mask as for x, applied by the reference.
    let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let terms = matmul_f64(&wa, &xa, tokens, t);
    let scale = terms
        .iter()
        .chain(want)
        .fold(1e-6f64, |a, v| a.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0f64, f64::max)
        / scale
}

fn is_24(w: &DenseMatrix) -> bool {
    w.data()
        .chunks(4)
        .all(|g| g.iter().filter(|v| v.to_bits() != 0).count() <= 2)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn round_trip_and_lifting(rows in 1usize..6, cols in 1usize..70, n in 2usize..=8, seed in any::<u64>()) {
        let w = slide_matrix(rows, cols, n, seed);
        let s = Slide::encode(&w, &SlideOptions { n }).unwrap();
        prop_assert_eq!(s.decode(), w.clone());
        let g = s.geometry();
        prop_assert_eq!(g.expanded_cols, g.padded_cols * (n - 1) * 4 / (2 * n));
        prop_assert_eq!(s.values().len(), rows * g.groups_per_row * 2);

        // Every window is 2:4 and the expanded matrix reproduces W·x exactly up to fp order.
        let wp = s.expanded();
        prop_assert_eq!(wp.cols(), g.expanded_cols);
        prop_assert!(is_24(&wp));
        let x = random::activations(cols, seed);
        let xl = s.lift(&x).unwrap();
        let want = matvec_f64(&w, &x, None);
        let via_lift = matvec_f64(&wp, &xl, None);
        for (a, b) in via_lift.iter().zip(&want) {
            prop_assert!((a - b).abs() <= 1e-9 * (1.0 + b.abs()), "{a} vs {b}");
        }
        let map = s.lift_map();
        for (kp, &src) in map.iter().enumerate() {
            let expect = if src == LIFT_PAD { 0.0 } else { x[src as usize] };
            prop_assert_eq!(xl[kp], expect);
        }

        // Serialization round trip through the registry.
        let back = registry::from_bytes(&s.to_bytes()).unwrap();
        prop_assert_eq!(back.decode(), w);
    }

    #[test]
    fn products_match_reference(rows in 1usize..20, cols in 1usize..90, n in 2usize..=8,
                                dp in 0.0f64..0.9, tokens in 1usize..4, seed in any::<u64>()) {
        let w = slide_matrix(rows, cols, n, seed);
        let s = Slide::encode(&w, &SlideOptions { n }).unwrap();
        let x = random::activations(cols * tokens, seed ^ 1);
        let t = random::threshold_for_sparsity(&x[..cols], dp).unwrap();
        let mut y = vec![0f32; rows];
        s.matvec(&x[..cols], t, &mut y).unwrap();
        let e = error_of_terms(&y, &matvec_f64(&w, &x[..cols], t), &w, &x[..cols], 1, t);
        prop_assert!(e < 1e-4, "matvec error {}", e);
        let mut ym = vec![0f32; rows * tokens];
        s.matmul(&x, tokens, t, &mut ym).unwrap();
        let e = error_of_terms(&ym, &matmul_f64(&w, &x, tokens, t), &w, &x, tokens, t);
        prop_assert!(e < 1e-4, "matmul error {}", e);
        // Row 0 of the batch is the single-vector product.
        prop_assert_eq!(&ym[..rows], &y[..]);
    }

    #[test]
    fn generated_nm_patterns_encode(rows in 1usize..8, blocks in 1usize..8, n in 2usize..=8, seed in any::<u64>()) {
        let cols = blocks * 2 * n;
        let w = random::sparse_matrix(rows, cols, 0.0, Pattern::NM { n: 2 * n - 2, m: 2 * n }, seed).unwrap();
        let s = Slide::encode(&w, &SlideOptions { n }).unwrap();
        prop_assert_eq!(s.decode(), w);
    }

    #[test]
    fn pruning_always_encodes(rows in 1usize..6, cols in 1usize..50, n in 2usize..=8, seed in any::<u64>()) {
        let w = random::sparse_matrix(rows, cols, 0.1, Pattern::Unstructured, seed).unwrap();
        let p = prune_to_pattern(&w, n).unwrap();
        let s = Slide::encode(&p, &SlideOptions { n }).unwrap();
        prop_assert_eq!(s.decode(), p.clone());
        // Pruning only zeroes entries.
        for (a, b) in w.data().iter().zip(p.data()) {
            prop_assert!(b.to_bits() == 0 || a.to_bits() == b.to_bits());
        }
    }

    #[test]
    fn mutated_payload_never_panics(seed in any::<u64>(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4)) {
        let w = slide_matrix(3, 21, 4, seed);
        let s = Slide::encode(&w, &SlideOptions::default()).unwrap();
        let mut bw = sieve_formats::blob::ByteWriter::new();
        s.write_payload(&mut bw);
        let mut bytes = bw.buf;
        for (at, x) in flips {
            let i = at % bytes.len();
            bytes[i] ^= x | 1;
        }
        // Checksum bypassed: this exercises the payload validation itself.
        let mut r = sieve_formats::blob::ByteReader::new(&bytes);
        if let Ok(back) = Slide::read_payload(&mut r) {
            // Whatever survives validation must be usable without panics.
            let d = back.decode();
            let x = random::activations(back.cols(), 3);
            let mut y = vec![0f32; back.rows()];
            back.matvec(&x, Some(0.1), &mut y).unwrap();
            prop_assert!(max_rel_error(&y, &matvec_f64(&d, &x, Some(0.1))) < 1e-4);
        }
    }
}

#[test]
fn violation_is_typed_and_registry_default_refuses_unstructured() {
    let w = random::sparse_matrix(8, 64, 0.5, Pattern::Unstructured, 3).unwrap();
    let e = registry::encode_default(sieve_formats::FormatKind::Slide, &w).unwrap_err();
    assert!(matches!(e, FormatError::Pattern(_)), "{e:?}");
    assert!(e.to_string().contains("6:8"), "{e}");
    // The same matrix pruned to 6:8 is accepted by the registry.
    let p = prune_to_pattern(&w, 4).unwrap();
    assert!(registry::encode_default(sieve_formats::FormatKind::Slide, &p).is_ok());
}

#[test]
fn encode_or_prune_uses_pattern_n() {
    let w = random::sparse_matrix(4, 40, 0.0, Pattern::NM { n: 8, m: 10 }, 5).unwrap();
    let (s, pruned) = encode_or_prune(&w, Pattern::NM { n: 8, m: 10 }).unwrap();
    assert_eq!(s.n(), 5);
    assert!(pruned.is_none());
    assert_eq!(s.decode(), w);
    let u = random::sparse_matrix(4, 40, 0.2, Pattern::Unstructured, 5).unwrap();
    let (s, pruned) = encode_or_prune(&u, Pattern::Unstructured).unwrap();
    assert_eq!(s.n(), 4);
    assert_eq!(s.decode(), pruned.unwrap());
}

#[test]
fn storage_of_6_8() {
    // 4096 columns at 6:8: 512 blocks, 1536 groups, 3072 kept values, 192 metadata words per row.
    let g = SlideGeometry::new(4096, 4).unwrap();
    assert_eq!((g.groups_per_row, g.expanded_cols), (1536, 6144));
    assert_eq!(g.meta_words_per_row, 192);
    let w = random::sparse_matrix(2, 4096, 0.0, Pattern::NM { n: 6, m: 8 }, 1).unwrap();
    let s = Slide::encode(&w, &SlideOptions::default()).unwrap();
    let st = s.storage();
    assert_eq!(st.payload_bytes, 2 * 3072 * 2);
    assert_eq!(st.metadata_bytes, 2 * 192 * 4);
}

#[test]
fn product_argument_errors() {
    let w = slide_matrix(4, 24, 4, 9);
    let s = Slide::encode(&w, &SlideOptions::default()).unwrap();
    let mut y = vec![0f32; 4];
    assert!(matches!(
        s.matvec(&[0.0; 23], None, &mut y),
        Err(FormatError::Shape { .. })
    ));
    assert!(matches!(
        s.matvec(&[0.0; 24], None, &mut y[..3]),
        Err(FormatError::Shape { .. })
    ));
    assert!(matches!(
        s.matvec(&[0.0; 24], Some(-1.0), &mut y),
        Err(FormatError::Threshold(_))
    ));
    assert!(matches!(
        s.matvec(&[0.0; 24], Some(f32::NAN), &mut y),
        Err(FormatError::Threshold(_))
    ));
    let mut ym = vec![0f32; 8];
    assert!(matches!(
        s.matmul(&[0.0; 47], 2, None, &mut ym),
        Err(FormatError::Shape { .. })
    ));
    assert!(s.lift(&[0.0; 25]).is_err());
}
