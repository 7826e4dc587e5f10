/*
 * Page layout: where each head block and each conv state sits inside one
 * slot's page, and how many slots a configuration gets.
 *
 * A page is, in this order:
 *   for each recurrent layer l, for each local value head h:
 *       the head block of (l, h)  (kernels/format.h; block_bytes, aligned)
 *   for each recurrent layer l:
 *       the conv state of l on this rank, native dtype, opaque bytes
 *   tail padding up to page_align and min_page_bytes
 * Layer-major head order keeps the blocks one decode step of one layer reads
 * contiguous within a page. The conv state is not quantized: the pool only
 * stores its bytes, the server's conv kernel reads them through the strided
 * view base + slot * page_bytes + conv_offset[l].
 *
 * Tensor parallelism: rank r of tp holds value heads [r*HV/tp, (r+1)*HV/tp)
 * and 1/tp of every layer's conv state: its channels, the rule of pool/conv.h
 * that tp/ shares, so the shape the conv view reports is this rank's.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/format.h"
#include "pool/conv.h"
#include "kernels/quant.h"
#include "plugin/hash.h"
#include "pool/internal.h"

/* Limits of the alignment and size fields (the config's checks name them). */
#define MAX_PAGE_ALIGN     (UINT64_C(1) << 30) /* 1 GiB: pages align to at most a huge page */
#define MAX_BLOCK_ALIGN    4096u               /* a head block aligns to at most a page */
#define MAX_MIN_PAGE_BYTES (UINT64_C(1) << 48)

static uint64_t round_up(uint64_t x, uint64_t align)
{
    return (x + align - 1) / align * align;
}

static int is_pow2(uint64_t x)
{
    return x && !(x & (x - 1));
}

void stepq__pool_layout_free(struct stepq__pool_layout *layout)
{
    if (!layout)
        return;
    free(layout->block_offset);
    free(layout->block_bytes);
    free(layout->block_compact);
    free(layout->unit_bits);
    free(layout->conv_offset);
    if (layout->heads)
        for (int b = 0; b < layout->pub.n_blocks; b++)
            stepq__head_layout_free(&layout->heads[b]);
    free(layout->heads);
    free(layout->head_off);
    free(layout->row_impact);
    memset(layout, 0, sizeof(*layout));
}

uint64_t stepq__pool_layout_fingerprint(const stepq_pool_layout *l)
{
    uint64_t h = STEPQ__FNV_OFFSET;
    int64_t head[] = { l->arch,
                       l->method,
                       l->n_layers,
                       l->n_local_heads,
                       l->first_head,
                       l->d_k,
                       l->d_v,
                       l->units_per_head,
                       (int64_t)l->page_bytes,
                       (int64_t)l->conv_bytes_per_layer };

    h = stepq__fnv1a(h, head, sizeof(head));
    h = stepq__fnv1a(h, l->block_offset, (size_t)l->n_blocks * sizeof(*l->block_offset));
    h = stepq__fnv1a(h, l->block_bytes, (size_t)l->n_blocks * sizeof(*l->block_bytes));
    h = stepq__fnv1a(h, l->unit_bits, (size_t)l->n_blocks * (size_t)l->units_per_head);
    h = stepq__fnv1a(h, l->conv_offset, (size_t)l->n_layers * sizeof(*l->conv_offset));
    return h;
}

static int alloc_tables(struct stepq__pool_layout *out, int n_layers, int n_heads,
                        int units_per_head, char *err)
{
    size_t nb = (size_t)n_layers * (size_t)n_heads;

    out->block_offset = calloc(nb ? nb : 1, sizeof(*out->block_offset));
    out->block_bytes = calloc(nb ? nb : 1, sizeof(*out->block_bytes));
    out->block_compact = calloc(nb ? nb : 1, sizeof(*out->block_compact));
    out->unit_bits = calloc(nb ? nb * (size_t)units_per_head : 1, 1);
    out->conv_offset = calloc(n_layers ? (size_t)n_layers : 1, sizeof(*out->conv_offset));
    if (!out->block_offset || !out->block_bytes || !out->block_compact || !out->unit_bits ||
        !out->conv_offset) {
        stepq__pool_layout_free(out);
        return stepq__error_obj(err, STEPQ_ENOMEM, "out of memory (page layout tables)");
    }
    out->pub.n_layers = n_layers;
    out->pub.n_local_heads = n_heads;
    out->pub.n_blocks = (int)nb;
    out->pub.units_per_head = units_per_head;
    return STEPQ_OK;
}

/* Places the conv states after the blocks, pads the page, fills the public view. */
static int finish(struct stepq__pool_layout *out, uint64_t conv_per_layer, uint64_t block_align,
                  uint64_t page_align, uint64_t min_page_bytes, char *err)
{
    stepq_pool_layout *l = &out->pub;
    uint64_t off = 0, compact = 0;

    for (int b = 0; b < l->n_blocks; b++) {
        if (out->block_offset[b] != off)
            return stepq__error_obj(err, STEPQ_EINTERNAL, "block %d not contiguous", b);
        off += out->block_bytes[b];
        compact += out->block_compact[b];
    }
    l->state_bytes = off;
    l->state_bytes_compact = compact;
    for (int i = 0; i < l->n_layers; i++) {
        off = round_up(off, block_align);
        out->conv_offset[i] = off;
        off += conv_per_layer;
    }
    l->conv_bytes_per_layer = conv_per_layer;
    l->conv_bytes = conv_per_layer * (uint64_t)l->n_layers;
    if (off < min_page_bytes)
        off = min_page_bytes;
    off = round_up(off, page_align);
    if (off == 0)
        return stepq__error_obj(err, STEPQ_EINVAL, "the page layout is empty (no state, no conv)");
    l->page_bytes = off;
    l->pad_bytes = off - l->state_bytes - l->conv_bytes;
    l->block_offset = out->block_offset;
    l->block_bytes = out->block_bytes;
    l->block_compact = out->block_compact;
    l->unit_bits = out->unit_bits;
    l->conv_offset = out->conv_offset;
    l->fingerprint = stepq__pool_layout_fingerprint(l);
    return STEPQ_OK;
}

int stepq__pool_layout_synthetic(int n_layers, int n_heads, const uint32_t *block_compact,
                                 uint64_t conv_bytes_per_layer, uint32_t block_align,
                                 uint64_t page_align, uint64_t min_page_bytes,
                                 struct stepq__pool_layout *out)
{
    uint64_t off = 0;
    int ret;

    memset(out, 0, sizeof(*out));
    if (n_layers < 1 || n_heads < 0 || !is_pow2(block_align) || !is_pow2(page_align) ||
        page_align < 16 || (n_heads > 0 && !block_compact))
        return stepq__error(STEPQ_EINVAL, "synthetic layout: bad arguments");
    ret = alloc_tables(out, n_layers, n_heads, 1, NULL);
    if (ret < 0)
        return ret;
    out->pub.arch = STEPQ_ARCH_GDN;
    out->pub.method = STEPQ_METHOD_FP32;
    for (int b = 0; b < out->pub.n_blocks; b++) {
        out->block_offset[b] = off;
        out->block_compact[b] = block_compact[b];
        out->block_bytes[b] = (uint32_t)round_up(block_compact[b], block_align);
        off += out->block_bytes[b];
    }
    ret = finish(out, conv_bytes_per_layer, block_align, page_align, min_page_bytes, NULL);
    if (ret < 0)
        stepq__pool_layout_free(out);
    return ret;
}

int stepq__pool_layout_build(const stepq_pool_config *cfg, struct stepq__pool_layout *out,
                             char *err)
{
    const stepq_map_t *map = cfg->map;
    stepq_model_shape shape;
    stepq_method method;
    uint64_t page_align = cfg->page_align ? cfg->page_align : STEPQ__POOL_PAGE_ALIGN;
    uint64_t block_align = cfg->block_align ? cfg->block_align : STEPQ__POOL_BLOCK_ALIGN;
    uint64_t conv_elems = 0, conv_layer_bytes, off = 0;
    int conv_dim;
    int tp = cfg->tp_size <= 1 ? 1 : cfg->tp_size;
    int n_local, first, upu;
    uint8_t *row_bits = NULL;
    int ret;

    memset(out, 0, sizeof(*out));
    if (cfg->tp_size < 0 || cfg->tp_rank < 0 || cfg->tp_rank >= tp)
        return stepq__error_obj(err, STEPQ_EINVAL,
                                "stepq_pool_config: tp_rank %d is not in 0..tp_size-1 (tp_size %d)",
                                cfg->tp_rank, cfg->tp_size);
    /* 16 B minimum: the CUDA copy and clear kernels move whole uint4 words. */
    if (!is_pow2(page_align) || !is_pow2(block_align) || page_align < 16)
        return stepq__error_obj(err, STEPQ_EINVAL,
                                "stepq_pool_config: page_align %" PRIu64 " and block_align %" PRIu64
                                " must be powers of two, page_align at least 16",
                                page_align, block_align);
    /* Bounds far above any use keep every offset and rounding inside 64 bits. */
    if (page_align > MAX_PAGE_ALIGN)
        return stepq__error_obj(err, STEPQ_EINVAL,
                                "stepq_pool_config.page_align: %" PRIu64 " is over %" PRIu64,
                                page_align, (uint64_t)MAX_PAGE_ALIGN);
    if (block_align > MAX_BLOCK_ALIGN)
        return stepq__error_obj(err, STEPQ_EINVAL,
                                "stepq_pool_config.block_align: %" PRIu64 " is over %u",
                                block_align, MAX_BLOCK_ALIGN);
    if (cfg->min_page_bytes > MAX_MIN_PAGE_BYTES)
        return stepq__error_obj(err, STEPQ_ERANGE,
                                "stepq_pool_config.min_page_bytes: %" PRIu64 " is over 2^48",
                                cfg->min_page_bytes);
    ret = stepq_map_shape(map, &shape);
    if (ret < 0)
        return ret;
    method = stepq_map_method(map);
    if (shape.num_v_heads % tp)
        return stepq__error_obj(err, STEPQ_ESHAPE,
                                "the map's %d value heads do not split over tp_size %d",
                                shape.num_v_heads, tp);
    if (shape.conv_rank > 0) {
        conv_elems = 1;
        for (int i = 0; i < shape.conv_rank; i++)
            conv_elems *= (uint64_t)shape.conv_shape[i];
    }
    conv_layer_bytes = conv_elems * stepq_dtype_size(shape.conv_dtype);
    conv_dim = stepq__conv_split_dim(&shape);
    if (conv_dim >= 0 && shape.conv_shape[conv_dim] % tp)
        return stepq__error_obj(err, STEPQ_ESHAPE,
                                "the conv state's channels (conv_state.shape[%d] = %" PRId64
                                ") do not split over tp_size %d",
                                conv_dim, shape.conv_shape[conv_dim], tp);
    /* Value heads hv of q/k group hv / (HV / H): a rank's contiguous block of
     * HV / tp value heads reads H / tp whole q/k heads only when tp divides H. */
    if (shape.num_k_heads % tp)
        return stepq__error_obj(err, STEPQ_ESHAPE,
                                "the map's %d q/k heads do not split over tp_size %d",
                                shape.num_k_heads, tp);
    n_local = shape.num_v_heads / tp;
    first = cfg->tp_rank * n_local;
    upu = shape.arch == STEPQ_ARCH_KDA ? shape.head_k_dim : 1;

    ret = alloc_tables(out, shape.n_layers, n_local, upu, err);
    if (ret < 0)
        return ret;
    out->n_k_heads = shape.num_k_heads / tp;
    out->conv_rank = shape.conv_rank;
    out->conv_dtype = shape.conv_dtype;
    for (int i = 0; i < shape.conv_rank; i++)
        out->conv_shape[i] = shape.conv_shape[i];
    if (conv_dim >= 0)
        out->conv_shape[conv_dim] = shape.conv_shape[conv_dim] / tp;
    {
        size_t nb = (size_t)out->pub.n_blocks ? (size_t)out->pub.n_blocks : 1;
        out->heads = calloc(nb, sizeof(*out->heads));
        out->head_off = calloc(nb, sizeof(*out->head_off));
        if (stepq__method_uses_row_impact(method))
            out->row_impact = malloc(nb * (size_t)shape.head_k_dim * sizeof(float));
        if (!out->heads || !out->head_off ||
            (stepq__method_uses_row_impact(method) && !out->row_impact)) {
            ret = stepq__error_obj(err, STEPQ_ENOMEM, "out of memory (head layouts)");
            goto fail;
        }
    }
    out->pub.arch = shape.arch;
    out->pub.method = method;
    out->pub.first_head = first;
    out->pub.d_k = shape.head_k_dim;
    out->pub.d_v = shape.head_v_dim;
    row_bits = malloc((size_t)shape.head_k_dim);
    if (!row_bits) {
        ret = stepq__error_obj(err, STEPQ_ENOMEM, "out of memory (row bits)");
        goto fail;
    }
    for (int layer = 0; layer < shape.n_layers; layer++) {
        for (int h = 0; h < n_local; h++) {
            int b = layer * n_local + h, head = first + h;
            struct stepq__head_layout *hlp = &out->heads[b], hl;

            ret = stepq_map_head_row_bits(map, layer, head, row_bits, shape.head_k_dim);
            if (ret < 0)
                goto fail;
            /* A unit is the head (GDN: its rows share one width) or a row (KDA). */
            memcpy(out->unit_bits + (size_t)b * upu, row_bits, (size_t)upu);
            ret = stepq__head_layout_init(&hl, method, shape.arch, shape.head_k_dim,
                                          shape.head_v_dim, row_bits, block_align);
            if (ret < 0) {
                stepq__error_obj(err, ret, "layer %d head %d: %s", layer, head, stepq_last_error());
                goto fail;
            }
            hl.row_split = stepq_map_row_split(map);   /* the fit's; 0.5 without column scales */
            hl.decode_fit = stepq_map_decode_fit(map); /* exact without column scales */
            hl.arith = stepq_map_arith(map);           /* fp32 without column scales */
            if (hl.block_bytes > UINT32_MAX || hl.block_bytes % block_align) {
                stepq__head_layout_free(&hl);
                ret =
                    stepq__error_obj(err, STEPQ_EINTERNAL,
                                     "layer %d head %d: block of %zu B is not %" PRIu64 "-aligned",
                                     layer, head, hl.block_bytes, block_align);
                goto fail;
            }
            out->block_offset[b] = off;
            out->head_off[b] = (size_t)off;
            out->block_bytes[b] = (uint32_t)hl.block_bytes;
            out->block_compact[b] = (uint32_t)hl.compact_bytes;
            off += hl.block_bytes;
            *hlp = hl; /* kept: the pool's steps use it */
            if (out->row_impact) {
                const float *w = stepq_map_row_impact(map, layer, head);
                float *dst = out->row_impact + (size_t)b * (size_t)shape.head_k_dim;
                for (int i = 0; i < shape.head_k_dim; i++)
                    dst[i] = w ? w[i] : 1.0f;
            }
        }
    }
    free(row_bits);
    row_bits = NULL;
    ret = finish(out, conv_layer_bytes / (uint64_t)tp, block_align, page_align, cfg->min_page_bytes,
                 err);
    if (ret < 0)
        goto fail;
    return STEPQ_OK;

fail:
    free(row_bits);
    stepq__pool_layout_free(out);
    return ret;
}
