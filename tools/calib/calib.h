/*
 * Calibration and evaluation engine shared by `stepq calibrate` and
 * `stepq eval`: per-head replay of traces through the fp32 reference
 * recurrence (kernels/dsp.h stepq__head_update), the storage methods in the
 * loop (kernels/quant.h), and the bit-allocation solver.
 */
#ifndef STEPQ_TOOLS_CALIB_H
#define STEPQ_TOOLS_CALIB_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/format.h"
#include "tools/calib/trace.h"

/* ---------------------------------------------------------------- head data */

/** One (stream, layer, value head) of a trace in fp32, q/k l2-normalised and q scaled. */
struct stepq__calib_head {
    int T, K, V, kda;
    float *q, *k, *v, *g, *beta; /* [T][K], [T][K], [T][V], [T] or [T][K], [T] */
};

int stepq__calib_head_load(const struct stepq__trace_set *ts, int stream, int li, int hv,
                           struct stepq__calib_head *h);
void stepq__calib_head_free(struct stepq__calib_head *h);

/** One recurrent step on an fp32 tile [K][V] (decay, delta update, readout o[V]). */
void stepq__calib_step(float *S, const struct stepq__calib_head *h, int t, float *o);
/** Propagates an error tile one step: native E <- (I - beta k k^T) D E; oracle E <- D E. */
void stepq__calib_err_step(float *E, const struct stepq__calib_head *h, int t, int native);
/** Squared readout error ||E^T q_t||^2. */
double stepq__calib_read_err(const float *E, const struct stepq__calib_head *h, int t);
/** stepq__calib_err_step then stepq__calib_read_err (the same bits), with one pass less over E. */
double stepq__calib_err_step_read(float *E, const struct stepq__calib_head *h, int t, int native);

/** A storage method for one head, applied in place (quantize + reconstruct). */
struct stepq__calib_quant {
    struct stepq__head_layout hl;
    int borrowed; /* hl is a copy of a pool's layout: not freed here */
    uint8_t *block;
    const float *w; /* row impact (spatial, stepq) or NULL */
    int dense_fp32; /* nothing to do */
    int decode_fit; /* stepq__calib_quant_use_decode_fit: stores fit as a decode step does */
    /* with decode_fit, a head of an arith fp16 map the fp16 step covers (kernels/step_f16.c):
     * its stores are that step (stepq__calib_quant_step_f16), scratch its 2 K V floats */
    int f16;
    float *scratch;
};

/**
 * A decode step of an f16 quantizer (qz->f16): the fp16 step of its block with token t's
 * inputs of h, in place, readout into o (V floats); x gets the decoded new state. Returns the
 * step's health flags.
 */
struct stepq__calib_head;
uint32_t stepq__calib_quant_step_f16(struct stepq__calib_quant *qz,
                                     const struct stepq__calib_head *h, int t, float *x, float *o);

/** row_bits: K widths (NULL for dense methods). */
int stepq__calib_quant_init(struct stepq__calib_quant *qz, stepq_method method, stepq_arch arch,
                            int K, int V, const uint8_t *row_bits, const float *w);
/**
 * A quantizer of one head as a pool stores it: hl is the pool's head layout
 * (borrowed: it must outlive the quantizer), w its row impact or NULL.
 */
int stepq__calib_quant_init_layout(struct stepq__calib_quant *qz,
                                   const struct stepq__head_layout *hl, const float *w);
/**
 * Stores x through the quantizer and reconstructs it in place. Returns 1 where a store under
 * the decode fit rows fell back to the exact fit (the old column scales could not serve), else 0.
 */
int stepq__calib_quant_apply(struct stepq__calib_quant *qz, float *x);
/**
 * From now on each store fits as the pool's decode step does (the layout's
 * decode_fit, kernels/quant.h: exact, norefit, or rows against the previous
 * store's block), not as a prefill pack (always exact). Starts a stream.
 */
void stepq__calib_quant_use_decode_fit(struct stepq__calib_quant *qz);
/**
 * A new stream: the previous store is forgotten, as a fresh zero page (the
 * rows fit's first store then falls back to the exact fit).
 */
void stepq__calib_quant_reset(struct stepq__calib_quant *qz);
void stepq__calib_quant_free(struct stepq__calib_quant *qz);

/* ---------------------------------------------------------------- threads */

typedef void (*stepq__calib_job_fn)(void *ctx, int job, int worker);
/** Runs fn(ctx, j, worker) for j in [0, n) on `threads` threads (job order is irrelevant to
 *  the results when each job writes only its own outputs). Shows a progress line on stderr
 *  when stderr is a terminal and `label` is non-NULL. */
int stepq__calib_parallel(int n, int threads, stepq__calib_job_fn fn, void *ctx, const char *label);
int stepq__calib_default_threads(void);

/* ---------------------------------------------------------------- allocation */

/**
 * Multiple-choice knapsack: choose one option per unit, minimising the total
 * cost subject to sum of sizes <= cap. cost [n][m], size [n][m] (sizes are
 * non-negative integers, e.g. bit widths when all units have the same
 * number of values). choice[n] receives option indices.
 * Exact dynamic programme when n * (cap + 1) <= dp_limit, else Lagrangian
 * relaxation (bisection on the bit price) followed by a greedy repair that
 * never exceeds cap. Ties are broken towards the lower option index and the
 * lower unit index, so the result is deterministic.
 * Returns 0 (exact), 1 (Lagrangian), or STEPQ_ERANGE when even the smallest
 * options do not fit, STEPQ_ENOMEM.
 */
int stepq__calib_allocate(int n, int m, const double *cost, const int *size, long long cap,
                          long long dp_limit, int *choice);

/* ---------------------------------------------------------------- statistics */

double stepq__calib_spearman(const double *x, const double *y, int n);

/** Half-life in tokens of a mean log retention l (ln 2 / -l); 1e30 for l >= 0 (no decay). */
double stepq__calib_half_life(double l);

#endif /* STEPQ_TOOLS_CALIB_H */
