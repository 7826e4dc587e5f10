/*
 * stepq simulate [MAP]: the pool's lifecycle simulation (tests/harness/lifecycle_sim.h) as a
 * tool. Without a map the pool has small synthetic pages (the allocator and
 * the lifecycle are what is exercised); with one, the pages are the map's
 * real layout in host memory, (policy slots x B + 1) of them.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool/internal.h"
#include "tests/harness/lifecycle_sim.h"
#include "stepq/map.h"
#include "stepq/pool.h"
#include "tools/cli.h"
#include "tools/commands.h"

/* With a map the pages are real (the 27B map: 80 pages of 31 MiB, about 8 ms a request on
 * one core, 27 on a slower one), so the default there is a run of seconds; without one, 100,000
 * take 0.3 s. */
#define MAP_DEFAULT_REQUESTS 200

static void simulate_usage(FILE *f)
{
    fprintf(f,
            "usage: stepq simulate [MAP] [--requests N] [--seed S] [--policy P]\n"
            "                      [--max-running B] [--budget BYTES] [--abort-rate F]\n"
            "                      [--track-interval T] [--json] [-o FILE]\n"
            "Runs a radix-caching server's request lifecycle (admission per policy, prefix\n"
            "hits with deferred copy-on-write, ping-pong tracking, cache insert, eviction,\n"
            "aborts) on a host pool, checking it against a shadow model at every tick.\n"
            "Defaults: 100000 requests (%d with MAP: its pages are real memory), seed 1,\n"
            "extra_buffer, B = 16, T = 256. --json: the counts as JSON; -o: into FILE.\n"
            "Progress on stderr (STEPQ_PROGRESS=off|bar|lines).\n",
            MAP_DEFAULT_REQUESTS);
}

static void sim_progress(void *arg, int64_t finished, int64_t requests)
{
    (void)requests;
    stepq_tool_progress_set(arg, finished);
}

int stepq_tool_simulate(int argc, char **argv)
{
    struct stepq__sim_config cfg = STEPQ__SIM_CONFIG_DEFAULT;
    struct stepq__sim_stats st;
    stepq_pool_config pc = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool = NULL;
    stepq_map_t *map = NULL;
    const char *path = NULL, *out_path = NULL;
    uint64_t budget = 0;
    int json = 0, have_requests = 0, ret;
    struct stepq_tool_progress prog;
    struct stepq_tool_out out;
    FILE *f;
    char err[1024];

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long long n;

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
            static const char *const value_opts[] = {
                "--abort-rate",     "--budget",   "--max-running",
                "--policy",         "--requests", "--seed",
                "--track-interval", "-o",         NULL
            };
            return stepq_tool_missing_value("simulate", a, value_opts);
        }
        i++;
        if (!strcmp(a, "-o")) {
            out_path = v;
        } else if (!strcmp(a, "--requests")) {
            if (stepq_tool_int("simulate", a, v, 1, INT64_MAX / 2, &n) < 0)
                return 2;
            cfg.requests = n;
            have_requests = 1;
        } else if (!strcmp(a, "--seed")) {
            if (stepq_tool_int("simulate", a, v, 0, INT64_MAX, &n) < 0)
                return 2;
            cfg.seed = (uint64_t)n;
        } else if (!strcmp(a, "--max-running")) {
            if (stepq_tool_int("simulate", a, v, 1, 1 << 20, &n) < 0)
                return 2;
            cfg.max_running = (int)n;
        } else if (!strcmp(a, "--track-interval")) {
            if (stepq_tool_int("simulate", a, v, 1, 1 << 20, &n) < 0)
                return 2;
            cfg.track_interval = (int)n;
            cfg.chunk = 4 * (int)n;
        } else if (!strcmp(a, "--budget")) {
            if (stepq_tool_int("simulate", a, v, 1, INT64_MAX, &n) < 0)
                return 2;
            budget = (uint64_t)n;
        } else if (!strcmp(a, "--abort-rate")) {
            if (stepq_tool_real("simulate", a, v, 0, 1, 0, &cfg.abort_rate) < 0)
                return 2;
        } else if (!strcmp(a, "--policy")) {
            if (stepq_pool_policy_from_name(v, &cfg.policy) < 0) {
                fprintf(stderr, "stepq simulate: %s\n", stepq_last_error());
                return 2;
            }
        } else {
            fprintf(stderr, "stepq simulate: unknown option '%s' (see stepq simulate --help)\n", a);
            return 2;
        }
    }

    if (!(f = stepq_tool_out_open(&out, "simulate", out_path)))
        return 1;
    pc.policy = cfg.policy;
    if (budget)
        pc.memory_budget_bytes = budget;
    else
        pc.max_running_requests = cfg.max_running;
    if (path && !have_requests)
        cfg.requests = MAP_DEFAULT_REQUESTS;
    if (path) {
        if ((ret = stepq_map_load_file(path, NULL, &map)) < 0) {
            stepq_tool_path_error("simulate", path, NULL, stepq_last_error(), ret);
            stepq_tool_out_discard(&out);
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
        stepq_tool_out_discard(&out);
        stepq_map_close(map);
        return 1;
    }

    if (map) {
        /* The map's pages are real memory: say how much before the work. */
        stepq_pool_stats ps;
        if (stepq_pool_get_stats(pool, &ps, sizeof(ps)) == STEPQ_OK)
            fprintf(stderr,
                    "stepq simulate: %" PRId64 " requests on a host pool of %d + 1 pages of "
                    "%.1f MiB (%.2f GiB)\n",
                    cfg.requests, ps.capacity, (double)ps.page_bytes / (1 << 20),
                    (double)ps.pool_bytes / (1 << 30));
    }
    stepq_tool_progress_begin(&prog, "simulate", "requests", cfg.requests);
    cfg.progress = sim_progress;
    cfg.progress_arg = &prog;
    ret = stepq__sim_run(pool, &cfg, &st, err, sizeof(err));
    stepq_tool_progress_end(&prog);
    if (json) {
        fprintf(f,
                "{\"ok\": %s, \"policy\": \"%s\", \"seed\": %" PRIu64 ", \"requests\": %" PRId64
                ", \"completed\": %" PRId64 ", \"aborted\": %" PRId64 ", \"ticks\": %" PRId64
                ", \"seconds\": %.3f, \"prefix_hits\": %" PRId64 ", \"prefix_misses\": %" PRId64
                ", \"cow_copies\": %" PRId64 ", \"track_copies\": %" PRId64 ", \"forks\": %" PRId64
                ", \"inserts\": %" PRId64 ", \"evictions\": %" PRId64
                ", \"admission_waits\": %" PRId64 ", \"track_skips\": %" PRId64
                ", \"pool_calls\": %" PRId64 ", \"checks\": %" PRId64
                ", \"injected_errors\": %" PRId64 ", \"capacity\": %d, \"high_water\": %d}\n",
                ret == STEPQ_OK ? "true" : "false", stepq_pool_policy_name(cfg.policy), cfg.seed,
                st.arrived, st.completed, st.aborted, st.ticks, st.seconds, st.prefix_hits,
                st.prefix_misses, st.cow_copies, st.track_copies, st.forks, st.inserts,
                st.evictions, st.admission_waits, st.track_skips, st.pool_ops, st.checks,
                st.injected_errors, st.capacity, st.max_in_use);
    } else {
        fprintf(f, "policy %s, seed %" PRIu64 ", B = %d, pool of %d slots\n",
                stepq_pool_policy_name(cfg.policy), cfg.seed, cfg.max_running, st.capacity);
        fprintf(f,
                "requests     %" PRId64 " (%" PRId64 " completed, %" PRId64 " aborted) in %.2f s, "
                "%" PRId64 " ticks\n",
                st.arrived, st.completed, st.aborted, st.seconds, st.ticks);
        fprintf(f, "prefix       %" PRId64 " hits (deferred copy-on-write), %" PRId64 " misses\n",
                st.prefix_hits, st.prefix_misses);
        fprintf(f,
                "cache        %" PRId64 " inserts, %" PRId64 " prefix forks, %" PRId64
                " evictions, %" PRId64 " duplicate inserts\n",
                st.inserts, st.forks, st.evictions, st.duplicate_inserts);
        fprintf(f, "tracking     %" PRId64 " ping-pong copies, %" PRId64 " skipped\n",
                st.track_copies, st.track_skips);
        fprintf(f, "admission    %" PRId64 " waits for slots, high water %d of %d\n",
                st.admission_waits, st.max_in_use, st.capacity);
        fprintf(f,
                "checks       %" PRId64 " pool calls, %" PRId64 " full checks, %" PRId64
                " invalid calls refused\n",
                st.pool_ops, st.checks, st.injected_errors);
        fprintf(f, "tokens       %" PRId64 " prefilled, %" PRId64 " decoded\n", st.tokens_prefilled,
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
    /* A failed run's report is kept: it says how far the run got. */
    if (stepq_tool_out_commit(&out, "simulate") < 0)
        ret = STEPQ_EIO;
    stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
    stepq_map_close(map);
    return ret == STEPQ_OK ? 0 : 1;
}
