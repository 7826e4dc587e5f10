/*
 * Internals of the pool layer: the page layout, the pool object and the
 * backend function table (host memory, CUDA device memory).
 */
#ifndef STEPQ_POOL_INTERNAL_H
#define STEPQ_POOL_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "kernels/dsp.h"
#include "plugin/err.h"
#include "plugin/handle.h"
#include "stepq/pool.h"
#include "stepq/step.h"

/** Default alignment of a page stride: 256 B, cudaMalloc's own alignment. */
#define STEPQ__POOL_PAGE_ALIGN 256u
/** Default alignment of a head block: 16 B, one vectorised (uint4) load. */
#define STEPQ__POOL_BLOCK_ALIGN 16u

/**
 * A page layout and the tables behind its public view. Built from a map
 * (stepq__pool_layout_build) or, in tests, from block sizes directly
 * (stepq__pool_layout_synthetic). Owns its arrays.
 */
struct stepq__pool_layout {
    stepq_pool_layout pub;
    uint64_t *block_offset;
    uint32_t *block_bytes;
    uint32_t *block_compact;
    uint8_t *unit_bits;
    uint64_t *conv_offset;

    /*
     * What the kernels need, kept from the build (maps only; a synthetic
     * layout has none and runs no step): the head layout of every block,
     * block_offset as size_t (the kernels' head_offset of one layer is
     * head_off + layer * n_local_heads), and the row impact of every block
     * ([n_blocks][d_k]; NULL when the method does not use it).
     */
    struct stepq__head_layout *heads; /* [n_blocks] */
    size_t *head_off;                 /* [n_blocks] */
    float *row_impact;                /* [n_blocks * d_k] or NULL */
    int n_k_heads;                    /* q/k heads on this rank */
    int conv_rank;
    int64_t conv_shape[STEPQ_CONV_MAX_RANK]; /* this rank's: the channels / tp (pool/conv.h) */
    stepq_dtype conv_dtype;
};

/**
 * Builds the layout of cfg's map for cfg's rank, alignments and minimum page
 * size. Errors go to err (may be NULL) and the thread-local error.
 */
int stepq__pool_layout_build(const stepq_pool_config *cfg, struct stepq__pool_layout *out,
                             char *err);

/**
 * Builds a layout without a map: n_layers x n_heads blocks of the given
 * compact sizes (block_compact[layer * n_heads + head]), each rounded up to
 * block_align, then n_layers conv states of conv_bytes_per_layer, the page
 * rounded up to page_align and min_page_bytes. For tests of the allocator.
 */
int stepq__pool_layout_synthetic(int n_layers, int n_heads, const uint32_t *block_compact,
                                 uint64_t conv_bytes_per_layer, uint32_t block_align,
                                 uint64_t page_align, uint64_t min_page_bytes,
                                 struct stepq__pool_layout *out);

/** Frees a layout's tables (the struct itself is the caller's). */
void stepq__pool_layout_free(struct stepq__pool_layout *layout);

/** FNV-1a over the layout tables: the layout's fingerprint. */
uint64_t stepq__pool_layout_fingerprint(const stepq_pool_layout *l);

/**
 * Slot count from the sizing fields of cfg for a page of page_bytes, or a
 * negative status (message in err).
 */
int stepq__pool_sizing(const stepq_pool_config *cfg, uint64_t page_bytes, int32_t *slots,
                       char *err);

struct stepq_pool;

/**
 * One backend. Every id list handed to a backend has been validated and has
 * its -1 entries removed. Functions return STEPQ_OK or a negative status
 * with the message already recorded in pool->err.
 */
struct stepq__pool_ops {
    const char *name;
    /** Allocates pages (zeroed), health words (zeroed) and device tables. */
    int (*init)(struct stepq_pool *pool);
    /**
     * Releases what init allocated, after waiting for outstanding work; frees
     * everything even when something fails, and returns the first failure.
     */
    int (*fini)(struct stepq_pool *pool);
    /** Zeroes the health words of ids and, when pages is nonzero, their pages. */
    int (*clear)(struct stepq_pool *pool, const int32_t *ids, int32_t n, int pages);
    /** Copies pages and health words src[i] -> dst[i] (lists disjoint). */
    int (*copy)(struct stepq_pool *pool, const int32_t *src, const int32_t *dst, int32_t n);
    /**
     * stepq_pool_copy_masked(): src, dst and mask (may be NULL) are the
     * caller's lists in the backend's memory, not validated (the backend
     * skips the entries the public header names); n > 0; stream is the
     * caller's (NULL = the pool's; always NULL on the host backend).
     */
    int (*copy_masked)(struct stepq_pool *pool, const int32_t *src, const int32_t *dst,
                       const int32_t *mask, int32_t n, void *stream);
    /** Copies page ids[i] to host + pos[i] * page_bytes. */
    int (*to_host)(struct stepq_pool *pool, const int32_t *ids, const int32_t *pos, int32_t n,
                   void *host);
    /** Copies host + pos[i] * page_bytes into page ids[i] and resets their health words. */
    int (*from_host)(struct stepq_pool *pool, const int32_t *ids, const int32_t *pos, int32_t n,
                     const void *host);
    /** Reads all slots + 1 health words into out (host memory). */
    int (*read_health)(struct stepq_pool *pool, uint32_t *out);
    /** Waits for outstanding work. */
    int (*sync)(struct stepq_pool *pool);

    /*
     * The data path (pool/step.c validated the call; slot lists on the host
     * backend are checked, on CUDA they are device memory). Every tensor is
     * in the backend's memory. Each returns STEPQ_OK or a status with the
     * message in pool->err.
     */
    /** One decode step of layer `layer`; a->slots, a->health are filled in. */
    int (*decode)(struct stepq_pool *pool, int layer, const struct stepq__step_args *a);
    /** Packs (pack = 1) or unpacks (0) the dense states of `p` for layer `layer`. */
    int (*transfer)(struct stepq_pool *pool, int layer, int pack, const stepq_prefill_args *p,
                    void *stream);
    /**
     * Whether the backend runs this step / transfer (after the generic
     * checks): STEPQ_OK or STEPQ_ENOTSUP with the reason in pool->err.
     */
    int (*supports)(struct stepq_pool *pool, stepq_op op, int layer, const void *args);
};

extern const struct stepq__pool_ops stepq__pool_host_ops;
/** The CUDA backend; in a build without CUDA its init returns STEPQ_ENOTSUP. */
extern const struct stepq__pool_ops stepq__pool_cuda_ops;

/** Slot states in stepq_pool.state. */
enum {
    STEPQ__SLOT_FREE = 0,
    STEPQ__SLOT_USED = 1,
    STEPQ__SLOT_SENTINEL = 2,
};

struct stepq_pool {
    struct stepq__handle_entry *entry; /* its handle-table entry: the lock lives there */
    char err[STEPQ__ERRLEN];

    stepq_pool_backend backend;
    const struct stepq__pool_ops *ops;
    unsigned flags;
    stepq_pool_policy policy;
    int device;
    void *stream;

    struct stepq__pool_layout layout;
    uint64_t page_bytes;
    int32_t slots; /* usable slots; pages = slots + 1 */

    /* Free slots as a FIFO ring (SGLang hands out the oldest freed slot first,
     * which also keeps a just-freed slot out of reuse for as long as possible). */
    int32_t *ring;
    int32_t ring_head;
    int32_t ring_count;
    uint8_t *state;   /* [slots + 1] STEPQ__SLOT_* */
    uint8_t *mark;    /* [slots + 1] scratch for duplicate checks, all 0 between calls */
    int32_t *scratch; /* [4 * (slots + 1)] compacted id lists for the backends */

    int32_t in_use;
    int32_t high_water;
    uint64_t n_alloc;
    uint64_t n_free;

    uint8_t *pages;   /* backend memory: (slots + 1) * page_bytes */
    uint32_t *health; /* backend memory: slots + 1 words */
    void *backend_data;
};

/**
 * Layer `layer` as the kernels see it: the pool's pages and the head layouts,
 * offsets and row impact of that layer's blocks.
 */
void stepq__pool_packed_layer(const struct stepq_pool *pool, int layer,
                              struct stepq__packed_layer *out);

/**
 * A public decode-step description as the kernels' (stepq__step_args), for
 * a layer of H q/k and HV value heads of d_k x d_v and n_slots pages; health
 * is left NULL. The pool's step uses it, and so do the kernel checks and the
 * bench when they call an internal entry the pool does not reach.
 */
void stepq__step_args_to_kernel(stepq_arch arch, int H, int HV, int d_k, int d_v, int n_slots,
                                const stepq_step_args *p, void *stream, struct stepq__step_args *a);

/**
 * Opens a pool on an explicit layout (ownership of the layout's tables moves
 * to the pool, also on failure). cfg supplies backend, sizing, policy and
 * flags; its map is not used.
 */
int stepq__pool_open_layout(const stepq_pool_config *cfg, struct stepq__pool_layout *layout,
                            stepq_pool_t **out);

/**
 * Looks a handle up in the table of open pools and takes its pool's mutex:
 * *pool gets the pool, or STEPQ_EBADF (message names fn) when the handle is
 * not open. Every public entry that takes a pool starts with it and ends
 * with stepq__pool_leave(pool). Handles are not pointers to the pool
 * (pool/pool.c says why): never dereference one.
 */
int stepq__pool_enter(stepq_pool_t *h, const char *fn, stepq_pool_t **pool);
void stepq__pool_leave(stepq_pool_t *pool);

/**
 * The pool a handle names (for tests that call internal functions on an
 * open pool), or NULL when the handle is not open. Takes no lock beyond the
 * lookup: only for single-threaded use.
 */
stepq_pool_t *stepq__pool_resolve(stepq_pool_t *h);

/**
 * Internal consistency check of the allocator (ring, states, counters):
 * STEPQ_OK or STEPQ_EINTERNAL naming the first broken invariant. For tests
 * and the lifecycle simulation.
 */
int stepq__pool_check(stepq_pool_t *pool);

#endif /* STEPQ_POOL_INTERNAL_H */
