// spMspV over Balanced-CBC with 8-bit or 4-bit values: y = W · mask_t(x), W with N nonzeros in
// every 16 rows of a column (balanced sparsity), every stored value on an integer grid
// (`sieve pack --values int8|int4[:G]`, sieve-formats/src/value_grid.rs):
//
//   int8: W[r][k] = s[r] · q,        |q| <= 127, f32 scale per row       code u = q + 128 (a byte)
//   int4: W[r][k] = s[r][k / G] · q, |q| <= 7,   f16 scale per row and G columns (G = 32, 64, 128)
//                                                                         code u = q + 8 (a nibble)
//
// The same mapping as balanced_cbc_spmspv.cu's index kernel (read its header first): row tile
// rt = rows 512 rt .. +511, lane j of a warp owns rows 512 rt + 16 j .. +15, every (column,
// 16-row group) holds exactly N slots (nonzeros, then zero-valued padding on rows of their own).
// Block (rt, k), L lanes (32, or the last tile's lanes that hold rows < M), built at upload
// (src/balanced_lowbit.rs `device_blocks`):
//
//      | values: VW x L u32                  | rows: IW x L u32                          |
//        word w of lane j, at 4 (w L + j)      word w of lane j: slot i's row (0..15) in
//        int8: slots 4w..4w+3, a byte each     nibble i % 8 of word i / 8 (IW = ceil(N / 8))
//        int4: slots 8w..8w+7, a nibble each
//        (VW = ceil(N / 4) | ceil(N / 8))
//      block bytes 4 (VW + IW) L rounded up to 16; a full block (L = 32) is 128 (VW + IW) bytes:
//      at N = 8, 384 bytes (int8) or 256 (int4), against 640 for the f16 index kernel.
//
// A lane reads its VW + IW words with coalesced 4-byte loads. Decoding slot i: int8, one PRMT
// puts the byte under the exponent of 2^23 (0x4B0000uu = 2^23 + u) and one FADD removes
// 2^23 + 128; int4, a shift and one LOP3 ((w >> 4 i) & 15 | 0x4B000000) then an FADD of
// 2^23 + 8. The integers q are summed times x in shared-memory accumulators exactly as the f16
// kernel sums values, and the scales are applied once per row (int8: at the final reduction)
// or once per row and warp slice (int4: a warp's column slice lies inside one column group, so
// its 16 x 32 sums are scaled by that group's scale before the 8 warps are added). Hence the
// product differs from the f16 kernel on the same (snapped) weights only by f32 rounding.
//
// Thread mapping as the f16 kernel: block (rt, ks) = one row tile, 8 warps, each warp a slice
// of cols_per_warp consecutive columns (int4: a divisor of G), the active columns of the slice
// (TEAL: |x| > t) streamed in batches of 4 with the next batch's loads issued before the
// current one is processed; split-K over the slices with one atomic per row; fused zeroing
// through flags/epoch (flags == nullptr: the product is added to y).

#define BLB_TILE 512
#define BLB_WARPS 8
#define BLB_BATCH 4

__device__ __forceinline__ u32 blb_ld32(const unsigned char* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

template <int N, int BITS, int LANES>
__device__ __forceinline__ void blb_tile(float (*acc)[16][32], const unsigned char* __restrict__ blocks,
                                         const float* __restrict__ scales, const float* __restrict__ x,
                                         float* __restrict__ y, int M, int K, float t, int cols_per_warp,
                                         int last_lanes, int group, int mp, u32* __restrict__ flags, u32 epoch) {
    constexpr int IW = (N + 7) / 8;
    constexpr int VW = BITS == 8 ? (N + 3) / 4 : (N + 7) / 8;
    constexpr u32 FULL_BLOCK_BYTES = 128 * (VW + IW);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rt = blockIdx.x;
    const unsigned char* tile = blocks + (size_t)rt * (size_t)K * FULL_BLOCK_BYTES;
    const int lanes = LANES ? LANES : last_lanes;
    const u32 block_bytes = lanes == 32 ? FULL_BLOCK_BYTES : ((u32)(4 * (VW + IW) * lanes) + 15u) & ~15u;
    const bool stored = LANES == 32 || lane < lanes;
    float* warp_acc = &acc[warp][0][0];
#pragma unroll
    for (int s = 0; s < 16; ++s) warp_acc[s * 32 + lane] = 0.f;
    const int begin = (blockIdx.y * BLB_WARPS + warp) * cols_per_warp;
    const int end = min(begin + cols_per_warp, K);
    const unsigned char* base4 = tile + 4 * lane;
    const u32 idx_at = 4u * VW * (u32)lanes;

    pdl_wait();
    if (flags && blockIdx.y == 0) {
        for (int r = threadIdx.x; r < BLB_TILE; r += blockDim.x)
            if (rt * BLB_TILE + r < M) y[rt * BLB_TILE + r] = 0.f;
        publish_zeroed_tile(flags + rt, epoch);
    }
    float xw[2];
    u32 half_mask[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int k = begin + 32 * h + lane;
        xw[h] = k < end ? __ldg(x + k) : 0.f;
        half_mask[h] = __ballot_sync(FULL_MASK, k < end && active(xw[h], t));
    }
    u64 pending = (u64)half_mask[1] << 32 | half_mask[0];

    // Lanes that store nothing keep zero codes on rows 0..N-1 (rows >= M, never written).
    u32 words[2][BLB_BATCH][VW];
    u32 meta[2][BLB_BATCH][IW];
    constexpr u32 ZERO_CODE = BITS == 8 ? 0x80808080u : 0x88888888u;
#pragma unroll
    for (int st = 0; st < 2; ++st)
#pragma unroll
        for (int u = 0; u < BLB_BATCH; ++u) {
#pragma unroll
            for (int w = 0; w < VW; ++w) words[st][u][w] = ZERO_CODE;
            meta[st][u][0] = 0x76543210u;
            if (IW > 1) meta[st][u][IW - 1] = 0xfedcba98u;
        }
    float xs[2][BLB_BATCH];
    int count[2];
    auto fetch = [&](int st) {
        int n = 0;
#pragma unroll
        for (int u = 0; u < BLB_BATCH; ++u) {
            const bool have = pending != 0;
            const int s = have ? __ffsll((long long)pending) - 1 : 0;
            pending &= pending - 1;
            xs[st][u] = __shfl_sync(FULL_MASK, s < 32 ? xw[0] : xw[1], s & 31);
            n += have ? 1 : 0;
            if (have && stored) {
                const unsigned char* p4 = base4 + (size_t)(begin + s) * block_bytes;
#pragma unroll
                for (int w = 0; w < VW; ++w) words[st][u][w] = blb_ld32(p4 + w * lanes * 4);
#pragma unroll
                for (int w = 0; w < IW; ++w) meta[st][u][w] = blb_ld32(p4 + idx_at + w * lanes * 4);
            }
        }
        count[st] = n;
    };
    const u32 lane_base = 4u * (u32)lane;
    char* acc_bytes = (char*)warp_acc;
    auto process = [&](int st) {
#pragma unroll
        for (int u = 0; u < BLB_BATCH; ++u) {
            if (u >= count[st]) break;
            u32 off[N];
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const u32 w = meta[st][u][i / 8];
                const int sh = 4 * (i % 8) - 7;
                off[i] = ((sh < 0 ? w << -sh : w >> sh) & 0x780u) | lane_base;
            }
            float a[N];
#pragma unroll
            for (int i = 0; i < N; ++i) a[i] = *(float*)(acc_bytes + off[i]);
#pragma unroll
            for (int i = 0; i < N; ++i) {
                float v;
                if (BITS == 8) {
                    const u32 w = words[st][u][i / 4];
                    v = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | (u32)(i % 4))) - 8388736.f;
                } else {
                    const u32 w = words[st][u][i / 8];
                    v = __uint_as_float(((w >> (4 * (i % 8))) & 15u) | 0x4B000000u) - 8388616.f;
                }
                a[i] = fmaf(v, xs[st][u], a[i]);
            }
#pragma unroll
            for (int i = 0; i < N; ++i) *(float*)(acc_bytes + off[i]) = a[i];
        }
    };
    fetch(0);
    while (true) {
        if (count[0] == 0) break;
        fetch(1);
        process(0);
        if (count[1] == 0) break;
        fetch(0);
        process(1);
    }
    __syncthreads();
    if (flags && blockIdx.y != 0) wait_zeroed_tile(flags + rt, epoch);
    for (int i = threadIdx.x; i < BLB_TILE; i += blockDim.x) {
        int l = i & 31, s = i >> 5;
        int r = rt * BLB_TILE + l * 16 + s;
        float sum = 0.f;
        if (BITS == 8) {
#pragma unroll
            for (int w = 0; w < BLB_WARPS; ++w) sum += acc[w][s][l];
            sum *= __ldg(scales + r);
        } else {
#pragma unroll
            for (int w = 0; w < BLB_WARPS; ++w) {
                const int b = (blockIdx.y * BLB_WARPS + w) * cols_per_warp;
                if (b < K) sum = fmaf(acc[w][s][l], __ldg(scales + (size_t)(b / group) * mp + r), sum);
            }
        }
        if (r < M && sum != 0.f) atomicAdd(y + r, sum);
    }
}

template <int N, int BITS>
__device__ __forceinline__ void blb_kernel(const unsigned char* __restrict__ blocks, const float* __restrict__ scales,
                                           const float* __restrict__ x, float* __restrict__ y, int M, int K, float t,
                                           int cols_per_warp, int last_lanes, int group, int mp,
                                           u32* __restrict__ flags, u32 epoch) {
    __shared__ float acc[BLB_WARPS][16][32];
    pdl_release();
    if (blockIdx.x == gridDim.x - 1 && last_lanes != 32)
        blb_tile<N, BITS, 0>(acc, blocks, scales, x, y, M, K, t, cols_per_warp, last_lanes, group, mp, flags, epoch);
    else
        blb_tile<N, BITS, 32>(acc, blocks, scales, x, y, M, K, t, cols_per_warp, last_lanes, group, mp, flags, epoch);
}

#define BLB_ARGS                                                                                        \
    const unsigned char *__restrict__ blocks, const float *__restrict__ scales, const float *__restrict__ x, \
        float *__restrict__ y, int M, int K, float t, int cols_per_warp, int last_lanes, int group, int mp,   \
        u32 *__restrict__ flags, u32 epoch
#define BLB_PASS blocks, scales, x, y, M, K, t, cols_per_warp, last_lanes, group, mp, flags, epoch
#define BLB_KERNEL(NN)                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, (NN) <= 8 ? 3 : 2) bcbc_int8_n##NN(BLB_ARGS) {           \
        blb_kernel<NN, 8>(BLB_PASS);                                                                           \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, (NN) <= 8 ? 3 : 2) bcbc_int4_n##NN(BLB_ARGS) {           \
        blb_kernel<NN, 4>(BLB_PASS);                                                                           \
    }
BLB_KERNEL(1)
BLB_KERNEL(2)
BLB_KERNEL(3)
BLB_KERNEL(4)
BLB_KERNEL(5)
BLB_KERNEL(6)
BLB_KERNEL(7)
BLB_KERNEL(8)
BLB_KERNEL(9)
BLB_KERNEL(10)
BLB_KERNEL(11)
BLB_KERNEL(12)
BLB_KERNEL(13)
BLB_KERNEL(14)
BLB_KERNEL(15)
BLB_KERNEL(16)

// The matrix as f16, column-major: out[k · Mp + r] (Mp = 512 (tiles - 1) + 16 last_lanes), each
// stored weight s · q rounded to f16 once (s: the row's f32 scale for int8, its column group's
// for int4, both as the spMspV kernel reads them, `smp` = 512 · tiles rows per group): the
// batched prefill's copy for cuBLAS. One warp per block (rt, k), lane j its 16 rows, as
// balanced_cbc_spmspv.cu's bcbc_to_f16_t: zeroed in shared memory, each slot added at its row
// (padding slots hold code zero), two 16-byte stores.
extern "C" __global__ void __launch_bounds__(256) blb_to_f16_t(const unsigned char* __restrict__ blocks,
                                                                const float* __restrict__ scales,
                                                                f16_bits* __restrict__ out, int K, int N, int bits,
                                                                int tiles, int last_lanes, int group, int smp,
                                                                int Mp) {
    __shared__ __align__(16) f16_bits rows[BLB_WARPS][32][16];
    pdl_wait_then_release();  // the previous GEMM may still read `out`
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t wid = (size_t)blockIdx.x * BLB_WARPS + warp;
    if (wid >= (size_t)tiles * K) return;
    const int rt = (int)(wid / K), k = (int)(wid % K);
    const u32 iw = (u32)(N + 7) / 8;
    const u32 vw = bits == 8 ? (u32)(N + 3) / 4 : (u32)(N + 7) / 8;
    const u32 full = 128u * (vw + iw);
    const int lanes = rt == tiles - 1 ? last_lanes : 32;
    const u32 block_bytes = lanes == 32 ? full : (4u * (vw + iw) * (u32)lanes + 15u) & ~15u;
    if (lane >= lanes) return;
    const unsigned char* b = blocks + (size_t)rt * (size_t)K * full + (size_t)k * block_bytes + 4 * lane;
    const u32 idx_at = 4u * vw * (u32)lanes;
    const float* srow = scales + (bits == 8 ? 0 : (size_t)(k / group) * smp) + (size_t)rt * BLB_TILE + 16 * lane;
    uint4* mine = reinterpret_cast<uint4*>(&rows[warp][lane][0]);
    mine[0] = make_uint4(0u, 0u, 0u, 0u);
    mine[1] = make_uint4(0u, 0u, 0u, 0u);
    for (int i = 0; i < N; ++i) {
        const int per = bits == 8 ? 4 : 8;
        const u32 w = blb_ld32(b + 4u * (u32)(i / per) * lanes);
        const int q = bits == 8 ? (int)((w >> (8 * (i % 4))) & 0xffu) - 128 : (int)((w >> (4 * (i % 8))) & 15u) - 8;
        const int r = (int)((blb_ld32(b + idx_at + 4u * (u32)(i / 8) * lanes) >> (4 * (i % 8))) & 15u);
        const float v = __fmul_rn(srow[r], (float)q);
        rows[warp][lane][r] = f2h(h2f(rows[warp][lane][r]) + v);
    }
    __threadfence_block();  // the 16 halves stored above, read back as two vectors
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)k * Mp + (size_t)rt * BLB_TILE + 16 * lane);
    dst[0] = mine[0];
    dst[1] = mine[1];
}
