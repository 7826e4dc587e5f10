/*
 * The fp16 decode step of the C reference (kernels/step_f16.c, the map field arith fp16) against
 * the fp32 step on the same packed heads: its readout and the quantization error of its new
 * state stay within bounds of the fp32 step's for every width and shape, also over many steps,
 * from a zeroed page and for states whose scales saturate; it writes in place as out of place;
 * the reference step routes exactly the heads stepq__step_f16_supports names to it; and the
 * decode fit norefit changes the column scales only.
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

static void head_init(struct head *h, int dk, int dv, int bits)
{
    uint8_t rb[STEPQ__MAX_HEAD_DIM];
    memset(h, 0, sizeof(*h));
    memset(rb, bits, sizeof(rb));
    assert_int_equal(
        stepq__head_layout_init(&h->hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, dk, dv, rb, 0),
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
    float g, beta;
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
    in->g = -0.05f - 0.5f * rng_unit(rng);
    in->beta = 0.2f + 0.7f * rng_unit(rng);
}

struct result {
    double o_rel;  /* fp16 readout vs fp32 readout */
    double e16;    /* |decode(fp16 block) - exact update| / |exact update| */
    double e32;    /* the same for the fp32 step's block */
    uint32_t fl16; /* flags of the fp16 step */
};

/* One step from h->blk by both arithmetics; h->b16 and h->b32 get the new blocks. */
static struct result step_both(struct head *h, const struct inputs *in)
{
    const size_t n = (size_t)h->dk * h->dv;
    float o16[STEPQ__MAX_HEAD_DIM], o32[STEPQ__MAX_HEAD_DIM], g = in->g;
    struct result r;
    r.fl16 = stepq__step_head_f16(&h->hl, h->blk, h->w, in->q, in->k, in->v, in->g, in->beta,
                                  h->b16, o16, h->scratch, NULL);
    /* the fp32 step: the exact update of the decoded state, fitted exactly */
    assert_int_equal(stepq__dequantize_head(&h->hl, h->blk, h->x), STEPQ_OK);
    uint32_t fl = stepq__head_update(h->x, (size_t)h->dv, 1, 0, h->dk, h->dv, in->q, in->k, in->v,
                                     &g, in->beta, o32);
    assert_int_equal(stepq__quantize_head(&h->hl, h->x, h->w, h->b32, &fl), STEPQ_OK);
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
        float o16[128], o32[128], oe[128], g;
        inputs_gen(&in, 128, 128, &rng, 0.5f);
        g = in.g;
        (void)stepq__step_head_f16(&a.hl, a.blk, a.w, in.q, in.k, in.v, in.g, in.beta, a.blk, o16,
                                   a.scratch, NULL);
        assert_int_equal(stepq__dequantize_head(&b.hl, b.blk, b.x), STEPQ_OK);
        uint32_t fl =
            stepq__head_update(b.x, 128, 1, 0, 128, 128, in.q, in.k, in.v, &g, in.beta, o32);
        assert_int_equal(stepq__quantize_head(&b.hl, b.x, b.w, b.blk, &fl), STEPQ_OK);
        (void)stepq__head_update(ex, 128, 1, 0, 128, 128, in.q, in.k, in.v, &g, in.beta, oe);
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
        float g = in.g, o32[128];
        assert_int_equal(stepq__dequantize_head(&h.hl, h.blk, h.x), STEPQ_OK);
        (void)stepq__head_update(h.x, 128, 1, 0, 128, 128, in.q, in.k, in.v, &g, in.beta, o32);
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

/* Which heads take the fp16 step: GDN integer heads of one width with column scales. */
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
    assert_false(stepq__step_f16_supports(&hl)); /* KDA */
    stepq__head_layout_free(&hl);
    memset(rb, STEPQ_BITS_PIVOT, sizeof(rb));
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 128, 128, rb, 0),
        STEPQ_OK);
    assert_false(stepq__step_f16_supports(&hl)); /* a pivot head */
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
