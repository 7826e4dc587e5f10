/*
 * stepq mkmap: builds a precision map for a built-in model shape without
 * calibration (uniform / dsq / dense baselines, and synthetic mixed-precision
 * layout examples). The maps in config/examples/ are made with this command
 * (config/examples/regen.sh); `stepq calibrate` makes calibrated maps.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plugin/vocab.h"
#include "stepq/map.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/mkmap.h"

/*
 * Shape presets. Layer ids are 0-based model layer indices. Sources (public
 * config.json files; config/SCHEMA.md has the details):
 *  - Qwen3.8-27B: the paper's shape (48 GDN layers x 48 value heads, 128x128,
 *    conv state 2,949,120 B per request); layer ids as in Qwen3.5-27B
 *    (64 layers, every 4th full attention).
 *  - Qwen3-Next-80B-A3B: 48 layers, full_attention_interval 4, 16 q/k heads,
 *    32 value heads, linear_conv_kernel_dim 4: conv dim 2*16*128 + 32*128.
 *  - Kimi-Linear-48B-A3B: 27 layers, linear_attn_config.kda_layers (1-based
 *    there), 32 heads of 128, short_conv_kernel_size 4 with separate q, k, v
 *    convolutions.
 *  - tiny-gdn: ../shared/models/tiny-gdn/config.json.
 */
struct preset {
    const char *key;
    const char *model_name;
    stepq_arch arch;
    int model_layers; /* total layers of the model */
    int full_every;   /* every full_every-th layer is full attention (0: see ids) */
    const int *ids;   /* explicit recurrent ids when full_every == 0 */
    int n_ids;
    int num_k_heads, num_v_heads, head_k_dim, head_v_dim;
    int conv_rank;
    int64_t conv_shape[STEPQ_CONV_MAX_RANK];
};

/* Kimi-Linear kda_layers [1,2,3,5,...,26] (1-based) as 0-based layer indices. */
static const int kimi_ids[] = { 0,  1,  2,  4,  5,  6,  8,  9,  10, 12,
                                13, 14, 16, 17, 18, 20, 21, 22, 24, 25 };

static const struct preset presets[] = {
    { "qwen3.8-27b",
      "Qwen3.8-27B",
      STEPQ_ARCH_GDN,
      64,
      4,
      NULL,
      0,
      16,
      48,
      128,
      128,
      2,
      { 2 * 16 * 128 + 48 * 128, 3 } },
    { "qwen3-next-80b-a3b",
      "Qwen3-Next-80B-A3B",
      STEPQ_ARCH_GDN,
      48,
      4,
      NULL,
      0,
      16,
      32,
      128,
      128,
      2,
      { 2 * 16 * 128 + 32 * 128, 3 } },
    { "kimi-linear-48b-a3b",
      "Kimi-Linear-48B-A3B",
      STEPQ_ARCH_KDA,
      27,
      0,
      kimi_ids,
      (int)(sizeof(kimi_ids) / sizeof(kimi_ids[0])),
      32,
      32,
      128,
      128,
      3,
      { 3, 32 * 128, 3 } },
    { "tiny-gdn",
      "tiny-gdn",
      STEPQ_ARCH_GDN,
      8,
      4,
      NULL,
      0,
      4,
      8,
      128,
      128,
      2,
      { 2 * 4 * 128 + 8 * 128, 3 } },
};
#define N_PRESETS (sizeof(presets) / sizeof(presets[0]))

static void mkmap_usage(FILE *f)
{
    fprintf(f, "usage: stepq mkmap --shape NAME --method METHOD [--bits B] [--pivots P]\n"
               "                   [--row-split A] [--decode-fit F] [--arith A]\n"
               "                   [--out FILE | -o FILE] [--name TEXT]\n"
               "Builds an uncalibrated precision map for a built-in model shape.\n"
               "  --shape    one of:");
    for (size_t i = 0; i < N_PRESETS; i++)
        fprintf(f, " %s", presets[i].key);
    fprintf(f, "\n"
               "  --method   fp32 bf16 fp16 uniform dsq spatial temporal stepq fp8\n"
               "             (fp8: e4m3 codes, one fp32 scale amax/240 per head and 32\n"
               "             value channels, SGLang's proposed float8 pool; SGLang's int8\n"
               "             cached-state store is uniform --bits 8 up to its fp32 scales)\n"
               "  --bits     budget bits per value, one of 2,3,4,5,6,8 (uniform .. stepq;\n"
               "             fp32 bf16 fp16 fp8 have one fixed width)\n"
               "  --pivots   fp16 pivot units (temporal, stepq), spread evenly; the other\n"
               "             units get a fixed {lower, B, higher} mix summing exactly to\n"
               "             the budget: a synthetic layout example, not a calibration\n"
               "  --out, -o  output file (default: standard output), written whole or not at all\n"
               "  --row-split  dsq, spatial, stepq: the map field row_split, the dual-axis\n"
               "             fit's row-scale exponent in (0, 1] (default 0.5: not written)\n"
               "  --decode-fit  dsq, spatial, stepq: the map field decode_fit, the decode\n"
               "             step's fit: exact (default: not written), norefit (no\n"
               "             column refit) or rows (the page's column scales kept, the\n"
               "             row scales refitted)\n"
               "  --arith    dsq, spatial, stepq: the map field arith, the decode step's\n"
               "             arithmetic: fp32 (default: not written) or fp16 (the\n"
               "             per-element work in IEEE fp16; needs the decode fit exact\n"
               "             or norefit)\n"
               "  --name     model name to record (default: the preset's)\n");
}

static int die(const char *tool, const char *what, int st)
{
    fprintf(stderr, "stepq %s: %s: %s (%s)\n", tool, what, stepq_last_error(),
            stepq_status_name(st));
    return 1;
}

/* Deterministic 64-bit generator (splitmix64) for the layout order. */
static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int is_width(int b)
{
    return (b >= 2 && b <= 6) || b == 8;
}

/*
 * Pivots at evenly spaced units; the rest at B, except n_hi units one width
 * up and n_lo one width down, chosen so that the non-pivot units use exactly
 * B*N - 8*N_piv bits (pivots replace 8-bit units). Returns 0 or prints why not.
 */
static int make_layout(const char *tool, stepq_map_t *map, int bits, int64_t pivots, int cand[3],
                       int *n_cand)
{
    stepq_model_shape s;
    stepq_map_shape(map, &s);
    const int upl = stepq_map_units_per_layer(map);
    const int64_t U = (int64_t)s.n_layers * upl, M = U - pivots;
    int lo = 0, hi = 0;

    if (pivots < 0 || pivots > U) {
        fprintf(stderr, "stepq %s: --pivots %lld is out of range 0..%lld\n", tool,
                (long long)pivots, (long long)U);
        return -1;
    }
    /* Two widths apart where possible ({4, 6, 8} around 6), else the neighbour. */
    for (int b = bits - 2; b >= 2 && !lo; b--)
        lo = is_width(b) ? b : 0;
    for (int b = bits - 1; b >= 2 && !lo; b--)
        lo = is_width(b) ? b : 0;
    for (int b = bits + 2; b <= 8 && !hi; b++)
        hi = is_width(b) ? b : 0;
    for (int b = bits + 1; b <= 8 && !hi; b++)
        hi = is_width(b) ? b : 0;

    /* Deficit against "every non-pivot unit at B", in unit-bits. */
    const int64_t deficit = (int64_t)(8 - bits) * pivots;
    int64_t n_hi = hi ? M / 10 : 0, n_lo = 0;
    for (; n_hi >= 0; n_hi--) {
        int64_t need = deficit + n_hi * (hi - bits);
        if (need == 0) {
            n_lo = 0;
            break;
        }
        if (lo && need % (bits - lo) == 0 && n_hi + need / (bits - lo) <= M) {
            n_lo = need / (bits - lo);
            break;
        }
    }
    if (n_hi < 0) {
        fprintf(stderr, "stepq %s: %lld pivots do not fit a %d-bit budget\n", tool,
                (long long)pivots, bits);
        return -1;
    }

    unsigned char *width = malloc((size_t)U);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(M > 0 ? M : 1));
    if (!width || !order) {
        free(width);
        free(order);
        fprintf(stderr, "stepq %s: out of memory\n", tool);
        return -1;
    }
    memset(width, bits, (size_t)U);
    for (int64_t k = 0; k < pivots; k++)
        width[(2 * k + 1) * U / (2 * pivots)] = STEPQ_BITS_PIVOT;
    int64_t j = 0;
    for (int64_t u = 0; u < U; u++)
        if (width[u] != STEPQ_BITS_PIVOT)
            order[j++] = u;
    uint64_t seed = 0x5354455051ull;      /* "STEPQ" */
    for (int64_t i = M - 1; i > 0; i--) { /* Fisher-Yates */
        int64_t r = (int64_t)(splitmix64(&seed) % (uint64_t)(i + 1));
        int64_t t = order[i];
        order[i] = order[r];
        order[r] = t;
    }
    for (int64_t i = 0; i < n_hi; i++)
        width[order[i]] = (unsigned char)hi;
    for (int64_t i = n_hi; i < n_hi + n_lo; i++)
        width[order[i]] = (unsigned char)lo;

    int st = 0;
    for (int64_t u = 0; u < U && st >= 0; u++)
        st = stepq_map_set_unit_bits(map, (int)(u / upl), (int)(u % upl), width[u]);
    free(width);
    free(order);
    if (st < 0)
        return die(tool, "set_unit_bits", st);

    *n_cand = 0;
    if (n_lo)
        cand[(*n_cand)++] = lo;
    cand[(*n_cand)++] = bits;
    if (n_hi)
        cand[(*n_cand)++] = hi;
    return 0;
}

static const struct preset *find_preset(const char *key)
{
    for (size_t i = 0; i < N_PRESETS; i++)
        if (!strcmp(key, presets[i].key))
            return &presets[i];
    return NULL;
}

int stepq_tool_preset_find(const char *key)
{
    return find_preset(key) != NULL;
}

void stepq_tool_preset_list(FILE *f)
{
    for (size_t i = 0; i < N_PRESETS; i++)
        fprintf(f, "%s%s", i ? ", " : "", presets[i].key);
}

int stepq_tool_mkmap_build(const char *tool, const char *shape_key, stepq_method method, int bits,
                           long long pivots, const char *name, stepq_map_t **out)
{
    const struct preset *p = find_preset(shape_key);
    const int fixed = !stepq__method_has_units(method);
    const int mixed = method == STEPQ_METHOD_TEMPORAL || method == STEPQ_METHOD_STEPQ;
    const char *method_name = stepq_method_name(method);

    *out = NULL;
    if (!p) {
        fprintf(stderr, "stepq %s: unknown shape '%s'\n", tool, shape_key);
        return 2;
    }
    int ids[64];
    stepq_model_shape s = { 0 };
    s.arch = p->arch;
    if (p->full_every) {
        for (int l = 0; l < p->model_layers; l++)
            if (l % p->full_every != p->full_every - 1)
                ids[s.n_layers++] = l;
    } else {
        memcpy(ids, p->ids, sizeof(int) * (size_t)p->n_ids);
        s.n_layers = p->n_ids;
    }
    s.layer_ids = ids;
    s.num_k_heads = p->num_k_heads;
    s.num_v_heads = p->num_v_heads;
    s.head_k_dim = p->head_k_dim;
    s.head_v_dim = p->head_v_dim;
    s.conv_rank = p->conv_rank;
    memcpy(s.conv_shape, p->conv_shape, sizeof(s.conv_shape));
    s.conv_dtype = STEPQ_DTYPE_BF16;

    double budget = fixed ? stepq__method_fixed_bits(method) : bits;
    stepq_map_t *map = NULL;
    int st = stepq_map_create(&s, method, budget, &map);
    if (st < 0)
        return die(tool, "create", st);

    char notes[512];
    int cand[3], n_cand = 0;
    if (mixed) {
        if (make_layout(tool, map, bits, pivots, cand, &n_cand) < 0) {
            stepq_map_close(map);
            return 1;
        }
        snprintf(notes, sizeof(notes),
                 "Synthetic layout example, not calibrated: %lld fp16 pivot unit(s) spread evenly; "
                 "the other units at a fixed pseudo-random mix of widths summing exactly to the "
                 "%d-bit budget (pivots replace 8-bit units); row impact 1. Use stepq calibrate "
                 "for a real map.",
                 pivots, bits);
    } else if (method == STEPQ_METHOD_FP8) {
        snprintf(notes, sizeof(notes),
                 "e4m3 state, one fp32 scale amax/240 per (head, 32 value channels) (baseline: "
                 "SGLang's proposed float8 state pool); no calibration needed.");
    } else if (fixed) {
        snprintf(notes, sizeof(notes), "Unquantized %s state (baseline).", method_name);
    } else {
        snprintf(notes, sizeof(notes),
                 "Every unit at %d bits; no calibration needed for method %s%s.", bits, method_name,
                 method == STEPQ_METHOD_SPATIAL ? " (row impact 1: not calibrated)" : "");
    }
    if ((st = stepq_map_set_model_name(map, name ? name : p->model_name)) < 0 ||
        (st = stepq_map_set_provenance(map, "tool", "stepq mkmap")) < 0 ||
        (st = stepq_map_set_provenance(map, "notes", notes)) < 0 ||
        (n_cand && (st = stepq_map_set_provenance_candidates(map, cand, n_cand)) < 0)) {
        stepq_map_close(map);
        return die(tool, "provenance", st);
    }
    *out = map;
    return 0;
}

int stepq_tool_mkmap(int argc, char **argv)
{
    const char *shape_key = NULL, *method_name = NULL, *out = NULL, *name = NULL;
    int bits = 0;
    long long pivots = 0;
    double row_split = 0.0;      /* 0: the default 0.5, not written */
    const char *fit_name = NULL; /* NULL: the default exact, not written */
    stepq_decode_fit fit = STEPQ_DECODE_FIT_EXACT;
    const char *arith_name = NULL; /* NULL: the default fp32, not written */
    stepq_arith arith = STEPQ_ARITH_FP32;
    stepq_method method;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mkmap_usage(stdout);
            return 0;
        }
        if (a[0] != '-') {
            fprintf(stderr, "stepq mkmap: unexpected argument '%s'\n", a);
            return 2;
        }
        if (!v) {
            static const char *const value_opts[] = {
                "--arith",  "--bits",      "--decode-fit", "--method", "--name", "--out",
                "--pivots", "--row-split", "--shape",      "-o",       NULL,
            };
            return stepq_tool_missing_value("mkmap", a, value_opts);
        }
        long long n;
        if (!strcmp(a, "--shape")) {
            shape_key = v;
        } else if (!strcmp(a, "--method")) {
            method_name = v;
        } else if (!strcmp(a, "--bits")) {
            if (stepq_tool_int("mkmap", a, v, 2, 8, &n) < 0)
                return 2;
            bits = (int)n;
            if (!is_width(bits)) {
                fprintf(stderr, "stepq mkmap: --bits %s is not one of 2,3,4,5,6,8\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--pivots")) {
            if (stepq_tool_int("mkmap", a, v, 0, INT32_MAX, &pivots) < 0)
                return 2;
        } else if (!strcmp(a, "--row-split")) {
            if (stepq_tool_real("mkmap", a, v, 0.0, 1.0, STEPQ_TOOL_OPEN_LO, &row_split) < 0)
                return 2;
        } else if (!strcmp(a, "--decode-fit")) {
            if (stepq_tool_decode_fit("mkmap", a, v, &fit) < 0)
                return 2;
            fit_name = v;
        } else if (!strcmp(a, "--arith")) {
            if (stepq_tool_arith("mkmap", a, v, &arith) < 0)
                return 2;
            arith_name = v;
        } else if (!strcmp(a, "--out") || !strcmp(a, "-o")) {
            out = v;
        } else if (!strcmp(a, "--name")) {
            name = v;
        } else {
            fprintf(stderr, "stepq mkmap: unknown option '%s' (see stepq mkmap --help)\n", a);
            return 2;
        }
        i++;
    }
    if (!shape_key || !method_name) {
        mkmap_usage(stderr);
        return 2;
    }
    const struct preset *p = find_preset(shape_key);
    if (!p) {
        fprintf(stderr, "stepq mkmap: unknown shape '%s' (stepq mkmap --help lists them)\n",
                shape_key);
        return 2;
    }
    if (stepq_method_from_name(method_name, &method) < 0) {
        fprintf(stderr, "stepq mkmap: %s\n", stepq_last_error());
        return 2;
    }
    /* fp32 / bf16 / fp16 / fp8: one fixed format, nothing per unit to choose. */
    const int fixed = !stepq__method_has_units(method);
    const int mixed = method == STEPQ_METHOD_TEMPORAL || method == STEPQ_METHOD_STEPQ;
    if (fixed && bits && bits != (int)stepq__method_fixed_bits(method)) {
        fprintf(stderr, "stepq mkmap: method %s stores %g bits per value, not --bits %d\n",
                method_name, stepq__method_fixed_bits(method), bits);
        return 2;
    }
    if (!fixed && !bits) {
        fprintf(stderr, "stepq mkmap: method %s needs --bits\n", method_name);
        return 2;
    }
    if (pivots && !mixed) {
        fprintf(stderr, "stepq mkmap: method %s has no pivots (only temporal and stepq)\n",
                method_name);
        return 2;
    }

    if (row_split > 0.0 && !stepq_method_has_col_scales(method)) {
        fprintf(stderr,
                "stepq mkmap: --row-split: method %s has no dual-axis fit (only dsq, "
                "spatial and stepq)\n",
                method_name);
        return 2;
    }

    if (fit_name && !stepq_method_has_col_scales(method)) {
        fprintf(stderr,
                "stepq mkmap: --decode-fit %s: method %s has no column refit (only dsq, "
                "spatial and stepq)\n",
                fit_name, method_name);
        return 2;
    }

    if (arith_name && !stepq_method_has_col_scales(method)) {
        fprintf(stderr,
                "stepq mkmap: --arith %s: method %s has no dual-axis decode step (only dsq, "
                "spatial and stepq)\n",
                arith_name, method_name);
        return 2;
    }
    if (arith == STEPQ_ARITH_FP16 && fit == STEPQ_DECODE_FIT_ROWS) {
        fprintf(stderr, "stepq mkmap: --arith fp16 needs --decode-fit exact or norefit, not %s\n",
                stepq_decode_fit_name(fit));
        return 2;
    }

    stepq_map_t *map = NULL;
    int st = stepq_tool_mkmap_build("mkmap", shape_key, method, bits, pivots, name, &map);
    if (st)
        return st;
    if (row_split > 0.0 && (st = stepq_map_set_row_split(map, row_split)) < 0) {
        stepq_map_close(map);
        return die("mkmap", "--row-split", st);
    }
    if ((st = stepq_map_set_decode_fit(map, fit)) < 0) {
        stepq_map_close(map);
        return die("mkmap", "--decode-fit", st);
    }
    if ((st = stepq_map_set_arith(map, arith)) < 0) { /* after the fit it may need */
        stepq_map_close(map);
        return die("mkmap", "--arith", st);
    }

    /* Written whole or not at all; a write error names the file (not its temporary name). */
    char *buf;
    size_t len;
    struct stepq_tool_out o;
    FILE *f;
    if ((st = stepq_map_write_buffer(map, &buf, &len)) < 0) {
        stepq_map_close(map);
        return die("mkmap", "write", st);
    }
    st = !(f = stepq_tool_out_open(&o, "mkmap", out)) || fwrite(buf, 1, len, f) != len ||
         stepq_tool_out_commit(&o, "mkmap") < 0;
    stepq_tool_out_discard(&o);
    stepq_free(buf);
    stepq_map_close(map);
    return st ? 1 : 0;
}
