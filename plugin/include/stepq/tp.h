/*
 * Tensor parallelism without a transport: how a model's heads split over
 * TP ranks, each rank's slice of the precision map, the page size every
 * rank pads to so slot ids agree, the fingerprints ranks compare, and the
 * fixed-size header of a "packed pages of slots" message. Plain C on the
 * host; nothing here talks to NCCL or a GPU.
 *
 * The split is the server's (SGLang's, as vLLM's): with TP degree tp, rank r
 * computes q/k heads [r*H/tp, (r+1)*H/tp) and value heads
 * [r*HV/tp, (r+1)*HV/tp) of every recurrent layer. Value head hv reads q/k
 * head hv / (HV/H), so each rank's value block reads exactly its own q/k
 * heads: the grouped-value (GVA) groups stay whole on one rank.
 *
 * Every function is thread-safe (no shared state) and sets
 * stepq_last_error() when it fails.
 */
#ifndef STEPQ_TP_H
#define STEPQ_TP_H

#include "stepq/common.h"
#include "stepq/map.h"
#include "stepq/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- The head split --- */

/** One rank's part of a model shape (stepq_tp_shard()). */
typedef struct stepq_tp_shard_info {
    int tp_size;      /**< TP degree */
    int tp_rank;      /**< this rank, 0 .. tp_size - 1 */
    int num_k_heads;  /**< q/k heads on this rank: H / tp_size */
    int num_v_heads;  /**< value heads on this rank: HV / tp_size */
    int first_k_head; /**< global q/k head of local q/k head 0: tp_rank * H / tp_size */
    int first_v_head; /**< global value head of local value head 0: tp_rank * HV / tp_size */
    int conv_rank;    /**< rank of the conv state shape (0: the model has none) */
    /** The dimension of the conv state that is split (its channels), -1 when there is none. */
    int conv_split_dim;
    /** This rank's conv state shape of one layer: conv_shape[conv_split_dim] / tp_size. */
    int64_t conv_shape[STEPQ_CONV_MAX_RANK];
} stepq_tp_shard_info;

/**
 * Splits a whole-model shape for rank tp_rank of tp_size.
 *
 * Both head counts must divide: H % tp_size and HV % tp_size are 0 (a
 * remainder would leave a q/k head, and the value heads reading it, on two
 * ranks, which the server's column-parallel projections never produce).
 * The conv state's channels, its largest dimension (the others are the
 * kernel taps and KDA's three q/k/v convolutions), must divide too.
 *
 * @param shape     the whole model (stepq_map_shape()); not kept
 * @param tp_size   TP degree, >= 1
 * @param tp_rank   0 .. tp_size - 1
 * @param out       filled on success (out_size bytes of it)
 * @param out_size  sizeof(stepq_tp_shard_info) as the caller compiled it;
 *                  fields past it are not written, so older callers keep
 *                  working when fields are appended
 * @return STEPQ_OK; STEPQ_EINVAL for a NULL argument, a bad tp_size or
 *         tp_rank, or counts that do not divide, the message naming both
 *         numbers ("num_k_heads 16 does not split over tp_size 3 ...").
 */
STEPQ_API int stepq_tp_shard(const stepq_model_shape *shape, int tp_size, int tp_rank,
                             stepq_tp_shard_info *out, size_t out_size);

/**
 * The slice of a precision map that rank tp_rank of tp_size holds, as a
 * valid map of its own: the shape of stepq_tp_shard() (H / tp q/k heads,
 * HV / tp value heads, the rank's conv state), each local head's widths,
 * row-impact factors and statistics, pivots renumbered to local head ids
 * (KDA: [local head, row]), and the map's method, name and provenance.
 *
 * Budget: the budget rule (config/SCHEMA.md) bounds the whole model, and
 * the calibrator spends it globally, so one rank's slice may use more than
 * its share (a rank holding more pivots or wide heads). A slice keeps the
 * map's budget_bits when it satisfies the rule under it, and otherwise
 * takes the smallest multiple of 2^-16 bits per value it satisfies (at
 * most 8: a non-pivot unit has at most 8 bits and pivots count as 8), so
 * the shard validates and reports what the rank really spends. Methods
 * with one width (uniform, dsq, spatial), fp8 and the dense methods keep
 * their budget. At tp_size 1 the shard equals the map and is written to
 * the same bytes.
 *
 * @param map      a loaded or validated map (whole model); only read
 * @param out      on success a new map owned by the caller (stepq_map_close());
 *                 NULL on failure
 * @return STEPQ_OK; the errors of stepq_tp_shard(); STEPQ_EBADF for a
 *         closed map; STEPQ_ENOMEM.
 */
STEPQ_API int stepq_map_shard(const stepq_map_t *map, int tp_size, int tp_rank, stepq_map_t **out);

/* --- The padded page --- */

/**
 * One rank's pool when every rank pads its page to the largest rank's
 * (stepq_tp_plan()). Per GPU: the rank's own numbers; per replica: summed
 * over the tp_size ranks (one GPU each) of one model replica.
 */
typedef struct stepq_tp_plan_info {
    int tp_size;
    int tp_rank;
    int largest_rank; /**< the first rank whose unpadded page is the largest */
    /**
     * The page of every rank (bytes per slot): the largest rank's page. Set
     * stepq_pool_config.min_page_bytes to it before stepq_pool_open() on each
     * rank; stepq_tp_plan() already counts the rest below with it.
     */
    uint64_t page_bytes;
    uint64_t own_page_bytes;              /**< this rank's page without TP padding */
    uint64_t tp_pad_bytes;                /**< per GPU: page_bytes - own_page_bytes, per slot */
    uint64_t max_tp_pad_bytes;            /**< the largest tp_pad_bytes of any rank */
    uint64_t state_bytes;                 /**< this rank: packed head blocks as allocated */
    uint64_t state_bytes_compact;         /**< this rank: head blocks without alignment */
    uint64_t conv_bytes;                  /**< this rank: conv state, all layers */
    uint64_t pad_bytes;                   /**< this rank: all tail padding (alignment + TP) */
    int32_t slots;                        /**< usable slots of every rank's pool (padded page) */
    uint64_t pool_bytes;                  /**< per GPU: (slots + 1) x page_bytes */
    uint64_t replica_page_bytes;          /**< per replica: tp_size x page_bytes (one slot) */
    uint64_t replica_tp_pad_bytes;        /**< per replica: sum of tp_pad_bytes */
    uint64_t replica_state_bytes;         /**< per replica: sum of state_bytes */
    uint64_t replica_state_bytes_compact; /**< per replica: sum of state_bytes_compact */
    uint64_t replica_conv_bytes;          /**< per replica: sum of conv_bytes */
    uint64_t replica_pad_bytes;           /**< per replica: sum of pad_bytes */
} stepq_tp_plan_info;

/**
 * Plans rank cfg->tp_rank of cfg->tp_size with its page padded to the
 * largest rank's, so every rank's pool has the same page size and, for a
 * memory budget, the same slot count: slot ids agree across ranks. Every
 * rank can compute this alone (each holds the whole map). cfg is read as
 * stepq_pool_plan() reads it (its min_page_bytes is a lower bound for every
 * rank); nothing is allocated.
 *
 * @param out_size sizeof(stepq_tp_plan_info) as the caller compiled it
 * @return STEPQ_OK; the errors of stepq_pool_plan() and stepq_tp_shard();
 *         STEPQ_ERANGE when a per-replica sum passes 2^64.
 */
STEPQ_API int stepq_tp_plan(const stepq_pool_config *cfg, stepq_tp_plan_info *out, size_t out_size);

/* --- Fingerprints --- */

/** What the ranks of a deployment and the two ends of a page transfer compare. */
typedef struct stepq_tp_fingerprint_info {
    /** stepq_map_fingerprint() of the whole map: shape, method, budget, widths, row impact. */
    uint64_t map;
    /**
     * The map fingerprint, tp_size, and every rank's planned page (value
     * heads, state, compact, conv and padded page bytes: the alignment and
     * min_page_bytes in effect), and the library's major.minor version (its
     * head-block format): equal on every rank of one deployment, so an
     * all-gather at pool open catches a rank with another map, shape, tp
     * size or page geometry. Slot counts are sizing and not part of it.
     */
    uint64_t group;
    /** group and tp_rank: equal on both ends of a transfer of this rank's packed pages. */
    uint64_t page;
} stepq_tp_fingerprint_info;

/**
 * Computes the fingerprints of rank cfg->tp_rank (cfg as for
 * stepq_tp_plan()). Canonical: built from the map's content, never its
 * file bytes (calibration statistics, provenance and the model name are
 * left out), and independent of the host's byte order.
 *
 * @param out_size sizeof(stepq_tp_fingerprint_info) as the caller compiled it
 * @return STEPQ_OK; the errors of stepq_tp_plan().
 */
STEPQ_API int stepq_tp_fingerprint(const stepq_pool_config *cfg, stepq_tp_fingerprint_info *out,
                                   size_t out_size);

/* --- Packed-page messages --- */

/**
 * The header of a message carrying packed pages of slots (request
 * migration, prefill/decode transfer): STEPQ_TP_MSG_HEADER_BYTES bytes,
 * little-endian, followed by slot_count x page_bytes bytes of pages.
 *
 *   offset  bytes  field
 *        0      4  magic "SQPG"
 *        4      2  version (STEPQ_TP_MSG_VERSION)
 *        6      2  header bytes (STEPQ_TP_MSG_HEADER_BYTES)
 *        8      8  fingerprint: the sender's stepq_tp_fingerprint_info.page
 *       16      4  slot count (at most INT32_MAX)
 *       20      4  reserved, 0
 *       24      8  page bytes (> 0)
 *       32      8  payload bytes: slot count x page bytes
 *       40      8  checksum: FNV-1a of bytes 0..39
 *
 * The checksum covers the header only: pages are moved device to device,
 * where the host never reads them.
 */
#define STEPQ_TP_MSG_HEADER_BYTES 48
#define STEPQ_TP_MSG_VERSION      1
#define STEPQ_TP_MSG_MAGIC        "SQPG"

/** The fields of a message header that vary (the rest is fixed by the version). */
typedef struct stepq_tp_msg_header {
    uint64_t fingerprint;   /**< the sender rank's page fingerprint */
    uint32_t slot_count;    /**< pages that follow the header */
    uint64_t page_bytes;    /**< bytes of each page */
    uint64_t payload_bytes; /**< slot_count x page_bytes (filled by decode; ignored by encode) */
} stepq_tp_msg_header;

/**
 * Writes the STEPQ_TP_MSG_HEADER_BYTES header of h into buf.
 * @return STEPQ_OK; STEPQ_EINVAL for NULL arguments, page_bytes 0 or a
 *         slot count over INT32_MAX; STEPQ_ERANGE when cap is smaller than
 *         the header.
 */
STEPQ_API int stepq_tp_msg_encode(const stepq_tp_msg_header *h, void *buf, size_t cap);

/**
 * Reads and checks the header at the start of buf (len bytes available;
 * the pages that follow are not read). The receiver passes its own page
 * fingerprint and page bytes: a header for another layout is refused.
 * Any len and any bytes give a status, never a crash.
 *
 * @param out filled only on success
 * @return STEPQ_OK;
 *         STEPQ_EPARSE: truncated (len < STEPQ_TP_MSG_HEADER_BYTES), foreign
 *         (magic), a wrong header size, checksum, reserved word, page bytes
 *         0, slot count over INT32_MAX or a payload size that disagrees;
 *         STEPQ_EVERSION: another message version;
 *         STEPQ_ESHAPE: the fingerprint or page bytes are not the receiver's
 *         (the message names both values);
 *         STEPQ_EINVAL: NULL buf or out.
 */
STEPQ_API int stepq_tp_msg_decode(const void *buf, size_t len, uint64_t want_fingerprint,
                                  uint64_t want_page_bytes, stepq_tp_msg_header *out);

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_TP_H */
