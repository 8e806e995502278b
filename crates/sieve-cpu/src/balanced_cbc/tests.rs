use super::*;
use crate::test_support::{check_error_of_terms, term_sizes};
use proptest::prelude::*;
use sieve_formats::random::{activations, balanced_matrix, threshold_for_sparsity};
use sieve_formats::reference::{matmul_f64, matvec_f64, max_rel_error};

/// The tolerance of the other fast kernels' tests (`tiled_cbc::rows`): f32 sums in another order stay
/// far inside the reference kernels' own 1e-3, so the fast paths are held to 1e-5.
const TOL: f64 = 1e-5;

const ARRANGEMENTS: [Arrangement; 2] = [Arrangement::Interleaved, Arrangement::Split];

fn check_error(got: &[f32], want: &[f64], what: &str) {
    assert!(got.iter().all(|v| v.is_finite()), "{what}: {got:?}");
    let e = max_rel_error(got, want);
    assert!(e <= TOL, "{what}: error {e}");
}

/// Every SIMD level and arrangement against the f64 reference and the format's own kernel,
/// matvec and batched below and above the GEMM cut, for one matrix and activation draw.
fn check(rows: usize, cols: usize, slots: usize, dp: f64, tokens: usize, seed: u64) {
    let w = balanced_matrix(rows, cols, slots, seed).unwrap();
    let x = activations(cols * tokens, seed ^ 7);
    let t = threshold_for_sparsity(&x, dp).unwrap();
    let want_v = matvec_f64(&w, &x[..cols], t);
    let want_m = matmul_f64(&w, &x, tokens, t);
    let reference = BalancedCbc::encode_with_slots(&w, slots).unwrap();
    let mut ref_v = vec![0f32; rows];
    reference.matvec(&x[..cols], t, &mut ref_v).unwrap();
    let mut ref_m = vec![0f32; rows * tokens];
    reference.matmul(&x, tokens, t, &mut ref_m).unwrap();
    let ref_v: Vec<f64> = ref_v.iter().map(|&v| v as f64).collect();
    let ref_m: Vec<f64> = ref_m.iter().map(|&v| v as f64).collect();
    // Relative to the terms, not the results: one row's sum can cancel to almost nothing.
    let (terms, terms_m) = (
        term_sizes(&w, &x[..cols], 1, t),
        term_sizes(&w, &x, tokens, t),
    );
    for arrangement in ARRANGEMENTS {
        let fast = FastBalancedCbc::with_arrangement(&reference, arrangement);
        for level in SimdLevel::available() {
            let what = format!("{level:?} {arrangement:?} {rows}x{cols} N {slots} dp {dp}");
            let mut y = vec![f32::NAN; rows];
            fast.matvec_with(level, &x[..cols], t, &mut y).unwrap();
            check_error_of_terms(&y, &want_v, &terms, &format!("{what} matvec"));
            let vs = format!("{what} matvec vs BalancedCbc::matvec");
            check_error_of_terms(&y, &ref_v, &terms, &vs);
            let mut ym = vec![f32::NAN; rows * tokens];
            fast.matmul_with(level, &x, tokens, t, &mut ym).unwrap();
            check_error_of_terms(&ym, &want_m, &terms_m, &format!("{what} matmul x{tokens}"));
            let vs = format!("{what} matmul vs BalancedCbc::matmul");
            check_error_of_terms(&ym, &ref_m, &terms_m, &vs);
        }
    }
}

#[test]
fn balanced_every_level_matches_the_reference() {
    // M below one group, not a multiple of 16, several 512-row tiles; N from 1 to 16; every
    // threshold regime (none, half, most and nearly all inputs off); batches below and above
    // the GEMM cut.
    for &(m, k) in &[
        (1, 1),
        (7, 13),
        (16, 33),
        (45, 70),
        (192, 576),
        (300, 40),
        (513, 17),
        (1030, 9),
    ] {
        for (i, &n) in [1, 5, 8, 16, 3, 11].iter().enumerate() {
            for (j, &dp) in [0.0, 0.5, 0.9, 0.99].iter().enumerate() {
                let tokens = [1, 3, 6][(i + j) % 3];
                check(m, k, n, dp, tokens, (m * 1000 + k + 7 * i + j) as u64);
            }
        }
    }
}

#[test]
fn balanced_keeps_the_blob_kind_and_storage() {
    for n in [1, 5, 8, 16] {
        for &(m, k) in &[(600, 96), (45, 7), (512, 3)] {
            let w = balanced_matrix(m, k, n, (m + k + n) as u64).unwrap();
            let reference = BalancedCbc::encode_with_slots(&w, n).unwrap();
            for arrangement in ARRANGEMENTS {
                let fast = FastBalancedCbc::with_arrangement(&reference, arrangement);
                assert_eq!(fast.to_bytes(), reference.to_bytes(), "{m}x{k} N {n}");
                assert_eq!(fast.decode(), w);
                assert_eq!(fast.storage(), reference.storage());
                assert_eq!(fast.kind(), FormatKind::BalancedCbc);
                assert_eq!(fast.slots(), n);
                // A u16 mask and N values per (group of 16 rows, column).
                assert_eq!(fast.cpu_layout_bytes(), 2 * m.div_ceil(16) * k * (n + 1));
            }
        }
    }
    // A matrix sparser than its N (padding slots everywhere) also round-trips.
    let w = balanced_matrix(100, 30, 2, 5).unwrap();
    let reference = BalancedCbc::encode_with_slots(&w, 6).unwrap();
    let fast = FastBalancedCbc::new(&reference);
    assert_eq!(fast.to_bytes(), reference.to_bytes());
    let blob = fast.to_bytes();
    let loaded = crate::format_from_blob(&blob).unwrap();
    assert_eq!(loaded.kind(), FormatKind::BalancedCbc);
    assert_eq!(loaded.to_bytes(), blob);
}

#[test]
fn balanced_negative_zeros_are_kept() {
    let mut data = vec![f16::ZERO; 20 * 40];
    data[3] = f16::NEG_ZERO;
    data[45] = f16::from_f32(1.5);
    data[799] = f16::from_f32(-2.0);
    let w = DenseMatrix::new(20, 40, data).unwrap();
    let reference = BalancedCbc::encode_with_slots(&w, 2).unwrap();
    let fast = FastBalancedCbc::new(&reference);
    assert_eq!(fast.decode(), w);
    assert_eq!(fast.to_bytes(), reference.to_bytes());
}

#[test]
fn balanced_non_finite_activations_reach_only_the_rows_that_store_their_column() {
    let w = balanced_matrix(40, 70, 5, 11).unwrap();
    let reference = BalancedCbc::encode_with_slots(&w, 5).unwrap();
    let mut x = activations(70, 12);
    x[33] = f32::INFINITY;
    x[50] = f32::NAN;
    let mut want = vec![0f32; 40];
    reference.matvec(&x, None, &mut want).unwrap();
    assert!(want.iter().any(|v| v.is_finite()) && want.iter().any(|v| !v.is_finite()));
    for arrangement in ARRANGEMENTS {
        let fast = FastBalancedCbc::with_arrangement(&reference, arrangement);
        for level in SimdLevel::available() {
            let mut y = vec![0f32; 40];
            fast.matvec_with(level, &x, None, &mut y).unwrap();
            for (r, (g, e)) in y.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.is_finite(),
                    e.is_finite(),
                    "{level:?} {arrangement:?} row {r}: {g} vs {e}"
                );
            }
        }
    }
}

#[test]
fn balanced_bad_arguments_are_errors() {
    let w = balanced_matrix(40, 20, 8, 1).unwrap();
    let fast = FastBalancedCbc::new(&BalancedCbc::encode_with_slots(&w, 8).unwrap());
    let mut y = vec![0f32; 40];
    assert!(fast.matvec(&[0.0; 19], None, &mut y).is_err());
    assert!(fast.matvec(&[0.0; 20], None, &mut y[..39]).is_err());
    assert!(fast.matvec(&[0.0; 20], Some(f32::NAN), &mut y).is_err());
    assert!(fast.matmul(&[0.0; 40], 2, None, &mut y).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn balanced_random_shapes_match_the_reference(
        rows in 1usize..70,
        cols in 1usize..300,
        slots in 1usize..=16,
        dp in 0.0f64..1.0,
        tokens in 1usize..7,
        seed in any::<u64>(),
    ) {
        check(rows, cols, slots, dp, tokens, seed);
    }
}

/// `w` with every row snapped onto its int8 grid (what `sieve pack --values int8` stores).
fn snapped(w: &DenseMatrix) -> DenseMatrix {
    let (m, k) = (w.rows(), w.cols());
    let mut v: Vec<f32> = w.data().iter().map(|x| x.to_f32()).collect();
    for row in v.chunks_mut(k.max(1)) {
        sieve_formats::value_grid::snap_row(row).unwrap();
    }
    DenseMatrix::from_f32(m, k, &v).unwrap()
}

/// The 8-bit records of a snapped balanced matrix, every SIMD level against the f64 reference
/// on the decoded matrix and against the f16 records, matvec and batched.
fn check_int8(rows: usize, cols: usize, slots: usize, dp: f64, tokens: usize, seed: u64) {
    let w = snapped(&balanced_matrix(rows, cols, slots, seed).unwrap());
    let x = activations(cols * tokens, seed ^ 7);
    let t = threshold_for_sparsity(&x, dp).unwrap();
    let reference = BalancedCbc::encode_with_slots(&w, slots).unwrap();
    let want_v = matvec_f64(&reference.decode(), &x[..cols], t);
    let want_m = matmul_f64(&w, &x, tokens, t);
    let terms = term_sizes(&w, &x[..cols], 1, t);
    // The batch's outputs cancel like the single vector's: measured against their terms too.
    let terms_m = term_sizes(&w, &x, tokens, t);
    let fast = FastBalancedCbc::with_int8(&reference).expect("a snapped matrix is on its grids");
    assert_eq!(fast.values(), Values::Int8);
    let f16_records = FastBalancedCbc::with_arrangement(&reference, Arrangement::Interleaved);
    let mut ref_v = vec![0f32; rows];
    f16_records
        .matvec_with(SimdLevel::Portable, &x[..cols], t, &mut ref_v)
        .unwrap();
    let ref_v: Vec<f64> = ref_v.iter().map(|&v| v as f64).collect();
    for level in SimdLevel::available() {
        let what = format!("int8 {level:?} {rows}x{cols} N {slots} dp {dp}");
        let mut y = vec![f32::NAN; rows];
        fast.matvec_with(level, &x[..cols], t, &mut y).unwrap();
        check_error_of_terms(&y, &want_v, &terms, &format!("{what} matvec"));
        check_error_of_terms(
            &y,
            &ref_v,
            &terms,
            &format!("{what} matvec vs the f16 records"),
        );
        let mut ym = vec![f32::NAN; rows * tokens];
        fast.matmul_with(level, &x, tokens, t, &mut ym).unwrap();
        check_error_of_terms(&ym, &want_m, &terms_m, &format!("{what} matmul x{tokens}"));
        // Padded records (the layout experiment) give the same products.
        for align in [2, 8] {
            let padded = FastBalancedCbc::with_int8_aligned(&reference, align).unwrap();
            let mut yp = vec![f32::NAN; rows];
            padded.matvec_with(level, &x[..cols], t, &mut yp).unwrap();
            check_error_of_terms(
                &yp,
                &want_v,
                &terms,
                &format!("{what} align {align} matvec"),
            );
            let mut ym = vec![f32::NAN; rows * tokens];
            padded.matmul_with(level, &x, tokens, t, &mut ym).unwrap();
            check_error_of_terms(
                &ym,
                &want_m,
                &terms_m,
                &format!("{what} align {align} matmul x{tokens}"),
            );
        }
    }
}

#[test]
fn int8_every_level_matches_the_reference() {
    for &(m, k) in &[
        (1, 1),
        (7, 13),
        (16, 33),
        (45, 70),
        (192, 576),
        (300, 41),
        (513, 17),
    ] {
        for (i, &n) in [1, 5, 8, 16, 3, 11, 2, 15].iter().enumerate() {
            for (j, &dp) in [0.0, 0.5, 0.9, 0.99].iter().enumerate() {
                let tokens = [1, 3, 6][(i + j) % 3];
                check_int8(m, k, n, dp, tokens, (m * 1000 + k + 7 * i + j) as u64);
            }
        }
    }
}

#[test]
fn int8_records_keep_the_blob_and_halve_the_values() {
    for n in [1, 5, 8, 16] {
        for &(m, k) in &[(600, 96), (45, 7), (512, 3)] {
            let w = snapped(&balanced_matrix(m, k, n, (m + k + n) as u64).unwrap());
            let reference = BalancedCbc::encode_with_slots(&w, n).unwrap();
            let fast = FastBalancedCbc::with_int8(&reference).unwrap();
            assert_eq!(fast.to_bytes(), reference.to_bytes(), "{m}x{k} N {n}");
            assert_eq!(fast.decode(), w);
            assert_eq!(fast.storage(), reference.storage());
            assert_eq!(fast.kind(), FormatKind::BalancedCbc);
            assert_eq!(fast.slots(), n);
            // A u16 mask and N bytes per (group of 16 rows, column).
            assert_eq!(fast.cpu_layout_bytes(), m.div_ceil(16) * k * (n + 2));
        }
    }
}

#[test]
fn int8_detection_accepts_snapped_and_refuses_off_grid_matrices() {
    let w = balanced_matrix(100, 64, 8, 3).unwrap();
    let reference = BalancedCbc::encode_with_slots(&w, 8).unwrap();
    // Random f16 weights are on no int8 grid: the f16 records stay.
    assert!(FastBalancedCbc::with_int8(&reference).is_none());
    let s = snapped(&w);
    assert!(FastBalancedCbc::with_int8(&BalancedCbc::encode_with_slots(&s, 8).unwrap()).is_some());
    // One value off its row's grid (between two grid points) refuses the whole matrix.
    let mut data = s.data().to_vec();
    let at = data
        .iter()
        .position(|v| v.to_f32().abs() > 0.0 && v.to_f32().abs() < 0.5)
        .unwrap();
    data[at] = f16::from_f32(data[at].to_f32() * 1.003);
    let off = DenseMatrix::new(100, 64, data).unwrap();
    assert_ne!(off, s);
    assert!(
        FastBalancedCbc::with_int8(&BalancedCbc::encode_with_slots(&off, 8).unwrap()).is_none()
    );
    // Rows of zeros (scale 0) are on a grid, and their products are zeros.
    let mut data = s.data().to_vec();
    for r in [0, 17, 99] {
        data[r * 64..(r + 1) * 64].fill(f16::ZERO);
    }
    let z = DenseMatrix::new(100, 64, data).unwrap();
    let fast = FastBalancedCbc::with_int8(&BalancedCbc::encode_with_slots(&z, 8).unwrap()).unwrap();
    let x = activations(64, 4);
    let want = matvec_f64(&z, &x, None);
    for level in SimdLevel::available() {
        let mut y = vec![f32::NAN; 100];
        fast.matvec_with(level, &x, None, &mut y).unwrap();
        check_error(&y, &want, &format!("int8 {level:?} zero rows"));
        assert_eq!((y[0], y[17], y[99]), (0.0, 0.0, 0.0));
    }
    // A stored negative zero cannot be rebuilt as 0 · s: f16 records.
    let mut data = s.data().to_vec();
    data[3 * 64 + 5] = f16::NEG_ZERO;
    data[3 * 64 + 6] = f16::ZERO;
    let nz = DenseMatrix::new(100, 64, data).unwrap();
    let nz = BalancedCbc::encode_with_slots(&nz, 16).unwrap();
    assert!(FastBalancedCbc::with_int8(&nz).is_none());
    // `new` picks the 8-bit records unless SIEVE_BCBC_CPU (`CpuKernelOptions`) asks for f16 ones.
    let picked = FastBalancedCbc::new(&BalancedCbc::encode_with_slots(&s, 8).unwrap());
    if crate::options::CpuKernelOptions::global().balanced_cbc
        == crate::options::BalancedCbcRecords::Auto
    {
        assert_eq!(picked.values(), Values::Int8);
    }
    assert_eq!(FastBalancedCbc::new(&reference).values(), Values::F16);
}

/// A 40 x 70 N = 5 matrix (`snap` puts it on integer grids) built by `build` at every level:
/// inputs that are infinite or NaN reach exactly the rows that store their column.
fn check_non_finite_inputs(
    snap: impl Fn(&DenseMatrix) -> DenseMatrix,
    build: impl Fn(&BalancedCbc) -> Option<FastBalancedCbc>,
) {
    let w = snap(&balanced_matrix(40, 70, 5, 11).unwrap());
    let reference = BalancedCbc::encode_with_slots(&w, 5).unwrap();
    let mut x = activations(70, 12);
    x[33] = f32::INFINITY;
    x[50] = f32::NAN;
    let mut want = vec![0f32; 40];
    reference.matvec(&x, None, &mut want).unwrap();
    assert!(want.iter().any(|v| v.is_finite()) && want.iter().any(|v| !v.is_finite()));
    let fast = build(&reference).expect("a snapped matrix is on its grids");
    for level in SimdLevel::available() {
        let mut y = vec![0f32; 40];
        fast.matvec_with(level, &x, None, &mut y).unwrap();
        for (r, (g, e)) in y.iter().zip(&want).enumerate() {
            assert_eq!(
                g.is_finite(),
                e.is_finite(),
                "{level:?} row {r}: {g} vs {e}"
            );
            if e.is_finite() {
                assert!(
                    (g - e).abs() <= 1e-4 * e.abs().max(1.0),
                    "{level:?} row {r}: {g} vs {e}"
                );
            }
        }
    }
}

#[test]
fn int8_non_finite_activations_reach_only_the_rows_that_store_their_column() {
    check_non_finite_inputs(snapped, FastBalancedCbc::with_int8);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn int8_random_shapes_match_the_reference(
        rows in 1usize..70,
        cols in 1usize..300,
        slots in 1usize..=16,
        dp in 0.0f64..1.0,
        tokens in 1usize..7,
        seed in any::<u64>(),
    ) {
        check_int8(rows, cols, slots, dp, tokens, seed);
    }
}

#[test]
fn a_group_equals_one_product_per_matrix_and_checks_its_shapes() {
    // q/k/v-like: different row counts (one below a group, one not a multiple of 16), shared
    // K; f16, 8-bit and 4-bit records mixed.
    let mats: Vec<FastBalancedCbc> = [(37, 8), (12, 5), (200, 3)]
        .iter()
        .enumerate()
        .map(|(i, &(rows, n))| {
            let w = balanced_matrix(rows, 150, n, 60 + i as u64).unwrap();
            let w = match i {
                1 => snapped(&w),
                2 => snapped4(&w, 64),
                _ => w,
            };
            FastBalancedCbc::new(&BalancedCbc::encode_with_slots(&w, n).unwrap())
        })
        .collect();
    assert_eq!(mats[1].values(), Values::Int8);
    assert!(matches!(mats[2].values(), Values::Int4 { .. }));
    let refs: Vec<&FastBalancedCbc> = mats.iter().collect();
    let x = activations(150, 61);
    for t in [None, threshold_for_sparsity(&x, 0.5).unwrap()] {
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; m.rows()]).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
        matvec_group(&refs, &x, t, &mut outs).unwrap();
        for (m, y) in mats.iter().zip(&ys) {
            let mut want = vec![f32::NAN; m.rows()];
            m.matvec(&x, t, &mut want).unwrap();
            assert_eq!(y, &want, "threshold {t:?}");
        }
    }
    let mut short = vec![0f32; 36];
    let mut y1 = vec![0f32; 12];
    let mut y2 = vec![0f32; 200];
    assert!(matvec_group(&refs, &x, None, &mut [&mut short, &mut y1, &mut y2]).is_err());
    assert!(matvec_group(&refs, &x, None, &mut [&mut y1, &mut y2]).is_err());
    assert!(matvec_group(&refs, &x[..149], None, &mut [&mut short, &mut y1, &mut y2]).is_err());
}

/// `w` with every row's groups of `columns` input columns snapped onto 4-bit grids (what
/// `sieve pack --values int4:G` stores).
fn snapped4(w: &DenseMatrix, columns: usize) -> DenseMatrix {
    let (m, k) = (w.rows(), w.cols());
    let mut v: Vec<f32> = w.data().iter().map(|x| x.to_f32()).collect();
    for row in v.chunks_mut(k.max(1)) {
        for run in row.chunks_mut(columns) {
            sieve_formats::value_grid::INT4.snap_row(run).unwrap();
        }
    }
    DenseMatrix::from_f32(m, k, &v).unwrap()
}

/// The 4-bit layouts this CPU can build (quads need AVX-512 VBMI2 and VNNI).
fn int4_layouts() -> Vec<Int4Layout> {
    let mut layouts = vec![Int4Layout::Columns];
    if int4_quads::supported() {
        layouts.push(Int4Layout::Quads);
    }
    layouts
}

/// Whether `fast`'s matrix-vector product at `level` multiplies 8-bit activations (the quads'
/// VNNI kernel).
fn quantizes_activations(fast: &FastBalancedCbc, level: SimdLevel) -> bool {
    matches!(fast.packed, Some(Packed::Int4Quads(_))) && level == SimdLevel::Avx512Vbmi2
}

/// The quads' product (8-bit activations per 32 columns) against the f64 product of the
/// unquantized activations, row by row: each input moves by at most half a step, 1/254 of its
/// block's largest active input, so row `i` may move by `Σ_c |w_ic| · amax_b(c) / 254`, plus
/// f32 rounding of the terms.
fn check_quantized_activations(
    got: &[f32],
    want: &[f64],
    w: &DenseMatrix,
    x: &[f32],
    t: Threshold,
    what: &str,
) {
    let (m, k) = (w.rows(), w.cols());
    let active = |v: f32| v != 0.0 && sieve_formats::format::is_active(v, t);
    let mut amax = vec![0f64; k.div_ceil(32)];
    for (c, &v) in x[..k].iter().enumerate() {
        if active(v) {
            amax[c / 32] = amax[c / 32].max(v.abs() as f64);
        }
    }
    let terms = term_sizes(w, &x[..k], 1, t);
    let scale = terms.iter().fold(1e-6f64, |a, v| a.max(*v));
    for r in 0..m {
        let row = &w.data()[r * k..(r + 1) * k];
        let bound: f64 = row
            .iter()
            .enumerate()
            .filter(|&(c, _)| active(x[c]))
            .map(|(c, v)| v.to_f64().abs() * amax[c / 32] / 254.0)
            .sum();
        let e = (got[r] as f64 - want[r]).abs();
        assert!(
            e <= bound * (1.0 + 1e-6) + TOL * scale,
            "{what}: row {r} off by {e}, bound {bound}"
        );
    }
}

/// The 4-bit records of a snapped balanced matrix in every layout, every SIMD level against
/// the f64 reference on the decoded matrix and against the f16 records, matvec and batched;
/// the quads' VNNI kernel against the f64 product of its own quantized activations.
#[allow(clippy::too_many_arguments)]
fn check_int4(
    rows: usize,
    cols: usize,
    slots: usize,
    columns: usize,
    dp: f64,
    tokens: usize,
    seed: u64,
) {
    let w = snapped4(&balanced_matrix(rows, cols, slots, seed).unwrap(), columns);
    let x = activations(cols * tokens, seed ^ 7);
    let t = threshold_for_sparsity(&x, dp).unwrap();
    let reference = BalancedCbc::encode_with_slots(&w, slots).unwrap();
    let want_v = matvec_f64(&reference.decode(), &x[..cols], t);
    let want_m = matmul_f64(&w, &x, tokens, t);
    let terms = term_sizes(&w, &x[..cols], 1, t);
    // The batch's outputs cancel like the single vector's: measured against their terms too.
    let terms_m = term_sizes(&w, &x, tokens, t);
    let f16_records = FastBalancedCbc::with_arrangement(&reference, Arrangement::Interleaved);
    let mut ref_v = vec![0f32; rows];
    f16_records
        .matvec_with(SimdLevel::Portable, &x[..cols], t, &mut ref_v)
        .unwrap();
    let ref_v: Vec<f64> = ref_v.iter().map(|&v| v as f64).collect();
    for layout in int4_layouts() {
        let fast = FastBalancedCbc::with_int4_layout(&reference, layout)
            .expect("a snapped matrix is on its grids");
        // The widest group size that fits is found: at least the one snapped to.
        let Values::Int4 {
            columns: found,
            layout: built,
        } = fast.values()
        else {
            panic!("not int4: {:?}", fast.values());
        };
        assert_eq!(built, layout);
        assert!(found >= columns || found >= cols, "{found} < {columns}");
        assert_eq!(fast.decode(), w);
        for level in SimdLevel::available() {
            let what =
                format!("int4 {layout:?} {level:?} {rows}x{cols} N {slots} G {columns} dp {dp}");
            let mut y = vec![f32::NAN; rows];
            fast.matvec_with(level, &x[..cols], t, &mut y).unwrap();
            if quantizes_activations(&fast, level) {
                let p = fast.prepare(&x[..cols], t, &[&fast]);
                let Some(Packed::Int4Quads(r)) = &fast.packed else {
                    unreachable!("built as quads");
                };
                let qa = p.quads.as_ref().expect("finite activations");
                let own: Vec<f64> = (0..rows.div_ceil(GROUP))
                    .flat_map(|g| r.quantized_reference(g, qa))
                    .take(rows)
                    .collect();
                let vs = format!("{what} matvec vs its quantized activations");
                check_error_of_terms(&y, &own, &terms, &vs);
                check_quantized_activations(&y, &want_v, &w, &x[..cols], t, &what);
            } else {
                check_error_of_terms(&y, &want_v, &terms, &format!("{what} matvec"));
                let vs = format!("{what} matvec vs the f16 records");
                check_error_of_terms(&y, &ref_v, &terms, &vs);
            }
            let mut ym = vec![f32::NAN; rows * tokens];
            fast.matmul_with(level, &x, tokens, t, &mut ym).unwrap();
            // Small batches run the matrix-vector kernel per token, larger ones the GEMM.
            if tokens < gemm::DECODE_GEMM_MIN_TOKENS && quantizes_activations(&fast, level) {
                for (n, (yt, wt)) in ym.chunks(rows).zip(want_m.chunks(rows)).enumerate() {
                    let xt = &x[n * cols..(n + 1) * cols];
                    let what = format!("{what} matmul x{tokens}, token {n}");
                    check_quantized_activations(yt, wt, &w, xt, t, &what);
                }
            } else {
                let what = format!("{what} matmul x{tokens}");
                check_error_of_terms(&ym, &want_m, &terms_m, &what);
            }
        }
    }
}

#[test]
fn int4_every_level_matches_the_reference() {
    for &(m, k) in &[
        (1, 1),
        (7, 13),
        (16, 33),
        (45, 70),
        (192, 576),
        (300, 41),
        (513, 170),
    ] {
        for (i, &n) in [1, 5, 8, 16, 3, 11, 2, 9].iter().enumerate() {
            for (j, &dp) in [0.0, 0.5, 0.9, 0.99].iter().enumerate() {
                let tokens = [1, 3, 6][(i + j) % 3];
                let columns = [32, 64, 128][(i + 2 * j) % 3];
                check_int4(
                    m,
                    k,
                    n,
                    columns,
                    dp,
                    tokens,
                    (m * 1000 + k + 7 * i + j) as u64,
                );
            }
        }
    }
}

#[test]
fn int4_records_keep_the_blob_and_quarter_the_values() {
    for n in [1, 5, 8, 16] {
        for &(m, k) in &[(600, 96), (45, 7), (512, 130)] {
            let w = snapped4(&balanced_matrix(m, k, n, (m + k + n) as u64).unwrap(), 64);
            let reference = BalancedCbc::encode_with_slots(&w, n).unwrap();
            let fast = FastBalancedCbc::with_int4(&reference).unwrap();
            assert_eq!(fast.to_bytes(), reference.to_bytes(), "{m}x{k} N {n}");
            assert_eq!(fast.decode(), w);
            assert_eq!(fast.storage(), reference.storage());
            assert_eq!(fast.slots(), n);
            let Values::Int4 { columns, .. } = fast.values() else {
                panic!("{m}x{k} N {n}: {:?}", fast.values());
            };
            // Per (group of 16 rows, column) a u16 mask and N nibbles, or per (group, quad of
            // columns) a u64 mask and 4 N nibbles; 16 f16 scales per (group, column group).
            let groups = m.div_ceil(16);
            let records = match fast.values() {
                Values::Int4 {
                    layout: Int4Layout::Columns,
                    ..
                } => k * (2 + n.div_ceil(2)),
                _ => k.div_ceil(4) * (8 + 2 * n),
            };
            assert_eq!(
                fast.cpu_layout_bytes(),
                groups * records + groups * k.div_ceil(columns) * 32,
                "{m}x{k} N {n}"
            );
        }
    }
}

#[test]
fn int4_detection_accepts_snapped_and_refuses_off_grid_matrices() {
    let w = balanced_matrix(100, 200, 8, 3).unwrap();
    let reference = BalancedCbc::encode_with_slots(&w, 8).unwrap();
    // Random f16 weights, and rows on int8 grids, are on no 4-bit grid.
    assert!(FastBalancedCbc::with_int4(&reference).is_none());
    let s8 = BalancedCbc::encode_with_slots(&snapped(&w), 8).unwrap();
    assert!(FastBalancedCbc::with_int4(&s8).is_none());
    assert_eq!(FastBalancedCbc::new(&s8).values(), Values::Int8);
    // Each group size is found as itself (the grids of 32 columns are on no grid of 64).
    for columns in [32, 64, 128] {
        let s = snapped4(&w, columns);
        let enc = BalancedCbc::encode_with_slots(&s, 8).unwrap();
        let fast = FastBalancedCbc::with_int4(&enc).unwrap();
        assert!(matches!(fast.values(), Values::Int4 { columns: c, .. } if c == columns));
        if crate::options::CpuKernelOptions::global().balanced_cbc
            == crate::options::BalancedCbcRecords::Auto
        {
            // `new` picks the per-column records unless asked for quads.
            assert_eq!(
                FastBalancedCbc::new(&enc).values(),
                Values::Int4 {
                    columns,
                    layout: Int4Layout::Columns
                }
            );
        }
    }
    // One value off its grid refuses the whole matrix.
    let s = snapped4(&w, 64);
    let mut data = s.data().to_vec();
    let at = data
        .iter()
        .position(|v| v.to_f32().abs() > 0.0 && v.to_f32().abs() < 0.5)
        .unwrap();
    data[at] = f16::from_f32(data[at].to_f32() * 1.003);
    let off = DenseMatrix::new(100, 200, data).unwrap();
    assert!(
        FastBalancedCbc::with_int4(&BalancedCbc::encode_with_slots(&off, 8).unwrap()).is_none()
    );
    // Rows and groups of zeros (scale 0) are on a grid, and their products are zeros.
    let mut data = s.data().to_vec();
    for r in [0, 17, 99] {
        data[r * 200..(r + 1) * 200].fill(f16::ZERO);
    }
    data[40 * 200 + 64..40 * 200 + 128].fill(f16::ZERO);
    let z = DenseMatrix::new(100, 200, data).unwrap();
    let fast = FastBalancedCbc::with_int4(&BalancedCbc::encode_with_slots(&z, 8).unwrap()).unwrap();
    let x = activations(200, 4);
    let want = matvec_f64(&z, &x, None);
    for level in SimdLevel::available() {
        let mut y = vec![f32::NAN; 100];
        fast.matvec_with(level, &x, None, &mut y).unwrap();
        check_error(&y, &want, &format!("int4 {level:?} zero rows"));
        assert_eq!((y[0], y[17], y[99]), (0.0, 0.0, 0.0));
    }
}

#[test]
fn int4_non_finite_activations_reach_only_the_rows_that_store_their_column() {
    for layout in int4_layouts() {
        check_non_finite_inputs(
            |w| snapped4(w, 32),
            |b| FastBalancedCbc::with_int4_layout(b, layout),
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn int4_random_shapes_match_the_reference(
        rows in 1usize..70,
        cols in 1usize..300,
        slots in 1usize..=16,
        columns in prop_oneof![Just(32usize), Just(64), Just(128)],
        dp in 0.0f64..1.0,
        tokens in 1usize..7,
        seed in any::<u64>(),
    ) {
        check_int4(rows, cols, slots, columns, dp, tokens, seed);
    }
}
