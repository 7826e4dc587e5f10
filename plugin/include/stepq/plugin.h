/*
 * Loading stepq as a plugin: one exported function, stepq_plugin_get(),
 * returns a versioned table of function pointers to the public API, so a
 * server can dlopen() the library, resolve that one symbol and call
 * everything through the table (NCCL's external tuner plugin is the model:
 * one struct per ABI version, and a loader that asks for the newest version
 * it knows first, then older ones). Also here: the logger, the callback
 * through which the library reports what it would otherwise have to print.
 *
 * The lookup, as a server does it:
 *
 *     void *lib = dlopen("libstepq.so.0.1", RTLD_NOW | RTLD_LOCAL);
 *     stepq_plugin_get_fn get;
 *     void *sym = dlsym(lib, STEPQ_PLUGIN_SYMBOL);
 *     memcpy(&get, &sym, sizeof(get));
 *     const struct stepq_plugin_v1 *p = get(1);  // newest known first, then older
 *     if (!p || p->version != 1 || p->size < sizeof(*p))
 *         ...                                     // not a stepq this server can use
 *
 * ABI rules (what keeps old servers working with a new library and the
 * reverse):
 *   - A released struct stepq_plugin_vN never changes: no member is removed,
 *     reordered, retyped or given a new meaning, and its size stays. A
 *     public function whose signature must change keeps its old entry in the
 *     old tables and gets a new member in the next version.
 *   - Version N+1 is declared by copying every member of version N, in
 *     order, and appending the new ones; the library keeps one static
 *     table per version it supports, so stepq_plugin_get(N) keeps returning
 *     the struct of version N, with size = sizeof(struct stepq_plugin_vN).
 *   - A table's version equals the version asked for; its size is at least
 *     the size of that version's struct. Every member is non-NULL.
 *   - The argument structs the entries take (stepq_pool_config,
 *     stepq_step_args, ...) carry their own size/magic/version headers and
 *     evolve by those rules (stepq/common.h), independently of the table.
 *
 * The tables are static constants: stepq_plugin_get() may be called from
 * any thread, any number of times, and the pointers stay valid until the
 * library is unloaded.
 *
 * Unloading: load the library once per process and keep it. It holds state
 * for the life of the process (the handle table, whose entries are never
 * freed so that a closed handle stays invalid for good), which a dlclose()
 * would leak (64 KiB per 1024 maps and pools open at once), and no call may
 * be running or follow when it is unloaded.
 */
#ifndef STEPQ_PLUGIN_H
#define STEPQ_PLUGIN_H

#include <stdint.h>

#include "stepq/common.h"
#include "stepq/map.h"
#include "stepq/pool.h"
#include "stepq/step.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The newest plugin table version this header declares. */
#define STEPQ_PLUGIN_VERSION 1
/** The one symbol a plugin host resolves (dlsym). */
#define STEPQ_PLUGIN_SYMBOL "stepq_plugin_get"

/* --- the logger ----------------------------------------------------------- */

/** Message levels (syslog's order: lower is more severe). */
typedef enum stepq_log_level {
    STEPQ_LOG_ERROR = 3, /**< a call failed: the text stepq_last_error() then returns */
    STEPQ_LOG_WARN = 4,  /**< reserved: nothing is logged at this level yet */
    STEPQ_LOG_INFO = 6,  /**< reserved */
    STEPQ_LOG_DEBUG = 7, /**< reserved */
} stepq_log_level;

/**
 * A host's logger: called with the host's user pointer, a stepq_log_level
 * and a NUL-terminated message valid only during the call.
 */
typedef void (*stepq_log_fn)(void *user, int level, const char *msg);

/**
 * Sets the process-wide logger (fn NULL: none, the default). The library
 * never prints: what it reports goes to this callback.
 *
 * What is logged: every failing call logs one message at STEPQ_LOG_ERROR,
 * the detail text stepq_last_error() returns after it (a failure that
 * passes through several layers, e.g. an argument check inside a decode
 * step, is logged once, with its final text). stepq_plugin_get() for an
 * unknown version is such a failure. Successful calls log nothing.
 *
 * Threads: the callback runs on the thread whose call failed, so it may run
 * on several threads at once and must be thread-safe itself. It is never
 * called with a pool's or the library's lock held, so it may call stepq
 * (stepq_pool_last_error(), say); stepq calls that fail inside the
 * callback are not logged (no recursion).
 * stepq_set_logger() may be called from any thread at any time; when it
 * returns, no thread is still inside the previous callback and none will
 * enter it again, so its user data may be freed. It must not be called from
 * inside the callback: it then returns STEPQ_EBUSY and changes nothing.
 *
 * @return STEPQ_OK, or STEPQ_EBUSY (called from the callback).
 */
STEPQ_API int stepq_set_logger(stepq_log_fn fn, void *user);

/* --- the plugin table ----------------------------------------------------- */

/**
 * Version 1 of the plugin table. Each member points at the public function
 * of the same name without the `stepq_` prefix (version_number: the header
 * has a `version`, so stepq_version() is named so here); its documentation
 * is that function's, in stepq/map.h, pool.h, step.h, common.h and above.
 * Frozen: see the ABI rules above.
 */
struct stepq_plugin_v1 {
    uint32_t size;    /**< sizeof(struct stepq_plugin_v1) */
    uint32_t version; /**< 1 */
    const char *name; /**< "stepq" */

    /* The library, status codes, errors and the logger. */
    unsigned (*version_number)(void); /**< stepq_version() */
    const char *(*version_string)(void);
    const char *(*status_name)(int status);
    const char *(*strerror)(int status);
    const char *(*last_error)(void);
    int (*set_logger)(stepq_log_fn fn, void *user);

    /* Precision maps. */
    int (*map_load_file)(const char *path, const stepq_map_load_config *cfg, stepq_map_t **out);
    int (*map_load_buffer)(const char *buf, size_t len, const stepq_map_load_config *cfg,
                           stepq_map_t **out);
    void (*map_close)(stepq_map_t *map);
    int (*map_shape)(const stepq_map_t *map, stepq_model_shape *shape);
    double (*map_budget_bits)(const stepq_map_t *map);
    int (*map_unit_stats)(const stepq_map_t *map, int layer, int unit, stepq_unit_stats *stats);
    int (*map_fingerprint)(const stepq_map_t *map, uint64_t *out);
    const char *(*map_last_error)(const stepq_map_t *map);

    /* Pools: open, slots, page movement, accounting. */
    int (*pool_plan)(const stepq_pool_config *cfg, stepq_pool_plan_info *out);
    int (*pool_open)(const stepq_pool_config *cfg, stepq_pool_t **out);
    int (*pool_close)(stepq_pool_t *pool, unsigned flags);
    int (*pool_alloc)(stepq_pool_t *pool, int32_t n, int32_t *ids);
    int (*pool_free)(stepq_pool_t *pool, const int32_t *ids, int32_t n);
    int (*pool_clear)(stepq_pool_t *pool, const int32_t *ids, int32_t n);
    int (*pool_copy)(stepq_pool_t *pool, const int32_t *src, const int32_t *dst, int32_t n);
    int (*pool_copy_to_host)(stepq_pool_t *pool, const int32_t *ids, int32_t n, void *host,
                             size_t host_bytes);
    int (*pool_copy_from_host)(stepq_pool_t *pool, const int32_t *ids, int32_t n, const void *host,
                               size_t host_bytes);
    int (*pool_sync)(stepq_pool_t *pool);
    int (*pool_buffer_infos)(stepq_pool_t *pool, stepq_pool_buffer_info *out, int cap, int *count);
    int (*pool_health_words)(stepq_pool_t *pool, uint32_t **words);
    int (*pool_health_read)(stepq_pool_t *pool, const int32_t *ids, int32_t n, uint32_t *out);
    int (*pool_get_stats)(stepq_pool_t *pool, stepq_pool_stats *out, size_t stats_size);
    int (*pool_get_layout)(stepq_pool_t *pool, const stepq_pool_layout **out);
    int (*pool_is_allocated)(stepq_pool_t *pool, int32_t slot);
    const char *(*pool_last_error)(const stepq_pool_t *pool);

    /* The data path. */
    int (*pool_supports)(stepq_pool_t *pool, stepq_op op, int layer, const void *args);
    int (*pool_decode_step)(stepq_pool_t *pool, int layer, const stepq_step_args *args,
                            void *stream);
    int (*pool_prefill_pack)(stepq_pool_t *pool, int layer, const stepq_prefill_args *args,
                             void *stream);
    int (*pool_prefill_unpack)(stepq_pool_t *pool, int layer, const stepq_prefill_args *args,
                               void *stream);
    int (*pool_conv_state)(stepq_pool_t *pool, int layer, stepq_conv_view *out, size_t view_size);
};

/** Version 1 of the table, by its typedef. */
typedef struct stepq_plugin_v1 stepq_plugin_v1;

/** The type of stepq_plugin_get, for the pointer dlsym() returns. */
typedef const void *(*stepq_plugin_get_fn)(uint32_t version);

/**
 * Returns the table of ABI version `version` (a const struct
 * stepq_plugin_vN, which begins with uint32_t size, uint32_t version and
 * const char *name), or NULL for a version this library does not provide
 * (0, or newer than it): stepq_last_error() then names the versions it
 * provides, and the logger gets that text. Thread-safe; the table is
 * static and never changes.
 */
STEPQ_API const void *stepq_plugin_get(uint32_t version);

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_PLUGIN_H */
