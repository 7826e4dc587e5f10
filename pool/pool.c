/*
 * The pool object: open/close, the table of open pools, the slot allocator
 * and the validation of every id list before anything changes. Data
 * movement is the backend's (backend_host.c, backend_cuda.c).
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "stepq_config.h"

#include "pool/internal.h"
#if STEPQ_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#endif

/* --- policies ------------------------------------------------------------ */

static const struct {
    const char *name;
    int slots;
} policies[STEPQ_POOL_POLICY_COUNT] = {
    [STEPQ_POOL_POLICY_NO_CACHE] = { "no_cache", 1 },
    [STEPQ_POOL_POLICY_NO_BUFFER] = { "no_buffer", 3 },
    [STEPQ_POOL_POLICY_LAZY] = { "lazy", 4 },
    [STEPQ_POOL_POLICY_EXTRA_BUFFER] = { "extra_buffer", 5 },
};

int stepq_pool_policy_slots(stepq_pool_policy policy)
{
    if ((unsigned)policy >= STEPQ_POOL_POLICY_COUNT)
        return stepq__error(STEPQ_EINVAL, "policy %d is not a stepq_pool_policy", (int)policy);
    return policies[policy].slots;
}

const char *stepq_pool_policy_name(stepq_pool_policy policy)
{
    if ((unsigned)policy >= STEPQ_POOL_POLICY_COUNT)
        return "?";
    return policies[policy].name;
}

int stepq_pool_policy_from_name(const char *name, stepq_pool_policy *out)
{
    if (!name || !out)
        return stepq__error(STEPQ_EINVAL, "stepq_pool_policy_from_name: NULL argument");
    for (int i = 0; i < STEPQ_POOL_POLICY_COUNT; i++) {
        if (!strcmp(name, policies[i].name)) {
            *out = (stepq_pool_policy)i;
            return STEPQ_OK;
        }
    }
    return stepq__error(STEPQ_EINVAL,
                        "policy '%s' is not one of no_cache, no_buffer, lazy, extra_buffer", name);
}

/*
 * The slot count of a configuration for pages of page_bytes: exactly one of
 * the sizing fields decides it, the policy's slots per request scaling
 * max_running_requests.
 */
int stepq__pool_sizing(const stepq_pool_config *cfg, uint64_t page_bytes, int32_t *slots, char *err)
{
    int set =
        (cfg->num_slots != 0) + (cfg->max_running_requests != 0) + (cfg->memory_budget_bytes != 0);
    const int32_t max_slots = INT32_MAX - 1;
    int per;

    if (set != 1)
        return stepq__error_obj(err, STEPQ_EINVAL,
                                "stepq_pool_config: set exactly one of num_slots, "
                                "max_running_requests, memory_budget_bytes (%d are set)",
                                set);
    per = stepq_pool_policy_slots(cfg->policy);
    if (per < 0)
        return stepq__error_obj(err, STEPQ_EINVAL, "stepq_pool_config.policy: %d is unknown",
                                (int)cfg->policy);
    if (cfg->num_slots < 0 || cfg->max_running_requests < 0)
        return stepq__error_obj(err, STEPQ_EINVAL,
                                "stepq_pool_config: num_slots %" PRId32
                                " / max_running_requests %" PRId32 " is negative",
                                cfg->num_slots, cfg->max_running_requests);
    if (cfg->num_slots) {
        if (cfg->num_slots > max_slots)
            return stepq__error_obj(err, STEPQ_ERANGE, "num_slots %" PRId32 " is too large",
                                    cfg->num_slots);
        *slots = cfg->num_slots;
    } else if (cfg->max_running_requests) {
        if (cfg->max_running_requests > max_slots / per)
            return stepq__error_obj(err, STEPQ_ERANGE,
                                    "max_running_requests %" PRId32 " x %d slots is too large",
                                    cfg->max_running_requests, per);
        *slots = cfg->max_running_requests * per;
    } else {
        uint64_t pages = cfg->memory_budget_bytes / page_bytes;
        if (pages < 2)
            return stepq__error_obj(err, STEPQ_ENOSPC,
                                    "memory budget %" PRIu64 " B holds %" PRIu64
                                    " pages of %" PRIu64
                                    " B; a pool needs 2 (the sentinel and one slot)",
                                    cfg->memory_budget_bytes, pages, page_bytes);
        *slots = pages - 1 > (uint64_t)max_slots ? max_slots : (int32_t)(pages - 1);
    }
    if ((uint64_t)*slots + 1 > UINT64_MAX / page_bytes)
        return stepq__error_obj(err, STEPQ_ERANGE,
                                "stepq_pool_config: %" PRId32 " slots + 1 of %" PRIu64
                                " B pages overflow 64 bits",
                                *slots, page_bytes);
    return STEPQ_OK;
}

/* --- handles ------------------------------------------------------------- */

/*
 * A pool's handle is an entry of the library's handle table (plugin/handle.h
 * says why: no ABA, no global lock). The entry's mutex is the pool's lock,
 * so a call that waits on it while the pool closes sees the new generation
 * and returns STEPQ_EBADF.
 */
static const char closed_text[] = "pool handle is closed or not valid";

/* Looks the handle up and locks its pool; STEPQ_EBADF when it is not open. */
int stepq__pool_enter(stepq_pool_t *h, const char *fn, stepq_pool_t **pool)
{
    struct stepq__handle_entry *e;
    uint32_t gen = 0;

    *pool = NULL;
    if (!h)
        return stepq__error(STEPQ_EINVAL, "%s: pool is NULL", fn);
    e = stepq__handle_entry_of(h, &gen);
    if (!e)
        return stepq__error(STEPQ_EBADF, "%s: %s", fn, closed_text);
    pthread_mutex_lock(&e->mu);
    *pool = stepq__handle_live(e, gen, STEPQ__HANDLE_POOL);
    if (!*pool) {
        pthread_mutex_unlock(&e->mu);
        return stepq__error(STEPQ_EBADF, "%s: %s", fn, closed_text);
    }
    /* Until the leave, a failure's texts (the check's, then the call's
     * prefixed one) are logged once, as the final text. */
    stepq__log_defer();
    return STEPQ_OK;
}

void stepq__pool_leave(stepq_pool_t *pool)
{
    pthread_mutex_unlock(&pool->entry->mu);
    stepq__log_flush();
}

stepq_pool_t *stepq__pool_resolve(stepq_pool_t *h)
{
    stepq_pool_t *pool = NULL;

    if (stepq__pool_enter(h, "stepq__pool_resolve", &pool) < 0)
        return NULL;
    stepq__pool_leave(pool);
    return pool;
}

const char *stepq_pool_last_error(const stepq_pool_t *h)
{
    /* A copy made under the pool's lock: failing calls on other threads write
     * the pool's text under the same lock, and the copy stays valid for this
     * thread until its next call here. */
    static _Thread_local char text[STEPQ__ERRLEN];
    struct stepq__handle_entry *e;
    stepq_pool_t *pool;
    uint32_t gen = 0;

    /* Not stepq__pool_enter(): asking for a closed pool's text is no failure,
     * so it neither replaces the thread's text (the failure being asked
     * about) nor reaches the logger. */
    if (!h)
        return "pool is NULL";
    e = stepq__handle_entry_of(h, &gen);
    if (!e)
        return closed_text;
    pthread_mutex_lock(&e->mu);
    pool = stepq__handle_live(e, gen, STEPQ__HANDLE_POOL);
    if (pool) {
        memcpy(text, pool->err, sizeof(text));
        text[sizeof(text) - 1] = '\0';
    }
    pthread_mutex_unlock(&e->mu);
    return pool ? text : closed_text;
}

/* --- open / close --------------------------------------------------------- */

/*
 * Checks the arguments of open / plan and imports the caller's config (of
 * any version since the first) into *cfg, this library's struct, so older
 * callers' missing fields take the INITIALIZER's values.
 */
static int check_open_args(const stepq_pool_config *user, stepq_pool_config *cfg, void *out,
                           const char *fn)
{
    static const stepq_pool_config defaults = STEPQ_POOL_CONFIG_INITIALIZER;
    static const size_t ends[] = { STEPQ__FIELD_END(stepq_pool_config, flags) };
    int ret;

    if (!out)
        return stepq__error(STEPQ_EINVAL, "%s: out is NULL", fn);
    if (!user)
        return stepq__error(STEPQ_EINVAL, "%s: cfg is NULL", fn);
    ret = stepq__config_import(cfg, &defaults, sizeof(*cfg), user, ends, STEPQ_POOL_CONFIG_VERSION,
                               "stepq_pool_config");
    if (ret < 0)
        return ret;
    if (!cfg->map)
        return stepq__error(STEPQ_EINVAL, "stepq_pool_config.map: a precision map is required");
    {
        stepq_model_shape shape;
        ret = stepq_map_shape(cfg->map, &shape);
        if (ret == STEPQ_EBADF)
            return stepq__error(ret, "stepq_pool_config.map: map handle is closed or not valid");
        if (ret < 0)
            return ret;
    }
    return STEPQ_OK;
}

/*
 * What a pool holds besides its pages: the health words (backend memory),
 * the layout tables (host) and, on the CUDA backend, one kernel descriptor
 * per head and layer (device memory).
 */
static uint64_t meta_bytes_of(const struct stepq__pool_layout *l, int32_t slots,
                              stepq_pool_backend backend)
{
    const stepq_pool_layout *p = &l->pub;
    uint64_t desc = 0;

#if STEPQ_HAVE_CUDA
    if (backend == STEPQ_POOL_BACKEND_CUDA && l->heads)
        desc = (uint64_t)p->n_blocks * stepq__cuda_layer_bytes_per_head();
#endif
    return (uint64_t)(slots + 1) * sizeof(uint32_t) +
           (uint64_t)p->n_blocks * (sizeof(uint64_t) + 2 * sizeof(uint32_t)) +
           (uint64_t)p->n_blocks * (uint64_t)p->units_per_head + (uint64_t)p->n_layers * 8 + desc;
}

int stepq_pool_plan(const stepq_pool_config *user, stepq_pool_plan_info *out)
{
    struct stepq__pool_layout layout;
    const stepq_pool_layout *l = &layout.pub;
    stepq_pool_config cfg;
    int32_t slots;
    int ret;

    stepq__log_defer();
    ret = check_open_args(user, &cfg, out, "stepq_pool_plan");
    if (ret < 0)
        goto done;
    ret = stepq__pool_layout_build(&cfg, &layout, NULL);
    if (ret < 0)
        goto done;
    ret = stepq__pool_sizing(&cfg, l->page_bytes, &slots, NULL);
    if (ret < 0)
        goto out;
    memset(out, 0, sizeof(*out));
    out->page_bytes = l->page_bytes;
    out->state_bytes = l->state_bytes;
    out->state_bytes_compact = l->state_bytes_compact;
    out->align_bytes = l->state_bytes - l->state_bytes_compact;
    out->conv_bytes = l->conv_bytes;
    out->pad_bytes = l->pad_bytes;
    out->slots = slots;
    out->pool_bytes = (uint64_t)(slots + 1) * l->page_bytes;
    out->meta_bytes = meta_bytes_of(&layout, slots, cfg.backend);
out:
    stepq__pool_layout_free(&layout);
done:
    stepq__log_flush();
    return ret;
}

int stepq_pool_open(const stepq_pool_config *user, stepq_pool_t **out)
{
    struct stepq__pool_layout layout;
    stepq_pool_config cfg;
    int ret;

    if (out)
        *out = NULL;
    /* Layout and backend failures wrap inner texts: logged once, at the end. */
    stepq__log_defer();
    ret = check_open_args(user, &cfg, out, "stepq_pool_open");
    if (ret >= 0)
        ret = stepq__pool_layout_build(&cfg, &layout, NULL);
    if (ret >= 0)
        ret = stepq__pool_open_layout(&cfg, &layout, out);
    stepq__log_flush();
    return ret;
}

int stepq__pool_open_layout(const stepq_pool_config *cfg, struct stepq__pool_layout *layout,
                            stepq_pool_t **out)
{
    stepq_pool_t *pool;
    int32_t slots;
    size_t n;
    int ret;

    *out = NULL;
    if (cfg->backend != STEPQ_POOL_BACKEND_HOST && cfg->backend != STEPQ_POOL_BACKEND_CUDA) {
        ret =
            stepq__error(STEPQ_EINVAL, "stepq_pool_config.backend: %d is not host (0) or cuda (1)",
                         (int)cfg->backend);
        goto fail_layout;
    }
    if (cfg->flags & ~STEPQ_POOL_FLAG_CLEAR_ON_ALLOC) {
        ret = stepq__error(STEPQ_EINVAL, "stepq_pool_config.flags: unknown bits 0x%x",
                           cfg->flags & ~STEPQ_POOL_FLAG_CLEAR_ON_ALLOC);
        goto fail_layout;
    }
    ret = stepq__pool_sizing(cfg, layout->pub.page_bytes, &slots, NULL);
    if (ret < 0)
        goto fail_layout;
    if ((uint64_t)(slots + 1) > SIZE_MAX / layout->pub.page_bytes) {
        ret = stepq__error(STEPQ_ENOMEM, "%" PRId32 " pages of %" PRIu64 " B overflow size_t",
                           slots + 1, layout->pub.page_bytes);
        goto fail_layout;
    }

    pool = calloc(1, sizeof(*pool));
    if (!pool) {
        ret = stepq__error(STEPQ_ENOMEM, "out of memory (pool)");
        goto fail_layout;
    }
    pool->backend = cfg->backend;
    pool->ops =
        cfg->backend == STEPQ_POOL_BACKEND_CUDA ? &stepq__pool_cuda_ops : &stepq__pool_host_ops;
    pool->flags = cfg->flags;
    pool->policy = cfg->policy;
    pool->device = cfg->device;
    pool->stream = cfg->stream;
    pool->layout = *layout;
    pool->page_bytes = layout->pub.page_bytes;
    pool->slots = slots;

    /* The pages first: a pool too large for the memory fails here, before
     * seconds of bookkeeping for its slots are spent. */
    ret = pool->ops->init(pool);
    if (ret < 0) {
        stepq__error(ret, "%s", pool->err);
        goto fail_bookkeeping;
    }
    n = (size_t)slots + 1;
    pool->ring = malloc(n * sizeof(*pool->ring));
    pool->state = calloc(n, 1);
    pool->mark = calloc(n, 1);
    pool->scratch = malloc(4 * n * sizeof(*pool->scratch));
    if (!pool->ring || !pool->state || !pool->mark || !pool->scratch) {
        ret =
            stepq__error(STEPQ_ENOMEM, "out of memory (bookkeeping for %" PRId32 " slots)", slots);
        goto fail_backend;
    }
    pool->state[0] = STEPQ__SLOT_SENTINEL;
    for (int32_t i = 0; i < slots; i++)
        pool->ring[i] = i + 1;
    pool->ring_head = 0;
    pool->ring_count = slots;

    ret = stepq__handle_add(pool, STEPQ__HANDLE_POOL, (void **)out, &pool->entry, pool->err);
    if (ret < 0) {
        stepq__error(ret, "%s", pool->err);
        goto fail_backend;
    }
    return STEPQ_OK;

fail_backend:
    pool->ops->fini(pool);
fail_bookkeeping:
    free(pool->ring);
    free(pool->state);
    free(pool->mark);
    free(pool->scratch);
    stepq__pool_layout_free(&pool->layout);
    free(pool);
    return ret;
fail_layout:
    stepq__pool_layout_free(layout);
    return ret;
}

int stepq_pool_close(stepq_pool_t *h, unsigned flags)
{
    stepq_pool_t *pool;
    struct stepq__handle_entry *e;
    int ret;

    if (!h)
        return STEPQ_OK;
    if (flags & ~STEPQ_POOL_CLOSE_FORCE)
        return stepq__error(STEPQ_EINVAL, "stepq_pool_close: unknown flags 0x%x",
                            flags & ~STEPQ_POOL_CLOSE_FORCE);
    ret = stepq__pool_enter(h, "stepq_pool_close", &pool);
    if (ret < 0)
        return ret;
    if (pool->in_use > 0 && !(flags & STEPQ_POOL_CLOSE_FORCE)) {
        ret = stepq__error_obj(pool->err, STEPQ_EBUSY,
                               "stepq_pool_close: %" PRId32
                               " slots are still allocated (free them or pass "
                               "STEPQ_POOL_CLOSE_FORCE)",
                               pool->in_use);
        stepq__pool_leave(pool);
        return ret;
    }
    /* From here the handle is dead: a call waiting on the lock sees the new
     * generation and returns STEPQ_EBADF. */
    e = pool->entry;
    stepq__handle_drop(e);
    pthread_mutex_unlock(&e->mu);

    /* The pool is closed either way; a failure of its queued work or of its
     * device is still the caller's to know. */
    ret = pool->ops->fini(pool);
    if (ret < 0)
        stepq__error(ret, "%s", pool->err);
    free(pool->ring);
    free(pool->state);
    free(pool->mark);
    free(pool->scratch);
    stepq__pool_layout_free(&pool->layout);
    free(pool);
    stepq__log_flush(); /* the enter's, as stepq__pool_leave() would */
    return ret;
}

/* --- id validation ------------------------------------------------------- */

/* Range and sentinel check of entry i of a list named what (not -1). */
static int check_id(stepq_pool_t *pool, const char *what, int32_t i, int32_t id)
{
    if (id == STEPQ_POOL_SLOT_SENTINEL)
        return stepq__error_obj(pool->err, STEPQ_EINVAL,
                                "%s[%" PRId32 "] = 0 is the sentinel slot, never allocated", what,
                                i);
    if (id < -1 || id > pool->slots)
        return stepq__error_obj(pool->err, STEPQ_ERANGE,
                                "%s[%" PRId32 "] = %" PRId32
                                " is out of range (slots are 1..%" PRId32 ", -1 is padding)",
                                what, i, id, pool->slots);
    return STEPQ_OK;
}

static void unmark(stepq_pool_t *pool, const int32_t *ids, int32_t n)
{
    for (int32_t i = 0; i < n; i++)
        if (ids[i] > 0 && ids[i] <= pool->slots)
            pool->mark[ids[i]] = 0;
}

/* Which repeated entries a list may have. */
enum { DUP_OK, DUP_EINVAL, DUP_DOUBLEFREE };

/*
 * Validates a list: every entry -1 or an allocated slot, repeats as `dup`
 * says. Compacts the non-padding ids into compact (and their positions into
 * pos, when not NULL: then repeats are kept and the caller bounds n);
 * *m gets their count.
 */
static int validate_list(stepq_pool_t *pool, const char *what, const int32_t *ids, int32_t n,
                         int dup, int32_t *compact, int32_t *pos, int32_t *m)
{
    int ret = STEPQ_OK;
    int32_t i, k = 0;

    if (n < 0)
        return stepq__error_obj(pool->err, STEPQ_EINVAL, "%s: n = %" PRId32 " is negative", what,
                                n);
    if (n > 0 && !ids)
        return stepq__error_obj(pool->err, STEPQ_EINVAL, "%s is NULL with n = %" PRId32, what, n);
    for (i = 0; i < n; i++) {
        int32_t id = ids[i];

        if (id == STEPQ_POOL_SLOT_PAD)
            continue;
        ret = check_id(pool, what, i, id);
        if (ret < 0)
            break;
        if (pool->state[id] != STEPQ__SLOT_USED) {
            ret = stepq__error_obj(pool->err,
                                   dup == DUP_DOUBLEFREE ? STEPQ_EDOUBLEFREE : STEPQ_EINVAL,
                                   "%s[%" PRId32 "] = %" PRId32 " is not allocated%s", what, i, id,
                                   dup == DUP_DOUBLEFREE ? " (double free)" : "");
            break;
        }
        if (dup == DUP_OK && pool->mark[id] && !pos)
            continue; /* compacted once: keeps compact within slots + 1 entries */
        if (dup != DUP_OK && pool->mark[id]) {
            ret = stepq__error_obj(
                pool->err, dup == DUP_DOUBLEFREE ? STEPQ_EDOUBLEFREE : STEPQ_EINVAL,
                "%s[%" PRId32 "] = %" PRId32 " is listed more than once", what, i, id);
            break;
        }
        pool->mark[id] = 1;
        compact[k] = id;
        if (pos)
            pos[k] = i;
        k++;
    }
    unmark(pool, ids, i);
    *m = k;
    return ret;
}

/* --- slot operations ------------------------------------------------------ */

int stepq_pool_alloc(stepq_pool_t *h, int32_t n, int32_t *ids)
{
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_alloc", &pool);

    if (ret < 0)
        return ret;
    if (n < 0 || (n > 0 && !ids)) {
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL,
                               "stepq_pool_alloc: n = %" PRId32 " with ids %s", n,
                               ids ? "set" : "NULL");
        goto out;
    }
    if (n > pool->ring_count) {
        ret = stepq__error_obj(pool->err, STEPQ_ENOSPC,
                               "stepq_pool_alloc: %" PRId32 " slots requested, %" PRId32
                               " of %" PRId32 " free",
                               n, pool->ring_count, pool->slots);
        goto out;
    }
    if (n == 0)
        goto out;
    /* Read the candidates without taking them, so a backend failure (the
     * health reset is a device operation) leaves the ring as it was. */
    for (int32_t i = 0; i < n; i++)
        ids[i] = pool->ring[(pool->ring_head + i) % pool->slots];
    ret = pool->ops->clear(pool, ids, n, !!(pool->flags & STEPQ_POOL_FLAG_CLEAR_ON_ALLOC));
    if (ret < 0) {
        stepq__error(ret, "%s", pool->err);
        for (int32_t i = 0; i < n; i++)
            ids[i] = STEPQ_POOL_SLOT_PAD;
        goto out;
    }
    for (int32_t i = 0; i < n; i++)
        pool->state[ids[i]] = STEPQ__SLOT_USED;
    pool->ring_head = (pool->ring_head + n) % pool->slots;
    pool->ring_count -= n;
    pool->in_use += n;
    pool->n_alloc += (uint64_t)n;
    if (pool->in_use > pool->high_water)
        pool->high_water = pool->in_use;
out:
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_free(stepq_pool_t *h, const int32_t *ids, int32_t n)
{
    int32_t m;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_free", &pool);

    if (ret < 0)
        return ret;
    ret = validate_list(pool, "ids", ids, n, DUP_DOUBLEFREE, pool->scratch, NULL, &m);
    if (ret < 0) {
        stepq__error(ret, "stepq_pool_free: %s", pool->err);
        goto out;
    }
    for (int32_t i = 0; i < m; i++) {
        int32_t id = pool->scratch[i];

        pool->state[id] = STEPQ__SLOT_FREE;
        pool->ring[(pool->ring_head + pool->ring_count) % pool->slots] = id;
        pool->ring_count++;
    }
    pool->in_use -= m;
    pool->n_free += (uint64_t)m;
out:
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_clear(stepq_pool_t *h, const int32_t *ids, int32_t n)
{
    int32_t m;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_clear", &pool);

    if (ret < 0)
        return ret;
    ret = validate_list(pool, "ids", ids, n, DUP_OK, pool->scratch, NULL, &m);
    if (ret >= 0 && m > 0)
        ret = pool->ops->clear(pool, pool->scratch, m, 1);
    if (ret < 0)
        stepq__error(ret, "stepq_pool_clear: %s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_copy(stepq_pool_t *h, const int32_t *src, const int32_t *dst, int32_t n)
{
    int32_t *s, *d, m = 0;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_copy", &pool);

    if (ret < 0)
        return ret;
    s = pool->scratch;
    d = pool->scratch + pool->slots + 1;
    if (n < 0 || (n > 0 && (!src || !dst))) {
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL, "n = %" PRId32 " with src %s and dst %s", n,
                               src ? "set" : "NULL", dst ? "set" : "NULL");
        goto out;
    }
    if (n > pool->slots + 1) {
        /* Distinct destinations bound a valid list; this keeps scratch in bounds. */
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL,
                               "n = %" PRId32 " pairs, more than the pool's %" PRId32 " slots", n,
                               pool->slots);
        goto out;
    }
    /* mark bit 1: a source, bit 2: a destination. */
    for (int32_t i = 0; i < n && ret >= 0; i++) {
        if (src[i] == STEPQ_POOL_SLOT_PAD || dst[i] == STEPQ_POOL_SLOT_PAD)
            continue;
        if ((ret = check_id(pool, "src", i, src[i])) < 0 ||
            (ret = check_id(pool, "dst", i, dst[i])) < 0)
            break;
        if (pool->state[src[i]] != STEPQ__SLOT_USED || pool->state[dst[i]] != STEPQ__SLOT_USED) {
            int bad_src = pool->state[src[i]] != STEPQ__SLOT_USED;
            ret = stepq__error_obj(pool->err, STEPQ_EINVAL,
                                   "%s[%" PRId32 "] = %" PRId32 " is not allocated",
                                   bad_src ? "src" : "dst", i, bad_src ? src[i] : dst[i]);
            break;
        }
        if (pool->mark[dst[i]] & 2) {
            ret = stepq__error_obj(pool->err, STEPQ_EINVAL,
                                   "dst[%" PRId32 "] = %" PRId32 " is a destination more than once",
                                   i, dst[i]);
            break;
        }
        pool->mark[src[i]] |= 1;
        pool->mark[dst[i]] |= 2;
        s[m] = src[i];
        d[m] = dst[i];
        m++;
    }
    if (ret >= 0) {
        for (int32_t i = 0; i < m; i++) {
            if (pool->mark[s[i]] == 3 || pool->mark[d[i]] == 3) {
                int32_t slot = pool->mark[s[i]] == 3 ? s[i] : d[i];
                ret = stepq__error_obj(
                    pool->err, STEPQ_EINVAL,
                    "slot %" PRId32 " is both a source and a destination: the lists overlap", slot);
                break;
            }
        }
    }
    for (int32_t i = 0; i < m; i++) {
        pool->mark[s[i]] = 0;
        pool->mark[d[i]] = 0;
    }
    if (ret >= 0 && m > 0)
        ret = pool->ops->copy(pool, s, d, m);
out:
    if (ret < 0)
        stepq__error(ret, "stepq_pool_copy: %s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_copy_masked(stepq_pool_t *h, const int32_t *src, const int32_t *dst,
                           const int32_t *mask, int32_t n, void *stream)
{
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_copy_masked", &pool);

    if (ret < 0)
        return ret;
    /* Only the arguments themselves: the lists may be device memory, and a
     * captured launch reads them at each replay, not now. */
    if (n < 0 || (n > 0 && (!src || !dst))) {
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL, "n = %" PRId32 " with src %s and dst %s", n,
                               src ? "set" : "NULL", dst ? "set" : "NULL");
        goto out;
    }
    if (n > STEPQ_POOL_COPY_MASKED_MAX) {
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL,
                               "n = %" PRId32 " entries, more than STEPQ_POOL_COPY_MASKED_MAX (%d)",
                               n, STEPQ_POOL_COPY_MASKED_MAX);
        goto out;
    }
    if (n > 0)
        ret = pool->ops->copy_masked(pool, src, dst, mask, n, stream);
out:
    if (ret < 0)
        stepq__error(ret, "stepq_pool_copy_masked: %s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

static int check_host(stepq_pool_t *pool, int32_t n, const void *host, size_t host_bytes)
{
    if (n > 0 && !host)
        return stepq__error_obj(pool->err, STEPQ_EINVAL, "host is NULL");
    if (n > 0 && host_bytes / (size_t)n < pool->page_bytes)
        return stepq__error_obj(pool->err, STEPQ_EINVAL,
                                "host buffer of %zu B is smaller than %" PRId32 " pages of %" PRIu64
                                " B",
                                host_bytes, n, pool->page_bytes);
    return STEPQ_OK;
}

/* Lists that keep their repeats are bounded by the scratch space (slots + 1 entries). */
static int check_list_bound(stepq_pool_t *pool, int32_t n, const char *hint)
{
    if (n > pool->slots + 1)
        return stepq__error_obj(pool->err, STEPQ_EINVAL,
                                "n = %" PRId32 " is more than the pool's %" PRId32 " slots%s", n,
                                pool->slots, hint);
    return STEPQ_OK;
}

/*
 * The checks of a copy between pages and a host buffer: the list (bounded,
 * repeats as `dup` says, compacted into scratch with positions in *pos) and
 * the host buffer; *m gets the number of pages to copy.
 */
static int check_host_list(stepq_pool_t *pool, const int32_t *ids, int32_t n, int dup,
                           const void *host, size_t host_bytes, const char *hint, int32_t **pos,
                           int32_t *m)
{
    int ret;

    *pos = pool->scratch + pool->slots + 1;
    *m = 0;
    ret = check_list_bound(pool, n, hint);
    if (ret >= 0)
        ret = validate_list(pool, "ids", ids, n, dup, pool->scratch, *pos, m);
    if (ret >= 0)
        ret = check_host(pool, n, host, host_bytes);
    return ret;
}

int stepq_pool_copy_to_host(stepq_pool_t *h, const int32_t *ids, int32_t n, void *host,
                            size_t host_bytes)
{
    int32_t m, *pos;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_copy_to_host", &pool);

    if (ret < 0)
        return ret;
    /* Pages are read-only here, so repeats are fine, but the lists are
     * bounded by the scratch space: split longer lists. */
    ret = check_host_list(pool, ids, n, DUP_OK, host, host_bytes, "; split the list", &pos, &m);
    if (ret >= 0 && m > 0)
        ret = pool->ops->to_host(pool, pool->scratch, pos, m, host);
    if (ret < 0)
        stepq__error(ret, "stepq_pool_copy_to_host: %s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_copy_from_host(stepq_pool_t *h, const int32_t *ids, int32_t n, const void *host,
                              size_t host_bytes)
{
    int32_t m, *pos;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_copy_from_host", &pool);

    if (ret < 0)
        return ret;
    ret = check_host_list(pool, ids, n, DUP_EINVAL, host, host_bytes, "", &pos, &m);
    if (ret >= 0 && m > 0)
        ret = pool->ops->from_host(pool, pool->scratch, pos, m, host);
    if (ret < 0)
        stepq__error(ret, "stepq_pool_copy_from_host: %s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_sync(stepq_pool_t *h)
{
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_sync", &pool);

    if (ret < 0)
        return ret;
    ret = pool->ops->sync(pool);
    if (ret < 0)
        stepq__error(ret, "stepq_pool_sync: %s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

/* --- queries ------------------------------------------------------------- */

int stepq_pool_buffer_infos(stepq_pool_t *h, stepq_pool_buffer_info *out, int cap, int *count)
{
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_buffer_infos", &pool);

    if (ret < 0)
        return ret;
    if (!count || (cap > 0 && !out)) {
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL, "stepq_pool_buffer_infos: NULL argument");
        goto out;
    }
    *count = 2;
    if (cap < 2) {
        ret = stepq__error_obj(pool->err, STEPQ_ERANGE,
                               "stepq_pool_buffer_infos: cap %d, the pool has 2 buffers", cap);
        goto out;
    }
    out[0].ptr = pool->pages;
    out[0].bytes = (uint64_t)(pool->slots + 1) * pool->page_bytes;
    out[0].item_bytes = pool->page_bytes;
    out[0].name = "pages";
    out[1].ptr = pool->health;
    out[1].bytes = (uint64_t)(pool->slots + 1) * sizeof(uint32_t);
    out[1].item_bytes = sizeof(uint32_t);
    out[1].name = "health";
out:
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_health_words(stepq_pool_t *h, uint32_t **words)
{
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_health_words", &pool);

    if (ret < 0)
        return ret;
    if (!words)
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL, "stepq_pool_health_words: words is NULL");
    else
        *words = pool->health;
    stepq__pool_leave(pool);
    return ret;
}

/* Reads all health words into a temporary host copy (*buf, to be freed). */
static int read_health(stepq_pool_t *pool, uint32_t **buf)
{
    int ret;

    *buf = malloc(((size_t)pool->slots + 1) * sizeof(uint32_t));
    if (!*buf)
        return stepq__error_obj(pool->err, STEPQ_ENOMEM, "out of memory (health words)");
    ret = pool->ops->read_health(pool, *buf);
    if (ret < 0) {
        free(*buf);
        *buf = NULL;
    }
    return ret;
}

int stepq_pool_health_read(stepq_pool_t *h, const int32_t *ids, int32_t n, uint32_t *out)
{
    uint32_t *words = NULL;
    int32_t m;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_health_read", &pool);

    if (ret < 0)
        return ret;
    ret = check_list_bound(pool, n, "");
    if (ret >= 0)
        ret = validate_list(pool, "ids", ids, n, DUP_OK, pool->scratch, NULL, &m);
    if (ret >= 0 && n > 0 && !out)
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL, "out is NULL");
    if (ret >= 0)
        ret = read_health(pool, &words);
    if (ret >= 0)
        for (int32_t i = 0; i < n; i++)
            out[i] = ids[i] == STEPQ_POOL_SLOT_PAD ? 0 : words[ids[i]];
    free(words);
    if (ret < 0)
        stepq__error(ret, "stepq_pool_health_read: %s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_get_stats(stepq_pool_t *h, stepq_pool_stats *out, size_t stats_size)
{
    stepq_pool_stats s;
    const stepq_pool_layout *l;
    uint32_t *words = NULL;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_get_stats", &pool);

    if (ret < 0)
        return ret;
    if (!out || stats_size == 0 || stats_size > sizeof(s)) {
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL,
                               "stepq_pool_get_stats: out %s, stats_size %zu (this library "
                               "knows up to %zu)",
                               out ? "set" : "NULL", stats_size, sizeof(s));
        goto out;
    }
    ret = read_health(pool, &words);
    if (ret < 0) {
        stepq__error(ret, "stepq_pool_get_stats: %s", pool->err);
        goto out;
    }
    l = &pool->layout.pub;
    memset(&s, 0, sizeof(s));
    s.capacity = pool->slots;
    s.in_use = pool->in_use;
    s.available = pool->ring_count;
    s.high_water = pool->high_water;
    s.n_alloc = pool->n_alloc;
    s.n_free = pool->n_free;
    s.page_bytes = pool->page_bytes;
    s.pool_bytes = (uint64_t)(pool->slots + 1) * pool->page_bytes;
    s.in_use_bytes = (uint64_t)pool->in_use * pool->page_bytes;
    s.meta_bytes = meta_bytes_of(&pool->layout, pool->slots, pool->backend);
    s.state_bytes = l->state_bytes;
    s.state_bytes_compact = l->state_bytes_compact;
    s.conv_bytes = l->conv_bytes;
    s.pad_bytes = l->pad_bytes;
    for (int32_t i = 1; i <= pool->slots; i++) {
        if (pool->state[i] == STEPQ__SLOT_USED && words[i]) {
            s.health_any |= words[i];
            s.health_slots++;
        }
    }
    free(words);
    memcpy(out, &s, stats_size);
out:
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_get_layout(stepq_pool_t *h, const stepq_pool_layout **out)
{
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_get_layout", &pool);

    if (ret < 0)
        return ret;
    if (!out)
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL, "stepq_pool_get_layout: out is NULL");
    else
        *out = &pool->layout.pub;
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_page(stepq_pool_t *h, int32_t slot, void **ptr)
{
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_page", &pool);

    if (ret < 0)
        return ret;
    if (!ptr)
        ret = stepq__error_obj(pool->err, STEPQ_EINVAL, "stepq_pool_page: ptr is NULL");
    else if (slot < 0 || slot > pool->slots)
        ret = stepq__error_obj(pool->err, STEPQ_ERANGE,
                               "stepq_pool_page: slot %" PRId32 " is not in 0..%" PRId32, slot,
                               pool->slots);
    else
        *ptr = pool->pages + (size_t)slot * pool->page_bytes;
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_is_allocated(stepq_pool_t *h, int32_t slot)
{
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq_pool_is_allocated", &pool);

    if (ret < 0)
        return ret;
    if (slot < 0 || slot > pool->slots)
        ret = stepq__error_obj(pool->err, STEPQ_ERANGE,
                               "stepq_pool_is_allocated: slot %" PRId32 " is not in 0..%" PRId32,
                               slot, pool->slots);
    else
        ret = pool->state[slot] == STEPQ__SLOT_USED;
    stepq__pool_leave(pool);
    return ret;
}

int stepq__pool_check(stepq_pool_t *h)
{
    int32_t used = 0;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, "stepq__pool_check", &pool);

    if (ret < 0)
        return ret;
#define FAIL(...)                                                        \
    do {                                                                 \
        ret = stepq__error_obj(pool->err, STEPQ_EINTERNAL, __VA_ARGS__); \
        goto out;                                                        \
    } while (0)
    if (pool->state[0] != STEPQ__SLOT_SENTINEL)
        FAIL("slot 0 lost its sentinel state (%d)", pool->state[0]);
    for (int32_t i = 1; i <= pool->slots; i++) {
        if (pool->state[i] == STEPQ__SLOT_USED)
            used++;
        else if (pool->state[i] != STEPQ__SLOT_FREE)
            FAIL("slot %" PRId32 " has state %d", i, pool->state[i]);
        if (pool->mark[i])
            FAIL("slot %" PRId32 " has a stale mark", i);
    }
    if (used != pool->in_use)
        FAIL("%" PRId32 " slots are marked used, in_use says %" PRId32, used, pool->in_use);
    if (pool->ring_count + pool->in_use != pool->slots)
        FAIL("free ring holds %" PRId32 " + %" PRId32 " in use != %" PRId32 " slots",
             pool->ring_count, pool->in_use, pool->slots);
    if (pool->n_alloc - pool->n_free != (uint64_t)pool->in_use)
        FAIL("n_alloc - n_free = %" PRIu64 " != in_use %" PRId32, pool->n_alloc - pool->n_free,
             pool->in_use);
    for (int32_t k = 0; k < pool->ring_count; k++) {
        int32_t id = pool->ring[(pool->ring_head + k) % pool->slots];
        if (id < 1 || id > pool->slots)
            FAIL("free ring entry %" PRId32 " is %" PRId32, k, id);
        if (pool->state[id] != STEPQ__SLOT_FREE)
            FAIL("slot %" PRId32 " is in the free ring but not free", id);
        if (pool->mark[id])
            FAIL("slot %" PRId32 " is in the free ring twice", id);
        pool->mark[id] = 1;
    }
#undef FAIL
out:
    for (int32_t k = 0; k < pool->ring_count; k++) {
        int32_t id = pool->ring[(pool->ring_head + k) % pool->slots];
        if (id >= 1 && id <= pool->slots)
            pool->mark[id] = 0;
    }
    stepq__pool_leave(pool);
    return ret;
}
