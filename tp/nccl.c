/*
 * The NCCL transport of the TP layer (stepq/tp.h, "The NCCL transport"): a
 * communicator stepq owns or the host's, the fingerprint all-gather at pool
 * open and the packed-page exchange between ranks.
 *
 * Nothing here waits inside CUDA or NCCL: owned communicators are
 * non-blocking, host staging buffers are pinned (a copy to pageable memory
 * would block the host behind the NCCL kernel), and every wait polls the
 * stream, the communicator's asynchronous error and a deadline, so a dead
 * peer ends in STEPQ_ETIMEDOUT. The pool is reached through its public API
 * only (pages, health words, layout), as any server would.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "stepq_config.h"

#include "plugin/err.h"
#include "stepq/tp.h"

#if STEPQ_HAVE_NCCL

#include <cuda_runtime_api.h>
/* nccl.h declares ncclGroupStart() and a few others without (void). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#include "plugin/cuda_err.h"
#include "plugin/handle.h"
#include "tp/nccl_internal.h"
#include "tp/le.h"

_Static_assert(sizeof(ncclUniqueId) == STEPQ_TP_ID_BYTES, "stepq_tp_id holds an ncclUniqueId");

/*
 * How often a wait looks at the stream, the asynchronous error and the
 * clock: 100 us is short next to a page transfer (a 30 MB page takes about
 * 1 ms over NVLink) and long enough not to keep a core busy.
 */
#define POLL_NS 100000L

/* The pool-check record (tp/nccl_internal.h) travels as little-endian words. */
#define REC_BYTES (8 * STEPQ__TP_REC_WORDS)

/* The receiver's reply in an exchange: "SQAK", then its status (int32 LE). */
#define REPLY_MAGIC "SQAK"

struct stepq_tp_comm {
    struct stepq__handle_entry *entry;
    void *handle;
    ncclComm_t nccl; /* NULL once aborted, or for a detached communicator */
    int rank, size, device;
    int owned;
    uint32_t timeout_ms;
    int failed; /* the status that ended it; 0 while it works */
    char failure[STEPQ__ERRLEN];
    /* Staging for headers, replies, records and health words: device memory
     * NCCL moves, and pinned host memory the host reads and writes. */
    uint8_t *dev, *host;
    size_t cap;
};

int stepq__tp_nccl_status(int nccl_result)
{
    switch ((ncclResult_t)nccl_result) {
    case ncclSuccess:
        return STEPQ_OK;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
        return STEPQ_EINVAL;
    case ncclSystemError:
    case ncclRemoteError:
        return STEPQ_EIO;
    case ncclUnhandledCudaError:
        return STEPQ_ECUDA;
    case ncclInProgress:
        return STEPQ_EBUSY;
    default:
        return STEPQ_ENCCL;
    }
}

/* --- time --- */

static uint64_t now_ms(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u;
}

static void poll_pause(void)
{
    const struct timespec t = { 0, POLL_NS };

    nanosleep(&t, NULL);
}

/* --- failures --- */

/* Ends the communicator: later calls refuse; stepq's own is aborted. */
static void comm_fail(struct stepq_tp_comm *c, int status)
{
    if (!c->failed) {
        c->failed = status;
        memcpy(c->failure, stepq_last_error(), sizeof(c->failure));
    }
    if (c->owned && c->nccl) {
        (void)ncclCommAbort(c->nccl);
        c->nccl = NULL;
    }
}

static int nccl_fail(struct stepq_tp_comm *c, ncclResult_t r, const char *what)
{
    const int status = stepq__tp_nccl_status(r);
    const char *detail = ncclGetLastError(c ? c->nccl : NULL);

    stepq__error(status, "%s: %s%s%s", what, ncclGetErrorString(r), detail && *detail ? ": " : "",
                 detail ? detail : "");
    if (c)
        comm_fail(c, status);
    return status;
}

static int timed_out(struct stepq_tp_comm *c, const char *what)
{
    stepq__error(STEPQ_ETIMEDOUT,
                 "%s: not done after %" PRIu32 " ms (a peer failed or did not post its side); %s",
                 what, c->timeout_ms,
                 c->owned ? "the communicator was aborted"
                          : "the communicator is the host's: abort it (ncclCommAbort), its stream "
                            "holds NCCL work that will not finish");
    comm_fail(c, STEPQ_ETIMEDOUT);
    return STEPQ_ETIMEDOUT;
}

static int cuda_fail(struct stepq_tp_comm *c, cudaError_t e, const char *what)
{
    const int status = stepq__cuda_error(NULL, (int)e, what);

    if (c)
        comm_fail(c, status);
    return status;
}

/* --- waits --- */

/* One look at the communicator's asynchronous state: a status for an error, 1 while an
 * operation is in progress, 0 when it is idle. */
static int poll_comm(struct stepq_tp_comm *c, const char *what)
{
    ncclResult_t a = ncclSuccess, r = ncclCommGetAsyncError(c->nccl, &a);

    if (r != ncclSuccess)
        return nccl_fail(c, r, what);
    if (a != ncclSuccess && a != ncclInProgress)
        return nccl_fail(c, a, what);
    return a == ncclInProgress;
}

/* The communicator's state, polled until it leaves ncclInProgress. */
static int wait_ready(struct stepq_tp_comm *c, uint64_t deadline, const char *what)
{
    for (;;) {
        int busy = poll_comm(c, what);

        if (busy <= 0)
            return busy;
        if (now_ms() > deadline)
            return timed_out(c, what);
        poll_pause();
    }
}

/* The stream, polled until its work is done, watching the communicator. */
static int wait_stream(struct stepq_tp_comm *c, cudaStream_t stream, uint64_t deadline,
                       const char *what)
{
    for (;;) {
        cudaError_t e = cudaStreamQuery(stream);
        int busy;

        if (e == cudaSuccess)
            return STEPQ_OK;
        if (e != cudaErrorNotReady)
            return cuda_fail(c, e, what);
        if ((busy = poll_comm(c, what)) < 0)
            return busy;
        if (now_ms() > deadline)
            return timed_out(c, what);
        poll_pause();
    }
}

/* Ends a group whose calls returned first (the group is closed whatever they returned). */
static int group_end(struct stepq_tp_comm *c, ncclResult_t first, uint64_t deadline,
                     const char *what)
{
    ncclResult_t r = ncclGroupEnd();

    if (first != ncclSuccess && first != ncclInProgress)
        return nccl_fail(c, first, what);
    if (r == ncclInProgress)
        return wait_ready(c, deadline, what);
    if (r != ncclSuccess)
        return nccl_fail(c, r, what);
    return STEPQ_OK;
}

/* Keeps the first failing result of the calls in a group. */
static void keep(ncclResult_t *first, ncclResult_t r)
{
    if ((*first == ncclSuccess || *first == ncclInProgress) && r != ncclSuccess)
        *first = r;
}

/* --- the communicator handle --- */

static int check_config(const stepq_tp_comm_config *user, stepq_tp_comm_config *cfg)
{
    static const stepq_tp_comm_config defaults = STEPQ_TP_COMM_CONFIG_INITIALIZER;
    static const size_t ends[] = { STEPQ__FIELD_END(stepq_tp_comm_config, timeout_ms) };
    int ret;

    if (!user) {
        *cfg = defaults;
    } else if ((ret = stepq__config_import(cfg, &defaults, sizeof(*cfg), user, ends,
                                           STEPQ_TP_COMM_CONFIG_VERSION, "stepq_tp_comm_config")) <
               0) {
        return ret;
    }
    if (cfg->timeout_ms == 0)
        cfg->timeout_ms = STEPQ_TP_TIMEOUT_MS_DEFAULT;
    return STEPQ_OK;
}

static int check_rank(const char *fn, int rank, int size)
{
    if (size < 1)
        return stepq__error(STEPQ_EINVAL, "%s: size %d, a communicator has at least 1 rank", fn,
                            size);
    if (rank < 0 || rank >= size)
        return stepq__error(STEPQ_EINVAL, "%s: rank %d is not in 0..%d", fn, rank, size - 1);
    return STEPQ_OK;
}

static int comm_new(int rank, int size, int device, uint32_t timeout_ms, int owned,
                    struct stepq_tp_comm **out)
{
    struct stepq_tp_comm *c = calloc(1, sizeof(*c));
    int ret;

    *out = NULL;
    if (!c)
        return stepq__error(STEPQ_ENOMEM, "stepq_tp_comm: out of memory");
    c->rank = rank;
    c->size = size;
    c->device = device;
    c->owned = owned;
    c->timeout_ms = timeout_ms;
    if ((ret = stepq__handle_add(c, STEPQ__HANDLE_TP_COMM, &c->handle, &c->entry, NULL)) < 0) {
        free(c);
        return stepq__error(ret, "stepq_tp_comm: out of memory (handle table)");
    }
    *out = c;
    return STEPQ_OK;
}

static void comm_free(struct stepq_tp_comm *c)
{
    if (c->dev)
        (void)cudaFree(c->dev);
    if (c->host)
        (void)cudaFreeHost(c->host);
    (void)cudaGetLastError();
    stepq__handle_drop(c->entry);
    free(c);
}

/* The communicator of a handle, usable: STEPQ_EBADF closed, STEPQ_ENCCL failed before. */
static int comm_get(stepq_tp_comm_t *h, const char *fn, struct stepq_tp_comm **out)
{
    struct stepq_tp_comm *c;

    *out = NULL;
    if (!h)
        return stepq__error(STEPQ_EINVAL, "%s: comm is NULL", fn);
    c = stepq__handle_get(h, STEPQ__HANDLE_TP_COMM);
    if (!c)
        return stepq__error(STEPQ_EBADF, "%s: communicator handle is closed or not valid", fn);
    if (c->failed)
        return stepq__error(STEPQ_ENCCL,
                            "%s: the communicator failed before (%s: %s); close it and make "
                            "another",
                            fn, stepq_status_name(c->failed), c->failure);
    *out = c;
    return STEPQ_OK;
}

/* Makes comm's device current (*prev: the caller's). */
static int device_enter(struct stepq_tp_comm *c, int *prev)
{
    cudaError_t e = cudaGetDevice(prev);

    if (e != cudaSuccess)
        return cuda_fail(NULL, e, "cudaGetDevice");
    if (*prev != c->device && (e = cudaSetDevice(c->device)) != cudaSuccess)
        return cuda_fail(NULL, e, "cudaSetDevice");
    return STEPQ_OK;
}

static void device_leave(struct stepq_tp_comm *c, int prev)
{
    if (prev != c->device)
        (void)cudaSetDevice(prev);
}

/* At least bytes of staging, device and pinned host (no work uses the old ones: calls wait). */
static int staging(struct stepq_tp_comm *c, size_t bytes)
{
    cudaError_t e;

    if (bytes <= c->cap)
        return STEPQ_OK;
    if (c->dev)
        (void)cudaFree(c->dev);
    if (c->host)
        (void)cudaFreeHost(c->host);
    c->dev = c->host = NULL;
    c->cap = 0;
    if ((e = cudaMalloc((void **)&c->dev, bytes)) != cudaSuccess)
        return cuda_fail(NULL, e, "cudaMalloc(tp staging)");
    if ((e = cudaMallocHost((void **)&c->host, bytes)) != cudaSuccess) {
        (void)cudaFree(c->dev);
        c->dev = NULL;
        return cuda_fail(NULL, e, "cudaMallocHost(tp staging)");
    }
    c->cap = bytes;
    return STEPQ_OK;
}

int stepq__tp_comm_detached(int rank, int size, stepq_tp_comm_t **out)
{
    struct stepq_tp_comm *c;
    int ret;

    if (!out)
        return stepq__error(STEPQ_EINVAL, "stepq__tp_comm_detached: out is NULL");
    *out = NULL;
    if ((ret = check_rank("stepq__tp_comm_detached", rank, size)) < 0)
        return ret;
    if ((ret = comm_new(rank, size, 0, STEPQ_TP_TIMEOUT_MS_DEFAULT, 0, &c)) < 0)
        return ret;
    *out = c->handle;
    return STEPQ_OK;
}

int stepq_tp_unique_id(stepq_tp_id *out)
{
    ncclUniqueId id;
    ncclResult_t r;

    if (!out)
        return stepq__error(STEPQ_EINVAL, "stepq_tp_unique_id: out is NULL");
    if ((r = ncclGetUniqueId(&id)) != ncclSuccess)
        return nccl_fail(NULL, r, "stepq_tp_unique_id: ncclGetUniqueId");
    memcpy(out->bytes, id.internal, sizeof(out->bytes));
    return STEPQ_OK;
}

int stepq_tp_comm_init(const stepq_tp_id *id, int rank, int size, const stepq_tp_comm_config *user,
                       stepq_tp_comm_t **out)
{
    static const char fn[] = "stepq_tp_comm_init";
    ncclConfig_t nc = NCCL_CONFIG_INITIALIZER;
    stepq_tp_comm_config cfg;
    struct stepq_tp_comm *c;
    ncclUniqueId uid;
    ncclResult_t r;
    int count = 0, prev = 0, ret;
    cudaError_t e;
    uint64_t deadline;

    if (!out)
        return stepq__error(STEPQ_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    if (!id)
        return stepq__error(STEPQ_EINVAL, "%s: id is NULL", fn);
    if ((ret = check_rank(fn, rank, size)) < 0 || (ret = check_config(user, &cfg)) < 0)
        return ret;
    e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        return stepq__error(STEPQ_ENODEV, "%s: no CUDA device: %s", fn,
                            e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
    }
    if (cfg.device < 0 || cfg.device >= count)
        return stepq__error(STEPQ_ENODEV,
                            "%s: stepq_tp_comm_config.device %d: this machine has devices 0..%d",
                            fn, cfg.device, count - 1);
    if ((ret = comm_new(rank, size, cfg.device, cfg.timeout_ms, 1, &c)) < 0)
        return ret;
    deadline = now_ms() + cfg.timeout_ms;
    if ((ret = device_enter(c, &prev)) < 0) {
        comm_free(c);
        return ret;
    }
    memcpy(uid.internal, id->bytes, sizeof(uid.internal));
    nc.blocking = 0; /* so that a rank that never joins can be aborted */
    r = ncclCommInitRankConfig(&c->nccl, size, uid, rank, &nc);
    if (r != ncclSuccess && r != ncclInProgress)
        ret = nccl_fail(c, r, "stepq_tp_comm_init: ncclCommInitRankConfig");
    else if (c->nccl)
        ret = wait_ready(c, deadline, "stepq_tp_comm_init: waiting for every rank to join");
    else
        ret = stepq__error(STEPQ_EINTERNAL, "%s: ncclCommInitRankConfig gave no communicator", fn);
    device_leave(c, prev);
    if (ret < 0) {
        comm_fail(c, ret);
        comm_free(c);
        return ret;
    }
    *out = c->handle;
    return STEPQ_OK;
}

int stepq_tp_comm_wrap(void *nccl_comm, int rank, int size, const stepq_tp_comm_config *user,
                       stepq_tp_comm_t **out)
{
    static const char fn[] = "stepq_tp_comm_wrap";
    const ncclComm_t nc = nccl_comm;
    stepq_tp_comm_config cfg;
    struct stepq_tp_comm *c;
    int n = 0, me = 0, dev = 0, ret;
    ncclResult_t r;

    if (!out)
        return stepq__error(STEPQ_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    if (!nccl_comm)
        return stepq__error(STEPQ_EINVAL, "%s: nccl_comm is NULL", fn);
    if ((ret = check_rank(fn, rank, size)) < 0 || (ret = check_config(user, &cfg)) < 0)
        return ret;
    if ((r = ncclCommCount(nc, &n)) != ncclSuccess ||
        (r = ncclCommUserRank(nc, &me)) != ncclSuccess ||
        (r = ncclCommCuDevice(nc, &dev)) != ncclSuccess)
        return nccl_fail(NULL, r, "stepq_tp_comm_wrap: querying the communicator");
    if (n != size || me != rank)
        return stepq__error(STEPQ_EINVAL,
                            "%s: the communicator is rank %d of %d, not rank %d of %d (another "
                            "group's communicator?)",
                            fn, me, n, rank, size);
    if ((ret = comm_new(rank, size, dev, cfg.timeout_ms, 0, &c)) < 0)
        return ret;
    c->nccl = nc;
    *out = c->handle;
    return STEPQ_OK;
}

int stepq_tp_comm_close(stepq_tp_comm_t *h)
{
    struct stepq_tp_comm *c;
    int prev = 0, ret = STEPQ_OK;

    if (!h)
        return STEPQ_OK;
    c = stepq__handle_get(h, STEPQ__HANDLE_TP_COMM);
    if (!c)
        return stepq__error(STEPQ_EBADF,
                            "stepq_tp_comm_close: communicator handle is closed or not valid");
    if (c->owned && c->nccl && (ret = device_enter(c, &prev)) >= 0) {
        const uint64_t deadline = now_ms() + c->timeout_ms;
        ncclResult_t r = ncclCommFinalize(c->nccl);

        if (r == ncclInProgress)
            ret = wait_ready(c, deadline, "stepq_tp_comm_close: ncclCommFinalize");
        else if (r != ncclSuccess)
            ret = nccl_fail(c, r, "stepq_tp_comm_close: ncclCommFinalize");
        /* Finalized, the destroy only frees local resources (ncclInProgress is not a failure). */
        if (c->nccl && ret >= 0 && (r = ncclCommDestroy(c->nccl)) != ncclSuccess &&
            r != ncclInProgress)
            ret = nccl_fail(c, r, "stepq_tp_comm_close: ncclCommDestroy");
        c->nccl = NULL;
        device_leave(c, prev);
    }
    if (c->owned && c->nccl) { /* the device could not be entered */
        (void)ncclCommAbort(c->nccl);
        c->nccl = NULL;
    }
    comm_free(c);
    return ret;
}

/* --- pools --- */

/*
 * The pool's pages and health words, which must be device memory of comm's
 * device: a pool of the host backend is refused (NCCL moves device memory).
 */
static int pool_memory(struct stepq_tp_comm *c, stepq_pool_t *pool, const char *fn, uint8_t **pages,
                       uint32_t **health, uint64_t *page_bytes, uint64_t *slots)
{
    stepq_pool_buffer_info b[2];
    struct cudaPointerAttributes attr;
    const stepq_pool_layout *l;
    int count = 0, ret;
    cudaError_t e;

    *pages = NULL;
    *slots = 0;
    if ((ret = stepq_pool_buffer_infos(pool, b, 2, &count)) < 0 ||
        (ret = stepq_pool_health_words(pool, health)) < 0 ||
        (ret = stepq_pool_get_layout(pool, &l)) < 0)
        return stepq__error(ret, "%s: %s", fn, stepq_last_error());
    for (int i = 0; i < count; i++)
        if (!strcmp(b[i].name, "pages")) {
            *pages = b[i].ptr;
            *slots = b[i].bytes / b[i].item_bytes - 1; /* the sentinel's page is not a slot */
        }
    *page_bytes = l->page_bytes;
    memset(&attr, 0, sizeof(attr));
    e = cudaPointerGetAttributes(&attr, *pages);
    if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
        (void)cudaGetLastError();
        return stepq__error(STEPQ_ENOTSUP,
                            "%s: the pool's pages at %p are not device memory (%s): NCCL moves "
                            "device memory; open the pool with STEPQ_POOL_BACKEND_CUDA",
                            fn, (void *)*pages,
                            e != cudaSuccess ? cudaGetErrorString(e) : "a host backend pool");
    }
    if (attr.device != c->device)
        return stepq__error(STEPQ_EINVAL,
                            "%s: the pool is on device %d, the communicator on device %d", fn,
                            attr.device, c->device);
    return STEPQ_OK;
}

/* This rank's record: what it checked about its own cfg and pool, then its numbers. */
static void own_record(struct stepq_tp_comm *c, const stepq_pool_config *cfg, uint64_t page_bytes,
                       uint64_t slots, uint64_t *w, char *why)
{
    stepq_tp_fingerprint_info fp;
    stepq_tp_plan_info plan;
    int ret;

    memset(w, 0, REC_BYTES);
    w[STEPQ__TP_REC_TAG] = STEPQ__TP_REC_TAG_V1;
    w[STEPQ__TP_REC_VERSION] = STEPQ_VERSION_NUMBER;
    w[STEPQ__TP_REC_PAGE_BYTES] = page_bytes;
    why[0] = 0;
    w[STEPQ__TP_REC_SLOTS] = slots;
    if ((ret = stepq_tp_fingerprint(cfg, &fp, sizeof(fp))) < 0 ||
        (ret = stepq_tp_plan(cfg, &plan, sizeof(plan))) < 0) {
        snprintf(why, STEPQ__ERRLEN, "%s", stepq_last_error());
        w[STEPQ__TP_REC_STATUS] = (uint64_t)(int64_t)ret;
        return;
    }
    w[STEPQ__TP_REC_TP_SIZE] = (uint64_t)plan.tp_size;
    w[STEPQ__TP_REC_TP_RANK] = (uint64_t)plan.tp_rank;
    w[STEPQ__TP_REC_MAP] = fp.map;
    w[STEPQ__TP_REC_GROUP] = fp.group;
    w[STEPQ__TP_REC_PAGE] = fp.page;
    if (plan.tp_size != c->size || plan.tp_rank != c->rank)
        ret = snprintf(why, STEPQ__ERRLEN,
                       "its stepq_pool_config is tp_rank %d of tp_size %d, its communicator "
                       "rank %d of %d",
                       plan.tp_rank, plan.tp_size, c->rank, c->size);
    else if (plan.page_bytes != page_bytes)
        ret = snprintf(why, STEPQ__ERRLEN,
                       "its pool's page is %" PRIu64 " B where its stepq_pool_config plans %" PRIu64
                       " B (open the pool with min_page_bytes from stepq_tp_plan(), and pass "
                       "the same config)",
                       page_bytes, plan.page_bytes);
    else
        ret = 0;
    if (ret)
        w[STEPQ__TP_REC_STATUS] = (uint64_t)(int64_t)STEPQ_ESHAPE;
}

/* Every rank judges the same records alike: rank 0 is the reference. */
int stepq__tp_pool_verdict(const uint64_t *rec, int size, int me, const char *own_why)
{
    static const char fn[] = "stepq_tp_check_pools";
    const uint64_t *r0 = rec;

    for (int k = 0; k < size; k++) {
        const uint64_t *w = rec + (size_t)k * STEPQ__TP_REC_WORDS;
        const int st = (int)(int64_t)w[STEPQ__TP_REC_STATUS];

        if (w[STEPQ__TP_REC_TAG] != STEPQ__TP_REC_TAG_V1)
            return stepq__error(STEPQ_EVERSION,
                                "%s: rank %d sent a record tagged %016" PRIx64
                                " (another stepq build?)",
                                fn, k, w[STEPQ__TP_REC_TAG]);
        if (st < 0)
            return stepq__error(st, "%s: rank %d cannot take part: %s: %s", fn, k,
                                stepq_status_name(st),
                                k == me ? own_why : "its own error says why");
    }
    for (int k = 1; k < size; k++) {
        const uint64_t *w = rec + (size_t)k * STEPQ__TP_REC_WORDS;

        if (w[STEPQ__TP_REC_VERSION] != r0[STEPQ__TP_REC_VERSION])
            return stepq__error(STEPQ_EVERSION,
                                "%s: rank %d runs stepq version %" PRIu64 ", rank 0 %" PRIu64, fn,
                                k, w[STEPQ__TP_REC_VERSION], r0[STEPQ__TP_REC_VERSION]);
        if (w[STEPQ__TP_REC_MAP] != r0[STEPQ__TP_REC_MAP])
            return stepq__error(STEPQ_ESHAPE,
                                "%s: rank %d's map differs from rank 0's (map fingerprint "
                                "%016" PRIx64 ", rank 0 %016" PRIx64 ")",
                                fn, k, w[STEPQ__TP_REC_MAP], r0[STEPQ__TP_REC_MAP]);
        if (w[STEPQ__TP_REC_TP_SIZE] != r0[STEPQ__TP_REC_TP_SIZE])
            return stepq__error(STEPQ_ESHAPE,
                                "%s: rank %d has tp_size %" PRIu64 ", rank 0 %" PRIu64, fn, k,
                                w[STEPQ__TP_REC_TP_SIZE], r0[STEPQ__TP_REC_TP_SIZE]);
        if (w[STEPQ__TP_REC_GROUP] != r0[STEPQ__TP_REC_GROUP])
            return stepq__error(STEPQ_ESHAPE,
                                "%s: rank %d's page layout differs from rank 0's with the same map "
                                "and tp_size (another page_align, block_align or min_page_bytes: "
                                "group fingerprint %016" PRIx64 ", rank 0 %016" PRIx64 ")",
                                fn, k, w[STEPQ__TP_REC_GROUP], r0[STEPQ__TP_REC_GROUP]);
        if (w[STEPQ__TP_REC_PAGE_BYTES] != r0[STEPQ__TP_REC_PAGE_BYTES])
            return stepq__error(STEPQ_ESHAPE,
                                "%s: rank %d's pages are %" PRIu64 " B, rank 0's %" PRIu64 " B", fn,
                                k, w[STEPQ__TP_REC_PAGE_BYTES], r0[STEPQ__TP_REC_PAGE_BYTES]);
        if (w[STEPQ__TP_REC_SLOTS] != r0[STEPQ__TP_REC_SLOTS])
            return stepq__error(STEPQ_ESHAPE,
                                "%s: rank %d's pool has %" PRIu64 " slots, rank 0's %" PRIu64
                                " (size every rank's pool alike, so slot ids agree)",
                                fn, k, w[STEPQ__TP_REC_SLOTS], r0[STEPQ__TP_REC_SLOTS]);
    }
    return STEPQ_OK;
}

int stepq_tp_check_pools(stepq_tp_comm_t *h, const stepq_pool_config *cfg, stepq_pool_t *pool,
                         void *stream_)
{
    static const char fn[] = "stepq_tp_check_pools";
    const cudaStream_t stream = stream_;
    struct stepq_tp_comm *c;
    uint64_t w[STEPQ__TP_REC_WORDS], *rec = NULL, page_bytes = 0, slots = 0, deadline;
    char why[STEPQ__ERRLEN];
    uint8_t *pages;
    uint32_t *health;
    ncclResult_t first = ncclSuccess;
    int prev = 0, ret;
    cudaError_t e;

    if ((ret = comm_get(h, fn, &c)) < 0)
        return ret;
    if (!cfg || !pool)
        return stepq__error(STEPQ_EINVAL, "%s: %s is NULL", fn, cfg ? "pool" : "cfg");
    if ((ret = pool_memory(c, pool, fn, &pages, &health, &page_bytes, &slots)) < 0)
        return ret;
    if (!c->nccl)
        return stepq__error(STEPQ_EINVAL, "%s: the communicator has no NCCL communicator", fn);
    deadline = now_ms() + c->timeout_ms;
    own_record(c, cfg, page_bytes, slots, w, why);
    rec = malloc(REC_BYTES * (size_t)c->size);
    if (!rec)
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory (%d records)", fn, c->size);
    if ((ret = device_enter(c, &prev)) < 0)
        goto out_free;
    if ((ret = staging(c, REC_BYTES * ((size_t)c->size + 1))) < 0)
        goto out;
    for (int i = 0; i < STEPQ__TP_REC_WORDS; i++)
        stepq__le_put(c->host + 8 * i, w[i], 8);
    e = cudaMemcpyAsync(c->dev, c->host, REC_BYTES, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) {
        ret = cuda_fail(c, e, "stepq_tp_check_pools: cudaMemcpyAsync(record)");
        goto out;
    }
    (void)ncclGroupStart();
    keep(&first, ncclAllGather(c->dev, c->dev + REC_BYTES, REC_BYTES, ncclUint8, c->nccl, stream));
    if ((ret = group_end(c, first, deadline, "stepq_tp_check_pools: ncclAllGather")) < 0)
        goto out;
    e = cudaMemcpyAsync(c->host + REC_BYTES, c->dev + REC_BYTES, REC_BYTES * (size_t)c->size,
                        cudaMemcpyDeviceToHost, stream);
    if (e != cudaSuccess) {
        ret = cuda_fail(c, e, "stepq_tp_check_pools: cudaMemcpyAsync(records)");
        goto out;
    }
    if ((ret = wait_stream(c, stream, deadline, "stepq_tp_check_pools: the all-gather")) < 0)
        goto out;
    for (size_t i = 0; i < (size_t)c->size * STEPQ__TP_REC_WORDS; i++)
        rec[i] = stepq__le_get(c->host + REC_BYTES + 8 * i, 8);
    ret = stepq__tp_pool_verdict(rec, c->size, c->rank, why);
out:
    device_leave(c, prev);
out_free:
    free(rec);
    return ret;
}

/* --- page exchange --- */

/* One side of an exchange, checked. */
struct side {
    stepq_tp_slots args;     /* the caller's, completed with the defaults */
    const stepq_tp_slots *s; /* &args */
    uint8_t *pages;
    uint32_t *health;
    uint64_t page_bytes;
    int32_t *ids;    /* the slots without the -1 entries */
    int32_t *sorted; /* receiving: ids in ascending order */
    int32_t n;
};

static int cmp_i32(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;

    return (x > y) - (x < y);
}

static int check_side(struct stepq_tp_comm *c, const stepq_tp_slots *user, int receiving,
                      struct side *out)
{
    static const stepq_tp_slots defaults = STEPQ_TP_SLOTS_INITIALIZER;
    static const size_t ends[] = { STEPQ__FIELD_END(stepq_tp_slots, n) };
    const char *fn =
        receiving ? "stepq_tp_exchange_slots (recv)" : "stepq_tp_exchange_slots (send)";
    const stepq_tp_slots *s = &out->args;
    uint64_t slots;
    int ret;

    memset(out, 0, sizeof(*out));
    out->s = s;
    if ((ret = stepq__config_import(&out->args, &defaults, sizeof(out->args), user, ends,
                                    STEPQ_TP_SLOTS_VERSION, "stepq_tp_slots")) < 0)
        return ret;
    if (!s->pool)
        return stepq__error(STEPQ_EINVAL, "%s: pool is NULL", fn);
    if (s->peer < 0 || s->peer >= c->size)
        return stepq__error(STEPQ_EINVAL, "%s: peer %d is not in 0..%d", fn, s->peer, c->size - 1);
    if (s->n < 0 || (s->n > 0 && !s->slot_ids))
        return stepq__error(STEPQ_EINVAL, "%s: %" PRId32 " slots at %p", fn, s->n,
                            (const void *)s->slot_ids);
    if ((ret = pool_memory(c, s->pool, fn, &out->pages, &out->health, &out->page_bytes, &slots)) <
        0)
        return ret;
    out->ids = malloc(sizeof(int32_t) * ((size_t)s->n + 1));
    if (!out->ids)
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory (%" PRId32 " slot ids)", fn, s->n);
    for (int32_t i = 0; i < s->n; i++) {
        const int32_t id = s->slot_ids[i];

        if (id == STEPQ_POOL_SLOT_PAD)
            continue;
        if (id == STEPQ_POOL_SLOT_SENTINEL)
            return stepq__error(STEPQ_EINVAL, "%s: slot_ids[%" PRId32 "] is the sentinel slot 0",
                                fn, i);
        ret = stepq_pool_is_allocated(s->pool, id);
        if (ret < 0)
            return stepq__error(ret, "%s: slot_ids[%" PRId32 "]: %s", fn, i, stepq_last_error());
        if (!ret)
            return stepq__error(STEPQ_EINVAL,
                                "%s: slot_ids[%" PRId32 "] = %" PRId32 " is not allocated", fn, i,
                                id);
        out->ids[out->n++] = id;
    }
    if (receiving) {
        out->sorted = malloc(sizeof(int32_t) * ((size_t)out->n + 1));
        if (!out->sorted)
            return stepq__error(STEPQ_ENOMEM, "%s: out of memory", fn);
        memcpy(out->sorted, out->ids, sizeof(int32_t) * (size_t)out->n);
        qsort(out->sorted, (size_t)out->n, sizeof(int32_t), cmp_i32);
        for (int32_t i = 1; i < out->n; i++)
            if (out->sorted[i] == out->sorted[i - 1])
                return stepq__error(STEPQ_EINVAL,
                                    "%s: slot %" PRId32
                                    " is listed twice (it would receive two pages)",
                                    fn, out->sorted[i]);
    }
    return STEPQ_OK;
}

/* Staging offsets of an exchange: fixed slots for the small messages, then health words. */
enum {
    ST_SEND_HDR = 0,
    ST_RECV_HDR = 64,
    ST_SEND_REPLY = 128,
    ST_RECV_REPLY = 192,
    ST_HEALTH = 256,
};

/* Enqueues n 4-byte copies between health words and the staging (runs of slots coalesced). */
static cudaError_t copy_health(uint32_t *health, const int32_t *ids, int32_t n, uint8_t *stage,
                               int to_stage, cudaStream_t stream)
{
    for (int32_t i = 0; i < n;) {
        int32_t k = 1;
        cudaError_t e;

        while (i + k < n && ids[i + k] == ids[i] + k)
            k++;
        e = to_stage ? cudaMemcpyAsync(stage + 4 * (size_t)i, health + ids[i], 4 * (size_t)k,
                                       cudaMemcpyDeviceToDevice, stream)
                     : cudaMemcpyAsync(health + ids[i], stage + 4 * (size_t)i, 4 * (size_t)k,
                                       cudaMemcpyDeviceToDevice, stream);
        if (e != cudaSuccess)
            return e;
        i += k;
    }
    return cudaSuccess;
}

/*
 * One exchange in its three phases (stepq/tp.h): headers, replies, then,
 * where the receiver accepted, health words and pages. snd / rcv may be
 * NULL. refused is the receiver's verdict (0, or the status it refused
 * with; why its text), peer_refused what the sender's peer replied.
 */
struct xfer {
    struct stepq_tp_comm *c;
    struct side *snd, *rcv;
    cudaStream_t stream;
    uint64_t deadline;
    size_t health_recv; /* staging offset of the received health words */
    int refused, peer_refused;
    char why[STEPQ__ERRLEN];
};

/*
 * One small message each way on the stream, through the staging buffers: host bytes at
 * send_off go to send_peer and recv_peer's arrive at recv_off on the host (a peer < 0:
 * that direction is not used). The phases before any page moves are made of these.
 */
static int swap_small(struct xfer *x, size_t send_off, int send_peer, size_t recv_off,
                      int recv_peer, size_t bytes, const char *what)
{
    struct stepq_tp_comm *c = x->c;
    ncclResult_t first = ncclSuccess;
    cudaError_t e;
    int ret;

    if (send_peer >= 0 && (e = cudaMemcpyAsync(c->dev + send_off, c->host + send_off, bytes,
                                               cudaMemcpyHostToDevice, x->stream)) != cudaSuccess)
        return cuda_fail(c, e, what);
    (void)ncclGroupStart();
    if (send_peer >= 0)
        keep(&first, ncclSend(c->dev + send_off, bytes, ncclUint8, send_peer, c->nccl, x->stream));
    if (recv_peer >= 0)
        keep(&first, ncclRecv(c->dev + recv_off, bytes, ncclUint8, recv_peer, c->nccl, x->stream));
    if ((ret = group_end(c, first, x->deadline, what)) < 0)
        return ret;
    if (recv_peer >= 0 && (e = cudaMemcpyAsync(c->host + recv_off, c->dev + recv_off, bytes,
                                               cudaMemcpyDeviceToHost, x->stream)) != cudaSuccess)
        return cuda_fail(c, e, what);
    return wait_stream(c, x->stream, x->deadline, what);
}

/* 1: the sender's header (and its health words staged); the receiver reads its own. */
static int xfer_headers(struct xfer *x)
{
    struct stepq_tp_comm *c = x->c;
    int ret;

    if (x->snd) {
        stepq_tp_msg_header h = { 0 };
        cudaError_t e;

        h.fingerprint = x->snd->s->page_fingerprint;
        h.slot_count = (uint32_t)x->snd->n;
        h.page_bytes = x->snd->page_bytes;
        if ((ret = stepq_tp_msg_encode(&h, c->host + ST_SEND_HDR, STEPQ_TP_MSG_HEADER_BYTES)) < 0)
            return ret;
        e = copy_health(x->snd->health, x->snd->ids, x->snd->n, c->dev + ST_HEALTH, 1, x->stream);
        if (e != cudaSuccess)
            return cuda_fail(c, e, "stepq_tp_exchange_slots: staging the health words");
    }
    return swap_small(x, ST_SEND_HDR, x->snd ? x->snd->s->peer : -1, ST_RECV_HDR,
                      x->rcv ? x->rcv->s->peer : -1, STEPQ_TP_MSG_HEADER_BYTES,
                      "stepq_tp_exchange_slots: the header");
}

/* 2: the receiver judges the header and replies, before any page moves. */
static int xfer_replies(struct xfer *x)
{
    struct stepq_tp_comm *c = x->c;
    int ret;

    if (x->rcv) {
        stepq_tp_msg_header got;
        int v = stepq_tp_msg_decode(c->host + ST_RECV_HDR, STEPQ_TP_MSG_HEADER_BYTES,
                                    x->rcv->s->page_fingerprint, x->rcv->page_bytes, &got);

        if (v == STEPQ_OK && got.slot_count != (uint32_t)x->rcv->n)
            v = stepq__error(STEPQ_ESHAPE,
                             "page message: %" PRIu32 " pages, this receiver lists %" PRId32
                             " slots",
                             got.slot_count, x->rcv->n);
        if (v < 0) {
            x->refused = v;
            snprintf(x->why, sizeof(x->why), "%s", stepq_last_error());
        }
        memcpy(c->host + ST_SEND_REPLY, REPLY_MAGIC, 4);
        stepq__le_put(c->host + ST_SEND_REPLY + 4, (uint64_t)(uint32_t)v, 4);
    }
    if ((ret = swap_small(x, ST_SEND_REPLY, x->rcv ? x->rcv->s->peer : -1, ST_RECV_REPLY,
                          x->snd ? x->snd->s->peer : -1, STEPQ_TP_REPLY_BYTES,
                          "stepq_tp_exchange_slots: the reply")) < 0)
        return ret;
    if (!x->snd)
        return STEPQ_OK;
    if (memcmp(c->host + ST_RECV_REPLY, REPLY_MAGIC, 4))
        return stepq__error(STEPQ_EPARSE, "stepq_tp_exchange_slots: rank %d's reply is not \"%s\"",
                            x->snd->s->peer, REPLY_MAGIC);
    x->peer_refused = (int)(int32_t)(uint32_t)stepq__le_get(c->host + ST_RECV_REPLY + 4, 4);
    if (x->peer_refused > 0)
        return stepq__error(STEPQ_EPARSE,
                            "stepq_tp_exchange_slots: rank %d replied %d, not a status",
                            x->snd->s->peer, x->peer_refused);
    return STEPQ_OK;
}

/* 3: health words and pages where the receiver accepted them, then the receiver's health. */
static int xfer_pages(struct xfer *x)
{
    struct stepq_tp_comm *c = x->c;
    const struct side *snd = x->snd && x->peer_refused == 0 && x->snd->n > 0 ? x->snd : NULL;
    const struct side *rcv = x->rcv && x->refused == 0 && x->rcv->n > 0 ? x->rcv : NULL;
    ncclResult_t first = ncclSuccess;
    cudaError_t e;
    int ret;

    if (!snd && !rcv)
        return STEPQ_OK;
    (void)ncclGroupStart();
    if (snd) {
        keep(&first, ncclSend(c->dev + ST_HEALTH, 4 * (size_t)snd->n, ncclUint8, snd->s->peer,
                              c->nccl, x->stream));
        for (int32_t i = 0; i < snd->n; i++)
            keep(&first, ncclSend(snd->pages + (size_t)snd->ids[i] * snd->page_bytes,
                                  snd->page_bytes, ncclUint8, snd->s->peer, c->nccl, x->stream));
    }
    if (rcv) {
        keep(&first, ncclRecv(c->dev + x->health_recv, 4 * (size_t)rcv->n, ncclUint8, rcv->s->peer,
                              c->nccl, x->stream));
        for (int32_t i = 0; i < rcv->n; i++)
            keep(&first, ncclRecv(rcv->pages + (size_t)rcv->ids[i] * rcv->page_bytes,
                                  rcv->page_bytes, ncclUint8, rcv->s->peer, c->nccl, x->stream));
    }
    if ((ret = group_end(c, first, x->deadline, "stepq_tp_exchange_slots: the pages")) < 0)
        return ret;
    if (rcv && (e = copy_health(rcv->health, rcv->ids, rcv->n, c->dev + x->health_recv, 0,
                                x->stream)) != cudaSuccess)
        return cuda_fail(c, e, "stepq_tp_exchange_slots: writing the health words");
    return wait_stream(c, x->stream, x->deadline, "stepq_tp_exchange_slots: the pages");
}

static int exchange(struct xfer *x)
{
    int ret;

    x->health_recv = ST_HEALTH + 4 * (size_t)(x->snd ? x->snd->n : 0);
    if ((ret = staging(x->c, x->health_recv + 4 * (size_t)(x->rcv ? x->rcv->n : 0))) < 0 ||
        (ret = xfer_headers(x)) < 0 || (ret = xfer_replies(x)) < 0)
        return ret;
    return xfer_pages(x);
}

int stepq_tp_exchange_slots(stepq_tp_comm_t *h, const stepq_tp_slots *send,
                            const stepq_tp_slots *recv, void *stream)
{
    static const char fn[] = "stepq_tp_exchange_slots";
    struct side snd = { 0 }, rcv = { 0 };
    struct xfer x;
    struct stepq_tp_comm *c;
    int prev = 0, ret;
    uint64_t deadline;

    if ((ret = comm_get(h, fn, &c)) < 0)
        return ret;
    if (!send && !recv)
        return stepq__error(STEPQ_EINVAL, "%s: send and recv are both NULL", fn);
    deadline = now_ms() + c->timeout_ms;
    if ((send && (ret = check_side(c, send, 0, &snd)) < 0) ||
        (recv && (ret = check_side(c, recv, 1, &rcv)) < 0))
        goto out_free;
    /* A slot both sent and received would be read while it is written. */
    for (int32_t i = 0; send && recv && snd.s->pool == rcv.s->pool && i < snd.n; i++)
        if (bsearch(&snd.ids[i], rcv.sorted, (size_t)rcv.n, sizeof(int32_t), cmp_i32)) {
            ret = stepq__error(STEPQ_EINVAL, "%s: slot %" PRId32 " is both sent and received", fn,
                               snd.ids[i]);
            goto out_free;
        }
    if (!c->nccl) {
        ret = stepq__error(STEPQ_EINVAL, "%s: the communicator has no NCCL communicator", fn);
        goto out_free;
    }
    if ((ret = device_enter(c, &prev)) < 0)
        goto out_free;
    memset(&x, 0, sizeof(x));
    x.c = c;
    x.snd = send ? &snd : NULL;
    x.rcv = recv ? &rcv : NULL;
    x.stream = (cudaStream_t)stream;
    x.deadline = deadline;
    ret = exchange(&x);
    device_leave(c, prev);
    if (ret >= 0 && x.refused < 0)
        ret =
            stepq__error(x.refused, "%s: refused the pages of rank %d: %s", fn, rcv.s->peer, x.why);
    else if (ret >= 0 && x.peer_refused < 0)
        ret = stepq__error(x.peer_refused,
                           "%s: rank %d refused the %" PRId32 " pages: %s (its error says why)", fn,
                           snd.s->peer, snd.n, stepq_status_name(x.peer_refused));
out_free:
    free(snd.ids);
    free(rcv.ids);
    free(rcv.sorted);
    return ret;
}

#else /* !STEPQ_HAVE_NCCL */

static int no_nccl(const char *fn)
{
    return stepq__error(STEPQ_ENOTSUP,
                        "%s: this stepq was built without NCCL (it needs CUDA and NCCL; meson "
                        "options cuda and nccl)",
                        fn);
}

int stepq_tp_unique_id(stepq_tp_id *out)
{
    return no_nccl("stepq_tp_unique_id");
}

int stepq_tp_comm_init(const stepq_tp_id *id, int rank, int size, const stepq_tp_comm_config *cfg,
                       stepq_tp_comm_t **out)
{
    if (out)
        *out = NULL;
    return no_nccl("stepq_tp_comm_init");
}

int stepq_tp_comm_wrap(void *nccl_comm, int rank, int size, const stepq_tp_comm_config *cfg,
                       stepq_tp_comm_t **out)
{
    if (out)
        *out = NULL;
    return no_nccl("stepq_tp_comm_wrap");
}

int stepq_tp_comm_close(stepq_tp_comm_t *comm)
{
    return comm ? no_nccl("stepq_tp_comm_close") : STEPQ_OK;
}

int stepq_tp_check_pools(stepq_tp_comm_t *comm, const stepq_pool_config *cfg, stepq_pool_t *pool,
                         void *stream)
{
    return no_nccl("stepq_tp_check_pools");
}

int stepq_tp_exchange_slots(stepq_tp_comm_t *comm, const stepq_tp_slots *send,
                            const stepq_tp_slots *recv, void *stream)
{
    return no_nccl("stepq_tp_exchange_slots");
}

#endif

/* One side of a page exchange as stepq_tp_exchange_slots takes it. */
static stepq_tp_slots one_side(stepq_pool_t *pool, uint64_t page_fingerprint, int peer,
                               const int32_t *slot_ids, int32_t n)
{
    stepq_tp_slots s = STEPQ_TP_SLOTS_INITIALIZER;

    s.pool = pool;
    s.page_fingerprint = page_fingerprint;
    s.peer = peer;
    s.slot_ids = slot_ids;
    s.n = n;
    return s;
}

int stepq_tp_send_slots(stepq_tp_comm_t *comm, stepq_pool_t *pool, uint64_t page_fingerprint,
                        int peer, const int32_t *slot_ids, int32_t n, void *stream)
{
    stepq_tp_slots s = one_side(pool, page_fingerprint, peer, slot_ids, n);
    return stepq_tp_exchange_slots(comm, &s, NULL, stream);
}

int stepq_tp_recv_slots(stepq_tp_comm_t *comm, stepq_pool_t *pool, uint64_t page_fingerprint,
                        int peer, const int32_t *slot_ids, int32_t n, void *stream)
{
    stepq_tp_slots s = one_side(pool, page_fingerprint, peer, slot_ids, n);
    return stepq_tp_exchange_slots(comm, NULL, &s, stream);
}
