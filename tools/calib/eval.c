/* The evaluation core of `stepq eval` (tools/calib/eval.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant.h"
#include "plugin/err.h"
#include "tools/calib/calib.h"
#include "tools/calib/eval.h"
#include "pool/internal.h"

/*
 * One pass of state_sums: a[u] = sum_e (X[u][e] - Sr[e])^2 for four tiles, and, when r is
 * not NULL, *r += sum_e Sr[e]^2 in the same pass. Inlined with r constant at each call, so
 * that the test leaves the loop.
 */
static inline void diff_sums4(const float *Sr, const float *const X[4], size_t KV, double *r,
                              double a[4])
{
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0, rr = r ? *r : 0.0;
    for (size_t e = 0; e < KV; e++) {
        double y = Sr[e];
        double d0 = (double)X[0][e] - y, d1 = (double)X[1][e] - y;
        double d2 = (double)X[2][e] - y, d3 = (double)X[3][e] - y;
        if (r)
            rr += y * y;
        a0 += d0 * d0;
        a1 += d1 * d1;
        a2 += d2 * d2;
        a3 += d3 * d3;
    }
    if (r)
        *r = rr;
    a[0] = a0;
    a[1] = a1;
    a[2] = a2;
    a[3] = a3;
}

/*
 * s2 = sum_e Sr[e]^2 and se[m] = sum_e (Sq_m[e] - Sr[e])^2 for the M tiles of Sq,
 * each summed over e in order as one loop per sum would, but up to five sums
 * per pass: one chain of dependent additions per sum is what limits the speed,
 * and the chains of different sums overlap.
 */
static void state_sums(const float *Sr, const float *Sq, int M, size_t KV, double *s2, double *se)
{
    double r = 0.0;
    for (int m0 = 0; m0 < M; m0 += 4) {
        const float *X[4];
        double a[4];
        int n = M - m0 < 4 ? M - m0 : 4;
        for (int u = 0; u < 4; u++)
            X[u] = Sq + KV * (size_t)(m0 + (u < n ? u : 0));
        if (m0 == 0)
            diff_sums4(Sr, X, KV, &r, a);
        else
            diff_sums4(Sr, X, KV, NULL, a);
        for (int u = 0; u < n; u++)
            se[m0 + u] = a[u];
    }
    *s2 = r;
}

void stepq__eval_head_job(void *vctx, int job, int worker)
{
    (void)worker;
    struct stepq__eval *c = vctx;
    const struct stepq__trace_info *I = c->I;
    int li = job / I->HV, hv = job % I->HV, K = I->K, V = I->V, T = I->T, S = I->n_streams;
    int M = c->n_maps + 1, H = I->n_layers * I->HV, kda = I->arch == STEPQ_ARCH_KDA;
    size_t KV = (size_t)K * V;
    struct stepq__calib_quant qz[STEPQ__EVAL_MAX_MAPS + 1], qi[2];
    double e2[STEPQ__EVAL_MAX_MAPS + 1], se[STEPQ__EVAL_MAX_MAPS + 1];
    float *Sr = malloc(sizeof(float) * KV), *Sq = malloc(sizeof(float) * KV * (size_t)M);
    float *E = malloc(sizeof(float) * KV * 4), *orf = malloc(sizeof(float) * (size_t)V);
    float *oq = malloc(sizeof(float) * (size_t)V), *Xb = malloc(sizeof(float) * KV);
    float *orq = malloc(sizeof(float) * (size_t)V); /* the fp32 update's readout, unused */
    int nq = 0, ni = 0;
    memset(qz, 0, sizeof(qz));
    memset(qi, 0, sizeof(qi));
    if (!Sr || !Sq || !E || !orf || !oq || !Xb || !orq) {
        c->rc[job] = stepq__error(STEPQ_ENOMEM, "eval: out of memory");
        goto out;
    }
    for (int m = 0; m < M; m++, nq++) {
        if (m < c->n_maps) {
            /* Head hv of layer li exactly as the map's pool stores it. */
            struct stepq__packed_layer pl;
            stepq__pool_packed_layer(stepq__pool_resolve(c->pools[m]), li, &pl);
            c->rc[job] = stepq__calib_quant_init_layout(
                &qz[m], &pl.heads[hv], pl.row_impact ? pl.row_impact + (size_t)hv * K : NULL);
            /* Every store here follows a recurrent update: the map's decode fit, as the pool's
             * decode step (exact unless the map says decode_fit norefit or rows). */
            if (c->rc[job] == STEPQ_OK)
                stepq__calib_quant_use_decode_fit(&qz[m]);
        } else {
            uint8_t rb[STEPQ__MAX_HEAD_DIM];
            memset(rb, 6, sizeof(rb)); /* the internal uniform@6 of the lifetime statistics */
            c->rc[job] =
                stepq__calib_quant_init(&qz[m], STEPQ_METHOD_UNIFORM, I->arch, K, V, rb, NULL);
        }
        if (c->rc[job] < 0)
            goto out;
    }
    for (int b = 0; b < 2; b++, ni++) {
        uint8_t rb[STEPQ__MAX_HEAD_DIM];
        memset(rb, b ? 8 : 6, sizeof(rb));
        if ((c->rc[job] = stepq__calib_quant_init(&qi[b], STEPQ_METHOD_UNIFORM, I->arch, K, V, rb,
                                                  NULL)) < 0)
            goto out;
    }

    double lsum = 0.0;
    for (int s = 0; s < S; s++) {
        struct stepq__calib_head h;
        if ((c->rc[job] = stepq__calib_head_load(c->ts, s, li, hv, &h)) < 0)
            goto out;
        memset(Sr, 0, sizeof(float) * KV);
        memset(Sq, 0, sizeof(float) * KV * (size_t)M);
        for (int m = 0; m < M; m++)
            stepq__calib_quant_reset(&qz[m]); /* a fresh page per stream */
        double *inj = c->inj + ((size_t)job * S + s) * 4;
        for (int t = 0; t < T; t++) {
            const float *g = h.g + (size_t)t * (kda ? K : 1);
            for (int i = 0; i < (kda ? K : 1); i++)
                lsum += g[i] / (kda ? K : 1);
            stepq__calib_step(Sr, &h, t, orf);
            double r2 = 0.0, s2;
            for (int j = 0; j < V; j++)
                r2 += (double)orf[j] * orf[j];
            int bk = t / c->bucket;
            for (int m = 0; m < M; m++) {
                struct stepq__eval_acc *a = &c->acc[((size_t)m * H + job) * S + s];
                float *X = Sq + KV * m;
                if (qz[m].f16) {
                    /* the fp16 step reads its old block and writes the new one: its readout
                     * is oq; Xb (the gain's reference) is the fp32 update of the old state */
                    memcpy(Xb, X, sizeof(float) * KV);
                    stepq__calib_step(Xb, &h, t, orq);
                    (void)stepq__calib_quant_step_f16(&qz[m], &h, t, X, oq);
                } else {
                    stepq__calib_step(X, &h, t, oq);
                }
                double e2m = 0.0, odm = 0.0, qdm = 0.0, qrm = 0.0;
                for (int j = 0; j < V; j++) {
                    e2m += ((double)oq[j] - orf[j]) * ((double)oq[j] - orf[j]);
                    odm += (double)oq[j] * orf[j];
                }
                e2[m] = e2m;
                /* The store's gain: how much of the state a store keeps along itself (a
                 * shrinking quantizer, e.g. a least-squares refit of noisy codes, gives < 1). */
                if (!qz[m].f16) {
                    memcpy(Xb, X, sizeof(float) * KV);
                    a->rows_exact += stepq__calib_quant_apply(&qz[m], X);
                }
                for (size_t e = 0; e < KV; e++) {
                    qdm += (double)X[e] * Xb[e];
                    qrm += (double)Xb[e] * Xb[e];
                }
                a->odot += odm;
                a->qdot += qdm;
                a->qref += qrm;
                a->stores += 1;
            }
            if (kda && c->row_serr) { /* per key row, the internal uniform@6 (method n_maps) */
                const float *X = Sq + KV * c->n_maps;
                double *rs = c->row_serr + ((size_t)job * S + s) * K;
                for (int i = 0; i < K; i++) {
                    double a = 0.0;
                    for (int j = 0; j < V; j++) {
                        double d = (double)X[(size_t)i * V + j] - Sr[(size_t)i * V + j];
                        a += d * d;
                    }
                    rs[i] += a;
                    c->row_lret[(size_t)job * K + i] += g[i] / ((double)S * T);
                }
            }
            state_sums(Sr, Sq, M, KV, &s2, se);
            for (int m = 0; m < M; m++) {
                struct stepq__eval_acc *a = &c->acc[((size_t)m * H + job) * S + s];
                a->err += e2[m];
                a->ref += r2;
                if (t < STEPQ__EVAL_EDGE) {
                    a->err_a += e2[m];
                    a->ref_a += r2;
                }
                if (t >= T - STEPQ__EVAL_EDGE) {
                    a->err_b += e2[m];
                    a->ref_b += r2;
                }
                a->serr += se[m];
                a->sref += s2;
                size_t ci = (((size_t)m * H + job) * S + s) * c->nb + bk;
                c->curve_err[ci] += e2[m];
                c->curve_ref[ci] += r2;
            }
            if (t == c->t_inj) {
                for (int b = 0; b < 2; b++) {
                    float *En = E + KV * (2 * b), *Eo = E + KV * (2 * b + 1);
                    memcpy(En, Sr, sizeof(float) * KV);
                    stepq__calib_quant_apply(&qi[b], En);
                    for (size_t e = 0; e < KV; e++)
                        En[e] -= Sr[e];
                    memcpy(Eo, En, sizeof(float) * KV);
                }
            } else if (t > c->t_inj) {
                for (int b = 0; b < 2; b++) {
                    float *En = E + KV * (2 * b), *Eo = E + KV * (2 * b + 1);
                    inj[2 * b] += stepq__calib_err_step_read(En, &h, t, 1);
                    inj[2 * b + 1] += stepq__calib_err_step_read(Eo, &h, t, 0);
                }
            }
        }
        stepq__calib_head_free(&h);
    }
    c->lret[job] = lsum / ((double)S * T);
out:
    for (int m = 0; m < nq; m++)
        stepq__calib_quant_free(&qz[m]);
    for (int b = 0; b < ni; b++)
        stepq__calib_quant_free(&qi[b]);
    free(Sr);
    free(Sq);
    free(E);
    free(orf);
    free(oq);
    free(Xb);
    free(orq);
}
