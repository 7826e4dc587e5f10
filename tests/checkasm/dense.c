/*
 * The dense step family: the baseline decode step on fp32 or bf16 dense
 * states (no pool: the CUDA entry stepq__cuda_step_dense(_ex), chosen by an
 * explicit argument, against the reference stepq__ref_step_dense), over one
 * step and over many steps of the same requests, in both state layouts, on
 * fp32 inputs or bf16 strided views with the in-kernel gate, on the shipped
 * and on the thread-per-column kernels. States and tensors carry guard bytes. The poisoned
 * cases start with a NaN and an Inf in two heads' states and a NaN in one request's q, and
 * compare every slot's health word and the four counters with the reference's.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda.h"
#include "tests/checkasm/checkasm.h"
#include "tests/checkasm/compare.h"

/* Magnitude of the random start states. */
#define AMP 0.1f
/* fp32 states after up to 1024 steps: rounding accumulates, relative error (RMS) at most this. */
#define TOL_F32_STATE_REL 1e-5
/*
 * bf16 states: each side rounds its own fp32 update; relative error (RMS)
 * at most this, at most TOL_BF16_STATE_OFF of the elements differing, each
 * within 2^-8 of its head's largest magnitude plus one ulp of the element (a
 * tiny element left by cancellation may differ by several of its own ulps).
 */
#define TOL_BF16_STATE_REL       1e-2
#define TOL_BF16_STATE_OFF       0.01
#define TOL_BF16_STATE_HEAD_LOG2 (-8)

struct params {
    stepq_arch arch;
    stepq__layout layout;
    int H, HV, batch, steps;
    int bf16;   /* bf16 states */
    int view;   /* bf16 strided inputs with the in-kernel gate */
    int column; /* STEPQ__CUDA_COLUMN: bf16 states on the column kernel */
    int poison; /* NaN, Inf start elements and a NaN in q; health and counters compared */
    int sat;    /* bf16: one element driven past bf16's largest finite value (SATURATED) */
};

static int start(const struct params *p)
{
    return checkasm_check(
        "dense %s %s states %s H=%d HV=%d B=%d %d step%s%s%s%s%s", stepq_arch_name(p->arch),
        p->bf16 ? "bf16" : "fp32", p->layout == STEPQ__LAYOUT_KV ? "[K,V]" : "[V,K]", p->H, p->HV,
        p->batch, p->steps, p->steps > 1 ? "s" : "", p->view ? " bf16 strided in-kernel gate" : "",
        p->column ? " column kernel" : "", p->poison ? " NaN/Inf states, NaN in q" : "",
        p->sat ? " saturating bf16 store" : "");
}

struct launch {
    const struct stepq__step_args *a;
    void *states;
    size_t stride;
    stepq__layout layout;
    int bf16, column;
};

/* The fp32 [.] shipped path through stepq__cuda_step_dense, the others through _ex. */
static int launch_new(void *ctx)
{
    const struct launch *c = ctx;
    if (!c->bf16 && !c->column) {
        const struct stepq__dense_states st = { c->states, c->stride, c->layout };
        return stepq__cuda_step_dense(c->a, &st);
    }
    return stepq__cuda_step_dense_ex(c->a, c->states, c->stride, c->layout,
                                     c->bf16 ? STEPQ_DTYPE_BF16 : STEPQ_DTYPE_FP32,
                                     c->column ? STEPQ__CUDA_COLUMN : 0);
}

/* bf16 states, CUDA (g16) vs the reference's fp32 S rounded (see TOL_BF16_STATE_*); Sg: widened. */
/* A finite fp32 value as the GPU stores it in a bf16 state: nearest even, saturating to the
 * largest finite bf16 (kernels/cuda/cuda.h); NaN and Inf as they are. */
static uint16_t bf16_sat(float x)
{
    const uint16_t h = stepq__bf16_from_float(x);
    return isfinite(x) && (h & 0x7fffu) == 0x7f80u ? (uint16_t)((h & 0x8000u) | 0x7f7fu) : h;
}

static int compare_bf16_states(const uint16_t *g16, const float *S, float *Sg, size_t n)
{
    const size_t head = (size_t)FX_D * FX_D;
    size_t off = 0;
    for (size_t h0 = 0; h0 < n; h0 += head) {
        double mx = 0;
        for (size_t e = h0; e < h0 + head; e++)
            mx = fmax(mx, fabs((double)S[e]));
        for (size_t e = h0; e < h0 + head; e++) {
            const uint16_t rb = bf16_sat(S[e]);
            const double ga = stepq__bf16_to_float(g16[e]), gb = stepq__bf16_to_float(rb);
            const double ulp = ldexp(1.0, ilogb(gb == 0 ? 1e-38 : gb) - 7);
            Sg[e] = (float)ga;
            off += g16[e] != rb;
            CA_CHECK(fabs(ga - gb) <= ldexp(mx, TOL_BF16_STATE_HEAD_LOG2) + ulp,
                     "element %zu: bf16 0x%04x vs 0x%04x (%g vs %g, head max %g)", e, g16[e], rb,
                     ga, gb, mx);
        }
    }
    CA_CHECK((double)off <= TOL_BF16_STATE_OFF * (double)n,
             "%zu of %zu bf16 elements differ (> %g)", off, n, TOL_BF16_STATE_OFF);
    return 0;
}

static int run(const struct params *p)
{
    const int n_slots = p->batch + 2;
    const size_t stride = (size_t)p->HV * FX_D * FX_D, n = stride * (size_t)n_slots;
    const unsigned flags =
        STEPQ_STEP_L2NORM | (p->view ? STEPQ_STEP_GATE_IN_KERNEL | STEPQ_STEP_BETA_SIGMOID : 0);
    struct fx_rng *rng = checkasm_rng();
    struct fx_inputs in = { 0 };
    struct fx_step_io hio = { 0 }, dio = { 0 };
    struct fx_buf hS = { 0 }, dS = { 0 }, dh = { 0 };
    uint32_t *hh = NULL, *hg = NULL; /* poison: the health words, reference and CUDA */
    float *S = malloc(sizeof(float) * n), *Sg = malloc(sizeof(float) * n);
    uint16_t *S16 = malloc(2 * n);
    int32_t *slots0 = malloc(sizeof(int32_t) * (size_t)p->batch);
    void *o_got = NULL, *o_ref = NULL;
    stepq_step_args ah, ad;
    struct stepq__step_args ka, kd;
    double worst = 0, e = 0;
    char what[160];
    int rc = 0, ret;

    CA_TRY(S && Sg && S16 && slots0, "out of memory");
    for (size_t i = 0; i < n; i++) {
        S[i] = AMP * fx_nrand(rng);
        S16[i] = stepq__bf16_from_float(S[i]);
        if (p->bf16)
            S[i] = stepq__bf16_to_float(S16[i]);
    }
    CA_OK(fx_buf_alloc(&hS, sizeof(float) * n, 0));
    CA_OK(fx_buf_alloc(&dS, (p->bf16 ? 2 : 4) * n, 1));
    CA_OK(fx_buf_set(&hS, S));
    CA_OK(fx_buf_set(&dS, p->bf16 ? (const void *)S16 : S));
    CA_OK(fx_inputs_alloc(&in, p->arch, p->batch, p->H, p->HV));
    CA_OK(fx_inputs_gen(&in, n_slots, p->view, rng));
    memcpy(slots0, in.slots, sizeof(int32_t) * (size_t)p->batch);
    if (p->poison) {
        /* request 1's head 0: a NaN at (5, 7); request 2's last head: +Inf at (100, 3) */
        const float bad[2] = { NAN, INFINITY };
        const size_t at[2] = { 5 * FX_D + 7, 100 * FX_D + 3 };
        for (int i = 0; i < 2; i++) {
            CA_TRY(p->batch > 2 && in.slots[1 + i] >= 0, "poison: request %d is padding", 1 + i);
            const size_t h = (size_t)in.slots[1 + i] * stride +
                             (size_t)(i ? p->HV - 1 : 0) * FX_D * FX_D + at[i];
            S[h] = bad[i];
            S16[h] = stepq__bf16_from_float(bad[i]);
        }
        CA_OK(fx_buf_set(&hS, S));
        CA_OK(fx_buf_set(&dS, p->bf16 ? (const void *)S16 : S));
        in.q[0] = NAN; /* request 0's q head 0: its value heads keep their states */
        hh = calloc((size_t)n_slots, sizeof(uint32_t));
        hg = malloc(sizeof(uint32_t) * (size_t)n_slots);
        CA_TRY(hh && hg, "out of memory");
        CA_OK(fx_buf_alloc(&dh, sizeof(uint32_t) * (size_t)n_slots, 1));
        CA_OK(fx_buf_set(&dh, hh));
    }
    if (p->sat) {
        /*
         * Request 1, value head 0, column 9: rows 3 and 70 start at bf16's largest finite value
         * M, k is (e_3 - e_70) / sqrt(2) after the l2norm, the decay 1 and beta 1, so S^T k = 0,
         * u = v = 1.4e36 and row 3 becomes M + 9.9e35 = 3.3994e38: finite in fp32 and past
         * 3.3961e38, where bf16 rounds to Inf, so the GPU stores M and raises SATURATED; row 70
         * becomes M - 9.9e35.
         */
        const int b = 1, hq = 0, j = 9, r3 = 3, r70 = 70;
        CA_TRY(p->bf16 && !p->view && p->steps == 1 && p->batch > 1 && in.slots[b] >= 0,
               "sat: needs bf16 states, one step, raw gates and request 1 live");
        const float M = stepq__bf16_to_float(0x7f7f);
        const int rows[2] = { r3, r70 };
        for (int i = 0; i < 2; i++) {
            const size_t at = (size_t)in.slots[b] * stride + (p->layout == STEPQ__LAYOUT_KV
                                                                  ? (size_t)rows[i] * FX_D + j
                                                                  : (size_t)j * FX_D + rows[i]);
            S[at] = M;
            S16[at] = 0x7f7f;
        }
        CA_OK(fx_buf_set(&hS, S));
        CA_OK(fx_buf_set(&dS, S16));
        float *k = in.k + ((size_t)b * p->H + hq) * FX_D;
        for (int i = 0; i < FX_D; i++)
            k[i] = i == r3 ? 1.0f : i == r70 ? -1.0f : 0.0f;
        in.v[((size_t)b * p->HV + 0) * FX_D + j] = 1.4e36f;
        for (int i = 0; i < in.ng; i++)
            in.g[((size_t)b * p->HV + 0) * in.ng + i] = 0.0f;
        in.beta[(size_t)b * p->HV + 0] = 1.0f;
        hh = calloc((size_t)n_slots, sizeof(uint32_t));
        hg = malloc(sizeof(uint32_t) * (size_t)n_slots);
        CA_TRY(hh && hg, "out of memory");
        CA_OK(fx_buf_alloc(&dh, sizeof(uint32_t) * (size_t)n_slots, 1));
        CA_OK(fx_buf_set(&dh, hh));
    }
    CA_OK(fx_step_io_init(&hio, &in, p->view, 0));
    CA_OK(fx_step_io_init(&dio, &in, p->view, 1));
    o_got = malloc(hio.o.bytes);
    o_ref = malloc(hio.o.bytes);
    CA_TRY(o_got && o_ref, "out of memory");
    fx_step_io_args(&hio, flags, &ah);
    fx_step_io_args(&dio, flags, &ad);
    fx_dense_kernel_args(p->arch, p->H, p->HV, n_slots, &ah, NULL, &ka);
    fx_dense_kernel_args(p->arch, p->H, p->HV, n_slots, &ad, NULL, &kd);
    ka.health = hh;
    kd.health = dh.p;
    const struct stepq__dense_states st = { hS.p, stride, p->layout };
    struct launch lc = { &kd, dS.p, stride, p->layout, p->bf16, p->column };

    for (int t = 0; t < p->steps; t++) {
        if (t > 0) {
            /* new inputs for the same requests */
            CA_OK(fx_inputs_gen(&in, n_slots, p->view, rng));
            memcpy(in.slots, slots0, sizeof(int32_t) * (size_t)p->batch);
            CA_OK(fx_step_io_set(&hio, &in));
            CA_OK(fx_step_io_set(&dio, &in));
        }
        /* call_ref, call_new */
        CA_OK(stepq__ref_step_dense(&ka, &st));
        if (p->bf16) { /* the GPU stores the updated state as bf16 */
            float *h = hS.p;
            for (size_t i = 0; i < n; i++)
                h[i] = stepq__bf16_to_float(bf16_sat(h[i]));
        }
        CA_OK(launch_new(&lc));
        if (t == 0 || t == p->steps - 1) {
            CA_OK(fx_buf_get(&dio.o, o_got));
            CA_OK(fx_buf_get(&hio.o, o_ref));
            if (ca_compare_o(&hio, o_got, o_ref, in.slots, &e)) {
                rc = 1;
                goto out;
            }
            worst = fmax(worst, e);
        }
    }
    const struct fx_step_io *io[2] = { &hio, &dio };
    for (int i = 0; i < 2; i++) {
        ret = fx_step_io_check(io[i], what, sizeof(what));
        CA_TRY(ret == 0, "%s", ret < 0 ? stepq_last_error() : what);
    }
    if (p->poison) {
        uint64_t cr[STEPQ__HEALTH_NCOUNTS], cg[STEPQ__HEALTH_NCOUNTS];
        CA_OK(fx_buf_get(&dh, hg));
        CA_OK(fx_buf_get(&hio.counts, cr));
        CA_OK(fx_buf_get(&dio.counts, cg));
        for (int s = 0; s < n_slots; s++)
            CA_TRY(hg[s] == hh[s], "slot %d: health 0x%x, reference 0x%x", s, hg[s], hh[s]);
        for (int i = 0; i < STEPQ__HEALTH_NCOUNTS; i++)
            CA_TRY(cg[i] == cr[i], "counter %d: %llu, reference %llu", i, (unsigned long long)cg[i],
                   (unsigned long long)cr[i]);
        /* the counters restart with each step's inputs: the poison is the first step's */
        CA_TRY(p->steps > 1 || (cr[0] > 0 && cr[1] >= 2),
               "poison: the reference counted input %llu, state %llu", (unsigned long long)cr[0],
               (unsigned long long)cr[1]);
        CA_TRY((hh[in.slots[1]] & STEPQ_HEALTH_STATE) && (hh[slots0[0]] & STEPQ_HEALTH_INPUT),
               "poison: the reference flagged slot %d 0x%x, slot %d 0x%x", in.slots[1],
               hh[in.slots[1]], slots0[0], hh[slots0[0]]);
        checkasm_note("health of %d slots and counters (%llu input, %llu state) as the reference's",
                      n_slots, (unsigned long long)cr[0], (unsigned long long)cr[1]);
    }
    if (p->sat) {
        /* the fp32 reference does not saturate: only the GPU's word and counter say it */
        uint64_t cg[STEPQ__HEALTH_NCOUNTS];
        CA_OK(fx_buf_get(&dh, hg));
        CA_OK(fx_buf_get(&dio.counts, cg));
        for (int s = 0; s < n_slots; s++)
            CA_TRY(!!(hg[s] & STEPQ_HEALTH_SATURATED) == (s == slots0[1]),
                   "sat: slot %d health 0x%x (the saturating slot is %d)", s, hg[s], slots0[1]);
        CA_TRY(cg[2] == 1, "sat: saturated counter %llu, want 1", (unsigned long long)cg[2]);
        checkasm_note("SATURATED on slot %d only, counted once", slots0[1]);
    }
    int64_t bad;
    CA_OK(fx_buf_compare(&hS, 1, &bad));
    CA_TRY(bad < 0, "host states: guard byte %lld changed", (long long)bad - FX_GUARD);
    CA_OK(fx_buf_compare(&dS, 1, &bad));
    CA_TRY(bad < 0, "device states: guard byte %lld changed", (long long)bad - FX_GUARD);
    memcpy(S, hS.p, sizeof(float) * n);
    if (p->bf16) {
        CA_OK(fx_buf_get(&dS, S16));
        if (compare_bf16_states(S16, S, Sg, n)) {
            rc = 1;
            goto out;
        }
    } else {
        CA_OK(fx_buf_get(&dS, Sg));
    }
    const double rel = sqrt(ca_nmse(Sg, S, n)),
                 lim = p->bf16 ? TOL_BF16_STATE_REL : TOL_F32_STATE_REL;
    CA_TRY(rel <= lim, "state relative error %g (> %g)", rel, lim);
    if (p->view)
        checkasm_note("state relative error %.3g", rel);
    else
        checkasm_note("state relative error %.3g, output NMSE %.3g", rel, worst);
    if (checkasm_benchmarking())
        rc = checkasm_bench(launch_new, &lc, NULL);
out:
    fx_step_io_free(&hio);
    fx_step_io_free(&dio);
    fx_inputs_free(&in);
    fx_buf_free(&hS);
    fx_buf_free(&dS);
    fx_buf_free(&dh);
    free(hh);
    free(hg);
    free(S);
    free(Sg);
    free(S16);
    free(slots0);
    free(o_got);
    free(o_ref);
    return rc;
}

static void one(struct params p)
{
    if (start(&p))
        checkasm_report(run(&p));
}

/* The dense entry's refusal: its status and a message naming the entry. */
static int refused_entry(int got, int want, const char *what)
{
    return ca_expect_refused_entry(got, want, "cuda step (dense)", what);
}

/* The dense entry's own checks (no pool stands before it): status, message, states unchanged. */
static int run_bad_entry(void)
{
    enum { H = 1, HV = 2, B = 4, NS = B + 2 };
    const size_t stride = (size_t)HV * FX_D * FX_D;
    struct fx_rng *rng = checkasm_rng();
    struct fx_inputs in = { 0 };
    struct fx_step_io dio = { 0 };
    struct fx_buf dS = { 0 };
    stepq_step_args ad;
    struct stepq__step_args a, x;
    int rc = 0, n = 0;
    int64_t bad;

    CA_OK(fx_inputs_alloc(&in, STEPQ_ARCH_GDN, B, H, HV));
    CA_OK(fx_inputs_gen(&in, NS, 0, rng));
    CA_OK(fx_step_io_init(&dio, &in, 0, 1));
    CA_OK(fx_buf_alloc(&dS, 4 * stride * NS, 1));
    fx_step_io_args(&dio, STEPQ_STEP_L2NORM, &ad);
    fx_dense_kernel_args(STEPQ_ARCH_GDN, H, HV, NS, &ad, NULL, &a);
    const stepq__layout KV = STEPQ__LAYOUT_KV;
    const stepq_dtype F32 = STEPQ_DTYPE_FP32;
    const struct {
        const char *what;
        int status;
        size_t stride;
        stepq__layout layout;
        stepq_dtype dtype;
        unsigned flags;
    } cases[] = {
        { "n_slots 0", STEPQ_EINVAL, stride, KV, F32, 0 },
        { "d_k 64", STEPQ_ENOTSUP, stride, KV, F32, 0 },
        { "slot ids NULL", STEPQ_EINVAL, stride, KV, F32, 0 },
        { "slot stride short", STEPQ_EINVAL, stride / 2, KV, F32, 0 },
        { "layout 2", STEPQ_EINVAL, stride, (stepq__layout)2, F32, 0 },
        { "state dtype fp16", STEPQ_ENOTSUP, stride, KV, STEPQ_DTYPE_FP16, 0 },
        { "flags 2", STEPQ_EINVAL, stride, KV, F32, 2 },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        x = a;
        if (i == 0)
            x.n_slots = 0;
        else if (i == 1)
            x.d_k = 64;
        else if (i == 2)
            x.slots = NULL;
        if ((rc =
                 refused_entry(stepq__cuda_step_dense_ex(&x, dS.p, cases[i].stride, cases[i].layout,
                                                         cases[i].dtype, cases[i].flags),
                               cases[i].status, cases[i].what)))
            goto out;
        n++;
    }
    const struct stepq__dense_states none = { NULL, stride, KV };
    if ((rc = refused_entry(stepq__cuda_step_dense(&a, &none), STEPQ_EINVAL, "states NULL")))
        goto out;
    n++;
    CA_OK(fx_buf_compare(&dS, 0, &bad));
    CA_TRY(bad < 0, "a refused call wrote the states (byte %lld)", (long long)bad - FX_GUARD);
    CA_OK(fx_buf_compare(&dio.o, 0, &bad));
    CA_TRY(bad < 0, "a refused call wrote o (byte %lld)", (long long)bad - FX_GUARD);
    checkasm_note("%d refused calls: each its status and a message naming the entry, nothing"
                  " written",
                  n);
out:
    fx_step_io_free(&dio);
    fx_inputs_free(&in);
    fx_buf_free(&dS);
    return rc;
}

void checkasm_check_dense(void)
{
    const stepq_arch G = STEPQ_ARCH_GDN, K = STEPQ_ARCH_KDA;
    const stepq__layout KV = STEPQ__LAYOUT_KV, VK = STEPQ__LAYOUT_VK;
    const int small = checkasm_small(), B = small ? 3 : 12, T = small ? 16 : 1024;

    one((struct params){ .arch = G, .layout = KV, .H = 2, .HV = 4, .batch = B, .steps = 1 });
    one((struct params){ .arch = K, .layout = VK, .H = 2, .HV = 2, .batch = B, .steps = 1 });
    one((struct params){
        .arch = G, .layout = VK, .H = 2, .HV = 4, .batch = B, .steps = 1, .bf16 = 1 });
    one((struct params){
        .arch = K, .layout = KV, .H = 2, .HV = 2, .batch = B, .steps = 1, .bf16 = 1 });
    one((struct params){
        .arch = G, .layout = VK, .H = 2, .HV = 4, .batch = B, .steps = 4, .view = 1 });
    one((struct params){
        .arch = K, .layout = KV, .H = 2, .HV = 2, .batch = B, .steps = 4, .view = 1 });
    one((struct params){
        .arch = G, .layout = KV, .H = 2, .HV = 4, .batch = B, .steps = 1, .bf16 = 1, .view = 1 });
    /* the fp32 recurrence over many steps */
    one((struct params){ .arch = G, .layout = VK, .H = 1, .HV = 2, .batch = 2, .steps = T });
    one((struct params){ .arch = K, .layout = KV, .H = 1, .HV = 1, .batch = 2, .steps = T });
    /* NaN and Inf in the states, a NaN input: health words and counters as the reference's */
    one((struct params){
        .arch = G, .layout = KV, .H = 2, .HV = 4, .batch = B, .steps = 1, .poison = 1 });
    one((struct params){
        .arch = K, .layout = VK, .H = 2, .HV = 2, .batch = B, .steps = 2, .poison = 1 });
    one((struct params){ .arch = G,
                         .layout = KV,
                         .H = 2,
                         .HV = 4,
                         .batch = B,
                         .steps = 1,
                         .bf16 = 1,
                         .view = 1,
                         .poison = 1 });
    one((struct params){
        .arch = K, .layout = VK, .H = 2, .HV = 2, .batch = B, .steps = 1, .bf16 = 1, .poison = 1 });
    /* a bf16 store past bf16's range saturates, SATURATED raised (the warp kernel) */
    one((struct params){
        .arch = G, .layout = KV, .H = 2, .HV = 4, .batch = B, .steps = 1, .bf16 = 1, .sat = 1 });
    one((struct params){
        .arch = K, .layout = VK, .H = 2, .HV = 2, .batch = B, .steps = 1, .bf16 = 1, .sat = 1 });
    /* the thread-per-column kernel for bf16 states (fp32 states always run there) */
    one((struct params){
        .arch = G, .layout = KV, .H = 2, .HV = 4, .batch = B, .steps = 1, .bf16 = 1, .column = 1 });

    if (checkasm_check("dense invalid arguments (dense step entry)"))
        checkasm_report(run_bad_entry());
}
