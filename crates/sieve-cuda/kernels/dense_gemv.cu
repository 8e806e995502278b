// Dense f16 GEMV, y = W * mask_t(x), for N = 1. Two layouts.
//
// (1) Row-major W (M x K, the DenseMatrix layout), one warp per output row:
//
//        row m:  [ 16B | 16B | 16B | ... ]   K/8 vectors of 8 f16
//                  l0    l1    l2  ...       lane l reads vectors l, l+32, l+64, ...
//
//     UNROLL vectors per lane are loaded before the first is used, so each warp keeps
//     UNROLL * 512 bytes in flight. Activations are f32, read through L1 (they are reused by
//     every row); inactive ones (|x| <= t) are zeroed on the fly. The lane sums are reduced
//     with shuffles and lane 0 writes y[m] (or adds to it when `accumulate` is set: the decode
//     runner adds o_proj/down_proj straight into the residual stream): no atomics, no zeroing.
//     K must be a multiple of 8 (rows 16-byte aligned); `dense_gemv_rowmajor_scalar` covers
//     any K.
//
// (2) Column-major W (K x ldm, ldm = M rounded up to 8, padding rows zero), the layout for
//     dense weights with sparse activations (TEAL alone). Celty's warp tiling without indices:
//
//                      k0 ............ k0+CPW-1     (CPW = cols_per_warp, the inner loop)
//        rows r0..r0+255 | lane0: rows r0..r0+7   (one 16B load per active column)
//                        | lane1: rows r0+8..+15
//                        | ...
//
//     The warp reads the CPW activations of its K slice 32 at a time (one per lane), forms
//     the active mask with a ballot, and walks the set bits: every lane sees the same column,
//     so skipping an inactive column costs no divergence and issues no weight load. Eight
//     active columns are loaded before any is used (4 KB in flight per warp). The 8 warps of a
//     block share a row tile and take consecutive K slices; they reduce in shared memory and
//     add to y with one atomic per row (split-K).
//     Fused zeroing (`dense_colmajor`): the blocks of K slice 0 (blockIdx.y = 0, the lowest
//     linear indices, so dispatched first) zero their row tile of y and publish the launch's
//     epoch in flags[row tile]; every other block waits for that flag before its atomics. No
//     separate memset launch, and the flags never need resetting (a new epoch per launch).
//     `dense_colmajor_list` takes an already compacted list of active columns instead of x's
//     mask: warp slices are slices of that list.

#define WARPS_PER_BLOCK_CM 8
#define CM_UNROLL 8

template <int UNROLL>
__device__ __forceinline__ void gemv_row(const uint4* __restrict__ row, const float* __restrict__ x,
                                         float* __restrict__ y, int m, int nvec, float t, int lane, int accumulate) {
    float acc = 0.f;
    int v = lane;
    for (; v + 32 * (UNROLL - 1) < nvec; v += 32 * UNROLL) {
        uint4 w[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) w[u] = ld_stream16(row + v + 32 * u);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const float4* xp = reinterpret_cast<const float4*>(x) + 2 * (v + 32 * u);
            float4 a = __ldg(xp), b = __ldg(xp + 1);
            float xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            float wf[8];
            unpack8(w[u], wf);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc += wf[i] * (active(xs[i], t) ? xs[i] : 0.f);
        }
    }
    for (; v < nvec; v += 32) {
        uint4 w = ld_stream16(row + v);
        const float4* xp = reinterpret_cast<const float4*>(x) + 2 * v;
        float4 a = __ldg(xp), b = __ldg(xp + 1);
        float xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float wf[8];
        unpack8(w, wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc += wf[i] * (active(xs[i], t) ? xs[i] : 0.f);
    }
    acc = warp_sum(acc);
    if (lane == 0) y[m] = accumulate ? y[m] + acc : acc;
}

extern "C" __global__ void __launch_bounds__(256)
dense_gemv_rowmajor(const uint4* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                    int M, int K, float t, int accumulate) {
    pdl_release();
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= M) return;
    int nvec = K >> 3;
    // Under programmatic dependent launch the row's first 2 KB (weights: never written by
    // another kernel) are fetched into L2 while the previous kernel finishes.
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        int v = lane + 32 * u;
        if (v < nvec) asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(w + (size_t)warp * nvec + v));
    }
    pdl_wait();
    gemv_row<4>(w + (size_t)warp * nvec, x, y, warp, nvec, t, lane, accumulate);
}

extern "C" __global__ void __launch_bounds__(256)
dense_gemv_rowmajor_scalar(const f16_bits* __restrict__ w, const float* __restrict__ x,
                           float* __restrict__ y, int M, int K, float t, int accumulate) {
    pdl_wait_then_release();
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= M) return;
    const f16_bits* row = w + (size_t)warp * K;
    float acc = 0.f;
    for (int k = lane; k < K; k += 32) {
        float xv = __ldg(x + k);
        if (active(xv, t)) acc += h2f(row[k]) * xv;
    }
    acc = warp_sum(acc);
    if (lane == 0) y[warp] = accumulate ? y[warp] + acc : acc;
}

// Accumulates the active columns [begin, end) of one warp's K slice into acc[8] (rows
// r0 + lane*8 .. +7). LIST: columns come from `cols` (already compacted), else from x's mask.
template <bool LIST>
__device__ __forceinline__ void colmajor_slice(const f16_bits* __restrict__ w, const float* __restrict__ x,
                                               const int* __restrict__ cols, int begin, int end,
                                               size_t ldm, int row_off, bool lane_rows, float t,
                                               int lane, float acc[8]) {
    for (int base = begin; base < end; base += 32) {
        int idx = base + lane;
        int col = -1;
        float xv = 0.f;
        if (idx < end) {
            col = LIST ? __ldg(cols + idx) : idx;
            xv = __ldg(x + col);
        }
        bool on = idx < end && (LIST || active(xv, t));
        u32 mask = __ballot_sync(FULL_MASK, on);
        while (mask) {
            // Up to CM_UNROLL active columns per round, all loads issued before the math.
            int src[CM_UNROLL];
            int n = 0;
#pragma unroll
            for (int u = 0; u < CM_UNROLL; ++u) {
                if (mask) {
                    src[u] = __ffs(mask) - 1;
                    mask &= mask - 1;
                    n = u + 1;
                } else {
                    src[u] = src[0];
                }
            }
            uint4 wv[CM_UNROLL];
            float xs[CM_UNROLL];
#pragma unroll
            for (int u = 0; u < CM_UNROLL; ++u) {
                int c = __shfl_sync(FULL_MASK, col, src[u]);
                xs[u] = __shfl_sync(FULL_MASK, xv, src[u]);
                if (u < n && lane_rows)
                    wv[u] = ld_stream16(w + (size_t)c * ldm + row_off);
                else
                    wv[u] = make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < CM_UNROLL; ++u) {
                if (u < n) {
                    float wf[8];
                    unpack8(wv[u], wf);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] += wf[i] * xs[u];
                }
            }
        }
    }
}

template <bool LIST>
__device__ __forceinline__ void colmajor_kernel(const f16_bits* __restrict__ w, const float* __restrict__ x,
                                                const int* __restrict__ cols, int ncols,
                                                float* __restrict__ y, int M, int ldm, float t,
                                                int cols_per_warp, u32* flags, u32 epoch) {
    __shared__ float part[WARPS_PER_BLOCK_CM][256];
    int lane = threadIdx.x & 31;
    int wib = threadIdx.x >> 5;
    int r0 = blockIdx.x * 256;
    if (flags && blockIdx.y == 0) {
        for (int r = threadIdx.x; r < 256; r += blockDim.x)
            if (r0 + r < M) y[r0 + r] = 0.f;
        publish_zeroed_tile(flags + blockIdx.x, epoch);
    }
    int row_off = r0 + lane * 8;
    bool lane_rows = row_off < ldm;
    int slice = blockIdx.y * WARPS_PER_BLOCK_CM + wib;
    int begin = slice * cols_per_warp;
    int end = min(begin + cols_per_warp, ncols);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (begin < end) colmajor_slice<LIST>(w, x, cols, begin, end, (size_t)ldm, row_off, lane_rows, t, lane, acc);
#pragma unroll
    for (int i = 0; i < 8; ++i) part[wib][lane * 8 + i] = acc[i];
    __syncthreads();
    if (flags && blockIdx.y != 0) wait_zeroed_tile(flags + blockIdx.x, epoch);
    for (int r = threadIdx.x; r < 256; r += blockDim.x) {
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < WARPS_PER_BLOCK_CM; ++q) s += part[q][r];
        if (r0 + r < M && s != 0.f) atomicAdd(y + r0 + r, s);
    }
}

extern "C" __global__ void __launch_bounds__(256)
dense_colmajor(const f16_bits* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
               int M, int K, int ldm, float t, int cols_per_warp, u32* flags, u32 epoch) {
    pdl_wait_then_release();
    colmajor_kernel<false>(w, x, nullptr, K, y, M, ldm, t, cols_per_warp, flags, epoch);
}

extern "C" __global__ void __launch_bounds__(256)
dense_colmajor_list(const f16_bits* __restrict__ w, const float* __restrict__ x, const int* __restrict__ cols,
                    const int* __restrict__ ncols, float* __restrict__ y, int M, int ldm,
                    int cols_per_warp) {
    pdl_wait_then_release();
    colmajor_kernel<true>(w, x, cols, *ncols, y, M, ldm, -1.f, cols_per_warp, nullptr, 0);
}

// Compacts the active columns of x into `cols` (order not preserved; products are sums, so
// order only changes rounding) and their count into *ncols (zeroed by the caller).
extern "C" __global__ void __launch_bounds__(256)
compact_active(const float* __restrict__ x, int K, float t, int* __restrict__ cols, int* __restrict__ ncols) {
    pdl_wait_then_release();
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    int lane = threadIdx.x & 31;
    bool on = k < K && active(x[k], t);
    u32 mask = __ballot_sync(FULL_MASK, on);
    int base = 0;
    if (lane == 0 && mask) base = atomicAdd(ncols, __popc(mask));
    base = __shfl_sync(FULL_MASK, base, 0);
    if (on) cols[base + __popc(mask & ((1u << lane) - 1))] = k;
}

// f32 -> f16 activations for the cuBLAS baseline (GemmEx takes f16 inputs).
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, f16_bits* __restrict__ out, int n) {
    pdl_wait_then_release();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}

// Device-to-device copy with 16-byte accesses: the bandwidth ceiling every kernel is
// compared against (bytes read + bytes written).
extern "C" __global__ void __launch_bounds__(256)
copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
    pdl_wait_then_release();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = ld_stream16(src + i);
}

// Keeps the GPU busy for `ns` nanoseconds so that the host can enqueue a whole timed batch
// ahead of the GPU: per-launch event timings then contain no host launch gaps.
extern "C" __global__ void spin_ns(u64 ns) {
    pdl_wait_then_release();
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
