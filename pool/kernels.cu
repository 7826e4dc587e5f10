/*
 * Page clear and gather-copy kernels of the CUDA pool backend.
 *
 * Slot lists of clear and copy reach the kernels as kernel arguments (by
 * value, in chunks), not through a device buffer: no staging copy, no host
 * synchronisation, and the launches stay capturable in a CUDA graph. The
 * masked copy reads its lists from device memory instead (they are the
 * server's tensors, rewritten between graph replays) and checks each entry
 * there.
 */
#include <cuda_runtime.h>

#include "pool/cuda.h"

/* Ids per launch: keeps the argument block under the 4 KiB every CUDA
 * version accepts (4 B per id, two lists for a copy). */
#define CLEAR_IDS_PER_LAUNCH  960
#define COPY_PAIRS_PER_LAUNCH 480
/* 256 threads x 16 B: one 4 KiB tile per block iteration. */
#define THREADS 256
/* Blocks per launch to aim for: ~8 resident blocks of 256 threads on each of
 * an H200's 132 SMs, so one slot alone still spreads over the whole GPU while
 * 512 slots do not launch hundreds of thousands of blocks. */
#define TARGET_BLOCKS 1024

struct clear_args {
    int32_t id[CLEAR_IDS_PER_LAUNCH];
};

struct copy_args {
    int32_t src[COPY_PAIRS_PER_LAUNCH];
    int32_t dst[COPY_PAIRS_PER_LAUNCH];
};

__global__ void clear_pages(uint8_t *pages, uint64_t page_bytes, uint32_t *health,
                            const struct clear_args args, int zero_pages)
{
    const int32_t id = args.id[blockIdx.x];
    uint4 *p = (uint4 *)(pages + (uint64_t)id * page_bytes);
    const uint64_t n = page_bytes / 16;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    if (blockIdx.y == 0 && threadIdx.x == 0)
        health[id] = 0;
    if (!zero_pages)
        return;
    for (uint64_t i = (uint64_t)blockIdx.y * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.y * blockDim.x)
        p[i] = zero;
}

/* Block (blockIdx.y) of the blocks copying page s to page d: its share of the
 * page's 16-byte words and, from block 0, the health word. */
__device__ void copy_page(uint8_t *pages, uint64_t page_bytes, uint32_t *health, int32_t s,
                          int32_t d)
{
    const uint4 *src = (const uint4 *)(pages + (uint64_t)s * page_bytes);
    uint4 *dst = (uint4 *)(pages + (uint64_t)d * page_bytes);
    const uint64_t n = page_bytes / 16;

    if (blockIdx.y == 0 && threadIdx.x == 0)
        health[d] = health[s];
    for (uint64_t i = (uint64_t)blockIdx.y * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.y * blockDim.x)
        dst[i] = src[i];
}

__global__ void copy_pages(uint8_t *pages, uint64_t page_bytes, uint32_t *health,
                           const struct copy_args args)
{
    copy_page(pages, page_bytes, health, args.src[blockIdx.x], args.dst[blockIdx.x]);
}

/* Entry blockIdx.x of device lists: skipped when masked off, when either id
 * is outside 1..slots (the sentinel, padding, garbage) or when they are
 * equal. The test is the same for every block of the entry. */
__global__ void copy_pages_masked(uint8_t *pages, uint64_t page_bytes, uint32_t *health,
                                  int32_t slots, const int32_t *src, const int32_t *dst,
                                  const int32_t *mask)
{
    const int32_t e = (int32_t)blockIdx.x;
    int32_t s, d;

    if (mask && mask[e] == 0)
        return;
    s = src[e];
    d = dst[e];
    if (s < 1 || s > slots || d < 1 || d > slots || s == d)
        return;
    copy_page(pages, page_bytes, health, s, d);
}

/* Blocks per page for k pages in one launch: about TARGET_BLOCKS in all, at
 * most one per 4 KiB tile, at least one. */
static unsigned blocks_per_page(uint64_t page_bytes, int32_t k)
{
    uint64_t tiles = (page_bytes / 16 + THREADS - 1) / THREADS;
    uint64_t want = (TARGET_BLOCKS + (uint64_t)k - 1) / (uint64_t)k;

    if (want > tiles)
        want = tiles;
    return (unsigned)(want ? want : 1);
}

extern "C" int stepq__pool_cuda_clear(uint8_t *pages, uint64_t page_bytes, uint32_t *health,
                                      const int32_t *ids, int32_t n, int zero_pages, void *stream)
{
    struct clear_args args;

    for (int32_t at = 0; at < n; at += CLEAR_IDS_PER_LAUNCH) {
        int32_t k = n - at < CLEAR_IDS_PER_LAUNCH ? n - at : CLEAR_IDS_PER_LAUNCH;
        dim3 grid((unsigned)k, zero_pages ? blocks_per_page(page_bytes, k) : 1);

        for (int32_t i = 0; i < k; i++)
            args.id[i] = ids[at + i];
        clear_pages<<<grid, zero_pages ? THREADS : 32, 0, (cudaStream_t)stream>>>(
            pages, page_bytes, health, args, zero_pages);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            return (int)e;
    }
    return (int)cudaSuccess;
}

extern "C" int stepq__pool_cuda_copy(uint8_t *pages, uint64_t page_bytes, uint32_t *health,
                                     const int32_t *src, const int32_t *dst, int32_t n,
                                     void *stream)
{
    struct copy_args args;

    for (int32_t at = 0; at < n; at += COPY_PAIRS_PER_LAUNCH) {
        int32_t k = n - at < COPY_PAIRS_PER_LAUNCH ? n - at : COPY_PAIRS_PER_LAUNCH;
        dim3 grid((unsigned)k, blocks_per_page(page_bytes, k));

        for (int32_t i = 0; i < k; i++) {
            args.src[i] = src[at + i];
            args.dst[i] = dst[at + i];
        }
        copy_pages<<<grid, THREADS, 0, (cudaStream_t)stream>>>(pages, page_bytes, health, args);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            return (int)e;
    }
    return (int)cudaSuccess;
}

extern "C" int stepq__pool_cuda_copy_masked(uint8_t *pages, uint64_t page_bytes, uint32_t *health,
                                            int32_t slots, const int32_t *src, const int32_t *dst,
                                            const int32_t *mask, int32_t n, void *stream)
{
    if (n <= 0)
        return (int)cudaSuccess;
    dim3 grid((unsigned)n, blocks_per_page(page_bytes, n));
    copy_pages_masked<<<grid, THREADS, 0, (cudaStream_t)stream>>>(pages, page_bytes, health, slots,
                                                                  src, dst, mask);
    return (int)cudaGetLastError();
}
