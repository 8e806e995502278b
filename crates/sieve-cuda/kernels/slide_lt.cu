// SlideSparse through cuSPARSELt (src/slide_lt.rs; the library wrapper is src/cusparselt.rs):
// the two small kernels around the library's 2:4 product, for f16, INT8 and FP8 (e4m3) values.
//
//   lt_lift_{f16,i8,e4m3}: X (n rows of K f32, row stride ldx) -> X' (np rows of Kp elements,
//       row-major, K' contiguous: the "B" operand cuSPARSELt reads as a K' x N column-major
//       matrix), X'[t][k'] = q(mask_t(X[t][map[k']])), 0 where map[k'] = LT_PAD or t >= n.
//       One block of 256 threads per row t of X' (rows n .. np are the plan's padding: zeros).
//       The 8-bit kernels first reduce max |mask_t(X[t])| over the K original columns (the
//       lifting copies values, so the lifted row has the same maximum), then write the codes of
//       s_t = max / 127 (INT8, rne(x / s), clamped to +-127) or max / 448 (e4m3, cvt.rn.satfinite:
//       round to nearest even, saturating), bit for bit sieve_formats::eight_bit::{int8_row,
//       e4m3_row}; s_t goes to xscale[t]. A dense product of the same precision uses the same
//       kernels with the identity map.
//
//   lt_scale_{i32,f32,f16}: the library's raw accumulators D (np rows of Mp, row-major: its
//       M x N column-major output) -> Y (n rows of M f32, row stride ldy):
//       Y[t][r] (+)= D[t][r] * post * ws[r] * xs[t] (ws, xs null for the f16 path: 1).
//       post undoes the library's alpha (2^16 where an 8-bit product writes f16). One thread per
//       output, grid-stride.

#define LT_PAD 0xffffffffu

// Block-wide max of a non-negative value over 256 threads (8 warps).
__device__ __forceinline__ float block_max_256(float m) {
    __shared__ float partial[8];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, d));
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = m;
    __syncthreads();
    float r = partial[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) r = fmaxf(r, partial[w]);
    return r;
}

// mask_t(X[t][map[k']]) or 0 (padding column, padding row).
__device__ __forceinline__ float lifted_value(const float* __restrict__ xr, const unsigned* __restrict__ map,
                                              int kk, bool live, float thr) {
    if (!live) return 0.f;
    const unsigned src = map[kk];
    if (src == LT_PAD) return 0.f;
    const float v = xr[src];
    return active(v, thr) ? v : 0.f;
}

extern "C" __global__ void __launch_bounds__(256) lt_lift_f16(const float* __restrict__ x, int ldx,
                                                              const unsigned* __restrict__ map, int kp,
                                                              int n, float thr, f16_bits* __restrict__ out) {
    const int t = blockIdx.x;
    const bool live = t < n;
    const float* xr = x + (size_t)(live ? t : 0) * ldx;
    f16_bits* o = out + (size_t)t * kp;
    for (int kk = threadIdx.x; kk < kp; kk += 256) o[kk] = f2h(lifted_value(xr, map, kk, live, thr));
}

// max |mask_t(X[t])| over the K original columns (0 for a padding row).
__device__ __forceinline__ float row_max(const float* __restrict__ xr, int k, bool live, float thr) {
    float m = 0.f;
    if (live)
        for (int c = threadIdx.x; c < k; c += 256) {
            const float v = xr[c];
            if (active(v, thr)) m = fmaxf(m, fabsf(v));
        }
    return block_max_256(m);
}

extern "C" __global__ void __launch_bounds__(256) lt_lift_i8(const float* __restrict__ x, int ldx, int k,
                                                             const unsigned* __restrict__ map, int kp, int n,
                                                             float thr, signed char* __restrict__ out,
                                                             float* __restrict__ xscale) {
    const int t = blockIdx.x;
    const bool live = t < n;
    const float* xr = x + (size_t)(live ? t : 0) * ldx;
    const float s = __fdiv_rn(row_max(xr, k, live, thr), 127.f);
    if (threadIdx.x == 0) xscale[t] = s;
    signed char* o = out + (size_t)t * kp;
    for (int kk = threadIdx.x; kk < kp; kk += 256) {
        const float v = lifted_value(xr, map, kk, live, thr);
        int q = 0;
        if (s > 0.f) q = max(-127, min(127, __float2int_rn(__fdiv_rn(v, s))));
        o[kk] = (signed char)q;
    }
}

// Two f32 to e4m3 (round to nearest even, saturating to +-448): lo in the low byte.
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// kp is even (a multiple of 64), so each thread writes a pair.
extern "C" __global__ void __launch_bounds__(256) lt_lift_e4m3(const float* __restrict__ x, int ldx, int k,
                                                               const unsigned* __restrict__ map, int kp, int n,
                                                               float thr, unsigned char* __restrict__ out,
                                                               float* __restrict__ xscale) {
    const int t = blockIdx.x;
    const bool live = t < n;
    const float* xr = x + (size_t)(live ? t : 0) * ldx;
    const float s = __fdiv_rn(row_max(xr, k, live, thr), 448.f);
    if (threadIdx.x == 0) xscale[t] = s;
    unsigned short* o = reinterpret_cast<unsigned short*>(out + (size_t)t * kp);
    for (int p = threadIdx.x; p < kp / 2; p += 256) {
        float v0 = lifted_value(xr, map, 2 * p, live, thr), v1 = lifted_value(xr, map, 2 * p + 1, live, thr);
        if (s > 0.f) {
            v0 = __fdiv_rn(v0, s);
            v1 = __fdiv_rn(v1, s);
        } else {
            v0 = v1 = 0.f;
        }
        o[p] = e4m3x2(v0, v1);
    }
}

template <typename T>
__device__ __forceinline__ float acc_value(T v);
template <>
__device__ __forceinline__ float acc_value<int>(int v) { return (float)v; }
template <>
__device__ __forceinline__ float acc_value<float>(float v) { return v; }
template <>
__device__ __forceinline__ float acc_value<f16_bits>(f16_bits v) { return h2f(v); }

template <typename T>
__device__ __forceinline__ void lt_scale(const T* __restrict__ d, int mp, int m, int n, float post,
                                         const float* __restrict__ ws, const float* __restrict__ xs,
                                         float* __restrict__ y, int ldy, int accumulate) {
    const long long total = (long long)n * m;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(i / m), r = (int)(i - (long long)t * m);
        float v = acc_value<T>(d[(size_t)t * mp + r]) * post;
        if (ws) v *= ws[r] * xs[t];
        float* dst = y + (size_t)t * ldy + r;
        *dst = accumulate ? *dst + v : v;
    }
}

extern "C" __global__ void lt_scale_i32(const int* d, int mp, int m, int n, float post, const float* ws,
                                        const float* xs, float* y, int ldy, int accumulate) {
    lt_scale<int>(d, mp, m, n, post, ws, xs, y, ldy, accumulate);
}
extern "C" __global__ void lt_scale_f32(const float* d, int mp, int m, int n, float post, const float* ws,
                                        const float* xs, float* y, int ldy, int accumulate) {
    lt_scale<float>(d, mp, m, n, post, ws, xs, y, ldy, accumulate);
}
extern "C" __global__ void lt_scale_f16(const f16_bits* d, int mp, int m, int n, float post, const float* ws,
                                        const float* xs, float* y, int ldy, int accumulate) {
    lt_scale<f16_bits>(d, mp, m, n, post, ws, xs, y, ldy, accumulate);
}
