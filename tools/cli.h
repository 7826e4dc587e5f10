/*
 * What every stepq command shares, so that each does it one way: number
 * options refused with one line naming the option, progress on stderr, output
 * files that appear whole or not at all, error lines that name a path once,
 * and JSON strings.
 */
#ifndef STEPQ_TOOLS_CLI_H
#define STEPQ_TOOLS_CLI_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

#include "stepq/map.h"

/* --- number options ---------------------------------------------------------- */

/**
 * Parses v, the value of option opt of command tool, as a decimal integer in
 * [lo, hi]. Refuses an empty value, trailing characters and out-of-range
 * values with "stepq TOOL: OPT 'V': want an integer in [LO, HI]" on stderr.
 * Returns 0, or -1 after the message (the command then exits with status 2).
 */
int stepq_tool_int(const char *tool, const char *opt, const char *v, long long lo, long long hi,
                   long long *out);

#define STEPQ_TOOL_OPEN_LO 1 /**< stepq_tool_real: lo itself is refused, (lo, hi] */

/**
 * The same for a real number in [lo, hi] ((lo, hi] with STEPQ_TOOL_OPEN_LO):
 * NaN and infinities are refused as any out-of-range value is.
 */
int stepq_tool_real(const char *tool, const char *opt, const char *v, double lo, double hi,
                    int flags, double *out);

/**
 * The same for a decode fit name (stepq_decode_fit_from_name()): "stepq
 * TOOL: OPT: 'V' is not exact, norefit or rows" on stderr for another.
 */
int stepq_tool_decode_fit(const char *tool, const char *opt, const char *v, stepq_decode_fit *out);

/**
 * The same for a decode step's arithmetic (stepq_arith_from_name()): "stepq
 * TOOL: OPT: 'V' is not fp32 or fp16" on stderr for another.
 */
int stepq_tool_arith(const char *tool, const char *opt, const char *v, stepq_arith *out);

/* --- progress on stderr ------------------------------------------------------ */

/**
 * Long work reports on stderr, never on stdout: on a terminal a bar with the
 * rate and the time left, redrawn a few times a second and erased at the end;
 * otherwise a plain line every few seconds (none for work shorter than that)
 * and one when it is done. STEPQ_PROGRESS=off|bar|lines overrides the choice
 * and STEPQ_PROGRESS_INTERVAL=SECONDS the plain lines' period (tests).
 * Updates may come from several threads.
 */
struct stepq_tool_progress {
    const char *tool, *unit; /* unit "B": amounts are printed as bytes */
    int64_t total, done;
    int mode; /* 0 off, 1 bar, 2 lines */
    int printed;
    double interval, t0, next;
    pthread_mutex_t lock;
};

void stepq_tool_progress_begin(struct stepq_tool_progress *p, const char *tool, const char *unit,
                               int64_t total);
/** Adds n to the work done (thread-safe); prints when a report is due. */
void stepq_tool_progress_add(struct stepq_tool_progress *p, int64_t n);
/** Sets the work done to done (thread-safe); prints when a report is due. */
void stepq_tool_progress_set(struct stepq_tool_progress *p, int64_t done);
/** Ends the report: erases the bar, or prints the last plain line where one was printed. */
void stepq_tool_progress_end(struct stepq_tool_progress *p);

/* --- output files ------------------------------------------------------------ */

/**
 * An output file written to a temporary file next to it (PATH.tmp.PID.N) and
 * renamed to PATH when complete, so a reader never sees half a file: a failure
 * (stepq_tool_out_discard) and SIGINT, SIGTERM or SIGHUP remove the temporary
 * file. A NULL path or "-" is standard output; a target that exists and is not
 * a regular file (/dev/null, a FIFO) is written in place.
 */
struct stepq_tool_out {
    const char *path; /* the target; NULL for standard output */
    char tmp[4096];   /* the temporary file while open */
    int slot;         /* its entry in the signal handler's list, -1 if none */
    int direct;       /* the target is not a regular file: written in place, tmp is its name */
    FILE *f;
};

/**
 * Reserves the temporary name of path (o->tmp) for a writer that opens the
 * file itself; the signal handlers remove it from now on. Returns 0, or -1
 * after "stepq TOOL: PATH: ..." on stderr.
 */
int stepq_tool_out_reserve(struct stepq_tool_out *o, const char *tool, const char *path);
/** reserve and fopen(o->tmp, "w"); standard output for NULL or "-". NULL after a message. */
FILE *stepq_tool_out_open(struct stepq_tool_out *o, const char *tool, const char *path);
/**
 * Closes o->f when open (write errors included) and renames the temporary
 * file to the target. Returns 0, or -1 after "stepq TOOL: PATH: ..." naming
 * the target (the temporary file is removed).
 */
int stepq_tool_out_commit(struct stepq_tool_out *o, const char *tool);
/** Closes o->f when open and removes the temporary file (failure paths; safe to repeat). */
void stepq_tool_out_discard(struct stepq_tool_out *o);

/* --- messages ---------------------------------------------------------------- */

/**
 * "stepq TOOL: PATH: DETAIL" (+ " (STATUS_NAME)" when status < 0) on stderr,
 * PATH said once even when DETAIL (a library message) starts with it, and
 * tmp (a temporary file's name, or NULL) replaced by PATH in DETAIL.
 */
void stepq_tool_path_error(const char *tool, const char *path, const char *tmp, const char *detail,
                           int status);

/**
 * The number of threads used for n_jobs jobs when asked for want: at most
 * n_jobs (more would idle), said on stderr when the request was capped.
 */
int stepq_tool_threads(const char *tool, int want, int n_jobs, const char *jobs_name);

struct cJSON;

/**
 * Reads the small JSON file PATH that option OPT names (at most max_bytes):
 * *out its document (cJSON_Delete), NULL on failure. Returns 0, or 2 after
 * "stepq TOOL: OPT PATH: PROBLEM" on stderr (cannot open or read it, too
 * large, not valid JSON at byte N, not a JSON object).
 */
int stepq_tool_json_file(const char *tool, const char *opt, const char *path, size_t max_bytes,
                         struct cJSON **out);

/** s as a JSON string, quotes included. */
void stepq_tool_json_str(FILE *f, const char *s);

/** fprintf to f, or nothing when f is NULL (a table that --json switched off). */
void stepq_tool_printf(FILE *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif /* STEPQ_TOOLS_CLI_H */
