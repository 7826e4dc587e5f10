/*
 * Library-wide internal error helpers. Every failing path calls one of these
 * so the caller gets a status code plus a detail text that names the cause.
 */
#ifndef STEPQ_PLUGIN_ERR_H
#define STEPQ_PLUGIN_ERR_H

#include <stdarg.h>
#include <stddef.h>

#include "stepq/common.h"

/** Size of every per-object last-error buffer. */
#define STEPQ__ERRLEN 512

#if defined(__GNUC__)
#define STEPQ__PRINTF(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#else
#define STEPQ__PRINTF(fmt_idx, arg_idx)
#endif

/** Records a thread-local detail text for status and returns status. */
int stepq__error(int status, const char *fmt, ...) STEPQ__PRINTF(2, 3);

/**
 * Records the detail text in obj_buf (an object's STEPQ__ERRLEN buffer; may be
 * NULL) and in the thread-local slot, and returns status.
 */
int stepq__error_obj(char *obj_buf, int status, const char *fmt, ...) STEPQ__PRINTF(3, 4);

/** va_list form of stepq__error_obj. */
int stepq__verror_obj(char *obj_buf, int status, const char *fmt, va_list ap);

/**
 * Passes msg to the host's logger (stepq_set_logger()) at level (a
 * stepq_log_level), if one is set. Every error text reaches it through
 * stepq__verror_obj(); nothing in the library prints.
 */
void stepq__log(int level, const char *msg);

/**
 * Brackets a public call whose failure may set several texts (inner checks,
 * then outer ones naming the call): errors set on this thread between the
 * two are not logged as they are set; stepq__log_flush() logs the last one,
 * once, if any was set. Calls nest; only the outermost flush logs. Every
 * defer is followed by exactly one flush on the same thread.
 */
void stepq__log_defer(void);
void stepq__log_flush(void);

/** Checks a versioned config struct header; returns STEPQ_EVERSION with a message if wrong. */
int stepq__check_config(const void *cfg, size_t min_size, unsigned max_version, const char *what);

/**
 * Checks a versioned struct and copies it into dst, a struct of the current
 * cur_size bytes first filled from defaults (the INITIALIZER), so an older
 * caller's missing fields take their defaults. field_ends[v - 1] is where
 * the last field of version v ends (STEPQ__FIELD_END), for v = 1 ..
 * cur_version; those entries never change once a version is released. A
 * version above cur_version, or a struct larger than cur_size, is
 * STEPQ_EVERSION (a caller built against a newer stepq).
 */
int stepq__config_import(void *dst, const void *defaults, size_t cur_size, const void *src,
                         const size_t *field_ends, unsigned cur_version, const char *what);

/** Where a field of a struct ends: the size of the version that ends with it. */
#define STEPQ__FIELD_END(type, field) (offsetof(type, field) + sizeof(((type *)0)->field))

#endif /* STEPQ_PLUGIN_ERR_H */
