/*
 * The packed head format: block layouts and sizes, fp16/bf16 and e4m3
 * conversion, bit-stream packing.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/format.h"
#include "tests/kernels/util.h"

static void fill_bits(uint8_t *rb, int n, int b)
{
    for (int i = 0; i < n; i++)
        rb[i] = (uint8_t)b;
}

static void gdn_6bit_128_head_is_12288_code_bytes_plus_two_scale_vectors(void **state)
{
    (void)state;
    struct stepq__head_layout hl;
    uint8_t rb[128];
    fill_bits(rb, 128, 6);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 128, 128, rb, 0),
        STEPQ_OK);
    assert_int_equal(hl.codes_bytes, 12288);
    assert_int_equal(hl.row_scale_offset, 12288);
    assert_int_equal(hl.col_scale_offset, 12544);
    assert_int_equal(hl.block_bytes, 12800);
    assert_int_equal(hl.compact_bytes, 12800);
    assert_int_equal(hl.row_bitoff[1], 128 * 6);
    stepq__head_layout_free(&hl);

    /* uniform has no column scales */
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_UNIFORM, STEPQ_ARCH_GDN, 128, 128, rb, 0),
        STEPQ_OK);
    assert_int_equal(hl.block_bytes, 12544);
    assert_int_equal(hl.compact_bytes, 12544);
    assert_int_equal(hl.has_col, 0);
    stepq__head_layout_free(&hl);
}

static void pivot_head_reserves_both_scale_slots_but_compact_omits_them(void **state)
{
    (void)state;
    struct stepq__head_layout hl;
    uint8_t rb[128];
    fill_bits(rb, 128, STEPQ_BITS_PIVOT);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 128, 128, rb, 16),
        STEPQ_OK);
    assert_int_equal(hl.codes_bytes, 2 * 128 * 128);
    assert_int_equal(hl.block_bytes, 2 * 128 * 128 + 256 + 256);
    assert_int_equal(hl.compact_bytes, 2 * 128 * 128);
    assert_int_equal(hl.n_pivot_rows, 128);
    stepq__head_layout_free(&hl);
}

/*
 * The paper's serving layout: Qwen3.8-27B (48 layers x 48 heads of 128x128) at
 * stepq@6 with 32 pivot heads. The budget 6*N - 8*N_piv leaves 13568 bits
 * per value-position across the 2272 integer heads: 2240 heads at 6 bits and
 * 32 at 4. Compact: 29,999,104 B; the analytical layout (scale slots for
 * every head): 30,015,488 B.
 */
static void qwen_stepq6_totals_match_the_paper(void **state)
{
    (void)state;
    struct stepq__head_layout h6, h4, hp;
    uint8_t rb[128];
    fill_bits(rb, 128, 6);
    assert_int_equal(
        stepq__head_layout_init(&h6, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 128, 128, rb, 0), 0);
    fill_bits(rb, 128, 4);
    assert_int_equal(
        stepq__head_layout_init(&h4, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 128, 128, rb, 0), 0);
    fill_bits(rb, 128, STEPQ_BITS_PIVOT);
    assert_int_equal(
        stepq__head_layout_init(&hp, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 128, 128, rb, 0), 0);
    uint64_t compact = 2240 * (uint64_t)h6.compact_bytes + 32 * (uint64_t)h4.compact_bytes +
                       32 * (uint64_t)hp.compact_bytes;
    uint64_t block = 2240 * (uint64_t)h6.block_bytes + 32 * (uint64_t)h4.block_bytes +
                     32 * (uint64_t)hp.block_bytes;
    assert_int_equal(compact, 29999104);
    assert_int_equal(block, 30015488);
    stepq__head_layout_free(&h6);
    stepq__head_layout_free(&h4);
    stepq__head_layout_free(&hp);
}

/*
 * KDA 4x3, rows at 3, pivot, 5, 2 bits: row streams of ceil(9/8)=2, 6,
 * ceil(15/8)=2 and ceil(6/8)=1 bytes at byte offsets 0, 2, 8, 10 (11 code
 * bytes); row scales at 16 (8 B), column scales at 32 (6 B), block 48.
 * Compact: 11 + 3 non-pivot row scales + one column vector = 23.
 */
static void kda_rows_with_mixed_bits_are_byte_aligned_streams(void **state)
{
    (void)state;
    struct stepq__head_layout hl;
    const uint8_t rb[4] = { 3, STEPQ_BITS_PIVOT, 5, 2 };
    assert_int_equal(stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 4, 3, rb, 0),
                     0);
    assert_int_equal(hl.row_bitoff[0], 0);
    assert_int_equal(hl.row_bitoff[1], 16);
    assert_int_equal(hl.row_bitoff[2], 64);
    assert_int_equal(hl.row_bitoff[3], 80);
    assert_int_equal(hl.row_bitoff[4], 88);
    assert_int_equal(hl.codes_bytes, 11);
    assert_int_equal(hl.row_scale_offset, 16);
    assert_int_equal(hl.col_scale_offset, 32);
    assert_int_equal(hl.block_bytes, 48);
    assert_int_equal(hl.compact_bytes, 23);
    assert_int_equal(hl.n_pivot_rows, 1);
    stepq__head_layout_free(&hl);

    /* temporal: same codes, no column vector */
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_TEMPORAL, STEPQ_ARCH_KDA, 4, 3, rb, 1), 0);
    assert_int_equal(hl.row_scale_offset, 11);
    assert_int_equal(hl.block_bytes, 19);
    assert_int_equal(hl.compact_bytes, 17);
    stepq__head_layout_free(&hl);
}

static void kda_head_of_only_pivots_has_no_compact_column_vector(void **state)
{
    (void)state;
    struct stepq__head_layout hl;
    uint8_t rb[4];
    fill_bits(rb, 4, STEPQ_BITS_PIVOT);
    assert_int_equal(stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 4, 3, rb, 0),
                     0);
    assert_int_equal(hl.compact_bytes, 4 * 3 * 2);
    assert_int_equal(hl.block_bytes, 32 + 16 + 16);
    stepq__head_layout_free(&hl);
}

static void dense_blocks_hold_the_dtype_row_major(void **state)
{
    (void)state;
    struct stepq__head_layout hl;
    assert_int_equal(stepq__head_layout_init(&hl, STEPQ_METHOD_FP32, STEPQ_ARCH_GDN, 4, 3, NULL, 0),
                     0);
    assert_int_equal(hl.codes_bytes, 48);
    assert_int_equal(hl.block_bytes, 48);
    assert_int_equal(hl.quantized, 0);
    stepq__head_layout_free(&hl);
    assert_int_equal(stepq__head_layout_init(&hl, STEPQ_METHOD_BF16, STEPQ_ARCH_KDA, 4, 3, NULL, 0),
                     0);
    assert_int_equal(hl.codes_bytes, 24);
    assert_int_equal(hl.compact_bytes, 24);
    assert_int_equal(hl.block_bytes, 32);
    stepq__head_layout_free(&hl);
}

/* fp8: one byte per value, ceil(d_v / 32) fp32 tile scales aligned after the codes. */
static void fp8_block_is_one_byte_per_value_plus_tile_scales(void **state)
{
    (void)state;
    struct stepq__head_layout hl;
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_FP8, STEPQ_ARCH_GDN, 128, 128, NULL, 0),
        STEPQ_OK);
    assert_int_equal(hl.quantized, 1);
    assert_int_equal(hl.has_col, 0);
    assert_int_equal(hl.codes_bytes, 16384);
    assert_int_equal(hl.tile_scale_offset, 16384);
    assert_int_equal(hl.block_bytes, 16400);
    assert_int_equal(hl.compact_bytes, 16400);
    assert_int_equal(hl.row_bits[0], 0);
    assert_int_equal(hl.row_bitoff[1], 128 * 8);
    stepq__head_layout_free(&hl);

    /* d_v = 40: two tiles (32 + a short one of 8); KDA heads are laid out alike. */
    assert_int_equal(stepq__head_layout_init(&hl, STEPQ_METHOD_FP8, STEPQ_ARCH_KDA, 3, 40, NULL, 0),
                     STEPQ_OK);
    assert_int_equal(hl.codes_bytes, 120);
    assert_int_equal(hl.tile_scale_offset, 128);
    assert_int_equal(hl.block_bytes, 144);
    assert_int_equal(hl.compact_bytes, 128);
    assert_int_equal(stepq__fp8_tiles(40), 2);
    assert_int_equal(stepq__fp8_tiles(32), 1);
    assert_int_equal(stepq__fp8_tiles(1), 1);
    stepq__head_layout_free(&hl);
}

/* The value of an e4m3 code from its fields (independent of the library's bit tricks). */
static double e4m3_value(int c)
{
    int e = (c >> 3) & 15, m = c & 7;
    double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m, -9);
    return c & 0x80 ? -v : v;
}

static void e4m3_decodes_every_code_and_encodes_every_code_up_to_240_back(void **state)
{
    (void)state;
    for (int c = 0; c < 256; c++) {
        float f = stepq__e4m3_to_float((uint8_t)c);
        if ((c & 0x7f) == 0x7f) { /* the two NaN codes */
            assert_true(f != f);
            continue;
        }
        assert_true((double)f == e4m3_value(c));
        assert_int_equal(signbit(f) != 0, (c & 0x80) != 0);
        /* Codes above 240 (256 .. 448) saturate to 240; every other code is its own image. */
        int want = fabsf(f) > 240.0f ? (c & 0x80) | 0x77 : c;
        assert_int_equal(stepq__e4m3_from_float(f), want);
    }
    assert_int_equal(stepq__e4m3_from_float(240.0f), 0x77);
    assert_int_equal(stepq__e4m3_from_float(-240.0f), 0xf7);
}

/*
 * Between two neighbouring codes: the midpoint goes to the code with the even mantissa,
 * one float ulp either side to the nearer code. Covers subnormals (2^-9 steps), the
 * subnormal/normal boundary and every binade up to 240.
 */
static void e4m3_rounds_to_nearest_even_and_saturates(void **state)
{
    (void)state;
    for (int c = 0; c < 0x77; c++) {
        for (int sg = 0; sg < 2; sg++) {
            int lo = c | (sg << 7), hi = (c + 1) | (sg << 7);
            float a = stepq__e4m3_to_float((uint8_t)lo), b = stepq__e4m3_to_float((uint8_t)hi);
            float mid = (float)(((double)a + (double)b) / 2.0); /* exact in float */
            assert_true((double)mid == ((double)a + (double)b) / 2.0);
            int even = (c & 1) ? hi : lo;
            assert_int_equal(stepq__e4m3_from_float(mid), even);
            assert_int_equal(stepq__e4m3_from_float(nextafterf(mid, a)), lo);
            assert_int_equal(stepq__e4m3_from_float(nextafterf(mid, b)), hi);
        }
    }
    /* Beyond 240, infinities, NaN and values that round to zero (which keep their sign). */
    assert_int_equal(stepq__e4m3_from_float(nextafterf(240.0f, 1e9f)), 0x77);
    assert_int_equal(stepq__e4m3_from_float(248.0f), 0x77);
    assert_int_equal(stepq__e4m3_from_float(1e30f), 0x77);
    assert_int_equal(stepq__e4m3_from_float(INFINITY), 0x77);
    assert_int_equal(stepq__e4m3_from_float(-INFINITY), 0xf7);
    assert_int_equal(stepq__e4m3_from_float(NAN), 0x00);
    assert_int_equal(stepq__e4m3_from_float(0.0f), 0x00);
    assert_int_equal(stepq__e4m3_from_float(-0.0f), 0x80);
    assert_int_equal(stepq__e4m3_from_float(1e-30f), 0x00);
    assert_int_equal(stepq__e4m3_from_float(-1e-30f), 0x80);
    assert_int_equal(stepq__e4m3_from_float(0x1p-10f), 0x00);                   /* tie to 0 */
    assert_int_equal(stepq__e4m3_from_float(nextafterf(0x1p-10f, 1.0f)), 0x01); /* above it */
}

/*
 * The zero threshold of the CUDA fp8 pack (kernels/cuda/fp8_kernel.cuh): for a tile scale
 * s >= 2^-116, thr = s * 2^-10 is exact, and every x with |x| < thr gets the code of x * 0
 * (the signed zero) there without a division. Checked against the reference's code of the
 * correctly rounded x / s (fit_fp8) over scales across the whole range, with zeros, denormals,
 * the floats beside thr and random values below it; and at thr itself the division is taken
 * (its code may be zero or not: 2^-10 exactly is a tie to zero).
 */
static void e4m3_zero_threshold_of_the_cuda_pack_matches_the_reference(void **state)
{
    (void)state;
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 20000; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        /* s: the edge 2^-116, then random exponents in [-116, 30] and random mantissas */
        const int ex = -116 + (int)((rng >> 33) % 147);
        const float s =
            i == 0 ? 0x1p-116f : ldexpf(1.0f + (float)((rng >> 11) & 0xfffff) / 0x1p20f, ex);
        const float thr = s * 0x1p-10f;
        assert_true((double)thr == (double)s * 0x1p-10); /* exact */
        const float xs[] = { 0.0f,
                             -0.0f,
                             0x1p-149f,
                             -0x1p-130f,
                             nextafterf(thr, 0.0f),
                             -nextafterf(thr, 0.0f),
                             thr * (float)((rng >> 40) & 0xffff) / 0x1p16f,
                             -thr * (float)((rng >> 24) & 0xffff) / 0x1p16f };
        for (size_t k = 0; k < sizeof(xs) / sizeof(xs[0]); k++) {
            const float x = xs[k];
            if (!(fabsf(x) < thr))
                continue;
            assert_int_equal(stepq__e4m3_from_float(x / s), signbit(x) ? 0x80 : 0x00);
            assert_int_equal(stepq__e4m3_from_float(x * 0.0f), signbit(x) ? 0x80 : 0x00);
        }
        /* just above thr the quotient rounds to the first subnormal code */
        const float up = nextafterf(thr, 1.0f);
        assert_int_equal(stepq__e4m3_from_float(up / s), up / s > 0x1p-10f ? 0x01 : 0x00);
    }
}

/*
 * sq_div (kernels/cuda/common.cuh), the CUDA fp8 fits' quotient: q = RN(a RN(1/b)), then one
 * Markstein correction q + RN(a - q b) RN(1/b) with two FMAs, equals the correctly rounded a / b.
 * kernels/cuda/probe/div_exhaustive.cu checks every pair of significands on a GPU; this is the
 * same comparison in the host's IEEE float arithmetic on a sample that runs in CI: the first and
 * last 1024 significands of b (the last ones are where RN(1/b) is least accurate) against every
 * 97th significand of a, and scaled copies of each pair at both ends of the range the fp8 fits
 * use (|a| >= 2^-90, 2^-80 <= b <= 2^120). A plain product a RN(1/b) differs from a / b in a
 * fraction of these pairs, so the correction is what the check sees.
 */
static float markstein_div(float a, float b)
{
    const float bi = 1.0f / b, q = a * bi;
    return fmaf(fmaf(-q, b, a), bi, q);
}

static void markstein_quotient_of_the_cuda_fp8_fits_is_correctly_rounded(void **state)
{
    (void)state;
    long plain = 0, pairs = 0;
    for (int k = 0; k < 2048; k++) {
        const uint32_t mb = k < 1024 ? (uint32_t)k : (1u << 23) - 2048u + (uint32_t)k;
        float b;
        const uint32_t ib = 0x3f800000u | mb;
        memcpy(&b, &ib, 4);
        for (uint32_t ma = (uint32_t)k % 97; ma < (1u << 23); ma += 97) {
            float a;
            const uint32_t ia = 0x3f800000u | ma;
            memcpy(&a, &ia, 4);
            const float q = markstein_div(a, b), r = a / b;
            if (q != r)
                fail_msg("a = %a, b = %a: %a, correctly rounded %a", (double)a, (double)b,
                         (double)q, (double)r);
            plain += a * (1.0f / b) != r;
            pairs++;
            if (ma % 4096 == k % 97) { /* scaled: the ends of the fp8 fits' range, signs */
                const float a2 = ldexpf(-a, -90), b2 = ldexpf(b, -80), a3 = ldexpf(a, 100),
                            b3 = ldexpf(-b, 120);
                assert_true(markstein_div(a2, b2) == a2 / b2);
                assert_true(markstein_div(a3, b3) == a3 / b3);
                assert_true(markstein_div(a2, b3) == a2 / b3);
            }
        }
    }
    assert_true(pairs > 150000);
    assert_true(plain > 0); /* the uncorrected product is not enough */
}

static void layout_rejects_bad_bits_methods_and_alignment(void **state)
{
    (void)state;
    struct stepq__head_layout hl;
    uint8_t rb[4] = { 4, 4, 7, 4 };
    assert_int_equal(stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 4, 3, rb, 0),
                     STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "row_bits[2]"));
    assert_null(hl.row_bits);

    uint8_t piv[4] = { 4, STEPQ_BITS_PIVOT, 4, 4 };
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_SPATIAL, STEPQ_ARCH_KDA, 4, 3, piv, 0),
        STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "no pivots"));

    uint8_t mixed[4] = { 4, 6, 4, 4 };
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 4, 3, mixed, 0),
        STEPQ_EINVAL);
    assert_int_equal(stepq__head_layout_init(&hl, STEPQ_METHOD_DSQ, STEPQ_ARCH_KDA, 4, 3, mixed, 0),
                     STEPQ_EINVAL);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 4, 3, mixed, 24),
        STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "power of two"));
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 0, 3, mixed, 0),
        STEPQ_EINVAL);
    assert_int_equal(
        stepq__head_layout_init(&hl, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 4, 3, NULL, 0),
        STEPQ_EINVAL);
    assert_int_equal(stepq__head_layout_init(&hl, STEPQ_METHOD_COUNT, STEPQ_ARCH_KDA, 4, 3, rb, 0),
                     STEPQ_EINVAL);
    stepq__head_layout_free(&hl); /* safe on a zeroed layout */
}

static void fp16_round_trips_every_finite_half(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        if ((h & 0x7c00u) == 0x7c00u)
            continue;
        float f = stepq__fp16_to_float((uint16_t)h);
        assert_int_equal(stepq__fp16_from_float(f), h);
    }
}

static void fp16_rounds_to_nearest_even_and_overflows_to_inf(void **state)
{
    (void)state;
    /* 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0). */
    assert_int_equal(stepq__fp16_from_float(1.0f + 0x1p-11f), 0x3c00);
    /* 1 + 3*2^-11 is halfway between odd 1+2^-10 and even 1+2^-9: up. */
    assert_int_equal(stepq__fp16_from_float(1.0f + 3 * 0x1p-11f), 0x3c02);
    assert_int_equal(stepq__fp16_from_float(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
    /* subnormals: 2^-24 is the smallest, half of it ties to 0, 1.5x to 2^-23 */
    assert_int_equal(stepq__fp16_from_float(0x1p-24f), 0x0001);
    assert_int_equal(stepq__fp16_from_float(0x1p-25f), 0x0000);
    assert_int_equal(stepq__fp16_from_float(3 * 0x1p-25f), 0x0002);
    assert_int_equal(stepq__fp16_from_float(-0x1p-14f), 0x8400);
    /* 65504 is the largest half; 65519 rounds down, 65520 ties up to Inf */
    assert_int_equal(stepq__fp16_from_float(65519.0f), 0x7bff);
    assert_int_equal(stepq__fp16_from_float(65520.0f), 0x7c00);
    assert_int_equal(stepq__fp16_from_float(-1e9f), 0xfc00);
    assert_true(isnan(stepq__fp16_to_float(stepq__fp16_from_float(NAN))));

    int sat = 0;
    assert_int_equal(stepq__fp16_from_float_sat(1e9f, &sat), 0x7bff);
    assert_int_equal(sat, 1);
    sat = 0;
    assert_int_equal(stepq__fp16_from_float_sat(-INFINITY, &sat), 0xfbff);
    assert_int_equal(sat, 1);
    sat = 0;
    assert_int_equal(stepq__fp16_from_float_sat(0.5f, &sat), 0x3800);
    assert_int_equal(sat, 0);
}

static void bf16_rounds_to_nearest_even(void **state)
{
    (void)state;
    /* 1 + 2^-8 ties to 1.0 (even), 1 + 3*2^-8 ties up to 1 + 2^-6 */
    assert_int_equal(stepq__bf16_from_float(1.0f + 0x1p-8f), 0x3f80);
    assert_int_equal(stepq__bf16_from_float(1.0f + 3 * 0x1p-8f), 0x3f82);
    assert_true(stepq__bf16_to_float(0x4049) == 3.140625f);
    assert_true(isnan(stepq__bf16_to_float(stepq__bf16_from_float(NAN))));
}

static void scales_are_clamped_to_the_fp16_normal_range(void **state)
{
    (void)state;
    assert_int_equal(stepq__scale_to_fp16(0.0f), 0x0400); /* 2^-14 */
    assert_int_equal(stepq__scale_to_fp16(1e-30f), 0x0400);
    assert_int_equal(stepq__scale_to_fp16(NAN), 0x0400);
    assert_int_equal(stepq__scale_to_fp16(1e30f), 0x7bff); /* 65504 */
    assert_int_equal(stepq__scale_to_fp16(INFINITY), 0x7bff);
    assert_int_equal(stepq__scale_to_fp16(1.0f), 0x3c00);
    assert_true(stepq__fp16_to_float(0x0400) == STEPQ__SCALE_MIN);
    assert_true(stepq__fp16_to_float(0x7bff) == STEPQ__SCALE_MAX);
}

/* 3-bit codes -3, 3, 0, 1 are stored u = 0, 6, 3, 4, LSB first:
 * bits 0-2 = 000, 3-5 = 110, 6-8 = 011, 9-11 = 100 -> 0xF0 0x08. */
static void pack_writes_the_documented_bit_image(void **state)
{
    (void)state;
    const int8_t z[4] = { -3, 3, 0, 1 };
    uint8_t buf[2] = { 0, 0 };
    stepq__pack_codes(buf, 0, z, 4, 3);
    assert_int_equal(buf[0], 0xF0);
    assert_int_equal(buf[1], 0x08);

    /* 4-bit: z = 7, -4 (qmax 7) -> u = 14, 3 -> 0x3E */
    const int8_t z4[2] = { 7, -4 };
    uint8_t b4 = 0;
    stepq__pack_codes(&b4, 0, z4, 2, 4);
    assert_int_equal(b4, 0x3E);
}

static void pack_unpack_round_trip_every_width_length_and_offset(void **state)
{
    (void)state;
    static const int widths[] = { 2, 3, 4, 5, 6, 8 };
    uint64_t rng = 0x1234567ull;
    int8_t z[97], back[97];
    uint8_t buf[128], ref[128];

    for (size_t w = 0; w < sizeof(widths) / sizeof(widths[0]); w++) {
        int b = widths[w];
        int qmax = stepq__qmax(b);
        for (int n = 1; n <= 97; n += (n < 20 ? 1 : 7)) {
            for (int off = 0; off < 19; off += 3) {
                for (int e = 0; e < n; e++)
                    z[e] = (int8_t)((int)(rng_next(&rng) % (uint64_t)(2 * qmax + 1)) - qmax);
                for (size_t e = 0; e < sizeof(buf); e++)
                    buf[e] = (uint8_t)rng_next(&rng);
                memcpy(ref, buf, sizeof(buf));
                stepq__pack_codes(buf, (uint64_t)off, z, (size_t)n, b);
                stepq__unpack_codes(buf, (uint64_t)off, back, (size_t)n, b);
                assert_memory_equal(z, back, (size_t)n);
                /* bits outside [off, off + n*b) are preserved */
                for (int bit = 0; bit < 8 * (int)sizeof(buf); bit++) {
                    if (bit >= off && bit < off + n * b)
                        continue;
                    assert_int_equal((buf[bit / 8] >> (bit % 8)) & 1,
                                     (ref[bit / 8] >> (bit % 8)) & 1);
                }
            }
        }
        /* the extreme codes survive too */
        int8_t ext[3] = { (int8_t)-qmax, 0, (int8_t)qmax };
        memset(buf, 0, sizeof(buf));
        stepq__pack_codes(buf, 5, ext, 3, b);
        stepq__unpack_codes(buf, 5, back, 3, b);
        assert_memory_equal(ext, back, 3);
    }
}

static void stream_sizes_are_exact(void **state)
{
    (void)state;
    assert_int_equal(stepq__stream_bytes(128 * 128, 6), 12288);
    assert_int_equal(stepq__stream_bytes(3, 3), 2);
    assert_int_equal(stepq__stream_bytes(8, 3), 3);
    assert_int_equal(stepq__stream_bytes(1, 2), 1);
    assert_int_equal(stepq__stream_bytes(128, 5), 80);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(gdn_6bit_128_head_is_12288_code_bytes_plus_two_scale_vectors),
        cmocka_unit_test(pivot_head_reserves_both_scale_slots_but_compact_omits_them),
        cmocka_unit_test(qwen_stepq6_totals_match_the_paper),
        cmocka_unit_test(kda_rows_with_mixed_bits_are_byte_aligned_streams),
        cmocka_unit_test(kda_head_of_only_pivots_has_no_compact_column_vector),
        cmocka_unit_test(dense_blocks_hold_the_dtype_row_major),
        cmocka_unit_test(fp8_block_is_one_byte_per_value_plus_tile_scales),
        cmocka_unit_test(e4m3_decodes_every_code_and_encodes_every_code_up_to_240_back),
        cmocka_unit_test(e4m3_rounds_to_nearest_even_and_saturates),
        cmocka_unit_test(layout_rejects_bad_bits_methods_and_alignment),
        cmocka_unit_test(fp16_round_trips_every_finite_half),
        cmocka_unit_test(fp16_rounds_to_nearest_even_and_overflows_to_inf),
        cmocka_unit_test(e4m3_zero_threshold_of_the_cuda_pack_matches_the_reference),
        cmocka_unit_test(markstein_quotient_of_the_cuda_fp8_fits_is_correctly_rounded),
        cmocka_unit_test(bf16_rounds_to_nearest_even),
        cmocka_unit_test(scales_are_clamped_to_the_fp16_normal_range),
        cmocka_unit_test(pack_writes_the_documented_bit_image),
        cmocka_unit_test(pack_unpack_round_trip_every_width_length_and_offset),
        cmocka_unit_test(stream_sizes_are_exact),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
