// RoPE with the KV-cache write, the one rotation of both paths: rope_kv for the decode step's
// token, rope_rows for the n tokens of a batched prefill. Both call rope_head (f16 cache) or
// rope_head_i8 (8-bit cache: the _i8 kernels), which share the rotation (rotated_pair).
//
// Buffers (f32 unless noted; H/Hkv heads, hd head dim, C = context):
//
//   qkv     [ q: H*hd | k: Hkv*hd | v: Hkv*hd ]   one token's output of the fused q|k|v product
//           (prefill: n such rows, (H + 2 Hkv) hd apart)
//   bias    the q|k|v bias (Qwen2), same layout as one qkv row, or null
//   k_cache, v_cache  f16 [C][Hkv][hd] of one layer (the runner passes the layer's base), or
//           i8 [C][Hkv][hd] with k_scales, v_scales f32 [C][Hkv]: one scale per (position, KV
//           head) row, the rule of sieve_formats::kv_cache::quantize_row
//   rope_cos, rope_sin [C][hd/2]  tables computed on the host in f64 (the CPU path's angles)
//   state   i32 [0] = position p of the decode step's token (device memory, so a captured CUDA
//           graph replays for every token)
//
// rope_head: block per q or k head (q heads then k heads are contiguous in qkv, so head j's
// row starts at j*hd either way), thread i rotates the pair (i, i + hd/2) (rotate-half
// convention); biases are added first. q heads are written back in place; k heads go to the
// cache row of position p as f16, and their blocks also copy their v head (bias added) there.
//
// rope_head_i8: the same blocks with one pair per thread (hd <= 2 * 128, checked by the
// launcher), so a k head's block holds its whole k row and v row in registers:
//
//      thread i:  k pair (i, i + hd/2) rotated, v pair (i, i + hd/2)      i < hd/2
//      max|x| of each row: |x| as its bit pattern (sign cleared), an unsigned max over the
//      warp (shuffles) then over the 4 warps (shared memory); exact under FTZ, and a NaN
//      (bits above +inf's) wins the max and marks its row
//      scale = max|x| / 127 and q = rint(x / scale) by IEEE division (__fdiv_rn: the kernels
//      compile with --use_fast_math, whose `/` is approximate), clamped to [-127, 127];
//      thread 0 writes the two scales of the (position, KV head) cell.
//
// So q and scale equal the CPU's bit for bit for the same x, except for rows whose largest
// magnitude is below 127 * 2^-126 (~1.5e-36): FTZ flushes their subnormal scale and the GPU
// stores them as zero rows (scale 0, q 0) where the CPU keeps subnormal scales.
//
// rope_kv:   grid H + Hkv, position state[0].
// rope_rows: row y of qkv at position p0 + y (a prompt chunk); or, with
//            seqs, row y is the next token of its own sequence: position seqs[2y], cache slot
//            seqs[2y + 1] (the slot's rows start slot * slot_stride values past the layer's
//            base, its scales slot * slot_stride / hd), so a decode step of many sequences is
//            one launch. A negative slot marks a padding row (a captured step's batch rounded
//            up): its q is rotated, nothing is written to any cache.
//            Its grid (f16 cache) is drawn above the kernel.
// rope_kv_i8, rope_rows_i8: the same over the 8-bit cache (grid (H + Hkv, n) for rope_rows_i8:
// a k head's block reduces its row's largest |x|).

#define ROPE_THREADS 128

// Pair i of the q or k head whose row is `row` rotated by the angle table rows c, s (biases
// `brow`, when non-null, added first).
__device__ __forceinline__ float2 rotated_pair(const float* __restrict__ row, const float* __restrict__ brow,
                                               const float* __restrict__ c, const float* __restrict__ s, int i,
                                               int half) {
    float a = row[i], b = row[i + half];
    if (brow) {
        a += brow[i];
        b += brow[i + half];
    }
    return make_float2(a * c[i] - b * s[i], b * c[i] + a * s[i]);
}

// Pair i of KV head kh's v row (bias added), which its k head's block writes to the cache.
__device__ __forceinline__ float2 value_pair(const float* __restrict__ qkv, const float* __restrict__ bias,
                                             int H, int Hkv, int hd, int kh, int i) {
    const int half = hd / 2;
    const size_t voff = (size_t)(H + Hkv) * hd + (size_t)kh * hd;
    float va = qkv[voff + i], vb = qkv[voff + i + half];
    if (bias) {
        va += bias[voff + i];
        vb += bias[voff + i + half];
    }
    return make_float2(va, vb);
}

__device__ __forceinline__ void rope_head(float* __restrict__ qkv, const float* __restrict__ bias,
                                          const float* __restrict__ rope_cos,
                                          const float* __restrict__ rope_sin, int p, int head,
                                          f16_bits* __restrict__ k_cache,
                                          f16_bits* __restrict__ v_cache, int H, int Hkv, int hd) {
    int half = hd / 2;
    const float* c = rope_cos + (size_t)p * half;
    const float* s = rope_sin + (size_t)p * half;
    float* row = qkv + (size_t)head * hd;
    const float* brow = bias ? bias + (size_t)head * hd : nullptr;
    size_t kv_row = (size_t)Hkv * hd;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float2 r = rotated_pair(row, brow, c, s, i, half);
        if (head < H) {
            row[i] = r.x;
            row[i + half] = r.y;
        } else {
            int kh = head - H;
            f16_bits* kdst = k_cache + (size_t)p * kv_row + (size_t)kh * hd;
            kdst[i] = f2h(r.x);
            kdst[i + half] = f2h(r.y);
            const float2 v = value_pair(qkv, bias, H, Hkv, hd, kh, i);
            f16_bits* vdst = v_cache + (size_t)p * kv_row + (size_t)kh * hd;
            vdst[i] = f2h(v.x);
            vdst[i + half] = f2h(v.y);
        }
    }
}

// |x| as an unsigned integer that orders as |x| does (NaN above +inf).
__device__ __forceinline__ u32 abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

__device__ __forceinline__ u32 umax32(u32 a, u32 b) { return a > b ? a : b; }

// The largest of a and of b over the block (every thread gets both). Called once per block.
__device__ __forceinline__ void block_max2(u32& a, u32& b) {
    __shared__ u32 s_max[2][ROPE_THREADS / 32];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        a = umax32(a, __shfl_xor_sync(FULL_MASK, a, d));
        b = umax32(b, __shfl_xor_sync(FULL_MASK, b, d));
    }
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        s_max[0][warp] = a;
        s_max[1][warp] = b;
    }
    __syncthreads();
    a = s_max[0][0];
    b = s_max[1][0];
    for (int w = 1; w < warps; ++w) {
        a = umax32(a, s_max[0][w]);
        b = umax32(b, s_max[1][w]);
    }
}

// A row's scale from its largest |x| bits: NaN for a row holding NaN, 0 for a zero row,
// else max|x| / 127 (IEEE division; FTZ makes a subnormal result 0: a zero row).
__device__ __forceinline__ float kv_row_scale(u32 amax_bits) {
    if (amax_bits > 0x7f800000u) return __uint_as_float(0x7fc00000u);
    if (amax_bits == 0u) return 0.f;
    return __fdiv_rn(__uint_as_float(amax_bits), 127.f);
}

// One value on its row's grid: clamp(rint(x / scale), -127, 127); 0 for a zero or NaN row and
// for inf / inf (an infinite row), as Rust's saturating `as i8` stores NaN.
__device__ __forceinline__ signed char kv_quantize(float x, float scale) {
    const u32 sb = __float_as_uint(scale);
    if (sb == 0u || sb > 0x7f800000u) return 0;
    const float r = rintf(__fdiv_rn(x, scale));
    if (abs_bits(r) > 0x7f800000u) return 0;
    return (signed char)(int)fminf(fmaxf(r, -127.f), 127.f);
}

__device__ __forceinline__ void rope_head_i8(float* __restrict__ qkv, const float* __restrict__ bias,
                                             const float* __restrict__ rope_cos,
                                             const float* __restrict__ rope_sin, int p, int head,
                                             signed char* __restrict__ k_cache,
                                             signed char* __restrict__ v_cache, float* __restrict__ k_scales,
                                             float* __restrict__ v_scales, int H, int Hkv, int hd) {
    const int half = hd / 2;
    const float* c = rope_cos + (size_t)p * half;
    const float* s = rope_sin + (size_t)p * half;
    float* row = qkv + (size_t)head * hd;
    const float* brow = bias ? bias + (size_t)head * hd : nullptr;
    const int i = threadIdx.x;
    const bool has_pair = i < half;
    if (head < H) {  // uniform over the block: q heads return before the block's barrier
        if (has_pair) {
            const float2 r = rotated_pair(row, brow, c, s, i, half);
            row[i] = r.x;
            row[i + half] = r.y;
        }
        return;
    }
    const int kh = head - H;
    const float2 k = has_pair ? rotated_pair(row, brow, c, s, i, half) : make_float2(0.f, 0.f);
    const float2 v = has_pair ? value_pair(qkv, bias, H, Hkv, hd, kh, i) : make_float2(0.f, 0.f);
    u32 kmax = umax32(abs_bits(k.x), abs_bits(k.y));
    u32 vmax = umax32(abs_bits(v.x), abs_bits(v.y));
    block_max2(kmax, vmax);
    const float ks = kv_row_scale(kmax), vs = kv_row_scale(vmax);
    const size_t cell = (size_t)p * Hkv + kh;  // the (position, KV head) row
    if (has_pair) {
        signed char* kdst = k_cache + cell * hd;
        kdst[i] = kv_quantize(k.x, ks);
        kdst[i + half] = kv_quantize(k.y, ks);
        signed char* vdst = v_cache + cell * hd;
        vdst[i] = kv_quantize(v.x, vs);
        vdst[i + half] = kv_quantize(v.y, vs);
    }
    if (threadIdx.x == 0) {
        k_scales[cell] = ks;
        v_scales[cell] = vs;
    }
}

extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope_kv(float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ rope_cos,
        const float* __restrict__ rope_sin, const int* __restrict__ state, f16_bits* __restrict__ k_cache,
        f16_bits* __restrict__ v_cache, int H, int Hkv, int hd, const char* __restrict__ pf, u64 pf_bytes) {
    prefetch_span_l2(pf, pf_bytes);  // the o product's weights (step.cu)
    pdl_wait_then_release();
    if ((int)blockIdx.x >= H + Hkv) return;  // blocks added to spread the prefetch
    rope_head(qkv, bias, rope_cos, rope_sin, state[0], blockIdx.x, k_cache, v_cache, H, Hkv, hd);
}

// Row blockIdx.y's position and cache offset (elements past the layer's base): position p0 + y
// of a prompt chunk (seqs null), or its sequence's next position and slot. False for a padding
// row's KV-head blocks (slot -(s + 1) < 0), which write no cache.
__device__ __forceinline__ bool rope_row_target(int p0, const int* __restrict__ seqs, long long slot_stride,
                                                int H, int* p, size_t* slot) {
    const int y = blockIdx.y;
    *p = p0 + y;
    *slot = 0;
    if (seqs) {
        *p = seqs[2 * y];
        const int s = seqs[2 * y + 1];
        if (s < 0 && (int)blockIdx.x >= H) return false;
        *slot = (size_t)max(s, 0) * (size_t)slot_stride;
    }
    return true;
}

// rope_rows over the f16 cache: grid (ceil((H + Hkv) hd/2 / ROPE_ROW_THREADS), n); thread t of
// block bx takes pair j = ROPE_ROW_THREADS bx + t of the row's (H + Hkv) hd/2 rotate-half pairs
// (head j / (hd/2), pair j % (hd/2)), so that every block is full whatever hd. (A block per head
// left half of its 128 threads idle at hd 128, and made (H + Hkv) n blocks of one head's work:
// 8192 blocks for a 128-token prompt of a 7B model.)
#define ROPE_ROW_THREADS 256
extern "C" __global__ void __launch_bounds__(ROPE_ROW_THREADS)
rope_rows(float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ rope_cos,
          const float* __restrict__ rope_sin, int p0, const int* __restrict__ seqs, long long slot_stride,
          f16_bits* __restrict__ k_cache, f16_bits* __restrict__ v_cache, int H, int Hkv, int hd,
          const char* __restrict__ pf, u64 pf_bytes) {
    prefetch_span_l2(pf, pf_bytes);
    pdl_wait_then_release();
    const int half = hd / 2;
    const int j = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= (H + Hkv) * half) return;
    const int head = j / half, i = j % half;
    const int y = blockIdx.y;
    int p = p0 + y;
    size_t slot = 0;
    if (seqs) {
        p = seqs[2 * y];
        const int sl = seqs[2 * y + 1];
        if (sl < 0 && head >= H) return;  // a padding row writes no cache
        slot = (size_t)max(sl, 0) * (size_t)slot_stride;
    }
    float* qkv_row = qkv + (size_t)y * (size_t)(H + 2 * Hkv) * hd;
    float* row = qkv_row + (size_t)head * hd;
    const float* brow = bias ? bias + (size_t)head * hd : nullptr;
    const float2 r = rotated_pair(row, brow, rope_cos + (size_t)p * half, rope_sin + (size_t)p * half, i, half);
    if (head < H) {
        row[i] = r.x;
        row[i + half] = r.y;
        return;
    }
    const int kh = head - H;
    const size_t cell = slot + (size_t)p * Hkv * hd + (size_t)kh * hd;
    k_cache[cell + i] = f2h(r.x);
    k_cache[cell + i + half] = f2h(r.y);
    const float2 v = value_pair(qkv_row, bias, H, Hkv, hd, kh, i);
    v_cache[cell + i] = f2h(v.x);
    v_cache[cell + i + half] = f2h(v.y);
}

extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope_kv_i8(float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ rope_cos,
           const float* __restrict__ rope_sin, const int* __restrict__ state, signed char* __restrict__ k_cache,
           signed char* __restrict__ v_cache, float* __restrict__ k_scales, float* __restrict__ v_scales, int H,
           int Hkv, int hd, const char* __restrict__ pf, u64 pf_bytes) {
    prefetch_span_l2(pf, pf_bytes);
    pdl_wait_then_release();
    if ((int)blockIdx.x >= H + Hkv) return;  // blocks added to spread the prefetch
    rope_head_i8(qkv, bias, rope_cos, rope_sin, state[0], blockIdx.x, k_cache, v_cache, k_scales, v_scales, H,
                 Hkv, hd);
}

extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope_rows_i8(float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ rope_cos,
             const float* __restrict__ rope_sin, int p0, const int* __restrict__ seqs, long long slot_stride,
             signed char* __restrict__ k_cache, signed char* __restrict__ v_cache, float* __restrict__ k_scales,
             float* __restrict__ v_scales, int H, int Hkv, int hd, const char* __restrict__ pf, u64 pf_bytes) {
    prefetch_span_l2(pf, pf_bytes);
    pdl_wait_then_release();
    const size_t qkv_row = (size_t)(H + 2 * Hkv) * hd;
    const int y = blockIdx.y;
    int p;
    size_t slot;
    if (!rope_row_target(p0, seqs, slot_stride, H, &p, &slot)) return;
    const size_t scale_slot = slot / hd;  // the scales hold one entry per hd values
    rope_head_i8(qkv + y * qkv_row, bias, rope_cos, rope_sin, p, blockIdx.x, k_cache + slot, v_cache + slot,
                 k_scales + scale_slot, v_scales + scale_slot, H, Hkv, hd);
}
