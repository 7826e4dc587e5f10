/*
 * The one CUDA-error helper of the library (pool backend and kernels alike):
 * a CUDA runtime error becomes a stepq status with a message naming the call
 * and the runtime's own text. A library inside a server never aborts it: the
 * last (non-sticky) error is cleared so the server can go on; a sticky one
 * stays, and the runtime's text says so. Built only with CUDA.
 */
#ifndef STEPQ_PLUGIN_CUDA_ERR_H
#define STEPQ_PLUGIN_CUDA_ERR_H

#include "plugin/err.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Maps cuda_err (a cudaError_t) to STEPQ_ENODEV (no device, no or too old a
 * driver) or STEPQ_ECUDA, records "<what>: <text> (<name>)" in obj_buf (may
 * be NULL) and the thread-local slot, clears the last error and returns the
 * status.
 */
int stepq__cuda_error(char *obj_buf, int cuda_err, const char *what);

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_PLUGIN_CUDA_ERR_H */
