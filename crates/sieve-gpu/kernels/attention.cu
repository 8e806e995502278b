// Grouped-query attention of one decode token over the f16 KV cache, split along the sequence
// (flash-decoding), then a combine kernel.
//
// attention_split: grid (Hkv, S), 128 threads. Block (kv head h, split s) takes the g = H/Hkv
// query heads that read KV head h, and positions [s*per, min((s+1)*per, len)) with
// len = state[0] + 1 and per = ceil(len / S): the grid is fixed when the step is captured, the
// split of the work follows the sequence length read from device memory.
//
//   positions in tiles of 128, thread t <-> position tile0 + t:
//     scores  s[j] = (q_j * scale) . k_p           (q of the g heads in shared memory;
//                                                   k row read as 16-byte vectors)
//     per-head tile max by warp shuffles + shared, running max m_j, correction exp(m_old - m_new)
//     prob[j][t] = exp(s[j] - m_j) in shared;  l_j (per thread, reduced at the end)
//     values: thread t owns output dims t and t + 128 of every head j:
//             acc[j][.] = acc * corr + sum_t prob[j][t] * v_t[dim]   (v rows read coalesced)
//   output per (query head, split): part[(head * S + s) * (hd + 2)] = { m, l, acc[0..hd] }
//   (an empty split writes m = -inf, l = 0).
//
// Prefill (len0 > 0): grid (Hkv, S, n), query z at position len0 - 1 + z reads its q from
// qkv + z * q_stride and writes its partials z * H * S * (hd + 2) further; combine runs on
// grid (H, n). Causality is the length: query z sees keys 0 .. len0 - 1 + z.
//
// attention_combine: grid H, 128 threads: out[h][d] = sum_s e^(m_s - M) acc_s[d] / sum_s e^(m_s - M) l_s.
//
// Limits (checked by the runner): hd <= 256 and a multiple of 8, g <= 8.

#define ATT_THREADS 128
#define ATT_MAX_G 8
#define ATT_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, d));
    return v;
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attention_split(const float* __restrict__ qkv, const f16_bits* __restrict__ k_cache,
                const f16_bits* __restrict__ v_cache, const int* __restrict__ state,
                float* __restrict__ part, int H, int Hkv, int hd, float scale, int len0, int q_stride) {
    extern __shared__ float smem[];
    __shared__ float red[ATT_THREADS / 32][ATT_MAX_G];
    const int kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    const int g = H / Hkv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Decode: one query, len from the state. Prefill: query z of the batch sees len0 + z keys.
    const int len = len0 > 0 ? len0 + (int)blockIdx.z : state[0] + 1;
    qkv += (size_t)blockIdx.z * q_stride;
    part += (size_t)blockIdx.z * H * S * (hd + 2);
    const int per = (len + S - 1) / S;
    const int p0 = min(split * per, len), p1 = min(p0 + per, len);
    float* qs = smem;             // [g][hd]
    float* prob = smem + g * hd;  // [g][ATT_THREADS]
    for (int i = tid; i < g * hd; i += ATT_THREADS) qs[i] = qkv[(size_t)kvh * g * hd + i] * scale;
    __syncthreads();

    const size_t row = (size_t)Hkv * hd;
    float m[ATT_MAX_G], l[ATT_MAX_G], acc[ATT_MAX_G][2];
#pragma unroll
    for (int j = 0; j < ATT_MAX_G; ++j) {
        m[j] = ATT_NEG_INF;
        l[j] = 0.f;
        acc[j][0] = acc[j][1] = 0.f;
    }
    for (int t0 = p0; t0 < p1; t0 += ATT_THREADS) {
        const int p = t0 + tid;
        const bool valid = p < p1;
        float s[ATT_MAX_G];
#pragma unroll
        for (int j = 0; j < ATT_MAX_G; ++j) s[j] = 0.f;
        if (valid) {
            const uint4* kr = reinterpret_cast<const uint4*>(k_cache + (size_t)p * row + (size_t)kvh * hd);
            for (int c = 0; c < hd / 8; ++c) {
                float kf[8];
                unpack8(kr[c], kf);
#pragma unroll
                for (int j = 0; j < ATT_MAX_G; ++j) {
                    if (j < g) {
                        const float* q = qs + j * hd + c * 8;
#pragma unroll
                        for (int e = 0; e < 8; ++e) s[j] = fmaf(q[e], kf[e], s[j]);
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < ATT_MAX_G; ++j) {
            if (j < g) {
                float v = warp_max(valid ? s[j] : ATT_NEG_INF);
                if (lane == 0) red[warp][j] = v;
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < ATT_MAX_G; ++j) {
            if (j < g) {
                float tile_max = red[0][j];
#pragma unroll
                for (int w = 1; w < ATT_THREADS / 32; ++w) tile_max = fmaxf(tile_max, red[w][j]);
                // The tile has at least one valid position, so the new max is finite.
                float m_new = fmaxf(m[j], tile_max);
                float corr = __expf(m[j] - m_new);
                m[j] = m_new;
                float e = valid ? __expf(s[j] - m_new) : 0.f;
                prob[j * ATT_THREADS + tid] = e;
                l[j] = l[j] * corr + e;
                acc[j][0] *= corr;
                acc[j][1] *= corr;
            }
        }
        __syncthreads();
        const int count = min(ATT_THREADS, p1 - t0);
        const f16_bits* vbase = v_cache + (size_t)t0 * row + (size_t)kvh * hd;
#pragma unroll 8
        for (int q = 0; q < count; ++q) {
            const f16_bits* vr = vbase + (size_t)q * row;
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                int dim = tid + k * ATT_THREADS;
                if (dim < hd) {
                    float v = h2f(vr[dim]);
#pragma unroll
                    for (int j = 0; j < ATT_MAX_G; ++j)
                        if (j < g) acc[j][k] = fmaf(prob[j * ATT_THREADS + q], v, acc[j][k]);
                }
            }
        }
        __syncthreads();  // red and prob are rewritten by the next tile
    }
#pragma unroll
    for (int j = 0; j < ATT_MAX_G; ++j) {
        if (j < g) {
            float v = warp_sum(l[j]);
            if (lane == 0) red[warp][j] = v;
        }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < ATT_MAX_G; ++j) {
        if (j < g) {
            float* out = part + ((size_t)(kvh * g + j) * S + split) * (hd + 2);
            if (tid == 0) {
                float total = 0.f;
#pragma unroll
                for (int w = 0; w < ATT_THREADS / 32; ++w) total += red[w][j];
                out[0] = m[j];
                out[1] = total;
            }
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                int dim = tid + k * ATT_THREADS;
                if (dim < hd) out[2 + dim] = acc[j][k];
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
attention_combine(const float* __restrict__ part, float* __restrict__ att, int S, int hd) {
    const int h = blockIdx.x;
    // blockIdx.y: the query of a prefill batch (0 in decode).
    part += (size_t)blockIdx.y * gridDim.x * S * (hd + 2);
    att += (size_t)blockIdx.y * gridDim.x * hd;
    const float* base = part + (size_t)h * S * (hd + 2);
    float M = ATT_NEG_INF;
    for (int s = 0; s < S; ++s) M = fmaxf(M, base[(size_t)s * (hd + 2)]);
    float L = 0.f;
    for (int s = 0; s < S; ++s) {
        const float* p = base + (size_t)s * (hd + 2);
        if (p[1] > 0.f) L += p[1] * __expf(p[0] - M);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < S; ++s) {
            const float* p = base + (size_t)s * (hd + 2);
            if (p[1] > 0.f) a += p[2 + d] * __expf(p[0] - M);
        }
        att[(size_t)h * hd + d] = a / L;
    }
}
