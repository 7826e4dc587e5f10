/*
 * The CUDA kernels (sm_90a) of kernels/dsp.h: fused packed decode step, the
 * dense fp32/bf16 decode step (the baseline), pack/unpack (prefill hooks) and
 * the paper's two-stage decode variant.
 *
 * Memory contract of the CUDA entries: every tensor (q, k, v, g, beta,
 * A_log, dt_bias, o, slots, health, counts, dense states, page bases) is
 * DEVICE memory; `stream` is a cudaStream_t (NULL = legacy default stream).
 * The step inputs and output are read as kernels/dsp.h describes them:
 * fp32 or bf16 (a->dtype, a->param_dtype), requests a->*_stride elements
 * apart, independently of the dtype of the states.
 * The layer description in struct stepq__packed_layer (heads[], head_offset,
 * row_impact) is HOST memory: it is mirrored once to a device descriptor
 * table (stepq__cuda_layer_prepare) so that a step in steady state performs
 * no host-to-device copy. The caller (the pool's CUDA backend) prepares
 * each layer once and keeps the handle for the layer's lifetime.
 *
 * Slot ids live on the device, so the CUDA entries do not check them on the
 * host (that would need a synchronising copy and break CUDA-graph capture):
 * ids outside 0..n_slots-1 are skipped by the kernels like -1 (nothing is
 * written for them), and a duplicate id in one batch is a caller bug whose
 * outcome is undefined (one of the writers wins).
 *
 * Only d_k = d_v = 128 is implemented (every shipping GDN/KDA model); other
 * shapes return STEPQ_ENOTSUP. CUDA errors never abort: stepq__cuda_error
 * (plugin/cuda_err.h) maps them to STEPQ_ENODEV (no device, no or too old
 * a driver, no kernel image for the device) or STEPQ_ECUDA, with a message
 * naming the entry, the failing call and the runtime's text, and clears
 * the last error. Entries are asynchronous on `stream` and thread-safe,
 * except that a handle's two-stage scratch and second stream serve one
 * call at a time (the fused step, pack and unpack only read the handle).
 */
#ifndef STEPQ_KERNELS_CUDA_CUDA_H
#define STEPQ_KERNELS_CUDA_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/dsp.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Head dimension the CUDA kernels support (d_k = d_v). */
#define STEPQ__CUDA_HEAD_DIM 128

/** A layer's device-side descriptor table (opaque). */
typedef struct stepq__cuda_layer stepq__cuda_layer;

/** Decode variants of the packed step. */
typedef enum stepq__cuda_variant {
    STEPQ__CUDA_FUSED = 0, /**< one pass: read page, update, fit, write page (default) */
    STEPQ__CUDA_TWO_STAGE =
        1, /**< paper: update to fp32 scratch, then fit+pack on a second stream */
} stepq__cuda_variant;

/**
 * Number of usable CUDA devices; 0 when there is none or the runtime fails
 * (the error is cleared). Never aborts.
 */
int stepq__cuda_device_count(void);

/**
 * Kernel choice of stepq__cuda_layer_prepare_ex and stepq__cuda_step_dense_ex:
 * the thread-per-column kernels (head_kernel.cuh) for every launch of that
 * handle or call, instead of the micro-tiled ones (tile_kernel.cuh,
 * unpack_kernel.cuh, fp8_kernel.cuh). For the tests and the benchmark's "(old)"
 * rows, which compare the two; launches that use the column kernels anyway (the
 * dense fp32 step, two-stage stage 1, layers with dense-method pages, the decode
 * step of fp8 pages) are the same either way. The choice belongs to the handle (or the call), not
 * to the process: handles of either kind may be used side by side.
 */
#define STEPQ__CUDA_COLUMN 1u
/*
 * The fp16 kernel (arith fp16 layers, kernels/cuda/f16_kernel.cuh) at 3 blocks per SM (80
 * registers, no spill) instead of 4 (64 registers): the benchmark's A/B of its occupancy. The
 * exact fit's kernel only (a norefit layer keeps 4 blocks per SM); a packed layer's flag, which
 * the dense step refuses.
 */
#define STEPQ__CUDA_F16_OCC3 2u

/**
 * Mirrors a packed layer's description (pl->heads, head_offset, row_impact:
 * host memory) into a device descriptor table. pl->base, n_slots and
 * page_stride are NOT captured: they are passed again at each call.
 * `flags`: 0, STEPQ__CUDA_COLUMN or STEPQ__CUDA_F16_OCC3, kept in the handle for its
 * steps, packs and unpacks. A layer with arith fp16 heads steps them, pivot heads included, in
 * one launch of the fp16 kernel (a head it does not step, or a block with alignment padding, is
 * refused here, STEPQ_ENOTSUP); its handle's two-stage variant and column kernels refuse its
 * steps (STEPQ_ENOTSUP). Synchronous (a blocking copy). Release with
 * stepq__cuda_layer_release.
 * The dual-axis heads' decode_fit (all the same: one template variant per
 * launch) selects the fit of the handle's decode steps (fused and two-stage
 * stage 2): norefit launches SQ_V_NOREFIT / the column kernel's NOREFIT,
 * rows SQ_V_ROWS / ROWS; packs always fit exactly.
 * @return STEPQ_OK; STEPQ_EINVAL (bad layout, w not finite > 0, head block
 *         outside the page, unknown flags, dual-axis heads whose decode_fit
 *         differs: refused before any CUDA call, naming decode_fit),
 *         STEPQ_ENOTSUP (d_k or d_v != 128), STEPQ_ENOMEM, STEPQ_ENODEV or
 *         STEPQ_ECUDA.
 */
int stepq__cuda_layer_prepare_ex(const struct stepq__packed_layer *pl, unsigned flags,
                                 stepq__cuda_layer **out);

/** stepq__cuda_layer_prepare_ex with flags 0: the shipped kernels (the pool's handles). */
int stepq__cuda_layer_prepare(const struct stepq__packed_layer *pl, stepq__cuda_layer **out);

/** Frees a prepared layer (synchronises its second stream). NULL is a no-op. */
void stepq__cuda_layer_release(stepq__cuda_layer *L);

/**
 * Device bytes a prepared layer holds per head (its descriptor), for the
 * pool's memory accounting; the two-stage variant's scratch comes on top
 * when that variant runs.
 */
size_t stepq__cuda_layer_bytes_per_head(void);

/**
 * Packed decode step on a prepared layer. pl supplies base, page_stride,
 * n_slots (its heads/offsets must be the ones L was prepared from).
 * STEPQ__CUDA_TWO_STAGE keeps an fp32 scratch of batch*HV heads in L (grown
 * on demand, a blocking allocation) and joins its second stream back into
 * a->stream before returning, so stream order is preserved.
 */
int stepq__cuda_step_packed_prepared(const struct stepq__step_args *a,
                                     const struct stepq__packed_layer *pl, stepq__cuda_layer *L,
                                     stepq__cuda_variant variant);

/** Pack (prefill hook) from a source of dtype STEPQ_DTYPE_FP32 or BF16. */
int stepq__cuda_pack_prepared(const struct stepq__packed_layer *pl, stepq__cuda_layer *L, int n,
                              const int32_t *slots, const void *src, size_t src_stride,
                              stepq__layout layout, stepq_dtype dtype, uint32_t *health,
                              uint64_t *counts, void *stream);

/** Unpack with a destination dtype, fp32 or bf16 (bf16 rounds to nearest even). */
int stepq__cuda_unpack_prepared(const struct stepq__packed_layer *pl, stepq__cuda_layer *L, int n,
                                const int32_t *slots, void *dst, size_t dst_stride,
                                stepq__layout layout, stepq_dtype dtype, void *stream);

/**
 * Dense decode step on fp32 or bf16 states (base is float* or bf16 bits;
 * slot_stride in elements; `dtype` is the states', a->dtype the inputs').
 * bf16 states are updated in fp32 and stored rounded to nearest even,
 * saturating to the largest finite bf16. bf16 states run on the warp kernel
 * (dense_kernel.cuh) where base and stride allow 16-byte vectors, else on the
 * tile kernel. `flags`: 0 or STEPQ__CUDA_COLUMN (bf16 states on the column
 * kernel; fp32 states always run there);
 * anything else is STEPQ_EINVAL.
 */
int stepq__cuda_step_dense_ex(const struct stepq__step_args *a, void *base, size_t slot_stride,
                              stepq__layout layout, stepq_dtype dtype, unsigned flags);

/** stepq__cuda_step_dense_ex on fp32 states (flags 0), described as for stepq__ref_step_dense. */
int stepq__cuda_step_dense(const struct stepq__step_args *a, const struct stepq__dense_states *st);

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_KERNELS_CUDA_CUDA_H */
