/*
 * Random recurrence inputs for the kernel tests: a step_args with owned
 * buffers. Gates are long-lived (retention close to 1) unless told otherwise.
 */
#ifndef STEPQ_TESTS_KERNELS_PROBLEM_H
#define STEPQ_TESTS_KERNELS_PROBLEM_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/dsp.h"
#include "tests/kernels/util.h"

struct problem {
    struct stepq__step_args a;
    float *q, *k, *v, *g, *beta, *o;
    int32_t *slots;
};

/* Points a at the per-row tensors of a step: inputs q, k, v, g, beta and output o. */
static inline void step_args_set_tensors(struct stepq__step_args *a, const float *q, const float *k,
                                         const float *v, const float *g, const float *beta,
                                         float *o)
{
    a->q = q;
    a->k = k;
    a->v = v;
    a->g = g;
    a->beta = beta;
    a->o = o;
}

/* Allocates and fills inputs for n rows (requests of a step, or tokens of a prefill). */
static inline void problem_init(struct problem *p, stepq_arch arch, int n, int H, int HV, int d_k,
                                int d_v, uint64_t seed)
{
    uint64_t rng = seed;
    int n_g = arch == STEPQ_ARCH_KDA ? d_k : 1;

    memset(p, 0, sizeof(*p));
    p->q = malloc(sizeof(float) * (size_t)n * H * d_k);
    p->k = malloc(sizeof(float) * (size_t)n * H * d_k);
    p->v = malloc(sizeof(float) * (size_t)n * HV * d_v);
    p->g = malloc(sizeof(float) * (size_t)n * HV * n_g);
    p->beta = malloc(sizeof(float) * (size_t)n * HV);
    p->o = malloc(sizeof(float) * (size_t)n * HV * d_v);
    p->slots = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    rng_fill(&rng, p->q, (size_t)n * H * d_k, 1.0f);
    rng_fill(&rng, p->k, (size_t)n * H * d_k, 1.0f);
    rng_fill(&rng, p->v, (size_t)n * HV * d_v, 1.0f);
    for (size_t e = 0; e < (size_t)n * HV * n_g; e++)
        p->g[e] = -0.01f * rng_unit(&rng); /* half-lives of 70 tokens and more */
    for (size_t e = 0; e < (size_t)n * HV; e++)
        p->beta[e] = 0.05f + 0.9f * rng_unit(&rng);
    memset(p->o, 0, sizeof(float) * (size_t)n * HV * d_v);
    for (int b = 0; b < n; b++)
        p->slots[b] = b + 1;

    p->a.arch = arch;
    p->a.batch = n;
    p->a.H = H;
    p->a.HV = HV;
    p->a.d_k = d_k;
    p->a.d_v = d_v;
    p->a.n_slots = n + 1;
    p->a.slots = p->slots;
    step_args_set_tensors(&p->a, p->q, p->k, p->v, p->g, p->beta, p->o);
    p->a.opt.l2norm = 1;
}

static inline void problem_free(struct problem *p)
{
    free(p->q);
    free(p->k);
    free(p->v);
    free(p->g);
    free(p->beta);
    free(p->o);
    free(p->slots);
    memset(p, 0, sizeof(*p));
}

/* The same inputs shifted to token t of a prefill problem, as a one-request step. */
static inline struct stepq__step_args problem_token(const struct problem *p, int t, float *o,
                                                    const int32_t *slot)
{
    struct stepq__step_args a = p->a;
    int n_g = a.arch == STEPQ_ARCH_KDA ? a.d_k : 1;

    a.batch = 1;
    a.n_slots = 1;
    a.slots = slot;
    step_args_set_tensors(&a, p->q + (size_t)t * a.H * a.d_k, p->k + (size_t)t * a.H * a.d_k,
                          p->v + (size_t)t * a.HV * a.d_v, p->g + (size_t)t * a.HV * n_g,
                          p->beta + (size_t)t * a.HV, o);
    return a;
}

/* Stores x as element i of buf, of type dt (bf16: round to nearest even). */
static inline void elem_put(uint8_t *buf, stepq_dtype dt, size_t i, float x)
{
    if (dt == STEPQ_DTYPE_BF16) {
        uint16_t h = stepq__bf16_from_float(x);
        memcpy(buf + 2 * i, &h, 2);
    } else {
        memcpy(buf + 4 * i, &x, 4);
    }
}

/* x as an element of type dt holds it (bf16: rounded to nearest even). */
static inline float elem_round(stepq_dtype dt, float x)
{
    return dt == STEPQ_DTYPE_BF16 ? stepq__bf16_to_float(stepq__bf16_from_float(x)) : x;
}

#define VIEW_O_FILL 0xA5 /* bytes of o outside the written rows */

/*
 * A problem's tensors as a server hands them: elements of `dtype` (A_log,
 * dt_bias: `param_dtype`), q, k and v as views into one fused projection
 * row per request (q | k | v | 3 spare elements), g, beta and o in rows
 * longer than packed. Every input gap holds NaN and o starts as VIEW_O_FILL
 * bytes, so a read or a write outside the views shows (a NaN read makes
 * the head an input failure).
 */
struct server_view {
    stepq_dtype dtype, param_dtype;
    size_t qkv_stride, g_stride, beta_stride, o_stride;
    uint8_t *qkv, *g, *beta, *o, *A_log, *dt_bias;
    size_t o_bytes;
};

/* n elements of dt, all NaN: gaps that poison any read. */
static inline uint8_t *nan_buffer(stepq_dtype dt, size_t n)
{
    uint8_t *buf = malloc(n * stepq_dtype_size(dt) + 1);
    for (size_t i = 0; i < n; i++)
        elem_put(buf, dt, i, NAN);
    return buf;
}

/* Copies n rows of `len` packed floats into rows `stride` elements apart at buf + at. */
static inline void rows_put(uint8_t *buf, stepq_dtype dt, size_t stride, size_t at,
                            const float *src, int n, size_t len)
{
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < len; i++)
            elem_put(buf, dt, (size_t)r * stride + at + i, src[(size_t)r * len + i]);
}

/*
 * Builds the view of p (batch = its rows) and returns p->a pointing at it.
 * The problem's own tensors (and A_log, dt_bias when given, which p->a is
 * then meant to use with gate_in_kernel) are rounded to the view's types in
 * place, so that the fp32 contiguous p->a reads the very values of the view.
 */
static inline struct stepq__step_args server_view_init(struct server_view *w, struct problem *p,
                                                       stepq_dtype dtype, stepq_dtype param_dtype,
                                                       float *A_log, float *dt_bias)
{
    const struct stepq__step_args *a = &p->a;
    int n = a->batch, HV = a->HV, n_g = a->arch == STEPQ_ARCH_KDA ? a->d_k : 1;
    size_t nq = (size_t)a->H * a->d_k, nv = (size_t)HV * a->d_v, ng = (size_t)HV * n_g;
    size_t es = stepq_dtype_size(dtype);

    memset(w, 0, sizeof(*w));
    w->dtype = dtype;
    w->param_dtype = param_dtype;
    w->qkv_stride = 2 * nq + nv + 3;
    w->g_stride = ng + 5;
    w->beta_stride = (size_t)HV + 2;
    w->o_stride = nv + 7;
    for (size_t e = 0; e < (size_t)n * nq; e++) {
        p->q[e] = elem_round(dtype, p->q[e]);
        p->k[e] = elem_round(dtype, p->k[e]);
    }
    for (size_t e = 0; e < (size_t)n * nv; e++)
        p->v[e] = elem_round(dtype, p->v[e]);
    for (size_t e = 0; e < (size_t)n * ng; e++)
        p->g[e] = elem_round(dtype, p->g[e]);
    for (size_t e = 0; e < (size_t)n * HV; e++)
        p->beta[e] = elem_round(dtype, p->beta[e]);
    w->qkv = nan_buffer(dtype, (size_t)n * w->qkv_stride);
    w->g = nan_buffer(dtype, (size_t)n * w->g_stride);
    w->beta = nan_buffer(dtype, (size_t)n * w->beta_stride);
    rows_put(w->qkv, dtype, w->qkv_stride, 0, p->q, n, nq);
    rows_put(w->qkv, dtype, w->qkv_stride, nq, p->k, n, nq);
    rows_put(w->qkv, dtype, w->qkv_stride, 2 * nq, p->v, n, nv);
    rows_put(w->g, dtype, w->g_stride, 0, p->g, n, ng);
    rows_put(w->beta, dtype, w->beta_stride, 0, p->beta, n, (size_t)HV);
    w->o_bytes = (size_t)n * w->o_stride * es;
    w->o = malloc(w->o_bytes + 1);
    memset(w->o, VIEW_O_FILL, w->o_bytes);

    struct stepq__step_args v = *a;
    v.dtype = dtype;
    v.param_dtype = param_dtype;
    v.q = w->qkv;
    v.k = w->qkv + nq * es;
    v.v = w->qkv + 2 * nq * es;
    v.q_stride = v.k_stride = v.v_stride = w->qkv_stride;
    v.g = w->g;
    v.g_stride = w->g_stride;
    v.beta = w->beta;
    v.beta_stride = w->beta_stride;
    v.o = w->o;
    v.o_stride = w->o_stride;
    if (A_log && dt_bias) {
        for (int h = 0; h < HV; h++)
            A_log[h] = elem_round(param_dtype, A_log[h]);
        for (size_t e = 0; e < ng; e++)
            dt_bias[e] = elem_round(param_dtype, dt_bias[e]);
        w->A_log = nan_buffer(param_dtype, (size_t)HV);
        w->dt_bias = nan_buffer(param_dtype, ng);
        rows_put(w->A_log, param_dtype, 0, 0, A_log, 1, (size_t)HV);
        rows_put(w->dt_bias, param_dtype, 0, 0, dt_bias, 1, ng);
        v.A_log = w->A_log;
        v.dt_bias = w->dt_bias;
    }
    return v;
}

/*
 * Whether the view's o holds, row by row, the fp32 contiguous o_ref of the
 * same step converted to the view's dtype (bit for bit), with the gaps and
 * the rows of padding entries (slots[b] < 0; slots NULL: none) untouched.
 */
static inline int server_view_o_matches(const struct server_view *w, const float *o_ref,
                                        const int32_t *slots, int n, int HV, int d_v)
{
    size_t es = stepq_dtype_size(w->dtype), nv = (size_t)HV * d_v;
    uint8_t want[4];
    for (int b = 0; b < n; b++)
        for (size_t e = 0; e < w->o_stride; e++) {
            const uint8_t *got = w->o + ((size_t)b * w->o_stride + e) * es;
            if ((slots && slots[b] < 0) || e >= nv) {
                memset(want, VIEW_O_FILL, sizeof(want));
            } else {
                elem_put(want, w->dtype, 0, o_ref[(size_t)b * nv + e]);
            }
            if (memcmp(got, want, es))
                return 0;
        }
    return 1;
}

static inline void server_view_free(struct server_view *w)
{
    free(w->qkv);
    free(w->g);
    free(w->beta);
    free(w->o);
    free(w->A_log);
    free(w->dt_bias);
    memset(w, 0, sizeof(*w));
}

#endif /* STEPQ_TESTS_KERNELS_PROBLEM_H */
