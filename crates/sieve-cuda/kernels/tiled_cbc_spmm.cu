// Tiled-CBC times a block of tokens on the tensor cores (SPDP's SpMM, seed 002): the weights
// are read compressed, once per block of up to 64 tokens, and decoded straight into mma.sync
// A fragments; no f16 copy of the matrix is written.
//
//   Y[n][M] (+)= A[n][K] · Wᵀ     W in Tiled-CBC (sieve-formats/src/tiled_cbc.rs: read its header),
//                                 A f16 rows (lda elements apart, already TEAL-masked by the
//                                 caller), Y f32 rows (ldy floats apart)
//
// One GTile (256 rows x 16 columns) is exactly one k step of m16n8k16 for 16 row tiles, so the
// pipeline walks GTiles: block (token tile, split, row tile rt) takes rows 256 rt .. +255, tokens
// 8 NT tt .. +8 NT - 1, and GTiles kt0 .. kt1 of its split (consecutive in memory: g = rt KT + kt).
//
// Per GTile, one stage of shared memory (3 stages, cp.async, 16-byte copies), filled by all
// 256 threads:
//   vals  tile_offset[g] .. tile_offset[g+1]   (<= 16 x 256 f16)
//   bits  the 16 columns' 4 bitmap words, read as 8 u32 halves per column (rows 32 q .. +31)
//   rank  the rank table of tiled_cbc.rs (8 bytes per column: set bits in rows < 32 q)
//   info  16 ColInfo words (value offset << 16 | nnz)
//   x     A[tok][16 kt .. +15] for the block's tokens, 24 f16 per row (16 + 8 of padding, so
//         the B loads below hit 32 distinct banks); rows past n or columns past K are zero
//
// Thread mapping: 8 warps; warp w owns rows 32 w .. 32 w + 31 of the tile (two m16 row tiles),
// which are the half-word q = w of every column's bitmap. Lane (g = lane / 4, t = lane % 4)
// holds, in each row tile i, the A fragment of rows r = 16 i + g and r + 8, columns 2t, 2t+1,
// 2t+8, 2t+9 (PTX ISA, m16n8k16 f16 A layout):
//
//      column c of the 4:  half = bits[c][w]            (32 rows of this warp)
//                          base = (info[c] >> 16) + rank[c][w]
//      row o (0..31):      set  = half bit o
//                          v    = set ? vals[base + popc(half bits below o)] : +0
//
// so each lane decodes 16 values per GTile: 4 columns x 4 rows (o = g, g + 8, g + 16, g + 24).
// B fragments (tokens 8 j + g, k = 2t, 2t+1 and 2t+8, 2t+9) are two u32 loads from x. Per GTile
// a warp issues 2 x NT mma.sync; accumulators: 2 row tiles x NT token tiles x 4 f32.
// Output: lane (g, t) holds rows g, g+8 x tokens 2t, 2t+1 of each (row tile, token tile); it is
// written (mode 0), added (mode 1) or atomically added (mode 2, split K over GTiles; y zeroed
// first by prefill.cu's zero_rows when the product writes).
//
// Requirements (checked by the launcher in src/tiled_cbc.rs): lda a multiple of 8 and A
// 16-byte aligned (16-byte copies), K a multiple of 8 (a copy of 8 columns is all in or all out).
// Padding rows and columns of the format have clear bits, so they decode to +0.

#define TSP_WARPS 8
#define TSP_STAGES 3
#define TSP_TILE_M 256
#define TSP_TILE_K 16
#define TSP_X_STRIDE 24

template <int NT>
struct TspStage {
    f16_bits vals[TSP_TILE_K * TSP_TILE_M];
    u32 bits[TSP_TILE_K * 8];
    unsigned char rank[TSP_TILE_K * 8];
    u32 info[TSP_TILE_K];
    f16_bits x[8 * NT][TSP_X_STRIDE];
};

// mode: 0 write y, 1 add to y, 2 atomically add to y (split K).
template <int NT>
__device__ __forceinline__ void tcbc_spmm(const u32* __restrict__ tile_offset, const u32* __restrict__ col_info,
                                          const u64* __restrict__ bitmaps, const unsigned char* __restrict__ rank,
                                          const f16_bits* __restrict__ values, const f16_bits* __restrict__ a, int lda,
                                          float* __restrict__ y, int ldy, int M, int K, int KT, int n,
                                          int gtiles_per_split, int mode) {
    constexpr int TOK = 8 * NT;
    __shared__ __align__(16) TspStage<NT> st[TSP_STAGES];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int tok0 = blockIdx.x * TOK;
    const int rt = blockIdx.z;
    const int kt0 = blockIdx.y * gtiles_per_split;
    const int kt1 = min(KT, kt0 + gtiles_per_split);
    const int count = kt1 - kt0;
    if (count <= 0) return;
    const size_t g0 = (size_t)rt * KT + kt0;

    // Stage `i` (local GTile index) into buffer i % TSP_STAGES: the weights' chunks (values,
    // bitmaps (32), rank (8), info (4)), then the tokens' (2 per token), then one commit, also
    // past the end (an empty group), so that the wait counts below stay fixed.
    auto issue_weights = [&](int i) {
        if (i >= count) return;
        TspStage<NT>& s = st[i % TSP_STAGES];
        const size_t gi = g0 + i;
        const u32 v0 = __ldg(tile_offset + gi), v1 = __ldg(tile_offset + gi + 1);
        const int val_chunks = (int)(v1 - v0) >> 3;
        const int total = val_chunks + 32 + 8 + 4;
        for (int c = tid; c < total; c += TSP_WARPS * 32) {
            if (c < val_chunks) {
                cp_async16(&s.vals[c * 8], values + v0 + (size_t)c * 8, 16);
            } else if (c < val_chunks + 32) {
                const int q = c - val_chunks;
                cp_async16(&s.bits[q * 4], bitmaps + gi * 64 + q * 2, 16);
            } else if (c < val_chunks + 40) {
                const int q = c - val_chunks - 32;
                cp_async16(&s.rank[q * 16], rank + gi * 128 + q * 16, 16);
            } else {
                const int q = c - val_chunks - 40;
                cp_async16(&s.info[q * 4], col_info + gi * 16 + q * 4, 16);
            }
        }
    };
    auto issue_tokens = [&](int i) {
        if (i < count && tid < 2 * TOK) {
            TspStage<NT>& s = st[i % TSP_STAGES];
            const int tok = tid >> 1, h = tid & 1;
            const int k = (kt0 + i) * TSP_TILE_K + 8 * h;
            const bool in = tok0 + tok < n && k < K;
            const f16_bits* src = in ? a + (size_t)(tok0 + tok) * lda + k : a;
            cp_async16(&s.x[tok][8 * h], src, in ? 16 : 0);
        }
        cp_async_commit();
    };

    // The weights do not depend on the previous kernel: the first stage's are requested before
    // waiting on it (programmatic dependent launch), the tokens only after.
    issue_weights(0);
    pdl_wait_then_release();
    issue_tokens(0);
    issue_weights(1);
    issue_tokens(1);

    // shift[k] = 32 - (g + 8 k): popc(half << shift) counts the set bits below row g + 8 k.
    u32 shift[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) shift[k] = 32u - (u32)(g + 8 * k);

    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    for (int i = 0; i < count; ++i) {
        issue_weights(i + 2);
        issue_tokens(i + 2);
        cp_async_wait<2>();
        __syncthreads();
        const TspStage<NT>& s = st[i % TSP_STAGES];

        // v[cc][k]: column 2t + (cc & 1) + 8 (cc >> 1), row g + 8 k of this warp's 32.
        u32 v[4][4];
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
            const int c = 2 * t + (cc & 1) + 8 * (cc >> 1);
            const u32 half = s.bits[c * 8 + warp];
            const u32 base = (s.info[c] >> 16) + s.rank[c * 8 + warp];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 below = __popc(__funnelshift_lc(0u, half, shift[k]));
                const bool set = (half >> (g + 8 * k)) & 1u;
                v[cc][k] = set ? (u32)s.vals[base + below] : 0u;
            }
        }
        // Row tile i2 holds rows g + 16 i2 (k = 2 i2) and g + 8 + 16 i2 (k = 2 i2 + 1).
        u32 afrag[2][4];
#pragma unroll
        for (int i2 = 0; i2 < 2; ++i2) {
            afrag[i2][0] = v[0][2 * i2] | (v[1][2 * i2] << 16);
            afrag[i2][1] = v[0][2 * i2 + 1] | (v[1][2 * i2 + 1] << 16);
            afrag[i2][2] = v[2][2 * i2] | (v[3][2 * i2] << 16);
            afrag[i2][3] = v[2][2 * i2 + 1] | (v[3][2 * i2 + 1] << 16);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const u32 b0 = *reinterpret_cast<const u32*>(&s.x[8 * j + g][2 * t]);
            const u32 b1 = *reinterpret_cast<const u32*>(&s.x[8 * j + g][2 * t + 8]);
#pragma unroll
            for (int i2 = 0; i2 < 2; ++i2) mma_16816(acc[i2][j], afrag[i2], b0, b1);
        }
        // The stage just read is the one stage i + 3 overwrites in the next iteration.
        __syncthreads();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = rt * TSP_TILE_M + warp * 32 + i2 * 16 + g + (e >= 2 ? 8 : 0);
                const int tok = tok0 + 8 * j + 2 * t + (e & 1);
                if (row >= M || tok >= n) continue;
                float* dst = y + (size_t)tok * ldy + row;
                const float val = acc[i2][j][e];
                if (mode == 0)
                    *dst = val;
                else if (mode == 1)
                    *dst += val;
                else
                    atomicAdd(dst, val);
            }
}

#define TCBC_SPMM_KERNEL(NT)                                                                             \
    extern "C" __global__ void __launch_bounds__(TSP_WARPS * 32, (NT) <= 4 ? 3 : 2) tcbc_spmm_nt##NT(                     \
        const u32* __restrict__ tile_offset, const u32* __restrict__ col_info, const u64* __restrict__ bitmaps, \
        const unsigned char* __restrict__ rank, const f16_bits* __restrict__ values,                      \
        const f16_bits* __restrict__ a, int lda, float* __restrict__ y, int ldy, int M, int K, int KT, int n,   \
        int gtiles_per_split, int mode) {                                                                  \
        tcbc_spmm<NT>(tile_offset, col_info, bitmaps, rank, values, a, lda, y, ldy, M, K, KT, n,          \
                      gtiles_per_split, mode);                                                             \
    }
TCBC_SPMM_KERNEL(1)
TCBC_SPMM_KERNEL(2)
TCBC_SPMM_KERNEL(4)
TCBC_SPMM_KERNEL(8)
