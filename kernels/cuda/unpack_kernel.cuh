/*
 * Unpack (prefill hook: packed page -> dense fp32/bf16, [K,V] or [V,K]) on
 * a store-coalesced mapping with the tile kernel's cheap decode: the unpack
 * of every layer whose heads are all quantized (sq_head_kernel keeps dense
 * pages and the legacy comparison rows).
 *
 * Why not sq_tile_kernel's 8x8 micro-tile: its fp32 rows are 32 bytes per
 * thread (two 16-byte stores per half-sector pair, the pattern that made the
 * tile's dense fp32 step 2.4x slower than the column kernel), and it holds a
 * 64-register tile that an unpack does not need (no reductions). Here warp w
 * owns rows 16w..16w+15 and lane l columns 4l..4l+3 (all lanes of a warp
 * read the same row's codes: no bank conflicts). bf16 [K,V] rows leave as
 * one 256-byte warp store per row (86% of copy bandwidth). fp32 [K,V] goes
 * through a 16 KiB shared buffer, 32 rows at a time, so that every warp store
 * writes 128 contiguous bytes (sq_unpack_rows_t): measured on the H200 at
 * B = 512, 16-byte-per-lane stores ran fp32 [K,V] at 53-74% of copy
 * bandwidth. [V,K] goes through a 32 KiB buffer by column (sq_unpack_vk), so
 * that each lane stores 16 bytes and a warp two whole 256-byte column chunks.
 * About 16 values live per thread, so 4 blocks share an SM and hide the
 * staging latency of each other's blocks.
 *
 * Exactness: the reference reconstructs x = (r c_j) * (z / qmax) (c_j = 1
 * without column scales; pivot rows are fp16 values), and tests/checkasm compares
 * bf16 unpack bit for bit. The signed code z is exact as a float (the
 * position-exponent decode of tile_kernel.cuh), z / qmax is correctly rounded
 * by one Markstein correction of z * RN(1/qmax) (sq_div; checked exhaustively
 * on the host for |z| <= qmax, b = 2..6 and 8: z * RN(1/qmax) alone is off
 * in 40 of those 374 cases), and both products are separate roundings. bf16 stores
 * use cvt.rn (round to nearest even, as the reference) when every row and
 * column scale of the block is finite and the row is not a pivot row (values
 * below 65504^2, far from bf16 overflow); otherwise the reference's scalar
 * conversion (sq_bf16_rn: past bf16's range +-Inf, a NaN keeps its high bits,
 * which cvt.rn would replace by the canonical NaN), as the column kernel.
 *
 * Per element: 2 operations to the float code (templates on uniform-width
 * heads; 3 on run-time widths), 3 for z / qmax, 2 multiplies, a quarter
 * store; per 4 elements two 32-bit shared loads and a funnel shift. The
 * column kernel's mixed-width path spends ~20 (per-row shared loads, LUT
 * index and load, one store per element), which is why KDA unpack ran at
 * 49.6% of copy bandwidth.
 */
#ifndef STEPQ_KERNELS_CUDA_UNPACK_KERNEL_CUH
#define STEPQ_KERNELS_CUDA_UNPACK_KERNEL_CUH

#include "kernels/cuda/common.cuh"

/* 4 blocks per SM (<= 64 registers): the staging of one block hides behind the others' stores */
#define SQ_UMIN_BLOCKS 4

/* Per-row constants of the unpack (one 16-byte broadcast load per row). */
struct __align__(16) sq_urow
{
    float r;     /* row scale (pivot rows: unused) */
    float qm;    /* qmax (pivot rows: 1) */
    float iq;    /* RN(1 / qmax) */
    uint32_t bo; /* width | byte offset of the row's codes << 8 */
};

/* Four codes of a row at columns j0..j0+3 (j0 % 4 == 0) -> x = (r c) * (z / qmax). B = 0: b. */
template <int B>
__device__ __forceinline__ void sq_uquad(float (&v)[4], const uint8_t *buf, uint32_t roff, int b,
                                         int j0, const sq_urow &ro, const float (&c)[4])
{
    const uint32_t bit = (uint32_t)j0 * (uint32_t)(B ? B : b);
    uint32_t W;
    if (B == 8) {
        W = *(const uint32_t *)(buf + roff + (bit >> 3));
    } else if (B == 4) {
        W = *(const uint16_t *)(buf + roff + (bit >> 3));
    } else if (B == 2) {
        W = buf[roff + (bit >> 3)];
    } else { /* 4b <= 32 bits within two aligned words (16 bytes of slack after the block) */
        const uint32_t a = roff + ((bit >> 5) << 2);
        W = __funnelshift_r(*(const uint32_t *)(buf + a), *(const uint32_t *)(buf + a + 4),
                            bit & 31u);
    }
#pragma unroll
    for (int n = 0; n < 4; n++) {
        float z;
        if constexpr (B != 0) {
            constexpr int G = 23 / B; /* codes per extraction word (position-exponent decode) */
            const int s = (n / G) * G * B, p = n * B - s;
            const uint32_t Wn = s ? W >> s : W;
            const float f =
                __uint_as_float(((uint32_t)(150 - p) << 23) | (Wn & (sq_bw<B>::MASK << p)));
            z = f - ((float)(1u << (23 - p)) + (float)sq_bw<B>::QM);
        } else {
            const uint32_t mask = (1u << b) - 1u;
            const uint32_t u = (W >> (n * b)) & mask;
            z = __uint_as_float(0x4B000000u | u) - __uint_as_float(0x4B000000u | (mask >> 1));
        }
        v[n] = __fmul_rn(__fmul_rn(ro.r, c[n]), sq_div(z, ro.qm, ro.iq));
    }
}

/*
 * Four dense values at element n of dst (16-byte fp32 / 8-byte bf16 store when `vec`); bf16 by
 * the reference's scalar conversion where `scalar` (sq_bf16_rn: NaNs keep their bits).
 */
template <int DT>
__device__ __forceinline__ void sq_ustore4(void *dst, size_t n, const float (&v)[4], bool vec,
                                           bool scalar)
{
    if (DT == SQ_F32) {
        float *p = (float *)dst + n;
        if (vec) {
            *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++)
                p[k] = v[k];
        }
        return;
    }
    uint16_t *p = (uint16_t *)dst + n;
    if (!scalar && vec) {
        *(uint2 *)p = make_uint2(sq_bf16x2(v[0], v[1]), sq_bf16x2(v[2], v[3]));
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++)
            p[k] = sq_bf16_rn(v[k]);
    }
}

/*
 * Row i's four values at columns j0..j0+3: fp16 values of a pivot row (only
 * with B = 0) or the decoded codes. Returns whether the row is a pivot row.
 */
template <int B>
__device__ __forceinline__ bool sq_urow_quad(float (&v)[4], const uint8_t *buf, const sq_urow &ro,
                                             int j0, const float (&c)[4])
{
    const int b = (int)(ro.bo & 0xffu);
    const uint32_t roff = ro.bo >> 8;
    if (B == 0 && b == STEPQ_BITS_PIVOT) { /* warp-uniform */
        const uint2 h = *(const uint2 *)(buf + roff + 2 * j0);
        const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&h.x));
        const float2 d = __half22float2(*reinterpret_cast<const __half2 *>(&h.y));
        v[0] = a.x, v[1] = a.y, v[2] = d.x, v[3] = d.y;
        return true;
    }
    sq_uquad<B>(v, buf, roff, b, j0, ro, c);
    return false;
}

/*
 * [K,V]: the block's 128 rows, warp w rows 16w + 4g + k (g, k = 0..3), lane
 * l columns 4l..4l+3; each row leaves as soon as it is decoded. B: the
 * head's uniform width, or 0 (run-time widths and pivot rows).
 */
template <int B, int DT>
__device__ __forceinline__ void sq_unpack_rows(const uint8_t *buf, const sq_urow *rows,
                                               const float *cs, void *dst, size_t off, bool vec,
                                               bool slow, int w, int lane)
{
    const int j0 = 4 * lane;
    const float4 c4 = *(const float4 *)(cs + j0);
    const float c[4] = { c4.x, c4.y, c4.z, c4.w };
#pragma unroll 1
    for (int g = 0; g < 4; g++) {
        float v[4][4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int i = 16 * w + 4 * g + k;
            const bool piv = sq_urow_quad<B>(v[k], buf, rows[i], j0, c);
            sq_ustore4<DT>(dst, off + (size_t)i * SQ_D + j0, v[k], vec, slow || piv);
        }
    }
}

/*
 * fp32 [K,V] through the shared buffer T (32 rows x 128 columns, float4
 * granules swizzled by row: granule q of row r sits at q ^ (r & 7), so the
 * row writes and the row reads by lane are conflict-free). Chunk ch holds
 * rows 32ch..32ch+31: warp w decodes rows 4w..4w+3 of it (lane l columns
 * 4l..4l+3), then writes back its own 4 rows, lane l columns l + 32m (m =
 * 0..3), after a warp barrier only: every warp store is 128 contiguous bytes,
 * the pattern that measured 82-85% of copy bandwidth where 16-byte-per-lane
 * stores measured 53% (GDN). No vector stores, so any stride works.
 */
template <int B>
__device__ __forceinline__ void sq_unpack_rows_t(const uint8_t *buf, const sq_urow *rows,
                                                 const float *cs, float4 *T, void *dst, size_t off,
                                                 int w, int lane)
{
    const int j0 = 4 * lane;
    const float4 c4 = *(const float4 *)(cs + j0);
    const float c[4] = { c4.x, c4.y, c4.z, c4.w };
    const float *Tf = (const float *)T;
#pragma unroll 1
    for (int ch = 0; ch < 4; ch++) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int rr = 4 * w + k;
            float v[4];
            sq_urow_quad<B>(v, buf, rows[32 * ch + rr], j0, c);
            T[rr * 32 + (lane ^ (rr & 7))] = make_float4(v[0], v[1], v[2], v[3]);
        }
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int rr = 4 * w + k;
            float *d = (float *)dst + off + (size_t)(32 * ch + rr) * SQ_D;
#pragma unroll
            for (int m = 0; m < 4; m++) {
                const int q = 8 * m + (lane >> 2);
                d[32 * m + lane] = Tf[rr * SQ_D + 4 * (q ^ (rr & 7)) + (lane & 3)];
            }
        }
        __syncwarp(); /* T's rows are rewritten by the next chunk */
    }
}

/*
 * [V,K] through the shared buffer U (UB bytes), by column: a chunk of RC rows
 * (UB / 128 / element bytes: 128 bf16 or 64 fp32 rows in 32 KiB), whose NP
 * 16-byte pieces per column leave as NP lanes' 16-byte stores (one barrier
 * per chunk, instead of a 2- or 4-byte store per element and two barriers per
 * 32 rows, which held bf16 [V,K] at 49-59% of copy bandwidth on the H200).
 *   Decode: warp w takes RC / 32 groups of 4 rows (group q: rows 4q..4q+3 of
 *   the chunk), lane l columns 4l..4l+3, as sq_unpack_rows; each column's 4
 *   values (16 bytes fp32, 8 bf16: the unit of group q) go to U in one store.
 *   bf16 rounds here, by the reference's scalar conversion where a row of the
 *   group is a pivot row or `slow` (sq_bf16_rn and cvt.rn agree except on
 *   NaNs, so the group's other rows lose nothing).
 *   Store: pass p, thread t: column 256 / NP p + t / NP, piece h = t % NP.
 * Swizzle, within a column's NP pieces: piece h sits at h ^ f, f = (column / 4)
 * % NP; bf16 units (half pieces) swap halves where column / 32 is odd. So
 * the decode's stores (lanes' columns 4 apart) and the pieces' reads are
 * conflict-free. U's size (sq_uvk_bytes): 16 KiB for bf16 (64 rows, 8 pieces
 * per column), 32 KiB for fp32 (64 rows). At 32 KiB the GDN layer, whose
 * pivot head makes every block's staging 32 KiB, fits 3 blocks per SM, at 16
 * KiB 4; measured on the H100 at B = 512 (kernels/cuda/README.md): bf16 7%
 * faster at 16 KiB (GDN; KDA equal), fp32 5-7% slower (32 fp32 rows a chunk).
 */
template <int B, int DT, int UB>
__device__ __forceinline__ void sq_unpack_vk(const uint8_t *buf, const sq_urow *rows,
                                             const float *cs, uint8_t *U, void *dst, size_t off,
                                             bool vec, bool slow, int w, int lane)
{
    constexpr int ES = DT == SQ_F32 ? 4 : 2; /* element bytes */
    constexpr int CB = UB / SQ_D;            /* a column's bytes per chunk */
    constexpr int RC = CB / ES;              /* rows per chunk */
    constexpr int NP = CB / 16;              /* 16-byte pieces per column and chunk */
    constexpr int G = RC / 32;               /* 4-row groups per warp and chunk */
    constexpr int PE = 16 / ES;              /* elements per piece */
    constexpr int LNP = NP == 8 ? 3 : 4;     /* log2 NP */
    static_assert(G >= 1 && (NP == 8 || NP == 16), "sq_unpack_vk: chunk shape");
    const int j0 = 4 * lane, t = 32 * w + lane, h = t & (NP - 1);
    const float4 c4 = *(const float4 *)(cs + j0);
    const float c[4] = { c4.x, c4.y, c4.z, c4.w };
#pragma unroll 1
    for (int ch = 0; ch < SQ_D / RC; ch++) {
        if (ch)
            __syncthreads(); /* U is rewritten */
#pragma unroll
        for (int g = 0; g < G; g++) {
            const int q = G * w + g;
            float v[4][4];
            bool sc = slow;
#pragma unroll
            for (int k = 0; k < 4; k++)
                sc |= sq_urow_quad<B>(v[k], buf, rows[RC * ch + 4 * q + k], j0, c);
#pragma unroll
            for (int cc = 0; cc < 4; cc++) {
                const int col = j0 + cc, f = (col >> 2) & (NP - 1);
                if (DT == SQ_F32) {
                    *(float4 *)(U + col * CB + (q ^ f) * 16) =
                        make_float4(v[0][cc], v[1][cc], v[2][cc], v[3][cc]);
                } else {
                    const int at = ((q >> 1) ^ f) * 16 + ((q & 1) ^ ((col >> 5) & 1)) * 8;
                    const uint2 u =
                        sc ? make_uint2(sq_bf16_rn(v[0][cc]) | (uint32_t)sq_bf16_rn(v[1][cc]) << 16,
                                        sq_bf16_rn(v[2][cc]) | (uint32_t)sq_bf16_rn(v[3][cc]) << 16)
                           : make_uint2(sq_bf16x2(v[0][cc], v[1][cc]),
                                        sq_bf16x2(v[2][cc], v[3][cc]));
                    *(uint2 *)(U + col * CB + at) = u;
                }
            }
        }
        __syncthreads();
#pragma unroll 2
        for (int p = 0; p < NP / 2; p++) {
            const int col = SQ_THREADS / NP * p + (t >> LNP), f = (col >> 2) & (NP - 1);
            uint4 x = *(const uint4 *)(U + col * CB + (h ^ f) * 16);
            if (DT == SQ_BF16 && ((col >> 5) & 1))
                x = make_uint4(x.z, x.w, x.x, x.y);
            const size_t n = off + (size_t)col * SQ_D + RC * ch + PE * h;
            if (vec) {
                sq_st16((uint8_t *)dst + n * ES, x.x, x.y, x.z, x.w);
            } else {
                const uint32_t wd[4] = { x.x, x.y, x.z, x.w };
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    if (DT == SQ_F32) {
                        ((uint32_t *)dst)[n + k] = wd[k];
                    } else {
                        ((uint16_t *)dst)[n + 2 * k] = (uint16_t)wd[k];
                        ((uint16_t *)dst)[n + 2 * k + 1] = (uint16_t)(wd[k] >> 16);
                    }
                }
            }
        }
    }
}

/* sq_unpack_vk's U for dense dtype DT (above) */
template <int DT> constexpr int sq_uvk_bytes()
{
    return DT == SQ_BF16 ? 16384 : 32768;
}

/* The block's 128 rows into dst: [V,K] through U, fp32 [K,V] through T, bf16 [K,V] directly. */
template <int B, int DT, bool VK>
__device__ __forceinline__ void sq_unpack_head(const uint8_t *buf, const sq_urow *rows,
                                               const float *cs, void *T, void *dst, size_t off,
                                               bool vec, bool slow, int w, int lane)
{
    if constexpr (VK)
        sq_unpack_vk<B, DT, sq_uvk_bytes<DT>()>(buf, rows, cs, (uint8_t *)T, dst, off, vec, slow, w,
                                                lane);
    else if constexpr (DT == SQ_F32)
        sq_unpack_rows_t<B>(buf, rows, cs, (float4 *)T, dst, off, w, lane);
    else
        sq_unpack_rows<B, DT>(buf, rows, cs, dst, off, vec, slow, w, lane);
}

/*
 * One block per (entry, head) on a (heads, batch) grid: blocks that run
 * together write neighbouring heads of one entry. DT: SQ_F32 or SQ_BF16;
 * VK: [V,K].
 */
template <int DT, bool VK>
__global__ void __launch_bounds__(SQ_THREADS, SQ_UMIN_BLOCKS) sq_unpack_kernel(sq_io io)
{
    extern __shared__ __align__(16) uint8_t sq_dyn[];
    __shared__ sq_urow rows[SQ_D];
    __shared__ __align__(16) float cs[SQ_D];
    void *T = nullptr; /* [V,K]: U of sq_unpack_vk; fp32 [K,V]: 32 x 128 (16 KiB) */
    if constexpr (VK) {
        __shared__ uint4 u[sq_uvk_bytes<DT>() / 16];
        T = u;
    } else if constexpr (DT == SQ_F32) {
        __shared__ float4 tr[32 * 32];
        T = tr;
    }
    const int hv = blockIdx.x, e = blockIdx.y, t = threadIdx.x;
    const int32_t slot = io.slots ? io.slots[e] : e;
    if (slot < 0 || slot >= io.n_slots)
        return; /* uniform over the block */
    const sq_head_desc *hd = io.heads + hv;
    const uint8_t *blk = io.pages + (size_t)slot * io.page_stride + hd->block_off;
    sq_stage_block(sq_dyn, blk, hd->block_bytes);
    /* row and column scales straight from the page while the block travels: one barrier */
    bool bad = false;
    if (t < SQ_D) {
        const int b = hd->bits[t];
        const bool piv = b == STEPQ_BITS_PIVOT;
        const float r = piv ? 1.0f : sq_h2f(((const uint16_t *)(blk + hd->row_scale_off))[t]);
        const float c =
            hd->has_col ? sq_h2f(((const uint16_t *)(blk + hd->col_scale_off))[t]) : 1.0f;
        const float qm = piv ? 1.0f : (float)((1 << (b - 1)) - 1);
        sq_urow ro;
        ro.r = r;
        ro.qm = qm;
        ro.iq = piv ? 1.0f : sq_iqm[b & 15];
        ro.bo = (uint32_t)b | (uint32_t)hd->row_off[t] << 8;
        rows[t] = ro;
        cs[t] = c;
        bad = !isfinite(r) || !isfinite(c);
    }
    sq_cp_async_wait_all();
    const bool slow = __syncthreads_or(bad);
    const size_t off = (size_t)e * io.dense_stride + (size_t)hv * SQ_D * SQ_D;
    const int w = t >> 5, lane = t & 31;
    const bool vec = io.dense_vec;
    /* one width for every row: templated decode; else run-time widths */
    switch (hd->ubits) {
    case 2:
        sq_unpack_head<2, DT, VK>(sq_dyn, rows, cs, T, io.dense, off, vec, slow, w, lane);
        break;
    case 3:
        sq_unpack_head<3, DT, VK>(sq_dyn, rows, cs, T, io.dense, off, vec, slow, w, lane);
        break;
    case 4:
        sq_unpack_head<4, DT, VK>(sq_dyn, rows, cs, T, io.dense, off, vec, slow, w, lane);
        break;
    case 5:
        sq_unpack_head<5, DT, VK>(sq_dyn, rows, cs, T, io.dense, off, vec, slow, w, lane);
        break;
    case 6:
        sq_unpack_head<6, DT, VK>(sq_dyn, rows, cs, T, io.dense, off, vec, slow, w, lane);
        break;
    case 8:
        sq_unpack_head<8, DT, VK>(sq_dyn, rows, cs, T, io.dense, off, vec, slow, w, lane);
        break;
    default:
        sq_unpack_head<0, DT, VK>(sq_dyn, rows, cs, T, io.dense, off, vec, slow, w, lane);
        break;
    }
}

#endif /* STEPQ_KERNELS_CUDA_UNPACK_KERNEL_CUH */
