/*
 * The data path of an open pool: one decode step of one recurrent layer for
 * a batch of slots, the prefill hooks that move dense states in and out of
 * packed pages around the server's own chunk kernel, the conv-state view and
 * a capability query. The pool owns everything the kernels need (head
 * layouts, row impact, the device descriptors), built once at open, so a
 * call only names the layer, the slots and the tensors.
 *
 * Tensors are described as a server holds them (SGLang's GDN / KDA decode
 * kernels are the model), for this rank's heads: H = the map's q/k heads /
 * tp_size, HV = its value heads / tp_size, K = head_k_dim, V = head_v_dim.
 * Within one request the heads are contiguous in the shapes given below;
 * consecutive requests are `*_stride` ELEMENTS apart (0 = packed), so views
 * split out of a fused projection need no copy.
 *
 * Backends: on the host backend every pointer is host memory and the call
 * runs the C reference before it returns; on the CUDA backend every tensor
 * and the slot-id list are device memory of the pool's device and the call
 * only enqueues kernels on `stream`.
 *
 * CUDA graphs: stepq_pool_decode_step(), stepq_pool_prefill_pack() and
 * stepq_pool_prefill_unpack() on the CUDA backend do no host
 * synchronisation, no allocation and no read of device memory, so they can
 * be captured into a CUDA graph and replayed; the slot ids and inputs are
 * read from device memory at replay time.
 *
 * Slot ids: -1 (STEPQ_POOL_SLOT_PAD) entries are skipped: nothing is written
 * for them, their output rows included (a pack may read a skipped entry's
 * dense rows, which must therefore be addressable). Slot 0 (the sentinel) is a
 * valid target for padding and may appear any number of times; what it holds
 * is meaningless. Every other id must be an allocated slot and appear once.
 * The host backend checks this and fails with nothing changed; the CUDA
 * backend cannot read the device list without a synchronisation, so there an
 * id outside 0..slots is skipped like -1, and an unallocated or repeated id is
 * the caller's bug (its page is updated; with a repeat, one writer wins).
 *
 * Thread safety: calls may come from several threads; each is atomic with
 * respect to the pool's other calls. Work on one slot must be ordered by the
 * caller (one stream, or events), as for any CUDA tensor.
 *
 * Errors: every entry validates everything it can before it changes
 * anything, and returns a negative stepq_status with a message that names
 * the argument (stepq_pool_last_error(), stepq_last_error()).
 */
#ifndef STEPQ_STEP_H
#define STEPQ_STEP_H

#include "stepq/common.h"
#include "stepq/map.h"
#include "stepq/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Layout of one dense state head in a server's tensor. */
typedef enum stepq_state_layout {
    STEPQ_STATE_LAYOUT_KV = 0, /**< [K][V] per head: flash-linear-attention's [N, HV, K, V] */
    STEPQ_STATE_LAYOUT_VK = 1, /**< [V][K] per head: SGLang's pool [slots + 1, HV, V, K] */
} stepq_state_layout;

/** stepq_step_args.flags: l2-normalise q and k in the kernel (eps 1e-6). */
#define STEPQ_STEP_L2NORM (1u << 0)
/**
 * stepq_step_args.flags: g holds the raw gate input `a`; the kernel forms
 * g = -exp(A_log[h]) * softplus(a + dt_bias) (GDN: dt_bias [HV]; KDA:
 * dt_bias [HV][K]).
 */
#define STEPQ_STEP_GATE_IN_KERNEL (1u << 1)
/** stepq_step_args.flags: beta holds the raw `b`; the kernel uses sigmoid(b). */
#define STEPQ_STEP_BETA_SIGMOID (1u << 2)

/**
 * One decode token for a batch of requests of one layer. Per request b and
 * value head h (h reads q/k head h / (HV / H)):
 *
 *     q, k <- q, k / sqrt(sum of squares + 1e-6)      (STEPQ_STEP_L2NORM)
 *     q <- q * scale
 *     S <- exp(g) S                 (GDN: one g per head; KDA: row i by g_i)
 *     u <- beta * (v - S^T k)       (the decayed state)
 *     S <- S + k u^T
 *     o <- S^T q                    (the updated state)
 *
 * S is reconstructed from the slot's packed page and written back packed.
 * Initialise with STEPQ_STEP_ARGS_INITIALIZER, then set the fields.
 */
typedef struct stepq_step_args {
    size_t size;      /**< sizeof(stepq_step_args) as the caller compiled it */
    unsigned magic;   /**< STEPQ_CONFIG_MAGIC */
    unsigned version; /**< STEPQ_STEP_ARGS_VERSION as the caller compiled it */

    int32_t batch;           /**< requests, 0 .. 65535 */
    const int32_t *slot_ids; /**< [batch] int32 slot ids (device memory on CUDA) */
    stepq_dtype dtype;       /**< of q, k, v, g, beta and o: fp32 or bf16 */
    const void *q;           /**< [batch][H][K] */
    const void *k;           /**< [batch][H][K] */
    const void *v;           /**< [batch][HV][V] */
    const void *g;           /**< log-space gate (or raw a): GDN [batch][HV], KDA [batch][HV][K] */
    const void *beta;        /**< [batch][HV] (or raw b) */
    void *o;                 /**< [batch][HV][V] output */
    int64_t q_stride;        /**< elements between requests of q (0 = H*K) */
    int64_t k_stride;        /**< ... of k (0 = H*K) */
    int64_t v_stride;        /**< ... of v (0 = HV*V) */
    int64_t g_stride;        /**< ... of g (0 = HV, KDA HV*K) */
    int64_t beta_stride;     /**< ... of beta (0 = HV) */
    int64_t o_stride;        /**< ... of o (0 = HV*V) */
    unsigned flags;          /**< STEPQ_STEP_* */
    float scale;             /**< query scale; 0 = K^-1/2 */
    const void *A_log;       /**< [HV] (STEPQ_STEP_GATE_IN_KERNEL) */
    const void *dt_bias;     /**< GDN [HV], KDA [HV][K] (STEPQ_STEP_GATE_IN_KERNEL) */
    stepq_dtype param_dtype; /**< of A_log and dt_bias: fp32 or bf16 */
    uint64_t *health_counts; /**< NULL, or 4 counters (input, state, saturated, output) */
    /* Declared shape: 0 = take it from the map; otherwise it must equal the
     * map's (this rank's) value, or the call fails with STEPQ_ESHAPE. */
    int32_t num_k_heads; /**< H */
    int32_t num_v_heads; /**< HV */
    int32_t head_k_dim;  /**< K */
    int32_t head_v_dim;  /**< V */
} stepq_step_args;

#define STEPQ_STEP_ARGS_VERSION 1
/* One field per line, by name (kept out of clang-format). */
/* clang-format off */
#define STEPQ_STEP_ARGS_INITIALIZER         \
    {                                       \
        .size = sizeof(stepq_step_args),    \
        .magic = STEPQ_CONFIG_MAGIC,        \
        .version = STEPQ_STEP_ARGS_VERSION, \
        .batch = 0,                         \
        .slot_ids = NULL,                   \
        .dtype = STEPQ_DTYPE_FP32,          \
        .q = NULL,                          \
        .k = NULL,                          \
        .v = NULL,                          \
        .g = NULL,                          \
        .beta = NULL,                       \
        .o = NULL,                          \
        .q_stride = 0,                      \
        .k_stride = 0,                      \
        .v_stride = 0,                      \
        .g_stride = 0,                      \
        .beta_stride = 0,                   \
        .o_stride = 0,                      \
        .flags = 0,                         \
        .scale = 0.0f,                      \
        .A_log = NULL,                      \
        .dt_bias = NULL,                    \
        .param_dtype = STEPQ_DTYPE_FP32,    \
        .health_counts = NULL,              \
        .num_k_heads = 0,                   \
        .num_v_heads = 0,                   \
        .head_k_dim = 0,                    \
        .head_v_dim = 0,                    \
    }
/* clang-format on */

/**
 * Runs one decode step of recurrent layer `layer` (0 .. n_layers - 1, the
 * map's order; stepq_map_layer_index() turns a model layer id into it).
 *
 * @param stream cudaStream_t to enqueue on (CUDA backend; NULL = the pool's
 *               configured stream); must belong to the pool's device.
 *               Ignored by the host backend.
 * @return STEPQ_OK; STEPQ_EINVAL (NULL tensor, a slot id not allocated or
 *         repeated, stride too small, misaligned pointer, unknown flags,
 *         stream of another device), STEPQ_ERANGE (layer, or a slot id out
 *         of range: below -1 or above the pool's slots), STEPQ_ESHAPE (declared shape),
 *         STEPQ_ENOTSUP (see stepq_pool_supports()), STEPQ_EVERSION,
 *         STEPQ_EBADF, STEPQ_ECUDA. Nothing is written on failure.
 *         Non-finite inputs are not an error: that head keeps its state,
 *         its output row is 0 and the slot's health word notes
 *         STEPQ_HEALTH_INPUT.
 */
STEPQ_API int stepq_pool_decode_step(stepq_pool_t *pool, int layer, const stepq_step_args *args,
                                     void *stream);

/**
 * Dense states of a list of slots for one layer, as the server's chunk
 * kernel reads (initial states) and writes (final states) them: entry e is
 * HV heads of K*V values at states + e * state_stride elements, each head in
 * `layout`. Initialise with STEPQ_PREFILL_ARGS_INITIALIZER.
 */
typedef struct stepq_prefill_args {
    size_t size;      /**< sizeof(stepq_prefill_args) as the caller compiled it */
    unsigned magic;   /**< STEPQ_CONFIG_MAGIC */
    unsigned version; /**< STEPQ_PREFILL_ARGS_VERSION as the caller compiled it */

    int32_t n;               /**< entries, 0 .. 65535 */
    const int32_t *slot_ids; /**< [n] slot ids (device memory on CUDA); -1 skipped */
    void *states;            /**< [n][HV][K][V] or [n][HV][V][K]; read by pack, written by unpack */
    int64_t state_stride;    /**< elements between entries (0 = HV*K*V) */
    stepq_dtype dtype;       /**< fp32 or bf16 (unpack rounds to nearest even, past bf16: +-Inf) */
    stepq_state_layout layout; /**< per-head layout of `states` */
    uint64_t *health_counts;   /**< pack: NULL, or 4 counters as in stepq_step_args */
    int32_t num_v_heads;       /**< declared HV (0 = the map's) */
    int32_t head_k_dim;        /**< declared K (0 = the map's) */
    int32_t head_v_dim;        /**< declared V (0 = the map's) */
} stepq_prefill_args;

#define STEPQ_PREFILL_ARGS_VERSION 1
/* One field per line, by name (kept out of clang-format). */
/* clang-format off */
#define STEPQ_PREFILL_ARGS_INITIALIZER         \
    {                                          \
        .size = sizeof(stepq_prefill_args),    \
        .magic = STEPQ_CONFIG_MAGIC,           \
        .version = STEPQ_PREFILL_ARGS_VERSION, \
        .n = 0,                                \
        .slot_ids = NULL,                      \
        .states = NULL,                        \
        .state_stride = 0,                     \
        .dtype = STEPQ_DTYPE_FP32,             \
        .layout = STEPQ_STATE_LAYOUT_KV,       \
        .health_counts = NULL,                 \
        .num_v_heads = 0,                      \
        .head_k_dim = 0,                       \
        .head_v_dim = 0,                       \
    }
/* clang-format on */

/**
 * Packs dense states into the slots' pages of one layer (after the server's
 * prefill chunk kernel produced the final states): fit, quantize, write.
 * Non-finite state elements are stored as 0 and noted STEPQ_HEALTH_STATE.
 * The slots must be allocated and distinct (sentinel 0 allowed); same
 * errors and stream semantics as stepq_pool_decode_step().
 */
STEPQ_API int stepq_pool_prefill_pack(stepq_pool_t *pool, int layer, const stepq_prefill_args *args,
                                      void *stream);

/**
 * Reconstructs the slots' states of one layer into dense tensors (the
 * initial states of a prefill chunk that continues a cached prefix). Slots
 * may repeat; the pages are only read.
 */
STEPQ_API int stepq_pool_prefill_unpack(stepq_pool_t *pool, int layer,
                                        const stepq_prefill_args *args, void *stream);

/** Operations stepq_pool_supports() is asked about. */
typedef enum stepq_op {
    STEPQ_OP_DECODE_STEP = 0,    /**< args: const stepq_step_args * */
    STEPQ_OP_PREFILL_PACK = 1,   /**< args: const stepq_prefill_args * */
    STEPQ_OP_PREFILL_UNPACK = 2, /**< args: const stepq_prefill_args * */
} stepq_op;

/**
 * Whether the pool's backend runs `op` on `layer` (-1: every layer) with the
 * dtypes, layout, flags, declared shape and batch of `args`; the tensor and
 * slot pointers of args are not looked at (they may be NULL). A server asks
 * once at load time instead of failing at its first step.
 *
 * The CUDA backend runs 128x128 heads only.
 *
 * @return STEPQ_OK when supported; STEPQ_ENOTSUP with the reason in
 *         stepq_pool_last_error() (e.g. "cuda backend: head 64x64; the
 *         kernels support 128x128"); STEPQ_EINVAL / STEPQ_ESHAPE /
 *         STEPQ_ERANGE / STEPQ_EVERSION for arguments that are wrong on
 *         every backend.
 */
STEPQ_API int stepq_pool_supports(stepq_pool_t *pool, stepq_op op, int layer, const void *args);

/**
 * Where one layer's conv states live: slot s's conv state of this rank is
 * `bytes` bytes at base + s * slot_stride (device memory on CUDA), a dense
 * tensor of `shape` in `dtype`, row-major, never quantized. The server's
 * conv kernel reads and writes it in place, as a strided view of
 * [slots + 1, shape...].
 */
typedef struct stepq_conv_view {
    void *base;           /**< slot 0's conv state of the layer */
    uint64_t slot_stride; /**< bytes between slots (the page stride) */
    uint64_t bytes;       /**< bytes of one slot's conv state */
    stepq_dtype dtype;
    int rank;                           /**< 0 when the map has no conv state */
    int64_t shape[STEPQ_CONV_MAX_RANK]; /**< this rank's shape: dim 0 (channels) / tp_size */
} stepq_conv_view;

/**
 * Fills *out (view_size = sizeof(stepq_conv_view) as the caller compiled
 * it; fields past it are not written) for recurrent layer `layer`.
 */
STEPQ_API int stepq_pool_conv_state(stepq_pool_t *pool, int layer, stepq_conv_view *out,
                                    size_t view_size);

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_STEP_H */
