/*
 * Precision maps: the per-checkpoint, per-budget description of how each
 * recurrent-state unit is stored (schema: config/SCHEMA.md).
 *
 * A unit is a whole value head (GDN) or one key row of a head (KDA). Unit ids
 * inside a layer are `head` for GDN and `head * d_k + row` for KDA.
 *
 * `layer` arguments are recurrent-layer indices 0..n_layers-1 (positions in
 * model.recurrent_layers), not model layer ids; stepq_map_layer_index()
 * translates a model layer id.
 *
 * A map handle is immutable once loaded or validated and may then be read
 * from any number of threads. Building a map (stepq_map_create + setters) is
 * single-threaded. Every failing call leaves the map unchanged, returns a
 * status and sets stepq_last_error() (thread-local). Failing calls that take
 * a non-const map (the setters) also set stepq_map_last_error(); calls on a
 * const map (readers, validate, write) set only the thread-local text, so
 * that many threads may read one shared map without a data race.
 */
#ifndef STEPQ_MAP_H
#define STEPQ_MAP_H

#include "stepq/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Opaque precision map handle (not the map's address): once its map is
 * closed it is STEPQ_EBADF in every call for good, even when a later map
 * reuses the memory. Maps are read-only once loaded and may be read from
 * several threads; closing must not race with their use.
 */
typedef struct stepq_map stepq_map_t;

/*
 * The vocabulary, one list each (libuv's X-macro habit): the enums below, the
 * name functions (stepq_method_name(), ...) and the method properties
 * (stepq_method_is_dense(), ...) are all generated from these lists, so they
 * cannot disagree.
 *
 * Architectures: XX(NAME, value, "name", description)
 */
#define STEPQ_ARCH_MAP(XX)                                                 \
    XX(GDN, 0, "gdn", "Gated DeltaNet: scalar gate per head; unit = head") \
    XX(KDA, 1, "kda", "Kimi Delta Attention: gate per key channel; unit = key row")

/*
 * Storage methods (the block formats are in the kernels' format.h):
 * XX(NAME, value, "name", dense, column scales, row impact, per-unit bits
 *    and pivots, per-unit entries in the map's `layers`, description)
 * Values are never renumbered: a new method takes the next value.
 */
#define STEPQ_METHOD_MAP(XX)                                                                      \
    XX(FP32, 0, "fp32", 1, 0, 0, 0, 0, "unquantized fp32 state")                                  \
    XX(BF16, 1, "bf16", 1, 0, 0, 0, 0, "unquantized bf16 state")                                  \
    XX(FP16, 2, "fp16", 1, 0, 0, 0, 0, "unquantized fp16 state")                                  \
    XX(UNIFORM, 3, "uniform", 0, 0, 0, 0, 1, "row absmax scales, one bit width (paper baseline)") \
    XX(DSQ, 4, "dsq", 0, 1, 0, 0, 1, "row + column scales, no row impact, one bit width")         \
    XX(SPATIAL, 5, "spatial", 0, 1, 1, 0, 1, "key-row-aware dual-axis fit, one bit width")        \
    XX(TEMPORAL, 6, "temporal", 0, 0, 0, 1, 1, "per-unit bits + fp16 pivots, row absmax scales")  \
    XX(STEPQ, 7, "stepq", 0, 1, 1, 1, 1, "per-unit bits + pivots + key-row-aware dual-axis fit")  \
    XX(FP8, 8, "fp8", 0, 0, 0, 0, 0,                                                              \
       "e4m3 codes, one fp32 scale amax/240 per (head, 32 value channels) over all key rows "     \
       "(SGLang's proposed float8 state pool)")

/*
 * The fit of a decode step's new state (map field `decode_fit`, dsq /
 * spatial / stepq only; kernels/quant.h has the arithmetic):
 * XX(NAME, value, "name", description)
 */
#define STEPQ_DECODE_FIT_MAP(XX)                                                          \
    XX(EXACT, 0, "exact", "the full dual-axis fit with the fixed-code column refit")      \
    XX(NOREFIT, 1, "norefit",                                                             \
       "the dual-axis fit without the column refit: column scales fp16(max |y|) (decode " \
       "steps only; packs stay exact)")                                                   \
    XX(ROWS, 2, "rows",                                                                   \
       "row scales only: the column scales of the page read are kept, the row scales "    \
       "refitted to them (decode steps only; packs stay exact)")

/*
 * The arithmetic of a decode step's per-element work (map field `arith`, dsq /
 * spatial / stepq only; kernels/quant.h defines it operation by operation):
 * XX(NAME, value, "name", description)
 */
#define STEPQ_ARITH_MAP(XX)                                                             \
    XX(FP32, 0, "fp32", "fp32 arithmetic throughout")                                   \
    XX(FP16, 1, "fp16",                                                                 \
       "packed half2 arithmetic for the per-element work of the fused decode step, in " \
       "IEEE fp16 under power-of-two normalisers (decode steps only; packs stay fp32)")

/* Element types of dense tensors: XX(NAME, value, "name", bytes) */
#define STEPQ_DTYPE_MAP(XX) \
    XX(FP32, 0, "fp32", 4)  \
    XX(BF16, 1, "bf16", 2)  \
    XX(FP16, 2, "fp16", 2)

/** Linear-attention family of the recurrent layers (STEPQ_ARCH_MAP). */
typedef enum stepq_arch {
#define STEPQ__XX(name, value, text, desc) STEPQ_ARCH_##name = (value),
    STEPQ_ARCH_MAP(STEPQ__XX)
#undef STEPQ__XX
} stepq_arch;

/** Storage method of a map (STEPQ_METHOD_MAP). */
typedef enum stepq_method {
#define STEPQ__XX(name, value, text, dense, col, w, mixed, units, desc) \
    STEPQ_METHOD_##name = (value),
    STEPQ_METHOD_MAP(STEPQ__XX)
#undef STEPQ__XX
        STEPQ_METHOD_COUNT
} stepq_method;

/** Element type of a dense tensor: conv state, unquantized states, server tensors
 * (STEPQ_DTYPE_MAP). */
typedef enum stepq_dtype {
#define STEPQ__XX(name, value, text, bytes) STEPQ_DTYPE_##name = (value),
    STEPQ_DTYPE_MAP(STEPQ__XX)
#undef STEPQ__XX
} stepq_dtype;

/** The decode step's fit of a dual-axis map (STEPQ_DECODE_FIT_MAP). */
typedef enum stepq_decode_fit {
#define STEPQ__XX(name, value, text, desc) STEPQ_DECODE_FIT_##name = (value),
    STEPQ_DECODE_FIT_MAP(STEPQ__XX)
#undef STEPQ__XX
        STEPQ_DECODE_FIT_COUNT
} stepq_decode_fit;

/** The arithmetic of a dual-axis map's decode step (STEPQ_ARITH_MAP). */
typedef enum stepq_arith {
#define STEPQ__XX(name, value, text, desc) STEPQ_ARITH_##name = (value),
    STEPQ_ARITH_MAP(STEPQ__XX)
#undef STEPQ__XX
        STEPQ_ARITH_COUNT
} stepq_arith;

/**
 * Largest head dimension (head_k_dim, head_v_dim) of a map: the limit the
 * map loader, the pool and the kernels share, so a map that validates also
 * opens. Shipping models use 128.
 */
#define STEPQ_MAX_HEAD_DIM 1024

/** Unit bit widths: integer formats 2..8, STEPQ_BITS_PIVOT for an fp16 pivot unit. */
#define STEPQ_BITS_PIVOT 16
/** Unit "bits" value reported for every unit of a map without per-unit widths
 * (fp32/bf16/fp16, and fp8, whose one format is fixed). */
#define STEPQ_BITS_DENSE 0

/** Maximum rank of the conv-state shape. */
#define STEPQ_CONV_MAX_RANK 4

/** Model shape as the server sees it (whole model, before tensor parallelism). */
typedef struct stepq_model_shape {
    stepq_arch arch;
    int n_layers;         /**< number of recurrent (linear-attention) layers */
    const int *layer_ids; /**< n_layers model layer indices, strictly increasing */
    int num_k_heads;      /**< H: q/k heads */
    int num_v_heads;      /**< HV: value heads (state heads), a multiple of H */
    int head_k_dim;       /**< d_k: state rows */
    int head_v_dim;       /**< d_v: state columns */
    int conv_rank;        /**< rank of the per-layer conv state shape (0 = no conv state) */
    int64_t conv_shape[STEPQ_CONV_MAX_RANK];
    stepq_dtype conv_dtype;
} stepq_model_shape;

/** Options for loading a map. */
typedef struct stepq_map_load_config {
    size_t size;
    unsigned magic;
    unsigned version;
    size_t max_bytes; /**< refuse files larger than this (0 = 256 MiB default) */
    /** Refuse input holding more JSON values than this (0 = default, 4,194,304), counted
     * before parsing. The parse tree costs about 80 bytes a value (cJSON), so this bounds
     * the memory of a load to about 340 MB plus twice the file's size whatever the file
     * holds (a file of "x-" arrays of zeros would otherwise cost 40 times its size); the
     * largest bundled map (Qwen3.8-27B, 975 kB) holds 302,122 values. (version 2) */
    size_t max_values;
} stepq_map_load_config;

#define STEPQ_MAP_LOAD_CONFIG_VERSION 2
/* One field per line, by name (kept out of clang-format). */
/* clang-format off */
#define STEPQ_MAP_LOAD_CONFIG_INITIALIZER         \
    {                                             \
        .size = sizeof(stepq_map_load_config),    \
        .magic = STEPQ_CONFIG_MAGIC,              \
        .version = STEPQ_MAP_LOAD_CONFIG_VERSION, \
        .max_bytes = 0,                           \
        .max_values = 0,                          \
    }
/* clang-format on */

/**
 * Loads and validates a map from a file. On success *out owns a new map
 * (release with stepq_map_close). On failure *out is NULL and the returned
 * status is STEPQ_EIO / STEPQ_EPARSE / STEPQ_ESCHEMA / STEPQ_ESHAPE /
 * STEPQ_ERANGE / STEPQ_ENONFINITE / STEPQ_ENOMEM with stepq_last_error()
 * naming the JSON path and the reason. cfg may be NULL for defaults.
 */
STEPQ_API int stepq_map_load_file(const char *path, const stepq_map_load_config *cfg,
                                  stepq_map_t **out);

/** Same as stepq_map_load_file, from a buffer of len bytes (need not be NUL-terminated). */
STEPQ_API int stepq_map_load_buffer(const char *buf, size_t len, const stepq_map_load_config *cfg,
                                    stepq_map_t **out);

/**
 * Serializes a map to JSON (schema v1). *out is NUL-terminated and owned by
 * the caller (free with stepq_free); *len excludes the NUL. The output is
 * deterministic: the same map always gives the same bytes.
 */
STEPQ_API int stepq_map_write_buffer(const stepq_map_t *map, char **out, size_t *len);

/** Writes stepq_map_write_buffer's output to a file (atomically: temp file + rename). */
STEPQ_API int stepq_map_write_file(const stepq_map_t *map, const char *path);

/** Releases a map. NULL is a no-op; a closed handle is refused (STEPQ_EBADF in stepq_last_error()).
 */
STEPQ_API void stepq_map_close(stepq_map_t *map);

/** The detail text of the last failure on this map, or "" if none. */
STEPQ_API const char *stepq_map_last_error(const stepq_map_t *map);

/* --- Building a map (calibrator, tools, tests) --- */

/**
 * Creates a map for a shape and method. budget_bits is the nominal bits per
 * value: exactly 32 (fp32), 16 (bf16, fp16) or 8 (fp8); one of 2,3,4,5,6,8 for
 * uniform / dsq / spatial; a number in [2, 8] for temporal / stepq. Every
 * unit of a quantized map starts at the largest width <= budget_bits, with
 * no pivots, unit row-impact factors (all 1, spatial / stepq) and no
 * statistics. The shape (and its layer_ids) is copied. On success *out owns
 * the map; on failure *out is NULL and the status is STEPQ_EINVAL /
 * STEPQ_ERANGE / STEPQ_ESHAPE / STEPQ_ENONFINITE / STEPQ_ENOMEM, with the
 * message naming the field as config/SCHEMA.md does ("model.num_v_heads: ...").
 */
STEPQ_API int stepq_map_create(const stepq_model_shape *shape, stepq_method method,
                               double budget_bits, stepq_map_t **out);

/**
 * Sets the bit width of one unit (2,3,4,5,6,8; STEPQ_BITS_PIVOT makes it a
 * pivot). Widths the method cannot store are refused at once with
 * STEPQ_EINVAL (pivots outside temporal / stepq, a width other than the
 * budget for uniform / dsq / spatial, any width for dense and fp8 maps); the budget
 * rule, which depends on all units, is checked by stepq_map_validate().
 */
STEPQ_API int stepq_map_set_unit_bits(stepq_map_t *map, int layer, int unit, int bits);

/**
 * Sets the d_k row-impact factors of one head (spatial / stepq maps); copied.
 * Each must be finite (else STEPQ_ENONFINITE) and > 0, and their geometric
 * mean 1 within 1e-3 (else STEPQ_ERANGE).
 */
STEPQ_API int stepq_map_set_row_impact(stepq_map_t *map, int layer, int head, const float *w);

/**
 * Sets the row split alpha of the dual-axis fit (dsq, spatial, stepq; the
 * map field `row_split`, config/SCHEMA.md): before the column scales are
 * fitted, key row i of a head is divided by r_i = max_j |x_ij|^alpha /
 * sqrt(w_i) (w_i its row impact, 1 for dsq). 0.5, every map's default, is
 * the paper's balanced split, r_i = sqrt(max_j |x_ij| / w_i); a larger alpha
 * gives rows much smaller than the head's largest more of their code range
 * (KDA, whose key rows decay at their own rates: tools/CALIBRATION.md). The
 * split decides the codes and scales a pack writes, not how a block decodes,
 * so it is part of the map's fingerprint (when not 0.5) but not of the page
 * layout. Both backends fit with the map's split.
 *
 * @return STEPQ_OK; STEPQ_ENONFINITE (NaN, Inf) or STEPQ_ERANGE (outside
 *         (0, 1]); STEPQ_EINVAL for a value other than 0.5 on a map whose
 *         method has no column scales. The map is unchanged on failure.
 */
STEPQ_API int stepq_map_set_row_split(stepq_map_t *map, double alpha);

/**
 * Sets the fit a decode step uses for the new state of a dual-axis map
 * (dsq, spatial, stepq; the map field `decode_fit`, config/SCHEMA.md):
 * STEPQ_DECODE_FIT_EXACT, every map's default, is the full fit of
 * kernels/quant.h; STEPQ_DECODE_FIT_NOREFIT skips its step 4 (the
 * fixed-code column refit) and stores the column scales it quantized with,
 * c_j = fp16(max_i |x_ij / r_i|), which saves the decode step's refit sums
 * and their reduction; STEPQ_DECODE_FIT_ROWS keeps the column scales of
 * the page the step read and refits only the row scales to them (no column
 * reduction at all; the exact fit for the whole head where the page cannot
 * serve: kernels/quant.h). Prefill packs and calibration keep the exact fit;
 * the blocks decode the same way either way. It
 * changes what a decode step writes, so it is part of the map's
 * fingerprint (when not exact) but not of the page layout. Both backends
 * serve every fit.
 *
 * @return STEPQ_OK; STEPQ_EINVAL for a value outside the list, for
 *         a fit other than EXACT on a map whose method has no column scales, or for
 *         a fit other than EXACT on a map whose arithmetic is FP16
 *         (stepq_map_set_arith()). The map is unchanged on failure.
 */
STEPQ_API int stepq_map_set_decode_fit(stepq_map_t *map, stepq_decode_fit fit);

/**
 * Sets the arithmetic of a decode step of a dual-axis map (dsq, spatial,
 * stepq; the map field `arith`, config/SCHEMA.md): STEPQ_ARITH_FP32, every
 * map's default, computes in fp32 throughout; STEPQ_ARITH_FP16 does the
 * decode step's per-element arithmetic in IEEE fp16 (packed half2) under
 * power-of-two normalisers, defined operation by operation in
 * kernels/quant.h. Prefill packs, unpacks and calibration are unchanged, and
 * the blocks decode the same way either way. FP16 is defined for the exact
 * decode fit only (stepq_map_set_decode_fit()). It changes what a decode
 * step writes, so it is part of the map's fingerprint (when not fp32) but
 * not of the page layout.
 *
 * @return STEPQ_OK; STEPQ_EINVAL for a value outside the list, for an
 *         arithmetic other than FP32 on a map whose method has no column
 *         scales, or for FP16 on a map whose decode fit is not EXACT. The map
 *         is unchanged on failure.
 */
STEPQ_API int stepq_map_set_arith(stepq_map_t *map, stepq_arith arith);

/** Per-unit calibration statistics (what the calibrator measured for a unit). */
typedef struct stepq_unit_stats {
    double log_retention; /**< l_u = E[log retention] (<= 0) */
    double lambda;        /**< lifetime weight */
    double distortion[9]; /**< d_u(b) indexed by bits 2..8; negative = not measured */
} stepq_unit_stats;

/**
 * Statistics with nothing measured: distortion entries 0, 1 and 7 are not
 * unit widths and must stay negative; set the entries of the widths you
 * measured (2,3,4,5,6,8).
 */
/* One field per line, by name (kept out of clang-format). */
/* clang-format off */
#define STEPQ_UNIT_STATS_INITIALIZER                                            \
    {                                                                           \
        .log_retention = 0.0,                                                   \
        .lambda = 0.0,                                                          \
        .distortion = { -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0 }, \
    }
/* clang-format on */

/**
 * Sets calibration statistics of one unit (copied). log_retention must be
 * finite and <= 0, lambda finite and >= 0, each measured distortion finite
 * and >= 0 (negative entries mean "not measured" and are stored as -1).
 * A map either has statistics for every unit or for none, and every unit
 * measures the same set of widths; stepq_map_validate() checks both.
 * Returns STEPQ_EINVAL / STEPQ_ENONFINITE / STEPQ_ERANGE / STEPQ_ENOMEM.
 */
STEPQ_API int stepq_map_set_unit_stats(stepq_map_t *map, int layer, int unit,
                                       const stepq_unit_stats *stats);

/**
 * Sets a provenance field (string value): "tool", "tool_version", "data",
 * "notes", ... (config/SCHEMA.md lists them). value NULL removes the field.
 */
STEPQ_API int stepq_map_set_provenance(stepq_map_t *map, const char *key, const char *value);

/**
 * Sets a numeric provenance field: "tokens", "segments", "segment_length"
 * (integers >= 0), "horizon" (integer >= 1), "pivot_fraction" (in [0, 1]).
 * A NaN value removes the field.
 */
STEPQ_API int stepq_map_set_provenance_number(stepq_map_t *map, const char *key, double value);

/**
 * Sets the provenance candidate bit widths (strictly increasing, each one of
 * 2,3,4,5,6,8; 1..6 entries); copied. bits NULL removes the list.
 */
STEPQ_API int stepq_map_set_provenance_candidates(stepq_map_t *map, const int *bits, int n);

/** Sets the model's name (free text, e.g. "Qwen3-Next-80B-A3B"). */
STEPQ_API int stepq_map_set_model_name(stepq_map_t *map, const char *name);

/**
 * Checks every cross-field rule a loaded map must satisfy (bits allowed by
 * the method, pivots, budget, row impact, statistics all-or-none with the
 * same measured widths). The writer refuses maps that fail. Messages name
 * the JSON path the problem would have in the written file.
 */
STEPQ_API int stepq_map_validate(const stepq_map_t *map);

/* --- Reading a map --- */

/** Fills *shape; the layer_ids pointer stays owned by the map. */
STEPQ_API int stepq_map_shape(const stepq_map_t *map, stepq_model_shape *shape);
/** The map's method (STEPQ_METHOD_COUNT for a NULL map). */
STEPQ_API stepq_method stepq_map_method(const stepq_map_t *map);
/** The nominal bits per value (0 for a NULL map). */
STEPQ_API double stepq_map_budget_bits(const stepq_map_t *map);
/**
 * The row split of the dual-axis fit (stepq_map_set_row_split()): 0.5 unless
 * the map's `row_split` says otherwise (always 0.5 for methods without column
 * scales); 0 for a NULL or closed map.
 */
STEPQ_API double stepq_map_row_split(const stepq_map_t *map);
/**
 * The decode step's fit (stepq_map_set_decode_fit()): STEPQ_DECODE_FIT_EXACT
 * unless the map's `decode_fit` says otherwise (always exact for methods
 * without column scales); STEPQ_DECODE_FIT_COUNT for a NULL or closed map.
 */
STEPQ_API stepq_decode_fit stepq_map_decode_fit(const stepq_map_t *map);
/**
 * The decode step's arithmetic (stepq_map_set_arith()): STEPQ_ARITH_FP32
 * unless the map's `arith` says otherwise (always fp32 for methods without
 * column scales); STEPQ_ARITH_COUNT for a NULL or closed map.
 */
STEPQ_API stepq_arith stepq_map_arith(const stepq_map_t *map);
/** Model name, or "" when the map has none. */
STEPQ_API const char *stepq_map_model_name(const stepq_map_t *map);
/** Index (0..n_layers-1) of a model layer id; STEPQ_ENOENT when it is not recurrent. */
STEPQ_API int stepq_map_layer_index(const stepq_map_t *map, int model_layer_id);
/** Units per layer: HV (GDN) or HV * d_k (KDA). */
STEPQ_API int stepq_map_units_per_layer(const stepq_map_t *map);
/** Values per unit: d_k * d_v (GDN) or d_v (KDA). */
STEPQ_API int stepq_map_values_per_unit(const stepq_map_t *map);
/** Bits of one unit (2..8, STEPQ_BITS_PIVOT, or STEPQ_BITS_DENSE); negative status on bad ids. */
STEPQ_API int stepq_map_unit_bits(const stepq_map_t *map, int layer, int unit);
/**
 * The bits of every unit of one layer (units_per_layer bytes, owned by the
 * map, valid until it is closed), or NULL for dense methods and bad layers.
 */
STEPQ_API const uint8_t *stepq_map_layer_bits(const stepq_map_t *map, int layer);
/**
 * The bit width of every key row of value head `head` of layer `layer`:
 * row_bits[0..d_k) (d_k = n, which must equal head_k_dim). KDA: each row's
 * unit; GDN: the head's one width on every row; dense methods and fp8:
 * STEPQ_BITS_DENSE everywhere. The one place a head's row widths are read
 * from a map (the pool's layout and the calibration tools use it).
 */
STEPQ_API int stepq_map_head_row_bits(const stepq_map_t *map, int layer, int head,
                                      uint8_t *row_bits, int n);
/** Row-impact factors of a head (d_k floats), or NULL when the method uses none. */
STEPQ_API const float *stepq_map_row_impact(const stepq_map_t *map, int layer, int head);
/** Calibration statistics of a unit; STEPQ_ENOENT when the map has none. */
STEPQ_API int stepq_map_unit_stats(const stepq_map_t *map, int layer, int unit,
                                   stepq_unit_stats *stats);

/** A string provenance field, or NULL when the map does not have it (or key is unknown). */
STEPQ_API const char *stepq_map_provenance(const stepq_map_t *map, const char *key);
/** A numeric provenance field; STEPQ_ENOENT when absent, STEPQ_EINVAL for unknown keys. */
STEPQ_API int stepq_map_provenance_number(const stepq_map_t *map, const char *key, double *value);
/**
 * Copies up to cap candidate widths into bits and returns how many the map
 * lists (which may exceed cap); STEPQ_ENOENT when it has no list.
 */
STEPQ_API int stepq_map_provenance_candidates(const stepq_map_t *map, int *bits, int cap);

/**
 * A 64-bit fingerprint of everything that decides the stored bytes and their
 * reconstruction: shape (conv state included), method, budget, unit widths,
 * row impact, the row split when it is not 0.5, the decode fit when it
 * is not exact and the arithmetic when it is not fp32 (so the fingerprints
 * of maps without a `row_split`, `decode_fit` or `arith` field are what they
 * were before them). Calibration statistics, provenance and the model name
 * are not included. Two maps with the same fingerprint produce the
 * same pages (tensor-parallel ranks compare it when a pool opens). The value does not depend on the
 * platform.
 */
STEPQ_API int stepq_map_fingerprint(const stepq_map_t *map, uint64_t *out);

/** Name of a method ("stepq") / arch ("gdn") / dtype ("bf16"); "?" for unknown values. */
STEPQ_API const char *stepq_method_name(stepq_method method);
STEPQ_API const char *stepq_arch_name(stepq_arch arch);
STEPQ_API const char *stepq_dtype_name(stepq_dtype dtype);
/** Name of a decode fit ("exact", "norefit", "rows"); "?" for unknown values. */
STEPQ_API const char *stepq_decode_fit_name(stepq_decode_fit fit);
/** Parses a decode fit name; STEPQ_EINVAL for unknown names. */
STEPQ_API int stepq_decode_fit_from_name(const char *name, stepq_decode_fit *out);
/** Name of a decode step's arithmetic ("fp32", "fp16"); "?" for unknown values. */
STEPQ_API const char *stepq_arith_name(stepq_arith a);
/** Parses an arithmetic name; STEPQ_EINVAL for unknown names. */
STEPQ_API int stepq_arith_from_name(const char *name, stepq_arith *out);
/** Parses a method name; STEPQ_EINVAL for unknown names. */
STEPQ_API int stepq_method_from_name(const char *name, stepq_method *out);
/** Parses an arch name ("gdn", "kda"); STEPQ_EINVAL for unknown names. */
STEPQ_API int stepq_arch_from_name(const char *name, stepq_arch *out);
/** Parses a dtype name ("fp32", "bf16", "fp16"); STEPQ_EINVAL for unknown names. */
STEPQ_API int stepq_dtype_from_name(const char *name, stepq_dtype *out);
/** Size in bytes of one element of dtype. */
STEPQ_API size_t stepq_dtype_size(stepq_dtype dtype);

/** Whether a method stores per-column scales (dsq, spatial, stepq). */
STEPQ_API int stepq_method_has_col_scales(stepq_method method);
/** Whether a method is unquantized (fp32, bf16, fp16). */
STEPQ_API int stepq_method_is_dense(stepq_method method);

/* --- Memory accounting --- */

/** Exact per-request byte counts of a map (whole model, no TP split). */
typedef struct stepq_map_memory {
    uint64_t state_bytes_fp32;    /**< n_layers * HV * d_k * d_v * 4 */
    uint64_t state_bytes_compact; /**< codes + fp16 scales + fp16 pivots, no padding */
    uint64_t conv_bytes;          /**< n_layers * prod(conv_shape) * dtype size */
    uint64_t n_values;            /**< n_layers * HV * d_k * d_v */
    uint64_t n_units;             /**< n_layers * units per layer */
    uint64_t n_pivots;            /**< pivot units */
    uint64_t code_bytes;          /**< integer (fp8: e4m3) code bytes (part of compact) */
    uint64_t scale_bytes;         /**< fp16 row + column scale bytes, fp8's fp32 tile scales */
    uint64_t pivot_bytes;         /**< fp16 pivot bytes (part of compact) */
    uint64_t dense_bytes;         /**< unquantized state bytes (dense methods) */
    double bits_per_value;        /**< state_bytes_compact * 8 / n_values */
    double ratio_vs_fp32;         /**< state_bytes_fp32 / state_bytes_compact */
} stepq_map_memory;

/**
 * Computes the exact compact accounting of a map (config/SCHEMA.md, "Memory
 * accounting"): per non-pivot unit ceil(n*b/8) code bytes and 2 B per key
 * row of row scales, 2*d_v B of column scales per head with a non-pivot unit
 * (dsq, spatial, stepq), 2 B per pivot value; dense methods count their
 * dtype; fp8 counts 1 B per value and 4 B per (head, 32-column tile).
 * Alignment and reserved slots are the pool's (stepq/pool.h).
 */
STEPQ_API int stepq_map_memory_info(const stepq_map_t *map, stepq_map_memory *out);

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_MAP_H */
