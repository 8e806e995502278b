//! Causal grouped-query attention of a prompt chunk over the KV cache (f16, or 8-bit rows with
//! their scales, [`KvCache`]) on tensor cores (flash-attention 2, `kernels/prompt_attention.cu`):
//! `n` consecutive query rows, query `z` at position `first + z` sees keys `0 ..= first + z`.
//! Its output is what [`crate::attention::attention_rows`]' split + combine writes for the same
//! rows, and that function runs this kernel for a prompt chunk of at least [`MIN_ROWS`] rows
//! whose shape it supports ([`supports`]); the f64 CPU reference is
//! [`crate::attention::reference::attention`].

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{grid_cfg, i32_arg, Gpu, KernelFamily};
use crate::kv_cache::KvCache;
use crate::product::DevPtr;
use cudarc::driver::PushKernelArg;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "prompt_attention",
    source: include_str!("../kernels/prompt_attention.cu"),
};

/// Head dimensions with a compiled kernel (`prompt_attention[_i8]_hd<HD>`).
pub const HEAD_DIMS: [usize; 3] = [64, 96, 128];
/// Query rows of a prompt chunk from which `attention_rows` takes this kernel (below, the
/// split kernel's grid of one block per query and split fills the GPU better).
pub const MIN_ROWS: usize = 16;
/// Query rows per block (4 warps of 16) and key positions per shared-memory tile.
const TILE_ROWS: usize = 64;
const TILE_KEYS: usize = 64;
/// f16 of padding per shared-memory row (see the kernel's header).
const PAD: usize = 8;
const THREADS: u32 = 128;

/// Whether the kernel runs this attention shape (over either cache): a compiled head
/// dimension, whole groups of query heads.
pub fn supports(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    HEAD_DIMS.contains(&head_dim)
        && kv_heads > 0
        && heads >= kv_heads
        && heads.is_multiple_of(kv_heads)
}

/// Dynamic shared memory in bytes: of `prompt_attention_hd<HD>`, two buffers of a K and a V
/// tile of `TILE_KEYS` rows of `hd + PAD` f16; of `prompt_attention_i8_hd<HD>`, one such pair,
/// then two staging buffers of the tiles' bytes and their rows' two scales.
fn shared_bytes(head_dim: usize, int8: bool) -> usize {
    let tile_pair = 2 * TILE_KEYS * (head_dim + PAD) * 2;
    if int8 {
        tile_pair + 2 * (2 * TILE_KEYS * head_dim + 2 * TILE_KEYS * 4)
    } else {
        2 * tile_pair
    }
}

/// Splits along the keys for `n` rows from `first` (at most `max_splits`, the partials buffer's):
/// none while the `heads x ceil(n / 64)` blocks fill half the SMs or more (the partials cost
/// `n x H x splits x (hd + 2)` floats written and read back); otherwise enough for about two
/// blocks per SM, each split at least 4 key tiles (256 positions).
pub fn splits_for(
    multiprocessors: usize,
    heads: usize,
    first: usize,
    n: usize,
    max_splits: usize,
) -> usize {
    let blocks = (heads * n.div_ceil(TILE_ROWS)).max(1);
    if 2 * blocks > multiprocessors {
        return 1;
    }
    let key_tiles = (first + n).div_ceil(TILE_KEYS);
    (2 * multiprocessors)
        .div_ceil(blocks)
        .min(key_tiles / 4)
        .min(max_splits)
        .max(1)
}

/// Attention of `n` query rows of `qkv` (f32, `(H + 2 Hkv) hd` apart, q first), the first at
/// position `first`, over `cache` (`[position][Hkv][hd]`, holding positions `0 .. first + n`);
/// output `att` f32 `[n][H][hd]`. Errors (no launch) for an unsupported shape, a position past
/// 32 bits, or misaligned buffers.
#[allow(clippy::too_many_arguments)]
pub fn prompt_attention(
    gpu: &Gpu,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    qkv: DevPtr,
    cache: KvCache,
    att: DevPtr,
    first: usize,
    n: usize,
) -> Result<()> {
    prompt_attention_split(
        gpu, heads, kv_heads, head_dim, qkv, cache, 0, att, first, n, 1,
    )
}

/// [`prompt_attention`] with the keys split `splits` ways (see [`splits_for`]): the kernel
/// writes `attention_combine`'s partials to `part` (f32, at least `n x H x splits x (hd + 2)`,
/// unused for one split), then the combine writes `att`.
#[allow(clippy::too_many_arguments)]
pub fn prompt_attention_split(
    gpu: &Gpu,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    qkv: DevPtr,
    cache: KvCache,
    part: DevPtr,
    att: DevPtr,
    first: usize,
    n: usize,
    splits: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    if splits == 0 || splits > 65535 || (splits > 1 && (part == 0 || !part.is_multiple_of(8))) {
        return Err(CudaError::Unsupported(format!(
            "prompt attention in {splits} splits with partials at {part:#x}: 1 to 65535 splits, \
             and more than one needs an 8-byte aligned partials buffer"
        )));
    }
    if !supports(heads, kv_heads, head_dim) {
        return Err(CudaError::Unsupported(format!(
            "prompt attention with {heads} query heads over {kv_heads} KV heads of dimension \
             {head_dim}: the kernel needs whole groups and a head dimension in {HEAD_DIMS:?}"
        )));
    }
    let (k, v, scales) = match cache {
        KvCache::F16 { k, v } => (k, v, None),
        KvCache::Int8 {
            k,
            v,
            k_scales,
            v_scales,
        } => (k, v, Some((k_scales, v_scales))),
    };
    let end = first
        .checked_add(n)
        .ok_or_else(|| CudaError::Unsupported(format!("prompt positions {first} + {n}")))?;
    i32_arg("prompt end position", end)?;
    let q_stride = heads
        .checked_add(2 * kv_heads)
        .and_then(|r| r.checked_mul(head_dim))
        .ok_or_else(|| CudaError::Unsupported(format!("a qkv row of {heads} heads")))?;
    let q_stride = i32_arg("qkv row width", q_stride)?;
    let (hi, hkvi) = (
        i32_arg("query heads", heads)?,
        i32_arg("KV heads", kv_heads)?,
    );
    let (ks, vs) = scales.unwrap_or((4, 4));
    for (what, ptr, align) in [
        ("qkv", qkv, 8),
        ("att", att, 8),
        ("k cache", k, 16),
        ("v cache", v, 16),
        ("k scales", ks, 4),
        ("v scales", vs, 4),
    ] {
        if ptr == 0 || ptr % align != 0 {
            return Err(CudaError::Unsupported(format!(
                "prompt attention: {what} at {ptr:#x} is not {align}-byte aligned"
            )));
        }
    }
    let tiles = n.div_ceil(TILE_ROWS);
    if tiles > 65535 {
        return Err(CudaError::Unsupported(format!(
            "{n} prompt rows: the grid's y ({tiles} tiles of {TILE_ROWS}) is at most 65535"
        )));
    }
    let cache_kind = if scales.is_some() { "_i8" } else { "" };
    let name = format!("prompt_attention{cache_kind}_hd{head_dim}");
    let f = gpu.function(&FAMILY, &name)?;
    let shared = shared_bytes(head_dim, scales.is_some());
    gpu.allow_dynamic_shared(&f, shared)?;
    let (ni, firsti) = (
        i32_arg("prompt rows", n)?,
        i32_arg("prompt position", first)?,
    );
    let scale_log2 = std::f32::consts::LOG2_E / (head_dim as f32).sqrt();
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&qkv)
        .arg(&k)
        .arg(&v)
        .arg(&att)
        .arg(&part)
        .arg(&ni)
        .arg(&firsti)
        .arg(&hi)
        .arg(&hkvi)
        .arg(&q_stride)
        .arg(&scale_log2);
    if let Some((k_scales, v_scales)) = &scales {
        b.arg(k_scales).arg(v_scales);
    }
    let mut cfg = grid_cfg((hi as u32, tiles as u32), THREADS, shared as u32);
    cfg.grid_dim.2 = splits as u32;
    unsafe { b.launch(cfg) }.during("launching prompt_attention")?;
    if splits > 1 {
        crate::attention::combine(gpu, part, att, heads, n, splits, head_dim)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One m16n8k16 product through the kernel's fragment index math, emulated per lane: Q's A
    /// fragments as loaded, K's B fragments as `ldmatrix` (no .trans) hands them out for the
    /// kernel's lane addresses, and the C layout read back; then P (C of S reused as A) times V
    /// through `ldmatrix.trans`. Checks the maps against plain matrix products.
    #[test]
    fn fragment_maps_match_matrix_products() {
        const HD: usize = 64;
        const KEYS: usize = 64;
        let q: Vec<f32> = (0..16 * HD).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
        let k: Vec<f32> = (0..KEYS * HD)
            .map(|i| ((i * 5) % 11) as f32 - 5.0)
            .collect();
        let v: Vec<f32> = (0..KEYS * HD).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
        // A fragment of a 16 x 16 block (rows 0..16, cols c0..c0+16) of a row-major matrix.
        let a_frag = |m: &dyn Fn(usize, usize) -> f32, c0: usize, lane: usize| -> [[f32; 2]; 4] {
            let (gr, tq) = (lane / 4, lane % 4);
            let at = |r: usize, c: usize| [m(r, c0 + c), m(r, c0 + c + 1)];
            [
                at(gr, 2 * tq),
                at(gr + 8, 2 * tq),
                at(gr, 2 * tq + 8),
                at(gr + 8, 2 * tq + 8),
            ]
        };
        // ldmatrix.x4: lane l supplies the address of row l % 8 of matrix l / 8 (8 consecutive
        // elements from (row, col)); lane receives, of matrix i, row l / 4, elements 2 (l % 4),
        // +1, or with .trans, rows 2 (l % 4), +1 of column l / 4.
        let ldmatrix =
            |m: &[f32], addr: &dyn Fn(usize) -> (usize, usize), trans: bool, lane: usize| {
                let mut out = [[0f32; 2]; 4];
                for (i, o) in out.iter_mut().enumerate() {
                    let (gr, tq) = (lane / 4, lane % 4);
                    let elem = |row: usize, col: usize| {
                        let (r, c) = addr(8 * i + row);
                        m[r * HD + c + col]
                    };
                    *o = if trans {
                        [elem(2 * tq, gr), elem(2 * tq + 1, gr)]
                    } else {
                        [elem(gr, 2 * tq), elem(gr, 2 * tq + 1)]
                    };
                }
                out
            };
        // mma m16n8k16 of one warp from per-lane fragments: gather A and B back into matrices.
        let mma = |a: &[[[f32; 2]; 4]; 32], b: &[[[f32; 2]; 2]; 32], c: &mut [[f32; 4]; 32]| {
            let mut am = [[0f32; 16]; 16];
            let mut bm = [[0f32; 8]; 16];
            for lane in 0..32 {
                let (gr, tq) = (lane / 4, lane % 4);
                for e in 0..2 {
                    am[gr][2 * tq + e] = a[lane][0][e];
                    am[gr + 8][2 * tq + e] = a[lane][1][e];
                    am[gr][2 * tq + 8 + e] = a[lane][2][e];
                    am[gr + 8][2 * tq + 8 + e] = a[lane][3][e];
                    bm[2 * tq + e][gr] = b[lane][0][e];
                    bm[2 * tq + 8 + e][gr] = b[lane][1][e];
                }
            }
            for lane in 0..32 {
                let (gr, tq) = (lane / 4, lane % 4);
                for (e, (r, col)) in [
                    (gr, 2 * tq),
                    (gr, 2 * tq + 1),
                    (gr + 8, 2 * tq),
                    (gr + 8, 2 * tq + 1),
                ]
                .into_iter()
                .enumerate()
                {
                    c[lane][e] += (0..16).map(|kk| am[r][kk] * bm[kk][col]).sum::<f32>();
                }
            }
        };
        // S = Q K^T as the kernel computes it.
        let mut s = [[[0f32; 4]; 32]; KEYS / 8];
        let qm = |r: usize, c: usize| q[r * HD + c];
        for (nt, s_nt) in s.iter_mut().enumerate() {
            for kp in 0..HD / 32 {
                let mut b = [[[[0f32; 2]; 2]; 32]; 2];
                let mut a = [[[[0f32; 2]; 4]; 32]; 2];
                for lane in 0..32 {
                    let r = ldmatrix(
                        &k,
                        &|l| (8 * nt + (l & 7), 32 * kp + 8 * (l >> 3)),
                        false,
                        lane,
                    );
                    b[0][lane] = [r[0], r[1]];
                    b[1][lane] = [r[2], r[3]];
                    a[0][lane] = a_frag(&qm, 32 * kp, lane);
                    a[1][lane] = a_frag(&qm, 32 * kp + 16, lane);
                }
                mma(&a[0], &b[0], s_nt);
                mma(&a[1], &b[1], s_nt);
            }
        }
        let mut sm = vec![0f32; 16 * KEYS];
        for (nt, s_nt) in s.iter().enumerate() {
            for lane in 0..32 {
                let (gr, tq) = (lane / 4, lane % 4);
                sm[gr * KEYS + 8 * nt + 2 * tq] = s_nt[lane][0];
                sm[gr * KEYS + 8 * nt + 2 * tq + 1] = s_nt[lane][1];
                sm[(gr + 8) * KEYS + 8 * nt + 2 * tq] = s_nt[lane][2];
                sm[(gr + 8) * KEYS + 8 * nt + 2 * tq + 1] = s_nt[lane][3];
            }
        }
        for r in 0..16 {
            for key in 0..KEYS {
                let want: f32 = (0..HD).map(|d| q[r * HD + d] * k[key * HD + d]).sum();
                assert_eq!(sm[r * KEYS + key], want, "S[{r}][{key}]");
            }
        }
        // O = S V, S's C fragments reused as A fragments, V through ldmatrix.trans.
        let mut o = [[[0f32; 4]; 32]; HD / 8];
        for kk in 0..KEYS / 16 {
            let mut a = [[[0f32; 2]; 4]; 32];
            for (lane, al) in a.iter_mut().enumerate() {
                for half in 0..2 {
                    let c = s[2 * kk + half][lane];
                    al[half * 2] = [c[0], c[1]];
                    al[half * 2 + 1] = [c[2], c[3]];
                }
            }
            for dp in 0..HD / 16 {
                let mut b = [[[[0f32; 2]; 2]; 32]; 2];
                for lane in 0..32 {
                    let r = ldmatrix(
                        &v,
                        &|l| {
                            (
                                16 * kk + (l & 7) + 8 * ((l >> 3) & 1),
                                16 * dp + 8 * (l >> 4),
                            )
                        },
                        true,
                        lane,
                    );
                    b[0][lane] = [r[0], r[1]];
                    b[1][lane] = [r[2], r[3]];
                }
                let (lo, hi) = o.split_at_mut(2 * dp + 1);
                mma(&a, &b[0], &mut lo[2 * dp]);
                mma(&a, &b[1], &mut hi[0]);
            }
        }
        for (dt, o_dt) in o.iter().enumerate() {
            for lane in 0..32 {
                let (gr, tq) = (lane / 4, lane % 4);
                for (e, (r, d)) in [
                    (gr, 2 * tq),
                    (gr, 2 * tq + 1),
                    (gr + 8, 2 * tq),
                    (gr + 8, 2 * tq + 1),
                ]
                .into_iter()
                .enumerate()
                {
                    let d = 8 * dt + d;
                    let want: f32 = (0..KEYS)
                        .map(|key| sm[r * KEYS + key] * v[key * HD + d])
                        .sum();
                    assert_eq!(o_dt[lane][e], want, "O[{r}][{d}]");
                }
            }
        }
    }

    /// The kernel's control flow per block, warp and lane, emulated in f32 (no f16 rounding):
    /// the reversed tile order, row clamping, the block's and the warp's key ranges, tiles a
    /// warp skips, the mask and when it applies, zero-filled keys past the chunk, the quad
    /// reductions of the running max and the per-lane partial sums. The products inside a
    /// tile are taken as matrices (their fragment maps are checked above). Output `[n][H][hd]`.
    #[allow(clippy::too_many_arguments)]
    fn emulate_kernel(
        qkv: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        first: usize,
        heads: usize,
        kv_heads: usize,
        hd: usize,
        splits: usize,
    ) -> Vec<f32> {
        let (bm, bn) = (TILE_ROWS, TILE_KEYS);
        let q_stride = (heads + 2 * kv_heads) * hd;
        let scale_log2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
        let mut att = vec![f32::NAN; n * heads * hd];
        // attention_combine's partials, [z][h][split][hd + 2].
        let mut part = vec![f32::NAN; n * heads * splits * (hd + 2)];
        let grid_x = n.div_ceil(bm);
        for (bx, h, split) in (0..grid_x)
            .flat_map(|bx| (0..heads).flat_map(move |h| (0..splits).map(move |s| (bx, h, s))))
        {
            {
                let kvh = h / (heads / kv_heads);
                let q0 = (grid_x - 1 - bx) * bm;
                let kv_end = first + (q0 + bm).min(n);
                let ntiles = kv_end.div_ceil(bn);
                let per = ntiles.div_ceil(splits);
                let t_begin = (split * per).min(ntiles);
                let t_end = (t_begin + per).min(ntiles);
                // What the shared-memory tiles hold: zero past kv_end.
                let cache_at = |c: &[f32], key: usize, d: usize| {
                    if key < kv_end {
                        c[(key * kv_heads + kvh) * hd + d]
                    } else {
                        0.0
                    }
                };
                for warp in 0..4 {
                    let wq0 = q0 + 16 * warp;
                    let live = wq0 < n;
                    let warp_kv_end = first + (wq0 + 16).min(n);
                    // Lane (gr, tq), register e: row gr + 8 (e >= 2), column 2 tq + (e & 1).
                    let row = |lane: usize, e: usize| (wq0 + lane / 4 + 8 * (e / 2)).min(n - 1);
                    let mut m = [[f32::NEG_INFINITY; 2]; 32];
                    let mut l = [[0f32; 2]; 32];
                    let mut o = vec![[[0f32; 4]; 32]; hd / 8];
                    for j in t_begin..t_end {
                        let j0 = j * bn;
                        if !(live && j0 < warp_kv_end) {
                            continue;
                        }
                        let mask = j0 + bn - 1 > first + wq0;
                        let mut s = vec![[[0f32; 4]; 32]; bn / 8];
                        for (nt, s_nt) in s.iter_mut().enumerate() {
                            for (lane, sl) in s_nt.iter_mut().enumerate() {
                                for (e, se) in sl.iter_mut().enumerate() {
                                    let z = row(lane, e);
                                    let key = j0 + 8 * nt + 2 * (lane % 4) + (e & 1);
                                    let dot: f32 = (0..hd)
                                        .map(|d| {
                                            qkv[z * q_stride + h * hd + d] * cache_at(k, key, d)
                                        })
                                        .sum();
                                    let mut val = dot * scale_log2;
                                    if mask && key > first + z {
                                        val = f32::NEG_INFINITY;
                                    }
                                    *se = val;
                                }
                            }
                        }
                        // Lane maxima, then over the 4 lanes of a row (xor 1, 2).
                        let mut mx = m;
                        for s_nt in &s {
                            for lane in 0..32 {
                                for e in 0..4 {
                                    mx[lane][e / 2] = mx[lane][e / 2].max(s_nt[lane][e]);
                                }
                            }
                        }
                        let quad = mx;
                        for lane in 0..32 {
                            for r in 0..2 {
                                mx[lane][r] = (0..4)
                                    .map(|t| quad[lane / 4 * 4 + t][r])
                                    .fold(f32::NEG_INFINITY, f32::max);
                                if splits == 1 {
                                    assert!(
                                        mx[lane][r].is_finite(),
                                        "tile {j}: a row without keys"
                                    );
                                }
                            }
                        }
                        let mut p = vec![[[0f32; 4]; 32]; bn / 8];
                        // Exponents from 0 for a row without a key yet (a split past it).
                        let u = mx.map(|r| r.map(|x| if x == f32::NEG_INFINITY { 0.0 } else { x }));
                        for lane in 0..32 {
                            for r in 0..2 {
                                let c = (m[lane][r] - u[lane][r]).exp2();
                                m[lane][r] = mx[lane][r];
                                l[lane][r] *= c;
                                for o_dt in o.iter_mut() {
                                    o_dt[lane][2 * r] *= c;
                                    o_dt[lane][2 * r + 1] *= c;
                                }
                            }
                            for nt in 0..bn / 8 {
                                for e in 0..4 {
                                    let pe = (s[nt][lane][e] - u[lane][e / 2]).exp2();
                                    l[lane][e / 2] += pe;
                                    p[nt][lane][e] = pe;
                                }
                            }
                        }
                        // O += P V, P gathered from the lanes' C fragments.
                        let p_at = |r: usize, key: usize| {
                            let lane = (r % 8) * 4 + (key % 8) / 2;
                            p[key / 8][lane][2 * (r / 8) + key % 2]
                        };
                        for (dt, o_dt) in o.iter_mut().enumerate() {
                            for (lane, ol) in o_dt.iter_mut().enumerate() {
                                for (e, oe) in ol.iter_mut().enumerate() {
                                    let r = lane / 4 + 8 * (e / 2);
                                    let d = 8 * dt + 2 * (lane % 4) + (e & 1);
                                    *oe += (0..bn)
                                        .map(|kk| p_at(r, kk) * cache_at(v, j0 + kk, d))
                                        .sum::<f32>();
                                }
                            }
                        }
                    }
                    if !live {
                        continue;
                    }
                    for lane in 0..32 {
                        for e in 0..4 {
                            let r = e / 2;
                            let sum: f32 = (0..4).map(|t| l[lane / 4 * 4 + t][r]).sum();
                            let z = wq0 + lane / 4 + 8 * r;
                            if z >= n {
                                continue;
                            }
                            let rec = &mut part[((z * heads + h) * splits + split) * (hd + 2)..]
                                [..hd + 2];
                            rec[0] = m[lane][r] * std::f32::consts::LN_2;
                            rec[1] = sum;
                            for (dt, o_dt) in o.iter().enumerate() {
                                let d = 8 * dt + 2 * (lane % 4) + (e & 1);
                                if splits == 1 {
                                    att[(z * heads + h) * hd + d] = o_dt[lane][e] / sum;
                                } else {
                                    rec[2 + d] = o_dt[lane][e];
                                }
                            }
                        }
                    }
                }
            }
        }
        if splits > 1 {
            // attention_combine.
            for (rec, out) in part.chunks(splits * (hd + 2)).zip(att.chunks_mut(hd)) {
                let big = rec
                    .chunks(hd + 2)
                    .map(|p| p[0])
                    .fold(f32::NEG_INFINITY, f32::max);
                let weight = |p: &[f32]| if p[1] > 0.0 { (p[0] - big).exp() } else { 0.0 };
                let total: f32 = rec.chunks(hd + 2).map(|p| p[1] * weight(p)).sum();
                for (d, o) in out.iter_mut().enumerate() {
                    *o = rec
                        .chunks(hd + 2)
                        .map(|p| p[2 + d] * weight(p))
                        .sum::<f32>()
                        / total;
                }
            }
        }
        att
    }

    #[test]
    fn emulated_kernel_matches_reference() {
        let mut seed = 0x1234_5678u64;
        let mut rnd = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
                })
                .collect()
        };
        for (hd, group, kv_heads) in [(64, 1usize, 1usize), (64, 4, 1), (96, 2, 2)] {
            let heads = group * kv_heads;
            let w = (heads + 2 * kv_heads) * hd;
            let cases = [
                (1usize, 0usize),
                (17, 0),
                (16, 45),
                (70, 0),
                (130, 45),
                (20, 300),
            ];
            for (n, first, splits) in cases
                .into_iter()
                .flat_map(|(n, f)| [(n, f, 1usize), (n, f, 3)])
            {
                // NaN past the chunk: the emulated tiles, like the kernel's, never read it.
                let mut k = rnd((first + n) * kv_heads * hd);
                let mut v = rnd((first + n) * kv_heads * hd);
                k.extend(std::iter::repeat_n(f32::NAN, 3 * kv_heads * hd));
                v.extend(std::iter::repeat_n(f32::NAN, 3 * kv_heads * hd));
                let qkv = rnd(n * w);
                let got = emulate_kernel(&qkv, &k, &v, n, first, heads, kv_heads, hd, splits);
                for z in 0..n {
                    let want = crate::attention::reference::attention(
                        &qkv[z * w..][..heads * hd],
                        &k,
                        &v,
                        first + z + 1,
                        heads,
                        kv_heads,
                        hd,
                    );
                    let err = got[z * heads * hd..][..heads * hd]
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(
                            0f32,
                            |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
                        );
                    assert!(
                        err < 1e-4,
                        "{heads}/{kv_heads} heads, {n} rows from {first}, {splits} splits, row {z}: {err}"
                    );
                }
            }
        }
    }

    #[test]
    fn splits_only_for_few_rows_over_many_keys() {
        // 7B on an H200 (132 SMs): a 127-token prompt, a 256-row chunk after 1024 tokens.
        assert_eq!(splits_for(132, 32, 0, 127, 64), 1);
        assert_eq!(splits_for(132, 32, 1024, 256, 64), 1);
        // A GQA model's 8 heads, 60 rows after 2000: 8 blocks, 32 key tiles.
        assert_eq!(splits_for(132, 8, 2000, 60, 64), 8);
        // 16 rows after 4000: 32 blocks, 63 key tiles.
        assert_eq!(splits_for(132, 32, 4000, 16, 64), 9);
        assert_eq!(splits_for(132, 32, 4000, 16, 4), 4);
        // Short contexts never split below 4 key tiles a split.
        assert_eq!(splits_for(132, 8, 100, 16, 64), 1);
        assert_eq!(splits_for(132, 8, 0, 1, 64), 1);
    }

    #[test]
    fn kernel_limits() {
        assert!(supports(32, 32, 128));
        assert!(supports(32, 8, 64));
        assert!(supports(32, 8, 96));
        assert!(!supports(32, 8, 80));
        assert!(!supports(30, 8, 128));
        assert!(!supports(32, 0, 128));
        // The kernel header's figures.
        assert_eq!(shared_bytes(128, false), 69_632);
        assert_eq!(shared_bytes(128, true), 68_608);
    }
}
