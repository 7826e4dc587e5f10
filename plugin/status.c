/*
 * Status names and texts, the thread-local last error, the version query.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepq_config.h"

#include "plugin/err.h"
#include "stepq/common.h"
#include "stepq/plugin.h"

static _Thread_local char last_error[STEPQ__ERRLEN];

/*
 * One log line per failing call: inside a call that brackets itself with
 * stepq__log_defer() / stepq__log_flush() (every pool call, map loads), the
 * texts set by its inner checks, and the outer texts that prefix them, are
 * logged once, when the call ends, as the final text.
 */
static _Thread_local int defer_depth;
static _Thread_local int defer_pending;

const char *stepq_status_name(int status)
{
    switch (status) {
#define XX(name, value, text) \
    case STEPQ_##name:        \
        return "STEPQ_" #name;
        STEPQ_STATUS_MAP(XX)
#undef XX
    }
    return "STEPQ_UNKNOWN";
}

const char *stepq_strerror(int status)
{
    switch (status) {
#define XX(name, value, text) \
    case STEPQ_##name:        \
        return text;
        STEPQ_STATUS_MAP(XX)
#undef XX
    }
    return "unknown status";
}

const char *stepq_last_error(void)
{
    return last_error;
}

unsigned stepq_version(void)
{
    return STEPQ_VERSION_NUMBER;
}

const char *stepq_version_string(void)
{
    return STEPQ_VERSION_STRING;
}

void stepq_free(void *ptr)
{
    free(ptr);
}

int stepq__verror_obj(char *obj_buf, int status, const char *fmt, va_list ap)
{
    char tmp[STEPQ__ERRLEN];

    vsnprintf(tmp, sizeof(tmp), fmt, ap);
    memcpy(last_error, tmp, sizeof(tmp));
    if (obj_buf)
        memcpy(obj_buf, tmp, sizeof(tmp));
    if (defer_depth > 0)
        defer_pending = 1;
    else
        stepq__log(STEPQ_LOG_ERROR, last_error);
    return status;
}

void stepq__log_defer(void)
{
    defer_depth++;
}

void stepq__log_flush(void)
{
    if (defer_depth > 0 && --defer_depth == 0 && defer_pending) {
        defer_pending = 0;
        stepq__log(STEPQ_LOG_ERROR, last_error);
    }
}

int stepq__error_obj(char *obj_buf, int status, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    stepq__verror_obj(obj_buf, status, fmt, ap);
    va_end(ap);
    return status;
}

int stepq__error(int status, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    stepq__verror_obj(NULL, status, fmt, ap);
    va_end(ap);
    return status;
}

/* Every versioned config struct starts with these three fields. */
struct config_header {
    size_t size;
    unsigned magic;
    unsigned version;
};

int stepq__check_config(const void *cfg, size_t min_size, unsigned max_version, const char *what)
{
    const struct config_header *h = cfg;

    if (h->magic != STEPQ_CONFIG_MAGIC)
        return stepq__error(STEPQ_EVERSION,
                            "%s: bad magic 0x%08x (initialise it with its _INITIALIZER macro)",
                            what, h->magic);
    if (h->version == 0 || h->version > max_version)
        return stepq__error(STEPQ_EVERSION,
                            "%s: version %u is not supported (this library knows 1..%u)", what,
                            h->version, max_version);
    if (h->size < min_size)
        return stepq__error(STEPQ_EVERSION,
                            "%s: size %zu is smaller than its first version (%zu B)", what, h->size,
                            min_size);
    return STEPQ_OK;
}

/*
 * NCCL's rule for versioned structs: the caller's struct may be older than
 * ours, never newer. The fields its version knows (up to field_ends[its
 * version - 1]; never its trailing padding, which a later version may have
 * filled with a field) are copied over our defaults, so the fields it does
 * not know keep their INITIALIZER values, and the result is a struct of the
 * current layout that the library reads without further checks.
 */
int stepq__config_import(void *dst, const void *defaults, size_t cur_size, const void *src,
                         const size_t *field_ends, unsigned cur_version, const char *what)
{
    const struct config_header *h = src;
    struct config_header *d = dst;
    int ret = stepq__check_config(src, field_ends[0], cur_version, what);

    if (ret < 0)
        return ret;
    if (h->size < field_ends[h->version - 1])
        return stepq__error(STEPQ_EVERSION, "%s: size %zu is smaller than its version %u (%zu B)",
                            what, h->size, h->version, field_ends[h->version - 1]);
    if (h->size > cur_size)
        return stepq__error(STEPQ_EVERSION,
                            "%s: size %zu is larger than this library's %zu B (built against a "
                            "newer stepq)",
                            what, h->size, cur_size);
    memcpy(dst, defaults, cur_size);
    memcpy(dst, src, field_ends[h->version - 1]);
    d->size = cur_size;
    d->version = cur_version;
    return STEPQ_OK;
}
