/* Comparisons of CUDA results with the reference's (compare.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kernels/quant.h"
#include "tests/checkasm/checkasm.h"
#include "tests/checkasm/compare.h"

#define D FX_D

/*
 * Relative error bound, in units of 2^-24, of the unrounded code argument
 * t = x / r / c * qmax as computed by either side with the same scales: at
 * most 5 roundings (GPU: x * RN(1/r), times RN(1/c), times qmax, and
 * RN(1/r), RN(1/c) themselves; reference: three), 8 leaves a margin.
 */
#define TIE_ULPS 8
/*
 * bf16 / fp16 pages: an element within this many ulps of its head's largest
 * magnitude plus one ulp of its own (compare_dense16 says why).
 */
#define TOL_DENSE16_HEAD_ULPS 1
/*
 * A column scale moved by flipped codes beyond one ulp: within this factor of
 * the refit's first-order bound (compare_quant derives it), plus one fp16 ulp.
 */
#define TOL_COL_TIE_FACTOR 1.5
/*
 * fp8 tile scales after a decode step: amax / 240 of states that differ by the update's
 * roundings, a few 2^-24 of the tile's largest magnitude; 1e-5 leaves a margin of ~100.
 */
#define TOL_FP8_SCALE_REL 1e-5

double ca_nmse(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? num / den : num;
}

uint16_t ca_rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

int ca_ulp16(uint16_t a, uint16_t b)
{
    int ia = (a & 0x8000) ? -(int)(a & 0x7fff) : (int)a;
    int ib = (b & 0x8000) ? -(int)(b & 0x7fff) : (int)b;
    return abs(ia - ib);
}

/*
 * One head of the source with the scales that each side quantized it with.
 * Column scales are the step-2 ones of kernels/quant.h (c_j = fp16(max_i
 * |x_ij / r_i|)), recomputed here: the stored ones are the refit, which no
 * code was rounded with.
 */
struct tie_head {
    float x[D][D];             /* x_ij ([d_k][d_v]); non-finite as 0, the reference's sanitising */
    double r_ref[D], r_got[D]; /* row scales read from each page (0 on pivot rows) */
    double c_ref[D];           /* the reference's step-2 column scales (1 without) */
    double c_lo[D], c_hi[D];   /* every step-2 column scale the GPU can have computed */
};

static int tie_near(double z, double t)
{
    return fabs(z - t) <= 0.5 + TIE_ULPS * 0x1p-24 * fmax(fabs(t), 1.0);
}

/* t = x / r / c * qmax in double, clamped to +-qmax as the codes are. */
static double tie_arg(double x, double r, double c, double qm)
{
    double t = x / r / c * qm;
    return fmax(-qm, fmin(qm, t));
}

/* The entry of the source packed into slot s, or -1. */
static int src_entry(const struct ca_pack_src *ps, int s)
{
    for (int e = 0; e < ps->n; e++)
        if (ps->slots[e] == s)
            return e;
    return -1;
}

/* Loads entry e, head h of the source and both pages' scales (a: GPU, b: reference). */
static void tie_head_load(struct tie_head *th, const struct ca_pack_src *ps, int e, int h,
                          const struct stepq__head_layout *hl, const uint8_t *a, const uint8_t *b)
{
    const float *x = ps->x + (size_t)e * ps->stride + (size_t)h * D * D;
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) {
            float v = ps->layout == STEPQ__LAYOUT_KV ? x[i * D + j] : x[j * D + i];
            th->x[i][j] = isfinite(v) ? v : 0.0f;
        }
    for (int i = 0; i < D; i++) {
        size_t rp = hl->row_scale_offset + 2 * (size_t)i;
        int piv = hl->row_bits[i] == STEPQ_BITS_PIVOT;
        th->r_ref[i] = piv ? 0 : stepq__fp16_to_float(ca_rd16(b + rp));
        th->r_got[i] = piv ? 0 : stepq__fp16_to_float(ca_rd16(a + rp));
    }
    for (int j = 0; j < D; j++) {
        th->c_ref[j] = th->c_lo[j] = th->c_hi[j] = 1.0;
        if (!hl->has_col)
            continue;
        /* the reference's column max, in its float arithmetic (exact: max is) */
        float m = 0.0f;
        double mg = 0;
        for (int i = 0; i < D; i++) {
            if (hl->row_bits[i] == STEPQ_BITS_PIVOT)
                continue;
            float y = fabsf(th->x[i][j] / (float)th->r_ref[i]);
            m = y > m ? y : m;
            mg = fmax(mg, fabs(th->x[i][j] / th->r_got[i]));
        }
        th->c_ref[j] = stepq__fp16_to_float(stepq__scale_to_fp16(m));
        /*
         * The GPU's column max (its row scales, y = x * RN(1/r): within 2^-23
         * of mg) rounds to either fp16 neighbour of a rounding midpoint that
         * lies within TIE_ULPS float ulps of mg: then its step-2 scale, and
         * every code of the column with it, may differ from the reference's.
         */
        th->c_lo[j] =
            stepq__fp16_to_float(stepq__scale_to_fp16((float)(mg * (1 - TIE_ULPS * 0x1p-24))));
        th->c_hi[j] =
            stepq__fp16_to_float(stepq__scale_to_fp16((float)(mg * (1 + TIE_ULPS * 0x1p-24))));
    }
}

/*
 * Code (i, j), za from the GPU and zb from the reference, |za - zb| = 1.
 * With t the exact argument under the reference's scales, a tie is
 * |za - t| <= 0.5 + eps and |zb - t| <= 0.5 + eps, eps = TIE_ULPS 2^-24
 * max(|t|, 1): t lies within eps of the half-integer between the codes,
 * where the two roundings of t may part. Failing that, za is accepted only as
 * the rounding (within eps) of t under the GPU's own scales: its row scale
 * (one fp16 ulp from the reference's is allowed) or a step-2 column scale
 * that its column max can round to (c_lo, c_hi). Returns 0 (tie), 1 (the
 * GPU's scales), -1 (no tie) or -2 (zb is not a rounding of t: this file's
 * model of the reference is wrong); *t_ref gets t.
 */
static int tie_check(const struct tie_head *th, int i, int j, double qm, int za, int zb,
                     double *t_ref)
{
    double x = th->x[i][j];
    double t = tie_arg(x, th->r_ref[i], th->c_ref[j], qm);
    *t_ref = t;
    if (!tie_near(zb, t))
        return -2;
    if (tie_near(za, t))
        return 0;
    if (tie_near(za, tie_arg(x, th->r_got[i], th->c_lo[j], qm)) ||
        tie_near(za, tie_arg(x, th->r_got[i], th->c_hi[j], qm)))
        return 1;
    return -1;
}

/* What the differing-code accounting of one comparison found. */
struct flips {
    size_t codes, diff, ties_scale, by_scale;
    size_t codes16, diff16; /* of them, the codes of fp16-step heads (arith fp16) */
};

/* Whether head layout hl's decode steps run in fp16 (arith fp16, kernels/step_f16.c). */
static int f16_head(const struct stepq__head_layout *hl)
{
    return hl->arith == STEPQ_ARITH_FP16 && stepq__step_f16_supports(hl);
}

/*
 * bf16 / fp16 pages: the GPU and the reference round differently computed
 * fp32 states, and a tiny element left by cancellation can differ by several
 * of its own ulps. Tolerance: one ulp of the head's largest magnitude plus
 * one ulp of the element.
 */
static int compare_dense16(const struct stepq__head_layout *hl, const uint8_t *a, const uint8_t *b,
                           int s, int h)
{
    int bf = hl->method == STEPQ_METHOD_BF16, mant = bf ? 7 : 10;
    double mx = 0;
    for (int e = 0; e < D * D; e++) {
        uint16_t v = ca_rd16(b + 2 * e);
        mx = fmax(mx, fabs(bf ? stepq__bf16_to_float(v) : stepq__fp16_to_float(v)));
    }
    for (int e = 0; e < D * D; e++) {
        uint16_t va = ca_rd16(a + 2 * e), vb = ca_rd16(b + 2 * e);
        double fa = bf ? stepq__bf16_to_float(va) : stepq__fp16_to_float(va);
        double fb = bf ? stepq__bf16_to_float(vb) : stepq__fp16_to_float(vb);
        double ulp = ldexp(1.0, ilogb(fb == 0 ? 1e-30 : fb) - mant);
        CA_CHECK(fabs(fa - fb) <= TOL_DENSE16_HEAD_ULPS * ldexp(mx, -mant - 1) + ulp,
                 "slot %d head %d element %d: 0x%04x vs 0x%04x (head max %g)", s, h, e, va, vb, mx);
    }
    return 0;
}

/* One quantized block of slot s, head h: a (GPU) vs b (reference); ps: the pack's source. */
static int compare_quant(const struct stepq__head_layout *hl, const float *w, const uint8_t *a,
                         const uint8_t *b, const struct ca_pack_src *ps, int entry, int s, int h,
                         struct flips *f)
{
    static struct tie_head th;
    double den[D] = { 0 }, flip[D] = { 0 };
    int8_t za[D], zb[D];
    const int f16 = !ps && f16_head(hl);
    const int scale_ulps = f16 ? TOL_F16_SCALE_ULPS : TOL_FP16_ULPS;

    if (ps)
        tie_head_load(&th, ps, entry, h, hl, a, b);
    /* Pivots are fp16 values of fp32 states, as a dense fp16 page: a tiny element
     * left by cancellation may differ by several of its own ulps (measured: a
     * subnormal pivot 2 ulps apart), so the tolerance is compare_dense16's. */
    double piv_max = 0;
    for (int i = 0; i < D; i++)
        for (int j = 0; hl->row_bits[i] == STEPQ_BITS_PIVOT && j < D; j++)
            piv_max = fmax(piv_max, fabs(stepq__fp16_to_float(
                                        ca_rd16(b + hl->row_bitoff[i] / 8 + 2 * (size_t)j))));
    for (int i = 0; i < D; i++) {
        int bi = hl->row_bits[i];
        if (bi == STEPQ_BITS_PIVOT) {
            for (int j = 0; j < D; j++) {
                size_t p = hl->row_bitoff[i] / 8 + 2 * (size_t)j;
                double fa = stepq__fp16_to_float(ca_rd16(a + p));
                double fb = stepq__fp16_to_float(ca_rd16(b + p));
                double ulp = ldexp(1.0, ilogb(fb == 0 ? 1e-30 : fb) - 10);
                CA_CHECK(ca_ulp16(ca_rd16(a + p), ca_rd16(b + p)) <= TOL_FP16_ULPS ||
                             fabs(fa - fb) <= TOL_DENSE16_HEAD_ULPS * ldexp(piv_max, -11) + ulp,
                         "slot %d head %d pivot (%d,%d): 0x%04x vs 0x%04x (pivot max %g)", s, h, i,
                         j, ca_rd16(a + p), ca_rd16(b + p), piv_max);
            }
            continue;
        }
        size_t rp = hl->row_scale_offset + 2 * (size_t)i;
        CA_CHECK(ca_ulp16(ca_rd16(a + rp), ca_rd16(b + rp)) <= scale_ulps,
                 "slot %d head %d row scale %d: 0x%04x vs 0x%04x", s, h, i, ca_rd16(a + rp),
                 ca_rd16(b + rp));
        stepq__unpack_codes(a, hl->row_bitoff[i], za, D, bi);
        stepq__unpack_codes(b, hl->row_bitoff[i], zb, D, bi);
        /* refit weights W_i = w_i^2 r_i^2 of the reference's fit */
        double wi = w ? w[i] : 1.0;
        double ri = stepq__fp16_to_float(ca_rd16(b + rp));
        double W = wi * wi * ri * ri, qm = stepq__qmax(bi);
        for (int j = 0; j < D; j++) {
            double zt = zb[j] / qm;
            den[j] += W * zt * zt;
            if (za[j] == zb[j])
                continue;
            f->diff++;
            f->diff16 += (size_t)f16;
            flip[j] += W * (3 * fabs(zt) + 2 / qm) / qm;
            CA_CHECK(abs(za[j] - zb[j]) <= 1, "slot %d head %d code (%d,%d): %d vs %d", s, h, i, j,
                     za[j], zb[j]);
            if (!ps)
                continue;
            double t;
            int k = tie_check(&th, i, j, qm, za[j], zb[j], &t);
            CA_CHECK(k != -2,
                     "slot %d head %d code (%d,%d): reference code %d, but x / r%s * qmax = %.9g"
                     " (checkasm's recomputation of the reference is wrong)",
                     s, h, i, j, zb[j], hl->has_col ? " / c" : "", t);
            CA_CHECK(k >= 0,
                     "slot %d head %d code (%d,%d) @%d: %d vs %d is no tie: x = %.9g, x / r%s *"
                     " qmax = %.9g (r %.9g, c %.9g; GPU's c %.9g..%.9g)",
                     s, h, i, j, bi, za[j], zb[j], (double)th.x[i][j], hl->has_col ? " / c" : "", t,
                     th.r_ref[i], th.c_ref[j], th.c_lo[j], th.c_hi[j]);
            f->by_scale += (size_t)k;
        }
    }
    /*
     * Column scales within one fp16 ulp, except where a code of the column
     * moved at a tie: the fixed-code refit c = N / D then moves by up to W_k
     * (3|zt_k| + 2/qmax) / qmax / D per flipped code k (|dN| <= W_k |dzt|
     * (|zt_k| + 1/qmax) c, |dD| <= W_k |dzt| (2|zt_k| + 1/qmax)), which in a
     * column of few non-zero codes exceeds one ulp.
     */
    if (hl->has_col)
        for (int j = 0; j < D; j++) {
            size_t cp = hl->col_scale_offset + 2 * (size_t)j;
            uint16_t ca = ca_rd16(a + cp), cb = ca_rd16(b + cp);
            if (ca_ulp16(ca, cb) <= scale_ulps)
                continue;
            double fa = stepq__fp16_to_float(ca), fb = stepq__fp16_to_float(cb);
            CA_CHECK(flip[j] > 0 && (den[j] == 0 ||
                                     fabs(fa - fb) <= TOL_COL_TIE_FACTOR * fb * flip[j] / den[j] +
                                                          ldexp(fb, -10)),
                     "slot %d head %d col scale %d: 0x%04x vs 0x%04x (tie bound %g)", s, h, j, ca,
                     cb, den[j] > 0 ? flip[j] / den[j] : -1.0);
            f->ties_scale++;
        }
    return 0;
}

/* An e4m3 code's place in value order: sign-magnitude (+0 and -0 are both 0). */
static int e4m3_ordinal(uint8_t c)
{
    return c & 0x80 ? -(int)(c & 0x7f) : (int)(c & 0x7f);
}

/*
 * One fp8 block of slot s, head h: a (GPU) vs b (reference). A pack (`exact`: the source
 * is the same fp32 or bf16 tensor) must give the same bytes: the tile maxima are exact,
 * both divisions are correctly rounded and both conversions round to nearest even from
 * the same clamped quotient. After a decode step the states differ in the last bits
 * (fp32 against double dot products), so a tile scale may move by TOL_FP8_SCALE_REL and
 * a code only to a neighbour, at a rounding boundary (counted against
 * TOL_STEP_CODE_FLIPS with the integer codes).
 */
static int compare_fp8(const struct stepq__head_layout *hl, const uint8_t *a, const uint8_t *b,
                       int exact, int s, int h, struct flips *f)
{
    for (size_t o = 0; exact && o < hl->block_bytes; o++)
        CA_CHECK(a[o] == b[o], "slot %d head %d fp8 pack byte %zu (%s): 0x%02x vs reference 0x%02x",
                 s, h, o, o < hl->codes_bytes ? "a code" : "a tile scale or padding", a[o], b[o]);
    for (int t = 0; t < stepq__fp8_tiles(D); t++) {
        float sa, sb;
        memcpy(&sa, a + hl->tile_scale_offset + 4 * (size_t)t, 4);
        memcpy(&sb, b + hl->tile_scale_offset + 4 * (size_t)t, 4);
        CA_CHECK(fabs((double)sa - sb) <= TOL_FP8_SCALE_REL * fabs((double)sb),
                 "slot %d head %d fp8 tile scale %d: %.9g vs reference %.9g", s, h, t, sa, sb);
    }
    for (int e = 0; e < D * D; e++) {
        if (a[e] == b[e])
            continue;
        f->diff++;
        CA_CHECK(abs(e4m3_ordinal(a[e]) - e4m3_ordinal(b[e])) <= 1,
                 "slot %d head %d fp8 code (%d,%d): 0x%02x vs reference 0x%02x (not neighbours)", s,
                 h, e / D, e % D, a[e], b[e]);
    }
    for (size_t o = hl->tile_scale_offset + 4 * (size_t)stepq__fp8_tiles(D); o < hl->block_bytes;
         o++)
        CA_CHECK(a[o] == 0 && b[o] == 0, "slot %d head %d fp8 padding byte %zu: 0x%02x / 0x%02x", s,
                 h, o, a[o], b[o]);
    return 0;
}

/* Where byte o of a page lies: the index of the tested block holding it, or -1. */
static int block_of(const struct stepq__packed_layer *pl, size_t o)
{
    for (int h = 0; h < pl->n_heads; h++)
        if (o >= pl->head_offset[h] && o < pl->head_offset[h] + pl->heads[h].block_bytes)
            return h;
    return -1;
}

/* No byte outside the written blocks changed, on either side. */
static int compare_unwritten(const struct fx_pools *fx, const uint8_t *got, const uint8_t *ref,
                             const uint8_t *start, const uint8_t *written)
{
    const size_t P = (size_t)fx->page_bytes, n_pages = (size_t)fx->slots + 1;
    int *where = malloc(P * sizeof(*where));

    CA_CHECK(where, "out of memory");
    for (size_t o = 0; o < P; o++)
        where[o] = block_of(&fx->hpl, o);
    for (size_t s = 0; s < n_pages; s++)
        for (size_t o = 0; o < P; o++) {
            const size_t i = s * P + o;
            const int h = where[o];
            if (h >= 0 && written[s])
                continue;
            if (got[i] == start[i] && ref[i] == start[i])
                continue;
            char place[96];
            if (h < 0)
                snprintf(place, sizeof(place), "outside layer %d's blocks", fx->layer);
            else
                snprintf(place, sizeof(place),
                         "in head %d's block of a slot the call must not write", h);
            const int cuda = got[i] != start[i];
            free(where);
            return checkasm_fail(
                __FILE__, __LINE__,
                "%s pool: stray write at page %zu byte %zu (%s): 0x%02x, was 0x%02x",
                cuda ? "CUDA" : "host", s, o, place, cuda ? got[i] : ref[i], start[i]);
        }
    free(where);
    return 0;
}

int ca_compare_pages(const struct fx_pools *fx, const uint8_t *got, const uint8_t *ref,
                     const uint8_t *start, const uint8_t *written, const struct ca_pack_src *ps)
{
    const struct stepq__packed_layer *pl = &fx->hpl;
    struct flips f = { 0 };

    if (compare_unwritten(fx, got, ref, start, written))
        return 1;
    for (int s = 0; s <= fx->slots; s++)
        for (int h = 0; h < pl->n_heads; h++) {
            const struct stepq__head_layout *hl = &pl->heads[h];
            const size_t off = (size_t)s * fx->page_bytes + pl->head_offset[h];
            const uint8_t *a = got + off, *b = ref + off;
            /* the 1e-4 budget is over every code compared, identical blocks included */
            const size_t head_codes = hl->quantized ? (size_t)(D - hl->n_pivot_rows) * D : 0;
            f.codes += head_codes;
            f.codes16 += f16_head(hl) ? head_codes : 0;
            if (!written[s] || !memcmp(a, b, hl->block_bytes))
                continue;
            const int entry = ps ? src_entry(ps, s) : -1;
            CA_CHECK(!ps || entry >= 0, "slot %d head %d was not packed but its block changed", s,
                     h);
            if (hl->method == STEPQ_METHOD_FP32) {
                const double e = ca_nmse((const float *)a, (const float *)b, D * D);
                CA_CHECK(e <= TOL_F32_NMSE, "slot %d head %d fp32 state NMSE %g (> %g)", s, h, e,
                         TOL_F32_NMSE);
                continue;
            }
            if (!hl->quantized) {
                if (compare_dense16(hl, a, b, s, h))
                    return 1;
                continue;
            }
            if (hl->method == STEPQ_METHOD_FP8) {
                if (compare_fp8(hl, a, b, ps != NULL, s, h, &f))
                    return 1;
                continue;
            }
            const float *w = pl->row_impact ? pl->row_impact + (size_t)h * D : NULL;
            if (compare_quant(hl, w, a, b, ps, entry, s, h, &f))
                return 1;
        }
    CA_CHECK(ps || (double)(f.diff - f.diff16) <= TOL_STEP_CODE_FLIPS * (double)f.codes,
             "%zu of %zu codes differ (> %g)", f.diff - f.diff16, f.codes, TOL_STEP_CODE_FLIPS);
    CA_CHECK(ps || (double)f.diff16 <= TOL_F16_STEP_CODE_FLIPS * (double)f.codes16,
             "fp16 step: %zu of %zu codes differ (> %g)", f.diff16, f.codes16,
             TOL_F16_STEP_CODE_FLIPS);
    if (!ps && f.codes16)
        checkasm_note("fp16 step: %zu of %zu codes differ by +-1 (bound %g)", f.diff16, f.codes16,
                      TOL_F16_STEP_CODE_FLIPS);
    if (f.diff && ps)
        checkasm_note("%zu of %zu codes differ by +-1, each a proven tie (%zu of them under the"
                      " GPU's own scales); %zu column scales moved by them beyond one ulp",
                      f.diff, f.codes, f.by_scale, f.ties_scale);
    else if (f.diff)
        checkasm_note("%zu of %zu codes differ by +-1 (ties); %zu column scales moved by them"
                      " beyond one ulp",
                      f.diff, f.codes, f.ties_scale);
    return 0;
}

int ca_compare_health(const struct fx_pools *fx, const uint32_t *got, const uint32_t *ref,
                      const uint64_t *c_got, const uint64_t *c_ref)
{
    for (int s = 0; s <= fx->slots; s++)
        CA_CHECK(got[s] == ref[s], "health[%d] = 0x%x, reference 0x%x", s, got[s], ref[s]);
    if (!c_got)
        return 0;
    CA_CHECK(!memcmp(c_got, c_ref, STEPQ__HEALTH_NCOUNTS * sizeof(*c_got)),
             "health counts %llu/%llu/%llu/%llu vs reference %llu/%llu/%llu/%llu",
             (unsigned long long)c_got[0], (unsigned long long)c_got[1],
             (unsigned long long)c_got[2], (unsigned long long)c_got[3],
             (unsigned long long)c_ref[0], (unsigned long long)c_ref[1],
             (unsigned long long)c_ref[2], (unsigned long long)c_ref[3]);
    return 0;
}

/* bf16 o: see compare.h. */
static int compare_o_bf16(const struct fx_step_io *io, const uint16_t *got, const uint16_t *ref,
                          const int32_t *slots)
{
    const uint16_t sent = FX_SENTINEL << 8 | FX_SENTINEL;
    size_t off = 0, n = 0;
    for (int b = 0; b < io->batch; b++)
        for (size_t e = 0; e < io->o_stride; e++) {
            const size_t i = (size_t)b * io->o_stride + e;
            const int head = e < (size_t)io->HV * D && slots[b] >= 0;
            if (!head) {
                CA_CHECK(got[i] == ref[i] && ref[i] == sent,
                         "o element %zu (a gap or padding row) is 0x%04x, reference 0x%04x", i,
                         got[i], ref[i]);
                continue;
            }
            n++;
            if (got[i] == ref[i])
                continue;
            const size_t h0 = (size_t)b * io->o_stride + e / D * D;
            double rms = 0;
            for (int j = 0; j < D; j++) {
                double x = stepq__bf16_to_float(ref[h0 + j]);
                rms += x * x / D;
            }
            double ga = stepq__bf16_to_float(got[i]), gb = stepq__bf16_to_float(ref[i]);
            double big = fmax(fabs(ga), fabs(gb));
            double ulp = ldexp(1.0, ilogb(big == 0 ? 1e-38 : big) - 7);
            CA_CHECK(fabs(ga - gb) <= ulp + TOL_BF16_OUT_RMS * sqrt(rms),
                     "o element %zu: bf16 0x%04x vs reference 0x%04x (%g vs %g)", i, got[i], ref[i],
                     ga, gb);
            off++;
        }
    CA_CHECK((double)off <= TOL_BF16_OUT_OFF * (double)n,
             "%zu of %zu bf16 o elements differ (> %g)", off, n, TOL_BF16_OUT_OFF);
    checkasm_note("bf16 strided o: %zu of %zu elements one rounding apart", off, n);
    return 0;
}

int ca_compare_o(const struct fx_step_io *io, const void *got, const void *ref,
                 const int32_t *slots, double *nmse)
{
    return ca_compare_o_tol(io, got, ref, slots, TOL_F32_NMSE, nmse);
}

int ca_compare_o_tol(const struct fx_step_io *io, const void *got, const void *ref,
                     const int32_t *slots, double tol, double *nmse)
{
    if (io->view)
        return compare_o_bf16(io, got, ref, slots);
    const size_t row = (size_t)io->HV * D;
    const float *a = got, *b = ref;
    double num = 0, den = 0;
    for (int e = 0; e < io->batch; e++) {
        const float *ra = a + (size_t)e * row, *rb = b + (size_t)e * row;
        if (slots[e] < 0) {
            /* padding: nothing is written, its row included */
            for (size_t i = 0; i < 4 * row; i++)
                CA_CHECK(((const uint8_t *)ra)[i] == FX_SENTINEL &&
                             ((const uint8_t *)rb)[i] == FX_SENTINEL,
                         "o of padding entry %d: byte %zu written (0x%02x, reference 0x%02x)", e, i,
                         ((const uint8_t *)ra)[i], ((const uint8_t *)rb)[i]);
            continue;
        }
        for (size_t i = 0; i < row; i++) {
            double d = (double)ra[i] - rb[i];
            num += d * d;
            den += (double)rb[i] * rb[i];
        }
    }
    const double e = den > 0 ? num / den : num;
    if (nmse)
        *nmse = e;
    CA_CHECK(e <= tol, "output NMSE %g > %g", e, tol);
    return 0;
}

int ca_expect_refused(stepq_pool_t *pool, int got, int want, const char *needle, const char *what)
{
    CA_CHECK(got == want, "%s: returned %s (%s), expected %s", what, stepq_status_name(got),
             got < 0 ? stepq_pool_last_error(pool) : "no error", stepq_status_name(want));
    CA_CHECK(strstr(stepq_pool_last_error(pool), needle) != NULL,
             "%s: the pool's message '%s' does not name '%s'", what, stepq_pool_last_error(pool),
             needle);
    CA_CHECK(strstr(stepq_last_error(), needle) != NULL,
             "%s: the thread's message '%s' does not name '%s'", what, stepq_last_error(), needle);
    return 0;
}

int ca_transfer_check(const struct fx_transfer *p, const char *verb, const char *prep)
{
    char w[32] = "";
    if (stepq__method_has_units(p->method)) {
        if (p->bits)
            snprintf(w, sizeof(w), "@%d", p->bits);
        else
            snprintf(w, sizeof(w), "%s",
                     p->arch == STEPQ_ARCH_GDN ? " mixed+pivot head" : " mixed rows+pivots");
    }
    char rs[32] = "";
    if (p->row_split > 0)
        snprintf(rs, sizeof(rs), " row split %g", p->row_split);
    return checkasm_check(
        "%s %s %s%s HV=%d n=%d %s %s %s%s%s%s%s", verb, stepq_arch_name(p->arch),
        stepq_method_name(p->method), w, p->HV, p->n, prep, stepq_dtype_name(p->dtype),
        p->layout == STEPQ_STATE_LAYOUT_KV ? "[K,V]" : "[V,K]",
        p->aligned && p->layout == STEPQ_STATE_LAYOUT_VK && p->dtype == STEPQ_DTYPE_BF16
            ? " 16-byte stride"
            : "",
        p->wild_ids ? " cuda ids outside 0..slots" : "", p->column ? " column kernel" : "", rs);
}

int ca_expect_refused_entry(int got, int want, const char *who, const char *what)
{
    CA_CHECK(got == want, "%s: returned %s (%s), expected %s", what, stepq_status_name(got),
             got < 0 ? stepq_last_error() : "no error", stepq_status_name(want));
    CA_CHECK(strstr(stepq_last_error(), who) != NULL, "%s: message '%s' does not name '%s'", what,
             stepq_last_error(), who);
    return 0;
}

int ca_snap_take(struct fx_pools *fx, struct ca_snap *s)
{
    const size_t words = ((size_t)fx->slots + 1) * sizeof(uint32_t);
    s->hp = malloc(fx->pages_bytes);
    s->dp = malloc(fx->pages_bytes);
    s->hh = malloc(words);
    s->dh = malloc(words);
    CA_CHECK(s->hp && s->dp && s->hh && s->dh, "out of memory");
    memcpy(s->hp, fx->hpages, fx->pages_bytes);
    memcpy(s->hh, fx->hhealth, words);
    CA_CHECK(fx_pools_download(fx, s->dp, s->dh) >= 0, "%s", stepq_last_error());
    return 0;
}

void ca_snap_free(struct ca_snap *s)
{
    free(s->hp);
    free(s->dp);
    free(s->hh);
    free(s->dh);
}

int ca_pools_unchanged(struct fx_pools *fx, const struct ca_snap *s, const char *what)
{
    const size_t words = ((size_t)fx->slots + 1) * sizeof(uint32_t);
    uint8_t *pages = malloc(fx->pages_bytes);
    uint32_t *health = malloc(words);
    int rc = 0;

    if (!pages || !health) {
        rc = checkasm_fail(__FILE__, __LINE__, "out of memory");
    } else if (fx_pools_download(fx, pages, health) < 0) {
        rc = checkasm_fail(__FILE__, __LINE__, "%s: %s", what, stepq_last_error());
    } else {
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            rc = checkasm_fail(__FILE__, __LINE__, "%s: CUDA error left behind: %s", what,
                               cudaGetErrorString(e));
        else if (memcmp(fx->hpages, s->hp, fx->pages_bytes) || memcmp(fx->hhealth, s->hh, words))
            rc = checkasm_fail(__FILE__, __LINE__, "%s: the host pool's pages or health changed",
                               what);
        else if (memcmp(pages, s->dp, fx->pages_bytes) || memcmp(health, s->dh, words))
            rc = checkasm_fail(__FILE__, __LINE__, "%s: the CUDA pool's pages or health changed",
                               what);
    }
    free(pages);
    free(health);
    return rc;
}
