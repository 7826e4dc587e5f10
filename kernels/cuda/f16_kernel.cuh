/*
 * The fused packed decode step in fp16 arithmetic (the map field arith = fp16): one 256-thread
 * block per (entry, value head) of a GDN integer head of one width B with column scales
 * (stepq__step_f16_supports), or of a pivot head of the same layer (sq_f16_pivot_item, fp32),
 * or, on the SQ_V_KDA instantiation, of a KDA head of any width mix with pivot rows
 * (sq_f16_item<0, V>): one launch per layer. kernels/quant.h lists its operations and
 * kernels/step_f16.c is its C reference; this file follows the list step by step. The thread
 * mapping is the tile kernel's (thread t: warp w, tx = t % 16 owns columns 8tx..8tx+7, rows
 * 8ty..8ty+7 with ty = 2w + (t % 32) / 16), but a thread's 64 elements are 32 half2 registers
 * (X[row][pair], the pair = two adjacent columns), so that the kernel fits in 64 registers and four
 * blocks (32 warps) share an SM: the occupancy that hides the page loads of one block behind the
 * arithmetic of the others (kernels/cuda/README.md, the fp16 design probe: 2 blocks per SM 371 us,
 * 3 314 us, 4 294 us at B = 512 in the probe's frame).
 *
 * Per-row work (normalisers, row scales, refit weights) runs once per row: lanes 2r and 2r + 1
 * of a half-warp own row R0 + r and broadcast its factors by one shuffle per row; the row
 * maxima come from a reduce-scatter (5 shuffles for the thread's 8 rows). The page is read and
 * written in place: every thread reads its codes and the scales it needs before the first
 * barrier and writes after the last one it reads across.
 *
 * Departures from the reference's order of fp32 operations: none intended. The inputs' own
 * preparation (l2norm, gate, beta) is the tile kernel's (fp32 sums), so q and k may differ from
 * the reference's by an ulp, and with them, rarely, an fp16 rounding and a code; the checkasm
 * decode family bounds those differences (tests/checkasm/decode.c, arith fp16).
 */
#ifndef STEPQ_KERNELS_CUDA_F16_KERNEL_CUH
#define STEPQ_KERNELS_CUDA_F16_KERNEL_CUH

#include <cuda_fp16.h>

#include "kernels/cuda/tile_kernel.cuh"

/* Blocks per SM the launch bounds ask for by default: 4 (64 registers a thread; 3: 80). */
#define SQ_F16_OCC 4
/* the launch of a KDA layer (hd->f16 == 3 for every head): its own instantiation, so that the
 * run-time-width path's registers do not weigh on the GDN widths' allocation */
#define SQ_V_KDA 256
/* (4 blocks per SM as GDN; at 64 registers the KDA item spills 480 bytes, at 80 (3 blocks,
 * STEPQ__CUDA_F16_OCC3) 156, at 2 blocks none (114 registers): the bench rows compare them) */

/* the smallest power of two >= x (x >= 0 finite; 0 gives 2^-126): step_f16.c's p2 */
__device__ __forceinline__ float sq_p2(float x)
{
    uint32_t e = (__float_as_uint(x) + 0x007FFFFFu) & 0x7F800000u;
    return __uint_as_float(e ? e : 0x00800000u);
}

/* 1 / p for a power of two p in the normal range, exact */
__device__ __forceinline__ float sq_p2inv(float p)
{
    return __uint_as_float(0x7F000000u - __float_as_uint(p));
}

__device__ __forceinline__ float sq_max16(float x)
{
#pragma unroll
    for (int s = 1; s < 16; s <<= 1)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, s));
    return x;
}

/* The stored scale of s (stepq__scale_to_fp16, SATURATED beyond 65504) */
__device__ __forceinline__ uint16_t sq_f16_scale(float s, unsigned &fl)
{
    if (s > STEPQ__SCALE_MAX)
        fl |= STEPQ_HEALTH_SATURATED;
    return sq_scale_h(s);
}

/* Shared memory beside the tile kernel's input phase (sq_tsmem: q, k, v, decay, beta, k.q). */
struct __align__(16) sq_f16_smem
{
    uint32_t cm[8][64]; /* column maxima (half2) per warp */
    uint32_t ct[64];    /* the block's column maxima (half2, scale P) */
    uint32_t qt[64];    /* their quantize factors qmax / c (half2, scale P) */
    float pw[8];        /* P_w per warp */
    float P, iP;        /* the largest P_w and 1 / P (exact: a power of two) */
    uint4 rc[SQ_D];     /* KDA: the rows' constants (sq_f16_rowc) */
    unsigned pm[4];     /* KDA: the pivot rows (bit i % 32 of word i / 32) */
};

/*
 * The input phase of both items: the tile kernel's (sq_tile_in_qk, sq_tile_in_vgb,
 * sq_tile_in_norm) with the l2norm in double. false where an input is not finite: the head
 * keeps its page, its output row is 0, INPUT is raised, and the block has synced (the caller
 * returns). Else *kq = k.q.
 */
__device__ __forceinline__ bool sq_f16_inputs(const sq_step &st, const sq_io &io, int hv, int e,
                                              int HV, int32_t slot, sq_tsmem &sm, const sq_in &in,
                                              int bfi, const sq_tpos &pos, float &kq)
{
    const int t = pos.t;
    bool bad = false;
    if (t < SQ_D)
        bad = sq_tile_in_qk<true>(st, in, sm, bfi, pos);
    else
        bad = sq_tile_in_vgb(st, in, sm, bfi, t);
    if (__syncthreads_or(bad)) {
        sq_input_failed(st, io, e, HV, hv, slot, t, bfi);
        __syncthreads();
        return false;
    }
    kq = sq_tile_in_norm<SQ_SRC_PACKED, true>(st, io, sm, hv, e, HV, pos);
    return true;
}

/* A thread's 4 half2 partial sums of its 8 columns as fp32, times the power of two f (exact). */
__device__ __forceinline__ void sq_f16_widen(const half2 (&h)[4], float f, float (&x)[8])
{
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const float2 v = __half22float2(h[p]);
        x[2 * p] = __fmul_rn(v.x, f), x[2 * p + 1] = __fmul_rn(v.y, f);
    }
}

/* The 8 B-bit codes of a thread's row (lo, hi: 8B bits) as 4 half2 z (exact): half(0x6400 | u)
 * = 1024 + u, z = u - qmax */
template <int B> __device__ __forceinline__ void sq_f16_dec(uint32_t lo, uint32_t hi, half2 (&X)[4])
{
    constexpr uint32_t M = sq_bw<B>::MASK;
    const half2 off = __float2half2_rn(1024.0f + (float)sq_bw<B>::QM);
    const uint64_t W = (uint64_t)lo | ((uint64_t)hi << 32);
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const uint32_t F = (uint32_t)(W >> (2 * p * B));
        X[p] = __hsub2(sq_u2h((F & M) | ((F << (16 - B)) & (M << 16)) | 0x64006400u), off);
    }
}

/* A row's 4 code pairs (the low B bits of each half of T) as the 8B bits lo, hi */
template <int B>
__device__ __forceinline__ void sq_f16_enc(const uint32_t (&T)[4], uint32_t &lo, uint32_t &hi)
{
    constexpr uint32_t M = sq_bw<B>::MASK;
    uint64_t W = 0;
#pragma unroll
    for (int p = 0; p < 4; p++)
        W |= (uint64_t)((T[p] & M) | ((T[p] >> (16 - B)) & (M << B))) << (2 * p * B);
    lo = (uint32_t)W;
    hi = (uint32_t)(W >> 32);
}

/*
 * KDA rows at run-time widths (sq_f16_item<0, V>): row i's constants in shared memory, filled
 * by thread i before the input phase's barrier. x: byte offset of its codes | b << 16 | pivot
 * << 24; y: half2 (qmax, 1536 + qmax); z: half2 (1024 + qmax) twice (the decode's offset); w:
 * RN(1 / qmax) (fp32).
 */
__device__ __forceinline__ uint4 sq_f16_rowc(int b, uint32_t roff)
{
    if (b < 2 || b > 8) /* a pivot row */
        return make_uint4(roff | (16u << 16) | (1u << 24), 0u, 0u, 0u);
    const float qm = (float)((1 << (b - 1)) - 1);
    return make_uint4(roff | ((uint32_t)b << 16), sq_h2u(__floats2half2_rn(qm, 1536.0f + qm)),
                      sq_h2u(__float2half2_rn(1024.0f + qm)), __float_as_uint(1.0f / qm));
}

/* sq_f16_dec at a run-time width b (off: half2 1024 + qmax twice) */
__device__ __forceinline__ void sq_f16_dec_rt(uint32_t lo, uint32_t hi, int b, uint32_t off,
                                              half2 (&X)[4])
{
    const uint32_t M = (1u << b) - 1u, M16 = M << 16, s = 16u - (uint32_t)b;
    const uint32_t w2 = __funnelshift_rc(lo, hi, 4u * (uint32_t)b); /* codes 4..7 */
    const uint32_t F[4] = { lo, lo >> (2 * b), w2, w2 >> (2 * b) };
#pragma unroll
    for (int p = 0; p < 4; p++)
        X[p] = __hsub2(sq_u2h((F[p] & M) | ((F[p] << s) & M16) | 0x64006400u), sq_u2h(off));
}

/* sq_f16_enc at a run-time width b */
__device__ __forceinline__ void sq_f16_enc_rt(const uint32_t (&T)[4], int b, uint32_t &lo,
                                              uint32_t &hi)
{
    const uint32_t M = (1u << b) - 1u, Mb = M << b, s = 16u - (uint32_t)b, s4 = 4u * (uint32_t)b;
    uint32_t P[4];
#pragma unroll
    for (int p = 0; p < 4; p++)
        P[p] = (T[p] & M) | ((T[p] >> s) & Mb);
    const uint32_t A = P[0] | (P[1] << (2 * b)), Bw = P[2] | (P[3] << (2 * b));
    lo = A | __funnelshift_lc(0u, Bw, s4);   /* Bw << 4b (0 for b = 8) */
    hi = __funnelshift_rc(Bw, 0u, 32u - s4); /* Bw >> (32 - 4b) */
}

/*
 * One (entry e, head hv) work item at width B (hd->f16 == 1), or of a KDA head at run-time
 * widths with pivot rows (B == 0, hd->f16 == 3: kernels/quant.h lists what differs). V: the
 * input dtype bit (SQ_V_IN32 or SQ_V_IN16). Ends with a barrier.
 */
template <int B, int V>
__device__ __forceinline__ void sq_f16_item(const sq_step &st, const sq_io &io, int hv, int e,
                                            int HV, int32_t slot, sq_tsmem &sm, sq_f16_smem &fs,
                                            const sq_in &in)
{
    constexpr bool KDA = B == 0;
    constexpr int BW = KDA ? 2 : B; /* (the width the GDN-only code below compiles at) */
    constexpr int QM = KDA ? 1 : sq_bw<BW>::QM;
    constexpr bool REFIT = !(V & SQ_V_NOREFIT); /* the decode fit norefit: no step-6 refit */
    const int t = threadIdx.x, bfi = sq_in_bf16<V>(st);
    const int lane = t & 31, w = t >> 5, tx = lane & 15;
    const sq_tpos pos = { t, lane, w, tx, 8 * (2 * w + (lane >> 4)), 8 * tx };
    const int R0 = pos.R0, C0 = pos.C0;
    const sq_head_desc *hd = io.heads + hv;
    uint8_t *blk = io.pages + (size_t)slot * io.page_stride + hd->block_off;
    const uint8_t *codes = blk; /* codes_offset 0 */
    unsigned fl = 0;
    if (t == 0)
        sm.fl = 0;
    if (KDA && t < SQ_D) {
        const int b = hd->bits[t];
        fs.rc[t] = sq_f16_rowc(b, hd->row_off[t]);
        const unsigned pb = __ballot_sync(0xffffffffu, b == STEPQ_BITS_PIVOT); /* warps 0..3 */
        if (lane == 0)
            fs.pm[w] = pb;
    }

    /* the thread's codes and old scales first: in flight through the input phase (KDA: the
     * widths and offsets of its rows in two vector loads; pivot rows are read in step 2) */
    uint32_t clo[8], chi[8];
    unsigned pm = 0; /* KDA: which of the thread's 8 rows are pivot rows */
    if constexpr (KDA) {
        const uint2 bb = *(const uint2 *)&hd->bits[R0];
        const uint4 ro = *(const uint4 *)&hd->row_off[R0];
        const uint32_t rb[2] = { bb.x, bb.y }, rof[4] = { ro.x, ro.y, ro.z, ro.w };
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int b = (rb[r >> 2] >> (8 * (r & 3))) & 0xFF;
            const uint32_t off = (rof[r >> 1] >> (16 * (r & 1))) & 0xFFFFu;
            clo[r] = chi[r] = 0;
            if (b == STEPQ_BITS_PIVOT)
                pm |= 1u << r;
            else
                sq_ld_codes_rt(codes + off, tx, b, clo[r], chi[r]);
        }
    } else {
#pragma unroll
        for (int r = 0; r < 8; r++)
            sq_ld_codes<B>(codes + (size_t)(R0 + r) * (SQ_D * B / 8), tx, clo[r], chi[r]);
    }
    const uint4 rr = *(const uint4 *)(blk + hd->row_scale_off + 2 * R0);
    const uint4 cc = *(const uint4 *)(blk + hd->col_scale_off + 2 * C0);
    /* column t's old scale for step 1's u (threads 0..127), off the tail's critical path;
     * KDA: and the first pivot row's value in column t, for the readout's pivot terms */
    const float c_t = sq_h2f(((const uint16_t *)(blk + hd->col_scale_off))[t & (SQ_D - 1)]);
    const int piv0 = KDA ? hd->piv0 : SQ_D;
    const float x0_t =
        piv0 < SQ_D ? sq_h2f(((const uint16_t *)(blk + hd->piv0_off))[t & (SQ_D - 1)]) : 0.0f;
    const int myl = (tx >> 1) & 7, src0 = lane & 16; /* the row this lane owns: R0 + myl */

    float kq;
    if (!sq_f16_inputs(st, io, hv, e, HV, slot, sm, in, bfi, pos, kq))
        return;
    const float alpha = sm.dec0, beta = sm.beta, iq = 1.0f / (float)QM;

    half2 X[8][4];
#pragma unroll
    for (int r = 0; r < 8; r++) {
        if constexpr (KDA) {
            const uint4 rc = fs.rc[R0 + r];
            if (pm & (1u << r)) /* a pivot row: 0 through step 1, its update is step 2's */
                X[r][0] = X[r][1] = X[r][2] = X[r][3] = __float2half2_rn(0.0f);
            else
                sq_f16_dec_rt(clo[r], chi[r], (rc.x >> 16) & 0xFFu, rc.z, X[r]);
        } else {
            sq_f16_dec<B>(clo[r], chi[r], X[r]);
        }
    }
    /* the old scales stay packed (4 registers each) and widen where they are used */
    const uint32_t rw[4] = { rr.x, rr.y, rr.z, rr.w }, cw[4] = { cc.x, cc.y, cc.z, cc.w };
    float rf[8];
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const float2 a = __half22float2(sq_u2h(rw[p]));
        rf[2 * p] = a.x, rf[2 * p + 1] = a.y;
    }
    if constexpr (KDA) /* e_i = r_i alpha_i / qmax_i (0 for a pivot row) in place of r_i */
#pragma unroll
        for (int r = 0; r < 8; r++) {
            rf[r] = pm & (1u << r) ? 0.0f
                                   : __fmul_rn(__fmul_rn(rf[r], sm.dec[R0 + r]),
                                               __uint_as_float(fs.rc[R0 + r].w));
        }

    /* 1. the dot products in the code domain */
    {
        float pk[8], pq[8];
        float mk = 0.0f, mq = 0.0f;
#pragma unroll
        for (int r = 0; r < 8; r++) {
            mk = fmaxf(mk, fabsf(__fmul_rn(rf[r], sm.k[R0 + r])));
            mq = fmaxf(mq, fabsf(__fmul_rn(rf[r], sm.q[R0 + r])));
        }
        const float Pk = sq_p2(mk), Pq = sq_p2(mq), iPk = sq_p2inv(Pk), iPq = sq_p2inv(Pq);
        half2 ak[4], aq[4];
#pragma unroll
        for (int p = 0; p < 4; p++)
            ak[p] = aq[p] = __float2half2_rn(0.0f);
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const half2 wk = __float2half2_rn(__fmul_rn(__fmul_rn(rf[r], sm.k[R0 + r]), iPk));
            const half2 wq = __float2half2_rn(__fmul_rn(__fmul_rn(rf[r], sm.q[R0 + r]), iPq));
#pragma unroll
            for (int p = 0; p < 4; p++) {
                ak[p] = __hfma2(X[r][p], wk, ak[p]); /* a KDA pivot row: + 0 (X and e are 0) */
                aq[p] = __hfma2(X[r][p], wq, aq[p]);
            }
        }
        sq_f16_widen(ak, Pk, pk);
        sq_f16_widen(aq, Pq, pq);
        float s, tq;
        sq_colsums(sm.part[0], pk, pq, pos, &s, &tq);
        if (t < SQ_D) {
            const float f = KDA ? c_t : __fmul_rn(__fmul_rn(c_t, alpha), iq);
            s = __fmul_rn(s, f), tq = __fmul_rn(tq, f);
            if (KDA && piv0 < SQ_D) /* the pivot rows' fp32 terms, in row order */
                for (int wd = piv0 >> 5; wd < 4; wd++)
                    for (unsigned m = fs.pm[wd]; m; m &= m - 1) {
                        const int i = 32 * wd + __ffs(m) - 1;
                        float x =
                            i == piv0
                                ? x0_t
                                : sq_h2f(((const uint16_t *)(blk + (fs.rc[i].x & 0xFFFFu)))[t]);
                        x = isfinite(x) ? __fmul_rn(x, sm.dec[i]) : 0.0f;
                        s = __fmaf_rn(x, sm.k[i], s);
                        tq = __fmaf_rn(x, sm.q[i], tq);
                    }
            const float u = __fmul_rn(beta, __fsub_rn(sm.v[t], s));
            sm.cola[t] = u;
            float o = __fmaf_rn(u, kq, tq);
            if (!isfinite(o)) {
                o = 0.0f;
                fl |= STEPQ_HEALTH_OUTPUT;
            }
            sq_st_out(st.o, (size_t)e * st.o_stride + (size_t)hv * SQ_D + t, o, bfi);
        }
    }
    __syncthreads();

    /* 2. the decode and the update in half under the row normalisers N_i */
    float uc[8];
    {
        const float4 a = *(const float4 *)&sm.cola[C0], b = *(const float4 *)&sm.cola[C0 + 4];
        uc[0] = a.x, uc[1] = a.y, uc[2] = a.z, uc[3] = a.w;
        uc[4] = b.x, uc[5] = b.y, uc[6] = b.z, uc[7] = b.w;
    }
    float cf[8];
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const float2 b = __half22float2(sq_u2h(cw[p]));
        cf[2 * p] = b.x, cf[2 * p + 1] = b.y;
    }
    const float r_my = sq_h2f(((const uint16_t *)(blk + hd->row_scale_off))[R0 + myl]);
    const float w_my = hd->w[R0 + myl];
    /* KDA: the owned row's decay, 1 / qmax and kind (a pivot row: no scale, no N_i) */
    const uint4 rc_my = KDA ? fs.rc[R0 + myl] : make_uint4(0u, 0u, 0u, 0u);
    const bool piv_my = KDA && (rc_my.x >> 24);
    float cm = 0.0f, um = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        cm = fmaxf(cm, cf[j]);
        um = fmaxf(um, fabsf(uc[j]));
    }
    cm = sq_max16(cm); /* a half-warp's 16 lanes hold all 128 columns */
    um = sq_max16(um);
    const float Pc = sq_p2(cm), iPc = sq_p2inv(Pc), Su = sq_p2(um), iSu = sq_p2inv(Su);
    half2 C2[4], U2[4];
#pragma unroll
    for (int p = 0; p < 4; p++) {
        C2[p] = __floats2half2_rn(__fmul_rn(cf[2 * p], iPc), __fmul_rn(cf[2 * p + 1], iPc));
        U2[p] = __floats2half2_rn(__fmul_rn(uc[2 * p], iSu), __fmul_rn(uc[2 * p + 1], iSu));
    }
    const float k_my = sm.k[R0 + myl];
    const float ar = piv_my ? 0.0f : __fmul_rn(KDA ? sm.dec[R0 + myl] : alpha, r_my);
    const float iq_my = KDA ? __uint_as_float(rc_my.w) : iq;
    const float N_my = piv_my ? 1.0f : sq_p2(fmaxf(__fmul_rn(ar, Pc), __fmul_rn(fabsf(k_my), um)));
    const float iN = sq_p2inv(N_my);
    {
        const uint32_t FK =
            sq_h2u(__floats2half2_rn(__fmul_rn(__fmul_rn(__fmul_rn(ar, Pc), iq_my), iN),
                                     __fmul_rn(__fmul_rn(k_my, Su), iN)));
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const half2 fk = sq_u2h(__shfl_sync(0xffffffffu, FK, src0 | (2 * r)));
            const half2 F2 = __low2half2(fk), K2 = __high2half2(fk);
#pragma unroll
            for (int p = 0; p < 4; p++)
                X[r][p] = __hfma2(K2, U2[p], __hmul2(__hmul2(X[r][p], F2), C2[p]));
        }
    }
    if (KDA && pm) {
        /* pivot rows: the fp32 step's update of the old values (read again: no registers held
         * them), stored now (no one reads them since the barrier), then zeros in every maximum
         * and sum below; a non-finite old value is 0, STATE */
#pragma unroll
        for (int r = 0; r < 8; r++)
            if (pm & (1u << r)) {
                uint8_t *row = blk + (fs.rc[R0 + r].x & 0xFFFFu) + 16 * tx;
                const uint4 v = *(const uint4 *)row;
                const uint32_t xw[4] = { v.x, v.y, v.z, v.w };
                const float ai = sm.dec[R0 + r], kr = sm.k[R0 + r];
                uint32_t yw[4];
                bool nf = false;
#pragma unroll
                for (int p = 0; p < 4; p++) {
                    float2 x = __half22float2(sq_u2h(xw[p]));
                    nf |= !isfinite(x.x) || !isfinite(x.y);
                    x.x = isfinite(x.x) ? x.x : 0.0f;
                    x.y = isfinite(x.y) ? x.y : 0.0f;
                    float a = __fadd_rn(__fmul_rn(x.x, ai), __fmul_rn(kr, uc[2 * p]));
                    float b = __fadd_rn(__fmul_rn(x.y, ai), __fmul_rn(kr, uc[2 * p + 1]));
                    nf |= !isfinite(a) || !isfinite(b);
                    a = isfinite(a) ? a : 0.0f;
                    b = isfinite(b) ? b : 0.0f;
                    yw[p] = (uint32_t)sq_f16_sat(a, &fl) | ((uint32_t)sq_f16_sat(b, &fl) << 16);
                    X[r][p] = __float2half2_rn(0.0f);
                }
                if (nf)
                    fl |= STEPQ_HEALTH_STATE;
                *(uint4 *)row = make_uint4(yw[0], yw[1], yw[2], yw[3]);
            }
    }

    /* 3. row maxima (reduce-scatter: lane pair myl ends with row R0 + myl's) and row scales */
    float rn_my, yb;
    {
        half2 RM[4];
#pragma unroll
        for (int r = 0; r < 8; r += 2) {
            const half2 m0 = __hmax2(__hmax2(__habs2(X[r][0]), __habs2(X[r][1])),
                                     __hmax2(__habs2(X[r][2]), __habs2(X[r][3])));
            const half2 m1 = __hmax2(__hmax2(__habs2(X[r + 1][0]), __habs2(X[r + 1][1])),
                                     __hmax2(__habs2(X[r + 1][2]), __habs2(X[r + 1][3])));
            RM[r / 2] = __hmax2(__lows2half2(m0, m1), __highs2half2(m0, m1));
        }
        const bool b3 = tx & 8, b2 = tx & 4, b1 = tx & 2;
        half2 k0 = b3 ? RM[2] : RM[0], k1 = b3 ? RM[3] : RM[1];
        const half2 s0 = b3 ? RM[0] : RM[2], s1 = b3 ? RM[1] : RM[3];
        k0 = __hmax2(k0, sq_u2h(__shfl_xor_sync(0xffffffffu, sq_h2u(s0), 8)));
        k1 = __hmax2(k1, sq_u2h(__shfl_xor_sync(0xffffffffu, sq_h2u(s1), 8)));
        half2 kk = b2 ? k1 : k0;
        const half2 sx = b2 ? k0 : k1;
        kk = __hmax2(kk, sq_u2h(__shfl_xor_sync(0xffffffffu, sq_h2u(sx), 4)));
        kk = __hmax2(kk, sq_u2h(__shfl_xor_sync(0xffffffffu, sq_h2u(kk), 2)));
        kk = __hmax2(kk, sq_u2h(__shfl_xor_sync(0xffffffffu, sq_h2u(kk), 1)));
        const float m = __fmul_rn(__half2float(b1 ? __high2half(kk) : __low2half(kk)), N_my);
        const uint16_t rh =
            piv_my ? 0 : sq_f16_scale(sq_dual_row_scale(m, w_my, hd->row_split), fl);
        rn_my = sq_h2f(rh);
        yb = piv_my ? 0.0f : __fdiv_rn(m, rn_my);
        if (!(tx & 1))
            ((uint16_t *)(blk + hd->row_scale_off))[R0 + myl] = rh; /* read by no one since */
    }
    /* 4. P_w over the warp's 16 rows; Y = X R_i; the refit weights A_i / Pa */
    float ybw = fmaxf(yb, __shfl_xor_sync(0xffffffffu, yb, 2));
    ybw = fmaxf(ybw, __shfl_xor_sync(0xffffffffu, ybw, 4));
    ybw = fmaxf(ybw, __shfl_xor_sync(0xffffffffu, ybw, 8));
    ybw = fmaxf(ybw, __shfl_xor_sync(0xffffffffu, ybw, 16));
    const float Pw = sq_p2(ybw);
    uint32_t RA; /* this lane's row: R_i and A_i / Pa (half2), shuffled to the row's lanes */
    float Pa = 0.0f;
    {
        const float R =
            piv_my ? 0.0f : fminf(__fdiv_rn(__fmul_rn(N_my, sq_p2inv(Pw)), rn_my), 65504.0f);
        float Ah = 0.0f;
        if constexpr (REFIT) {
            const float A = __fmul_rn(__fmul_rn(__fmul_rn(w_my, w_my), rn_my), rn_my);
            float Am = fmaxf(A, __shfl_xor_sync(0xffffffffu, A, 2));
            Am = fmaxf(Am, __shfl_xor_sync(0xffffffffu, Am, 4));
            Am = fmaxf(Am, __shfl_xor_sync(0xffffffffu, Am, 8));
            Pa = sq_p2(Am) * (B == 8 ? 4.0f : 1.0f); /* 8 rows of A z^2 below 65504 */
            Ah = __fmul_rn(A, sq_p2inv(Pa));
        }
        RA = sq_h2u(__floats2half2_rn(R, Ah));
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const half2 R2 = __low2half2(sq_u2h(__shfl_sync(0xffffffffu, RA, src0 | (2 * r))));
#pragma unroll
            for (int p = 0; p < 4; p++)
                X[r][p] = __hmul2(X[r][p], R2);
        }
    }
    /* 5. column maxima: 8 rows in-thread, the other half-warp, then the warps in scale P */
    {
        half2 CM[4];
#pragma unroll
        for (int p = 0; p < 4; p++) {
            half2 m = __habs2(X[0][p]);
#pragma unroll
            for (int r = 1; r < 8; r++)
                m = __hmax2(m, __habs2(X[r][p]));
            CM[p] = __hmax2(m, sq_u2h(__shfl_xor_sync(0xffffffffu, sq_h2u(m), 16)));
        }
        if (lane < 16)
            *(uint4 *)&fs.cm[w][4 * tx] =
                make_uint4(sq_h2u(CM[0]), sq_h2u(CM[1]), sq_h2u(CM[2]), sq_h2u(CM[3]));
        if (lane == 0)
            fs.pw[w] = Pw;
    }
    __syncthreads();
    bool csat = false;
    if (t < 64) {
        float P = fs.pw[0];
#pragma unroll
        for (int wi = 1; wi < 8; wi++)
            P = fmaxf(P, fs.pw[wi]);
        /* P_w / P as P_w (1 / P): powers of two, so the product is the quotient, rounded alike */
        const float iP = 1.0f / P;
        half2 m = __float2half2_rn(0.0f);
#pragma unroll
        for (int wi = 0; wi < 8; wi++)
            m = __hmax2(m,
                        __hmul2(sq_u2h(fs.cm[wi][t]), __float2half2_rn(__fmul_rn(fs.pw[wi], iP))));
        fs.ct[t] = sq_h2u(m);
        /* once per column: qmax / c_j with c_j clamped to 65504 / P (a no-op but for the
         * columns that saturate), saturated at 65504 */
        float2 c = __half22float2(m);
        csat = fmaxf(c.x, c.y) * P > STEPQ__SCALE_MAX;
        const float cl = STEPQ__SCALE_MAX * iP;
        c.x = fminf(c.x, cl), c.y = fminf(c.y, cl);
        fs.qt[t] =
            sq_h2u(__floats2half2_rn(c.x > 0.0f ? fminf(__fdiv_rn(QM, c.x), 65504.0f) : 0.0f,
                                     c.y > 0.0f ? fminf(__fdiv_rn(QM, c.y), 65504.0f) : 0.0f));
        /* (KDA: QM = 1, the rows' qmax_i enter at the codes) */
        if (t == 0)
            fs.P = P, fs.iP = iP;
    }
    const bool sat = __syncthreads_or(csat);
    const float P = fs.P, pw = __fmul_rn(Pw, fs.iP); /* = Pw / P */

    /* 6. quantize factors, codes, the refit's partials; codes stored row by row */
    half2 Q2[4];
    {
        const uint4 q4 = *(const uint4 *)&fs.qt[4 * tx];
        const half2 pw2 = __float2half2_rn(pw);
        Q2[0] = __hmul2(sq_u2h(q4.x), pw2), Q2[1] = __hmul2(sq_u2h(q4.y), pw2);
        Q2[2] = __hmul2(sq_u2h(q4.z), pw2), Q2[3] = __hmul2(sq_u2h(q4.w), pw2);
    }
    if (sat && t == 0)
        fl |= STEPQ_HEALTH_SATURATED;
    float pn[8], pd[8];
    {
        const half2 mag = __float2half2_rn(1536.0f + (float)QM);
        half2 an[4], ad[4];
#pragma unroll
        for (int p = 0; p < 4; p++)
            an[p] = ad[p] = __float2half2_rn(0.0f);
#pragma unroll
        for (int r = 0; r < 8; r++) {
            /* the row's refit weight, shuffled again (8 registers fewer than keeping them) */
            const half2 A2 =
                REFIT ? __high2half2(sq_u2h(__shfl_sync(0xffffffffu, RA, src0 | (2 * r))))
                      : __float2half2_rn(0.0f);
            uint32_t T[4];
            if constexpr (KDA) {
                /* T = h(Y Q_w) qmax_i + 1536 + qmax_i; the refit on zt = h(z h(1 / qmax_i)) */
                const uint4 rc = fs.rc[R0 + r];
                const half2 qm = __low2half2(sq_u2h(rc.y)), mg = __high2half2(sq_u2h(rc.y));
                const half2 ih = __float2half2_rn(__uint_as_float(rc.w));
#pragma unroll
                for (int p = 0; p < 4; p++) {
                    half2 Tp = __hfma2(__hmul2(X[r][p], Q2[p]), qm, mg);
                    if (sat)
                        Tp = __hmin2(__hmax2(Tp, __float2half2_rn(1536.0f)), __hadd2(mg, qm));
                    if (REFIT) {
                        const half2 zt = __hmul2(__hsub2(Tp, mg), ih);
                        an[p] = __hfma2(__hmul2(zt, X[r][p]), A2, an[p]);
                        ad[p] = __hfma2(__hmul2(zt, zt), A2, ad[p]);
                    }
                    T[p] = sq_h2u(Tp);
                }
                if (!(pm & (1u << r))) { /* a pivot row was stored in step 2 */
                    const int b = (rc.x >> 16) & 0xFF;
                    uint32_t lo, hi;
                    sq_f16_enc_rt(T, b, lo, hi);
                    sq_st_codes_rt(blk + (rc.x & 0xFFFFu), tx, b, lo, hi);
                }
                continue;
            }
#pragma unroll
            for (int p = 0; p < 4; p++) {
                half2 Tp = __hfma2(X[r][p], Q2[p], mag);
                if (sat)
                    Tp = __hmin2(__hmax2(Tp, __float2half2_rn(1536.0f)),
                                 __float2half2_rn(1536.0f + 2.0f * QM));
                if (REFIT) {
                    const half2 z = __hsub2(Tp, mag);
                    an[p] = __hfma2(__hmul2(z, X[r][p]), A2, an[p]);
                    ad[p] = __hfma2(__hmul2(z, z), A2, ad[p]);
                }
                T[p] = sq_h2u(Tp);
            }
            uint32_t lo, hi;
            sq_f16_enc<BW>(T, lo, hi);
            sq_st_codes<BW>(blk + (size_t)(R0 + r) * (SQ_D * BW / 8), tx, lo, hi);
        }
        const float fa = __fmul_rn(Pa, pw);
        sq_f16_widen(an, fa, pn);
        sq_f16_widen(ad, Pa, pd);
    }
    float n = 0.0f, d = 0.0f;
    if (REFIT) /* norefit: no sums, and no barrier before the column scales */
        sq_colsums(sm.part[0], pn, pd, pos, &n, &d);
    if (t < SQ_D) {
        const float c2 = __half2float(((const half *)fs.ct)[t]);
        const float c = REFIT && d > 0.0f ? __fdiv_rn(__fmul_rn(__fmul_rn((float)QM, P), n), d)
                                          : __fmul_rn(c2, P); /* KDA: QM P = P, exact */
        ((uint16_t *)(blk + hd->col_scale_off))[t] = sq_f16_scale(c, fl);
    }
    if (fl)
        atomicOr(&sm.fl, fl);
    __syncthreads();
    if (t == 0 && sm.fl)
        sq_tile_report(io, sm.fl, slot);
}

/*
 * A pivot head of an fp16 layer (hd->f16 == 2, hd->pivh) in the same launch, so that a layer
 * is one kernel: the C reference steps pivot heads in fp32 (kernels/step.c), and so does
 * sq_pivot_head_step (tile_kernel.cuh), the tile kernel's pivot head item too. This kernel
 * stages no block, so the rows are read after the input phase (its registers and the values'
 * 32 do not fit together).
 *
 * SQ_F16_PIVOT_PREFETCH (default 0; kernels/cuda/AB_RUN.sh variant f16pref): before the input
 * phase each thread asks L2 for one 128-byte line of the head's 32 KiB of rows (no register is
 * held), so that the loads after it find them in L2 rather than in DRAM. For B = 1, where this
 * item is the fp16 layer's slowest block (10.7 us in a graph against 8.8 without the pivot
 * head, H100, session 21); written in session 22 without a device, not yet measured.
 */
#ifndef SQ_F16_PIVOT_PREFETCH
#define SQ_F16_PIVOT_PREFETCH 0
#endif

template <int V>
__device__ __forceinline__ void sq_f16_pivot_item(const sq_step &st, const sq_io &io, int hv, int e,
                                                  int HV, int32_t slot, sq_tsmem &sm,
                                                  const sq_in &in)
{
    const int t = threadIdx.x, bfi = sq_in_bf16<V>(st);
    const int lane = t & 31, w = t >> 5, tx = lane & 15;
    const sq_tpos pos = { t, lane, w, tx, 8 * (2 * w + (lane >> 4)), 8 * tx };
    const sq_head_desc *hd = io.heads + hv;
    uint8_t *blk = io.pages + (size_t)slot * io.page_stride + hd->block_off;
#if SQ_F16_PIVOT_PREFETCH
    static_assert(SQ_THREADS * 128 == SQ_D * 2 * SQ_D, "one line of the rows per thread");
    asm volatile("prefetch.global.L2 [%0];" ::"l"(blk + 128 * t));
#endif
    if (t == 0)
        sm.fl = 0;
    float kq;
    if (!sq_f16_inputs(st, io, hv, e, HV, slot, sm, in, bfi, pos, kq))
        return;
    const float alpha = sm.dec0;
    uint4 X[8];
#pragma unroll
    for (int r = 0; r < 8; r++)
        X[r] = *(const uint4 *)(blk + (size_t)(pos.R0 + r) * (2 * SQ_D) + 16 * tx);
    sq_pivot_head_step<false>(st, io, hv, e, slot, sm, kq, bfi, alpha, X, blk, pos);
}

/*
 * The launch: grid (batch, heads), every head of the layer (hd->f16: 1 at its width, 2 a pivot
 * head; layer prepare refuses a layer with any other); padding entries return at once. V: the
 * input dtype bit, with SQ_V_NOREFIT for the decode fit norefit (kernels/quant.h, step 6).
 */
template <int V, int OCC = SQ_F16_OCC>
__global__ void __launch_bounds__(SQ_THREADS, OCC) sq_f16_kernel(sq_step st, sq_io io)
{
    __shared__ sq_tsmem sm;
    __shared__ sq_f16_smem fs;
    const int hv = blockIdx.y, e = blockIdx.x, HV = gridDim.y;
    const int32_t slot = io.slots ? io.slots[e] : e;
    const sq_head_desc *hd = io.heads + hv;
    if (slot < 0 || slot >= io.n_slots || !hd->f16 || (hd->f16 == 3) != ((V & SQ_V_KDA) != 0))
        return; /* uniform over the block */
    sq_in in;
    sq_load_in<true, V>(in, st, hv, e, HV, threadIdx.x);
    if (hd->f16 == 2) {
        sq_f16_pivot_item<V>(st, io, hv, e, HV, slot, sm, in);
        return;
    }
    if constexpr ((V & SQ_V_KDA) != 0) { /* KDA: run-time widths and pivot rows */
        sq_f16_item<0, V & ~SQ_V_KDA>(st, io, hv, e, HV, slot, sm, fs, in);
        return;
    }
    /* the head's width (2..6 or 8): the tile kernel's one dispatch per head */
    sq_by_width(hd->ubits, [&](auto w) {
        sq_f16_item<decltype(w)::value, V>(st, io, hv, e, HV, slot, sm, fs, in);
    });
}

#endif /* STEPQ_KERNELS_CUDA_F16_KERNEL_CUH */
