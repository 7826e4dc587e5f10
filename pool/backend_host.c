/*
 * Host-memory backend: pages in one page-aligned allocation, every
 * operation a plain memset/memcpy that completes before it returns. It runs
 * everywhere (CI) and is what the CPU reference kernels operate on.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "pool/internal.h"

static int host_init(stepq_pool_t *pool)
{
    size_t n = (size_t)pool->slots + 1;
    void *pages = NULL;

    if (posix_memalign(&pages, STEPQ__POOL_PAGE_ALIGN, n * pool->page_bytes))
        return stepq__error_obj(pool->err, STEPQ_ENOMEM,
                                "out of host memory: %zu pages of %" PRIu64 " B", n,
                                pool->page_bytes);
    pool->health = calloc(n, sizeof(*pool->health));
    if (!pool->health) {
        free(pages);
        return stepq__error_obj(pool->err, STEPQ_ENOMEM, "out of host memory (health words)");
    }
    memset(pages, 0, n * pool->page_bytes);
    pool->pages = pages;
    return STEPQ_OK;
}

static void host_fini(stepq_pool_t *pool)
{
    free(pool->pages);
    free(pool->health);
    pool->pages = NULL;
    pool->health = NULL;
}

static uint8_t *page(stepq_pool_t *pool, int32_t id)
{
    return pool->pages + (size_t)id * pool->page_bytes;
}

static int host_clear(stepq_pool_t *pool, const int32_t *ids, int32_t n, int pages)
{
    for (int32_t i = 0; i < n; i++) {
        if (pages)
            memset(page(pool, ids[i]), 0, pool->page_bytes);
        pool->health[ids[i]] = 0;
    }
    return STEPQ_OK;
}

static int host_copy(stepq_pool_t *pool, const int32_t *src, const int32_t *dst, int32_t n)
{
    for (int32_t i = 0; i < n; i++) {
        memcpy(page(pool, dst[i]), page(pool, src[i]), pool->page_bytes);
        pool->health[dst[i]] = pool->health[src[i]];
    }
    return STEPQ_OK;
}

static int host_to_host(stepq_pool_t *pool, const int32_t *ids, const int32_t *pos, int32_t n,
                        void *host)
{
    for (int32_t i = 0; i < n; i++)
        memcpy((uint8_t *)host + (size_t)pos[i] * pool->page_bytes, page(pool, ids[i]),
               pool->page_bytes);
    return STEPQ_OK;
}

static int host_from_host(stepq_pool_t *pool, const int32_t *ids, const int32_t *pos, int32_t n,
                          const void *host)
{
    for (int32_t i = 0; i < n; i++) {
        memcpy(page(pool, ids[i]), (const uint8_t *)host + (size_t)pos[i] * pool->page_bytes,
               pool->page_bytes);
        pool->health[ids[i]] = 0;
    }
    return STEPQ_OK;
}

static int host_read_health(stepq_pool_t *pool, uint32_t *out)
{
    memcpy(out, pool->health, ((size_t)pool->slots + 1) * sizeof(*out));
    return STEPQ_OK;
}

static int host_sync(stepq_pool_t *pool)
{
    return STEPQ_OK;
}

const struct stepq__pool_ops stepq__pool_host_ops = {
    .name = "host",
    .init = host_init,
    .fini = host_fini,
    .clear = host_clear,
    .copy = host_copy,
    .to_host = host_to_host,
    .from_host = host_from_host,
    .read_health = host_read_health,
    .sync = host_sync,
};
