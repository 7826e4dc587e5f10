/*
 * The streamed dense decode step: fp32 or bf16 states, [K,V] or [V,K], one
 * token per request, the dense step entry (stepq__cuda_step_dense_ex) and
 * the layers whose pages are bf16 states.
 *
 * Why: on the tile kernel a block holds its head in registers from the
 * load to the store, two blocks per SM (128 registers), so an SM has at
 * most two heads' loads in flight and its memory idles while both blocks
 * are in their reductions: the bf16 step ran at 69.7% of copy bandwidth at
 * B = 512 (GDN, 379 us on the H200). Here the block is persistent and
 * keeps the memory busy: it walks the (entry, head) items i = blockIdx.x,
 * blockIdx.x + gridDim.x, ... (entry i / HV, head i % HV) and, while it
 * computes one item, the states of its next nb - 1 items are already on
 * their way into shared memory: 16-byte cp.async, one commit group per
 * item, in the staged layout and swizzle of sq_stage_dense
 * (tile_kernel.cuh), so the micro-tile reads are conflict-free LDS.128 in
 * both layouts.
 *
 * The item itself is the tile kernel's: sq_tile_item with SQ_V_HELD, which
 * reads the micro-tile from the staged head (sq_tload_staged, the floats of
 * the direct load) and then runs the same phases, so the states, the
 * outputs and the health bits are the tile kernel's bit for bit (checkasm
 * compares them bytewise as well as against the reference).
 *
 * Pipeline, nb = 2 or 3 buffers of SQ_STAGE_BYTES (dynamic shared memory):
 * - prologue: the block's items 0 .. nb - 2 are issued, one group each;
 * - iteration k (item i_k): item i_{k+nb-1} is issued into buffer
 *   (k + nb - 1) % nb, which iteration k - 1 finished reading before its
 *   barrier; then cp.async.wait_group nb - 1 (item i_k's copies have
 *   landed) and a barrier (every thread's copies are visible);
 * - an item whose slot id is -1 (padding) or out of range is skipped, as
 *   in the tile kernel (no output, no health); its issue commits an empty
 *   group, so every iteration commits exactly one and the counts hold;
 *   a state without 16-byte alignment (!io.dense_vec) is staged by plain
 *   loads and stores (sq_stage_dense_scalar: rare, not tuned);
 * - the recurrence inputs of item i_{k+1} (sq_load_in: a few registers)
 *   are loaded as soon as item i_k is done, so their latency overlaps the
 *   next issue and wait;
 * - the block ends with cp.async.wait_all: no copy lands after it.
 * Grid: min(items, resident blocks per SM x SMs) (layer.cu,
 * launch_stream); two blocks per SM for bf16 (2 x 64 KiB or 96 KiB of
 * buffers), one for fp32 (128 or 192 KiB).
 */
#ifndef STEPQ_KERNELS_CUDA_STREAM_KERNEL_CUH
#define STEPQ_KERNELS_CUDA_STREAM_KERNEL_CUH

#include "kernels/cuda/tile_kernel.cuh"

/* Blocks per SM the stream kernel is compiled for (its register budget). */
#define SQ_STREAM_MIN_BLOCKS(DT) ((DT) == SQ_BF16 ? 2 : 1)
#define SQ_STREAM_MAX_NB         3 /* deepest pipeline: buffers of staged heads */

/* cp.async.wait_group with a run-time count (the instruction takes an immediate). */
__device__ __forceinline__ void sq_cp_wait_pending(int n)
{
    if (n >= 2)
        asm volatile("cp.async.wait_group 2;\n" ::: "memory");
    else if (n == 1)
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    else
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

/* The slot id of entry e, or -1 where it is padding or out of range. */
__device__ __forceinline__ int32_t sq_stream_slot(const sq_io &io, int e)
{
    const int32_t s = io.slots ? io.slots[e] : e;
    return s >= 0 && s < io.n_slots ? s : -1;
}

/* Issues item i's state into buf: exactly one commit group, empty when there is nothing to copy. */
template <int DT>
__device__ __forceinline__ void sq_stream_issue(const sq_io &io, int i, int n, int HV, uint8_t *buf)
{
    constexpr size_t ES = DT == SQ_F32 ? 4 : 2;
    if (i < n) {
        const int e = i / HV, hv = i - e * HV;
        const int32_t slot = sq_stream_slot(io, e);
        if (slot >= 0) {
            const uint8_t *src = (const uint8_t *)io.dense +
                                 ES * ((size_t)slot * io.dense_stride + (size_t)hv * SQ_D * SQ_D);
            if (io.dense_vec) {
                sq_stage_dense<DT>(buf, src); /* commits */
                return;
            }
            sq_stage_dense_scalar<DT>(buf, src);
        }
    }
    sq_cp_commit();
}

template <int DT>
__global__ void __launch_bounds__(SQ_THREADS, SQ_STREAM_MIN_BLOCKS(DT))
    sq_stream_kernel(sq_step st, sq_io io, int n, int nb)
{
    extern __shared__ __align__(16) uint8_t sq_dyn[];
    __shared__ sq_tsmem sm;
    constexpr uint32_t SB = SQ_STAGE_BYTES(DT == SQ_F32 ? 4 : 2);
    constexpr int HELD = SQ_V_HELD | (DT == SQ_BF16 ? SQ_V_HELD16 : 0);
    const int t = threadIdx.x, G = gridDim.x, HV = st.HV;
    int i = blockIdx.x;
    for (int p = 0; p < nb - 1; p++)
        sq_stream_issue<DT>(io, i + p * G, n, HV, sq_dyn + p * SB);
    sq_in in;
    if (i < n)
        sq_load_in<true, 0>(in, st, i % HV, i / HV, HV, t);
    for (int k = 0; i < n; i += G, k++) {
        sq_stream_issue<DT>(io, i + (nb - 1) * G, n, HV, sq_dyn + ((k + nb - 1) % nb) * SB);
        const int e = i / HV, hv = i - e * HV, nx = i + G;
        const int32_t slot = sq_stream_slot(io, e);
        if (slot >= 0) { /* uniform over the block */
            sq_cp_wait_pending(nb - 1);
            __syncthreads(); /* every thread's copies of item i are visible */
            /* ends with a barrier: the buffer is free for the next issue */
            sq_tile_item<SQ_SRC_DENSE, true, SQ_SINK_DENSE, HELD>(st, io, hv, e, HV, slot,
                                                                  sq_dyn + (k % nb) * SB, sm, in);
        }
        if (nx < n)
            sq_load_in<true, 0>(in, st, nx % HV, nx / HV, HV, t);
    }
    sq_cp_async_wait_all(); /* no copy may land after the block has gone */
}

#endif /* STEPQ_KERNELS_CUDA_STREAM_KERNEL_CUH */
