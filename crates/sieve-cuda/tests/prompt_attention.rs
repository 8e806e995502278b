//! The tensor-core prompt attention (`prompt_attention`, flash-attention 2) against the f64
//! reference (`attention::reference::attention`), over the f16 cache and the 8-bit one: prompt
//! chunks of 1, 15, 16, 17, 127 and 300 rows, from position 0 and after earlier tokens
//! (len0 > 0), hd 64, 96 and 128, groups of 1, 4 and 8 query heads per KV head. The cache rows past
//! the chunk hold NaN (f16) or NaN scales (8-bit), and the output has a NaN row past the last,
//! so that a read of a key the rows may not see, or a write past `n`, shows. Also: `attention_rows` takes the kernel from `MIN_ROWS` rows and its
//! output matches the split kernel's; unsupported shapes are typed errors. Without a GPU each
//! test prints a skip reason and passes, unless `SIEVE_REQUIRE_GPU=1`.

use cudarc::driver::CudaSlice;
use half::f16;
use sieve_cuda::attention::{self, reference, AttentionShape};
use sieve_cuda::prefill::Rows;
use sieve_cuda::prompt_attention::{self, prompt_attention, prompt_attention_split};
use sieve_cuda::{dev_ptr, gpu_or_skip, CudaError, Gpu, KvCache};
use sieve_formats::kv_cache::quantize_row;

use sieve_formats::random::Lcg as Rng;

fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Largest difference per head (`hd` values) over that head's magnitude (at least 1).
fn scaled_error(got: &[f32], want: &[f32], hd: usize) -> f32 {
    got.chunks(hd)
        .zip(want.chunks(hd))
        .map(|(g, w)| {
            let d = g
                .iter()
                .zip(w)
                .map(|(x, y)| (x - y).abs())
                .fold(
                    0.0,
                    |m: f32, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
                );
            d / w.iter().fold(1f32, |m, x| m.max(x.abs()))
        })
        .fold(0.0, f32::max)
}

/// The kernel rounds q and the probabilities to f16 (f32 accumulation); the reference is given
/// the f16-rounded q, so what remains is the probabilities' rounding (2^-11 relative) summed
/// over the keys: a few 1e-4 on outputs of magnitude up to 1.
const TOL: f32 = 3e-3;

/// One layer's cache on the device: `valid` rows of random values (`[pos][Hkv][hd]`), then
/// `extra` rows of NaN (f16) or of NaN scales (8-bit); and the f32 values the reference reads.
struct Cache {
    k: CudaSlice<f16>,
    v: CudaSlice<f16>,
    kf: Vec<f32>,
    vf: Vec<f32>,
    /// What the split kernel reads: `kf`, `vf` for the f16 cache; int * scale unrounded for
    /// the 8-bit one.
    kx: Vec<f32>,
    vx: Vec<f32>,
    int8: Option<Int8Cache>,
}

/// The 8-bit cache's rows and scales (`[pos][Hkv]`).
struct Int8Cache {
    k: CudaSlice<i8>,
    v: CudaSlice<i8>,
    k_scales: CudaSlice<f32>,
    v_scales: CudaSlice<f32>,
}

impl Cache {
    fn random(gpu: &Gpu, rng: &mut Rng, valid: usize, extra: usize, row: usize) -> Self {
        let make = |rng: &mut Rng| -> (Vec<f32>, CudaSlice<f16>) {
            let f: Vec<f32> = rng
                .vec(valid * row, 2.0)
                .into_iter()
                .map(round_f16)
                .collect();
            let mut h: Vec<f16> = f.iter().map(|&x| f16::from_f32(x)).collect();
            h.extend(std::iter::repeat_n(f16::NAN, extra * row));
            (f, gpu.upload(&h).unwrap())
        };
        let (kf, k) = make(rng);
        let (vf, v) = make(rng);
        Self {
            k,
            v,
            kx: kf.clone(),
            vx: vf.clone(),
            kf,
            vf,
            int8: None,
        }
    }
    /// The 8-bit cache of random rows of magnitudes 0.1 to 10 (`quantize_row`'s rule); the
    /// reference reads what the kernel widens a row to: f16(int * scale).
    fn random_int8(
        gpu: &Gpu,
        rng: &mut Rng,
        valid: usize,
        extra: usize,
        hd: usize,
        row: usize,
    ) -> Self {
        let mut make = || -> (Vec<f32>, Vec<f32>, CudaSlice<i8>, CudaSlice<f32>) {
            let mut x = rng.vec(valid * row, 1.0);
            for (r, part) in x.chunks_mut(hd).enumerate() {
                let magnitude = [0.1f32, 1.0, 3.0, 10.0][r % 4];
                part.iter_mut().for_each(|v| *v *= magnitude);
            }
            let mut q = vec![0i8; x.len()];
            let mut scales: Vec<f32> = x
                .chunks(hd)
                .zip(q.chunks_mut(hd))
                .map(|(r, qr)| quantize_row(r, qr))
                .collect();
            let exact: Vec<f32> = q
                .chunks(hd)
                .zip(&scales)
                .flat_map(|(qr, &s)| qr.iter().map(move |&v| v as f32 * s))
                .collect();
            let widened = exact.iter().map(|&v| round_f16(v)).collect();
            q.extend(std::iter::repeat_n(0i8, extra * row));
            scales.extend(std::iter::repeat_n(f32::NAN, extra * row / hd));
            (
                widened,
                exact,
                gpu.upload(&q).unwrap(),
                gpu.upload(&scales).unwrap(),
            )
        };
        let (kf, kx, k8, ks) = make();
        let (vf, vx, v8, vs) = make();
        Self {
            k: gpu.upload(&[f16::ZERO]).unwrap(),
            v: gpu.upload(&[f16::ZERO]).unwrap(),
            kf,
            vf,
            kx,
            vx,
            int8: Some(Int8Cache {
                k: k8,
                v: v8,
                k_scales: ks,
                v_scales: vs,
            }),
        }
    }
    fn view(&self, gpu: &Gpu) -> KvCache {
        match &self.int8 {
            None => KvCache::F16 {
                k: dev_ptr(gpu, &self.k),
                v: dev_ptr(gpu, &self.v),
            },
            Some(c) => KvCache::Int8 {
                k: dev_ptr(gpu, &c.k),
                v: dev_ptr(gpu, &c.v),
                k_scales: dev_ptr(gpu, &c.k_scales),
                v_scales: dev_ptr(gpu, &c.v_scales),
            },
        }
    }
}

/// The reference output of `n` rows of `qkv`, the first at `first`: `[n][H][hd]`, over the
/// inputs the prompt kernel rounds to f16 (q, and the 8-bit cache's widened rows), or with
/// `split` over what the split kernel reads (q and int * scale unrounded).
#[allow(clippy::too_many_arguments)]
fn reference_rows(
    qkv: &[f32],
    cache: &Cache,
    first: usize,
    n: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    split: bool,
) -> Vec<f32> {
    let w = (heads + 2 * kv_heads) * hd;
    let (k, v) = if split {
        (&cache.kx, &cache.vx)
    } else {
        (&cache.kf, &cache.vf)
    };
    let mut out = Vec::with_capacity(n * heads * hd);
    for z in 0..n {
        let q: Vec<f32> = qkv[z * w..][..heads * hd]
            .iter()
            .map(|&x| if split { x } else { round_f16(x) })
            .collect();
        out.extend(reference::attention(
            &q,
            k,
            v,
            first + z + 1,
            heads,
            kv_heads,
            hd,
        ));
    }
    out
}

#[test]
fn prompt_attention_matches_reference() {
    let Some(gpu) = gpu_or_skip("prompt_attention_matches_reference") else {
        return;
    };
    check_against_reference(&gpu, false);
}

#[test]
fn int8_prompt_attention_matches_reference() {
    let Some(gpu) = gpu_or_skip("int8_prompt_attention_matches_reference") else {
        return;
    };
    check_against_reference(&gpu, true);
}

fn check_against_reference(gpu: &Gpu, int8: bool) {
    let mut rng = Rng(if int8 { 0x18 } else { 0x9a77 });
    for hd in [64usize, 96, 128] {
        for (group, kv_heads) in [(1usize, 3usize), (4, 2), (8, 1)] {
            let heads = group * kv_heads;
            let w = (heads + 2 * kv_heads) * hd;
            for n in [1usize, 15, 16, 17, 127, 300] {
                for first in [0usize, 45] {
                    let what = format!(
                        "{heads}/{kv_heads} heads, hd {hd}, {n} rows from {first}, int8 {int8}"
                    );
                    let cache = if int8 {
                        Cache::random_int8(gpu, &mut rng, first + n, 5, hd, kv_heads * hd)
                    } else {
                        Cache::random(gpu, &mut rng, first + n, 5, kv_heads * hd)
                    };
                    let qkv = rng.vec(n * w, 2.0);
                    let qkvd = gpu.upload(&qkv).unwrap();
                    // One NaN row past the output, which the kernel must leave alone.
                    let att = gpu.poisoned_f32((n + 1) * heads * hd).unwrap();
                    let pp = |s: &CudaSlice<f32>| dev_ptr(gpu, s);
                    prompt_attention(
                        gpu,
                        heads,
                        kv_heads,
                        hd,
                        pp(&qkvd),
                        cache.view(gpu),
                        pp(&att),
                        first,
                        n,
                    )
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let got = gpu.download(&att).unwrap();
                    assert!(
                        got[n * heads * hd..].iter().all(|x| x.is_nan()),
                        "{what}: wrote past the last row"
                    );
                    let want = reference_rows(&qkv, &cache, first, n, heads, kv_heads, hd, false);
                    for z in 0..n {
                        let r = z * heads * hd..(z + 1) * heads * hd;
                        let err = scaled_error(&got[r.clone()], &want[r], hd);
                        assert!(err < TOL, "{what}: row {z}: max error {err}");
                    }
                    // The keys split 3 ways (partials, then attention_combine): with 45 + n
                    // keys (1 or 2 tiles) some splits are empty, with 300 rows none is.
                    let splits = 3;
                    let part = gpu.poisoned_f32(n * heads * splits * (hd + 2)).unwrap();
                    let att = gpu.poisoned_f32((n + 1) * heads * hd).unwrap();
                    prompt_attention_split(
                        gpu,
                        heads,
                        kv_heads,
                        hd,
                        pp(&qkvd),
                        cache.view(gpu),
                        pp(&part),
                        pp(&att),
                        first,
                        n,
                        splits,
                    )
                    .unwrap_or_else(|e| panic!("{what}, {splits} splits: {e}"));
                    let got = gpu.download(&att).unwrap();
                    assert!(
                        got[n * heads * hd..].iter().all(|x| x.is_nan()),
                        "{what}, {splits} splits: wrote past the last row"
                    );
                    for z in 0..n {
                        let r = z * heads * hd..(z + 1) * heads * hd;
                        let err = scaled_error(&got[r.clone()], &want[r], hd);
                        assert!(
                            err < TOL,
                            "{what}, {splits} splits: row {z}: max error {err}"
                        );
                    }
                }
            }
        }
    }
}

/// `attention_rows` over a prompt chunk: the tensor-core kernel from `MIN_ROWS` rows, the split
/// kernel below (and through `attention_rows_split` always); both match the reference.
#[test]
fn attention_rows_takes_the_prompt_kernel() {
    let Some(gpu) = gpu_or_skip("attention_rows_takes_the_prompt_kernel") else {
        return;
    };
    let mut rng = Rng(0x5eed);
    let (heads, kv_heads, hd) = (8usize, 2usize, 128usize);
    let w = (heads + 2 * kv_heads) * hd;
    // (first, n): below MIN_ROWS (split kernel), at it, a long chunk, and a few rows after a
    // long context (the prompt kernel with key splits, `splits_for`).
    let cases = [
        (100, prompt_attention::MIN_ROWS - 1),
        (100, prompt_attention::MIN_ROWS),
        (100, 200),
        (2000, 20),
    ];
    for (first, n, int8) in cases
        .into_iter()
        .flat_map(|(f, n)| [(f, n, false), (f, n, true)])
    {
        let capacity = first + n + 7;
        let shape = AttentionShape::new(&gpu, heads, kv_heads, hd, capacity).unwrap();
        let cache = if int8 {
            Cache::random_int8(&gpu, &mut rng, first + n, 7, hd, kv_heads * hd)
        } else {
            Cache::random(&gpu, &mut rng, first + n, 7, kv_heads * hd)
        };
        let qkv = rng.vec(n * w, 2.0);
        let qkvd = gpu.upload(&qkv).unwrap();
        let part = gpu.poisoned_f32(n * shape.partials_len()).unwrap();
        let pp = |s: &CudaSlice<f32>| dev_ptr(&gpu, s);
        // attention_rows takes the prompt kernel from MIN_ROWS rows, which rounds its inputs
        // to f16 (the reference is given the same); the split kernel reads them as they are.
        let prompt = n >= prompt_attention::MIN_ROWS;
        let want = reference_rows(&qkv, &cache, first, n, heads, kv_heads, hd, !prompt);
        let rows = Rows::Consecutive { first };
        let att = gpu.poisoned_f32(n * heads * hd).unwrap();
        attention::attention_rows(
            &gpu,
            &shape,
            pp(&qkvd),
            cache.view(&gpu),
            pp(&part),
            pp(&att),
            &rows,
            n,
        )
        .unwrap();
        let err = scaled_error(&gpu.download(&att).unwrap(), &want, hd);
        assert!(
            err < TOL,
            "attention_rows, {n} rows from {first}, int8 {int8}: max error {err}"
        );
        let att = gpu.poisoned_f32(n * heads * hd).unwrap();
        attention::attention_rows_split(
            &gpu,
            &shape,
            pp(&qkvd),
            cache.view(&gpu),
            pp(&part),
            pp(&att),
            &rows,
            n,
        )
        .unwrap();
        let want = reference_rows(&qkv, &cache, first, n, heads, kv_heads, hd, true);
        let err = scaled_error(&gpu.download(&att).unwrap(), &want, hd);
        assert!(
            err < TOL,
            "attention_rows_split, {n} rows from {first}, int8 {int8}: max error {err}"
        );
    }
}

#[test]
fn prompt_attention_refuses_unsupported_shapes() {
    let Some(gpu) = gpu_or_skip("prompt_attention_refuses_unsupported_shapes") else {
        return;
    };
    let mut rng = Rng(1);
    let cache = Cache::random(&gpu, &mut rng, 32, 0, 2 * 128);
    let qkv = gpu.upload(&rng.vec(32 * 12 * 128, 1.0)).unwrap();
    let att = gpu.poisoned_f32(32 * 8 * 128).unwrap();
    let (q, a) = (dev_ptr(&gpu, &qkv), dev_ptr(&gpu, &att));
    let view = cache.view(&gpu);
    let unsupported = |r: Result<(), CudaError>| matches!(r, Err(CudaError::Unsupported(_)));
    // Head dimension without a kernel, a partial group, no KV heads.
    assert!(unsupported(prompt_attention(
        &gpu, 8, 2, 80, q, view, a, 0, 16
    )));
    assert!(unsupported(prompt_attention(
        &gpu, 7, 2, 128, q, view, a, 0, 16
    )));
    assert!(unsupported(prompt_attention(
        &gpu, 8, 0, 128, q, view, a, 0, 16
    )));
    // Misaligned 8-bit scales.
    let i8 = KvCache::Int8 {
        k: dev_ptr(&gpu, &cache.k),
        v: dev_ptr(&gpu, &cache.v),
        k_scales: a + 2,
        v_scales: a,
    };
    assert!(unsupported(prompt_attention(
        &gpu, 8, 2, 128, q, i8, a, 0, 16
    )));
    // Positions past 32 bits, a misaligned cache.
    assert!(unsupported(prompt_attention(
        &gpu,
        8,
        2,
        128,
        q,
        view,
        a,
        i32::MAX as usize,
        16
    )));
    let KvCache::F16 { k, v } = view else {
        unreachable!()
    };
    let shifted = KvCache::F16 { k: k + 2, v };
    assert!(unsupported(prompt_attention(
        &gpu, 8, 2, 128, q, shifted, a, 0, 16
    )));
    // No rows: nothing to do.
    assert!(prompt_attention(&gpu, 8, 2, 128, q, view, a, 0, 0).is_ok());
}

/// The 7B shape's prompt attention (32 heads, hd 128; 127 and 256 rows, after 0 to 4000
/// tokens; both caches) through both kernels, medians printed (not asserted):
/// `--ignored --nocapture`.
#[test]
#[ignore]
fn prompt_attention_timing() {
    let Some(gpu) = gpu_or_skip("prompt_attention_timing") else {
        return;
    };
    let mut rng = Rng(7);
    let (heads, kv_heads, hd) = (32usize, 32usize, 128usize);
    let w = (heads + 2 * kv_heads) * hd;
    let cases = [(0usize, 127usize), (0, 256), (1024, 256), (4000, 16)];
    for (first, n, int8) in cases
        .into_iter()
        .flat_map(|(f, n)| [(f, n, false), (f, n, true)])
    {
        let capacity = 4096.max(first + n);
        let shape = AttentionShape::new(&gpu, heads, kv_heads, hd, capacity).unwrap();
        let cache = if int8 {
            Cache::random_int8(&gpu, &mut rng, first + n, 0, hd, kv_heads * hd)
        } else {
            Cache::random(&gpu, &mut rng, first + n, 0, kv_heads * hd)
        };
        let qkvd = gpu.upload(&rng.vec(n * w, 2.0)).unwrap();
        let part = gpu.poisoned_f32(n * shape.partials_len()).unwrap();
        let att = gpu.poisoned_f32(n * heads * hd).unwrap();
        let pp = |s: &CudaSlice<f32>| dev_ptr(&gpu, s);
        let rows = Rows::Consecutive { first };
        // attention_rows: the prompt kernel, with the key splits it picks.
        let key_splits = prompt_attention::splits_for(
            gpu.info().multiprocessors as usize,
            heads,
            first,
            n,
            shape.splits,
        );
        let tc = sieve_cuda::timing::time_launches(&gpu, 5, 50, |_| {
            attention::attention_rows(
                &gpu,
                &shape,
                pp(&qkvd),
                cache.view(&gpu),
                pp(&part),
                pp(&att),
                &rows,
                n,
            )
        })
        .unwrap();
        let split = sieve_cuda::timing::time_launches(&gpu, 5, 50, |_| {
            attention::attention_rows_split(
                &gpu,
                &shape,
                pp(&qkvd),
                cache.view(&gpu),
                pp(&part),
                pp(&att),
                &rows,
                n,
            )
        })
        .unwrap();
        eprintln!(
            "{} rows from {first}, {heads} heads, hd {hd}, int8 cache {int8}: prompt_attention ({key_splits} key splits) {:.1} us, split + combine {:.1} us (medians, one layer, {})",
            n,
            tc.median_us,
            split.median_us,
            gpu.info().name
        );
    }
}
