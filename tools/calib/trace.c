/*
 * Safetensors trace reader and writer (tools/calib/trace.h). The reader trusts
 * nothing in the file: sizes are checked before any multiplication can
 * overflow, and every tensor's bytes must lie inside the data area, be
 * aligned to its element size, and not overlap another tensor's.
 */
#include "tools/calib/trace.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/format.h"
#include "plugin/err.h"

size_t stepq__trace_dtype_size(stepq__trace_dtype dt)
{
    return dt == STEPQ__TRACE_F32 ? 4 : 2;
}

static int dtype_from_name(const char *s, stepq__trace_dtype *out)
{
    if (!strcmp(s, "F32"))
        *out = STEPQ__TRACE_F32;
    else if (!strcmp(s, "BF16"))
        *out = STEPQ__TRACE_BF16;
    else if (!strcmp(s, "F16"))
        *out = STEPQ__TRACE_F16;
    else
        return -1;
    return 0;
}

static const char *dtype_name(stepq__trace_dtype dt)
{
    return dt == STEPQ__TRACE_F32 ? "F32" : dt == STEPQ__TRACE_BF16 ? "BF16" : "F16";
}

/* Strict UTF-8 (no overlongs, no surrogates, <= U+10FFFF). Returns the offset of the
 * first bad byte or len when valid. */
static size_t utf8_check(const uint8_t *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        uint8_t c = s[i];
        size_t n;
        uint32_t cp;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 1;
            cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            n = 2;
            cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            n = 3;
            cp = c & 0x07;
        } else {
            return i;
        }
        if (n > len - 1 - i)
            return i;
        for (size_t j = 1; j <= n; j++) {
            if ((s[i + j] & 0xC0) != 0x80)
                return i;
            cp = (cp << 6) | (s[i + j] & 0x3F);
        }
        if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
            cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return i;
        i += n + 1;
    }
    return len;
}

static void file_free(struct stepq__trace_file *f)
{
    if (!f)
        return;
    for (int i = 0; i < f->n_tensors; i++)
        free(f->tensors[i].name);
    free(f->tensors);
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_vals[i]);
    }
    free(f->meta_keys);
    free(f->meta_vals);
    if (f->owns)
        free((void *)f->base);
    free(f->path);
    free(f);
}

void stepq__trace_file_close(struct stepq__trace_file *f)
{
    file_free(f);
}

static int cmp_begin(const void *a, const void *b)
{
    const struct stepq__trace_tensor *x = *(struct stepq__trace_tensor *const *)a;
    const struct stepq__trace_tensor *y = *(struct stepq__trace_tensor *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* A JSON number that is an exact non-negative integer below 2^53. */
static int json_u53(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j))
        return -1;
    double d = j->valuedouble;
    if (!(d >= 0.0) || d > 9007199254740992.0 || d != floor(d))
        return -1;
    *out = (uint64_t)d;
    return 0;
}

static int parse_tensor(const cJSON *j, const char *what, struct stepq__trace_tensor *t,
                        uint64_t data_len)
{
    const char *nm = t->name;
    if (!cJSON_IsObject(j))
        return stepq__error(STEPQ_ESCHEMA, "%s: tensor '%s': not an object", what, nm);
    const cJSON *dt = NULL, *sh = NULL, *off = NULL;
    for (const cJSON *c = j->child; c; c = c->next) {
        if (!strcmp(c->string, "dtype") && !dt)
            dt = c;
        else if (!strcmp(c->string, "shape") && !sh)
            sh = c;
        else if (!strcmp(c->string, "data_offsets") && !off)
            off = c;
        else
            return stepq__error(STEPQ_ESCHEMA, "%s: tensor '%s': unexpected or duplicate key '%s'",
                                what, nm, c->string);
    }
    if (!dt || !sh || !off)
        return stepq__error(STEPQ_ESCHEMA, "%s: tensor '%s': needs dtype, shape and data_offsets",
                            what, nm);
    if (!cJSON_IsString(dt) || dtype_from_name(dt->valuestring, &t->dtype) < 0)
        return stepq__error(
            STEPQ_ESCHEMA, "%s: tensor '%s': dtype %s%s%s is not supported (F32, BF16, F16)", what,
            nm, cJSON_IsString(dt) ? "'" : "",
            cJSON_IsString(dt) ? dt->valuestring : "(not a string)", cJSON_IsString(dt) ? "'" : "");
    if (!cJSON_IsArray(sh))
        return stepq__error(STEPQ_ESCHEMA, "%s: tensor '%s': shape is not an array", what, nm);
    int nd = cJSON_GetArraySize(sh);
    if (nd > 8)
        return stepq__error(STEPQ_ERANGE, "%s: tensor '%s': %d dimensions (at most 8)", what, nm,
                            nd);
    t->ndim = nd;
    uint64_t numel = 1;
    int i = 0;
    for (const cJSON *c = sh->child; c; c = c->next, i++) {
        uint64_t d;
        if (json_u53(c, &d) < 0)
            return stepq__error(STEPQ_ESCHEMA,
                                "%s: tensor '%s': shape[%d] is not a non-negative integer", what,
                                nm, i);
        t->shape[i] = (int64_t)d;
        if (d && numel > UINT64_MAX / 8 / d)
            return stepq__error(STEPQ_ERANGE, "%s: tensor '%s': shape overflows", what, nm);
        numel *= d;
    }
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 ||
        json_u53(cJSON_GetArrayItem(off, 0), &t->begin) < 0 ||
        json_u53(cJSON_GetArrayItem(off, 1), &t->end) < 0)
        return stepq__error(
            STEPQ_ESCHEMA, "%s: tensor '%s': data_offsets must be [begin, end] integers", what, nm);
    uint64_t bytes = numel * stepq__trace_dtype_size(t->dtype);
    if (t->end < t->begin)
        return stepq__error(STEPQ_ERANGE, "%s: tensor '%s': data_offsets end %llu < begin %llu",
                            what, nm, (unsigned long long)t->end, (unsigned long long)t->begin);
    if (t->end - t->begin != bytes)
        return stepq__error(STEPQ_ERANGE,
                            "%s: tensor '%s': data_offsets span %llu bytes, shape x %s needs %llu",
                            what, nm, (unsigned long long)(t->end - t->begin), dtype_name(t->dtype),
                            (unsigned long long)bytes);
    if (t->end > data_len)
        return stepq__error(STEPQ_ERANGE,
                            "%s: tensor '%s': data [%llu, %llu) beyond the data area of %llu bytes "
                            "(truncated file?)",
                            what, nm, (unsigned long long)t->begin, (unsigned long long)t->end,
                            (unsigned long long)data_len);
    if (t->begin % stepq__trace_dtype_size(t->dtype))
        return stepq__error(STEPQ_ERANGE, "%s: tensor '%s': offset %llu is not aligned to %zu",
                            what, nm, (unsigned long long)t->begin,
                            stepq__trace_dtype_size(t->dtype));
    return STEPQ_OK;
}

int stepq__trace_file_parse(const uint8_t *buf, size_t len, const char *what,
                            struct stepq__trace_file **out)
{
    int rc = STEPQ_OK;
    cJSON *root = NULL;
    struct stepq__trace_file *f = NULL;
    struct stepq__trace_tensor **order = NULL;
    char **names = NULL;

    *out = NULL;
    if (!what)
        what = "trace";
    if (len < 8)
        return stepq__error(STEPQ_EPARSE, "%s: %zu bytes, shorter than the 8-byte header length",
                            what, len);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--)
        hl = (hl << 8) | buf[i];
    if (hl > STEPQ__TRACE_MAX_HEADER)
        return stepq__error(STEPQ_ERANGE, "%s: header of %llu bytes (at most %u)", what,
                            (unsigned long long)hl, STEPQ__TRACE_MAX_HEADER);
    if (hl < 2 || hl > len - 8)
        return stepq__error(STEPQ_EPARSE,
                            "%s: header of %llu bytes, file has %zu after the length "
                            "(truncated?)",
                            what, (unsigned long long)hl, len - 8);
    const uint8_t *h = buf + 8;
    size_t bad = utf8_check(h, (size_t)hl);
    if (bad != hl)
        return stepq__error(STEPQ_EPARSE, "%s: header byte %zu is not valid UTF-8", what, bad);
    if (memchr(h, 0, (size_t)hl))
        return stepq__error(STEPQ_EPARSE, "%s: header contains a NUL byte", what);
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts((const char *)h, (size_t)hl, &end, 0);
    if (!root)
        return stepq__error(STEPQ_EPARSE, "%s: header is not valid JSON", what);
    /* Only spaces may follow the JSON value (safetensors pads with spaces). */
    for (const char *p = end; p < (const char *)h + hl; p++)
        if (*p != ' ' && *p != '\n' && *p != '\t' && *p != '\r') {
            rc = stepq__error(STEPQ_EPARSE, "%s: trailing bytes after the header JSON", what);
            goto done;
        }
    if (!cJSON_IsObject(root)) {
        rc = stepq__error(STEPQ_ESCHEMA, "%s: header is not a JSON object", what);
        goto done;
    }
    f = calloc(1, sizeof(*f));
    if (!f) {
        rc = stepq__error(STEPQ_ENOMEM, "%s: out of memory", what);
        goto done;
    }
    f->base = buf;
    f->size = len;
    int n = cJSON_GetArraySize(root);
    if (n > STEPQ__TRACE_MAX_TENSORS + 1) {
        rc = stepq__error(STEPQ_ERANGE, "%s: %d header entries (at most %d)", what, n,
                          STEPQ__TRACE_MAX_TENSORS);
        goto done;
    }
    f->tensors = calloc((size_t)n + 1, sizeof(*f->tensors));
    names = calloc((size_t)n + 1, sizeof(*names));
    order = calloc((size_t)n + 1, sizeof(*order));
    if (!f->tensors || !names || !order) {
        rc = stepq__error(STEPQ_ENOMEM, "%s: out of memory", what);
        goto done;
    }
    uint64_t data_len = len - 8 - hl;
    int have_meta = 0, nn = 0;
    for (const cJSON *c = root->child; c; c = c->next) {
        names[nn++] = c->string;
        if (!strcmp(c->string, "__metadata__")) {
            if (have_meta++)
                continue; /* reported as a duplicate key below */
            if (!cJSON_IsObject(c)) {
                rc = stepq__error(STEPQ_ESCHEMA, "%s: __metadata__ is not an object", what);
                goto done;
            }
            int m = cJSON_GetArraySize(c);
            f->meta_keys = calloc((size_t)m + 1, sizeof(char *));
            f->meta_vals = calloc((size_t)m + 1, sizeof(char *));
            if (!f->meta_keys || !f->meta_vals) {
                rc = stepq__error(STEPQ_ENOMEM, "%s: out of memory", what);
                goto done;
            }
            for (const cJSON *e = c->child; e; e = e->next) {
                if (!cJSON_IsString(e)) {
                    rc = stepq__error(STEPQ_ESCHEMA, "%s: __metadata__.%s is not a string", what,
                                      e->string);
                    goto done;
                }
                for (int k = 0; k < f->n_meta; k++)
                    if (!strcmp(f->meta_keys[k], e->string)) {
                        rc = stepq__error(STEPQ_ESCHEMA, "%s: __metadata__.%s: duplicate key", what,
                                          e->string);
                        goto done;
                    }
                f->meta_keys[f->n_meta] = strdup(e->string);
                f->meta_vals[f->n_meta] = strdup(e->valuestring);
                if (!f->meta_keys[f->n_meta] || !f->meta_vals[f->n_meta]) {
                    f->n_meta++;
                    rc = stepq__error(STEPQ_ENOMEM, "%s: out of memory", what);
                    goto done;
                }
                f->n_meta++;
            }
            continue;
        }
        struct stepq__trace_tensor *t = &f->tensors[f->n_tensors];
        t->name = strdup(c->string);
        if (!t->name) {
            rc = stepq__error(STEPQ_ENOMEM, "%s: out of memory", what);
            goto done;
        }
        f->n_tensors++;
        if (!t->name[0]) {
            rc = stepq__error(STEPQ_ESCHEMA, "%s: a tensor has an empty name", what);
            goto done;
        }
        if ((rc = parse_tensor(c, what, t, data_len)) < 0)
            goto done;
        t->data = buf + 8 + hl + t->begin;
        order[f->n_tensors - 1] = t;
    }
    qsort(names, (size_t)nn, sizeof(*names), cmp_name);
    for (int i = 1; i < nn; i++)
        if (!strcmp(names[i - 1], names[i])) {
            rc =
                stepq__error(STEPQ_ESCHEMA, "%s: duplicate key '%s' in the header", what, names[i]);
            goto done;
        }
    /* Tensors must tile the data area exactly: no overlap, no gap, nothing after. */
    qsort(order, (size_t)f->n_tensors, sizeof(*order), cmp_begin);
    uint64_t pos = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const struct stepq__trace_tensor *t = order[i];
        if (t->begin < pos) {
            rc = stepq__error(STEPQ_ERANGE, "%s: tensor '%s' [%llu, %llu) overlaps tensor '%s'",
                              what, t->name, (unsigned long long)t->begin,
                              (unsigned long long)t->end, order[i - 1]->name);
            goto done;
        }
        if (t->begin > pos) {
            rc = stepq__error(STEPQ_ERANGE, "%s: %llu unused bytes before tensor '%s'", what,
                              (unsigned long long)(t->begin - pos), t->name);
            goto done;
        }
        pos = t->end;
    }
    if (pos != data_len) {
        rc = stepq__error(STEPQ_ERANGE, "%s: %llu bytes after the last tensor", what,
                          (unsigned long long)(data_len - pos));
        goto done;
    }
done:
    cJSON_Delete(root);
    free(order);
    free(names);
    if (rc < 0) {
        file_free(f);
        return rc;
    }
    *out = f;
    return STEPQ_OK;
}

int stepq__trace_file_open(const char *path, struct stepq__trace_file **out)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return stepq__error(errno == ENOENT ? STEPQ_ENOENT : STEPQ_EIO, "%s: %s", path,
                            strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return stepq__error(STEPQ_EIO, "%s: not a regular file", path);
    }
    /*
     * Read, not mmap: a mapped file that shrinks while open (another process
     * rewriting it) kills the reader with SIGBUS at the next access; a copy
     * read at open either is complete or is an error here.
     */
    size_t len = (size_t)st.st_size;
    uint8_t *p = malloc(len ? len : 1);
    size_t got = 0;
    if (!p) {
        close(fd);
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory for %zu bytes", path, len);
    }
    while (got < len) {
        ssize_t r = read(fd, p + got, len - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    if (got != len) {
        free(p);
        close(fd);
        return stepq__error(STEPQ_EIO,
                            "%s: read %zu of %zu bytes (the file changed while it was read?)", path,
                            got, len);
    }
    const uint8_t *base = p;
    close(fd);
    struct stepq__trace_file *f;
    int rc = stepq__trace_file_parse(base, len, path, &f);
    if (rc < 0) {
        free((void *)base);
        return rc;
    }
    f->owns = 1;
    f->path = strdup(path);
    *out = f;
    return STEPQ_OK;
}

const struct stepq__trace_tensor *stepq__trace_file_find(const struct stepq__trace_file *f,
                                                         const char *name)
{
    for (int i = 0; i < f->n_tensors; i++)
        if (!strcmp(f->tensors[i].name, name))
            return &f->tensors[i];
    return NULL;
}

const char *stepq__trace_file_meta(const struct stepq__trace_file *f, const char *key)
{
    for (int i = 0; i < f->n_meta; i++)
        if (!strcmp(f->meta_keys[i], key))
            return f->meta_vals[i];
    return NULL;
}

/* ------------------------------------------------------------------ trace sets */

enum { T_Q, T_K, T_V, T_G, T_BETA, T_O, T_N };
static const char *const tnames[T_N] = { "q", "k", "v", "g", "beta", "o" };

struct slot {
    const struct stepq__trace_tensor *t[T_N];
    int s_in_file; /* stream index inside the tensors */
};

struct stepq__trace_set {
    struct stepq__trace_info info;
    int n_files;
    struct stepq__trace_file **files;
    struct slot *slots; /* [n_streams][n_layers] */
};

static int meta_int(const struct stepq__trace_file *f, const char *key, long lo, long hi, int *out)
{
    const char *s = stepq__trace_file_meta(f, key);
    const char *what = f->path ? f->path : "trace";
    if (!s)
        return stepq__error(STEPQ_ESCHEMA, "%s: __metadata__.%s is missing", what, key);
    char *e;
    errno = 0;
    long v = strtol(s, &e, 10);
    if (e == s || *e || errno || v < lo || v > hi)
        return stepq__error(STEPQ_ERANGE,
                            "%s: __metadata__.%s = '%s' is not an integer in [%ld, %ld]", what, key,
                            s, lo, hi);
    *out = (int)v;
    return STEPQ_OK;
}

static int parse_layers(const char *s, int *ids, int cap, const char *what, const char *key)
{
    int n = 0;
    const char *p = s;
    if (!s || !*s)
        return stepq__error(STEPQ_ESCHEMA, "%s: __metadata__.%s is missing or empty", what, key);
    while (*p) {
        char *e;
        errno = 0;
        long v = strtol(p, &e, 10);
        if (e == p || errno || v < 0 || v > 1000000 || (*e && *e != ','))
            return stepq__error(STEPQ_ERANGE, "%s: __metadata__.%s = '%s': bad layer list", what,
                                key, s);
        if (n >= cap)
            return stepq__error(STEPQ_ERANGE, "%s: __metadata__.%s: more than %d layers", what, key,
                                cap);
        if (n && v <= ids[n - 1])
            return stepq__error(STEPQ_ERANGE, "%s: __metadata__.%s: layers not increasing", what,
                                key);
        ids[n++] = (int)v;
        p = *e ? e + 1 : e;
        if (*e == ',' && !*p)
            return stepq__error(STEPQ_ERANGE, "%s: __metadata__.%s = '%s': bad layer list", what,
                                key, s);
    }
    return n;
}

static int file_info(const struct stepq__trace_file *f, struct stepq__trace_info *in, int *s_off,
                     int *n_str, int *lay, int *n_lay)
{
    const char *what = f->path ? f->path : "trace";
    const char *s;
    int rc, ver;
    memset(in, 0, sizeof(*in));
    if (!(s = stepq__trace_file_meta(f, "format")) || strcmp(s, "stepq-trace"))
        return stepq__error(STEPQ_ESCHEMA, "%s: __metadata__.format is not 'stepq-trace'", what);
    if ((rc = meta_int(f, "version", 1, 1, &ver)) < 0)
        return rc;
    if (!(s = stepq__trace_file_meta(f, "arch")) || (strcmp(s, "gdn") && strcmp(s, "kda")))
        return stepq__error(STEPQ_ESCHEMA, "%s: __metadata__.arch must be 'gdn' or 'kda'", what);
    in->arch = !strcmp(s, "kda") ? STEPQ_ARCH_KDA : STEPQ_ARCH_GDN;
    if ((rc = meta_int(f, "H", 1, 4096, &in->H)) < 0 ||
        (rc = meta_int(f, "HV", 1, 4096, &in->HV)) < 0 ||
        (rc = meta_int(f, "K", 1, STEPQ__MAX_HEAD_DIM, &in->K)) < 0 ||
        (rc = meta_int(f, "V", 1, STEPQ__MAX_HEAD_DIM, &in->V)) < 0 ||
        (rc = meta_int(f, "qk_l2norm", 0, 1, &in->qk_l2norm)) < 0 ||
        (rc = meta_int(f, "stream_offset", 0, 1 << 24, s_off)) < 0 ||
        (rc = meta_int(f, "n_streams", 1, 1 << 24, n_str)) < 0 ||
        (rc = meta_int(f, "streams_total", 1, 1 << 24, &in->n_streams)) < 0 ||
        (rc = meta_int(f, "seq_len", 1, 1 << 28, &in->T)) < 0)
        return rc;
    if (in->HV % in->H)
        return stepq__error(STEPQ_ESCHEMA, "%s: HV = %d is not a multiple of H = %d", what, in->HV,
                            in->H);
    if (*s_off + *n_str > in->n_streams)
        return stepq__error(STEPQ_ERANGE, "%s: streams %d..%d beyond streams_total %d", what,
                            *s_off, *s_off + *n_str - 1, in->n_streams);
    if (!(s = stepq__trace_file_meta(f, "qk_heads")) || (strcmp(s, "H") && strcmp(s, "HV")))
        return stepq__error(STEPQ_ESCHEMA, "%s: __metadata__.qk_heads must be 'H' or 'HV'", what);
    in->qk_repeated = !strcmp(s, "HV");
    if (!(s = stepq__trace_file_meta(f, "scale")))
        return stepq__error(STEPQ_ESCHEMA, "%s: __metadata__.scale is missing", what);
    char *e;
    double sc = strtod(s, &e);
    if (e == s || *e || !(sc > 0.0) || sc > 1e6)
        return stepq__error(STEPQ_ERANGE, "%s: __metadata__.scale = '%s' is not a positive number",
                            what, s);
    in->scale = (float)sc;
    if ((rc = parse_layers(stepq__trace_file_meta(f, "all_layers"), in->layer_ids,
                           STEPQ__TRACE_MAX_LAYERS, what, "all_layers")) < 0)
        return rc;
    in->n_layers = rc;
    if ((rc = parse_layers(stepq__trace_file_meta(f, "layers"), lay, STEPQ__TRACE_MAX_LAYERS, what,
                           "layers")) < 0)
        return rc;
    *n_lay = rc;
    return STEPQ_OK;
}

static int same_info(const struct stepq__trace_info *a, const struct stepq__trace_info *b)
{
    return a->arch == b->arch && a->H == b->H && a->HV == b->HV && a->K == b->K && a->V == b->V &&
           a->qk_repeated == b->qk_repeated && a->qk_l2norm == b->qk_l2norm &&
           a->scale == b->scale && a->n_layers == b->n_layers && a->n_streams == b->n_streams &&
           a->T == b->T && !memcmp(a->layer_ids, b->layer_ids, sizeof(int) * (size_t)a->n_layers);
}

static int check_shape(const struct stepq__trace_tensor *t, const char *what, int nd,
                       const int64_t *want)
{
    int ok = t->ndim == nd;
    for (int i = 0; ok && i < nd; i++)
        ok = t->shape[i] == want[i];
    if (ok)
        return STEPQ_OK;
    char got[160] = "", exp[160] = "";
    size_t pg = 0, pe = 0;
    for (int i = 0; i < t->ndim && pg < sizeof(got) - 24; i++)
        pg += (size_t)snprintf(got + pg, sizeof(got) - pg, "%s%lld", i ? "," : "",
                               (long long)t->shape[i]);
    for (int i = 0; i < nd && pe < sizeof(exp) - 24; i++)
        pe += (size_t)snprintf(exp + pe, sizeof(exp) - pe, "%s%lld", i ? "," : "",
                               (long long)want[i]);
    return stepq__error(STEPQ_ESHAPE, "%s: tensor '%s' has shape [%s], expected [%s]", what,
                        t->name, got, exp);
}

/* Whether one stored element is NaN or +-Inf (its exponent bits all set). */
static int elem_nonfinite(const uint8_t *p, stepq__trace_dtype dt)
{
    if (dt == STEPQ__TRACE_F32)
        return (p[3] & 0x7F) == 0x7F && (p[2] & 0x80);
    if (dt == STEPQ__TRACE_BF16)
        return (p[1] & 0x7F) == 0x7F && (p[0] & 0x80);
    return (p[1] & 0x7C) == 0x7C; /* F16 */
}

static float load_elem(const uint8_t *p, stepq__trace_dtype dt);

/*
 * Refuses a tensor holding a NaN or an Inf: the replay would carry it into
 * every state after it, and calibrate and eval would print costs and errors
 * of nan. Names the file, the tensor, its layer and the first bad element,
 * by its index in the tensor ([stream in the file, token, head(, element)])
 * and by stream of the capture (s_off: the file's first), token and head.
 */
static int check_finite(const struct stepq__trace_tensor *t, const char *what, int layer, int s_off)
{
    static const char *const dims[] = { "stream", "token", "head", "element" };
    const size_t es = stepq__trace_dtype_size(t->dtype), n = (size_t)(t->end - t->begin) / es;
    size_t i = 0;

    while (i < n && !elem_nonfinite(t->data + i * es, t->dtype))
        i++;
    if (i == n)
        return STEPQ_OK;
    /* Shapes were checked: 3 or 4 dimensions [S, T, heads(, width)], none 0 here. */
    int64_t idx[4] = { 0 };
    size_t rest = i;
    for (int d = t->ndim - 1; d >= 0; d--) {
        idx[d] = (int64_t)(rest % (size_t)t->shape[d]);
        rest /= (size_t)t->shape[d];
    }
    char at[96] = "", named[160] = "";
    size_t la = 0, ln = 0;
    for (int d = 0; d < t->ndim; d++) {
        la +=
            (size_t)snprintf(at + la, sizeof(at) - la, "%s%lld", d ? ", " : "", (long long)idx[d]);
        ln += (size_t)snprintf(named + ln, sizeof(named) - ln, "%s%s %lld", d ? ", " : "", dims[d],
                               (long long)(d == 0 ? s_off + idx[0] : idx[d]));
    }
    float v = load_elem(t->data + i * es, t->dtype);
    return stepq__error(STEPQ_ENONFINITE,
                        "%s: tensor '%s' (layer %d) holds %s at [%s] (%s): a trace must be finite",
                        what, t->name, layer,
                        isnan(v) ? "nan"
                        : v > 0  ? "inf"
                                 : "-inf",
                        at, named);
}

void stepq__trace_set_close(struct stepq__trace_set *ts)
{
    if (!ts)
        return;
    for (int i = 0; i < ts->n_files; i++)
        stepq__trace_file_close(ts->files[i]);
    free(ts->files);
    free(ts->slots);
    free(ts);
}

int stepq__trace_set_from_files(struct stepq__trace_file **files, int n,
                                struct stepq__trace_set **out)
{
    int rc = STEPQ_OK;
    struct stepq__trace_set *ts = calloc(1, sizeof(*ts));
    *out = NULL;
    if (!ts || !(ts->files = calloc((size_t)(n > 0 ? n : 1), sizeof(*ts->files)))) {
        for (int i = 0; i < n; i++)
            stepq__trace_file_close(files[i]);
        free(ts);
        return stepq__error(STEPQ_ENOMEM, "trace set: out of memory");
    }
    for (int i = 0; i < n; i++)
        ts->files[i] = files[i];
    ts->n_files = n;
    if (n < 1) {
        rc = stepq__error(STEPQ_EINVAL, "trace set: no files");
        goto fail;
    }
    int has_o = -1;
    for (int fi = 0; fi < n; fi++) {
        const struct stepq__trace_file *f = files[fi];
        const char *what = f->path ? f->path : "trace";
        struct stepq__trace_info in;
        int s_off, n_str, lay[STEPQ__TRACE_MAX_LAYERS], n_lay;
        if ((rc = file_info(f, &in, &s_off, &n_str, lay, &n_lay)) < 0)
            goto fail;
        if (fi == 0) {
            ts->info = in;
            ts->slots = calloc((size_t)in.n_streams * (size_t)in.n_layers, sizeof(*ts->slots));
            if (!ts->slots) {
                rc = stepq__error(STEPQ_ENOMEM, "trace set: out of memory");
                goto fail;
            }
        } else if (!same_info(&in, &ts->info)) {
            rc =
                stepq__error(STEPQ_ESHAPE,
                             "%s: model shape, streams_total, seq_len or all_layers differ from %s",
                             what, files[0]->path ? files[0]->path : "the first file");
            goto fail;
        }
        const struct stepq__trace_info *I = &ts->info;
        int Hq = I->qk_repeated ? I->HV : I->H;
        int expected_tensors = 0;
        for (int l = 0; l < n_lay; l++) {
            int li = -1;
            for (int j = 0; j < I->n_layers; j++)
                if (I->layer_ids[j] == lay[l])
                    li = j;
            if (li < 0) {
                rc = stepq__error(STEPQ_ESCHEMA, "%s: layer %d is not in all_layers", what, lay[l]);
                goto fail;
            }
            const struct stepq__trace_tensor *tt[T_N];
            for (int k = 0; k < T_N; k++) {
                char nm[64];
                snprintf(nm, sizeof(nm), "layer%d.%s", lay[l], tnames[k]);
                tt[k] = stepq__trace_file_find(f, nm);
                if (!tt[k] && k != T_O) {
                    rc = stepq__error(STEPQ_ESCHEMA, "%s: tensor '%s' is missing", what, nm);
                    goto fail;
                }
                expected_tensors += tt[k] != NULL;
            }
            int ho = tt[T_O] != NULL;
            if (has_o < 0)
                has_o = ho;
            else if (has_o != ho) {
                rc = stepq__error(STEPQ_ESCHEMA,
                                  "%s: layer%d.o present in some files or layers only", what,
                                  lay[l]);
                goto fail;
            }
            int64_t sq[4] = { n_str, I->T, Hq, I->K }, sv[4] = { n_str, I->T, I->HV, I->V };
            int64_t sg[4] = { n_str, I->T, I->HV, I->K }, sb[3] = { n_str, I->T, I->HV };
            if ((rc = check_shape(tt[T_Q], what, 4, sq)) < 0 ||
                (rc = check_shape(tt[T_K], what, 4, sq)) < 0 ||
                (rc = check_shape(tt[T_V], what, 4, sv)) < 0 ||
                (rc = check_shape(tt[T_G], what, I->arch == STEPQ_ARCH_KDA ? 4 : 3, sg)) < 0 ||
                (rc = check_shape(tt[T_BETA], what, 3, sb)) < 0 ||
                (ho && (rc = check_shape(tt[T_O], what, 4, sv)) < 0))
                goto fail;
            for (int k = 0; k < T_N; k++)
                if (tt[k] && (rc = check_finite(tt[k], what, lay[l], s_off)) < 0)
                    goto fail;
            for (int s = 0; s < n_str; s++) {
                struct slot *sl = &ts->slots[(size_t)(s_off + s) * I->n_layers + li];
                if (sl->t[T_Q]) {
                    rc = stepq__error(STEPQ_ESCHEMA, "%s: stream %d layer %d appears twice", what,
                                      s_off + s, lay[l]);
                    goto fail;
                }
                memcpy(sl->t, tt, sizeof(tt));
                sl->s_in_file = s;
            }
        }
        if (expected_tensors != f->n_tensors) {
            rc = stepq__error(STEPQ_ESCHEMA,
                              "%s: %d tensors in the file, %d expected for layers '%s'", what,
                              f->n_tensors, expected_tensors, stepq__trace_file_meta(f, "layers"));
            goto fail;
        }
    }
    ts->info.has_output = has_o > 0;
    /* A set may hold a subset of a capture's streams (e.g. some of its files): every stream
     * that is present must have every layer; the present streams are renumbered 0.. in order. */
    int L = ts->info.n_layers, kept = 0;
    for (int s = 0; s < ts->info.n_streams; s++) {
        int have = 0;
        for (int l = 0; l < L; l++)
            have += ts->slots[(size_t)s * L + l].t[T_Q] != NULL;
        if (!have)
            continue;
        for (int l = 0; l < L; l++)
            if (!ts->slots[(size_t)s * L + l].t[T_Q]) {
                rc = stepq__error(STEPQ_ESCHEMA, "trace set: stream %d of layer %d is in no file",
                                  s, ts->info.layer_ids[l]);
                goto fail;
            }
        if (kept != s)
            memcpy(&ts->slots[(size_t)kept * L], &ts->slots[(size_t)s * L],
                   sizeof(*ts->slots) * (size_t)L);
        kept++;
    }
    ts->info.n_streams = kept;
    *out = ts;
    return STEPQ_OK;
fail:
    stepq__trace_set_close(ts);
    return rc;
}

int stepq__trace_set_open(const char *const *paths, int n, struct stepq__trace_set **out)
{
    struct stepq__trace_file **files = calloc((size_t)(n > 0 ? n : 1), sizeof(*files));
    int rc;
    *out = NULL;
    if (!files)
        return stepq__error(STEPQ_ENOMEM, "trace set: out of memory");
    for (int i = 0; i < n; i++) {
        if ((rc = stepq__trace_file_open(paths[i], &files[i])) < 0) {
            for (int j = 0; j < i; j++)
                stepq__trace_file_close(files[j]);
            free(files);
            return rc;
        }
    }
    rc = stepq__trace_set_from_files(files, n, out);
    free(files);
    return rc;
}

const struct stepq__trace_info *stepq__trace_set_info(const struct stepq__trace_set *ts)
{
    return &ts->info;
}

const char *stepq__trace_set_meta(const struct stepq__trace_set *ts, const char *key)
{
    return ts->n_files ? stepq__trace_file_meta(ts->files[0], key) : NULL;
}

static float load_elem(const uint8_t *p, stepq__trace_dtype dt)
{
    if (dt == STEPQ__TRACE_F32) {
        uint32_t u =
            (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    return dt == STEPQ__TRACE_BF16 ? stepq__bf16_to_float(h) : stepq__fp16_to_float(h);
}

/* Copies n rows of `w` elements at (s, t0 + r, head) of a [S][T][heads][w] tensor. */
static void gather(const struct stepq__trace_tensor *t, int s, int T, int heads, int head, int w,
                   int t0, int n, float *dst)
{
    size_t es = stepq__trace_dtype_size(t->dtype);
    for (int r = 0; r < n; r++) {
        size_t idx = (((size_t)s * T + (size_t)(t0 + r)) * heads + head) * w;
        const uint8_t *p = t->data + idx * es;
        for (int i = 0; i < w; i++)
            dst[(size_t)r * w + i] = load_elem(p + (size_t)i * es, t->dtype);
    }
}

int stepq__trace_head(const struct stepq__trace_set *ts, int stream, int li, int hv, int t0, int n,
                      float *q, float *k, float *v, float *g, float *beta, float *o)
{
    const struct stepq__trace_info *I = &ts->info;
    if (stream < 0 || stream >= I->n_streams || li < 0 || li >= I->n_layers || hv < 0 ||
        hv >= I->HV || t0 < 0 || n < 0 || t0 + n > I->T)
        return stepq__error(
            STEPQ_EINVAL, "trace: stream %d, layer index %d, head %d, tokens [%d, %d) out of range",
            stream, li, hv, t0, t0 + n);
    if (o && !I->has_output)
        return stepq__error(STEPQ_EINVAL, "trace: the set has no outputs (layer*.o)");
    const struct slot *sl = &ts->slots[(size_t)stream * I->n_layers + li];
    int s = sl->s_in_file;
    int Hq = I->qk_repeated ? I->HV : I->H;
    int hq = I->qk_repeated ? hv : hv / (I->HV / I->H);
    if (q)
        gather(sl->t[T_Q], s, I->T, Hq, hq, I->K, t0, n, q);
    if (k)
        gather(sl->t[T_K], s, I->T, Hq, hq, I->K, t0, n, k);
    if (v)
        gather(sl->t[T_V], s, I->T, I->HV, hv, I->V, t0, n, v);
    if (g)
        gather(sl->t[T_G], s, I->T, I->HV, hv, I->arch == STEPQ_ARCH_KDA ? I->K : 1, t0, n, g);
    if (beta)
        gather(sl->t[T_BETA], s, I->T, I->HV, hv, 1, t0, n, beta);
    if (o)
        gather(sl->t[T_O], s, I->T, I->HV, hv, I->V, t0, n, o);
    return STEPQ_OK;
}

/* ------------------------------------------------------------------ writer */

struct stepq__trace_writer {
    FILE *fp;
    char *path;
    int n, cur;
    struct stepq__trace_wtensor *t;
    uint64_t left; /* elements left in tensor cur */
    int failed;
};

static uint64_t numel(const struct stepq__trace_wtensor *t)
{
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= (uint64_t)t->shape[i];
    return n;
}

int stepq__trace_writer_open(const char *path, const struct stepq__trace_wtensor *t, int n,
                             const char *const *meta_kv, int n_meta,
                             struct stepq__trace_writer **out)
{
    *out = NULL;
    cJSON *root = cJSON_CreateObject(), *meta = cJSON_CreateObject();
    if (!root || !meta) {
        cJSON_Delete(root);
        cJSON_Delete(meta);
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory", path);
    }
    cJSON_AddItemToObject(root, "__metadata__", meta);
    for (int i = 0; i < n_meta; i++)
        cJSON_AddStringToObject(meta, meta_kv[2 * i], meta_kv[2 * i + 1]);
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        cJSON *o = cJSON_CreateObject(), *sh = cJSON_CreateArray(), *of = cJSON_CreateArray();
        cJSON_AddStringToObject(o, "dtype", dtype_name(t[i].dtype));
        for (int d = 0; d < t[i].ndim; d++)
            cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t[i].shape[d]));
        cJSON_AddItemToObject(o, "shape", sh);
        uint64_t b = numel(&t[i]) * stepq__trace_dtype_size(t[i].dtype);
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)(off + b)));
        cJSON_AddItemToObject(o, "data_offsets", of);
        cJSON_AddItemToObject(root, t[i].name, o);
        off += b;
    }
    char *js = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!js)
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory", path);
    size_t hl = strlen(js), pad = (8 - hl % 8) % 8;
    struct stepq__trace_writer *w = calloc(1, sizeof(*w));
    if (!w || !(w->t = calloc((size_t)(n ? n : 1), sizeof(*w->t))) || !(w->path = strdup(path))) {
        free(js);
        if (w) {
            free(w->t);
            free(w);
        }
        return stepq__error(STEPQ_ENOMEM, "%s: out of memory", path);
    }
    memcpy(w->t, t, sizeof(*t) * (size_t)n);
    w->n = n;
    w->fp = fopen(path, "wb");
    if (!w->fp) {
        int e = errno;
        free(js);
        free(w->t);
        free(w->path);
        free(w);
        return stepq__error(STEPQ_EIO, "%s: %s", path, strerror(e));
    }
    uint8_t len8[8];
    uint64_t L = hl + pad;
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)(L >> (8 * i));
    fwrite(len8, 1, 8, w->fp);
    fwrite(js, 1, hl, w->fp);
    for (size_t i = 0; i < pad; i++)
        fputc(' ', w->fp);
    free(js);
    w->cur = 0;
    while (w->cur < n && !(w->left = numel(&w->t[w->cur])))
        w->cur++;
    *out = w;
    return STEPQ_OK;
}

int stepq__trace_writer_put(struct stepq__trace_writer *w, const float *x, size_t n)
{
    uint8_t buf[4096];
    while (n) {
        if (w->cur >= w->n) {
            w->failed = 1;
            return stepq__error(STEPQ_ERANGE, "%s: more data than the tensors hold", w->path);
        }
        stepq__trace_dtype dt = w->t[w->cur].dtype;
        size_t es = stepq__trace_dtype_size(dt);
        size_t m = n < w->left ? n : (size_t)w->left;
        if (m > sizeof(buf) / es)
            m = sizeof(buf) / es;
        for (size_t i = 0; i < m; i++) {
            if (dt == STEPQ__TRACE_F32) {
                uint32_t u;
                memcpy(&u, &x[i], 4);
                for (int b = 0; b < 4; b++)
                    buf[i * 4 + b] = (uint8_t)(u >> (8 * b));
            } else {
                uint16_t h = dt == STEPQ__TRACE_BF16 ? stepq__bf16_from_float(x[i])
                                                     : stepq__fp16_from_float(x[i]);
                buf[i * 2] = (uint8_t)h;
                buf[i * 2 + 1] = (uint8_t)(h >> 8);
            }
        }
        if (fwrite(buf, es, m, w->fp) != m) {
            w->failed = 1;
            return stepq__error(STEPQ_EIO, "%s: write failed", w->path);
        }
        x += m;
        n -= m;
        w->left -= m;
        while (w->cur < w->n && w->left == 0) {
            w->cur++;
            if (w->cur < w->n)
                w->left = numel(&w->t[w->cur]);
        }
    }
    return STEPQ_OK;
}

int stepq__trace_writer_close(struct stepq__trace_writer *w)
{
    int rc = STEPQ_OK;
    if (!w)
        return STEPQ_OK;
    if (w->cur < w->n && !w->failed)
        rc = stepq__error(STEPQ_EINVAL, "%s: tensor '%s' not fully written", w->path,
                          w->t[w->cur].name);
    if (fclose(w->fp) != 0 && rc == STEPQ_OK)
        rc = stepq__error(STEPQ_EIO, "%s: close failed", w->path);
    if (w->failed && rc == STEPQ_OK)
        rc = stepq__error(STEPQ_EIO, "%s: incomplete", w->path);
    if (rc < 0)
        remove(w->path);
    free(w->t);
    free(w->path);
    free(w);
    return rc;
}
