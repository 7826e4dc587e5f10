/*
 * Launchers of the pool's CUDA kernels (pool/kernels.cu), callable from C.
 * Each but the masked copy takes host id lists (already validated, no -1
 * entries), passes them to the kernels by value in chunks, enqueues on
 * `stream` (a cudaStream_t) and returns a cudaError_t as int (0 =
 * cudaSuccess). Pages must be 16-byte aligned and page_bytes a multiple of
 * 16.
 */
#ifndef STEPQ_POOL_CUDA_H
#define STEPQ_POOL_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Zeroes health[ids[i]] and, when zero_pages, the pages of ids. */
int stepq__pool_cuda_clear(uint8_t *pages, uint64_t page_bytes, uint32_t *health,
                           const int32_t *ids, int32_t n, int zero_pages, void *stream);

/** Copies pages and health words src[i] -> dst[i] (disjoint lists). */
int stepq__pool_cuda_copy(uint8_t *pages, uint64_t page_bytes, uint32_t *health, const int32_t *src,
                          const int32_t *dst, int32_t n, void *stream);

/**
 * The exception to the host lists above: src, dst and mask (NULL = every
 * entry) are device memory, n entries each, read by one kernel (no launch
 * for n = 0). Entry i copies page and health word src[i] -> dst[i] when
 * mask[i] != 0, both ids are in 1..slots and they differ; it is skipped
 * otherwise. Nothing is read on the host.
 */
int stepq__pool_cuda_copy_masked(uint8_t *pages, uint64_t page_bytes, uint32_t *health,
                                 int32_t slots, const int32_t *src, const int32_t *dst,
                                 const int32_t *mask, int32_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_POOL_CUDA_H */
