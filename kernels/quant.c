/*
 * Fit + pack and reconstruct of one head (arithmetic in kernels/quant.h).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "kernels/quant.h"
#include "plugin/err.h"

/* Blocks may sit at any byte offset in a page: go through memcpy. */
static uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static void wr16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, sizeof(v));
}

static int check_layout(const struct stepq__head_layout *hl)
{
    if (!hl || !hl->row_bitoff || !hl->row_bits || hl->d_k < 1 || hl->d_v < 1 ||
        hl->d_k > STEPQ__MAX_HEAD_DIM || hl->d_v > STEPQ__MAX_HEAD_DIM)
        return stepq__error(STEPQ_EINVAL, "head layout is NULL or not initialised");
    return STEPQ_OK;
}

float stepq__scale_value(float s, uint16_t *h, uint32_t *flags)
{
    if (s > STEPQ__SCALE_MAX)
        *flags |= STEPQ_HEALTH_SATURATED;
    *h = stepq__scale_to_fp16(s);
    return stepq__fp16_to_float(*h);
}

/*
 * The code clamp(rintf(t), +-qf) of a scaled element t (qf = (float)qmax), inlined into
 * loops the compiler vectorises. Clamping before rounding gives the same code (rint is
 * monotonic and fixes the integers +-qmax), and on [-127, 127] adding and subtracting
 * 1.5 * 2^23 rounds to the nearest integer, ties to even, exactly as rintf does in the
 * default rounding mode (the program never changes it); only the sign of a zero can
 * differ, which the conversion to int8_t drops.
 */
static inline int8_t code_of(float t, float qf)
{
    const float magic = 12582912.0f;

    t = qf < t ? qf : t;
    t = -qf > t ? -qf : t;
    t = (t + magic) - magic;
    return (int8_t)(int)t;
}

/*
 * The codes of a row: z[j] = code_of((y[j] / c[j]) * qmax) (c NULL: y[j] * qmax), y the
 * row divided by its row scale.
 */
static void quant_row(const float *y, const float *c, int d_v, int qmax, int8_t *z)
{
    const float qf = (float)qmax;

    for (int j = 0; j < d_v; j++)
        z[j] = code_of((c ? y[j] / c[j] : y[j]) * qf, qf);
}

static void store_dense(const struct stepq__head_layout *hl, const float *x, uint8_t *blk,
                        uint32_t *flags)
{
    size_t n = (size_t)hl->d_k * (size_t)hl->d_v;
    int sat = 0;

    switch (hl->method) {
    case STEPQ_METHOD_FP32:
        memcpy(blk, x, n * sizeof(float));
        break;
    case STEPQ_METHOD_BF16:
        for (size_t e = 0; e < n; e++) {
            uint16_t h = stepq__bf16_from_float(x[e]);
            if ((h & 0x7f80u) == 0x7f80u) { /* rounded up to Inf: saturate */
                h = (uint16_t)((h & 0x8000u) | 0x7f7fu);
                sat = 1;
            }
            wr16(blk + 2 * e, h);
        }
        break;
    default: /* FP16 */
        for (size_t e = 0; e < n; e++)
            wr16(blk + 2 * e, stepq__fp16_from_float_sat(x[e], &sat));
        break;
    }
    if (sat)
        *flags |= STEPQ_HEALTH_SATURATED;
}

/* Stores row i of x as fp16 where it is a pivot row; returns whether it was one. */
static int store_pivot_row(const struct stepq__head_layout *hl, const float *x, int i, uint8_t *blk,
                           uint32_t *flags)
{
    if (hl->row_bits[i] != STEPQ_BITS_PIVOT)
        return 0;
    const float *xr = x + (size_t)i * hl->d_v;
    uint8_t *dst = blk + hl->row_bitoff[i] / 8;
    int sat = 0;

    for (int j = 0; j < hl->d_v; j++)
        wr16(dst + 2 * (size_t)j, stepq__fp16_from_float_sat(xr[j], &sat));
    if (sat)
        *flags |= STEPQ_HEALTH_SATURATED;
    return 1;
}

/*
 * max(acc, v) with fmaxf's answer when v is NaN (acc is kept), but inlined:
 * without -ffast-math GCC calls libm's fmaxf, which was 12% of `stepq eval`.
 * acc is never NaN here (it starts at 0 and only takes values that compare >).
 */
static inline float max_keep(float acc, float v)
{
    return v > acc ? v : acc;
}

static float row_absmax(const float *xr, int d_v)
{
    float m = 0.0f;
    int j = 0;
#ifdef __SSE2__
    /* maxps(v, acc) is v > acc ? v : acc, max_keep(acc, v) lane by lane; max is exact and
     * NaN is skipped in any order, so eight lanes merged at the end give the same value.
     * GCC does not vectorise this reduction by itself (it may not reorder float ones). */
    const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    __m128 m0 = _mm_setzero_ps(), m1 = _mm_setzero_ps();
    for (; j + 8 <= d_v; j += 8) {
        m0 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(xr + j), abs_mask), m0);
        m1 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(xr + j + 4), abs_mask), m1);
    }
    float l[8];
    _mm_storeu_ps(l, m0);
    _mm_storeu_ps(l + 4, m1);
    for (int t = 0; t < 8; t++)
        m = max_keep(m, l[t]);
#else
    float m8[8] = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
    for (; j + 8 <= d_v; j += 8)
        for (int t = 0; t < 8; t++)
            m8[t] = max_keep(m8[t], fabsf(xr[j + t]));
    for (int t = 0; t < 8; t++)
        m = max_keep(m, m8[t]);
#endif
    for (; j < d_v; j++)
        m = max_keep(m, fabsf(xr[j]));
    return m;
}

/* The analysis override of the arithmetic (kernels/quant.h, stepq__quant_set_arith_fp16). */
static int arith_fp16 = 0;

int stepq__quant_set_arith_fp16(int on)
{
    arith_fp16 = on != 0;
    return STEPQ_OK;
}

int stepq__quant_arith_fp16(void)
{
    return arith_fp16;
}

/*
 * x[0..n) through fp16 in the block's normalised domain: divided by 2^e, the smallest
 * power of two >= bound (exact), rounded to fp16 (to nearest even, subnormals kept), and
 * multiplied back. With bound >= max |x| fp16's range never binds; what is left is its
 * 11-bit significand. A bound that is 0 or not finite leaves x as it is.
 */
static void fp16_block(float *x, size_t n, float bound)
{
    if (!(bound > 0.0f) || !isfinite(bound))
        return;
    int e;
    (void)frexpf(bound, &e); /* bound = m 2^e, m in [0.5, 1): 2^e >= bound */
    const float down = ldexpf(1.0f, -e), up = ldexpf(1.0f, e);
    for (size_t i = 0; i < n; i++)
        x[i] = stepq__fp16_to_float(stepq__fp16_from_float(x[i] * down)) * up;
}

/* y = x / r over a row of d_v, through fp16 below bound (fp16_block) under the analysis arithmetic.
 */
static void row_over_scale(float *y, const float *x, float r, int d_v, float bound)
{
    for (int j = 0; j < d_v; j++)
        y[j] = x[j] / r;
    if (arith_fp16)
        fp16_block(y, (size_t)d_v, bound);
}

/* uniform / temporal: row absmax scales, no column scales. */
static void fit_rowmax(const struct stepq__head_layout *hl, const float *x, uint8_t *blk,
                       uint32_t *flags)
{
    int d_k = hl->d_k, d_v = hl->d_v;
    int8_t z[STEPQ__MAX_HEAD_DIM];
    float y[STEPQ__MAX_HEAD_DIM];

    for (int i = 0; i < d_k; i++) {
        if (store_pivot_row(hl, x, i, blk, flags))
            continue;
        const float *xr = x + (size_t)i * d_v;
        int b = hl->row_bits[i];
        int qmax = stepq__qmax(b);
        uint16_t rh;
        float r = stepq__scale_value(row_absmax(xr, d_v), &rh, flags);
        wr16(blk + hl->row_scale_offset + 2 * (size_t)i, rh);
        row_over_scale(y, xr, r, d_v, 1.0f); /* |y| <= 1 (to an fp16 rounding of r) */
        quant_row(y, NULL, d_v, qmax, z);
        stepq__pack_codes(blk, hl->row_bitoff[i], z, (size_t)d_v, b);
    }
}

/* The analysis override of fit_dual's row split (kernels/quant.h): 0 = unset, the layout's. */
static double row_split_override = 0.0;

int stepq__quant_set_row_split(double alpha)
{
    if (!(alpha > 0.0 && alpha <= 1.0))
        return stepq__error(STEPQ_EINVAL, "row split %g outside (0, 1]", alpha);
    row_split_override = alpha;
    return STEPQ_OK;
}

void stepq__quant_clear_row_split(void)
{
    row_split_override = 0.0;
}

double stepq__quant_row_split(void)
{
    return row_split_override;
}

double stepq__quant_row_split_or(double own)
{
    return row_split_override > 0.0 ? row_split_override : own;
}

double stepq__quant_row_split_of(const struct stepq__head_layout *hl)
{
    return stepq__quant_row_split_or(hl->row_split);
}

/*
 * dsq / spatial / stepq: the key-row-aware dual-axis fit (w NULL = all 1); without
 * `refit` (STEPQ_DECODE_FIT_NOREFIT) steps 1-3 only, the step-2 column scales stored.
 */
static void fit_dual(const struct stepq__head_layout *hl, const float *x, const float *w, int refit,
                     uint8_t *blk, uint32_t *flags)
{
    int d_k = hl->d_k, d_v = hl->d_v;
    float r[STEPQ__MAX_HEAD_DIM], c[STEPQ__MAX_HEAD_DIM];
    double num[STEPQ__MAX_HEAD_DIM], den[STEPQ__MAX_HEAD_DIM];
    float yrow[STEPQ__MAX_HEAD_DIM], zt_a[STEPQ__MAX_HEAD_DIM], zt_b[STEPQ__MAX_HEAD_DIM];
    int8_t z[STEPQ__MAX_HEAD_DIM];
    int any_int = 0;
    float ymax = 0.0f; /* max |y| = max_i m_i / r_i over the integer rows: the fp16 block's bound */
    const double split = stepq__quant_row_split_of(hl);

    /* Step 1: row scales; pivot rows are stored as they are. */
    for (int i = 0; i < d_k; i++) {
        if (store_pivot_row(hl, x, i, blk, flags))
            continue;
        const float *xr = x + (size_t)i * d_v;
        any_int = 1;
        float wi = w ? w[i] : 1.0f;
        uint16_t rh;
        const float m = row_absmax(xr, d_v);
        r[i] = stepq__scale_value(split == 0.5 ? sqrtf(m / wi)
                                               : (float)(pow((double)m, split) / sqrt((double)wi)),
                                  &rh, flags);
        wr16(blk + hl->row_scale_offset + 2 * (size_t)i, rh);
        if (r[i] > 0.0f)
            ymax = max_keep(ymax, m / r[i]);
    }
    if (!any_int)
        return;

    /* Step 2: column scales of Y = X / r over the integer rows; Y is kept for step 3 when
     * there is room (else step 3 divides again: the same values). */
    float *y = malloc(sizeof(float) * (size_t)d_k * (size_t)d_v);
    for (int j = 0; j < d_v; j++)
        c[j] = 0.0f;
    for (int i = 0; i < d_k; i++) {
        if (hl->row_bits[i] == STEPQ_BITS_PIVOT)
            continue;
        const float *xr = x + (size_t)i * d_v;
        float *yr = y ? y + (size_t)i * d_v : yrow;
        row_over_scale(yr, xr, r[i], d_v, ymax);
        for (int j = 0; j < d_v; j++)
            c[j] = max_keep(c[j], fabsf(yr[j]));
    }
    for (int j = 0; j < d_v; j++) {
        uint16_t ch;
        c[j] = stepq__scale_value(c[j], &ch, flags);
        num[j] = 0.0;
        den[j] = 0.0;
    }

    /* Step 3: codes, packed row by row; step 4's sums ride along, two rows per pass over
     * num/den (rows still added in order: the pending row p, then row i). */
    int p = -1;
    double w2r_p = 0.0, w2r2_p = 0.0;
    for (int i = 0; i < d_k; i++) {
        int b = hl->row_bits[i];
        if (b == STEPQ_BITS_PIVOT)
            continue;
        const float *xr = x + (size_t)i * d_v;
        int qmax = stepq__qmax(b);
        double wi = w ? (double)w[i] : 1.0;
        double w2r = wi * wi * (double)r[i];
        double w2r2 = w2r * (double)r[i];
        float qf = (float)qmax;
        float *yr = yrow;
        if (y)
            yr = y + (size_t)i * d_v;
        else
            row_over_scale(yrow, xr, r[i], d_v, ymax);
        quant_row(yr, c, d_v, qmax, z);
        stepq__pack_codes(blk, hl->row_bitoff[i], z, (size_t)d_v, b);
        if (!refit)
            continue; /* no sums: step 4 stores the step-2 scales */
        float *zt = p < 0 ? zt_a : zt_b;
        for (int j = 0; j < d_v; j++)
            zt[j] = (float)z[j] / qf;
        if (p < 0) {
            p = i;
            w2r_p = w2r;
            w2r2_p = w2r2;
            continue;
        }
        const float *xp = x + (size_t)p * d_v;
        for (int j = 0; j < d_v; j++) {
            double za = zt_a[j], zb = zt_b[j];
            num[j] = (num[j] + w2r_p * za * (double)xp[j]) + w2r * zb * (double)xr[j];
            den[j] = (den[j] + w2r2_p * za * za) + w2r2 * zb * zb;
        }
        p = -1;
    }
    if (p >= 0) {
        const float *xp = x + (size_t)p * d_v;
        for (int j = 0; j < d_v; j++) {
            double za = zt_a[j];
            num[j] += w2r_p * za * (double)xp[j];
            den[j] += w2r2_p * za * za;
        }
    }

    /* Step 4: fixed-code column refit (weighted least squares); den stays 0 without it. */
    for (int j = 0; j < d_v; j++) {
        uint16_t ch;
        if (den[j] > 0.0)
            stepq__scale_value((float)(num[j] / den[j]), &ch, flags);
        else
            ch = stepq__scale_to_fp16(c[j]);
        wr16(blk + hl->col_scale_offset + 2 * (size_t)j, ch);
    }
    free(y);
}

/*
 * Whether the fp16 column scale h can serve the decode fit rows: a positive finite value
 * (0, a negative value, Inf and NaN cannot; the exact fit stores 0 or [2^-14, 65504]).
 */
static int rows_col_ok(uint16_t h)
{
    return (uint16_t)(h - 1u) < 0x7bffu;
}

/*
 * The decode fit rows (kernels/quant.h): the column scales ch (fp16, the old block's) are
 * kept, the row scales refitted to them. x is finite (sanitised). Returns 0, having written
 * nothing, where the old block cannot serve (a column scale not positive finite, no integer row, a
 * row scale that would saturate, a row maximum above STEPQ__ROWS_GROW times the old row scale
 * rh of that row): the caller then fits exactly.
 */
static int fit_rows(const struct stepq__head_layout *hl, const float *x, const uint16_t *ch,
                    const uint16_t *rh, uint8_t *blk, uint32_t *flags)
{
    int d_k = hl->d_k, d_v = hl->d_v, any_int = 0;
    float rc[STEPQ__MAX_HEAD_DIM], m[STEPQ__MAX_HEAD_DIM];
    int8_t z[STEPQ__MAX_HEAD_DIM];

    for (int j = 0; j < d_v; j++) {
        if (!rows_col_ok(ch[j]))
            return 0;
        rc[j] = 1.0f / stepq__fp16_to_float(ch[j]); /* RN(1/c_j), once per column */
    }
    /* Step 1: every row maximum first, so that a saturating one falls back unwritten. */
    for (int i = 0; i < d_k; i++) {
        if (hl->row_bits[i] == STEPQ_BITS_PIVOT)
            continue;
        const float *xr = x + (size_t)i * d_v;
        float mi = 0.0f;
        for (int j = 0; j < d_v; j++)
            mi = max_keep(mi, fabsf(xr[j]) * rc[j]);
        if (!(mi <= STEPQ__SCALE_MAX))
            return 0;
        if (mi > STEPQ__ROWS_GROW * stepq__fp16_to_float(rh[i])) /* the growth trigger */
            return 0;
        m[i] = mi;
        any_int = 1;
    }
    if (!any_int)
        return 0;

    /* Steps 2 and 3: r_i = fp16(m_i) (never 0: the conversion clamps to [2^-14, 65504]),
     * codes at (x_ij RN(1/c_j)) (qmax_i / r_i), the factor one float division per row. */
    for (int i = 0; i < d_k; i++) {
        if (store_pivot_row(hl, x, i, blk, flags))
            continue;
        const float *xr = x + (size_t)i * d_v;
        int b = hl->row_bits[i];
        uint16_t r16; /* the new row scale (rh holds the old ones) */
        const float r = stepq__scale_value(m[i], &r16, flags);
        const int qmax = stepq__qmax(b);
        const float qf = (float)qmax, s = qf / r;
        wr16(blk + hl->row_scale_offset + 2 * (size_t)i, r16);
        for (int j = 0; j < d_v; j++)
            z[j] = code_of((xr[j] * rc[j]) * s, qf);
        stepq__pack_codes(blk, hl->row_bitoff[i], z, (size_t)d_v, b);
    }
    /* Step 4: the column scales as they were. */
    for (int j = 0; j < d_v; j++)
        wr16(blk + hl->col_scale_offset + 2 * (size_t)j, ch[j]);
    return 1;
}

/*
 * fp8: per tile of 32 columns over all rows, s = amax / 240 (fp32, stored as is), codes
 * e4m3(clamp(x / s, +-240)) with round to nearest even (kernels/format.h). A tile whose
 * scale is 0 (all zero, or amax / 240 below the smallest float) keeps codes 0; a
 * division by it would make Inf/NaN of the zeros. x is finite here.
 */
static void fit_fp8(const struct stepq__head_layout *hl, const float *x, uint8_t *blk)
{
    int d_k = hl->d_k, d_v = hl->d_v;

    for (int t = 0, j0 = 0; j0 < d_v; t++, j0 += STEPQ__FP8_TILE) {
        int j1 = j0 + STEPQ__FP8_TILE < d_v ? j0 + STEPQ__FP8_TILE : d_v;
        float m = 0.0f;
        for (int i = 0; i < d_k; i++)
            m = max_keep(m, row_absmax(x + (size_t)i * d_v + j0, j1 - j0));
        float sc = m / STEPQ__FP8_AMAX;
        memcpy(blk + hl->tile_scale_offset + 4 * (size_t)t, &sc, sizeof(sc));
        if (sc == 0.0f)
            continue; /* the codes stay 0 (the block was cleared) */
        for (int i = 0; i < d_k; i++) {
            const float *xr = x + (size_t)i * d_v;
            uint8_t *cr = blk + (size_t)i * d_v;
            float y[STEPQ__FP8_TILE];
            for (int j = j0; j < j1; j++) /* the divisions apart: this loop vectorises */
                y[j - j0] = xr[j] / sc;
            for (int j = j0; j < j1; j++)
                cr[j] = stepq__e4m3_from_float(y[j - j0]);
        }
    }
}

/* The reconstruction of fit_fp8's block: x^ = float(code) * s of the code's tile. */
static void dequant_fp8(const struct stepq__head_layout *hl, const uint8_t *blk, float *x)
{
    int d_k = hl->d_k, d_v = hl->d_v;
    float sc[STEPQ__MAX_HEAD_DIM / STEPQ__FP8_TILE + 1];

    for (int t = 0; t < stepq__fp8_tiles(d_v); t++)
        memcpy(&sc[t], blk + hl->tile_scale_offset + 4 * (size_t)t, sizeof(float));
    for (int i = 0; i < d_k; i++) {
        const uint8_t *cr = blk + (size_t)i * d_v;
        float *xr = x + (size_t)i * d_v;
        for (int t = 0, j0 = 0; j0 < d_v; t++, j0 += STEPQ__FP8_TILE) {
            int j1 = j0 + STEPQ__FP8_TILE < d_v ? j0 + STEPQ__FP8_TILE : d_v;
            for (int j = j0; j < j1; j++)
                xr[j] = stepq__e4m3_to_float(cr[j]) * sc[t];
        }
    }
}

int stepq__quantize_head(const struct stepq__head_layout *hl, const float *x, const float *w,
                         void *block, uint32_t *flags)
{
    return stepq__quantize_head_fit(hl, x, w, NULL, block, flags, STEPQ_DECODE_FIT_EXACT);
}

int stepq__quantize_head_fit(const struct stepq__head_layout *hl, const float *x, const float *w,
                             const void *old, void *block, uint32_t *flags, stepq_decode_fit fit)
{
    return stepq__quantize_head_fit_ex(hl, x, w, old, block, flags, fit, NULL);
}

int stepq__quantize_head_fit_ex(const struct stepq__head_layout *hl, const float *x, const float *w,
                                const void *old, void *block, uint32_t *flags, stepq_decode_fit fit,
                                int *exact)
{
    uint32_t dummy = 0;
    int ex = 0;
    int rc = check_layout(hl);

    if (rc < 0)
        return rc;
    if (!x || !block)
        return stepq__error(STEPQ_EINVAL, "quantize head: NULL state or block");
    if ((unsigned)fit >= STEPQ_DECODE_FIT_COUNT)
        return stepq__error(STEPQ_EINVAL, "quantize head: unknown fit %d", (int)fit);
    const int rows = fit == STEPQ_DECODE_FIT_ROWS && stepq_method_has_col_scales(hl->method);
    if (rows && !old)
        return stepq__error(STEPQ_EINVAL, "quantize head: the fit rows needs the old block");
    if (!flags)
        flags = &dummy;

    int use_w = w && stepq__method_uses_row_impact(hl->method);
    if (use_w)
        for (int i = 0; i < hl->d_k; i++)
            if (!(w[i] > 0.0f) || !isfinite(w[i]))
                return stepq__error(STEPQ_EINVAL,
                                    "quantize head: row impact w[%d] = %g is not finite and > 0", i,
                                    (double)w[i]);

    /* Non-finite elements become 0 (on a private copy: x stays const). */
    size_t n = (size_t)hl->d_k * (size_t)hl->d_v;
    float *clean = NULL;
    uint32_t nonfinite = 0;
    for (size_t e = 0; e < n; e++) { /* isfinite on the bits, no early exit: vectorises */
        uint32_t b;
        memcpy(&b, x + e, sizeof(b));
        nonfinite |= (b & 0x7f800000u) == 0x7f800000u;
    }
    if (nonfinite) {
        clean = malloc(n * sizeof(float));
        if (!clean)
            return stepq__error(STEPQ_ENOMEM, "quantize head: out of memory");
        for (size_t f = 0; f < n; f++)
            clean[f] = isfinite(x[f]) ? x[f] : 0.0f;
        *flags |= STEPQ_HEALTH_STATE;
        x = clean;
    }

    /* The analysis arithmetic fp16: the state to fit (the updated state) through fp16 first,
     * on a private copy; fp8 and the dense methods are left as they are. */
    if (arith_fp16 && hl->quantized && hl->method != STEPQ_METHOD_FP8) {
        if (!clean) {
            clean = malloc(n * sizeof(float));
            if (!clean)
                return stepq__error(STEPQ_ENOMEM, "quantize head: out of memory");
            memcpy(clean, x, n * sizeof(float));
            x = clean;
        }
        fp16_block(clean, n, row_absmax(clean, (int)n)); /* the whole head as one row */
    }

    /* rows: the old column and row scales, read before the block is cleared (old may be block) */
    uint16_t ch[STEPQ__MAX_HEAD_DIM], rh[STEPQ__MAX_HEAD_DIM];
    if (rows) {
        for (int j = 0; j < hl->d_v; j++)
            ch[j] = rd16((const uint8_t *)old + hl->col_scale_offset + 2 * (size_t)j);
        for (int i = 0; i < hl->d_k; i++)
            rh[i] = rd16((const uint8_t *)old + hl->row_scale_offset + 2 * (size_t)i);
    }

    uint8_t *blk = block;
    memset(blk, 0, hl->block_bytes);
    if (!hl->quantized)
        store_dense(hl, x, blk, flags);
    else if (hl->method == STEPQ_METHOD_FP8)
        fit_fp8(hl, x, blk);
    else if (rows && fit_rows(hl, x, ch, rh, blk, flags))
        ; /* served by the old column scales (x sanitised above); else the exact fit below */
    else if (stepq_method_has_col_scales(hl->method)) {
        ex = rows || fit == STEPQ_DECODE_FIT_EXACT;
        fit_dual(hl, x, use_w ? w : NULL, fit != STEPQ_DECODE_FIT_NOREFIT, blk, flags);
    } else
        fit_rowmax(hl, x, blk, flags);
    if (exact)
        *exact = ex;
    free(clean);
    return STEPQ_OK;
}

int stepq__dequantize_head(const struct stepq__head_layout *hl, const void *block, float *x)
{
    int rc = check_layout(hl);

    if (rc < 0)
        return rc;
    if (!x || !block)
        return stepq__error(STEPQ_EINVAL, "dequantize head: NULL state or block");

    const uint8_t *blk = block;
    int d_k = hl->d_k, d_v = hl->d_v;
    size_t n = (size_t)d_k * (size_t)d_v;

    if (!hl->quantized) {
        if (hl->method == STEPQ_METHOD_FP32)
            memcpy(x, blk, n * sizeof(float));
        else if (hl->method == STEPQ_METHOD_BF16)
            for (size_t e = 0; e < n; e++)
                x[e] = stepq__bf16_to_float(rd16(blk + 2 * e));
        else
            for (size_t e = 0; e < n; e++)
                x[e] = stepq__fp16_to_float(rd16(blk + 2 * e));
        return STEPQ_OK;
    }

    if (hl->method == STEPQ_METHOD_FP8) {
        dequant_fp8(hl, blk, x);
        return STEPQ_OK;
    }

    float c[STEPQ__MAX_HEAD_DIM];
    int8_t z[STEPQ__MAX_HEAD_DIM];
    for (int j = 0; j < d_v; j++)
        c[j] = hl->has_col ? stepq__fp16_to_float(rd16(blk + hl->col_scale_offset + 2 * (size_t)j))
                           : 1.0f;
    for (int i = 0; i < d_k; i++) {
        float *xr = x + (size_t)i * d_v;
        int b = hl->row_bits[i];
        if (b == STEPQ_BITS_PIVOT) {
            const uint8_t *src = blk + hl->row_bitoff[i] / 8;
            for (int j = 0; j < d_v; j++)
                xr[j] = stepq__fp16_to_float(rd16(src + 2 * (size_t)j));
            continue;
        }
        float r = stepq__fp16_to_float(rd16(blk + hl->row_scale_offset + 2 * (size_t)i));
        float qmax = (float)stepq__qmax(b);
        stepq__unpack_codes(blk, hl->row_bitoff[i], z, (size_t)d_v, b);
        if (hl->has_col)
            for (int j = 0; j < d_v; j++)
                xr[j] = (r * c[j]) * ((float)z[j] / qmax);
        else
            for (int j = 0; j < d_v; j++)
                xr[j] = r * ((float)z[j] / qmax);
    }
    if (arith_fp16) {
        /* the bound a kernel has before it reconstructs: max r_i x max c_j (|z| <= qmax) over
         * the integer rows, and the pivot rows' own largest value */
        float rmax = 0.0f, cmax = hl->has_col ? 0.0f : 1.0f, pmax = 0.0f;
        for (int j = 0; hl->has_col && j < d_v; j++)
            cmax = max_keep(cmax, fabsf(c[j]));
        for (int i = 0; i < d_k; i++) {
            if (hl->row_bits[i] == STEPQ_BITS_PIVOT)
                pmax = max_keep(pmax, row_absmax(x + (size_t)i * d_v, d_v));
            else
                rmax = max_keep(rmax, fabsf(stepq__fp16_to_float(
                                          rd16(blk + hl->row_scale_offset + 2 * (size_t)i))));
        }
        fp16_block(x, n, max_keep(rmax * cmax, pmax));
    }
    return STEPQ_OK;
}

double stepq__weighted_sq_error(const float *x, const float *y, const float *w, int d_k, int d_v)
{
    double total = 0.0;

    for (int i = 0; i < d_k; i++) {
        double row = 0.0;
        for (int j = 0; j < d_v; j++) {
            double d = (double)x[(size_t)i * d_v + j] - (double)y[(size_t)i * d_v + j];
            row += d * d;
        }
        double wi = w ? (double)w[i] : 1.0;
        total += wi * wi * row;
    }
    return total;
}
