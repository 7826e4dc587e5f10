/*
 * The plugin table and the logger from inside the library: version
 * negotiation (which versions give a table, what an unknown one says), the
 * table's members being the public functions themselves, and the logger's
 * contract (one message per failing call, equal to stepq_last_error(),
 * nothing for successful calls, no recursion, stepq_set_logger() refused
 * from the callback, and never a call into a logger that was replaced, from
 * any thread). tests/plugin/host.c is the same table seen from a dlopen host.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "stepq/stepq.h"
#include "tests/config/fixtures.h"

/* --- version negotiation -------------------------------------------------- */

static void unknown_versions_give_null_and_name_the_provided_ones(void **state)
{
    const uint32_t bad[] = { 0, STEPQ_PLUGIN_VERSION + 1, 1000, UINT32_MAX };

    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char want[160];

        assert_null(stepq_plugin_get(bad[i]));
        snprintf(want, sizeof(want),
                 "stepq_plugin_get: plugin version %u is not provided; this stepq provides "
                 "version 1",
                 bad[i]);
        assert_string_equal(stepq_last_error(), want);
    }
}

static void version_1_is_the_public_api(void **state)
{
    const stepq_plugin_v1 *p = stepq_plugin_get(1);

    assert_non_null(p);
    assert_ptr_equal(stepq_plugin_get(1), p); /* one static table */
    assert_int_equal(p->size, sizeof(stepq_plugin_v1));
    assert_int_equal(p->version, 1);
    assert_string_equal(p->name, "stepq");
    /* The frozen header every version begins with. */
    assert_int_equal(offsetof(stepq_plugin_v1, size), 0);
    assert_int_equal(offsetof(stepq_plugin_v1, version), 4);
    assert_int_equal(offsetof(stepq_plugin_v1, name), 8);

    /* Every member is the public function of its name: no wrapper. */
    assert_true(p->version_number == stepq_version);
    assert_true(p->version_string == stepq_version_string);
    assert_true(p->status_name == stepq_status_name);
    assert_true(p->strerror == stepq_strerror);
    assert_true(p->last_error == stepq_last_error);
    assert_true(p->set_logger == stepq_set_logger);
    assert_true(p->map_load_file == stepq_map_load_file);
    assert_true(p->map_load_buffer == stepq_map_load_buffer);
    assert_true(p->map_close == stepq_map_close);
    assert_true(p->map_shape == stepq_map_shape);
    assert_true(p->map_budget_bits == stepq_map_budget_bits);
    assert_true(p->map_unit_stats == stepq_map_unit_stats);
    assert_true(p->map_fingerprint == stepq_map_fingerprint);
    assert_true(p->map_last_error == stepq_map_last_error);
    assert_true(p->pool_plan == stepq_pool_plan);
    assert_true(p->pool_open == stepq_pool_open);
    assert_true(p->pool_close == stepq_pool_close);
    assert_true(p->pool_alloc == stepq_pool_alloc);
    assert_true(p->pool_free == stepq_pool_free);
    assert_true(p->pool_clear == stepq_pool_clear);
    assert_true(p->pool_copy == stepq_pool_copy);
    assert_true(p->pool_copy_to_host == stepq_pool_copy_to_host);
    assert_true(p->pool_copy_from_host == stepq_pool_copy_from_host);
    assert_true(p->pool_sync == stepq_pool_sync);
    assert_true(p->pool_buffer_infos == stepq_pool_buffer_infos);
    assert_true(p->pool_health_words == stepq_pool_health_words);
    assert_true(p->pool_health_read == stepq_pool_health_read);
    assert_true(p->pool_get_stats == stepq_pool_get_stats);
    assert_true(p->pool_get_layout == stepq_pool_get_layout);
    assert_true(p->pool_is_allocated == stepq_pool_is_allocated);
    assert_true(p->pool_last_error == stepq_pool_last_error);
    assert_true(p->pool_supports == stepq_pool_supports);
    assert_true(p->pool_decode_step == stepq_pool_decode_step);
    assert_true(p->pool_prefill_pack == stepq_pool_prefill_pack);
    assert_true(p->pool_prefill_unpack == stepq_pool_prefill_unpack);
    assert_true(p->pool_conv_state == stepq_pool_conv_state);

    /* And none is missing: the members after the header are all set (a
     * member added to the struct but not to the table fails here). */
    for (size_t at = offsetof(stepq_plugin_v1, version_number); at < sizeof(*p);
         at += sizeof(void (*)(void))) {
        void (*fn)(void);

        memcpy(&fn, (const char *)p + at, sizeof(fn));
        assert_non_null(fn);
    }
}

/*
 * Version 1 as released: its members in this order, one pointer each after
 * the 16-byte header. A member inserted, removed or moved (instead of
 * appended in a version 2) fails here.
 */
/* clang-format off */
#define MEMBER(m) { #m, offsetof(stepq_plugin_v1, m), sizeof(((stepq_plugin_v1 *)0)->m) }
/* clang-format on */
static const struct {
    const char *name;
    size_t offset, size;
} v1_members[] = {
    MEMBER(version_number),    MEMBER(version_string),      MEMBER(status_name),
    MEMBER(strerror),          MEMBER(last_error),          MEMBER(set_logger),
    MEMBER(map_load_file),     MEMBER(map_load_buffer),     MEMBER(map_close),
    MEMBER(map_shape),         MEMBER(map_budget_bits),     MEMBER(map_unit_stats),
    MEMBER(map_fingerprint),   MEMBER(map_last_error),      MEMBER(pool_plan),
    MEMBER(pool_open),         MEMBER(pool_close),          MEMBER(pool_alloc),
    MEMBER(pool_free),         MEMBER(pool_clear),          MEMBER(pool_copy),
    MEMBER(pool_copy_to_host), MEMBER(pool_copy_from_host), MEMBER(pool_sync),
    MEMBER(pool_buffer_infos), MEMBER(pool_health_words),   MEMBER(pool_health_read),
    MEMBER(pool_get_stats),    MEMBER(pool_get_layout),     MEMBER(pool_is_allocated),
    MEMBER(pool_last_error),   MEMBER(pool_supports),       MEMBER(pool_decode_step),
    MEMBER(pool_prefill_pack), MEMBER(pool_prefill_unpack), MEMBER(pool_conv_state),
};
#undef MEMBER

static void version_1_layout_is_frozen(void **state)
{
    const size_t n = sizeof(v1_members) / sizeof(v1_members[0]);
    size_t at = 2 * sizeof(uint32_t) + sizeof(const char *); /* size, version, name */

    assert_int_equal(n, 36);
    for (size_t i = 0; i < n; i++) {
        if (v1_members[i].offset != at)
            fail_msg("%s is at %zu, not %zu", v1_members[i].name, v1_members[i].offset, at);
        assert_int_equal(v1_members[i].size, sizeof(void (*)(void)));
        at += v1_members[i].size;
    }
    assert_int_equal(sizeof(stepq_plugin_v1), at);
}

/* --- the logger ------------------------------------------------------------ */

static struct {
    int n, level;
    char msg[512];
} got;

static void record(void *user, int level, const char *msg)
{
    assert_ptr_equal(user, &got);
    got.n++;
    got.level = level;
    snprintf(got.msg, sizeof(got.msg), "%s", msg);
}

/* The failure just made was logged once, at error level, as stepq_last_error(). */
static void assert_logged_once(int status)
{
    assert_true(status < 0);
    assert_int_equal(got.n, 1);
    assert_int_equal(got.level, STEPQ_LOG_ERROR);
    assert_string_equal(got.msg, stepq_last_error());
    got.n = 0;
}

static stepq_map_t *small_map(void)
{
    stepq_model_shape sh = fx_shape_small(STEPQ_ARCH_GDN);
    stepq_map_t *map = NULL;

    assert_int_equal(stepq_map_create(&sh, STEPQ_METHOD_UNIFORM, 4, &map), STEPQ_OK);
    return map;
}

static void each_failure_is_logged_once_with_its_final_text(void **state)
{
    stepq_map_t *map = small_map(), *bad = NULL;
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool = NULL;
    stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
    int32_t ids[2];
    float x[64] = { 0 };
    static const char no_row_impact[] =
        "{\"format\": \"stepq-precision-map\", \"schema_version\": 1}";

    assert_int_equal(stepq_set_logger(record, &got), STEPQ_OK);
    got.n = 0;
    /* Successful calls, the data path included, log nothing. */
    cfg.map = map;
    cfg.num_slots = 4;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 2, ids), STEPQ_OK);
    a.batch = 2;
    a.slot_ids = ids;
    a.q = a.k = a.v = a.g = a.beta = x;
    a.o = x + 32;
    assert_int_equal(stepq_pool_decode_step(pool, 0, &a, NULL), STEPQ_OK);
    assert_int_equal(stepq_pool_free(pool, ids, 1), STEPQ_OK);
    assert_int_equal(got.n, 0);

    /* Failures: one message each, whatever layers their texts went through. */
    assert_logged_once(stepq_pool_free(pool, ids, 1)); /* double free */
    a.q = NULL;                                        /* the step's check, then the step's relay */
    assert_logged_once(stepq_pool_decode_step(pool, 0, &a, NULL));
    a.q = x;
    a.version = 99; /* the import's text, prefixed by the step */
    assert_logged_once(stepq_pool_decode_step(pool, 0, &a, NULL));
    assert_non_null(strstr(got.msg, "stepq_pool_decode_step: stepq_step_args: version 99"));
    assert_logged_once(stepq_pool_decode_step(pool, 7, &a, NULL));
    assert_logged_once(stepq_pool_close(pool, 0)); /* a slot is still in use */
    {
        stepq_pool_t *p2 = NULL;
        stepq_pool_plan_info plan;

        cfg.num_slots = -1;
        assert_logged_once(stepq_pool_open(&cfg, &p2));
        assert_logged_once(stepq_pool_plan(&cfg, &plan));
        cfg.num_slots = 4;
        cfg.tp_size = 3; /* 4 value heads do not split over 3 ranks: the layout's text */
        assert_logged_once(stepq_pool_open(&cfg, &p2));
        assert_null(p2);
    }
    assert_logged_once(stepq_map_load_buffer(no_row_impact, sizeof(no_row_impact) - 1, NULL, &bad));
    assert_logged_once(stepq_map_load_file("/nonexistent/map.json", NULL, &bad));
    assert_logged_once(stepq_map_set_unit_bits(map, 0, 0, 7));
    assert_int_equal(stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    assert_logged_once(stepq_pool_alloc(pool, 1, ids)); /* stale handle */
    /* Reading a closed pool's text is no failure: the thread's text stays. */
    assert_string_equal(stepq_pool_last_error(pool), "pool handle is closed or not valid");
    assert_string_equal(stepq_last_error(), "stepq_pool_alloc: pool handle is closed or not valid");
    assert_int_equal(got.n, 0);
    assert_null(stepq_plugin_get(0));
    assert_logged_once(STEPQ_EVERSION);

    /* Without a logger nothing is called. */
    assert_int_equal(stepq_set_logger(NULL, NULL), STEPQ_OK);
    assert_null(stepq_plugin_get(0));
    assert_int_equal(got.n, 0);
    stepq_map_close(map);
}

static int reentry_status, reentry_inner;

/* A callback that calls stepq: a failure there is not logged (no
 * recursion), and replacing the logger from here is refused. */
static void reenter(void *user, int level, const char *msg)
{
    stepq_method m;

    (*(int *)user)++;
    reentry_inner = stepq_method_from_name("no-such-method", &m);
    reentry_status = stepq_set_logger(NULL, NULL);
}

static void the_callback_is_not_reentered_and_cannot_replace_itself(void **state)
{
    int calls = 0;
    stepq_method m;

    assert_int_equal(stepq_set_logger(reenter, &calls), STEPQ_OK);
    assert_int_equal(stepq_method_from_name("nope", &m), STEPQ_EINVAL);
    assert_int_equal(calls, 1);
    assert_int_equal(reentry_inner, STEPQ_EINVAL);
    assert_int_equal(reentry_status, STEPQ_EBUSY);
    /* The refused call changed nothing: the logger is still set. */
    assert_int_equal(stepq_method_from_name("nope", &m), STEPQ_EINVAL);
    assert_int_equal(calls, 2);
    assert_int_equal(stepq_set_logger(NULL, NULL), STEPQ_OK);
}

/* --- threads --------------------------------------------------------------- */

#define THREADS 4

struct counter {
    atomic_int calls;  /* messages received */
    atomic_int inside; /* threads inside the callback now */
};

static void count(void *user, int level, const char *msg)
{
    struct counter *c = user;

    atomic_fetch_add(&c->inside, 1);
    for (volatile int spin = 0; spin < 200; spin++) /* widen the window a swap must wait for */
        ;
    atomic_fetch_add(&c->calls, 1);
    atomic_fetch_sub(&c->inside, 1);
}

static atomic_int stop;
static atomic_long failed_calls;

static void *fail_in_a_loop(void *arg)
{
    stepq_method m;

    while (!atomic_load(&stop)) {
        if (stepq_method_from_name("nope", &m) == STEPQ_EINVAL)
            atomic_fetch_add(&failed_calls, 1);
    }
    return NULL;
}

static void every_thread_logs_and_a_replaced_logger_is_never_called_again(void **state)
{
    struct counter c[3] = { 0 };
    pthread_t t[THREADS];
    stepq_method m;

    /* Each of many concurrent failures reaches the logger once. */
    assert_int_equal(stepq_set_logger(count, &c[0]), STEPQ_OK);
    atomic_store(&stop, 0);
    atomic_store(&failed_calls, 0);
    for (int i = 0; i < THREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, fail_in_a_loop, NULL), 0);
    while (atomic_load(&c[0].calls) < 20000)
        ;
    /* Swaps while every thread logs: when the swap returns, the old callback
     * is done on every thread and is never entered again. */
    for (int k = 1; k < 3; k++) {
        assert_int_equal(stepq_set_logger(count, &c[k]), STEPQ_OK);
        assert_int_equal(atomic_load(&c[k - 1].inside), 0);
        const int frozen = atomic_load(&c[k - 1].calls);
        while (atomic_load(&c[k].calls) < 20000)
            ;
        assert_int_equal(atomic_load(&c[k - 1].calls), frozen);
    }
    assert_int_equal(stepq_set_logger(NULL, NULL), STEPQ_OK);
    assert_int_equal(atomic_load(&c[2].inside), 0);
    atomic_store(&stop, 1);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    /* Nothing doubled: the loggers together counted no more messages than
     * there were failures (the threads kept failing after the last swap). */
    const long total = atomic_load(&failed_calls);
    const long counted = (long)c[0].calls + c[1].calls + c[2].calls;
    assert_true(counted <= total);
    assert_true(counted >= 60000);
    /* With the logger removed, a failure on this thread reaches nobody. */
    assert_int_equal(stepq_method_from_name("nope", &m), STEPQ_EINVAL);
    assert_int_equal((long)c[0].calls + c[1].calls + c[2].calls, counted);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(unknown_versions_give_null_and_name_the_provided_ones),
        cmocka_unit_test(version_1_is_the_public_api),
        cmocka_unit_test(version_1_layout_is_frozen),
        cmocka_unit_test(each_failure_is_logged_once_with_its_final_text),
        cmocka_unit_test(the_callback_is_not_reentered_and_cannot_replace_itself),
        cmocka_unit_test(every_thread_logs_and_a_replaced_logger_is_never_called_again),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
