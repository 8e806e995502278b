// Dense low-bit GEMV / small GEMM: Y (N x M, f32) = X (N x K, f16) · Wᵀ, W quantized,
// N = 1..32 tokens, dequantized in registers and multiplied on the tensor cores
// (mma.sync m16n8k16, f16 inputs, f32 accumulation). Ten weight kinds (src/lowbit.rs):
//
//   kind         value of W[r][k]                        scale (and min)            from
//   w4 g128      s[r][k / 128] · (u - 8), u in 0..15     f16 per row and 128 columns sieve's W4A16
//   w4 g32       s[r][k / 32]  · (u - 8)                 f16 per row and 32 columns  GGUF Q4_0
//   w8 row       s[r] · (u - 128), u in 0..255           f32 per row                 sieve's W8A16
//   w8 g32       s[r][k / 32]  · (u - 128)               f16 per row and 32 columns  GGUF Q8_0
//   w4 g32 a     s[r][k / 32] · u - m[r][k / 32]         f16 s and m per 32 columns  GGUF Q4_1
//   w5 g32       s[r][k / 32]  · (u - 16), u in 0..31    f16 per row and 32 columns  GGUF Q5_0
//   w5 g32 a     s[r][k / 32] · u - m[r][k / 32]         f16 s and m per 32 columns  GGUF Q5_1
//   w4 k         d sc[g] · u - dmin mc[g], g = k / 32    f16 d, dmin per 256 columns GGUF Q4_K
//   w5 k         the same with 5-bit u                   and 6-bit sc, mc per 32     GGUF Q5_K
//   w6 k         d sc[g] · (u - 32), g = k / 16          f16 d per 256, i8 sc per 16 GGUF Q6_K
//
// (Symmetric kinds have the fixed zero points 8, 16, 32, 128, as GPTQ's symmetric mode and
// Q4_0 / Q5_0 / Q6_K. The K kinds keep GGUF's two levels: an f16 d (and dmin) per row and
// 256-column super-block times a small integer code per group, multiplied in f32 in the kernel,
// where d · sc is exact: an f16 has 11 significant bits, a code at most 8. Rounding d · sc to
// f16 instead moved the logits of a tiny Q5_K model by 0.72: docs/BENCHMARKS.md.)
//
// Device layout (built at upload, src/lowbit.rs `device_layout`): rows padded to Mp = 16 n,
// columns to Kp = 128 n, 256 n for the K kinds (padding: value 0, scale 0). Row tile rt = rows 16 rt .. 16 rt + 15;
// k tile = 16 columns. The mma's A fragment of one (row tile, k tile), for lane (g = lane / 4,
// c = lane % 4), is the 8 elements
//
//      e0 (g, 2c)    e1 (g, 2c+1)    e2 (g+8, 2c)    e3 (g+8, 2c+1)
//      e4 (g, 2c+8)  e5 (g, 2c+9)    e6 (g+8, 2c+8)  e7 (g+8, 2c+9)      (row, k slot in tile)
//
// x blocks: k slots are not columns in order. The chunk's k tiles form blocks of P tiles (P =
// tiles per scale group, at most the chunk's: 1 for w6 k, 4 for w4 g128, else 2),
// and in tile j of a block, lane group c's slots 2c, 2c+1, 2c+8, 2c+9 hold the block's columns
// 4Pc + 4j .. 4Pc + 4j + 3 (src/lowbit.rs `fragment_column`). So a lane's activations of a
// block are 4P consecutive halves, one 8- or 16-byte load, where the natural order needs two
// 4-byte loads per k tile; a block stays inside its scale group.
//
//   4-bit: one u32, e(2i) in bits 4i..4i+3, e(2i+1) in bits 16+4i..19+4i, so that
//          ((word >> 4i) & 0x000f000f) | 0x64006400 is the f16 pair (1024 + e(2i), 1024 + e(2i+1))
//          and one f16x2 subtraction of (1032, 1032) gives the exact values u - 8: A register i
//          (registers 1 and 3 are read in place at bits 4..7 instead: lb_frag4);
//   8-bit: two u32, bytes e0..e3 then e4..e7; a PRMT with 0x64 bytes makes (1024 + u, 1024 + u')
//          and a subtraction of 1152 gives u - 128.
//   5- and 6-bit: the low nibbles as the 4-bit word, the HB = 1 or 2 high bits in a second
//          plane (below), OR-ed in at bit 4 (bit 8 for registers 1 and 3: lb_frag_hi).
//
// A chunk is 512 bytes: 32 lanes x 16 bytes, lane l's uint4 = its fragments of 4 consecutive
// k tiles (4-bit: 16 rows x 64 columns) or 2 (8-bit: 16 rows x 32 columns). The chunks of a
// row tile follow each other along k, the row tiles one after the other:
//
//      chunk (rt, kc) at byte 512 (rt · chunks + kc);  lane l reads bytes 16 l .. 16 l + 15
//      | l0 | l1 | l2 | ... | l31 |   one coalesced 128-bit load per lane, no other weight bytes
//
// High plane (5- and 6-bit kinds): HB u32 words per lane and chunk, at word HB (32 (rt · chunks
// + kc) + l). k tile j of the chunk has its field at bit 4 j (HB = 1) or in word j / 2 at bit 8 (j % 2)
// (HB = 2); within a field, element e(2i)'s high bits sit at bit HB i, e(2i+1)'s at 16 + HB i.
//
// Group scales (f16 kinds): one u32 per (row tile, group, g) = f16 pair (s[16rt+g], s[16rt+g+8]),
// at ((rt · groups + group) · 8 + g): a lane loads the scales of its two rows with one 4-byte load.
// Group mins (affine kinds): the same pairs, same index. Row scales (w8 row): f32 [Mp].
// K kinds: per (row tile, super-block sb, word j = 0..7, g) one u32 of codes at
// ((rt · supers + sb) · 8 + j) · 8 + g: w4 k / w5 k bytes (sc, sc', mc, mc') of group 8 sb + j,
// w6 k bytes (sc, sc') of group 16 sb + 2 j, then of 16 sb + 2 j + 1 (' = row g + 8), each the
// i8 code biased by 128 (sc + 128 as u8, so one PRMT and one exact FADD give sc in f32); the f16
// pairs (d, d') at (rt · supers + sb) · 8 + g in `sscales`, (dmin, dmin') in `gmins`.
//
// Thread mapping: persistent blocks (the grid is at most what stays resident), block b taking
// row tiles b, b + grid, ...; per row tile, LB_WARPS = 8 warps splitting its K chunks into
// contiguous ranges of whole scale groups (split-K inside the block, reduced in shared memory:
// no atomics, no zeroing, each output written once). A warp streams its chunks in stages of
// LB_BATCH = 4 (the loads of stage s + 1 and of its scales are issued before stage s is used:
// 4 KB in flight per warp; across a tile boundary the next tile's first stage is in flight
// while the current one is reduced). Per k tile: dequantize the A fragment (4-bit: 5 SHF/LOP3 + 4
// HSUB2), then per 8-token n tile load the B fragment (x[n = 8 nt + g][k0 + 2c, +1] and
// [k0 + 2c + 8, +9] in the x-block order above, loaded per chunk) and one mma. Group kinds
// accumulate a group's mmas in `part`, then add part · scale of its row to `acc`: values are the
// integers u - zero exactly, so the product differs from the CPU reference only by f32 rounding.
// Affine kinds also sum the group's x per token (one more mma, A all ones) and add -m · sum.
// w6 k adds part · sc per 16 columns to `sacc` and d · sacc to `acc` per super-block.
// N tiles: NT = ceil(N / 8) per kernel instance (NT = 1 serves N = 1..8: the tensor cores have
// the spare throughput; the weight bytes bound N <= 8). K kinds split K in whole super-blocks,
// one per stage: a stage loads its 8 code words and d (dmin) pairs beside its weights.
// x is N x ldx f16 (ldx >= Kp, columns K .. Kp zero), y N x ldy f32; `accumulate` adds to y.

// Overridable for tuning experiments (dev/lowbit-tune, results in its README); the library
// uses the defaults. Blocks per SM (the launch bounds' minimum) is chosen per kind there:
// W4A16 g128 runs best at 3 for one n tile, everything else at 2 (LB_KERNELS_BY_NT below).
#ifndef LB_WARPS
#define LB_WARPS 8
#endif
#ifndef LB_BATCH
#define LB_BATCH 4
#endif
#ifndef LB_MIN_BLOCKS_W4G128
#define LB_MIN_BLOCKS_W4G128 3
#endif
#ifndef LB_MIN_BLOCKS
#define LB_MIN_BLOCKS 2
#endif

// 4-bit fragment word -> 4 A registers of exact f16 values u - Z (Z = 8, or 0 for affine kinds).
// Registers 0 and 2 take their nibbles at bits 0-3 (of each half: 1024 + u after the OR with
// the f16 exponent of 1024), registers 1 and 3 theirs at bits 4-7 where they read 1024 + 16 u,
// brought back by one f16x2 FMA with 1/16: 5 LOP3/SHF and 4 f16x2 ops for 8 weights, no shift
// per register. Every step is exact (integers below 2048 and powers of two).
template <int Z>
__device__ __forceinline__ void lb_frag4(u32 w, u32 a[4]) {
    constexpr u32 sub = (0x6400u + Z) * 0x10001u;             // 1024 + Z
    constexpr u32 sixteenth = 0x2c002c00u;                     // 1/16
    constexpr u32 neg = (0xd400u + 16 * Z) * 0x10001u;         // -(64 + Z)
    const u32 ex = 0x64006400u;
    const u32 w8 = w >> 8;
    a[0] = sub_f16x2(and_or(w, 0x000f000fu, ex), sub);
    a[1] = fma_f16x2(and_or(w, 0x00f000f0u, ex), sixteenth, neg);
    a[2] = sub_f16x2(and_or(w8, 0x000f000fu, ex), sub);
    a[3] = fma_f16x2(and_or(w8, 0x00f000f0u, ex), sixteenth, neg);
}

// 5- or 6-bit fragment: the low nibbles as lb_frag4 (registers 1 and 3 in place at bits 4-7,
// reading 1024 + 16 u), the HB = BITS - 4 high bits of the k tile from `t` (the tile's field
// shifted down to bit 0: register i's pair at bits HB i and 16 + HB i) moved by one shift each
// to bit 4 (registers 0, 2) or bit 8 (registers 1, 3, where 16 u puts them) and merged by one
// LOP3; exact f16 values u - Z (every intermediate an integer below 2048).
template <int HB, int Z>
__device__ __forceinline__ void lb_frag_hi(u32 w, u32 t, u32 a[4]) {
    constexpr u32 sub = (0x6400u + Z) * 0x10001u;      // 1024 + Z
    constexpr u32 sixteenth = 0x2c002c00u;              // 1/16
    constexpr u32 neg = (0xd400u + 16 * Z) * 0x10001u;  // -(64 + Z)
    constexpr u32 hm = (1u << HB) - 1;
    constexpr u32 at4 = (hm << 4) * 0x10001u, at8 = (hm << 8) * 0x10001u;
    const u32 ex = 0x64006400u;
    const u32 w8 = w >> 8;
    a[0] = sub_f16x2(and_or(t << 4, at4, and_or(w, 0x000f000fu, ex)), sub);
    a[1] = fma_f16x2(and_or(t << (8 - HB), at8, and_or(w, 0x00f000f0u, ex)), sixteenth, neg);
    a[2] = sub_f16x2(and_or(t << (4 - 2 * HB), at4, and_or(w8, 0x000f000fu, ex)), sub);
    a[3] = fma_f16x2(and_or(t << (8 - 3 * HB), at8, and_or(w8, 0x00f000f0u, ex)), sixteenth, neg);
}

// 8-bit fragment words -> 4 A registers of exact f16 values u - 128.
__device__ __forceinline__ void lb_frag8(u32 w0, u32 w1, u32 a[4]) {
    a[0] = sub_f16x2(prmt(w0, 0x64646464u, 0x4140u), 0x64806480u);
    a[1] = sub_f16x2(prmt(w0, 0x64646464u, 0x4342u), 0x64806480u);
    a[2] = sub_f16x2(prmt(w1, 0x64646464u, 0x4140u), 0x64806480u);
    a[3] = sub_f16x2(prmt(w1, 0x64646464u, 0x4342u), 0x64806480u);
}

// k tile j's A fragment (exact f16 values u - Z) of a chunk: `words` the lane's 4 weight
// words, `hb` its HW high-plane words (5- and 6-bit kinds).
template <int BITS, int Z, int HW>
__device__ __forceinline__ void lb_frag(const u32 words[4], const u32* hb, int j, u32 a[4]) {
    if (BITS == 4)
        lb_frag4<Z>(words[j], a);
    else if (BITS == 8)
        lb_frag8(words[2 * j], words[2 * j + 1], a);
    else if (BITS == 5)
        lb_frag_hi<1, Z>(words[j], hb[0] >> (4 * j), a);
    else
        lb_frag_hi<2, Z>(words[j], hb[(j >> 1) % HW] >> (8 * (j & 1)), a);
}

// Byte i of w as an exact f32 without I2F (a quarter-rate conversion on sm_90): the byte is
// placed in the mantissa of 2^23 and 2^23 is subtracted.
// BIAS is subtracted in the same (exact) FADD: the code bytes of w6 k are sc + 128.
template <int BIAS = 0>
__device__ __forceinline__ float lb_byte_f32(u32 w, int i) {
    return __uint_as_float(prmt(w, 0x4b000000u, 0x7650u | i)) - (8388608.f + BIAS);
}

// BITS: 4, 5, 6 or 8. GROUP: columns per scale (0: one f32 scale per row). AFFINE: value
// s · u - m with u unsigned (zero point 0) and a per-group min m; else s · (u - Z). SUPER: the
// K kinds' two-level scales (d · code per group). NT: 8-token n tiles.
template <int BITS, int GROUP, bool AFFINE, bool SUPER, int NT>
__device__ __forceinline__ void lowbit_kernel(const uint4* __restrict__ w, const u32* __restrict__ hi,
                                              const u32* __restrict__ gscales, const u32* __restrict__ gmins,
                                              const u32* __restrict__ sscales, const float* __restrict__ rscales,
                                              const f16_bits* __restrict__ x,
                                              int ldx, float* __restrict__ y, int ldy, int M, int N, int chunks,
                                              int accumulate) {
    constexpr int HB = BITS == 5 ? 1 : BITS == 6 ? 2 : 0;  // high bits beside the nibble plane
    constexpr int Z = AFFINE ? 0 : BITS == 4 ? 8 : BITS == 5 ? 16 : 32;
    constexpr int KTC = BITS == 8 ? 2 : 4;               // k tiles per chunk
    constexpr int CK = 16 * KTC;                         // columns per chunk
    constexpr int KPG = GROUP / 16;                      // k tiles per scale group (0: row scale)
    // chunks per step: whole groups, or whole super-blocks (K kinds)
    constexpr int CPS = SUPER ? 256 / CK : GROUP > CK ? GROUP / CK : 1;
    constexpr int U = LB_BATCH;                          // chunks per stage (a multiple of CPS)
    constexpr int SUPS = SUPER ? U * CK / 256 : 1;       // super-blocks per stage (K kinds)
    // scale words per stage: group pairs, or 8 code words per super-block
    constexpr int SPS = SUPER ? 8 * SUPS : GROUP ? (U * CK) / GROUP : 1;
    constexpr int HW = HB ? HB : 1;                      // high-plane words per lane and chunk
    // k tiles per x block (the layout's column permutation stays inside a scale group)
    constexpr int P = GROUP && KPG < KTC ? KPG : KTC;
    static_assert(U % CPS == 0, "a stage holds whole groups and super-blocks");
    static_assert(!AFFINE || GROUP, "affine kinds have group scales");
    static_assert(!SUPER || (GROUP && 256 % GROUP == 0), "K kinds' groups tile a super-block");
    // Two reduction buffers, by row-tile parity: a block's next tile writes its partial sums
    // while the current tile's are still being read.
    __shared__ float red[2][LB_WARPS][NT * 8][17];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int tiles = (M + 15) >> 4;
    const int steps = chunks / CPS;
    const int spw = (steps + LB_WARPS - 1) / LB_WARPS;
    const int c0 = min(warp * spw, steps) * CPS;
    const int c1 = min((warp + 1) * spw, steps) * CPS;
    const int groups = GROUP ? chunks * CK / GROUP : 1;

    uint4 buf[2][U];
    u32 hb[2][U][HW];
    // sb: scale pairs or code words; mb: min pairs (affine) or dmin pairs (K affine); db: d pairs
    u32 sb[2][SPS], mb[2][AFFINE ? (SUPER ? SUPS : SPS) : 1], db[2][SUPER ? SUPS : 1];
    auto fetch = [&](int st, int rt, int cb) {
        const uint4* wp = w + (size_t)rt * chunks * 32 + lane;
        const u32* hp = hi + ((size_t)rt * chunks * 32 + lane) * HW;
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (cb + u < c1) {
                buf[st][u] = ld_stream16(wp + (size_t)(cb + u) * 32);
                if (HB) {
#pragma unroll
                    for (int h = 0; h < HW; ++h) hb[st][u][h] = __ldg(hp + (size_t)(cb + u) * 32 * HW + h);
                }
            }
        if (SUPER) {
            const int supers = chunks * CK / 256;
            const int s0 = cb * CK / 256;
#pragma unroll
            for (int q = 0; q < SUPS; ++q) {
                if ((s0 + q) * 256 < c1 * CK) {
                    const size_t at = (size_t)rt * supers + s0 + q;
#pragma unroll
                    for (int j = 0; j < 8; ++j) sb[st][8 * q + j] = __ldg(gscales + (at * 8 + j) * 8 + g);
                    db[st][SUPER ? q : 0] = __ldg(sscales + at * 8 + g);
                    if (AFFINE) mb[st][AFFINE ? q : 0] = __ldg(gmins + at * 8 + g);
                }
            }
        } else if (GROUP) {
            const u32* sp = gscales + (size_t)rt * groups * 8 + g;
            const u32* mp = gmins + (size_t)rt * groups * 8 + g;
#pragma unroll
            for (int s = 0; s < SPS; ++s) {
                const int grp = cb * CK / (GROUP ? GROUP : 1) + s;
                if (grp * GROUP < c1 * CK) {
                    sb[st][s] = __ldg(sp + (size_t)grp * 8);
                    if (AFFINE) mb[st][AFFINE ? s : 0] = __ldg(mp + (size_t)grp * 8);
                }
            }
        }
    };

    // part: the current group's integer products; xs (affine kinds): the group's sums of x
    // per token, from one more mma with an all-ones A (the tensor cores have the spare issue).
    // sacc (w6 k): the super-block's sum of part · sc, multiplied by d once per super-block
    // rather than once per 16 columns (two FMULs per k tile saved; f32 rounding only).
    constexpr bool FACTOR_D = SUPER && !AFFINE;
    float acc[NT][4], part[NT][4], xs[NT][4], sacc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = part[nt][i] = xs[nt][i] = sacc[nt][i] = 0.f;
    const u32 ones[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};

    auto compute = [&](int st, int cb) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (cb + u >= c1) break;
            const u32 words[4] = {buf[st][u].x, buf[st][u].y, buf[st][u].z, buf[st][u].w};
            // The chunk's B fragments: per x block, lane group c's 4 P halves are contiguous
            // (the layout's column permutation), one 8- or 16-byte load per block (two for
            // P = 4). Rows n >= N read row N - 1: their mma columns are never stored, so no
            // predicate and no zeroing.
            u32 bx[NT][2 * KTC];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const f16_bits* xr = x + (size_t)min(nt * 8 + g, N - 1) * ldx + (cb + u) * CK + 4 * P * c;
#pragma unroll
                for (int bk = 0; bk < KTC / P; ++bk) {
                    if (P == 1) {
                        const uint2 v = __ldg(reinterpret_cast<const uint2*>(xr + 16 * bk));
                        bx[nt][2 * bk] = v.x;
                        bx[nt][2 * bk + 1] = v.y;
                    } else {
#pragma unroll
                        for (int h = 0; h < P / 2; ++h) {
                            const uint4 v = __ldg(reinterpret_cast<const uint4*>(xr + 16 * P * bk + 8 * h));
                            bx[nt][2 * P * bk + 4 * h] = v.x;
                            bx[nt][2 * P * bk + 4 * h + 1] = v.y;
                            bx[nt][2 * P * bk + 4 * h + 2] = v.z;
                            bx[nt][2 * P * bk + 4 * h + 3] = v.w;
                        }
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < KTC; ++j) {
                u32 a[4];
                lb_frag<BITS, Z, HW>(words, hb[st][u], j, a);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const u32 b0 = bx[nt][2 * j], b1 = bx[nt][2 * j + 1];
                    mma_16816(GROUP ? part[nt] : acc[nt], a, b0, b1);
                    if (AFFINE) mma_16816(xs[nt], ones, b0, b1);
                }
                if (GROUP) {
                    constexpr int kpg = KPG ? KPG : 1;
                    const int t = u * KTC + j;  // k tile within the stage (stages start on a group)
                    if ((t + 1) % kpg == 0) {
                        const int s = (t * 16) / (GROUP ? GROUP : 1);
                        float s_lo, s_hi, m_lo = 0.f, m_hi = 0.f;
                        if (SUPER) {
                            // d · code in f32: exact (the header says why).
                            const int q = (t * 16) / 256;                        // super-block in the stage
                            const int gs = s - q * (256 / (GROUP ? GROUP : 1));  // group in it
                            if (AFFINE) {
                                const u32 d2 = db[st][SUPER ? q : 0];
                                const float d_lo = h2f((unsigned short)(d2 & 0xffffu));
                                const float d_hi = h2f((unsigned short)(d2 >> 16));
                                const u32 code = sb[st][8 * q + gs];
                                const u32 m2 = mb[st][AFFINE ? q : 0];
                                s_lo = d_lo * lb_byte_f32(code, 0);
                                s_hi = d_hi * lb_byte_f32(code, 1);
                                m_lo = -h2f((unsigned short)(m2 & 0xffffu)) * lb_byte_f32(code, 2);
                                m_hi = -h2f((unsigned short)(m2 >> 16)) * lb_byte_f32(code, 3);
                            } else {
                                // sc alone (d comes in at the super-block's end, below).
                                const u32 code = sb[st][8 * q + gs / 2];
                                s_lo = lb_byte_f32<128>(code, 2 * (gs & 1));
                                s_hi = lb_byte_f32<128>(code, 2 * (gs & 1) + 1);
                            }
                        } else {
                            const u32 s2 = sb[st][s];
                            s_lo = h2f((unsigned short)(s2 & 0xffffu));
                            s_hi = h2f((unsigned short)(s2 >> 16));
                            if (AFFINE) {
                                const u32 m2 = mb[st][AFFINE ? s : 0];
                                m_lo = -h2f((unsigned short)(m2 & 0xffffu));
                                m_hi = -h2f((unsigned short)(m2 >> 16));
                            }
                        }
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            float* dst = FACTOR_D ? sacc[nt] : acc[nt];
                            dst[0] = fmaf(part[nt][0], s_lo, dst[0]);
                            dst[1] = fmaf(part[nt][1], s_lo, dst[1]);
                            dst[2] = fmaf(part[nt][2], s_hi, dst[2]);
                            dst[3] = fmaf(part[nt][3], s_hi, dst[3]);
                            if (AFFINE) {
                                acc[nt][0] = fmaf(xs[nt][0], m_lo, acc[nt][0]);
                                acc[nt][1] = fmaf(xs[nt][1], m_lo, acc[nt][1]);
                                acc[nt][2] = fmaf(xs[nt][2], m_hi, acc[nt][2]);
                                acc[nt][3] = fmaf(xs[nt][3], m_hi, acc[nt][3]);
                            }
#pragma unroll
                            for (int i = 0; i < 4; ++i) part[nt][i] = xs[nt][i] = 0.f;
                        }
                        if (FACTOR_D && (t + 1) % 16 == 0) {
                            // The super-block's end (16 k tiles): acc += d · sacc.
                            const u32 d2 = db[st][SUPER ? t / 16 : 0];
                            const float d_lo = h2f((unsigned short)(d2 & 0xffffu));
                            const float d_hi = h2f((unsigned short)(d2 >> 16));
#pragma unroll
                            for (int nt = 0; nt < NT; ++nt) {
                                acc[nt][0] = fmaf(sacc[nt][0], d_lo, acc[nt][0]);
                                acc[nt][1] = fmaf(sacc[nt][1], d_lo, acc[nt][1]);
                                acc[nt][2] = fmaf(sacc[nt][2], d_hi, acc[nt][2]);
                                acc[nt][3] = fmaf(sacc[nt][3], d_hi, acc[nt][3]);
#pragma unroll
                                for (int i = 0; i < 4; ++i) sacc[nt][i] = 0.f;
                            }
                        }
                    }
                }
            }
        }
    };

    // One row tile's end: row scales (w8 row), the warps' partial sums through shared memory,
    // each output written once.
    auto finish = [&](int rt, int par) {
        if (!GROUP) {
            const float s_lo = __ldg(rscales + 16 * rt + g), s_hi = __ldg(rscales + 16 * rt + g + 8);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                acc[nt][0] *= s_lo;
                acc[nt][1] *= s_lo;
                acc[nt][2] *= s_hi;
                acc[nt][3] *= s_hi;
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            red[par][warp][nt * 8 + 2 * c][g] = acc[nt][0];
            red[par][warp][nt * 8 + 2 * c + 1][g] = acc[nt][1];
            red[par][warp][nt * 8 + 2 * c][g + 8] = acc[nt][2];
            red[par][warp][nt * 8 + 2 * c + 1][g + 8] = acc[nt][3];
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < NT * 8 * 16; i += blockDim.x) {
            const int n = i >> 4, r = i & 15;
            const int row = 16 * rt + r;
            if (n >= N || row >= M) continue;
            float s = 0.f;
#pragma unroll
            for (int q = 0; q < LB_WARPS; ++q) s += red[par][q][n][r];
            float* o = y + (size_t)n * ldy + row;
            *o = accumulate ? *o + s : s;
        }
    };

    // Persistent blocks: block b takes row tiles b, b + grid, b + 2 grid, ... (grid = tiles gives
    // one tile per block). Each warp walks the stages of its chunk range tile after tile, and the
    // first stage of its next tile is fetched before the current tile's last stage is used and
    // reduced, so the loads stay in flight across tile boundaries. A warp with an empty range
    // still takes part in every tile's reduction.
    auto next = [&](int& rt, int& cb) {
        cb += U;
        if (cb >= c1) {
            cb = c0;
            rt += gridDim.x;
        }
    };
    int rt = blockIdx.x, cb = c0, par = 0;
    // Weights and scales are never written by another kernel: the first stage is fetched
    // while a programmatic predecessor finishes.
    pdl_release();
    if (rt < tiles) fetch(0, rt, cb);
    pdl_wait();
    while (rt < tiles) {
        int rn = rt, cn = cb;
        next(rn, cn);
        if (rn < tiles) fetch(1, rn, cn);
        compute(0, cb);
        if (rn != rt) {
            finish(rt, par);
            par ^= 1;
        }
        rt = rn;
        cb = cn;
        if (rt >= tiles) break;
        next(rn, cn);
        if (rn < tiles) fetch(0, rn, cn);
        compute(1, cb);
        if (rn != rt) {
            finish(rt, par);
            par ^= 1;
        }
        rt = rn;
        cb = cn;
    }
}

#define LB_ARGS                                                                                   \
    const uint4 *__restrict__ w, const u32 *__restrict__ hi, const u32 *__restrict__ gscales,     \
        const u32 *__restrict__ gmins, const u32 *__restrict__ sscales,                           \
        const float *__restrict__ rscales, const f16_bits *__restrict__ x, int ldx,               \
        float *__restrict__ y, int ldy, int M, int N, int chunks, int accumulate
#define LB_PASS w, hi, gscales, gmins, sscales, rscales, x, ldx, y, ldy, M, N, chunks, accumulate
#define LB_KERNEL(NAME, BITS, GROUP, AFFINE, SUPER, NT, MINB)                                  \
    extern "C" __global__ void __launch_bounds__(32 * LB_WARPS, MINB) NAME##_nt##NT(LB_ARGS) { \
        lowbit_kernel<BITS, GROUP, AFFINE, SUPER, NT>(LB_PASS);                               \
    }
#define LB_KERNELS(NAME, BITS, GROUP, AFFINE, SUPER, MINB) \
    LB_KERNELS_BY_NT(NAME, BITS, GROUP, AFFINE, SUPER, MINB, MINB)
// MINB1 blocks per SM for one n tile, MINB for two to four. W4A16 g128 runs best at 3 for
// N <= 8, but 3 blocks leave 80 registers a thread and its NT = 2..4 instances spilled there
// (612 bytes of spill stores at NT = 4); at 2 they spill nothing and run 1.5-1.7x faster at
// 32 tokens (H100, 2026-12-06: docs/BENCHMARKS.md, "the low-bit kernel above 8 tokens").
#define LB_KERNELS_BY_NT(NAME, BITS, GROUP, AFFINE, SUPER, MINB1, MINB) \
    LB_KERNEL(NAME, BITS, GROUP, AFFINE, SUPER, 1, MINB1)               \
    LB_KERNEL(NAME, BITS, GROUP, AFFINE, SUPER, 2, MINB)                \
    LB_KERNEL(NAME, BITS, GROUP, AFFINE, SUPER, 3, MINB)                \
    LB_KERNEL(NAME, BITS, GROUP, AFFINE, SUPER, 4, MINB)
LB_KERNELS_BY_NT(lowbit_w4g128, 4, 128, false, false, LB_MIN_BLOCKS_W4G128, LB_MIN_BLOCKS)
LB_KERNELS(lowbit_w4g32, 4, 32, false, false, LB_MIN_BLOCKS)
LB_KERNELS(lowbit_w8row, 8, 0, false, false, LB_MIN_BLOCKS)
LB_KERNELS(lowbit_w8g32, 8, 32, false, false, LB_MIN_BLOCKS)
LB_KERNELS(lowbit_w4g32a, 4, 32, true, false, LB_MIN_BLOCKS)
LB_KERNELS(lowbit_w5g32, 5, 32, false, false, LB_MIN_BLOCKS)
LB_KERNELS(lowbit_w5g32a, 5, 32, true, false, LB_MIN_BLOCKS)
LB_KERNELS(lowbit_w4k, 4, 32, true, true, LB_MIN_BLOCKS)
LB_KERNELS(lowbit_w5k, 5, 32, true, true, LB_MIN_BLOCKS)
LB_KERNELS(lowbit_w6k, 6, 16, false, true, LB_MIN_BLOCKS)

// The matrix as f16 for the batched prefill above a few dozen tokens, where cuBLAS on the f16
// copy beats this file's kernel (it reloads every weight per 32 tokens): out (Mp x Kp,
// row-major) = each weight's value rounded to f16 once, the scale (and min) applied in f32 as
// the CPU's `dequantize` does (s · (u - Z), s · u - m, d · sc for the K kinds).
//
// One thread per (row tile, chunk, lane): it loads the lane's 16 bytes (and high-plane words),
// dequantizes each k tile's A fragment with the GEMV's own functions, and writes, per k tile,
// rows g and g + 8 at the 4 consecutive columns its fragment holds there
// (16 P (j / P) + 4 P c + 4 (j % P): `fragment_column`): one 8-byte store per row and tile.
// Registers 0 and 2 of a fragment are row g (slots 2c, 2c + 1 then 2c + 8, 2c + 9: columns
// +0, +1, +2, +3), registers 1 and 3 row g + 8.
template <int BITS, int GROUP, bool AFFINE, bool SUPER>
__device__ __forceinline__ void lowbit_to_f16_body(const uint4* __restrict__ w, const u32* __restrict__ hi,
                                                   const u32* __restrict__ gscales, const u32* __restrict__ gmins,
                                                   const u32* __restrict__ sscales, const float* __restrict__ rscales,
                                                   f16_bits* __restrict__ out, int tiles, int chunks) {
    constexpr int HB = BITS == 5 ? 1 : BITS == 6 ? 2 : 0;
    constexpr int Z = AFFINE ? 0 : BITS == 4 ? 8 : BITS == 5 ? 16 : 32;
    constexpr int KTC = BITS == 8 ? 2 : 4;
    constexpr int CK = 16 * KTC;
    constexpr int KPG = GROUP / 16;
    constexpr int P = GROUP && KPG < KTC ? KPG : KTC;
    constexpr int HW = HB ? HB : 1;
    pdl_wait_then_release();  // the previous GEMM may still read `out`
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tiles * chunks * 32) return;
    const int lane = (int)(i & 31);
    const size_t rest = i >> 5;
    const int kc = (int)(rest % chunks), rt = (int)(rest / chunks);
    const int g = lane >> 2, c = lane & 3;
    const int ldo = chunks * CK;
    const int r0 = rt * 16 + g;
    const uint4 wv = w[i];
    const u32 words[4] = {wv.x, wv.y, wv.z, wv.w};
    u32 hw[HW];
#pragma unroll
    for (int h = 0; h < HW; ++h) hw[h] = HB ? hi[i * HW + h] : 0u;
    u32 o[2][2 * KTC];  // per row (r0, r0 + 8): tile j's 4 values at words 2 j, 2 j + 1
#pragma unroll
    for (int j = 0; j < KTC; ++j) {
        u32 a[4];
        lb_frag<BITS, Z, HW>(words, hw, j, a);
        const int col = kc * CK + 16 * P * (j / P) + 4 * P * c + 4 * (j % P);
        // Scale s and min m of rows r0 (index 0) and r0 + 8 (index 1) at these 4 columns.
        float s[2], m[2] = {0.f, 0.f};
        if (SUPER) {
            const int at = rt * (ldo / 256) + col / 256;
            float d[2];
            unpack2(sscales[at * 8 + g], d[0], d[1]);
            if (AFFINE) {
                // Code word of group (col % 256) / 32: bytes sc, sc', mc, mc'.
                const u32 cw = gscales[(at * 8 + (col % 256) / 32) * 8 + g];
                float dm[2];
                unpack2(gmins[at * 8 + g], dm[0], dm[1]);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    s[h] = __fmul_rn(d[h], (float)((cw >> (8 * h)) & 0xffu));
                    m[h] = __fmul_rn(dm[h], (float)((cw >> (16 + 8 * h)) & 0xffu));
                }
            } else {
                // w6 k: word (col % 256) / 32 holds groups 2j (bytes 0, 1) and 2j + 1 (bytes 2, 3),
                // each code biased by 128.
                const int gl = (col % 256) / 16;
                const u32 cw = gscales[(at * 8 + gl / 2) * 8 + g] >> (16 * (gl & 1));
#pragma unroll
                for (int h = 0; h < 2; ++h) s[h] = __fmul_rn(d[h], (float)((int)((cw >> (8 * h)) & 0xffu) - 128));
            }
        } else if (GROUP) {
            const int at = (rt * (ldo / (GROUP ? GROUP : 1)) + col / (GROUP ? GROUP : 1)) * 8 + g;
            unpack2(gscales[at], s[0], s[1]);
            if (AFFINE) unpack2(gmins[at], m[0], m[1]);
        } else {
            s[0] = rscales[r0];
            s[1] = rscales[r0 + 8];
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float q[4];
            unpack2(a[h], q[0], q[1]);
            unpack2(a[h + 2], q[2], q[3]);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float lo = __fsub_rn(__fmul_rn(s[h], q[2 * e]), m[h]);
                const float hi2 = __fsub_rn(__fmul_rn(s[h], q[2 * e + 1]), m[h]);
                o[h][2 * j + e] = (u32)f2h(lo) | ((u32)f2h(hi2) << 16);
            }
        }
    }
    // The lane's columns of x block bk are 4P consecutive ones from 16 P bk + 4 P c: tile j of
    // the block wrote words 2 (j % P), +1 of them. One 8P-byte run per row and block (P = 4:
    // 32 bytes, a whole sector; 8-byte stores per tile filled a quarter of one each).
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int bk = 0; bk < KTC / P; ++bk) {
            f16_bits* dst = out + (size_t)(r0 + 8 * h) * ldo + kc * CK + 16 * P * bk + 4 * P * c;
            const u32* w = &o[h][2 * P * bk];
            if (P == 4) {
                reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
                reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
            } else if (P == 2) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
            } else {
                *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
            }
        }
}

// Grid: ceil(tiles · chunks · 32 / 256) blocks of 256 threads.
#define LB_TO_F16(NAME, BITS, GROUP, AFFINE, SUPER)                                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME##_to_f16(                                      \
        const uint4* __restrict__ w, const u32* __restrict__ hi, const u32* __restrict__ gscales,         \
        const u32* __restrict__ gmins, const u32* __restrict__ sscales, const float* __restrict__ rscales, \
        f16_bits* __restrict__ out, int tiles, int chunks) {                                               \
        lowbit_to_f16_body<BITS, GROUP, AFFINE, SUPER>(w, hi, gscales, gmins, sscales, rscales, out, tiles, \
                                                       chunks);                                            \
    }
LB_TO_F16(lowbit_w4g128, 4, 128, false, false)
LB_TO_F16(lowbit_w4g32, 4, 32, false, false)
LB_TO_F16(lowbit_w8row, 8, 0, false, false)
LB_TO_F16(lowbit_w8g32, 8, 32, false, false)
LB_TO_F16(lowbit_w4g32a, 4, 32, true, false)
LB_TO_F16(lowbit_w5g32, 5, 32, false, false)
LB_TO_F16(lowbit_w5g32a, 5, 32, true, false)
LB_TO_F16(lowbit_w4k, 4, 32, true, true)
LB_TO_F16(lowbit_w5k, 5, 32, true, true)
LB_TO_F16(lowbit_w6k, 6, 16, false, true)

// f32 activations (n rows of K, `ldin` apart) -> f16 (n x ldx, columns K .. ldx zero), each input
// kept only where it is active under the TEAL threshold t (|x| > t; t < 0 keeps all): the
// runner's activations into the low-bit kernels' input. The dense low-bit kernels read every
// column, so a threshold here gives the masked product's value, not a skip.
extern "C" __global__ void lowbit_x_to_f16(const float* __restrict__ x, f16_bits* __restrict__ out, int K,
                                           int ldin, int ldx, int n, float t) {
    pdl_wait_then_release();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * ldx) return;
    int row = i / ldx, k = i - row * ldx;
    float v = k < K ? x[(size_t)row * ldin + k] : 0.f;
    out[i] = active(v, t) ? f2h(v) : (f16_bits)0;
}
