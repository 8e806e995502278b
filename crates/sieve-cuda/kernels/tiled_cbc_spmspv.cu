// SPDP spMspV over Tiled-CBC: y = W * mask_t(x), W in the layout of
// sieve-formats/src/tiled_cbc.rs (read its header first). Summary:
//
//   GTile g = rt*KT + kt: rows 256 rt .. +255, columns 16 kt .. +15 (zero padded)
//   col_info[16g + c] = (off << 16) | nnz, column c's values at values[tile_offset[g] + off ..]
//   (rounded up to 8 f16 = 16 bytes), bitmaps[(16g + c)*4 + w]: rows 64w .. 64w+63
//
// Thread mapping: one block of 256 threads per (row tile rt, split-K range of GTiles);
// thread i owns row 256 rt + i and accumulates it in a register, so decoding needs no
// scatter and no shared-memory atomics:
//
//      GTile kt:  c0 c1 ... c15            thread i, active column c:
//      bitmaps:   4 x u64 per column         word = bitmap[c][i / 64], bit = i % 64
//      values:    packed nonzeros            if bit set: rank = popc(word below bit)
//                                                              + popc(words before)
//                                            acc += values_smem[c][rank] * x[16 kt + c]
//
// Pipeline per GTile (SPDP Alg. 1 with three cp.async groups):
//   meta(g)  = TileOffset + 16 ColInfo + 16 activations  (prefetched two GTiles ahead)
//   data(g)  = bitmaps and values of the ACTIVE, nonempty columns only (activation-aware
//              column selection: inactive columns are never fetched), 16-byte cp.async,
//              double buffered in shared memory
//   compute(g) = the decode above (SPDP's HAD-SMBD, MaskedPopcount = __popcll)
//   iteration it: wait(data(it)), issue meta(it+2), issue data(it+1), compute(it)
// After its range the block adds its 256 sums to y with one atomic per row (split-K over
// GTiles), so y is zeroed before the launch.

#define TCBC_TILE_M 256
#define TCBC_TILE_K 16

struct TcbcMeta {
    u32 tile_offset;
    u32 col_info[TCBC_TILE_K];
    float x[TCBC_TILE_K];
};

extern "C" __global__ void __launch_bounds__(256)
tcbc_spmspv(const u32* __restrict__ tile_offset, const u32* __restrict__ col_info,
            const u64* __restrict__ bitmaps, const f16_bits* __restrict__ values,
            const float* __restrict__ x, float* __restrict__ y, int M, int K, int KT, float t,
            int gtiles_per_block) {
    __shared__ __align__(16) f16_bits s_vals[2][TCBC_TILE_K * TCBC_TILE_M];
    __shared__ __align__(16) u64 s_bits[2][TCBC_TILE_K * 4];
    __shared__ __align__(16) TcbcMeta s_meta[3];
    __shared__ u32 s_active[3];

    int tid = threadIdx.x;
    int rt = blockIdx.y;
    int kt0 = blockIdx.x * gtiles_per_block;
    int kt1 = min(kt0 + gtiles_per_block, KT);
    int n = kt1 - kt0;
    if (n <= 0) return;

    // Metadata of local GTile i into meta slot i % 3 (threads 0..32 issue 4-byte copies).
    auto load_meta = [&](int i) {
        if (i >= n) return;
        int g = rt * KT + kt0 + i;
        TcbcMeta* m = &s_meta[i % 3];
        if (tid == 0) cp_async4(&m->tile_offset, tile_offset + g);
        if (tid >= 32 && tid < 32 + TCBC_TILE_K) {
            int c = tid - 32;
            cp_async4(&m->col_info[c], col_info + (size_t)g * TCBC_TILE_K + c);
            int k = (kt0 + i) * TCBC_TILE_K + c;
            // Padding columns beyond K read a harmless in-bounds element; they have nnz = 0.
            cp_async4(&m->x[c], x + min(k, K - 1));
        }
    };
    // After meta(i) has landed: the mask of active, nonempty columns.
    auto select_columns = [&](int i) {
        if (tid < 32) {
            const TcbcMeta* m = &s_meta[i % 3];
            bool on = false;
            if (tid < TCBC_TILE_K) {
                int k = (kt0 + i) * TCBC_TILE_K + tid;
                on = k < K && (m->col_info[tid] & 0xffffu) != 0 && active(m->x[tid], t);
            }
            u32 mask = __ballot_sync(FULL_MASK, on);
            if (tid == 0) s_active[i % 3] = mask;
        }
    };
    // Values and bitmaps of local GTile i's active columns into data buffer i % 2:
    // thread tid serves column tid / 16, 16-byte chunks tid % 16, +16 (a column holds at most
    // 256 f16 = 32 chunks); threads of inactive columns issue nothing.
    auto load_data = [&](int i) {
        if (i >= n) return;
        int g = rt * KT + kt0 + i;
        const TcbcMeta* m = &s_meta[i % 3];
        u32 mask = s_active[i % 3];
        int c = tid >> 4, part = tid & 15;
        if (mask & (1u << c)) {
            u32 info = m->col_info[c];
            u32 nnz = info & 0xffffu, off = info >> 16;
            u32 chunks = (nnz + 7) >> 3;
            const f16_bits* src = values + m->tile_offset + off;
            f16_bits* dst = &s_vals[i & 1][c * TCBC_TILE_M];
            for (u32 q = part; q < chunks; q += 16) cp_async16(dst + q * 8, src + q * 8, 16);
            if (part < 2) cp_async16(&s_bits[i & 1][c * 4 + part * 2], bitmaps + ((size_t)g * TCBC_TILE_K + c) * 4 + part * 2, 16);
        }
    };

    float acc = 0.f;
    int w = tid >> 6, b = tid & 63;
    u64 below = (1ull << b) - 1ull;

    // Prologue: meta(0) -> select -> data(0) with meta(1) in flight.
    load_meta(0);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    select_columns(0);
    load_meta(1);
    cp_async_commit();
    __syncthreads();
    load_data(0);
    cp_async_commit();

    for (int it = 0; it < n; ++it) {
        cp_async_wait<0>();  // data(it) and meta(it+1)
        __syncthreads();
        if (it + 1 < n) select_columns(it + 1);
        load_meta(it + 2);
        cp_async_commit();
        __syncthreads();     // s_active[it+1] visible
        load_data(it + 1);
        cp_async_commit();

        // Compute on data(it) while meta(it+2) and data(it+1) are in flight.
        const TcbcMeta* m = &s_meta[it % 3];
        u32 mask = s_active[it % 3];
        const f16_bits* vals = s_vals[it & 1];
        const u64* bits = s_bits[it & 1];
        while (mask) {
            int c = __ffs(mask) - 1;
            mask &= mask - 1;
            const u64* cw = bits + c * 4;
            u64 word = cw[w];
            if ((word >> b) & 1ull) {
                int rank = __popcll(word & below);
                for (int q = 0; q < w; ++q) rank += __popcll(cw[q]);
                acc += h2f(vals[c * TCBC_TILE_M + rank]) * m->x[c];
            }
        }
        __syncthreads();  // buffer it & 1 is refilled by load_data(it + 2) next iteration
    }
    cp_async_wait<0>();
    int row = rt * TCBC_TILE_M + tid;
    if (row < M && acc != 0.f) atomicAdd(y + row, acc);
}
