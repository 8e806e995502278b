//! The 8-bit KV cache on the GPU against the CPU rule (`sieve_formats::kv_cache`): RoPE's cache
//! write stores the same i8 rows and f32 scales as `quantize_row` (bit for bit, decode, prompt
//! rows and the many-sequences path with a padding row, odd shapes, zero / tie / NaN rows), and
//! attention over an i8 cache (decode, prompt rows with len0 > 0, many sequences) equals the f64
//! reference over the same cache read back (`q * scale`) within f32 rounding, for hd 64 and 128,
//! groups of 1, 3 and 8 query heads and lengths 1, 7, 300 and 2049. Without a GPU each test prints
//! a skip reason and passes, unless `SIEVE_REQUIRE_GPU=1`.

use cudarc::driver::CudaSlice;
use sieve_cuda::attention::{self, reference, AttentionShape, SplitKernel};
use sieve_cuda::prefill::Rows;
use sieve_cuda::{dev_ptr, gpu_or_skip, rope, Gpu, KvCache, L2Span};
use sieve_formats::kv_cache::quantize_row;

use sieve_formats::random::Lcg as Rng;

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Quarter-turn angle tables: every cos and sin is 0 or ±1, so the rotation is exact on the
/// GPU (fused or not) and on the CPU, and the rows the two quantize are the same numbers.
fn quarter_turn_tables(capacity: usize, half: usize) -> (Vec<f32>, Vec<f32>) {
    let turn = |p: usize, i: usize| ((p + 3 * i) % 4) as f32 * std::f32::consts::FRAC_PI_2;
    let table = |f: fn(f32) -> f32| -> Vec<f32> {
        (0..capacity * half)
            .map(|j| f(turn(j / half, j % half)).round())
            .collect()
    };
    (table(f32::cos), table(f32::sin))
}

/// One layer's 8-bit cache on the device (K, V, their scales) of `rows` rows of `hd`.
struct DeviceCache {
    k: CudaSlice<i8>,
    v: CudaSlice<i8>,
    k_scales: CudaSlice<f32>,
    v_scales: CudaSlice<f32>,
}

/// What a cache buffer holds before a write: a byte no row quantizes to on its own, and a
/// scale no row has, so that an untouched row is told from a written one.
const POISON_Q: i8 = -128;
const POISON_SCALE: f32 = -1.0;

impl DeviceCache {
    fn poisoned(gpu: &Gpu, rows: usize, hd: usize) -> Self {
        Self {
            k: gpu.upload(&vec![POISON_Q; rows * hd]).unwrap(),
            v: gpu.upload(&vec![POISON_Q; rows * hd]).unwrap(),
            k_scales: gpu.upload(&vec![POISON_SCALE; rows]).unwrap(),
            v_scales: gpu.upload(&vec![POISON_SCALE; rows]).unwrap(),
        }
    }
    fn of(gpu: &Gpu, k: &(Vec<i8>, Vec<f32>), v: &(Vec<i8>, Vec<f32>)) -> Self {
        Self {
            k: gpu.upload(&k.0).unwrap(),
            v: gpu.upload(&v.0).unwrap(),
            k_scales: gpu.upload(&k.1).unwrap(),
            v_scales: gpu.upload(&v.1).unwrap(),
        }
    }
    fn view(&self, gpu: &Gpu) -> KvCache {
        KvCache::Int8 {
            k: dev_ptr(gpu, &self.k),
            v: dev_ptr(gpu, &self.v),
            k_scales: dev_ptr(gpu, &self.k_scales),
            v_scales: dev_ptr(gpu, &self.v_scales),
        }
    }
    fn download(&self, gpu: &Gpu) -> [(Vec<i8>, Vec<f32>); 2] {
        [
            (
                gpu.download(&self.k).unwrap(),
                gpu.download(&self.k_scales).unwrap(),
            ),
            (
                gpu.download(&self.v).unwrap(),
                gpu.download(&self.v_scales).unwrap(),
            ),
        ]
    }
}

/// The k and v rows one q|k|v row writes at its position: bias added, k rotated by the tables'
/// row (exact with quarter turns), each of the `kv_heads` rows quantized by the CPU rule.
fn expected_rows(
    qkv: &[f32],
    bias: &[f32],
    cos: &[f32],
    sin: &[f32],
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> [(Vec<i8>, Vec<f32>); 2] {
    let x: Vec<f32> = qkv.iter().zip(bias).map(|(a, b)| a + b).collect();
    let mut k = x[heads * hd..(heads + kv_heads) * hd].to_vec();
    for row in k.chunks_mut(hd) {
        rope::reference::rope(row, cos, sin);
    }
    let v = &x[(heads + kv_heads) * hd..];
    let quantize = |rows: &[f32]| {
        let mut q = vec![0i8; rows.len()];
        let scales = rows
            .chunks(hd)
            .zip(q.chunks_mut(hd))
            .map(|(r, qr)| quantize_row(r, qr))
            .collect();
        (q, scales)
    };
    [quantize(&k), quantize(v)]
}

/// Compares the `kv_heads` rows at cache row `cell` (position * Hkv) of K and V with `want`,
/// scales by their bits (NaN matches NaN).
fn assert_rows_equal(
    got: &[(Vec<i8>, Vec<f32>); 2],
    want: &[(Vec<i8>, Vec<f32>); 2],
    cell: usize,
    kv_heads: usize,
    hd: usize,
    what: &str,
) {
    for (which, (g, w)) in ["k", "v"].iter().zip(got.iter().zip(want)) {
        for h in 0..kv_heads {
            let (gs, ws) = (g.1[cell + h], w.1[h]);
            assert!(
                gs.to_bits() == ws.to_bits() || (gs.is_nan() && ws.is_nan()),
                "{what}: {which} scale of KV head {h}: GPU {gs:e}, CPU {ws:e}"
            );
            assert_eq!(
                g.0[(cell + h) * hd..][..hd],
                w.0[h * hd..][..hd],
                "{what}: {which} row of KV head {h}"
            );
        }
    }
}

/// Rows of a q|k|v buffer with the special rows the rule defines: KV head 0's k and v are zero
/// (bias too), and, when `with_nan`, the last KV head's v holds a NaN; the others random, with
/// a few values on exact half steps of their row's grid.
fn qkv_rows(
    rng: &mut Rng,
    n: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    with_nan: bool,
) -> (Vec<f32>, Vec<f32>) {
    let w = (heads + 2 * kv_heads) * hd;
    let mut qkv = rng.vec(n * w, 2.0);
    let mut bias = rng.vec(w, 0.5);
    for kv in [heads, heads + kv_heads] {
        bias[kv * hd..(kv + 1) * hd].fill(0.0);
    }
    for row in qkv.chunks_mut(w) {
        for kv in [heads, heads + kv_heads] {
            row[kv * hd..(kv + 1) * hd].fill(0.0);
        }
        if kv_heads > 1 {
            // A v row whose largest magnitude is 4 (bias 0): 2 lands on 63.5, a tie.
            let v1 = (heads + kv_heads + 1) * hd;
            bias[v1..v1 + hd].fill(0.0);
            row[v1] = -4.0;
            row[v1 + 1] = 2.0;
            row[v1 + 2] = 1.0;
            row[v1 + 3..v1 + hd].iter_mut().for_each(|x| *x *= 0.5);
        }
        if with_nan {
            row[(heads + 2 * kv_heads - 1) * hd + 1] = f32::NAN;
        }
    }
    (qkv, bias)
}

const WRITE_SHAPES: &[(usize, usize, usize)] = &[
    (4, 4, 16),
    (9, 3, 64),
    (6, 2, 96),
    (8, 1, 128),
    (8, 4, 256),
    (3, 3, 10),
    (5, 1, 6),
];

#[test]
fn int8_cache_write_follows_the_cpu_rule() {
    let Some(gpu) = gpu_or_skip("int8_cache_write_follows_the_cpu_rule") else {
        return;
    };
    let mut rng = Rng(0x8b17);
    for &(heads, kv_heads, hd) in WRITE_SHAPES {
        let capacity = 37;
        let half = hd / 2;
        let (cos, sin) = quarter_turn_tables(capacity, half);
        let w = (heads + 2 * kv_heads) * hd;
        let angle = |p: usize| (&cos[p * half..][..half], &sin[p * half..][..half]);
        let pp = |s: &CudaSlice<f32>| dev_ptr(&gpu, s);
        let (cd, sd) = (gpu.upload(&cos).unwrap(), gpu.upload(&sin).unwrap());
        let shape = format!("{heads}/{kv_heads}/{hd}");

        // Decode: one row at position 29.
        let (qkv, bias) = qkv_rows(&mut rng, 1, heads, kv_heads, hd, true);
        let cache = DeviceCache::poisoned(&gpu, capacity * kv_heads, hd);
        let (qkvd, biasd) = (gpu.upload(&qkv).unwrap(), gpu.upload(&bias).unwrap());
        let p = 29;
        let state = gpu.upload(&[p as i32, 0]).unwrap();
        rope::rope_kv(
            &gpu,
            pp(&qkvd),
            pp(&biasd),
            pp(&cd),
            pp(&sd),
            dev_ptr(&gpu, &state),
            cache.view(&gpu),
            heads,
            kv_heads,
            hd,
            L2Span::NONE,
        )
        .unwrap();
        let got = cache.download(&gpu);
        let (c, s) = angle(p);
        let want = expected_rows(&qkv, &bias, c, s, heads, kv_heads, hd);
        assert_rows_equal(
            &got,
            &want,
            p * kv_heads,
            kv_heads,
            hd,
            &format!("rope_kv {shape}"),
        );
        for (q, scales) in &got {
            let untouched = (0..capacity).filter(|&r| r != p).all(|r| {
                q[r * kv_heads * hd..][..kv_heads * hd]
                    .iter()
                    .all(|&b| b == POISON_Q)
                    && scales[r * kv_heads..][..kv_heads]
                        .iter()
                        .all(|&x| x == POISON_SCALE)
            });
            assert!(untouched, "rope_kv {shape}: wrote another position");
        }
        // q heads rotated in place, as the f16 path does.
        let mut want_q: Vec<f32> = qkv.iter().zip(&bias).map(|(a, b)| a + b).collect();
        for row in want_q[..heads * hd].chunks_mut(hd) {
            rope::reference::rope(row, c, s);
        }
        let got_q = gpu.download(&qkvd).unwrap();
        assert!(
            max_abs_diff(&got_q[..heads * hd], &want_q[..heads * hd]) < 1e-6,
            "rope_kv {shape}: q heads"
        );

        // A prompt chunk: 5 rows at positions 3..8.
        let n = 5;
        let first = 3;
        let (qkv, bias) = qkv_rows(&mut rng, n, heads, kv_heads, hd, false);
        let cache = DeviceCache::poisoned(&gpu, capacity * kv_heads, hd);
        let (qkvd, biasd) = (gpu.upload(&qkv).unwrap(), gpu.upload(&bias).unwrap());
        rope::rope_rows(
            &gpu,
            pp(&qkvd),
            pp(&biasd),
            pp(&cd),
            pp(&sd),
            &Rows::Consecutive { first },
            n,
            cache.view(&gpu),
            heads,
            kv_heads,
            hd,
            L2Span::NONE,
        )
        .unwrap();
        let got = cache.download(&gpu);
        for z in 0..n {
            let (c, s) = angle(first + z);
            let want = expected_rows(&qkv[z * w..][..w], &bias, c, s, heads, kv_heads, hd);
            let what = format!("rope_rows {shape} prompt row {z}");
            assert_rows_equal(&got, &want, (first + z) * kv_heads, kv_heads, hd, &what);
        }

        // Many sequences: 3 slots of `capacity` positions; rows at (position, slot), the last
        // a padding row of slot 1, which must write nothing.
        let slots = 3;
        let rows = [(4usize, 2i32), (0, 0), (36, 1), (11, -2)];
        let (qkv, bias) = qkv_rows(&mut rng, rows.len(), heads, kv_heads, hd, false);
        let cache = DeviceCache::poisoned(&gpu, slots * capacity * kv_heads, hd);
        let (qkvd, biasd) = (gpu.upload(&qkv).unwrap(), gpu.upload(&bias).unwrap());
        let seqs: Vec<i32> = rows.iter().flat_map(|&(p, s)| [p as i32, s]).collect();
        let seqsd = gpu.upload(&seqs).unwrap();
        rope::rope_rows(
            &gpu,
            pp(&qkvd),
            pp(&biasd),
            pp(&cd),
            pp(&sd),
            &Rows::Sequences {
                seqs: dev_ptr(&gpu, &seqsd),
                slot_stride: capacity * kv_heads * hd,
            },
            rows.len(),
            cache.view(&gpu),
            heads,
            kv_heads,
            hd,
            L2Span::NONE,
        )
        .unwrap();
        let got = cache.download(&gpu);
        let mut written = Vec::new();
        for (z, &(p, slot)) in rows.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let (c, s) = angle(p);
            let want = expected_rows(&qkv[z * w..][..w], &bias, c, s, heads, kv_heads, hd);
            let cell = (slot as usize * capacity + p) * kv_heads;
            let what = format!("rope_rows {shape} sequence row {z}");
            assert_rows_equal(&got, &want, cell, kv_heads, hd, &what);
            written.push(cell / kv_heads);
        }
        for (q, scales) in &got {
            let untouched = (0..slots * capacity)
                .filter(|r| !written.contains(r))
                .all(|r| {
                    q[r * kv_heads * hd..][..kv_heads * hd]
                        .iter()
                        .all(|&b| b == POISON_Q)
                        && scales[r * kv_heads..][..kv_heads]
                            .iter()
                            .all(|&x| x == POISON_SCALE)
                });
            assert!(
                untouched,
                "rope_rows {shape} sequences: wrote a row of no sequence (a padding row?)"
            );
        }
    }
}

/// Random K and V caches of `rows` rows of `hd`, quantized by the CPU rule; the rows' scales
/// spread over two orders of magnitude as real keys' heads do.
fn random_int8_cache(rng: &mut Rng, rows: usize, hd: usize) -> [(Vec<i8>, Vec<f32>); 2] {
    let mut make = || {
        let mut x = rng.vec(rows * hd, 1.0);
        for (r, row) in x.chunks_mut(hd).enumerate() {
            let magnitude = [0.1f32, 1.0, 3.0, 10.0][r % 4];
            row.iter_mut().for_each(|v| *v *= magnitude);
        }
        reference::quantize_cache(&x, hd)
    };
    [make(), make()]
}

/// f32 rounding of an output of magnitude up to 1 (the f16 cache's attention test allows the
/// same); outputs here reach ~10 (rows scaled up to 10), so the bound scales with them.
const TOL: f32 = 2e-4;

/// Largest difference of `got` from `want`, per head (`hd` values) over that head's magnitude
/// (at least 1): a head whose outputs are small is held to its own scale, not the largest head's.
fn scaled_error(got: &[f32], want: &[f32], hd: usize) -> f32 {
    got.chunks(hd)
        .zip(want.chunks(hd))
        .map(|(g, w)| max_abs_diff(g, w) / w.iter().fold(1f32, |m, x| m.max(x.abs())))
        .fold(0.0, f32::max)
}

#[test]
fn int8_attention_matches_reference() {
    let Some(gpu) = gpu_or_skip("int8_attention_matches_reference") else {
        return;
    };
    let mut rng = Rng(0xa77e);
    for kernel in [SplitKernel::Block, SplitKernel::Warp] {
        for hd in [16usize, 64, 96, 128, 256] {
            for (group, kv_heads) in [(1usize, 3usize), (3, 2), (8, 2)] {
                let heads = group * kv_heads;
                let w = (heads + 2 * kv_heads) * hd;
                for len in [1usize, 7, 300, 2049] {
                    let capacity = len + 3;
                    let shape = AttentionShape::new(&gpu, heads, kv_heads, hd, capacity).unwrap();
                    let shape = AttentionShape { kernel, ..shape };
                    let what = format!(
                        "{kernel:?}: {heads}/{kv_heads}/{hd} len {len} (splits {})",
                        shape.splits
                    );
                    let pp = |s: &CudaSlice<f32>| dev_ptr(&gpu, s);
                    let [k, v] = random_int8_cache(&mut rng, capacity * kv_heads, hd);
                    let (kf, vf) = (
                        reference::dequantize_cache(&k.0, &k.1, hd),
                        reference::dequantize_cache(&v.0, &v.1, hd),
                    );
                    let cache = DeviceCache::of(&gpu, &k, &v);

                    // Decode: the token at len - 1.
                    let qkv = rng.vec(w, 2.0);
                    let qkvd = gpu.upload(&qkv).unwrap();
                    let state = gpu.upload(&[len as i32 - 1, 0]).unwrap();
                    let part = gpu.poisoned_f32(shape.partials_len()).unwrap();
                    let att = gpu.poisoned_f32(heads * hd).unwrap();
                    attention::attention(
                        &gpu,
                        &shape,
                        pp(&qkvd),
                        cache.view(&gpu),
                        dev_ptr(&gpu, &state),
                        pp(&part),
                        pp(&att),
                        // The 8-bit cache's kernels take the span after their scale buffers.
                        L2Span::of(&gpu, &qkvd),
                    )
                    .unwrap();
                    let want = reference::attention(
                        &qkv[..heads * hd],
                        &kf,
                        &vf,
                        len,
                        heads,
                        kv_heads,
                        hd,
                    );
                    let err = scaled_error(&gpu.download(&att).unwrap(), &want, hd);
                    assert!(err < TOL, "decode {what}: max error {err}");

                    // A prompt chunk ending at len - 1: query z at position first + z (len0 > 0).
                    let n = len.min(5);
                    let first = len - n;
                    let qkv = rng.vec(n * w, 2.0);
                    let qkvd = gpu.upload(&qkv).unwrap();
                    let part = gpu.poisoned_f32(n * shape.partials_len()).unwrap();
                    let att = gpu.poisoned_f32(n * heads * hd).unwrap();
                    attention::attention_rows(
                        &gpu,
                        &shape,
                        pp(&qkvd),
                        cache.view(&gpu),
                        pp(&part),
                        pp(&att),
                        &Rows::Consecutive { first },
                        n,
                    )
                    .unwrap();
                    let got = gpu.download(&att).unwrap();
                    for z in 0..n {
                        let q = &qkv[z * w..][..heads * hd];
                        let want =
                            reference::attention(q, &kf, &vf, first + z + 1, heads, kv_heads, hd);
                        let err = scaled_error(&got[z * heads * hd..][..heads * hd], &want, hd);
                        assert!(err < TOL, "prompt row {z} {what}: max error {err}");
                    }
                }
            }
        }
    }
}

#[test]
fn int8_attention_of_many_sequences_matches_reference() {
    let Some(gpu) = gpu_or_skip("int8_attention_of_many_sequences_matches_reference") else {
        return;
    };
    let mut rng = Rng(0x5e95);
    for kernel in [SplitKernel::Block, SplitKernel::Warp] {
        for hd in [16usize, 64, 96, 128, 256] {
            for (group, kv_heads) in [(1usize, 3usize), (3, 2), (8, 2)] {
                let heads = group * kv_heads;
                let w = (heads + 2 * kv_heads) * hd;
                let capacity = 2049 + 3;
                let slots = 3;
                let shape = AttentionShape::new(&gpu, heads, kv_heads, hd, capacity).unwrap();
                let shape = AttentionShape { kernel, ..shape };
                let what = format!(
                    "{kernel:?}: {heads}/{kv_heads}/{hd} (splits {})",
                    shape.splits
                );
                let pp = |s: &CudaSlice<f32>| dev_ptr(&gpu, s);
                let [k, v] = random_int8_cache(&mut rng, slots * capacity * kv_heads, hd);
                let (kf, vf) = (
                    reference::dequantize_cache(&k.0, &k.1, hd),
                    reference::dequantize_cache(&v.0, &v.1, hd),
                );
                let cache = DeviceCache::of(&gpu, &k, &v);
                // (position, slot): lengths 2049, 1, 300, 7, and a padding row over slot 0.
                let rows = [(2048usize, 1i32), (0, 2), (299, 0), (6, 2), (40, -1)];
                let seqs: Vec<i32> = rows.iter().flat_map(|&(p, s)| [p as i32, s]).collect();
                let seqsd = gpu.upload(&seqs).unwrap();
                let n = rows.len();
                let qkv = rng.vec(n * w, 2.0);
                let qkvd = gpu.upload(&qkv).unwrap();
                let part = gpu.poisoned_f32(n * shape.partials_len()).unwrap();
                let att = gpu.poisoned_f32(n * heads * hd).unwrap();
                let slot_stride = capacity * kv_heads * hd;
                attention::attention_rows(
                    &gpu,
                    &shape,
                    pp(&qkvd),
                    cache.view(&gpu),
                    pp(&part),
                    pp(&att),
                    &Rows::Sequences {
                        seqs: dev_ptr(&gpu, &seqsd),
                        slot_stride,
                    },
                    n,
                )
                .unwrap();
                let got = gpu.download(&att).unwrap();
                for (z, &(p, s)) in rows.iter().enumerate() {
                    let slot = if s < 0 { -(s + 1) } else { s } as usize;
                    let (ks, vs) = (
                        &kf[slot * slot_stride..][..slot_stride],
                        &vf[slot * slot_stride..][..slot_stride],
                    );
                    let q = &qkv[z * w..][..heads * hd];
                    let want = reference::attention(q, ks, vs, p + 1, heads, kv_heads, hd);
                    let err = scaled_error(&got[z * heads * hd..][..heads * hd], &want, hd);
                    assert!(
                        err < TOL,
                        "sequence row {z} (slot {s}, position {p}) {what}: max error {err}"
                    );
                }
            }
        }
    }
}
