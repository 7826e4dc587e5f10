/*
 * The micro-tiled head kernel: one 256-thread block per (entry, value head)
 * of a 128x128 state, every thread owning an 8-row x 8-column tile in 64
 * registers. Used for every quantized page (fused decode step, pack =
 * two-stage stage 2) and for the dense bf16 decode step; unpack_kernel.cuh
 * unpacks; head_kernel.cuh (thread per column) remains for the dense fp32
 * step, two-stage stage 1 and layers whose pages hold dense methods
 * (fp32/bf16/fp16 pages).
 *
 * Thread t: warp w = t / 32, tx = t % 16 (columns 8tx..8tx+7), ty = 2w +
 * (t % 32) / 16 (rows 8ty..8ty+7). A warp holds 16 complete rows, so a row
 * reduction is 8 in-thread operations plus a 4-level reduce-scatter over the
 * 16 lanes of a half-warp (8 shuffles for 8 rows); a column reduction is 8
 * in-thread operations, one reduce-scatter shuffle level between the two
 * half-warps and an 8-way sum over the warps in shared memory.
 *
 * Per element, the fused 6-bit step of a uniform-width head issues about:
 * decode 4 (one LOP3 puts code n under the exponent 150 - p of its bit
 * position p, so the float is exactly 2^(23-p) + u; FADD to the signed code;
 * two FMUL by the row factor r_i dec_i / qmax_i and the column scale), S^T k
 * and S^T q of the decayed state 2 (o = S_dec^T q + u (k.q): one pass),
 * update 1 (FFMA), row max 1, y = x * (1/r_i) 1, column max 1, quantize 1
 * (FFMA with qmax/c_j and 1.5*2^23 = round half to even in the low mantissa
 * bits), pack 1 (bits(t) accumulated by LEA, one constant per word removes
 * the exponent bits: sum bits(t_n) << p_n - sum (bits(1.5*2^23) - qmax) << p_n
 * is the packed word, exactly, mod 2^32), refit 4 (z, z w^2 r^2, two FFMA;
 * qmax is applied to the column scale): about 17 FP32-lane operations plus
 * ~2 of shuffles and shared memory. Mixed-width (KDA) rows and layers
 * without a uniform-width head run one body with run-time widths (shifts by
 * multiples of b, IMAD by 2^(nb) for the pack, a switch on b for the store
 * only): about 5 more per element, but no per-row template switch, no
 * divergence between half-warps of different widths and far less code.
 *
 * Instruction fetch matters (ncu: ~1 stall cycle per instruction in
 * no_instruction with six width paths live): the packed step runs on a
 * (batch, heads) grid, so the blocks resident on the device mostly share a
 * head and therefore one width's code.
 *
 * Differences to the reference (all within the test tolerances): the
 * reconstruction is (z * (r dec RN(1/qmax))) * c instead of
 * ((r c) (z/qmax)) dec, the update uses one FFMA, x / r and y / c are
 * multiplications by the reciprocals, y/c*qmax is y * RN(qmax/c) on uniform
 * heads, and the refit sums are fp32. The state therefore differs in the last
 * ulp, which moves codes only at ties.
 *
 * The decode fit norefit (SQ_V_NOREFIT, a template bit of the packed step
 * and of two-stage stage 2) stores the step-2 column scales instead of the
 * refit: no refit sums in the encode (4 of the ~17 operations per element),
 * no column reduction of num and den, no barrier before it.
 *
 * The decode fit rows (SQ_V_ROWS, likewise) keeps the old block's column
 * scales and refits only the row scales to them (r_i = fp16(max_j |x_ij|
 * RN(1/c_j)), codes at (x RN(1/c_j)) (qmax_i / r_i)): no column max, no
 * refit sums, no column reduction or barrier at all; the row max becomes
 * that of |x| RN(1/c_j) (one FMUL more) and the vote on whether the old
 * block can serve rides on the barriers of the decode and the non-finite
 * check. Where it cannot (a column scale not positive finite, no integer
 * rows, a saturating row; non-finite elements are zeroed first and do not
 * decide it) the head takes the exact fit in the same call, as the
 * reference does (kernels/cuda/README.md).
 */
#ifndef STEPQ_KERNELS_CUDA_TILE_KERNEL_CUH
#define STEPQ_KERNELS_CUDA_TILE_KERNEL_CUH

#include <type_traits>

#include "kernels/cuda/common.cuh"
/* not used here: layer.cu, which launches sq_head_kernel too, includes only this and unpack */
#include "kernels/cuda/head_kernel.cuh"

#define SQ_TMIN_BLOCKS 2
#define SQ_MAGIC       12582912.0f /* 1.5 * 2^23: t = y + MAGIC rounds y half to even */
#define SQ_MAGIC_I     0x4B400000

/* max that propagates NaN (sm_80+): a non-finite element poisons its row max. */
__device__ __forceinline__ float sq_maxnan(float a, float b)
{
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

/* Loads the B bytes of 8 codes at row + tx*B (row 16-byte aligned). */
template <int B>
__device__ __forceinline__ void sq_ld_codes(const uint8_t *row, int tx, uint32_t &lo, uint32_t &hi)
{
    const uint32_t off = (uint32_t)tx * B;
    if (B == 8) {
        uint2 v = *(const uint2 *)(row + off);
        lo = v.x;
        hi = v.y;
    } else if (B == 4) {
        lo = *(const uint32_t *)(row + off);
        hi = 0;
    } else if (B == 2) {
        lo = *(const uint16_t *)(row + off);
        hi = 0;
    } else { /* 3, 5, 6: the bytes lie within two aligned words */
        const uint32_t a = off & ~3u, sh = (off & 3u) * 8u;
        uint32_t w0 = *(const uint32_t *)(row + a), w1 = *(const uint32_t *)(row + a + 4);
        lo = __funnelshift_r(w0, w1, sh);
        hi = w1 >> sh;
    }
}

/* Stores the B bytes of 8 codes at row + tx*B. */
template <int B>
__device__ __forceinline__ void sq_st_codes(uint8_t *row, int tx, uint32_t lo, uint32_t hi)
{
    const uint32_t off = (uint32_t)tx * B;
    if (B == 8) {
        *(uint2 *)(row + off) = make_uint2(lo, hi);
    } else if (B == 4) {
        *(uint32_t *)(row + off) = lo;
    } else if (B == 2) {
        *(uint16_t *)(row + off) = (uint16_t)lo;
    } else if (B == 6) {
        /* 6tx is 0 mod 4 (even tx) or 2 mod 4 (odd): one word and one half-word */
        const bool odd = tx & 1;
        const uint32_t a32 = odd ? off + 2 : off, a16 = odd ? off : off + 4;
        const uint32_t v32 = odd ? __funnelshift_r(lo, hi, 16) : lo;
        *(uint32_t *)(row + a32) = v32;
        *(uint16_t *)(row + a16) = (uint16_t)(odd ? lo : hi);
    } else {
#pragma unroll
        for (int n = 0; n < B; n++)
            row[off + n] = (uint8_t)(n < 4 ? lo >> (8 * n) : hi >> (8 * (n - 4)));
    }
}

/* sq_st_codes at a run-time width b: the one switch on b of the run-time-width path. */
__device__ __forceinline__ void sq_st_codes_rt(uint8_t *row, int tx, int b, uint32_t lo,
                                               uint32_t hi)
{
    switch (b) {
    case 2:
        sq_st_codes<2>(row, tx, lo, hi);
        break;
    case 3:
        sq_st_codes<3>(row, tx, lo, hi);
        break;
    case 4:
        sq_st_codes<4>(row, tx, lo, hi);
        break;
    case 5:
        sq_st_codes<5>(row, tx, lo, hi);
        break;
    case 6:
        sq_st_codes<6>(row, tx, lo, hi);
        break;
    case 8:
        sq_st_codes<8>(row, tx, lo, hi);
        break;
    default:
        break;
    }
}

/* Template bits of the tile kernel, chosen by the host (layer.cu, launch_tile). */
/* grid (batch, heads): resident blocks mostly share a head, so one code path is hot */
#define SQ_V_ORDER 1
/* uniform-width heads on the run-time-width path too (no templated width code in the binary) */
#define SQ_V_RTU 4
/* the pack stages its dense head in shared memory (sq_stage_dense): [V,K] sources only */
#define SQ_V_STAGE 8
/*
 * the step's inputs and o are fp32 (IN32) / bf16 (IN16) in this instantiation;
 * neither: st.in_bf16 at run time. The packed step is instantiated per input
 * dtype: with the run-time flag at every input load (predicated 16- and
 * 32-bit load pairs) it measured 1.5-2% slower at B = 512 on the H200. The
 * dense bf16-state step keeps the flag: at the 128-register limit its timing
 * moves with any change of its code, and a build with fp32-only loads there
 * measured 5-7% slower than with the flag (within 1% of before).
 */
#define SQ_V_IN32 16
#define SQ_V_IN16 32
/*
 * the decode fit norefit (map field decode_fit, kernels/quant.h): the column
 * scales stored are the step-2 ones the codes were rounded with. The refit's
 * sums in the encode (z, z w^2 r^2, two FFMA per element) are then dead
 * code, and its column reduction and barrier are not compiled in
 * (sq_tile_store_packed). Decode steps only: the fused step and two-stage
 * stage 2; a prefill pack never sets it.
 */
#define SQ_V_NOREFIT 64
/*
 * the decode fit rows (map field decode_fit, kernels/quant.h): the column
 * scales of the block read are kept, the row scales refitted to them
 * (sq_tile_store_rows). No column max, no refit sums, no column reduction
 * or barrier for them; the exact fit stays compiled in for the heads whose
 * old block cannot serve (a block-wide vote: sq_tile_finite_rows). Decode
 * steps only, as SQ_V_NOREFIT.
 */
#define SQ_V_ROWS 128

/*
 * SQ_STAGE_BULK (default 0; kernels/cuda/AB_RUN.sh variant bulk): the fused packed step stages
 * its head block by one bulk copy from thread 0 (sq_bulk_stage, common.cuh) instead of 16-byte
 * cp.async from every thread. Written in session 22 without a device, for B = 1 (does one SM
 * take in a block faster through the TMA engine? the GDN pivot head's 32 KiB is the layer's
 * slowest block there) and B = 512 (about 3-4 fewer instructions and a loop per thread); not
 * yet measured.
 */
#ifndef SQ_STAGE_BULK
#define SQ_STAGE_BULK 0
#endif
template <int SRC, bool UPDATE, int SINK>
constexpr bool sq_bulk_step =
    SQ_STAGE_BULK &&SRC == SQ_SRC_PACKED &&UPDATE &&SINK == SQ_SINK_PACKED;

/* Whether the step's inputs are bf16: fixed by the variant bits V, else st.in_bf16. */
template <int V> __device__ __forceinline__ int sq_in_bf16(const sq_step &st)
{
    return (V & SQ_V_IN16) ? 1 : (V & SQ_V_IN32) ? 0 : st.in_bf16;
}

/*
 * Decode of 8 codes of a uniform-width row: code n sits at bit p < 24 - B of an extraction
 * word W (lo, or (hi:lo) shifted by a multiple of the codes per word), and
 * the float with biased exponent 150 - p and mantissa W & (MASK << p) is
 * exactly 2^(23-p) + u: one LOP3 and one FADD per code.
 */
template <int B>
__device__ __forceinline__ void sq_dec_row_e(float *xr, const uint8_t *row, int tx, float rf,
                                             const float (&cc)[8])
{
    uint32_t lo, hi;
    sq_ld_codes<B>(row, tx, lo, hi);
    constexpr int G = 23 / B; /* codes per extraction word */
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const int s = (n / G) * G * B, p = n * B - s;
        const uint32_t W = s == 0 ? lo : s < 32 ? __funnelshift_r(lo, hi, s) : hi >> (s - 32);
        const float f = __uint_as_float(((uint32_t)(150 - p) << 23) | (W & (sq_bw<B>::MASK << p)));
        const float z = f - ((float)(1u << (23 - p)) + (float)sq_bw<B>::QM);
        xr[n] = (z * rf) * cc[n];
    }
}

/* sum over the codes of one 32-bit word of C << position (mod 2^32), C = bits(MAGIC) - qmax */
template <int B> __host__ __device__ constexpr uint32_t sq_pack_k(bool high)
{
    uint32_t k = 0;
    for (int n = 0; n < 8; n++) {
        const int p = n * B;
        const uint32_t C = (uint32_t)SQ_MAGIC_I - (uint32_t)sq_bw<B>::QM;
        if (!high && p + B <= 32)
            k += C << p;
        else if (high && p >= 32)
            k += C << (p - 32);
    }
    return k;
}

/*
 * Quantize of 8 values of a uniform-width row. bits(t) = bits(MAGIC)
 * + z, so sum_n bits(t_n) << p_n - sum_n (bits(MAGIC) - qmax) << p_n is the
 * packed word of u_n = z_n + qmax (exact mod 2^32): one LEA per code and one
 * constant per word; a code across the word boundary takes its exact u. The
 * refit sums carry the common factor a = w^2 r^2 only (qmax is applied to
 * the column scale): num' = sum a z y, den' = sum a z^2, c = qmax num'/den'.
 */
template <int B>
__device__ __forceinline__ void sq_quant_row_e(const float *yr, uint8_t *row, int tx,
                                               const float (&qci)[8], float a, float (&num)[8],
                                               float (&den)[8])
{
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const float t = fmaf(yr[n], qci[n], SQ_MAGIC);
        const uint32_t bt = __float_as_uint(t);
        const int p = n * B;
        if (p + B <= 32) {
            lo += bt << p;
        } else if (p >= 32) {
            hi += bt << (p - 32);
        } else {
            const uint32_t u = bt - ((uint32_t)SQ_MAGIC_I - (uint32_t)sq_bw<B>::QM);
            lo += u << p;
            hi += u >> (32 - p);
        }
        const float z = t - SQ_MAGIC;
        const float za = z * a;
        num[n] = fmaf(za, yr[n], num[n]);
        den[n] = fmaf(za, z, den[n]);
    }
    lo -= sq_pack_k<B>(false);
    hi -= sq_pack_k<B>(true);
    sq_st_codes<B>(row, tx, lo, hi);
}

template <int B>
__device__ __forceinline__ void sq_dec_tile_e(float (&x)[64], const uint8_t *buf, int R0, int tx,
                                              const float *rowf, const float (&cc)[8])
{
#pragma unroll
    for (int r = 0; r < 8; r++)
        sq_dec_row_e<B>(x + 8 * r, buf + (R0 + r) * 16 * B, tx, rowf[R0 + r], cc);
}

template <int B>
__device__ __forceinline__ void sq_quant_tile_e(const float (&x)[64], uint8_t *buf, int R0, int tx,
                                                const float (&ci)[8], const float *a,
                                                float (&num)[8], float (&den)[8])
{
    float qci[8];
#pragma unroll
    for (int c = 0; c < 8; c++)
        qci[c] = ci[c] * (float)sq_bw<B>::QM;
#pragma unroll
    for (int r = 0; r < 8; r++)
        sq_quant_row_e<B>(x + 8 * r, buf + (R0 + r) * 16 * B, tx, qci, a[R0 + r], num, den);
}

/*
 * f(sq_width<B>{}) with B the head's uniform width ub (2..6, or 8: the one width left): the one
 * dispatch per head of the uniform-width templates, so that each of them is one line.
 */
template <int B> struct sq_width {
    static constexpr int value = B;
};

template <class F> __device__ __forceinline__ void sq_by_width(int ub, F &&f)
{
    switch (ub) {
    case 2:
        f(sq_width<2>{});
        break;
    case 3:
        f(sq_width<3>{});
        break;
    case 4:
        f(sq_width<4>{});
        break;
    case 5:
        f(sq_width<5>{});
        break;
    case 6:
        f(sq_width<6>{});
        break;
    default:
        f(sq_width<8>{});
        break;
    }
}

/* sq_dec_tile_e at the head's uniform width ub (2..6 or 8): one dispatch per head. */
__device__ __forceinline__ void sq_dec_tile_ub(float (&x)[64], const uint8_t *buf, int R0, int tx,
                                               const float *rowf, const float (&cc)[8], int ub)
{
    sq_by_width(ub, [&](auto w) { sq_dec_tile_e<decltype(w)::value>(x, buf, R0, tx, rowf, cc); });
}

/* sq_quant_tile_e at the head's uniform width ub (2..6 or 8). */
__device__ __forceinline__ void sq_quant_tile_ub(const float (&x)[64], uint8_t *buf, int R0, int tx,
                                                 const float (&ci)[8], const float *a,
                                                 float (&num)[8], float (&den)[8], int ub)
{
    sq_by_width(
        ub, [&](auto w) { sq_quant_tile_e<decltype(w)::value>(x, buf, R0, tx, ci, a, num, den); });
}

/*
 * Run-time widths: one code path for every width b (2..8), so the
 * rows of a mixed-width (KDA) head need no per-row template switch and the
 * two half-warps of a warp do not diverge on different widths. The b bytes
 * of a thread's 8 codes lie within two aligned words (rows are 16-byte
 * aligned; the kernel's buffer has 16 bytes of slack after the block).
 */
__device__ __forceinline__ void sq_ld_codes_rt(const uint8_t *row, int tx, int b, uint32_t &lo,
                                               uint32_t &hi)
{
    const uint32_t off = (uint32_t)(tx * b), a = off & ~3u, sh = (off & 3u) * 8u;
    const uint32_t w0 = *(const uint32_t *)(row + a), w1 = *(const uint32_t *)(row + a + 4);
    lo = __funnelshift_r(w0, w1, sh);
    hi = w1 >> sh;
}

__device__ __forceinline__ void sq_dec_row_rt(float *xr, const uint8_t *row, int tx, int b,
                                              float rf, const float (&cc)[8])
{
    uint32_t lo, hi;
    sq_ld_codes_rt(row, tx, b, lo, hi);
    const uint32_t mask = (1u << b) - 1u;
    const float zoff = __uint_as_float(0x4B000000u | (mask >> 1)); /* 2^23 + qmax */
    const uint32_t w2 = __funnelshift_rc(lo, hi, 4 * b);           /* codes 4..7 */
    const int s[4] = { 0, b, 2 * b, 3 * b };
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const uint32_t u = ((n < 4 ? lo : w2) >> s[n & 3]) & mask;
        const float z = __uint_as_float(0x4B000000u | u) - zoff;
        xr[n] = (z * rf) * cc[n];
    }
}

/*
 * Codes of 8 values at a run-time width: codes 0..3 and 4..7 are packed into
 * two words by the additive form of sq_quant_row_e (multiplies by 2^(nb)),
 * joined, and stored through a switch on b (the stores only). CL clamps to
 * +-qmax: needed only when a scale saturated (otherwise the fp16 scales cover
 * |y| to within 2^-11 and |z| <= qmax + 0.07 rounds inside the range).
 */
template <bool CL, bool U>
__device__ __forceinline__ void sq_quant_row_rt(const float *yr, uint8_t *row, int tx, int b,
                                                const float (&ci)[8], float ar, float ad,
                                                float (&num)[8], float (&den)[8])
{
    /* U (uniform-width head): ci holds qmax / c_j and ar = w^2 r^2, as sq_quant_row_e */
    const uint32_t qmi = (1u << (b - 1)) - 1u;
    const float qm = __uint_as_float(0x4B000000u | qmi) - 8388608.0f;
    const uint32_t p1 = 1u << b, p2 = 1u << (2 * b), p3 = 1u << (3 * b);
    const uint32_t pw[4] = { 1u, p1, p2, p3 };
    uint32_t A = 0, Bw = 0;
#pragma unroll
    for (int n = 0; n < 8; n++) {
        float t = U ? fmaf(yr[n], ci[n], SQ_MAGIC) : fmaf(yr[n] * ci[n], qm, SQ_MAGIC);
        if (CL)
            t = fminf(fmaxf(t, SQ_MAGIC - qm), SQ_MAGIC + qm);
        const uint32_t bt = __float_as_uint(t);
        if (n < 4)
            A += bt * pw[n & 3];
        else
            Bw += bt * pw[n & 3];
        const float z = t - SQ_MAGIC;
        const float za = z * ar;
        num[n] = fmaf(za, yr[n], num[n]);
        den[n] = U ? fmaf(za, z, den[n]) : fmaf(z * z, ad, den[n]);
    }
    const uint32_t K = ((uint32_t)SQ_MAGIC_I - qmi) * (1u + p1 + p2 + p3);
    A -= K;
    Bw -= K;
    const uint32_t s4 = 4u * (uint32_t)b;
    const uint32_t lo = A | __funnelshift_lc(0u, Bw, s4);   /* Bw << 4b (0 for b = 8) */
    const uint32_t hi = __funnelshift_rc(Bw, 0u, 32u - s4); /* Bw >> (32 - 4b) */
    sq_st_codes_rt(row, tx, b, lo, hi);
}

/*
 * Per-row constants of the run-time-width path (SQ_V_RTU), filled once per
 * block by thread i for row i instead of being recomputed by the 16 lanes of
 * the row in the decode and again in the quantize (~20 integer operations
 * per row and pass: shifts, masks, the powers 2^(nb), the pack constant).
 * Decode: d0 = shifts b, 2b, 3b, 4b; d1 = mask, bits(2^23 + qmax), byte
 * offset of the row's codes. Quantize: q = qmax, the pack constant K
 * (bits); the refit weights stay in sm.ar, sm.ad (with them in the table
 * the unrolled rows of the pack spilled). Pivot rows: d0.x = 0 and the
 * byte offset.
 */
struct __align__(16) sq_rowc
{
    uint4 d0, d1;
    float2 q, pad;
};

__device__ __forceinline__ void sq_rowc_fill(sq_rowc &rc, int b, uint32_t roff)
{
    if (b < 2 || b > 8) {
        rc.d0 = make_uint4(0, 0, 0, 0);
        rc.d1 = make_uint4(0, 0, roff, 0);
        rc.q = rc.pad = make_float2(0.0f, 0.0f);
        return;
    }
    const uint32_t ub = (uint32_t)b, mask = (1u << ub) - 1u, qmi = mask >> 1;
    const uint32_t p1 = 1u << ub, p2 = 1u << (2 * ub), p3 = 1u << (3 * ub);
    rc.d0 = make_uint4(ub, 2 * ub, 3 * ub, 4 * ub);
    rc.d1 = make_uint4(mask, 0x4B000000u | qmi, roff, 0u);
    rc.q = make_float2((float)qmi,
                       __uint_as_float(((uint32_t)SQ_MAGIC_I - qmi) * (1u + p1 + p2 + p3)));
    rc.pad = make_float2(0.0f, 0.0f);
}

/* sq_dec_row_rt with the row's constants from the table (d0, d1). */
__device__ __forceinline__ void sq_dec_row_rc(float *xr, const uint8_t *row, int tx,
                                              const uint4 &d0, const uint4 &d1, float rf,
                                              const float (&cc)[8])
{
    const uint32_t off = (uint32_t)tx * d0.x, a = off & ~3u, sh = (off & 3u) * 8u;
    const uint32_t w0 = *(const uint32_t *)(row + a), w1 = *(const uint32_t *)(row + a + 4);
    const uint32_t lo = __funnelshift_r(w0, w1, sh), hi = w1 >> sh;
    const uint32_t w2 = __funnelshift_rc(lo, hi, d0.w); /* codes 4..7 */
    const float zoff = __uint_as_float(d1.y);
    const uint32_t s[4] = { 0u, d0.x, d0.y, d0.z };
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const uint32_t u = ((n < 4 ? lo : w2) >> s[n & 3]) & d1.x;
        const float z = __uint_as_float(0x4B000000u | u) - zoff;
        xr[n] = (z * rf) * cc[n];
    }
}

/*
 * sq_quant_row_rt<false, false> with the row's constants from the table:
 * the same codes, sums and bytes; the 2^(nb) sums in Horner form (three
 * IMAD by 2^b per word, equal mod 2^32).
 */
__device__ __forceinline__ void sq_quant_row_rc(const float *yr, uint8_t *row, int tx, int b,
                                                const float2 &q, float ar, float ad,
                                                const float (&ci)[8], float (&num)[8],
                                                float (&den)[8])
{
    const float qm = q.x;
    const uint32_t p1 = 1u << b;
    uint32_t A = 0, Bw = 0;
#pragma unroll
    for (int n = 7; n >= 0; n--) { /* Horner from the highest code: one IMAD each */
        const float t = fmaf(yr[n] * ci[n], qm, SQ_MAGIC);
        const uint32_t bt = __float_as_uint(t);
        if (n >= 4)
            Bw = Bw * p1 + bt;
        else
            A = A * p1 + bt;
        const float z = t - SQ_MAGIC;
        const float za = z * ar;
        num[n] = fmaf(za, yr[n], num[n]);
        den[n] = fmaf(z * z, ad, den[n]);
    }
    const uint32_t K = __float_as_uint(q.y);
    A -= K;
    Bw -= K;
    const uint32_t s4 = 4u * (uint32_t)b;
    const uint32_t lo = A | __funnelshift_lc(0u, Bw, s4);   /* Bw << 4b (0 for b = 8) */
    const uint32_t hi = __funnelshift_rc(Bw, 0u, 32u - s4); /* Bw >> (32 - 4b) */
    sq_st_codes_rt(row, tx, b, lo, hi);
}

/*
 * Column partials p[c] (columns 8tx+c of this thread's 8 rows) -> part[w][col]
 * holding the warp's 16 rows: one reduce-scatter level between half-warps.
 */
template <bool MAX>
__device__ __forceinline__ void sq_col_part(const float (&p)[8], float *part, int w, int lane)
{
    const int h = lane >> 4, tx = lane & 15;
    float r[4];
#pragma unroll
    for (int c = 0; c < 4; c++) {
        float send = h ? p[c] : p[c + 4];
        float keep = h ? p[c + 4] : p[c];
        float o = __shfl_xor_sync(0xffffffffu, send, 16);
        r[c] = MAX ? fmaxf(keep, o) : keep + o;
    }
    *(float4 *)(part + w * SQ_D + 8 * tx + 4 * h) = make_float4(r[0], r[1], r[2], r[3]);
}

template <bool MAX> __device__ __forceinline__ float sq_col_total(const float *part, int j)
{
    float s = part[j];
#pragma unroll
    for (int w = 1; w < 8; w++)
        s = MAX ? fmaxf(s, part[w * SQ_D + j]) : s + part[w * SQ_D + j];
    return s;
}

/*
 * Row reduce-scatter over the 16 lanes of a half-warp: v[r] = partial max of
 * row r; returns the full max of row (tx >> 1) on lanes tx and tx ^ 1.
 */
__device__ __forceinline__ float sq_row_max(const float (&m)[8], int tx)
{
    float v[8];
#pragma unroll
    for (int r = 0; r < 8; r++)
        v[r] = m[r];
    {
        const bool up = tx & 8;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float send = up ? v[k] : v[k + 4], keep = up ? v[k + 4] : v[k];
            v[k] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 8));
        }
    }
    {
        const bool up = tx & 4;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            float send = up ? v[k] : v[k + 2], keep = up ? v[k + 2] : v[k];
            v[k] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 4));
        }
    }
    {
        const bool up = tx & 2;
        float send = up ? v[0] : v[1], keep = up ? v[1] : v[0];
        v[0] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 2));
    }
    return fmaxf(v[0], __shfl_xor_sync(0xffffffffu, v[0], 1));
}

/* Dense tile load: fp32 or bf16, [K,V] or [V,K]; 16-byte vectors when `vec`. */
template <int DT>
__device__ __forceinline__ void sq_tload(float (&x)[64], const void *p, size_t off, bool vk,
                                         bool vec, int R0, int C0)
{
    if (vec) {
#pragma unroll
        for (int a = 0; a < 8; a++) {
            /* [K,V]: row R0+a, columns C0..; [V,K]: column C0+a, rows R0.. */
            size_t n = off + (vk ? (size_t)(C0 + a) * SQ_D + R0 : (size_t)(R0 + a) * SQ_D + C0);
            float e[8];
            if (DT == SQ_F32) {
                const float4 *s = (const float4 *)((const float *)p + n);
                float4 u = s[0], v = s[1];
                e[0] = u.x, e[1] = u.y, e[2] = u.z, e[3] = u.w;
                e[4] = v.x, e[5] = v.y, e[6] = v.z, e[7] = v.w;
            } else {
                uint4 u = *(const uint4 *)((const uint16_t *)p + n);
                uint32_t wd[4] = { u.x, u.y, u.z, u.w };
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    e[2 * k] = __uint_as_float(wd[k] << 16);
                    e[2 * k + 1] = __uint_as_float(wd[k] & 0xffff0000u);
                }
            }
#pragma unroll
            for (int b = 0; b < 8; b++)
                x[vk ? b * 8 + a : a * 8 + b] = e[b];
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < 8; c++) {
            size_t n =
                off + (vk ? (size_t)(C0 + c) * SQ_D + R0 + r : (size_t)(R0 + r) * SQ_D + C0 + c);
            x[r * 8 + c] = DT == SQ_F32 ? ((const float *)p)[n] : sq_bf2f(((const uint16_t *)p)[n]);
        }
}

/* Dense tile store; bf16 rounds to nearest even, `sat`: values may round to Inf. */
template <int DT>
__device__ __forceinline__ void sq_tstore(const float (&x)[64], void *p, size_t off, bool vk,
                                          bool vec, int R0, int C0, bool sat, unsigned *fl)
{
    if (vec && !(DT == SQ_BF16 && sat)) {
#pragma unroll
        for (int a = 0; a < 8; a++) {
            size_t n = off + (vk ? (size_t)(C0 + a) * SQ_D + R0 : (size_t)(R0 + a) * SQ_D + C0);
            float e[8];
#pragma unroll
            for (int b = 0; b < 8; b++)
                e[b] = x[vk ? b * 8 + a : a * 8 + b];
            if (DT == SQ_F32) {
                float4 *d = (float4 *)((float *)p + n);
                d[0] = make_float4(e[0], e[1], e[2], e[3]);
                d[1] = make_float4(e[4], e[5], e[6], e[7]);
            } else {
                *(uint4 *)((uint16_t *)p + n) =
                    make_uint4(sq_bf16x2(e[0], e[1]), sq_bf16x2(e[2], e[3]), sq_bf16x2(e[4], e[5]),
                               sq_bf16x2(e[6], e[7]));
            }
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < 8; c++) {
            size_t n =
                off + (vk ? (size_t)(C0 + c) * SQ_D + R0 + r : (size_t)(R0 + r) * SQ_D + C0 + c);
            if (DT == SQ_F32)
                ((float *)p)[n] = x[r * 8 + c];
            else
                ((uint16_t *)p)[n] = sq_bf16_sat(x[r * 8 + c], fl);
        }
}

struct __align__(16) sq_tsmem
{
    float q[SQ_D], k[SQ_D], v[SQ_D], dec[SQ_D];
    float part[2][8 * SQ_D]; /* column partials [quantity][warp][column] */
    float cola[SQ_D], colb[SQ_D];
    float rowf[SQ_D], cold[SQ_D]; /* decode: r dec / qmax (dec for pivots), column scale */
    float rinv[SQ_D], ar[SQ_D], ad[SQ_D];
    float aw[SQ_D]; /* uniform-width heads: refit weight w^2 r^2 */
    uint16_t roff[SQ_D];
    uint8_t bits[SQ_D];
    double l2[4][2];
    float kqp[4];
    float beta, dec0;
    unsigned fl, sat;
};

/*
 * Raw recurrence inputs of one (request, head) as bits (sq_ld_bits), loaded
 * ahead and widened where they are used (sq_bits_f), so that the state
 * tile's loads go out without waiting for them:
 *   threads 0..127 (channel t):         w[0] q, w[1] k
 *   threads 128..255 (channel t - 128): w[0] v, w[1] g, w[2] beta, w[3]
 *       dt_bias, w[4] A_log (the gate's only where the thread has a gate)
 * One array for both halves, so that they share registers. dt_bias and
 * A_log come with the rest instead of in sq_decay, after g: one memory
 * latency fewer before the input check.
 */
struct sq_in {
    uint32_t w[5];
};

/* The input phase runs on all eight warps (sq_in for who loads what). */
template <bool UPDATE, int V>
__device__ __forceinline__ void sq_load_in(sq_in &in, const sq_step &st, int hv, int e, int HV,
                                           int t)
{
    if (!UPDATE)
        return;
    const int hq = hv / (HV / st.H), bf = sq_in_bf16<V>(st);
    if (t < SQ_D) {
        const size_t qh = (size_t)hq * SQ_D + t;
        in.w[0] = sq_ld_bits(st.q, (size_t)e * st.q_stride + qh, bf);
        in.w[1] = sq_ld_bits(st.k, (size_t)e * st.k_stride + qh, bf);
        return;
    }
    const int j = t - SQ_D;
    in.w[0] = sq_ld_bits(st.v, (size_t)e * st.v_stride + (size_t)hv * SQ_D + j, bf);
    if (st.kda || j == 0) {
        in.w[1] =
            sq_ld_bits(st.g, (size_t)e * st.g_stride + (size_t)hv * (st.kda ? SQ_D : 1) + j, bf);
        sq_ld_gate(st, hv, j, in.w[3], in.w[4]);
    }
    if (j == 0)
        in.w[2] = sq_ld_bits(st.beta, (size_t)e * st.beta_stride + hv, bf);
}

/*
 * Staged dense source of the pack of a [V,K] tensor (SQ_V_STAGE). Loaded by
 * sq_tload, a thread's 8 columns x 32 bytes of a [V,K] head coalesce poorly.
 * Measured on the H200 at B = 512 (fp32, us, GDN / KDA): [V,K] 533 / 594
 * direct, 411 / 510 staged; but [K,V] 387 / 447 direct and 406 / 507
 * staged (bf16 [K,V] 327 / 415 direct, 345 / 443 staged): where sq_tload's
 * rows are already contiguous, waiting for the whole head before any
 * arithmetic costs more than it saves. So only [V,K] packs stage.
 * Instead the head's 128 contiguous rows of 128 elements (64 KiB fp32,
 * 32 KiB bf16) are copied into the kernel's buffer with 16-byte cp.async,
 * thread n taking the granules n, n + 256, ... of the head (fully
 * coalesced; 16 or 8 in flight per thread without holding registers),
 * issued before the per-row descriptor setup; each thread then reads its
 * micro-tile from shared memory: the same floats as sq_tload, so the pack
 * is unchanged bit for bit. A tensor without 16-byte alignment
 * (!io.dense_vec) fills the same layout element by element.
 *
 * The buffer also receives the packed block, which is first written after
 * the non-finite check's __syncthreads_or (every micro-tile is in registers
 * by then): hence the two share it and the dynamic size is the larger of
 * the two (layer.cu, pack_smem).
 *
 * Swizzle: 16-byte granule g of staged row a is stored at granule
 * g ^ (g >> 3 & 1) ^ (a >> 3 & 7) of the row. An LDS.128 is served a
 * quarter-warp (8 lanes) at a time, conflict-free when the 8 granules fall
 * in different 16-byte bank groups (granule index mod 8):
 * - cp.async: 8 lanes write 8 consecutive granules of one row (a fixed);
 * - [K,V] reads: 8 lanes (tx = 0..7 or 8..15) read row R0 + r, granule tx
 *   (bf16) or 2tx + k (fp32: granules 0, 2, .., 14 would meet in pairs; the
 *   g >> 3 term moves lanes 4..7 to the odd bank groups);
 * - [V,K] reads: lane tx reads row 8tx + c, one granule fixed by R0 (the
 *   same for all 8 lanes: an 8-way conflict unswizzled); a >> 3 = tx
 *   spreads them over the 8 bank groups.
 */
#define SQ_STAGE_BYTES(es) (SQ_D * SQ_D * (es)) /* staged dense head of es-byte elements */

/* Physical granule of granule g in a staged row of group a8 = row >> 3 (see above). */
__device__ __forceinline__ uint32_t sq_stage_swz(uint32_t a8, uint32_t g)
{
    return g ^ (((g >> 3) & 1u) ^ (a8 & 7u));
}

/* Issues the cp.async copy of one dense head (src: its first element) into buf. */
template <int DT> __device__ __forceinline__ void sq_stage_dense(uint8_t *buf, const void *src)
{
    constexpr uint32_t RB = SQ_D * (DT == SQ_F32 ? 4 : 2), GR = RB / 16; /* row: bytes, granules */
    const uint8_t *s = (const uint8_t *)src;
#pragma unroll
    for (uint32_t it = 0; it < SQ_D * GR / SQ_THREADS; it++) {
        const uint32_t n = it * SQ_THREADS + threadIdx.x, a = n / GR;
        sq_cp_async16(buf + a * RB + 16 * sq_stage_swz(a >> 3, n % GR), s + 16 * n);
    }
    sq_cp_commit();
}

/*
 * Without 16-byte alignment (!io.dense_vec): the same staged layout, one
 * element at a time (plain loads and stores; rare, so not tuned). The tile
 * is then read by the one path above: the fallback through sq_tload made
 * the pack spill (128-152 B; -Xptxas -v).
 */
template <int DT>
__device__ __forceinline__ void sq_stage_dense_scalar(uint8_t *buf, const void *src)
{
    constexpr uint32_t ES = DT == SQ_F32 ? 4 : 2, RB = SQ_D * ES;
#pragma unroll 8
    for (uint32_t n = threadIdx.x; n < SQ_D * SQ_D; n += SQ_THREADS) {
        const uint32_t a = n / SQ_D, o = (n % SQ_D) * ES;
        uint8_t *d = buf + a * RB + 16 * sq_stage_swz(a >> 3, o / 16) + o % 16;
        if (DT == SQ_F32)
            *(float *)d = ((const float *)src)[n];
        else
            *(uint16_t *)d = ((const uint16_t *)src)[n];
    }
}

/*
 * sq_tload (vector case) from the staged head in buf. VK is a template
 * parameter so that each layout has its own loads: with a run-time vk the
 * compiler shared them and transposed through 56 selects.
 */
template <int DT, bool VK>
__device__ __forceinline__ void sq_tload_staged(float (&x)[64], const uint8_t *buf, int R0, int C0)
{
    constexpr uint32_t ES = DT == SQ_F32 ? 4 : 2, RB = SQ_D * ES;
    /* [K,V]: staged rows R0.., elements C0..; [V,K]: rows C0.., elements R0.. */
    const uint32_t a0 = VK ? C0 : R0, g0 = (VK ? R0 : C0) * ES / 16;
    const uint8_t *base = buf + a0 * RB;
    /* the 8 rows share a row group; fp32: g0 is even, so granule g0 + 1 lies at p0 ^ 16 */
    const uint32_t p0 = 16 * sq_stage_swz(a0 >> 3, g0), p1 = p0 ^ 16;
#pragma unroll
    for (int a = 0; a < 8; a++) {
        const uint8_t *row = base + a * RB;
        float e[8];
        if (DT == SQ_F32) {
            float4 u = *(const float4 *)(row + p0), v = *(const float4 *)(row + p1);
            e[0] = u.x, e[1] = u.y, e[2] = u.z, e[3] = u.w;
            e[4] = v.x, e[5] = v.y, e[6] = v.z, e[7] = v.w;
        } else {
            uint4 u = *(const uint4 *)(row + p0);
            uint32_t wd[4] = { u.x, u.y, u.z, u.w };
#pragma unroll
            for (int k = 0; k < 4; k++) {
                e[2 * k] = __uint_as_float(wd[k] << 16);
                e[2 * k + 1] = __uint_as_float(wd[k] & 0xffff0000u);
            }
        }
#pragma unroll
        for (int b = 0; b < 8; b++)
            x[VK ? b * 8 + a : a * 8 + b] = e[b];
    }
}

/* The dense head of (entry e or slot, head hv) into x (sq_tload). */
__device__ __forceinline__ void sq_tload_at(float (&x)[64], const sq_io &io, int32_t slot, int e,
                                            int hv, int R0, int C0)
{
    const size_t off =
        (size_t)(io.dense_by_slot ? slot : e) * io.dense_stride + (size_t)hv * SQ_D * SQ_D;
    if (io.bf16)
        sq_tload<SQ_BF16>(x, io.dense, off, io.layout_vk, io.dense_vec, R0, C0);
    else
        sq_tload<SQ_F32>(x, io.dense, off, io.layout_vk, io.dense_vec, R0, C0);
}

/*
 * A thread's place in the block (the file's comment has the mapping): its
 * warp w, tx = lane % 16, and the first row R0 and column C0 of its 8x8
 * micro-tile. The phases below take it whole, so that their parameters name
 * only what they read and write.
 */
struct sq_tpos {
    int t, lane, w, tx, R0, C0;
};

/* Thread t's place: warp w, tx = t % 16, rows R0 = 8 (2 w + (t % 32) / 16) .., columns 8 tx .. */
__device__ __forceinline__ sq_tpos sq_tile_pos(int t)
{
    const int lane = t & 31, w = t >> 5, tx = lane & 15;
    return { t, lane, w, tx, 8 * (2 * w + (lane >> 4)), 8 * tx };
}

/* Waits for the head block the kernel staged: sq_bulk_stage's under BULK, else any cp.async. */
template <int SRC, bool BULK> __device__ __forceinline__ void sq_tile_stage_wait()
{
    if (BULK)
        sq_bulk_wait();
    else if (SRC != SQ_SRC_DENSE)
        sq_cp_async_wait_all();
}

/*
 * Load: the rows' widths and code offsets (and with SQ_V_RTU their table,
 * rowc) into shared memory, and a dense source into x. A packed source is
 * already on its way into buf (sq_tile_kernel), and so is a staged dense
 * head, which this waits for.
 */
template <int SRC, bool UPDATE, int SINK, int V>
__device__ __forceinline__ void
sq_tile_load(float (&x)[64], const sq_io &io, const sq_head_desc *hd, sq_tsmem &sm, sq_rowc *rowc,
             const uint8_t *buf, int32_t slot, int e, int hv, const sq_tpos &pos)
{
    const int t = pos.t, R0 = pos.R0, C0 = pos.C0;
    constexpr bool packed = SRC == SQ_SRC_PACKED || SINK == SQ_SINK_PACKED;
    constexpr bool ROWC = V & SQ_V_RTU;
    /*
     * Where a dense source is not staged, its loads go first, so that they
     * are in flight while the descriptor loads below wait. Measured on the
     * H200 (B = 512): the GDN pack 385 -> 373 us (its 12-byte spill also
     * went), but the run-time-width (KDA) pack 448 -> 455-458 us, so that
     * one keeps the loads after the per-row table.
     */
    constexpr bool STAGED = !UPDATE && SINK == SQ_SINK_PACKED && (V & SQ_V_STAGE);
    constexpr bool EARLY = SRC == SQ_SRC_DENSE && !STAGED && !(V & SQ_V_RTU);
    if (EARLY)
        sq_tload_at(x, io, slot, e, hv, R0, C0);
    if (packed && t < SQ_D) {
        sm.bits[t] = hd->bits[t];
        sm.roff[t] = hd->row_off[t];
        if (ROWC)
            sq_rowc_fill(rowc[t], hd->bits[t], hd->row_off[t]);
    }

    if (SRC == SQ_SRC_DENSE && !STAGED && !EARLY) {
        sq_tload_at(x, io, slot, e, hv, R0, C0);
    } else if (SRC == SQ_SRC_DENSE && STAGED) {
        /* a [V,K] pack: the head was staged into buf by the caller (sq_stage_dense) */
        sq_cp_async_wait_all();
        __syncthreads();
        if (io.bf16 && io.layout_vk)
            sq_tload_staged<SQ_BF16, true>(x, buf, R0, C0);
        else if (io.bf16)
            sq_tload_staged<SQ_BF16, false>(x, buf, R0, C0);
        else if (io.layout_vk)
            sq_tload_staged<SQ_F32, true>(x, buf, R0, C0);
        else
            sq_tload_staged<SQ_F32, false>(x, buf, R0, C0);
    }
}

/*
 * Inputs, channel t of q and k (threads 0..127): widened from their bits
 * (bf16 when bfi), their squares' warp sums for the l2norm, into shared
 * memory. Returns whether one is not finite. DBL (the fp16 kernel,
 * f16_kernel.cuh): the sums and the norm's reciprocal in double, as the
 * reference's; the fp32 reciprocal is then the same bits but where the two
 * orders of the sum straddle a rounding boundary (~2^-29), so that the fp16
 * kernel's code-domain weights see the reference's k and q (with fp32 sums
 * a third of them differed by an ulp). The tile kernel keeps fp32 sums
 * (the norms agree to ~1e-7): with the double ones its GDN stepq@6 step
 * measured 508-516 us at B = 512 (H200), with fp32 sums 504.7 us.
 */
template <bool DBL> using sq_l2_t = typename std::conditional<DBL, double, float>::type;

template <bool DBL = false>
__device__ __forceinline__ bool sq_tile_in_qk(const sq_step &st, const sq_in &in, sq_tsmem &sm,
                                              int bfi, const sq_tpos &pos)
{
    const int t = pos.t, lane = pos.lane, w = pos.w;
    const float qv = sq_bits_f(in.w[0], bfi), kv = sq_bits_f(in.w[1], bfi);
    /*
     * Not `const bool bad = !isfinite(qv) || !isfinite(kv)`: in a function
     * of its own that form compiles to a 16-bit flag where the kernel had a
     * predicate (8 instructions more in the dense bf16 step).
     */
    bool bad = !isfinite(qv);
    if (!bad)
        bad = !isfinite(kv);
    if (st.l2norm) {
        using A = sq_l2_t<DBL>;
        A sq2 = (A)qv * qv, sk2 = (A)kv * kv;
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            sq2 += __shfl_xor_sync(0xffffffffu, sq2, o);
            sk2 += __shfl_xor_sync(0xffffffffu, sk2, o);
        }
        if (lane == 0) {
            sm.l2[w][0] = sq2; /* a float sum is exact in the double slot */
            sm.l2[w][1] = sk2;
        }
    }
    sm.q[t] = qv;
    sm.k[t] = kv;
    return bad;
}

/*
 * Inputs, channel j = t - 128 of v, its decay (KDA; GDN: j = 0 only) and
 * beta (j = 0), into shared memory (threads 128..255). Returns whether one
 * is not finite.
 */
__device__ __forceinline__ bool sq_tile_in_vgb(const sq_step &st, const sq_in &in, sq_tsmem &sm,
                                               int bfi, int t)
{
    const int j = t - SQ_D;
    const float vv = sq_bits_f(in.w[0], bfi);
    bool bad = !isfinite(vv);
    sm.v[j] = vv;
    if (st.kda || j == 0) {
        float d = sq_decay<false>(st, sq_bits_f(in.w[1], bfi), in.w[3], in.w[4], bad);
        if (st.kda)
            sm.dec[j] = d;
        else
            sm.dec0 = d;
    }
    if (j == 0)
        sm.beta = sq_beta(st, sq_bits_f(in.w[2], bfi), bad);
    return bad;
}

/*
 * Inputs, once all are finite: q and k l2-normalised, q scaled, the GDN
 * decay copied to every row, the head left to two-stage stage 2 (io.skip);
 * waits for a staged packed block. Returns k.q for the readout.
 */
template <int SRC, bool DBL = false, bool BULK = false>
__device__ __forceinline__ float sq_tile_in_norm(const sq_step &st, const sq_io &io, sq_tsmem &sm,
                                                 int hv, int e, int HV, const sq_tpos &pos)
{
    const int t = pos.t, lane = pos.lane, w = pos.w;
    if (t < SQ_D) {
        float sc = st.scale > 0.0f ? st.scale : 0.08838834764831845f; /* 128^-1/2 */
        float qv = sm.q[t], kv = sm.k[t];
        if (st.l2norm) {
            /* as kernels/recurrence.c l2normalize, in the sums' type (sq_tile_in_qk) */
            using A = sq_l2_t<DBL>;
            const A a = ((A)sm.l2[0][0] + (A)sm.l2[1][0]) + ((A)sm.l2[2][0] + (A)sm.l2[3][0]);
            const A b = ((A)sm.l2[0][1] + (A)sm.l2[1][1]) + ((A)sm.l2[2][1] + (A)sm.l2[3][1]);
            qv *= (float)((A)1 / sqrt(a + (A)1e-6));
            kv *= (float)((A)1 / sqrt(b + (A)1e-6));
        }
        qv *= sc;
        sm.q[t] = qv;
        sm.k[t] = kv;
        float p = qv * kv;
#pragma unroll
        for (int o = 16; o; o >>= 1)
            p += __shfl_xor_sync(0xffffffffu, p, o);
        if (lane == 0)
            sm.kqp[w] = p;
    } else if (!st.kda) {
        sm.dec[t - SQ_D] = sm.dec0;
    }
    if (io.skip && t == 0)
        io.skip[(size_t)e * HV + hv] = 0;
    sq_tile_stage_wait<SRC, BULK>();
    __syncthreads();
    return (sm.kqp[0] + sm.kqp[1]) + (sm.kqp[2] + sm.kqp[3]);
}

/*
 * The rows of a head without a uniform width (and with SQ_V_RTU, every
 * head): fp16 pivot rows, or codes at each row's width b, decoded with the
 * row's constants from the table (ROWC) or computed per lane.
 */
template <bool ROWC>
__device__ __forceinline__ void sq_dec_tile_rows(float (&x)[64], const uint8_t *buf,
                                                 const sq_tsmem &sm, const sq_rowc *rowc, int R0,
                                                 int tx, const float (&cc)[8])
{
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int i = R0 + r;
        uint4 d0 = make_uint4(0, 0, 0, 0), d1 = d0;
        if (ROWC) {
            d0 = rowc[i].d0;
            d1 = rowc[i].d1;
        }
        const int b = ROWC ? (d0.x ? (int)d0.x : STEPQ_BITS_PIVOT) : sm.bits[i];
        const float rf = sm.rowf[i];
        const uint8_t *row = buf + (ROWC ? d1.z : sm.roff[i]);
        float *xr = x + 8 * r;
        if (b == STEPQ_BITS_PIVOT) {
            uint4 v = *(const uint4 *)(row + 16 * tx);
            uint32_t wd[4] = { v.x, v.y, v.z, v.w };
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&wd[k]));
                xr[2 * k] = f.x * rf;
                xr[2 * k + 1] = f.y * rf;
            }
        } else if (ROWC) {
            sq_dec_row_rc(xr, row, tx, d0, d1, rf, cc);
        } else {
            sq_dec_row_rt(xr, row, tx, b, rf, cc);
        }
    }
}

/*
 * Decode of the staged block into x: the row factors r_i dec_i / qmax_i (the
 * decay folded in: no pass of its own) and the column scales, then the
 * codes at the head's uniform width or row by row.
 */
template <bool UPDATE, int V>
__device__ __forceinline__ bool sq_tile_decode(float (&x)[64], const uint8_t *buf,
                                               const sq_head_desc *hd, sq_tsmem &sm,
                                               const sq_rowc *rowc, const sq_tpos &pos)
{
    const int t = pos.t, tx = pos.tx, R0 = pos.R0, C0 = pos.C0;
    constexpr bool RTU = V & SQ_V_RTU, ROWC = V & SQ_V_RTU, ROWS = V & SQ_V_ROWS;
    bool bad = false; /* SQ_V_ROWS: column t's old scale cannot serve */
    if (t < SQ_D) {
        int b = sm.bits[t];
        float d = UPDATE ? sm.dec[t] : 1.0f;
        float r = sq_h2f(((const uint16_t *)(buf + hd->row_scale_off))[t]);
        sm.rowf[t] = b == STEPQ_BITS_PIVOT ? d : (r * d) * sq_iqm[b & 15];
        if constexpr (ROWS) {
            /* the old row scale, for the growth trigger (unused until an exact fit) */
            sm.ar[t] = r;
            const uint16_t ch = hd->has_col ? ((const uint16_t *)(buf + hd->col_scale_off))[t] : 0;
            sm.cold[t] = hd->has_col ? sq_h2f(ch) : 1.0f;
            sm.ad[t] = __frcp_rn(sq_h2f(ch)); /* rc_j = RN(1/c_j), once per column */
            bad = !sq_rows_col_ok(ch);
        } else {
            sm.cold[t] =
                hd->has_col ? sq_h2f(((const uint16_t *)(buf + hd->col_scale_off))[t]) : 1.0f;
        }
    }
    /* the block-wide flag of the fit rows rides on the barrier the decode needs anyway */
    bool colbad = false;
    if (ROWS)
        colbad = __syncthreads_or(bad);
    else
        __syncthreads();
    float cc[8];
    {
        float4 a = *(const float4 *)(sm.cold + C0), b = *(const float4 *)(sm.cold + C0 + 4);
        cc[0] = a.x, cc[1] = a.y, cc[2] = a.z, cc[3] = a.w;
        cc[4] = b.x, cc[5] = b.y, cc[6] = b.z, cc[7] = b.w;
    }
    const int ub = hd->ubits; /* one width for every row: one dispatch per head */
    if (ub && !RTU)
        sq_dec_tile_ub(x, buf, R0, tx, sm.rowf, cc, ub);
    else
        sq_dec_tile_rows<ROWC>(x, buf, sm, rowc, R0, tx, cc);
    return colbad;
}

/*
 * SQ_V_ROWS with a dense source (two-stage stage 2): the old column scales
 * and row scales (the latter into sm.ar, for the growth trigger) from the
 * page itself (blk, global memory: stage 1 left it as it was), as
 * sq_tile_decode loads them from the staged block. Returns the
 * block-wide flag that one cannot serve.
 */
__device__ __forceinline__ bool sq_tile_rows_cols(const uint8_t *blk, const sq_head_desc *hd,
                                                  sq_tsmem &sm, int t)
{
    bool bad = false;
    if (t < SQ_D) {
        const uint16_t ch = hd->has_col ? ((const uint16_t *)(blk + hd->col_scale_off))[t] : 0;
        sm.ar[t] = sq_h2f(((const uint16_t *)(blk + hd->row_scale_off))[t]); /* the old r_i */
        sm.cold[t] = sq_h2f(ch);
        sm.ad[t] = __frcp_rn(sq_h2f(ch));
        bad = !sq_rows_col_ok(ch);
    }
    return __syncthreads_or(bad);
}

/* The decay of a dense source (a packed one has it in its row factors). */
__device__ __forceinline__ void sq_tile_decay(float (&x)[64], const sq_tsmem &sm, int R0)
{
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const float d = sm.dec[R0 + r];
#pragma unroll
        for (int c = 0; c < 8; c++)
            x[r * 8 + c] *= d;
    }
}

/*
 * The delta rule on the decayed state: S^T k and S^T q in one pass (the
 * readout is o = S_dec^T q + u (k.q)), u = (v - S^T k) beta per column, and
 * the rank-1 update x += k u^T. Leaves u in sm.cola and S_dec^T q in sm.colb.
 */
__device__ __forceinline__ void sq_tile_update(float (&x)[64], sq_tsmem &sm, const sq_tpos &pos)
{
    const int t = pos.t, lane = pos.lane, w = pos.w, R0 = pos.R0, C0 = pos.C0;
    float pk[8], pq[8];
#pragma unroll
    for (int c = 0; c < 8; c++)
        pk[c] = pq[c] = 0.0f;
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const float kr = sm.k[R0 + r], qr = sm.q[R0 + r];
#pragma unroll
        for (int c = 0; c < 8; c++) {
            pk[c] = fmaf(x[r * 8 + c], kr, pk[c]);
            pq[c] = fmaf(x[r * 8 + c], qr, pq[c]);
        }
    }
    sq_col_part<false>(pk, sm.part[0], w, lane);
    sq_col_part<false>(pq, sm.part[1], w, lane);
    __syncthreads(); /* also: every read of the staged old block is done */
    {
        const int j = t & (SQ_D - 1);
        if (t < SQ_D)
            sm.cola[j] = (sm.v[j] - sq_col_total<false>(sm.part[0], j)) * sm.beta;
        else
            sm.colb[j] = sq_col_total<false>(sm.part[1], j);
    }
    __syncthreads();
    float uu[8];
    {
        float4 a = *(const float4 *)(sm.cola + C0), b = *(const float4 *)(sm.cola + C0 + 4);
        uu[0] = a.x, uu[1] = a.y, uu[2] = a.z, uu[3] = a.w;
        uu[4] = b.x, uu[5] = b.y, uu[6] = b.z, uu[7] = b.w;
    }
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const float kr = sm.k[R0 + r];
#pragma unroll
        for (int c = 0; c < 8; c++)
            x[r * 8 + c] = fmaf(kr, uu[c], x[r * 8 + c]);
    }
}

/*
 * The row maxima m of |x| that the row scales need, NaN-propagating so that
 * they also detect non-finite elements. A block with one (rare) sets them to
 * 0 (health STATE) and recomputes S^T q from the sanitised state into
 * sm.colb. Returns whether it did (then the readout is sm.colb alone).
 */
template <bool UPDATE>
__device__ __forceinline__ bool sq_tile_finite(float (&x)[64], float (&m)[8], sq_tsmem &sm,
                                               unsigned &fl, const sq_tpos &pos)
{
    const int t = pos.t, lane = pos.lane, w = pos.w, R0 = pos.R0;
#pragma unroll
    for (int r = 0; r < 8; r++) {
        float a = sq_maxnan(fabsf(x[r * 8]), fabsf(x[r * 8 + 1]));
        float b = sq_maxnan(fabsf(x[r * 8 + 2]), fabsf(x[r * 8 + 3]));
        float c = sq_maxnan(fabsf(x[r * 8 + 4]), fabsf(x[r * 8 + 5]));
        float d = sq_maxnan(fabsf(x[r * 8 + 6]), fabsf(x[r * 8 + 7]));
        m[r] = sq_maxnan(sq_maxnan(a, b), sq_maxnan(c, d));
    }
    bool nf = false;
#pragma unroll
    for (int r = 0; r < 8; r++)
        nf |= !(m[r] <= 3.402823466e38f);
    const bool slow = __syncthreads_or(nf);
    if (slow) {
        /* rare: non-finite elements become 0; the readout is recomputed */
        if (nf)
            fl |= STEPQ_HEALTH_STATE;
#pragma unroll
        for (int r = 0; r < 8; r++) {
            float mm = 0.0f;
#pragma unroll
            for (int c = 0; c < 8; c++) {
                if (!isfinite(x[r * 8 + c]))
                    x[r * 8 + c] = 0.0f;
                mm = fmaxf(mm, fabsf(x[r * 8 + c]));
            }
            m[r] = mm;
        }
        if (UPDATE) {
            float pq[8];
#pragma unroll
            for (int c = 0; c < 8; c++) {
                pq[c] = 0.0f;
#pragma unroll
                for (int r = 0; r < 8; r++)
                    pq[c] = fmaf(x[r * 8 + c], sm.q[R0 + r], pq[c]);
            }
            sq_col_part<false>(pq, sm.part[1], w, lane);
            __syncthreads();
            if (t < SQ_D)
                sm.colb[t] = sq_col_total<false>(sm.part[1], t);
            __syncthreads();
        }
    }
    return slow;
}

/*
 * The thread's partial row maxima of the fit rows, m_i = max_j |x_ij| rc_j
 * (rc_j = RN(1/c_j) in sm.ad; pivot rows: max |x_ij|), NaN-propagating;
 * returns whether one would not serve: not finite, or above 65504 on an
 * integer row (its scale would saturate; a finite x whose product
 * overflows lands here too), or above STEPQ__ROWS_GROW times the row's
 * old scale (sm.ar: the growth trigger; a partial maximum exceeds it
 * exactly where the row's maximum does, so no row reduction first).
 */
__device__ __forceinline__ bool sq_rows_maxima(const float (&x)[64], float (&m)[8],
                                               const sq_tsmem &sm, int R0, int C0)
{
    float4 a = *(const float4 *)(sm.ad + C0), b = *(const float4 *)(sm.ad + C0 + 4);
    const float rc[8] = { a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w };
    float4 g = *(const float4 *)(sm.ar + R0), h = *(const float4 *)(sm.ar + R0 + 4);
    const float ro[8] = { g.x, g.y, g.z, g.w, h.x, h.y, h.z, h.w };
    bool v = false;
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const bool piv = sm.bits[R0 + r] == STEPQ_BITS_PIVOT;
        float p[8];
#pragma unroll
        for (int c = 0; c < 8; c++)
            p[c] = piv ? fabsf(x[r * 8 + c]) : fabsf(x[r * 8 + c]) * rc[c];
        const float e = sq_maxnan(sq_maxnan(p[0], p[1]), sq_maxnan(p[2], p[3]));
        const float f = sq_maxnan(sq_maxnan(p[4], p[5]), sq_maxnan(p[6], p[7]));
        m[r] = sq_maxnan(e, f);
        v |= !(m[r] <= (piv ? 3.402823466e38f : STEPQ__SCALE_MAX));
        v |= !piv && m[r] > STEPQ__ROWS_GROW * ro[r]; /* the growth trigger */
    }
    return v;
}

/*
 * SQ_V_ROWS: the row maxima the fit rows needs (sq_rows_maxima) and one
 * block-wide vote, in place of sq_tile_finite's barrier on the common
 * path, on colbad (a column scale not positive finite, or no integer rows),
 * a non-finite element or a saturating row. Where it says no (rare),
 * sq_tile_finite runs as in the exact variants; where that zeroed
 * non-finite elements (health STATE, the readout recomputed), the rows fit
 * may still serve the sanitised state (the reference's update zeroes them
 * before its fit: kernels/quant.h), which a second vote on its maxima
 * decides. *exact: the head takes the exact fit.
 */
template <bool UPDATE>
__device__ __forceinline__ bool sq_tile_finite_rows(float (&x)[64], float (&m)[8], sq_tsmem &sm,
                                                    unsigned &fl, const sq_tpos &pos, bool colbad,
                                                    bool &exact)
{
    const int R0 = pos.R0, C0 = pos.C0;
    bool v = colbad; /* uniform over the block */
    if (!colbad)
        v = sq_rows_maxima(x, m, sm, R0, C0);
    exact = __syncthreads_or(v);
    if (!exact)
        return false;
    const bool slow = sq_tile_finite<UPDATE>(x, m, sm, fl, pos);
    if (slow && !colbad) { /* rare: non-finite elements were zeroed */
        float m2[8];
        exact = __syncthreads_or(sq_rows_maxima(x, m2, sm, R0, C0));
        if (!exact)
#pragma unroll
            for (int r = 0; r < 8; r++)
                m[r] = m2[r];
    }
    return slow;
}

/* Readout o of column t (bf16 when bfi); a non-finite one is stored as 0 (health OUTPUT). */
__device__ __forceinline__ void sq_tile_readout(const sq_step &st, const sq_tsmem &sm, float kq,
                                                bool slow, int e, int hv, int bfi, unsigned &fl,
                                                int t)
{
    if (t < SQ_D) {
        float o = slow ? sm.colb[t] : fmaf(sm.cola[t], kq, sm.colb[t]);
        if (!isfinite(o)) {
            o = 0.0f;
            fl |= STEPQ_HEALTH_OUTPUT;
        }
        sq_st_out(st.o, (size_t)e * st.o_stride + (size_t)hv * SQ_D + t, o, bfi);
    }
}

/*
 * Store into the dense sink. bf16: the saturating scalar path only where
 * the tile's maximum would round to Inf (sq_tstore).
 */
__device__ __forceinline__ void sq_tile_store_dense(const float (&x)[64], const float (&m)[8],
                                                    const sq_io &io, int32_t slot, int e, int hv,
                                                    unsigned &fl, const sq_tpos &pos)
{
    const int R0 = pos.R0, C0 = pos.C0;
    size_t off = (size_t)(io.dense_by_slot ? slot : e) * io.dense_stride + (size_t)hv * SQ_D * SQ_D;
    if (io.bf16) {
        float mx = 0.0f;
#pragma unroll
        for (int r = 0; r < 8; r++)
            mx = fmaxf(mx, m[r]);
        bool sat = __float_as_uint(mx) >= 0x7F7F8000u; /* rounds to Inf in bf16 */
        sq_tstore<SQ_BF16>(x, io.dense, off, io.layout_vk, io.dense_vec, R0, C0, sat, &fl);
    } else {
        sq_tstore<SQ_F32>(x, io.dense, off, io.layout_vk, io.dense_vec, R0, C0, false, &fl);
    }
}

/*
 * Fit, rows: the scale of row R0 + tx/2 from its maximum mr on lanes tx
 * even (fp16 into the block; saturation raises SATURATED and sm.sat), with
 * its reciprocal and the refit weights into shared memory.
 */
__device__ __forceinline__ void sq_tile_fit_rows(const float (&m)[8], const sq_head_desc *hd,
                                                 bool dual, sq_tsmem &sm, uint8_t *buf,
                                                 unsigned &fl, const sq_tpos &pos)
{
    const int tx = pos.tx, R0 = pos.R0;
    float mr = sq_row_max(m, tx);
    if (!(tx & 1)) {
        const int i = R0 + (tx >> 1);
        const int b = sm.bits[i];
        float ri = 0.0f, ar = 0.0f, ad = 0.0f, aw = 0.0f;
        uint16_t h = 0;
        if (b != STEPQ_BITS_PIVOT) {
            const float wi = hd->w[i];
            float s = dual ? sq_dual_row_scale(mr, wi, hd->row_split) : mr;
            if (s > STEPQ__SCALE_MAX) {
                fl |= STEPQ_HEALTH_SATURATED;
                sm.sat = 1;
            }
            h = sq_scale_h(s);
            float r = sq_h2f(h);
            const float iq = __fdividef(1.0f, (float)((1 << (b - 1)) - 1));
            const float w2r2 = wi * wi * r * r;
            ri = __frcp_rn(r);
            ar = w2r2 * iq; /* refit weights: a relative 1e-7 is immaterial */
            ad = ar * iq;
            aw = w2r2; /* uniform-width heads: qmax goes to the column scale */
        }
        sm.rinv[i] = ri;
        sm.ar[i] = ar;
        sm.ad[i] = ad;
        sm.aw[i] = aw;
        ((uint16_t *)(buf + hd->row_scale_off))[i] = h;
    }
}

/* Encode, pivot rows: their fp16 values straight into the block (none in a uniform-width head). */
__device__ __forceinline__ void sq_tile_store_pivots(const float (&x)[64], const sq_head_desc *hd,
                                                     const sq_tsmem &sm, uint8_t *buf, unsigned &fl,
                                                     int R0, int tx)
{
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int i = R0 + r;
        if (!hd->ubits && sm.bits[i] == STEPQ_BITS_PIVOT) {
            uint16_t hb[8];
#pragma unroll
            for (int c = 0; c < 8; c++)
                hb[c] = sq_f16_sat(x[r * 8 + c], &fl);
            *(uint4 *)(buf + sm.roff[i] + 16 * tx) =
                make_uint4(hb[0] | (uint32_t)hb[1] << 16, hb[2] | (uint32_t)hb[3] << 16,
                           hb[4] | (uint32_t)hb[5] << 16, hb[6] | (uint32_t)hb[7] << 16);
        }
    }
}

/*
 * Fit, columns: y = x / r in place of x (0 on pivot rows), then on dual
 * heads the column scales c_j of max |y| (saturation raises SATURATED and
 * sm.sat; c_j into sm.cola for the refit) and ci = 1 / c_j; else ci = 1.
 */
__device__ __forceinline__ void sq_tile_fit_cols(float (&x)[64], float (&ci)[8], bool dual,
                                                 sq_tsmem &sm, unsigned &fl, const sq_tpos &pos)
{
    const int t = pos.t, lane = pos.lane, w = pos.w, R0 = pos.R0, C0 = pos.C0;
    {
        float4 a = *(const float4 *)(sm.rinv + R0), b = *(const float4 *)(sm.rinv + R0 + 4);
        const float ri[8] = { a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w };
#pragma unroll
        for (int r = 0; r < 8; r++)
#pragma unroll
            for (int c = 0; c < 8; c++)
                x[r * 8 + c] *= ri[r];
    }
    if (dual) {
        float pc[8];
#pragma unroll
        for (int c = 0; c < 8; c++) {
            float a = fmaxf(fabsf(x[c]), fabsf(x[8 + c]));
            float b = fmaxf(fabsf(x[16 + c]), fabsf(x[24 + c]));
            float d = fmaxf(fabsf(x[32 + c]), fabsf(x[40 + c]));
            float f = fmaxf(fabsf(x[48 + c]), fabsf(x[56 + c]));
            pc[c] = fmaxf(fmaxf(a, b), fmaxf(d, f));
        }
        sq_col_part<true>(pc, sm.part[0], w, lane);
        __syncthreads();
        if (t < SQ_D) {
            const int j = t;
            const float cm = sq_col_total<true>(sm.part[0], t);
            if (cm > STEPQ__SCALE_MAX) {
                fl |= STEPQ_HEALTH_SATURATED;
                sm.sat = 1;
            }
            float c = sq_h2f(sq_scale_h(cm));
            sm.cola[j] = c;
            sm.colb[j] = __frcp_rn(c);
        }
        __syncthreads();
        float4 a = *(const float4 *)(sm.colb + C0), b = *(const float4 *)(sm.colb + C0 + 4);
        ci[0] = a.x, ci[1] = a.y, ci[2] = a.z, ci[3] = a.w;
        ci[4] = b.x, ci[5] = b.y, ci[6] = b.z, ci[7] = b.w;
    } else {
        __syncthreads(); /* sm.sat */
#pragma unroll
        for (int c = 0; c < 8; c++)
            ci[c] = 1.0f;
    }
}

/*
 * The codes and refit sums of the thread's 8 rows on the run-time-width
 * path: U, a uniform-width head (width ub, ci = qmax / c_j); else each row's
 * width, pivot rows skipped. CL: clamp (a scale saturated).
 */
template <bool CL, bool U>
__device__ __forceinline__ void
sq_quant_tile_rt(const float (&x)[64], uint8_t *buf, const sq_tsmem &sm, int R0, int tx, int ub,
                 const float (&ci)[8], float (&num)[8], float (&den)[8])
{
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int i = R0 + r;
        const int b = U ? ub : sm.bits[i];
        if (U || b != STEPQ_BITS_PIVOT)
            sq_quant_row_rt<CL, U>(x + 8 * r, buf + sm.roff[i], tx, b, ci, U ? sm.aw[i] : sm.ar[i],
                                   sm.ad[i], num, den);
    }
}

/*
 * Encode, codes: y (in x) quantized at 1 / c_j = ci into the block with the
 * refit sums num, den of its columns. The uniform-width templates unless
 * SQ_V_RTU; clamped where a scale saturated (clamp); else row by row.
 */
template <int V>
__device__ __forceinline__ void sq_tile_encode(const float (&x)[64], const float (&ci)[8], int ub,
                                               bool clamp, const sq_tsmem &sm, const sq_rowc *rowc,
                                               uint8_t *buf, float (&num)[8], float (&den)[8],
                                               const sq_tpos &pos)
{
    const int tx = pos.tx, R0 = pos.R0;
    constexpr bool RTU = V & SQ_V_RTU, ROWC = V & SQ_V_RTU;
    float qci[8]; /* RTU: qmax / c_j of a uniform-width head */
    if (ub && !clamp && !RTU) {
        sq_quant_tile_ub(x, buf, R0, tx, ci, sm.aw, num, den, ub);
    } else if (ub && !clamp) {
        const float qm = (float)((1 << (ub - 1)) - 1);
#pragma unroll
        for (int c = 0; c < 8; c++)
            qci[c] = ci[c] * qm;
        sq_quant_tile_rt<false, true>(x, buf, sm, R0, tx, ub, qci, num, den);
    } else if (clamp) {
        sq_quant_tile_rt<true, false>(x, buf, sm, R0, tx, ub, ci, num, den);
    } else if (ROWC) {
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int i = R0 + r;
            const int b = sm.bits[i];
            if (b != STEPQ_BITS_PIVOT)
                sq_quant_row_rc(x + 8 * r, buf + sm.roff[i], tx, b, rowc[i].q, sm.ar[i], sm.ad[i],
                                ci, num, den);
        }
    } else {
        sq_quant_tile_rt<false, false>(x, buf, sm, R0, tx, ub, ci, num, den);
    }
}

/*
 * Fit, refit: the column scales of a dual head from the fixed codes, c_j =
 * num / den (sq_quant_row_e left qmax out of the sums; den = 0 keeps c_j),
 * into the block; 0 without integer rows, or where the layout has column
 * scales but the head is not dual.
 */
__device__ __forceinline__ void sq_tile_refit(const float (&num)[8], const float (&den)[8],
                                              const sq_head_desc *hd, bool dual, int ub, bool clamp,
                                              sq_tsmem &sm, uint8_t *buf, unsigned &fl,
                                              const sq_tpos &pos)
{
    const int t = pos.t, lane = pos.lane, w = pos.w;
    if (dual) {
        sq_col_part<false>(num, sm.part[0], w, lane);
        sq_col_part<false>(den, sm.part[1], w, lane);
        __syncthreads();
        if (t < SQ_D) {
            const int j = t;
            uint16_t h = 0;
            if (hd->any_int) {
                const float nm = sq_col_total<false>(sm.part[0], t);
                const float dn = sq_col_total<false>(sm.part[1], t);
                if (dn > 0.0f) {
                    /* sq_quant_row_e left qmax out of the sums */
                    float c = ub && !clamp ? (nm * (float)((1 << (ub - 1)) - 1)) / dn : nm / dn;
                    if (c > STEPQ__SCALE_MAX)
                        fl |= STEPQ_HEALTH_SATURATED;
                    h = sq_scale_h(c);
                } else {
                    h = sq_scale_h(sm.cola[j]);
                }
            }
            ((uint16_t *)(buf + hd->col_scale_off))[j] = h;
        }
    } else if (hd->has_col && t < SQ_D) {
        ((uint16_t *)(buf + hd->col_scale_off))[t] = 0;
    }
}

/*
 * Fit without the refit (SQ_V_NOREFIT): the column scales of a dual head
 * are step 2's, c_j of sq_tile_fit_cols (sm.cola, untouched since its
 * barrier), into the block by thread j; 0 without integer rows, or where the
 * layout has column scales but the head is not dual, as sq_tile_refit. The
 * scales lie apart from the codes in the block, so no barrier is needed
 * before the one that ends the item.
 */
__device__ __forceinline__ void sq_tile_cols_fixed(const sq_head_desc *hd, bool dual,
                                                   const sq_tsmem &sm, uint8_t *buf, int t)
{
    if (hd->has_col && t < SQ_D)
        ((uint16_t *)(buf + hd->col_scale_off))[t] =
            dual && hd->any_int ? sq_scale_h(sm.cola[t]) : (uint16_t)0;
}

/*
 * Codes of the fit rows at a uniform width B (the templates): row factor
 * s_i = qmax_i / r_i for all 8 codes of a row (sq_quant_row_e with a per-row
 * broadcast instead of the per-column qmax / c_j; its refit sums are dead).
 */
template <int B>
__device__ __forceinline__ void sq_quant_tile_rows_e(const float (&y)[64], uint8_t *buf, int R0,
                                                     int tx, const float (&s)[8])
{
    float num[8] = {}, den[8] = {}; /* the refit sums: dead, dropped by the compiler */
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const float q[8] = { s[r], s[r], s[r], s[r], s[r], s[r], s[r], s[r] };
        sq_quant_row_e<B>(y + 8 * r, buf + (R0 + r) * 16 * B, tx, q, 0.0f, num, den);
    }
}

__device__ __forceinline__ void sq_quant_tile_rows_ub(const float (&y)[64], uint8_t *buf, int R0,
                                                      int tx, const float (&s)[8], int ub)
{
    sq_by_width(ub, [&](auto w) { sq_quant_tile_rows_e<decltype(w)::value>(y, buf, R0, tx, s); });
}

/*
 * The fit rows into the packed sink (SQ_V_ROWS, the old block served:
 * sq_tile_finite_rows): m holds the thread's partial maxima of |x_ij| rc_j.
 * Row scale r_i = fp16(m_i) on lanes tx even with s_i = qmax_i / r_i (a
 * correctly rounded division, as the reference) into sm.rinv; pivot rows;
 * y = x rc in place; codes t = fmaf(y, s_i, 1.5*2^23) (no clamp: nothing
 * saturated, and |y s_i| <= qmax_i (1 + 2^-10)); the old column scales
 * back into the block by thread j (exact: the fp16 of the float of an
 * fp16). No column reduction and no barrier: the half-warp's rows come
 * from its own lanes (__syncwarp), and the item's closing barrier orders
 * the block before the copy-out.
 */
template <int V>
__device__ __forceinline__ void sq_tile_store_rows(float (&x)[64], const float (&m)[8],
                                                   const sq_head_desc *hd, sq_tsmem &sm,
                                                   uint8_t *buf, unsigned &fl, const sq_tpos &pos)
{
    const int t = pos.t, tx = pos.tx, R0 = pos.R0, C0 = pos.C0;
    constexpr bool RTU = V & SQ_V_RTU;
    if (hd->needs_zero) {
        for (uint32_t n = t; n < hd->block_bytes / 16; n += SQ_THREADS)
            ((uint4 *)buf)[n] = make_uint4(0, 0, 0, 0);
        __syncthreads();
    }
    const float mr = sq_row_max(m, tx);
    if (!(tx & 1)) {
        const int i = R0 + (tx >> 1);
        const int b = sm.bits[i];
        float s = 0.0f;
        uint16_t h = 0;
        if (b != STEPQ_BITS_PIVOT) {
            h = sq_scale_h(mr);
            s = __fdiv_rn((float)((1 << (b - 1)) - 1), sq_h2f(h));
        }
        sm.rinv[i] = s;
        ((uint16_t *)(buf + hd->row_scale_off))[i] = h;
    }
    sq_tile_store_pivots(x, hd, sm, buf, fl, R0, tx);
    __syncwarp(); /* sm.rinv of a half-warp's rows comes from its own lanes */
    float s[8];
    {
        float4 a = *(const float4 *)(sm.rinv + R0), b = *(const float4 *)(sm.rinv + R0 + 4);
        s[0] = a.x, s[1] = a.y, s[2] = a.z, s[3] = a.w;
        s[4] = b.x, s[5] = b.y, s[6] = b.z, s[7] = b.w;
        float4 c = *(const float4 *)(sm.ad + C0), d = *(const float4 *)(sm.ad + C0 + 4);
        const float rc[8] = { c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w };
#pragma unroll
        for (int r = 0; r < 8; r++)
#pragma unroll
            for (int k = 0; k < 8; k++)
                x[r * 8 + k] *= rc[k];
    }
    const int ub = hd->ubits;
    if (ub && !RTU) {
        sq_quant_tile_rows_ub(x, buf, R0, tx, s, ub);
    } else {
        float num[8] = {}, den[8] = {}; /* dead likewise */
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int i = R0 + r;
            const int b = ub ? ub : sm.bits[i];
            const float q[8] = { s[r], s[r], s[r], s[r], s[r], s[r], s[r], s[r] };
            if (b != STEPQ_BITS_PIVOT)
                sq_quant_row_rt<false, true>(x + 8 * r, buf + sm.roff[i], tx, b, q, 0.0f, 0.0f, num,
                                             den);
        }
    }
    if (t < SQ_D)
        ((uint16_t *)(buf + hd->col_scale_off))[t] = __half_as_ushort(__float2half_rn(sm.cold[t]));
}

/*
 * Into the packed sink: the new block is assembled in buf (the old one has
 * been read by now), row scales, pivot rows, column scales, codes, refit
 * (SQ_V_NOREFIT: the step-2 column scales instead; num and den are then
 * never read, so the compiler drops their sums from the encode).
 */
template <int V>
__device__ __forceinline__ void sq_tile_store_packed(float (&x)[64], const float (&m)[8],
                                                     const sq_head_desc *hd, sq_tsmem &sm,
                                                     const sq_rowc *rowc, uint8_t *buf,
                                                     unsigned &fl, const sq_tpos &pos, bool exact)
{
    const int t = pos.t;
    const bool dual = hd->dual;
    if constexpr (V & SQ_V_ROWS) {
        if (!exact) { /* the old block serves (sq_tile_finite_rows); else the exact fit below */
            sq_tile_store_rows<V>(x, m, hd, sm, buf, fl, pos);
            return;
        }
    }
    if (hd->needs_zero) {
        for (uint32_t n = t; n < hd->block_bytes / 16; n += SQ_THREADS)
            ((uint4 *)buf)[n] = make_uint4(0, 0, 0, 0);
        __syncthreads();
    }
    sq_tile_fit_rows(m, hd, dual, sm, buf, fl, pos);
    sq_tile_store_pivots(x, hd, sm, buf, fl, pos.R0, pos.tx);
    __syncwarp(); /* sm.rinv of a half-warp's rows comes from its own lanes */
    float ci[8];
    sq_tile_fit_cols(x, ci, dual, sm, fl, pos);
    float num[8], den[8];
#pragma unroll
    for (int c = 0; c < 8; c++)
        num[c] = den[c] = 0.0f;
    const bool clamp = sm.sat;
    const int ub = hd->ubits;
    sq_tile_encode<V>(x, ci, ub, clamp, sm, rowc, buf, num, den, pos);
    if constexpr (V & SQ_V_NOREFIT)
        sq_tile_cols_fixed(hd, dual, sm, buf, t);
    else
        sq_tile_refit(num, den, hd, dual, ub, clamp, sm, buf, fl, pos);
}

/*
 * The input phase of a step's item: the inputs into sm (sq_tile_in_qk, sq_tile_in_vgb), then,
 * once all are finite, sq_tile_in_norm (which waits for a staged block) and *kq = k.q. false
 * where one is not finite: sq_input_failed has handled the head, and buf and sm are free.
 */
template <int SRC, bool BULK = false>
__device__ __forceinline__ bool sq_tile_inputs(const sq_step &st, const sq_io &io, const sq_in &in,
                                               sq_tsmem &sm, int bfi, int hv, int e, int HV,
                                               int32_t slot, const sq_tpos &pos, float &kq)
{
    const int t = pos.t;
    bool bad = false;
    if (t < SQ_D)
        bad = sq_tile_in_qk(st, in, sm, bfi, pos);
    else
        bad = sq_tile_in_vgb(st, in, sm, bfi, t);
    if (__syncthreads_or(bad)) {
        sq_tile_stage_wait<SRC, BULK>(); /* nothing may land in a finished block */
        sq_input_failed(st, io, e, HV, hv, slot, t, bfi);
        __syncthreads();
        return false;
    }
    kq = sq_tile_in_norm<SRC, false, BULK>(st, io, sm, hv, e, HV, pos);
    return true;
}

/*
 * One (entry e, head hv) work item. SRC: packed (quantized pages only) or
 * dense; SINK: packed (quantized) or dense. With a packed source the block
 * has been staged into buf by the caller (sq_stage_block), and so has the
 * dense head of a pack (sq_stage_dense, sq_stage_dense_scalar).
 * Ends with a barrier: buf and sm are free when it returns. V: SQ_V_* bits.
 */
template <int SRC, bool UPDATE, int SINK, int V = 0>
__device__ __forceinline__ void sq_tile_item(const sq_step &st, const sq_io &io, int hv, int e,
                                             int HV, int32_t slot, uint8_t *buf, sq_tsmem &sm,
                                             const sq_in &in)
{
    const int t = threadIdx.x, bfi = sq_in_bf16<V>(st);
    const sq_tpos pos = sq_tile_pos(t);
    const bool packed = SRC == SQ_SRC_PACKED || SINK == SQ_SINK_PACKED;
    const sq_head_desc *hd = packed ? io.heads + hv : nullptr;
    uint8_t *blk = packed ? io.pages + (size_t)slot * io.page_stride + hd->block_off : nullptr;
    unsigned fl = 0; /* health bits raised by this thread */
    if (t == 0) {
        sm.fl = 0;
        sm.sat = 0;
    }
    /* run-time widths: per-row constants from a table (1-1.3% faster than per-lane math, KDA) */
    constexpr bool ROWC = V & SQ_V_RTU;
    sq_rowc *rowc = nullptr;
    if constexpr (ROWC) {
        __shared__ sq_rowc rowc_tab[SQ_D];
        rowc = rowc_tab;
    }

    float x[64];
    sq_tile_load<SRC, UPDATE, SINK, V>(x, io, hd, sm, rowc, buf, slot, e, hv, pos);
    float kq = 0.0f;
    if (UPDATE) {
        /* the recurrence inputs (as sq_head_kernel), from their bits (sq_load_in) */
        if (!sq_tile_inputs<SRC, sq_bulk_step<SRC, UPDATE, SINK>>(st, io, in, sm, bfi, hv, e, HV,
                                                                  slot, pos, kq))
            return;
    } else if (SRC == SQ_SRC_PACKED) {
        sq_cp_async_wait_all();
        __syncthreads();
    }
    constexpr bool ROWS = (V & SQ_V_ROWS) && SINK == SQ_SINK_PACKED;
    bool colbad = false; /* SQ_V_ROWS: the old block's column scales cannot serve */
    if (SRC == SQ_SRC_PACKED)
        colbad = sq_tile_decode<UPDATE, V>(x, buf, hd, sm, rowc, pos);
    else if (ROWS)
        colbad = sq_tile_rows_cols(blk, hd, sm, t);
    if (UPDATE && SRC != SQ_SRC_PACKED)
        sq_tile_decay(x, sm, pos.R0);
    if (UPDATE)
        sq_tile_update(x, sm, pos);
    float m[8];
    bool exact = true; /* SQ_V_ROWS: the head takes the exact fit (sq_tile_finite_rows) */
    bool slow;
    if constexpr (ROWS)
        slow = sq_tile_finite_rows<UPDATE>(x, m, sm, fl, pos, colbad || !(hd->dual && hd->any_int),
                                           exact);
    else
        slow = sq_tile_finite<UPDATE>(x, m, sm, fl, pos);
    if (UPDATE)
        sq_tile_readout(st, sm, kq, slow, e, hv, bfi, fl, t);
    if (SINK == SQ_SINK_DENSE)
        sq_tile_store_dense(x, m, io, slot, e, hv, fl, pos);
    else
        sq_tile_store_packed<V>(x, m, hd, sm, rowc, buf, fl, pos, exact);

    /* every thread's health bits are in sm.fl before the block leaves and thread 0 reports */
    if (fl)
        atomicOr(&sm.fl, fl);
    __syncthreads();
    if (SINK == SQ_SINK_PACKED) {
        const uint4 *s = (const uint4 *)buf;
        uint4 *d = (uint4 *)blk;
        for (uint32_t n = t; n < hd->block_bytes / 16; n += SQ_THREADS)
            d[n] = s[n];
    }
    if (t == 0 && sm.fl)
        sq_tile_report(io, sm.fl, slot);
    __syncthreads(); /* buf and sm are free when it returns */
}

/* Column sums of a thread's 8 partials a[] and b[] over the block: the other half-warp's, then
 * the 8 warps in order (part: [2][8 warps][128]); after the barrier, thread t < 128 gets column
 * t's in *sa, *sb. */
__device__ __forceinline__ void sq_colsums(float *part, float (&a)[8], float (&b)[8],
                                           const sq_tpos &pos, float *sa, float *sb)
{
    const int w = pos.w, C0 = pos.C0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        a[j] += __shfl_xor_sync(0xffffffffu, a[j], 16);
        b[j] += __shfl_xor_sync(0xffffffffu, b[j], 16);
    }
    if (pos.lane < 16) {
        float *pa = part + w * SQ_D + C0, *pb = part + 8 * SQ_D + w * SQ_D + C0;
        *(float4 *)pa = make_float4(a[0], a[1], a[2], a[3]);
        *(float4 *)(pa + 4) = make_float4(a[4], a[5], a[6], a[7]);
        *(float4 *)pb = make_float4(b[0], b[1], b[2], b[3]);
        *(float4 *)(pb + 4) = make_float4(b[4], b[5], b[6], b[7]);
    }
    __syncthreads();
    float x = 0.0f, y = 0.0f;
    if (pos.t < SQ_D)
#pragma unroll
        for (int wi = 0; wi < 8; wi++) {
            x += part[wi * SQ_D + pos.t];
            y += part[8 * SQ_D + wi * SQ_D + pos.t];
        }
    *sa = x;
    *sb = y;
}

/*
 * One update pass of sq_pivot_head_step over the thread's rows: x' = x alpha + k_i u_j stored
 * in place as fp16 and the S'^T q partials into pq. REF: the reference's pass (non-finite
 * values zeroed, raising *nf, the store saturating with its health bit into fl); else RN fp16
 * pairs and the |x'| maximum into amax (a NaN leaves it: the partials tell).
 */
template <bool REF>
__device__ __forceinline__ void sq_pivot_pass(const uint4 (&X)[8], const float (&u)[8], float alpha,
                                              const sq_tsmem &sm, int R0, int tx, uint8_t *blk,
                                              float (&pq)[8], float &amax, bool &nf, unsigned &fl)
{
#pragma unroll
    for (int j = 0; j < 8; j++)
        pq[j] = 0.0f;
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const float kr = sm.k[R0 + r], qr = sm.q[R0 + r];
        const uint32_t xw[4] = { X[r].x, X[r].y, X[r].z, X[r].w };
        uint32_t yw[4];
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const float2 x = __half22float2(sq_u2h(xw[p]));
            float a = fmaf(kr, u[2 * p], __fmul_rn(x.x, alpha));
            float b = fmaf(kr, u[2 * p + 1], __fmul_rn(x.y, alpha));
            if (REF && (!isfinite(a) || !isfinite(b))) {
                nf = true;
                a = isfinite(a) ? a : 0.0f;
                b = isfinite(b) ? b : 0.0f;
            }
            pq[2 * p] = fmaf(a, qr, pq[2 * p]), pq[2 * p + 1] = fmaf(b, qr, pq[2 * p + 1]);
            if (REF) {
                yw[p] = (uint32_t)sq_f16_sat(a, &fl) | ((uint32_t)sq_f16_sat(b, &fl) << 16);
            } else {
                amax = fmaxf(amax, fmaxf(fabsf(a), fabsf(b)));
                yw[p] = sq_h2u(__floats2half2_rn(a, b));
            }
        }
        *(uint4 *)(blk + (size_t)(R0 + r) * (2 * SQ_D) + 16 * tx) =
            make_uint4(yw[0], yw[1], yw[2], yw[3]);
    }
}

/*
 * The decode step of a GDN pivot head (sq_head_desc.pivh: its 128 rows fp16 values back to back,
 * 2 d_v bytes each, and nothing else the step writes: the reference leaves a head without integer
 * rows' scale fields as they were) once the input phase has filled sm and given k.q: in fp32, as
 * the reference steps pivot rows (kernels/step.c) and the tile item's pivot rows do: decode x
 * alpha, the two dot products with fp32 partial sums, the update by one FFMA, non-finite elements
 * zeroed with the readout recomputed from the sanitised state, the store saturating at +-65504.
 * X: the thread's 8 rows R0.. of 8 values from column C0, as the block holds them (half2 words);
 * the new rows go to blk (the block in its page) in place, the readout to st.o, the health word
 * reported. No fit, no column or row scales: in the tile kernel's general item this head ran
 * every phase of the packed store for nothing, and at B = 1 it was the layer's slowest block.
 */
template <bool FAST>
__device__ __forceinline__ void sq_pivot_head_step(const sq_step &st, const sq_io &io, int hv,
                                                   int e, int32_t slot, sq_tsmem &sm, float kq,
                                                   int bfi, float alpha, const uint4 (&X)[8],
                                                   uint8_t *blk, const sq_tpos &pos)
{
    const int t = pos.t, tx = pos.tx, R0 = pos.R0, C0 = pos.C0;
    unsigned fl = 0;
    /* the decayed state's S^T k and S^T q */
    float pk[8], pq[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
        pk[j] = pq[j] = 0.0f;
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const float kr = sm.k[R0 + r], qr = sm.q[R0 + r];
        const uint32_t xw[4] = { X[r].x, X[r].y, X[r].z, X[r].w };
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const float2 x = __half22float2(sq_u2h(xw[p]));
            const float a = __fmul_rn(x.x, alpha), b = __fmul_rn(x.y, alpha);
            pk[2 * p] = fmaf(a, kr, pk[2 * p]), pk[2 * p + 1] = fmaf(b, kr, pk[2 * p + 1]);
            pq[2 * p] = fmaf(a, qr, pq[2 * p]), pq[2 * p + 1] = fmaf(b, qr, pq[2 * p + 1]);
        }
    }
    float s, tq;
    sq_colsums(sm.part[0], pk, pq, pos, &s, &tq);
    if (t < SQ_D) {
        sm.cola[t] = (sm.v[t] - s) * sm.beta;
        sm.colb[t] = tq;
    }
    __syncthreads();

    /*
     * The update, in place (no other thread reads this thread's values). FAST (the tile
     * kernel, whose 128 registers keep X for a second pass): a pass that stores each value's RN
     * fp16, exact where every new value is finite and within +-65504, which the readout
     * partials (a non-finite value makes its column's partial non-finite) and the thread's
     * |x'| maximum tell after it; else (rare), and always without FAST (the fp16 kernel, whose
     * 64 registers spilled more with the second pass and ran 1.6-2.1% slower at B = 256-512),
     * the pass of the reference: non-finite elements zeroed, the store saturating with its
     * health bit, and the sanitised state's S'^T q summed for the readout it needs.
     */
    float u[8];
    {
        const float4 a = *(const float4 *)&sm.cola[C0], b = *(const float4 *)&sm.cola[C0 + 4];
        u[0] = a.x, u[1] = a.y, u[2] = a.z, u[3] = a.w, u[4] = b.x, u[5] = b.y, u[6] = b.z;
        u[7] = b.w;
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
        pk[j] = 0.0f;
    bool slow = !FAST, nf = false;
    if constexpr (FAST) {
        float amax = 0.0f;
        sq_pivot_pass<false>(X, u, alpha, sm, R0, tx, blk, pq, amax, nf, fl);
        slow = !(amax <= 65504.0f);
#pragma unroll
        for (int j = 0; j < 8; j++)
            slow |= !isfinite(pq[j]);
    }
    if (slow) { /* the reference's pass, from the old rows the fast one did not touch */
        float unused = 0.0f;
        sq_pivot_pass<true>(X, u, alpha, sm, R0, tx, blk, pq, unused, nf, fl);
    }
    if (__syncthreads_or(nf)) {
        /* rare: the readout of the sanitised state, as the reference reads it */
        if (nf)
            fl |= STEPQ_HEALTH_STATE;
        float o2, unused;
        sq_colsums(sm.part[0], pq, pk, pos, &o2, &unused);
        if (t < SQ_D) {
            sm.colb[t] = o2;
            sm.cola[t] = 0.0f; /* o = S'^T q: no u (k.q) term */
        }
        __syncthreads();
    }
    if (t < SQ_D) {
        float o = fmaf(sm.cola[t], kq, sm.colb[t]);
        if (!isfinite(o)) {
            o = 0.0f;
            fl |= STEPQ_HEALTH_OUTPUT;
        }
        sq_st_out(st.o, (size_t)e * st.o_stride + (size_t)hv * SQ_D + t, o, bfi);
    }
    if (fl)
        atomicOr(&sm.fl, fl);
    __syncthreads();
    if (t == 0 && sm.fl)
        sq_tile_report(io, sm.fl, slot);
}

/*
 * The tile kernel's item for a GDN pivot head (hd->pivh) in the fused packed step: the block
 * has been staged into buf (sq_stage_block) while the input phase (the tile item's) runs; the
 * step is sq_pivot_head_step's, the thread's rows read from the staged copy (loading them straight
 * into registers before the input phase instead measured 1.5-2.3% slower at B = 512 and no
 * faster at B = 1: kernels/cuda/README.md, "The GDN pivot head's own item"). Ends with a
 * barrier, as sq_tile_item.
 */
template <int V>
__device__ __forceinline__ void sq_tile_pivot_item(const sq_step &st, const sq_io &io, int hv,
                                                   int e, int HV, int32_t slot, const uint8_t *buf,
                                                   sq_tsmem &sm, const sq_in &in)
{
    const int t = threadIdx.x, bfi = sq_in_bf16<V>(st);
    const sq_tpos pos = sq_tile_pos(t);
    uint8_t *blk = io.pages + (size_t)slot * io.page_stride + io.heads[hv].block_off;
    if (t == 0)
        sm.fl = 0;
    float kq;
    constexpr bool BULK = sq_bulk_step<SQ_SRC_PACKED, true, SQ_SINK_PACKED>;
    if (!sq_tile_inputs<SQ_SRC_PACKED, BULK>(st, io, in, sm, bfi, hv, e, HV, slot, pos, kq))
        return;
    uint4 X[8];
#pragma unroll
    for (int r = 0; r < 8; r++)
        X[r] = *(const uint4 *)(buf + (pos.R0 + r) * (2 * SQ_D) + 16 * pos.tx);
    sq_pivot_head_step<true>(st, io, hv, e, slot, sm, kq, bfi, sm.dec0, X, blk, pos);
    __syncthreads(); /* buf and sm are free when it returns */
}

template <int SRC, bool UPDATE, int SINK, int V = 0>
__global__ void __launch_bounds__(SQ_THREADS, SQ_TMIN_BLOCKS) sq_tile_kernel(sq_step st, sq_io io)
{
    extern __shared__ __align__(16) uint8_t sq_dyn[];
    __shared__ sq_tsmem sm;
    /* SQ_V_ORDER: grid (batch, heads), so that resident blocks mostly share a head */
    constexpr bool ORD = V & SQ_V_ORDER;
    const int hv = ORD ? blockIdx.y : blockIdx.x, e = ORD ? blockIdx.x : blockIdx.y;
    const int HV = ORD ? gridDim.y : gridDim.x;
    /*
     * The pack issues its dense head first: the source is indexed by entry
     * (io.dense_by_slot is 0 for a pack), so its copy need not wait for the
     * slot id and skip flag; a block that then returns early waits for it.
     */
    constexpr bool STAGE =
        SRC == SQ_SRC_DENSE && !UPDATE && SINK == SQ_SINK_PACKED && (V & SQ_V_STAGE);
    if (STAGE) {
        const size_t off = (size_t)e * io.dense_stride + (size_t)hv * SQ_D * SQ_D;
        if (io.bf16) {
            const uint16_t *src = (const uint16_t *)io.dense + off;
            if (io.dense_vec)
                sq_stage_dense<SQ_BF16>(sq_dyn, src);
            else
                sq_stage_dense_scalar<SQ_BF16>(sq_dyn, src);
        } else {
            const float *src = (const float *)io.dense + off;
            if (io.dense_vec)
                sq_stage_dense<SQ_F32>(sq_dyn, src);
            else
                sq_stage_dense_scalar<SQ_F32>(sq_dyn, src);
        }
    }
    const int32_t slot = io.slots ? io.slots[e] : e;
    if (slot < 0 || slot >= io.n_slots || (!UPDATE && io.skip && io.skip[(size_t)e * HV + hv])) {
        if (STAGE)
            sq_cp_async_wait_all(); /* no copy may land after the block has gone */
        return;                     /* uniform over the block */
    }
    /* the fused packed step, where a GDN pivot head takes its own item */
    constexpr bool STEP = SRC == SQ_SRC_PACKED && UPDATE && SINK == SQ_SINK_PACKED;
    if (SRC == SQ_SRC_PACKED) {
        const sq_head_desc *hd = io.heads + hv;
        const uint8_t *blk = io.pages + (size_t)slot * io.page_stride + hd->block_off;
        if (!sq_bulk_step<SRC, UPDATE, SINK>)
            sq_stage_block(sq_dyn, blk, hd->block_bytes);
        else if (threadIdx.x == 0)
            sq_bulk_stage(sq_dyn, blk, hd->block_bytes);
    }
    sq_in in;
    sq_load_in<UPDATE, V>(in, st, hv, e, HV, threadIdx.x);
    if (STEP && io.heads[hv].pivh)
        sq_tile_pivot_item<V>(st, io, hv, e, HV, slot, sq_dyn, sm, in); /* uniform over the block */
    else
        sq_tile_item<SRC, UPDATE, SINK, V>(st, io, hv, e, HV, slot, sq_dyn, sm, in);
}

#endif /* STEPQ_KERNELS_CUDA_TILE_KERNEL_CUH */
