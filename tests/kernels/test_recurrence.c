/*
 * The fp32 reference recurrence: hand-computed steps, options, grouped value
 * heads, padding slots, both layouts, chunked prefill against the token loop,
 * argument checks and non-finite handling.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/dsp.h"
#include "tests/kernels/problem.h"
#include "tests/kernels/util.h"

static struct stepq__step_args one_head(stepq_arch arch, const float *q, const float *k,
                                        const float *v, const float *g, const float *beta, float *o,
                                        const int32_t *slot)
{
    struct stepq__step_args a;
    memset(&a, 0, sizeof(a));
    a.arch = arch;
    a.batch = 1;
    a.H = a.HV = 1;
    a.d_k = a.d_v = 2;
    a.n_slots = 1;
    a.slots = slot;
    step_args_set_tensors(&a, q, k, v, g, beta, o);
    a.opt.scale = 1.0f;
    return a;
}

/*
 * GDN, S0 = I, g = log 0.5, k = [1, 0], v = [2, 3], beta = 0.5, q = [0, 1],
 * scale 1, no l2norm:
 *   decay: S = 0.5 I; S^T k = [0.5, 0]; u = 0.5 ([2, 3] - [0.5, 0]) = [0.75, 1.5]
 *   S += k u^T -> [[1.25, 1.5], [0, 0.5]];  o = S^T q = [0, 0.5]
 */
static void gdn_step_2x2_golden(void **state)
{
    (void)state;
    float S[4] = { 1, 0, 0, 1 }, o[2];
    const float q[2] = { 0, 1 }, k[2] = { 1, 0 }, v[2] = { 2, 3 }, g[1] = { logf(0.5f) },
                beta[1] = { 0.5f };
    const int32_t slot = 0;
    struct stepq__step_args a = one_head(STEPQ_ARCH_GDN, q, k, v, g, beta, o, &slot);
    struct stepq__dense_states st = { S, 4, STEPQ__LAYOUT_KV };
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_OK);
    const float want[4] = { 1.25f, 1.5f, 0.0f, 0.5f };
    for (int e = 0; e < 4; e++)
        assert_float_equal(S[e], want[e], 1e-7);
    assert_float_equal(o[0], 0.0f, 1e-7);
    assert_float_equal(o[1], 0.5f, 1e-7);
}

/*
 * KDA, S0 = [[1, 2], [3, 4]], g = [log 0.5, log 0.25], k = [1, 1], v = [1, 1],
 * beta = 1, q = [1, 0]:
 *   decay rows: [[0.5, 1], [0.75, 1]]; S^T k = [1.25, 2]; u = [-0.25, -1]
 *   S += k u^T -> [[0.25, 0], [0.5, 0]];  o = row 0 = [0.25, 0]
 */
static void kda_step_2x2_golden(void **state)
{
    (void)state;
    float S[4] = { 1, 2, 3, 4 }, o[2];
    const float q[2] = { 1, 0 }, k[2] = { 1, 1 }, v[2] = { 1, 1 };
    const float g[2] = { logf(0.5f), logf(0.25f) }, beta[1] = { 1.0f };
    const int32_t slot = 0;
    struct stepq__step_args a = one_head(STEPQ_ARCH_KDA, q, k, v, g, beta, o, &slot);
    struct stepq__dense_states st = { S, 4, STEPQ__LAYOUT_KV };
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_OK);
    const float want[4] = { 0.25f, 0.0f, 0.5f, 0.0f };
    for (int e = 0; e < 4; e++)
        assert_float_equal(S[e], want[e], 1e-7);
    assert_float_equal(o[0], 0.25f, 1e-7);
    assert_float_equal(o[1], 0.0f, 1e-7);
}

static float *states_new(int n_slots, int HV, int dk, int dv, uint64_t seed)
{
    size_t n = (size_t)n_slots * HV * dk * dv;
    float *s = malloc(sizeof(float) * n);
    uint64_t rng = seed;
    rng_fill(&rng, s, n, 0.5f);
    return s;
}

static double softplus_d(double x)
{
    return x > 20.0 ? x : log1p(exp(x));
}

/* g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), computed here in double. */
static void in_kernel_gate_and_beta_sigmoid_match_precomputed(void **state)
{
    (void)state;
    for (int arch = 0; arch < 2; arch++) {
        enum { B = 3, H = 2, HV = 4, DK = 8, DV = 6 };
        struct problem p;
        problem_init(&p, (stepq_arch)arch, B, H, HV, DK, DV, 41 + arch);
        int n_g = arch ? DK : 1;
        float A_log[HV], dt_bias[HV * DK], graw[B * HV * DK], braw[B * HV];
        uint64_t rng = 8;
        for (int h = 0; h < HV; h++)
            A_log[h] = rng_sym(&rng);
        for (int e = 0; e < HV * n_g; e++)
            dt_bias[e] = rng_sym(&rng);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < HV; h++) {
                braw[b * HV + h] = 3.0f * rng_sym(&rng);
                p.beta[b * HV + h] = (float)(1.0 / (1.0 + exp(-(double)braw[b * HV + h])));
                for (int c = 0; c < n_g; c++) {
                    size_t e = ((size_t)b * HV + h) * n_g + c;
                    graw[e] = 4.0f * rng_sym(&rng);
                    p.g[e] = (float)(-exp((double)A_log[h]) *
                                     softplus_d((double)graw[e] + dt_bias[h * n_g + c]));
                }
            }
        float *s1 = states_new(B + 1, HV, DK, DV, 3), *s2 = states_new(B + 1, HV, DK, DV, 3);
        float o2[B * HV * DV];
        struct stepq__dense_states st1 = { s1, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
        struct stepq__dense_states st2 = { s2, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
        assert_int_equal(stepq__ref_step_dense(&p.a, &st1), STEPQ_OK);

        struct stepq__step_args a = p.a;
        a.g = graw;
        a.beta = braw;
        a.A_log = A_log;
        a.dt_bias = dt_bias;
        a.opt.gate_in_kernel = 1;
        a.opt.beta_sigmoid = 1;
        a.o = o2;
        assert_int_equal(stepq__ref_step_dense(&a, &st2), STEPQ_OK);
        size_t ns = (size_t)(B + 1) * HV * DK * DV;
        assert_true(rel_err(s2, s1, ns) < 1e-6);
        assert_true(rel_err(o2, p.o, (size_t)B * HV * DV) < 1e-6);
        free(s1);
        free(s2);
        problem_free(&p);
    }
}

/* l2norm in the kernel + default scale == normalising q, k beforehand with scale d_k^-1/2. */
static void l2norm_and_default_scale_match_manual_normalisation(void **state)
{
    (void)state;
    enum { B = 2, H = 1, HV = 2, DK = 16, DV = 8 };
    struct problem p;
    problem_init(&p, STEPQ_ARCH_GDN, B, H, HV, DK, DV, 5);
    float qn[B * H * DK], kn[B * H * DK], o2[B * HV * DV];
    for (int r = 0; r < B * H; r++) {
        double sq = 0, sk = 0;
        for (int i = 0; i < DK; i++) {
            sq += (double)p.q[r * DK + i] * p.q[r * DK + i];
            sk += (double)p.k[r * DK + i] * p.k[r * DK + i];
        }
        for (int i = 0; i < DK; i++) {
            qn[r * DK + i] = (float)(p.q[r * DK + i] / sqrt(sq + 1e-6) / sqrt((double)DK));
            kn[r * DK + i] = (float)(p.k[r * DK + i] / sqrt(sk + 1e-6));
        }
    }
    float *s1 = states_new(B + 1, HV, DK, DV, 9), *s2 = states_new(B + 1, HV, DK, DV, 9);
    struct stepq__dense_states st1 = { s1, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
    struct stepq__dense_states st2 = { s2, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
    assert_int_equal(stepq__ref_step_dense(&p.a, &st1), STEPQ_OK);
    struct stepq__step_args a = p.a;
    a.q = qn;
    a.k = kn;
    a.opt.l2norm = 0;
    a.opt.scale = 1.0f;
    a.o = o2;
    assert_int_equal(stepq__ref_step_dense(&a, &st2), STEPQ_OK);
    assert_true(rel_err(s2, s1, (size_t)(B + 1) * HV * DK * DV) < 1e-6);
    assert_true(rel_err(o2, p.o, (size_t)B * HV * DV) < 1e-6);
    /* an explicit scale is used as given: scale 2 doubles the readout exactly */
    float *s3 = states_new(B + 1, HV, DK, DV, 9), o3[B * HV * DV];
    struct stepq__dense_states st3 = { s3, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
    a.opt.scale = 2.0f;
    a.o = o3;
    assert_int_equal(stepq__ref_step_dense(&a, &st3), STEPQ_OK);
    for (int e = 0; e < B * HV * DV; e++)
        assert_true(o3[e] == 2.0f * o2[e]);
    free(s3);
    free(s1);
    free(s2);
    problem_free(&p);
}

/* HV = 6 value heads over H = 2 q/k heads equal H = HV with q/k repeated per group. */
static void grouped_value_heads_read_their_qk_group(void **state)
{
    (void)state;
    for (int arch = 0; arch < 2; arch++) {
        enum { B = 2, H = 2, HV = 6, DK = 8, DV = 5 };
        struct problem p;
        problem_init(&p, (stepq_arch)arch, B, H, HV, DK, DV, 17);
        float qx[B * HV * DK], kx[B * HV * DK], o2[B * HV * DV];
        for (int b = 0; b < B; b++)
            for (int hv = 0; hv < HV; hv++) {
                int hq = hv / (HV / H);
                memcpy(qx + (b * HV + hv) * DK, p.q + (b * H + hq) * DK, sizeof(float) * DK);
                memcpy(kx + (b * HV + hv) * DK, p.k + (b * H + hq) * DK, sizeof(float) * DK);
            }
        float *s1 = states_new(B + 1, HV, DK, DV, 1), *s2 = states_new(B + 1, HV, DK, DV, 1);
        struct stepq__dense_states st1 = { s1, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
        struct stepq__dense_states st2 = { s2, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
        assert_int_equal(stepq__ref_step_dense(&p.a, &st1), STEPQ_OK);
        struct stepq__step_args a = p.a;
        a.H = HV;
        a.q = qx;
        a.k = kx;
        a.o = o2;
        assert_int_equal(stepq__ref_step_dense(&a, &st2), STEPQ_OK);
        assert_memory_equal(s1, s2, sizeof(float) * (B + 1) * HV * DK * DV);
        assert_memory_equal(p.o, o2, sizeof(o2));
        /* and the groups differ: head 0 and head 3 read different q/k */
        assert_true(max_abs_diff(p.o, p.o + 3 * DV, DV) > 0);
        free(s1);
        free(s2);
        problem_free(&p);
    }
}

static void padding_slots_are_skipped(void **state)
{
    (void)state;
    enum { B = 3, H = 1, HV = 2, DK = 4, DV = 4, NS = 4 };
    struct problem p;
    problem_init(&p, STEPQ_ARCH_KDA, B, H, HV, DK, DV, 23);
    p.slots[0] = 3;
    p.slots[1] = -1;
    p.slots[2] = 1;
    p.a.n_slots = NS;
    for (int e = 0; e < B * HV * DV; e++)
        p.o[e] = 123.0f;
    float *s = states_new(NS, HV, DK, DV, 2), *ref = states_new(NS, HV, DK, DV, 2);
    size_t slot = (size_t)HV * DK * DV;
    struct stepq__dense_states st = { s, slot, STEPQ__LAYOUT_KV };
    assert_int_equal(stepq__ref_step_dense(&p.a, &st), STEPQ_OK);
    /* slots 0 (sentinel) and 2 untouched; 1 and 3 updated */
    assert_memory_equal(s, ref, sizeof(float) * slot);
    assert_memory_equal(s + 2 * slot, ref + 2 * slot, sizeof(float) * slot);
    assert_true(max_abs_diff(s + slot, ref + slot, slot) > 0);
    assert_true(max_abs_diff(s + 3 * slot, ref + 3 * slot, slot) > 0);
    /* the padding entry's output rows are not written */
    for (int e = HV * DV; e < 2 * HV * DV; e++)
        assert_true(p.o[e] == 123.0f);
    assert_true(p.o[0] != 123.0f);
    free(s);
    free(ref);
    problem_free(&p);
}

static void vk_layout_gives_the_transposed_kv_result(void **state)
{
    (void)state;
    for (int arch = 0; arch < 2; arch++) {
        enum { B = 2, H = 1, HV = 2, DK = 6, DV = 5 };
        struct problem p;
        problem_init(&p, (stepq_arch)arch, B, H, HV, DK, DV, 29);
        size_t n = (size_t)(B + 1) * HV * DK * DV;
        float *kv = states_new(B + 1, HV, DK, DV, 4), *vk = malloc(sizeof(float) * n);
        float o2[B * HV * DV];
        for (size_t h = 0; h < (size_t)(B + 1) * HV; h++)
            for (int i = 0; i < DK; i++)
                for (int j = 0; j < DV; j++)
                    vk[h * DK * DV + j * DK + i] = kv[h * DK * DV + i * DV + j];
        struct stepq__dense_states st1 = { kv, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
        struct stepq__dense_states st2 = { vk, (size_t)HV * DK * DV, STEPQ__LAYOUT_VK };
        assert_int_equal(stepq__ref_step_dense(&p.a, &st1), STEPQ_OK);
        struct stepq__step_args a = p.a;
        a.o = o2;
        assert_int_equal(stepq__ref_step_dense(&a, &st2), STEPQ_OK);
        for (size_t h = 0; h < (size_t)(B + 1) * HV; h++)
            for (int i = 0; i < DK; i++)
                for (int j = 0; j < DV; j++)
                    assert_true(vk[h * DK * DV + j * DK + i] == kv[h * DK * DV + i * DV + j]);
        assert_memory_equal(o2, p.o, sizeof(o2));
        free(kv);
        free(vk);
        problem_free(&p);
    }
}

/* Runs T tokens one by one; returns outputs [T][HV][d_v] and the final state. */
static void token_loop(const struct problem *p, float *state, stepq__layout layout, float *o)
{
    const int32_t slot = 0;
    struct stepq__dense_states st = { state, (size_t)p->a.HV * p->a.d_k * p->a.d_v, layout };
    for (int t = 0; t < p->a.batch; t++) {
        struct stepq__step_args a = problem_token(p, t, o + (size_t)t * p->a.HV * p->a.d_v, &slot);
        assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_OK);
    }
}

static void check_prefill(stepq_arch arch, int T, const int *chunks, int n_chunks, int layout_vk)
{
    enum { H = 1, HV = 2, DK = 16, DV = 12 };
    struct problem p;
    problem_init(&p, arch, T, H, HV, DK, DV, 1000 + T + arch);
    size_t ns = (size_t)HV * DK * DV, no = (size_t)T * HV * DV;
    stepq__layout layout = layout_vk ? STEPQ__LAYOUT_VK : STEPQ__LAYOUT_KV;
    float *s0 = states_new(1, HV, DK, DV, 7);
    float *sref = malloc(sizeof(float) * ns), *s = malloc(sizeof(float) * ns);
    float *oref = malloc(sizeof(float) * no);

    memcpy(sref, s0, sizeof(float) * ns);
    token_loop(&p, sref, layout, oref);
    for (int c = 0; c < n_chunks; c++) {
        memcpy(s, s0, sizeof(float) * ns);
        memset(p.o, 0, sizeof(float) * no);
        assert_int_equal(stepq__ref_prefill_chunked(&p.a, chunks[c], s, layout), STEPQ_OK);
        double es = rel_err(s, sref, ns), eo = rel_err(p.o, oref, no);
        if (getenv("STEPQ_TEST_VERBOSE") || es > 1e-5 || eo > 1e-5)
            print_message("%s T=%d chunk=%d: state rel err %.3g, output rel err %.3g\n",
                          arch == STEPQ_ARCH_KDA ? "kda" : "gdn", T, chunks[c], es, eo);
        assert_true(es <= 1e-5);
        assert_true(eo <= 1e-5);
    }
    free(s0);
    free(sref);
    free(s);
    free(oref);
    problem_free(&p);
}

static void gdn_chunked_prefill_equals_token_recurrence_over_4096_tokens(void **state)
{
    (void)state;
    const int chunks[] = { 1, 37, 64, 1000 };
    check_prefill(STEPQ_ARCH_GDN, 4096, chunks, 4, 0);
}

static void kda_chunked_prefill_equals_token_recurrence_over_4096_tokens(void **state)
{
    (void)state;
    const int chunks[] = { 1, 37, 64 };
    check_prefill(STEPQ_ARCH_KDA, 4096, chunks, 3, 0);
}

static void chunked_prefill_in_one_chunk_and_vk_layout(void **state)
{
    (void)state;
    const int chunks[] = { 300, 512, 7 };
    check_prefill(STEPQ_ARCH_GDN, 300, chunks, 3, 1);
    check_prefill(STEPQ_ARCH_KDA, 300, chunks, 3, 1);
}

static void step_rejects_bad_arguments_without_writing(void **state)
{
    (void)state;
    enum { B = 2, H = 1, HV = 2, DK = 4, DV = 4 };
    struct problem p;
    problem_init(&p, STEPQ_ARCH_GDN, B, H, HV, DK, DV, 3);
    float *s = states_new(B + 1, HV, DK, DV, 5), *ref = states_new(B + 1, HV, DK, DV, 5);
    size_t n = (size_t)(B + 1) * HV * DK * DV;
    struct stepq__dense_states st = { s, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
    struct stepq__step_args a;

    a = p.a;
    p.slots[1] = p.slots[0];
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "twice"));
    p.slots[1] = B + 1;
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "slots[1]"));
    p.slots[1] = 2;
    a.H = 3;
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_EINVAL);
    a = p.a;
    a.opt.gate_in_kernel = 1;
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_EINVAL);
    a = p.a;
    a.q = NULL;
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_EINVAL);
    a = p.a;
    st.slot_stride = 3;
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_EINVAL);
    st.slot_stride = (size_t)HV * DK * DV;
    a.d_k = STEPQ__MAX_HEAD_DIM + 1;
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_EINVAL);
    assert_memory_equal(s, ref, sizeof(float) * n);
    for (int e = 0; e < B * HV * DV; e++)
        assert_true(p.o[e] == 0.0f);
    free(s);
    free(ref);
    problem_free(&p);
}

/* A NaN input of (request 1, head 0): that head keeps its state, outputs 0,
 * its slot is flagged INPUT; every other head is computed as without it. */
static void non_finite_input_leaves_that_head_unchanged(void **state)
{
    (void)state;
    for (int arch = 0; arch < 2; arch++) {
        enum { B = 2, H = 1, HV = 2, DK = 4, DV = 3 };
        struct problem p;
        problem_init(&p, (stepq_arch)arch, B, H, HV, DK, DV, 61);
        size_t slot = (size_t)HV * DK * DV;
        float *s = states_new(B + 1, HV, DK, DV, 8), *ref = states_new(B + 1, HV, DK, DV, 8);
        float *before = states_new(B + 1, HV, DK, DV, 8);
        float o2[B * HV * DV];
        uint32_t health[B + 1] = { 0 };
        uint64_t counts[STEPQ__HEALTH_NCOUNTS] = { 0 };
        struct stepq__dense_states st = { s, slot, STEPQ__LAYOUT_KV };
        struct stepq__dense_states sr = { ref, slot, STEPQ__LAYOUT_KV };

        struct stepq__step_args a = p.a;
        a.o = o2;
        assert_int_equal(stepq__ref_step_dense(&a, &sr), STEPQ_OK);

        p.v[(1 * HV + 0) * DV + 1] = NAN;
        p.a.health = health;
        p.a.counts = counts;
        assert_int_equal(stepq__ref_step_dense(&p.a, &st), STEPQ_OK);
        /* request 1 is slot 2; its head 0 is unchanged, head 1 as in the clean run */
        assert_memory_equal(s + 2 * slot, before + 2 * slot, sizeof(float) * DK * DV);
        assert_memory_equal(s + 2 * slot + DK * DV, ref + 2 * slot + DK * DV,
                            sizeof(float) * DK * DV);
        assert_memory_equal(s + slot, ref + slot, sizeof(float) * slot);
        for (int j = 0; j < DV; j++)
            assert_true(p.o[(1 * HV + 0) * DV + j] == 0.0f);
        assert_memory_equal(p.o, o2, sizeof(float) * HV * DV);
        assert_int_equal(health[2], STEPQ_HEALTH_INPUT);
        assert_int_equal(health[1], 0);
        assert_int_equal(counts[0], 1);
        assert_int_equal(counts[1], 0);

        /* the same for Inf in the gate and in beta */
        p.v[(1 * HV + 0) * DV + 1] = 0.5f;
        p.g[0] = -INFINITY;
        p.beta[3] = INFINITY;
        memcpy(before, s, sizeof(float) * (B + 1) * slot);
        assert_int_equal(stepq__ref_step_dense(&p.a, &st), STEPQ_OK);
        assert_memory_equal(s + slot, before + slot, sizeof(float) * DK * DV);
        assert_memory_equal(s + 2 * slot + DK * DV, before + 2 * slot + DK * DV,
                            sizeof(float) * DK * DV);
        assert_int_equal(health[1], STEPQ_HEALTH_INPUT);
        assert_int_equal(counts[0], 3);
        free(s);
        free(ref);
        free(before);
        problem_free(&p);
    }
}

/* Inf in a stored state is replaced by 0 after the update: finite state and output, flag STATE. */
static void non_finite_state_is_zeroed_and_flagged(void **state)
{
    (void)state;
    enum { B = 1, H = 1, HV = 1, DK = 4, DV = 3 };
    struct problem p;
    problem_init(&p, STEPQ_ARCH_GDN, B, H, HV, DK, DV, 71);
    float *s = states_new(2, HV, DK, DV, 8);
    uint32_t health[2] = { 0 };
    uint64_t counts[STEPQ__HEALTH_NCOUNTS] = { 0 };
    struct stepq__dense_states st = { s, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
    s[DK * DV + 5] = INFINITY;
    p.a.health = health;
    p.a.counts = counts;
    assert_int_equal(stepq__ref_step_dense(&p.a, &st), STEPQ_OK);
    for (int e = 0; e < DK * DV; e++)
        assert_true(isfinite(s[DK * DV + e]));
    for (int j = 0; j < DV; j++)
        assert_true(isfinite(p.o[j]));
    assert_int_equal(health[1], STEPQ_HEALTH_STATE);
    assert_int_equal(counts[1], 1);
    free(s);
    problem_free(&p);
}

static void overflowing_readout_is_written_as_zero_and_flagged(void **state)
{
    (void)state;
    float S[4] = { 1, 1, 1, 1 }, o[2];
    const float q[2] = { 3e38f, 3e38f }, k[2] = { 0, 0 }, v[2] = { 0, 0 }, g[1] = { 0 },
                beta[1] = { 0 };
    const int32_t slot = 0;
    uint32_t health = 0;
    struct stepq__step_args a = one_head(STEPQ_ARCH_GDN, q, k, v, g, beta, o, &slot);
    struct stepq__dense_states st = { S, 4, STEPQ__LAYOUT_KV };
    a.health = &health;
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_OK);
    assert_true(o[0] == 0.0f && o[1] == 0.0f);
    assert_int_equal(health, STEPQ_HEALTH_OUTPUT);
}

static void prefill_refuses_non_finite_input_and_keeps_state(void **state)
{
    (void)state;
    enum { T = 20, H = 1, HV = 2, DK = 4, DV = 4 };
    struct problem p;
    problem_init(&p, STEPQ_ARCH_KDA, T, H, HV, DK, DV, 5);
    float *s = states_new(1, HV, DK, DV, 1), *ref = states_new(1, HV, DK, DV, 1);
    p.k[7 * DK + 2] = NAN;
    assert_int_equal(stepq__ref_prefill_chunked(&p.a, 8, s, STEPQ__LAYOUT_KV), STEPQ_ENONFINITE);
    assert_non_null(strstr(stepq_last_error(), "token 7"));
    assert_memory_equal(s, ref, sizeof(float) * HV * DK * DV);
    assert_int_equal(stepq__ref_prefill_chunked(&p.a, 0, s, STEPQ__LAYOUT_KV), STEPQ_EINVAL);
    free(s);
    free(ref);
    problem_free(&p);
}

/*
 * Raw gate inputs for gate_in_kernel + beta_sigmoid: g holds a, beta holds
 * b, and A_log [HV], dt_bias [HV][n_g] are filled (values as a server's).
 */
static void use_in_kernel_gate(struct problem *p, float *A_log, float *dt_bias, uint64_t seed)
{
    int HV = p->a.HV, n = p->a.batch, n_g = p->a.arch == STEPQ_ARCH_KDA ? p->a.d_k : 1;
    uint64_t rng = seed;
    for (int h = 0; h < HV; h++)
        A_log[h] = rng_sym(&rng);
    for (int e = 0; e < HV * n_g; e++)
        dt_bias[e] = rng_sym(&rng);
    for (size_t e = 0; e < (size_t)n * HV * n_g; e++)
        p->g[e] = 4.0f * rng_sym(&rng);
    for (size_t e = 0; e < (size_t)n * HV; e++)
        p->beta[e] = 3.0f * rng_sym(&rng);
    p->a.A_log = A_log;
    p->a.dt_bias = dt_bias;
    p->a.opt.gate_in_kernel = 1;
    p->a.opt.beta_sigmoid = 1;
}

/*
 * The step inputs as a server hands them: bf16 (A_log, dt_bias too), q|k|v
 * views into one fused projection row, padded g, beta and o rows, NaN in
 * every input gap. The dense step then gives exactly the states of the fp32
 * contiguous step fed the same bf16-rounded values, and its o rounded to
 * bf16, with o's gaps and the padding entry's row untouched; GDN and KDA,
 * with and without the in-kernel gate, both layouts. fp32 views give the
 * contiguous results bit for bit.
 */
static void dense_step_bf16_strided_views_equal_fp32_contiguous_on_rounded_inputs(void **state)
{
    (void)state;
    static const stepq_dtype dts[2] = { STEPQ_DTYPE_BF16, STEPQ_DTYPE_FP32 };
    for (int arch = 0; arch < 2; arch++)
        for (int gate = 0; gate < 2; gate++)
            for (int d = 0; d < 2; d++) {
                enum { B = 4, H = 2, HV = 4, DK = 8, DV = 6 };
                struct problem p;
                problem_init(&p, (stepq_arch)arch, B, H, HV, DK, DV, 300 + 4 * arch + 2 * gate + d);
                p.slots[2] = -1;
                float A_log[HV], dt_bias[HV * DK];
                if (gate)
                    use_in_kernel_gate(&p, A_log, dt_bias, 90 + arch);
                struct server_view w;
                struct stepq__step_args a = server_view_init(
                    &w, &p, dts[d], dts[d], gate ? A_log : NULL, gate ? dt_bias : NULL);
                stepq__layout lay = gate ? STEPQ__LAYOUT_VK : STEPQ__LAYOUT_KV;
                size_t slot = (size_t)HV * DK * DV, ns = (size_t)(B + 1) * slot;
                float *s1 = states_new(B + 1, HV, DK, DV, 6),
                      *s2 = states_new(B + 1, HV, DK, DV, 6);
                uint32_t h1[B + 1] = { 0 }, h2[B + 1] = { 0 };
                struct stepq__dense_states st1 = { s1, slot, lay }, st2 = { s2, slot, lay };
                p.a.health = h1;
                a.health = h2;
                assert_int_equal(stepq__ref_step_dense(&p.a, &st1), STEPQ_OK);
                assert_int_equal(stepq__ref_step_dense(&a, &st2), STEPQ_OK);
                assert_memory_equal(s1, s2, sizeof(float) * ns);
                assert_memory_equal(h1, h2, sizeof(h1));
                for (int b = 0; b < B + 1; b++)
                    assert_int_equal(h2[b], 0); /* no NaN of a gap was read */
                assert_true(server_view_o_matches(&w, p.o, p.slots, B, HV, DV));
                server_view_free(&w);
                free(s1);
                free(s2);
                problem_free(&p);
            }
}

/*
 * The chunked prefill reads its T tokens through the same views (strides
 * between tokens): final state and o as the fp32 contiguous prefill on the
 * rounded values, exactly.
 */
static void
chunked_prefill_bf16_strided_tokens_equal_fp32_contiguous_on_rounded_inputs(void **state)
{
    (void)state;
    for (int arch = 0; arch < 2; arch++)
        for (int gate = 0; gate < 2; gate++) {
            enum { T = 50, H = 1, HV = 2, DK = 8, DV = 8 };
            struct problem p;
            problem_init(&p, (stepq_arch)arch, T, H, HV, DK, DV, 500 + 2 * arch + gate);
            float A_log[HV], dt_bias[HV * DK];
            if (gate)
                use_in_kernel_gate(&p, A_log, dt_bias, 70 + arch);
            struct server_view w;
            struct stepq__step_args a =
                server_view_init(&w, &p, STEPQ_DTYPE_BF16, STEPQ_DTYPE_BF16, gate ? A_log : NULL,
                                 gate ? dt_bias : NULL);
            size_t ns = (size_t)HV * DK * DV;
            float *s1 = states_new(1, HV, DK, DV, 2), *s2 = states_new(1, HV, DK, DV, 2);
            assert_int_equal(stepq__ref_prefill_chunked(&p.a, 16, s1, STEPQ__LAYOUT_KV), STEPQ_OK);
            assert_int_equal(stepq__ref_prefill_chunked(&a, 16, s2, STEPQ__LAYOUT_KV), STEPQ_OK);
            assert_memory_equal(s1, s2, sizeof(float) * ns);
            assert_true(server_view_o_matches(&w, p.o, NULL, T, HV, DV));
            server_view_free(&w);
            free(s1);
            free(s2);
            problem_free(&p);
        }
}

/* The stride fields of struct stepq__step_args and their names. */
static const struct {
    size_t off;
    const char *name;
} stride_fields[6] = {
    { offsetof(struct stepq__step_args, q_stride), "q_stride" },
    { offsetof(struct stepq__step_args, k_stride), "k_stride" },
    { offsetof(struct stepq__step_args, v_stride), "v_stride" },
    { offsetof(struct stepq__step_args, g_stride), "g_stride" },
    { offsetof(struct stepq__step_args, beta_stride), "beta_stride" },
    { offsetof(struct stepq__step_args, o_stride), "o_stride" },
};

static size_t *stride_field(struct stepq__step_args *a, int n)
{
    return (size_t *)((char *)a + stride_fields[n].off);
}

/*
 * A nonzero stride one element short of the packed row (rows would overlap)
 * is STEPQ_EINVAL naming the field; dtype or param_dtype fp16 (or an unknown
 * value) is STEPQ_ENOTSUP naming the field; the packed length itself is
 * accepted. Nothing is written: states, o and health stay as they were, for
 * the dense step and the chunked prefill.
 */
static void short_strides_and_fp16_are_rejected_without_writing(void **state)
{
    (void)state;
    for (int arch = 0; arch < 2; arch++) {
        enum { B = 2, H = 1, HV = 2, DK = 4, DV = 4 };
        const size_t packed[6] = { H * DK, H * DK, HV * DV, arch ? HV * DK : HV, HV, HV * DV };
        struct problem p;
        problem_init(&p, (stepq_arch)arch, B, H, HV, DK, DV, 7);
        size_t n = (size_t)(B + 1) * HV * DK * DV;
        float *s = states_new(B + 1, HV, DK, DV, 5), *ref = states_new(B + 1, HV, DK, DV, 5);
        uint32_t health[B + 1] = { 0 };
        struct stepq__dense_states st = { s, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
        struct stepq__step_args a;
        p.a.health = health;
        memset(p.o, 0xA5, sizeof(float) * B * HV * DV);

        for (int f = 0; f < 6; f++) {
            a = p.a;
            *stride_field(&a, f) = packed[f] - 1;
            assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_EINVAL);
            assert_non_null(strstr(stepq_last_error(), stride_fields[f].name));
            assert_int_equal(stepq__ref_prefill_chunked(&a, 4, s, STEPQ__LAYOUT_KV), STEPQ_EINVAL);
            assert_non_null(strstr(stepq_last_error(), stride_fields[f].name));
        }
        a = p.a;
        a.dtype = STEPQ_DTYPE_FP16;
        assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_ENOTSUP);
        assert_non_null(strstr(stepq_last_error(), "dtype fp16 is not supported (fp32, bf16)"));
        assert_int_equal(stepq__ref_prefill_chunked(&a, 4, s, STEPQ__LAYOUT_KV), STEPQ_ENOTSUP);
        a.dtype = (stepq_dtype)7;
        assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_ENOTSUP);
        assert_non_null(strstr(stepq_last_error(), "dtype 7"));
        a = p.a;
        a.param_dtype = STEPQ_DTYPE_FP16;
        assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_ENOTSUP);
        assert_non_null(strstr(stepq_last_error(), "param_dtype fp16 is not supported"));
        assert_memory_equal(s, ref, sizeof(float) * n);
        for (size_t e = 0; e < sizeof(float) * B * HV * DV; e++)
            assert_int_equal(((const uint8_t *)p.o)[e], 0xA5);
        for (int b = 0; b < B + 1; b++)
            assert_int_equal(health[b], 0);

        /* exactly the packed lengths: the packed default */
        float *s2 = states_new(B + 1, HV, DK, DV, 5), o2[B * HV * DV];
        struct stepq__dense_states st2 = { s2, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
        a = p.a;
        for (int f = 0; f < 6; f++)
            *stride_field(&a, f) = packed[f];
        a.o = o2;
        assert_int_equal(stepq__ref_step_dense(&p.a, &st), STEPQ_OK);
        assert_int_equal(stepq__ref_step_dense(&a, &st2), STEPQ_OK);
        assert_memory_equal(s, s2, sizeof(float) * n);
        assert_memory_equal(p.o, o2, sizeof(o2));
        free(s2);
        free(s);
        free(ref);
        problem_free(&p);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(gdn_step_2x2_golden),
        cmocka_unit_test(kda_step_2x2_golden),
        cmocka_unit_test(in_kernel_gate_and_beta_sigmoid_match_precomputed),
        cmocka_unit_test(l2norm_and_default_scale_match_manual_normalisation),
        cmocka_unit_test(grouped_value_heads_read_their_qk_group),
        cmocka_unit_test(padding_slots_are_skipped),
        cmocka_unit_test(vk_layout_gives_the_transposed_kv_result),
        cmocka_unit_test(gdn_chunked_prefill_equals_token_recurrence_over_4096_tokens),
        cmocka_unit_test(kda_chunked_prefill_equals_token_recurrence_over_4096_tokens),
        cmocka_unit_test(chunked_prefill_in_one_chunk_and_vk_layout),
        cmocka_unit_test(step_rejects_bad_arguments_without_writing),
        cmocka_unit_test(non_finite_input_leaves_that_head_unchanged),
        cmocka_unit_test(non_finite_state_is_zeroed_and_flagged),
        cmocka_unit_test(overflowing_readout_is_written_as_zero_and_flagged),
        cmocka_unit_test(prefill_refuses_non_finite_input_and_keeps_state),
        cmocka_unit_test(dense_step_bf16_strided_views_equal_fp32_contiguous_on_rounded_inputs),
        cmocka_unit_test(
            chunked_prefill_bf16_strided_tokens_equal_fp32_contiguous_on_rounded_inputs),
        cmocka_unit_test(short_strides_and_fp16_are_rejected_without_writing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
