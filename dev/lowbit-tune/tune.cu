// Tuning experiment for the dense low-bit decode products (crates/sieve-cuda/kernels/
// dense_lowbit_gemv.cu), outside the library: the four products of every Llama layer
// (q|k|v, o, gate|up, down) for all layers of a model shape, captured in one CUDA graph with
// programmatic dependent launch as the decode step runs them, each layer's weights its own
// buffers (the whole model's bytes stream from HBM, as in decode), replayed and timed with
// events (median of the replays): the conversion launch and the product per matrix, as the
// runner launches them (one block per row tile, persistent blocks, and persistent without the
// conversion launches), under compile-time settings (LB_WARPS, LB_BATCH, LB_MIN_BLOCKS,
// LB_MIN_BLOCKS_W4G128) given with -D. Weights are random bytes: the
// values do not change the time; correctness is the library's tests' job.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 [-DLB_MIN_BLOCKS=3] -o tune dev/lowbit-tune/tune.cu
//   ./tune [layers=32] [model=7b|13b|8b] [only=name substring]
//                                          -> one line per (kind or mix, variant): ms per step, GB/s
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "../../crates/sieve-cuda/kernels/common.cuh"
#include "../../crates/sieve-cuda/kernels/dense_lowbit_gemv.cu"

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

typedef void (*LbKernel)(const uint4*, const u32*, const u32*, const u32*, const u32*, const float*,
                         const f16_bits*, int, float*, int, int, int, int, int);

struct Kind {
    const char* name;
    int bits, group;
    LbKernel f16;
    bool two_level = false;  // K kinds: code words per group, d (dmin) pairs per 256 columns
    bool persistent = true;  // the library's grid choice (LowBitKind::persistent)
};

// Q6_K with one f16 scale per 16 columns (the kind before the two-level ones), for comparison.
LB_KERNEL(tune_w6g16, 6, 16, false, false, 1, LB_MIN_BLOCKS)

// How the products are launched: grid = one block per row tile, or persistent (at most the
// resident blocks); with or without the f32 -> f16 conversion launch before each product.
enum Mode { TILES, PERSISTENT, LIBRARY, PERSISTENT_NO_CONVERSION };
static const char* mode_name[] = {"grid = tiles", "persistent", "library's grid per kind",
                                  "persistent, no conversion"};

struct Product {
    const struct Kind* k;
    bool convert;  // preceded by its activation conversion (a later part of a group shares it)
    int rows, cols, tiles, chunks, kp;
    uint4* w;
    u32* hi;
    u32* gs;
    float* rs;
    float* x;
    f16_bits* x16;
    float* y;
    size_t bytes;
};

static Product make(const Kind& k, int rows, int cols) {
    Product p{};
    p.k = &k;
    p.convert = true;
    p.rows = rows;
    p.cols = cols;
    p.tiles = (rows + 15) / 16;
    p.kp = k.two_level ? (cols + 255) / 256 * 256 : (cols + 127) / 128 * 128;
    const int ck = k.bits == 8 ? 32 : 64;
    p.chunks = p.kp / ck;
    size_t wbytes = (size_t)p.tiles * p.chunks * 512;
    int groups = k.group ? p.kp / k.group : 1;
    size_t gbytes = k.group ? (size_t)p.tiles * groups * 8 * 4 : 4;
    size_t rbytes = (size_t)p.tiles * 16 * 4;
    CK(cudaMalloc(&p.w, wbytes));
    CK(cudaMemset(p.w, 0x5a, wbytes));
    size_t hbytes = k.bits == 5 || k.bits == 6 ? (size_t)p.tiles * p.chunks * 32 * (k.bits - 4) * 4 : 4;
    CK(cudaMalloc(&p.hi, hbytes));
    CK(cudaMemset(p.hi, 0x33, hbytes));
    CK(cudaMalloc(&p.gs, gbytes));
    CK(cudaMemset(p.gs, 0x1c, gbytes));
    CK(cudaMalloc(&p.rs, rbytes));
    CK(cudaMemset(p.rs, 0, rbytes));
    CK(cudaMalloc(&p.x, cols * 4));
    std::vector<float> hx(cols);
    for (int i = 0; i < cols; ++i) hx[i] = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f;
    CK(cudaMemcpy(p.x, hx.data(), cols * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&p.x16, p.kp * 2));
    CK(cudaMemset(p.x16, 0, p.kp * 2));
    CK(cudaMalloc(&p.y, rows * 4));
    CK(cudaMemset(p.y, 0, rows * 4));
    // K kinds read 64 code words and 1-2 pairs per row tile and 256 columns (the buffer is larger).
    size_t sbytes = k.two_level ? (size_t)p.tiles * (p.kp / 256) * (64 + 16) * 4 : 0;
    p.bytes = wbytes + (k.two_level ? sbytes : k.group ? gbytes : rbytes) + (hbytes > 4 ? hbytes : 0);
    return p;
}

static void release(Product& p) {
    cudaFree(p.w);
    cudaFree(p.hi);
    cudaFree(p.gs);
    cudaFree(p.rs);
    cudaFree(p.x);
    cudaFree(p.x16);
    cudaFree(p.y);
}

template <typename... Args>
static void launch_pdl(void (*f)(Args...), dim3 grid, dim3 block, cudaStream_t s, Args... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, f, args...));
}

static void enqueue(Product& p, Mode mode, int sms, cudaStream_t s) {
    const Kind& k = *p.k;
    if (mode != PERSISTENT_NO_CONVERSION && p.convert)
        launch_pdl(lowbit_x_to_f16, dim3((p.kp + 255) / 256), dim3(256), s, (const float*)p.x, p.x16, p.cols,
                   p.cols, p.kp, 1, -1.f);
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k.f16, 32 * LB_WARPS, 0));
    const bool persistent = mode == PERSISTENT || mode == PERSISTENT_NO_CONVERSION || (mode == LIBRARY && k.persistent);
    const int grid = persistent ? std::min(p.tiles, per_sm * sms) : p.tiles;
    // Affine kinds read their mins, K kinds their d pairs, from the scale buffer: the values do
    // not change the time.
    launch_pdl(k.f16, dim3(grid), dim3(32 * LB_WARPS), s, (const uint4*)p.w, (const u32*)p.hi, (const u32*)p.gs,
               (const u32*)p.gs, (const u32*)p.gs, (const float*)p.rs, (const f16_bits*)p.x16, p.kp, p.y, p.rows, p.rows, 1,
               p.chunks, 1);
}

// llama.cpp's "use more bits" layers of Q4_K_M (Q6_K attn_v and ffn_down there).
static bool more_bits(int l, int layers) {
    return l < layers / 8 || l >= 7 * layers / 8 || (l - layers / 8) % 3 == 2;
}

int main(int argc, char** argv) {
    int layers = argc > 1 ? atoi(argv[1]) : 32;
    std::string model = argc > 2 ? argv[2] : "7b";
    int d = 4096, ff = 11008, kv = 4096;
    if (model == "13b") d = 5120, ff = 13824, kv = 5120;
    if (model == "8b") d = 4096, ff = 14336, kv = 1024;
    Kind kinds[] = {
        {"w4a16-g128", 4, 128, lowbit_w4g128_nt1},
        {"q4_0", 4, 32, lowbit_w4g32_nt1},
        {"w8a16", 8, 0, lowbit_w8row_nt1},
        {"q8_0", 8, 32, lowbit_w8g32_nt1},
        {"q4_1", 4, 32, lowbit_w4g32a_nt1},
        {"q4_k", 4, 32, lowbit_w4k_nt1, true},
        {"q6_k", 6, 16, lowbit_w6k_nt1, true},
        {"w6g16", 6, 16, tune_w6g16_nt1, false, true},
    };
    // Mixes: every kind's products, or Q4_K_M's (Q4_K, and Q6_K for v and down in the "more
    // bits" layers, q|k then one product and v another, as the runner joins them).
    struct Mix {
        const char* name;
        const Kind* base;
        const Kind* more;
    };
    std::vector<Mix> mixes;
    for (const Kind& k : kinds) mixes.push_back({k.name, &k, nullptr});
    mixes.push_back({"q4_k_m (q6_k two-level)", &kinds[5], &kinds[6]});
    mixes.push_back({"q4_k_m (q6_k as w6g16)", &kinds[5], &kinds[7]});
    const char* only = argc > 3 ? argv[3] : "";
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("model %s, %d layers, LB_WARPS %d LB_BATCH %d LB_MIN_BLOCKS %d (W4A16 g128: %d)\n", model.c_str(),
           layers, LB_WARPS, LB_BATCH, LB_MIN_BLOCKS, LB_MIN_BLOCKS_W4G128);
    for (const Mix& mx : mixes) {
        if (*only && !strstr(mx.name, only)) continue;
        std::vector<Product> ps;
        size_t bytes = 0;
        auto add = [&](const Kind& k, int rows, int cols, bool convert) {
            ps.push_back(make(k, rows, cols));
            ps.back().convert = convert;
            bytes += ps.back().bytes;
        };
        for (int l = 0; l < layers; ++l) {
            const bool more = mx.more && more_bits(l, layers);
            if (more) {
                add(*mx.base, d + kv, d, true);
                add(*mx.more, kv, d, true);
            } else {
                add(*mx.base, d + 2 * kv, d, true);
            }
            add(*mx.base, d, d, true);
            add(*mx.base, 2 * ff, d, true);
            add(more ? *mx.more : *mx.base, d, ff, true);
        }
        for (Mode mode : {TILES, PERSISTENT, LIBRARY, PERSISTENT_NO_CONVERSION}) {
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            for (auto& p : ps) enqueue(p, mode, sms, s);
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, s));
            CK(cudaStreamSynchronize(s));
            std::vector<float> ms;
            for (int i = 0; i < 15; ++i) {
                CK(cudaEventRecord(e0, s));
                CK(cudaGraphLaunch(ge, s));
                CK(cudaEventRecord(e1, s));
                CK(cudaEventSynchronize(e1));
                float m;
                CK(cudaEventElapsedTime(&m, e0, e1));
                ms.push_back(m);
            }
            std::sort(ms.begin(), ms.end());
            const float med = ms[ms.size() / 2];
            printf("%-24s %-26s %8.3f ms per step  %7.1f GB/s  (%.2f GB, %zu products)\n", mx.name, mode_name[mode],
                   med, bytes / (med * 1e-3) / 1e9, bytes / 1e9, ps.size());
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
        }
        for (auto& p : ps) release(p);
    }
    return 0;
}
