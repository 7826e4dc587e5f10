/*
 * stepq common definitions: export macro, status codes, error texts, the
 * version query and the allocator pair used for buffers the library returns.
 *
 * Every function of the library reports failure through an enum stepq_status
 * value (0 on success, negative on error) and never aborts or exits the host
 * process. A human-readable detail for the last failure is kept per object
 * (e.g. stepq_map_last_error()) and per thread (stepq_last_error()), and
 * goes to the host's logger when one is set (stepq_set_logger(),
 * stepq/plugin.h): the library itself never prints.
 */
#ifndef STEPQ_COMMON_H
#define STEPQ_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "stepq/version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#if defined(STEPQ_BUILDING_LIBRARY)
#define STEPQ_API __declspec(dllexport)
#else
#define STEPQ_API
#endif
#elif defined(__GNUC__) && __GNUC__ >= 4
#define STEPQ_API __attribute__((visibility("default")))
#else
#define STEPQ_API
#endif

/*
 * The status list. One X-macro generates the enum, stepq_status_name() and
 * stepq_strerror(), so the three can never disagree. Values follow errno
 * where a matching errno exists (negated), as libuv and dav1d do, so a
 * server can log them next to its own errno-based codes.
 */
#define STEPQ_STATUS_MAP(XX)                                             \
    XX(OK, 0, "success")                                                 \
    XX(EINVAL, -22, "invalid argument")                                  \
    XX(ENOMEM, -12, "out of memory")                                     \
    XX(ENOENT, -2, "no such file or entry")                              \
    XX(EIO, -5, "input/output error")                                    \
    XX(EBUSY, -16, "resource busy")                                      \
    XX(ENOSPC, -28, "no free slots left")                                \
    XX(ERANGE, -34, "value out of range")                                \
    XX(EEXIST, -17, "already exists")                                    \
    XX(EBADF, -9, "object already closed or not valid")                  \
    XX(ENOTSUP, -95, "operation not supported by this build or backend") \
    XX(EVERSION, -1001, "version or ABI mismatch")                       \
    XX(EPARSE, -1002, "malformed input (syntax)")                        \
    XX(ESCHEMA, -1003, "input violates the schema")                      \
    XX(ESHAPE, -1004, "tensor or model shape mismatch")                  \
    XX(ENONFINITE, -1005, "non-finite value (NaN or Inf)")               \
    XX(EDOUBLEFREE, -1006, "slot is not allocated (double free)")        \
    XX(ECUDA, -1007, "CUDA runtime error")                               \
    XX(ENCCL, -1008, "NCCL error")                                       \
    XX(ENODEV, -19, "no CUDA device available")                          \
    XX(ETIMEDOUT, -110, "timed out (a peer did not answer in time)")     \
    XX(EINTERNAL, -1009, "internal error (a bug in stepq; please report it)")

/** Status codes returned by every stepq function. 0 is success; errors are negative. */
typedef enum stepq_status {
#define XX(name, value, text) STEPQ_##name = (value),
    STEPQ_STATUS_MAP(XX)
#undef XX
} stepq_status;

/** Returns the symbolic name of a status ("STEPQ_EINVAL"); "STEPQ_UNKNOWN" for other values. */
STEPQ_API const char *stepq_status_name(int status);

/** Returns a short English description of a status; never NULL. */
STEPQ_API const char *stepq_strerror(int status);

/**
 * Returns the detail text of the last failure on the calling thread, e.g.
 * "layers[3].heads[7].bits: 7 is not one of 2,3,4,5,6,8". The text stays
 * valid until the next failing stepq call on the same thread. Returns ""
 * when no call has failed on this thread.
 */
STEPQ_API const char *stepq_last_error(void);

/** Returns the library version as STEPQ_VERSION_ENCODE(major, minor, patch). */
STEPQ_API unsigned stepq_version(void);

/** Returns the library version as a string, e.g. "0.1.0". */
STEPQ_API const char *stepq_version_string(void);

/** Frees a buffer the library returned to the caller (e.g. a serialized map). NULL is a no-op. */
STEPQ_API void stepq_free(void *ptr);

/*
 * Versioned configuration structs (the NCCL pattern): every config struct
 * begins with size, magic and version, and is initialised with its
 * *_INITIALIZER macro. The library checks the three and returns
 * STEPQ_EVERSION for a struct it does not know, so callers compiled
 * against an older header keep working when fields are appended.
 */
#define STEPQ_CONFIG_MAGIC 0x53545051u /* "STPQ" */

#ifdef __cplusplus
}
#endif

#endif /* STEPQ_COMMON_H */
