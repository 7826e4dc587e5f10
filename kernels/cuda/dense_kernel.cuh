/*
 * sq_dense_kernel<VK, FP8> (the warp kernel): the decode step on dense bf16 states, [K,V] or
 * [V,K], with no barrier between its load and its store (fp32 states run on the column kernel,
 * which measured faster for them); FP8: on fp8 pages instead (below, at the kernel), whose only
 * barrier is a tile's pair of warps before the codes are stored.
 *
 * A 128x128 head (one 256-thread block, one (request, value head)) is cut into eight column
 * strips of 16 columns, one per warp: the recurrence is column-independent once k, q, the
 * decay and beta are known (u_j = beta (v_j - S_:j . k), S_:j += k u_j, o_j = S_:j . q). The
 * block shares only the input phase (the tile kernel's division of it, two barriers while the
 * state's loads are in flight); from the loaded state to its store no warp waits for another.
 * Lane (cg = lane & 1, rg = lane >> 1) holds rows 8 rg .. 8 rg + 7 and columns
 * 16 w + 8 cg .. 16 w + 8 cg + 7 of warp w's strip, 64 values in registers, loaded as 16-byte
 * vectors (a [K,V] row's or a [V,K] column's 8 elements: the tile kernel's sq_tload and sq_tstore,
 * whose micro-tile indexing this lane tile shares). The column sums S^T k and S^T q are
 * warp reduce-scatters over the 16 row groups (8 shuffles for 8 columns: sq_dense_rs8), after
 * which lane holds column sq_dense_col(lane) of its 8; u goes back to the row groups by 8
 * shuffles.
 *
 * The arithmetic is the reference's order (kernels/recurrence.c): the decayed state, u from it,
 * the rank-1 update, then the readout from the updated state (not the tile kernel's
 * S_dec^T q + u (k.q)). A non-finite element of the updated state makes the lane's readout
 * partial non-finite (NaN or Inf times any q, or an Inf plus anything), so that partial is the
 * detector: only a lane whose partial is not finite checks its elements (zeroing the
 * non-finite ones, health STATE) and recomputes it. bf16 states track the lane's |x| maximum
 * for the store: where it would round to Inf the lane stores through the saturating scalar
 * path (health SATURATED), else by round-to-nearest-even pairs.
 *
 * Why: the tile kernel's dense bf16 step holds a head per block between block-wide barriers at
 * two blocks per SM and reached 63-64% of the copy bandwidth; this kernel 72.7-73.5%
 * (kernels/cuda/README.md, "The dense bf16 step on the warp kernel", with what lost).
 * Health: sq_block_health at the end (a block-wide vote, and only when a lane raised a bit, which
 * is rare, a shared word and one report per (request, head), as every kernel counts).
 */
#ifndef STEPQ_KERNELS_CUDA_DENSE_KERNEL_CUH
#define STEPQ_KERNELS_CUDA_DENSE_KERNEL_CUH

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/tile_kernel.cuh" /* sq_in, sq_load_in: the shared input phase */

/* Blocks per SM the warp kernel is compiled for (registers: 65536 / (256 x this)). */
#ifndef SQ_DMIN_BLOCKS
#define SQ_DMIN_BLOCKS 2
#endif

/*
 * Which of its 8 columns a lane holds after sq_dense_rs8: lane bits 4, 3, 2 as weights 4, 2, 1
 * (bit 1 pairs two lanes with the same total; bit 0 is the column group).
 */
__device__ __forceinline__ int sq_dense_col(int lane)
{
    return ((lane >> 2) & 4) | ((lane >> 2) & 2) | ((lane >> 2) & 1);
}

/* The lane of column group cg that holds column c after sq_dense_rs8 (lane bit 1 clear). */
__device__ __forceinline__ int sq_dense_src(int cg, int c)
{
    return cg | ((c & 1) << 2) | (((c >> 1) & 1) << 3) | (((c >> 2) & 1) << 4);
}

/*
 * Sums p[0..7] over the 16 row groups of the lane's column group (lanes xor 2, 4, 8, 16) as a
 * reduce-scatter: every exchange sends the half the partner keeps. Returns the total of
 * column sq_dense_col(lane).
 */
__device__ __forceinline__ float sq_dense_rs8(const float (&p)[8], int lane)
{
    const unsigned full = 0xffffffffu;
    const bool h4 = lane & 16, h3 = lane & 8, h2 = lane & 4;
    float a[4], b[2];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float send = h4 ? p[i] : p[i + 4], keep = h4 ? p[i + 4] : p[i];
        a[i] = keep + __shfl_xor_sync(full, send, 16);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const float send = h3 ? a[i] : a[i + 2], keep = h3 ? a[i + 2] : a[i];
        b[i] = keep + __shfl_xor_sync(full, send, 8);
    }
    const float s = (h2 ? b[1] : b[0]) + __shfl_xor_sync(full, h2 ? b[0] : b[1], 4);
    return s + __shfl_xor_sync(full, s, 2);
}

/* The lane's column partials of a product with a key-row vector: p_c = sum_r x_rc y_r. */
__device__ __forceinline__ void sq_dense_coldot(const float (&x)[64], const float (&y)[8],
                                                float (&p)[8])
{
#pragma unroll
    for (int c = 0; c < 8; c++)
        p[c] = 0.0f;
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < 8; c++)
            p[c] = fmaf(x[r * 8 + c], y[r], p[c]);
}

/*
 * The lane's 8 x 8 fp8 codes (rows R0.., columns C0..; kernels/format.h: [K][V] bytes) as floats
 * times the tile's scale s, one rounding (e4m3 -> half2 -> float2 is exact), as dequant_fp8.
 */
__device__ __forceinline__ void sq_dense_f8dec(float (&x)[64], const uint2 (&cw)[8], float s)
{
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const uint32_t w = h < 2 ? cw[r].x : cw[r].y;
            const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
                (__nv_fp8x2_storage_t)((w >> (16 * (h & 1))) & 0xffffu), __NV_E4M3);
            const float2 f = __half22float2(__half2(hr));
            x[r * 8 + 2 * h] = __fmul_rn(f.x, s);
            x[r * 8 + 2 * h + 1] = __fmul_rn(f.y, s);
        }
}

/*
 * One (request e, value head hv) per block, grid (HV, batch). VK: [V,K] states. The inputs' dtype
 * is st.in_bf16 (only the input phase and the output store read it). FP8: the state is an fp8
 * page instead (kernels/format.h, codes [K][V], always VK false): the lane loads its 8 x 8 codes
 * (8 bytes of each of its rows) and its tile's scale with the state's loads, decodes them after
 * the input phase, and stores the fit of kernels/quant.c fit_fp8: fp8 tile t (columns
 * 32t..32t+31) is the strips of warps 2t and 2t+1, whose |x| maxima meet at a 64-thread named
 * barrier (sq_fp8_tile_scale, as in sq_fp8_kernel), then s = amax / 240 and the codes as that
 * kernel's pack of fp32 sources (correctly rounded divisions, the clamp to +-240, cvt.rn.satfinite
 * pairs; the quotients by sq_fp8_codes2: sq_div where the scale allows, and the zero threshold).
 */
template <bool VK, bool FP8 = false>
__global__ void __launch_bounds__(SQ_THREADS, SQ_DMIN_BLOCKS) sq_dense_kernel(sq_step st, sq_io io)
{
    static_assert(!(VK && FP8), "fp8 pages hold [K][V] codes");
    const unsigned full = 0xffffffffu;
    const int hv = blockIdx.x, e = blockIdx.y, HV = gridDim.x;
    const int32_t slot = io.slots ? io.slots[e] : e;
    if (slot < 0 || slot >= io.n_slots)
        return; /* uniform over the block */
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int cg = lane & 1, rg = lane >> 1, R0 = 8 * rg, C0 = 16 * w + 8 * cg;
    const int jc = sq_dense_col(lane), col = C0 + jc; /* the column whose totals the lane holds */
    const int bfi = st.in_bf16, kda = st.kda;

    const size_t off = (size_t)slot * io.dense_stride + (size_t)hv * SQ_D * SQ_D;
    float x[64], kr[8], qr[8], dr[8], vj, beta;
    /* FP8: the page block, the lane's codes and its tile's scale (tile w / 2) */
    uint8_t *blk =
        FP8 ? io.pages + (size_t)slot * io.page_stride + io.heads[hv].block_off : nullptr;
    float *tscale = FP8 ? (float *)(blk + io.heads[hv].tile_scale_off) + (w >> 1) : nullptr;
    uint2 cw[FP8 ? 8 : 1];
    float s8 = 0.0f;
    /*
     * The input phase shared by the block (the tile kernel's division of it): thread t < 128
     * loads channel t of q and k, thread 128 + j channel j of v and its decay (KDA; GDN: j = 0)
     * and beta (j = 0), the state's loads are issued, then two barriers: the verdict on the
     * inputs with the norms' warp sums, and the normalised q, k.
     */
    __shared__ __align__(16) float sq[SQ_D], sk[SQ_D], sv[SQ_D], sd[SQ_D];
    __shared__ float sl2[4][2], sbeta, sdec0;
    {
        const int t = threadIdx.x;
        sq_in in;
        sq_load_in<true, 0>(in, st, hv, e, HV, t);
        if constexpr (FP8) {
#pragma unroll
            for (int r = 0; r < 8; r++)
                cw[r] = *(const uint2 *)(blk + (size_t)(R0 + r) * SQ_D + C0);
            s8 = *tscale;
        } else {
            sq_tload<SQ_BF16>(x, io.dense, off, VK, true, R0, C0);
        }
        bool bad;
        if (t < SQ_D) {
            const float qv = sq_bits_f(in.w[0], bfi), kv = sq_bits_f(in.w[1], bfi);
            bad = !isfinite(qv) || !isfinite(kv);
            float q2 = qv * qv, k2 = kv * kv;
#pragma unroll
            for (int o = 16; o; o >>= 1) {
                q2 += __shfl_xor_sync(full, q2, o);
                k2 += __shfl_xor_sync(full, k2, o);
            }
            if (lane == 0) {
                sl2[w][0] = q2;
                sl2[w][1] = k2;
            }
            sq[t] = qv;
            sk[t] = kv;
        } else {
            const int j = t - SQ_D;
            const float vv = sq_bits_f(in.w[0], bfi);
            bad = !isfinite(vv);
            sv[j] = vv;
            if (kda || j == 0) {
                const float d = sq_decay<false>(st, sq_bits_f(in.w[1], bfi), in.w[3], in.w[4], bad);
                if (kda)
                    sd[j] = d;
                else
                    sdec0 = d;
            }
            if (j == 0)
                sbeta = sq_beta(st, sq_bits_f(in.w[2], bfi), bad);
        }
        if (__syncthreads_or(bad)) {
            sq_input_failed(st, io, e, HV, hv, slot, t, bfi);
            return; /* uniform over the block */
        }
        if (t < SQ_D) {
            /* as kernels/recurrence.c l2normalize, fp32 sums (the tile kernel's order) */
            float qv = sq[t], kv = sk[t];
            if (st.l2norm) {
                const float a = (sl2[0][0] + sl2[1][0]) + (sl2[2][0] + sl2[3][0]);
                const float b = (sl2[0][1] + sl2[1][1]) + (sl2[2][1] + sl2[3][1]);
                qv *= 1.0f / sqrtf(a + 1e-6f);
                kv *= 1.0f / sqrtf(b + 1e-6f);
            }
            sq[t] = qv * (st.scale > 0.0f ? st.scale : 0.08838834764831845f); /* 128^-1/2 */
            sk[t] = kv;
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float4 a = *(const float4 *)(sk + R0 + 4 * h),
                         b = *(const float4 *)(sq + R0 + 4 * h);
            kr[4 * h] = a.x, kr[4 * h + 1] = a.y, kr[4 * h + 2] = a.z, kr[4 * h + 3] = a.w;
            qr[4 * h] = b.x, qr[4 * h + 1] = b.y, qr[4 * h + 2] = b.z, qr[4 * h + 3] = b.w;
            if (kda) {
                const float4 d = *(const float4 *)(sd + R0 + 4 * h);
                dr[4 * h] = d.x, dr[4 * h + 1] = d.y, dr[4 * h + 2] = d.z, dr[4 * h + 3] = d.w;
            }
        }
        if (!kda)
#pragma unroll
            for (int r = 0; r < 8; r++)
                dr[r] = sdec0;
        vj = sv[col];
        beta = sbeta;
    }
    if constexpr (FP8) {
        sq_dense_f8dec(x, cw, s8);
    }

    /* decay, S^T k, u */
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < 8; c++)
            x[r * 8 + c] *= dr[r];
    float p[8];
    sq_dense_coldot(x, kr, p);
    const float u = (vj - sq_dense_rs8(p, lane)) * beta;
    float uu[8];
#pragma unroll
    for (int c = 0; c < 8; c++)
        uu[c] = __shfl_sync(full, u, sq_dense_src(cg, c));

    /* the update, the readout partials, bf16's maximum */
    float m = 0.0f;
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < 8; c++) {
            x[r * 8 + c] = fmaf(kr[r], uu[c], x[r * 8 + c]);
            m = fmaxf(m, fabsf(x[r * 8 + c]));
        }
    sq_dense_coldot(x, qr, p);
    unsigned fl = 0;
    bool nf = false;
#pragma unroll
    for (int c = 0; c < 8; c++)
        nf |= !isfinite(p[c]);
    if (nf) {
        /* rare: non-finite elements become 0 and the partials are recomputed */
        m = 0.0f;
#pragma unroll
        for (int i = 0; i < 64; i++) {
            if (!isfinite(x[i])) {
                x[i] = 0.0f;
                fl |= STEPQ_HEALTH_STATE;
            }
            m = fmaxf(m, fabsf(x[i]));
        }
        sq_dense_coldot(x, qr, p);
    }
    float o = sq_dense_rs8(p, lane);
    if (!isfinite(o)) {
        o = 0.0f;
        fl |= STEPQ_HEALTH_OUTPUT;
    }
    if (!(lane & 2))
        sq_st_out(st.o, (size_t)e * st.o_stride + (size_t)hv * SQ_D + col, o, bfi);
    if constexpr (FP8) {
        const float sc = sq_fp8_tile_scale(m, w >> 1, w & 1);
        const sq_fp8_div dv = sq_fp8_div_of<true>(sc);
        const auto emit = [&](auto fast) {
            constexpr bool FAST = decltype(fast)::value;
#pragma unroll
            for (int r = 0; r < 8; r++) {
                uint32_t c[2] = { 0, 0 };
                if (sc > 0.0f) {
#pragma unroll
                    for (int h = 0; h < 4; h++)
                        c[h >> 1] |=
                            sq_fp8_codes2<FAST, true>(dv, x[r * 8 + 2 * h], x[r * 8 + 2 * h + 1])
                            << (16 * (h & 1));
                }
                *(uint2 *)(blk + (size_t)(R0 + r) * SQ_D + C0) = make_uint2(c[0], c[1]);
            }
        };
        if (dv.fast) /* uniform over the tile's two warps */
            emit(std::true_type{});
        else
            emit(std::false_type{});
        if (lane == 0 && !(w & 1))
            *tscale = sc;
    } else {
        const bool sat = __float_as_uint(m) >= 0x7F7F8000u; /* rounds to Inf */
        sq_tstore<SQ_BF16>(x, io.dense, off, VK, true, R0, C0, sat, &fl);
    }

    sq_block_health(io, fl, slot);
}

#endif /* STEPQ_KERNELS_CUDA_DENSE_KERNEL_CUH */
