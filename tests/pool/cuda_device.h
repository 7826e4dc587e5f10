/*
 * The CUDA tests' one preamble: whether this build and this machine can run
 * them. Exit status 77 is meson's "skipped"; the line printed says why.
 */
#ifndef STEPQ_TESTS_POOL_CUDA_DEVICE_H
#define STEPQ_TESTS_POOL_CUDA_DEVICE_H

#include <stdio.h>

#include "stepq_config.h"

#if STEPQ_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* 0 when a CUDA device is there, else 77 after printing the reason. */
static inline int stepq_test_cuda_device(void)
{
#if !STEPQ_HAVE_CUDA
    printf("SKIP: this build has no CUDA\n");
    return 77;
#else
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        printf("SKIP: no CUDA device\n");
        return 77;
    }
    return 0;
#endif
}

#endif
