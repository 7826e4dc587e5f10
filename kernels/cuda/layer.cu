/*
 * Host side of the CUDA kernels: device descriptor tables of packed layers,
 * argument checks, launches and the two-stage variant. Every CUDA error
 * becomes a status through the library's one helper, stepq__cuda_error
 * (never an abort).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "kernels/cuda/cuda.h"
#include "kernels/format.h"
#include "kernels/quant.h"
#include "plugin/cuda_err.h"
#include "plugin/err.h"
}
#include "kernels/cuda/dense_kernel.cuh"
#include "kernels/cuda/f16_kernel.cuh"
#include "kernels/cuda/fp8_kernel.cuh"
#include "kernels/cuda/tile_kernel.cuh"
#include "kernels/cuda/unpack_kernel.cuh"

/* Dynamic shared memory ceiling set on every kernel instance (a GDN pivot
 * head needs 32.5 KiB of block plus 16 KiB of byte codes). */
#define SQ_DYN_SMEM_MAX (96 * 1024)

struct stepq__cuda_layer {
    sq_head_desc *d_heads;
    int n_heads;
    size_t max_block;     /* largest block_bytes */
    int offsets16;        /* all head offsets multiples of 16 */
    int all_quant;        /* every head with integer codes: the tile kernel handles the layer */
    int all_fp8;          /* every head fp8 at a 16-byte offset: fp8_step, fp8_transfer */
    int column;           /* STEPQ__CUDA_COLUMN: the thread-per-column kernels for every launch */
    int any_uniform;      /* some head has one integer width for all rows (ubits) */
    stepq_decode_fit fit; /* the dual heads' decode fit: the steps' SQ_V_NOREFIT / SQ_V_ROWS */
    int any_f16;          /* an arith fp16 layer: every head's decode step is the fp16 kernel's */
    int f16_occ3;         /* STEPQ__CUDA_F16_OCC3 */
    int f16_kda;          /* ... of a KDA layer: the kernel's SQ_V_KDA instantiation */
    /*
     * Every head a bf16 block of the same arch, laid out back to back from
     * dense_off (head hv at dense_off + hv * d_k * d_v * 2): the page is a
     * dense bf16 [HV][K][V] state, and the step runs on the dense tile kernel
     * (8 bf16 per 16-byte access) instead of the column kernel.
     */
    int dense_bf16;
    size_t dense_off;
    /* two-stage variant */
    float *scratch;
    int *skip;
    size_t scratch_heads;
    cudaStream_t s2;
    cudaEvent_t ev_a, ev_b;
};

/*
 * A failed runtime call `call` of entry `who` as stepq__cuda_error's status
 * (STEPQ_ENODEV or STEPQ_ECUDA, the last error cleared), its message
 * "<who>: <call>: <text> (<name>)" so that it names the entry as every
 * other error of the entry does.
 */
static int cuda_fail(cudaError_t err, const char *who, const char *call)
{
    char what[256];
    snprintf(what, sizeof(what), "%s: %s", who, call);
    return stepq__cuda_error(NULL, (int)err, what);
}

#define SQ_CU(call, who)                        \
    do {                                        \
        cudaError_t err_ = (call);              \
        if (err_ != cudaSuccess)                \
            return cuda_fail(err_, who, #call); \
    } while (0)

extern "C" int stepq__cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

static int method_is_dual(int m)
{
    return m == STEPQ_METHOD_DSQ || m == STEPQ_METHOD_SPATIAL || m == STEPQ_METHOD_STEPQ;
}

/* Checks the host description; fills the descriptors (host copy). */
static int build_desc(const struct stepq__packed_layer *pl, sq_head_desc *d, size_t *max_block,
                      int *off16, const char *who)
{
    if (!pl || !pl->heads || !pl->head_offset || pl->n_heads < 1)
        return stepq__error(STEPQ_EINVAL, "%s: NULL packed layer, layouts or offsets", who);
    *max_block = 0;
    *off16 = 1;
    for (int hv = 0; hv < pl->n_heads; hv++) {
        const struct stepq__head_layout *hl = &pl->heads[hv];
        if (!hl->row_bitoff || !hl->row_bits)
            return stepq__error(STEPQ_EINVAL, "%s: head %d layout is not initialised", who, hv);
        if (hl->d_k != SQ_D || hl->d_v != SQ_D)
            return stepq__error(STEPQ_ENOTSUP,
                                "%s: head %d is %dx%d; the CUDA kernels support 128x128 heads only",
                                who, hv, hl->d_k, hl->d_v);
        if (hl->block_bytes % 16 || hl->block_bytes > UINT16_MAX * 2u)
            return stepq__error(STEPQ_ENOTSUP, "%s: head %d block of %zu B (need a multiple of 16)",
                                who, hv, hl->block_bytes);
        sq_head_desc *h = &d[hv];
        memset(h, 0, sizeof(*h));
        h->block_off = (uint32_t)pl->head_offset[hv];
        h->block_bytes = (uint32_t)hl->block_bytes;
        h->row_scale_off = (uint32_t)hl->row_scale_offset;
        h->col_scale_off = (uint32_t)hl->col_scale_offset;
        h->tile_scale_off = (uint32_t)hl->tile_scale_offset;
        h->method = (uint8_t)hl->method;
        h->quantized = (uint8_t)hl->quantized;
        h->has_col = (uint8_t)hl->has_col;
        h->dual = (uint8_t)method_is_dual(hl->method);
        h->row_split = hl->row_split;
        h->any_int = hl->n_pivot_rows < SQ_D;
        int use_w = pl->row_impact && stepq__method_uses_row_impact(hl->method);
        h->piv0 = SQ_D;
        for (int i = SQ_D - 1; i >= 0; i--)
            if (hl->row_bits[i] == STEPQ_BITS_PIVOT) {
                h->piv0 = (uint8_t)i;
                h->piv0_off = (uint16_t)(hl->row_bitoff[i] / 8);
            }
        for (int i = 0; i < SQ_D; i++) {
            h->bits[i] = hl->row_bits[i];
            h->row_off[i] = (uint16_t)(hl->row_bitoff[i] / 8);
            float w = use_w ? pl->row_impact[(size_t)hv * SQ_D + i] : 1.0f;
            if (!(w > 0.0f) || !isfinite(w))
                return stepq__error(STEPQ_EINVAL,
                                    "%s: row impact of head %d row %d is %g (need finite > 0)", who,
                                    hv, i, (double)w);
            h->w[i] = w;
            if (hl->quantized && hl->row_bitoff[i] % 128)
                return stepq__error(STEPQ_EINTERNAL, "%s: head %d row %d codes not 16-B aligned",
                                    who, hv, i);
        }
        h->ubits =
            hl->quantized && hl->row_bits[0] >= 2 && hl->row_bits[0] <= 8 ? hl->row_bits[0] : 0;
        for (int i = 1; i < SQ_D && h->ubits; i++)
            if (hl->row_bits[i] != hl->row_bits[0])
                h->ubits = 0;
        /* arith fp16: the heads the C reference steps in fp16 (kernels/step_f16.c) */
        h->f16 = hl->arith == STEPQ_ARITH_FP16 && stepq__step_f16_supports(hl) && h->ubits;
        /* KDA: every head with an integer row, any mix of widths and pivot rows */
        if (hl->arith == STEPQ_ARITH_FP16 && hl->arch == STEPQ_ARCH_KDA)
            h->f16 = stepq__step_f16_supports(hl) ? 3 : 0;
        {
            size_t covered = hl->codes_bytes + (hl->quantized ? 2 * (size_t)SQ_D : 0) +
                             (hl->has_col ? 2 * (size_t)SQ_D : 0);
            h->needs_zero =
                hl->quantized &&
                (covered != hl->block_bytes || hl->row_scale_offset != hl->codes_bytes ||
                 (hl->has_col && hl->col_scale_offset != hl->row_scale_offset + 2 * SQ_D));
        }
        /*
         * A GDN pivot head (fp16 rows back to back, 2 d_v bytes each, every byte of the block a
         * field): the fused step runs sq_pivot_head_step on it (tile and fp16 kernels; the
         * reference writes only its rows), and an fp16 layer steps it in the same launch.
         */
        if (hl->arch == STEPQ_ARCH_GDN && hl->quantized && hl->n_pivot_rows == SQ_D &&
            hl->codes_offset == 0 && !h->needs_zero) {
            h->pivh = 1;
            for (int i = 0; i < SQ_D; i++)
                if (hl->row_bitoff[i] != (uint64_t)i * 16 * SQ_D)
                    h->pivh = 0;
            if (h->pivh && hl->arith == STEPQ_ARITH_FP16)
                h->f16 = 2; /* sq_f16_pivot_item */
        }
        if (h->f16 && h->needs_zero) /* not at 128x128 with the pools' alignments */
            return stepq__error(STEPQ_ENOTSUP,
                                "%s: head %d: arith fp16 on a block with alignment padding (%zu B; "
                                "the fp16 kernel writes the fields only)",
                                who, hv, hl->block_bytes);
        if (pl->head_offset[hv] % 16)
            return stepq__error(STEPQ_EINVAL, "%s: head %d offset %zu is not a multiple of 16", who,
                                hv, pl->head_offset[hv]);
        if (hl->block_bytes > *max_block)
            *max_block = hl->block_bytes;
    }
    return STEPQ_OK;
}

static size_t dyn_smem(size_t max_block)
{
    return ((max_block + 16 + 15) & ~(size_t)15) + SQ_D * SQ_D;
}

extern "C" int stepq__cuda_layer_prepare_ex(const struct stepq__packed_layer *pl, unsigned flags,
                                            stepq__cuda_layer **out)
{
    static const char who[] = "cuda layer prepare";
    if (!out)
        return stepq__error(STEPQ_EINVAL, "%s: NULL output", who);
    *out = NULL;
    if (flags & ~(STEPQ__CUDA_COLUMN | STEPQ__CUDA_F16_OCC3))
        return stepq__error(STEPQ_EINVAL, "%s: unknown flags 0x%x", who, flags);
    if (!pl || pl->n_heads < 1)
        return stepq__error(STEPQ_EINVAL, "%s: NULL or empty packed layer", who);
    sq_head_desc *h = (sq_head_desc *)calloc((size_t)pl->n_heads, sizeof(*h));
    stepq__cuda_layer *L = (stepq__cuda_layer *)calloc(1, sizeof(*L));
    int rc, decode_fit = -1;
    if (!h || !L) {
        rc = stepq__error(STEPQ_ENOMEM, "%s: out of memory", who);
        goto fail;
    }
    if ((rc = build_desc(pl, h, &L->max_block, &L->offsets16, who)) < 0)
        goto fail;
    /* One decode fit per launch (a template bit): the dual heads of a layer must agree. */
    for (int hv = 0; hv < pl->n_heads; hv++) {
        const int f = (int)pl->heads[hv].decode_fit;
        if (!h[hv].dual)
            continue;
        if (decode_fit < 0) {
            decode_fit = f;
        } else if (decode_fit != f) {
            rc = stepq__error(STEPQ_EINVAL,
                              "%s: head %d's decode_fit is %s, an earlier head's %s (one decode "
                              "fit per layer)",
                              who, hv, stepq_decode_fit_name((stepq_decode_fit)f),
                              stepq_decode_fit_name((stepq_decode_fit)decode_fit));
            goto fail;
        }
    }
    /* an arith fp16 layer is one launch of the fp16 kernel: every head must be its (GDN
     * integer heads of one width and pivot heads; KDA heads with at least one integer row: a
     * KDA head whose rows are all pivots is the one a map can hold and the kernel refuses) */
    for (int hv = 0; hv < pl->n_heads; hv++)
        if (pl->heads[hv].arith == STEPQ_ARITH_FP16 && !h[hv].f16) {
            rc = stepq__error(STEPQ_ENOTSUP,
                              "%s: head %d of an arith fp16 layer is not one the fp16 kernel "
                              "steps (kernels/cuda/f16_kernel.cuh)",
                              who, hv);
            goto fail;
        }
    if (dyn_smem(L->max_block) > SQ_DYN_SMEM_MAX) {
        rc = stepq__error(STEPQ_ENOTSUP, "%s: a head block of %zu B exceeds the kernel's buffer",
                          who, L->max_block);
        goto fail;
    }
    {
        cudaError_t err = cudaMalloc((void **)&L->d_heads, sizeof(*h) * (size_t)pl->n_heads);
        if (err == cudaSuccess)
            err =
                cudaMemcpy(L->d_heads, h, sizeof(*h) * (size_t)pl->n_heads, cudaMemcpyHostToDevice);
        /* cudaMemcpy from pageable memory returns once the bytes are staged, not
         * landed, and steps may run on a non-blocking stream that is not
         * ordered after the legacy stream: wait for the DMA before the handle
         * is used (this runs at pool open, never in a step). */
        if (err == cudaSuccess)
            err = cudaStreamSynchronize(cudaStreamLegacy);
        if (err != cudaSuccess) {
            rc = cuda_fail(err, who, "descriptor upload");
            goto fail;
        }
    }
    L->n_heads = pl->n_heads;
    L->column = (flags & STEPQ__CUDA_COLUMN) != 0;
    L->f16_occ3 = (flags & STEPQ__CUDA_F16_OCC3) != 0;
    L->fit = decode_fit < 0 ? STEPQ_DECODE_FIT_EXACT
                            : (stepq_decode_fit)decode_fit; /* no dual heads: exact */
    L->all_quant = 1;
    L->all_fp8 = L->offsets16;
    for (int hv = 0; hv < pl->n_heads; hv++) {
        L->any_f16 |= h[hv].f16;
        L->f16_kda |= h[hv].f16 == 3;
        /* fp8 pages are not the tile kernel's: all_fp8 (fp8_step, fp8_transfer) or the column
         * kernel, as the dense methods' (kernels/cuda/README.md) */
        L->all_quant &= pl->heads[hv].quantized && pl->heads[hv].method != STEPQ_METHOD_FP8;
        L->all_fp8 &= pl->heads[hv].method == STEPQ_METHOD_FP8;
        L->any_uniform |= h[hv].ubits != 0;
    }
    L->dense_bf16 = pl->n_heads > 0 && pl->head_offset[0] % 16 == 0 && pl->page_stride % 16 == 0;
    for (int hv = 0; hv < pl->n_heads && L->dense_bf16; hv++) {
        const struct stepq__head_layout *hl = &pl->heads[hv];
        L->dense_bf16 =
            hl->method == STEPQ_METHOD_BF16 && hl->arch == pl->heads[0].arch && hl->d_k == SQ_D &&
            hl->d_v == SQ_D && hl->codes_offset == 0 &&
            pl->head_offset[hv] == pl->head_offset[0] + (size_t)hv * SQ_D * SQ_D * sizeof(uint16_t);
    }
    L->dense_off = L->dense_bf16 ? pl->head_offset[0] : 0;
    free(h);
    *out = L;
    return STEPQ_OK;
fail:
    if (L && L->d_heads)
        cudaFree(L->d_heads);
    free(L);
    free(h);
    return rc;
}

extern "C" int stepq__cuda_layer_prepare(const struct stepq__packed_layer *pl,
                                         stepq__cuda_layer **out)
{
    return stepq__cuda_layer_prepare_ex(pl, 0, out);
}

extern "C" size_t stepq__cuda_layer_bytes_per_head(void)
{
    return sizeof(sq_head_desc);
}

extern "C" void stepq__cuda_layer_release(stepq__cuda_layer *L)
{
    if (!L)
        return;
    if (L->s2) {
        cudaStreamSynchronize(L->s2);
        cudaStreamDestroy(L->s2);
        cudaEventDestroy(L->ev_a);
        cudaEventDestroy(L->ev_b);
    }
    cudaFree(L->scratch);
    cudaFree(L->skip);
    cudaFree(L->d_heads);
    cudaGetLastError();
    free(L);
}

/* --- launches --- */

/*
 * Function attributes (the dynamic shared memory ceiling) belong to a
 * device's context, so each kernel raises its own once per device: a flag per
 * (kernel, device id) below SQ_ATTR_DEVICES, and on every launch for the
 * devices beyond. Benign races: the attribute call is idempotent and every
 * writer of a flag stores the same value.
 */
#define SQ_ATTR_DEVICES 64

/*
 * Launches kernel K on grid (256 threads, smem bytes of dynamic shared
 * memory), raising its dynamic shared memory ceiling on the first launch on
 * each device.
 */
template <auto K, typename... A>
static int launch_k(dim3 grid, size_t smem, cudaStream_t s, const char *who, const A &...args)
{
    static unsigned char attr_done[SQ_ATTR_DEVICES];
    if (grid.x == 0 || grid.y == 0)
        return STEPQ_OK;
    int dev = 0;
    SQ_CU(cudaGetDevice(&dev), who);
    const bool known = dev >= 0 && dev < SQ_ATTR_DEVICES;
    if (!known || !attr_done[dev]) {
        SQ_CU(cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, SQ_DYN_SMEM_MAX),
              who);
        if (known)
            attr_done[dev] = 1;
    }
    K<<<grid, SQ_THREADS, smem, s>>>(args...);
    SQ_CU(cudaGetLastError(), who);
    return STEPQ_OK;
}

template <int SRC, bool UPDATE, int SINK, bool NOREFIT = false, bool ROWS = false>
static int launch(dim3 grid, size_t smem, cudaStream_t s, const sq_step &st, const sq_io &io,
                  const char *who)
{
    return launch_k<sq_head_kernel<SRC, UPDATE, SINK, NOREFIT, ROWS>>(grid, smem, s, who, st, io);
}

/*
 * sq_head_kernel with the layer's decode fit (the column handle's decode steps): NOREFIT
 * for norefit, ROWS for rows.
 */
template <int SRC, bool UPDATE, int SINK>
static int launch_fit(dim3 grid, size_t smem, cudaStream_t s, const sq_step &st, const sq_io &io,
                      const stepq__cuda_layer *L, const char *who)
{
    if (L->fit == STEPQ_DECODE_FIT_NOREFIT)
        return launch<SRC, UPDATE, SINK, true>(grid, smem, s, st, io, who);
    if (L->fit == STEPQ_DECODE_FIT_ROWS)
        return launch<SRC, UPDATE, SINK, false, true>(grid, smem, s, st, io, who);
    return launch<SRC, UPDATE, SINK>(grid, smem, s, st, io, who);
}

template <int SRC, bool UPDATE, int SINK, int V>
static int launch_tile_v(dim3 grid, size_t smem, cudaStream_t s, const sq_step &st, const sq_io &io,
                         const char *who)
{
    return launch_k<sq_tile_kernel<SRC, UPDATE, SINK, V>>(grid, smem, s, who, st, io);
}

/*
 * The fused packed step with template bits ORDER or ORDER|RTU (v & SQ_V_RTU),
 * IN32 or IN16 after st.in_bf16, and N (0, SQ_V_NOREFIT or SQ_V_ROWS); g2 is already
 * the (batch, heads) grid.
 */
template <int N>
static int launch_step_tile(dim3 g2, size_t smem, cudaStream_t s, const sq_step &st,
                            const sq_io &io, int v, const char *who)
{
    constexpr int SRC = SQ_SRC_PACKED, SINK = SQ_SINK_PACKED;
    constexpr int O = SQ_V_ORDER | N, R = SQ_V_ORDER | SQ_V_RTU | N;
    if ((v & SQ_V_RTU) && st.in_bf16)
        return launch_tile_v<SRC, true, SINK, R | SQ_V_IN16>(g2, smem, s, st, io, who);
    if (v & SQ_V_RTU)
        return launch_tile_v<SRC, true, SINK, R | SQ_V_IN32>(g2, smem, s, st, io, who);
    if (st.in_bf16)
        return launch_tile_v<SRC, true, SINK, O | SQ_V_IN16>(g2, smem, s, st, io, who);
    return launch_tile_v<SRC, true, SINK, O | SQ_V_IN32>(g2, smem, s, st, io, who);
}

/*
 * The tile kernel with template bits v (SQ_V_*) among the instantiated sets:
 * packed step ORDER and ORDER|RTU, each with IN32 or IN16 after st.in_bf16,
 * each exact, NOREFIT or ROWS; pack 0, RTU, STAGE and RTU|STAGE, and
 * NOREFIT, RTU|NOREFIT, ROWS and RTU|ROWS (two-stage stage 2, whose fp32
 * scratch is [K,V]: never staged); dense bf16 step 0. ORDER launches the grid as (batch,
 * heads).
 */
template <int SRC, bool UPDATE, int SINK>
static int launch_tile(dim3 grid, size_t smem, cudaStream_t s, const sq_step &st, const sq_io &io,
                       int v, const char *who)
{
    if constexpr (SRC == SQ_SRC_PACKED && UPDATE && SINK == SQ_SINK_PACKED) {
        /* one instantiation per input dtype (SQ_V_IN32 / SQ_V_IN16) and decode fit */
        const dim3 g2(grid.y, grid.x);
        if (v & SQ_V_NOREFIT)
            return launch_step_tile<SQ_V_NOREFIT>(g2, smem, s, st, io, v, who);
        if (v & SQ_V_ROWS)
            return launch_step_tile<SQ_V_ROWS>(g2, smem, s, st, io, v, who);
        return launch_step_tile<0>(g2, smem, s, st, io, v, who);
    } else if constexpr (SINK == SQ_SINK_PACKED) {
        if ((v & SQ_V_NOREFIT) && (v & SQ_V_RTU))
            return launch_tile_v<SRC, UPDATE, SINK, SQ_V_RTU | SQ_V_NOREFIT>(grid, smem, s, st, io,
                                                                             who);
        if (v & SQ_V_NOREFIT)
            return launch_tile_v<SRC, UPDATE, SINK, SQ_V_NOREFIT>(grid, smem, s, st, io, who);
        if ((v & SQ_V_ROWS) && (v & SQ_V_RTU))
            return launch_tile_v<SRC, UPDATE, SINK, SQ_V_RTU | SQ_V_ROWS>(grid, smem, s, st, io,
                                                                          who);
        if (v & SQ_V_ROWS)
            return launch_tile_v<SRC, UPDATE, SINK, SQ_V_ROWS>(grid, smem, s, st, io, who);
        if ((v & SQ_V_RTU) && (v & SQ_V_STAGE))
            return launch_tile_v<SRC, UPDATE, SINK, SQ_V_RTU | SQ_V_STAGE>(grid, smem, s, st, io,
                                                                           who);
        if (v & SQ_V_STAGE)
            return launch_tile_v<SRC, UPDATE, SINK, SQ_V_STAGE>(grid, smem, s, st, io, who);
        if (v & SQ_V_RTU)
            return launch_tile_v<SRC, UPDATE, SINK, SQ_V_RTU>(grid, smem, s, st, io, who);
        return launch_tile_v<SRC, UPDATE, SINK, 0>(grid, smem, s, st, io, who);
    } else {
        return launch_tile_v<SRC, UPDATE, SINK, 0>(grid, smem, s, st, io, who);
    }
}

/* sq_unpack_kernel on a (heads, batch) grid: blocks resident together write neighbouring heads */
template <int DT, bool VK>
static int launch_unpack(dim3 grid, size_t smem, cudaStream_t s, const sq_io &io, const char *who)
{
    return launch_k<sq_unpack_kernel<DT, VK>>(grid, smem, s, who, io);
}

/*
 * sq_fp8_kernel (fp8_kernel.cuh) for a pack (PACK) or unpack of io's dense side, on a (heads,
 * batch) grid; the caller has checked fp8_transfer.
 */
template <bool PACK>
static int launch_fp8(dim3 grid, cudaStream_t s, const sq_io &io, const char *who)
{
    if (io.bf16)
        return io.layout_vk ? launch_k<sq_fp8_kernel<SQ_BF16, true, PACK>>(grid, 0, s, who, io)
                            : launch_k<sq_fp8_kernel<SQ_BF16, false, PACK>>(grid, 0, s, who, io);
    return io.layout_vk ? launch_k<sq_fp8_kernel<SQ_F32, true, PACK>>(grid, 0, s, who, io)
                        : launch_k<sq_fp8_kernel<SQ_F32, false, PACK>>(grid, 0, s, who, io);
}

/*
 * The warp kernel (dense_kernel.cuh) on bf16 dense states of io.layout_vk's layout, grid
 * (heads, batch); the caller has checked io.dense_vec. fp32 states stay on the column kernel:
 * the warp kernel measured 782 us against its 608 at B = 512 (kernels/cuda/README.md).
 */
static int launch_dense(dim3 grid, cudaStream_t s, const sq_step &st, const sq_io &io,
                        const char *who)
{
    return io.layout_vk ? launch_k<sq_dense_kernel<true>>(grid, 0, s, who, st, io)
                        : launch_k<sq_dense_kernel<false>>(grid, 0, s, who, st, io);
}

/* Dynamic shared memory of the tile kernel: the block and 16 bytes read past it. */
static size_t tile_smem(size_t max_block)
{
    return (max_block + 16 + 15) & ~(size_t)15;
}

/* A pack on the tile kernel: a [V,K] head is staged into the block's buffer (sq_stage_dense). */
static size_t pack_smem(size_t max_block, const sq_io &io)
{
    const size_t blk = tile_smem(max_block);
    const size_t dense = io.layout_vk ? SQ_STAGE_BYTES(io.bf16 ? 2 : 4) : 0;
    return blk > dense ? blk : dense;
}
static_assert(SQ_STAGE_BYTES(4) <= SQ_DYN_SMEM_MAX, "the staged fp32 head exceeds the attribute");
/* the fp16 KDA item reads a thread's 8 widths and 8 row offsets as one 8- and one 16-byte load */
static_assert(offsetof(sq_head_desc, bits) % 8 == 0 && offsetof(sq_head_desc, row_off) % 16 == 0 &&
                  sizeof(sq_head_desc) % 16 == 0,
              "sq_head_desc: bits and row_off misaligned");

static int dense_vec_ok(const void *p, size_t stride, stepq_dtype dtype);

/* The tile and unpack kernels read quantized blocks only; a column handle asked for neither. */
static int use_tile(const stepq__cuda_layer *L)
{
    return !L->column && L->all_quant;
}

/*
 * The fused decode step of an fp8 layer runs on the warp kernel's fp8 instantiation
 * (dense_kernel.cuh) where the pages allow 8- and 16-byte code accesses; otherwise, and for the
 * two-stage variant's stage 1, on the column kernel.
 */
static int fp8_step(const stepq__cuda_layer *L, const sq_io &io)
{
    return !L->column && L->all_fp8 && io.vec16;
}

/* fp8 transfers (sq_fp8_kernel) also need a dense side that allows 16-byte vectors. */
static int fp8_transfer(const stepq__cuda_layer *L, const sq_io &io)
{
    return fp8_step(L, io) && io.dense_vec;
}

/* Template bits of the pack: run-time widths without a uniform-width head; [V,K] staged. */
static int pack_variant(const stepq__cuda_layer *L, const sq_io &io)
{
    return (L->any_uniform ? 0 : SQ_V_RTU) | (io.layout_vk ? SQ_V_STAGE : 0);
}

static int check_args(const struct stepq__step_args *a, const char *who)
{
    int rc = stepq__check_step_args(a, who);
    if (rc < 0)
        return rc;
    if (a->d_k != SQ_D || a->d_v != SQ_D)
        return stepq__error(STEPQ_ENOTSUP, "%s: d_k=%d, d_v=%d; the CUDA kernels support 128 only",
                            who, a->d_k, a->d_v);
    if (a->batch > 65535)
        return stepq__error(STEPQ_EINVAL, "%s: batch %d > 65535", who, a->batch);
    if (a->batch > 0 && !a->slots)
        return stepq__error(STEPQ_EINVAL, "%s: NULL slot ids", who);
    return STEPQ_OK;
}

static sq_step make_step(const struct stepq__step_args *a)
{
    sq_step st;
    st.H = a->H;
    st.HV = a->HV;
    st.kda = a->arch == STEPQ_ARCH_KDA;
    st.l2norm = a->opt.l2norm;
    st.gate = a->opt.gate_in_kernel;
    st.beta_sig = a->opt.beta_sigmoid;
    st.scale = a->opt.scale;
    st.in_bf16 = a->dtype == STEPQ_DTYPE_BF16;
    st.par_bf16 = a->param_dtype == STEPQ_DTYPE_BF16;
    st.q = a->q;
    st.k = a->k;
    st.v = a->v;
    st.g = a->g;
    st.beta = a->beta;
    st.A_log = a->A_log;
    st.dt_bias = a->dt_bias;
    st.o = a->o;
    /* the packed defaults are resolved here, so the kernels never see a 0 stride */
    const struct stepq__step_strides sd = stepq__step_strides_of(a);
    st.q_stride = sd.q;
    st.k_stride = sd.k;
    st.v_stride = sd.v;
    st.g_stride = sd.g;
    st.beta_stride = sd.beta;
    st.o_stride = sd.o;
    return st;
}

static sq_io make_io(const struct stepq__packed_layer *pl, const stepq__cuda_layer *L)
{
    sq_io io;
    memset(&io, 0, sizeof(io));
    if (pl) {
        io.n_slots = pl->n_slots;
        io.pages = pl->base;
        io.page_stride = pl->page_stride;
        io.heads = L->d_heads;
        io.vec16 = L->offsets16 && pl->page_stride % 16 == 0 && (uintptr_t)pl->base % 16 == 0;
    }
    return io;
}

static int check_pages(const struct stepq__packed_layer *pl, const stepq__cuda_layer *L,
                       const char *who)
{
    if (!pl || !L || !pl->base || pl->n_slots < 1)
        return stepq__error(STEPQ_EINVAL, "%s: NULL layer, handle or pages, or n_slots < 1", who);
    if (pl->n_heads != L->n_heads)
        return stepq__error(STEPQ_EINVAL, "%s: layer has %d heads, the prepared handle %d", who,
                            pl->n_heads, L->n_heads);
    /* Blocks are moved with 16-byte vectors and read as fp32/fp16 words. */
    if ((uintptr_t)pl->base % 16 || pl->page_stride % 16)
        return stepq__error(STEPQ_EINVAL, "%s: page base %p or stride %zu not 16-byte aligned", who,
                            (void *)pl->base, pl->page_stride);
    for (int hv = 0; hv < pl->n_heads; hv++)
        if (pl->head_offset[hv] + pl->heads[hv].block_bytes > pl->page_stride)
            return stepq__error(STEPQ_EINVAL, "%s: head %d block exceeds the page (%zu B)", who, hv,
                                pl->page_stride);
    return STEPQ_OK;
}

extern "C" int stepq__cuda_step_packed_prepared(const struct stepq__step_args *a,
                                                const struct stepq__packed_layer *pl,
                                                stepq__cuda_layer *L, stepq__cuda_variant variant)
{
    static const char who[] = "cuda step (packed)";
    int rc = check_args(a, who);
    if (rc < 0 || a->batch == 0)
        return rc;
    if ((rc = check_pages(pl, L, who)) < 0)
        return rc;
    if (pl->n_heads != a->HV)
        return stepq__error(STEPQ_EINVAL, "%s: the layer has %d heads, the step %d", who,
                            pl->n_heads, a->HV);
    for (int hv = 0; hv < pl->n_heads; hv++)
        if (pl->heads[hv].arch != a->arch)
            return stepq__error(STEPQ_EINVAL, "%s: head %d is laid out for another arch", who, hv);
    cudaStream_t s = (cudaStream_t)a->stream;
    sq_step st = make_step(a);
    sq_io io = make_io(pl, L);
    io.slots = a->slots;
    io.health = a->health;
    io.counts = (unsigned long long *)a->counts;
    dim3 grid((unsigned)a->HV, (unsigned)a->batch);
    size_t smem = dyn_smem(L->max_block);

    if (variant == STEPQ__CUDA_FUSED && !L->column && L->dense_bf16) {
        /* a bf16 page is a dense bf16 state of page_stride / 2 elements per slot */
        io.dense = pl->base + L->dense_off;
        io.dense_stride = pl->page_stride / sizeof(uint16_t);
        io.dense_vec = dense_vec_ok(io.dense, io.dense_stride, STEPQ_DTYPE_BF16);
        io.dense_by_slot = 1;
        io.bf16 = 1;
        if (io.dense_vec)
            return launch_dense(grid, s, st, io, who);
        return launch_tile<SQ_SRC_DENSE, true, SQ_SINK_DENSE>(grid, 0, s, st, io, 0, who);
    }
    if (variant == STEPQ__CUDA_FUSED && fp8_step(L, io))
        return launch_k<sq_dense_kernel<false, true>>(grid, 0, s, who, st, io);
    const int tile = use_tile(L);
    if (tile)
        smem = tile_smem(L->max_block);
    if (L->any_f16 && (variant != STEPQ__CUDA_FUSED || !tile))
        return stepq__error(STEPQ_ENOTSUP,
                            "%s: the layer's arith is fp16, which only the fused step on the "
                            "tile kernels implements (not the %s)",
                            who,
                            variant != STEPQ__CUDA_FUSED ? "two-stage variant" : "column kernels");
    if (L->any_f16 && L->f16_kda) {
        /* KDA: every head on the run-time-width item, its own instantiation (SQ_V_KDA) */
        const dim3 g2(grid.y, grid.x);
        constexpr int K = SQ_V_KDA;
        if (L->fit == STEPQ_DECODE_FIT_NOREFIT)
            return st.in_bf16 ? launch_k<sq_f16_kernel<K | SQ_V_IN16 | SQ_V_NOREFIT>>(g2, 0, s, who,
                                                                                      st, io)
                              : launch_k<sq_f16_kernel<K | SQ_V_IN32 | SQ_V_NOREFIT>>(g2, 0, s, who,
                                                                                      st, io);
        if (L->f16_occ3)
            return st.in_bf16 ? launch_k<sq_f16_kernel<K | SQ_V_IN16, 3>>(g2, 0, s, who, st, io)
                              : launch_k<sq_f16_kernel<K | SQ_V_IN32, 3>>(g2, 0, s, who, st, io);
        return st.in_bf16 ? launch_k<sq_f16_kernel<K | SQ_V_IN16>>(g2, 0, s, who, st, io)
                          : launch_k<sq_f16_kernel<K | SQ_V_IN32>>(g2, 0, s, who, st, io);
    }
    if (L->any_f16) {
        /* the fp16 kernel takes every head, its pivot heads included, on a (batch, heads) grid */
        const dim3 g2(grid.y, grid.x);
        if (L->fit == STEPQ_DECODE_FIT_NOREFIT) /* the map check allows exact and norefit */
            return st.in_bf16
                       ? launch_k<sq_f16_kernel<SQ_V_IN16 | SQ_V_NOREFIT>>(g2, 0, s, who, st, io)
                       : launch_k<sq_f16_kernel<SQ_V_IN32 | SQ_V_NOREFIT>>(g2, 0, s, who, st, io);
        /* 3 blocks per SM: a bench comparison row of the exact fit only */
        if (L->f16_occ3)
            return st.in_bf16 ? launch_k<sq_f16_kernel<SQ_V_IN16, 3>>(g2, 0, s, who, st, io)
                              : launch_k<sq_f16_kernel<SQ_V_IN32, 3>>(g2, 0, s, who, st, io);
        return st.in_bf16 ? launch_k<sq_f16_kernel<SQ_V_IN16>>(g2, 0, s, who, st, io)
                          : launch_k<sq_f16_kernel<SQ_V_IN32>>(g2, 0, s, who, st, io);
    }
    /* grid by head (measured faster: one width's code hot per SM); run-time widths when no head is
     * uniform (less code) */
    const int vt = SQ_V_ORDER | (L->any_uniform ? 0 : SQ_V_RTU) |
                   (L->fit == STEPQ_DECODE_FIT_NOREFIT ? SQ_V_NOREFIT : 0) |
                   (L->fit == STEPQ_DECODE_FIT_ROWS ? SQ_V_ROWS : 0); /* the map's decode_fit */
    if (variant == STEPQ__CUDA_FUSED)
        return tile
                   ? launch_tile<SQ_SRC_PACKED, true, SQ_SINK_PACKED>(grid, smem, s, st, io, vt,
                                                                      who)
                   : launch_fit<SQ_SRC_PACKED, true, SQ_SINK_PACKED>(grid, smem, s, st, io, L, who);
    if (variant != STEPQ__CUDA_TWO_STAGE)
        return stepq__error(STEPQ_EINVAL, "%s: unknown variant %d", who, (int)variant);

    /* Stage 1 writes fp32 [batch][HV][K][V] scratch, stage 2 packs it on s2. */
    size_t need = (size_t)a->batch * (size_t)a->HV;
    if (need > L->scratch_heads) {
        SQ_CU(cudaStreamSynchronize(s), who); /* the old scratch may still be read */
        if (L->s2)
            SQ_CU(cudaStreamSynchronize(L->s2), who);
        cudaFree(L->scratch);
        cudaFree(L->skip);
        L->scratch = NULL;
        L->skip = NULL;
        L->scratch_heads = 0;
        SQ_CU(cudaMalloc((void **)&L->scratch, need * SQ_D * SQ_D * sizeof(float)), who);
        SQ_CU(cudaMalloc((void **)&L->skip, need * sizeof(int)), who);
        L->scratch_heads = need;
    }
    if (!L->s2) {
        SQ_CU(cudaStreamCreateWithFlags(&L->s2, cudaStreamNonBlocking), who);
        SQ_CU(cudaEventCreateWithFlags(&L->ev_a, cudaEventDisableTiming), who);
        SQ_CU(cudaEventCreateWithFlags(&L->ev_b, cudaEventDisableTiming), who);
    }
    io.dense = L->scratch;
    io.dense_vec = 1; /* cudaMalloc'd, stride a multiple of 16 KiB */
    io.skip = L->skip;
    io.dense_stride = (size_t)a->HV * SQ_D * SQ_D;
    io.dense_by_slot = 0;
    /*
     * Stage 1 stays on the thread-per-column kernel: its fp32 scratch store
     * is row-coalesced there (measured 2x faster than the tile kernel's).
     */
    rc = launch<SQ_SRC_PACKED, true, SQ_SINK_DENSE>(grid, dyn_smem(L->max_block), s, st, io, who);
    if (rc < 0)
        return rc;
    SQ_CU(cudaEventRecord(L->ev_a, s), who);
    SQ_CU(cudaStreamWaitEvent(L->s2, L->ev_a, 0), who);
    /* Stage 2 has no recurrence inputs: input health was noted by stage 1. It is the
     * step's fit, so it takes the decode fit (vt's SQ_V_NOREFIT / SQ_V_ROWS: the latter
     * reads the old column scales from the page, which stage 1 left as it was), unlike a
     * prefill pack. */
    if (tile)
        rc = launch_tile<SQ_SRC_DENSE, false, SQ_SINK_PACKED>(grid, pack_smem(L->max_block, io),
                                                              L->s2, st, io, vt & ~SQ_V_ORDER, who);
    else if (fp8_transfer(L, io))
        rc = launch_fp8<true>(grid, L->s2, io, who);
    else
        rc = launch_fit<SQ_SRC_DENSE, false, SQ_SINK_PACKED>(grid, smem, L->s2, st, io, L, who);
    if (rc < 0)
        return rc;
    SQ_CU(cudaEventRecord(L->ev_b, L->s2), who);
    SQ_CU(cudaStreamWaitEvent(s, L->ev_b, 0), who);
    return STEPQ_OK;
}

/* Whether [V,K] tiles may move as 16-byte (fp32) / 8-byte (bf16) vectors. */
static int dense_vec_ok(const void *p, size_t stride, stepq_dtype dtype)
{
    size_t es = dtype == STEPQ_DTYPE_BF16 ? 2 : 4;
    return (uintptr_t)p % 16 == 0 && (stride * es) % 16 == 0;
}

static int check_dense_io(int n, const int32_t *slots, const void *buf, size_t stride, int HV,
                          stepq__layout layout, stepq_dtype dtype, const char *who)
{
    if (n < 0 || n > 65535)
        return stepq__error(STEPQ_EINVAL, "%s: n = %d outside 0..65535", who, n);
    if (n > 0 && (!slots || !buf))
        return stepq__error(STEPQ_EINVAL, "%s: NULL slot ids or dense tensor", who);
    if (n > 0 && stride < (size_t)HV * SQ_D * SQ_D)
        return stepq__error(STEPQ_EINVAL, "%s: stride %zu < HV*d_k*d_v = %zu", who, stride,
                            (size_t)HV * SQ_D * SQ_D);
    if (layout != STEPQ__LAYOUT_KV && layout != STEPQ__LAYOUT_VK)
        return stepq__error(STEPQ_EINVAL, "%s: unknown layout %d", who, (int)layout);
    /* as stepq__check_step_args: fp16 is a stepq_dtype, but no kernel reads or writes it */
    if (dtype == STEPQ_DTYPE_FP16)
        return stepq__error(STEPQ_ENOTSUP, "%s: dtype fp16 is not supported (fp32, bf16)", who);
    if (dtype != STEPQ_DTYPE_FP32 && dtype != STEPQ_DTYPE_BF16)
        return stepq__error(STEPQ_ENOTSUP, "%s: dtype %d is not supported (fp32, bf16)", who,
                            (int)dtype);
    return STEPQ_OK;
}

/* The work description of a pack / unpack: the layer's pages and one dense tensor per entry. */
static sq_io transfer_io(const struct stepq__packed_layer *pl, const stepq__cuda_layer *L,
                         const int32_t *slots, void *dense, size_t stride, stepq__layout layout,
                         stepq_dtype dtype)
{
    sq_io io = make_io(pl, L);
    io.slots = slots;
    io.dense = dense;
    io.dense_stride = stride;
    io.dense_vec = dense_vec_ok(dense, stride, dtype);
    io.layout_vk = layout == STEPQ__LAYOUT_VK;
    io.bf16 = dtype == STEPQ_DTYPE_BF16;
    return io;
}

extern "C" int stepq__cuda_pack_prepared(const struct stepq__packed_layer *pl, stepq__cuda_layer *L,
                                         int n, const int32_t *slots, const void *src,
                                         size_t src_stride, stepq__layout layout, stepq_dtype dtype,
                                         uint32_t *health, uint64_t *counts, void *stream)
{
    static const char who[] = "cuda pack";
    int rc = check_pages(pl, L, who);
    if (rc < 0)
        return rc;
    if ((rc = check_dense_io(n, slots, src, src_stride, pl->n_heads, layout, dtype, who)) < 0 ||
        n == 0)
        return rc;
    sq_step st;
    memset(&st, 0, sizeof(st));
    st.H = st.HV = pl->n_heads;
    sq_io io = transfer_io(pl, L, slots, (void *)src, src_stride, layout, dtype);
    io.health = health;
    io.counts = (unsigned long long *)counts;
    dim3 grid((unsigned)pl->n_heads, (unsigned)n);
    if (use_tile(L))
        return launch_tile<SQ_SRC_DENSE, false, SQ_SINK_PACKED>(grid, pack_smem(L->max_block, io),
                                                                (cudaStream_t)stream, st, io,
                                                                pack_variant(L, io), who);
    if (fp8_transfer(L, io))
        return launch_fp8<true>(grid, (cudaStream_t)stream, io, who);
    return launch<SQ_SRC_DENSE, false, SQ_SINK_PACKED>(grid, dyn_smem(L->max_block),
                                                       (cudaStream_t)stream, st, io, who);
}

extern "C" int stepq__cuda_unpack_prepared(const struct stepq__packed_layer *pl,
                                           stepq__cuda_layer *L, int n, const int32_t *slots,
                                           void *dst, size_t dst_stride, stepq__layout layout,
                                           stepq_dtype dtype, void *stream)
{
    static const char who[] = "cuda unpack";
    int rc = check_pages(pl, L, who);
    if (rc < 0)
        return rc;
    if ((rc = check_dense_io(n, slots, dst, dst_stride, pl->n_heads, layout, dtype, who)) < 0 ||
        n == 0)
        return rc;
    sq_step st;
    memset(&st, 0, sizeof(st));
    st.H = st.HV = pl->n_heads;
    sq_io io = transfer_io(pl, L, slots, dst, dst_stride, layout, dtype);
    if (use_tile(L)) {
        const dim3 grid((unsigned)pl->n_heads, (unsigned)n);
        const size_t smem = tile_smem(L->max_block);
        cudaStream_t s = (cudaStream_t)stream;
        if (io.bf16)
            return io.layout_vk ? launch_unpack<SQ_BF16, true>(grid, smem, s, io, who)
                                : launch_unpack<SQ_BF16, false>(grid, smem, s, io, who);
        return io.layout_vk ? launch_unpack<SQ_F32, true>(grid, smem, s, io, who)
                            : launch_unpack<SQ_F32, false>(grid, smem, s, io, who);
    }
    if (fp8_transfer(L, io))
        return launch_fp8<false>(dim3((unsigned)pl->n_heads, (unsigned)n), (cudaStream_t)stream, io,
                                 who);
    return launch<SQ_SRC_PACKED, false, SQ_SINK_DENSE>(dim3((unsigned)pl->n_heads, (unsigned)n),
                                                       dyn_smem(L->max_block), (cudaStream_t)stream,
                                                       st, io, who);
}

extern "C" int stepq__cuda_step_dense_ex(const struct stepq__step_args *a, void *base,
                                         size_t slot_stride, stepq__layout layout,
                                         stepq_dtype dtype, unsigned flags)
{
    static const char who[] = "cuda step (dense)";
    /* STEPQ__CUDA_COLUMN only: the fp16 kernel's occupancy flag is a packed layer's */
    if (flags & ~STEPQ__CUDA_COLUMN)
        return stepq__error(STEPQ_EINVAL, "%s: unknown flags 0x%x", who, flags);
    int rc = check_args(a, who);
    if (rc < 0 || a->batch == 0)
        return rc;
    if (a->n_slots < 1)
        return stepq__error(STEPQ_EINVAL, "%s: n_slots = %d", who, a->n_slots);
    if ((rc = check_dense_io(a->batch, a->slots, base, slot_stride, a->HV, layout, dtype, who)) < 0)
        return rc;
    sq_step st = make_step(a);
    sq_io io;
    memset(&io, 0, sizeof(io));
    io.n_slots = a->n_slots;
    io.slots = a->slots;
    io.dense = base;
    io.dense_stride = slot_stride;
    io.dense_vec = dense_vec_ok(base, slot_stride, dtype);
    io.dense_by_slot = 1;
    io.layout_vk = layout == STEPQ__LAYOUT_VK;
    io.bf16 = dtype == STEPQ_DTYPE_BF16;
    io.health = a->health;
    io.counts = (unsigned long long *)a->counts;
    dim3 grid((unsigned)a->HV, (unsigned)a->batch);
    /*
     * The warp kernel where the states allow 16-byte vectors (kernels/cuda/README.md, "The warp
     * kernel"); else bf16 states on the tile kernel (8 bf16 per 16-byte access where it can, scalar
     * elsewhere) and fp32 on the thread-per-column kernel. STEPQ__CUDA_COLUMN: the column kernel.
     */
    if (!(flags & STEPQ__CUDA_COLUMN) && io.dense_vec && io.bf16)
        return launch_dense(grid, (cudaStream_t)a->stream, st, io, who);
    if (!(flags & STEPQ__CUDA_COLUMN) && dtype == STEPQ_DTYPE_BF16)
        return launch_tile<SQ_SRC_DENSE, true, SQ_SINK_DENSE>(grid, 0, (cudaStream_t)a->stream, st,
                                                              io, 0, who);
    return launch<SQ_SRC_DENSE, true, SQ_SINK_DENSE>(grid, 0, (cudaStream_t)a->stream, st, io, who);
}

extern "C" int stepq__cuda_step_dense(const struct stepq__step_args *a,
                                      const struct stepq__dense_states *st)
{
    if (!st)
        return stepq__error(STEPQ_EINVAL, "cuda step (dense): NULL states");
    return stepq__cuda_step_dense_ex(a, st->base, st->slot_stride, st->layout, STEPQ_DTYPE_FP32, 0);
}
