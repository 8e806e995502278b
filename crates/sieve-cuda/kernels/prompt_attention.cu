// Causal grouped-query attention of a prompt chunk over the KV cache (f16; the 8-bit cache
// below) on tensor cores (flash-attention 2): n consecutive query rows at positions first ..
// first + n - 1, query z sees keys 0 ..= first + z; the chunk's own keys are already in the
// cache (RoPE and the cache write run first). Other head dimensions take attention.cu's kernel.
//
// prompt_attention_hd<HD> (HD = 64, 96, 128): grid (H, ceil(n / 64), S), 128 threads (4 warps).
// Block (h, y) takes query head h (KV head h / (H / Hkv)) and the 64 query rows of tile
// gridDim.y - 1 - y (the longest rows first: blocks are issued in order of x, then y, in
// practice, so every head's last tile starts before any shorter one); warp w owns rows
// q0 + 16 w .. q0 + 16 w + 15 of that tile. Rows past n are clamped to row n - 1 (computed,
// never written).
//
// Splits along the keys (S = gridDim.z > 1, for a few rows over a long context, where
// H x ceil(n / 64) blocks would leave the GPU idle): split s takes the block's key tiles
// [s * per, min((s + 1) * per, tiles)), per = ceil(tiles / S), and writes attention.cu's
// partials { m, l, acc[HD] } per (row, head, split) for attention_combine (grid (H, n)),
// instead of the output. With S = 1 the block writes att itself.
//
//   q    f32  qkv[z * q_stride + h * HD + d]        (q_stride = (H + 2 Hkv) HD, RoPE applied)
//   K, V f16  cache[(p * Hkv + kvh) * HD + d]       (position p, KV head kvh)
//   out  f32  att[(z * H + h) * HD + d]             (what attention_combine writes)
//        or   part[((z * H + h) * S + s) * (HD + 2) + {0: m, 1: l, 2 + d: acc}]   (S > 1)
//
// Per block, the keys 0 .. first + (last row of the tile) in tiles of BN = 64 positions:
//
//   shared (dynamic): buffer b in {0, 1}: K tile [BN][HD + 8] f16, then V tile [BN][HD + 8]
//   f16. The 8 f16 of padding per row make the row stride 4 banks mod 32, so the 8 rows an
//   ldmatrix phase reads (16 bytes each) hit 32 different banks. Filled with cp.async, 16 bytes
//   a thread per copy, tile j + 1 in flight while tile j is computed; positions past the
//   chunk's end (first + n) are zero-filled, never read.
//
// mma.sync m16n8k16 (f16 in, f32 accumulate); lane = 4 gr + tq:
//   A (16 x 16, row-major): a0 = (row gr, cols 2tq, 2tq+1), a1 = (gr + 8, 2tq..),
//                           a2 = (gr, 2tq + 8..), a3 = (gr + 8, 2tq + 8..)
//   B (16 x 8, "col"):      b0 = (k rows 2tq, 2tq+1 of column gr), b1 = (k rows 2tq + 8, +9)
//   C (16 x 8):             c0, c1 = (row gr, cols 2tq, 2tq+1), c2, c3 = (row gr + 8, same cols)
// (the lower 16 bits of a register hold the lower index).
//
//   1. Q: the warp's 16 rows x HD as HD / 16 A fragments, loaded once from f32 (float2 loads)
//      and rounded to f16 (the softmax scale is applied to the f32 scores instead).
//   2. S = Q K^T, 16 x BN per warp: B[k = dim][n = key] = K[key][dim], i.e. the cache row of a
//      key is a column of B: ldmatrix (no .trans) of 8 keys x 8 dims gives lane (gr, tq) the
//      dims 2tq, 2tq+1 of key gr, which is b0 (dims 0..7 of the k step) or b1 (dims 8..15).
//      One ldmatrix.x4 (lane l addresses key 8 nt + (l & 7), dims 32 kp + 8 (l >> 3)) gives
//      b0, b1 of k step 2 kp and of k step 2 kp + 1.
//   3. Online softmax in f32 per row (rows gr and gr + 8 of each lane, the row's other values
//      in the 3 lanes of the same gr: shuffles xor 1, 2): scores times scale * log2(e), keys
//      past the row's position set to -inf, running max m, e^x as exp2; the running sum l
//      stays a per-lane partial (every lane of a row rescales by the same factor) and is summed
//      over the 4 lanes once at the end.
//   4. O += P V: the C fragments of S (f32) become the A fragments of P (f16) in place, key
//      step kk = S n-tiles 2 kk (a0, a1) and 2 kk + 1 (a2, a3). B[k = key][n = dim] =
//      V[key][dim] is row-major, so ldmatrix.trans: lane (gr, tq) gets keys 2tq, 2tq+1 of dim
//      gr. One ldmatrix.x4.trans (lane l addresses key 16 kk + (l & 7) + 8 ((l >> 3) & 1),
//      dims 16 dp + 8 (l >> 4)) gives b0, b1 of O n-tiles 2 dp and 2 dp + 1.
//
// The 8-bit cache (prompt_attention_i8_hd<HD>: i8 rows [position][Hkv][HD] and f32 scales
// [position][Hkv], see attention.cu): the tile's bytes and its rows' K and V scales are staged
// with cp.async (two staging buffers of [BN][HD] K bytes, [BN][HD] V bytes, [2][BN] scales;
// tile j + 1 in flight), then widened into one [K, V] f16 tile pair as above, value =
// f16(int * scale) per element (the f32 product rounded once), between two barriers; steps
// 2-4 are the f16 kernel's.
//
//   A warp skips the tiles whose keys all lie past its rows' positions (it still copies and
//   synchronizes); masking is applied only in the tiles that reach past the warp's first row.
//   Every row sees key 0 in tile 0, so the running max is finite from the first tile on.
//
// Registers per thread at HD = 128: Q 32, O 64, S 32, P 16 (u32 / f32).
// Limits (checked by src/prompt_attention.rs): HD in {64, 96, 128}, H a multiple of Hkv,
// first + n < 2^31, qkv and att 8-byte, caches 16-byte, scales 4-byte aligned.
// Dynamic shared memory: f16 2 * 2 * BN * (HD + 8) * 2 bytes (69,632 at HD 128); 8-bit
// 2 * BN * (HD + 8) * 2 + 2 * (2 * BN * HD + 2 * BN * 4) bytes (68,608 at HD 128).

#define PA_THREADS 128
#define PA_WARPS 4
#define PA_BM (16 * PA_WARPS)
#define PA_BN 64
#define PA_PAD 8
#define PA_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
}

// Two floats as f16x2, lo in the lower 16 bits.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    return (u32)f2h(lo) | ((u32)f2h(hi) << 16);
}

// Copies the K and V rows of positions j0 .. j0 + PA_BN - 1 into one buffer; positions at or
// past kv_end are zero-filled (src_bytes 0, from a valid address).
template <int HD>
__device__ __forceinline__ void prompt_load_tile(f16_bits* ks, f16_bits* vs,
                                                 const f16_bits* __restrict__ k_cache,
                                                 const f16_bits* __restrict__ v_cache, int j0,
                                                 int kv_end, int Hkv, int kvh, int tid) {
    constexpr int LD = HD + PA_PAD;
    constexpr int CH = HD / 8;  // 16-byte chunks per row
    static_assert(PA_BN * CH % PA_THREADS == 0, "whole copies per thread");
#pragma unroll
    for (int it = 0; it < PA_BN * CH / PA_THREADS; ++it) {
        const int i = tid + it * PA_THREADS;
        const int r = i / CH, c = i % CH;
        const int key = j0 + r;
        const bool ok = key < kv_end;
        const size_t off = ((size_t)(ok ? key : 0) * Hkv + kvh) * HD + c * 8;
        cp_async16(ks + r * LD + c * 8, k_cache + off, ok ? 16 : 0);
        cp_async16(vs + r * LD + c * 8, v_cache + off, ok ? 16 : 0);
    }
}

// The 8-bit cache's staging buffer of one tile: K bytes [BN][HD], V bytes [BN][HD], K scales
// [BN], V scales [BN] (f32). Positions at or past kv_end stage zeros (values and scales).
template <int HD>
__device__ __forceinline__ void prompt_stage_tile_i8(signed char* stage,
                                                     const signed char* __restrict__ k_cache,
                                                     const signed char* __restrict__ v_cache,
                                                     const float* __restrict__ k_scales,
                                                     const float* __restrict__ v_scales, int j0,
                                                     int kv_end, int Hkv, int kvh, int tid) {
    constexpr int CH = HD / 16;  // 16-byte chunks per row
    static_assert(PA_BN * CH % PA_THREADS == 0, "whole copies per thread");
    static_assert(2 * PA_BN == PA_THREADS, "one scale per thread");
    signed char* ks = stage;
    signed char* vs = stage + PA_BN * HD;
    float* sc = reinterpret_cast<float*>(stage + 2 * PA_BN * HD);  // [2][BN]: K's, then V's
#pragma unroll
    for (int it = 0; it < PA_BN * CH / PA_THREADS; ++it) {
        const int i = tid + it * PA_THREADS;
        const int r = i / CH, c = i % CH;
        const int key = j0 + r;
        const bool ok = key < kv_end;
        const size_t off = ((size_t)(ok ? key : 0) * Hkv + kvh) * HD + c * 16;
        cp_async16(ks + r * HD + c * 16, k_cache + off, ok ? 16 : 0);
        cp_async16(vs + r * HD + c * 16, v_cache + off, ok ? 16 : 0);
    }
    const int r = tid % PA_BN, key = j0 + r;
    const float* src = tid < PA_BN ? k_scales : v_scales;
    if (key < kv_end)
        cp_async4(sc + tid, src + (size_t)key * Hkv + kvh);
    else
        sc[tid] = 0.f;
}

// Staged 8-bit rows to the f16 tiles the mma loop reads: value = f16(int * row scale), the
// f32 product rounded once (the numbers the f16 cache would hold for that row, to rounding).
template <int HD>
__device__ __forceinline__ void prompt_widen_tile_i8(f16_bits* kt, f16_bits* vt, const signed char* stage,
                                                     int tid) {
    constexpr int LD = HD + PA_PAD;
    constexpr int CH = HD / 8;  // 8-value pieces per row
    static_assert(2 * PA_BN * CH % PA_THREADS == 0, "whole pieces per thread");
    const float* sc = reinterpret_cast<const float*>(stage + 2 * PA_BN * HD);
    // Partly unrolled: Q and O stay live across this loop (a full unroll spilled at HD 128).
#pragma unroll 4
    for (int it = 0; it < 2 * PA_BN * CH / PA_THREADS; ++it) {
        const int i = tid + it * PA_THREADS;
        const int m = i / (PA_BN * CH);  // 0: K, 1: V
        const int r = (i / CH) % PA_BN, c = i % CH;
        const uint2 q = *reinterpret_cast<const uint2*>(stage + (size_t)m * PA_BN * HD + r * HD + c * 8);
        const float scale = sc[m * PA_BN + r];
        u32 w[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const u32 src = b < 2 ? q.x : q.y;
            const int sh = 16 * (b & 1);
            const float lo = (float)(signed char)(src >> sh) * scale;
            const float hi = (float)(signed char)(src >> (sh + 8)) * scale;
            w[b] = pack_f16x2(lo, hi);
        }
        f16_bits* dst = (m == 0 ? kt : vt) + r * LD + c * 8;
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// One row's partials { m (natural log), l, acc[HD] } from the lane's O registers of row half R
// (0: row gr, 1: row gr + 8).
template <int HD, int R>
__device__ __forceinline__ void prompt_store_partials(float* out, float m, float l, const float (&o)[HD / 8][4],
                                                      int tq) {
    if (tq == 0) {
        out[0] = m * 0.6931471805599453f;
        out[1] = l;
    }
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt)
        *reinterpret_cast<float2*>(out + 2 + 8 * dt + 2 * tq) = make_float2(o[dt][2 * R], o[dt][2 * R + 1]);
}

// Elem: f16_bits (the f16 cache) or signed char (the 8-bit cache, I8: its scales non-null).
template <int HD, typename Elem>
__device__ __forceinline__ void prompt_attention_body(const float* __restrict__ qkv,
                                                      const Elem* __restrict__ k_cache,
                                                      const Elem* __restrict__ v_cache,
                                                      float* __restrict__ att, float* __restrict__ part, int n,
                                                      int first, int H, int Hkv, int q_stride, float scale_log2,
                                                      const float* __restrict__ k_scales,
                                                      const float* __restrict__ v_scales) {
    constexpr bool I8 = sizeof(Elem) == 1;
    static_assert(HD % 32 == 0, "HD / 16 k steps are taken two at a time");
    constexpr int LD = HD + PA_PAD;
    constexpr int KT = HD / 16;   // k steps of Q K^T
    constexpr int DT = HD / 8;    // n-tiles of O
    constexpr int NT = PA_BN / 8; // n-tiles of S
    extern __shared__ __align__(16) f16_bits pa_smem[];

    const int h = blockIdx.x;
    const int kvh = h / (H / Hkv);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * PA_BM;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gr = lane >> 2, tq = lane & 3;

    // The block's keys: 0 .. first + its last row.
    const int kv_end = first + min(q0 + PA_BM, n);
    const int ntiles = (kv_end + PA_BN - 1) / PA_BN;
    // This split's key tiles (all of them without splits).
    const int S = gridDim.z, split = blockIdx.z;
    const int per = (ntiles + S - 1) / S;
    const int t_begin = min(split * per, ntiles), t_end = min(t_begin + per, ntiles);
    // The warp's rows (clamped to the chunk) and the keys they see.
    const int wq0 = q0 + warp * 16;
    const bool warp_live = wq0 < n;
    const int warp_kv_end = first + min(wq0 + 16, n);
    const int z0 = min(wq0 + gr, n - 1), z1 = min(wq0 + gr + 8, n - 1);
    const int pos0 = first + z0, pos1 = first + z1;

    // 1. Q fragments.
    u32 qf[KT][4];
    {
        const float* r0 = qkv + (size_t)z0 * q_stride + (size_t)h * HD + 2 * tq;
        const float* r1 = qkv + (size_t)z1 * q_stride + (size_t)h * HD + 2 * tq;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            const float2 a = *reinterpret_cast<const float2*>(r0 + 16 * kk);
            const float2 b = *reinterpret_cast<const float2*>(r1 + 16 * kk);
            const float2 c = *reinterpret_cast<const float2*>(r0 + 16 * kk + 8);
            const float2 d = *reinterpret_cast<const float2*>(r1 + 16 * kk + 8);
            qf[kk][0] = pack_f16x2(a.x, a.y);
            qf[kk][1] = pack_f16x2(b.x, b.y);
            qf[kk][2] = pack_f16x2(c.x, c.y);
            qf[kk][3] = pack_f16x2(d.x, d.y);
        }
    }

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m0 = PA_NEG_INF, m1 = PA_NEG_INF, l0 = 0.f, l1 = 0.f;

    // f16: tile j in buffer j & 1 (2 x [K, V] f16 tiles). 8-bit: one [K, V] f16 tile, then two
    // staging buffers; tile j is staged in buffer j & 1 and widened into the f16 tile.
    constexpr int STAGE = 2 * PA_BN * HD + 2 * PA_BN * 4;  // bytes of one staging buffer
    signed char* stage = reinterpret_cast<signed char*>(pa_smem + 2 * PA_BN * LD);
    auto load = [&](int t) {
        if constexpr (I8) {
            prompt_stage_tile_i8<HD>(stage + (t & 1) * STAGE, (const signed char*)k_cache,
                                     (const signed char*)v_cache, k_scales, v_scales, t * PA_BN, kv_end, Hkv,
                                     kvh, tid);
        } else {
            f16_bits* b = pa_smem + (size_t)(t & 1) * 2 * PA_BN * LD;
            prompt_load_tile<HD>(b, b + PA_BN * LD, (const f16_bits*)k_cache, (const f16_bits*)v_cache,
                                 t * PA_BN, kv_end, Hkv, kvh, tid);
        }
    };
    if (t_begin < t_end) load(t_begin);
    cp_async_commit();
    for (int j = t_begin; j < t_end; ++j) {
        if (j + 1 < t_end) load(j + 1);
        cp_async_commit();
        cp_async_wait<1>();  // tile j has landed (only tile j + 1's group may be pending)
        __syncthreads();
        if constexpr (I8) {
            // The f16 tile's last readers finished before the previous iteration's final barrier.
            prompt_widen_tile_i8<HD>(pa_smem, pa_smem + PA_BN * LD, stage + (j & 1) * STAGE, tid);
            __syncthreads();
        }
        const int j0 = j * PA_BN;
        if (warp_live && j0 < warp_kv_end) {  // warp-uniform
            const f16_bits* ks = pa_smem + (I8 ? 0 : (size_t)(j & 1) * 2 * PA_BN * LD);
            const f16_bits* vs = ks + PA_BN * LD;

            // 2. S = Q K^T.
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
                for (int kp = 0; kp < KT / 2; ++kp) {
                    u32 b[4];
                    ldmatrix_x4(b, ks + (8 * nt + (lane & 7)) * LD + 32 * kp + 8 * (lane >> 3));
                    mma_16816(s[nt], qf[2 * kp], b[0], b[1]);
                    mma_16816(s[nt], qf[2 * kp + 1], b[2], b[3]);
                }
            }

            // 3. Online softmax.
            const bool mask = j0 + PA_BN - 1 > first + wq0;
            float mx0 = m0, mx1 = m1;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float v = s[nt][e] * scale_log2;
                    if (mask) {
                        const int key = j0 + 8 * nt + 2 * tq + (e & 1);
                        if (key > (e < 2 ? pos0 : pos1)) v = PA_NEG_INF;
                    }
                    s[nt][e] = v;
                }
                mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
                mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
            // Without splits mx0, mx1 are finite (key 0 in tile 0), and exp2(-inf) = 0 on the
            // first tile. A split that starts past a row's position leaves it at -inf: exponents
            // are then taken from 0 (every p is exp2(-inf) = 0, and o, l stay 0).
            const float u0 = mx0 == PA_NEG_INF ? 0.f : mx0, u1 = mx1 == PA_NEG_INF ? 0.f : mx1;
            const float c0 = exp2f(m0 - u0), c1 = exp2f(m1 - u1);
            m0 = mx0;
            m1 = mx1;
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                o[dt][0] *= c0;
                o[dt][1] *= c0;
                o[dt][2] *= c1;
                o[dt][3] *= c1;
            }
            u32 pf[NT / 2][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float p0 = exp2f(s[nt][0] - u0), p1 = exp2f(s[nt][1] - u0);
                const float p2 = exp2f(s[nt][2] - u1), p3 = exp2f(s[nt][3] - u1);
                l0 += p0 + p1;
                l1 += p2 + p3;
                // S n-tile nt holds keys 8 nt .. 8 nt + 7: the low (a0, a1) or high (a2, a3)
                // half of P's key step nt / 2.
                pf[nt / 2][(nt & 1) * 2 + 0] = pack_f16x2(p0, p1);
                pf[nt / 2][(nt & 1) * 2 + 1] = pack_f16x2(p2, p3);
            }

            // 4. O += P V.
#pragma unroll
            for (int kk = 0; kk < NT / 2; ++kk) {
#pragma unroll
                for (int dp = 0; dp < DT / 2; ++dp) {
                    u32 b[4];
                    ldmatrix_x4_trans(
                        b, vs + (16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 16 * dp + 8 * (lane >> 4));
                    mma_16816(o[2 * dp], pf[kk], b[0], b[1]);
                    mma_16816(o[2 * dp + 1], pf[kk], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // the buffer of tile j is refilled with tile j + 2 next iteration
    }

    if (!warp_live) return;
    l0 += __shfl_xor_sync(FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 2);
    const int zr0 = wq0 + gr, zr1 = wq0 + gr + 8;
    if (S > 1) {
        // attention_combine's partials: part[((z H + h) S + split) (HD + 2)] = { m, l, acc },
        // m in natural-log units of the scaled score (-inf and l = 0 for a row the split does
        // not reach).
        const size_t rec = (size_t)S * (HD + 2);
        if (zr0 < n)
            prompt_store_partials<HD, 0>(part + ((size_t)zr0 * H + h) * rec + (size_t)split * (HD + 2), m0, l0,
                                         o, tq);
        if (zr1 < n)
            prompt_store_partials<HD, 1>(part + ((size_t)zr1 * H + h) * rec + (size_t)split * (HD + 2), m1, l1,
                                         o, tq);
        return;
    }
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        const int d = 8 * dt + 2 * tq;
        if (zr0 < n)
            *reinterpret_cast<float2*>(att + ((size_t)zr0 * H + h) * HD + d) =
                make_float2(o[dt][0] * inv0, o[dt][1] * inv0);
        if (zr1 < n)
            *reinterpret_cast<float2*>(att + ((size_t)zr1 * H + h) * HD + d) =
                make_float2(o[dt][2] * inv1, o[dt][3] * inv1);
    }
}

// prompt_attention_hd<HD> over the f16 cache, prompt_attention_i8_hd<HD> over the 8-bit one
// (its two scale buffers after the f16 kernel's arguments).
#define PROMPT_ATTENTION_KERNELS(HD)                                                                 \
    extern "C" __global__ void __launch_bounds__(PA_THREADS) prompt_attention_hd##HD(               \
        const float* __restrict__ qkv, const f16_bits* __restrict__ k_cache,                         \
        const f16_bits* __restrict__ v_cache, float* __restrict__ att, float* __restrict__ part,     \
        int n, int first, int H, int Hkv, int q_stride, float scale_log2) {                          \
        pdl_wait_then_release();                                                                     \
        prompt_attention_body<HD, f16_bits>(qkv, k_cache, v_cache, att, part, n, first, H, Hkv,      \
                                            q_stride, scale_log2, nullptr, nullptr);                 \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(PA_THREADS) prompt_attention_i8_hd##HD(            \
        const float* __restrict__ qkv, const signed char* __restrict__ k_cache,                      \
        const signed char* __restrict__ v_cache, float* __restrict__ att, float* __restrict__ part,  \
        int n, int first, int H, int Hkv, int q_stride, float scale_log2,                            \
        const float* __restrict__ k_scales, const float* __restrict__ v_scales) {                    \
        pdl_wait_then_release();                                                                     \
        prompt_attention_body<HD, signed char>(qkv, k_cache, v_cache, att, part, n, first, H, Hkv,   \
                                               q_stride, scale_log2, k_scales, v_scales);            \
    }

PROMPT_ATTENTION_KERNELS(64)
PROMPT_ATTENTION_KERNELS(96)
PROMPT_ATTENTION_KERNELS(128)
