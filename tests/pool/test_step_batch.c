/*
 * The decode step is batch-invariant, bit for bit: what a request gets from a step (its
 * output rows o, and its packed page after the step) does not depend on which other
 * requests share the batch, their order, the batch size or its padding. A server needs it
 * for continuous batching to give every request the tokens it would get alone.
 *
 * Per map: REQS requests, a slot each, go through STEPS decode steps of LAYERS layers on a
 * schedule as continuous batching makes one (a request joins with its prompt state packed,
 * sits steps out, leaves; batches of 1 to REQS requests in shuffled order, some padded with
 * -1 and sentinel entries as a CUDA-graph batch is). A request's inputs are a function of
 * (request, step, layer) only. A second pool on the same map runs every request alone
 * (batch 1, no padding, each prompt packed alone, the requests in another order and in
 * other slots). After every step each request's output rows, and then the pages of all
 * requests (stepq_pool_copy_to_host), must be bytewise those of the request alone; -1 rows
 * of o stay unwritten; at the end every health word is 0 and the stats say so.
 *
 * The controls show that the comparisons can fail: request CTRL_REQ alone once more, with one
 * ulp added to its beta of one head at step CTRL_STEP, layer 0, has the batched run's outputs
 * before that step and others there; one bit flipped in a request's page of the batched pool
 * is found as exactly that byte.
 *
 * Through the public API only, on one backend per run: `host` (the default: the C
 * reference) or `cuda` (tensors and slot lists in device memory, the pools on a
 * non-blocking stream; exits 77, skipped, without CUDA in the build or a device). The
 * heads are 128x128, as the CUDA kernels need.
 *
 *   meson test -C build 'pool step batch' 'pool step batch cuda' --print-errorlogs
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "stepq_config.h"
#include "tests/pool/cuda_device.h"

#include "stepq/stepq.h"
#include "tests/config/fixtures.h"

#if STEPQ_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define REQS      12         /* requests, a slot each */
#define SLOTS     (REQS + 2) /* two slots stay free */
#define STEPS     6
#define LAYERS    2
#define MAX_BATCH 16 /* the largest padded batch */
#define SHOWN     8  /* differences printed per map, of outputs and of pages */
#define CTRL_REQ  0
#define CTRL_STEP 2
#define POISON    0xa5 /* what o holds before a step */

/* Entries of a batch that are no request. */
#define ENT_PAD      (-1)
#define ENT_SENTINEL (-2)

/* Which steps a request decodes in (x); it joins, its prompt packed, at its first. */
static const char *const schedule[REQS] = {
    /* step 012345 */
    "xxxxxx", /* alone in the pool's first batch */
    ".xxxxx", /* */
    ".xxx..", /* leaves after step 3 */
    "..xxxx", /* */
    "..x...", /* one step */
    "..xx..", /* */
    "..x.xx", /* sits step 3 out */
    "..xx..", /* */
    "..xxxx", /* */
    "..x...", /* */
    "..xxxx", /* */
    ".xx..x", /* away for steps 3 and 4 */
};
/* Steps whose batch is padded up to the next power of two above it (at least one entry). */
static const int padded[STEPS] = { 0, 1, 0, 1, 0, 1 };

struct method_case {
    const char *name;
    stepq_arch arch;
    stepq_method method;
    double bits;
    int pivots;        /* temporal, stepq: fx_layout_exact's pivot units and width mix */
    stepq_dtype dtype; /* of q, k, v, g, beta and o */
    unsigned flags;    /* STEPQ_STEP_* */
};

#define GATE (STEPQ_STEP_L2NORM | STEPQ_STEP_GATE_IN_KERNEL | STEPQ_STEP_BETA_SIGMOID)
static struct method_case cases[] = {
    /* name, arch, method, bits, pivots, tensors, flags */
    { "gdn fp32", STEPQ_ARCH_GDN, STEPQ_METHOD_FP32, 32, 0, STEPQ_DTYPE_FP32, STEPQ_STEP_L2NORM },
    { "gdn bf16", STEPQ_ARCH_GDN, STEPQ_METHOD_BF16, 16, 0, STEPQ_DTYPE_FP32, STEPQ_STEP_L2NORM },
    { "gdn fp16", STEPQ_ARCH_GDN, STEPQ_METHOD_FP16, 16, 0, STEPQ_DTYPE_FP32, STEPQ_STEP_L2NORM },
    { "gdn fp8", STEPQ_ARCH_GDN, STEPQ_METHOD_FP8, 8, 0, STEPQ_DTYPE_FP32, STEPQ_STEP_L2NORM },
    { "gdn uniform@4", STEPQ_ARCH_GDN, STEPQ_METHOD_UNIFORM, 4, 0, STEPQ_DTYPE_FP32,
      STEPQ_STEP_L2NORM },
    { "gdn dsq@4", STEPQ_ARCH_GDN, STEPQ_METHOD_DSQ, 4, 0, STEPQ_DTYPE_FP32, STEPQ_STEP_L2NORM },
    { "gdn spatial@4", STEPQ_ARCH_GDN, STEPQ_METHOD_SPATIAL, 4, 0, STEPQ_DTYPE_FP32,
      STEPQ_STEP_L2NORM },
    { "gdn temporal@4", STEPQ_ARCH_GDN, STEPQ_METHOD_TEMPORAL, 4, 1, STEPQ_DTYPE_FP32,
      STEPQ_STEP_L2NORM },
    { "gdn stepq@4", STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 4, 1, STEPQ_DTYPE_FP32,
      STEPQ_STEP_L2NORM },
    { "gdn stepq@6", STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 6, 1, STEPQ_DTYPE_FP32,
      STEPQ_STEP_L2NORM },
    { "gdn stepq@6, bf16 tensors, gate in kernel", STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 6, 1,
      STEPQ_DTYPE_BF16, GATE },
    { "kda fp32", STEPQ_ARCH_KDA, STEPQ_METHOD_FP32, 32, 0, STEPQ_DTYPE_FP32, STEPQ_STEP_L2NORM },
    { "kda bf16", STEPQ_ARCH_KDA, STEPQ_METHOD_BF16, 16, 0, STEPQ_DTYPE_FP32, STEPQ_STEP_L2NORM },
    { "kda fp8", STEPQ_ARCH_KDA, STEPQ_METHOD_FP8, 8, 0, STEPQ_DTYPE_FP32, STEPQ_STEP_L2NORM },
    { "kda uniform@4", STEPQ_ARCH_KDA, STEPQ_METHOD_UNIFORM, 4, 0, STEPQ_DTYPE_FP32,
      STEPQ_STEP_L2NORM },
    { "kda stepq@4", STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 4, 2, STEPQ_DTYPE_FP32,
      STEPQ_STEP_L2NORM },
    { "kda stepq@6", STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 6, 2, STEPQ_DTYPE_FP32,
      STEPQ_STEP_L2NORM },
    { "kda stepq@4, bf16 tensors, gate in kernel", STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 4, 2,
      STEPQ_DTYPE_BF16, GATE },
};
#define N_CASES ((int)(sizeof(cases) / sizeof(cases[0])))

/* --- the backend's memory: host buffers, or device buffers on the pools' stream ------------ */

static int on_cuda;
#if STEPQ_HAVE_CUDA
static cudaStream_t stream;

static void cu(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        print_error("%s: %s\n", what, cudaGetErrorString(e));
        fail();
    }
}
#endif

static void *dev_alloc(size_t n)
{
    void *p = NULL;
#if STEPQ_HAVE_CUDA
    if (on_cuda) {
        cu(cudaMalloc(&p, n), "cudaMalloc");
        return p;
    }
#endif
    p = malloc(n);
    assert_non_null(p);
    return p;
}

static void dev_free(void *p)
{
#if STEPQ_HAVE_CUDA
    if (on_cuda) {
        cudaFree(p);
        return;
    }
#endif
    free(p);
}

/* Copies that have landed when they return (the stream synchronised). */
static void to_dev(void *dst, const void *src, size_t n)
{
#if STEPQ_HAVE_CUDA
    if (on_cuda) {
        cu(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream), "upload");
        cu(cudaStreamSynchronize(stream), "upload");
        return;
    }
#endif
    memcpy(dst, src, n);
}

static void from_dev(void *dst, const void *src, size_t n)
{
#if STEPQ_HAVE_CUDA
    if (on_cuda) {
        cu(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream), "download");
        cu(cudaStreamSynchronize(stream), "download");
        return;
    }
#endif
    memcpy(dst, src, n);
}

static void dev_fill(void *dst, int byte, size_t n)
{
#if STEPQ_HAVE_CUDA
    if (on_cuda) {
        cu(cudaMemsetAsync(dst, byte, n, stream), "memset");
        cu(cudaStreamSynchronize(stream), "memset");
        return;
    }
#endif
    memset(dst, byte, n);
}

/* --- maps, tensors, pools ----------------------------------------------------------------- */

struct ctx {
    const struct method_case *c;
    stepq_map_t *map;
    int H, HV, K, V, gk;
    size_t es;             /* bytes of a q..o element */
    size_t nq, nv, ng, nb; /* elements per request: q (and k), v (and o), g, beta */
    size_t per;            /* state elements per request and layer */
    size_t page;           /* page bytes */
    /* host staging for MAX_BATCH entries */
    uint8_t *q, *k, *v, *g, *beta, *o;
    float *A_log, *dt_bias, *dense; /* [LAYERS][HV], [LAYERS][HV][gk], [REQS][HV][K][V] */
    int32_t ids[MAX_BATCH];
    /* the backend's copies */
    uint8_t *dq, *dk, *dv, *dg, *dbeta, *d_o;
    float *dA_log, *ddt_bias, *ddense;
    int32_t *dids;
};

/* One pool, and what its steps gave each request. */
struct run {
    stepq_pool_t *pool;
    int32_t slot[REQS];
    uint8_t *o;     /* [REQS][STEPS][LAYERS] output rows as the steps wrote them */
    uint8_t *pages; /* [REQS] pages after the latest step */
};

static stepq_map_t *make_map(const struct method_case *c)
{
    stepq_model_shape s = fx_shape_small(c->arch); /* H 2, HV 4 */
    stepq_map_t *map = NULL;

    s.n_layers = LAYERS;
    s.head_k_dim = s.head_v_dim = 128; /* the CUDA kernels' heads */
    s.conv_shape[0] = 1024;
    s.conv_dtype = STEPQ_DTYPE_BF16;
    assert_int_equal(stepq_map_create(&s, c->method, c->bits, &map), STEPQ_OK);
    if (c->pivots)
        assert_int_equal(fx_layout_exact(map, (int)c->bits, c->pivots), STEPQ_OK);
    if (c->method == STEPQ_METHOD_SPATIAL || c->method == STEPQ_METHOD_STEPQ) {
        /* Row impact that is not all 1, so the fit's weights matter. */
        float w[128];
        for (int l = 0; l < LAYERS; l++)
            for (int h = 0; h < s.num_v_heads; h++) {
                double p = 0;
                for (int i = 0; i < 128; i++) {
                    w[i] = (float)(0.5 + (i * 7 + h + l) % 5 * 0.3);
                    p += log(w[i]);
                }
                for (int i = 0; i < 128; i++) /* geometric mean 1 */
                    w[i] = (float)(w[i] / exp(p / 128));
                assert_int_equal(stepq_map_set_row_impact(map, l, h, w), STEPQ_OK);
            }
    }
    assert_int_equal(stepq_map_validate(map), STEPQ_OK);
    return map;
}

static void *halloc(size_t n)
{
    void *p = calloc(1, n);
    assert_non_null(p);
    return p;
}

static void ctx_open(struct ctx *x, const struct method_case *c)
{
    stepq_model_shape s;
    unsigned long long r = 77;

    memset(x, 0, sizeof(*x));
    x->c = c;
    x->map = make_map(c);
    assert_int_equal(stepq_map_shape(x->map, &s), STEPQ_OK);
    x->H = s.num_k_heads, x->HV = s.num_v_heads, x->K = s.head_k_dim, x->V = s.head_v_dim;
    x->gk = c->arch == STEPQ_ARCH_KDA ? x->K : 1;
    x->es = stepq_dtype_size(c->dtype);
    x->nq = (size_t)x->H * x->K;
    x->nv = (size_t)x->HV * x->V;
    x->ng = (size_t)x->HV * x->gk;
    x->nb = (size_t)x->HV;
    x->per = (size_t)x->HV * x->K * x->V;
    x->q = halloc(MAX_BATCH * x->nq * x->es), x->k = halloc(MAX_BATCH * x->nq * x->es);
    x->v = halloc(MAX_BATCH * x->nv * x->es), x->o = halloc(MAX_BATCH * x->nv * x->es);
    x->g = halloc(MAX_BATCH * x->ng * x->es), x->beta = halloc(MAX_BATCH * x->nb * x->es);
    x->A_log = halloc(sizeof(float) * LAYERS * x->HV);
    x->dt_bias = halloc(sizeof(float) * LAYERS * x->ng);
    x->dense = halloc(sizeof(float) * REQS * x->per);
    x->dq = dev_alloc(MAX_BATCH * x->nq * x->es), x->dk = dev_alloc(MAX_BATCH * x->nq * x->es);
    x->dv = dev_alloc(MAX_BATCH * x->nv * x->es), x->d_o = dev_alloc(MAX_BATCH * x->nv * x->es);
    x->dg = dev_alloc(MAX_BATCH * x->ng * x->es), x->dbeta = dev_alloc(MAX_BATCH * x->nb * x->es);
    x->dA_log = dev_alloc(sizeof(float) * LAYERS * x->HV);
    x->ddt_bias = dev_alloc(sizeof(float) * LAYERS * x->ng);
    x->ddense = dev_alloc(sizeof(float) * REQS * x->per);
    x->dids = dev_alloc(sizeof(x->ids));
    /* The model's gate parameters (STEPQ_STEP_GATE_IN_KERNEL): one set per layer. */
    for (int i = 0; i < LAYERS * x->HV; i++)
        x->A_log[i] = (float)(fx_rand(&r) - 0.5);
    for (size_t i = 0; i < LAYERS * x->ng; i++)
        x->dt_bias[i] = (float)(fx_rand(&r) - 0.5);
    to_dev(x->dA_log, x->A_log, sizeof(float) * LAYERS * x->HV);
    to_dev(x->ddt_bias, x->dt_bias, sizeof(float) * LAYERS * x->ng);
}

static void ctx_close(struct ctx *x)
{
    free(x->q), free(x->k), free(x->v), free(x->o), free(x->g), free(x->beta);
    free(x->A_log), free(x->dt_bias), free(x->dense);
    dev_free(x->dq), dev_free(x->dk), dev_free(x->dv), dev_free(x->d_o), dev_free(x->dg);
    dev_free(x->dbeta), dev_free(x->dA_log), dev_free(x->ddt_bias), dev_free(x->ddense);
    dev_free(x->dids);
    stepq_map_close(x->map);
}

/*
 * A pool with every request in a slot. `other` puts request r in another slot than the
 * batched pool does: there a shuffled order of the ids left after two are freed, here the
 * ids of one alloc in reverse.
 */
static void run_open(struct ctx *x, struct run *R, int other)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    const stepq_pool_layout *l;
    int32_t all[SLOTS];

    memset(R, 0, sizeof(*R));
    cfg.map = x->map;
    cfg.num_slots = SLOTS;
#if STEPQ_HAVE_CUDA
    if (on_cuda) {
        cfg.backend = STEPQ_POOL_BACKEND_CUDA;
        cfg.stream = stream;
    }
#endif
    assert_int_equal(stepq_pool_open(&cfg, &R->pool), STEPQ_OK);
    assert_int_equal(stepq_pool_get_layout(R->pool, &l), STEPQ_OK);
    x->page = l->page_bytes;
    if (other) {
        assert_int_equal(stepq_pool_alloc(R->pool, REQS, all), STEPQ_OK);
        for (int r = 0; r < REQS; r++)
            R->slot[r] = all[REQS - 1 - r];
    } else {
        unsigned long long s = 5;
        assert_int_equal(stepq_pool_alloc(R->pool, SLOTS, all), STEPQ_OK);
        int32_t back[2] = { all[3], all[9] };
        assert_int_equal(stepq_pool_free(R->pool, back, 2), STEPQ_OK);
        int n = 0;
        for (int i = 0; i < SLOTS; i++)
            if (i != 3 && i != 9)
                R->slot[n++] = all[i];
        for (int i = REQS - 1; i > 0; i--) {
            int j = (int)(fx_rand(&s) * (i + 1));
            int32_t t = R->slot[i];
            R->slot[i] = R->slot[j], R->slot[j] = t;
        }
    }
    R->o = halloc((size_t)REQS * STEPS * LAYERS * x->nv * x->es);
    R->pages = halloc((size_t)REQS * x->page);
}

static void run_close(struct run *R)
{
    assert_int_equal(stepq_pool_close(R->pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    free(R->o);
    free(R->pages);
}

static uint8_t *o_row(const struct ctx *x, const struct run *R, int r, int t, int l)
{
    return R->o + (((size_t)r * STEPS + t) * LAYERS + l) * x->nv * x->es;
}

/* Element i of a q..o tensor, and the other way (a bf16 value is the top half of a float). */
static void put(const struct ctx *x, uint8_t *buf, size_t i, double value)
{
    float f = (float)value;
    uint32_t u;

    if (x->es == 4) {
        memcpy(buf + 4 * i, &f, 4);
        return;
    }
    memcpy(&u, &f, 4);
    uint16_t h = (uint16_t)(u >> 16); /* every bf16 value is an input */
    memcpy(buf + 2 * i, &h, 2);
}

static float get(const struct ctx *x, const uint8_t *buf, size_t i)
{
    uint32_t u = 0;
    float f;

    if (x->es == 4) {
        memcpy(&f, buf + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, buf + 2 * i, 2);
    u = (uint32_t)h << 16;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t bits_of(const struct ctx *x, const uint8_t *buf, size_t i)
{
    uint32_t u = 0;
    if (x->es == 4) {
        memcpy(&u, buf + 4 * i, 4);
    } else {
        uint16_t h;
        memcpy(&h, buf + 2 * i, 2);
        u = h;
    }
    return u;
}

/* Request r's inputs of step t, layer l, into entry e of the staging tensors. */
static void request_inputs(struct ctx *x, int e, int r, int t, int l)
{
    unsigned long long s = 1000003ull * (unsigned long long)(r + 1) + 1009ull * t + l;
    const int gate = !!(x->c->flags & STEPQ_STEP_GATE_IN_KERNEL);
    const int sig = !!(x->c->flags & STEPQ_STEP_BETA_SIGMOID);

    for (size_t i = 0; i < x->nq; i++) {
        put(x, x->q, e * x->nq + i, 2 * fx_rand(&s) - 1);
        put(x, x->k, e * x->nq + i, 2 * fx_rand(&s) - 1);
    }
    for (size_t i = 0; i < x->nv; i++)
        put(x, x->v, e * x->nv + i, 2 * fx_rand(&s) - 1);
    for (size_t i = 0; i < x->ng; i++) /* raw a, or log-space g: retention 0.58..0.95 */
        put(x, x->g, e * x->ng + i, gate ? 4 * fx_rand(&s) - 3 : -0.05 - 0.5 * fx_rand(&s));
    for (size_t i = 0; i < x->nb; i++)
        put(x, x->beta, e * x->nb + i, sig ? 4 * fx_rand(&s) - 2 : 0.2 + 0.6 * fx_rand(&s));
}

/* Request r's prompt state of layer l: rows of their own magnitude (0.02 .. 0.5). */
static void prompt_state(const struct ctx *x, float *dst, int r, int l)
{
    unsigned long long s = 7919ull * (unsigned long long)(r + 1) + l;

    for (int h = 0; h < x->HV; h++)
        for (int i = 0; i < x->K; i++) {
            const double a = 0.02 * pow(25.0, fx_rand(&s));
            float *row = dst + ((size_t)h * x->K + i) * x->V;
            for (int j = 0; j < x->V; j++)
                row[j] = (float)(a * (2 * fx_rand(&s) - 1));
        }
}

/* The prompts of requests reqs[0..n) packed in one call per layer. */
static void pack(struct ctx *x, struct run *R, const int *reqs, int n)
{
    if (!n)
        return;
    for (int e = 0; e < n; e++)
        x->ids[e] = R->slot[reqs[e]];
    to_dev(x->dids, x->ids, sizeof(int32_t) * n);
    for (int l = 0; l < LAYERS; l++) {
        for (int e = 0; e < n; e++)
            prompt_state(x, x->dense + e * x->per, reqs[e], l);
        to_dev(x->ddense, x->dense, sizeof(float) * n * x->per);
        stepq_prefill_args p = STEPQ_PREFILL_ARGS_INITIALIZER;
        p.n = n;
        p.slot_ids = x->dids;
        p.states = x->ddense;
        assert_int_equal(stepq_pool_prefill_pack(R->pool, l, &p, NULL), STEPQ_OK);
        assert_int_equal(stepq_pool_sync(R->pool), STEPQ_OK);
    }
}

/* Entry 0's beta of value head 0, one ulp further from 0. */
static void perturb_beta(struct ctx *x)
{
    if (x->es == 4) {
        uint32_t u;
        memcpy(&u, x->beta, 4);
        u++;
        memcpy(x->beta, &u, 4);
    } else {
        uint16_t h;
        memcpy(&h, x->beta, 2);
        h++;
        memcpy(x->beta, &h, 2);
    }
}

/*
 * Step t of run R for the entries ent[0..n) (requests, ENT_PAD, ENT_SENTINEL), every
 * layer; the requests' output rows are kept in R->o. A -1 row must stay as it was.
 * With `ctrl`, the one request's beta of value head 0 gets one ulp at step CTRL_STEP, layer 0.
 */
static void decode(struct ctx *x, struct run *R, int t, const int *ent, int n, int ctrl)
{
    const size_t row = x->nv * x->es;

    for (int e = 0; e < n; e++)
        x->ids[e] = ent[e] >= 0              ? R->slot[ent[e]]
                    : ent[e] == ENT_SENTINEL ? STEPQ_POOL_SLOT_SENTINEL
                                             : STEPQ_POOL_SLOT_PAD;
    to_dev(x->dids, x->ids, sizeof(int32_t) * n);
    for (int l = 0; l < LAYERS; l++) {
        for (int e = 0; e < n; e++) /* padding entries read inputs of their own */
            request_inputs(x, e, ent[e] >= 0 ? ent[e] : 100 + e, t, l);
        if (ctrl && t == CTRL_STEP && l == 0) {
            assert_int_equal(n, 1);
            perturb_beta(x);
        }
        to_dev(x->dq, x->q, n * x->nq * x->es);
        to_dev(x->dk, x->k, n * x->nq * x->es);
        to_dev(x->dv, x->v, n * x->nv * x->es);
        to_dev(x->dg, x->g, n * x->ng * x->es);
        to_dev(x->dbeta, x->beta, n * x->nb * x->es);
        dev_fill(x->d_o, POISON, n * row);

        stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
        a.batch = n;
        a.slot_ids = x->dids;
        a.dtype = x->c->dtype;
        a.q = x->dq, a.k = x->dk, a.v = x->dv, a.g = x->dg, a.beta = x->dbeta, a.o = x->d_o;
        a.flags = x->c->flags;
        a.A_log = x->dA_log + (size_t)l * x->HV;
        a.dt_bias = x->ddt_bias + (size_t)l * x->ng;
        int st = stepq_pool_decode_step(R->pool, l, &a, NULL);
        if (st != STEPQ_OK) {
            print_error("%s: step %d, layer %d, batch %d: %s: %s\n", x->c->name, t, l, n,
                        stepq_status_name(st), stepq_pool_last_error(R->pool));
            fail();
        }
        assert_int_equal(stepq_pool_sync(R->pool), STEPQ_OK);
        from_dev(x->o, x->d_o, n * row);
        for (int e = 0; e < n; e++) {
            if (ent[e] >= 0) {
                memcpy(o_row(x, R, ent[e], t, l), x->o + e * row, row);
                continue;
            }
            for (size_t i = 0; ent[e] == ENT_PAD && i < row; i++)
                if (x->o[e * row + i] != POISON) {
                    print_error("%s: step %d, layer %d: the -1 entry %d's output row was written\n",
                                x->c->name, t, l, e);
                    fail();
                }
        }
    }
}

/* The pages of every request, as the host sees them. */
static void read_pages(struct ctx *x, struct run *R)
{
    assert_int_equal(stepq_pool_copy_to_host(R->pool, R->slot, REQS, R->pages, REQS * x->page),
                     STEPQ_OK);
    assert_int_equal(stepq_pool_sync(R->pool), STEPQ_OK);
}

/* --- comparison ---------------------------------------------------------------------------- */

/*
 * Output elements of request r at step t that differ bitwise between run a (batched) and b
 * (alone); the first `*shown` budget of them are printed with both values.
 */
static long diff_o(const struct ctx *x, const struct run *a, const struct run *b, int r, int t,
                   int *shown, const char *tag)
{
    long n = 0;

    for (int l = 0; l < LAYERS; l++) {
        const uint8_t *pa = o_row(x, a, r, t, l), *pb = o_row(x, b, r, t, l);
        for (size_t i = 0; i < x->nv; i++) {
            if (!memcmp(pa + i * x->es, pb + i * x->es, x->es))
                continue;
            if ((*shown)-- > 0)
                print_error("%s%s: request %d (slot %d batched, %d alone), step %d, layer %d: "
                            "o[head %zu][%zu] = %.9g (0x%0*x) batched, %.9g (0x%0*x) alone\n",
                            tag, x->c->name, r, (int)a->slot[r], (int)b->slot[r], t, l, i / x->V,
                            i % x->V, (double)get(x, pa, i), (int)(2 * x->es), bits_of(x, pa, i),
                            (double)get(x, pb, i), (int)(2 * x->es), bits_of(x, pb, i));
            n++;
        }
    }
    return n;
}

/* Where byte `off` of a page lies: a head block of a layer, a layer's conv state or padding. */
static void where(stepq_pool_t *pool, uint64_t off, char *buf, size_t cap)
{
    const stepq_pool_layout *L;

    assert_int_equal(stepq_pool_get_layout(pool, &L), STEPQ_OK);
    for (int b = 0; b < L->n_blocks; b++)
        if (off >= L->block_offset[b] && off < L->block_offset[b] + L->block_bytes[b]) {
            snprintf(buf, cap, "layer %d head %d block, byte %llu", b / L->n_local_heads,
                     b % L->n_local_heads, (unsigned long long)(off - L->block_offset[b]));
            return;
        }
    for (int l = 0; l < L->n_layers; l++)
        if (off >= L->conv_offset[l] && off < L->conv_offset[l] + L->conv_bytes_per_layer) {
            snprintf(buf, cap, "layer %d conv state, byte %llu", l,
                     (unsigned long long)(off - L->conv_offset[l]));
            return;
        }
    snprintf(buf, cap, "padding, page byte %llu", (unsigned long long)off);
}

/* Page bytes of request r that differ between run a and b after step t; the first printed. */
static long diff_page(const struct ctx *x, const struct run *a, const struct run *b, int r, int t,
                      int *shown, const char *tag, uint64_t *first)
{
    const uint8_t *pa = a->pages + (size_t)r * x->page, *pb = b->pages + (size_t)r * x->page;
    long n = 0;

    for (size_t i = 0; i < x->page; i++) {
        if (pa[i] == pb[i])
            continue;
        if (!n) {
            char loc[96];
            where(a->pool, i, loc, sizeof(loc));
            if (first)
                *first = i;
            if ((*shown)-- > 0)
                print_error("%s%s: request %d (slot %d batched, %d alone), after step %d: page "
                            "byte %zu (%s) = 0x%02x batched, 0x%02x alone\n",
                            tag, x->c->name, r, (int)a->slot[r], (int)b->slot[r], t, i, loc, pa[i],
                            pb[i]);
        }
        n++;
    }
    return n;
}

/* Health words of every request 0, and the stats agreeing. */
static void assert_clean(struct run *R)
{
    uint32_t h[REQS];
    stepq_pool_stats s;

    assert_int_equal(stepq_pool_health_read(R->pool, R->slot, REQS, h), STEPQ_OK);
    for (int r = 0; r < REQS; r++)
        assert_int_equal(h[r], 0);
    assert_int_equal(stepq_pool_get_stats(R->pool, &s, sizeof(s)), STEPQ_OK);
    assert_int_equal(s.capacity, SLOTS);
    assert_int_equal(s.in_use, REQS);
    assert_int_equal(s.health_any, 0);
    assert_int_equal(s.health_slots, 0);
}

/* --- the test ------------------------------------------------------------------------------- */

static void shuffle(int *a, int n, unsigned long long *s)
{
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(fx_rand(s) * (i + 1));
        int t = a[i];
        a[i] = a[j], a[j] = t;
    }
}

static int joins_at(int r, int t)
{
    return schedule[r][t] == 'x' && !memchr(schedule[r], 'x', (size_t)t);
}

static void batch_invariant(void **state)
{
    const struct method_case *c = *state;
    struct ctx x;
    struct run B, A; /* batched, alone */
    unsigned long long s = 31;
    int shown_o = SHOWN, shown_pages = SHOWN, steps = 0;
    long o_diff = 0, page_diff = 0, o_cmp = 0;
    char sizes[128] = "";

    ctx_open(&x, c);
    run_open(&x, &B, 0);
    run_open(&x, &A, 1);
    for (int t = 0; t < STEPS; t++) {
        int join[REQS], nj = 0, ent[MAX_BATCH], n = 0;
        for (int r = 0; r < REQS; r++) {
            if (joins_at(r, t))
                join[nj++] = r;
            if (schedule[r][t] == 'x')
                ent[n++] = r;
        }
        /* Joining prompts: packed together here, one by one there. */
        shuffle(join, nj, &s);
        pack(&x, &B, join, nj);
        for (int j = 0; j < nj; j++)
            pack(&x, &A, &join[j], 1);

        /* The batch: shuffled, padded with -1 and sentinel entries in among the requests. */
        shuffle(ent, n, &s);
        const int real = n;
        if (padded[t]) {
            int to = 1;
            while (to <= real)
                to *= 2;
            assert_true(to <= MAX_BATCH);
            for (int p = 0; n < to; p++) {
                int at = (int)(fx_rand(&s) * (n + 1));
                memmove(ent + at + 1, ent + at, sizeof(int) * (size_t)(n - at));
                ent[at] = p % 2 ? ENT_SENTINEL : ENT_PAD;
                n++;
            }
        }
        snprintf(sizes + strlen(sizes), sizeof(sizes) - strlen(sizes), "%s%d", t ? ", " : "", real);
        if (n > real)
            snprintf(sizes + strlen(sizes), sizeof(sizes) - strlen(sizes), "+%d pad", n - real);

        decode(&x, &B, t, ent, n, 0);
        for (int r = 0; r < REQS; r++) /* alone, in request order */
            if (schedule[r][t] == 'x')
                decode(&x, &A, t, &r, 1, 0);

        for (int r = 0; r < REQS; r++)
            if (schedule[r][t] == 'x') {
                o_diff += diff_o(&x, &B, &A, r, t, &shown_o, "");
                o_cmp += LAYERS * (long)x.nv;
                steps++;
            }
        read_pages(&x, &B);
        read_pages(&x, &A);
        for (int r = 0; r < REQS; r++) /* those outside the batch too */
            page_diff += diff_page(&x, &B, &A, r, t, &shown_pages, "", NULL);
    }
    assert_clean(&B);
    assert_clean(&A);
    if (o_diff || page_diff)
        print_error("%s: NOT batch-invariant: %ld of %ld output elements and %ld page bytes "
                    "differ from the requests run alone\n",
                    c->name, o_diff, o_cmp, page_diff);
    assert_int_equal(o_diff, 0);
    assert_int_equal(page_diff, 0);

    /*
     * Control, that the comparison sees one ulp: request CTRL_REQ alone in a third pool, one
     * ulp added to its beta of value head 0 at CTRL_STEP, layer 0. Its outputs are the batched
     * run's before CTRL_STEP and differ there. (Its page may then differ or not: a quantized
     * page can round the change away, an fp32 page keeps it.)
     */
    struct run C;
    long ctrl_o[STEPS], ctrl_pages;
    int ctrl_shown = 1; /* the first difference printed, as a failing comparison shows it */
    const int ctrl = CTRL_REQ;
    run_open(&x, &C, 1);
    for (int t = 0; t < STEPS; t++) {
        ctrl_o[t] = 0;
        if (joins_at(ctrl, t))
            pack(&x, &C, &ctrl, 1);
        if (schedule[ctrl][t] != 'x')
            continue;
        decode(&x, &C, t, &ctrl, 1, 1);
        ctrl_o[t] = diff_o(&x, &B, &C, ctrl, t, &ctrl_shown, "control (expected): ");
    }
    for (int t = 0; t < CTRL_STEP; t++)
        assert_int_equal(ctrl_o[t], 0);
    assert_true(ctrl_o[CTRL_STEP] > 0);
    read_pages(&x, &C);
    ctrl_shown = 0;
    ctrl_pages = diff_page(&x, &B, &C, ctrl, STEPS - 1, &ctrl_shown, "", NULL);
    if (c->method == STEPQ_METHOD_FP32)
        assert_true(ctrl_pages > 0);

    /* And one bit flipped in a page of the batched pool (host copy out and in) is found. */
    const stepq_pool_layout *L;
    uint8_t *page = halloc(x.page);
    uint64_t flip, found = 0;
    const int victim = REQS - 1;
    assert_int_equal(stepq_pool_get_layout(B.pool, &L), STEPQ_OK);
    flip = L->block_offset[L->n_blocks - 1] + 5;
    assert_int_equal(stepq_pool_copy_to_host(B.pool, &B.slot[victim], 1, page, x.page), STEPQ_OK);
    assert_int_equal(stepq_pool_sync(B.pool), STEPQ_OK);
    page[flip] ^= 1;
    assert_int_equal(stepq_pool_copy_from_host(B.pool, &B.slot[victim], 1, page, x.page), STEPQ_OK);
    assert_int_equal(stepq_pool_sync(B.pool), STEPQ_OK);
    read_pages(&x, &B);
    ctrl_shown = 0;
    assert_int_equal(diff_page(&x, &B, &A, victim, STEPS - 1, &ctrl_shown, "", &found), 1);
    assert_int_equal(found, flip);
    free(page);

    long ctrl_later = 0;
    for (int t = CTRL_STEP + 1; t < STEPS; t++)
        ctrl_later += ctrl_o[t];
    print_message(
        "%s: batches of %s requests (%d request-steps) x %d layers: %ld output elements "
        "and %d pages x %d steps bitwise those of the requests alone; control: one ulp "
        "in request %d's beta of head 0 at step %d moves %ld of the head's %d outputs there, "
        "%ld later and %ld page bytes; one flipped page bit is found as its byte\n",
        c->name, sizes, steps, LAYERS, o_cmp, REQS, STEPS, ctrl, CTRL_STEP, ctrl_o[CTRL_STEP], x.V,
        ctrl_later, ctrl_pages);
    run_close(&C);
    run_close(&A);
    run_close(&B);
    ctx_close(&x);
}

int main(int argc, char **argv)
{
    struct CMUnitTest tests[N_CASES];

    on_cuda = argc > 1 && !strcmp(argv[1], "cuda");
    if (argc > 2 || (argc == 2 && !on_cuda && strcmp(argv[1], "host"))) {
        fprintf(stderr, "usage: %s [host|cuda]\n", argv[0]);
        return 2;
    }
    if (on_cuda) {
        int skip = stepq_test_cuda_device();
        if (skip)
            return skip;
#if STEPQ_HAVE_CUDA
        if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
            printf("cudaStreamCreateWithFlags failed\n");
            return 1;
        }
#endif
    }
    for (int i = 0; i < N_CASES; i++) {
        memset(&tests[i], 0, sizeof(tests[i]));
        tests[i].name = cases[i].name;
        tests[i].test_func = batch_invariant;
        tests[i].initial_state = &cases[i];
    }
    int rc = _cmocka_run_group_tests(on_cuda ? "batch invariance, cuda backend"
                                             : "batch invariance, host backend",
                                     tests, N_CASES, NULL, NULL);
#if STEPQ_HAVE_CUDA
    if (on_cuda)
        cudaStreamDestroy(stream);
#endif
    return rc;
}
