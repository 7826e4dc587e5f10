/*
 * Head block layouts, fp16/bf16 conversion and bit-stream packing
 * (the storage contract is written down in kernels/format.h).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/format.h"
#include "plugin/err.h"
#include "plugin/vocab.h"

/* The element type of a dense method's block. */
static stepq_dtype dense_dtype(stepq_method m)
{
    return m == STEPQ_METHOD_FP32   ? STEPQ_DTYPE_FP32
           : m == STEPQ_METHOD_BF16 ? STEPQ_DTYPE_BF16
                                    : STEPQ_DTYPE_FP16;
}

static int method_is_dense(stepq_method m)
{
    return m == STEPQ_METHOD_FP32 || m == STEPQ_METHOD_BF16 || m == STEPQ_METHOD_FP16;
}

static int method_has_col(stepq_method m)
{
    return m == STEPQ_METHOD_DSQ || m == STEPQ_METHOD_SPATIAL || m == STEPQ_METHOD_STEPQ;
}

static size_t align_up(size_t x, size_t a)
{
    return (x + a - 1) & ~(a - 1);
}

int stepq__format_int_bits(int bits)
{
    return (bits >= 2 && bits <= 6) || bits == 8;
}

int stepq__head_layout_init(struct stepq__head_layout *hl, stepq_method method, stepq_arch arch,
                            int d_k, int d_v, const uint8_t *row_bits, size_t align)
{
    if (!hl)
        return stepq__error(STEPQ_EINVAL, "head layout: NULL output");
    memset(hl, 0, sizeof(*hl));
    if ((int)method < 0 || method >= STEPQ_METHOD_COUNT)
        return stepq__error(STEPQ_EINVAL, "head layout: method %d is not a stepq_method",
                            (int)method);
    if (arch != STEPQ_ARCH_GDN && arch != STEPQ_ARCH_KDA)
        return stepq__error(STEPQ_EINVAL, "head layout: arch %d is neither gdn nor kda", (int)arch);
    if (d_k < 1 || d_k > STEPQ__MAX_HEAD_DIM || d_v < 1 || d_v > STEPQ__MAX_HEAD_DIM)
        return stepq__error(STEPQ_EINVAL, "head layout: d_k=%d, d_v=%d outside 1..%d", d_k, d_v,
                            STEPQ__MAX_HEAD_DIM);
    if (align == 0)
        align = STEPQ__ALIGN_DEFAULT;
    if (align & (align - 1))
        return stepq__error(STEPQ_EINVAL, "head layout: align %zu is not a power of two", align);

    int dense = method_is_dense(method), fp8 = method == STEPQ_METHOD_FP8;
    if (!dense && !fp8) {
        if (!row_bits)
            return stepq__error(STEPQ_EINVAL, "head layout: %s needs row_bits",
                                stepq_method_name(method));
        for (int i = 0; i < d_k; i++) {
            int b = row_bits[i];
            if (!stepq__format_int_bits(b) && b != STEPQ_BITS_PIVOT)
                return stepq__error(STEPQ_EINVAL,
                                    "head layout: row_bits[%d]: %d is not one of 2,3,4,5,6,8,16", i,
                                    b);
            if (b == STEPQ_BITS_PIVOT && !stepq__method_has_pivots(method))
                return stepq__error(STEPQ_EINVAL,
                                    "head layout: row_bits[%d]: method %s has no pivots", i,
                                    stepq_method_name(method));
            if (b != row_bits[0] && (arch == STEPQ_ARCH_GDN || !stepq__method_has_pivots(method)))
                return stepq__error(STEPQ_EINVAL,
                                    "head layout: row_bits[%d]=%d differs from row_bits[0]=%d, but "
                                    "%s",
                                    i, b, row_bits[0],
                                    arch == STEPQ_ARCH_GDN ? "a GDN head has one format"
                                                           : "this method has one bit width");
        }
    }

    /* One allocation for both arrays. */
    size_t nbits = sizeof(uint64_t) * (size_t)(d_k + 1);
    void *mem = malloc(nbits + (size_t)d_k);
    if (!mem)
        return stepq__error(STEPQ_ENOMEM, "head layout: out of memory");
    hl->row_bitoff = mem;
    hl->row_bits = (uint8_t *)mem + nbits;
    hl->method = method;
    hl->arch = arch;
    hl->d_k = d_k;
    hl->d_v = d_v;
    hl->align = align;
    hl->row_split = 0.5;
    hl->decode_fit = STEPQ_DECODE_FIT_EXACT;
    hl->arith = STEPQ_ARITH_FP32;
    hl->quantized = !dense;
    hl->has_col = method_has_col(method);

    if (fp8) {
        /* One byte per value, row-major, then the tile scales (kernels/format.h). */
        memset(hl->row_bits, 0, (size_t)d_k);
        for (int i = 0; i <= d_k; i++)
            hl->row_bitoff[i] = (uint64_t)i * (uint64_t)d_v * 8;
        hl->codes_bytes = (size_t)d_k * (size_t)d_v;
        hl->tile_scale_offset = align_up(hl->codes_bytes, align);
        size_t scales = 4 * (size_t)stepq__fp8_tiles(d_v);
        hl->block_bytes = align_up(hl->tile_scale_offset + scales, align);
        hl->compact_bytes = hl->codes_bytes + scales;
        return STEPQ_OK;
    }
    if (dense) {
        size_t es = stepq_dtype_size(dense_dtype(method));
        memset(hl->row_bits, 0, (size_t)d_k);
        for (int i = 0; i <= d_k; i++)
            hl->row_bitoff[i] = (uint64_t)i * (uint64_t)d_v * es * 8;
        hl->codes_bytes = (size_t)d_k * (size_t)d_v * es;
        hl->compact_bytes = hl->codes_bytes;
        hl->block_bytes = align_up(hl->codes_bytes, align);
        return STEPQ_OK;
    }

    memcpy(hl->row_bits, row_bits, (size_t)d_k);
    if (arch == STEPQ_ARCH_GDN) {
        /* One stream for the whole head. */
        int b = row_bits[0];
        for (int i = 0; i <= d_k; i++)
            hl->row_bitoff[i] = (uint64_t)i * (uint64_t)d_v * (uint64_t)b;
        hl->codes_bytes = stepq__stream_bytes((size_t)d_k * (size_t)d_v, b);
        hl->n_pivot_rows = b == STEPQ_BITS_PIVOT ? d_k : 0;
    } else {
        /* One byte-aligned stream per row. */
        size_t off = 0;
        for (int i = 0; i < d_k; i++) {
            hl->row_bitoff[i] = (uint64_t)off * 8;
            off += stepq__stream_bytes((size_t)d_v, row_bits[i]);
            hl->n_pivot_rows += row_bits[i] == STEPQ_BITS_PIVOT;
        }
        hl->row_bitoff[d_k] = (uint64_t)off * 8;
        hl->codes_bytes = off;
    }

    size_t pos = align_up(hl->codes_bytes, align);
    hl->row_scale_offset = pos;
    pos = align_up(pos + 2 * (size_t)d_k, align);
    if (hl->has_col) {
        hl->col_scale_offset = pos;
        pos = align_up(pos + 2 * (size_t)d_v, align);
    }
    hl->block_bytes = pos;

    int int_rows = d_k - hl->n_pivot_rows;
    hl->compact_bytes = hl->codes_bytes + 2 * (size_t)int_rows;
    if (hl->has_col && int_rows > 0)
        hl->compact_bytes += 2 * (size_t)d_v;
    return STEPQ_OK;
}

void stepq__head_layout_free(struct stepq__head_layout *hl)
{
    if (!hl)
        return;
    free(hl->row_bitoff); /* row_bits lives in the same allocation */
    memset(hl, 0, sizeof(*hl));
}

/* --- fp16 / bf16 --- */

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

uint16_t stepq__fp16_from_float(float f)
{
    uint32_t x = f2u(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;

    if (ax >= 0x7f800000u) /* Inf or NaN (keep NaN quiet and non-zero) */
        return sign | 0x7c00u | (ax > 0x7f800000u ? 0x0200u : 0);
    if (ax >= 0x477ff000u) /* >= 65520 rounds to Inf under nearest-even */
        return sign | 0x7c00u;
    if (ax >= 0x38800000u) { /* normal half: rebias, round on the 13 dropped bits */
        uint32_t odd = (ax >> 13) & 1u;
        ax += 0xfffu + odd - ((uint32_t)(127 - 15) << 23);
        return sign | (uint16_t)(ax >> 13);
    }
    /*
     * Subnormal half or zero: adding 0.5 puts the value on a grid of 2^-24
     * (the half subnormal step), so the float adder does the nearest-even
     * rounding; the integer difference of the bit patterns is the mantissa.
     */
    float r = u2f(ax) + 0.5f;
    return sign | (uint16_t)(f2u(r) - f2u(0.5f));
}

float stepq__fp16_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;

    if (exp == 0x1f)
        return u2f(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in float */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return u2f(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t stepq__fp16_from_float_sat(float f, int *sat)
{
    if (f != f) {
        *sat = 1;
        return 0;
    }
    if (f >= 65504.0f) {
        *sat |= f > 65504.0f;
        return 0x7bffu;
    }
    if (f <= -65504.0f) {
        *sat |= f < -65504.0f;
        return 0xfbffu;
    }
    return stepq__fp16_from_float(f);
}

uint16_t stepq__bf16_from_float(float f)
{
    uint32_t x = f2u(f);

    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

float stepq__bf16_to_float(uint16_t h)
{
    return u2f((uint32_t)h << 16);
}

uint16_t stepq__scale_to_fp16(float s)
{
    if (!(s >= STEPQ__SCALE_MIN)) /* also catches NaN */
        return 0x0400u;
    if (s >= STEPQ__SCALE_MAX)
        return 0x7bffu;
    return stepq__fp16_from_float(s);
}

/* --- fp8 (e4m3) --- */

/*
 * Code c: sign bit 7, exponent e = bits 6..3 (bias 7), mantissa m = bits 2..0;
 * e = 0: m * 2^-9, else (1 + m/8) * 2^(e-7); 0x7f / 0xff NaN. Every operation
 * below is exact in float (powers of two and 4-bit integers).
 */
#define E4M3_MAG(c)                \
    (((c) >> 3 & 15) == 0          \
         ? (float)((c)&7) / 512.0f \
         : (1.0f + (float)((c)&7) / 8.0f) * (float)(1u << ((c) >> 3 & 15)) / 128.0f)
#define E4M3(c)    (((c)&0x7f) == 0x7f ? NAN : (c)&0x80 ? -E4M3_MAG(c) : E4M3_MAG(c))
#define E4M3_4(c)  E4M3(c), E4M3((c) + 1), E4M3((c) + 2), E4M3((c) + 3)
#define E4M3_16(c) E4M3_4(c), E4M3_4((c) + 4), E4M3_4((c) + 8), E4M3_4((c) + 12)
#define E4M3_64(c) E4M3_16(c), E4M3_16((c) + 16), E4M3_16((c) + 32), E4M3_16((c) + 48)

const float stepq__e4m3_values[256] = { E4M3_64(0), E4M3_64(64), E4M3_64(128), E4M3_64(192) };

/* --- Bit streams --- */

/* Per-byte a + b mod 256 of eight bytes in a word (no carry between bytes). */
static inline uint64_t bytes_add(uint64_t a, uint64_t b)
{
    const uint64_t h = 0x8080808080808080ull;
    return ((a & ~h) + (b & ~h)) ^ ((a ^ b) & h);
}

/*
 * The lane masks of the three squeeze steps of pack_groups (unpack_groups undoes them with
 * the same masks): `bits` bits per 16-bit lane, 2 * bits per 32-bit lane, 4 * bits per word.
 */
struct squeeze_masks {
    uint64_t m1, m2, m3;
};

static inline struct squeeze_masks squeeze_masks(int bits)
{
    struct squeeze_masks m = {
        ((1ull << bits) - 1u) * 0x0001000100010001ull,
        ((1ull << (2 * bits)) - 1u) * 0x0000000100000001ull,
        (1ull << (4 * bits)) - 1u,
    };
    return m;
}

/*
 * Whole groups of 8 values fill exactly `bits` bytes. The switches below call
 * these with a constant width, so that the compiler unrolls the shifts.
 */
static inline void pack_groups(uint8_t *p, const int8_t *z, size_t groups, int bits)
{
    int qmax = stepq__qmax(bits);
    uint32_t mask = (1u << bits) - 1u;

    /* 8, 4 and 2 bits: whole values per byte, in byte loops that vectorise. */
    if (bits == 8 || bits == 4 || bits == 2) {
        int per = 8 / bits;
        for (size_t t = 0; t < groups * (size_t)bits; t++) {
            uint32_t u = 0;
            for (int v = 0; v < per; v++)
                u |= ((uint32_t)(z[t * (size_t)per + (size_t)v] + qmax) & mask) << (v * bits);
            p[t] = (uint8_t)u;
        }
        return;
    }
    /*
     * 3, 5, 6 bits: the eight offset codes u_t = (z_t + qmax) & mask side by side, one per
     * byte of a word, then squeezed into 8 * bits contiguous bits in three steps (pairs in
     * 16-bit lanes, quads in 32-bit lanes, all eight), value t at bits [t*b, (t+1)*b).
     */
    if (bits == 3 || bits == 5 || bits == 6) {
        const uint64_t ones = 0x0101010101010101ull;
        const struct squeeze_masks m = squeeze_masks(bits);
        for (size_t g = 0; g < groups; g++, z += 8) {
            uint64_t x = 0;
            for (int t = 0; t < 8; t++)
                x |= (uint64_t)(uint8_t)z[t] << (8 * t);
            x = bytes_add(x, (uint64_t)qmax * ones) & ((uint64_t)mask * ones);
            x = (x & m.m1) | (((x >> 8) & m.m1) << bits);
            x = (x & m.m2) | (((x >> 16) & m.m2) << (2 * bits));
            x = (x & m.m3) | (((x >> 32) & m.m3) << (4 * bits));
            for (int t = 0; t < bits; t++)
                *p++ = (uint8_t)(x >> (8 * t));
        }
        return;
    }
    for (size_t g = 0; g < groups; g++, z += 8) {
        uint64_t acc = 0;
        for (int t = 0; t < 8; t++)
            acc |= (uint64_t)((uint32_t)(z[t] + qmax) & mask) << (t * bits);
        for (int t = 0; t < bits; t++)
            *p++ = (uint8_t)(acc >> (8 * t));
    }
}

static inline void unpack_groups(const uint8_t *p, int8_t *z, size_t groups, int bits)
{
    int qmax = stepq__qmax(bits);
    uint32_t mask = (1u << bits) - 1u;

    if (bits == 8 || bits == 4 || bits == 2) {
        int per = 8 / bits;
        for (size_t t = 0; t < groups * (size_t)bits; t++)
            for (int v = 0; v < per; v++)
                z[t * (size_t)per + (size_t)v] =
                    (int8_t)((int)(((uint32_t)p[t] >> (v * bits)) & mask) - qmax);
        return;
    }
    /* 3, 5, 6 bits: the packing steps above in reverse, then z = u - qmax per byte. */
    if (bits == 3 || bits == 5 || bits == 6) {
        const uint64_t ones = 0x0101010101010101ull;
        const struct squeeze_masks m = squeeze_masks(bits);
        const uint64_t neg = (uint64_t)(uint8_t)(256 - qmax) * ones;
        for (size_t g = 0; g < groups; g++, z += 8) {
            uint64_t x = 0;
            for (int t = 0; t < bits; t++)
                x |= (uint64_t)p[t] << (8 * t);
            p += bits;
            x = (x & m.m3) | (((x >> (4 * bits)) & m.m3) << 32);
            x = (x & m.m2) | (((x >> (2 * bits)) & m.m2) << 16);
            x = (x & m.m1) | (((x >> bits) & m.m1) << 8);
            x = bytes_add(x, neg);
            for (int t = 0; t < 8; t++)
                z[t] = (int8_t)(uint8_t)(x >> (8 * t));
        }
        return;
    }
    for (size_t g = 0; g < groups; g++, z += 8) {
        uint64_t acc = 0;
        for (int t = 0; t < bits; t++)
            acc |= (uint64_t)p[t] << (8 * t);
        p += bits;
        for (int t = 0; t < 8; t++)
            z[t] = (int8_t)((int)((acc >> (t * bits)) & mask) - qmax);
    }
}

/* Calls fn(args..., bits) with `bits` a compile-time constant for every width
 * of the format, so that the inlined group loops get constant shifts. */
#define WITH_CONST_WIDTH(bits, fn, ...) \
    do {                                \
        switch (bits) {                 \
        case 2:                         \
            fn(__VA_ARGS__, 2);         \
            break;                      \
        case 3:                         \
            fn(__VA_ARGS__, 3);         \
            break;                      \
        case 4:                         \
            fn(__VA_ARGS__, 4);         \
            break;                      \
        case 5:                         \
            fn(__VA_ARGS__, 5);         \
            break;                      \
        case 6:                         \
            fn(__VA_ARGS__, 6);         \
            break;                      \
        case 8:                         \
            fn(__VA_ARGS__, 8);         \
            break;                      \
        default:                        \
            fn(__VA_ARGS__, bits);      \
            break;                      \
        }                               \
    } while (0)

void stepq__pack_codes(uint8_t *dst, uint64_t bit_off, const int8_t *z, size_t n, int bits)
{
    int qmax = stepq__qmax(bits);
    uint32_t mask = (1u << bits) - 1u;
    uint8_t *p = dst + (bit_off >> 3);
    unsigned sh = (unsigned)(bit_off & 7);
    size_t k = 0;

    /* Whole groups of 8 values fill exactly `bits` bytes: write them whole. */
    if (sh == 0) {
        size_t groups = n / 8;
        WITH_CONST_WIDTH(bits, pack_groups, p, z, groups);
        p += groups * (size_t)bits;
        k = groups * 8;
    }
    /* The rest value by value, preserving the neighbouring bits. */
    for (; k < n; k++) {
        uint32_t u = ((uint32_t)(z[k] + qmax) & mask) << sh;
        uint32_t m = mask << sh;
        p[0] = (uint8_t)((p[0] & ~m) | u);
        if (sh + (unsigned)bits > 8)
            p[1] = (uint8_t)((p[1] & ~(m >> 8)) | (u >> 8));
        sh += (unsigned)bits;
        p += sh >> 3;
        sh &= 7;
    }
}

void stepq__unpack_codes(const uint8_t *src, uint64_t bit_off, int8_t *z, size_t n, int bits)
{
    int qmax = stepq__qmax(bits);
    uint32_t mask = (1u << bits) - 1u;
    const uint8_t *p = src + (bit_off >> 3);
    unsigned sh = (unsigned)(bit_off & 7);
    size_t k = 0;

    if (sh == 0) {
        size_t groups = n / 8;
        WITH_CONST_WIDTH(bits, unpack_groups, p, z, groups);
        p += groups * (size_t)bits;
        k = groups * 8;
    }
    for (; k < n; k++) {
        uint32_t w = p[0];
        if (sh + (unsigned)bits > 8)
            w |= (uint32_t)p[1] << 8;
        z[k] = (int8_t)((int)((w >> sh) & mask) - qmax);
        sh += (unsigned)bits;
        p += sh >> 3;
        sh &= 7;
    }
}
