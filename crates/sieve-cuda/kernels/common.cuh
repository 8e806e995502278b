// Shared device helpers, prepended to every kernel family before NVRTC compiles it.
// No CUDA headers are included: f16 values travel as raw 16-bit patterns and are converted
// with PTX `cvt`, so the kernels compile with a bare NVRTC (no toolkit include path needed).

typedef unsigned short f16_bits;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The two f16 halves of a 32-bit word, low half first (little-endian element order).
__device__ __forceinline__ void unpack2(u32 w, float& lo, float& hi) {
    lo = h2f((unsigned short)(w & 0xffffu));
    hi = h2f((unsigned short)(w >> 16));
}

// 8 f16 in a 16-byte vector to 8 floats, element i of the vector to out[i].
__device__ __forceinline__ void unpack8(const uint4& v, float out[8]) {
    unpack2(v.x, out[0], out[1]);
    unpack2(v.y, out[2], out[3]);
    unpack2(v.z, out[4], out[5]);
    unpack2(v.w, out[6], out[7]);
}

// Streaming 16-byte load for data read exactly once (weights): read-only path, and no L1
// allocation so that activations and metadata keep the L1.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Like ld_stream16, also asking L2 to evict the line first (weights are never reused within
// one product; activations and the output are).
__device__ __forceinline__ uint4 ld_stream16_evict_first(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::evict_first.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Programmatic dependent launch (src/graph.rs): wait until the previous kernel of the graph has
// completed and its writes are visible, then let the next kernel launch so that its launch
// overlaps this one. Every kernel calls this first, before it touches global memory; both
// instructions are no-ops when the launch has no programmatic edge.
// Kernels with work that reads only their own static operands (weights, format metadata) do
// that first: pdl_release(), the static loads, then pdl_wait() before the first read of an
// activation or any write.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_then_release() {
    pdl_wait();
    pdl_release();
}

// L2 prefetch of static data a later kernel reads (the decode step's next weight product, see
// L2Span in src/product.rs): the span is cut into 32 KB pieces dealt to the blocks in turn
// (piece i to block i % blocks), one bulk prefetch (cp.async.bulk.prefetch, sm_90) per piece.
// Dealt by block, not by thread: an SM issues its bulk prefetches one after another, so 26 MB
// from the first 4 blocks of a launch took ~24 us (H100, 2026-12-07: docs/BENCHMARKS.md), and
// the launchers give a kernel that carries a span at least one block per SM. Nothing waits for it and
// nothing reads it here, so the kernels that carry it issue it before pdl_wait(): the bytes
// stream from DRAM while this small kernel and its predecessor's tail run, time in which the
// step reads no weights. `p` is 16-byte aligned (a device allocation); a piece's length is
// rounded down to a multiple of 16 as the instruction requires.
__device__ __forceinline__ void prefetch_span_l2(const char* p, unsigned long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (p == nullptr || bytes < 16) return;
    const unsigned long long piece = 32768;
    const unsigned long long per_block = (unsigned long long)blockDim.x * blockDim.y * blockDim.z;
    const unsigned long long threads = (unsigned long long)gridDim.x * gridDim.y * gridDim.z * per_block;
    const unsigned long long block = ((unsigned long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const unsigned long long blocks = threads / per_block;
    const unsigned long long tid = ((threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x) * blocks + block;
    for (unsigned long long off = tid * piece; off < bytes; off += threads * piece) {
        const unsigned long long left = bytes - off;
        const u32 n = (u32)((left < piece ? left : piece) & ~15ull);
        if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
    }
#endif
}

// TEAL activation mask: an input is active when |x| > t. t < 0 makes every input active.
__device__ __forceinline__ bool active(float x, float t) { return fabsf(x) > t; }

// Asynchronous global->shared copies (Ampere+), 16 bytes each; src_bytes < 16 zero-fills.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
    return s;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    u32 s = smem_addr(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    u32 s = smem_addr(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
    u32 s = smem_addr(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Fused output zeroing (dense_colmajor, tcbc_spmspv_lane8): the first block of a row tile
// zeroes its rows of y and publishes the launch's epoch in flags[tile] with a release store;
// the tile's other blocks spin on an acquire load of that flag before adding to y.
__device__ __forceinline__ void store_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Called by every thread of the zeroing block after its zero stores.
__device__ __forceinline__ void publish_zeroed_tile(u32* flag, u32 epoch) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) store_release(flag, epoch);
}
// Called by every thread of the other blocks before their atomics.
__device__ __forceinline__ void wait_zeroed_tile(const u32* flag, u32 epoch) {
    if (threadIdx.x == 0)
        while (load_acquire(flag) != epoch) {
        }
    __syncthreads();
}

// Inclusive prefix sum over the 32 lanes of a warp.
__device__ __forceinline__ u32 warp_inclusive_scan(u32 v, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        u32 n = __shfl_up_sync(FULL_MASK, v, d);
        if (lane >= d) v += n;
    }
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL_MASK, v, d);
    return v;
}

// PTX helpers of the tensor-core kernels (dense_lowbit_gemv.cu, ie_bme_spmm.cu).
__device__ __forceinline__ u32 sub_f16x2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 fma_f16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// (a & b) | c in one LOP3.
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// D = A · B + D for one m16n8k16 tile: f16 A (4 registers of f16x2, row-major) and B (2, column-
// major), f32 accumulators.
__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared-memory loads and cp.async copies at 32-bit shared addresses (tiled_cbc_spmspv,
// persistent_step: a `struct` or generic pointer would make the compiler rebuild 64-bit
// addresses for every access).
__device__ __forceinline__ u32 lds_u16(u32 addr) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ u32 lds_u8(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ u32 lds_u32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ uint4 lds_u32x4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ uint2 lds_u32x2(u32 addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}
__device__ __forceinline__ void cp_async16_s(u32 saddr, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr), "l"(gmem));
}
__device__ __forceinline__ void cp_async8_s(u32 saddr, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(saddr), "l"(gmem));
}
