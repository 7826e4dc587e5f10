/*
 * stepq eval: replays traces with each map's storage method in the loop
 * (paper Eq. 4: the state is quantized after every update and the output is
 * read before quantization; each store fits as the pool's decode step does,
 * with the map's decode_fit, from a fresh zero page per stream) against the
 * fp32 reference, and reports per map
 * (means with standard errors over streams):
 *   - relative readout error sum ||o^ - o||^2 / sum ||o||^2 over all heads
 *     ("global") and the mean over heads of the same ratio per head ("head":
 *     GDN models read every head through its own RMS norm), over all steps
 *     and over the first / last 256 steps;
 *   - relative state error sum_t ||S^ - S||^2 / sum_t ||S||^2 per lifetime
 *     class (heads split in thirds by the gate half-life of these traces);
 *   - the gains, whether the error is biased: readout sum <o^, o> / sum ||o||^2
 *     and store sum <Q(S^), S^> / sum ||S^||^2 over every store (1: unbiased;
 *     below 1 the stored state shrinks, which acts as extra decay);
 *   - for a map whose decode_fit is rows, the fraction of head stores that fell
 *     back to the exact fit (the old column scales could not serve: a fresh
 *     page, or the growth trigger), the bound on what that fit can save;
 * and, independent of the maps:
 *   - Spearman correlation between per-unit accumulated state error
 *     D_u = sum_t ||S^_t - S_t||^2 under uniform@6 and the half-life;
 *   - the single-injection experiment (paper Appendix B.1): one uniform INT6 /
 *     INT8 quantization error injected at step t0, then no quantization;
 *     squared readout error summed over the remaining steps with native delta
 *     feedback E <- (I - beta k k^T) D E and with the exact-read oracle
 *     E <- D E; ratio oracle / native.
 * Jobs are heads (all streams of a head in order), so results do not depend
 * on --threads.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/quant.h"
#include "plugin/err.h"
#include "stepq/stepq.h"
#include "stepq_config.h"
#include "tools/calib/calib.h"
#include "tools/calib/eval.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/calib/trace.h"

struct ms {
    double mean, se;
};

static struct ms mean_se(const double *x, int n)
{
    struct ms r = { 0, 0 };
    for (int i = 0; i < n; i++)
        r.mean += x[i];
    r.mean /= n;
    if (n > 1) {
        double v = 0;
        for (int i = 0; i < n; i++)
            v += (x[i] - r.mean) * (x[i] - r.mean);
        r.se = sqrt(v / (n - 1) / n);
    }
    return r;
}

/* A number in JSON: %.6g, or null where there is none (JSON has no NaN or Inf). */
static void json_num(FILE *f, double x)
{
    if (isfinite(x))
        fprintf(f, "%.6g", x);
    else
        fputs("null", f);
}

static void json_ms(FILE *f, const char *key, struct ms v, int last)
{
    fprintf(f, "\"%s\": {\"mean\": ", key);
    json_num(f, v.mean);
    fputs(", \"se\": ", f);
    json_num(f, v.se);
    fprintf(f, "}%s", last ? "" : ", ");
}

/* A map's label: its file name without the directory and ".json" (maps of one method that
 * differ in options stay distinguishable), else method@budget. */
static void map_label(char *buf, size_t len, const char *path, stepq_map_t *map)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t n = strlen(b);
    if (n > 5 && !strcmp(b + n - 5, ".json"))
        n -= 5;
    if (n > 0 && n < len && !strpbrk(b, "\"\\")) {
        memcpy(buf, b, n);
        buf[n] = 0;
    } else {
        snprintf(buf, len, "%s@%g", stepq_method_name(stepq_map_method(map)),
                 stepq_map_budget_bits(map));
    }
}

/* The plot group of method m: 0 (budget <= 4 bits), 1 (5-6 bits, dense maps and the internal
 * uniform@6) or 2 (7-8 bits); -1 for fp32 maps, which are not plotted. */
static int chart_group(stepq_map_t *const *maps, int n_maps, int m)
{
    if (m >= n_maps)
        return 1;
    if (stepq_map_method(maps[m]) == STEPQ_METHOD_FP32)
        return -1;
    double bb = stepq_map_budget_bits(maps[m]);
    return bb > 8.0 ? 1 : bb <= 4.0 ? 0 : bb <= 6.0 ? 1 : 2;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: stepq eval --map M... --trace F... [--json [FILE]] [-o FILE] [--classes]\n"
               "                  [--plot DIR] [--threads N] [--inject-step T] [--bucket N]\n"
               "                  [--row-split A] [--arith fp32|fp16]\n"
               "Replays the traces with every map's method in the loop against the fp32\n"
               "reference and prints a table of readout errors (a legend follows it).\n"
               "Each store fits as the pool's decode step does: the map's decode_fit\n"
               "(exact unless it says norefit or rows), from a fresh page per stream; a\n"
               "map whose arith is fp16 steps in fp16 the heads its pool steps in fp16\n"
               "(GDN integer heads; KDA heads with an integer row), the others in fp32.\n"
               "  --json         every detail (curves, per-head and per-class errors) as JSON\n"
               "                 on stdout instead of the table\n"
               "  --json FILE    the JSON into FILE and the table on stdout as well\n"
               "  -o FILE        what goes to stdout goes into FILE instead\n"
               "  --classes      three more table columns: the relative state error of the\n"
               "                 short-, middle- and long-lived third of the heads\n"
               "  --plot DIR     PNG charts (python3 with matplotlib), created when missing\n"
               "  --threads N    default: online CPUs, at most one per head\n"
               "  --inject-step  the single-injection step (default 256, T/4 for T <= 1024)\n"
               "  --bucket N     tokens per point of the error-over-time curve (default 64)\n"
               "  --row-split A  analysis: every dual-axis fit (dsq, spatial, stepq) divides\n"
               "                 row i by max|x_i|^A / sqrt(w_i), A in (0, 1], in place of\n"
               "                 each map's row_split (default: the map's, 0.5 unless it\n"
               "                 says otherwise; kernels/quant.h, config/SCHEMA.md)\n"
               "  --arith F      analysis: fp16 passes every quantized integer method's state\n"
               "                 through fp16 three times per store (the updated state, y =\n"
               "                 x / r_i, the reconstruction), each after an exact power-of-two\n"
               "                 normalisation of the head: could the kernels' per-element work\n"
               "                 run in packed fp16? (kernels/quant.h; default fp32, as built)\n"
               "Progress on stderr (STEPQ_PROGRESS=off|bar|lines).\n");
}

/* Jobs through the progress report: one head replayed is one unit of work. */
struct eval_run {
    struct stepq__eval *c;
    struct stepq_tool_progress *prog;
};

static void eval_job(void *v, int job, int worker)
{
    struct eval_run *r = v;

    stepq__eval_head_job(r->c, job, worker);
    stepq_tool_progress_add(r->prog, 1);
}

static int run_plot(const char *spec_path)
{
    const char *py = getenv("STEPQ_PYTHON");
    const char *script = getenv("STEPQ_PLOT_SCRIPT");
    char sb[4096], cmd[3 * 4096 + 64];
    if (!py || !*py)
        py = STEPQ_PYTHON;
    if (!script || !*script) {
        snprintf(sb, sizeof(sb), "%s/tools/scripts/plot.py", STEPQ_SOURCE_ROOT);
        if (access(sb, R_OK) != 0)
            snprintf(sb, sizeof(sb), "%s/plot.py", STEPQ_DATADIR);
        script = sb;
    }
    if (strchr(py, '\'') || strchr(script, '\'') || strchr(spec_path, '\''))
        return -1;
    snprintf(cmd, sizeof(cmd), "'%s' '%s' < '%s'", py, script, spec_path);
    return system(cmd) == 0 ? 0 : -1;
}

int stepq_tool_eval(int argc, char **argv)
{
    const char *maps_p[STEPQ__EVAL_MAX_MAPS], *traces[4096], *json = NULL, *plot = NULL;
    const char *out_path = NULL;
    int n_maps = 0, n_traces = 0, threads = stepq__calib_default_threads(), t_inj = -1, bucket = 64;
    int json_stdout = 0, classes = 0, threads_set = 0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--map") || !strcmp(a, "--trace")) {
            int is_map = !strcmp(a, "--map");
            while (i + 1 < argc && argv[i + 1][0] != '-') {
                if (is_map && n_maps < STEPQ__EVAL_MAX_MAPS)
                    maps_p[n_maps++] = argv[++i];
                else if (!is_map && n_traces < 4096)
                    traces[n_traces++] = argv[++i];
                else {
                    fprintf(stderr, "stepq eval: too many %s arguments\n", a);
                    return 2;
                }
            }
            continue;
        }
        /* --json alone: JSON on stdout; --json FILE (the value does not start with '-', and
         * eval has no operands): the JSON into FILE next to the table. */
        if (!strcmp(a, "--json")) {
            if (i + 1 < argc && argv[i + 1][0] != '-')
                json = argv[++i];
            else
                json_stdout = 1;
            continue;
        }
        if (!strcmp(a, "--classes")) {
            classes = 1;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            static const char *const value_opts[] = { "--bucket",    "--inject-step",
                                                      "--plot",      "--threads",
                                                      "--row-split", "--arith",
                                                      "-o",          NULL };
            return stepq_tool_missing_value("eval", a, value_opts);
        }
        i++;
        long long n;
        if (!strcmp(a, "-o"))
            out_path = v;
        else if (!strcmp(a, "--plot"))
            plot = v;
        else if (!strcmp(a, "--row-split")) {
            double x;
            if (stepq_tool_real("eval", a, v, 0.0, 1.0, STEPQ_TOOL_OPEN_LO, &x) < 0)
                return 2;
            stepq__quant_set_row_split(x);
        } else if (!strcmp(a, "--arith")) {
            if (strcmp(v, "fp32") && strcmp(v, "fp16")) {
                fprintf(stderr, "stepq eval: --arith '%s': not fp32 or fp16\n", v);
                return 2;
            }
            stepq__quant_set_arith_fp16(!strcmp(v, "fp16"));
        } else if (!strcmp(a, "--threads") || !strcmp(a, "--inject-step") ||
                   !strcmp(a, "--bucket")) {
            if (stepq_tool_int("eval", a, v, strcmp(a, "--inject-step") ? 1 : 0, 100000000, &n) < 0)
                return 2;
            if (!strcmp(a, "--threads"))
                threads = (int)n, threads_set = 1;
            else if (!strcmp(a, "--bucket"))
                bucket = (int)n;
            else
                t_inj = (int)n;
        } else {
            fprintf(stderr, "stepq eval: unknown option '%s' (see stepq eval --help)\n", a);
            return 2;
        }
    }
    if (stepq__quant_row_split() > 0.0)
        fprintf(stderr,
                "stepq eval: --row-split %g: the dual-axis fits use it in place of each map's "
                "row_split\n",
                stepq__quant_row_split());
    if (stepq__quant_arith_fp16())
        fprintf(stderr, "stepq eval: --arith fp16: every quantized integer method's state passes "
                        "through fp16 three times per store (an analysis; no kernel does)\n");
    if (json && json_stdout) {
        fprintf(stderr, "stepq eval: --json given twice, with and without a FILE\n");
        return 2;
    }
    if (!n_maps || !n_traces) {
        usage(stderr);
        return 2;
    }
    /* Where things go: the table to stdout (or -o FILE) unless --json alone puts the JSON
     * there; --json FILE writes the JSON into FILE. Opened first: a bad path fails at once. */
    struct stepq_tool_out o_main, o_json;
    FILE *tf = NULL, *jf = NULL, *mf;
    stepq_tool_out_reserve(&o_json, "eval", NULL); /* none yet: commit and discard do nothing */
    if (!(mf = stepq_tool_out_open(&o_main, "eval", out_path)))
        return 1;
    if (json && !(jf = stepq_tool_out_open(&o_json, "eval", json))) {
        stepq_tool_out_discard(&o_main);
        return 1;
    }
    if (json_stdout)
        jf = mf;
    else
        tf = mf;
    struct stepq__trace_set *ts;
    if (stepq__trace_set_open(traces, n_traces, &ts) < 0) {
        fprintf(stderr, "stepq eval: %s\n", stepq_last_error());
        stepq_tool_out_discard(&o_json);
        stepq_tool_out_discard(&o_main);
        return 1;
    }
    const struct stepq__trace_info *I = stepq__trace_set_info(ts);
    stepq_map_t *maps[STEPQ__EVAL_MAX_MAPS];
    int rc = 0, nm = 0;
    for (; nm < n_maps; nm++) {
        int st = stepq_map_load_file(maps_p[nm], NULL, &maps[nm]);
        if (st < 0) {
            stepq_tool_path_error("eval", maps_p[nm], NULL, stepq_last_error(), st);
            rc = 1;
            break;
        }
        stepq_model_shape sh;
        stepq_map_shape(maps[nm], &sh);
        int same = sh.arch == I->arch && sh.n_layers == I->n_layers && sh.num_k_heads == I->H &&
                   sh.num_v_heads == I->HV && sh.head_k_dim == I->K && sh.head_v_dim == I->V;
        for (int l = 0; same && l < sh.n_layers; l++)
            same = sh.layer_ids[l] == I->layer_ids[l];
        if (!same) {
            fprintf(stderr, "stepq eval: %s: the map's model shape differs from the traces'\n",
                    maps_p[nm]);
            nm++;
            rc = 1;
            break;
        }
    }
    if (t_inj < 0)
        t_inj = I->T > 1024 ? 256 : I->T / 4;
    if (t_inj >= I->T)
        t_inj = I->T - 1;
    int M = n_maps + 1, H = I->n_layers * I->HV, S = I->n_streams;
    int nb = (I->T + bucket - 1) / bucket;
    /* A host pool per map (one slot): the evaluation quantizes each head as the
     * map's pool lays it out, from the layouts the pool built at open. */
    stepq_pool_t *pools[STEPQ__EVAL_MAX_MAPS] = { 0 };
    for (int m = 0; m < nm && !rc; m++) {
        stepq_pool_config pc = STEPQ_POOL_CONFIG_INITIALIZER;
        pc.map = maps[m];
        pc.num_slots = 1;
        pc.policy = STEPQ_POOL_POLICY_NO_CACHE;
        int st = stepq_pool_open(&pc, &pools[m]);
        if (st < 0) {
            stepq_tool_path_error("eval", maps_p[m], NULL, stepq_last_error(), st);
            rc = 1;
        }
    }
    struct stepq__eval c = { .ts = ts,
                             .I = I,
                             .n_maps = n_maps,
                             .maps = maps,
                             .pools = pools,
                             .nb = nb,
                             .bucket = bucket,
                             .t_inj = t_inj };
    if (!rc) {
        c.acc = calloc((size_t)M * H * S, sizeof(*c.acc));
        c.curve_err = calloc((size_t)M * H * S * nb, sizeof(double));
        c.curve_ref = calloc((size_t)M * H * S * nb, sizeof(double));
        c.lret = calloc((size_t)H, sizeof(double));
        c.inj = calloc((size_t)H * S * 4, sizeof(double));
        if (I->arch == STEPQ_ARCH_KDA) {
            c.row_serr = calloc((size_t)H * S * I->K, sizeof(double));
            c.row_lret = calloc((size_t)H * I->K, sizeof(double));
        }
        c.rc = calloc((size_t)H, sizeof(int));
        if (!c.acc || !c.curve_err || !c.curve_ref || !c.lret || !c.inj || !c.rc ||
            (I->arch == STEPQ_ARCH_KDA && (!c.row_serr || !c.row_lret))) {
            fprintf(stderr, "stepq eval: out of memory\n");
            rc = 1;
        }
    }
    if (!rc) {
        struct stepq_tool_progress prog;
        struct eval_run run = { &c, &prog };
        threads = threads_set   ? stepq_tool_threads("eval", threads, H, "heads")
                  : threads < H ? threads
                                : H;
        stepq_tool_progress_begin(&prog, "eval", "heads", H);
        stepq__calib_parallel(H, threads, eval_job, &run, NULL);
        stepq_tool_progress_end(&prog);
        for (int h = 0; h < H && !rc; h++)
            if (c.rc[h] < 0) {
                fprintf(stderr, "stepq eval: %s\n", stepq_last_error());
                rc = 1;
            }
    }
    if (rc)
        goto done;

    /* Lifetime classes: thirds of heads by half-life (ties by head index). */
    double *hl = malloc(sizeof(double) * H), *tmp = malloc(sizeof(double) * (S > H ? S : H) * 9);
    int *cls = malloc(sizeof(int) * H), *order = malloc(sizeof(int) * H);
    for (int h = 0; h < H; h++) {
        hl[h] = stepq__calib_half_life(c.lret[h]);
        order[h] = h;
    }
    for (int i = 1; i < H; i++) /* insertion sort: H is small */
        for (int j = i; j > 0 && (hl[order[j - 1]] > hl[order[j]] ||
                                  (hl[order[j - 1]] == hl[order[j]] && order[j - 1] > order[j]));
             j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    for (int r = 0; r < H; r++)
        cls[order[r]] = r * 3 / H;

    stepq_tool_printf(
        tf, "stepq eval: %d streams x %d tokens, %d layers x %d heads; mean +- s.e. over streams\n",
        S, I->T, I->n_layers, I->HV);
    stepq_tool_printf(tf, "%-22s %6s %-16s %-16s %-16s %s", "map", "bits", "global", "head",
                      "first 256", classes ? "last 256        " : "last 256");
    if (classes)
        stepq_tool_printf(tf, " %-16s %-16s %s", "state short", "state middle", "state long");
    stepq_tool_printf(tf, "\n");
    if (jf)
        fprintf(jf,
                "{\"streams\": %d, \"tokens\": %d, \"layers\": %d, \"heads\": %d, "
                "\"inject_step\": %d, \"row_split_override\": ",
                S, I->T, I->n_layers, I->HV, t_inj);
    if (jf) {
        json_num(jf, stepq__quant_row_split() > 0.0 ? stepq__quant_row_split() : NAN);
        fprintf(jf, ", \"arith\": \"%s\"", stepq__quant_arith_fp16() ? "fp16" : "fp32");
        fputs(", \"methods\": [\n", jf);
    }
    struct ms gain[STEPQ__EVAL_MAX_MAPS + 1][2]; /* readout, store: printed after the table */
    char glabel[STEPQ__EVAL_MAX_MAPS + 1][128];
    /* The fit rows' fallback: the fraction of head stores that took the exact fit; -1 unless the
     * map's decode_fit is rows. */
    double fallback[STEPQ__EVAL_MAX_MAPS + 1];
    for (int m = 0; m < M; m++) {
        struct ms v[9];
        double n_st = 0, n_ex = 0;
        for (int s = 0; s < S; s++) {
            double e = 0, r = 0, ea = 0, ra = 0, eb = 0, rb2 = 0, hs = 0, se[3] = { 0 },
                   sr[3] = { 0 }, od = 0, qd = 0, qr = 0;
            for (int h = 0; h < H; h++) {
                const struct stepq__eval_acc *a = &c.acc[((size_t)m * H + h) * S + s];
                e += a->err;
                r += a->ref;
                ea += a->err_a;
                ra += a->ref_a;
                eb += a->err_b;
                rb2 += a->ref_b;
                hs += a->ref > 0 ? a->err / a->ref : 0;
                se[cls[h]] += a->serr;
                sr[cls[h]] += a->sref;
                od += a->odot;
                qd += a->qdot;
                qr += a->qref;
                n_st += a->stores;
                n_ex += a->rows_exact;
            }
            tmp[0 * S + s] = r > 0 ? e / r : 0;
            tmp[1 * S + s] = hs / H;
            tmp[2 * S + s] = ra > 0 ? ea / ra : 0;
            tmp[3 * S + s] = rb2 > 0 ? eb / rb2 : 0;
            for (int k = 0; k < 3; k++)
                tmp[(4 + k) * S + s] = sr[k] > 0 ? se[k] / sr[k] : 0;
            tmp[7 * S + s] = r > 0 ? od / r : 0;
            tmp[8 * S + s] = qr > 0 ? qd / qr : 0;
        }
        for (int k = 0; k < 9; k++) {
            double *x = malloc(sizeof(double) * S);
            for (int s = 0; s < S; s++)
                x[s] = tmp[k * S + s];
            v[k] = mean_se(x, S);
            free(x);
        }
        char name[128];
        double bpv = 6.0 + 16.0 / I->V; /* internal uniform@6: codes + one fp16 row scale per row */
        if (m < n_maps) {
            stepq_map_memory mi;
            stepq_map_memory_info(maps[m], &mi);
            bpv = mi.bits_per_value;
            map_label(name, sizeof(name), maps_p[m], maps[m]);
        } else {
            snprintf(name, sizeof(name), "uniform@6 (internal)");
        }
        gain[m][0] = v[7];
        gain[m][1] = v[8];
        fallback[m] = m < n_maps && stepq_map_decode_fit(maps[m]) == STEPQ_DECODE_FIT_ROWS &&
                              stepq_method_has_col_scales(stepq_map_method(maps[m])) && n_st > 0
                          ? n_ex / n_st
                          : -1.0;
        snprintf(glabel[m], sizeof(glabel[m]), "%s", name);
        stepq_tool_printf(tf, "%-22s %6.3f", name, bpv);
        for (int k = 0; k < (classes ? 7 : 4); k++) {
            char cell[64];
            snprintf(cell, sizeof(cell), "%.3e+-%.0e", v[k].mean, v[k].se);
            stepq_tool_printf(tf, " %-16s", cell);
        }
        stepq_tool_printf(tf, "\n");
        if (jf) {
            fputs("  {\"name\": ", jf);
            stepq_tool_json_str(jf, name);
            fputs(", \"map\": ", jf);
            stepq_tool_json_str(jf, m < n_maps ? maps_p[m] : "");
            fprintf(jf, ", \"bits_per_value\": %.6g, \"row_split\": ", bpv);
            /* The split the fit ran with: the override, else the map's; null without one. */
            json_num(jf, m < n_maps && stepq_method_has_col_scales(stepq_map_method(maps[m]))
                             ? stepq__quant_row_split_or(stepq_map_row_split(maps[m]))
                             : NAN);
            fputs(", ", jf);
            json_ms(jf, "readout_rel", v[0], 0);
            json_ms(jf, "readout_rel_head", v[1], 0);
            json_ms(jf, "readout_rel_first", v[2], 0);
            json_ms(jf, "readout_rel_last", v[3], 0);
            json_ms(jf, "state_rel_short", v[4], 0);
            json_ms(jf, "state_rel_middle", v[5], 0);
            json_ms(jf, "state_rel_long", v[6], 0);
            json_ms(jf, "readout_gain", v[7], 0);
            json_ms(jf, "store_gain", v[8], 0);
            fputs("\"rows_fallback\": ", jf);
            json_num(jf, fallback[m] >= 0 ? fallback[m] : NAN);
            fputs(", ", jf);
            fprintf(jf, "\"curve\": [");
            for (int b = 0; b < nb; b++) {
                double e = 0, r = 0;
                for (int h = 0; h < H; h++)
                    for (int s = 0; s < S; s++) {
                        size_t ci = (((size_t)m * H + h) * S + s) * nb + b;
                        e += c.curve_err[ci];
                        r += c.curve_ref[ci];
                    }
                fputs(b ? ", " : "", jf);
                json_num(jf, r > 0 ? e / r : 0);
            }
            fprintf(jf, "], \"head_state_err\": [");
            for (int h = 0; h < H; h++) {
                double se = 0;
                for (int s = 0; s < S; s++)
                    se += c.acc[((size_t)m * H + h) * S + s].serr;
                fputs(h ? ", " : "", jf);
                json_num(jf, se / S);
            }
            fprintf(jf, "], \"head_readout_rel\": [");
            for (int h = 0; h < H; h++) {
                double e = 0, r = 0;
                for (int s = 0; s < S; s++) {
                    e += c.acc[((size_t)m * H + h) * S + s].err;
                    r += c.acc[((size_t)m * H + h) * S + s].ref;
                }
                fputs(h ? ", " : "", jf);
                json_num(jf, r > 0 ? e / r : 0);
            }
            fprintf(jf, "]}%s\n", m + 1 < M ? "," : "");
        }
    }
    /* Spearman: pooled D_u under the internal uniform@6 vs half-life, and per stream. */
    double *du = malloc(sizeof(double) * H), *rho_s = calloc((size_t)S, sizeof(double));
    if (!du || !rho_s) {
        fprintf(stderr, "stepq eval: out of memory\n");
        rc = 1;
        goto done2;
    }
    for (int h = 0; h < H; h++) {
        du[h] = 0;
        for (int s = 0; s < S; s++)
            du[h] += c.acc[((size_t)n_maps * H + h) * S + s].serr;
    }
    double rho = stepq__calib_spearman(du, hl, H);
    for (int s = 0; s < S; s++) {
        for (int h = 0; h < H; h++)
            du[h] = c.acc[((size_t)n_maps * H + h) * S + s].serr;
        rho_s[s] = stepq__calib_spearman(du, hl, H);
    }
    struct ms rs = mean_se(rho_s, S);
    /* KDA: the same over key rows (its units), from the per-row statistics of the jobs. */
    double rho_r = NAN, *rho_rs = NULL;
    struct ms rrs = { NAN, NAN };
    const int R = I->arch == STEPQ_ARCH_KDA ? H * I->K : 0;
    if (R) {
        double *dr = malloc(sizeof(double) * (size_t)R), *hr = malloc(sizeof(double) * (size_t)R);
        rho_rs = calloc((size_t)S, sizeof(double));
        if (!dr || !hr || !rho_rs) {
            free(dr);
            free(hr);
            free(rho_rs);
            free(du);
            free(rho_s);
            fprintf(stderr, "stepq eval: out of memory\n");
            rc = 1;
            goto done2;
        }
        for (int u = 0; u < R; u++) {
            int h = u / I->K, i = u % I->K;
            hr[u] = stepq__calib_half_life(c.row_lret[u]);
            dr[u] = 0;
            for (int s = 0; s < S; s++)
                dr[u] += c.row_serr[((size_t)h * S + s) * I->K + i];
        }
        rho_r = stepq__calib_spearman(dr, hr, R);
        for (int s = 0; s < S; s++) {
            for (int u = 0; u < R; u++)
                dr[u] = c.row_serr[((size_t)(u / I->K) * S + s) * I->K + u % I->K];
            rho_rs[s] = stepq__calib_spearman(dr, hr, R);
        }
        rrs = mean_se(rho_rs, S);
        free(dr);
        free(hr);
    }
    /* Injection ratios per stream (summed over heads) and pooled. */
    double pooled[4] = { 0 }, *r6 = malloc(sizeof(double) * S), *r8 = malloc(sizeof(double) * S);
    for (int s = 0; s < S; s++) {
        double a[4] = { 0 };
        for (int h = 0; h < H; h++)
            for (int k = 0; k < 4; k++)
                a[k] += c.inj[((size_t)h * S + s) * 4 + k];
        for (int k = 0; k < 4; k++)
            pooled[k] += a[k];
        r6[s] = a[0] > 0 ? a[1] / a[0] : NAN;
        r8[s] = a[2] > 0 ? a[3] / a[2] : NAN;
    }
    struct ms i6 = mean_se(r6, S), i8 = mean_se(r8, S);
    stepq_tool_printf(
        tf,
        "global: sum |o^ - o|^2 / sum |o|^2 over every head and step (o^ read with the map's\n"
        "  state); head: the mean over heads of that ratio per head; first / last 256: the\n"
        "  global ratio over the first / last %d steps%s; bits: per value, scales and\n"
        "  pivots included; uniform@6 (internal): the reference for the two lines below\n",
        STEPQ__EVAL_EDGE,
        classes ? "; state short / middle / long: sum |S^ - S|^2 / sum |S|^2 of the third of\n"
                  "  the heads with the shortest / middle / longest gate half-lives"
                : "");
    stepq_tool_printf(tf,
                      "gain (readout sum <o^, o> / sum |o|^2; store sum <Q(S), S> / sum |S|^2 over "
                      "the stores):\n  1 is unbiased, below 1 the stored state shrinks (a "
                      "least-squares column refit\n  of noisy codes does)\n");
    for (int m = 0; m < M; m++)
        stepq_tool_printf(tf, "  %-22s readout %.6f+-%.0e  store %.6f+-%.0e\n", glabel[m],
                          gain[m][0].mean, gain[m][0].se, gain[m][1].mean, gain[m][1].se);
    for (int m = 0; m < M; m++)
        if (fallback[m] >= 0)
            stepq_tool_printf(tf,
                              "decode fit rows, %s: %.1f%% of the head stores fell back to the "
                              "exact fit (the old column scales could not serve)\n",
                              glabel[m], 100.0 * fallback[m]);
    stepq_tool_printf(
        tf,
        "Spearman(D_u under uniform@6, half-life): pooled %.3f, per stream %.3f +- %.3f (%d "
        "units)\n",
        rho, rs.mean, rs.se, H);
    if (R)
        stepq_tool_printf(
            tf, "  over key rows (KDA units): pooled %.3f, per stream %.3f +- %.3f (%d rows)\n",
            rho_r, rrs.mean, rrs.se, R);
    stepq_tool_printf(
        tf,
        "single injection at step %d, oracle / native squared readout error:\n"
        "  INT6 %.2f (per stream %.2f +- %.2f), INT8 %.2f (per stream %.2f +- %.2f)\n",
        t_inj, pooled[1] / pooled[0], i6.mean, i6.se, pooled[3] / pooled[2], i8.mean, i8.se);
    if (jf) {
        fputs("], \"spearman_uniform6_halflife\": {\"pooled\": ", jf);
        json_num(jf, rho);
        fputs(", ", jf);
        json_ms(jf, "per_stream", rs, 1);
        if (R) {
            fputs(", \"rows\": {\"pooled\": ", jf);
            json_num(jf, rho_r);
            fputs(", ", jf);
            json_ms(jf, "per_stream", rrs, 1);
            fprintf(jf, ", \"n\": %d}", R);
        }
        fprintf(jf, "},\n\"injection\": {\"step\": %d, \"int6_ratio\": ", t_inj);
        json_num(jf, pooled[0] > 0 ? pooled[1] / pooled[0] : NAN);
        fputs(", \"int8_ratio\": ", jf);
        json_num(jf, pooled[2] > 0 ? pooled[3] / pooled[2] : NAN);
        fputs(", ", jf);
        if (!(pooled[0] > 0))
            fprintf(jf,
                    "\"note\": \"no readout error after the injection step %d of %d "
                    "(it is the last step, or the traces are one token long)\", ",
                    t_inj, I->T);
        json_ms(jf, "int6_ratio_per_stream", i6, 0);
        json_ms(jf, "int8_ratio_per_stream", i8, 1);
        fprintf(jf, "},\n\"heads\": [");
        for (int h = 0; h < H; h++)
            fprintf(jf, "%s{\"layer\": %d, \"head\": %d, \"half_life\": %.6g, \"class\": %d}",
                    h ? ", " : "", I->layer_ids[h / I->HV], h % I->HV, hl[h], cls[h]);
        fprintf(jf, "]}\n");
    }
    if (stepq_tool_out_commit(&o_json, "eval") < 0)
        rc = 1;
    if (stepq_tool_out_commit(&o_main, "eval") < 0)
        rc = 1;
    if (plot && !rc) {
        /* Two charts via tools/scripts/plot.py: per-head relative readout error vs half-life, and
         * the relative readout error over time. */
        char path[4096];
        /* Like --json's file, the plot folder is created when missing (one level). */
        if (mkdir(plot, 0777) != 0 && errno != EEXIST) {
            fprintf(stderr, "stepq eval: --plot %s: %s\n", plot, strerror(errno));
            rc = 1;
        }
        /* Charts per nominal budget group (<= 4, 5-6, >= 7 bits; dense maps with the 6-bit
         * group, the internal uniform@6 too), so each stays legible. */
        for (int chart = 0; chart < 6 && !rc; chart++) {
            int kind = chart / 3, grp = chart % 3, count = 0;
            for (int m = 0; m < M; m++)
                count += chart_group(maps, n_maps, m) == grp;
            if (!count)
                continue;
            static const char *const gname[3] = { "b4", "b6", "b8" };
            snprintf(path, sizeof(path), "%s/%s_%s.spec.json", plot,
                     kind ? "error_vs_time" : "error_vs_halflife", gname[grp]);
            struct stepq_tool_out so;
            char png[4096 + 64];
            FILE *f = stepq_tool_out_open(&so, "eval", path);
            if (!f) {
                rc = 1;
                break;
            }
            snprintf(png, sizeof(png), "%s/%s_%s.png", plot,
                     kind ? "error_vs_time" : "error_vs_halflife", gname[grp]);
            fputs("{\"output\": ", f);
            stepq_tool_json_str(f, png);
            fputs(", \"logy\": true, \"legend_outside\": true, ", f);
            if (!kind)
                fprintf(
                    f,
                    "\"title\": \"relative readout error per head vs gate half-life\", "
                    "\"xlabel\": \"half-life (tokens)\", \"ylabel\": \"sum |do|^2 / sum |o|^2\", "
                    "\"logx\": true, \"logx_base\": 10, \"x\": [], \"series\": [");
            else
                fprintf(
                    f,
                    "\"title\": \"relative readout error over time (all heads)\", "
                    "\"xlabel\": \"token\", \"ylabel\": \"sum |do|^2 / sum |o|^2 per %d tokens\", "
                    "\"x\": [], \"series\": [",
                    bucket);
            int first = 1;
            for (int m = 0; m < M; m++) {
                if (chart_group(maps, n_maps, m) != grp)
                    continue;
                char name[128];
                if (m < n_maps)
                    map_label(name, sizeof(name), maps_p[m], maps[m]);
                else
                    snprintf(name, sizeof(name), "uniform@6 (internal)");
                fputs(first ? "{\"label\": " : ", {\"label\": ", f);
                stepq_tool_json_str(f, name);
                fprintf(f, ", \"style\": \"%s\", \"x\": [", kind ? "-" : "o");
                first = 0;
                int n = kind ? nb : H;
                for (int i = 0; i < n; i++)
                    fprintf(f, "%s%.6g", i ? ", " : "", kind ? (double)i * bucket : hl[i]);
                fprintf(f, "], \"y\": [");
                for (int i = 0; i < n; i++) {
                    double e = 0, r = 0;
                    for (int s = 0; s < S; s++) {
                        if (kind)
                            for (int h = 0; h < H; h++) {
                                size_t ci = (((size_t)m * H + h) * S + s) * nb + i;
                                e += c.curve_err[ci];
                                r += c.curve_ref[ci];
                            }
                        else {
                            e += c.acc[((size_t)m * H + i) * S + s].err;
                            r += c.acc[((size_t)m * H + i) * S + s].ref;
                        }
                    }
                    double y = r > 0 ? e / r : 0;
                    fprintf(f, "%s%.6g", i ? ", " : "", y > 1e-30 ? y : 1e-30);
                }
                fprintf(f, "]}");
            }
            fprintf(f, "]}\n");
            if (stepq_tool_out_commit(&so, "eval") < 0) {
                rc = 1;
                break;
            }
            if (run_plot(path) < 0)
                fprintf(stderr,
                        "stepq eval: warning: plotting %s failed (python3 with matplotlib "
                        "needed); the spec is kept\n",
                        path);
        }
    }
    free(du);
    free(rho_s);
    free(rho_rs);
    free(r6);
    free(r8);
done2:
    free(hl);
    free(tmp);
    free(cls);
    free(order);
done:
    stepq_tool_out_discard(&o_json); /* after a failure; nothing once committed */
    stepq_tool_out_discard(&o_main);
    for (int m = 0; m < nm; m++) {
        stepq_pool_close(pools[m], 0);
        stepq_map_close(maps[m]);
    }
    free(c.acc);
    free(c.row_serr);
    free(c.row_lret);
    free(c.curve_err);
    free(c.curve_ref);
    free(c.lret);
    free(c.inj);
    free(c.rc);
    stepq__trace_set_close(ts);
    return rc;
}
