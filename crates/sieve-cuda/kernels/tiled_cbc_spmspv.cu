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
    pdl_wait_then_release();
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

// ---------------------------------------------------------------------------------------------
// tcbc_spmspv_lane8: the same product, with sieve's own mapping for Hopper (beyond SPDP).
//
// SPDP's thread-per-row decode above pays a popcount and a shared load per *element* of every
// active column, and its pipeline holds one 16-column GTile per block: run 2 measured it
// latency bound at 5-18% of the copy bandwidth. This kernel:
//
//  1. Compacts first. Block (kx, rt) owns row tile rt and columns [k0, k0 + C), C =
//     cols_per_block (<= 512). It reads x, ColInfo and TileOffset of its range once, a
//     thread's two columns and their six loads issued together (one memory latency on the
//     block's critical path, at the price of reading the 4-byte ColInfo of inactive columns
//     too), and keeps the active,
//     nonempty columns (|x| > t, nnz > 0) in a shared list, in column order:
//         list[i] = (value offset, column tile index 16 g + c, 16-byte chunks, x_k bits)
//  2. Streams the list in batches of B = 32 columns through S = 2 shared buffers (B and S
//     are template parameters; other shapes are compiled for tuning) with cp.async, one
//     commit group per batch, S - 1 batches in flight:
//         stage:  vals[B][256] f16 | bits[B][8] u32 | rank[B][8] u8      (17.3 KB at B = 32)
//     thread t copies for column slot t / (256 / B) the 16-byte chunks (t % (256 / B)) +
//     (256 / B) q; the first two threads of a slot also copy its 32-byte bitmap, the third its
//     8-byte rank table. At ~43 KB of shared memory per block, five blocks (40 warps) fit on a
//     multiprocessor, so one block's prologue and first-batch latencies hide behind the others.
//  3. Decodes with a lane owning 8 consecutive rows. Lane j of every warp owns rows
//     8 j .. 8 j + 7 of the 256-row tile, which is one byte of the column's bitmap:
//
//         bits (u32 words):  | w0 | w1 | ... | w7 |      lane j: word q = j / 4, byte j % 4
//         first value index of lane j = rank[q] + popc(w_q & bits below byte j % 4)
//         rank[q] = set bits in rows < 32 q   (a table built at upload, 8 bytes per column tile)
//         then one shared load per set bit of the byte, in row order
//
//     so a column costs one popcount per lane, not one per element, and no atomics: warp w
//     takes slots w, w + 8, ... of each batch, decodes them side by side (their shared loads
//     overlap) and keeps 8 float sums per lane in registers. Per element that is five
//     instructions (bit test, predicated 16-bit shared load, pointer step, f16 -> f32, FMA):
//     the kernel is bound by instruction issue and shared-memory loads, not by DRAM (ncu, run 3).
//  4. Reduces the 8 warps' sums through shared memory and adds each row's total to y with one
//     atomic (split-K over column ranges).
//  Fused zeroing: y is not zeroed by a separate launch. Block kx = 0 of each row tile zeroes
//  the tile's rows of y first and then publishes `epoch` in flags[rt]; every other block of
//  the row tile waits for that flag before its atomics (by then block 0, which has a lower
//  linear index and so was dispatched earlier, has long finished zeroing). The launcher passes
//  a new epoch per launch, so the flags never need resetting.

// tcbc_spmspv_rr: the lane8 kernel with a round-robin decode (step 3'), same bytes, same
// pipeline. Lane j of every warp owns rows 32 w + j, w = 0..7, of the tile, so for bitmap word w
// (u32, rows 32 w .. 32 w + 31) the lanes with a set bit read CONSECUTIVE values:
//
//     value index of lane j in word w = rank[w] + popc(word_w & lanes below j)
//
// one wavefront per word (lane8's runs of neighbouring lanes lie 16 (1 - sp) bytes apart and
// conflict 2-4 ways, ncu run 5), paid with a popcount per word instead of per lane. Bitmap and
// rank table are read with two 16-byte and one 8-byte broadcast loads per column.

#define L8_WARPS 8

// Stage layout of the lane8 / rr / union pipelines (byte offsets inside one stage buffer):
// vals[BATCH][256] f16 | bits[BATCH][8] u32 | rank[BATCH][8] u8.
template <int BATCH>
struct StageLayout {
    static constexpr u32 BITS_OFF = BATCH * TCBC_TILE_M * 2;
    static constexpr u32 RANK_OFF = BITS_OFF + BATCH * 32;
    static constexpr u32 BYTES = RANK_OFF + BATCH * 8;
};

// Copies listed column e (value offset, column tile, 16-byte chunks) into slot my_slot of the
// stage at `stage` when `have`: this thread's chunks part, part + 256 / BATCH, ... of the values
// (a column tile holds at most 32), the bitmap (parts 0 and 1) and the rank table (part 2).
// Every thread then commits a cp.async group, copies or not, so that group counts agree.
template <int BATCH>
__device__ __forceinline__ void stage_column(bool have, const uint4* list, int i,
                                             const f16_bits* __restrict__ values,
                                             const u64* __restrict__ bitmaps,
                                             const unsigned char* __restrict__ rank, u32 stage,
                                             int my_slot, int part) {
    constexpr int THREADS_PER_SLOT = 256 / BATCH;
    using L = StageLayout<BATCH>;
    if (have) {
        uint4 e = list[i];
        const f16_bits* src = values + e.x;
        u32 dst = stage + (u32)my_slot * (TCBC_TILE_M * 2) + (u32)part * 16u;
#pragma unroll
        for (int rr = 0; rr < 32 / THREADS_PER_SLOT; ++rr) {
            u32 c = (u32)(part + rr * THREADS_PER_SLOT);
            if (c < e.z) cp_async16_s(dst + (u32)(rr * THREADS_PER_SLOT * 16), src + c * 8);
        }
        if (part < 2)
            cp_async16_s(stage + L::BITS_OFF + (u32)my_slot * 32u + (u32)part * 16u,
                         bitmaps + (size_t)e.y * 4 + part * 2);
        else if (part == 2)
            cp_async8_s(stage + L::RANK_OFF + (u32)my_slot * 8u, rank + (size_t)e.y * 8);
    }
    cp_async_commit();
}

// The round-robin decode of column slot `slot` of the stage at `cur`: val[w] = the f16 bits of
// row 32 w + lane, 0 where its bit is clear or the slot is not `valid`. For bitmap word w the
// lanes whose bit is set read consecutive values (rank[w] + set bits below the lane): one
// conflict-free wavefront per word.
template <int BATCH>
__device__ __forceinline__ void rr_decode_slot(u32 cur, int slot, bool valid, int lane, u32 (&val)[8]) {
    using L = StageLayout<BATCH>;
    const u32 lane_below = (1u << lane) - 1u;
    uint4 wa = lds_u32x4(cur + L::BITS_OFF + (u32)slot * 32u);
    uint4 wb = lds_u32x4(cur + L::BITS_OFF + (u32)slot * 32u + 16u);
    uint2 rk = lds_u32x2(cur + L::RANK_OFF + (u32)slot * 8u);
    u32 words[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
    const u32 vbase = cur + (u32)slot * (TCBC_TILE_M * 2);
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        u32 r = ((w < 4 ? rk.x : rk.y) >> (8 * (w & 3))) & 0xffu;
        bool on = valid && ((words[w] >> lane) & 1u);
        u32 addr = vbase + 2u * (r + __popc(words[w] & lane_below));
        val[w] = on ? lds_u16(addr) : 0u;
    }
}

// BATCH columns per stage, STAGES stage buffers (the instantiations are at the end).
// RR: the round-robin decode of tcbc_spmspv_rr (below) instead of a lane per 8 rows.
template <int BATCH, int STAGES, bool RR>
__device__ __forceinline__ void lane8_kernel(const u32* __restrict__ tile_offset, const u32* __restrict__ col_info,
                  const u64* __restrict__ bitmaps, const unsigned char* __restrict__ rank,
                  const f16_bits* __restrict__ values, const float* __restrict__ x,
                  float* __restrict__ y, u32* __restrict__ flags, u32 epoch, int M, int K, int KT,
                  float t, int cols_per_block) {
    constexpr int THREADS_PER_SLOT = 256 / BATCH;
    constexpr int SLOTS_PER_WARP = BATCH / L8_WARPS;
    // Byte offsets inside one stage (a `struct` would make the compiler rebuild 64-bit generic
    // addresses for every shared access; the kernel works on 32-bit shared addresses instead).
    constexpr u32 BITS_OFF = StageLayout<BATCH>::BITS_OFF;
    constexpr u32 RANK_OFF = StageLayout<BATCH>::RANK_OFF;
    constexpr u32 STAGE_BYTES = StageLayout<BATCH>::BYTES;
    extern __shared__ __align__(16) unsigned char smem[];
    // list[i] = (value offset in f16, column tile index 16 g + c, 16-byte chunks, x_k bits)
    uint4* list = reinterpret_cast<uint4*>(smem + STAGES * STAGE_BYTES);
    __shared__ int s_warp_count[2][L8_WARPS];
    const u32 sbase = smem_addr(smem);

    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int rt = blockIdx.y;
    int row = rt * TCBC_TILE_M + tid;
    // flags == nullptr: no fused zeroing, the product is added to y as it is (the decode
    // runner's mode: y is zeroed by an earlier kernel of the step, or is the residual stream).
    pdl_release();

    // 1. Compaction of the block's column range (at most 512 columns: two per thread) into
    //    the shared list. All six loads of a thread are issued before any is used, so the
    //    range costs one memory latency however many columns it has (run 4: a second round
    //    of loads after a barrier cost a full extra latency on 9 of the 12 LLaMA shapes).
    int k0 = blockIdx.x * cols_per_block;
    int k1 = min(k0 + cols_per_block, K);
    u32 info[2], off[2], gc[2];
    float xv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int k = k0 + tid + 256 * r;
        info[r] = 0;
        off[r] = 0;
        gc[r] = 0;
        xv[r] = 0.f;
        if (k < k1) {
            // ColInfo and TileOffset of inactive columns are read too: they travel with x.
            u32 g = (u32)rt * (u32)KT + (u32)(k >> 4);
            gc[r] = g * TCBC_TILE_K + (u32)(k & 15);
            info[r] = __ldg(col_info + gc[r]);
            off[r] = __ldg(tile_offset + g) + (info[r] >> 16);
        }
    }
    // Under programmatic dependent launch the format metadata above (static) is read while
    // the previous kernel finishes; x and y only after it has.
    pdl_wait();
    if (flags && blockIdx.x == 0) {
        if (row < M) y[row] = 0.f;
        publish_zeroed_tile(flags + rt, epoch);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int k = k0 + tid + 256 * r;
        if (k < k1) xv[r] = __ldg(x + k);
    }
    bool on[2];
    u32 ballot[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        on[r] = k0 + tid + 256 * r < k1 && active(xv[r], t) && (info[r] & 0xffffu) != 0;
        ballot[r] = __ballot_sync(FULL_MASK, on[r]);
        if (lane == 0) s_warp_count[r][warp] = __popc(ballot[r]);
    }
    __syncthreads();
    int n = 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int before = n;
#pragma unroll
        for (int w = 0; w < L8_WARPS; ++w) {
            before += w < warp ? s_warp_count[r][w] : 0;
            n += s_warp_count[r][w];
        }
        if (on[r]) {
            int i = before + __popc(ballot[r] & ((1u << lane) - 1u));
            list[i] = make_uint4(off[r], gc[r], ((info[r] & 0xffffu) + 7u) >> 3, __float_as_uint(xv[r]));
        }
    }
    __syncthreads();  // the list is read below

    float acc[8];
#pragma unroll
    for (int s = 0; s < 8; ++s) acc[s] = 0.f;

    if (n > 0) {
        // 2. Pipeline over batches of 16 listed columns.
        int nb = (n + BATCH - 1) / BATCH;
        int my_slot = tid / THREADS_PER_SLOT, part = tid % THREADS_PER_SLOT;
        auto load = [&](int b, u32 stage) {
            int i = b * BATCH + my_slot;
            stage_column<BATCH>(b < nb && i < n, list, i, values, bitmaps, rank, stage, my_slot, part);
        };
        const u32 stage_bytes = STAGE_BYTES;
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) load(s, sbase + (u32)s * stage_bytes);

        int q = lane >> 2, sh = (lane & 3) * 8;
        u32 below = (1u << sh) - 1u;
        u32 cur = sbase;                                                 // stage of batch b
        u32 next = sbase + (u32)(STAGES - 1) * stage_bytes;  // stage of b + STAGES - 1
        const u32 last = sbase + (u32)(STAGES - 1) * stage_bytes;
        for (int b = 0; b < nb; ++b) {
            cp_async_wait<STAGES - 2>();  // batch b has landed (this thread's copies)
            __syncthreads();                 // ... everyone's; and batch b - 1 is consumed
            load(b + STAGES - 1, next);
            int cnt = min(BATCH, n - b * BATCH);
            if (RR) {
                // 3'. Round robin: lane j owns rows 32 w + j (w = 0..7) of the warp's column
                //     slots. For bitmap word w the lanes whose bit is set read consecutive
                //     values (rank[w] + set bits below the lane): one conflict-free wavefront
                //     per word, one predicated load per word per lane.
                u32 val[SLOTS_PER_WARP][8];
                float xk[SLOTS_PER_WARP];
#pragma unroll
                for (int u = 0; u < SLOTS_PER_WARP; ++u) {
                    int slot = warp + u * L8_WARPS;
                    bool valid = slot < cnt;
                    slot = valid ? slot : 0;
                    rr_decode_slot<BATCH>(cur, slot, valid, lane, val[u]);
                    xk[u] = __uint_as_float(list[b * BATCH + slot].w);
                }
#pragma unroll
                for (int u = 0; u < SLOTS_PER_WARP; ++u) {
#pragma unroll
                    for (int w = 0; w < 8; ++w) acc[w] = fmaf(h2f((unsigned short)val[u][w]), xk[u], acc[w]);
                }
            } else {
            // 3. Lane j: rows 8 j .. 8 j + 7 of the warp's column slots, decoded side by side
            //    so that their shared-memory latencies overlap (slots past the batch's end get
            //    an empty byte and read nothing).
            u32 byte[SLOTS_PER_WARP], p[SLOTS_PER_WARP];
            float xk[SLOTS_PER_WARP];
#pragma unroll
            for (int u = 0; u < SLOTS_PER_WARP; ++u) {
                int slot = warp + u * L8_WARPS;
                bool valid = slot < cnt;
                slot = valid ? slot : 0;
                u32 word = lds_u32(cur + BITS_OFF + (u32)slot * 32u + (u32)q * 4u);
                u32 r = lds_u8(cur + RANK_OFF + (u32)slot * 8u + (u32)q) + __popc(word & below);
                byte[u] = valid ? (word >> sh) & 0xffu : 0u;
                p[u] = cur + (u32)slot * (TCBC_TILE_M * 2) + 2u * r;
                xk[u] = __uint_as_float(list[b * BATCH + slot].w);
            }
#pragma unroll
            for (int s = 0; s < 8; ++s) {
#pragma unroll
                for (int u = 0; u < SLOTS_PER_WARP; ++u) {
                    if (byte[u] & (1u << s)) {
                        acc[s] = fmaf(h2f((unsigned short)lds_u16(p[u])), xk[u], acc[s]);
                        p[u] += 2u;
                    }
                }
            }
            }
            cur = cur == last ? sbase : cur + stage_bytes;
            next = next == last ? sbase : next + stage_bytes;
        }
        cp_async_wait<0>();
    }
    __syncthreads();  // every warp is done with the stages: reuse them for the reduction

    // 4. Cross-warp reduction, then one atomic per row.
    float* red = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int s = 0; s < 8; ++s) red[warp * TCBC_TILE_M + (RR ? 32 * s + lane : lane * 8 + s)] = acc[s];
    __syncthreads();
    if (n == 0) return;  // uniform: nothing to add (block 0 has already zeroed its rows)
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < L8_WARPS; ++w) sum += red[w * TCBC_TILE_M + tid];
    if (flags && blockIdx.x != 0) wait_zeroed_tile(flags + rt, epoch);
    if (row < M && sum != 0.f) atomicAdd(y + row, sum);
}

#define LANE8_ARGS                                                                                 \
    const u32 *__restrict__ tile_offset, const u32 *__restrict__ col_info,                         \
        const u64 *__restrict__ bitmaps, const unsigned char *__restrict__ rank,                   \
        const f16_bits *__restrict__ values, const float *__restrict__ x, float *__restrict__ y,   \
        u32 *__restrict__ flags, u32 epoch, int M, int K, int KT, float t, int cols_per_block
#define LANE8_PASS tile_offset, col_info, bitmaps, rank, values, x, y, flags, epoch, M, K, KT, t, cols_per_block

// One kernel per pipeline shape, named tcbc_spmspv_lane8_b<B>s<S> (Lane8Shape in
// src/tiled_cbc.rs). Default: 32-column batches, 2 stages (~43 KB of shared memory: 5 blocks
// per SM); the others were within 5% of it on the LLaMA-2-7B shapes (docs/BENCHMARKS.md).
extern "C" __global__ void __launch_bounds__(256) tcbc_spmspv_lane8_b32s2(LANE8_ARGS) {
    lane8_kernel<32, 2, false>(LANE8_PASS);
}
extern "C" __global__ void __launch_bounds__(256) tcbc_spmspv_lane8_b16s3(LANE8_ARGS) {
    lane8_kernel<16, 3, false>(LANE8_PASS);
}
extern "C" __global__ void __launch_bounds__(256) tcbc_spmspv_lane8_b16s4(LANE8_ARGS) {
    lane8_kernel<16, 4, false>(LANE8_PASS);
}
extern "C" __global__ void __launch_bounds__(256) tcbc_spmspv_lane8_b32s3(LANE8_ARGS) {
    lane8_kernel<32, 3, false>(LANE8_PASS);
}
extern "C" __global__ void __launch_bounds__(256) tcbc_spmspv_rr_b32s2(LANE8_ARGS) {
    lane8_kernel<32, 2, true>(LANE8_PASS);
}
extern "C" __global__ void __launch_bounds__(256) tcbc_spmspv_rr_b16s3(LANE8_ARGS) {
    lane8_kernel<16, 3, true>(LANE8_PASS);
}
extern "C" __global__ void __launch_bounds__(256) tcbc_spmspv_rr_b16s4(LANE8_ARGS) {
    lane8_kernel<16, 4, true>(LANE8_PASS);
}
extern "C" __global__ void __launch_bounds__(256) tcbc_spmspv_rr_b32s3(LANE8_ARGS) {
    lane8_kernel<32, 3, true>(LANE8_PASS);
}

// ---------------------------------------------------------------------------------------------
// tcbc_spmspv_union_n<NB>: the rr kernel for a small batch of n <= NB tokens (NB = 2, 4) (issue 28; SPDP
// names it as future work). A many-sequence decode step multiplies each matrix by n rows at
// once; run n times, the rr kernel reads each active column's weights once per row. This one
// reads a column once for the batch:
//
//   x: n rows of K f32, ldx apart, each masked by the threshold on its own (a row's inactive
//      inputs are 0, exactly what the one-token kernel skips);
//   list[i] = (value offset, column tile 16 g + c, 16-byte chunks, -): the block's columns that
//      are nonempty and active in AT LEAST ONE row (the union), in column order;
//   xs[i][NB] = the listed column's n masked inputs (0 for rows past n and inactive rows).
//
//      column i:  values and bitmap (one cp.async stream, as rr)      decode (rr):
//                 xs[i] = | x0 | x1 | ... | x(NB-1) |                  v = value of row 32 w + j
//                                                                      acc[r][w] += v * xs[i][r]
//
// Lane j of every warp owns rows 32 w + j (w = 0..7) of the 256-row tile for all NB rows of
// x: 8 NB sums in registers. The warps' sums are reduced through shared memory one token at a
// time, then added to y (n rows, ldy apart) with one atomic per row: y += W . mask(x) always
// (the caller zeroes y for a written product). Bytes read: the union's columns once, instead of
// each row's active columns once per row; the union of independent rows at activation sparsity
// dp is 1 - dp^n of the columns, so this pays most at small n. Every lane multiplies all its
// row slots (zeros of unset bits included) into NB sums, the dense product's arithmetic: past
// 4 tokens the tensor-core SpMM is faster (measured, src/tiled_cbc.rs UNION_MAX_TOKENS).

#define UNION_BATCH 32
#define UNION_STAGES 2

template <int NB>
__device__ __forceinline__ void union_kernel(const u32* __restrict__ tile_offset, const u32* __restrict__ col_info,
                                             const u64* __restrict__ bitmaps, const unsigned char* __restrict__ rank,
                                             const f16_bits* __restrict__ values, const float* __restrict__ x,
                                             int ldx, int n_tokens, float* __restrict__ y, int ldy, int M, int K,
                                             int KT, float t, int cols_per_block) {
    constexpr int BATCH = UNION_BATCH, STAGES = UNION_STAGES;
    constexpr int SLOTS_PER_WARP = BATCH / L8_WARPS;
    constexpr u32 STAGE_BYTES = StageLayout<BATCH>::BYTES;
    extern __shared__ __align__(16) unsigned char smem[];
    // After the stages: list[cols_per_block] (uint4), then xs[cols_per_block][NB] (f32).
    uint4* list = reinterpret_cast<uint4*>(smem + STAGES * STAGE_BYTES);
    float* xs = reinterpret_cast<float*>(list + cols_per_block);
    __shared__ int s_warp_count[2][L8_WARPS];
    const u32 sbase = smem_addr(smem);

    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int rt = blockIdx.y;
    int row = rt * TCBC_TILE_M + tid;
    pdl_release();

    // 1. Compaction of the union (two columns per thread, all loads issued together).
    int k0 = blockIdx.x * cols_per_block;
    int k1 = min(k0 + cols_per_block, K);
    u32 info[2], off[2], gc[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int k = k0 + tid + 256 * r;
        info[r] = 0;
        off[r] = 0;
        gc[r] = 0;
        if (k < k1) {
            u32 g = (u32)rt * (u32)KT + (u32)(k >> 4);
            gc[r] = g * TCBC_TILE_K + (u32)(k & 15);
            info[r] = __ldg(col_info + gc[r]);
            off[r] = __ldg(tile_offset + g) + (info[r] >> 16);
        }
    }
    pdl_wait();
    float xv[2][NB];
    bool on[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int k = k0 + tid + 256 * r;
        bool any = false;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            float v = 0.f;
            if (j < n_tokens && k < k1) {
                v = __ldg(x + (size_t)j * ldx + k);
                bool a = active(v, t);
                any |= a;
                v = a ? v : 0.f;
            }
            xv[r][j] = v;
        }
        on[r] = k < k1 && any && (info[r] & 0xffffu) != 0;
    }
    u32 ballot[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        ballot[r] = __ballot_sync(FULL_MASK, on[r]);
        if (lane == 0) s_warp_count[r][warp] = __popc(ballot[r]);
    }
    __syncthreads();
    int n = 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int before = n;
#pragma unroll
        for (int w = 0; w < L8_WARPS; ++w) {
            before += w < warp ? s_warp_count[r][w] : 0;
            n += s_warp_count[r][w];
        }
        if (on[r]) {
            int i = before + __popc(ballot[r] & ((1u << lane) - 1u));
            list[i] = make_uint4(off[r], gc[r], ((info[r] & 0xffffu) + 7u) >> 3, 0u);
#pragma unroll
            for (int j = 0; j < NB; ++j) xs[i * NB + j] = xv[r][j];
        }
    }
    __syncthreads();
    if (n == 0) return;  // uniform: nothing to add

    float acc[NB][8];
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int s = 0; s < 8; ++s) acc[j][s] = 0.f;

    // 2. The rr pipeline over batches of listed columns.
    constexpr int THREADS_PER_SLOT = 256 / BATCH;
    int nb = (n + BATCH - 1) / BATCH;
    int my_slot = tid / THREADS_PER_SLOT, part = tid % THREADS_PER_SLOT;
    auto load = [&](int b, u32 stage) {
        int i = b * BATCH + my_slot;
        stage_column<BATCH>(b < nb && i < n, list, i, values, bitmaps, rank, stage, my_slot, part);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load(s, sbase + (u32)s * STAGE_BYTES);
    u32 cur = sbase;
    u32 next = sbase + (u32)(STAGES - 1) * STAGE_BYTES;
    const u32 last = sbase + (u32)(STAGES - 1) * STAGE_BYTES;
    for (int b = 0; b < nb; ++b) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        load(b + STAGES - 1, next);
        int cnt = min(BATCH, n - b * BATCH);
        u32 val[SLOTS_PER_WARP][8];
#pragma unroll
        for (int u = 0; u < SLOTS_PER_WARP; ++u) {
            int slot = warp + u * L8_WARPS;
            bool valid = slot < cnt;
            rr_decode_slot<BATCH>(cur, valid ? slot : 0, valid, lane, val[u]);
        }
#pragma unroll
        for (int u = 0; u < SLOTS_PER_WARP; ++u) {
            int slot = warp + u * L8_WARPS;
            // Slots past the batch's end decoded to zeros; their xs entry is any listed one.
            const float* xk = xs + (size_t)(b * BATCH + (slot < cnt ? slot : 0)) * NB;
            float xr[NB];
#pragma unroll
            for (int j = 0; j < NB; ++j) xr[j] = xk[j];
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                float v = h2f((unsigned short)val[u][w]);
#pragma unroll
                for (int j = 0; j < NB; ++j) acc[j][w] = fmaf(v, xr[j], acc[j][w]);
            }
        }
        cur = cur == last ? sbase : cur + STAGE_BYTES;
        next = next == last ? sbase : next + STAGE_BYTES;
    }
    cp_async_wait<0>();

    // 3. Per token: the warps' sums through shared memory (the stage buffers), one atomic per
    //    row and token.
    float* red = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        if (j >= n_tokens) break;  // uniform
        __syncthreads();  // stages consumed / previous token's sums read
#pragma unroll
        for (int s = 0; s < 8; ++s) red[warp * TCBC_TILE_M + 32 * s + lane] = acc[j][s];
        __syncthreads();
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < L8_WARPS; ++w) sum += red[w * TCBC_TILE_M + tid];
        if (row < M && sum != 0.f) atomicAdd(y + (size_t)j * ldy + row, sum);
    }
}

#define UNION_ARGS                                                                                 \
    const u32 *__restrict__ tile_offset, const u32 *__restrict__ col_info,                         \
        const u64 *__restrict__ bitmaps, const unsigned char *__restrict__ rank,                   \
        const f16_bits *__restrict__ values, const float *__restrict__ x, int ldx, int n_tokens,   \
        float *__restrict__ y, int ldy, int M, int K, int KT, float t, int cols_per_block
#define UNION_PASS tile_offset, col_info, bitmaps, rank, values, x, ldx, n_tokens, y, ldy, M, K, KT, t, cols_per_block

// At least two resident blocks per multiprocessor asked of the register allocation (8 NB sums
// per lane); n_tokens <= NB.
extern "C" __global__ void __launch_bounds__(256, 2) tcbc_spmspv_union_n2(UNION_ARGS) {
    union_kernel<2>(UNION_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 2) tcbc_spmspv_union_n4(UNION_ARGS) {
    union_kernel<4>(UNION_PASS);
}

// Decodes the whole matrix into Wt, K x M row-major f16 (W transposed), for the batched
// prefill's GEMM. One block per GTile (kt, rt), 256 threads = the tile's rows:
//   1. threads 0..63 stage the tile's 16 x 4 bitmap words and threads 64..79 its 16 column
//      infos in shared memory (one round of loads for the whole tile);
//   2. thread r finds, for each of the 16 columns at once, its value's rank by popcounts over
//      the column's words below its own, and issues the 16 value loads together;
//   3. it writes Wt[k][rt * 256 + r] for each column (consecutive threads, consecutive
//      addresses).
// The earlier kernel walked the columns one after another, three dependent loads each: ~48
// memory latencies per block, 175 us for 11008 x 4096 at sp 0.5 (H200, 2026-12-05), about
// six times its bytes at copy bandwidth.
extern "C" __global__ void __launch_bounds__(256)
tcbc_decode_t(const u32* __restrict__ tile_offset, const u32* __restrict__ col_info,
              const u64* __restrict__ bitmaps, const f16_bits* __restrict__ values,
              f16_bits* __restrict__ wt, int M, int K, int KT) {
    __shared__ u64 s_bm[TCBC_TILE_K * 4];
    __shared__ u32 s_info[TCBC_TILE_K];
    pdl_wait_then_release();
    const int kt = blockIdx.x, rt = blockIdx.y, r = threadIdx.x;
    const int row = rt * TCBC_TILE_M + r;
    const u32 g = (u32)rt * (u32)KT + (u32)kt;
    // Columns of this tile inside the matrix (the last column tile may be partial).
    const int cols = min(TCBC_TILE_K, K - kt * TCBC_TILE_K);
    if (r < TCBC_TILE_K * 4) {
        s_bm[r] = (r >> 2) < cols ? bitmaps[(size_t)g * TCBC_TILE_K * 4 + r] : 0ull;
    } else if (r < TCBC_TILE_K * 5) {
        const int c = r - TCBC_TILE_K * 4;
        s_info[c] = c < cols ? col_info[g * TCBC_TILE_K + c] : 0u;
    }
    const u32 base = tile_offset[g];
    __syncthreads();
    const int word = r >> 6, bit = r & 63;
    f16_bits v[TCBC_TILE_K];
#pragma unroll
    for (int c = 0; c < TCBC_TILE_K; ++c) {
        const u64* bm = s_bm + c * 4;
        u32 rank = 0;
#pragma unroll
        for (int w = 0; w < 3; ++w) rank += w < word ? __popcll(bm[w]) : 0;
        const u64 mine = bm[word];
        rank += __popcll(mine & ((1ull << bit) - 1ull));
        v[c] = ((mine >> bit) & 1ull) ? values[base + (s_info[c] >> 16) + rank] : (f16_bits)0;
    }
    if (row < M) {
#pragma unroll
        for (int c = 0; c < TCBC_TILE_K; ++c)
            if (c < cols) wt[(size_t)(kt * TCBC_TILE_K + c) * M + row] = v[c];
    }
}
