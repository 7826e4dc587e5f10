/*
 * Tensor parallelism without a transport: how a model's heads split over
 * TP ranks, each rank's slice of the precision map, the page size every
 * rank pads to so slot ids agree, the fingerprints ranks compare, and the
 * fixed-size header of a "packed pages of slots" message (plain C on the
 * host), and the NCCL transport that moves them (a communicator, the
 * fingerprint check at pool open, packed pages of slots to another rank).
 * The header compiles without nccl.h: a communicator is passed as void *.
 *
 * The split is the server's (SGLang's, as vLLM's): with TP degree tp, rank r
 * computes q/k heads [r*H/tp, (r+1)*H/tp) and value heads
 * [r*HV/tp, (r+1)*HV/tp) of every recurrent layer. Value head hv reads q/k
 * head hv / (HV/H), so each rank's value block reads exactly its own q/k
 * heads: the grouped-value (GVA) groups stay whole on one rank.
 *
 * Every function before the NCCL section is thread-safe (no shared state);
 * every function sets stepq_last_error() when it fails.
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
 * (KDA: [local head, row]), and the map's method, row split, name and
 * provenance.
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

/* --- The NCCL transport --- */

/*
 * Built where CUDA and NCCL are (meson option nccl); in a build without
 * them every function below returns STEPQ_ENOTSUP with a message saying so.
 *
 * Timeouts: every call that waits (communicator init, close, the pool
 * check, page transfers) polls the communicator's asynchronous error
 * (ncclCommGetAsyncError) and the CUDA stream, and ends the call once
 * timeout_ms (stepq_tp_comm_config; 60 s by default) have passed since it
 * began: a communicator stepq made (stepq_tp_comm_init) is then aborted
 * (ncclCommAbort, which also ends the NCCL work left on the stream) and the
 * call returns STEPQ_ETIMEDOUT. A peer that died or never posts its side
 * therefore ends in an error on this rank, never a hang. A host's
 * communicator (stepq_tp_comm_wrap) is not stepq's to abort: the call
 * returns STEPQ_ETIMEDOUT all the same and the host must abort it, since
 * its stream still holds NCCL work that will not finish; the timeout
 * covers NCCL's own calls only when that communicator is non-blocking
 * (ncclConfig_t.blocking = 0), as a blocking one may block inside them.
 * After a timeout or an NCCL error the stepq_tp_comm_t refuses further
 * calls (STEPQ_ENCCL) and only stepq_tp_comm_close() remains.
 *
 * NCCL results become statuses: ncclInvalidArgument and ncclInvalidUsage
 * STEPQ_EINVAL, ncclSystemError and ncclRemoteError (a peer failed)
 * STEPQ_EIO, ncclUnhandledCudaError STEPQ_ECUDA, others STEPQ_ENCCL; the
 * message names the call and NCCL's own text.
 *
 * Threads: a communicator is used by one thread at a time (as NCCL's);
 * different communicators are independent.
 *
 * Calibration: `stepq calibrate` fits one map from statistics of every
 * head, so a sharded run would gather each rank's per-head statistics
 * (doubles, for its own heads) with one all-gather of the same byte count
 * per rank, in rank order, which is the head order (rank r holds heads
 * [r*HV/tp, (r+1)*HV/tp)), and then fit on every rank alike. No such call
 * exists yet: calibration runs on one process.
 */

/** Opaque handle of a communicator stepq uses: its own or the host's. */
typedef struct stepq_tp_comm stepq_tp_comm_t;

/** Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES). */
#define STEPQ_TP_ID_BYTES 128

/** An NCCL unique id (ncclUniqueId) as bytes, to pass to every rank by the host's means. */
typedef struct stepq_tp_id {
    unsigned char bytes[STEPQ_TP_ID_BYTES];
} stepq_tp_id;

/** Default of stepq_tp_comm_config.timeout_ms: 60 s. */
#define STEPQ_TP_TIMEOUT_MS_DEFAULT 60000u

/** Communicator options. Initialise with STEPQ_TP_COMM_CONFIG_INITIALIZER. */
typedef struct stepq_tp_comm_config {
    size_t size;
    unsigned magic;
    unsigned version;
    /** CUDA device of this rank (stepq_tp_comm_init; a wrapped communicator has its own). */
    int device;
    /** How long one call may wait, in ms (0: STEPQ_TP_TIMEOUT_MS_DEFAULT). */
    uint32_t timeout_ms;
} stepq_tp_comm_config;

#define STEPQ_TP_COMM_CONFIG_VERSION 1
/* clang-format off */
#define STEPQ_TP_COMM_CONFIG_INITIALIZER         \
    {                                            \
        .size = sizeof(stepq_tp_comm_config),    \
        .magic = STEPQ_CONFIG_MAGIC,             \
        .version = STEPQ_TP_COMM_CONFIG_VERSION, \
        .device = 0,                             \
        .timeout_ms = 0,                         \
    }
/* clang-format on */

/**
 * Makes a new NCCL unique id (ncclGetUniqueId) for stepq_tp_comm_init().
 * One rank calls it and hands the bytes to the others.
 * @return STEPQ_OK; STEPQ_EINVAL for NULL; the mapped NCCL error; STEPQ_ENOTSUP
 *         without NCCL.
 */
STEPQ_API int stepq_tp_unique_id(stepq_tp_id *out);

/**
 * Makes this rank's communicator from a unique id (ncclCommInitRankConfig,
 * non-blocking, so that a timeout can abort it); stepq owns it. Every rank
 * of size calls it with the same id. Waits for the other ranks up to the
 * timeout.
 *
 * @param cfg NULL for the defaults
 * @param out on success the new communicator (stepq_tp_comm_close()); NULL on failure
 * @return STEPQ_OK; STEPQ_EINVAL (NULL id or out, size < 1, rank out of
 *         0 .. size - 1); STEPQ_EVERSION (cfg header); STEPQ_ENODEV;
 *         STEPQ_ETIMEDOUT (some rank did not join in time; aborted);
 *         the mapped NCCL error; STEPQ_ENOMEM; STEPQ_ENOTSUP without NCCL.
 */
STEPQ_API int stepq_tp_comm_init(const stepq_tp_id *id, int rank, int size,
                                 const stepq_tp_comm_config *cfg, stepq_tp_comm_t **out);

/**
 * Uses the host's communicator (an ncclComm_t, e.g. the server's TP group),
 * which stays the host's: stepq never destroys or aborts it. rank and size
 * are what the caller means it to be; they are checked against the
 * communicator's (ncclCommUserRank, ncclCommCount), so a communicator of
 * another group is refused. cfg->device is ignored (the communicator's).
 *
 * @return STEPQ_OK; STEPQ_EINVAL (NULL, rank out of range, or rank / size
 *         not the communicator's, the message naming both); STEPQ_EVERSION;
 *         STEPQ_ENOMEM; STEPQ_ENOTSUP without NCCL.
 */
STEPQ_API int stepq_tp_comm_wrap(void *nccl_comm, int rank, int size,
                                 const stepq_tp_comm_config *cfg, stepq_tp_comm_t **out);

/**
 * Releases a communicator: one stepq made is finalized and destroyed
 * (aborted when that passes the timeout or it had failed), a host's is left
 * to the host. NULL is a no-op.
 * @return STEPQ_OK; the error of the finalize (the handle is released anyway).
 */
STEPQ_API int stepq_tp_comm_close(stepq_tp_comm_t *comm);

/**
 * Checks at pool open that every rank of comm opened its pool from the same
 * inputs: all-gathers each rank's fingerprints (stepq_tp_fingerprint() of
 * cfg), tp size and rank, page bytes and slot count, and compares every
 * rank's with rank 0's. Every rank gets the same result: STEPQ_OK, or the
 * same status and message naming the first rank that differs and what
 * differs ("rank 1's map differs from rank 0's ...", "rank 1's pool has 64
 * slots, rank 0's 80 ..."); the rank that differs is named, not blamed:
 * rank 0 is the reference. A rank whose own cfg and pool disagree (its cfg's page
 * is not its pool's, its cfg's tp_rank / tp_size are not comm's) takes
 * part all the same with its error, which every rank then reports.
 *
 * Collective: every rank of comm calls it. Synchronous: enqueued on stream
 * (a cudaStream_t of comm's device; NULL the default stream) and waited for.
 *
 * @param cfg  the configuration pool was opened with (min_page_bytes from
 *             stepq_tp_plan()); its map must still be open; only read
 * @param pool an open pool of the CUDA backend, on comm's device
 * @return STEPQ_OK; STEPQ_ESHAPE (another map, tp split, rank, page geometry
 *         or slot count); STEPQ_EVERSION (another stepq version on a rank);
 *         a rank's own failure to fingerprint its cfg (its status);
 *         STEPQ_EINVAL (NULL arguments, a pool on another device than
 *         comm's: at once, without the collective, so the other ranks then
 *         time out); STEPQ_ENOTSUP (a pool of the host backend, at once:
 *         NCCL moves device memory);
 *         STEPQ_ETIMEDOUT; the mapped NCCL / CUDA errors; STEPQ_ENCCL (comm
 *         failed before).
 */
STEPQ_API int stepq_tp_check_pools(stepq_tp_comm_t *comm, const stepq_pool_config *cfg,
                                   stepq_pool_t *pool, void *stream);

/**
 * One side of a page transfer: slots of a pool and the rank at the other end.
 * -1 entries in slot_ids are padding, skipped; the others are allocated
 * slots (a receiving list may not repeat one). slot_ids is host memory.
 * Initialise with STEPQ_TP_SLOTS_INITIALIZER, then set the fields.
 */
typedef struct stepq_tp_slots {
    size_t size;
    unsigned magic;
    unsigned version;
    stepq_pool_t *pool;        /**< an open pool of the CUDA backend on comm's device */
    uint64_t page_fingerprint; /**< stepq_tp_fingerprint() of the pool's config: .page */
    int peer;                  /**< the rank of comm at the other end (may be this rank) */
    const int32_t *slot_ids;   /**< [n] slot ids, host memory */
    int32_t n;
} stepq_tp_slots;

#define STEPQ_TP_SLOTS_VERSION 1
/* clang-format off */
#define STEPQ_TP_SLOTS_INITIALIZER         \
    {                                      \
        .size = sizeof(stepq_tp_slots),    \
        .magic = STEPQ_CONFIG_MAGIC,       \
        .version = STEPQ_TP_SLOTS_VERSION, \
        .pool = NULL,                      \
        .page_fingerprint = 0,             \
        .peer = 0,                         \
        .slot_ids = NULL,                  \
        .n = 0,                            \
    }
/* clang-format on */

/**
 * Moves the packed pages of slots between ranks of comm (request migration,
 * prefill/decode transfer): the sender's pages (packed bytes and conv
 * state, as stored, and each slot's health word, as stepq_pool_copy()
 * carries them) land in the receiver's slots, in list order. send and recv
 * may both be given (a rank that sends and receives at once, or one rank
 * moving pages between two of its pools: peer = its own rank), or one of
 * them NULL.
 *
 * The exchange, in three NCCL groups: the sender's STEPQ_TP_MSG_HEADER_BYTES
 * header (stepq_tp_msg_encode(): its page fingerprint, slot count, page
 * bytes); the receiver's STEPQ_TP_REPLY_BYTES reply, "SQAK" then its
 * status as a little-endian int32 (0: accepted); then, only when accepted,
 * the slots' health words (slot count x uint32) and one message of
 * page_bytes per slot, device to device, received in place into the
 * slots' pages. The receiver refuses a header whose fingerprint or page
 * bytes are not its own, or whose slot count is not its list's, before
 * any page or health word is written, and both ends return that status
 * (the receiver's message says why; the sender's names the peer).
 *
 * Synchronous: enqueued on stream (a cudaStream_t of comm's device, NULL
 * the default stream) and waited for. Work writing the sender's slots must
 * be complete or ordered before stream (e.g. stream is the pool's stream),
 * and the slots must stay allocated and untouched by other work until the
 * call returns.
 *
 * @return STEPQ_OK; STEPQ_ESHAPE / STEPQ_EPARSE / STEPQ_EVERSION (the
 *         receiver refused the header: stepq_tp_msg_decode()'s statuses,
 *         ESHAPE also for a slot count that is not the receiver's);
 *         STEPQ_EINVAL (NULL, peer out of range, a slot not allocated, a
 *         repeated receiving slot, a slot both sent and received, the
 *         sentinel); STEPQ_EVERSION (a stepq_tp_slots header); STEPQ_ERANGE (a slot id
 *         out of range); STEPQ_ENOTSUP (a pool of the host backend);
 *         STEPQ_ETIMEDOUT; the mapped NCCL / CUDA errors; STEPQ_ENCCL
 *         (comm failed before). Argument errors return at once, before any
 *         NCCL call (the peer then times out).
 */
STEPQ_API int stepq_tp_exchange_slots(stepq_tp_comm_t *comm, const stepq_tp_slots *send,
                                      const stepq_tp_slots *recv, void *stream);

/** Bytes of the receiver's reply in stepq_tp_exchange_slots(). */
#define STEPQ_TP_REPLY_BYTES 8

/** stepq_tp_exchange_slots() with only a sending side. */
STEPQ_API int stepq_tp_send_slots(stepq_tp_comm_t *comm, stepq_pool_t *pool,
                                  uint64_t page_fingerprint, int peer, const int32_t *slot_ids,
                                  int32_t n, void *stream);

/** stepq_tp_exchange_slots() with only a receiving side. */
STEPQ_API int stepq_tp_recv_slots(stepq_tp_comm_t *comm, stepq_pool_t *pool,
                                  uint64_t page_fingerprint, int peer, const int32_t *slot_ids,
                                  int32_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_TP_H */
