/*
 * The shared fixture of the kernel checks (tests/checkasm) and of `stepq bench
 * kernels` (tools/bench_kernels.c): precision maps built in memory with the map
 * builder, pools opened from them through the public API with every slot
 * allocated, a host pool (the C reference) and a CUDA pool holding the same
 * packed start, tensors with guard bytes, the inputs of a decode step, and the
 * kernels' view of a pool's layer for the internal entries that the pool does
 * not reach (the dense step, the two-stage variant, the column-kernel
 * handles): the comparison kernel is then chosen by an explicit argument.
 *
 * Every function returns STEPQ_OK or a negative stepq_status with
 * stepq_last_error() naming what failed. Built only with CUDA.
 */
#ifndef STEPQ_TESTS_CHECKASM_FIXTURE_H
#define STEPQ_TESTS_CHECKASM_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/dsp.h"
#include "stepq/stepq.h"

/** Head size of every check and bench row: the only one the CUDA kernels run. */
#define FX_D 128
/** Guard bytes, and every page byte that no call may write. */
#define FX_SENTINEL 0xA5
/** Guard bytes on each side of a tensor: 256 keeps the tensor cudaMalloc-aligned. */
#define FX_GUARD 256

/** xorshift64: the same numbers on every machine, seeded per check. */
struct fx_rng {
    uint64_t s;
};

uint32_t fx_rand(struct fx_rng *r);
/** Uniform in [0, 1). */
float fx_urand(struct fx_rng *r);
/** Standard normal (Box-Muller). */
float fx_nrand(struct fx_rng *r);

/**
 * A tensor with FX_GUARD guard bytes on both sides, in host or device memory,
 * and a host image (`shadow`) of what the whole allocation must hold: the
 * guards, and the tensor as last set. A check compares the allocation with it
 * after every call: the whole of an input (nothing may write it), the guards
 * of an output.
 */
struct fx_buf {
    void *p; /**< the tensor: alloc + FX_GUARD */
    size_t bytes;
    int device;
    uint8_t *alloc;  /**< guard | tensor | guard */
    uint8_t *shadow; /**< host image of alloc */
};

/** Allocates a tensor of `bytes` (0 allowed), every byte of it and its guards FX_SENTINEL. */
int fx_buf_alloc(struct fx_buf *b, size_t bytes, int device);
/** Sets the tensor to src (NULL: FX_SENTINEL bytes); the guards are rewritten too. */
int fx_buf_set(struct fx_buf *b, const void *src);
/** Copies the tensor out (device: a synchronous copy after the device is idle). */
int fx_buf_get(const struct fx_buf *b, void *dst);
/**
 * Compares the allocation with its image: the guards only (guards_only) or
 * all of it. *bad is -1 when they agree, else the offset of the first
 * differing byte from the allocation's start (< FX_GUARD: the guard before).
 */
int fx_buf_compare(const struct fx_buf *b, int guards_only, int64_t *bad);
void fx_buf_free(struct fx_buf *b);

/**
 * A precision map of n_layers layers for 128x128 heads, with a small bf16
 * conv state per layer, built with stepq_map_create, stepq_map_set_unit_bits
 * and stepq_map_set_row_impact.
 */
struct fx_map_spec {
    stepq_arch arch;
    stepq_method method;
    /**
     * One width (2..8) for every unit; 0 with a quantized method: mixed
     * widths, for GDN a width per head and a pivot last head, for KDA a
     * random width or pivot per key row (temporal / stepq only for a mix).
     */
    int bits;
    /** When set: units_per_layer widths (STEPQ_BITS_PIVOT allowed), the same in every layer. */
    const uint8_t *unit_bits;
    double budget; /**< budget_bits for stepq_map_create; 0: bits, 6 for a mix, the dtype's bits */
    int H, HV;
    int n_layers;
    /** Row impact drawn uniformly from [w_lo, w_hi], then divided by its geometric mean (1). */
    float w_lo, w_hi;
    /** The map field row_split (dual-axis methods); 0: the default 0.5. */
    double row_split;
    /** The map field decode_fit (dual-axis methods); 0: the default exact. */
    stepq_decode_fit decode_fit;
    /** The map field arith (dual-axis methods); 0: the default fp32. */
    stepq_arith arith;
};

/** Builds spec's map (*out owns it). rng draws the mixed widths and the row impact. */
int fx_map_create(const struct fx_map_spec *spec, struct fx_rng *rng, stepq_map_t **out);

/**
 * Opens a pool of `slots` usable slots on map and allocates every one of them
 * (ids 1..slots, checked), so that any slot id a check lists is allocated.
 */
int fx_pool_open(const stepq_map_t *map, stepq_pool_backend backend, int32_t slots, void *stream,
                 stepq_pool_t **out);

/** The kernels' description of `layer` of an open pool (its pages, head layouts and offsets). */
int fx_packed_layer(stepq_pool_t *pool, int layer, struct stepq__packed_layer *out);

/**
 * One decode step of `layer` of an open pool as the kernel entries take it:
 * what pool/step.c hands its backend for args (those checks are the pool's;
 * the entries check again), health words the pool's. For the entries the pool
 * does not reach.
 */
int fx_kernel_args(stepq_pool_t *pool, const stepq_step_args *args, void *stream,
                   struct stepq__step_args *out);

/** The same for a step of no pool (the dense step): the shape given, no health words. */
void fx_dense_kernel_args(stepq_arch arch, int H, int HV, int n_slots, const stepq_step_args *args,
                          void *stream, struct stepq__step_args *out);

/**
 * A host pool and a CUDA pool opened from one map, every slot allocated in
 * both. The checks use layer 1 of 3: layers 0 and 2 and the conv states are
 * guard bytes (FX_SENTINEL) in every page, before and after the tested
 * blocks.
 */
struct fx_pools {
    stepq_map_t *map;
    stepq_pool_t *host, *cuda;
    int layer; /**< the tested layer */
    stepq_arch arch;
    int H, HV;
    int32_t slots; /**< usable slots; pages = slots + 1 */
    uint64_t page_bytes;
    size_t pages_bytes;                  /**< (slots + 1) * page_bytes */
    uint8_t *hpages;                     /**< the host pool's pages (host memory) */
    uint8_t *dpages;                     /**< the CUDA pool's pages (device memory) */
    uint32_t *hhealth;                   /**< the host pool's health words */
    uint32_t *dhealth;                   /**< the CUDA pool's (device memory) */
    struct stepq__packed_layer hpl, dpl; /**< the tested layer of each pool */
};

/** Opens spec's map and both pools (spec->n_layers is taken as 3). */
int fx_pools_open(struct fx_pools *fx, const struct fx_map_spec *spec, int32_t slots,
                  struct fx_rng *rng);
void fx_pools_close(struct fx_pools *fx);
/** Every page byte FX_SENTINEL and every health word 0, in both pools. */
int fx_pools_blank(struct fx_pools *fx);
/**
 * The packed start: every page byte FX_SENTINEL, then the tested layer of
 * every page (the sentinel's too) packed by the host pool from random states
 * whose rows grow in magnitude (amp times 1..7), health words 0; the host
 * pool's pages then copied into the CUDA pool.
 */
int fx_pools_fill(struct fx_pools *fx, float amp, struct fx_rng *rng);
/** The host pool's pages and health words copied into the CUDA pool. */
int fx_pools_upload(struct fx_pools *fx);
/** The CUDA pool's pages and health words, after its work is done (either may be NULL). */
int fx_pools_download(struct fx_pools *fx, uint8_t *pages, uint32_t *health);

/** The fp32 inputs of a decode step, generated on the host. */
struct fx_inputs {
    stepq_arch arch;
    int batch, H, HV;
    int ng; /**< gate values per head: 1 (GDN) or FX_D (KDA) */
    int32_t *slots;
    float *q, *k, *v, *g, *beta, *A_log, *dt_bias;
};

int fx_inputs_alloc(struct fx_inputs *in, stepq_arch arch, int batch, int H, int HV);
/**
 * New inputs: slot ids a shuffle of 0..n_pages-1 (n_pages >= batch) with
 * every fourth entry padding (-1); q, k, v standard normal; with raw_gate the raw a and b of the
 * in-kernel gate (normal), else a log-space gate in (-0.5, 0] and beta in
 * [0, 1); A_log and dt_bias 0.3 x normal.
 */
int fx_inputs_gen(struct fx_inputs *in, int n_pages, int raw_gate, struct fx_rng *rng);
void fx_inputs_free(struct fx_inputs *in);

/**
 * The tensors of a step on one side (host or device memory), each an fx_buf:
 * fp32 and packed, or (view) bf16 as a server hands them: q, k and v views of
 * one fused projection row per request (q | k | v | 3 spare elements), g,
 * beta and o in padded rows, A_log and dt_bias bf16 too. Input gaps hold NaN
 * (a read of one would fail the head); o starts as FX_SENTINEL bytes.
 */
struct fx_step_io {
    int device, view;
    stepq_arch arch;
    int batch, H, HV;
    size_t q_stride, k_stride, v_stride, g_stride, beta_stride, o_stride; /**< elements; 0 packed */
    size_t n_o;                                                           /**< elements of o */
    struct fx_buf slots, q, k, v, g, beta, A_log, dt_bias, o,
        counts; /**< view: q is the qkv rows */
};

int fx_step_io_init(struct fx_step_io *io, const struct fx_inputs *in, int view, int device);
/** Writes in's inputs (and slot ids), o as FX_SENTINEL bytes and the 4 counters as 0. */
int fx_step_io_set(struct fx_step_io *io, const struct fx_inputs *in);
/** Public step arguments on io's tensors (dtypes, strides, counters), with `flags`. */
void fx_step_io_args(const struct fx_step_io *io, unsigned flags, stepq_step_args *a);
/**
 * After a call: every input unchanged, the guards of o and of the counters
 * intact. Returns 0, 1 (what names the tensor and the byte) or a status < 0.
 */
int fx_step_io_check(const struct fx_step_io *io, char *what, size_t what_len);
void fx_step_io_free(struct fx_step_io *io);

/* One pack or unpack configuration (fx_transfer_cases). */
struct fx_transfer {
    stepq_arch arch;
    stepq_method method;
    int bits; /* 0: mixed widths */
    int HV, n;
    stepq_state_layout layout;
    stepq_dtype dtype;
    int column;       /* the entry on a STEPQ__CUDA_COLUMN handle instead of the pool */
    int wild_ids;     /* the CUDA side's skipped entries are ids outside 0..slots instead of -1 */
    double row_split; /* the map's row_split (fx_map_spec); 0: 0.5 */
    int aligned;      /* bf16 [V,K]: a 16-byte stride (the vector path) instead of an odd one */
};

/** Calls one for every configuration the pack and unpack checks share (fewer when small:
 * SANITIZE=1). */
void fx_transfer_cases(int small, void (*one)(struct fx_transfer));

#endif /* STEPQ_TESTS_CHECKASM_FIXTURE_H */
