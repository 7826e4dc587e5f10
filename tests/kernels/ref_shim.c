/*
 * A test-only shared library exposing the fp32 reference recurrence with
 * plain C types, for tests/kernels/check_vs_transformers.py (ctypes). Not
 * installed; not part of the library's API.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/dsp.h"
#include "plugin/err.h"
#include "tests/kernels/problem.h"

#define SHIM_API __attribute__((visibility("default")))

SHIM_API int stepq_ref_shim_run(int arch, int B, int T, int H, int HV, int d_k, int d_v,
                                const float *q, const float *k, const float *v, const float *g,
                                const float *beta, const float *A_log, const float *dt_bias,
                                int l2norm, float scale, int gate_in_kernel, int beta_sigmoid,
                                int chunk, float *state, float *o);
SHIM_API const char *stepq_ref_shim_last_error(void);

/*
 * Runs B requests of T tokens. Inputs are laid out as transformers takes
 * them: q, k [B][T][H][d_k], v [B][T][HV][d_v], g [B][T][HV] (GDN) or
 * [B][T][HV][d_k] (KDA), beta [B][T][HV]; state [B][HV][d_k][d_v] in/out;
 * o [B][T][HV][d_v]. chunk == 0: token by token through the decode step
 * (all B requests in one batch per token); chunk > 0: the chunked prefill
 * reference per request.
 */
int stepq_ref_shim_run(int arch, int B, int T, int H, int HV, int d_k, int d_v, const float *q,
                       const float *k, const float *v, const float *g, const float *beta,
                       const float *A_log, const float *dt_bias, int l2norm, float scale,
                       int gate_in_kernel, int beta_sigmoid, int chunk, float *state, float *o)
{
    int n_g = arch == STEPQ_ARCH_KDA ? d_k : 1;
    size_t sq = (size_t)H * d_k, sv = (size_t)HV * d_v, sg = (size_t)HV * n_g;
    struct stepq__step_args a;

    memset(&a, 0, sizeof(a));
    a.arch = (stepq_arch)arch;
    a.H = H;
    a.HV = HV;
    a.d_k = d_k;
    a.d_v = d_v;
    a.A_log = A_log;
    a.dt_bias = dt_bias;
    a.opt.l2norm = l2norm;
    a.opt.scale = scale;
    a.opt.gate_in_kernel = gate_in_kernel;
    a.opt.beta_sigmoid = beta_sigmoid;

    if (chunk > 0) {
        a.batch = T;
        for (int b = 0; b < B; b++) {
            step_args_set_tensors(&a, q + (size_t)b * T * sq, k + (size_t)b * T * sq,
                                  v + (size_t)b * T * sv, g + (size_t)b * T * sg,
                                  beta + (size_t)b * T * HV, o + (size_t)b * T * sv);
            int rc = stepq__ref_prefill_chunked(&a, chunk, state + (size_t)b * HV * d_k * d_v,
                                                STEPQ__LAYOUT_KV);
            if (rc < 0)
                return rc;
        }
        return STEPQ_OK;
    }

    /* Decode: gather token t of every request into [B][...] buffers. */
    float *tq = malloc(sizeof(float) * B * sq), *tk = malloc(sizeof(float) * B * sq);
    float *tv = malloc(sizeof(float) * B * sv), *tg = malloc(sizeof(float) * B * sg);
    float *tb = malloc(sizeof(float) * B * HV), *to = malloc(sizeof(float) * B * sv);
    int32_t *slots = malloc(sizeof(int32_t) * B);
    int rc = STEPQ_OK;
    if (!tq || !tk || !tv || !tg || !tb || !to || !slots) {
        rc = stepq__error(STEPQ_ENOMEM, "shim: out of memory");
        goto out;
    }
    for (int b = 0; b < B; b++)
        slots[b] = b;
    a.batch = B;
    a.n_slots = B;
    a.slots = slots;
    step_args_set_tensors(&a, tq, tk, tv, tg, tb, to);
    struct stepq__dense_states st = { state, (size_t)HV * d_k * d_v, STEPQ__LAYOUT_KV };
    for (int t = 0; t < T && rc == STEPQ_OK; t++) {
        for (int b = 0; b < B; b++) {
            size_t bt = (size_t)b * T + t;
            memcpy(tq + b * sq, q + bt * sq, sizeof(float) * sq);
            memcpy(tk + b * sq, k + bt * sq, sizeof(float) * sq);
            memcpy(tv + b * sv, v + bt * sv, sizeof(float) * sv);
            memcpy(tg + b * sg, g + bt * sg, sizeof(float) * sg);
            memcpy(tb + b * HV, beta + bt * HV, sizeof(float) * HV);
        }
        rc = stepq__ref_step_dense(&a, &st);
        for (int b = 0; b < B && rc == STEPQ_OK; b++)
            memcpy(o + ((size_t)b * T + t) * sv, to + b * sv, sizeof(float) * sv);
    }
out:
    free(tq);
    free(tk);
    free(tv);
    free(tg);
    free(tb);
    free(to);
    free(slots);
    return rc;
}

const char *stepq_ref_shim_last_error(void)
{
    return stepq_last_error();
}
