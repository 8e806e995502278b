//! Balanced-CBC: round trips, the block layout read back from the raw device image, storage,
//! products against the f64 reference, hostile blobs.

mod common;

use half::f16;
use proptest::prelude::*;
use sieve_formats::balanced_cbc::{slots_for_sparsity, BalancedCbc};
use sieve_formats::blob::{self, ByteReader, ByteWriter};
use sieve_formats::random::{self, Pattern, SplitMix64};
use sieve_formats::reference::{matmul_f64, matvec_f64, max_rel_error};
use sieve_formats::{registry, DenseMatrix, FormatError, FormatKind, WeightFormat};

/// A random M x K matrix whose every group (16 rows of one column) has at most `n` nonzeros;
/// roughly a quarter of the groups are full, the rest hold a random count.
fn balanced_matrix(rows: usize, cols: usize, n: usize, seed: u64) -> DenseMatrix {
    let mut rng = SplitMix64::new(seed);
    let mut data = vec![f16::ZERO; rows * cols];
    for g0 in (0..rows).step_by(16) {
        let height = 16.min(rows - g0);
        for col in 0..cols {
            let mut idx: Vec<usize> = (0..height).collect();
            rng.shuffle(&mut idx);
            let count = if rng.below(4) == 0 {
                n
            } else {
                rng.below(n + 1)
            };
            for &r in idx.iter().take(count.min(height)) {
                data[(g0 + r) * cols + col] = random::weight_value(&mut rng);
            }
        }
    }
    DenseMatrix::new(rows, cols, data).unwrap()
}

fn bits(w: &DenseMatrix) -> Vec<u16> {
    w.bit_patterns()
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Lanes stored in row tile `rt` of an M-row matrix, from the module documentation.
fn lanes(m: usize, rt: usize) -> usize {
    let rt_count = m.div_ceil(512);
    if rt + 1 < rt_count {
        32
    } else {
        (m - 512 * (rt_count - 1)).div_ceil(16)
    }
}

/// Stored bytes of a block with `l` lanes and `n` slots: `l (2 n + 2)` rounded up to 16.
fn stored(n: usize, l: usize) -> usize {
    (l * (2 * n + 2)).div_ceil(16) * 16
}

/// The image length: `(RT - 1) K (64 N + 64) + K stored(L(RT - 1))`.
fn image_len(m: usize, k: usize, n: usize) -> usize {
    let rt_count = m.div_ceil(512);
    (rt_count - 1) * k * (64 * n + 64) + k * stored(n, lanes(m, rt_count - 1))
}

/// Reads `enc.blocks()` by the layout of the module documentation (independently of the
/// format's own decoder): checks block sizes and lane counts, that every bitmap has exactly N
/// bits, that padding slots are +0 at the lowest rows not holding a nonzero, that fill bytes
/// are zero, and rebuilds W bit-exactly.
fn check_layout(enc: &BalancedCbc, w: &DenseMatrix) {
    let (m, k, n) = (w.rows(), w.cols(), enc.slots());
    let full = 64 * n + 64;
    assert_eq!(enc.block_bytes(), full);
    assert_eq!(enc.row_tiles(), m.div_ceil(512));
    assert_eq!(enc.blocks().len(), image_len(m, k, n));
    let mut data = vec![0u16; m * k];
    for rt in 0..enc.row_tiles() {
        let l = lanes(m, rt);
        assert_eq!(enc.lanes_in_tile(rt), l);
        assert!((1..=32).contains(&l));
        // Every stored lane holds at least one row < M.
        assert!(rt * 512 + (l - 1) * 16 < m);
        let bb = stored(n, l);
        assert_eq!(enc.tile_block_bytes(rt), bb);
        if rt + 1 < enc.row_tiles() {
            assert_eq!(bb, full);
        }
        for col in 0..k {
            let at = rt * k * full + col * bb;
            let block = &enc.blocks()[at..at + bb];
            assert!(
                block[l * (2 * n + 2)..].iter().all(|&b| b == 0),
                "rt {rt} col {col}: fill bytes"
            );
            for lane in 0..l {
                let bitmap = u16_at(block, 2 * l * n + 2 * lane);
                assert_eq!(
                    bitmap.count_ones() as usize,
                    n,
                    "rt {rt} col {col} lane {lane}"
                );
                let slot_value = |i: usize| {
                    if i < n / 2 * 2 {
                        let o = ((i / 2) * l + lane) * 4;
                        let word = u32::from_le_bytes(block[o..o + 4].try_into().unwrap());
                        (word >> (16 * (i % 2))) as u16
                    } else {
                        u16_at(block, (n / 2) * 4 * l + 2 * lane)
                    }
                };
                let row0 = rt * 512 + lane * 16;
                let rows: Vec<usize> = (0..16).filter(|r| bitmap & (1 << r) != 0).collect();
                let mut padding_rows = Vec::new();
                for (i, &r) in rows.iter().enumerate() {
                    let v = slot_value(i);
                    let want = if row0 + r < m {
                        w.get(row0 + r, col).to_bits()
                    } else {
                        0
                    };
                    assert_eq!(v, want, "rt {rt} col {col} lane {lane} slot {i}");
                    if row0 + r < m {
                        data[(row0 + r) * k + col] = v;
                    }
                    if v == 0 {
                        padding_rows.push(r);
                    }
                }
                // Padding: the lowest rows of the group holding +0.
                let zero_rows: Vec<usize> = (0..16)
                    .filter(|&r| row0 + r >= m || w.get(row0 + r, col).to_bits() == 0)
                    .take(padding_rows.len())
                    .collect();
                assert_eq!(padding_rows, zero_rows, "rt {rt} col {col} lane {lane}");
            }
        }
    }
    assert_eq!(data, bits(w), "the raw blocks rebuild W");
}

fn check_round_trip(enc: &BalancedCbc, w: &DenseMatrix) {
    assert_eq!(bits(&enc.decode()), bits(w), "decode(encode(W)) != W");
    check_layout(enc, w);
    let blob = enc.to_bytes();
    let back = registry::from_bytes(&blob).expect("from_bytes");
    assert_eq!(back.kind(), FormatKind::BalancedCbc);
    assert_eq!(bits(&back.decode()), bits(w), "blob round trip");
    assert_eq!(back.storage(), enc.storage());
    let (_, payload) = blob::unframe(&blob).expect("unframe");
    let direct = BalancedCbc::read_payload(&mut ByteReader::new(payload)).expect("read_payload");
    assert_eq!(&direct, enc);
    let s = enc.storage();
    let m = w.rows();
    let stored_lanes = 32 * (enc.row_tiles() - 1) + lanes(m, enc.row_tiles() - 1);
    assert_eq!(s.payload_bytes, stored_lanes * w.cols() * enc.slots() * 2);
    assert!(s.metadata_bytes >= stored_lanes * w.cols() * 2);
    assert_eq!(s.total_bytes(), enc.blocks().len());
}

/// The largest nonzero count of any group, at least 1: what `encode` picks.
fn max_group_count(w: &DenseMatrix) -> usize {
    let mut max = 1;
    for g0 in (0..w.rows()).step_by(16) {
        for col in 0..w.cols() {
            let c = (g0..(g0 + 16).min(w.rows()))
                .filter(|&r| w.get(r, col).to_bits() != 0)
                .count();
            max = max.max(c);
        }
    }
    max
}

fn payload(rows: u64, cols: u64, slots: u64, blocks: &[u8]) -> Vec<u8> {
    let mut b = ByteWriter::new();
    b.u64(rows);
    b.u64(cols);
    b.u64(slots);
    b.buf.extend_from_slice(blocks);
    b.into_inner()
}

fn load(payload: &[u8]) -> sieve_formats::Result<Box<dyn WeightFormat>> {
    registry::from_bytes(&blob::frame(FormatKind::BalancedCbc as u16, payload))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn round_trip_balanced(
        rows in 1usize..1300, cols in 1usize..12, n in 1usize..=16, seed in any::<u64>(),
    ) {
        let w = balanced_matrix(rows, cols, n, seed);
        let enc = BalancedCbc::encode_with_slots(&w, n).unwrap();
        prop_assert_eq!(enc.slots(), n);
        check_round_trip(&enc, &w);
        // The automatic N is the fullest group's count.
        let auto = BalancedCbc::encode(&w).unwrap();
        prop_assert_eq!(auto.slots(), max_group_count(&w));
        prop_assert!(auto.slots() <= n);
        check_round_trip(&auto, &w);
    }

    #[test]
    fn round_trip_unstructured(
        rows in 1usize..1100, cols in 1usize..12, sparsity in 0.0f64..0.99, seed in any::<u64>(),
    ) {
        let w = random::sparse_matrix(rows, cols, sparsity, Pattern::Unstructured, seed).unwrap();
        let enc = BalancedCbc::encode(&w).unwrap();
        prop_assert_eq!(enc.slots(), max_group_count(&w));
        check_round_trip(&enc, &w);
    }

    #[test]
    fn round_trip_extreme_values(
        rows in 1usize..600, cols in 1usize..10, zeros in 0.0f64..1.0, seed in any::<u64>(),
    ) {
        // -0 and subnormals are nonzeros and must come back bit-exact.
        let w = random::extreme_matrix(rows, cols, zeros, seed).unwrap();
        check_round_trip(&BalancedCbc::encode(&w).unwrap(), &w);
    }

    #[test]
    fn over_full_groups_are_refused(
        rows in 1usize..700, cols in 1usize..10, n in 1usize..16, seed in any::<u64>(),
    ) {
        let w = balanced_matrix(rows, cols, 16, seed);
        let need = max_group_count(&w);
        match BalancedCbc::encode_with_slots(&w, n) {
            Ok(enc) => {
                prop_assert!(need <= n);
                check_round_trip(&enc, &w);
            }
            Err(FormatError::Pattern(msg)) => {
                prop_assert!(need > n, "{}", msg);
                prop_assert!(msg.contains("column"), "{}", msg);
            }
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }

    #[test]
    fn products_match_reference(
        rows in 1usize..1100, cols in 1usize..100, n in 1usize..=16, tokens in 1usize..5,
        dp in prop_oneof![Just(0.0f64), Just(0.3), Just(0.7)], seed in any::<u64>(),
    ) {
        let w = balanced_matrix(rows, cols, n, seed);
        let enc = BalancedCbc::encode_with_slots(&w, n).unwrap();
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
        rows in 1usize..700, cols in 1usize..10, n in 1usize..=16,
        flips in proptest::collection::vec((any::<usize>(), 0u8..8), 1..4), seed in any::<u64>(),
    ) {
        let w = balanced_matrix(rows, cols, n, seed);
        let enc = BalancedCbc::encode_with_slots(&w, n).unwrap();
        let mut out = ByteWriter::new();
        enc.write_payload(&mut out);
        prop_assert!(common::flipped_payload_is_safe(FormatKind::BalancedCbc, out.into_inner(), &flips));
    }

    #[test]
    fn random_bytes_are_rejected(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        prop_assert!(common::random_bytes_are_safe(FormatKind::BalancedCbc, &bytes));
    }
}

/// A fixed case checked byte by byte: M = 520 (two row tiles, the second with 8 live rows in
/// its only lane), K = 2, N = 3 (odd: one word per lane plus the tail). Tile 0 blocks are
/// 64 N + 64 = 256 bytes at 0 and 256; tile 1 has L = 1: raw 1 (2 N + 2) = 8 bytes, stored 16,
/// blocks at 512 and 528, 544 bytes in all (the 32-lane layout took 1024).
#[test]
fn layout_by_hand() {
    let (m, k) = (520, 2);
    let mut data = vec![0.0f32; m * k];
    // Column 0, group 0 (rows 0..16): nonzeros at rows 3 and 9 -> one padding slot at row 0.
    data[3 * k] = 1.0;
    data[9 * k] = 2.0;
    // Column 1, group 1 (rows 16..32): rows 16, 17, 31 (full).
    data[16 * k + 1] = 3.0;
    data[17 * k + 1] = 4.0;
    data[31 * k + 1] = -5.0;
    // Column 1, row 519 (row tile 1, lane 0, row 7).
    data[519 * k + 1] = 6.0;
    let w = DenseMatrix::from_f32(m, k, &data).unwrap();
    let enc = BalancedCbc::encode(&w).unwrap();
    assert_eq!(enc.slots(), 3);
    assert_eq!(enc.row_tiles(), 2);
    assert_eq!(enc.block_bytes(), 256);
    assert_eq!((enc.lanes_in_tile(0), enc.lanes_in_tile(1)), (32, 1));
    assert_eq!(
        (enc.tile_block_bytes(0), enc.tile_block_bytes(1)),
        (256, 16)
    );
    assert_eq!(enc.blocks().len(), 2 * 256 + 2 * 16);
    let one = f16::from_f32(1.0).to_bits();
    let b0 = &enc.blocks()[0..256];
    let b1 = &enc.blocks()[256..512];
    let b2 = &enc.blocks()[512..528];
    let b3 = &enc.blocks()[528..544];
    // Block 0 (rt 0, col 0), lane 0: bitmap rows {0, 3, 9}; word 0 = slot0 (+0) | slot1 (1.0)
    // << 16; tail = 2.0.
    assert_eq!(u16_at(b0, 192), 0b10_0000_1001);
    assert_eq!(&b0[0..4], &(u32::from(one) << 16).to_le_bytes());
    assert_eq!(u16_at(b0, 128), f16::from_f32(2.0).to_bits());
    // Lanes without nonzeros pad rows 0, 1, 2.
    assert!((1..32).all(|j| u16_at(b0, 192 + 2 * j) == 0b111));
    // Block 1 (rt 0, col 1), lane 1: rows {0, 1, 15} -> 3.0, 4.0 in word 0, -5.0 in the tail.
    assert_eq!(u16_at(b1, 192 + 2), 0b1000_0000_0000_0011);
    let word =
        u32::from(f16::from_f32(3.0).to_bits()) | (u32::from(f16::from_f32(4.0).to_bits()) << 16);
    assert_eq!(&b1[4..8], &word.to_le_bytes());
    assert_eq!(u16_at(b1, 128 + 2), f16::from_f32(-5.0).to_bits());
    // Block 2 (rt 1, col 0), one lane: word 0 at 0 (padding rows 0, 1), tail at 4 (row 2),
    // bitmap at 2 L N = 6, fill 8..16.
    assert_eq!(b2, &[0, 0, 0, 0, 0, 0, 0b111, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    // Block 3 (rt 1, col 1), lane 0: row 7 plus padding rows 0, 1.
    let six = f16::from_f32(6.0).to_bits().to_le_bytes();
    assert_eq!(
        b3,
        &[
            0,
            0,
            0,
            0,
            six[0],
            six[1],
            0b1000_0011,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0
        ]
    );
    // 2 K 32 + 1 K 1 stored lanes of N slots; the rest is bitmaps and fill.
    assert_eq!(enc.storage().payload_bytes, (2 * 32 + 2) * 3 * 2);
    assert_eq!(enc.storage().metadata_bytes, (2 * 32 + 2) * 2 + 2 * 8);
    check_round_trip(&enc, &w);
}

/// M = 576, K = 3, N = 5: tile 1 has 4 lanes (rows 512..575), raw = stored = 4 (2 N + 2) = 48
/// bytes, at 3 * 384 + 48 k; words at u32 index w * 4 + j, tail at 32 + 2 j, bitmaps at 40 + 2 j.
#[test]
fn layout_by_hand_576_rows() {
    let (m, k) = (576, 3);
    let mut data = vec![0.0f32; m * k];
    // Column 2, lane 3 of tile 1 (rows 560..576): rows 0, 2, 5, 10, 15 (a full group).
    let vals = [1.0f32, 2.0, 3.0, 4.0, 5.0];
    for (&r, &v) in [560usize, 562, 565, 570, 575].iter().zip(&vals) {
        data[r * k + 2] = v;
    }
    let w = DenseMatrix::from_f32(m, k, &data).unwrap();
    let enc = BalancedCbc::encode_with_slots(&w, 5).unwrap();
    assert_eq!((enc.lanes_in_tile(0), enc.lanes_in_tile(1)), (32, 4));
    assert_eq!(enc.block_bytes(), 384);
    assert_eq!(enc.tile_block_bytes(1), 48);
    assert_eq!(enc.blocks().len(), 3 * 384 + 3 * 48);
    let h = |v: f32| u32::from(f16::from_f32(v).to_bits());
    let block = &enc.blocks()[3 * 384 + 2 * 48..3 * 384 + 3 * 48];
    assert_eq!(
        &block[12..16],
        &(h(1.0) | h(2.0) << 16).to_le_bytes(),
        "word 0 lane 3"
    );
    assert_eq!(
        &block[28..32],
        &(h(3.0) | h(4.0) << 16).to_le_bytes(),
        "word 1 lane 3"
    );
    assert_eq!(u16_at(block, 38), h(5.0) as u16, "tail lane 3");
    assert_eq!(u16_at(block, 46), 0b1000_0100_0010_0101, "bitmap lane 3");
    // Lanes 0..3 hold no nonzero: bitmaps pad rows 0..5.
    assert!((0..3).all(|j| u16_at(block, 40 + 2 * j) == 0b1_1111));
    check_round_trip(&enc, &w);
}

/// M = 1000, K = 2, N = 8: tile 1 has 31 lanes (rows 512..1007, rows 1000.. zero rows),
/// raw = 31 * 18 = 558 bytes, stored 560 (2 fill bytes), at 2 * 576 + 560 k.
#[test]
fn layout_by_hand_1000_rows() {
    let (m, k) = (1000, 2);
    let mut data = vec![0.0f32; m * k];
    // Column 1, lane 30 of tile 1 (rows 992..1008): rows 1 (993) and 7 (999).
    data[993 * k + 1] = 8.0;
    data[999 * k + 1] = 9.0;
    let w = DenseMatrix::from_f32(m, k, &data).unwrap();
    let enc = BalancedCbc::encode_with_slots(&w, 8).unwrap();
    assert_eq!((enc.lanes_in_tile(0), enc.lanes_in_tile(1)), (32, 31));
    assert_eq!(enc.block_bytes(), 576);
    assert_eq!(enc.tile_block_bytes(1), 560);
    assert_eq!(enc.blocks().len(), 2 * 576 + 2 * 560);
    let h = |v: f32| u32::from(f16::from_f32(v).to_bits());
    let block = &enc.blocks()[2 * 576 + 560..2 * 576 + 2 * 560];
    // Bitmap rows 0..8 (6 padding rows); slot 1 = row 1, slot 7 = row 7.
    assert_eq!(u16_at(block, 2 * 31 * 8 + 60), 0xff);
    assert_eq!(
        &block[30 * 4..31 * 4],
        &(h(8.0) << 16).to_le_bytes(),
        "word 0"
    );
    let o = (3 * 31 + 30) * 4;
    assert_eq!(&block[o..o + 4], &(h(9.0) << 16).to_le_bytes(), "word 3");
    assert_eq!(&block[558..560], &[0, 0], "fill");
    check_round_trip(&enc, &w);
}

/// The image size for M = 576, K = 64, N = 8 from the formula: one full tile of 64 blocks of
/// 64 N + 64 = 576 bytes, and a 4-lane tile of 64 blocks of 4 (2 N + 2) = 72 -> 80 bytes:
/// 36864 + 5120 = 41984 bytes, against 2 * 64 * 576 = 73728 with 32-lane tiles.
#[test]
fn total_bytes_576_rows() {
    let (m, k, n) = (576, 64, 8);
    let w = balanced_matrix(m, k, n, 3);
    let enc = BalancedCbc::encode_with_slots(&w, n).unwrap();
    let expected = 64 * (64 * n + 64) + 64 * (4 * (2 * n + 2)).next_multiple_of(16);
    assert_eq!(expected, 41984);
    assert_eq!(enc.blocks().len(), expected);
    assert_eq!(enc.storage().total_bytes(), expected);
    assert_eq!(enc.storage().payload_bytes, (32 + 4) * k * n * 2);
    // Plus the 24-byte header (M, K, N) in the payload.
    let mut out = ByteWriter::new();
    enc.write_payload(&mut out);
    assert_eq!(out.into_inner().len(), 24 + expected);
    // k/v-sized: M = 192 is one tile of 12 lanes.
    let w = balanced_matrix(192, k, n, 4);
    let enc = BalancedCbc::encode_with_slots(&w, n).unwrap();
    assert_eq!(enc.lanes_in_tile(0), 12);
    assert_eq!(enc.blocks().len(), 64 * (12 * 18usize).next_multiple_of(16));
    check_round_trip(&enc, &w);
}

#[test]
fn slots_and_shapes() {
    let w = DenseMatrix::zeros(3, 5).unwrap();
    let enc = BalancedCbc::encode(&w).unwrap();
    assert_eq!(enc.slots(), 1, "an all-zero matrix still stores one slot");
    check_round_trip(&enc, &w);
    for n in [0, 17, 100] {
        assert!(matches!(
            BalancedCbc::encode_with_slots(&w, n),
            Err(FormatError::Option(_))
        ));
    }
    // A full 16-row column needs 16 slots.
    let dense = DenseMatrix::from_f32(40, 3, &vec![1.5; 120]).unwrap();
    assert_eq!(BalancedCbc::encode(&dense).unwrap().slots(), 16);
    let err = BalancedCbc::encode_with_slots(&dense, 15).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("column 0") && msg.contains("group 0"), "{msg}");
    // The first offending group is named: column 2, rows 16..32.
    let mut data = vec![0.0f32; 40 * 3];
    for r in 16..20 {
        data[r * 3 + 2] = 1.0;
    }
    let w = DenseMatrix::from_f32(40, 3, &data).unwrap();
    let msg = BalancedCbc::encode_with_slots(&w, 3)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("column 2") && msg.contains("group 1") && msg.contains("16..32"),
        "{msg}"
    );
    assert!(BalancedCbc::encode_with_slots(&w, 4).is_ok());
    for (rows, cols) in [(1, 1), (1, 30), (512, 1), (513, 2), (1024, 3), (511, 4)] {
        for z in [0.0, 0.5, 0.95] {
            let w = random::extreme_matrix(rows, cols, z, rows as u64).unwrap();
            check_round_trip(&BalancedCbc::encode(&w).unwrap(), &w);
        }
    }
    assert_eq!(slots_for_sparsity(0.5).unwrap(), 8);
    assert!(slots_for_sparsity(1.0).is_err());
}

#[test]
fn registry_round_trip_and_default() {
    let w = balanced_matrix(700, 9, 4, 11);
    let p = registry::encode_default(FormatKind::BalancedCbc, &w).unwrap();
    assert_eq!(p.kind(), FormatKind::BalancedCbc);
    let back = registry::from_bytes(&p.to_bytes()).unwrap();
    assert_eq!(bits(&back.decode()), bits(&w));
    assert_eq!(
        FormatKind::from_name("balanced-cbc").unwrap(),
        FormatKind::BalancedCbc
    );
    assert_eq!(FormatKind::from_tag(6).unwrap(), FormatKind::BalancedCbc);
    assert_eq!(FormatKind::BalancedCbc.name(), "balanced-cbc");
}

#[test]
fn every_truncation_and_bit_flip_is_an_error() {
    let w = balanced_matrix(530, 3, 5, 5);
    let blob = BalancedCbc::encode(&w).unwrap().to_bytes();
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

/// Hand-made payloads in a valid frame: each must be a typed error, never a panic or a huge
/// allocation.
#[test]
fn hostile_payloads_are_rejected() {
    let mut data = vec![0.0f32; 520 * 2];
    data[3 * 2] = 1.0;
    data[9 * 2] = 2.0;
    data[519 * 2 + 1] = 6.0;
    let w = DenseMatrix::from_f32(520, 2, &data).unwrap();
    let enc = BalancedCbc::encode_with_slots(&w, 3).unwrap();
    let good = enc.blocks().to_vec();
    assert_eq!(good.len(), 2 * 256 + 2 * 16);
    assert!(load(&payload(520, 2, 3, &good)).is_ok());
    let corrupt = |what: &str, p: Vec<u8>| match load(&p) {
        Err(FormatError::Corrupt(_)) | Err(FormatError::Truncated { .. }) => {}
        other => panic!("{what}: expected Corrupt or Truncated, got {other:?}"),
    };
    type Edit = Box<dyn Fn(&mut Vec<u8>)>;
    let edit = |what: &str, f: Edit| {
        let mut b = good.clone();
        f(&mut b);
        corrupt(what, payload(520, 2, 3, &b));
    };
    // Truncated block image, and too long (trailing bytes).
    corrupt("truncated", payload(520, 2, 3, &good[..good.len() - 1]));
    corrupt("no blocks", payload(520, 2, 3, &[]));
    let mut longer = good.clone();
    longer.push(0);
    corrupt("trailing byte", payload(520, 2, 3, &longer));
    corrupt("header only", payload(520, 2, 3, &[])[..20].to_vec());
    // N out of range.
    corrupt("N = 0", payload(520, 2, 0, &good));
    corrupt("N = 17", payload(520, 2, 17, &good));
    corrupt("N huge", payload(520, 2, u64::MAX, &good));
    // Dims: empty, overflowing, larger than the payload.
    corrupt("zero rows", payload(0, 2, 3, &good));
    corrupt("zero cols", payload(520, 0, 3, &good));
    corrupt("huge rows", payload(u64::MAX, 2, 3, &good));
    corrupt("huge product", payload(1 << 40, 1 << 40, 3, &good));
    corrupt(
        "blocks past the address space",
        payload(1 << 31, (1 << 30) - 1, 16, &good),
    );
    corrupt("more tiles than bytes", payload(1 << 20, 1 << 20, 3, &good));
    corrupt("other shape", payload(1100, 2, 3, &good));
    // Block 0 lane 0 (bitmap at byte 192): bits {0, 3, 9}.
    edit("popcount too low", Box::new(|b| b[192] &= !1));
    edit("popcount too high", Box::new(|b| b[192] |= 0b10));
    edit(
        "empty bitmap",
        Box::new(|b| {
            b[192] = 0;
            b[193] = 0;
        }),
    );
    edit(
        "NaN value",
        Box::new(|b| b[2..4].copy_from_slice(&0x7e00u16.to_le_bytes())),
    );
    edit(
        "infinite value",
        Box::new(|b| b[128..130].copy_from_slice(&0x7c00u16.to_le_bytes())),
    );
    // A nonzero written into the padding slot of block 0 lane 0 (row 0) makes it a real entry:
    // the group {0, 3, 9} is then full, which is canonical, so it loads with the new entry.
    {
        let mut b = good.clone();
        b[0..2].copy_from_slice(&0x3c00u16.to_le_bytes());
        let q = load(&payload(520, 2, 3, &b)).unwrap();
        assert_eq!(q.decode().get(0, 0).to_f32(), 1.0);
    }
    // Padding not at the lowest zero rows: lane 1 of block 0 pads rows {0, 1, 2}; move one to 5.
    edit(
        "padding not lowest",
        Box::new(|b| b[194..196].copy_from_slice(&0b100011u16.to_le_bytes())),
    );
    // Tile 1 has one lane (rows 512..528, rows 520.. >= M); its blocks are 16 bytes at 512
    // (column 0) and 528 (column 1): word 0 at +0, tail at +4, bitmap at +6, fill +8..+16.
    // Block 2 lane 0 pads rows {0, 1, 2}; move the padding to rows {8, 9, 10} (>= M) with a
    // nonzero in slot 0.
    edit(
        "nonzero at rows >= M",
        Box::new(|b| {
            b[512 + 6..512 + 8].copy_from_slice(&0x0700u16.to_le_bytes());
            b[512..512 + 2].copy_from_slice(&0x3c00u16.to_le_bytes());
        }),
    );
    // -0 is a nonzero too, and may not sit at rows >= M either: bitmap {0, 1, 8} with -0 in
    // the tail slot (row 520).
    edit(
        "-0 at rows >= M",
        Box::new(|b| {
            b[512 + 6..512 + 8].copy_from_slice(&0b1_0000_0011u16.to_le_bytes());
            b[512 + 4..512 + 6].copy_from_slice(&0x8000u16.to_le_bytes());
        }),
    );
    // Block 3 lane 0 (rows 512..528): row 7 (519) is live, rows 8.. (>= 520) are not.
    edit(
        "bit at a dead row",
        Box::new(|b| {
            // bitmap {0, 1, 7} -> {0, 1, 8}, the value of row 7 now claims row 520.
            b[528 + 6..528 + 8].copy_from_slice(&0b1_0000_0011u16.to_le_bytes());
        }),
    );
    // Fill bytes must be zero, in every block of the last tile.
    for at in [512 + 8, 512 + 15, 528 + 8, 528 + 15] {
        edit("nonzero fill byte", Box::new(move |b| b[at] = 1));
    }
    // The image length is exact: the old 32-lane length for this shape is refused.
    let mut padded = good.clone();
    padded.resize(4 * 256, 0);
    corrupt("32-lane image length", payload(520, 2, 3, &padded));
    corrupt("one tile's length", payload(512, 2, 3, &good));
}
