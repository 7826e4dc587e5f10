/*
 * stepq inspect MAP [--json]: the exact per-request memory of a precision map.
 *
 * Compact bytes come from the map's own accounting (codes + fp16 scales +
 * fp16 pivots, no padding); allocated bytes come from the pool's page layout
 * (head blocks with their alignment and reserved scale slots), so the number
 * printed is the one a pool built from this map really uses.
 */
#include <stdio.h>
#include <string.h>

#include "stepq/map.h"
#include "stepq/pool.h"
#include "tools/cli.h"
#include "tools/commands.h"

static void inspect_usage(FILE *f)
{
    fprintf(f, "usage: stepq inspect MAP [--json] [-o FILE]\n"
               "Prints the per-request memory of a precision map (whole model, TP 1):\n"
               "FP32 state bytes, compact bytes (codes + fp16 scales + fp16 pivots; fp8:\n"
               "e4m3 codes + fp32 tile scales), allocated bytes (head blocks with\n"
               "alignment), conv bytes, bits per value and the ratio against FP32.\n"
               "--json: the numbers as JSON; -o: into FILE.\n");
}

static double mib(uint64_t b)
{
    return (double)b / (1024.0 * 1024.0);
}

int stepq_tool_inspect(int argc, char **argv)
{
    const char *path = NULL, *out_path = NULL;
    int json = 0;

    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (!strcmp(argv[i], "-o")) {
            static const char *const value_opts[] = { "-o", NULL };
            if (i + 1 == argc)
                return stepq_tool_missing_value("inspect", argv[i], value_opts);
            out_path = argv[++i];
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

    struct stepq_tool_out out;
    FILE *f = stepq_tool_out_open(&out, "inspect", out_path);
    if (!f) {
        stepq_map_close(map);
        return 1;
    }
    stepq_model_shape shape;
    stepq_map_shape(map, &shape);
    if (json) {
        fputs("{\"map\": ", f);
        stepq_tool_json_str(f, path);
        fprintf(f,
                ", \"method\": \"%s\", \"arch\": \"%s\", \"layers\": %d, "
                "\"units\": %llu, \"pivots\": %llu, "
                "\"state_bytes_fp32\": %llu, \"state_bytes_compact\": %llu, "
                "\"state_bytes_allocated\": %llu, \"conv_bytes\": %llu, "
                "\"bits_per_value\": %.6f, \"ratio_vs_fp32\": %.6f}\n",
                stepq_method_name(stepq_map_method(map)), stepq_arch_name(shape.arch),
                shape.n_layers, (unsigned long long)mem.n_units, (unsigned long long)mem.n_pivots,
                (unsigned long long)mem.state_bytes_fp32,
                (unsigned long long)mem.state_bytes_compact, (unsigned long long)plan.state_bytes,
                (unsigned long long)mem.conv_bytes, mem.bits_per_value, mem.ratio_vs_fp32);
    } else {
        const char *name = stepq_map_model_name(map);
        fprintf(f, "map            %s\n", path);
        fprintf(f, "model          %s (%s, %d recurrent layers, H=%d, HV=%d, %dx%d)\n",
                name[0] ? name : "(unnamed)", stepq_arch_name(shape.arch), shape.n_layers,
                shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim);
        fprintf(f, "method         %s @ %g bits nominal, %llu units, %llu pivots\n",
                stepq_method_name(stepq_map_method(map)), stepq_map_budget_bits(map),
                (unsigned long long)mem.n_units, (unsigned long long)mem.n_pivots);
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
    }
    stepq_map_close(map);
    return stepq_tool_out_commit(&out, "inspect") < 0 ? 1 : 0;
}
