/*
 * What the three kernels share: the device mirrors of the layout and the
 * step arguments, conversions that round as kernels/quant.c does, the
 * input loads and gate math of the recurrence, cp.async staging and the
 * code-width constants. head_kernel.cuh (thread per column),
 * tile_kernel.cuh (micro-tiles) and unpack_kernel.cuh include it.
 */
#ifndef STEPQ_KERNELS_CUDA_COMMON_CUH
#define STEPQ_KERNELS_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

extern "C" {
#include "kernels/dsp.h"
}

#define SQ_D       128 /* head dimension (d_k = d_v) */
#define SQ_THREADS 256 /* threads per block: one block per (request, value head) */

enum { SQ_SRC_PACKED = 0, SQ_SRC_DENSE = 1 };
enum { SQ_SINK_PACKED = 0, SQ_SINK_DENSE = 1 };

/* Device mirror of one head's layout (kernels/format.h). */
struct __align__(16) sq_head_desc
{
    uint32_t block_off;   /* head_offset in the page */
    uint32_t block_bytes; /* multiple of 16 */
    uint32_t row_scale_off, col_scale_off;
    uint32_t tile_scale_off; /* fp8: the ceil(d_v/32) fp32 tile scales; 0 otherwise */
    uint8_t method, quantized, has_col, dual;
    uint8_t any_int, ubits; /* ubits: the one integer width of every row, else 0 */
    uint8_t needs_zero;     /* the block has bytes no field covers (zeroed by the tile kernel) */
    uint8_t f16;            /* the decode step is the fp16 kernel's (f16_kernel.cuh; arith fp16) */
    uint8_t piv0;           /* the first pivot row (SQ_D: none); piv0_off its row_off (the fp16
                               KDA item's readout reads both with the descriptor's first 32
                               bytes; bits sit at byte 32, row_off at 160, aligned) */
    uint8_t pivh;           /* a GDN pivot head: fp16 rows only (sq_pivot_head_step) */
    uint16_t piv0_off;
    uint8_t bits[SQ_D];     /* 2..8 or 16 (pivot); 0 for dense methods */
    uint16_t row_off[SQ_D]; /* byte offset of row i's codes (a multiple of 16 at d_v = 128) */
    float w[SQ_D];          /* row impact used by the fit (1 when unused) */
    double row_split;       /* the dual-axis fit's row split (map field row_split; 0.5 default) */
};

/*
 * The dual-axis fit's row scale of a row with absmax m and row impact w, as
 * kernels/quant.c fit_dual computes it: sqrt(m / w) at the default split 0.5,
 * else m^split / sqrt(w) in double precision. The other split is a call out
 * of line, so the default path keeps its registers.
 */
__device__ __noinline__ float sq_row_scale_split(float m, float w, double split)
{
    return (float)(pow((double)m, split) / sqrt((double)w));
}

__device__ __forceinline__ float sq_dual_row_scale(float m, float w, double split)
{
    return split == 0.5 ? sqrtf(m / w) : sq_row_scale_split(m, w, split);
}

/*
 * The recurrence inputs (device pointers). q, k, v, g, beta and o are fp32
 * or bf16 (in_bf16), A_log and dt_bias likewise (par_bf16); the strides are
 * the elements between consecutive requests, already defaulted by the host
 * (layer.cu, make_step), so they are never 0 here.
 */
struct sq_step {
    int H, HV, kda, l2norm, gate, beta_sig;
    int in_bf16, par_bf16;
    float scale;
    const void *q, *k, *v, *g, *beta, *A_log, *dt_bias;
    void *o;
    size_t q_stride, k_stride, v_stride, g_stride, beta_stride, o_stride;
};

/* Where the work items go. */
struct sq_io {
    int n_slots;          /* slot ids outside 0..n_slots-1 are skipped */
    const int32_t *slots; /* [entries]; NULL: entry e is slot e */
    uint8_t *pages;       /* packed pages */
    size_t page_stride;
    const sq_head_desc *heads;
    int vec16;           /* pages, stride and offsets 16-byte aligned */
    void *dense;         /* dense tensor */
    size_t dense_stride; /* elements per entry (or per slot) */
    int dense_by_slot;   /* dense entry index = slot id (dense step) or entry (pack/unpack) */
    int layout_vk, bf16;
    int dense_vec; /* dense base and stride allow 16-byte (fp32) / 8-byte (bf16) vectors */
    uint32_t *health;
    unsigned long long *counts;
    int *skip; /* two-stage: [entries][HV], stage 1 marks heads left untouched */
};

__device__ __forceinline__ float sq_h2f(uint16_t h)
{
    return __half2float(__ushort_as_half(h));
}

/*
 * Whether an old fp16 column scale can serve the decode fit rows: positive
 * and finite (kernels/quant.c, rows_col_ok).
 */
__device__ __forceinline__ bool sq_rows_col_ok(uint16_t h)
{
    return (uint16_t)(h - 1u) < 0x7bffu;
}

/* stepq__scale_to_fp16 */
__device__ __forceinline__ uint16_t sq_scale_h(float s)
{
    if (!(s >= STEPQ__SCALE_MIN))
        return 0x0400u;
    if (s >= STEPQ__SCALE_MAX)
        return 0x7bffu;
    return __half_as_ushort(__float2half_rn(s));
}

/* The half2 whose bits are u, and the bits of a half2 */
__device__ __forceinline__ half2 sq_u2h(uint32_t u)
{
    return *reinterpret_cast<half2 *>(&u);
}

__device__ __forceinline__ uint32_t sq_h2u(half2 h)
{
    return *reinterpret_cast<uint32_t *>(&h);
}

/* stepq__fp16_from_float_sat */
__device__ __forceinline__ uint16_t sq_f16_sat(float f, unsigned *fl)
{
    if (f != f) {
        *fl |= STEPQ_HEALTH_SATURATED;
        return 0;
    }
    if (f >= 65504.0f) {
        if (f > 65504.0f)
            *fl |= STEPQ_HEALTH_SATURATED;
        return 0x7bffu;
    }
    if (f <= -65504.0f) {
        if (f < -65504.0f)
            *fl |= STEPQ_HEALTH_SATURATED;
        return 0xfbffu;
    }
    return __half_as_ushort(__float2half_rn(f));
}

/*
 * stepq__bf16_from_float, an unpack's bf16 store (plugin/include/stepq/step.h): round to nearest
 * even, values past bf16's range become +-Inf, a NaN stays a NaN (quiet, its high bits kept).
 */
__device__ __forceinline__ uint16_t sq_bf16_rn(float f)
{
    uint32_t x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x0040u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/*
 * bf16 store of kernels/quant.c store_dense (pages, dense steps): sq_bf16_rn, but what would be
 * +-Inf saturates to bf16's largest finite value (flag in *fl).
 */
__device__ __forceinline__ uint16_t sq_bf16_sat(float f, unsigned *fl)
{
    uint32_t x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);
    uint16_t h = (uint16_t)(x >> 16);
    if ((h & 0x7f80u) == 0x7f80u) {
        h = (uint16_t)((h & 0x8000u) | 0x7f7fu);
        *fl |= STEPQ_HEALTH_SATURATED;
    }
    return h;
}

__device__ __forceinline__ float sq_bf2f(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

/*
 * stepq__e4m3_from_float on a quotient x / s of finite values: clamped to +-240 first
 * (STEPQ__FP8_AMAX: the same code as clamping after rounding), then the hardware's
 * round-to-nearest-even conversion (cvt.rn.satfinite.e4m3x2.f32), which keeps the sign
 * of a zero result as the reference does. fminf / fmaxf keep -0 (no NaN reaches here).
 */
__device__ __forceinline__ uint8_t sq_e4m3(float y)
{
    y = fminf(fmaxf(y, -STEPQ__FP8_AMAX), STEPQ__FP8_AMAX);
    return (uint8_t)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
}

/*
 * Two e4m3 codes (a in the low byte) of quotients x / s with |x| <= the tile's amax m and
 * s = RN(m / 240), rounded to nearest even as stepq__e4m3_from_float. CLAMP: the reference's
 * clamp to +-240 first. It decides a code only where s is subnormal (m below 240 * 2^-126):
 * there s's relative error can reach 1/3 and |x / s| 360, which e4m3 rounds past 240. A normal s
 * keeps |x / s| within a few ulps of 240, far below 248 (the midpoint of 240 and e4m3's next
 * value 256), so a bf16 source (sq_fp8_kernel's pack), whose smallest magnitude 2^-133 keeps s
 * normal or within 0.2% of m / 240, leaves the clamp out.
 */
template <bool CLAMP> __device__ __forceinline__ uint32_t sq_e4m3x2(float a, float b)
{
    if (CLAMP) {
        a = fminf(fmaxf(a, -STEPQ__FP8_AMAX), STEPQ__FP8_AMAX);
        b = fminf(fmaxf(b, -STEPQ__FP8_AMAX), STEPQ__FP8_AMAX);
    }
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

/*
 * The scale s = amax / 240 of fp8 tile t (kernels/quant.c fit_fp8) from the |x| maxima m of the
 * two warps that hold it (u = 0, 1: which of the pair), called by every thread of both: a warp
 * max, a pair in shared memory and a 64-thread named barrier (id 1 + t, so one tile's wait does
 * not hold the others), then the correctly rounded division.
 */
__device__ __forceinline__ float sq_fp8_tile_scale(float m, int t, int u)
{
#pragma unroll
    for (int o = 16; o; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __shared__ float smax[4][2];
    if ((threadIdx.x & 31) == 0)
        smax[t][u] = m;
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + t) : "memory");
    return __fdiv_rn(fmaxf(smax[t][0], smax[t][1]), STEPQ__FP8_AMAX);
}

/* Health, reported by one thread: one event per (request, head) and flag, as the reference. */
__device__ __forceinline__ void sq_tile_report(const sq_io &io, unsigned f, int32_t slot)
{
    if (io.health)
        atomicOr(io.health + slot, f);
    if (io.counts)
        for (int bit = 0; bit < STEPQ__HEALTH_NCOUNTS; bit++)
            if (f & (1u << bit))
                atomicAdd(io.counts + bit, 1ull);
}

/*
 * The health of a block's (request, head), called by every thread of the block with its own bits:
 * a block-wide vote, and only where a thread raised one (rare) a shared word and one report from
 * thread 0 (sq_tile_report). Used by the kernels that keep their flags in registers (the warp
 * kernel, sq_fp8_kernel's pack).
 */
__device__ __forceinline__ void sq_block_health(const sq_io &io, unsigned fl, int32_t slot)
{
    if (__syncthreads_or(fl != 0)) {
        __shared__ unsigned sfl;
        if (threadIdx.x == 0)
            sfl = 0;
        __syncthreads();
        if (fl)
            atomicOr(&sfl, fl);
        __syncthreads();
        if (threadIdx.x == 0)
            sq_tile_report(io, sfl, slot);
    }
}

/* stepq__e4m3_to_float: exact through half (e4m3's range and steps fit fp16). */
__device__ __forceinline__ float sq_e4m3_f(uint8_t c)
{
    return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3)));
}

/*
 * The bits of element i of a recurrence input (fp32, or bf16 when `bf16`)
 * and their value (bf16 widens exactly), and the output store (bf16 rounded
 * to nearest even, as stepq__bf16_from_float). The flag is uniform over the
 * grid; only the input phase and the output store go through these. The
 * load and the widening are separate so that no thread waits on an input
 * where its load is issued: a widening in the arm of the dtype branch that
 * holds the load makes each load wait in turn, before the next input's and
 * the state's loads go out.
 */
__device__ __forceinline__ uint32_t sq_ld_bits(const void *p, size_t i, int bf16)
{
    return bf16 ? (uint32_t)((const uint16_t *)p)[i] : ((const uint32_t *)p)[i];
}

__device__ __forceinline__ float sq_bits_f(uint32_t b, int bf16)
{
    return __uint_as_float(bf16 ? b << 16 : b);
}

__device__ __forceinline__ void sq_st_out(void *p, size_t i, float x, int bf16)
{
    if (bf16)
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(x);
    else
        ((float *)p)[i] = x;
}

/* 16-byte asynchronous global -> shared copy (cp.async, sm_80+), its wait and commit. */
__device__ __forceinline__ void sq_cp_async16(void *smem, const void *gmem)
{
    unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem) : "memory");
}

__device__ __forceinline__ void sq_cp_async_wait_all()
{
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

__device__ __forceinline__ void sq_cp_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Issues the cp.async copy of a head block into buf (bytes: a multiple of 16), one group. */
__device__ __forceinline__ void sq_stage_block(uint8_t *buf, const uint8_t *blk, uint32_t bytes)
{
    for (uint32_t n = threadIdx.x; n < bytes / 16; n += SQ_THREADS)
        sq_cp_async16(buf + 16 * n, blk + 16 * n);
    sq_cp_commit();
}

/*
 * The head block staged by one bulk copy (cp.async.bulk, the TMA engine of sm_90) instead of
 * 16-byte cp.async by every thread: thread 0 initialises the block's one mbarrier, announces the
 * bytes and issues the copy; every thread waits on the barrier's phase 0 (sq_bulk_wait) after a
 * __syncthreads has ordered the initialisation before its wait. buf, blk and bytes are multiples
 * of 16, as for sq_stage_block. The tile kernel's fused step under SQ_STAGE_BULK
 * (tile_kernel.cuh), not yet measured.
 */
__device__ __forceinline__ uint64_t *sq_bulk_mbar()
{
    __shared__ uint64_t mbar;
    return &mbar;
}

__device__ __forceinline__ void sq_bulk_stage(uint8_t *buf, const uint8_t *blk, uint32_t bytes)
{
    const unsigned m = (unsigned)__cvta_generic_to_shared(sq_bulk_mbar());
    const unsigned d = (unsigned)__cvta_generic_to_shared(buf);
    asm volatile(
        "mbarrier.init.shared::cta.b64 [%0], 1;\n"
        "fence.mbarrier_init.release.cluster;\n"
        "fence.proxy.async.shared::cta;\n"
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%2], [%3], %1, "
        "[%0];\n" ::"r"(m),
        "r"(bytes), "r"(d), "l"(blk)
        : "memory");
}

__device__ __forceinline__ void sq_bulk_wait()
{
    const unsigned m = (unsigned)__cvta_generic_to_shared(sq_bulk_mbar());
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "SQ_BULK_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
                 "@!p bra SQ_BULK_WAIT;\n"
                 "}\n" ::"r"(m)
                 : "memory");
}

enum { SQ_F32 = 0, SQ_BF16 = 1, SQ_F16 = 2 };

/*
 * The bits of dt_bias[hv][j] (GDN: [hv]) and A_log[hv] that sq_decay needs
 * with st.gate (0 without), loaded apart from it so that a kernel can issue
 * them with its other inputs.
 */
__device__ __forceinline__ void sq_ld_gate(const sq_step &st, int hv, int j, uint32_t &bias,
                                           uint32_t &alog)
{
    bias = alog = 0;
    if (st.gate) {
        const int ng = st.kda ? SQ_D : 1;
        bias = sq_ld_bits(st.dt_bias, (size_t)hv * ng + j, st.par_bf16);
        alog = sq_ld_bits(st.A_log, (size_t)hv, st.par_bf16);
    }
}

/*
 * The decay exp(g) of a head's key channel (GDN: of the head); with st.gate,
 * g is the raw gate and g = -exp(A_log) softplus(g + dt_bias) is formed
 * here from the bits of sq_ld_gate (torch's softplus: in double as the
 * reference when DBL, else in fp32). bad notes a non-finite gate.
 */
template <bool DBL>
__device__ __forceinline__ float sq_decay(const sq_step &st, float g, uint32_t bias, uint32_t alog,
                                          bool &bad)
{
    if (st.gate) {
        const int pb = st.par_bf16;
        const float ga = g + sq_bits_f(bias, pb);
        const float sp = ga > 20.0f ? ga : DBL ? (float)log1p(exp((double)ga)) : log1pf(expf(ga));
        g = -expf(sq_bits_f(alog, pb)) * sp;
    }
    bad |= !isfinite(g);
    return expf(g);
}

/* beta, or sigmoid(beta) with st.beta_sig; bad notes a non-finite one. */
__device__ __forceinline__ float sq_beta(const sq_step &st, float b, bool &bad)
{
    if (st.beta_sig)
        b = 1.0f / (1.0f + expf(-b));
    bad |= !isfinite(b);
    return b;
}

/*
 * Non-finite recurrence inputs of (entry e, head hv): the state keeps its
 * content (the caller writes nothing back), the output row is 0 (o is bf16
 * when bf16), stage 2 of the two-stage step skips the head, and the slot's
 * health notes INPUT.
 */
__device__ __forceinline__ void sq_input_failed(const sq_step &st, const sq_io &io, int e, int HV,
                                                int hv, int32_t slot, int t, int bf16)
{
    if (t < SQ_D)
        sq_st_out(st.o, (size_t)e * st.o_stride + (size_t)hv * SQ_D + t, 0.0f, bf16);
    if (t == 0) {
        if (io.skip)
            io.skip[(size_t)e * HV + hv] = 1;
        if (io.health)
            atomicOr(io.health + slot, STEPQ_HEALTH_INPUT);
        if (io.counts)
            atomicAdd(io.counts + 0, 1ull);
    }
}

/*
 * a / b from b and RN(1/b) (Markstein): the residual is exact and the
 * corrected quotient is the correctly rounded a / b (Markstein's theorem,
 * given a faithful first quotient; tests/kernels/test_format.c checks a
 * sample of significand pairs on the host, kernels/cuda/probe/div_exhaustive.cu
 * all 2^46 on a GPU) wherever 1/b, the residual (about 2^-24 |a|) and the
 * quotient are normal floats; 3 operations instead of an IEEE division.
 */
__device__ __forceinline__ float sq_div(float a, float b, float binv)
{
    float q = __fmul_rn(a, binv);
    float e = fmaf(-q, b, a);
    return fmaf(e, binv, q);
}

/*
 * The division of an fp8 tile's elements by its scale s > 0 (kernels/quant.c fit_fp8: x / s
 * correctly rounded, then e4m3), set up once per tile. SQDIV (the fp8 decode step; the pack only
 * in SQ_FP8_PACK_SQDIV builds, fp8_kernel.cuh): where s is in [2^-80, 2^120], sq_div with
 * si = RN(1/s) (3 operations), elsewhere __fdiv_rn; else __fdiv_rn everywhere. sq_div is exact
 * where sq_div is exact for the reduced pair of significands (kernels/cuda/probe/div_exhaustive.cu
 * checks all 2^46 of them, none differs (H100, session 20); its header gives the scaling
 * argument, which holds for every element that keeps its quotient, |x| >= thr >= 2^-90: 1/s,
 * the residual and the quotient stay normal).
 * Either way an element with |x| < thr = s 2^-10 takes the code of x * 0: |x / s| < 2^-10 rounds
 * to e4m3's signed zero (2^-10 is the midpoint of 0 and 2^-9, a tie to even), which keeps zeros
 * and denormals out of the divisions (__fdiv_rn's slow path; sq_div's exactness needs normal
 * residuals; -0 / s is -0). thr is exact where s 2^-10 is a normal float; below that (s < 2^-116)
 * thr = 0 sends every element through __fdiv_rn.
 */
struct sq_fp8_div {
    float s, si, thr;
    bool fast;
};

template <bool SQDIV> __device__ __forceinline__ sq_fp8_div sq_fp8_div_of(float s)
{
    sq_fp8_div d;
    d.s = s;
    d.fast = SQDIV && s >= 0x1p-80f && s <= 0x1p120f;
    d.si = d.fast ? __frcp_rn(s) : 0.0f;
    d.thr = s >= 0x1p-116f ? s * 0x1p-10f : 0.0f;
    return d;
}

/*
 * Two e4m3 codes (a in the low byte) of a / s and b / s (sq_fp8_div). FAST: d.fast, the caller's
 * tile-uniform branch; then s is normal and |x / s| stays within a few ulps of 240, so the clamp
 * is moot (sq_e4m3x2). CLAMP: the clamp to +-240 of fp32 sources on the __fdiv_rn path.
 */
template <bool FAST, bool CLAMP>
__device__ __forceinline__ uint32_t sq_fp8_codes2(const sq_fp8_div &d, float a, float b)
{
    const bool za = fabsf(a) < d.thr, zb = fabsf(b) < d.thr;
    float qa, qb;
    if (FAST) {
        qa = sq_div(a, d.s, d.si);
        qb = sq_div(b, d.s, d.si);
    } else { /* a zero's division divides s by s instead */
        qa = __fdiv_rn(za ? d.s : a, d.s);
        qb = __fdiv_rn(zb ? d.s : b, d.s);
    }
    return sq_e4m3x2 < CLAMP && !FAST > (za ? a * 0.0f : qa, zb ? b * 0.0f : qb);
}

/* Two values as bf16, rounded to nearest even by one cvt; no saturation: callers rule out Inf. */
__device__ __forceinline__ uint32_t sq_bf16x2(float a, float b)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&h);
}

/*
 * 16-byte global store (st.global.v4): the compiler split some aggregate ones. No memory clobber:
 * the kernel's stores never alias its loads, so later loads may still be issued before it.
 */
__device__ __forceinline__ void sq_st16(void *p, uint32_t a, uint32_t b, uint32_t c, uint32_t d)
{
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(a), "r"(b), "r"(c),
                 "r"(d));
}

/* qmax and code mask of a B-bit width, as constants for the templated decode and pack. */
template <int B> struct sq_bw {
    static constexpr int QM = (1 << (B - 1)) - 1;
    static constexpr uint32_t MASK = (1u << B) - 1u;
};

/* RN(1 / qmax) for b = 0..8 (entries for b < 2 and b = 7 unused). */
__constant__ float sq_iqm[9] = { 0.0f,         0.0f,         1.0f,
                                 1.0f / 3.0f,  1.0f / 7.0f,  1.0f / 15.0f,
                                 1.0f / 31.0f, 1.0f / 63.0f, 1.0f / 127.0f };

#endif /* STEPQ_KERNELS_CUDA_COMMON_CUH */
