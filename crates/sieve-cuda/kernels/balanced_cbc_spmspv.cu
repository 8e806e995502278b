// spMspV over Balanced-CBC: y = W * mask_t(x), W in the layout of
// sieve-formats/src/balanced_cbc.rs (read its header first). Summary:
//
//   row tile rt = rows 512 rt .. +511; lane j of a warp owns rows 512 rt + 16 j .. +15
//   every (column k, 16-row group) holds exactly N slots (nonzeros + zero padding)
//   L lanes per tile: 32, except the last tile, which stores only the lanes holding rows < M
//   block (rt, k) at byte rt * K * (64 N + 64) + k * B(L), B(L) = L (2 N + 2) rounded up to 16,
//   fixed size, no metadata:
//
//      | words: N/2 x L u32, word w of lane j = slots 2w | 2w+1 | tail: L u16 (N odd) | bits: L u16 |
//        lane:  0 1 2 ... L-1 | 0 1 2 ... L-1 | ...            lane j's slot N-1                lane j's rows
//
// so a lane reads its N values and its 16-bit row mask with N/2 + 2 coalesced 4- and 2-byte
// loads (the warp reads the whole block, nothing else), like the dense column-major
// kernel reads its 16-byte row slice. Why this layout: the Tiled-CBC kernels place a column's
// values by a per-lane popcount, so each element costs a shared-memory load at a data-dependent
// address (ncu, runs 3-8: L1/shared pipe 80-90%, 21-79% of copy bandwidth). Here the count per
// lane is fixed by the pruning pattern (Balanced Sparsity: N of every 16 rows per column), so the
// loads are fixed-size and coalesced.
//
// Thread mapping: block (rt, ks) = one row tile, 8 warps, each warp a slice of cols_per_warp
// (<= 64) consecutive columns. A warp reads the slice's activations once (two per lane), forms
// the active mask with ballots and streams the active columns in batches of U = 4: the loads of
// batch b + 1 are issued before batch b is processed. Processing column c in lane j:
//
//     slots i = 0 .. N-1, rows s_i = positions of the set bits of bits_j (ascending), found
//     with an ALU-only chain b &= b - 1 (the isolated bit's position is computed off the chain)
//     acc[warp][s_i][lane] += value_i * x_c      (shared memory, bank = lane: conflict free)
//
// All N accumulators of a column are read before any is written (the slots are distinct), so
// the N read-modify-writes overlap. Accumulators live in shared memory because the row a value
// lands on is data dependent (a register array indexed at run time would go to local memory).
// Finally the 8 warps' accumulators are summed and added to y with one atomic per row (split-K
// over the column slices).
//
//
// Two kernels per N, the upload (GpuBalancedCbc, BcbcKernel::for_slots) picks one:
// * bcbc_spmspv_n<N> ("chain", above; used for N > 8) reads the blob's blocks as they are;
// * bcbc_idx_n<N> ("index", used for N <= 8): the upload replaces each lane's 16-bit mask by
//   its slots' rows as 4-bit indices (slot i in nibble i % 8 of index word i / 8; the words
//   follow the values from the next 4-byte boundary, IW = ceil(N / 8) x L u32, block rounded
//   up to 16; a full block is 64 N + 128 IW bytes), so a slot's accumulator address is one
//   shift and one LOP3, ((word >> k) & 0x780) | 4 lane, instead of the chain's four ALU
//   operations and an IMAD: 16.5 instead of 20.5 issued instructions per value (ncu, N = 8),
//   5-15% faster on the LLaMA shapes for 11-17% more bytes (docs/BENCHMARKS.md, run 11).
// The slice's active columns are one warp-uniform 64-bit mask; a batch that runs out of
// columns processes only those it has. Full tiles (every tile but maybe the last) are a
// template instance with 32 lanes, so their loads take immediate offsets.
// Fused zeroing (as dense_colmajor): blocks with blockIdx.y = 0 zero their row tile of y and
// publish the launch's epoch in flags[rt]; the others wait for it before their atomics.
// flags == nullptr: no zeroing, the product is added to y (the decode runner's mode).

#define BCBC_TILE 512
#define BCBC_WARPS 8
#define BCBC_BATCH 4

__device__ __forceinline__ u32 bcbc_ld32(const unsigned char* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 bcbc_ld16(const unsigned char* p) {
    unsigned short v;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 bcbc_bit_index(u32 one_bit) {
    u32 s;
    asm("bfind.u32 %0, %1;" : "=r"(s) : "r"(one_bit));
    return s;
}

// The product of one row tile's blocks, one warp slice of columns per warp. LANES is the
// tile's stored lanes when known at compile time (32: every tile but perhaps the last, so the
// loads take immediate offsets), 0 for the last tile's run-time `last_lanes`.
// NB: tokens per launch (1: the decode step's product; 4: the union product of up to four,
// n_tokens of them used, x and y rows ldx and ldy apart). acc holds [BCBC_WARPS][NB][16][32].
template <int N, bool IDX, int LANES, int NB>
__device__ __forceinline__ void bcbc_tile(float* acc, const unsigned char* __restrict__ blocks,
                                          const float* __restrict__ x, int ldx, int n_tokens,
                                          float* __restrict__ y, int ldy,
                                          int M, int K, float t, int cols_per_warp,
                                          int last_lanes, u32* __restrict__ flags, u32 epoch) {
    constexpr int IW = (N + 7) / 8;  // IDX: index words per lane
    constexpr u32 FULL_BLOCK_BYTES = IDX ? 64 * N + 128 * IW : 64 * N + 64;
    constexpr int WORDS = N / 2 + 1;  // +1: the tail slot of odd N (unused for even N)
    constexpr int META = IDX ? IW : 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rt = blockIdx.x;
    const unsigned char* tile = blocks + (size_t)rt * (size_t)K * FULL_BLOCK_BYTES;
    // Lanes stored in this tile (the last tile stores only those holding rows < M) and the
    // tile's block size; lanes past them do no loads and add zeros to rows that are not written.
    const int lanes = LANES ? LANES : last_lanes;
    // IDX: the index words start at the first 4-byte boundary after the values.
    const u32 idx_at = ((u32)lanes * 2 * N + 3u) & ~3u;
    const u32 block_bytes = lanes == 32 ? FULL_BLOCK_BYTES
                            : IDX      ? (idx_at + 4u * IW * (u32)lanes + 15u) & ~15u
                                       : ((u32)lanes * (2 * N + 2) + 15u) & ~15u;
    const bool stored = LANES == 32 || lane < lanes;
    float* warp_acc = acc + warp * NB * 512;
#pragma unroll
    for (int s = 0; s < 16 * NB; ++s) warp_acc[s * 32 + lane] = 0.f;
    const int begin = (blockIdx.y * BCBC_WARPS + warp) * cols_per_warp;
    const int end = min(begin + cols_per_warp, K);
    // Per-lane bases of the 4-byte and the 2-byte loads of a block.
    const unsigned char* base4 = tile + 4 * lane;
    const unsigned char* base2 = tile + 2 * lane;

    // Activations are written by the previous kernel of a decode step: read them only after it.
    pdl_wait();
    if (flags && blockIdx.y == 0) {
        for (int r = threadIdx.x; r < BCBC_TILE; r += blockDim.x)
            if (rt * BCBC_TILE + r < M) y[rt * BCBC_TILE + r] = 0.f;
        publish_zeroed_tile(flags + rt, epoch);
    }
    // Each token's inputs masked on their own; a column is listed when active in any token.
    float xw[2][NB];
    u32 half_mask[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int k = begin + 32 * h + lane;
        bool any = false;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            float v = 0.f;
            if (k < end && j < n_tokens) {
                v = __ldg(x + (size_t)j * ldx + k);
                bool a = active(v, t);
                any |= a;
                v = a ? v : 0.f;
            }
            xw[h][j] = v;
        }
        half_mask[h] = __ballot_sync(FULL_MASK, k < end && any);
    }
    // The slice's active columns, bit s = column begin + s (warp-uniform).
    u64 pending = (u64)half_mask[1] << 32 | half_mask[0];

    // Lanes that store nothing keep zero values on their N lowest rows (their rows are >= M).
    u32 words[2][BCBC_BATCH][WORDS];
    u32 meta[2][BCBC_BATCH][META];
#pragma unroll
    for (int st = 0; st < 2; ++st)
#pragma unroll
        for (int u = 0; u < BCBC_BATCH; ++u) {
#pragma unroll
            for (int w = 0; w < WORDS; ++w) words[st][u][w] = 0u;
            if (IDX) {
                meta[st][u][0] = 0x76543210u;
                if (IW > 1) meta[st][u][IW - 1] = 0xfedcba98u;
            } else {
                meta[st][u][0] = (1u << N) - 1u;
            }
        }
    float xs[2][BCBC_BATCH][NB];
    int count[2];
    // The next BATCH active columns into stage st; count[st] = how many there were (the rest
    // of the stage is not processed).
    auto fetch = [&](int st) {
        int n = 0;
#pragma unroll
        for (int u = 0; u < BCBC_BATCH; ++u) {
            const bool have = pending != 0;
            const int s = have ? __ffsll((long long)pending) - 1 : 0;
            pending &= pending - 1;
#pragma unroll
            for (int j = 0; j < NB; ++j)
                xs[st][u][j] = __shfl_sync(FULL_MASK, s < 32 ? xw[0][j] : xw[1][j], s & 31);
            n += have ? 1 : 0;
            if (have && stored) {
                const size_t at = (size_t)(begin + s) * block_bytes;
                const unsigned char* p4 = base4 + at;
                const unsigned char* p2 = base2 + at;
#pragma unroll
                for (int w = 0; w < N / 2; ++w) words[st][u][w] = bcbc_ld32(p4 + w * lanes * 4);
                if (N & 1) words[st][u][N / 2] = bcbc_ld16(p2 + (N / 2) * 4 * lanes);
                if (IDX) {
#pragma unroll
                    for (int w = 0; w < IW; ++w) meta[st][u][w] = bcbc_ld32(p4 + idx_at + w * lanes * 4);
                } else {
                    meta[st][u][0] = bcbc_ld16(p2 + 2 * lanes * N);
                }
            }
        }
        count[st] = n;
    };
    // Byte offset of this lane's row 0 within the warp's accumulators (row s at + 128 s).
    const u32 lane_base = 4u * (u32)lane;
    char* acc_bytes = (char*)warp_acc;
    auto process = [&](int st) {
#pragma unroll
        for (int u = 0; u < BCBC_BATCH; ++u) {
            if (u >= count[st]) break;
            // Byte offset of slot i's accumulator: lane_base + 128 row.
            u32 off[N];
            if (IDX) {
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    // Nibble i % 8 of word i / 8 shifted to bits 7..10, then one LOP3.
                    const u32 w = meta[st][u][i / 8];
                    const int sh = 4 * (i % 8) - 7;
                    off[i] = ((sh < 0 ? w << -sh : w >> sh) & 0x780u) | lane_base;
                }
            } else {
                u32 b = meta[st][u][0];
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    u32 rest = b & (b - 1u);
                    off[i] = bcbc_bit_index(b ^ rest) * 128u + lane_base;
                    b = rest;
                }
            }
            float v[N];
#pragma unroll
            for (int i = 0; i < N; ++i) {
                u32 w = words[st][u][i / 2];
                v[i] = h2f((unsigned short)((i & 1) ? (w >> 16) : (w & 0xffffu)));
            }
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                if (j >= n_tokens) break;  // uniform
                char* tok_acc = acc_bytes + j * 2048;  // token j's [16][32] floats
                float a[N];
#pragma unroll
                for (int i = 0; i < N; ++i) a[i] = *(float*)(tok_acc + off[i]);
#pragma unroll
                for (int i = 0; i < N; ++i) a[i] = fmaf(v[i], xs[st][u][j], a[i]);
#pragma unroll
                for (int i = 0; i < N; ++i) *(float*)(tok_acc + off[i]) = a[i];
            }
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
    // Thread (s, l): row 16 l + s of the tile, conflict-free reads (bank = l).
    for (int i = threadIdx.x; i < BCBC_TILE; i += blockDim.x) {
        int l = i & 31, s = i >> 5;
        int r = rt * BCBC_TILE + l * 16 + s;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            if (j >= n_tokens) break;
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < BCBC_WARPS; ++w) sum += acc[(w * NB + j) * 512 + s * 32 + l];
            if (r < M && sum != 0.f) atomicAdd(y + (size_t)j * ldy + r, sum);
        }
    }
}

template <int N, bool IDX>
__device__ __forceinline__ void bcbc_kernel(const unsigned char* __restrict__ blocks,
                                            const float* __restrict__ x, float* __restrict__ y,
                                            int M, int K, float t, int cols_per_warp,
                                            int last_lanes, u32* __restrict__ flags, u32 epoch) {
    __shared__ float acc[BCBC_WARPS * 16 * 32];
    pdl_release();
    if (blockIdx.x == gridDim.x - 1 && last_lanes != 32)
        bcbc_tile<N, IDX, 0, 1>(acc, blocks, x, K, 1, y, M, M, K, t, cols_per_warp, last_lanes, flags, epoch);
    else
        bcbc_tile<N, IDX, 32, 1>(acc, blocks, x, K, 1, y, M, M, K, t, cols_per_warp, last_lanes, flags, epoch);
}

// The union product of up to BCBC_UNION_TOKENS tokens (issue 28): the kernel above with each
// listed column (active in some token) multiplied into every token's accumulators (dynamic
// shared memory, 16 KB per token). Always adds to y (rows ldy apart).
#define BCBC_UNION_TOKENS 4
template <int N, bool IDX>
__device__ __forceinline__ void bcbc_union_kernel(const unsigned char* __restrict__ blocks,
                                                  const float* __restrict__ x, int ldx, int n_tokens,
                                                  float* __restrict__ y, int ldy, int M, int K, float t,
                                                  int cols_per_warp, int last_lanes) {
    extern __shared__ float union_acc[];
    pdl_release();
    if (blockIdx.x == gridDim.x - 1 && last_lanes != 32)
        bcbc_tile<N, IDX, 0, BCBC_UNION_TOKENS>(union_acc, blocks, x, ldx, n_tokens, y, ldy, M, K, t,
                                                cols_per_warp, last_lanes, nullptr, 0);
    else
        bcbc_tile<N, IDX, 32, BCBC_UNION_TOKENS>(union_acc, blocks, x, ldx, n_tokens, y, ldy, M, K, t,
                                                 cols_per_warp, last_lanes, nullptr, 0);
}

#define BCBC_ARGS                                                                        \
    const unsigned char *__restrict__ blocks, const float *__restrict__ x,               \
        float *__restrict__ y, int M, int K, float t, int cols_per_warp, int last_lanes,        \
        u32 *__restrict__ flags, u32 epoch
#define BCBC_PASS blocks, x, y, M, K, t, cols_per_warp, last_lanes, flags, epoch
#define BCBC_UNION_ARGS                                                                  \
    const unsigned char *__restrict__ blocks, const float *__restrict__ x, int ldx,      \
        int n_tokens, float *__restrict__ y, int ldy, int M, int K, float t,            \
        int cols_per_warp, int last_lanes
#define BCBC_UNION_PASS blocks, x, ldx, n_tokens, y, ldy, M, K, t, cols_per_warp, last_lanes
// One kernel per slot count N (bcbc_spmspv_n<N>): N sizes the register arrays. Up to N = 8
// the kernel fits 85 registers (3 blocks, 24 warps per SM: more loads in flight); above, the
// two stages of N/2 + 1 words per column need up to 128 (N = 11 under the 85-register cap ran at
// 0.69-0.75x cuBLAS in run 9, with 128 at 0.75-0.85x in run 10, docs/BENCHMARKS.md).
#define BCBC_KERNEL(NN)                                                                  \
    extern "C" __global__ void __launch_bounds__(256, (NN) <= 8 ? 3 : 2)                 \
        bcbc_spmspv_n##NN(BCBC_ARGS) {                                                   \
        bcbc_kernel<NN, false>(BCBC_PASS);                                              \
    }                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, (NN) <= 8 ? 3 : 2)                 \
        bcbc_idx_n##NN(BCBC_ARGS) {                                                      \
        bcbc_kernel<NN, true>(BCBC_PASS);                                               \
    }                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 2) bcbc_union_n##NN(BCBC_UNION_ARGS) { \
        bcbc_union_kernel<NN, false>(BCBC_UNION_PASS);                                  \
    }                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 2) bcbc_idx_union_n##NN(BCBC_UNION_ARGS) { \
        bcbc_union_kernel<NN, true>(BCBC_UNION_PASS);                                   \
    }
BCBC_KERNEL(1)
BCBC_KERNEL(2)
BCBC_KERNEL(3)
BCBC_KERNEL(4)
BCBC_KERNEL(5)
BCBC_KERNEL(6)
BCBC_KERNEL(7)
BCBC_KERNEL(8)
BCBC_KERNEL(9)
BCBC_KERNEL(10)
BCBC_KERNEL(11)
BCBC_KERNEL(12)
BCBC_KERNEL(13)
BCBC_KERNEL(14)
BCBC_KERNEL(15)
BCBC_KERNEL(16)

// The matrix as f16, column-major: out[k · Mp + r] (Mp = 512 (tiles - 1) + 16 last_lanes),
// the batched prefill's copy for cuBLAS (a Balanced-CBC model's prompt used to run token by
// token through the spMspV kernel). Either layout (idx: the index words, else the mask chain).
// One warp per block (rt, k), lane j its 16 rows 512 rt + 16 j ..: the lane zeroes its 16
// halves in shared memory, adds each of its N slots at the slot's row (adds, not stores: a
// padding slot holds 0), and writes the 32 bytes with two 16-byte stores, so a warp writes the
// tile's part of column k (1 KB) contiguously. Lanes past the last tile's stored ones write
// nothing: those rows are past Mp.
extern "C" __global__ void __launch_bounds__(256) bcbc_to_f16_t(const unsigned char* __restrict__ blocks,
                                                                 f16_bits* __restrict__ out, int K, int N,
                                                                 int idx, int tiles, int last_lanes, int Mp) {
    __shared__ __align__(16) f16_bits rows[BCBC_WARPS][32][16];
    pdl_wait_then_release();  // the previous GEMM may still read `out`
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t wid = (size_t)blockIdx.x * BCBC_WARPS + warp;
    if (wid >= (size_t)tiles * K) return;
    const int rt = (int)(wid / K), k = (int)(wid % K);
    const u32 iw = (u32)(N + 7) / 8;
    const u32 full = idx ? 64u * N + 128u * iw : 64u * N + 64u;
    const int lanes = rt == tiles - 1 ? last_lanes : 32;
    const u32 idx_at = ((u32)lanes * 2 * N + 3u) & ~3u;
    const u32 block_bytes = lanes == 32 ? full
                            : idx      ? (idx_at + 4u * iw * (u32)lanes + 15u) & ~15u
                                       : ((u32)lanes * (2 * N + 2) + 15u) & ~15u;
    if (lane >= lanes) return;
    const unsigned char* b = blocks + (size_t)rt * (size_t)K * full + (size_t)k * block_bytes;
    uint4* mine = reinterpret_cast<uint4*>(&rows[warp][lane][0]);
    mine[0] = make_uint4(0u, 0u, 0u, 0u);
    mine[1] = make_uint4(0u, 0u, 0u, 0u);
    u32 mask = idx ? 0u : bcbc_ld16(b + 2 * lanes * N + 2 * lane);
    for (int i = 0; i < N; ++i) {
        // Slot i: half i % 2 of word i / 2, or the odd-N tail.
        const u32 at = (N & 1) && i == N - 1 ? 4u * (u32)(N / 2) * lanes + 2u * lane
                                             : 4u * ((u32)(i / 2) * lanes + lane) + 2u * (i & 1);
        const u32 v = bcbc_ld16(b + at);
        int r;
        if (idx) {
            r = (int)((bcbc_ld32(b + idx_at + 4u * ((u32)(i / 8) * lanes + lane)) >> (4 * (i % 8))) & 15u);
        } else {
            r = __ffs(mask) - 1;
            mask &= mask - 1u;
        }
        if (r >= 0) rows[warp][lane][r] = f2h(h2f(rows[warp][lane][r]) + h2f((unsigned short)v));
    }
    __threadfence_block();  // the 16 halves stored above, read back as two vectors
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)k * Mp + (size_t)rt * BCBC_TILE + 16 * lane);
    dst[0] = mine[0];
    dst[1] = mine[1];
}
