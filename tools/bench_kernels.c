/*
 * stepq bench kernels [--json [FILE]] [-o FILE] [--quick] [--peer FILE]: one decode step,
 * pack and unpack of one layer on the GPU, timed with CUDA events (3 warm-up
 * launches, median of 20: tests/checkasm/timing.c, the helper the kernel
 * checks' --bench uses too), for the Qwen3-Next-80B-A3B (GDN, 32 value heads
 * over 16 q/k heads) and Kimi-Linear-48B (KDA, 32 heads) layer shapes at TP1.
 *
 * The rows run on the checks' fixture (tests/checkasm/fixture.c): the packed
 * step, pack and unpack rows on a CUDA pool opened from a map built in memory
 * (one layer, the method's widths), through the public API
 * (stepq_pool_decode_step, stepq_pool_prefill_pack / _unpack), as a server
 * calls them; the dense fp32 / bf16 rows, the two-stage row and the "(old)"
 * thread-per-column rows through the internal entries, on the pool's layer
 * where there is one, the kernel chosen by an explicit argument. The
 * "stepq@4 norefit" / "stepq@6 norefit" rows are the stepq@4 / stepq@6 rows
 * on the same maps with the decode fit norefit (map field decode_fit): the
 * A/B of the column refit in one run; "stepq@4 rows" / "stepq@6 rows" the
 * same with the decode fit rows (the old column scales kept: no column
 * reduction; the start pages are the pack's, so every head is served). The
 * "fp16" rows take the map field arith fp16 (GDN and KDA), "fp16 norefit" with
 * the decode fit norefit as well.
 *
 * Bytes moved = state bytes read + written (packed head blocks incl. their
 * alignment, from the pool's layout, or the dense state; the two-stage rows
 * add their fp32 scratch write + read) + q/k/v/g/beta read + o written. The
 * device copy bandwidth is measured in the same run (cudaMemcpy
 * device-to-device of 1 GiB, read + write counted).
 *
 * The peer (flash-linear-attention's fp32-state kernels) is timed by
 * tools/bench_peer_fla.py in its own process; --peer reads its JSON. Without
 * it the fp32 rows carry peer times quoted from an earlier H200 measurement, marked as quoted.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepq_config.h"
#include "tools/cli.h"
#include "tools/commands.h"

static const int batches[] = { 1, 8, 32, 64, 128, 256, 512 };
#define N_BATCHES ((int)(sizeof(batches) / sizeof(batches[0])))

struct kopts {
    const char *json, *out, *only, *peer; /* json: --json FILE */
    int json_stdout, quick, graph, only_b, only_shape, help;
    int no_pivots; /* --no-pivots: the stepq maps' pivot units at 6 bits instead */
};

/*
 * The options, checked the same way with or without CUDA in the build. Returns 0, or 2 after
 * one line naming the option.
 */
static int parse_opts(int argc, char **argv, struct kopts *k)
{
    static const char *const tool = "bench kernels";
    long long n;

    memset(k, 0, sizeof(*k));
    k->only_shape = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            k->help = 1;
            return 0;
        } else if (!strcmp(a, "--quick")) {
            k->quick = 1;
            continue;
        } else if (!strcmp(a, "--graph")) {
            k->graph = 1;
            continue;
        } else if (!strcmp(a, "--no-pivots")) {
            k->no_pivots = 1;
            continue;
        } else if (!strcmp(a, "--json")) {
            /* --json FILE: the JSON into FILE next to the tables; --json alone: on stdout. */
            if (v && v[0] != '-')
                k->json = argv[++i];
            else
                k->json_stdout = 1;
            continue;
        }
        if (!v) {
            static const char *const value_opts[] = { "--batch", "--only", "--peer",
                                                      "--shape", "-o",     NULL };
            return stepq_tool_missing_value(tool, a, value_opts);
        }
        i++;
        if (!strcmp(a, "-o")) {
            k->out = v;
        } else if (!strcmp(a, "--peer")) {
            k->peer = v;
        } else if (!strcmp(a, "--only")) {
            k->only = v;
        } else if (!strcmp(a, "--batch")) {
            int known = 0;
            if (stepq_tool_int(tool, a, v, 1, batches[N_BATCHES - 1], &n) < 0)
                return 2;
            for (int bi = 0; bi < N_BATCHES; bi++)
                known |= batches[bi] == n;
            if (!known) {
                fprintf(stderr,
                        "stepq %s: --batch %s: the batches measured are 1, 8, 32, 64, 128, "
                        "256 and 512\n",
                        tool, v);
                return 2;
            }
            k->only_b = (int)n;
        } else if (!strcmp(a, "--shape")) {
            k->only_shape = !strcmp(v, "gdn") ? 0 : !strcmp(v, "kda") ? 1 : -2;
            if (k->only_shape < 0) {
                fprintf(stderr, "stepq %s: --shape '%s': want gdn or kda\n", tool, v);
                return 2;
            }
        } else {
            fprintf(stderr, "stepq %s: unknown option '%s' (see stepq %s --help)\n", tool, a, tool);
            return 2;
        }
    }
    if (k->json && k->json_stdout) {
        fprintf(stderr, "stepq %s: --json given twice, with and without a FILE\n", tool);
        return 2;
    }
    return 0;
}

#if STEPQ_HAVE_CUDA
#include <cjson/cJSON.h>
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda.h"
#include "kernels/dsp.h"
#include "kernels/format.h"
#include "plugin/err.h"
#include "stepq/stepq.h"
#include "tests/checkasm/fixture.h"
#include "tests/checkasm/timing.h"

#define D     128
#define MAX_B 512
/* A peer file is a few kB; anything this large is not one. */
#define PEER_MAX_BYTES (1u << 20)

/*
 * Quoted from an earlier measurement on the same H200 model (fla fused_recurrent_gated_delta_rule
 * / fused_recurrent_kda, fp32 state; tools/scripts/bench_peer_fla.py measures it afresh), per
 * shape (GDN, KDA) and batch; 0: none quoted. NOT measured here.
 */
static const double peer_us_quoted[2][N_BATCHES] = { { 82, 75, 113, 158, 245, 431, 797 },
                                                     { 0, 0, 0, 0, 0, 0, 742 } };

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

/* Words in the host patterns the fills repeat over device memory (16 MiB). */
#define PAT_N (4u << 20)

/* Copies the PAT_N 32-bit words at pat over n bytes of device memory, repeated. */
static int fill_with(void *dev, size_t n, const void *pat)
{
    const size_t pat_bytes = PAT_N * sizeof(uint32_t);
    for (size_t off = 0; off < n; off += pat_bytes) {
        size_t len = n - off < pat_bytes ? n - off : pat_bytes;
        if (!cu_ok(cudaMemcpy((char *)dev + off, pat, len, cudaMemcpyHostToDevice), "fill"))
            return 0;
    }
    return 1;
}

/* Fills n bytes of device memory with random floats in [-scale, scale) from a 16 MiB pattern. */
static int fill_random(void *dev, size_t n, float scale)
{
    static float *pat;
    if (!pat) {
        pat = malloc(PAT_N * sizeof(float));
        if (!pat)
            return 0;
    }
    for (size_t i = 0; i < PAT_N; i++)
        pat[i] = scale * frand();
    return fill_with(dev, n, pat);
}

/*
 * Dense states that are finite read either way: every 32-bit word is two
 * bf16 values of magnitude <= scale (high half: the word's fp32 value is
 * within one bf16 ulp of it). Random fp32 bits read as bf16 would put NaN
 * and Inf (exponent 0xff in a low half, 1 in 256) in every head, and the
 * dense bf16 step would time its non-finite path.
 */
static int fill_states(void *dev, size_t n, float scale)
{
    static uint32_t *pat;
    if (!pat) {
        pat = malloc(PAT_N * sizeof(uint32_t));
        if (!pat)
            return 0;
        for (size_t i = 0; i < PAT_N; i++)
            pat[i] = (uint32_t)stepq__bf16_from_float(scale * frand()) << 16 |
                     stepq__bf16_from_float(scale * frand());
    }
    return fill_with(dev, n, pat);
}

/* What a row times. */
enum kind {
    K_DENSE_F32,
    K_DENSE_BF16,
    K_PACKED,
    K_PACKED_2S,
    K_PACK,           /* from fp32 [K,V] */
    K_PACK_BF16,      /* from bf16 [K,V] */
    K_PACK_VK,        /* from fp32 [V,K] */
    K_UNPACK,         /* to fp32 [K,V] */
    K_UNPACK_BF16,    /* to bf16 [K,V] */
    K_UNPACK_VK,      /* to fp32 [V,K] */
    K_PACK_BF16_VK,   /* from bf16 [V,K] */
    K_UNPACK_BF16_VK, /* to bf16 [V,K] */
};

/* Whether a kind is a decode step (reads q/k/v/g/beta, writes o) rather than a pack / unpack. */
static int is_step(enum kind k)
{
    return k == K_DENSE_F32 || k == K_DENSE_BF16 || k == K_PACKED || k == K_PACKED_2S;
}

/* Whether a kind is a pack (reads the dense states, writes pages). */
static int is_pack(enum kind k)
{
    return k == K_PACK || k == K_PACK_BF16 || k == K_PACK_VK || k == K_PACK_BF16_VK;
}

/* The dense side of a pack or unpack kind. */
static stepq_dtype kind_dtype(enum kind k)
{
    return k == K_PACK_BF16 || k == K_UNPACK_BF16 || k == K_PACK_BF16_VK || k == K_UNPACK_BF16_VK
               ? STEPQ_DTYPE_BF16
               : STEPQ_DTYPE_FP32;
}

static stepq_state_layout kind_layout(enum kind k)
{
    return k == K_PACK_VK || k == K_UNPACK_VK || k == K_PACK_BF16_VK || k == K_UNPACK_BF16_VK
               ? STEPQ_STATE_LAYOUT_VK
               : STEPQ_STATE_LAYOUT_KV;
}

/* One row's launch, what fx_time_us times. */
struct ctx {
    enum kind kind;
    unsigned prep;         /* a handle of this kernel choice (stepq__cuda_layer_prepare_ex flags) */
    stepq_pool_t *pool;    /* the packed rows' pool */
    stepq_step_args args;  /* the step through the public API */
    stepq_prefill_args pf; /* the pack / unpack through the public API */
    struct stepq__step_args ka;    /* the step as the internal entries take it */
    struct stepq__packed_layer pl; /* the pool's layer 0, for the internal entries */
    stepq__cuda_layer *L;          /* the two-stage and "(old)" rows' handle */
    void *dense;                   /* dense states: by slot id (dense steps), by entry (pack) */
    size_t stride;                 /* elements from one dense state to the next */
    cudaStream_t s;
};

static int launch(void *p)
{
    const struct ctx *c = p;
    switch (c->kind) {
    case K_DENSE_F32:
    case K_DENSE_BF16:
        return stepq__cuda_step_dense_ex(
            &c->ka, c->dense, c->stride, STEPQ__LAYOUT_KV,
            c->kind == K_DENSE_BF16 ? STEPQ_DTYPE_BF16 : STEPQ_DTYPE_FP32, c->prep);
    case K_PACKED:
        if (c->prep)
            return stepq__cuda_step_packed_prepared(&c->ka, &c->pl, c->L, STEPQ__CUDA_FUSED);
        return stepq_pool_decode_step(c->pool, 0, &c->args, c->s);
    case K_PACKED_2S:
        return stepq__cuda_step_packed_prepared(&c->ka, &c->pl, c->L, STEPQ__CUDA_TWO_STAGE);
    case K_PACK:
    case K_PACK_BF16:
    case K_PACK_VK:
    case K_PACK_BF16_VK:
        if (c->prep)
            return stepq__cuda_pack_prepared(&c->pl, c->L, c->pf.n, c->pf.slot_ids, c->dense,
                                             c->stride, (stepq__layout)c->pf.layout, c->pf.dtype,
                                             NULL, NULL, c->s);
        return stepq_pool_prefill_pack(c->pool, 0, &c->pf, c->s);
    case K_UNPACK:
    case K_UNPACK_BF16:
    case K_UNPACK_VK:
    case K_UNPACK_BF16_VK:
        if (c->prep)
            return stepq__cuda_unpack_prepared(&c->pl, c->L, c->pf.n, c->pf.slot_ids, c->dense,
                                               c->stride, (stepq__layout)c->pf.layout, c->pf.dtype,
                                               c->s);
        return stepq_pool_prefill_unpack(c->pool, 0, &c->pf, c->s);
    }
    return STEPQ_EINVAL;
}

/* The copy bandwidth's launch: 1 GiB device to device. */
struct copy {
    void *dst, *src;
    size_t bytes;
    cudaStream_t s;
};

static int launch_copy(void *p)
{
    const struct copy *c = p;
    cudaError_t e = cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, c->s);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return stepq__error(STEPQ_ECUDA, "copy: %s", cudaGetErrorString(e));
    }
    return STEPQ_OK;
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
    int budget;           /* 0 dense */
    stepq_decode_fit fit; /* the map's decode_fit: the norefit / rows rows' A/B against exact */
    stepq_arith arith;    /* the map's arith: the fp16 rows */
};

static const struct method methods[] = {
    { "fp32", STEPQ_METHOD_FP32, 0, STEPQ_DECODE_FIT_EXACT, STEPQ_ARITH_FP32 },
    { "bf16", STEPQ_METHOD_BF16, 0, STEPQ_DECODE_FIT_EXACT, STEPQ_ARITH_FP32 },
    { "uniform@6", STEPQ_METHOD_UNIFORM, 6, STEPQ_DECODE_FIT_EXACT, STEPQ_ARITH_FP32 },
    { "stepq@4", STEPQ_METHOD_STEPQ, 4, STEPQ_DECODE_FIT_EXACT, STEPQ_ARITH_FP32 },
    { "stepq@6", STEPQ_METHOD_STEPQ, 6, STEPQ_DECODE_FIT_EXACT, STEPQ_ARITH_FP32 },
    { "fp8", STEPQ_METHOD_FP8, 8, STEPQ_DECODE_FIT_EXACT, STEPQ_ARITH_FP32 },
    { "stepq@4 norefit", STEPQ_METHOD_STEPQ, 4, STEPQ_DECODE_FIT_NOREFIT, STEPQ_ARITH_FP32 },
    { "stepq@6 norefit", STEPQ_METHOD_STEPQ, 6, STEPQ_DECODE_FIT_NOREFIT, STEPQ_ARITH_FP32 },
    { "stepq@4 rows", STEPQ_METHOD_STEPQ, 4, STEPQ_DECODE_FIT_ROWS, STEPQ_ARITH_FP32 },
    { "stepq@6 rows", STEPQ_METHOD_STEPQ, 6, STEPQ_DECODE_FIT_ROWS, STEPQ_ARITH_FP32 },
    { "stepq@4 fp16", STEPQ_METHOD_STEPQ, 4, STEPQ_DECODE_FIT_EXACT, STEPQ_ARITH_FP16 },
    { "stepq@6 fp16", STEPQ_METHOD_STEPQ, 6, STEPQ_DECODE_FIT_EXACT, STEPQ_ARITH_FP16 },
    { "stepq@4 fp16 norefit", STEPQ_METHOD_STEPQ, 4, STEPQ_DECODE_FIT_NOREFIT, STEPQ_ARITH_FP16 },
    { "stepq@6 fp16 norefit", STEPQ_METHOD_STEPQ, 6, STEPQ_DECODE_FIT_NOREFIT, STEPQ_ARITH_FP16 },
};

/*
 * The widths of a method's map (fx_map_spec.unit_bits), per head (GDN) or per
 * key row (KDA): one pivot head per GDN layer (1.39% of 32 heads rounds to
 * 0.44: one is the conservative choice), one pivot row per KDA head (0.625%
 * of 128 rows), and a {4,6,8} (@6) or {2..8} (@4) mix at exactly the budget
 * sum(b) = bbar*N - 8*N_piv. NULL where the method has one width. no_pivots (--no-pivots):
 * the pivot units at 6 bits instead.
 */
static const uint8_t *unit_bits(uint8_t *out, const struct method *me, stepq_arch arch, int HV,
                                int no_pivots)
{
    if (me->m != STEPQ_METHOD_STEPQ)
        return NULL;
    if (arch == STEPQ_ARCH_GDN) {
        static const int w6[] = { 8, 4, 6 }, c6[] = { 7, 8, 16 };
        static const int w4[] = { 8, 6, 4, 3, 2 }, c4[] = { 3, 4, 8, 8, 8 };
        uint8_t hb[32];
        hb[0] = no_pivots ? 6 : STEPQ_BITS_PIVOT;
        if (me->budget == 6)
            make_bits(hb + 1, 31, w6, c6, 3);
        else
            make_bits(hb + 1, 31, w4, c4, 5);
        for (int h = 0; h < HV; h++)
            out[h] = hb[h % 32];
        return out;
    }
    static const int w6[] = { 8, 4, 6 }, c6[] = { 29, 30, 68 };
    static const int w4[] = { 8, 6, 4, 3, 2 }, c4[] = { 10, 20, 40, 30, 27 };
    for (int h = 0; h < HV; h++) {
        uint8_t *rb = out + (size_t)h * D;
        rb[0] = no_pivots ? 6 : STEPQ_BITS_PIVOT;
        if (me->budget == 6)
            make_bits(rb + 1, 127, w6, c6, 3);
        else
            make_bits(rb + 1, 127, w4, c4, 5);
    }
    return out;
}

/*
 * A CUDA pool of MAX_B slots (ids 1..MAX_B, all allocated) on a one-layer map
 * of the method for the shape (no_pivots: unit_bits'); *blocks gets the bytes of
 * the layer's head blocks as the pool lays them out.
 */
static int open_pool(const struct method *me, stepq_arch arch, int H, int HV, int no_pivots,
                     cudaStream_t s, stepq_map_t **map, stepq_pool_t **pool, size_t *blocks)
{
    static uint8_t ub[32 * D];
    struct fx_rng r = { 0x2545f4914f6cdd1dull };
    const struct fx_map_spec spec = {
        .arch = arch,
        .method = me->m,
        .bits = me->m == STEPQ_METHOD_STEPQ ? 0 : me->budget,
        .unit_bits = unit_bits(ub, me, arch, HV, no_pivots),
        .budget = me->budget,
        .H = H,
        .HV = HV,
        .n_layers = 1,
        .w_lo = 0.75f,
        .w_hi = 1.25f,
        .decode_fit = me->fit,
        .arith = me->arith,
    };
    const stepq_pool_layout *lay;
    int ret;

    *pool = NULL;
    if ((ret = fx_map_create(&spec, &r, map)) < 0 ||
        (ret = fx_pool_open(*map, STEPQ_POOL_BACKEND_CUDA, MAX_B, s, pool)) < 0 ||
        (ret = stepq_pool_get_layout(*pool, &lay)) < 0) {
        fprintf(stderr, "stepq bench kernels: %s map, pool: %s\n", me->name, stepq_last_error());
        return ret;
    }
    *blocks = 0;
    for (int h = 0; h < lay->n_local_heads; h++)
        *blocks += lay->block_bytes[h];
    return STEPQ_OK;
}

/*
 * The rows of each batch, in print order. Step rows first (the ones with a "vs fp32"
 * and "vs peer"), then pack and unpack of stepq@6 and of fp8 (SGLang's proposed float8
 * pool) with each dense side, then the
 * thread-per-column kernels (old: STEPQ__CUDA_COLUMN, on the row's layer handle or dense
 * step) for comparison.
 */
struct row {
    const char *label; /* unique: --only selects by it */
    int method;        /* index into methods[] */
    enum kind kind;
    unsigned prep; /* 0: the pool's kernels; else the handle flags of the row's kernel choice */
};

static const struct row rows[] = {
    { "fp32", 0, K_DENSE_F32, 0 },
    { "bf16", 1, K_DENSE_BF16, 0 },
    { "uniform@6", 2, K_PACKED, 0 },
    { "stepq@4", 3, K_PACKED, 0 },
    { "stepq@6", 4, K_PACKED, 0 },
    /* the decode fit norefit (map field decode_fit), the same maps otherwise: A/B of the refit */
    { "stepq@4 norefit", 6, K_PACKED, 0 },
    { "stepq@6 norefit", 7, K_PACKED, 0 },
    /* the decode fit rows, likewise: the old column scales kept, no column reduction */
    { "stepq@4 rows", 8, K_PACKED, 0 },
    { "stepq@6 rows", 9, K_PACKED, 0 },
    /* the map field arith fp16: the fp16 kernel at 4 blocks per SM, and at 3 */
    { "stepq@4 fp16", 10, K_PACKED, 0 },
    { "stepq@6 fp16", 11, K_PACKED, 0 },
    { "stepq@6 fp16 3 blocks/SM", 11, K_PACKED, STEPQ__CUDA_F16_OCC3 },
    /* both: the fp16 step without its refit (A/B against the two rows above) */
    { "stepq@4 fp16 norefit", 12, K_PACKED, 0 },
    { "stepq@6 fp16 norefit", 13, K_PACKED, 0 },
    { "fp8", 5, K_PACKED, 0 },
    { "stepq@6 two-stage", 4, K_PACKED_2S, 0 },
    { "stepq@6 pack", 4, K_PACK, 0 },
    { "stepq@6 pack bf16", 4, K_PACK_BF16, 0 },
    { "stepq@6 pack [V,K]", 4, K_PACK_VK, 0 },
    { "stepq@6 pack bf16 [V,K]", 4, K_PACK_BF16_VK, 0 },
    { "stepq@6 unpack", 4, K_UNPACK, 0 },
    { "stepq@6 unpack bf16", 4, K_UNPACK_BF16, 0 },
    { "stepq@6 unpack [V,K]", 4, K_UNPACK_VK, 0 },
    { "stepq@6 unpack bf16 [V,K]", 4, K_UNPACK_BF16_VK, 0 },
    { "fp8 pack", 5, K_PACK, 0 },
    { "fp8 pack bf16", 5, K_PACK_BF16, 0 },
    { "fp8 pack [V,K]", 5, K_PACK_VK, 0 },
    { "fp8 pack bf16 [V,K]", 5, K_PACK_BF16_VK, 0 },
    { "fp8 unpack", 5, K_UNPACK, 0 },
    { "fp8 unpack bf16", 5, K_UNPACK_BF16, 0 },
    { "fp8 unpack [V,K]", 5, K_UNPACK_VK, 0 },
    { "fp8 unpack bf16 [V,K]", 5, K_UNPACK_BF16_VK, 0 },
    { "fp32 (old)", 0, K_DENSE_F32, STEPQ__CUDA_COLUMN },
    { "bf16 (old)", 1, K_DENSE_BF16, STEPQ__CUDA_COLUMN },
    { "stepq@6 (old)", 4, K_PACKED, STEPQ__CUDA_COLUMN },
    { "fp8 (old)", 5, K_PACKED, STEPQ__CUDA_COLUMN },
    { "stepq@6 unpack (old)", 4, K_UNPACK, STEPQ__CUDA_COLUMN },
    { "stepq@6 unpack bf16 (old)", 4, K_UNPACK_BF16, STEPQ__CUDA_COLUMN },
    { "stepq@6 unpack [V,K] (old)", 4, K_UNPACK_VK, STEPQ__CUDA_COLUMN },
    { "fp8 pack (old)", 5, K_PACK, STEPQ__CUDA_COLUMN },
    { "fp8 pack bf16 (old)", 5, K_PACK_BF16, STEPQ__CUDA_COLUMN },
    { "fp8 pack [V,K] (old)", 5, K_PACK_VK, STEPQ__CUDA_COLUMN },
    { "fp8 pack bf16 [V,K] (old)", 5, K_PACK_BF16_VK, STEPQ__CUDA_COLUMN },
    { "fp8 unpack (old)", 5, K_UNPACK, STEPQ__CUDA_COLUMN },
    { "fp8 unpack bf16 (old)", 5, K_UNPACK_BF16, STEPQ__CUDA_COLUMN },
    { "fp8 unpack [V,K] (old)", 5, K_UNPACK_VK, STEPQ__CUDA_COLUMN },
    { "fp8 unpack bf16 [V,K] (old)", 5, K_UNPACK_BF16_VK, STEPQ__CUDA_COLUMN },
};
#define N_ROWS ((int)(sizeof(rows) / sizeof(rows[0])))

/* Peer timings per shape (0 GDN, 1 KDA) and batch index; 0 where the peer has none. */
struct peer {
    const char *file; /* --peer FILE, or NULL: the quoted numbers */
    char device[128];
    double copy_gbs;
    double us[2][N_BATCHES];
};

static int peer_fail(const char *file, const char *problem)
{
    fprintf(stderr, "stepq bench kernels: --peer %s: %s\n", file, problem);
    return 2;
}

/* A finite number > 0, or 0. */
static double positive(const cJSON *it)
{
    return cJSON_IsNumber(it) && isfinite(it->valuedouble) && it->valuedouble > 0 ? it->valuedouble
                                                                                  : 0;
}

/* Validates one row of the peer file and records its time; returns 0 or the exit status. */
static int peer_row(struct peer *p, const cJSON *r, int i)
{
    char msg[256];
    if (!cJSON_IsObject(r)) {
        snprintf(msg, sizeof(msg), "rows[%d]: not an object", i);
        return peer_fail(p->file, msg);
    }
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(r, "shape");
    const cJSON *batch = cJSON_GetObjectItemCaseSensitive(r, "batch");
    double us = positive(cJSON_GetObjectItemCaseSensitive(r, "us"));
    int sh = -1;
    if (cJSON_IsString(shape) && shape->valuestring)
        sh = !strcmp(shape->valuestring, "gdn") ? 0 : !strcmp(shape->valuestring, "kda") ? 1 : -1;
    if (sh < 0) {
        snprintf(msg, sizeof(msg), "rows[%d].shape: missing, or not \"gdn\" or \"kda\"", i);
        return peer_fail(p->file, msg);
    }
    if (!cJSON_IsNumber(batch) || !(batch->valuedouble >= 1 && batch->valuedouble <= 65535) ||
        batch->valuedouble != floor(batch->valuedouble)) {
        snprintf(msg, sizeof(msg), "rows[%d].batch: missing, or not an integer in 1..65535", i);
        return peer_fail(p->file, msg);
    }
    if (us == 0) {
        snprintf(msg, sizeof(msg), "rows[%d].us: missing, or not a finite number > 0", i);
        return peer_fail(p->file, msg);
    }
    /* Batches this bench does not run are valid and unused. */
    for (int bi = 0; bi < N_BATCHES; bi++) {
        if (batches[bi] != (int)batch->valuedouble)
            continue;
        if (p->us[sh][bi] > 0) {
            snprintf(msg, sizeof(msg), "rows[%d]: a second row for %s at batch %d", i,
                     shape->valuestring, batches[bi]);
            return peer_fail(p->file, msg);
        }
        p->us[sh][bi] = us;
    }
    return 0;
}

/*
 * Reads the JSON of tools/bench_peer_fla.py: {"device": str, "copy_gbs": number > 0,
 * "rows": [{"shape": "gdn"|"kda", "batch": int, "us": number > 0, ...}, ...]}; other
 * fields are ignored. Returns 0, or 2 after naming the file and the problem.
 */
static int peer_load(struct peer *p, const char *file)
{
    memset(p, 0, sizeof(*p));
    p->file = file;
    cJSON *root = NULL;
    int rc = stepq_tool_json_file("bench kernels", "--peer", file, PEER_MAX_BYTES, &root);
    if (rc)
        return rc;
    const cJSON *dev = cJSON_GetObjectItemCaseSensitive(root, "device");
    const cJSON *rws = cJSON_GetObjectItemCaseSensitive(root, "rows");
    if (!cJSON_IsString(dev) || !dev->valuestring || !dev->valuestring[0])
        rc = peer_fail(file, "device: missing, or not a non-empty string");
    else if ((p->copy_gbs = positive(cJSON_GetObjectItemCaseSensitive(root, "copy_gbs"))) == 0)
        rc = peer_fail(file, "copy_gbs: missing, or not a finite number > 0");
    else if (!cJSON_IsArray(rws) || cJSON_GetArraySize(rws) < 1)
        rc = peer_fail(file, "rows: missing, or not a non-empty array");
    else {
        snprintf(p->device, sizeof(p->device), "%s", dev->valuestring);
        int i = 0;
        for (const cJSON *r = rws->child; r && rc == 0; r = r->next, i++)
            rc = peer_row(p, r, i);
    }
    cJSON_Delete(root);
    return rc;
}

/* The tables go to tout: stdout, -o FILE, or nowhere with --json alone. */
static FILE *tout;

/* The opening of a row's JSON object, after a comma unless it is the first row: its shape,
 * method (the row label) and batch. */
static void json_row_head(FILE *jf, int first_row, int shape, const char *label, int B)
{
    fprintf(jf, "%s\n  {\"shape\": \"%s\", \"method\": \"%s\", \"batch\": %d, ",
            first_row ? "" : ",", shape ? "kimi-linear-48b" : "qwen3-next-80b-a3b", label, B);
}

static int usage(FILE *f)
{
    fprintf(f, "usage: stepq bench kernels [--json [FILE]] [-o FILE] [--quick] [--graph]\n"
               "                           [--peer FILE] [--only LABEL] [--batch B]\n"
               "                           [--shape gdn|kda] [--no-pivots]\n"
               "  Times the CUDA decode step, pack and unpack of one layer (Qwen3-Next GDN,\n"
               "  Kimi-Linear KDA) at batch 1..512 and prints us, bytes, GB/s, the fraction of\n"
               "  the device copy bandwidth measured in the same run and the speedup vs fp32.\n"
               "  --quick: batches 1, 64 and 512 only. --graph: time each launch as a server's\n"
               "  CUDA graph runs it (20 launches captured into one graph on a created stream,\n"
               "  the median replay / 20; a row that cannot be captured says why; default: each\n"
               "  launch between two events, which includes the host's launch latency at small\n"
               "  batches). --only: one row label (below); --batch (1, 8, 32, 64, 128, 256 or\n"
               "  512), --shape: one batch / one layer shape (for profilers). --json: every row,\n"
               "  machine-readable, on stdout instead of the tables; --json FILE: into FILE, the\n"
               "  tables on stdout too; -o: stdout into FILE.\n"
               "  --no-pivots: the stepq rows' maps without pivots (GDN's pivot head and each\n"
               "  KDA head's pivot row at 6 bits instead): what the pivots cost.\n"
               "  --peer: the JSON of tools/bench_peer_fla.py (flash-linear-attention's fp32\n"
               "  kernels, timed in a separate process): adds 'peer us' and 'vs peer' (peer us /\n"
               "  us) to the step rows at the batches it has. Without it the fp32 rows show the\n"
               "  times of an earlier H200 run as 'peer us (q)', quoted, not measured.\n"
               "  Rows marked (old) run the thread-per-column kernels; 'bf16' and '[V,K]' name\n"
               "  the dense side of a pack or unpack (fp32 [K,V] otherwise). Rows:\n");
    int col = 0;
    for (int i = 0; i < N_ROWS; i++) {
        int w = (int)strlen(rows[i].label) + 4;
        if (col + w > 80) {
            fputc('\n', f);
            col = 0;
        }
        col += fprintf(f, "%s'%s'%s", col ? " " : "    ", rows[i].label, i + 1 < N_ROWS ? "," : "");
    }
    fputc('\n', f);
    return f == stdout ? 0 : 2;
}

int stepq_tool_bench_kernels(int argc, char **argv)
{
    struct kopts ko;
    int prc0 = parse_opts(argc, argv, &ko);
    if (prc0)
        return prc0;
    if (ko.help)
        return usage(stdout);
    const char *json = ko.json, *only = ko.only, *peer_file = ko.peer;
    const int quick = ko.quick, graph = ko.graph, only_b = ko.only_b, only_shape = ko.only_shape;
    const int no_pivots = ko.no_pivots;
    if (only) {
        int known = 0;
        for (int ri = 0; ri < N_ROWS; ri++)
            known |= !strcmp(rows[ri].label, only);
        if (!known) {
            fprintf(stderr, "stepq bench kernels: --only '%s': no such row (see --help)\n", only);
            return 2;
        }
    }
    /* The peer file is read before the device is looked for: a bad file fails the same way
     * with or without a GPU. */
    struct peer peer;
    memset(&peer, 0, sizeof(peer));
    if (peer_file) {
        int prc = peer_load(&peer, peer_file);
        if (prc)
            return prc;
    } else
        memcpy(peer.us, peer_us_quoted, sizeof(peer.us));
    const int measured = peer_file != NULL;

    if (stepq__cuda_device_count() < 1) {
        fprintf(stderr, "stepq bench kernels: no CUDA device available; nothing measured\n");
        return 1;
    }
    struct cudaDeviceProp prop;
    if (!cu_ok(cudaGetDeviceProperties(&prop, 0), "device properties"))
        return 1;

    /* Copy bandwidth of this device, now. */
    struct copy cp = { NULL, NULL, (size_t)1 << 30, NULL };
    cudaStream_t s = NULL;
    double copy_us = 0;
    if (!cu_ok(cudaMalloc(&cp.src, cp.bytes), "malloc") ||
        !cu_ok(cudaMalloc(&cp.dst, cp.bytes), "malloc"))
        return 1;
    if (fx_time_us(launch_copy, &cp, s, &copy_us) < 0) {
        fprintf(stderr, "stepq bench kernels: %s\n", stepq_last_error());
        return 1;
    }
    double copy_gbs = 2.0 * (double)cp.bytes / (copy_us * 1e-6) / 1e9;
    cudaFree(cp.src);
    cudaFree(cp.dst);
    /* Where things go (opened before the work, so a bad path fails at once): the tables to
     * stdout or -o FILE, the JSON to --json FILE, or in the tables' place with --json alone. */
    struct stepq_tool_out o_main, o_json;
    FILE *mf = stepq_tool_out_open(&o_main, "bench kernels", ko.out), *jf = NULL;
    stepq_tool_out_reserve(&o_json, "bench kernels", NULL);
    if (!mf)
        return 1;
    if (json && !(jf = stepq_tool_out_open(&o_json, "bench kernels", json))) {
        stepq_tool_out_discard(&o_main);
        return 1;
    }
    if (ko.json_stdout)
        jf = mf;
    else
        tout = mf;
    stepq_tool_printf(tout, "device: %s, %d SMs; copy bandwidth (D2D, read+write) %.0f GB/s\n",
                      prop.name, prop.multiProcessorCount, copy_gbs);
    if (graph)
        stepq_tool_printf(
            tout,
            "timing: CUDA graphs of %d launches on a created stream, %d eager warm-up, "
            "median of %d replays / %d; one layer, one token per request\n",
            FX_TIME_GRAPH_LAUNCHES, FX_TIME_WARMUP, FX_TIME_RUNS, FX_TIME_GRAPH_LAUNCHES);
    else
        stepq_tool_printf(
            tout,
            "timing: CUDA events, %d warm-up, median of %d; one layer, one token per request\n",
            FX_TIME_WARMUP, FX_TIME_RUNS);
    if (no_pivots)
        stepq_tool_printf(tout,
                          "maps: --no-pivots (the stepq maps' pivot head / rows at 6 bits)\n");
    if (measured) {
        stepq_tool_printf(
            tout,
            "peer: flash-linear-attention fp32 kernels from %s, measured in a separate process\n"
            "      (tools/bench_peer_fla.py) on %s with its own copy bandwidth %.0f GB/s\n",
            peer.file, peer.device, peer.copy_gbs);
        if (strcmp(peer.device, prop.name))
            stepq_tool_printf(tout, "      NOTE: the peer's device is not this one (%s)\n",
                              prop.name);
    }
    stepq_tool_printf(tout, "\n");

    if (jf) {
        fprintf(jf, "{\"device\": ");
        stepq_tool_json_str(jf, prop.name);
        fprintf(jf,
                ", \"copy_gbs\": %.1f, \"runs\": %d, \"timing\": \"%s\", \"graph_launches\": %d,\n "
                "\"no_pivots\": %s, \"peer\": ",
                copy_gbs, FX_TIME_RUNS, graph ? "graph" : "events",
                graph ? FX_TIME_GRAPH_LAUNCHES : 0, no_pivots ? "true" : "false");
        if (measured) {
            fprintf(jf, "{\"source\": \"measured\", \"file\": ");
            stepq_tool_json_str(jf, peer.file);
            fprintf(jf, ", \"device\": ");
            stepq_tool_json_str(jf, peer.device);
            fprintf(jf, ", \"copy_gbs\": %.1f, \"applies_to\": \"step rows\"}", peer.copy_gbs);
        } else
            fprintf(jf, "{\"source\": \"quoted\", \"reference\": \"an earlier H200 measurement\", "
                        "\"applies_to\": "
                        "\"fp32 rows\"}");
        fprintf(jf, ",\n \"rows\": [");
    }
    int first_row = 1, rc = 0;
    /*
     * The timed launches' stream: the legacy default stream (events), or with --graph a created
     * one that a graph can capture. Setup (packs, fills) stays on s and is synchronized before a
     * row is timed, and the timing synchronizes before the next row's setup.
     */
    cudaStream_t ts = NULL;
    if (graph && !cu_ok(cudaStreamCreateWithFlags(&ts, cudaStreamNonBlocking), "graph stream"))
        rc = 1;

    /* Device buffers sized for the largest batch. */
    /* dense states are indexed by slot id (1..MAX_B) */
    size_t state_bytes = (size_t)(MAX_B + 1) * 32 * D * D * sizeof(float);
    void *dstate = NULL;
    float *q, *k, *v, *g, *beta, *A_log, *dt_bias, *o;
    int32_t *dslots;
    int ok = cu_ok(cudaMalloc(&dstate, state_bytes), "malloc states") &&
             cu_ok(cudaMalloc((void **)&q, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&k, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&v, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&g, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&beta, MAX_B * 32 * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&A_log, 32 * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&dt_bias, 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&o, MAX_B * 32 * D * 4), "malloc") &&
             cu_ok(cudaMalloc((void **)&dslots, MAX_B * 4), "malloc");
    if (!ok || !fill_states(dstate, state_bytes, 0.05f) || !fill_random(q, MAX_B * 32 * D * 4, 1) ||
        !fill_random(k, MAX_B * 32 * D * 4, 1) || !fill_random(v, MAX_B * 32 * D * 4, 1) ||
        !fill_random(g, MAX_B * 32 * D * 4, 1) || !fill_random(beta, MAX_B * 32 * 4, 1) ||
        !fill_random(A_log, 32 * 4, 0.5f) || !fill_random(dt_bias, 32 * D * 4, 0.5f)) {
        stepq_tool_out_discard(&o_json);
        stepq_tool_out_discard(&o_main);
        return 1;
    }
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
        if (!cu_ok(cudaMemcpy(dslots, hs, sizeof(hs), cudaMemcpyHostToDevice), "slots")) {
            stepq_tool_out_discard(&o_json);
            stepq_tool_out_discard(&o_main);
            return 1;
        }
    }

    static const char *shape_name[] = { "Qwen3-Next-80B-A3B (GDN, HV=32, H=16)",
                                        "Kimi-Linear-48B (KDA, HV=32, H=32)" };
    enum { N_METHODS = (int)(sizeof(methods) / sizeof(methods[0])) };
    /* Progress on stderr: one step per row measured, the rows the options leave. */
    int n_meas = 0;
    for (int shape = 0; shape < 2; shape++)
        for (int bi = 0; bi < N_BATCHES; bi++)
            for (int ri = 0; ri < N_ROWS; ri++)
                n_meas += (only_shape < 0 || shape == only_shape) &&
                          (!quick || batches[bi] == 1 || batches[bi] == 64 || batches[bi] == 512) &&
                          (!only_b || batches[bi] == only_b) &&
                          (!only || !strcmp(only, rows[ri].label));
    struct stepq_tool_progress prog;
    stepq_tool_progress_begin(&prog, "bench kernels", "rows", n_meas);
    for (int shape = 0; shape < 2 && rc == 0; shape++) {
        if (only_shape >= 0 && shape != only_shape)
            continue;
        stepq_arch arch = shape ? STEPQ_ARCH_KDA : STEPQ_ARCH_GDN;
        int H = shape ? 32 : 16, HV = 32, ng = shape ? D : 1;
        /* the quantized methods' pools, opened at their first row, closed with the shape */
        stepq_map_t *maps[N_METHODS] = { 0 };
        stepq_pool_t *pools[N_METHODS] = { 0 };
        size_t blocks[N_METHODS] = { 0 };
        stepq_tool_printf(tout, "%s\n", shape_name[shape]);
        stepq_tool_printf(tout, "%-26s %5s %10s %12s %9s %7s %8s", "method", "B", "us", "bytes",
                          "GB/s", "copy%", "vs fp32");
        if (measured)
            stepq_tool_printf(tout, " %9s %8s\n", "peer us", "vs peer");
        else
            stepq_tool_printf(tout, " %12s\n", "peer us (q)");
        for (int bi = 0; bi < N_BATCHES && rc == 0; bi++) {
            int B = batches[bi];
            if (quick && B != 1 && B != 64 && B != 512)
                continue;
            if (only_b && B != only_b)
                continue;
            double fp32_us = 0;
            size_t io_bytes = (size_t)B * (2 * H * D + HV * D + HV * ng + HV + HV * D) * 4;
            for (int ri = 0; ri < N_ROWS && rc == 0; ri++) {
                const struct row *rw = &rows[ri];
                const struct method *me = &methods[rw->method];
                const int step = is_step(rw->kind);
                if (only && strcmp(only, rw->label))
                    continue;
                struct ctx c;
                memset(&c, 0, sizeof(c));
                c.kind = rw->kind;
                c.prep = rw->prep;
                c.s = ts;
                c.dense = dstate;
                c.stride = (size_t)HV * D * D;
                stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
                a.batch = B;
                a.slot_ids = dslots;
                a.q = q;
                a.k = k;
                a.v = v;
                a.g = g;
                a.beta = beta;
                a.A_log = A_log;
                a.dt_bias = dt_bias;
                a.o = o;
                a.flags = STEPQ_STEP_L2NORM | STEPQ_STEP_GATE_IN_KERNEL | STEPQ_STEP_BETA_SIGMOID;
                c.args = a;
                stepq_prefill_args pf = STEPQ_PREFILL_ARGS_INITIALIZER;
                pf.n = B;
                pf.slot_ids = dslots;
                pf.states = dstate;
                pf.dtype = kind_dtype(rw->kind);
                pf.layout = kind_layout(rw->kind);
                c.pf = pf;
                const size_t dense_f32 = (size_t)B * HV * D * D * 4;
                size_t state_rw;
                if (me->budget == 0) {
                    fx_dense_kernel_args(arch, H, HV, MAX_B + 1, &c.args, ts, &c.ka);
                    state_rw = rw->kind == K_DENSE_F32 ? 2 * dense_f32 : dense_f32;
                    /* the fp32 rows before left fp32 bits: make the bf16 view finite again */
                    if (rw->kind == K_DENSE_BF16 &&
                        !fill_states(dstate, (size_t)(MAX_B + 1) * HV * D * D * 4, 0.05f))
                        rc = 1;
                } else {
                    const int mi = rw->method;
                    if (!pools[mi] && open_pool(me, arch, H, HV, no_pivots, s, &maps[mi],
                                                &pools[mi], &blocks[mi]) < 0) {
                        rc = 1;
                        break;
                    }
                    c.pool = pools[mi];
                    /*
                     * Valid pages: pack random fp32 states into every slot used. A pack from
                     * bf16 reads the bf16 states unpacked from them (the dense buffer's fp32
                     * bits read as bf16 would hold NaNs and infinities).
                     */
                    stepq_prefill_args fill = pf;
                    fill.dtype = STEPQ_DTYPE_FP32;
                    fill.layout = STEPQ_STATE_LAYOUT_KV;
                    /*
                     * A pack reads the dense states by entry: fresh ones, not what the rows
                     * before left there. A bf16 unpack's words read as fp32 hold zeros and
                     * denormals (a bf16 zero in the high half): behind such a row the fp8 pack
                     * rows measured 1.6x slower, both kernels (kernels/cuda/README.md, "fp8
                     * pages").
                     */
                    if (is_pack(rw->kind) &&
                        !fill_states(dstate, (size_t)B * HV * D * D * 4, 0.05f))
                        rc = 1;
                    if (rc == 0 && (stepq_pool_prefill_pack(c.pool, 0, &fill, s) < 0 ||
                                    !cu_ok(cudaStreamSynchronize(s), "pack")))
                        rc = 1;
                    fill.dtype = STEPQ_DTYPE_BF16;
                    if (rc == 0 && is_pack(rw->kind) && kind_dtype(rw->kind) == STEPQ_DTYPE_BF16 &&
                        (stepq_pool_prefill_unpack(c.pool, 0, &fill, s) < 0 ||
                         !cu_ok(cudaStreamSynchronize(s), "unpack")))
                        rc = 1;
                    /*
                     * The internal entries run on the pool's own layer (its pages, layouts,
                     * row impact) with a handle of their kernel choice: the two-stage row the
                     * shipped kernels, an "(old)" row the column kernels, on pages written by
                     * the shipped pack.
                     */
                    if (rc == 0 && (rw->prep || rw->kind == K_PACKED_2S) &&
                        (fx_packed_layer(c.pool, 0, &c.pl) < 0 ||
                         fx_kernel_args(c.pool, &c.args, ts, &c.ka) < 0 ||
                         stepq__cuda_layer_prepare_ex(&c.pl, rw->prep, &c.L) < 0))
                        rc = 1;
                    if (rc)
                        fprintf(stderr, "stepq bench kernels: %s\n", stepq_last_error());
                    /* A pack or unpack moves the pages one way and the dense states the other. */
                    const int bf16_side = kind_dtype(rw->kind) == STEPQ_DTYPE_BF16;
                    state_rw = (size_t)B * blocks[mi];
                    state_rw += step ? state_rw : bf16_side ? dense_f32 / 2 : dense_f32;
                    if (rw->kind == K_PACKED_2S)
                        state_rw += 2 * dense_f32; /* scratch write + read */
                }
                double us = -1;
                int timed = rc == 0 ? (graph ? fx_time_graph_us(launch, &c, ts, &us)
                                             : fx_time_us(launch, &c, ts, &us))
                                    : STEPQ_OK;
                if (timed == STEPQ_ENOTSUP && graph) {
                    /* it ran eagerly but does not capture: a row that says so, not a failure */
                    stepq_tool_printf(tout, "%-26s %5d %10s  (%s)\n", rw->label, B, "-",
                                      stepq_last_error());
                    if (jf) {
                        json_row_head(jf, first_row, shape, rw->label, B);
                        fputs("\"us\": null, \"not_capturable\": ", jf);
                        stepq_tool_json_str(jf, stepq_last_error());
                        fputs("}", jf);
                        first_row = 0;
                    }
                    stepq_tool_progress_add(&prog, 1);
                    stepq__cuda_layer_release(c.L);
                    continue;
                }
                if (timed < 0) {
                    fprintf(stderr, "stepq bench kernels: %s\n", stepq_last_error());
                    rc = 1;
                }
                stepq_tool_progress_add(&prog, 1);
                size_t bytes = state_rw + (step ? io_bytes : 0);
                if (ri == 0)
                    fp32_us = us;
                double gbs = bytes / (us * 1e-6) / 1e9;
                /* The peer runs a decode step on fp32 states: measured, next to every step
                 * row; quoted, on the fp32 row. */
                double pus = (measured ? step : ri == 0) ? peer.us[shape][bi] : 0;
                double quoted = ri == 0 ? peer_us_quoted[shape][bi] : 0;
                if (rc == 0) {
                    char sp[16] = "-", pc[16] = "-", vp[16] = "-";
                    if (step && fp32_us > 0)
                        snprintf(sp, sizeof(sp), "%.2fx", fp32_us / us);
                    if (pus > 0) {
                        snprintf(pc, sizeof(pc), "%.0f", pus);
                        snprintf(vp, sizeof(vp), "%.2fx", pus / us);
                    }
                    stepq_tool_printf(tout, "%-26s %5d %10.1f %12zu %9.0f %6.1f%% %8s", rw->label,
                                      B, us, bytes, gbs, 100.0 * gbs / copy_gbs, sp);
                    if (measured)
                        stepq_tool_printf(tout, " %9s %8s\n", pc, vp);
                    else
                        stepq_tool_printf(tout, " %12s\n", pus > 0 ? pc : "");
                    if (jf) {
                        json_row_head(jf, first_row, shape, rw->label, B);
                        fprintf(jf,
                                "\"us\": %.2f, \"bytes\": %zu, \"gbs\": %.1f, \"copy_frac\": %.4f, "
                                "\"speedup_vs_fp32\": %.3f, ",
                                us, bytes, gbs, gbs / copy_gbs, step ? fp32_us / us : 0.0);
                        if (quoted > 0)
                            fprintf(jf, "\"peer_us_quoted\": %.0f, ", quoted);
                        else
                            fprintf(jf, "\"peer_us_quoted\": null, ");
                        if (pus > 0)
                            fprintf(jf, "\"peer_us\": %.2f, \"speedup_vs_peer\": %.3f}", pus,
                                    pus / us);
                        else
                            fprintf(jf, "\"peer_us\": null, \"speedup_vs_peer\": null}");
                    }
                    first_row = 0;
                }
                stepq__cuda_layer_release(c.L);
            }
        }
        for (int mi = 0; mi < N_METHODS; mi++) {
            if (pools[mi])
                stepq_pool_close(pools[mi], STEPQ_POOL_CLOSE_FORCE);
            stepq_map_close(maps[mi]);
        }
        stepq_tool_printf(tout, "\n");
    }
    if (measured)
        stepq_tool_printf(
            tout,
            "peer us: flash-linear-attention fused_recurrent_gated_delta_rule /\n"
            "fused_recurrent_kda (fp32 state) from %s, a separate process; vs peer = peer us /\n"
            "us, on the step rows at the batches the peer file has.\n",
            peer.file);
    else
        stepq_tool_printf(
            tout, "peer us (q): quoted from an earlier run (flash-linear-attention "
                  "fused_recurrent_gated_delta_rule /\n"
                  "fused_recurrent_kda, fp32 state, same H200 model), not measured by this run.\n");
    stepq_tool_progress_end(&prog);
    if (jf)
        fprintf(jf, "\n]}\n");
    if (stepq_tool_out_commit(&o_json, "bench kernels") < 0)
        rc = 1;
    if (stepq_tool_out_commit(&o_main, "bench kernels") < 0)
        rc = 1;
    cudaFree(dstate);
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(g);
    cudaFree(beta);
    cudaFree(A_log);
    cudaFree(dt_bias);
    cudaFree(o);
    cudaFree(dslots);
    if (ts)
        cudaStreamDestroy(ts);
    return rc;
}

#else /* !STEPQ_HAVE_CUDA */

int stepq_tool_bench_kernels(int argc, char **argv)
{
    struct kopts ko;
    int rc = parse_opts(argc, argv, &ko);
    if (rc)
        return rc;
    fprintf(stderr, "stepq bench kernels: this build has no CUDA support (configure with "
                    "-Dcuda=enabled); nothing measured\n");
    return 1;
}

#endif
