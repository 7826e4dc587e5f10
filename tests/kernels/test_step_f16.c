/*
 * The fp16 decode step of the C reference (kernels/step_f16.c, the map field arith fp16) against
 * the fp32 step on the same packed heads: its readout and the quantization error of its new
 * state stay within bounds of the fp32 step's for every width and shape, also over many steps,
 * from a zeroed page and for states whose scales saturate; it writes in place as out of place;
 * stepq__step_f16_supports' truth table (tests/pool/test_step.c checks that the pool's step
 * routes exactly those heads to it); and the decode fit norefit changes the column scales only. KDA
 * heads (per-row decays, mixed widths, pivot rows) the same, and their pivot rows are the fp32
 * step's update, a non-finite old pivot value reading as 0 with STATE.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/dsp.h"
#include "kernels/quant.h"
#include "tests/kernels/util.h"

struct head {
    struct stepq__head_layout hl;
    int dk, dv;
    float *x, *w, *scratch, *tile;
    uint8_t *blk, *b16, *b32;
};

/* A stepq head of arch with the row widths rb (pivot rows STEPQ_BITS_PIVOT), arith fp16. */
static void head_init_rb(struct head *h, stepq_arch arch, int dk, int dv, const uint8_t *rb)
{
    memset(h, 0, sizeof(*h));
    assert_int_equal(stepq__head_layout_init(&h->hl, STEPQ_METHOD_STEPQ, arch, dk, dv, rb, 0),
                     STEPQ_OK);
    h->hl.arith = STEPQ_ARITH_FP16;
    h->dk = dk;
    h->dv = dv;
    const size_t n = (size_t)dk * dv;
    h->x = calloc(n, sizeof(float));
    h->tile = calloc(n, sizeof(float));
    h->scratch = calloc(2 * n, sizeof(float));
    h->w = calloc((size_t)dk, sizeof(float));
    h->blk = calloc(1, h->hl.block_bytes);
    h->b16 = calloc(1, h->hl.block_bytes);
    h->b32 = calloc(1, h->hl.block_bytes);
    assert_non_null(h->x);
    assert_non_null(h->b32);
}

/* A GDN head: every row of width bits. */
static void head_init(struct head *h, int dk, int dv, int bits)
{
    uint8_t rb[STEPQ__MAX_HEAD_DIM];
    memset(rb, bits, sizeof(rb));
    head_init_rb(h, STEPQ_ARCH_GDN, dk, dv, rb);
}

static void head_free(struct head *h)
{
    stepq__head_layout_free(&h->hl);
    free(h->x);
    free(h->tile);
    free(h->scratch);
    free(h->w);
    free(h->blk);
    free(h->b16);
    free(h->b32);
}

/* A state of log-normal row and column magnitudes (spreads rs, cs) times amp, packed exactly. */
static void head_fill(struct head *h, uint64_t *rng, float rs, float cs, float amp)
{
    float rm[STEPQ__MAX_HEAD_DIM], cm[STEPQ__MAX_HEAD_DIM];
    for (int i = 0; i < h->dk; i++) {
        rm[i] = expf(rs * 1.7f * rng_sym(rng));
        h->w[i] = 0.3f + 2.0f * rng_unit(rng);
    }
    for (int j = 0; j < h->dv; j++)
        cm[j] = expf(cs * 1.7f * rng_sym(rng));
    for (int i = 0; i < h->dk; i++)
        for (int j = 0; j < h->dv; j++)
            h->x[(size_t)i * h->dv + j] = amp * rm[i] * cm[j] * rng_sym(rng);
    uint32_t fl = 0;
    assert_int_equal(stepq__quantize_head(&h->hl, h->x, h->w, h->blk, &fl), STEPQ_OK);
}

struct inputs {
    float q[STEPQ__MAX_HEAD_DIM], k[STEPQ__MAX_HEAD_DIM], v[STEPQ__MAX_HEAD_DIM];
    float g[STEPQ__MAX_HEAD_DIM], beta; /* g: GDN g[0], KDA d_k log decays */
};

/* Prepared inputs as the reference's prep gives them: unit k, q scaled by dk^-1/2. */
static void inputs_gen(struct inputs *in, int dk, int dv, uint64_t *rng, float vamp)
{
    double nq = 0, nk = 0;
    for (int i = 0; i < dk; i++) {
        in->q[i] = rng_sym(rng);
        in->k[i] = rng_sym(rng);
        nq += (double)in->q[i] * in->q[i];
        nk += (double)in->k[i] * in->k[i];
    }
    for (int i = 0; i < dk; i++) {
        in->q[i] = (float)(in->q[i] / sqrt(nq) / sqrt((double)dk));
        in->k[i] = (float)(in->k[i] / sqrt(nk));
    }
    for (int j = 0; j < dv; j++)
        in->v[j] = vamp * rng_sym(rng);
    in->g[0] = -0.05f - 0.5f * rng_unit(rng);
    in->beta = 0.2f + 0.7f * rng_unit(rng);
}

/* inputs_gen with KDA's per-row log decays g_i in [-1, -0.01] (alpha_i from 0.37 to 0.99). */
static void inputs_gen_kda(struct inputs *in, int dk, int dv, uint64_t *rng, float vamp)
{
    inputs_gen(in, dk, dv, rng, vamp);
    for (int i = 0; i < dk; i++)
        in->g[i] = -0.01f - 0.99f * rng_unit(rng);
}

struct result {
    double o_rel;  /* fp16 readout vs fp32 readout */
    double e16;    /* |decode(fp16 block) - exact update| / |exact update| */
    double e32;    /* the same for the fp32 step's block */
    uint32_t fl16; /* flags of the fp16 step */
    uint32_t fl32; /* and of the fp32 step (update and fit) */
};

/* One step from h->blk by both arithmetics; h->b16 and h->b32 get the new blocks. */
static struct result step_both(struct head *h, const struct inputs *in)
{
    const size_t n = (size_t)h->dk * h->dv;
    float o16[STEPQ__MAX_HEAD_DIM], o32[STEPQ__MAX_HEAD_DIM];
    struct result r;
    r.fl16 = stepq__step_head_f16(&h->hl, h->blk, h->w, in->q, in->k, in->v, in->g, in->beta,
                                  h->b16, o16, h->scratch, NULL);
    /* the fp32 step (kernels/step.c): the exact update of the decoded state, fitted with the
     * layout's decode fit (exact here) */
    assert_int_equal(stepq__dequantize_head(&h->hl, h->blk, h->x), STEPQ_OK);
    uint32_t fl = stepq__head_update(h->x, (size_t)h->dv, 1, h->hl.arch == STEPQ_ARCH_KDA, h->dk,
                                     h->dv, in->q, in->k, in->v, in->g, in->beta, o32);
    assert_int_equal(
        stepq__quantize_head_fit(&h->hl, h->x, h->w, h->blk, h->b32, &fl, h->hl.decode_fit),
        STEPQ_OK);
    r.fl32 = fl;
    r.o_rel = rel_err(o16, o32, (size_t)h->dv);
    assert_int_equal(stepq__dequantize_head(&h->hl, h->b16, h->tile), STEPQ_OK);
    r.e16 = rel_err(h->tile, h->x, n);
    assert_int_equal(stepq__dequantize_head(&h->hl, h->b32, h->tile), STEPQ_OK);
    r.e32 = rel_err(h->tile, h->x, n);
    for (size_t e = 0; e < n; e++)
        assert_true(isfinite(h->tile[e]));
    return r;
}

/*
 * Every width on 128x128 and on two smaller shapes, rows and columns spread by e^(+-1.7 s):
 * the readout within 3e-3 of fp32's (fp16's 11 bits over the dot products' partial sums) and
 * the new state's error within 1.03x of the fp32 fit's (1.10x at 8 bits, where fp16's rounding
 * of Y is 1/16 of a code step).
 */
static void fp16_step_tracks_fp32_for_every_width(void **state)
{
    (void)state;
    static const int widths[] = { 2, 3, 4, 5, 6, 8 };
    static const int shapes[][2] = { { 128, 128 }, { 64, 64 }, { 40, 24 } };
    static const float spreads[][2] = { { 0.0f, 0.0f }, { 1.0f, 0.7f }, { 2.0f, 2.0f } };
    uint64_t rng = 7;
    for (size_t s = 0; s < 3; s++)
        for (size_t b = 0; b < sizeof(widths) / sizeof(widths[0]); b++)
            for (size_t sp = 0; sp < 3; sp++) {
                struct head h;
                head_init(&h, shapes[s][0], shapes[s][1], widths[b]);
                assert_true(stepq__step_f16_supports(&h.hl));
                double w16 = 0, w32 = 0, wo = 0;
                for (int rep = 0; rep < 4; rep++) {
                    struct inputs in;
                    head_fill(&h, &rng, spreads[sp][0], spreads[sp][1], 0.3f);
                    inputs_gen(&in, h.dk, h.dv, &rng, 0.5f);
                    struct result r = step_both(&h, &in);
                    w16 += r.e16;
                    w32 += r.e32;
                    wo = fmax(wo, r.o_rel);
                    assert_int_equal(r.fl16, 0);
                }
                const double lim = widths[b] == 8 ? 1.10 : 1.03;
                if (!(wo < 3e-3) || !(w16 < lim * w32))
                    fail_msg("%dx%d @%d spread (%g, %g): readout %.3g, state error fp16 %.4g vs "
                             "fp32 %.4g (%.4fx)",
                             h.dk, h.dv, widths[b], spreads[sp][0], spreads[sp][1], wo, w16 / 4,
                             w32 / 4, w16 / w32);
                head_free(&h);
            }
}

/*
 * 256 steps on one head, three trajectories from the same packed start: the exact fp32 recurrence
 * on a dense state, the fp32 packed step and the fp16 packed step. The fp16 one's readouts and
 * final state stay as close to the exact trajectory as the fp32 one's (within 1.10x); the two
 * packed trajectories drift apart by the codes' rounding either way.
 */
static void fp16_trajectory_tracks_the_exact_one_as_fp32(void **state)
{
    (void)state;
    uint64_t rng = 99;
    struct head a, b;
    head_init(&a, 128, 128, 6);
    head_init(&b, 128, 128, 6);
    head_fill(&a, &rng, 1.0f, 0.7f, 0.3f);
    memcpy(b.blk, a.blk, a.hl.block_bytes);
    memcpy(b.w, a.w, sizeof(float) * 128);
    float *ex = calloc(128 * 128, sizeof(float));
    assert_non_null(ex);
    assert_int_equal(stepq__dequantize_head(&a.hl, a.blk, ex), STEPQ_OK);
    double n16 = 0, n32 = 0, den = 0;
    for (int t = 0; t < 256; t++) {
        struct inputs in;
        float o16[128], o32[128], oe[128];
        inputs_gen(&in, 128, 128, &rng, 0.5f);
        (void)stepq__step_head_f16(&a.hl, a.blk, a.w, in.q, in.k, in.v, in.g, in.beta, a.blk, o16,
                                   a.scratch, NULL);
        assert_int_equal(stepq__dequantize_head(&b.hl, b.blk, b.x), STEPQ_OK);
        uint32_t fl =
            stepq__head_update(b.x, 128, 1, 0, 128, 128, in.q, in.k, in.v, in.g, in.beta, o32);
        assert_int_equal(stepq__quantize_head(&b.hl, b.x, b.w, b.blk, &fl), STEPQ_OK);
        (void)stepq__head_update(ex, 128, 1, 0, 128, 128, in.q, in.k, in.v, in.g, in.beta, oe);
        for (int j = 0; j < 128; j++) {
            n16 += ((double)o16[j] - oe[j]) * ((double)o16[j] - oe[j]);
            n32 += ((double)o32[j] - oe[j]) * ((double)o32[j] - oe[j]);
            den += (double)oe[j] * oe[j];
        }
    }
    assert_int_equal(stepq__dequantize_head(&a.hl, a.blk, a.tile), STEPQ_OK);
    assert_int_equal(stepq__dequantize_head(&b.hl, b.blk, b.tile), STEPQ_OK);
    const double s16 = rel_err(a.tile, ex, 128 * 128), s32 = rel_err(b.tile, ex, 128 * 128);
    const double r16 = sqrt(n16 / den), r32 = sqrt(n32 / den);
    if (!(r16 < 1.10 * r32) || !(s16 < 1.10 * s32))
        fail_msg("after 256 steps, from the exact trajectory: readout fp16 %.4g vs fp32 %.4g, "
                 "state %.4g vs %.4g",
                 r16, r32, s16, s32);
    print_message("after 256 steps, from the exact trajectory: readout fp16 %.4g vs fp32 %.4g, "
                  "state %.4g vs %.4g\n",
                  r16, r32, s16, s32);
    free(ex);
    head_free(&a);
    head_free(&b);
}

/*
 * A zeroed page (a fresh slot: scales 0) steps to the quantized k u^T; a state of 1e9 whose
 * scales saturate comes out finite and flagged SATURATED, as the fp32 step flags it; in place
 * equals out of place.
 */
static void fp16_step_edges(void **state)
{
    (void)state;
    uint64_t rng = 5;
    struct head h;
    struct inputs in;
    head_init(&h, 128, 128, 6);
    for (int i = 0; i < 128; i++)
        h.w[i] = 1.0f;
    memset(h.blk, 0, h.hl.block_bytes);
    inputs_gen(&in, 128, 128, &rng, 0.5f);
    struct result r = step_both(&h, &in);
    assert_int_equal(r.fl16, 0);
    if (!(r.e16 < 1.03 * r.e32 + 1e-6) || !(r.o_rel < 3e-3))
        fail_msg("zero page: state error %.4g vs %.4g, readout %.3g", r.e16, r.e32, r.o_rel);

    head_fill(&h, &rng, 1.0f, 0.7f, 1e9f);
    inputs_gen(&in, 128, 128, &rng, 1e9f);
    uint32_t fl32 = 0;
    r = step_both(&h, &in);
    assert_int_equal(stepq__quantize_head(&h.hl, h.x, h.w, h.b32, &fl32), STEPQ_OK);
    assert_int_equal(r.fl16 & STEPQ_HEALTH_SATURATED, fl32 & STEPQ_HEALTH_SATURATED);
    assert_true(r.fl16 & STEPQ_HEALTH_SATURATED);

    head_fill(&h, &rng, 2.0f, 2.0f, 0.3f);
    inputs_gen(&in, 128, 128, &rng, 0.5f);
    float o1[128], o2[128];
    (void)stepq__step_head_f16(&h.hl, h.blk, h.w, in.q, in.k, in.v, in.g, in.beta, h.b16, o1,
                               h.scratch, NULL);
    (void)stepq__step_head_f16(&h.hl, h.blk, h.w, in.q, in.k, in.v, in.g, in.beta, h.blk, o2,
                               h.scratch, NULL);
    assert_memory_equal(h.b16, h.blk, h.hl.block_bytes);
    assert_memory_equal(o1, o2, sizeof(o1));
    head_free(&h);
}

/*
 * The decode fit norefit (kernels/quant.h, step 6 without the refit): from the same block and
 * inputs, the same codes and row scales as the exact fit, other column scales (finite, > 0), and
 * a new state whose error is at least the exact fit's within rounding and at most 1.1x it from 4
 * bits on, 2x at 2 and 3 bits (measured on this head: 1.86x, 1.38x, 1.05x, 1.03x, 1.004x,
 * 1.005x at 2, 3, 4, 5, 6, 8 bits); the readout is the step's, before any fit, so it is the same.
 */
static void fp16_norefit_keeps_codes_and_row_scales(void **state)
{
    (void)state;
    static const int widths[] = { 2, 3, 4, 5, 6, 8 };
    uint64_t rng = 11;
    for (int wi = 0; wi < 6; wi++) {
        struct head h;
        struct inputs in;
        head_init(&h, 128, 128, widths[wi]);
        head_fill(&h, &rng, 1.0f, 0.7f, 1.0f);
        inputs_gen(&in, 128, 128, &rng, 0.5f);
        float oe[128], on[128];
        (void)stepq__step_head_f16(&h.hl, h.blk, h.w, in.q, in.k, in.v, in.g, in.beta, h.b16, oe,
                                   h.scratch, NULL);
        h.hl.decode_fit = STEPQ_DECODE_FIT_NOREFIT;
        (void)stepq__step_head_f16(&h.hl, h.blk, h.w, in.q, in.k, in.v, in.g, in.beta, h.b32, on,
                                   h.scratch, NULL);
        h.hl.decode_fit = STEPQ_DECODE_FIT_EXACT;
        assert_memory_equal(oe, on, sizeof(oe));
        const size_t ro = h.hl.row_scale_offset, co = h.hl.col_scale_offset;
        assert_memory_equal(h.b16, h.b32, ro);                    /* codes */
        assert_memory_equal(h.b16 + ro, h.b32 + ro, 2 * 128);     /* row scales */
        assert_memory_not_equal(h.b16 + co, h.b32 + co, 2 * 128); /* column scales */
        for (int j = 0; j < 128; j++) {
            uint16_t c;
            memcpy(&c, h.b32 + co + 2 * (size_t)j, 2);
            const float cf = stepq__fp16_to_float(c);
            if (!(cf > 0.0f && isfinite(cf)))
                fail_msg("%d bits: norefit column scale %d is %g", widths[wi], j, cf);
        }
        /* the exact update of the decoded state, against both new blocks */
        float o32[128];
        assert_int_equal(stepq__dequantize_head(&h.hl, h.blk, h.x), STEPQ_OK);
        (void)stepq__head_update(h.x, 128, 1, 0, 128, 128, in.q, in.k, in.v, in.g, in.beta, o32);
        assert_int_equal(stepq__dequantize_head(&h.hl, h.b16, h.tile), STEPQ_OK);
        const double ee = rel_err(h.tile, h.x, 128 * 128);
        assert_int_equal(stepq__dequantize_head(&h.hl, h.b32, h.tile), STEPQ_OK);
        const double en = rel_err(h.tile, h.x, 128 * 128);
        if (!(en > 0.98 * ee && en < (widths[wi] <= 3 ? 2.0 : 1.1) * ee))
            fail_msg("%d bits: norefit state error %.4g against the exact fit's %.4g", widths[wi],
                     en, ee);
        head_free(&h);
    }
}

/*
 * KDA row widths (per-row widths and pivot rows, kernels/format.h). 0: as a calibration gives
 * them, mostly 4 to 6 bits, a few rows of 2, 3 and 8, two pivot rows (rows 3 and d_k - 5); 1:
 * the six widths in turn, one pivot row (d_k / 2 + 1); 2: every row 6 bits; 3: 2 bits, pivot
 * rows 0 and d_k / 2; 4: 8 bits, pivot row d_k - 1; 5: one integer row of 4 bits (row 2), every
 * other row a pivot.
 */
#define KDA_PATTERNS 6
static void kda_rows(uint8_t *rb, int dk, int pattern)
{
    static const uint8_t cal[16] = { 5, 4, 6, 5, 4, 5, 3, 6, 5, 4, 8, 5, 6, 2, 4, 5 };
    static const uint8_t all[6] = { 2, 3, 4, 5, 6, 8 };
    static const uint8_t one[KDA_PATTERNS] = { 0, 0, 6, 2, 8, STEPQ_BITS_PIVOT };
    for (int i = 0; i < dk; i++)
        rb[i] = pattern == 0 ? cal[i % 16] : pattern == 1 ? all[i % 6] : one[pattern];
    if (pattern == 0) {
        rb[3] = STEPQ_BITS_PIVOT;
        rb[dk - 5] = STEPQ_BITS_PIVOT;
    } else if (pattern == 1) {
        rb[dk / 2 + 1] = STEPQ_BITS_PIVOT;
    } else if (pattern == 3) {
        rb[0] = STEPQ_BITS_PIVOT;
        rb[dk / 2] = STEPQ_BITS_PIVOT;
    } else if (pattern == 4) {
        rb[dk - 1] = STEPQ_BITS_PIVOT;
    } else if (pattern == 5) {
        rb[2] = 4;
    }
}

static void head_init_kda(struct head *h, int dk, int dv, int pattern)
{
    uint8_t rb[STEPQ__MAX_HEAD_DIM];
    kda_rows(rb, dk, pattern);
    head_init_rb(h, STEPQ_ARCH_KDA, dk, dv, rb);
}

/*
 * KDA heads (per-row decays, widths and pivot rows) on 128x128 and two smaller shapes, for every
 * row pattern and spread: the readout within 2e-3 of fp32's and the new state's error within
 * 1.02x of the fp32 fit's, 1.05x at 8 bits, 1.25x for the head of one integer row. Measured
 * (4 steps each, seed 17): readout at most 7.9e-4; state 0.994x..1.002x for patterns 0-3,
 * 1.001x..1.016x at 8 bits (pattern 4), 1.014x..1.106x for pattern 5, whose error (2e-4, the
 * pivot rows' fp16 rounding) moves with the fp16 u_j in the pivot rows' k_i u_j.
 */
static void fp16_kda_step_tracks_fp32(void **state)
{
    (void)state;
    static const int shapes[][2] = { { 128, 128 }, { 64, 64 }, { 40, 24 } };
    static const float spreads[][2] = { { 0.0f, 0.0f }, { 1.0f, 0.7f }, { 2.0f, 2.0f } };
    uint64_t rng = 17;
    for (size_t s = 0; s < 3; s++)
        for (int pat = 0; pat < KDA_PATTERNS; pat++)
            for (size_t sp = 0; sp < 3; sp++) {
                struct head h;
                head_init_kda(&h, shapes[s][0], shapes[s][1], pat);
                assert_true(stepq__step_f16_supports(&h.hl));
                double w16 = 0, w32 = 0, wo = 0;
                for (int rep = 0; rep < 4; rep++) {
                    struct inputs in;
                    head_fill(&h, &rng, spreads[sp][0], spreads[sp][1], 0.3f);
                    inputs_gen_kda(&in, h.dk, h.dv, &rng, 0.5f);
                    struct result r = step_both(&h, &in);
                    w16 += r.e16;
                    w32 += r.e32;
                    wo = fmax(wo, r.o_rel);
                    assert_int_equal(r.fl16, 0);
                }
                const double lim = pat == 5 ? 1.25 : pat == 4 ? 1.05 : 1.02;
                if (!(wo < 2e-3) || !(w16 < lim * w32))
                    fail_msg("kda %dx%d pattern %d spread (%g, %g): readout %.3g, state error "
                             "fp16 %.4g vs fp32 %.4g (%.4fx)",
                             h.dk, h.dv, pat, spreads[sp][0], spreads[sp][1], wo, w16 / 4, w32 / 4,
                             w16 / w32);
                head_free(&h);
            }
}

/*
 * 256 steps on a KDA head (pattern 0: mixed widths, two pivot rows) from one packed start, the
 * exact fp32 recurrence, the fp32 packed step and the fp16 packed step, as for GDN above: the
 * fp16 trajectory's readouts and final state stay as close to the exact one as the fp32 one's
 * (within 1.05x). Measured: 128x128 readout 0.1212 vs 0.1209 (1.003x), state 0.3106 vs 0.3143
 * (0.988x); 40x24 readout 0.1268 vs 0.1262 (1.005x), state 0.1535 vs 0.1546 (0.993x).
 */
static void kda_trajectory(int dk, int dv, uint64_t rng, double *r_ratio, double *s_ratio)
{
    struct head a, b;
    head_init_kda(&a, dk, dv, 0);
    head_init_kda(&b, dk, dv, 0);
    head_fill(&a, &rng, 1.0f, 0.7f, 0.3f);
    memcpy(b.blk, a.blk, a.hl.block_bytes);
    memcpy(b.w, a.w, sizeof(float) * (size_t)dk);
    const size_t n = (size_t)dk * dv;
    float *ex = calloc(n, sizeof(float));
    assert_non_null(ex);
    assert_int_equal(stepq__dequantize_head(&a.hl, a.blk, ex), STEPQ_OK);
    double n16 = 0, n32 = 0, den = 0;
    for (int t = 0; t < 256; t++) {
        struct inputs in;
        float o16[STEPQ__MAX_HEAD_DIM], o32[STEPQ__MAX_HEAD_DIM], oe[STEPQ__MAX_HEAD_DIM];
        inputs_gen_kda(&in, dk, dv, &rng, 0.5f);
        uint32_t f16 = stepq__step_head_f16(&a.hl, a.blk, a.w, in.q, in.k, in.v, in.g, in.beta,
                                            a.blk, o16, a.scratch, NULL);
        assert_int_equal(f16, 0);
        assert_int_equal(stepq__dequantize_head(&b.hl, b.blk, b.x), STEPQ_OK);
        uint32_t fl =
            stepq__head_update(b.x, (size_t)dv, 1, 1, dk, dv, in.q, in.k, in.v, in.g, in.beta, o32);
        assert_int_equal(
            stepq__quantize_head_fit(&b.hl, b.x, b.w, b.blk, b.blk, &fl, b.hl.decode_fit),
            STEPQ_OK);
        (void)stepq__head_update(ex, (size_t)dv, 1, 1, dk, dv, in.q, in.k, in.v, in.g, in.beta, oe);
        for (int j = 0; j < dv; j++) {
            n16 += ((double)o16[j] - oe[j]) * ((double)o16[j] - oe[j]);
            n32 += ((double)o32[j] - oe[j]) * ((double)o32[j] - oe[j]);
            den += (double)oe[j] * oe[j];
        }
    }
    assert_int_equal(stepq__dequantize_head(&a.hl, a.blk, a.tile), STEPQ_OK);
    assert_int_equal(stepq__dequantize_head(&b.hl, b.blk, b.tile), STEPQ_OK);
    const double s16 = rel_err(a.tile, ex, n), s32 = rel_err(b.tile, ex, n);
    const double r16 = sqrt(n16 / den), r32 = sqrt(n32 / den);
    print_message("kda %dx%d after 256 steps, from the exact trajectory: readout fp16 %.4g vs fp32 "
                  "%.4g, state %.4g vs %.4g\n",
                  dk, dv, r16, r32, s16, s32);
    *r_ratio = r16 / r32;
    *s_ratio = s16 / s32;
    free(ex);
    head_free(&a);
    head_free(&b);
}

static void fp16_kda_trajectory_tracks_the_exact_one_as_fp32(void **state)
{
    (void)state;
    static const int shapes[][3] = { { 128, 128, 23 }, { 40, 24, 29 } };
    for (int s = 0; s < 2; s++) {
        double rr, sr;
        kda_trajectory(shapes[s][0], shapes[s][1], (uint64_t)shapes[s][2], &rr, &sr);
        if (!(rr < 1.05) || !(sr < 1.05))
            fail_msg("kda %dx%d after 256 steps: readout %.4fx, state %.4fx the fp32 step's",
                     shapes[s][0], shapes[s][1], rr, sr);
    }
}

/*
 * KDA edges, as fp16_step_edges for GDN: a zeroed page steps to the quantized k u^T (pivot rows:
 * their fp16) within the bounds above (measured: 0.99996x the fp32 fit's error, readout 6e-8);
 * a state of 1e9 comes out finite and flagged SATURATED as the fp32 step flags it; in place
 * equals out of place (128x128 of pattern 0, 40x24 of pattern 1).
 */
static void fp16_kda_step_edges(void **state)
{
    (void)state;
    uint64_t rng = 31;
    struct head h;
    struct inputs in;
    head_init_kda(&h, 128, 128, 0);
    for (int i = 0; i < 128; i++)
        h.w[i] = 1.0f;
    memset(h.blk, 0, h.hl.block_bytes);
    inputs_gen_kda(&in, 128, 128, &rng, 0.5f);
    struct result r = step_both(&h, &in);
    assert_int_equal(r.fl16, 0);
    if (!(r.e16 < 1.02 * r.e32 + 1e-6) || !(r.o_rel < 2e-3))
        fail_msg("kda zero page: state error %.4g vs %.4g, readout %.3g", r.e16, r.e32, r.o_rel);

    head_fill(&h, &rng, 1.0f, 0.7f, 1e9f);
    inputs_gen_kda(&in, 128, 128, &rng, 1e9f);
    r = step_both(&h, &in);
    assert_int_equal(r.fl16 & STEPQ_HEALTH_SATURATED, r.fl32 & STEPQ_HEALTH_SATURATED);
    assert_true(r.fl16 & STEPQ_HEALTH_SATURATED);

    for (int s = 0; s < 2; s++) {
        struct head e;
        head_init_kda(&e, s ? 40 : 128, s ? 24 : 128, s ? 1 : 0);
        head_fill(&e, &rng, 2.0f, 2.0f, 0.3f);
        inputs_gen_kda(&in, e.dk, e.dv, &rng, 0.5f);
        float o1[STEPQ__MAX_HEAD_DIM], o2[STEPQ__MAX_HEAD_DIM];
        (void)stepq__step_head_f16(&e.hl, e.blk, e.w, in.q, in.k, in.v, in.g, in.beta, e.b16, o1,
                                   e.scratch, NULL);
        (void)stepq__step_head_f16(&e.hl, e.blk, e.w, in.q, in.k, in.v, in.g, in.beta, e.blk, o2,
                                   e.scratch, NULL);
        assert_memory_equal(e.b16, e.blk, e.hl.block_bytes);
        assert_memory_equal(o1, o2, sizeof(float) * (size_t)e.dv);
        head_free(&e);
    }
    head_free(&h);
}

static uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static void wr16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, 2);
}

/* The spacing of fp16 values at |x| (subnormals: 2^-24). */
static double ulp16(double x)
{
    int e;
    (void)frexp(fabs(x), &e); /* |x| in [2^(e-1), 2^e) */
    return fmax(ldexp(1.0, e - 1 - 10), ldexp(1.0, -24));
}

/*
 * The pivot rows of a KDA head (kernels/quant.h, KDA step 2): each new value is the fp32 step's
 * x_pj alpha_p + k_p u_j rounded to fp16, with the fp16 step's u_j. With q = k the readout
 * o_j = fma(u_j, k.q, t_j) and t_j = s_j give u_j back (s_j = (o_j - beta v_j k.q) / (1 - beta
 * k.q), to 4e-6 (|u_j| + |o_j|)), so both are checked: the new value is RN_fp16(x_pj alpha_p +
 * k_p u_j) within one fp16 spacing (plus |k_p| times the error of the recovered u_j), and it is
 * the fp32 step's stored pivot value within |k_p| |u_j - u32_j| and one spacing, where u32_j
 * is the fp32 step's u (recomputed here as kernels/recurrence.c computes it). The row scale
 * slot of a pivot row is written 0 (set to 1.0 in the old block here), and alpha_p is the row's
 * own decay: the rows are given the most different gates of the head. Measured: max |u - u32|
 * 3.7e-4 to 5.7e-4 of max |u32| (asserted below 2e-3, so that it explains little).
 */
static void fp16_kda_pivot_rows_are_the_fp32_update(void **state)
{
    (void)state;
    static const int shapes[][2] = { { 128, 128 }, { 40, 24 } };
    uint64_t rng = 37;
    for (int s = 0; s < 2; s++)
        for (int pat = 0; pat < 2; pat++) {
            struct head h;
            struct inputs in;
            const int dk = shapes[s][0], dv = shapes[s][1];
            head_init_kda(&h, dk, dv, pat);
            head_fill(&h, &rng, 1.0f, 0.7f, 0.3f);
            inputs_gen_kda(&in, dk, dv, &rng, 0.5f);
            memcpy(in.q, in.k, sizeof(float) * (size_t)dk);
            int np = 0;
            for (int i = 0; i < dk; i++)
                if (h.hl.row_bits[i] == STEPQ_BITS_PIVOT) {
                    in.g[i] = np++ % 2 ? -0.01f : -1.0f; /* alpha 0.99 and 0.37 */
                    wr16(h.blk + h.hl.row_scale_offset + 2 * (size_t)i, 0x3C00);
                }
            assert_true(np > 0);
            float o16[STEPQ__MAX_HEAD_DIM], o32[STEPQ__MAX_HEAD_DIM];
            uint32_t fl = stepq__step_head_f16(&h.hl, h.blk, h.w, in.q, in.k, in.v, in.g, in.beta,
                                               h.b16, o16, h.scratch, NULL);
            assert_int_equal(fl, 0);
            /* the fp32 step on the same block: its u (the update's, in the same order) and its
             * stored pivot rows */
            assert_int_equal(stepq__dequantize_head(&h.hl, h.blk, h.x), STEPQ_OK);
            double acc[STEPQ__MAX_HEAD_DIM] = { 0 }, kq_d = 0;
            float u32[STEPQ__MAX_HEAD_DIM];
            for (int i = 0; i < dk; i++) {
                const float d = expf(in.g[i]);
                for (int j = 0; j < dv; j++)
                    acc[j] += (double)(h.x[(size_t)i * dv + j] * d) * in.k[i];
                kq_d += (double)in.k[i] * in.q[i];
            }
            for (int j = 0; j < dv; j++)
                u32[j] = (in.v[j] - (float)acc[j]) * in.beta;
            float *x0 = calloc((size_t)dk * dv, sizeof(float));
            assert_non_null(x0);
            memcpy(x0, h.x, sizeof(float) * (size_t)dk * dv);
            fl = stepq__head_update(h.x, (size_t)dv, 1, 1, dk, dv, in.q, in.k, in.v, in.g, in.beta,
                                    o32);
            assert_int_equal(
                stepq__quantize_head_fit(&h.hl, h.x, h.w, h.blk, h.b32, &fl, h.hl.decode_fit),
                STEPQ_OK);
            const double kq = (float)kq_d, bk = (double)in.beta * kq;
            double du_max = 0, u_max = 0;
            for (int i = 0; i < dk; i++) {
                if (h.hl.row_bits[i] != STEPQ_BITS_PIVOT)
                    continue;
                assert_int_equal(rd16(h.b16 + h.hl.row_scale_offset + 2 * (size_t)i), 0);
                const float al = (float)exp((double)in.g[i]), ki = in.k[i];
                const uint8_t *p16 = h.b16 + h.hl.row_bitoff[i] / 8;
                const uint8_t *p32 = h.b32 + h.hl.row_bitoff[i] / 8;
                for (int j = 0; j < dv; j++) {
                    const double sj = ((double)o16[j] - bk * in.v[j]) / (1.0 - bk);
                    const double uj = in.beta * (in.v[j] - sj);
                    const double eu = 4e-6 * (fabs(uj) + fabs((double)o16[j]));
                    const double x = x0[(size_t)i * dv + j];
                    const double n16 = stepq__fp16_to_float(rd16(p16 + 2 * (size_t)j));
                    const double n32 = stepq__fp16_to_float(rd16(p32 + 2 * (size_t)j));
                    const double want = x * al + ki * uj, du = fabs(uj - u32[j]);
                    const double sp = ulp16(fmax(fabs(n16), fabs(want)));
                    if (!(fabs(n16 - want) <= sp + fabs(ki) * eu))
                        fail_msg("kda %dx%d pattern %d pivot row %d col %d: %.8g, x alpha + k u = "
                                 "%.8g (x %.6g, alpha %.6g, k %.6g, u %.8g)",
                                 dk, dv, pat, i, j, n16, want, x, (double)al, (double)ki, uj);
                    if (!(fabs(n16 - n32) <= sp + fabs(ki) * (du + eu)))
                        fail_msg("kda %dx%d pattern %d pivot row %d col %d: %.8g, the fp32 step's "
                                 "%.8g (k %.6g, u %.8g vs %.8g)",
                                 dk, dv, pat, i, j, n16, n32, (double)ki, uj, (double)u32[j]);
                    du_max = fmax(du_max, du);
                    u_max = fmax(u_max, fabs((double)u32[j]));
                }
            }
            /* the u_j difference is the dot products' fp16 rounding, not a free pass */
            assert_true(du_max < 2e-3 * u_max);
            free(x0);
            head_free(&h);
        }
}

/*
 * A pivot value that is not finite in the old block (a corrupted page: no fit stores one)
 * reads as 0 and raises STATE: the step writes the block and readout it writes from the block
 * with 0 there, and only the flag differs. For NaN, +Inf and -Inf, in each pivot row of the
 * head.
 */
static void fp16_kda_nonfinite_pivot_reads_as_zero(void **state)
{
    (void)state;
    static const uint16_t bad[] = { 0x7E00, 0x7C00, 0xFC00 };
    static const int shapes[][3] = { { 128, 128, 0 }, { 40, 24, 3 } };
    uint64_t rng = 41;
    for (int s = 0; s < 2; s++) {
        struct head h;
        struct inputs in;
        const int dk = shapes[s][0], dv = shapes[s][1];
        head_init_kda(&h, dk, dv, shapes[s][2]);
        head_fill(&h, &rng, 1.0f, 0.7f, 0.3f);
        inputs_gen_kda(&in, dk, dv, &rng, 0.5f);
        uint8_t *nb = calloc(1, h.hl.block_bytes);
        float o0[STEPQ__MAX_HEAD_DIM], o1[STEPQ__MAX_HEAD_DIM];
        assert_non_null(nb);
        int tried = 0;
        for (int i = 0; i < dk; i++) {
            if (h.hl.row_bits[i] != STEPQ_BITS_PIVOT)
                continue;
            for (int b = 0; b < 3; b++, tried++) {
                const size_t at = h.hl.row_bitoff[i] / 8 + 2 * (size_t)((i + 5 * b) % dv);
                wr16(h.blk + at, 0);
                memcpy(nb, h.blk, h.hl.block_bytes);
                wr16(nb + at, bad[b]);
                uint32_t f0 = stepq__step_head_f16(&h.hl, h.blk, h.w, in.q, in.k, in.v, in.g,
                                                   in.beta, h.b16, o0, h.scratch, NULL);
                uint32_t f1 = stepq__step_head_f16(&h.hl, nb, h.w, in.q, in.k, in.v, in.g, in.beta,
                                                   h.b32, o1, h.scratch, NULL);
                assert_int_equal(f0, 0);
                assert_int_equal(f1, STEPQ_HEALTH_STATE);
                assert_memory_equal(h.b16, h.b32, h.hl.block_bytes);
                assert_memory_equal(o0, o1, sizeof(float) * (size_t)dv);
                /* in place too: the bad value's block steps to the same bytes */
                (void)stepq__step_head_f16(&h.hl, nb, h.w, in.q, in.k, in.v, in.g, in.beta, nb, o1,
                                           h.scratch, NULL);
                assert_memory_equal(h.b16, nb, h.hl.block_bytes);
            }
        }
        assert_true(tried >= 3);
        free(nb);
        head_free(&h);
    }
}

/*
 * Which heads take the fp16 step: heads with column scales, on GDN integer rows of one width, on
 * KDA any mix of widths and pivot rows with at least one integer row.
 */
static void fp16_step_supports_only_its_heads(void **state)
{
    (void)state;
    struct stepq__head_layout hl;
    uint8_t rb[128];
    memset(rb, 6, sizeof(rb));
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, 128, 128, rb, 0), STEPQ_OK);
    assert_true(stepq__step_f16_supports(&hl));
    stepq__head_layout_free(&hl);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_UNIFORM, STEPQ_ARCH_GDN, 128, 128, rb, 0),
        STEPQ_OK);
    assert_false(stepq__step_f16_supports(&hl)); /* no column scales */
    stepq__head_layout_free(&hl);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 128, 128, rb, 0),
        STEPQ_OK);
    assert_true(stepq__step_f16_supports(&hl)); /* KDA of one width */
    stepq__head_layout_free(&hl);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_DSQ, STEPQ_ARCH_KDA, 128, 128, rb, 0), STEPQ_OK);
    assert_true(stepq__step_f16_supports(&hl)); /* KDA dsq */
    stepq__head_layout_free(&hl);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_UNIFORM, STEPQ_ARCH_KDA, 128, 128, rb, 0),
        STEPQ_OK);
    assert_false(stepq__step_f16_supports(&hl)); /* KDA without column scales */
    stepq__head_layout_free(&hl);
    for (int pat = 0; pat < KDA_PATTERNS; pat++) {
        kda_rows(rb, 128, pat);
        assert_int_equal(
            stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 128, 128, rb, 0),
            STEPQ_OK);
        assert_true(stepq__step_f16_supports(&hl)); /* mixed widths, pivot rows */
        stepq__head_layout_free(&hl);
        assert_int_equal(
            stepq__head_layout_init(&hl, STEPQ_METHOD_TEMPORAL, STEPQ_ARCH_KDA, 128, 128, rb, 0),
            STEPQ_OK);
        assert_false(stepq__step_f16_supports(&hl)); /* the same rows, no column scales */
        stepq__head_layout_free(&hl);
    }
    memset(rb, STEPQ_BITS_PIVOT, sizeof(rb));
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 128, 128, rb, 0),
        STEPQ_OK);
    assert_false(stepq__step_f16_supports(&hl)); /* KDA: every row a pivot */
    stepq__head_layout_free(&hl);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 128, 128, rb, 0),
        STEPQ_OK);
    assert_false(stepq__step_f16_supports(&hl)); /* a GDN pivot head */
    stepq__head_layout_free(&hl);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(fp16_step_tracks_fp32_for_every_width),
        cmocka_unit_test(fp16_trajectory_tracks_the_exact_one_as_fp32),
        cmocka_unit_test(fp16_step_edges),
        cmocka_unit_test(fp16_step_supports_only_its_heads),
        cmocka_unit_test(fp16_norefit_keeps_codes_and_row_scales),
        cmocka_unit_test(fp16_kda_step_tracks_fp32),
        cmocka_unit_test(fp16_kda_trajectory_tracks_the_exact_one_as_fp32),
        cmocka_unit_test(fp16_kda_step_edges),
        cmocka_unit_test(fp16_kda_pivot_rows_are_the_fp32_update),
        cmocka_unit_test(fp16_kda_nonfinite_pivot_reads_as_zero),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
