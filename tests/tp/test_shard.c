/*
 * The shard mapper (stepq/tp.h) on every bundled map: the head split, the
 * rank's slice of the map as a valid map of its own, the round trip of the
 * slices back to the whole, tp = 1 as the identity, the errors for a tp
 * that does not divide, the padded page against a hand computation.
 * argv[1]: the repository root.
 */
#include <glob.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "config/map_internal.h"
#include "stepq/pool.h"
#include "stepq/tp.h"

static const char *root;

static const int tps[] = { 1, 2, 4, 8 };

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;

    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    n = ftell(f);
    assert_true(n >= 0);
    rewind(f);
    buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* Every bundled map: the JSON files of config/examples and of each config/calibrated folder. */
static void bundled_maps(glob_t *g)
{
    char pat[4096];

    snprintf(pat, sizeof(pat), "%s/config/examples/*.json", root);
    assert_int_equal(glob(pat, 0, NULL, g), 0);
    snprintf(pat, sizeof(pat), "%s/config/calibrated/*/*.json", root);
    assert_int_equal(glob(pat, GLOB_APPEND, NULL, g), 0);
}

static int divides(const stepq_model_shape *s, int tp)
{
    int64_t ch = 0;

    for (int i = 0; i < s->conv_rank; i++)
        if (s->conv_shape[i] > ch)
            ch = s->conv_shape[i];
    return s->num_k_heads % tp == 0 && s->num_v_heads % tp == 0 && (ch == 0 || ch % tp == 0);
}

static stepq_pool_plan_info plan(const stepq_map_t *map, int tp, int rank)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_plan_info p;

    cfg.map = map;
    cfg.tp_size = tp;
    cfg.tp_rank = rank;
    cfg.num_slots = 1;
    assert_int_equal(stepq_pool_plan(&cfg, &p), STEPQ_OK);
    return p;
}

/* Writes a map and loads the text back: the shard is a map a server can store and read. */
static void reloads_equal(const stepq_map_t *m)
{
    char *text;
    size_t len;
    stepq_map_t *back = NULL;

    assert_int_equal(stepq_map_write_buffer(m, &text, &len), STEPQ_OK);
    assert_int_equal(stepq_map_load_buffer(text, len, NULL, &back), STEPQ_OK);
    assert_true(stepq__map_equal(m, back));
    stepq_map_close(back);
    stepq_free(text);
}

/*
 * The per-head data of the shards of one tp, concatenated rank after rank,
 * is the whole map's: widths of every key row, row impact, statistics.
 */
static void concatenation_gives_back_the_whole(const stepq_map_t *whole, stepq_map_t **shards,
                                               int tp)
{
    stepq_model_shape s, ls;
    int upu, vpl;

    assert_int_equal(stepq_map_shape(whole, &s), STEPQ_OK);
    upu = s.arch == STEPQ_ARCH_KDA ? s.head_k_dim : 1;
    vpl = s.num_v_heads / tp;
    for (int l = 0; l < s.n_layers; l++) {
        for (int hv = 0; hv < s.num_v_heads; hv++) {
            const stepq_map_t *sh = shards[hv / vpl];
            const int h = hv % vpl;
            uint8_t rw[STEPQ_MAX_HEAD_DIM], rs[STEPQ_MAX_HEAD_DIM];
            const float *ww = stepq_map_row_impact(whole, l, hv),
                        *ws = stepq_map_row_impact(sh, l, h);

            assert_int_equal(stepq_map_shape(sh, &ls), STEPQ_OK);
            assert_int_equal(ls.num_v_heads, vpl);
            assert_int_equal(stepq_map_head_row_bits(whole, l, hv, rw, s.head_k_dim), STEPQ_OK);
            assert_int_equal(stepq_map_head_row_bits(sh, l, h, rs, s.head_k_dim), STEPQ_OK);
            assert_memory_equal(rw, rs, (size_t)s.head_k_dim);
            assert_true(!ww == !ws);
            if (ww)
                assert_memory_equal(ww, ws, sizeof(float) * (size_t)s.head_k_dim);
            for (int u = 0; u < upu; u++) {
                stepq_unit_stats a = STEPQ_UNIT_STATS_INITIALIZER, b = STEPQ_UNIT_STATS_INITIALIZER;
                int ra = stepq_map_unit_stats(whole, l, hv * upu + u, &a);
                int rb = stepq_map_unit_stats(sh, l, h * upu + u, &b);
                assert_int_equal(ra, rb);
                if (ra == STEPQ_OK) {
                    assert_memory_equal(&a.log_retention, &b.log_retention, sizeof(double));
                    assert_memory_equal(&a.lambda, &b.lambda, sizeof(double));
                    assert_memory_equal(a.distortion, b.distortion, sizeof(a.distortion));
                }
            }
        }
    }
}

static void every_bundled_map_shards_at_tp_1_2_4_8(void **state)
{
    glob_t g;
    int sharded = 0, refused = 0;

    bundled_maps(&g);
    assert_true(g.gl_pathc >= 50); /* 22 examples + 32 calibrated maps today */
    for (size_t f = 0; f < g.gl_pathc; f++) {
        stepq_map_t *map = NULL;
        stepq_model_shape s;
        stepq_map_memory whole_mem;

        assert_int_equal(stepq_map_load_file(g.gl_pathv[f], NULL, &map), STEPQ_OK);
        assert_int_equal(stepq_map_shape(map, &s), STEPQ_OK);
        assert_int_equal(stepq_map_memory_info(map, &whole_mem), STEPQ_OK);
        for (size_t t = 0; t < sizeof(tps) / sizeof(tps[0]); t++) {
            const int tp = tps[t];
            stepq_map_t *shards[8] = { 0 };
            uint64_t compact = 0, conv = 0, pivots = 0;

            if (!divides(&s, tp)) {
                stepq_map_t *none = (stepq_map_t *)1;
                assert_int_equal(stepq_map_shard(map, tp, 0, &none), STEPQ_EINVAL);
                assert_null(none);
                refused++;
                continue;
            }
            for (int r = 0; r < tp; r++) {
                stepq_model_shape ls;
                stepq_map_memory m;
                stepq_pool_plan_info mine, from_whole;
                int st = stepq_map_shard(map, tp, r, &shards[r]);

                if (st < 0)
                    print_error("%s tp %d rank %d: %s\n", g.gl_pathv[f], tp, r, stepq_last_error());
                assert_int_equal(st, STEPQ_OK);
                assert_int_equal(stepq_map_validate(shards[r]), STEPQ_OK);
                assert_int_equal(stepq_map_method(shards[r]), stepq_map_method(map));
                assert_true(stepq_map_budget_bits(shards[r]) >= stepq_map_budget_bits(map));
                assert_int_equal(stepq_map_shape(shards[r], &ls), STEPQ_OK);
                assert_int_equal(ls.num_k_heads, s.num_k_heads / tp);
                assert_int_equal(ls.num_v_heads, s.num_v_heads / tp);
                assert_int_equal(ls.n_layers, s.n_layers);
                assert_memory_equal(ls.layer_ids, s.layer_ids, sizeof(int) * (size_t)s.n_layers);
                assert_int_equal(stepq_map_memory_info(shards[r], &m), STEPQ_OK);
                compact += m.state_bytes_compact;
                conv += m.conv_bytes;
                pivots += m.n_pivots;
                /* A pool of the shard alone is the whole map's pool on this rank. */
                mine = plan(shards[r], 1, 0);
                from_whole = plan(map, tp, r);
                assert_int_equal(mine.state_bytes, from_whole.state_bytes);
                assert_int_equal(mine.state_bytes_compact, from_whole.state_bytes_compact);
                assert_int_equal(mine.conv_bytes, from_whole.conv_bytes);
                assert_int_equal(mine.page_bytes, from_whole.page_bytes);
                if (tp > 1 && r == 0)
                    reloads_equal(shards[r]);
                sharded++;
            }
            assert_int_equal(compact, whole_mem.state_bytes_compact);
            assert_int_equal(conv, whole_mem.conv_bytes);
            assert_int_equal(pivots, whole_mem.n_pivots);
            concatenation_gives_back_the_whole(map, shards, tp);
            for (int r = 0; r < tp; r++)
                stepq_map_close(shards[r]);
        }
        stepq_map_close(map);
    }
    /* Every map splits at 1, 2 and 4, and all but the tiny-gdn ones (H = 4) at 8. */
    {
        int tiny_gdn = 0;
        for (size_t f = 0; f < g.gl_pathc; f++)
            tiny_gdn += strstr(g.gl_pathv[f], "tiny-gdn") != NULL;
        assert_true(tiny_gdn >= 20);
        assert_int_equal(refused, tiny_gdn);
    }
    assert_true(sharded > 500);
    globfree(&g);
}

/* At tp 1 the shard is the map: equal field for field, written to the same bytes. */
static void tp_1_is_the_identity(void **state)
{
    glob_t g;
    char schema[4096];
    size_t n;

    bundled_maps(&g);
    snprintf(schema, sizeof(schema), "%s/config/SCHEMA.md", root);
    for (size_t f = 0; f <= g.gl_pathc; f++) {
        stepq_map_t *map = NULL, *one = NULL;
        char *a, *b, *md = NULL;
        size_t la, lb;

        if (f < g.gl_pathc) {
            assert_int_equal(stepq_map_load_file(g.gl_pathv[f], NULL, &map), STEPQ_OK);
        } else {
            /* The schema's full example sets every provenance field. */
            char *start, *end;
            md = slurp(schema, &n);
            start = strstr(strstr(md, "## Full example"), "```json\n") + 8;
            end = strstr(start, "\n```") + 1;
            assert_int_equal(stepq_map_load_buffer(start, (size_t)(end - start), NULL, &map),
                             STEPQ_OK);
        }
        assert_int_equal(stepq_map_shard(map, 1, 0, &one), STEPQ_OK);
        assert_true(stepq__map_equal(map, one));
        assert_int_equal(stepq_map_write_buffer(map, &a, &la), STEPQ_OK);
        assert_int_equal(stepq_map_write_buffer(one, &b, &lb), STEPQ_OK);
        assert_int_equal(la, lb);
        assert_memory_equal(a, b, la);
        stepq_free(a);
        stepq_free(b);
        stepq_map_close(one);
        stepq_map_close(map);
        free(md);
    }
    globfree(&g);
}

/* A toy GDN shape: 1 layer, H q/k heads, HV value heads of 128 x 128, conv [64 H, 3] bf16. */
static stepq_model_shape toy(int h, int hv)
{
    static const int ids[1] = { 0 };
    stepq_model_shape s;

    memset(&s, 0, sizeof(s));
    s.arch = STEPQ_ARCH_GDN;
    s.n_layers = 1;
    s.layer_ids = ids;
    s.num_k_heads = h;
    s.num_v_heads = hv;
    s.head_k_dim = 128;
    s.head_v_dim = 128;
    s.conv_rank = 2;
    s.conv_shape[0] = 64 * h;
    s.conv_shape[1] = 3;
    s.conv_dtype = STEPQ_DTYPE_BF16;
    return s;
}

static void a_tp_that_does_not_divide_is_refused_naming_both_numbers(void **state)
{
    stepq_model_shape s = toy(16, 48);
    stepq_tp_shard_info sh;
    stepq_map_t *map = NULL, *out = NULL;

    assert_int_equal(stepq_tp_shard(&s, 3, 0, &sh, sizeof(sh)), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "num_k_heads 16"));
    assert_non_null(strstr(stepq_last_error(), "tp_size 3"));
    assert_int_equal(stepq_tp_shard(&s, 32, 0, &sh, sizeof(sh)), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "num_k_heads 16 does not split over tp_size 32"));
    /* A shape with HV not a multiple of H is not a model shape at all. */
    s.num_v_heads = 20;
    assert_int_equal(stepq_tp_shard(&s, 4, 0, &sh, sizeof(sh)), STEPQ_EINVAL);
    s.num_v_heads = 48;
    /* The conv channels split too. */
    s.conv_shape[0] = 1030;
    assert_int_equal(stepq_tp_shard(&s, 4, 0, &sh, sizeof(sh)), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "1030 does not split over tp_size 4"));
    s.conv_shape[0] = 1024;
    assert_int_equal(stepq_tp_shard(&s, 4, 4, &sh, sizeof(sh)), STEPQ_EINVAL);
    assert_int_equal(stepq_tp_shard(&s, 0, 0, &sh, sizeof(sh)), STEPQ_EINVAL);
    assert_int_equal(stepq_tp_shard(&s, 4, 0, &sh, 0), STEPQ_EINVAL);
    assert_int_equal(stepq_tp_shard(&s, 4, 0, &sh, sizeof(sh) + 1), STEPQ_EINVAL);
    assert_int_equal(stepq_tp_shard(NULL, 4, 0, &sh, sizeof(sh)), STEPQ_EINVAL);

    /* The map slice refuses the same way and creates nothing. */
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_UNIFORM, 4, &map), STEPQ_OK);
    assert_int_equal(stepq_map_shard(map, 3, 0, &out), STEPQ_EINVAL);
    assert_null(out);
    assert_non_null(strstr(stepq_last_error(), "16"));
    assert_non_null(strstr(stepq_last_error(), "3"));
    assert_int_equal(stepq_map_shard(map, 2, 0, NULL), STEPQ_EINVAL);
    stepq_map_close(map);
    assert_int_equal(stepq_map_shard(map, 2, 0, &out), STEPQ_EBADF);
}

/* The split of Qwen3-Next (16 q/k heads, 32 value heads) at tp 4: blocks of 4 and 8. */
static void ranks_take_contiguous_blocks_with_their_qk_groups(void **state)
{
    stepq_model_shape s = toy(16, 32);
    stepq_tp_shard_info sh;

    s.conv_shape[0] = 8192;
    for (int r = 0; r < 4; r++) {
        assert_int_equal(stepq_tp_shard(&s, 4, r, &sh, sizeof(sh)), STEPQ_OK);
        assert_int_equal(sh.num_k_heads, 4);
        assert_int_equal(sh.num_v_heads, 8);
        assert_int_equal(sh.first_k_head, 4 * r);
        assert_int_equal(sh.first_v_head, 8 * r);
        /* value head hv reads q/k head hv / (HV / H): the rank's own q/k heads */
        for (int hv = sh.first_v_head; hv < sh.first_v_head + sh.num_v_heads; hv++) {
            assert_true(hv / 2 >= sh.first_k_head);
            assert_true(hv / 2 < sh.first_k_head + sh.num_k_heads);
        }
        assert_int_equal(sh.conv_split_dim, 0);
        assert_int_equal(sh.conv_shape[0], 2048);
        assert_int_equal(sh.conv_shape[1], 3);
    }
    /* KDA's [3, channels, taps]: the channels split, not the three convolutions. */
    s.conv_rank = 3;
    s.conv_shape[0] = 3;
    s.conv_shape[1] = 4096;
    s.conv_shape[2] = 3;
    assert_int_equal(stepq_tp_shard(&s, 8, 7, &sh, sizeof(sh)), STEPQ_OK);
    assert_int_equal(sh.conv_split_dim, 1);
    assert_int_equal(sh.conv_shape[0], 3);
    assert_int_equal(sh.conv_shape[1], 512);
    assert_int_equal(sh.conv_shape[2], 3);
    /* A model without conv state. */
    s.conv_rank = 0;
    assert_int_equal(stepq_tp_shard(&s, 2, 1, &sh, sizeof(sh)), STEPQ_OK);
    assert_int_equal(sh.conv_split_dim, -1);
    /* An older caller's smaller struct is written only as far as it goes. */
    memset(&sh, 0x5a, sizeof(sh));
    assert_int_equal(stepq_tp_shard(&s, 2, 1, &sh, offsetof(stepq_tp_shard_info, conv_rank)),
                     STEPQ_OK);
    assert_int_equal(sh.first_v_head, 16);
    assert_int_equal(sh.conv_rank, 0x5a5a5a5a);
}

/*
 * Two value heads of 128 x 128 at stepq@6, tp 2: head 0 at 4 bits, head 1 a
 * pivot (4 * 16384 bits = 6 * 32768 - 8 * 16384: the budget exactly).
 *   rank 0: codes 16384 * 4 / 8 = 8192 + row scales 256 + column scales 256
 *           = 8704 B; conv [64, 3] bf16 / 2 = 192 B at 8704; 8896 -> page 8960
 *   rank 1: fp16 16384 * 2 = 32768 + the reserved scale slots 512 = 33280 B;
 *           conv at 33280 + 192 = 33472 -> page 33536
 * Every page is 33536 B: rank 0 carries 33536 - 8960 = 24576 B of TP padding.
 * Rank 1's slice, one pivot head alone, spends 8 bits per value: its budget.
 */
static void the_padded_page_matches_a_hand_computation(void **state)
{
    stepq_model_shape s = toy(2, 2);
    stepq_map_t *map = NULL, *shard = NULL;
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_tp_plan_info p0, p1;

    s.conv_shape[0] = 64;
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 6, &map), STEPQ_OK);
    assert_int_equal(stepq_map_set_unit_bits(map, 0, 0, 4), STEPQ_OK);
    assert_int_equal(stepq_map_set_unit_bits(map, 0, 1, STEPQ_BITS_PIVOT), STEPQ_OK);
    assert_int_equal(stepq_map_validate(map), STEPQ_OK);
    cfg.map = map;
    cfg.tp_size = 2;
    cfg.num_slots = 10;
    cfg.tp_rank = 0;
    assert_int_equal(stepq_tp_plan(&cfg, &p0, sizeof(p0)), STEPQ_OK);
    cfg.tp_rank = 1;
    assert_int_equal(stepq_tp_plan(&cfg, &p1, sizeof(p1)), STEPQ_OK);

    assert_int_equal(p0.state_bytes, 8704);
    assert_int_equal(p0.conv_bytes, 192);
    assert_int_equal(p0.own_page_bytes, 8960);
    assert_int_equal(p0.page_bytes, 33536);
    assert_int_equal(p0.tp_pad_bytes, 24576);
    assert_int_equal(p0.pad_bytes, 33536 - 8704 - 192);
    assert_int_equal(p1.state_bytes, 33280);
    assert_int_equal(p1.own_page_bytes, 33536);
    assert_int_equal(p1.page_bytes, 33536);
    assert_int_equal(p1.tp_pad_bytes, 0);
    assert_int_equal(p1.pad_bytes, 64);
    for (int r = 0; r < 2; r++) {
        const stepq_tp_plan_info *p = r ? &p1 : &p0;
        assert_int_equal(p->tp_rank, r);
        assert_int_equal(p->largest_rank, 1);
        assert_int_equal(p->max_tp_pad_bytes, 24576);
        assert_int_equal(p->slots, 10);
        assert_int_equal(p->pool_bytes, 11 * 33536);
        assert_int_equal(p->replica_page_bytes, 2 * 33536);
        assert_int_equal(p->replica_tp_pad_bytes, 24576);
        assert_int_equal(p->replica_state_bytes, 8704 + 33280);
        assert_int_equal(p->replica_conv_bytes, 384);
        assert_int_equal(p->replica_pad_bytes, (33536 - 8896) + 64);
    }
    /* With a memory budget both ranks get the same slots. */
    cfg.num_slots = 0;
    cfg.memory_budget_bytes = 1000000;
    for (int r = 0; r < 2; r++) {
        cfg.tp_rank = r;
        assert_int_equal(stepq_tp_plan(&cfg, &p0, sizeof(p0)), STEPQ_OK);
        assert_int_equal(p0.slots, 1000000 / 33536 - 1);
    }
    /* The slices: rank 0 keeps budget 6, rank 1 (all pivot) takes 8. */
    assert_int_equal(stepq_map_shard(map, 2, 0, &shard), STEPQ_OK);
    assert_true(stepq_map_budget_bits(shard) == 6.0);
    stepq_map_close(shard);
    assert_int_equal(stepq_map_shard(map, 2, 1, &shard), STEPQ_OK);
    assert_true(stepq_map_budget_bits(shard) == 8.0);
    assert_int_equal(stepq_map_unit_bits(shard, 0, 0), STEPQ_BITS_PIVOT);
    reloads_equal(shard);
    stepq_map_close(shard);
    stepq_map_close(map);
}

/*
 * A slice that spends more than the whole's budget but less than the next
 * whole bit gets the smallest 2^-16 step that covers it: four heads at
 * stepq@5 over 2 ranks, rank 0 holding 6 + 5 bits, rank 1 4 + 4.
 */
static void a_slice_over_the_budget_takes_what_it_spends(void **state)
{
    stepq_model_shape s = toy(4, 4);
    stepq_map_t *map = NULL, *shard = NULL;
    const int bits[4] = { 6, 5, 4, 4 };

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 5, &map), STEPQ_OK);
    for (int h = 0; h < 4; h++)
        assert_int_equal(stepq_map_set_unit_bits(map, 0, h, bits[h]), STEPQ_OK);
    assert_int_equal(stepq_map_validate(map), STEPQ_OK);
    assert_int_equal(stepq_map_shard(map, 2, 0, &shard), STEPQ_OK);
    assert_true(stepq_map_budget_bits(shard) == 5.5);
    stepq_map_close(shard);
    assert_int_equal(stepq_map_shard(map, 2, 1, &shard), STEPQ_OK);
    assert_true(stepq_map_budget_bits(shard) == 5.0);
    stepq_map_close(shard);
    assert_int_equal(stepq_map_shard(map, 4, 0, &shard), STEPQ_OK);
    assert_true(stepq_map_budget_bits(shard) == 6.0);
    stepq_map_close(shard);
    stepq_map_close(map);
}

/* KDA pivots are [head, row]: a rank's pivots are renumbered to its local heads. */
static void kda_pivots_are_renumbered_per_rank(void **state)
{
    stepq_model_shape s = toy(4, 4);
    stepq_map_t *map = NULL, *shard = NULL;
    char *text;
    size_t len;

    s.arch = STEPQ_ARCH_KDA;
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 6, &map), STEPQ_OK);
    /* head 3 row 5 a pivot, paid for by rows of head 3 at 4 bits */
    assert_int_equal(stepq_map_set_unit_bits(map, 0, 3 * 128 + 5, STEPQ_BITS_PIVOT), STEPQ_OK);
    assert_int_equal(stepq_map_set_unit_bits(map, 0, 3 * 128 + 6, 4), STEPQ_OK);
    assert_int_equal(stepq_map_validate(map), STEPQ_OK);
    assert_int_equal(stepq_map_shard(map, 2, 1, &shard), STEPQ_OK);
    assert_int_equal(stepq_map_unit_bits(shard, 0, 1 * 128 + 5), STEPQ_BITS_PIVOT);
    assert_int_equal(stepq_map_unit_bits(shard, 0, 1 * 128 + 6), 4);
    assert_int_equal(stepq_map_write_buffer(shard, &text, &len), STEPQ_OK);
    assert_non_null(strstr(text, "\"pivots\": [[1, 5]]"));
    stepq_free(text);
    stepq_map_close(shard);
    assert_int_equal(stepq_map_shard(map, 2, 0, &shard), STEPQ_OK);
    assert_int_equal(stepq_map_write_buffer(shard, &text, &len), STEPQ_OK);
    assert_non_null(strstr(text, "\"pivots\": []"));
    stepq_free(text);
    stepq_map_close(shard);
    stepq_map_close(map);
}

/* Every rank's slice keeps the map's row split (a property of the fit, not of a head). */
static void every_slice_keeps_the_row_split(void **state)
{
    stepq_model_shape s = toy(4, 4);
    stepq_map_t *map = NULL, *shard = NULL;
    char *a, *b;
    size_t la, lb;

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 6, &map), STEPQ_OK);
    assert_int_equal(stepq_map_set_row_split(map, 0.75), STEPQ_OK);
    for (int tp = 1; tp <= 4; tp *= 2)
        for (int r = 0; r < tp; r++) {
            assert_int_equal(stepq_map_shard(map, tp, r, &shard), STEPQ_OK);
            assert_true(stepq_map_row_split(shard) == 0.75);
            if (tp == 1) {
                assert_int_equal(stepq_map_write_buffer(map, &a, &la), STEPQ_OK);
                assert_int_equal(stepq_map_write_buffer(shard, &b, &lb), STEPQ_OK);
                assert_int_equal(la, lb);
                assert_memory_equal(a, b, la);
                stepq_free(a);
                stepq_free(b);
            }
            stepq_map_close(shard);
        }
    stepq_map_close(map);
}

/* Every rank's slice keeps the map's decode fit (a property of the fit, not of a head). */
static void every_slice_keeps_the_decode_fit(void **state)
{
    stepq_model_shape s = toy(4, 4);
    stepq_map_t *map = NULL, *shard = NULL;

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 6, &map), STEPQ_OK);
    for (int fit = STEPQ_DECODE_FIT_NOREFIT; fit <= STEPQ_DECODE_FIT_ROWS; fit++) {
        assert_int_equal(stepq_map_set_decode_fit(map, (stepq_decode_fit)fit), STEPQ_OK);
        for (int tp = 1; tp <= 4; tp *= 2)
            for (int r = 0; r < tp; r++) {
                assert_int_equal(stepq_map_shard(map, tp, r, &shard), STEPQ_OK);
                assert_int_equal(stepq_map_decode_fit(shard), fit);
                stepq_map_close(shard);
            }
    }
    stepq_map_close(map);
}

/* Every rank's slice keeps the map's decode arithmetic, with the exact fit it needs; a slice of
 * an fp32 map stays fp32 under each fit. */
static void every_slice_keeps_the_arith(void **state)
{
    stepq_model_shape s = toy(4, 4);
    stepq_map_t *map = NULL, *shard = NULL;

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 6, &map), STEPQ_OK);
    assert_int_equal(stepq_map_set_arith(map, STEPQ_ARITH_FP16), STEPQ_OK);
    for (int tp = 1; tp <= 4; tp *= 2)
        for (int r = 0; r < tp; r++) {
            assert_int_equal(stepq_map_shard(map, tp, r, &shard), STEPQ_OK);
            assert_int_equal(stepq_map_arith(shard), STEPQ_ARITH_FP16);
            assert_int_equal(stepq_map_decode_fit(shard), STEPQ_DECODE_FIT_EXACT);
            stepq_map_close(shard);
        }
    assert_int_equal(stepq_map_set_arith(map, STEPQ_ARITH_FP32), STEPQ_OK);
    for (int fit = STEPQ_DECODE_FIT_EXACT; fit <= STEPQ_DECODE_FIT_ROWS; fit++) {
        assert_int_equal(stepq_map_set_decode_fit(map, (stepq_decode_fit)fit), STEPQ_OK);
        assert_int_equal(stepq_map_shard(map, 2, 1, &shard), STEPQ_OK);
        assert_int_equal(stepq_map_arith(shard), STEPQ_ARITH_FP32);
        assert_int_equal(stepq_map_decode_fit(shard), fit);
        stepq_map_close(shard);
    }
    stepq_map_close(map);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_bundled_map_shards_at_tp_1_2_4_8),
        cmocka_unit_test(tp_1_is_the_identity),
        cmocka_unit_test(a_tp_that_does_not_divide_is_refused_naming_both_numbers),
        cmocka_unit_test(ranks_take_contiguous_blocks_with_their_qk_groups),
        cmocka_unit_test(the_padded_page_matches_a_hand_computation),
        cmocka_unit_test(a_slice_over_the_budget_takes_what_it_spends),
        cmocka_unit_test(kda_pivots_are_renumbered_per_rank),
        cmocka_unit_test(every_slice_keeps_the_row_split),
        cmocka_unit_test(every_slice_keeps_the_decode_fit),
        cmocka_unit_test(every_slice_keeps_the_arith),
    };
    if (argc != 2) {
        fprintf(stderr, "usage: %s REPOSITORY_ROOT\n", argv[0]);
        return 2;
    }
    root = argv[1];
    return cmocka_run_group_tests(tests, NULL, NULL);
}
