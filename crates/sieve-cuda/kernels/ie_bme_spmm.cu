// IE-BME (UnionSparse, seed 003) products on tensor cores: Y[n][:] = W · mask_t(X[n][:]) for
// N = 1..32 tokens, W stored as union bitmaps over 16 x 64 local tiles with INT4 or INT8 values
// (sieve-formats/src/ie_bme: read its header first). Rust side: src/ie_bme.rs.
//
// One tile t = (tr, tc): rows 16 tr .. +15 (in the tile's reordered order p = 0..15), columns
// 64 tc .. +63, cut into RA x CA areas (RA, CA in {1, 2}: Q = RA · CA areas of H_B x K_B =
// 16/RA x 64/CA). Bit (i, j) of the union bitmap says whether any area holds a value at
// (i, j); every set bit owns one *tuple*: the Q values of that position, one per area. Device
// layout per tile (built at upload, `IeBmeDevice`):
//
//   bitmaps  32/Q u32 words: logical bit b = i·K_B + j in word b / 32, bit b % 32 (the format's
//            u64 words split low half first)
//   tuples   at values + tile_offset[t]: tuple r (r = rank of its bit, row-major) is Q codes of
//            BITS bits, area q = a·CA + c in bits BITS·q ..; codes biased (int4 u = q + 8, int8
//            u = q + 128). The format's Q streams interleaved: the same bytes, one load per rank
//            instead of Q ("one traversal gathering the RA x CA area streams").
//   iperm    u64: nibble o = the reordered row p holding original row o
//   scales   f32 [G][Mp]: scale of original row r, column group g = 64 tc / group
//
// Thread mapping (the point of the design): a warp multiplies one tile as the A operand of
// mma.sync m16n8k16 (4 k steps of 16 columns). Lane (g = lane / 4, l = lane % 4) holds A rows
// g and g + 8, columns 2l, 2l+1, 2l+8, 2l+9 of each k step. With RA = CA = 2 those 32 values are
// exactly the 4 areas' values at union positions (i = g, j = 16u + 8e + 2l + {0, 1}), u, e in
// {0, 1}: one rank per position indexes all four areas, so a lane decodes 8 positions (4
// adjacent pairs: one popcount per pair) into its fragments and no value is read twice.
//
//        tile (reordered rows)     cols 0..31 (c = 0)      cols 32..63 (c = 1)
//        rows 0..7   (a = 0)       area q = 0              area q = 1          lane (g, l) holds
//        rows 8..15  (a = 1)       area q = 2              area q = 3          (g, g+8) x (j, j+32)
//
// RA = 1 (rows g and g + 8 are two union rows) or CA = 1 (columns j and j + 32 are two union
// columns) double the positions per lane and halve the values per tuple; the mapping is the same.
// An absent position decodes as zero codes. The mma accumulates the tile in reordered rows;
// the epilogue moves row p of lane 4 (p % 8) + l to original row o = perm(p) with two
// shuffles per row and token, scales it, and adds it to the lane's f32 accumulators of original
// rows g and g + 8, which live across all tiles of the warp.
//
// Block = 8 warps = 8 consecutive tile rows x one chunk of `chunk` <= 32 / NT8 tiles along K
// (split-K: one atomic per row and token at the end; the launcher sizes chunks for one wave of
// blocks up to 8 tokens, at most 8 tiles above). Fused zeroing assumes, as every fused-zeroing
// kernel here does, that the blockIdx.y = 0 blocks (the lowest linear block ids) are dispatched
// before the blocks that wait for them. The block stages its chunk of X, masked (TEAL: |x| > t,
// t < 0 keeps all) and converted to f16, in shared memory, 8 · NT8 token rows of 64 · chunk + 8
// halves (row stride 4 mod 32 words: the B loads of lanes (g, l) hit 32 distinct banks). Rows of
// tokens past N are left unwritten: they reach only mma columns that are never stored.
// Rows of X and Y are ldx and ldy floats apart. Output: y[n · ldy + row] += the product; with
// flags, a plain product with fused zeroing: the
// warps of the first K chunk (blockIdx.y = 0) zero their tile row of y for all N tokens and
// publish the launch's epoch in flags[tr]; the other chunks' warps wait for it before their
// atomics (at their end, so the wait is almost always over at once).

#define IB_WARPS 8
// Shared-memory staging of X: 8 · NT8 token rows of at most 32 / NT8 tiles (33 KB for every NT8).
#define IB_MAX_CHUNK(NT8) (32 / (NT8))

// Tuple of rank r: Q codes of BITS bits (Q · BITS = 4, 8, 16 or 32).
template <int TUPLE_BITS>
__device__ __forceinline__ u32 ib_tuple(const unsigned char* __restrict__ base, u32 r) {
    if (TUPLE_BITS == 4) return (__ldg(base + (r >> 1)) >> (4 * (r & 1))) & 15u;
    if (TUPLE_BITS == 8) return __ldg(base + r);
    if (TUPLE_BITS == 16) return __ldg(reinterpret_cast<const unsigned short*>(base) + r);
    return __ldg(reinterpret_cast<const u32*>(base) + r);
}

// Area q's values of two adjacent positions as f16x2, the first position's in the low half.
// int4: `both` holds the two 16-bit tuples (first in the low half). An even nibble is put under
// the exponent of 1024 (1024 + u) and 1032 subtracted; an odd nibble is read in place at bits
// 4-7 (1024 + 16u) and brought back by one exact f16x2 FMA with 1/16 and -(64 + 8).
// int8: one PRMT gathers byte q of both tuples, then the same with 1024 + u - 1152.
template <int BITS>
__device__ __forceinline__ u32 ib_pair(u32 both, u32 both8, u32 t0, u32 t1, int q) {
    if (BITS == 4) {
        const u32 w = q < 2 ? both : both8;
        if ((q & 1) == 0) return sub_f16x2(and_or(w, 0x000f000fu, 0x64006400u), 0x64086408u);
        // 0x2c00 = 1/16, 0xd480 = -72: (1024 + 16u) / 16 - 72 = u - 8.
        return fma_f16x2(and_or(w, 0x00f000f0u, 0x64006400u), 0x2c002c00u, 0xd480d480u);
    } else {
        const u32 sel = (u32)q | ((u32)(4 + q) << 8);
        return sub_f16x2(and_or(prmt(t0, t1, sel), 0x00ff00ffu, 0x64006400u), 0x64806480u);
    }
}

// Ranks before each lane's bitmap word: the exclusive sum of the W32 words' popcounts over the
// warp (lane i holds word i; lanes past W32 hold 0).
template <int W32>
__device__ __forceinline__ u32 ib_rank_before(u32 word, int lane) {
    u32 incl = __popc(word);
#pragma unroll
    for (int d = 1; d < W32; d <<= 1) {
        const u32 o = __shfl_up_sync(FULL_MASK, incl, d);
        if (lane >= d) incl += o;
    }
    return incl - __popc(word);
}

// ONE: a single token (only column 0 of the mma's B and C is used). NT8: n8 token tiles.
template <int RA, int CA, int BITS, int NT8, bool ONE>
__device__ __forceinline__ void ib_kernel(const u32* __restrict__ bitmaps, const unsigned long long* __restrict__ iperms,
                                          const u32* __restrict__ tile_offsets, const unsigned char* __restrict__ values,
                                          const float* __restrict__ scales, const float* __restrict__ x,
                                          float* __restrict__ y, int M, int K, int N, int ldx, int ldy,
                                          int tile_rows, int tile_cols,
                                          int chunk, int group_tiles, int mp, float t, u32* __restrict__ flags,
                                          u32 epoch) {
    constexpr int Q = RA * CA;
    constexpr int W32 = 32 / Q;              // bitmap words per tile
    constexpr int KB = 64 / CA;              // union columns
    constexpr int NI = RA == 2 ? 1 : 2;      // union rows per lane
    constexpr int NW = KB / 32;              // words per union row
    constexpr int TUPLE_BITS = Q * BITS;
    constexpr u32 ZERO = BITS == 4 ? (0x88888888u >> (32 - TUPLE_BITS)) : (0x80808080u >> (32 - TUPLE_BITS));
    constexpr int NTOK = 8 * NT8;

    __shared__ __align__(16) unsigned short xs[NTOK][64 * IB_MAX_CHUNK(NT8) + 8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, l = lane & 3;
    const int tc0 = blockIdx.y * chunk;
    const int tc1 = min(tile_cols, tc0 + chunk);
    const int tr = blockIdx.x * IB_WARPS + warp;

    pdl_release();
    pdl_wait();
    // Stage X's chunk: masked, f16, zero past K. Token rows N.. are not written: they feed only
    // mma columns that are never stored.
    const int cols = (tc1 - tc0) * 64;
    for (int n = 0; n < min(N, NTOK); ++n)
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const int col = tc0 * 64 + c;
            float v = col < K ? __ldg(x + (size_t)n * ldx + col) : 0.f;
            xs[n][c] = f2h(active(v, t) ? v : 0.f);
        }
    __syncthreads();
    if (tr >= tile_rows) return;
    if (flags && blockIdx.y == 0) {
        for (int i = lane; i < 16 * N; i += 32) {
            const int row = tr * 16 + (i & 15), n = i >> 4;
            if (row < M) y[(size_t)n * ldy + row] = 0.f;
        }
        __threadfence();
        __syncwarp();
        if (lane == 0) store_release(flags + tr, epoch);
    }

    float acc[NT8][2][2];
#pragma unroll
    for (int n8 = 0; n8 < NT8; ++n8)
#pragma unroll
        for (int h = 0; h < 2; ++h) acc[n8][h][0] = acc[n8][h][1] = 0.f;
    const int row0 = tr * 16 + g, row1 = row0 + 8;

    // Software pipeline over the chunk's tiles: while tile tc is decoded and multiplied, the
    // tuples of tile tc + 1 and the metadata of tile tc + 2 are in flight (each tile's loads
    // depend on its bitmap, so without this a warp waits two memory latencies per tile).
    constexpr int NP = NI * NW * 4;  // adjacent position pairs per lane
    u32 word = 0, offset = 0;
    unsigned long long iperm = 0;
    auto load_meta = [&](int tc) {
        const size_t tile = (size_t)tr * tile_cols + tc;
        word = lane < W32 ? __ldg(bitmaps + tile * W32 + lane) : 0u;
        offset = __ldg(tile_offsets + tile);
        iperm = __ldg(iperms + tile);
    };
    // Ranks of the lane's positions and their tuple loads (ZERO where a bit is clear).
    auto gather = [&](u32 (&tup)[NP][2]) {
        const u32 excl = ib_rank_before<W32>(word, lane);
        const unsigned char* base = values + offset;
#pragma unroll
        for (int ii = 0; ii < NI; ++ii) {
            const int i = RA == 2 ? g : g + 8 * ii;
#pragma unroll
            for (int uh = 0; uh < NW; ++uh) {
                const u32 w = __shfl_sync(FULL_MASK, word, i * NW + uh);
                const u32 before = __shfl_sync(FULL_MASK, excl, i * NW + uh);
#pragma unroll
                for (int ul = 0; ul < 2; ++ul)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const u32 first = 1u << (16 * ul + 8 * e + 2 * l);  // the pair's first bit
                        const u32 r0 = before + __popc(w & (first - 1u));
                        const u32 b0 = (w & first) ? 1u : 0u, b1 = (w & (first << 1)) ? 1u : 0u;
                        u32(&t2)[2] = tup[((ii * NW + uh) * 2 + ul) * 2 + e];
                        t2[0] = b0 ? ib_tuple<TUPLE_BITS>(base, r0) : ZERO;
                        t2[1] = b1 ? ib_tuple<TUPLE_BITS>(base, r0 + b0) : ZERO;
                    }
            }
        }
    };
    // Decode into fragments, mma over the 4 k steps, un-permute, scale, accumulate.
    auto compute = [&](int tc, const u32 (&tup)[NP][2], unsigned long long ip) {
        u32 a[4][4];
#pragma unroll
        for (int ii = 0; ii < NI; ++ii)
#pragma unroll
            for (int uh = 0; uh < NW; ++uh)
#pragma unroll
                for (int ul = 0; ul < 2; ++ul)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const u32(&t2)[2] = tup[((ii * NW + uh) * 2 + ul) * 2 + e];
                        const int u = 2 * uh + ul;
                        const u32 both = BITS == 4 ? prmt(t2[0], t2[1], 0x5410u) : 0u;
                        const u32 both8 = BITS == 4 && Q > 2 ? both >> 8 : 0u;
#pragma unroll
                        for (int q = 0; q < Q; ++q) {
                            const int ar = q / CA, c = q % CA;
                            const int h = RA == 2 ? ar : ii;        // row g or g + 8
                            const int kk = CA == 2 ? 2 * c + u : u; // 16-column k step
                            a[kk][2 * e + h] = ib_pair<BITS>(both, both8, t2[0], t2[1], q);
                        }
                    }
        // Scales of the lane's two original rows for this tile's column group.
        const int grp = group_tiles == 2 ? tc >> 1 : tc / group_tiles;
        const float s0 = __ldg(scales + (size_t)grp * mp + row0);
        const float s1 = __ldg(scales + (size_t)grp * mp + row1);
        // Reordered rows of original rows g and g + 8, and the lanes holding them.
        const u32 p0 = (u32)(ip >> (4 * g)) & 15u, p1 = (u32)(ip >> (4 * (g + 8))) & 15u;
        const int src0 = 4 * (int)(p0 & 7u) + l, src1 = 4 * (int)(p1 & 7u) + l;
        const int xc = (tc - tc0) * 64 + 2 * l;
#pragma unroll
        for (int n8 = 0; n8 < NT8; ++n8) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            const unsigned short* xr = xs[8 * n8 + g];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u32 b0 = *reinterpret_cast<const u32*>(xr + xc + 16 * kk);
                const u32 b1 = *reinterpret_cast<const u32*>(xr + xc + 16 * kk + 8);
                mma_16816(c, a[kk], b0, b1);
            }
            // c[0], c[1]: reordered row g, tokens 2l, 2l+1; c[2], c[3]: row g + 8.
            float v00 = __shfl_sync(FULL_MASK, c[0], src0), v02 = __shfl_sync(FULL_MASK, c[2], src0);
            float v10 = __shfl_sync(FULL_MASK, c[0], src1), v12 = __shfl_sync(FULL_MASK, c[2], src1);
            acc[n8][0][0] = fmaf(p0 & 8u ? v02 : v00, s0, acc[n8][0][0]);
            acc[n8][1][0] = fmaf(p1 & 8u ? v12 : v10, s1, acc[n8][1][0]);
            if (!ONE) {
                float v01 = __shfl_sync(FULL_MASK, c[1], src0), v03 = __shfl_sync(FULL_MASK, c[3], src0);
                float v11 = __shfl_sync(FULL_MASK, c[1], src1), v13 = __shfl_sync(FULL_MASK, c[3], src1);
                acc[n8][0][1] = fmaf(p0 & 8u ? v03 : v01, s0, acc[n8][0][1]);
                acc[n8][1][1] = fmaf(p1 & 8u ? v13 : v11, s1, acc[n8][1][1]);
            }
        }
    };

    u32 tup_a[NP][2], tup_b[NP][2];
    unsigned long long ip_a = 0, ip_b = 0;
    if (tc0 < tc1) {
        load_meta(tc0);
        gather(tup_a);
        ip_a = iperm;
        if (tc0 + 1 < tc1) load_meta(tc0 + 1);
    }
    for (int tc = tc0; tc < tc1; tc += 2) {
        if (tc + 1 < tc1) {
            gather(tup_b);
            ip_b = iperm;
            if (tc + 2 < tc1) load_meta(tc + 2);
        }
        compute(tc, tup_a, ip_a);
        if (tc + 1 >= tc1) break;
        if (tc + 2 < tc1) {
            gather(tup_a);
            ip_a = iperm;
            if (tc + 3 < tc1) load_meta(tc + 3);
        }
        compute(tc + 1, tup_b, ip_b);
    }
    if (flags && blockIdx.y != 0) {
        if (lane == 0)
            while (load_acquire(flags + tr) != epoch) {
            }
        __syncwarp();
    }
#pragma unroll
    for (int n8 = 0; n8 < NT8; ++n8)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < (ONE ? 1 : 2); ++j) {
                const int n = 8 * n8 + 2 * l + j, row = h ? row1 : row0;
                if (n < N && row < M && acc[n8][h][j] != 0.f) atomicAdd(y + (size_t)n * ldy + row, acc[n8][h][j]);
            }
}

#define IB_ARGS                                                                                              \
    const u32 *__restrict__ bitmaps, const unsigned long long *__restrict__ iperms,                          \
        const u32 *__restrict__ tile_offsets, const unsigned char *__restrict__ values,                      \
        const float *__restrict__ scales, const float *__restrict__ x, float *__restrict__ y, int M, int K,   \
        int N, int ldx, int ldy, int tile_rows, int tile_cols, int chunk, int group_tiles, int mp, float t,   \
        u32 *__restrict__ flags, u32 epoch
#define IB_PASS \
    bitmaps, iperms, tile_offsets, values, scales, x, y, M, K, N, ldx, ldy, tile_rows, tile_cols, chunk, group_tiles, mp, t, flags, epoch
#define IB_KERNEL(RA, CA, BITS, NAME, NT8, ONE)                                                    \
    extern "C" __global__ void __launch_bounds__(256) ie_bme_r##RA##c##CA##_int##BITS##_##NAME(IB_ARGS) { \
        ib_kernel<RA, CA, BITS, NT8, ONE>(IB_PASS);                                                \
    }
#define IB_TOKENS(RA, CA, BITS)          \
    IB_KERNEL(RA, CA, BITS, n1, 1, true) \
    IB_KERNEL(RA, CA, BITS, n8, 1, false) \
    IB_KERNEL(RA, CA, BITS, n16, 2, false) \
    IB_KERNEL(RA, CA, BITS, n32, 4, false)
#define IB_AREAS(BITS)     \
    IB_TOKENS(2, 2, BITS)  \
    IB_TOKENS(1, 2, BITS)  \
    IB_TOKENS(2, 1, BITS)  \
    IB_TOKENS(1, 1, BITS)
IB_AREAS(4)
IB_AREAS(8)

// The matrix as f16, row-major: out[r · Kp + k] (Mp = 16 tile_rows, Kp = 64 tile_cols rows and
// columns), each value s · q rounded to f16 once, zero where no tuple holds it: the batched
// prefill's copy for cuBLAS on long prompts (the product kernel above takes 32 tokens a launch
// and decodes every tile again per launch). One warp per tile, lane l its columns 2l and 2l + 1
// of the tile's 16 original rows o: reordered row p = nibble o of the tile's iperm, union
// position (i, j) of area (a, c) (RA = 2: a = p / 8; CA = 2: c = column / 32), the tuple of its
// rank (the words' popcounts scanned across the warp, as the product kernel does), area
// q = a · CA + c's code; one 4-byte store per row, so the warp writes each of the tile's rows
// (128 bytes) at once.
template <int RA, int CA, int BITS>
__device__ __forceinline__ void ib_to_f16_body(const u32* __restrict__ bitmaps, const unsigned long long* __restrict__ iperms,
                                               const u32* __restrict__ tile_offsets, const unsigned char* __restrict__ values,
                                               const float* __restrict__ scales, f16_bits* __restrict__ out,
                                               int tile_rows, int tile_cols, int group_tiles, int mp) {
    constexpr int Q = RA * CA;
    constexpr int W32 = 32 / Q;  // bitmap words per tile
    constexpr int KB = 64 / CA;  // union columns
    constexpr int TUPLE_BITS = Q * BITS;
    constexpr int ZERO = BITS == 4 ? 8 : 128;
    constexpr u32 MASK = (1u << BITS) - 1u;
    pdl_wait_then_release();  // the previous GEMM may still read `out`
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t tile = (size_t)blockIdx.x * IB_WARPS + warp;
    if (tile >= (size_t)tile_rows * tile_cols) return;  // the whole warp
    const int tr = (int)(tile / tile_cols), tc = (int)(tile % tile_cols);
    const u32 word = lane < W32 ? __ldg(bitmaps + tile * W32 + lane) : 0u;
    const u32 excl = ib_rank_before<W32>(word, lane);
    const unsigned char* base = values + __ldg(tile_offsets + tile);
    const unsigned long long ip = __ldg(iperms + tile);
    const int grp = tc / group_tiles;
    const int kp = tile_cols * 64;
#pragma unroll 4
    for (int o = 0; o < 16; ++o) {
        const int p = (int)((ip >> (4 * o)) & 15u);
        const int a = RA == 2 ? p >> 3 : 0, i = RA == 2 ? p & 7 : p;
        const float s = __ldg(scales + (size_t)grp * mp + tr * 16 + o);
        u32 packed = 0u;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = 2 * lane + e;
            const int c = CA == 2 ? col >> 5 : 0, j = CA == 2 ? col & 31 : col;
            const int b = i * KB + j;
            const u32 w = __shfl_sync(FULL_MASK, word, b >> 5);
            const u32 before = __shfl_sync(FULL_MASK, excl, b >> 5);
            float v = 0.f;
            if ((w >> (b & 31)) & 1u) {
                const u32 r = before + __popc(w & ((1u << (b & 31)) - 1u));
                const u32 tup = ib_tuple<TUPLE_BITS>(base, r);
                v = __fmul_rn(s, (float)((int)((tup >> (BITS * (a * CA + c))) & MASK) - ZERO));
            }
            packed |= (u32)f2h(v) << (16 * e);
        }
        *reinterpret_cast<u32*>(out + (size_t)(tr * 16 + o) * kp + tc * 64 + 2 * lane) = packed;
    }
}

// Grid: ceil(tiles / 8) blocks of 256 threads.
#define IB_TO_F16(RA, CA, BITS)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) ie_bme_r##RA##c##CA##_int##BITS##_to_f16(             \
        const u32* __restrict__ bitmaps, const unsigned long long* __restrict__ iperms,                      \
        const u32* __restrict__ tile_offsets, const unsigned char* __restrict__ values,                      \
        const float* __restrict__ scales, f16_bits* __restrict__ out, int tile_rows, int tile_cols,          \
        int group_tiles, int mp) {                                                                           \
        ib_to_f16_body<RA, CA, BITS>(bitmaps, iperms, tile_offsets, values, scales, out, tile_rows, tile_cols, \
                                     group_tiles, mp);                                                       \
    }
IB_TO_F16(2, 2, 4)
IB_TO_F16(1, 2, 4)
IB_TO_F16(2, 1, 4)
IB_TO_F16(1, 1, 4)
IB_TO_F16(2, 2, 8)
IB_TO_F16(1, 2, 8)
IB_TO_F16(2, 1, 8)
IB_TO_F16(1, 1, 8)
