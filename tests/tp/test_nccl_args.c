/*
 * The NCCL transport on the CPU: what it refuses before any NCCL call
 * (NULL arguments, ranks out of range, a bad config header, a pool of the
 * host backend, a closed handle), the one mapping of NCCL results to
 * statuses and the pool check's verdict on gathered records (the same on
 * every rank, naming the first rank that differs); in a build without
 * NCCL, that every entry says so. No GPU is
 * needed: a communicator without an NCCL communicator behind it stands in
 * for a real one (tp/nccl_internal.h). argv[1]: the repository root.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "stepq_config.h"

#include "stepq/pool.h"
#include "stepq/tp.h"

#if STEPQ_HAVE_NCCL
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#include "tp/nccl_internal.h"
#endif

#include "tests/tp/tp_test.h"

#if STEPQ_HAVE_NCCL

static void nccl_results_map_to_statuses(void **state)
{
    assert_int_equal(stepq__tp_nccl_status(ncclSuccess), STEPQ_OK);
    assert_int_equal(stepq__tp_nccl_status(ncclInvalidArgument), STEPQ_EINVAL);
    assert_int_equal(stepq__tp_nccl_status(ncclInvalidUsage), STEPQ_EINVAL);
    assert_int_equal(stepq__tp_nccl_status(ncclSystemError), STEPQ_EIO);
    assert_int_equal(stepq__tp_nccl_status(ncclRemoteError), STEPQ_EIO);
    assert_int_equal(stepq__tp_nccl_status(ncclUnhandledCudaError), STEPQ_ECUDA);
    assert_int_equal(stepq__tp_nccl_status(ncclInternalError), STEPQ_ENCCL);
    assert_int_equal(stepq__tp_nccl_status(ncclInProgress), STEPQ_EBUSY);
    assert_int_equal(stepq__tp_nccl_status(12345), STEPQ_ENCCL);
}

static void init_refuses_bad_arguments_before_nccl(void **state)
{
    stepq_tp_id id;
    stepq_tp_comm_t *comm = (stepq_tp_comm_t *)&id;
    stepq_tp_comm_config cfg = STEPQ_TP_COMM_CONFIG_INITIALIZER;

    memset(&id, 0, sizeof(id));
    assert_int_equal(stepq_tp_unique_id(NULL), STEPQ_EINVAL);
    assert_int_equal(stepq_tp_comm_init(&id, 0, 1, NULL, NULL), STEPQ_EINVAL);
    assert_int_equal(stepq_tp_comm_init(NULL, 0, 1, NULL, &comm), STEPQ_EINVAL);
    assert_null(comm);
    assert_true(has("id is NULL"));
    assert_int_equal(stepq_tp_comm_init(&id, 0, 0, NULL, &comm), STEPQ_EINVAL);
    assert_true(has("size 0"));
    assert_int_equal(stepq_tp_comm_init(&id, -1, 2, NULL, &comm), STEPQ_EINVAL);
    assert_true(has("rank -1 is not in 0..1"));
    assert_int_equal(stepq_tp_comm_init(&id, 2, 2, NULL, &comm), STEPQ_EINVAL);
    assert_true(has("rank 2 is not in 0..1"));
    cfg.magic = 0;
    assert_int_equal(stepq_tp_comm_init(&id, 0, 1, &cfg, &comm), STEPQ_EVERSION);
    assert_true(has("stepq_tp_comm_config"));
    cfg = (stepq_tp_comm_config)STEPQ_TP_COMM_CONFIG_INITIALIZER;
    cfg.version = STEPQ_TP_COMM_CONFIG_VERSION + 1;
    assert_int_equal(stepq_tp_comm_init(&id, 0, 1, &cfg, &comm), STEPQ_EVERSION);
    assert_null(comm);
}

static void wrap_refuses_bad_arguments_before_nccl(void **state)
{
    int not_a_comm = 0;
    stepq_tp_comm_t *comm = (stepq_tp_comm_t *)&not_a_comm;

    assert_int_equal(stepq_tp_comm_wrap(NULL, 0, 1, NULL, &comm), STEPQ_EINVAL);
    assert_null(comm);
    assert_true(has("nccl_comm is NULL"));
    assert_int_equal(stepq_tp_comm_wrap(&not_a_comm, 3, 2, NULL, &comm), STEPQ_EINVAL);
    assert_true(has("rank 3 is not in 0..1"));
    assert_int_equal(stepq_tp_comm_wrap(&not_a_comm, 0, -4, NULL, &comm), STEPQ_EINVAL);
    assert_true(has("size -4"));
    assert_int_equal(stepq_tp_comm_wrap(&not_a_comm, 0, 1, NULL, NULL), STEPQ_EINVAL);
}

static void a_pool_of_the_host_backend_is_refused(void **state)
{
    stepq_map_t *map = load("config/calibrated/tiny-gdn/stepq@6.json");
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_tp_fingerprint_info fp;
    stepq_tp_comm_t *comm = NULL;
    stepq_pool_t *pool = NULL;
    int32_t ids[2];

    cfg.map = map;
    cfg.num_slots = 4;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 2, ids), STEPQ_OK);
    assert_int_equal(stepq_tp_fingerprint(&cfg, &fp, sizeof(fp)), STEPQ_OK);
    assert_int_equal(stepq__tp_comm_detached(0, 1, &comm), STEPQ_OK);

    assert_int_equal(stepq_tp_check_pools(comm, &cfg, pool, NULL), STEPQ_ENOTSUP);
    assert_true(has("not device memory"));
    assert_true(has("STEPQ_POOL_BACKEND_CUDA"));
    assert_int_equal(stepq_tp_send_slots(comm, pool, fp.page, 0, ids, 2, NULL), STEPQ_ENOTSUP);
    assert_true(has("not device memory"));
    assert_int_equal(stepq_tp_recv_slots(comm, pool, fp.page, 0, ids, 2, NULL), STEPQ_ENOTSUP);
    assert_true(has("not device memory"));

    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_OK);
    assert_int_equal(stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    stepq_map_close(map);
}

static void calls_refuse_bad_arguments_before_nccl(void **state)
{
    stepq_map_t *map = load("config/calibrated/tiny-gdn/stepq@6.json");
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_tp_comm_t *comm = NULL;
    stepq_pool_t *pool = NULL;
    const int32_t ids[2] = { 1, 2 };
    stepq_tp_slots s = slots_of(NULL, 0, 0, ids, 2);

    cfg.map = map;
    cfg.num_slots = 4;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_OK);
    assert_int_equal(stepq__tp_comm_detached(0, 2, &comm), STEPQ_OK);

    assert_int_equal(stepq_tp_check_pools(NULL, &cfg, pool, NULL), STEPQ_EINVAL);
    assert_true(has("comm is NULL"));
    assert_int_equal(stepq_tp_check_pools(comm, NULL, pool, NULL), STEPQ_EINVAL);
    assert_true(has("cfg is NULL"));
    assert_int_equal(stepq_tp_check_pools(comm, &cfg, NULL, NULL), STEPQ_EINVAL);
    assert_true(has("pool is NULL"));

    assert_int_equal(stepq_tp_exchange_slots(comm, NULL, NULL, NULL), STEPQ_EINVAL);
    assert_true(has("both NULL"));
    assert_int_equal(stepq_tp_exchange_slots(comm, &s, NULL, NULL), STEPQ_EINVAL);
    assert_true(has("pool is NULL"));
    s.magic = 0;
    assert_int_equal(stepq_tp_exchange_slots(comm, NULL, &s, NULL), STEPQ_EVERSION);
    assert_true(has("stepq_tp_slots"));
    s.magic = STEPQ_CONFIG_MAGIC;
    s.pool = pool;
    s.peer = 2;
    assert_int_equal(stepq_tp_exchange_slots(comm, &s, NULL, NULL), STEPQ_EINVAL);
    assert_true(has("peer 2 is not in 0..1"));
    s.peer = -1;
    assert_int_equal(stepq_tp_exchange_slots(comm, NULL, &s, NULL), STEPQ_EINVAL);
    assert_true(has("peer -1 is not in 0..1"));
    s.peer = 1;
    s.n = -1;
    assert_int_equal(stepq_tp_exchange_slots(comm, &s, NULL, NULL), STEPQ_EINVAL);
    s.n = 2;
    s.slot_ids = NULL;
    assert_int_equal(stepq_tp_send_slots(comm, pool, 0, 1, NULL, 2, NULL), STEPQ_EINVAL);
    assert_int_equal(stepq_tp_recv_slots(NULL, pool, 0, 1, ids, 2, NULL), STEPQ_EINVAL);

    /* A closed communicator's handle stays closed. */
    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_OK);
    assert_int_equal(stepq_tp_check_pools(comm, &cfg, pool, NULL), STEPQ_EBADF);
    assert_int_equal(stepq_tp_send_slots(comm, pool, 0, 0, ids, 2, NULL), STEPQ_EBADF);
    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_EBADF);
    assert_int_equal(stepq_tp_comm_close(NULL), STEPQ_OK);
    assert_int_equal(stepq__tp_comm_detached(2, 2, &comm), STEPQ_EINVAL);

    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);
    stepq_map_close(map);
}

/* Records of size ranks that agree: tp_size ranks of one map, 80 slots each. */
static void agreeing(uint64_t *rec, int size)
{
    for (int k = 0; k < size; k++) {
        uint64_t *w = rec + (size_t)k * STEPQ__TP_REC_WORDS;

        memset(w, 0, 8 * STEPQ__TP_REC_WORDS);
        w[STEPQ__TP_REC_TAG] = STEPQ__TP_REC_TAG_V1;
        w[STEPQ__TP_REC_VERSION] = stepq_version();
        w[STEPQ__TP_REC_TP_SIZE] = (uint64_t)size;
        w[STEPQ__TP_REC_TP_RANK] = (uint64_t)k;
        w[STEPQ__TP_REC_MAP] = 0x1111;
        w[STEPQ__TP_REC_GROUP] = 0x2222;
        w[STEPQ__TP_REC_PAGE] = 0x3333 + (uint64_t)k;
        w[STEPQ__TP_REC_PAGE_BYTES] = 4096;
        w[STEPQ__TP_REC_SLOTS] = 80;
    }
}

/* The verdict on every rank me of size: the same status and text (returned). */
static int verdict_everywhere(const uint64_t *rec, int size, char *text, size_t cap)
{
    int first = 0;

    for (int me = 0; me < size; me++) {
        const int st = stepq__tp_pool_verdict(rec, size, me, "own reason");

        if (me == 0) {
            first = st;
            snprintf(text, cap, "%s", st < 0 ? stepq_last_error() : "");
        } else {
            assert_int_equal(st, first);
            if (st < 0)
                assert_string_equal(stepq_last_error(), text);
        }
    }
    return first;
}

static void every_rank_gives_the_same_verdict_naming_the_first_rank_that_differs(void **state)
{
    uint64_t rec[3 * STEPQ__TP_REC_WORDS];
    char text[512];

    agreeing(rec, 3);
    assert_int_equal(verdict_everywhere(rec, 3, text, sizeof(text)), STEPQ_OK);

    rec[2 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_MAP] = 0x9999;
    assert_int_equal(verdict_everywhere(rec, 3, text, sizeof(text)), STEPQ_ESHAPE);
    assert_non_null(strstr(text, "rank 2's map differs from rank 0's"));
    /* Rank 1 differs too, in its slots: it is the first, and named. */
    rec[1 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_SLOTS] = 64;
    assert_int_equal(verdict_everywhere(rec, 3, text, sizeof(text)), STEPQ_ESHAPE);
    assert_non_null(strstr(text, "rank 1's pool has 64 slots, rank 0's 80"));

    agreeing(rec, 3);
    rec[1 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_TP_SIZE] = 4;
    assert_int_equal(verdict_everywhere(rec, 3, text, sizeof(text)), STEPQ_ESHAPE);
    assert_non_null(strstr(text, "rank 1 has tp_size 4, rank 0 3"));

    agreeing(rec, 3);
    rec[2 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_GROUP] = 0x2223;
    assert_int_equal(verdict_everywhere(rec, 3, text, sizeof(text)), STEPQ_ESHAPE);
    assert_non_null(strstr(text, "rank 2's page layout differs from rank 0's"));

    agreeing(rec, 3);
    rec[1 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_PAGE_BYTES] = 8192;
    assert_int_equal(verdict_everywhere(rec, 3, text, sizeof(text)), STEPQ_ESHAPE);
    assert_non_null(strstr(text, "rank 1's pages are 8192 B, rank 0's 4096 B"));

    agreeing(rec, 3);
    rec[2 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_VERSION] += 1;
    assert_int_equal(verdict_everywhere(rec, 3, text, sizeof(text)), STEPQ_EVERSION);
    assert_non_null(strstr(text, "rank 2 runs stepq version"));

    agreeing(rec, 3);
    rec[1 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_TAG] = 0;
    assert_int_equal(verdict_everywhere(rec, 3, text, sizeof(text)), STEPQ_EVERSION);
    assert_non_null(strstr(text, "rank 1 sent a record tagged"));
}

static void a_rank_that_cannot_take_part_fails_every_rank(void **state)
{
    uint64_t rec[2 * STEPQ__TP_REC_WORDS];

    agreeing(rec, 2);
    rec[1 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_STATUS] = (uint64_t)(int64_t)STEPQ_ESHAPE;
    /* Its numbers are not compared: its own failure is the verdict. */
    rec[1 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_MAP] = 0;
    assert_int_equal(stepq__tp_pool_verdict(rec, 2, 0, "own reason"), STEPQ_ESHAPE);
    assert_true(has("rank 1 cannot take part: STEPQ_ESHAPE: its own error says why"));
    /* The rank itself says why. */
    assert_int_equal(stepq__tp_pool_verdict(rec, 2, 1, "own reason"), STEPQ_ESHAPE);
    assert_true(has("rank 1 cannot take part: STEPQ_ESHAPE: own reason"));
    rec[1 * STEPQ__TP_REC_WORDS + STEPQ__TP_REC_STATUS] = (uint64_t)(int64_t)STEPQ_EVERSION;
    assert_int_equal(stepq__tp_pool_verdict(rec, 2, 0, "own reason"), STEPQ_EVERSION);
}

#else /* !STEPQ_HAVE_NCCL */

static void every_entry_says_nccl_is_not_built(void **state)
{
    stepq_tp_id id;
    stepq_tp_comm_t *comm = (stepq_tp_comm_t *)&id;
    const int32_t ids[1] = { 1 };

    memset(&id, 0, sizeof(id));
    assert_int_equal(stepq_tp_unique_id(&id), STEPQ_ENOTSUP);
    assert_true(has("without NCCL"));
    assert_int_equal(stepq_tp_comm_init(&id, 0, 1, NULL, &comm), STEPQ_ENOTSUP);
    assert_null(comm);
    assert_int_equal(stepq_tp_comm_wrap(&id, 0, 1, NULL, &comm), STEPQ_ENOTSUP);
    assert_true(has("stepq_tp_comm_wrap"));
    assert_int_equal(stepq_tp_check_pools(NULL, NULL, NULL, NULL), STEPQ_ENOTSUP);
    assert_int_equal(stepq_tp_send_slots(NULL, NULL, 0, 0, ids, 1, NULL), STEPQ_ENOTSUP);
    assert_int_equal(stepq_tp_recv_slots(NULL, NULL, 0, 0, ids, 1, NULL), STEPQ_ENOTSUP);
    assert_true(has("without NCCL"));
    assert_int_equal(stepq_tp_comm_close(NULL), STEPQ_OK);
}

#endif

static void timeouts_are_their_own_status(void **state)
{
    assert_int_equal(STEPQ_ETIMEDOUT, -110);
    assert_string_equal(stepq_status_name(STEPQ_ETIMEDOUT), "STEPQ_ETIMEDOUT");
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
#if STEPQ_HAVE_NCCL
        cmocka_unit_test(nccl_results_map_to_statuses),
        cmocka_unit_test(init_refuses_bad_arguments_before_nccl),
        cmocka_unit_test(wrap_refuses_bad_arguments_before_nccl),
        cmocka_unit_test(a_pool_of_the_host_backend_is_refused),
        cmocka_unit_test(calls_refuse_bad_arguments_before_nccl),
        cmocka_unit_test(every_rank_gives_the_same_verdict_naming_the_first_rank_that_differs),
        cmocka_unit_test(a_rank_that_cannot_take_part_fails_every_rank),
#else
        cmocka_unit_test(every_entry_says_nccl_is_not_built),
#endif
        cmocka_unit_test(timeouts_are_their_own_status),
    };

    root = argc > 1 ? argv[1] : ".";
    return cmocka_run_group_tests(tests, NULL, NULL);
}
