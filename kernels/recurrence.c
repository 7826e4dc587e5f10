/*
 * The fp32 reference recurrence of GDN and KDA: one decode step on dense
 * states in either native layout, and a chunked prefill that equals the
 * token-by-token recurrence. It also holds the helpers every reference
 * entry shares (declared at the end of kernels/dsp.h): the checks of step
 * arguments and slot lists, the input preparation of one head, the update
 * of one head on an fp32 tile and health notes. kernels/step.c (the packed
 * entries) calls them; nothing here calls step.c.
 *
 * Dot products accumulate in double; states and vectors are float, as in the
 * fla / transformers fp32 paths, so the reference is at least as accurate as
 * the kernels it checks.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/dsp.h"
#include "plugin/err.h"

#define L2NORM_EPS 1e-6

void stepq__health_note(uint32_t *health, uint64_t *counts, int32_t slot, uint32_t flags)
{
    if (!flags)
        return;
    if (health && slot >= 0)
        health[slot] |= flags;
    if (counts)
        for (int bit = 0; bit < STEPQ__HEALTH_NCOUNTS; bit++)
            if (flags & (1u << bit))
                counts[bit]++;
}

/*
 * Element i of a step tensor of type dt as fp32 (bf16 widens exactly), and
 * its store (bf16: round to nearest even): the one place where the
 * reference meets the server's element types, so that the fp32 path reads
 * and writes exactly the floats it did when the tensors were float *.
 */
static inline float load_elem(const void *p, stepq_dtype dt, size_t i)
{
    if (dt == STEPQ_DTYPE_BF16)
        return stepq__bf16_to_float(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline void store_elem(void *p, stepq_dtype dt, size_t i, float x)
{
    if (dt == STEPQ_DTYPE_BF16)
        ((uint16_t *)p)[i] = stepq__bf16_from_float(x);
    else
        ((float *)p)[i] = x;
}

struct stepq__step_strides stepq__step_strides_of(const struct stepq__step_args *a)
{
    size_t qk = (size_t)a->H * (size_t)a->d_k, vo = (size_t)a->HV * (size_t)a->d_v;
    size_t g = (size_t)a->HV * (size_t)(a->arch == STEPQ_ARCH_KDA ? a->d_k : 1);
    struct stepq__step_strides s = {
        .q = a->q_stride ? a->q_stride : qk,
        .k = a->k_stride ? a->k_stride : qk,
        .v = a->v_stride ? a->v_stride : vo,
        .g = a->g_stride ? a->g_stride : g,
        .beta = a->beta_stride ? a->beta_stride : (size_t)a->HV,
        .o = a->o_stride ? a->o_stride : vo,
    };
    return s;
}

void stepq__store_out(const struct stepq__step_args *a, int b, int hv, const float *o)
{
    size_t off = (size_t)b * stepq__step_strides_of(a).o + (size_t)hv * (size_t)a->d_v;
    for (int j = 0; j < a->d_v; j++)
        store_elem(a->o, a->dtype, off + (size_t)j, o ? o[j] : 0.0f);
}

/* fp32 and bf16 are implemented; fp16 (a valid stepq_dtype) and anything else are not. */
static int check_dtype(stepq_dtype dt, const char *field, const char *who)
{
    if (dt == STEPQ_DTYPE_FP32 || dt == STEPQ_DTYPE_BF16)
        return STEPQ_OK;
    if (dt == STEPQ_DTYPE_FP16)
        return stepq__error(STEPQ_ENOTSUP, "%s: %s fp16 is not supported (fp32, bf16)", who, field);
    return stepq__error(STEPQ_ENOTSUP, "%s: %s %d is not supported (fp32, bf16)", who, field,
                        (int)dt);
}

/*
 * A nonzero stride below the packed row length would make consecutive
 * requests overlap: a caller bug, never a view a server can hand.
 */
static int check_strides(const struct stepq__step_args *a, const char *who)
{
    size_t qk = (size_t)a->H * (size_t)a->d_k, vo = (size_t)a->HV * (size_t)a->d_v;
    int kda = a->arch == STEPQ_ARCH_KDA;
    const struct {
        size_t given, packed;
        const char *name, *row;
    } f[6] = {
        { a->q_stride, qk, "q_stride", "H*d_k" },
        { a->k_stride, qk, "k_stride", "H*d_k" },
        { a->v_stride, vo, "v_stride", "HV*d_v" },
        { a->g_stride, (size_t)a->HV * (size_t)(kda ? a->d_k : 1), "g_stride",
          kda ? "HV*d_k" : "HV" },
        { a->beta_stride, (size_t)a->HV, "beta_stride", "HV" },
        { a->o_stride, vo, "o_stride", "HV*d_v" },
    };
    for (int n = 0; n < 6; n++)
        if (f[n].given && f[n].given < f[n].packed)
            return stepq__error(STEPQ_EINVAL, "%s: %s %zu < %s = %zu (rows would overlap)", who,
                                f[n].name, f[n].given, f[n].row, f[n].packed);
    return STEPQ_OK;
}

int stepq__check_step_args(const struct stepq__step_args *a, const char *who)
{
    if (!a)
        return stepq__error(STEPQ_EINVAL, "%s: NULL arguments", who);
    if (a->arch != STEPQ_ARCH_GDN && a->arch != STEPQ_ARCH_KDA)
        return stepq__error(STEPQ_EINVAL, "%s: arch %d is neither gdn nor kda", who, (int)a->arch);
    if (a->batch < 0 || a->H < 1 || a->HV < 1 || a->HV % a->H)
        return stepq__error(STEPQ_EINVAL,
                            "%s: batch=%d, H=%d, HV=%d (need batch >= 0, HV a multiple of H)", who,
                            a->batch, a->H, a->HV);
    if (a->d_k < 1 || a->d_k > STEPQ__MAX_HEAD_DIM || a->d_v < 1 || a->d_v > STEPQ__MAX_HEAD_DIM)
        return stepq__error(STEPQ_EINVAL, "%s: d_k=%d, d_v=%d outside 1..%d", who, a->d_k, a->d_v,
                            STEPQ__MAX_HEAD_DIM);
    int rc;
    if ((rc = check_dtype(a->dtype, "dtype", who)) < 0 ||
        (rc = check_dtype(a->param_dtype, "param_dtype", who)) < 0 ||
        (rc = check_strides(a, who)) < 0)
        return rc;
    if (a->batch == 0)
        return STEPQ_OK;
    if (!a->q || !a->k || !a->v || !a->g || !a->beta || !a->o)
        return stepq__error(STEPQ_EINVAL, "%s: q, k, v, g, beta and o must not be NULL", who);
    if (a->opt.gate_in_kernel && (!a->A_log || !a->dt_bias))
        return stepq__error(STEPQ_EINVAL, "%s: gate_in_kernel needs A_log and dt_bias", who);
    if (!(a->opt.scale <= 0.0f || isfinite(a->opt.scale)))
        return stepq__error(STEPQ_EINVAL, "%s: scale %g is not finite", who, (double)a->opt.scale);
    return STEPQ_OK;
}

int stepq__check_slot_list(int n, const int32_t *slots, int n_slots, int distinct, const char *who)
{
    if (n_slots < 1)
        return stepq__error(STEPQ_EINVAL, "%s: n_slots = %d", who, n_slots);
    if (n < 0 || (n > 0 && !slots))
        return stepq__error(STEPQ_EINVAL, "%s: n=%d with %s slot ids", who, n,
                            slots ? "valid" : "NULL");
    uint8_t *seen = distinct ? calloc(((size_t)n_slots + 7) / 8, 1) : NULL;
    if (distinct && !seen)
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory", who);
    int rc = STEPQ_OK;
    for (int e = 0; e < n && rc == STEPQ_OK; e++) {
        int32_t s = slots[e];
        if (s == -1)
            continue;
        if (s < 0 || s >= n_slots)
            rc = stepq__error(STEPQ_EINVAL, "%s: slots[%d] = %d is outside -1, 0..%d", who, e,
                              (int)s, n_slots - 1);
        else if (seen && s > 0 && (seen[s / 8] & (1u << (s % 8))))
            rc = stepq__error(STEPQ_EINVAL, "%s: slot %d appears twice", who, (int)s);
        else if (seen)
            seen[s / 8] |= (uint8_t)(1u << (s % 8));
    }
    free(seen);
    return rc;
}

static float softplus(float x)
{
    /* torch's softplus (beta 1, threshold 20) */
    return x > 20.0f ? x : (float)log1p(exp((double)x));
}

static int all_finite(const float *x, int n)
{
    for (int i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

static void l2normalize(float *x, int n)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * (double)x[i];
    float inv = (float)(1.0 / sqrt(ss + L2NORM_EPS));
    for (int i = 0; i < n; i++)
        x[i] *= inv;
}

int stepq__prep_head(const struct stepq__step_args *a, int b, int hv, float *q, float *k, float *v,
                     float *g, float *beta)
{
    int d_k = a->d_k, d_v = a->d_v;
    int hq = hv / (a->HV / a->H);
    int n_g = a->arch == STEPQ_ARCH_KDA ? d_k : 1;
    struct stepq__step_strides s = stepq__step_strides_of(a);
    stepq_dtype dt = a->dtype, pt = a->param_dtype;
    size_t q_off = (size_t)b * s.q + (size_t)hq * d_k, k_off = (size_t)b * s.k + (size_t)hq * d_k;
    size_t v_off = (size_t)b * s.v + (size_t)hv * d_v, g_off = (size_t)b * s.g + (size_t)hv * n_g;

    for (int i = 0; i < d_k; i++) {
        q[i] = load_elem(a->q, dt, q_off + i);
        k[i] = load_elem(a->k, dt, k_off + i);
    }
    for (int j = 0; j < d_v; j++)
        v[j] = load_elem(a->v, dt, v_off + j);
    if (!all_finite(q, d_k) || !all_finite(k, d_k) || !all_finite(v, d_v))
        return 1;

    for (int i = 0; i < n_g; i++) {
        float graw = load_elem(a->g, dt, g_off + i);
        if (a->opt.gate_in_kernel) {
            float bias = load_elem(a->dt_bias, pt, (size_t)hv * n_g + i);
            g[i] = -expf(load_elem(a->A_log, pt, (size_t)hv)) * softplus(graw + bias);
        } else {
            g[i] = graw;
        }
    }
    if (!all_finite(g, n_g))
        return 1;
    float bt = load_elem(a->beta, dt, (size_t)b * s.beta + hv);
    if (a->opt.beta_sigmoid)
        bt = 1.0f / (1.0f + expf(-bt));
    if (!isfinite(bt))
        return 1;
    *beta = bt;

    if (a->opt.l2norm) {
        l2normalize(q, d_k);
        l2normalize(k, d_k);
    }
    float scale = a->opt.scale > 0.0f ? a->opt.scale : (float)(1.0 / sqrt((double)d_k));
    for (int i = 0; i < d_k; i++)
        q[i] *= scale;
    return 0;
}

int stepq__prep_step_head(const struct stepq__step_args *a, int b, int hv, int32_t slot, float *q,
                          float *k, float *v, float *g, float *beta)
{
    if (!stepq__prep_head(a, b, hv, q, k, v, g, beta))
        return 0;
    stepq__store_out(a, b, hv, NULL);
    stepq__health_note(a->health, a->counts, slot, STEPQ_HEALTH_INPUT);
    return 1;
}

/*
 * x if it is finite, else +0 with 1 OR-ed into *bad: isfinite() on the bits
 * (Inf and NaN are the floats whose exponent field is all ones) and a mask
 * instead of a branch, so that the loops below vectorise.
 */
static inline float finite_or_zero(float x, uint32_t *bad)
{
    uint32_t b;
    memcpy(&b, &x, sizeof(b));
    uint32_t nf = (b & 0x7f800000u) == 0x7f800000u;
    *bad |= nf;
    b &= nf - 1u;
    memcpy(&x, &b, sizeof(x));
    return x;
}

/*
 * The unit-stride case (cs == 1: [d_k][d_v] rows, every replay in tools/) of
 * stepq__head_update, written so that the compiler vectorises over j. Each
 * acc[j] takes the same products in the same order (rows i = 0, 1, ...) as in
 * the general loop, two rows per pass to halve its loads and stores.
 */
static uint32_t head_update_unit(float *S, size_t rs, int arch_kda, int d_k, int d_v,
                                 const float *q, const float *k, const float *v, const float *g,
                                 float beta, float *o)
{
    double acc[STEPQ__MAX_HEAD_DIM];
    float u[STEPQ__MAX_HEAD_DIM];
    uint32_t bad = 0, bad_out = 0;
    float decay = expf(g[0]);
    int i = 0;

    for (int j = 0; j < d_v; j++)
        acc[j] = 0.0;
    for (; i + 2 <= d_k; i += 2) {
        float d0 = arch_kda ? expf(g[i]) : decay, d1 = arch_kda ? expf(g[i + 1]) : decay;
        float *r0 = S + (size_t)i * rs, *r1 = r0 + rs;
        double k0 = k[i], k1 = k[i + 1];
        for (int j = 0; j < d_v; j++) {
            float s0 = r0[j] * d0, s1 = r1[j] * d1;
            r0[j] = s0;
            r1[j] = s1;
            acc[j] = (acc[j] + (double)s0 * k0) + (double)s1 * k1;
        }
    }
    for (; i < d_k; i++) {
        float d = arch_kda ? expf(g[i]) : decay;
        float *row = S + (size_t)i * rs;
        double ki = k[i];
        for (int j = 0; j < d_v; j++) {
            float s = row[j] * d;
            row[j] = s;
            acc[j] += (double)s * ki;
        }
    }
    for (int j = 0; j < d_v; j++)
        u[j] = (v[j] - (float)acc[j]) * beta;

    for (int j = 0; j < d_v; j++)
        acc[j] = 0.0;
    for (i = 0; i + 2 <= d_k; i += 2) {
        float *r0 = S + (size_t)i * rs, *r1 = r0 + rs;
        float k0 = k[i], k1 = k[i + 1];
        double q0 = q[i], q1 = q[i + 1];
        for (int j = 0; j < d_v; j++) {
            float s0 = finite_or_zero(r0[j] + k0 * u[j], &bad);
            float s1 = finite_or_zero(r1[j] + k1 * u[j], &bad);
            r0[j] = s0;
            r1[j] = s1;
            acc[j] = (acc[j] + (double)s0 * q0) + (double)s1 * q1;
        }
    }
    for (; i < d_k; i++) {
        float *row = S + (size_t)i * rs;
        float ki = k[i];
        double qi = q[i];
        for (int j = 0; j < d_v; j++) {
            float s = finite_or_zero(row[j] + ki * u[j], &bad);
            row[j] = s;
            acc[j] += (double)s * qi;
        }
    }
    for (int j = 0; j < d_v; j++)
        o[j] = finite_or_zero((float)acc[j], &bad_out);
    return (bad ? STEPQ_HEALTH_STATE : 0) | (bad_out ? STEPQ_HEALTH_OUTPUT : 0);
}

uint32_t stepq__head_update(float *S, size_t rs, size_t cs, int arch_kda, int d_k, int d_v,
                            const float *q, const float *k, const float *v, const float *g,
                            float beta, float *o)
{
    if (cs == 1 && (d_k == 1 || rs >= (size_t)d_v))
        return head_update_unit(S, rs, arch_kda, d_k, d_v, q, k, v, g, beta, o);

    double acc[STEPQ__MAX_HEAD_DIM];
    float u[STEPQ__MAX_HEAD_DIM];
    uint32_t flags = 0;
    float decay = expf(g[0]);

    /* Decay, then the prediction S^T k from the decayed state. */
    for (int j = 0; j < d_v; j++)
        acc[j] = 0.0;
    for (int i = 0; i < d_k; i++) {
        float d = arch_kda ? expf(g[i]) : decay;
        float *row = S + (size_t)i * rs;
        double ki = k[i];
        for (int j = 0; j < d_v; j++) {
            float s = row[(size_t)j * cs] * d;
            row[(size_t)j * cs] = s;
            acc[j] += (double)s * ki;
        }
    }
    for (int j = 0; j < d_v; j++)
        u[j] = (v[j] - (float)acc[j]) * beta;

    /* Rank-1 update, sanitise, readout from the updated state. */
    for (int j = 0; j < d_v; j++)
        acc[j] = 0.0;
    for (int i = 0; i < d_k; i++) {
        float *row = S + (size_t)i * rs;
        float ki = k[i];
        double qi = q[i];
        for (int j = 0; j < d_v; j++) {
            float s = row[(size_t)j * cs] + ki * u[j];
            if (!isfinite(s)) {
                s = 0.0f;
                flags |= STEPQ_HEALTH_STATE;
            }
            row[(size_t)j * cs] = s;
            acc[j] += (double)s * qi;
        }
    }
    for (int j = 0; j < d_v; j++) {
        float r = (float)acc[j];
        if (!isfinite(r)) {
            r = 0.0f;
            flags |= STEPQ_HEALTH_OUTPUT;
        }
        o[j] = r;
    }
    return flags;
}

int stepq__ref_step_dense(const struct stepq__step_args *a, const struct stepq__dense_states *st)
{
    static const char who[] = "step (dense fp32)";
    int rc = stepq__check_step_args(a, who);

    if (rc < 0 || a->batch == 0)
        return rc;
    if (!st || !st->base)
        return stepq__error(STEPQ_EINVAL, "%s: NULL states", who);
    size_t head = (size_t)a->d_k * (size_t)a->d_v;
    if (st->slot_stride < head * (size_t)a->HV)
        return stepq__error(STEPQ_EINVAL, "%s: slot stride %zu < HV*d_k*d_v = %zu", who,
                            st->slot_stride, head * (size_t)a->HV);
    if (st->layout != STEPQ__LAYOUT_KV && st->layout != STEPQ__LAYOUT_VK)
        return stepq__error(STEPQ_EINVAL, "%s: unknown layout %d", who, (int)st->layout);
    if ((rc = stepq__check_slot_list(a->batch, a->slots, a->n_slots, 1, who)) < 0)
        return rc;

    size_t rs = st->layout == STEPQ__LAYOUT_KV ? (size_t)a->d_v : 1;
    size_t cs = st->layout == STEPQ__LAYOUT_KV ? 1 : (size_t)a->d_k;
    float q[STEPQ__MAX_HEAD_DIM], k[STEPQ__MAX_HEAD_DIM], v[STEPQ__MAX_HEAD_DIM];
    float g[STEPQ__MAX_HEAD_DIM], beta, o[STEPQ__MAX_HEAD_DIM];

    for (int b = 0; b < a->batch; b++) {
        int32_t s = a->slots[b];
        if (s < 0)
            continue;
        for (int hv = 0; hv < a->HV; hv++) {
            if (stepq__prep_step_head(a, b, hv, s, q, k, v, g, &beta))
                continue;
            float *S = st->base + (size_t)s * st->slot_stride + (size_t)hv * head;
            uint32_t fl = stepq__head_update(S, rs, cs, a->arch == STEPQ_ARCH_KDA, a->d_k, a->d_v,
                                             q, k, v, g, beta, o);
            stepq__store_out(a, b, hv, o);
            stepq__health_note(a->health, a->counts, s, fl);
        }
    }
    return STEPQ_OK;
}

/*
 * Chunked prefill. Inside a chunk with cumulative log gates G_t (per key
 * channel for KDA), the state before token t's update, decayed, is
 *   D_t S_{t-1} = e^{G_t} S0 + sum_{s<t} e^{G_t - G_s} k_s u_s^T,
 * so the corrections u solve the unit lower-triangular system
 *   u_t + sum_{s<t} beta_t (k_t . e^{G_t-G_s} k_s) u_s = beta_t (v_t - S0^T (e^{G_t} k_t)),
 * solved by forward substitution (the UT transform of fla's chunk kernels).
 * Outputs and the final state follow from the same sums. Only differences
 * G_t - G_s with s <= t are exponentiated, so nothing overflows whatever the
 * chunk length. The state is carried in double between chunks.
 */
int stepq__ref_prefill_chunked(const struct stepq__step_args *a, int chunk, float *state,
                               stepq__layout layout)
{
    static const char who[] = "prefill (chunked)";
    int rc = stepq__check_step_args(a, who);

    if (rc < 0)
        return rc;
    if (chunk < 1)
        return stepq__error(STEPQ_EINVAL, "%s: chunk length %d < 1", who, chunk);
    if (!state)
        return stepq__error(STEPQ_EINVAL, "%s: NULL state", who);
    if (layout != STEPQ__LAYOUT_KV && layout != STEPQ__LAYOUT_VK)
        return stepq__error(STEPQ_EINVAL, "%s: unknown layout %d", who, (int)layout);

    int T = a->batch, d_k = a->d_k, d_v = a->d_v, kda = a->arch == STEPQ_ARCH_KDA;
    int n_g = kda ? d_k : 1;
    int C = chunk < T ? chunk : (T > 0 ? T : 1);
    float scratch_q[STEPQ__MAX_HEAD_DIM], scratch_k[STEPQ__MAX_HEAD_DIM];
    float scratch_v[STEPQ__MAX_HEAD_DIM], scratch_g[STEPQ__MAX_HEAD_DIM], scratch_b;

    /* Refuse non-finite inputs before writing anything. */
    for (int t = 0; t < T; t++)
        for (int hv = 0; hv < a->HV; hv++)
            if (stepq__prep_head(a, t, hv, scratch_q, scratch_k, scratch_v, scratch_g, &scratch_b))
                return stepq__error(STEPQ_ENONFINITE,
                                    "%s: token %d, value head %d: non-finite input", who, t, hv);

    size_t nS = (size_t)d_k * d_v;
    double *S = malloc(sizeof(double) * nS);
    double *U = malloc(sizeof(double) * (size_t)C * d_v);
    double *G = malloc(sizeof(double) * (size_t)C * n_g);
    double *E = malloc(sizeof(double) * (size_t)C * d_k); /* e^{G_t} for the rows, per token */
    float *Q = malloc(sizeof(float) * (size_t)C * d_k);
    float *K = malloc(sizeof(float) * (size_t)C * d_k);
    float *V = malloc(sizeof(float) * (size_t)C * d_v);
    float *B = malloc(sizeof(float) * (size_t)C);
    double *acc = malloc(sizeof(double) * (size_t)(d_k > d_v ? d_k : d_v));
    if (!S || !U || !G || !E || !Q || !K || !V || !B || !acc) {
        rc = stepq__error(STEPQ_ENOMEM, "%s: out of memory", who);
        goto out;
    }

    size_t rs = layout == STEPQ__LAYOUT_KV ? (size_t)d_v : 1;
    size_t cs = layout == STEPQ__LAYOUT_KV ? 1 : (size_t)d_k;
    for (int hv = 0; hv < a->HV; hv++) {
        float *Sh = state + (size_t)hv * nS;
        for (int i = 0; i < d_k; i++)
            for (int j = 0; j < d_v; j++)
                S[(size_t)i * d_v + j] = Sh[(size_t)i * rs + (size_t)j * cs];

        for (int t0 = 0; t0 < T; t0 += C) {
            int n = T - t0 < C ? T - t0 : C;
            for (int t = 0; t < n; t++) {
                float gt[STEPQ__MAX_HEAD_DIM];
                stepq__prep_head(a, t0 + t, hv, Q + (size_t)t * d_k, K + (size_t)t * d_k,
                                 V + (size_t)t * d_v, gt, &B[t]);
                for (int c = 0; c < n_g; c++)
                    G[(size_t)t * n_g + c] = (t ? G[(size_t)(t - 1) * n_g + c] : 0.0) + gt[c];
                for (int i = 0; i < d_k; i++)
                    E[(size_t)t * d_k + i] = exp(G[(size_t)t * n_g + (kda ? i : 0)]);
            }
            for (int t = 0; t < n; t++) {
                const float *qt = Q + (size_t)t * d_k, *kt = K + (size_t)t * d_k;
                const double *et = E + (size_t)t * d_k;
                double *ut = U + (size_t)t * d_v;
                float ot[STEPQ__MAX_HEAD_DIM];

                /* rhs_t = beta_t (v_t - S0^T (e^{G_t} k_t)); inter-chunk readout S0^T (e^{G_t} q_t)
                 */
                for (int j = 0; j < d_v; j++)
                    ut[j] = 0.0;
                for (int j = 0; j < d_v; j++)
                    acc[j] = 0.0;
                for (int i = 0; i < d_k; i++) {
                    double ek = et[i] * kt[i], eq = et[i] * qt[i];
                    const double *Si = S + (size_t)i * d_v;
                    for (int j = 0; j < d_v; j++) {
                        ut[j] += Si[j] * ek;
                        acc[j] += Si[j] * eq;
                    }
                }
                for (int j = 0; j < d_v; j++)
                    ut[j] = (double)B[t] * ((double)V[(size_t)t * d_v + j] - ut[j]);

                /* forward substitution and the intra-chunk readout */
                for (int s = 0; s <= t; s++) {
                    const float *ks = K + (size_t)s * d_k;
                    double akk = 0.0, aqk = 0.0;
                    if (kda) {
                        for (int i = 0; i < d_k; i++) {
                            double dec = exp(G[(size_t)t * d_k + i] - G[(size_t)s * d_k + i]);
                            akk += (double)kt[i] * dec * ks[i];
                            aqk += (double)qt[i] * dec * ks[i];
                        }
                    } else { /* the scalar decay factors out of the dot products */
                        for (int i = 0; i < d_k; i++) {
                            akk += (double)kt[i] * ks[i];
                            aqk += (double)qt[i] * ks[i];
                        }
                        double dec = exp(G[t] - G[s]);
                        akk *= dec;
                        aqk *= dec;
                    }
                    const double *us = U + (size_t)s * d_v;
                    if (s < t) {
                        double bkk = (double)B[t] * akk;
                        for (int j = 0; j < d_v; j++)
                            ut[j] -= bkk * us[j];
                    }
                    /* u_s is final for s < t; u_t is final once s reaches t */
                    if (s == t)
                        for (int j = 0; j < d_v; j++)
                            acc[j] += aqk * ut[j];
                    else
                        for (int j = 0; j < d_v; j++)
                            acc[j] += aqk * us[j];
                }
                for (int j = 0; j < d_v; j++)
                    ot[j] = (float)acc[j];
                stepq__store_out(a, t0 + t, hv, ot);
            }
            /* S <- e^{G_last} S0 + sum_s e^{G_last - G_s} k_s u_s^T */
            for (int i = 0; i < d_k; i++) {
                int c = kda ? i : 0;
                double glast = G[(size_t)(n - 1) * n_g + c];
                double *Si = S + (size_t)i * d_v;
                double el = exp(glast);
                for (int j = 0; j < d_v; j++)
                    Si[j] *= el;
                for (int s = 0; s < n; s++) {
                    double f = exp(glast - G[(size_t)s * n_g + c]) * K[(size_t)s * d_k + i];
                    const double *us = U + (size_t)s * d_v;
                    for (int j = 0; j < d_v; j++)
                        Si[j] += f * us[j];
                }
            }
        }
        for (int i = 0; i < d_k; i++)
            for (int j = 0; j < d_v; j++)
                Sh[(size_t)i * rs + (size_t)j * cs] = (float)S[(size_t)i * d_v + j];
    }
    rc = STEPQ_OK;
out:
    free(S);
    free(U);
    free(G);
    free(E);
    free(Q);
    free(K);
    free(V);
    free(B);
    free(acc);
    return rc;
}
