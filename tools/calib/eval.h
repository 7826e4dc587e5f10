/*
 * The evaluation core of `stepq eval`: one job per (layer, head) replays
 * every stream of that head with each map's storage method in the loop (the
 * state quantized after every update, the output read before quantization)
 * against the fp32 reference, and accumulates the readout, state and
 * single-injection errors that tools/eval.c reports. Jobs write only their
 * own entries, so results do not depend on the thread count.
 */
#ifndef STEPQ_TOOLS_CALIB_EVAL_H
#define STEPQ_TOOLS_CALIB_EVAL_H

#include "stepq/stepq.h"
#include "tools/calib/trace.h"

#define STEPQ__EVAL_MAX_MAPS 64
#define STEPQ__EVAL_EDGE     256 /* first / last steps reported separately */

struct stepq__eval_acc {               /* per (method, head, stream) */
    double err, ref;                   /* readout, all steps */
    double err_a, ref_a, err_b, ref_b; /* first / last EDGE steps */
    double serr, sref;                 /* state */
    double odot;                       /* sum_t <o^, o>: the readout gain's numerator (/ ref) */
    double qdot, qref;                 /* sum_t <Q(S^), S^>, sum_t <S^, S^> over the stores */
    double stores, rows_exact;         /* stores; those the fit rows left to the exact fit */
};

struct stepq__eval {
    const struct stepq__trace_set *ts;
    const struct stepq__trace_info *I;
    int n_maps; /* user maps; method n_maps is the internal uniform@6 */
    stepq_map_t **maps;
    stepq_pool_t **pools; /* [n_maps] a host pool per map: it owns the head layouts */
    int nb, bucket;       /* time buckets */
    int t_inj;
    struct stepq__eval_acc *acc;   /* [M][heads][S] */
    double *curve_err, *curve_ref; /* [M][heads][S][nb] */
    double *lret;                  /* [heads] mean g (GDN) / mean over rows (KDA) */
    double *inj;                   /* [heads][S][4]: native6, oracle6, native8, oracle8 */
    int *rc;
    /* KDA only (NULL otherwise): a unit is a key row, so the lifetime statistics are also
     * kept per row: the internal uniform@6's state error and the mean log decay. */
    double *row_serr; /* [heads][S][K] */
    double *row_lret; /* [heads][K] */
};

/** One job (stepq__calib_parallel's job function): head `job` of c's traces. */
void stepq__eval_head_job(void *c, int job, int worker);

#endif /* STEPQ_TOOLS_CALIB_EVAL_H */
