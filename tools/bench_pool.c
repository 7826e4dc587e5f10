/*
 * stepq bench pool: what the pool costs a server.
 *   - alloc/free operations per second (host bookkeeping; 1 and 4 threads)
 *   - copy and clear throughput for 1..512 slots per call, on the CUDA
 *     backend (skipped with a message without a device) and on the host.
 * Copy GB/s counts bytes read + written (2 x pages x page bytes), clear
 * counts bytes written. Each size runs until --min-ms of work has passed.
 */
#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "pool/internal.h"
#include "stepq/map.h"
#include "stepq/pool.h"
#include "tools/cli.h"
#include "tools/commands.h"

/* The paper's stepq@6 slot (Qwen3.8-27B, 31.4375 MiB): the default page of the copy benchmarks. */
#define DEFAULT_PAGE_BYTES 32964608ull
#define MAX_SIZES          16

static void bench_pool_usage(FILE *f)
{
    fprintf(f,
            "usage: stepq bench pool [--map MAP] [--page-bytes N] [--slots 1,2,4,...,512]\n"
            "                        [--backend host|cuda|both] [--min-ms MS] [--json] [-o FILE]\n"
            "Without --backend: cuda where a device exists, else host. Host pools are kept\n"
            "within a quarter of the machine's memory unless --slots says otherwise.\n"
            "alloc/free ops/s on the CPU; copy and clear GB/s for N slots per call.\n"
            "Pages come from MAP's layout, else --page-bytes (default %llu, the\n"
            "Qwen3.8-27B stepq@6 slot). CUDA needs (2 x max slots + 1) pages of memory.\n"
            "--json: the numbers as JSON instead of the tables; -o: into FILE. Progress per\n"
            "measurement on stderr (STEPQ_PROGRESS=off|bar|lines).\n",
            DEFAULT_PAGE_BYTES);
}

/*
 * --json: the tables go nowhere (out = NULL) and the numbers into one JSON
 * document printed on stdout at the end; messages stay on stderr.
 */
static FILE *out;
static cJSON *jroot;
static struct stepq_tool_progress prog; /* one step per measurement */

static double now_s(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int open_pool(const stepq_map_t *map, uint64_t page_bytes, stepq_pool_backend backend,
                     int32_t slots, stepq_pool_t **pool)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    struct stepq__pool_layout l;
    uint32_t block;
    int ret;

    cfg.backend = backend;
    cfg.num_slots = slots;
    if (map) {
        cfg.map = map;
        return stepq_pool_open(&cfg, pool);
    }
    /* One layer of 16 KiB blocks plus the remainder as conv state. */
    block = 16384;
    {
        int heads = (int)(page_bytes / block);
        uint32_t *b = malloc(sizeof(*b) * (size_t)(heads ? heads : 1));
        if (!b)
            return STEPQ_ENOMEM;
        for (int i = 0; i < heads; i++)
            b[i] = block;
        ret = stepq__pool_layout_synthetic(1, heads, b, page_bytes - (uint64_t)heads * block, 16,
                                           256, 0, &l);
        free(b);
    }
    if (ret < 0)
        return ret;
    return stepq__pool_open_layout(&cfg, &l, pool);
}

/* --- alloc / free rate ------------------------------------------------------ */

struct rate_arg {
    stepq_pool_t *pool;
    int32_t batch;
    double seconds;
    uint64_t ops;
    int failed;
};

static void *rate_main(void *p)
{
    struct rate_arg *a = p;
    int32_t ids[64];
    double t0 = now_s();

    while (now_s() - t0 < a->seconds) {
        for (int k = 0; k < 1000; k++) {
            if (stepq_pool_alloc(a->pool, a->batch, ids) != STEPQ_OK ||
                stepq_pool_free(a->pool, ids, a->batch) != STEPQ_OK) {
                a->failed = 1;
                return NULL;
            }
        }
        a->ops += 2000;
    }
    return NULL;
}

/*
 * Calls/s by thread count: threads on one shared pool, and threads on a pool
 * each (calls on different pools share no lock, so these should scale with
 * the cores); then one thread with 10,000 other pools open (a call's cost
 * must not depend on how many pools exist).
 */
static int run_rate(stepq_pool_t **pools, int n_threads, int32_t batch, double seconds,
                    double *calls_s)
{
    struct rate_arg a[8];
    pthread_t th[8];
    uint64_t ops = 0;
    double t0 = now_s();
    int failed = 0;

    for (int i = 0; i < n_threads; i++) {
        a[i] = (struct rate_arg){ pools[i], batch, seconds, 0, 0 };
        pthread_create(&th[i], NULL, rate_main, &a[i]);
    }
    for (int i = 0; i < n_threads; i++) {
        pthread_join(th[i], NULL);
        ops += a[i].ops;
        if (a[i].failed) {
            fprintf(stderr, "stepq bench pool: %s\n", stepq_pool_last_error(pools[i]));
            failed = 1;
        }
    }
    *calls_s = (double)ops / (now_s() - t0);
    return failed ? -1 : 0;
}

static int bench_rate(double seconds)
{
    static const int threads[] = { 1, 2, 4, 8 };
    static const int32_t batches[] = { 1, 8, 64 };
    enum { N_OTHER = 10000 };
    stepq_pool_t *own[8] = { 0 }, *shared[8], **other = NULL;
    int ret = 0;

    for (int i = 0; i < 8 && ret >= 0; i++)
        ret = open_pool(NULL, 4096, STEPQ_POOL_BACKEND_HOST, 4096, &own[i]);
    if (ret < 0) {
        fprintf(stderr, "stepq bench pool: %s\n", stepq_last_error());
        goto out;
    }
    for (int i = 0; i < 8; i++)
        shared[i] = own[0];
    stepq_tool_printf(out, "alloc/free on the host (one alloc + one free = 2 calls; %d cores)\n",
                      (int)sysconf(_SC_NPROCESSORS_ONLN));
    stepq_tool_printf(out, "%8s %8s %16s %16s %10s\n", "threads", "slots", "calls/s shared",
                      "calls/s own", "own/1 thr");
    for (size_t b = 0; b < sizeof(batches) / sizeof(batches[0]); b++) {
        double one = 0;
        for (size_t t = 0; t < sizeof(threads) / sizeof(threads[0]); t++) {
            double cs, co;
            if (run_rate(shared, threads[t], batches[b], seconds, &cs) < 0 ||
                run_rate(own, threads[t], batches[b], seconds, &co) < 0) {
                ret = -1;
                goto out;
            }
            if (t == 0)
                one = co;
            if (jroot) {
                cJSON *r = cJSON_CreateObject();
                cJSON_AddNumberToObject(r, "threads", threads[t]);
                cJSON_AddNumberToObject(r, "slots_per_call", batches[b]);
                cJSON_AddNumberToObject(r, "calls_per_s_shared_pool", cs);
                cJSON_AddNumberToObject(r, "calls_per_s_pool_per_thread", co);
                cJSON_AddItemToArray(cJSON_GetObjectItem(jroot, "alloc_free"), r);
            }
            stepq_tool_printf(out, "%8d %8" PRId32 " %16.3e %16.3e %9.2fx\n", threads[t],
                              batches[b], cs, co, co / one);
            stepq_tool_progress_add(&prog, 1);
        }
    }
    other = calloc(N_OTHER, sizeof(*other));
    for (int i = 0; other && i < N_OTHER && ret >= 0; i++)
        ret = open_pool(NULL, 256, STEPQ_POOL_BACKEND_HOST, 1, &other[i]);
    if (!other || ret < 0) {
        fprintf(stderr, "stepq bench pool: %s\n", other ? stepq_last_error() : "out of memory");
        ret = -1;
        goto out;
    }
    {
        double cs;
        if (run_rate(own, 1, 1, seconds, &cs) < 0) {
            ret = -1;
            goto out;
        }
        if (jroot) {
            cJSON *r = cJSON_CreateObject();
            cJSON_AddNumberToObject(r, "other_pools_open", N_OTHER);
            cJSON_AddNumberToObject(r, "calls_per_s", cs);
            cJSON_AddItemToObject(jroot, "alloc_free_many_pools", r);
        }
        stepq_tool_printf(out, "%8d %8d %16.3e   (with %d other pools open)\n", 1, 1, cs, N_OTHER);
        stepq_tool_progress_add(&prog, 1);
    }
out:
    for (int i = 0; other && i < N_OTHER; i++)
        stepq_pool_close(other[i], STEPQ_POOL_CLOSE_FORCE);
    free(other);
    for (int i = 0; i < 8; i++)
        stepq_pool_close(own[i], STEPQ_POOL_CLOSE_FORCE);
    return ret < 0 ? 1 : 0;
}

/* --- copy / clear throughput ------------------------------------------------ */

static int bench_moves(const char *name, stepq_pool_t *pool, const int *sizes, int n_sizes,
                       double min_s)
{
    stepq_pool_stats st;
    int32_t *ids;
    int max = 0;

    stepq_pool_get_stats(pool, &st, sizeof(st));
    for (int i = 0; i < n_sizes; i++)
        if (sizes[i] > max)
            max = sizes[i];
    ids = malloc(sizeof(*ids) * (size_t)st.capacity);
    if (!ids || stepq_pool_alloc(pool, st.capacity, ids) < 0) {
        fprintf(stderr, "stepq bench pool: %s\n", stepq_last_error());
        free(ids);
        return 1;
    }
    stepq_tool_printf(out, "\n%s backend, page %" PRIu64 " B (%.4f MiB)\n", name, st.page_bytes,
                      (double)st.page_bytes / 1048576.0);
    stepq_tool_printf(out, "%8s %14s %12s %14s %12s\n", "slots", "copy us/call", "copy GB/s",
                      "clear us/call", "clear GB/s");
    for (int i = 0; i < n_sizes; i++) {
        int32_t n = sizes[i];
        double t_copy = 0, t_clear = 0;
        long iters;

        stepq_tool_progress_add(&prog, 1);
        if (2 * n > st.capacity)
            continue;
        for (int pass = 0; pass < 2; pass++) {
            double t0, dt;
            /* warm up, then time enough calls to pass min_s */
            iters = 0;
            stepq_pool_sync(pool);
            t0 = now_s();
            do {
                int ret = pass == 0 ? stepq_pool_copy(pool, ids, ids + n, n)
                                    : stepq_pool_clear(pool, ids + n, n);
                if (ret < 0) {
                    fprintf(stderr, "stepq bench pool: %s\n", stepq_last_error());
                    free(ids);
                    return 1;
                }
                iters++;
                if (iters % 16 == 0 || iters < 16)
                    stepq_pool_sync(pool);
            } while (now_s() - t0 < min_s || iters < 3);
            stepq_pool_sync(pool);
            dt = (now_s() - t0) / (double)iters;
            if (pass == 0)
                t_copy = dt;
            else
                t_clear = dt;
        }
        if (jroot) {
            cJSON *r = cJSON_CreateObject(), *arr = cJSON_GetObjectItem(jroot, name);
            if (!arr)
                cJSON_AddItemToObject(jroot, name, arr = cJSON_CreateArray());
            cJSON_AddNumberToObject(r, "slots", n);
            cJSON_AddNumberToObject(r, "page_bytes", (double)st.page_bytes);
            cJSON_AddNumberToObject(r, "copy_us", t_copy * 1e6);
            cJSON_AddNumberToObject(r, "copy_gb_s", 2.0 * n * (double)st.page_bytes / t_copy / 1e9);
            cJSON_AddNumberToObject(r, "clear_us", t_clear * 1e6);
            cJSON_AddNumberToObject(r, "clear_gb_s",
                                    (double)n * (double)st.page_bytes / t_clear / 1e9);
            cJSON_AddItemToArray(arr, r);
        }
        stepq_tool_printf(out, "%8" PRId32 " %14.1f %12.1f %14.1f %12.1f\n", n, t_copy * 1e6,
                          2.0 * n * (double)st.page_bytes / t_copy / 1e9, t_clear * 1e6,
                          (double)n * (double)st.page_bytes / t_clear / 1e9);
    }
    stepq_pool_free(pool, ids, st.capacity);
    free(ids);
    return 0;
}

int stepq_tool_bench_pool(int argc, char **argv)
{
    static int sizes[MAX_SIZES] = { 1, 2, 4, 8, 16, 32, 64, 128, 256, 512 };
    int n_sizes = 10, max = 512, do_host = 0, do_cuda = 0, rc = 0, chosen = 0, sized = 0, json = 0;
    uint64_t page_bytes = DEFAULT_PAGE_BYTES;
    double min_s = 0.2;
    const char *out_path = NULL;
    struct stepq_tool_out of;
    long long n;
    stepq_map_t *map = NULL;
    stepq_pool_t *pool = NULL;
    int ret;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;

        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_pool_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        }
        if (!v) {
            static const char *const value_opts[] = {
                "--backend", "--map", "--min-ms", "--page-bytes", "--slots", "-o", NULL
            };
            return stepq_tool_missing_value("bench pool", a, value_opts);
        }
        i++;
        if (!strcmp(a, "-o")) {
            out_path = v;
        } else if (!strcmp(a, "--map")) {
            stepq_map_close(map);
            map = NULL;
            if ((ret = stepq_map_load_file(v, NULL, &map)) < 0) {
                stepq_tool_path_error("bench pool", v, NULL, stepq_last_error(), ret);
                return 1;
            }
        } else if (!strcmp(a, "--page-bytes")) {
            /* strtoull took "-5" for 2^64 - 5. */
            if (stepq_tool_int("bench pool", a, v, 256, INT64_MAX, &n) < 0)
                return 2;
            page_bytes = (uint64_t)n;
        } else if (!strcmp(a, "--slots")) {
            char *s = (char *)v, *end;
            sized = 1;
            n_sizes = 0;
            max = 0;
            while (*s) {
                long x = strtol(s, &end, 10);
                if (end == s || x < 1 || x > 1 << 16 || (*end && *end != ',') ||
                    n_sizes == MAX_SIZES) {
                    fprintf(stderr,
                            "stepq bench pool: --slots '%s': want up to %d counts in [1, %d], "
                            "e.g. 1,2,4\n",
                            v, MAX_SIZES, 1 << 16);
                    return 2;
                }
                sizes[n_sizes++] = (int)x;
                max = x > max ? (int)x : max;
                s = *end ? end + 1 : end;
            }
            if (!n_sizes) {
                fprintf(stderr, "stepq bench pool: --slots '': want counts, e.g. 1,2,4\n");
                return 2;
            }
        } else if (!strcmp(a, "--backend")) {
            do_host = !strcmp(v, "host") || !strcmp(v, "both");
            do_cuda = !strcmp(v, "cuda") || !strcmp(v, "both");
            chosen = 1;
            if (!do_host && !do_cuda) {
                fprintf(stderr, "stepq bench pool: --backend host, cuda or both\n");
                return 2;
            }
        } else if (!strcmp(a, "--min-ms")) {
            double ms;
            if (stepq_tool_real("bench pool", a, v, 0, 600000, STEPQ_TOOL_OPEN_LO, &ms) < 0)
                return 2;
            min_s = ms / 1000.0;
        } else {
            fprintf(stderr, "stepq bench pool: unknown option '%s'\n", a);
            bench_pool_usage(stderr);
            return 2;
        }
    }

    /* Without --backend: the CUDA backend where a device exists, else the host. */
    if (!chosen) {
        stepq_pool_t *probe = NULL;
        ret = open_pool(NULL, 4096, STEPQ_POOL_BACKEND_CUDA, 1, &probe);
        do_cuda = ret >= 0;
        do_host = !do_cuda;
        if (probe)
            stepq_pool_close(probe, STEPQ_POOL_CLOSE_FORCE);
        if (!do_cuda)
            fprintf(stderr, "stepq bench pool: %s; benchmarking the host backend\n",
                    stepq_last_error());
    }
    /* The host pools hold 2 x max + 1 pages: keep them within a quarter of the
     * machine's memory unless --slots asked for more. */
    if (do_host && !sized) {
        uint64_t pg = map ? 0 : page_bytes, mem = 0;
        long np = sysconf(_SC_PHYS_PAGES), ps = sysconf(_SC_PAGESIZE);
        if (map) {
            stepq_pool_config pc = STEPQ_POOL_CONFIG_INITIALIZER;
            stepq_pool_plan_info plan;
            pc.map = map;
            pc.num_slots = 1;
            if (stepq_pool_plan(&pc, &plan) == STEPQ_OK)
                pg = plan.page_bytes;
        }
        if (np > 0 && ps > 0)
            mem = (uint64_t)np * (uint64_t)ps;
        if (pg && mem) {
            uint64_t fit = (mem / 4 / pg - 1) / 2;
            if (fit < (uint64_t)max) {
                while (n_sizes > 1 && (uint64_t)sizes[n_sizes - 1] > fit)
                    n_sizes--;
                max = sizes[n_sizes - 1];
                fprintf(stderr,
                        "stepq bench pool: up to %d slots per call, so that the host pools fit "
                        "in a quarter of this machine's %.1f GiB (--slots for more)\n",
                        max, (double)mem / (1u << 30));
            }
        }
    }
    FILE *f = stepq_tool_out_open(&of, "bench pool", out_path);
    if (!f) {
        stepq_map_close(map);
        return 1;
    }
    out = json ? NULL : f;
    stepq_tool_progress_begin(&prog, "bench pool", "measurements",
                              13 + (int64_t)n_sizes * (do_cuda + do_host));
    if (json) {
        jroot = cJSON_CreateObject();
        cJSON_AddItemToObject(jroot, "alloc_free", cJSON_CreateArray());
        cJSON_AddNumberToObject(jroot, "cores", (double)sysconf(_SC_NPROCESSORS_ONLN));
    }
    if (bench_rate(min_s * 5) != 0)
        rc = 1;
    if (do_cuda) {
        ret = open_pool(map, page_bytes, STEPQ_POOL_BACKEND_CUDA, 2 * max + 1, &pool);
        if (ret == STEPQ_ENODEV || ret == STEPQ_ENOTSUP) {
            fprintf(stderr, "stepq bench pool: cuda backend: skipped (%s)\n", stepq_last_error());
        } else if (ret < 0) {
            fprintf(stderr, "stepq bench pool: cuda pool: %s\n", stepq_last_error());
            rc = 1;
        } else {
            rc |= bench_moves("cuda", pool, sizes, n_sizes, min_s);
            stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
        }
    }
    if (do_host) {
        ret = open_pool(map, page_bytes, STEPQ_POOL_BACKEND_HOST, 2 * max + 1, &pool);
        if (ret < 0) {
            fprintf(stderr, "stepq bench pool: host pool: %s\n", stepq_last_error());
            rc = 1;
        } else {
            rc |= bench_moves("host", pool, sizes, n_sizes, min_s);
            stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
        }
    }
    stepq_tool_progress_end(&prog);
    stepq_map_close(map);
    if (jroot) {
        char *text = cJSON_Print(jroot);
        if (text)
            fprintf(f, "%s\n", text);
        else
            rc = 1;
        free(text);
        cJSON_Delete(jroot);
        jroot = NULL;
    }
    if (stepq_tool_out_commit(&of, "bench pool") < 0)
        rc = 1;
    return rc;
}
