/*
 * The strict precision-map loader (schema: config/SCHEMA.md).
 *
 * Input goes through three gates: a lexical scan of the raw bytes (UTF-8,
 * control characters, NUL escapes: cJSON checks none of these), cJSON's
 * parser (syntax), then a schema walk that names the JSON path of the first
 * violation. Nothing is allocated in proportion to a shape the document
 * does not back with elements of its own (see precheck_layers), so a small
 * hostile file cannot make the loader allocate gigabytes.
 */
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "config/map_internal.h"

/* The JSON path of the element being read, e.g. "layers[3].heads[7].bits". */
struct ctx {
    char path[256];
    size_t len;
    const stepq_model_shape *shape;
    stepq_method method;
};

static size_t push_key(struct ctx *c, const char *key)
{
    size_t old = c->len;
    int n = snprintf(c->path + c->len, sizeof(c->path) - c->len, "%s%.64s", c->len ? "." : "", key);
    c->len = n < 0 ? c->len : c->len + (size_t)n;
    if (c->len >= sizeof(c->path))
        c->len = sizeof(c->path) - 1;
    return old;
}

static size_t push_idx(struct ctx *c, int i)
{
    size_t old = c->len;
    int n = snprintf(c->path + c->len, sizeof(c->path) - c->len, "[%d]", i);
    c->len = n < 0 ? c->len : c->len + (size_t)n;
    if (c->len >= sizeof(c->path))
        c->len = sizeof(c->path) - 1;
    return old;
}

static void pop(struct ctx *c, size_t old)
{
    c->len = old;
    c->path[old] = '\0';
}

static int fail(const struct ctx *c, int status, const char *fmt, ...) STEPQ__PRINTF(3, 4);

static int fail(const struct ctx *c, int status, const char *fmt, ...)
{
    char msg[STEPQ__ERRLEN];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return stepq__error(status, "%s: %s", c->len ? c->path : "(document)", msg);
}

static const char *type_name(const cJSON *it)
{
    if (cJSON_IsObject(it))
        return "an object";
    if (cJSON_IsArray(it))
        return "an array";
    if (cJSON_IsString(it))
        return "a string";
    if (cJSON_IsNumber(it))
        return "a number";
    if (cJSON_IsBool(it))
        return "a boolean";
    if (cJSON_IsNull(it))
        return "null";
    return "an invalid value";
}

static int expect(const struct ctx *c, const cJSON *it, int (*is)(const cJSON *), const char *what)
{
    if (!is(it))
        return fail(c, STEPQ_ESCHEMA, "expected %s, got %s", what, type_name(it));
    return STEPQ_OK;
}

static int is_object(const cJSON *it)
{
    return cJSON_IsObject(it);
}
static int is_array(const cJSON *it)
{
    return cJSON_IsArray(it);
}
static int is_string(const cJSON *it)
{
    return cJSON_IsString(it) && it->valuestring;
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/*
 * Checks an object's keys: each must be one of `keys` (found[i] receives its
 * member) or start with "x-" (ignored), and none may appear twice.
 */
static int check_keys(struct ctx *c, const cJSON *obj, const char *const *keys, int n_keys,
                      const cJSON **found)
{
    const cJSON *it;
    int n_ext = 0, st = STEPQ_OK;

    for (int i = 0; i < n_keys; i++)
        found[i] = NULL;
    for (it = obj->child; it; it = it->next) {
        const char *k = it->string ? it->string : "";
        if (!strncmp(k, "x-", 2)) {
            n_ext++;
            continue;
        }
        int i;
        for (i = 0; i < n_keys; i++)
            if (!strcmp(k, keys[i]))
                break;
        size_t old = push_key(c, k);
        if (i == n_keys) {
            char list[256];
            size_t len = 0;
            list[0] = '\0';
            for (int j = 0; j < n_keys && len < sizeof(list); j++)
                len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%s", j ? ", " : "",
                                        keys[j]);
            st = fail(c, STEPQ_ESCHEMA,
                      "unknown field (expected one of: %s; extension fields start with \"x-\")",
                      list);
        } else if (found[i]) {
            st = fail(c, STEPQ_ESCHEMA, "duplicate key");
        } else {
            found[i] = it;
        }
        pop(c, old);
        if (st < 0)
            return st;
    }
    if (n_ext > 1) { /* duplicates among ignored "x-" keys are still duplicates */
        const char **names = malloc(sizeof(*names) * (size_t)n_ext);
        int j = 0;
        if (!names)
            return stepq__error(STEPQ_ENOMEM, "out of memory");
        for (it = obj->child; it; it = it->next)
            if (it->string && !strncmp(it->string, "x-", 2))
                names[j++] = it->string;
        qsort(names, (size_t)n_ext, sizeof(*names), name_cmp);
        for (j = 1; j < n_ext && st == STEPQ_OK; j++) {
            if (!strcmp(names[j], names[j - 1])) {
                size_t old = push_key(c, names[j]);
                st = fail(c, STEPQ_ESCHEMA, "duplicate key");
                pop(c, old);
            }
        }
        free(names);
    }
    return st;
}

static int require(struct ctx *c, const cJSON *it, const char *key)
{
    if (it)
        return STEPQ_OK;
    size_t old = push_key(c, key);
    int st = fail(c, STEPQ_ESCHEMA, "required field is missing");
    pop(c, old);
    return st;
}

/* A finite JSON number (cJSON turns overflowing literals into +-inf). */
static int get_number(const struct ctx *c, const cJSON *it, double *out)
{
    int st;
    if ((st = expect(c, it, cJSON_IsNumber, "a number")) < 0)
        return st;
    if (!isfinite(it->valuedouble))
        return fail(c, STEPQ_ENONFINITE, "number is not finite (out of the double range)");
    *out = it->valuedouble;
    return STEPQ_OK;
}

static int get_int(const struct ctx *c, const cJSON *it, int64_t lo, int64_t hi, int64_t *out)
{
    double v = 0.0;
    int st;
    if ((st = get_number(c, it, &v)) < 0)
        return st;
    if (v != floor(v))
        return fail(c, STEPQ_ESCHEMA, "%s is not an integer", STEPQ__NUM(v));
    if (v < (double)lo || v > (double)hi)
        return fail(c, STEPQ_ERANGE, "%s is out of range %lld..%lld", STEPQ__NUM(v), (long long)lo,
                    (long long)hi);
    *out = (int64_t)v;
    return STEPQ_OK;
}

/* An integer that only needs to fit an int; the caller checks the value. */
static int get_small_int(const struct ctx *c, const cJSON *it, int *out)
{
    int64_t v = 0;
    int st = get_int(c, it, -1000000, 1000000, &v);
    if (st == STEPQ_OK)
        *out = (int)v;
    return st;
}

static int get_text(const struct ctx *c, const cJSON *it, const char **out)
{
    int st;
    if ((st = expect(c, it, is_string, "a string")) < 0)
        return st;
    size_t n = strlen(it->valuestring);
    if (n > STEPQ__MAX_TEXT)
        return fail(c, STEPQ_ERANGE, "%zu bytes, longer than the limit of %d", n, STEPQ__MAX_TEXT);
    *out = it->valuestring;
    return STEPQ_OK;
}

static int get_array(const struct ctx *c, const cJSON *it, int min, int max, int *n)
{
    int st;
    if ((st = expect(c, it, is_array, "an array")) < 0)
        return st;
    *n = cJSON_GetArraySize(it);
    if (*n < min || *n > max) {
        if (min == max)
            return fail(c, STEPQ_ESHAPE, "%d entries, expected %d", *n, min);
        return fail(c, STEPQ_ESHAPE, "%d entries, expected %d..%d", *n, min, max);
    }
    return STEPQ_OK;
}

static int get_enum(const struct ctx *c, const cJSON *it, int (*parse)(const char *, void *),
                    const char *choices, int *out)
{
    const char *s = NULL; /* set by get_text when it succeeds (NULL keeps -O2 -Wall quiet) */
    int st;
    if ((st = get_text(c, it, &s)) < 0)
        return st;
    if (parse(s, out) < 0)
        return fail(c, STEPQ_ESCHEMA, "\"%.64s\" is not one of %s", s, choices);
    return STEPQ_OK;
}

static int parse_arch(const char *s, void *out)
{
    stepq_arch a;
    if (strcmp(s, "gdn") && strcmp(s, "kda"))
        return -1;
    stepq_arch_from_name(s, &a);
    *(int *)out = (int)a;
    return 0;
}

static int parse_dtype(const char *s, void *out)
{
    stepq_dtype d;
    if (strcmp(s, "fp32") && strcmp(s, "bf16") && strcmp(s, "fp16"))
        return -1;
    stepq_dtype_from_name(s, &d);
    *(int *)out = (int)d;
    return 0;
}

static int parse_decode_fit(const char *s, void *out)
{
    stepq_decode_fit fit;
    if (stepq_decode_fit_from_name(s, &fit) < 0)
        return -1;
    *(int *)out = (int)fit;
    return 0;
}

static int parse_arith(const char *s, void *out)
{
    stepq_arith arith;
    if (stepq_arith_from_name(s, &arith) < 0)
        return -1;
    *(int *)out = (int)arith;
    return 0;
}

static int parse_method(const char *s, void *out)
{
    for (int i = 0; i < STEPQ_METHOD_COUNT; i++) {
        if (!strcmp(s, stepq_method_name((stepq_method)i))) {
            *(int *)out = i;
            return 0;
        }
    }
    return -1;
}

/* --- lexical gate --- */

/*
 * Checks what cJSON does not: valid UTF-8 (no overlongs, surrogates or code
 * points past U+10FFFF), no raw control characters inside strings, no \u0000
 * escapes (they would silently truncate a key or a value), no NUL bytes.
 */
static int lex_check(const unsigned char *s, size_t n, size_t max_values)
{
    size_t line = 1, col = 1;
    bool in_str = false;
    size_t i = 0;
    /* An upper bound of the values cJSON will allocate a node for: every value but the
     * last of a container is followed by a comma, and a container is a value with at
     * most one last value: values <= commas + 2 x containers + 1 (the root). */
    size_t values = 1;

    if (n >= 3 && s[0] == 0xEF && s[1] == 0xBB && s[2] == 0xBF)
        i = 3; /* a UTF-8 byte-order mark is tolerated (cJSON skips it) */
    for (; i < n; col++) {
        unsigned char b = s[i];
        if (b >= 0x80) {
            uint32_t cp;
            size_t len;
            if (b >= 0xC2 && b <= 0xDF) {
                len = 2;
                cp = b & 0x1F;
            } else if (b >= 0xE0 && b <= 0xEF) {
                len = 3;
                cp = b & 0x0F;
            } else if (b >= 0xF0 && b <= 0xF4) {
                len = 4;
                cp = b & 0x07;
            } else {
                goto bad_utf8;
            }
            if (i + len > n)
                return stepq__error(STEPQ_EPARSE,
                                    "line %zu, column %zu: truncated UTF-8 sequence at the end",
                                    line, col);
            for (size_t k = 1; k < len; k++) {
                if ((s[i + k] & 0xC0) != 0x80)
                    goto bad_utf8;
                cp = (cp << 6) | (s[i + k] & 0x3F);
            }
            if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
                (cp >= 0xD800 && cp <= 0xDFFF))
                goto bad_utf8;
            i += len;
            continue;
        bad_utf8:
            return stepq__error(STEPQ_EPARSE, "line %zu, column %zu: invalid UTF-8 (byte 0x%02x)",
                                line, col, b);
        }
        if (b == 0)
            return stepq__error(STEPQ_EPARSE, "line %zu, column %zu: NUL byte in the input", line,
                                col);
        if (in_str) {
            if (b < 0x20)
                return stepq__error(STEPQ_EPARSE,
                                    "line %zu, column %zu: raw control character 0x%02x in a "
                                    "string (escape it)",
                                    line, col, b);
            if (b == '"') {
                in_str = false;
            } else if (b == '\\' && i + 1 < n) {
                if (s[i + 1] == 'u' && i + 5 < n && !memcmp(s + i + 2, "0000", 4))
                    return stepq__error(STEPQ_EPARSE,
                                        "line %zu, column %zu: \\u0000 in a string is not allowed",
                                        line, col);
                i += 2; /* the escaped character cannot end the string */
                col++;
                continue;
            }
        } else if (b == '"') {
            in_str = true;
        } else if (b == ',' || b == '[' || b == '{') {
            values += b == ',' ? 1 : 2;
            if (values > max_values)
                return stepq__error(STEPQ_ERANGE,
                                    "line %zu, column %zu: more than %zu JSON values (max_values; "
                                    "parsing costs about 80 B a value)",
                                    line, col, max_values);
        } else if (b == '\n') {
            line++;
            col = 0;
        }
        i++;
    }
    return STEPQ_OK;
}

/* 1-based line and column of a byte offset, for syntax errors. */
static void position(const char *buf, size_t off, size_t *line, size_t *col)
{
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < off; i++) {
        if (buf[i] == '\n') {
            (*line)++;
            *col = 1;
        } else if (((unsigned char)buf[i] & 0xC0) != 0x80) {
            (*col)++;
        }
    }
}

/* --- model --- */

static const char *const model_keys[] = {
    "name",        "arch",       "recurrent_layers", "num_k_heads",
    "num_v_heads", "head_k_dim", "head_v_dim",       "conv_state",
};
enum { M_NAME, M_ARCH, M_LAYERS, M_HK, M_HV, M_DK, M_DV, M_CONV, M_COUNT };

static int parse_int_field(struct ctx *c, const cJSON *it, const char *key, int64_t lo, int64_t hi,
                           int *out)
{
    int64_t v = 0;
    int st;
    if ((st = require(c, it, key)) < 0)
        return st;
    size_t old = push_key(c, key);
    st = get_int(c, it, lo, hi, &v);
    pop(c, old);
    if (st == STEPQ_OK)
        *out = (int)v;
    return st;
}

static int parse_model(struct ctx *c, const cJSON *obj, stepq_model_shape *s, int **ids,
                       const char **name)
{
    const cJSON *f[M_COUNT];
    size_t old;
    int st, n, v = 0;

    if ((st = expect(c, obj, is_object, "an object")) < 0)
        return st;
    if ((st = check_keys(c, obj, model_keys, M_COUNT, f)) < 0)
        return st;
    if (f[M_NAME]) {
        old = push_key(c, "name");
        st = get_text(c, f[M_NAME], name);
        pop(c, old);
        if (st < 0)
            return st;
    }
    if ((st = require(c, f[M_ARCH], "arch")) < 0)
        return st;
    old = push_key(c, "arch");
    st = get_enum(c, f[M_ARCH], parse_arch, "gdn, kda", &v);
    pop(c, old);
    if (st < 0)
        return st;
    s->arch = (stepq_arch)v;

    if ((st = require(c, f[M_LAYERS], "recurrent_layers")) < 0)
        return st;
    old = push_key(c, "recurrent_layers");
    if ((st = get_array(c, f[M_LAYERS], 1, STEPQ__MAX_LAYERS, &n)) < 0)
        return st;
    *ids = malloc(sizeof(int) * (size_t)n);
    if (!*ids)
        return stepq__error(STEPQ_ENOMEM, "out of memory");
    const cJSON *it = f[M_LAYERS]->child;
    for (int i = 0; i < n; i++, it = it->next) {
        int64_t id = 0;
        size_t o2 = push_idx(c, i);
        if ((st = get_int(c, it, 0, STEPQ__MAX_LAYER_ID, &id)) < 0)
            return st;
        if (i > 0 && id <= (*ids)[i - 1])
            return fail(c, STEPQ_ERANGE,
                        "%lld does not follow %d (ids must be strictly increasing)", (long long)id,
                        (*ids)[i - 1]);
        (*ids)[i] = (int)id;
        pop(c, o2);
    }
    pop(c, old);
    s->n_layers = n;
    s->layer_ids = *ids;

    if ((st = parse_int_field(c, f[M_HK], "num_k_heads", 1, STEPQ__MAX_HEADS, &s->num_k_heads)) <
            0 ||
        (st = parse_int_field(c, f[M_HV], "num_v_heads", 1, STEPQ__MAX_HEADS, &s->num_v_heads)) < 0)
        return st;
    if (s->num_v_heads % s->num_k_heads) {
        old = push_key(c, "num_v_heads");
        st = fail(c, STEPQ_ESHAPE, "%d is not a multiple of num_k_heads %d", s->num_v_heads,
                  s->num_k_heads);
        pop(c, old);
        return st;
    }
    if ((st = parse_int_field(c, f[M_DK], "head_k_dim", 1, STEPQ_MAX_HEAD_DIM, &s->head_k_dim)) <
            0 ||
        (st = parse_int_field(c, f[M_DV], "head_v_dim", 1, STEPQ_MAX_HEAD_DIM, &s->head_v_dim)) < 0)
        return st;

    s->conv_rank = 0;
    s->conv_dtype = STEPQ_DTYPE_BF16;
    if (f[M_CONV]) {
        static const char *const conv_keys[] = { "shape", "dtype" };
        const cJSON *cf[2];
        old = push_key(c, "conv_state");
        if ((st = expect(c, f[M_CONV], is_object, "an object")) < 0 ||
            (st = check_keys(c, f[M_CONV], conv_keys, 2, cf)) < 0 ||
            (st = require(c, cf[0], "shape")) < 0 || (st = require(c, cf[1], "dtype")) < 0)
            return st;
        size_t o2 = push_key(c, "shape");
        if ((st = get_array(c, cf[0], 1, STEPQ_CONV_MAX_RANK, &n)) < 0)
            return st;
        it = cf[0]->child;
        int64_t elems = 1;
        for (int i = 0; i < n; i++, it = it->next) {
            int64_t d = 0;
            size_t o3 = push_idx(c, i);
            if ((st = get_int(c, it, 1, STEPQ__MAX_CONV_DIM, &d)) < 0)
                return st;
            pop(c, o3);
            s->conv_shape[i] = d;
            elems *= d;
            if (elems > STEPQ__MAX_CONV_ELEM)
                return fail(c, STEPQ_ERANGE, "more than %lld elements per layer",
                            (long long)STEPQ__MAX_CONV_ELEM);
        }
        s->conv_rank = n;
        pop(c, o2);
        o2 = push_key(c, "dtype");
        st = get_enum(c, cf[1], parse_dtype, "fp32, bf16, fp16", &v);
        pop(c, o2);
        if (st < 0)
            return st;
        s->conv_dtype = (stepq_dtype)v;
        pop(c, old);
    }
    return STEPQ_OK;
}

/* --- provenance --- */

static int parse_provenance(struct ctx *c, const cJSON *obj, stepq_map_t *m)
{
    const char *keys[STEPQ__PROV_STR_COUNT + STEPQ__PROV_NUM_COUNT + 1];
    const cJSON *f[STEPQ__PROV_STR_COUNT + STEPQ__PROV_NUM_COUNT + 1];
    const int n_keys = STEPQ__PROV_STR_COUNT + STEPQ__PROV_NUM_COUNT + 1;
    int st;

    for (int i = 0; i < STEPQ__PROV_STR_COUNT; i++)
        keys[i] = stepq__prov_str_keys[i];
    for (int i = 0; i < STEPQ__PROV_NUM_COUNT; i++)
        keys[STEPQ__PROV_STR_COUNT + i] = stepq__prov_num_keys[i];
    keys[n_keys - 1] = "candidates";

    if ((st = expect(c, obj, is_object, "an object")) < 0 ||
        (st = check_keys(c, obj, keys, n_keys, f)) < 0)
        return st;
    for (int i = 0; i < STEPQ__PROV_STR_COUNT; i++) {
        const char *s = NULL;
        if (!f[i])
            continue;
        size_t old = push_key(c, keys[i]);
        if ((st = get_text(c, f[i], &s)) < 0)
            return st;
        pop(c, old);
        if ((st = stepq__prov_set_str(m, keys[i], s)) < 0)
            return st;
    }
    for (int i = 0; i < STEPQ__PROV_NUM_COUNT; i++) {
        const cJSON *it = f[STEPQ__PROV_STR_COUNT + i];
        double v = 0.0;
        if (!it)
            continue;
        size_t old = push_key(c, stepq__prov_num_keys[i]);
        if ((st = get_number(c, it, &v)) < 0 || (st = stepq__prov_num_check(i, v, c->path)) < 0)
            return st;
        pop(c, old);
        m->prov_num[i] = v;
        m->has_prov_num[i] = true;
    }
    if (f[n_keys - 1]) {
        int n, b = 0;
        size_t old = push_key(c, "candidates");
        if ((st = get_array(c, f[n_keys - 1], 1, STEPQ__MAX_CANDIDATES, &n)) < 0)
            return st;
        const cJSON *it = f[n_keys - 1]->child;
        for (int i = 0; i < n; i++, it = it->next) {
            size_t o2 = push_idx(c, i);
            if ((st = get_small_int(c, it, &b)) < 0)
                return st;
            if (!stepq__bits_is_int(b))
                return fail(c, STEPQ_ERANGE, "%d is not one of 2,3,4,5,6,8", b);
            if (i > 0 && b <= m->candidates[i - 1])
                return fail(c, STEPQ_ERANGE, "%d does not follow %d (must be strictly increasing)",
                            b, m->candidates[i - 1]);
            m->candidates[i] = b;
            pop(c, o2);
        }
        m->n_candidates = n;
        pop(c, old);
    }
    return STEPQ_OK;
}

/* --- layers --- */

/* Checks that member `key` of the current object (it) is an array of d_k entries. */
static int precheck_rows(struct ctx *c, const cJSON *it, const char *key)
{
    int n;
    size_t old = push_key(c, key);
    int st = get_array(c, it, c->shape->head_k_dim, c->shape->head_k_dim, &n);

    if (st == STEPQ_OK)
        pop(c, old);
    return st;
}

/*
 * Before the map is allocated, checks that the document really holds the
 * per-unit arrays the shape promises: `layers` has n_layers objects, each
 * `heads` has HV objects, and every per-row array (KDA row_bits, row_impact,
 * KDA statistics) has d_k entries. Allocation is then bounded by the size of
 * the parsed document. Statistics are checked to be all-or-none here for the
 * same reason (they are allocated for every unit at once).
 */
static int precheck_layers(struct ctx *c, const cJSON *layers)
{
    const stepq_model_shape *s = c->shape;
    const bool kda = s->arch == STEPQ_ARCH_KDA;
    const bool need_w = stepq__method_uses_row_impact(c->method);
    const cJSON *first_stats = NULL;
    char first_path[64] = "";
    int n, st;

    if ((st = expect(c, layers, is_array, "an array")) < 0)
        return st;
    if ((n = cJSON_GetArraySize(layers)) != s->n_layers)
        return fail(c, STEPQ_ESHAPE, "%d entries, but model.recurrent_layers has %d", n,
                    s->n_layers);
    const cJSON *lay = layers->child;
    for (int l = 0; l < s->n_layers; l++, lay = lay->next) {
        size_t o1 = push_idx(c, l);
        if ((st = expect(c, lay, is_object, "an object")) < 0)
            return st;
        const cJSON *heads = cJSON_GetObjectItemCaseSensitive(lay, "heads");
        if ((st = require(c, heads, "heads")) < 0)
            return st;
        size_t o2 = push_key(c, "heads");
        if ((st = expect(c, heads, is_array, "an array")) < 0)
            return st;
        if ((n = cJSON_GetArraySize(heads)) != s->num_v_heads)
            return fail(c, STEPQ_ESHAPE, "%d entries, but model.num_v_heads is %d", n,
                        s->num_v_heads);
        const cJSON *hd = heads->child;
        for (int h = 0; h < s->num_v_heads; h++, hd = hd->next) {
            size_t o3 = push_idx(c, h);
            if ((st = expect(c, hd, is_object, "an object")) < 0)
                return st;
            if (kda) {
                const cJSON *rb = cJSON_GetObjectItemCaseSensitive(hd, "row_bits");
                if ((st = require(c, rb, "row_bits")) < 0 ||
                    (st = precheck_rows(c, rb, "row_bits")) < 0)
                    return st;
            }
            const cJSON *w = cJSON_GetObjectItemCaseSensitive(hd, "row_impact");
            if (need_w) {
                if (!w) {
                    st = require(c, w, "row_impact");
                    return stepq__error(st, "%s (required for method %s)", stepq_last_error(),
                                        stepq_method_name(c->method));
                }
                if ((st = precheck_rows(c, w, "row_impact")) < 0)
                    return st;
            }
            const cJSON *stats = cJSON_GetObjectItemCaseSensitive(hd, "stats");
            if (stats && !first_stats) {
                first_stats = stats;
                snprintf(first_path, sizeof(first_path), "layers[%d].heads[%d]", l, h);
            }
            if (!stats && first_stats) {
                push_key(c, "stats");
                return fail(c, STEPQ_ESCHEMA,
                            "missing, but %s has statistics (they are all-or-none)", first_path);
            }
            if (stats && kda) {
                /* Each per-row statistics array must have d_k entries. */
                size_t o4 = push_key(c, "stats");
                if ((st = expect(c, stats, is_object, "an object")) < 0)
                    return st;
                for (const cJSON *it = stats->child; it; it = it->next) {
                    if (!it->string || !strncmp(it->string, "x-", 2))
                        continue;
                    size_t o5 = push_key(c, it->string);
                    if (!strcmp(it->string, "distortion") && cJSON_IsObject(it)) {
                        for (const cJSON *d = it->child; d; d = d->next) {
                            if (!d->string || !strncmp(d->string, "x-", 2))
                                continue;
                            if ((st = precheck_rows(c, d, d->string)) < 0)
                                return st;
                        }
                    } else if (cJSON_IsArray(it)) {
                        if ((st = get_array(c, it, s->head_k_dim, s->head_k_dim, &n)) < 0)
                            return st;
                    }
                    pop(c, o5);
                }
                pop(c, o4);
            }
            pop(c, o3);
        }
        pop(c, o2);
        pop(c, o1);
    }
    /* A missing statistics object before the first present one. */
    if (first_stats) {
        lay = layers->child;
        for (int l = 0; l < s->n_layers; l++, lay = lay->next) {
            const cJSON *hd = cJSON_GetObjectItemCaseSensitive(lay, "heads")->child;
            for (int h = 0; h < s->num_v_heads; h++, hd = hd->next) {
                if (!cJSON_GetObjectItemCaseSensitive(hd, "stats")) {
                    size_t o1 = push_idx(c, l);
                    push_key(c, "heads");
                    push_idx(c, h);
                    push_key(c, "stats");
                    st = fail(c, STEPQ_ESCHEMA,
                              "missing, but %s has statistics (they are all-or-none)", first_path);
                    pop(c, o1);
                    return st;
                }
            }
        }
    }
    return STEPQ_OK;
}

/* Reads a width: 2..8, or 16 for a unit listed as a pivot (unit: "head 7", "row [7, 12]"). */
static int parse_bits(struct ctx *c, const cJSON *it, bool is_pivot, const char *unit, int layer,
                      uint8_t *out)
{
    int b = 0, st;
    if ((st = get_small_int(c, it, &b)) < 0)
        return st;
    if (b == STEPQ_BITS_PIVOT) {
        if (!stepq__method_has_pivots(c->method))
            return fail(c, STEPQ_ERANGE,
                        "16 (fp16 pivot) is not allowed for method %s (only temporal and stepq "
                        "have pivots)",
                        stepq_method_name(c->method));
        if (!is_pivot)
            return fail(c, STEPQ_ERANGE,
                        "16 (fp16 pivot) requires %s to be listed in layers[%d].pivots", unit,
                        layer);
    } else if (!stepq__bits_is_int(b)) {
        return fail(c, STEPQ_ERANGE, "%d is not one of 2,3,4,5,6,8", b);
    } else if (is_pivot) {
        return fail(c, STEPQ_ERANGE,
                    "%d, but %s is listed in layers[%d].pivots (a pivot has bits 16)", b, unit,
                    layer);
    }
    *out = (uint8_t)b;
    return STEPQ_OK;
}

static int parse_row_impact(struct ctx *c, const cJSON *arr, float *w)
{
    const int dk = c->shape->head_k_dim;
    const cJSON *it = arr->child;
    int st;

    for (int i = 0; i < dk; i++, it = it->next) {
        double v = 0.0;
        size_t old = push_idx(c, i);
        if ((st = get_number(c, it, &v)) < 0)
            return st;
        if (!(v > 0.0) || v > FLT_MAX || (float)v == 0.0f)
            return fail(c, STEPQ_ERANGE, "%s is not a positive float", STEPQ__NUM(v));
        w[i] = (float)v;
        pop(c, old);
    }
    return stepq__row_impact_check(w, dk, c->path);
}

static const char *const stats_keys[] = { "log_retention", "lambda", "distortion" };

/*
 * Statistics of one head: GDN numbers, or KDA arrays of d_k (row r -> unit
 * base + r). Values are range-checked by stepq__stats_check.
 */
static int parse_stats(struct ctx *c, const cJSON *obj, stepq_map_t *m, int layer, int base)
{
    const bool kda = c->shape->arch == STEPQ_ARCH_KDA;
    const int rows = kda ? c->shape->head_k_dim : 1;
    const cJSON *f[3];
    int st;

    if ((st = expect(c, obj, is_object, "an object")) < 0 ||
        (st = check_keys(c, obj, stats_keys, 3, f)) < 0)
        return st;
    for (int i = 0; i < 3; i++)
        if ((st = require(c, f[i], stats_keys[i])) < 0)
            return st;

    stepq_unit_stats *out = m->stats + stepq__unit_index(m, layer, base);
    for (int r = 0; r < rows; r++) {
        out[r].log_retention = 0.0;
        out[r].lambda = 0.0;
        for (int b = 0; b < 9; b++)
            out[r].distortion[b] = -1.0;
    }

    /* log_retention and lambda: a number (GDN) or d_k numbers (KDA). */
    for (int k = 0; k < 2; k++) {
        size_t old = push_key(c, stats_keys[k]);
        const cJSON *it = f[k];
        if (kda) {
            if ((st = expect(c, it, is_array, "an array")) < 0)
                return st;
            it = it->child;
        }
        for (int r = 0; r < rows; r++, it = kda ? it->next : it) {
            double v = 0.0;
            size_t o2 = kda ? push_idx(c, r) : c->len;
            if ((st = get_number(c, it, &v)) < 0)
                return st;
            pop(c, o2);
            if (k == 0)
                out[r].log_retention = v;
            else
                out[r].lambda = v;
        }
        pop(c, old);
    }

    size_t old = push_key(c, "distortion");
    if ((st = expect(c, f[2], is_object, "an object")) < 0)
        return st;
    /* The keys are the measured widths; check_keys also catches duplicates. */
    static const char *const widths[] = { "2", "3", "4", "5", "6", "8" };
    const cJSON *df[6];
    if ((st = check_keys(c, f[2], widths, 6, df)) < 0)
        return st;
    for (int k = 0; k < 6; k++) {
        const cJSON *it = df[k];
        const int b = widths[k][0] - '0';
        if (!it)
            continue;
        size_t o2 = push_key(c, widths[k]);
        if (kda) {
            if ((st = expect(c, it, is_array, "an array")) < 0)
                return st;
            it = it->child;
        }
        for (int r = 0; r < rows; r++, it = kda ? it->next : it) {
            double v = 0.0;
            size_t o3 = kda ? push_idx(c, r) : c->len;
            if ((st = get_number(c, it, &v)) < 0)
                return st;
            if (v < 0.0)
                return fail(c, STEPQ_ERANGE, "%s is negative", STEPQ__NUM(v));
            pop(c, o3);
            out[r].distortion[b] = v;
        }
        pop(c, o2);
    }
    pop(c, old);

    for (int r = 0; r < rows; r++) {
        if ((st = stepq__stats_check(&out[r], c->path, kda ? r : -1)) < 0)
            return st;
        m->has_stats[stepq__unit_index(m, layer, base + r)] = 1;
    }
    return STEPQ_OK;
}

static const char *const layer_keys[] = { "layer", "pivots", "heads" };
static const char *const gdn_head_keys[] = { "bits", "row_impact", "stats" };
static const char *const kda_head_keys[] = { "row_bits", "row_impact", "stats" };

/*
 * Marks the pivots of one layer in piv (units_per_layer entries, 0 = not a
 * pivot, else 1 + index in the pivots array).
 */
static int parse_pivots(struct ctx *c, const cJSON *arr, int *piv)
{
    const stepq_model_shape *s = c->shape;
    const bool kda = s->arch == STEPQ_ARCH_KDA;
    int n, st;

    if ((st = expect(c, arr, is_array, "an array")) < 0)
        return st;
    n = cJSON_GetArraySize(arr);
    if (n > 0 && !stepq__method_has_pivots(c->method))
        return fail(c, STEPQ_ESCHEMA, "method %s has no pivots (only temporal and stepq do)",
                    stepq_method_name(c->method));
    const cJSON *it = arr->child;
    for (int i = 0; i < n; i++, it = it->next) {
        int64_t head = 0, row = 0;
        size_t old = push_idx(c, i);
        if (kda) {
            int k;
            if ((st = expect(c, it, is_array, "a [head, row] pair")) < 0)
                return st;
            if ((k = cJSON_GetArraySize(it)) != 2)
                return fail(c, STEPQ_ESCHEMA, "%d entries, expected a [head, row] pair", k);
            size_t o2 = push_idx(c, 0);
            if ((st = get_int(c, it->child, 0, s->num_v_heads - 1, &head)) < 0)
                return st;
            pop(c, o2);
            o2 = push_idx(c, 1);
            if ((st = get_int(c, it->child->next, 0, s->head_k_dim - 1, &row)) < 0)
                return st;
            pop(c, o2);
        } else if ((st = get_int(c, it, 0, s->num_v_heads - 1, &head)) < 0) {
            return st;
        }
        int u = kda ? (int)(head * s->head_k_dim + row) : (int)head;
        if (piv[u])
            return fail(c, STEPQ_ESCHEMA, "duplicate pivot (also at pivots[%d])", piv[u] - 1);
        piv[u] = i + 1;
        pop(c, old);
    }
    return STEPQ_OK;
}

static int parse_layers(struct ctx *c, const cJSON *layers, stepq_map_t *m)
{
    const stepq_model_shape *s = c->shape;
    const bool kda = s->arch == STEPQ_ARCH_KDA;
    const int dk = s->head_k_dim;
    int *piv;
    int st = STEPQ_OK;

    piv = malloc(sizeof(int) * (size_t)m->units_per_layer);
    if (!piv)
        return stepq__error(STEPQ_ENOMEM, "out of memory");
    /* precheck_layers made statistics all-or-none: the first head tells. */
    const cJSON *head0 = cJSON_GetObjectItemCaseSensitive(layers->child, "heads")->child;
    if (cJSON_GetObjectItemCaseSensitive(head0, "stats")) {
        m->stats = calloc((size_t)m->n_units, sizeof(*m->stats));
        m->has_stats = calloc((size_t)m->n_units, 1);
        if (!m->stats || !m->has_stats) {
            st = stepq__error(STEPQ_ENOMEM, "out of memory");
            goto done;
        }
    }

    const cJSON *lay = layers->child;
    for (int l = 0; l < s->n_layers; l++, lay = lay->next) {
        const cJSON *f[3];
        int64_t id = 0;
        size_t o1 = push_idx(c, l);

        if ((st = check_keys(c, lay, layer_keys, 3, f)) < 0 || (st = require(c, f[0], "layer")) < 0)
            goto done;
        size_t o2 = push_key(c, "layer");
        if ((st = get_int(c, f[0], 0, STEPQ__MAX_LAYER_ID, &id)) < 0)
            goto done;
        if (id != s->layer_ids[l]) {
            st = fail(c, STEPQ_ESHAPE, "%lld does not match model.recurrent_layers[%d] = %d",
                      (long long)id, l, s->layer_ids[l]);
            goto done;
        }
        pop(c, o2);

        memset(piv, 0, sizeof(int) * (size_t)m->units_per_layer);
        if (f[1]) {
            o2 = push_key(c, "pivots");
            if ((st = parse_pivots(c, f[1], piv)) < 0)
                goto done;
            pop(c, o2);
        }

        o2 = push_key(c, "heads");
        const cJSON *hd = f[2]->child;
        for (int h = 0; h < s->num_v_heads; h++, hd = hd->next) {
            const cJSON *hf[3];
            size_t o3 = push_idx(c, h);
            int base = kda ? h * dk : h;
            if ((st = check_keys(c, hd, kda ? kda_head_keys : gdn_head_keys, 3, hf)) < 0 ||
                (st = require(c, hf[0], kda ? "row_bits" : "bits")) < 0)
                goto done;
            size_t o4 = push_key(c, kda ? "row_bits" : "bits");
            uint8_t *bits = m->bits + stepq__unit_index(m, l, base);
            if (kda) {
                const cJSON *it = hf[0]->child;
                for (int r = 0; r < dk; r++, it = it->next) {
                    size_t o5 = push_idx(c, r);
                    char unit[40];
                    snprintf(unit, sizeof(unit), "row [%d, %d]", h, r);
                    if ((st = parse_bits(c, it, piv[base + r] != 0, unit, l, &bits[r])) < 0)
                        goto done;
                    pop(c, o5);
                }
            } else {
                char unit[24];
                snprintf(unit, sizeof(unit), "head %d", h);
                if ((st = parse_bits(c, hf[0], piv[base] != 0, unit, l, bits)) < 0)
                    goto done;
            }
            pop(c, o4);

            if (hf[1]) {
                o4 = push_key(c, "row_impact");
                if (!m->row_impact) {
                    st = fail(c, STEPQ_ESCHEMA,
                              "not allowed for method %s (only spatial and stepq use row impact)",
                              stepq_method_name(c->method));
                    goto done;
                }
                float *w = m->row_impact + ((size_t)l * s->num_v_heads + h) * dk;
                if ((st = parse_row_impact(c, hf[1], w)) < 0)
                    goto done;
                pop(c, o4);
            }
            if (hf[2]) {
                o4 = push_key(c, "stats");
                if ((st = parse_stats(c, hf[2], m, l, base)) < 0)
                    goto done;
                pop(c, o4);
            }
            pop(c, o3);
        }
        pop(c, o2);
        pop(c, o1);
    }
done:
    free(piv);
    return st;
}

/* --- document --- */

static const char *const root_keys[] = {
    "format",    "schema_version", "model", "method",     "budget_bits",
    "row_split", "decode_fit",     "arith", "provenance", "layers",
};
enum {
    R_FORMAT,
    R_VERSION,
    R_MODEL,
    R_METHOD,
    R_BUDGET,
    R_SPLIT,
    R_FIT,
    R_ARITH,
    R_PROV,
    R_LAYERS,
    R_COUNT
};

/* A root field the document's method does not have: "PATH: not allowed for method M (WHY)". */
static int not_allowed(const struct ctx *c, const char *why)
{
    return fail(c, STEPQ_ESCHEMA, "not allowed for method %s (%s)", stepq_method_name(c->method),
                why);
}

static int load_doc(const cJSON *root, stepq_map_t **out)
{
    struct ctx c = { .len = 0 };
    const cJSON *f[R_COUNT];
    stepq_model_shape shape;
    stepq_map_t *m = NULL;
    int *ids = NULL;
    const char *name = NULL;
    int st, v = 0, fit = STEPQ_DECODE_FIT_EXACT, arith = STEPQ_ARITH_FP32;
    int64_t ver = 0;
    double budget = 0.0, split = STEPQ__ROW_SPLIT_DEFAULT;
    size_t old;

    memset(&shape, 0, sizeof(shape));
    if ((st = expect(&c, root, is_object, "an object")) < 0)
        return st;

    /* Format and version first, so a newer file fails with EVERSION, not ESCHEMA. */
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    if ((st = require(&c, fmt, "format")) < 0)
        return st;
    old = push_key(&c, "format");
    if ((st = expect(&c, fmt, is_string, "a string")) < 0)
        return st;
    if (strcmp(fmt->valuestring, STEPQ__MAP_FORMAT))
        return fail(&c, STEPQ_EVERSION, "\"%.64s\" is not \"" STEPQ__MAP_FORMAT "\"",
                    fmt->valuestring);
    pop(&c, old);
    const cJSON *ver_it = cJSON_GetObjectItemCaseSensitive(root, "schema_version");
    if ((st = require(&c, ver_it, "schema_version")) < 0)
        return st;
    old = push_key(&c, "schema_version");
    if ((st = get_int(&c, ver_it, INT32_MIN, INT32_MAX, &ver)) < 0)
        return st;
    if (ver != STEPQ__MAP_SCHEMA_VERSION)
        return fail(&c, STEPQ_EVERSION, "%lld is not supported (this library reads version %d)",
                    (long long)ver, STEPQ__MAP_SCHEMA_VERSION);
    pop(&c, old);

    if ((st = check_keys(&c, root, root_keys, R_COUNT, f)) < 0)
        return st;
    if ((st = require(&c, f[R_MODEL], "model")) < 0)
        return st;
    old = push_key(&c, "model");
    st = parse_model(&c, f[R_MODEL], &shape, &ids, &name);
    pop(&c, old);
    if (st < 0)
        goto done;
    c.shape = &shape;

    if ((st = require(&c, f[R_METHOD], "method")) < 0)
        goto done;
    old = push_key(&c, "method");
    st = get_enum(&c, f[R_METHOD], parse_method,
                  "fp32, bf16, fp16, fp8, uniform, dsq, spatial, temporal, stepq", &v);
    pop(&c, old);
    if (st < 0)
        goto done;
    c.method = (stepq_method)v;

    if ((st = require(&c, f[R_BUDGET], "budget_bits")) < 0)
        goto done;
    old = push_key(&c, "budget_bits");
    st = get_number(&c, f[R_BUDGET], &budget);
    pop(&c, old);
    if (st < 0 || (st = stepq__budget_check(c.method, budget)) < 0)
        goto done;
    if ((st = stepq__shape_check(&shape)) < 0)
        goto done;

    /* Optional, and only where there is a dual-axis fit to split (any value elsewhere,
     * 0.5 included, would claim a choice the method does not have). */
    if (f[R_SPLIT]) {
        old = push_key(&c, "row_split");
        if (!stepq_method_has_col_scales(c.method)) {
            st = not_allowed(&c, "only dsq, spatial and stepq have the dual-axis fit it splits");
            goto done;
        }
        st = get_number(&c, f[R_SPLIT], &split);
        pop(&c, old);
        if (st < 0 || (st = stepq__row_split_check(c.method, split)) < 0)
            goto done;
    }
    /* Optional likewise: only a method with the column refit can skip it ("exact" elsewhere
     * would claim a choice the method does not have). */
    if (f[R_FIT]) {
        old = push_key(&c, "decode_fit");
        if (!stepq_method_has_col_scales(c.method)) {
            st = not_allowed(&c,
                             "only dsq, spatial and stepq have the dual-axis fit's column refit");
            goto done;
        }
        st = get_enum(&c, f[R_FIT], parse_decode_fit, "exact, norefit, rows", &fit);
        pop(&c, old);
        if (st < 0)
            goto done;
    }
    /* Optional likewise: only the dual-axis decode step has an fp16 variant ("fp32"
     * elsewhere would claim a choice the method does not have), and fp16 only under the
     * exact fit, whichever of the two fields comes first in the file. */
    if (f[R_ARITH]) {
        old = push_key(&c, "arith");
        if (!stepq_method_has_col_scales(c.method)) {
            st = not_allowed(&c, "only dsq, spatial and stepq have the dual-axis decode step's "
                                 "fp16 variant");
            goto done;
        }
        st = get_enum(&c, f[R_ARITH], parse_arith, "fp32, fp16", &arith);
        pop(&c, old);
        if (st < 0 ||
            (st = stepq__arith_check(c.method, (stepq_decode_fit)fit, (stepq_arith)arith)) < 0)
            goto done;
    }

    if (!stepq__method_has_units(c.method)) {
        if (f[R_LAYERS]) {
            old = push_key(&c, "layers");
            st = not_allowed(&c, "its one format has no per-unit choices");
            goto done;
        }
    } else {
        if ((st = require(&c, f[R_LAYERS], "layers")) < 0)
            goto done;
        old = push_key(&c, "layers");
        st = precheck_layers(&c, f[R_LAYERS]);
        pop(&c, old);
        if (st < 0)
            goto done;
    }

    if ((st = stepq__map_alloc(&shape, c.method, budget, &m)) < 0)
        goto done;
    m->row_split = split;
    m->decode_fit = (stepq_decode_fit)fit;
    m->arith = (stepq_arith)arith;
    if (name && (st = stepq__map_set_name(m, name)) < 0)
        goto done;
    if (f[R_PROV]) {
        old = push_key(&c, "provenance");
        st = parse_provenance(&c, f[R_PROV], m);
        pop(&c, old);
        if (st < 0)
            goto done;
    }
    if (stepq__method_has_units(c.method)) {
        old = push_key(&c, "layers");
        st = parse_layers(&c, f[R_LAYERS], m);
        pop(&c, old);
        if (st < 0)
            goto done;
    }
    st = stepq__map_check(m);

done:
    free(ids);
    if (st < 0) {
        stepq__map_free(m);
        return st;
    }
    return stepq__map_publish(m, out);
}

/* The caller's load options (any version) as this library's; a limit of 0 keeps the default
 * (max_values may be NULL: stepq_map_load_file reads the file, the buffer load checks values). */
static int import_load_config(const stepq_map_load_config *cfg, size_t *max_bytes,
                              size_t *max_values)
{
    static const stepq_map_load_config defaults = STEPQ_MAP_LOAD_CONFIG_INITIALIZER;
    static const size_t ends[] = { STEPQ__FIELD_END(stepq_map_load_config, max_bytes),
                                   STEPQ__FIELD_END(stepq_map_load_config, max_values) };
    stepq_map_load_config c;
    int st = stepq__config_import(&c, &defaults, sizeof(c), cfg, ends,
                                  STEPQ_MAP_LOAD_CONFIG_VERSION, "stepq_map_load_config");

    if (st < 0)
        return st;
    /* Any larger limit means "no limit": no buffer that large can exist, and
     * the reader's max_bytes + 1 must not wrap. */
    if (c.max_bytes)
        *max_bytes = c.max_bytes < SIZE_MAX / 2 ? c.max_bytes : SIZE_MAX / 2;
    if (c.max_values && max_values)
        *max_values = c.max_values;
    return STEPQ_OK;
}

static int load_buffer(const char *buf, size_t len, const stepq_map_load_config *cfg,
                       stepq_map_t **out)
{
    size_t max_bytes = STEPQ__MAP_DEFAULT_MAX_BYTES, max_values = STEPQ__MAP_DEFAULT_MAX_VALUES;
    const char *end = NULL;
    char *copy;
    cJSON *root;
    int st;

    if (!out)
        return stepq__error(STEPQ_EINVAL, "stepq_map_load_buffer: out is NULL");
    *out = NULL;
    if (!buf && len)
        return stepq__error(STEPQ_EINVAL, "stepq_map_load_buffer: buf is NULL");
    if (cfg) {
        if ((st = import_load_config(cfg, &max_bytes, &max_values)) < 0)
            return st;
    }
    if (len > max_bytes)
        return stepq__error(STEPQ_ERANGE, "input is %zu bytes, over the limit of %zu (max_bytes)",
                            len, max_bytes);
    if ((st = lex_check((const unsigned char *)buf, len, max_values)) < 0)
        return st;

    /* cJSON needs a NUL-terminated copy to reject trailing garbage. */
    copy = malloc(len + 1);
    if (!copy)
        return stepq__error(STEPQ_ENOMEM, "out of memory reading a %zu-byte map", len);
    if (len)
        memcpy(copy, buf, len);
    copy[len] = '\0';
    {
        size_t i = 0;
        while (i < len && (copy[i] == ' ' || copy[i] == '\t' || copy[i] == '\n' || copy[i] == '\r'))
            i++;
        if (i == len) {
            free(copy);
            return stepq__error(STEPQ_EPARSE, "empty input (no JSON value)");
        }
    }
    /*
     * cJSON 1.7 also stores the error position in a process-global slot on
     * every parse; stepq never reads it (the position comes back in `end`),
     * so concurrent loads only race on a value nobody uses.
     */
    root = cJSON_ParseWithLengthOpts(copy, len + 1, &end, 1);
    if (!root) {
        size_t line, col, off = end && end >= copy ? (size_t)(end - copy) : 0;
        if (off > len)
            off = len;
        position(copy, off, &line, &col);
        st = stepq__error(STEPQ_EPARSE, "line %zu, column %zu: %s", line, col,
                          off >= len ? "unexpected end of input (truncated?)"
                                     : "syntax error (or out of memory)");
        /* cJSON's process-global error pointer now points into `copy`, which is
         * freed next; a host program calling cJSON_GetErrorPtr() would read
         * freed memory. A successful parse resets it (to NULL). */
        cJSON_Delete(cJSON_Parse("0"));
        free(copy);
        return st;
    }
    free(copy);
    st = load_doc(root, out);
    cJSON_Delete(root);
    return st;
}

/*
 * A load's checks wrap one another's texts (a missing field, then the method
 * that requires it): the logger gets the final one, once (plugin/err.h).
 */
int stepq_map_load_buffer(const char *buf, size_t len, const stepq_map_load_config *cfg,
                          stepq_map_t **out)
{
    int st;

    stepq__log_defer();
    st = load_buffer(buf, len, cfg, out);
    stepq__log_flush();
    return st;
}

static int load_file(const char *path, const stepq_map_load_config *cfg, stepq_map_t **out)
{
    size_t max_bytes = STEPQ__MAP_DEFAULT_MAX_BYTES, len = 0, cap;
    struct stat sb;
    char *buf = NULL;
    int fd, st;

    if (!out)
        return stepq__error(STEPQ_EINVAL, "stepq_map_load_file: out is NULL");
    *out = NULL;
    if (!path)
        return stepq__error(STEPQ_EINVAL, "stepq_map_load_file: path is NULL");
    if (cfg) {
        if ((st = import_load_config(cfg, &max_bytes, NULL)) < 0)
            return st;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return stepq__error(STEPQ_EIO, "%s: %s", path, strerror(errno));
    if (fstat(fd, &sb) < 0) {
        st = stepq__error(STEPQ_EIO, "%s: %s", path, strerror(errno));
        goto done;
    }
    if (S_ISDIR(sb.st_mode)) {
        st = stepq__error(STEPQ_EIO, "%s: is a directory", path);
        goto done;
    }
    if (S_ISREG(sb.st_mode) && (uint64_t)sb.st_size > max_bytes) {
        st = stepq__error(STEPQ_ERANGE, "%s: %lld bytes, over the limit of %zu (max_bytes)", path,
                          (long long)sb.st_size, max_bytes);
        goto done;
    }
    /* Read to EOF (pipes and growing files included), never past the limit. */
    cap = S_ISREG(sb.st_mode) && sb.st_size > 0 ? (size_t)sb.st_size + 1 : 65536;
    buf = malloc(cap);
    if (!buf) {
        st = stepq__error(STEPQ_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    for (;;) {
        if (len == cap) {
            size_t ncap = cap * 2;
            char *nb;
            if (ncap > max_bytes + 1)
                ncap = max_bytes + 1;
            if (ncap <= cap) {
                st = stepq__error(STEPQ_ERANGE, "%s: over the limit of %zu bytes (max_bytes)", path,
                                  max_bytes);
                goto done;
            }
            nb = realloc(buf, ncap);
            if (!nb) {
                st = stepq__error(STEPQ_ENOMEM, "%s: out of memory", path);
                goto done;
            }
            buf = nb;
            cap = ncap;
        }
        ssize_t r = read(fd, buf + len, cap - len);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            st = stepq__error(STEPQ_EIO, "%s: %s", path, strerror(errno));
            goto done;
        }
        if (r == 0)
            break;
        len += (size_t)r;
        if (len > max_bytes) {
            st = stepq__error(STEPQ_ERANGE, "%s: over the limit of %zu bytes (max_bytes)", path,
                              max_bytes);
            goto done;
        }
    }
    /* Content errors name the JSON path only; the caller knows the file. */
    st = load_buffer(buf, len, cfg, out);
done:
    free(buf);
    close(fd);
    return st;
}

int stepq_map_load_file(const char *path, const stepq_map_load_config *cfg, stepq_map_t **out)
{
    int st;

    stepq__log_defer();
    st = load_file(path, cfg, out);
    stepq__log_flush();
    return st;
}
