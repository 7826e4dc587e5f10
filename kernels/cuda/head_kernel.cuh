/*
 * One CUDA block per (entry, value head) of a 128x128 state, in three
 * composable phases so that every kernel of kernels/cuda/cuda.h is one
 * instantiation of the same code (and all of them are checked against the
 * same C reference):
 *   source: packed page (decode; fp8 pages too) | dense tensor (fp32/bf16, [K,V] or [V,K])
 *   update: the GDN/KDA recurrence step, or nothing (pack / unpack)
 *   sink:   packed page (fit + encode) | dense tensor
 *
 * Thread mapping: 256 threads, thread t owns column j = t % 128 and rows
 * [64*(t/128), 64*(t/128) + 64). The 64 state values stay in registers;
 * column reductions (S^T k, S^T q, column max, refit sums) are in-thread plus
 * one exchange between the two row halves, and the only row reduction (row
 * absmax) uses a butterfly transpose-reduce (15 shuffles for 16 rows).
 * The arithmetic of the fit follows kernels/quant.h step by step.
 */
#ifndef STEPQ_KERNELS_CUDA_HEAD_KERNEL_CUH
#define STEPQ_KERNELS_CUDA_HEAD_KERNEL_CUH

#include "kernels/cuda/common.cuh"

#define SQ_NR         64        /* state rows per thread (registers) */
#define SQ_MIN_BLOCKS 2         /* caps registers at 128 so two heads share an SM */
#define SQ_LUT        (7 * 256) /* z/qmax for b = 2..8, indexed (b-2)*256 + u */

/* Block copy global <-> shared, 16-byte vectors when aligned. */
__device__ __forceinline__ void sq_copy(void *dst, const void *src, uint32_t bytes, int vec16)
{
    if (vec16) {
        const uint4 *s = (const uint4 *)src;
        uint4 *d = (uint4 *)dst;
        for (uint32_t e = threadIdx.x; e < bytes / 16; e += SQ_THREADS)
            d[e] = s[e];
    } else {
        const uint8_t *s = (const uint8_t *)src;
        uint8_t *d = (uint8_t *)dst;
        for (uint32_t e = threadIdx.x; e < bytes; e += SQ_THREADS)
            d[e] = s[e];
    }
}

__device__ __forceinline__ double sq_warp_sum(double x)
{
#pragma unroll
    for (int o = 16; o; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* One butterfly stage: pairs (k, k + S) swap halves with lane ^ S. */
template <int S> __device__ __forceinline__ void sq_rowmax_stage(float (&v)[16], int lane)
{
    const bool up = lane & S;
#pragma unroll
    for (int k = 0; k < S; k++) {
        float lo = v[k], hi = v[k + S];
        float send = up ? lo : hi;
        float keep = up ? hi : lo;
        v[k] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, S));
    }
}

/*
 * Butterfly transpose-reduce: v[k] holds row k of 16 rows for this lane's
 * column; afterwards the result on lane l is the max over the warp's 32
 * columns of row (l & 15). 15 + 1 shuffles instead of 16 * 5.
 */
__device__ __forceinline__ float sq_rowmax16(float (&v)[16], int lane)
{
    sq_rowmax_stage<8>(v, lane);
    sq_rowmax_stage<4>(v, lane);
    sq_rowmax_stage<2>(v, lane);
    sq_rowmax_stage<1>(v, lane);
    return fmaxf(v[0], __shfl_xor_sync(0xffffffffu, v[0], 16));
}

/*
 * The thread's 64 elements (rows half*64.., column j) of a dense head at
 * p + off. [K,V]: a warp reads 128 contiguous bytes per row. [V,K]: each
 * thread reads its column's 64 contiguous rows as 16-byte (fp32) or 8-byte
 * (bf16) vectors when `vec` (16-byte aligned base, stride and offset).
 */
template <int DT>
__device__ __forceinline__ void sq_load_tile(float (&x)[SQ_NR], const void *p, size_t off, bool vk,
                                             bool vec, int half, int j)
{
    if (vk && vec && DT != SQ_F16) {
        size_t n0 = off + (size_t)j * SQ_D + half * SQ_NR;
#pragma unroll
        for (int r = 0; r < SQ_NR; r += 4) {
            if (DT == SQ_F32) {
                float4 v = *(const float4 *)((const float *)p + n0 + r);
                x[r] = v.x;
                x[r + 1] = v.y;
                x[r + 2] = v.z;
                x[r + 3] = v.w;
            } else {
                uint2 v = *(const uint2 *)((const uint16_t *)p + n0 + r);
                x[r] = __uint_as_float(v.x << 16);
                x[r + 1] = __uint_as_float(v.x & 0xffff0000u);
                x[r + 2] = __uint_as_float(v.y << 16);
                x[r + 3] = __uint_as_float(v.y & 0xffff0000u);
            }
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < SQ_NR; r++) {
        int i = half * SQ_NR + r;
        size_t n = off + (vk ? (size_t)j * SQ_D + i : (size_t)i * SQ_D + j);
        if (DT == SQ_F32)
            x[r] = ((const float *)p)[n];
        else if (DT == SQ_BF16)
            x[r] = sq_bf2f(((const uint16_t *)p)[n]);
        else
            x[r] = sq_h2f(((const uint16_t *)p)[n]);
    }
}

/*
 * The reverse of sq_load_tile; bf16/fp16 saturate (flag in *fl). An unpack's bf16 (RN) rounds as
 * the reference's unpack instead (sq_bf16_rn: past bf16's range +-Inf).
 */
template <int DT>
__device__ __forceinline__ void sq_store_tile(const float (&x)[SQ_NR], void *p, size_t off, bool vk,
                                              bool vec, int half, int j, unsigned *fl,
                                              bool RN = false)
{
    const auto bf = [&](float f) -> uint32_t { return RN ? sq_bf16_rn(f) : sq_bf16_sat(f, fl); };
    if (vk && vec && DT != SQ_F16) {
        size_t n0 = off + (size_t)j * SQ_D + half * SQ_NR;
#pragma unroll
        for (int r = 0; r < SQ_NR; r += 4) {
            if (DT == SQ_F32) {
                *(float4 *)((float *)p + n0 + r) = make_float4(x[r], x[r + 1], x[r + 2], x[r + 3]);
            } else {
                uint2 v;
                v.x = bf(x[r]) | (bf(x[r + 1]) << 16);
                v.y = bf(x[r + 2]) | (bf(x[r + 3]) << 16);
                *(uint2 *)((uint16_t *)p + n0 + r) = v;
            }
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < SQ_NR; r++) {
        int i = half * SQ_NR + r;
        size_t n = off + (vk ? (size_t)j * SQ_D + i : (size_t)i * SQ_D + j);
        if (DT == SQ_F32)
            ((float *)p)[n] = x[r];
        else if (DT == SQ_BF16)
            ((uint16_t *)p)[n] = (uint16_t)bf(x[r]);
        else
            ((uint16_t *)p)[n] = sq_f16_sat(x[r], fl);
    }
}

/*
 * fp8 pages (kernels/format.h): the thread's 64 e4m3 codes of column j, each times the
 * fp32 scale of j's tile of 32 columns, x = float(c) * s as the reference (one rounding).
 * A warp reads 32 contiguous code bytes per row.
 */
__device__ __forceinline__ void sq_load_fp8(float (&x)[SQ_NR], const uint8_t *blk, uint32_t so,
                                            int half, int j)
{
    const float s = ((const float *)(blk + so))[j / STEPQ__FP8_TILE];
#pragma unroll
    for (int r = 0; r < SQ_NR; r++)
        x[r] = __fmul_rn(sq_e4m3_f(blk[(size_t)(half * SQ_NR + r) * SQ_D + j]), s);
}

struct __align__(16) sq_smem
{
    float q[SQ_D], k[SQ_D], v[SQ_D], dec[SQ_D];
    float red[2][2][SQ_D];  /* [quantity][half][column] */
    float rowpart[4][SQ_D]; /* row max partials of the 4 warps of a half */
    float rs[SQ_D], cs[SQ_D], w2r2[SQ_D];
    float2 rr[SQ_D]; /* new row scale and its reciprocal */
    uint16_t rh[SQ_D], roff[SQ_D];
    uint8_t bits[SQ_D];
    float lut[SQ_LUT];
    float fit[2][2][SQ_D]; /* refit sums [num|den][half][column] */
    double l2[4][2];
    float fp8max[2][SQ_D / STEPQ__FP8_TILE]; /* fp8 tile amax partials [half][tile] */
    float beta, dec0;
};

/* Row i's maximum of step 1: the max of the partials of the 4 warps of its half. */
__device__ __forceinline__ float sq_rowpart_max(const sq_smem &sm, int i)
{
    return fmaxf(fmaxf(sm.rowpart[0][i], sm.rowpart[1][i]),
                 fmaxf(sm.rowpart[2][i], sm.rowpart[3][i]));
}

/*
 * Decode of a slot's block is done from shared memory (`buf`, the block
 * staged with 16-byte loads); the encode writes the new block into the same
 * buffer (codes built word-parallel from the byte codes in `zb`) and copies
 * it out whole, so each packed byte is read and written once. NOREFIT (the
 * decode fit norefit; the column handle's decode steps only) stores the
 * step-2 column scales c_j instead of the refit: no refit sums and no
 * exchange of them (the barrier before the encode stays: the encode reads
 * every thread's byte codes). ROWS (the decode fit rows, likewise) keeps
 * the old block's column scales (read from the page, which is still the
 * old block in both the fused step and two-stage stage 2) and refits the
 * row scales to them; block-wide votes first decide whether the old block
 * can serve (kernels/quant.h), else the head takes the exact fit.
 */
template <int SRC, bool UPDATE, int SINK, bool NOREFIT = false, bool ROWS = false>
__global__ void __launch_bounds__(SQ_THREADS, SQ_MIN_BLOCKS) sq_head_kernel(sq_step st, sq_io io)
{
    extern __shared__ __align__(16) uint8_t sq_dyn[];
    __shared__ sq_smem sm;

    const int hv = blockIdx.x, e = blockIdx.y, HV = gridDim.x;
    const int t = threadIdx.x, j = t & (SQ_D - 1), half = t >> 7, lane = t & 31;
    const int wih = (t >> 5) & 3; /* warp index within the half */
    const int32_t slot = io.slots ? io.slots[e] : e;
    if (slot < 0 || slot >= io.n_slots)
        return; /* uniform over the block */
    if (!UPDATE && io.skip && io.skip[(size_t)e * HV + hv])
        return;

    const bool packed = SRC == SQ_SRC_PACKED || SINK == SQ_SINK_PACKED;
    const sq_head_desc *hd = packed ? io.heads + hv : nullptr;
    uint8_t *blk = packed ? io.pages + (size_t)slot * io.page_stride + hd->block_off : nullptr;
    uint8_t *buf = sq_dyn;
    const int method = packed ? hd->method : 0;
    /* fp8 pages move like the dense methods' (no staging), with their own decode and fit */
    const bool fp8 = packed && method == STEPQ_METHOD_FP8;
    const bool quant = packed && hd->quantized && !fp8;
    unsigned fl = 0; /* health bits raised by this thread */
    if (packed && t < SQ_D) {
        sm.bits[t] = hd->bits[t];
        sm.roff[t] = hd->row_off[t];
    }

    /*
     * ---- source, issued first: its latency overlaps the input phase ----
     * Packed blocks travel by cp.async into shared memory; dense tiles are
     * loaded straight into registers (64 independent loads per thread).
     */
    float x[SQ_NR];
    if (SRC == SQ_SRC_PACKED) {
        if (quant) {
            sq_stage_block(buf, blk, hd->block_bytes);
        } else if (fp8) {
            sq_load_fp8(x, blk, hd->tile_scale_off, half, j);
        } else if (method == STEPQ_METHOD_FP32) {
            sq_load_tile<SQ_F32>(x, blk, 0, false, false, half, j);
        } else if (method == STEPQ_METHOD_BF16) {
            sq_load_tile<SQ_BF16>(x, blk, 0, false, false, half, j);
        } else {
            sq_load_tile<SQ_F16>(x, blk, 0, false, false, half, j);
        }
    } else {
        size_t off =
            (size_t)(io.dense_by_slot ? slot : e) * io.dense_stride + (size_t)hv * SQ_D * SQ_D;
        if (io.bf16)
            sq_load_tile<SQ_BF16>(x, io.dense, off, io.layout_vk, io.dense_vec, half, j);
        else
            sq_load_tile<SQ_F32>(x, io.dense, off, io.layout_vk, io.dense_vec, half, j);
        if (!UPDATE) {
            /* pack: non-finite elements become 0 before the fit */
            bool nf = false;
#pragma unroll
            for (int r = 0; r < SQ_NR; r++)
                if (!isfinite(x[r])) {
                    x[r] = 0.0f;
                    nf = true;
                }
            if (nf)
                fl |= STEPQ_HEALTH_STATE;
        }
    }
    if (quant) {
        for (int n = t; n < SQ_LUT; n += SQ_THREADS) {
            int b = n / 256 + 2, u = n % 256, qm = (1 << (b - 1)) - 1;
            sm.lut[n] = (float)(u - qm) / (float)qm;
        }
    }

    /* ---- inputs of the recurrence ---- */
    if (UPDATE) {
        const int hq = hv / (HV / st.H), bf = st.in_bf16;
        const size_t qh = (size_t)hq * SQ_D;
        bool bad = false;
        if (t < SQ_D) {
            const uint32_t qb = sq_ld_bits(st.q, (size_t)e * st.q_stride + qh + t, bf);
            const uint32_t kb = sq_ld_bits(st.k, (size_t)e * st.k_stride + qh + t, bf);
            const uint32_t vb =
                sq_ld_bits(st.v, (size_t)e * st.v_stride + (size_t)hv * SQ_D + t, bf);
            float qv = sq_bits_f(qb, bf), kv = sq_bits_f(kb, bf), vv = sq_bits_f(vb, bf);
            bad = !isfinite(qv) || !isfinite(kv) || !isfinite(vv);
            if (st.l2norm) {
                double sq2 = sq_warp_sum((double)qv * qv), sk2 = sq_warp_sum((double)kv * kv);
                if (lane == 0) {
                    sm.l2[t >> 5][0] = sq2;
                    sm.l2[t >> 5][1] = sk2;
                }
            }
            sm.q[t] = qv;
            sm.k[t] = kv;
            sm.v[t] = vv;
            if (st.kda || t == 0) {
                const int gi = st.kda ? t : 0;
                const size_t go = (size_t)e * st.g_stride + (size_t)hv * (st.kda ? SQ_D : 1) + gi;
                uint32_t bias, alog;
                sq_ld_gate(st, hv, gi, bias, alog);
                float d =
                    sq_decay<true>(st, sq_bits_f(sq_ld_bits(st.g, go, bf), bf), bias, alog, bad);
                if (st.kda)
                    sm.dec[t] = d;
                else
                    sm.dec0 = d;
            }
            if (t == 0)
                sm.beta = sq_beta(
                    st, sq_bits_f(sq_ld_bits(st.beta, (size_t)e * st.beta_stride + hv, bf), bf),
                    bad);
        }
        if (__syncthreads_or(bad)) {
            /* The state keeps its previous content; the output row is 0. */
            if (SRC == SQ_SRC_PACKED)
                sq_cp_async_wait_all(); /* nothing may land in a finished block */
            sq_input_failed(st, io, e, HV, hv, slot, t, st.in_bf16);
            return;
        }
        if (t < SQ_D) {
            float sc = st.scale > 0.0f ? st.scale : 0.08838834764831845f; /* 128^-1/2 */
            float iq = 1.0f, ik = 1.0f;
            if (st.l2norm) {
                double a = sm.l2[0][0] + sm.l2[1][0] + sm.l2[2][0] + sm.l2[3][0];
                double b = sm.l2[0][1] + sm.l2[1][1] + sm.l2[2][1] + sm.l2[3][1];
                iq = (float)(1.0 / sqrt(a + 1e-6));
                ik = (float)(1.0 / sqrt(b + 1e-6));
            }
            float qv = sm.q[t], kv = sm.k[t];
            if (st.l2norm) {
                qv *= iq;
                kv *= ik;
            }
            sm.q[t] = qv * sc;
            sm.k[t] = kv;
        }
        if (io.skip && t == 0)
            io.skip[(size_t)e * HV + hv] = 0;
        __syncthreads();
    }

    /* ---- packed source: decode the staged block ---- */
    if (SRC == SQ_SRC_PACKED && quant) {
        sq_cp_async_wait_all();
        if (t < 4)
            ((uint32_t *)(buf + hd->block_bytes))[t] = 0; /* decode reads one word past */
        __syncthreads();
        if (t < SQ_D) {
            sm.rs[t] = sq_h2f(((const uint16_t *)(buf + hd->row_scale_off))[t]);
            sm.cs[t] =
                hd->has_col ? sq_h2f(((const uint16_t *)(buf + hd->col_scale_off))[t]) : 1.0f;
        }
        __syncthreads();
        const float cj = sm.cs[j]; /* 1 without column scales: (r * 1) * z == r * z */
        const uint32_t *w32 = (const uint32_t *)buf;
        const int ub = hd->ubits;
        if (ub) {
            /* one width for every row: position, shift and mask are per thread */
            const uint32_t p = (uint32_t)(j * ub), sh = p & 31, mask = (1u << ub) - 1u;
            const uint32_t *wp = w32 + (p >> 5);
            const float *lut = sm.lut + (ub - 2) * 256;
            const int rw = 4 * ub; /* 32-bit words per row */
#pragma unroll
            for (int r = 0; r < SQ_NR; r++) {
                int i = half * SQ_NR + r;
                const uint32_t *q = wp + i * rw;
                uint32_t u = __funnelshift_r(q[0], q[1], sh) & mask;
                x[r] = (sm.rs[i] * cj) * lut[u];
            }
        } else {
#pragma unroll
            for (int r = 0; r < SQ_NR; r++) {
                int i = half * SQ_NR + r;
                int b = sm.bits[i];
                uint32_t ro = sm.roff[i];
                if (b == STEPQ_BITS_PIVOT) {
                    x[r] = sq_h2f(((const uint16_t *)(buf + ro))[j]);
                } else {
                    uint32_t p = (uint32_t)(j * b);
                    uint32_t wi = (ro >> 2) + (p >> 5);
                    uint32_t u = __funnelshift_r(w32[wi], w32[wi + 1], p & 31) & ((1u << b) - 1u);
                    x[r] = (sm.rs[i] * cj) * sm.lut[(b - 2) * 256 + u];
                }
            }
        }
    }

    /* ---- update: decay, delta correction, rank-1 update, readout ---- */
    if (UPDATE) {
        /*
         * Unswitched by hand on the arch: from one loop with st.kda ? sm.dec[i]
         * : sm.dec0, nvcc 13 once unswitched itself (GDN multiplying by a
         * register) and, after the dtype-aware input phase was added, selected
         * an address per element instead (64 SEL, VIADD and scalar LDS more on
         * GDN: the dense fp32 step 3-4% slower at B = 512 on the H200).
         */
        float acc = 0.0f;
        if (st.kda) {
#pragma unroll
            for (int r = 0; r < SQ_NR; r++) {
                int i = half * SQ_NR + r;
                x[r] *= sm.dec[i];
                acc = fmaf(x[r], sm.k[i], acc);
            }
        } else {
            const float d = sm.dec0;
#pragma unroll
            for (int r = 0; r < SQ_NR; r++) {
                int i = half * SQ_NR + r;
                x[r] *= d;
                acc = fmaf(x[r], sm.k[i], acc);
            }
        }
        sm.red[0][half][j] = acc;
        __syncthreads();
        float u = (sm.v[j] - (sm.red[0][0][j] + sm.red[0][1][j])) * sm.beta;
        acc = 0.0f;
        bool nf = false;
#pragma unroll
        for (int r = 0; r < SQ_NR; r++) {
            int i = half * SQ_NR + r;
            float s = __fadd_rn(x[r], __fmul_rn(sm.k[i], u));
            if (!isfinite(s)) {
                s = 0.0f;
                nf = true;
            }
            x[r] = s;
            acc = fmaf(s, sm.q[i], acc);
        }
        if (nf)
            fl |= STEPQ_HEALTH_STATE;
        sm.red[1][half][j] = acc;
        __syncthreads();
        if (half == 0) {
            float o = sm.red[1][0][j] + sm.red[1][1][j];
            if (!isfinite(o)) {
                o = 0.0f;
                fl |= STEPQ_HEALTH_OUTPUT;
            }
            sq_st_out(st.o, (size_t)e * st.o_stride + (size_t)hv * SQ_D + j, o, st.in_bf16);
        }
    }

    /* ---- sink ---- */
    if (SINK == SQ_SINK_DENSE) {
        size_t off =
            (size_t)(io.dense_by_slot ? slot : e) * io.dense_stride + (size_t)hv * SQ_D * SQ_D;
        if (io.bf16)
            sq_store_tile<SQ_BF16>(x, io.dense, off, io.layout_vk, io.dense_vec, half, j, &fl,
                                   !UPDATE); /* an unpack rounds, a step saturates */
        else
            sq_store_tile<SQ_F32>(x, io.dense, off, io.layout_vk, io.dense_vec, half, j, &fl);
    } else if (fp8) {
        /*
         * fp8 fit (kernels/quant.h): a tile is 32 columns of both halves, i.e. warp wih of
         * each half (thread t: column t % 128). s = amax / 240 and x / s are correctly
         * rounded divisions as in the reference; s = 0 keeps codes 0 (+0, as the reference
         * leaves its cleared block). Every thread writes the codes it read, and the scales
         * are written after the block's last read of them (the update's barriers, or none
         * read at all in a pack).
         */
        float m = 0.0f;
#pragma unroll
        for (int r = 0; r < SQ_NR; r++)
            m = fmaxf(m, fabsf(x[r]));
#pragma unroll
        for (int o = 16; o; o >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0)
            sm.fp8max[half][wih] = m;
        __syncthreads();
        const float sc = __fdiv_rn(fmaxf(sm.fp8max[0][wih], sm.fp8max[1][wih]), STEPQ__FP8_AMAX);
#pragma unroll
        for (int r = 0; r < SQ_NR; r++)
            blk[(size_t)(half * SQ_NR + r) * SQ_D + j] =
                sc > 0.0f ? sq_e4m3(__fdiv_rn(x[r], sc)) : (uint8_t)0;
        if (t < SQ_D / STEPQ__FP8_TILE)
            ((float *)(blk + hd->tile_scale_off))[t] =
                __fdiv_rn(fmaxf(sm.fp8max[0][t], sm.fp8max[1][t]), STEPQ__FP8_AMAX);
        /* alignment padding after the scales (a block_align above 16), written as 0 */
        for (uint32_t n = hd->tile_scale_off + 4 * (SQ_D / STEPQ__FP8_TILE) + t;
             n < hd->block_bytes; n += SQ_THREADS)
            blk[n] = 0;
    } else if (!quant) {
        if (method == STEPQ_METHOD_FP32)
            sq_store_tile<SQ_F32>(x, blk, 0, false, false, half, j, &fl);
        else if (method == STEPQ_METHOD_BF16)
            sq_store_tile<SQ_BF16>(x, blk, 0, false, false, half, j, &fl);
        else
            sq_store_tile<SQ_F16>(x, blk, 0, false, false, half, j, &fl);
    } else {
        uint8_t *zb = buf + ((hd->block_bytes + 16 + 15) & ~15u);
        const bool dual = hd->dual;

        /*
         * 0. ROWS: the old column scale c_j of the page (global: the block
         * staged in buf may be overwritten below), rc_j = RN(1/c_j), the row
         * maxima of |x| rc_j and two votes: the head takes the exact fit where
         * a column scale is not positive finite or the head has no integer
         * row, then where a row scale would saturate or a row maximum exceeds
         * STEPQ__ROWS_GROW times its old row scale (the page's, global, as
         * c_j: the growth trigger). Otherwise the row maxima stay in
         * sm.rowpart for step 1.
         */
        bool rows = false;
        uint16_t chj = 0;
        float rcj = 1.0f;
        if (ROWS) {
            chj = hd->has_col ? ((const uint16_t *)(blk + hd->col_scale_off))[j] : 0;
            rcj = __frcp_rn(sq_h2f(chj));
            /* non-finite elements were zeroed by now (the update, or the dense load) */
            bool bad = !sq_rows_col_ok(chj) || !(dual && hd->any_int);
            if (!__syncthreads_or(bad)) {
#pragma unroll
                for (int c = 0; c < SQ_NR / 16; c++) {
                    float v[16];
#pragma unroll
                    for (int k = 0; k < 16; k++)
                        v[k] = fabsf(x[c * 16 + k]) * rcj;
                    float m = sq_rowmax16(v, lane);
                    if (lane < 16)
                        sm.rowpart[wih][half * SQ_NR + c * 16 + lane] = m;
                }
                __syncthreads();
                bool sat = false;
                if (t < SQ_D && sm.bits[t] != STEPQ_BITS_PIVOT) {
                    const float m = sq_rowpart_max(sm, t);
                    const float ro = sq_h2f(((const uint16_t *)(blk + hd->row_scale_off))[t]);
                    sat = !(m <= STEPQ__SCALE_MAX) || m > STEPQ__ROWS_GROW * ro; /* growth */
                }
                rows = !__syncthreads_or(sat);
            }
        }

        /* 1. row absmax over this half's rows, 16 at a time (ROWS: of |x| rc_j, above) */
        if (!rows) {
#pragma unroll
            for (int c = 0; c < SQ_NR / 16; c++) {
                float v[16];
#pragma unroll
                for (int k = 0; k < 16; k++)
                    v[k] = fabsf(x[c * 16 + k]);
                float m = sq_rowmax16(v, lane);
                if (lane < 16)
                    sm.rowpart[wih][half * SQ_NR + c * 16 + lane] = m;
            }
        }
        __syncthreads(); /* also: every read of buf (the old block) is done */
        if (ROWS && rows && t < SQ_D) {
            /* the fit rows: r_i = fp16(m_i), s_i = qmax_i / r_i in sm.rr[i].y */
            int b = sm.bits[t];
            float r = 0.0f, s = 0.0f;
            uint16_t h = 0;
            if (b != STEPQ_BITS_PIVOT) {
                float m = sq_rowpart_max(sm, t);
                h = sq_scale_h(m);
                r = sq_h2f(h);
                s = __fdiv_rn((float)((1 << (b - 1)) - 1), r);
            }
            sm.rr[t] = make_float2(r, s);
            sm.rh[t] = h;
        } else if (t < SQ_D) {
            int b = sm.bits[t];
            float r = 0.0f;
            uint16_t h = 0;
            if (b != STEPQ_BITS_PIVOT) {
                float m = sq_rowpart_max(sm, t);
                float s = dual ? sq_dual_row_scale(m, hd->w[t], hd->row_split) : m;
                if (s > STEPQ__SCALE_MAX)
                    fl |= STEPQ_HEALTH_SATURATED;
                h = sq_scale_h(s);
                r = sq_h2f(h);
                float w = hd->w[t];
                sm.w2r2[t] = w * w * r * r;
            }
            sm.rr[t] = make_float2(r, r > 0.0f ? __frcp_rn(r) : 0.0f);
            sm.rh[t] = h;
        }
        /* The new block is assembled in buf: zero it (padding, unused slots). */
        for (uint32_t n = t; n < hd->block_bytes / 16; n += SQ_THREADS)
            ((uint4 *)buf)[n] = make_uint4(0, 0, 0, 0);
        __syncthreads();

        /* 2. Y = X / r in place of X (integer rows); column scales of Y */
        const int ub = hd->ubits; /* every row one integer width: no per-row checks */
        float cm = 0.0f;
        if (ROWS && rows) {
            /* 2-3 of the fit rows: z = clamp(rint((x rc_j) s_i)); pivot rows as below */
#pragma unroll
            for (int r = 0; r < SQ_NR; r++) {
                int i = half * SQ_NR + r;
                int b = sm.bits[i];
                if (b == STEPQ_BITS_PIVOT) {
                    ((uint16_t *)(buf + sm.roff[i]))[j] = sq_f16_sat(x[r], &fl);
                    continue;
                }
                const float qm = (float)((1 << (b - 1)) - 1);
                float z = rintf((x[r] * rcj) * sm.rr[i].y);
                z = fminf(fmaxf(z, -qm), qm);
                zb[i * SQ_D + j] = (uint8_t)((int)z + ((1 << (b - 1)) - 1));
            }
        } else if (ub) {
#pragma unroll
            for (int r = 0; r < SQ_NR; r++) {
                float2 rr = sm.rr[half * SQ_NR + r];
                x[r] = sq_div(x[r], rr.x, rr.y);
                cm = fmaxf(cm, fabsf(x[r]));
            }
        } else {
#pragma unroll
            for (int r = 0; r < SQ_NR; r++) {
                int i = half * SQ_NR + r;
                if (sm.bits[i] != STEPQ_BITS_PIVOT) {
                    float2 rr = sm.rr[i];
                    x[r] = sq_div(x[r], rr.x, rr.y);
                    cm = fmaxf(cm, fabsf(x[r]));
                }
            }
        }
        float cj = 1.0f, cinv = 1.0f;
        if (dual && !(ROWS && rows)) {
            sm.red[0][half][j] = cm;
            __syncthreads();
            float c = fmaxf(sm.red[0][0][j], sm.red[0][1][j]);
            if (c > STEPQ__SCALE_MAX && half == 0)
                fl |= STEPQ_HEALTH_SATURATED;
            cj = sq_h2f(sq_scale_h(c));
            cinv = __frcp_rn(cj);
        }

        /*
         * 3. codes (bytes in zb), pivot rows straight into the block; refit
         * sums. With y = x / r: num = sum w^2 r^2 zt y (= sum w^2 r zt x up to
         * one rounding of y), den = sum w^2 r^2 zt^2, accumulated in fp32
         * (the reference uses double: the refit scale agrees within one fp16
         * ulp, which is the stated tolerance).
         */
        float num = 0.0f, den = 0.0f;
        if (ROWS && rows) {
            /* the codes are in zb already (step 2 of the fit rows) */
        } else if (ub) {
            const int qm = (1 << (ub - 1)) - 1;
            const float qmf = (float)qm, iqm = 1.0f / qmf;
#pragma unroll
            for (int r = 0; r < SQ_NR; r++) {
                int i = half * SQ_NR + r;
                float y = dual ? sq_div(x[r], cj, cinv) : x[r];
                float z = fminf(fmaxf(rintf(y * qmf), -qmf), qmf);
                zb[i * SQ_D + j] = (uint8_t)((int)z + qm);
                if (dual && !NOREFIT) {
                    float zt = z * iqm;
                    float a = sm.w2r2[i] * zt;
                    num = fmaf(a, x[r], num);
                    den = fmaf(a, zt, den);
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < SQ_NR; r++) {
                int i = half * SQ_NR + r;
                int b = sm.bits[i];
                if (b == STEPQ_BITS_PIVOT) {
                    ((uint16_t *)(buf + sm.roff[i]))[j] = sq_f16_sat(x[r], &fl);
                    continue;
                }
                int qm = (1 << (b - 1)) - 1;
                float y = dual ? sq_div(x[r], cj, cinv) : x[r];
                float z = rintf(y * (float)qm);
                z = fminf(fmaxf(z, (float)-qm), (float)qm);
                int u = (int)z + qm;
                zb[i * SQ_D + j] = (uint8_t)u;
                if (dual && !NOREFIT) {
                    float zt = sm.lut[(b - 2) * 256 + u];
                    float a = sm.w2r2[i] * zt;
                    num = fmaf(a, x[r], num);
                    den = fmaf(a, zt, den);
                }
            }
        }

        /* 4. fixed-code column refit (NOREFIT, the decode fit norefit: c_j of step 2) */
        if (dual && !NOREFIT && !(ROWS && rows)) {
            sm.fit[0][half][j] = num;
            sm.fit[1][half][j] = den;
        }
        __syncthreads();
        if (t < SQ_D) {
            ((uint16_t *)(buf + hd->row_scale_off))[t] = sm.rh[t];
            if (ROWS && rows) {
                ((uint16_t *)(buf + hd->col_scale_off))[j] = chj; /* kept as it was */
            } else if (NOREFIT && dual && hd->any_int) {
                ((uint16_t *)(buf + hd->col_scale_off))[j] = sq_scale_h(cj);
            } else if (dual && hd->any_int) {
                float nm = sm.fit[0][0][j] + sm.fit[0][1][j];
                float dn = sm.fit[1][0][j] + sm.fit[1][1][j];
                uint16_t h;
                if (dn > 0.0f) {
                    float c = nm / dn;
                    if (c > STEPQ__SCALE_MAX)
                        fl |= STEPQ_HEALTH_SATURATED;
                    h = sq_scale_h(c);
                } else {
                    h = sq_scale_h(cj);
                }
                ((uint16_t *)(buf + hd->col_scale_off))[j] = h;
            }
        }

        /* 5. word-parallel encode: lane l of a row builds the row's word l */
        const int warp = t >> 5;
        for (int i = warp; i < SQ_D; i += SQ_THREADS / 32) {
            int b = sm.bits[i];
            if (b == STEPQ_BITS_PIVOT || lane >= 4 * b)
                continue;
            int bit0 = 32 * lane;
            int k0 = bit0 / b;
            uint64_t acc = 0;
            for (int k = k0; k < SQ_D && k * b < bit0 + 32; k++) {
                int pos = k * b - bit0;
                uint32_t val = zb[i * SQ_D + k];
                acc |= pos >= 0 ? (uint64_t)val << pos : (uint64_t)(val >> -pos);
            }
            ((uint32_t *)(buf + sm.roff[i]))[lane] = (uint32_t)acc;
        }
        __syncthreads();
        sq_copy(blk, buf, hd->block_bytes, io.vec16);
    }

    /* ---- health: one event per (request, head) and flag, as the reference ---- */
    unsigned f = 0;
#pragma unroll
    for (int bit = 0; bit < STEPQ__HEALTH_NCOUNTS; bit++)
        if (__syncthreads_or(fl & (1u << bit)))
            f |= 1u << bit;
    if (t == 0 && f)
        sq_tile_report(io, f, slot);
}

#endif /* STEPQ_KERNELS_CUDA_HEAD_KERNEL_CUH */
