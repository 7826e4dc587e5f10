/*
 * The bit-allocation solver (tools/calib.h stepq__calib_allocate): a multiple-choice
 * knapsack. When all units hold the same number of values (every GDN head,
 * every KDA key row), sizes are the bit widths and the capacity is
 * floor(budget * U - 8 * pivots), small enough for an exact dynamic
 * programme on GDN models (2,304 heads x 13,824 bits for Qwen3.8-27B@6);
 * KDA's 81,920 rows use the Lagrangian path.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plugin/err.h"
#include "tools/calib/calib.h"

static int dp_solve(int n, int m, const double *cost, const int *size, long long cap, int *choice)
{
    size_t W = (size_t)cap + 1;
    double *f = malloc(sizeof(double) * W), *g = malloc(sizeof(double) * W);
    uint8_t *pick = malloc((size_t)n * W);
    if (!f || !g || !pick) {
        free(f);
        free(g);
        free(pick);
        return stepq__error(STEPQ_ENOMEM, "allocation: out of memory for the exact solver");
    }
    for (size_t c = 0; c < W; c++)
        f[c] = 0.0; /* "at most c": the empty prefix costs 0 at every capacity */
    for (int u = 0; u < n; u++) {
        const double *cu = cost + (size_t)u * m;
        const int *su = size + (size_t)u * m;
        uint8_t *pu = pick + (size_t)u * W;
        for (size_t c = 0; c < W; c++) {
            double best = INFINITY;
            int bi = 255;
            for (int o = 0; o < m; o++) {
                if ((size_t)su[o] > c)
                    continue;
                double v = f[c - (size_t)su[o]] + cu[o];
                if (v < best) {
                    best = v;
                    bi = o;
                }
            }
            g[c] = best;
            pu[c] = (uint8_t)bi;
        }
        double *t = f;
        f = g;
        g = t;
    }
    int rc = 0;
    if (!isfinite(f[W - 1])) {
        rc = stepq__error(STEPQ_ERANGE, "allocation: the smallest widths exceed the budget");
    } else {
        size_t c = W - 1;
        for (int u = n - 1; u >= 0; u--) {
            int o = pick[(size_t)u * W + c];
            choice[u] = o;
            c -= (size_t)size[(size_t)u * m + o];
        }
    }
    free(f);
    free(g);
    free(pick);
    return rc;
}

static long long lagr_pick(int n, int m, const double *cost, const int *size, double price,
                           int *choice)
{
    long long tot = 0;
    for (int u = 0; u < n; u++) {
        double best = INFINITY;
        int bi = 0;
        for (int o = 0; o < m; o++) {
            double v = cost[(size_t)u * m + o] + price * size[(size_t)u * m + o];
            if (v < best || (v == best && size[(size_t)u * m + o] < size[(size_t)u * m + bi])) {
                best = v;
                bi = o;
            }
        }
        choice[u] = bi;
        tot += size[(size_t)u * m + bi];
    }
    return tot;
}

struct move {
    double ratio; /* cost saved per extra size unit */
    int u, o;
};

static int cmp_move(const void *a, const void *b)
{
    const struct move *x = a, *y = b;
    if (x->ratio != y->ratio)
        return x->ratio > y->ratio ? -1 : 1;
    if (x->u != y->u)
        return x->u - y->u;
    return x->o - y->o;
}

static int lagrangian(int n, int m, const double *cost, const int *size, long long cap, int *choice)
{
    int *tmp = malloc(sizeof(int) * (size_t)n);
    struct move *mv = malloc(sizeof(*mv) * (size_t)n * (size_t)m + 1);
    if (!tmp || !mv) {
        free(tmp);
        free(mv);
        return stepq__error(STEPQ_ENOMEM, "allocation: out of memory");
    }
    double cmax = 0.0;
    for (size_t i = 0; i < (size_t)n * m; i++)
        if (fabs(cost[i]) > cmax)
            cmax = fabs(cost[i]);
    double lo = 0.0, hi = cmax > 0 ? cmax * 4 + 1e-300 : 1.0;
    if (lagr_pick(n, m, cost, size, 0.0, choice) > cap) {
        int ok = 0;
        for (int it = 0; it < 200; it++) {
            if (lagr_pick(n, m, cost, size, hi, tmp) <= cap) {
                ok = 1;
                break;
            }
            hi *= 4.0;
        }
        if (!ok) {
            free(tmp);
            free(mv);
            return stepq__error(STEPQ_ERANGE, "allocation: the smallest widths exceed the budget");
        }
        for (int it = 0; it < 200 && hi - lo > 1e-15 * hi; it++) {
            double mid = 0.5 * (lo + hi);
            if (lagr_pick(n, m, cost, size, mid, tmp) <= cap)
                hi = mid;
            else
                lo = mid;
        }
        lagr_pick(n, m, cost, size, hi, choice);
    }
    /* Repair: spend what is left on the best cost-per-size upgrades, one per unit per pass. */
    long long used = 0;
    for (int u = 0; u < n; u++)
        used += size[(size_t)u * m + choice[u]];
    for (int pass = 0; pass < m; pass++) {
        size_t nm = 0;
        for (int u = 0; u < n; u++) {
            double c0 = cost[(size_t)u * m + choice[u]];
            int s0 = size[(size_t)u * m + choice[u]];
            for (int o = 0; o < m; o++) {
                int ds = size[(size_t)u * m + o] - s0;
                double dc = c0 - cost[(size_t)u * m + o];
                if (ds > 0 && dc > 0)
                    mv[nm++] = (struct move){ dc / ds, u, o };
            }
        }
        if (!nm)
            break;
        qsort(mv, nm, sizeof(*mv), cmp_move);
        int changed = 0;
        for (int u = 0; u < n; u++)
            tmp[u] = 0;
        for (size_t i = 0; i < nm; i++) {
            int u = mv[i].u;
            if (tmp[u])
                continue;
            int ds = size[(size_t)u * m + mv[i].o] - size[(size_t)u * m + choice[u]];
            if (used + ds > cap)
                continue;
            used += ds;
            choice[u] = mv[i].o;
            tmp[u] = 1;
            changed = 1;
        }
        if (!changed)
            break;
    }
    free(tmp);
    free(mv);
    return 1;
}

int stepq__calib_allocate(int n, int m, const double *cost, const int *size, long long cap,
                          long long dp_limit, int *choice)
{
    if (n < 0 || m < 1 || m > 254 || cap < 0)
        return stepq__error(STEPQ_EINVAL, "allocation: bad problem (n %d, m %d, cap %lld)", n, m,
                            cap);
    for (size_t i = 0; i < (size_t)n * m; i++)
        if (size[i] < 0 || !isfinite(cost[i]))
            return stepq__error(STEPQ_EINVAL, "allocation: option %zu has size %d, cost %g", i,
                                size[i], cost[i]);
    if (n == 0)
        return 0;
    if ((double)n * ((double)cap + 1.0) <= (double)dp_limit)
        return dp_solve(n, m, cost, size, cap, choice);
    return lagrangian(n, m, cost, size, cap, choice);
}
