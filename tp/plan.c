/*
 * The padded page (stepq_tp_plan) and the fingerprints ranks compare
 * (stepq_tp_fingerprint).
 *
 * Ranks hold different heads, and with per-unit widths (temporal, stepq)
 * different numbers of bytes: one rank's page may be larger than another's.
 * A server names a request's state by one slot id on every rank, so every
 * rank must have the same slot count, and for a memory budget that needs
 * the same page size: each rank pads its page to the largest rank's. Every
 * rank holds the whole map, so each computes every rank's page alone and
 * no exchange is needed to agree on it; the fingerprint exchange at pool
 * open only confirms that all ranks started from the same inputs.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "plugin/err.h"
#include "plugin/hash.h"
#include "stepq/tp.h"
#include "stepq/version.h"

/* The version of the group fingerprint's input list: bump it when the list changes. */
static const char group_tag[] = "stepq-tp-group-v1";
static const char page_tag[] = "stepq-tp-page-v1";

/* cfg as the pool reads it: an older caller's struct is completed with the defaults. */
static int import_config(const stepq_pool_config *user, stepq_pool_config *cfg, const char *fn)
{
    static const stepq_pool_config defaults = STEPQ_POOL_CONFIG_INITIALIZER;
    static const size_t ends[] = { STEPQ__FIELD_END(stepq_pool_config, flags) };

    if (!user)
        return stepq__error(STEPQ_EINVAL, "%s: cfg is NULL", fn);
    return stepq__config_import(cfg, &defaults, sizeof(*cfg), user, ends, STEPQ_POOL_CONFIG_VERSION,
                                "stepq_pool_config");
}

static int add_u64(uint64_t *acc, uint64_t v)
{
    return __builtin_add_overflow(*acc, v, acc) ? -1 : 0;
}

/*
 * Plans every rank of cfg twice: unpadded (one slot, so sizing cannot fail
 * on a page that is not the final one), then padded to the largest page
 * with cfg's own sizing. own[r] gets rank r's unpadded plan, padded[r] the
 * padded one (both tp entries).
 */
static int plan_ranks(const stepq_pool_config *cfg, int tp, stepq_pool_plan_info *own,
                      stepq_pool_plan_info *padded, int *largest)
{
    stepq_pool_config c = *cfg;
    uint64_t max_page = 0;
    int ret;

    c.num_slots = 1;
    c.max_running_requests = 0;
    c.memory_budget_bytes = 0;
    for (int r = 0; r < tp; r++) {
        c.tp_rank = r;
        if ((ret = stepq_pool_plan(&c, &own[r])) < 0)
            return ret;
        if (own[r].page_bytes > max_page) {
            max_page = own[r].page_bytes;
            *largest = r;
        }
    }
    c = *cfg;
    c.min_page_bytes = max_page;
    for (int r = 0; r < tp; r++) {
        c.tp_rank = r;
        if ((ret = stepq_pool_plan(&c, &padded[r])) < 0)
            return ret;
        if (padded[r].page_bytes != max_page)
            return stepq__error(STEPQ_EINTERNAL,
                                "stepq_tp_plan: rank %d's page is %" PRIu64 " B padded to %" PRIu64,
                                r, padded[r].page_bytes, max_page);
    }
    return STEPQ_OK;
}

/*
 * Validates cfg, splits the shape (for the message naming both numbers) and
 * plans every rank into two tp-long arrays it allocates; the caller frees
 * *own (one block holds both).
 */
static int plan_all(const stepq_pool_config *user, const char *fn, stepq_pool_config *cfg,
                    stepq_tp_shard_info *sh, stepq_pool_plan_info **own,
                    stepq_pool_plan_info **padded, int *largest)
{
    stepq_model_shape shape;
    int tp, ret;

    *own = *padded = NULL;
    if ((ret = import_config(user, cfg, fn)) < 0)
        return ret;
    if (!cfg->map)
        return stepq__error(STEPQ_EINVAL, "stepq_pool_config.map: a precision map is required");
    if ((ret = stepq_map_shape(cfg->map, &shape)) < 0)
        return ret;
    tp = cfg->tp_size <= 1 ? 1 : cfg->tp_size;
    if (cfg->tp_size < 0)
        return stepq__error(STEPQ_EINVAL, "stepq_pool_config.tp_size: %d is negative",
                            cfg->tp_size);
    if ((ret = stepq_tp_shard(&shape, tp, cfg->tp_rank, sh, sizeof(*sh))) < 0)
        return ret;
    *own = calloc(2 * (size_t)tp, sizeof(**own));
    if (!*own)
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory (%d rank plans)", fn, tp);
    *padded = *own + tp;
    *largest = 0;
    if ((ret = plan_ranks(cfg, tp, *own, *padded, largest)) < 0) {
        free(*own);
        *own = *padded = NULL;
    }
    return ret;
}

int stepq_tp_plan(const stepq_pool_config *user, stepq_tp_plan_info *out, size_t out_size)
{
    stepq_pool_plan_info *own, *padded, *me;
    stepq_pool_config cfg;
    stepq_tp_shard_info sh;
    stepq_tp_plan_info r;
    int largest, ret;

    if (!out || out_size == 0 || out_size > sizeof(r))
        return stepq__error(STEPQ_EINVAL,
                            "stepq_tp_plan: out %s, out_size %zu (this library knows up to %zu)",
                            out ? "set" : "NULL", out_size, sizeof(r));
    if ((ret = plan_all(user, "stepq_tp_plan", &cfg, &sh, &own, &padded, &largest)) < 0)
        return ret;
    memset(&r, 0, sizeof(r));
    me = &padded[sh.tp_rank];
    r.tp_size = sh.tp_size;
    r.tp_rank = sh.tp_rank;
    r.largest_rank = largest;
    r.page_bytes = me->page_bytes;
    r.own_page_bytes = own[sh.tp_rank].page_bytes;
    r.tp_pad_bytes = r.page_bytes - r.own_page_bytes;
    r.state_bytes = me->state_bytes;
    r.state_bytes_compact = me->state_bytes_compact;
    r.conv_bytes = me->conv_bytes;
    r.pad_bytes = me->pad_bytes;
    r.slots = me->slots;
    r.pool_bytes = me->pool_bytes;
    for (int k = 0; k < sh.tp_size; k++) {
        const uint64_t tp_pad = padded[k].page_bytes - own[k].page_bytes;
        if (tp_pad > r.max_tp_pad_bytes)
            r.max_tp_pad_bytes = tp_pad;
        if (add_u64(&r.replica_page_bytes, padded[k].page_bytes) < 0 ||
            add_u64(&r.replica_tp_pad_bytes, tp_pad) < 0 ||
            add_u64(&r.replica_state_bytes, padded[k].state_bytes) < 0 ||
            add_u64(&r.replica_state_bytes_compact, padded[k].state_bytes_compact) < 0 ||
            add_u64(&r.replica_conv_bytes, padded[k].conv_bytes) < 0 ||
            add_u64(&r.replica_pad_bytes, padded[k].pad_bytes) < 0) {
            free(own);
            return stepq__error(STEPQ_ERANGE,
                                "stepq_tp_plan: one slot over %d ranks of %" PRIu64
                                " B pages is more than 2^64 bytes",
                                sh.tp_size, r.page_bytes);
        }
    }
    free(own);
    memcpy(out, &r, out_size);
    return STEPQ_OK;
}

/* Little-endian, so a fingerprint does not depend on the host's byte order. */
static uint64_t fnv_u64(uint64_t h, uint64_t v)
{
    unsigned char b[8];

    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    return stepq__fnv1a(h, b, sizeof(b));
}

int stepq_tp_fingerprint(const stepq_pool_config *user, stepq_tp_fingerprint_info *out,
                         size_t out_size)
{
    stepq_pool_plan_info *own, *padded;
    stepq_pool_config cfg;
    stepq_tp_shard_info sh;
    stepq_tp_fingerprint_info r;
    uint64_t h;
    int largest, ret;

    if (!out || out_size == 0 || out_size > sizeof(r))
        return stepq__error(
            STEPQ_EINVAL,
            "stepq_tp_fingerprint: out %s, out_size %zu (this library knows up to %zu)",
            out ? "set" : "NULL", out_size, sizeof(r));
    if ((ret = plan_all(user, "stepq_tp_fingerprint", &cfg, &sh, &own, &padded, &largest)) < 0)
        return ret;
    memset(&r, 0, sizeof(r));
    if ((ret = stepq_map_fingerprint(cfg.map, &r.map)) < 0) {
        free(own);
        return ret;
    }
    /*
     * The group: what every rank computes alike. The head-block format is
     * the library's, named by its major.minor version; the alignments and
     * min_page_bytes show in each rank's planned bytes.
     */
    h = stepq__fnv1a(STEPQ__FNV_OFFSET, group_tag, sizeof(group_tag) - 1);
    h = fnv_u64(h, STEPQ_VERSION_MAJOR);
    h = fnv_u64(h, STEPQ_VERSION_MINOR);
    h = fnv_u64(h, r.map);
    h = fnv_u64(h, (uint64_t)sh.tp_size);
    for (int k = 0; k < sh.tp_size; k++) {
        h = fnv_u64(h, (uint64_t)k * (uint64_t)sh.num_v_heads);
        h = fnv_u64(h, (uint64_t)sh.num_v_heads);
        h = fnv_u64(h, own[k].page_bytes);
        h = fnv_u64(h, padded[k].page_bytes);
        h = fnv_u64(h, padded[k].state_bytes);
        h = fnv_u64(h, padded[k].state_bytes_compact);
        h = fnv_u64(h, padded[k].conv_bytes);
        h = fnv_u64(h, padded[k].pad_bytes);
    }
    r.group = h;
    h = stepq__fnv1a(STEPQ__FNV_OFFSET, page_tag, sizeof(page_tag) - 1);
    h = fnv_u64(h, r.group);
    h = fnv_u64(h, (uint64_t)sh.tp_rank);
    r.page = h;
    free(own);
    memcpy(out, &r, out_size);
    return STEPQ_OK;
}
