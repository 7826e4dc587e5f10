/*
 * Replay primitives, storage methods in the loop, a small thread pool and
 * rank statistics for `stepq calibrate` / `stepq eval` (tools/calib.h).
 */
#include "tools/calib/calib.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/dsp.h"
#include "kernels/quant.h"
#include "plugin/err.h"

void stepq__calib_head_free(struct stepq__calib_head *h)
{
    free(h->q);
    free(h->k);
    free(h->v);
    free(h->g);
    free(h->beta);
    memset(h, 0, sizeof(*h));
}

int stepq__calib_head_load(const struct stepq__trace_set *ts, int stream, int li, int hv,
                           struct stepq__calib_head *h)
{
    const struct stepq__trace_info *I = stepq__trace_set_info(ts);
    int T = I->T, K = I->K, V = I->V, kda = I->arch == STEPQ_ARCH_KDA;
    memset(h, 0, sizeof(*h));
    h->T = T;
    h->K = K;
    h->V = V;
    h->kda = kda;
    h->q = malloc(sizeof(float) * (size_t)T * K);
    h->k = malloc(sizeof(float) * (size_t)T * K);
    h->v = malloc(sizeof(float) * (size_t)T * V);
    h->g = malloc(sizeof(float) * (size_t)T * (kda ? K : 1));
    h->beta = malloc(sizeof(float) * (size_t)T);
    if (!h->q || !h->k || !h->v || !h->g || !h->beta) {
        stepq__calib_head_free(h);
        return stepq__error(STEPQ_ENOMEM, "trace replay: out of memory");
    }
    int rc = stepq__trace_head(ts, stream, li, hv, 0, T, h->q, h->k, h->v, h->g, h->beta, NULL);
    if (rc < 0) {
        stepq__calib_head_free(h);
        return rc;
    }
    /* Same normalisation as kernels/recurrence.c (double sum, eps 1e-6), then the scale. */
    for (int t = 0; t < T; t++) {
        float *q = h->q + (size_t)t * K, *k = h->k + (size_t)t * K;
        if (I->qk_l2norm) {
            double sq = 0.0, sk = 0.0;
            for (int i = 0; i < K; i++) {
                sq += (double)q[i] * q[i];
                sk += (double)k[i] * k[i];
            }
            float iq = (float)(1.0 / sqrt(sq + 1e-6)), ik = (float)(1.0 / sqrt(sk + 1e-6));
            for (int i = 0; i < K; i++) {
                q[i] *= iq;
                k[i] *= ik;
            }
        }
        for (int i = 0; i < K; i++)
            q[i] *= I->scale;
    }
    return STEPQ_OK;
}

void stepq__calib_step(float *S, const struct stepq__calib_head *h, int t, float *o)
{
    const float *g = h->g + (size_t)t * (h->kda ? h->K : 1);
    stepq__head_update(S, (size_t)h->V, 1, h->kda, h->K, h->V, h->q + (size_t)t * h->K,
                       h->k + (size_t)t * h->K, h->v + (size_t)t * h->V, g, h->beta[t], o);
}

/*
 * E <- D E and the prediction acc = E^T k from the decayed E (native only),
 * then E <- E - beta k acc^T; returns the squared readout ||E^T q||^2 of the
 * result when read is set. Unit-stride loops the compiler vectorises; each
 * acc[j] sums over rows in order (two rows per pass), as before.
 */
static double err_step(float *E, const struct stepq__calib_head *h, int t, int native, int read)
{
    int K = h->K, V = h->V, i;
    const float *g = h->g + (size_t)t * (h->kda ? K : 1);
    const float *k = h->k + (size_t)t * K;
    double acc[STEPQ__MAX_HEAD_DIM];
    float d0 = expf(g[0]);

    if (!native) {
        /* The oracle only decays: the prediction is not used. */
        for (i = 0; i < K; i++) {
            float d = h->kda ? expf(g[i]) : d0;
            float *row = E + (size_t)i * V;
            for (int j = 0; j < V; j++)
                row[j] *= d;
        }
        return read ? stepq__calib_read_err(E, h, t) : 0.0;
    }
    for (int j = 0; j < V; j++)
        acc[j] = 0.0;
    for (i = 0; i + 2 <= K; i += 2) {
        float da = h->kda ? expf(g[i]) : d0, db = h->kda ? expf(g[i + 1]) : d0;
        float *ra = E + (size_t)i * V, *rb = ra + V;
        double ka = k[i], kb = k[i + 1];
        for (int j = 0; j < V; j++) {
            ra[j] *= da;
            rb[j] *= db;
            acc[j] = (acc[j] + ka * ra[j]) + kb * rb[j];
        }
    }
    for (; i < K; i++) {
        float d = h->kda ? expf(g[i]) : d0;
        float *row = E + (size_t)i * V;
        double ki = k[i];
        for (int j = 0; j < V; j++) {
            row[j] *= d;
            acc[j] += ki * row[j];
        }
    }

    /* The correction, with the readout of the corrected rows in the same pass. */
    const float *q = h->q + (size_t)t * K;
    float accf[STEPQ__MAX_HEAD_DIM];
    float b = h->beta[t];
    double rd[STEPQ__MAX_HEAD_DIM], s = 0.0;
    for (int j = 0; j < V; j++) {
        accf[j] = (float)acc[j];
        rd[j] = 0.0;
    }
    for (i = 0; i + 2 <= K; i += 2) {
        float *ra = E + (size_t)i * V, *rb = ra + V;
        float bka = b * k[i], bkb = b * k[i + 1];
        double qa = q[i], qb = q[i + 1];
        for (int j = 0; j < V; j++) {
            ra[j] -= bka * accf[j];
            rb[j] -= bkb * accf[j];
            rd[j] = (rd[j] + qa * ra[j]) + qb * rb[j];
        }
    }
    for (; i < K; i++) {
        float *row = E + (size_t)i * V;
        float bk = b * k[i];
        double qi = q[i];
        for (int j = 0; j < V; j++) {
            row[j] -= bk * accf[j];
            rd[j] += qi * row[j];
        }
    }
    if (!read)
        return 0.0;
    for (int j = 0; j < V; j++)
        s += rd[j] * rd[j];
    return s;
}

void stepq__calib_err_step(float *E, const struct stepq__calib_head *h, int t, int native)
{
    err_step(E, h, t, native, 0);
}

double stepq__calib_err_step_read(float *E, const struct stepq__calib_head *h, int t, int native)
{
    return err_step(E, h, t, native, 1);
}

double stepq__calib_read_err(const float *E, const struct stepq__calib_head *h, int t)
{
    int K = h->K, V = h->V, i;
    const float *q = h->q + (size_t)t * K;
    double acc[STEPQ__MAX_HEAD_DIM], s = 0.0;
    for (int j = 0; j < V; j++)
        acc[j] = 0.0;
    for (i = 0; i + 2 <= K; i += 2) {
        const float *ra = E + (size_t)i * V, *rb = ra + V;
        double qa = q[i], qb = q[i + 1];
        for (int j = 0; j < V; j++)
            acc[j] = (acc[j] + qa * ra[j]) + qb * rb[j];
    }
    for (; i < K; i++) {
        const float *row = E + (size_t)i * V;
        double qi = q[i];
        for (int j = 0; j < V; j++)
            acc[j] += qi * row[j];
    }
    for (int j = 0; j < V; j++)
        s += acc[j] * acc[j];
    return s;
}

int stepq__calib_quant_init(struct stepq__calib_quant *qz, stepq_method method, stepq_arch arch,
                            int K, int V, const uint8_t *row_bits, const float *w)
{
    memset(qz, 0, sizeof(*qz));
    if (method == STEPQ_METHOD_FP32) {
        qz->dense_fp32 = 1;
        return STEPQ_OK;
    }
    int rc = stepq__head_layout_init(&qz->hl, method, arch, K, V, row_bits, 0);
    if (rc < 0)
        return rc;
    qz->block = malloc(qz->hl.block_bytes);
    if (!qz->block) {
        stepq__head_layout_free(&qz->hl);
        return stepq__error(STEPQ_ENOMEM, "quantizer: out of memory");
    }
    qz->w = stepq__method_uses_row_impact(method) ? w : NULL;
    return STEPQ_OK;
}

int stepq__calib_quant_apply(struct stepq__calib_quant *qz, float *x)
{
    int exact = 0;
    if (qz->dense_fp32)
        return 0;
    /* The calls only fail on a bad layout or fit, which init already rejected. */
    if (qz->decode_fit)
        stepq__quantize_head_fit_ex(&qz->hl, x, qz->w, qz->block, qz->block, NULL,
                                    qz->hl.decode_fit, &exact);
    else
        stepq__quantize_head(&qz->hl, x, qz->w, qz->block, NULL);
    stepq__dequantize_head(&qz->hl, qz->block, x);
    return qz->decode_fit && qz->hl.decode_fit == STEPQ_DECODE_FIT_ROWS && exact;
}

void stepq__calib_quant_use_decode_fit(struct stepq__calib_quant *qz)
{
    qz->decode_fit = !qz->dense_fp32;
    /* the map's arith fp16: the decode step is the fp16 one where it covers the head (its
     * scratch is allocated once; without it the store stays the fp32 fit, as the tile path) */
    if (qz->decode_fit && qz->hl.arith == STEPQ_ARITH_FP16 && stepq__step_f16_supports(&qz->hl)) {
        qz->scratch = malloc(sizeof(float) * 2 * (size_t)qz->hl.d_k * (size_t)qz->hl.d_v);
        qz->f16 = qz->scratch != NULL;
    }
    stepq__calib_quant_reset(qz);
}

uint32_t stepq__calib_quant_step_f16(struct stepq__calib_quant *qz,
                                     const struct stepq__calib_head *h, int t, float *x, float *o)
{
    const int K = h->K, V = h->V;
    const float *g = h->g + (size_t)t * (h->kda ? K : 1);
    uint32_t fl =
        stepq__step_head_f16(&qz->hl, qz->block, qz->w, h->q + (size_t)t * K, h->k + (size_t)t * K,
                             h->v + (size_t)t * V, g, h->beta[t], qz->block, o, qz->scratch, NULL);
    stepq__dequantize_head(&qz->hl, qz->block, x);
    return fl;
}

void stepq__calib_quant_reset(struct stepq__calib_quant *qz)
{
    if (!qz->dense_fp32 && qz->block)
        memset(qz->block, 0, qz->hl.block_bytes);
}

int stepq__calib_quant_init_layout(struct stepq__calib_quant *qz,
                                   const struct stepq__head_layout *hl, const float *w)
{
    memset(qz, 0, sizeof(*qz));
    if (hl->method == STEPQ_METHOD_FP32) {
        qz->dense_fp32 = 1;
        return STEPQ_OK;
    }
    qz->hl = *hl; /* its arrays stay the pool's */
    qz->borrowed = 1;
    qz->block = malloc(hl->block_bytes);
    if (!qz->block)
        return stepq__error(STEPQ_ENOMEM, "quantizer: out of memory");
    qz->w = stepq__method_uses_row_impact(hl->method) ? w : NULL;
    return STEPQ_OK;
}

void stepq__calib_quant_free(struct stepq__calib_quant *qz)
{
    if (!qz->dense_fp32 && !qz->borrowed)
        stepq__head_layout_free(&qz->hl);
    free(qz->block);
    free(qz->scratch);
    memset(qz, 0, sizeof(*qz));
}

/* ---------------------------------------------------------------- threads */

struct pool_ctx {
    stepq__calib_job_fn fn;
    void *ctx;
    int n;
    atomic_int next, done;
};

struct worker_arg {
    struct pool_ctx *p;
    int id;
};

static void *worker_main(void *arg)
{
    struct worker_arg *wa = arg;
    struct pool_ctx *p = wa->p;
    for (;;) {
        int j = atomic_fetch_add(&p->next, 1);
        if (j >= p->n)
            break;
        p->fn(p->ctx, j, wa->id);
        atomic_fetch_add(&p->done, 1);
    }
    return NULL;
}

int stepq__calib_default_threads(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 256 ? 256 : (int)n;
}

int stepq__calib_parallel(int n, int threads, stepq__calib_job_fn fn, void *ctx, const char *label)
{
    struct pool_ctx p = { fn, ctx, n, 0, 0 };
    if (threads < 1)
        threads = 1;
    if (threads > n)
        threads = n > 0 ? n : 1;
    pthread_t tid[256];
    struct worker_arg wa[256];
    int started = 0;
    for (int i = 1; i < threads && i < 256; i++) {
        wa[i].p = &p;
        wa[i].id = i;
        if (pthread_create(&tid[i], NULL, worker_main, &wa[i]) != 0)
            break;
        started = i;
    }
    int tty = label && isatty(2);
    if (tty && started > 0) {
        /* The calling thread reports progress while the others work, then joins in. */
        int last = -1;
        while (atomic_load(&p.next) < n) {
            int d = atomic_load(&p.done);
            if (d != last) {
                fprintf(stderr, "\r%s: %d/%d", label, d, n);
                last = d;
            }
            struct timespec ts = { 0, 200 * 1000 * 1000 };
            nanosleep(&ts, NULL);
        }
    }
    wa[0].p = &p;
    wa[0].id = 0;
    worker_main(&wa[0]);
    for (int i = 1; i <= started; i++)
        pthread_join(tid[i], NULL);
    if (tty)
        fprintf(stderr, "\r%s: %d/%d\n", label, n, n);
    return STEPQ_OK;
}

/* ---------------------------------------------------------------- statistics */

struct rank_item {
    double v;
    int i;
};

static int cmp_rank(const void *a, const void *b)
{
    const struct rank_item *x = a, *y = b;
    if (x->v != y->v)
        return x->v < y->v ? -1 : 1;
    return x->i - y->i;
}

static void ranks(const double *x, int n, double *r, struct rank_item *tmp)
{
    for (int i = 0; i < n; i++) {
        tmp[i].v = x[i];
        tmp[i].i = i;
    }
    qsort(tmp, (size_t)n, sizeof(*tmp), cmp_rank);
    for (int i = 0; i < n;) {
        int j = i;
        while (j + 1 < n && tmp[j + 1].v == tmp[i].v)
            j++;
        double avg = 0.5 * (i + j) + 1.0; /* average rank of ties */
        for (int k = i; k <= j; k++)
            r[tmp[k].i] = avg;
        i = j + 1;
    }
}

double stepq__calib_half_life(double l)
{
    return l < 0 ? 0.69314718055994531 / -l : 1e30;
}

double stepq__calib_spearman(const double *x, const double *y, int n)
{
    if (n < 2)
        return NAN;
    double *rx = malloc(sizeof(double) * (size_t)n), *ry = malloc(sizeof(double) * (size_t)n);
    struct rank_item *tmp = malloc(sizeof(*tmp) * (size_t)n);
    double res = NAN;
    if (rx && ry && tmp) {
        ranks(x, n, rx, tmp);
        ranks(y, n, ry, tmp);
        double mx = 0, my = 0, sxy = 0, sxx = 0, syy = 0;
        for (int i = 0; i < n; i++) {
            mx += rx[i];
            my += ry[i];
        }
        mx /= n;
        my /= n;
        for (int i = 0; i < n; i++) {
            sxy += (rx[i] - mx) * (ry[i] - my);
            sxx += (rx[i] - mx) * (rx[i] - mx);
            syy += (ry[i] - my) * (ry[i] - my);
        }
        res = sxx > 0 && syy > 0 ? sxy / sqrt(sxx * syy) : NAN;
    }
    free(rx);
    free(ry);
    free(tmp);
    return res;
}
