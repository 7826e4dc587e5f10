/*
 * A plugin host, loading stepq the way a server does: dlopen() the shared
 * library by path, resolve stepq_plugin_get and nothing else, ask for the
 * newest table version it knows first and fall back to older ones, then run
 * everything through the table: load a map, open a host pool, pack four
 * requests' dense initial states, run decode steps on every layer, copy and
 * offload a slot, unpack and compare with a dense fp32 recurrence within
 * the map's bound (the README example's bound). Then the error paths
 * through the table (double free, a bad decode argument, a missing map, a
 * stale pool handle, unknown versions), each of which must reach the
 * host's logger exactly once with the text last_error() returns, while the
 * successful calls log nothing.
 *
 * usage: host LIBSTEPQ_SO MAP_JSON
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <stepq/plugin.h> /* types only: this program links no stepq code */

#define N      4  /* requests */
#define TOKENS 16 /* decode tokens on every layer */

static const stepq_plugin_v1 *sq; /* the table, once negotiated */

/* --- the logger ------------------------------------------------------------ */

#define MAX_LOGGED 64

static struct {
    int n;
    int levels[MAX_LOGGED];
    char msgs[MAX_LOGGED][512];
} logged;

static void logger(void *user, int level, const char *msg)
{
    if (user != &logged)
        abort();
    if (logged.n < MAX_LOGGED) {
        logged.levels[logged.n] = level;
        snprintf(logged.msgs[logged.n], sizeof(logged.msgs[0]), "%s", msg);
    }
    logged.n++;
}

static int failures;

#define EXPECT(cond, ...)                                           \
    do {                                                            \
        if (!(cond)) {                                              \
            fprintf(stderr, "FAIL line %d: %s: ", __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                           \
            fprintf(stderr, "\n");                                  \
            failures++;                                             \
        }                                                           \
    } while (0)

#define CHECK(call)                                                                              \
    do {                                                                                         \
        int st_ = (call);                                                                        \
        if (st_ < 0) {                                                                           \
            fprintf(stderr, "FAIL line %d: %s: %s: %s\n", __LINE__, #call, sq->status_name(st_), \
                    sq->last_error());                                                           \
            return 1;                                                                            \
        }                                                                                        \
    } while (0)

/*
 * One failing call through the table: it returns `want` and the logger got
 * exactly one message, at STEPQ_LOG_ERROR, equal to last_error().
 */
static void expect_failure(int got, int want, const char *what)
{
    EXPECT(got == want, "%s returned %s, not %s (%s)", what, sq->status_name(got),
           sq->status_name(want), sq->last_error());
    EXPECT(logged.n == 1, "%s: %d messages logged, not 1", what, logged.n);
    if (logged.n >= 1) {
        EXPECT(logged.levels[0] == STEPQ_LOG_ERROR, "%s: level %d", what, logged.levels[0]);
        EXPECT(!strcmp(logged.msgs[0], sq->last_error()), "%s: logged '%s', last_error '%s'", what,
               logged.msgs[0], sq->last_error());
    }
    printf("%-34s %s: %s\n", what, sq->status_name(got), sq->last_error());
    logged.n = 0;
}

/* --- the version negotiation ------------------------------------------------ */

/*
 * Newest first, as a server does: `newest` is the newest version the host
 * was built to use. A table is accepted when its header says the version
 * asked for, at least that version's size and stepq's name. This host has
 * only version 1's struct; a host built against a header with version 2
 * would take a v2 table here and fall back to v1 on an older stepq.
 */
static const stepq_plugin_v1 *negotiate(stepq_plugin_get_fn get, uint32_t newest, uint32_t *tried)
{
    *tried = 0;
    for (uint32_t v = newest; v >= 1; v--) {
        const struct {
            uint32_t size, version;
            const char *name;
        } *h = get(v);

        (*tried)++;
        if (!h)
            continue; /* not provided by this stepq: try the next older one */
        if (h->version != v || !h->name || strcmp(h->name, "stepq")) {
            fprintf(stderr, "FAIL: version %u table says version %u, name %s\n", v, h->version,
                    h->name ? h->name : "(null)");
            return NULL;
        }
        if (v == 1 && h->size >= sizeof(stepq_plugin_v1))
            return (const stepq_plugin_v1 *)h;
        fprintf(stderr, "FAIL: version %u table of %u B\n", v, h->size);
        return NULL;
    }
    return NULL;
}

/* --- the workload ---------------------------------------------------------- */

static unsigned rng = 12345;
static float uniform(void) /* in [-1, 1) */
{
    rng = rng * 1664525u + 1013904223u;
    return (float)(rng >> 8) / 8388608.0f - 1.0f;
}

static void unit(float *x, int n) /* a random unit vector */
{
    double s = 0;
    for (int i = 0; i < n; i++) {
        x[i] = uniform();
        s += (double)x[i] * x[i];
    }
    for (int i = 0; i < n; i++)
        x[i] /= (float)sqrt(s);
}

static double rel_err(const float *got, const float *ref, size_t n)
{
    double e = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)got[i] - ref[i];
        e += d * d;
        r += (double)ref[i] * ref[i];
    }
    return sqrt(e / r);
}

static int run(const char *map_path)
{
    stepq_map_t *map;
    stepq_model_shape sh;

    CHECK(sq->map_load_file(map_path, NULL, &map));
    CHECK(sq->map_shape(map, &sh));
    const int H = sh.num_k_heads, HV = sh.num_v_heads, K = sh.head_k_dim, V = sh.head_v_dim;
    const int L = sh.n_layers;
    /* The README example's bound: three quantization steps of the map's
     * nominal width for the relative error of states re-quantized after
     * every token (3/31 at 6 bits); dense maps bf16's 2^-8 rounding. */
    const double bits = sq->map_budget_bits(map);
    const double max_err = bits < 16 ? 3.0 / ((1 << ((int)bits - 1)) - 1) : 3.0 / 256;
    const size_t per = (size_t)HV * K * V; /* one request's state of one layer */

    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    cfg.map = map;
    cfg.backend = STEPQ_POOL_BACKEND_HOST;
    cfg.num_slots = 8;
    stepq_pool_plan_info plan;
    CHECK(sq->pool_plan(&cfg, &plan));
    stepq_pool_t *pool;
    CHECK(sq->pool_open(&cfg, &pool));
    int32_t ids[N];
    CHECK(sq->pool_alloc(pool, N, ids));
    stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
    a.batch = N;
    CHECK(sq->pool_supports(pool, STEPQ_OP_DECODE_STEP, -1, &a));

    float *ref = malloc(sizeof(float) * per * N * L), *got = malloc(sizeof(float) * per * N);
    float *q = malloc(sizeof(float) * N * H * K), *k = malloc(sizeof(float) * N * H * K);
    float *v = malloc(sizeof(float) * N * HV * V), *g = malloc(sizeof(float) * N * HV);
    float *beta = malloc(sizeof(float) * N * HV), *o = malloc(sizeof(float) * N * HV * V);
    double *log_ret = malloc(sizeof(double) * L * HV);
    if (!ref || !got || !q || !k || !v || !g || !beta || !o || !log_ret) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (int l = 0; l < L; l++)
        for (int h = 0; h < HV; h++) {
            stepq_unit_stats us = STEPQ_UNIT_STATS_INITIALIZER;
            int st = sq->map_unit_stats(map, l, h, &us);
            log_ret[l * HV + h] = st == STEPQ_OK ? us.log_retention : -0.05;
        }

    /* Prefill: dense initial states, packed. */
    stepq_prefill_args pf = STEPQ_PREFILL_ARGS_INITIALIZER;
    pf.n = N;
    pf.slot_ids = ids;
    pf.states = got;
    pf.layout = STEPQ_STATE_LAYOUT_KV;
    for (int l = 0; l < L; l++) {
        float *s = ref + per * N * l;
        for (size_t i = 0; i < per * N; i++)
            s[i] = 0.05f * uniform();
        memcpy(got, s, sizeof(float) * per * N);
        CHECK(sq->pool_prefill_pack(pool, l, &pf, NULL));
    }

    a.slot_ids = ids;
    a.q = q, a.k = k, a.v = v, a.g = g, a.beta = beta, a.o = o;
    const float scale = 1.0f / sqrtf((float)K);
    double o_err = 0, o_norm = 0;
    for (int t = 0; t < TOKENS; t++) {
        for (int l = 0; l < L; l++) {
            for (int b = 0; b < N * H; b++) {
                unit(q + (size_t)b * K, K);
                unit(k + (size_t)b * K, K);
            }
            for (int i = 0; i < N * HV * V; i++)
                v[i] = uniform();
            for (int i = 0; i < N * HV; i++) {
                g[i] = (float)log_ret[l * HV + i % HV] * (1.0f + 0.5f * uniform());
                beta[i] = 0.5f + 0.4f * uniform();
            }
            CHECK(sq->pool_decode_step(pool, l, &a, NULL));
            /* S <- exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q (README's recurrence). */
            for (int b = 0; b < N; b++)
                for (int h = 0; h < HV; h++) {
                    float *S = ref + per * ((size_t)N * l + b) + (size_t)h * K * V;
                    const float *qh = q + ((size_t)b * H + h / (HV / H)) * K;
                    const float *kh = k + ((size_t)b * H + h / (HV / H)) * K;
                    const float *vh = v + ((size_t)b * HV + h) * V;
                    const float dec = expf(g[b * HV + h]), bt = beta[b * HV + h];
                    for (int j = 0; j < V; j++) {
                        double sk = 0, so = 0;
                        for (int i = 0; i < K; i++)
                            sk += (double)(S[i * V + j] *= dec) * kh[i];
                        const float u = bt * (vh[j] - (float)sk);
                        for (int i = 0; i < K; i++) {
                            S[i * V + j] += kh[i] * u;
                            so += (double)S[i * V + j] * qh[i] * scale;
                        }
                        const double d = o[((size_t)b * HV + h) * V + j] - so;
                        o_err += d * d;
                        o_norm += so * so;
                    }
                }
        }
    }

    for (int l = 0; l < L; l++) {
        CHECK(sq->pool_prefill_unpack(pool, l, &pf, NULL));
        const double e = rel_err(got, ref + per * N * l, per * N);
        printf("layer %d: state error %.4f (bound %.4f)\n", l, e, max_err);
        EXPECT(e <= max_err, "layer %d state error %.4f over %.4f", l, e, max_err);
    }
    printf("readout error %.4f over %d tokens x %d layers\n", sqrt(o_err / o_norm), TOKENS, L);
    EXPECT(sqrt(o_err / o_norm) <= max_err, "readout error %.4f", sqrt(o_err / o_norm));

    /* Radix copy-on-write and offload through the table: request 0's page
     * copied into a new slot, and offloaded and reloaded into another, both
     * unpack to exactly request 0's states. */
    stepq_pool_stats stats;
    CHECK(sq->pool_get_stats(pool, &stats, sizeof(stats)));
    EXPECT(stats.in_use == N && stats.page_bytes == plan.page_bytes && stats.health_any == 0,
           "stats: in_use %d, page %llu B (plan %llu B), health 0x%x", (int)stats.in_use,
           (unsigned long long)stats.page_bytes, (unsigned long long)plan.page_bytes,
           stats.health_any);
    int32_t more[2];
    CHECK(sq->pool_alloc(pool, 2, more));
    CHECK(sq->pool_copy(pool, &ids[0], &more[0], 1));
    void *host = malloc(stats.page_bytes);
    float *back = malloc(sizeof(float) * per * 3);
    if (!host || !back)
        return 1;
    CHECK(sq->pool_copy_to_host(pool, &ids[0], 1, host, stats.page_bytes));
    CHECK(sq->pool_copy_from_host(pool, &more[1], 1, host, stats.page_bytes));
    CHECK(sq->pool_sync(pool));
    const int32_t three[3] = { ids[0], more[0], more[1] };
    stepq_prefill_args pf3 = pf;
    pf3.n = 3;
    pf3.slot_ids = three;
    pf3.states = back;
    for (int l = 0; l < L; l++) {
        CHECK(sq->pool_prefill_unpack(pool, l, &pf3, NULL));
        EXPECT(!memcmp(back, back + per, sizeof(float) * per) &&
                   !memcmp(back, back + 2 * per, sizeof(float) * per),
               "layer %d: the copied or reloaded slot differs from its source", l);
    }
    stepq_conv_view cv;
    CHECK(sq->pool_conv_state(pool, 0, &cv, sizeof(cv)));
    EXPECT(cv.slot_stride == stats.page_bytes, "conv view stride %llu",
           (unsigned long long)cv.slot_stride);
    CHECK(sq->pool_free(pool, more, 2));
    EXPECT(logged.n == 0, "%d messages logged by successful calls (first: %s)", logged.n,
           logged.msgs[0]);

    /* --- errors through the table --- */
    CHECK(sq->pool_free(pool, ids, N));
    expect_failure(sq->pool_free(pool, ids, N), STEPQ_EDOUBLEFREE, "double free");
    CHECK(sq->pool_alloc(pool, N, ids));
    a.q = NULL; /* an inner check's text, prefixed by the step's: still one message */
    expect_failure(sq->pool_decode_step(pool, 0, &a, NULL), STEPQ_EINVAL, "decode step, q NULL");
    a.q = q;
    stepq_map_t *none = NULL;
    expect_failure(sq->map_load_file("/nonexistent/map.json", NULL, &none), STEPQ_EIO,
                   "missing map");
    expect_failure(sq->pool_close(pool, 0), STEPQ_EBUSY, "close with slots in use");
    CHECK(sq->pool_close(pool, STEPQ_POOL_CLOSE_FORCE));
    expect_failure(sq->pool_alloc(pool, 1, ids), STEPQ_EBADF, "stale pool handle");
    expect_failure(sq->pool_decode_step(pool, 0, &a, NULL), STEPQ_EBADF, "stale handle, step");

    sq->map_close(map);
    free(ref), free(got), free(q), free(k), free(v), free(g), free(beta), free(o), free(log_ret);
    free(host), free(back);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s LIBSTEPQ_SO MAP_JSON\n", argv[0]);
        return 2;
    }
    /* Nothing of stepq is linked in: every call below goes through the table. */
    if (dlsym(RTLD_DEFAULT, "stepq_pool_open")) {
        fprintf(stderr, "FAIL: this host is linked against stepq\n");
        return 1;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "FAIL: dlopen %s: %s\n", argv[1], dlerror());
        return 1;
    }
    void *sym = dlsym(lib, STEPQ_PLUGIN_SYMBOL);
    if (!sym) {
        fprintf(stderr, "FAIL: %s has no %s\n", argv[1], STEPQ_PLUGIN_SYMBOL);
        return 1;
    }
    stepq_plugin_get_fn get;
    memcpy(&get, &sym, sizeof(get)); /* POSIX: dlsym's object pointer is the function */

    /* A host built against a newer header asks for STEPQ_PLUGIN_VERSION + 1
     * first and falls back; this one knows version 1. */
    uint32_t tried;
    sq = negotiate(get, STEPQ_PLUGIN_VERSION + 1, &tried);
    if (!sq || tried != 2) {
        fprintf(stderr, "FAIL: no version 1 table after %u tries\n", tried);
        return 1;
    }
    const stepq_plugin_v1 *again = negotiate(get, STEPQ_PLUGIN_VERSION, &tried);
    EXPECT(again == sq && tried == 1, "newest known first: %u tries", tried);
    printf("stepq %s: plugin table version %u, %u B, name %s\n", sq->version_string(), sq->version,
           sq->size, sq->name);
    CHECK(sq->set_logger(logger, &logged));

    int ret = run(argv[2]);

    /* Unknown versions: NULL, and the reason names the version provided. */
    EXPECT(get(0) == NULL, "version 0 gave a table");
    EXPECT(strstr(sq->last_error(), "version 1"), "version 0: '%s'", sq->last_error());
    expect_failure(STEPQ_EVERSION, STEPQ_EVERSION, "plugin version 0");
    EXPECT(get(STEPQ_PLUGIN_VERSION + 1) == NULL, "version %d gave a table",
           STEPQ_PLUGIN_VERSION + 1);
    EXPECT(strstr(sq->last_error(), "version 1"), "version 2: '%s'", sq->last_error());
    expect_failure(STEPQ_EVERSION, STEPQ_EVERSION, "plugin version 2");

    /* No logger: failures log nothing, and the old callback is not called. */
    CHECK(sq->set_logger(NULL, NULL));
    EXPECT(get(0) == NULL, "version 0 gave a table");
    EXPECT(logged.n == 0, "%d messages after the logger was removed", logged.n);

    /* No dlclose(), as a server: stepq's handle table lives as long as the
     * process (stepq/plugin.h, "Unloading"). */
    if (ret || failures) {
        fprintf(stderr, "%d checks failed\n", failures + ret);
        return 1;
    }
    printf("ok\n");
    return 0;
}
