/*
 * The pool's data path (stepq/step.h): argument checks shared by both
 * backends, the host-side slot checks, and the hand-over to the backend's
 * kernels (backend_host.c: the C reference; backend_cuda.c: the CUDA
 * kernels). Everything here is host bookkeeping: no device memory is read,
 * so the CUDA path stays capturable in a CUDA graph.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pool/internal.h"

/* The CUDA kernels' grid limit on the batch (gridDim.y), applied on both
 * backends so a server sees the same contract whatever it runs on. */
#define MAX_BATCH 65535

void stepq__pool_packed_layer(const struct stepq_pool *pool, int layer,
                              struct stepq__packed_layer *out)
{
    const struct stepq__pool_layout *L = &pool->layout;
    const size_t nh = (size_t)L->pub.n_local_heads, first = (size_t)layer * nh;

    memset(out, 0, sizeof(*out));
    out->base = pool->pages;
    out->page_stride = pool->page_bytes;
    out->n_slots = pool->slots + 1;
    out->n_heads = (int)nh;
    out->heads = L->heads + first;
    out->head_offset = L->head_off + first;
    out->row_impact = L->row_impact ? L->row_impact + first * (size_t)L->pub.d_k : NULL;
}

/* --- argument import and checks ------------------------------------------ */

/* Where a failing check writes: the pool's buffer (and the thread's). */
#define FAIL(pool, status, ...) stepq__error_obj((pool)->err, status, __VA_ARGS__)

/* The caller's versioned args (NULL refused) as this library's struct, errors in the pool. */
static int import_args(stepq_pool_t *pool, const void *user, void *dst, const void *defaults,
                       size_t size, const size_t *ends, unsigned version, const char *what,
                       const char *fn)
{
    int ret;

    if (!user)
        return FAIL(pool, STEPQ_EINVAL, "%s: args is NULL", fn);
    ret = stepq__config_import(dst, defaults, size, user, ends, version, what);
    return ret < 0 ? FAIL(pool, ret, "%s: %s", fn, stepq_last_error()) : STEPQ_OK;
}

static int import_step(stepq_pool_t *pool, const stepq_step_args *user, stepq_step_args *a,
                       const char *fn)
{
    static const stepq_step_args defaults = STEPQ_STEP_ARGS_INITIALIZER;
    static const size_t ends[] = { STEPQ__FIELD_END(stepq_step_args, head_v_dim) };

    return import_args(pool, user, a, &defaults, sizeof(*a), ends, STEPQ_STEP_ARGS_VERSION,
                       "stepq_step_args", fn);
}

static int import_prefill(stepq_pool_t *pool, const stepq_prefill_args *user, stepq_prefill_args *p,
                          const char *fn)
{
    static const stepq_prefill_args defaults = STEPQ_PREFILL_ARGS_INITIALIZER;
    static const size_t ends[] = { STEPQ__FIELD_END(stepq_prefill_args, head_v_dim) };

    return import_args(pool, user, p, &defaults, sizeof(*p), ends, STEPQ_PREFILL_ARGS_VERSION,
                       "stepq_prefill_args", fn);
}

/* layer in range, and a pool built from a map (a synthetic layout has no heads). */
static int check_layer(stepq_pool_t *pool, int layer, int any, const char *fn)
{
    const stepq_pool_layout *l = &pool->layout.pub;

    if (!pool->layout.heads)
        return FAIL(pool, STEPQ_ENOTSUP, "%s: the pool was opened without a map: it has no steps",
                    fn);
    if ((any && layer == -1) || (layer >= 0 && layer < l->n_layers))
        return STEPQ_OK;
    return FAIL(pool, STEPQ_ERANGE, "%s: layer %d is not a recurrent layer (0..%d%s)", fn, layer,
                l->n_layers - 1, any ? ", or -1 for all" : "");
}

static int check_dtype(stepq_pool_t *pool, stepq_dtype dt, const char *field, const char *fn)
{
    if (dt == STEPQ_DTYPE_FP32 || dt == STEPQ_DTYPE_BF16)
        return STEPQ_OK;
    if (dt == STEPQ_DTYPE_FP16)
        return FAIL(pool, STEPQ_ENOTSUP, "%s: %s fp16 is not supported (fp32, bf16)", fn, field);
    return FAIL(pool, STEPQ_EINVAL, "%s: %s %d is not a stepq_dtype", fn, field, (int)dt);
}

static int check_declared(stepq_pool_t *pool, int32_t declared, int actual, const char *field,
                          const char *fn)
{
    if (declared == 0 || declared == actual)
        return STEPQ_OK;
    return FAIL(pool, STEPQ_ESHAPE, "%s: %s = %" PRId32 ", the map's layer has %d on this rank", fn,
                field, declared, actual);
}

static int check_stride(stepq_pool_t *pool, int64_t stride, uint64_t need, const char *field,
                        const char *fn)
{
    if (stride == 0 || (stride > 0 && (uint64_t)stride >= need))
        return STEPQ_OK;
    return FAIL(pool, STEPQ_EINVAL,
                "%s: %s = %" PRId64 " elements is less than one request's %" PRIu64, fn, field,
                stride, need);
}

/* A tensor the call reads or writes: present, and aligned to its element type. */
static int check_ptr(stepq_pool_t *pool, const void *p, size_t align, const char *field,
                     const char *fn)
{
    if (!p)
        return FAIL(pool, STEPQ_EINVAL, "%s: %s is NULL", fn, field);
    if ((uintptr_t)p % align)
        return FAIL(pool, STEPQ_EINVAL, "%s: %s = %p is not %zu-byte aligned", fn, field, p, align);
    return STEPQ_OK;
}

/* What a decode step needs of every backend, tensors aside. */
static int check_step_shape(stepq_pool_t *pool, const stepq_step_args *a, const char *fn)
{
    const struct stepq__pool_layout *L = &pool->layout;
    const unsigned known = STEPQ_STEP_L2NORM | STEPQ_STEP_GATE_IN_KERNEL | STEPQ_STEP_BETA_SIGMOID;
    int ret;

    if ((ret = check_declared(pool, a->num_k_heads, L->n_k_heads, "num_k_heads", fn)) < 0 ||
        (ret = check_declared(pool, a->num_v_heads, L->pub.n_local_heads, "num_v_heads", fn)) < 0 ||
        (ret = check_declared(pool, a->head_k_dim, L->pub.d_k, "head_k_dim", fn)) < 0 ||
        (ret = check_declared(pool, a->head_v_dim, L->pub.d_v, "head_v_dim", fn)) < 0)
        return ret;
    if (a->batch < 0 || a->batch > MAX_BATCH)
        return FAIL(pool, STEPQ_EINVAL, "%s: batch = %" PRId32 " is outside 0..%d", fn, a->batch,
                    MAX_BATCH);
    if (a->flags & ~known)
        return FAIL(pool, STEPQ_EINVAL, "%s: flags has unknown bits 0x%x", fn, a->flags & ~known);
    if (!isfinite(a->scale) || a->scale < 0.0f)
        return FAIL(pool, STEPQ_EINVAL, "%s: scale = %g (need finite >= 0; 0 = K^-1/2)", fn,
                    (double)a->scale);
    if ((ret = check_dtype(pool, a->dtype, "dtype", fn)) < 0)
        return ret;
    if ((a->flags & STEPQ_STEP_GATE_IN_KERNEL) &&
        (ret = check_dtype(pool, a->param_dtype, "param_dtype", fn)) < 0)
        return ret;
    return STEPQ_OK;
}

/* The tensors of a decode step: present, aligned, strides not overlapping requests. */
static int check_step_tensors(stepq_pool_t *pool, const stepq_step_args *a, const char *fn)
{
    const struct stepq__pool_layout *L = &pool->layout;
    const uint64_t H = (uint64_t)L->n_k_heads, HV = (uint64_t)L->pub.n_local_heads,
                   K = (uint64_t)L->pub.d_k, V = (uint64_t)L->pub.d_v;
    const uint64_t g_need = L->pub.arch == STEPQ_ARCH_KDA ? HV * K : HV;
    const size_t es = stepq_dtype_size(a->dtype), ps = stepq_dtype_size(a->param_dtype);
    int ret;

    if (a->batch == 0)
        return STEPQ_OK;
    if ((ret = check_ptr(pool, a->slot_ids, sizeof(int32_t), "slot_ids", fn)) < 0 ||
        (ret = check_ptr(pool, a->q, es, "q", fn)) < 0 ||
        (ret = check_ptr(pool, a->k, es, "k", fn)) < 0 ||
        (ret = check_ptr(pool, a->v, es, "v", fn)) < 0 ||
        (ret = check_ptr(pool, a->g, es, "g", fn)) < 0 ||
        (ret = check_ptr(pool, a->beta, es, "beta", fn)) < 0 ||
        (ret = check_ptr(pool, a->o, es, "o", fn)) < 0)
        return ret;
    if ((a->flags & STEPQ_STEP_GATE_IN_KERNEL) &&
        ((ret = check_ptr(pool, a->A_log, ps, "A_log (STEPQ_STEP_GATE_IN_KERNEL)", fn)) < 0 ||
         (ret = check_ptr(pool, a->dt_bias, ps, "dt_bias (STEPQ_STEP_GATE_IN_KERNEL)", fn)) < 0))
        return ret;
    if ((ret = check_stride(pool, a->q_stride, H * K, "q_stride", fn)) < 0 ||
        (ret = check_stride(pool, a->k_stride, H * K, "k_stride", fn)) < 0 ||
        (ret = check_stride(pool, a->v_stride, HV * V, "v_stride", fn)) < 0 ||
        (ret = check_stride(pool, a->g_stride, g_need, "g_stride", fn)) < 0 ||
        (ret = check_stride(pool, a->beta_stride, HV, "beta_stride", fn)) < 0 ||
        (ret = check_stride(pool, a->o_stride, HV * V, "o_stride", fn)) < 0)
        return ret;
    return STEPQ_OK;
}

static int check_prefill_shape(stepq_pool_t *pool, const stepq_prefill_args *p, const char *fn)
{
    const struct stepq__pool_layout *L = &pool->layout;
    int ret;

    if ((ret = check_declared(pool, p->num_v_heads, L->pub.n_local_heads, "num_v_heads", fn)) < 0 ||
        (ret = check_declared(pool, p->head_k_dim, L->pub.d_k, "head_k_dim", fn)) < 0 ||
        (ret = check_declared(pool, p->head_v_dim, L->pub.d_v, "head_v_dim", fn)) < 0)
        return ret;
    if (p->n < 0 || p->n > MAX_BATCH)
        return FAIL(pool, STEPQ_EINVAL, "%s: n = %" PRId32 " is outside 0..%d", fn, p->n,
                    MAX_BATCH);
    if (p->layout != STEPQ_STATE_LAYOUT_KV && p->layout != STEPQ_STATE_LAYOUT_VK)
        return FAIL(pool, STEPQ_EINVAL, "%s: layout %d is neither KV (0) nor VK (1)", fn,
                    (int)p->layout);
    return check_dtype(pool, p->dtype, "dtype", fn);
}

static int check_prefill_tensors(stepq_pool_t *pool, const stepq_prefill_args *p, const char *fn)
{
    const stepq_pool_layout *l = &pool->layout.pub;
    const uint64_t need = (uint64_t)l->n_local_heads * (uint64_t)l->d_k * (uint64_t)l->d_v;
    int ret;

    if (p->n == 0)
        return STEPQ_OK;
    if ((ret = check_ptr(pool, p->slot_ids, sizeof(int32_t), "slot_ids", fn)) < 0 ||
        (ret = check_ptr(pool, p->states, stepq_dtype_size(p->dtype), "states", fn)) < 0)
        return ret;
    return check_stride(pool, p->state_stride, need, "state_stride", fn);
}

/*
 * Host backend only (the ids are host memory there): every id is -1, the
 * sentinel 0 or an allocated slot, and no allocated slot is listed twice
 * when `distinct` (two writers of one page). Runs under the pool's mutex.
 */
static int check_host_ids(stepq_pool_t *pool, const int32_t *ids, int32_t n, int distinct,
                          const char *fn)
{
    int ret = STEPQ_OK;
    int32_t i;

    for (i = 0; i < n; i++) {
        int32_t id = ids[i];

        if (id == STEPQ_POOL_SLOT_PAD || id == STEPQ_POOL_SLOT_SENTINEL)
            continue;
        if (id < -1 || id > pool->slots) {
            ret = FAIL(pool, STEPQ_ERANGE,
                       "%s: slot_ids[%" PRId32 "] = %" PRId32 " is out of range (slots 1..%" PRId32
                       ", 0 sentinel, -1 padding)",
                       fn, i, id, pool->slots);
            break;
        }
        if (pool->state[id] != STEPQ__SLOT_USED) {
            ret = FAIL(pool, STEPQ_EINVAL,
                       "%s: slot_ids[%" PRId32 "] = %" PRId32 " is not allocated", fn, i, id);
            break;
        }
        if (distinct && pool->mark[id]) {
            ret =
                FAIL(pool, STEPQ_EINVAL,
                     "%s: slot_ids[%" PRId32 "] = %" PRId32 " is listed more than once", fn, i, id);
            break;
        }
        pool->mark[id] = 1;
    }
    for (int32_t j = 0; j < i; j++)
        if (ids[j] > 0 && ids[j] <= pool->slots)
            pool->mark[ids[j]] = 0;
    return ret;
}

/* --- the entries ------------------------------------------------------------ */

void stepq__step_args_to_kernel(stepq_arch arch, int H, int HV, int d_k, int d_v, int n_slots,
                                const stepq_step_args *p, void *stream, struct stepq__step_args *a)
{
    memset(a, 0, sizeof(*a));
    a->arch = arch;
    a->batch = p->batch;
    a->H = H;
    a->HV = HV;
    a->d_k = d_k;
    a->d_v = d_v;
    a->n_slots = n_slots;
    a->slots = p->slot_ids;
    a->q = p->q;
    a->k = p->k;
    a->v = p->v;
    a->g = p->g;
    a->beta = p->beta;
    a->A_log = p->A_log;
    a->dt_bias = p->dt_bias;
    a->o = p->o;
    a->dtype = p->dtype;
    a->param_dtype = p->param_dtype;
    a->q_stride = (size_t)p->q_stride;
    a->k_stride = (size_t)p->k_stride;
    a->v_stride = (size_t)p->v_stride;
    a->g_stride = (size_t)p->g_stride;
    a->beta_stride = (size_t)p->beta_stride;
    a->o_stride = (size_t)p->o_stride;
    a->opt.l2norm = !!(p->flags & STEPQ_STEP_L2NORM);
    a->opt.scale = p->scale; /* 0: the kernels' d_k^-1/2 */
    a->opt.gate_in_kernel = !!(p->flags & STEPQ_STEP_GATE_IN_KERNEL);
    a->opt.beta_sigmoid = !!(p->flags & STEPQ_STEP_BETA_SIGMOID);
    a->counts = p->health_counts;
    a->stream = stream;
}

/* The kernels' description of a checked decode step on this pool. */
static void to_kernel_args(const stepq_pool_t *pool, const stepq_step_args *p, void *stream,
                           struct stepq__step_args *a)
{
    const struct stepq__pool_layout *L = &pool->layout;

    stepq__step_args_to_kernel(L->pub.arch, L->n_k_heads, L->pub.n_local_heads, L->pub.d_k,
                               L->pub.d_v, pool->slots + 1, p, stream ? stream : pool->stream, a);
    a->health = pool->health;
}

int stepq_pool_decode_step(stepq_pool_t *h, int layer, const stepq_step_args *args, void *stream)
{
    static const char fn[] = "stepq_pool_decode_step";
    struct stepq__step_args a;
    stepq_step_args p;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, fn, &pool);

    if (ret < 0)
        return ret;
    if ((ret = import_step(pool, args, &p, fn)) < 0 ||
        (ret = check_layer(pool, layer, 0, fn)) < 0 || (ret = check_step_shape(pool, &p, fn)) < 0 ||
        (ret = check_step_tensors(pool, &p, fn)) < 0)
        goto out;
    if (p.batch == 0)
        goto out;
    if (pool->backend == STEPQ_POOL_BACKEND_HOST &&
        (ret = check_host_ids(pool, p.slot_ids, p.batch, 1, fn)) < 0)
        goto out;
    if ((ret = pool->ops->supports(pool, STEPQ_OP_DECODE_STEP, layer, &p)) < 0)
        goto out;
    to_kernel_args(pool, &p, stream, &a);
    ret = pool->ops->decode(pool, layer, &a);
out:
    if (ret < 0)
        stepq__error(ret, "%s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

static int transfer(stepq_pool_t *h, int layer, int pack, const stepq_prefill_args *args,
                    void *stream)
{
    const char *fn = pack ? "stepq_pool_prefill_pack" : "stepq_pool_prefill_unpack";
    stepq_prefill_args p;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, fn, &pool);

    if (ret < 0)
        return ret;
    if ((ret = import_prefill(pool, args, &p, fn)) < 0 ||
        (ret = check_layer(pool, layer, 0, fn)) < 0 ||
        (ret = check_prefill_shape(pool, &p, fn)) < 0 ||
        (ret = check_prefill_tensors(pool, &p, fn)) < 0)
        goto out;
    if (p.n == 0)
        goto out;
    if (pool->backend == STEPQ_POOL_BACKEND_HOST &&
        (ret = check_host_ids(pool, p.slot_ids, p.n, pack, fn)) < 0)
        goto out;
    if ((ret = pool->ops->supports(pool, pack ? STEPQ_OP_PREFILL_PACK : STEPQ_OP_PREFILL_UNPACK,
                                   layer, &p)) < 0)
        goto out;
    ret = pool->ops->transfer(pool, layer, pack, &p, stream ? stream : pool->stream);
out:
    if (ret < 0)
        stepq__error(ret, "%s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_prefill_pack(stepq_pool_t *pool, int layer, const stepq_prefill_args *args,
                            void *stream)
{
    return transfer(pool, layer, 1, args, stream);
}

int stepq_pool_prefill_unpack(stepq_pool_t *pool, int layer, const stepq_prefill_args *args,
                              void *stream)
{
    return transfer(pool, layer, 0, args, stream);
}

int stepq_pool_supports(stepq_pool_t *h, stepq_op op, int layer, const void *args)
{
    static const char fn[] = "stepq_pool_supports";
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, fn, &pool);

    if (ret < 0)
        return ret;
    if ((ret = check_layer(pool, layer, 1, fn)) < 0)
        goto out;
    if (op == STEPQ_OP_DECODE_STEP) {
        stepq_step_args p;
        if ((ret = import_step(pool, args, &p, fn)) < 0 ||
            (ret = check_step_shape(pool, &p, fn)) < 0)
            goto out;
        ret = pool->ops->supports(pool, op, layer, &p);
    } else if (op == STEPQ_OP_PREFILL_PACK || op == STEPQ_OP_PREFILL_UNPACK) {
        stepq_prefill_args p;
        if ((ret = import_prefill(pool, args, &p, fn)) < 0 ||
            (ret = check_prefill_shape(pool, &p, fn)) < 0)
            goto out;
        ret = pool->ops->supports(pool, op, layer, &p);
    } else {
        ret = FAIL(pool, STEPQ_EINVAL, "%s: op %d is not a stepq_op", fn, (int)op);
    }
out:
    if (ret < 0)
        stepq__error(ret, "%s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}

int stepq_pool_conv_state(stepq_pool_t *h, int layer, stepq_conv_view *out, size_t view_size)
{
    static const char fn[] = "stepq_pool_conv_state";
    const struct stepq__pool_layout *L;
    stepq_conv_view v;
    stepq_pool_t *pool = NULL;
    int ret = stepq__pool_enter(h, fn, &pool);

    if (ret < 0)
        return ret;
    L = &pool->layout;
    if (!out || view_size == 0 || view_size > sizeof(v)) {
        ret = FAIL(pool, STEPQ_EINVAL, "%s: out %s, view_size %zu (this library knows up to %zu)",
                   fn, out ? "set" : "NULL", view_size, sizeof(v));
        goto out;
    }
    if (layer < 0 || layer >= L->pub.n_layers) {
        ret = FAIL(pool, STEPQ_ERANGE, "%s: layer %d is not a recurrent layer (0..%d)", fn, layer,
                   L->pub.n_layers - 1);
        goto out;
    }
    memset(&v, 0, sizeof(v));
    v.base = pool->pages + L->conv_offset[layer];
    v.slot_stride = pool->page_bytes;
    v.bytes = L->pub.conv_bytes_per_layer;
    v.dtype = L->conv_dtype;
    v.rank = L->conv_rank;
    for (int i = 0; i < L->conv_rank; i++)
        v.shape[i] = L->conv_shape[i];
    memcpy(out, &v, view_size);
out:
    if (ret < 0)
        stepq__error(ret, "%s", pool->err);
    stepq__pool_leave(pool);
    return ret;
}
