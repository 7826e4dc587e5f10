/*
 * sq_fp8_kernel<DT, VK, PACK>: pack (dense fp32/bf16 -> fp8 page) and unpack (fp8 page -> dense)
 * of layers whose heads are all fp8 (kernels/format.h: e4m3 codes [K][V], one fp32 scale per tile
 * of 32 columns over all 128 rows), with 16-byte dense accesses and no shared staging. The fused
 * decode step of fp8 pages is the warp kernel's fp8 instantiation (dense_kernel.cuh).
 *
 * One 256-thread block per (entry, value head), grid (heads, batch). Thread group g = t / 64 (two
 * warps) owns fp8 tile g, columns 32g..32g+31 of every row, so a tile's absmax is one warp max, a
 * 64-thread named barrier (id 1 + g) and a shared pair: no block-wide barrier before the codes
 * leave, and one group's wait does not hold the others. Each thread holds 64 elements as NV
 * 16-byte dense vectors of W elements (fp32: 16 x 4, bf16: 8 x 8), laid out so that every warp
 * access of the dense side covers whole 128-byte lines and every warp access of the codes whole
 * 32-byte sectors (measured on the H200: half-sector code accesses from two warps made the [V,K]
 * pack L2-bound at 73% of copy bandwidth):
 *   [K,V]: 32/W lanes per tile row: lane l of the group holds columns 32g + W (l % (32/W)) + b
 *          (b < W) of rows l / (32/W) + 2W a (a < NV); a warp covers 4 (fp32) or 8 (bf16) tile
 *          rows, and the codes of vector a are W contiguous bytes of its row.
 *   [V,K]: W/2 column slots per row group: lane l holds rows W (l / (W/2)) + b of columns
 *          32g + NV (l % (W/2)) + a; a warp load covers 256 (fp32) or 128 (bf16) contiguous bytes
 *          of each of 2 or 4 columns, and the codes of each of the thread's W rows are its NV
 *          contiguous columns, which the lanes of one row group complete to the tile's sector.
 * 16-byte stores go through st.global.v4 (sq_st16, common.cuh): the compiler split some aggregate
 * ones.
 *
 * Exactness, as the reference (kernels/quant.c fit_fp8 / dequant_fp8) and checkasm's bytewise
 * pack compare: s = amax / 240 and x / s correctly rounded (sq_fp8_codes2 in common.cuh:
 * __fdiv_rn, or sq_div in SQ_FP8_PACK_SQDIV builds), the clamp to +-240 for fp32
 * sources (sq_e4m3x2 says why bf16 ones need none), then cvt.rn.satfinite.e4m3x2 on pairs (round
 * to nearest even, the sign of a zero kept); s = 0 keeps the codes +0. A non-finite dense element
 * becomes 0 before the fit (health STATE, one report per (entry, head) after a block-wide vote, as
 * every pack counts). The unpack is float(code) * s with one rounding (e4m3 -> f16 -> f32 is
 * exact); bf16 stores round to nearest even by cvt pairs, as the reference's unpack
 * (stepq__bf16_from_float: past bf16's range +-Inf; a NaN stays a NaN).
 *
 * The dense side needs 16-byte alignment of its base and stride (io.dense_vec); other tensors
 * keep the column kernel (layer.cu). PACK honours io.skip (stage 2 of the two-stage step).
 */
#ifndef STEPQ_KERNELS_CUDA_FP8_KERNEL_CUH
#define STEPQ_KERNELS_CUDA_FP8_KERNEL_CUH

#include <type_traits>

#include "kernels/cuda/common.cuh"

/*
 * Blocks per SM the fp8 pack and unpack are compiled for (registers: 65536 / (256 x this)): the
 * pack holds its 64 elements across the tile's barrier, the unpack only its 16 code words. The
 * fp32 pack at 3 blocks (80 registers) spilled 16-24 bytes and ran 2-5% slower than at 2 (H100,
 * B = 512: [K,V] 458-460 against 451-452 us, [V,K] 484-488 against 459-463; kernels/cuda/
 * README.md). The bf16 pack holds its 64 elements in 32 words (62-63 registers); with
 * SQ_FP8_PACK_SQDIV it is held to 4 blocks (64 registers): left free, the compiler took 128 for
 * the interleaved sq_div quotients.
 *
 * SQ_FP8_PACK_SQDIV (default 0): the pack's divisions by sq_div where the tile's scale allows
 * (sq_fp8_div_of). The fp8 decode step always takes them (dense_kernel.cuh: 9.8-10.3% faster);
 * the pack did not gain (H100, B = 512: fp32 sources within 1%, bf16 sources 1-6% slower at 4
 * blocks per SM; the same at 2 blocks per SM is not measured: AB_RUN.sh's variant packdiv2
 * sets SQ_F8BMIN_BLOCKS to 2; kernels/cuda/README.md).
 */
#ifndef SQ_FP8_PACK_SQDIV
#define SQ_FP8_PACK_SQDIV 0
#endif
#define SQ_F8MIN_BLOCKS 2
#ifndef SQ_F8BMIN_BLOCKS
#define SQ_F8BMIN_BLOCKS (SQ_FP8_PACK_SQDIV ? 4 : 2) /* the pack from bf16 */
#endif
#define SQ_F8UMIN_BLOCKS 4

static_assert(SQ_D / STEPQ__FP8_TILE == 4 && SQ_THREADS == 256,
              "sq_fp8_kernel: one 64-thread group per fp8 tile of a 128x128 head");

/* The geometry of a thread's 64 elements (see the header): NV vectors of W elements. */
template <int DT, bool VK> struct sq_f8geo {
    static constexpr int W = DT == SQ_F32 ? 4 : 8; /* elements per 16-byte vector */
    static constexpr int NV = 64 / W;              /* vectors per thread */
    /* [K,V]: lanes per tile row; [V,K]: lanes per row group, one per column slot */
    static constexpr int LPR = VK ? W / 2 : 32 / W;
};

/* The two codes of the low 16 bits of c as floats (exact through half2). */
__device__ __forceinline__ float2 sq_e4m3x2_f(uint32_t c)
{
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(c & 0xffffu), __NV_E4M3);
    return __half22float2(__half2(h));
}

/* N (4, 8 or 16) code bytes in N/4 words, stored at p (aligned to N). */
template <int N> __device__ __forceinline__ void sq_f8st(uint8_t *p, const uint32_t (&c)[4])
{
    if (N == 4)
        *(uint32_t *)p = c[0];
    else if (N == 8)
        *(uint2 *)p = make_uint2(c[0], c[1]);
    else
        sq_st16(p, c[0], c[1], c[2], c[3]);
}

template <int N> __device__ __forceinline__ void sq_f8ld(const uint8_t *p, uint32_t (&c)[4])
{
    if (N == 4) {
        c[0] = *(const uint32_t *)p;
    } else if (N == 8) {
        const uint2 u = *(const uint2 *)p;
        c[0] = u.x, c[1] = u.y;
    } else {
        const uint4 u = *(const uint4 *)p;
        c[0] = u.x, c[1] = u.y, c[2] = u.z, c[3] = u.w;
    }
}

/*
 * One (entry e, value head hv) per block, grid (heads, batch). DT: the dense side's dtype
 * (SQ_F32 or SQ_BF16), VK: its layout, PACK: dense -> page, else page -> dense.
 */
template <int DT, bool VK, bool PACK>
__global__ void __launch_bounds__(SQ_THREADS, !PACK           ? SQ_F8UMIN_BLOCKS
                                              : DT == SQ_BF16 ? SQ_F8BMIN_BLOCKS
                                                              : SQ_F8MIN_BLOCKS)
    sq_fp8_kernel(sq_io io)
{
    using G = sq_f8geo<DT, VK>;
    constexpr int W = G::W, NV = G::NV, LPR = G::LPR;
    const int hv = blockIdx.x, e = blockIdx.y, HV = gridDim.x;
    const int t = threadIdx.x, g = t >> 6, l = t & 63;
    const int32_t slot = io.slots ? io.slots[e] : e;
    if (slot < 0 || slot >= io.n_slots)
        return; /* uniform over the block */
    if (PACK && io.skip && io.skip[(size_t)e * HV + hv])
        return;

    const sq_head_desc *hd = io.heads + hv;
    uint8_t *blk = io.pages + (size_t)slot * io.page_stride + hd->block_off;
    float *scales = (float *)(blk + hd->tile_scale_off);
    const size_t off =
        (size_t)(io.dense_by_slot ? slot : e) * io.dense_stride + (size_t)hv * SQ_D * SQ_D;
    /* the thread's first element and the step between its vectors (see the header) */
    const int lo = l % LPR, hi = l / LPR;
    const int r0 = VK ? W * hi : hi, c0 = 32 * g + (VK ? NV * lo : W * lo);
    /* element (vector a, position b): [K,V] row r0 + 2W a, column c0 + b; [V,K] row r0 + b,
     * column c0 + a */
    const auto dense_at = [&](int a) -> size_t {
        return off + (VK ? (size_t)(c0 + a) * SQ_D + r0 : (size_t)(r0 + 2 * W * a) * SQ_D + c0);
    };

    if (PACK) {
        /*
         * Every load first: 16 / 8 independent 16-byte loads per thread. bf16 stays in its words
         * (32 registers instead of 64; widening is one operation, done where a value is used).
         */
        float x[DT == SQ_F32 ? NV : 1][W];
        uint32_t u[DT == SQ_BF16 ? NV : 1][W / 2];
#pragma unroll
        for (int a = 0; a < NV; a++) {
            if constexpr (DT == SQ_F32) {
                const float4 v = *(const float4 *)((const float *)io.dense + dense_at(a));
                x[a][0] = v.x, x[a][1] = v.y, x[a][2] = v.z, x[a][3] = v.w;
            } else {
                const uint4 v = *(const uint4 *)((const uint16_t *)io.dense + dense_at(a));
                u[a][0] = v.x, u[a][1] = v.y, u[a][2] = v.z, u[a][3] = v.w;
            }
        }
        const auto el = [&](int a, int b) -> float {
            if constexpr (DT == SQ_F32)
                return x[a][b];
            else
                return __uint_as_float(b & 1 ? u[a][b >> 1] & 0xffff0000u : u[a][b >> 1] << 16);
        };
        /* nf = sum x * 0 is NaN iff an element is not finite (then the rare pass zeroes them) */
        unsigned fl = 0;
        float m = 0.0f, nf = 0.0f;
#pragma unroll
        for (int a = 0; a < NV; a++)
#pragma unroll
            for (int b = 0; b < W; b++) {
                m = fmaxf(m, fabsf(el(a, b)));
                nf = fmaf(el(a, b), 0.0f, nf);
            }
        if (nf != 0.0f) {
            m = 0.0f;
#pragma unroll
            for (int a = 0; a < NV; a++)
#pragma unroll
                for (int b = 0; b < W; b++) {
                    if (!isfinite(el(a, b))) {
                        if constexpr (DT == SQ_F32)
                            x[a][b] = 0.0f;
                        else
                            u[a][b >> 1] &= b & 1 ? 0x0000ffffu : 0xffff0000u;
                    }
                    m = fmaxf(m, fabsf(el(a, b)));
                }
            fl = STEPQ_HEALTH_STATE;
        }
        const float sc = sq_fp8_tile_scale(m, g, l >> 5);
        const sq_fp8_div dv = sq_fp8_div_of<SQ_FP8_PACK_SQDIV != 0>(sc);
        /* the codes: [K,V] vector a is W bytes of one row; [V,K] row b is the NV columns */
        const auto emit = [&](auto fast) {
            constexpr bool FAST = decltype(fast)::value;
            if (!VK) {
#pragma unroll
                for (int a = 0; a < NV; a++) {
                    uint32_t c[4] = { 0, 0, 0, 0 };
                    if (sc > 0.0f) {
#pragma unroll
                        for (int b = 0; b < W; b += 2)
                            c[b >> 2] |=
                                sq_fp8_codes2<FAST, DT == SQ_F32>(dv, el(a, b), el(a, b + 1))
                                << (8 * (b & 3));
                    }
                    sq_f8st<W>(blk + (size_t)(r0 + 2 * W * a) * SQ_D + c0, c);
                }
            } else {
#pragma unroll
                for (int b = 0; b < W; b++) {
                    uint32_t c[4] = { 0, 0, 0, 0 };
                    if (sc > 0.0f) {
#pragma unroll
                        for (int a = 0; a < NV; a += 2)
                            c[a >> 2] |=
                                sq_fp8_codes2<FAST, DT == SQ_F32>(dv, el(a, b), el(a + 1, b))
                                << (8 * (a & 3));
                    }
                    sq_f8st<NV>(blk + (size_t)(r0 + b) * SQ_D + c0, c);
                }
            }
        };
        if (dv.fast) /* uniform over the tile's two warps */
            emit(std::true_type{});
        else
            emit(std::false_type{});
        if (l == 0)
            scales[g] = sc;
        /* alignment padding after the scales (a block_align above 16), written as 0 */
        for (uint32_t n = hd->tile_scale_off + 4 * (SQ_D / STEPQ__FP8_TILE) + t;
             n < hd->block_bytes; n += SQ_THREADS)
            blk[n] = 0;
        sq_block_health(io, fl, slot);
        return;
    }

    /*
     * unpack: every code load first (16 words: [K,V] vector a's W bytes at cw[a W/4 ..], [V,K]
     * row b's NV bytes at cw[b NV/4 ..]), then each vector decoded, times the tile's scale, and
     * stored; bf16 by cvt.rn pairs, as the reference's unpack (stepq__bf16_from_float: past
     * bf16's range +-Inf, a NaN stays a NaN).
     */
    const float s = scales[g];
    uint32_t cw[16];
    if (!VK) {
#pragma unroll
        for (int a = 0; a < NV; a++) {
            uint32_t c[4];
            sq_f8ld<W>(blk + (size_t)(r0 + 2 * W * a) * SQ_D + c0, c);
#pragma unroll
            for (int k = 0; k < W / 4; k++)
                cw[a * (W / 4) + k] = c[k];
        }
    } else {
#pragma unroll
        for (int b = 0; b < W; b++) {
            uint32_t c[4];
            sq_f8ld<NV>(blk + (size_t)(r0 + b) * SQ_D + c0, c);
#pragma unroll
            for (int k = 0; k < NV / 4; k++)
                cw[b * (NV / 4) + k] = c[k];
        }
    }
    const auto store = [&](int a, const float(&v)[W]) {
        if constexpr (DT == SQ_F32)
            sq_st16((float *)io.dense + dense_at(a), __float_as_uint(v[0]), __float_as_uint(v[1]),
                    __float_as_uint(v[2]), __float_as_uint(v[3]));
        else
            sq_st16((uint16_t *)io.dense + dense_at(a), sq_bf16x2(v[0], v[1]),
                    sq_bf16x2(v[2], v[3]), sq_bf16x2(v[4], v[5]), sq_bf16x2(v[6], v[7]));
    };
#pragma unroll
    for (int a = 0; a < NV; a += 2) {
        /* vectors a and a + 1: [K,V] byte pairs of their own words, [V,K] byte pair a, a + 1 of
         * each row's word */
        float v0[W], v1[W];
#pragma unroll
        for (int b = 0; b < W; b += 2) {
            if (!VK) {
                const float2 f = sq_e4m3x2_f(cw[a * (W / 4) + b / 4] >> (8 * (b & 3)));
                const float2 h = sq_e4m3x2_f(cw[(a + 1) * (W / 4) + b / 4] >> (8 * (b & 3)));
                v0[b] = __fmul_rn(f.x, s), v0[b + 1] = __fmul_rn(f.y, s);
                v1[b] = __fmul_rn(h.x, s), v1[b + 1] = __fmul_rn(h.y, s);
            } else {
                const float2 f = sq_e4m3x2_f(cw[b * (NV / 4) + a / 4] >> (8 * (a & 3)));
                const float2 h = sq_e4m3x2_f(cw[(b + 1) * (NV / 4) + a / 4] >> (8 * (a & 3)));
                v0[b] = __fmul_rn(f.x, s), v1[b] = __fmul_rn(f.y, s);
                v0[b + 1] = __fmul_rn(h.x, s), v1[b + 1] = __fmul_rn(h.y, s);
            }
        }
        store(a, v0);
        store(a + 1, v1);
    }
}

#endif /* STEPQ_KERNELS_CUDA_FP8_KERNEL_CUH */
