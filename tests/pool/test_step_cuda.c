/*
 * The public data path on the CUDA backend (stepq/step.h), on the GPU:
 *   - a CUDA pool and a host pool opened from the same map run the same
 *     prefill packs and padded decode batches through the API; the CUDA
 *     kernels match the C reference within the named tolerances;
 *   - the decode steps of every layer of a batch, captured into one CUDA
 *     graph and replayed 100 times with new inputs, give outputs, pages and
 *     health words byte-identical to the same calls made eagerly.
 * Maps: tiny-gdn stepq@6 (calibrated, GDN) and a KDA stepq map with mixed
 * row widths and a pivot row built here. Exits 77 (skipped) without CUDA in
 * the build or a device in the machine.
 *
 * Run on a GPU machine:  meson test -C build 'pool step cuda' --print-errorlogs
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

#define SLOTS   16
#define BATCH   8 /* 5 real slots, 2 sentinel entries, 1 padding entry */
#define TOKENS  16
#define REPLAYS 100

/*
 * CUDA vs reference, one step from the same pages. The readout comes from
 * the same decoded state through fp32 arithmetic in another order: rounding
 * only. The new state is fitted and rounded to codes and fp16 scales; where
 * a value falls on a rounding tie the two round differently
 * (tests/checkasm proves every differing code is such a tie), which
 * moves that element, or a row of it for a scale, by one step of its width:
 * far below a 6-bit code's own error (~1e-3), while a wrong head, layout or
 * gate would give ~1.
 */
#define TOL_STATE_NMSE 1e-5
#define TOL_OUT_NMSE   1e-9

struct batch {
    int H, HV, K, V, L, kda;
    size_t nq, nv, ng, nb, per;
    float *q, *k, *v, *g, *beta;            /* host */
    void *dq, *dk, *dv, *dg, *dbeta, *dids; /* device */
    int32_t ids[BATCH];
};

static void cu(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        print_error("%s: %s\n", what, cudaGetErrorString(e));
        fail();
    }
}

/*
 * A host-to-device copy that has landed. cudaMemcpy from pageable memory
 * returns once the bytes are staged, before the DMA to the device completes,
 * and the pools here may run on a non-blocking stream that is not ordered
 * after the legacy stream's copy: a kernel there could read a half-written
 * buffer (measured: packs of the same input into two pools differing in a
 * few low bits, in some runs).
 */
static void upload(void *dst, const void *src, size_t n, const char *what)
{
    cu(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), what);
    cu(cudaDeviceSynchronize(), what);
}

static void *dalloc(size_t n)
{
    void *p = NULL;
    cu(cudaMalloc(&p, n ? n : 16), "cudaMalloc");
    return p;
}

static stepq_map_t *kda_map(void)
{
    /* The small test shape (H 2, HV 4) with the kernels' 128x128 heads, 2 layers. */
    stepq_model_shape s = fx_shape_small(STEPQ_ARCH_KDA);
    stepq_map_t *map = NULL;

    s.n_layers = 2;
    s.head_k_dim = s.head_v_dim = 128;
    s.conv_shape[0] = 1024;
    s.conv_dtype = STEPQ_DTYPE_BF16;
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 6, &map), STEPQ_OK);
    assert_int_equal(fx_layout_exact(map, 6, 2), STEPQ_OK);
    return map;
}

static stepq_map_t *gdn_map(void)
{
    stepq_map_t *map = NULL;
    assert_int_equal(stepq_map_load_file(
                         STEPQ_SOURCE_ROOT "/config/calibrated/tiny-gdn/stepq@6.json", NULL, &map),
                     STEPQ_OK);
    return map;
}

static stepq_pool_t *open_pool(stepq_map_t *map, stepq_pool_backend be, void *stream)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool = NULL;
    int32_t all[SLOTS];

    cfg.map = map;
    cfg.backend = be;
    cfg.stream = stream;
    cfg.num_slots = SLOTS;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_OK);
    /* The same allocation history on every pool gives the same ids. */
    assert_int_equal(stepq_pool_alloc(pool, SLOTS, all), STEPQ_OK);
    int32_t back[6] = { all[0], all[3], all[7], all[8], all[11], all[15] };
    assert_int_equal(stepq_pool_free(pool, back, 6), STEPQ_OK);
    return pool;
}

static void batch_init(struct batch *b, stepq_map_t *map)
{
    stepq_model_shape s;
    assert_int_equal(stepq_map_shape(map, &s), STEPQ_OK);
    memset(b, 0, sizeof(*b));
    b->H = s.num_k_heads, b->HV = s.num_v_heads, b->K = s.head_k_dim, b->V = s.head_v_dim;
    b->L = s.n_layers;
    b->kda = s.arch == STEPQ_ARCH_KDA;
    b->nq = (size_t)BATCH * b->H * b->K;
    b->nv = (size_t)BATCH * b->HV * b->V;
    b->ng = (size_t)BATCH * b->HV * (b->kda ? b->K : 1);
    b->nb = (size_t)BATCH * b->HV;
    b->per = (size_t)b->HV * b->K * b->V;
    b->q = malloc(4 * b->nq), b->k = malloc(4 * b->nq), b->v = malloc(4 * b->nv);
    b->g = malloc(4 * b->ng), b->beta = malloc(4 * b->nb);
    assert_true(b->q && b->k && b->v && b->g && b->beta);
    b->dq = dalloc(4 * b->nq), b->dk = dalloc(4 * b->nq), b->dv = dalloc(4 * b->nv);
    b->dg = dalloc(4 * b->ng), b->dbeta = dalloc(4 * b->nb), b->dids = dalloc(sizeof(b->ids));
    /* Slots 2, 5, 6, 10, 13 (allocated on every pool), with padding as a graph batch has it. */
    const int32_t ids[BATCH] = { 6, 0, 2, -1, 13, 0, 5, 10 };
    memcpy(b->ids, ids, sizeof(ids));
    upload(b->dids, b->ids, sizeof(ids), "ids");
}

static void batch_free(struct batch *b)
{
    free(b->q), free(b->k), free(b->v), free(b->g), free(b->beta);
    cudaFree(b->dq), cudaFree(b->dk), cudaFree(b->dv), cudaFree(b->dg), cudaFree(b->dbeta);
    cudaFree(b->dids);
}

static void batch_fill(struct batch *b, unsigned long long seed, cudaStream_t s)
{
    unsigned long long r = seed;
    for (size_t i = 0; i < b->nq; i++) {
        b->q[i] = (float)(2 * fx_rand(&r) - 1);
        b->k[i] = (float)(2 * fx_rand(&r) - 1);
    }
    for (size_t i = 0; i < b->nv; i++)
        b->v[i] = (float)(2 * fx_rand(&r) - 1);
    for (size_t i = 0; i < b->ng; i++)
        b->g[i] = (float)(-0.01 - 0.4 * fx_rand(&r));
    for (size_t i = 0; i < b->nb; i++)
        b->beta[i] = (float)(0.1 + 0.8 * fx_rand(&r));
    cu(cudaMemcpyAsync(b->dq, b->q, 4 * b->nq, cudaMemcpyHostToDevice, s), "q");
    cu(cudaMemcpyAsync(b->dk, b->k, 4 * b->nq, cudaMemcpyHostToDevice, s), "k");
    cu(cudaMemcpyAsync(b->dv, b->v, 4 * b->nv, cudaMemcpyHostToDevice, s), "v");
    cu(cudaMemcpyAsync(b->dg, b->g, 4 * b->ng, cudaMemcpyHostToDevice, s), "g");
    cu(cudaMemcpyAsync(b->dbeta, b->beta, 4 * b->nb, cudaMemcpyHostToDevice, s), "beta");
}

static stepq_step_args args_of(const struct batch *b, int device, void *o)
{
    stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
    a.batch = BATCH;
    a.slot_ids = device ? b->dids : b->ids;
    a.q = device ? b->dq : b->q;
    a.k = device ? b->dk : b->k;
    a.v = device ? b->dv : b->v;
    a.g = device ? b->dg : b->g;
    a.beta = device ? b->dbeta : b->beta;
    a.o = o;
    a.flags = STEPQ_STEP_L2NORM;
    return a;
}

static double nmse(const float *x, const float *ref, size_t n)
{
    double e = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)x[i] - ref[i];
        e += d * d;
        r += (double)ref[i] * ref[i];
    }
    return r > 0 ? e / r : e;
}

/* The initial states, packed into both pools through the prefill hook. */
static void pack_both(struct batch *b, stepq_pool_t *host, stepq_pool_t *dev)
{
    unsigned long long r = 99;
    float *dense = malloc(4 * b->per * BATCH);
    void *ddense = dalloc(4 * b->per * BATCH);
    int32_t real[BATCH];
    assert_non_null(dense);
    /* Pack the real slots only: a sentinel entry packs garbage by design. */
    for (int e = 0; e < BATCH; e++)
        real[e] = b->ids[e] > 0 ? b->ids[e] : -1;
    void *dreal = dalloc(sizeof(real));
    upload(dreal, real, sizeof(real), "ids");
    for (int l = 0; l < b->L; l++) {
        for (size_t i = 0; i < b->per * BATCH; i++)
            dense[i] = (float)(0.1 * (2 * fx_rand(&r) - 1));
        upload(ddense, dense, 4 * b->per * BATCH, "dense");
        stepq_prefill_args p = STEPQ_PREFILL_ARGS_INITIALIZER;
        p.n = BATCH;
        p.slot_ids = real;
        p.states = dense;
        if (host)
            assert_int_equal(stepq_pool_prefill_pack(host, l, &p, NULL), STEPQ_OK);
        p.slot_ids = dreal;
        p.states = ddense;
        assert_int_equal(stepq_pool_prefill_pack(dev, l, &p, NULL), STEPQ_OK);
        /* The pool's stream may be a non-blocking one, unordered with the
         * next layer's synchronous upload into the same buffer. */
        assert_int_equal(stepq_pool_sync(dev), STEPQ_OK);
    }
    assert_int_equal(stepq_pool_sync(dev), STEPQ_OK);
    free(dense);
    cudaFree(ddense);
    cudaFree(dreal);
}

/* Unpacks layer l of the real slots of both pools and returns the NMSE. */
static double state_nmse(struct batch *b, stepq_pool_t *host, stepq_pool_t *dev, int l)
{
    int32_t real[BATCH];
    for (int e = 0; e < BATCH; e++)
        real[e] = b->ids[e] > 0 ? b->ids[e] : -1;
    float *h = calloc(b->per * BATCH, 4), *d = calloc(b->per * BATCH, 4);
    void *dd = dalloc(4 * b->per * BATCH), *dreal = dalloc(sizeof(real));
    assert_true(h && d);
    cu(cudaMemset(dd, 0, 4 * b->per * BATCH), "memset");
    upload(dreal, real, sizeof(real), "ids");
    stepq_prefill_args p = STEPQ_PREFILL_ARGS_INITIALIZER;
    p.n = BATCH;
    p.slot_ids = real;
    p.states = h;
    assert_int_equal(stepq_pool_prefill_unpack(host, l, &p, NULL), STEPQ_OK);
    p.slot_ids = dreal;
    p.states = dd;
    p.layout = STEPQ_STATE_LAYOUT_KV;
    assert_int_equal(stepq_pool_prefill_unpack(dev, l, &p, NULL), STEPQ_OK);
    cu(cudaMemcpy(d, dd, 4 * b->per * BATCH, cudaMemcpyDeviceToHost), "download");
    double e = nmse(d, h, b->per * BATCH);
    free(h), free(d);
    cudaFree(dd), cudaFree(dreal);
    return e;
}

/* The host pool's pages and health words, copied over the CUDA pool's (same layout). */
static void sync_pages(stepq_pool_t *host, stepq_pool_t *dev)
{
    stepq_pool_buffer_info h[2], d[2];
    int count = 0;
    assert_int_equal(stepq_pool_buffer_infos(host, h, 2, &count), STEPQ_OK);
    assert_int_equal(stepq_pool_buffer_infos(dev, d, 2, &count), STEPQ_OK);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(h[i].bytes, d[i].bytes);
        upload(d[i].ptr, h[i].ptr, h[i].bytes, "pages");
    }
}

/*
 * checkasm's rule for a stateful kernel: the same input state and the same
 * inputs to both, one step, compare. Before every token the CUDA pool gets
 * the host pool's pages, so each comparison is of one step; the trajectories
 * are not compared over many steps, because re-quantizing after every token
 * amplifies a single rounding tie (a code or an fp16 scale rounded the other
 * way) into two different, equally valid quantized trajectories that drift
 * apart to the level of the format's own error (measured: readout NMSE
 * 1.6e-3 after 16 tokens, the 6-bit noise level).
 */
static void cuda_matches_host(stepq_map_t *map, const char *name)
{
    struct batch b;
    batch_init(&b, map);
    stepq_pool_t *host = open_pool(map, STEPQ_POOL_BACKEND_HOST, NULL);
    stepq_pool_t *dev = open_pool(map, STEPQ_POOL_BACKEND_CUDA, NULL);
    float *o_h = calloc(b.nv, 4), *o_d = calloc(b.nv, 4);
    void *d_o = dalloc(4 * b.nv);
    assert_true(o_h && o_d);
    pack_both(&b, host, dev);
    double worst_pack = 0, worst_o = 0, worst_s = 0;
    for (int l = 0; l < b.L; l++) {
        double e = state_nmse(&b, host, dev, l);
        worst_pack = e > worst_pack ? e : worst_pack;
    }
    for (int t = 0; t < TOKENS; t++) {
        sync_pages(host, dev);
        for (int l = 0; l < b.L; l++) {
            batch_fill(&b, 1000 * t + l, NULL);
            cu(cudaDeviceSynchronize(), "inputs");
            stepq_step_args ah = args_of(&b, 0, o_h), ad = args_of(&b, 1, d_o);
            assert_int_equal(stepq_pool_decode_step(host, l, &ah, NULL), STEPQ_OK);
            assert_int_equal(stepq_pool_decode_step(dev, l, &ad, NULL), STEPQ_OK);
            cu(cudaMemcpy(o_d, d_o, 4 * b.nv, cudaMemcpyDeviceToHost), "o");
            for (int e = 0; e < BATCH; e++) {
                if (b.ids[e] <= 0)
                    continue; /* padding rows are unwritten; sentinel rows are undefined */
                size_t row = (size_t)b.HV * b.V;
                double err = nmse(o_d + e * row, o_h + e * row, row);
                worst_o = err > worst_o ? err : worst_o;
            }
            double e = state_nmse(&b, host, dev, l);
            worst_s = e > worst_s ? e : worst_s;
        }
    }
    printf("%s: worst NMSE, CUDA vs reference: pack %.3g; over %d tokens x %d layers, one step "
           "each: readout %.3g, state %.3g\n",
           name, worst_pack, TOKENS, b.L, worst_o, worst_s);
    assert_true(worst_pack <= TOL_STATE_NMSE);
    assert_true(worst_o <= TOL_OUT_NMSE);
    assert_true(worst_s <= TOL_STATE_NMSE);
    free(o_h), free(o_d);
    cudaFree(d_o);
    assert_int_equal(stepq_pool_close(host, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    assert_int_equal(stepq_pool_close(dev, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    batch_free(&b);
}

static void test_cuda_matches_host_gdn(void **state)
{
    stepq_map_t *map = gdn_map();
    cuda_matches_host(map, "gdn stepq@6");
    stepq_map_close(map);
}

static void test_cuda_matches_host_kda(void **state)
{
    stepq_map_t *map = kda_map();
    cuda_matches_host(map, "kda stepq@6 mixed+pivot");
    stepq_map_close(map);
}

/*
 * The decode fit rows (map field decode_fit): the same comparison on the same maps, the
 * pages synced before every token, so that both backends keep the same old column scales
 * (checkasm's decode cases compare them code by code).
 */
static void test_cuda_matches_host_rows(void **state)
{
    stepq_map_t *map = gdn_map();
    assert_int_equal(stepq_map_set_decode_fit(map, STEPQ_DECODE_FIT_ROWS), STEPQ_OK);
    cuda_matches_host(map, "gdn stepq@6 rows");
    stepq_map_close(map);
    map = kda_map();
    assert_int_equal(stepq_map_set_decode_fit(map, STEPQ_DECODE_FIT_ROWS), STEPQ_OK);
    cuda_matches_host(map, "kda stepq@6 mixed+pivot rows");
    stepq_map_close(map);
}

/*
 * Every page byte and health word of a CUDA pool but the sentinel's, on the
 * host. The sentinel is excluded: two sentinel entries of one batch are two
 * kernels' blocks updating one page at once, so what it holds is undefined.
 */
static uint8_t *pool_bytes(stepq_pool_t *pool, size_t *n)
{
    stepq_pool_buffer_info info[2];
    int count = 0;
    assert_int_equal(stepq_pool_buffer_infos(pool, info, 2, &count), STEPQ_OK);
    const size_t pages = info[0].bytes - info[0].item_bytes;
    const size_t words = info[1].bytes - info[1].item_bytes;
    *n = pages + words;
    uint8_t *h = malloc(*n);
    assert_non_null(h);
    assert_int_equal(stepq_pool_sync(pool), STEPQ_OK);
    cu(cudaMemcpy(h, (uint8_t *)info[0].ptr + info[0].item_bytes, pages, cudaMemcpyDeviceToHost),
       "pages");
    cu(cudaMemcpy(h + pages, (uint8_t *)info[1].ptr + info[1].item_bytes, words,
                  cudaMemcpyDeviceToHost),
       "health");
    return h;
}

static void graph_equals_eager(stepq_map_t *map, const char *name)
{
    struct batch b;
    cudaStream_t s;
    cu(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    batch_init(&b, map);
    stepq_pool_t *eager = open_pool(map, STEPQ_POOL_BACKEND_CUDA, s);
    stepq_pool_t *graph = open_pool(map, STEPQ_POOL_BACKEND_CUDA, s);
    pack_both(&b, NULL, eager);
    pack_both(&b, NULL, graph);
    size_t n1, n2;
    uint8_t *p1 = pool_bytes(eager, &n1), *p2 = pool_bytes(graph, &n2);
    assert_int_equal(n1, n2);
    assert_memory_equal(p1, p2, n1); /* the pack is deterministic */
    free(p1), free(p2);

    /* One output buffer per layer, so a replay's outputs are all kept. */
    const size_t obytes = 4 * b.nv * (size_t)b.L;
    uint8_t *d_o = dalloc(obytes), *o_eager = malloc(obytes), *o_graph = malloc(obytes);
    assert_true(o_eager && o_graph);

    /* Capture: every layer's decode step of the batch, nothing else. */
    cudaGraph_t g;
    cudaGraphExec_t exec;
    cu(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
    for (int l = 0; l < b.L; l++) {
        stepq_step_args a = args_of(&b, 1, d_o + 4 * b.nv * (size_t)l);
        int st = stepq_pool_decode_step(graph, l, &a, NULL);
        if (st != STEPQ_OK) {
            cudaStreamEndCapture(s, &g);
            print_error("capture, layer %d: %s: %s\n", l, stepq_status_name(st),
                        stepq_last_error());
            fail();
        }
    }
    cu(cudaStreamEndCapture(s, &g), "end capture");
    size_t nodes = 0;
    cu(cudaGraphGetNodes(g, NULL, &nodes), "nodes");
    printf("%s: graph of %zu kernel nodes for %d layers\n", name, nodes, b.L);
    cu(cudaGraphInstantiate(&exec, g, 0), "instantiate");

    for (int t = 0; t < REPLAYS; t++) {
        batch_fill(&b, 7000 + t, s);
        for (int l = 0; l < b.L; l++) {
            stepq_step_args a = args_of(&b, 1, d_o + 4 * b.nv * (size_t)l);
            assert_int_equal(stepq_pool_decode_step(eager, l, &a, NULL), STEPQ_OK);
        }
        cu(cudaMemcpyAsync(o_eager, d_o, obytes, cudaMemcpyDeviceToHost, s), "o eager");
        cu(cudaMemsetAsync(d_o, 0xff, obytes, s), "poison o");
        cu(cudaGraphLaunch(exec, s), "replay");
        cu(cudaMemcpyAsync(o_graph, d_o, obytes, cudaMemcpyDeviceToHost, s), "o graph");
        cu(cudaStreamSynchronize(s), "sync");
        /* Padding rows (-1) are written by neither, sentinel rows are undefined. */
        for (int l = 0; l < b.L; l++)
            for (int e = 0; e < BATCH; e++) {
                if (b.ids[e] <= 0)
                    continue;
                size_t off = 4 * (b.nv * (size_t)l + (size_t)e * b.HV * b.V);
                if (memcmp(o_eager + off, o_graph + off, 4 * (size_t)b.HV * b.V)) {
                    print_error("%s: replay %d layer %d entry %d: outputs differ\n", name, t, l, e);
                    fail();
                }
            }
    }
    p1 = pool_bytes(eager, &n1);
    p2 = pool_bytes(graph, &n2);
    assert_memory_equal(p1, p2, n1);
    printf("%s: %d replays == %d eager steps of %d layers (outputs, pages, health)\n", name,
           REPLAYS, REPLAYS, b.L);
    free(p1), free(p2);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    free(o_eager), free(o_graph);
    cudaFree(d_o);
    assert_int_equal(stepq_pool_close(eager, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    assert_int_equal(stepq_pool_close(graph, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    batch_free(&b);
    cudaStreamDestroy(s);
}

static void test_graph_replay_equals_eager_gdn(void **state)
{
    stepq_map_t *map = gdn_map();
    graph_equals_eager(map, "gdn stepq@6");
    stepq_map_close(map);
}

static void test_graph_replay_equals_eager_kda(void **state)
{
    stepq_map_t *map = kda_map();
    graph_equals_eager(map, "kda stepq@6 mixed+pivot");
    stepq_map_close(map);
}

/* The CUDA backend's capability answers: 128x128 runs; other head sizes do not. */
static void test_cuda_supports(void **state)
{
    stepq_map_t *map = gdn_map();
    stepq_pool_t *dev = open_pool(map, STEPQ_POOL_BACKEND_CUDA, NULL);
    stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
    a.dtype = STEPQ_DTYPE_BF16;
    assert_int_equal(stepq_pool_supports(dev, STEPQ_OP_DECODE_STEP, -1, &a), STEPQ_OK);
    assert_int_equal(stepq_pool_close(dev, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    stepq_map_close(map);

    stepq_model_shape s = fx_shape_small(STEPQ_ARCH_GDN); /* 8x4 heads */
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_UNIFORM, 6, &map), STEPQ_OK);
    dev = open_pool(map, STEPQ_POOL_BACKEND_CUDA, NULL);
    assert_int_equal(stepq_pool_supports(dev, STEPQ_OP_DECODE_STEP, 0, &a), STEPQ_ENOTSUP);
    printf("small heads: %s\n", stepq_pool_last_error(dev));
    assert_non_null(strstr(stepq_pool_last_error(dev), "128"));
    assert_int_equal(stepq_pool_close(dev, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    stepq_map_close(map);
}

/*
 * A map whose row_split is not 0.5 (map field row_split): the CUDA kernels fit with it
 * (kernels/cuda/common.cuh sq_dual_row_scale), so the CUDA pool supports every op (the
 * checkasm decode and pack checks compare its pages with the host pool's code by code).
 */
static void test_cuda_serves_another_row_split(void **state)
{
    stepq_map_t *map = gdn_map();
    assert_int_equal(stepq_map_set_row_split(map, 0.75), STEPQ_OK);
    stepq_pool_t *dev = open_pool(map, STEPQ_POOL_BACKEND_CUDA, NULL);
    stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
    stepq_prefill_args p = STEPQ_PREFILL_ARGS_INITIALIZER;
    a.dtype = STEPQ_DTYPE_BF16;
    p.n = 1;
    assert_int_equal(stepq_pool_supports(dev, STEPQ_OP_DECODE_STEP, -1, &a), STEPQ_OK);
    assert_int_equal(stepq_pool_supports(dev, STEPQ_OP_PREFILL_PACK, 0, &p), STEPQ_OK);
    assert_int_equal(stepq_pool_supports(dev, STEPQ_OP_PREFILL_UNPACK, 0, &p), STEPQ_OK);
    assert_int_equal(stepq_pool_close(dev, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    stepq_map_close(map);
}
#endif

int main(void)
{
    int skip = stepq_test_cuda_device();
#if STEPQ_HAVE_CUDA
    if (skip)
        return skip;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_matches_host_gdn),
        cmocka_unit_test(test_cuda_matches_host_kda),
        cmocka_unit_test(test_cuda_matches_host_rows),
        cmocka_unit_test(test_graph_replay_equals_eager_gdn),
        cmocka_unit_test(test_graph_replay_equals_eager_kda),
        cmocka_unit_test(test_cuda_supports),
        cmocka_unit_test(test_cuda_serves_another_row_split),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#else
    return skip; /* 77: this build has no CUDA */
#endif
}
