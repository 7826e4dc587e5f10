/*
 * CUDA backend: one cudaMalloc for the slots + 1 pages, one for the health
 * words, one for the layout tables. Every data operation is enqueued on the
 * pool's stream. CUDA errors become STEPQ_ECUDA with the runtime's text;
 * the (non-sticky) error state is cleared so the server can go on. Calls
 * switch to the pool's device and back, leaving the caller's current device
 * as it was.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepq_config.h"

#include "pool/internal.h"

#if STEPQ_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda.h"
#include "plugin/cuda_err.h"
#include "pool/cuda.h"

struct cuda_data {
    /*
     * One prepared device descriptor per recurrent layer, built at open so a
     * step uploads nothing. NULL where the kernels cannot run the layer
     * (heads other than 128x128): then
     * `unsupported` says why, the pool still opens (its slots and copies
     * work) and steps, packs and unpacks return STEPQ_ENOTSUP, as
     * stepq_pool_supports() says.
     */
    stepq__cuda_layer **layers;
    int n_layers;
    int unsupported_status;
    char unsupported[STEPQ__ERRLEN];
};

static int cuda_fail(stepq_pool_t *pool, cudaError_t e, const char *what)
{
    return stepq__cuda_error(pool->err, (int)e, what);
}

#define CUDA_TRY(call, what)                 \
    do {                                     \
        cudaError_t e_ = (call);             \
        if (e_ != cudaSuccess) {             \
            ret = cuda_fail(pool, e_, what); \
            goto out;                        \
        }                                    \
    } while (0)

/* Makes the pool's device current; *prev gets the caller's. */
static int device_enter(stepq_pool_t *pool, int *prev)
{
    cudaError_t e = cudaGetDevice(prev);

    if (e != cudaSuccess)
        return cuda_fail(pool, e, "cudaGetDevice");
    if (*prev != pool->device && (e = cudaSetDevice(pool->device)) != cudaSuccess)
        return cuda_fail(pool, e, "cudaSetDevice");
    return STEPQ_OK;
}

static void device_leave(stepq_pool_t *pool, int prev)
{
    if (prev != pool->device)
        (void)cudaSetDevice(prev);
}

static cudaStream_t stream_of(stepq_pool_t *pool)
{
    return (cudaStream_t)pool->stream;
}

static void release_layers(struct cuda_data *cd)
{
    for (int i = 0; cd->layers && i < cd->n_layers; i++)
        stepq__cuda_layer_release(cd->layers[i]);
    free(cd->layers);
    cd->layers = NULL;
    cd->n_layers = 0;
}

/* Prepares every layer's device descriptors (maps only; a synthetic layout has no heads). */
static int prepare_layers(stepq_pool_t *pool, struct cuda_data *cd)
{
    const int n = pool->layout.pub.n_layers;

    if (!pool->layout.heads)
        return STEPQ_OK;
    cd->layers = calloc((size_t)n, sizeof(*cd->layers));
    if (!cd->layers)
        return stepq__error_obj(pool->err, STEPQ_ENOMEM, "out of memory (layer descriptors)");
    cd->n_layers = n;
    for (int i = 0; i < n; i++) {
        struct stepq__packed_layer pl;
        int ret;

        stepq__pool_packed_layer(pool, i, &pl);
        ret = stepq__cuda_layer_prepare(&pl, &cd->layers[i]);
        if (ret == STEPQ_ENOTSUP) {
            if (!cd->unsupported_status) {
                cd->unsupported_status = ret;
                snprintf(cd->unsupported, sizeof(cd->unsupported), "cuda backend, layer %d: %s", i,
                         stepq_last_error());
            }
            continue;
        }
        if (ret < 0)
            return stepq__error_obj(pool->err, ret, "layer %d: %s", i, stepq_last_error());
    }
    return STEPQ_OK;
}

static int cuda_init(stepq_pool_t *pool)
{
    size_t n = (size_t)pool->slots + 1;
    struct cuda_data *cd;
    int count = 0, prev = 0, ret = STEPQ_OK;
    cudaError_t e = cudaGetDeviceCount(&count);

    if (e != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        return stepq__error_obj(pool->err, STEPQ_ENODEV, "no CUDA device: %s",
                                e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
    }
    if (pool->device < 0 || pool->device >= count)
        return stepq__error_obj(pool->err, STEPQ_ENODEV,
                                "stepq_pool_config.device %d: this machine has devices 0..%d",
                                pool->device, count - 1);
    cd = calloc(1, sizeof(*cd));
    if (!cd)
        return stepq__error_obj(pool->err, STEPQ_ENOMEM, "out of memory (CUDA backend)");
    pool->backend_data = cd;
    ret = device_enter(pool, &prev);
    if (ret < 0) {
        free(cd);
        pool->backend_data = NULL;
        return ret;
    }
    CUDA_TRY(cudaMalloc((void **)&pool->pages, n * pool->page_bytes), "cudaMalloc(pages)");
    CUDA_TRY(cudaMalloc((void **)&pool->health, n * sizeof(uint32_t)), "cudaMalloc(health)");
    /* Zero on the pool's stream and wait, so the pages are zero for every
     * stream once open returns. */
    CUDA_TRY(cudaMemsetAsync(pool->pages, 0, n * pool->page_bytes, stream_of(pool)),
             "cudaMemsetAsync(pages)");
    CUDA_TRY(cudaMemsetAsync(pool->health, 0, n * sizeof(uint32_t), stream_of(pool)),
             "cudaMemsetAsync(health)");
    CUDA_TRY(cudaStreamSynchronize(stream_of(pool)), "cudaStreamSynchronize");
    ret = prepare_layers(pool, cd);
out:
    if (ret < 0) {
        release_layers(cd);
        cudaFree(pool->pages);
        cudaFree(pool->health);
        (void)cudaGetLastError();
        pool->pages = NULL;
        pool->health = NULL;
        free(cd);
        pool->backend_data = NULL;
    }
    device_leave(pool, prev);
    return ret;
}

/*
 * Frees everything, whatever fails on the way, and returns the first
 * failure: work still queued that failed (the stream's sync), or a device
 * switch that failed (the frees are still tried: with unified addressing
 * the runtime finds each allocation's device).
 */
static int cuda_fini(stepq_pool_t *pool)
{
    struct cuda_data *cd = pool->backend_data;
    int prev = 0, ret, entered;
    cudaError_t e;

    if (!cd)
        return STEPQ_OK;
    ret = device_enter(pool, &prev);
    entered = ret >= 0;
    if (entered && (e = cudaStreamSynchronize(stream_of(pool))) != cudaSuccess)
        ret = cuda_fail(pool, e, "stepq_pool_close: work queued on the pool's stream failed");
    release_layers(cd);
    cudaFree(pool->pages);
    cudaFree(pool->health);
    (void)cudaGetLastError();
    if (entered)
        device_leave(pool, prev);
    free(cd);
    pool->backend_data = NULL;
    pool->pages = NULL;
    pool->health = NULL;
    return ret < 0 ? ret : STEPQ_OK;
}

static int cuda_clear(stepq_pool_t *pool, const int32_t *ids, int32_t n, int pages)
{
    int prev = 0, ret = device_enter(pool, &prev);

    if (ret < 0)
        return ret;
    CUDA_TRY((cudaError_t)stepq__pool_cuda_clear(pool->pages, pool->page_bytes, pool->health, ids,
                                                 n, pages, pool->stream),
             "clear kernel");
out:
    device_leave(pool, prev);
    return ret;
}

static int cuda_copy(stepq_pool_t *pool, const int32_t *src, const int32_t *dst, int32_t n)
{
    int prev = 0, ret = device_enter(pool, &prev);

    if (ret < 0)
        return ret;
    CUDA_TRY((cudaError_t)stepq__pool_cuda_copy(pool->pages, pool->page_bytes, pool->health, src,
                                                dst, n, pool->stream),
             "copy kernel");
out:
    device_leave(pool, prev);
    return ret;
}

/* One cudaMemcpyAsync per run of consecutive slots at consecutive positions. */
static int copy_runs(stepq_pool_t *pool, const int32_t *ids, const int32_t *pos, int32_t n,
                     uint8_t *host, int to_host)
{
    int ret = STEPQ_OK;

    for (int32_t i = 0; i < n;) {
        int32_t k = 1;
        size_t bytes;
        uint8_t *dev, *h;

        while (i + k < n && ids[i + k] == ids[i] + k && pos[i + k] == pos[i] + k)
            k++;
        bytes = (size_t)k * pool->page_bytes;
        dev = pool->pages + (size_t)ids[i] * pool->page_bytes;
        h = host + (size_t)pos[i] * pool->page_bytes;
        CUDA_TRY(cudaMemcpyAsync(to_host ? (void *)h : (void *)dev, to_host ? dev : h, bytes,
                                 to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                                 stream_of(pool)),
                 to_host ? "cudaMemcpyAsync(to host)" : "cudaMemcpyAsync(from host)");
        i += k;
    }
out:
    return ret;
}

static int cuda_to_host(stepq_pool_t *pool, const int32_t *ids, const int32_t *pos, int32_t n,
                        void *host)
{
    int prev = 0, ret = device_enter(pool, &prev);

    if (ret < 0)
        return ret;
    ret = copy_runs(pool, ids, pos, n, host, 1);
    device_leave(pool, prev);
    return ret;
}

static int cuda_from_host(stepq_pool_t *pool, const int32_t *ids, const int32_t *pos, int32_t n,
                          const void *host)
{
    int prev = 0, ret = device_enter(pool, &prev);

    if (ret < 0)
        return ret;
    ret = copy_runs(pool, ids, pos, n, (uint8_t *)host, 0);
    if (ret >= 0)
        CUDA_TRY((cudaError_t)stepq__pool_cuda_clear(pool->pages, pool->page_bytes, pool->health,
                                                     ids, n, 0, pool->stream),
                 "health reset kernel");
out:
    device_leave(pool, prev);
    return ret;
}

static int cuda_read_health(stepq_pool_t *pool, uint32_t *out)
{
    int prev = 0, ret = device_enter(pool, &prev);

    if (ret < 0)
        return ret;
    CUDA_TRY(cudaMemcpyAsync(out, pool->health, ((size_t)pool->slots + 1) * sizeof(uint32_t),
                             cudaMemcpyDeviceToHost, stream_of(pool)),
             "cudaMemcpyAsync(health)");
    CUDA_TRY(cudaStreamSynchronize(stream_of(pool)), "cudaStreamSynchronize");
out:
    device_leave(pool, prev);
    return ret;
}

static int cuda_sync(stepq_pool_t *pool)
{
    int prev = 0, ret = device_enter(pool, &prev);

    if (ret < 0)
        return ret;
    CUDA_TRY(cudaStreamSynchronize(stream_of(pool)), "cudaStreamSynchronize");
out:
    device_leave(pool, prev);
    return ret;
}

/* --- the data path: the CUDA kernels on the prepared layers ----------------- */

/* A kernel entry's failure (thread-local text) as the pool's. */
static int kernel_fail(stepq_pool_t *pool, int ret)
{
    return stepq__error_obj(pool->err, ret, "cuda backend: %s", stepq_last_error());
}

/*
 * A stream of another device would run the kernels on memory they cannot
 * address: refused with a message naming the stream, outside a capture.
 */
static int check_stream(stepq_pool_t *pool, void *stream)
{
    int dev = pool->device;
    cudaError_t e;

    if (!stream)
        return STEPQ_OK; /* the legacy default stream of the current (the pool's) device */
    /* cudaStreamGetDevice is refused on a capturing stream (measured: "operation
     * not permitted when stream is capturing"); a capture then records the
     * launch, and a stream of another device fails at the launch instead
     * (STEPQ_ECUDA, nothing written). */
    enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing((cudaStream_t)stream, &cap) == cudaSuccess &&
        cap != cudaStreamCaptureStatusNone)
        return STEPQ_OK;
    (void)cudaGetLastError();
    e = cudaStreamGetDevice((cudaStream_t)stream, &dev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return stepq__error_obj(pool->err, STEPQ_EINVAL, "stream %p: %s", stream,
                                cudaGetErrorString(e));
    }
    if (dev != pool->device)
        return stepq__error_obj(pool->err, STEPQ_EINVAL,
                                "stream %p belongs to device %d, the pool to device %d", stream,
                                dev, pool->device);
    return STEPQ_OK;
}

/* One launch on the caller's stream (checked as a step's); the lists stay on the device. */
static int cuda_copy_masked(stepq_pool_t *pool, const int32_t *src, const int32_t *dst,
                            const int32_t *mask, int32_t n, void *stream)
{
    int prev = 0, ret = device_enter(pool, &prev);

    if (ret < 0)
        return ret;
    if ((ret = check_stream(pool, stream)) < 0)
        goto out;
    CUDA_TRY((cudaError_t)stepq__pool_cuda_copy_masked(pool->pages, pool->page_bytes, pool->health,
                                                       pool->slots, src, dst, mask, n,
                                                       stream ? stream : pool->stream),
             "masked copy kernel");
out:
    device_leave(pool, prev);
    return ret;
}

static int cuda_decode(stepq_pool_t *pool, int layer, const struct stepq__step_args *a)
{
    struct cuda_data *cd = pool->backend_data;
    struct stepq__packed_layer pl;
    int prev = 0, ret = device_enter(pool, &prev);

    if (ret < 0)
        return ret;
    if ((ret = check_stream(pool, a->stream)) >= 0) {
        stepq__pool_packed_layer(pool, layer, &pl);
        ret = stepq__cuda_step_packed_prepared(a, &pl, cd->layers[layer], STEPQ__CUDA_FUSED);
        if (ret < 0)
            ret = kernel_fail(pool, ret);
    }
    device_leave(pool, prev);
    return ret;
}

static int cuda_transfer(stepq_pool_t *pool, int layer, int pack, const stepq_prefill_args *p,
                         void *stream)
{
    struct cuda_data *cd = pool->backend_data;
    const stepq_pool_layout *l = &pool->layout.pub;
    const size_t stride =
        p->state_stride ? (size_t)p->state_stride : (size_t)l->n_local_heads * l->d_k * l->d_v;
    struct stepq__packed_layer pl;
    int prev = 0, ret = device_enter(pool, &prev);

    if (ret < 0)
        return ret;
    if ((ret = check_stream(pool, stream)) >= 0) {
        stepq__pool_packed_layer(pool, layer, &pl);
        if (pack)
            ret = stepq__cuda_pack_prepared(&pl, cd->layers[layer], p->n, p->slot_ids, p->states,
                                            stride, (stepq__layout)p->layout, p->dtype,
                                            pool->health, p->health_counts, stream);
        else
            ret = stepq__cuda_unpack_prepared(&pl, cd->layers[layer], p->n, p->slot_ids, p->states,
                                              stride, (stepq__layout)p->layout, p->dtype, stream);
        if (ret < 0)
            ret = kernel_fail(pool, ret);
    }
    device_leave(pool, prev);
    return ret;
}

static int cuda_supports(stepq_pool_t *pool, stepq_op op, int layer, const void *args)
{
    struct cuda_data *cd = pool->backend_data;

    for (int i = layer < 0 ? 0 : layer; i < (layer < 0 ? cd->n_layers : layer + 1); i++)
        if (!cd->layers[i])
            return stepq__error_obj(pool->err, cd->unsupported_status, "%s", cd->unsupported);
    return STEPQ_OK;
}

const struct stepq__pool_ops stepq__pool_cuda_ops = {
    .name = "cuda",
    .init = cuda_init,
    .fini = cuda_fini,
    .clear = cuda_clear,
    .copy = cuda_copy,
    .copy_masked = cuda_copy_masked,
    .to_host = cuda_to_host,
    .from_host = cuda_from_host,
    .read_health = cuda_read_health,
    .sync = cuda_sync,
    .decode = cuda_decode,
    .transfer = cuda_transfer,
    .supports = cuda_supports,
};

#else /* !STEPQ_HAVE_CUDA */

static int nocuda_init(stepq_pool_t *pool)
{
    return stepq__error_obj(pool->err, STEPQ_ENOTSUP,
                            "the CUDA backend is not in this build (configured without nvcc)");
}

static int nocuda_fini(stepq_pool_t *pool)
{
    return STEPQ_OK;
}

const struct stepq__pool_ops stepq__pool_cuda_ops = {
    .name = "cuda (not built)",
    .init = nocuda_init,
    .fini = nocuda_fini,
};

#endif
