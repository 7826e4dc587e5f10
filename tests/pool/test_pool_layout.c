/*
 * Page layouts built from precision maps: head-block placement, conv state,
 * padding, exact byte accounting, tensor-parallel splits, and the paper's
 * numbers for the Qwen3.8-27B shape (the paper's).
 */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/format.h"
#include "pool/internal.h"
#include "stepq/map.h"
#include "stepq/pool.h"
#include "tests/config/fixtures.h"

#define MiB (1024.0 * 1024.0)
#define GiB (1024.0 * 1024.0 * 1024.0)

/* stepq@6 with 32 pivot heads (1.39% of 2304) paid for by 32 heads at 4 bits. */
static stepq_map_t *qwen_stepq6(void)
{
    stepq_model_shape s = fx_shape_qwen27();
    stepq_map_t *map = NULL;

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 6.0, &map), STEPQ_OK);
    for (int i = 0; i < 32; i++) {
        /* spread over layers and heads so TP ranks get different mixes */
        assert_int_equal(stepq_map_set_unit_bits(map, i, (i * 7) % 48, STEPQ_BITS_PIVOT), STEPQ_OK);
        assert_int_equal(stepq_map_set_unit_bits(map, 47 - i, (i * 5 + 1) % 48, 4), STEPQ_OK);
    }
    assert_int_equal(stepq_map_validate(map), STEPQ_OK);
    return map;
}

static stepq_pool_plan_info plan_of(const stepq_map_t *map, int tp_rank, int tp_size,
                                    uint64_t min_page, int running)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_plan_info p;

    cfg.map = map;
    cfg.tp_rank = tp_rank;
    cfg.tp_size = tp_size;
    cfg.min_page_bytes = min_page;
    cfg.max_running_requests = running;
    assert_int_equal(stepq_pool_plan(&cfg, &p), STEPQ_OK);
    return p;
}

static void qwen_fp32_pages_reproduce_46_02_gib_at_b64(void **state)
{
    stepq_model_shape s = fx_shape_qwen27();
    stepq_map_t *map = NULL;
    stepq_pool_plan_info p;

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_FP32, 32.0, &map), STEPQ_OK);
    p = plan_of(map, 0, 1, 0, 64);
    assert_int_equal(p.state_bytes, 150994944);
    assert_int_equal(p.state_bytes_compact, 150994944);
    assert_int_equal(p.conv_bytes, 2949120);
    assert_int_equal(p.page_bytes, 153944064); /* 146.8125 MiB */
    assert_true(p.page_bytes / MiB == 146.8125);
    assert_int_equal(p.slots, 5 * 64);
    assert_int_equal(p.pool_bytes, 321ull * 153944064);
    assert_true(p.pool_bytes / GiB > 46.015 && p.pool_bytes / GiB < 46.025);
    stepq_map_close(map);
}

static void qwen_stepq6_pages_reproduce_31_4375_mib_and_9_85_gib(void **state)
{
    stepq_map_t *map = qwen_stepq6();
    stepq_map_memory mem;
    stepq_pool_plan_info p = plan_of(map, 0, 1, 0, 64);

    assert_int_equal(stepq_map_memory_info(map, &mem), STEPQ_OK);
    assert_int_equal(p.state_bytes_compact, 29999104); /* codes + scales + 32 fp16 pivots */
    assert_int_equal(p.state_bytes_compact, mem.state_bytes_compact);
    assert_int_equal(p.state_bytes, 30015488); /* + the pivot heads' scale slots */
    assert_int_equal(p.align_bytes, 16384);
    assert_int_equal(p.page_bytes, 32964608);
    assert_true(p.page_bytes / MiB == 31.4375);
    assert_int_equal(p.pad_bytes, 0);
    assert_int_equal(p.pool_bytes, 321ull * 32964608);
    assert_true(p.pool_bytes / GiB > 9.845 && p.pool_bytes / GiB < 9.855);
    stepq_map_close(map);
}

static void blocks_follow_the_kernel_format_layer_by_layer(void **state)
{
    stepq_map_t *map = qwen_stepq6();
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool;
    const stepq_pool_layout *l;
    uint64_t off = 0;

    cfg.map = map;
    cfg.num_slots = 1;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_OK);
    assert_int_equal(stepq_pool_get_layout(pool, &l), STEPQ_OK);
    assert_int_equal(l->n_blocks, 48 * 48);
    assert_int_equal(l->n_local_heads, 48);
    for (int layer = 0; layer < 48; layer++) {
        for (int h = 0; h < 48; h++) {
            int b = layer * 48 + h;
            uint8_t bits = (uint8_t)stepq_map_unit_bits(map, layer, h), row[128];
            struct stepq__head_layout hl;

            memset(row, bits, sizeof(row));
            assert_int_equal(
                stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 128, 128, row, 16),
                STEPQ_OK);
            assert_int_equal(l->unit_bits[b], bits);
            assert_int_equal(l->block_offset[b], off);
            assert_int_equal(l->block_bytes[b], hl.block_bytes);
            assert_int_equal(l->block_compact[b], hl.compact_bytes);
            assert_int_equal(l->block_offset[b] % 16, 0);
            off += hl.block_bytes;
            stepq__head_layout_free(&hl);
        }
    }
    assert_int_equal(l->state_bytes, off);
    for (int layer = 0; layer < 48; layer++)
        assert_int_equal(l->conv_offset[layer], off + (uint64_t)layer * 61440);
    assert_int_equal(l->page_bytes % 256, 0);
    assert_int_equal(l->page_bytes, l->state_bytes + l->conv_bytes + l->pad_bytes);
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);
    stepq_map_close(map);
}

static void tensor_parallel_ranks_split_heads_and_agree_on_the_page(void **state)
{
    stepq_map_t *map = qwen_stepq6();
    stepq_pool_plan_info p[4], full = plan_of(map, 0, 1, 0, 8);
    uint64_t state_sum = 0, compact = 0, max_page = 0;
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool[2];
    const stepq_pool_layout *l[2];
    int differ = 0;

    for (int r = 0; r < 4; r++) {
        p[r] = plan_of(map, r, 4, 0, 8);
        state_sum += p[r].state_bytes;
        compact += p[r].state_bytes_compact;
        assert_int_equal(p[r].conv_bytes, 2949120 / 4);
        if (p[r].page_bytes > max_page)
            max_page = p[r].page_bytes;
        differ |= p[r].page_bytes != p[0].page_bytes;
    }
    assert_int_equal(state_sum, full.state_bytes);
    assert_int_equal(compact, full.state_bytes_compact);
    assert_true(differ); /* pivots and 4-bit heads fall unevenly on the ranks */
    for (int r = 0; r < 4; r++) {
        stepq_pool_plan_info q = plan_of(map, r, 4, max_page, 8);
        assert_int_equal(q.page_bytes, max_page);
        assert_int_equal(q.page_bytes, q.state_bytes + q.conv_bytes + q.pad_bytes);
        assert_int_equal(q.slots, 40);
    }
    /* Rank 1 starts at value head 12; layouts of different ranks differ. */
    cfg.map = map;
    cfg.tp_size = 4;
    cfg.num_slots = 1;
    for (int r = 0; r < 2; r++) {
        cfg.tp_rank = r;
        assert_int_equal(stepq_pool_open(&cfg, &pool[r]), STEPQ_OK);
        assert_int_equal(stepq_pool_get_layout(pool[r], &l[r]), STEPQ_OK);
        assert_int_equal(l[r]->first_head, 12 * r);
        assert_int_equal(l[r]->n_local_heads, 12);
        for (int h = 0; h < 12; h++)
            assert_int_equal(l[r]->unit_bits[h], stepq_map_unit_bits(map, 0, 12 * r + h));
    }
    assert_true(l[0]->fingerprint != l[1]->fingerprint);
    for (int r = 0; r < 2; r++)
        assert_int_equal(stepq_pool_close(pool[r], 0), STEPQ_OK);
    /* 48 heads do not split over 5 ranks. */
    cfg.tp_size = 5;
    cfg.tp_rank = 0;
    assert_int_equal(stepq_pool_open(&cfg, &pool[0]), STEPQ_ESHAPE);
    cfg.tp_size = 4;
    cfg.tp_rank = 4;
    assert_int_equal(stepq_pool_open(&cfg, &pool[0]), STEPQ_EINVAL);
    stepq_map_close(map);
}

static void a_memory_budget_buys_whole_pages(void **state)
{
    stepq_map_t *map = qwen_stepq6();
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_plan_info p;

    cfg.map = map;
    cfg.memory_budget_bytes = 10ull << 30;
    assert_int_equal(stepq_pool_plan(&cfg, &p), STEPQ_OK);
    assert_int_equal(p.slots, (int32_t)((10ull << 30) / 32964608) - 1);
    assert_true(p.pool_bytes <= cfg.memory_budget_bytes);
    assert_true(p.pool_bytes + p.page_bytes > cfg.memory_budget_bytes);
    cfg.memory_budget_bytes = 32964608;
    assert_int_equal(stepq_pool_plan(&cfg, &p), STEPQ_ENOSPC);
    stepq_map_close(map);
}

static void kda_blocks_mix_row_widths_within_a_head(void **state)
{
    static int ids[2] = { 0, 3 };
    stepq_model_shape s;
    stepq_map_t *map = NULL;
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool;
    const stepq_pool_layout *l;
    uint8_t row[64];
    struct stepq__head_layout hl;

    memset(&s, 0, sizeof(s));
    s.arch = STEPQ_ARCH_KDA;
    s.n_layers = 2;
    s.layer_ids = ids;
    s.num_k_heads = 4;
    s.num_v_heads = 4;
    s.head_k_dim = 64;
    s.head_v_dim = 64;
    s.conv_rank = 2;
    s.conv_shape[0] = 768;
    s.conv_shape[1] = 3;
    s.conv_dtype = STEPQ_DTYPE_FP32;
    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_STEPQ, 4.0, &map), STEPQ_OK);
    /* Head 1 of layer 1: rows 0..9 at 2 bits, row 10 a pivot, rows 11..15 at 6 bits. */
    for (int r = 0; r < 16; r++) {
        int bits = r < 10 ? 2 : r == 10 ? STEPQ_BITS_PIVOT : 6;
        assert_int_equal(stepq_map_set_unit_bits(map, 1, 64 + r, bits), STEPQ_OK);
    }
    cfg.map = map;
    cfg.num_slots = 3;
    cfg.tp_size = 2;
    cfg.tp_rank = 0;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_OK);
    assert_int_equal(stepq_pool_get_layout(pool, &l), STEPQ_OK);
    assert_int_equal(l->units_per_head, 64);
    assert_int_equal(l->n_blocks, 4);
    for (int r = 0; r < 64; r++)
        row[r] = (uint8_t)stepq_map_unit_bits(map, 1, 64 + r);
    assert_int_equal(row[10], STEPQ_BITS_PIVOT);
    assert_memory_equal(l->unit_bits + 3 * 64, row, 64);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 64, 64, row, 16),
        STEPQ_OK);
    assert_int_equal(l->block_bytes[3], hl.block_bytes);
    assert_int_equal(l->block_compact[3], hl.compact_bytes);
    stepq__head_layout_free(&hl);
    assert_int_equal(l->conv_bytes_per_layer, 768 * 3 * 4 / 2);
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);
    stepq_map_close(map);
}

/*
 * Sizes that would wrap 64 bits are refused, naming the field, before any
 * work: the pool size of huge pages x many slots, huge alignments, a huge
 * minimum page.
 */
static void sizes_that_would_wrap_are_refused(void **state)
{
    stepq_model_shape s = fx_shape_small(STEPQ_ARCH_GDN);
    stepq_map_t *map = NULL;
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_plan_info plan;

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_UNIFORM, 4, &map), STEPQ_OK);
    cfg.map = map;
    cfg.num_slots = 1 << 30;
    cfg.min_page_bytes = UINT64_C(1) << 40;
    assert_int_equal(stepq_pool_plan(&cfg, &plan), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "overflow"));
    cfg.num_slots = 4;
    cfg.min_page_bytes = UINT64_C(1) << 62;
    assert_int_equal(stepq_pool_plan(&cfg, &plan), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "min_page_bytes"));
    cfg.min_page_bytes = 0;
    cfg.page_align = UINT64_C(1) << 63;
    assert_int_equal(stepq_pool_plan(&cfg, &plan), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "page_align"));
    cfg.page_align = 0;
    cfg.block_align = 1u << 31;
    assert_int_equal(stepq_pool_plan(&cfg, &plan), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "block_align"));
    cfg.block_align = 0;
    assert_int_equal(stepq_pool_plan(&cfg, &plan), STEPQ_OK);
    stepq_map_close(map);
}

/*
 * fp8 pages: each 128x128 head block is 16384 code bytes + 4 fp32 tile scales = 16400 B,
 * with no alignment padding at the default 16-byte alignment; a 256-byte block alignment
 * pads every block to 16640 and the compact count stays.
 */
static void fp8_blocks_are_codes_plus_tile_scales(void **state)
{
    stepq_model_shape s = fx_shape_qwen_next();
    stepq_map_t *map = NULL;
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_plan_info p;

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_FP8, 8, &map), STEPQ_OK);
    cfg.map = map;
    cfg.num_slots = 2;
    assert_int_equal(stepq_pool_plan(&cfg, &p), STEPQ_OK);
    assert_int_equal(p.state_bytes, 36ull * 32 * 16400);
    assert_int_equal(p.state_bytes_compact, 36ull * 32 * 16400);
    assert_int_equal(p.align_bytes, 0);
    cfg.block_align = 256;
    assert_int_equal(stepq_pool_plan(&cfg, &p), STEPQ_OK);
    assert_int_equal(p.state_bytes, 36ull * 32 * 16640);
    assert_int_equal(p.state_bytes_compact, 36ull * 32 * 16400);
    stepq_map_close(map);
}

static void plan_and_open_agree_and_fingerprints_are_stable(void **state)
{
    stepq_map_t *map = qwen_stepq6();
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_plan_info p;
    stepq_pool_stats st;
    stepq_pool_t *a, *b;
    const stepq_pool_layout *la, *lb;

    cfg.map = map;
    cfg.num_slots = 2;
    cfg.page_align = 4096;
    assert_int_equal(stepq_pool_plan(&cfg, &p), STEPQ_OK);
    assert_int_equal(stepq_pool_open(&cfg, &a), STEPQ_OK);
    assert_int_equal(stepq_pool_open(&cfg, &b), STEPQ_OK);
    assert_int_equal(stepq_pool_get_stats(a, &st, sizeof(st)), STEPQ_OK);
    assert_int_equal(st.page_bytes, p.page_bytes);
    assert_int_equal(p.page_bytes % 4096, 0);
    assert_int_equal(st.pool_bytes, p.pool_bytes);
    assert_int_equal(st.meta_bytes, p.meta_bytes);
    assert_int_equal(st.pad_bytes, p.pad_bytes);
    assert_int_equal(stepq_pool_get_layout(a, &la), STEPQ_OK);
    assert_int_equal(stepq_pool_get_layout(b, &lb), STEPQ_OK);
    assert_true(la->fingerprint == lb->fingerprint);
    assert_true(la->fingerprint == stepq__pool_layout_fingerprint(la));
    assert_int_equal(stepq_pool_close(a, 0), STEPQ_OK);
    assert_int_equal(stepq_pool_close(b, 0), STEPQ_OK);
    cfg.page_align = 100; /* not a power of two */
    assert_int_equal(stepq_pool_plan(&cfg, &p), STEPQ_EINVAL);
    cfg.page_align = 8; /* below the 16 B the CUDA kernels move at once */
    assert_int_equal(stepq_pool_plan(&cfg, &p), STEPQ_EINVAL);
    stepq_map_close(map);
}

/*
 * The map's decode arithmetic (arith) reaches the head layout of every block, with the map's
 * decode fit; it is no part of the page: fp16 and fp32 pages have the same blocks and the same
 * layout fingerprint. A method without column scales keeps fp32.
 */
static void the_maps_arith_reaches_every_block_and_not_the_page(void **state)
{
    static const stepq_method methods[] = { STEPQ_METHOD_DSQ, STEPQ_METHOD_SPATIAL,
                                            STEPQ_METHOD_STEPQ, STEPQ_METHOD_UNIFORM };

    for (int arch = 0; arch < 2; arch++) {
        for (size_t k = 0; k < sizeof(methods) / sizeof(methods[0]); k++) {
            stepq_model_shape s = fx_shape_small((stepq_arch)arch);
            stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
            struct stepq__pool_layout l32, l16;
            stepq_map_t *map = NULL;
            const int dual = stepq_method_has_col_scales(methods[k]);

            assert_int_equal(stepq_map_create(&s, methods[k], 6.0, &map), STEPQ_OK);
            cfg.map = map;
            cfg.num_slots = 1;
            assert_int_equal(stepq__pool_layout_build(&cfg, &l32, NULL), STEPQ_OK);
            assert_int_equal(stepq_map_set_arith(map, STEPQ_ARITH_FP16),
                             dual ? STEPQ_OK : STEPQ_EINVAL);
            assert_int_equal(stepq__pool_layout_build(&cfg, &l16, NULL), STEPQ_OK);
            assert_int_equal(l16.pub.n_blocks, l32.pub.n_blocks);
            for (int b = 0; b < l32.pub.n_blocks; b++) {
                assert_int_equal(l32.heads[b].arith, STEPQ_ARITH_FP32);
                assert_int_equal(l16.heads[b].arith, dual ? STEPQ_ARITH_FP16 : STEPQ_ARITH_FP32);
                assert_int_equal(l16.heads[b].decode_fit, STEPQ_DECODE_FIT_EXACT);
                assert_int_equal(l16.heads[b].block_bytes, l32.heads[b].block_bytes);
                assert_int_equal(l16.block_offset[b], l32.block_offset[b]);
            }
            assert_int_equal(l16.pub.page_bytes, l32.pub.page_bytes);
            assert_true(stepq__pool_layout_fingerprint(&l16.pub) ==
                        stepq__pool_layout_fingerprint(&l32.pub));
            stepq__pool_layout_free(&l16);
            stepq__pool_layout_free(&l32);
            stepq_map_close(map);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(qwen_fp32_pages_reproduce_46_02_gib_at_b64),
        cmocka_unit_test(qwen_stepq6_pages_reproduce_31_4375_mib_and_9_85_gib),
        cmocka_unit_test(blocks_follow_the_kernel_format_layer_by_layer),
        cmocka_unit_test(tensor_parallel_ranks_split_heads_and_agree_on_the_page),
        cmocka_unit_test(a_memory_budget_buys_whole_pages),
        cmocka_unit_test(kda_blocks_mix_row_widths_within_a_head),
        cmocka_unit_test(plan_and_open_agree_and_fingerprints_are_stable),
        cmocka_unit_test(sizes_that_would_wrap_are_refused),
        cmocka_unit_test(fp8_blocks_are_codes_plus_tile_scales),
        cmocka_unit_test(the_maps_arith_reaches_every_block_and_not_the_page),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
