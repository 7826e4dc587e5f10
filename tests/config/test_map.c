/*
 * Precision maps: exact memory accounting (the paper's Qwen3.8-27B / Kimi-Linear numbers and the
 * paper), the builder API (misuse leaves the map unchanged), readers,
 * fingerprints, and write/load round trips.
 */
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "config/map_internal.h"
#include "stepq/pool.h"
#include "tests/config/fixtures.h"

static stepq_map_t *create_ok(const stepq_model_shape *s, stepq_method m, double budget)
{
    stepq_map_t *map = NULL;
    int st = stepq_map_create(s, m, budget, &map);
    if (st < 0)
        print_error("stepq_map_create: %s\n", stepq_last_error());
    assert_int_equal(st, STEPQ_OK);
    assert_non_null(map);
    return map;
}

static stepq_map_memory memory_of(const stepq_map_t *map)
{
    stepq_map_memory m;
    assert_int_equal(stepq_map_memory_info(map, &m), STEPQ_OK);
    assert_int_equal(m.state_bytes_compact,
                     m.dense_bytes + m.code_bytes + m.scale_bytes + m.pivot_bytes);
    return m;
}

/* --- accounting --- */

static void qwen27_fp32_state_and_conv_bytes_match_the_paper(void **state)
{
    stepq_model_shape s = fx_shape_qwen27();
    stepq_map_t *map = create_ok(&s, STEPQ_METHOD_FP32, 32);
    stepq_map_memory m = memory_of(map);

    assert_int_equal(s.n_layers, 48);
    assert_int_equal(m.state_bytes_fp32, 150994944);
    assert_int_equal(m.state_bytes_compact, 150994944);
    assert_int_equal(m.conv_bytes, 2949120);
    assert_int_equal(m.conv_bytes / 48, 61440);
    assert_int_equal(m.n_values, 48ull * 48 * 128 * 128);
    assert_true(m.bits_per_value == 32.0);
    assert_true(m.ratio_vs_fp32 == 1.0);
    stepq_map_close(map);

    map = create_ok(&s, STEPQ_METHOD_BF16, 16);
    m = memory_of(map);
    assert_int_equal(m.state_bytes_compact, 150994944 / 2);
    assert_true(m.bits_per_value == 16.0);
    assert_int_equal(stepq_map_unit_bits(map, 0, 0), STEPQ_BITS_DENSE);
    stepq_map_close(map);
}

/*
 * fp8: one e4m3 byte per value and one fp32 scale per (head, 32 value columns), no units;
 * 128 x 128 heads give 8 + 32 * 4 / (128 * 128) = 8 + 1/128 bits per value.
 */
static void fp8_counts_codes_and_tile_scales_and_has_no_units(void **state)
{
    stepq_model_shape s = fx_shape_qwen27();
    stepq_map_t *map = create_ok(&s, STEPQ_METHOD_FP8, 8);
    stepq_map_memory m = memory_of(map);

    assert_false(stepq_method_is_dense(STEPQ_METHOD_FP8));
    assert_false(stepq_method_has_col_scales(STEPQ_METHOD_FP8));
    assert_int_equal(m.code_bytes, 2304ull * 128 * 128);
    assert_int_equal(m.scale_bytes, 2304ull * 4 * 4);
    assert_int_equal(m.state_bytes_compact, 37785600);
    assert_int_equal(m.dense_bytes + m.pivot_bytes + m.n_pivots, 0);
    assert_true(m.bits_per_value == 8.0078125);
    assert_int_equal(stepq_map_unit_bits(map, 0, 0), STEPQ_BITS_DENSE);
    assert_null(stepq_map_layer_bits(map, 0));
    assert_int_equal(stepq_map_set_unit_bits(map, 0, 0, 8), STEPQ_EINVAL);
    stepq_unit_stats us = STEPQ_UNIT_STATS_INITIALIZER;
    assert_int_equal(stepq_map_set_unit_stats(map, 0, 0, &us), STEPQ_EINVAL);
    assert_int_equal(stepq_map_validate(map), STEPQ_OK);
    stepq_map_close(map);

    /* The budget is the format's width; nothing else is accepted. */
    static const double bad[] = { 6, 4, 16, 8.5, 32 };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        map = NULL;
        assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_FP8, bad[i], &map), STEPQ_ERANGE);
        assert_null(map);
        assert_non_null(strstr(stepq_last_error(), "budget_bits"));
    }

    /* d_v not a multiple of 32 ends in a short tile: d_v 4 and 40 have 1 and 2 tiles. */
    stepq_model_shape k = fx_shape_small(STEPQ_ARCH_KDA);
    map = create_ok(&k, STEPQ_METHOD_FP8, 8);
    m = memory_of(map);
    assert_int_equal(m.code_bytes, 3ull * 4 * 8 * 4);
    assert_int_equal(m.scale_bytes, 3ull * 4 * 4);
    stepq_map_close(map);
    k.head_v_dim = 40;
    map = create_ok(&k, STEPQ_METHOD_FP8, 8);
    m = memory_of(map);
    assert_int_equal(m.scale_bytes, 3ull * 4 * 2 * 4);
    stepq_map_close(map);
}

/* An fp8 map in JSON has no layers: a layers array is refused, the plain map loads. */
static void fp8_json_has_no_layers(void **state)
{
    static const char head[] =
        "{\"format\": \"stepq-precision-map\", \"schema_version\": 1, \"model\": {\"arch\": "
        "\"gdn\", \"recurrent_layers\": [0], \"num_k_heads\": 1, \"num_v_heads\": 1, "
        "\"head_k_dim\": 4, \"head_v_dim\": 4}, \"method\": \"fp8\", \"budget_bits\": ";
    char buf[512];
    stepq_map_t *m = NULL;

    snprintf(buf, sizeof(buf), "%s8}", head);
    assert_int_equal(stepq_map_load_buffer(buf, strlen(buf), NULL, &m), STEPQ_OK);
    assert_int_equal(stepq_map_method(m), STEPQ_METHOD_FP8);
    char *text;
    size_t len;
    assert_int_equal(stepq_map_write_buffer(m, &text, &len), STEPQ_OK);
    assert_null(strstr(text, "\"layers\""));
    assert_non_null(strstr(text, "\"method\": \"fp8\""));
    stepq_free(text);
    stepq_map_close(m);

    m = NULL;
    snprintf(buf, sizeof(buf), "%s8, \"layers\": [{\"layer\": 0, \"heads\": [{\"bits\": 8}]}]}",
             head);
    assert_int_equal(stepq_map_load_buffer(buf, strlen(buf), NULL, &m), STEPQ_ESCHEMA);
    assert_null(m);
    assert_non_null(strstr(stepq_last_error(), "layers"));
    snprintf(buf, sizeof(buf), "%s6}", head);
    assert_int_equal(stepq_map_load_buffer(buf, strlen(buf), NULL, &m), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "budget_bits"));
}

static void qwen27_dsq6_counts_codes_row_and_column_scales(void **state)
{
    stepq_model_shape s = fx_shape_qwen27();
    stepq_map_t *map = create_ok(&s, STEPQ_METHOD_DSQ, 6);
    stepq_map_memory m = memory_of(map);

    assert_int_equal(m.state_bytes_compact, 2304ull * (12288 + 256 + 256));
    assert_int_equal(m.state_bytes_compact, 29491200);
    assert_int_equal(m.code_bytes, 2304ull * 12288);
    assert_int_equal(m.scale_bytes, 2304ull * 512);
    assert_int_equal(m.pivot_bytes, 0);
    assert_int_equal(m.n_pivots, 0);
    assert_int_equal(m.n_units, 2304);
    stepq_map_close(map);
}

static void qwen27_uniform6_has_row_scales_only(void **state)
{
    stepq_model_shape s = fx_shape_qwen27();
    stepq_map_t *map = create_ok(&s, STEPQ_METHOD_UNIFORM, 6);
    stepq_map_memory m = memory_of(map);

    assert_int_equal(m.state_bytes_compact, 28901376);
    assert_int_equal(m.scale_bytes, 2304ull * 256);
    stepq_map_close(map);

    /* temporal also has row scales only */
    map = create_ok(&s, STEPQ_METHOD_TEMPORAL, 6);
    assert_int_equal(memory_of(map).state_bytes_compact, 28901376);
    stepq_map_close(map);
}

static void qwen27_stepq6_with_32_pivots_is_the_paper_layout(void **state)
{
    stepq_model_shape s = fx_shape_qwen27();
    stepq_map_t *map = create_ok(&s, STEPQ_METHOD_STEPQ, 6);

    assert_int_equal(fx_layout_exact(map, 6, 32), STEPQ_OK);
    assert_int_equal(stepq_map_validate(map), STEPQ_OK);

    /* the head bits of non-pivot heads sum to exactly 6 * 2304 - 8 * 32 */
    long sum = 0;
    int seen[17] = { 0 };
    for (int l = 0; l < 48; l++) {
        for (int h = 0; h < 48; h++) {
            int b = stepq_map_unit_bits(map, l, h);
            seen[b]++;
            if (b != STEPQ_BITS_PIVOT)
                sum += b;
        }
    }
    assert_int_equal(sum, 6 * 2304 - 8 * 32);
    assert_int_equal(seen[16], 32);
    assert_true(seen[4] > 0 && seen[6] > 0 && seen[8] > 0);
    assert_int_equal(seen[4] + seen[6] + seen[8] + seen[16], 2304);

    stepq_map_memory m = memory_of(map);
    assert_int_equal(m.state_bytes_compact, 29999104);
    assert_int_equal(m.n_pivots, 32);
    assert_int_equal(m.pivot_bytes, 32ull * 128 * 128 * 2);
    assert_int_equal(m.scale_bytes, 2272ull * 512); /* pivot heads have no scales */
    assert_true(fabs(m.ratio_vs_fp32 - 5.03) < 0.005);
    assert_true(fabs(m.bits_per_value - 29999104.0 * 8 / (2304.0 * 16384)) < 1e-12);

    /* one more bit anywhere breaks the budget rule */
    int bumped = 0;
    for (int u = 0; u < 2304 && !bumped; u++) {
        if (stepq_map_unit_bits(map, u / 48, u % 48) == 6) {
            assert_int_equal(stepq_map_set_unit_bits(map, u / 48, u % 48, 8), STEPQ_OK);
            bumped = 1;
        }
    }
    assert_true(bumped);
    assert_int_equal(stepq_map_validate(map), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "layers: non-pivot units use"));
    char *buf = NULL;
    size_t len = 0;
    assert_int_equal(stepq_map_write_buffer(map, &buf, &len), STEPQ_ERANGE);
    assert_null(buf);
    stepq_map_close(map);
}

static void kimi_fp32_and_dsq4_match_the_paper(void **state)
{
    stepq_model_shape s = fx_shape_kimi();
    stepq_map_t *map = create_ok(&s, STEPQ_METHOD_FP32, 32);
    stepq_map_memory m = memory_of(map);

    assert_int_equal(m.state_bytes_fp32, 41943040);
    assert_int_equal(m.conv_bytes, 20ull * 3 * 4096 * 3 * 2);
    stepq_map_close(map);

    map = create_ok(&s, STEPQ_METHOD_DSQ, 4);
    assert_int_equal(stepq_map_units_per_layer(map), 32 * 128);
    assert_int_equal(stepq_map_values_per_unit(map), 128);
    m = memory_of(map);
    assert_int_equal(m.state_bytes_compact, 5570560);
    assert_int_equal(m.n_units, 81920);
    assert_int_equal(m.scale_bytes, 81920ull * 2 + 640ull * 256);
    stepq_map_close(map);
}

static void kda_pivot_rows_drop_their_row_scale_and_full_pivot_heads_their_columns(void **state)
{
    stepq_model_shape s = fx_shape_kimi();
    stepq_map_t *map = create_ok(&s, STEPQ_METHOD_STEPQ, 4);

    /* paper: 512 fp16 pivot rows replacing 8-bit rows */
    assert_int_equal(fx_layout_exact(map, 4, 512), STEPQ_OK);
    assert_int_equal(stepq_map_validate(map), STEPQ_OK);
    stepq_map_memory m = memory_of(map);
    assert_int_equal(m.n_pivots, 512);
    /* codes of (4 * 81920 - 8 * 512) row-bits, 2 B per non-pivot row, 640 column vectors */
    assert_int_equal(m.code_bytes, (4ull * 81920 - 8 * 512) * 128 / 8);
    assert_int_equal(m.scale_bytes, (81920ull - 512) * 2 + 640ull * 256);
    assert_int_equal(m.pivot_bytes, 512ull * 128 * 2);
    assert_int_equal(m.state_bytes_compact, 5635072);
    stepq_map_close(map);

    /* a head whose rows are all pivots stores no column scales */
    stepq_model_shape t = fx_shape_small(STEPQ_ARCH_KDA);
    map = create_ok(&t, STEPQ_METHOD_STEPQ, 6);
    stepq_map_memory before = memory_of(map);
    for (int r = 0; r < 8; r++)
        assert_int_equal(stepq_map_set_unit_bits(map, 0, 8 + r, STEPQ_BITS_PIVOT), STEPQ_OK);
    stepq_map_memory after = memory_of(map);
    assert_int_equal(after.scale_bytes, before.scale_bytes - 8 * 2 - 4 * 2);
    assert_int_equal(after.code_bytes, before.code_bytes - 8 * 3);
    assert_int_equal(after.pivot_bytes, 8 * 4 * 2);
    stepq_map_close(map);
}

static void odd_widths_round_code_bytes_up_per_unit(void **state)
{
    stepq_model_shape s = fx_shape_small(STEPQ_ARCH_KDA);
    s.head_v_dim = 5; /* 5 values at 3 bits = 15 bits -> 2 bytes per row */
    stepq_map_t *map = create_ok(&s, STEPQ_METHOD_UNIFORM, 3);
    stepq_map_memory m = memory_of(map);
    assert_int_equal(m.code_bytes, 3ull * 4 * 8 * 2);
    stepq_map_close(map);
}

static void qwen_next_uniform_numbers(void **state)
{
    stepq_model_shape s = fx_shape_qwen_next();
    const uint64_t want[3] = { 9732096, 14450688, 19169280 };
    for (int i = 0; i < 3; i++) {
        stepq_map_t *map = create_ok(&s, STEPQ_METHOD_UNIFORM, 4 + 2 * i);
        stepq_map_memory m = memory_of(map);
        assert_int_equal(m.state_bytes_fp32, 75497472);
        assert_int_equal(m.conv_bytes, 36ull * 8192 * 3 * 2);
        assert_int_equal(m.state_bytes_compact, want[i]);
        stepq_map_close(map);
    }
}

/* --- builder misuse --- */

static void create_rejects_bad_shapes_and_budgets(void **state)
{
    stepq_model_shape s = fx_shape_small(STEPQ_ARCH_GDN);
    stepq_map_t *map = (stepq_map_t *)&s; /* must be reset to NULL */

    assert_int_equal(stepq_map_create(NULL, STEPQ_METHOD_DSQ, 4, &map), STEPQ_EINVAL);
    assert_null(map);
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_DSQ, 4, NULL), STEPQ_EINVAL);

    stepq_model_shape t = s;
    t.num_v_heads = 5;
    assert_int_equal(stepq_map_create(&t, STEPQ_METHOD_DSQ, 4, &map), STEPQ_ESHAPE);
    assert_non_null(strstr(stepq_last_error(), "model.num_v_heads: 5 is not a multiple"));
    t = s;
    int bad_ids[3] = { 0, 3, 3 };
    t.layer_ids = bad_ids;
    assert_int_equal(stepq_map_create(&t, STEPQ_METHOD_DSQ, 4, &map), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "model.recurrent_layers[2]"));
    t = s;
    t.n_layers = 0;
    assert_int_equal(stepq_map_create(&t, STEPQ_METHOD_DSQ, 4, &map), STEPQ_ERANGE);
    t = s;
    t.head_k_dim = 0;
    assert_int_equal(stepq_map_create(&t, STEPQ_METHOD_DSQ, 4, &map), STEPQ_ERANGE);
    t = s;
    t.arch = (stepq_arch)7;
    assert_int_equal(stepq_map_create(&t, STEPQ_METHOD_DSQ, 4, &map), STEPQ_ERANGE);
    t = s;
    t.conv_rank = 5;
    assert_int_equal(stepq_map_create(&t, STEPQ_METHOD_DSQ, 4, &map), STEPQ_ESHAPE);
    t = s;
    t.conv_shape[1] = 0;
    assert_int_equal(stepq_map_create(&t, STEPQ_METHOD_DSQ, 4, &map), STEPQ_ERANGE);

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_FP32, 16, &map), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "budget_bits: 16 does not match method fp32"));
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_UNIFORM, 7, &map), STEPQ_ERANGE);
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_DSQ, 4.5, &map), STEPQ_ERANGE);
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 9, &map), STEPQ_ERANGE);
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, NAN, &map), STEPQ_ENONFINITE);
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_COUNT, 4, &map), STEPQ_EINVAL);
    assert_null(map);

    /* a fractional budget is fine for per-unit methods: units start below it */
    map = create_ok(&s, STEPQ_METHOD_STEPQ, 4.5);
    assert_int_equal(stepq_map_unit_bits(map, 0, 0), 4);
    assert_int_equal(stepq_map_validate(map), STEPQ_OK);
    stepq_map_close(map);
}

/* Two identically built maps, so a failing call can be shown to change nothing. */
static void twins(stepq_method method, double budget, stepq_arch arch, stepq_map_t **a,
                  stepq_map_t **b)
{
    stepq_model_shape s = fx_shape_small(arch);
    *a = create_ok(&s, method, budget);
    *b = create_ok(&s, method, budget);
}

static void setters_reject_bad_ids_and_values_and_change_nothing(void **state)
{
    stepq_map_t *m, *ref;
    twins(STEPQ_METHOD_STEPQ, 6, STEPQ_ARCH_GDN, &m, &ref);

    assert_int_equal(stepq_map_set_unit_bits(m, -1, 0, 4), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_map_last_error(m), "layer -1 is out of range 0..2"));
    assert_int_equal(stepq_map_set_unit_bits(m, 3, 0, 4), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 4, 4), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_map_last_error(m), "unit 4 is out of range 0..3"));
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 0, 7), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "7 is not one of 2,3,4,5,6,8"));
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 0, 1), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 0, 0), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 0, 32), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_unit_bits(NULL, 0, 0, 4), STEPQ_EINVAL);

    float w[8] = { 1, 1, 1, 1, 1, 1, 1, 1 };
    w[3] = NAN;
    assert_int_equal(stepq_map_set_row_impact(m, 0, 0, w), STEPQ_ENONFINITE);
    assert_non_null(strstr(stepq_map_last_error(m), "layers[0].heads[0].row_impact[3]"));
    w[3] = 0.0f;
    assert_int_equal(stepq_map_set_row_impact(m, 0, 0, w), STEPQ_ERANGE);
    w[3] = -1.0f;
    assert_int_equal(stepq_map_set_row_impact(m, 0, 0, w), STEPQ_ERANGE);
    w[3] = 2.0f; /* geometric mean 2^(1/8) */
    assert_int_equal(stepq_map_set_row_impact(m, 0, 0, w), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "geometric mean"));
    assert_int_equal(stepq_map_set_row_impact(m, 0, 4, w), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_row_impact(m, 0, 0, NULL), STEPQ_EINVAL);

    stepq_unit_stats st = STEPQ_UNIT_STATS_INITIALIZER;
    st.log_retention = 0.25;
    assert_int_equal(stepq_map_set_unit_stats(m, 0, 0, &st), STEPQ_ERANGE);
    st.log_retention = -0.5;
    st.lambda = -1;
    assert_int_equal(stepq_map_set_unit_stats(m, 0, 0, &st), STEPQ_ERANGE);
    st.lambda = INFINITY;
    assert_int_equal(stepq_map_set_unit_stats(m, 0, 0, &st), STEPQ_ENONFINITE);
    st.lambda = 2;
    st.distortion[7] = 0.5; /* 7 is not a unit width */
    assert_int_equal(stepq_map_set_unit_stats(m, 0, 0, &st), STEPQ_EINVAL);
    st.distortion[7] = -1;
    st.distortion[4] = NAN;
    assert_int_equal(stepq_map_set_unit_stats(m, 0, 0, &st), STEPQ_ENONFINITE);
    st.distortion[4] = 0.5;
    assert_int_equal(stepq_map_set_unit_stats(m, 0, 99, &st), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_unit_stats(m, 0, 0, NULL), STEPQ_EINVAL);

    assert_int_equal(stepq_map_set_provenance(m, "notes", "caf\xc3"), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "provenance.notes: invalid UTF-8 at byte 3"));
    assert_int_equal(stepq_map_set_model_name(m, "\xed\xa0\x80"), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_provenance(m, "author", "x"), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_map_last_error(m), "provenance.author: unknown string field"));
    assert_int_equal(stepq_map_set_provenance_number(m, "tokens", -1), STEPQ_ERANGE);
    assert_int_equal(stepq_map_set_provenance_number(m, "tokens", 1.5), STEPQ_ESCHEMA);
    assert_int_equal(stepq_map_set_provenance_number(m, "horizon", 0), STEPQ_ERANGE);
    assert_int_equal(stepq_map_set_provenance_number(m, "pivot_fraction", 1.5), STEPQ_ERANGE);
    assert_int_equal(stepq_map_set_provenance_number(m, "tokens", INFINITY), STEPQ_ENONFINITE);
    assert_int_equal(stepq_map_set_provenance_number(m, "notes", 1), STEPQ_EINVAL);
    int cand_bad[3] = { 4, 4, 6 }, cand_bad2[2] = { 4, 7 };
    assert_int_equal(stepq_map_set_provenance_candidates(m, cand_bad, 3), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_provenance_candidates(m, cand_bad2, 2), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_provenance_candidates(m, cand_bad2, 0), STEPQ_EINVAL);
    assert_int_equal(stepq_map_set_provenance_candidates(m, cand_bad2, 7), STEPQ_EINVAL);

    assert_true(stepq__map_equal(m, ref));
    assert_int_equal(stepq_map_unit_stats(m, 0, 0, &st), STEPQ_ENOENT);
    stepq_map_close(m);
    stepq_map_close(ref);
}

static void methods_refuse_what_they_do_not_store(void **state)
{
    stepq_map_t *m, *ref;
    float w[8] = { 1, 1, 1, 1, 1, 1, 1, 1 };

    twins(STEPQ_METHOD_UNIFORM, 6, STEPQ_ARCH_GDN, &m, &ref);
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 0, STEPQ_BITS_PIVOT), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_map_last_error(m), "method uniform has no pivots"));
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 0, 4), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_map_last_error(m), "4 differs from budget_bits 6"));
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 0, 6), STEPQ_OK); /* its own width is fine */
    assert_int_equal(stepq_map_set_row_impact(m, 0, 0, w), STEPQ_EINVAL);
    assert_null(stepq_map_row_impact(m, 0, 0));
    assert_true(stepq__map_equal(m, ref));
    stepq_map_close(m);
    stepq_map_close(ref);

    twins(STEPQ_METHOD_FP32, 32, STEPQ_ARCH_KDA, &m, &ref);
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 0, 8), STEPQ_EINVAL);
    stepq_unit_stats st = STEPQ_UNIT_STATS_INITIALIZER;
    assert_int_equal(stepq_map_set_unit_stats(m, 0, 0, &st), STEPQ_EINVAL);
    assert_null(stepq_map_layer_bits(m, 0));
    assert_true(stepq__map_equal(m, ref));
    stepq_map_close(m);
    stepq_map_close(ref);

    twins(STEPQ_METHOD_DSQ, 4, STEPQ_ARCH_KDA, &m, &ref);
    assert_int_equal(stepq_map_set_unit_bits(m, 1, 8 * 4 - 1, 4), STEPQ_OK);
    assert_int_equal(stepq_map_set_unit_bits(m, 1, 8 * 4, 4), STEPQ_EINVAL);
    assert_true(stepq__map_equal(m, ref));
    stepq_map_close(m);
    stepq_map_close(ref);
}

static void validate_catches_partial_statistics_and_mismatched_sets(void **state)
{
    stepq_model_shape s = fx_shape_small(STEPQ_ARCH_GDN);
    stepq_map_t *m = create_ok(&s, STEPQ_METHOD_DSQ, 4);
    stepq_unit_stats st = STEPQ_UNIT_STATS_INITIALIZER;
    st.log_retention = -0.1;
    st.lambda = 3;
    st.distortion[4] = 0.01;

    assert_int_equal(stepq_map_set_unit_stats(m, 1, 2, &st), STEPQ_OK);
    assert_int_equal(stepq_map_validate(m), STEPQ_ESCHEMA);
    assert_non_null(strstr(stepq_last_error(), "layers[0].heads[0].stats: missing"));
    for (int l = 0; l < 3; l++)
        for (int h = 0; h < 4; h++)
            assert_int_equal(stepq_map_set_unit_stats(m, l, h, &st), STEPQ_OK);
    assert_int_equal(stepq_map_validate(m), STEPQ_OK);
    st.distortion[6] = 0.001;
    assert_int_equal(stepq_map_set_unit_stats(m, 2, 3, &st), STEPQ_OK);
    assert_int_equal(stepq_map_validate(m), STEPQ_ESCHEMA);
    assert_non_null(strstr(stepq_last_error(), "layers[2].heads[3].stats.distortion: measures "
                                               "bits {4,6} but the first unit measures {4}"));
    stepq_map_close(m);
}

static void readers_report_bad_ids_and_translate_layer_ids(void **state)
{
    stepq_model_shape s = fx_shape_small(STEPQ_ARCH_KDA), got;
    stepq_map_t *m = create_ok(&s, STEPQ_METHOD_SPATIAL, 5);

    assert_int_equal(stepq_map_shape(m, &got), STEPQ_OK);
    assert_int_equal(got.n_layers, 3);
    assert_int_equal(got.layer_ids[2], 3);
    assert_ptr_not_equal(got.layer_ids, s.layer_ids); /* copied */
    assert_int_equal(stepq_map_method(m), STEPQ_METHOD_SPATIAL);
    assert_true(stepq_map_budget_bits(m) == 5.0);
    assert_string_equal(stepq_map_model_name(m), "");
    assert_int_equal(stepq_map_layer_index(m, 2), 1);
    assert_int_equal(stepq_map_layer_index(m, 3), 2);
    assert_int_equal(stepq_map_layer_index(m, 1), STEPQ_ENOENT);
    assert_int_equal(stepq_map_unit_bits(m, 2, 31), 5);
    assert_int_equal(stepq_map_unit_bits(m, 3, 0), STEPQ_EINVAL);
    assert_int_equal(stepq_map_unit_bits(m, 0, 32), STEPQ_EINVAL);
    assert_int_equal(stepq_map_unit_bits(NULL, 0, 0), STEPQ_EINVAL);
    const uint8_t *lb = stepq_map_layer_bits(m, 1);
    assert_non_null(lb);
    assert_int_equal(lb[31], 5);
    assert_null(stepq_map_layer_bits(m, 3));
    const float *w = stepq_map_row_impact(m, 2, 3);
    assert_non_null(w);
    assert_true(w[7] == 1.0f);
    assert_null(stepq_map_row_impact(m, 2, 4));
    assert_int_equal(stepq_map_method(NULL), STEPQ_METHOD_COUNT);
    assert_string_equal(stepq_map_last_error(NULL), "");
    double v;
    assert_int_equal(stepq_map_provenance_number(m, "tokens", &v), STEPQ_ENOENT);
    assert_int_equal(stepq_map_provenance_candidates(m, NULL, 0), STEPQ_ENOENT);
    assert_null(stepq_map_provenance(m, "tool"));

    assert_string_equal(stepq_method_name(STEPQ_METHOD_STEPQ), "stepq");
    assert_string_equal(stepq_method_name((stepq_method)99), "?");
    assert_string_equal(stepq_arch_name(STEPQ_ARCH_KDA), "kda");
    assert_string_equal(stepq_dtype_name(STEPQ_DTYPE_BF16), "bf16");
    stepq_method meth;
    assert_int_equal(stepq_method_from_name("temporal", &meth), STEPQ_OK);
    assert_int_equal(meth, STEPQ_METHOD_TEMPORAL);
    assert_int_equal(stepq_method_from_name("int4", &meth), STEPQ_EINVAL);
    assert_true(stepq_method_has_col_scales(STEPQ_METHOD_DSQ));
    assert_false(stepq_method_has_col_scales(STEPQ_METHOD_TEMPORAL));
    assert_true(stepq_method_is_dense(STEPQ_METHOD_FP16));
    assert_int_equal(stepq_dtype_size(STEPQ_DTYPE_FP32), 4);
    stepq_map_close(m);
}

static void fingerprint_follows_the_layout_not_the_provenance(void **state)
{
    stepq_map_t *a, *b;
    uint64_t fa, fb;

    twins(STEPQ_METHOD_STEPQ, 6, STEPQ_ARCH_GDN, &a, &b);
    assert_int_equal(stepq_map_fingerprint(a, &fa), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance(b, "notes", "different notes"), STEPQ_OK);
    assert_int_equal(stepq_map_set_model_name(b, "other"), STEPQ_OK);
    assert_int_equal(stepq_map_fingerprint(b, &fb), STEPQ_OK);
    assert_true(fa == fb);
    assert_int_equal(stepq_map_set_unit_bits(b, 2, 3, 5), STEPQ_OK);
    assert_int_equal(stepq_map_fingerprint(b, &fb), STEPQ_OK);
    assert_true(fa != fb);
    assert_int_equal(stepq_map_set_unit_bits(b, 2, 3, 6), STEPQ_OK);
    float w[8] = { 2, 0.5f, 1, 1, 1, 1, 1, 1 };
    assert_int_equal(stepq_map_set_row_impact(b, 0, 0, w), STEPQ_OK);
    assert_int_equal(stepq_map_fingerprint(b, &fb), STEPQ_OK);
    assert_true(fa != fb);
    stepq_map_close(a);
    stepq_map_close(b);
}

/* --- round trips --- */

/* A map with every optional part filled, values chosen to stress number printing. */
static stepq_map_t *full_map(stepq_arch arch, stepq_method method, double budget)
{
    stepq_model_shape s = fx_shape_small(arch);
    stepq_map_t *m = create_ok(&s, method, budget);
    unsigned long long rng = 42 + (unsigned long long)arch * 7 + (unsigned long long)method;
    const int upl = stepq_map_units_per_layer(m);

    if (stepq_map_method(m) == STEPQ_METHOD_STEPQ || stepq_map_method(m) == STEPQ_METHOD_TEMPORAL)
        assert_int_equal(fx_layout_exact(m, (int)budget, 3), STEPQ_OK);
    if (stepq_map_row_impact(m, 0, 0)) {
        for (int l = 0; l < 3; l++) {
            for (int h = 0; h < 4; h++) {
                float w[8];
                double lg = 0;
                for (int i = 0; i < 8; i++) {
                    w[i] = (float)exp(4.0 * (fx_rand(&rng) - 0.5));
                    lg += log(w[i]);
                }
                for (int i = 0; i < 8; i++)
                    w[i] = (float)(w[i] / exp(lg / 8));
                assert_int_equal(stepq_map_set_row_impact(m, l, h, w), STEPQ_OK);
            }
        }
    }
    for (int l = 0; l < 3; l++) {
        for (int u = 0; u < upl; u++) {
            stepq_unit_stats st = STEPQ_UNIT_STATS_INITIALIZER;
            st.log_retention = -fx_rand(&rng) * pow(10, -8 * fx_rand(&rng));
            if (u == 1)
                st.log_retention = -0.0;
            st.lambda = 1.0 / (1.0 - fx_rand(&rng)) * 1e10;
            st.distortion[3] = fx_rand(&rng) * 1e-300;
            st.distortion[4] = 0.1;
            st.distortion[8] = u == 2 ? 0.0 : fx_rand(&rng) / 3.0;
            assert_int_equal(stepq_map_set_unit_stats(m, l, u, &st), STEPQ_OK);
        }
    }
    assert_int_equal(
        stepq_map_set_model_name(m, "T\303\251st \"model\"\\ \n\t\001 \360\237\230\200"), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance(m, "tool", "test_map"), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance(m, "tool_version", "0.1.0"), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance(m, "data", "wikitext-2 train, 32 x 2048"), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance(m, "notes", ""), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance(m, "method_detail", "B6 = {4,6,8}"), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance_number(m, "tokens", 65536), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance_number(m, "segments", 32), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance_number(m, "segment_length", 2048), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance_number(m, "horizon", 9007199254740992.0), STEPQ_OK);
    assert_int_equal(stepq_map_set_provenance_number(m, "pivot_fraction", 0.0139), STEPQ_OK);
    int cand[3] = { 4, 6, 8 };
    assert_int_equal(stepq_map_set_provenance_candidates(m, cand, 3), STEPQ_OK);
    assert_int_equal(stepq_map_validate(m), STEPQ_OK);
    return m;
}

static stepq_map_t *reload(const stepq_map_t *m, char **text, size_t *len)
{
    stepq_map_t *back = NULL;
    int st = stepq_map_write_buffer(m, text, len);
    if (st < 0)
        print_error("write: %s\n", stepq_last_error());
    assert_int_equal(st, STEPQ_OK);
    assert_int_equal(strlen(*text), *len);
    st = stepq_map_load_buffer(*text, *len, NULL, &back);
    if (st < 0)
        print_error("load: %s\n", stepq_last_error());
    assert_int_equal(st, STEPQ_OK);
    return back;
}

/* back (a reloaded map, or one set back to its defaults) has the fingerprint f and writes text
 * (len bytes) byte for byte. */
static void assert_reload_keeps(const stepq_map_t *back, uint64_t f, const char *text, size_t len)
{
    uint64_t fb = 0;
    char *t2 = NULL;
    size_t n2 = 0;
    assert_int_equal(stepq_map_fingerprint(back, &fb), STEPQ_OK);
    assert_true(fb == f);
    assert_int_equal(stepq_map_write_buffer(back, &t2, &n2), STEPQ_OK);
    assert_int_equal(n2, len);
    assert_memory_equal(t2, text, len);
    stepq_free(t2);
}

static void write_then_load_gives_the_same_map_for_every_method(void **state)
{
    for (int arch = 0; arch < 2; arch++) {
        for (int method = 0; method < STEPQ_METHOD_COUNT; method++) {
            /* fp32 / bf16 / fp16 / fp8 have one fixed width and no units. */
            const int units = stepq__method_has_units((stepq_method)method);
            double budget = units ? 6 : stepq__method_fixed_bits((stepq_method)method);
            stepq_map_t *m;
            if (!units) {
                stepq_model_shape s = fx_shape_small((stepq_arch)arch);
                m = create_ok(&s, (stepq_method)method, budget);
                assert_int_equal(stepq_map_set_provenance(m, "notes", "dense"), STEPQ_OK);
            } else {
                m = full_map((stepq_arch)arch, (stepq_method)method, budget);
            }
            char *t1, *t2;
            size_t n1, n2;
            stepq_map_t *back = reload(m, &t1, &n1);
            assert_true(stepq__map_equal(m, back));
            /* deterministic: the reloaded map writes the same bytes */
            assert_int_equal(stepq_map_write_buffer(back, &t2, &n2), STEPQ_OK);
            assert_int_equal(n1, n2);
            assert_memory_equal(t1, t2, n1);
            uint64_t f1, f2;
            assert_int_equal(stepq_map_fingerprint(m, &f1), STEPQ_OK);
            assert_int_equal(stepq_map_fingerprint(back, &f2), STEPQ_OK);
            assert_true(f1 == f2);
            stepq_free(t1);
            stepq_free(t2);
            stepq_map_close(back);
            stepq_map_close(m);
        }
    }
}

static void equality_sees_every_field(void **state)
{
    stepq_map_t *a = full_map(STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 6);
    stepq_map_t *b = full_map(STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 6);
    stepq_unit_stats st;

    assert_true(stepq__map_equal(a, b));
    assert_int_equal(stepq_map_unit_stats(b, 2, 5, &st), STEPQ_OK);
    st.distortion[8] = nextafter(st.distortion[8], 1.0);
    assert_int_equal(stepq_map_set_unit_stats(b, 2, 5, &st), STEPQ_OK);
    assert_false(stepq__map_equal(a, b));
    stepq_map_close(b);

    b = full_map(STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 6);
    assert_int_equal(stepq_map_set_provenance_number(b, "pivot_fraction", NAN), STEPQ_OK);
    assert_false(stepq__map_equal(a, b));
    stepq_map_close(b);

    b = full_map(STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 6);
    assert_int_equal(stepq_map_set_provenance(b, "notes", NULL), STEPQ_OK);
    assert_false(stepq__map_equal(a, b));
    stepq_map_close(b);
    stepq_map_close(a);
}

/*
 * The dual-axis fit's row split: 0.5 by default and then neither written nor
 * fingerprinted (maps without the field keep their bytes and fingerprints);
 * another value round-trips, changes the fingerprint and the equality; bad
 * values and methods without column scales are refused, changing nothing.
 */
static void row_split_round_trips_and_is_refused_where_it_means_nothing(void **state)
{
    stepq_map_t *m = full_map(STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 6), *back;
    stepq_map_t *ref = full_map(STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 6);
    char *t0, *t1;
    size_t n0, n1;
    uint64_t f0, f1;

    assert_true(stepq_map_row_split(m) == 0.5);
    assert_int_equal(stepq_map_write_buffer(m, &t0, &n0), STEPQ_OK);
    assert_null(strstr(t0, "row_split"));
    assert_int_equal(stepq_map_fingerprint(m, &f0), STEPQ_OK);

    assert_int_equal(stepq_map_set_row_split(m, 0.75), STEPQ_OK);
    assert_true(stepq_map_row_split(m) == 0.75);
    assert_false(stepq__map_equal(m, ref));
    assert_int_equal(stepq_map_fingerprint(m, &f1), STEPQ_OK);
    assert_true(f1 != f0);
    back = reload(m, &t1, &n1);
    assert_non_null(strstr(t1, "\"budget_bits\": 6,\n  \"row_split\": 0.75,\n  \"provenance\""));
    assert_true(stepq__map_equal(m, back));
    assert_true(stepq_map_row_split(back) == 0.75);
    assert_reload_keeps(back, f1, t1, n1);
    stepq_free(t1);
    stepq_map_close(back);

    /* 1 is in range and prints as an integer. */
    assert_int_equal(stepq_map_set_row_split(m, 1.0), STEPQ_OK);
    back = reload(m, &t1, &n1);
    assert_non_null(strstr(t1, "\"row_split\": 1,\n"));
    assert_true(stepq_map_row_split(back) == 1.0);
    stepq_free(t1);
    stepq_map_close(back);

    /* Back to 0.5: the bytes and the fingerprint of a map that never had the field. */
    assert_int_equal(stepq_map_set_row_split(m, 0.5), STEPQ_OK);
    assert_true(stepq__map_equal(m, ref));
    assert_reload_keeps(m, f0, t0, n0);
    stepq_free(t0);

    /* Bad values: the status, a message naming the field, and the map as it was. */
    static const struct {
        double v;
        int status;
        const char *msg;
    } bad[] = {
        { 0.0, STEPQ_ERANGE, "row_split: 0 is out of range (0, 1]" },
        { -0.25, STEPQ_ERANGE, "row_split: -0.25 is out of range (0, 1]" },
        { 1.5, STEPQ_ERANGE, "row_split: 1.5 is out of range (0, 1]" },
        { NAN, STEPQ_ENONFINITE, "row_split: not a finite number" },
        { INFINITY, STEPQ_ENONFINITE, "row_split: not a finite number" },
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(stepq_map_set_row_split(m, bad[i].v), bad[i].status);
        assert_non_null(strstr(stepq_last_error(), bad[i].msg));
        assert_non_null(strstr(stepq_map_last_error(m), bad[i].msg));
        assert_true(stepq__map_equal(m, ref));
    }
    stepq_map_close(ref);
    stepq_map_close(m);

    /* Methods without column scales: only the default. */
    for (int method = 0; method < STEPQ_METHOD_COUNT; method++) {
        if (stepq_method_has_col_scales((stepq_method)method))
            continue;
        stepq_model_shape sh = fx_shape_small(STEPQ_ARCH_GDN);
        const int units = stepq__method_has_units((stepq_method)method);
        m = create_ok(&sh, (stepq_method)method,
                      units ? 6 : stepq__method_fixed_bits((stepq_method)method));
        assert_true(stepq_map_row_split(m) == 0.5);
        assert_int_equal(stepq_map_set_row_split(m, 0.75), STEPQ_EINVAL);
        assert_non_null(strstr(stepq_map_last_error(m), "has no column scales"));
        assert_non_null(strstr(stepq_map_last_error(m), stepq_method_name((stepq_method)method)));
        assert_true(stepq_map_row_split(m) == 0.5);
        assert_int_equal(stepq_map_set_row_split(m, 0.5), STEPQ_OK);
        stepq_map_close(m);
    }
    assert_true(stepq_map_row_split(NULL) == 0.0);
    assert_int_equal(stepq_map_set_row_split(NULL, 0.75), STEPQ_EINVAL);
}

/*
 * The decode step's fit: exact by default and then neither written nor
 * fingerprinted (maps without the field keep their bytes and fingerprints);
 * norefit and rows round-trip (norefit after row_split too), change the
 * fingerprint (each its own) and the equality; values outside the list and
 * methods without column scales are refused, changing nothing; the names
 * parse both ways.
 */
static void decode_fit_round_trips_and_is_refused_where_it_means_nothing(void **state)
{
    stepq_map_t *m = full_map(STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 6), *back;
    stepq_map_t *ref = full_map(STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 6);
    char *t0, *t1;
    size_t n0, n1;
    uint64_t f0, f1, fs;
    stepq_decode_fit fit;

    assert_int_equal(stepq_map_decode_fit(m), STEPQ_DECODE_FIT_EXACT);
    assert_int_equal(stepq_map_write_buffer(m, &t0, &n0), STEPQ_OK);
    assert_null(strstr(t0, "decode_fit"));
    assert_int_equal(stepq_map_fingerprint(m, &f0), STEPQ_OK);

    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_NOREFIT), STEPQ_OK);
    assert_int_equal(stepq_map_decode_fit(m), STEPQ_DECODE_FIT_NOREFIT);
    assert_false(stepq__map_equal(m, ref));
    assert_int_equal(stepq_map_fingerprint(m, &f1), STEPQ_OK);
    assert_true(f1 != f0);
    back = reload(m, &t1, &n1);
    assert_non_null(
        strstr(t1, "\"budget_bits\": 6,\n  \"decode_fit\": \"norefit\",\n  \"provenance\""));
    assert_true(stepq__map_equal(m, back));
    assert_int_equal(stepq_map_decode_fit(back), STEPQ_DECODE_FIT_NOREFIT);
    assert_reload_keeps(back, f1, t1, n1);
    stepq_free(t1);
    stepq_map_close(back);

    /* With a row split: both fields, in that order, and a fingerprint of its own. */
    assert_int_equal(stepq_map_set_row_split(m, 0.75), STEPQ_OK);
    back = reload(m, &t1, &n1);
    assert_non_null(strstr(t1, "\"row_split\": 0.75,\n  \"decode_fit\": \"norefit\",\n"));
    assert_true(stepq__map_equal(m, back));
    assert_int_equal(stepq_map_fingerprint(m, &fs), STEPQ_OK);
    assert_true(fs != f0 && fs != f1);
    stepq_free(t1);
    stepq_map_close(back);
    assert_int_equal(stepq_map_set_row_split(m, 0.5), STEPQ_OK);

    /* rows: written, reloaded, a fingerprint other than exact's and norefit's. */
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_ROWS), STEPQ_OK);
    assert_int_equal(stepq_map_decode_fit(m), STEPQ_DECODE_FIT_ROWS);
    back = reload(m, &t1, &n1);
    assert_non_null(
        strstr(t1, "\"budget_bits\": 6,\n  \"decode_fit\": \"rows\",\n  \"provenance\""));
    assert_true(stepq__map_equal(m, back));
    assert_int_equal(stepq_map_decode_fit(back), STEPQ_DECODE_FIT_ROWS);
    assert_int_equal(stepq_map_fingerprint(back, &fs), STEPQ_OK);
    assert_true(fs != f0 && fs != f1);
    stepq_free(t1);
    stepq_map_close(back);

    /* Back to exact: the bytes and the fingerprint of a map that never had the field. */
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_EXACT), STEPQ_OK);
    assert_true(stepq__map_equal(m, ref));
    assert_reload_keeps(m, f0, t0, n0);
    stepq_free(t0);

    /* Not a decode fit: refused naming the value, the map as it was. */
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_COUNT), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_map_last_error(m), "3 is not a decode fit"));
    assert_int_equal(stepq_map_set_decode_fit(m, (stepq_decode_fit)-1), STEPQ_EINVAL);
    assert_true(stepq__map_equal(m, ref));
    stepq_map_close(ref);
    stepq_map_close(m);

    /* Methods without column scales: only exact. */
    for (int method = 0; method < STEPQ_METHOD_COUNT; method++) {
        if (stepq_method_has_col_scales((stepq_method)method))
            continue;
        stepq_model_shape sh = fx_shape_small(STEPQ_ARCH_KDA);
        const int units = stepq__method_has_units((stepq_method)method);
        m = create_ok(&sh, (stepq_method)method,
                      units ? 6 : stepq__method_fixed_bits((stepq_method)method));
        assert_int_equal(stepq_map_decode_fit(m), STEPQ_DECODE_FIT_EXACT);
        assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_NOREFIT), STEPQ_EINVAL);
        assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_ROWS), STEPQ_EINVAL);
        assert_non_null(strstr(stepq_map_last_error(m), "has no column scales"));
        assert_non_null(strstr(stepq_map_last_error(m), stepq_method_name((stepq_method)method)));
        assert_int_equal(stepq_map_decode_fit(m), STEPQ_DECODE_FIT_EXACT);
        assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_EXACT), STEPQ_OK);
        stepq_map_close(m);
    }
    assert_int_equal(stepq_map_decode_fit(NULL), STEPQ_DECODE_FIT_COUNT);
    assert_int_equal(stepq_map_set_decode_fit(NULL, STEPQ_DECODE_FIT_NOREFIT), STEPQ_EINVAL);

    /* The names. */
    assert_string_equal(stepq_decode_fit_name(STEPQ_DECODE_FIT_EXACT), "exact");
    assert_string_equal(stepq_decode_fit_name(STEPQ_DECODE_FIT_NOREFIT), "norefit");
    assert_string_equal(stepq_decode_fit_name(STEPQ_DECODE_FIT_ROWS), "rows");
    assert_string_equal(stepq_decode_fit_name(STEPQ_DECODE_FIT_COUNT), "?");
    assert_int_equal(stepq_decode_fit_from_name("rows", &fit), STEPQ_OK);
    assert_int_equal(fit, STEPQ_DECODE_FIT_ROWS);
    assert_int_equal(stepq_decode_fit_from_name("norefit", &fit), STEPQ_OK);
    assert_int_equal(fit, STEPQ_DECODE_FIT_NOREFIT);
    assert_int_equal(stepq_decode_fit_from_name("exact", &fit), STEPQ_OK);
    assert_int_equal(fit, STEPQ_DECODE_FIT_EXACT);
    assert_int_equal(stepq_decode_fit_from_name("fast", &fit), STEPQ_EINVAL);
    assert_non_null(
        strstr(stepq_last_error(), "unknown decode_fit \"fast\" (one of exact, norefit, rows)"));
    assert_int_equal(stepq_decode_fit_from_name(NULL, &fit), STEPQ_EINVAL);
}

/*
 * The decode step's arithmetic: fp32 by default and then neither written nor
 * fingerprinted (maps without the field keep their bytes and fingerprints);
 * fp16 round-trips (after decode_fit too), changes the fingerprint and the
 * equality; fp16 is refused with a fit other than exact, by either setter
 * (the map unchanged) and by validation and the writer (a map made so
 * behind the setters' backs); values outside the list and methods without
 * column scales are refused, changing nothing; the names parse both ways.
 */
static void arith_round_trips_and_is_refused_where_it_means_nothing(void **state)
{
    stepq_map_t *m = full_map(STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 6), *back;
    stepq_map_t *ref = full_map(STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 6);
    char *t0, *t1;
    size_t n0, n1;
    uint64_t f0, f1, fs;
    stepq_arith arith;

    assert_int_equal(stepq_map_arith(m), STEPQ_ARITH_FP32);
    assert_int_equal(stepq_map_write_buffer(m, &t0, &n0), STEPQ_OK);
    assert_null(strstr(t0, "arith"));
    assert_int_equal(stepq_map_fingerprint(m, &f0), STEPQ_OK);

    /* fp32 set explicitly: the bytes and the fingerprint of a map without the field. */
    assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP32), STEPQ_OK);
    assert_true(stepq__map_equal(m, ref));
    assert_reload_keeps(m, f0, t0, n0);

    assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP16), STEPQ_OK);
    assert_int_equal(stepq_map_arith(m), STEPQ_ARITH_FP16);
    assert_int_equal(stepq_map_validate(m), STEPQ_OK);
    assert_false(stepq__map_equal(m, ref));
    assert_int_equal(stepq_map_fingerprint(m, &f1), STEPQ_OK);
    assert_true(f1 != f0);
    back = reload(m, &t1, &n1);
    assert_non_null(strstr(t1, "\"budget_bits\": 6,\n  \"arith\": \"fp16\",\n  \"provenance\""));
    assert_true(stepq__map_equal(m, back));
    assert_int_equal(stepq_map_arith(back), STEPQ_ARITH_FP16);
    assert_reload_keeps(back, f1, t1, n1);
    stepq_free(t1);
    stepq_map_close(back);

    /* With a row split: both fields, in that order, and a fingerprint of its own. */
    assert_int_equal(stepq_map_set_row_split(m, 0.75), STEPQ_OK);
    back = reload(m, &t1, &n1);
    assert_non_null(strstr(t1, "\"row_split\": 0.75,\n  \"arith\": \"fp16\",\n"));
    assert_true(stepq__map_equal(m, back));
    assert_int_equal(stepq_map_fingerprint(m, &fs), STEPQ_OK);
    assert_true(fs != f0 && fs != f1);
    stepq_free(t1);
    stepq_map_close(back);
    assert_int_equal(stepq_map_set_row_split(m, 0.5), STEPQ_OK);

    /* fp16 takes the fit norefit (kernels/quant.h), both ways round, with a fingerprint of its
     * own ... */
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_NOREFIT), STEPQ_OK);
    assert_int_equal(stepq_map_validate(m), STEPQ_OK);
    assert_int_equal(stepq_map_fingerprint(m, &fs), STEPQ_OK);
    assert_true(fs != f0 && fs != f1);
    back = reload(m, &t1, &n1);
    assert_int_equal(stepq_map_decode_fit(back), STEPQ_DECODE_FIT_NOREFIT);
    assert_int_equal(stepq_map_arith(back), STEPQ_ARITH_FP16);
    stepq_free(t1);
    stepq_map_close(back);
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_EXACT), STEPQ_OK);
    assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP32), STEPQ_OK);
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_NOREFIT), STEPQ_OK);
    assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP16), STEPQ_OK);
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_EXACT), STEPQ_OK);

    /* ... but not the fit rows: refused with fp16 set, naming both fields and the function,
     * the map as it was. */
    {
        const int fit = STEPQ_DECODE_FIT_ROWS;
        assert_int_equal(stepq_map_set_decode_fit(m, (stepq_decode_fit)fit), STEPQ_EINVAL);
        assert_non_null(strstr(stepq_map_last_error(m), "stepq_map_set_decode_fit"));
        assert_non_null(strstr(stepq_map_last_error(m), "arith is fp16"));
        assert_non_null(
            strstr(stepq_map_last_error(m), stepq_decode_fit_name((stepq_decode_fit)fit)));
        assert_int_equal(stepq_map_decode_fit(m), STEPQ_DECODE_FIT_EXACT);
        assert_int_equal(stepq_map_arith(m), STEPQ_ARITH_FP16);
        assert_int_equal(stepq_map_fingerprint(m, &fs), STEPQ_OK);
        assert_true(fs == f1);
    }
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_EXACT), STEPQ_OK);
    /* ... and fp16 is refused with the fit rows set. */
    assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP32), STEPQ_OK);
    {
        const int fit = STEPQ_DECODE_FIT_ROWS;
        assert_int_equal(stepq_map_set_decode_fit(m, (stepq_decode_fit)fit), STEPQ_OK);
        assert_int_equal(stepq_map_fingerprint(m, &fs), STEPQ_OK);
        assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP16), STEPQ_EINVAL);
        assert_non_null(strstr(stepq_map_last_error(m), "stepq_map_set_arith"));
        assert_non_null(
            strstr(stepq_map_last_error(m), "fp16 needs decode_fit exact or norefit, not"));
        assert_non_null(
            strstr(stepq_map_last_error(m), stepq_decode_fit_name((stepq_decode_fit)fit)));
        assert_int_equal(stepq_map_arith(m), STEPQ_ARITH_FP32);
        assert_int_equal(stepq_map_decode_fit(m), fit);
        assert_int_equal(stepq_map_fingerprint(m, &f1), STEPQ_OK);
        assert_true(f1 == fs);
        /* The pair made behind the setters' backs: validation and the writer refuse it. */
        stepq__map_of(m, "test")->arith = STEPQ_ARITH_FP16;
        assert_int_equal(stepq_map_validate(m), STEPQ_ESCHEMA);
        assert_non_null(
            strstr(stepq_last_error(), "arith: fp16 needs decode_fit exact or norefit, not"));
        assert_non_null(strstr(stepq_last_error(), stepq_decode_fit_name((stepq_decode_fit)fit)));
        assert_int_equal(stepq_map_write_buffer(m, &t1, &n1), STEPQ_ESCHEMA);
        stepq__map_of(m, "test")->arith = STEPQ_ARITH_FP32;
        assert_int_equal(stepq_map_validate(m), STEPQ_OK);
    }
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_EXACT), STEPQ_OK);

    /* Back to fp32: the bytes and the fingerprint of a map that never had the field. */
    assert_true(stepq__map_equal(m, ref));
    assert_reload_keeps(m, f0, t0, n0);
    stepq_free(t0);

    /* Not an arithmetic: refused naming the value, the map as it was. */
    assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_COUNT), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_map_last_error(m), "2 is not an arithmetic"));
    assert_int_equal(stepq_map_set_arith(m, (stepq_arith)-1), STEPQ_EINVAL);
    assert_true(stepq__map_equal(m, ref));
    stepq_map_close(ref);
    stepq_map_close(m);

    /* dsq and spatial take it too. */
    for (int method = STEPQ_METHOD_DSQ; method <= STEPQ_METHOD_SPATIAL; method++) {
        m = full_map(STEPQ_ARCH_KDA, (stepq_method)method, 6);
        assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP16), STEPQ_OK);
        back = reload(m, &t1, &n1);
        assert_int_equal(stepq_map_arith(back), STEPQ_ARITH_FP16);
        assert_true(stepq__map_equal(m, back));
        stepq_free(t1);
        stepq_map_close(back);
        stepq_map_close(m);
    }

    /* Methods without column scales: only fp32. */
    for (int method = 0; method < STEPQ_METHOD_COUNT; method++) {
        if (stepq_method_has_col_scales((stepq_method)method))
            continue;
        stepq_model_shape sh = fx_shape_small(STEPQ_ARCH_KDA);
        const int units = stepq__method_has_units((stepq_method)method);
        m = create_ok(&sh, (stepq_method)method,
                      units ? 6 : stepq__method_fixed_bits((stepq_method)method));
        assert_int_equal(stepq_map_arith(m), STEPQ_ARITH_FP32);
        assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP16), STEPQ_EINVAL);
        assert_non_null(strstr(stepq_map_last_error(m), "stepq_map_set_arith"));
        assert_non_null(strstr(stepq_map_last_error(m), "has no column scales"));
        assert_non_null(strstr(stepq_map_last_error(m), stepq_method_name((stepq_method)method)));
        assert_int_equal(stepq_map_arith(m), STEPQ_ARITH_FP32);
        assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP32), STEPQ_OK);
        /* Behind the setters' backs: validation refuses it. */
        stepq__map_of(m, "test")->arith = STEPQ_ARITH_FP16;
        assert_int_equal(stepq_map_validate(m), STEPQ_ESCHEMA);
        assert_non_null(strstr(stepq_last_error(), "arith: fp16 is not allowed for method"));
        stepq__map_of(m, "test")->arith = STEPQ_ARITH_FP32;
        stepq_map_close(m);
    }
    assert_int_equal(stepq_map_arith(NULL), STEPQ_ARITH_COUNT);
    assert_int_equal(stepq_map_set_arith(NULL, STEPQ_ARITH_FP16), STEPQ_EINVAL);

    /* The names. */
    assert_string_equal(stepq_arith_name(STEPQ_ARITH_FP32), "fp32");
    assert_string_equal(stepq_arith_name(STEPQ_ARITH_FP16), "fp16");
    assert_string_equal(stepq_arith_name(STEPQ_ARITH_COUNT), "?");
    assert_string_equal(stepq_arith_name((stepq_arith)-1), "?");
    assert_int_equal(stepq_arith_from_name("fp16", &arith), STEPQ_OK);
    assert_int_equal(arith, STEPQ_ARITH_FP16);
    assert_int_equal(stepq_arith_from_name("fp32", &arith), STEPQ_OK);
    assert_int_equal(arith, STEPQ_ARITH_FP32);
    assert_int_equal(stepq_arith_from_name("fast", &arith), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "unknown arith \"fast\" (one of fp32, fp16)"));
    assert_int_equal(stepq_arith_from_name("FP16", &arith), STEPQ_EINVAL);
    assert_int_equal(arith, STEPQ_ARITH_FP32);
    assert_int_equal(stepq_arith_from_name(NULL, &arith), STEPQ_EINVAL);
}

static void extension_keys_are_ignored_and_not_written_back(void **state)
{
    const char *doc =
        "{\"format\": \"stepq-precision-map\", \"schema_version\": 1, \"x-generator\": {\"a\": "
        "[1]},"
        " \"model\": {\"arch\": \"gdn\", \"x-hf\": \"org/model\", \"recurrent_layers\": [1],"
        " \"num_k_heads\": 1, \"num_v_heads\": 2, \"head_k_dim\": 2, \"head_v_dim\": 2},"
        " \"method\": \"temporal\", \"budget_bits\": 6, \"provenance\": {\"x-host\": \"h\"},"
        " \"layers\": [{\"layer\": 1, \"x-note\": null, \"pivots\": [1], \"heads\":"
        " [{\"bits\": 4, \"x-why\": 1}, {\"bits\": 16}]}]}";
    stepq_map_t *m = NULL, *back;
    char *text;
    size_t len;

    int st = stepq_map_load_buffer(doc, strlen(doc), NULL, &m);
    if (st < 0)
        print_error("%s\n", stepq_last_error());
    assert_int_equal(st, STEPQ_OK);
    assert_int_equal(stepq_map_unit_bits(m, 0, 1), STEPQ_BITS_PIVOT);
    stepq_model_shape s;
    stepq_map_shape(m, &s);
    assert_int_equal(s.conv_rank, 0);
    stepq_map_memory mem = memory_of(m);
    assert_int_equal(mem.conv_bytes, 0);
    back = reload(m, &text, &len);
    assert_null(strstr(text, "x-"));
    assert_true(stepq__map_equal(m, back));
    stepq_free(text);
    stepq_map_close(back);
    stepq_map_close(m);
}

static void writer_output_does_not_depend_on_the_locale(void **state)
{
    stepq_map_t *m = full_map(STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 6);
    char *t1, *t2;
    size_t n1, n2;

    assert_int_equal(stepq_map_write_buffer(m, &t1, &n1), STEPQ_OK);
    /* Locales with a decimal comma, where installed; C.UTF-8 always exists. */
    const char *names[] = { "de_DE.UTF-8", "fr_FR.UTF-8", "ru_RU.UTF-8", "C.UTF-8" };
    int tried = 0;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (!setlocale(LC_NUMERIC, names[i]))
            continue;
        tried++;
        assert_int_equal(stepq_map_write_buffer(m, &t2, &n2), STEPQ_OK);
        assert_int_equal(n1, n2);
        assert_memory_equal(t1, t2, n1);
        stepq_map_t *back = NULL;
        assert_int_equal(stepq_map_load_buffer(t2, n2, NULL, &back), STEPQ_OK);
        assert_true(stepq__map_equal(m, back));
        stepq_map_close(back);
        stepq_free(t2);
    }
    setlocale(LC_NUMERIC, "C");
    assert_true(tried > 0);
    assert_non_null(strstr(t1, "\"pivot_fraction\": 0.0139"));
    stepq_free(t1);
    stepq_map_close(m);
}

static void write_file_is_atomic_and_loadable(void **state)
{
    char dir[] = "/tmp/stepq-test-map-XXXXXX";
    char path[256];
    stepq_map_t *m = full_map(STEPQ_ARCH_GDN, STEPQ_METHOD_DSQ, 4), *back = NULL;

    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/map.json", dir);
    assert_int_equal(stepq_map_write_file(m, path), STEPQ_OK);
    assert_int_equal(stepq_map_write_file(m, path), STEPQ_OK); /* replaces */
    assert_int_equal(stepq_map_load_file(path, NULL, &back), STEPQ_OK);
    assert_true(stepq__map_equal(m, back));
    stepq_map_close(back);

    char bad[300];
    snprintf(bad, sizeof(bad), "%s/missing-dir/map.json", dir);
    assert_int_equal(stepq_map_write_file(m, bad), STEPQ_EIO);
    assert_non_null(strstr(stepq_last_error(), "missing-dir"));
    assert_int_equal(unlink(path), 0);
    assert_int_equal(rmdir(dir), 0); /* no temp file left behind */
    stepq_map_close(m);
}

/* A head's row widths: GDN repeats the head's width, KDA reads each row's unit, dense maps 0. */
static void head_row_bits_follow_the_units(void **state)
{
    uint8_t rb[8];
    for (int arch = 0; arch < 2; arch++) {
        stepq_model_shape sh = fx_shape_small((stepq_arch)arch); /* d_k 8, HV 4 */
        stepq_map_t *m = NULL;
        assert_int_equal(stepq_map_create(&sh, STEPQ_METHOD_STEPQ, 6, &m), STEPQ_OK);
        int upl = stepq_map_units_per_layer(m);
        for (int u = 0; u < upl; u++)
            assert_int_equal(stepq_map_set_unit_bits(m, 1, u, u % 2 ? 4 : 8), STEPQ_OK);
        assert_int_equal(stepq_map_head_row_bits(m, 1, 2, rb, 8), STEPQ_OK);
        for (int i = 0; i < 8; i++)
            assert_int_equal(rb[i], arch == STEPQ_ARCH_KDA ? ((2 * 8 + i) % 2 ? 4 : 8) : 8);
        assert_int_equal(stepq_map_head_row_bits(m, 1, 3, rb, 8), STEPQ_OK);
        if (arch == STEPQ_ARCH_GDN)
            assert_int_equal(rb[5], 4);
        assert_int_equal(stepq_map_head_row_bits(m, 1, 2, rb, 7), STEPQ_EINVAL);
        assert_int_equal(stepq_map_head_row_bits(m, 1, 4, rb, 8), STEPQ_EINVAL);
        assert_int_equal(stepq_map_head_row_bits(m, 3, 0, rb, 8), STEPQ_EINVAL);
        stepq_map_close(m);
        assert_int_equal(stepq_map_create(&sh, STEPQ_METHOD_BF16, 16, &m), STEPQ_OK);
        assert_int_equal(stepq_map_head_row_bits(m, 0, 0, rb, 8), STEPQ_OK);
        for (int i = 0; i < 8; i++)
            assert_int_equal(rb[i], STEPQ_BITS_DENSE);
        stepq_map_close(m);
    }
}

struct pipe_feed {
    const char *buf;
    size_t len;
    int fd;
};

static void *feed_main(void *p)
{
    struct pipe_feed *f = p;
    for (size_t at = 0; at < f->len;) {
        ssize_t w = write(f->fd, f->buf + at, f->len - at);
        if (w <= 0)
            break;
        at += (size_t)w;
    }
    close(f->fd);
    return NULL;
}

/* max_bytes = SIZE_MAX means no limit: the reader's bound must not wrap and refuse the map. */
static void load_with_the_largest_max_bytes(void **state)
{
    stepq_model_shape sh = fx_shape_small(STEPQ_ARCH_GDN);
    stepq_map_t *m = NULL, *back = NULL;
    stepq_map_load_config lc = STEPQ_MAP_LOAD_CONFIG_INITIALIZER;
    char path[] = "/tmp/stepq-map-XXXXXX";
    char *buf = NULL;
    size_t len = 0;
    int fd = mkstemp(path);

    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(stepq_map_create(&sh, STEPQ_METHOD_UNIFORM, 6, &m), STEPQ_OK);
    assert_int_equal(stepq_map_write_file(m, path), STEPQ_OK);
    assert_int_equal(stepq_map_write_buffer(m, &buf, &len), STEPQ_OK);
    lc.max_bytes = SIZE_MAX;
    assert_int_equal(stepq_map_load_file(path, &lc, &back), STEPQ_OK);
    stepq_map_close(back);
    assert_int_equal(stepq_map_load_buffer(buf, len, &lc, &back), STEPQ_OK);
    stepq_map_close(back);
    unlink(path);
    stepq_free(buf);
    stepq_map_close(m);

    /* A pipe has no size: the reader grows its buffer, bounded by max_bytes + 1. */
    sh = fx_shape_qwen27();
    assert_int_equal(stepq_map_create(&sh, STEPQ_METHOD_STEPQ, 6, &m), STEPQ_OK);
    assert_int_equal(stepq_map_write_buffer(m, &buf, &len), STEPQ_OK);
    assert_true(len > 65536);
    struct pipe_feed feed = { .buf = buf, .len = len };
    int fds[2];
    pthread_t th;
    char fdpath[64];
    assert_int_equal(pipe(fds), 0);
    feed.fd = fds[1];
    assert_int_equal(pthread_create(&th, NULL, feed_main, &feed), 0);
    snprintf(fdpath, sizeof(fdpath), "/dev/fd/%d", fds[0]);
    assert_int_equal(stepq_map_load_file(fdpath, &lc, &back), STEPQ_OK);
    pthread_join(th, NULL);
    close(fds[0]);
    stepq_map_close(back);
    stepq_free(buf);
    stepq_map_close(m);
}

/* Map handles: a closed map is STEPQ_EBADF everywhere, a second close is harmless. */
static void a_closed_map_handle_is_refused_everywhere(void **state)
{
    stepq_model_shape sh = fx_shape_small(STEPQ_ARCH_GDN), got;
    stepq_map_t *m = NULL, *later = NULL;
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool = NULL;

    assert_int_equal(stepq_map_create(&sh, STEPQ_METHOD_UNIFORM, 6, &m), STEPQ_OK);
    stepq_map_close(m);
    assert_int_equal(stepq_map_shape(m, &got), STEPQ_EBADF);
    assert_int_equal(stepq_map_set_unit_bits(m, 0, 0, 4), STEPQ_EBADF);
    assert_int_equal(stepq_map_validate(m), STEPQ_EBADF);
    assert_null(stepq_map_layer_bits(m, 0));
    assert_int_equal(stepq_map_method(m), STEPQ_METHOD_COUNT);
    assert_true(stepq_map_row_split(m) == 0.0);
    assert_int_equal(stepq_map_set_row_split(m, 0.5), STEPQ_EBADF);
    assert_int_equal(stepq_map_decode_fit(m), STEPQ_DECODE_FIT_COUNT);
    assert_int_equal(stepq_map_set_decode_fit(m, STEPQ_DECODE_FIT_EXACT), STEPQ_EBADF);
    assert_int_equal(stepq_map_arith(m), STEPQ_ARITH_COUNT);
    assert_int_equal(stepq_map_set_arith(m, STEPQ_ARITH_FP32), STEPQ_EBADF);
    stepq_map_close(m); /* a double close: refused, nothing freed twice */
    assert_non_null(strstr(stepq_last_error(), "closed or not valid"));
    /* A later map may take the memory and the table entry, never the handle. */
    assert_int_equal(stepq_map_create(&sh, STEPQ_METHOD_UNIFORM, 6, &later), STEPQ_OK);
    assert_true(later != m);
    assert_int_equal(stepq_map_shape(m, &got), STEPQ_EBADF);
    cfg.map = m;
    cfg.num_slots = 2;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_EBADF);
    assert_non_null(strstr(stepq_last_error(), "stepq_pool_config.map"));
    assert_null(pool);
    /* A pool's handle is not a map's. */
    cfg.map = later;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_OK);
    assert_int_equal(stepq_map_shape((const stepq_map_t *)pool, &got), STEPQ_EBADF);
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);
    stepq_map_close(later);
}

/* Writes full-featured maps as fuzz seeds (tests/fuzz/corpus/ok-full-*.json). */
static int write_corpus(const char *dir)
{
    static const struct {
        stepq_arch arch;
        stepq_method method;
        double budget;
        const char *name;
    } maps[] = {
        { STEPQ_ARCH_GDN, STEPQ_METHOD_STEPQ, 6, "ok-full-gdn-stepq6.json" },
        { STEPQ_ARCH_GDN, STEPQ_METHOD_TEMPORAL, 4, "ok-full-gdn-temporal4.json" },
        { STEPQ_ARCH_KDA, STEPQ_METHOD_STEPQ, 4, "ok-full-kda-stepq4.json" },
        { STEPQ_ARCH_KDA, STEPQ_METHOD_SPATIAL, 3, "ok-full-kda-spatial3.json" },
    };
    char path[1024];
    for (size_t i = 0; i < sizeof(maps) / sizeof(maps[0]); i++) {
        stepq_map_t *m = full_map(maps[i].arch, maps[i].method, maps[i].budget);
        snprintf(path, sizeof(path), "%s/%s", dir, maps[i].name);
        if (stepq_map_write_file(m, path) < 0) {
            fprintf(stderr, "%s\n", stepq_last_error());
            return 1;
        }
        stepq_map_close(m);
    }
    return 0;
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(qwen27_fp32_state_and_conv_bytes_match_the_paper),
        cmocka_unit_test(qwen27_dsq6_counts_codes_row_and_column_scales),
        cmocka_unit_test(fp8_counts_codes_and_tile_scales_and_has_no_units),
        cmocka_unit_test(fp8_json_has_no_layers),
        cmocka_unit_test(qwen27_uniform6_has_row_scales_only),
        cmocka_unit_test(qwen27_stepq6_with_32_pivots_is_the_paper_layout),
        cmocka_unit_test(kimi_fp32_and_dsq4_match_the_paper),
        cmocka_unit_test(head_row_bits_follow_the_units),
        cmocka_unit_test(load_with_the_largest_max_bytes),
        cmocka_unit_test(a_closed_map_handle_is_refused_everywhere),
        cmocka_unit_test(kda_pivot_rows_drop_their_row_scale_and_full_pivot_heads_their_columns),
        cmocka_unit_test(odd_widths_round_code_bytes_up_per_unit),
        cmocka_unit_test(qwen_next_uniform_numbers),
        cmocka_unit_test(create_rejects_bad_shapes_and_budgets),
        cmocka_unit_test(setters_reject_bad_ids_and_values_and_change_nothing),
        cmocka_unit_test(methods_refuse_what_they_do_not_store),
        cmocka_unit_test(validate_catches_partial_statistics_and_mismatched_sets),
        cmocka_unit_test(readers_report_bad_ids_and_translate_layer_ids),
        cmocka_unit_test(fingerprint_follows_the_layout_not_the_provenance),
        cmocka_unit_test(write_then_load_gives_the_same_map_for_every_method),
        cmocka_unit_test(equality_sees_every_field),
        cmocka_unit_test(row_split_round_trips_and_is_refused_where_it_means_nothing),
        cmocka_unit_test(decode_fit_round_trips_and_is_refused_where_it_means_nothing),
        cmocka_unit_test(arith_round_trips_and_is_refused_where_it_means_nothing),
        cmocka_unit_test(extension_keys_are_ignored_and_not_written_back),
        cmocka_unit_test(writer_output_does_not_depend_on_the_locale),
        cmocka_unit_test(write_file_is_atomic_and_loadable),
    };
    if (argc == 3 && !strcmp(argv[1], "--write-corpus"))
        return write_corpus(argv[2]);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
