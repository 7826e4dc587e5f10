/*
 * stepq simulate [MAP]: the pool's lifecycle simulation (tests/harness/lifecycle_sim.h) as a
 * tool. Without a map the pool has small synthetic pages (the allocator and
 * the lifecycle are what is exercised); with one, the pages are the map's
 * real layout in host memory, (policy slots x B + 1) of them.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool/internal.h"
#include "tests/harness/lifecycle_sim.h"
#include "stepq/map.h"
#include "stepq/pool.h"
#include "tools/commands.h"

static void simulate_usage(FILE *f)
{
    fprintf(f, "usage: stepq simulate [MAP] [--requests N] [--seed S] [--policy P]\n"
               "                      [--max-running B] [--budget BYTES] [--abort-rate F]\n"
               "                      [--track-interval T] [--json]\n"
               "Runs a radix-caching server's request lifecycle (admission per policy, prefix\n"
               "hits with deferred copy-on-write, ping-pong tracking, cache insert, eviction,\n"
               "aborts) on a host pool, checking it against a shadow model at every tick.\n"
               "Defaults: 100000 requests, seed 1, extra_buffer, B = 16, T = 256.\n");
}

static int parse_num(const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;

    errno = 0;
    *out = strtoll(s, &end, 10);
    return errno || *end || end == s || *out < lo || *out > hi ? -1 : 0;
}

int stepq_tool_simulate(int argc, char **argv)
{
    struct stepq__sim_config cfg = STEPQ__SIM_CONFIG_DEFAULT;
    struct stepq__sim_stats st;
    stepq_pool_config pc = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool = NULL;
    stepq_map_t *map = NULL;
    const char *path = NULL;
    uint64_t budget = 0;
    int json = 0, ret;
    char err[1024];

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t n;

        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            simulate_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        } else if (a[0] != '-' && !path) {
            path = a;
            continue;
        } else if (!v) {
            static const char *const value_opts[] = { "--abort-rate",     "--budget",
                                                      "--max-running",    "--policy",
                                                      "--requests",       "--seed",
                                                      "--track-interval", NULL };
            return stepq_tool_missing_value("simulate", a, value_opts);
        }
        i++;
        if (!strcmp(a, "--requests") && !parse_num(v, 1, INT64_MAX / 2, &n)) {
            cfg.requests = n;
        } else if (!strcmp(a, "--seed") && !parse_num(v, 0, INT64_MAX, &n)) {
            cfg.seed = (uint64_t)n;
        } else if (!strcmp(a, "--max-running") && !parse_num(v, 1, 1 << 20, &n)) {
            cfg.max_running = (int)n;
        } else if (!strcmp(a, "--track-interval") && !parse_num(v, 1, 1 << 20, &n)) {
            cfg.track_interval = (int)n;
            cfg.chunk = 4 * (int)n;
        } else if (!strcmp(a, "--budget") && !parse_num(v, 1, INT64_MAX, &n)) {
            budget = (uint64_t)n;
        } else if (!strcmp(a, "--abort-rate")) {
            char *end;
            cfg.abort_rate = strtod(v, &end);
            /* !(x >= 0 && x <= 1) refuses NaN too, which every ordered comparison passes. */
            if (end == v || *end || !(cfg.abort_rate >= 0 && cfg.abort_rate <= 1)) {
                fprintf(stderr, "stepq simulate: --abort-rate '%s': want 0..1\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--policy")) {
            if (stepq_pool_policy_from_name(v, &cfg.policy) < 0) {
                fprintf(stderr, "stepq simulate: %s\n", stepq_last_error());
                return 2;
            }
        } else {
            fprintf(stderr, "stepq simulate: bad option or value: %s %s\n", a, v);
            simulate_usage(stderr);
            return 2;
        }
    }

    pc.policy = cfg.policy;
    if (budget)
        pc.memory_budget_bytes = budget;
    else
        pc.max_running_requests = cfg.max_running;
    if (path) {
        if ((ret = stepq_map_load_file(path, NULL, &map)) < 0) {
            fprintf(stderr, "stepq simulate: %s: %s\n", path, stepq_last_error());
            return 1;
        }
        pc.map = map;
        ret = stepq_pool_open(&pc, &pool);
    } else {
        /* 2 layers x 2 heads of 64 B + 2 x 32 B conv: 512 B pages. */
        static const uint32_t blocks[4] = { 64, 64, 64, 64 };
        struct stepq__pool_layout l;

        ret = stepq__pool_layout_synthetic(2, 2, blocks, 32, 16, 256, 0, &l);
        if (ret >= 0)
            ret = stepq__pool_open_layout(&pc, &l, &pool);
    }
    if (ret < 0) {
        fprintf(stderr, "stepq simulate: opening the pool: %s (%s)\n", stepq_last_error(),
                stepq_status_name(ret));
        stepq_map_close(map);
        return 1;
    }

    ret = stepq__sim_run(pool, &cfg, &st, err, sizeof(err));
    if (json) {
        printf("{\"ok\": %s, \"policy\": \"%s\", \"seed\": %" PRIu64 ", \"requests\": %" PRId64
               ", \"completed\": %" PRId64 ", \"aborted\": %" PRId64 ", \"ticks\": %" PRId64
               ", \"seconds\": %.3f, \"prefix_hits\": %" PRId64 ", \"prefix_misses\": %" PRId64
               ", \"cow_copies\": %" PRId64 ", \"track_copies\": %" PRId64 ", \"forks\": %" PRId64
               ", \"inserts\": %" PRId64 ", \"evictions\": %" PRId64
               ", \"admission_waits\": %" PRId64 ", \"track_skips\": %" PRId64
               ", \"pool_calls\": %" PRId64 ", \"checks\": %" PRId64
               ", \"injected_errors\": %" PRId64 ", \"capacity\": %d, \"high_water\": %d}\n",
               ret == STEPQ_OK ? "true" : "false", stepq_pool_policy_name(cfg.policy), cfg.seed,
               st.arrived, st.completed, st.aborted, st.ticks, st.seconds, st.prefix_hits,
               st.prefix_misses, st.cow_copies, st.track_copies, st.forks, st.inserts, st.evictions,
               st.admission_waits, st.track_skips, st.pool_ops, st.checks, st.injected_errors,
               st.capacity, st.max_in_use);
    } else {
        printf("policy %s, seed %" PRIu64 ", B = %d, pool of %d slots\n",
               stepq_pool_policy_name(cfg.policy), cfg.seed, cfg.max_running, st.capacity);
        printf("requests     %" PRId64 " (%" PRId64 " completed, %" PRId64 " aborted) in %.2f s, "
               "%" PRId64 " ticks\n",
               st.arrived, st.completed, st.aborted, st.seconds, st.ticks);
        printf("prefix       %" PRId64 " hits (deferred copy-on-write), %" PRId64 " misses\n",
               st.prefix_hits, st.prefix_misses);
        printf("cache        %" PRId64 " inserts, %" PRId64 " prefix forks, %" PRId64
               " evictions, %" PRId64 " duplicate inserts\n",
               st.inserts, st.forks, st.evictions, st.duplicate_inserts);
        printf("tracking     %" PRId64 " ping-pong copies, %" PRId64 " skipped\n", st.track_copies,
               st.track_skips);
        printf("admission    %" PRId64 " waits for slots, high water %d of %d\n",
               st.admission_waits, st.max_in_use, st.capacity);
        printf("checks       %" PRId64 " pool calls, %" PRId64 " full checks, %" PRId64
               " invalid calls refused\n",
               st.pool_ops, st.checks, st.injected_errors);
        printf("tokens       %" PRId64 " prefilled, %" PRId64 " decoded\n", st.tokens_prefilled,
               st.tokens_decoded);
    }
    if (ret != STEPQ_OK)
        fprintf(stderr, "stepq simulate: FAILED (%s): %s\n", stepq_status_name(ret), err);
    else if (stepq_pool_close(pool, 0) != STEPQ_OK) {
        fprintf(stderr, "stepq simulate: the pool does not close clean: %s\n", stepq_last_error());
        ret = STEPQ_EINTERNAL;
    } else {
        pool = NULL;
    }
    stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
    stepq_map_close(map);
    return ret == STEPQ_OK ? 0 : 1;
}
