/*
 * A small shared library (not installed, not API) that lets tools/nll_eval.py
 * store a model's recurrent states through a precision map with the C
 * reference quantizers: quantize + reconstruct every head of a batch of
 * dense fp32 states [n][HV][d_k][d_v] in place, on all CPU cores.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/quant.h"
#include "plugin/err.h"
#include "stepq/stepq.h"
#include "tools/calib.h"

#define SHIM_API __attribute__((visibility("default")))

struct shim {
    stepq_map_t *map;
    stepq_model_shape sh;
    int threads;
};

SHIM_API int stepq_shim_open(const char *map_path, int threads, void **out);
SHIM_API int stepq_shim_layer_index(void *h, int model_layer);
SHIM_API int stepq_shim_roundtrip(void *h, int layer_index, float *states, int n);
SHIM_API void stepq_shim_close(void *h);
SHIM_API const char *stepq_shim_last_error(void);

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

struct rt {
    struct shim *s;
    int li;
    float *x;
    int rc;
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
        const uint8_t *lb = stepq_map_layer_bits(r->s->map, r->li);
        for (int i = 0; i < K; i++)
            rb[i] = kda ? lb[hv * K + i] : lb[hv];
        w = stepq_map_row_impact(r->s->map, r->li, hv);
    }
    struct sq_quant qz;
    int rc = sq_quant_init(&qz, meth, sh->arch, K, V, stepq_method_is_dense(meth) ? NULL : rb, w);
    if (rc < 0) {
        r->rc = rc;
        return;
    }
    sq_quant_apply(&qz, r->x + (size_t)job * K * V);
    sq_quant_free(&qz);
}

int stepq_shim_roundtrip(void *h, int layer_index, float *states, int n)
{
    struct shim *s = h;
    if (layer_index < 0 || layer_index >= s->sh.n_layers || n < 0 || !states)
        return stepq__error(STEPQ_EINVAL, "shim: bad layer index %d or n %d", layer_index, n);
    struct rt r = { s, layer_index, states, 0 };
    sq_parallel(n * s->sh.num_v_heads, s->threads, rt_job, &r, NULL);
    return r.rc;
}

void stepq_shim_close(void *h)
{
    struct shim *s = h;
    if (!s)
        return;
    stepq_map_close(s->map);
    free(s);
}

const char *stepq_shim_last_error(void)
{
    return stepq_last_error();
}
