// RoPE with the KV-cache write, the one rotation of both paths: rope_kv for the decode step's
// token, rope_rows for the n tokens of a batched prefill. Both call rope_head.
//
// Buffers (f32 unless noted; H/Hkv heads, hd head dim, C = context):
//
//   qkv     [ q: H*hd | k: Hkv*hd | v: Hkv*hd ]   one token's output of the fused q|k|v product
//           (prefill: n such rows, (H + 2 Hkv) hd apart)
//   bias    the q|k|v bias (Qwen2), same layout as one qkv row, or null
//   k_cache, v_cache  f16 [C][Hkv*hd] of one layer (the runner passes the layer's base)
//   rope_cos, rope_sin [C][hd/2]  tables computed on the host in f64 (the CPU path's angles)
//   state   i32 [0] = position p of the decode step's token (device memory, so a captured CUDA
//           graph replays for every token)
//
// rope_head: block per q or k head (q heads then k heads are contiguous in qkv, so head j's
// row starts at j*hd either way), thread i rotates the pair (i, i + hd/2) (rotate-half
// convention); biases are added first. q heads are written back in place; k heads go to the
// cache row of position p as f16, and their blocks also copy their v head (bias added) there.
//
// rope_kv:   grid H + Hkv, position state[0].
// rope_rows: grid (H + Hkv, n), row y of qkv at position p0 + y (a prompt chunk); or, with
//            seqs, row y is the next token of its own sequence: position seqs[2y], cache slot
//            seqs[2y + 1] (the slot's rows start slot * slot_stride elements past the layer's
//            base), so a decode step of many sequences is one launch. A negative slot marks a
//            padding row (a captured step's batch rounded up): its q is rotated, nothing is
//            written to any cache.

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
        float a = row[i], b = row[i + half];
        if (brow) {
            a += brow[i];
            b += brow[i + half];
        }
        float ra = a * c[i] - b * s[i];
        float rb = b * c[i] + a * s[i];
        if (head < H) {
            row[i] = ra;
            row[i + half] = rb;
        } else {
            int kh = head - H;
            f16_bits* kdst = k_cache + (size_t)p * kv_row + (size_t)kh * hd;
            kdst[i] = f2h(ra);
            kdst[i + half] = f2h(rb);
            size_t voff = (size_t)(H + Hkv) * hd + (size_t)kh * hd;
            float va = qkv[voff + i], vb = qkv[voff + i + half];
            if (bias) {
                va += bias[voff + i];
                vb += bias[voff + i + half];
            }
            f16_bits* vdst = v_cache + (size_t)p * kv_row + (size_t)kh * hd;
            vdst[i] = f2h(va);
            vdst[i + half] = f2h(vb);
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
rope_kv(float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ rope_cos,
        const float* __restrict__ rope_sin, const int* __restrict__ state, f16_bits* __restrict__ k_cache,
        f16_bits* __restrict__ v_cache, int H, int Hkv, int hd) {
    pdl_wait_then_release();
    rope_head(qkv, bias, rope_cos, rope_sin, state[0], blockIdx.x, k_cache, v_cache, H, Hkv, hd);
}

extern "C" __global__ void __launch_bounds__(128)
rope_rows(float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ rope_cos,
          const float* __restrict__ rope_sin, int p0, const int* __restrict__ seqs, long long slot_stride,
          f16_bits* __restrict__ k_cache, f16_bits* __restrict__ v_cache, int H, int Hkv, int hd) {
    pdl_wait_then_release();
    const size_t qkv_row = (size_t)(H + 2 * Hkv) * hd;
    const int y = blockIdx.y;
    int p = p0 + y;
    size_t slot = 0;
    if (seqs) {
        p = seqs[2 * y];
        const int s = seqs[2 * y + 1];
        if (s < 0 && (int)blockIdx.x >= H) return;  // padding row: no cache write
        slot = (size_t)max(s, 0) * (size_t)slot_stride;
    }
    rope_head(qkv + y * qkv_row, bias, rope_cos, rope_sin, p, blockIdx.x, k_cache + slot, v_cache + slot, H,
              Hkv, hd);
}
