/*
 * The fp16 arithmetic of the packed decode step (the map field `arith` = fp16): the C reference
 * of kernels/cuda/f16_kernel.cuh, one integer head at a time. kernels/quant.h spells out the
 * operations; this file is that list in C. Every half operation is computed exactly in double
 * (a product of two halves has at most 22 significant bits; an fma of halves is exact in double
 * but where the addends' exponents lie more than 31 apart) and rounded once to fp16, to nearest
 * even, as the GPU's HMUL2 / HFMA2 / HSUB2 round; everything marked float is a correctly rounded
 * binary32 operation, as the kernel's __fmul_rn / __fdiv_rn / __fsqrt_rn.
 */
#include <math.h>
#include <string.h>

#include "kernels/format.h"
#include "kernels/quant.h"

/* x rounded to the nearest fp16 value (ties to even; subnormals kept; beyond 65520, Inf) */
static double half_rn(double x)
{
    const double a = fabs(x);
    if (!(a < 65520.0))
        return isnan(x) ? x : copysign(INFINITY, x);
    int e;
    (void)frexp(a, &e);                   /* a = m 2^e, m in [0.5, 1) */
    const int q = e < -13 ? -24 : e - 11; /* the quantum: 11 significant bits, 2^-24 below 2^-14 */
    return ldexp(nearbyint(ldexp(x, -q)), q);
}

static float h(double x)
{
    return (float)half_rn(x);
}

/* the smallest power of two >= x (x >= 0 finite; 0 gives 2^-126), as the kernel's sq_p2 */
static float p2(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    uint32_t e = (b + 0x007FFFFFu) & 0x7F800000u;
    e = e ? e : 0x00800000u;
    float r;
    memcpy(&r, &e, 4);
    return r;
}

/*
 * A column's fp32 sum over the groups of 8 rows in the kernel's order: each pair of groups
 * (2w, 2w + 1: a warp's two half-warps) first, then the pairs in order (an odd last group alone).
 */
struct pair_sum {
    float sum, pend;
};

static void pair_add(struct pair_sum *ps, int gi, int ng, float x)
{
    if (gi % 2 == 0 && gi + 1 < ng) {
        ps->pend = x;
        return;
    }
    ps->sum += gi % 2 ? ps->pend + x : x;
}

static float fmaxabs(float m, float x)
{
    return fmaxf(m, fabsf(x));
}

static float rd_h(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return stepq__fp16_to_float(v);
}

static void wr_h(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, 2);
}

int stepq__step_f16_supports(const struct stepq__head_layout *hl)
{
    if (!hl || !hl->quantized || !hl->has_col || hl->d_k > STEPQ__MAX_HEAD_DIM ||
        hl->d_v > STEPQ__MAX_HEAD_DIM)
        return 0;
    if (hl->arch == STEPQ_ARCH_KDA) {
        /* any mix of integer widths and pivot rows, but at least one integer row */
        int n_int = 0;
        for (int i = 0; i < hl->d_k; i++) {
            if (hl->row_bits[i] == STEPQ_BITS_PIVOT)
                continue;
            if (!stepq__format_int_bits(hl->row_bits[i]))
                return 0;
            n_int++;
        }
        return n_int > 0;
    }
    if (hl->arch != STEPQ_ARCH_GDN || hl->n_pivot_rows != 0)
        return 0;
    for (int i = 1; i < hl->d_k; i++)
        if (hl->row_bits[i] != hl->row_bits[0])
            return 0;
    return stepq__format_int_bits(hl->row_bits[0]);
}

uint32_t stepq__step_head_f16(const struct stepq__head_layout *hl, const uint8_t *in,
                              const float *w, const float *q, const float *k, const float *v,
                              const float *g, float beta, uint8_t *out, float *o, float *scratch,
                              float *targ)
{
    const int d_k = hl->d_k, d_v = hl->d_v, kda = hl->arch == STEPQ_ARCH_KDA;
    const int ng = (d_k + 7) / 8;   /* groups of 8 rows: the kernel's thread tiles */
    const int nw = (d_k + 15) / 16; /* blocks of 16 rows: the kernel's warps */
    const double split = stepq__quant_row_split_of(hl);
    /* X: the state in its normalised domains; Z: the old codes, or a pivot row's values */
    float *X = scratch, *Z = scratch + (size_t)d_k * d_v;
    float r[STEPQ__MAX_HEAD_DIM], c[STEPQ__MAX_HEAD_DIM], u[STEPQ__MAX_HEAD_DIM];
    float N[STEPQ__MAX_HEAD_DIM], rn[STEPQ__MAX_HEAD_DIM], A[STEPQ__MAX_HEAD_DIM];
    float CM[STEPQ__MAX_HEAD_DIM], Q[STEPQ__MAX_HEAD_DIM], yb[STEPQ__MAX_HEAD_DIM];
    float al[STEPQ__MAX_HEAD_DIM], iqr[STEPQ__MAX_HEAD_DIM];
    int qm[STEPQ__MAX_HEAD_DIM], piv[STEPQ__MAX_HEAD_DIM];
    uint16_t rh[STEPQ__MAX_HEAD_DIM], ch[STEPQ__MAX_HEAD_DIM], pv[STEPQ__MAX_HEAD_DIM];
    int8_t zc[STEPQ__MAX_HEAD_DIM];
    uint32_t flags = 0;

    /* Per row: width, qmax, RN(1 / qmax), decay (GDN: the head's). */
    for (int i = 0; i < d_k; i++) {
        piv[i] = hl->row_bits[i] == STEPQ_BITS_PIVOT;
        qm[i] = piv[i] ? 1 : stepq__qmax(hl->row_bits[i]);
        iqr[i] = 1.0f / (float)qm[i];
        al[i] = (float)exp((double)g[kda ? i : 0]);
    }
    /* The old block, read whole before anything is written (out may be in). A pivot value
     * that is not finite (a corrupted page: a fit never stores one) reads as 0, STATE. */
    for (int i = 0; i < d_k; i++) {
        float *zr = Z + (size_t)i * d_v;
        if (piv[i]) {
            r[i] = 0.0f;
            for (int j = 0; j < d_v; j++) {
                zr[j] = rd_h(in + hl->row_bitoff[i] / 8 + 2 * (size_t)j);
                if (!isfinite(zr[j])) {
                    zr[j] = 0.0f;
                    flags |= STEPQ_HEALTH_STATE;
                }
            }
            continue;
        }
        r[i] = rd_h(in + hl->row_scale_offset + 2 * (size_t)i);
        stepq__unpack_codes(in, hl->row_bitoff[i], zc, (size_t)d_v, hl->row_bits[i]);
        for (int j = 0; j < d_v; j++)
            zr[j] = (float)zc[j];
    }
    for (int j = 0; j < d_v; j++)
        c[j] = rd_h(in + hl->col_scale_offset + 2 * (size_t)j);
    const float alpha = al[0];
    double kq_d = 0.0;
    for (int i = 0; i < d_k; i++)
        kq_d += (double)k[i] * (double)q[i];
    const float kq = (float)kq_d, iq = iqr[0];

    /* 1. The two dot products in the code domain: half partial sums over each group's rows
     * (weights r_i k_i and r_i q_i over the group's power of two; KDA: e_i k_i, e_i q_i with
     * e_i = r_i alpha_i / qmax_i), fp32 across the groups; KDA: the sum times c_j, then the
     * pivot rows' fp32 terms in row order. */
    float e[STEPQ__MAX_HEAD_DIM];
    for (int i = 0; i < d_k; i++)
        e[i] = kda ? (piv[i] ? 0.0f : r[i] * al[i] * iqr[i]) : r[i];
    for (int j = 0; j < d_v; j++) {
        struct pair_sum sa = { 0.0f, 0.0f }, sb = { 0.0f, 0.0f };
        for (int gi = 0; gi < ng; gi++) {
            const int i0 = 8 * gi, i1 = i0 + 8 < d_k ? i0 + 8 : d_k;
            float mk = 0.0f, mq = 0.0f;
            for (int i = i0; i < i1; i++) {
                mk = fmaxabs(mk, e[i] * k[i]);
                mq = fmaxabs(mq, e[i] * q[i]);
            }
            const float Pk = p2(mk), Pq = p2(mq);
            double ak = 0.0, aq = 0.0;
            for (int i = i0; i < i1; i++) {
                if (piv[i])
                    continue;
                const double z = Z[(size_t)i * d_v + j];
                ak = half_rn(z * h(e[i] * k[i] * (1.0f / Pk)) + ak);
                aq = half_rn(z * h(e[i] * q[i] * (1.0f / Pq)) + aq);
            }
            pair_add(&sa, gi, ng, (float)ak * Pk);
            pair_add(&sb, gi, ng, (float)aq * Pq);
        }
        float s, t;
        if (kda) {
            s = sa.sum * c[j], t = sb.sum * c[j];
            for (int i = 0; i < d_k; i++)
                if (piv[i]) {
                    const float xa = Z[(size_t)i * d_v + j] * al[i];
                    s = fmaf(xa, k[i], s);
                    t = fmaf(xa, q[i], t);
                }
        } else {
            const float f = c[j] * alpha * iq;
            s = sa.sum * f, t = sb.sum * f;
        }
        u[j] = beta * (v[j] - s);
        float oj = fmaf(u[j], kq, t);
        if (!isfinite(oj)) {
            oj = 0.0f;
            flags |= STEPQ_HEALTH_OUTPUT;
        }
        o[j] = oj;
    }

    /* 2. The decode and the update in half under the row normalisers N_i; pivot rows in fp32
     * as the fp32 step updates them (decay, then plus k_i u_j; not finite: 0, STATE), stored
     * saturating, and out of every scale below (their X row 0). */
    float cmax = 0.0f, umax = 0.0f;
    for (int j = 0; j < d_v; j++) {
        cmax = fmaxf(cmax, c[j]);
        umax = fmaxabs(umax, u[j]);
    }
    const float Pc = p2(cmax), Su = p2(umax);
    for (int i = 0; i < d_k; i++) {
        float *xr = X + (size_t)i * d_v;
        const float *zr = Z + (size_t)i * d_v;
        if (piv[i]) {
            int sat = 0;
            for (int j = 0; j < d_v; j++) {
                float x = zr[j] * al[i] + k[i] * u[j];
                if (!isfinite(x)) {
                    x = 0.0f;
                    flags |= STEPQ_HEALTH_STATE;
                }
                pv[j] = stepq__fp16_from_float_sat(x, &sat);
                xr[j] = 0.0f;
            }
            /* the row's stored values, kept in the bytes of its Z row (read no more) */
            memcpy(Z + (size_t)i * d_v, pv, 2 * (size_t)d_v);
            if (sat)
                flags |= STEPQ_HEALTH_SATURATED;
            rh[i] = 0;
            rn[i] = A[i] = yb[i] = N[i] = 0.0f;
            continue;
        }
        const float ar = al[i] * r[i];
        N[i] = p2(fmaxf(ar * Pc, fabsf(k[i]) * umax));
        const float iN = 1.0f / N[i];
        const float F = h(ar * Pc * iqr[i] * iN), K = h(k[i] * Su * iN);
        float M = 0.0f;
        for (int j = 0; j < d_v; j++) {
            const float C = h(c[j] * (1.0f / Pc)), U = h(u[j] * (1.0f / Su));
            const float zf = h((double)zr[j] * F);
            const float x = h((double)K * U + (double)h((double)zf * C));
            xr[j] = x;
            M = fmaxabs(M, x);
        }
        /* 3. Row scales from the row maxima m_i = M_i N_i (exact). */
        const float m = M * N[i], wi = w ? w[i] : 1.0f;
        rn[i] = stepq__scale_value(split == 0.5 ? sqrtf(m / wi)
                                                : (float)(pow((double)m, split) / sqrt((double)wi)),
                                   &rh[i], &flags);
        A[i] = wi * wi * rn[i] * rn[i];
        yb[i] = m / rn[i]; /* >= max_j |x_ij| / r_i */
    }
    /* 4. Y = X N_i / (P_w r_i) = y / P_w, with P_w a power of two >= max |y| over the rows of
     * 16-row block w (a warp of the kernel); P the largest P_w. */
    float Pw[STEPQ__MAX_HEAD_DIM / 16 + 1], P = 0.0f;
    for (int wi = 0; wi < nw; wi++) {
        float mb = 0.0f;
        for (int i = 16 * wi; i < 16 * wi + 16 && i < d_k; i++)
            mb = fmaxf(mb, yb[i]);
        Pw[wi] = p2(mb);
        P = fmaxf(P, Pw[wi]);
    }
    for (int i = 0; i < d_k; i++) {
        if (piv[i])
            continue;
        const float R = h(fminf(N[i] * (1.0f / Pw[i / 16]) / rn[i], 65504.0f));
        for (int j = 0; j < d_v; j++)
            X[(size_t)i * d_v + j] = h((double)X[(size_t)i * d_v + j] * R);
    }
    /* 5. Column maxima in the scale of P (each block's maxima times P_w / P, a power of two),
     * the quantize factors qmax / c_j (KDA: 1 / c_j; saturated at 65504) in it and in each
     * block's scale. A column whose scale would pass 65504 is clamped there, and with it the
     * codes, as the exact fit clamps them. */
    int sat = 0;
    for (int j = 0; j < d_v; j++) {
        float mj = 0.0f;
        for (int wi = 0; wi < nw; wi++) {
            float mw = 0.0f;
            for (int i = 16 * wi; i < 16 * wi + 16 && i < d_k; i++)
                mw = fmaxabs(mw, X[(size_t)i * d_v + j]);
            mj = fmaxf(mj, h((double)mw * (Pw[wi] / P)));
        }
        CM[j] = mj;
        sat |= mj * P > STEPQ__SCALE_MAX;
    }
    const float qnum = kda ? 1.0f : (float)qm[0];
    for (int j = 0; j < d_v; j++) {
        /* the clamp changes only the columns that saturate */
        const float cj = fminf(CM[j], STEPQ__SCALE_MAX * (1.0f / P));
        Q[j] = h(cj > 0.0f ? fminf(qnum / cj, 65504.0f) : 0.0f);
    }
    if (sat)
        flags |= STEPQ_HEALTH_SATURATED;

    /* 6. The quantize (T = Y Q_w + 1536 + qmax in half: the code u = z + qmax in its low bits;
     * KDA: T = h(Y Q_w) qmax_i + 1536 + qmax_i), the refit's half partial sums over each group
     * of 8 rows (KDA: of zt = h(z / qmax_i)), fp32 across the groups. */
    const int refit = hl->decode_fit != STEPQ_DECODE_FIT_NOREFIT; /* kernels/quant.h */
    /* keeps sum A z^2 of 8 rows below 65504 (GDN at 8 bits; KDA sums zt^2 <= 1) */
    const float asc = !kda && qm[0] == 127 ? 4.0f : 1.0f;
    float Pa[STEPQ__MAX_HEAD_DIM / 8 + 1];
    for (int gi = 0; gi < ng; gi++) {
        float ma = 0.0f;
        for (int i = 8 * gi; i < 8 * gi + 8 && i < d_k; i++)
            ma = fmaxf(ma, A[i]);
        Pa[gi] = p2(ma) * asc;
    }
    for (int j = 0; j < d_v; j++) {
        struct pair_sum sn = { 0.0f, 0.0f }, sd = { 0.0f, 0.0f };
        for (int gi = 0; gi < ng; gi++) {
            const int i0 = 8 * gi, i1 = i0 + 8 < d_k ? i0 + 8 : d_k;
            const float pw = Pw[gi / 2] / P, Qw = h((double)Q[j] * pw);
            double an = 0.0, ad = 0.0;
            for (int i = i0; i < i1; i++) {
                if (piv[i])
                    continue;
                const float y = X[(size_t)i * d_v + j], qf = (float)qm[i];
                const float MAG = 1536.0f + qf;
                float T, zt;
                if (kda) {
                    const float G = h((double)y * Qw);
                    T = h((double)G * qf + MAG);
                    if (targ)
                        targ[(size_t)i * d_v + j] = G * qf;
                } else {
                    T = h((double)y * Qw + MAG);
                    if (targ)
                        targ[(size_t)i * d_v + j] = y * Qw;
                }
                if (sat)
                    T = fminf(fmaxf(T, MAG - qf), MAG + qf);
                const float z = T - MAG; /* exact */
                Z[(size_t)i * d_v + j] = z;
                if (!refit)
                    continue;
                zt = kda ? h((double)z * h(iqr[i])) : z;
                const float a2 = h(A[i] * (1.0f / Pa[gi]));
                an = half_rn((double)h((double)zt * y) * a2 + an);
                ad = half_rn((double)h((double)zt * zt) * a2 + ad);
            }
            pair_add(&sn, gi, ng, (float)an * Pa[gi] * pw);
            pair_add(&sd, gi, ng, (float)ad * Pa[gi]);
        }
        const float cj = refit && sd.sum > 0.0f ? qnum * P * sn.sum / sd.sum : CM[j] * P;
        (void)stepq__scale_value(cj, &ch[j], &flags);
    }

    /* 7. The new block: codes and row scales (pivot rows: their values, row scale 0), column
     * scales; bytes no field covers are 0. */
    memset(out, 0, hl->block_bytes);
    for (int i = 0; i < d_k; i++) {
        if (piv[i]) {
            memcpy(out + hl->row_bitoff[i] / 8, Z + (size_t)i * d_v, 2 * (size_t)d_v);
            continue;
        }
        for (int j = 0; j < d_v; j++)
            zc[j] = (int8_t)Z[(size_t)i * d_v + j];
        stepq__pack_codes(out, hl->row_bitoff[i], zc, (size_t)d_v, hl->row_bits[i]);
        wr_h(out + hl->row_scale_offset + 2 * (size_t)i, rh[i]);
    }
    for (int j = 0; j < d_v; j++)
        wr_h(out + hl->col_scale_offset + 2 * (size_t)j, ch[j]);
    return flags;
}
