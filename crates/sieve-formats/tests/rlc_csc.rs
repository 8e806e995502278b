//! RLC-CSC: round trips, layout, storage, products against the f64 reference, hostile blobs.

mod common;

use proptest::prelude::*;
use sieve_formats::blob::{self, ByteReader, ByteWriter};
use sieve_formats::random::{self, Pattern};
use sieve_formats::reference::{matmul_f64, matvec_f64, max_rel_error};
use sieve_formats::rlc_csc::{RlcCsc, RlcCscOptions};
use sieve_formats::{registry, DenseMatrix, FormatError, FormatKind, WeightFormat};

fn opts(index_bits: u32, block_rows: usize) -> RlcCscOptions {
    RlcCscOptions {
        index_bits,
        block_rows,
    }
}

fn extreme_matrix(rows: usize, cols: usize, zero_fraction: f64, seed: u64) -> DenseMatrix {
    random::extreme_matrix(rows, cols, zero_fraction, seed).expect("finite by construction")
}

fn bits(w: &DenseMatrix) -> Vec<u16> {
    w.bit_patterns()
}

/// Encode, decode, serialize and read back; everything must be bit-exact.
fn check_round_trip(w: &DenseMatrix, o: &RlcCscOptions) {
    let enc = RlcCsc::encode(w, o).expect("encode");
    assert_eq!(bits(&enc.decode()), bits(w), "decode(encode(W)) != W");
    let blob = enc.to_bytes();
    let back = registry::from_bytes(&blob).expect("from_bytes");
    assert_eq!(back.kind(), FormatKind::RlcCsc);
    assert_eq!(bits(&back.decode()), bits(w), "blob round trip");
    assert_eq!(back.storage(), enc.storage());
    let (_, payload) = blob::unframe(&blob).expect("unframe");
    let direct = RlcCsc::read_payload(&mut ByteReader::new(payload)).expect("read_payload");
    assert_eq!(direct, enc, "read_payload rebuilds every array");
}

fn block_rows_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![Just(256usize), Just(512), Just(4096)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn round_trip_unstructured(
        rows in 1usize..700, cols in 1usize..48, sparsity in 0.0f64..0.95,
        n in 2u32..=8, block in block_rows_strategy(), seed in any::<u64>(),
    ) {
        let w = random::sparse_matrix(rows, cols, sparsity, Pattern::Unstructured, seed).unwrap();
        check_round_trip(&w, &opts(n, block));
    }

    #[test]
    fn round_trip_n_m(
        rows in 1usize..400, cols in 1usize..70,
        nm in prop_oneof![Just((2usize, 4usize)), Just((1, 4)), Just((6, 8)), Just((4, 8)), Just((1, 16))],
        n in 2u32..=8, seed in any::<u64>(),
    ) {
        let w = random::sparse_matrix(rows, cols, 0.0, Pattern::NM { n: nm.0, m: nm.1 }, seed).unwrap();
        check_round_trip(&w, &opts(n, 256));
    }

    #[test]
    fn round_trip_extreme_values(
        rows in 1usize..600, cols in 1usize..20, zeros in 0.0f64..1.0,
        n in 2u32..=8, block in block_rows_strategy(), seed in any::<u64>(),
    ) {
        check_round_trip(&extreme_matrix(rows, cols, zeros, seed), &opts(n, block));
    }

    #[test]
    fn products_match_reference(
        rows in 1usize..600, cols in 1usize..160, sparsity in 0.0f64..0.95,
        n in 2u32..=8, block in block_rows_strategy(), tokens in 1usize..5,
        dp in prop_oneof![Just(0.0f64), Just(0.3), Just(0.7)], seed in any::<u64>(),
    ) {
        let w = random::sparse_matrix(rows, cols, sparsity, Pattern::Unstructured, seed).unwrap();
        let enc = RlcCsc::encode(&w, &opts(n, block)).unwrap();
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
        rows in 1usize..300, cols in 1usize..12, sparsity in 0.0f64..0.95,
        flips in proptest::collection::vec((any::<usize>(), 0u8..8), 1..4), seed in any::<u64>(),
    ) {
        let w = random::sparse_matrix(rows, cols, sparsity, Pattern::Unstructured, seed).unwrap();
        let enc = RlcCsc::encode(&w, &opts(3, 256)).unwrap();
        let mut out = ByteWriter::new();
        enc.write_payload(&mut out);
        prop_assert!(common::flipped_payload_is_safe(FormatKind::RlcCsc, out.into_inner(), &flips));
    }

    #[test]
    fn random_bytes_are_rejected(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        prop_assert!(common::random_bytes_are_safe(FormatKind::RlcCsc, &bytes));
    }
}

#[test]
fn every_truncation_and_header_bit_flip_is_an_error() {
    let w = random::sparse_matrix(300, 7, 0.6, Pattern::Unstructured, 5).unwrap();
    let blob = RlcCsc::encode(&w, &opts(4, 256)).unwrap().to_bytes();
    for len in 0..blob.len() {
        assert!(
            registry::from_bytes(&blob[..len]).is_err(),
            "truncated to {len}"
        );
    }
    // Bytes 14..16 are the frame's reserved field, which `blob::unframe` ignores by design.
    for i in (0..blob.len()).filter(|i| !(14..16).contains(i)) {
        for bit in [0u8, 3, 7] {
            let mut b = blob.clone();
            b[i] ^= 1 << bit;
            assert!(registry::from_bytes(&b).is_err(), "flip byte {i} bit {bit}");
        }
    }
}

/// Celty's example column [0,0,4,0,0,0,0,2,8] with 2-bit runs. With our rule (a padding entry
/// occupies a zero row) the runs are [2, 3, 0, 0]: rows 2, 2+1+3 = 6, 7, 8.
#[test]
fn celty_example_long_gap_with_two_bit_runs() {
    let col = [0.0f32, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 2.0, 8.0];
    let w = DenseMatrix::from_f32(9, 1, &col).unwrap();
    let enc = RlcCsc::encode(&w, &opts(2, 256)).unwrap();
    assert_eq!(enc.seg_len(), &[4]);
    assert_eq!(enc.seg_start(), &[0, 32]);
    // A 32-entry segment is one slab of one stripe: lane t holds logical entry t at position t.
    let vals: Vec<f32> = enc.values()[..4].iter().map(|v| v.to_f32()).collect();
    assert_eq!(vals, [4.0, 0.0, 2.0, 8.0]);
    let runs: Vec<u32> = (0..4).map(|p| enc.run_at(p)).collect();
    assert_eq!(runs, [2, 3, 0, 0]);
    // Packed LSB first, 2 bits each: 2 | 3 << 2 | 0 | 0.
    assert_eq!(enc.packed_indices()[0], 2 | (3 << 2));
    assert!(enc.values()[4..].iter().all(|v| v.to_bits() == 0));
    assert_eq!(bits(&enc.decode()), bits(&w));

    // A 40-row gap with n = 2 needs floor(40 / 4) = 10 padding entries and a final run of 0;
    // a 43-row gap needs 10 and a final run of 3.
    for (gap, pads, last_run) in [(40usize, 10usize, 0u32), (43, 10, 3)] {
        let mut col = vec![0.0f32; gap + 1];
        col[gap] = -1.5;
        let w = DenseMatrix::from_f32(gap + 1, 1, &col).unwrap();
        let enc = RlcCsc::encode(&w, &opts(2, 256)).unwrap();
        assert_eq!(enc.seg_len(), &[pads as u32 + 1]);
        for p in 0..pads {
            assert_eq!((enc.values()[p].to_bits(), enc.run_at(p)), (0, 3));
        }
        assert_eq!(enc.values()[pads].to_f32(), -1.5);
        assert_eq!(enc.run_at(pads), last_run);
        assert_eq!(bits(&enc.decode()), bits(&w));
    }
}

/// Lane interleaving: lane t owns logical entries t, t+32, ... stored contiguously.
#[test]
fn lane_interleaved_layout() {
    // 300 rows, every entry nonzero and equal to its row + 1: one segment of 300 entries,
    // padded to 320 = one full slab (S = 8) and one slab of S = 2.
    let col: Vec<f32> = (0..300).map(|r| (r + 1) as f32).collect();
    let w = DenseMatrix::from_f32(300, 1, &col).unwrap();
    let enc = RlcCsc::encode(&w, &opts(4, 512)).unwrap();
    assert_eq!(enc.seg_start(), &[0, 320]);
    assert_eq!(enc.seg_len(), &[300]);
    assert_eq!(enc.slab_start(), &[0, 2]);
    assert_eq!(enc.slab_row(), &[0, 256]);
    for t in 0..32 {
        for s in 0..8 {
            assert_eq!(enc.values()[t * 8 + s].to_f32(), (32 * s + t + 1) as f32);
        }
        for s in 0..2 {
            let logical = 256 + 32 * s + t;
            let want = if logical < 300 {
                (logical + 1) as f32
            } else {
                0.0
            };
            assert_eq!(enc.values()[256 + t * 2 + s].to_f32(), want);
        }
    }
    // Every run is 0 (a dense column), including the masked tail entries.
    assert!(enc.packed_indices().iter().all(|&w| w == 0));
    assert_eq!(enc.packed_indices().len(), 320 * 4 / 32);

    // Runs of a full slab with n = 4: lane t's 8 runs are word t, stripe s in bits 4s..4s+4.
    // Rows 2r for r in 0..256 (every other row): each entry has run 1, the first has run 0.
    let col: Vec<f32> = (0..512)
        .map(|r| if r % 2 == 1 { 1.0 } else { 0.0 })
        .collect();
    let w = DenseMatrix::from_f32(512, 1, &col).unwrap();
    let enc = RlcCsc::encode(&w, &opts(4, 512)).unwrap();
    assert_eq!(enc.seg_len(), &[256]);
    for t in 0..32 {
        assert_eq!(enc.packed_indices()[t], 0x1111_1111, "lane {t}");
    }
}

/// Storage on a small fixed case, computed by hand.
#[test]
fn storage_accounting_by_hand() {
    // M = 512, K = 3, B = 256, n = 4. Column 0 dense; column 1 empty; column 2 one nonzero at
    // row 300 = block 1, row 44: gap 44 = 2 * 16 + 12 -> 2 padding entries + 1 entry.
    let mut data = vec![0.0f32; 512 * 3];
    for r in 0..512 {
        data[r * 3] = 0.5;
    }
    data[300 * 3 + 2] = -2.0;
    let w = DenseMatrix::from_f32(512, 3, &data).unwrap();
    let enc = RlcCsc::encode(&w, &opts(4, 256)).unwrap();
    // Segments (b * K + k): [256, 0, 0, 256, 0, 3] entries -> padded [256, 0, 0, 256, 0, 32].
    assert_eq!(enc.seg_len(), &[256, 0, 0, 256, 0, 3]);
    assert_eq!(enc.seg_start(), &[0, 256, 256, 256, 512, 512, 544]);
    assert_eq!(enc.slab_start(), &[0, 1, 1, 1, 2, 2, 3]);
    assert_eq!(enc.slab_row(), &[0, 0, 0]);
    let s = enc.storage();
    // Values: 544 stored entries x 2 B.
    assert_eq!(s.payload_bytes, 544 * 2);
    // Runs: 544 x 4 bits = 272 B; seg_start 7 + seg_len 6 + slab_start 7 u32 = 80 B;
    // slab_row 3 u16 = 6 B.
    assert_eq!(s.metadata_bytes, 272 + 80 + 6);
    assert_eq!(bits(&enc.decode()), bits(&w));
}

/// Celty's number: ~63% of dense bytes for a 50%-sparse 4096 x 4096 layer at n = 4.
#[test]
fn compression_close_to_celty_at_half_sparsity() {
    let w = random::sparse_matrix(4096, 512, 0.5, Pattern::Unstructured, 3).unwrap();
    let enc = RlcCsc::encode(&w, &RlcCscOptions::default()).unwrap();
    let ratio = enc.storage().total_bytes() as f64 / w.dense_bytes() as f64;
    // 0.5 x (2 B value + 0.5 B run) = 62.5%, plus tail padding of ~16 entries per column.
    assert!((0.625..0.64).contains(&ratio), "ratio {ratio}");
}

#[test]
fn invalid_options_and_arguments_are_errors() {
    let w = random::sparse_matrix(10, 10, 0.5, Pattern::Unstructured, 1).unwrap();
    for o in [
        opts(1, 256),
        opts(9, 256),
        opts(4, 0),
        opts(4, 100),
        opts(4, 65536 + 256),
    ] {
        assert!(
            matches!(RlcCsc::encode(&w, &o), Err(FormatError::Option(_))),
            "{o:?}"
        );
    }
    let enc = RlcCsc::encode(&w, &opts(4, 256)).unwrap();
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
        enc.matvec(&[0.0; 10], Some(f32::NAN), &mut y),
        Err(FormatError::Threshold(_))
    ));
    assert!(matches!(
        enc.matmul(&[0.0; 20], 2, None, &mut y),
        Err(FormatError::Shape { .. })
    ));
    let mut empty: Vec<f32> = Vec::new();
    enc.matmul(&[], 0, None, &mut empty).unwrap();
}

#[test]
fn one_by_one_and_tiny_shapes() {
    for (rows, cols) in [(1, 1), (1, 70), (70, 1), (257, 3), (4097, 2)] {
        for z in [0.0, 0.5, 0.99] {
            check_round_trip(
                &extreme_matrix(rows, cols, z, rows as u64),
                &RlcCscOptions::default(),
            );
        }
        let zero = DenseMatrix::zeros(rows, cols).unwrap();
        check_round_trip(&zero, &RlcCscOptions::default());
    }
}

/// Hand-corrupted arrays, serialized with a valid frame: each must be a typed Corrupt error.
#[test]
fn targeted_corruptions_are_rejected() {
    let w = random::sparse_matrix(600, 5, 0.6, Pattern::Unstructured, 9).unwrap();
    let enc = RlcCsc::encode(&w, &opts(2, 256)).unwrap();
    assert!(
        enc.seg_len().last().is_some_and(|l| !l.is_multiple_of(32)),
        "fixture needs a tail"
    );
    struct Parts {
        rows: u64,
        cols: u64,
        n: u32,
        block: u64,
        values: Vec<u16>,
        indices: Vec<u32>,
        seg_start: Vec<u32>,
        seg_len: Vec<u32>,
        slab_start: Vec<u32>,
        slab_row: Vec<u16>,
    }
    let base = Parts {
        rows: 600,
        cols: 5,
        n: 2,
        block: 256,
        values: enc.value_bits().to_vec(),
        indices: enc.packed_indices().to_vec(),
        seg_start: enc.seg_start().to_vec(),
        seg_len: enc.seg_len().to_vec(),
        slab_start: enc.slab_start().to_vec(),
        slab_row: enc.slab_row().to_vec(),
    };
    let serialize = |p: &Parts| {
        let mut b = ByteWriter::new();
        b.u64(p.rows);
        b.u64(p.cols);
        b.u32(p.n);
        b.u64(p.block);
        b.u16s(&p.values);
        b.u32s(&p.indices);
        b.u32s(&p.seg_start);
        b.u32s(&p.seg_len);
        b.u32s(&p.slab_start);
        b.u16s(&p.slab_row);
        blob::frame(FormatKind::RlcCsc as u16, &b.into_inner())
    };
    assert!(
        registry::from_bytes(&serialize(&base)).is_ok(),
        "unmodified parts are valid"
    );
    type Edit = Box<dyn Fn(&mut Parts)>;
    let edits: Vec<(&str, Edit)> = vec![
        ("zero rows", Box::new(|p| p.rows = 0)),
        ("huge rows", Box::new(|p| p.rows = u64::MAX / 2)),
        ("more rows than runs reach", Box::new(|p| p.rows = 1 << 40)),
        ("bad index bits", Box::new(|p| p.n = 9)),
        ("bad block", Box::new(|p| p.block = 100)),
        ("changed block", Box::new(|p| p.block = 512)),
        ("NaN value", Box::new(|p| p.values[0] = 0x7e00)),
        ("inf value", Box::new(|p| p.values[0] = 0x7c00)),
        (
            "run past block end",
            Box::new(|p| p.indices.iter_mut().for_each(|w| *w = u32::MAX)),
        ),
        (
            "short indices",
            Box::new(|p| {
                p.indices.pop();
            }),
        ),
        ("seg_start not from 0", Box::new(|p| p.seg_start[0] = 32)),
        (
            "seg_start decreasing",
            Box::new(|p| p.seg_start[1] = u32::MAX),
        ),
        ("seg_len too long", Box::new(|p| p.seg_len[0] += 32)),
        (
            "seg_len too short",
            Box::new(|p| p.seg_len[0] = p.seg_len[0].saturating_sub(32)),
        ),
        ("slab_start off", Box::new(|p| p.slab_start[1] += 1)),
        (
            "slab cursor wrong",
            Box::new(|p| {
                let n = p.slab_row.len();
                p.slab_row[n - 1] ^= 1;
            }),
        ),
        (
            "tail value nonzero",
            Box::new(|p| {
                let n = p.values.len();
                p.values[n - 1] = 0x3c00;
            }),
        ),
        (
            "tail run nonzero",
            Box::new(|p| {
                let n = p.indices.len();
                p.indices[n - 1] |= 1 << 30;
            }),
        ),
        (
            "missing segment",
            Box::new(|p| {
                p.seg_len.pop();
            }),
        ),
    ];
    for (what, edit) in edits {
        let mut p = Parts {
            values: base.values.clone(),
            indices: base.indices.clone(),
            seg_start: base.seg_start.clone(),
            seg_len: base.seg_len.clone(),
            slab_start: base.slab_start.clone(),
            slab_row: base.slab_row.clone(),
            ..base
        };
        edit(&mut p);
        match registry::from_bytes(&serialize(&p)) {
            Err(FormatError::Corrupt(_)) | Err(FormatError::Truncated { .. }) => {}
            other => panic!("{what}: expected a Corrupt error, got {other:?}"),
        }
    }
}
