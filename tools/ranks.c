/*
 * One process per rank on one libuv loop: a uv_process_t per rank with two
 * pipes (its standard output, collected; its standard error, passed through
 * line by line with the rank's prefix) and one timer (the run's timeout,
 * then the grace period between SIGTERM and SIGKILL once a rank failed).
 * The loop ends when every handle is closed: every process reaped and every
 * pipe at EOF, so no rank outlives the call.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "tools/ranks.h"

/* A line of a rank's standard error longer than this is passed on in pieces. */
#define ERR_LINE_MAX 1024

struct run;

struct proc {
    struct run *run;
    int rank;
    uv_process_t handle;
    uv_pipe_t out, err;
    int started, running;
    int64_t status;
    int signal;
    char *buf; /* standard output so far */
    size_t len, cap;
    char line[ERR_LINE_MAX]; /* the standard error line being read */
    size_t line_len;
    char last[ERR_LINE_MAX]; /* the last complete non-empty line */
    int oom;
};

struct run {
    const char *tool;
    uv_loop_t loop;
    uv_timer_t timer;
    struct proc *p;
    int n, running;
    int failed;    /* the first rank that failed, -1 */
    int timed_out; /* the timeout passed first */
    int stopping;  /* SIGTERM sent: exits by a signal from now on are ours */
    int killed;    /* SIGKILL sent */
    double timeout_s;
};

int stepq_tool_self_exe(const char *tool, char *buf, size_t len)
{
    size_t size = len;
    int e = uv_exepath(buf, &size);

    if (e < 0 || size >= len) {
        fprintf(stderr, "stepq %s: cannot find this executable's path: %s\n", tool,
                e < 0 ? uv_strerror(e) : "too long");
        return -1;
    }
    return 0;
}

static void signal_all(struct run *r, int sig)
{
    for (int i = 0; i < r->n; i++)
        if (r->p[i].running)
            uv_process_kill(&r->p[i].handle, sig);
}

static void on_grace(uv_timer_t *t)
{
    struct run *r = t->data;

    r->killed = 1;
    signal_all(r, SIGKILL);
}

/* Stops every rank still running: SIGTERM now, SIGKILL after the grace period. */
static void stop_all(struct run *r)
{
    if (r->stopping)
        return;
    r->stopping = 1;
    signal_all(r, SIGTERM);
    uv_timer_stop(&r->timer);
    if (r->running)
        uv_timer_start(&r->timer, on_grace, STEPQ_TOOL_RANKS_GRACE_S * 1000, 0);
}

static void on_timeout(uv_timer_t *t)
{
    struct run *r = t->data;

    r->timed_out = 1;
    stop_all(r);
}

static void on_close(uv_handle_t *h)
{
    (void)h;
}

static void on_exit_cb(uv_process_t *h, int64_t status, int sig)
{
    struct proc *p = h->data;
    struct run *r = p->run;

    p->running = 0;
    p->status = status;
    p->signal = sig;
    r->running--;
    uv_close((uv_handle_t *)h, on_close);
    /* A rank that ends badly before the others were told to stop is the failure to report. */
    if ((status || sig) && !r->stopping && r->failed < 0) {
        r->failed = p->rank;
        stop_all(r);
    }
    if (!r->running)
        uv_close((uv_handle_t *)&r->timer, on_close);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)h;
    buf->base = malloc(suggested);
    buf->len = buf->base ? suggested : 0;
}

static void on_out(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    struct proc *p = s->data;

    if (nread > 0) {
        if (p->len + (size_t)nread + 1 > p->cap) {
            size_t cap = 2 * (p->len + (size_t)nread + 1);
            char *b = realloc(p->buf, cap);
            if (!b)
                p->oom = 1;
            else
                p->buf = b, p->cap = cap;
        }
        if (!p->oom) {
            memcpy(p->buf + p->len, buf->base, (size_t)nread);
            p->len += (size_t)nread;
            p->buf[p->len] = 0;
        }
    } else if (nread < 0) {
        uv_close((uv_handle_t *)s, on_close);
    }
    free(buf->base);
}

/* One line of a rank's standard error: passed on with the prefix, and kept as its last. */
static void err_line(struct proc *p)
{
    p->line[p->line_len] = 0;
    fprintf(stderr, "[rank %d] %s\n", p->rank, p->line);
    if (p->line_len)
        memcpy(p->last, p->line, p->line_len + 1);
    p->line_len = 0;
}

static void on_err(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    struct proc *p = s->data;

    for (ssize_t i = 0; i < nread; i++) {
        const char c = buf->base[i];
        if (c == '\n' || c == '\r') {
            /* a progress bar's carriage returns: its lines, not blank ones */
            if (c == '\n' || p->line_len)
                err_line(p);
        } else {
            p->line[p->line_len++] = c;
            if (p->line_len == sizeof(p->line) - 1)
                err_line(p);
        }
    }
    if (nread < 0) {
        if (p->line_len)
            err_line(p);
        uv_close((uv_handle_t *)s, on_close);
    }
    free(buf->base);
}

static int spawn(struct run *r, struct proc *p, char **argv, const char *exe)
{
    uv_process_options_t opt;
    uv_stdio_container_t io[3];
    int e;

    memset(&opt, 0, sizeof(opt));
    uv_pipe_init(&r->loop, &p->out, 0);
    uv_pipe_init(&r->loop, &p->err, 0);
    p->out.data = p->err.data = p->handle.data = p;
    io[0].flags = UV_IGNORE;
    io[1].flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE;
    io[1].data.stream = (uv_stream_t *)&p->out;
    io[2].flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE;
    io[2].data.stream = (uv_stream_t *)&p->err;
    opt.file = exe;
    opt.args = argv;
    opt.exit_cb = on_exit_cb;
    opt.stdio = io;
    opt.stdio_count = 3;
    if ((e = uv_spawn(&r->loop, &p->handle, &opt)) < 0) {
        /* uv_spawn leaves the process handle to be closed, and the pipes never opened */
        uv_close((uv_handle_t *)&p->handle, on_close);
        uv_close((uv_handle_t *)&p->out, on_close);
        uv_close((uv_handle_t *)&p->err, on_close);
        return e;
    }
    p->started = p->running = 1;
    r->running++;
    uv_read_start((uv_stream_t *)&p->out, on_alloc, on_out);
    uv_read_start((uv_stream_t *)&p->err, on_alloc, on_err);
    return 0;
}

/* The last line of a rank's standard error without the "stepq TOOL: " it starts with. */
static const char *last_text(const struct run *r, const struct proc *p)
{
    char head[128];
    const size_t n = (size_t)snprintf(head, sizeof(head), "stepq %s: ", r->tool);

    if (!p->last[0])
        return "(nothing on stderr)";
    return strncmp(p->last, head, n) ? p->last : p->last + n;
}

int stepq_tool_ranks_run(const char *tool, struct stepq_tool_rank *ranks, int n, double timeout_s)
{
    char exe[4096];
    struct run r;
    int e, ret = -1;

    memset(&r, 0, sizeof(r));
    r.tool = tool;
    r.n = n;
    r.failed = -1;
    r.timeout_s = timeout_s;
    if (stepq_tool_self_exe(tool, exe, sizeof(exe)) < 0)
        return -1;
    if (!(r.p = calloc((size_t)n, sizeof(*r.p)))) {
        fprintf(stderr, "stepq %s: out of memory\n", tool);
        return -1;
    }
    if ((e = uv_loop_init(&r.loop)) < 0) {
        fprintf(stderr, "stepq %s: uv_loop_init: %s\n", tool, uv_strerror(e));
        goto fail_loop;
    }
    uv_timer_init(&r.loop, &r.timer);
    r.timer.data = &r;
    int spawn_failed = -1, spawn_err = 0;
    for (int i = 0; i < n; i++) {
        r.p[i].run = &r;
        r.p[i].rank = i;
        ranks[i].argv[0] = exe;
        if ((e = spawn(&r, &r.p[i], ranks[i].argv, exe)) < 0) {
            spawn_failed = i, spawn_err = e;
            break;
        }
        ranks[i].pid = r.p[i].handle.pid;
    }
    if (spawn_failed >= 0)
        stop_all(&r);
    else if (timeout_s > 0)
        uv_timer_start(&r.timer, on_timeout, (uint64_t)(timeout_s * 1000), 0);
    if (!r.running)
        uv_close((uv_handle_t *)&r.timer, on_close);
    uv_run(&r.loop, UV_RUN_DEFAULT);

    if (spawn_failed >= 0) {
        fprintf(stderr, "stepq %s: rank %d: cannot start %s: %s\n", tool, spawn_failed, exe,
                uv_strerror(spawn_err));
    } else if (r.failed >= 0) {
        const struct proc *p = &r.p[r.failed];
        if (p->signal)
            fprintf(stderr, "stepq %s: rank %d died (signal %d)%s%s\n", tool, p->rank, p->signal,
                    p->last[0] ? ": " : "", p->last[0] ? last_text(&r, p) : "");
        else
            fprintf(stderr, "stepq %s: rank %d exited with status %d: %s\n", tool, p->rank,
                    (int)p->status, last_text(&r, p));
    } else if (r.timed_out) {
        fprintf(stderr, "stepq %s: --timeout-s %g passed: every rank stopped%s\n", tool, timeout_s,
                r.killed ? " (SIGKILL after the grace period)" : "");
    } else {
        ret = 0;
        for (int i = 0; i < n && ret == 0; i++)
            if (r.p[i].oom) {
                fprintf(stderr, "stepq %s: rank %d: out of memory for its output\n", tool, i);
                ret = -1;
            }
    }
    for (int i = 0; i < n; i++) {
        ranks[i].argv[0] = NULL;
        ranks[i].out = r.p[i].buf;
        ranks[i].out_len = r.p[i].len;
    }
    uv_loop_close(&r.loop);
fail_loop:
    free(r.p);
    return ret;
}
