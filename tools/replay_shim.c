/*
 * A small shared library (not installed, not API) that lets tools/nll_eval.py
 * store a model's recurrent states through a precision map: quantize +
 * reconstruct every head of a batch of dense fp32 states [n][HV][d_k][d_v] in
 * place, either with the C reference quantizers on all CPU cores (host
 * memory), or, in CUDA builds, with the library's CUDA pack / unpack kernels
 * on device memory (pages of slots 1..n of a private pool per layer). The
 * Python side checks the CUDA path against the CPU one before trusting it.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/dsp.h"
#include "kernels/quant.h"
#include "plugin/err.h"
#include "stepq/stepq.h"
#include "tools/calib.h"

#include "stepq_config.h"
#if STEPQ_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda.h"
#endif

#define SHIM_API __attribute__((visibility("default")))

struct cuda_layer_state {
    struct stepq_head_layout *hl;
    size_t *off;
    float *w;
    struct stepq__packed_layer pl;
    void *cl; /* stepq__cuda_layer */
};

struct shim {
    stepq_map_t *map;
    stepq_model_shape sh;
    int threads;
    int cuda_n; /* slots available to the CUDA path (0: not opened) */
    struct cuda_layer_state *cu;
    int32_t *dslots; /* device: 1..cuda_n */
};

SHIM_API int stepq_shim_open(const char *map_path, int threads, void **out);
SHIM_API int stepq_shim_layer_index(void *h, int model_layer);
SHIM_API int stepq_shim_shape(void *h, int out[5]);
SHIM_API int stepq_shim_bits_per_value(void *h, double *out);
SHIM_API int stepq_shim_roundtrip(void *h, int layer_index, float *states, int n);
SHIM_API void stepq_shim_close(void *h);
SHIM_API const char *stepq_shim_last_error(void);
SHIM_API int stepq_shim_cuda_open(void *h, int max_n);
SHIM_API int stepq_shim_cuda_roundtrip(void *h, int layer_index, float *dev_states, int n,
                                       void *stream);

int stepq_shim_open(const char *map_path, int threads, void **out)
{
    struct shim *s = calloc(1, sizeof(*s));
    *out = NULL;
    if (!s)
        return stepq__error(STEPQ_ENOMEM, "shim: out of memory");
    int rc = stepq_map_load_file(map_path, NULL, &s->map);
    if (rc < 0) {
        free(s);
        return rc;
    }
    stepq_map_shape(s->map, &s->sh);
    s->threads = threads > 0 ? threads : sq_default_threads();
    *out = s;
    return STEPQ_OK;
}

int stepq_shim_layer_index(void *h, int model_layer)
{
    return stepq_map_layer_index(((struct shim *)h)->map, model_layer);
}

/* The state shape the map was made for, so that the caller can check its tensors against it
 * (the roundtrips trust n * HV * d_k * d_v floats): out = {n_layers, HV, d_k, d_v, is_kda}. */
int stepq_shim_shape(void *h, int out[5])
{
    const struct shim *s = h;
    if (!s || !out)
        return stepq__error(STEPQ_EINVAL, "shim: NULL handle or output");
    out[0] = s->sh.n_layers;
    out[1] = s->sh.num_v_heads;
    out[2] = s->sh.head_k_dim;
    out[3] = s->sh.head_v_dim;
    out[4] = s->sh.arch == STEPQ_ARCH_KDA;
    return STEPQ_OK;
}

/* The map's compact bits per state value, from the library's accounting (config/SCHEMA.md). */
int stepq_shim_bits_per_value(void *h, double *out)
{
    const struct shim *s = h;
    stepq_map_memory mem;
    if (!s || !out)
        return stepq__error(STEPQ_EINVAL, "shim: NULL handle or output");
    int rc = stepq_map_memory_info(s->map, &mem);
    if (rc < 0)
        return rc;
    *out = mem.bits_per_value;
    return STEPQ_OK;
}

struct rt {
    struct shim *s;
    int li;
    float *x;
    atomic_int rc; /* a failure of any worker (the last one stored), else 0 */
};

static void rt_job(void *vctx, int job, int worker)
{
    (void)worker;
    struct rt *r = vctx;
    const stepq_model_shape *sh = &r->s->sh;
    int HV = sh->num_v_heads, K = sh->head_k_dim, V = sh->head_v_dim, hv = job % HV;
    int kda = sh->arch == STEPQ_ARCH_KDA;
    stepq_method meth = stepq_map_method(r->s->map);
    uint8_t rb[STEPQ__MAX_HEAD_DIM];
    const float *w = NULL;
    if (!stepq_method_is_dense(meth)) {
        sq_map_row_bits(r->s->map, r->li, hv, K, kda, rb);
        w = stepq_map_row_impact(r->s->map, r->li, hv);
    }
    struct sq_quant qz;
    int rc = sq_quant_init(&qz, meth, sh->arch, K, V, stepq_method_is_dense(meth) ? NULL : rb, w);
    if (rc < 0) {
        atomic_store(&r->rc, rc);
        return;
    }
    sq_quant_apply(&qz, r->x + (size_t)job * K * V);
    sq_quant_free(&qz);
}

int stepq_shim_roundtrip(void *h, int layer_index, float *states, int n)
{
    struct shim *s = h;
    if (!s || layer_index < 0 || layer_index >= s->sh.n_layers || n < 0 || !states)
        return stepq__error(STEPQ_EINVAL, "shim: bad layer index %d or n %d", layer_index, n);
    struct rt r = { s, layer_index, states, 0 };
    sq_parallel(n * s->sh.num_v_heads, s->threads, rt_job, &r, NULL);
    return atomic_load(&r.rc);
}

#if STEPQ_HAVE_CUDA
static void cuda_free_all(struct shim *s)
{
    if (!s->cu)
        return;
    for (int l = 0; l < s->sh.n_layers; l++) {
        struct cuda_layer_state *c = &s->cu[l];
        if (c->cl)
            stepq__cuda_layer_release(c->cl);
        if (c->pl.base)
            cudaFree(c->pl.base);
        if (c->hl)
            for (int h = 0; h < s->sh.num_v_heads; h++)
                stepq__head_layout_free(&c->hl[h]);
        free(c->hl);
        free(c->off);
        free(c->w);
    }
    free(s->cu);
    s->cu = NULL;
    if (s->dslots)
        cudaFree(s->dslots);
    s->dslots = NULL;
    s->cuda_n = 0;
}
#endif

int stepq_shim_cuda_open(void *h, int max_n)
{
    struct shim *s = h;
#if STEPQ_HAVE_CUDA
    const stepq_model_shape *sh = &s->sh;
    int HV = sh->num_v_heads, K = sh->head_k_dim, V = sh->head_v_dim;
    int kda = sh->arch == STEPQ_ARCH_KDA;
    stepq_method meth = stepq_map_method(s->map);
    if (max_n < 1 || stepq_method_is_dense(meth))
        return stepq__error(STEPQ_EINVAL, "shim: CUDA path needs a quantized map and n >= 1");
    if (stepq__cuda_device_count() < 1)
        return stepq__error(STEPQ_ENODEV, "shim: no CUDA device");
    cuda_free_all(s);
    s->cu = calloc((size_t)sh->n_layers, sizeof(*s->cu));
    if (!s->cu)
        return stepq__error(STEPQ_ENOMEM, "shim: out of memory");
    int rc = STEPQ_OK;
    for (int l = 0; l < sh->n_layers && rc >= 0; l++) {
        struct cuda_layer_state *c = &s->cu[l];
        c->hl = calloc((size_t)HV, sizeof(*c->hl));
        c->off = calloc((size_t)HV, sizeof(size_t));
        c->w = malloc(sizeof(float) * (size_t)HV * K);
        if (!c->hl || !c->off || !c->w) {
            rc = stepq__error(STEPQ_ENOMEM, "shim: out of memory");
            break;
        }
        size_t pos = 0;
        for (int hv = 0; hv < HV && rc >= 0; hv++) {
            uint8_t rb[STEPQ__MAX_HEAD_DIM];
            sq_map_row_bits(s->map, l, hv, K, kda, rb);
            rc = stepq__head_layout_init(&c->hl[hv], meth, sh->arch, K, V, rb, 16);
            c->off[hv] = pos;
            pos += c->hl[hv].block_bytes;
            const float *w = stepq_map_row_impact(s->map, l, hv);
            for (int i = 0; i < K; i++)
                c->w[(size_t)hv * K + i] = w ? w[i] : 1.0f;
        }
        if (rc < 0)
            break;
        c->pl.page_stride = (pos + 15) & ~(size_t)15;
        c->pl.n_slots = max_n + 1;
        c->pl.n_heads = HV;
        c->pl.heads = c->hl;
        c->pl.head_offset = c->off;
        c->pl.row_impact = stepq__method_uses_row_impact(meth) ? c->w : NULL;
        void *base = NULL;
        if (cudaMalloc(&base, c->pl.page_stride * (size_t)(max_n + 1)) != cudaSuccess) {
            cudaGetLastError();
            rc = stepq__error(STEPQ_ECUDA, "shim: cudaMalloc of the pages failed");
            break;
        }
        c->pl.base = base;
        stepq__cuda_layer *cl = NULL;
        rc = stepq__cuda_layer_prepare(&c->pl, &cl);
        c->cl = cl;
    }
    if (rc >= 0) {
        int32_t *slots = malloc(sizeof(int32_t) * (size_t)max_n);
        if (!slots)
            rc = stepq__error(STEPQ_ENOMEM, "shim: out of memory");
        for (int i = 0; slots && i < max_n; i++)
            slots[i] = i + 1;
        if (rc >= 0 &&
            (cudaMalloc((void **)&s->dslots, sizeof(int32_t) * (size_t)max_n) != cudaSuccess ||
             cudaMemcpy(s->dslots, slots, sizeof(int32_t) * (size_t)max_n,
                        cudaMemcpyHostToDevice) != cudaSuccess)) {
            cudaGetLastError();
            rc = stepq__error(STEPQ_ECUDA, "shim: slot list upload failed");
        }
        free(slots);
    }
    if (rc < 0) {
        cuda_free_all(s);
        return rc;
    }
    s->cuda_n = max_n;
    return STEPQ_OK;
#else
    (void)s;
    (void)max_n;
    return stepq__error(STEPQ_ENOTSUP, "shim: built without CUDA");
#endif
}

int stepq_shim_cuda_roundtrip(void *h, int layer_index, float *dev_states, int n, void *stream)
{
    struct shim *s = h;
#if STEPQ_HAVE_CUDA
    if (!s->cuda_n || layer_index < 0 || layer_index >= s->sh.n_layers || n < 0 || n > s->cuda_n ||
        !dev_states)
        return stepq__error(STEPQ_EINVAL, "shim: CUDA roundtrip: bad layer %d or n %d (max %d)",
                            layer_index, n, s->cuda_n);
    struct cuda_layer_state *c = &s->cu[layer_index];
    size_t stride = (size_t)s->sh.num_v_heads * s->sh.head_k_dim * s->sh.head_v_dim;
    int rc = stepq__cuda_pack_prepared(&c->pl, c->cl, n, s->dslots, dev_states, stride,
                                       STEPQ__LAYOUT_KV, STEPQ_DTYPE_FP32, NULL, NULL, stream);
    if (rc >= 0)
        rc = stepq__cuda_unpack_prepared(&c->pl, c->cl, n, s->dslots, dev_states, stride,
                                         STEPQ__LAYOUT_KV, STEPQ_DTYPE_FP32, stream);
    return rc;
#else
    (void)s;
    (void)layer_index;
    (void)dev_states;
    (void)n;
    (void)stream;
    return stepq__error(STEPQ_ENOTSUP, "shim: built without CUDA");
#endif
}

void stepq_shim_close(void *h)
{
    struct shim *s = h;
    if (!s)
        return;
#if STEPQ_HAVE_CUDA
    cuda_free_all(s);
#endif
    stepq_map_close(s->map);
    free(s);
}

const char *stepq_shim_last_error(void)
{
    return stepq_last_error();
}
