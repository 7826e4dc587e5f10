/*
 * Names and properties of architectures, methods and dtypes, all generated
 * from the lists in stepq/map.h.
 */
#include <stdio.h>
#include <string.h>

#include "plugin/err.h"
#include "plugin/vocab.h"

static const struct {
    const char *name;
    bool dense, col, w, mixed, units;
} methods[STEPQ_METHOD_COUNT] = {
#define XX(n, value, text, dense, col, w, mixed, units, desc) \
    [value] = { text, dense, col, w, mixed, units },
    STEPQ_METHOD_MAP(XX)
#undef XX
};

static const char *const arch_names[] = {
#define XX(n, value, text, desc) [value] = text,
    STEPQ_ARCH_MAP(XX)
#undef XX
};

static const struct {
    const char *name;
    size_t bytes;
} dtypes[] = {
#define XX(n, value, text, bytes) [value] = { text, bytes },
    STEPQ_DTYPE_MAP(XX)
#undef XX
};

static const char *const fit_names[STEPQ_DECODE_FIT_COUNT] = {
#define XX(n, value, text, desc) [value] = text,
    STEPQ_DECODE_FIT_MAP(XX)
#undef XX
};

static const char *const arith_names[STEPQ_ARITH_COUNT] = {
#define XX(n, value, text, desc) [value] = text,
    STEPQ_ARITH_MAP(XX)
#undef XX
};

#define N_ARCH  (sizeof(arch_names) / sizeof(arch_names[0]))
#define N_DTYPE (sizeof(dtypes) / sizeof(dtypes[0]))

static bool method_ok(stepq_method m)
{
    return (unsigned)m < STEPQ_METHOD_COUNT;
}

const char *stepq_method_name(stepq_method method)
{
    return method_ok(method) ? methods[method].name : "?";
}

const char *stepq_arch_name(stepq_arch arch)
{
    return (unsigned)arch < N_ARCH ? arch_names[arch] : "?";
}

const char *stepq_dtype_name(stepq_dtype dtype)
{
    return (unsigned)dtype < N_DTYPE ? dtypes[dtype].name : "?";
}

const char *stepq_decode_fit_name(stepq_decode_fit fit)
{
    return (unsigned)fit < STEPQ_DECODE_FIT_COUNT ? fit_names[fit] : "?";
}

const char *stepq_arith_name(stepq_arith a)
{
    return (unsigned)a < STEPQ_ARITH_COUNT ? arith_names[a] : "?";
}

size_t stepq_dtype_size(stepq_dtype dtype)
{
    return (unsigned)dtype < N_DTYPE ? dtypes[dtype].bytes : 0;
}

int stepq_method_has_col_scales(stepq_method method)
{
    return method_ok(method) && methods[method].col;
}

int stepq_method_is_dense(stepq_method method)
{
    return method_ok(method) && methods[method].dense;
}

bool stepq__method_uses_row_impact(stepq_method method)
{
    return method_ok(method) && methods[method].w;
}

bool stepq__method_has_pivots(stepq_method method)
{
    return method_ok(method) && methods[method].mixed;
}

bool stepq__method_single_width(stepq_method method)
{
    return method_ok(method) && methods[method].units && !methods[method].mixed;
}

bool stepq__method_has_units(stepq_method method)
{
    return method_ok(method) && methods[method].units;
}

double stepq__method_fixed_bits(stepq_method method)
{
    switch (method) {
    case STEPQ_METHOD_FP32:
        return 32.0;
    case STEPQ_METHOD_BF16:
    case STEPQ_METHOD_FP16:
        return 16.0;
    case STEPQ_METHOD_FP8:
        return 8.0;
    default:
        return 0.0;
    }
}

/* "one of a, b, c" for the error texts of the parsers below. */
static void one_of(char *buf, size_t len, const char *const *names, size_t n, size_t stride)
{
    size_t at = 0;

    buf[0] = '\0';
    for (size_t i = 0; i < n && at + 1 < len; i++) {
        const char *name = *(const char *const *)((const char *)names + i * stride);
        int w = snprintf(buf + at, len - at, "%s%s", i ? ", " : "", name);
        if (w < 0)
            break;
        at += (size_t)w;
    }
}

static int from_name(const char *what, const char *name, const char *const *names, size_t n,
                     size_t stride, int *out)
{
    char list[128];

    if (!name || !out)
        return stepq__error(STEPQ_EINVAL, "stepq_%s_from_name: NULL argument", what);
    for (size_t i = 0; i < n; i++) {
        if (!strcmp(name, *(const char *const *)((const char *)names + i * stride))) {
            *out = (int)i;
            return STEPQ_OK;
        }
    }
    one_of(list, sizeof(list), names, n, stride);
    return stepq__error(STEPQ_EINVAL, "unknown %s \"%.64s\" (one of %s)", what, name, list);
}

int stepq_method_from_name(const char *name, stepq_method *out)
{
    int v = 0, st = from_name("method", name, &methods[0].name, STEPQ_METHOD_COUNT,
                              sizeof(methods[0]), out ? &v : NULL);
    if (st == STEPQ_OK)
        *out = (stepq_method)v;
    return st;
}

int stepq_arch_from_name(const char *name, stepq_arch *out)
{
    int v = 0,
        st = from_name("arch", name, arch_names, N_ARCH, sizeof(arch_names[0]), out ? &v : NULL);
    if (st == STEPQ_OK)
        *out = (stepq_arch)v;
    return st;
}

int stepq_dtype_from_name(const char *name, stepq_dtype *out)
{
    int v = 0,
        st = from_name("dtype", name, &dtypes[0].name, N_DTYPE, sizeof(dtypes[0]), out ? &v : NULL);
    if (st == STEPQ_OK)
        *out = (stepq_dtype)v;
    return st;
}

int stepq_decode_fit_from_name(const char *name, stepq_decode_fit *out)
{
    int v = 0, st = from_name("decode_fit", name, fit_names, STEPQ_DECODE_FIT_COUNT,
                              sizeof(fit_names[0]), out ? &v : NULL);
    if (st == STEPQ_OK)
        *out = (stepq_decode_fit)v;
    return st;
}

int stepq_arith_from_name(const char *name, stepq_arith *out)
{
    int v = 0, st = from_name("arith", name, arith_names, STEPQ_ARITH_COUNT, sizeof(arith_names[0]),
                              out ? &v : NULL);
    if (st == STEPQ_OK)
        *out = (stepq_arith)v;
    return st;
}
