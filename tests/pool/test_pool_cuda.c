/*
 * The CUDA pool backend against the host backend: the same random sequence
 * of alloc / clear / copy / reload on both must leave the same bytes in
 * every page. Exits 77 (skipped) when the build has no CUDA or the machine
 * no device.
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
