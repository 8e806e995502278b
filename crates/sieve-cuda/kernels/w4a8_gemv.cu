// W4A8: Y (N x M, f32) = X (N x K) · Wᵀ for N = 1..32 with 4-bit weights and 8-bit
// activations, on the integer tensor cores (mma.sync m16n8k32, s8 x s8 -> s32).
//
//   weights      the W4A16 g128 and GGUF Q4_0 (g32) kinds of dense_lowbit_gemv.cu, in its device
//                layout (read that header: chunks of 16 rows x 64 columns, one uint4 per lane,
//                f16 scale pairs per row tile, group and lane group): value s · (u - 8)
//   activations  each token's row as INT8 with one f32 scale per 128 columns (w4a8_quantize_x
//                below, bit for bit sieve_formats::eight_bit::int8_groups: s = max|x| / 127 of
//                the group, q = rne(x / s)); the scales are token-major, ldx / 128 per token
//
// Why a second kernel over the same bytes: below 32 tokens the f16 kernel is bound by its
// instruction issue, not by the weights. Making exact f16 values costs it 5 LOP3/SHF and 4 f16x2
// ops per 8 weights and one m16n8k16 mma per 16 columns; here 8 weights cost one SHF and two
// LOP3, and one m16n8k32 takes 32 columns.
//
// A fragment (m16n8k32, s8, row-major), lane (g = lane / 4, c = lane % 4):
//
//      a0: row g,     k slots 4c .. 4c + 3        a2: row g,     k slots 16 + 4c .. 16 + 4c + 3
//      a1: row g + 8, k slots 4c .. 4c + 3        a3: row g + 8, k slots 16 + 4c .. 16 + 4c + 3
//
// B: b0 = k slots 4c .. 4c + 3 of token g, b1 = k slots 16 + 4c ..; C (s32): c0, c1 row g, tokens
// 2c, 2c + 1; c2, c3 row g + 8.
//
// The 4-bit word of k tile j (dense_lowbit_gemv.cu) holds row g's e0, e4, e1, e5 at bits 0, 8,
// 16, 24 and row g + 8's e2, e6, e3, e7 at bits 4, 12, 20, 28. So
//
//      ((w << 4) & 0xf0f0f0f0) ^ 0x80808080    row g:     four s8 values 16 (u - 8)
//      ( w       & 0xf0f0f0f0) ^ 0x80808080    row g + 8: the same
//
// (u ^ 8 is u - 8 in 4-bit two's complement; in a byte's high half it reads 16 (u - 8)), exact;
// the mma sums 16 (u - 8) q and the 1/16 goes with the token's scale. Bytes e0, e4, e1, e5 are
// the tile's columns +0, +2, +1, +3 of the lane's four (the x-block order of the f16 kernel: its
// slots 2c, 2c + 1, 2c + 8, 2c + 9 are columns +0, +1, +2, +3), so the quantized activations
// store every aligned group of 4 columns in byte order 0, 2, 1, 3: a lane's B register is one
// aligned word. Tiles 2i and 2i + 1 of a chunk are one mma: a0, a1 from word 2i, a2, a3 from word
// 2i + 1, b0 and b1 the activation words of the same two tiles.
//
// Activation loads: P = k tiles per x block (4 for g128, 2 for g32); lane c's bytes of block bk
// of a chunk are the 4P at 64 chunk + 16 P bk + 4 P c: one 16-byte load per chunk and 8-token n
// tile (g128), or two 8-byte loads (g32, whose tiles 2i, 2i + 1 are exactly group i of the chunk).
//
// Integer sums stay exact within a group (|16 (u - 8) q| <= 16256, at most 128 of them: < 2^22,
// so the I2F is exact too); a weight group's sum is scaled by the row's f16 scale times the
// token's scale of the 128 columns holding it (a weight group never straddles two: 32 and 128
// divide 128) into an f32 accumulator. Thread mapping as dense_lowbit_gemv.cu: persistent blocks over the row tiles, 8
// warps splitting a tile's chunks into contiguous ranges of whole groups, stages of 4 chunks
// double-buffered, partial sums reduced in shared memory, each output written once, times 1/16.

#ifndef W4A8_WARPS
#define W4A8_WARPS 8
#endif
#define W4A8_STAGE 4

// D = A · B + D for one m16n8k32 tile of s8 values, s32 accumulators.
__device__ __forceinline__ void mma_s8_16832(int c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The four A registers of k tiles 2i, 2i + 1 from their 4-bit words.
__device__ __forceinline__ void w4a8_frag(u32 w0, u32 w1, u32 a[4]) {
    a[0] = ((w0 << 4) & 0xf0f0f0f0u) ^ 0x80808080u;
    a[1] = (w0 & 0xf0f0f0f0u) ^ 0x80808080u;
    a[2] = ((w1 << 4) & 0xf0f0f0f0u) ^ 0x80808080u;
    a[3] = (w1 & 0xf0f0f0f0u) ^ 0x80808080u;
}

// GROUP: 128 (sieve's W4A16 g128) or 32 (GGUF Q4_0). NT: 8-token n tiles.
template <int GROUP, int NT>
__device__ __forceinline__ void w4a8_kernel(const uint4* __restrict__ w, const u32* __restrict__ gscales,
                                            const unsigned char* __restrict__ x8,
                                            const float* __restrict__ xscale, int ldx, float* __restrict__ y,
                                            int ldy, int M, int N, int chunks, int accumulate) {
    constexpr int CK = 64;                           // columns per chunk
    constexpr int CPS = GROUP > CK ? GROUP / CK : 1;  // chunks per step of whole groups
    constexpr int U = W4A8_STAGE;                    // chunks per stage
    constexpr int GPS = U * CK / GROUP;              // groups per stage
    constexpr int P = GROUP / 16 < 4 ? GROUP / 16 : 4;
    constexpr int MPG = GROUP / 32;                  // mmas per group
    static_assert(GROUP == 32 || GROUP == 128, "W4A8 kernels take groups of 32 or 128");
    static_assert(U % CPS == 0, "a stage holds whole groups");
    __shared__ float red[2][W4A8_WARPS][NT * 8][17];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int tiles = (M + 15) >> 4;
    const int steps = chunks / CPS;
    const int spw = (steps + W4A8_WARPS - 1) / W4A8_WARPS;
    const int c0 = min(warp * spw, steps) * CPS;
    const int c1 = min((warp + 1) * spw, steps) * CPS;
    const int groups = chunks * CK / GROUP;
    const int xgroups = ldx / 128;  // activation scales per token

    uint4 buf[2][U];
    u32 sb[2][GPS];
    auto fetch = [&](int st, int rt, int cb) {
        const uint4* wp = w + (size_t)rt * chunks * 32 + lane;
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (cb + u < c1) buf[st][u] = ld_stream16(wp + (size_t)(cb + u) * 32);
        const u32* sp = gscales + (size_t)rt * groups * 8 + g;
#pragma unroll
        for (int s = 0; s < GPS; ++s) {
            const int grp = cb * CK / GROUP + s;
            if (grp * GROUP < c1 * CK) sb[st][s] = __ldg(sp + (size_t)grp * 8);
        }
    };

    float acc[NT][4];
    int part[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[nt][i] = 0.f;
            part[nt][i] = 0;
        }

    auto compute = [&](int st, int cb) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (cb + u >= c1) break;
            // B words of the chunk's 4 k tiles per n tile. Rows n >= N read row N - 1: their
            // columns of C are never stored.
            u32 bx[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned char* xr = x8 + (size_t)min(nt * 8 + g, N - 1) * ldx + (cb + u) * CK + 4 * P * c;
                if (P == 4) {
                    const uint4 v = __ldg(reinterpret_cast<const uint4*>(xr));
                    bx[nt][0] = v.x;
                    bx[nt][1] = v.y;
                    bx[nt][2] = v.z;
                    bx[nt][3] = v.w;
                } else {
                    const uint2 v0 = __ldg(reinterpret_cast<const uint2*>(xr));
                    const uint2 v1 = __ldg(reinterpret_cast<const uint2*>(xr + 32));
                    bx[nt][0] = v0.x;
                    bx[nt][1] = v0.y;
                    bx[nt][2] = v1.x;
                    bx[nt][3] = v1.y;
                }
            }
            const u32 words[4] = {buf[st][u].x, buf[st][u].y, buf[st][u].z, buf[st][u].w};
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 a[4];
                w4a8_frag(words[2 * h], words[2 * h + 1], a);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma_s8_16832(part[nt], a, bx[nt][2 * h], bx[nt][2 * h + 1]);
                const int t = 2 * u + h;  // mma within the stage (stages start on a group)
                if ((t + 1) % MPG == 0) {
                    const u32 s2 = sb[st][t / MPG];
                    const float s_lo = h2f((unsigned short)(s2 & 0xffffu));
                    const float s_hi = h2f((unsigned short)(s2 >> 16));
                    // The 128-column activation group of this weight group.
                    const int ag = ((cb * CK) / GROUP + t / MPG) * GROUP / 128;
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const float x0 = __ldg(xscale + (size_t)min(nt * 8 + 2 * c, N - 1) * xgroups + ag);
                        const float x1 = __ldg(xscale + (size_t)min(nt * 8 + 2 * c + 1, N - 1) * xgroups + ag);
                        acc[nt][0] = fmaf((float)part[nt][0], s_lo * x0, acc[nt][0]);
                        acc[nt][1] = fmaf((float)part[nt][1], s_lo * x1, acc[nt][1]);
                        acc[nt][2] = fmaf((float)part[nt][2], s_hi * x0, acc[nt][2]);
                        acc[nt][3] = fmaf((float)part[nt][3], s_hi * x1, acc[nt][3]);
#pragma unroll
                        for (int i = 0; i < 4; ++i) part[nt][i] = 0;
                    }
                }
            }
        }
    };

    // One row tile's end: the warps' partial sums through shared memory, each output written
    // once, times 1/16.
    auto finish = [&](int rt, int par) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            red[par][warp][nt * 8 + 2 * c][g] = acc[nt][0];
            red[par][warp][nt * 8 + 2 * c + 1][g] = acc[nt][1];
            red[par][warp][nt * 8 + 2 * c][g + 8] = acc[nt][2];
            red[par][warp][nt * 8 + 2 * c + 1][g + 8] = acc[nt][3];
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < NT * 8 * 16; i += blockDim.x) {
            const int n = i >> 4, r = i & 15;
            const int row = 16 * rt + r;
            if (n >= N || row >= M) continue;
            float s = 0.f;
#pragma unroll
            for (int q = 0; q < W4A8_WARPS; ++q) s += red[par][q][n][r];
            s *= 0.0625f;
            float* o = y + (size_t)n * ldy + row;
            *o = accumulate ? *o + s : s;
        }
    };

    auto next = [&](int& rt, int& cb) {
        cb += U;
        if (cb >= c1) {
            cb = c0;
            rt += gridDim.x;
        }
    };
    int rt = blockIdx.x, cb = c0, par = 0;
    // The weights are never written by another kernel: the first stage is fetched while a
    // programmatic predecessor (the activations' quantization) finishes.
    pdl_release();
    if (rt < tiles) fetch(0, rt, cb);
    pdl_wait();
    while (rt < tiles) {
        int rn = rt, cn = cb;
        next(rn, cn);
        if (rn < tiles) fetch(1, rn, cn);
        compute(0, cb);
        if (rn != rt) {
            finish(rt, par);
            par ^= 1;
        }
        rt = rn;
        cb = cn;
        if (rt >= tiles) break;
        next(rn, cn);
        if (rn < tiles) fetch(0, rn, cn);
        compute(1, cb);
        if (rn != rt) {
            finish(rt, par);
            par ^= 1;
        }
        rt = rn;
        cb = cn;
    }
}

#define W4A8_ARGS                                                                                  \
    const uint4 *__restrict__ w, const u32 *__restrict__ gscales, const unsigned char *__restrict__ x8, \
        const float *__restrict__ xscale, int ldx, float *__restrict__ y, int ldy, int M, int N,     \
        int chunks, int accumulate
#define W4A8_KERNEL(NAME, GROUP, NT, MINB)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * W4A8_WARPS, MINB) NAME##_nt##NT(W4A8_ARGS) { \
        w4a8_kernel<GROUP, NT>(w, gscales, x8, xscale, ldx, y, ldy, M, N, chunks, accumulate);     \
    }
#define W4A8_KERNELS(NAME, GROUP)   \
    W4A8_KERNEL(NAME, GROUP, 1, 3) \
    W4A8_KERNEL(NAME, GROUP, 2, 2) \
    W4A8_KERNEL(NAME, GROUP, 3, 2) \
    W4A8_KERNEL(NAME, GROUP, 4, 2)
W4A8_KERNELS(w4a8_g128, 128)
W4A8_KERNELS(w4a8_g32, 32)

// f32 activations (n rows of K, `ldin` apart) -> INT8 codes (n x ldx bytes, every aligned group
// of 4 columns in byte order 0, 2, 1, 3; zeros past K) and one f32 scale per 128 columns of each
// token (n x ldx / 128, token-major), each input kept only where it is active under the TEAL
// threshold t (|x| > t; t < 0 keeps all). One warp per (token, 128-column group), 8 a block:
// lane l holds columns 4l .. 4l + 3 of its group, the group's largest kept |x| by shuffles, then
// each lane writes its 4 codes as one word. No block-wide reduction and no second pass over the
// row: a token of K columns is K / 128 independent warps. Codes and scales are
// sieve_formats::eight_bit::int8_groups's exactly (IEEE division and round-to-nearest-even, as
// the CPU's f32 `/` and `round_ties_even`).
extern "C" __global__ void __launch_bounds__(256) w4a8_quantize_x(const float* __restrict__ x, int K, int ldin,
                                                                  float t, unsigned char* __restrict__ x8,
                                                                  int ldx, float* __restrict__ xscale, int n) {
    pdl_wait_then_release();
    const int xgroups = ldx / 128;
    const int item = blockIdx.x * 8 + (threadIdx.x >> 5);  // token * xgroups + group: one per warp
    if (item >= n * xgroups) return;                         // whole warps leave together
    const int lane = threadIdx.x & 31;
    const int row = item / xgroups, grp = item - row * xgroups;
    const int k0 = grp * 128 + 4 * lane;
    const float* xr = x + (size_t)row * ldin;
    float v[4];
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int k = k0 + i;
        v[i] = k < K ? xr[k] : 0.f;
        if (!active(v[i], t)) v[i] = 0.f;
        m = fmaxf(m, fabsf(v[i]));
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, d));
    const float s = __fdiv_rn(m, 127.f);
    if (lane == 0) xscale[item] = s;
    u32 word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int q = 0;
        if (s > 0.f) q = max(-127, min(127, __float2int_rn(__fdiv_rn(v[i], s))));
        const int pos = i == 1 ? 2 : i == 2 ? 1 : i;  // byte order 0, 2, 1, 3
        word |= (u32)(q & 0xff) << (8 * pos);
    }
    *reinterpret_cast<u32*>(x8 + (size_t)row * ldx + k0) = word;
}
