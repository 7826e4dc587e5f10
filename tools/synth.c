/*
 * stepq synth: synthetic GDN / KDA traces (tools/calib/trace.h format) with
 * controlled gate half-lives and key-row / value-column outliers, for tests
 * and for timing the calibrator at real model shapes. Deterministic: the
 * same arguments give byte-identical files.
 *
 * Half-lives: unit u of n (GDN head, KDA key row) gets
 *   tau_u = hl_min * (hl_max / hl_min)^(p_u / (n - 1)),
 * p a seeded permutation of 0..n-1, and per-token gates
 *   g_t = -(ln 2 / tau_u) * e_t,  e_t ~ uniform(0.5, 1.5)
 * so the mean log retention is -ln 2 / tau_u. Outliers: in every head a few
 * key channels get 8x larger k and q (key-row outliers of the state) and a few
 * value channels 8x larger v (value-column outliers).
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepq/stepq.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/calib/trace.h"

struct rng {
    uint64_t s;
};

static uint64_t rng_next(struct rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_unif(struct rng *r)
{
    return ((double)(rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double rng_gauss(struct rng *r)
{
    double u = rng_unif(r), v = rng_unif(r);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: stepq synth --out|-o PREFIX [--arch gdn|kda] [--layers N] [--H N] [--HV N]\n"
            "         [--K N] [--V N] [--streams S] [--T T] [--streams-per-file N]\n"
            "         [--halflife-min X] [--halflife-max X] [--row-outliers N] [--col-outliers N]\n"
            "         [--dtype bf16|fp32] [--seed N] [--json]\n"
            "Writes PREFIX-000.safetensors, ... (synthetic recurrent-kernel traces) and\n"
            "prints their names (--json: as a JSON document). Each file appears when it is\n"
            "complete; a failure or Ctrl-C removes the one being written. Progress on\n"
            "stderr (STEPQ_PROGRESS=off|bar|lines).\n"
            "Defaults: gdn, 2 layers, H 2, HV 4, K V 32, 2 streams of 256 tokens,\n"
            "half-lives 2 .. 20000 tokens, 2 row and 2 column outliers per head, bf16, seed 1.\n");
}

int stepq_tool_synth(int argc, char **argv)
{
    const char *out = NULL, *arch_s = "gdn", *dtype_s = "bf16";
    int json = 0;
    long layers = 2, H = 2, HV = 4, K = 32, V = 32, S = 2, T = 256, spf = 0, rows_o = 2, cols_o = 2,
         seed = 1;
    double hl_min = 2.0, hl_max = 20000.0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long *ip = NULL, lo = 1, hi = 1 << 20;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        }
        if (!v) {
            static const char *const value_opts[] = { "--H",
                                                      "--HV",
                                                      "--K",
                                                      "--T",
                                                      "--V",
                                                      "--arch",
                                                      "--col-outliers",
                                                      "--dtype",
                                                      "--halflife-max",
                                                      "--halflife-min",
                                                      "--layers",
                                                      "--out",
                                                      "--row-outliers",
                                                      "--seed",
                                                      "--streams",
                                                      "--streams-per-file",
                                                      "-o",
                                                      NULL };
            return stepq_tool_missing_value("synth", a, value_opts);
        }
        if (!strcmp(a, "--out") || !strcmp(a, "-o"))
            out = v;
        else if (!strcmp(a, "--arch"))
            arch_s = v;
        else if (!strcmp(a, "--dtype"))
            dtype_s = v;
        else if (!strcmp(a, "--halflife-min") || !strcmp(a, "--halflife-max")) {
            if (stepq_tool_real("synth", a, v, 0, 1e9, STEPQ_TOOL_OPEN_LO,
                                !strcmp(a, "--halflife-min") ? &hl_min : &hl_max) < 0)
                return 2;
        } else if (!strcmp(a, "--layers"))
            ip = &layers, hi = STEPQ__TRACE_MAX_LAYERS;
        else if (!strcmp(a, "--H"))
            ip = &H, hi = 1024;
        else if (!strcmp(a, "--HV"))
            ip = &HV, hi = 1024;
        else if (!strcmp(a, "--K"))
            ip = &K, hi = 1024;
        else if (!strcmp(a, "--V"))
            ip = &V, hi = 1024;
        else if (!strcmp(a, "--streams"))
            ip = &S, hi = 1 << 16;
        else if (!strcmp(a, "--T"))
            ip = &T, hi = 1 << 24;
        else if (!strcmp(a, "--streams-per-file"))
            ip = &spf, lo = 0;
        else if (!strcmp(a, "--row-outliers"))
            ip = &rows_o, lo = 0;
        else if (!strcmp(a, "--col-outliers"))
            ip = &cols_o, lo = 0;
        else if (!strcmp(a, "--seed"))
            ip = &seed, lo = 0, hi = 0x7fffffffL;
        else {
            fprintf(stderr, "stepq synth: unknown option '%s' (see stepq synth --help)\n", a);
            return 2;
        }
        long long n;
        if (ip && stepq_tool_int("synth", a, v, lo, hi, &n) < 0)
            return 2;
        if (ip)
            *ip = (long)n;
        i++;
    }
    if (!out) {
        usage(stderr);
        return 2;
    }
    int kda = !strcmp(arch_s, "kda");
    if (!kda && strcmp(arch_s, "gdn")) {
        fprintf(stderr, "stepq synth: --arch %s: expected gdn or kda\n", arch_s);
        return 2;
    }
    stepq__trace_dtype dt;
    if (!strcmp(dtype_s, "bf16"))
        dt = STEPQ__TRACE_BF16;
    else if (!strcmp(dtype_s, "fp32"))
        dt = STEPQ__TRACE_F32;
    else {
        fprintf(stderr, "stepq synth: --dtype %s: expected bf16 or fp32\n", dtype_s);
        return 2;
    }
    if (HV % H) {
        fprintf(stderr, "stepq synth: --HV %ld: want a multiple of --H %ld\n", HV, H);
        return 2;
    }
    if (rows_o > K || cols_o > V) {
        fprintf(stderr, "stepq synth: --%s-outliers %ld: want at most --%s %ld\n",
                rows_o > K ? "row" : "col", rows_o > K ? rows_o : cols_o, rows_o > K ? "K" : "V",
                rows_o > K ? K : V);
        return 2;
    }
    if (hl_max < hl_min) {
        fprintf(stderr, "stepq synth: --halflife-max %g: want at least --halflife-min %g\n", hl_max,
                hl_min);
        return 2;
    }
    if (spf <= 0 || spf > S)
        spf = S;

    /* Half-lives per unit and outlier channels per head, all from the seed. */
    long n_units = layers * HV * (kda ? K : 1);
    double *tau = malloc(sizeof(double) * (size_t)n_units);
    long *perm = malloc(sizeof(long) * (size_t)n_units);
    float *kscale = malloc(sizeof(float) * (size_t)(layers * HV * K));
    float *vscale = malloc(sizeof(float) * (size_t)(layers * HV * V));
    size_t rowmax = (size_t)(K > V ? K : V) * (size_t)HV;
    float *buf = malloc(sizeof(float) * rowmax);
    if (!tau || !perm || !kscale || !vscale || !buf) {
        fprintf(stderr, "stepq synth: out of memory\n");
        return 1;
    }
    struct rng r = { (uint64_t)seed * 0x2545F4914F6CDD1Dull + 17 };
    for (long u = 0; u < n_units; u++)
        perm[u] = u;
    for (long u = n_units - 1; u > 0; u--) {
        long j = (long)(rng_next(&r) % (uint64_t)(u + 1));
        long t = perm[u];
        perm[u] = perm[j];
        perm[j] = t;
    }
    for (long u = 0; u < n_units; u++)
        tau[u] = n_units > 1
                     ? hl_min * pow(hl_max / hl_min, (double)perm[u] / (double)(n_units - 1))
                     : hl_min;
    for (long i = 0; i < layers * HV * K; i++)
        kscale[i] = 1.0f;
    for (long i = 0; i < layers * HV * V; i++)
        vscale[i] = 1.0f;
    for (long h = 0; h < layers * HV; h++) {
        for (long o = 0; o < rows_o; o++)
            kscale[h * K + (long)(rng_next(&r) % (uint64_t)K)] = 8.0f;
        for (long o = 0; o < cols_o; o++)
            vscale[h * V + (long)(rng_next(&r) % (uint64_t)V)] = 8.0f;
    }

    char all_layers[STEPQ__TRACE_MAX_LAYERS * 8] = "";
    size_t pos = 0;
    for (long l = 0; l < layers; l++)
        pos +=
            (size_t)snprintf(all_layers + pos, sizeof(all_layers) - pos, "%s%ld", l ? "," : "", l);
    /* Progress in bytes: per token and stream, q and k, v, g (fp32) and beta of every layer. */
    size_t ds = stepq__trace_dtype_size(dt);
    int64_t total = (int64_t)S * T * layers *
                    (int64_t)((2 * H * K + HV * V + HV) * ds + HV * (kda ? K : 1) * 4);
    struct stepq_tool_progress prog;
    struct stepq_tool_out of;
    stepq_tool_progress_begin(&prog, "synth", "B", total);
    if (json)
        printf("{\"files\": [");
    int rc = 0, nfile = 0;
    for (long s0 = 0; s0 < S && !rc; s0 += spf, nfile++) {
        long ns = s0 + spf <= S ? spf : S - s0;
        int nt = (int)layers * 5;
        struct stepq__trace_wtensor *wt = calloc((size_t)nt, sizeof(*wt));
        char(*names)[32] = calloc((size_t)nt, 32);
        if (!wt || !names) {
            fprintf(stderr, "stepq synth: out of memory\n");
            return 1;
        }
        static const char *const tn[5] = { "q", "k", "v", "g", "beta" };
        for (long l = 0; l < layers; l++)
            for (int k = 0; k < 5; k++) {
                struct stepq__trace_wtensor *t = &wt[l * 5 + k];
                snprintf(names[l * 5 + k], 32, "layer%ld.%s", l, tn[k]);
                t->name = names[l * 5 + k];
                t->dtype = k == 3 ? STEPQ__TRACE_F32 : dt;
                t->shape[0] = ns;
                t->shape[1] = T;
                if (k <= 1) {
                    t->ndim = 4;
                    t->shape[2] = H;
                    t->shape[3] = K;
                } else if (k == 2) {
                    t->ndim = 4;
                    t->shape[2] = HV;
                    t->shape[3] = V;
                } else if (k == 3 && kda) {
                    t->ndim = 4;
                    t->shape[2] = HV;
                    t->shape[3] = K;
                } else {
                    t->ndim = 3;
                    t->shape[2] = HV;
                }
            }
        char sH[24], sHV[24], sK[24], sV[24], sso[24], sns[24], sst[24], sT[24], ssc[32], sseed[24];
        char shl[64];
        snprintf(sH, sizeof(sH), "%ld", H);
        snprintf(sHV, sizeof(sHV), "%ld", HV);
        snprintf(sK, sizeof(sK), "%ld", K);
        snprintf(sV, sizeof(sV), "%ld", V);
        snprintf(sso, sizeof(sso), "%ld", s0);
        snprintf(sns, sizeof(sns), "%ld", ns);
        snprintf(sst, sizeof(sst), "%ld", S);
        snprintf(sT, sizeof(sT), "%ld", T);
        snprintf(ssc, sizeof(ssc), "%.9g", 1.0 / sqrt((double)K));
        snprintf(sseed, sizeof(sseed), "%ld", seed);
        snprintf(shl, sizeof(shl), "%g..%g", hl_min, hl_max);
        const char *meta[] = { "format",
                               "stepq-trace",
                               "version",
                               "1",
                               "arch",
                               arch_s,
                               "H",
                               sH,
                               "HV",
                               sHV,
                               "K",
                               sK,
                               "V",
                               sV,
                               "qk_heads",
                               "H",
                               "qk_l2norm",
                               "1",
                               "scale",
                               ssc,
                               "all_layers",
                               all_layers,
                               "layers",
                               all_layers,
                               "stream_offset",
                               sso,
                               "n_streams",
                               sns,
                               "streams_total",
                               sst,
                               "seq_len",
                               sT,
                               "source",
                               "synthetic",
                               "split",
                               "synthetic",
                               "tool",
                               "stepq synth",
                               "seed",
                               sseed,
                               "halflife",
                               shl };
        char path[4096];
        snprintf(path, sizeof(path), "%s-%03d.safetensors", out, nfile);
        struct stepq__trace_writer *w;
        if (stepq_tool_out_reserve(&of, "synth", path) < 0) {
            free(wt);
            free(names);
            rc = 1;
            break;
        }
        int st = stepq__trace_writer_open(of.tmp, wt, nt, meta,
                                          (int)(sizeof(meta) / sizeof(meta[0]) / 2), &w);
        if (st < 0) {
            stepq_tool_path_error("synth", path, of.tmp, stepq_last_error(), 0);
            stepq_tool_out_discard(&of);
            free(wt);
            free(names);
            rc = 1;
            break;
        }
        for (long l = 0; l < layers && !rc; l++) {
            for (int k = 0; k < 5 && !rc; k++) {
                /* One generator per (layer, tensor, stream): files split by streams agree. */
                for (long s = s0; s < s0 + ns && !rc; s++) {
                    struct rng tr = { ((uint64_t)seed << 32) ^ ((uint64_t)l << 20) ^
                                      ((uint64_t)k << 16) ^ (uint64_t)s ^ 0x5DEECE66Dull };
                    for (long t = 0; t < T && !rc; t++) {
                        size_t n = 0;
                        if (k <= 1) {
                            for (long h = 0; h < H; h++)
                                for (long i = 0; i < K; i++) {
                                    /* q/k head h feeds value heads h*rep..; use the first's
                                     * outliers */
                                    long hv0 = h * (HV / H);
                                    buf[n++] =
                                        (float)(rng_gauss(&tr) * kscale[(l * HV + hv0) * K + i]);
                                }
                        } else if (k == 2) {
                            for (long h = 0; h < HV; h++)
                                for (long j = 0; j < V; j++)
                                    buf[n++] =
                                        (float)(rng_gauss(&tr) * vscale[(l * HV + h) * V + j]);
                        } else if (k == 3) {
                            for (long h = 0; h < HV; h++)
                                for (long i = 0; i < (kda ? K : 1); i++) {
                                    long u = (l * HV + h) * (kda ? K : 1) + i;
                                    double e = 0.5 + rng_unif(&tr);
                                    buf[n++] = (float)(-(0.69314718055994531 / tau[u]) * e);
                                }
                        } else {
                            for (long h = 0; h < HV; h++)
                                buf[n++] = (float)(1.0 / (1.0 + exp(-rng_gauss(&tr))));
                        }
                        if (stepq__trace_writer_put(w, buf, n) < 0) {
                            stepq_tool_path_error("synth", path, of.tmp, stepq_last_error(), 0);
                            rc = 1;
                        }
                        stepq_tool_progress_add(&prog, (int64_t)(n * (k == 3 ? 4 : ds)));
                    }
                }
            }
        }
        if (stepq__trace_writer_close(w) < 0 && !rc) {
            stepq_tool_path_error("synth", path, of.tmp, stepq_last_error(), 0);
            rc = 1;
        }
        free(wt);
        free(names);
        if (rc)
            stepq_tool_out_discard(&of);
        else if (stepq_tool_out_commit(&of, "synth") < 0)
            rc = 1;
        else if (json) {
            printf("%s", nfile ? ", " : "");
            stepq_tool_json_str(stdout, path);
        } else {
            printf("%s\n", path);
        }
    }
    stepq_tool_progress_end(&prog);
    if (json)
        printf("]%s}\n", rc ? ", \"failed\": true" : "");
    free(tau);
    free(perm);
    free(kscale);
    free(vscale);
    free(buf);
    return rc;
}
