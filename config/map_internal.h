/*
 * Internals of the precision-map layer (config/): the in-memory map, the
 * shared validation rules used by the builder, the loader and the writer,
 * and test hooks. Only the config sources and the tests include this header.
 */
#ifndef STEPQ_CONFIG_MAP_INTERNAL_H
#define STEPQ_CONFIG_MAP_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "plugin/err.h"
#include "plugin/handle.h"
#include "plugin/vocab.h"
#include "stepq/map.h"

/* Format name and the one schema version this library reads and writes. */
#define STEPQ__MAP_FORMAT         "stepq-precision-map"
#define STEPQ__MAP_SCHEMA_VERSION 1

/*
 * Shape limits. They keep every byte count far inside uint64_t (values per
 * request <= 2^48) and every per-layer count inside int; real models are
 * orders of magnitude smaller.
 */
#define STEPQ__MAX_LAYERS    4096
#define STEPQ__MAX_LAYER_ID  1000000
#define STEPQ__MAX_HEADS     4096
#define STEPQ__MAX_CONV_DIM  INT32_MAX
#define STEPQ__MAX_CONV_ELEM (INT64_C(1) << 40) /* per layer */
/* Per-unit arrays of a quantized map are bounded so a map never needs GiBs. */
#define STEPQ__MAX_UNITS (INT64_C(1) << 28)
/* Free-text fields (model name, provenance strings). */
#define STEPQ__MAX_TEXT 65536

/* The dual-axis fit's row split of a map that has no `row_split` field (SCHEMA.md). */
#define STEPQ__ROW_SPLIT_DEFAULT 0.5

/* Tolerance of the "geometric mean 1 within a head" row-impact rule. */
#define STEPQ__ROW_IMPACT_GEOMEAN_TOL 1e-3

/* Default load size limit (stepq_map_load_config.max_bytes == 0). */
#define STEPQ__MAP_DEFAULT_MAX_BYTES ((size_t)256 << 20)
/* Default JSON value limit (stepq_map_load_config.max_values == 0): 14x the values of the
 * largest bundled map, about 340 MB of cJSON tree (64 B a node plus the allocator's). */
#define STEPQ__MAP_DEFAULT_MAX_VALUES ((size_t)1 << 22)

/* Provenance keys (SCHEMA.md): strings, numbers, and the candidate list. */
enum stepq__prov_str {
    STEPQ__PROV_TOOL,
    STEPQ__PROV_TOOL_VERSION,
    STEPQ__PROV_DATA,
    STEPQ__PROV_NOTES,
    STEPQ__PROV_METHOD_DETAIL,
    STEPQ__PROV_STR_COUNT
};
enum stepq__prov_num {
    STEPQ__PROV_TOKENS,
    STEPQ__PROV_SEGMENTS,
    STEPQ__PROV_SEGMENT_LENGTH,
    STEPQ__PROV_HORIZON,
    STEPQ__PROV_PIVOT_FRACTION,
    STEPQ__PROV_NUM_COUNT
};
extern const char *const stepq__prov_str_keys[STEPQ__PROV_STR_COUNT];
extern const char *const stepq__prov_num_keys[STEPQ__PROV_NUM_COUNT];
/* Largest number of candidate widths (2,3,4,5,6,8). */
#define STEPQ__MAX_CANDIDATES 6

struct stepq_map {
    stepq_model_shape shape; /* shape.layer_ids points at layer_ids below */
    int *layer_ids;
    stepq_method method;
    double budget_bits;
    double row_split; /* the dual-axis fit's row split: 0.5 unless dsq/spatial/stepq say else */
    stepq_decode_fit
        decode_fit;    /* the decode step's fit: exact unless dsq/spatial/stepq say else */
    stepq_arith arith; /* the decode step's arithmetic: fp32 unless dsq/spatial/stepq say else */
    char *model_name;  /* NULL when absent */

    int units_per_layer; /* HV (GDN) or HV * d_k (KDA) */
    int values_per_unit; /* d_k * d_v (GDN) or d_v (KDA) */
    int64_t n_units;     /* n_layers * units_per_layer */

    /* Quantized methods only (NULL for dense ones), [layer][unit]. */
    uint8_t *bits;
    /* spatial / stepq only, [layer][head][row]; NULL otherwise. */
    float *row_impact;
    /* Calibration statistics, allocated on first use, [layer][unit]. */
    stepq_unit_stats *stats;
    uint8_t *has_stats;

    char *prov_str[STEPQ__PROV_STR_COUNT];
    double prov_num[STEPQ__PROV_NUM_COUNT];
    bool has_prov_num[STEPQ__PROV_NUM_COUNT];
    int candidates[STEPQ__MAX_CANDIDATES];
    int n_candidates; /* -1: no candidate list */

    char err[STEPQ__ERRLEN];
    struct stepq__handle_entry *entry; /* its handle, once published */
};

/** Whether b is an integer unit width (2,3,4,5,6,8). */
bool stepq__bits_is_int(int b);

/**
 * Checks a model shape against the schema rules. Messages name the JSON
 * path under `model` (e.g. "model.num_v_heads: ..."). Thread error only.
 */
int stepq__shape_check(const stepq_model_shape *shape);

/**
 * Checks that a method and budget go together ("budget_bits: ..."). Thread
 * error only.
 */
int stepq__budget_check(stepq_method method, double budget_bits);

/**
 * Checks a row split for a method ("row_split: ..."): finite (else
 * STEPQ_ENONFINITE), in (0, 1] (else STEPQ_ERANGE), and 0.5 unless the
 * method has column scales (else STEPQ_ESCHEMA). Thread error only.
 */
int stepq__row_split_check(stepq_method method, double row_split);

/**
 * Checks a decode fit for a method ("decode_fit: ..."): one of the list
 * (else STEPQ_EINVAL), and exact unless the method has column scales (else
 * STEPQ_ESCHEMA). Thread error only.
 */
int stepq__decode_fit_check(stepq_method method, stepq_decode_fit fit);

/**
 * Checks a decode step's arithmetic for a method and a decode fit ("arith:
 * ..."): one of the list (else STEPQ_EINVAL), fp32 unless the method has
 * column scales (else STEPQ_ESCHEMA), and fp16 only with the exact decode
 * fit (else STEPQ_ESCHEMA, naming both fields). Thread error only.
 */
int stepq__arith_check(stepq_method method, stepq_decode_fit fit, stepq_arith arith);

/**
 * Allocates a map for a checked shape, method and budget: every unit at the
 * budget width (quantized methods), unit row impact where the method has
 * it, row split 0.5, exact decode fit, fp32 arithmetic, no statistics, no
 * provenance. Returns STEPQ_ENOMEM or STEPQ_ERANGE (too many units) with a
 * thread error.
 */
int stepq__map_alloc(const stepq_model_shape *shape, stepq_method method, double budget_bits,
                     stepq_map_t **out);

/**
 * Checks every cross-field rule of a complete map (method widths, pivots,
 * budget, row split, row impact, statistics). Messages name JSON paths. Does not write
 * the map's error buffer (the map may be shared between threads).
 */
int stepq__map_check(const stepq_map_t *map);

/** Checks one head's row-impact factors; path names the JSON array. */
int stepq__row_impact_check(const float *w, int n, const char *path);

/**
 * Checks one unit's statistics; path names the JSON object, row is the
 * index into its per-row arrays (KDA) or -1 (GDN).
 */
int stepq__stats_check(const stepq_unit_stats *s, const char *path, int row);

/** Checks and stores a provenance string / number by key (NULL value removes). */
int stepq__prov_set_str(stepq_map_t *map, const char *key, const char *value);
int stepq__prov_set_num(stepq_map_t *map, const char *key, double value);
/** Index of a provenance key, or -1. */
int stepq__prov_str_index(const char *key);
int stepq__prov_num_index(const char *key);
/** Checks one numeric provenance value; path names the JSON field. */
int stepq__prov_num_check(int idx, double value, const char *path);

/**
 * Formats a double for an error message: the shortest %g text that reads
 * back as the same value ("0.1", not "0.10000000000000001"). Returns buf.
 */
const char *stepq__num(char buf[32], double v);
/* Convenience for one message argument (the buffer lives in the caller's block). */
#define STEPQ__NUM(v) stepq__num((char[32]){ 0 }, (v))

/** Exact equality of two maps, every field included (tests, round trips). */
bool stepq__map_equal(const stepq_map_t *a, const stepq_map_t *b);

/*
 * Map handles (plugin/handle.h). The public functions take handles and
 * resolve them first; the loader and the builder work on the struct and
 * publish it when it is complete.
 */
/** Gives a complete map its handle in *out; frees the map on failure. */
int stepq__map_publish(stepq_map_t *map, stepq_map_t **out);
/** The map a handle names: STEPQ_EINVAL for NULL, STEPQ_EBADF for a stale or foreign one. */
int stepq__map_resolve(const stepq_map_t *h, const char *fn, stepq_map_t **map);
/** stepq__map_resolve for functions that return no status: NULL (error recorded) or the map. */
stepq_map_t *stepq__map_of(const stepq_map_t *h, const char *fn);
/** Frees a map's struct and arrays (one not published, or one whose handle is dropped). */
void stepq__map_free(stepq_map_t *map);
/** The model name setter on the struct. */
int stepq__map_set_name(stepq_map_t *map, const char *name);

/** Index of a unit in the [layer][unit] arrays. */
static inline int64_t stepq__unit_index(const stepq_map_t *m, int layer, int unit)
{
    return (int64_t)layer * m->units_per_layer + unit;
}

#endif /* STEPQ_CONFIG_MAP_INTERNAL_H */
