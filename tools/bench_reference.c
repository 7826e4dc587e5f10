/*
 * stepq bench reference: per-head decode-step time of the C reference on the
 * CPU, for the dense fp32 step and every storage method at 4, 6 and 8 bits.
 *
 * The numbers orient (how much of a step is the fit, what the reference
 * costs in calibration and tests); they set no speed goal, and say nothing
 * about the CUDA kernels (`stepq bench kernels` on the GPU host does).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/dsp.h"
#include "kernels/quant.h"
#include "tools/cli.h"
#include "tools/commands.h"

struct bench_opts {
    stepq_arch arch;
    int d_k, d_v, heads, batch;
    double min_s;
    int json;
    const char *out_path;
    FILE *f; /* the report: stdout or -o FILE */
};

static void bench_ref_usage(FILE *f)
{
    fprintf(f, "usage: stepq bench reference [--arch gdn|kda] [--dk N] [--dv N] [--heads N]\n"
               "                             [--batch N] [--min-ms N] [--json] [-o FILE]\n"
               "Times one decode step of the C reference per (request, head) on one CPU thread:\n"
               "the dense fp32 step in place, then the packed step quantize(update(dequantize))\n"
               "for fp32/bf16/fp16 and uniform/dsq/spatial/temporal/stepq at 4, 6 and 8 bits,\n"
               "with the dequantize and fit+pack parts timed alone. Defaults: gdn, 128x128,\n"
               "4 heads, batch 4, 200 ms per measurement (median of 3). --json: the rows as\n"
               "JSON; -o: into FILE. Progress per row on stderr (STEPQ_PROGRESS=off|bar|lines).\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static float rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    uint64_t x = rng_state * 0x2545F4914F6CDD1Dull;
    return (float)((double)(x >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* Median over 3 runs of the seconds per call of fn, each run >= min_s / 3. */
typedef int (*bench_fn)(void *ctx);

static double time_median(bench_fn fn, void *ctx, double min_s)
{
    double t[3];
    for (int r = 0; r < 3; r++) {
        long n = 0;
        double t0 = now_s(), el;
        do {
            if (fn(ctx) < 0)
                return -1.0;
            n++;
            el = now_s() - t0;
        } while (el < min_s / 3);
        t[r] = el / (double)n;
    }
    double a = t[0], b = t[1], c = t[2];
    return a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
}

struct ctx {
    struct stepq__step_args a;
    struct stepq__dense_states st;
    struct stepq__packed_layer pl;
    const struct stepq__head_layout *hl;
    float *tile;
    uint8_t *block;
    const float *w;
};

static int run_dense(void *p)
{
    struct ctx *c = p;
    return stepq__ref_step_dense(&c->a, &c->st);
}

static int run_packed(void *p)
{
    struct ctx *c = p;
    return stepq__ref_step_packed(&c->a, &c->pl);
}

static int run_dequant(void *p)
{
    struct ctx *c = p;
    return stepq__dequantize_head(c->hl, c->block, c->tile);
}

static int run_quant(void *p)
{
    struct ctx *c = p;
    return stepq__quantize_head(c->hl, c->tile, c->w, c->block, NULL);
}

static int parse_args(int argc, char **argv, struct bench_opts *o)
{
    static const char *const tool = "bench reference";
    long long n;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json")) {
            o->json = 1;
            continue;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_ref_usage(stdout);
            return 1;
        }
        if (!v) {
            static const char *const value_opts[] = { "--arch",  "--batch",  "--dk", "--dv",
                                                      "--heads", "--min-ms", "-o",   NULL };
            return stepq_tool_missing_value(tool, a, value_opts);
        }
        i++;
        if (!strcmp(a, "--arch")) {
            if (!strcmp(v, "gdn"))
                o->arch = STEPQ_ARCH_GDN;
            else if (!strcmp(v, "kda"))
                o->arch = STEPQ_ARCH_KDA;
            else {
                fprintf(stderr, "stepq %s: --arch '%s': want gdn or kda\n", tool, v);
                return 2;
            }
            continue;
        } else if (!strcmp(a, "-o")) {
            o->out_path = v;
            continue;
        }
        int *dst = !strcmp(a, "--dk")      ? &o->d_k
                   : !strcmp(a, "--dv")    ? &o->d_v
                   : !strcmp(a, "--heads") ? &o->heads
                   : !strcmp(a, "--batch") ? &o->batch
                                           : NULL;
        long long hi = !strcmp(a, "--heads")   ? 256
                       : !strcmp(a, "--batch") ? 4096
                                               : STEPQ__MAX_HEAD_DIM;
        if (!strcmp(a, "--min-ms")) {
            if (stepq_tool_int(tool, a, v, 1, 600000, &n) < 0)
                return 2;
            o->min_s = (double)n / 1000.0;
        } else if (dst) {
            if (stepq_tool_int(tool, a, v, 1, hi, &n) < 0)
                return 2;
            *dst = (int)n;
        } else {
            fprintf(stderr, "stepq %s: unknown option '%s' (see stepq %s --help)\n", tool, a, tool);
            return 2;
        }
    }
    return 0;
}

struct result {
    const char *name;
    int bits;
    size_t block_bytes;
    double step_s, unpack_s, pack_s; /* per head; unpack/pack < 0 when not measured */
};

static void print_result(const struct bench_opts *o, const struct result *r, int *first)
{
    double us = 1e6 * r->step_s;
    /* bytes a packed step reads and writes per head: the block, twice */
    double mbs = r->step_s > 0 ? 2.0 * (double)r->block_bytes / r->step_s / 1e6 : 0.0;
    if (o->json) {
        fprintf(o->f,
                "%s\n    {\"method\": \"%s\", \"bits\": %d, \"block_bytes\": %zu, "
                "\"step_us_per_head\": %.3f, \"dequantize_us\": %.3f, \"quantize_us\": %.3f, "
                "\"block_MBps\": %.1f}",
                *first ? "" : ",", r->name, r->bits, r->block_bytes, us,
                r->unpack_s >= 0 ? 1e6 * r->unpack_s : -1.0,
                r->pack_s >= 0 ? 1e6 * r->pack_s : -1.0, mbs);
    } else {
        char bits[16] = "-";
        if (r->bits > 0)
            snprintf(bits, sizeof(bits), "%d", r->bits);
        fprintf(o->f, "%-13s %4s %9zu %12.2f", r->name, bits, r->block_bytes, us);
        if (r->unpack_s >= 0)
            fprintf(o->f, " %11.2f %11.2f %9.1f\n", 1e6 * r->unpack_s, 1e6 * r->pack_s, mbs);
        else
            fprintf(o->f, " %11s %11s %9.1f\n", "-", "-", mbs);
    }
    *first = 0;
}

int stepq_tool_bench_reference(int argc, char **argv)
{
    struct bench_opts o = { STEPQ_ARCH_GDN, 128, 128, 4, 4, 0.2, 0, NULL, NULL };
    struct stepq_tool_out of;
    struct stepq_tool_progress prog;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    if (!(o.f = stepq_tool_out_open(&of, "bench reference", o.out_path)))
        return 1;
    /* Rows: the dense step, the dense formats once and the other methods at three widths. */
    int rows = 1;
    for (int m = STEPQ_METHOD_FP32; m < STEPQ_METHOD_COUNT; m++)
        rows += m <= STEPQ_METHOD_FP16 ? 1 : 3;
    stepq_tool_progress_begin(&prog, "bench reference", "rows", rows);

    int HV = o.heads, B = o.batch, dk = o.d_k, dv = o.d_v;
    int n_g = o.arch == STEPQ_ARCH_KDA ? dk : 1;
    size_t head = (size_t)dk * dv;
    struct ctx c;
    memset(&c, 0, sizeof(c));

    float *q = malloc(sizeof(float) * B * HV * dk), *k = malloc(sizeof(float) * B * HV * dk);
    float *v = malloc(sizeof(float) * B * HV * dv), *g = malloc(sizeof(float) * B * HV * n_g);
    float *beta = malloc(sizeof(float) * B * HV), *out = malloc(sizeof(float) * B * HV * dv);
    float *dense = malloc(sizeof(float) * (size_t)(B + 1) * HV * head);
    float *w = malloc(sizeof(float) * HV * dk);
    int32_t *slots = malloc(sizeof(int32_t) * B);
    struct stepq__head_layout *hls = calloc((size_t)HV, sizeof(*hls));
    size_t *offs = malloc(sizeof(size_t) * HV);
    uint8_t *rb = malloc((size_t)dk);
    uint8_t *pages = NULL;
    if (!q || !k || !v || !g || !beta || !out || !dense || !w || !slots || !hls || !offs || !rb) {
        fprintf(stderr, "stepq bench reference: out of memory\n");
        rc = 1;
        goto out;
    }
    for (int e = 0; e < B * HV * dk; e++) {
        q[e] = rnd();
        k[e] = rnd();
    }
    for (int e = 0; e < B * HV * dv; e++)
        v[e] = rnd();
    for (int e = 0; e < B * HV * n_g; e++)
        g[e] = -0.05f * (1.0f + rnd());
    for (int e = 0; e < B * HV; e++)
        beta[e] = 0.5f + 0.4f * rnd();
    for (size_t e = 0; e < (size_t)(B + 1) * HV * head; e++)
        dense[e] = 0.5f * rnd();
    for (int e = 0; e < HV * dk; e++)
        w[e] = 1.0f + 0.5f * rnd(); /* not normalised: the fit does not care */
    for (int b = 0; b < B; b++)
        slots[b] = b + 1;

    c.a.arch = o.arch;
    c.a.batch = B;
    c.a.H = HV;
    c.a.HV = HV;
    c.a.d_k = dk;
    c.a.d_v = dv;
    c.a.n_slots = B + 1;
    c.a.slots = slots;
    c.a.q = q;
    c.a.k = k;
    c.a.v = v;
    c.a.g = g;
    c.a.beta = beta;
    c.a.o = out;
    c.a.opt.l2norm = 1;

    if (o.json)
        fprintf(o.f,
                "{\"benchmark\": \"reference\", \"arch\": \"%s\", \"d_k\": %d, \"d_v\": %d, "
                "\"heads\": %d, \"batch\": %d, \"results\": [",
                o.arch == STEPQ_ARCH_KDA ? "kda" : "gdn", dk, dv, HV, B);
    else
        fprintf(o.f,
                "stepq bench reference: C reference, 1 CPU thread, %s head %dx%d, batch %d x %d "
                "heads\n(times per head; MB/s = packed block read + written per step time)\n\n"
                "%-13s %4s %9s %12s %11s %11s %9s\n",
                o.arch == STEPQ_ARCH_KDA ? "KDA" : "GDN", dk, dv, B, HV, "method", "bits",
                "block B", "step us", "dequant us", "fit+pack us", "MB/s");
    int first = 1;

    /* The dense fp32 step on the server's own [N, HV, K, V] tensor. */
    c.st.base = dense;
    c.st.slot_stride = (size_t)HV * head;
    c.st.layout = STEPQ__LAYOUT_KV;
    double t = time_median(run_dense, &c, o.min_s);
    if (t < 0)
        goto fail;
    struct result r0 = { "fp32 native", 0, head * 4, t / (B * HV), -1.0, -1.0 };
    print_result(&o, &r0, &first);
    stepq_tool_progress_add(&prog, 1);

    static const int widths[] = { 4, 6, 8 };
    for (int m = STEPQ_METHOD_FP32; m < STEPQ_METHOD_COUNT; m++) {
        /* fp32 / bf16 / fp16 / fp8: one format, one row (bits 0: no width to choose) */
        int fixed = !stepq__method_has_units((stepq_method)m);
        for (int wi = 0; wi < (fixed ? 1 : 3); wi++) {
            int bits = fixed ? 0 : widths[wi];
            size_t page = 0;
            memset(rb, bits, (size_t)dk);
            for (int h = 0; h < HV; h++) {
                if (stepq__head_layout_init(&hls[h], (stepq_method)m, o.arch, dk, dv, rb, 0) < 0)
                    goto fail;
                offs[h] = page;
                page += hls[h].block_bytes;
            }
            free(pages);
            pages = calloc((size_t)B + 1, page);
            if (!pages) {
                fprintf(stderr, "stepq bench reference: out of memory\n");
                rc = 1;
                goto out;
            }
            c.pl.base = pages;
            c.pl.page_stride = page;
            c.pl.n_slots = B + 1;
            c.pl.n_heads = HV;
            c.pl.heads = hls;
            c.pl.head_offset = offs;
            c.pl.row_impact = w;
            int32_t all[1] = { 0 };
            for (int s = 0; s <= B; s++) {
                all[0] = s;
                if (stepq__ref_pack(&c.pl, 1, all, dense + (size_t)s * HV * head, HV * head,
                                    STEPQ__LAYOUT_KV, NULL, NULL, NULL) < 0)
                    goto fail;
            }
            double ts = time_median(run_packed, &c, o.min_s);
            c.hl = &hls[0];
            c.block = pages + page;
            c.tile = dense;
            c.w = w;
            double tu = time_median(run_dequant, &c, o.min_s / 2);
            double tp = time_median(run_quant, &c, o.min_s / 2);
            if (ts < 0 || tu < 0 || tp < 0)
                goto fail;
            struct result r = {
                stepq_method_name((stepq_method)m), bits, hls[0].block_bytes, ts / (B * HV), tu, tp
            };
            print_result(&o, &r, &first);
            stepq_tool_progress_add(&prog, 1);
            for (int h = 0; h < HV; h++)
                stepq__head_layout_free(&hls[h]);
        }
    }
    if (o.json)
        fprintf(o.f, "\n]}\n");
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "stepq bench reference: %s\n", stepq_last_error());
    rc = 1;
out:
    stepq_tool_progress_end(&prog);
    if (rc == 0 && stepq_tool_out_commit(&of, "bench reference") < 0)
        rc = 1;
    stepq_tool_out_discard(&of);
    if (hls)
        for (int h = 0; h < HV; h++)
            stepq__head_layout_free(&hls[h]);
    free(q);
    free(k);
    free(v);
    free(g);
    free(beta);
    free(out);
    free(dense);
    free(w);
    free(slots);
    free(hls);
    free(offs);
    free(rb);
    free(pages);
    return rc;
}
