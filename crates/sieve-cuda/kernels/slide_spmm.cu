// SlideSparse (2N-2):2N weights on the 2:4 sparse tensor cores (src/slide.rs; the format is
// sieve-formats' slide.rs). Y[n][M] = lift(mask_t(X))[n][K'] · W'ᵀ, W' the expanded 2:4 matrix.
//
// Two kernels per product:
//   slide_lift_rows: X (n rows of K f32, row stride ldx) -> X' (n rows of K'p f16, row stride
//                    K'p), X'[i][k'] = f16(mask_t(X[i][map[k']])), 0 where map[k'] = LIFT_PAD or
//                    k' >= K'. The TEAL mask and the f16 rounding of the f16 path's per-token
//                    conversion, with the lifting fused in.
//   slide_spmm_nt{1,2,4,8}: X' times the re-laid-out W' on mma.sp m16n8k32 (8 * nt tokens per
//                    block), f32 accumulation; y written, added, or (split K) atomically added.
//   (a split-K launch that writes zeroes y first with prefill.cu's zero_rows)
//   slide_to_f16_rows: the original W (M x K, f16, rows `ld` apart) from the device layout,
//                    for prompts long enough that cuBLAS on an f16 copy beats mma.sp (the
//                    decode kernel above reuses no weight across token tiles: src/slide.rs
//                    `DECODE_MIN_TOKENS`). One thread per uint4 of values: its 4 (row, group)
//                    pairs, their nibbles from the two metadata words of lanes (g, 2f) and
//                    (g, 2f + 1), each value that is not +0 stored at the original column the
//                    lift map gives its lifted column (every original product sits in exactly
//                    one window, so no two threads write one element). The caller zeroes W.
//
// Lifted activations X' (device order). K'p = K' padded to STAGE_K = 128. Within every window of
// 32 lifted columns (one mma's K) the 16 column pairs are stored transposed 4 x 4, so that the
// four B registers of lane (g, t) are one 16-byte vector:
//
//   lifted offset k in the window = 2 * (t + 4 j) + e      (pair t + 4 j, element e)
//   stored offset                 = 8 * t + 2 * j + e     (lane t's b_j, low/high half e)
//
//   B register b_j of mma.m16n8k32 (row.col, f16): lane (g = lane / 4, t = lane % 4) holds
//   B[k = 2t + 8j, 2t + 8j + 1][token g]  ->  the uint4 at stored offset 8t of token g's window.
//
// Weights (device order, built once on upload by src/slide.rs: SlideDevice::new). Rows padded to
// whole warps (32 rows = 2 row tiles of 16), K' to K'p. A row tile `rt` (16 rows) and a K pair
// `kp` (64 lifted columns = two mma fragments f = 0, 1) hold:
//
//   values[((rt * kpairs + kp) * 2 + f) * 32 + lane]  (uint4 = mma registers a0..a3)
//      a0 = row 16rt+g,   the 2 kept values of lifted group 16kp + 8f + t
//      a1 = row 16rt+g+8, same group          (value of the lower in-group index in the low half)
//      a2 = row 16rt+g,   group 16kp + 8f + t + 4
//      a3 = row 16rt+g+8, group 16kp + 8f + t + 4
//   meta[(rt * kpairs + kp) * 32 + lane]              (u32, one per lane)
//      lane (g, t), f = t / 2, h = t % 2: nibble c (bits 4c..) = row 16rt+g, group
//      16kp + 8f + 4h + c; nibble 4 + c (bits 16 + 4c..) = row 16rt+g+8, same group.
//      The nibble is slide's idx0 | idx1 << 2, which is mma.sp's 16-bit-type encoding.
//
// mma.sp with sparsity selector 0 reads metadata from lanes t = 0, 1 of each quad: lane (g, h)
// supplies rows g and g+8 of fragment columns 16h .. 16h+15. For fragment 0 those are the words
// lanes t = 0, 1 loaded; for fragment 1 the words of lanes t = 2, 3, moved down by one shuffle
// (one 4-byte load per lane per K pair: the metadata costs 1/8 of the values, nothing wasted).
// Padding groups (K' .. K'p, rows past M) hold +0 values under nibble 0x4 (indices 0, 1): the
// all-zero nibble is not a valid mma.sp index pair.
//
// Thread mapping of slide_spmm: 128 threads = 4 warps along M, each warp 2 row tiles (32 rows),
// a block 128 rows x 8 nt tokens; blockIdx.y picks the token tile, blockIdx.z the K range (split
// K). Per stage of 128 lifted columns: the block stages X' (8 nt tokens x 128, f16) in shared
// memory with cp.async, double-buffered; each warp loads its weights of the stage (8 uint4 and 2
// words per lane, coalesced 512-byte rows) straight into registers one stage ahead, then runs
// 2 row tiles x 4 fragments x nt token tiles of mma.sp. Accumulators: lane (g, t) holds rows g, g+8
// of its row tile x tokens 2t, 2t+1 of each token tile.

#define SLIDE_LIFT_PAD 0xffffffffu
#define SLIDE_STAGE_K 128                        // lifted columns per pipeline stage
#define SLIDE_XS_STRIDE (SLIDE_STAGE_K + 32)     // f16 per staged token row: 320 bytes, so that
                                                 // rows g, g+1 fall on opposite bank halves
#define SLIDE_WARPS 4
#define SLIDE_ROW_TILES 2                        // row tiles of 16 per warp

// Plain `.sp`, not `.sp::ordered_metadata`: ptxas advises the latter for future architectures (on
// sm_90 both run the same), and it would be safe here (every nibble has idx0 < idx1), but it needs
// PTX ISA 8.5 (CUDA 12.5) while `.sp` compiles with any NVRTC that knows sm_90a.
// D = A · B + D on the 2:4 sparse tensor cores: A 16 x 32 f16 compressed to 16 x 16 (a), B 32 x 8
// f16 (b), f32 accumulators; metadata e, sparsity selector 0.
__device__ __forceinline__ void mma_sp_16832(float c[4], const uint4& a, const uint4& b, u32 e) {
    asm volatile(
        "mma.sp.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, 0x0;"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y), "r"(b.z), "r"(b.w), "r"(e));
}

// Lifted offset (within a 32-column window) of stored offset q: the inverse of the transpose
// drawn above.
__device__ __forceinline__ int slide_lifted_of_stored(int q) {
    const int t = q >> 3, j = (q >> 1) & 3, e = q & 1;
    return 2 * (t + 4 * j) + e;
}

// One thread per 8 stored f16 (16 bytes) of X': gathers through the lift map, masks, rounds.
extern "C" __global__ void __launch_bounds__(256)
slide_lift_rows(const float* __restrict__ x, int ldx, const u32* __restrict__ lift_map, int k_lifted,
                int k_padded, f16_bits* __restrict__ out, int n, float t) {
    pdl_wait_then_release();
    const int chunks_per_row = k_padded >> 3;
    const size_t total = (size_t)n * chunks_per_row;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / chunks_per_row;
        const int chunk = (int)(i % chunks_per_row);
        const int window = chunk >> 2, q0 = (chunk & 3) << 3;
        const float* xr = x + row * (size_t)ldx;
        u32 packed[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            unsigned short h[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int kl = window * 32 + slide_lifted_of_stored(q0 + 2 * p + e);
                float v = 0.f;
                if (kl < k_lifted) {
                    const u32 src = lift_map[kl];
                    if (src != SLIDE_LIFT_PAD) {
                        const float xv = xr[src];
                        v = active(xv, t) ? xv : 0.f;
                    }
                }
                h[e] = f2h(v);
            }
            packed[p] = (u32)h[0] | ((u32)h[1] << 16);
        }
        *reinterpret_cast<uint4*>(out + row * (size_t)k_padded + (size_t)chunk * 8) =
            make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
}

// mode: 0 write y, 1 add to y, 2 atomically add to y (split K).
template <int NT>
__device__ __forceinline__ void slide_spmm(const uint4* __restrict__ values, const u32* __restrict__ meta,
                                           const f16_bits* __restrict__ xl, float* __restrict__ y, int M,
                                           int row_tiles, int kpairs, int n, int ldy, int stages_per_split,
                                           int mode) {
    constexpr int TOK = 8 * NT;
    constexpr int X_CHUNKS = TOK * SLIDE_STAGE_K / 8;  // 16-byte copies per stage
    __shared__ __align__(16) f16_bits xs[2][TOK][SLIDE_XS_STRIDE];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int rt0 = (blockIdx.x * SLIDE_WARPS + warp) * SLIDE_ROW_TILES;
    // Rows are padded to whole warps, so a warp's two row tiles are both present or both absent.
    const bool has_rows = rt0 < row_tiles;
    const int tok0 = blockIdx.y * TOK;
    const int k_padded = kpairs * 64;
    const int stages = kpairs >> 1;
    const int s_begin = blockIdx.z * stages_per_split;
    const int s_end = min(stages, s_begin + stages_per_split);

    // Weights are static operands: start the first stage's loads before waiting on the
    // previous kernel (common.cuh, programmatic dependent launch).
    uint4 a_cur[SLIDE_ROW_TILES][4], a_next[SLIDE_ROW_TILES][4];
    u32 e_cur[SLIDE_ROW_TILES][2], e_next[SLIDE_ROW_TILES][2];
    auto load_weights = [&](int s, uint4 (&a)[SLIDE_ROW_TILES][4], u32 (&e)[SLIDE_ROW_TILES][2]) {
#pragma unroll
        for (int r = 0; r < SLIDE_ROW_TILES; ++r) {
            const size_t pair0 = (size_t)(rt0 + r) * kpairs + 2 * s;
#pragma unroll
            for (int f = 0; f < 4; ++f) a[r][f] = ld_stream16(values + (pair0 * 2 + f) * 32 + lane);
#pragma unroll
            for (int p = 0; p < 2; ++p) e[r][p] = __ldg(meta + (pair0 + p) * 32 + lane);
        }
    };
    if (has_rows && s_begin < s_end) load_weights(s_begin, a_cur, e_cur);
    pdl_wait_then_release();

    auto stage_x = [&](int s, int buf) {
        for (int c = threadIdx.x; c < X_CHUNKS; c += SLIDE_WARPS * 32) {
            const int tok = c / (SLIDE_STAGE_K / 8), col = (c % (SLIDE_STAGE_K / 8)) * 8;
            const bool in = tok0 + tok < n;
            const f16_bits* src = in ? xl + (size_t)(tok0 + tok) * k_padded + (size_t)s * SLIDE_STAGE_K + col : xl;
            cp_async16(&xs[buf][tok][col], src, in ? 16 : 0);
        }
        cp_async_commit();
    };

    float acc[SLIDE_ROW_TILES][NT][4];
#pragma unroll
    for (int r = 0; r < SLIDE_ROW_TILES; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[r][j][i] = 0.f;

    if (s_begin < s_end) stage_x(s_begin, 0);
    for (int s = s_begin; s < s_end; ++s) {
        const int buf = (s - s_begin) & 1;
        const bool more = s + 1 < s_end;
        if (more) {
            stage_x(s + 1, buf ^ 1);
            if (has_rows) load_weights(s + 1, a_next, e_next);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (has_rows) {
            // Fragment f of the stage is fragment f % 2 of K pair f / 2; an odd fragment's words
            // sit in lanes t = 2, 3 and move down to t = 0, 1 (lanes t = 2, 3 are not read).
            u32 e[SLIDE_ROW_TILES][4];
#pragma unroll
            for (int r = 0; r < SLIDE_ROW_TILES; ++r)
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    e[r][2 * p] = e_cur[r][p];
                    e[r][2 * p + 1] = __shfl_down_sync(FULL_MASK, e_cur[r][p], 2);
                }
#pragma unroll
            for (int f = 0; f < 4; ++f) {
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const uint4 b = *reinterpret_cast<const uint4*>(&xs[buf][8 * j + g][32 * f + 8 * t]);
#pragma unroll
                    for (int r = 0; r < SLIDE_ROW_TILES; ++r) mma_sp_16832(acc[r][j], a_cur[r][f], b, e[r][f]);
                }
            }
        }
        // The buffer just read is the one the next iteration's cp.async overwrites.
        __syncthreads();
        if (more) {
#pragma unroll
            for (int r = 0; r < SLIDE_ROW_TILES; ++r) {
#pragma unroll
                for (int f = 0; f < 4; ++f) a_cur[r][f] = a_next[r][f];
                e_cur[r][0] = e_next[r][0];
                e_cur[r][1] = e_next[r][1];
            }
        }
    }
    if (!has_rows) return;

#pragma unroll
    for (int r = 0; r < SLIDE_ROW_TILES; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = (rt0 + r) * 16 + g + (i >= 2 ? 8 : 0);
                const int tok = tok0 + 8 * j + 2 * t + (i & 1);
                if (row >= M || tok >= n) continue;
                float* dst = y + (size_t)tok * ldy + row;
                const float v = acc[r][j][i];
                if (mode == 0)
                    *dst = v;
                else if (mode == 1)
                    *dst += v;
                else if (v != 0.f)
                    atomicAdd(dst, v);
            }
}

#define SLIDE_SPMM_KERNEL(NT)                                                                          \
    extern "C" __global__ void __launch_bounds__(SLIDE_WARPS * 32) slide_spmm_nt##NT(                 \
        const uint4* __restrict__ values, const u32* __restrict__ meta, const f16_bits* __restrict__ xl, \
        float* __restrict__ y, int M, int row_tiles, int kpairs, int n, int ldy, int stages_per_split,  \
        int mode) {                                                                                    \
        slide_spmm<NT>(values, meta, xl, y, M, row_tiles, kpairs, n, ldy, stages_per_split, mode);      \
    }
SLIDE_SPMM_KERNEL(1)
SLIDE_SPMM_KERNEL(2)
SLIDE_SPMM_KERNEL(4)
SLIDE_SPMM_KERNEL(8)

// Launch: one thread per uint4 of values (row tiles x K pairs x 2 fragments x 32), grid-stride.
// out is zeroed by the caller; out[r * ld + c] = W[r][c] for every kept value that is not +0.
extern "C" __global__ void __launch_bounds__(256)
slide_to_f16_rows(const uint4* __restrict__ values, const u32* __restrict__ meta, const u32* __restrict__ lift_map,
                  int rows, int groups_per_row, int kpairs, long long slots, int ld, f16_bits* __restrict__ out) {
    pdl_wait_then_release();
    for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q < slots;
         q += (long long)gridDim.x * blockDim.x) {
        const int lane = (int)(q & 31), frag = (int)((q >> 5) & 1);
        const long long tile_pair = q >> 6;  // rt * kpairs + kp
        const int kp = (int)(tile_pair % kpairs), rt = (int)(tile_pair / kpairs);
        const int g = lane >> 2, t = lane & 3;
        const uint4 v = values[q];
        const u32 words[4] = {v.x, v.y, v.z, v.w};
        const u32* mrow = meta + tile_pair * 32 + g * 4;
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {
            const int row = rt * 16 + g + 8 * (reg & 1);
            const int group = 16 * kp + 8 * frag + t + 4 * (reg >> 1);
            if (row >= rows || group >= groups_per_row) continue;
            const u32 mw = mrow[2 * frag + (reg >> 1)];
            const u32 nibble = (mw >> (4 * (t + 4 * (reg & 1)))) & 0xfu;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 bits = (words[reg] >> (16 * e)) & 0xffffu;
                if (bits == 0u) continue;  // +0: a placeholder (or a zero) writes nothing
                const u32 idx = e == 0 ? (nibble & 3u) : (nibble >> 2);
                const u32 col = lift_map[4 * group + idx];
                if (col == SLIDE_LIFT_PAD) continue;
                out[(size_t)row * ld + col] = (f16_bits)bits;
            }
        }
    }
}
