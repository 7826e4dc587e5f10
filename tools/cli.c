/*
 * The commands' shared option parsing, progress reports, output files and
 * messages (tools/cli.h).
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "stepq/stepq.h"
#include "tools/cli.h"

/* --- number options ---------------------------------------------------------- */

int stepq_tool_int(const char *tool, const char *opt, const char *v, long long lo, long long hi,
                   long long *out)
{
    char *end;
    long long x;

    errno = 0;
    x = strtoll(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "stepq %s: %s '%s': want an integer in [%lld, %lld]\n", tool, opt, v, lo,
                hi);
        return -1;
    }
    *out = x;
    return 0;
}

int stepq_tool_real(const char *tool, const char *opt, const char *v, double lo, double hi,
                    int flags, double *out)
{
    int open_lo = flags & STEPQ_TOOL_OPEN_LO;
    char *end;
    double x;

    errno = 0;
    x = strtod(v, &end);
    /* Written so that NaN fails every test: each ordered comparison is false for it. */
    if (end == v || *end || !isfinite(x) || !(open_lo ? x > lo : x >= lo) || !(x <= hi)) {
        fprintf(stderr, "stepq %s: %s '%s': want a number in %c%g, %g]\n", tool, opt, v,
                open_lo ? '(' : '[', lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

int stepq_tool_decode_fit(const char *tool, const char *opt, const char *v, stepq_decode_fit *out)
{
    if (stepq_decode_fit_from_name(v, out) < 0) {
        fprintf(stderr, "stepq %s: %s: '%s' is not exact, norefit or rows\n", tool, opt, v);
        return -1;
    }
    return 0;
}

int stepq_tool_arith(const char *tool, const char *opt, const char *v, stepq_arith *out)
{
    if (stepq_arith_from_name(v, out) < 0) {
        fprintf(stderr, "stepq %s: %s: '%s' is not fp32 or fp16\n", tool, opt, v);
        return -1;
    }
    return 0;
}

/* --- progress on stderr ------------------------------------------------------ */

#define BAR_PERIOD_S   0.2 /* seconds between redraws of the bar: smooth, yet cheap */
#define LINE_PERIOD_S  5.0 /* seconds between plain lines: show life, yet keep a log short */
#define BAR_WIDTH      16  /* the whole bar line stays within 80 columns */
#define PROGRESS_OFF   0
#define PROGRESS_BAR   1
#define PROGRESS_LINES 2

static double now_s(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void fmt_amount(char *buf, size_t len, double x, const char *unit)
{
    if (strcmp(unit, "B") && x >= 1e5) /* large counts: 3 digits, as the bytes have */
        snprintf(buf, len, x >= 1e7 ? "%.1fM" : "%.2fM", x / 1e6);
    else if (strcmp(unit, "B") && x >= 1e4)
        snprintf(buf, len, "%.1fk", x / 1e3);
    else if (strcmp(unit, "B"))
        snprintf(buf, len, x < 10 && x != floor(x) ? "%.2g" : "%.0f", x); /* rates below 10/s */
    else if (x >= 1e9)
        snprintf(buf, len, "%.2f GB", x / 1e9);
    else if (x >= 1e6)
        snprintf(buf, len, "%.1f MB", x / 1e6);
    else
        snprintf(buf, len, "%.0f kB", x / 1e3);
}

static void fmt_time(char *buf, size_t len, double s)
{
    long t = (long)(s + 0.5);

    if (t >= 3600)
        snprintf(buf, len, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else
        snprintf(buf, len, "%ld:%02ld", t / 60, t % 60);
}

void stepq_tool_progress_begin(struct stepq_tool_progress *p, const char *tool, const char *unit,
                               int64_t total)
{
    const char *env = getenv("STEPQ_PROGRESS"), *iv = getenv("STEPQ_PROGRESS_INTERVAL");

    memset(p, 0, sizeof(*p));
    p->tool = tool;
    p->unit = unit;
    p->total = total > 0 ? total : 1;
    if (env && !strcmp(env, "off"))
        p->mode = PROGRESS_OFF;
    else if (env && !strcmp(env, "bar"))
        p->mode = PROGRESS_BAR;
    else if (env && !strcmp(env, "lines"))
        p->mode = PROGRESS_LINES;
    else
        p->mode = isatty(2) ? PROGRESS_BAR : PROGRESS_LINES;
    p->interval = p->mode == PROGRESS_BAR ? BAR_PERIOD_S : LINE_PERIOD_S;
    if (iv && *iv) {
        char *end;
        double x = strtod(iv, &end);
        if (!*end && x >= 0 && x <= 3600)
            p->interval = x;
    }
    p->t0 = now_s();
    p->next = p->t0 + p->interval;
    pthread_mutex_init(&p->lock, NULL);
}

static void progress_print(struct stepq_tool_progress *p, double t, int last)
{
    double el = t - p->t0, frac = (double)p->done / (double)p->total;
    double rate = el > 0 ? (double)p->done / el : 0;
    const char *u = strcmp(p->unit, "B") ? p->unit : "";
    char done[32], total[32], r[32], eta[32];

    if (frac > 1)
        frac = 1;
    fmt_amount(done, sizeof(done), (double)p->done, p->unit);
    fmt_amount(total, sizeof(total), (double)p->total, p->unit);
    fmt_amount(r, sizeof(r), rate, p->unit);
    if (rate > 0 && !last)
        fmt_time(eta, sizeof(eta), (double)(p->total - p->done) / rate);
    else
        snprintf(eta, sizeof(eta), "?");
    if (p->mode == PROGRESS_BAR) {
        char bar[BAR_WIDTH + 1];
        int fill = (int)(frac * BAR_WIDTH);

        for (int i = 0; i < BAR_WIDTH; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[BAR_WIDTH] = 0;
        fprintf(stderr, "\r\033[Kstepq %s [%s] %3.0f%% %s/%s%s%s, %s/s, ETA %s", p->tool, bar,
                100 * frac, done, total, *u ? " " : "", u, r, eta);
    } else if (last) {
        fmt_time(eta, sizeof(eta), el);
        fprintf(stderr, "stepq %s: %s/%s%s%s done in %s, %s%s%s/s\n", p->tool, done, total,
                *u ? " " : "", u, eta, r, *u ? " " : "", u);
    } else {
        fprintf(stderr, "stepq %s: %s/%s%s%s (%.0f%%), %s%s%s/s, ETA %s\n", p->tool, done, total,
                *u ? " " : "", u, 100 * frac, r, *u ? " " : "", u, eta);
    }
    fflush(stderr);
    p->printed = 1;
}

static void progress_maybe(struct stepq_tool_progress *p)
{
    double t = now_s();

    if (t < p->next)
        return;
    p->next = t + p->interval;
    progress_print(p, t, 0);
}

void stepq_tool_progress_add(struct stepq_tool_progress *p, int64_t n)
{
    if (p->mode == PROGRESS_OFF)
        return;
    pthread_mutex_lock(&p->lock);
    p->done += n;
    progress_maybe(p);
    pthread_mutex_unlock(&p->lock);
}

void stepq_tool_progress_set(struct stepq_tool_progress *p, int64_t done)
{
    if (p->mode == PROGRESS_OFF)
        return;
    pthread_mutex_lock(&p->lock);
    p->done = done;
    progress_maybe(p);
    pthread_mutex_unlock(&p->lock);
}

void stepq_tool_progress_end(struct stepq_tool_progress *p)
{
    if (p->mode == PROGRESS_BAR && p->printed)
        fputs("\r\033[K", stderr);
    else if (p->mode == PROGRESS_LINES && p->printed)
        progress_print(p, now_s(), 1);
    if (p->tool) /* once: a second end finds tool NULL */
        pthread_mutex_destroy(&p->lock);
    p->tool = NULL;
    p->mode = PROGRESS_OFF;
}

/* --- input files ------------------------------------------------------------- */

static int json_file_fail(const char *tool, const char *opt, const char *path, const char *problem)
{
    fprintf(stderr, "stepq %s: %s %s: %s\n", tool, opt, path, problem);
    return 2;
}

int stepq_tool_json_file(const char *tool, const char *opt, const char *path, size_t max_bytes,
                         struct cJSON **out)
{
    char msg[256];
    FILE *f = fopen(path, "rb");

    *out = NULL;
    if (!f) {
        snprintf(msg, sizeof(msg), "cannot open it: %s", strerror(errno));
        return json_file_fail(tool, opt, path, msg);
    }
    char *buf = malloc(max_bytes + 1);
    size_t n = buf ? fread(buf, 1, max_bytes + 1, f) : 0;
    int rd_err = ferror(f) ? errno : 0;
    fclose(f);
    if (!buf)
        return json_file_fail(tool, opt, path, "out of memory");
    if (rd_err || n > max_bytes) {
        free(buf);
        if (rd_err)
            snprintf(msg, sizeof(msg), "cannot read it: %s", strerror(rd_err));
        else
            snprintf(msg, sizeof(msg), "larger than %zu kB: not a file %s reads", max_bytes >> 10,
                     opt);
        return json_file_fail(tool, opt, path, msg);
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, n, &end, 0);
    if (!root)
        snprintf(msg, sizeof(msg), "not valid JSON (at byte %td of %zu)", end ? end - buf : 0, n);
    free(buf);
    if (!root)
        return json_file_fail(tool, opt, path, msg);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return json_file_fail(tool, opt, path, "not a JSON object");
    }
    *out = root;
    return 0;
}

/* --- output files ------------------------------------------------------------ */

/*
 * The temporary files that exist now, for the signal handler: fixed buffers,
 * as a handler may only call async-signal-safe functions (unlink, raise).
 */
#define MAX_TMP 16
static char tmp_names[MAX_TMP][4096];
static volatile sig_atomic_t tmp_live[MAX_TMP];

static void on_signal(int sig)
{
    for (int i = 0; i < MAX_TMP; i++)
        if (tmp_live[i])
            unlink(tmp_names[i]);
    signal(sig, SIG_DFL);
    raise(sig);
}

static void install_handlers(void)
{
    static int installed;
    static const int sigs[] = { SIGINT, SIGTERM, SIGHUP };

    if (installed)
        return;
    installed = 1;
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
        struct sigaction sa, old;

        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        /* A signal the caller ignores (nohup) stays ignored. */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN)
            sigaction(sigs[i], &sa, NULL);
    }
}

int stepq_tool_out_reserve(struct stepq_tool_out *o, const char *tool, const char *path)
{
    static atomic_uint counter;

    memset(o, 0, sizeof(*o));
    o->slot = -1;
    if (!path || !strcmp(path, "-"))
        return 0;
    o->path = path;
    /* A target that exists and is not a regular file (/dev/null, a FIFO) is written in place:
     * renaming over it would replace the device or pipe with a file. */
    struct stat sb;
    if (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        o->direct = 1;
        snprintf(o->tmp, sizeof(o->tmp), "%s", path);
        return 0;
    }
    if (snprintf(o->tmp, sizeof(o->tmp), "%s.tmp.%ld.%u", path, (long)getpid(),
                 atomic_fetch_add(&counter, 1)) >= (int)sizeof(o->tmp)) {
        fprintf(stderr, "stepq %s: %s: path too long\n", tool, path);
        return -1;
    }
    install_handlers();
    for (int i = 0; i < MAX_TMP; i++)
        if (!tmp_live[i]) {
            memcpy(tmp_names[i], o->tmp, sizeof(o->tmp));
            tmp_live[i] = 1;
            o->slot = i;
            break;
        }
    return 0;
}

FILE *stepq_tool_out_open(struct stepq_tool_out *o, const char *tool, const char *path)
{
    if (stepq_tool_out_reserve(o, tool, path) < 0)
        return NULL;
    if (!o->path)
        return o->f = stdout;
    if (!(o->f = fopen(o->direct ? o->path : o->tmp, "w"))) {
        stepq_tool_path_error(tool, o->path, NULL, strerror(errno), 0);
        stepq_tool_out_discard(o);
        return NULL;
    }
    return o->f;
}

static void release(struct stepq_tool_out *o)
{
    if (o->slot >= 0)
        tmp_live[o->slot] = 0;
    o->slot = -1;
    o->tmp[0] = 0;
}

int stepq_tool_out_commit(struct stepq_tool_out *o, const char *tool)
{
    int bad = 0, e = 0;

    if (o->f) {
        bad = fflush(o->f) != 0 || ferror(o->f);
        e = errno;
        if (o->f != stdout && fclose(o->f) != 0 && !bad) {
            bad = 1;
            e = errno;
        }
        o->f = NULL;
    }
    if (!o->path)
        return bad ? (fprintf(stderr, "stepq %s: standard output: %s\n", tool,
                              strerror(e ? e : EIO)),
                      -1)
                   : 0;
    if (!bad && !o->direct && rename(o->tmp, o->path) < 0) {
        bad = 1;
        e = errno;
    }
    if (bad) {
        stepq_tool_path_error(tool, o->path, NULL, strerror(e ? e : EIO), 0);
        stepq_tool_out_discard(o);
        return -1;
    }
    release(o);
    return 0;
}

void stepq_tool_out_discard(struct stepq_tool_out *o)
{
    if (o->f && o->f != stdout)
        fclose(o->f);
    o->f = NULL;
    if (o->path && o->tmp[0] && !o->direct)
        unlink(o->tmp);
    release(o);
}

/* --- messages ---------------------------------------------------------------- */

void stepq_tool_path_error(const char *tool, const char *path, const char *tmp, const char *detail,
                           int status)
{
    char buf[8192];
    size_t pl = strlen(path), tl = tmp && *tmp ? strlen(tmp) : 0, n = 0;

    /* The detail with every occurrence of the temporary name replaced by the target's. */
    for (const char *s = detail; *s && n + pl + 1 < sizeof(buf);) {
        if (tl && !strncmp(s, tmp, tl)) {
            memcpy(buf + n, path, pl);
            n += pl;
            s += tl;
        } else {
            buf[n++] = *s++;
        }
    }
    buf[n] = 0;
    const char *d = buf;
    if (!strncmp(d, path, pl) && d[pl] == ':' && d[pl + 1] == ' ')
        d += pl + 2;
    fprintf(stderr, "stepq %s: %s: %s", tool, path, d);
    if (status < 0)
        fprintf(stderr, " (%s)", stepq_status_name(status));
    fputc('\n', stderr);
}

int stepq_tool_threads(const char *tool, int want, int n_jobs, const char *jobs_name)
{
    if (n_jobs < 1)
        n_jobs = 1;
    if (want <= n_jobs)
        return want;
    fprintf(stderr, "stepq %s: --threads %d: %d %s to share, using %d threads\n", tool, want,
            n_jobs, jobs_name, n_jobs);
    return n_jobs;
}

void stepq_tool_json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\')
            fprintf(f, "\\%c", *c);
        else if (*c < 0x20)
            fprintf(f, "\\u%04x", *c);
        else
            fputc(*c, f);
    }
    fputc('"', f);
}

void stepq_tool_printf(FILE *f, const char *fmt, ...)
{
    va_list ap;

    if (!f)
        return;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
}
