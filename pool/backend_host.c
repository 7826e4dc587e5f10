/*
 * Host-memory backend: pages in one page-aligned allocation, every
 * operation a plain memset/memcpy that completes before it returns. It runs
 * everywhere (CI) and is what the CPU reference kernels operate on.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/format.h"
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

static int host_fini(stepq_pool_t *pool)
{
    free(pool->pages);
    free(pool->health);
    pool->pages = NULL;
    pool->health = NULL;
    return STEPQ_OK;
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

/* In list order: a destination listed twice ends with its last entry's page
 * (the public contract leaves that unspecified). */
static int host_copy_masked(stepq_pool_t *pool, const int32_t *src, const int32_t *dst,
                            const int32_t *mask, int32_t n, void *stream)
{
    (void)stream;
    for (int32_t i = 0; i < n; i++) {
        const int32_t s = src[i], d = dst[i];

        if (mask && mask[i] == 0)
            continue;
        if (s < 1 || s > pool->slots || d < 1 || d > pool->slots || s == d)
            continue;
        host_copy(pool, &src[i], &dst[i], 1);
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

/* --- the data path: the C reference kernels ------------------------------- */

/* A reference kernel's failure (thread-local text) as the pool's. */
static int ref_fail(stepq_pool_t *pool, int ret)
{
    return stepq__error_obj(pool->err, ret, "host backend: %s", stepq_last_error());
}

static int host_decode(stepq_pool_t *pool, int layer, const struct stepq__step_args *a)
{
    struct stepq__packed_layer pl;
    int ret;

    stepq__pool_packed_layer(pool, layer, &pl);
    ret = stepq__ref_step_packed(a, &pl);
    return ret < 0 ? ref_fail(pool, ret) : STEPQ_OK;
}

/*
 * The reference kernels move fp32; a bf16 tensor goes through an fp32 copy
 * (exact on the way in; rounded to nearest even on the way out, as the
 * CUDA kernels store it).
 */
static int host_transfer(stepq_pool_t *pool, int layer, int pack, const stepq_prefill_args *p,
                         void *stream)
{
    const stepq_pool_layout *l = &pool->layout.pub;
    const size_t per = (size_t)l->n_local_heads * (size_t)l->d_k * (size_t)l->d_v;
    const size_t stride = p->state_stride ? (size_t)p->state_stride : per;
    size_t fstride = stride; /* of the fp32 tensor the reference moves */
    struct stepq__packed_layer pl;
    float *tmp = NULL;
    int ret;

    (void)stream;
    stepq__pool_packed_layer(pool, layer, &pl);
    if (p->dtype == STEPQ_DTYPE_BF16) {
        tmp = malloc((size_t)p->n * per * sizeof(float));
        if (!tmp)
            return stepq__error_obj(
                pool->err, STEPQ_ENOMEM,
                "host backend: out of memory (fp32 copy of %" PRId32 " bf16 states)", p->n);
        fstride = per;
    }
    if (pack) {
        if (tmp) {
            const uint16_t *src = p->states;
            for (int32_t e = 0; e < p->n; e++)
                for (size_t i = 0; i < per; i++)
                    tmp[(size_t)e * per + i] = stepq__bf16_to_float(src[(size_t)e * stride + i]);
        }
        ret = stepq__ref_pack(&pl, p->n, p->slot_ids, tmp ? tmp : p->states, fstride,
                              (stepq__layout)p->layout, pool->health, p->health_counts, NULL);
    } else {
        ret = stepq__ref_unpack(&pl, p->n, p->slot_ids, tmp ? tmp : p->states, fstride,
                                (stepq__layout)p->layout, NULL);
        if (ret >= 0 && tmp) {
            uint16_t *dst = p->states;
            for (int32_t e = 0; e < p->n; e++)
                if (p->slot_ids[e] != STEPQ_POOL_SLOT_PAD)
                    for (size_t i = 0; i < per; i++)
                        dst[(size_t)e * stride + i] =
                            stepq__bf16_from_float(tmp[(size_t)e * per + i]);
        }
    }
    free(tmp);
    return ret < 0 ? ref_fail(pool, ret) : STEPQ_OK;
}

/* The reference runs every shape, dtype and method the pool could open. */
static int host_supports(stepq_pool_t *pool, stepq_op op, int layer, const void *args)
{
    return STEPQ_OK;
}

const struct stepq__pool_ops stepq__pool_host_ops = {
    .name = "host",
    .init = host_init,
    .fini = host_fini,
    .clear = host_clear,
    .copy = host_copy,
    .copy_masked = host_copy_masked,
    .to_host = host_to_host,
    .from_host = host_from_host,
    .read_health = host_read_health,
    .sync = host_sync,
    .decode = host_decode,
    .transfer = host_transfer,
    .supports = host_supports,
};
