/*
 * The unpack family (the prefill hook that reconstructs a layer's dense
 * states from its pages): a host pool and a CUDA pool holding the same packed
 * start (fx_pools_fill) unpack the same slot list (padding, a repeated slot)
 * into dense tensors full of FX_SENTINEL bytes. call_ref is the host pool's
 * stepq_pool_prefill_unpack, call_new the CUDA pool's or the unpack entry on a
 * STEPQ__CUDA_COLUMN handle of its layer. The pages are only read: both pools
 * must keep every byte. The refused calls are pack.c's (the same checks).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda.h"
#include "tests/checkasm/checkasm.h"
#include "tests/checkasm/compare.h"

/* Magnitude of the random states packed into the start pages. */
#define AMP 0.2f
/*
 * bf16 destinations: both sides round the same reconstruction to nearest
 * even; the reconstruction r_i c_j z / qmax is one product order on both, so
 * no element may differ.
 */
#define TOL_UNPACK_BF16_ULPS 0

#define params fx_transfer

static int start(const struct params *p)
{
    return ca_transfer_check(p, "unpack", "to");
}

struct launch {
    stepq_pool_t *pool;
    int layer;
    const stepq_prefill_args *args;
    const struct stepq__packed_layer *pl;
    stepq__cuda_layer *L; /* column: the entry on it */
};

static int launch_new(void *ctx)
{
    const struct launch *c = ctx;
    const stepq_prefill_args *a = c->args;
    if (!c->L)
        return stepq_pool_prefill_unpack(c->pool, c->layer, a, NULL);
    return stepq__cuda_unpack_prepared(c->pl, c->L, a->n, a->slot_ids, a->states,
                                       (size_t)a->state_stride, (stepq__layout)a->layout, a->dtype,
                                       NULL);
}

/*
 * The destinations, CUDA (got) vs host (ref): entries of skipped slots and
 * the stride gaps keep their FX_SENTINEL bytes on both sides; fp32 within
 * TOL_F32_NMSE, bf16 within TOL_UNPACK_BF16_ULPS.
 */
static int compare_dense(const struct params *p, const uint8_t *got, const uint8_t *ref,
                         const int32_t *ids, size_t stride)
{
    const size_t es = p->dtype == STEPQ_DTYPE_BF16 ? 2 : 4;
    const size_t per = (size_t)p->HV * FX_D * FX_D;
    double num = 0, den = 0;
    for (int e = 0; e < p->n; e++)
        for (size_t i = 0; i < stride; i++) {
            const size_t at = ((size_t)e * stride + i) * es;
            if (ids[e] < 0 || i >= per) {
                for (size_t k = 0; k < es; k++)
                    CA_CHECK(got[at + k] == FX_SENTINEL && ref[at + k] == FX_SENTINEL,
                             "entry %d element %zu (%s) written: 0x%02x, reference 0x%02x", e, i,
                             ids[e] < 0 ? "a skipped entry" : "a stride gap", got[at + k],
                             ref[at + k]);
                continue;
            }
            if (es == 2) {
                /* a NaN matches any NaN: the GPU's arithmetic makes the canonical one */
                const uint16_t a = ca_rd16(got + at), b = ca_rd16(ref + at);
                const int nan_a = (a & 0x7fff) > 0x7f80, nan_b = (b & 0x7fff) > 0x7f80;
                CA_CHECK(nan_a ? nan_b : !nan_b && ca_ulp16(a, b) <= TOL_UNPACK_BF16_ULPS,
                         "entry %d element %zu: bf16 0x%04x vs reference 0x%04x", e, i, a, b);
                continue;
            }
            float a, b;
            memcpy(&a, got + at, 4);
            memcpy(&b, ref + at, 4);
            num += ((double)a - b) * ((double)a - b);
            den += (double)b * b;
        }
    const double e = den > 0 ? num / den : num;
    CA_CHECK(e <= TOL_F32_NMSE, "unpack NMSE %g > %g", e, TOL_F32_NMSE);
    return 0;
}

static int run(const struct params *p)
{
    const struct fx_map_spec spec = {
        .arch = p->arch,
        .method = p->method,
        .bits = p->bits,
        .H = p->HV > 1 ? p->HV / 2 : 1,
        .HV = p->HV,
        .w_lo = 0.5f,
        .w_hi = 2.0f,
        .row_split = p->row_split,
    };
    const int bf16 = p->dtype == STEPQ_DTYPE_BF16;
    /* [V,K] bf16 with an odd stride (unless p->aligned) takes the scalar path, the others the
     * vector path */
    const size_t head = (size_t)FX_D * FX_D,
                 stride = head * p->HV +
                          (p->layout == STEPQ_STATE_LAYOUT_VK && bf16 && !p->aligned ? 1 : 64);
    const size_t bytes = stride * (size_t)p->n * (bf16 ? 2 : 4);
    struct fx_rng *rng = checkasm_rng();
    struct fx_pools fx = { 0 };
    struct fx_buf hd = { 0 }, dd = { 0 }, hids = { 0 }, dids_b = { 0 };
    stepq__cuda_layer *L = NULL;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)p->n), *dids = malloc(sizeof(int32_t) * p->n);
    uint8_t *got = malloc(bytes);
    struct ca_snap sn = { 0 };
    stepq_prefill_args ah = STEPQ_PREFILL_ARGS_INITIALIZER, ad;
    int64_t bad;
    int rc = 0;

    CA_TRY(ids && dids && got, "out of memory");
    CA_OK(fx_pools_open(&fx, &spec, p->n + 1, rng));
    CA_OK(fx_pools_fill(&fx, AMP, rng));
    if (p->method == STEPQ_METHOD_FP8 && bf16) {
        /*
         * bf16 near its top, head 0 of every page: tile 1's scale puts codes near 240 between
         * bf16's rounding-to-Inf bound and FLT_MAX, tile 2's products overflow fp32 (both +-Inf:
         * an unpack rounds to nearest even, plugin/include/stepq/step.h), tile 3's scale is NaN
         */
        const float top[3] = { 1.4164e36f, 1e37f, NAN };
        const struct stepq__head_layout *hl = &fx.hpl.heads[0];
        for (int32_t s = 0; s <= fx.slots; s++)
            memcpy(fx.hpl.base + (size_t)s * fx.hpl.page_stride + fx.hpl.head_offset[0] +
                       hl->tile_scale_offset + 4,
                   top, sizeof(top));
        CA_OK(fx_pools_upload(&fx));
    }
    /* slots from the top down; entry 1 skipped (every third from it with wild ids), entry 3 a
     * repeat of entry 0 (an unpack only reads) */
    const int32_t wild[] = { fx.slots + 1, -7, 1 << 30 };
    for (int e = 0, k = 0; e < p->n; e++) {
        const int pad = e == 1 || (p->wild_ids && e % 3 == 1);
        ids[e] = pad ? STEPQ_POOL_SLOT_PAD : e == 3 ? ids[0] : fx.slots - e;
        dids[e] = pad && p->wild_ids ? wild[k++ % 3] : ids[e];
    }
    CA_OK(fx_buf_alloc(&hd, bytes, 0));
    CA_OK(fx_buf_alloc(&dd, bytes, 1));
    CA_OK(fx_buf_alloc(&hids, sizeof(int32_t) * (size_t)p->n, 0));
    CA_OK(fx_buf_alloc(&dids_b, sizeof(int32_t) * (size_t)p->n, 1));
    CA_OK(fx_buf_set(&hids, ids));
    CA_OK(fx_buf_set(&dids_b, dids));
    if ((rc = ca_snap_take(&fx, &sn)))
        goto out;
    ah.n = p->n;
    ah.slot_ids = hids.p;
    ah.states = hd.p;
    ah.state_stride = (int64_t)stride;
    ah.dtype = p->dtype;
    ah.layout = p->layout;
    ad = ah;
    ad.slot_ids = dids_b.p;
    ad.states = dd.p;
    struct launch lc = { fx.cuda, fx.layer, &ad, &fx.dpl, NULL };
    if (p->column) {
        CA_OK(stepq__cuda_layer_prepare_ex(&fx.dpl, STEPQ__CUDA_COLUMN, &L));
        lc.L = L;
    }

    /* call_ref, call_new */
    CA_OK(stepq_pool_prefill_unpack(fx.host, fx.layer, &ah, NULL));
    CA_OK(launch_new(&lc));

    CA_OK(fx_buf_get(&dd, got));
    if (compare_dense(p, got, hd.p, ids, stride) || ca_pools_unchanged(&fx, &sn, "the unpack")) {
        rc = 1;
        goto out;
    }
    const struct fx_buf *outs[2] = { &hd, &dd }, *ins[2] = { &hids, &dids_b };
    for (int i = 0; i < 2; i++) {
        CA_OK(fx_buf_compare(outs[i], 1, &bad));
        CA_TRY(bad < 0, "%s destination: guard byte %lld changed", i ? "device" : "host",
               (long long)bad - FX_GUARD);
        CA_OK(fx_buf_compare(ins[i], 0, &bad));
        CA_TRY(bad < 0, "%s slot ids: byte %lld changed", i ? "device" : "host",
               (long long)bad - FX_GUARD);
    }
    if (checkasm_benchmarking())
        rc = checkasm_bench(launch_new, &lc, NULL);
out:
    stepq__cuda_layer_release(L);
    fx_buf_free(&hd);
    fx_buf_free(&dd);
    fx_buf_free(&hids);
    fx_buf_free(&dids_b);
    free(ids);
    free(dids);
    free(got);
    ca_snap_free(&sn);
    fx_pools_close(&fx);
    return rc;
}

static void one(struct params p)
{
    if (start(&p))
        checkasm_report(run(&p));
}

void checkasm_check_unpack(void)
{
    fx_transfer_cases(checkasm_small(), one);
}
