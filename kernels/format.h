/*
 * The packed storage format of one recurrent-state head, the binding
 * contract between the C reference, the CUDA kernels and the pool.
 *
 * A head's state X is d_k x d_v: rows i are key channels, columns j value
 * channels. The packed block of ONE head is laid out as follows.
 *
 * Codes
 *   Codes are stored row-major [d_k][d_v]. Bits form a little-endian stream:
 *   value n of a stream occupies bits [n*b, (n+1)*b), least significant bit
 *   first within each byte. A code z in [-qmax, qmax] (qmax = 2^(b-1) - 1) is
 *   stored offset-binary, u = z + qmax. A row of n values at b bits takes
 *   exactly ceil(n*b/8) bytes and rows are concatenated with no padding:
 *     GDN: one stream for the whole head, ceil(d_k*d_v*b/8) bytes; value
 *          (i, j) is stream value i*d_v + j.
 *     KDA: row i has its own bit width b_i and its own stream, starting at the
 *          byte where row i-1 ended (bits left over in that last byte are 0).
 *   Bits of the code area that belong to no value are written as 0.
 *
 * Pivots
 *   A pivot unit (bits == STEPQ_BITS_PIVOT) stores IEEE fp16 values instead
 *   of codes, in the same place: a GDN pivot head is 2*d_k*d_v bytes, a KDA
 *   pivot row 2*d_v bytes. Pivots use no scales. Values beyond the fp16 range
 *   saturate to +-65504 (flagged STEPQ_HEALTH_SATURATED), never to Inf.
 *
 * Block order
 *   [codes / pivots] [row scales: d_k fp16] [column scales: d_v fp16]
 *   Column scales exist only for methods that have them (dsq, spatial,
 *   stepq). Each sub-block starts at a multiple of `align` (default 16)
 *   relative to the block start, and block_bytes is rounded up to `align`
 *   so that consecutive blocks stay aligned. Both scale slots are reserved
 *   for every head, even a pivot head or a head whose rows are all pivots:
 *   this is the paper's "analytical" layout ("reserves two scale slots for
 *   every head, including pivots"), e.g. Qwen3.8-27B stepq@6 gives
 *   30,015,488 B per request against a compact count of 29,999,104 B.
 *   Unused scale slots (pivot rows, pivot heads) are written as 0.
 *   compact_bytes is the information content: code bytes + pivot bytes +
 *   2 B per non-pivot row + 2*d_v B for the column-scale vector when the
 *   method has one and the head has at least one non-pivot row; no
 *   alignment. block_bytes - compact_bytes is reported as padding.
 *
 * Scales
 *   fp16 (IEEE half, stored as uint16_t), clamped to [2^-14, 65504].
 *   Reconstruction: X_ij = r_i * c_j * z_ij / qmax_i (c_j = 1 without
 *   column scales).
 *
 * fp8 (e4m3 codes, fp32 tile scales)
 *   Codes: d_k*d_v bytes row-major [K][V], one OCP FP8 E4M3 byte per value
 *   (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is
 *   subnormal, m * 2^-9; 0x7f / 0xff are NaN, never written). Then, at
 *   tile_scale_offset (a multiple of `align`), ceil(d_v/32) IEEE fp32 scales:
 *   tile t covers columns [32t, min(32t + 32, d_v)) of every row, so the last
 *   tile is short when d_v is not a multiple of 32 (STEPQ__FP8_TILE).
 *   s_t = m_t / 240 (one correctly rounded float division), m_t the largest
 *   |x| of the tile. Codes c = e4m3(clamp(x / s_t, +-240)), round to nearest
 *   even; an all-zero tile (s_t = 0, or m_t / 240 underflowing to 0) stores
 *   codes 0 and decodes to 0. Reconstruction: x^ = float(c) * s_t.
 *   Why 240 and not e4m3's largest finite 448: 240 is the largest magnitude
 *   both e4m3 variants hold (OCP e4m3fn: 448, e4m3fnuz: 240), the target the
 *   SGLang proposal specifies. x / s_t is at most 240 within one rounding, so
 *   the largest element maps to code 0x77 and no code overflows or
 *   saturates for a normal scale; the codes 256..448 stay unused, which costs
 *   only range at the bottom (the subnormal step is s_t 2^-9 = m_t / 122880
 *   instead of m_t / 229376), not precision (the relative step of a binade is
 *   the same). The clamp is for a subnormal s_t (m_t below 240 * 2^-126),
 *   whose relative error can push x / s_t past 240. row_bits are all 0 (no
 *   integer rows) and the block has no fp16 scales.
 *   compact_bytes = d_k*d_v + 4*ceil(d_v/32); for 128x128 that is 16,400 B,
 *   8 + 1/128 = 8.0078 bits per value, with no alignment padding at align 16.
 *
 * Dense methods (fp32 / bf16 / fp16)
 *   The block is d_k*d_v elements of that dtype, row-major [K][V], then
 *   padding up to `align`. fp16 saturates like pivots; bf16 rounds to
 *   nearest even.
 *
 * Non-finite values (kernels/README.md gives the reasoning)
 *   Packing never stores NaN or Inf: non-finite elements of a state are
 *   replaced by 0 before fitting and STEPQ_HEALTH_STATE is raised; a decode
 *   step whose inputs for a (request, head) are non-finite leaves that head's
 *   state untouched, writes 0 to its output and raises STEPQ_HEALTH_INPUT.
 */
#ifndef STEPQ_KERNELS_FORMAT_H
#define STEPQ_KERNELS_FORMAT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "stepq/common.h"
#include "stepq/map.h"
#include "plugin/vocab.h" /* STEPQ__FP8_TILE */
#include "stepq/pool.h"   /* STEPQ_HEALTH_* */

/** Default alignment of the sub-blocks of a head block (bytes). */
#define STEPQ__ALIGN_DEFAULT 16

/** Largest head dimension (bounds the kernels' scratch sizes): the public limit. */
#define STEPQ__MAX_HEAD_DIM STEPQ_MAX_HEAD_DIM

/** Smallest and largest stored scale (fp16 normal range). */
#define STEPQ__SCALE_MIN 6.103515625e-05f /* 2^-14 */
#define STEPQ__SCALE_MAX 65504.0f

/*
 * The decode fit rows' growth trigger (kernels/quant.h): the head falls back to the exact fit
 * where a non-pivot row's new maximum m_i = max_j |x_ij| RN(1/c_j) exceeds ROWS_GROW times the
 * float of the old block's fp16 row scale (compared in float, m_i > 1.5f * r_i, so that every
 * backend takes the same decision). A column that outgrew its stale scale shows up as a jump of
 * the rows it dominates. Chosen on synthetic traces (tools/results/decode-fit-synthetic.md).
 */
#define STEPQ__ROWS_GROW 1.5f

/*
 * Health flags: the public STEPQ_HEALTH_* bits of stepq/pool.h, OR-ed per
 * slot into a uint32_t word the pool exposes to the server. A flag never
 * clears itself; the owner of the word resets it.
 */

/** Layout of a dense fp32 state head as a server hands it over. */
typedef enum stepq__layout {
    STEPQ__LAYOUT_KV = 0, /**< [d_k][d_v], fla: [N, HV, K, V] */
    STEPQ__LAYOUT_VK = 1, /**< [d_v][d_k], SGLang pool: [slots+1, HV, V, K] */
} stepq__layout;

/**
 * Byte layout of one head block. Built by stepq__head_layout_init, released
 * with stepq__head_layout_free. Read-only after init (thread-safe to share).
 */
struct stepq__head_layout {
    stepq_method method;
    stepq_arch arch;
    int d_k, d_v;
    int quantized;    /**< 1 for uniform..stepq and fp8, 0 for fp32/bf16/fp16 */
    int has_col;      /**< the method stores column scales */
    int n_pivot_rows; /**< rows stored as fp16 (GDN pivot head: d_k) */
    size_t align;
    /**
     * dsq / spatial / stepq: the row split alpha of the dual-axis fit
     * (kernels/quant.h), the map field row_split. It changes the codes and
     * scales a fit chooses, not the block format or its decoding. Init sets
     * 0.5; the pool's layout sets its map's. Unused by the other methods.
     */
    double row_split;
    /**
     * dsq / spatial / stepq: the fit of a decode step's new state (the map
     * field decode_fit; kernels/quant.h): STEPQ_DECODE_FIT_NOREFIT skips the
     * fixed-code column refit, STEPQ_DECODE_FIT_ROWS keeps the old block's
     * column scales and refits the row scales. Packs fit exactly whatever
     * it says, and the block format and its decoding do not depend on it. Init sets exact;
     * the pool's layout sets its map's. Unused by the other methods.
     */
    stepq_decode_fit decode_fit;
    /**
     * dsq / spatial / stepq: the arithmetic of a decode step (the map field
     * arith; kernels/quant.h): STEPQ_ARITH_FP16 does the step's per-element
     * work in IEEE fp16 under power-of-two normalisers, and only under the
     * exact decode fit. Packs, unpacks and calibration compute in fp32
     * whatever it says, and the block format and its decoding do not depend
     * on it. Init sets fp32; the pool's layout sets its map's. Unused by the
     * other methods.
     */
    stepq_arith arith;

    /** d_k bit widths (2..8 or STEPQ_BITS_PIVOT); all 0 for dense methods. */
    uint8_t *row_bits;
    /**
     * d_k + 1 bit offsets of each row's first value relative to the start
     * of the code area (entry d_k = end of the code stream). GDN: i*d_v*b;
     * KDA: 8 * byte offset. For dense methods: i*d_v*elem_size*8.
     */
    uint64_t *row_bitoff;

    size_t codes_offset;      /**< always 0 */
    size_t codes_bytes;       /**< bytes of codes / pivots / dense values */
    size_t row_scale_offset;  /**< d_k fp16; 0 and unused for dense methods */
    size_t col_scale_offset;  /**< d_v fp16; 0 and unused without column scales */
    size_t tile_scale_offset; /**< fp8: ceil(d_v/32) fp32 tile scales; 0 for other methods */
    size_t block_bytes;       /**< allocated bytes, a multiple of align */
    size_t compact_bytes;     /**< information bytes, no alignment, no unused scale slots */
};

/**
 * Builds the layout of one head.
 *
 * @param hl       filled on success; left zeroed on failure.
 * @param method   storage method.
 * @param arch     GDN (one bit width per head) or KDA (per-row bit widths).
 * @param d_k,d_v  head dimensions, 1..STEPQ__MAX_HEAD_DIM.
 * @param row_bits d_k entries (copied): 2,3,4,5,6,8 or STEPQ_BITS_PIVOT.
 *                 GDN needs all entries equal; uniform/dsq/spatial need one
 *                 width and no pivot. Ignored (may be NULL) for dense methods.
 * @param align    sub-block alignment, a power of two; 0 = STEPQ__ALIGN_DEFAULT.
 * @return STEPQ_OK, STEPQ_EINVAL (message names the field) or STEPQ_ENOMEM.
 */
int stepq__head_layout_init(struct stepq__head_layout *hl, stepq_method method, stepq_arch arch,
                            int d_k, int d_v, const uint8_t *row_bits, size_t align);

/** Releases the arrays of a layout and zeroes it. Safe on a zeroed layout. */
void stepq__head_layout_free(struct stepq__head_layout *hl);

/** Whether a bit width is a legal integer format (2,3,4,5,6,8). */
int stepq__format_int_bits(int bits);

/** qmax(b) = 2^(b-1) - 1. */
static inline int stepq__qmax(int bits)
{
    return (1 << (bits - 1)) - 1;
}

/** Bytes of a stream of n values at b bits: ceil(n*b/8). */
static inline size_t stepq__stream_bytes(size_t n, int bits)
{
    return (n * (size_t)bits + 7) / 8;
}

/* --- fp16 / bf16 (round to nearest even) --- */

/** float -> IEEE half, round to nearest even; overflow gives Inf, NaN stays NaN. */
uint16_t stepq__fp16_from_float(float f);
/** IEEE half -> float (exact). */
float stepq__fp16_to_float(uint16_t h);
/** float -> fp16 saturating to +-65504 (NaN -> 0); *sat set to 1 when clamped. */
uint16_t stepq__fp16_from_float_sat(float f, int *sat);
/** float -> bf16, round to nearest even; NaN stays NaN. */
uint16_t stepq__bf16_from_float(float f);
/** bf16 -> float (exact). */
float stepq__bf16_to_float(uint16_t h);
/** A scale as stored: fp16 of s clamped to [2^-14, 65504] (NaN -> 2^-14). */
uint16_t stepq__scale_to_fp16(float s);

/* --- fp8 (e4m3) --- */

/** The value fp8 maps a tile's largest magnitude to (the format note above says why). */
#define STEPQ__FP8_AMAX 240.0f

/* Inline (format.h is included by the kernels that use them per element). */
static inline uint32_t stepq__f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float stepq__f32_of_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/**
 * float -> e4m3 code, round to nearest even, |f| clamped to STEPQ__FP8_AMAX
 * first (the same code as clamping after rounding: 240 is a code and rounding
 * is monotonic); NaN -> 0. The sign is kept, also for zero (-0 and negative
 * values that round to 0 give 0x80), as the CUDA conversion does.
 */
static inline uint8_t stepq__e4m3_from_float(float f)
{
    uint8_t sign = (uint8_t)((stepq__f32_bits(f) >> 24) & 0x80u);
    float a = stepq__f32_of_bits(stepq__f32_bits(f) & 0x7fffffffu);

    if (a != a)
        return 0;
    if (a > STEPQ__FP8_AMAX)
        a = STEPQ__FP8_AMAX;
    if (a < 0.015625f) {
        /*
         * Subnormal codes (and 2^-6, the smallest normal, code 8): m * 2^-9 for
         * m = 0..8. a * 512 is exact, and adding and subtracting 1.5 * 2^23 rounds it
         * to the nearest integer, ties to even; the integer is the code itself.
         */
        float m = (a * 512.0f + 12582912.0f) - 12582912.0f;
        return sign | (uint8_t)(int)m;
    }
    /*
     * Normal: round the float's 23 mantissa bits to 3, nearest even (the carry may
     * step the exponent, which is right), then rebias 127 -> 7. a <= 240 keeps the
     * result at or below 0x77 = 1.875 * 2^7 = 240.
     */
    uint32_t u = stepq__f32_bits(a);
    u += 0x7ffffu + ((u >> 20) & 1u);
    uint32_t e = (u >> 23) - 127u + 7u;
    return sign | (uint8_t)(e << 3 | ((u >> 20) & 7u));
}

/** The value of every e4m3 code (format.c builds it from the fields at compile time). */
extern const float stepq__e4m3_values[256];

/** e4m3 code -> float (exact); 0x7f / 0xff are NaN. A table: the reference decodes every
 * value of a page with it, and the fields' branches cost 5x more per element. */
static inline float stepq__e4m3_to_float(uint8_t c)
{
    return stepq__e4m3_values[c];
}
/** Number of fp8 scale tiles of a head with d_v columns: ceil(d_v / 32). */
static inline int stepq__fp8_tiles(int d_v)
{
    return (d_v + STEPQ__FP8_TILE - 1) / STEPQ__FP8_TILE;
}

/* --- Bit streams --- */

/**
 * Writes n codes z (in [-qmax, qmax], stored u = z + qmax) at b bits into the
 * stream dst starting at bit bit_off. Bits outside [bit_off, bit_off + n*b)
 * are preserved. b in 2..8.
 */
void stepq__pack_codes(uint8_t *dst, uint64_t bit_off, const int8_t *z, size_t n, int bits);

/** Reads n codes written by stepq__pack_codes. */
void stepq__unpack_codes(const uint8_t *src, uint64_t bit_off, int8_t *z, size_t n, int bits);

#endif /* STEPQ_KERNELS_FORMAT_H */
