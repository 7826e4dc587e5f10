/*
 * stepq capacity MAP: serving memory against batch size (the paper's
 * Figure 1a accounting).
 *
 *   state pool bytes = (policy_slots x B + 1) x S
 *
 * S is one aggregate persistent-state slot of one model replica: the pool's
 * page for this map (head blocks as allocated, which for stepq/temporal maps
 * reserve the pivot heads' scale slots, i.e. the paper's "analytical" count;
 * plus the conv state), summed over tensor-parallel ranks after padding every
 * rank to the largest page. --slot compact uses compact state bytes + conv
 * instead. The FP32 slot of the same shape is printed alongside.
 * total = weights + state pool + KV (kv_bytes_per_token x context x B).
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cJSON.h>

#include "stepq_config.h"

#include "stepq/map.h"
#include "stepq/pool.h"
#include "stepq/tp.h"
#include "tools/cli.h"
#include "tools/commands.h"

extern char **environ;

#define MAX_BATCHES 64
#define GIB         (1024.0 * 1024.0 * 1024.0)
#define MIB         (1024.0 * 1024.0)

static void capacity_usage(FILE *f)
{
    fprintf(f, "usage: stepq capacity MAP [--batch 1,8,64,512] [--policy extra_buffer] [--tp N]\n"
               "                      [--weights-bytes N] [--kv-bytes-per-token N --context L]\n"
               "                      [--slot page|compact] [--json] [-o FILE]\n"
               "                      [--plot FILE.png|FILE.svg]\n"
               "State pool memory against batch size B: (policy_slots x B + 1) x S, S the\n"
               "per-replica slot (the pool page of MAP summed over --tp ranks, conv state\n"
               "included). Policies: no_cache 1, no_buffer 3, lazy 4, extra_buffer 5 slots per\n"
               "request. --tp N also prints the page of each GPU (every rank padded to the\n"
               "largest) and its TP padding per GPU and per replica. --plot draws the map\n"
               "and FP32 curves with the weights as a line\n"
               "(needs python3 with matplotlib; STEPQ_PYTHON / STEPQ_PLOT_SCRIPT override).\n"
               "--json: the numbers as JSON; -o: what goes to stdout into FILE.\n");
}

struct slot {
    uint64_t bytes; /* S */
    uint64_t state, compact, conv, pad;
    /* Per GPU: every rank's page (the largest rank's) and each rank's TP padding in it. */
    uint64_t page, tp_pad;
    int largest_rank;
    uint64_t *rank_tp_pad; /* [tp] */
};

/* a + b, or -1 where the sum does not fit 64 bits. */
static int add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return __builtin_add_overflow(a, b, out) ? -1 : 0;
}

/*
 * S of a map for tp ranks: every rank padded to the largest page
 * (stepq_tp_plan), summed. 1 (after a message) where a sum passes 2^64
 * bytes or tp does not split the map; otherwise 0 or a negative status.
 */
static int slot_of(const stepq_map_t *map, int tp, int compact_only, struct slot *out)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_tp_plan_info p;
    stepq_model_shape shape;
    stepq_tp_shard_info sh;
    int ret;

    memset(out, 0, sizeof(*out));
    cfg.map = map;
    cfg.tp_size = tp;
    cfg.num_slots = 1;
    if ((ret = stepq_map_shape(map, &shape)) < 0)
        return ret;
    if (stepq_tp_shard(&shape, tp, 0, &sh, sizeof(sh)) < 0) {
        fprintf(stderr, "stepq capacity: --tp %d: %s\n", tp, stepq_last_error());
        return 1;
    }
    out->rank_tp_pad = calloc((size_t)tp, sizeof(*out->rank_tp_pad));
    if (!out->rank_tp_pad)
        return STEPQ_ENOMEM;
    for (int r = 0; r < tp; r++) {
        cfg.tp_rank = r;
        ret = stepq_tp_plan(&cfg, &p, sizeof(p));
        if (ret == STEPQ_ERANGE)
            goto wraps;
        if (ret < 0)
            return ret;
        out->rank_tp_pad[r] = p.tp_pad_bytes;
    }
    out->bytes = p.replica_page_bytes;
    out->state = p.replica_state_bytes;
    out->compact = p.replica_state_bytes_compact;
    out->conv = p.replica_conv_bytes;
    out->pad = p.replica_pad_bytes;
    out->tp_pad = p.replica_tp_pad_bytes;
    out->page = p.page_bytes;
    out->largest_rank = p.largest_rank;
    if (compact_only && add_u64(out->compact, out->conv, &out->bytes) < 0)
        goto wraps;
    return STEPQ_OK;
wraps:
    fprintf(stderr, "stepq capacity: --tp %d: one slot over the ranks is more than 2^64 bytes\n",
            tp);
    return 1;
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;

    errno = 0;
    if (!s || !*s || *s == '-')
        return -1;
    *out = strtoull(s, &end, 10);
    return errno || *end ? -1 : 0;
}

/* a * b, or -1 where the product does not fit 64 bits. */
static int mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}

static int parse_batches(const char *s, int *b, int *n)
{
    *n = 0;
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);

        if (end == s || v < 1 || v > 1 << 24 || *n == MAX_BATCHES || (*end && *end != ','))
            return -1;
        b[(*n)++] = (int)v;
        s = *end ? end + 1 : end;
    }
    return *n > 0 ? 0 : -1;
}

static const char *plot_script(char *buf, size_t len)
{
    const char *env = getenv("STEPQ_PLOT_SCRIPT");

    if (env && *env)
        return env;
    snprintf(buf, len, "%s/tools/scripts/plot.py", STEPQ_SOURCE_ROOT);
    if (access(buf, R_OK) == 0)
        return buf;
    snprintf(buf, len, "%s/plot.py", STEPQ_DATADIR);
    return buf;
}

/* Runs `python3 plot.py` with the spec on its stdin; 0 when it succeeded. */
static int run_plot(const char *spec)
{
    char script_buf[4096];
    const char *script = plot_script(script_buf, sizeof(script_buf));
    const char *py = getenv("STEPQ_PYTHON");
    char *argv[3];
    posix_spawn_file_actions_t fa;
    void (*old_pipe)(int);
    size_t len = strlen(spec), off = 0;
    int fds[2], status = 0, ret;
    pid_t pid;

    if (!py || !*py)
        py = STEPQ_PYTHON;
    argv[0] = (char *)py;
    argv[1] = (char *)script;
    argv[2] = NULL;
    if (pipe(fds)) {
        perror("stepq capacity: pipe");
        return -1;
    }
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[0], 0);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    posix_spawn_file_actions_addclose(&fa, fds[1]);
    ret = posix_spawnp(&pid, py, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[0]);
    if (ret) {
        fprintf(stderr, "stepq capacity: cannot run %s: %s\n", py, strerror(ret));
        close(fds[1]);
        return -1;
    }
    /* A plotter that dies early must not kill us with SIGPIPE. */
    old_pipe = signal(SIGPIPE, SIG_IGN);
    while (off < len) {
        ssize_t w = write(fds[1], spec + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    close(fds[1]);
    signal(SIGPIPE, old_pipe);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "stepq capacity: %s %s failed (exit status %d)\n", py, script,
                WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        return -1;
    }
    return 0;
}

static cJSON *gib_array(const double *v, int n)
{
    cJSON *a = cJSON_CreateArray();

    for (int i = 0; i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i] / GIB));
    return a;
}

static void add_series(cJSON *series, const char *label, const double *v, int n, const char *style)
{
    cJSON *s = cJSON_CreateObject();

    cJSON_AddStringToObject(s, "label", label);
    cJSON_AddItemToObject(s, "y", gib_array(v, n));
    cJSON_AddStringToObject(s, "style", style);
    cJSON_AddItemToArray(series, s);
}

int stepq_tool_capacity(int argc, char **argv)
{
    const char *path = NULL, *plot = NULL, *policy_name = "extra_buffer", *out_path = NULL;
    struct stepq_tool_out out;
    FILE *f = NULL;
    int batches[MAX_BATCHES] = { 1, 8, 64, 512 }, n_b = 4, json = 0, tp = 1, compact = 0;
    int tp_given = 0; /* --tp adds the per-GPU page and its TP padding to the output */
    uint64_t weights = 0, kv_per_token = 0, context = 0;
    int have_kv = 0, have_ctx = 0, per, ret, rc = 1;
    stepq_pool_policy policy;
    stepq_map_t *map = NULL, *fp32 = NULL;
    stepq_model_shape shape;
    struct slot s_map = { 0 }, s_fp32 = { 0 };
    double state[MAX_BATCHES], state32[MAX_BATCHES], total[MAX_BATCHES], total32[MAX_BATCHES];
    uint64_t slots[MAX_BATCHES], kv[MAX_BATCHES];
    char label[256];

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;

        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            capacity_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        } else if (a[0] != '-') {
            if (path) {
                fprintf(stderr, "stepq capacity: a second MAP '%s'\n", a);
                return 2;
            }
            path = a;
            continue;
        }
        if (!v) {
            static const char *const value_opts[] = {
                "--batch", "--context", "--kv-bytes-per-token", "--plot", "--policy",
                "--slot",  "--tp",      "--weights-bytes",      "-o",     NULL
            };
            return stepq_tool_missing_value("capacity", a, value_opts);
        }
        i++;
        if (!strcmp(a, "--batch")) {
            if (parse_batches(v, batches, &n_b)) {
                fprintf(stderr,
                        "stepq capacity: --batch '%s': want positive integers, e.g. "
                        "1,8,64,512\n",
                        v);
                return 2;
            }
        } else if (!strcmp(a, "--policy")) {
            policy_name = v;
        } else if (!strcmp(a, "--tp")) {
            uint64_t t;
            if (parse_u64(v, &t) || t < 1 || t > 1024) {
                fprintf(stderr, "stepq capacity: --tp '%s': want 1..1024\n", v);
                return 2;
            }
            tp = (int)t;
            tp_given = 1;
        } else if (!strcmp(a, "--weights-bytes")) {
            if (parse_u64(v, &weights)) {
                fprintf(stderr, "stepq capacity: --weights-bytes '%s': want bytes\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--kv-bytes-per-token")) {
            if (parse_u64(v, &kv_per_token)) {
                fprintf(stderr, "stepq capacity: --kv-bytes-per-token '%s': want bytes\n", v);
                return 2;
            }
            have_kv = 1;
        } else if (!strcmp(a, "--context")) {
            if (parse_u64(v, &context)) {
                fprintf(stderr, "stepq capacity: --context '%s': want tokens\n", v);
                return 2;
            }
            have_ctx = 1;
        } else if (!strcmp(a, "--slot")) {
            if (strcmp(v, "page") && strcmp(v, "compact")) {
                fprintf(stderr, "stepq capacity: --slot '%s': page or compact\n", v);
                return 2;
            }
            compact = !strcmp(v, "compact");
        } else if (!strcmp(a, "--plot")) {
            plot = v;
        } else if (!strcmp(a, "-o")) {
            out_path = v;
        } else {
            fprintf(stderr, "stepq capacity: unknown option '%s'\n", a);
            capacity_usage(stderr);
            return 2;
        }
    }
    if (!path) {
        capacity_usage(stderr);
        return 2;
    }
    if (have_kv != have_ctx) {
        fprintf(stderr, "stepq capacity: --kv-bytes-per-token and --context go together\n");
        return 2;
    }
    if (stepq_pool_policy_from_name(policy_name, &policy) < 0) {
        fprintf(stderr, "stepq capacity: --policy: %s\n", stepq_last_error());
        return 2;
    }
    per = stepq_pool_policy_slots(policy);

    if ((ret = stepq_map_load_file(path, NULL, &map)) < 0) {
        stepq_tool_path_error("capacity", path, NULL, stepq_last_error(), ret);
        return 1;
    }
    if ((ret = stepq_map_shape(map, &shape)) < 0 ||
        (ret = stepq_map_create(&shape, STEPQ_METHOD_FP32, 32.0, &fp32)) < 0 ||
        (ret = slot_of(map, tp, compact, &s_map)) != 0 ||
        (ret = slot_of(fp32, tp, compact, &s_fp32)) != 0) {
        if (ret > 0) { /* slot_of said why */
            rc = 2;
            goto out;
        }
        fprintf(stderr, "stepq capacity: %s: %s (%s)\n", path, stepq_last_error(),
                stepq_status_name(ret));
        goto out;
    }

    for (int i = 0; i < n_b; i++) {
        uint64_t kv_tok = 0, pool = 0, pool32 = 0;
        /* per <= 5 and a batch <= 2^24: the slot count cannot wrap; the byte counts can. */
        slots[i] = (uint64_t)per * (uint64_t)batches[i] + 1;
        if (mul_u64(kv_per_token, context, &kv_tok) < 0 ||
            mul_u64(kv_tok, (uint64_t)batches[i], &kv[i]) < 0) {
            fprintf(stderr,
                    "stepq capacity: --kv-bytes-per-token %" PRIu64 " x --context %" PRIu64
                    " x --batch %d is more than 2^64 bytes\n",
                    kv_per_token, context, batches[i]);
            rc = 2;
            goto out;
        }
        if (mul_u64(slots[i], s_map.bytes, &pool) < 0 ||
            mul_u64(slots[i], s_fp32.bytes, &pool32) < 0) {
            const int map_wraps = mul_u64(slots[i], s_map.bytes, &pool) < 0;
            fprintf(stderr,
                    "stepq capacity: --batch %d with --policy %s: %" PRIu64 " slots x %" PRIu64
                    " B (the %s slot) is more than 2^64 bytes\n",
                    batches[i], stepq_pool_policy_name(policy), slots[i],
                    map_wraps ? s_map.bytes : s_fp32.bytes, map_wraps ? "map's" : "fp32");
            rc = 2;
            goto out;
        }
        state[i] = (double)pool;
        state32[i] = (double)pool32;
        total[i] = (double)weights + state[i] + (double)kv[i];
        total32[i] = (double)weights + state32[i] + (double)kv[i];
    }
    if (!(f = stepq_tool_out_open(&out, "capacity", out_path)))
        goto out;
    snprintf(label, sizeof(label), "%s %s@%g", stepq_map_model_name(map),
             stepq_method_name(stepq_map_method(map)), stepq_map_budget_bits(map));

    if (json) {
        cJSON *root = cJSON_CreateObject(), *rows = cJSON_CreateArray();
        char *text;

        cJSON_AddStringToObject(root, "map", path);
        cJSON_AddStringToObject(root, "method", stepq_method_name(stepq_map_method(map)));
        cJSON_AddStringToObject(root, "policy", stepq_pool_policy_name(policy));
        cJSON_AddNumberToObject(root, "policy_slots", per);
        cJSON_AddNumberToObject(root, "tp", tp);
        cJSON_AddStringToObject(root, "slot", compact ? "compact" : "page");
        cJSON_AddNumberToObject(root, "slot_bytes", (double)s_map.bytes);
        cJSON_AddNumberToObject(root, "slot_state_bytes", (double)s_map.state);
        cJSON_AddNumberToObject(root, "slot_state_compact_bytes", (double)s_map.compact);
        cJSON_AddNumberToObject(root, "slot_conv_bytes", (double)s_map.conv);
        cJSON_AddNumberToObject(root, "slot_pad_bytes", (double)s_map.pad);
        cJSON_AddNumberToObject(root, "fp32_slot_bytes", (double)s_fp32.bytes);
        if (tp_given) {
            cJSON *pads = cJSON_CreateArray();

            cJSON_AddNumberToObject(root, "tp_page_bytes_per_gpu", (double)s_map.page);
            cJSON_AddNumberToObject(root, "tp_largest_rank", s_map.largest_rank);
            for (int r = 0; r < tp; r++)
                cJSON_AddItemToArray(pads, cJSON_CreateNumber((double)s_map.rank_tp_pad[r]));
            cJSON_AddItemToObject(root, "tp_pad_bytes_per_gpu", pads);
            cJSON_AddNumberToObject(root, "tp_pad_bytes_per_replica", (double)s_map.tp_pad);
        }
        cJSON_AddNumberToObject(root, "weights_bytes", (double)weights);
        cJSON_AddNumberToObject(root, "kv_bytes_per_token", (double)kv_per_token);
        cJSON_AddNumberToObject(root, "context", (double)context);
        for (int i = 0; i < n_b; i++) {
            cJSON *r = cJSON_CreateObject();

            cJSON_AddNumberToObject(r, "batch", batches[i]);
            cJSON_AddNumberToObject(r, "slots", (double)slots[i]);
            cJSON_AddNumberToObject(r, "slot_bytes", (double)s_map.bytes);
            cJSON_AddNumberToObject(r, "state_pool_bytes", state[i]);
            cJSON_AddNumberToObject(r, "kv_bytes", (double)kv[i]);
            cJSON_AddNumberToObject(r, "total_bytes", total[i]);
            cJSON_AddNumberToObject(r, "fp32_state_pool_bytes", state32[i]);
            cJSON_AddNumberToObject(r, "fp32_total_bytes", total32[i]);
            cJSON_AddItemToArray(rows, r);
        }
        cJSON_AddItemToObject(root, "batches", rows);
        text = cJSON_Print(root);
        if (text)
            fprintf(f, "%s\n", text);
        free(text);
        cJSON_Delete(root);
    } else {
        fprintf(f, "map     %s (%s), policy %s: %d slots per request + 1 sentinel, tp %d\n", path,
                label, stepq_pool_policy_name(policy), per, tp);
        fprintf(f,
                "slot S  %" PRIu64 " B (%.4f MiB) = state %" PRIu64 " B (compact %" PRIu64
                ") + conv %" PRIu64 " B + padding %" PRIu64 " B%s\n",
                s_map.bytes, (double)s_map.bytes / MIB, s_map.state, s_map.compact, s_map.conv,
                s_map.pad, compact ? " [--slot compact: compact + conv]" : "");
        if (tp_given) {
            fprintf(f,
                    "per GPU page %" PRIu64 " B (%.4f MiB) on each of %d GPUs, rank %d's (the "
                    "largest); S = %d pages\n",
                    s_map.page, (double)s_map.page / MIB, tp, s_map.largest_rank, tp);
            fprintf(f, "TP pad  per GPU");
            for (int r = 0; r < tp; r++)
                fprintf(f, "%s %" PRIu64, r ? " /" : "", s_map.rank_tp_pad[r]);
            fprintf(f, " B (ranks 0..%d); per replica %" PRIu64 " B of S's padding\n", tp - 1,
                    s_map.tp_pad);
        }
        fprintf(f, "fp32 S  %" PRIu64 " B (%.4f MiB), %.2fx the map's slot\n", s_fp32.bytes,
                (double)s_fp32.bytes / MIB, (double)s_fp32.bytes / (double)s_map.bytes);
        if (weights || have_kv)
            fprintf(f,
                    "weights %" PRIu64 " B (%.2f GiB), KV %" PRIu64 " B/token x %" PRIu64
                    " tokens\n",
                    weights, (double)weights / GIB, kv_per_token, context);
        fprintf(f, "\n%7s %8s %16s %16s %16s %16s\n", "batch", "slots", "state pool GiB",
                "fp32 pool GiB", "total GiB", "fp32 total GiB");
        for (int i = 0; i < n_b; i++)
            fprintf(f, "%7d %8" PRIu64 " %16.2f %16.2f %16.2f %16.2f\n", batches[i], slots[i],
                    state[i] / GIB, state32[i] / GIB, total[i] / GIB, total32[i] / GIB);
    }

    rc = 0;
    if (plot) {
        cJSON *spec = cJSON_CreateObject(), *x = cJSON_CreateArray(), *series = cJSON_CreateArray();
        char title[512], name[300];
        char *text;

        for (int i = 0; i < n_b; i++)
            cJSON_AddItemToArray(x, cJSON_CreateNumber(batches[i]));
        snprintf(title, sizeof(title), "%s: serving memory, %s (%dB+1)S", stepq_map_model_name(map),
                 stepq_pool_policy_name(policy), per);
        cJSON_AddStringToObject(spec, "output", plot);
        cJSON_AddStringToObject(spec, "title", title);
        cJSON_AddStringToObject(spec, "xlabel", "concurrent requests B");
        cJSON_AddStringToObject(spec, "ylabel", "GiB");
        cJSON_AddBoolToObject(spec, "logx", 1);
        cJSON_AddItemToObject(spec, "x", x);
        add_series(series, "FP32 state pool", state32, n_b, "-o");
        snprintf(name, sizeof(name), "%s state pool", label);
        add_series(series, name, state, n_b, "-s");
        if (have_kv || weights) {
            add_series(series, "FP32 total", total32, n_b, ":o");
            snprintf(name, sizeof(name), "%s total", label);
            add_series(series, name, total, n_b, ":s");
        }
        cJSON_AddItemToObject(spec, "series", series);
        if (weights) {
            cJSON *h = cJSON_CreateArray(), *w = cJSON_CreateObject();

            cJSON_AddStringToObject(w, "label", "weights");
            cJSON_AddNumberToObject(w, "y", (double)weights / GIB);
            cJSON_AddItemToArray(h, w);
            cJSON_AddItemToObject(spec, "hlines", h);
        }
        text = cJSON_PrintUnformatted(spec);
        cJSON_Delete(spec);
        if (!text || run_plot(text) < 0)
            rc = 1;
        else if (!json)
            fprintf(f, "\nplot written to %s\n", plot);
        free(text);
    }
    if (stepq_tool_out_commit(&out, "capacity") < 0)
        rc = 1;
out:
    free(s_map.rank_tp_pad);
    free(s_fp32.rank_tp_pad);
    stepq_map_close(fp32);
    stepq_map_close(map);
    return rc;
}
