/*
 * Comparisons of CUDA results with the reference's, and their tolerances:
 * the pages of a pool's layer (with the proof that every differing code of a
 * pack is a rounding tie), outputs of a step, health words and counters.
 * Each returns 0, or 1 after checkasm_fail() named the first offending
 * element.
 */
#ifndef STEPQ_TESTS_CHECKASM_COMPARE_H
#define STEPQ_TESTS_CHECKASM_COMPARE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/format.h"
#include "tests/checkasm/fixture.h"

/* fp32 outputs, fp32 pages and fp32 unpacks: the same arithmetic in another order, rounding only.
 */
#define TOL_F32_NMSE 1e-10
/*
 * Codes of pages a step wrote, whose fp32 source is not known here: a code
 * may differ by +-1 where the two updated states put it on a rounding tie,
 * at most this fraction of the codes compared.
 */
#define TOL_STEP_CODE_FLIPS 1e-4
/*
 * The fp16 decode step (arith fp16; kernels/quant.h): the kernel runs the reference's half
 * operations, but its inputs' preparation (gate, beta sigmoid: CUDA's expf against libm's) can
 * differ by an ulp, which moves an fp16 rounding of a weight or of u now and then, and with it
 * the codes at near-ties of a column and the scales by an fp16 ulp or two. Bounds for those: the
 * fraction of codes of fp16 heads that differ (each by +-1), the ulps of their row and column
 * scales, the NMSE of the readout (half partial sums: one moved rounding is 2^-11 of a partial).
 */
#define TOL_F16_STEP_CODE_FLIPS 1e-3
#define TOL_F16_SCALE_ULPS      2
#define TOL_F16_OUT_NMSE        1e-6
/* fp16 scales and pivots: one ulp (the two sides compute the fp32 value in another order). */
#define TOL_FP16_ULPS 1
/* bf16 outputs: at most this fraction of the elements one rounding apart. */
#define TOL_BF16_OUT_OFF 0.01
/* ... each within one bf16 ulp of the larger plus this fraction of the head's RMS. */
#define TOL_BF16_OUT_RMS 1e-5

double ca_nmse(const float *a, const float *ref, size_t n);
uint16_t ca_rd16(const uint8_t *p);
/** Distance in ulps of two fp16 / bf16 bit patterns (sign-magnitude). */
int ca_ulp16(uint16_t a, uint16_t b);

/** The dense source of a pack, with which ca_compare_pages proves differing codes ties. */
struct ca_pack_src {
    const float *x; /**< n entries of HV heads in `layout`, widened to fp32 */
    size_t stride;  /**< elements from one entry to the next */
    stepq__layout layout;
    int n;
    const int32_t *slots; /**< entry e was packed into slot slots[e] (-1: skipped) */
};

/**
 * The CUDA pool's pages (got) against the host pool's (ref), both started
 * from `start`: every byte outside the tested layer's blocks, and the blocks
 * of slots with written[s] == 0, equal to start on both sides (no stray
 * write on either); the written blocks within the tolerances. With ps (a
 * pack) every differing code must be a proven rounding tie; without it (a
 * step) at most TOL_STEP_CODE_FLIPS of the codes may differ.
 */
int ca_compare_pages(const struct fx_pools *fx, const uint8_t *got, const uint8_t *ref,
                     const uint8_t *start, const uint8_t *written, const struct ca_pack_src *ps);

/** Health words of every page (slots + 1) and, when given, the 4 counters: equal. */
int ca_compare_health(const struct fx_pools *fx, const uint32_t *got, const uint32_t *ref,
                      const uint64_t *c_got, const uint64_t *c_ref);

/**
 * o of a step, CUDA (got) vs reference (ref), as raw tensors of io's layout
 * (fp32 packed, or bf16 rows o_stride apart): the rows of padding entries and
 * the gaps hold FX_SENTINEL bytes on both sides; the rest NMSE within
 * TOL_F32_NMSE (fp32), or bf16 within TOL_BF16_OUT_* (two fp32 readouts may
 * round to neighbouring bf16 values). *nmse (may be NULL) gets the fp32 NMSE.
 */
int ca_compare_o(const struct fx_step_io *io, const void *got, const void *ref,
                 const int32_t *slots, double *nmse);
/** ca_compare_o with the fp32 NMSE bound tol instead of TOL_F32_NMSE. */
int ca_compare_o_tol(const struct fx_step_io *io, const void *got, const void *ref,
                     const int32_t *slots, double tol, double *nmse);

/**
 * A refused call of the public API: its status is `want` and both the pool's
 * message and the thread's name `needle` (the argument at fault). what says
 * which call it was.
 */
int ca_expect_refused(stepq_pool_t *pool, int got, int want, const char *needle, const char *what);

/**
 * Starts the check of one pack or unpack configuration (checkasm_check),
 * named from its parameters: "<verb> <arch> <method>[@bits| mixed...] HV=.. n=..
 * <prep> <dtype> <layout>[ cuda ids outside 0..slots][ column kernel]".
 */
int ca_transfer_check(const struct fx_transfer *p, const char *verb, const char *prep);

/**
 * A refused call of an internal entry (no pool in front of it): its status is
 * `want` and the thread's message names the entry `who`.
 */
int ca_expect_refused_entry(int got, int want, const char *who, const char *what);

/** Both pools' pages and health words at one moment (the CUDA pool's read back). */
struct ca_snap {
    uint8_t *hp, *dp;
    uint32_t *hh, *dh;
};

/** Takes the snapshot: 0, or 1 after reporting the failure. Free with ca_snap_free. */
int ca_snap_take(struct fx_pools *fx, struct ca_snap *s);
void ca_snap_free(struct ca_snap *s);

/**
 * Both pools' pages and health words are still those of the snapshot s, and
 * no CUDA error is left behind (cudaGetLastError after a synchronisation).
 */
int ca_pools_unchanged(struct fx_pools *fx, const struct ca_snap *s, const char *what);

#endif /* STEPQ_TESTS_CHECKASM_COMPARE_H */
