/*
 * The exhaustive check of sq_div (common.cuh: a / b from b and RN(1/b), one Markstein correction):
 * a standalone program beside the library, not part of it. It compares sq_div(a, b, __frcp_rn(b))
 * bit for bit with the correctly rounded quotient __fdiv_rn(a, b) for every pair of significands,
 * a and b in [1, 2): 2^46 pairs, about a minute on one H200.
 *
 * Why significands suffice: for a = A 2^i, b = B 2^j (A, B in [1, 2)), every step of sq_div scales
 * exactly with the operands (RN(1/b) = RN(1/B) 2^-j, q = RN(a RN(1/b)) = RN(A RN(1/B)) 2^(i-j),
 * the residual a - q b = (A - q' B) 2^i, the corrected quotient 2^(i-j) times the reduced one) as
 * long as every intermediate value and the result are normal floats: 1/b, the quotient, and the
 * residual, whose magnitude is about 2^-24 |a|. So where |a| >= 2^-100 and 2^-120 <= |b| <= 2^120
 * and the quotient is normal, sq_div equals the IEEE division exactly when it does for the reduced
 * pair, and signs only flip every value. Zeros, subnormals and the far ranges are the callers' to
 * keep out (kernels/cuda/README.md, "fp8 pages").
 *
 * `stepq-div-probe` runs all of it (progress on stderr, the result on stdout); `stepq-div-probe
 * --sample N` only N values of b, the first and the last N / 2 significands (a test:
 * tests/kernels/meson.build; it exits 77 without a device). Exit status 0 when no pair differs, 1
 * when one does (printed), 2 on a CUDA error.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/common.cuh"

#define DIV_BLOCK 256
#define DIV_FIRST 8 /* differing pairs kept for the report */

struct div_report {
    unsigned long long bad;
    unsigned kept;
    uint32_t a[DIV_FIRST], b[DIV_FIRST];
};

/* Block x: significand b0 + x of b against all 2^23 significands of a. */
__global__ void __launch_bounds__(DIV_BLOCK) div_check(uint32_t b0, div_report *rep)
{
    const uint32_t ib = 0x3f800000u | (b0 + blockIdx.x);
    const float b = __uint_as_float(ib), binv = __frcp_rn(b);
    unsigned long long bad = 0;
    for (uint32_t m = threadIdx.x; m < (1u << 23); m += DIV_BLOCK) {
        const float a = __uint_as_float(0x3f800000u | m);
        const float q = sq_div(a, b, binv), r = __fdiv_rn(a, b);
        if (__float_as_uint(q) != __float_as_uint(r)) {
            bad++;
            const unsigned k = atomicAdd(&rep->kept, 1u);
            if (k < DIV_FIRST) {
                rep->a[k] = __float_as_uint(a);
                rep->b[k] = ib;
            }
        }
    }
    if (bad)
        atomicAdd(&rep->bad, bad);
}

#define DIV_CU(x)                                                                     \
    do {                                                                              \
        cudaError_t e_ = (x);                                                         \
        if (e_ != cudaSuccess) {                                                      \
            fprintf(stderr, "stepq-div-probe: %s: %s\n", #x, cudaGetErrorString(e_)); \
            return 2;                                                                 \
        }                                                                             \
    } while (0)

static int usage(FILE *f)
{
    fprintf(f, "usage: stepq-div-probe [--sample N]\n"
               "  Compares sq_div(a, b, RN(1/b)) with the correctly rounded a / b for every pair\n"
               "  of float significands (2^46 pairs; --sample N: the first and last N/2 "
               "significands of b).\n"
               "  Exit 0: no pair differs; 1: some do (printed); 2: CUDA error; 77: no device.\n");
    return f == stdout ? 0 : 2;
}

int main(int argc, char **argv)
{
    uint32_t nb = 1u << 23;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return usage(stdout);
        if (!strcmp(argv[i], "--sample") && i + 1 < argc) {
            char *end;
            const unsigned long v = strtoul(argv[++i], &end, 10);
            if (*end || v == 0 || v > (1u << 23)) {
                fprintf(stderr, "stepq-div-probe: --sample: '%s' is not in 1..8388608\n", argv[i]);
                return 2;
            }
            nb = (uint32_t)v;
            continue;
        }
        fprintf(stderr, "stepq-div-probe: unknown option '%s'\n", argv[i]);
        return usage(stderr);
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("stepq-div-probe: no CUDA device, skipped\n");
        return 77;
    }
    div_report *rep;
    DIV_CU(cudaMallocManaged(&rep, sizeof(*rep)));
    memset(rep, 0, sizeof(*rep));
    cudaEvent_t t0, t1;
    DIV_CU(cudaEventCreate(&t0));
    DIV_CU(cudaEventCreate(&t1));
    DIV_CU(cudaEventRecord(t0));
    /* the first nb / 2 and the last nb - nb / 2 significands of b (all of them without --sample) */
    const uint32_t step = 1u << 16,
                   ranges[2][2] = { { 0, nb / 2 }, { (1u << 23) - (nb - nb / 2), 1u << 23 } };
    uint32_t done = 0;
    for (int g = 0; g < 2; g++)
        for (uint32_t b0 = ranges[g][0]; b0 < ranges[g][1]; b0 += step) {
            const uint32_t cnt = ranges[g][1] - b0 < step ? ranges[g][1] - b0 : step;
            div_check<<<cnt, DIV_BLOCK>>>(b0, rep);
            DIV_CU(cudaGetLastError());
            DIV_CU(cudaDeviceSynchronize());
            done += cnt;
            fprintf(stderr, "\rstepq-div-probe: %u of %u significands of b", done, nb);
        }
    DIV_CU(cudaEventRecord(t1));
    DIV_CU(cudaEventSynchronize(t1));
    float ms = 0;
    DIV_CU(cudaEventElapsedTime(&ms, t0, t1));
    fprintf(stderr, "\n");
    printf("stepq-div-probe: %llu pairs (a in [1, 2), %u values of b), %llu differ, %.1f s\n",
           (unsigned long long)nb << 23, nb, rep->bad, ms / 1000.0);
    for (unsigned k = 0; k < rep->kept && k < DIV_FIRST; k++) {
        float a, b;
        memcpy(&a, &rep->a[k], 4);
        memcpy(&b, &rep->b[k], 4);
        const float bi = 1.0f / b, q = a * bi; /* the host's IEEE float operations */
        printf("  a = %a, b = %a: sq_div %a, a / b %a\n", a, b, fmaf(fmaf(-q, b, a), bi, q), a / b);
    }
    const int bad = rep->bad != 0;
    cudaFree(rep);
    return bad;
}
