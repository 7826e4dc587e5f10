/*
 * What TP ranks exchange, on the CPU: the fingerprints (stable for the same
 * content, different for one changed head) and the packed-page message
 * header (round trip, every refusal, and random bytes that always give a
 * status). argv[1]: the repository root.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "plugin/hash.h"
#include "stepq/pool.h"
#include "stepq/tp.h"

#include "tests/tp/tp_test.h"

static stepq_tp_fingerprint_info fp_of(const stepq_map_t *map, int tp, int rank)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_tp_fingerprint_info f;

    cfg.map = map;
    cfg.tp_size = tp;
    cfg.tp_rank = rank;
    cfg.num_slots = 4;
    assert_int_equal(stepq_tp_fingerprint(&cfg, &f, sizeof(f)), STEPQ_OK);
    return f;
}

#define GDN6 "config/calibrated/tiny-gdn/stepq@6.json"
#define KDA6 "config/calibrated/tiny-kda/stepq@6.json"

static void the_same_map_loaded_twice_has_the_same_fingerprints(void **state)
{
    const char *maps[] = { GDN6, KDA6, "config/examples/qwen3.8-27b.stepq-6-layout.json" };

    for (size_t i = 0; i < sizeof(maps) / sizeof(maps[0]); i++) {
        stepq_map_t *a = load(maps[i]), *b = load(maps[i]);
        uint64_t mf;

        for (int r = 0; r < 2; r++) {
            stepq_tp_fingerprint_info fa = fp_of(a, 2, r), fb = fp_of(b, 2, r);
            assert_true(fa.map == fb.map);
            assert_true(fa.group == fb.group);
            assert_true(fa.page == fb.page);
        }
        /* The map component is the map's own fingerprint. */
        assert_int_equal(stepq_map_fingerprint(a, &mf), STEPQ_OK);
        assert_true(fp_of(a, 2, 0).map == mf);
        stepq_map_close(a);
        stepq_map_close(b);
    }
}

static void ranks_share_the_group_and_differ_in_the_page(void **state)
{
    stepq_map_t *map = load(GDN6);
    stepq_tp_fingerprint_info r0 = fp_of(map, 2, 0), r1 = fp_of(map, 2, 1);
    stepq_tp_fingerprint_info t1 = fp_of(map, 1, 0), t4 = fp_of(map, 4, 0);
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_tp_fingerprint_info f;
    stepq_map_t *uni = load("config/calibrated/tiny-gdn/uniform@6.json");

    assert_true(r0.group == r1.group);
    assert_true(r0.page != r1.page);
    assert_true(t1.group != r0.group && t4.group != r0.group && t1.group != t4.group);
    /* Ranks of a uniform map have identical layouts but hold other heads. */
    assert_true(fp_of(uni, 2, 0).page != fp_of(uni, 2, 1).page);
    stepq_map_close(uni);
    /* A page geometry other ranks do not have: a larger minimum page. */
    cfg.map = map;
    cfg.tp_size = 2;
    cfg.num_slots = 4;
    cfg.min_page_bytes = 64ull << 20;
    assert_int_equal(stepq_tp_fingerprint(&cfg, &f, sizeof(f)), STEPQ_OK);
    assert_true(f.map == r0.map);
    assert_true(f.group != r0.group);
    /* The default alignment named explicitly is the same geometry. */
    cfg.min_page_bytes = 0;
    cfg.page_align = 256;
    cfg.block_align = 16;
    assert_int_equal(stepq_tp_fingerprint(&cfg, &f, sizeof(f)), STEPQ_OK);
    assert_true(f.group == r0.group && f.page == r0.page);
    cfg.page_align = 1 << 20;
    assert_int_equal(stepq_tp_fingerprint(&cfg, &f, sizeof(f)), STEPQ_OK);
    assert_true(f.group != r0.group);
    cfg.page_align = 0;
    cfg.block_align = 0;
    /* Slot counts are sizing, not content. */
    cfg.min_page_bytes = 0;
    cfg.num_slots = 400;
    assert_int_equal(stepq_tp_fingerprint(&cfg, &f, sizeof(f)), STEPQ_OK);
    assert_true(f.group == r0.group && f.page == r0.page);
    /* Arguments. */
    assert_int_equal(stepq_tp_fingerprint(&cfg, &f, 0), STEPQ_EINVAL);
    assert_int_equal(stepq_tp_fingerprint(NULL, &f, sizeof(f)), STEPQ_EINVAL);
    cfg.tp_size = 3;
    assert_int_equal(stepq_tp_fingerprint(&cfg, &f, sizeof(f)), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "tp_size 3"));
    cfg.tp_size = 2;
    cfg.magic = 0;
    assert_int_equal(stepq_tp_fingerprint(&cfg, &f, sizeof(f)), STEPQ_EVERSION);
    stepq_map_close(map);
}

/* The first head with an integer width above 2, narrowed: still within the budget. */
static void narrow_one_head(stepq_map_t *map, int upu)
{
    const int n = stepq_map_units_per_layer(map);

    for (int u = 0; u < n; u += upu) {
        int b = stepq_map_unit_bits(map, 0, u);
        if (b > 2 && b != STEPQ_BITS_PIVOT) {
            assert_int_equal(stepq_map_set_unit_bits(map, 0, u, b == 8 ? 6 : b - 1), STEPQ_OK);
            assert_int_equal(stepq_map_validate(map), STEPQ_OK);
            return;
        }
    }
    fail_msg("no head to narrow");
}

static void one_changed_head_changes_every_fingerprint(void **state)
{
    const char *maps[] = { GDN6, KDA6 };

    for (size_t i = 0; i < 2; i++) {
        stepq_map_t *a = load(maps[i]), *b = load(maps[i]);
        stepq_model_shape s;
        stepq_unit_stats st = STEPQ_UNIT_STATS_INITIALIZER;

        assert_int_equal(stepq_map_shape(a, &s), STEPQ_OK);
        /* Statistics and the name do not change the pages: same fingerprints. */
        assert_int_equal(stepq_map_unit_stats(b, 0, 0, &st), STEPQ_OK);
        st.lambda += 1.0;
        assert_int_equal(stepq_map_set_unit_stats(b, 0, 0, &st), STEPQ_OK);
        assert_int_equal(stepq_map_set_model_name(b, "renamed"), STEPQ_OK);
        assert_true(fp_of(a, 2, 0).group == fp_of(b, 2, 0).group);
        /* One unit's width does, on every rank (the group covers all ranks' pages). */
        narrow_one_head(b, s.arch == STEPQ_ARCH_KDA ? s.head_k_dim : 1);
        for (int r = 0; r < 2; r++) {
            stepq_tp_fingerprint_info fa = fp_of(a, 2, r), fb = fp_of(b, 2, r);
            assert_true(fa.map != fb.map);
            assert_true(fa.group != fb.group);
            assert_true(fa.page != fb.page);
        }
        stepq_map_close(a);
        stepq_map_close(b);
    }
}

/*
 * The row split (map field row_split) changes what a pack writes, so ranks whose maps
 * differ in it alone must not agree; at 0.5, the default, the fingerprints are those of
 * the map without the field.
 */
static void a_row_split_changes_every_fingerprint_unless_it_is_the_default(void **state)
{
    const char *maps[] = { GDN6, KDA6 };

    for (size_t i = 0; i < 2; i++) {
        stepq_map_t *a = load(maps[i]), *b = load(maps[i]);

        assert_int_equal(stepq_map_set_row_split(b, 0.75), STEPQ_OK);
        for (int r = 0; r < 2; r++) {
            stepq_tp_fingerprint_info fa = fp_of(a, 2, r), fb = fp_of(b, 2, r);
            assert_true(fa.map != fb.map);
            assert_true(fa.group != fb.group);
            assert_true(fa.page != fb.page);
        }
        assert_int_equal(stepq_map_set_row_split(b, 0.5), STEPQ_OK);
        for (int r = 0; r < 2; r++) {
            stepq_tp_fingerprint_info fa = fp_of(a, 2, r), fb = fp_of(b, 2, r);
            assert_true(fa.map == fb.map && fa.group == fb.group && fa.page == fb.page);
        }
        stepq_map_close(a);
        stepq_map_close(b);
    }
}

/*
 * The decode fit (map field decode_fit) changes what a decode step writes, so ranks whose
 * maps differ in it alone must not agree; exact, the default, gives the fingerprints of the
 * map without the field.
 */
static void a_decode_fit_changes_every_fingerprint_unless_it_is_exact(void **state)
{
    const char *maps[] = { GDN6, KDA6 };

    for (size_t i = 0; i < 2; i++) {
        stepq_map_t *a = load(maps[i]), *b = load(maps[i]);

        for (int fit = STEPQ_DECODE_FIT_NOREFIT; fit <= STEPQ_DECODE_FIT_ROWS; fit++) {
            assert_int_equal(stepq_map_set_decode_fit(b, (stepq_decode_fit)fit), STEPQ_OK);
            for (int r = 0; r < 2; r++) {
                stepq_tp_fingerprint_info fa = fp_of(a, 2, r), fb = fp_of(b, 2, r);
                assert_true(fa.map != fb.map);
                assert_true(fa.group != fb.group);
                assert_true(fa.page != fb.page);
            }
        }
        assert_int_equal(stepq_map_set_decode_fit(b, STEPQ_DECODE_FIT_EXACT), STEPQ_OK);
        for (int r = 0; r < 2; r++) {
            stepq_tp_fingerprint_info fa = fp_of(a, 2, r), fb = fp_of(b, 2, r);
            assert_true(fa.map == fb.map && fa.group == fb.group && fa.page == fb.page);
        }
        stepq_map_close(a);
        stepq_map_close(b);
    }
}

/*
 * The decode arithmetic (map field arith) changes what a decode step writes too: ranks whose
 * maps differ in it alone must not agree; fp32, the default, gives the fingerprints of the map
 * without the field.
 */
static void an_arith_changes_every_fingerprint_unless_it_is_fp32(void **state)
{
    const char *maps[] = { GDN6, KDA6 };

    for (size_t i = 0; i < 2; i++) {
        stepq_map_t *a = load(maps[i]), *b = load(maps[i]);

        assert_int_equal(stepq_map_set_arith(b, STEPQ_ARITH_FP16), STEPQ_OK);
        for (int r = 0; r < 2; r++) {
            stepq_tp_fingerprint_info fa = fp_of(a, 2, r), fb = fp_of(b, 2, r);
            assert_true(fa.map != fb.map);
            assert_true(fa.group != fb.group);
            assert_true(fa.page != fb.page);
        }
        assert_int_equal(stepq_map_set_arith(b, STEPQ_ARITH_FP32), STEPQ_OK);
        for (int r = 0; r < 2; r++) {
            stepq_tp_fingerprint_info fa = fp_of(a, 2, r), fb = fp_of(b, 2, r);
            assert_true(fa.map == fb.map && fa.group == fb.group && fa.page == fb.page);
        }
        stepq_map_close(a);
        stepq_map_close(b);
    }
}

/* --- the message header --- */

static const stepq_tp_msg_header hdr = {
    .fingerprint = 0x0123456789abcdefull,
    .slot_count = 5,
    .page_bytes = 32964608,
    .payload_bytes = 0,
};

static void encoded(uint8_t *b)
{
    assert_int_equal(stepq_tp_msg_encode(&hdr, b, STEPQ_TP_MSG_HEADER_BYTES), STEPQ_OK);
}

/* Rewrites the checksum after an edit, so that the edit itself is what decode sees. */
static void reseal(uint8_t *b)
{
    uint64_t h = stepq__fnv1a(STEPQ__FNV_OFFSET, b, 40);

    for (int i = 0; i < 8; i++)
        b[40 + i] = (uint8_t)(h >> (8 * i));
}

static int decode(const uint8_t *b, size_t len)
{
    stepq_tp_msg_header out;

    return stepq_tp_msg_decode(b, len, hdr.fingerprint, hdr.page_bytes, &out);
}

static void a_header_round_trips_in_little_endian(void **state)
{
    uint8_t b[STEPQ_TP_MSG_HEADER_BYTES + 16];
    stepq_tp_msg_header out;

    memset(b, 0xee, sizeof(b));
    encoded(b);
    assert_memory_equal(b, "SQPG\x01\x00\x30\x00\xef\xcd\xab\x89\x67\x45\x23\x01", 16);
    assert_int_equal(b[16], 5);
    assert_int_equal(b[48], 0xee); /* nothing past the header is written */
    assert_int_equal(stepq_tp_msg_decode(b, sizeof(b), hdr.fingerprint, hdr.page_bytes, &out),
                     STEPQ_OK);
    assert_true(out.fingerprint == hdr.fingerprint);
    assert_int_equal(out.slot_count, 5);
    assert_int_equal(out.page_bytes, 32964608);
    assert_int_equal(out.payload_bytes, 5ull * 32964608);
    assert_int_equal(decode(b, STEPQ_TP_MSG_HEADER_BYTES), STEPQ_OK);
}

static void decode_refuses_truncated_foreign_and_corrupted_headers(void **state)
{
    uint8_t b[STEPQ_TP_MSG_HEADER_BYTES];
    stepq_tp_msg_header out;

    encoded(b);
    for (size_t len = 0; len < STEPQ_TP_MSG_HEADER_BYTES; len++)
        assert_int_equal(decode(b, len), STEPQ_EPARSE);
    assert_non_null(strstr(stepq_last_error(), "truncated"));
    /* Every single-bit flip anywhere is refused. */
    for (int bit = 0; bit < 8 * STEPQ_TP_MSG_HEADER_BYTES; bit++) {
        int st;
        encoded(b);
        b[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        st = decode(b, sizeof(b));
        assert_true(st == (bit / 8 == 4 || bit / 8 == 5 ? STEPQ_EVERSION : STEPQ_EPARSE));
    }
    encoded(b);
    memcpy(b, "JSON", 4);
    assert_int_equal(decode(b, sizeof(b)), STEPQ_EPARSE);
    assert_non_null(strstr(stepq_last_error(), "not a stepq page message"));
    encoded(b);
    b[4] = 2;
    reseal(b);
    assert_int_equal(decode(b, sizeof(b)), STEPQ_EVERSION);
    encoded(b);
    b[6] = 64;
    reseal(b);
    assert_int_equal(decode(b, sizeof(b)), STEPQ_EPARSE);
    encoded(b);
    b[20] = 1; /* reserved */
    reseal(b);
    assert_int_equal(decode(b, sizeof(b)), STEPQ_EPARSE);
    encoded(b);
    b[32] ^= 1; /* payload bytes disagree with slots x page */
    reseal(b);
    assert_int_equal(decode(b, sizeof(b)), STEPQ_EPARSE);
    encoded(b);
    memset(b + 24, 0, 8); /* page bytes 0 */
    memset(b + 32, 0, 8);
    reseal(b);
    assert_int_equal(decode(b, sizeof(b)), STEPQ_EPARSE);
    encoded(b);
    b[19] = 0x80; /* 2^31 + 5 slots */
    reseal(b);
    assert_int_equal(decode(b, sizeof(b)), STEPQ_EPARSE);
    assert_int_equal(stepq_tp_msg_decode(NULL, 48, 0, 1, &out), STEPQ_EINVAL);
    encoded(b);
    assert_int_equal(stepq_tp_msg_decode(b, 48, 0, 1, NULL), STEPQ_EINVAL);
}

static void decode_refuses_another_layout_naming_both(void **state)
{
    uint8_t b[STEPQ_TP_MSG_HEADER_BYTES];
    stepq_tp_msg_header out;

    encoded(b);
    assert_int_equal(stepq_tp_msg_decode(b, sizeof(b), 0x1111, hdr.page_bytes, &out), STEPQ_ESHAPE);
    assert_non_null(strstr(stepq_last_error(), "0123456789abcdef"));
    assert_non_null(strstr(stepq_last_error(), "0000000000001111"));
    assert_int_equal(stepq_tp_msg_decode(b, sizeof(b), hdr.fingerprint, 4096, &out), STEPQ_ESHAPE);
    assert_non_null(strstr(stepq_last_error(), "32964608"));
    assert_non_null(strstr(stepq_last_error(), "4096"));
}

static void encode_refuses_what_decode_would(void **state)
{
    uint8_t b[STEPQ_TP_MSG_HEADER_BYTES];
    stepq_tp_msg_header h = hdr;

    assert_int_equal(stepq_tp_msg_encode(&h, b, sizeof(b) - 1), STEPQ_ERANGE);
    assert_int_equal(stepq_tp_msg_encode(NULL, b, sizeof(b)), STEPQ_EINVAL);
    assert_int_equal(stepq_tp_msg_encode(&h, NULL, sizeof(b)), STEPQ_EINVAL);
    h.page_bytes = 0;
    assert_int_equal(stepq_tp_msg_encode(&h, b, sizeof(b)), STEPQ_EINVAL);
    h.page_bytes = 1;
    h.slot_count = 0x80000000u;
    assert_int_equal(stepq_tp_msg_encode(&h, b, sizeof(b)), STEPQ_EINVAL);
    h.slot_count = INT32_MAX;
    h.page_bytes = UINT64_MAX / 2;
    assert_int_equal(stepq_tp_msg_encode(&h, b, sizeof(b)), STEPQ_EINVAL);
    h.slot_count = 0; /* an empty message is a message */
    assert_int_equal(stepq_tp_msg_encode(&h, b, sizeof(b)), STEPQ_OK);
    assert_int_equal(stepq_tp_msg_decode(b, sizeof(b), h.fingerprint, h.page_bytes, &h), STEPQ_OK);
    assert_int_equal(h.payload_bytes, 0);
}

/* A sender's page fingerprint is checked by a receiver that computed its own. */
static void a_receiver_accepts_its_own_rank_only(void **state)
{
    stepq_map_t *sender = load(GDN6), *receiver = load(GDN6);
    stepq_tp_msg_header h = { 0 }, out;
    stepq_tp_plan_info p;
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    uint8_t b[STEPQ_TP_MSG_HEADER_BYTES];

    cfg.map = sender;
    cfg.tp_size = 2;
    cfg.tp_rank = 1;
    cfg.num_slots = 4;
    assert_int_equal(stepq_tp_plan(&cfg, &p, sizeof(p)), STEPQ_OK);
    h.fingerprint = fp_of(sender, 2, 1).page;
    h.slot_count = 3;
    h.page_bytes = p.page_bytes;
    assert_int_equal(stepq_tp_msg_encode(&h, b, sizeof(b)), STEPQ_OK);
    assert_int_equal(
        stepq_tp_msg_decode(b, sizeof(b), fp_of(receiver, 2, 1).page, p.page_bytes, &out),
        STEPQ_OK);
    assert_int_equal(
        stepq_tp_msg_decode(b, sizeof(b), fp_of(receiver, 2, 0).page, p.page_bytes, &out),
        STEPQ_ESHAPE);
    stepq_map_close(sender);
    stepq_map_close(receiver);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static int documented(int st)
{
    return st == STEPQ_OK || st == STEPQ_EPARSE || st == STEPQ_EVERSION || st == STEPQ_ESHAPE;
}

/*
 * Random bytes of random lengths, each in a buffer of exactly that length
 * (a sanitizer build catches any read past it), and random edits of a valid
 * header: always a documented status, never a crash; an edited header is
 * never accepted.
 */
static void random_bytes_always_give_a_status(void **state)
{
    uint8_t good[STEPQ_TP_MSG_HEADER_BYTES];
    int ok = 0;

    encoded(good);
    for (int it = 0; it < 200000; it++) {
        const size_t len = (size_t)(next() % 97);
        uint8_t *b = malloc(len ? len : 1);
        int st;

        assert_non_null(b);
        if (it % 2 && len >= STEPQ_TP_MSG_HEADER_BYTES) {
            /* a valid header with 1..4 bytes changed */
            const int edits = 1 + (int)(next() % 4);
            memcpy(b, good, sizeof(good));
            for (size_t i = sizeof(good); i < len; i++)
                b[i] = (uint8_t)next();
            for (int e = 0; e < edits; e++)
                b[next() % sizeof(good)] ^= (uint8_t)(1 + next() % 255);
            if (it % 4 == 1)
                reseal(b);
        } else {
            for (size_t i = 0; i < len; i++)
                b[i] = (uint8_t)next();
            if (len >= 4 && it % 3 == 0)
                memcpy(b, "SQPG", 4); /* get past the magic */
            if (len >= 8 && it % 6 == 0)
                memcpy(b + 4, "\x01\x00\x30\x00", 4);
        }
        st = decode(b, len);
        assert_true(documented(st));
        if (st == STEPQ_OK)
            ok += memcmp(b, good, sizeof(good)) != 0;
        free(b);
    }
    assert_int_equal(ok, 0);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(the_same_map_loaded_twice_has_the_same_fingerprints),
        cmocka_unit_test(ranks_share_the_group_and_differ_in_the_page),
        cmocka_unit_test(one_changed_head_changes_every_fingerprint),
        cmocka_unit_test(a_row_split_changes_every_fingerprint_unless_it_is_the_default),
        cmocka_unit_test(a_decode_fit_changes_every_fingerprint_unless_it_is_exact),
        cmocka_unit_test(an_arith_changes_every_fingerprint_unless_it_is_fp32),
        cmocka_unit_test(a_header_round_trips_in_little_endian),
        cmocka_unit_test(decode_refuses_truncated_foreign_and_corrupted_headers),
        cmocka_unit_test(decode_refuses_another_layout_naming_both),
        cmocka_unit_test(encode_refuses_what_decode_would),
        cmocka_unit_test(a_receiver_accepts_its_own_rank_only),
        cmocka_unit_test(random_bytes_always_give_a_status),
    };
    if (argc != 2) {
        fprintf(stderr, "usage: %s REPOSITORY_ROOT\n", argv[0]);
        return 2;
    }
    root = argv[1];
    return cmocka_run_group_tests(tests, NULL, NULL);
}
