// The next token, chosen on the GPU so that the host reads one id per step: repetition
// penalty, then greedy argmax, or temperature / top-k / top-p sampling. One block of 1024
// threads over the V logits (the buffer is scratch: the penalty is applied in place).
//
//   state[0] = p, the position of the token that produced these logits; state[1] = its id.
//   history[i] = token at position i (prompt and generated), i <= p.
//   After the kernel: state[0] = p + 1, state[1] = history[p + 1] = the chosen token, so the
//   next step's embedding reads it without the host.
//
// Penalty: the last `window` positions, each id once (an id also seen later in the window is
// skipped), logit / r if positive else logit * r (the CPU sampler's rule).
// Sampling (T >= 1e-6; below it greedy, as on the CPU): logits / T; top-k keeps values >= the
// k-th largest (found by bisection on the value, so ties at the boundary are all kept); top-p
// keeps the largest values whose softmax mass reaches p (bisection on the value again); then
// u ~ U[0,1) from a hash of (seed, p) picks the token by the running sum of the kept weights
// in id order.

#define SAMPLE_THREADS 1024
#define SAMPLE_BISECT 48
#define ARGMAX_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        float o = __shfl_xor_sync(FULL_MASK, v, d);
        v = is_max ? fmaxf(v, o) : v + o;
    }
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < SAMPLE_THREADS / 32; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
    return r;
}

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Sum over ids with logit >= cut of exp((l - top) * inv_t) (count when `count` is set).
__device__ float kept_mass(const float* logits, int V, float cut, float top, float inv_t, bool count, float* red) {
    float s = 0.f;
    for (int i = threadIdx.x; i < V; i += SAMPLE_THREADS) {
        float l = logits[i];
        if (l >= cut) s += count ? 1.f : __expf((l - top) * inv_t);
    }
    return block_reduce(s, false, red);
}

// The choice for one row of logits (the whole block works on it; every thread returns the
// chosen id). `recent` holds the row's last `recent_len` tokens for the penalty (the CPU
// sampler's window), `p` is the position of the token that produced these logits (the draw's
// hash input). Returns V when every logit is -inf (the callers map it to a valid id or a code).
// With `bad` (a shared int the caller zeroed before a barrier), a NaN or +inf logit sets it.
__device__ int sample_row(float* __restrict__ logits, int V, float temperature, int top_k, float top_p,
                          float penalty, const int* __restrict__ recent, int recent_len, u64 seed, int p,
                          float* red, int* red_i, float* chunk_sum, int* bad) {
    const int tid = threadIdx.x;

    if (penalty != 1.f) {
        int i = tid;
        if (i < recent_len) {
            int id = recent[i];
            bool later = false;
            for (int j = i + 1; j < recent_len; ++j) later |= recent[j] == id;
            if (!later && id >= 0 && id < V) {
                float l = logits[id];
                logits[id] = l > 0.f ? l / penalty : l * penalty;
            }
        }
        __syncthreads();
    }

    // Argmax, lowest id on ties (as the CPU sampler).
    float best = __int_as_float(0xff800000);
    int best_id = V;
    bool not_finite = false;
    for (int i = tid; i < V; i += SAMPLE_THREADS) {
        float l = logits[i];
        not_finite |= isnan(l) || l == __int_as_float(0x7f800000);
        if (l > best) {
            best = l;
            best_id = i;
        }
    }
    if (bad && not_finite) atomicOr(bad, 1);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        float ob = __shfl_xor_sync(FULL_MASK, best, d);
        int oi = __shfl_xor_sync(FULL_MASK, best_id, d);
        if (ob > best || (ob == best && oi < best_id)) {
            best = ob;
            best_id = oi;
        }
    }
    if ((tid & 31) == 0) {
        red[tid >> 5] = best;
        red_i[tid >> 5] = best_id;
    }
    __syncthreads();
    float top = red[0];
    int chosen = red_i[0];
    for (int w = 1; w < SAMPLE_THREADS / 32; ++w) {
        if (red[w] > top || (red[w] == top && red_i[w] < chosen)) {
            top = red[w];
            chosen = red_i[w];
        }
    }
    __syncthreads();

    // Below 1e-6 (sieve_model::sampling::GREEDY_BELOW_TEMPERATURE, which the host already
    // sends as 0) the draw is greedy: 1 / T would overflow f32 and (l - top) * inv_t be NaN.
    if (temperature >= 1e-6f) {
        const float inv_t = 1.f / temperature;
        float cut = __int_as_float(0xff800000);
        if (top_k > 0 && top_k < V) {
            // Smallest logit: the bisection's lower end.
            float mn = __int_as_float(0x7f800000);
            for (int i = tid; i < V; i += SAMPLE_THREADS) mn = fminf(mn, logits[i]);
            mn = -block_reduce(-mn, true, red);
            float lo = mn;
            float hi = top;
            for (int it = 0; it < SAMPLE_BISECT; ++it) {
                float mid = 0.5f * (lo + hi);
                if (mid <= lo || mid >= hi) break;
                float c = kept_mass(logits, V, mid, top, inv_t, true, red);
                if (c >= (float)top_k) lo = mid; else hi = mid;
            }
            cut = lo;
        }
        float total = kept_mass(logits, V, cut, top, inv_t, false, red);
        if (top_p < 1.f) {
            float lo = cut == __int_as_float(0xff800000) ? top - 1e4f * temperature : cut, hi = top;
            float want = top_p * total;
            for (int it = 0; it < SAMPLE_BISECT; ++it) {
                float mid = 0.5f * (lo + hi);
                if (mid <= lo || mid >= hi) break;
                float mass = kept_mass(logits, V, fmaxf(mid, cut), top, inv_t, false, red);
                if (mass >= want) lo = mid; else hi = mid;
            }
            cut = fmaxf(cut, lo);
            total = kept_mass(logits, V, cut, top, inv_t, false, red);
        }
        // Running sum in id order: thread t owns ids [t*per, (t+1)*per).
        const int per = (V + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
        const int b = tid * per, e = min(b + per, V);
        float mine = 0.f;
        for (int i = b; i < e; ++i) {
            float l = logits[i];
            if (l >= cut) mine += __expf((l - top) * inv_t);
        }
        chunk_sum[tid] = mine;
        __syncthreads();
        if (tid == 0) {
            u64 r = splitmix64(seed ^ splitmix64((u64)p + 1));
            float target = (float)((double)(r >> 11) * (1.0 / 9007199254740992.0)) * total;
            int t = 0;
            while (t < SAMPLE_THREADS - 1 && target >= chunk_sum[t]) {
                target -= chunk_sum[t];
                ++t;
            }
            int pick = chosen;  // rounding fallback: the most likely token
            for (int i = t * per; i < min(t * per + per, V); ++i) {
                float l = logits[i];
                if (l >= cut) {
                    float w = __expf((l - top) * inv_t);
                    if (target < w) {
                        pick = i;
                        break;
                    }
                    target -= w;
                }
            }
            red_i[0] = pick;
        }
        __syncthreads();
        chosen = red_i[0];
    }
    return chosen;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_token(float* __restrict__ logits, int V, float temperature, int top_k, float top_p,
             float penalty, int window, u64 seed, int* __restrict__ state, int* __restrict__ history,
             int capacity) {
    pdl_wait_then_release();
    __shared__ float red[SAMPLE_THREADS / 32];
    __shared__ int red_i[SAMPLE_THREADS / 32];
    __shared__ float chunk_sum[SAMPLE_THREADS];
    const int p = state[0];
    const int first = max(0, p + 1 - window);
    int chosen = sample_row(logits, V, temperature, top_k, top_p, penalty, history + first, p + 1 - first,
                            seed, p, red, red_i, chunk_sum, nullptr);
    if (threadIdx.x == 0) {
        if (chosen >= V) chosen = 0;
        if (p + 1 < capacity) {
            history[p + 1] = chosen;
            state[0] = p + 1;
        }
        state[1] = chosen;
    }
}

// sample_rows: the choice for each of n rows of logits, each with its own arguments (a batched
// decode step of sequences with their own temperature / top-k / top-p / penalty / seed), so the
// host reads n ids. Grid n, SAMPLE_THREADS threads; row r: logits[r * V ..], args[r], its
// recent tokens recent[r * window .. + args[r].recent_len]; out[r] = the id, -1 when every
// logit of the row is -inf, -2 when one is NaN or +inf (the CPU sampler refuses those rows).
struct SampleRowArgs {
    float temperature;
    int top_k;
    float top_p;
    float penalty;
    int recent_len;
    int position;
    u64 seed;
};

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(float* __restrict__ logits, int V, const SampleRowArgs* __restrict__ args,
            const int* __restrict__ recent, int window, int* __restrict__ out) {
    pdl_wait_then_release();
    __shared__ float red[SAMPLE_THREADS / 32];
    __shared__ int red_i[SAMPLE_THREADS / 32];
    __shared__ float chunk_sum[SAMPLE_THREADS];
    __shared__ int bad;
    const int r = blockIdx.x;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    const int chosen = sample_row(logits + (size_t)r * V, V, args[r].temperature, args[r].top_k, args[r].top_p,
                                  args[r].penalty, recent + (size_t)r * window, min(args[r].recent_len, window),
                                  args[r].seed, args[r].position, red, red_i, chunk_sum, &bad);
    if (threadIdx.x == 0) out[r] = bad ? -2 : chosen >= V ? -1 : chosen;
}

// argmax_rows: the greedy choice of each of n rows of logits (a batched decode step whose
// sequences all decode greedily without a repetition penalty), so the host reads n ids instead
// of n x V logits. Grid n, SAMPLE_THREADS threads; row r is logits[r * V ..].
// out[r] = the lowest id of the row's largest finite-or--inf value (the CPU sampler's rule:
// strictly greater wins, ties keep the lowest id); -1 when every logit is -inf; -2 when a logit
// is NaN or +inf (the CPU sampler refuses those rows too).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
argmax_rows(const float* __restrict__ logits, int V, int* __restrict__ out) {
    pdl_wait_then_release();
    __shared__ float red_v[SAMPLE_THREADS / 32];
    __shared__ int red_i[SAMPLE_THREADS / 32];
    __shared__ int bad_any;
    const float* row = logits + (size_t)blockIdx.x * V;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) bad_any = 0;
    __syncthreads();
    float best = ARGMAX_NEG_INF;
    int best_id = -1;
    bool bad = false;
    for (int i = tid; i < V; i += SAMPLE_THREADS) {
        const float l = row[i];
        if (isnan(l) || l == -ARGMAX_NEG_INF) bad = true;
        // -inf never wins (the CPU rule); ids rise along the loop, so ">" keeps the lowest.
        else if (l > best) {
            best = l;
            best_id = i;
        }
    }
    if (bad) atomicOr(&bad_any, 1);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, best, d);
        const int oi = __shfl_xor_sync(FULL_MASK, best_id, d);
        if (oi >= 0 && (best_id < 0 || ov > best || (ov == best && oi < best_id))) {
            best = ov;
            best_id = oi;
        }
    }
    if (lane == 0) {
        red_v[warp] = best;
        red_i[warp] = best_id;
    }
    __syncthreads();
    if (tid == 0) {
        float b = red_v[0];
        int id = red_i[0];
        for (int w = 1; w < SAMPLE_THREADS / 32; ++w) {
            const int oi = red_i[w];
            if (oi >= 0 && (id < 0 || red_v[w] > b || (red_v[w] == b && oi < id))) {
                b = red_v[w];
                id = oi;
            }
        }
        out[blockIdx.x] = bad_any ? -2 : id;
    }
}
