//! Tiled-CBC: round trips, layout, storage against SPDP's formula, products, hostile blobs.

mod common;

use proptest::prelude::*;
use sieve_formats::blob::{self, ByteReader, ByteWriter};
use sieve_formats::random::{self, Pattern};
use sieve_formats::reference::{matmul_f64, matvec_f64, max_rel_error};
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::{registry, DenseMatrix, FormatError, FormatKind, WeightFormat};

fn extreme_matrix(rows: usize, cols: usize, zero_fraction: f64, seed: u64) -> DenseMatrix {
    random::extreme_matrix(rows, cols, zero_fraction, seed).expect("finite by construction")
}

fn bits(w: &DenseMatrix) -> Vec<u16> {
    w.bit_patterns()
}

fn check_round_trip(w: &DenseMatrix) {
    let enc = TiledCbc::encode(w).expect("encode");
    assert_eq!(bits(&enc.decode()), bits(w), "decode(encode(W)) != W");
    let blob = enc.to_bytes();
    let back = registry::from_bytes(&blob).expect("from_bytes");
    assert_eq!(back.kind(), FormatKind::TiledCbc);
    assert_eq!(bits(&back.decode()), bits(w), "blob round trip");
    assert_eq!(back.storage(), enc.storage());
    let (_, payload) = blob::unframe(&blob).expect("unframe");
    let direct = TiledCbc::read_payload(&mut ByteReader::new(payload)).expect("read_payload");
    assert_eq!(direct, enc);
}

/// SPDP's storage formula on the padded shape, plus the 16-byte value padding per column.
fn spdp_bytes(w: &DenseMatrix) -> (usize, usize) {
    let (rt, kt) = (w.rows().div_ceil(256), w.cols().div_ceil(16));
    let ngt = rt * kt;
    let nbm = (rt * 256) * (kt * 16) / 64;
    let metadata = 4 * (ngt + 1) + 4 * (ngt * 16) + 8 * nbm;
    let mut values = 0;
    for r in 0..rt {
        for k in 0..w.cols() {
            let nnz = (r * 256..(r * 256 + 256).min(w.rows()))
                .filter(|&m| w.get(m, k).to_bits() != 0)
                .count();
            values += nnz.div_ceil(8) * 8;
        }
    }
    (2 * values, metadata)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn round_trip_unstructured(
        rows in 1usize..700, cols in 1usize..48, sparsity in 0.0f64..0.95, seed in any::<u64>(),
    ) {
        let w = random::sparse_matrix(rows, cols, sparsity, Pattern::Unstructured, seed).unwrap();
        check_round_trip(&w);
        let (payload, metadata) = spdp_bytes(&w);
        let s = TiledCbc::encode(&w).unwrap().storage();
        prop_assert_eq!((s.payload_bytes, s.metadata_bytes), (payload, metadata));
    }

    #[test]
    fn round_trip_n_m(
        rows in 1usize..400, cols in 1usize..70,
        nm in prop_oneof![Just((2usize, 4usize)), Just((1, 4)), Just((6, 8)), Just((4, 8)), Just((1, 16))],
        seed in any::<u64>(),
    ) {
        let w = random::sparse_matrix(rows, cols, 0.0, Pattern::NM { n: nm.0, m: nm.1 }, seed).unwrap();
        check_round_trip(&w);
    }

    #[test]
    fn round_trip_extreme_values(
        rows in 1usize..600, cols in 1usize..40, zeros in 0.0f64..1.0, seed in any::<u64>(),
    ) {
        check_round_trip(&extreme_matrix(rows, cols, zeros, seed));
    }

    #[test]
    fn products_match_reference(
        rows in 1usize..600, cols in 1usize..160, sparsity in 0.0f64..0.95, tokens in 1usize..5,
        dp in prop_oneof![Just(0.0f64), Just(0.3), Just(0.7)], seed in any::<u64>(),
    ) {
        let w = random::sparse_matrix(rows, cols, sparsity, Pattern::Unstructured, seed).unwrap();
        let enc = TiledCbc::encode(&w).unwrap();
        let x = random::activations(cols * tokens, seed ^ 1);
        let t = random::threshold_for_sparsity(&x, dp).unwrap();
        let mut y = vec![f32::NAN; rows];
        enc.matvec(&x[..cols], t, &mut y).unwrap();
        let err = max_rel_error(&y, &matvec_f64(&w, &x[..cols], t));
        prop_assert!(err <= 1e-3, "matvec error {err}");
        let mut yb = vec![f32::NAN; rows * tokens];
        enc.matmul(&x, tokens, t, &mut yb).unwrap();
        let err = max_rel_error(&yb, &matmul_f64(&w, &x, tokens, t));
        prop_assert!(err <= 1e-3, "matmul error {err}");
    }

    #[test]
    fn corrupted_payloads_never_panic(
        rows in 1usize..300, cols in 1usize..40, sparsity in 0.0f64..0.95,
        flips in proptest::collection::vec((any::<usize>(), 0u8..8), 1..4), seed in any::<u64>(),
    ) {
        let w = random::sparse_matrix(rows, cols, sparsity, Pattern::Unstructured, seed).unwrap();
        let enc = TiledCbc::encode(&w).unwrap();
        let mut out = ByteWriter::new();
        enc.write_payload(&mut out);
        prop_assert!(common::flipped_payload_is_safe(FormatKind::TiledCbc, out.into_inner(), &flips));
    }

    #[test]
    fn random_bytes_are_rejected(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        prop_assert!(common::random_bytes_are_safe(FormatKind::TiledCbc, &bytes));
    }
}

#[test]
fn every_truncation_and_bit_flip_is_an_error() {
    let w = random::sparse_matrix(300, 20, 0.6, Pattern::Unstructured, 5).unwrap();
    let blob = TiledCbc::encode(&w).unwrap().to_bytes();
    for len in 0..blob.len() {
        assert!(
            registry::from_bytes(&blob[..len]).is_err(),
            "truncated to {len}"
        );
    }
    // Bytes 14..16 are the frame's reserved field, which `blob::unframe` ignores by design.
    for i in (0..blob.len()).step_by(3).filter(|i| !(14..16).contains(i)) {
        let mut b = blob.clone();
        b[i] ^= 0x10;
        assert!(registry::from_bytes(&b).is_err(), "flip byte {i}");
    }
}

/// Storage and layout on a fixed case, checked against SPDP's formula computed by hand.
#[test]
fn storage_and_layout_by_hand() {
    // M = 300, K = 20: RT = 2, KT = 2, NGT = 4, padded to 512 x 32.
    // Column j (< 20) has j + 1 nonzeros in rows 0..=j (row tile 0); plus W[299][19].
    let mut data = vec![0.0f32; 300 * 20];
    for j in 0..20 {
        for r in 0..=j {
            data[r * 20 + j] = (r * 100 + j + 1) as f32;
        }
    }
    data[299 * 20 + 19] = -3.0;
    let w = DenseMatrix::from_f32(300, 20, &data).unwrap();
    let enc = TiledCbc::encode(&w).unwrap();
    let s = enc.storage();
    // 4 B x (NGT + 1) + 4 B x (NGT x TILE_K) + 8 B x NBM, NBM = 512 x 32 / 64 = 256.
    assert_eq!(s.metadata_bytes, 4 * 5 + 4 * 64 + 8 * 256);
    // NNZ = 1 + 2 + ... + 20 + 1 = 211, 2 B each = 422 B, plus padding to 8 values per column:
    // GTile 0 (cols 0..16, nnz 1..16): 8 x 8 + 8 x 16 = 192 values; GTile 1 (cols 16..20, nnz
    // 17..20): 4 x 24 = 96; GTile 2: 0; GTile 3 (col 19, nnz 1): 8. Total 296 values.
    assert_eq!(s.payload_bytes, 296 * 2);
    assert_eq!(s.payload_bytes - 2 * 211, 85 * 2);
    assert_eq!(enc.tile_offset(), &[0, 192, 288, 288, 296]);
    // ColInfo of GTile 0: offset (upper 16 bits) advances by round8(nnz), nnz in the low bits.
    let mut off = 0;
    for c in 0..16 {
        assert_eq!(
            enc.col_info()[c],
            (off << 16) | (c as u32 + 1),
            "column {c}"
        );
        off += (c as u32 + 1).div_ceil(8) * 8;
    }
    // GTile 1: columns 16..20 (nnz 17..20), then 12 padding columns with nnz 0 at offset 96.
    assert_eq!(
        &enc.col_info()[16..20],
        &[17, (24 << 16) | 18, (48 << 16) | 19, (72 << 16) | 20]
    );
    assert!(enc.col_info()[20..32].iter().all(|&c| c == 96 << 16));
    // Bitmaps of column 2 (nnz 3, rows 0..3): word 0 = 0b111.
    assert_eq!(&enc.bitmaps()[2 * 4..3 * 4], &[0b111, 0, 0, 0]);
    // W[299][19]: GTile 3, column 3, row 299 - 256 = 43 -> word 0 bit 43.
    let ct = 3 * 16 + 3;
    assert_eq!(&enc.bitmaps()[ct * 4..ct * 4 + 4], &[1 << 43, 0, 0, 0]);
    assert_eq!(enc.values()[288].to_f32(), -3.0);
    // Column 1 values (rows 0, 1) at offset 8, then 6 padding zeros.
    assert_eq!(enc.values()[8].to_f32(), 2.0);
    assert_eq!(enc.values()[9].to_f32(), 102.0);
    assert!(enc.values()[10..16].iter().all(|v| v.to_bits() == 0));
    assert_eq!(bits(&enc.decode()), bits(&w));
}

#[test]
fn compression_at_half_sparsity_matches_formula() {
    let w = random::sparse_matrix(1024, 1024, 0.5, Pattern::Unstructured, 3).unwrap();
    let s = TiledCbc::encode(&w).unwrap().storage();
    let formula = 4 * (64 * 4 + 1) + 4 * (256 * 16) + 8 * (1024 * 1024 / 64) + 2 * w.nnz();
    let ratio = s.total_bytes() as f64 / w.dense_bytes() as f64;
    // Padding adds ~3.5 values per 256 x 1 column tile over the formula.
    assert!(s.total_bytes() >= formula && s.total_bytes() < formula + 1024 * 4 * 8 * 2);
    assert!((0.57..0.59).contains(&ratio), "ratio {ratio}");
}

#[test]
fn tiny_shapes_and_argument_errors() {
    for (rows, cols) in [(1, 1), (1, 70), (70, 1), (257, 3), (255, 17), (513, 15)] {
        for z in [0.0, 0.5, 0.99] {
            check_round_trip(&extreme_matrix(rows, cols, z, rows as u64));
        }
        check_round_trip(&DenseMatrix::zeros(rows, cols).unwrap());
    }
    let w = random::sparse_matrix(10, 10, 0.5, Pattern::Unstructured, 1).unwrap();
    let enc = TiledCbc::encode(&w).unwrap();
    let mut y = vec![0f32; 10];
    assert!(matches!(
        enc.matvec(&[0.0; 9], None, &mut y),
        Err(FormatError::Shape { .. })
    ));
    assert!(matches!(
        enc.matvec(&[0.0; 10], Some(-1.0), &mut y),
        Err(FormatError::Threshold(_))
    ));
    assert!(matches!(
        enc.matmul(&[0.0; 10], 1, None, &mut [0f32; 9]),
        Err(FormatError::Shape { .. })
    ));
}

/// Hand-corrupted arrays in a valid frame: each must be a typed error.
#[test]
fn targeted_corruptions_are_rejected() {
    let w = random::sparse_matrix(300, 20, 0.7, Pattern::Unstructured, 9).unwrap();
    let enc = TiledCbc::encode(&w).unwrap();
    #[derive(Clone)]
    struct Parts {
        rows: u64,
        cols: u64,
        tile_offset: Vec<u32>,
        col_info: Vec<u32>,
        bitmaps: Vec<u64>,
        values: Vec<u16>,
    }
    let base = Parts {
        rows: 300,
        cols: 20,
        tile_offset: enc.tile_offset().to_vec(),
        col_info: enc.col_info().to_vec(),
        bitmaps: enc.bitmaps().to_vec(),
        values: enc.value_bits().to_vec(),
    };
    let serialize = |p: &Parts| {
        let mut b = ByteWriter::new();
        b.u64(p.rows);
        b.u64(p.cols);
        b.u32s(&p.tile_offset);
        b.u32s(&p.col_info);
        b.u64s(&p.bitmaps);
        b.u16s(&p.values);
        blob::frame(FormatKind::TiledCbc as u16, &b.into_inner())
    };
    assert!(registry::from_bytes(&serialize(&base)).is_ok());
    // The first padding slot of the first GTile-0 column whose nnz is not a multiple of 8.
    let pad_slot = (0..16)
        .map(|c| base.col_info[c])
        .find(|info| !(info & 0xffff).is_multiple_of(8))
        .map(|info| ((info >> 16) + (info & 0xffff)) as usize)
        .expect("the fixture needs a padded column");
    type Edit = Box<dyn Fn(&mut Parts)>;
    let edits: Vec<(&str, Edit)> = vec![
        ("zero cols", Box::new(|p| p.cols = 0)),
        ("huge shape", Box::new(|p| p.rows = u64::MAX)),
        ("other shape", Box::new(|p| p.rows = 600)),
        ("narrower", Box::new(|p| p.cols = 16)),
        ("nnz != popcount", Box::new(|p| p.col_info[0] += 1)),
        ("bit without nnz", Box::new(|p| p.bitmaps[0] ^= 1 << 63)),
        ("offset skew", Box::new(|p| p.col_info[1] += 1 << 16)),
        // GTile 2 (row tile 1) column 0: word 0 covers rows 256..320, rows 300.. are padding.
        (
            "bit in padding row",
            Box::new(|p| {
                p.bitmaps[2 * 16 * 4] |= 1 << 60;
                p.col_info[32] += 1;
            }),
        ),
        (
            "bit in padding word",
            Box::new(|p| {
                p.bitmaps[2 * 16 * 4 + 1] |= 1;
                p.col_info[32] += 1;
            }),
        ),
        (
            "entries in padding column",
            Box::new(|p| {
                let ct = 16 + 10;
                p.bitmaps[ct * 4] |= 1;
                p.col_info[ct] += 1;
            }),
        ),
        (
            "tile offset decreasing",
            Box::new(|p| p.tile_offset[1] = u32::MAX),
        ),
        ("tile offset not from 0", Box::new(|p| p.tile_offset[0] = 8)),
        (
            "values short",
            Box::new(|p| {
                p.values.pop();
            }),
        ),
        ("NaN value", Box::new(|p| p.values[0] = 0x7e00)),
        ("+0 stored value", Box::new(|p| p.values[0] = 0)),
        (
            "padding value nonzero",
            Box::new(move |p| p.values[pad_slot] = 0x3c00),
        ),
        (
            "col_info short",
            Box::new(|p| {
                p.col_info.pop();
            }),
        ),
        (
            "bitmaps short",
            Box::new(|p| {
                p.bitmaps.pop();
            }),
        ),
    ];
    for (what, edit) in edits {
        let mut p = base.clone();
        edit(&mut p);
        match registry::from_bytes(&serialize(&p)) {
            Err(FormatError::Corrupt(_)) | Err(FormatError::Truncated { .. }) => {}
            other => panic!("{what}: expected a Corrupt error, got {other:?}"),
        }
    }
}
