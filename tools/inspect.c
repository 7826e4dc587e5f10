/*
 * stepq inspect MAP [--json]: the exact per-request memory of a precision map.
 *
 * Compact bytes come from the map's own accounting (codes + fp16 scales +
 * fp16 pivots, no padding); allocated bytes come from the pool's page layout
 * (head blocks with their alignment and reserved scale slots), so the number
 * printed is the one a pool built from this map really uses.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepq/map.h"
#include "stepq/pool.h"
#include "stepq/tp.h"
#include "tools/cli.h"
#include "tools/commands.h"

static void inspect_usage(FILE *f)
{
    fprintf(f, "usage: stepq inspect MAP [--tp N] [--json] [-o FILE]\n"
               "Prints the per-request memory of a precision map (whole model, TP 1):\n"
               "FP32 state bytes, compact bytes (codes + fp16 scales + fp16 pivots; fp8:\n"
               "e4m3 codes + fp32 tile scales), allocated bytes (head blocks with\n"
               "alignment), conv bytes, bits per value and the ratio against FP32.\n"
               "A row split other than 0.5 (the map's row_split), a decode fit other\n"
               "than exact (decode_fit) and a decode arithmetic other than fp32 (arith)\n"
               "are shown with the method.\n"
               "--tp N: also each GPU's heads and page when N GPUs split the model, every\n"
               "page padded to the largest, and that padding per GPU and per replica.\n"
               "--json: the numbers as JSON; -o: into FILE.\n");
}

static double mib(uint64_t b)
{
    return (double)b / (1024.0 * 1024.0);
}

/* Each rank's heads and padded page for --tp; 0, or 2 after a line naming --tp. */
static int plan_ranks(const stepq_map_t *map, int tp, stepq_tp_shard_info *sh,
                      stepq_tp_plan_info *pl)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_model_shape shape;

    cfg.map = map;
    cfg.num_slots = 1;
    cfg.tp_size = tp;
    stepq_map_shape(map, &shape);
    for (int r = 0; r < tp; r++) {
        cfg.tp_rank = r;
        if (stepq_tp_shard(&shape, tp, r, &sh[r], sizeof(sh[r])) < 0 ||
            stepq_tp_plan(&cfg, &pl[r], sizeof(pl[r])) < 0) {
            fprintf(stderr, "stepq inspect: --tp %d: %s\n", tp, stepq_last_error());
            return 2;
        }
    }
    return 0;
}

static void print_tp_json(FILE *f, int tp, const stepq_tp_shard_info *sh,
                          const stepq_tp_plan_info *pl)
{
    fprintf(f,
            ", \"tp\": {\"size\": %d, \"largest_rank\": %d, \"page_bytes_per_gpu\": %llu, "
            "\"page_bytes_per_replica\": %llu, \"tp_pad_bytes_per_replica\": %llu, "
            "\"max_tp_pad_bytes_per_gpu\": %llu, \"ranks\": [",
            tp, pl[0].largest_rank, (unsigned long long)pl[0].page_bytes,
            (unsigned long long)pl[0].replica_page_bytes,
            (unsigned long long)pl[0].replica_tp_pad_bytes,
            (unsigned long long)pl[0].max_tp_pad_bytes);
    for (int r = 0; r < tp; r++)
        fprintf(f,
                "%s{\"rank\": %d, \"first_v_head\": %d, \"v_heads\": %d, \"first_k_head\": %d, "
                "\"k_heads\": %d, \"state_bytes\": %llu, \"conv_bytes\": %llu, "
                "\"own_page_bytes\": %llu, \"tp_pad_bytes\": %llu}",
                r ? ", " : "", r, sh[r].first_v_head, sh[r].num_v_heads, sh[r].first_k_head,
                sh[r].num_k_heads, (unsigned long long)pl[r].state_bytes,
                (unsigned long long)pl[r].conv_bytes, (unsigned long long)pl[r].own_page_bytes,
                (unsigned long long)pl[r].tp_pad_bytes);
    fputs("]}", f);
}

static void print_tp_text(FILE *f, int tp, const stepq_tp_shard_info *sh,
                          const stepq_tp_plan_info *pl)
{
    fprintf(f,
            "tensor parallel, tp %d: every GPU's page is padded to the largest (rank %d's) so "
            "slot ids agree\n",
            tp, pl[0].largest_rank);
    fprintf(f, "  %4s  %11s  %9s  %12s  %12s  %20s\n", "rank", "value heads", "q/k heads",
            "state B", "own page B", "TP padding B per GPU");
    for (int r = 0; r < tp; r++) {
        char v[32], k[32];
        snprintf(v, sizeof(v), "%d-%d", sh[r].first_v_head,
                 sh[r].first_v_head + sh[r].num_v_heads - 1);
        snprintf(k, sizeof(k), "%d-%d", sh[r].first_k_head,
                 sh[r].first_k_head + sh[r].num_k_heads - 1);
        fprintf(f, "  %4d  %11s  %9s  %12llu  %12llu  %20llu\n", r, v, k,
                (unsigned long long)pl[r].state_bytes, (unsigned long long)pl[r].own_page_bytes,
                (unsigned long long)pl[r].tp_pad_bytes);
    }
    fprintf(f, "  page per GPU     %12llu B  %10.4f MiB  (TP padding up to %llu B)\n",
            (unsigned long long)pl[0].page_bytes, mib(pl[0].page_bytes),
            (unsigned long long)pl[0].max_tp_pad_bytes);
    fprintf(f, "  page per replica %12llu B  %10.4f MiB  (TP padding %llu B, %d GPUs)\n",
            (unsigned long long)pl[0].replica_page_bytes, mib(pl[0].replica_page_bytes),
            (unsigned long long)pl[0].replica_tp_pad_bytes, tp);
}

int stepq_tool_inspect(int argc, char **argv)
{
    const char *path = NULL, *out_path = NULL;
    int json = 0, tp = 0; /* 0: no --tp */

    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (!strcmp(argv[i], "-o") || !strcmp(argv[i], "--tp")) {
            static const char *const value_opts[] = { "--tp", "-o", NULL };
            long long n;
            if (i + 1 == argc)
                return stepq_tool_missing_value("inspect", argv[i], value_opts);
            if (argv[i][1] == 'o') {
                out_path = argv[++i];
            } else {
                if (stepq_tool_int("inspect", "--tp", argv[i + 1], 1, 1024, &n) < 0)
                    return 2;
                tp = (int)n;
                i++;
            }
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            inspect_usage(stdout);
            return 0;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "stepq inspect: unknown option '%s' (see stepq inspect --help)\n",
                    argv[i]);
            return 2;
        } else if (path) {
            fprintf(stderr, "stepq inspect: a second MAP '%s'\n", argv[i]);
            return 2;
        } else {
            path = argv[i];
        }
    }
    if (!path) {
        inspect_usage(stderr);
        return 2;
    }

    stepq_map_t *map = NULL;
    int st = stepq_map_load_file(path, NULL, &map);
    if (st < 0) {
        stepq_tool_path_error("inspect", path, NULL, stepq_last_error(), st);
        return 1;
    }

    stepq_map_memory mem;
    st = stepq_map_memory_info(map, &mem);
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_plan_info plan;
    cfg.map = map;
    cfg.num_slots = 1;
    if (st >= 0)
        st = stepq_pool_plan(&cfg, &plan);
    if (st < 0) {
        stepq_tool_path_error("inspect", path, NULL, stepq_last_error(), st);
        stepq_map_close(map);
        return 1;
    }

    stepq_tp_shard_info *sh = NULL;
    stepq_tp_plan_info *tpp = NULL;
    if (tp) {
        sh = calloc((size_t)tp, sizeof(*sh));
        tpp = calloc((size_t)tp, sizeof(*tpp));
        st = !sh || !tpp ? 1 : plan_ranks(map, tp, sh, tpp);
        if (st) {
            if (st == 1)
                fprintf(stderr, "stepq inspect: out of memory\n");
            free(sh);
            free(tpp);
            stepq_map_close(map);
            return st;
        }
    }

    struct stepq_tool_out out;
    FILE *f = stepq_tool_out_open(&out, "inspect", out_path);
    if (!f) {
        free(sh);
        free(tpp);
        stepq_map_close(map);
        return 1;
    }
    stepq_model_shape shape;
    stepq_map_shape(map, &shape);
    const double split = stepq_map_row_split(map);
    const stepq_decode_fit fit = stepq_map_decode_fit(map);
    const stepq_arith arith = stepq_map_arith(map);
    if (json) {
        fputs("{\"map\": ", f);
        stepq_tool_json_str(f, path);
        fprintf(f,
                ", \"method\": \"%s\", \"arch\": \"%s\", \"layers\": %d, "
                "\"units\": %llu, \"pivots\": %llu, "
                "\"state_bytes_fp32\": %llu, \"state_bytes_compact\": %llu, "
                "\"state_bytes_allocated\": %llu, \"conv_bytes\": %llu, "
                "\"bits_per_value\": %.6f, \"ratio_vs_fp32\": %.6f",
                stepq_method_name(stepq_map_method(map)), stepq_arch_name(shape.arch),
                shape.n_layers, (unsigned long long)mem.n_units, (unsigned long long)mem.n_pivots,
                (unsigned long long)mem.state_bytes_fp32,
                (unsigned long long)mem.state_bytes_compact, (unsigned long long)plan.state_bytes,
                (unsigned long long)mem.conv_bytes, mem.bits_per_value, mem.ratio_vs_fp32);
        if (split != 0.5) /* as in the map: only another split than 0.5 */
            fprintf(f, ", \"row_split\": %.15g", split);
        if (fit != STEPQ_DECODE_FIT_EXACT) /* likewise */
            fprintf(f, ", \"decode_fit\": \"%s\"", stepq_decode_fit_name(fit));
        if (arith != STEPQ_ARITH_FP32) /* likewise */
            fprintf(f, ", \"arith\": \"%s\"", stepq_arith_name(arith));
        if (tp)
            print_tp_json(f, tp, sh, tpp);
        fputs("}\n", f);
    } else {
        const char *name = stepq_map_model_name(map);
        fprintf(f, "map            %s\n", path);
        fprintf(f, "model          %s (%s, %d recurrent layers, H=%d, HV=%d, %dx%d)\n",
                name[0] ? name : "(unnamed)", stepq_arch_name(shape.arch), shape.n_layers,
                shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim);
        fprintf(f, "method         %s @ %g bits nominal, %llu units, %llu pivots\n",
                stepq_method_name(stepq_map_method(map)), stepq_map_budget_bits(map),
                (unsigned long long)mem.n_units, (unsigned long long)mem.n_pivots);
        if (split != 0.5)
            fprintf(f,
                    "row split      %g (the dual-axis fit's row scale max|x_i|^%g / sqrt(w_i))\n",
                    split, split);
        if (fit == STEPQ_DECODE_FIT_NOREFIT)
            fprintf(f,
                    "decode fit     %s (decode steps store the step-2 column scales, no "
                    "refit; packs fit exactly)\n",
                    stepq_decode_fit_name(fit));
        else if (fit == STEPQ_DECODE_FIT_ROWS)
            fprintf(f,
                    "decode fit     %s (decode steps keep the page's column scales and refit "
                    "the row scales; packs fit exactly)\n",
                    stepq_decode_fit_name(fit));
        if (arith == STEPQ_ARITH_FP16)
            fprintf(f,
                    "arith          %s (decode steps compute per element in IEEE fp16; packs "
                    "compute in fp32)\n",
                    stepq_arith_name(arith));
        fprintf(f, "per request:\n");
        fprintf(f, "  state fp32       %12llu B  %10.4f MiB\n",
                (unsigned long long)mem.state_bytes_fp32, mib(mem.state_bytes_fp32));
        fprintf(f,
                "  state compact    %12llu B  %10.4f MiB  (codes %llu + scales %llu + pivots %llu "
                "+ dense %llu)\n",
                (unsigned long long)mem.state_bytes_compact, mib(mem.state_bytes_compact),
                (unsigned long long)mem.code_bytes, (unsigned long long)mem.scale_bytes,
                (unsigned long long)mem.pivot_bytes, (unsigned long long)mem.dense_bytes);
        fprintf(
            f, "  state allocated  %12llu B  %10.4f MiB  (alignment + reserved scale slots %llu)\n",
            (unsigned long long)plan.state_bytes, mib(plan.state_bytes),
            (unsigned long long)(plan.state_bytes - mem.state_bytes_compact));
        fprintf(f, "  conv state       %12llu B  %10.4f MiB  (%s, not quantized)\n",
                (unsigned long long)mem.conv_bytes, mib(mem.conv_bytes),
                stepq_dtype_name(shape.conv_dtype));
        fprintf(f, "  bits per value   %.4f\n", mem.bits_per_value);
        fprintf(f, "  ratio vs fp32    %.4fx\n", mem.ratio_vs_fp32);
        if (stepq_map_method(map) == STEPQ_METHOD_FP8) {
            /* The scales per head: one fp32 per 32 value columns (the last tile may be short). */
            const int tiles = (shape.head_v_dim + 31) / 32;
            fprintf(f,
                    "  fp8 scales       %d fp32 per head (tiles of 32 value columns, amax/240): "
                    "8 + 32*%d/(%d*%d) = %.7f bits per value\n",
                    tiles, tiles, shape.head_k_dim, shape.head_v_dim,
                    8.0 + 32.0 * tiles / ((double)shape.head_k_dim * shape.head_v_dim));
        }
        if (tp)
            print_tp_text(f, tp, sh, tpp);
    }
    free(sh);
    free(tpp);
    stepq_map_close(map);
    return stepq_tool_out_commit(&out, "inspect") < 0 ? 1 : 0;
}
