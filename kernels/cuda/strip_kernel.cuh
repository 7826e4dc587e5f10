/*
 * sq_strip_kernel: the fused packed decode step (exact fit, fp32 arithmetic) with the head cut
 * into column strips, one per warp, as the dense warp kernel (dense_kernel.cuh) cuts a bf16 head.
 * An experiment of session 20, built behind SQ_STRIP (default 0, then layer.cu never launches it):
 * on an H100 it passes checkasm and is 3-9% slower than the tile kernel at B = 512
 * (kernels/cuda/README.md, "The packed step on column strips").
 *
 * Why: the tile kernel gives each warp 16 complete rows, so every column quantity of the step
 * (S^T k, S^T q, u, the column maxima, the refit sums) crosses the eight warps through shared
 * memory and a barrier, with the per-column tails on threads 0..127 while the others wait. In a
 * strip, warp w holds columns 16w..16w+15 over all 128 rows: those quantities are warp
 * reduce-scatters (sq_dense_rs8, sums and maxima) and only the row maxima are block-wide. Per
 * item: the input phase (two barriers, the tile kernel's), one barrier for the row maxima, one
 * after the row fit, one before the copy-out: 5 against the tile kernel's 11.
 *
 * Lane (cg = lane & 1, rg = lane >> 1) of warp w holds rows 8 rg .. 8 rg + 7 and columns
 * 16 w + 8 cg .. + 7 (the dense warp kernel's lane tile), 64 values in registers; its codes are
 * 8 codes of each of its rows at column group tx = 2 w + cg, so the tile kernel's per-row decode
 * and quantize (sq_dec_row_e, sq_quant_row_e, sq_quant_row_rt) serve unchanged. Their shared
 * memory accesses would meet in one bank for all 16 row groups of a warp (8 rows of 16 B bytes
 * are 0 mod 128 bytes at every width B), so the staged block is padded: 16 bytes after every 8
 * code rows (sq_sp_off), which spreads the row groups over 8 bank groups (2-way at most).
 *
 * Which heads: integer heads of one width with column scales (stepq, dsq, spatial: hd->ubits,
 * dual, any_int) whose block needs no zeroing; any other head of the launch (pivot rows, mixed
 * widths, uniform rows, dense methods) takes the tile kernel's item in the same kernel, as
 * before. The arithmetic per element is the tile kernel's (its file comment lists it); the sums
 * run in another order (lane rows, then the warp's 16 row groups), so the state may differ from
 * the tile kernel's in the last ulp, which moves codes only at ties, as against the reference.
 * Two differences of structure, both the reference's arithmetic up to rounding (so they too may
 * differ from the tile kernel by an ulp, or a code at a tie), and both rare: a warp whose state
 * has a non-finite element zeroes it and recomputes its own columns' readout from the sanitised
 * state (the tile kernel recomputes every column's when any warp has one; the others keep
 * S_dec^T q + u (k.q)), and the clamped quantize (sq_quant_row_rt, when a scale saturated) is
 * chosen per warp: a saturated row scale, seen by all, or a saturated column of the warp's own
 * (the tile kernel takes it for the whole block; elsewhere the clamp would bind on no code, but
 * the unclamped path rounds y (qmax / c_j) instead of (y / c_j) qmax).
 */
#ifndef STEPQ_KERNELS_CUDA_STRIP_KERNEL_CUH
#define STEPQ_KERNELS_CUDA_STRIP_KERNEL_CUH

#include "kernels/cuda/dense_kernel.cuh" /* sq_dense_rs8, sq_dense_col, sq_dense_src, coldot */
#include "kernels/cuda/tile_kernel.cuh"

#ifndef SQ_STRIP
#define SQ_STRIP 0
#endif

#define SQ_STRIP_PAD 256 /* 16 bytes after each of the 16 groups of 8 code rows */

/* Offset in the padded stage of block byte o, B-bit codes (rows of 16 B bytes from byte 0). */
template <int B> __device__ __forceinline__ uint32_t sq_sp_off(uint32_t o)
{
    constexpr uint32_t CODE = SQ_D * 16u * B, GROUP = 8u * 16u * B;
    return o < CODE ? o + 16u * (o / GROUP) : o + SQ_STRIP_PAD;
}

/* The 8 values of v at lane row group R0.. (shared memory, 16-byte aligned). */
__device__ __forceinline__ void sq_strip_ld8(float (&d)[8], const float *v)
{
    const float4 a = *(const float4 *)v, b = *(const float4 *)(v + 4);
    d[0] = a.x, d[1] = a.y, d[2] = a.z, d[3] = a.w;
    d[4] = b.x, d[5] = b.y, d[6] = b.z, d[7] = b.w;
}

/*
 * One (entry e, head hv) of B-bit integer rows (see the file comment), the block at blk staged
 * padded into buf by the caller (sq_strip_stage), whose inputs are in `in`.
 */
template <int B, int V>
__device__ __forceinline__ void sq_strip_item(const sq_step &st, const sq_io &io, int hv, int e,
                                              int HV, int32_t slot, uint8_t *buf, sq_tsmem &sm,
                                              const sq_in &in)
{
    constexpr int QM = sq_bw<B>::QM;
    const unsigned full = 0xffffffffu;
    const int t = threadIdx.x, bfi = sq_in_bf16<V>(st);
    const int lane = t & 31, w = t >> 5, cg = lane & 1, rg = lane >> 1;
    const int R0 = 8 * rg, C0 = 16 * w + 8 * cg, tx = 2 * w + cg;
    const int col = C0 + sq_dense_col(lane); /* the column whose totals the lane holds */
    const bool holder = !(lane & 2);         /* lanes l and l ^ 2 hold the same totals */
    const sq_tpos pos = { t, lane, w, tx, R0, C0 };
    const sq_head_desc *hd = io.heads + hv;
    uint8_t *blk = io.pages + (size_t)slot * io.page_stride + hd->block_off;
    uint16_t *rsc = (uint16_t *)(buf + sq_sp_off<B>(hd->row_scale_off));
    uint16_t *csc = (uint16_t *)(buf + sq_sp_off<B>(hd->col_scale_off));
    const auto rowp = [&](int r) { return buf + (R0 + r) * 16 * B + 16 * rg; };
    unsigned fl = 0;
    if (t == 0) {
        sm.fl = 0;
        sm.sat = 0;
    }

    /* inputs: the tile kernel's phase (two barriers; the second also waits for the stage) */
    bool bad;
    if (t < SQ_D)
        bad = sq_tile_in_qk(st, in, sm, bfi, pos);
    else
        bad = sq_tile_in_vgb(st, in, sm, bfi, t);
    if (__syncthreads_or(bad)) {
        sq_cp_async_wait_all(); /* nothing may land in a finished block */
        sq_input_failed(st, io, e, HV, hv, slot, t, bfi);
        return;
    }
    const float kq = sq_tile_in_norm<SQ_SRC_PACKED>(st, io, sm, hv, e, HV, pos);

    /* decode: the lane's row factors r_i dec_i / qmax and column scales, straight from the stage */
    float x[64];
    {
        float rf[8], cc[8], dr[8];
        sq_strip_ld8(dr, sm.dec + R0);
#pragma unroll
        for (int r = 0; r < 8; r++)
            rf[r] = (sq_h2f(rsc[R0 + r]) * dr[r]) * sq_iqm[B];
#pragma unroll
        for (int c = 0; c < 8; c++)
            cc[c] = sq_h2f(csc[C0 + c]);
#pragma unroll
        for (int r = 0; r < 8; r++)
            sq_dec_row_e<B>(x + 8 * r, rowp(r), tx, rf[r], cc);
    }

    /* the delta rule in the warp: S^T k and S^T q, u, the rank-1 update */
    float u, sqd;
    {
        float kr[8], qr[8], pk[8], pq[8];
        sq_strip_ld8(kr, sm.k + R0);
        sq_strip_ld8(qr, sm.q + R0);
        sq_dense_coldot(x, kr, pk);
        sq_dense_coldot(x, qr, pq);
        const float sk = sq_dense_rs8(pk, lane);
        sqd = sq_dense_rs8(pq, lane);
        u = (sm.v[col] - sk) * sm.beta;
        float uu[8];
#pragma unroll
        for (int c = 0; c < 8; c++)
            uu[c] = __shfl_sync(full, u, sq_dense_src(cg, c));
#pragma unroll
        for (int r = 0; r < 8; r++)
#pragma unroll
            for (int c = 0; c < 8; c++)
                x[r * 8 + c] = fmaf(kr[r], uu[c], x[r * 8 + c]);
    }

    /* row maxima, NaN-propagating: they also detect non-finite elements */
    float m[8];
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const float a = sq_maxnan(fabsf(x[r * 8]), fabsf(x[r * 8 + 1]));
        const float b = sq_maxnan(fabsf(x[r * 8 + 2]), fabsf(x[r * 8 + 3]));
        const float c = sq_maxnan(fabsf(x[r * 8 + 4]), fabsf(x[r * 8 + 5]));
        const float d = sq_maxnan(fabsf(x[r * 8 + 6]), fabsf(x[r * 8 + 7]));
        m[r] = sq_maxnan(sq_maxnan(a, b), sq_maxnan(c, d));
    }
    bool nf = false;
#pragma unroll
    for (int r = 0; r < 8; r++)
        nf |= !(m[r] <= 3.402823466e38f);
    float o;
    if (__any_sync(full, nf)) {
        /* rare, per warp: non-finite elements become 0, the readout from the sanitised state */
        if (nf)
            fl |= STEPQ_HEALTH_STATE;
        float qr[8], pq[8];
        sq_strip_ld8(qr, sm.q + R0);
        sq_tile_zero_nf(x, m);
        sq_dense_coldot(x, qr, pq);
        o = sq_dense_rs8(pq, lane);
    } else {
        o = fmaf(u, kq, sqd); /* S_dec^T q + u (k.q), as the tile kernel */
    }
    if (!isfinite(o)) {
        o = 0.0f;
        fl |= STEPQ_HEALTH_OUTPUT;
    }
    if (holder)
        sq_st_out(st.o, (size_t)e * st.o_stride + (size_t)hv * SQ_D + col, o, bfi);

    /* row maxima over the block: lane ^ 1 halves the rows, a [warp][row] table, one barrier */
    {
        float h[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float send = cg ? m[k] : m[k + 4], keep = cg ? m[k + 4] : m[k];
            h[k] = fmaxf(keep, __shfl_xor_sync(full, send, 1));
        }
        *(float4 *)(sm.part[0] + w * SQ_D + R0 + 4 * cg) = make_float4(h[0], h[1], h[2], h[3]);
    }
    __syncthreads();
    if (t < SQ_D) {
        /* the row fit of row t (sq_tile_fit_rows') */
        float mr = sm.part[0][t];
#pragma unroll
        for (int k = 1; k < 8; k++)
            mr = fmaxf(mr, sm.part[0][k * SQ_D + t]);
        const float wi = hd->w[t];
        const sq_row_fit f = sq_fit_row(sq_dual_row_scale(mr, wi, hd->row_split), wi, B, sm, fl);
        sm.rinv[t] = f.ri;
        sm.ar[t] = f.ar;
        sm.ad[t] = f.ad;
        sm.aw[t] = f.aw;
        rsc[t] = f.h; /* every warp read the old row scales before the row barrier */
    }
    __syncthreads();

    /* columns, in the warp: y = x / r, c_j of max |y|, its reciprocal to the row groups */
    float ci[8];
    float cstep; /* the holder's step-2 scale: a column of zero codes keeps it */
    bool clamp;
    {
        float ri[8];
        sq_strip_ld8(ri, sm.rinv + R0);
#pragma unroll
        for (int r = 0; r < 8; r++)
#pragma unroll
            for (int c = 0; c < 8; c++)
                x[r * 8 + c] *= ri[r];
        float pc[8];
#pragma unroll
        for (int c = 0; c < 8; c++) {
            const float a = fmaxf(fabsf(x[c]), fabsf(x[8 + c]));
            const float b = fmaxf(fabsf(x[16 + c]), fabsf(x[24 + c]));
            const float d = fmaxf(fabsf(x[32 + c]), fabsf(x[40 + c]));
            const float f = fmaxf(fabsf(x[48 + c]), fabsf(x[56 + c]));
            pc[c] = fmaxf(fmaxf(a, b), fmaxf(d, f));
        }
        const float cm = sq_dense_rs8<true>(pc, lane);
        const bool csat = cm > STEPQ__SCALE_MAX;
        if (csat)
            fl |= STEPQ_HEALTH_SATURATED;
        cstep = sq_h2f(sq_scale_h(cm));
        const float cinv = __frcp_rn(cstep);
#pragma unroll
        for (int c = 0; c < 8; c++)
            ci[c] = __shfl_sync(full, cinv, sq_dense_src(cg, c));
        clamp = sm.sat || __any_sync(full, csat);
    }

    /* codes into the stage, with the refit sums of the lane's columns */
    float num[8], den[8];
#pragma unroll
    for (int c = 0; c < 8; c++)
        num[c] = den[c] = 0.0f;
    if (!clamp) {
        float qci[8], aw[8];
#pragma unroll
        for (int c = 0; c < 8; c++)
            qci[c] = ci[c] * (float)QM;
        sq_strip_ld8(aw, sm.aw + R0);
#pragma unroll
        for (int r = 0; r < 8; r++)
            sq_quant_row_e<B>(x + 8 * r, rowp(r), tx, qci, aw[r], num, den);
    } else {
#pragma unroll
        for (int r = 0; r < 8; r++)
            sq_quant_row_rt<true, false>(x + 8 * r, rowp(r), tx, B, ci, sm.ar[R0 + r],
                                         sm.ad[R0 + r], num, den);
    }

    /* the refit of the lane's column (sq_tile_refit's arithmetic), by its holder */
    {
        const float nm = sq_dense_rs8(num, lane), dn = sq_dense_rs8(den, lane);
        uint16_t h;
        if (dn > 0.0f) {
            /* sq_quant_row_e left qmax out of the sums */
            const float c = !clamp ? (nm * (float)QM) / dn : nm / dn;
            if (c > STEPQ__SCALE_MAX)
                fl |= STEPQ_HEALTH_SATURATED;
            h = sq_scale_h(c);
        } else {
            h = sq_scale_h(cstep);
        }
        if (holder)
            csc[col] = h;
    }

    /* every lane's codes and scales are in the stage: copy it out unpadded, report health */
    if (fl)
        atomicOr(&sm.fl, fl);
    __syncthreads();
    for (uint32_t n = t; n < hd->block_bytes / 16; n += SQ_THREADS)
        ((uint4 *)blk)[n] = *(const uint4 *)(buf + sq_sp_off<B>(16 * n));
    if (t == 0 && sm.fl)
        sq_tile_report(io, sm.fl, slot);
}

/* Issues the cp.async copy of a B-bit head block into the padded stage (sq_sp_off), one group. */
template <int B>
__device__ __forceinline__ void sq_strip_stage(uint8_t *buf, const uint8_t *blk, uint32_t bytes)
{
    for (uint32_t n = threadIdx.x; n < bytes / 16; n += SQ_THREADS)
        sq_cp_async16(buf + sq_sp_off<B>(16 * n), blk + 16 * n);
    sq_cp_commit();
}

/*
 * The fused packed step, exact fit, on a (batch, heads) grid (V: SQ_V_ORDER with SQ_V_IN32 or
 * SQ_V_IN16): strip heads on sq_strip_item, the others on the tile kernel's item. Dynamic shared
 * memory: the tile kernel's plus SQ_STRIP_PAD (layer.cu).
 */
template <int V>
__global__ void __launch_bounds__(SQ_THREADS, SQ_TMIN_BLOCKS) sq_strip_kernel(sq_step st, sq_io io)
{
    extern __shared__ __align__(16) uint8_t sq_dyn[];
    __shared__ sq_tsmem sm;
    static_assert(V & SQ_V_ORDER, "the strip kernel runs on the (batch, heads) grid");
    const int hv = blockIdx.y, e = blockIdx.x, HV = gridDim.y;
    const int32_t slot = io.slots ? io.slots[e] : e;
    if (slot < 0 || slot >= io.n_slots)
        return; /* uniform over the block */
    const sq_head_desc *hd = io.heads + hv;
    const uint8_t *blk = io.pages + (size_t)slot * io.page_stride + hd->block_off;
    sq_in in;
    if (hd->ubits && hd->dual && hd->any_int && hd->has_col && !hd->needs_zero) {
        sq_by_width(hd->ubits, [&](auto wd) {
            constexpr int B = decltype(wd)::value;
            sq_strip_stage<B>(sq_dyn, blk, hd->block_bytes);
            sq_load_in<true, V>(in, st, hv, e, HV, threadIdx.x);
            sq_strip_item<B, V>(st, io, hv, e, HV, slot, sq_dyn, sm, in);
        });
        return;
    }
    sq_stage_block(sq_dyn, blk, hd->block_bytes);
    sq_load_in<true, V>(in, st, hv, e, HV, threadIdx.x);
    sq_tile_item<SQ_SRC_PACKED, true, SQ_SINK_PACKED, V>(st, io, hv, e, HV, slot, sq_dyn, sm, in);
}

#endif /* STEPQ_KERNELS_CUDA_STRIP_KERNEL_CUH */
