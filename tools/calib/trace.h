/*
 * Recurrent-kernel traces: safetensors files holding, per recurrent layer,
 * the inputs of the recurrent kernel (q, k, v, g, beta) for S streams of T
 * tokens, as written by tools/scripts/capture_traces.py and `stepq synth`.
 *
 * File: u64 little-endian header length N, N bytes of JSON (an object: tensor
 * name -> {"dtype", "shape", "data_offsets": [begin, end]} plus an optional
 * "__metadata__" object of strings), then the data (offsets relative to the
 * end of the header). The reader is strict: every dtype, shape and offset is
 * checked (overflow, out of range, overlap, gaps, misalignment, truncation),
 * the header must be valid UTF-8 JSON of at most STEPQ__TRACE_MAX_HEADER bytes;
 * every failure is a negative status with a message naming the file and the
 * tensor or key (stepq_last_error()).
 *
 * Trace level (tools/CALIBRATION.md, "Trace format"): metadata format
 * "stepq-trace" version "1", arch, H, HV, K, V, qk_heads (H or HV),
 * qk_l2norm, scale, layers, stream_offset, n_streams, streams_total, seq_len;
 * tensors layer{L}.{q,k,v,g,beta} (optional .o) with the shapes given there.
 * A trace set joins files by (stream_offset, layer); it may hold a subset of the
 * capture's streams (every present stream with every layer), renumbered 0.. in order.
 */
#ifndef STEPQ_TOOLS_TRACE_H
#define STEPQ_TOOLS_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "stepq/map.h"

#define STEPQ__TRACE_MAX_HEADER  (16u << 20) /* a header beyond 16 MiB is refused */
#define STEPQ__TRACE_MAX_TENSORS 65536
#define STEPQ__TRACE_MAX_LAYERS  256

typedef enum stepq__trace_dtype {
    STEPQ__TRACE_F32 = 0,
    STEPQ__TRACE_BF16 = 1,
    STEPQ__TRACE_F16 = 2,
} stepq__trace_dtype;

struct stepq__trace_tensor {
    char *name;
    stepq__trace_dtype dtype;
    int ndim;
    int64_t shape[8];
    uint64_t begin, end; /* relative to the data area */
    const uint8_t *data; /* begin of the tensor's bytes */
};

/** One parsed safetensors file (header + data view). */
struct stepq__trace_file {
    char *path;
    const uint8_t *base; /* whole file */
    size_t size;
    int owns; /* base is ours (read at open, freed at close) */
    int n_tensors;
    struct stepq__trace_tensor *tensors;
    int n_meta;
    char **meta_keys, **meta_vals;
};

/**
 * Parses a safetensors image in memory (not copied: buf must outlive the
 * file object). `what` names it in messages. Returns STEPQ_OK, STEPQ_EPARSE
 * (syntax, UTF-8, truncation), STEPQ_ESCHEMA (types, unknown dtype, keys),
 * STEPQ_ERANGE (offsets, sizes), STEPQ_ENOMEM.
 */
int stepq__trace_file_parse(const uint8_t *buf, size_t len, const char *what,
                            struct stepq__trace_file **out);
/** Reads a whole file and parses it. Also STEPQ_ENOENT / STEPQ_EIO / STEPQ_ENOMEM. */
int stepq__trace_file_open(const char *path, struct stepq__trace_file **out);
void stepq__trace_file_close(struct stepq__trace_file *f);
const struct stepq__trace_tensor *stepq__trace_file_find(const struct stepq__trace_file *f,
                                                         const char *name);
const char *stepq__trace_file_meta(const struct stepq__trace_file *f, const char *key);

/** The model shape and stream layout common to every file of a trace set. */
struct stepq__trace_info {
    stepq_arch arch;
    int H, HV, K, V;
    int qk_repeated; /* q/k stored at HV heads (1) or H heads (0) */
    int qk_l2norm;   /* the replay applies the l2norm */
    float scale;     /* query scale after the l2norm */
    int n_layers;
    int layer_ids[STEPQ__TRACE_MAX_LAYERS];
    int n_streams, T;
    int has_output;
};

struct stepq__trace_set;

/**
 * Opens n files and checks that they form one trace: same shape metadata,
 * every (stream, layer) present exactly once, tensors of the right shapes,
 * every value finite (STEPQ_ENONFINITE names the first NaN or Inf).
 */
int stepq__trace_set_open(const char *const *paths, int n, struct stepq__trace_set **out);
/** Same over already parsed files (takes ownership of them, also on failure). */
int stepq__trace_set_from_files(struct stepq__trace_file **files, int n,
                                struct stepq__trace_set **out);
void stepq__trace_set_close(struct stepq__trace_set *ts);
const struct stepq__trace_info *stepq__trace_set_info(const struct stepq__trace_set *ts);
/** Metadata value of the first file (source, split, ...), or NULL. */
const char *stepq__trace_set_meta(const struct stepq__trace_set *ts, const char *key);

/**
 * Converts the inputs of one (stream, layer index li, value head hv) to fp32
 * for tokens [t0, t0 + n): q, k [n][K] (the head hv's q/k head), v [n][V],
 * g [n] (GDN) or [n][K] (KDA), beta [n]; o [n][V] only when the set has
 * outputs (else pass NULL). Any pointer may be NULL to skip. Thread-safe.
 */
int stepq__trace_head(const struct stepq__trace_set *ts, int stream, int li, int hv, int t0, int n,
                      float *q, float *k, float *v, float *g, float *beta, float *o);

/* --- Writing (stepq synth; tests) --- */

struct stepq__trace_writer;

struct stepq__trace_wtensor {
    const char *name;
    stepq__trace_dtype dtype;
    int ndim;
    int64_t shape[8];
};

/**
 * Writes the header of a file with these tensors (data in the given order,
 * contiguous) and metadata pairs; the data follows with
 * stepq__trace_writer_put in the same order, then stepq__trace_writer_close.
 */
int stepq__trace_writer_open(const char *path, const struct stepq__trace_wtensor *t, int n,
                             const char *const *meta_kv, int n_meta,
                             struct stepq__trace_writer **out);
/** Appends n fp32 values converted to the current tensor(s)' dtype. */
int stepq__trace_writer_put(struct stepq__trace_writer *w, const float *x, size_t n);
/** Checks every byte was written and closes; frees w in any case. */
int stepq__trace_writer_close(struct stepq__trace_writer *w);

size_t stepq__trace_dtype_size(stepq__trace_dtype dt);

#endif /* STEPQ_TOOLS_TRACE_H */
