/*
 * The pack family (the prefill hook that fits and quantizes dense states into
 * a layer's pages): CUDA vs the C reference on the same dense source, into a
 * host pool and a CUDA pool opened from the same map, both starting as
 * FX_SENTINEL bytes. call_ref is the host pool's stepq_pool_prefill_pack,
 * call_new the CUDA pool's, or the pack entry on a STEPQ__CUDA_COLUMN handle
 * of the CUDA pool's layer (the thread-per-column kernel, for comparison).
 * The source is known, so every code that differs must be proven a rounding
 * tie (ca_compare_pages). Then the refused calls.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda.h"
#include "tests/checkasm/checkasm.h"
#include "tests/checkasm/compare.h"

/* Magnitude of the random source states. */
#define AMP 0.2f

#define params fx_transfer

static int start(const struct params *p)
{
    return ca_transfer_check(p, "pack", "from");
}

struct launch {
    stepq_pool_t *pool;
    int layer;
    const stepq_prefill_args *args;
    const struct stepq__packed_layer *pl; /* column: the entry on L */
    stepq__cuda_layer *L;
    uint32_t *health;
};

static int launch_new(void *ctx)
{
    const struct launch *c = ctx;
    const stepq_prefill_args *a = c->args;
    if (!c->L)
        return stepq_pool_prefill_pack(c->pool, c->layer, a, NULL);
    return stepq__cuda_pack_prepared(c->pl, c->L, a->n, a->slot_ids, a->states,
                                     (size_t)a->state_stride, (stepq__layout)a->layout, a->dtype,
                                     c->health, a->health_counts, NULL);
}

/* The tensors of one side: source, slot ids, counters. */
struct side {
    struct fx_buf src, ids, counts;
};

static int side_init(struct side *s, const void *src, size_t src_bytes, const int32_t *ids, int n,
                     int device)
{
    static const uint64_t zero[STEPQ__HEALTH_NCOUNTS];
    int ret;
    if ((ret = fx_buf_alloc(&s->src, src_bytes, device)) < 0 ||
        (ret = fx_buf_set(&s->src, src)) < 0 ||
        (ret = fx_buf_alloc(&s->ids, sizeof(int32_t) * (size_t)n, device)) < 0 ||
        (ret = fx_buf_set(&s->ids, ids)) < 0 ||
        (ret = fx_buf_alloc(&s->counts, sizeof(zero), device)) < 0 ||
        (ret = fx_buf_set(&s->counts, zero)) < 0)
        return ret;
    return STEPQ_OK;
}

static void side_free(struct side *s)
{
    fx_buf_free(&s->src);
    fx_buf_free(&s->ids);
    fx_buf_free(&s->counts);
}

/* Inputs unchanged, the counters' guards intact. */
static int side_check(const struct side *s, const char *name)
{
    int64_t bad;
    CA_CHECK(fx_buf_compare(&s->src, 0, &bad) >= 0 && bad < 0, "%s source: byte %lld changed", name,
             (long long)bad - FX_GUARD);
    CA_CHECK(fx_buf_compare(&s->ids, 0, &bad) >= 0 && bad < 0, "%s slot ids: byte %lld changed",
             name, (long long)bad - FX_GUARD);
    CA_CHECK(fx_buf_compare(&s->counts, 1, &bad) >= 0 && bad < 0,
             "%s health counters: guard byte %lld changed", name, (long long)bad - FX_GUARD);
    return 0;
}

static void prefill_args(const struct params *p, const struct side *s, size_t stride,
                         stepq_prefill_args *a)
{
    const stepq_prefill_args init = STEPQ_PREFILL_ARGS_INITIALIZER;
    *a = init;
    a->n = p->n;
    a->slot_ids = s->ids.p;
    a->states = s->src.p;
    a->state_stride = (int64_t)stride;
    a->dtype = p->dtype;
    a->layout = p->layout;
    a->health_counts = s->counts.p;
}

/* Element (row r, column c) of one head of the dense side in p's layout. */
static size_t head_at(const struct params *p, int r, int c)
{
    return p->layout == STEPQ_STATE_LAYOUT_VK ? (size_t)c * FX_D + r : (size_t)r * FX_D + c;
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
    const size_t elems = stride * (size_t)p->n;
    struct fx_rng *rng = checkasm_rng();
    struct fx_pools fx = { 0 };
    struct side hs = { 0 }, ds = { 0 };
    stepq__cuda_layer *L = NULL;
    float *src = malloc(sizeof(float) * elems);
    uint16_t *src16 = malloc(2 * elems);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)p->n), *dids = malloc(sizeof(int32_t) * p->n);
    uint8_t *start = NULL, *got = NULL, *written = NULL;
    uint32_t *h_got = NULL;
    uint64_t c_got[STEPQ__HEALTH_NCOUNTS], c_ref[STEPQ__HEALTH_NCOUNTS];
    stepq_prefill_args ah, ad;
    int rc = 0;

    CA_TRY(src && src16 && ids && dids, "out of memory");
    CA_OK(fx_pools_open(&fx, &spec, p->n + 1, rng));
    CA_OK(fx_pools_blank(&fx));
    for (size_t e = 0; e < elems; e++) {
        src16[e] = stepq__bf16_from_float(AMP * fx_nrand(rng));
        src[e] = bf16 ? stepq__bf16_to_float(src16[e]) : AMP * fx_nrand(rng);
    }
    /*
     * entry 0 head 0: stored as 0, STEPQ_HEALTH_STATE, counted once for the head although the
     * second poison sits in another column tile (column 100 of either layout: fp8's tile 3)
     */
    const size_t p2 = p->layout == STEPQ_STATE_LAYOUT_VK ? 100 * FX_D + 5 : 100;
    src[5] = src[p2] = NAN;
    src16[5] = src16[p2] = 0x7fc0;
    if (p->method == STEPQ_METHOD_FP8) {
        /* two special tiles of entry 0's last head (head 0 holds the NaNs) */
        float *h = src + (size_t)(p->HV - 1) * head;
        uint16_t *h16 = src16 + (size_t)(p->HV - 1) * head;
        /*
         * Tile 1 (columns 32..63): zeros of both signs, denormals and elements beside s 2^-10
         * (the kernel's threshold below which a code is the signed zero without a division),
         * among normal values; its largest element is 0.5 (s = 0.5 / 240). bf16 sources take the
         * same values rounded to bf16 (the denormals of bf16's range).
         */
        const float s = 0.5f / 240.0f, t = s * 0x1p-10f;
        const float special[8] = {
            0.0f, -0.0f, 1e-40f, -3e-39f, t, -nextafterf(t, 0.0f), 0.5f, nextafterf(t, 1.0f)
        };
        for (int r = 0; r < FX_D; r++)
            for (int c = 32; c < 64; c++) {
                const size_t at = head_at(p, r, c);
                if ((r + c) % 3 == 0) {
                    const float v = special[(r * 7 + c) % 8];
                    h16[at] = stepq__bf16_from_float(v);
                    h[at] = bf16 ? stepq__bf16_to_float(h16[at]) : v;
                } else if (bf16) {
                    h16[at] = stepq__bf16_from_float(0.0625f * fx_nrand(rng));
                    h[at] = stepq__bf16_to_float(h16[at]);
                } else {
                    h[at] = 0.0625f * fx_nrand(rng);
                }
            }
        /*
         * Tile 2 (columns 64..95), fp32 sources: a subnormal scale. Its largest element is
         * 1296 * 2^-149, so s = 1296 / 240 = 5.4 subnormal steps rounds to 5 and x / s = 259.2,
         * which e4m3 would round to 256: the clamp to +-240 before rounding (kernels/format.h)
         * decides the code. The others are far smaller. (bf16 cannot hold such values: its
         * smallest magnitude, 2^-133, keeps s within 0.2% of m / 240.)
         */
        if (!bf16)
            for (int r = 0; r < FX_D; r++)
                for (int c = 64; c < 96; c++)
                    h[head_at(p, r, c)] =
                        r == 7 && c == 70 ? -ldexpf(1296.0f, -149) : ldexpf(fx_nrand(rng), -142);
    }
    /* slots from the top down, entry 1 skipped (every third from it with wild ids) */
    const int32_t wild[] = { fx.slots + 1, -7, 1 << 30 };
    for (int e = 0, k = 0; e < p->n; e++) {
        const int pad = e == 1 || (p->wild_ids && e % 3 == 1);
        ids[e] = pad ? STEPQ_POOL_SLOT_PAD : fx.slots - e;
        dids[e] = pad && p->wild_ids ? wild[k++ % 3] : ids[e];
    }
    CA_OK(side_init(&hs, bf16 ? (const void *)src16 : src, (bf16 ? 2 : 4) * elems, ids, p->n, 0));
    CA_OK(side_init(&ds, bf16 ? (const void *)src16 : src, (bf16 ? 2 : 4) * elems, dids, p->n, 1));
    start = malloc(fx.pages_bytes);
    got = malloc(fx.pages_bytes);
    written = calloc((size_t)fx.slots + 1, 1);
    h_got = malloc(((size_t)fx.slots + 1) * sizeof(*h_got));
    CA_TRY(start && got && written && h_got, "out of memory");
    memcpy(start, fx.hpages, fx.pages_bytes);
    for (int e = 0; e < p->n; e++)
        if (ids[e] >= 0)
            written[ids[e]] = 1;
    prefill_args(p, &hs, stride, &ah);
    prefill_args(p, &ds, stride, &ad);
    struct launch lc = { fx.cuda, fx.layer, &ad, &fx.dpl, NULL, fx.dhealth };
    if (p->column) {
        CA_OK(stepq__cuda_layer_prepare_ex(&fx.dpl, STEPQ__CUDA_COLUMN, &L));
        lc.L = L;
    }

    /* call_ref, call_new */
    CA_OK(stepq_pool_prefill_pack(fx.host, fx.layer, &ah, NULL));
    CA_OK(launch_new(&lc));

    CA_OK(fx_pools_download(&fx, got, h_got));
    CA_OK(fx_buf_get(&ds.counts, c_got));
    CA_OK(fx_buf_get(&hs.counts, c_ref));
    const struct ca_pack_src ps = { src, stride, (stepq__layout)p->layout, p->n, ids };
    if (ca_compare_pages(&fx, got, fx.hpages, start, written, &ps) ||
        ca_compare_health(&fx, h_got, fx.hhealth, c_got, c_ref) || side_check(&hs, "host") ||
        side_check(&ds, "device")) {
        rc = 1;
        goto out;
    }
    if (checkasm_benchmarking())
        rc = checkasm_bench(launch_new, &lc, NULL);
out:
    stepq__cuda_layer_release(L);
    side_free(&hs);
    side_free(&ds);
    free(src);
    free(src16);
    free(ids);
    free(dids);
    free(start);
    free(got);
    free(written);
    free(h_got);
    fx_pools_close(&fx);
    return rc;
}

static void one(struct params p)
{
    if (start(&p))
        checkasm_report(run(&p));
}

/* --- refused calls ------------------------------------------------------------ */

enum bad_public {
    BP_ARGS_NULL,
    BP_LAYER_PAST,
    BP_VERSION,
    BP_N_NEG,
    BP_N_BIG,
    BP_LAYOUT,
    BP_DTYPE_FP16,
    BP_DTYPE_BAD,
    BP_SLOTS_NULL,
    BP_STATES_NULL,
    BP_STATES_MISALIGNED,
    BP_STRIDE,
    BP_NUM_V_HEADS,
    BP_HEAD_K_DIM,
    BP_HEAD_V_DIM,
    BP_COUNT
};

static const struct bad {
    const char *what;
    int status;
    const char *needle;
} bad_public[BP_COUNT] = {
    [BP_ARGS_NULL] = { "args NULL", STEPQ_EINVAL, "args is NULL" },
    [BP_LAYER_PAST] = { "layer 3 of 3", STEPQ_ERANGE, "layer 3" },
    [BP_VERSION] = { "version 99", STEPQ_EVERSION, "version 99" },
    [BP_N_NEG] = { "n -1", STEPQ_EINVAL, "n = -1" },
    [BP_N_BIG] = { "n 70000", STEPQ_EINVAL, "n = 70000" },
    [BP_LAYOUT] = { "layout 2", STEPQ_EINVAL, "layout 2" },
    [BP_DTYPE_FP16] = { "dtype fp16", STEPQ_ENOTSUP, "dtype fp16" },
    [BP_DTYPE_BAD] = { "dtype 9", STEPQ_EINVAL, "dtype 9" },
    [BP_SLOTS_NULL] = { "slot_ids NULL", STEPQ_EINVAL, "slot_ids is NULL" },
    [BP_STATES_NULL] = { "states NULL", STEPQ_EINVAL, "states is NULL" },
    [BP_STATES_MISALIGNED] = { "states misaligned", STEPQ_EINVAL, "states = " },
    [BP_STRIDE] = { "state_stride short", STEPQ_EINVAL, "state_stride" },
    [BP_NUM_V_HEADS] = { "num_v_heads wrong", STEPQ_ESHAPE, "num_v_heads" },
    [BP_HEAD_K_DIM] = { "head_k_dim 64", STEPQ_ESHAPE, "head_k_dim" },
    [BP_HEAD_V_DIM] = { "head_v_dim 64", STEPQ_ESHAPE, "head_v_dim" },
};

static void apply_public(int i, int HV, stepq_prefill_args *a, int *layer,
                         const stepq_prefill_args **ap)
{
    switch ((enum bad_public)i) {
    case BP_ARGS_NULL:
        *ap = NULL;
        break;
    case BP_LAYER_PAST:
        *layer = 3;
        break;
    case BP_VERSION:
        a->version = 99;
        break;
    case BP_N_NEG:
        a->n = -1;
        break;
    case BP_N_BIG:
        a->n = 70000;
        break;
    case BP_LAYOUT:
        a->layout = (stepq_state_layout)2;
        break;
    case BP_DTYPE_FP16:
        a->dtype = STEPQ_DTYPE_FP16;
        break;
    case BP_DTYPE_BAD:
        a->dtype = (stepq_dtype)9;
        break;
    case BP_SLOTS_NULL:
        a->slot_ids = NULL;
        break;
    case BP_STATES_NULL:
        a->states = NULL;
        break;
    case BP_STATES_MISALIGNED:
        a->states = (uint8_t *)a->states + 2;
        break;
    case BP_STRIDE:
        a->state_stride = (int64_t)HV * FX_D * FX_D - 1;
        break;
    case BP_NUM_V_HEADS:
        a->num_v_heads = HV + 1;
        break;
    case BP_HEAD_K_DIM:
        a->head_k_dim = 64;
        break;
    case BP_HEAD_V_DIM:
        a->head_v_dim = 64;
        break;
    case BP_COUNT:
        break;
    }
}

/* Lists the host pool refuses (the CUDA pool cannot read its device list). */
static const struct host_ids {
    const char *what;
    int32_t ids[4];
    int status;
    const char *needle;
} host_ids[] = {
    { "slot id past the pool", { 3, 99, -1, 5 }, STEPQ_ERANGE, "slot_ids[1] = 99" },
    { "slot listed twice", { 3, 5, -1, 5 }, STEPQ_EINVAL, "slot_ids[3] = 5 is listed more" },
    { "slot not allocated", { 3, 0, -1, 5 }, STEPQ_EINVAL, "slot_ids[3] = 5 is not allocated" },
};

/* A small GDN stepq@6 layer of 2 heads over 5 slots, its pages packed; 4 entries (3, 0, -1, 5). */
static int bad_setup(struct fx_pools *fx, struct side *hs, struct side *ds, size_t *stride)
{
    const struct fx_map_spec spec = {
        .arch = STEPQ_ARCH_GDN,
        .method = STEPQ_METHOD_STEPQ,
        .bits = 6,
        .H = 1,
        .HV = 2,
        .w_lo = 0.5f,
        .w_hi = 2.0f,
    };
    static const int32_t ids[4] = { 3, 0, -1, 5 };
    const size_t elems = 4 * (size_t)2 * FX_D * FX_D;
    struct fx_rng *rng = checkasm_rng();
    float *x = calloc(elems, sizeof(float));
    int rc = 0;

    CA_TRY(x, "out of memory");
    for (size_t e = 0; e < elems; e++)
        x[e] = AMP * fx_nrand(rng);
    CA_OK(fx_pools_open(fx, &spec, 5, rng));
    CA_OK(fx_pools_fill(fx, AMP, rng));
    CA_OK(side_init(hs, x, 4 * elems, ids, 4, 0));
    CA_OK(side_init(ds, x, 4 * elems, ids, 4, 1));
    *stride = (size_t)2 * FX_D * FX_D;
out:
    free(x);
    return rc;
}

/* Both pools' pages, health words and tensors as they were. */
static int all_unchanged(struct fx_pools *fx, const struct ca_snap *sn, const struct side *hs,
                         const struct side *ds)
{
    if (ca_pools_unchanged(fx, sn, "after the refused calls"))
        return 1;
    return side_check(hs, "host") || side_check(ds, "device");
}

static int run_bad_public(void)
{
    struct fx_pools fx = { 0 };
    struct side hs = { 0 }, ds = { 0 };
    struct ca_snap sn = { 0 };
    size_t stride = 0;
    char what[160];
    int rc = 0, n = 0;

    if ((rc = bad_setup(&fx, &hs, &ds, &stride)))
        goto out;
    if ((rc = ca_snap_take(&fx, &sn)))
        goto out;
    const struct params p = { .n = 4, .layout = STEPQ_STATE_LAYOUT_KV, .dtype = STEPQ_DTYPE_FP32 };
    for (int op = 0; op < 2; op++) /* pack, then unpack: the same checks (pool/step.c) */
        for (int i = 0; i < BP_COUNT; i++)
            for (int side = 0; side < 2; side++) {
                stepq_pool_t *pool = side ? fx.cuda : fx.host;
                stepq_prefill_args a;
                const stepq_prefill_args *ap = &a;
                int layer = fx.layer;
                prefill_args(&p, side ? &ds : &hs, stride, &a);
                apply_public(i, fx.HV, &a, &layer, &ap);
                snprintf(what, sizeof(what), "%s %s pool, %s", op ? "unpack" : "pack",
                         side ? "CUDA" : "host", bad_public[i].what);
                int ret = op ? stepq_pool_prefill_unpack(pool, layer, ap, NULL)
                             : stepq_pool_prefill_pack(pool, layer, ap, NULL);
                if ((rc = ca_expect_refused(pool, ret, bad_public[i].status, bad_public[i].needle,
                                            what)))
                    goto out;
                n++;
            }
    const int32_t five = 5;
    int32_t back = 0;
    for (size_t i = 0; i < sizeof(host_ids) / sizeof(host_ids[0]); i++) {
        stepq_prefill_args a;
        prefill_args(&p, &hs, stride, &a);
        a.slot_ids = host_ids[i].ids;
        if (i + 1 == sizeof(host_ids) / sizeof(host_ids[0]))
            CA_OK(stepq_pool_free(fx.host, &five, 1));
        snprintf(what, sizeof(what), "pack host pool, %s", host_ids[i].what);
        if ((rc = ca_expect_refused(fx.host, stepq_pool_prefill_pack(fx.host, fx.layer, &a, NULL),
                                    host_ids[i].status, host_ids[i].needle, what)))
            goto out;
        n++;
    }
    CA_OK(stepq_pool_alloc(fx.host, 1, &back));
    CA_TRY(back == 5, "the host pool gave back slot %d, not 5", (int)back);
    if ((rc = all_unchanged(&fx, &sn, &hs, &ds)))
        goto out;
    checkasm_note("%d refused calls (pack and unpack): each its status and a message naming the"
                  " argument, no page byte, health word or dense state changed",
                  n);
out:
    ca_snap_free(&sn);
    side_free(&hs);
    side_free(&ds);
    fx_pools_close(&fx);
    return rc;
}

/*
 * The pack and unpack entries' own checks on the CUDA pool's layer, those the
 * pool validates first (kept: the entries are callable alone) and those it
 * cannot pass wrong (misaligned pages, a handle of another head count).
 */
static int run_bad_entry(void)
{
    static const char pack[] = "cuda pack", unpack[] = "cuda unpack";
    struct fx_pools fx = { 0 };
    struct side hs = { 0 }, ds = { 0 };
    stepq__cuda_layer *L = NULL, *L1 = NULL;
    struct ca_snap sn = { 0 };
    size_t stride = 0;
    int rc = 0, n = 0;

    if ((rc = bad_setup(&fx, &hs, &ds, &stride)))
        goto out;
    if ((rc = ca_snap_take(&fx, &sn)))
        goto out;
    struct stepq__packed_layer mis = fx.dpl, pl1 = fx.dpl;
    mis.base += 8; /* not 16-byte aligned */
    pl1.n_heads = 1;
    CA_OK(stepq__cuda_layer_prepare(&fx.dpl, &L));
    CA_OK(stepq__cuda_layer_prepare(&pl1, &L1));
    const int32_t *ids = ds.ids.p;
    void *x = ds.src.p;
    const stepq__layout KV = STEPQ__LAYOUT_KV, VK = STEPQ__LAYOUT_VK;
    const stepq_dtype F32 = STEPQ_DTYPE_FP32, B16 = STEPQ_DTYPE_BF16;
    const struct {
        const char *what, *who;
        int status, unpack;
        const struct stepq__packed_layer *pl;
        stepq__cuda_layer *L;
        int n;
        const int32_t *ids;
        void *x;
        size_t stride;
        stepq__layout layout;
        stepq_dtype dtype;
    } cases[] = {
        { "n -1", pack, STEPQ_EINVAL, 0, &fx.dpl, L, -1, ids, x, stride, KV, F32 },
        { "n 70000", pack, STEPQ_EINVAL, 0, &fx.dpl, L, 70000, ids, x, stride, KV, F32 },
        { "stride short ([V,K] bf16)", pack, STEPQ_EINVAL, 0, &fx.dpl, L, 4, ids, x, stride - 1, VK,
          B16 },
        { "slot ids NULL", pack, STEPQ_EINVAL, 0, &fx.dpl, L, 4, NULL, x, stride, KV, F32 },
        { "source NULL", pack, STEPQ_EINVAL, 0, &fx.dpl, L, 4, ids, NULL, stride, KV, F32 },
        { "pages not 16-byte aligned", pack, STEPQ_EINVAL, 0, &mis, L, 4, ids, x, stride, KV, F32 },
        { "a handle of 1 head", pack, STEPQ_EINVAL, 0, &fx.dpl, L1, 4, ids, x, stride, KV, F32 },
        { "no handle", pack, STEPQ_EINVAL, 0, &fx.dpl, NULL, 4, ids, x, stride, KV, F32 },
        { "layout 2", pack, STEPQ_EINVAL, 0, &fx.dpl, L, 4, ids, x, stride, (stepq__layout)2, F32 },
        { "dtype fp16", pack, STEPQ_ENOTSUP, 0, &fx.dpl, L, 4, ids, x, stride, KV,
          STEPQ_DTYPE_FP16 },
        { "stride short", unpack, STEPQ_EINVAL, 1, &fx.dpl, L, 4, ids, x, stride - 64, KV, F32 },
        { "pages not 16-byte aligned", unpack, STEPQ_EINVAL, 1, &mis, L, 4, ids, x, stride, VK,
          B16 },
        { "destination NULL", unpack, STEPQ_EINVAL, 1, &fx.dpl, L, 4, ids, NULL, stride, KV, F32 },
        { "a handle of 1 head", unpack, STEPQ_EINVAL, 1, &fx.dpl, L1, 4, ids, x, stride, KV, F32 },
    };
    char what[96];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const int ret =
            cases[i].unpack
                ? stepq__cuda_unpack_prepared(cases[i].pl, cases[i].L, cases[i].n, cases[i].ids,
                                              cases[i].x, cases[i].stride, cases[i].layout,
                                              cases[i].dtype, NULL)
                : stepq__cuda_pack_prepared(cases[i].pl, cases[i].L, cases[i].n, cases[i].ids,
                                            cases[i].x, cases[i].stride, cases[i].layout,
                                            cases[i].dtype, fx.dhealth, NULL, NULL);
        snprintf(what, sizeof(what), "%s, %s", cases[i].who, cases[i].what);
        if ((rc = ca_expect_refused_entry(ret, cases[i].status, cases[i].who, what)))
            goto out;
        n++;
    }
    if ((rc = all_unchanged(&fx, &sn, &hs, &ds)))
        goto out;
    checkasm_note("%d refused calls: each its status and a message naming the entry, no CUDA error"
                  " left, no page byte or dense state changed",
                  n);
out:
    stepq__cuda_layer_release(L);
    stepq__cuda_layer_release(L1);
    ca_snap_free(&sn);
    side_free(&hs);
    side_free(&ds);
    fx_pools_close(&fx);
    return rc;
}

void checkasm_check_pack(void)
{
    fx_transfer_cases(checkasm_small(), one);

    if (checkasm_check("pack and unpack invalid arguments (public API, host and CUDA pools)"))
        checkasm_report(run_bad_public());
    if (checkasm_check("pack and unpack invalid arguments (pack and unpack entries)"))
        checkasm_report(run_bad_entry());
}
