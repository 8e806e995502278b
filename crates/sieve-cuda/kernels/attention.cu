// Grouped-query attention of one decode token over the KV cache (f16, or i8 with one f32 scale
// per (position, KV head) row: the _i8 kernels), split along the sequence (flash-decoding),
// then a combine kernel.
//
// attention_split_g<G>: grid (Hkv, S), 128 threads (4 warps); G = the group size g = H / Hkv
// rounded up to 1, 2, 4 or 8 (heads j >= g are masked). Block (kv head h, split s) takes the
// g query heads that read KV head h, and positions [s*per, min((s+1)*per, len)) with
// len = state[0] + 1 and per = ceil(len / S): the grid is fixed when the step is captured, the
// split of the work follows the sequence length read from device memory.
//
// Lanes lie along the head dimension, so every cache read is coalesced: a row of hd values is
// hd / 8 chunks of 8 (16 bytes of f16, or 8 bytes of i8), read by a group of L lanes (L = hd / 8
// rounded up to a power of two; lanes past hd / 8 idle), R = 32 / L rows per warp, RB = 4 R
// rows per block step:
//
//      cache row p (hd values): | chunk 0 | chunk 1 | ... |    lane = sub * L + c
//      warp w, sub-row sub:   row  t0 + i * RB + w * R + sub, chunk c, for i < ATT_LOADS
//
//   per tile of TILE = ATT_LOADS * RB positions:
//     1. every thread issues its ATT_LOADS K chunks and ATT_LOADS V chunks at once (all the
//        tile's bytes in flight: one memory latency per tile, not one per row);
//     2. scores: the lane's 8 dims of q_j (registers) . its K chunk, summed over the L lanes
//        by shuffles; scores[j][row] in shared memory (-inf past the split's end);
//     3. warp w takes heads w, w + 4: tile max, running max m_j, probabilities in place,
//        running sum l_j, correction corr_j = exp(m_old - m_new), all in shared memory;
//     4. values: acc[j][8] = acc * corr_j + sum over the thread's rows of prob[j][row] * V chunk.
//   After the last tile the RB row groups' accumulators are reduced through shared memory.
//
// The 8-bit cache (attention_split_i8_g<G>, Cache = CacheI8): the same mapping over i8 chunks,
// plus each row's key and value scale (k_scales, v_scales f32 [position][Hkv], loaded with the
// row's chunks in step 1). The integers are multiplied as they are and the scales folded in
// once per row: step 2 stores score = scale_k(row) * (q . k_int), step 4 adds
// prob * scale_v(row) * v_int. The f16 kernels (Cache = CacheF16) have no scale and their
// arithmetic is that of the kernel before the 8-bit cache. (Twice the rows per tile for the
// 8-bit cache, to keep the f16 kernel's bytes in flight, was measured on a 7B decode step:
// 5.90 against 6.02 ms at 8192 positions, 4.60 against 4.42 ms at ~200; not kept. H200,
// 2026-12-05.)
//   output per (query head, split): part[(head * S + s) * (hd + 2)] = { m, l, acc[0..hd] }
//   (an empty split writes m = -inf, l = 0).
//
// The previous kernel gave a thread one position and walked its K row and the tile's V rows
// one 16-byte (or 2-byte) load after another: ~30 dependent memory latencies per tile, 20 µs per
// layer of a 7B decode step at a 300-token context (docs/BENCHMARKS.md, GPU decode run 4).
//
// Prefill (len0 > 0): grid (Hkv, S, n), query z at position len0 - 1 + z reads its q from
// qkv + z * q_stride and writes its partials z * H * S * (hd + 2) further; combine runs on
// grid (H, n). Causality is the length: query z sees keys 0 .. len0 - 1 + z. (Prompt chunks of
// 16 rows or more at hd 64, 96 or 128 take the tensor-core kernel of prompt_attention.cu instead.)
//
// Many sequences (seqs != null): grid (Hkv, S, n), query z is the next token of its own
// sequence: length seqs[2z] + 1, cache slot seqs[2z + 1] (slot * slot_stride elements past the
// layer's base, its scales slot * slot_stride / hd entries); q and partials as in prefill. One launch serves a decode step of n sequences.
// A padding row (slot -(s + 1) < 0, see rope_seqs) reads slot s, which the batch's real row
// of that slot has written: its output is valid and unused.
//
// attention_combine: grid H, 128 threads: out[h][d] = sum_s e^(m_s - M) acc_s[d] / sum_s e^(m_s - M) l_s.
// (Measured and removed, 2026-12-07, H100, docs/BENCHMARKS.md "Window N2": the combine done by
// the last split block of each KV head, counted in with an atomic, no combine launch: the 7B
// step took the same time or up to 1.2% longer. Under PDL the combine's launch is hidden, and
// the last block's serial combine sits on the same critical path. Run 6 found the same for the
// combine and RoPE fused together.)
//
// A second split kernel, one running softmax per warp and one barrier: attention_warp.cu.
//
// Limits (checked by AttentionShape::new in src/attention.rs): hd <= 256 and a multiple of 8,
// g <= 8. Dynamic shared memory: max(G * TILE, RB * G * hd) floats (<= 32 KB; the launcher
// computes the same).

#define ATT_THREADS 128
#define ATT_WARPS 4
#define ATT_LOADS 8
#define ATT_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, d));
    return v;
}

// What attention_split_body reads per lane and row: a chunk of 8 cache values, widened to f32.
struct CacheF16 {
    typedef f16_bits elem;
    typedef uint4 chunk;  // 8 f16
    static constexpr bool scaled = false;
    __device__ __forceinline__ static chunk load(const elem* p) {
        return __ldg(reinterpret_cast<const uint4*>(p));
    }
    __device__ __forceinline__ static chunk zero() { return make_uint4(0, 0, 0, 0); }
    __device__ __forceinline__ static void unpack(const chunk& v, float out[8]) { unpack8(v, out); }
};

struct CacheI8 {
    typedef signed char elem;
    typedef uint2 chunk;  // 8 i8, element i in byte i (little-endian)
    static constexpr bool scaled = true;
    __device__ __forceinline__ static chunk load(const elem* p) {
        return __ldg(reinterpret_cast<const uint2*>(p));
    }
    __device__ __forceinline__ static chunk zero() { return make_uint2(0, 0); }
    __device__ __forceinline__ static void unpack(const chunk& v, float out[8]) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            out[b] = (float)(signed char)(v.x >> (8 * b));
            out[4 + b] = (float)(signed char)(v.y >> (8 * b));
        }
    }
};

template <int G, typename Cache>
__device__ __forceinline__ void attention_split_body(const float* __restrict__ qkv,
                                                     const typename Cache::elem* __restrict__ k_cache,
                                                     const typename Cache::elem* __restrict__ v_cache,
                                                     const int* __restrict__ state, float* __restrict__ part,
                                                     int H, int Hkv, int hd, float scale, int len0,
                                                     int q_stride, const int* __restrict__ seqs,
                                                     long long slot_stride, const float* __restrict__ k_scales,
                                                     const float* __restrict__ v_scales) {
    extern __shared__ float smem[];  // scores [G][TILE]; after the loop, the reduction [RB][G][hd]
    __shared__ float s_m[G], s_l[G], s_corr[G];
    const int kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    const int g = H / Hkv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Decode: one query, len from the state. Prefill: query z of the batch sees len0 + z keys.
    // Sequences: query z's length and cache slot from seqs.
    const int z = blockIdx.z;
    const int len = seqs ? seqs[2 * z] + 1 : len0 > 0 ? len0 + z : state[0] + 1;
    if (seqs) {
        const int s = seqs[2 * z + 1];
        const size_t slot = (size_t)(s < 0 ? -(s + 1) : s) * (size_t)slot_stride;
        k_cache += slot;
        v_cache += slot;
        if (Cache::scaled) {
            k_scales += slot / hd;
            v_scales += slot / hd;
        }
    }
    qkv += (size_t)blockIdx.z * q_stride;
    part += (size_t)blockIdx.z * H * S * (hd + 2);
    const int per = (len + S - 1) / S;
    const int p0 = min(split * per, len), p1 = min(p0 + per, len);

    const int chunks = hd >> 3;
    int L = 1;
    while (L < chunks) L <<= 1;
    const int R = 32 / L, RB = ATT_WARPS * R, TILE = ATT_LOADS * RB;
    const int sub = lane / L, c = lane % L;
    const bool has_chunk = c < chunks;
    const int rstep = warp * R + sub;  // this thread's row within a block step

    float q[G][8], acc[G][8];
#pragma unroll
    for (int j = 0; j < G; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            q[j][e] = (j < g && has_chunk) ? qkv[(size_t)(kvh * g + j) * hd + c * 8 + e] * scale : 0.f;
            acc[j][e] = 0.f;
        }
    }
    // No barrier here: thread tid < G is the only one to touch s_m[tid] and s_l[tid] before
    // the barrier that ends step 2 (or, with no tile, before its own writes of out[0], out[1]),
    // so the tile's K and V loads below are issued while the q loads are in flight instead of
    // one L2 latency after them.
    if (tid < G) {
        s_m[tid] = ATT_NEG_INF;
        s_l[tid] = 0.f;
    }

    const size_t row = (size_t)Hkv * hd;
    const typename Cache::elem* kbase = k_cache + (size_t)kvh * hd + c * 8;
    const typename Cache::elem* vbase = v_cache + (size_t)kvh * hd + c * 8;
    float* sc = smem;
    for (int t0 = p0; t0 < p1; t0 += TILE) {
        // 1. The tile's K and V chunks (and, for the 8-bit cache, their rows' scales), all in
        // flight together.
        typename Cache::chunk kv[ATT_LOADS], vv[ATT_LOADS];
        float kscale[ATT_LOADS], vscale[ATT_LOADS];
#pragma unroll
        for (int i = 0; i < ATT_LOADS; ++i) {
            const int p = t0 + i * RB + rstep;
            const bool ok = p < p1 && has_chunk;
            kv[i] = ok ? Cache::load(kbase + (size_t)p * row) : Cache::zero();
            vv[i] = ok ? Cache::load(vbase + (size_t)p * row) : Cache::zero();
            if (Cache::scaled) {
                kscale[i] = ok ? __ldg(k_scales + (size_t)p * Hkv + kvh) : 0.f;
                vscale[i] = ok ? __ldg(v_scales + (size_t)p * Hkv + kvh) : 0.f;
            }
        }
        // 2. Scores of the thread's rows, summed over the row's L lanes.
#pragma unroll
        for (int i = 0; i < ATT_LOADS; ++i) {
            float kf[8];
            Cache::unpack(kv[i], kf);
            float d[G];
#pragma unroll
            for (int j = 0; j < G; ++j) {
                d[j] = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d[j] = fmaf(q[j][e], kf[e], d[j]);
            }
            for (int off = L >> 1; off > 0; off >>= 1) {
#pragma unroll
                for (int j = 0; j < G; ++j) d[j] += __shfl_xor_sync(FULL_MASK, d[j], off);
            }
            if (c == 0) {
                const int idx = i * RB + rstep;
                const bool valid = t0 + idx < p1;
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    const float score = Cache::scaled ? d[j] * kscale[i] : d[j];
                    if (j < g) sc[j * TILE + idx] = valid ? score : ATT_NEG_INF;
                }
            }
        }
        __syncthreads();
        // 3. Online softmax of the tile, one warp per head.
        for (int j = warp; j < g; j += ATT_WARPS) {
            float mx = ATT_NEG_INF;
            for (int i = lane; i < TILE; i += 32) mx = fmaxf(mx, sc[j * TILE + i]);
            mx = warp_max(mx);
            // The tile has at least one valid position, so m_new is finite.
            const float m_old = s_m[j], m_new = fmaxf(m_old, mx);
            float sum = 0.f;
            for (int i = lane; i < TILE; i += 32) {
                const float e = __expf(sc[j * TILE + i] - m_new);
                sc[j * TILE + i] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            // Every lane has read s_m[j] above; order those reads before lane 0 rewrites it
            // (shuffles converge the lanes but do not order shared memory: racecheck).
            __syncwarp();
            if (lane == 0) {
                const float corr = __expf(m_old - m_new);
                s_corr[j] = corr;
                s_l[j] = s_l[j] * corr + sum;
                s_m[j] = m_new;
            }
        }
        __syncthreads();
        // 4. Values.
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const float corr = j < g ? s_corr[j] : 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[j][e] *= corr;
        }
#pragma unroll
        for (int i = 0; i < ATT_LOADS; ++i) {
            float vf[8];
            Cache::unpack(vv[i], vf);
            const int idx = i * RB + rstep;
#pragma unroll
            for (int j = 0; j < G; ++j) {
                if (j < g) {
                    const float pr = Cache::scaled ? sc[j * TILE + idx] * vscale[i] : sc[j * TILE + idx];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[j][e] = fmaf(pr, vf[e], acc[j][e]);
                }
            }
        }
        __syncthreads();  // scores are rewritten by the next tile
    }

    // Reduction over the RB row groups, then the partials.
    float* red = smem;  // [RB][G][hd]
    if (has_chunk) {
#pragma unroll
        for (int j = 0; j < G; ++j)
            if (j < g) {
#pragma unroll
                for (int e = 0; e < 8; ++e) red[((size_t)rstep * G + j) * hd + c * 8 + e] = acc[j][e];
            }
    }
    __syncthreads();
    for (int o = tid; o < g * hd; o += ATT_THREADS) {
        const int j = o / hd, d = o - j * hd;
        float sum = 0.f;
        for (int r = 0; r < RB; ++r) sum += red[((size_t)r * G + j) * hd + d];
        part[((size_t)(kvh * g + j) * S + split) * (hd + 2) + 2 + d] = sum;
    }
    if (tid < g) {
        float* out = part + ((size_t)(kvh * g + tid) * S + split) * (hd + 2);
        out[0] = s_m[tid];
        out[1] = s_l[tid];
    }
}

#define ATTENTION_ARGS(ELEM)                                                                       \
    const float *__restrict__ qkv, const ELEM *__restrict__ k_cache, const ELEM *__restrict__ v_cache, \
        const int *__restrict__ state, float *__restrict__ part, int H, int Hkv, int hd, float scale,  \
        int len0, int q_stride, const int *__restrict__ seqs, long long slot_stride
#define ATTENTION_PASS \
    qkv, k_cache, v_cache, state, part, H, Hkv, hd, scale, len0, q_stride, seqs, slot_stride

// attention_split_g<G> over the f16 cache, attention_split_i8_g<G> over the 8-bit one (its
// two scale buffers follow the f16 kernel's arguments). The last two arguments are a span of
// static data for L2 (pf, pf_bytes; null for none: prefetch_span_l2 in common.cuh), asked for
// before the wait: in the decode step, the start of the gate|up weights, since attention
// reads little from DRAM at short contexts.
#define ATTENTION_SPLIT_KERNELS(G)                                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_split_g##G(ATTENTION_ARGS(f16_bits), \
        const char* __restrict__ pf, u64 pf_bytes) {                                                \
        prefetch_span_l2(pf, pf_bytes);                                                             \
        pdl_wait_then_release();                                                                    \
        attention_split_body<G, CacheF16>(ATTENTION_PASS, nullptr, nullptr);                        \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_split_i8_g##G(                \
        ATTENTION_ARGS(signed char), const float* __restrict__ k_scales,                            \
        const float* __restrict__ v_scales, const char* __restrict__ pf, u64 pf_bytes) {            \
        prefetch_span_l2(pf, pf_bytes);                                                             \
        pdl_wait_then_release();                                                                    \
        attention_split_body<G, CacheI8>(ATTENTION_PASS, k_scales, v_scales);                       \
    }

ATTENTION_SPLIT_KERNELS(1)
ATTENTION_SPLIT_KERNELS(2)
ATTENTION_SPLIT_KERNELS(4)
ATTENTION_SPLIT_KERNELS(8)

extern "C" __global__ void __launch_bounds__(128)
attention_combine(const float* __restrict__ part, float* __restrict__ att, int S, int hd) {
    pdl_wait_then_release();
    const int h = blockIdx.x;
    // blockIdx.y: the query of a prefill batch (0 in decode).
    part += (size_t)blockIdx.y * gridDim.x * S * (hd + 2);
    att += (size_t)blockIdx.y * gridDim.x * hd;
    const float* base = part + (size_t)h * S * (hd + 2);
    float M = ATT_NEG_INF;
    for (int s = 0; s < S; ++s) M = fmaxf(M, base[(size_t)s * (hd + 2)]);
    float L = 0.f;
    for (int s = 0; s < S; ++s) {
        const float* p = base + (size_t)s * (hd + 2);
        if (p[1] > 0.f) L += p[1] * __expf(p[0] - M);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < S; ++s) {
            const float* p = base + (size_t)s * (hd + 2);
            if (p[1] > 0.f) a += p[2 + d] * __expf(p[0] - M);
        }
        att[(size_t)h * hd + d] = a / L;
    }
}
