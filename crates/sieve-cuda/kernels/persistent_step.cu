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
//                      After a Tiled-CBC q|k|v it first does that q|k|v's epilogue itself from
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
//     2. batches of 32 listed columns through 2..8 cp.async stage buffers (4 by default):
//          stage = vals[32][256] f16 | bits[32][8] u32 | rank[32][8] u8    (17,664 bytes)
//        16 threads per column slot, 16-byte chunks part and part + 16
//     3. round-robin decode (tiled_cbc_spmspv.cu, rr): warp w takes slots w and w + 16; lane j
//        owns rows 32 q + j (q = 0..7): value index rank[q] + popc(bits_q below lane j), one
//        conflict-free shared load per word
//     4. the 16 warps' 8 sums per lane reduced in shared memory, one atomicAdd per row
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
// (stage, block): the bytes its Tiled-CBC tasks asked for (0 for the other stages).

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

struct PLayer {
    u64 attn_norm, qkv, qkv_bias, k_cache, v_cache, o, mlp_norm, gate_up, down;
    float t_qkv, t_o, t_gate_up, t_down;
    PTcbc s_qkv, s_o, s_gate_up, s_down;
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
};

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
// With `gu` (a Tiled-CBC gate|up's raw sums, gate rows then up rows) src is ignored and the
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
    const u64 sparse = st.x == ST_QKV || st.x == ST_QKV_EMBED ? L->s_qkv.values
                       : st.x == ST_O                         ? L->s_o.values
                       : st.x == ST_GATE_UP                   ? L->s_gate_up.values
                       : st.x == ST_DOWN                      ? L->s_down.values
                       : st.x == ST_HEAD                      ? a.s_head.values
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

// The same pair from a Tiled-CBC q|k|v's raw sums in acc_qkv.
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
    case 6: cp_async_wait<6>(); break;
    case 5: cp_async_wait<5>(); break;
    case 4: cp_async_wait<4>(); break;
    case 3: cp_async_wait<3>(); break;
    case 2: cp_async_wait<2>(); break;
    case 1: cp_async_wait<1>(); break;
    default: cp_async_wait<0>(); break;
    }
}

// y[256 rt + r] += sum over the active columns k in [k0, k1) of W[256 rt + r][k] * xs[k]
// (header, steps 1-4). `area`: list[512] uint4, then `stages` stage buffers. Returns the
// bytes this thread asked of memory (when `count`), for the trace.
__device__ u32 tcbc_task(const PTcbc& m, const float* xs, float* y, int rt, int k0, int k1, unsigned char* area,
                         int stages, int* wc, bool count) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint4* list = reinterpret_cast<uint4*>(area);
    const u32 sbase = smem_addr(area + PT_MAX_COLS * 16);
    // 1. Compaction: the column's metadata is read only when its input is active.
    const int k = k0 + tid;
    bool on = false;
    uint4 e = make_uint4(0u, 0u, 0u, 0u);
    u32 bytes = 0;
    if (k < k1) {
        const float xv = xs[k];
        if (xv != 0.f) {
            const u32 g = (u32)rt * (u32)m.KT + (u32)(k >> 4);
            const u32 gc = g * 16u + (u32)(k & 15);
            const u32 info = __ldg(reinterpret_cast<const u32*>(m.col_info) + gc);
            const u32 off = __ldg(reinterpret_cast<const u32*>(m.tile_offset) + g);
            on = (info & 0xffffu) != 0;
            e = make_uint4(off + (info >> 16), gc, ((info & 0xffffu) + 7u) >> 3, __float_as_uint(xv));
            bytes = 8u + (on ? e.z * 16u + 40u : 0u);
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
    __syncthreads();

    float acc[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) acc[q] = 0.f;
    if (n > 0) {
        // 2. The pipeline: batch b in stage buffer b % stages, stages - 1 in flight.
        const int nb = (n + PT_BATCH - 1) / PT_BATCH;
        const int slot = tid >> 4, part = tid & 15;
        auto load = [&](int b) {
            const int i = b * PT_BATCH + slot;
            const bool have = b < nb && i < n;
            pt_stage_column(have, have ? list[i] : make_uint4(0u, 0u, 0u, 0u), m,
                            sbase + (u32)(b % stages) * PT_STAGE_BYTES, slot, part);
        };
        for (int b = 0; b < stages - 1; ++b) load(b);
        const u32 lane_below = (1u << lane) - 1u;
        for (int b = 0; b < nb; ++b) {
            pt_wait_all_but(stages - 2);  // batch b has landed (this thread's copies)
            __syncthreads();              // ... everyone's; batch b - 1 is consumed
            load(b + stages - 1);
            const u32 cur = sbase + (u32)(b % stages) * PT_STAGE_BYTES;
            const int cnt = min(PT_BATCH, n - b * PT_BATCH);
            // 3. Round-robin decode of slots warp and warp + 16.
#pragma unroll
            for (int u = 0; u < PT_BATCH / PS_WARPS; ++u) {
                const int sl = warp + u * PS_WARPS;
                if (sl < cnt) {
                    const float xk = __uint_as_float(list[b * PT_BATCH + sl].w);
                    const uint4 wa = lds_u32x4(cur + PT_BITS_OFF + (u32)sl * 32u);
                    const uint4 wb = lds_u32x4(cur + PT_BITS_OFF + (u32)sl * 32u + 16u);
                    const uint2 rk = lds_u32x2(cur + PT_RANK_OFF + (u32)sl * 8u);
                    const u32 words[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
                    const u32 vbase = cur + (u32)sl * 512u;
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        if ((words[q] >> lane) & 1u) {
                            const u32 r = ((q < 4 ? rk.x : rk.y) >> (8 * (q & 3))) & 0xffu;
                            const u32 bits = lds_u16(vbase + 2u * (r + __popc(words[q] & lane_below)));
                            acc[q] = fmaf(h2f((unsigned short)bits), xk, acc[q]);
                        }
                    }
                }
            }
        }
        cp_async_wait<0>();
    }
    __syncthreads();  // the stage buffers are free: the warps' sums go there
    // 4. Reduction over the 16 warps, one atomic per row.
    float* red = reinterpret_cast<float*>(area + PT_MAX_COLS * 16);
    if (n > 0) {
#pragma unroll
        for (int q = 0; q < 8; ++q) red[warp * 256 + 32 * q + lane] = acc[q];
    }
    __syncthreads();
    if (n > 0 && tid < 256) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < PS_WARPS; ++w) sum += red[w * 256 + tid];
        const int row = rt * 256 + tid;
        if (row < m.M && sum != 0.f) atomicAdd(y + row, sum);
    }
    __syncthreads();  // list, counts and sums are rewritten by the next task
    return count ? bytes : 0u;
}

// y += W . xs over all tasks of the product, dealt round robin; the block's bytes (thread 0's
// return value, when `count`).
// `m` by value: its fields stay in registers across the tasks' atomics.
__device__ u64 tcbc_stage(const PTcbc m, const float* xs, float* y, unsigned char* area, int stages, int* wc,
                          bool count) {
    const int row_tiles = (m.M + 255) / 256, chunks = (m.K + m.cols_per_task - 1) / m.cols_per_task;
    u32 mine = 0;
    for (int task = blockIdx.x; task < row_tiles * chunks; task += gridDim.x) {
        const int rt = task % row_tiles, k0 = (task / row_tiles) * m.cols_per_task;
        mine += tcbc_task(m, xs, y, rt, k0, min(k0 + m.cols_per_task, m.K), area, stages, wc, count);
    }
    if (!count) return 0;
    __shared__ unsigned long long s_bytes;
    if (threadIdx.x == 0) s_bytes = 0;
    __syncthreads();
    const u32 w = __reduce_add_sync(FULL_MASK, mine);
    if ((threadIdx.x & 31) == 0) atomicAdd(&s_bytes, (unsigned long long)w);
    __syncthreads();
    return s_bytes;
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
    // A Tiled-CBC q|k|v left raw sums (acc_qkv): the task rotates its own q, and the split
    // holding the new position p = len - 1 takes that position's k and v rows from acc_qkv too,
    // rounded to f16 as the cache stores them, into shared memory (newk, newv); the first query
    // head of each KV head writes them to the cache for the steps after this one. So no block
    // reads cache row p in this stage, and no stage of its own is needed for RoPE.
    const bool raw = L->s_qkv.values != 0;
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
    unsigned char* area = reinterpret_cast<unsigned char*>(smem) + a.tcbc_at;  // Tiled-CBC tasks
    // The new position's k and v rows of a Tiled-CBC q|k|v's attention (only such models have
    // the area; no Tiled-CBC task runs in an attention stage).
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
        u64 counted = 0;  // bytes the block's Tiled-CBC tasks asked for (traced steps)
        switch (st.x) {
        case ST_QKV:
        case ST_QKV_EMBED: {
            const f16_bits* emb =
                st.x == ST_QKV_EMBED ? reinterpret_cast<const f16_bits*>(a.embed) + (size_t)tok * a.d : nullptr;
            stage_input(xs, x, emb, x, reinterpret_cast<const float*>(L->attn_norm), a.d, a.eps, L->t_qkv, red);
            if (L->s_qkv.values)
                counted = tcbc_stage(L->s_qkv, xs, reinterpret_cast<float*>(a.acc_qkv), area, a.tcbc_stages, wc, trace != nullptr);
            else
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
            else
                rows_stage(reinterpret_cast<const f16_bits*>(L->o), xs, x, a.d, a.H * a.hd, true);
            break;
        case ST_GATE_UP:
            stage_input(xs, x, nullptr, nullptr, reinterpret_cast<const float*>(L->mlp_norm), a.d, a.eps,
                        L->t_gate_up, red);
            if (L->s_gate_up.values)
                counted = tcbc_stage(L->s_gate_up, xs, reinterpret_cast<float*>(a.acc_gu), area, a.tcbc_stages, wc, trace != nullptr);
            else
                gate_up_stage(a, L, xs);
            break;
        case ST_DOWN:
            stage_input(xs, reinterpret_cast<const float*>(a.h), nullptr, nullptr, nullptr, a.I, a.eps, L->t_down,
                        red, L->s_gate_up.values ? reinterpret_cast<const float*>(a.acc_gu) : nullptr);
            if (a.acc_qkv) zero_share(a.acc_qkv, (a.H + 2 * a.Hkv) * a.hd);
            // The head's atomics need zeroed logits; nothing reads them during the step.
            if (a.s_head.values && si + 1 < a.n_stages && stages[si + 1].x == ST_HEAD)
                zero_share(a.logits, a.vocab);
            if (L->s_down.values)
                counted = tcbc_stage(L->s_down, xs, x, area, a.tcbc_stages, wc, trace != nullptr);
            else
                rows_stage(reinterpret_cast<const f16_bits*>(L->down), xs, x, a.d, a.I, true);
            break;
        case ST_HEAD:
            stage_input(xs, x, nullptr, nullptr, reinterpret_cast<const float*>(a.final_norm), a.d, a.eps, a.t_head,
                        red);
            if (a.s_head.values)
                counted = tcbc_stage(a.s_head, xs, reinterpret_cast<float*>(a.logits), area, a.tcbc_stages, wc, trace != nullptr);
            else
                rows_stage(reinterpret_cast<const f16_bits*>(a.lm_head), xs, reinterpret_cast<float*>(a.logits),
                           a.vocab, a.d, false);
            break;
        default:
            break;
        }
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
