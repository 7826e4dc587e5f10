/*
 * The decode step family: one packed decode step of a pool's layer, CUDA vs
 * the C reference. A host pool and a CUDA pool opened from the same map hold
 * the same packed start and get the same inputs (shuffled slot ids with
 * padding, the sentinel page among them); call_ref is the host pool's step,
 * call_new the CUDA pool's (its fused kernels) or, for what the pool does not
 * run, the internal entry on the CUDA pool's pages with a handle of an
 * explicit kernel choice: the two-stage variant and the thread-per-column
 * kernels (STEPQ__CUDA_COLUMN). Then the refused calls: the public API's
 * (status, message naming the argument, nothing changed) and the entry's own
 * checks that the pool cannot reach.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda.h"
#include "tests/checkasm/checkasm.h"
#include "tests/checkasm/compare.h"

/* Magnitude of the random states packed into the start pages. */
#define AMP 0.3f
/* States so large that row and column scales saturate (the clamped quantizer). */
#define HUGE_AMP 1e9f

enum via {
    VIA_POOL,      /* stepq_pool_decode_step on the CUDA pool: the shipped fused kernels */
    VIA_TWO_STAGE, /* stepq__cuda_step_packed_prepared, STEPQ__CUDA_TWO_STAGE */
    VIA_COLUMN,    /* ... STEPQ__CUDA_FUSED on a STEPQ__CUDA_COLUMN handle */
};

struct params {
    stepq_arch arch;
    stepq_method method;
    int bits; /* 0: mixed widths (fx_map_spec) */
    int H, HV, batch;
    int gate;      /* raw a and b: the in-kernel gate and beta sigmoid */
    int nonfinite; /* a NaN in request 0's q: its heads keep their state, output 0, flagged */
    int view;      /* bf16 strided inputs (fx_step_io) */
    int huge;      /* HUGE_AMP states */
    int wild_ids;  /* the CUDA side's padding entries are ids outside 0..slots instead of -1 */
    enum via via;
    double row_split;     /* the map's row_split; 0: 0.5 */
    stepq_decode_fit fit; /* the map's decode_fit; 0: exact */
    int zero_col;         /* one column scale 0 in a head of every start page (pivot heads aside) */
    int nan_state;        /* one fp16 NaN in a pivot row of a head of every start page */
    stepq_arith arith;    /* the map's arith; 0: fp32 */
    int zero_pages;       /* the tested layer's blocks of every start page zeroed (fresh slots) */
};

/* "@6", " mixed+pivot head" (GDN), " mixed rows" (KDA), or "" for a dense method or fp8. */
static const char *width_name(stepq_arch arch, stepq_method m, int bits, char *buf, size_t n)
{
    if (!stepq__method_has_units(m))
        snprintf(buf, n, "%s", "");
    else if (bits)
        snprintf(buf, n, "@%d", bits);
    else
        snprintf(buf, n, "%s", arch == STEPQ_ARCH_GDN ? " mixed+pivot head" : " mixed rows+pivots");
    return buf;
}

static int start(const struct params *p)
{
    char w[32], rs[32] = "";
    if (p->row_split > 0)
        snprintf(rs, sizeof(rs), " row split %g", p->row_split);
    return checkasm_check(
        "decode %s %s%s H=%d HV=%d B=%d%s%s%s%s%s%s%s%s%s%s%s%s", stepq_arch_name(p->arch),
        stepq_method_name(p->method), width_name(p->arch, p->method, p->bits, w, sizeof(w)), p->H,
        p->HV, p->batch, p->gate ? " in-kernel gate" : "", p->nonfinite ? " NaN in q" : "",
        p->view ? " bf16 strided" : "", p->huge ? " huge state" : "",
        p->wild_ids ? " cuda ids outside 0..slots" : "",
        p->via == VIA_TWO_STAGE ? " two-stage"
        : p->via == VIA_COLUMN  ? " column kernel"
                                : "",
        rs,
        p->fit == STEPQ_DECODE_FIT_NOREFIT ? " norefit"
        : p->fit == STEPQ_DECODE_FIT_ROWS  ? " rows"
                                           : "",
        p->zero_col ? " zero column scale" : "", p->nan_state ? " NaN in a pivot row" : "",
        p->arith == STEPQ_ARITH_FP16 ? " arith fp16" : "", p->zero_pages ? " zero pages" : "");
}

/* The CUDA call of a check, also what bench_new times. */
struct launch {
    enum via via;
    stepq_pool_t *pool;
    int layer;
    const stepq_step_args *args;       /* VIA_POOL */
    const struct stepq__step_args *ka; /* the others */
    const struct stepq__packed_layer *pl;
    stepq__cuda_layer *L;
};

static int launch_new(void *ctx)
{
    const struct launch *c = ctx;
    if (c->via == VIA_POOL)
        return stepq_pool_decode_step(c->pool, c->layer, c->args, NULL);
    return stepq__cuda_step_packed_prepared(
        c->ka, c->pl, c->L, c->via == VIA_TWO_STAGE ? STEPQ__CUDA_TWO_STAGE : STEPQ__CUDA_FUSED);
}

/* Flags of a check's step. */
static unsigned step_flags(int gate)
{
    return STEPQ_STEP_L2NORM | (gate ? STEPQ_STEP_GATE_IN_KERNEL | STEPQ_STEP_BETA_SIGMOID : 0);
}

/* Both sides' tensors passed every guard and input check. */
static int check_io(const struct fx_step_io *hio, const struct fx_step_io *dio)
{
    char what[160];
    const struct fx_step_io *io[2] = { hio, dio };
    for (int i = 0; i < 2; i++) {
        int ret = fx_step_io_check(io[i], what, sizeof(what));
        CA_CHECK(ret == 0, "%s", ret < 0 ? stepq_last_error() : what);
    }
    return 0;
}

static int run(const struct params *p)
{
    const struct fx_map_spec spec = {
        .arch = p->arch,
        .method = p->method,
        .bits = p->bits,
        .H = p->H,
        .HV = p->HV,
        .w_lo = 0.5f,
        .w_hi = 2.0f,
        .row_split = p->row_split,
        .decode_fit = p->fit,
        .arith = p->arith,
    };
    struct fx_rng *rng = checkasm_rng();
    struct fx_pools fx = { 0 };
    struct fx_inputs in = { 0 };
    struct fx_step_io hio = { 0 }, dio = { 0 };
    stepq__cuda_layer *L = NULL;
    uint8_t *start = NULL, *got = NULL, *written = NULL;
    void *o_got = NULL, *o_ref = NULL;
    uint32_t *h_got = NULL;
    uint64_t c_got[STEPQ__HEALTH_NCOUNTS], c_ref[STEPQ__HEALTH_NCOUNTS];
    stepq_step_args ah, ad;
    struct stepq__step_args ka;
    double o_nmse = 0;
    int rc = 0;

    CA_OK(fx_pools_open(&fx, &spec, p->batch + 2, rng));
    CA_OK(fx_pools_fill(&fx, p->huge ? HUGE_AMP : AMP, rng));
    if (p->zero_col) {
        /* head s % HV of page s: column (7 s + 3) % d_v's scale 0, in both pools */
        for (int32_t s = 0; s <= fx.slots; s++) {
            const int h = s % fx.HV;
            const struct stepq__head_layout *hl = &fx.hpl.heads[h];
            if (!hl->has_col)
                continue;
            uint8_t *c = fx.hpl.base + (size_t)s * fx.hpl.page_stride + fx.hpl.head_offset[h] +
                         hl->col_scale_offset + 2 * (size_t)((7 * s + 3) % hl->d_v);
            c[0] = c[1] = 0;
        }
        CA_OK(fx_pools_upload(&fx));
    }
    if (p->zero_pages) {
        /* every block of the tested layer all zero bytes, as a fresh slot's page: scales 0 */
        for (int32_t s = 0; s <= fx.slots; s++)
            for (int h = 0; h < fx.HV; h++)
                memset(fx.hpl.base + (size_t)s * fx.hpl.page_stride + fx.hpl.head_offset[h], 0,
                       fx.hpl.heads[h].block_bytes);
        CA_OK(fx_pools_upload(&fx));
    }
    if (p->nan_state) {
        /* head s % HV of page s: a NaN in its first pivot row, column (5 s + 1) % d_v */
        for (int32_t s = 0; s <= fx.slots; s++) {
            const int h = s % fx.HV;
            const struct stepq__head_layout *hl = &fx.hpl.heads[h];
            int i = 0;
            while (i < hl->d_k && hl->row_bits[i] != STEPQ_BITS_PIVOT)
                i++;
            if (i == hl->d_k)
                continue;
            uint8_t *c = fx.hpl.base + (size_t)s * fx.hpl.page_stride + fx.hpl.head_offset[h] +
                         hl->row_bitoff[i] / 8 + 2 * (size_t)((5 * s + 1) % hl->d_v);
            c[0] = 0x00;
            c[1] = 0x7e; /* fp16 NaN, little endian */
        }
        CA_OK(fx_pools_upload(&fx));
    }
    CA_OK(fx_inputs_alloc(&in, p->arch, p->batch, p->H, p->HV));
    CA_OK(fx_inputs_gen(&in, fx.slots + 1, p->gate, rng));
    if (p->nonfinite)
        in.q[0] = NAN;
    CA_OK(fx_step_io_init(&hio, &in, p->view, 0));
    CA_OK(fx_step_io_init(&dio, &in, p->view, 1));
    if (p->wild_ids) {
        /* documented for the CUDA backend: ids outside 0..slots are skipped like -1 */
        const int32_t wild[] = { fx.slots + 1, -7, 1 << 30, INT32_MIN };
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)p->batch);
        CA_TRY(ids, "out of memory");
        for (int b = 0, k = 0; b < p->batch; b++)
            ids[b] = in.slots[b] < 0 ? wild[k++ % 4] : in.slots[b];
        rc = fx_buf_set(&dio.slots, ids) < 0;
        free(ids);
        CA_TRY(!rc, "%s", stepq_last_error());
    }
    start = malloc(fx.pages_bytes);
    got = malloc(fx.pages_bytes);
    written = calloc((size_t)fx.slots + 1, 1);
    h_got = malloc(((size_t)fx.slots + 1) * sizeof(*h_got));
    o_got = malloc(hio.o.bytes);
    o_ref = malloc(hio.o.bytes);
    CA_TRY(start && got && written && h_got && o_got && o_ref, "out of memory");
    memcpy(start, fx.hpages, fx.pages_bytes);
    for (int b = 0; b < p->batch; b++)
        if (in.slots[b] >= 0)
            written[in.slots[b]] = 1;
    fx_step_io_args(&hio, step_flags(p->gate), &ah);
    fx_step_io_args(&dio, step_flags(p->gate), &ad);
    struct launch lc = { p->via, fx.cuda, fx.layer, &ad, &ka, &fx.dpl, NULL };
    if (p->via != VIA_POOL) {
        CA_OK(stepq__cuda_layer_prepare_ex(&fx.dpl, p->via == VIA_COLUMN ? STEPQ__CUDA_COLUMN : 0,
                                           &L));
        CA_OK(fx_kernel_args(fx.cuda, &ad, NULL, &ka));
        lc.L = L;
    }

    /* call_ref, call_new */
    CA_OK(stepq_pool_decode_step(fx.host, fx.layer, &ah, NULL));
    CA_OK(launch_new(&lc));

    CA_OK(fx_pools_download(&fx, got, h_got));
    CA_OK(fx_buf_get(&dio.o, o_got));
    CA_OK(fx_buf_get(&dio.counts, c_got));
    CA_OK(fx_buf_get(&hio.o, o_ref));
    CA_OK(fx_buf_get(&hio.counts, c_ref));
    if (ca_compare_pages(&fx, got, fx.hpages, start, written, NULL) ||
        ca_compare_health(&fx, h_got, fx.hhealth, c_got, c_ref) ||
        ca_compare_o_tol(&hio, o_got, o_ref, in.slots,
                         p->arith == STEPQ_ARITH_FP16 ? TOL_F16_OUT_NMSE : TOL_F32_NMSE, &o_nmse) ||
        check_io(&hio, &dio)) {
        rc = 1;
        goto out;
    }
    if (p->arith == STEPQ_ARITH_FP16)
        checkasm_note("fp16 step: output NMSE %.3g (bound %g)", o_nmse, TOL_F16_OUT_NMSE);
    if (checkasm_benchmarking())
        rc = checkasm_bench(launch_new, &lc, NULL);
out:
    stepq__cuda_layer_release(L);
    free(start);
    free(got);
    free(written);
    free(h_got);
    free(o_got);
    free(o_ref);
    fx_step_io_free(&hio);
    fx_step_io_free(&dio);
    fx_inputs_free(&in);
    fx_pools_close(&fx);
    return rc;
}

static void one(struct params p)
{
    if (start(&p))
        checkasm_report(run(&p));
}

/* --- refused calls ------------------------------------------------------------ */

/* The public API's refusals every backend shares (pool/step.c). */
enum bad_public {
    BP_ARGS_NULL,
    BP_LAYER_PAST,
    BP_LAYER_NEG,
    BP_MAGIC,
    BP_VERSION,
    BP_BATCH_BIG,
    BP_BATCH_NEG,
    BP_FLAGS,
    BP_SCALE_NAN,
    BP_SCALE_NEG,
    BP_DTYPE_FP16,
    BP_DTYPE_BAD,
    BP_PARAM_FP16,
    BP_SLOTS_NULL,
    BP_Q_NULL,
    BP_O_NULL,
    BP_K_MISALIGNED,
    BP_ALOG_NULL,
    BP_DTBIAS_NULL,
    BP_Q_STRIDE,
    BP_Q_STRIDE_NEG,
    BP_V_STRIDE,
    BP_G_STRIDE,
    BP_BETA_STRIDE,
    BP_O_STRIDE,
    BP_NUM_K_HEADS,
    BP_NUM_V_HEADS,
    BP_HEAD_K_DIM,
    BP_HEAD_V_DIM,
    BP_COUNT
};

static const struct bad {
    const char *what;
    int status;
    const char *needle; /* what the message must name */
} bad_public[BP_COUNT] = {
    [BP_ARGS_NULL] = { "args NULL", STEPQ_EINVAL, "args is NULL" },
    [BP_LAYER_PAST] = { "layer 3 of 3", STEPQ_ERANGE, "layer 3" },
    [BP_LAYER_NEG] = { "layer -1", STEPQ_ERANGE, "layer -1" },
    [BP_MAGIC] = { "magic 0", STEPQ_EVERSION, "magic" },
    [BP_VERSION] = { "version 99", STEPQ_EVERSION, "version 99" },
    [BP_BATCH_BIG] = { "batch 70000", STEPQ_EINVAL, "batch = 70000" },
    [BP_BATCH_NEG] = { "batch -1", STEPQ_EINVAL, "batch = -1" },
    [BP_FLAGS] = { "an unknown flag", STEPQ_EINVAL, "flags" },
    [BP_SCALE_NAN] = { "scale NaN", STEPQ_EINVAL, "scale" },
    [BP_SCALE_NEG] = { "scale -1", STEPQ_EINVAL, "scale" },
    [BP_DTYPE_FP16] = { "dtype fp16", STEPQ_ENOTSUP, "dtype fp16" },
    [BP_DTYPE_BAD] = { "dtype 7", STEPQ_EINVAL, "dtype 7" },
    [BP_PARAM_FP16] = { "param_dtype fp16 with the gate", STEPQ_ENOTSUP, "param_dtype fp16" },
    [BP_SLOTS_NULL] = { "slot_ids NULL", STEPQ_EINVAL, "slot_ids is NULL" },
    [BP_Q_NULL] = { "q NULL", STEPQ_EINVAL, " q is NULL" },
    [BP_O_NULL] = { "o NULL", STEPQ_EINVAL, " o is NULL" },
    [BP_K_MISALIGNED] = { "k misaligned", STEPQ_EINVAL, " k = " },
    [BP_ALOG_NULL] = { "gate without A_log", STEPQ_EINVAL, "A_log" },
    [BP_DTBIAS_NULL] = { "gate without dt_bias", STEPQ_EINVAL, "dt_bias" },
    [BP_Q_STRIDE] = { "q_stride short", STEPQ_EINVAL, "q_stride" },
    [BP_Q_STRIDE_NEG] = { "q_stride -1", STEPQ_EINVAL, "q_stride" },
    [BP_V_STRIDE] = { "v_stride short", STEPQ_EINVAL, "v_stride" },
    [BP_G_STRIDE] = { "g_stride short", STEPQ_EINVAL, "g_stride" },
    [BP_BETA_STRIDE] = { "beta_stride short", STEPQ_EINVAL, "beta_stride" },
    [BP_O_STRIDE] = { "o_stride short", STEPQ_EINVAL, "o_stride" },
    [BP_NUM_K_HEADS] = { "num_k_heads wrong", STEPQ_ESHAPE, "num_k_heads" },
    [BP_NUM_V_HEADS] = { "num_v_heads wrong", STEPQ_ESHAPE, "num_v_heads" },
    [BP_HEAD_K_DIM] = { "head_k_dim 64", STEPQ_ESHAPE, "head_k_dim" },
    [BP_HEAD_V_DIM] = { "head_v_dim 64", STEPQ_ESHAPE, "head_v_dim" },
};

/* Applies refusal i to a copy of valid arguments a (and the layer, and the pointer passed). */
static void apply_public(int i, const struct fx_pools *fx, stepq_step_args *a, int *layer,
                         const stepq_step_args **ap)
{
    const int64_t H = fx->H, HV = fx->HV, K = FX_D;
    switch ((enum bad_public)i) {
    case BP_ARGS_NULL:
        *ap = NULL;
        break;
    case BP_LAYER_PAST:
        *layer = 3;
        break;
    case BP_LAYER_NEG:
        *layer = -1;
        break;
    case BP_MAGIC:
        a->magic = 0;
        break;
    case BP_VERSION:
        a->version = 99;
        break;
    case BP_BATCH_BIG:
        a->batch = 70000;
        break;
    case BP_BATCH_NEG:
        a->batch = -1;
        break;
    case BP_FLAGS:
        a->flags |= 1u << 7;
        break;
    case BP_SCALE_NAN:
        a->scale = NAN;
        break;
    case BP_SCALE_NEG:
        a->scale = -1.0f;
        break;
    case BP_DTYPE_FP16:
        a->dtype = STEPQ_DTYPE_FP16;
        break;
    case BP_DTYPE_BAD:
        a->dtype = (stepq_dtype)7;
        break;
    case BP_PARAM_FP16:
        a->flags |= STEPQ_STEP_GATE_IN_KERNEL;
        a->param_dtype = STEPQ_DTYPE_FP16;
        break;
    case BP_SLOTS_NULL:
        a->slot_ids = NULL;
        break;
    case BP_Q_NULL:
        a->q = NULL;
        break;
    case BP_O_NULL:
        a->o = NULL;
        break;
    case BP_K_MISALIGNED:
        a->k = (const uint8_t *)a->k + 2;
        break;
    case BP_ALOG_NULL:
        a->flags |= STEPQ_STEP_GATE_IN_KERNEL;
        a->A_log = NULL;
        break;
    case BP_DTBIAS_NULL:
        a->flags |= STEPQ_STEP_GATE_IN_KERNEL;
        a->dt_bias = NULL;
        break;
    case BP_Q_STRIDE:
        a->q_stride = H * K - 1;
        break;
    case BP_Q_STRIDE_NEG:
        a->q_stride = -1;
        break;
    case BP_V_STRIDE:
        a->v_stride = HV * K - 1;
        break;
    case BP_G_STRIDE:
        a->g_stride = (fx->arch == STEPQ_ARCH_KDA ? HV * K : HV) - 1;
        break;
    case BP_BETA_STRIDE:
        a->beta_stride = HV - 1;
        break;
    case BP_O_STRIDE:
        a->o_stride = HV * K - 1;
        break;
    case BP_NUM_K_HEADS:
        a->num_k_heads = (int32_t)H + 1;
        break;
    case BP_NUM_V_HEADS:
        a->num_v_heads = (int32_t)HV * 2;
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

/* The slot lists only the host pool checks (the CUDA pool cannot read its device list). */
static const struct host_ids {
    const char *what;
    int32_t ids[4];
    int status;
    const char *needle;
} host_ids[] = {
    { "slot id past the pool", { 3, 99, -1, 5 }, STEPQ_ERANGE, "slot_ids[1] = 99" },
    { "slot id -2", { -2, 0, -1, 5 }, STEPQ_ERANGE, "slot_ids[0] = -2" },
    { "slot listed twice", { 3, 5, -1, 5 }, STEPQ_EINVAL, "slot_ids[3] = 5 is listed more" },
    { "slot not allocated", { 3, 0, -1, 5 }, STEPQ_EINVAL, "slot_ids[3] = 5 is not allocated" },
};

/* A small GDN layer for the refused calls: 4 requests (ids 3, 0, -1, 5) over 5 slots. */
static int bad_setup(struct fx_pools *fx, struct fx_inputs *in, struct fx_step_io *hio,
                     struct fx_step_io *dio, int H, int HV)
{
    const struct fx_map_spec spec = {
        .arch = STEPQ_ARCH_GDN,
        .method = STEPQ_METHOD_STEPQ,
        .bits = 6,
        .H = H,
        .HV = HV,
        .w_lo = 0.5f,
        .w_hi = 2.0f,
    };
    static const int32_t ids[4] = { 3, 0, -1, 5 };
    struct fx_rng *rng = checkasm_rng();
    int rc = 0;

    CA_OK(fx_pools_open(fx, &spec, 5, rng));
    CA_OK(fx_pools_fill(fx, AMP, rng));
    CA_OK(fx_inputs_alloc(in, STEPQ_ARCH_GDN, 4, H, HV));
    CA_OK(fx_inputs_gen(in, fx->slots + 1, 0, rng));
    memcpy(in->slots, ids, sizeof(ids));
    CA_OK(fx_step_io_init(hio, in, 0, 0));
    CA_OK(fx_step_io_init(dio, in, 0, 1));
out:
    return rc;
}

/* o was never written and no input changed, on either side. */
static int untouched(const struct fx_step_io *hio, const struct fx_step_io *dio)
{
    const struct fx_step_io *io[2] = { hio, dio };
    for (int i = 0; i < 2; i++) {
        int64_t bad;
        CA_CHECK(fx_buf_compare(&io[i]->o, 0, &bad) >= 0 && bad < 0,
                 "%s o: byte %lld written by a refused call", i ? "device" : "host",
                 (long long)bad - FX_GUARD);
    }
    return check_io(hio, dio);
}

static int run_bad_public(void)
{
    struct fx_pools fx = { 0 };
    struct fx_inputs in = { 0 };
    struct fx_step_io hio = { 0 }, dio = { 0 };
    struct ca_snap sn = { 0 };
    char what[160];
    int rc = 0, n = 0;

    if ((rc = bad_setup(&fx, &in, &hio, &dio, 1, 2)) || (rc = ca_snap_take(&fx, &sn)))
        goto out;
    for (int i = 0; i < BP_COUNT; i++)
        for (int side = 0; side < 2; side++) {
            stepq_pool_t *pool = side ? fx.cuda : fx.host;
            stepq_step_args a;
            const stepq_step_args *ap = &a;
            int layer = fx.layer;
            fx_step_io_args(side ? &dio : &hio, STEPQ_STEP_L2NORM, &a);
            apply_public(i, &fx, &a, &layer, &ap);
            snprintf(what, sizeof(what), "%s pool, %s", side ? "CUDA" : "host", bad_public[i].what);
            if ((rc = ca_expect_refused(pool, stepq_pool_decode_step(pool, layer, ap, NULL),
                                        bad_public[i].status, bad_public[i].needle, what)))
                goto out;
            n++;
        }
    /* slot 5 free for the last list, given back afterwards (the pool hands out the freed one) */
    const int32_t five = 5;
    int32_t back = 0;
    for (size_t i = 0; i < sizeof(host_ids) / sizeof(host_ids[0]); i++) {
        stepq_step_args a;
        fx_step_io_args(&hio, STEPQ_STEP_L2NORM, &a);
        a.slot_ids = host_ids[i].ids;
        if (i + 1 == sizeof(host_ids) / sizeof(host_ids[0]))
            CA_OK(stepq_pool_free(fx.host, &five, 1));
        snprintf(what, sizeof(what), "host pool, %s", host_ids[i].what);
        if ((rc = ca_expect_refused(fx.host, stepq_pool_decode_step(fx.host, fx.layer, &a, NULL),
                                    host_ids[i].status, host_ids[i].needle, what)))
            goto out;
        n++;
    }
    CA_OK(stepq_pool_alloc(fx.host, 1, &back));
    CA_TRY(back == 5, "the host pool gave back slot %d, not 5", (int)back);
    if ((rc = ca_pools_unchanged(&fx, &sn, "after the refused calls")) ||
        (rc = untouched(&hio, &dio)))
        goto out;
    checkasm_note("%d refused calls: each its status and a message naming the argument, no page"
                  " byte, health word or output changed",
                  n);
out:
    ca_snap_free(&sn);
    fx_step_io_free(&hio);
    fx_step_io_free(&dio);
    fx_inputs_free(&in);
    fx_pools_close(&fx);
    return rc;
}

/*
 * The packed step entry's own checks, on the CUDA pool's layer: what the pool
 * validates before it calls (kept, the entry is callable alone) and what it
 * cannot pass wrong (a head count or arch not the layer's, misaligned pages,
 * a handle of another layer, no handle, an unknown variant), and a kernel
 * choice other than STEPQ__CUDA_COLUMN at prepare.
 */
static int run_bad_entry(void)
{
    static const char step[] = "cuda step (packed)";
    struct fx_pools fx = { 0 };
    struct fx_inputs in = { 0 };
    struct fx_step_io hio = { 0 }, dio = { 0 };
    struct ca_snap sn = { 0 };
    stepq__cuda_layer *L = NULL, *L3 = NULL, *bad = NULL;
    struct stepq__step_args a, x;
    stepq_step_args ad;
    int rc = 0, n = 0;

    if ((rc = bad_setup(&fx, &in, &hio, &dio, 2, 4)) || (rc = ca_snap_take(&fx, &sn)))
        goto out;
    struct stepq__packed_layer mis = fx.dpl, pl3 = fx.dpl;
    mis.base += 8; /* not 16-byte aligned */
    pl3.n_heads = 3;
    CA_OK(stepq__cuda_layer_prepare(&fx.dpl, &L));
    CA_OK(stepq__cuda_layer_prepare(&pl3, &L3));
    fx_step_io_args(&dio, STEPQ_STEP_L2NORM, &ad);
    CA_OK(fx_kernel_args(fx.cuda, &ad, NULL, &a));
    const struct {
        const char *what;
        int status;
        const struct stepq__packed_layer *pl;
        stepq__cuda_layer *L;
        int variant;
    } cases[] = {
        { "d_k = d_v = 64", STEPQ_ENOTSUP, &fx.dpl, L, STEPQ__CUDA_FUSED },
        { "batch 70000", STEPQ_EINVAL, &fx.dpl, L, STEPQ__CUDA_FUSED },
        { "slot ids NULL", STEPQ_EINVAL, &fx.dpl, L, STEPQ__CUDA_FUSED },
        { "q NULL", STEPQ_EINVAL, &fx.dpl, L, STEPQ__CUDA_FUSED },
        { "HV 8 on a layer of 4 heads", STEPQ_EINVAL, &fx.dpl, L, STEPQ__CUDA_FUSED },
        { "arch kda on a gdn layer", STEPQ_EINVAL, &fx.dpl, L, STEPQ__CUDA_FUSED },
        { "gate without A_log", STEPQ_EINVAL, &fx.dpl, L, STEPQ__CUDA_FUSED },
        { "pages not 16-byte aligned", STEPQ_EINVAL, &mis, L, STEPQ__CUDA_FUSED },
        { "a handle of 3 heads", STEPQ_EINVAL, &fx.dpl, L3, STEPQ__CUDA_FUSED },
        { "no handle, two-stage", STEPQ_EINVAL, &fx.dpl, NULL, STEPQ__CUDA_TWO_STAGE },
        { "variant 7", STEPQ_EINVAL, &fx.dpl, L, 7 },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        x = a;
        if (i == 0)
            x.d_k = x.d_v = 64;
        else if (i == 1)
            x.batch = 70000;
        else if (i == 2)
            x.slots = NULL;
        else if (i == 3)
            x.q = NULL;
        else if (i == 4)
            x.HV = 8;
        else if (i == 5)
            x.arch = STEPQ_ARCH_KDA;
        else if (i == 6)
            x.opt.gate_in_kernel = 1, x.A_log = NULL;
        if ((rc = ca_expect_refused_entry(
                 stepq__cuda_step_packed_prepared(&x, cases[i].pl, cases[i].L,
                                                  (stepq__cuda_variant)cases[i].variant),
                 cases[i].status, step, cases[i].what)))
            goto out;
        n++;
    }
    bad = L;
    if ((rc = ca_expect_refused_entry(
             stepq__cuda_layer_prepare_ex(&fx.dpl, ~STEPQ__CUDA_COLUMN, &bad), STEPQ_EINVAL,
             "cuda layer prepare", "prepare with unknown flags")))
        goto out;
    CA_TRY(bad == NULL, "a refused prepare left a handle");
    n++;
    /*
     * Dual heads of two decode fits in one layer: a map cannot say so (decode_fit is the map's),
     * but the entry takes hand-made layers and launches one fit per layer (a template bit), so it
     * refuses them by name, with the head that differs.
     */
    CA_TRY(fx.dpl.n_heads == 4, "the fixture's layer has %d heads, not 4", fx.dpl.n_heads);
    struct stepq__head_layout mixed_heads[4];
    memcpy(mixed_heads, fx.dpl.heads, sizeof(mixed_heads));
    mixed_heads[2].decode_fit = mixed_heads[0].decode_fit == STEPQ_DECODE_FIT_NOREFIT
                                    ? STEPQ_DECODE_FIT_ROWS
                                    : STEPQ_DECODE_FIT_NOREFIT;
    struct stepq__packed_layer mixed = fx.dpl;
    mixed.heads = mixed_heads;
    bad = L;
    if ((rc = ca_expect_refused_entry(stepq__cuda_layer_prepare_ex(&mixed, 0, &bad), STEPQ_EINVAL,
                                      "head 2's decode_fit",
                                      "prepare of a layer with two decode fits")))
        goto out;
    CA_TRY(bad == NULL, "a refused prepare left a handle");
    n++;
    if ((rc = ca_pools_unchanged(&fx, &sn, "after the refused calls")) ||
        (rc = untouched(&hio, &dio)))
        goto out;
    checkasm_note("%d refused calls: each its status and a message naming the entry, no CUDA error"
                  " left, no page byte changed",
                  n);
out:
    stepq__cuda_layer_release(L);
    stepq__cuda_layer_release(L3);
    ca_snap_free(&sn);
    fx_step_io_free(&hio);
    fx_step_io_free(&dio);
    fx_inputs_free(&in);
    fx_pools_close(&fx);
    return rc;
}

/*
 * stepq_pool_supports on a CUDA pool of an fp8 map of 128x128 heads (GDN and KDA): every
 * layer runs the decode step (fp32 and bf16 inputs), pack and unpack (both layouts, fp32
 * and bf16), as a server asks at load time.
 */
static int run_fp8_supports(void)
{
    stepq_map_t *map = NULL;
    stepq_pool_t *pool = NULL;
    int rc = 0;
    for (int arch = 0; arch < 2 && !rc; arch++) {
        const struct fx_map_spec spec = {
            .arch = (stepq_arch)arch, .method = STEPQ_METHOD_FP8, .H = 2, .HV = 4, .n_layers = 2
        };
        CA_OK(fx_map_create(&spec, checkasm_rng(), &map));
        CA_OK(fx_pool_open(map, STEPQ_POOL_BACKEND_CUDA, 2, NULL, &pool));
        for (int dt = 0; dt < 2 && !rc; dt++) {
            stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
            a.dtype = dt ? STEPQ_DTYPE_BF16 : STEPQ_DTYPE_FP32;
            int st = stepq_pool_supports(pool, STEPQ_OP_DECODE_STEP, -1, &a);
            if (st < 0)
                rc = checkasm_fail(__FILE__, __LINE__, "%s decode %s: %s", arch ? "kda" : "gdn",
                                   stepq_dtype_name(a.dtype), stepq_pool_last_error(pool));
            for (int lay = 0; lay < 2 && !rc; lay++) {
                stepq_prefill_args p = STEPQ_PREFILL_ARGS_INITIALIZER;
                p.dtype = a.dtype;
                p.layout = lay ? STEPQ_STATE_LAYOUT_VK : STEPQ_STATE_LAYOUT_KV;
                if ((st = stepq_pool_supports(pool, STEPQ_OP_PREFILL_PACK, 1, &p)) < 0 ||
                    (st = stepq_pool_supports(pool, STEPQ_OP_PREFILL_UNPACK, 0, &p)) < 0)
                    rc = checkasm_fail(__FILE__, __LINE__, "%s pack/unpack %s %s: %s",
                                       arch ? "kda" : "gdn", stepq_dtype_name(p.dtype),
                                       lay ? "[V,K]" : "[K,V]", stepq_pool_last_error(pool));
            }
        }
        stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
        stepq_map_close(map);
        pool = NULL;
        map = NULL;
    }
out:
    if (pool)
        stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
    stepq_map_close(map);
    return rc;
}

/*
 * A CUDA pool whose map has 64x64 heads opens (its slots and copies work) but
 * refuses every step, pack and unpack with STEPQ_ENOTSUP naming the kernels'
 * 128, as stepq_pool_supports says beforehand.
 */
static int run_small_heads(stepq_method method)
{
    static const int ids[1] = { 0 };
    stepq_model_shape s;
    stepq_map_t *map = NULL;
    stepq_pool_t *pool = NULL;
    struct fx_buf dslots = { 0 }, dense = { 0 }, q = { 0 };
    int rc = 0;

    memset(&s, 0, sizeof(s));
    s.arch = STEPQ_ARCH_GDN;
    s.n_layers = 1;
    s.layer_ids = ids;
    s.num_k_heads = 1;
    s.num_v_heads = 2;
    s.head_k_dim = 64;
    s.head_v_dim = 64;
    CA_OK(stepq_map_create(
        &s, method, stepq__method_has_units(method) ? 6 : stepq__method_fixed_bits(method), &map));
    CA_OK(fx_pool_open(map, STEPQ_POOL_BACKEND_CUDA, 2, NULL, &pool));
    CA_OK(fx_buf_alloc(&dslots, sizeof(int32_t), 1));
    CA_OK(fx_buf_alloc(&dense, 4 * 2 * 64 * 64, 1));
    CA_OK(fx_buf_alloc(&q, 4 * 2 * 64, 1));
    stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
    a.batch = 1;
    a.slot_ids = dslots.p;
    a.q = a.k = a.v = a.g = a.beta = a.o = q.p;
    stepq_prefill_args p = STEPQ_PREFILL_ARGS_INITIALIZER;
    p.n = 1;
    p.slot_ids = dslots.p;
    p.states = dense.p;
    if ((rc = ca_expect_refused(pool, stepq_pool_supports(pool, STEPQ_OP_DECODE_STEP, -1, &a),
                                STEPQ_ENOTSUP, "128", "supports(decode)")) ||
        (rc = ca_expect_refused(pool, stepq_pool_decode_step(pool, 0, &a, NULL), STEPQ_ENOTSUP,
                                "128", "decode step")) ||
        (rc = ca_expect_refused(pool, stepq_pool_prefill_pack(pool, 0, &p, NULL), STEPQ_ENOTSUP,
                                "128", "prefill pack")) ||
        (rc = ca_expect_refused(pool, stepq_pool_prefill_unpack(pool, 0, &p, NULL), STEPQ_ENOTSUP,
                                "128", "prefill unpack")))
        goto out;
    int64_t bad;
    CA_OK(fx_buf_compare(&dense, 0, &bad));
    CA_TRY(bad < 0, "a refused unpack wrote the dense tensor (byte %lld)", (long long)bad);
    CA_OK(fx_buf_compare(&q, 0, &bad));
    CA_TRY(bad < 0, "a refused step wrote its output (byte %lld)", (long long)bad);
    checkasm_note("%s", stepq_pool_last_error(pool));
out:
    fx_buf_free(&dslots);
    fx_buf_free(&dense);
    fx_buf_free(&q);
    if (pool)
        stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
    stepq_map_close(map);
    return rc;
}

/*
 * A layer of arith fp16 heads on a handle of the two-stage variant or of the column kernels:
 * STEPQ_ENOTSUP naming the arith, and no page byte changed.
 */
static int run_f16_refused(void)
{
    const struct fx_map_spec spec = {
        .arch = STEPQ_ARCH_GDN,
        .method = STEPQ_METHOD_STEPQ,
        .bits = 6,
        .H = 2,
        .HV = 4,
        .w_lo = 0.5f,
        .w_hi = 2.0f,
        .arith = STEPQ_ARITH_FP16,
    };
    struct fx_rng *rng = checkasm_rng();
    struct fx_pools fx = { 0 };
    struct fx_inputs in = { 0 };
    struct fx_step_io dio = { 0 };
    stepq__cuda_layer *L = NULL;
    uint8_t *before = NULL, *after = NULL;
    stepq_step_args ad;
    struct stepq__step_args ka;
    int rc = 0;

    CA_OK(fx_pools_open(&fx, &spec, 4, rng));
    CA_OK(fx_pools_fill(&fx, AMP, rng));
    CA_OK(fx_inputs_alloc(&in, STEPQ_ARCH_GDN, 2, 2, 4));
    CA_OK(fx_inputs_gen(&in, fx.slots + 1, 0, rng));
    CA_OK(fx_step_io_init(&dio, &in, 0, 1));
    fx_step_io_args(&dio, step_flags(0), &ad);
    CA_OK(fx_kernel_args(fx.cuda, &ad, NULL, &ka));
    before = malloc(fx.pages_bytes);
    after = malloc(fx.pages_bytes);
    CA_TRY(before && after, "out of memory");
    CA_OK(fx_pools_download(&fx, before, NULL));
    for (int k = 0; k < 2 && rc == 0; k++) {
        CA_OK(stepq__cuda_layer_prepare_ex(&fx.dpl, k ? STEPQ__CUDA_COLUMN : 0, &L));
        const int got = stepq__cuda_step_packed_prepared(
            &ka, &fx.dpl, L, k ? STEPQ__CUDA_FUSED : STEPQ__CUDA_TWO_STAGE);
        stepq__cuda_layer_release(L);
        L = NULL;
        CA_TRY(got == STEPQ_ENOTSUP && strstr(stepq_last_error(), "arith"),
               "%s: returned %s (%s), expected STEPQ_ENOTSUP naming arith",
               k ? "column kernels" : "two-stage variant", stepq_status_name(got),
               stepq_last_error());
        CA_TRY(cudaDeviceSynchronize() == cudaSuccess && cudaGetLastError() == cudaSuccess,
               "a CUDA error after the refused call");
        CA_OK(fx_pools_download(&fx, after, NULL));
        CA_TRY(!memcmp(before, after, fx.pages_bytes), "%s: the refused call changed the pages",
               k ? "column kernels" : "two-stage variant");
    }
out:
    free(before);
    free(after);
    fx_step_io_free(&dio);
    fx_inputs_free(&in);
    fx_pools_close(&fx);
    return rc;
}

/*
 * The cases each cheaper decode fit (norefit, rows) runs first, in this order: GDN stepq@6 and
 * @4 (uniform widths), GDN stepq mixed with a pivot head, KDA stepq mixed rows (run-time
 * widths), bf16 views, dsq GDN and KDA, spatial@3. batch and fit are set per run.
 */
static const struct params fit_cases[] = {
    { .arch = STEPQ_ARCH_GDN, .method = STEPQ_METHOD_STEPQ, .bits = 6, .H = 2, .HV = 4 },
    { .arch = STEPQ_ARCH_GDN, .method = STEPQ_METHOD_STEPQ, .bits = 4, .H = 2, .HV = 4, .gate = 1 },
    { .arch = STEPQ_ARCH_GDN, .method = STEPQ_METHOD_STEPQ, .H = 2, .HV = 4, .gate = 1 },
    { .arch = STEPQ_ARCH_KDA, .method = STEPQ_METHOD_STEPQ, .H = 2, .HV = 2 },
    { .arch = STEPQ_ARCH_KDA, .method = STEPQ_METHOD_STEPQ, .H = 2, .HV = 2, .gate = 1, .view = 1 },
    { .arch = STEPQ_ARCH_GDN, .method = STEPQ_METHOD_DSQ, .bits = 5, .H = 2, .HV = 4 },
    { .arch = STEPQ_ARCH_KDA, .method = STEPQ_METHOD_DSQ, .bits = 4, .H = 1, .HV = 2, .gate = 1 },
    { .arch = STEPQ_ARCH_GDN, .method = STEPQ_METHOD_SPATIAL, .bits = 3, .H = 2, .HV = 4 },
};

static void fit_first(stepq_decode_fit fit, int batch)
{
    for (size_t i = 0; i < sizeof(fit_cases) / sizeof(fit_cases[0]); i++) {
        struct params p = fit_cases[i];
        p.batch = batch;
        p.fit = fit;
        one(p);
    }
}

/*
 * The fp16 decode step's cases on one arch at batch B. GDN: dual-axis heads of every width,
 * the mixed map with a pivot head (the fp16 kernel's pivot item), dsq and spatial; KDA (the
 * kernel's SQ_V_KDA instantiation): rows of mixed widths with a pivot row per head, and heads of
 * one width. Both: in-kernel gates, bf16 views, a NaN in q, huge states (saturating scales), a
 * zero column scale in the start pages, zeroed start pages (fresh slots; GDN with fp32
 * arithmetic too), ids outside 0..slots, a row split, 40 x 8 heads (not small); a NaN in a
 * pivot row (GDN: the pivot head), GDN a huge state in the mixed map (the pivot head's values
 * saturating); the decode fit norefit beside the exact fit.
 */
static void f16_cases(stepq_arch arch, int B, int small)
{
    static const int gw[] = { 2, 3, 4, 5, 6, 8 }, kw[] = { 0, 2, 3, 5, 6, 8 };
    const int kda = arch == STEPQ_ARCH_KDA;
    const stepq_method SQ = STEPQ_METHOD_STEPQ;
    const struct params base = {
        .arch = arch, .method = SQ, .H = 2, .HV = kda ? 2 : 4, .batch = B, .arith = STEPQ_ARITH_FP16
    };
    struct params p;

    /* with the exact fit and with norefit (no step-6 refit) */
    for (int f = 0; f < 2; f++) {
        const stepq_decode_fit fit = f ? STEPQ_DECODE_FIT_NOREFIT : STEPQ_DECODE_FIT_EXACT;
        for (int w = 0; w < 6; w++) {
            p = base, p.fit = fit, p.bits = kda ? kw[w] : gw[w], p.gate = (w + f + kda) & 1;
            one(p);
        }
        if (!kda) {
            p = base, p.fit = fit; /* mixed widths and a pivot head */
            one(p);
            p = base, p.fit = fit, p.method = STEPQ_METHOD_DSQ, p.bits = 5, p.view = f;
            one(p);
            p = base, p.fit = fit, p.bits = 4, p.zero_col = 1;
            one(p);
        }
        p = base, p.fit = fit, p.bits = kda ? 0 : 6, p.huge = 1;
        one(p);
        p = base, p.fit = fit, p.zero_pages = 1;
        one(p);
        p = base, p.fit = fit, p.nan_state = 1; /* GDN: in the pivot head (its fp32 item) */
        one(p);
        if (!kda) {
            p = base, p.fit = fit, p.huge = 1; /* the pivot head's values saturating */
            one(p);
        }
    }
    p = base, p.gate = 1, p.view = kda;
    one(p);
    if (!kda) {
        p = base, p.method = STEPQ_METHOD_SPATIAL, p.bits = 3, p.gate = 1;
        one(p);
        p = base, p.view = 1;
        one(p);
    }
    p = base, p.bits = kda ? 0 : 6, p.nonfinite = 1;
    one(p);
    p = base, p.wild_ids = 1, p.method = kda ? STEPQ_METHOD_DSQ : SQ, p.bits = kda ? 4 : 8;
    one(p);
    p = base, p.gate = 1, p.row_split = 0.75;
    one(p);
    p = base, p.zero_pages = !kda, p.zero_col = kda, p.arith = kda ? base.arith : STEPQ_ARITH_FP32;
    one(p); /* GDN: zeroed pages in fp32 arithmetic; KDA: a zero column scale */
    if (!small) {
        p = base, p.H = 4, p.HV = 8, p.batch = 40, p.gate = 1;
        one(p);
    }
}

void checkasm_check_decode(void)
{
    static const int widths[] = { 2, 3, 4, 5, 6, 8 };
    const stepq_arch G = STEPQ_ARCH_GDN, K = STEPQ_ARCH_KDA;
    const stepq_method SQ = STEPQ_METHOD_STEPQ;
    const int small = checkasm_small(), B = small ? 3 : 12;

    /* GDN with GVA (HV = 2H), every method and bit width. */
    for (int m = 0; m < STEPQ_METHOD_COUNT; m++) {
        if (!stepq__method_has_units((stepq_method)m)) {
            one((struct params){ .arch = G, .method = m, .H = 2, .HV = 4, .batch = B });
            continue;
        }
        for (int w = 0; w < 6; w++)
            if (!small || w == 4)
                one((struct params){ .arch = G,
                                     .method = m,
                                     .bits = widths[w],
                                     .H = 2,
                                     .HV = 4,
                                     .batch = B,
                                     .gate = w & 1 });
        if (m == STEPQ_METHOD_TEMPORAL || m == SQ)
            one((struct params){ .arch = G, .method = m, .H = 2, .HV = 4, .batch = B, .gate = 1 });
    }
    /* KDA: per-row bits with pivots, one shared column-scale vector per head. */
    one((struct params){ .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B });
    one((struct params){
        .arch = K, .method = STEPQ_METHOD_TEMPORAL, .H = 2, .HV = 2, .batch = B, .gate = 1 });
    one((struct params){
        .arch = K, .method = STEPQ_METHOD_UNIFORM, .bits = 4, .H = 2, .HV = 2, .batch = B });
    one((struct params){
        .arch = K, .method = STEPQ_METHOD_DSQ, .bits = 5, .H = 1, .HV = 2, .batch = B, .gate = 1 });
    one((struct params){
        .arch = K, .method = STEPQ_METHOD_FP32, .H = 2, .HV = 2, .batch = B, .gate = 1 });
    /* the map's row split (row_split) in the dual-axis fit of the step */
    one((struct params){
        .arch = G, .method = SQ, .H = 2, .HV = 4, .batch = B, .gate = 1, .row_split = 0.75 });
    one((struct params){ .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .row_split = 0.6 });
    one((struct params){ .arch = G,
                         .method = STEPQ_METHOD_DSQ,
                         .bits = 4,
                         .H = 2,
                         .HV = 4,
                         .batch = B,
                         .row_split = 0.75,
                         .via = VIA_TWO_STAGE });
    /*
     * The decode fit norefit (decode_fit): the step-2 column scales, against the reference's
     * norefit fit (kernels/quant.h), with the same tolerances. GDN stepq@6 and @4 (uniform
     * widths), GDN stepq mixed with a pivot head, KDA stepq mixed rows (run-time widths), dsq;
     * bf16 views, saturating scales, a NaN in q; the two-stage variant (its stage 2 takes the
     * fit) and the column kernel.
     */
    {
        const stepq_decode_fit NR = STEPQ_DECODE_FIT_NOREFIT;
        fit_first(NR, B);
        one((struct params){ .arch = G,
                             .method = SQ,
                             .bits = 6,
                             .H = 2,
                             .HV = 4,
                             .batch = B,
                             .huge = 1,
                             .fit = NR });
        one((struct params){ .arch = G,
                             .method = SQ,
                             .bits = 6,
                             .H = 2,
                             .HV = 4,
                             .batch = B,
                             .nonfinite = 1,
                             .fit = NR });
        one((struct params){
            .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .row_split = 0.6, .fit = NR });
        one((struct params){ .arch = G,
                             .method = SQ,
                             .bits = 6,
                             .H = 2,
                             .HV = 4,
                             .batch = B,
                             .via = VIA_TWO_STAGE,
                             .fit = NR });
        one((struct params){ .arch = K,
                             .method = SQ,
                             .H = 2,
                             .HV = 2,
                             .batch = B,
                             .via = VIA_TWO_STAGE,
                             .fit = NR });
        one((struct params){ .arch = G,
                             .method = SQ,
                             .bits = 4,
                             .H = 2,
                             .HV = 4,
                             .batch = B,
                             .via = VIA_COLUMN,
                             .fit = NR });
        one((struct params){
            .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .via = VIA_COLUMN, .fit = NR });
    }
    /*
     * The decode fit rows (decode_fit): the old column scales kept, the row scales refitted
     * to them, against the reference's rows fit (kernels/quant.h), with the same tolerances.
     * GDN stepq@6 and @4 (uniform widths), GDN stepq mixed with a pivot head, KDA stepq mixed
     * rows (run-time widths), dsq GDN and KDA, spatial@3; the fallback to the exact fit: a
     * zero column scale in the start pages, huge states (scales at the saturation limit:
     * heads may serve or fall back); a NaN in q; a NaN in a pivot row of the start pages (the
     * state's non-finite elements zeroed first, then the rows fit; the exact fit's case too);
     * bf16 views; the two-stage variant (its stage 2 reads the old scales from the page) and
     * the column kernel.
     */
    {
        const stepq_decode_fit RW = STEPQ_DECODE_FIT_ROWS;
        fit_first(RW, B);
        one((struct params){ .arch = G,
                             .method = SQ,
                             .bits = 6,
                             .H = 2,
                             .HV = 4,
                             .batch = B,
                             .zero_col = 1,
                             .fit = RW });
        one((struct params){
            .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .zero_col = 1, .fit = RW });
        one((struct params){ .arch = G,
                             .method = SQ,
                             .bits = 6,
                             .H = 2,
                             .HV = 4,
                             .batch = B,
                             .huge = 1,
                             .fit = RW });
        one((struct params){
            .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .huge = 1, .fit = RW });
        one((struct params){ .arch = G,
                             .method = SQ,
                             .bits = 6,
                             .H = 2,
                             .HV = 4,
                             .batch = B,
                             .nonfinite = 1,
                             .fit = RW });
        one((struct params){
            .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .nan_state = 1 });
        one((struct params){
            .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .nan_state = 1, .fit = RW });
        one((struct params){ .arch = K,
                             .method = SQ,
                             .H = 2,
                             .HV = 2,
                             .batch = B,
                             .via = VIA_TWO_STAGE,
                             .nan_state = 1,
                             .fit = RW });
        one((struct params){ .arch = K,
                             .method = SQ,
                             .H = 2,
                             .HV = 2,
                             .batch = B,
                             .via = VIA_COLUMN,
                             .nan_state = 1,
                             .fit = RW });
        one((struct params){ .arch = G,
                             .method = SQ,
                             .bits = 6,
                             .H = 2,
                             .HV = 4,
                             .batch = B,
                             .via = VIA_TWO_STAGE,
                             .fit = RW });
        one((struct params){ .arch = K,
                             .method = SQ,
                             .H = 2,
                             .HV = 2,
                             .batch = B,
                             .via = VIA_TWO_STAGE,
                             .zero_col = 1,
                             .fit = RW });
        one((struct params){ .arch = G,
                             .method = SQ,
                             .bits = 4,
                             .H = 2,
                             .HV = 4,
                             .batch = B,
                             .via = VIA_COLUMN,
                             .fit = RW });
        one((struct params){ .arch = K,
                             .method = SQ,
                             .H = 2,
                             .HV = 2,
                             .batch = B,
                             .via = VIA_COLUMN,
                             .zero_col = 1,
                             .fit = RW });
    }
    /* bf16 pages step on the dense tile kernel (kernels/cuda/layer.cu): KDA, NaN, views */
    one((struct params){
        .arch = K, .method = STEPQ_METHOD_BF16, .H = 2, .HV = 2, .batch = B, .gate = 1 });
    one((struct params){
        .arch = G, .method = STEPQ_METHOD_BF16, .H = 2, .HV = 4, .batch = B, .nonfinite = 1 });
    one((struct params){ .arch = K,
                         .method = STEPQ_METHOD_BF16,
                         .H = 2,
                         .HV = 2,
                         .batch = B,
                         .gate = 1,
                         .nonfinite = 1,
                         .view = 1 });
    /* non-finite inputs leave the head untouched; batches of 1 and 40 */
    one((struct params){ .arch = G, .method = SQ, .H = 2, .HV = 4, .batch = B, .nonfinite = 1 });
    one((struct params){
        .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .gate = 1, .nonfinite = 1 });
    one((struct params){ .arch = G, .method = SQ, .bits = 6, .H = 2, .HV = 4, .batch = 1 });
    if (!small) {
        one((struct params){ .arch = G, .method = SQ, .H = 4, .HV = 8, .batch = 40, .gate = 1 });
        one((struct params){ .arch = K, .method = SQ, .H = 4, .HV = 8, .batch = 40, .gate = 1 });
    }
    /* the inputs as a server hands them: bf16 views of a fused projection, padded rows */
    one((struct params){
        .arch = G, .method = SQ, .H = 2, .HV = 4, .batch = B, .gate = 1, .view = 1 });
    one((struct params){
        .arch = G, .method = SQ, .bits = 6, .H = 2, .HV = 4, .batch = B, .view = 1 });
    one((struct params){ .arch = K,
                         .method = SQ,
                         .H = 2,
                         .HV = 2,
                         .batch = B,
                         .gate = 1,
                         .nonfinite = 1,
                         .view = 1 });
    one((struct params){ .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .view = 1 });
    one((struct params){ .arch = G,
                         .method = STEPQ_METHOD_FP32,
                         .H = 2,
                         .HV = 4,
                         .batch = B,
                         .gate = 1,
                         .view = 1 });
    /* saturating scales take the clamped quantizer */
    one((struct params){
        .arch = G, .method = SQ, .bits = 6, .H = 2, .HV = 4, .batch = B, .huge = 1 });
    one((struct params){ .arch = G,
                         .method = STEPQ_METHOD_UNIFORM,
                         .bits = 4,
                         .H = 2,
                         .HV = 4,
                         .batch = B,
                         .huge = 1 });
    /*
     * The GDN pivot head (sq_pivot_head_step, its own item in the tile kernel): huge states
     * (fp16 values saturating at +-65504, health SATURATED) and a NaN in its rows (zeroed, the
     * readout recomputed, health STATE).
     */
    one((struct params){ .arch = G, .method = SQ, .H = 2, .HV = 4, .batch = B, .huge = 1 });
    one((struct params){ .arch = G, .method = SQ, .H = 2, .HV = 4, .batch = B, .nan_state = 1 });
    /* ids outside 0..slots on the CUDA pool are skipped like -1 (documented) */
    one((struct params){
        .arch = G, .method = SQ, .H = 2, .HV = 4, .batch = B, .gate = 1, .wild_ids = 1 });

    /* the two-stage variant (the paper's), through the entry on the CUDA pool's pages */
    one((struct params){ .arch = G,
                         .method = SQ,
                         .H = 2,
                         .HV = 4,
                         .batch = B,
                         .nonfinite = 1,
                         .via = VIA_TWO_STAGE });
    one((struct params){
        .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .gate = 1, .via = VIA_TWO_STAGE });
    one((struct params){ .arch = K,
                         .method = SQ,
                         .H = 2,
                         .HV = 2,
                         .batch = B,
                         .gate = 1,
                         .view = 1,
                         .via = VIA_TWO_STAGE });
    /*
     * The thread-per-column kernels (kept for dense pages, two-stage stage 1
     * and comparison), chosen per handle.
     */
    one((struct params){
        .arch = G, .method = SQ, .H = 2, .HV = 4, .batch = B, .gate = 1, .via = VIA_COLUMN });
    one((struct params){ .arch = K, .method = SQ, .H = 2, .HV = 2, .batch = B, .via = VIA_COLUMN });
    one((struct params){ .arch = G,
                         .method = SQ,
                         .H = 2,
                         .HV = 4,
                         .batch = B,
                         .gate = 1,
                         .view = 1,
                         .via = VIA_COLUMN });

    /*
     * fp8 (the fused step on the warp kernel's fp8 instantiation): GDN and KDA, batches of 1,
     * B and 40, in-kernel gate, bf16 strided inputs, NaN inputs, huge states, the two-stage
     * variant (stage 1 on the column kernel, stage 2 the fp8 pack of the updated state) and
     * the fused step on an explicit column-kernel handle.
     */
    const stepq_method F8 = STEPQ_METHOD_FP8;
    one((struct params){ .arch = G, .method = F8, .H = 2, .HV = 4, .batch = 1 });
    one((struct params){ .arch = K, .method = F8, .H = 2, .HV = 2, .batch = B, .gate = 1 });
    one((struct params){ .arch = G, .method = F8, .H = 2, .HV = 4, .batch = B, .view = 1 });
    one((struct params){
        .arch = K, .method = F8, .H = 2, .HV = 2, .batch = B, .nonfinite = 1, .view = 1 });
    one((struct params){ .arch = G, .method = F8, .H = 2, .HV = 4, .batch = B, .huge = 1 });
    one((struct params){
        .arch = G, .method = F8, .H = 2, .HV = 4, .batch = B, .gate = 1, .via = VIA_TWO_STAGE });
    one((struct params){
        .arch = K, .method = F8, .H = 2, .HV = 2, .batch = B, .gate = 1, .via = VIA_COLUMN });
    if (!small) {
        one((struct params){ .arch = G, .method = F8, .H = 4, .HV = 8, .batch = 40, .gate = 1 });
        one((struct params){ .arch = K, .method = F8, .H = 4, .HV = 8, .batch = 40 });
        one((struct params){ .arch = K, .method = F8, .H = 2, .HV = 2, .batch = 1, .view = 1 });
        one((struct params){
            .arch = G, .method = F8, .H = 2, .HV = 4, .batch = B, .wild_ids = 1, .gate = 1 });
    }

    /*
     * The fp16 decode step (arith fp16, kernels/cuda/f16_kernel.cuh) on GDN and KDA (f16_cases);
     * the variants that do not implement it refuse (run_f16_refused).
     */
    {
        f16_cases(G, B, small);
        f16_cases(K, B, small);
        if (checkasm_check("decode arith fp16: the two-stage variant and the column kernels "
                           "refuse (STEPQ_ENOTSUP)"))
            checkasm_report(run_f16_refused());
    }

    if (checkasm_check("decode invalid arguments (public API, host and CUDA pools)"))
        checkasm_report(run_bad_public());
    if (checkasm_check("decode invalid arguments (packed step entry)"))
        checkasm_report(run_bad_entry());
    if (checkasm_check("decode, pack, unpack on a CUDA pool of 64x64 heads: STEPQ_ENOTSUP"))
        checkasm_report(run_small_heads(STEPQ_METHOD_UNIFORM));
    if (checkasm_check("supports: decode, pack, unpack on a CUDA pool of an fp8 map"))
        checkasm_report(run_fp8_supports());
    if (checkasm_check("decode, pack, unpack on a CUDA pool of 64x64 fp8 heads: STEPQ_ENOTSUP"))
        checkasm_report(run_small_heads(STEPQ_METHOD_FP8));
}
