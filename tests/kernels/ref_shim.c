/*
 * A test-only shared library exposing the fp32 reference recurrence and, in
 * CUDA builds, the CUDA dense fp32 decode step with plain C types, for
 * tests/kernels/check_vs_transformers.py (ctypes). Not installed; not part
 * of the library's API.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/dsp.h"
#include "plugin/err.h"
#include "tests/kernels/problem.h"

#include "stepq_config.h"
#if STEPQ_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda.h"
#include "plugin/cuda_err.h"
#endif

#define SHIM_API __attribute__((visibility("default")))

SHIM_API int stepq_ref_shim_run(int arch, int B, int T, int H, int HV, int d_k, int d_v,
                                const float *q, const float *k, const float *v, const float *g,
                                const float *beta, const float *A_log, const float *dt_bias,
                                int l2norm, float scale, int gate_in_kernel, int beta_sigmoid,
                                int chunk, float *state, float *o);
SHIM_API int stepq_ref_shim_run_cuda(int arch, int B, int T, int H, int HV, int d_k, int d_v,
                                     const float *q, const float *k, const float *v, const float *g,
                                     const float *beta, const float *A_log, const float *dt_bias,
                                     int l2norm, float scale, int gate_in_kernel, int beta_sigmoid,
                                     int chunk, float *state, float *o);
SHIM_API int stepq_ref_shim_has_cuda(void);
SHIM_API const char *stepq_ref_shim_last_error(void);

/* The step arguments both paths share (tensors, batch and slots are set by the caller). */
static void shim_args(struct stepq__step_args *a, int arch, int H, int HV, int d_k, int d_v,
                      const float *A_log, const float *dt_bias, int l2norm, float scale,
                      int gate_in_kernel, int beta_sigmoid)
{
    memset(a, 0, sizeof(*a));
    a->arch = (stepq_arch)arch;
    a->H = H;
    a->HV = HV;
    a->d_k = d_k;
    a->d_v = d_v;
    a->A_log = A_log;
    a->dt_bias = dt_bias;
    a->opt.l2norm = l2norm;
    a->opt.scale = scale;
    a->opt.gate_in_kernel = gate_in_kernel;
    a->opt.beta_sigmoid = beta_sigmoid;
}

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

    shim_args(&a, arch, H, HV, d_k, d_v, A_log, dt_bias, l2norm, scale, gate_in_kernel,
              beta_sigmoid);

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

/* 1 in a CUDA build with a usable device, else 0. */
int stepq_ref_shim_has_cuda(void)
{
#if STEPQ_HAVE_CUDA
    return stepq__cuda_device_count() > 0;
#else
    return 0;
#endif
}

#if STEPQ_HAVE_CUDA
/* A CUDA failure of step `what` as stepq__cuda_error's status, its message naming the shim. */
static int cuda_fail(cudaError_t e, const char *what)
{
    char msg[128];
    snprintf(msg, sizeof(msg), "shim (cuda): %s", what);
    return stepq__cuda_error(NULL, (int)e, msg);
}

/* [B][T][n] -> [T][B][n], so that token t of every request is one [B][n] slice. */
static void token_major(float *dst, const float *src, int B, int T, size_t n)
{
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            memcpy(dst + ((size_t)t * B + b) * n, src + ((size_t)b * T + t) * n, sizeof(float) * n);
}

/* Device copy of a host array (n floats); NULL stays NULL. */
static cudaError_t dev_copy(float **d, const float *h, size_t n)
{
    *d = NULL;
    if (!h)
        return cudaSuccess;
    cudaError_t e = cudaMalloc((void **)d, sizeof(float) * n);
    if (e == cudaSuccess)
        e = cudaMemcpy(*d, h, sizeof(float) * n, cudaMemcpyHostToDevice);
    return e;
}
#endif

/*
 * The decode path of stepq_ref_shim_run (same arguments and layouts; chunk
 * must be 0) through the CUDA dense fp32 step, stepq__cuda_step_dense: the
 * inputs are copied to the device once in token-major order, the states
 * ([B][HV][d_k][d_v], layout [K,V], slot b = request b) stay on the device
 * for all T steps, and o and the final states come back at the end.
 * Returns STEPQ_ENODEV without a device (or in a build without CUDA),
 * STEPQ_ENOTSUP unless d_k = d_v = 128, STEPQ_ECUDA (or STEPQ_ENODEV, see
 * stepq__cuda_error) on a runtime error.
 */
int stepq_ref_shim_run_cuda(int arch, int B, int T, int H, int HV, int d_k, int d_v, const float *q,
                            const float *k, const float *v, const float *g, const float *beta,
                            const float *A_log, const float *dt_bias, int l2norm, float scale,
                            int gate_in_kernel, int beta_sigmoid, int chunk, float *state, float *o)
{
#if STEPQ_HAVE_CUDA
    if (chunk != 0)
        return stepq__error(STEPQ_EINVAL, "shim (cuda): chunk must be 0 (decode), got %d", chunk);
    if (B < 1 || T < 1 || H < 1 || HV < 1 || HV % H)
        return stepq__error(STEPQ_EINVAL, "shim (cuda): bad shape B=%d T=%d H=%d HV=%d", B, T, H,
                            HV);
    if (d_k != STEPQ__CUDA_HEAD_DIM || d_v != STEPQ__CUDA_HEAD_DIM)
        return stepq__error(STEPQ_ENOTSUP, "shim (cuda): d_k = %d, d_v = %d (only %d)", d_k, d_v,
                            STEPQ__CUDA_HEAD_DIM);
    if (stepq__cuda_device_count() < 1)
        return stepq__error(STEPQ_ENODEV, "shim (cuda): no CUDA device");

    int n_g = arch == STEPQ_ARCH_KDA ? d_k : 1;
    size_t sq = (size_t)H * d_k, sv = (size_t)HV * d_v, sg = (size_t)HV * n_g;
    size_t n_tok = (size_t)B * T, n_state = (size_t)B * HV * d_k * d_v;
    const float *src[5] = { q, k, v, g, beta };
    size_t width[5] = { sq, sq, sv, sg, (size_t)HV };
    float *host[5] = { 0 }, *dev[5] = { 0 };
    float *d_A = NULL, *d_dt = NULL, *d_o = NULL, *d_S = NULL, *h_o = NULL;
    int32_t *d_slots = NULL, *slots = malloc(sizeof(int32_t) * B);
    cudaError_t e = cudaSuccess;
    const char *what = "";
    int rc = STEPQ_OK;

    h_o = malloc(sizeof(float) * n_tok * sv);
    for (int i = 0; i < 5; i++)
        host[i] = malloc(sizeof(float) * n_tok * width[i]);
    if (!slots || !h_o || !host[0] || !host[1] || !host[2] || !host[3] || !host[4]) {
        rc = stepq__error(STEPQ_ENOMEM, "shim (cuda): out of memory");
        goto out;
    }
    for (int b = 0; b < B; b++)
        slots[b] = b;
    for (int i = 0; i < 5; i++) {
        token_major(host[i], src[i], B, T, width[i]);
        what = "inputs to the device";
        if ((e = dev_copy(&dev[i], host[i], n_tok * width[i])) != cudaSuccess)
            goto cuda_err;
    }
    what = "gate parameters to the device";
    if ((e = dev_copy(&d_A, gate_in_kernel ? A_log : NULL, (size_t)HV)) != cudaSuccess ||
        (e = dev_copy(&d_dt, gate_in_kernel ? dt_bias : NULL, sg)) != cudaSuccess)
        goto cuda_err;
    what = "states to the device";
    if ((e = dev_copy(&d_S, state, n_state)) != cudaSuccess)
        goto cuda_err;
    what = "slot ids to the device";
    if ((e = cudaMalloc((void **)&d_slots, sizeof(int32_t) * B)) != cudaSuccess ||
        (e = cudaMemcpy(d_slots, slots, sizeof(int32_t) * B, cudaMemcpyHostToDevice)) !=
            cudaSuccess)
        goto cuda_err;
    what = "output allocation";
    if ((e = cudaMalloc((void **)&d_o, sizeof(float) * n_tok * sv)) != cudaSuccess)
        goto cuda_err;

    struct stepq__step_args a;
    shim_args(&a, arch, H, HV, d_k, d_v, d_A, d_dt, l2norm, scale, gate_in_kernel, beta_sigmoid);
    a.batch = B;
    a.n_slots = B;
    a.slots = d_slots;
    a.stream = NULL; /* legacy default stream: the steps run in order */
    struct stepq__dense_states st = { d_S, (size_t)HV * d_k * d_v, STEPQ__LAYOUT_KV };
    for (int t = 0; t < T; t++) {
        size_t r = (size_t)t * B;
        step_args_set_tensors(&a, dev[0] + r * sq, dev[1] + r * sq, dev[2] + r * sv,
                              dev[3] + r * sg, dev[4] + r * HV, d_o + r * sv);
        if ((rc = stepq__cuda_step_dense(&a, &st)) < 0)
            goto out;
    }
    what = "the decode steps";
    if ((e = cudaDeviceSynchronize()) != cudaSuccess)
        goto cuda_err;
    what = "results to the host";
    if ((e = cudaMemcpy(h_o, d_o, sizeof(float) * n_tok * sv, cudaMemcpyDeviceToHost)) !=
            cudaSuccess ||
        (e = cudaMemcpy(state, d_S, sizeof(float) * n_state, cudaMemcpyDeviceToHost)) !=
            cudaSuccess)
        goto cuda_err;
    /* [T][B][HV][d_v] back to [B][T][HV][d_v] */
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            memcpy(o + ((size_t)b * T + t) * sv, h_o + ((size_t)t * B + b) * sv,
                   sizeof(float) * sv);
    goto out;

cuda_err:
    rc = cuda_fail(e, what);
out:
    for (int i = 0; i < 5; i++) {
        cudaFree(dev[i]);
        free(host[i]);
    }
    cudaFree(d_A);
    cudaFree(d_dt);
    cudaFree(d_S);
    cudaFree(d_o);
    cudaFree(d_slots);
    free(slots);
    free(h_o);
    return rc;
#else
    return stepq__error(STEPQ_ENODEV, "shim (cuda): built without CUDA");
#endif
}

const char *stepq_ref_shim_last_error(void)
{
    return stepq_last_error();
}
