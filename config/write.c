/*
 * The precision-map writer: deterministic JSON (fixed key order, fixed
 * layout, shortest round-trip numbers) that the loader reads back into an
 * identical map. cJSON's printer is not used because it offers neither a
 * fixed number format nor control over the layout.
 */
#include <errno.h>
#include <fcntl.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config/map_internal.h"

/* A growing output buffer; the first failure sticks. */
struct out {
    char *p;
    size_t len, cap;
    int err;
};

static void grow(struct out *o, size_t need)
{
    if (o->err || o->len + need + 1 <= o->cap)
        return;
    size_t cap = o->cap ? o->cap : 4096;
    while (cap < o->len + need + 1)
        cap *= 2;
    char *p = realloc(o->p, cap);
    if (!p) {
        o->err = STEPQ_ENOMEM;
        return;
    }
    o->p = p;
    o->cap = cap;
}

static void put(struct out *o, const char *s, size_t n)
{
    grow(o, n);
    if (o->err)
        return;
    memcpy(o->p + o->len, s, n);
    o->len += n;
    o->p[o->len] = '\0';
}

static void puts_(struct out *o, const char *s)
{
    put(o, s, strlen(s));
}

static void printf_(struct out *o, const char *fmt, ...) STEPQ__PRINTF(2, 3);

static void printf_(struct out *o, const char *fmt, ...)
{
    char tmp[128];
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof(tmp)) {
        o->err = o->err ? o->err : STEPQ_EINTERNAL;
        return;
    }
    put(o, tmp, (size_t)n);
}

/* A JSON string literal: escapes quote, backslash and control characters. */
static void put_string(struct out *o, const char *s)
{
    put(o, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            char e[2] = { '\\', (char)*p };
            put(o, e, 2);
        } else if (*p < 0x20) {
            printf_(o, "\\u%04x", *p);
        } else {
            put(o, (const char *)p, 1);
        }
    }
    put(o, "\"", 1);
}

/*
 * Shortest decimal that reads back as exactly the same double (or float).
 * Integral values print as integers. Runs under the "C" numeric locale (set
 * by the caller), so the decimal point is always '.'.
 */
static void put_double(struct out *o, double v)
{
    char buf[40];

    if (v == floor(v) && fabs(v) < 1e15) {
        printf_(o, "%.0f", v); /* "-0" for negative zero, which reads back as -0.0 */
        return;
    }
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof(buf), "%.*g", p, v);
        double r = strtod(buf, NULL);
        if (!memcmp(&r, &v, sizeof(v)) || p == 17)
            break;
    }
    puts_(o, buf);
}

static void put_float(struct out *o, float v)
{
    char buf[40];

    if (v == floorf(v) && fabsf(v) < 1e7f) {
        printf_(o, "%.0f", (double)v);
        return;
    }
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, sizeof(buf), "%.*g", p, (double)v);
        float r = (float)strtod(buf, NULL);
        if (!memcmp(&r, &v, sizeof(v)) || p == 9)
            break;
    }
    puts_(o, buf);
}

static void put_key(struct out *o, int indent, const char *key)
{
    printf_(o, "%*s\"%s\": ", indent, "", key);
}

static void write_model(struct out *o, const stepq_map_t *m)
{
    const stepq_model_shape *s = &m->shape;

    puts_(o, "  \"model\": {\n");
    if (m->model_name) {
        put_key(o, 4, "name");
        put_string(o, m->model_name);
        puts_(o, ",\n");
    }
    printf_(o, "    \"arch\": \"%s\",\n", stepq_arch_name(s->arch));
    puts_(o, "    \"recurrent_layers\": [");
    for (int i = 0; i < s->n_layers; i++)
        printf_(o, "%s%d", i ? ", " : "", s->layer_ids[i]);
    puts_(o, "],\n");
    printf_(o, "    \"num_k_heads\": %d,\n", s->num_k_heads);
    printf_(o, "    \"num_v_heads\": %d,\n", s->num_v_heads);
    printf_(o, "    \"head_k_dim\": %d,\n", s->head_k_dim);
    printf_(o, "    \"head_v_dim\": %d", s->head_v_dim);
    if (s->conv_rank > 0) {
        puts_(o, ",\n    \"conv_state\": {\"shape\": [");
        for (int i = 0; i < s->conv_rank; i++)
            printf_(o, "%s%lld", i ? ", " : "", (long long)s->conv_shape[i]);
        printf_(o, "], \"dtype\": \"%s\"}", stepq_dtype_name(s->conv_dtype));
    }
    puts_(o, "\n  }");
}

static void write_provenance(struct out *o, const stepq_map_t *m)
{
    bool any = m->n_candidates >= 0, first = true;

    for (int i = 0; i < STEPQ__PROV_STR_COUNT; i++)
        any |= m->prov_str[i] != NULL;
    for (int i = 0; i < STEPQ__PROV_NUM_COUNT; i++)
        any |= m->has_prov_num[i];
    if (!any)
        return;
    puts_(o, ",\n  \"provenance\": {");
    for (int i = 0; i < STEPQ__PROV_STR_COUNT; i++) {
        if (!m->prov_str[i])
            continue;
        puts_(o, first ? "\n" : ",\n");
        first = false;
        put_key(o, 4, stepq__prov_str_keys[i]);
        put_string(o, m->prov_str[i]);
    }
    for (int i = 0; i < STEPQ__PROV_NUM_COUNT; i++) {
        if (!m->has_prov_num[i])
            continue;
        puts_(o, first ? "\n" : ",\n");
        first = false;
        put_key(o, 4, stepq__prov_num_keys[i]);
        put_double(o, m->prov_num[i]);
    }
    if (m->n_candidates >= 0) {
        puts_(o, first ? "\n" : ",\n");
        put_key(o, 4, "candidates");
        puts_(o, "[");
        for (int i = 0; i < m->n_candidates; i++)
            printf_(o, "%s%d", i ? ", " : "", m->candidates[i]);
        puts_(o, "]");
    }
    puts_(o, "\n  }");
}

/* Statistics of one head: numbers (GDN) or arrays over its rows (KDA). */
static void write_stats(struct out *o, const stepq_map_t *m, const stepq_unit_stats *st, int rows)
{
    const bool arr = m->shape.arch == STEPQ_ARCH_KDA;

    puts_(o, ", \"stats\": {\"log_retention\": ");
    puts_(o, arr ? "[" : "");
    for (int r = 0; r < rows; r++) {
        puts_(o, r ? ", " : "");
        put_double(o, st[r].log_retention);
    }
    puts_(o, arr ? "], \"lambda\": [" : ", \"lambda\": ");
    for (int r = 0; r < rows; r++) {
        puts_(o, r ? ", " : "");
        put_double(o, st[r].lambda);
    }
    puts_(o, arr ? "], \"distortion\": {" : ", \"distortion\": {");
    bool first = true;
    for (int b = 2; b <= 8; b++) {
        if (st[0].distortion[b] < 0.0) /* the measured set is the same for every unit */
            continue;
        printf_(o, "%s\"%d\": %s", first ? "" : ", ", b, arr ? "[" : "");
        first = false;
        for (int r = 0; r < rows; r++) {
            puts_(o, r ? ", " : "");
            put_double(o, st[r].distortion[b]);
        }
        puts_(o, arr ? "]" : "");
    }
    puts_(o, "}}");
}

static void write_layers(struct out *o, const stepq_map_t *m)
{
    const stepq_model_shape *s = &m->shape;
    const bool kda = s->arch == STEPQ_ARCH_KDA;
    const int dk = s->head_k_dim;

    puts_(o, ",\n  \"layers\": [\n");
    for (int l = 0; l < s->n_layers && !o->err; l++) {
        const uint8_t *bits = m->bits + stepq__unit_index(m, l, 0);
        printf_(o, "    {\n      \"layer\": %d,\n      \"pivots\": [", s->layer_ids[l]);
        bool first = true;
        for (int u = 0; u < m->units_per_layer; u++) {
            if (bits[u] != STEPQ_BITS_PIVOT)
                continue;
            if (kda)
                printf_(o, "%s[%d, %d]", first ? "" : ", ", u / dk, u % dk);
            else
                printf_(o, "%s%d", first ? "" : ", ", u);
            first = false;
        }
        puts_(o, "],\n      \"heads\": [\n");
        for (int h = 0; h < s->num_v_heads; h++) {
            int base = kda ? h * dk : h;
            if (kda) {
                puts_(o, "        {\"row_bits\": [");
                for (int r = 0; r < dk; r++)
                    printf_(o, "%s%d", r ? ", " : "", bits[base + r]);
                puts_(o, "]");
            } else {
                printf_(o, "        {\"bits\": %d", bits[h]);
            }
            if (m->row_impact) {
                const float *w = m->row_impact + ((size_t)l * s->num_v_heads + h) * dk;
                puts_(o, ", \"row_impact\": [");
                for (int r = 0; r < dk; r++) {
                    puts_(o, r ? ", " : "");
                    put_float(o, w[r]);
                }
                puts_(o, "]");
            }
            if (m->stats)
                write_stats(o, m, m->stats + stepq__unit_index(m, l, base), kda ? dk : 1);
            puts_(o, h + 1 < s->num_v_heads ? "},\n" : "}\n");
        }
        puts_(o, l + 1 < s->n_layers ? "      ]\n    },\n" : "      ]\n    }\n");
    }
    puts_(o, "  ]");
}

int stepq_map_write_buffer(const stepq_map_t *h, char **out, size_t *len)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_write_buffer", &map);
        if (st_ < 0)
            return st_;
    }
    struct out o = { NULL, 0, 0, 0 };
    locale_t c_locale, old;
    int st;

    if (!map || !out)
        return stepq__error(STEPQ_EINVAL, "stepq_map_write_buffer: NULL argument");
    *out = NULL;
    if (len)
        *len = 0;
    if ((st = stepq__map_check(map)) < 0)
        return st;

    /* Numbers must not follow the host's LC_NUMERIC (a server may set one). */
    c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    if (c_locale == (locale_t)0)
        return stepq__error(STEPQ_ENOMEM, "stepq_map_write_buffer: cannot create the C locale");
    old = uselocale(c_locale);

    printf_(&o, "{\n  \"format\": \"%s\",\n  \"schema_version\": %d,\n", STEPQ__MAP_FORMAT,
            STEPQ__MAP_SCHEMA_VERSION);
    write_model(&o, map);
    printf_(&o, ",\n  \"method\": \"%s\",\n  \"budget_bits\": ", stepq_method_name(map->method));
    put_double(&o, map->budget_bits);
    if (map->row_split != STEPQ__ROW_SPLIT_DEFAULT) { /* the default is not written */
        puts_(&o, ",\n  \"row_split\": ");
        put_double(&o, map->row_split);
    }
    if (map->decode_fit != STEPQ_DECODE_FIT_EXACT) /* nor is the default fit */
        printf_(&o, ",\n  \"decode_fit\": \"%s\"", stepq_decode_fit_name(map->decode_fit));
    if (map->arith != STEPQ_ARITH_FP32) /* nor is the default arithmetic */
        printf_(&o, ",\n  \"arith\": \"%s\"", stepq_arith_name(map->arith));
    write_provenance(&o, map);
    if (stepq__method_has_units(map->method))
        write_layers(&o, map);
    puts_(&o, "\n}\n");

    uselocale(old);
    freelocale(c_locale);
    if (o.err) {
        free(o.p);
        return stepq__error(o.err, "stepq_map_write_buffer: %s", stepq_strerror(o.err));
    }
    *out = o.p;
    if (len)
        *len = o.len;
    return STEPQ_OK;
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int stepq_map_write_file(const stepq_map_t *h, const char *path)
{
    stepq_map_t *map;
    {
        int st_ = stepq__map_resolve(h, "stepq_map_write_file", &map);
        if (st_ < 0)
            return st_;
    }
    static atomic_uint counter;
    char *buf, *tmp;
    size_t len, tlen;
    int st, fd;

    if (!map || !path)
        return stepq__error(STEPQ_EINVAL, "stepq_map_write_file: NULL argument");
    if ((st = stepq_map_write_buffer(h, &buf, &len)) < 0)
        return st;
    /* A unique name in the same directory, so rename() is atomic. */
    tlen = strlen(path) + 64;
    tmp = malloc(tlen);
    if (!tmp) {
        free(buf);
        return stepq__error(STEPQ_ENOMEM, "stepq_map_write_file: out of memory");
    }
    snprintf(tmp, tlen, "%s.tmp.%ld.%u", path, (long)getpid(), atomic_fetch_add(&counter, 1));
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) {
        st = stepq__error(STEPQ_EIO, "%s: %s", tmp, strerror(errno));
        goto fail_open;
    }
    if (write_all(fd, buf, len) < 0 || fsync(fd) < 0) {
        st = stepq__error(STEPQ_EIO, "%s: %s", tmp, strerror(errno));
        close(fd);
        goto fail_write;
    }
    if (close(fd) < 0) {
        st = stepq__error(STEPQ_EIO, "%s: %s", tmp, strerror(errno));
        goto fail_write;
    }
    if (rename(tmp, path) < 0) {
        st = stepq__error(STEPQ_EIO, "%s: %s", path, strerror(errno));
        goto fail_write;
    }
    free(tmp);
    free(buf);
    return STEPQ_OK;

fail_write:
    unlink(tmp);
fail_open:
    free(tmp);
    free(buf);
    return st;
}
