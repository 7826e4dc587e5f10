/* CUDA-event timing shared by the checks' benchmarks and `stepq bench kernels` (timing.h). */
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "plugin/cuda_err.h"
#include "plugin/err.h"
#include "tests/checkasm/timing.h"

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* The median of the FX_TIME_RUNS times t (ms; sorted in place), in us. */
static double median_us(float *t)
{
    qsort(t, FX_TIME_RUNS, sizeof(float), cmp_float);
    return 1000.0 * 0.5 * (t[FX_TIME_RUNS / 2 - 1] + t[FX_TIME_RUNS / 2]);
}

int fx_time_us(fx_launch_fn launch, void *ctx, void *stream, double *us)
{
    cudaStream_t s = (cudaStream_t)stream;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float t[FX_TIME_RUNS];
    cudaError_t e;
    int ret = STEPQ_OK;

    *us = -1;
    if ((e = cudaEventCreate(&e0)) != cudaSuccess || (e = cudaEventCreate(&e1)) != cudaSuccess) {
        ret = stepq__cuda_error(NULL, (int)e, "timing: cudaEventCreate");
        goto out;
    }
    for (int r = 0; r < FX_TIME_WARMUP; r++)
        if ((ret = launch(ctx)) < 0)
            goto out;
    for (int r = 0; r < FX_TIME_RUNS; r++) {
        if ((e = cudaEventRecord(e0, s)) != cudaSuccess) {
            ret = stepq__cuda_error(NULL, (int)e, "timing: cudaEventRecord");
            goto out;
        }
        if ((ret = launch(ctx)) < 0)
            goto out;
        if ((e = cudaEventRecord(e1, s)) != cudaSuccess ||
            (e = cudaEventSynchronize(e1)) != cudaSuccess ||
            (e = cudaEventElapsedTime(&t[r], e0, e1)) != cudaSuccess) {
            ret = stepq__cuda_error(NULL, (int)e, "timing: the timed launch");
            goto out;
        }
    }
    *us = median_us(t);
out:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    return ret;
}

/* One replay of ge between e0 and e1 on s, its time in ms into *ms. */
static int time_replay(cudaGraphExec_t ge, cudaStream_t s, cudaEvent_t e0, cudaEvent_t e1,
                       float *ms)
{
    cudaError_t e;
    if ((e = cudaEventRecord(e0, s)) != cudaSuccess ||
        (e = cudaGraphLaunch(ge, s)) != cudaSuccess ||
        (e = cudaEventRecord(e1, s)) != cudaSuccess ||
        (e = cudaEventSynchronize(e1)) != cudaSuccess ||
        (e = cudaEventElapsedTime(ms, e0, e1)) != cudaSuccess)
        return stepq__cuda_error(NULL, (int)e, "timing: the timed graph replay");
    return STEPQ_OK;
}

int fx_time_graph_us(fx_launch_fn launch, void *ctx, void *stream, double *us)
{
    cudaStream_t s = (cudaStream_t)stream;
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    float t[FX_TIME_RUNS], warm;
    cudaError_t e;
    int ret = STEPQ_OK;

    *us = -1;
    if (!s)
        return stepq__error(STEPQ_EINVAL, "timing: a graph needs a created stream, not the legacy "
                                          "default stream");
    for (int r = 0; r < FX_TIME_WARMUP; r++)
        if ((ret = launch(ctx)) < 0)
            return ret;
    if ((e = cudaStreamSynchronize(s)) != cudaSuccess)
        return stepq__cuda_error(NULL, (int)e, "timing: the warm-up launches");
    if ((e = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)) != cudaSuccess)
        return stepq__cuda_error(NULL, (int)e, "timing: cudaStreamBeginCapture");
    for (int r = 0; r < FX_TIME_GRAPH_LAUNCHES && ret >= 0; r++)
        ret = launch(ctx);
    e = cudaStreamEndCapture(s, &g); /* ends the capture in every case */
    /* The launch ran eagerly above: what fails from here on is its capture (STEPQ_ENOTSUP). */
    if (ret < 0) {
        char why[512]; /* the launch's message, copied: stepq__error writes the same buffer */
        snprintf(why, sizeof(why), "%s", stepq_last_error());
        ret = stepq__error(STEPQ_ENOTSUP, "timing: not capturable into a CUDA graph: %s", why);
        goto out;
    }
    if (e != cudaSuccess) {
        ret = stepq__error(STEPQ_ENOTSUP, "timing: not capturable into a CUDA graph: %s",
                           cudaGetErrorString(e));
        goto out;
    }
    if ((e = cudaGraphInstantiate(&ge, g, 0)) != cudaSuccess) {
        ret = stepq__error(STEPQ_ENOTSUP, "timing: the captured graph does not instantiate: %s",
                           cudaGetErrorString(e));
        goto out;
    }
    if ((e = cudaEventCreate(&e0)) != cudaSuccess || (e = cudaEventCreate(&e1)) != cudaSuccess) {
        ret = stepq__cuda_error(NULL, (int)e, "timing: cudaEventCreate");
        goto out;
    }
    if ((ret = time_replay(ge, s, e0, e1, &warm)) < 0) /* uploads the graph, warms the clocks */
        goto out;
    for (int r = 0; r < FX_TIME_RUNS; r++)
        if ((ret = time_replay(ge, s, e0, e1, &t[r])) < 0)
            goto out;
    *us = median_us(t) / FX_TIME_GRAPH_LAUNCHES;
out:
    if (ret < 0)
        cudaGetLastError(); /* a failed capture's error is reported, not left for the next call */
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    if (ge)
        cudaGraphExecDestroy(ge);
    if (g)
        cudaGraphDestroy(g);
    return ret;
}
