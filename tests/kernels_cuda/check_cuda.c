/*
 * checkasm-style comparison of the CUDA kernels (kernels/cuda/) with the C
 * reference (kernels/dsp.h) on the same random inputs: random states packed
 * by the reference, shuffled slot ids with -1 padding, sentinel bytes (0xA5)
 * around and between head blocks and pages, checked after every call.
 *
 * Tolerances (issue 5): fp32 outputs and states NMSE <= 1e-10; codes equal
 * except ties (differing only by +-1; a pack, whose source is known, proves
 * each differing code a rounding tie, the others allow at most 1e-4 of
 * codes); scales and fp16/bf16 values within one ulp; health words and
 * counters equal.
 * SANITIZE=1 shrinks the sizes for compute-sanitizer. Exit 77: no GPU.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda.h"
#include "kernels/dsp.h"
#include "kernels/quant.h"

#define D        128
#define SENTINEL 0xA5
#define GAP      16 /* sentinel bytes between head blocks and after each page */

static int n_fail, n_pass;
static int small;

#define CHECK(cond, ...)                                \
    do {                                                \
        if (!(cond)) {                                  \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
            return 1;                                   \
        }                                               \
    } while (0)

#define CU(call)                                                           \
    do {                                                                   \
        cudaError_t e_ = (call);                                           \
        CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
    } while (0)

#define SQ(call) CHECK((call) == STEPQ_OK, "%s: %s", #call, stepq_last_error())

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}
static float urand(void)
{
    return (float)(rnd() & 0xffffff) / 16777216.0f;
}
static float nrand(void)
{
    float u = urand() + 1e-7f, v = urand();
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

static double nmse(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? num / den : num;
}

/* A test layer: HV heads of one method, pages with sentinel gaps. */
struct layer {
    struct stepq__head_layout hl[8];
    size_t off[8];
    float w[8 * D];
    struct stepq__packed_layer pl;
    size_t bytes;
};

/* bits_mode: b >= 2 one width; 0 = GDN per-head mix with a pivot head, KDA per-row mix. */
static int make_layer(struct layer *L, stepq_method m, stepq_arch arch, int HV, int n_slots,
                      int bits)
{
    static const int mix[] = { 2, 3, 4, 5, 6, 8, 16 };
    memset(L, 0, sizeof(*L));
    size_t pos = GAP;
    for (int h = 0; h < HV; h++) {
        uint8_t rb[D];
        int b = bits;
        if (bits == 0 && arch == STEPQ_ARCH_GDN)
            b = h == HV - 1 ? 16 : mix[(h * 2 + 1) % 6];
        for (int i = 0; i < D; i++)
            rb[i] = (uint8_t)(bits == 0 && arch == STEPQ_ARCH_KDA ? mix[rnd() % 7] : b);
        SQ(stepq__head_layout_init(&L->hl[h], m, arch, D, D, rb, 16));
        L->off[h] = pos;
        pos += L->hl[h].block_bytes + GAP;
        for (int i = 0; i < D; i++)
            L->w[h * D + i] = 0.5f + 1.5f * urand();
    }
    L->pl.page_stride = (pos + 15) & ~(size_t)15;
    L->pl.n_slots = n_slots;
    L->pl.n_heads = HV;
    L->pl.heads = L->hl;
    L->pl.head_offset = L->off;
    L->pl.row_impact = L->w;
    L->bytes = L->pl.page_stride * (size_t)n_slots + GAP;
    return 0;
}

static void free_layer(struct layer *L)
{
    for (int h = 0; h < L->pl.n_heads; h++)
        stepq__head_layout_free(&L->hl[h]);
}

/* Fills pages: sentinel everywhere, then every slot's heads packed from random states. */
static int fill_pages(struct layer *L, uint8_t *pages, float amp)
{
    memset(pages, SENTINEL, L->bytes);
    float *x = malloc(sizeof(float) * D * D);
    CHECK(x, "oom");
    for (int s = 0; s < L->pl.n_slots; s++)
        for (int h = 0; h < L->pl.n_heads; h++) {
            for (int e = 0; e < D * D; e++)
                x[e] = amp * nrand() * (1.0f + (float)(e / D % 7));
            SQ(stepq__quantize_head(&L->hl[h], x, L->w + h * D,
                                    pages + (size_t)s * L->pl.page_stride + L->off[h], NULL));
        }
    free(x);
    return 0;
}

static uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static int ulp16(uint16_t a, uint16_t b)
{
    int ia = (a & 0x8000) ? -(int)(a & 0x7fff) : (int)a;
    int ib = (b & 0x8000) ? -(int)(b & 0x7fff) : (int)b;
    return abs(ia - ib);
}

/* The dense source of a pack: lets compare_pages prove differing codes ties. */
struct pack_src {
    const float *x; /* n entries of HV heads in `layout`, as the reference read them */
    size_t stride;  /* elements from one entry to the next */
    stepq__layout layout;
    int n;
    const int32_t *slots; /* entry e was packed into slot slots[e] (-1: skipped) */
};

/*
 * One head of the source with the scales that each side quantized it with.
 * Column scales are the step-2 ones of kernels/quant.h (c_j = fp16(max_i
 * |x_ij / r_i|)), recomputed here: the stored ones are the refit, which no
 * code was rounded with.
 */
struct tie_head {
    float x[D][D];             /* x_ij ([d_k][d_v]); non-finite as 0, the reference's sanitising */
    double r_ref[D], r_got[D]; /* row scales read from each page (0 on pivot rows) */
    double c_ref[D];           /* the reference's step-2 column scales (1 without) */
    double c_lo[D], c_hi[D];   /* every step-2 column scale the GPU can have computed */
};

/*
 * Relative error bound, in units of 2^-24, of the unrounded code argument
 * t = x / r / c * qmax as computed by either side with the same scales: at
 * most 5 roundings (GPU: x * RN(1/r), times RN(1/c), times qmax, and
 * RN(1/r), RN(1/c) themselves; reference: three), 8 leaves a margin.
 */
#define TIE_ULPS 8

static int tie_near(double z, double t)
{
    return fabs(z - t) <= 0.5 + TIE_ULPS * 0x1p-24 * fmax(fabs(t), 1.0);
}

/* t = x / r / c * qmax in double, clamped to +-qmax as the codes are. */
static double tie_arg(double x, double r, double c, double qm)
{
    double t = x / r / c * qm;
    return fmax(-qm, fmin(qm, t));
}

/* The entry of the source packed into slot s, or -1. */
static int src_entry(const struct pack_src *ps, int s)
{
    for (int e = 0; e < ps->n; e++)
        if (ps->slots[e] == s)
            return e;
    return -1;
}

/* Loads entry e, head h of the source and both pages' scales (a: GPU, b: reference). */
static void tie_head_load(struct tie_head *th, const struct pack_src *ps, int e, int h,
                          const struct stepq__head_layout *hl, const uint8_t *a, const uint8_t *b)
{
    const float *x = ps->x + (size_t)e * ps->stride + (size_t)h * D * D;
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) {
            float v = ps->layout == STEPQ__LAYOUT_KV ? x[i * D + j] : x[j * D + i];
            th->x[i][j] = isfinite(v) ? v : 0.0f;
        }
    for (int i = 0; i < D; i++) {
        size_t rp = hl->row_scale_offset + 2 * (size_t)i;
        int piv = hl->row_bits[i] == STEPQ_BITS_PIVOT;
        th->r_ref[i] = piv ? 0 : stepq__fp16_to_float(rd16(b + rp));
        th->r_got[i] = piv ? 0 : stepq__fp16_to_float(rd16(a + rp));
    }
    for (int j = 0; j < D; j++) {
        th->c_ref[j] = th->c_lo[j] = th->c_hi[j] = 1.0;
        if (!hl->has_col)
            continue;
        /* the reference's column max, in its float arithmetic (exact: max is) */
        float m = 0.0f;
        double mg = 0;
        for (int i = 0; i < D; i++) {
            if (hl->row_bits[i] == STEPQ_BITS_PIVOT)
                continue;
            float y = fabsf(th->x[i][j] / (float)th->r_ref[i]);
            m = y > m ? y : m;
            mg = fmax(mg, fabs(th->x[i][j] / th->r_got[i]));
        }
        th->c_ref[j] = stepq__fp16_to_float(stepq__scale_to_fp16(m));
        /*
         * The GPU's column max (its row scales, y = x * RN(1/r): within 2^-23
         * of mg) rounds to either fp16 neighbour of a rounding midpoint that
         * lies within TIE_ULPS float ulps of mg: then its step-2 scale, and
         * every code of the column with it, may differ from the reference's.
         */
        th->c_lo[j] =
            stepq__fp16_to_float(stepq__scale_to_fp16((float)(mg * (1 - TIE_ULPS * 0x1p-24))));
        th->c_hi[j] =
            stepq__fp16_to_float(stepq__scale_to_fp16((float)(mg * (1 + TIE_ULPS * 0x1p-24))));
    }
}

/*
 * Code (i, j), za from the GPU and zb from the reference, |za - zb| = 1.
 * With t the exact argument under the reference's scales, a tie is
 * |za - t| <= 0.5 + eps and |zb - t| <= 0.5 + eps, eps = TIE_ULPS 2^-24
 * max(|t|, 1): t lies within eps of the half-integer between the codes,
 * where the two roundings of t may part. Failing that, za is accepted only as
 * the rounding (within eps) of t under the GPU's own scales: its row scale
 * (one fp16 ulp from the reference's is allowed) or a step-2 column scale
 * that its column max can round to (c_lo, c_hi). Returns 0 (tie), 1 (the
 * GPU's scales), -1 (no tie) or -2 (zb is not a rounding of t: this file's
 * model of the reference is wrong); *t_ref gets t.
 */
static int tie_check(const struct tie_head *th, int i, int j, double qm, int za, int zb,
                     double *t_ref)
{
    double x = th->x[i][j];
    double t = tie_arg(x, th->r_ref[i], th->c_ref[j], qm);
    *t_ref = t;
    if (!tie_near(zb, t))
        return -2;
    if (tie_near(za, t))
        return 0;
    if (tie_near(za, tie_arg(x, th->r_got[i], th->c_lo[j], qm)) ||
        tie_near(za, tie_arg(x, th->r_got[i], th->c_hi[j], qm)))
        return 1;
    return -1;
}

/*
 * Compares pages produced by the GPU (got) with the reference (ref). ps: the
 * source of a pack, or NULL (pages the step wrote): with it every differing
 * code must be a proven tie (tie_check), without it at most 1e-4 of the
 * codes may differ.
 */
static int compare_pages(const struct layer *L, const uint8_t *got, const uint8_t *ref,
                         const struct pack_src *ps, const char *what)
{
    static struct tie_head th;
    size_t codes = 0, diff = 0, ties_scale = 0, by_scale = 0;
    int8_t za[D], zb[D];
    for (size_t i = 0; i < L->bytes; i++) {
        int in_block = 0;
        size_t s = i / L->pl.page_stride, o = i % L->pl.page_stride;
        for (int h = 0; h < L->pl.n_heads && s < (size_t)L->pl.n_slots; h++)
            if (o >= L->off[h] && o < L->off[h] + L->hl[h].block_bytes)
                in_block = 1;
        if (!in_block)
            CHECK(got[i] == SENTINEL, "%s: stray write at byte %zu (0x%02x)", what, i, got[i]);
    }
    for (int s = 0; s < L->pl.n_slots; s++)
        for (int h = 0; h < L->pl.n_heads; h++) {
            const struct stepq__head_layout *hl = &L->hl[h];
            const uint8_t *a = got + (size_t)s * L->pl.page_stride + L->off[h];
            const uint8_t *b = ref + (size_t)s * L->pl.page_stride + L->off[h];
            /* the 1e-4 budget is over every code compared, identical blocks included */
            size_t head_codes = hl->quantized ? (size_t)(D - hl->n_pivot_rows) * D : 0;
            if (!memcmp(a, b, hl->block_bytes)) {
                codes += head_codes;
                continue;
            }
            int entry = ps ? src_entry(ps, s) : -1;
            CHECK(!ps || entry >= 0, "%s: slot %d head %d was not packed but its block changed",
                  what, s, h);
            if (hl->method == STEPQ_METHOD_FP32) {
                CHECK(nmse((const float *)a, (const float *)b, D * D) <= 1e-10,
                      "%s: slot %d head %d fp32 state NMSE %g", what, s, h,
                      nmse((const float *)a, (const float *)b, D * D));
                continue;
            }
            if (!hl->quantized) {
                /*
                 * bf16 / fp16 pages: the GPU and the reference round
                 * differently computed fp32 states, and a tiny element left
                 * by cancellation can differ by several of its own ulps.
                 * Tolerance: one ulp of the head's largest magnitude plus
                 * one ulp of the element.
                 */
                int bf = hl->method == STEPQ_METHOD_BF16, mant = bf ? 7 : 10;
                double mx = 0;
                for (int e = 0; e < D * D; e++) {
                    uint16_t v = rd16(b + 2 * e);
                    mx = fmax(mx, fabs(bf ? stepq__bf16_to_float(v) : stepq__fp16_to_float(v)));
                }
                for (int e = 0; e < D * D; e++) {
                    uint16_t va = rd16(a + 2 * e), vb = rd16(b + 2 * e);
                    double fa = bf ? stepq__bf16_to_float(va) : stepq__fp16_to_float(va);
                    double fb = bf ? stepq__bf16_to_float(vb) : stepq__fp16_to_float(vb);
                    double ulp = ldexp(1.0, ilogb(fb == 0 ? 1e-30 : fb) - mant);
                    CHECK(fabs(fa - fb) <= ldexp(mx, -mant - 1) + ulp,
                          "%s: slot %d head %d element %d: 0x%04x vs 0x%04x (head max %g)", what, s,
                          h, e, va, vb, mx);
                }
                continue;
            }
            double den[D] = { 0 }, flip[D] = { 0 };
            codes += head_codes;
            if (ps)
                tie_head_load(&th, ps, entry, h, hl, a, b);
            for (int i = 0; i < D; i++) {
                int bi = hl->row_bits[i];
                if (bi == STEPQ_BITS_PIVOT) {
                    for (int j = 0; j < D; j++) {
                        size_t p = hl->row_bitoff[i] / 8 + 2 * (size_t)j;
                        CHECK(ulp16(rd16(a + p), rd16(b + p)) <= 1,
                              "%s: slot %d head %d pivot (%d,%d): 0x%04x vs 0x%04x", what, s, h, i,
                              j, rd16(a + p), rd16(b + p));
                    }
                    continue;
                }
                size_t rp = hl->row_scale_offset + 2 * (size_t)i;
                CHECK(ulp16(rd16(a + rp), rd16(b + rp)) <= 1,
                      "%s: slot %d head %d row scale %d: 0x%04x vs 0x%04x", what, s, h, i,
                      rd16(a + rp), rd16(b + rp));
                stepq__unpack_codes(a, hl->row_bitoff[i], za, D, bi);
                stepq__unpack_codes(b, hl->row_bitoff[i], zb, D, bi);
                /* refit weights W_i = w_i^2 r_i^2 of the reference's fit */
                double wi = hl->method == STEPQ_METHOD_DSQ ? 1.0 : L->w[h * D + i];
                double ri = stepq__fp16_to_float(rd16(b + rp));
                double W = wi * wi * ri * ri, qm = stepq__qmax(bi);
                for (int j = 0; j < D; j++) {
                    double zt = zb[j] / qm;
                    den[j] += W * zt * zt;
                    if (za[j] != zb[j]) {
                        diff++;
                        flip[j] += W * (3 * fabs(zt) + 2 / qm) / qm;
                        CHECK(abs(za[j] - zb[j]) <= 1, "%s: slot %d head %d code (%d,%d): %d vs %d",
                              what, s, h, i, j, za[j], zb[j]);
                        if (!ps)
                            continue;
                        double t;
                        int k = tie_check(&th, i, j, qm, za[j], zb[j], &t);
                        CHECK(k != -2,
                              "%s: slot %d head %d code (%d,%d): reference code %d, but x / r%s *"
                              " qmax = %.9g (check_cuda's recomputation of the reference is wrong)",
                              what, s, h, i, j, zb[j], hl->has_col ? " / c" : "", t);
                        CHECK(k >= 0,
                              "%s: slot %d head %d code (%d,%d) @%d: %d vs %d is no tie: x = %.9g,"
                              " x / r%s * qmax = %.9g (r %.9g, c %.9g; GPU's c %.9g..%.9g)",
                              what, s, h, i, j, bi, za[j], zb[j], (double)th.x[i][j],
                              hl->has_col ? " / c" : "", t, th.r_ref[i], th.c_ref[j], th.c_lo[j],
                              th.c_hi[j]);
                        by_scale += (size_t)k;
                    }
                }
            }
            /*
             * Column scales within one fp16 ulp, except where a code of the
             * column moved at a tie: the fixed-code refit c = N / D then
             * moves by up to W_k (3|zt_k| + 2/qmax) / qmax / D per flipped
             * code k (|dN| <= W_k |dzt| (|zt_k| + 1/qmax) c, |dD| <= W_k
             * |dzt| (2|zt_k| + 1/qmax)), which in a column of few non-zero
             * codes exceeds one ulp.
             */
            if (hl->has_col)
                for (int j = 0; j < D; j++) {
                    size_t cp = hl->col_scale_offset + 2 * (size_t)j;
                    uint16_t ca = rd16(a + cp), cb = rd16(b + cp);
                    if (ulp16(ca, cb) <= 1)
                        continue;
                    double fa = stepq__fp16_to_float(ca), fb = stepq__fp16_to_float(cb);
                    CHECK(flip[j] > 0 &&
                              (den[j] == 0 ||
                               fabs(fa - fb) <= 1.5 * fb * flip[j] / den[j] + ldexp(fb, -10)),
                          "%s: slot %d head %d col scale %d: 0x%04x vs 0x%04x (tie bound %g)", what,
                          s, h, j, ca, cb, den[j] > 0 ? flip[j] / den[j] : -1.0);
                    ties_scale++;
                }
        }
    CHECK(ps || diff <= codes / 10000, "%s: %zu of %zu codes differ (> 1e-4)", what, diff, codes);
    if (diff && ps)
        printf("  %s: %zu of %zu codes differ by +-1, each a proven tie (%zu of them under the"
               " GPU's own scales); %zu column scales moved by them beyond one ulp\n",
               what, diff, codes, by_scale, ties_scale);
    else if (diff)
        printf("  %s: %zu of %zu codes differ by +-1 (ties); %zu column scales moved by them"
               " beyond one ulp\n",
               what, diff, codes, ties_scale);
    return 0;
}

struct inputs {
    int batch, H, HV;
    int32_t *slots;
    float *q, *k, *v, *g, *beta, *A_log, *dt_bias;
};

/* Allocates the inputs of `batch` requests (filled by gen_inputs, freed by inputs_free). */
static void inputs_alloc(struct inputs *in, stepq_arch arch, int batch, int H, int HV)
{
    int ng = arch == STEPQ_ARCH_KDA ? D : 1;
    *in = (struct inputs){ .batch = batch, .H = H, .HV = HV };
    in->slots = malloc(sizeof(int32_t) * batch);
    in->q = malloc(sizeof(float) * batch * H * D);
    in->k = malloc(sizeof(float) * batch * H * D);
    in->v = malloc(sizeof(float) * batch * HV * D);
    in->g = malloc(sizeof(float) * batch * HV * ng);
    in->beta = malloc(sizeof(float) * batch * HV);
    in->A_log = malloc(sizeof(float) * HV);
    in->dt_bias = malloc(sizeof(float) * HV * ng);
}

static void inputs_free(struct inputs *in)
{
    free(in->slots);
    free(in->q);
    free(in->k);
    free(in->v);
    free(in->g);
    free(in->beta);
    free(in->A_log);
    free(in->dt_bias);
}

static void gen_inputs(struct inputs *in, stepq_arch arch, int n_slots, int gate)
{
    int B = in->batch, ng = arch == STEPQ_ARCH_KDA ? D : 1;
    int *perm = malloc(sizeof(int) * (size_t)n_slots);
    for (int s = 0; s < n_slots; s++)
        perm[s] = s;
    for (int s = n_slots - 1; s > 0; s--) {
        int r = (int)(rnd() % (unsigned)(s + 1)), t = perm[s];
        perm[s] = perm[r];
        perm[r] = t;
    }
    for (int b = 0; b < B; b++)
        in->slots[b] = (b % 4 == 3) ? -1 : perm[b];
    for (int n = 0; n < B * in->H * D; n++) {
        in->q[n] = nrand();
        in->k[n] = nrand();
    }
    for (int n = 0; n < B * in->HV * D; n++)
        in->v[n] = nrand();
    for (int n = 0; n < B * in->HV * ng; n++)
        in->g[n] = gate ? nrand() : -0.5f * urand();
    for (int n = 0; n < B * in->HV; n++)
        in->beta[n] = gate ? nrand() : urand();
    for (int n = 0; n < in->HV; n++)
        in->A_log[n] = 0.3f * nrand();
    for (int n = 0; n < in->HV * ng; n++)
        in->dt_bias[n] = 0.3f * nrand();
    free(perm);
}

/* Device copies of a host buffer. */
static void *dup_dev(const void *h, size_t n)
{
    void *d = NULL;
    if (cudaMalloc(&d, n ? n : 1) != cudaSuccess)
        return NULL;
    if (n)
        cudaMemcpy(d, h, n, cudaMemcpyHostToDevice);
    return d;
}

static float step_amp = 0.3f; /* magnitude of the random states packed into pages */

/*
 * The inputs of a batch as a server hands them (kernels/dsp.h): bf16
 * elements (A_log and dt_bias too), q, k and v as views into one fused
 * projection row per request (q | k | v | 3 spare elements), g, beta and o
 * in padded rows. Input gaps hold NaN (a read of one would fail the head)
 * and o starts as SENTINEL bytes. The reference reads these host bytes and
 * the kernels a device copy of the very same bytes.
 */
struct view {
    size_t qkv_stride, g_stride, beta_stride, o_stride;
    size_t n_qkv, n_g, n_beta, n_o; /* elements of each buffer */
    size_t n_alog, n_par;           /* elements of A_log (HV) and dt_bias */
    uint16_t *qkv, *g, *beta, *o, *A_log, *dt_bias;
};

static int step_view; /* run_step and run_dense take their inputs and o through a struct view */
/*
 * The kernel choice run_step, run_pack and run_dense pass to the entries
 * (stepq__cuda_layer_prepare_ex, stepq__cuda_step_dense_ex): 0, or
 * STEPQ__CUDA_COLUMN for the thread-per-column comparison checks.
 */
static unsigned kernel_flags;

static void view_alloc(struct view *w, stepq_arch arch, int batch, int H, int HV)
{
    const size_t ng = (size_t)HV * (arch == STEPQ_ARCH_KDA ? D : 1);
    w->qkv_stride = 2 * (size_t)H * D + (size_t)HV * D + 3;
    w->g_stride = ng + 5;
    w->beta_stride = (size_t)HV + 2;
    w->o_stride = (size_t)HV * D + 7;
    w->n_qkv = w->qkv_stride * batch;
    w->n_g = w->g_stride * batch;
    w->n_beta = w->beta_stride * batch;
    w->n_o = w->o_stride * batch;
    w->n_alog = (size_t)HV;
    w->n_par = ng;
    w->qkv = malloc(2 * w->n_qkv);
    w->g = malloc(2 * w->n_g);
    w->beta = malloc(2 * w->n_beta);
    w->o = malloc(2 * w->n_o);
    w->A_log = malloc(2 * w->n_alog);
    w->dt_bias = malloc(2 * w->n_par);
}

static void view_free(struct view *w)
{
    free(w->qkv);
    free(w->g);
    free(w->beta);
    free(w->o);
    free(w->A_log);
    free(w->dt_bias);
}

/* n elements of one row: bf16 of the fp32 inputs, rounded to nearest even. */
static void view_row(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = stepq__bf16_from_float(src[i]);
}

/* The view of `in` (NaN gaps, SENTINEL o). */
static void view_fill(struct view *w, const struct inputs *in)
{
    const int B = in->batch, H = in->H, HV = in->HV;
    const size_t nq = (size_t)H * D, nv = (size_t)HV * D, ng = w->n_par;
    const uint16_t nan16 = 0x7fc1;
    for (size_t e = 0; e < w->n_qkv; e++)
        w->qkv[e] = nan16;
    for (size_t e = 0; e < w->n_g; e++)
        w->g[e] = nan16;
    for (size_t e = 0; e < w->n_beta; e++)
        w->beta[e] = nan16;
    for (int b = 0; b < B; b++) {
        uint16_t *row = w->qkv + (size_t)b * w->qkv_stride;
        view_row(row, in->q + (size_t)b * nq, nq);
        view_row(row + nq, in->k + (size_t)b * nq, nq);
        view_row(row + 2 * nq, in->v + (size_t)b * nv, nv);
        view_row(w->g + (size_t)b * w->g_stride, in->g + (size_t)b * ng, ng);
        view_row(w->beta + (size_t)b * w->beta_stride, in->beta + (size_t)b * HV, (size_t)HV);
    }
    view_row(w->A_log, in->A_log, (size_t)HV);
    view_row(w->dt_bias, in->dt_bias, ng);
    memset(w->o, SENTINEL, 2 * w->n_o);
}

/* Points a's tensors at a view's buffers (host or device: the same layout), dtypes bf16. */
static void view_point(struct stepq__step_args *a, const struct view *w, uint16_t *qkv, uint16_t *g,
                       uint16_t *beta, uint16_t *A_log, uint16_t *dt_bias, uint16_t *o)
{
    const size_t nq = (size_t)a->H * D;
    a->dtype = a->param_dtype = STEPQ_DTYPE_BF16;
    a->q = qkv;
    a->k = qkv + nq;
    a->v = qkv + 2 * nq;
    a->q_stride = a->k_stride = a->v_stride = w->qkv_stride;
    a->g = g;
    a->g_stride = w->g_stride;
    a->beta = beta;
    a->beta_stride = w->beta_stride;
    a->A_log = A_log;
    a->dt_bias = dt_bias;
    a->o = o;
    a->o_stride = w->o_stride;
}

/* Device copies of a view's buffers, same layout; 1 when an allocation failed. */
static int view_dev(const struct view *w, struct view *dw)
{
    *dw = *w;
    dw->qkv = dup_dev(w->qkv, 2 * w->n_qkv);
    dw->g = dup_dev(w->g, 2 * w->n_g);
    dw->beta = dup_dev(w->beta, 2 * w->n_beta);
    dw->o = dup_dev(w->o, 2 * w->n_o);
    dw->A_log = dup_dev(w->A_log, 2 * w->n_alog);
    dw->dt_bias = dup_dev(w->dt_bias, 2 * w->n_par);
    return !dw->qkv || !dw->g || !dw->beta || !dw->o || !dw->A_log || !dw->dt_bias;
}

/* Copies the host view's inputs (and its SENTINEL o) into the device view. */
static int view_upload(const struct view *w, const struct view *dw)
{
    CU(cudaMemcpy(dw->qkv, w->qkv, 2 * w->n_qkv, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dw->A_log, w->A_log, 2 * w->n_alog, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dw->dt_bias, w->dt_bias, 2 * w->n_par, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dw->g, w->g, 2 * w->n_g, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dw->beta, w->beta, 2 * w->n_beta, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dw->o, w->o, 2 * w->n_o, cudaMemcpyHostToDevice));
    return 0;
}

static void view_dev_free(struct view *dw)
{
    cudaFree(dw->qkv);
    cudaFree(dw->g);
    cudaFree(dw->beta);
    cudaFree(dw->o);
    cudaFree(dw->A_log);
    cudaFree(dw->dt_bias);
}

/*
 * o of a view, CUDA (got) vs reference (ref), both bf16: the gaps and the
 * rows of padding entries keep their SENTINEL bytes in both. Elsewhere the
 * two fp32 readouts (NMSE <= 1e-10 on fp32 outputs) may round to
 * neighbouring bf16 values: a differing element must be within one bf16 ulp
 * of the larger plus 1e-5 of the head's RMS, and at most 1% of them differ.
 */
static int compare_view_o(const uint16_t *got, const uint16_t *ref, const struct view *w,
                          const int32_t *slots, int batch, int HV, const char *what)
{
    size_t off = 0, n = 0;
    for (int b = 0; b < batch; b++)
        for (size_t e = 0; e < w->o_stride; e++) {
            const size_t i = (size_t)b * w->o_stride + e;
            const int head = e < (size_t)HV * D && slots[b] >= 0;
            if (!head) {
                CHECK(got[i] == ref[i] && ref[i] == (SENTINEL << 8 | SENTINEL),
                      "%s: o element %zu (a gap or padding row) is 0x%04x, reference 0x%04x", what,
                      i, got[i], ref[i]);
                continue;
            }
            n++;
            if (got[i] == ref[i])
                continue;
            const size_t h0 = (size_t)b * w->o_stride + e / D * D;
            double rms = 0;
            for (int j = 0; j < D; j++) {
                double x = stepq__bf16_to_float(ref[h0 + j]);
                rms += x * x / D;
            }
            double ga = stepq__bf16_to_float(got[i]), gb = stepq__bf16_to_float(ref[i]);
            double big = fmax(fabs(ga), fabs(gb));
            double ulp = ldexp(1.0, ilogb(big == 0 ? 1e-38 : big) - 7);
            CHECK(fabs(ga - gb) <= ulp + 1e-5 * sqrt(rms),
                  "%s: o element %zu: bf16 0x%04x vs reference 0x%04x (%g vs %g)", what, i, got[i],
                  ref[i], ga, gb);
            off++;
        }
    CHECK(off <= n / 100, "%s: %zu of %zu bf16 o elements differ (> 1%%)", what, off, n);
    printf("  %s: bf16 strided o: %zu of %zu elements one rounding apart\n", what, off, n);
    return 0;
}

/* Step arguments of a batch: shape, l2norm, slot ids and the per-row tensors (o: output). */
static struct stepq__step_args step_args(stepq_arch arch, int batch, int H, int HV, int n_slots,
                                         const int32_t *slots, const float *q, const float *k,
                                         const float *v, const float *g, const float *beta,
                                         float *o)
{
    struct stepq__step_args a = { 0 };
    a.arch = arch;
    a.batch = batch;
    a.H = H;
    a.HV = HV;
    a.d_k = a.d_v = D;
    a.n_slots = n_slots;
    a.opt.l2norm = 1;
    a.slots = slots;
    a.q = q;
    a.k = k;
    a.v = v;
    a.g = g;
    a.beta = beta;
    a.o = o;
    return a;
}

/*
 * One packed decode step, CUDA vs reference. variant: fused or two-stage.
 * nonfinite: request 0 gets a NaN in q (head untouched, output 0, flag).
 */
static int run_step(stepq_method m, stepq_arch arch, int bits, int H, int HV, int batch, int gate,
                    int nonfinite, stepq__cuda_variant variant)
{
    char what[160];
    snprintf(what, sizeof(what), "step %s method=%d bits=%d H=%d HV=%d B=%d gate=%d nf=%d var=%d%s",
             arch == STEPQ_ARCH_KDA ? "kda" : "gdn", (int)m, bits, H, HV, batch, gate, nonfinite,
             (int)variant, step_view ? " bf16 strided inputs" : "");
    int n_slots = batch + 3, ng = arch == STEPQ_ARCH_KDA ? D : 1;
    struct layer L;
    if (make_layer(&L, m, arch, HV, n_slots, bits))
        return 1;
    uint8_t *pages = malloc(L.bytes), *ref = malloc(L.bytes), *got = malloc(L.bytes);
    struct inputs in;
    inputs_alloc(&in, arch, batch, H, HV);
    float *o_ref = calloc((size_t)batch * HV * D, sizeof(float));
    float *o_got = calloc((size_t)batch * HV * D, sizeof(float));
    uint32_t *h_ref = calloc((size_t)n_slots, 4), *h_got = calloc((size_t)n_slots, 4);
    uint64_t c_ref[4] = { 0 }, c_got[4] = { 0 };
    if (fill_pages(&L, pages, step_amp))
        return 1;
    memcpy(ref, pages, L.bytes);
    gen_inputs(&in, arch, n_slots, gate);
    if (nonfinite)
        in.q[0] = NAN;
    /* Outputs of padding rows are not written: pre-fill both equally. */
    for (size_t n = 0; n < (size_t)batch * HV * D; n++)
        o_ref[n] = o_got[n] = 12345.0f;

    struct stepq__step_args a =
        step_args(arch, batch, H, HV, n_slots, in.slots, in.q, in.k, in.v, in.g, in.beta, o_ref);
    a.opt.gate_in_kernel = gate;
    a.opt.beta_sigmoid = gate;
    a.A_log = in.A_log;
    a.dt_bias = in.dt_bias;
    a.health = h_ref;
    a.counts = c_ref;
    L.pl.base = ref;
    /* step_view: both read the same bf16 strided bytes, both write o into SENTINEL-filled rows */
    struct view w = { 0 }, dw = { 0 };
    if (step_view) {
        view_alloc(&w, arch, batch, H, HV);
        view_fill(&w, &in);
        CHECK(!view_dev(&w, &dw), "device allocation");
        view_point(&a, &w, w.qkv, w.g, w.beta, w.A_log, w.dt_bias, w.o);
    }
    SQ(stepq__ref_step_packed(&a, &L.pl));

    /* the same on the device */
    struct stepq__step_args d = a;
    d.slots = dup_dev(in.slots, sizeof(int32_t) * batch);
    if (step_view) {
        view_point(&d, &dw, dw.qkv, dw.g, dw.beta, dw.A_log, dw.dt_bias, dw.o);
    } else {
        d.q = dup_dev(in.q, sizeof(float) * batch * H * D);
        d.k = dup_dev(in.k, sizeof(float) * batch * H * D);
        d.v = dup_dev(in.v, sizeof(float) * batch * HV * D);
        d.g = dup_dev(in.g, sizeof(float) * batch * HV * ng);
        d.beta = dup_dev(in.beta, sizeof(float) * batch * HV);
        d.A_log = dup_dev(in.A_log, sizeof(float) * HV);
        d.dt_bias = dup_dev(in.dt_bias, sizeof(float) * HV * ng);
        d.o = dup_dev(o_got, sizeof(float) * batch * HV * D);
    }
    d.health = dup_dev(h_got, 4 * (size_t)n_slots);
    d.counts = dup_dev(c_got, sizeof(c_got));
    uint8_t *dpages = dup_dev(pages, L.bytes);
    CHECK(d.o && d.health && d.counts && dpages && d.q && d.dt_bias, "device allocation");
    struct stepq__packed_layer dpl = L.pl;
    dpl.base = dpages + 0; /* pages start at byte 0; the first head at GAP */
    stepq__cuda_layer *cl = NULL;
    SQ(stepq__cuda_layer_prepare_ex(&dpl, kernel_flags, &cl));
    SQ(stepq__cuda_step_packed_prepared(&d, &dpl, cl, variant));
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(got, dpages, L.bytes, cudaMemcpyDeviceToHost));
    uint16_t *o16 = step_view ? malloc(2 * w.n_o) : NULL;
    if (step_view)
        CU(cudaMemcpy(o16, dw.o, 2 * w.n_o, cudaMemcpyDeviceToHost));
    else
        CU(cudaMemcpy(o_got, d.o, sizeof(float) * batch * HV * D, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(h_got, d.health, 4 * (size_t)n_slots, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(c_got, d.counts, sizeof(c_got), cudaMemcpyDeviceToHost));

    int rc = compare_pages(&L, got, ref, NULL, what);
    if (!rc && step_view) {
        rc = compare_view_o(o16, w.o, &w, in.slots, batch, HV, what);
    } else if (!rc) {
        double e = nmse(o_got, o_ref, (size_t)batch * HV * D);
        if (e > 1e-10) {
            printf("FAIL %s: output NMSE %g > 1e-10\n", what, e);
            rc = 1;
        }
    }
    if (!rc) {
        for (int s = 0; s < n_slots && !rc; s++)
            if (h_got[s] != h_ref[s]) {
                printf("FAIL %s: health[%d] = 0x%x, reference 0x%x\n", what, s, h_got[s], h_ref[s]);
                rc = 1;
            }
        if (!rc && memcmp(c_got, c_ref, sizeof(c_ref))) {
            printf("FAIL %s: health counts %llu/%llu/%llu/%llu vs %llu/%llu/%llu/%llu\n", what,
                   (unsigned long long)c_got[0], (unsigned long long)c_got[1],
                   (unsigned long long)c_got[2], (unsigned long long)c_got[3],
                   (unsigned long long)c_ref[0], (unsigned long long)c_ref[1],
                   (unsigned long long)c_ref[2], (unsigned long long)c_ref[3]);
            rc = 1;
        }
    }
    stepq__cuda_layer_release(cl);
    cudaFree((void *)d.slots);
    if (step_view) { /* d.k and d.v point into d.q's buffer */
        view_dev_free(&dw);
        view_free(&w);
        free(o16);
    } else {
        cudaFree((void *)d.q);
        cudaFree((void *)d.k);
        cudaFree((void *)d.v);
        cudaFree((void *)d.g);
        cudaFree((void *)d.beta);
        cudaFree((void *)d.A_log);
        cudaFree((void *)d.dt_bias);
        cudaFree(d.o);
    }
    cudaFree(d.health);
    cudaFree(d.counts);
    cudaFree(dpages);
    free(pages);
    free(ref);
    free(got);
    inputs_free(&in);
    free(o_ref);
    free(o_got);
    free(h_ref);
    free(h_got);
    free_layer(&L);
    return rc;
}

/* A step on states so large that row and column scales saturate (clamped codes). */
static int run_step_amp(stepq_method m, stepq_arch arch, int bits, int H, int HV, int batch,
                        float amp)
{
    step_amp = amp;
    int rc = run_step(m, arch, bits, H, HV, batch, 0, 0, 0);
    step_amp = 0.3f;
    return rc;
}

/* run_step on a server's views: bf16 inputs (A_log, dt_bias too) and o in strided rows. */
static int run_step_view(stepq_method m, stepq_arch arch, int bits, int H, int HV, int batch,
                         int gate, int nonfinite, stepq__cuda_variant variant)
{
    step_view = 1;
    int rc = run_step(m, arch, bits, H, HV, batch, gate, nonfinite, variant);
    step_view = 0;
    return rc;
}

/* pack then unpack, both layouts, fp32 and bf16 sources, vs the reference. */
static int run_pack(stepq_method m, stepq_arch arch, int bits, int HV, int n, stepq__layout lay,
                    stepq_dtype dt)
{
    char what[128];
    snprintf(what, sizeof(what), "pack/unpack %s method=%d bits=%d layout=%d dtype=%d",
             arch == STEPQ_ARCH_KDA ? "kda" : "gdn", (int)m, bits, (int)lay, (int)dt);
    int n_slots = n + 2;
    struct layer L;
    if (make_layer(&L, m, arch, HV, n_slots, bits))
        return 1;
    /* [V,K] bf16 with an odd stride takes the scalar path, the others the vector path */
    size_t head = D * D,
           stride = head * HV + (lay == STEPQ__LAYOUT_VK && dt == STEPQ_DTYPE_BF16 ? 1 : 64);
    float *src = malloc(sizeof(float) * stride * n);
    uint16_t *src16 = malloc(2 * stride * n);
    int32_t *slots = malloc(sizeof(int32_t) * n);
    uint8_t *ref = malloc(L.bytes), *got = malloc(L.bytes);
    for (size_t e = 0; e < stride * (size_t)n; e++) {
        src16[e] = stepq__bf16_from_float(0.2f * nrand());
        src[e] = dt == STEPQ_DTYPE_BF16 ? stepq__bf16_to_float(src16[e]) : 0.2f * nrand();
    }
    src[5] = NAN; /* entry 0 head 0: STATE flag */
    src16[5] = 0x7fc0;
    for (int e = 0; e < n; e++)
        slots[e] = e == 1 ? -1 : (n_slots - 1 - e);
    uint32_t h_ref[64] = { 0 }, h_got[64] = { 0 };
    uint64_t c_ref[4] = { 0 }, c_got[4] = { 0 };
    memset(ref, SENTINEL, L.bytes);
    L.pl.base = ref;
    SQ(stepq__ref_pack(&L.pl, n, slots, src, stride, lay, h_ref, c_ref, NULL));

    uint8_t *dpages = NULL;
    CU(cudaMalloc((void **)&dpages, L.bytes));
    CU(cudaMemset(dpages, SENTINEL, L.bytes));
    void *dsrc = dt == STEPQ_DTYPE_BF16 ? dup_dev(src16, 2 * stride * n)
                                        : dup_dev(src, sizeof(float) * stride * n);
    int32_t *dslots = dup_dev(slots, sizeof(int32_t) * n);
    uint32_t *dh = dup_dev(h_got, sizeof(h_got));
    uint64_t *dc = dup_dev(c_got, sizeof(c_got));
    struct stepq__packed_layer dpl = L.pl;
    dpl.base = dpages;
    stepq__cuda_layer *cl = NULL;
    SQ(stepq__cuda_layer_prepare_ex(&dpl, kernel_flags, &cl));
    SQ(stepq__cuda_pack_prepared(&dpl, cl, n, dslots, dsrc, stride, lay, dt, dh, dc, NULL));
    CU(cudaMemcpy(got, dpages, L.bytes, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(h_got, dh, sizeof(h_got), cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(c_got, dc, sizeof(c_got), cudaMemcpyDeviceToHost));
    /* Unwritten slots hold the sentinel on both sides; compare_pages checks they still do. */
    struct pack_src ps = { src, stride, lay, n, slots };
    int rc = compare_pages(&L, got, ref, &ps, what);
    if (!rc && (memcmp(h_got, h_ref, sizeof(h_ref)) || memcmp(c_got, c_ref, sizeof(c_ref)))) {
        printf("FAIL %s: health words or counts differ\n", what);
        rc = 1;
    }

    /* unpack the reference pages on both sides */
    if (!rc) {
        float *u_ref = calloc(stride * n, sizeof(float)),
              *u_got = calloc(stride * n, sizeof(float));
        uint16_t *u16 = calloc(stride * n, 2);
        SQ(stepq__ref_unpack(&L.pl, n, slots, u_ref, stride, lay, NULL));
        CU(cudaMemcpy(dpages, ref, L.bytes, cudaMemcpyHostToDevice));
        void *dd = NULL;
        size_t es = dt == STEPQ_DTYPE_BF16 ? 2 : 4;
        CU(cudaMalloc(&dd, es * stride * n));
        CU(cudaMemset(dd, 0, es * stride * n));
        SQ(stepq__cuda_unpack_prepared(&dpl, cl, n, dslots, dd, stride, lay, dt, NULL));
        if (dt == STEPQ_DTYPE_BF16) {
            CU(cudaMemcpy(u16, dd, 2 * stride * n, cudaMemcpyDeviceToHost));
            for (size_t e = 0; e < stride * (size_t)n && !rc; e++)
                if (ulp16(u16[e], stepq__bf16_from_float(u_ref[e])) > 0) {
                    printf("FAIL %s: unpack bf16 element %zu: 0x%04x vs %g\n", what, e, u16[e],
                           (double)u_ref[e]);
                    rc = 1;
                }
        } else {
            CU(cudaMemcpy(u_got, dd, 4 * stride * n, cudaMemcpyDeviceToHost));
            double e = nmse(u_got, u_ref, stride * n);
            if (e > 1e-10) {
                printf("FAIL %s: unpack NMSE %g\n", what, e);
                rc = 1;
            }
        }
        cudaFree(dd);
        free(u_ref);
        free(u_got);
        free(u16);
    }
    stepq__cuda_layer_release(cl);
    cudaFree(dpages);
    cudaFree(dsrc);
    cudaFree(dslots);
    cudaFree(dh);
    cudaFree(dc);
    free(src);
    free(src16);
    free(slots);
    free(ref);
    free(got);
    free_layer(&L);
    return rc;
}

/* Dense fp32 decode: `steps` steps on the GPU vs the reference, both layouts. */
static int run_dense(stepq_arch arch, stepq__layout lay, int H, int HV, int batch, int steps,
                     int bf16)
{
    char what[96];
    snprintf(what, sizeof(what), "dense %s %s layout=%d B=%d steps=%d%s", bf16 ? "bf16" : "fp32",
             arch == STEPQ_ARCH_KDA ? "kda" : "gdn", (int)lay, batch, steps,
             step_view ? " bf16 strided inputs, gate" : "");
    int n_slots = batch + 2, ng = arch == STEPQ_ARCH_KDA ? D : 1;
    size_t stride = (size_t)HV * D * D;
    float *S = malloc(sizeof(float) * stride * n_slots),
          *Sg = malloc(sizeof(float) * stride * n_slots);
    uint16_t *S16 = malloc(2 * stride * n_slots);
    for (size_t e = 0; e < stride * n_slots; e++) {
        S[e] = 0.1f * nrand();
        S16[e] = stepq__bf16_from_float(S[e]);
        if (bf16)
            S[e] = stepq__bf16_to_float(S16[e]);
    }
    struct inputs in;
    inputs_alloc(&in, arch, batch, H, HV);
    float *o_ref = calloc((size_t)batch * HV * D, sizeof(float));
    float *o_got = calloc((size_t)batch * HV * D, sizeof(float));
    int32_t slots0[64];
    gen_inputs(&in, arch, n_slots, 0);
    memcpy(slots0, in.slots, sizeof(int32_t) * batch);
    void *dS =
        bf16 ? dup_dev(S16, 2 * stride * n_slots) : dup_dev(S, sizeof(float) * stride * n_slots);
    /* gen_inputs refills the same buffers every step: the arguments point at them once. */
    struct stepq__step_args a =
        step_args(arch, batch, H, HV, n_slots, in.slots, in.q, in.k, in.v, in.g, in.beta, o_ref);
    int32_t *dslots = dup_dev(in.slots, sizeof(int32_t) * batch);
    float *dq, *dk, *dv, *dg, *db, *dout;
    CU(cudaMalloc((void **)&dq, sizeof(float) * batch * H * D));
    CU(cudaMalloc((void **)&dk, sizeof(float) * batch * H * D));
    CU(cudaMalloc((void **)&dv, sizeof(float) * batch * HV * D));
    CU(cudaMalloc((void **)&dg, sizeof(float) * batch * HV * ng));
    CU(cudaMalloc((void **)&db, sizeof(float) * batch * HV));
    CU(cudaMalloc((void **)&dout, sizeof(float) * batch * HV * D));
    struct stepq__step_args d =
        step_args(arch, batch, H, HV, n_slots, dslots, dq, dk, dv, dg, db, dout);
    /* step_view: the same bf16 strided bytes for both, with the in-kernel gate (bf16 A_log too) */
    struct view w = { 0 }, dw = { 0 };
    uint16_t *o16 = NULL;
    if (step_view) {
        view_alloc(&w, arch, batch, H, HV);
        view_fill(&w, &in);
        CHECK(!view_dev(&w, &dw) && (o16 = malloc(2 * w.n_o)), "allocation");
        view_point(&a, &w, w.qkv, w.g, w.beta, w.A_log, w.dt_bias, w.o);
        view_point(&d, &dw, dw.qkv, dw.g, dw.beta, dw.A_log, dw.dt_bias, dw.o);
        a.opt.gate_in_kernel = a.opt.beta_sigmoid = 1;
        d.opt = a.opt;
    }
    struct stepq__dense_states st = { S, stride, lay }, dst = { (float *)dS, stride, lay };
    double worst = 0;
    for (int t = 0; t < steps; t++) {
        gen_inputs(&in, arch, n_slots, step_view);
        memcpy(in.slots, slots0, sizeof(int32_t) * batch); /* the same requests every step */
        if (step_view) { /* before the reference writes its o into w.o */
            view_fill(&w, &in);
            if (view_upload(&w, &dw))
                return 1;
        }
        SQ(stepq__ref_step_dense(&a, &st));
        if (bf16) /* the GPU stores the updated state as bf16 */
            for (size_t e = 0; e < stride * n_slots; e++)
                S[e] = stepq__bf16_to_float(stepq__bf16_from_float(S[e]));
        if (!step_view) {
            CU(cudaMemcpy(dq, in.q, sizeof(float) * batch * H * D, cudaMemcpyHostToDevice));
            CU(cudaMemcpy(dk, in.k, sizeof(float) * batch * H * D, cudaMemcpyHostToDevice));
            CU(cudaMemcpy(dv, in.v, sizeof(float) * batch * HV * D, cudaMemcpyHostToDevice));
            CU(cudaMemcpy(dg, in.g, sizeof(float) * batch * HV * ng, cudaMemcpyHostToDevice));
            CU(cudaMemcpy(db, in.beta, sizeof(float) * batch * HV, cudaMemcpyHostToDevice));
        }
        if (bf16 || kernel_flags)
            SQ(stepq__cuda_step_dense_ex(&d, dS, stride, lay,
                                         bf16 ? STEPQ_DTYPE_BF16 : STEPQ_DTYPE_FP32, kernel_flags));
        else
            SQ(stepq__cuda_step_dense(&d, &dst));
        if (step_view && (t == steps - 1 || t == 0)) {
            CU(cudaMemcpy(o16, dw.o, 2 * w.n_o, cudaMemcpyDeviceToHost));
            if (compare_view_o(o16, w.o, &w, in.slots, batch, HV, what))
                return 1;
        } else if (t == steps - 1 || t == 0) {
            CU(cudaMemcpy(o_got, dout, sizeof(float) * batch * HV * D, cudaMemcpyDeviceToHost));
            for (int b = 0; b < batch; b++)
                if (in.slots[b] < 0)
                    memcpy(o_got + (size_t)b * HV * D, o_ref + (size_t)b * HV * D,
                           sizeof(float) * HV * D);
            double e = nmse(o_got, o_ref, (size_t)batch * HV * D);
            if (e > worst)
                worst = e;
        }
    }
    int rc = 0;
    if (bf16) {
        /*
         * bf16-stored states: the GPU and the reference round differently
         * computed fp32 values, and a tiny element produced by cancellation
         * may differ by several of its own ulps. Tolerance per element:
         * 2^-8 of the head's largest magnitude plus one ulp of the element.
         */
        CU(cudaMemcpy(S16, dS, 2 * stride * n_slots, cudaMemcpyDeviceToHost));
        size_t off = 0, head = (size_t)D * D;
        for (size_t h0 = 0; h0 < stride * n_slots && !rc; h0 += head) {
            double mx = 0;
            for (size_t e = h0; e < h0 + head; e++)
                mx = fmax(mx, fabs((double)S[e]));
            for (size_t e = h0; e < h0 + head; e++) {
                uint16_t rb = stepq__bf16_from_float(S[e]);
                double ga = stepq__bf16_to_float(S16[e]), gb = stepq__bf16_to_float(rb);
                double ulp = ldexp(1.0, ilogb(gb == 0 ? 1e-38 : gb) - 7);
                Sg[e] = (float)ga;
                off += S16[e] != rb;
                if (fabs(ga - gb) > ldexp(mx, -8) + ulp) {
                    printf("FAIL %s: element %zu: bf16 0x%04x vs 0x%04x (%g vs %g, head max %g)\n",
                           what, e, S16[e], rb, ga, gb, mx);
                    rc = 1;
                    break;
                }
            }
        }
        if (!rc && off > stride * n_slots / 100) {
            printf("FAIL %s: %zu bf16 elements differ (> 1%%)\n", what, off);
            rc = 1;
        }
    } else {
        CU(cudaMemcpy(Sg, dS, sizeof(float) * stride * n_slots, cudaMemcpyDeviceToHost));
    }
    double rel = sqrt(nmse(Sg, S, stride * n_slots));
    double lim_o = steps > 1 ? 1e-10 : 1e-10;
    if (rc == 0 && (rel > (bf16 ? 1e-2 : 1e-5) || worst > lim_o)) {
        printf("FAIL %s: state relative error %g (<= 1e-5), output NMSE %g\n", what, rel, worst);
        rc = 1;
    } else if (rc == 0) {
        printf("  %s: state relative error %.3g, output NMSE %.3g\n", what, rel, worst);
    }
    if (step_view) {
        view_dev_free(&dw);
        view_free(&w);
        free(o16);
    }
    cudaFree(dS);
    cudaFree(dslots);
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dg);
    cudaFree(db);
    cudaFree(dout);
    free(S);
    free(S16);
    free(Sg);
    inputs_free(&in);
    free(o_ref);
    free(o_got);
    return rc;
}

/* run_dense on a server's views (struct view), with the in-kernel gate. */
static int run_dense_view(stepq_arch arch, stepq__layout lay, int H, int HV, int batch, int steps,
                          int bf16)
{
    step_view = 1;
    int rc = run_dense(arch, lay, H, HV, batch, steps, bf16);
    step_view = 0;
    return rc;
}

static void report(const char *name, int rc)
{
    if (rc)
        n_fail++;
    else
        n_pass++;
    printf("%s %s\n", rc ? "FAIL" : "ok  ", name);
}

/* The call's status is `want` and the message names the entry `who`. */
#define BAD(call, want, who)                                                                     \
    do {                                                                                         \
        int rc_ = (call);                                                                        \
        CHECK(rc_ == (want), "%s returned %d (%s), expected %d", #call, rc_, stepq_last_error(), \
              (int)(want));                                                                      \
        CHECK(strstr(stepq_last_error(), (who)) != NULL, "%s: message '%s' does not name %s",    \
              #call, stepq_last_error(), (who));                                                 \
        n_bad++;                                                                                 \
    } while (0)

/*
 * Invalid arguments to every CUDA entry: the documented status, a message
 * naming the entry, no sticky CUDA error, and the device pages byte for
 * byte as they were; then a valid pack still works.
 */
static int run_bad_args(void)
{
    enum { HV = 2, H = 1, B = 4, NS = B + 2 };
    static const char step[] = "cuda step (packed)", pack[] = "cuda pack", unpack[] = "cuda unpack",
                      dense[] = "cuda step (dense)";
    int n_bad = 0;
    struct layer L, L3;
    if (make_layer(&L, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, HV, NS, 6) ||
        make_layer(&L3, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 3, NS, 6))
        return 1;
    uint8_t *pages = malloc(L.bytes), *got = malloc(L.bytes);
    CHECK(pages && got, "oom");
    if (fill_pages(&L, pages, 0.3f))
        return 1;
    const size_t nd = (size_t)B * HV * D * D, nq = (size_t)B * H * D, nv = (size_t)B * HV * D;
    float *zeros = calloc(nd, sizeof(float));
    int32_t hs[B] = { 3, 0, -1, 5 };
    CHECK(zeros, "oom");
    uint8_t *dp = dup_dev(pages, L.bytes);
    float *dq = dup_dev(zeros, 4 * nq), *dk = dup_dev(zeros, 4 * nq), *dv = dup_dev(zeros, 4 * nv);
    float *dg = dup_dev(zeros, 4 * (size_t)B * HV), *db = dup_dev(zeros, 4 * (size_t)B * HV);
    float *dout = dup_dev(zeros, 4 * nv), *ddense = dup_dev(zeros, 4 * nd);
    int32_t *dslots = dup_dev(hs, sizeof(hs));
    CHECK(dp && dq && dk && dv && dg && db && dout && ddense && dslots, "device allocation");

    struct stepq__packed_layer dpl = L.pl, mis = L.pl, dpl3 = L3.pl;
    dpl.base = dp;
    mis.base = dp + 8; /* not 16-byte aligned */
    dpl3.base = dp;
    stepq__cuda_layer *cl = NULL, *cl3 = NULL;
    SQ(stepq__cuda_layer_prepare(&dpl, &cl));
    SQ(stepq__cuda_layer_prepare(&dpl3, &cl3));

    const struct stepq__step_args a =
        step_args(STEPQ_ARCH_GDN, B, H, HV, NS, dslots, dq, dk, dv, dg, db, dout);
    struct stepq__step_args x;

    /* fused packed step */
    x = a, x.d_k = x.d_v = 64;
    BAD(stepq__cuda_step_packed_prepared(&x, &dpl, cl, STEPQ__CUDA_FUSED), STEPQ_ENOTSUP, step);
    x = a, x.batch = 70000;
    BAD(stepq__cuda_step_packed_prepared(&x, &dpl, cl, STEPQ__CUDA_FUSED), STEPQ_EINVAL, step);
    x = a, x.slots = NULL;
    BAD(stepq__cuda_step_packed_prepared(&x, &dpl, cl, STEPQ__CUDA_FUSED), STEPQ_EINVAL, step);
    x = a, x.q = NULL;
    BAD(stepq__cuda_step_packed_prepared(&x, &dpl, cl, STEPQ__CUDA_FUSED), STEPQ_EINVAL, step);
    x = a, x.HV = 4;
    BAD(stepq__cuda_step_packed_prepared(&x, &dpl, cl, STEPQ__CUDA_FUSED), STEPQ_EINVAL, step);
    x = a, x.opt.gate_in_kernel = 1; /* without A_log, dt_bias */
    BAD(stepq__cuda_step_packed_prepared(&x, &dpl, cl, STEPQ__CUDA_FUSED), STEPQ_EINVAL, step);
    BAD(stepq__cuda_step_packed_prepared(&a, &mis, cl, STEPQ__CUDA_FUSED), STEPQ_EINVAL, step);
    BAD(stepq__cuda_step_packed_prepared(&a, &dpl, cl3, STEPQ__CUDA_FUSED), STEPQ_EINVAL, step);
    BAD(stepq__cuda_step_packed_prepared(&a, &dpl, NULL, STEPQ__CUDA_TWO_STAGE), STEPQ_EINVAL,
        step);
    BAD(stepq__cuda_step_packed_prepared(&a, &dpl, cl, (stepq__cuda_variant)7), STEPQ_EINVAL, step);

    /* pack and unpack (prefill hooks) */
    const size_t stride = (size_t)HV * D * D;
    BAD(stepq__cuda_pack_prepared(&dpl, cl, -1, dslots, ddense, stride, STEPQ__LAYOUT_KV,
                                  STEPQ_DTYPE_FP32, NULL, NULL, NULL),
        STEPQ_EINVAL, pack);
    BAD(stepq__cuda_pack_prepared(&dpl, cl, 70000, dslots, ddense, stride, STEPQ__LAYOUT_KV,
                                  STEPQ_DTYPE_FP32, NULL, NULL, NULL),
        STEPQ_EINVAL, pack);
    BAD(stepq__cuda_pack_prepared(&dpl, cl, B, dslots, ddense, stride - 1, STEPQ__LAYOUT_VK,
                                  STEPQ_DTYPE_BF16, NULL, NULL, NULL),
        STEPQ_EINVAL, pack);
    BAD(stepq__cuda_pack_prepared(&dpl, cl, B, NULL, ddense, stride, STEPQ__LAYOUT_KV,
                                  STEPQ_DTYPE_FP32, NULL, NULL, NULL),
        STEPQ_EINVAL, pack);
    BAD(stepq__cuda_pack_prepared(&dpl, cl, B, dslots, NULL, stride, STEPQ__LAYOUT_KV,
                                  STEPQ_DTYPE_FP32, NULL, NULL, NULL),
        STEPQ_EINVAL, pack);
    BAD(stepq__cuda_pack_prepared(&mis, cl, B, dslots, ddense, stride, STEPQ__LAYOUT_KV,
                                  STEPQ_DTYPE_FP32, NULL, NULL, NULL),
        STEPQ_EINVAL, pack);
    BAD(stepq__cuda_pack_prepared(&dpl, cl3, B, dslots, ddense, stride, STEPQ__LAYOUT_KV,
                                  STEPQ_DTYPE_FP32, NULL, NULL, NULL),
        STEPQ_EINVAL, pack);
    BAD(stepq__cuda_unpack_prepared(&dpl, cl, B, dslots, ddense, stride - 64, STEPQ__LAYOUT_KV,
                                    STEPQ_DTYPE_FP32, NULL),
        STEPQ_EINVAL, unpack);
    BAD(stepq__cuda_unpack_prepared(&mis, cl, B, dslots, ddense, stride, STEPQ__LAYOUT_VK,
                                    STEPQ_DTYPE_BF16, NULL),
        STEPQ_EINVAL, unpack);
    BAD(stepq__cuda_unpack_prepared(&dpl, cl, B, dslots, NULL, stride, STEPQ__LAYOUT_KV,
                                    STEPQ_DTYPE_FP32, NULL),
        STEPQ_EINVAL, unpack);

    /* dense fp32 step on the same states */
    x = a, x.n_slots = 0;
    BAD(stepq__cuda_step_dense_ex(&x, ddense, stride, STEPQ__LAYOUT_KV, STEPQ_DTYPE_FP32, 0),
        STEPQ_EINVAL, dense);
    x = a, x.d_k = 64;
    BAD(stepq__cuda_step_dense_ex(&x, ddense, stride, STEPQ__LAYOUT_KV, STEPQ_DTYPE_FP32, 0),
        STEPQ_ENOTSUP, dense);
    BAD(stepq__cuda_step_dense_ex(&a, ddense, stride / 2, STEPQ__LAYOUT_KV, STEPQ_DTYPE_FP32, 0),
        STEPQ_EINVAL, dense);
    BAD(stepq__cuda_step_dense_ex(&a, ddense, stride, STEPQ__LAYOUT_KV, STEPQ_DTYPE_FP32, 2),
        STEPQ_EINVAL, dense);

    /* a kernel choice other than STEPQ__CUDA_COLUMN leaves no handle */
    stepq__cuda_layer *bad = cl;
    BAD(stepq__cuda_layer_prepare_ex(&dpl, ~STEPQ__CUDA_COLUMN, &bad), STEPQ_EINVAL,
        "cuda layer prepare");
    CHECK(bad == NULL, "a rejected prepare left a handle");

    CU(cudaDeviceSynchronize());
    CU(cudaGetLastError()); /* nothing sticky */
    CU(cudaMemcpy(got, dp, L.bytes, cudaMemcpyDeviceToHost));
    CHECK(!memcmp(got, pages, L.bytes), "a rejected call changed the pages");
    /*
     * A valid call still works. Slot ids out of range live on the device, so
     * the kernels skip them like -1 (cuda.h): only slot 3's page may change.
     */
    const int32_t hs2[B] = { NS, 3, -7, 1 << 30 };
    CU(cudaMemcpy(dslots, hs2, sizeof(hs2), cudaMemcpyHostToDevice));
    SQ(stepq__cuda_pack_prepared(&dpl, cl, B, dslots, ddense, stride, STEPQ__LAYOUT_KV,
                                 STEPQ_DTYPE_FP32, NULL, NULL, NULL));
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(got, dp, L.bytes, cudaMemcpyDeviceToHost));
    const size_t ps = L.pl.page_stride;
    CHECK(!memcmp(got, pages, 3 * ps) && !memcmp(got + 4 * ps, pages + 4 * ps, L.bytes - 4 * ps),
          "a pack with out-of-range slot ids wrote outside slot 3's page");
    CHECK(memcmp(got + 3 * ps, pages + 3 * ps, ps), "the pack did not write slot 3's page");
    printf("  %d invalid calls rejected with their status and entry name, pages unchanged; slot ids"
           " %d, -7 and 2^30 skipped\n",
           n_bad, NS);

    stepq__cuda_layer_release(cl);
    stepq__cuda_layer_release(cl3);
    void *dev[] = { dp, dq, dk, dv, dg, db, dout, ddense, dslots };
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
        cudaFree(dev[i]);
    free(pages);
    free(got);
    free(zeros);
    free_layer(&L);
    free_layer(&L3);
    return 0;
}

#define RUN(name, call) report(name, (call))
/* A check left out under SANITIZE=1 when `skip` (the sanitizers see each kernel once or twice). */
#define RUN_FULL(skip, name, call) \
    do {                           \
        if (!(small && (skip)))    \
            RUN(name, call);       \
    } while (0)

int main(void)
{
    int ndev = stepq__cuda_device_count();
    if (ndev < 1) {
        printf("SKIP: no CUDA device (cudaGetDeviceCount found none)\n");
        return 77;
    }
    small = getenv("SANITIZE") && atoi(getenv("SANITIZE")) > 0;
    int B = small ? 3 : 12;
    char name[96];

    /* GDN with GVA (HV = 2H), every method and bit width. */
    static const int widths[] = { 2, 3, 4, 5, 6, 8 };
    for (int m = 0; m < STEPQ_METHOD_COUNT; m++) {
        if (m <= STEPQ_METHOD_FP16) {
            snprintf(name, sizeof(name), "gdn step method %d", m);
            RUN(name, run_step((stepq_method)m, STEPQ_ARCH_GDN, 0, 2, 4, B, 0, 0, 0));
            continue;
        }
        for (int w = 0; w < 6; w++) {
            if (small && w != 4)
                continue;
            snprintf(name, sizeof(name), "gdn step method %d @%d", m, widths[w]);
            RUN(name, run_step((stepq_method)m, STEPQ_ARCH_GDN, widths[w], 2, 4, B, w & 1, 0, 0));
        }
        if (m == STEPQ_METHOD_TEMPORAL || m == STEPQ_METHOD_STEPQ) {
            snprintf(name, sizeof(name), "gdn step method %d mixed + pivot head", m);
            RUN(name, run_step((stepq_method)m, STEPQ_ARCH_GDN, 0, 2, 4, B, 1, 0, 0));
        }
    }
    /* KDA: per-row bits with pivots, one shared column-scale vector per head. */
    RUN("kda step stepq mixed rows",
        run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 2, 2, B, 0, 0, 0));
    RUN("kda step temporal mixed rows",
        run_step(STEPQ_METHOD_TEMPORAL, STEPQ_ARCH_KDA, 0, 2, 2, B, 1, 0, 0));
    RUN("kda step uniform @4", run_step(STEPQ_METHOD_UNIFORM, STEPQ_ARCH_KDA, 4, 2, 2, B, 0, 0, 0));
    RUN("kda step dsq @5", run_step(STEPQ_METHOD_DSQ, STEPQ_ARCH_KDA, 5, 1, 2, B, 1, 0, 0));
    RUN("kda step fp32", run_step(STEPQ_METHOD_FP32, STEPQ_ARCH_KDA, 0, 2, 2, B, 1, 0, 0));
    /* non-finite inputs leave the head untouched; several batches; two-stage */
    RUN("gdn step non-finite input",
        run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 0, 2, 4, B, 0, 1, 0));
    RUN("kda step non-finite input",
        run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 2, 2, B, 1, 1, 0));
    RUN("gdn step batch 1", run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 6, 2, 4, 1, 0, 0, 0));
    RUN_FULL(1, "gdn step batch 40",
             run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 0, 4, 8, 40, 1, 0, 0));
    RUN_FULL(1, "kda step batch 40",
             run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 4, 8, 40, 1, 0, 0));
    RUN("gdn step two-stage", run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 0, 2, 4, B, 0, 1, 1));
    RUN("kda step two-stage", run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 2, 2, B, 1, 0, 1));
    /* the inputs as a server hands them: bf16 views of a fused projection, padded rows */
    RUN("gdn step bf16 strided inputs, gate",
        run_step_view(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 0, 2, 4, B, 1, 0, 0));
    RUN("gdn step bf16 strided inputs @6",
        run_step_view(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 6, 2, 4, B, 0, 0, 0));
    RUN("kda step bf16 strided inputs, gate, non-finite input",
        run_step_view(STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 2, 2, B, 1, 1, 0));
    RUN("kda step bf16 strided inputs",
        run_step_view(STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 2, 2, B, 0, 0, 0));
    RUN("gdn step fp32 pages bf16 strided inputs, gate",
        run_step_view(STEPQ_METHOD_FP32, STEPQ_ARCH_GDN, 0, 2, 4, B, 1, 0, 0));
    RUN("kda step two-stage bf16 strided inputs, gate",
        run_step_view(STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 2, 2, B, 1, 0, 1));

    /* pack / unpack, both layouts, fp32 and bf16 sources */
    for (int lay = 0; lay < 2; lay++)
        for (int dt = 0; dt < 2; dt++) {
            snprintf(name, sizeof(name), "pack/unpack gdn stepq layout %d dtype %d", lay, dt);
            RUN(name, run_pack(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 0, 4, 4, (stepq__layout)lay,
                               (stepq_dtype)dt));
            snprintf(name, sizeof(name), "pack/unpack kda stepq layout %d dtype %d", lay, dt);
            RUN(name, run_pack(STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 2, 4, (stepq__layout)lay,
                               (stepq_dtype)dt));
        }
    /* each templated width, stepq (column scales) and uniform (none) */
    for (int w = 0; w < 6; w++) {
        snprintf(name, sizeof(name), "pack/unpack gdn stepq @%d", widths[w]);
        RUN_FULL(1, name,
                 run_pack(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, widths[w], 2, 3,
                          (stepq__layout)(w & 1), (stepq_dtype)(w >> 1 & 1)));
        snprintf(name, sizeof(name), "pack/unpack gdn uniform @%d", widths[w]);
        RUN_FULL(widths[w] != 6, name,
                 run_pack(STEPQ_METHOD_UNIFORM, STEPQ_ARCH_GDN, widths[w], 2, 3,
                          (stepq__layout) !(w & 1), (stepq_dtype)(w >> 1 & 1)));
    }
    RUN_FULL(1, "pack/unpack kda temporal mixed rows",
             run_pack(STEPQ_METHOD_TEMPORAL, STEPQ_ARCH_KDA, 0, 2, 3, STEPQ__LAYOUT_VK,
                      STEPQ_DTYPE_BF16));
    /* an fp32 layer: the column kernel */
    RUN("pack/unpack gdn fp32",
        run_pack(STEPQ_METHOD_FP32, STEPQ_ARCH_GDN, 0, 2, 3, STEPQ__LAYOUT_KV, STEPQ_DTYPE_FP32));

    /*
     * The thread-per-column kernels (kept for dense pages, two-stage stage 1
     * and comparison), chosen per handle and per dense call.
     */
    kernel_flags = STEPQ__CUDA_COLUMN;
    RUN("legacy gdn step stepq mixed + pivot head",
        run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 0, 2, 4, B, 1, 0, 0));
    RUN("legacy kda step stepq mixed rows",
        run_step(STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 2, 2, B, 0, 0, 0));
    RUN("legacy pack/unpack gdn stepq",
        run_pack(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 0, 4, 4, STEPQ__LAYOUT_VK, STEPQ_DTYPE_FP32));
    RUN("legacy pack/unpack gdn stepq bf16 [K,V]",
        run_pack(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 0, 4, 4, STEPQ__LAYOUT_KV, STEPQ_DTYPE_BF16));
    RUN("legacy dense bf16 gdn 1 step [K,V]",
        run_dense(STEPQ_ARCH_GDN, STEPQ__LAYOUT_KV, 2, 4, B, 1, 1));
    RUN("legacy gdn step bf16 strided inputs, gate",
        run_step_view(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 0, 2, 4, B, 1, 0, 0));
    kernel_flags = 0;

    RUN("invalid arguments: status, message, pages unchanged", run_bad_args());

    /* saturating scales take the clamped quantizer */
    RUN("gdn step stepq @6 huge state",
        run_step_amp(STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 6, 2, 4, B, 1e9f));
    RUN("gdn step uniform @4 huge state",
        run_step_amp(STEPQ_METHOD_UNIFORM, STEPQ_ARCH_GDN, 4, 2, 4, B, 1e9f));

    /* dense fp32 recurrence: one step, and 1024 steps (<= 1e-5 relative) */
    RUN("dense gdn 1 step [K,V]", run_dense(STEPQ_ARCH_GDN, STEPQ__LAYOUT_KV, 2, 4, B, 1, 0));
    RUN("dense kda 1 step [V,K]", run_dense(STEPQ_ARCH_KDA, STEPQ__LAYOUT_VK, 2, 2, B, 1, 0));
    RUN("dense bf16 gdn 1 step [V,K]", run_dense(STEPQ_ARCH_GDN, STEPQ__LAYOUT_VK, 2, 4, B, 1, 1));
    RUN("dense bf16 kda 1 step [K,V]", run_dense(STEPQ_ARCH_KDA, STEPQ__LAYOUT_KV, 2, 2, B, 1, 1));
    RUN("dense gdn bf16 strided inputs, gate, 4 steps [V,K]",
        run_dense_view(STEPQ_ARCH_GDN, STEPQ__LAYOUT_VK, 2, 4, B, 4, 0));
    RUN("dense kda bf16 strided inputs, gate, 4 steps [K,V]",
        run_dense_view(STEPQ_ARCH_KDA, STEPQ__LAYOUT_KV, 2, 2, B, 4, 0));
    RUN("dense bf16 states gdn bf16 strided inputs, gate [K,V]",
        run_dense_view(STEPQ_ARCH_GDN, STEPQ__LAYOUT_KV, 2, 4, B, 1, 1));
    int T = small ? 16 : 1024;
    RUN("dense gdn 1024 steps", run_dense(STEPQ_ARCH_GDN, STEPQ__LAYOUT_VK, 1, 2, 2, T, 0));
    RUN("dense kda 1024 steps", run_dense(STEPQ_ARCH_KDA, STEPQ__LAYOUT_KV, 1, 1, 2, T, 0));

    printf("\n%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
