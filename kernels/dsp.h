/*
 * The kernel entries' common contract: argument structs, shapes, element
 * types and health reporting of a decode step, a pack and an unpack, and the
 * C reference entries that implement it (kernels/recurrence.c,
 * kernels/step.c).
 *
 * The pool's backends call these entries directly, one per operation: the
 * host backend the C reference below, the CUDA backend the CUDA entries of
 * kernels/cuda/cuda.h (which take the same structs). The tests compare the
 * two on the same inputs, kernel by kernel (tests/checkasm)
 * and through the pool (tests/pool/test_step_cuda.c): the reference is the
 * specification the CUDA kernels are held to.
 *
 * Shapes, for one recurrent layer and one decode token per request:
 *   batch  requests, slots[b] their slot ids (-1 = padding: skipped, its
 *          output rows are not written)
 *   H      q/k heads, HV value (state) heads, HV a multiple of H; value head
 *          hv reads q/k head hv / (HV / H)
 *   q, k   [batch][H][d_k]       v [batch][HV][d_v]      o [batch][HV][d_v]
 *   g      log-space gate: GDN [batch][HV], KDA [batch][HV][d_k]; with
 *          gate_in_kernel it holds the raw `a` of the same shape and
 *          g = -exp(A_log[hv]) * softplus(a + dt_bias), dt_bias GDN [HV],
 *          KDA [HV][d_k]
 *   beta   [batch][HV]; with beta_sigmoid it holds raw b, beta = sigmoid(b)
 * Element types: q, k, v, g, beta and o are of `dtype`, A_log and dt_bias
 * of `param_dtype`, each fp32 (the default, 0) or bf16 (STEPQ_ENOTSUP for
 * any other). Inputs are widened to fp32 and the recurrence is computed in
 * fp32 whatever the dtype; a bf16 o is the fp32 readout rounded to nearest
 * even.
 * Strides: a server's activations are often views split out of a fused
 * projection, so consecutive requests (the leading [batch] index) of q, k,
 * v, g, beta and o are *_stride ELEMENTS apart; 0 means packed (H*d_k for
 * q and k, HV*d_v for v and o, HV or HV*d_k for g, HV for beta), and a
 * nonzero stride below that is STEPQ_EINVAL (rows would overlap). Within a
 * request the heads are contiguous in the shapes above; A_log and dt_bias
 * are always contiguous. For the C entries the tensors are host pointers;
 * for CUDA entries device pointers, and `stream` is the cudaStream_t the
 * work is queued on (ignored by the C entries).
 *
 * Per (request, value head), in this order (the order of
 * flash-linear-attention and transformers, which this project adopts):
 *   q <- q * rsqrt(sum q^2 + 1e-6), same for k        (if l2norm)
 *   q <- q * scale                                    (scale <= 0: d_k^-1/2)
 *   S <- exp(g) S        (GDN: scalar; KDA: row i scaled by exp(g_i))
 *   u <- beta * (v - S^T k)                           (decayed state)
 *   S <- S + k u^T
 *   non-finite elements of S -> 0, flag STEPQ_HEALTH_STATE
 *   o <- S^T q                                        (updated state)
 *
 * Health (kernels/README.md): `health` is indexed by slot id and OR-ed with
 * STEPQ_HEALTH_* bits; `counts` (4 entries, indexed by flag bit position:
 * input, state, saturated, output) is incremented once per (request, head)
 * event. Either may be NULL.
 */
#ifndef STEPQ_KERNELS_DSP_H
#define STEPQ_KERNELS_DSP_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/format.h"

/** Number of entries of a health counter array. */
#define STEPQ__HEALTH_NCOUNTS 4

/** Recurrence options. */
struct stepq__step_opts {
    int l2norm;         /**< l2-normalise q and k in the kernel (eps 1e-6) */
    float scale;        /**< query scale; <= 0 means d_k^-1/2 */
    int gate_in_kernel; /**< g holds raw a; gate from A_log, dt_bias */
    int beta_sigmoid;   /**< beta holds raw b; beta = sigmoid(b) */
};

/** Inputs of one decode step of one layer (shapes in the header comment). */
struct stepq__step_args {
    stepq_arch arch;
    int batch, H, HV, d_k, d_v;
    int n_slots;                      /**< dense step: slot ids must be < n_slots (or -1); the
                                           packed step checks against the layer's n_slots */
    const int32_t *slots;             /**< [batch] */
    const void *q, *k, *v, *g, *beta; /**< of dtype, rows *_stride elements apart */
    const void *A_log, *dt_bias;      /**< of param_dtype; only with gate_in_kernel */
    stepq_dtype dtype;                /**< q, k, v, g, beta, o: STEPQ_DTYPE_FP32 (0) or BF16 */
    stepq_dtype param_dtype;          /**< A_log, dt_bias: STEPQ_DTYPE_FP32 (0) or BF16 */
    /** Elements between consecutive requests (tokens of a prefill); 0 = packed. */
    size_t q_stride, k_stride, v_stride, g_stride, beta_stride, o_stride;
    struct stepq__step_opts opt;
    void *o;          /**< [batch][HV][d_v] of dtype, rows o_stride elements apart */
    uint32_t *health; /**< [n_slots] or NULL */
    uint64_t *counts; /**< [STEPQ__HEALTH_NCOUNTS] or NULL */
    void *stream;     /**< cudaStream_t for CUDA entries */
};

/** Dense fp32 states as a server holds them: head hv of slot s starts at
 *  base + s*slot_stride + hv*d_k*d_v (elements), in `layout`. */
struct stepq__dense_states {
    float *base;
    size_t slot_stride;
    stepq__layout layout;
};

/**
 * Packed pages of one layer: head hv of slot s is the block at
 * base + s*page_stride + head_offset[hv] with layout heads[hv].
 */
struct stepq__packed_layer {
    uint8_t *base;
    size_t page_stride;
    int n_slots;                            /**< pages in the pool (incl. sentinel 0) */
    int n_heads;                            /**< HV */
    const struct stepq__head_layout *heads; /**< [n_heads], all with the same d_k, d_v */
    const size_t *head_offset;              /**< [n_heads] */
    const float *row_impact;                /**< [n_heads][d_k] or NULL (all 1) */
};

/* --- The C reference entries (kernels/recurrence.c, kernels/step.c) --- */

/** Decode step on dense fp32 states in place. */
int stepq__ref_step_dense(const struct stepq__step_args *a, const struct stepq__dense_states *st);

/** Decode step on packed pages: quantize(update(dequantize(page))) (paper Eq. 4). */
int stepq__ref_step_packed(const struct stepq__step_args *a, const struct stepq__packed_layer *pl);

/**
 * Packs n dense states into pages: entry e (src + e*src_stride elements,
 * [HV] heads in `layout`) goes to slot slots[e] (-1 skipped). `stream` is
 * ignored (the CUDA entries' argument).
 */
int stepq__ref_pack(const struct stepq__packed_layer *pl, int n, const int32_t *slots,
                    const float *src, size_t src_stride, stepq__layout layout, uint32_t *health,
                    uint64_t *counts, void *stream);

/** Reconstructs n pages into dense states (the reverse of stepq__ref_pack). */
int stepq__ref_unpack(const struct stepq__packed_layer *pl, int n, const int32_t *slots, float *dst,
                      size_t dst_stride, stepq__layout layout, void *stream);

/**
 * Chunked prefill reference of one sequence: T tokens of one request, the
 * chunkwise-parallel (WY / UT-transform) form with any chunk length >= 1,
 * equal to T decode steps up to rounding.
 *
 * Tensors as in a decode step with `batch` replaced by T (token t in place of
 * request b; dtypes as there, and *_stride is the distance between tokens);
 * slots/n_slots/health are unused. state: HV heads of d_k*d_v fp32 in
 * `layout`, read as the initial state (NULL-equivalent: pass zeros) and
 * overwritten with the final state. o: [T][HV][d_v].
 * Non-finite inputs are rejected with STEPQ_ENONFINITE before anything is
 * written (a prefill has no per-token fallback).
 */
int stepq__ref_prefill_chunked(const struct stepq__step_args *a, int chunk, float *state,
                               stepq__layout layout);

/*
 * Helpers shared by the reference entries, all in kernels/recurrence.c so
 * that kernels/step.c calls recurrence.c and never the other way round
 * (the CUDA host code and the calibration replay call some of them too).
 */
int stepq__check_step_args(const struct stepq__step_args *a, const char *who);

/** The per-request strides of a step's tensors in elements, the packed defaults filled in. */
struct stepq__step_strides {
    size_t q, k, v, g, beta, o;
};
/** The strides of a (shape-checked) step: *_stride, or the packed default where it is 0. */
struct stepq__step_strides stepq__step_strides_of(const struct stepq__step_args *a);
/**
 * Writes the d_v outputs of (request b, value head hv) into a->o, converted
 * to a->dtype (bf16: round to nearest even); o == NULL writes zeros.
 */
void stepq__store_out(const struct stepq__step_args *a, int b, int hv, const float *o);
/**
 * Prepares the inputs of (request b, value head hv): normalised and scaled q,
 * k (d_k), v (d_v), the log-space gate g (1 value for GDN, d_k for KDA) and
 * beta. Returns 0 if every input is finite, 1 otherwise.
 */
int stepq__prep_head(const struct stepq__step_args *a, int b, int hv, float *q, float *k, float *v,
                     float *g, float *beta);
/**
 * stepq__prep_head for a decode step into `slot`, with the one policy every
 * step follows on a non-finite input: the head's output row o[b][hv] reads 0,
 * the slot is flagged STEPQ_HEALTH_INPUT and 1 is returned (the caller then
 * leaves the state as it was). Returns 0 when the inputs are ready.
 */
int stepq__prep_step_head(const struct stepq__step_args *a, int b, int hv, int32_t slot, float *q,
                          float *k, float *v, float *g, float *beta);
/**
 * The update of one head on an fp32 tile S (element (i, j) at S[i*rs + j*cs]):
 * decay, delta correction, update, sanitise (non-finite -> 0), readout into
 * o[d_v] (a non-finite readout element is written as 0). Returns the health
 * bits raised: STEPQ_HEALTH_STATE and/or STEPQ_HEALTH_OUTPUT, or 0.
 */
uint32_t stepq__head_update(float *S, size_t rs, size_t cs, int arch_kda, int d_k, int d_v,
                            const float *q, const float *k, const float *v, const float *g,
                            float beta, float *o);
/**
 * Checks that slot ids are -1 or in 0..n_slots-1 and, when `distinct`, that
 * no id but 0 appears twice (two requests writing one page is a caller bug).
 * Slot 0 is the pages' sentinel, the padding target of a CUDA-graph batch:
 * it may repeat, entries run in order and what it holds is meaningless (the
 * CUDA kernels accept it the same way).
 */
int stepq__check_slot_list(int n, const int32_t *slots, int n_slots, int distinct, const char *who);
/** Records a health event for a slot (flags OR-ed, counts incremented). */
void stepq__health_note(uint32_t *health, uint64_t *counts, int32_t slot, uint32_t flags);

#endif /* STEPQ_KERNELS_DSP_H */
