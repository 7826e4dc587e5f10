/*
 * stepq bench kernels [--json FILE] [--quick]: one decode step of one layer
 * on the GPU, timed with CUDA events (3 warm-up launches, median of 20),
 * for the Qwen3-Next-80B-A3B (GDN, 32 value heads over 16 q/k heads) and
 * Kimi-Linear-48B (KDA, 32 heads) layer shapes at TP1.
 *
 * Bytes moved = state bytes read + written (packed pages incl. alignment, or
 * the dense state; the two-stage rows add their fp32 scratch write + read)
 * + q/k/v/g/beta read + o written. The device copy bandwidth is measured in
 * the same run (cudaMemcpy device-to-device of 1 GiB, read + write counted).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepq_config.h"
#include "tools/commands.h"

#if STEPQ_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda.h"
#include "kernels/dsp.h"
#include "kernels/format.h"
#include "stepq/stepq.h"

#define D      128
#define WARMUP 3
#define RUNS   20
#define MAX_B  512

/* Quoted from issue 5 (fla fused_recurrent_gated_delta_rule, fp32 state, same H200): NOT measured
 * here. */
static const int peer_b[] = { 1, 8, 32, 64, 128, 256, 512 };
static const double peer_us_gdn[] = { 82, 75, 113, 158, 245, 431, 797 };

static uint64_t rng = 88172645463325252ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((int64_t)(rng >> 40) - (1 << 23)) / (float)(1 << 23);
}

static int cu_ok(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return 1;
    fprintf(stderr, "stepq bench kernels: %s: %s\n", what, cudaGetErrorString(e));
    cudaGetLastError();
    return 0;
}

/* Fills n bytes of device memory with random floats in [-scale, scale) from a 16 MiB pattern. */
static int fill_random(void *dev, size_t n, float scale)
{
    static float *pat;
    static const size_t pat_n = 4u << 20;
    if (!pat) {
        pat = malloc(pat_n * sizeof(float));
        if (!pat)
            return 0;
    }
    for (size_t i = 0; i < pat_n; i++)
        pat[i] = scale * frand();
    for (size_t off = 0; off < n; off += pat_n * sizeof(float)) {
        size_t len = n - off < pat_n * sizeof(float) ? n - off : pat_n * sizeof(float);
        if (!cu_ok(cudaMemcpy((char *)dev + off, pat, len, cudaMemcpyHostToDevice), "fill"))
            return 0;
    }
    return 1;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* A launcher for one configuration. */
enum kind {
    K_DENSE_F32,
    K_DENSE_BF16,
    K_PACKED,
    K_PACKED_2S,
    K_PACK,
    K_UNPACK,
    K_UNPACK_BF16, /* bf16 [K,V] */
    K_UNPACK_VK,   /* fp32 [V,K] */
};

struct ctx {
    struct stepq__step_args a;
    struct stepq__packed_layer pl;
    stepq__cuda_layer *L;
    void *dense;
    enum kind kind;
    cudaStream_t s;
};

static int launch(struct ctx *c)
{
    switch (c->kind) {
    case K_DENSE_F32:
        return stepq__cuda_step_dense_ex(&c->a, c->dense, (size_t)c->a.HV * D * D, STEPQ__LAYOUT_KV,
                                         STEPQ__DTYPE_F32);
    case K_DENSE_BF16:
        return stepq__cuda_step_dense_ex(&c->a, c->dense, (size_t)c->a.HV * D * D, STEPQ__LAYOUT_KV,
                                         STEPQ__DTYPE_BF16);
    case K_PACKED:
        return stepq__cuda_step_packed_prepared(&c->a, &c->pl, c->L, STEPQ__CUDA_FUSED);
    case K_PACKED_2S:
        return stepq__cuda_step_packed_prepared(&c->a, &c->pl, c->L, STEPQ__CUDA_TWO_STAGE);
    case K_PACK:
        return stepq__cuda_pack_prepared(&c->pl, c->L, c->a.batch, c->a.slots, c->dense,
                                         (size_t)c->a.HV * D * D, STEPQ__LAYOUT_KV,
                                         STEPQ__DTYPE_F32, NULL, NULL, c->s);
    case K_UNPACK:
        return stepq__cuda_unpack_prepared(&c->pl, c->L, c->a.batch, c->a.slots, c->dense,
                                           (size_t)c->a.HV * D * D, STEPQ__LAYOUT_KV,
                                           STEPQ__DTYPE_F32, c->s);
    case K_UNPACK_BF16:
        return stepq__cuda_unpack_prepared(&c->pl, c->L, c->a.batch, c->a.slots, c->dense,
                                           (size_t)c->a.HV * D * D, STEPQ__LAYOUT_KV,
                                           STEPQ__DTYPE_BF16, c->s);
    case K_UNPACK_VK:
        return stepq__cuda_unpack_prepared(&c->pl, c->L, c->a.batch, c->a.slots, c->dense,
                                           (size_t)c->a.HV * D * D, STEPQ__LAYOUT_VK,
                                           STEPQ__DTYPE_F32, c->s);
    }
    return STEPQ_EINVAL;
}

/* Median microseconds of one launch, or < 0 on error. */
static double time_us(struct ctx *c, cudaEvent_t e0, cudaEvent_t e1)
{
    float t[RUNS];
    for (int r = 0; r < WARMUP; r++)
        if (launch(c) < 0) {
            fprintf(stderr, "stepq bench kernels: %s\n", stepq_last_error());
            return -1;
        }
    for (int r = 0; r < RUNS; r++) {
        cudaEventRecord(e0, c->s);
        if (launch(c) < 0) {
            fprintf(stderr, "stepq bench kernels: %s\n", stepq_last_error());
            return -1;
        }
        cudaEventRecord(e1, c->s);
        if (!cu_ok(cudaEventSynchronize(e1), "event"))
            return -1;
        cudaEventElapsedTime(&t[r], e0, e1);
    }
    qsort(t, RUNS, sizeof(float), cmp_float);
    return 1000.0 * 0.5 * (t[RUNS / 2 - 1] + t[RUNS / 2]);
}

/* Synthetic per-unit widths at a budget: counts per width, then shuffled. */
static void make_bits(uint8_t *out, int n, const int *w, const int *cnt, int nw)
{
    int k = 0;
    for (int i = 0; i < nw; i++)
        for (int c = 0; c < cnt[i]; c++)
            out[k++] = (uint8_t)w[i];
    for (int i = n - 1; i > 0; i--) {
        int r = (int)((rng = rng * 6364136223846793005ull + 1) >> 33) % (i + 1);
        uint8_t t = out[i];
        out[i] = out[r];
        out[r] = t;
    }
}

struct method {
    const char *name;
    stepq_method m;
    int budget; /* 0 dense */
};

static const struct method methods[] = {
    { "fp32", STEPQ_METHOD_FP32, 0 },         { "bf16", STEPQ_METHOD_BF16, 0 },
    { "uniform@6", STEPQ_METHOD_UNIFORM, 6 }, { "stepq@4", STEPQ_METHOD_STEPQ, 4 },
    { "stepq@6", STEPQ_METHOD_STEPQ, 6 },
};

/*
 * Per-head (GDN) or per-row (KDA) widths: one pivot head per GDN layer (1.39%
 * of 32 heads rounds to 0.44: one is the conservative choice), one pivot row
 * per KDA head (0.625% of 128 rows), and a {4,6,8} (@6) or {2..8} (@4) mix at
 * exactly the budget sum(b) = bbar*N - 8*N_piv.
 */
static int layouts(struct stepq_head_layout *hl, const struct method *me, stepq_arch arch, int HV)
{
    uint8_t rb[32][D];
    if (me->budget == 0) {
        for (int h = 0; h < HV; h++)
            if (stepq__head_layout_init(&hl[h], me->m, arch, D, D, NULL, 16) < 0)
                return -1;
        return 0;
    }
    for (int h = 0; h < HV; h++)
        memset(rb[h], me->budget, D);
    if (me->m == STEPQ_METHOD_STEPQ) {
        if (arch == STEPQ_ARCH_GDN) {
            static const int w6[] = { 8, 4, 6 }, c6[] = { 7, 8, 16 };
            static const int w4[] = { 8, 6, 4, 3, 2 }, c4[] = { 3, 4, 8, 8, 8 };
            uint8_t hb[32];
            hb[0] = STEPQ_BITS_PIVOT;
            if (me->budget == 6)
                make_bits(hb + 1, 31, w6, c6, 3);
            else
                make_bits(hb + 1, 31, w4, c4, 5);
            for (int h = 0; h < HV; h++)
                memset(rb[h], hb[h % 32], D);
        } else {
            static const int w6[] = { 8, 4, 6 }, c6[] = { 29, 30, 68 };
            static const int w4[] = { 8, 6, 4, 3, 2 }, c4[] = { 10, 20, 40, 30, 27 };
            for (int h = 0; h < HV; h++) {
                rb[h][0] = STEPQ_BITS_PIVOT;
                if (me->budget == 6)
                    make_bits(rb[h] + 1, 127, w6, c6, 3);
                else
                    make_bits(rb[h] + 1, 127, w4, c4, 5);
            }
        }
    }
    for (int h = 0; h < HV; h++)
        if (stepq__head_layout_init(&hl[h], me->m, arch, D, D, rb[h], 16) < 0)
            return -1;
    return 0;
}

/*
 * Rows of the prepared variants (stepq__cuda_set_tile_variant; kernels/cuda/README.md,
 * "Prepared variants"), after the shipped rows. A row with vbits 0 is the shipped kernel's
 * row for a configuration the shipped rows do not cover; labels end in the variant's tag.
 */
struct vrow {
    const char *label;
    int method; /* index into methods[] */
    enum kind kind;
    int vbits;
};

static const struct vrow vrows[] = {
    { "stepq@6 unpack (u)", 4, K_UNPACK, STEPQ__CUDA_TILE_UNPACK },
    { "stepq@6 unpack bf16", 4, K_UNPACK_BF16, 0 },
    { "stepq@6 unpack bf16 (u)", 4, K_UNPACK_BF16, STEPQ__CUDA_TILE_UNPACK },
    { "stepq@6 unpack [V,K]", 4, K_UNPACK_VK, 0 },
    { "stepq@6 unpack [V,K] (u)", 4, K_UNPACK_VK, STEPQ__CUDA_TILE_UNPACK },
    { "stepq@6 (rc)", 4, K_PACKED, STEPQ__CUDA_TILE_ROWC },
    { "stepq@4 (rc)", 3, K_PACKED, STEPQ__CUDA_TILE_ROWC },
    { "stepq@6 pack (rc)", 4, K_PACK, STEPQ__CUDA_TILE_ROWC },
    { "uniform@6 (s)", 2, K_PACKED, STEPQ__CUDA_TILE_SPREAD },
    { "stepq@6 (s)", 4, K_PACKED, STEPQ__CUDA_TILE_SPREAD },
    { "stepq@6 pack (s)", 4, K_PACK, STEPQ__CUDA_TILE_SPREAD },
    { "stepq@6 (rc+s)", 4, K_PACKED, STEPQ__CUDA_TILE_ROWC | STEPQ__CUDA_TILE_SPREAD },
    { "stepq@4 (rc+s)", 3, K_PACKED, STEPQ__CUDA_TILE_ROWC | STEPQ__CUDA_TILE_SPREAD },
    { "stepq@6 pack (rc+s)", 4, K_PACK, STEPQ__CUDA_TILE_ROWC | STEPQ__CUDA_TILE_SPREAD },
};
#define N_VROWS ((int)(sizeof(vrows) / sizeof(vrows[0])))

static int usage(FILE *f)
{
    fprintf(f, "usage: stepq bench kernels [--json FILE] [--quick] [--only LABEL] [--batch B]\n"
               "                           [--shape gdn|kda]\n"
               "  Times the CUDA decode step, pack and unpack of one layer (Qwen3-Next GDN,\n"
               "  Kimi-Linear KDA) at batch 1..512 and prints us, bytes, GB/s, the fraction of\n"
               "  the device copy bandwidth measured in the same run and the speedup vs fp32.\n"
               "  --quick: batches 1, 64 and 512 only. --only: one row label (e.g. 'stepq@6',\n"
               "  'stepq@6 pack', 'fp32 (old)'); --batch, --shape: one batch / one layer shape\n"
               "  (for profilers). Rows marked (old) run the thread-per-column kernels; rows\n"
               "  ending in (u), (rc), (s) run prepared variants (set_tile_variant:\n"
               "  u = unpack kernel, rc = per-row constants of the run-time-width path: KDA only,\n"
               "  GDN layers have uniform-width heads and run the shipped kernel; s = per-column\n"
               "  phases on all 256 threads), next to shipped rows of the same configuration.\n");
    return f == stdout ? 0 : 2;
}

int stepq_tool_bench_kernels(int argc, char **argv)
{
    const char *json = NULL;
    const char *only = NULL;
    int quick = 0, only_b = 0, only_shape = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc)
            json = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc)
            only_b = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc)
            only_shape = !strcmp(argv[++i], "kda");
        else if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return usage(stdout);
        else
            return usage(stderr);
    }
    if (stepq__cuda_device_count() < 1) {
        fprintf(stderr, "stepq bench kernels: no CUDA device available; nothing measured\n");
        return 1;
    }
    struct cudaDeviceProp prop;
    if (!cu_ok(cudaGetDeviceProperties(&prop, 0), "device properties"))
        return 1;

    /* Copy bandwidth of this device, now. */
    size_t cb = (size_t)1 << 30;
    void *c0 = NULL, *c1 = NULL;
    cudaEvent_t e0, e1;
    cudaStream_t s = NULL;
    if (!cu_ok(cudaMalloc(&c0, cb), "malloc") || !cu_ok(cudaMalloc(&c1, cb), "malloc") ||
        !cu_ok(cudaEventCreate(&e0), "event") || !cu_ok(cudaEventCreate(&e1), "event"))
        return 1;
    float ct[RUNS];
    for (int r = 0; r < WARMUP + RUNS; r++) {
        cudaEventRecord(e0, s);
        cudaMemcpyAsync(c1, c0, cb, cudaMemcpyDeviceToDevice, s);
        cudaEventRecord(e1, s);
        if (!cu_ok(cudaEventSynchronize(e1), "copy"))
            return 1;
        if (r >= WARMUP)
            cudaEventElapsedTime(&ct[r - WARMUP], e0, e1);
    }
    qsort(ct, RUNS, sizeof(float), cmp_float);
    double copy_gbs = 2.0 * (double)cb / (0.5e-3 * (ct[RUNS / 2 - 1] + ct[RUNS / 2])) / 1e9;
    cudaFree(c0);
    cudaFree(c1);
    printf("device: %s, %d SMs; copy bandwidth (D2D, read+write) %.0f GB/s\n", prop.name,
           prop.multiProcessorCount, copy_gbs);
    printf("timing: CUDA events, %d warm-up, median of %d; one layer, one token per request\n\n",
           WARMUP, RUNS);

    FILE *jf = NULL;
    if (json) {
        jf = fopen(json, "w");
        if (!jf) {
            fprintf(stderr, "stepq bench kernels: cannot write %s\n", json);
            return 1;
        }
        fprintf(jf, "{\"device\": \"%s\", \"copy_gbs\": %.1f, \"runs\": %d, \"rows\": [", prop.name,
                copy_gbs, RUNS);
    }
    int first_row = 1, rc = 0;

    /* Device buffers sized for the largest batch. */
    /* dense states are indexed by slot id (1..MAX_B) */
    size_t state_bytes = (size_t)(MAX_B + 1) * 32 * D * D * sizeof(float);
    void *dstate = NULL, *pages = NULL;
    float *q, *k, *v, *g, *beta, *A_log, *dt_bias, *o;
    int32_t *dslots;
    size_t page_max = (size_t)(MAX_B + 1) * 32 * (2 * D * D + 1024);
    int ok = cu_ok(cudaMalloc(&dstate, state_bytes), "malloc states") &&
             cu_ok(cudaMalloc(&pages, page_max), "malloc pages") &&
             cu_ok(cudaMalloc((void **)&q, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&k, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&v, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&g, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&beta, MAX_B * 32 * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&A_log, 32 * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&dt_bias, 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&o, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&dslots, MAX_B * 4), "malloc");
    if (!ok || !fill_random(dstate, state_bytes, 0.05f) || !fill_random(q, MAX_B * 32 * D * 4, 1) ||
        !fill_random(k, MAX_B * 32 * D * 4, 1) || !fill_random(v, MAX_B * 32 * D * 4, 1) ||
        !fill_random(g, MAX_B * 32 * D * 4, 1) || !fill_random(beta, MAX_B * 32 * 4, 1) ||
        !fill_random(A_log, 32 * 4, 0.5f) || !fill_random(dt_bias, 32 * D * 4, 0.5f))
        return 1;
    {
        /* slots 1..B, shuffled (0 is the sentinel page) */
        int32_t hs[MAX_B];
        for (int i = 0; i < MAX_B; i++)
            hs[i] = i + 1;
        for (int i = MAX_B - 1; i > 0; i--) {
            int r = (int)((rng = rng * 6364136223846793005ull + 1) >> 33) % (i + 1);
            int32_t t = hs[i];
            hs[i] = hs[r];
            hs[r] = t;
        }
        if (!cu_ok(cudaMemcpy(dslots, hs, sizeof(hs), cudaMemcpyHostToDevice), "slots"))
            return 1;
    }

    static const char *shape_name[] = { "Qwen3-Next-80B-A3B (GDN, HV=32, H=16)",
                                        "Kimi-Linear-48B (KDA, HV=32, H=32)" };
    static const int batches[] = { 1, 8, 32, 64, 128, 256, 512 };
    for (int shape = 0; shape < 2 && rc == 0; shape++) {
        if (only_shape >= 0 && shape != only_shape)
            continue;
        stepq_arch arch = shape ? STEPQ_ARCH_KDA : STEPQ_ARCH_GDN;
        int H = shape ? 32 : 16, HV = 32, ng = shape ? D : 1;
        printf("%s\n", shape_name[shape]);
        printf("%-24s %5s %10s %12s %9s %7s %8s %12s\n", "method", "B", "us", "bytes", "GB/s",
               "copy%", "vs fp32", "peer us (q)");
        for (int bi = 0; bi < 7 && rc == 0; bi++) {
            int B = batches[bi];
            if (quick && B != 1 && B != 64 && B != 512)
                continue;
            if (only_b && B != only_b)
                continue;
            double fp32_us = 0;
            size_t io_bytes = (size_t)B * (2 * H * D + HV * D + HV * ng + HV + HV * D) * 4;
            /*
             * rows: 5 methods (step), two-stage stepq@6, pack and unpack of
             * stepq@6, then fp32, bf16 and stepq@6 on the thread-per-column
             * kernels (old), then the prepared-variant rows (vrows).
             */
            for (int row = 0; row < 11 + N_VROWS && rc == 0; row++) {
                static const int row_method[] = { 0, 1, 2, 3, 4, 4, 4, 4, 0, 1, 4 };
                const struct vrow *vr = row >= 11 ? &vrows[row - 11] : NULL;
                const struct method *me = &methods[vr ? vr->method : row_method[row]];
                /* flat: a packed-step row of a prepared variant */
                const int old = row >= 8 && row <= 10, flat = vr && vr->kind == K_PACKED;
                char lab[32];
                snprintf(lab, sizeof(lab), "%s%s", me->name,
                         old        ? " (old)"
                         : row == 5 ? " two-stage"
                         : row == 6 ? " pack"
                         : row == 7 ? " unpack"
                                    : "");
                const char *label = vr ? vr->label : lab;
                if (only && strcmp(only, label))
                    continue;
                struct stepq_head_layout hl[32];
                size_t off[32], pos = 0;
                float w[32 * D];
                memset(hl, 0, sizeof(hl));
                if (layouts(hl, me, arch, HV) < 0) {
                    fprintf(stderr, "stepq bench kernels: layout: %s\n", stepq_last_error());
                    rc = 1;
                    break;
                }
                for (int h = 0; h < HV; h++) {
                    off[h] = pos;
                    pos += hl[h].block_bytes;
                }
                for (int i = 0; i < 32 * D; i++)
                    w[i] = 0.75f + 0.5f * (frand() + 1.0f) * 0.5f;
                struct ctx c;
                memset(&c, 0, sizeof(c));
                c.s = s;
                c.a.arch = arch;
                c.a.batch = B;
                c.a.H = H;
                c.a.HV = HV;
                c.a.d_k = c.a.d_v = D;
                c.a.n_slots = MAX_B + 1;
                c.a.slots = dslots;
                c.a.q = q;
                c.a.k = k;
                c.a.v = v;
                c.a.g = g;
                c.a.beta = beta;
                c.a.A_log = A_log;
                c.a.dt_bias = dt_bias;
                c.a.o = o;
                c.a.opt.l2norm = 1;
                c.a.opt.gate_in_kernel = 1;
                c.a.opt.beta_sigmoid = 1;
                c.a.stream = s;
                c.dense = dstate;
                c.pl.base = pages;
                c.pl.page_stride = (pos + 15) & ~(size_t)15;
                c.pl.n_slots = MAX_B + 1;
                c.pl.n_heads = HV;
                c.pl.heads = hl;
                c.pl.head_offset = off;
                c.pl.row_impact = w;
                size_t state_rw;
                if (me->budget == 0) {
                    c.kind = me->m == STEPQ_METHOD_FP32 ? K_DENSE_F32 : K_DENSE_BF16;
                    state_rw = 2 * (size_t)B * HV * D * D * (me->m == STEPQ_METHOD_FP32 ? 4 : 2);
                } else {
                    if (stepq__cuda_layer_prepare(&c.pl, &c.L) < 0) {
                        fprintf(stderr, "stepq bench kernels: %s\n", stepq_last_error());
                        rc = 1;
                        break;
                    }
                    /* valid pages: pack random fp32 states into every slot used */
                    c.kind = K_PACK;
                    if (launch(&c) < 0 || !cu_ok(cudaStreamSynchronize(s), "pack")) {
                        fprintf(stderr, "stepq bench kernels: %s\n", stepq_last_error());
                        rc = 1;
                    }
                    size_t blocks = 0;
                    for (int h = 0; h < HV; h++)
                        blocks += hl[h].block_bytes;
                    state_rw = 2 * (size_t)B * blocks;
                    c.kind = vr                       ? vr->kind
                             : row < 5 || old || flat ? K_PACKED
                             : row == 5               ? K_PACKED_2S
                             : row == 6               ? K_PACK
                                                      : K_UNPACK;
                    if (row == 5)
                        state_rw += 2 * (size_t)B * HV * D * D * 4; /* scratch write + read */
                    if (c.kind == K_PACK || c.kind == K_UNPACK || c.kind == K_UNPACK_VK)
                        state_rw = state_rw / 2 + (size_t)B * HV * D * D * 4;
                    if (c.kind == K_UNPACK_BF16)
                        state_rw = state_rw / 2 + (size_t)B * HV * D * D * 2;
                }
                stepq__cuda_set_legacy(old);
                stepq__cuda_set_tile_variant(vr ? vr->vbits : 0);
                double us = rc ? -1 : time_us(&c, e0, e1);
                stepq__cuda_set_legacy(0);
                stepq__cuda_set_tile_variant(0);
                if (us < 0)
                    rc = 1;
                size_t bytes = state_rw + (row < 6 || old || flat ? io_bytes : 0);
                if (row == 0)
                    fp32_us = us;
                double gbs = bytes / (us * 1e-6) / 1e9;
                char peer[16] = "";
                if (row == 0 && shape == 0)
                    snprintf(peer, sizeof(peer), "%.0f", peer_us_gdn[bi]);
                if (row == 0 && shape == 1 && B == 512)
                    snprintf(peer, sizeof(peer), "742");
                if (rc == 0) {
                    char sp[16] = "-";
                    if ((row < 6 || old || flat) && fp32_us > 0)
                        snprintf(sp, sizeof(sp), "%.2fx", fp32_us / us);
                    printf("%-24s %5d %10.1f %12zu %9.0f %6.1f%% %8s %12s\n", label, B, us, bytes,
                           gbs, 100.0 * gbs / copy_gbs, sp, peer);
                    if (jf)
                        fprintf(
                            jf,
                            "%s\n  {\"shape\": \"%s\", \"method\": \"%s\", \"batch\": %d, "
                            "\"us\": %.2f, \"bytes\": %zu, \"gbs\": %.1f, \"copy_frac\": %.4f, "
                            "\"speedup_vs_fp32\": %.3f, \"peer_us_quoted\": %s}",
                            first_row ? "" : ",", shape ? "kimi-linear-48b" : "qwen3-next-80b-a3b",
                            label, B, us, bytes, gbs, gbs / copy_gbs,
                            row < 6 || old || flat ? fp32_us / us : 0.0, peer[0] ? peer : "null");
                    first_row = 0;
                }
                stepq__cuda_layer_release(c.L);
                for (int h = 0; h < HV; h++)
                    stepq__head_layout_free(&hl[h]);
            }
        }
        printf("\n");
    }
    (void)peer_b;
    printf("peer us (q): quoted from issue 5 (flash-linear-attention "
           "fused_recurrent_gated_delta_rule /\n"
           "fused_recurrent_kda, fp32 state, same H200 model), not measured by this run.\n");
    if (jf) {
        fprintf(jf, "\n]}\n");
        fclose(jf);
    }
    cudaFree(dstate);
    cudaFree(pages);
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(g);
    cudaFree(beta);
    cudaFree(A_log);
    cudaFree(dt_bias);
    cudaFree(o);
    cudaFree(dslots);
    return rc;
}

#else /* !STEPQ_HAVE_CUDA */

int stepq_tool_bench_kernels(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "stepq bench kernels: this build has no CUDA support (configure with "
                    "-Dcuda=enabled); nothing measured\n");
    return 1;
}

#endif
