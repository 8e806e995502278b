// attention_split_warp_g<G> and attention_split_warp_i8_g<G>: a second split kernel for
// decode attention, compiled as its own family (src/attention.rs WARP_FAMILY: this file after
// attention.cu, whose cache readers, limits and argument macros it uses), so that the kernels
// every model runs do not depend on it. Chosen by SIEVE_ATTENTION_KERNEL=warp; it writes the
// partials of attention_split_g<G> for the same grid, and attention_combine follows it.

// The query a split block serves (attention_split_body's preamble, as a function): decode, one
// query, its length from the state; prefill, query z of the batch sees len0 + z keys;
// sequences, query z's length and cache slot from seqs. Returns the slot's element offset in the cache (0 but for sequences)
// and this split's share [p0, p1) of the positions.
struct SplitQuery {
    size_t slot;
    int p0, p1;
};
__device__ __forceinline__ SplitQuery split_query(const int* __restrict__ state, int len0,
                                                  const int* __restrict__ seqs, long long slot_stride) {
    const int split = blockIdx.y, S = gridDim.y, z = blockIdx.z;
    const int len = seqs ? seqs[2 * z] + 1 : len0 > 0 ? len0 + z : state[0] + 1;
    size_t slot = 0;
    if (seqs) {
        const int s = seqs[2 * z + 1];
        slot = (size_t)(s < 0 ? -(s + 1) : s) * (size_t)slot_stride;
    }
    const int per = (len + S - 1) / S;
    const int p0 = min(split * per, len);
    return SplitQuery{slot, p0, min(p0 + per, len)};
}

// attention_split_warp_g<G> (and _i8): the same partials from the same grid, with the block's
// four warps working apart until one merge (SIEVE_ATTENTION_KERNEL=warp, src/attention.rs;
// built 2026-12-07 without a device, not yet measured). attention_split_g<G> passes three
// block barriers per tile of 8 RB positions and two more to reduce: at a short context (one
// tile a block) those barriers and the shared-memory softmax are most of its ~8 us a layer
// (docs/BENCHMARKS.md, "Window N2"). Here:
//   - lanes along the head dimension as in attention_split_g (L lanes a row, R = 32 / L rows a
//     warp step);
//     warp w takes the tiles of ATT_LOADS * R positions t0 = p0 + (w + 4 i) * ATT_LOADS * R;
//   - per tile and head j: the 8 rows' scores (q_j . k over the row's L lanes, by shuffles:
//     every lane of the row holds it), the tile's max and sum over the warp's R row groups by
//     shuffles, the running (m, l) the same in every lane, and acc_j[8] = acc_j * corr +
//     sum of p * v over the lane's own rows;
//   - after its tiles a warp adds its R row groups' acc by shuffles; the four warps' (m, l, acc)
//     meet in shared memory ([ATT_WARPS][G][hd + 2] floats) for one merge after one barrier.
// Arithmetic: the same exp and sums in another order (f32). Dynamic shared memory: the merge's
// [ATT_WARPS][G][hd + 2] floats. No G = 8: q, acc and the tile's unpacked keys would need
// ~265 registers (the launcher takes the block kernel there).
template <int G, typename Cache>
__device__ __forceinline__ void attention_split_warp_body(const float* __restrict__ qkv,
                                                          const typename Cache::elem* __restrict__ k_cache,
                                                          const typename Cache::elem* __restrict__ v_cache,
                                                          const int* __restrict__ state, float* __restrict__ part,
                                                          int H, int Hkv, int hd, float scale, int len0,
                                                          int q_stride, const int* __restrict__ seqs,
                                                          long long slot_stride, const float* __restrict__ k_scales,
                                                          const float* __restrict__ v_scales) {
    extern __shared__ float smem[];  // [ATT_WARPS][G][hd + 2]: each warp's m, l, acc[hd]
    const int kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    const int g = H / Hkv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const SplitQuery sq = split_query(state, len0, seqs, slot_stride);
    k_cache += sq.slot;
    v_cache += sq.slot;
    if (Cache::scaled) {
        k_scales += sq.slot / hd;
        v_scales += sq.slot / hd;
    }
    qkv += (size_t)blockIdx.z * q_stride;
    part += (size_t)blockIdx.z * H * S * (hd + 2);
    const int p0 = sq.p0, p1 = sq.p1;

    const int chunks = hd >> 3;
    int L = 1;
    while (L < chunks) L <<= 1;
    const int R = 32 / L, WT = ATT_LOADS * R;  // positions of one warp tile
    const int sub = lane / L, c = lane % L;
    const bool has_chunk = c < chunks;

    float q[G][8], acc[G][8], m[G], l[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            q[j][e] = (j < g && has_chunk) ? qkv[(size_t)(kvh * g + j) * hd + c * 8 + e] * scale : 0.f;
            acc[j][e] = 0.f;
        }
        m[j] = ATT_NEG_INF;
        l[j] = 0.f;
    }
    const size_t row = (size_t)Hkv * hd;
    const typename Cache::elem* kbase = k_cache + (size_t)kvh * hd + c * 8;
    const typename Cache::elem* vbase = v_cache + (size_t)kvh * hd + c * 8;
    for (int t0 = p0 + warp * WT; t0 < p1; t0 += ATT_WARPS * WT) {
        // The tile's K and V chunks (and the 8-bit cache's row scales), all in flight.
        typename Cache::chunk kv[ATT_LOADS], vv[ATT_LOADS];
        float kscale[ATT_LOADS], vscale[ATT_LOADS];
#pragma unroll
        for (int i = 0; i < ATT_LOADS; ++i) {
            const int p = t0 + i * R + sub;
            const bool ok = p < p1 && has_chunk;
            kv[i] = ok ? Cache::load(kbase + (size_t)p * row) : Cache::zero();
            vv[i] = ok ? Cache::load(vbase + (size_t)p * row) : Cache::zero();
            if (Cache::scaled) {
                kscale[i] = p < p1 ? __ldg(k_scales + (size_t)p * Hkv + kvh) : 0.f;
                vscale[i] = p < p1 ? __ldg(v_scales + (size_t)p * Hkv + kvh) : 0.f;
            }
        }
        float kf[ATT_LOADS][8];
#pragma unroll
        for (int i = 0; i < ATT_LOADS; ++i) Cache::unpack(kv[i], kf[i]);
#pragma unroll
        for (int j = 0; j < G; ++j) {
            if (j >= g) continue;
            // Scores of the lane's rows: the row's L lanes each end with the whole dot product.
            float sc[ATT_LOADS];
            float mx = ATT_NEG_INF;
#pragma unroll
            for (int i = 0; i < ATT_LOADS; ++i) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d = fmaf(q[j][e], kf[i][e], d);
                for (int off = L >> 1; off > 0; off >>= 1) d += __shfl_xor_sync(FULL_MASK, d, off);
                if (Cache::scaled) d *= kscale[i];
                sc[i] = t0 + i * R + sub < p1 ? d : ATT_NEG_INF;
                mx = fmaxf(mx, sc[i]);
            }
            // The tile's max over the warp's R row groups; the tile's first row is valid, so
            // it is finite, and so is the new running max.
            for (int off = L; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, off));
            const float m_new = fmaxf(m[j], mx);
            const float corr = __expf(m[j] - m_new);  // 0 while m[j] is still -inf
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[j][e] *= corr;
#pragma unroll
            for (int i = 0; i < ATT_LOADS; ++i) {
                const float pr = __expf(sc[i] - m_new);  // 0 for rows past p1
                sum += pr;
                float vf[8];
                Cache::unpack(vv[i], vf);
                const float w = Cache::scaled ? pr * vscale[i] : pr;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j][e] = fmaf(w, vf[e], acc[j][e]);
            }
            for (int off = L; off < 32; off <<= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off);
            l[j] = l[j] * corr + sum;
            m[j] = m_new;
        }
    }
    // The warp's R row groups hold partial acc of the same dimensions: add them.
#pragma unroll
    for (int j = 0; j < G; ++j) {
        if (j >= g) continue;  // uniform: g is the block's
#pragma unroll
        for (int e = 0; e < 8; ++e)
            for (int off = L; off < 32; off <<= 1) acc[j][e] += __shfl_xor_sync(FULL_MASK, acc[j][e], off);
    }
    float* mine = smem + (size_t)warp * G * (hd + 2);
#pragma unroll
    for (int j = 0; j < G; ++j) {
        if (j >= g) continue;
        if (lane == 0) {
            mine[j * (hd + 2)] = m[j];
            mine[j * (hd + 2) + 1] = l[j];
        }
        if (sub == 0 && has_chunk) {
#pragma unroll
            for (int e = 0; e < 8; ++e) mine[j * (hd + 2) + 2 + c * 8 + e] = acc[j][e];
        }
    }
    __syncthreads();
    // Merge the warps: a warp with no rows has m = -inf and l = 0 and weighs nothing; a split
    // with no rows at all writes m = -inf, l = 0 (and acc 0) as the combine expects.
    for (int o = tid; o < g * (hd + 2); o += ATT_THREADS) {
        const int j = o / (hd + 2), d = o - j * (hd + 2);
        float M = ATT_NEG_INF;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, smem[((size_t)w * G + j) * (hd + 2)]);
        float v = 0.f;
        if (d == 0) {
            v = M;
        } else if (M != ATT_NEG_INF) {
#pragma unroll
            for (int w = 0; w < ATT_WARPS; ++w) {
                const float* pw = smem + ((size_t)w * G + j) * (hd + 2);
                if (pw[1] > 0.f) v += pw[d] * __expf(pw[0] - M);
            }
        }
        part[((size_t)(kvh * g + j) * S + split) * (hd + 2) + d] = v;
    }
}

#define ATTENTION_SPLIT_WARP_KERNELS(G)                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_split_warp_g##G(ATTENTION_ARGS(f16_bits), \
        const char* __restrict__ pf, u64 pf_bytes) {                                                  \
        prefetch_span_l2(pf, pf_bytes);                                                               \
        pdl_wait_then_release();                                                                      \
        attention_split_warp_body<G, CacheF16>(ATTENTION_PASS, nullptr, nullptr);                     \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_split_warp_i8_g##G(            \
        ATTENTION_ARGS(signed char), const float* __restrict__ k_scales,                              \
        const float* __restrict__ v_scales, const char* __restrict__ pf, u64 pf_bytes) {              \
        prefetch_span_l2(pf, pf_bytes);                                                               \
        pdl_wait_then_release();                                                                      \
        attention_split_warp_body<G, CacheI8>(ATTENTION_PASS, k_scales, v_scales);                    \
    }

ATTENTION_SPLIT_WARP_KERNELS(1)
ATTENTION_SPLIT_WARP_KERNELS(2)
ATTENTION_SPLIT_WARP_KERNELS(4)
