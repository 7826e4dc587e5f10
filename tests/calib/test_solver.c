/*
 * The bit-allocation solver against brute force on small random instances:
 * the exact DP must find the optimum; the Lagrangian path must stay within
 * the budget and never beat the optimum; impossible budgets are refused.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "stepq/stepq.h"
#include "tools/calib/calib.h"

static uint64_t rs = 88172645463325252ull;
static double urand(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (double)(rs >> 11) / 9007199254740992.0;
}

static double brute(int n, int m, const double *c, const int *s, long long cap, int u,
                    long long used)
{
    if (u == n)
        return 0.0;
    double best = INFINITY;
    for (int o = 0; o < m; o++) {
        if (used + s[u * m + o] > cap)
            continue;
        double v = c[u * m + o] + brute(n, m, c, s, cap, u + 1, used + s[u * m + o]);
        if (v < best)
            best = v;
    }
    return best;
}

static void eval_choice(int n, int m, const double *c, const int *s, const int *ch, double *cost,
                        long long *size)
{
    *cost = 0;
    *size = 0;
    for (int u = 0; u < n; u++) {
        *cost += c[u * m + ch[u]];
        *size += s[u * m + ch[u]];
    }
}

static void dp_matches_brute_force(void **state)
{
    (void)state;
    static const int widths[4] = { 2, 4, 6, 8 };
    for (int trial = 0; trial < 300; trial++) {
        int n = 1 + (int)(urand() * 7), m = 2 + (int)(urand() * 3);
        double c[8 * 4];
        int s[8 * 4], ch[8];
        for (int u = 0; u < n; u++) {
            double scale = exp(6 * urand());
            for (int o = 0; o < m; o++) {
                s[u * m + o] = widths[o];
                /* distortion falls with width, roughly 4^-b, plus noise (not always convex) */
                c[u * m + o] = scale * pow(4.0, -widths[o]) * (0.5 + urand());
            }
        }
        long long cap = 2 * n + (long long)(urand() * (6 * n + 1));
        double opt = brute(n, m, c, s, cap, 0, 0);
        int rc = stepq__calib_allocate(n, m, c, s, cap, 1LL << 30, ch);
        assert_int_equal(rc, 0);
        double cost;
        long long size;
        eval_choice(n, m, c, s, ch, &cost, &size);
        assert_true(size <= cap);
        assert_true(fabs(cost - opt) <= 1e-12 * fabs(opt) + 1e-300);
        /* Lagrangian path: feasible and never better than the optimum. */
        rc = stepq__calib_allocate(n, m, c, s, cap, 0, ch);
        assert_int_equal(rc, 1);
        eval_choice(n, m, c, s, ch, &cost, &size);
        assert_true(size <= cap);
        assert_true(cost >= opt * (1 - 1e-12));
    }
}

static void lagrangian_close_to_optimum_on_many_units(void **state)
{
    (void)state;
    enum { N = 400, M = 4 };
    static double c[N * M];
    static int s[N * M], ch1[N], ch2[N];
    static const int widths[M] = { 3, 4, 5, 6 };
    for (int u = 0; u < N; u++)
        for (int o = 0; o < M; o++) {
            s[u * M + o] = widths[o];
            c[u * M + o] = exp(8 * urand()) * pow(4.0, -widths[o]);
        }
    long long cap = 4 * N;
    assert_int_equal(stepq__calib_allocate(N, M, c, s, cap, 1LL << 30, ch1), 0);
    assert_int_equal(stepq__calib_allocate(N, M, c, s, cap, 0, ch2), 1);
    double c1, c2;
    long long s1, s2;
    eval_choice(N, M, c, s, ch1, &c1, &s1);
    eval_choice(N, M, c, s, ch2, &c2, &s2);
    assert_true(s1 <= cap && s2 <= cap);
    assert_true(c2 >= c1 * (1 - 1e-12));
    assert_true(c2 <= c1 * 1.05); /* convex-ish costs: the relaxation is nearly tight */
}

static void impossible_budget_is_erange(void **state)
{
    (void)state;
    double c[4] = { 1, 0.5, 1, 0.5 };
    int s[4] = { 3, 4, 3, 4 }, ch[2];
    assert_int_equal(stepq__calib_allocate(2, 2, c, s, 5, 1LL << 30, ch), STEPQ_ERANGE);
    assert_int_equal(stepq__calib_allocate(2, 2, c, s, 5, 0, ch), STEPQ_ERANGE);
    assert_int_equal(stepq__calib_allocate(2, 2, c, s, 6, 1LL << 30, ch), 0);
    assert_int_equal(ch[0] + ch[1], 0);
    assert_int_equal(stepq__calib_allocate(2, 2, c, s, 7, 1LL << 30, ch), 0);
    assert_int_equal(ch[0] + ch[1], 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(dp_matches_brute_force),
        cmocka_unit_test(lagrangian_close_to_optimum_on_many_units),
        cmocka_unit_test(impossible_budget_is_erange),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
