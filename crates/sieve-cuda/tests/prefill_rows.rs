//! The batched pass's element-wise row kernels (`kernels/prefill.cu`: RMSNorm, the masked f16
//! conversion of a GEMM input, SwiGLU, the embedding gather, zeroing) against the CPU on widths
//! that take their 16-byte path (multiples of 4 on aligned rows) and their one-column path (odd
//! widths, rows starting one float off alignment), with NaN canaries around what each may write.
//! Without a GPU each test prints a skip reason and passes, unless `SIEVE_REQUIRE_GPU=1`.

use half::f16;
use sieve_cuda::prefill::{embed_rows, rmsnorm_rows, rows_to_f16, silu_rows, zero_rows};
use sieve_cuda::{dev_ptr, gpu_or_skip, L2Span};
use sieve_formats::random::Lcg as Rng;

/// (rows, width, row stride, offset of the first row in floats): aligned and vectorizable, odd
/// widths, strides wider than the rows, a first row one float past 16-byte alignment, and
/// aligned input rows whose f16 output rows are not 8-byte aligned (width 6).
const SHAPES: &[(usize, usize, usize, usize)] = &[
    (3, 4096, 4096, 0),
    (5, 1028, 1032, 0),
    (2, 4099, 4101, 0),
    (4, 64, 68, 1),
    (1, 3, 3, 0),
    (7, 2050, 2052, 1),
    (2, 6, 8, 0),
];

fn f16_bits(v: f32) -> u16 {
    f16::from_f32(v).to_bits()
}

#[test]
fn row_kernels_match_the_cpu() {
    let Some(gpu) = gpu_or_skip("row_kernels_match_the_cpu") else {
        return;
    };
    let mut rng = Rng(7);
    for &(n, k, ld, off) in SHAPES {
        let what = format!("{n} rows of {k}, stride {ld}, offset {off}");
        let len = off + n * ld + 4;
        let x = rng.vec(len, 3.0);
        let xd = gpu.upload(&x).unwrap();
        let x0 = dev_ptr(&gpu, &xd) + (off * 4) as u64;

        // rows_to_f16 under a threshold and without one; the output rows are k apart.
        for t in [None, Some(0.7f32)] {
            let out = gpu.upload(&vec![0xffffu16; n * k + 5]).unwrap();
            rows_to_f16(&gpu, x0, ld, dev_ptr(&gpu, &out), n, k, t).unwrap();
            let got = gpu.download(&out).unwrap();
            for r in 0..n {
                for c in 0..k {
                    let v = x[off + r * ld + c];
                    let v = match t {
                        Some(t) if v.abs() <= t => 0.0,
                        _ => v,
                    };
                    assert_eq!(got[r * k + c], f16_bits(v), "{what}, t {t:?}: ({r}, {c})");
                }
            }
            assert!(
                got[n * k..].iter().all(|&b| b == 0xffff),
                "{what}: wrote past the rows"
            );
        }

        // RMSNorm reads rows of k packed one after another (its stride is its width).
        let w = rng.vec(k, 1.0);
        let wd = gpu.upload(&w).unwrap();
        let out = gpu.poisoned_f32(off + n * k + 4).unwrap();
        let o0 = dev_ptr(&gpu, &out) + (off * 4) as u64;
        // A span to prefetch (the norm's own weights) is a hint: the result is the same.
        rmsnorm_rows(
            &gpu,
            x0,
            dev_ptr(&gpu, &wd),
            o0,
            n,
            k,
            1e-5,
            L2Span::of(&gpu, &wd),
        )
        .unwrap();
        let got = gpu.download(&out).unwrap();
        for r in 0..n {
            let row = &x[off + r * k..off + (r + 1) * k];
            let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
            let scale = 1.0 / (ss / k as f64 + 1e-5).sqrt();
            for c in 0..k {
                let want = row[c] as f64 * scale * w[c] as f64;
                let g = got[off + r * k + c] as f64;
                assert!(
                    (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{what}: norm ({r}, {c}) {g} against {want}"
                );
            }
        }
        assert!(
            got[..off].iter().all(|v| v.is_nan()),
            "{what}: norm wrote before the rows"
        );
        assert!(
            got[off + n * k..].iter().all(|v| v.is_nan()),
            "{what}: norm wrote past the rows"
        );

        // SwiGLU over rows [gate | up] of 2k.
        let gu = rng.vec(off + n * 2 * k + 4, 4.0);
        let gud = gpu.upload(&gu).unwrap();
        silu_rows(
            &gpu,
            dev_ptr(&gpu, &gud) + (off * 4) as u64,
            n,
            k,
            L2Span::of(&gpu, &gud).capped(1000),
        )
        .unwrap();
        let got = gpu.download(&gud).unwrap();
        for r in 0..n {
            let base = off + r * 2 * k;
            for c in 0..k {
                let (g, u) = (gu[base + c] as f64, gu[base + k + c] as f64);
                let want = g / (1.0 + (-g).exp()) * u;
                let v = got[base + c] as f64;
                assert!(
                    (v - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{what}: silu ({r}, {c}) {v} against {want}"
                );
                assert_eq!(got[base + k + c], gu[base + k + c], "{what}: up changed");
            }
        }
        assert_eq!(got[..off], gu[..off], "{what}: silu wrote before the rows");
        assert_eq!(
            got[off + n * 2 * k..],
            gu[off + n * 2 * k..],
            "{what}: silu wrote past"
        );

        // Zeroing n rows of k, ld apart: nothing between or around them changes.
        let yd = gpu.upload(&x).unwrap();
        zero_rows(&gpu, dev_ptr(&gpu, &yd) + (off * 4) as u64, ld, n, k).unwrap();
        let got = gpu.download(&yd).unwrap();
        for (i, (&g, &orig)) in got.iter().zip(&x).enumerate() {
            let in_row = i >= off && (i - off) / ld < n && (i - off) % ld < k;
            assert_eq!(g, if in_row { 0.0 } else { orig }, "{what}: zero at {i}");
        }

        // The embedding gather: tokens repeat and come in any order.
        let vocab = 5;
        let table: Vec<u16> = rng
            .vec(vocab * k, 2.0)
            .iter()
            .map(|&v| f16_bits(v))
            .collect();
        let tokens: Vec<i32> = (0..n).map(|r| ((r * 3 + 2) % vocab) as i32).collect();
        let (td, tokd) = (gpu.upload(&table).unwrap(), gpu.upload(&tokens).unwrap());
        let out = gpu.poisoned_f32(off + n * k + 4).unwrap();
        let o0 = dev_ptr(&gpu, &out) + (off * 4) as u64;
        embed_rows(&gpu, dev_ptr(&gpu, &td), dev_ptr(&gpu, &tokd), o0, n, k).unwrap();
        let got = gpu.download(&out).unwrap();
        for (r, &tok) in tokens.iter().enumerate() {
            for c in 0..k {
                let want = f16::from_bits(table[tok as usize * k + c]).to_f32();
                assert_eq!(got[off + r * k + c], want, "{what}: embed ({r}, {c})");
            }
        }
        assert!(
            got[..off]
                .iter()
                .chain(&got[off + n * k..])
                .all(|v| v.is_nan()),
            "{what}: embed wrote outside its rows"
        );
    }
}

/// More rows than a grid has rows (65,535): the kernels loop over the rest.
#[test]
fn row_kernels_take_more_rows_than_a_grid() {
    let Some(gpu) = gpu_or_skip("row_kernels_take_more_rows_than_a_grid") else {
        return;
    };
    let (n, m, ld) = (70_000usize, 4usize, 5usize);
    let y = vec![2.5f32; n * ld];
    let yd = gpu.upload(&y).unwrap();
    zero_rows(&gpu, dev_ptr(&gpu, &yd), ld, n, m).unwrap();
    let got = gpu.download(&yd).unwrap();
    for (i, &g) in got.iter().enumerate() {
        assert_eq!(g, if i % ld < m { 0.0 } else { 2.5 }, "zero_rows at {i}");
    }
    let gu: Vec<f32> = (0..n * 2 * m).map(|i| (i % 7) as f32 - 3.0).collect();
    let gud = gpu.upload(&gu).unwrap();
    silu_rows(&gpu, dev_ptr(&gpu, &gud), n, m, L2Span::NONE).unwrap();
    let got = gpu.download(&gud).unwrap();
    for r in [0, 65_534, 65_535, n - 1] {
        for c in 0..m {
            let (g, u) = (gu[r * 2 * m + c] as f64, gu[r * 2 * m + m + c] as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            let v = got[r * 2 * m + c] as f64;
            assert!(
                (v - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "silu row {r}"
            );
        }
    }
}

#[test]
fn zero_rows_launch_nothing() {
    let Some(gpu) = gpu_or_skip("zero_rows_launch_nothing") else {
        return;
    };
    let x = vec![1.5f32; 64];
    let xd = gpu.upload(&x).unwrap();
    let p = dev_ptr(&gpu, &xd);
    zero_rows(&gpu, p, 16, 0, 16).unwrap();
    silu_rows(&gpu, p, 0, 16, L2Span::NONE).unwrap();
    rmsnorm_rows(&gpu, p, p, p, 0, 16, 1e-5, L2Span::NONE).unwrap();
    rows_to_f16(&gpu, p, 16, p, 0, 16, None).unwrap();
    embed_rows(&gpu, p, p, p, 0, 16).unwrap();
    assert_eq!(gpu.download(&xd).unwrap(), x, "a launch over 0 rows wrote");
}

/// RoPE over the rows of a batched pass with the f16 cache (`rope_rows`, one rotated pair per
/// thread across heads): q heads rotated in place, k rotated and v copied to their cache cells
/// as f16, for consecutive prompt rows and for one row per sequence with a padding row that
/// writes no cache; k and v in the rows themselves unchanged, every other cell untouched.
#[test]
fn f16_rope_rows_match_the_cpu() {
    use sieve_cuda::prefill::Rows;
    use sieve_cuda::rope::{self, reference};
    use sieve_cuda::KvCache;
    let Some(gpu) = gpu_or_skip("f16_rope_rows_match_the_cpu") else {
        return;
    };
    const NAN_F16: u16 = 0x7e00;
    let mut rng = Rng(0x5eed);
    for &(heads, kv_heads, hd) in &[
        (4usize, 2usize, 64usize),
        (7, 1, 128),
        (3, 3, 6),
        (32, 8, 128),
    ] {
        let (half, capacity, slots) = (hd / 2, 40usize, 3usize);
        let w = (heads + 2 * kv_heads) * hd;
        let (cos, sin) = (rng.vec(capacity * half, 1.0), rng.vec(capacity * half, 1.0));
        let bias = rng.vec(w, 0.5);
        let (cd, sd, bd) = (
            gpu.upload(&cos).unwrap(),
            gpu.upload(&sin).unwrap(),
            gpu.upload(&bias).unwrap(),
        );
        for by_sequence in [false, true] {
            let what = format!("{heads}/{kv_heads}/{hd}, by sequence {by_sequence}");
            // (position, slot); slot -(s + 1) marks a padding row of slot s.
            let rows: Vec<(usize, i32)> = if by_sequence {
                vec![(4, 2), (0, 0), (39, 1), (11, -2)]
            } else {
                (0..6).map(|z| (5 + z, 0)).collect()
            };
            let n = rows.len();
            let qkv = rng.vec(n * w, 2.0);
            let qkvd = gpu.upload(&qkv).unwrap();
            let cache_len = slots * capacity * kv_heads * hd;
            let kd = gpu.upload(&vec![NAN_F16; cache_len]).unwrap();
            let vd = gpu.upload(&vec![NAN_F16; cache_len]).unwrap();
            let seqs: Vec<i32> = rows.iter().flat_map(|&(p, s)| [p as i32, s]).collect();
            let seqsd = gpu.upload(&seqs).unwrap();
            let which = if by_sequence {
                Rows::Sequences {
                    seqs: dev_ptr(&gpu, &seqsd),
                    slot_stride: capacity * kv_heads * hd,
                }
            } else {
                Rows::Consecutive { first: 5 }
            };
            let cache = KvCache::F16 {
                k: dev_ptr(&gpu, &kd),
                v: dev_ptr(&gpu, &vd),
            };
            rope::rope_rows(
                &gpu,
                dev_ptr(&gpu, &qkvd),
                dev_ptr(&gpu, &bd),
                dev_ptr(&gpu, &cd),
                dev_ptr(&gpu, &sd),
                &which,
                n,
                cache,
                heads,
                kv_heads,
                hd,
                L2Span::of(&gpu, &cd),
            )
            .unwrap();
            let got_rows = gpu.download(&qkvd).unwrap();
            let (got_k, got_v) = (gpu.download(&kd).unwrap(), gpu.download(&vd).unwrap());
            let close = |g: f32, want: f32, tol: f32| (g - want).abs() <= tol * (1.0 + want.abs());
            let mut want_k = vec![None; cache_len];
            let mut want_v = vec![None; cache_len];
            for (z, &(p, slot)) in rows.iter().enumerate() {
                let row: Vec<f32> = qkv[z * w..][..w]
                    .iter()
                    .zip(&bias)
                    .map(|(a, b)| a + b)
                    .collect();
                let (c, s) = (&cos[p * half..][..half], &sin[p * half..][..half]);
                for h in 0..heads {
                    let mut q = row[h * hd..][..hd].to_vec();
                    reference::rope(&mut q, c, s);
                    for (i, &want) in q.iter().enumerate() {
                        let g = got_rows[z * w + h * hd + i];
                        assert!(
                            close(g, want, 1e-5),
                            "{what}: row {z} q head {h}[{i}] {g} against {want}"
                        );
                    }
                }
                assert_eq!(
                    got_rows[z * w + heads * hd..(z + 1) * w],
                    qkv[z * w + heads * hd..(z + 1) * w],
                    "{what}: row {z}'s k and v changed in the rows"
                );
                if slot < 0 {
                    continue;
                }
                for kh in 0..kv_heads {
                    let mut k = row[(heads + kh) * hd..][..hd].to_vec();
                    reference::rope(&mut k, c, s);
                    let v = &row[(heads + kv_heads + kh) * hd..][..hd];
                    let cell = (slot as usize * capacity + p) * kv_heads * hd + kh * hd;
                    for i in 0..hd {
                        want_k[cell + i] = Some(k[i]);
                        want_v[cell + i] = Some(v[i]);
                    }
                }
            }
            for (name, got, want) in [("k", &got_k, &want_k), ("v", &got_v, &want_v)] {
                for (i, (&g, want)) in got.iter().zip(want).enumerate() {
                    match want {
                        Some(want) => {
                            let g = f16::from_bits(g).to_f32();
                            assert!(
                                close(g, *want, 2e-3),
                                "{what}: {name} cache [{i}] {g} against {want}"
                            );
                        }
                        None => assert_eq!(g, NAN_F16, "{what}: {name} cache [{i}] written"),
                    }
                }
            }
        }
    }
}
