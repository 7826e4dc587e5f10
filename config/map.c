/*
 * Precision maps in memory: the builder, the readers, the cross-field
 * validation shared with the loader and the writer, the memory accounting.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/map_internal.h"
#include "plugin/handle.h"
#include "plugin/hash.h"

const char *const stepq__prov_str_keys[STEPQ__PROV_STR_COUNT] = {
    "tool", "tool_version", "data", "notes", "method_detail",
};
const char *const stepq__prov_num_keys[STEPQ__PROV_NUM_COUNT] = {
    "tokens", "segments", "segment_length", "horizon", "pivot_fraction",
};

bool stepq__bits_is_int(int b)
{
    return (b >= 2 && b <= 6) || b == 8;
}

/* JSON path of a unit's statistics object (per head; KDA rows index its arrays). */
static void stats_path(const stepq_map_t *m, int layer, int unit, char *buf, size_t n)
{
    int head = m->shape.arch == STEPQ_ARCH_GDN ? unit : unit / m->shape.head_k_dim;
    snprintf(buf, n, "layers[%d].heads[%d].stats", layer, head);
}

/* The array index of a unit inside its head's statistics (-1 for GDN). */
static int stats_row(const stepq_map_t *m, int unit)
{
    return m->shape.arch == STEPQ_ARCH_GDN ? -1 : unit % m->shape.head_k_dim;
}

/* Copies the thread-local detail text into the map's own buffer. */
static int map_fail(stepq_map_t *map, int status)
{
    snprintf(map->err, sizeof(map->err), "%s", stepq_last_error());
    return status;
}

const char *stepq__num(char buf[32], double v)
{
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, 32, "%.*g", p, v);
        if (strtod(buf, NULL) == v)
            break;
    }
    return buf;
}

/* --- shape and budget rules (shared with the loader) --- */

int stepq__shape_check(const stepq_model_shape *s)
{
    if (!s)
        return stepq__error(STEPQ_EINVAL, "model: NULL shape");
    if ((unsigned)s->arch > STEPQ_ARCH_KDA)
        return stepq__error(STEPQ_ERANGE, "model.arch: %d is not gdn (0) or kda (1)", (int)s->arch);
    if (s->n_layers < 1 || s->n_layers > STEPQ__MAX_LAYERS)
        return stepq__error(STEPQ_ERANGE, "model.recurrent_layers: %d layers, must be 1..%d",
                            s->n_layers, STEPQ__MAX_LAYERS);
    if (!s->layer_ids)
        return stepq__error(STEPQ_EINVAL, "model.recurrent_layers: NULL layer_ids");
    for (int i = 0; i < s->n_layers; i++) {
        if (s->layer_ids[i] < 0 || s->layer_ids[i] > STEPQ__MAX_LAYER_ID)
            return stepq__error(STEPQ_ERANGE,
                                "model.recurrent_layers[%d]: %d is out of range 0..%d", i,
                                s->layer_ids[i], STEPQ__MAX_LAYER_ID);
        if (i > 0 && s->layer_ids[i] <= s->layer_ids[i - 1])
            return stepq__error(STEPQ_ERANGE,
                                "model.recurrent_layers[%d]: %d does not follow %d (ids must be "
                                "strictly increasing)",
                                i, s->layer_ids[i], s->layer_ids[i - 1]);
    }
    if (s->num_k_heads < 1 || s->num_k_heads > STEPQ__MAX_HEADS)
        return stepq__error(STEPQ_ERANGE, "model.num_k_heads: %d is out of range 1..%d",
                            s->num_k_heads, STEPQ__MAX_HEADS);
    if (s->num_v_heads < 1 || s->num_v_heads > STEPQ__MAX_HEADS)
        return stepq__error(STEPQ_ERANGE, "model.num_v_heads: %d is out of range 1..%d",
                            s->num_v_heads, STEPQ__MAX_HEADS);
    if (s->num_v_heads % s->num_k_heads)
        return stepq__error(STEPQ_ESHAPE,
                            "model.num_v_heads: %d is not a multiple of num_k_heads %d",
                            s->num_v_heads, s->num_k_heads);
    if (s->head_k_dim < 1 || s->head_k_dim > STEPQ_MAX_HEAD_DIM)
        return stepq__error(STEPQ_ERANGE, "model.head_k_dim: %d is out of range 1..%d",
                            s->head_k_dim, STEPQ_MAX_HEAD_DIM);
    if (s->head_v_dim < 1 || s->head_v_dim > STEPQ_MAX_HEAD_DIM)
        return stepq__error(STEPQ_ERANGE, "model.head_v_dim: %d is out of range 1..%d",
                            s->head_v_dim, STEPQ_MAX_HEAD_DIM);
    if (s->conv_rank < 0 || s->conv_rank > STEPQ_CONV_MAX_RANK)
        return stepq__error(STEPQ_ESHAPE, "model.conv_state.shape: rank %d, must be 1..%d",
                            s->conv_rank, STEPQ_CONV_MAX_RANK);
    int64_t elems = 1;
    for (int i = 0; i < s->conv_rank; i++) {
        if (s->conv_shape[i] < 1 || s->conv_shape[i] > STEPQ__MAX_CONV_DIM)
            return stepq__error(STEPQ_ERANGE,
                                "model.conv_state.shape[%d]: %lld is out of range 1..%lld", i,
                                (long long)s->conv_shape[i], (long long)STEPQ__MAX_CONV_DIM);
        elems *= s->conv_shape[i]; /* both factors <= 2^40 / 2^31: no overflow */
        if (elems > STEPQ__MAX_CONV_ELEM)
            return stepq__error(STEPQ_ERANGE,
                                "model.conv_state.shape: more than %lld elements per layer",
                                (long long)STEPQ__MAX_CONV_ELEM);
    }
    if (s->conv_rank > 0 && (unsigned)s->conv_dtype > STEPQ_DTYPE_FP16)
        return stepq__error(STEPQ_ERANGE, "model.conv_state.dtype: %d is not a dtype",
                            (int)s->conv_dtype);
    return STEPQ_OK;
}

int stepq__budget_check(stepq_method method, double budget)
{
    if ((unsigned)method >= STEPQ_METHOD_COUNT)
        return stepq__error(STEPQ_EINVAL, "method: %d is not a method", (int)method);
    if (!isfinite(budget))
        return stepq__error(STEPQ_ENONFINITE, "budget_bits: not a finite number");
    if (!stepq__method_has_units(method)) {
        double want = stepq__method_fixed_bits(method);
        if (budget != want)
            return stepq__error(STEPQ_ERANGE,
                                "budget_bits: %s does not match method %s (must be %g)",
                                STEPQ__NUM(budget), stepq_method_name(method), want);
    } else if (stepq__method_single_width(method)) {
        /* range first: converting a huge double to int is undefined */
        if (budget < 2.0 || budget > 8.0 || budget != floor(budget) ||
            !stepq__bits_is_int((int)budget))
            return stepq__error(STEPQ_ERANGE,
                                "budget_bits: %s is not one of 2,3,4,5,6,8 (method %s stores every "
                                "unit at budget_bits)",
                                STEPQ__NUM(budget), stepq_method_name(method));
    } else if (budget < 2.0 || budget > 8.0) {
        return stepq__error(STEPQ_ERANGE, "budget_bits: %s is out of range [2, 8] for method %s",
                            STEPQ__NUM(budget), stepq_method_name(method));
    }
    return STEPQ_OK;
}

int stepq__row_split_check(stepq_method method, double v)
{
    if (!isfinite(v))
        return stepq__error(STEPQ_ENONFINITE, "row_split: not a finite number");
    if (!(v > 0.0 && v <= 1.0))
        return stepq__error(STEPQ_ERANGE, "row_split: %s is out of range (0, 1]", STEPQ__NUM(v));
    if (v != STEPQ__ROW_SPLIT_DEFAULT && !stepq_method_has_col_scales(method))
        return stepq__error(STEPQ_ESCHEMA,
                            "row_split: %s is not allowed for method %s (only dsq, spatial and "
                            "stepq have the dual-axis fit; its default is 0.5)",
                            STEPQ__NUM(v), stepq_method_name(method));
    return STEPQ_OK;
}

int stepq__decode_fit_check(stepq_method method, stepq_decode_fit fit)
{
    if ((unsigned)fit >= STEPQ_DECODE_FIT_COUNT)
        return stepq__error(STEPQ_EINVAL, "decode_fit: %d is not a decode fit", (int)fit);
    if (fit != STEPQ_DECODE_FIT_EXACT && !stepq_method_has_col_scales(method))
        return stepq__error(STEPQ_ESCHEMA,
                            "decode_fit: %s is not allowed for method %s (only dsq, spatial and "
                            "stepq have the dual-axis fit's column refit; its default is exact)",
                            stepq_decode_fit_name(fit), stepq_method_name(method));
    return STEPQ_OK;
}

/* Whether a map may pair arith with fit: fp16 is defined for the exact fit and norefit
 * (kernels/quant.h), not rows. The one statement of the rule for the check and both setters. */
static int arith_takes_fit(stepq_arith arith, stepq_decode_fit fit)
{
    return arith != STEPQ_ARITH_FP16 || fit != STEPQ_DECODE_FIT_ROWS;
}

int stepq__arith_check(stepq_method method, stepq_decode_fit fit, stepq_arith arith)
{
    if ((unsigned)arith >= STEPQ_ARITH_COUNT)
        return stepq__error(STEPQ_EINVAL, "arith: %d is not an arithmetic", (int)arith);
    if (arith != STEPQ_ARITH_FP32 && !stepq_method_has_col_scales(method))
        return stepq__error(
            STEPQ_ESCHEMA,
            "arith: %s is not allowed for method %s (only dsq, spatial and stepq have the "
            "dual-axis decode step's fp16 variant; its default is fp32)",
            stepq_arith_name(arith), stepq_method_name(method));
    if (!arith_takes_fit(arith, fit))
        return stepq__error(STEPQ_ESCHEMA, "arith: %s needs decode_fit exact or norefit, not %s",
                            stepq_arith_name(arith), stepq_decode_fit_name(fit));
    return STEPQ_OK;
}

/* The largest integer width <= budget: where a fresh quantized map starts. */
static int initial_bits(double budget)
{
    static const int widths[] = { 8, 6, 5, 4, 3, 2 };
    for (int i = 0; i < 6; i++)
        if (widths[i] <= budget)
            return widths[i];
    return 2;
}

int stepq__map_alloc(const stepq_model_shape *shape, stepq_method method, double budget,
                     stepq_map_t **out)
{
    stepq_map_t *m;
    int64_t n_units;
    int dk = shape->head_k_dim;

    *out = NULL;
    m = calloc(1, sizeof(*m));
    if (!m)
        goto fail_nomem;
    m->shape = *shape;
    m->method = method;
    m->budget_bits = budget;
    m->row_split = STEPQ__ROW_SPLIT_DEFAULT;
    m->decode_fit = STEPQ_DECODE_FIT_EXACT;
    m->arith = STEPQ_ARITH_FP32;
    m->n_candidates = -1;
    m->units_per_layer =
        shape->arch == STEPQ_ARCH_GDN ? shape->num_v_heads : shape->num_v_heads * shape->head_k_dim;
    m->values_per_unit =
        shape->arch == STEPQ_ARCH_GDN ? shape->head_k_dim * shape->head_v_dim : shape->head_v_dim;
    n_units = (int64_t)shape->n_layers * m->units_per_layer;
    m->n_units = n_units;
    for (int i = shape->conv_rank; i < STEPQ_CONV_MAX_RANK; i++)
        m->shape.conv_shape[i] = 0;
    if (shape->conv_rank == 0)
        m->shape.conv_dtype = STEPQ_DTYPE_BF16;

    m->layer_ids = malloc(sizeof(int) * (size_t)shape->n_layers);
    if (!m->layer_ids)
        goto fail_nomem;
    memcpy(m->layer_ids, shape->layer_ids, sizeof(int) * (size_t)shape->n_layers);
    m->shape.layer_ids = m->layer_ids;

    if (stepq__method_has_units(method)) {
        if (n_units > STEPQ__MAX_UNITS) {
            stepq__map_free(m);
            return stepq__error(STEPQ_ERANGE, "model: %lld units exceed the limit of %lld",
                                (long long)n_units, (long long)STEPQ__MAX_UNITS);
        }
        m->bits = malloc((size_t)n_units);
        if (!m->bits)
            goto fail_nomem;
        memset(m->bits, initial_bits(budget), (size_t)n_units);
        if (stepq__method_uses_row_impact(method)) {
            size_t n = (size_t)shape->n_layers * (size_t)shape->num_v_heads * (size_t)dk;
            m->row_impact = malloc(sizeof(float) * n);
            if (!m->row_impact)
                goto fail_nomem;
            for (size_t i = 0; i < n; i++)
                m->row_impact[i] = 1.0f;
        }
    }
    *out = m;
    return STEPQ_OK;

fail_nomem:
    stepq__map_free(m);
    return stepq__error(STEPQ_ENOMEM, "out of memory allocating a precision map");
}

/* --- builder --- */

int stepq_map_create(const stepq_model_shape *shape, stepq_method method, double budget_bits,
                     stepq_map_t **out)
{
    int st;

    if (!out)
        return stepq__error(STEPQ_EINVAL, "stepq_map_create: out is NULL");
    *out = NULL;
    if ((st = stepq__shape_check(shape)) < 0)
        return st;
    if ((st = stepq__budget_check(method, budget_bits)) < 0)
        return st;
    stepq_map_t *m;
    if ((st = stepq__map_alloc(shape, method, budget_bits, &m)) < 0)
        return st;
    return stepq__map_publish(m, out);
}

void stepq__map_free(stepq_map_t *map)
{
    if (!map)
        return;
    free(map->layer_ids);
    free(map->model_name);
    free(map->bits);
    free(map->row_impact);
    free(map->stats);
    free(map->has_stats);
    for (int i = 0; i < STEPQ__PROV_STR_COUNT; i++)
        free(map->prov_str[i]);
    free(map);
}

/* --- handles ---------------------------------------------------------------
 *
 * A map's handle is an entry of the library's handle table (plugin/handle.h):
 * a closed map's handle is STEPQ_EBADF forever, whatever reuses its memory,
 * and a pool's handle is not a map's. Lookups take no lock (maps are read
 * from many threads); closing a map while another thread uses it is the
 * caller's bug, as for any object.
 */
static const char closed_map_text[] = "map handle is closed or not valid";

int stepq__map_publish(stepq_map_t *map, stepq_map_t **out)
{
    int st = stepq__handle_add(map, STEPQ__HANDLE_MAP, (void **)out, &map->entry, NULL);

    if (st < 0) {
        stepq__map_free(map);
        *out = NULL;
    }
    return st;
}

int stepq__map_resolve(const stepq_map_t *h, const char *fn, stepq_map_t **map)
{
    *map = NULL;
    if (!h)
        return stepq__error(STEPQ_EINVAL, "%s: map is NULL", fn);
    *map = stepq__handle_get(h, STEPQ__HANDLE_MAP);
    if (!*map)
        return stepq__error(STEPQ_EBADF, "%s: %s", fn, closed_map_text);
    return STEPQ_OK;
}

stepq_map_t *stepq__map_of(const stepq_map_t *h, const char *fn)
{
    stepq_map_t *map = NULL;

    if (h)
        stepq__map_resolve(h, fn, &map);
    return map;
}

void stepq_map_close(stepq_map_t *h)
{
    stepq_map_t *map;

    if (!h || stepq__map_resolve(h, "stepq_map_close", &map) < 0)
        return; /* a second close is refused (STEPQ_EBADF in stepq_last_error()) */
    stepq__handle_drop(map->entry);
    stepq__map_free(map);
}

const char *stepq_map_last_error(const stepq_map_t *h)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_last_error");
    return map ? map->err : h ? closed_map_text : "";
}

/* Checks layer and unit ids of a setter; records the error in the map. */
static int check_unit_ids(stepq_map_t *map, const char *fn, int layer, int unit)
{
    if (layer < 0 || layer >= map->shape.n_layers)
        return stepq__error_obj(map->err, STEPQ_EINVAL, "%s: layer %d is out of range 0..%d", fn,
                                layer, map->shape.n_layers - 1);
    if (unit < 0 || unit >= map->units_per_layer)
        return stepq__error_obj(map->err, STEPQ_EINVAL, "%s: unit %d is out of range 0..%d", fn,
                                unit, map->units_per_layer - 1);
    return STEPQ_OK;
}

int stepq_map_set_unit_bits(stepq_map_t *h, int layer, int unit, int bits)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_set_unit_bits", &map);
        if (st_ < 0)
            return st_;
    }
    int st;

    if (!map)
        return stepq__error(STEPQ_EINVAL, "stepq_map_set_unit_bits: map is NULL");
    if (!stepq__method_has_units(map->method))
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_unit_bits: method %s has no per-unit widths",
                                stepq_method_name(map->method));
    if ((st = check_unit_ids(map, "stepq_map_set_unit_bits", layer, unit)) < 0)
        return st;
    if (bits == STEPQ_BITS_PIVOT) {
        if (!stepq__method_has_pivots(map->method))
            return stepq__error_obj(map->err, STEPQ_EINVAL,
                                    "stepq_map_set_unit_bits: method %s has no pivots (only "
                                    "temporal and stepq do)",
                                    stepq_method_name(map->method));
    } else if (!stepq__bits_is_int(bits)) {
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_unit_bits: %d is not one of 2,3,4,5,6,8 (or %d for "
                                "a pivot)",
                                bits, STEPQ_BITS_PIVOT);
    } else if (stepq__method_single_width(map->method) && bits != (int)map->budget_bits) {
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_unit_bits: %d differs from budget_bits %s (method "
                                "%s stores every unit at one width)",
                                bits, STEPQ__NUM(map->budget_bits), stepq_method_name(map->method));
    }
    map->bits[stepq__unit_index(map, layer, unit)] = (uint8_t)bits;
    return STEPQ_OK;
}

int stepq__row_impact_check(const float *w, int n, const char *path)
{
    double sum_log = 0.0, gm;

    for (int i = 0; i < n; i++) {
        if (!isfinite(w[i]))
            return stepq__error(STEPQ_ENONFINITE, "%s[%d]: not a finite number", path, i);
        if (!(w[i] > 0.0f))
            return stepq__error(STEPQ_ERANGE, "%s[%d]: %s is not positive", path, i,
                                STEPQ__NUM(w[i]));
        sum_log += log((double)w[i]);
    }
    gm = exp(sum_log / n);
    if (fabs(gm - 1.0) > STEPQ__ROW_IMPACT_GEOMEAN_TOL)
        return stepq__error(STEPQ_ERANGE,
                            "%s: geometric mean is %.6g, must be 1 (within %g): divide the factors "
                            "by their geometric mean",
                            path, gm, STEPQ__ROW_IMPACT_GEOMEAN_TOL);
    return STEPQ_OK;
}

int stepq_map_set_row_impact(stepq_map_t *h, int layer, int head, const float *w)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_set_row_impact", &map);
        if (st_ < 0)
            return st_;
    }
    char path[96];
    int st, dk;

    if (!map)
        return stepq__error(STEPQ_EINVAL, "stepq_map_set_row_impact: map is NULL");
    if (!map->row_impact)
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_row_impact: method %s has no row-impact factors "
                                "(only spatial and stepq do)",
                                stepq_method_name(map->method));
    if (layer < 0 || layer >= map->shape.n_layers)
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_row_impact: layer %d is out of range 0..%d", layer,
                                map->shape.n_layers - 1);
    if (head < 0 || head >= map->shape.num_v_heads)
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_row_impact: head %d is out of range 0..%d", head,
                                map->shape.num_v_heads - 1);
    if (!w)
        return stepq__error_obj(map->err, STEPQ_EINVAL, "stepq_map_set_row_impact: w is NULL");
    dk = map->shape.head_k_dim;
    snprintf(path, sizeof(path), "layers[%d].heads[%d].row_impact", layer, head);
    if ((st = stepq__row_impact_check(w, dk, path)) < 0)
        return map_fail(map, st);
    memcpy(map->row_impact + ((size_t)layer * map->shape.num_v_heads + head) * dk, w,
           sizeof(float) * dk);
    return STEPQ_OK;
}

int stepq_map_set_row_split(stepq_map_t *h, double alpha)
{
    stepq_map_t *map;
    int st = stepq__map_resolve(h, "stepq_map_set_row_split", &map);

    if (st < 0)
        return st;
    if (alpha != STEPQ__ROW_SPLIT_DEFAULT && !stepq_method_has_col_scales(map->method))
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_row_split: method %s has no column scales (only "
                                "dsq, spatial and stepq have the dual-axis fit's row split)",
                                stepq_method_name(map->method));
    if ((st = stepq__row_split_check(map->method, alpha)) < 0)
        return map_fail(map, st);
    map->row_split = alpha;
    return STEPQ_OK;
}

int stepq_map_set_decode_fit(stepq_map_t *h, stepq_decode_fit fit)
{
    stepq_map_t *map;
    int st = stepq__map_resolve(h, "stepq_map_set_decode_fit", &map);

    if (st < 0)
        return st;
    if ((unsigned)fit >= STEPQ_DECODE_FIT_COUNT)
        return stepq__error_obj(
            map->err, STEPQ_EINVAL,
            "stepq_map_set_decode_fit: %d is not a decode fit (exact, norefit, rows)", (int)fit);
    if (fit != STEPQ_DECODE_FIT_EXACT && !stepq_method_has_col_scales(map->method))
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_decode_fit: method %s has no column scales (only "
                                "dsq, spatial and stepq have the dual-axis fit's column refit)",
                                stepq_method_name(map->method));
    if (!arith_takes_fit(map->arith, fit))
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_decode_fit: the map's arith is fp16, which needs "
                                "decode_fit exact or norefit, not %s (set arith fp32 first)",
                                stepq_decode_fit_name(fit));
    map->decode_fit = fit;
    return STEPQ_OK;
}

int stepq_map_set_arith(stepq_map_t *h, stepq_arith arith)
{
    stepq_map_t *map;
    int st = stepq__map_resolve(h, "stepq_map_set_arith", &map);

    if (st < 0)
        return st;
    if ((unsigned)arith >= STEPQ_ARITH_COUNT)
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_arith: %d is not an arithmetic (fp32, fp16)",
                                (int)arith);
    if (arith != STEPQ_ARITH_FP32 && !stepq_method_has_col_scales(map->method))
        return stepq__error_obj(
            map->err, STEPQ_EINVAL,
            "stepq_map_set_arith: method %s has no column scales (only dsq, spatial and "
            "stepq have the dual-axis decode step's fp16 variant)",
            stepq_method_name(map->method));
    if (!arith_takes_fit(arith, map->decode_fit))
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_arith: fp16 needs decode_fit exact or norefit, not "
                                "%s (set decode_fit exact first)",
                                stepq_decode_fit_name(map->decode_fit));
    map->arith = arith;
    return STEPQ_OK;
}

int stepq__stats_check(const stepq_unit_stats *s, const char *path, int row)
{
    char at[16] = "";

    /* KDA statistics are per-row arrays in JSON: name the element. */
    if (row >= 0)
        snprintf(at, sizeof(at), "[%d]", row);
    if (!isfinite(s->log_retention))
        return stepq__error(STEPQ_ENONFINITE, "%s.log_retention%s: not a finite number", path, at);
    if (s->log_retention > 0.0)
        return stepq__error(STEPQ_ERANGE, "%s.log_retention%s: %s is positive (must be <= 0)", path,
                            at, STEPQ__NUM(s->log_retention));
    if (!isfinite(s->lambda))
        return stepq__error(STEPQ_ENONFINITE, "%s.lambda%s: not a finite number", path, at);
    if (s->lambda < 0.0)
        return stepq__error(STEPQ_ERANGE, "%s.lambda%s: %s is negative", path, at,
                            STEPQ__NUM(s->lambda));
    for (int b = 0; b < 9; b++) {
        double d = s->distortion[b];
        if (isnan(d))
            return stepq__error(STEPQ_ENONFINITE, "%s.distortion.%d%s: NaN", path, b, at);
        if (d < 0.0)
            continue;
        if (!stepq__bits_is_int(b))
            return stepq__error(STEPQ_EINVAL,
                                "%s.distortion.%d%s: %d is not a unit width (entries 0, 1 and 7 "
                                "must be negative)",
                                path, b, at, b);
        if (!isfinite(d))
            return stepq__error(STEPQ_ENONFINITE, "%s.distortion.%d%s: not a finite number", path,
                                b, at);
    }
    return STEPQ_OK;
}

int stepq_map_set_unit_stats(stepq_map_t *h, int layer, int unit, const stepq_unit_stats *stats)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_set_unit_stats", &map);
        if (st_ < 0)
            return st_;
    }
    stepq_unit_stats s;
    char path[96];
    int st;

    if (!map)
        return stepq__error(STEPQ_EINVAL, "stepq_map_set_unit_stats: map is NULL");
    if (!stepq__method_has_units(map->method))
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "stepq_map_set_unit_stats: method %s has no units",
                                stepq_method_name(map->method));
    if ((st = check_unit_ids(map, "stepq_map_set_unit_stats", layer, unit)) < 0)
        return st;
    if (!stats)
        return stepq__error_obj(map->err, STEPQ_EINVAL, "stepq_map_set_unit_stats: stats is NULL");
    s = *stats;
    for (int b = 0; b < 9; b++)
        if (s.distortion[b] < 0.0)
            s.distortion[b] = -1.0;
    stats_path(map, layer, unit, path, sizeof(path));
    if ((st = stepq__stats_check(&s, path, stats_row(map, unit))) < 0)
        return map_fail(map, st);
    if (!map->stats) {
        map->stats = calloc((size_t)map->n_units, sizeof(*map->stats));
        map->has_stats = calloc((size_t)map->n_units, 1);
        if (!map->stats || !map->has_stats) {
            free(map->stats);
            free(map->has_stats);
            map->stats = NULL;
            map->has_stats = NULL;
            return stepq__error_obj(map->err, STEPQ_ENOMEM,
                                    "stepq_map_set_unit_stats: out of memory");
        }
    }
    map->stats[stepq__unit_index(map, layer, unit)] = s;
    map->has_stats[stepq__unit_index(map, layer, unit)] = 1;
    return STEPQ_OK;
}

/* --- provenance --- */

int stepq__prov_str_index(const char *key)
{
    for (int i = 0; key && i < STEPQ__PROV_STR_COUNT; i++)
        if (!strcmp(key, stepq__prov_str_keys[i]))
            return i;
    return -1;
}

int stepq__prov_num_index(const char *key)
{
    for (int i = 0; key && i < STEPQ__PROV_NUM_COUNT; i++)
        if (!strcmp(key, stepq__prov_num_keys[i]))
            return i;
    return -1;
}

int stepq__prov_num_check(int idx, double v, const char *path)
{
    if (!isfinite(v))
        return stepq__error(STEPQ_ENONFINITE, "%s: not a finite number", path);
    if (idx == STEPQ__PROV_PIVOT_FRACTION) {
        if (v < 0.0 || v > 1.0)
            return stepq__error(STEPQ_ERANGE, "%s: %s is out of range [0, 1]", path, STEPQ__NUM(v));
        return STEPQ_OK;
    }
    /* The counts are integers that a double holds exactly. */
    if (v != floor(v))
        return stepq__error(STEPQ_ESCHEMA, "%s: %s is not an integer", path, STEPQ__NUM(v));
    double lo = idx == STEPQ__PROV_HORIZON ? 1.0 : 0.0;
    if (v < lo || v > 9007199254740992.0)
        return stepq__error(STEPQ_ERANGE, "%s: %s is out of range [%g, 2^53]", path, STEPQ__NUM(v),
                            lo);
    return STEPQ_OK;
}

/* Offset of the first byte that breaks UTF-8 (overlongs, surrogates, > U+10FFFF), or -1. */
static long utf8_error(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char b = s[i];
        size_t len;
        uint32_t cp;
        if (b < 0x80) {
            i++;
            continue;
        }
        if (b >= 0xC2 && b <= 0xDF)
            len = 2, cp = b & 0x1F;
        else if (b >= 0xE0 && b <= 0xEF)
            len = 3, cp = b & 0x0F;
        else if (b >= 0xF0 && b <= 0xF4)
            len = 4, cp = b & 0x07;
        else
            return (long)i;
        if (i + len > n)
            return (long)i;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return (long)i;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return (long)i;
        i += len;
    }
    return -1;
}

/* Free text must be valid UTF-8 so that the written map loads again. */
static int text_check(const char *s, const char *what)
{
    size_t n = strlen(s);
    long bad;
    if (n > STEPQ__MAX_TEXT)
        return stepq__error(STEPQ_ERANGE, "%s: %zu bytes, longer than the limit of %d", what, n,
                            STEPQ__MAX_TEXT);
    if ((bad = utf8_error((const unsigned char *)s, n)) >= 0)
        return stepq__error(STEPQ_EINVAL, "%s: invalid UTF-8 at byte %ld", what, bad);
    return STEPQ_OK;
}

int stepq__prov_set_str(stepq_map_t *map, const char *key, const char *value)
{
    int idx = stepq__prov_str_index(key), st;
    char *copy = NULL;
    char what[64];

    if (idx < 0)
        return stepq__error(STEPQ_EINVAL,
                            "provenance.%.32s: unknown string field (tool, tool_version, data, "
                            "notes, method_detail)",
                            key ? key : "(null)");
    if (value) {
        snprintf(what, sizeof(what), "provenance.%s", key);
        if ((st = text_check(value, what)) < 0)
            return st;
        copy = strdup(value);
        if (!copy)
            return stepq__error(STEPQ_ENOMEM, "out of memory");
    }
    free(map->prov_str[idx]);
    map->prov_str[idx] = copy;
    return STEPQ_OK;
}

int stepq__prov_set_num(stepq_map_t *map, const char *key, double value)
{
    int idx = stepq__prov_num_index(key), st;
    char path[64];

    if (idx < 0)
        return stepq__error(STEPQ_EINVAL,
                            "provenance.%.32s: unknown numeric field (tokens, segments, "
                            "segment_length, horizon, pivot_fraction)",
                            key ? key : "(null)");
    if (isnan(value)) {
        map->has_prov_num[idx] = false;
        map->prov_num[idx] = 0.0;
        return STEPQ_OK;
    }
    snprintf(path, sizeof(path), "provenance.%s", key);
    if ((st = stepq__prov_num_check(idx, value, path)) < 0)
        return st;
    map->prov_num[idx] = value;
    map->has_prov_num[idx] = true;
    return STEPQ_OK;
}

int stepq_map_set_provenance(stepq_map_t *h, const char *key, const char *value)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_set_provenance", &map);
        if (st_ < 0)
            return st_;
    }
    int st;
    if (!map)
        return stepq__error(STEPQ_EINVAL, "stepq_map_set_provenance: map is NULL");
    if ((st = stepq__prov_set_str(map, key, value)) < 0)
        return map_fail(map, st);
    return STEPQ_OK;
}

int stepq_map_set_provenance_number(stepq_map_t *h, const char *key, double value)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_set_provenance_number", &map);
        if (st_ < 0)
            return st_;
    }
    int st;
    if (!map)
        return stepq__error(STEPQ_EINVAL, "stepq_map_set_provenance_number: map is NULL");
    if ((st = stepq__prov_set_num(map, key, value)) < 0)
        return map_fail(map, st);
    return STEPQ_OK;
}

int stepq_map_set_provenance_candidates(stepq_map_t *h, const int *bits, int n)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_set_provenance_candidates", &map);
        if (st_ < 0)
            return st_;
    }
    if (!map)
        return stepq__error(STEPQ_EINVAL, "stepq_map_set_provenance_candidates: map is NULL");
    if (!bits) {
        map->n_candidates = -1;
        return STEPQ_OK;
    }
    if (n < 1 || n > STEPQ__MAX_CANDIDATES)
        return stepq__error_obj(map->err, STEPQ_EINVAL,
                                "provenance.candidates: %d entries, must be 1..%d", n,
                                STEPQ__MAX_CANDIDATES);
    for (int i = 0; i < n; i++) {
        if (!stepq__bits_is_int(bits[i]))
            return stepq__error_obj(map->err, STEPQ_EINVAL,
                                    "provenance.candidates[%d]: %d is not one of 2,3,4,5,6,8", i,
                                    bits[i]);
        if (i > 0 && bits[i] <= bits[i - 1])
            return stepq__error_obj(map->err, STEPQ_EINVAL,
                                    "provenance.candidates[%d]: %d does not follow %d (must be "
                                    "strictly increasing)",
                                    i, bits[i], bits[i - 1]);
    }
    memcpy(map->candidates, bits, sizeof(int) * (size_t)n);
    map->n_candidates = n;
    return STEPQ_OK;
}

int stepq__map_set_name(stepq_map_t *map, const char *name)
{
    char *copy = NULL;
    int st;

    if (name) {
        if ((st = text_check(name, "model.name")) < 0)
            return map_fail(map, st);
        copy = strdup(name);
        if (!copy)
            return stepq__error_obj(map->err, STEPQ_ENOMEM, "out of memory");
    }
    free(map->model_name);
    map->model_name = copy;
    return STEPQ_OK;
}

int stepq_map_set_model_name(stepq_map_t *h, const char *name)
{
    stepq_map_t *map;
    int st = stepq__map_resolve(h, "stepq_map_set_model_name", &map);

    return st < 0 ? st : stepq__map_set_name(map, name);
}

/* --- validation --- */

/* JSON path of a unit's width: layers[l].heads[h].bits or ...row_bits[r]. */
static void unit_path(const stepq_map_t *m, int layer, int unit, char *buf, size_t n)
{
    if (m->shape.arch == STEPQ_ARCH_GDN)
        snprintf(buf, n, "layers[%d].heads[%d].bits", layer, unit);
    else
        snprintf(buf, n, "layers[%d].heads[%d].row_bits[%d]", layer, unit / m->shape.head_k_dim,
                 unit % m->shape.head_k_dim);
}

static unsigned measured_set(const stepq_unit_stats *s)
{
    unsigned set = 0;
    for (int b = 0; b < 9; b++)
        if (s->distortion[b] >= 0.0)
            set |= 1u << b;
    return set;
}

static void format_set(unsigned set, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int b = 0; b < 9 && len + 3 < n; b++)
        if (set & (1u << b))
            len += (size_t)snprintf(buf + len, n - len, "%s%d", len ? "," : "", b);
    if (!set)
        snprintf(buf, n, "none");
}

int stepq__map_check(const stepq_map_t *m)
{
    char path[128];
    int st;

    if ((st = stepq__shape_check(&m->shape)) < 0)
        return st;
    if ((st = stepq__budget_check(m->method, m->budget_bits)) < 0)
        return st;
    if ((st = stepq__row_split_check(m->method, m->row_split)) < 0)
        return st;
    if ((st = stepq__decode_fit_check(m->method, m->decode_fit)) < 0)
        return st;
    if ((st = stepq__arith_check(m->method, m->decode_fit, m->arith)) < 0)
        return st;
    if (!stepq__method_has_units(m->method))
        return STEPQ_OK;

    /* Widths, pivots and the budget rule. */
    uint64_t code_bits = 0, n_values, piv_values = 0;
    const uint64_t vpu = (uint64_t)m->values_per_unit;
    n_values = (uint64_t)m->n_units * vpu;
    for (int l = 0; l < m->shape.n_layers; l++) {
        for (int u = 0; u < m->units_per_layer; u++) {
            int b = m->bits[stepq__unit_index(m, l, u)];
            if (b == STEPQ_BITS_PIVOT) {
                if (!stepq__method_has_pivots(m->method)) {
                    unit_path(m, l, u, path, sizeof(path));
                    return stepq__error(STEPQ_ERANGE,
                                        "%s: 16 (fp16 pivot) is not allowed for method %s (only "
                                        "temporal and stepq have pivots)",
                                        path, stepq_method_name(m->method));
                }
                piv_values += vpu;
                continue;
            }
            if (!stepq__bits_is_int(b)) {
                unit_path(m, l, u, path, sizeof(path));
                return stepq__error(STEPQ_ERANGE, "%s: %d is not one of 2,3,4,5,6,8", path, b);
            }
            if (stepq__method_single_width(m->method) && b != (int)m->budget_bits) {
                unit_path(m, l, u, path, sizeof(path));
                return stepq__error(STEPQ_ERANGE,
                                    "%s: %d differs from budget_bits %s (method %s stores every "
                                    "unit at one width)",
                                    path, b, STEPQ__NUM(m->budget_bits),
                                    stepq_method_name(m->method));
            }
            code_bits += vpu * (uint64_t)b;
        }
    }
    if (stepq__method_has_pivots(m->method)) {
        /* Pivots count as replacing 8-bit units (the budget rule of tools/CALIBRATION.md). */
        double limit = m->budget_bits * (double)n_values - 8.0 * (double)piv_values;
        if ((double)code_bits > limit)
            return stepq__error(STEPQ_ERANGE,
                                "layers: non-pivot units use %llu bits, over the budget "
                                "budget_bits*N - 8*N_piv = %s (N = %llu values, N_piv = %llu "
                                "pivot values)",
                                (unsigned long long)code_bits, STEPQ__NUM(limit),
                                (unsigned long long)n_values, (unsigned long long)piv_values);
    }

    if (m->row_impact) {
        const int dk = m->shape.head_k_dim;
        for (int l = 0; l < m->shape.n_layers; l++) {
            for (int h = 0; h < m->shape.num_v_heads; h++) {
                snprintf(path, sizeof(path), "layers[%d].heads[%d].row_impact", l, h);
                const float *w = m->row_impact + ((size_t)l * m->shape.num_v_heads + h) * dk;
                if ((st = stepq__row_impact_check(w, dk, path)) < 0)
                    return st;
            }
        }
    }

    if (m->stats) {
        unsigned set0 = measured_set(&m->stats[0]);
        for (int l = 0; l < m->shape.n_layers; l++) {
            for (int u = 0; u < m->units_per_layer; u++) {
                int64_t i = stepq__unit_index(m, l, u);
                stats_path(m, l, u, path, sizeof(path));
                if (!m->has_stats[i]) {
                    return stepq__error(STEPQ_ESCHEMA,
                                        "%s: missing%s, but other units have statistics (they are "
                                        "all-or-none)",
                                        path, m->shape.arch == STEPQ_ARCH_KDA ? " for a row" : "");
                }
                if ((st = stepq__stats_check(&m->stats[i], path, stats_row(m, u))) < 0)
                    return st;
                unsigned set = measured_set(&m->stats[i]);
                if (set != set0) {
                    char a[32], b[32];
                    format_set(set, a, sizeof(a));
                    format_set(set0, b, sizeof(b));
                    return stepq__error(STEPQ_ESCHEMA,
                                        "%s.distortion: measures bits {%s} but the first unit "
                                        "measures {%s} (the set must be the same for every unit)",
                                        path, a, b);
                }
            }
        }
    }
    return STEPQ_OK;
}

int stepq_map_validate(const stepq_map_t *h)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_validate", &map);
        if (st_ < 0)
            return st_;
    }
    if (!map)
        return stepq__error(STEPQ_EINVAL, "stepq_map_validate: map is NULL");
    return stepq__map_check(map);
}

/* --- readers --- */

int stepq_map_shape(const stepq_map_t *h, stepq_model_shape *shape)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_shape", &map);
        if (st_ < 0)
            return st_;
    }
    if (!map || !shape)
        return stepq__error(STEPQ_EINVAL, "stepq_map_shape: NULL argument");
    *shape = map->shape;
    return STEPQ_OK;
}

stepq_method stepq_map_method(const stepq_map_t *h)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_method");
    return map ? map->method : STEPQ_METHOD_COUNT;
}

double stepq_map_budget_bits(const stepq_map_t *h)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_budget_bits");
    return map ? map->budget_bits : 0.0;
}

double stepq_map_row_split(const stepq_map_t *h)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_row_split");
    return map ? map->row_split : 0.0;
}

stepq_decode_fit stepq_map_decode_fit(const stepq_map_t *h)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_decode_fit");
    return map ? map->decode_fit : STEPQ_DECODE_FIT_COUNT;
}

stepq_arith stepq_map_arith(const stepq_map_t *h)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_arith");
    return map ? map->arith : STEPQ_ARITH_COUNT;
}

const char *stepq_map_model_name(const stepq_map_t *h)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_model_name");
    return map && map->model_name ? map->model_name : "";
}

int stepq_map_layer_index(const stepq_map_t *h, int model_layer_id)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_layer_index", &map);
        if (st_ < 0)
            return st_;
    }
    int lo = 0, hi;

    if (!map)
        return stepq__error(STEPQ_EINVAL, "stepq_map_layer_index: map is NULL");
    hi = map->shape.n_layers - 1;
    while (lo <= hi) { /* ids are strictly increasing */
        int mid = lo + (hi - lo) / 2;
        if (map->layer_ids[mid] == model_layer_id)
            return mid;
        if (map->layer_ids[mid] < model_layer_id)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return stepq__error(STEPQ_ENOENT, "model layer %d is not a recurrent layer of this map",
                        model_layer_id);
}

int stepq_map_units_per_layer(const stepq_map_t *h)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_units_per_layer", &map);
        if (st_ < 0)
            return st_;
    }
    return map ? map->units_per_layer
               : stepq__error(STEPQ_EINVAL, "stepq_map_units_per_layer: map is NULL");
}

int stepq_map_values_per_unit(const stepq_map_t *h)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_values_per_unit", &map);
        if (st_ < 0)
            return st_;
    }
    return map ? map->values_per_unit
               : stepq__error(STEPQ_EINVAL, "stepq_map_values_per_unit: map is NULL");
}

/* Id checks for readers: thread-local error only (the map may be shared). */
static int reader_ids(const stepq_map_t *map, const char *fn, int layer, int unit, int n_unit)
{
    if (!map)
        return stepq__error(STEPQ_EINVAL, "%s: map is NULL", fn);
    if (layer < 0 || layer >= map->shape.n_layers)
        return stepq__error(STEPQ_EINVAL, "%s: layer %d is out of range 0..%d", fn, layer,
                            map->shape.n_layers - 1);
    if (unit < 0 || unit >= n_unit)
        return stepq__error(STEPQ_EINVAL, "%s: id %d is out of range 0..%d", fn, unit, n_unit - 1);
    return STEPQ_OK;
}

int stepq_map_unit_bits(const stepq_map_t *h, int layer, int unit)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_unit_bits", &map);
        if (st_ < 0)
            return st_;
    }
    int st = reader_ids(map, "stepq_map_unit_bits", layer, unit, map ? map->units_per_layer : 0);
    if (st < 0)
        return st;
    if (!map->bits)
        return STEPQ_BITS_DENSE;
    return map->bits[stepq__unit_index(map, layer, unit)];
}

const uint8_t *stepq_map_layer_bits(const stepq_map_t *h, int layer)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_layer_bits");
    if (reader_ids(map, "stepq_map_layer_bits", layer, 0, 1) < 0)
        return NULL;
    if (!map->bits) {
        stepq__error(STEPQ_EINVAL, "stepq_map_layer_bits: method %s has no per-unit widths",
                     stepq_method_name(map->method));
        return NULL;
    }
    return map->bits + stepq__unit_index(map, layer, 0);
}

int stepq_map_head_row_bits(const stepq_map_t *h, int layer, int head, uint8_t *row_bits, int n)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_head_row_bits", &map);
        if (st_ < 0)
            return st_;
    }
    int st =
        reader_ids(map, "stepq_map_head_row_bits", layer, head, map ? map->shape.num_v_heads : 0);
    if (st < 0)
        return st;
    if (!row_bits || n != map->shape.head_k_dim)
        return stepq__error(STEPQ_EINVAL,
                            "stepq_map_head_row_bits: row_bits %s, n = %d (head_k_dim is %d)",
                            row_bits ? "set" : "NULL", n, map->shape.head_k_dim);
    for (int i = 0; i < n; i++) {
        if (!map->bits)
            row_bits[i] = STEPQ_BITS_DENSE;
        else
            row_bits[i] = map->bits[stepq__unit_index(
                map, layer, map->shape.arch == STEPQ_ARCH_KDA ? head * n + i : head)];
    }
    return STEPQ_OK;
}

const float *stepq_map_row_impact(const stepq_map_t *h, int layer, int head)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_row_impact");
    if (reader_ids(map, "stepq_map_row_impact", layer, head, map ? map->shape.num_v_heads : 0) < 0)
        return NULL;
    if (!map->row_impact)
        return NULL;
    return map->row_impact +
           ((size_t)layer * map->shape.num_v_heads + head) * (size_t)map->shape.head_k_dim;
}

int stepq_map_unit_stats(const stepq_map_t *h, int layer, int unit, stepq_unit_stats *stats)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_unit_stats", &map);
        if (st_ < 0)
            return st_;
    }
    int st = reader_ids(map, "stepq_map_unit_stats", layer, unit, map ? map->units_per_layer : 0);
    if (st < 0)
        return st;
    if (!stats)
        return stepq__error(STEPQ_EINVAL, "stepq_map_unit_stats: stats is NULL");
    if (!map->stats || !map->has_stats[stepq__unit_index(map, layer, unit)])
        return stepq__error(STEPQ_ENOENT, "layer %d unit %d has no calibration statistics", layer,
                            unit);
    *stats = map->stats[stepq__unit_index(map, layer, unit)];
    return STEPQ_OK;
}

const char *stepq_map_provenance(const stepq_map_t *h, const char *key)
{
    stepq_map_t *map = stepq__map_of(h, "stepq_map_provenance");
    int idx = stepq__prov_str_index(key);
    return map && idx >= 0 ? map->prov_str[idx] : NULL;
}

int stepq_map_provenance_number(const stepq_map_t *h, const char *key, double *value)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_provenance_number", &map);
        if (st_ < 0)
            return st_;
    }
    int idx = stepq__prov_num_index(key);
    if (!map || !value)
        return stepq__error(STEPQ_EINVAL, "stepq_map_provenance_number: NULL argument");
    if (idx < 0)
        return stepq__error(STEPQ_EINVAL, "provenance.%.32s: unknown numeric field",
                            key ? key : "(null)");
    if (!map->has_prov_num[idx])
        return stepq__error(STEPQ_ENOENT, "provenance.%s: not set", key);
    *value = map->prov_num[idx];
    return STEPQ_OK;
}

int stepq_map_provenance_candidates(const stepq_map_t *h, int *bits, int cap)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_provenance_candidates", &map);
        if (st_ < 0)
            return st_;
    }
    if (!map || (cap > 0 && !bits))
        return stepq__error(STEPQ_EINVAL, "stepq_map_provenance_candidates: NULL argument");
    if (map->n_candidates < 0)
        return stepq__error(STEPQ_ENOENT, "provenance.candidates: not set");
    for (int i = 0; i < map->n_candidates && i < cap; i++)
        bits[i] = map->candidates[i];
    return map->n_candidates;
}

/* --- memory accounting --- */

int stepq_map_memory_info(const stepq_map_t *h, stepq_map_memory *out)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_memory_info", &map);
        if (st_ < 0)
            return st_;
    }
    stepq_map_memory r;

    if (!map || !out)
        return stepq__error(STEPQ_EINVAL, "stepq_map_memory_info: NULL argument");
    memset(&r, 0, sizeof(r));
    const stepq_model_shape *s = &map->shape;
    const uint64_t L = (uint64_t)s->n_layers, HV = (uint64_t)s->num_v_heads;
    const uint64_t dk = (uint64_t)s->head_k_dim, dv = (uint64_t)s->head_v_dim;
    const uint64_t vpu = (uint64_t)map->values_per_unit;

    r.n_values = L * HV * dk * dv;
    r.n_units = (uint64_t)map->n_units;
    r.state_bytes_fp32 = r.n_values * 4;
    if (s->conv_rank > 0) {
        uint64_t e = 1;
        for (int i = 0; i < s->conv_rank; i++)
            e *= (uint64_t)s->conv_shape[i];
        r.conv_bytes = L * e * stepq_dtype_size(s->conv_dtype);
    }

    if (stepq_method_is_dense(map->method)) {
        stepq_dtype dt = map->method == STEPQ_METHOD_FP32   ? STEPQ_DTYPE_FP32
                         : map->method == STEPQ_METHOD_BF16 ? STEPQ_DTYPE_BF16
                                                            : STEPQ_DTYPE_FP16;
        r.dense_bytes = r.n_values * stepq_dtype_size(dt);
    } else if (map->method == STEPQ_METHOD_FP8) {
        /* One e4m3 byte per value and one fp32 scale per (head, tile of 32 columns); a
         * d_v that is not a multiple of 32 ends in a shorter tile (kernels/format.h). */
        r.code_bytes = r.n_values;
        r.scale_bytes = L * HV * ((dv + STEPQ__FP8_TILE - 1) / STEPQ__FP8_TILE) * 4;
    } else {
        const bool col = stepq_method_has_col_scales(map->method);
        const int upl = map->units_per_layer;
        const int units_per_head = s->arch == STEPQ_ARCH_GDN ? 1 : s->head_k_dim;
        /* GDN: d_k row scales per head unit; KDA: one per row unit. */
        const uint64_t row_scale = s->arch == STEPQ_ARCH_GDN ? 2 * dk : 2;
        for (int l = 0; l < s->n_layers; l++) {
            const uint8_t *bits = map->bits + stepq__unit_index(map, l, 0);
            for (int u0 = 0; u0 < upl; u0 += units_per_head) {
                bool any_int = false;
                for (int u = u0; u < u0 + units_per_head; u++) {
                    if (bits[u] == STEPQ_BITS_PIVOT) {
                        r.n_pivots++;
                        r.pivot_bytes += 2 * vpu;
                    } else {
                        any_int = true;
                        r.code_bytes += (vpu * bits[u] + 7) / 8;
                        r.scale_bytes += row_scale;
                    }
                }
                if (col && any_int)
                    r.scale_bytes += 2 * dv;
            }
        }
    }
    r.state_bytes_compact = r.dense_bytes + r.code_bytes + r.scale_bytes + r.pivot_bytes;
    r.bits_per_value = (double)r.state_bytes_compact * 8.0 / (double)r.n_values;
    r.ratio_vs_fp32 = (double)r.state_bytes_fp32 / (double)r.state_bytes_compact;
    *out = r;
    return STEPQ_OK;
}

/* --- fingerprint and equality --- */

/* Little-endian encoding, so the value does not depend on the host. */
static uint64_t fnv_u64(uint64_t h, uint64_t v)
{
    unsigned char b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    return stepq__fnv1a(h, b, 8);
}

static uint64_t fnv_double(uint64_t h, double d)
{
    uint64_t v;
    memcpy(&v, &d, sizeof(v));
    return fnv_u64(h, v);
}

int stepq_map_fingerprint(const stepq_map_t *handle, uint64_t *out)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(handle, "stepq_map_fingerprint", &map);
        if (st_ < 0)
            return st_;
    }
    static const char tag[] = "stepq-map-fingerprint-v1";
    uint64_t h = STEPQ__FNV_OFFSET;

    if (!map || !out)
        return stepq__error(STEPQ_EINVAL, "stepq_map_fingerprint: NULL argument");
    const stepq_model_shape *s = &map->shape;
    h = stepq__fnv1a(h, tag, sizeof(tag) - 1);
    h = fnv_u64(h, (uint64_t)s->arch);
    h = fnv_u64(h, (uint64_t)s->n_layers);
    for (int i = 0; i < s->n_layers; i++)
        h = fnv_u64(h, (uint64_t)s->layer_ids[i]);
    h = fnv_u64(h, (uint64_t)s->num_k_heads);
    h = fnv_u64(h, (uint64_t)s->num_v_heads);
    h = fnv_u64(h, (uint64_t)s->head_k_dim);
    h = fnv_u64(h, (uint64_t)s->head_v_dim);
    h = fnv_u64(h, (uint64_t)s->conv_rank);
    for (int i = 0; i < s->conv_rank; i++)
        h = fnv_u64(h, (uint64_t)s->conv_shape[i]);
    h = fnv_u64(h, s->conv_rank ? (uint64_t)s->conv_dtype : 0);
    h = fnv_u64(h, (uint64_t)map->method);
    h = fnv_double(h, map->budget_bits);
    /* Only a split other than the default is hashed: the fingerprints of the maps that
     * have no row_split field stay what they were before the field existed. */
    if (map->row_split != STEPQ__ROW_SPLIT_DEFAULT) {
        static const char split_tag[] = "row_split";
        h = stepq__fnv1a(h, split_tag, sizeof(split_tag) - 1);
        h = fnv_double(h, map->row_split);
    }
    /* Likewise the decode fit: only one other than exact is hashed. */
    if (map->decode_fit != STEPQ_DECODE_FIT_EXACT) {
        static const char fit_tag[] = "decode_fit";
        h = stepq__fnv1a(h, fit_tag, sizeof(fit_tag) - 1);
        h = fnv_u64(h, (uint64_t)map->decode_fit);
    }
    /* And the arithmetic: only one other than fp32 is hashed. */
    if (map->arith != STEPQ_ARITH_FP32) {
        static const char arith_tag[] = "arith";
        h = stepq__fnv1a(h, arith_tag, sizeof(arith_tag) - 1);
        h = fnv_u64(h, (uint64_t)map->arith);
    }
    if (map->bits)
        h = stepq__fnv1a(h, map->bits, (size_t)map->n_units);
    if (map->row_impact) {
        size_t n = (size_t)s->n_layers * s->num_v_heads * s->head_k_dim;
        for (size_t i = 0; i < n; i++) {
            uint32_t v;
            memcpy(&v, &map->row_impact[i], sizeof(v));
            h = fnv_u64(h, v);
        }
    }
    *out = h;
    return STEPQ_OK;
}

static bool str_eq(const char *a, const char *b)
{
    if (!a || !b)
        return a == b;
    return !strcmp(a, b);
}

bool stepq__map_equal(const stepq_map_t *ha, const stepq_map_t *hb)
{
    const stepq_map_t *a = stepq__map_of(ha, "stepq__map_equal"),
                      *b = stepq__map_of(hb, "stepq__map_equal");

    const stepq_model_shape *sa = &a->shape, *sb = &b->shape;

    if (sa->arch != sb->arch || sa->n_layers != sb->n_layers ||
        sa->num_k_heads != sb->num_k_heads || sa->num_v_heads != sb->num_v_heads ||
        sa->head_k_dim != sb->head_k_dim || sa->head_v_dim != sb->head_v_dim ||
        sa->conv_rank != sb->conv_rank)
        return false;
    if (memcmp(sa->layer_ids, sb->layer_ids, sizeof(int) * (size_t)sa->n_layers))
        return false;
    for (int i = 0; i < sa->conv_rank; i++)
        if (sa->conv_shape[i] != sb->conv_shape[i])
            return false;
    if (sa->conv_rank && sa->conv_dtype != sb->conv_dtype)
        return false;
    if (a->method != b->method || memcmp(&a->budget_bits, &b->budget_bits, sizeof(double)) ||
        memcmp(&a->row_split, &b->row_split, sizeof(double)) || a->decode_fit != b->decode_fit ||
        a->arith != b->arith)
        return false;
    if (!str_eq(a->model_name, b->model_name))
        return false;
    if (!a->bits != !b->bits || (a->bits && memcmp(a->bits, b->bits, (size_t)a->n_units)))
        return false;
    if (!a->row_impact != !b->row_impact)
        return false;
    if (a->row_impact &&
        memcmp(a->row_impact, b->row_impact,
               sizeof(float) * (size_t)sa->n_layers * sa->num_v_heads * sa->head_k_dim))
        return false;
    if (!a->stats != !b->stats)
        return false;
    if (a->stats) {
        if (memcmp(a->has_stats, b->has_stats, (size_t)a->n_units))
            return false;
        for (int64_t i = 0; i < a->n_units; i++) {
            if (!a->has_stats[i])
                continue;
            /* Field by field: the struct may have padding. */
            const stepq_unit_stats *x = &a->stats[i], *y = &b->stats[i];
            if (memcmp(&x->log_retention, &y->log_retention, sizeof(double)) ||
                memcmp(&x->lambda, &y->lambda, sizeof(double)) ||
                memcmp(x->distortion, y->distortion, sizeof(x->distortion)))
                return false;
        }
    }
    for (int i = 0; i < STEPQ__PROV_STR_COUNT; i++)
        if (!str_eq(a->prov_str[i], b->prov_str[i]))
            return false;
    for (int i = 0; i < STEPQ__PROV_NUM_COUNT; i++) {
        if (a->has_prov_num[i] != b->has_prov_num[i])
            return false;
        if (a->has_prov_num[i] && memcmp(&a->prov_num[i], &b->prov_num[i], sizeof(double)))
            return false;
    }
    if (a->n_candidates != b->n_candidates)
        return false;
    if (a->n_candidates > 0 &&
        memcmp(a->candidates, b->candidates, sizeof(int) * (size_t)a->n_candidates))
        return false;
    return true;
}
