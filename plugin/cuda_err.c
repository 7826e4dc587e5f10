/* CUDA runtime errors as stepq statuses (plugin/cuda_err.h). */
#include <cuda_runtime_api.h>

#include "plugin/cuda_err.h"

int stepq__cuda_error(char *obj_buf, int cuda_err, const char *what)
{
    const cudaError_t e = (cudaError_t)cuda_err;
    const int status = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
                               e == cudaErrorNoKernelImageForDevice
                           ? STEPQ_ENODEV
                           : STEPQ_ECUDA;

    (void)cudaGetLastError();
    return stepq__error_obj(obj_buf, status, "%s: %s (%s)", what, cudaGetErrorString(e),
                            cudaGetErrorName(e));
}
