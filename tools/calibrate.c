/*
 * stepq calibrate: precision maps from recurrent-kernel traces (the choices
 * and the evidence behind the defaults are in tools/CALIBRATION.md).
 *
 * Per head (one job; jobs run on --threads threads, each job reads its
 * streams in order and writes only its own results, so the output does not
 * depend on the thread count):
 *   1. replay every stream through the fp32 reference; accumulate the mean
 *      log retention (per head, or per key row for KDA), the row impact
 *      omega_i = E[(A_t^T q_t)_i^2], the mean squared readout E||o_t||^2,
 *      and keep the state at --samples evenly spaced steps per stream;
 *   2. w_i = (omega_i / geomean(omega))^(1/8), floored at --w-floor, then
 *      renormalised to geometric mean 1 (spatial, stepq);
 *   3. distortion d_u(b) per candidate width from the kept states quantized
 *      with the method's own fit (stepq: the dual-axis fit at --row-split, which
 *      the map then records as its row_split):
 *        mse          mean squared reconstruction error per value (the paper)
 *        readout      sum_i omega_i sum_j Z_ij^2 / n_u (error read by the next query)
 *        propagated   sum over the next --prop-steps reads of ||(Phi Z)^T q_s||^2 / n_u,
 *                     the error carried by the real transitions A_s (delta
 *                     feedback included), plus a gate-only tail up to the
 *                     horizon H (mean of the last 16 reads x sum_j exp(2 j l_u)), GDN only
 *   4. unit cost c_u(b) = n_u * weight_u * d_u(b), weight_u = lambda_u (--lifetime gate,
 *      lambda_u = sum_{j<H} exp(2 j l_u)) or 1 (--lifetime none), divided by
 *      E||o||^2 of the head with --normalize output (the model reads each head
 *      through its own RMS norm, so relative readout error is what matters).
 * Then pivots (temporal, stepq): the round(pivot_fraction * U) units of
 * highest c_u(max B); allocation: a multiple-choice knapsack over the rest,
 * sum_u b_u <= floor(budget * U - 8 * pivots) (all units hold the same
 * number of values), exact DP when small enough.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/quant.h"
#include "plugin/err.h"
#include "stepq/stepq.h"
#include "tools/calib/calib.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/calib/trace.h"

enum { DIST_MSE, DIST_READOUT, DIST_PROP };
#define TAIL_FIT 16 /* reads averaged for the gate-only tail of --distortion propagated */
static const char *const dist_names[] = { "mse", "readout", "propagated" };

struct copts {
    stepq_method method;
    double budget;
    int horizon;
    int cand[8], n_cand;
    double pivot_fraction; /* < 0: default for the arch */
    int threads;
    int samples;
    int prop_steps;
    int dist;
    int lifetime_gate;
    int normalize_out;
    double w_floor;
    const char *report;
    double row_split; /* the dual-axis fit's row split (dsq, spatial, stepq): 0.5 by default */
    stepq_decode_fit decode_fit; /* recorded in the map only: calibration fits exactly */
    stepq_arith arith;           /* likewise: calibration computes in fp32 */
};

struct head_res {
    double *lret;  /* [rows]: mean g per unit row (GDN: 1 value) */
    float *w;      /* [K] */
    double out2;   /* mean ||o||^2 per token */
    double *dist;  /* [n_cand][rows] */
    double *omega; /* [K] */
    int rc;
};

struct cctx {
    const struct stepq__trace_set *ts;
    const struct stepq__trace_info *I;
    const struct copts *o;
    struct head_res *res; /* [n_layers * HV] */
    struct stepq_tool_progress *prog;
};

static void head_job(void *vctx, int job, int worker);

/* A head through the progress report. */
static void head_job_progress(void *vctx, int job, int worker)
{
    head_job(vctx, job, worker);
    stepq_tool_progress_add(((struct cctx *)vctx)->prog, 1);
}

static void head_job(void *vctx, int job, int worker)
{
    (void)worker;
    struct cctx *c = vctx;
    const struct stepq__trace_info *I = c->I;
    const struct copts *o = c->o;
    int li = job / I->HV, hv = job % I->HV;
    int K = I->K, V = I->V, T = I->T, S = I->n_streams, kda = I->arch == STEPQ_ARCH_KDA;
    int rows = kda ? K : 1;
    struct head_res *r = &c->res[job];
    size_t KV = (size_t)K * V;

    int P = o->dist == DIST_PROP ? o->prop_steps : 0;
    if (P > T / 2)
        P = T / 2;
    /* Sample steps: evenly spaced in [T/8, T - 1 - P]. */
    int ns = o->samples, t_lo = T / 8, t_hi = T - 1 - P;
    if (t_hi < t_lo)
        t_lo = t_hi;
    if (ns > t_hi - t_lo + 1)
        ns = t_hi - t_lo + 1;
    if (ns < 1)
        ns = 1;
    int *tsamp = malloc(sizeof(int) * (size_t)ns);
    float *snap = malloc(sizeof(float) * KV * (size_t)ns * (size_t)S);
    float *St = calloc(KV, sizeof(float)), *X = malloc(sizeof(float) * KV);
    float *E = malloc(sizeof(float) * KV), *ob = malloc(sizeof(float) * (size_t)V);
    struct stepq__calib_head *hd = calloc((size_t)S, sizeof(*hd));
    r->lret = calloc((size_t)rows, sizeof(double));
    r->omega = calloc((size_t)K, sizeof(double));
    r->w = malloc(sizeof(float) * (size_t)K);
    r->dist = calloc((size_t)o->n_cand * rows, sizeof(double));
    if (!tsamp || !snap || !St || !X || !E || !ob || !hd || !r->lret || !r->omega || !r->w ||
        !r->dist) {
        r->rc = stepq__error(STEPQ_ENOMEM, "calibrate: out of memory");
        goto out;
    }
    for (int i = 0; i < ns; i++)
        tsamp[i] = ns > 1 ? t_lo + (int)((long long)(t_hi - t_lo) * i / (ns - 1)) : t_hi;

    double out2 = 0.0;
    for (int s = 0; s < S; s++) {
        if ((r->rc = stepq__calib_head_load(c->ts, s, li, hv, &hd[s])) < 0)
            goto out;
        struct stepq__calib_head *h = &hd[s];
        memset(St, 0, sizeof(float) * KV);
        int si = 0;
        for (int t = 0; t < T; t++) {
            const float *q = h->q + (size_t)t * K, *k = h->k + (size_t)t * K;
            const float *g = h->g + (size_t)t * rows;
            double kq = 0.0;
            for (int i = 0; i < K; i++)
                kq += (double)k[i] * q[i];
            double e0 = exp((double)g[0]); /* GDN: one gate for every row */
            for (int i = 0; i < K; i++) {
                double a = (kda ? exp((double)g[i]) : e0) * (q[i] - h->beta[t] * kq * k[i]);
                r->omega[i] += a * a;
            }
            for (int i = 0; i < rows; i++)
                r->lret[i] += g[i];
            stepq__calib_step(St, h, t, ob);
            for (int j = 0; j < V; j++)
                out2 += (double)ob[j] * ob[j];
            if (si < ns && t == tsamp[si]) {
                memcpy(snap + ((size_t)s * ns + si) * KV, St, sizeof(float) * KV);
                si++;
            }
        }
        if (o->dist != DIST_PROP)
            stepq__calib_head_free(h);
    }
    double ntok = (double)S * T;
    for (int i = 0; i < rows; i++)
        r->lret[i] /= ntok;
    for (int i = 0; i < K; i++)
        r->omega[i] /= ntok;
    r->out2 = out2 / ntok;

    /* Row impact: w = (omega / geomean)^(1/8), floored, geometric mean 1. */
    {
        double mean = 0.0, lg = 0.0;
        for (int i = 0; i < K; i++)
            mean += r->omega[i];
        mean /= K;
        double fl = mean > 0 ? mean * 1e-12 : 1e-30;
        for (int i = 0; i < K; i++)
            lg += log(r->omega[i] > fl ? r->omega[i] : fl);
        lg /= K;
        double wl = 0.0;
        double *wd = malloc(sizeof(double) * (size_t)K);
        if (!wd) {
            r->rc = stepq__error(STEPQ_ENOMEM, "calibrate: out of memory");
            goto out;
        }
        for (int i = 0; i < K; i++) {
            double om = r->omega[i] > fl ? r->omega[i] : fl;
            double w = exp((log(om) - lg) / 8.0);
            wd[i] = w < o->w_floor ? o->w_floor : w;
            wl += log(wd[i]);
        }
        wl /= K;
        for (int i = 0; i < K; i++)
            r->w[i] = (float)(wd[i] / exp(wl));
        free(wd);
    }

    if (o->method != STEPQ_METHOD_TEMPORAL && o->method != STEPQ_METHOD_STEPQ)
        goto out; /* single-width methods need no distortion */
    for (int ci = 0; ci < o->n_cand; ci++) {
        uint8_t rb[STEPQ__MAX_HEAD_DIM];
        memset(rb, o->cand[ci], sizeof(rb));
        struct stepq__calib_quant qz;
        if ((r->rc = stepq__calib_quant_init(&qz, o->method, I->arch, K, V, rb, r->w)) < 0)
            goto out;
        qz.hl.row_split = o->row_split; /* the fit the map's pools will run */
        double *d = r->dist + (size_t)ci * rows;
        for (int s = 0; s < S; s++) {
            for (int si = 0; si < ns; si++) {
                const float *x0 = snap + ((size_t)s * ns + si) * KV;
                memcpy(X, x0, sizeof(float) * KV);
                stepq__calib_quant_apply(&qz, X);
                for (size_t e = 0; e < KV; e++)
                    E[e] = X[e] - x0[e];
                if (o->dist == DIST_PROP) {
                    double acc = 0.0, tail = 0.0;
                    int np = 0, nt = 0;
                    for (int p = 1; p <= P && tsamp[si] + p < T; p++) {
                        int tt = tsamp[si] + p;
                        double re = stepq__calib_err_step_read(E, &hd[s], tt, 1);
                        acc += re;
                        np = p;
                        if (p > P - TAIL_FIT) {
                            tail += re;
                            nt++;
                        }
                    }
                    /* Reads beyond the followed ones, up to the horizon: the last reads' mean
                     * times the gate-only decay sum_{j=1}^{H-np} e2^j (e2 = exp(2 l_u)). */
                    if (nt && o->horizon > np) {
                        double e2 = exp(2.0 * r->lret[0]), n_more = (double)(o->horizon - np);
                        double geo = e2 >= 1.0 ? n_more : e2 * (1.0 - pow(e2, n_more)) / (1.0 - e2);
                        acc += tail / nt * geo;
                    }
                    d[0] += acc / (double)KV;
                } else {
                    for (int i = 0; i < K; i++) {
                        double rs = 0.0;
                        for (int j = 0; j < V; j++)
                            rs += (double)E[(size_t)i * V + j] * E[(size_t)i * V + j];
                        if (o->dist == DIST_READOUT)
                            rs *= r->omega[i];
                        d[kda ? i : 0] += rs / (double)(kda ? V : (int)KV);
                    }
                }
            }
        }
        for (int i = 0; i < rows; i++)
            d[i] /= (double)S * ns;
        stepq__calib_quant_free(&qz);
    }
out:
    if (hd)
        for (int s = 0; s < S; s++)
            stepq__calib_head_free(&hd[s]);
    free(hd);
    free(tsamp);
    free(snap);
    free(St);
    free(X);
    free(E);
    free(ob);
}

static void usage(FILE *f)
{
    fprintf(
        f, "usage: stepq calibrate --trace F... --budget B --method M --out MAP [options]\n"
           "Writes the map MAP (-o MAP too); a summary on stderr (--json: on stdout, as JSON);\n"
           "progress per head on stderr (STEPQ_PROGRESS=off|bar|lines).\n"
           "  --method uniform|dsq|spatial|temporal|stepq   --budget 2..8 (widths for single-width "
           "methods)\n"
           "           fp32|bf16|fp16|fp8: one fixed format, nothing to calibrate (--budget "
           "ignored)\n"
           "  --horizon H          lifetime-weight horizon (default 2048)\n"
           "  --candidates 3,4,5,6 candidate widths (default: see tools/CALIBRATION.md)\n"
           "  --pivot-fraction P   fp16 pivot units, fraction of all units (default 1.39%% GDN, "
           "0.625%% KDA)\n"
           "  --distortion mse|readout|propagated   (default propagated for GDN, readout for KDA)\n"
           "  --lifetime gate|none weight d_u by lambda_u (default: gate unless propagated)\n"
           "  --normalize output|none  divide by the head's mean squared readout (default output)\n"
           "  --samples N          states kept per stream and head (default 4)\n"
           "  --prop-steps N       reads followed by --distortion propagated (default 64)\n"
           "  --w-floor X          row-impact floor before renormalisation (default 0.05)\n"
           "  --row-split A        dsq, spatial, stepq: the dual-axis fit divides row i by\n"
           "                       max|x_i|^A / sqrt(w_i), A in (0, 1] (default 0.5); the\n"
           "                       distortions are measured with it and the map records it\n"
           "                       as row_split (both backends fit with it)\n"
           "  --decode-fit F       dsq, spatial, stepq: the map's decode_fit, exact (default),\n"
           "                       norefit (decode steps skip the column refit) or rows\n"
           "                       (decode steps keep the page's column scales and refit\n"
           "                       the row scales); the distortions are still measured\n"
           "                       with the exact fit\n"
           "  --arith A            dsq, spatial, stepq: the map's arith, the decode step's\n"
           "                       arithmetic, fp32 (default) or fp16 (needs --decode-fit\n"
           "                       exact or norefit); the distortions are still measured\n"
           "                       in fp32\n"
           "  --threads N          default: online CPUs, at most one per head\n"
           "  --report FILE        per-unit statistics and costs as JSON\n"
           "  --conv-kernel N      conv state width + 1 for the map's shape (default 4)\n"
           "  --model-name NAME    model name written into the map\n");
}

static int parse_cands(const char *s, int *c, int *n)
{
    *n = 0;
    while (*s) {
        char *e;
        long v = strtol(s, &e, 10);
        if (e == s || !stepq__format_int_bits((int)v) || (*n && v <= c[*n - 1]) || *n >= 6)
            return -1;
        c[(*n)++] = (int)v;
        if (*e == ',')
            e++;
        else if (*e)
            return -1;
        s = e;
    }
    return *n ? 0 : -1;
}

struct risk {
    double r;
    int u;
};

static int cmp_risk_q(const void *a, const void *b)
{
    const struct risk *x = a, *y = b;
    if (x->r != y->r)
        return x->r > y->r ? -1 : 1;
    return x->u - y->u;
}

int stepq_tool_calibrate(int argc, char **argv)
{
    /* Two lines, in the order of the fields (kept out of clang-format, which would give
     * each its own line). */
    /* clang-format off */
    struct copts o = {
        STEPQ_METHOD_STEPQ,    -1.0, 2048, { 0 }, 0, -1.0, 0, 4, 64, -1, -1, 1, 0.05, NULL, 0.5,
        STEPQ_DECODE_FIT_EXACT, STEPQ_ARITH_FP32
    };
    /* clang-format on */
    const char *out = NULL, *model_name = NULL, *candidates_arg = NULL;
    int fit_given = 0;   /* --decode-fit, exact included: refused for methods without the refit */
    int arith_given = 0; /* --arith, fp32 included: likewise */
    const char *traces[4096];
    int n_traces = 0, conv_kernel = 4, have_method = 0, lifetime_set = 0, json = 0, threads_set = 0;
    o.threads = stepq__calib_default_threads();

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        }
        if (!strcmp(a, "--trace")) {
            while (i + 1 < argc && argv[i + 1][0] != '-' && n_traces < 4096)
                traces[n_traces++] = argv[++i];
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            static const char *const value_opts[] = {
                "--budget",    "--candidates", "--conv-kernel",    "--distortion",
                "--horizon",   "--lifetime",   "--method",         "--model-name",
                "--normalize", "--out",        "--pivot-fraction", "--prop-steps",
                "--report",    "--row-split",  "--decode-fit",     "--arith",
                "--samples",   "--threads",    "--w-floor",        "-o",
                NULL
            };
            return stepq_tool_missing_value("calibrate", a, value_opts);
        }
        i++;
        long long n;
        if (!strcmp(a, "--out") || !strcmp(a, "-o"))
            out = v;
        else if (!strcmp(a, "--report"))
            o.report = v;
        else if (!strcmp(a, "--model-name"))
            model_name = v;
        else if (!strcmp(a, "--method")) {
            if (stepq_method_from_name(v, &o.method) < 0) {
                fprintf(stderr,
                        "stepq calibrate: --method %s: expected uniform, dsq, spatial, "
                        "temporal, stepq (or fp32, bf16, fp16, fp8)\n",
                        v);
                return 2;
            }
            have_method = 1;
        } else if (!strcmp(a, "--budget")) {
            if (stepq_tool_real("calibrate", a, v, 2.0, 8.0, 0, &o.budget) < 0)
                return 2;
        } else if (!strcmp(a, "--horizon")) {
            if (stepq_tool_int("calibrate", a, v, 1, 100000000, &n) < 0)
                return 2;
            o.horizon = (int)n;
        } else if (!strcmp(a, "--candidates")) {
            candidates_arg = v;
            if (parse_cands(v, o.cand, &o.n_cand) < 0) {
                fprintf(stderr,
                        "stepq calibrate: --candidates %s: expected increasing widths "
                        "from 2,3,4,5,6,8 (at most 6)\n",
                        v);
                return 2;
            }
        } else if (!strcmp(a, "--pivot-fraction")) {
            if (stepq_tool_real("calibrate", a, v, 0.0, 0.5, 0, &o.pivot_fraction) < 0)
                return 2;
        } else if (!strcmp(a, "--distortion")) {
            o.dist = !strcmp(v, "mse")          ? DIST_MSE
                     : !strcmp(v, "readout")    ? DIST_READOUT
                     : !strcmp(v, "propagated") ? DIST_PROP
                                                : -2;
            if (o.dist == -2) {
                fprintf(stderr,
                        "stepq calibrate: --distortion %s: expected mse, readout or "
                        "propagated\n",
                        v);
                return 2;
            }
        } else if (!strcmp(a, "--lifetime")) {
            o.lifetime_gate = !strcmp(v, "gate") ? 1 : !strcmp(v, "none") ? 0 : -2;
            lifetime_set = 1;
            if (o.lifetime_gate == -2) {
                fprintf(stderr, "stepq calibrate: --lifetime %s: expected gate or none\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--normalize")) {
            o.normalize_out = !strcmp(v, "output") ? 1 : !strcmp(v, "none") ? 0 : -2;
            if (o.normalize_out == -2) {
                fprintf(stderr, "stepq calibrate: --normalize %s: expected output or none\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--samples") || !strcmp(a, "--prop-steps") ||
                   !strcmp(a, "--threads") || !strcmp(a, "--conv-kernel")) {
            if (stepq_tool_int("calibrate", a, v, 1, 1000000, &n) < 0)
                return 2;
            if (!strcmp(a, "--samples"))
                o.samples = (int)n;
            else if (!strcmp(a, "--prop-steps"))
                o.prop_steps = (int)n;
            else if (!strcmp(a, "--threads"))
                o.threads = (int)n, threads_set = 1;
            else
                conv_kernel = (int)n;
        } else if (!strcmp(a, "--w-floor")) {
            if (stepq_tool_real("calibrate", a, v, 0.0, 1.0, STEPQ_TOOL_OPEN_LO, &o.w_floor) < 0)
                return 2;
        } else if (!strcmp(a, "--row-split")) {
            if (stepq_tool_real("calibrate", a, v, 0.0, 1.0, STEPQ_TOOL_OPEN_LO, &o.row_split) < 0)
                return 2;
        } else if (!strcmp(a, "--decode-fit")) {
            if (stepq_tool_decode_fit("calibrate", a, v, &o.decode_fit) < 0)
                return 2;
            fit_given = 1;
        } else if (!strcmp(a, "--arith")) {
            if (stepq_tool_arith("calibrate", a, v, &o.arith) < 0)
                return 2;
            arith_given = 1;
        } else {
            fprintf(stderr, "stepq calibrate: unknown option '%s' (see stepq calibrate --help)\n",
                    a);
            return 2;
        }
    }
    /* fp32 / bf16 / fp16 / fp8: one fixed format, so no choice to calibrate; the map of
     * the traces' shape is written, at the format's own width whatever --budget says. */
    if (!stepq__method_has_units(o.method))
        o.budget = stepq__method_fixed_bits(o.method);
    if (!n_traces || !out || o.budget < 0 || !have_method) {
        usage(stderr);
        return 2;
    }
    if (o.row_split != 0.5 && !stepq_method_has_col_scales(o.method)) {
        fprintf(stderr,
                "stepq calibrate: --row-split %g: method %s has no column scales (only dsq, "
                "spatial and stepq have the dual-axis fit it splits)\n",
                o.row_split, stepq_method_name(o.method));
        return 2;
    }
    if (fit_given && !stepq_method_has_col_scales(o.method)) {
        fprintf(stderr,
                "stepq calibrate: --decode-fit %s: method %s has no column refit (only dsq, "
                "spatial and stepq)\n",
                stepq_decode_fit_name(o.decode_fit), stepq_method_name(o.method));
        return 2;
    }
    if (arith_given && !stepq_method_has_col_scales(o.method)) {
        fprintf(stderr,
                "stepq calibrate: --arith %s: method %s has no dual-axis decode step (only dsq, "
                "spatial and stepq)\n",
                stepq_arith_name(o.arith), stepq_method_name(o.method));
        return 2;
    }
    if (o.arith == STEPQ_ARITH_FP16 && o.decode_fit == STEPQ_DECODE_FIT_ROWS) {
        fprintf(stderr,
                "stepq calibrate: --arith fp16 needs --decode-fit exact or norefit, not %s\n",
                stepq_decode_fit_name(o.decode_fit));
        return 2;
    }
    int single = o.method != STEPQ_METHOD_TEMPORAL && o.method != STEPQ_METHOD_STEPQ;
    if (single && o.budget != floor(o.budget)) {
        fprintf(stderr, "stepq calibrate: --budget %g: %s stores one width\n", o.budget,
                stepq_method_name(o.method));
        return 2;
    }

    /* The widths the allocation may choose from must reach the budget, or bits go unused. */
    if (!single && o.n_cand && o.cand[o.n_cand - 1] < o.budget)
        fprintf(stderr,
                "stepq calibrate: warning: --candidates %s: the widest is %d bits, so %g bits "
                "per value of --budget %g stay unused\n",
                candidates_arg, o.cand[o.n_cand - 1], o.budget - o.cand[o.n_cand - 1], o.budget);

    /* The outputs first: a bad path fails before the work. */
    struct stepq_tool_out o_map, o_rep;
    stepq_tool_out_reserve(&o_rep, "calibrate", NULL);
    if (!stepq_tool_out_open(&o_map, "calibrate", out))
        return 1;
    if (o.report && !stepq_tool_out_open(&o_rep, "calibrate", o.report)) {
        stepq_tool_out_discard(&o_map);
        return 1;
    }

    struct stepq__trace_set *ts;
    if (stepq__trace_set_open(traces, n_traces, &ts) < 0) {
        fprintf(stderr, "stepq calibrate: %s\n", stepq_last_error());
        stepq_tool_out_discard(&o_rep);
        stepq_tool_out_discard(&o_map);
        return 1;
    }
    const struct stepq__trace_info *I = stepq__trace_set_info(ts);
    int kda = I->arch == STEPQ_ARCH_KDA;
    if (o.dist < 0)
        o.dist = kda ? DIST_READOUT : DIST_PROP;
    if (kda && o.dist == DIST_PROP) {
        fprintf(stderr, "stepq calibrate: --distortion propagated is implemented for GDN only\n");
        stepq__trace_set_close(ts);
        stepq_tool_out_discard(&o_rep);
        stepq_tool_out_discard(&o_map);
        return 2;
    }
    if (!lifetime_set)
        o.lifetime_gate = o.dist == DIST_PROP ? 0 : 1;
    if (o.pivot_fraction < 0)
        o.pivot_fraction = kda ? 0.00625 : 0.0139;
    if (!o.n_cand) {
        /* Defaults chosen on WikiText-2 valid traces of tiny-gdn (tools/CALIBRATION.md). */
        static const int b4[] = { 3, 4, 5, 6 }, b6[] = { 4, 5, 6, 8 };
        const int *b = o.budget <= 5.0 ? b4 : b6;
        o.n_cand = 4;
        memcpy(o.cand, b, sizeof(int) * 4);
    }

    int rows = kda ? I->K : 1;
    int n_heads = I->n_layers * I->HV;
    int upl = I->HV * rows; /* units per layer */
    long long U = (long long)I->n_layers * upl;
    int n_u = kda ? I->V : I->K * I->V;
    struct head_res *res = calloc((size_t)n_heads, sizeof(*res));
    if (!res) {
        fprintf(stderr, "stepq calibrate: out of memory\n");
        stepq__trace_set_close(ts);
        stepq_tool_out_discard(&o_rep);
        stepq_tool_out_discard(&o_map);
        return 1;
    }
    struct stepq_tool_progress prog;
    struct cctx ctx = { ts, I, &o, res, &prog };
    struct timespec t0, t1;
    o.threads = threads_set           ? stepq_tool_threads("calibrate", o.threads, n_heads, "heads")
                : o.threads < n_heads ? o.threads
                                      : n_heads;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    stepq_tool_progress_begin(&prog, "calibrate", "heads", n_heads);
    stepq__calib_parallel(n_heads, o.threads, head_job_progress, &ctx, NULL);
    stepq_tool_progress_end(&prog);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int rc = 0;
    for (int h = 0; h < n_heads && !rc; h++)
        if (res[h].rc < 0) {
            fprintf(stderr, "stepq calibrate: %s\n", stepq_last_error());
            rc = 1;
        }

    /* Costs, pivots, allocation. */
    int m = o.n_cand;
    double *cost = NULL, *lam = NULL;
    int *size = NULL, *choice = NULL, *bits = NULL;
    struct risk *rk = NULL;
    int n_piv = 0, solver = -1;
    if (!rc) {
        cost = calloc((size_t)U * m, sizeof(double));
        size = calloc((size_t)U * m, sizeof(int));
        choice = calloc((size_t)U, sizeof(int));
        bits = calloc((size_t)U, sizeof(int));
        lam = calloc((size_t)U, sizeof(double));
        rk = calloc((size_t)U, sizeof(*rk));
        if (!cost || !size || !choice || !bits || !lam || !rk) {
            fprintf(stderr, "stepq calibrate: out of memory\n");
            rc = 1;
        }
    }
    if (!rc) {
        for (long long u = 0; u < U; u++) {
            int h = (int)(u / rows), i = (int)(u % rows);
            double l = res[h].lret[i];
            double e2 = exp(2.0 * l);
            /* sum_{j<H} e2^j in closed form; exact count when e2 == 1 */
            lam[u] =
                e2 >= 1.0 ? (double)o.horizon : (1.0 - pow(e2, (double)o.horizon)) / (1.0 - e2);
            double wgt = o.lifetime_gate ? lam[u] : 1.0;
            if (o.normalize_out)
                wgt /= res[h].out2 > 1e-30 ? res[h].out2 : 1e-30;
            for (int c = 0; c < m; c++) {
                double d = single ? 0.0 : res[h].dist[(size_t)c * rows + i];
                cost[u * m + c] = (double)n_u * wgt * d;
                size[u * m + c] = o.cand[c];
            }
            bits[u] = stepq__method_has_units(o.method) ? (int)o.budget : STEPQ_BITS_DENSE;
        }
        if (!single) {
            n_piv = (int)floor(o.pivot_fraction * (double)U + 0.5);
            for (long long u = 0; u < U; u++) {
                rk[u].r = cost[u * m + m - 1];
                rk[u].u = (int)u;
            }
            qsort(rk, (size_t)U, sizeof(*rk), cmp_risk_q);
            for (int p = 0; p < n_piv; p++)
                bits[rk[p].u] = STEPQ_BITS_PIVOT;
            /* Compact the non-pivot units into the solver's arrays (in unit order). */
            long long nn = 0;
            for (long long u = 0; u < U; u++) {
                if (bits[u] == STEPQ_BITS_PIVOT)
                    continue;
                memmove(cost + nn * m, cost + u * m, sizeof(double) * m);
                memmove(size + nn * m, size + u * m, sizeof(int) * m);
                nn++;
            }
            double capd = o.budget * (double)U - 8.0 * n_piv;
            long long cap = (long long)floor(capd + 1e-9);
            solver = stepq__calib_allocate((int)nn, m, cost, size, cap, 400000000LL, choice);
            if (solver < 0) {
                fprintf(stderr, "stepq calibrate: %s\n", stepq_last_error());
                rc = 1;
            } else {
                long long k = 0;
                for (long long u = 0; u < U; u++)
                    if (bits[u] != STEPQ_BITS_PIVOT)
                        bits[u] = o.cand[choice[k++]];
            }
        }
    }

    /* The map. */
    stepq_map_t *map = NULL;
    if (!rc) {
        stepq_model_shape sh;
        memset(&sh, 0, sizeof(sh));
        sh.arch = I->arch;
        sh.n_layers = I->n_layers;
        sh.layer_ids = I->layer_ids;
        sh.num_k_heads = I->H;
        sh.num_v_heads = I->HV;
        sh.head_k_dim = I->K;
        sh.head_v_dim = I->V;
        sh.conv_rank = 2;
        sh.conv_shape[0] = 2LL * I->H * I->K + (long long)I->HV * I->V;
        sh.conv_shape[1] = conv_kernel - 1;
        sh.conv_dtype = STEPQ_DTYPE_BF16;
        if (conv_kernel == 1)
            sh.conv_rank = 0;
        int st = stepq_map_create(&sh, o.method, o.budget, &map);
        if (st >= 0)
            st = stepq_map_set_row_split(map, o.row_split);
        if (st >= 0)
            st = stepq_map_set_decode_fit(map, o.decode_fit);
        if (st >= 0)
            st = stepq_map_set_arith(map, o.arith); /* after the fit it may need */
        const char *nm = model_name ? model_name : stepq__trace_set_meta(ts, "model");
        if (st >= 0 && nm)
            st = stepq_map_set_model_name(map, nm);
        for (long long u = 0; st >= 0 && stepq__method_has_units(o.method) && u < U; u++)
            st = stepq_map_set_unit_bits(map, (int)(u / upl), (int)(u % upl), bits[u]);
        if (st >= 0 && stepq__method_uses_row_impact(o.method))
            for (int h = 0; st >= 0 && h < n_heads; h++)
                st = stepq_map_set_row_impact(map, h / I->HV, h % I->HV, res[h].w);
        if (!single) {
            for (long long u = 0; st >= 0 && u < U; u++) {
                int h = (int)(u / rows), i = (int)(u % rows);
                stepq_unit_stats us = STEPQ_UNIT_STATS_INITIALIZER;
                us.log_retention = res[h].lret[i] < 0 ? res[h].lret[i] : 0.0;
                us.lambda = lam[u];
                for (int c = 0; c < m; c++)
                    us.distortion[o.cand[c]] = res[h].dist[(size_t)c * rows + i];
                st = stepq_map_set_unit_stats(map, (int)(u / upl), (int)(u % upl), &us);
            }
        }
        char data[1024], detail[512];
        const char *src = stepq__trace_set_meta(ts, "source"),
                   *split = stepq__trace_set_meta(ts, "split");
        snprintf(data, sizeof(data), "%s (%s), %d streams x %d tokens", src ? src : "?",
                 split ? split : "?", I->n_streams, I->T);
        char split_detail[80] = ""; /* only another split or fit than the default: as before */
        if (o.row_split != 0.5)
            snprintf(split_detail, sizeof(split_detail), " row_split=%g", o.row_split);
        if (o.decode_fit != STEPQ_DECODE_FIT_EXACT) {
            size_t at = strlen(split_detail);
            snprintf(split_detail + at, sizeof(split_detail) - at, " decode_fit=%s",
                     stepq_decode_fit_name(o.decode_fit));
        }
        if (o.arith != STEPQ_ARITH_FP32) {
            size_t at = strlen(split_detail);
            snprintf(split_detail + at, sizeof(split_detail) - at, " arith=%s",
                     stepq_arith_name(o.arith));
        }
        snprintf(detail, sizeof(detail),
                 "distortion=%s lifetime=%s normalize=%s samples=%d prop_steps=%d w_floor=%g "
                 "solver=%s pivots=%d%s",
                 dist_names[o.dist], o.lifetime_gate ? "gate" : "none",
                 o.normalize_out ? "output" : "none", o.samples, o.prop_steps, o.w_floor,
                 single        ? "none"
                 : solver == 0 ? "exact-dp"
                               : "lagrangian",
                 n_piv, split_detail);
        if (st >= 0)
            st = stepq_map_set_provenance(map, "tool", "stepq calibrate");
        if (st >= 0)
            st = stepq_map_set_provenance(map, "tool_version", stepq_version_string());
        if (st >= 0)
            st = stepq_map_set_provenance(map, "data", data);
        if (st >= 0)
            st = stepq_map_set_provenance(map, "method_detail", detail);
        if (st >= 0)
            st = stepq_map_set_provenance_number(map, "tokens", (double)I->n_streams * I->T);
        if (st >= 0)
            st = stepq_map_set_provenance_number(map, "segments", I->n_streams);
        if (st >= 0)
            st = stepq_map_set_provenance_number(map, "segment_length", I->T);
        if (st >= 0 && !single) {
            st = stepq_map_set_provenance_number(map, "horizon", o.horizon);
            if (st >= 0)
                st = stepq_map_set_provenance_number(map, "pivot_fraction", o.pivot_fraction);
            if (st >= 0)
                st = stepq_map_set_provenance_candidates(map, o.cand, o.n_cand);
        }
        if (st >= 0)
            st = stepq_map_validate(map);
        char *text = NULL;
        size_t len = 0;
        if (st >= 0)
            st = stepq_map_write_buffer(map, &text, &len);
        if (st < 0) {
            fprintf(stderr, "stepq calibrate: %s\n",
                    map && stepq_map_last_error(map) && *stepq_map_last_error(map)
                        ? stepq_map_last_error(map)
                        : stepq_last_error());
            rc = 1;
        } else {
            if (fwrite(text, 1, len, o_map.f) != len || stepq_tool_out_commit(&o_map, "calibrate"))
                rc = 1;
        }
        stepq_free(text);
    }

    if (!rc && o.report) {
        FILE *f = o_rep.f;
        {
            fprintf(f,
                    "{\"method\": \"%s\", \"budget\": %g, \"distortion\": \"%s\", "
                    "\"lifetime\": \"%s\", \"normalize\": \"%s\", \"horizon\": %d, ",
                    stepq_method_name(o.method), o.budget, dist_names[o.dist],
                    o.lifetime_gate ? "gate" : "none", o.normalize_out ? "output" : "none",
                    o.horizon);
            if (o.row_split != 0.5)
                fprintf(f, "\"row_split\": %g, ", o.row_split);
            if (o.decode_fit != STEPQ_DECODE_FIT_EXACT)
                fprintf(f, "\"decode_fit\": \"%s\", ", stepq_decode_fit_name(o.decode_fit));
            if (o.arith != STEPQ_ARITH_FP32)
                fprintf(f, "\"arith\": \"%s\", ", stepq_arith_name(o.arith));
            fprintf(f, "\"candidates\": [");
            for (int c = 0; c < m; c++)
                fprintf(f, "%s%d", c ? ", " : "", o.cand[c]);
            fprintf(f, "], \"units\": [\n");
            for (long long u = 0; u < U; u++) {
                int h = (int)(u / rows), i = (int)(u % rows);
                double l = res[h].lret[i];
                fprintf(f,
                        "  {\"layer\": %d, \"head\": %d, \"row\": %d, \"half_life\": %.6g, "
                        "\"lambda\": %.6g, \"out2\": %.6g, \"bits\": %d, \"dist\": [",
                        I->layer_ids[h / I->HV], h % I->HV, kda ? i : -1, stepq__calib_half_life(l),
                        lam[u], res[h].out2, bits[u]);
                for (int c = 0; c < m && !single; c++)
                    fprintf(f, "%s%.6g", c ? ", " : "", res[h].dist[(size_t)c * rows + i]);
                fprintf(f, "]}%s\n", u + 1 < U ? "," : "");
            }
            fprintf(f, "]}\n");
            if (stepq_tool_out_commit(&o_rep, "calibrate") < 0)
                rc = 1;
        }
    }
    stepq_tool_out_discard(&o_rep); /* after a failure; nothing once committed */
    stepq_tool_out_discard(&o_map);
    if (!rc) {
        int hist[17] = { 0 };
        for (long long u = 0; u < U; u++)
            hist[bits[u]]++;
        fprintf(stderr, "calibrate: %s@%g, %lld units, %.1f s on %d threads; widths:",
                stepq_method_name(o.method), o.budget, U,
                (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec),
                o.threads);
        for (int b = 2; b <= 16; b++)
            if (hist[b])
                fprintf(stderr, " %s%d x%d", b == 16 ? "fp16 " : "", b == 16 ? 16 : b, hist[b]);
        if (o.row_split != 0.5)
            fprintf(stderr, "; row_split %g", o.row_split);
        fprintf(stderr, "\n");
        if (json) {
            fputs("{\"map\": ", stdout);
            stepq_tool_json_str(stdout, out);
            printf(", \"method\": \"%s\", \"budget\": %g, \"row_split\": %g, \"decode_fit\": "
                   "\"%s\", \"arith\": \"%s\", \"units\": %lld, "
                   "\"pivots\": %d, \"distortion\": \"%s\", \"solver\": \"%s\", \"threads\": %d, "
                   "\"seconds\": %.3f, \"widths\": {",
                   stepq_method_name(o.method), o.budget, o.row_split,
                   stepq_decode_fit_name(o.decode_fit), stepq_arith_name(o.arith), U, n_piv,
                   dist_names[o.dist],
                   single        ? "none"
                   : solver == 0 ? "exact-dp"
                                 : "lagrangian",
                   o.threads,
                   (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
            for (int b = 2, first = 1; b <= 16; b++)
                if (hist[b]) {
                    printf("%s\"%d\": %d", first ? "" : ", ", b, hist[b]);
                    first = 0;
                }
            printf("}}\n");
        }
    }
    stepq_map_close(map);
    for (int h = 0; h < n_heads; h++) {
        free(res[h].lret);
        free(res[h].w);
        free(res[h].dist);
        free(res[h].omega);
    }
    free(res);
    free(cost);
    free(size);
    free(choice);
    free(bits);
    free(lam);
    free(rk);
    stepq__trace_set_close(ts);
    return rc;
}
