/*
 * The lifecycle simulation (tests/harness/lifecycle_sim.c) as a test: a radix-caching server's
 * request lifecycle under every reservation policy, checked against a
 * shadow model at every tick. Seeds are fixed, plus one drawn per run and
 * printed (STEPQ_SIM_SEED=N reproduces a run).
 */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "pool/internal.h"
#include "tests/harness/lifecycle_sim.h"

static uint64_t random_seed;

/* A pool of small pages (4 blocks of 64 B + 2 x 32 B conv: 320 -> 512 B). */
static stepq_pool_t *open_pool(stepq_pool_policy policy, int max_running, uint64_t budget)
{
    static const uint32_t blocks[4] = { 64, 64, 64, 64 };
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    struct stepq__pool_layout l;
    stepq_pool_t *pool = NULL;

    assert_int_equal(stepq__pool_layout_synthetic(2, 2, blocks, 32, 16, 256, 0, &l), STEPQ_OK);
    cfg.policy = policy;
    if (budget)
        cfg.memory_budget_bytes = budget;
    else
        cfg.max_running_requests = max_running;
    assert_int_equal(stepq__pool_open_layout(&cfg, &l, &pool), STEPQ_OK);
    return pool;
}

static void run(stepq_pool_policy policy, int64_t requests, uint64_t seed, uint64_t budget,
                int64_t expect_min_requests)
{
    struct stepq__sim_config cfg = STEPQ__SIM_CONFIG_DEFAULT;
    struct stepq__sim_stats st;
    stepq_pool_t *pool;
    char err[512];
    int ret;

    cfg.policy = policy;
    cfg.requests = requests;
    cfg.seed = seed;
    pool = open_pool(policy, cfg.max_running, budget);
    ret = stepq__sim_run(pool, &cfg, &st, err, sizeof(err));
    printf("# %-12s seed %-20" PRIu64 " %7" PRId64 " requests (%" PRId64 " completed, %" PRId64
           " aborted) in %.2f s: %" PRId64 " ticks, %" PRId64 " hits / %" PRId64 " misses, %" PRId64
           " copy-on-write, %" PRId64 " tracks, %" PRId64 " forks, %" PRId64 " inserts, %" PRId64
           " evictions, %" PRId64 " waits, high water %d of %d, %" PRId64 " pool calls, %" PRId64
           " checks\n",
           stepq_pool_policy_name(policy), seed, st.arrived, st.completed, st.aborted, st.seconds,
           st.ticks, st.prefix_hits, st.prefix_misses, st.cow_copies, st.track_copies, st.forks,
           st.inserts, st.evictions, st.admission_waits, st.max_in_use, st.capacity, st.pool_ops,
           st.checks);
    if (ret != STEPQ_OK)
        fail_msg("simulation failed (%s): %s", stepq_status_name(ret), err);
    assert_int_equal(st.completed + st.aborted, requests);
    assert_true(st.completed >= expect_min_requests);
    assert_true(st.checks >= st.ticks);
    if (policy != STEPQ_POOL_POLICY_NO_CACHE) {
        /* The run exercised what it claims to: hits, evictions, invalid calls. */
        assert_true(st.prefix_hits > 0);
        assert_true(st.cow_copies > 0);
        assert_true(st.evictions > 0);
        assert_true(st.inserts > 0);
    }
    if (policy == STEPQ_POOL_POLICY_EXTRA_BUFFER || policy == STEPQ_POOL_POLICY_LAZY)
        assert_true(st.track_copies > 0);
    assert_true(st.injected_errors > 0);
    assert_true(st.aborted > 0);
    /* No leak: the pool closes without force. */
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);
}

static void extra_buffer_runs_100k_requests_without_a_leak_or_double_issue(void **state)
{
    run(STEPQ_POOL_POLICY_EXTRA_BUFFER, 100000, 1, 0, 90000);
}

static void extra_buffer_holds_under_a_random_seed(void **state)
{
    run(STEPQ_POOL_POLICY_EXTRA_BUFFER, 20000, random_seed, 0, 18000);
}

static void no_buffer_radix_cache_lifecycle_holds(void **state)
{
    run(STEPQ_POOL_POLICY_NO_BUFFER, 20000, 2, 0, 18000);
    run(STEPQ_POOL_POLICY_NO_BUFFER, 20000, random_seed + 1, 0, 18000);
}

static void lazy_tracking_lifecycle_holds(void **state)
{
    run(STEPQ_POOL_POLICY_LAZY, 20000, 3, 0, 18000);
    run(STEPQ_POOL_POLICY_LAZY, 20000, random_seed + 2, 0, 18000);
}

static void no_cache_lifecycle_holds(void **state)
{
    run(STEPQ_POOL_POLICY_NO_CACHE, 20000, 4, 0, 18000);
}

static void a_pool_smaller_than_the_reservation_still_serves_everyone(void **state)
{
    /* 20 pages of 512 B: 19 slots for B = 16 under extra_buffer (3 at admission). */
    run(STEPQ_POOL_POLICY_EXTRA_BUFFER, 10000, random_seed + 3, 20 * 512, 9000);
}

static void a_bad_configuration_is_refused(void **state)
{
    struct stepq__sim_config cfg = STEPQ__SIM_CONFIG_DEFAULT;
    struct stepq__sim_stats st;
    stepq_pool_t *pool = open_pool(STEPQ_POOL_POLICY_EXTRA_BUFFER, 4, 0);
    int32_t id;
    char err[256];

    cfg.chunk = 300; /* not a multiple of track_interval */
    assert_int_equal(stepq__sim_run(pool, &cfg, &st, err, sizeof(err)), STEPQ_EINVAL);
    cfg.chunk = 1024;
    assert_int_equal(stepq_pool_alloc(pool, 1, &id), STEPQ_OK); /* not empty */
    assert_int_equal(stepq__sim_run(pool, &cfg, &st, err, sizeof(err)), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);

    /* A pool too small for one request (2 pages of 512 B: one slot, extra_buffer
     * needs 3) is the caller's sizing, refused up front: not STEPQ_EINTERNAL. */
    pool = open_pool(STEPQ_POOL_POLICY_EXTRA_BUFFER, 0, 1024);
    assert_int_equal(stepq__sim_run(pool, &cfg, &st, err, sizeof(err)), STEPQ_ENOSPC);
    assert_non_null(strstr(err, "needs 3 for one request"));
    assert_int_equal(stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    /* A request count whose stall limit would wrap 64 bits. */
    pool = open_pool(STEPQ_POOL_POLICY_EXTRA_BUFFER, 4, 0);
    cfg.requests = INT64_MAX / 2;
    assert_int_equal(stepq__sim_run(pool, &cfg, &st, err, sizeof(err)), STEPQ_ERANGE);
    assert_int_equal(stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
}

int main(void)
{
    const char *env = getenv("STEPQ_SIM_SEED");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(extra_buffer_runs_100k_requests_without_a_leak_or_double_issue),
        cmocka_unit_test(extra_buffer_holds_under_a_random_seed),
        cmocka_unit_test(no_buffer_radix_cache_lifecycle_holds),
        cmocka_unit_test(lazy_tracking_lifecycle_holds),
        cmocka_unit_test(no_cache_lifecycle_holds),
        cmocka_unit_test(a_pool_smaller_than_the_reservation_still_serves_everyone),
        cmocka_unit_test(a_bad_configuration_is_refused),
    };

    random_seed =
        env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)clock();
    printf("# random seed %" PRIu64 " (STEPQ_SIM_SEED=%" PRIu64 " repeats it)\n", random_seed,
           random_seed);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
