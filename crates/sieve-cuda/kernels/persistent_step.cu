// The whole decode step of a dense f16 model in one launch: a persistent kernel whose blocks
// (one per SM, 512 threads) walk an on-device list of stages derived from the model's plan,
// with a grid-wide barrier between stages instead of a kernel boundary.
//
//   stages  int2 [n] = { kind, layer }, built on the host from sieve_model::plan::step_ops:
//     QKV_EMBED / QKV  x = embedding[token] (first layer only) ; xs = mask(rmsnorm(x) * w)
//                      q|k|v rows in rotate-half pairs (i, i + hd/2) of a head: one warp takes
//                      both rows of a pair, adds the bias, rotates q and k, writes q to the qkv
//                      buffer and k, v (f16) straight to the cache row of position p
//                      (norm + q|k|v product + RoPE + KV write: one stage)
//     ATTENTION        task (q head h, split s) per block: scores of the split's positions,
//                      softmax partials {m, l, acc[hd]} to `part`; the split that arrives last
//                      at the head's counter combines the S partials into att[h] (no barrier).
//                      After a sparse q|k|v (Tiled-CBC, Balanced-CBC) it first does its epilogue from
//                      the raw sums: its q head's RoPE, and in the split holding position p
//                      the new k and v rows (into shared memory; the first query head of each
//                      KV head also writes them to the cache)
//     O                x[r] += W_o[r] . mask(att)
//     GATE_UP          xs = mask(rmsnorm(x) * w) ; h[r] = silu(gate[r] . xs) * (up[r] . xs)
//                      (norm + gate|up product + SwiGLU: one stage)
//     DOWN             x[r] += W_down[r] . mask(h)
//     HEAD             logits[r] = W_lm[r] . mask(rmsnorm(x) * w_final)
//   The sampler (or the teacher-forced advance) stays a kernel of its own after this one.
//
// Tiled-CBC products (any of q|k|v, o, gate|up, down, head; PTcbc.values != 0, the arrays of
// sieve-formats/src/tiled_cbc.rs plus the rank table of src/tiled_cbc.rs): a task is one
// 256-row tile and a range of at most 512 columns, tasks dealt round robin to the blocks; the
// block adds its 256 partial sums to y with atomics (split-K), so a product's rows are only
// whole after the next barrier:
//   q|k|v  -> raw sums in acc_qkv; the ATTENTION stage rotates and caches them (above)
//   gate|up-> raw sums in acc_gu; the DOWN stage's input is silu(gate) * up of them
//   o, down-> added straight into x (the residual);  head -> logits, zeroed by the last DOWN
// acc_qkv is zeroed by every DOWN stage and acc_gu by every ATTENTION stage (each is read two
// or more barriers before and written after). So acc_qkv is zero whenever a step starts, and
// acc_gu is zero before every GATE_UP because an ATTENTION stage always precedes it (a step
// ends with the last layer's gate|up sums still in acc_gu).
//
//   task (rt, k0..k1), 512 threads:
//     1. thread i takes column k0 + i: active if xs[k] != 0 (xs is masked) and nnz > 0; the
//        active columns go to list[] in shared memory (ballot + warp counts), in order
//     2. batches of 32 listed columns through 2..8 cp.async stage buffers (4 by default),
//        the block's tasks one stream of batches, so that one task's compaction, first
//        copies and reduction overlap its neighbour's (tcbc_stage):
//          stage = vals[32][256] f16 | bits[32][8] u32 | rank[32][8] u8    (17,664 bytes)
//        16 threads per column slot, 16-byte chunks part and part + 16
//     3. round-robin decode (tiled_cbc_spmspv.cu, rr): warp w takes slots w and w + 16; lane j
//        owns rows 32 q + j (q = 0..7): value index rank[q] + popc(bits_q below lane j), one
//        conflict-free shared load per word
//     4. the 16 warps' 8 sums per lane reduced in shared memory, one global atomicAdd per row
//   area = list[2][512] uint4 (16 KB) | red[16][256] f32 (16 KB) | stage buffers
//
// Balanced-CBC products (any of the five; PBcbc.blocks != 0: the blocks of
// sieve-formats/src/balanced_cbc.rs as src/balanced_cbc.rs uploads them, idx != 0 the "index"
// layout whose lanes hold 4-bit row indices instead of the row mask, balanced_cbc_spmspv.cu):
// a task is one 512-row tile rt and cols_per_task = 16 cpw columns (cpw <= 64), dealt round
// robin like Tiled-CBC's and added to y with atomics the same way (split-K), so the epilogues
// above hold for them unchanged: any sparse product leaves raw sums.
//
//   task (rt, k0 .. k0 + 16 cpw), 512 threads = 16 warps, a slice of cpw columns per warp:
//
//              warp 0              warp 1                  warp 15
//            k0 .. k0+cpw-1     k0+cpw .. k0+2cpw-1   ...  k0+15cpw .. k0+16cpw-1
//     lane 0   | block (rt, k), lane 0: N slots in rows 512 rt +   0 ..  15
//     lane 1   |                lane 1:                512 rt +  16 ..  31
//      ...     |                                        ...
//     lane 31  |                lane 31:               512 rt + 496 .. 511
//   (the last tile stores only its first last_lanes lanes; the others load and add nothing)
//
//     1. warp w reads xs of its columns (two per lane; xs is masked: 0 = inactive) and ballots
//        a 64-bit mask of the active ones
//     2. the active columns stream through a ring of U register slots (U = 8 for N <= 8, else
//        4): slot u is processed and at once refilled with the next active column, so U
//        columns' loads stay in flight; lane j loads its N / 2 value words (+ the odd N's
//        tail) and its row mask (chain) or index words (index): coalesced 4- and 2-byte loads,
//        the warp reads the whole block and nothing else
//     3. slot i of lane j: acc[w][row_i][j] += value_i * xs[k], the rows from the mask (bfind
//        of its lowest bits in turn) or the nibbles; shared memory, bank = lane
//     4. barrier; thread (s, l) sums acc[0..15][s][l] into row 512 rt + 16 l + s, one global
//        atomicAdd per row; barrier (each warp zeroes its acc at its next task)
//   area = acc[16 warps][16 rows][32 lanes] f32 (32 KB). N is known only at run time: two
//   register sizings (NMAX = 8 and 16, template instances with the index or the chain) take
//   N <= NMAX, the slots past N predicated off.
//
// Products (row-major f16 weights, K a multiple of 8): warp w of block b is global warp
// gw = b * 16 + w; it takes row pairs t = gw, gw + GW, ... (GW = 16 * gridDim.x) of the stage:
//
//      row a:  [ 16B | 16B | ... ]   lane l reads vectors l, l+32, ..., 4 at a time from each
//      row b:  [ 16B | 16B | ... ]   row (8 loads, 4 KB per warp in flight)
//      xs (the stage's input, f32) sits in shared memory, staged once per block and stage.
//
// Before waiting at a barrier a warp asks L2 for the first bytes of its rows of the next stage
// (weights never depend on the barrier), so that the next stage starts on L2 hits.
//
// Grid barrier (grid_barrier): a growing 64-bit arrival count in sync[0..1]. A wait longer than
// watchdog_ns writes the stage (1-based) to *error, raises sync[32] (abort), and every block
// leaves: a dependency bug gives an error on the host instead of a hung GPU. The host re-zeroes
// `sync` after an abort. sync[64 + h] counts the splits of head h that are done (reset by its
// combiner). Before the barrier that precedes attention, each block asks L2 for the K and V
// rows of its first attention task.
//   flags_at > 0 (SIEVE_PERSISTENT_BARRIER=flags, src/persistent.rs) takes flag_barrier instead:
// sync[flags_at + b] = how many barriers block b has passed, over every launch. A block raises
// its own flag (a release store) and threads 0 .. gridDim.x - 1 each wait for one block's flag
// (acquire loads), so the grid's arrivals are gridDim.x stores to different words, where the
// count barrier's are gridDim.x atomics on one word that the L2 serializes (~2 us a barrier,
// 364 us of a 7B step: docs/BENCHMARKS.md "Window N2"). Every block passes the same barriers
// in every launch, so the flags agree at a launch's start and a block reads its base from its own
// flag; an abort leaves them apart, and the host zeroes all of `sync` then.
//
// Intermediate buffers written in this launch (x, qkv, att, h, part, the new cache row) are read
// with ld.global.cg: the L1 is not coherent across SMs. Weights go through the read-only path.
//
// Trace (optional): trace[(stage * gridDim.x + block) * 2 + {0, 1}] = %globaltimer at the
// stage's start (after the barrier) and end (before the next barrier); the word after the last
// stamp holds the positions attention reads (p + 1), so that the host counts the KV bytes of
// the step it timed rather than of the position it believes the step ran at; then one word per
// (stage, block): the bytes its Tiled-CBC or Balanced-CBC tasks asked for (0 for the other
// stages).

#define PS_THREADS 512
#define PS_WARPS 16
#define PS_SCORE_CAP 4096
#define PS_PREFETCH_BYTES 4096
#define PS_NEG_INF __int_as_float(0xff800000)

enum { ST_QKV = 0, ST_QKV_EMBED = 1, ST_ATTENTION = 2, ST_O = 3, ST_GATE_UP = 4, ST_DOWN = 5, ST_HEAD = 6 };

#define PT_BATCH 32
// Stage buffers: a.tcbc_stages (2..8, chosen on the host), tcbc_stages - 1 batches in flight.
#define PT_MAX_STAGES 8
#define PT_MAX_COLS 512
#define PT_BITS_OFF 16384u
#define PT_RANK_OFF 17408u
#define PT_STAGE_BYTES 17664u

// One Tiled-CBC matrix (values == 0: the product is dense rows instead).
struct PTcbc {
    u64 tile_offset, col_info, bitmaps, rank, values;
    int M, K, KT, cols_per_task;
};

// One Balanced-CBC matrix (blocks == 0: not this format): N slots per 16-row group, idx != 0
// the index layout, last_lanes the lanes stored in the last row tile.
struct PBcbc {
    u64 blocks;
    int M, K, N, idx, last_lanes, cols_per_task;
};

struct PLayer {
    u64 attn_norm, qkv, qkv_bias, k_cache, v_cache, o, mlp_norm, gate_up, down;
    float t_qkv, t_o, t_gate_up, t_down;
    PTcbc s_qkv, s_o, s_gate_up, s_down;
    PBcbc b_qkv, b_o, b_gate_up, b_down;
};

struct PArgs {
    u64 layers, stages, embed, final_norm, lm_head;
    u64 x, qkv, att, h, logits, part, state, rope_cos, rope_sin;
    u64 sync, error, trace, watchdog_ns;
    int n_stages, d, H, Hkv, hd, I, vocab, splits;
    float eps, t_head, att_scale;
    int xs_floats, flags_at;
    int tcbc_at;      // byte offset of the Tiled-CBC area in dynamic shared memory
    int tcbc_stages;  // its stage buffers
    u64 acc_qkv, acc_gu;
    PTcbc s_head;
    PBcbc b_head;
};

// The layouts src/persistent.rs mirrors (its test `kernel_structs_have_the_kernels_layout`).
// (sizes only: NVRTC has no offsetof; the Rust test checks the offsets).
static_assert(sizeof(PTcbc) == 56 && sizeof(PBcbc) == 32, "PTcbc / PBcbc layout");
static_assert(sizeof(PLayer) == 440 && sizeof(PArgs) == 312, "PLayer / PArgs layout");

// A product leaves raw sums (split-K atomics: Tiled-CBC or Balanced-CBC) rather than rows.
__device__ __forceinline__ bool sparse_product(const PTcbc& s, const PBcbc& b) {
    return s.values != 0 || b.blocks != 0;
}

__device__ __forceinline__ u64 global_timer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ float ldcg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldcg_u32(const void* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void stcg_f32(float* p, float v) {
    asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ unsigned long long load_acquire_u64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
}

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    __syncthreads();  // red may still be read from the previous call
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < PS_WARPS; ++i) t += red[i];
    return t;
}

__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = PS_NEG_INF;
#pragma unroll
    for (int i = 0; i < PS_WARPS; ++i) t = fmaxf(t, red[i]);
    return t;
}

// Every block waits until all have arrived. False when the step was aborted.
// sync[0..1] is a 64-bit arrival count that only grows (a launch adds gridDim.x per barrier,
// so it is a multiple of gridDim.x between launches): a block's arrival returns the old count,
// and its barrier is passed when the count reaches the next multiple of gridDim.x. One atomic
// per block and barrier, no reset. The abort flag sits on its own 128-byte line (sync[32]).
__device__ bool grid_barrier(u32* sync, u32* error, u64 watchdog_ns, int stage) {
    __shared__ int s_ok;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long* count = reinterpret_cast<unsigned long long*>(sync);
        __threadfence();
        const unsigned long long old = atomicAdd(count, 1ull);
        const unsigned long long target = (old / gridDim.x + 1) * gridDim.x;
        int ok = 1;
        const u64 start = global_timer();
        int spins = 0;
        while (load_acquire_u64(count) < target) {
            if (++spins == 256) {
                spins = 0;
                if (load_acquire(sync + 32)) {
                    ok = 0;
                    break;
                }
                if (global_timer() - start > watchdog_ns) {
                    atomicCAS(error, 0u, (u32)(stage + 1));
                    atomicExch(sync + 32, 1u);
                    ok = 0;
                    break;
                }
            }
        }
        __threadfence();
        s_ok = ok;
    }
    __syncthreads();
    return s_ok != 0;
}

// The flag barrier (header): `target` is the block's base flag plus the barriers passed in this
// launch; gridDim.x <= blockDim.x (the launcher checks).
__device__ bool flag_barrier(u32* sync, u32* error, u64 watchdog_ns, int stage, int flags_at, u32 target) {
    u32* flags = sync + flags_at;
    __syncthreads();  // the block's writes of this stage are done
    if (threadIdx.x == 0) {
        __threadfence();
        store_release(flags + blockIdx.x, target);
    }
    int ok = 1;
    if (threadIdx.x < gridDim.x) {
        const u64 start = global_timer();
        int spins = 0;
        // Signed difference: the flags wrap after 2^32 barriers.
        while ((int)(load_acquire(flags + threadIdx.x) - target) < 0) {
            if (++spins == 256) {
                spins = 0;
                if (load_acquire(sync + 32)) {
                    ok = 0;
                    break;
                }
                if (global_timer() - start > watchdog_ns) {
                    atomicCAS(error, 0u, (u32)(stage + 1));
                    atomicExch(sync + 32, 1u);
                    ok = 0;
                    break;
                }
            }
        }
        __threadfence();
    }
    return __syncthreads_and(ok) != 0;
}

// xs[i] = mask_t(src[i] * scale * w[i]) with scale = 1 / rms(src) (w null: no norm, scale 1).
// Layer 0's first stage takes src from the embedding row instead and writes this block's slice
// of x from it.
// With `gu` (a sparse gate|up's raw sums, gate rows then up rows) src is ignored and the
// input is SwiGLU of them: silu(gate[i]) * up[i], as gate_up_stage computes h.
__device__ void stage_input(float* xs, const float* src, const f16_bits* emb_row, float* x_out, const float* w,
                            int n, float eps, float t, float* red, const float* gu = nullptr) {
    float ss = 0.f;
    const int per = (n + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per, hi = lo + per;
    for (int i = threadIdx.x; i < n; i += PS_THREADS) {
        float v;
        if (gu) {
            const float g = ldcg_f32(gu + i);
            v = g / (1.f + __expf(-g)) * ldcg_f32(gu + n + i);
        } else {
            v = emb_row ? h2f(emb_row[i]) : ldcg_f32(src + i);
        }
        if (emb_row && i >= lo && i < hi) stcg_f32(x_out + i, v);
        xs[i] = v;
        ss += v * v;
    }
    float scale = 1.f;
    if (w) scale = 1.f / sqrtf(block_sum(ss, red) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += PS_THREADS) {
        float v = w ? xs[i] * scale * w[i] : xs[i];
        xs[i] = active(v, t) ? v : 0.f;
    }
    __syncthreads();
}

__device__ __forceinline__ float dot8(const uint4& w, const float* xs, int v) {
    const float4* xp = reinterpret_cast<const float4*>(xs) + 2 * v;
    float4 a = xp[0], b = xp[1];
    float wf[8];
    unpack8(w, wf);
    return wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * b.x + wf[5] * b.y + wf[6] * b.z +
           wf[7] * b.w;
}

// (row a . xs, row b . xs) by one warp; every lane gets both sums.
__device__ __forceinline__ float2 dot2(const f16_bits* a, const f16_bits* b, const float* xs, int K, int lane) {
    const uint4* ra = reinterpret_cast<const uint4*>(a);
    const uint4* rb = reinterpret_cast<const uint4*>(b);
    const int nvec = K >> 3;
    float sa = 0.f, sb = 0.f;
    int v = lane;
    for (; v + 96 < nvec; v += 128) {
        uint4 wa[4], wb[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            wa[u] = ld_stream16(ra + v + 32 * u);
            wb[u] = ld_stream16(rb + v + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            sa += dot8(wa[u], xs, v + 32 * u);
            sb += dot8(wb[u], xs, v + 32 * u);
        }
    }
    for (; v < nvec; v += 32) {
        uint4 wa = ld_stream16(ra + v), wb = ld_stream16(rb + v);
        sa += dot8(wa, xs, v);
        sb += dot8(wb, xs, v);
    }
    return make_float2(warp_sum(sa), warp_sum(sb));
}

__device__ __forceinline__ void prefetch_rows(const f16_bits* a, const f16_bits* b, int K, int lane) {
    const int bytes = min(K * 2, PS_PREFETCH_BYTES);
    for (int off = lane * 128; off < bytes; off += 32 * 128) {
        prefetch_l2(reinterpret_cast<const char*>(a) + off);
        prefetch_l2(reinterpret_cast<const char*>(b) + off);
    }
}

// The two rows (and their count, K) that warp gw multiplies first in stage st; false if none.
__device__ bool first_rows(const PArgs& a, int2 st, int gw, const f16_bits*& ra, const f16_bits*& rb, int& K) {
    const PLayer* L = reinterpret_cast<const PLayer*>(a.layers) + st.y;
    const int half = a.hd / 2;
    // Tiled-CBC stages read only their active columns, known after the barrier.
    // (The head's is read by value: the address of a kernel parameter would move all of them
    // to local memory.)
    // Balanced-CBC stages too (their blocks' addresses depend on the active columns).
    const u64 sparse = st.x == ST_QKV || st.x == ST_QKV_EMBED ? L->s_qkv.values | L->b_qkv.blocks
                       : st.x == ST_O                         ? L->s_o.values | L->b_o.blocks
                       : st.x == ST_GATE_UP                   ? L->s_gate_up.values | L->b_gate_up.blocks
                       : st.x == ST_DOWN                      ? L->s_down.values | L->b_down.blocks
                       : st.x == ST_HEAD                      ? a.s_head.values | a.b_head.blocks
                                                              : 0;
    if (sparse) return false;
    switch (st.x) {
    case ST_QKV:
    case ST_QKV_EMBED: {
        if (gw >= (a.H + 2 * a.Hkv) * half) return false;
        K = a.d;
        const int r0 = (gw / half) * a.hd + gw % half;
        ra = reinterpret_cast<const f16_bits*>(L->qkv) + (size_t)r0 * K;
        rb = ra + (size_t)half * K;
        return true;
    }
    case ST_GATE_UP:
        if (gw >= a.I) return false;
        K = a.d;
        ra = reinterpret_cast<const f16_bits*>(L->gate_up) + (size_t)gw * K;
        rb = ra + (size_t)a.I * K;
        return true;
    case ST_O:
    case ST_DOWN:
    case ST_HEAD: {
        const int M = st.x == ST_HEAD ? a.vocab : a.d;
        if (2 * gw >= M) return false;
        K = st.x == ST_O ? a.H * a.hd : st.x == ST_DOWN ? a.I : a.d;
        const u64 w = st.x == ST_O ? L->o : st.x == ST_DOWN ? L->down : a.lm_head;
        ra = reinterpret_cast<const f16_bits*>(w) + (size_t)(2 * gw) * K;
        rb = 2 * gw + 1 < M ? ra + K : ra;
        return true;
    }
    default:
        return false;
    }
}

// Rows r0 = head * hd + i and r1 = r0 + hd / 2 of q|k|v (sums u, v) with the bias added and,
// for q and k heads, rotated to position p.
__device__ __forceinline__ float2 rope_pair(const PArgs& a, const PLayer* L, int p, int head, int i, float u,
                                            float v) {
    const int half = a.hd / 2, r0 = head * a.hd + i, r1 = r0 + half;
    const float* bias = reinterpret_cast<const float*>(L->qkv_bias);
    if (bias) {
        u += bias[r0];
        v += bias[r1];
    }
    if (head < a.H + a.Hkv) {
        const float c = reinterpret_cast<const float*>(a.rope_cos)[(size_t)p * half + i];
        const float s = reinterpret_cast<const float*>(a.rope_sin)[(size_t)p * half + i];
        return make_float2(u * c - v * s, v * c + u * s);
    }
    return make_float2(u, v);
}

// The same pair from a sparse q|k|v's raw sums in acc_qkv.
__device__ __forceinline__ float2 raw_pair(const PArgs& a, const PLayer* L, int p, int head, int i) {
    const float* raw = reinterpret_cast<const float*>(a.acc_qkv) + (size_t)head * a.hd + i;
    return rope_pair(a, L, p, head, i, ldcg_f32(raw), ldcg_f32(raw + a.hd / 2));
}

// The dense q|k|v's epilogue: the pair through rope_pair, q to the qkv buffer, k and v (f16)
// to the cache row of position p.
__device__ __forceinline__ void qkv_pair(const PArgs& a, const PLayer* L, int p, int head, int i, float u,
                                         float v) {
    const int half = a.hd / 2, r0 = head * a.hd + i, r1 = r0 + half;
    const float2 r = rope_pair(a, L, p, head, i, u, v);
    u = r.x;
    v = r.y;
    if (head < a.H) {
        stcg_f32(reinterpret_cast<float*>(a.qkv) + r0, u);
        stcg_f32(reinterpret_cast<float*>(a.qkv) + r1, v);
    } else {
        const bool is_k = head < a.H + a.Hkv;
        const int kvh = is_k ? head - a.H : head - a.H - a.Hkv;
        f16_bits* dst = reinterpret_cast<f16_bits*>(is_k ? L->k_cache : L->v_cache) + (size_t)p * a.Hkv * a.hd +
                        (size_t)kvh * a.hd;
        dst[i] = f2h(u);
        dst[i + half] = f2h(v);
    }
}

__device__ void qkv_stage(const PArgs& a, const PLayer* L, const float* xs, int p) {
    const int lane = threadIdx.x & 31, gw = blockIdx.x * PS_WARPS + (threadIdx.x >> 5), GW = gridDim.x * PS_WARPS;
    const int half = a.hd / 2, K = a.d;
    const int T = (a.H + 2 * a.Hkv) * half;
    const f16_bits* W = reinterpret_cast<const f16_bits*>(L->qkv);
    for (int t = gw; t < T; t += GW) {
        const int head = t / half, i = t % half;
        const int r0 = head * a.hd + i, r1 = r0 + half;
        float2 y = dot2(W + (size_t)r0 * K, W + (size_t)r1 * K, xs, K, lane);
        if (lane == 0) qkv_pair(a, L, p, head, i, y.x, y.y);
    }
}

// Listed column e = (value offset, column tile 16 g + c, 16-byte chunks, x bits) into slot
// `slot` of the stage buffer at `stage` (header, step 2); every thread commits a group.
__device__ __forceinline__ void pt_stage_column(bool have, uint4 e, const PTcbc& m, u32 stage, int slot,
                                                int part) {
    if (have) {
        const f16_bits* src = reinterpret_cast<const f16_bits*>(m.values) + e.x;
        const u32 dst = stage + (u32)slot * 512u + (u32)part * 16u;
        if ((u32)part < e.z) cp_async16_s(dst, src + part * 8);
        if ((u32)part + 16u < e.z) cp_async16_s(dst + 256u, src + (part + 16) * 8);
        if (part < 2)
            cp_async16_s(stage + PT_BITS_OFF + (u32)slot * 32u + (u32)part * 16u,
                    reinterpret_cast<const u64*>(m.bitmaps) + (size_t)e.y * 4 + part * 2);
        else if (part == 2)
            cp_async8_s(stage + PT_RANK_OFF + (u32)slot * 8u, reinterpret_cast<const unsigned char*>(m.rank) + (size_t)e.y * 8);
    }
    cp_async_commit();
}

// cp.async.wait_group takes an immediate: the host's stage count picks one.
__device__ __forceinline__ void pt_wait_all_but(int n) {
    switch (n) {
    case 7: cp_async_wait<7>(); break;
    case 6: cp_async_wait<6>(); break;
    case 5: cp_async_wait<5>(); break;
    case 4: cp_async_wait<4>(); break;
    case 3: cp_async_wait<3>(); break;
    case 2: cp_async_wait<2>(); break;
    case 1: cp_async_wait<1>(); break;
    default: cp_async_wait<0>(); break;
    }
}

// Step 1 for task (rt, k0..k1): the active columns into `list`, in order; returns their count
// (the same in every thread) and adds this thread's metadata bytes to `bytes`.
__device__ int tcbc_compact(const PTcbc& m, const float* xs, int rt, int k0, int k1, uint4* list, int* wc,
                            u32& bytes) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // The column's metadata is read only when its input is active.
    const int k = k0 + tid;
    bool on = false;
    uint4 e = make_uint4(0u, 0u, 0u, 0u);
    if (k < k1) {
        const float xv = xs[k];
        if (xv != 0.f) {
            const u32 g = (u32)rt * (u32)m.KT + (u32)(k >> 4);
            const u32 gc = g * 16u + (u32)(k & 15);
            const u32 info = __ldg(reinterpret_cast<const u32*>(m.col_info) + gc);
            const u32 off = __ldg(reinterpret_cast<const u32*>(m.tile_offset) + g);
            on = (info & 0xffffu) != 0;
            e = make_uint4(off + (info >> 16), gc, ((info & 0xffffu) + 7u) >> 3, __float_as_uint(xv));
            bytes += 8u + (on ? e.z * 16u + 40u : 0u);
        }
    }
    const u32 ballot = __ballot_sync(FULL_MASK, on);
    if (lane == 0) wc[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, n = 0;
#pragma unroll
    for (int w = 0; w < PS_WARPS; ++w) {
        before += w < warp ? wc[w] : 0;
        n += wc[w];
    }
    if (on) list[before + __popc(ballot & ((1u << lane) - 1u))] = e;
    __syncthreads();  // the list is whole; wc may be rewritten
    return n;
}

// y += W . xs over all tasks of the product (header, steps 1-4); the block's bytes (thread
// 0's return value, when `count`).
//   The block's tasks j = 0, 1, ... (task blockIdx.x + j * gridDim.x, tile rt, columns k0..k1)
// are one stream of batches through the stage buffers, so that a task's latency chain overlaps
// its neighbours' copies instead of running alone:
//   - task j + 1's compaction (list (j + 1) & 1) runs before task j is consumed, while task
//     j's first batches are already in flight (they were issued during task j - 1);
//   - the copies run up to `stages` - 1 batches ahead of the consumer, across task boundaries;
//   - task j's reduction (through red, then one global atomic per row) runs while task j + 1's
//     first batches land.
// `area`: list[2][512] uint4 | red[16][256] f32 | `stages` stage buffers. Batch i of the
// stream (issue order) sits in buffer i % stages.
// `m` by value: its fields stay in registers across the tasks' atomics.
__device__ u64 tcbc_stage(const PTcbc m, const float* xs, float* y, unsigned char* area, int stages, int* wc,
                          bool count) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row_tiles = (m.M + 255) / 256, chunks = (m.K + m.cols_per_task - 1) / m.cols_per_task;
    const int ntask = row_tiles * chunks;
    const int T = (int)blockIdx.x < ntask ? (ntask - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    uint4* lists = reinterpret_cast<uint4*>(area);
    float* red = reinterpret_cast<float*>(area + 2 * PT_MAX_COLS * 16);
    const u32 sbase = smem_addr(area + 2 * PT_MAX_COLS * 16 + PS_WARPS * 256 * 4);
    u32 bytes = 0;
    if (T > 0) {
        auto task_rt = [&](int j) { return (int)(blockIdx.x + j * gridDim.x) % row_tiles; };
        auto task_k0 = [&](int j) { return (int)(blockIdx.x + j * gridDim.x) / row_tiles * m.cols_per_task; };
        auto compact = [&](int j) {
            const int k0 = task_k0(j);
            return tcbc_compact(m, xs, task_rt(j), k0, min(k0 + m.cols_per_task, m.K), lists + (j & 1) * PT_MAX_COLS,
                                wc, bytes);
        };
        // Active columns of tasks j and j + 1, by j & 1 (two scalars: an indexed pair would
        // live in local memory).
        int nact_even = compact(0), nact_odd = 0;
        auto nact = [&](int j) { return (j & 1) ? nact_odd : nact_even; };
        int known = 1;                  // tasks [0, known) are compacted
        int ij = 0, ib = 0;             // the next batch to issue: task ij, batch ib
        int issued = 0, consumed = 0;   // batches of the stream
        const int slot = tid >> 4, part = tid & 15;
        // Issues batches while a buffer is free and the next batch's task is compacted; every
        // thread commits one group per batch (empty when it has no chunk of it).
        auto issue = [&]() {
            while (issued - consumed < stages) {
                while (ij < known && ib * PT_BATCH >= nact(ij)) {
                    ++ij;
                    ib = 0;
                }
                if (ij >= known) return;
                const int i = ib * PT_BATCH + slot;
                const bool have = i < nact(ij);
                pt_stage_column(have, have ? lists[(ij & 1) * PT_MAX_COLS + i] : make_uint4(0u, 0u, 0u, 0u), m,
                                sbase + (u32)(issued % stages) * PT_STAGE_BYTES, slot, part);
                ++issued;
                ++ib;
            }
        };
        issue();
        const u32 lane_below = (1u << lane) - 1u;
        for (int j = 0; j < T; ++j) {
            // List (j + 1) & 1 held task j - 1, whose batches are all consumed (the barrier
            // after its reduction).
            if (j + 1 < T) {
                const int n_next = compact(j + 1);
                if ((j + 1) & 1)
                    nact_odd = n_next;
                else
                    nact_even = n_next;
                known = j + 2;
            }
            issue();  // tops up; a task with no active columns leaves the stream empty here
            const int n = nact(j), nb = (n + PT_BATCH - 1) / PT_BATCH;
            const uint4* list = lists + (j & 1) * PT_MAX_COLS;
            float acc[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] = 0.f;
            for (int b = 0; b < nb; ++b) {
                pt_wait_all_but(issued - consumed - 1);  // this batch has landed (this thread's copies)
                __syncthreads();                         // ... everyone's; the previous one is consumed
                issue();
                const u32 cur = sbase + (u32)(consumed % stages) * PT_STAGE_BYTES;
                const int cnt = min(PT_BATCH, n - b * PT_BATCH);
                // 3. Round-robin decode of slots warp and warp + 16: every shared load of both
                //    slots issued before the first FMA (16 warps a block are too few to hide a
                //    load-to-FMA chain per bit; the graph kernel has 40 a multiprocessor).
                u32 val[PT_BATCH / PS_WARPS][8];
                float xk[PT_BATCH / PS_WARPS];
#pragma unroll
                for (int u = 0; u < PT_BATCH / PS_WARPS; ++u) {
                    const int sl0 = warp + u * PS_WARPS;
                    const bool valid = sl0 < cnt;
                    const int sl = valid ? sl0 : 0;
                    xk[u] = __uint_as_float(list[b * PT_BATCH + sl].w);
                    const uint4 wa = lds_u32x4(cur + PT_BITS_OFF + (u32)sl * 32u);
                    const uint4 wb = lds_u32x4(cur + PT_BITS_OFF + (u32)sl * 32u + 16u);
                    const uint2 rk = lds_u32x2(cur + PT_RANK_OFF + (u32)sl * 8u);
                    const u32 words[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
                    const u32 vbase = cur + (u32)sl * 512u;
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        const u32 r = ((q < 4 ? rk.x : rk.y) >> (8 * (q & 3))) & 0xffu;
                        const bool on = valid && ((words[q] >> lane) & 1u);
                        val[u][q] = on ? lds_u16(vbase + 2u * (r + __popc(words[q] & lane_below))) : 0u;
                    }
                }
#pragma unroll
                for (int u = 0; u < PT_BATCH / PS_WARPS; ++u) {
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[q] = fmaf(h2f((unsigned short)val[u][q]), xk[u], acc[q]);
                }
                ++consumed;
            }
            // 4. The 16 warps' sums of the task's 256 rows through `red`, then one atomic per
            //    row. (Shared-memory float atomics are a compare-and-swap loop: 16 warps
            //    finishing together on the same 256 words made the whole stream 13% slower.)
            //    red is written again only after a barrier of the next task with columns.
            if (nb > 0) {
#pragma unroll
                for (int q = 0; q < 8; ++q) red[warp * 256 + 32 * q + lane] = acc[q];
            }
            __syncthreads();  // red is whole; every buffer of task j is consumed
            if (nb > 0 && tid < 256) {
                float sum = 0.f;
#pragma unroll
                for (int w = 0; w < PS_WARPS; ++w) sum += red[w * 256 + tid];
                const int row = task_rt(j) * 256 + tid;
                if (row < m.M && sum != 0.f) atomicAdd(y + row, sum);
            }
        }
        cp_async_wait<0>();  // nothing is in flight (every issued batch was consumed)
    }
    __syncthreads();  // the area is reused by the next stage
    if (!count) return 0;
    __shared__ unsigned long long s_bytes;
    if (threadIdx.x == 0) s_bytes = 0;
    __syncthreads();
    const u32 w = __reduce_add_sync(FULL_MASK, bytes);
    if ((threadIdx.x & 31) == 0) atomicAdd(&s_bytes, (unsigned long long)w);
    __syncthreads();
    return s_bytes;
}

// ---- Balanced-CBC (header) ----

#define PB_TILE 512
#define PB_WARP_ACC 512  // floats of a warp's accumulators: [16 rows][32 lanes]

__device__ __forceinline__ u32 pb_ld32(const unsigned char* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 pb_ld16(const unsigned char* p) {
    unsigned short v;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 pb_bit_index(u32 one_bit) {
    u32 s;
    asm("bfind.u32 %0, %1;" : "=r"(s) : "r"(one_bit));
    return s;
}

// y += W . xs over the block's tasks of Balanced-CBC matrix m (header, steps 1-4), m.N <= NMAX
// (the register arrays' size; slots past m.N are predicated off), IDX: the index layout.
// `acc`: the area's 16 warps' accumulators. Returns the bytes this thread's warp asked for
// (in lane 0).
template <int NMAX, bool IDX>
__device__ __forceinline__ u32 bcbc_tasks(const PBcbc& m, const float* xs, float* y, float* acc) {
    constexpr int U = NMAX <= 8 ? 8 : 4;              // columns in flight per warp
    constexpr int WORDS = NMAX / 2;                   // value words per lane (odd N: tail in word N / 2)
    constexpr int META = IDX ? (NMAX + 7) / 8 : 1;    // index words, or the row mask
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int N = m.N, K = m.K, half_n = m.N / 2, iw = (m.N + 7) / 8;
    const bool odd = (m.N & 1) != 0;
    // A full tile's block (32 lanes), which also places the tiles: tile rt at rt K full.
    const u32 full = IDX ? 64u * (u32)N + 128u * (u32)iw : 64u * (u32)N + 64u;
    const int row_tiles = (m.M + PB_TILE - 1) / PB_TILE, cpt = m.cols_per_task, cpw = cpt / PS_WARPS;
    const int ntask = row_tiles * ((K + cpt - 1) / cpt);
    const unsigned char* blocks = reinterpret_cast<const unsigned char*>(m.blocks);
    float* wacc = acc + warp * PB_WARP_ACC;
    char* acc_bytes = reinterpret_cast<char*>(wacc);
    const u32 lane_base = 4u * (u32)lane;  // byte offset of the lane's row 0 (row r at + 128 r)
    u32 bytes = 0;
    // The ring (header, step 2); `ring` bit u: slot u holds a column (warp-uniform).
    u32 words[U][WORDS], meta[U][META];
    float xk[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        xk[u] = 0.f;
#pragma unroll
        for (int w = 0; w < WORDS; ++w) words[u][w] = 0u;
#pragma unroll
        for (int w = 0; w < META; ++w) meta[u][w] = 0u;
    }
    for (int task = blockIdx.x; task < ntask; task += gridDim.x) {
        const int rt = task % row_tiles, k0 = task / row_tiles * cpt;
        const int lanes = rt == row_tiles - 1 ? m.last_lanes : 32;
        const u32 idx_at = ((u32)lanes * 2u * (u32)N + 3u) & ~3u;  // IDX: the index words' offset
        const u32 block_bytes = lanes == 32 ? full
                                : IDX      ? (idx_at + 4u * (u32)iw * (u32)lanes + 15u) & ~15u
                                           : ((u32)lanes * (2u * (u32)N + 2u) + 15u) & ~15u;
        const u32 stride = 4u * (u32)lanes;  // bytes from one lane-major word row to the next
        const bool stored = lane < lanes;
        const unsigned char* tile = blocks + (size_t)rt * (size_t)K * full;
        // The lane's column of the warp's accumulators (only this lane touches it until the
        // barrier before the reduction).
#pragma unroll
        for (int s = 0; s < 16; ++s) wacc[s * 32 + lane] = 0.f;
        // 1. The slice's active columns, bit s = column begin + s.
        const int begin = k0 + warp * cpw, end = min(begin + cpw, K);
        const int ka = begin + lane, kb = begin + 32 + lane;
        const u32 lo = __ballot_sync(FULL_MASK, ka < end && xs[ka] != 0.f);
        const u32 hi = __ballot_sync(FULL_MASK, kb < end && xs[kb] != 0.f);
        u64 pending = (u64)hi << 32 | lo;
        if (lane == 0) bytes += (u32)__popcll(pending) * block_bytes;
        u32 ring = 0;
        // The next active column into slot u (u is a constant after unrolling).
        auto fetch = [&](int u) {
            if (pending == 0) {
                ring &= ~(1u << u);
                return;
            }
            ring |= 1u << u;
            const int k = begin + __ffsll((long long)pending) - 1;
            pending &= pending - 1;
            xk[u] = xs[k];
            if (stored) {
                const unsigned char* blk = tile + (size_t)k * block_bytes;
#pragma unroll
                for (int w = 0; w < WORDS; ++w) {
                    if (w < half_n)
                        words[u][w] = pb_ld32(blk + 4 * lane + w * stride);
                    else if (w == half_n && odd)
                        words[u][w] = pb_ld16(blk + 2 * lane + w * stride);
                }
                if (IDX) {
#pragma unroll
                    for (int w = 0; w < META; ++w)
                        if (w < iw) meta[u][w] = pb_ld32(blk + idx_at + w * stride + 4 * lane);
                } else {
                    meta[u][0] = pb_ld16(blk + 2u * (u32)lanes * (u32)N + 2 * lane);
                }
            }
        };
        // 3. Slot u's column into the lane's rows, eight slots at a time: the eight
        // accumulators read before any is written (a lane's slots are distinct rows), so their
        // read-modify-writes overlap.
        auto process = [&](int u) {
            if (!stored) return;
            u32 b = meta[u][0];  // chain: the row mask's bits not yet taken
#pragma unroll
            for (int i0 = 0; i0 < NMAX; i0 += 8) {
                u32 off[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (IDX) {
                        // Nibble i % 8 of word i / 8 shifted to bits 7..10 (row * 128).
                        const u32 w = meta[u][i0 / 8];
                        const int sh = 4 * j - 7;
                        off[j] = ((sh < 0 ? w << -sh : w >> sh) & 0x780u) | lane_base;
                    } else {
                        const u32 rest = b & (b - 1u);
                        off[j] = pb_bit_index(b ^ rest) * 128u + lane_base;
                        b = rest;
                    }
                }
                float acc_v[8];
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (i0 + j < N) acc_v[j] = *reinterpret_cast<const float*>(acc_bytes + off[j]);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int i = i0 + j;
                    if (i < N) {
                        const u32 w = words[u][i / 2];
                        const float v = h2f((unsigned short)((i & 1) ? (w >> 16) : (w & 0xffffu)));
                        *reinterpret_cast<float*>(acc_bytes + off[j]) = fmaf(v, xk[u], acc_v[j]);
                    }
                }
            }
        };
        // 2. The ring: slot u processed, then refilled. Columns enter in order, so an empty
        // slot 0 at the top of a round means an empty ring.
#pragma unroll
        for (int u = 0; u < U; ++u) fetch(u);
        while (ring & 1u) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if ((ring >> u) & 1u) process(u);
                fetch(u);
            }
        }
        // 4. Thread (s, l) = (warp, lane): row 512 rt + 16 l + s, conflict-free reads.
        __syncthreads();
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < PS_WARPS; ++w) sum += acc[w * PB_WARP_ACC + warp * 32 + lane];
        const int row = rt * PB_TILE + 16 * lane + warp;
        if (row < m.M && sum != 0.f) atomicAdd(y + row, sum);
        __syncthreads();  // read before the next task's zeroing
    }
    return bytes;
}

// y += W . xs for a Balanced-CBC matrix (header); the block's bytes (thread 0's return value,
// when `count`). `area` holds the accumulators; it is free again on return. Inlined at one call
// site (the main loop's, after its switch): a call would spill the kernel's live registers, and
// five inlined copies of its four instances would bloat the kernel.
__device__ __forceinline__ u64 bcbc_stage(const PBcbc m, const float* xs, float* y, unsigned char* area, bool count) {
    float* acc = reinterpret_cast<float*>(area);
    u32 bytes;
    if (m.N <= 8)
        bytes = m.idx ? bcbc_tasks<8, true>(m, xs, y, acc) : bcbc_tasks<8, false>(m, xs, y, acc);
    else
        bytes = m.idx ? bcbc_tasks<16, true>(m, xs, y, acc) : bcbc_tasks<16, false>(m, xs, y, acc);
    __syncthreads();  // a block without tasks passed no barrier
    if (!count) return 0;
    __shared__ unsigned long long s_bcbc_bytes;
    if (threadIdx.x == 0) s_bcbc_bytes = 0;
    __syncthreads();
    const u32 w = __reduce_add_sync(FULL_MASK, bytes);
    if ((threadIdx.x & 31) == 0) atomicAdd(&s_bcbc_bytes, (unsigned long long)w);
    __syncthreads();
    return s_bcbc_bytes;
}

// Zeroes this block's share of buf[0 .. n).
__device__ __forceinline__ void zero_share(u64 buf, int n) {
    float* f = reinterpret_cast<float*>(buf);
    for (int i = blockIdx.x * PS_THREADS + threadIdx.x; i < n; i += gridDim.x * PS_THREADS) stcg_f32(f + i, 0.f);
}

// Rows of W (M x K) against xs, two per warp: y[r] = dot (HEAD), or y[r] += dot (O, DOWN).
__device__ void rows_stage(const f16_bits* W, const float* xs, float* y, int M, int K, bool add) {
    const int lane = threadIdx.x & 31, gw = blockIdx.x * PS_WARPS + (threadIdx.x >> 5), GW = gridDim.x * PS_WARPS;
    for (int t = gw; 2 * t < M; t += GW) {
        const int r0 = 2 * t, r1 = min(r0 + 1, M - 1);
        float2 s = dot2(W + (size_t)r0 * K, W + (size_t)r1 * K, xs, K, lane);
        if (lane == 0) {
            stcg_f32(y + r0, add ? ldcg_f32(y + r0) + s.x : s.x);
            if (r1 != r0) stcg_f32(y + r1, add ? ldcg_f32(y + r1) + s.y : s.y);
        }
    }
}

__device__ void gate_up_stage(const PArgs& a, const PLayer* L, const float* xs) {
    const int lane = threadIdx.x & 31, gw = blockIdx.x * PS_WARPS + (threadIdx.x >> 5), GW = gridDim.x * PS_WARPS;
    const f16_bits* W = reinterpret_cast<const f16_bits*>(L->gate_up);
    float* h = reinterpret_cast<float*>(a.h);
    for (int t = gw; t < a.I; t += GW) {
        float2 s = dot2(W + (size_t)t * a.d, W + (size_t)(a.I + t) * a.d, xs, a.d, lane);
        if (lane == 0) stcg_f32(h + t, s.x / (1.f + __expf(-s.x)) * s.y);
    }
}

// Attention of query head h over positions [b, e) of the cache (f16 [C][Hkv][hd]): this
// block's partial {m, l, acc[hd]}; the last split of the head to finish combines them.
__device__ void attention_task(const PArgs& a, const PLayer* L, int h, int s, int len, float* sc, float* red,
                               float* qs, float* accs, f16_bits* newk, f16_bits* newv) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hd = a.hd, S = a.splits, kh = h / (a.H / a.Hkv);
    const int per = (len + S - 1) / S, b = min(s * per, len), e = min(b + per, len), n = e - b;
    const size_t row = (size_t)a.Hkv * hd;
    const f16_bits* kc = reinterpret_cast<const f16_bits*>(L->k_cache) + (size_t)kh * hd;
    const f16_bits* vc = reinterpret_cast<const f16_bits*>(L->v_cache) + (size_t)kh * hd;
    // A sparse q|k|v left raw sums (acc_qkv): the task rotates its own q, and the split
    // holding the new position p = len - 1 takes that position's k and v rows from acc_qkv too,
    // rounded to f16 as the cache stores them, into shared memory (newk, newv); the first query
    // head of each KV head writes them to the cache for the steps after this one. So no block
    // reads cache row p in this stage, and no stage of its own is needed for RoPE.
    const bool raw = sparse_product(L->s_qkv, L->b_qkv);  // Tiled-CBC or Balanced-CBC
    const int p = len - 1, half = hd / 2;
    const bool has_new = raw && b <= p && p < e;
    // Threads [0, hd/2) rotate q pairs; the next whole warps, [k0, k0 + hd), take k pairs then
    // v pairs (k0 + hd <= 384 for hd <= 256).
    const int k0 = (half + 31) / 32 * 32;
    if (raw) {
        if (tid < half) {
            const float2 r = raw_pair(a, L, p, h, tid);
            qs[tid] = r.x * a.att_scale;
            qs[tid + half] = r.y * a.att_scale;
        }
        if (has_new && tid >= k0 && tid < k0 + hd) {
            const int j = tid - k0, is_v = j >= half, i = is_v ? j - half : j;
            const float2 r = raw_pair(a, L, p, a.H + is_v * a.Hkv + kh, i);
            f16_bits* dst = is_v ? newv : newk;
            dst[i] = f2h(r.x);
            dst[i + half] = f2h(r.y);
            if (h % (a.H / a.Hkv) == 0) {
                f16_bits* row_p = const_cast<f16_bits*>(is_v ? vc : kc) + (size_t)p * row;
                row_p[i] = dst[i];
                row_p[i + half] = dst[i + half];
            }
        }
    } else if (tid < hd) {
        qs[tid] = ldcg_f32(reinterpret_cast<const float*>(a.qkv) + (size_t)h * hd + tid) * a.att_scale;
    }
    __syncthreads();
    const u32* newk_w = reinterpret_cast<const u32*>(newk);
    const u32* newv_w = reinterpret_cast<const u32*>(newv);
    // Scores: a warp per position, lane l holds dims [l*E, l*E + E) (E = hd / 32, even), four
    // positions' loads in flight at once.
    const int E2 = hd / 64;  // u32 words per lane
    for (int t0 = b + warp; t0 < e; t0 += 4 * PS_WARPS) {
        u32 kw[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int t = t0 + j * PS_WARPS;
#pragma unroll
            for (int wi = 0; wi < 4; ++wi)
                kw[j][wi] = (t >= e || wi >= E2) ? 0u
                            : (has_new && t == p) ? newk_w[lane * E2 + wi]
                                                  : ldcg_u32(kc + (size_t)t * row + lane * 2 * E2 + 2 * wi);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float dot = 0.f;
#pragma unroll
            for (int wi = 0; wi < 4; ++wi) {
                if (wi < E2) {
                    float lo, hi;
                    unpack2(kw[j][wi], lo, hi);
                    dot += qs[lane * 2 * E2 + 2 * wi] * lo + qs[lane * 2 * E2 + 2 * wi + 1] * hi;
                }
            }
            dot = warp_sum(dot);
            const int t = t0 + j * PS_WARPS;
            if (lane == 0 && t < e) sc[t - b] = dot;
        }
    }
    __syncthreads();
    float m = PS_NEG_INF;
    for (int i = tid; i < n; i += PS_THREADS) m = fmaxf(m, sc[i]);
    m = block_max(m, red);
    float l = 0.f;
    for (int i = tid; i < n; i += PS_THREADS) {
        const float pv = __expf(sc[i] - m);
        sc[i] = pv;
        l += pv;
    }
    l = block_sum(l, red);  // its barriers also publish sc
    // Values: thread (word c of a row, group g) sums positions b + g, b + g + NG, ...
    const int W2 = hd / 2, NG = PS_THREADS / W2, c = tid % W2, g = tid / W2;
    float a0 = 0.f, a1 = 0.f;
    for (int t0 = b + g; t0 < e; t0 += 4 * NG) {
        u32 vw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int t = t0 + j * NG;
            vw[j] = t >= e ? 0u : (has_new && t == p) ? newv_w[c] : ldcg_u32(vc + (size_t)t * row + 2 * c);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int t = t0 + j * NG;
            if (t < e) {
                float lo, hi;
                unpack2(vw[j], lo, hi);
                const float pv = sc[t - b];
                a0 += pv * lo;
                a1 += pv * hi;
            }
        }
    }
    if (g < NG) {
        accs[g * hd + 2 * c] = a0;
        accs[g * hd + 2 * c + 1] = a1;
    }
    __syncthreads();
    float* part = reinterpret_cast<float*>(a.part) + (size_t)(h * S + s) * (hd + 2);
    if (tid < hd) {
        float acc = 0.f;
        for (int j = 0; j < NG; ++j) acc += accs[j * hd + tid];
        stcg_f32(part + 2 + tid, acc);
    }
    if (tid == 0) {
        stcg_f32(part, n > 0 ? m : PS_NEG_INF);
        stcg_f32(part + 1, n > 0 ? l : 0.f);
    }
    __shared__ int s_last;
    __syncthreads();
    u32* count = reinterpret_cast<u32*>(a.sync) + 64 + h;
    if (tid == 0) {
        __threadfence();
        s_last = atomicAdd(count, 1u) == (u32)(S - 1);
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (tid < hd) {
        const float* base = reinterpret_cast<const float*>(a.part) + (size_t)h * S * (hd + 2);
        float M = PS_NEG_INF;
        for (int j = 0; j < S; ++j) M = fmaxf(M, ldcg_f32(base + (size_t)j * (hd + 2)));
        float num = 0.f, den = 0.f;
        for (int j = 0; j < S; ++j) {
            const float* pj = base + (size_t)j * (hd + 2);
            const float mj = ldcg_f32(pj);
            const float wj = mj == PS_NEG_INF ? 0.f : __expf(mj - M);
            den += wj * ldcg_f32(pj + 1);
            num += wj * ldcg_f32(pj + 2 + tid);
        }
        stcg_f32(reinterpret_cast<float*>(a.att) + (size_t)h * hd + tid, num / den);
    }
    if (tid == 0) atomicExch(count, 0u);
}

// The K and V cache rows of this block's first attention task (the new position's row is
// written in this stage: asking L2 for its stale line is harmless, L2 is coherent).
__device__ void prefetch_attention(const PArgs& a, const PLayer* L, int len) {
    const int task = blockIdx.x;
    if (task >= a.H * a.splits) return;
    const int h = task / a.splits, s = task % a.splits, S = a.splits;
    const int kh = h / (a.H / a.Hkv), per = (len + S - 1) / S;
    const int b = min(s * per, len), e = min(b + per, len);
    const size_t row = (size_t)a.Hkv * a.hd;
    const int lines = (a.hd * 2 + 127) / 128;
    for (int i = threadIdx.x; i < (e - b) * lines * 2; i += PS_THREADS) {
        const int t = b + i / (lines * 2), r = i % (lines * 2);
        const u64 base = (r & 1) ? L->v_cache : L->k_cache;
        prefetch_l2(reinterpret_cast<const f16_bits*>(base) + (size_t)t * row + (size_t)kh * a.hd + (r >> 1) * 64);
    }
}

extern "C" __global__ void __launch_bounds__(PS_THREADS, 1) persistent_step(const PArgs a) {
    // 16-byte aligned: the Tiled-CBC stage buffers take 16-byte cp.async copies.
    extern __shared__ __align__(16) float smem[];
    float* xs = smem;                          // [xs_floats]
    float* sc = xs + a.xs_floats;              // [PS_SCORE_CAP]
    float* accs = sc + PS_SCORE_CAP;           // [PS_THREADS * 2]
    float* qs = accs + 2 * PS_THREADS;         // [256]
    unsigned char* area = reinterpret_cast<unsigned char*>(smem) + a.tcbc_at;  // sparse tasks
    // The new position's k and v rows of a sparse q|k|v's attention (only such models have
    // the area; no sparse task runs in an attention stage).
    f16_bits* newk = reinterpret_cast<f16_bits*>(area);
    f16_bits* newv = newk + 256;
    __shared__ float red[PS_WARPS];
    __shared__ int wc[PS_WARPS];
    const int* state = reinterpret_cast<const int*>(a.state);
    const int p = (int)ldcg_u32(state);
    int tok = (int)ldcg_u32(state + 1);
    if (tok < 0 || tok >= a.vocab) tok = 0;  // the host checks every id it writes
    const int2* stages = reinterpret_cast<const int2*>(a.stages);
    u32* sync = reinterpret_cast<u32*>(a.sync);
    u32* error = reinterpret_cast<u32*>(a.error);
    u64* trace = reinterpret_cast<u64*>(a.trace);
    const int lane = threadIdx.x & 31, gw = blockIdx.x * PS_WARPS + (threadIdx.x >> 5);
    float* x = reinterpret_cast<float*>(a.x);
    if (trace && blockIdx.x == 0 && threadIdx.x == 0) trace[(size_t)a.n_stages * gridDim.x * 2] = (u64)(p + 1);
    // The flag barrier's base: this block's own flag, which only it writes (header).
    u32 passed = a.flags_at > 0 ? ldcg_u32(sync + a.flags_at + blockIdx.x) : 0u;
    for (int si = 0; si < a.n_stages; ++si) {
        const int2 st = stages[si];
        const PLayer* L = reinterpret_cast<const PLayer*>(a.layers) + st.y;
        if (trace && threadIdx.x == 0) trace[((size_t)si * gridDim.x + blockIdx.x) * 2] = global_timer();
        u64 counted = 0;  // bytes the block's sparse tasks asked for (traced steps)
        // A Balanced-CBC product of this stage (blocks != 0) into bcbc_y, run after the switch.
        PBcbc bcbc = {};
        float* bcbc_y = nullptr;
        switch (st.x) {
        case ST_QKV:
        case ST_QKV_EMBED: {
            const f16_bits* emb =
                st.x == ST_QKV_EMBED ? reinterpret_cast<const f16_bits*>(a.embed) + (size_t)tok * a.d : nullptr;
            stage_input(xs, x, emb, x, reinterpret_cast<const float*>(L->attn_norm), a.d, a.eps, L->t_qkv, red);
            if (L->s_qkv.values)
                counted = tcbc_stage(L->s_qkv, xs, reinterpret_cast<float*>(a.acc_qkv), area, a.tcbc_stages, wc, trace != nullptr);
            else if (L->b_qkv.blocks) {
                bcbc = L->b_qkv;  // run after the switch
                bcbc_y = reinterpret_cast<float*>(a.acc_qkv);
            } else
                qkv_stage(a, L, xs, p);
            break;
        }
        case ST_ATTENTION:
            if (a.acc_gu) zero_share(a.acc_gu, 2 * a.I);
            for (int task = blockIdx.x; task < a.H * a.splits; task += gridDim.x) {
                attention_task(a, L, task / a.splits, task % a.splits, p + 1, sc, red, qs, accs, newk, newv);
                __syncthreads();
            }
            break;
        case ST_O:
            stage_input(xs, reinterpret_cast<const float*>(a.att), nullptr, nullptr, nullptr, a.H * a.hd, a.eps,
                        L->t_o, red);
            if (L->s_o.values)
                counted = tcbc_stage(L->s_o, xs, x, area, a.tcbc_stages, wc, trace != nullptr);
            else if (L->b_o.blocks) {
                bcbc = L->b_o;  // run after the switch
                bcbc_y = x;
            } else
                rows_stage(reinterpret_cast<const f16_bits*>(L->o), xs, x, a.d, a.H * a.hd, true);
            break;
        case ST_GATE_UP:
            stage_input(xs, x, nullptr, nullptr, reinterpret_cast<const float*>(L->mlp_norm), a.d, a.eps,
                        L->t_gate_up, red);
            if (L->s_gate_up.values)
                counted = tcbc_stage(L->s_gate_up, xs, reinterpret_cast<float*>(a.acc_gu), area, a.tcbc_stages, wc, trace != nullptr);
            else if (L->b_gate_up.blocks) {
                bcbc = L->b_gate_up;  // run after the switch
                bcbc_y = reinterpret_cast<float*>(a.acc_gu);
            } else
                gate_up_stage(a, L, xs);
            break;
        case ST_DOWN:
            stage_input(xs, reinterpret_cast<const float*>(a.h), nullptr, nullptr, nullptr, a.I, a.eps, L->t_down,
                        red,
                        sparse_product(L->s_gate_up, L->b_gate_up) ? reinterpret_cast<const float*>(a.acc_gu) : nullptr);
            if (a.acc_qkv) zero_share(a.acc_qkv, (a.H + 2 * a.Hkv) * a.hd);
            // The head's atomics need zeroed logits; nothing reads them during the step.
            if ((a.s_head.values || a.b_head.blocks) && si + 1 < a.n_stages && stages[si + 1].x == ST_HEAD)
                zero_share(a.logits, a.vocab);
            if (L->s_down.values)
                counted = tcbc_stage(L->s_down, xs, x, area, a.tcbc_stages, wc, trace != nullptr);
            else if (L->b_down.blocks) {
                bcbc = L->b_down;  // run after the switch
                bcbc_y = x;
            } else
                rows_stage(reinterpret_cast<const f16_bits*>(L->down), xs, x, a.d, a.I, true);
            break;
        case ST_HEAD:
            stage_input(xs, x, nullptr, nullptr, reinterpret_cast<const float*>(a.final_norm), a.d, a.eps, a.t_head,
                        red);
            if (a.s_head.values)
                counted = tcbc_stage(a.s_head, xs, reinterpret_cast<float*>(a.logits), area, a.tcbc_stages, wc, trace != nullptr);
            else if (a.b_head.blocks) {
                bcbc = a.b_head;  // run after the switch
                bcbc_y = reinterpret_cast<float*>(a.logits);
            } else
                rows_stage(reinterpret_cast<const f16_bits*>(a.lm_head), xs, reinterpret_cast<float*>(a.logits),
                           a.vocab, a.d, false);
            break;
        default:
            break;
        }
        if (bcbc.blocks) counted = bcbc_stage(bcbc, xs, bcbc_y, area, trace != nullptr);
        if (trace && threadIdx.x == 0) {
            trace[((size_t)si * gridDim.x + blockIdx.x) * 2 + 1] = global_timer();
            // After the stamps and the positions word: bytes per (stage, block).
            trace[(size_t)a.n_stages * gridDim.x * 2 + 1 + (size_t)si * gridDim.x + blockIdx.x] = counted;
        }
        if (si + 1 < a.n_stages) {
            const f16_bits *ra, *rb;
            int K;
            const int2 next = stages[si + 1];
            if (next.x == ST_ATTENTION) {
                prefetch_attention(a, reinterpret_cast<const PLayer*>(a.layers) + next.y, p + 1);
            } else if (first_rows(a, next, gw, ra, rb, K)) {
                prefetch_rows(ra, rb, K, lane);
            }
            const bool ok = a.flags_at > 0 ? flag_barrier(sync, error, a.watchdog_ns, si, a.flags_at, ++passed)
                                           : grid_barrier(sync, error, a.watchdog_ns, si);
            if (!ok) return;
        }
    }
}
