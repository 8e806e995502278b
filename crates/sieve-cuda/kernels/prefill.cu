// Kernels of the batched prefill (sieve-gpu's src/prefill.rs and GpuModel::prefill_chunk): n
// prompt tokens at positions p0 .. p0+n-1.
//
//   x    [n][d]  f32 residual stream        a16 [n][K] f16 GEMM input (masked by the threshold)
//   qkv  [n][(H + 2 Hkv) hd] f32            gu  [n][2I] f32 (gate | up)
//
// rmsnorm_rows: block per row, out = x / rms(x) * w (f32), 16-byte loads and stores where the
//               width and the pointers allow.
// The element-wise kernels run on grid (ceil(cols / 1024), min(rows, 65535)) of 256 threads:
// thread j of block (bx, by) takes columns c = 4 (256 bx + j) .. c + 3 of rows by, by + gridDim.y,
// ..., with 16-byte (8-byte for f16)
// accesses where the row's start and width allow and one column at a time otherwise. (Their
// first form was a grid-stride loop over rows x cols that paid a 64-bit division and modulo per
// element, for one or two memory accesses. c + 4 stays below 2^31: the launchers take widths
// of at most 2^31 - 8.)
//   rows_to_f16: out[i][j] = f16(mask_t(x[i * ldx + j])), the GEMM input of one product under
//                its threshold.
//   silu_rows:   gate = silu(gate) * up in place.
//   embed_rows:  x[i] = embedding[tokens[i]].
//   zero_rows:   y[i][j] = 0 for rows of M floats, ldy apart (before a split-K product that
//                adds its parts atomically: the Tiled-CBC and SlideSparse SpMMs).
// RoPE with the cache write is rope.cu's rope_rows; the causal attention reuses attention.cu's
// kernels with one query per blockIdx.z.

__device__ __forceinline__ float masked(float v, float t) { return fabsf(v) > t ? v : 0.f; }

__device__ __forceinline__ bool aligned_to(const void* p, size_t bytes) {
    return (reinterpret_cast<size_t>(p) & (bytes - 1)) == 0;
}

// The first of this thread's 4 columns (element-wise kernels).
__device__ __forceinline__ int row_col0() { return (int)(blockIdx.x * blockDim.x + threadIdx.x) * 4; }

extern "C" __global__ void __launch_bounds__(256)
rmsnorm_rows(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int d, float eps,
             const char* __restrict__ pf, u64 pf_bytes) {
    prefetch_span_l2(pf, pf_bytes);  // the next product's weights (null: none), as step.cu's rmsnorm_zero
    pdl_wait_then_release();
    __shared__ float red[8];
    const float* row = x + (size_t)blockIdx.x * d;
    float* o = out + (size_t)blockIdx.x * d;
    const bool vec = (d & 3) == 0 && aligned_to(row, 16) && aligned_to(w, 16) && aligned_to(o, 16);
    float ss = 0.f;
    if (vec) {
        for (int i = threadIdx.x * 4; i < d; i += 1024) {
            const float4 v = *reinterpret_cast<const float4*>(row + i);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < d; i += 256) ss += row[i] * row[i];
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) total += red[i];
    const float scale = 1.f / sqrtf(total / (float)d + eps);
    if (vec) {
        for (int i = threadIdx.x * 4; i < d; i += 1024) {
            const float4 v = *reinterpret_cast<const float4*>(row + i);
            const float4 g = *reinterpret_cast<const float4*>(w + i);
            *reinterpret_cast<float4*>(o + i) =
                make_float4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z, v.w * scale * g.w);
        }
    } else {
        for (int i = threadIdx.x; i < d; i += 256) o[i] = row[i] * scale * w[i];
    }
}

extern "C" __global__ void __launch_bounds__(256)
rows_to_f16(const float* __restrict__ x, int ldx, f16_bits* __restrict__ out, int n, int K, float t) {
    pdl_wait_then_release();
    const int c = row_col0();
    if (c >= K) return;
    for (int r = blockIdx.y; r < n; r += gridDim.y) {
        const float* row = x + (size_t)r * ldx;
        f16_bits* o = out + (size_t)r * K;
        if (c + 4 <= K && aligned_to(row + c, 16) && aligned_to(o + c, 8)) {
            const float4 v = *reinterpret_cast<const float4*>(row + c);
            const u32 lo = (u32)f2h(masked(v.x, t)) | ((u32)f2h(masked(v.y, t)) << 16);
            const u32 hi = (u32)f2h(masked(v.z, t)) | ((u32)f2h(masked(v.w, t)) << 16);
            *reinterpret_cast<uint2*>(o + c) = make_uint2(lo, hi);
        } else {
            for (int j = c; j < min(c + 4, K); ++j) o[j] = f2h(masked(row[j], t));
        }
    }
}

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.f + __expf(-g)) * u; }

// gate <- silu(gate) * up, in place in the gate half of each row of gu.
extern "C" __global__ void __launch_bounds__(256)
silu_rows(float* __restrict__ gu, int n, int I, const char* __restrict__ pf, u64 pf_bytes) {
    prefetch_span_l2(pf, pf_bytes);
    pdl_wait_then_release();
    const int c = row_col0();
    if (c >= I) return;
    for (int r = blockIdx.y; r < n; r += gridDim.y) {
        float* g = gu + (size_t)r * 2 * I;
        const float* u = g + I;
        if (c + 4 <= I && aligned_to(g + c, 16) && aligned_to(u + c, 16)) {
            const float4 a = *reinterpret_cast<const float4*>(g + c);
            const float4 b = *reinterpret_cast<const float4*>(u + c);
            *reinterpret_cast<float4*>(g + c) = make_float4(silu_times(a.x, b.x), silu_times(a.y, b.y),
                                                            silu_times(a.z, b.z), silu_times(a.w, b.w));
        } else {
            for (int j = c; j < min(c + 4, I); ++j) g[j] = silu_times(g[j], u[j]);
        }
    }
}

// x[i][j] = embedding[tokens[i]][j].
extern "C" __global__ void __launch_bounds__(256)
embed_rows(const f16_bits* __restrict__ emb, const int* __restrict__ tokens, float* __restrict__ x, int n, int d) {
    pdl_wait_then_release();
    const int c = row_col0();
    if (c >= d) return;
    for (int r = blockIdx.y; r < n; r += gridDim.y) {
        const f16_bits* e = emb + (size_t)tokens[r] * d;
        float* o = x + (size_t)r * d;
        if (c + 4 <= d && aligned_to(e + c, 8) && aligned_to(o + c, 16)) {
            const uint2 v = *reinterpret_cast<const uint2*>(e + c);
            float a, b, cc, dd;
            unpack2(v.x, a, b);
            unpack2(v.y, cc, dd);
            *reinterpret_cast<float4*>(o + c) = make_float4(a, b, cc, dd);
        } else {
            for (int j = c; j < min(c + 4, d); ++j) o[j] = h2f(e[j]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
zero_rows(float* __restrict__ y, int ldy, int n, int M) {
    pdl_wait_then_release();
    const int c = row_col0();
    if (c >= M) return;
    for (int r = blockIdx.y; r < n; r += gridDim.y) {
        float* row = y + (size_t)r * ldy;
        if (c + 4 <= M && aligned_to(row + c, 16)) {
            *reinterpret_cast<float4*>(row + c) = make_float4(0.f, 0.f, 0.f, 0.f);
        } else {
            for (int j = c; j < min(c + 4, M); ++j) row[j] = 0.f;
        }
    }
}
