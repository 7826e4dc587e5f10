/* CUDA-event timing shared by the checks' benchmarks and `stepq bench kernels` (timing.h). */
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "plugin/cuda_err.h"
#include "tests/checkasm/timing.h"

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
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
    qsort(t, FX_TIME_RUNS, sizeof(float), cmp_float);
    *us = 1000.0 * 0.5 * (t[FX_TIME_RUNS / 2 - 1] + t[FX_TIME_RUNS / 2]);
out:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    return ret;
}
