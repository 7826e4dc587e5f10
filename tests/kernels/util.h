/*
 * Small helpers shared by the kernel tests: a deterministic RNG and error
 * measures. Header-only so every test stays one executable.
 */
#ifndef STEPQ_TESTS_KERNELS_UTIL_H
#define STEPQ_TESTS_KERNELS_UTIL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* xorshift64*: reproducible across platforms, unlike rand(). */
static inline uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

/* Uniform in [-1, 1). */
static inline float rng_sym(uint64_t *s)
{
    return (float)((double)(rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* Uniform in [0, 1). */
static inline float rng_unit(uint64_t *s)
{
    return (float)((double)(rng_next(s) >> 11) / 9007199254740992.0);
}

static inline void rng_fill(uint64_t *s, float *x, size_t n, float amp)
{
    for (size_t i = 0; i < n; i++)
        x[i] = amp * rng_sym(s);
}

/* ||a - b|| / ||b|| (0 when both are 0). */
static inline double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static inline double max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0.0;
    for (size_t i = 0; i < n; i++)
        m = fmax(m, fabs((double)a[i] - (double)b[i]));
    return m;
}

#endif /* STEPQ_TESTS_KERNELS_UTIL_H */
