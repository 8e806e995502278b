// Kernels of the batched prefill (sieve-gpu's src/prefill.rs and GpuModel::prefill_chunk): n
// prompt tokens at positions p0 .. p0+n-1.
//
//   x    [n][d]  f32 residual stream        a16 [n][K] f16 GEMM input (masked by the threshold)
//   qkv  [n][(H + 2 Hkv) hd] f32            gu  [n][2I] f32 (gate | up)
//
// rmsnorm_rows: block per row, out = x / rms(x) * w (f32).
// rows_to_f16:  grid-stride over n x K, out[i][j] = f16(mask_t(x[i * ldx + j])), the GEMM input
//               of one product under its threshold.
// silu_rows:    gate = silu(gate) * up in place.
// zero_rows:    y[i][j] = 0 for n rows of M floats, ldy apart (before a split-K product that
//               adds its parts atomically: the Tiled-CBC and SlideSparse SpMMs).
// RoPE with the cache write is rope.cu's rope_rows; the causal attention reuses attention.cu's
// kernels with one query per blockIdx.z.

__device__ __forceinline__ float masked(float v, float t) { return fabsf(v) > t ? v : 0.f; }

extern "C" __global__ void __launch_bounds__(256)
rmsnorm_rows(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int d, float eps) {
    pdl_wait_then_release();
    __shared__ float red[8];
    const float* row = x + (size_t)blockIdx.x * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += 256) ss += row[i] * row[i];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) total += red[i];
    float scale = 1.f / sqrtf(total / (float)d + eps);
    float* o = out + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += 256) o[i] = row[i] * scale * w[i];
}

extern "C" __global__ void __launch_bounds__(256)
rows_to_f16(const float* __restrict__ x, int ldx, f16_bits* __restrict__ out, int n, int K, float t) {
    pdl_wait_then_release();
    size_t total = (size_t)n * K;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / K, c = i % K;
        out[i] = f2h(masked(x[r * ldx + c], t));
    }
}

// gate <- silu(gate) * up, in place in the gate half of each row of gu.
extern "C" __global__ void __launch_bounds__(256)
silu_rows(float* __restrict__ gu, int n, int I) {
    pdl_wait_then_release();
    size_t total = (size_t)n * I;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / I, c = i % I;
        float g = gu[r * 2 * I + c], u = gu[r * 2 * I + I + c];
        gu[r * 2 * I + c] = g / (1.f + __expf(-g)) * u;
    }
}

// x[i][j] = embedding[tokens[i]][j].
extern "C" __global__ void __launch_bounds__(256)
embed_rows(const f16_bits* __restrict__ emb, const int* __restrict__ tokens, float* __restrict__ x, int n, int d) {
    pdl_wait_then_release();
    size_t total = (size_t)n * d;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / d, c = i % d;
        x[i] = h2f(emb[(size_t)tokens[r] * d + c]);
    }
}

extern "C" __global__ void __launch_bounds__(256)
zero_rows(float* __restrict__ y, int ldy, int n, int M) {
    pdl_wait_then_release();
    const size_t total = (size_t)n * M;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        y[(i / M) * (size_t)ldy + i % M] = 0.f;
}
