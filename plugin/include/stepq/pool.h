/*
 * The recurrent-state pool: slot lifecycle, packed pages and memory
 * accounting.
 *
 * A pool is one allocation of `slots + 1` pages. A page holds everything one
 * request keeps between steps on this tensor-parallel rank: for every
 * recurrent layer and every local value head, the head's packed block
 * (codes, fp16 scales, fp16 pivots, per the precision map), then the conv
 * state of each layer in its native dtype. Slot 0 is the sentinel page (the
 * dummy write target of CUDA-graph padding): it is never handed out and never
 * accepted by free/clear/copy. A slot id of STEPQ_POOL_SLOT_PAD (-1) in any
 * id list is padding and is skipped.
 *
 * Errors: every failing call leaves the pool exactly as it was (the whole id
 * list is validated before anything changes; CUDA failures after that: see
 * below), returns a negative stepq_status and sets stepq_pool_last_error()
 * and stepq_last_error().
 *
 * Thread safety: every function taking a pool may be called from several
 * threads at once; each call is atomic with respect to the others (one mutex
 * per pool, no lock shared between pools). Data operations of the CUDA
 * backend are enqueued on the pool's stream in the order the calls took the
 * mutex. A call racing stepq_pool_close() either runs before the close or
 * returns STEPQ_EBADF.
 *
 * Handles: a stepq_pool_t * is an opaque handle, not the pool's address.
 * It carries a generation, so once its pool is closed it is STEPQ_EBADF
 * forever, even when a later pool reuses the memory or the table entry.
 *
 * A CUDA failure (STEPQ_ECUDA) in clear, copy, a host copy or alloc, after
 * the checks passed: each is several launches or transfers on the stream
 * (clear, and the health reset of alloc and of copy-in: one kernel per 960
 * ids; copy: one per 480 pairs; host copies: one cudaMemcpyAsync per run of
 * consecutive slots at consecutive places), and the call returns at the
 * first one that fails: the ones before it are enqueued and run, it and the
 * ones after it do not. Which slots were done is not reported, so:
 *   - clear: each slot listed is cleared or unchanged;
 *   - copy: each destination holds its source's page and health word, or is
 *     unchanged; sources are only read;
 *   - copy_to_host: no slot changes; the host pages are undefined;
 *   - copy_from_host: the pages listed are undefined; their health words
 *     are reset only when every transfer was enqueued, and then only as far
 *     as the reset's own launches got (the others keep the words of the
 *     pages they replaced);
 *   - alloc: nothing is allocated (ids are all -1); free slots it would have
 *     handed out may have zeroed health words (and pages, with
 *     STEPQ_POOL_FLAG_CLEAR_ON_ALLOC), which the next alloc resets anyway.
 * Clear, copy or reload the slots listed again. Slots are never freed or
 * allocated by a failure, and no slot outside the lists (or, for alloc, the
 * free slots) is touched. A fault while enqueued work runs (an illegal
 * address in a kernel) is reported by a later call on the stream, typically
 * stepq_pool_sync(), and names no operation.
 *
 * Stream semantics (CUDA backend): alloc/free are host bookkeeping and take
 * effect at once; clear, copy, host copies and the health-word reset of
 * alloc are enqueued on the configured stream and are ordered with the
 * server's kernels on that stream (stepq_pool_copy_masked() on the stream it
 * is given). A slot freed while the stream still has
 * work reading it may be reallocated at once: its next user's clear/copy is
 * enqueued behind that work, so this is safe for work on the pool's stream.
 * Host backend: every operation completes before the call returns.
 */
#ifndef STEPQ_POOL_H
#define STEPQ_POOL_H

#include "stepq/common.h"
#include "stepq/map.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Opaque pool handle. */
typedef struct stepq_pool stepq_pool_t;

/** The sentinel slot: page 0, never handed out. */
#define STEPQ_POOL_SLOT_SENTINEL 0
/** Padding id in a slot list: skipped by every operation. */
#define STEPQ_POOL_SLOT_PAD (-1)

/** Where the pages live. */
typedef enum stepq_pool_backend {
    STEPQ_POOL_BACKEND_HOST = 0, /**< malloc'ed host memory; operations are synchronous */
    STEPQ_POOL_BACKEND_CUDA = 1, /**< one cudaMalloc; operations are stream-ordered */
} stepq_pool_backend;

/**
 * Slot reservation per running request (SGLang's mamba scheduler
 * strategies). The pool is sized as policy_slots x max_running_requests
 * usable slots plus the sentinel.
 */
typedef enum stepq_pool_policy {
    STEPQ_POOL_POLICY_NO_CACHE = 0,     /**< 1: no radix cache, the working slot only */
    STEPQ_POOL_POLICY_NO_BUFFER = 1,    /**< 3: radix cache without tracking buffers */
    STEPQ_POOL_POLICY_LAZY = 2,         /**< 4: radix cache, one lazily taken track slot */
    STEPQ_POOL_POLICY_EXTRA_BUFFER = 3, /**< 5: radix cache + 2 ping-pong track slots (overlap) */
    STEPQ_POOL_POLICY_COUNT
} stepq_pool_policy;

/** Slots reserved per running request under a policy (1, 3, 4, 5); STEPQ_EINVAL if unknown. */
STEPQ_API int stepq_pool_policy_slots(stepq_pool_policy policy);
/** Name of a policy ("extra_buffer"); "?" for unknown values. */
STEPQ_API const char *stepq_pool_policy_name(stepq_pool_policy policy);
/** Parses a policy name (no_cache, no_buffer, lazy, extra_buffer); STEPQ_EINVAL if unknown. */
STEPQ_API int stepq_pool_policy_from_name(const char *name, stepq_pool_policy *out);

/** stepq_pool_config.flags: zero a page (and its health word) whenever it is allocated. */
#define STEPQ_POOL_FLAG_CLEAR_ON_ALLOC (1u << 0)

/**
 * Pool configuration. Initialise with STEPQ_POOL_CONFIG_INITIALIZER, then set
 * the map and exactly one sizing field (num_slots, max_running_requests or
 * memory_budget_bytes).
 */
typedef struct stepq_pool_config {
    size_t size;
    unsigned magic;
    unsigned version;
    const stepq_map_t *map;     /**< required; read during open only (the layout is copied) */
    stepq_pool_backend backend; /**< host (default) or cuda */
    int device;                 /**< CUDA device ordinal (cuda backend) */
    void *stream;               /**< cudaStream_t for every data operation; NULL = default stream */
    int tp_rank;                /**< this rank, 0 .. tp_size - 1 */
    int tp_size;                /**< tensor-parallel degree; 0 or 1 = no split */
    /**
     * Minimum page size in bytes (0 = none). The TP layer passes the largest
     * page of all ranks (stepq_tp_plan(), stepq/tp.h) so every rank's pool has
     * the same page count for a budget and slot ids agree; the page is then
     * padded up to it.
     */
    uint64_t min_page_bytes;
    uint64_t page_align;          /**< page stride alignment, a power of two >= 16 (0 = 256) */
    uint32_t block_align;         /**< head-block alignment, a power of two (0 = 16) */
    stepq_pool_policy policy;     /**< reservation policy (default extra_buffer) */
    int32_t num_slots;            /**< sizing: explicit usable slot count */
    int32_t max_running_requests; /**< sizing: policy slots x this many requests */
    uint64_t memory_budget_bytes; /**< sizing: as many pages as fit, (slots + 1) x page <= this */
    unsigned flags;               /**< STEPQ_POOL_FLAG_* */
} stepq_pool_config;

#define STEPQ_POOL_CONFIG_VERSION 1
/* One field per line, by name (kept out of clang-format). */
/* clang-format off */
#define STEPQ_POOL_CONFIG_INITIALIZER             \
    {                                             \
        .size = sizeof(stepq_pool_config),        \
        .magic = STEPQ_CONFIG_MAGIC,              \
        .version = STEPQ_POOL_CONFIG_VERSION,     \
        .map = NULL,                              \
        .backend = STEPQ_POOL_BACKEND_HOST,       \
        .device = 0,                              \
        .stream = NULL,                           \
        .tp_rank = 0,                             \
        .tp_size = 1,                             \
        .min_page_bytes = 0,                      \
        .page_align = 0,                          \
        .block_align = 0,                         \
        .policy = STEPQ_POOL_POLICY_EXTRA_BUFFER, \
        .num_slots = 0,                           \
        .max_running_requests = 0,                \
        .memory_budget_bytes = 0,                 \
        .flags = 0,                               \
    }
/* clang-format on */

/**
 * What a configuration would allocate, computed without allocating
 * (stepq_pool_plan()). Byte counts are exact: page_bytes =
 * state_bytes + conv_bytes + pad_bytes, and
 * state_bytes = state_bytes_compact + align_bytes.
 */
typedef struct stepq_pool_plan_info {
    uint64_t page_bytes;          /**< bytes per slot (the page stride) */
    uint64_t state_bytes;         /**< packed head blocks as allocated (with block alignment) */
    uint64_t state_bytes_compact; /**< packed head blocks without any alignment */
    uint64_t align_bytes;         /**< state_bytes - state_bytes_compact */
    uint64_t conv_bytes;          /**< conv state of this rank, all layers */
    uint64_t pad_bytes;           /**< page tail padding (page_align, min_page_bytes) */
    int32_t slots;                /**< usable slots (the sentinel excluded) */
    uint64_t pool_bytes;          /**< (slots + 1) x page_bytes: the one page allocation */
    uint64_t meta_bytes; /**< health words (backend memory) + layout tables (host), apart from the
                            pages */
} stepq_pool_plan_info;

/**
 * Computes the page layout and the slot count of a configuration without
 * allocating anything: the TP layer uses it to agree on min_page_bytes, the
 * capacity planner to size deployments. Same validation as stepq_pool_open().
 */
STEPQ_API int stepq_pool_plan(const stepq_pool_config *cfg, stepq_pool_plan_info *out);

/**
 * Opens a pool. On success *out owns it (release with stepq_pool_close()).
 * Errors: STEPQ_EVERSION (config header), STEPQ_EINVAL (no map, bad sizing,
 * bad tp split, alignment not a power of two), STEPQ_ESHAPE (heads or conv
 * channels not divisible by tp_size), STEPQ_ENOSPC (budget holds no usable
 * slot), STEPQ_ENOMEM, STEPQ_ENOTSUP (CUDA backend in a build without
 * CUDA), STEPQ_ENODEV, STEPQ_ECUDA. All pages start zeroed.
 */
STEPQ_API int stepq_pool_open(const stepq_pool_config *cfg, stepq_pool_t **out);

/** stepq_pool_close() flags: release even with slots in use. */
#define STEPQ_POOL_CLOSE_FORCE (1u << 0)

/**
 * Closes a pool and frees its memory (after waiting for its stream). With
 * slots still allocated it returns STEPQ_EBUSY and leaves the pool open,
 * unless STEPQ_POOL_CLOSE_FORCE is given. NULL is a no-op. After a
 * successful close the handle is invalid for good: every call with it
 * returns STEPQ_EBADF (see "Handles" above). When work queued on the pool's
 * stream failed, or its device could not be made current, close still
 * frees everything and then returns that STEPQ_ECUDA / STEPQ_ENODEV (the
 * handle is closed all the same).
 */
STEPQ_API int stepq_pool_close(stepq_pool_t *pool, unsigned flags);

/**
 * Allocates n slots, all or nothing: on success ids[0..n-1] hold n distinct
 * slot ids in 1..slots, their health words are reset to 0 (and their pages
 * zeroed with STEPQ_POOL_FLAG_CLEAR_ON_ALLOC). STEPQ_ENOSPC when fewer than n
 * slots are free (nothing is allocated). n = 0 succeeds and does nothing.
 * Slots are handed out first-freed first-reused.
 */
STEPQ_API int stepq_pool_alloc(stepq_pool_t *pool, int32_t n, int32_t *ids);

/**
 * Frees the slots in ids[0..n-1] (-1 entries skipped). Errors, with nothing
 * freed: STEPQ_EINVAL (slot 0), STEPQ_ERANGE (id out of range),
 * STEPQ_EDOUBLEFREE (a slot that is not allocated, or listed twice).
 */
STEPQ_API int stepq_pool_free(stepq_pool_t *pool, const int32_t *ids, int32_t n);

/**
 * Zeroes the pages and health words of allocated slots (-1 skipped). Same id
 * errors as free; a slot that is not allocated is STEPQ_EINVAL.
 */
STEPQ_API int stepq_pool_clear(stepq_pool_t *pool, const int32_t *ids, int32_t n);

/**
 * Copies whole packed pages src[i] -> dst[i] for i < n (radix copy-on-write,
 * ping-pong tracking): packed bytes and conv state, as stored. A pair with a
 * -1 on either side is skipped. All slots must be allocated; a source may
 * appear several times, a destination once, and no slot may be both a source
 * and a destination (STEPQ_EINVAL: the copies would depend on their order).
 * The destination health words take the sources' values.
 */
STEPQ_API int stepq_pool_copy(stepq_pool_t *pool, const int32_t *src, const int32_t *dst,
                              int32_t n);

/** Largest n stepq_pool_copy_masked() accepts (the entries of one launch). */
#define STEPQ_POOL_COPY_MASKED_MAX 65536

/**
 * Copies whole pages src[i] -> dst[i] for the entries i < n with
 * mask[i] != 0, with the lists read on the device: the graph-capturable
 * form of stepq_pool_copy() for a decode step's conditional copies
 * (SGLang's extra-buffer track, track_mamba_states_if_needed). What moves
 * is what stepq_pool_copy() moves: the whole page as stored (packed blocks,
 * conv state, padding) and the health word (the destination takes the
 * source's).
 *
 * src, dst and mask are n int32 each in the backend's memory (device memory
 * on the CUDA backend, host memory on the host backend); mask may be NULL
 * (every entry). stream is a cudaStream_t of the pool's device (NULL = the
 * pool's stream); the host backend ignores it (as its decode step does) and
 * copies before it returns. CUDA backend: one kernel launch (none for n = 0) on stream; no
 * host synchronisation, no allocation, and no host read of src, dst or mask,
 * so the call can be captured into a CUDA graph and the graph replayed with
 * new contents in the same buffers (each replay reads them when it runs).
 * A stream of another device is STEPQ_EINVAL outside a capture, a failed
 * launch inside one (as for stepq_pool_decode_step()).
 *
 * The ids cannot be checked when the call is made (on the CUDA backend they
 * are read only when the kernel runs), so each entry is checked where it is
 * read, by these rules, and no entry is an error:
 *   - masked off (mask[i] == 0): skipped; mask is read first, so src[i] and
 *     dst[i] of such an entry are not read and may hold anything;
 *   - src[i] or dst[i] outside 1..slots (the sentinel 0, padding -1, any
 *     other value): skipped;
 *   - src[i] == dst[i]: skipped (the page is left as it is);
 *   - otherwise dst[i] gets src[i]'s page and health word.
 * Unlike stepq_pool_copy(), the allocator's view is not checked: which slots
 * are allocated is host state at the time of the call, while the ids are
 * read later, at each run or replay, and reading them on the host would
 * need a synchronisation. Ids of slots that are not allocated are the
 * caller's responsibility: such a copy overwrites the page (a free slot's
 * page and health word are reset when it is next allocated, so the
 * allocator itself is not harmed; an allocated slot of another request is).
 * Entries run concurrently and in no order, so these are caller bugs with
 * unspecified results: a slot that is the destination of two active entries
 * (its page may end up mixing both sources' bytes, its health word either
 * source's), and a slot that is the destination of one active entry and
 * the source of another (the other reads old, new or mixed bytes). A source
 * may appear in several active entries.
 *
 * Errors (nothing is enqueued or changed): STEPQ_EINVAL for n < 0,
 * n > STEPQ_POOL_COPY_MASKED_MAX, src or dst NULL with n > 0, or a stream
 * the pool's device does not own (CUDA backend); STEPQ_ECUDA
 * when the launch fails; STEPQ_EBADF for a closed handle. A fault while the
 * kernel runs (lists that are not n int32 of device memory) is reported by a
 * later call on the stream, as for every kernel. Thread safety: as every
 * pool call (the pool's mutex is held while the launch is enqueued).
 */
STEPQ_API int stepq_pool_copy_masked(stepq_pool_t *pool, const int32_t *src, const int32_t *dst,
                                     const int32_t *mask, int32_t n, void *stream);

/**
 * Copies the pages of ids[0..n-1] to host memory (offload): page i goes to
 * host + i * page_bytes; -1 entries leave their place untouched. host_bytes
 * must be at least n * page_bytes. CUDA backend: enqueued on the stream; the
 * host buffer is complete after stepq_pool_sync() (pinned memory makes the
 * copy asynchronous).
 */
STEPQ_API int stepq_pool_copy_to_host(stepq_pool_t *pool, const int32_t *ids, int32_t n, void *host,
                                      size_t host_bytes);

/**
 * Copies pages from host memory into allocated slots (reload): page i from
 * host + i * page_bytes into ids[i]; -1 entries skipped; an id listed twice
 * is STEPQ_EINVAL. Health words are reset. CUDA backend: enqueued on the
 * stream; the host buffer must stay unchanged until stepq_pool_sync().
 */
STEPQ_API int stepq_pool_copy_from_host(stepq_pool_t *pool, const int32_t *ids, int32_t n,
                                        const void *host, size_t host_bytes);

/** Waits until every operation enqueued on the pool's stream has completed (host: no-op). */
STEPQ_API int stepq_pool_sync(stepq_pool_t *pool);

/**
 * One contiguous tensor of the pool, for prefill/decode disaggregation
 * transfers (SGLang's get_contiguous_buf_infos): item i lives at
 * ptr + i * item_bytes.
 */
typedef struct stepq_pool_buffer_info {
    void *ptr;           /**< base address (device memory for the CUDA backend) */
    uint64_t bytes;      /**< length of the whole buffer */
    uint64_t item_bytes; /**< length of one slot's item */
    const char *name;    /**< "pages" or "health" */
} stepq_pool_buffer_info;

/**
 * Lists the pool's contiguous buffers: "pages" ((slots + 1) pages) and
 * "health" ((slots + 1) uint32 words). Writes at most cap entries and sets
 * *count to the number that exist (2); STEPQ_ERANGE when cap is too small.
 */
STEPQ_API int stepq_pool_buffer_infos(stepq_pool_t *pool, stepq_pool_buffer_info *out, int cap,
                                      int *count);

/**
 * Health-word bits the kernels OR into a slot's word (the word is reset on
 * alloc, clear and copy-in; a copy carries the source's word along).
 */
#define STEPQ_HEALTH_INPUT     0x1u /**< non-finite inputs: the head was left unchanged */
#define STEPQ_HEALTH_STATE     0x2u /**< non-finite state elements were replaced by 0 */
#define STEPQ_HEALTH_SATURATED 0x4u /**< a value or scale exceeded the fp16 range, clamped */
#define STEPQ_HEALTH_OUTPUT    0x8u /**< a readout overflowed and was written as 0 */

/**
 * The per-slot health words: (slots + 1) uint32 values indexed by slot id,
 * in the backend's memory (device memory for CUDA), for kernels to write.
 * Valid while the pool is open.
 */
STEPQ_API int stepq_pool_health_words(stepq_pool_t *pool, uint32_t **words);

/** Reads the health words of ids[0..n-1] into out (0 for -1 entries); synchronizes the stream. */
STEPQ_API int stepq_pool_health_read(stepq_pool_t *pool, const int32_t *ids, int32_t n,
                                     uint32_t *out);

/** Pool counters. */
typedef struct stepq_pool_stats {
    int32_t capacity;      /**< usable slots (the sentinel excluded) */
    int32_t in_use;        /**< allocated slots */
    int32_t available;     /**< capacity - in_use */
    int32_t high_water;    /**< largest in_use since open */
    uint64_t n_alloc;      /**< slots handed out since open */
    uint64_t n_free;       /**< slots returned since open */
    uint64_t page_bytes;   /**< bytes per slot */
    uint64_t pool_bytes;   /**< (capacity + 1) x page_bytes */
    uint64_t in_use_bytes; /**< in_use x page_bytes */
    uint64_t meta_bytes;   /**< health words + layout tables (host) + CUDA kernel descriptors */
    uint64_t state_bytes;  /**< per page: packed blocks as allocated */
    uint64_t state_bytes_compact; /**< per page: packed blocks without alignment */
    uint64_t conv_bytes;          /**< per page: conv state */
    uint64_t pad_bytes;           /**< per page: tail padding */
    uint32_t health_any;          /**< OR of the health words of allocated slots */
    int32_t health_slots;         /**< allocated slots with a nonzero health word */
} stepq_pool_stats;

/**
 * Fills *out (stats_size = sizeof(stepq_pool_stats) as the caller compiled
 * it; fields past it are not written, so older callers keep working). Reads
 * the health words: synchronizes the stream on the CUDA backend.
 */
STEPQ_API int stepq_pool_get_stats(stepq_pool_t *pool, stepq_pool_stats *out, size_t stats_size);

/**
 * The page layout, for the server and its tools (host memory). The pool's
 * own kernels read one device description of it, the per-layer descriptors
 * the CUDA backend prepares at open. Block i = layer * n_local_heads + local
 * head. The byte layout inside a block is the kernels' head-block format
 * for the block's unit bits (kernels/format.h).
 */
typedef struct stepq_pool_layout {
    stepq_arch arch;
    stepq_method method;
    int n_layers;      /**< recurrent layers */
    int n_local_heads; /**< value heads on this rank */
    int first_head;    /**< global value head of local head 0 */
    int d_k, d_v;
    int units_per_head; /**< 1 (GDN) or d_k (KDA) */
    uint64_t page_bytes;
    uint64_t state_bytes;
    uint64_t state_bytes_compact;
    uint64_t conv_bytes; /**< all layers */
    uint64_t conv_bytes_per_layer;
    uint64_t pad_bytes;
    const uint64_t *block_offset;  /**< [n_blocks] byte offset of each head block in a page */
    const uint32_t *block_bytes;   /**< [n_blocks] allocated bytes of each head block */
    const uint32_t *block_compact; /**< [n_blocks] compact bytes of each head block */
    const uint8_t *unit_bits;      /**< [n_blocks * units_per_head] unit bits (map values) */
    const uint64_t *conv_offset;   /**< [n_layers] byte offset of each layer's conv state */
    int n_blocks;                  /**< n_layers * n_local_heads */
    uint64_t fingerprint;          /**< hash of the layout: equal on both ends of a transfer */
} stepq_pool_layout;

/** Points *out at the pool's layout (owned by the pool, valid while it is open). */
STEPQ_API int stepq_pool_get_layout(stepq_pool_t *pool, const stepq_pool_layout **out);

/**
 * Address of a slot's page (device memory for CUDA). Slot 0 (the sentinel)
 * is allowed here, for kernels' padding writes; STEPQ_ERANGE otherwise.
 */
STEPQ_API int stepq_pool_page(stepq_pool_t *pool, int32_t slot, void **ptr);

/** Whether a slot is allocated: 1 yes, 0 no, negative status for a bad id or handle. */
STEPQ_API int stepq_pool_is_allocated(stepq_pool_t *pool, int32_t slot);

/** Detail text of the last failure on this pool, or "" (a fixed text for a closed handle). */
STEPQ_API const char *stepq_pool_last_error(const stepq_pool_t *pool);

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_POOL_H */
