// The decode step's kernels besides the weight products, RoPE (rope.cu) and attention
// (attention.cu): embedding gather, RMSNorm, SwiGLU, the teacher-forced advance.
//
// One token per step. Buffers (f32 unless noted; d = hidden, H/Hkv heads, hd head dim,
// I = intermediate, C = context):
//
//   state   i32 [0] = position p of this step's token, [1] = its token id (device memory, so a
//           captured CUDA graph replays for every token: nothing here is a launch argument)
//   x  [d]  residual stream        xn [d]  RMSNorm(x) * w, input of the next products
//   qkv     [ q: H*hd | k: Hkv*hd | v: Hkv*hd ]   output of the fused q|k|v product
//   gu      [ gate: I | up: I ]    h [I] = silu(gate) * up
//   k_cache, v_cache  f16 [C][Hkv*hd] of one layer (the runner passes the layer's base)
//   rope_cos, rope_sin [C][hd/2]  tables computed on the host in f64 (the CPU path's angles)
//
// rmsnorm_zero: NB blocks x 256 threads. Every block sums x^2 over all of d (d floats from L2:
// cheaper than a second launch or a grid-wide barrier), writes its own d/NB slice of xn, and
// zeroes its slice of `zero`, the buffer the next product accumulates into (the products add
// into their output, see GpuAccumulate in src/product.rs), so zeroing costs no launch of its own.
//
// rmsnorm_zero and silu_mul (and rope_kv, rope.cu) take the span of the next product's weights
// (pf, pf_bytes; null for none) and ask L2 for it before they wait for their predecessor: the
// step's DRAM is idle while these small kernels run (prefetch_span_l2 in common.cuh).

extern "C" __global__ void __launch_bounds__(256)
embed_token(const f16_bits* __restrict__ emb, const int* __restrict__ state, float* __restrict__ x,
            int d, int vocab) {
    pdl_wait_then_release();
    int tok = state[1];
    // The host checks every id it writes; a bad one here would be a runner bug. Stay in bounds.
    if (tok < 0 || tok >= vocab) tok = 0;
    const f16_bits* row = emb + (size_t)tok * d;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x) x[i] = h2f(row[i]);
}

extern "C" __global__ void __launch_bounds__(256)
rmsnorm_zero(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int d,
             float eps, float* __restrict__ zero, int zero_len, const char* __restrict__ pf, u64 pf_bytes) {
    prefetch_span_l2(pf, pf_bytes);
    pdl_wait_then_release();
    __shared__ float red[8];
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += 256) {
        float v = x[i];
        ss += v * v;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) total += red[i];
    float scale = 1.f / sqrtf(total / (float)d + eps);
    int per = (d + gridDim.x - 1) / gridDim.x;
    int b = blockIdx.x * per, e = min(b + per, d);
    for (int i = b + threadIdx.x; i < e; i += 256) out[i] = x[i] * scale * w[i];
    if (zero) {
        int zper = (zero_len + gridDim.x - 1) / gridDim.x;
        int zb = blockIdx.x * zper, ze = min(zb + zper, zero_len);
        for (int i = zb + threadIdx.x; i < ze; i += 256) zero[i] = 0.f;
    }
}

// h = silu(gate) * up, gate and up the two halves of gu.
extern "C" __global__ void __launch_bounds__(256)
silu_mul(const float* __restrict__ gu, float* __restrict__ h, int I, const char* __restrict__ pf, u64 pf_bytes) {
    prefetch_span_l2(pf, pf_bytes);
    pdl_wait_then_release();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < I) {
        float g = gu[i];
        h[i] = g / (1.f + __expf(-g)) * gu[I + i];
    }
}

// Teacher forcing (prompt tokens, perplexity): the next token is the known one in history.
extern "C" __global__ void advance_forced(int* __restrict__ state, const int* __restrict__ history, int capacity) {
    pdl_wait_then_release();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        int p = state[0] + 1;
        if (p < capacity) {
            state[0] = p;
            state[1] = history[p];
        }
    }
}
