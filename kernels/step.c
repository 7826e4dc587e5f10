/*
 * The C reference of the kernels that work on packed pages: the decode step
 * quantize(update(dequantize(page))) (paper Eq. 4), pack and unpack over a
 * list of slots, on top of recurrence.c: the argument checks, the input
 * preparation and the per-head update it shares with the dense step are
 * recurrence.c's (declared in kernels/dsp.h). Calls go one way, from here
 * to there; nothing in recurrence.c calls this file.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/dsp.h"
#include "kernels/quant.h"
#include "plugin/err.h"

/* Everything about the pages is checked before the first byte is written. */
static int check_layer(const struct stepq__packed_layer *pl, int d_k, int d_v, const char *who)
{
    if (!pl || !pl->base || !pl->heads || !pl->head_offset)
        return stepq__error(STEPQ_EINVAL, "%s: NULL packed layer, pages, layouts or offsets", who);
    if (pl->n_heads < 1 || pl->n_slots < 1)
        return stepq__error(STEPQ_EINVAL, "%s: n_heads=%d, n_slots=%d", who, pl->n_heads,
                            pl->n_slots);
    for (int h = 0; h < pl->n_heads; h++) {
        const struct stepq__head_layout *hl = &pl->heads[h];
        if (!hl->row_bitoff || hl->d_k != d_k || hl->d_v != d_v)
            return stepq__error(STEPQ_EINVAL,
                                "%s: head %d layout is %dx%d (or not initialised), expected %dx%d",
                                who, h, hl->d_k, hl->d_v, d_k, d_v);
        if (pl->head_offset[h] + hl->block_bytes > pl->page_stride)
            return stepq__error(
                STEPQ_EINVAL, "%s: head %d block [%zu, %zu) exceeds the page (%zu B)", who, h,
                pl->head_offset[h], pl->head_offset[h] + hl->block_bytes, pl->page_stride);
        if (pl->row_impact && stepq__method_uses_row_impact(hl->method))
            for (int i = 0; i < d_k; i++) {
                float w = pl->row_impact[(size_t)h * d_k + i];
                if (!(w > 0.0f) || !isfinite(w))
                    return stepq__error(STEPQ_EINVAL,
                                        "%s: row impact of head %d row %d is %g (need finite > 0)",
                                        who, h, i, (double)w);
            }
    }
    return STEPQ_OK;
}

static uint8_t *head_block(const struct stepq__packed_layer *pl, int32_t slot, int h)
{
    return pl->base + (size_t)slot * pl->page_stride + pl->head_offset[h];
}

static const float *head_w(const struct stepq__packed_layer *pl, int h, int d_k)
{
    return pl->row_impact ? pl->row_impact + (size_t)h * d_k : NULL;
}

int stepq__ref_step_packed(const struct stepq__step_args *a, const struct stepq__packed_layer *pl)
{
    static const char who[] = "step (packed)";
    int rc = stepq__check_step_args(a, who);

    if (rc < 0 || a->batch == 0)
        return rc;
    if ((rc = check_layer(pl, a->d_k, a->d_v, who)) < 0)
        return rc;
    if (pl->n_heads != a->HV)
        return stepq__error(STEPQ_EINVAL, "%s: the layer has %d heads, the step %d", who,
                            pl->n_heads, a->HV);
    for (int h = 0; h < pl->n_heads; h++)
        if (pl->heads[h].arch != a->arch)
            return stepq__error(STEPQ_EINVAL, "%s: head %d is laid out for another arch", who, h);
    if ((rc = stepq__check_slot_list(a->batch, a->slots, pl->n_slots, 1, who)) < 0)
        return rc;

    /* the fp32 tile, or the fp16 step's scratch (two tiles) */
    float *tile = malloc(sizeof(float) * 2 * (size_t)a->d_k * a->d_v);
    if (!tile)
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory", who);

    float q[STEPQ__MAX_HEAD_DIM], k[STEPQ__MAX_HEAD_DIM], v[STEPQ__MAX_HEAD_DIM];
    float g[STEPQ__MAX_HEAD_DIM], beta, o[STEPQ__MAX_HEAD_DIM];
    for (int b = 0; b < a->batch; b++) {
        int32_t s = a->slots[b];
        if (s < 0)
            continue;
        for (int h = 0; h < a->HV; h++) {
            /* On a non-finite input the page keeps its previous, valid content. */
            if (stepq__prep_step_head(a, b, h, s, q, k, v, g, &beta))
                continue;
            const struct stepq__head_layout *hl = &pl->heads[h];
            uint8_t *blk = head_block(pl, s, h);
            if (hl->arith == STEPQ_ARITH_FP16 && stepq__step_f16_supports(hl)) {
                uint32_t fl = stepq__step_head_f16(hl, blk, head_w(pl, h, a->d_k), q, k, v, g, beta,
                                                   blk, o, tile, NULL);
                stepq__store_out(a, b, h, o);
                stepq__health_note(a->health, a->counts, s, fl);
                continue;
            }
            stepq__dequantize_head(hl, blk, tile);
            uint32_t fl = stepq__head_update(tile, (size_t)a->d_v, 1, a->arch == STEPQ_ARCH_KDA,
                                             a->d_k, a->d_v, q, k, v, g, beta, o);
            /* Cannot fail: layout and w were validated above, the tile is finite. The
             * decode step's fit is the layout's (the map's decode_fit); packs fit exactly.
             * The fit rows reads the column scales of blk, the old block, before writing it. */
            stepq__quantize_head_fit(hl, tile, head_w(pl, h, a->d_k), blk, blk, &fl,
                                     hl->decode_fit);
            stepq__store_out(a, b, h, o);
            stepq__health_note(a->health, a->counts, s, fl);
        }
    }
    free(tile);
    return STEPQ_OK;
}

/*
 * What pack and unpack check before touching a page: the layer (its first
 * head gives d_k x d_v), the slot ids (distinct when pages are written), the
 * fp32 buffer `what` of n rows of `stride` floats, and the layout.
 */
static int check_transfer(const struct stepq__packed_layer *pl, int n, const int32_t *slots,
                          int distinct, const float *buf, size_t stride, stepq__layout layout,
                          const char *what, const char *who)
{
    int rc;

    if (!pl || !pl->heads)
        return stepq__error(STEPQ_EINVAL, "%s: NULL packed layer", who);
    int d_k = pl->heads[0].d_k, d_v = pl->heads[0].d_v;
    if ((rc = check_layer(pl, d_k, d_v, who)) < 0)
        return rc;
    if ((rc = stepq__check_slot_list(n, slots, pl->n_slots, distinct, who)) < 0)
        return rc;
    size_t head = (size_t)d_k * d_v;
    if (n > 0 && (!buf || stride < head * (size_t)pl->n_heads))
        return stepq__error(STEPQ_EINVAL, "%s: NULL %s or stride %zu < HV*d_k*d_v = %zu", who, what,
                            stride, head * (size_t)pl->n_heads);
    if (layout != STEPQ__LAYOUT_KV && layout != STEPQ__LAYOUT_VK)
        return stepq__error(STEPQ_EINVAL, "%s: unknown layout %d", who, (int)layout);
    return STEPQ_OK;
}

/* dst = src^T for a rows x cols src: turns one head between the KV and VK layouts. */
static void transpose(float *dst, const float *src, int rows, int cols)
{
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            dst[(size_t)c * rows + r] = src[(size_t)r * cols + c];
}

int stepq__ref_pack(const struct stepq__packed_layer *pl, int n, const int32_t *slots,
                    const float *src, size_t src_stride, stepq__layout layout, uint32_t *health,
                    uint64_t *counts, void *stream)
{
    static const char who[] = "pack";
    int rc;

    (void)stream;
    if ((rc = check_transfer(pl, n, slots, 1, src, src_stride, layout, "source", who)) < 0)
        return rc;
    int d_k = pl->heads[0].d_k, d_v = pl->heads[0].d_v;
    size_t head = (size_t)d_k * d_v;

    float *tile = malloc(sizeof(float) * head);
    if (!tile)
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory", who);
    for (int e = 0; e < n; e++) {
        int32_t s = slots[e];
        if (s < 0)
            continue;
        for (int h = 0; h < pl->n_heads; h++) {
            const float *x = src + (size_t)e * src_stride + (size_t)h * head;
            if (layout == STEPQ__LAYOUT_VK) {
                transpose(tile, x, d_v, d_k);
                x = tile;
            }
            uint32_t fl = 0;
            stepq__quantize_head(&pl->heads[h], x, head_w(pl, h, d_k), head_block(pl, s, h), &fl);
            stepq__health_note(health, counts, s, fl);
        }
    }
    free(tile);
    return STEPQ_OK;
}

int stepq__ref_unpack(const struct stepq__packed_layer *pl, int n, const int32_t *slots, float *dst,
                      size_t dst_stride, stepq__layout layout, void *stream)
{
    static const char who[] = "unpack";
    int rc;

    (void)stream;
    if ((rc = check_transfer(pl, n, slots, 0, dst, dst_stride, layout, "destination", who)) < 0)
        return rc;
    int d_k = pl->heads[0].d_k, d_v = pl->heads[0].d_v;
    size_t head = (size_t)d_k * d_v;

    float *tile = malloc(sizeof(float) * head);
    if (!tile)
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory", who);
    for (int e = 0; e < n; e++) {
        int32_t s = slots[e];
        if (s < 0)
            continue;
        for (int h = 0; h < pl->n_heads; h++) {
            float *x = dst + (size_t)e * dst_stride + (size_t)h * head;
            if (layout == STEPQ__LAYOUT_KV) {
                stepq__dequantize_head(&pl->heads[h], head_block(pl, s, h), x);
                continue;
            }
            stepq__dequantize_head(&pl->heads[h], head_block(pl, s, h), tile);
            transpose(x, tile, d_k, d_v);
        }
    }
    free(tile);
    return STEPQ_OK;
}
