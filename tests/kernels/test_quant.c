/*
 * Quantization methods (kernels/format.h, kernels/quant.h) on one head: hand-computed
 * golden values for tiny heads, then the properties every method must keep.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/quant.h"
#include "tests/kernels/util.h"

#define MAXB 4096

struct head {
    struct stepq__head_layout hl;
    uint8_t blk[MAXB];
    float xh[64 * 64];
};

static void head_init(struct head *h, stepq_method m, stepq_arch a, int dk, int dv,
                      const uint8_t *bits)
{
    assert_int_equal(stepq__head_layout_init(&h->hl, m, a, dk, dv, bits, 0), STEPQ_OK);
    assert_true(h->hl.block_bytes <= MAXB);
}

static void quantize(struct head *h, const float *x, const float *w)
{
    uint32_t flags = 0;
    assert_int_equal(stepq__quantize_head(&h->hl, x, w, h->blk, &flags), STEPQ_OK);
    assert_int_equal(flags, 0);
    assert_int_equal(stepq__dequantize_head(&h->hl, h->blk, h->xh), STEPQ_OK);
}

static uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static void expect_row_scales(const struct head *h, const uint16_t *want)
{
    for (int i = 0; i < h->hl.d_k; i++)
        assert_int_equal(rd16(h->blk + h->hl.row_scale_offset + 2 * i), want[i]);
}

static void expect_col_scales(const struct head *h, const uint16_t *want)
{
    for (int j = 0; j < h->hl.d_v; j++)
        assert_int_equal(rd16(h->blk + h->hl.col_scale_offset + 2 * j), want[j]);
}

/* Codes of row i (NULL entries in want for pivot rows are skipped by the caller). */
static void expect_row_codes(const struct head *h, int i, const int8_t *want)
{
    int8_t z[64];
    stepq__unpack_codes(h->blk, h->hl.row_bitoff[i], z, (size_t)h->hl.d_v, h->hl.row_bits[i]);
    assert_memory_equal(z, want, (size_t)h->hl.d_v);
}

static void expect_xhat(const struct head *h, const double *want)
{
    int n = h->hl.d_k * h->hl.d_v;
    for (int e = 0; e < n; e++)
        assert_float_equal(h->xh[e], want[e], 1e-7 * (1.0 + fabs(want[e])));
}

/*
 * uniform, GDN 2x2 at 4 bits (qmax 7), X = [[1, -0.5], [0.25, 2]]:
 * r = row absmax = [1, 2] (fp16 0x3C00, 0x4000).
 * z = rint(7 x / r): row 0: 7, rint(-3.5) = -4 (ties to even); row 1:
 * rint(0.875) = 1, 7. Stored u = z + 7: 14, 3, 8, 14 -> bytes 0x3E, 0xE8.
 * x^ = r z / 7: [[1, -4/7], [2/7, 2]].
 */
static void uniform_2x2_golden(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[2] = { 4, 4 };
    const float x[4] = { 1.0f, -0.5f, 0.25f, 2.0f };
    head_init(&h, STEPQ_METHOD_UNIFORM, STEPQ_ARCH_GDN, 2, 2, bits);
    quantize(&h, x, NULL);
    assert_int_equal(h.blk[0], 0x3E);
    assert_int_equal(h.blk[1], 0xE8);
    expect_row_scales(&h, (const uint16_t[]){ 0x3C00, 0x4000 });
    expect_xhat(&h, (const double[]){ 1.0, -4.0 / 7, 2.0 / 7, 2.0 });
    stepq__head_layout_free(&h.hl);
}

/*
 * dsq, GDN 2x2 at 4 bits, X = [[4, 1], [1, 1]], w = 1:
 * 1. m = [4, 1], r = sqrt(m) = [2, 1].
 * 2. Y = X / r = [[2, 0.5], [1, 1]], c = column max = [2, 1].
 * 3. z = rint(7 Y / c): [[7, rint(3.5) = 4], [rint(3.5) = 4, 7]];
 *    u = 14, 11, 11, 14 -> bytes 0xBE, 0xEB.
 * 4. refit, zt = z/7: c0 = (2*1*4 + 1*(4/7)*1) / (4*1 + 1*(16/49))
 *    = 8.5714 / 4.3265 = 1.98113 -> fp16 2029/1024 = 1.9814453125 (0x3FED);
 *    c1 = (2*(4/7)*1 + 1*1*1) / (4*(16/49) + 1) = 2.142857 / 2.306122
 *    = 0.929204 -> fp16 1903/2048 = 0.92919921875 (0x3B6F).
 * x^ = r c z/7: [[2*1.98145, 2*0.929199*4/7], [1.98145*4/7, 0.929199]].
 */
static void dsq_2x2_golden(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[2] = { 4, 4 };
    const float x[4] = { 4.0f, 1.0f, 1.0f, 1.0f };
    head_init(&h, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, 2, 2, bits);
    quantize(&h, x, NULL);
    assert_int_equal(h.blk[0], 0xBE);
    assert_int_equal(h.blk[1], 0xEB);
    expect_row_scales(&h, (const uint16_t[]){ 0x4000, 0x3C00 });
    expect_col_scales(&h, (const uint16_t[]){ 0x3FED, 0x3B6F });
    expect_xhat(&h, (const double[]){ 2 * 1.9814453125, 2 * 0.92919921875 * 4 / 7,
                                      1.9814453125 * 4 / 7, 0.92919921875 });
    stepq__head_layout_free(&h.hl);
}

/*
 * spatial, the same X with row impact w = [4, 0.25] (geometric mean 1):
 * 1. r = sqrt(m / w) = [sqrt(4/4), sqrt(1/0.25)] = [1, 2].
 * 2. Y = [[4, 1], [0.5, 0.5]], c = [4, 1].
 * 3. z = rint(7 Y / c) = [[7, 7], [rint(0.875) = 1, rint(3.5) = 4]];
 *    u = 14, 14, 8, 11 -> bytes 0xEE, 0xB8.
 * 4. refit with w^2 = [16, 1/16]:
 *    c0 = (16*1*1*4 + (1/16)*2*(1/7)*1) / (16 + (1/16)*4/49) = 3.99984 -> 4.0 (0x4400);
 *    c1 = (16*1*1*1 + (1/16)*2*(4/7)) / (16 + (1/16)*4*16/49) = 0.999365
 *    -> fp16 2047/2048 (0x3BFF).
 * The high-impact row 0 is reconstructed almost exactly; dsq on the same X
 * gave it 3.96 / 1.06.
 */
static void spatial_2x2_golden(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[2] = { 4, 4 };
    const float x[4] = { 4.0f, 1.0f, 1.0f, 1.0f };
    const float w[2] = { 4.0f, 0.25f };
    head_init(&h, STEPQ_METHOD_SPATIAL, STEPQ_ARCH_GDN, 2, 2, bits);
    quantize(&h, x, w);
    assert_int_equal(h.blk[0], 0xEE);
    assert_int_equal(h.blk[1], 0xB8);
    expect_row_scales(&h, (const uint16_t[]){ 0x3C00, 0x4000 });
    expect_col_scales(&h, (const uint16_t[]){ 0x4400, 0x3BFF });
    expect_xhat(&h, (const double[]){ 4.0, 0.99951171875, 2 * 4.0 / 7, 2 * 0.99951171875 * 4 / 7 });
    stepq__head_layout_free(&h.hl);
}

/*
 * temporal, KDA 4x3, rows at 4, pivot, 2 and 8 bits (row absmax scales):
 * row 0 [1, -0.5, 0.25]: r = 1, z = [7, rint(-3.5) = -4, rint(1.75) = 2],
 *   u = 14, 3, 9 -> bytes 0x3E, 0x09 (2-byte stream).
 * row 1 pivot [3.140625, -1, 0.5]: fp16 0x4248, 0xBC00, 0x3800 at byte 2.
 * row 2 [0.3, -0.6, 0.1], qmax 1: r = fp16(0.6) = 1229/2048 (0x38CD);
 *   z = [rint(0.49992) = 0, -1, rint(0.1666) = 0], u = 1, 0, 1 -> 0x11 at byte 8.
 * row 3 [2, 1, -1], qmax 127: r = 2, z = [127, rint(63.5) = 64, -64],
 *   u = 254, 191, 63 at bytes 9..11.
 */
static void temporal_kda_4x3_golden(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[4] = { 4, STEPQ_BITS_PIVOT, 2, 8 };
    const float x[12] = { 1, -0.5f, 0.25f, 3.140625f, -1, 0.5f, 0.3f, -0.6f, 0.1f, 2, 1, -1 };
    head_init(&h, STEPQ_METHOD_TEMPORAL, STEPQ_ARCH_KDA, 4, 3, bits);
    quantize(&h, x, NULL);
    const uint8_t codes[12] = { 0x3E, 0x09, 0x48, 0x42, 0x00, 0xBC,
                                0x00, 0x38, 0x11, 0xFE, 0xBF, 0x3F };
    assert_memory_equal(h.blk, codes, 12);
    expect_row_scales(&h, (const uint16_t[]){ 0x3C00, 0x0000, 0x38CD, 0x4000 });
    expect_xhat(&h, (const double[]){ 1, -4.0 / 7, 2.0 / 7, 3.140625, -1, 0.5, 0, -0.60009765625, 0,
                                      2, 2.0 * 64 / 127, -2.0 * 64 / 127 });
    stepq__head_layout_free(&h.hl);
}

/*
 * uniform, GDN 4x3 at 3 bits (qmax 3), with an all-zero row:
 * row 0 [0.5, -2, 0.125]: r = 2, z = rint(3 x / 2) = [rint(0.75) = 1, -3, rint(0.1875) = 0]
 * row 1 [1, 1, 1]: r = 1, z = [3, 3, 3]
 * row 2 zeros: r clamps to 2^-14 (0x0400), z = 0
 * row 3 [-3, 0.75, 0.25]: r = 3 (0x4200), z = [-3, rint(0.75) = 1, rint(0.25) = 0]
 */
static void uniform_4x3_golden_with_zero_row(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[4] = { 3, 3, 3, 3 };
    const float x[12] = { 0.5f, -2, 0.125f, 1, 1, 1, 0, 0, 0, -3, 0.75f, 0.25f };
    head_init(&h, STEPQ_METHOD_UNIFORM, STEPQ_ARCH_GDN, 4, 3, bits);
    quantize(&h, x, NULL);
    expect_row_codes(&h, 0, (const int8_t[]){ 1, -3, 0 });
    expect_row_codes(&h, 1, (const int8_t[]){ 3, 3, 3 });
    expect_row_codes(&h, 2, (const int8_t[]){ 0, 0, 0 });
    expect_row_codes(&h, 3, (const int8_t[]){ -3, 1, 0 });
    expect_row_scales(&h, (const uint16_t[]){ 0x4000, 0x3C00, 0x0400, 0x4200 });
    expect_xhat(&h, (const double[]){ 2.0 / 3, -2, 0, 1, 1, 1, 0, 0, 0, -3, 1, 0 });
    stepq__head_layout_free(&h.hl);
}

/*
 * dsq, GDN 4x3 at 5 bits (qmax 15), middle column all zero:
 * X = [[0.5, 0, -1], [2, 0, 0.25], [-0.125, 0, 4], [1, 0, -0.5]]
 * r = sqrt(absmax) = [1, fp16(sqrt 2) = 1.4140625, 2, 1]
 * step-2 c = column max of Y = X / r = [fp16(2/1.4140625), 0 -> 2^-14, 2], used
 * for the codes only: z = [[5, 0, -8], [15, 0, 1], [-1, 0, 15], [11, 0, -4]].
 * The zero column has den = 0: it keeps its step-2 value, clamped to 2^-14.
 * Refit: c0 -> 1.404296875 (0x3D9E), c2 -> 1.9912109375 (0x3FF7).
 */
static void dsq_4x3_golden_with_zero_column(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[4] = { 5, 5, 5, 5 };
    const float x[12] = { 0.5f, 0, -1, 2, 0, 0.25f, -0.125f, 0, 4, 1, 0, -0.5f };
    head_init(&h, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, 4, 3, bits);
    quantize(&h, x, NULL);
    expect_row_codes(&h, 0, (const int8_t[]){ 5, 0, -8 });
    expect_row_codes(&h, 1, (const int8_t[]){ 15, 0, 1 });
    expect_row_codes(&h, 2, (const int8_t[]){ -1, 0, 15 });
    expect_row_codes(&h, 3, (const int8_t[]){ 11, 0, -4 });
    expect_row_scales(&h, (const uint16_t[]){ 0x3C00, 0x3DA8, 0x4000, 0x3C00 });
    expect_col_scales(&h, (const uint16_t[]){ 0x3D9E, 0x0400, 0x3FF7 });
    expect_xhat(&h,
                (const double[]){ 0.4680989682674408, 0, -1.0619791746139526, 1.9857635498046875, 0,
                                  0.1877131313085556, -0.18723958730697632, 0, 3.982421875,
                                  1.0298177003860474, 0, -0.5309895873069763 });
    stepq__head_layout_free(&h.hl);
}

/*
 * spatial, the same X at 3 bits with w = [2, 0.5, 1, 1]:
 * r = sqrt(m / w) = [sqrt(0.5) -> 0.70703125, sqrt(4) = 2, 2, 1]
 * z = [[2, 0, -2], [3, 0, 0], [0, 0, 3], [3, 0, -1]]
 * refit (w^2 = 4, 0.25, 1, 1): c = [1.0185546875 (0x3C13), 2^-14, 2.009765625 (0x4005)]
 */
static void spatial_4x3_golden(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[4] = { 3, 3, 3, 3 };
    const float x[12] = { 0.5f, 0, -1, 2, 0, 0.25f, -0.125f, 0, 4, 1, 0, -0.5f };
    const float w[4] = { 2, 0.5f, 1, 1 };
    head_init(&h, STEPQ_METHOD_SPATIAL, STEPQ_ARCH_GDN, 4, 3, bits);
    quantize(&h, x, w);
    expect_row_codes(&h, 0, (const int8_t[]){ 2, 0, -2 });
    expect_row_codes(&h, 1, (const int8_t[]){ 3, 0, 0 });
    expect_row_codes(&h, 2, (const int8_t[]){ 0, 0, 3 });
    expect_row_codes(&h, 3, (const int8_t[]){ 3, 0, -1 });
    expect_row_scales(&h, (const uint16_t[]){ 0x39A8, 0x4000, 0x4000, 0x3C00 });
    expect_col_scales(&h, (const uint16_t[]){ 0x3C13, 0x0400, 0x4005 });
    expect_xhat(&h, (const double[]){ 0.48010000586509705, 0, -0.9473114013671875, 2.037109375, 0,
                                      0, 0, 0, 4.01953125, 1.0185546875, 0, -0.669921875 });
    stepq__head_layout_free(&h.hl);
}

/*
 * stepq, KDA 4x3 with rows at 4 bits, pivot, 6 bits, 8 bits sharing one
 * column-scale vector, w = [0.5, 4, 1, 0.5]:
 * X = [[2, -1, 0.5], [0.01, 0.02, -0.03], [-4, 8, 1], [0.5, 0.25, -0.125]]
 * r = sqrt(m / w) over integer rows = [sqrt(2/0.5) = 2, -, sqrt(8) -> 2.828125, sqrt(0.5/0.5) = 1]
 * c (step 2) = column max of X/r over rows 0, 2, 3 = [1.4142, 2.8287, 0.3536] in fp16
 * z: row 0 (qmax 7) [5, -1, 5]; row 2 (qmax 31) [-31, 31, 31]; row 3 (qmax 127) [45, 11, -45]
 * refit over rows 0, 2, 3 only: c = [0x3DA7, 0x41A9, 0x35A7]. The pivot row
 * is fp16 and has no scale (its row-scale slot is 0).
 */
static void stepq_kda_4x3_golden_mixed_bits_share_columns(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[4] = { 4, STEPQ_BITS_PIVOT, 6, 8 };
    const float x[12] = { 2, -1, 0.5f, 0.01f, 0.02f, -0.03f, -4, 8, 1, 0.5f, 0.25f, -0.125f };
    const float w[4] = { 0.5f, 4, 1, 0.5f };
    head_init(&h, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, 4, 3, bits);
    quantize(&h, x, w);
    expect_row_codes(&h, 0, (const int8_t[]){ 5, -1, 5 });
    expect_row_codes(&h, 2, (const int8_t[]){ -31, 31, 31 });
    expect_row_codes(&h, 3, (const int8_t[]){ 45, 11, -45 });
    expect_row_scales(&h, (const uint16_t[]){ 0x4000, 0x0000, 0x41A8, 0x3C00 });
    expect_col_scales(&h, (const uint16_t[]){ 0x3DA7, 0x41A9, 0x35A7 });
    expect_xhat(&h,
                (const double[]){ 2.0186941623687744, -0.8085938096046448, 0.5046735405921936,
                                  0.01000213623046875, 0.0200042724609375, -0.029998779296875,
                                  -3.9963836669921875, 8.003814697265625, 0.9990959167480469,
                                  0.5006997585296631, 0.24512489140033722, -0.12517493963241577 });
    stepq__head_layout_free(&h.hl);
}

/*
 * GDN heads of temporal / stepq at one integer width are uniform / spatial
 * heads (the methods differ only by per-unit widths and pivots); a 2x2 pivot
 * head stores fp16 values: [1/3, -2.5, 65504, 1e-8] -> 0x3555, 0xC100,
 * 0x7BFF, 0x0000 (1e-8 is below half the smallest subnormal), no scales.
 */
static void temporal_and_stepq_gdn_2x2_golden(void **state)
{
    (void)state;
    struct head a, b;
    const uint8_t bits[2] = { 4, 4 }, piv[2] = { STEPQ_BITS_PIVOT, STEPQ_BITS_PIVOT };
    const float x[4] = { 4.0f, 1.0f, 1.0f, 1.0f };
    const float w[2] = { 4.0f, 0.25f };

    head_init(&a, STEPQ_METHOD_TEMPORAL, STEPQ_ARCH_GDN, 2, 2, bits);
    head_init(&b, STEPQ_METHOD_UNIFORM, STEPQ_ARCH_GDN, 2, 2, bits);
    quantize(&a, x, NULL);
    quantize(&b, x, NULL);
    assert_int_equal(a.hl.block_bytes, b.hl.block_bytes);
    assert_memory_equal(a.blk, b.blk, a.hl.block_bytes);
    /* r = [4, 1]; z = rint(7 x / r) = [[7, rint(1.75) = 2], [7, 7]] -> u 14, 9, 14, 14 */
    assert_int_equal(a.blk[0], 0x9E);
    assert_int_equal(a.blk[1], 0xEE);
    stepq__head_layout_free(&a.hl);
    stepq__head_layout_free(&b.hl);

    head_init(&a, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 2, 2, bits);
    quantize(&a, x, w);
    assert_int_equal(a.blk[0], 0xEE); /* the spatial 2x2 golden above */
    assert_int_equal(a.blk[1], 0xB8);
    expect_col_scales(&a, (const uint16_t[]){ 0x4400, 0x3BFF });
    stepq__head_layout_free(&a.hl);

    const float y[4] = { 1.0f / 3, -2.5f, 65504.0f, 1e-8f };
    head_init(&a, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, 2, 2, piv);
    quantize(&a, y, w);
    assert_int_equal(rd16(a.blk), 0x3555);
    assert_int_equal(rd16(a.blk + 2), 0xC100);
    assert_int_equal(rd16(a.blk + 4), 0x7BFF);
    assert_int_equal(rd16(a.blk + 6), 0x0000);
    expect_row_scales(&a, (const uint16_t[]){ 0, 0 });
    expect_col_scales(&a, (const uint16_t[]){ 0, 0 });
    expect_xhat(&a, (const double[]){ 0.333251953125, -2.5, 65504.0, 0.0 });
    stepq__head_layout_free(&a.hl);
}

/* fp16 dense 2x2: 1/3 -> 0x3555, 65504 stays, 1e5 saturates to 65504 (flag). */
static void dense_fp16_bf16_fp32_blocks(void **state)
{
    (void)state;
    struct head h;
    const float x[4] = { 1.0f / 3, 65504.0f, -2.5f, 1e5f };
    uint32_t flags = 0;
    head_init(&h, STEPQ_METHOD_FP16, STEPQ_ARCH_GDN, 2, 2, NULL);
    assert_int_equal(stepq__quantize_head(&h.hl, x, NULL, h.blk, &flags), STEPQ_OK);
    assert_int_equal(flags, STEPQ_HEALTH_SATURATED);
    assert_int_equal(rd16(h.blk), 0x3555);
    assert_int_equal(rd16(h.blk + 2), 0x7BFF);
    assert_int_equal(rd16(h.blk + 4), 0xC100);
    assert_int_equal(rd16(h.blk + 6), 0x7BFF);
    stepq__head_layout_free(&h.hl);

    flags = 0;
    head_init(&h, STEPQ_METHOD_BF16, STEPQ_ARCH_GDN, 2, 2, NULL);
    assert_int_equal(stepq__quantize_head(&h.hl, x, NULL, h.blk, &flags), STEPQ_OK);
    assert_int_equal(flags, 0);
    assert_int_equal(rd16(h.blk), 0x3EAB); /* 1/3 = 0x3EAAAAAB -> nearest even 0x3EAB */
    stepq__head_layout_free(&h.hl);

    head_init(&h, STEPQ_METHOD_FP32, STEPQ_ARCH_GDN, 2, 2, NULL);
    quantize(&h, x, NULL);
    assert_memory_equal(h.xh, x, sizeof(x));
    stepq__head_layout_free(&h.hl);
}

/* --- properties --- */

/* A head with rows of very different magnitudes and a few column outliers. */
static void random_head(uint64_t *rng, float *x, int dk, int dv)
{
    for (int i = 0; i < dk; i++) {
        float amp = powf(10.0f, -3.0f + 4.0f * rng_unit(rng));
        for (int j = 0; j < dv; j++)
            x[i * dv + j] = amp * rng_sym(rng) * (j % 7 == 3 ? 8.0f : 1.0f);
    }
}

static void uniform_error_is_at_most_half_a_step(void **state)
{
    (void)state;
    static const int widths[] = { 2, 3, 4, 5, 6, 8 };
    enum { DK = 24, DV = 40 };
    uint64_t rng = 77;
    float x[DK * DV];
    uint8_t bits[DK];
    struct head h;

    for (int rep = 0; rep < 4; rep++) {
        random_head(&rng, x, DK, DV);
        for (size_t w = 0; w < 6; w++) {
            memset(bits, widths[w], sizeof(bits));
            head_init(&h, STEPQ_METHOD_UNIFORM, STEPQ_ARCH_GDN, DK, DV, bits);
            quantize(&h, x, NULL);
            for (int i = 0; i < DK; i++) {
                float r = stepq__fp16_to_float(rd16(h.blk + h.hl.row_scale_offset + 2 * i));
                double half = r / (2.0 * stepq__qmax(widths[w]));
                for (int j = 0; j < DV; j++)
                    assert_true(fabs((double)x[i * DV + j] - h.xh[i * DV + j]) <=
                                half * (1 + 1e-5));
            }
            stepq__head_layout_free(&h.hl);
        }
    }
}

static void dual_axis_fit_equals_dsq_when_all_w_are_one(void **state)
{
    (void)state;
    enum { DK = 16, DV = 24 };
    uint64_t rng = 5;
    float x[DK * DV], ones[DK];
    uint8_t bits[DK];
    struct head a, b, c;

    for (int i = 0; i < DK; i++)
        ones[i] = 1.0f;
    for (int bw = 2; bw <= 8; bw += 2) {
        random_head(&rng, x, DK, DV);
        memset(bits, bw, sizeof(bits));
        head_init(&a, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, DK, DV, bits);
        head_init(&b, STEPQ_METHOD_SPATIAL, STEPQ_ARCH_GDN, DK, DV, bits);
        head_init(&c, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, DK, DV, bits);
        quantize(&a, x, NULL);
        quantize(&b, x, ones);
        quantize(&c, x, ones);
        assert_memory_equal(a.blk, b.blk, a.hl.block_bytes);
        assert_memory_equal(a.blk, c.blk, a.hl.block_bytes);
        assert_true(stepq__weighted_sq_error(x, a.xh, ones, DK, DV) ==
                    stepq__weighted_sq_error(x, b.xh, ones, DK, DV));
        stepq__head_layout_free(&a.hl);
        stepq__head_layout_free(&b.hl);
        stepq__head_layout_free(&c.hl);
    }
}

/*
 * One small-magnitude row with a large impact factor (w_0 = 8, the others
 * 8^(-1/15) so the geometric mean is 1): dsq spends the column scales on the
 * big rows and rounds that row coarsely; the key-row-aware fit must give a
 * smaller w-weighted error, for every seed and bit width tried.
 */
static void dual_axis_fit_beats_dsq_on_a_high_impact_row(void **state)
{
    (void)state;
    enum { DK = 16, DV = 32 };
    uint64_t rng = 99;
    float x[DK * DV], w[DK];
    uint8_t bits[DK];
    struct head a, b;

    w[0] = 8.0f;
    for (int i = 1; i < DK; i++)
        w[i] = powf(8.0f, -1.0f / 15.0f);
    for (int seed = 0; seed < 8; seed++) {
        for (int i = 0; i < DK; i++)
            for (int j = 0; j < DV; j++)
                x[i * DV + j] = (i == 0 ? 0.02f : 1.0f) * rng_sym(&rng) * (j == 5 ? 6.0f : 1.0f);
        for (int bw = 3; bw <= 6; bw++) {
            memset(bits, bw, sizeof(bits));
            head_init(&a, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, DK, DV, bits);
            head_init(&b, STEPQ_METHOD_SPATIAL, STEPQ_ARCH_GDN, DK, DV, bits);
            quantize(&a, x, NULL);
            quantize(&b, x, w);
            double ea = stepq__weighted_sq_error(x, a.xh, w, DK, DV);
            double eb = stepq__weighted_sq_error(x, b.xh, w, DK, DV);
            assert_true(eb < ea);
            stepq__head_layout_free(&a.hl);
            stepq__head_layout_free(&b.hl);
        }
    }
}

static void more_bits_never_increase_error(void **state)
{
    (void)state;
    static const int widths[] = { 2, 3, 4, 5, 6, 8 };
    static const stepq_method methods[] = { STEPQ_METHOD_UNIFORM, STEPQ_METHOD_DSQ,
                                            STEPQ_METHOD_SPATIAL, STEPQ_METHOD_TEMPORAL,
                                            STEPQ_METHOD_STEPQ };
    enum { DK = 32, DV = 32 };
    uint64_t rng = 2024;
    float x[DK * DV], w[DK];
    uint8_t bits[DK];
    struct head h;

    for (int rep = 0; rep < 3; rep++) {
        random_head(&rng, x, DK, DV);
        double logsum = 0.0;
        for (int i = 0; i < DK; i++) {
            w[i] = 0.25f + 2.0f * rng_unit(&rng);
            logsum += log(w[i]);
        }
        for (int i = 0; i < DK; i++)
            w[i] *= (float)exp(-logsum / DK);
        for (size_t m = 0; m < sizeof(methods) / sizeof(methods[0]); m++) {
            for (int a = 0; a < 2; a++) {
                double prev = INFINITY;
                for (size_t b = 0; b < 6; b++) {
                    memset(bits, widths[b], sizeof(bits));
                    head_init(&h, methods[m], a ? STEPQ_ARCH_KDA : STEPQ_ARCH_GDN, DK, DV, bits);
                    quantize(&h, x, w);
                    double e = stepq__weighted_sq_error(x, h.xh, w, DK, DV);
                    assert_true(e <= prev);
                    prev = e;
                    stepq__head_layout_free(&h.hl);
                }
            }
        }
    }
}

/* Raising one KDA row from 4 to 8 bits shrinks that row's error. */
static void kda_row_with_more_bits_has_smaller_row_error(void **state)
{
    (void)state;
    enum { DK = 8, DV = 64 };
    uint64_t rng = 31;
    float x[DK * DV];
    uint8_t lo[DK], hi[DK];
    struct head a, b;

    random_head(&rng, x, DK, DV);
    memset(lo, 4, sizeof(lo));
    memcpy(hi, lo, sizeof(hi));
    hi[3] = 8;
    head_init(&a, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, lo);
    head_init(&b, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, hi);
    quantize(&a, x, NULL);
    quantize(&b, x, NULL);
    double ea = stepq__weighted_sq_error(x + 3 * DV, a.xh + 3 * DV, NULL, 1, DV);
    double eb = stepq__weighted_sq_error(x + 3 * DV, b.xh + 3 * DV, NULL, 1, DV);
    assert_true(eb < ea);
    assert_true(b.hl.codes_bytes == a.hl.codes_bytes + DV / 2);
    stepq__head_layout_free(&a.hl);
    stepq__head_layout_free(&b.hl);
}

static void quantize_overwrites_the_whole_block_deterministically(void **state)
{
    (void)state;
    enum { DK = 5, DV = 7 };
    uint64_t rng = 3;
    float x[DK * DV];
    uint8_t bits[DK] = { 3, STEPQ_BITS_PIVOT, 5, 2, 6 };
    struct head h;
    uint8_t first[MAXB];

    random_head(&rng, x, DK, DV);
    head_init(&h, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, bits);
    memset(h.blk, 0xA5, sizeof(h.blk));
    quantize(&h, x, NULL);
    memcpy(first, h.blk, h.hl.block_bytes);
    memset(h.blk, 0x5A, sizeof(h.blk));
    quantize(&h, x, NULL);
    assert_memory_equal(first, h.blk, h.hl.block_bytes);
    /* padding after the code stream and the unused pivot-row scale slot are 0 */
    for (size_t e = h.hl.codes_bytes; e < h.hl.row_scale_offset; e++)
        assert_int_equal(h.blk[e], 0);
    assert_int_equal(rd16(h.blk + h.hl.row_scale_offset + 2), 0);
    /* the block's end is respected */
    assert_int_equal(h.blk[h.hl.block_bytes], 0x5A);
    stepq__head_layout_free(&h.hl);
}

static void quantize_rejects_bad_row_impact_and_leaves_block(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[2] = { 4, 4 };
    const float x[4] = { 1, 2, 3, 4 };
    const float bad[2][2] = { { 1.0f, 0.0f }, { NAN, 1.0f } };

    head_init(&h, STEPQ_METHOD_SPATIAL, STEPQ_ARCH_GDN, 2, 2, bits);
    for (int t = 0; t < 2; t++) {
        memset(h.blk, 0x77, sizeof(h.blk));
        assert_int_equal(stepq__quantize_head(&h.hl, x, bad[t], h.blk, NULL), STEPQ_EINVAL);
        assert_non_null(strstr(stepq_last_error(), "row impact"));
        for (size_t e = 0; e < h.hl.block_bytes; e++)
            assert_int_equal(h.blk[e], 0x77);
    }
    assert_int_equal(stepq__quantize_head(NULL, x, NULL, h.blk, NULL), STEPQ_EINVAL);
    stepq__head_layout_free(&h.hl);
}

/*
 * fp8 round trip, per element: e4m3 keeps 3 mantissa bits, so a normal code is within half
 * an ulp, 2^-4 of the value; a subnormal code (|x / s| < 2^-6) within half its step 2^-9,
 * i.e. 2^-10 s. The division x / s and the product code * s each round once more (2^-24).
 */
#define FP8_REL_BOUND   0x1p-4  /* half an ulp of a 3-bit mantissa, relative */
#define FP8_SUB_BOUND   0x1p-10 /* half the subnormal step 2^-9, in units of the tile scale */
#define FP8_ROUND_SLACK 0x1p-20 /* the division and the product: 2 float roundings, with room */

static float fp8_scale(const struct head *h, int t)
{
    float s;
    memcpy(&s, h->blk + h->hl.tile_scale_offset + 4 * (size_t)t, sizeof(s));
    return s;
}

/*
 * fp8, GDN 2x3 (one short tile of 3 columns), X = [[2.4, -1.2, 0.3], [0, 0.7, -2]]:
 * s = 2.4 / 240 (float). X / s = 240, -120, 30, 0, 70.0000004, -200.000005 (float 200):
 * e4m3 240 = 0x77, -120 = 0xef, 30 = 0x5f, 0 = 0x00, 70 -> 72 = 0x69 (nearer), -200 is
 * the tie between 192 (mantissa 4, even) and 208: -192 = 0xf4.
 */
static void fp8_2x3_golden_with_a_tie(void **state)
{
    (void)state;
    struct head h;
    const float x[6] = { 2.4f, -1.2f, 0.3f, 0.0f, 0.7f, -2.0f };
    static const uint8_t want[6] = { 0x77, 0xef, 0x5f, 0x00, 0x69, 0xf4 };

    head_init(&h, STEPQ_METHOD_FP8, STEPQ_ARCH_GDN, 2, 3, NULL);
    assert_int_equal(h.hl.tile_scale_offset, 16);
    quantize(&h, x, NULL);
    assert_memory_equal(h.blk, want, 6);
    const float s = 2.4f / 240.0f;
    assert_true(fp8_scale(&h, 0) == s);
    static const float code[6] = { 240, -120, 30, 0, 72, -192 };
    for (int e = 0; e < 6; e++)
        assert_true(h.xh[e] == code[e] * s);
    /* padding after the codes and after the scale is written as 0 */
    for (size_t b = 6; b < 16; b++)
        assert_int_equal(h.blk[b], 0);
    for (size_t b = 20; b < h.hl.block_bytes; b++)
        assert_int_equal(h.blk[b], 0);
    stepq__head_layout_free(&h.hl);
}

/*
 * Tiles are 32 columns over every row: an all-zero tile has scale 0 and decodes to 0, one
 * whose amax / 240 underflows to 0 too (no division by 0, no NaN), one with a subnormal
 * scale stays finite and within the subnormal bound; the other tiles are not affected.
 */
static void fp8_zero_tiny_and_short_tiles(void **state)
{
    (void)state;
    enum { DK = 3, DV = 72 }; /* tiles of 32, 32 and 8 columns */
    struct head h;
    float x[DK * DV];
    uint64_t rng = 5;

    head_init(&h, STEPQ_METHOD_FP8, STEPQ_ARCH_KDA, DK, DV, NULL);
    for (int i = 0; i < DK; i++)
        for (int j = 0; j < DV; j++)
            x[i * DV + j] = j < 32 ? 0.0f : j < 64 ? 1e-44f * (float)(j & 1) : rng_sym(&rng);
    quantize(&h, x, NULL);
    assert_true(fp8_scale(&h, 0) == 0.0f);
    assert_true(fp8_scale(&h, 1) == 0.0f); /* 1e-44 / 240 underflows */
    assert_true(fp8_scale(&h, 2) > 0.0f);
    for (int i = 0; i < DK; i++)
        for (int j = 0; j < 64; j++) {
            assert_int_equal(h.blk[i * DV + j], 0);
            assert_true(h.xh[i * DV + j] == 0.0f);
        }

    /* A subnormal scale: amax 1e-40 gives s = 1e-40 / 240 ~ 4.2e-43, 300 ulps of the
     * smallest subnormal: x / s may pass 240 and saturates, the result stays finite. */
    for (int i = 0; i < DK; i++)
        for (int j = 0; j < 32; j++)
            x[i * DV + j] = 1e-40f * rng_sym(&rng);
    x[5] = 1e-40f;
    quantize(&h, x, NULL);
    float s = fp8_scale(&h, 0);
    assert_true(s > 0.0f && s < 0x1p-126f);
    for (int i = 0; i < DK; i++)
        for (int j = 0; j < 32; j++) {
            assert_true((h.blk[i * DV + j] & 0x7f) <= 0x77);
            assert_true(isfinite(h.xh[i * DV + j]));
            /* The usual bound, plus what the subnormal s costs: clamping x / s at 240 loses
             * up to 240 rounding steps of s (2^-150 each), the product one more. */
            double bound =
                FP8_REL_BOUND * fabsf(x[i * DV + j]) + FP8_SUB_BOUND * s + 241 * 0x1p-150;
            assert_true(fabs((double)h.xh[i * DV + j] - x[i * DV + j]) <= bound);
        }
    stepq__head_layout_free(&h.hl);
}

static void fp8_error_is_within_half_an_e4m3_ulp(void **state)
{
    (void)state;
    enum { DK = 32, DV = 64 }; /* two tiles; 2064 B fit the test's block */
    uint64_t rng = 808;
    static float x[DK * DV];
    struct head h;
    double worst = 0.0;

    head_init(&h, STEPQ_METHOD_FP8, STEPQ_ARCH_GDN, DK, DV, NULL);
    for (int rep = 0; rep < 8; rep++) {
        random_head(&rng, x, DK, DV); /* rows spread over 4 decades: subnormal codes too */
        quantize(&h, x, NULL);
        for (int e = 0; e < DK * DV; e++) {
            double s = fp8_scale(&h, (e % DV) / 32);
            double bound = (FP8_REL_BOUND * fabs(x[e]) + FP8_SUB_BOUND * s) * (1 + FP8_ROUND_SLACK);
            double err = fabs((double)h.xh[e] - x[e]);
            assert_true(err <= bound);
            worst = fmax(worst, err / bound);
        }
        /* The tile's largest element maps to 240 = code 0x77 exactly. */
        for (int t = 0; t < DV / 32; t++) {
            float m = 0.0f;
            for (int e = 0; e < DK * DV; e++)
                if ((e % DV) / 32 == t)
                    m = fmaxf(m, fabsf(x[e]));
            assert_true(fp8_scale(&h, t) == m / 240.0f);
        }
    }
    /* The bound is reached to within a few percent: it is the format's, not a loose one. */
    assert_true(worst > 0.9);
    stepq__head_layout_free(&h.hl);
}

/* NaN/Inf elements are stored as 0 (flag STATE); every stored scale stays finite. */
static void non_finite_elements_are_packed_as_zero(void **state)
{
    (void)state;
    static const stepq_method methods[] = { STEPQ_METHOD_FP32,     STEPQ_METHOD_BF16,
                                            STEPQ_METHOD_FP16,     STEPQ_METHOD_UNIFORM,
                                            STEPQ_METHOD_DSQ,      STEPQ_METHOD_SPATIAL,
                                            STEPQ_METHOD_TEMPORAL, STEPQ_METHOD_STEPQ,
                                            STEPQ_METHOD_FP8 };
    enum { DK = 4, DV = 6 };
    uint64_t rng = 11;
    float x[DK * DV], clean[DK * DV];
    uint8_t bits[DK] = { 4, 4, 4, 4 };
    struct head h;
    uint8_t ref[MAXB];

    rng_fill(&rng, x, DK * DV, 1.0f);
    memcpy(clean, x, sizeof(x));
    x[3] = NAN;
    x[10] = INFINITY;
    x[20] = -INFINITY;
    clean[3] = clean[10] = clean[20] = 0.0f;
    for (size_t m = 0; m < sizeof(methods) / sizeof(methods[0]); m++) {
        head_init(&h, methods[m], STEPQ_ARCH_GDN, DK, DV, bits);
        uint32_t flags = 0;
        assert_int_equal(stepq__quantize_head(&h.hl, clean, NULL, ref, &flags), STEPQ_OK);
        assert_int_equal(flags, 0);
        assert_int_equal(stepq__quantize_head(&h.hl, x, NULL, h.blk, &flags), STEPQ_OK);
        assert_int_equal(flags, STEPQ_HEALTH_STATE);
        assert_memory_equal(ref, h.blk, h.hl.block_bytes);
        assert_int_equal(stepq__dequantize_head(&h.hl, h.blk, h.xh), STEPQ_OK);
        for (int e = 0; e < DK * DV; e++)
            assert_true(isfinite(h.xh[e]));
        stepq__head_layout_free(&h.hl);
    }
}

/* A row absmax beyond 65504 clamps its scale and raises SATURATED, never Inf. */
static void huge_values_saturate_scales_and_are_flagged(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[2] = { 8, 8 };
    const float x[4] = { 1e6f, -3e5f, 1.0f, 0.5f };
    uint32_t flags = 0;
    head_init(&h, STEPQ_METHOD_UNIFORM, STEPQ_ARCH_GDN, 2, 2, bits);
    assert_int_equal(stepq__quantize_head(&h.hl, x, NULL, h.blk, &flags), STEPQ_OK);
    assert_int_equal(flags, STEPQ_HEALTH_SATURATED);
    assert_int_equal(rd16(h.blk + h.hl.row_scale_offset), 0x7BFF);
    assert_int_equal(stepq__dequantize_head(&h.hl, h.blk, h.xh), STEPQ_OK);
    assert_true(h.xh[0] == 65504.0f);
    stepq__head_layout_free(&h.hl);
}

/*
 * The row split (kernels/quant.h): a layout starts at 0.5, which gives the same block as
 * before the split existed; 1.0 normalises each row first, so a row 1/100 the size of the
 * others keeps its resolution (its error drops). The override is unset by default, refuses
 * values outside (0, 1] and, while set, wins over the layout's split.
 */
static void row_split_one_keeps_a_small_rows_resolution(void **state)
{
    (void)state;
    enum { DK = 4, DV = 8 };
    float x[DK * DV];
    for (int i = 0; i < DK; i++)
        for (int j = 0; j < DV; j++)
            x[i * DV + j] = (i == 3 ? 0.01f : 1.0f) * sinf(0.7f * (float)(i * DV + j) + 0.3f);
    struct head h, h1;
    head_init(&h, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, DK, DV, (const uint8_t[]){ 4, 4, 4, 4 });
    head_init(&h1, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, DK, DV, (const uint8_t[]){ 4, 4, 4, 4 });
    assert_true(h.hl.row_split == 0.5);
    assert_true(stepq__quant_row_split() == 0.0);
    assert_true(stepq__quant_row_split_of(&h.hl) == 0.5);
    quantize(&h, x, NULL);
    h1.hl.row_split = 1.0;
    assert_true(stepq__quant_row_split_of(&h1.hl) == 1.0);
    quantize(&h1, x, NULL);
    double e_half = 0, e_one = 0;
    for (int j = 0; j < DV; j++) {
        double a = h.xh[3 * DV + j] - x[3 * DV + j], b = h1.xh[3 * DV + j] - x[3 * DV + j];
        e_half += a * a;
        e_one += b * b;
    }
    assert_true(e_one < 0.25 * e_half);

    assert_int_equal(stepq__quant_set_row_split(0.0), STEPQ_EINVAL);
    assert_int_equal(stepq__quant_set_row_split(1.5), STEPQ_EINVAL);
    assert_int_equal(stepq__quant_set_row_split(NAN), STEPQ_EINVAL);
    assert_true(stepq__quant_row_split() == 0.0);
    assert_int_equal(stepq__quant_set_row_split(1.0), STEPQ_OK);
    assert_true(stepq__quant_row_split() == 1.0);
    assert_true(stepq__quant_row_split_of(&h.hl) == 1.0);
    stepq__quant_clear_row_split();
    assert_true(stepq__quant_row_split() == 0.0);
    stepq__head_layout_free(&h.hl);
    stepq__head_layout_free(&h1.hl);
}

/*
 * A layout whose row split is 0.75 packs the same bytes as a layout of 0.5 under the
 * override 0.75, and the override wins over a layout's split (0.5 over 0.75 gives the
 * 0.5 block), for every dual-axis method, with pivots and row impact.
 */
static void a_layouts_row_split_is_the_overrides(void **state)
{
    (void)state;
    enum { DK = 6, DV = 9 };
    static const stepq_method methods[] = { STEPQ_METHOD_DSQ, STEPQ_METHOD_SPATIAL,
                                            STEPQ_METHOD_STEPQ };
    uint64_t rng = 11;
    float x[DK * DV];
    const float w[DK] = { 2.0f, 0.5f, 1.25f, 0.8f, 1.0f, 1.0f };

    random_head(&rng, x, DK, DV);
    for (int i = 0; i < DK; i++) /* rows of very different sizes, as KDA's */
        for (int j = 0; j < DV; j++)
            x[i * DV + j] *= powf(10.0f, -(float)i / 2);
    for (size_t k = 0; k < sizeof(methods) / sizeof(methods[0]); k++) {
        const int stepq = methods[k] == STEPQ_METHOD_STEPQ;
        const uint8_t bits[DK] = { 4, 4, 4, 4, 4, 4 };
        const uint8_t mixed[DK] = { 3, STEPQ_BITS_PIVOT, 5, 2, 6, 4 };
        const stepq_arch arch = stepq ? STEPQ_ARCH_KDA : STEPQ_ARCH_GDN;
        const float *wk = methods[k] == STEPQ_METHOD_DSQ ? NULL : w;
        struct head a, b, c;
        head_init(&a, methods[k], arch, DK, DV, stepq ? mixed : bits);
        head_init(&b, methods[k], arch, DK, DV, stepq ? mixed : bits);
        head_init(&c, methods[k], arch, DK, DV, stepq ? mixed : bits);
        a.hl.row_split = 0.75;
        quantize(&a, x, wk);
        assert_int_equal(stepq__quant_set_row_split(0.75), STEPQ_OK);
        quantize(&b, x, wk);
        stepq__quant_clear_row_split();
        assert_memory_equal(a.blk, b.blk, a.hl.block_bytes);
        quantize(&c, x, wk); /* 0.5: another block */
        assert_true(memcmp(a.blk, c.blk, a.hl.block_bytes) != 0);
        assert_int_equal(stepq__quant_set_row_split(0.5), STEPQ_OK);
        quantize(&a, x, wk);
        stepq__quant_clear_row_split();
        assert_memory_equal(a.blk, c.blk, a.hl.block_bytes);
        stepq__head_layout_free(&a.hl);
        stepq__head_layout_free(&b.hl);
        stepq__head_layout_free(&c.hl);
    }
}

static void quantize_fit(struct head *h, const float *x, const float *w, stepq_decode_fit fit)
{
    uint32_t flags = 0;
    assert_int_equal(stepq__quantize_head_fit(&h->hl, x, w, NULL, h->blk, &flags, fit), STEPQ_OK);
    assert_int_equal(flags, 0);
    assert_int_equal(stepq__dequantize_head(&h->hl, h->blk, h->xh), STEPQ_OK);
}

/*
 * dsq_2x2_golden's X under the decode fit norefit: steps 1-3 as there (r = [2, 1],
 * c = [2, 1], the same code bytes 0xBE, 0xEB), no refit: the stored column scales are
 * step 2's, [2, 1] (0x4000, 0x3C00). x^ = r c z/7 = [[4, 8/7], [8/7, 1]].
 */
static void dsq_2x2_golden_norefit(void **state)
{
    (void)state;
    struct head h;
    const uint8_t bits[2] = { 4, 4 };
    const float x[4] = { 4.0f, 1.0f, 1.0f, 1.0f };
    head_init(&h, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, 2, 2, bits);
    quantize_fit(&h, x, NULL, STEPQ_DECODE_FIT_NOREFIT);
    assert_int_equal(h.blk[0], 0xBE);
    assert_int_equal(h.blk[1], 0xEB);
    expect_row_scales(&h, (const uint16_t[]){ 0x4000, 0x3C00 });
    expect_col_scales(&h, (const uint16_t[]){ 0x4000, 0x3C00 });
    expect_xhat(&h, (const double[]){ 4.0, 8.0 / 7, 8.0 / 7, 1.0 });
    stepq__head_layout_free(&h.hl);
}

/*
 * norefit against exact on the same head, for every dual-axis method with pivots, mixed
 * widths and row impact: the same bytes but the column scales (row scales, codes, pivot
 * rows, padding), the column scales fp16(max_i |x_ij / r_i|) over the integer rows with the
 * block's own r_i (recomputed here), the exact fit's differing from them somewhere; the
 * other methods ignore the fit; a head of pivot rows only stores column scales 0 either
 * way; a fit outside the list is refused and leaves the block.
 */
static void norefit_is_the_exact_fit_without_step_4(void **state)
{
    (void)state;
    enum { DK = 6, DV = 9 };
    static const stepq_method methods[] = { STEPQ_METHOD_DSQ, STEPQ_METHOD_SPATIAL,
                                            STEPQ_METHOD_STEPQ };
    uint64_t rng = 23;
    float x[DK * DV];
    const float w[DK] = { 2.0f, 0.5f, 1.25f, 0.8f, 1.0f, 1.0f };

    random_head(&rng, x, DK, DV);
    for (size_t k = 0; k < sizeof(methods) / sizeof(methods[0]); k++) {
        const int stepq = methods[k] == STEPQ_METHOD_STEPQ;
        const uint8_t bits[DK] = { 5, 5, 5, 5, 5, 5 };
        const uint8_t mixed[DK] = { 3, STEPQ_BITS_PIVOT, 5, 2, 6, 4 };
        const stepq_arch arch = stepq ? STEPQ_ARCH_KDA : STEPQ_ARCH_GDN;
        const float *wk = methods[k] == STEPQ_METHOD_DSQ ? NULL : w;
        struct head a, b;
        head_init(&a, methods[k], arch, DK, DV, stepq ? mixed : bits);
        head_init(&b, methods[k], arch, DK, DV, stepq ? mixed : bits);
        quantize_fit(&a, x, wk, STEPQ_DECODE_FIT_NOREFIT);
        quantize_fit(&b, x, wk, STEPQ_DECODE_FIT_EXACT);
        const size_t c0 = a.hl.col_scale_offset, c1 = c0 + 2 * (size_t)DV;
        assert_memory_equal(a.blk, b.blk, c0);
        assert_memory_equal(a.blk + c1, b.blk + c1, a.hl.block_bytes - c1);
        int differ = 0;
        for (int j = 0; j < DV; j++) {
            float m = 0.0f;
            for (int i = 0; i < DK; i++) {
                if (a.hl.row_bits[i] == STEPQ_BITS_PIVOT)
                    continue;
                float r = stepq__fp16_to_float(rd16(a.blk + a.hl.row_scale_offset + 2 * i));
                m = fmaxf(m, fabsf(x[i * DV + j] / r));
            }
            assert_int_equal(rd16(a.blk + c0 + 2 * j), stepq__scale_to_fp16(m));
            differ += rd16(a.blk + c0 + 2 * j) != rd16(b.blk + c0 + 2 * j);
        }
        assert_true(differ > 0);
        /* exact is stepq__quantize_head */
        quantize(&a, x, wk);
        assert_memory_equal(a.blk, b.blk, a.hl.block_bytes);
        /* refused: the block as it was */
        assert_int_equal(
            stepq__quantize_head_fit(&a.hl, x, wk, NULL, a.blk, NULL, STEPQ_DECODE_FIT_COUNT),
            STEPQ_EINVAL);
        assert_memory_equal(a.blk, b.blk, a.hl.block_bytes);
        stepq__head_layout_free(&a.hl);
        stepq__head_layout_free(&b.hl);
    }

    /* Pivot rows only (a GDN pivot head): no integer row, column scales 0 either way. */
    {
        const uint8_t piv[DK] = { STEPQ_BITS_PIVOT, STEPQ_BITS_PIVOT, STEPQ_BITS_PIVOT,
                                  STEPQ_BITS_PIVOT, STEPQ_BITS_PIVOT, STEPQ_BITS_PIVOT };
        struct head a, b;
        head_init(&a, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, DK, DV, piv);
        head_init(&b, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, DK, DV, piv);
        quantize_fit(&a, x, w, STEPQ_DECODE_FIT_NOREFIT);
        quantize_fit(&b, x, w, STEPQ_DECODE_FIT_EXACT);
        assert_memory_equal(a.blk, b.blk, a.hl.block_bytes);
        for (int j = 0; j < DV; j++)
            assert_int_equal(rd16(a.blk + a.hl.col_scale_offset + 2 * j), 0);
        stepq__head_layout_free(&a.hl);
        stepq__head_layout_free(&b.hl);
    }

    /* Methods without column scales: the fit changes nothing. */
    {
        const uint8_t mixed[DK] = { 3, STEPQ_BITS_PIVOT, 5, 2, 6, 4 };
        struct head a, b;
        head_init(&a, STEPQ_METHOD_TEMPORAL, STEPQ_ARCH_KDA, DK, DV, mixed);
        head_init(&b, STEPQ_METHOD_TEMPORAL, STEPQ_ARCH_KDA, DK, DV, mixed);
        quantize_fit(&a, x, NULL, STEPQ_DECODE_FIT_NOREFIT);
        quantize_fit(&b, x, NULL, STEPQ_DECODE_FIT_EXACT);
        assert_memory_equal(a.blk, b.blk, a.hl.block_bytes);
        stepq__head_layout_free(&a.hl);
        stepq__head_layout_free(&b.hl);
    }
}

static void wr16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, 2);
}

/* The fit rows of x against the column scales of `old`; the flags it raised in *fl. */
static void quantize_rows(struct head *h, const float *x, const float *w, const uint8_t *old,
                          uint32_t *fl)
{
    *fl = 0;
    assert_int_equal(stepq__quantize_head_fit(&h->hl, x, w, old, h->blk, fl, STEPQ_DECODE_FIT_ROWS),
                     STEPQ_OK);
    assert_int_equal(stepq__dequantize_head(&h->hl, h->blk, h->xh), STEPQ_OK);
}

/*
 * The decode fit rows on a dsq GDN 2x2 head at 4 bits (qmax 7), the old block's column
 * scales c = [2, 0.5] (0x4000, 0x3800), so rc = RN(1/c) = [0.5, 2], its row scales
 * [1, 0x3D56 = 1.333984375], X = [[2, 0.25], [1, -1]]:
 * 1. |X| rc = [[1, 0.5], [0.5, 2]]: m = [1, 2], r = [1, 2] (0x3C00, 0x4000); row 1 grew by
 *    2 / 1.333984375 = 1.49927, not past 1.5 (2 <= 1.5f * 1.333984375 = 2.0009765625).
 * 2. s = 7 / r = [7, 3.5]; z = rint(X rc s) = [[7, rint(3.5) = 4], [rint(1.75) = 2, -7]];
 *    u = z + 7 = 14, 11, 9, 0 -> bytes 0xBE, 0x09.
 * 3. c as it was: 0x4000, 0x3800.
 * x^ = r c z/7 = [[2, 2/7], [8/7, -1]]. The row impact does not enter: the same bytes with w.
 * The growth trigger: with row 1's old scale one fp16 step lower, 0x3D55 = 1.3330078125
 * (1.5f * it = 1.99951171875 < 2 = m_1), the head takes the exact fit (its bytes); an old row
 * scale 0 (here with valid column scales) falls back likewise.
 */
static void dsq_2x2_golden_rows(void **state)
{
    (void)state;
    struct head h;
    uint8_t old[MAXB];
    uint32_t fl;
    const uint8_t bits[2] = { 4, 4 };
    const float x[4] = { 2.0f, 0.25f, 1.0f, -1.0f }, w[2] = { 4.0f, 0.25f };
    head_init(&h, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, 2, 2, bits);
    memset(old, 0, sizeof(old));
    wr16(old + h.hl.col_scale_offset, 0x4000);
    wr16(old + h.hl.col_scale_offset + 2, 0x3800);
    wr16(old + h.hl.row_scale_offset, 0x3C00);
    wr16(old + h.hl.row_scale_offset + 2, 0x3D56);
    quantize_rows(&h, x, NULL, old, &fl);
    assert_int_equal(fl, 0);
    assert_int_equal(h.blk[0], 0xBE);
    assert_int_equal(h.blk[1], 0x09);
    expect_row_codes(&h, 0, (const int8_t[]){ 7, 4 });
    expect_row_codes(&h, 1, (const int8_t[]){ 2, -7 });
    expect_row_scales(&h, (const uint16_t[]){ 0x3C00, 0x4000 });
    expect_col_scales(&h, (const uint16_t[]){ 0x4000, 0x3800 });
    expect_xhat(&h, (const double[]){ 2.0, 2.0 / 7, 8.0 / 7, -1.0 });
    /* spatial with w: w is not used */
    struct head g;
    head_init(&g, STEPQ_METHOD_SPATIAL, STEPQ_ARCH_GDN, 2, 2, bits);
    quantize_rows(&g, x, w, old, &fl);
    assert_memory_equal(g.blk, h.blk, h.hl.block_bytes);
    /* in place: old is the block itself */
    memcpy(g.blk, old, g.hl.block_bytes);
    assert_int_equal(
        stepq__quantize_head_fit(&g.hl, x, w, g.blk, g.blk, &fl, STEPQ_DECODE_FIT_ROWS), STEPQ_OK);
    assert_memory_equal(g.blk, h.blk, h.hl.block_bytes);
    /* row 1 grew past 1.5x its old scale (or the old scale is 0): the exact fit's bytes */
    struct head e;
    head_init(&e, STEPQ_METHOD_DSQ, STEPQ_ARCH_GDN, 2, 2, bits);
    quantize(&e, x, NULL);
    assert_true(memcmp(e.blk, h.blk, e.hl.block_bytes) != 0);
    static const uint16_t grown[2] = { 0x3D55, 0x0000 };
    for (int k = 0; k < 2; k++) {
        wr16(old + h.hl.row_scale_offset + 2, grown[k]);
        quantize_rows(&h, x, NULL, old, &fl);
        assert_int_equal(fl, 0);
        assert_memory_equal(h.blk, e.blk, e.hl.block_bytes);
    }
    stepq__head_layout_free(&e.hl);
    stepq__head_layout_free(&g.hl);
    stepq__head_layout_free(&h.hl);
}

/*
 * The fit rows for every dual-axis method with pivots, mixed widths and row impact, the old
 * block the exact fit of a nearby state (no row grows past STEPQ__ROWS_GROW times its old scale,
 * asserted): the column scales are the old block's, bit for bit;
 * every integer row's scale is fp16(max_j |x_ij| RN(1/c_j)) (recomputed here), its codes
 * within +-qmax_i, and every element reconstructed within half a step r_i c_j / qmax_i (an
 * element at the clamp, within 2^-10 |x| of it); the pivot rows are the exact fit's; the
 * block differs from both the exact and the norefit fit of the same state.
 */
static void rows_keeps_the_old_columns_and_refits_the_rows(void **state)
{
    (void)state;
    enum { DK = 6, DV = 9 };
    static const stepq_method methods[] = { STEPQ_METHOD_DSQ, STEPQ_METHOD_SPATIAL,
                                            STEPQ_METHOD_STEPQ };
    uint64_t rng = 41;
    float x0[DK * DV], x[DK * DV];
    const float w[DK] = { 2.0f, 0.5f, 1.25f, 0.8f, 1.0f, 1.0f };

    random_head(&rng, x0, DK, DV);
    for (int e = 0; e < DK * DV; e++) /* the next state: near the old one, a column drifted */
        x[e] = x0[e] * (1.0f + 0.1f * rng_sym(&rng)) * ((e % DV) == 5 ? 1.2f : 1.0f);
    for (size_t k = 0; k < sizeof(methods) / sizeof(methods[0]); k++) {
        const int stepq = methods[k] == STEPQ_METHOD_STEPQ;
        const uint8_t bits[DK] = { 5, 5, 5, 5, 5, 5 };
        const uint8_t mixed[DK] = { 3, STEPQ_BITS_PIVOT, 5, 2, 6, 4 };
        const stepq_arch arch = stepq ? STEPQ_ARCH_KDA : STEPQ_ARCH_GDN;
        const uint8_t *bk = stepq ? mixed : bits;
        const float *wk = methods[k] == STEPQ_METHOD_DSQ ? NULL : w;
        struct head o, a, b, n;
        uint32_t fl;
        head_init(&o, methods[k], arch, DK, DV, bk);
        head_init(&a, methods[k], arch, DK, DV, bk);
        head_init(&b, methods[k], arch, DK, DV, bk);
        head_init(&n, methods[k], arch, DK, DV, bk);
        quantize(&o, x0, wk);
        quantize_rows(&a, x, wk, o.blk, &fl);
        assert_int_equal(fl, 0);
        quantize(&b, x, wk);
        quantize_fit(&n, x, wk, STEPQ_DECODE_FIT_NOREFIT);
        const size_t c0 = a.hl.col_scale_offset;
        assert_memory_equal(a.blk + c0, o.blk + c0, 2 * (size_t)DV);
        float c[DV], rc[DV];
        for (int j = 0; j < DV; j++) {
            c[j] = stepq__fp16_to_float(rd16(o.blk + c0 + 2 * j));
            rc[j] = 1.0f / c[j];
        }
        for (int i = 0; i < DK; i++) {
            const int bi = a.hl.row_bits[i];
            if (bi == STEPQ_BITS_PIVOT) {
                assert_memory_equal(a.blk + a.hl.row_bitoff[i] / 8, b.blk + b.hl.row_bitoff[i] / 8,
                                    2 * (size_t)DV);
                continue;
            }
            float m = 0.0f;
            for (int j = 0; j < DV; j++)
                m = fmaxf(m, fabsf(x[i * DV + j]) * rc[j]);
            /* within the growth trigger (else the exact fit): the rows path ran */
            const float ro = stepq__fp16_to_float(rd16(o.blk + o.hl.row_scale_offset + 2 * i));
            assert_true(m <= STEPQ__ROWS_GROW * ro);
            const uint16_t rh = rd16(a.blk + a.hl.row_scale_offset + 2 * i);
            assert_int_equal(rh, stepq__scale_to_fp16(m));
            const float r = stepq__fp16_to_float(rh);
            const int qmax = stepq__qmax(bi);
            int8_t z[DV];
            stepq__unpack_codes(a.blk, a.hl.row_bitoff[i], z, DV, bi);
            for (int j = 0; j < DV; j++) {
                assert_true(z[j] >= -qmax && z[j] <= qmax);
                const double step = (double)r * c[j] / qmax;
                const double err = fabs((double)x[i * DV + j] - a.xh[i * DV + j]);
                const double y = fabs((double)x[i * DV + j] * rc[j] * qmax / r);
                if (y <= qmax)
                    assert_true(err <= step * (0.5 + 1e-5));
                else
                    assert_true(err <= fabs((double)x[i * DV + j]) / 1024);
            }
        }
        assert_true(memcmp(a.blk, b.blk, a.hl.block_bytes) != 0);
        assert_true(memcmp(a.blk, n.blk, a.hl.block_bytes) != 0);
        /* without the old block: refused, the block as it was */
        memcpy(n.blk, a.blk, a.hl.block_bytes);
        assert_int_equal(
            stepq__quantize_head_fit(&n.hl, x, wk, NULL, n.blk, NULL, STEPQ_DECODE_FIT_ROWS),
            STEPQ_EINVAL);
        assert_memory_equal(n.blk, a.blk, a.hl.block_bytes);
        stepq__head_layout_free(&o.hl);
        stepq__head_layout_free(&a.hl);
        stepq__head_layout_free(&b.hl);
        stepq__head_layout_free(&n.hl);
    }
}

/*
 * Where the old block cannot serve, the fit rows is the exact fit, bytes and flags: a zero
 * page, one column scale 0, one Inf or negative, a row whose scale would saturate (m_i = 1e9
 * rc_j; the exact fit's sqrt split does not saturate: no flag), a head of pivot rows only. A
 * non-finite element does not decide it: it is zeroed (flag STATE) and the rows fit serves
 * the sanitised state (a state near the old block's: no row grows past the trigger), the bytes
 * of the rows fit of the state with a 0 there.
 */
static void rows_falls_back_to_the_exact_fit(void **state)
{
    (void)state;
    enum { DK = 6, DV = 9 };
    uint64_t rng = 43;
    float x0[DK * DV], x[DK * DV];
    const float w[DK] = { 2.0f, 0.5f, 1.25f, 0.8f, 1.0f, 1.0f };
    const uint8_t mixed[DK] = { 3, STEPQ_BITS_PIVOT, 5, 2, 6, 4 };
    const uint8_t piv[DK] = { STEPQ_BITS_PIVOT, STEPQ_BITS_PIVOT, STEPQ_BITS_PIVOT,
                              STEPQ_BITS_PIVOT, STEPQ_BITS_PIVOT, STEPQ_BITS_PIVOT };
    struct head o, a, b;
    uint32_t fa, fb;

    random_head(&rng, x0, DK, DV);
    for (int e = 0; e < DK * DV; e++) /* near x0: the rows fit serves it (kase 4) */
        x[e] = x0[e] * (1.0f + 0.1f * rng_sym(&rng));
    for (int kase = 0; kase < 7; kase++) {
        const uint8_t *bk = kase == 6 ? piv : mixed;
        float xs[DK * DV];
        memcpy(xs, x, sizeof(xs));
        head_init(&o, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, bk);
        head_init(&a, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, bk);
        head_init(&b, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, bk);
        quantize(&o, x0, w);
        const size_t c0 = o.hl.col_scale_offset;
        switch (kase) {
        case 0:
            memset(o.blk, 0, o.hl.block_bytes);
            break;
        case 1:
            wr16(o.blk + c0 + 2 * 4, 0x0000);
            break;
        case 2:
            wr16(o.blk + c0 + 2 * 8, 0x7C00);
            break;
        case 3:
            wr16(o.blk + c0 + 2 * 2, 0xBC00);
            break;
        case 4:
            xs[3 * DV + 1] = NAN;
            break;
        case 5:
            xs[2 * DV + 7] = 1e9f;
            break;
        default:
            break;
        }
        quantize_rows(&a, xs, w, o.blk, &fa);
        fb = 0;
        if (kase == 4) { /* the rows fit of the sanitised state, flagged */
            xs[3 * DV + 1] = 0.0f;
            quantize_rows(&b, xs, w, o.blk, &fb);
            assert_int_equal(fb, 0);
            fb = STEPQ_HEALTH_STATE;
            struct head e;
            head_init(&e, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, bk);
            quantize(&e, xs, w);
            assert_true(memcmp(e.blk, b.blk, e.hl.block_bytes) != 0); /* not the exact fit */
            stepq__head_layout_free(&e.hl);
        } else {
            assert_int_equal(stepq__quantize_head(&b.hl, xs, w, b.blk, &fb), STEPQ_OK);
        }
        assert_memory_equal(a.blk, b.blk, a.hl.block_bytes);
        assert_int_equal(fa, fb);
        assert_int_equal(fa, kase == 4 ? STEPQ_HEALTH_STATE : 0);
        stepq__head_layout_free(&o.hl);
        stepq__head_layout_free(&a.hl);
        stepq__head_layout_free(&b.hl);
    }
}

/*
 * The growth trigger: the old block the exact fit of x0, the new state x0 with row 2 scaled so
 * that its m_2 = max_j |x_2j| RN(1/c_j) is 1.5 (1 +- 1e-3) times the old r_2 (every other row
 * within 1.5x, asserted). Past it: the exact fit's bytes; just below: the rows fit (the old
 * column scales, r_2 = fp16(m_2), not the exact fit's bytes). Pivot rows do not take part: a
 * pivot row scaled by 10 changes nothing in the decision.
 */
static void rows_falls_back_where_a_row_grows_past_its_old_scale(void **state)
{
    (void)state;
    enum { DK = 6, DV = 9 };
    uint64_t rng = 47;
    float x0[DK * DV];
    const float w[DK] = { 2.0f, 0.5f, 1.25f, 0.8f, 1.0f, 1.0f };
    const uint8_t mixed[DK] = { 3, STEPQ_BITS_PIVOT, 5, 2, 6, 4 };
    struct head o, a, b;

    random_head(&rng, x0, DK, DV);
    head_init(&o, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, mixed);
    head_init(&a, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, mixed);
    head_init(&b, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, DK, DV, mixed);
    quantize(&o, x0, w);
    float rc[DV], m[DK], ro[DK];
    for (int j = 0; j < DV; j++)
        rc[j] = 1.0f / stepq__fp16_to_float(rd16(o.blk + o.hl.col_scale_offset + 2 * j));
    for (int i = 0; i < DK; i++) {
        m[i] = 0.0f;
        for (int j = 0; j < DV; j++)
            m[i] = fmaxf(m[i], fabsf(x0[i * DV + j]) * rc[j]);
        ro[i] = stepq__fp16_to_float(rd16(o.blk + o.hl.row_scale_offset + 2 * i));
        if (mixed[i] != STEPQ_BITS_PIVOT)
            assert_true(m[i] <= 1.4f * ro[i]); /* the old state itself: the rows fit serves */
    }
    for (int kase = 0; kase < 2; kase++) {
        float x[DK * DV];
        const float f = 1.5f * ro[2] / m[2] * (kase ? 1.001f : 0.999f);
        for (int e = 0; e < DK * DV; e++)
            x[e] = x0[e] * (e / DV == 2 ? f : e / DV == 1 ? 10.0f : 1.0f);
        float m2 = 0.0f;
        for (int j = 0; j < DV; j++)
            m2 = fmaxf(m2, fabsf(x[2 * DV + j]) * rc[j]);
        assert_true(kase ? m2 > STEPQ__ROWS_GROW * ro[2] : m2 <= STEPQ__ROWS_GROW * ro[2]);
        uint32_t fa, fb = 0;
        quantize_rows(&a, x, w, o.blk, &fa);
        assert_int_equal(stepq__quantize_head(&b.hl, x, w, b.blk, &fb), STEPQ_OK);
        assert_int_equal(fa, fb);
        if (kase) { /* grown: the exact fit */
            assert_memory_equal(a.blk, b.blk, a.hl.block_bytes);
        } else { /* the rows fit */
            const size_t c0 = a.hl.col_scale_offset;
            assert_memory_equal(a.blk + c0, o.blk + c0, 2 * (size_t)DV);
            assert_int_equal(rd16(a.blk + a.hl.row_scale_offset + 4), stepq__scale_to_fp16(m2));
            assert_true(memcmp(a.blk, b.blk, a.hl.block_bytes) != 0);
        }
    }
    stepq__head_layout_free(&o.hl);
    stepq__head_layout_free(&a.hl);
    stepq__head_layout_free(&b.hl);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(uniform_2x2_golden),
        cmocka_unit_test(dsq_2x2_golden),
        cmocka_unit_test(spatial_2x2_golden),
        cmocka_unit_test(temporal_kda_4x3_golden),
        cmocka_unit_test(uniform_4x3_golden_with_zero_row),
        cmocka_unit_test(dsq_4x3_golden_with_zero_column),
        cmocka_unit_test(spatial_4x3_golden),
        cmocka_unit_test(stepq_kda_4x3_golden_mixed_bits_share_columns),
        cmocka_unit_test(temporal_and_stepq_gdn_2x2_golden),
        cmocka_unit_test(dense_fp16_bf16_fp32_blocks),
        cmocka_unit_test(uniform_error_is_at_most_half_a_step),
        cmocka_unit_test(dual_axis_fit_equals_dsq_when_all_w_are_one),
        cmocka_unit_test(dual_axis_fit_beats_dsq_on_a_high_impact_row),
        cmocka_unit_test(more_bits_never_increase_error),
        cmocka_unit_test(kda_row_with_more_bits_has_smaller_row_error),
        cmocka_unit_test(quantize_overwrites_the_whole_block_deterministically),
        cmocka_unit_test(quantize_rejects_bad_row_impact_and_leaves_block),
        cmocka_unit_test(non_finite_elements_are_packed_as_zero),
        cmocka_unit_test(huge_values_saturate_scales_and_are_flagged),
        cmocka_unit_test(fp8_2x3_golden_with_a_tie),
        cmocka_unit_test(fp8_zero_tiny_and_short_tiles),
        cmocka_unit_test(fp8_error_is_within_half_an_e4m3_ulp),
        cmocka_unit_test(row_split_one_keeps_a_small_rows_resolution),
        cmocka_unit_test(a_layouts_row_split_is_the_overrides),
        cmocka_unit_test(dsq_2x2_golden_norefit),
        cmocka_unit_test(norefit_is_the_exact_fit_without_step_4),
        cmocka_unit_test(dsq_2x2_golden_rows),
        cmocka_unit_test(rows_keeps_the_old_columns_and_refits_the_rows),
        cmocka_unit_test(rows_falls_back_to_the_exact_fit),
        cmocka_unit_test(rows_falls_back_where_a_row_grows_past_its_old_scale),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
