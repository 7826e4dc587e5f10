/*
 * The CUDA pool backend against the host backend: the same random sequence
 * of alloc / clear / copy / reload on both must leave the same bytes in
 * every page; the masked copy with device lists gives the host backend's
 * pages, eagerly and from a captured graph replayed with new lists. Exits 77 (skipped) when the
 * build has no CUDA or the machine no device.
 *
 * Run on a GPU machine:  meson test -C build 'pool cuda' --print-errorlogs
 */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "stepq_config.h"

#include "pool/internal.h"
#include "stepq/pool.h"

#if STEPQ_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* Odd block sizes so pages are not powers of two: 4 x 3 blocks + 2 conv. */
static const uint32_t blocks[12] = { 1000, 2048, 17, 4096, 333, 64, 8192, 5, 100, 700, 12, 4000 };
#define SLOTS 600

static stepq_pool_t *open_backend(stepq_pool_backend backend, void *stream, unsigned flags)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    struct stepq__pool_layout l;
    stepq_pool_t *pool = NULL;

    assert_int_equal(stepq__pool_layout_synthetic(4, 3, blocks, 1234, 16, 256, 0, &l), STEPQ_OK);
    cfg.backend = backend;
    cfg.stream = stream;
    cfg.num_slots = SLOTS;
    cfg.flags = flags;
    assert_int_equal(stepq__pool_open_layout(&cfg, &l, &pool), STEPQ_OK);
    return pool;
}

static uint64_t page_bytes_of(stepq_pool_t *pool)
{
    stepq_pool_stats s;

    assert_int_equal(stepq_pool_get_stats(pool, &s, sizeof(s)), STEPQ_OK);
    return s.page_bytes;
}

static void fill_random(uint8_t *p, size_t n, uint64_t *rng)
{
    for (size_t i = 0; i < n; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (uint8_t)(*rng >> 56);
    }
}

/* Every page of both pools (sentinel included) must hold the same bytes. */
static void assert_same_pages(stepq_pool_t *host, stepq_pool_t *dev, const int32_t *ids, int32_t n)
{
    size_t pb = page_bytes_of(host);
    uint8_t *a = malloc((size_t)n * pb), *b = malloc((size_t)n * pb);

    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(stepq_pool_copy_to_host(host, ids, n, a, (size_t)n * pb), STEPQ_OK);
    assert_int_equal(stepq_pool_copy_to_host(dev, ids, n, b, (size_t)n * pb), STEPQ_OK);
    assert_int_equal(stepq_pool_sync(dev), STEPQ_OK);
    for (int32_t i = 0; i < n; i++)
        if (memcmp(a + (size_t)i * pb, b + (size_t)i * pb, pb))
            fail_msg("slot %" PRId32 " differs between the host and CUDA pools", ids[i]);
    free(a);
    free(b);
}

static void random_operations_match_the_host_backend(void **state)
{
    stepq_pool_t *host = open_backend(STEPQ_POOL_BACKEND_HOST, NULL, 0);
    stepq_pool_t *dev = open_backend(STEPQ_POOL_BACKEND_CUDA, NULL, 0);
    size_t pb = page_bytes_of(host);
    int32_t ids[SLOTS], ids2[SLOTS], src[512], dst[512];
    uint8_t *buf = malloc(64 * pb);
    uint64_t rng = 42;

    assert_non_null(buf);
    assert_int_equal(page_bytes_of(dev), pb);
    assert_int_equal(stepq_pool_alloc(host, SLOTS, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(dev, SLOTS, ids2), STEPQ_OK);
    assert_memory_equal(ids, ids2, sizeof(ids)); /* same allocator, same order */
    /* Load random pages into every slot, 64 at a time. */
    for (int32_t at = 0; at < SLOTS; at += 64) {
        int32_t k = SLOTS - at < 64 ? SLOTS - at : 64;
        fill_random(buf, (size_t)k * pb, &rng);
        assert_int_equal(stepq_pool_copy_from_host(host, ids + at, k, buf, (size_t)k * pb),
                         STEPQ_OK);
        assert_int_equal(stepq_pool_copy_from_host(dev, ids + at, k, buf, (size_t)k * pb),
                         STEPQ_OK);
        assert_int_equal(stepq_pool_sync(dev), STEPQ_OK);
    }
    /* Scattered copies of 1..512 pairs (disjoint halves), clears, padding. */
    for (int round = 0; round < 40; round++) {
        int32_t n = 1 + (int32_t)(rng % 256), c;
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        if (round % 10 == 9)
            n = 256;                          /* 512 slots touched */
        for (int32_t i = 0; i < SLOTS; i++) { /* shuffle */
            int32_t j = (int32_t)((rng >> 33) % (uint64_t)(i + 1)), t = ids[i];
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            ids[i] = ids[j];
            ids[j] = t;
        }
        for (int32_t i = 0; i < n; i++) {
            src[i] = ids[i];
            dst[i] = ids[n + i];
        }
        if (n > 3)
            src[1] = dst[2] = STEPQ_POOL_SLOT_PAD;
        assert_int_equal(stepq_pool_copy(host, src, dst, n), STEPQ_OK);
        assert_int_equal(stepq_pool_copy(dev, src, dst, n), STEPQ_OK);
        c = n / 4 + 1;
        assert_int_equal(stepq_pool_clear(host, ids + 2 * n, c), STEPQ_OK);
        assert_int_equal(stepq_pool_clear(dev, ids + 2 * n, c), STEPQ_OK);
    }
    for (int32_t at = 0; at < SLOTS; at += 64)
        assert_same_pages(host, dev, ids + at, SLOTS - at < 64 ? SLOTS - at : 64);
    free(buf);
    assert_int_equal(stepq_pool_close(host, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    assert_int_equal(stepq_pool_close(dev, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
}

#if STEPQ_HAVE_CUDA
static void health_words_follow_alloc_clear_and_copy_on_the_device(void **state)
{
    cudaStream_t stream;
    stepq_pool_t *dev;
    uint32_t *words, h[3], seven = 7;
    int32_t ids[3];

    assert_int_equal(cudaStreamCreate(&stream), cudaSuccess);
    dev = open_backend(STEPQ_POOL_BACKEND_CUDA, stream, STEPQ_POOL_FLAG_CLEAR_ON_ALLOC);
    assert_int_equal(stepq_pool_alloc(dev, 3, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_health_words(dev, &words), STEPQ_OK);
    /* A kernel would OR bits in; a copy on the pool's stream stands in for it. */
    assert_int_equal(cudaMemcpyAsync(words + ids[0], &seven, 4, cudaMemcpyHostToDevice, stream),
                     cudaSuccess);
    assert_int_equal(stepq_pool_copy(dev, ids, ids + 1, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_health_read(dev, ids, 3, h), STEPQ_OK);
    assert_int_equal(h[0], 7);
    assert_int_equal(h[1], 7);
    assert_int_equal(h[2], 0);
    assert_int_equal(stepq_pool_clear(dev, ids, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_health_read(dev, ids, 3, h), STEPQ_OK);
    assert_int_equal(h[0], 0);
    assert_int_equal(h[1], 7);
    assert_int_equal(stepq_pool_free(dev, ids + 1, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_close(dev, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    assert_int_equal(cudaStreamDestroy(stream), cudaSuccess);
}

/* --- masked copies: device lists, the host backend as the reference ------- */

#define MASKED_N 300

static int32_t *upload(const int32_t *h, int32_t n)
{
    int32_t *d = NULL;

    assert_int_equal(cudaMalloc((void **)&d, (size_t)n * sizeof(*d)), cudaSuccess);
    assert_int_equal(cudaMemcpy(d, h, (size_t)n * sizeof(*d), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

static void put(int32_t *d, const int32_t *h, int32_t n, cudaStream_t s)
{
    assert_int_equal(cudaMemcpyAsync(d, h, (size_t)n * sizeof(*d), cudaMemcpyHostToDevice, s),
                     cudaSuccess);
}

/* Both pools: SLOTS allocated (same ids), random pages and health words. */
static void fill_both(stepq_pool_t *host, stepq_pool_t *dev, int32_t *ids, uint64_t *rng)
{
    size_t pb = page_bytes_of(host);
    uint8_t *buf = malloc(64 * pb);
    uint32_t *hw, *dw, words[SLOTS + 1];
    int32_t ids2[SLOTS];

    assert_non_null(buf);
    assert_int_equal(stepq_pool_alloc(host, SLOTS, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(dev, SLOTS, ids2), STEPQ_OK);
    assert_memory_equal(ids, ids2, sizeof(ids2));
    for (int32_t at = 0; at < SLOTS; at += 64) {
        int32_t k = SLOTS - at < 64 ? SLOTS - at : 64;
        fill_random(buf, (size_t)k * pb, rng);
        assert_int_equal(stepq_pool_copy_from_host(host, ids + at, k, buf, (size_t)k * pb),
                         STEPQ_OK);
        assert_int_equal(stepq_pool_copy_from_host(dev, ids + at, k, buf, (size_t)k * pb),
                         STEPQ_OK);
        assert_int_equal(stepq_pool_sync(dev), STEPQ_OK);
    }
    fill_random((uint8_t *)words, sizeof(words), rng);
    assert_int_equal(stepq_pool_health_words(host, &hw), STEPQ_OK);
    assert_int_equal(stepq_pool_health_words(dev, &dw), STEPQ_OK);
    memcpy(hw, words, sizeof(words));
    assert_int_equal(cudaMemcpy(dw, words, sizeof(words), cudaMemcpyHostToDevice), cudaSuccess);
    free(buf);
}

/* Pages and health words of every slot equal on both pools. */
static void assert_same_pools(stepq_pool_t *host, stepq_pool_t *dev, const int32_t *ids)
{
    uint32_t a[SLOTS], b[SLOTS];

    for (int32_t at = 0; at < SLOTS; at += 64)
        assert_same_pages(host, dev, ids + at, SLOTS - at < 64 ? SLOTS - at : 64);
    assert_int_equal(stepq_pool_health_read(host, ids, SLOTS, a), STEPQ_OK);
    assert_int_equal(stepq_pool_health_read(dev, ids, SLOTS, b), STEPQ_OK);
    assert_memory_equal(a, b, sizeof(a));
}

/* Sources ids[0..99] (repeated), destinations ids[100..399] (distinct), bad
 * entries at 5..9; mask values 0, 1 or -7 at random. */
static void masked_lists(const int32_t *ids, int32_t rot, int32_t *src, int32_t *dst, int32_t *mask,
                         uint64_t *rng)
{
    for (int32_t i = 0; i < MASKED_N; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        src[i] = ids[(i + rot) % 100];
        dst[i] = ids[100 + i];
        mask[i] = (int32_t[]){ 0, 1, -7 }[(*rng >> 33) % 3];
    }
    src[5] = 0;
    dst[6] = STEPQ_POOL_SLOT_PAD;
    src[7] = SLOTS + 1;
    src[8] = dst[8];
    dst[9] = INT32_MIN;
}

static void masked_copy_matches_the_host_backend(void **state)
{
    stepq_pool_t *host = open_backend(STEPQ_POOL_BACKEND_HOST, NULL, 0);
    stepq_pool_t *dev = open_backend(STEPQ_POOL_BACKEND_CUDA, NULL, 0);
    int32_t ids[SLOTS], src[MASKED_N], dst[MASKED_N], mask[MASKED_N];
    int32_t *d_src, *d_dst, *d_mask;
    uint64_t rng = 99;

    fill_both(host, dev, ids, &rng);
    masked_lists(ids, 0, src, dst, mask, &rng);
    d_src = upload(src, MASKED_N);
    d_dst = upload(dst, MASKED_N);
    d_mask = upload(mask, MASKED_N);
    assert_int_equal(stepq_pool_copy_masked(host, src, dst, mask, MASKED_N, NULL), STEPQ_OK);
    assert_int_equal(stepq_pool_copy_masked(dev, d_src, d_dst, d_mask, MASKED_N, NULL), STEPQ_OK);
    assert_same_pools(host, dev, ids);
    /* No mask, other sources. */
    masked_lists(ids, 37, src, dst, mask, &rng);
    put(d_src, src, MASKED_N, NULL);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    assert_int_equal(stepq_pool_copy_masked(host, src, dst, NULL, MASKED_N, NULL), STEPQ_OK);
    assert_int_equal(stepq_pool_copy_masked(dev, d_src, d_dst, NULL, MASKED_N, NULL), STEPQ_OK);
    assert_same_pools(host, dev, ids);
    /* Argument errors are the host path's. */
    assert_int_equal(stepq_pool_copy_masked(dev, NULL, d_dst, NULL, 1, NULL), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_copy_masked(dev, d_src, d_dst, NULL, -1, NULL), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_copy_masked(dev, d_src, d_dst, NULL, 0, NULL), STEPQ_OK);
    assert_same_pools(host, dev, ids);
    cudaFree(d_src);
    cudaFree(d_dst);
    cudaFree(d_mask);
    assert_int_equal(stepq_pool_close(host, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    assert_int_equal(stepq_pool_close(dev, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
}

/* One capture, two replays with other masks and sources in the same buffers. */
static void a_captured_masked_copy_replays_with_new_lists(void **state)
{
    stepq_pool_t *host = open_backend(STEPQ_POOL_BACKEND_HOST, NULL, 0);
    stepq_pool_t *dev = open_backend(STEPQ_POOL_BACKEND_CUDA, NULL, 0);
    int32_t ids[SLOTS], src[MASKED_N], dst[MASKED_N], mask[MASKED_N], none[MASKED_N];
    int32_t *d_src, *d_dst, *d_mask;
    size_t pb = page_bytes_of(host), nodes = 0;
    uint8_t *a = malloc(pb), *b = malloc(pb);
    uint64_t rng = 1234;
    cudaStream_t s;
    cudaGraph_t g;
    cudaGraphExec_t exec;
    int st;

    assert_true(a && b);
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    fill_both(host, dev, ids, &rng);
    memset(none, 0, sizeof(none));
    masked_lists(ids, 0, src, dst, mask, &rng);
    d_src = upload(src, MASKED_N);
    d_dst = upload(dst, MASKED_N);
    d_mask = upload(none, MASKED_N);

    assert_int_equal(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    st = stepq_pool_copy_masked(dev, d_src, d_dst, d_mask, MASKED_N, s);
    assert_int_equal(cudaStreamEndCapture(s, &g), cudaSuccess);
    if (st != STEPQ_OK)
        fail_msg("capture: %s: %s", stepq_status_name(st), stepq_last_error());
    assert_int_equal(cudaGraphGetNodes(g, NULL, &nodes), cudaSuccess);
    assert_int_equal(nodes, 1);
    assert_int_equal(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
    /* The capture ran nothing: the mask was all zero anyway, and no page moved. */
    assert_same_pools(host, dev, ids);

    for (int t = 0; t < 2; t++) {
        if (t == 1)
            masked_lists(ids, 51, src, dst, mask, &rng);
        put(d_src, src, MASKED_N, s);
        put(d_mask, mask, MASKED_N, s);
        assert_int_equal(cudaGraphLaunch(exec, s), cudaSuccess);
        assert_int_equal(cudaStreamSynchronize(s), cudaSuccess);
        assert_int_equal(stepq_pool_copy_masked(host, src, dst, mask, MASKED_N, NULL), STEPQ_OK);
        assert_same_pools(host, dev, ids);
        /* And directly: each selected, valid entry's destination is its source. */
        for (int32_t i = 10; i < MASKED_N; i++) {
            if (!mask[i])
                continue;
            assert_int_equal(stepq_pool_copy_to_host(dev, &src[i], 1, a, pb), STEPQ_OK);
            assert_int_equal(stepq_pool_copy_to_host(dev, &dst[i], 1, b, pb), STEPQ_OK);
            assert_int_equal(stepq_pool_sync(dev), STEPQ_OK);
            assert_memory_equal(a, b, pb);
        }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    cudaFree(d_src);
    cudaFree(d_dst);
    cudaFree(d_mask);
    assert_int_equal(cudaStreamDestroy(s), cudaSuccess);
    free(a);
    free(b);
    assert_int_equal(stepq_pool_close(host, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    assert_int_equal(stepq_pool_close(dev, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
}

static void opening_a_cuda_pool_keeps_the_current_device(void **state)
{
    stepq_pool_t *dev;
    int before = -1, after = -2;

    assert_int_equal(cudaGetDevice(&before), cudaSuccess);
    dev = open_backend(STEPQ_POOL_BACKEND_CUDA, NULL, 0);
    assert_int_equal(cudaGetDevice(&after), cudaSuccess);
    assert_int_equal(before, after);
    assert_int_equal(stepq_pool_close(dev, 0), STEPQ_OK);
    assert_int_equal(cudaGetDevice(&after), cudaSuccess);
    assert_int_equal(before, after);
}

static void a_device_ordinal_out_of_range_is_enodev(void **state)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    struct stepq__pool_layout l;
    stepq_pool_t *pool = NULL;

    assert_int_equal(stepq__pool_layout_synthetic(1, 1, blocks, 0, 16, 256, 0, &l), STEPQ_OK);
    cfg.backend = STEPQ_POOL_BACKEND_CUDA;
    cfg.device = 1000;
    cfg.num_slots = 2;
    assert_int_equal(stepq__pool_open_layout(&cfg, &l, &pool), STEPQ_ENODEV);
    assert_null(pool);
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(random_operations_match_the_host_backend),
#if STEPQ_HAVE_CUDA
        cmocka_unit_test(health_words_follow_alloc_clear_and_copy_on_the_device),
        cmocka_unit_test(masked_copy_matches_the_host_backend),
        cmocka_unit_test(a_captured_masked_copy_replays_with_new_lists),
        cmocka_unit_test(opening_a_cuda_pool_keeps_the_current_device),
        cmocka_unit_test(a_device_ordinal_out_of_range_is_enodev),
#endif
    };
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    struct stepq__pool_layout l;
    stepq_pool_t *probe = NULL;
    int ret;

    cfg.backend = STEPQ_POOL_BACKEND_CUDA;
    cfg.num_slots = 1;
    if (stepq__pool_layout_synthetic(1, 1, blocks, 0, 16, 256, 0, &l) != STEPQ_OK)
        return 1;
    ret = stepq__pool_open_layout(&cfg, &l, &probe);
    if (ret == STEPQ_ENOTSUP || ret == STEPQ_ENODEV) {
        printf("skipped: %s\n", stepq_last_error());
        return 77;
    }
    if (ret != STEPQ_OK) {
        printf("opening a CUDA pool failed: %s\n", stepq_last_error());
        return 1;
    }
    stepq_pool_close(probe, 0);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
