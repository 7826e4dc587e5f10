/*
 * A small shared library (not installed, not API) that lets tools/scripts/nll_eval.py
 * store a model's recurrent states through a precision map: every head of a
 * batch of dense fp32 states [n][HV][d_k][d_v] is packed into a pool's pages
 * and reconstructed in place, through the public step API as a server does
 * (stepq_pool_prefill_pack, then stepq_pool_prefill_unpack):
 *   - host memory: one host-backend pool per worker thread, each packing and
 *     unpacking its share of the batch (the reference kernels, all cores);
 *   - device memory (CUDA builds): one CUDA-backend pool whose slots 1..n hold
 *     the batch.
 * The Python side checks the CUDA path against the CPU one before trusting it.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant.h"
#include "plugin/err.h"
#include "stepq/stepq.h"
#include "tools/calib/calib.h"

#include "stepq_config.h"
#if STEPQ_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define SHIM_API __attribute__((visibility("default")))

/* One pool and the ids of its slots 1..n (device memory for the CUDA pool). */
struct shim_pool {
    stepq_pool_t *pool;
    int n;
    int32_t *ids;
};

struct shim {
    stepq_map_t *map;
    stepq_model_shape sh;
    int threads;
    struct shim_pool *host; /* [threads], opened at the first CPU roundtrip, grown on demand */
    struct shim_pool cuda;  /* the CUDA path (n = 0: not opened) */
};

SHIM_API int stepq_shim_open(const char *map_path, int threads, void **out);
SHIM_API int stepq_shim_layer_index(void *h, int model_layer);
SHIM_API int stepq_shim_shape(void *h, int out[5]);
SHIM_API int stepq_shim_bits_per_value(void *h, double *out);
SHIM_API int stepq_shim_roundtrip(void *h, int layer_index, float *states, int n);
SHIM_API void stepq_shim_close(void *h);
SHIM_API int stepq_shim_set_row_split(double alpha);
SHIM_API void stepq_shim_clear_row_split(void);
SHIM_API int stepq_shim_row_split(void *h, double *out);
SHIM_API const char *stepq_shim_last_error(void);
SHIM_API int stepq_shim_cuda_open(void *h, int max_n);
SHIM_API int stepq_shim_cuda_roundtrip(void *h, int layer_index, float *dev_states, int n,
                                       void *stream);

static void pool_close(struct shim_pool *p, int device)
{
    if (p->pool)
        stepq_pool_close(p->pool, STEPQ_POOL_CLOSE_FORCE);
#if STEPQ_HAVE_CUDA
    if (device && p->ids)
        cudaFree(p->ids);
#endif
    if (!device)
        free(p->ids);
    memset(p, 0, sizeof(*p));
}

/* A pool of n slots on backend be, all allocated (a fresh pool hands out 1..n). */
static int pool_open(struct shim *s, struct shim_pool *p, int n, stepq_pool_backend be)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    int rc;

    memset(p, 0, sizeof(*p));
    if (!ids)
        return stepq__error(STEPQ_ENOMEM, "shim: out of memory");
    cfg.map = s->map;
    cfg.backend = be;
    cfg.num_slots = n;
    cfg.policy = STEPQ_POOL_POLICY_NO_CACHE;
    rc = stepq_pool_open(&cfg, &p->pool);
    if (rc >= 0)
        rc = stepq_pool_alloc(p->pool, n, ids);
    p->n = n;
    if (rc >= 0 && be == STEPQ_POOL_BACKEND_HOST) {
        p->ids = ids;
        return STEPQ_OK;
    }
#if STEPQ_HAVE_CUDA
    if (rc >= 0 && (cudaMalloc((void **)&p->ids, sizeof(int32_t) * (size_t)n) != cudaSuccess ||
                    cudaMemcpy(p->ids, ids, sizeof(int32_t) * (size_t)n, cudaMemcpyHostToDevice) !=
                        cudaSuccess)) {
        cudaGetLastError();
        rc = stepq__error(STEPQ_ECUDA, "shim: slot list upload failed");
    }
#endif
    free(ids);
    if (rc < 0)
        pool_close(p, be == STEPQ_POOL_BACKEND_CUDA);
    return rc;
}

/* Packs n entries of states into slots 1..n of p's layer, then reconstructs them in place. */
static int pool_roundtrip(struct shim_pool *p, int layer, float *states, int n, void *stream)
{
    stepq_prefill_args a = STEPQ_PREFILL_ARGS_INITIALIZER;
    int rc;

    a.n = n;
    a.slot_ids = p->ids;
    a.states = states;
    a.layout = STEPQ_STATE_LAYOUT_KV;
    rc = stepq_pool_prefill_pack(p->pool, layer, &a, stream);
    if (rc >= 0)
        rc = stepq_pool_prefill_unpack(p->pool, layer, &a, stream);
    return rc;
}

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
    s->threads = threads > 0 ? threads : stepq__calib_default_threads();
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
    int li, n, per_worker;
    float *x;
    atomic_int rc; /* a failure of any worker (the last one stored), else 0 */
};

static void rt_job(void *vctx, int job, int worker)
{
    (void)worker;
    struct rt *r = vctx;
    const size_t per = (size_t)r->s->sh.num_v_heads * r->s->sh.head_k_dim * r->s->sh.head_v_dim;
    const int first = job * r->per_worker;
    const int n = r->n - first < r->per_worker ? r->n - first : r->per_worker;
    if (n <= 0)
        return;
    int rc = pool_roundtrip(&r->s->host[job], r->li, r->x + (size_t)first * per, n, NULL);
    if (rc < 0)
        atomic_store(&r->rc, rc);
}

int stepq_shim_roundtrip(void *h, int layer_index, float *states, int n)
{
    struct shim *s = h;
    if (!s || layer_index < 0 || layer_index >= s->sh.n_layers || n < 0 || !states)
        return stepq__error(STEPQ_EINVAL, "shim: bad layer index %d or n %d", layer_index, n);
    if (n == 0)
        return STEPQ_OK;
    const int workers = n < s->threads ? n : s->threads;
    const int per_worker = (n + workers - 1) / workers;
    if (!s->host) {
        s->host = calloc((size_t)s->threads, sizeof(*s->host));
        if (!s->host)
            return stepq__error(STEPQ_ENOMEM, "shim: out of memory");
    }
    /* Worker w packs entries [w * per_worker, ...) through its own pool. */
    for (int w = 0; w < workers; w++) {
        if (s->host[w].n >= per_worker)
            continue;
        pool_close(&s->host[w], 0);
        int rc = pool_open(s, &s->host[w], per_worker, STEPQ_POOL_BACKEND_HOST);
        if (rc < 0)
            return rc;
    }
    struct rt r = { s, layer_index, n, per_worker, states, 0 };
    stepq__calib_parallel(workers, workers, rt_job, &r, NULL);
    return atomic_load(&r.rc);
}

int stepq_shim_cuda_open(void *h, int max_n)
{
    struct shim *s = h;
#if STEPQ_HAVE_CUDA
    if (!s || max_n < 1)
        return stepq__error(STEPQ_EINVAL, "shim: CUDA path needs n >= 1");
    pool_close(&s->cuda, 1);
    int rc = pool_open(s, &s->cuda, max_n, STEPQ_POOL_BACKEND_CUDA);
    /* A pool whose kernels cannot run the map (e.g. a row_split other than 0.5) opens but
     * refuses its transfers: say so here, so the caller takes the CPU path. */
    stepq_prefill_args a = STEPQ_PREFILL_ARGS_INITIALIZER;
    a.n = max_n;
    if (rc >= 0 && ((rc = stepq_pool_supports(s->cuda.pool, STEPQ_OP_PREFILL_PACK, -1, &a)) < 0 ||
                    (rc = stepq_pool_supports(s->cuda.pool, STEPQ_OP_PREFILL_UNPACK, -1, &a)) < 0))
        pool_close(&s->cuda, 1);
    return rc;
#else
    (void)s;
    (void)max_n;
    return stepq__error(STEPQ_ENOTSUP, "shim: built without CUDA");
#endif
}

int stepq_shim_cuda_roundtrip(void *h, int layer_index, float *dev_states, int n, void *stream)
{
    struct shim *s = h;
    if (!s || !s->cuda.n || n < 0 || n > s->cuda.n)
        return stepq__error(STEPQ_EINVAL, "shim: CUDA roundtrip: n %d (opened for %d)", n,
                            s ? s->cuda.n : 0);
    return pool_roundtrip(&s->cuda, layer_index, dev_states, n, stream);
}

void stepq_shim_close(void *h)
{
    struct shim *s = h;
    if (!s)
        return;
    for (int w = 0; s->host && w < s->threads; w++)
        pool_close(&s->host[w], 0);
    free(s->host);
    pool_close(&s->cuda, 1);
    stepq_map_close(s->map);
    free(s);
}

/* The analysis override of the dual-axis fit's row split (kernels/quant.h): the C reference
 * then fits with alpha in place of the map's row_split. The CUDA roundtrip fits with each
 * map's own row_split and never sees the override, so set it only for the host path. */
int stepq_shim_set_row_split(double alpha)
{
    return stepq__quant_set_row_split(alpha);
}

void stepq_shim_clear_row_split(void)
{
    stepq__quant_clear_row_split();
}

/* The row split the host roundtrip fits this map's dual-axis heads with: the override when
 * set, else the map's row_split (0.5 unless the map says otherwise). */
int stepq_shim_row_split(void *h, double *out)
{
    const struct shim *s = h;
    if (!s || !out)
        return stepq__error(STEPQ_EINVAL, "shim: NULL handle or output");
    *out = stepq__quant_row_split_or(stepq_map_row_split(s->map));
    return STEPQ_OK;
}

const char *stepq_shim_last_error(void)
{
    return stepq_last_error();
}
