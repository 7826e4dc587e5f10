/*
 * Random recurrence inputs for the kernel tests: a step_args with owned
 * buffers. Gates are long-lived (retention close to 1) unless told otherwise.
 */
#ifndef STEPQ_TESTS_KERNELS_PROBLEM_H
#define STEPQ_TESTS_KERNELS_PROBLEM_H

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

#endif /* STEPQ_TESTS_KERNELS_PROBLEM_H */
