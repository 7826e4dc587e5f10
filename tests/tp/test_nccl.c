/*
 * The NCCL transport on one GPU, one rank (a communicator of size 1): init
 * from a unique id, the host's communicator wrapped, the pool check, pages
 * and health words moved to this same rank between two CUDA pools, the
 * refusals that leave the receiver's pages untouched, and a receive that no
 * send matches ending in STEPQ_ETIMEDOUT within its timeout. Exits 77
 * (skipped) without CUDA or NCCL in the build or without a device.
 * argv[1]: the repository root.
 *
 * Run on a GPU machine:  meson test -C build-cuda 'tp nccl' --print-errorlogs
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

#include "stepq_config.h"

#include "stepq/pool.h"
#include "stepq/tp.h"

#if STEPQ_HAVE_NCCL
#include <cuda_runtime_api.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#include "tests/tp/tp_test.h"

#define GDN6  "config/calibrated/tiny-gdn/stepq@6.json"
#define GDN4  "config/calibrated/tiny-gdn/uniform@4.json"
#define SLOTS 8

/* One rank's CUDA pool as a TP server opens it: the planned page, then the check. */
struct rank_pool {
    stepq_map_t *map;
    stepq_pool_config cfg;
    stepq_pool_t *pool;
    stepq_tp_fingerprint_info fp;
    uint64_t page_bytes;
};

static void open_pool(struct rank_pool *p, const char *map)
{
    stepq_tp_plan_info plan;

    memset(p, 0, sizeof(*p));
    p->map = load(map);
    p->cfg = (stepq_pool_config)STEPQ_POOL_CONFIG_INITIALIZER;
    p->cfg.map = p->map;
    p->cfg.backend = STEPQ_POOL_BACKEND_CUDA;
    p->cfg.num_slots = SLOTS;
    assert_int_equal(stepq_tp_plan(&p->cfg, &plan, sizeof(plan)), STEPQ_OK);
    p->cfg.min_page_bytes = plan.page_bytes;
    assert_int_equal(stepq_pool_open(&p->cfg, &p->pool), STEPQ_OK);
    assert_int_equal(stepq_tp_fingerprint(&p->cfg, &p->fp, sizeof(p->fp)), STEPQ_OK);
    p->page_bytes = plan.page_bytes;
}

static void close_pool(struct rank_pool *p)
{
    assert_int_equal(stepq_pool_close(p->pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    stepq_map_close(p->map);
}

static stepq_tp_comm_t *one_rank(uint32_t timeout_ms)
{
    stepq_tp_comm_config cfg = STEPQ_TP_COMM_CONFIG_INITIALIZER;
    stepq_tp_comm_t *comm = NULL;
    stepq_tp_id id;

    cfg.timeout_ms = timeout_ms;
    assert_int_equal(stepq_tp_unique_id(&id), STEPQ_OK);
    if (stepq_tp_comm_init(&id, 0, 1, &cfg, &comm) != STEPQ_OK)
        fail_msg("stepq_tp_comm_init: %s", stepq_last_error());
    return comm;
}

static void fill_random(uint8_t *p, size_t n, uint64_t *rng)
{
    for (size_t i = 0; i < n; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (uint8_t)(*rng >> 56);
    }
}

/* Writes pages (host copies) and then health words into allocated slots. */
static void load_slots(struct rank_pool *p, const int32_t *ids, int32_t n, const uint8_t *pages,
                       const uint32_t *health)
{
    uint32_t *words;

    assert_int_equal(stepq_pool_copy_from_host(p->pool, ids, n, pages, (size_t)n * p->page_bytes),
                     STEPQ_OK);
    assert_int_equal(stepq_pool_sync(p->pool), STEPQ_OK);
    assert_int_equal(stepq_pool_health_words(p->pool, &words), STEPQ_OK);
    for (int32_t i = 0; i < n; i++)
        assert_int_equal(cudaMemcpy(words + ids[i], &health[i], 4, cudaMemcpyHostToDevice),
                         cudaSuccess);
}

static void read_slots(struct rank_pool *p, const int32_t *ids, int32_t n, uint8_t *pages,
                       uint32_t *health)
{
    assert_int_equal(stepq_pool_copy_to_host(p->pool, ids, n, pages, (size_t)n * p->page_bytes),
                     STEPQ_OK);
    assert_int_equal(stepq_pool_sync(p->pool), STEPQ_OK);
    assert_int_equal(stepq_pool_health_read(p->pool, ids, n, health), STEPQ_OK);
}

static void a_communicator_from_a_unique_id_opens_and_closes(void **state)
{
    stepq_tp_comm_t *comm = one_rank(0);

    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_OK);
    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_EBADF);
}

static void the_hosts_communicator_is_checked_and_left_to_it(void **state)
{
    ncclUniqueId id;
    ncclComm_t nc;
    stepq_tp_comm_t *comm = NULL;
    struct rank_pool p;

    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(ncclGetUniqueId(&id), ncclSuccess);
    assert_int_equal(ncclCommInitRank(&nc, 1, id, 0), ncclSuccess);
    assert_int_equal(stepq_tp_comm_wrap(nc, 0, 2, NULL, &comm), STEPQ_EINVAL);
    assert_true(has("rank 0 of 1, not rank 0 of 2"));
    assert_int_equal(stepq_tp_comm_wrap(nc, 0, 1, NULL, &comm), STEPQ_OK);
    open_pool(&p, GDN6);
    assert_int_equal(stepq_tp_check_pools(comm, &p.cfg, p.pool, NULL), STEPQ_OK);
    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_OK);
    close_pool(&p);
    /* Still the host's: it works and is the host's to destroy. */
    assert_int_equal(ncclCommDestroy(nc), ncclSuccess);
}

static void check_pools_passes_on_the_pool_it_was_opened_for(void **state)
{
    stepq_tp_comm_t *comm = one_rank(0);
    struct rank_pool p;
    stepq_pool_config other;
    cudaStream_t stream;

    open_pool(&p, GDN6);
    assert_int_equal(cudaStreamCreate(&stream), cudaSuccess);
    assert_int_equal(stepq_tp_check_pools(comm, &p.cfg, p.pool, NULL), STEPQ_OK);
    assert_int_equal(stepq_tp_check_pools(comm, &p.cfg, p.pool, stream), STEPQ_OK);
    /* A config that is not the pool's: every rank (here the one) says which and why. */
    other = p.cfg;
    other.tp_size = 2;
    assert_int_equal(stepq_tp_check_pools(comm, &other, p.pool, NULL), STEPQ_ESHAPE);
    assert_true(has("rank 0 cannot take part"));
    assert_true(has("tp_rank 0 of tp_size 2, its communicator rank 0 of 1"));
    other = p.cfg;
    other.min_page_bytes = p.page_bytes + 4096;
    assert_int_equal(stepq_tp_check_pools(comm, &other, p.pool, NULL), STEPQ_ESHAPE);
    assert_true(has("where its stepq_pool_config plans"));
    /* Refusals are verdicts, not failures: the communicator goes on. */
    assert_int_equal(stepq_tp_check_pools(comm, &p.cfg, p.pool, stream), STEPQ_OK);
    assert_int_equal(cudaStreamDestroy(stream), cudaSuccess);
    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_OK);
    close_pool(&p);
}

static void pages_and_health_words_move_to_another_pool(void **state)
{
    stepq_tp_comm_t *comm = one_rank(0);
    struct rank_pool a, b;
    int32_t ida[3], idb[5], spare[2];
    const uint32_t health[3] = { STEPQ_HEALTH_STATE, 0, STEPQ_HEALTH_INPUT | STEPQ_HEALTH_OUTPUT };
    uint8_t *src, *got;
    uint32_t hgot[3];
    uint64_t rng = 7;

    open_pool(&a, GDN6);
    open_pool(&b, GDN6);
    assert_true(a.fp.page == b.fp.page);
    src = malloc(3 * a.page_bytes);
    got = malloc(3 * a.page_bytes);
    assert_non_null(src);
    assert_non_null(got);
    fill_random(src, 3 * a.page_bytes, &rng);
    assert_int_equal(stepq_pool_alloc(a.pool, 3, ida), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(b.pool, 2, spare), STEPQ_OK); /* other ids on b */
    assert_int_equal(stepq_pool_alloc(b.pool, 3, idb), STEPQ_OK);
    load_slots(&a, ida, 3, src, health);
    {
        /* In the order 2, 0, 1 on the receiver, a -1 padding entry on each side. */
        const int32_t send_ids[4] = { ida[0], -1, ida[1], ida[2] };
        const int32_t recv_ids[4] = { idb[2], idb[0], -1, idb[1] };
        const stepq_tp_slots snd = slots_of(a.pool, a.fp.page, 0, send_ids, 4);
        const stepq_tp_slots rcv = slots_of(b.pool, b.fp.page, 0, recv_ids, 4);
        const int32_t order[3] = { idb[2], idb[0], idb[1] };

        if (stepq_tp_exchange_slots(comm, &snd, &rcv, NULL) != STEPQ_OK)
            fail_msg("stepq_tp_exchange_slots: %s", stepq_last_error());
        read_slots(&b, order, 3, got, hgot);
    }
    assert_memory_equal(got, src, 3 * a.page_bytes);
    assert_memory_equal(hgot, health, sizeof(health));
    /* The sender's slots are only read. */
    read_slots(&a, ida, 3, got, hgot);
    assert_memory_equal(got, src, 3 * a.page_bytes);
    assert_memory_equal(hgot, health, sizeof(health));
    free(src);
    free(got);
    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_OK);
    close_pool(&a);
    close_pool(&b);
}

/* The receiver's slots hold a pattern and health 0x7; after a refusal they still do. */
static void assert_untouched(struct rank_pool *p, const int32_t *ids, int32_t n)
{
    uint8_t *got = malloc((size_t)n * p->page_bytes);
    uint32_t h[4];

    assert_non_null(got);
    read_slots(p, ids, n, got, h);
    for (size_t i = 0; i < (size_t)n * p->page_bytes; i++)
        if (got[i] != 0xab)
            fail_msg("byte %zu of the receiver's pages is %02x: a page was written", i, got[i]);
    for (int32_t i = 0; i < n; i++)
        assert_int_equal(h[i], 0x7);
    free(got);
}

static void a_mismatching_receiver_refuses_before_writing_a_page(void **state)
{
    stepq_tp_comm_t *comm = one_rank(0);
    struct rank_pool a, c;
    int32_t ida[3], idr[3], idc[3];
    const uint32_t seven[3] = { 0x7, 0x7, 0x7 };
    uint8_t *pattern;

    open_pool(&a, GDN6);
    open_pool(&c, GDN4); /* another map: other fingerprint, other page bytes */
    assert_true(a.fp.page != c.fp.page);
    assert_true(a.page_bytes != c.page_bytes);
    assert_int_equal(stepq_pool_alloc(a.pool, 3, ida), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(a.pool, 3, idr), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(c.pool, 3, idc), STEPQ_OK);
    pattern = malloc(3 * (a.page_bytes > c.page_bytes ? a.page_bytes : c.page_bytes));
    assert_non_null(pattern);
    memset(pattern, 0xab, 3 * (a.page_bytes > c.page_bytes ? a.page_bytes : c.page_bytes));
    load_slots(&c, idc, 3, pattern, seven);
    load_slots(&a, idr, 3, pattern, seven);
    {
        stepq_tp_slots snd = slots_of(a.pool, a.fp.page, 0, ida, 3);
        stepq_tp_slots rcv = slots_of(c.pool, c.fp.page, 0, idc, 3);

        /* Pages of another map. */
        assert_int_equal(stepq_tp_exchange_slots(comm, &snd, &rcv, NULL), STEPQ_ESHAPE);
        assert_true(has("fingerprint"));
        assert_untouched(&c, idc, 3);
        /* The same page bytes, another fingerprint (another rank's pages, say). */
        rcv.pool = a.pool;
        rcv.page_fingerprint = a.fp.page ^ 1;
        rcv.slot_ids = idr;
        assert_int_equal(stepq_tp_exchange_slots(comm, &snd, &rcv, NULL), STEPQ_ESHAPE);
        assert_true(has("fingerprint"));
        assert_untouched(&a, idr, 3);
        /* The right pages, one fewer than the receiver lists. */
        rcv.page_fingerprint = a.fp.page;
        snd.n = 1;
        rcv.n = 2;
        assert_int_equal(stepq_tp_exchange_slots(comm, &snd, &rcv, NULL), STEPQ_ESHAPE);
        assert_true(has("1 pages, this receiver lists 2 slots"));
        assert_untouched(&a, idr, 3);
        /* A slot both sent and received is refused before any NCCL call. */
        rcv.slot_ids = ida;
        assert_int_equal(stepq_tp_exchange_slots(comm, &snd, &rcv, NULL), STEPQ_EINVAL);
        assert_true(has("is both sent and received"));
    }
    free(pattern);
    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_OK);
    close_pool(&a);
    close_pool(&c);
}

#define TIMEOUT_MS 2000
/* The wait polls every 100 us; the abort and the clock add little: 10 s is generous. */
#define TIMEOUT_SLACK_MS 10000

static double ms_since(const struct timespec *t0)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

/* Rank 1 of 2 never joins: rank 0's init ends at its timeout, aborted. */
static void an_init_whose_peer_never_joins_times_out(void **state)
{
    stepq_tp_comm_config cfg = STEPQ_TP_COMM_CONFIG_INITIALIZER;
    stepq_tp_comm_t *comm = NULL;
    stepq_tp_id id;
    struct timespec t0;
    double ms;
    int ret;

    cfg.timeout_ms = TIMEOUT_MS;
    assert_int_equal(stepq_tp_unique_id(&id), STEPQ_OK);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ret = stepq_tp_comm_init(&id, 0, 2, &cfg, &comm);
    ms = ms_since(&t0);
    if (ret != STEPQ_ETIMEDOUT)
        fail_msg("init without its peer: %s: %s", stepq_status_name(ret), stepq_last_error());
    assert_true(has("was aborted"));
    assert_null(comm);
    assert_true(ms >= TIMEOUT_MS && ms < TIMEOUT_MS + TIMEOUT_SLACK_MS);
}

/*
 * A receive from this rank that no send matches never hangs: it times out
 * (the NCCL kernel waits, the communicator is aborted), unless NCCL refuses
 * an unpaired transfer to itself at once (STEPQ_EINVAL). Either way the
 * communicator is done, and the pool and its stream work after it.
 */
static void a_receive_no_send_matches_ends_in_an_error(void **state)
{
    stepq_tp_comm_t *comm = one_rank(TIMEOUT_MS);
    struct rank_pool b;
    int32_t idb[2];
    struct timespec t0;
    double ms;
    int ret;

    open_pool(&b, GDN6);
    assert_int_equal(stepq_pool_alloc(b.pool, 2, idb), STEPQ_OK);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ret = stepq_tp_recv_slots(comm, b.pool, b.fp.page, 0, idb, 2, NULL);
    ms = ms_since(&t0);
    print_message("recv with no send: %s after %.0f ms: %s\n", stepq_status_name(ret), ms,
                  stepq_last_error());
    if (ret == STEPQ_ETIMEDOUT) {
        assert_true(has("was aborted"));
        assert_true(ms >= TIMEOUT_MS);
    } else if (ret != STEPQ_EINVAL) {
        fail_msg("recv with no send: %s: %s", stepq_status_name(ret), stepq_last_error());
    }
    assert_true(ms < TIMEOUT_MS + TIMEOUT_SLACK_MS);
    assert_int_equal(stepq_tp_check_pools(comm, &b.cfg, b.pool, NULL), STEPQ_ENCCL);
    assert_int_equal(stepq_tp_comm_close(comm), STEPQ_OK);
    assert_int_equal(stepq_pool_sync(b.pool), STEPQ_OK);
    close_pool(&b);
}

#endif /* STEPQ_HAVE_NCCL */

int main(int argc, char **argv)
{
#if !STEPQ_HAVE_NCCL
    printf("skipped: this build has no NCCL (it needs CUDA and NCCL)\n");
    return 77;
#else
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_communicator_from_a_unique_id_opens_and_closes),
        cmocka_unit_test(the_hosts_communicator_is_checked_and_left_to_it),
        cmocka_unit_test(check_pools_passes_on_the_pool_it_was_opened_for),
        cmocka_unit_test(pages_and_health_words_move_to_another_pool),
        cmocka_unit_test(a_mismatching_receiver_refuses_before_writing_a_page),
        cmocka_unit_test(an_init_whose_peer_never_joins_times_out),
        cmocka_unit_test(a_receive_no_send_matches_ends_in_an_error),
    };
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);

    if (e != cudaSuccess || count == 0) {
        printf("skipped: no CUDA device (%s)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
        return 77;
    }
    root = argc > 1 ? argv[1] : ".";
    return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
