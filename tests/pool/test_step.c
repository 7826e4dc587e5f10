/*
 * The pool's public data path on the host backend (stepq/step.h): decode
 * steps, prefill pack/unpack, the capability query and the conv-state view,
 * through the API a server calls, against the C reference kernels called
 * directly on the same pages; and every bad argument returning its status
 * with a message naming it and no page byte changed.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/dsp.h"
#include "kernels/format.h"
#include "kernels/quant.h"
#include "plugin/err.h"
#include "pool/internal.h"
#include "stepq/stepq.h"
#include "tests/config/fixtures.h"

#include "stepq_config.h"
#if STEPQ_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#endif

#define SLOTS 6
#define BATCH 4

/* A pool on a small map (H 2, HV 4, 8x4 heads, 3 layers) of one method. */
struct fixture {
    stepq_map_t *map;
    stepq_pool_t *pool;
    stepq_arch arch;
    int H, HV, K, V, L;
    int32_t ids[BATCH];
    /* host tensors of one batch */
    float *q, *k, *v, *g, *beta, *o, *A_log, *dt_bias;
    float *dense; /* [BATCH][HV][K][V] */
};

/* The map of method m at `bits` (fp32 / fp8: their one width); stepq mixes widths around it. */
static stepq_map_t *make_map_bits(stepq_arch arch, stepq_method m, int bits)
{
    stepq_model_shape sh = fx_shape_small(arch);
    stepq_map_t *map = NULL;
    double budget = stepq__method_has_units(m) ? bits : stepq__method_fixed_bits(m);

    assert_int_equal(stepq_map_create(&sh, m, budget, &map), STEPQ_OK);
    if (m == STEPQ_METHOD_STEPQ)
        assert_int_equal(fx_layout_exact(map, bits, 1), STEPQ_OK);
    if (m == STEPQ_METHOD_STEPQ) {
        /* Row impact that is not all 1, so the fit's weights matter. */
        float w[8];
        for (int l = 0; l < sh.n_layers; l++)
            for (int h = 0; h < sh.num_v_heads; h++) {
                double p = 0;
                for (int i = 0; i < 8; i++) {
                    w[i] = (float)(0.5 + (i * 7 + h + l) % 5 * 0.3);
                    p += log(w[i]);
                }
                for (int i = 0; i < 8; i++) /* geometric mean 1 */
                    w[i] = (float)(w[i] / exp(p / 8));
                assert_int_equal(stepq_map_set_row_impact(map, l, h, w), STEPQ_OK);
            }
    }
    return map;
}

static float *falloc(size_t n)
{
    float *p = calloc(n ? n : 1, sizeof(float));
    assert_non_null(p);
    return p;
}

static void fill_inputs(struct fixture *f, unsigned long long seed)
{
    unsigned long long s = seed;
    const int gk = f->arch == STEPQ_ARCH_KDA ? f->K : 1;

    for (int i = 0; i < BATCH * f->H * f->K; i++) {
        f->q[i] = (float)(fx_rand(&s) * 2 - 1);
        f->k[i] = (float)(fx_rand(&s) * 2 - 1);
    }
    for (int i = 0; i < BATCH * f->HV * f->V; i++)
        f->v[i] = (float)(fx_rand(&s) * 2 - 1);
    for (int i = 0; i < BATCH * f->HV * gk; i++)
        f->g[i] = (float)(-0.05 - 0.5 * fx_rand(&s));
    for (int i = 0; i < BATCH * f->HV; i++)
        f->beta[i] = (float)(0.2 + 0.6 * fx_rand(&s));
    for (int i = 0; i < f->HV; i++)
        f->A_log[i] = (float)(fx_rand(&s) - 0.5);
    for (int i = 0; i < f->HV * gk; i++)
        f->dt_bias[i] = (float)(fx_rand(&s) - 0.5);
    for (size_t i = 0; i < (size_t)BATCH * f->HV * f->K * f->V; i++)
        f->dense[i] = (float)(fx_rand(&s) * 2 - 1);
}

/*
 * A fixture whose map has the row split `split` (map field row_split) and the decode fit
 * `fit` (decode_fit) before its pool opens.
 */
static void fixture_open_fit_bits(struct fixture *f, stepq_arch arch, stepq_method m, double split,
                                  stepq_decode_fit fit, int bits)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_model_shape sh;

    memset(f, 0, sizeof(*f));
    f->arch = arch;
    f->map = make_map_bits(arch, m, bits);
    assert_int_equal(stepq_map_set_row_split(f->map, split), STEPQ_OK);
    assert_int_equal(stepq_map_set_decode_fit(f->map, fit), STEPQ_OK);
    assert_int_equal(stepq_map_shape(f->map, &sh), STEPQ_OK);
    f->H = sh.num_k_heads;
    f->HV = sh.num_v_heads;
    f->K = sh.head_k_dim;
    f->V = sh.head_v_dim;
    f->L = sh.n_layers;
    cfg.map = f->map;
    cfg.num_slots = SLOTS;
    assert_int_equal(stepq_pool_open(&cfg, &f->pool), STEPQ_OK);
    /* Shuffled, non-consecutive slots. */
    int32_t all[SLOTS];
    assert_int_equal(stepq_pool_alloc(f->pool, SLOTS, all), STEPQ_OK);
    f->ids[0] = all[4];
    f->ids[1] = all[1];
    f->ids[2] = all[5];
    f->ids[3] = all[2];
    int32_t rest[2] = { all[0], all[3] };
    assert_int_equal(stepq_pool_free(f->pool, rest, 2), STEPQ_OK);
    const int gk = arch == STEPQ_ARCH_KDA ? f->K : 1;
    f->q = falloc((size_t)BATCH * f->H * f->K);
    f->k = falloc((size_t)BATCH * f->H * f->K);
    f->v = falloc((size_t)BATCH * f->HV * f->V);
    f->g = falloc((size_t)BATCH * f->HV * gk);
    f->beta = falloc((size_t)BATCH * f->HV);
    f->o = falloc((size_t)BATCH * f->HV * f->V);
    f->A_log = falloc((size_t)f->HV);
    f->dt_bias = falloc((size_t)f->HV * gk);
    f->dense = falloc((size_t)BATCH * f->HV * f->K * f->V);
    fill_inputs(f, 7);
}

static void fixture_open_fit(struct fixture *f, stepq_arch arch, stepq_method m, double split,
                             stepq_decode_fit fit)
{
    fixture_open_fit_bits(f, arch, m, split, fit, 6);
}

/* The fixture of method m at `bits` (make_map_bits), exact fit, split 0.5. */
static void fixture_open_bits(struct fixture *f, stepq_arch arch, stepq_method m, int bits)
{
    fixture_open_fit_bits(f, arch, m, 0.5, STEPQ_DECODE_FIT_EXACT, bits);
}

static void fixture_open_split(struct fixture *f, stepq_arch arch, stepq_method m, double split)
{
    fixture_open_fit(f, arch, m, split, STEPQ_DECODE_FIT_EXACT);
}

static void fixture_open(struct fixture *f, stepq_arch arch, stepq_method m)
{
    fixture_open_split(f, arch, m, 0.5);
}

static void fixture_close(struct fixture *f)
{
    assert_int_equal(stepq_pool_close(f->pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    stepq_map_close(f->map);
    free(f->q), free(f->k), free(f->v), free(f->g), free(f->beta), free(f->o);
    free(f->A_log), free(f->dt_bias), free(f->dense);
}

static stepq_step_args step_args(struct fixture *f, const int32_t *ids, int32_t n)
{
    stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
    a.batch = n;
    a.slot_ids = ids;
    a.q = f->q, a.k = f->k, a.v = f->v, a.g = f->g, a.beta = f->beta, a.o = f->o;
    a.A_log = f->A_log, a.dt_bias = f->dt_bias;
    a.flags = STEPQ_STEP_L2NORM;
    return a;
}

static stepq_prefill_args prefill_args(struct fixture *f, const int32_t *ids, int32_t n,
                                       void *states)
{
    stepq_prefill_args p = STEPQ_PREFILL_ARGS_INITIALIZER;
    p.n = n;
    p.slot_ids = ids;
    p.states = states;
    return p;
}

/* The pool's pages (sentinel included) and their bytes. */
static uint8_t *pages_of(struct fixture *f, size_t *n)
{
    const stepq_pool_layout *l;
    void *base;

    assert_int_equal(stepq_pool_get_layout(f->pool, &l), STEPQ_OK);
    assert_int_equal(stepq_pool_page(f->pool, 0, &base), STEPQ_OK);
    *n = (size_t)(SLOTS + 1) * l->page_bytes;
    return base;
}

/* Every page byte of the pool, for "nothing changed" and to start again from. */
static uint8_t *snapshot(struct fixture *f)
{
    size_t n;
    const uint8_t *base = pages_of(f, &n);
    uint8_t *s = malloc(n);

    assert_non_null(s);
    memcpy(s, base, n);
    return s;
}

/* The pool's pages back to a snapshot. */
static void restore(struct fixture *f, const uint8_t *snap)
{
    size_t n;
    uint8_t *base = pages_of(f, &n);

    memcpy(base, snap, n);
}

static void assert_unchanged(struct fixture *f, const uint8_t *before)
{
    size_t n;
    const uint8_t *base = pages_of(f, &n);

    assert_memory_equal(base, before, n);
}

/* The reference kernels' arguments of a step through the API. */
static void kernel_args(const struct fixture *f, const stepq_step_args *p,
                        struct stepq__step_args *out)
{
    struct stepq__step_args a;

    memset(&a, 0, sizeof(a));
    a.arch = f->arch;
    a.batch = p->batch;
    a.H = f->H, a.HV = f->HV, a.d_k = f->K, a.d_v = f->V;
    a.slots = p->slot_ids;
    a.q = p->q, a.k = p->k, a.v = p->v, a.g = p->g, a.beta = p->beta, a.o = p->o;
    a.A_log = p->A_log, a.dt_bias = p->dt_bias;
    a.opt.l2norm = !!(p->flags & STEPQ_STEP_L2NORM);
    a.opt.gate_in_kernel = !!(p->flags & STEPQ_STEP_GATE_IN_KERNEL);
    a.opt.beta_sigmoid = !!(p->flags & STEPQ_STEP_BETA_SIGMOID);
    a.opt.scale = p->scale;
    *out = a;
}

/* The reference kernels on the pool's own layer description. */
static void ref_step(struct fixture *f, int layer, const stepq_step_args *p)
{
    struct stepq__packed_layer pl;
    struct stepq__step_args a;

    kernel_args(f, p, &a);
    stepq__pool_packed_layer(stepq__pool_resolve(f->pool), layer, &pl);
    assert_int_equal(stepq__ref_step_packed(&a, &pl), STEPQ_OK);
}

/* --- behaviour ------------------------------------------------------------ */

/*
 * A decode step through the API is the reference kernel on the same pages:
 * run both from one packed start on two copies of the pool and compare
 * pages and outputs bytewise, for GDN and KDA, stepq (mixed bits + pivots +
 * row impact) and fp32, with and without in-kernel gating.
 */
static void step_matches_reference(stepq_arch arch, stepq_method m, unsigned flags)
{
    struct fixture f;
    fixture_open(&f, arch, m);
    stepq_prefill_args p = prefill_args(&f, f.ids, BATCH, f.dense);
    for (int layer = 0; layer < f.L; layer++)
        assert_int_equal(stepq_pool_prefill_pack(f.pool, layer, &p, NULL), STEPQ_OK);
    uint8_t *start = snapshot(&f);
    const size_t obytes = sizeof(float) * BATCH * f.HV * f.V;
    float *o_api = malloc(obytes);
    assert_non_null(o_api);

    for (int layer = 0; layer < f.L; layer++) {
        stepq_step_args a = step_args(&f, f.ids, BATCH);
        a.flags |= flags;
        fill_inputs(&f, 100 + layer);
        assert_int_equal(stepq_pool_decode_step(f.pool, layer, &a, NULL), STEPQ_OK);
        memcpy(o_api, f.o, obytes);
        uint8_t *after_api = snapshot(&f);
        /* Back to the start, then the reference by hand. */
        restore(&f, start);
        memset(f.o, 0, obytes);
        ref_step(&f, layer, &a);
        assert_memory_equal(f.o, o_api, obytes);
        assert_unchanged(&f, after_api);
        free(start);
        start = after_api;
    }
    free(start);
    free(o_api);
    fixture_close(&f);
}

static void test_step_gdn_stepq(void **state)
{
    step_matches_reference(STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 0);
}
static void test_step_kda_stepq_in_kernel_gate(void **state)
{
    step_matches_reference(STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ,
                           STEPQ_STEP_GATE_IN_KERNEL | STEPQ_STEP_BETA_SIGMOID);
}
static void test_step_gdn_fp32_in_kernel_gate(void **state)
{
    step_matches_reference(STEPQ_ARCH_GDN, STEPQ_METHOD_FP32,
                           STEPQ_STEP_GATE_IN_KERNEL | STEPQ_STEP_BETA_SIGMOID);
}

static void test_step_gdn_fp8(void **state)
{
    step_matches_reference(STEPQ_ARCH_GDN, STEPQ_METHOD_FP8, 0);
}
static void test_step_kda_fp8_in_kernel_gate(void **state)
{
    step_matches_reference(STEPQ_ARCH_KDA, STEPQ_METHOD_FP8,
                           STEPQ_STEP_GATE_IN_KERNEL | STEPQ_STEP_BETA_SIGMOID);
}

/*
 * The README example's check on an fp8 pool: states packed at prefill, TOKENS decode steps
 * on every layer re-quantizing after each token, against the same steps on an fp32 pool
 * (exact states); relative Frobenius error of the unpacked states and of the readouts.
 * The bound is the steady state of an error re-rounded every token and decayed by the
 * retention r in between: e = d / sqrt(1 - r^2), d the RMS of one rounding (an error
 * uniform within e4m3's half ulp, 2^-4 relative, has RMS 2^-4 / sqrt(3)) and r the
 * slowest retention of fill_inputs' gates, exp(-0.05). (The README example's states,
 * all at retention exp(-0.05), measure 0.082 against this 0.117; these 0.034.)
 */
#define FP8_TOKENS       32
#define FP8_ROUNDING_RMS (0x1p-4 / 1.7320508075688772) /* 2^-4 / sqrt(3), relative */
#define FP8_SLOWEST_GATE (-0.05)                       /* fill_inputs: g in [-0.55, -0.05] */
#define FP8_TRACK_BOUND  (FP8_ROUNDING_RMS / sqrt(1 - exp(2 * FP8_SLOWEST_GATE)))

static void test_fp8_tracks_an_fp32_pool(void **state)
{
    for (int arch = 0; arch < 2; arch++) {
        struct fixture f, r;
        fixture_open(&f, (stepq_arch)arch, STEPQ_METHOD_FP8);
        fixture_open(&r, (stepq_arch)arch, STEPQ_METHOD_FP32);
        const size_t n_state = (size_t)BATCH * f.HV * f.K * f.V;
        const size_t n_out = (size_t)BATCH * f.HV * f.V;
        float *o8 = falloc(n_out), *s8 = falloc(n_state);
        stepq_prefill_args p8 = prefill_args(&f, f.ids, BATCH, f.dense);
        stepq_prefill_args p32 = prefill_args(&r, r.ids, BATCH, f.dense);
        for (int layer = 0; layer < f.L; layer++) {
            assert_int_equal(stepq_pool_prefill_pack(f.pool, layer, &p8, NULL), STEPQ_OK);
            assert_int_equal(stepq_pool_prefill_pack(r.pool, layer, &p32, NULL), STEPQ_OK);
        }
        double o_err = 0, o_norm = 0;
        for (int t = 0; t < FP8_TOKENS; t++)
            for (int layer = 0; layer < f.L; layer++) {
                fill_inputs(&f, 1000 + 7 * t + layer);
                stepq_step_args a = step_args(&f, f.ids, BATCH);
                assert_int_equal(stepq_pool_decode_step(f.pool, layer, &a, NULL), STEPQ_OK);
                memcpy(o8, f.o, sizeof(float) * n_out);
                /* the fp32 pool reads f's inputs and writes its output to r.o */
                a.slot_ids = r.ids;
                a.o = r.o;
                assert_int_equal(stepq_pool_decode_step(r.pool, layer, &a, NULL), STEPQ_OK);
                for (size_t i = 0; i < n_out; i++) {
                    o_err += (double)(o8[i] - r.o[i]) * (o8[i] - r.o[i]);
                    o_norm += (double)r.o[i] * r.o[i];
                }
            }
        for (int layer = 0; layer < f.L; layer++) {
            stepq_prefill_args u8 = prefill_args(&f, f.ids, BATCH, s8);
            stepq_prefill_args u32 = prefill_args(&r, r.ids, BATCH, r.dense);
            assert_int_equal(stepq_pool_prefill_unpack(f.pool, layer, &u8, NULL), STEPQ_OK);
            assert_int_equal(stepq_pool_prefill_unpack(r.pool, layer, &u32, NULL), STEPQ_OK);
            double err = 0, norm = 0;
            for (size_t i = 0; i < n_state; i++) {
                err += (double)(s8[i] - r.dense[i]) * (s8[i] - r.dense[i]);
                norm += (double)r.dense[i] * r.dense[i];
            }
            print_message("fp8 %s layer %d: state error %.5f\n", arch ? "kda" : "gdn", layer,
                          sqrt(err / norm));
            assert_true(err > 0 && sqrt(err / norm) <= FP8_TRACK_BOUND);
        }
        print_message("fp8 %s: readout error %.5f over %d tokens x %d layers (bound %.4f)\n",
                      arch ? "kda" : "gdn", sqrt(o_err / o_norm), FP8_TOKENS, f.L, FP8_TRACK_BOUND);
        assert_true(o_err > 0 && sqrt(o_err / o_norm) <= FP8_TRACK_BOUND);
        uint32_t h[BATCH];
        assert_int_equal(stepq_pool_health_read(f.pool, f.ids, BATCH, h), STEPQ_OK);
        for (int b = 0; b < BATCH; b++)
            assert_int_equal(h[b], 0);
        free(o8);
        free(s8);
        fixture_close(&r);
        fixture_close(&f);
    }
}

/*
 * Non-finite state values given to an fp8 pack are stored as 0 and flag the slot
 * (STEPQ_HEALTH_STATE), as for every method; the page decodes finite and the other
 * elements are what a clean pack stores.
 */
static void test_fp8_pack_of_non_finite_states_is_finite_and_flagged(void **state)
{
    struct fixture f;
    fixture_open(&f, STEPQ_ARCH_GDN, STEPQ_METHOD_FP8);
    const size_t n_state = (size_t)BATCH * f.HV * f.K * f.V;
    float *clean = falloc(n_state), *back = falloc(n_state);
    memcpy(clean, f.dense, sizeof(float) * n_state);
    f.dense[3] = NAN;
    f.dense[f.K * f.V + 5] = INFINITY;
    clean[3] = clean[f.K * f.V + 5] = 0.0f;
    stepq_prefill_args p = prefill_args(&f, f.ids, 1, clean);
    assert_int_equal(stepq_pool_prefill_pack(f.pool, 0, &p, NULL), STEPQ_OK);
    uint8_t *want = snapshot(&f);
    p.states = f.dense;
    assert_int_equal(stepq_pool_prefill_pack(f.pool, 0, &p, NULL), STEPQ_OK);
    assert_unchanged(&f, want);
    uint32_t h = 0;
    assert_int_equal(stepq_pool_health_read(f.pool, f.ids, 1, &h), STEPQ_OK);
    assert_int_equal(h, STEPQ_HEALTH_STATE);
    p.states = back;
    assert_int_equal(stepq_pool_prefill_unpack(f.pool, 0, &p, NULL), STEPQ_OK);
    for (size_t i = 0; i < (size_t)f.HV * f.K * f.V; i++)
        assert_true(isfinite(back[i]));
    assert_true(back[3] == 0.0f);
    free(want);
    free(clean);
    free(back);
    fixture_close(&f);
}

/*
 * fp32 maps store states exactly: pack then unpack gives back every bit, in
 * both layouts; bf16 tensors come back as packed (exact bf16 values).
 */
static void test_prefill_roundtrip_fp32_layouts_dtypes(void **state)
{
    struct fixture f;
    fixture_open(&f, STEPQ_ARCH_GDN, STEPQ_METHOD_FP32);
    const size_t per = (size_t)f.HV * f.K * f.V, n = BATCH * per;
    float *back = falloc(n + 8);
    uint16_t *b16 = malloc(sizeof(uint16_t) * n), *b16_back = malloc(sizeof(uint16_t) * n);
    assert_non_null(b16);
    assert_non_null(b16_back);

    for (int lay = 0; lay < 2; lay++) {
        stepq_prefill_args p = prefill_args(&f, f.ids, BATCH, f.dense);
        p.layout = (stepq_state_layout)lay;
        assert_int_equal(stepq_pool_prefill_pack(f.pool, 1, &p, NULL), STEPQ_OK);
        p.states = back;
        assert_int_equal(stepq_pool_prefill_unpack(f.pool, 1, &p, NULL), STEPQ_OK);
        assert_memory_equal(back, f.dense, n * sizeof(float));

        for (size_t i = 0; i < n; i++)
            b16[i] = stepq__bf16_from_float(f.dense[i]);
        p.dtype = STEPQ_DTYPE_BF16;
        p.states = b16;
        assert_int_equal(stepq_pool_prefill_pack(f.pool, 1, &p, NULL), STEPQ_OK);
        p.states = b16_back;
        assert_int_equal(stepq_pool_prefill_unpack(f.pool, 1, &p, NULL), STEPQ_OK);
        assert_memory_equal(b16_back, b16, n * sizeof(uint16_t));
    }
    free(back), free(b16), free(b16_back);
    fixture_close(&f);
}

/*
 * A strided unpack writes its entries and leaves the gaps between them;
 * a -1 entry is skipped (its place keeps its bytes).
 */
static void test_prefill_unpack_strided_skips_padding(void **state)
{
    struct fixture f;
    fixture_open(&f, STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ);
    const size_t per = (size_t)f.HV * f.K * f.V, stride = per + 5;
    float *dst = falloc(BATCH * stride), *ref = falloc(BATCH * per);
    stepq_prefill_args p = prefill_args(&f, f.ids, BATCH, f.dense);
    assert_int_equal(stepq_pool_prefill_pack(f.pool, 0, &p, NULL), STEPQ_OK);
    p.states = ref;
    assert_int_equal(stepq_pool_prefill_unpack(f.pool, 0, &p, NULL), STEPQ_OK);

    int32_t ids[BATCH] = { f.ids[0], -1, f.ids[2], f.ids[0] }; /* repeats are fine: read only */
    for (size_t i = 0; i < BATCH * stride; i++)
        dst[i] = -7.0f;
    p = prefill_args(&f, ids, BATCH, dst);
    p.state_stride = (int64_t)stride;
    assert_int_equal(stepq_pool_prefill_unpack(f.pool, 0, &p, NULL), STEPQ_OK);
    assert_memory_equal(dst, ref, per * sizeof(float));
    for (size_t i = per; i < stride; i++) /* the gap after entry 0 */
        assert_true(dst[i] == -7.0f);
    for (size_t i = 0; i < stride; i++)
        assert_true(dst[stride + i] == -7.0f); /* the -1 entry */
    assert_memory_equal(dst + 2 * stride, ref + 2 * per, per * sizeof(float));
    assert_memory_equal(dst + 3 * stride, ref, per * sizeof(float));
    free(dst), free(ref);
    fixture_close(&f);
}

/*
 * Padding as a CUDA-graph batch has it: -1 entries and several sentinel
 * entries. The real entries come out exactly as in the unpadded batch,
 * -1 output rows are not written, and no other slot's page changes.
 */
static void test_step_padding_pad_and_repeated_sentinel(void **state)
{
    struct fixture f;
    fixture_open(&f, STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ);
    stepq_prefill_args p = prefill_args(&f, f.ids, BATCH, f.dense);
    assert_int_equal(stepq_pool_prefill_pack(f.pool, 2, &p, NULL), STEPQ_OK);
    uint8_t *start = snapshot(&f);
    const size_t orow = (size_t)f.HV * f.V;

    /* Unpadded: entries 0 and 2. */
    int32_t two[2] = { f.ids[0], f.ids[2] };
    float *q2 = falloc(2 * f.H * f.K), *k2 = falloc(2 * f.H * f.K), *v2 = falloc(2 * orow);
    float *g2 = falloc(2 * f.HV), *b2 = falloc(2 * f.HV), *o2 = falloc(2 * orow);
    for (int e = 0; e < 2; e++) {
        int src = e * 2;
        memcpy(q2 + e * f.H * f.K, f.q + src * f.H * f.K, sizeof(float) * f.H * f.K);
        memcpy(k2 + e * f.H * f.K, f.k + src * f.H * f.K, sizeof(float) * f.H * f.K);
        memcpy(v2 + e * orow, f.v + src * orow, sizeof(float) * orow);
        memcpy(g2 + e * f.HV, f.g + src * f.HV, sizeof(float) * f.HV);
        memcpy(b2 + e * f.HV, f.beta + src * f.HV, sizeof(float) * f.HV);
    }
    stepq_step_args a = step_args(&f, two, 2);
    a.q = q2, a.k = k2, a.v = v2, a.g = g2, a.beta = b2, a.o = o2;
    assert_int_equal(stepq_pool_decode_step(f.pool, 2, &a, NULL), STEPQ_OK);
    uint8_t *want = snapshot(&f);

    const stepq_pool_layout *l;
    assert_int_equal(stepq_pool_get_layout(f.pool, &l), STEPQ_OK);
    int32_t padded[BATCH] = { f.ids[0], 0, f.ids[2], -1 };
    int32_t padded2[BATCH] = { f.ids[0], 0, f.ids[2], 0 };
    for (int variant = 0; variant < 2; variant++) {
        restore(&f, start);
        for (size_t i = 0; i < BATCH * orow; i++)
            f.o[i] = 42.0f;
        a = step_args(&f, variant ? padded2 : padded, BATCH);
        assert_int_equal(stepq_pool_decode_step(f.pool, 2, &a, NULL), STEPQ_OK);
        assert_memory_equal(f.o, o2, orow * sizeof(float));
        assert_memory_equal(f.o + 2 * orow, o2 + orow, orow * sizeof(float));
        if (!variant)
            for (size_t i = 0; i < orow; i++)
                assert_true(f.o[3 * orow + i] == 42.0f);
        /* Every page but the sentinel's equals the unpadded run. */
        uint8_t *got = snapshot(&f);
        assert_memory_equal(got + l->page_bytes, want + l->page_bytes,
                            (size_t)SLOTS * l->page_bytes);
        free(got);
    }
    free(start), free(want);
    free(q2), free(k2), free(v2), free(g2), free(b2), free(o2);
    fixture_close(&f);
}

/*
 * bf16 inputs in strided views (the server's split projections): the same
 * pages and outputs as fp32 contiguous inputs holding the same bf16 values,
 * the output rounded to bf16.
 */
static void test_step_bf16_strided_equals_fp32(void **state)
{
    struct fixture f;
    fixture_open(&f, STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ);
    const int qk = f.H * f.K, vv = f.HV * f.V, gg = f.HV * f.K, S = 3; /* gap */
    stepq_prefill_args p = prefill_args(&f, f.ids, BATCH, f.dense);
    assert_int_equal(stepq_pool_prefill_pack(f.pool, 0, &p, NULL), STEPQ_OK);
    uint8_t *start = snapshot(&f);
    uint16_t *q = calloc((size_t)BATCH * (qk + S), 2), *k = calloc((size_t)BATCH * (qk + S), 2);
    uint16_t *v = calloc((size_t)BATCH * (vv + S), 2), *g = calloc((size_t)BATCH * (gg + S), 2);
    uint16_t *b = calloc((size_t)BATCH * (f.HV + S), 2), *o = calloc((size_t)BATCH * (vv + S), 2);
    assert_true(q && k && v && g && b && o);
#define ROUND(src, dst, n, stride)                                                    \
    for (int e = 0; e < BATCH; e++)                                                   \
        for (int i = 0; i < (n); i++) {                                               \
            dst[(size_t)e * (stride) + i] = stepq__bf16_from_float(src[e * (n) + i]); \
            src[e * (n) + i] = stepq__bf16_to_float(dst[(size_t)e * (stride) + i]);   \
        }
    ROUND(f.q, q, qk, qk + S)
    ROUND(f.k, k, qk, qk + S)
    ROUND(f.v, v, vv, vv + S)
    ROUND(f.g, g, gg, gg + S)
    ROUND(f.beta, b, f.HV, f.HV + S)
#undef ROUND
    stepq_step_args a = step_args(&f, f.ids, BATCH);
    assert_int_equal(stepq_pool_decode_step(f.pool, 0, &a, NULL), STEPQ_OK);
    uint8_t *want = snapshot(&f);

    restore(&f, start);
    stepq_step_args c = step_args(&f, f.ids, BATCH);
    c.dtype = STEPQ_DTYPE_BF16;
    c.q = q, c.k = k, c.v = v, c.g = g, c.beta = b, c.o = o;
    c.q_stride = c.k_stride = qk + S;
    c.v_stride = c.o_stride = vv + S;
    c.g_stride = gg + S;
    c.beta_stride = f.HV + S;
    assert_int_equal(stepq_pool_decode_step(f.pool, 0, &c, NULL), STEPQ_OK);
    assert_unchanged(&f, want);
    for (int e = 0; e < BATCH; e++)
        for (int i = 0; i < vv; i++)
            assert_int_equal(o[(size_t)e * (vv + S) + i], stepq__bf16_from_float(f.o[e * vv + i]));
    free(start), free(want);
    free(q), free(k), free(v), free(g), free(b), free(o);
    fixture_close(&f);
}

static void test_supports_host_and_conv_view(void **state)
{
    struct fixture f;
    fixture_open(&f, STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ);
    stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
    stepq_prefill_args p = STEPQ_PREFILL_ARGS_INITIALIZER;

    assert_int_equal(stepq_pool_supports(f.pool, STEPQ_OP_DECODE_STEP, -1, &a), STEPQ_OK);
    a.dtype = STEPQ_DTYPE_BF16;
    a.flags = STEPQ_STEP_GATE_IN_KERNEL;
    a.param_dtype = STEPQ_DTYPE_BF16;
    assert_int_equal(stepq_pool_supports(f.pool, STEPQ_OP_DECODE_STEP, 2, &a), STEPQ_OK);
    a.dtype = STEPQ_DTYPE_FP16;
    assert_int_equal(stepq_pool_supports(f.pool, STEPQ_OP_DECODE_STEP, 2, &a), STEPQ_ENOTSUP);
    assert_non_null(strstr(stepq_pool_last_error(f.pool), "dtype fp16"));
    a.dtype = STEPQ_DTYPE_FP32;
    a.head_k_dim = 128;
    assert_int_equal(stepq_pool_supports(f.pool, STEPQ_OP_DECODE_STEP, 0, &a), STEPQ_ESHAPE);
    assert_non_null(strstr(stepq_pool_last_error(f.pool), "head_k_dim = 128"));
    p.layout = STEPQ_STATE_LAYOUT_VK;
    assert_int_equal(stepq_pool_supports(f.pool, STEPQ_OP_PREFILL_PACK, 0, &p), STEPQ_OK);
    assert_int_equal(stepq_pool_supports(f.pool, STEPQ_OP_PREFILL_UNPACK, 3, &p), STEPQ_ERANGE);
    assert_int_equal(stepq_pool_supports(f.pool, (stepq_op)9, 0, &p), STEPQ_EINVAL);

    /* The conv view addresses the page's conv bytes: 64 channels x 3 per layer. */
    stepq_conv_view cv;
    const stepq_pool_layout *l;
    assert_int_equal(stepq_pool_get_layout(f.pool, &l), STEPQ_OK);
    assert_int_equal(stepq_pool_conv_state(f.pool, 1, &cv, sizeof(cv)), STEPQ_OK);
    assert_int_equal(cv.rank, 2);
    assert_int_equal(cv.shape[0], 64);
    assert_int_equal(cv.shape[1], 3);
    stepq_model_shape sh;
    assert_int_equal(stepq_map_shape(f.map, &sh), STEPQ_OK);
    assert_int_equal(cv.dtype, sh.conv_dtype);
    assert_int_equal(cv.bytes, 64 * 3 * stepq_dtype_size(sh.conv_dtype));
    assert_int_equal(cv.slot_stride, l->page_bytes);
    void *page;
    assert_int_equal(stepq_pool_page(f.pool, f.ids[1], &page), STEPQ_OK);
    assert_ptr_equal((uint8_t *)cv.base + (size_t)f.ids[1] * cv.slot_stride,
                     (uint8_t *)page + l->conv_offset[1]);
    assert_int_equal(stepq_pool_conv_state(f.pool, 3, &cv, sizeof(cv)), STEPQ_ERANGE);
    assert_int_equal(stepq_pool_conv_state(f.pool, 0, &cv, sizeof(cv) + 1), STEPQ_EINVAL);
    fixture_close(&f);
}

/* At tp > 1 the conv view is the rank's share of the channels (the largest dimension, the
 * rule tp/ shards maps by): KDA's [3, channels, taps] splits its middle dimension, and its
 * shape and bytes agree; a channel count the ranks cannot share is refused at open. */
static void a_rank_conv_view_has_its_channels(void **state)
{
    (void)state;
    stepq_model_shape sh = fx_shape_small(STEPQ_ARCH_KDA);
    stepq_map_t *map = NULL;
    stepq_pool_t *pool = NULL;
    stepq_conv_view cv;

    sh.conv_rank = 3;
    sh.conv_shape[0] = 3;
    sh.conv_shape[1] = 64;
    sh.conv_shape[2] = 3;
    assert_int_equal(stepq_map_create(&sh, STEPQ_METHOD_FP32, 32, &map), STEPQ_OK);
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    cfg.map = map;
    cfg.num_slots = 2;
    cfg.tp_size = 2;
    cfg.tp_rank = 1;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_OK);
    assert_int_equal(stepq_pool_conv_state(pool, 0, &cv, sizeof(cv)), STEPQ_OK);
    assert_int_equal(cv.rank, 3);
    assert_int_equal(cv.shape[0], 3);
    assert_int_equal(cv.shape[1], 32);
    assert_int_equal(cv.shape[2], 3);
    assert_int_equal(cv.bytes, 3 * 32 * 3 * stepq_dtype_size(sh.conv_dtype));
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);
    stepq_map_close(map);

    sh.conv_shape[1] = 63; /* 3 x 63 x 3 values: bytes split in two, channels do not */
    assert_int_equal(stepq_map_create(&sh, STEPQ_METHOD_FP32, 32, &map), STEPQ_OK);
    cfg.map = map;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_ESHAPE);
    assert_null(pool);
    assert_non_null(
        strstr(stepq_last_error(), "conv_state.shape[1] = 63) do not split over tp_size 2"));
    stepq_map_close(map);
}

/*
 * The map's row split is the host pool's fit, end to end: a pack and a decode step through
 * a pool whose map says row_split 0.75 write the pages that the same map at 0.5 writes
 * under the analysis override 0.75 (kernels/quant.h), and other pages than it writes
 * without; dsq and stepq, GDN and KDA. The host backend serves the split.
 */
static void test_map_row_split_is_the_host_pools_fit(void **state)
{
    static const stepq_method methods[] = { STEPQ_METHOD_DSQ, STEPQ_METHOD_STEPQ };

    for (int arch = 0; arch < 2; arch++) {
        for (size_t k = 0; k < 2; k++) {
            struct fixture a, b;
            size_t n;
            fixture_open_split(&a, (stepq_arch)arch, methods[k], 0.75);
            fixture_open(&b, (stepq_arch)arch, methods[k]);
            assert_true(stepq__pool_resolve(a.pool)->layout.heads[0].row_split == 0.75);
            assert_true(stepq__pool_resolve(b.pool)->layout.heads[0].row_split == 0.5);
            stepq_prefill_args pa = prefill_args(&a, a.ids, BATCH, a.dense);
            stepq_prefill_args pb = prefill_args(&b, b.ids, BATCH, b.dense);
            assert_int_equal(stepq_pool_supports(a.pool, STEPQ_OP_PREFILL_PACK, -1, &pa), STEPQ_OK);
            for (int layer = 0; layer < a.L; layer++)
                assert_int_equal(stepq_pool_prefill_pack(a.pool, layer, &pa, NULL), STEPQ_OK);
            for (int layer = 0; layer < b.L; layer++) /* 0.5: other pages */
                assert_int_equal(stepq_pool_prefill_pack(b.pool, layer, &pb, NULL), STEPQ_OK);
            const uint8_t *pg_a = pages_of(&a, &n), *pg_b = pages_of(&b, &n);
            assert_true(memcmp(pg_a, pg_b, n) != 0);
            assert_int_equal(stepq__quant_set_row_split(0.75), STEPQ_OK);
            for (int layer = 0; layer < b.L; layer++)
                assert_int_equal(stepq_pool_prefill_pack(b.pool, layer, &pb, NULL), STEPQ_OK);
            assert_memory_equal(pg_a, pg_b, n);
            for (int layer = 0; layer < a.L; layer++) {
                stepq_step_args sa = step_args(&a, a.ids, BATCH), sb = step_args(&b, b.ids, BATCH);
                fill_inputs(&a, 200 + layer);
                fill_inputs(&b, 200 + layer);
                stepq__quant_clear_row_split();
                assert_int_equal(stepq_pool_decode_step(a.pool, layer, &sa, NULL), STEPQ_OK);
                assert_int_equal(stepq__quant_set_row_split(0.75), STEPQ_OK);
                assert_int_equal(stepq_pool_decode_step(b.pool, layer, &sb, NULL), STEPQ_OK);
                assert_memory_equal(a.o, b.o, sizeof(float) * BATCH * a.HV * a.V);
            }
            stepq__quant_clear_row_split();
            assert_memory_equal(pg_a, pg_b, n);
            fixture_close(&a);
            fixture_close(&b);
        }
    }
}

/*
 * The C reference's state of head h of request e after the step of ka on f: the start block
 * dequantized, then the update; what a decode fit then stores (heads of at most 8x8).
 */
static void ref_updated_tile(const struct fixture *f, const struct stepq__step_args *ka,
                             const struct stepq__head_layout *hl, const uint8_t *start_blk, int e,
                             int h, float *tile)
{
    float q[8], kk[8], v[8], g[8], beta, o[8];
    assert_int_equal(stepq__prep_step_head(ka, e, h, f->ids[e], q, kk, v, g, &beta), 0);
    assert_int_equal(stepq__dequantize_head(hl, start_blk, tile), STEPQ_OK);
    stepq__head_update(tile, (size_t)f->V, 1, f->arch == STEPQ_ARCH_KDA, f->K, f->V, q, kk, v, g,
                       beta, o);
}

/*
 * The map's decode fit is the host pool's decode step's, and only the step's: pools on a
 * norefit map and on the exact map (dsq, spatial, stepq; GDN and KDA) pack the same pages
 * and read out the same o, but step to other pages; every stepped block of the norefit
 * pool is the C reference's norefit fit of the updated state (dequantize the start block,
 * the update, stepq__quantize_head_fit), the exact pool's its exact fit, and the two
 * differ in their column scales only.
 */
static void test_map_decode_fit_is_the_host_pools_step(void **state)
{
    static const stepq_method methods[] = { STEPQ_METHOD_DSQ, STEPQ_METHOD_SPATIAL,
                                            STEPQ_METHOD_STEPQ };

    (void)state;
    for (int arch = 0; arch < 2; arch++) {
        for (size_t k = 0; k < sizeof(methods) / sizeof(methods[0]); k++) {
            struct fixture a, b;
            size_t n;
            fixture_open_fit(&a, (stepq_arch)arch, methods[k], 0.5, STEPQ_DECODE_FIT_NOREFIT);
            fixture_open(&b, (stepq_arch)arch, methods[k]);
            stepq_pool_t *pa_ = stepq__pool_resolve(a.pool);
            assert_int_equal(pa_->layout.heads[0].decode_fit, STEPQ_DECODE_FIT_NOREFIT);
            assert_int_equal(stepq__pool_resolve(b.pool)->layout.heads[0].decode_fit,
                             STEPQ_DECODE_FIT_EXACT);
            stepq_prefill_args pa = prefill_args(&a, a.ids, BATCH, a.dense);
            stepq_prefill_args pb = prefill_args(&b, b.ids, BATCH, b.dense);
            for (int layer = 0; layer < a.L; layer++) {
                assert_int_equal(stepq_pool_prefill_pack(a.pool, layer, &pa, NULL), STEPQ_OK);
                assert_int_equal(stepq_pool_prefill_pack(b.pool, layer, &pb, NULL), STEPQ_OK);
            }
            const uint8_t *pg_a = pages_of(&a, &n), *pg_b = pages_of(&b, &n);
            assert_memory_equal(pg_a, pg_b, n); /* the pack is exact */
            uint8_t *start = snapshot(&a);
            const size_t head = (size_t)a.K * a.V;
            float *tile = falloc(head);
            uint8_t *blk = malloc(n);
            assert_non_null(blk);
            for (int layer = 0; layer < a.L; layer++) {
                stepq_step_args sa = step_args(&a, a.ids, BATCH), sb = step_args(&b, b.ids, BATCH);
                fill_inputs(&a, 300 + layer);
                fill_inputs(&b, 300 + layer);
                assert_int_equal(stepq_pool_decode_step(a.pool, layer, &sa, NULL), STEPQ_OK);
                assert_int_equal(stepq_pool_decode_step(b.pool, layer, &sb, NULL), STEPQ_OK);
                assert_memory_equal(a.o, b.o, sizeof(float) * BATCH * a.HV * a.V);

                struct stepq__packed_layer pl;
                struct stepq__step_args ka;
                int col_differ = 0;
                stepq__pool_packed_layer(pa_, layer, &pl);
                kernel_args(&a, &sa, &ka);
                assert_true(a.K <= 8 && a.V <= 8);
                for (int e = 0; e < BATCH; e++)
                    for (int h = 0; h < a.HV; h++) {
                        const struct stepq__head_layout *hl = &pl.heads[h];
                        const size_t off = (size_t)a.ids[e] * pl.page_stride + pl.head_offset[h];
                        const float *w = pl.row_impact ? pl.row_impact + (size_t)h * a.K : NULL;
                        uint32_t fl = 0;
                        ref_updated_tile(&a, &ka, hl, start + off, e, h, tile);
                        assert_int_equal(stepq__quantize_head_fit(hl, tile, w, NULL, blk, &fl,
                                                                  STEPQ_DECODE_FIT_NOREFIT),
                                         STEPQ_OK);
                        assert_memory_equal(blk, pg_a + off, hl->block_bytes);
                        assert_int_equal(stepq__quantize_head(hl, tile, w, blk, &fl), STEPQ_OK);
                        assert_memory_equal(blk, pg_b + off, hl->block_bytes);
                        /* row scales, codes and pivots alike; column scales differ */
                        const size_t c0 = hl->col_scale_offset, c1 = c0 + 2 * (size_t)a.V;
                        assert_memory_equal(pg_a + off, pg_b + off, c0);
                        assert_memory_equal(pg_a + off + c1, pg_b + off + c1, hl->block_bytes - c1);
                        col_differ += memcmp(pg_a + off + c0, pg_b + off + c0, c1 - c0) != 0;
                    }
                assert_true(col_differ > 0);
            }
            assert_true(memcmp(pg_a, pg_b, n) != 0);
            free(blk);
            free(tile);
            free(start);
            fixture_close(&a);
            fixture_close(&b);
        }
    }
}

/*
 * The map's arith fp16 on the host pool (dsq, spatial, stepq; GDN and KDA): pools on an fp16
 * and an fp32 map pack the same pages; after a decode step every head the fp16 step covers
 * (stepq__step_f16_supports) holds the C reference's fp16 step of its start block
 * (kernels/step_f16.c on the prepared inputs: KDA's d_k log decays) and the output row is its
 * readout, bit for bit; every other head (GDN pivot heads) is the fp32 pool's block. Every map
 * has fp16 heads, the GDN stepq map pivot heads too; on KDA every head is an fp16 one, the
 * stepq map's with mixed widths and a pivot row among them. The fp16 pages differ from the fp32
 * ones. With the decode fit exact and with norefit (the heads' layouts carry it, and the
 * reference follows it).
 */
static void test_map_arith_fp16_is_the_host_pools_step(void **state)
{
    static const stepq_method methods[] = { STEPQ_METHOD_DSQ, STEPQ_METHOD_SPATIAL,
                                            STEPQ_METHOD_STEPQ };
    const size_t nm = sizeof(methods) / sizeof(methods[0]);

    (void)state;
    /* GDN then KDA, every method with the exact fit, then with norefit (the reference follows
     * hl->decode_fit) */
    for (size_t akf = 0; akf < 4 * nm; akf++) {
        const stepq_arch arch = akf < 2 * nm ? STEPQ_ARCH_GDN : STEPQ_ARCH_KDA;
        const size_t kf = akf % (2 * nm), k = kf % nm;
        const stepq_decode_fit fit = kf < nm ? STEPQ_DECODE_FIT_EXACT : STEPQ_DECODE_FIT_NOREFIT;
        struct fixture a, b;
        size_t n;
        memset(&a, 0, sizeof(a));
        /* the fp16 map: the fixture's map with arith fp16 before its pool opens */
        fixture_open_bits(&b, arch, methods[k], methods[k] == STEPQ_METHOD_STEPQ ? 6 : 4);
        {
            stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
            a = b;
            /* dsq and spatial at 4 bits, stepq mixed around 6 bits with pivot heads (GDN) or
             * pivot rows (KDA) */
            a.map = make_map_bits(arch, methods[k], methods[k] == STEPQ_METHOD_STEPQ ? 6 : 4);
            assert_int_equal(stepq_map_set_decode_fit(a.map, fit), STEPQ_OK);
            assert_int_equal(stepq_map_set_arith(a.map, STEPQ_ARITH_FP16), STEPQ_OK);
            cfg.map = a.map;
            cfg.num_slots = SLOTS;
            assert_int_equal(stepq_pool_open(&cfg, &a.pool), STEPQ_OK);
            int32_t all[SLOTS];
            assert_int_equal(stepq_pool_alloc(a.pool, SLOTS, all), STEPQ_OK);
        }
        stepq_pool_t *pa_ = stepq__pool_resolve(a.pool);
        stepq_prefill_args pb = prefill_args(&b, b.ids, BATCH, b.dense);
        for (int layer = 0; layer < b.L; layer++) {
            assert_int_equal(stepq_pool_prefill_pack(a.pool, layer, &pb, NULL), STEPQ_OK);
            assert_int_equal(stepq_pool_prefill_pack(b.pool, layer, &pb, NULL), STEPQ_OK);
        }
        const uint8_t *pg_a = pages_of(&a, &n), *pg_b = pages_of(&b, &n);
        assert_memory_equal(pg_a, pg_b, n); /* packs compute in fp32 either way */
        uint8_t *start = malloc(n);
        assert_non_null(start);
        memcpy(start, pg_a, n);
        const size_t head = (size_t)b.K * b.V;
        float *scratch = falloc(2 * head), *o_a = falloc((size_t)BATCH * b.HV * b.V);
        uint8_t *blk = malloc(n);
        assert_non_null(blk);
        int n16 = 0, n32 = 0, n_piv = 0, n_mixed = 0; /* fp16 heads with pivot rows, mixed */
        for (int layer = 0; layer < b.L; layer++) {
            stepq_step_args sb = step_args(&b, b.ids, BATCH);
            fill_inputs(&b, 500 + layer);
            assert_int_equal(stepq_pool_decode_step(a.pool, layer, &sb, NULL), STEPQ_OK);
            memcpy(o_a, b.o, sizeof(float) * BATCH * b.HV * b.V);
            assert_int_equal(stepq_pool_decode_step(b.pool, layer, &sb, NULL), STEPQ_OK);

            struct stepq__packed_layer pl;
            struct stepq__step_args ka;
            stepq__pool_packed_layer(pa_, layer, &pl);
            kernel_args(&b, &sb, &ka);
            assert_true(b.K <= 8 && b.V <= 8);
            for (int e = 0; e < BATCH; e++)
                for (int h = 0; h < b.HV; h++) {
                    const struct stepq__head_layout *hl = &pl.heads[h];
                    const size_t off = (size_t)b.ids[e] * pl.page_stride + pl.head_offset[h];
                    assert_int_equal(hl->arith, STEPQ_ARITH_FP16);
                    assert_int_equal(hl->decode_fit, fit);
                    if (!stepq__step_f16_supports(hl)) {
                        assert_memory_equal(pg_a + off, pg_b + off, hl->block_bytes);
                        n32++;
                        continue;
                    }
                    float q[8], kk[8], v[8], g[8], beta, o[8];
                    const float *w = pl.row_impact ? pl.row_impact + (size_t)h * b.K : NULL;
                    assert_int_equal(stepq__prep_step_head(&ka, e, h, b.ids[e], q, kk, v, g, &beta),
                                     0);
                    (void)stepq__step_head_f16(hl, start + off, w, q, kk, v, g, beta, blk, o,
                                               scratch, NULL);
                    assert_memory_equal(blk, pg_a + off, hl->block_bytes);
                    assert_memory_equal(o, o_a + ((size_t)e * b.HV + h) * b.V, sizeof(float) * b.V);
                    n16++;
                    n_piv += hl->n_pivot_rows > 0;
                    for (int i = 1; i < b.K; i++)
                        if (hl->row_bits[i] != hl->row_bits[0]) {
                            n_mixed++;
                            break;
                        }
                }
            memcpy(start, pg_a, n);
        }
        if (arch == STEPQ_ARCH_GDN)
            assert_true(n16 > 0 && (methods[k] != STEPQ_METHOD_STEPQ || n32 > 0));
        else
            assert_true(n16 > 0 && n32 == 0 &&
                        (methods[k] != STEPQ_METHOD_STEPQ || (n_piv > 0 && n_mixed > 0)));
        assert_true(memcmp(pg_a, pg_b, n) != 0);
        free(blk);
        free(scratch);
        free(o_a);
        free(start);
        assert_int_equal(stepq_pool_close(a.pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
        stepq_map_close(a.map);
        fixture_close(&b);
    }
}

/*
 * The decode fit rows on the host pool (dsq, spatial, stepq; GDN and KDA): pools on a rows,
 * an exact and a norefit map pack the same pages and read out the same o, but the rows
 * pool steps to pages of its own (other than both); every stepped block is the C
 * reference's rows fit of the updated state against the start block (dequantize, the
 * update, stepq__quantize_head_fit with the start block as the old one), and keeps the
 * start block's column scales. On fresh slots (zero pages) the rows pool steps to the exact
 * pool's pages.
 */
static void test_map_decode_fit_rows_is_the_host_pools_step(void **state)
{
    static const stepq_method methods[] = { STEPQ_METHOD_DSQ, STEPQ_METHOD_SPATIAL,
                                            STEPQ_METHOD_STEPQ };

    (void)state;
    for (int arch = 0; arch < 2; arch++) {
        for (size_t k = 0; k < sizeof(methods) / sizeof(methods[0]); k++) {
            struct fixture a, b, c;
            size_t n;
            fixture_open_fit(&a, (stepq_arch)arch, methods[k], 0.5, STEPQ_DECODE_FIT_ROWS);
            fixture_open(&b, (stepq_arch)arch, methods[k]);
            fixture_open_fit(&c, (stepq_arch)arch, methods[k], 0.5, STEPQ_DECODE_FIT_NOREFIT);
            stepq_pool_t *pa_ = stepq__pool_resolve(a.pool);
            assert_int_equal(pa_->layout.heads[0].decode_fit, STEPQ_DECODE_FIT_ROWS);
            stepq_prefill_args pa = prefill_args(&a, a.ids, BATCH, a.dense);
            stepq_prefill_args pb = prefill_args(&b, b.ids, BATCH, b.dense);
            stepq_prefill_args pc = prefill_args(&c, c.ids, BATCH, c.dense);
            for (int layer = 0; layer < a.L; layer++) {
                assert_int_equal(stepq_pool_prefill_pack(a.pool, layer, &pa, NULL), STEPQ_OK);
                assert_int_equal(stepq_pool_prefill_pack(b.pool, layer, &pb, NULL), STEPQ_OK);
                assert_int_equal(stepq_pool_prefill_pack(c.pool, layer, &pc, NULL), STEPQ_OK);
            }
            const uint8_t *pg_a = pages_of(&a, &n), *pg_b = pages_of(&b, &n),
                          *pg_c = pages_of(&c, &n);
            assert_memory_equal(pg_a, pg_b, n); /* the pack is exact */
            assert_memory_equal(pg_a, pg_c, n);
            uint8_t *start = snapshot(&a);
            const size_t head = (size_t)a.K * a.V;
            float *tile = falloc(head);
            uint8_t *blk = malloc(n);
            assert_non_null(blk);
            for (int layer = 0; layer < a.L; layer++) {
                stepq_step_args sa = step_args(&a, a.ids, BATCH), sb = step_args(&b, b.ids, BATCH);
                stepq_step_args sc = step_args(&c, c.ids, BATCH);
                fill_inputs(&a, 300 + layer);
                fill_inputs(&b, 300 + layer);
                fill_inputs(&c, 300 + layer);
                assert_int_equal(stepq_pool_decode_step(a.pool, layer, &sa, NULL), STEPQ_OK);
                assert_int_equal(stepq_pool_decode_step(b.pool, layer, &sb, NULL), STEPQ_OK);
                assert_int_equal(stepq_pool_decode_step(c.pool, layer, &sc, NULL), STEPQ_OK);
                assert_memory_equal(a.o, b.o, sizeof(float) * BATCH * a.HV * a.V);
                assert_memory_equal(a.o, c.o, sizeof(float) * BATCH * a.HV * a.V);

                struct stepq__packed_layer pl;
                struct stepq__step_args ka;
                stepq__pool_packed_layer(pa_, layer, &pl);
                kernel_args(&a, &sa, &ka);
                assert_true(a.K <= 8 && a.V <= 8);
                for (int e = 0; e < BATCH; e++)
                    for (int h = 0; h < a.HV; h++) {
                        const struct stepq__head_layout *hl = &pl.heads[h];
                        const size_t off = (size_t)a.ids[e] * pl.page_stride + pl.head_offset[h];
                        const float *w = pl.row_impact ? pl.row_impact + (size_t)h * a.K : NULL;
                        uint32_t fl = 0;
                        ref_updated_tile(&a, &ka, hl, start + off, e, h, tile);
                        assert_int_equal(stepq__quantize_head_fit(hl, tile, w, start + off, blk,
                                                                  &fl, STEPQ_DECODE_FIT_ROWS),
                                         STEPQ_OK);
                        assert_memory_equal(blk, pg_a + off, hl->block_bytes);
                        const size_t c0 = hl->col_scale_offset;
                        assert_memory_equal(pg_a + off + c0, start + off + c0, 2 * (size_t)a.V);
                    }
            }
            assert_true(memcmp(pg_a, pg_b, n) != 0);
            assert_true(memcmp(pg_a, pg_c, n) != 0);
            free(blk);
            free(tile);
            free(start);
            fixture_close(&a);
            fixture_close(&b);
            fixture_close(&c);

            /* Fresh slots (zero pages: column scales 0) cannot serve: the exact fit's pages. */
            fixture_open_fit(&a, (stepq_arch)arch, methods[k], 0.5, STEPQ_DECODE_FIT_ROWS);
            fixture_open(&b, (stepq_arch)arch, methods[k]);
            const uint8_t *z_a = pages_of(&a, &n), *z_b = pages_of(&b, &n);
            for (size_t q = 0; q < n; q++)
                assert_int_equal(z_a[q], 0);
            stepq_step_args za = step_args(&a, a.ids, BATCH), zb = step_args(&b, b.ids, BATCH);
            fill_inputs(&a, 400);
            fill_inputs(&b, 400);
            assert_int_equal(stepq_pool_decode_step(a.pool, 0, &za, NULL), STEPQ_OK);
            assert_int_equal(stepq_pool_decode_step(b.pool, 0, &zb, NULL), STEPQ_OK);
            assert_memory_equal(z_a, z_b, n);
            int nonzero = 0;
            for (size_t q = 0; q < n; q++)
                nonzero |= z_a[q] != 0;
            assert_true(nonzero);
            fixture_close(&a);
            fixture_close(&b);
        }
    }
}

/* --- bad input: status, a message naming the argument, nothing changed ------ */

struct bad_case {
    const char *name;
    int status;
    const char *needle;
};

static void expect(struct fixture *f, const uint8_t *before, int got, int status,
                   const char *needle, const char *what)
{
    if (got != status || !strstr(stepq_pool_last_error(f->pool), needle)) {
        print_error("%s: got %s '%s', want %s naming '%s'\n", what, stepq_status_name(got),
                    stepq_pool_last_error(f->pool), stepq_status_name(status), needle);
        fail();
    }
    assert_string_equal(stepq_last_error(), stepq_pool_last_error(f->pool));
    assert_unchanged(f, before);
}

static void bad_arguments_change_nothing(stepq_method method)
{
    struct fixture f;
    fixture_open(&f, STEPQ_ARCH_GDN, method);
    stepq_prefill_args pp = prefill_args(&f, f.ids, BATCH, f.dense);
    for (int layer = 0; layer < f.L; layer++)
        assert_int_equal(stepq_pool_prefill_pack(f.pool, layer, &pp, NULL), STEPQ_OK);
    uint8_t *before = snapshot(&f);
    stepq_step_args a;
    int32_t ids[BATCH];
    memcpy(ids, f.ids, sizeof(ids));

#define CASE(setup, layer, status, needle)                                                  \
    do {                                                                                    \
        a = step_args(&f, ids, BATCH);                                                      \
        setup;                                                                              \
        expect(&f, before, stepq_pool_decode_step(f.pool, layer, &a, NULL), status, needle, \
               #setup);                                                                     \
        memcpy(ids, f.ids, sizeof(ids));                                                    \
    } while (0)
    CASE((void)0, -1, STEPQ_ERANGE, "layer -1");
    CASE((void)0, 3, STEPQ_ERANGE, "layer 3");
    CASE(a.q = NULL, 0, STEPQ_EINVAL, "q is NULL");
    CASE(a.o = NULL, 0, STEPQ_EINVAL, "o is NULL");
    CASE(a.slot_ids = NULL, 0, STEPQ_EINVAL, "slot_ids is NULL");
    CASE(a.v = (const char *)f.v + 2, 0, STEPQ_EINVAL, "v = ");
    CASE(a.k_stride = f.H * f.K - 1, 0, STEPQ_EINVAL, "k_stride");
    CASE(a.o_stride = -4, 0, STEPQ_EINVAL, "o_stride");
    CASE(a.flags = 1u << 7, 0, STEPQ_EINVAL, "flags");
    CASE(a.scale = -1.0f, 0, STEPQ_EINVAL, "scale");
    CASE(a.scale = NAN, 0, STEPQ_EINVAL, "scale");
    CASE(a.dtype = STEPQ_DTYPE_FP16, 0, STEPQ_ENOTSUP, "dtype fp16");
    CASE(a.dtype = (stepq_dtype)7, 0, STEPQ_EINVAL, "dtype 7");
    CASE((a.flags |= STEPQ_STEP_GATE_IN_KERNEL, a.A_log = NULL), 0, STEPQ_EINVAL, "A_log");
    CASE((a.flags |= STEPQ_STEP_GATE_IN_KERNEL, a.param_dtype = STEPQ_DTYPE_FP16), 0, STEPQ_ENOTSUP,
         "param_dtype");
    CASE(a.num_v_heads = 8, 0, STEPQ_ESHAPE, "num_v_heads = 8");
    CASE(a.num_k_heads = 4, 0, STEPQ_ESHAPE, "num_k_heads = 4");
    CASE(a.head_v_dim = 128, 0, STEPQ_ESHAPE, "head_v_dim");
    CASE(a.batch = 65536, 0, STEPQ_EINVAL, "batch = 65536");
    CASE(a.batch = -1, 0, STEPQ_EINVAL, "batch = -1");
    CASE(ids[2] = ids[0], 0, STEPQ_EINVAL, "listed more than once");
    CASE(ids[3] = SLOTS + 1, 0, STEPQ_ERANGE, "slot_ids[3] = 7");
    CASE(ids[1] = -2, 0, STEPQ_ERANGE, "slot_ids[1] = -2");
    /* Slots freed by the fixture are not allocated. */
    {
        int32_t probe;
        for (probe = 1; probe <= SLOTS; probe++)
            if (stepq_pool_is_allocated(f.pool, probe) == 0)
                break;
        CASE(ids[0] = probe, 0, STEPQ_EINVAL, "is not allocated");
    }
    CASE(a.size = 8, 0, STEPQ_EVERSION, "stepq_step_args");
    CASE(a.size = sizeof(a) + 8, 0, STEPQ_EVERSION, "newer");
    CASE(a.magic = 0, 0, STEPQ_EVERSION, "magic");
    CASE(a.version = 2, 0, STEPQ_EVERSION, "version 2");
    expect(&f, before, stepq_pool_decode_step(f.pool, 0, NULL, NULL), STEPQ_EINVAL, "args",
           "NULL args");
#undef CASE

    /* Prefill entries. */
    stepq_prefill_args p;
#define PCASE(setup, pack, status, needle)                              \
    do {                                                                \
        p = prefill_args(&f, ids, BATCH, f.dense);                      \
        setup;                                                          \
        expect(&f, before,                                              \
               (pack) ? stepq_pool_prefill_pack(f.pool, 0, &p, NULL)    \
                      : stepq_pool_prefill_unpack(f.pool, 0, &p, NULL), \
               status, needle, #setup);                                 \
        memcpy(ids, f.ids, sizeof(ids));                                \
    } while (0)
    PCASE(p.states = NULL, 1, STEPQ_EINVAL, "states is NULL");
    PCASE(p.states = (char *)f.dense + 1, 0, STEPQ_EINVAL, "states = ");
    PCASE(p.state_stride = 10, 1, STEPQ_EINVAL, "state_stride");
    PCASE(p.layout = (stepq_state_layout)2, 1, STEPQ_EINVAL, "layout 2");
    PCASE(p.dtype = STEPQ_DTYPE_FP16, 0, STEPQ_ENOTSUP, "dtype fp16");
    PCASE(p.head_k_dim = 16, 1, STEPQ_ESHAPE, "head_k_dim = 16");
    PCASE(ids[1] = ids[0], 1, STEPQ_EINVAL, "listed more than once");
    PCASE(ids[1] = 99, 0, STEPQ_ERANGE, "slot_ids[1] = 99");
    PCASE(p.n = 70000, 1, STEPQ_EINVAL, "n = 70000");
#undef PCASE

    /* A closed pool: EBADF, as for every pool call. */
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *other;
    cfg.map = f.map;
    cfg.num_slots = 2;
    assert_int_equal(stepq_pool_open(&cfg, &other), STEPQ_OK);
    assert_int_equal(stepq_pool_close(other, 0), STEPQ_OK);
    a = step_args(&f, ids, BATCH);
    assert_int_equal(stepq_pool_decode_step(other, 0, &a, NULL), STEPQ_EBADF);
    free(before);
    fixture_close(&f);
}

static void test_step_bad_arguments_change_nothing(void **state)
{
    bad_arguments_change_nothing(STEPQ_METHOD_STEPQ);
}
static void test_fp8_bad_arguments_change_nothing(void **state)
{
    bad_arguments_change_nothing(STEPQ_METHOD_FP8);
}

/*
 * The versioned-struct rule: an older caller's smaller struct is accepted and
 * its missing fields take the defaults; a newer (larger) one is refused.
 */
struct cfg_v2 {
    size_t size;
    unsigned magic, version;
    int a;
    int b; /* appended in "version 2" */
};

static void test_config_import_older_caller_gets_defaults(void **state)
{
    const struct cfg_v2 defaults = { sizeof(struct cfg_v2), STEPQ_CONFIG_MAGIC, 2, 1, 77 };
    struct {
        size_t size;
        unsigned magic, version;
        int a;
    } old = { sizeof(old), STEPQ_CONFIG_MAGIC, 1, 5 };
    struct cfg_v2 got, newer = defaults;
    const size_t ends[2] = { STEPQ__FIELD_END(struct cfg_v2, a),
                             STEPQ__FIELD_END(struct cfg_v2, b) };

    assert_int_equal(stepq__config_import(&got, &defaults, sizeof(got), &old, ends, 2, "cfg"),
                     STEPQ_OK);
    assert_int_equal(got.a, 5);
    assert_int_equal(got.b, 77);
    assert_int_equal(got.size, sizeof(got));
    /* The old struct's trailing padding (where b now lives) is not copied. */
    memset(&old, 0xee, sizeof(old));
    old.size = sizeof(old), old.magic = STEPQ_CONFIG_MAGIC, old.version = 1, old.a = 6;
    assert_int_equal(stepq__config_import(&got, &defaults, sizeof(got), &old, ends, 2, "cfg"),
                     STEPQ_OK);
    assert_int_equal(got.a, 6);
    assert_int_equal(got.b, 77);
    newer.size = sizeof(newer) + 8;
    assert_int_equal(stepq__config_import(&got, &defaults, sizeof(got), &newer, ends, 2, "cfg"),
                     STEPQ_EVERSION);
    old.size = offsetof(struct cfg_v2, a);
    assert_int_equal(stepq__config_import(&got, &defaults, sizeof(got), &old, ends, 2, "cfg"),
                     STEPQ_EVERSION);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_step_gdn_stepq),
        cmocka_unit_test(a_rank_conv_view_has_its_channels),
        cmocka_unit_test(test_step_kda_stepq_in_kernel_gate),
        cmocka_unit_test(test_step_gdn_fp32_in_kernel_gate),
        cmocka_unit_test(test_prefill_roundtrip_fp32_layouts_dtypes),
        cmocka_unit_test(test_prefill_unpack_strided_skips_padding),
        cmocka_unit_test(test_step_padding_pad_and_repeated_sentinel),
        cmocka_unit_test(test_step_bf16_strided_equals_fp32),
        cmocka_unit_test(test_supports_host_and_conv_view),
        cmocka_unit_test(test_map_row_split_is_the_host_pools_fit),
        cmocka_unit_test(test_map_decode_fit_is_the_host_pools_step),
        cmocka_unit_test(test_map_arith_fp16_is_the_host_pools_step),
        cmocka_unit_test(test_map_decode_fit_rows_is_the_host_pools_step),
        cmocka_unit_test(test_step_bad_arguments_change_nothing),
        cmocka_unit_test(test_step_gdn_fp8),
        cmocka_unit_test(test_step_kda_fp8_in_kernel_gate),
        cmocka_unit_test(test_fp8_tracks_an_fp32_pool),
        cmocka_unit_test(test_fp8_pack_of_non_finite_states_is_finite_and_flagged),
        cmocka_unit_test(test_fp8_bad_arguments_change_nothing),
        cmocka_unit_test(test_config_import_older_caller_gets_defaults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
