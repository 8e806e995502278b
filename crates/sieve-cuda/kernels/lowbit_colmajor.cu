// Column-major 4-bit weights with TEAL column skipping: y += W · mask_t(x) for one token.
// W (M x K) is symmetric 4-bit with one f16 scale per row and G columns: G = 128 is sieve's
// W4A16, G = 32 GGUF's Q4_0 (value s[r][k / G] · (u - 8), u in 0..15). This is the decode
// layout of such a matrix when its input has a TEAL threshold: the tensor-core layout
// (dense_lowbit_gemv.cu) reads every weight whatever the input; this one reads nothing of an
// inactive column, so at activation sparsity dp it reads (1 - dp) of the weight bytes.
//
// Layout (src/lowbit_cols.rs `ColumnLayout`): rows padded to Mp = 256 n, columns to Kp = 32 n
//
//   words[k · Mp/8 + r/8]   u32: the 8 nibbles of rows r .. r + 7 of column k (r = 8 j); pair
//                           i = rows (r + 2i, r + 2i + 1) at bits 4i .. 4i+3 and 16+4i .. 19+4i,
//                           so ((w >> 4i) & 0x000f000f) | 0x64006400 is the f16 pair
//                           (1024 + u, 1024 + u') and one f16x2 subtraction of (1032, 1032)
//                           gives the exact (u - 8, u' - 8)
//   scales[g · Mp + r]      f16 s[r][g], g = k / G: a lane's 8 rows are one 16-byte load
//   padding                 u = 8 (value 0), scale 0
//
//      column k:  | l0: rows 0-7 | l1: rows 8-15 | ... | l31: rows 248-255 | next row tile ...
//                 one 128-byte line per (column, row tile): a warp reads whole lines, and no
//                 byte of an inactive column.
//
// One launch per product. Block = 8 warps = 8 consecutive slots of 32 columns (256 columns) of
// one row tile (256 rows); lane l owns rows r0 + 8l .. r0 + 8l + 7. (Variants, below the
// kernel body: T row tiles per warp, R columns per round.)
//
//   1. The warp loads its slot's 32 inputs (one per lane) and its rows' scales, together.
//   2. Compaction: a ballot of |x| > t gives the slot's active columns; the slot's largest
//      active |x| = m · 2^E (m in [0.5, 1)) gives s = 8 - E, and each lane rounds its input
//      to f16(x · 2^s). Every scaled input is below 256, so the f16 partial sums below can
//      neither overflow nor drop the small inputs of a slot with one huge one (Llama's
//      "massive activations" reach thousands). A power-of-two scale is exact:
//      f16(x · 2^s) = f16(x) · 2^s. Each lane writes (its column's byte offset, its input
//      in both halves) to the warp's list in shared memory, active columns first in order.
//      Every row tile's warps redo this for their slot: ~40 instructions, no launch.
//   3. The active columns in rounds of 16: per column one shared load of its offset and one
//      32-bit weight load (the 16 loads in flight before any is used: 2 KB per warp), then
//      4 f16 pairs (LOP3 and a shift, one HSUB2) that one HFMA2 each multiplies by the
//      broadcast input into 4 f16x2 partial sums. Each round's partial sums (at most 16
//      products, |.| < 16 · 8 · 256 = 32768 < 65504) are added into f32.
//   4. The warp's 8 sums are scaled by its rows' s and the slot's 2^-s; the block adds its 8
//      warps in shared memory and adds to y with one 16-byte vector reduction per 4 rows
//      (split-K: y is not zeroed here; the decode runner zeroes it in the RMSNorm before, or
//      adds into the residual).
//
// (3) lbc_w4_to_f16_t: the matrix as f16 (K x Mp, column k's Mp rows contiguous) for the batched
//     prefill, which multiplies it with cuBLAS (s · (u - 8) rounded to f16 once).

#define LBC_ROWS 256
#define LBC_SLOT 32
#define LBC_WARPS 8
#define LBC_ROUND 16

// 2^e as a float for |e| <= 126, from its exponent bits.
__device__ __forceinline__ float lbc_pow2(int e) { return __int_as_float((127 + e) << 23); }

__device__ __forceinline__ u32 ld_stream4(const u32* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// (u - 8) of pair i of word w as an f16 pair.
__device__ __forceinline__ u32 lbc_pair(u32 w, int i) {
    return sub_f16x2(and_or(w >> (4 * i), 0x000f000fu, 0x64006400u), 0x64086408u);
}

// T = row tiles per warp (1 or 2): with 2, a lane owns 8 rows in each of two adjacent row tiles
// (their words are 128 bytes apart in a column), so the per-column work of the list and the
// per-slot compaction serve twice the weights, and a round keeps 2 R loads in flight.
// R = active columns per round: the loads in flight per row tile, and the products in one f16
// partial sum.
// (Measured and removed, 2026-12-06, H100, docs/BENCHMARKS.md: two slots of one scale group per
// warp as one list, which halves the grid, was within 1-4% of t2r8 either way; every product
// summed in f32 instead of f16 partial sums was 6-12% slower and its TEAL perplexity no closer
// to the CPU's.)
template <int G, int T, int R>
__device__ __forceinline__ void lbc_w4_body(const u32* __restrict__ w, const f16_bits* __restrict__ scales,
                                            const float* __restrict__ x, float t, float* __restrict__ y, int M,
                                            int K, int Mp, int slots) {
    static_assert(LBC_SLOT % R == 0, "a round reads list entries below 32");
    __shared__ __align__(16) float part[LBC_WARPS][LBC_ROWS * T];
    // Per warp, its columns in order, active first: (byte offset of the column from the warp's
    // first, f16 input in both halves).
    __shared__ __align__(8) uint2 list[LBC_WARPS][LBC_SLOT];
    int lane = threadIdx.x & 31;
    int wib = threadIdx.x >> 5;
    int rt0 = blockIdx.x * T;
    int tiles = Mp / LBC_ROWS;
    int slot = blockIdx.y * LBC_WARPS + wib;
    float acc[T][8];
#pragma unroll
    for (int tt = 0; tt < T; ++tt)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[tt][i] = 0.f;
    if (slot < slots) {
        // 1. Inputs and scales, all in flight at once.
        int k = slot * LBC_SLOT + lane;
        float v = k < K ? x[k] : 0.f;
        int g = (slot * LBC_SLOT) / G;
        uint4 sv[T];
#pragma unroll
        for (int tt = 0; tt < T; ++tt)
            sv[tt] = rt0 + tt < tiles ? *reinterpret_cast<const uint4*>(scales + (size_t)g * Mp +
                                                                         (size_t)(rt0 + tt) * LBC_ROWS + lane * 8)
                                      : make_uint4(0u, 0u, 0u, 0u);
        // 2. Compaction in registers, written to the warp's list in shared memory.
        bool on = k < K && active(v, t);
        u32 mask = __ballot_sync(FULL_MASK, on);
        float a = on ? fabsf(v) : 0.f;
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) a = fmaxf(a, __shfl_xor_sync(FULL_MASK, a, d));
        // Zero and subnormal maxima give E = -126; the clamp keeps 2^s and 2^-s finite.
        int E = (int)((__float_as_uint(a) >> 23) & 0xffu) - 126;
        int s = min(max(8 - E, -100), 100);
        int n = __popc(mask);
        u32 ldw_bytes = (u32)(Mp / 8) * 4u;
        // Active columns first, in column order; inactive ones after them with input 0, so that
        // every entry a round reads is defined.
        u32 xh = on ? (u32)f2h(v * lbc_pow2(s)) : 0u;
        int below = __popc(mask & ((1u << lane) - 1u));
        int pos = on ? below : n + (lane - below);
        list[wib][pos] = make_uint2((u32)lane * ldw_bytes, xh | (xh << 16));
        __syncwarp();
        const char* wbase = reinterpret_cast<const char*>(w + (size_t)slot * LBC_SLOT * (Mp / 8) +
                                                          (size_t)rt0 * 32 + lane);
        bool second = T > 1 && rt0 + 1 < tiles;
        // 3. The active columns, R (x T) loads in flight per round.
        for (int j0 = 0; j0 < n; j0 += R) {
            u32 wv[T][R];
#pragma unroll
            for (int u = 0; u < R; ++u) {
                // Past the last active column: no load (its input is 0).
                u32 off = list[wib][j0 + u].x;
                bool ld = j0 + u < n;
                wv[0][u] = ld ? ld_stream4(reinterpret_cast<const u32*>(wbase + off)) : 0u;
                if (T > 1) wv[T - 1][u] = ld && second ? ld_stream4(reinterpret_cast<const u32*>(wbase + off + 128)) : 0u;
            }
            u32 hs[T][4];
#pragma unroll
            for (int tt = 0; tt < T; ++tt)
#pragma unroll
                for (int i = 0; i < 4; ++i) hs[tt][i] = 0u;
#pragma unroll
            for (int u = 0; u < R; ++u) {
                u32 x2 = list[wib][j0 + u].y;
#pragma unroll
                for (int tt = 0; tt < T; ++tt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) hs[tt][i] = fma_f16x2(lbc_pair(wv[tt][u], i), x2, hs[tt][i]);
            }
#pragma unroll
            for (int tt = 0; tt < T; ++tt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float lo, hi;
                    unpack2(hs[tt][i], lo, hi);
                    acc[tt][2 * i] += lo;
                    acc[tt][2 * i + 1] += hi;
                }
        }
        // 4. Scales.
        float p2 = lbc_pow2(-s);
#pragma unroll
        for (int tt = 0; tt < T; ++tt) {
            float sc[8];
            unpack8(sv[tt], sc);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[tt][i] *= sc[i] * p2;
        }
    }
#pragma unroll
    for (int tt = 0; tt < T; ++tt)
#pragma unroll
        for (int i = 0; i < 8; ++i) part[wib][tt * LBC_ROWS + lane * 8 + i] = acc[tt][i];
    __syncthreads();
    int r0 = rt0 * LBC_ROWS;
    bool vec = ((reinterpret_cast<size_t>(y) & 15) == 0) && (M % 4 == 0);
    if (vec) {
        // 4 rows a thread: one 16-byte reduction (M % 4 == 0, so all 4 rows exist or none).
        int r = threadIdx.x * 4;
        if (r < LBC_ROWS * T && r0 + r < M) {
            float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int q = 0; q < LBC_WARPS; ++q) {
                float4 v = *reinterpret_cast<const float4*>(&part[q][r]);
                s[0] += v.x;
                s[1] += v.y;
                s[2] += v.z;
                s[3] += v.w;
            }
            if (s[0] != 0.f || s[1] != 0.f || s[2] != 0.f || s[3] != 0.f)
                asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(y + r0 + r), "f"(s[0]),
                             "f"(s[1]), "f"(s[2]), "f"(s[3])
                             : "memory");
        }
    } else {
        for (int r = threadIdx.x; r < LBC_ROWS * T; r += blockDim.x) {
            float s = 0.f;
#pragma unroll
            for (int q = 0; q < LBC_WARPS; ++q) s += part[q][r];
            if (r0 + r < M && s != 0.f) atomicAdd(y + r0 + r, s);
        }
    }
}

#define LBC_W4_ARGS                                                                              \
    const u32 *__restrict__ w, const f16_bits *__restrict__ scales, const float *__restrict__ x, float t, \
        float *__restrict__ y, int M, int K, int Mp, int slots

// Grid: (ceil(row tiles / T), ceil(slots / 8)), 256 threads.
#define LBC_W4_KERNEL(NAME, G, T, R, MINB)                                       \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME(LBC_W4_ARGS) { \
        pdl_wait_then_release();                                                 \
        lbc_w4_body<G, T, R>(w, scales, x, t, y, M, K, Mp, slots);               \
    }
// Variants (src/lowbit_cols.rs `ColsVariant`): one row tile and rounds of 16 columns; two row
// tiles per warp with rounds of 8 (two with rounds of 16 lost to both, 2026-12-05).
LBC_W4_KERNEL(lbc_w4_g128, 128, 1, 16, 5)
LBC_W4_KERNEL(lbc_w4_g32, 32, 1, 16, 5)
LBC_W4_KERNEL(lbc_w4_g128_t2r8, 128, 2, 8, 3)
LBC_W4_KERNEL(lbc_w4_g32_t2r8, 32, 2, 8, 3)

// One thread per word: rows r .. r + 7 of column k as 8 f16 at out[k · Mp + r].
extern "C" __global__ void __launch_bounds__(256)
lbc_w4_to_f16_t(const u32* __restrict__ w, const f16_bits* __restrict__ scales, int Mp, int Kp, int G,
                f16_bits* __restrict__ out) {
    pdl_wait_then_release();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t words = (size_t)Kp * (Mp / 8);
    if (i >= words) return;
    int k = (int)(i / (Mp / 8));
    int r = (int)(i % (Mp / 8)) * 8;
    u32 wd = w[i];
    uint4 sv = *reinterpret_cast<const uint4*>(scales + (size_t)(k / G) * Mp + r);
    float sc[8];
    unpack8(sv, sc);
    u32 o[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        float lo = (float)((int)((wd >> (4 * p)) & 0xfu) - 8) * sc[2 * p];
        float hi = (float)((int)((wd >> (16 + 4 * p)) & 0xfu) - 8) * sc[2 * p + 1];
        o[p] = (u32)f2h(lo) | ((u32)f2h(hi) << 16);
    }
    *reinterpret_cast<uint4*>(out + (size_t)k * Mp + r) = make_uint4(o[0], o[1], o[2], o[3]);
}
