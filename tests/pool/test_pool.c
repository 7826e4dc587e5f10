/*
 * The pool's slot lifecycle on the host backend: allocation, free, clear,
 * copy, host copies, accounting, errors that change nothing, close, and
 * concurrent use from several threads. Pools are opened on synthetic
 * layouts here (no map needed); tests/pool/test_pool_layout.c covers layouts
 * built from maps.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "pool/internal.h"
#include "stepq/pool.h"

/* 2 layers x 3 heads: blocks round up to 16 B, conv 72 B per layer. */
static const uint32_t blocks[6] = { 100, 200, 300, 1000, 17, 64 };
#define PAGE_BYTES    2048u /* 1728 state + 16-aligned conv (1808 + 72 = 1880) -> 256-aligned */
#define STATE_BYTES   1728u
#define COMPACT_BYTES 1681u
#define CONV_BYTES    144u

static stepq_pool_t *open_synthetic(int32_t slots, unsigned flags)
{
    struct stepq__pool_layout l;
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool = NULL;

    assert_int_equal(stepq__pool_layout_synthetic(2, 3, blocks, 72, 16, 256, 0, &l), STEPQ_OK);
    cfg.num_slots = slots;
    cfg.flags = flags;
    assert_int_equal(stepq__pool_open_layout(&cfg, &l, &pool), STEPQ_OK);
    assert_non_null(pool);
    return pool;
}

static uint8_t *page(stepq_pool_t *pool, int32_t slot)
{
    void *p = NULL;

    assert_int_equal(stepq_pool_page(pool, slot, &p), STEPQ_OK);
    return p;
}

static void fill(stepq_pool_t *pool, int32_t slot, uint8_t seed)
{
    uint8_t *p = page(pool, slot);

    for (uint32_t i = 0; i < PAGE_BYTES; i++)
        p[i] = (uint8_t)(seed + i * 7);
}

static int holds(stepq_pool_t *pool, int32_t slot, uint8_t seed)
{
    const uint8_t *p = page(pool, slot);

    for (uint32_t i = 0; i < PAGE_BYTES; i++)
        if (p[i] != (uint8_t)(seed + i * 7))
            return 0;
    return 1;
}

static int is_zero(stepq_pool_t *pool, int32_t slot)
{
    const uint8_t *p = page(pool, slot);

    for (uint32_t i = 0; i < PAGE_BYTES; i++)
        if (p[i])
            return 0;
    return 1;
}

static stepq_pool_stats stats(stepq_pool_t *pool)
{
    stepq_pool_stats s;

    assert_int_equal(stepq_pool_get_stats(pool, &s, sizeof(s)), STEPQ_OK);
    return s;
}

/* The observable state of a pool, to check that a failed call changed nothing. */
struct snapshot {
    stepq_pool_stats st;
    uint8_t allocated[64];
};

static struct snapshot snap(stepq_pool_t *pool)
{
    struct snapshot s;

    memset(&s, 0, sizeof(s));
    s.st = stats(pool);
    for (int32_t i = 0; i <= s.st.capacity && i < 64; i++)
        s.allocated[i] = (uint8_t)stepq_pool_is_allocated(pool, i);
    assert_int_equal(stepq__pool_check(pool), STEPQ_OK);
    return s;
}

static void assert_unchanged(stepq_pool_t *pool, const struct snapshot *before)
{
    struct snapshot now = snap(pool);

    assert_memory_equal(&now, before, sizeof(now));
}

static void close_pool(stepq_pool_t *pool)
{
    assert_int_equal(stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
}

/* --- allocation ----------------------------------------------------------- */

static void alloc_hands_out_every_slot_once_and_never_the_sentinel(void **state)
{
    stepq_pool_t *pool = open_synthetic(8, 0);
    int32_t ids[8], seen[9] = { 0 };

    assert_int_equal(stepq_pool_alloc(pool, 3, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 5, ids + 3), STEPQ_OK);
    for (int i = 0; i < 8; i++) {
        assert_in_range(ids[i], 1, 8);
        seen[ids[i]]++;
        assert_int_equal(stepq_pool_is_allocated(pool, ids[i]), 1);
    }
    for (int i = 1; i <= 8; i++)
        assert_int_equal(seen[i], 1);
    assert_int_equal(stepq_pool_is_allocated(pool, 0), 0);
    assert_int_equal(stats(pool).in_use, 8);
    assert_int_equal(stats(pool).available, 0);
    close_pool(pool);
}

static void alloc_is_all_or_nothing(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    int32_t ids[4] = { -7, -7, -7, -7 };
    struct snapshot before;

    assert_int_equal(stepq_pool_alloc(pool, 3, ids), STEPQ_OK);
    before = snap(pool);
    ids[3] = -7;
    assert_int_equal(stepq_pool_alloc(pool, 2, ids + 2), STEPQ_ENOSPC);
    assert_non_null(strstr(stepq_pool_last_error(pool), "2 slots requested, 1 of 4 free"));
    assert_int_equal(ids[3], -7);
    assert_unchanged(pool, &before);
    assert_int_equal(stepq_pool_alloc(pool, 1, ids + 3), STEPQ_OK);
    close_pool(pool);
}

static void alloc_rejects_bad_arguments(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    struct snapshot before = snap(pool);
    int32_t id;

    assert_int_equal(stepq_pool_alloc(pool, 0, NULL), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, -1, &id), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_alloc(pool, 1, NULL), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_alloc(NULL, 1, &id), STEPQ_EINVAL);
    assert_unchanged(pool, &before);
    close_pool(pool);
}

static void freed_slots_are_reused_first_freed_first(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    int32_t ids[4], a = 3, b = 1;

    assert_int_equal(stepq_pool_alloc(pool, 4, ids), STEPQ_OK);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[3], 4);
    assert_int_equal(stepq_pool_free(pool, &a, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_free(pool, &b, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 2, ids), STEPQ_OK);
    assert_int_equal(ids[0], 3);
    assert_int_equal(ids[1], 1);
    close_pool(pool);
}

/* --- free ----------------------------------------------------------------- */

static void free_rejects_a_double_free_and_changes_nothing(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    int32_t ids[3], list[2];
    struct snapshot before;

    assert_int_equal(stepq_pool_alloc(pool, 3, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_free(pool, ids, 1), STEPQ_OK);
    before = snap(pool);
    assert_int_equal(stepq_pool_free(pool, ids, 1), STEPQ_EDOUBLEFREE);
    assert_non_null(strstr(stepq_pool_last_error(pool), "not allocated"));
    assert_non_null(strstr(stepq_last_error(), "double free"));
    list[0] = ids[1];
    list[1] = ids[0]; /* valid first, freed second: the first must stay allocated */
    assert_int_equal(stepq_pool_free(pool, list, 2), STEPQ_EDOUBLEFREE);
    list[1] = ids[1]; /* the same slot twice in one list */
    assert_int_equal(stepq_pool_free(pool, list, 2), STEPQ_EDOUBLEFREE);
    assert_non_null(strstr(stepq_pool_last_error(pool), "listed more than once"));
    assert_unchanged(pool, &before);
    assert_int_equal(stepq_pool_is_allocated(pool, ids[1]), 1);
    close_pool(pool);
}

static void free_rejects_the_sentinel_and_ids_out_of_range(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    int32_t id, list[2];
    struct snapshot before;

    assert_int_equal(stepq_pool_alloc(pool, 1, &id), STEPQ_OK);
    before = snap(pool);
    list[0] = id;
    list[1] = 0;
    assert_int_equal(stepq_pool_free(pool, list, 2), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_pool_last_error(pool), "ids[1] = 0 is the sentinel"));
    list[1] = 5;
    assert_int_equal(stepq_pool_free(pool, list, 2), STEPQ_ERANGE);
    list[1] = -2;
    assert_int_equal(stepq_pool_free(pool, list, 2), STEPQ_ERANGE);
    assert_int_equal(stepq_pool_free(pool, NULL, 1), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_free(pool, list, -1), STEPQ_EINVAL);
    assert_unchanged(pool, &before);
    close_pool(pool);
}

static void padding_ids_are_skipped_by_every_operation(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    int32_t ids[2], list[3], src[3], dst[3];
    uint8_t host[3 * PAGE_BYTES];

    assert_int_equal(stepq_pool_alloc(pool, 2, ids), STEPQ_OK);
    fill(pool, ids[0], 11);
    fill(pool, ids[1], 22);
    src[0] = -1, src[1] = ids[0], src[2] = ids[0];
    dst[0] = ids[1], dst[1] = -1, dst[2] = -1;
    assert_int_equal(stepq_pool_copy(pool, src, dst, 3), STEPQ_OK);
    assert_true(holds(pool, ids[1], 22));
    list[0] = -1, list[1] = -1, list[2] = -1;
    assert_int_equal(stepq_pool_clear(pool, list, 3), STEPQ_OK);
    assert_true(holds(pool, ids[0], 11));
    list[1] = ids[0];
    memset(host, 0xa5, sizeof(host));
    assert_int_equal(stepq_pool_copy_to_host(pool, list, 3, host, sizeof(host)), STEPQ_OK);
    assert_int_equal(host[0], 0xa5);
    assert_int_equal(host[2 * PAGE_BYTES], 0xa5);
    assert_memory_equal(host + PAGE_BYTES, page(pool, ids[0]), PAGE_BYTES);
    list[1] = ids[1];
    assert_int_equal(stepq_pool_free(pool, list, 3), STEPQ_OK);
    assert_int_equal(stepq_pool_is_allocated(pool, ids[1]), 0);
    assert_int_equal(stats(pool).in_use, 1);
    close_pool(pool);
}

/* --- clear, copy, health ---------------------------------------------------- */

static void clear_zeroes_the_page_and_health_word_only_of_listed_slots(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    int32_t ids[2];
    uint32_t *words, h[2];

    assert_int_equal(stepq_pool_alloc(pool, 2, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    fill(pool, ids[0], 1);
    fill(pool, ids[1], 2);
    words[ids[0]] = STEPQ_HEALTH_STATE;
    words[ids[1]] = STEPQ_HEALTH_INPUT;
    assert_int_equal(stepq_pool_clear(pool, ids, 1), STEPQ_OK);
    assert_true(is_zero(pool, ids[0]));
    assert_true(holds(pool, ids[1], 2));
    assert_int_equal(stepq_pool_health_read(pool, ids, 2, h), STEPQ_OK);
    assert_int_equal(h[0], 0);
    assert_int_equal(h[1], STEPQ_HEALTH_INPUT);
    close_pool(pool);
}

static void clear_rejects_slots_that_are_not_allocated(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    int32_t ids[2];
    struct snapshot before;

    assert_int_equal(stepq_pool_alloc(pool, 1, ids), STEPQ_OK);
    fill(pool, ids[0], 9);
    before = snap(pool);
    ids[1] = ids[0] + 1;
    assert_int_equal(stepq_pool_clear(pool, ids, 2), STEPQ_EINVAL);
    assert_true(holds(pool, ids[0], 9)); /* validated before anything was zeroed */
    ids[1] = 0;
    assert_int_equal(stepq_pool_clear(pool, ids, 2), STEPQ_EINVAL);
    assert_unchanged(pool, &before);
    close_pool(pool);
}

static void alloc_resets_the_health_word(void **state)
{
    stepq_pool_t *pool = open_synthetic(1, 0);
    int32_t id;
    uint32_t *words, h;

    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 1, &id), STEPQ_OK);
    fill(pool, id, 5);
    words[id] = STEPQ_HEALTH_SATURATED;
    assert_int_equal(stats(pool).health_slots, 1);
    assert_int_equal(stats(pool).health_any, STEPQ_HEALTH_SATURATED);
    assert_int_equal(stepq_pool_free(pool, &id, 1), STEPQ_OK);
    assert_int_equal(stats(pool).health_slots, 0); /* free slots are not counted */
    assert_int_equal(stepq_pool_alloc(pool, 1, &id), STEPQ_OK);
    assert_int_equal(stepq_pool_health_read(pool, &id, 1, &h), STEPQ_OK);
    assert_int_equal(h, 0);
    assert_true(holds(pool, id, 5)); /* without CLEAR_ON_ALLOC the bytes stay */
    close_pool(pool);
}

static void clear_on_alloc_zeroes_reused_pages(void **state)
{
    stepq_pool_t *pool = open_synthetic(1, STEPQ_POOL_FLAG_CLEAR_ON_ALLOC);
    int32_t id;

    assert_int_equal(stepq_pool_alloc(pool, 1, &id), STEPQ_OK);
    fill(pool, id, 5);
    assert_int_equal(stepq_pool_free(pool, &id, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 1, &id), STEPQ_OK);
    assert_true(is_zero(pool, id));
    close_pool(pool);
}

static void copy_duplicates_whole_pages_and_health_words(void **state)
{
    stepq_pool_t *pool = open_synthetic(6, 0);
    int32_t ids[5], src[3], dst[3];
    uint32_t *words;

    assert_int_equal(stepq_pool_alloc(pool, 5, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    fill(pool, ids[0], 10);
    fill(pool, ids[1], 20);
    words[ids[0]] = STEPQ_HEALTH_OUTPUT;
    /* ids[0] fans out to two destinations, ids[1] to one. */
    src[0] = ids[0], src[1] = ids[1], src[2] = ids[0];
    dst[0] = ids[2], dst[1] = ids[3], dst[2] = ids[4];
    assert_int_equal(stepq_pool_copy(pool, src, dst, 3), STEPQ_OK);
    assert_true(holds(pool, ids[2], 10));
    assert_true(holds(pool, ids[3], 20));
    assert_true(holds(pool, ids[4], 10));
    assert_true(holds(pool, ids[0], 10));
    assert_int_equal(words[ids[2]], STEPQ_HEALTH_OUTPUT);
    assert_int_equal(words[ids[3]], 0);
    close_pool(pool);
}

static void copy_rejects_overlap_repeated_destinations_and_free_slots(void **state)
{
    stepq_pool_t *pool = open_synthetic(6, 0);
    int32_t ids[4], src[2], dst[2], free_slot;
    struct snapshot before;

    assert_int_equal(stepq_pool_alloc(pool, 4, ids), STEPQ_OK);
    for (int i = 0; i < 4; i++)
        fill(pool, ids[i], (uint8_t)(40 + i));
    before = snap(pool);
    /* b is a destination of pair 0 and a source of pair 1. */
    src[0] = ids[0], dst[0] = ids[1];
    src[1] = ids[1], dst[1] = ids[2];
    assert_int_equal(stepq_pool_copy(pool, src, dst, 2), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_pool_last_error(pool), "overlap"));
    src[1] = ids[3], dst[1] = ids[1];
    assert_int_equal(stepq_pool_copy(pool, src, dst, 2), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_pool_last_error(pool), "destination more than once"));
    assert_int_equal(stepq_pool_copy(pool, ids, ids, 1), STEPQ_EINVAL);
    free_slot = 5;
    assert_int_equal(stepq_pool_is_allocated(pool, free_slot), 0);
    assert_int_equal(stepq_pool_copy(pool, ids, &free_slot, 1), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_copy(pool, &free_slot, ids, 1), STEPQ_EINVAL);
    src[0] = 0;
    assert_int_equal(stepq_pool_copy(pool, src, ids + 3, 1), STEPQ_EINVAL);
    src[0] = 7;
    assert_int_equal(stepq_pool_copy(pool, src, ids + 3, 1), STEPQ_ERANGE);
    assert_int_equal(stepq_pool_copy(pool, NULL, ids, 1), STEPQ_EINVAL);
    for (int i = 0; i < 4; i++)
        assert_true(holds(pool, ids[i], (uint8_t)(40 + i)));
    assert_unchanged(pool, &before);
    close_pool(pool);
}

/* --- masked copies (lists as a captured decode step passes them) ---------- */

/* Every page (sentinel included) and health word of a pool, for comparisons. */
struct image {
    uint8_t pages[8 * PAGE_BYTES];
    uint32_t health[8];
};

static void take_image(stepq_pool_t *pool, struct image *im)
{
    uint32_t *words;

    assert_true(stats(pool).capacity + 1 <= 8);
    memset(im, 0, sizeof(*im));
    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    for (int32_t i = 0; i <= stats(pool).capacity; i++) {
        memcpy(im->pages + (size_t)i * PAGE_BYTES, page(pool, i), PAGE_BYTES);
        im->health[i] = words[i];
    }
}

/* Slots 1..6 allocated, page i filled with seed 10 * i, health word i. */
static stepq_pool_t *open_filled(void)
{
    stepq_pool_t *pool = open_synthetic(6, 0);
    int32_t ids[6];
    uint32_t *words;

    assert_int_equal(stepq_pool_alloc(pool, 6, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    for (int32_t i = 1; i <= 6; i++) {
        assert_int_equal(ids[i - 1], i);
        fill(pool, i, (uint8_t)(10 * i));
        words[i] = (uint32_t)i;
    }
    return pool;
}

static void copy_masked_copies_only_the_entries_the_mask_selects(void **state)
{
    const int32_t src[3] = { 1, 2, 1 }, dst[3] = { 4, 5, 6 };
    const int32_t none[3] = { 0, 0, 0 }, some[3] = { 0, 7, -1 };
    stepq_pool_t *pool = open_filled();
    uint32_t *words;
    struct image before, after;

    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    /* None: nothing moves. */
    take_image(pool, &before);
    assert_int_equal(stepq_pool_copy_masked(pool, src, dst, none, 3, NULL), STEPQ_OK);
    take_image(pool, &after);
    assert_memory_equal(&before, &after, sizeof(before));
    /* Some: any nonzero value selects (entries 1 and 2 here). */
    assert_int_equal(stepq_pool_copy_masked(pool, src, dst, some, 3, NULL), STEPQ_OK);
    assert_true(holds(pool, 4, 40));
    assert_true(holds(pool, 5, 20));
    assert_true(holds(pool, 6, 10));
    assert_int_equal(words[4], 4);
    assert_int_equal(words[5], 2);
    assert_int_equal(words[6], 1);
    assert_true(holds(pool, 1, 10));
    assert_true(holds(pool, 2, 20));
    /* NULL mask: all of them. */
    fill(pool, 5, 50);
    fill(pool, 6, 60);
    assert_int_equal(stepq_pool_copy_masked(pool, src, dst, NULL, 3, NULL), STEPQ_OK);
    assert_true(holds(pool, 4, 10));
    assert_true(holds(pool, 5, 20));
    assert_true(holds(pool, 6, 10));
    assert_int_equal(words[4], 1);
    assert_int_equal(words[5], 2);
    assert_int_equal(words[6], 1);
    assert_true(is_zero(pool, 0));
    assert_int_equal(stepq__pool_check(pool), STEPQ_OK);
    close_pool(pool);
}

static void copy_masked_skips_entries_with_bad_ids(void **state)
{
    /* The sentinel, padding, out of range on either side, src == dst; the
     * masked-off entry's ids are garbage and must not be looked at. */
    const int32_t src[9] = { 0, 1, -1, 2, 7, 3, INT32_MIN, 1, 12345 };
    const int32_t dst[9] = { 4, 0, 5, -1, 6, 3, 4, 7, 4 };
    const int32_t mask[9] = { 1, 1, 1, 1, 1, 1, 1, 1, 0 };
    stepq_pool_t *pool = open_filled();
    struct image before, after;

    take_image(pool, &before);
    assert_int_equal(stepq_pool_copy_masked(pool, src, dst, mask, 9, NULL), STEPQ_OK);
    assert_int_equal(stepq_pool_copy_masked(pool, src, dst, NULL, 8, NULL), STEPQ_OK);
    take_image(pool, &after);
    assert_memory_equal(&before, &after, sizeof(before));
    /* n = 0 is a no-op, with or without lists. */
    assert_int_equal(stepq_pool_copy_masked(pool, NULL, NULL, NULL, 0, NULL), STEPQ_OK);
    assert_int_equal(stepq_pool_copy_masked(pool, src, dst, mask, 0, NULL), STEPQ_OK);
    take_image(pool, &after);
    assert_memory_equal(&before, &after, sizeof(before));
    close_pool(pool);
}

static void copy_masked_moves_what_copy_moves(void **state)
{
    const int32_t src[4] = { 1, -1, 2, 1 }, dst[4] = { 3, 4, 5, 6 };
    stepq_pool_t *a = open_filled(), *b = open_filled();
    struct image ia, ib;

    assert_int_equal(stepq_pool_copy(a, src, dst, 4), STEPQ_OK);
    assert_int_equal(stepq_pool_copy_masked(b, src, dst, NULL, 4, NULL), STEPQ_OK);
    take_image(a, &ia);
    take_image(b, &ib);
    assert_memory_equal(&ia, &ib, sizeof(ia));
    close_pool(a);
    close_pool(b);
}

static void copy_masked_does_not_consult_the_allocator(void **state)
{
    stepq_pool_t *pool = open_filled();
    const int32_t src = 1, dst = 6;
    int32_t id;
    uint32_t *words;

    /* A free destination is written (the caller's bug), the allocator is
     * untouched and the next alloc resets the health word. */
    assert_int_equal(stepq_pool_free(pool, &dst, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_copy_masked(pool, &src, &dst, NULL, 1, NULL), STEPQ_OK);
    assert_true(holds(pool, 6, 10));
    assert_int_equal(stepq_pool_is_allocated(pool, 6), 0);
    assert_int_equal(stepq__pool_check(pool), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 1, &id), STEPQ_OK);
    assert_int_equal(id, 6);
    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    assert_int_equal(words[6], 0);
    close_pool(pool);
}

static void copy_masked_rejects_bad_arguments_and_changes_nothing(void **state)
{
    const int32_t src[2] = { 1, 2 }, dst[2] = { 3, 4 };
    stepq_pool_t *pool = open_filled();
    struct snapshot before = snap(pool);
    struct image ib, ia;
    int stream_stand_in;

    take_image(pool, &ib);
    assert_int_equal(stepq_pool_copy_masked(NULL, src, dst, NULL, 2, NULL), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "stepq_pool_copy_masked: pool is NULL"));
    assert_int_equal(stepq_pool_copy_masked(pool, src, dst, NULL, -1, NULL), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_pool_last_error(pool), "n = -1"));
    assert_int_equal(stepq_pool_copy_masked(pool, NULL, dst, NULL, 2, NULL), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_pool_last_error(pool), "src NULL"));
    assert_int_equal(stepq_pool_copy_masked(pool, src, NULL, NULL, 2, NULL), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_pool_last_error(pool), "dst NULL"));
    assert_int_equal(
        stepq_pool_copy_masked(pool, src, dst, NULL, STEPQ_POOL_COPY_MASKED_MAX + 1, NULL),
        STEPQ_EINVAL);
    assert_non_null(strstr(stepq_pool_last_error(pool), "STEPQ_POOL_COPY_MASKED_MAX"));
    assert_non_null(strstr(stepq_last_error(), "stepq_pool_copy_masked"));
    take_image(pool, &ia);
    assert_memory_equal(&ib, &ia, sizeof(ib));
    assert_unchanged(pool, &before);
    /* the host backend ignores a stream, as its decode step and prefill calls do */
    assert_int_equal(stepq_pool_copy_masked(pool, src, dst, NULL, 2, &stream_stand_in), STEPQ_OK);
    close_pool(pool);
    assert_int_equal(stepq_pool_copy_masked(pool, src, dst, NULL, 2, NULL), STEPQ_EBADF);
}

/* --- host copies, buffers ------------------------------------------------- */

static void pages_survive_an_offload_round_trip(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    int32_t ids[2], back[2], dup[2];
    uint8_t *host = malloc(2 * PAGE_BYTES);
    uint32_t *words;

    assert_non_null(host);
    assert_int_equal(stepq_pool_alloc(pool, 2, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    fill(pool, ids[0], 77);
    fill(pool, ids[1], 88);
    assert_int_equal(stepq_pool_copy_to_host(pool, ids, 2, host, 2 * PAGE_BYTES), STEPQ_OK);
    assert_int_equal(stepq_pool_sync(pool), STEPQ_OK);
    assert_int_equal(stepq_pool_free(pool, ids, 2), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 2, back), STEPQ_OK);
    words[back[0]] = STEPQ_HEALTH_STATE;
    assert_int_equal(stepq_pool_clear(pool, back + 1, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_copy_from_host(pool, back, 2, host, 2 * PAGE_BYTES), STEPQ_OK);
    assert_true(holds(pool, back[0], 77));
    assert_true(holds(pool, back[1], 88));
    assert_int_equal(words[back[0]], 0);
    /* errors: a short buffer, a slot listed twice for reload, a free slot */
    assert_int_equal(stepq_pool_copy_to_host(pool, back, 2, host, 2 * PAGE_BYTES - 1),
                     STEPQ_EINVAL);
    dup[0] = dup[1] = back[0];
    assert_int_equal(stepq_pool_copy_from_host(pool, dup, 2, host, 2 * PAGE_BYTES), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_copy_to_host(pool, dup, 2, host, 2 * PAGE_BYTES), STEPQ_OK);
    dup[1] = ids[0]; /* freed above and not reallocated: FIFO reuse took 3 and 4 */
    assert_int_equal(stepq_pool_is_allocated(pool, ids[0]), 0);
    assert_int_equal(stepq_pool_copy_to_host(pool, dup, 2, host, 2 * PAGE_BYTES), STEPQ_EINVAL);
    free(host);
    close_pool(pool);
}

static void buffer_infos_describe_the_contiguous_pages(void **state)
{
    stepq_pool_t *pool = open_synthetic(8, 0);
    stepq_pool_buffer_info info[2];
    uint32_t *words;
    int count = -1;

    assert_int_equal(stepq_pool_buffer_infos(pool, info, 1, &count), STEPQ_ERANGE);
    assert_int_equal(count, 2);
    assert_int_equal(stepq_pool_buffer_infos(pool, info, 2, &count), STEPQ_OK);
    assert_string_equal(info[0].name, "pages");
    assert_ptr_equal(info[0].ptr, page(pool, 0));
    assert_int_equal(info[0].item_bytes, PAGE_BYTES);
    assert_int_equal(info[0].bytes, 9 * PAGE_BYTES);
    assert_ptr_equal((uint8_t *)info[0].ptr + 5 * info[0].item_bytes, page(pool, 5));
    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    assert_string_equal(info[1].name, "health");
    assert_ptr_equal(info[1].ptr, words);
    assert_int_equal(info[1].bytes, 9 * sizeof(uint32_t));
    close_pool(pool);
}

static void stats_account_every_byte_and_the_high_water_mark(void **state)
{
    stepq_pool_t *pool = open_synthetic(8, 0);
    const stepq_pool_layout *l;
    stepq_pool_stats s;
    int32_t ids[5];

    assert_int_equal(stepq_pool_alloc(pool, 5, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_free(pool, ids, 3), STEPQ_OK);
    s = stats(pool);
    assert_int_equal(s.capacity, 8);
    assert_int_equal(s.in_use, 2);
    assert_int_equal(s.available, 6);
    assert_int_equal(s.high_water, 5);
    assert_int_equal(s.n_alloc, 5);
    assert_int_equal(s.n_free, 3);
    assert_int_equal(s.page_bytes, PAGE_BYTES);
    assert_int_equal(s.state_bytes, STATE_BYTES);
    assert_int_equal(s.state_bytes_compact, COMPACT_BYTES);
    assert_int_equal(s.conv_bytes, CONV_BYTES);
    assert_int_equal(s.pad_bytes, PAGE_BYTES - STATE_BYTES - CONV_BYTES);
    assert_int_equal(s.pool_bytes, 9 * PAGE_BYTES);
    assert_int_equal(s.in_use_bytes, 2 * PAGE_BYTES);
    assert_int_equal(stepq_pool_get_layout(pool, &l), STEPQ_OK);
    assert_int_equal(l->n_blocks, 6);
    assert_int_equal(l->block_offset[3], 112 + 208 + 304);
    assert_int_equal(l->block_bytes[4], 32);
    assert_int_equal(l->conv_offset[0], STATE_BYTES);
    assert_int_equal(l->conv_offset[1], 1808);
    /* A caller compiled against a shorter struct gets only its fields. */
    memset(&s, 0xee, sizeof(s));
    assert_int_equal(stepq_pool_get_stats(pool, &s, offsetof(stepq_pool_stats, n_alloc)), STEPQ_OK);
    assert_int_equal(s.high_water, 5);
    assert_int_equal(s.n_alloc, 0xeeeeeeeeeeeeeeeeull);
    assert_int_equal(stepq_pool_get_stats(pool, &s, sizeof(s) + 8), STEPQ_EINVAL);
    close_pool(pool);
}

static void page_addresses_cover_the_sentinel_but_not_past_the_end(void **state)
{
    stepq_pool_t *pool = open_synthetic(3, 0);
    void *p;

    assert_int_equal(stepq_pool_page(pool, 0, &p), STEPQ_OK);
    assert_ptr_equal((uint8_t *)page(pool, 3) - 3 * PAGE_BYTES, p);
    assert_int_equal(stepq_pool_page(pool, 4, &p), STEPQ_ERANGE);
    assert_int_equal(stepq_pool_page(pool, -1, &p), STEPQ_ERANGE);
    assert_int_equal(stepq_pool_is_allocated(pool, 4), STEPQ_ERANGE);
    close_pool(pool);
}

/* --- close, configuration ----------------------------------------------- */

static void close_with_slots_in_use_is_busy_unless_forced(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0), *other;
    int32_t id, two[2];

    assert_int_equal(stepq_pool_alloc(pool, 1, &id), STEPQ_OK);
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_EBUSY);
    assert_non_null(strstr(stepq_pool_last_error(pool), "1 slots are still allocated"));
    assert_int_equal(stepq_pool_is_allocated(pool, id), 1); /* still open and usable */
    assert_int_equal(stepq_pool_free(pool, &id, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);

    other = open_synthetic(4, 0);
    assert_int_equal(stepq_pool_alloc(other, 2, two), STEPQ_OK);
    assert_int_equal(stepq_pool_close(other, 0x80), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_close(other, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
    assert_int_equal(stepq_pool_close(NULL, 0), STEPQ_OK);
}

static void calls_on_a_closed_pool_return_ebadf(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    stepq_pool_stats s;
    int32_t id;

    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);
    /* The handle is only compared against the table of open pools, never
     * dereferenced, so this is well defined (and clean under ASan). */
    assert_int_equal(stepq_pool_alloc(pool, 1, &id), STEPQ_EBADF);
    assert_non_null(strstr(stepq_last_error(), "closed"));
    assert_int_equal(stepq_pool_free(pool, &id, 1), STEPQ_EBADF);
    assert_int_equal(stepq_pool_get_stats(pool, &s, sizeof(s)), STEPQ_EBADF);
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_EBADF);
    assert_string_equal(stepq_pool_last_error(pool), "pool handle is closed or not valid");
}

static void open_checks_the_config_header_and_map(void **state)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_plan_info plan;
    stepq_pool_t *pool = (stepq_pool_t *)&cfg;

    cfg.num_slots = 4;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_EINVAL); /* no map */
    assert_null(pool);
    assert_non_null(strstr(stepq_last_error(), "map"));
    cfg.magic = 0;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_EVERSION);
    cfg.magic = STEPQ_CONFIG_MAGIC;
    cfg.version = 99;
    assert_int_equal(stepq_pool_open(&cfg, &pool), STEPQ_EVERSION);
    cfg.version = STEPQ_POOL_CONFIG_VERSION;
    cfg.size = 8;
    assert_int_equal(stepq_pool_plan(&cfg, &plan), STEPQ_EVERSION);
    assert_int_equal(stepq_pool_open(NULL, &pool), STEPQ_EINVAL);
    assert_int_equal(stepq_pool_open(&cfg, NULL), STEPQ_EINVAL);
}

/*
 * Handle reuse (ABA): a pool opened after another was closed takes over its
 * table entry (and, with most allocators, its memory), but not its handle.
 * Before handles carried a generation, stepq_pool_free(a, ids of b) returned
 * OK here and b then handed out slots b's owner still held.
 */
/* Failing calls write the pool's error text while other threads read it. */
struct err_reader {
    stepq_pool_t *pool;
    atomic_int stop;
    int bad;
};

static void *err_reader_main(void *arg)
{
    struct err_reader *r = arg;
    while (!atomic_load(&r->stop)) {
        const char *t = stepq_pool_last_error(r->pool);
        /* Either nothing failed yet or the whole text of one failure. */
        if (t[0] && !strstr(t, "is not allocated"))
            r->bad = 1;
    }
    return NULL;
}

static void error_text_is_read_safely_while_calls_fail(void **state)
{
    stepq_pool_t *pool = open_synthetic(8, 0);
    struct err_reader r = { .pool = pool };
    pthread_t th;
    int32_t id = 3;

    assert_int_equal(pthread_create(&th, NULL, err_reader_main, &r), 0);
    for (int i = 0; i < 20000; i++)
        assert_int_equal(stepq_pool_free(pool, &id, 1), STEPQ_EDOUBLEFREE);
    atomic_store(&r.stop, 1);
    pthread_join(th, NULL);
    assert_false(r.bad);
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);
}

/* Single-slot allocations reuse the oldest freed slot first (FIFO, as SGLang's allocator). */
static void single_slots_come_back_first_freed_first_reused(void **state)
{
    stepq_pool_t *pool = open_synthetic(3, 0);
    int32_t a, b, c, got;

    assert_int_equal(stepq_pool_alloc(pool, 1, &a), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 1, &b), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 1, &c), STEPQ_OK);
    assert_int_equal(stepq_pool_free(pool, &b, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_free(pool, &c, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_free(pool, &a, 1), STEPQ_OK);
    assert_int_equal(stepq_pool_alloc(pool, 1, &got), STEPQ_OK);
    assert_int_equal(got, b);
    assert_int_equal(stepq_pool_alloc(pool, 1, &got), STEPQ_OK);
    assert_int_equal(got, c);
    assert_int_equal(stepq_pool_alloc(pool, 1, &got), STEPQ_OK);
    assert_int_equal(got, a);
    assert_int_equal(stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
}

/* A copy carries the source's health word to the destination; the source keeps its own. */
static void health_words_travel_with_copies(void **state)
{
    stepq_pool_t *pool = open_synthetic(4, 0);
    int32_t ids[4];
    uint32_t *words, got[2];

    assert_int_equal(stepq_pool_alloc(pool, 4, ids), STEPQ_OK);
    assert_int_equal(stepq_pool_health_words(pool, &words), STEPQ_OK);
    words[ids[0]] = STEPQ_HEALTH_STATE;
    words[ids[1]] = STEPQ_HEALTH_INPUT | STEPQ_HEALTH_OUTPUT;
    assert_int_equal(stepq_pool_copy(pool, &ids[0], &ids[2], 1), STEPQ_OK);
    assert_int_equal(stepq_pool_copy(pool, &ids[1], &ids[3], 1), STEPQ_OK);
    int32_t dst[2] = { ids[2], ids[3] };
    assert_int_equal(stepq_pool_health_read(pool, dst, 2, got), STEPQ_OK);
    assert_int_equal(got[0], STEPQ_HEALTH_STATE);
    assert_int_equal(got[1], STEPQ_HEALTH_INPUT | STEPQ_HEALTH_OUTPUT);
    assert_int_equal(words[ids[0]], STEPQ_HEALTH_STATE);
    assert_int_equal(stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
}

static void a_closed_handle_never_names_a_later_pool(void **state)
{
    stepq_pool_t *a = open_synthetic(8, 0), *b;
    int32_t ids[2], more[8], n;
    stepq_pool_stats s;

    assert_int_equal(stepq_pool_close(a, 0), STEPQ_OK);
    for (int round = 0; round < 100; round++) {
        b = open_synthetic(8, 0);
        assert_true(b != a);
        assert_int_equal(stepq_pool_alloc(b, 2, ids), STEPQ_OK);
        assert_int_equal(stepq_pool_free(a, ids, 2), STEPQ_EBADF);
        assert_non_null(strstr(stepq_last_error(), "closed or not valid"));
        assert_int_equal(stepq_pool_alloc(a, 1, more), STEPQ_EBADF);
        assert_string_equal(stepq_pool_last_error(a), "pool handle is closed or not valid");
        /* b still owns exactly its two slots: the next 6 are all different. */
        assert_int_equal(stepq_pool_get_stats(b, &s, sizeof(s)), STEPQ_OK);
        assert_int_equal(s.in_use, 2);
        assert_int_equal(stepq_pool_alloc(b, 6, more), STEPQ_OK);
        for (n = 0; n < 6; n++)
            assert_true(more[n] != ids[0] && more[n] != ids[1]);
        assert_int_equal(stepq_pool_close(b, STEPQ_POOL_CLOSE_FORCE), STEPQ_OK);
        assert_int_equal(stepq_pool_close(b, 0), STEPQ_EBADF);
    }
    /* Values no open returned: EBADF, never a crash. */
    int local;
    assert_int_equal(stepq_pool_alloc((stepq_pool_t *)&local, 1, more), STEPQ_EBADF);
    assert_int_equal(stepq_pool_alloc((stepq_pool_t *)(uintptr_t)0x7fffffffu, 1, more),
                     STEPQ_EBADF);
}

static void open_layout_rejects_bad_backend_flags_and_sizing(void **state)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    struct stepq__pool_layout l;
    stepq_pool_t *pool;

    cfg.num_slots = 4;
    cfg.backend = (stepq_pool_backend)7;
    assert_int_equal(stepq__pool_layout_synthetic(1, 1, blocks, 0, 16, 256, 0, &l), STEPQ_OK);
    assert_int_equal(stepq__pool_open_layout(&cfg, &l, &pool), STEPQ_EINVAL);
    cfg.backend = STEPQ_POOL_BACKEND_HOST;
    cfg.flags = 0x100;
    assert_int_equal(stepq__pool_layout_synthetic(1, 1, blocks, 0, 16, 256, 0, &l), STEPQ_OK);
    assert_int_equal(stepq__pool_open_layout(&cfg, &l, &pool), STEPQ_EINVAL);
    cfg.flags = 0;
    cfg.max_running_requests = 2; /* two sizing fields */
    assert_int_equal(stepq__pool_layout_synthetic(1, 1, blocks, 0, 16, 256, 0, &l), STEPQ_OK);
    assert_int_equal(stepq__pool_open_layout(&cfg, &l, &pool), STEPQ_EINVAL);
    assert_null(pool);
}

static void pools_are_sized_by_slots_requests_or_budget(void **state)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    static const int per[] = { 1, 3, 4, 5 };
    int32_t slots;

    cfg.num_slots = 7;
    assert_int_equal(stepq__pool_sizing(&cfg, 1000, &slots, NULL), STEPQ_OK);
    assert_int_equal(slots, 7);
    cfg.num_slots = 0;
    cfg.max_running_requests = 10;
    for (int p = 0; p < STEPQ_POOL_POLICY_COUNT; p++) {
        cfg.policy = (stepq_pool_policy)p;
        assert_int_equal(stepq__pool_sizing(&cfg, 1000, &slots, NULL), STEPQ_OK);
        assert_int_equal(slots, 10 * per[p]);
    }
    cfg.max_running_requests = 0;
    cfg.memory_budget_bytes = 10999; /* 10 pages of 1000 B: the sentinel + 9 */
    assert_int_equal(stepq__pool_sizing(&cfg, 1000, &slots, NULL), STEPQ_OK);
    assert_int_equal(slots, 9);
    cfg.memory_budget_bytes = 1999;
    assert_int_equal(stepq__pool_sizing(&cfg, 1000, &slots, NULL), STEPQ_ENOSPC);
    cfg.memory_budget_bytes = 0;
    assert_int_equal(stepq__pool_sizing(&cfg, 1000, &slots, NULL), STEPQ_EINVAL);
    cfg.num_slots = -3;
    assert_int_equal(stepq__pool_sizing(&cfg, 1000, &slots, NULL), STEPQ_EINVAL);
    cfg.num_slots = 0;
    cfg.max_running_requests = INT32_MAX / 2;
    cfg.policy = STEPQ_POOL_POLICY_EXTRA_BUFFER;
    assert_int_equal(stepq__pool_sizing(&cfg, 1000, &slots, NULL), STEPQ_ERANGE);
    cfg.max_running_requests = 1;
    cfg.policy = (stepq_pool_policy)9;
    assert_int_equal(stepq__pool_sizing(&cfg, 1000, &slots, NULL), STEPQ_EINVAL);
}

static void policies_have_names_and_slot_counts(void **state)
{
    stepq_pool_policy p;

    assert_int_equal(stepq_pool_policy_slots(STEPQ_POOL_POLICY_NO_CACHE), 1);
    assert_int_equal(stepq_pool_policy_slots(STEPQ_POOL_POLICY_NO_BUFFER), 3);
    assert_int_equal(stepq_pool_policy_slots(STEPQ_POOL_POLICY_LAZY), 4);
    assert_int_equal(stepq_pool_policy_slots(STEPQ_POOL_POLICY_EXTRA_BUFFER), 5);
    assert_int_equal(stepq_pool_policy_slots((stepq_pool_policy)4), STEPQ_EINVAL);
    for (int i = 0; i < STEPQ_POOL_POLICY_COUNT; i++) {
        assert_int_equal(stepq_pool_policy_from_name(stepq_pool_policy_name(i), &p), STEPQ_OK);
        assert_int_equal(p, i);
    }
    assert_int_equal(stepq_pool_policy_from_name("radix", &p), STEPQ_EINVAL);
    assert_string_equal(stepq_pool_policy_name((stepq_pool_policy)-1), "?");
}

static void the_cuda_backend_fails_cleanly_without_a_device(void **state)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    struct stepq__pool_layout l;
    stepq_pool_t *pool = NULL;
    int ret;

    cfg.num_slots = 4;
    cfg.backend = STEPQ_POOL_BACKEND_CUDA;
    assert_int_equal(stepq__pool_layout_synthetic(1, 1, blocks, 0, 16, 256, 0, &l), STEPQ_OK);
    ret = stepq__pool_open_layout(&cfg, &l, &pool);
    if (ret == STEPQ_OK) { /* a GPU machine: tests/pool/test_pool_cuda.c covers it */
        close_pool(pool);
        skip();
    }
    assert_true(ret == STEPQ_ENODEV || ret == STEPQ_ENOTSUP);
    assert_null(pool);
    assert_true(strlen(stepq_last_error()) > 0);
}

/* --- threads ---------------------------------------------------------------- */

#define THREADS    8
#define ITERATIONS 20000
#define T_SLOTS    64

struct hammer {
    stepq_pool_t *pool;
    _Atomic int *owner; /* T_SLOTS + 1 flags: 1 while some thread holds the slot */
    unsigned seed;
    int errors;
    uint64_t allocated;
};

static void *hammer_main(void *arg)
{
    struct hammer *h = arg;
    int32_t ids[4];

    for (int it = 0; it < ITERATIONS; it++) {
        int32_t n = 1 + (int32_t)(rand_r(&h->seed) % 4);
        int ret = stepq_pool_alloc(h->pool, n, ids);

        if (ret == STEPQ_ENOSPC)
            continue;
        if (ret != STEPQ_OK) {
            h->errors++;
            continue;
        }
        h->allocated += (uint64_t)n;
        for (int32_t i = 0; i < n; i++)
            if (ids[i] < 1 || ids[i] > T_SLOTS || atomic_exchange(&h->owner[ids[i]], 1) != 0)
                h->errors++; /* issued to two threads at once, or out of range */
        for (int32_t i = 0; i < n; i++)
            atomic_store(&h->owner[ids[i]], 0);
        if (stepq_pool_free(h->pool, ids, n) != STEPQ_OK)
            h->errors++;
    }
    return NULL;
}

static void concurrent_alloc_and_free_never_share_a_slot(void **state)
{
    stepq_pool_t *pool = open_synthetic(T_SLOTS, 0);
    static _Atomic int owner[T_SLOTS + 1];
    struct hammer h[THREADS];
    pthread_t th[THREADS];
    uint64_t total = 0;
    stepq_pool_stats s;

    for (int i = 0; i < THREADS; i++) {
        h[i] = (struct hammer){ pool, owner, 1234u + (unsigned)i, 0, 0 };
        assert_int_equal(pthread_create(&th[i], NULL, hammer_main, &h[i]), 0);
    }
    for (int i = 0; i < THREADS; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(h[i].errors, 0);
        total += h[i].allocated;
    }
    s = stats(pool);
    assert_int_equal(s.in_use, 0);
    assert_int_equal(s.n_alloc, total);
    assert_int_equal(s.n_free, total);
    assert_true(total > (uint64_t)THREADS * ITERATIONS); /* most calls succeeded */
    assert_int_equal(stepq__pool_check(pool), STEPQ_OK);
    assert_int_equal(stepq_pool_close(pool, 0), STEPQ_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(alloc_hands_out_every_slot_once_and_never_the_sentinel),
        cmocka_unit_test(alloc_is_all_or_nothing),
        cmocka_unit_test(alloc_rejects_bad_arguments),
        cmocka_unit_test(freed_slots_are_reused_first_freed_first),
        cmocka_unit_test(free_rejects_a_double_free_and_changes_nothing),
        cmocka_unit_test(free_rejects_the_sentinel_and_ids_out_of_range),
        cmocka_unit_test(padding_ids_are_skipped_by_every_operation),
        cmocka_unit_test(clear_zeroes_the_page_and_health_word_only_of_listed_slots),
        cmocka_unit_test(clear_rejects_slots_that_are_not_allocated),
        cmocka_unit_test(alloc_resets_the_health_word),
        cmocka_unit_test(clear_on_alloc_zeroes_reused_pages),
        cmocka_unit_test(copy_duplicates_whole_pages_and_health_words),
        cmocka_unit_test(copy_rejects_overlap_repeated_destinations_and_free_slots),
        cmocka_unit_test(copy_masked_copies_only_the_entries_the_mask_selects),
        cmocka_unit_test(copy_masked_skips_entries_with_bad_ids),
        cmocka_unit_test(copy_masked_moves_what_copy_moves),
        cmocka_unit_test(copy_masked_does_not_consult_the_allocator),
        cmocka_unit_test(copy_masked_rejects_bad_arguments_and_changes_nothing),
        cmocka_unit_test(pages_survive_an_offload_round_trip),
        cmocka_unit_test(buffer_infos_describe_the_contiguous_pages),
        cmocka_unit_test(stats_account_every_byte_and_the_high_water_mark),
        cmocka_unit_test(page_addresses_cover_the_sentinel_but_not_past_the_end),
        cmocka_unit_test(close_with_slots_in_use_is_busy_unless_forced),
        cmocka_unit_test(calls_on_a_closed_pool_return_ebadf),
        cmocka_unit_test(open_checks_the_config_header_and_map),
        cmocka_unit_test(open_layout_rejects_bad_backend_flags_and_sizing),
        cmocka_unit_test(pools_are_sized_by_slots_requests_or_budget),
        cmocka_unit_test(policies_have_names_and_slot_counts),
        cmocka_unit_test(the_cuda_backend_fails_cleanly_without_a_device),
        cmocka_unit_test(concurrent_alloc_and_free_never_share_a_slot),
        cmocka_unit_test(a_closed_handle_never_names_a_later_pool),
        cmocka_unit_test(single_slots_come_back_first_freed_first_reused),
        cmocka_unit_test(health_words_travel_with_copies),
        cmocka_unit_test(error_text_is_read_safely_while_calls_fail),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
