/* The shared fixture of the kernel checks and the kernel bench (fixture.h). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kernels/format.h"
#include "plugin/cuda_err.h"
#include "pool/internal.h"
#include "tests/checkasm/fixture.h"

/* A bf16 NaN for the gaps of the input views. */
#define NAN_BF16 0x7fc1u
/* The conv state of every layer: 40 channels x 3 taps of bf16 (240 B), guard bytes after the
 * blocks that a 256-B page alignment then pads. */
#define CONV_CHANNELS 40
#define CONV_TAPS     3

/* --- random numbers -------------------------------------------------------- */

uint32_t fx_rand(struct fx_rng *r)
{
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return (uint32_t)(r->s >> 11);
}

float fx_urand(struct fx_rng *r)
{
    return (float)(fx_rand(r) & 0xffffff) / 16777216.0f;
}

float fx_nrand(struct fx_rng *r)
{
    float u = fx_urand(r) + 1e-7f, v = fx_urand(r);
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

/* --- guarded tensors --------------------------------------------------------- */

static int cu_fail(cudaError_t e, const char *what)
{
    return stepq__cuda_error(NULL, (int)e, what);
}

int fx_buf_alloc(struct fx_buf *b, size_t bytes, int device)
{
    const size_t total = bytes + 2 * FX_GUARD;
    cudaError_t e;

    memset(b, 0, sizeof(*b));
    b->bytes = bytes;
    b->device = device;
    b->shadow = malloc(total);
    if (!b->shadow)
        return stepq__error(STEPQ_ENOMEM, "fixture: out of memory (%zu B tensor image)", total);
    memset(b->shadow, FX_SENTINEL, total);
    if (device) {
        if ((e = cudaMalloc((void **)&b->alloc, total)) != cudaSuccess) {
            free(b->shadow);
            b->shadow = NULL;
            return cu_fail(e, "fixture: cudaMalloc(tensor)");
        }
        if ((e = cudaMemcpy(b->alloc, b->shadow, total, cudaMemcpyHostToDevice)) != cudaSuccess) {
            fx_buf_free(b);
            return cu_fail(e, "fixture: cudaMemcpy(guards)");
        }
    } else {
        /* 256-aligned like a device tensor, so alignment is the same on both sides */
        void *p = NULL;
        if (posix_memalign(&p, FX_GUARD, total)) {
            free(b->shadow);
            b->shadow = NULL;
            return stepq__error(STEPQ_ENOMEM, "fixture: out of memory (%zu B tensor)", total);
        }
        b->alloc = p;
        memcpy(b->alloc, b->shadow, total);
    }
    b->p = b->alloc + FX_GUARD;
    return STEPQ_OK;
}

int fx_buf_set(struct fx_buf *b, const void *src)
{
    const size_t total = b->bytes + 2 * FX_GUARD;
    cudaError_t e;

    memset(b->shadow, FX_SENTINEL, total);
    if (src && b->bytes)
        memcpy(b->shadow + FX_GUARD, src, b->bytes);
    if (!b->device) {
        memcpy(b->alloc, b->shadow, total);
        return STEPQ_OK;
    }
    if ((e = cudaMemcpy(b->alloc, b->shadow, total, cudaMemcpyHostToDevice)) != cudaSuccess)
        return cu_fail(e, "fixture: cudaMemcpy(tensor)");
    return STEPQ_OK;
}

int fx_buf_get(const struct fx_buf *b, void *dst)
{
    cudaError_t e;

    if (!b->device) {
        memcpy(dst, b->p, b->bytes);
        return STEPQ_OK;
    }
    if ((e = cudaDeviceSynchronize()) != cudaSuccess)
        return cu_fail(e, "fixture: cudaDeviceSynchronize");
    if ((e = cudaMemcpy(dst, b->p, b->bytes, cudaMemcpyDeviceToHost)) != cudaSuccess)
        return cu_fail(e, "fixture: cudaMemcpy(tensor to host)");
    return STEPQ_OK;
}

/* First byte where n bytes of a and b differ, or -1. */
static int64_t first_diff(const uint8_t *a, const uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i])
            return (int64_t)i;
    return -1;
}

int fx_buf_compare(const struct fx_buf *b, int guards_only, int64_t *bad)
{
    const size_t total = b->bytes + 2 * FX_GUARD;
    uint8_t *now = b->alloc;
    cudaError_t e;
    int64_t d;

    *bad = -1;
    if (b->device) {
        now = malloc(total);
        if (!now)
            return stepq__error(STEPQ_ENOMEM, "fixture: out of memory (guard check)");
        if ((e = cudaDeviceSynchronize()) != cudaSuccess ||
            (e = cudaMemcpy(now, b->alloc, total, cudaMemcpyDeviceToHost)) != cudaSuccess) {
            free(now);
            return cu_fail(e, "fixture: reading a tensor's guards");
        }
    }
    if (!guards_only) {
        *bad = first_diff(now, b->shadow, total);
    } else if ((d = first_diff(now, b->shadow, FX_GUARD)) >= 0) {
        *bad = d;
    } else if ((d = first_diff(now + FX_GUARD + b->bytes, b->shadow + FX_GUARD + b->bytes,
                               FX_GUARD)) >= 0) {
        *bad = d + FX_GUARD + (int64_t)b->bytes;
    }
    if (b->device)
        free(now);
    return STEPQ_OK;
}

void fx_buf_free(struct fx_buf *b)
{
    if (b->device)
        cudaFree(b->alloc);
    else
        free(b->alloc);
    free(b->shadow);
    memset(b, 0, sizeof(*b));
}

/* --- maps and pools ---------------------------------------------------------- */

/* The widths of a mix: the integer formats and the pivot. */
static const uint8_t mix_bits[] = { 2, 3, 4, 5, 6, 8, STEPQ_BITS_PIVOT };

static double default_budget(const struct fx_map_spec *s)
{
    if (s->budget > 0)
        return s->budget;
    if (!stepq__method_has_units(s->method)) /* fp32 / bf16 / fp16 / fp8: the format's width */
        return stepq__method_fixed_bits(s->method);
    return s->bits ? s->bits : 6;
}

/* Unit u's width of a mix: GDN head u (the last a pivot), KDA a random row width or pivot. */
static int mixed_bits(const struct fx_map_spec *s, int u, struct fx_rng *rng)
{
    if (s->arch == STEPQ_ARCH_GDN)
        return u == s->HV - 1 ? STEPQ_BITS_PIVOT : mix_bits[(u * 2 + 1) % 6];
    return mix_bits[fx_rand(rng) % 7];
}

int fx_map_create(const struct fx_map_spec *spec, struct fx_rng *rng, stepq_map_t **out)
{
    int ids[16];
    stepq_model_shape s;
    stepq_map_t *map = NULL;
    int ret;

    *out = NULL;
    if (spec->n_layers < 1 || spec->n_layers > 16)
        return stepq__error(STEPQ_EINVAL, "fixture: %d layers (1..16)", spec->n_layers);
    for (int i = 0; i < spec->n_layers; i++)
        ids[i] = i;
    memset(&s, 0, sizeof(s));
    s.arch = spec->arch;
    s.n_layers = spec->n_layers;
    s.layer_ids = ids;
    s.num_k_heads = spec->H;
    s.num_v_heads = spec->HV;
    s.head_k_dim = FX_D;
    s.head_v_dim = FX_D;
    s.conv_rank = 2;
    s.conv_shape[0] = CONV_CHANNELS;
    s.conv_shape[1] = CONV_TAPS;
    s.conv_dtype = STEPQ_DTYPE_BF16;
    if ((ret = stepq_map_create(&s, spec->method, default_budget(spec), &map)) < 0)
        return ret;
    const int units = stepq_map_units_per_layer(map);
    for (int l = 0; l < spec->n_layers && stepq__method_has_units(spec->method); l++) {
        if (!spec->unit_bits && spec->bits)
            break; /* stepq_map_create's one width */
        for (int u = 0; u < units; u++) {
            int b = spec->unit_bits ? spec->unit_bits[u] : mixed_bits(spec, u, rng);
            if ((ret = stepq_map_set_unit_bits(map, l, u, b)) < 0)
                goto fail;
        }
    }
    if (stepq_method_has_col_scales(spec->method) && spec->method != STEPQ_METHOD_DSQ) {
        float w[FX_D];
        for (int l = 0; l < spec->n_layers; l++)
            for (int h = 0; h < spec->HV; h++) {
                double lg = 0;
                for (int i = 0; i < FX_D; i++) {
                    w[i] = spec->w_lo + (spec->w_hi - spec->w_lo) * fx_urand(rng);
                    lg += log((double)w[i]);
                }
                const double gm = exp(lg / FX_D);
                for (int i = 0; i < FX_D; i++)
                    w[i] = (float)(w[i] / gm);
                if ((ret = stepq_map_set_row_impact(map, l, h, w)) < 0)
                    goto fail;
            }
    }
    if (spec->row_split > 0 && (ret = stepq_map_set_row_split(map, spec->row_split)) < 0)
        goto fail;
    if ((ret = stepq_map_set_decode_fit(map, spec->decode_fit)) < 0)
        goto fail;
    if (spec->arith != STEPQ_ARITH_FP32 && (ret = stepq_map_set_arith(map, spec->arith)) < 0)
        goto fail;
    *out = map;
    return STEPQ_OK;
fail:
    stepq_map_close(map);
    return ret;
}

int fx_pool_open(const stepq_map_t *map, stepq_pool_backend backend, int32_t slots, void *stream,
                 stepq_pool_t **out)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool = NULL;
    int32_t *ids;
    int ret;

    *out = NULL;
    cfg.map = map;
    cfg.backend = backend;
    cfg.stream = stream;
    cfg.num_slots = slots;
    if ((ret = stepq_pool_open(&cfg, &pool)) < 0)
        return ret;
    ids = malloc((size_t)slots * sizeof(*ids));
    if (!ids) {
        stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
        return stepq__error(STEPQ_ENOMEM, "fixture: out of memory (slot ids)");
    }
    if ((ret = stepq_pool_alloc(pool, slots, ids)) >= 0)
        for (int32_t i = 0; i < slots; i++)
            if (ids[i] != i + 1) {
                /* a fresh pool hands out 1..slots in order: the checks rely on every id */
                ret = stepq__error(STEPQ_EINTERNAL,
                                   "fixture: a fresh pool's %" PRId32 "th slot is %" PRId32, i + 1,
                                   ids[i]);
                break;
            }
    free(ids);
    if (ret < 0) {
        stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
        return ret;
    }
    *out = pool;
    return STEPQ_OK;
}

int fx_packed_layer(stepq_pool_t *h, int layer, struct stepq__packed_layer *out)
{
    stepq_pool_t *pool = stepq__pool_resolve(h);

    if (!pool)
        return stepq__error(STEPQ_EBADF, "fixture: the pool is not open");
    if (layer < 0 || layer >= pool->layout.pub.n_layers || !pool->layout.heads)
        return stepq__error(STEPQ_ERANGE, "fixture: the pool has no layer %d", layer);
    stepq__pool_packed_layer(pool, layer, out);
    return STEPQ_OK;
}

void fx_dense_kernel_args(stepq_arch arch, int H, int HV, int n_slots, const stepq_step_args *p,
                          void *stream, struct stepq__step_args *a)
{
    stepq__step_args_to_kernel(arch, H, HV, FX_D, FX_D, n_slots, p, stream, a);
}

int fx_kernel_args(stepq_pool_t *h, const stepq_step_args *p, void *stream,
                   struct stepq__step_args *a)
{
    stepq_pool_t *pool = stepq__pool_resolve(h);

    if (!pool)
        return stepq__error(STEPQ_EBADF, "fixture: the pool is not open");
    fx_dense_kernel_args(pool->layout.pub.arch, pool->layout.n_k_heads,
                         pool->layout.pub.n_local_heads, pool->slots + 1, p,
                         stream ? stream : pool->stream, a);
    a->health = pool->health;
    return STEPQ_OK;
}

void fx_pools_close(struct fx_pools *fx)
{
    if (fx->host)
        stepq_pool_close(fx->host, STEPQ_POOL_CLOSE_FORCE);
    if (fx->cuda)
        stepq_pool_close(fx->cuda, STEPQ_POOL_CLOSE_FORCE);
    stepq_map_close(fx->map);
    memset(fx, 0, sizeof(*fx));
}

/* The pages and health words of a pool (buffer infos 0 and 1). */
static int pool_buffers(stepq_pool_t *pool, uint8_t **pages, uint32_t **health, size_t *bytes)
{
    stepq_pool_buffer_info info[2];
    int count = 0, ret = stepq_pool_buffer_infos(pool, info, 2, &count);

    if (ret < 0)
        return ret;
    *pages = info[0].ptr;
    *health = info[1].ptr;
    *bytes = (size_t)info[0].bytes;
    return STEPQ_OK;
}

int fx_pools_open(struct fx_pools *fx, const struct fx_map_spec *spec, int32_t slots,
                  struct fx_rng *rng)
{
    struct fx_map_spec s = *spec;
    const stepq_pool_layout *lh, *ld;
    size_t hb = 0, db = 0;
    int ret;

    memset(fx, 0, sizeof(*fx));
    s.n_layers = 3;
    fx->layer = 1;
    fx->arch = s.arch;
    fx->H = s.H;
    fx->HV = s.HV;
    fx->slots = slots;
    if ((ret = fx_map_create(&s, rng, &fx->map)) < 0 ||
        (ret = fx_pool_open(fx->map, STEPQ_POOL_BACKEND_HOST, slots, NULL, &fx->host)) < 0 ||
        (ret = fx_pool_open(fx->map, STEPQ_POOL_BACKEND_CUDA, slots, NULL, &fx->cuda)) < 0 ||
        (ret = stepq_pool_get_layout(fx->host, &lh)) < 0 ||
        (ret = stepq_pool_get_layout(fx->cuda, &ld)) < 0 ||
        (ret = pool_buffers(fx->host, &fx->hpages, &fx->hhealth, &hb)) < 0 ||
        (ret = pool_buffers(fx->cuda, &fx->dpages, &fx->dhealth, &db)) < 0 ||
        (ret = fx_packed_layer(fx->host, fx->layer, &fx->hpl)) < 0 ||
        (ret = fx_packed_layer(fx->cuda, fx->layer, &fx->dpl)) < 0)
        goto fail;
    if (lh->fingerprint != ld->fingerprint || hb != db) {
        ret = stepq__error(STEPQ_EINTERNAL, "fixture: the host and CUDA pools' layouts differ");
        goto fail;
    }
    fx->page_bytes = lh->page_bytes;
    fx->pages_bytes = hb;
    return STEPQ_OK;
fail:
    fx_pools_close(fx);
    return ret;
}

int fx_pools_upload(struct fx_pools *fx)
{
    const size_t words = ((size_t)fx->slots + 1) * sizeof(uint32_t);
    cudaError_t e;

    if ((e = cudaDeviceSynchronize()) != cudaSuccess ||
        (e = cudaMemcpy(fx->dpages, fx->hpages, fx->pages_bytes, cudaMemcpyHostToDevice)) !=
            cudaSuccess ||
        (e = cudaMemcpy(fx->dhealth, fx->hhealth, words, cudaMemcpyHostToDevice)) != cudaSuccess)
        return cu_fail(e, "fixture: copying the host pool's pages into the CUDA pool");
    return STEPQ_OK;
}

int fx_pools_download(struct fx_pools *fx, uint8_t *pages, uint32_t *health)
{
    const size_t words = ((size_t)fx->slots + 1) * sizeof(uint32_t);
    cudaError_t e;
    int ret;

    if ((ret = stepq_pool_sync(fx->cuda)) < 0)
        return ret;
    if ((e = cudaDeviceSynchronize()) != cudaSuccess)
        return cu_fail(e, "fixture: cudaDeviceSynchronize");
    if (pages &&
        (e = cudaMemcpy(pages, fx->dpages, fx->pages_bytes, cudaMemcpyDeviceToHost)) != cudaSuccess)
        return cu_fail(e, "fixture: reading the CUDA pool's pages");
    if (health &&
        (e = cudaMemcpy(health, fx->dhealth, words, cudaMemcpyDeviceToHost)) != cudaSuccess)
        return cu_fail(e, "fixture: reading the CUDA pool's health words");
    return STEPQ_OK;
}

int fx_pools_blank(struct fx_pools *fx)
{
    memset(fx->hpages, FX_SENTINEL, fx->pages_bytes);
    memset(fx->hhealth, 0, ((size_t)fx->slots + 1) * sizeof(uint32_t));
    return fx_pools_upload(fx);
}

int fx_pools_fill(struct fx_pools *fx, float amp, struct fx_rng *rng)
{
    const int32_t n = fx->slots + 1;
    const size_t head = (size_t)FX_D * FX_D, per = head * (size_t)fx->HV;
    stepq_prefill_args p = STEPQ_PREFILL_ARGS_INITIALIZER;
    int32_t *ids = malloc((size_t)n * sizeof(*ids));
    float *x = malloc((size_t)n * per * sizeof(*x));
    int ret;

    if (!ids || !x) {
        free(ids);
        free(x);
        return stepq__error(STEPQ_ENOMEM, "fixture: out of memory (%" PRId32 " dense states)", n);
    }
    memset(fx->hpages, FX_SENTINEL, fx->pages_bytes);
    for (int32_t s = 0; s < n; s++) {
        ids[s] = s; /* the sentinel page too: a batch may name it */
        for (size_t e = 0; e < per; e++)
            x[(size_t)s * per + e] = amp * fx_nrand(rng) * (1.0f + (float)(e % head / FX_D % 7));
    }
    p.n = n;
    p.slot_ids = ids;
    p.states = x;
    ret = stepq_pool_prefill_pack(fx->host, fx->layer, &p, NULL);
    free(ids);
    free(x);
    if (ret < 0)
        return ret;
    /* a huge start saturates scales: the flags belong to the fill, not to the check */
    memset(fx->hhealth, 0, ((size_t)fx->slots + 1) * sizeof(uint32_t));
    return fx_pools_upload(fx);
}

/* --- step inputs --------------------------------------------------------------- */

int fx_inputs_alloc(struct fx_inputs *in, stepq_arch arch, int batch, int H, int HV)
{
    const size_t B = (size_t)batch;

    memset(in, 0, sizeof(*in));
    in->arch = arch;
    in->batch = batch;
    in->H = H;
    in->HV = HV;
    in->ng = arch == STEPQ_ARCH_KDA ? FX_D : 1;
    in->slots = malloc(sizeof(int32_t) * (B ? B : 1));
    in->q = malloc(sizeof(float) * (B * H * FX_D + 1));
    in->k = malloc(sizeof(float) * (B * H * FX_D + 1));
    in->v = malloc(sizeof(float) * (B * HV * FX_D + 1));
    in->g = malloc(sizeof(float) * (B * HV * in->ng + 1));
    in->beta = malloc(sizeof(float) * (B * HV + 1));
    in->A_log = malloc(sizeof(float) * (size_t)HV);
    in->dt_bias = malloc(sizeof(float) * (size_t)HV * in->ng);
    if (!in->slots || !in->q || !in->k || !in->v || !in->g || !in->beta || !in->A_log ||
        !in->dt_bias) {
        fx_inputs_free(in);
        return stepq__error(STEPQ_ENOMEM, "fixture: out of memory (step inputs)");
    }
    return STEPQ_OK;
}

void fx_inputs_free(struct fx_inputs *in)
{
    free(in->slots);
    free(in->q);
    free(in->k);
    free(in->v);
    free(in->g);
    free(in->beta);
    free(in->A_log);
    free(in->dt_bias);
    memset(in, 0, sizeof(*in));
}

int fx_inputs_gen(struct fx_inputs *in, int n_pages, int raw_gate, struct fx_rng *rng)
{
    const int B = in->batch;
    int32_t *perm;

    /* distinct ids for every request: the host pool refuses a repeated slot */
    if (n_pages < B)
        return stepq__error(STEPQ_EINVAL, "fixture: %d requests over %d pages", B, n_pages);
    perm = malloc(sizeof(*perm) * (size_t)n_pages);
    if (!perm)
        return stepq__error(STEPQ_ENOMEM, "fixture: out of memory (slot ids)");
    for (int s = 0; s < n_pages; s++)
        perm[s] = s;
    for (int s = n_pages - 1; s > 0; s--) {
        int r = (int)(fx_rand(rng) % (unsigned)(s + 1));
        int32_t t = perm[s];
        perm[s] = perm[r];
        perm[r] = t;
    }
    for (int b = 0; b < B; b++)
        in->slots[b] = (b % 4 == 3) ? STEPQ_POOL_SLOT_PAD : perm[b];
    free(perm);
    for (int n = 0; n < B * in->H * FX_D; n++) {
        in->q[n] = fx_nrand(rng);
        in->k[n] = fx_nrand(rng);
    }
    for (int n = 0; n < B * in->HV * FX_D; n++)
        in->v[n] = fx_nrand(rng);
    for (int n = 0; n < B * in->HV * in->ng; n++)
        in->g[n] = raw_gate ? fx_nrand(rng) : -0.5f * fx_urand(rng);
    for (int n = 0; n < B * in->HV; n++)
        in->beta[n] = raw_gate ? fx_nrand(rng) : fx_urand(rng);
    for (int n = 0; n < in->HV; n++)
        in->A_log[n] = 0.3f * fx_nrand(rng);
    for (int n = 0; n < in->HV * in->ng; n++)
        in->dt_bias[n] = 0.3f * fx_nrand(rng);
    return STEPQ_OK;
}

/* n bf16 elements of fp32 values, rounded to nearest even. */
static void to_bf16(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = stepq__bf16_from_float(src[i]);
}

int fx_step_io_init(struct fx_step_io *io, const struct fx_inputs *in, int view, int device)
{
    const size_t B = (size_t)in->batch, nq = (size_t)in->H * FX_D, nv = (size_t)in->HV * FX_D;
    const size_t ng = (size_t)in->HV * in->ng, es = view ? 2 : 4;
    int ret;

    memset(io, 0, sizeof(*io));
    io->device = device;
    io->view = view;
    io->arch = in->arch;
    io->batch = in->batch;
    io->H = in->H;
    io->HV = in->HV;
    if (view) {
        io->q_stride = io->k_stride = io->v_stride = 2 * nq + nv + 3;
        io->g_stride = ng + 5;
        io->beta_stride = (size_t)in->HV + 2;
        io->o_stride = nv + 7;
    }
    io->n_o = B * (view ? io->o_stride : nv);
    if ((ret = fx_buf_alloc(&io->slots, B * sizeof(int32_t), device)) < 0 ||
        (ret = fx_buf_alloc(&io->q, B * es * (view ? io->q_stride : nq), device)) < 0 ||
        (ret = fx_buf_alloc(&io->k, view ? 0 : B * es * nq, device)) < 0 ||
        (ret = fx_buf_alloc(&io->v, view ? 0 : B * es * nv, device)) < 0 ||
        (ret = fx_buf_alloc(&io->g, B * es * (view ? io->g_stride : ng), device)) < 0 ||
        (ret = fx_buf_alloc(&io->beta, B * es * (view ? io->beta_stride : (size_t)in->HV),
                            device)) < 0 ||
        (ret = fx_buf_alloc(&io->A_log, es * (size_t)in->HV, device)) < 0 ||
        (ret = fx_buf_alloc(&io->dt_bias, es * ng, device)) < 0 ||
        (ret = fx_buf_alloc(&io->o, es * io->n_o, device)) < 0 ||
        (ret = fx_buf_alloc(&io->counts, STEPQ__HEALTH_NCOUNTS * sizeof(uint64_t), device)) < 0) {
        fx_step_io_free(io);
        return ret;
    }
    return fx_step_io_set(io, in);
}

/* The bf16 views of in: NaN gaps, rows `stride` elements apart. */
static int set_views(struct fx_step_io *io, const struct fx_inputs *in)
{
    const size_t B = (size_t)in->batch, nq = (size_t)in->H * FX_D, nv = (size_t)in->HV * FX_D;
    const size_t ng = (size_t)in->HV * in->ng;
    uint16_t *qkv = malloc(io->q.bytes + 2), *g = malloc(io->g.bytes + 2);
    uint16_t *beta = malloc(io->beta.bytes + 2), *al = malloc(io->A_log.bytes + 2);
    uint16_t *dt = malloc(io->dt_bias.bytes + 2);
    int ret = STEPQ_OK;

    if (!qkv || !g || !beta || !al || !dt) {
        ret = stepq__error(STEPQ_ENOMEM, "fixture: out of memory (bf16 views)");
        goto out;
    }
    for (size_t e = 0; e < io->q.bytes / 2; e++)
        qkv[e] = NAN_BF16;
    for (size_t e = 0; e < io->g.bytes / 2; e++)
        g[e] = NAN_BF16;
    for (size_t e = 0; e < io->beta.bytes / 2; e++)
        beta[e] = NAN_BF16;
    for (size_t b = 0; b < B; b++) {
        uint16_t *row = qkv + b * io->q_stride;
        to_bf16(row, in->q + b * nq, nq);
        to_bf16(row + nq, in->k + b * nq, nq);
        to_bf16(row + 2 * nq, in->v + b * nv, nv);
        to_bf16(g + b * io->g_stride, in->g + b * ng, ng);
        to_bf16(beta + b * io->beta_stride, in->beta + b * (size_t)in->HV, (size_t)in->HV);
    }
    to_bf16(al, in->A_log, (size_t)in->HV);
    to_bf16(dt, in->dt_bias, ng);
    if ((ret = fx_buf_set(&io->q, qkv)) < 0 || (ret = fx_buf_set(&io->g, g)) < 0 ||
        (ret = fx_buf_set(&io->beta, beta)) < 0 || (ret = fx_buf_set(&io->A_log, al)) < 0 ||
        (ret = fx_buf_set(&io->dt_bias, dt)) < 0)
        goto out;
out:
    free(qkv);
    free(g);
    free(beta);
    free(al);
    free(dt);
    return ret;
}

int fx_step_io_set(struct fx_step_io *io, const struct fx_inputs *in)
{
    static const uint64_t zero[STEPQ__HEALTH_NCOUNTS];
    int ret;

    if ((ret = fx_buf_set(&io->slots, in->slots)) < 0 || (ret = fx_buf_set(&io->o, NULL)) < 0 ||
        (ret = fx_buf_set(&io->counts, zero)) < 0)
        return ret;
    if (io->view)
        return set_views(io, in);
    if ((ret = fx_buf_set(&io->q, in->q)) < 0 || (ret = fx_buf_set(&io->k, in->k)) < 0 ||
        (ret = fx_buf_set(&io->v, in->v)) < 0 || (ret = fx_buf_set(&io->g, in->g)) < 0 ||
        (ret = fx_buf_set(&io->beta, in->beta)) < 0 ||
        (ret = fx_buf_set(&io->A_log, in->A_log)) < 0 ||
        (ret = fx_buf_set(&io->dt_bias, in->dt_bias)) < 0)
        return ret;
    return STEPQ_OK;
}

void fx_step_io_args(const struct fx_step_io *io, unsigned flags, stepq_step_args *a)
{
    const size_t nq = (size_t)io->H * FX_D;
    const stepq_step_args init = STEPQ_STEP_ARGS_INITIALIZER;

    *a = init;
    a->batch = io->batch;
    a->slot_ids = io->slots.p;
    a->dtype = a->param_dtype = io->view ? STEPQ_DTYPE_BF16 : STEPQ_DTYPE_FP32;
    a->q = io->q.p;
    a->k = io->view ? (const void *)((const uint16_t *)io->q.p + nq) : io->k.p;
    a->v = io->view ? (const void *)((const uint16_t *)io->q.p + 2 * nq) : io->v.p;
    a->g = io->g.p;
    a->beta = io->beta.p;
    a->o = io->o.p;
    a->A_log = io->A_log.p;
    a->dt_bias = io->dt_bias.p;
    a->q_stride = (int64_t)io->q_stride;
    a->k_stride = (int64_t)io->k_stride;
    a->v_stride = (int64_t)io->v_stride;
    a->g_stride = (int64_t)io->g_stride;
    a->beta_stride = (int64_t)io->beta_stride;
    a->o_stride = (int64_t)io->o_stride;
    a->flags = flags;
    a->health_counts = io->counts.p;
}

int fx_step_io_check(const struct fx_step_io *io, char *what, size_t what_len)
{
    const struct {
        const struct fx_buf *b;
        const char *name;
        int output;
    } bufs[] = {
        { &io->slots, "slot_ids", 0 },
        { &io->q, io->view ? "q|k|v" : "q", 0 },
        { &io->k, "k", 0 },
        { &io->v, "v", 0 },
        { &io->g, "g", 0 },
        { &io->beta, "beta", 0 },
        { &io->A_log, "A_log", 0 },
        { &io->dt_bias, "dt_bias", 0 },
        { &io->o, "o", 1 },
        { &io->counts, "health_counts", 1 },
    };

    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) {
        int64_t bad;
        int ret = fx_buf_compare(bufs[i].b, bufs[i].output, &bad);
        if (ret < 0)
            return ret;
        if (bad >= 0) {
            snprintf(what, what_len, "%s %s: byte %" PRId64 " of the %s changed",
                     io->device ? "device" : "host", bufs[i].name, bad - FX_GUARD,
                     bufs[i].output ? "guards" : "input");
            return 1;
        }
    }
    return 0;
}

void fx_step_io_free(struct fx_step_io *io)
{
    fx_buf_free(&io->slots);
    fx_buf_free(&io->q);
    fx_buf_free(&io->k);
    fx_buf_free(&io->v);
    fx_buf_free(&io->g);
    fx_buf_free(&io->beta);
    fx_buf_free(&io->A_log);
    fx_buf_free(&io->dt_bias);
    fx_buf_free(&io->o);
    fx_buf_free(&io->counts);
}

/*
 * The configurations the pack and the unpack checks both run (each family
 * with its own pages): every layout and dtype, each templated width with and
 * without column scales, mixed KDA rows, a dense layer, ids outside the pool
 * and the column-kernel handles. fn is called once per configuration.
 */
void fx_transfer_cases(int small, void (*one)(struct fx_transfer))
{
    static const int widths[] = { 2, 3, 4, 5, 6, 8 };
    const stepq_arch G = STEPQ_ARCH_GDN, K = STEPQ_ARCH_KDA;
    const stepq_method SQ = STEPQ_METHOD_STEPQ;

    /* both layouts, fp32 and bf16 sources */
    for (int lay = 0; lay < 2; lay++)
        for (int dt = 0; dt < 2; dt++) {
            one((struct fx_transfer){
                .arch = G, .method = SQ, .HV = 4, .n = 4, .layout = lay, .dtype = dt });
            one((struct fx_transfer){
                .arch = K, .method = SQ, .HV = 2, .n = 4, .layout = lay, .dtype = dt });
        }
    /* each templated width, stepq (column scales) and uniform (none) */
    for (int w = 0; w < 6; w++) {
        if (!small)
            one((struct fx_transfer){ .arch = G,
                                      .method = SQ,
                                      .bits = widths[w],
                                      .HV = 2,
                                      .n = 3,
                                      .layout = w & 1,
                                      .dtype = w >> 1 & 1 });
        if (!small || widths[w] == 6)
            one((struct fx_transfer){ .arch = G,
                                      .method = STEPQ_METHOD_UNIFORM,
                                      .bits = widths[w],
                                      .HV = 2,
                                      .n = 3,
                                      .layout = !(w & 1),
                                      .dtype = w >> 1 & 1,
                                      .aligned = w == 2 }); /* bf16 [V,K], the vector path */
    }
    if (!small)
        one((struct fx_transfer){ .arch = K,
                                  .method = STEPQ_METHOD_TEMPORAL,
                                  .HV = 2,
                                  .n = 3,
                                  .layout = STEPQ_STATE_LAYOUT_VK,
                                  .dtype = STEPQ_DTYPE_BF16 });
    /* the map's row split (row_split) in the dual-axis fit: GDN stepq, KDA stepq rows */
    one((struct fx_transfer){ .arch = G, .method = SQ, .HV = 4, .n = 4, .row_split = 0.75 });
    one((struct fx_transfer){ .arch = K,
                              .method = SQ,
                              .HV = 2,
                              .n = 4,
                              .layout = STEPQ_STATE_LAYOUT_VK,
                              .dtype = STEPQ_DTYPE_BF16,
                              .row_split = 0.6,
                              .aligned = 1 });
    /* an fp32 layer: the column kernel, which the pool's handle picks for dense pages */
    one((struct fx_transfer){ .arch = G, .method = STEPQ_METHOD_FP32, .HV = 2, .n = 3 });
    /*
     * fp8 (sq_fp8_kernel where the dense side allows 16-byte vectors, else the column
     * kernel): both layouts, fp32 and bf16, GDN and KDA, at several batch sizes, bf16 [V,K]
     * at an odd stride (the column kernel) and at a 16-byte one (k >= 2; in the small mode
     * too); the small mode keeps one or two sizes per layout and dtype. Then fp8 on an
     * explicit column-kernel handle, where the pool would take sq_fp8_kernel.
     */
    static const int fp8_n[] = { 2, 1, 5, 17 };
    for (int lay = 0; lay < 2; lay++)
        for (int dt = 0; dt < 2; dt++)
            for (int k = 0; k < 4; k++)
                if (!small || k == 0 || (k == 2 && lay && dt))
                    one((struct fx_transfer){ .arch = (lay + dt + k) & 1 ? K : G,
                                              .method = STEPQ_METHOD_FP8,
                                              .HV = 2 + 2 * (k & 1),
                                              .n = fp8_n[k],
                                              .layout = lay,
                                              .dtype = dt,
                                              .aligned = k >= 2 });
    for (int lay = 0; lay < 2; lay++)
        one((struct fx_transfer){ .arch = lay ? K : G,
                                  .method = STEPQ_METHOD_FP8,
                                  .HV = 2,
                                  .n = 5,
                                  .layout = lay,
                                  .dtype = lay,
                                  .aligned = 1,
                                  .column = 1 });
    /* ids outside 0..slots on the CUDA pool are skipped like -1 (documented) */
    one((struct fx_transfer){ .arch = G, .method = SQ, .HV = 4, .n = 10, .wild_ids = 1 });
    /* the thread-per-column kernel on an explicit handle */
    one((struct fx_transfer){
        .arch = G, .method = SQ, .HV = 4, .n = 4, .layout = STEPQ_STATE_LAYOUT_VK, .column = 1 });
    one((struct fx_transfer){
        .arch = G, .method = SQ, .HV = 4, .n = 4, .dtype = STEPQ_DTYPE_BF16, .column = 1 });
}
