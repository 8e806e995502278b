use super::*;
use crate::test_support::{check_error_of_terms, term_sizes};
use crate::tiled_cbc::columns::ColumnTiledCbc;
use proptest::prelude::*;
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::reference::{matmul_f64, matvec_f64, max_rel_error};

/// The tolerance the column layout's tests use: the reference kernels' own is 1e-3; f32 sums
/// in another order stay far inside it, so the fast paths are held to 1e-5 of the largest output.
const TOL: f64 = 1e-5;

fn check_error(got: &[f32], want: &[f64], what: &str) {
    assert!(got.iter().all(|v| v.is_finite()), "{what}: {got:?}");
    let e = max_rel_error(got, want);
    assert!(e <= TOL, "{what}: error {e}");
}

/// Every SIMD level's products against the f64 reference, and the whole product surface
/// (matvec, batched below and above the GEMM cut) for one matrix and activation draw.
fn check(rows: usize, cols: usize, sp: f64, dp: f64, tokens: usize, seed: u64) {
    let w = sparse_matrix(rows, cols, sp, Pattern::Unstructured, seed).unwrap();
    let x = activations(cols * tokens, seed ^ 7);
    let t = threshold_for_sparsity(&x, dp).unwrap();
    let want_v = matvec_f64(&w, &x[..cols], t);
    let want_m = matmul_f64(&w, &x, tokens, t);
    let fast = RowTiledCbc::new(&TiledCbc::encode(&w).unwrap());
    // Relative to the terms, not the results: an output can cancel to almost nothing.
    let terms_v = term_sizes(&w, &x[..cols], 1, t);
    let terms_m = term_sizes(&w, &x, tokens, t);
    for level in SimdLevel::available() {
        let what = format!("{level:?} {rows}x{cols} sp {sp} dp {dp}");
        let mut y = vec![f32::NAN; rows];
        fast.matvec_with(level, &x[..cols], t, &mut y).unwrap();
        check_error_of_terms(&y, &want_v, &terms_v, &format!("{what} matvec"));
        let mut ym = vec![f32::NAN; rows * tokens];
        fast.matmul_with(level, &x, tokens, t, &mut ym).unwrap();
        check_error_of_terms(&ym, &want_m, &terms_m, &format!("{what} matmul x{tokens}"));
    }
}

#[test]
fn every_level_matches_the_f64_reference() {
    // M not a multiple of the row block (and below one), K above one offset segment, a single row or column,
    // empty and full matrices, every threshold regime (none, half, most and nearly all inputs
    // off, so that whole chunks are skipped), batches below and above the GEMM cut.
    for &(m, k) in &[
        (1, 1),
        (7, 13),
        (5, 33),
        (192, 576),
        (300, 40),
        (513, 17),
        (64, 129),
        (3, 1000),
        (40, 2 * SEGMENT + 5),
    ] {
        for (i, &sp) in [0.0, 0.5, 0.7, 0.97, 1.0].iter().enumerate() {
            for (j, &dp) in [0.0, 0.5, 0.9, 0.99].iter().enumerate() {
                let sp = if sp == 1.0 { 0.9999 } else { sp };
                let tokens = [1, 3, 6][(i + j) % 3];
                check(m, k, sp, dp, tokens, (m * 1000 + k + 7 * i + j) as u64);
            }
        }
    }
}

#[test]
fn agrees_with_the_reference_kernel_and_the_column_layout_and_keeps_the_blob() {
    let w = sparse_matrix(600, 96, 0.6, Pattern::Unstructured, 3).unwrap();
    let x = activations(96, 4);
    let t = threshold_for_sparsity(&x, 0.5).unwrap();
    let reference = TiledCbc::encode(&w).unwrap();
    let rows = RowTiledCbc::new(&reference);
    let columns = ColumnTiledCbc::new(reference.clone());
    let (mut a, mut b, mut c) = (vec![0f32; 600], vec![0f32; 600], vec![0f32; 600]);
    reference.matvec(&x, t, &mut a).unwrap();
    rows.matvec(&x, t, &mut b).unwrap();
    columns.matvec(&x, t, &mut c).unwrap();
    let want: Vec<f64> = a.iter().map(|v| *v as f64).collect();
    check_error(&b, &want, "rows against the reference kernel");
    check_error(&c, &want, "columns against the reference kernel");
    assert_eq!(rows.to_bytes(), reference.to_bytes());
    assert_eq!(rows.decode(), w);
    assert_eq!(rows.storage(), reference.storage());
    assert_eq!(rows.kind(), FormatKind::TiledCbc);
    // Values, and a u32 bitmap + u16 offset per (block of 32 rows, column): what decode streams.
    assert_eq!(
        rows.cpu_layout_bytes(),
        2 * w.nnz() + 6 * 600usize.div_ceil(BLOCK) * 96
    );
}

#[test]
fn negative_zeros_are_kept_like_tiled_cbc_keeps_them() {
    let mut data = vec![f16::ZERO; 6 * 40];
    data[3] = f16::NEG_ZERO;
    data[45] = f16::from_f32(1.5);
    data[239] = f16::from_f32(-2.0);
    let w = DenseMatrix::new(6, 40, data).unwrap();
    let reference = TiledCbc::encode(&w).unwrap();
    let rows = RowTiledCbc::new(&reference);
    assert_eq!(rows.decode(), w);
    assert_eq!(rows.to_bytes(), reference.to_bytes());
}

#[test]
fn non_finite_activations_reach_only_the_rows_that_store_their_column() {
    let w = sparse_matrix(40, 70, 0.5, Pattern::Unstructured, 11).unwrap();
    let reference = TiledCbc::encode(&w).unwrap();
    let rows = RowTiledCbc::new(&reference);
    let mut x = activations(70, 12);
    x[33] = f32::INFINITY;
    let mut want = vec![0f32; 40];
    reference.matvec(&x, None, &mut want).unwrap();
    assert!(want.iter().any(|v| v.is_finite()) && want.iter().any(|v| !v.is_finite()));
    for level in SimdLevel::available() {
        let mut y = vec![0f32; 40];
        rows.matvec_with(level, &x, None, &mut y).unwrap();
        for (r, (g, e)) in y.iter().zip(&want).enumerate() {
            assert_eq!(
                g.is_finite(),
                e.is_finite(),
                "{level:?} row {r}: {g} vs {e}"
            );
        }
    }
}

#[test]
fn bad_arguments_are_errors() {
    let w = sparse_matrix(40, 20, 0.5, Pattern::Unstructured, 1).unwrap();
    let rows = RowTiledCbc::new(&TiledCbc::encode(&w).unwrap());
    let mut y = vec![0f32; 40];
    assert!(rows.matvec(&[0.0; 19], None, &mut y).is_err());
    assert!(rows.matvec(&[0.0; 20], None, &mut y[..39]).is_err());
    assert!(rows.matvec(&[0.0; 20], Some(f32::NAN), &mut y).is_err());
    assert!(rows.matmul(&[0.0; 40], 2, None, &mut y).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_shapes_match_the_reference(
        rows in 1usize..70,
        cols in 1usize..300,
        sp in 0.0f64..1.0,
        dp in 0.0f64..1.0,
        tokens in 1usize..7,
        seed in any::<u64>(),
    ) {
        check(rows, cols, sp, dp, tokens, seed);
    }
}
