/*
 * stepq bench decode MAP|PRESET...: the decode throughput of the recurrent-state
 * path, as a server runs it, for the fp32 state, the bf16 state and each map's
 * method side by side (several maps of one model shape: every MAP file, and a
 * PRESET's stepq layout map at each --bits width).
 *
 * Everything goes through the public API: pools opened from the maps and from
 * dense fp32 / bf16 maps of the same shape (stepq_map_create), B slots
 * allocated, synthetic prompt states packed with stepq_pool_prefill_pack,
 * then T tokens x every timed layer of stepq_pool_decode_step. Per run the
 * decode time is the sum of the intervals between the starts of consecutive
 * tokens (the gaps between steps included) and an end mark after the last:
 * CUDA events on the pool's stream on the CUDA backend, CLOCK_MONOTONIC on
 * the host backend. One warm-up and 3 timed runs, the median reported;
 * tokens/s = B x T request-token transitions / decode time.
 *
 * Inputs are made before the timing, so that the timed loop holds only the
 * steps: a bank of N_BANK sets of unit-norm q / k, v and beta (token t, layer
 * l reads set (t + l) mod N_BANK), and per layer one gate tensor drawn from
 * the map's per-unit log retention (calibrated maps), or for maps without
 * statistics from half-lives log-uniform in [HALF_LIFE_MIN, HALF_LIFE_MAX]
 * tokens per unit.
 *
 * --peer FILE adds flash-linear-attention's fp32 state path, timed by
 * tools/scripts/bench_peer_fla.py --decode in a process of its own (the same
 * protocol on fla's kernels), as one more row per batch, after checking that
 * the file's shape, tokens and dtype are the run's.
 *
 * It measures the recurrent-state path only: no attention or MLP layers, no
 * conv state update, no sampling. --tp N times one rank's share of the heads
 * in this process; --tp N --procs starts one process per rank (tools/ranks.c,
 * libuv), each this command in a hidden rank mode (--rank-child) that prints
 * its JSON on its standard output, and reports per batch and state the
 * slowest rank's decode time. On the CUDA backend each rank takes device
 * R mod the device count and, where NCCL is built, joins one communicator
 * (the parent's unique id, in hex on the command line) and checks its pools
 * against the other ranks' (stepq_tp_check_pools) before timing them; NCCL
 * holds one rank per device, so there a host with fewer devices than ranks
 * is refused before any rank starts.
 */
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "stepq_config.h"
#include "stepq/stepq.h"
#include "tools/cli.h"
#include "tools/commands.h"
#include "tools/mkmap.h"
#include "tools/ranks.h"

#if STEPQ_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define TOOL        "bench decode"
#define MAX_BATCHES 16
#define MAX_RUNS    100
/* The maps of one run (MAP files, and a PRESET's map per --bits width), and the rows per batch:
 * fp32, bf16 and one per map (an fp32 or bf16 map's are those two). */
#define MAX_MAPS     8
#define MAX_VARIANTS (2 + MAX_MAPS)
/* Distinct q/k/v/beta sets the tokens cycle through: enough that consecutive
 * layers and tokens never read the same inputs, few enough to stay small. */
#define N_BANK 4
/* Dense prompt states made per layer; slots take them in turn (pack in chunks). */
#define N_PATTERN 2
/* Outer products summed into a synthetic prompt state (of the prompt's P). */
#define PROMPT_RANK 16
/* The gate fallback of maps without statistics: half-lives in tokens. */
#define HALF_LIFE_MIN 2.0
#define HALF_LIFE_MAX 2048.0
/* The stepq layout map a preset gets: the bundled qwen3.8-27b one (32 pivots of 2304 units), at
 * PRESET_BITS unless --bits says otherwise. */
#define PRESET_BITS       6
#define PRESET_PIVOT_UNIT 72
/* --peer: the file of tools/scripts/bench_peer_fla.py --decode. */
#define PEER_FORMAT      "stepq-bench-decode-peer"
#define PEER_LABEL       "fla fp32 (peer)"
#define PEER_MAX_BYTES   (1u << 20) /* a peer file is a few kB; anything this large is not one */
#define PEER_MAX_BATCHES 64
#define GIB              (1024.0 * 1024.0 * 1024.0)
#define MIB              (1024.0 * 1024.0)

/* The paper's protocol. */
static const int paper_batches[] = { 32, 64, 128, 256, 512 };
#define PAPER_TOKENS 1024
#define PAPER_PROMPT 128
/* The host backend's default: a reduced run that finishes in seconds. */
static const int host_batches[] = { 1, 4 };
#define HOST_TOKENS 16
#define HOST_LAYERS 2

static void usage(FILE *f)
{
    fprintf(f, "usage: stepq bench decode MAP|PRESET... [--bits 6,4] [--backend host|cuda]\n"
               "                          [--tp N] [--rank R] [--procs] [--timeout-s S]\n"
               "                          [--batch 32,64,...] [--tokens T] [--prompt P]\n"
               "                          [--layers N|all] [--full] [--runs R] [--warmup W]\n"
               "                          [--warmup-tokens N]\n"
               "                          [--budget-gib G] [--policy extra_buffer] [--graph]\n"
               "                          [--dtype bf16|fp32] [--peer FILE] [--json] [-o FILE]\n"
               "Decode throughput of the recurrent-state path through the public API: per\n"
               "token, every recurrent layer's stepq_pool_decode_step on B slots whose prompt\n"
               "states were packed with stepq_pool_prefill_pack; tokens/s and ms per step for\n"
               "the fp32 state, the bf16 state and each map's method side by side, the state\n"
               "bytes per request and the largest batch that fits --budget-gib (default 80)\n"
               "under the reservation policy (default extra_buffer: 5 slots per request + 1).\n"
               "It measures the recurrent-state path only, not attention or MLP layers.\n"
               "PRESET: a shape with the stepq@B layout map `stepq mkmap --shape PRESET\n"
               "--method stepq --bits B --pivots P` makes, P one unit in 72 (the bundled\n"
               "Qwen3.8-27B map's 32 of 2304), B 6 or each of --bits (3,4,5,6,8); one of\n  ");
    stepq_tool_preset_list(f);
    fprintf(f,
            ".\n"
            "Several MAP|PRESET (up to %d maps in all) of one model shape (arch, layers,\n"
            "heads, head dims, conv state; else refused, naming both and the field): a row\n"
            "per map after fp32 and bf16, labelled by its method (stepq@6; equal labels get\n"
            "the map's file or preset name); an fp32 or bf16 map is timed as the fp32 or\n"
            "bf16 rows, with none of its own. A batch is refused when no map's pool fits\n"
            "--budget-gib; the rows of a map whose pool does not say so. The report's table:\n"
            "  stepq bench decode qwen3-next-80b-a3b --bits 6,4 --peer peer.json\n"
            "(stepq@6 and stepq@4 next to fp32, bf16 and fla's fp32 on a GPU).\n"
            "The paper's protocol: batches 32,64,128,256,512, a 128-token prompt, 1024\n"
            "generated tokens, every layer, 1 warm-up + 3 runs, median; decode time = sum\n"
            "of the intervals between consecutive token starts (gaps included): CUDA\n"
            "events on the CUDA backend (the default where a device exists), the\n"
            "monotonic clock on the host backend (the C reference), whose default is a\n"
            "reduced run (2 layers, batches 1,4, 16 tokens; --full for the protocol).\n"
            "--tp N: one rank's share (H/N q/k heads, HV/N value heads; --rank R, default\n"
            "the rank with the largest page) in this one process. --tp N --procs: one\n"
            "process per rank, all N started at once; each times its own share, and the\n"
            "table's time is the slowest rank's per batch and state (--json: every rank's\n"
            "own results too). CUDA: rank R on device R, one NCCL communicator whose\n"
            "pools are checked against each other before the timing, so N ranks need N\n"
            "devices (NCCL holds one rank per device; a build without NCCL runs the ranks\n"
            "alone, on device R mod the device count). Host: the ranks run alone, as\n"
            "processes of this machine. A rank that fails stops every other; --timeout-s S\n"
            "stops them all after S seconds (default: no limit).\n"
            "--warmup-tokens N: each warm-up run generates N tokens, not T (default T):\n"
            "the warm-up only loads modules and warms clocks and caches, so a short one\n"
            "saves a quarter of the protocol's time; the timed runs are unchanged.\n"
            "--layers: the first N recurrent layers.\n"
            "--dtype: of q, k, v, g, beta and o (default bf16, as servers hold them).\n"
            "--graph (CUDA): each token's steps captured into a CUDA graph and replayed,\n"
            "as servers decode; without it the steps are launched one call at a time.\n"
            "--peer FILE: flash-linear-attention's fp32 state path as one more row per\n"
            "batch, '" PEER_LABEL "', and a 'vs peer' column (tokens/s over the peer's):\n"
            "FILE is the JSON of tools/scripts/bench_peer_fla.py --decode (the same protocol\n"
            "on fla's kernels, in a process of its own), timed with this run's shape (one\n"
            "rank's heads with --tp), layers, tokens and dtype, or refused; batches it lacks\n"
            "show '-'.\n"
            "--json: the numbers as JSON instead of the tables; -o: into FILE. Progress\n"
            "on stderr in request tokens (batch x tokens per run: the ETA weighs a run of\n"
            "512 requests as 16 runs of 32; STEPQ_PROGRESS=off|bar|lines).\n",
            MAX_MAPS);
}

struct opts {
    const char *targets[MAX_MAPS]; /* MAP|PRESET, as given */
    int n_targets;
    int bits[MAX_MAPS], n_bits; /* --bits: a preset's stepq widths (n_bits 0: PRESET_BITS) */
    const char *bits_text;
    const char *out_path, *policy_name, *peer_path;
    int backend; /* -1: cuda where a device exists, else host */
    int tp, rank;
    int batches[MAX_BATCHES], n_b; /* n_b 0: the backend's default */
    int tokens, prompt, layers;    /* 0: the backend's default (layers -1: all) */
    int runs, warmup, full, json, budget_given, graph;
    int warmup_tokens;   /* --warmup-tokens: a warm-up run's tokens (0: --tokens) */
    int procs, child;    /* --procs: one process per rank; --rank-child: one of them */
    const char *nccl_id; /* --nccl-id: the communicator's unique id in hex (a child) */
    double timeout_s;    /* --procs: the whole run's limit, 0 none */
    stepq_dtype dtype;   /* of the server's tensors */
    double budget_gib;
};

static int parse_batches(const char *v, struct opts *o)
{
    const char *s = v;
    o->n_b = 0;
    while (*s) {
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s || x < 1 || x > 65535 || (*end && *end != ',') || o->n_b == MAX_BATCHES) {
            fprintf(stderr,
                    "stepq " TOOL ": --batch '%s': want up to %d batch sizes in [1, 65535], "
                    "e.g. 32,64,128\n",
                    v, MAX_BATCHES);
            return -1;
        }
        o->batches[o->n_b++] = (int)x;
        s = *end ? end + 1 : end;
    }
    if (!o->n_b) {
        fprintf(stderr, "stepq " TOOL ": --batch '': want batch sizes, e.g. 32,64,128\n");
        return -1;
    }
    return 0;
}

/* --bits: distinct stepq widths a preset's layout map takes (mkmap's widths but 2, which its
 * pivots do not fit). */
static int parse_bits(const char *v, struct opts *o)
{
    const char *s = v;
    o->n_bits = 0;
    o->bits_text = v;
    while (*s) {
        char *end;
        long x = strtol(s, &end, 10);
        int seen = 0;
        for (int i = 0; i < o->n_bits; i++)
            seen |= o->bits[i] == x;
        if (end == s || x < 3 || x > 8 || x == 7 || seen || (*end && *end != ',') ||
            o->n_bits == MAX_MAPS) {
            fprintf(stderr,
                    "stepq " TOOL ": --bits '%s': want up to %d distinct stepq widths among "
                    "3,4,5,6,8, e.g. 6,4\n",
                    v, MAX_MAPS);
            return -1;
        }
        o->bits[o->n_bits++] = (int)x;
        s = *end ? end + 1 : end;
    }
    if (!o->n_bits) {
        fprintf(stderr, "stepq " TOOL ": --bits '': want stepq widths, e.g. 6,4\n");
        return -1;
    }
    return 0;
}

/* A target names a preset unless it looks like a file (a '/' or ".json"). */
static int is_preset_name(const char *target)
{
    return !strchr(target, '/') && !strstr(target, ".json");
}

/* Returns 0, 1 for --help, or 2 after one line naming the option. */
static int parse_opts(int argc, char **argv, struct opts *o)
{
    long long n;

    memset(o, 0, sizeof(*o));
    o->backend = -1;
    o->tp = 1;
    o->rank = -1;
    o->runs = 3;
    o->warmup = 1;
    o->budget_gib = 80;
    o->policy_name = "extra_buffer";
    o->dtype = STEPQ_DTYPE_BF16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 1;
        }
        /* The flags (options without a value). */
        const struct {
            const char *name;
            int *field;
        } flags[] = { { "--json", &o->json },
                      { "--full", &o->full },
                      { "--graph", &o->graph },
                      { "--procs", &o->procs },
                      { "--rank-child", &o->child } };
        int flag = -1;
        for (int f = 0; f < (int)(sizeof(flags) / sizeof(flags[0])); f++)
            if (!strcmp(a, flags[f].name))
                flag = f;
        if (flag >= 0) {
            *flags[flag].field = 1;
            continue;
        }
        if (a[0] != '-') {
            for (int t = 0; t < o->n_targets; t++)
                if (!strcmp(o->targets[t], a)) {
                    fprintf(stderr, "stepq " TOOL ": MAP or PRESET '%s' given twice\n", a);
                    return 2;
                }
            if (o->n_targets == MAX_MAPS) {
                fprintf(stderr, "stepq " TOOL ": '%s': more than %d MAP or PRESET\n", a, MAX_MAPS);
                return 2;
            }
            o->targets[o->n_targets++] = a;
            continue;
        }
        if (!v) {
            static const char *const value_opts[] = {
                "--backend",       "--batch",   "--budget-gib", "--layers",
                "--policy",        "--prompt",  "--rank",       "--runs",
                "--tokens",        "--tp",      "--warmup",     "-o",
                "--timeout-s",     "--nccl-id", "--peer",       "--bits",
                "--warmup-tokens", NULL
            };
            return stepq_tool_missing_value(TOOL, a, value_opts);
        }
        i++;
        if (!strcmp(a, "-o")) {
            o->out_path = v;
        } else if (!strcmp(a, "--backend")) {
            o->backend = !strcmp(v, "host")   ? STEPQ_POOL_BACKEND_HOST
                         : !strcmp(v, "cuda") ? STEPQ_POOL_BACKEND_CUDA
                                              : -2;
            if (o->backend == -2) {
                fprintf(stderr, "stepq " TOOL ": --backend '%s': want host or cuda\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--batch")) {
            if (parse_batches(v, o) < 0)
                return 2;
        } else if (!strcmp(a, "--bits")) {
            if (parse_bits(v, o) < 0)
                return 2;
        } else if (!strcmp(a, "--tp")) {
            if (stepq_tool_int(TOOL, a, v, 1, 1024, &n) < 0)
                return 2;
            o->tp = (int)n;
        } else if (!strcmp(a, "--rank")) {
            if (stepq_tool_int(TOOL, a, v, 0, 1023, &n) < 0)
                return 2;
            o->rank = (int)n;
        } else if (!strcmp(a, "--tokens")) {
            if (stepq_tool_int(TOOL, a, v, 1, 1 << 20, &n) < 0)
                return 2;
            o->tokens = (int)n;
        } else if (!strcmp(a, "--prompt")) {
            if (stepq_tool_int(TOOL, a, v, 1, 1 << 20, &n) < 0)
                return 2;
            o->prompt = (int)n;
        } else if (!strcmp(a, "--layers")) {
            if (!strcmp(v, "all"))
                o->layers = -1;
            else if (stepq_tool_int(TOOL, a, v, 1, 1 << 16, &n) < 0)
                return 2;
            else
                o->layers = (int)n;
        } else if (!strcmp(a, "--runs")) {
            if (stepq_tool_int(TOOL, a, v, 1, MAX_RUNS, &n) < 0)
                return 2;
            o->runs = (int)n;
        } else if (!strcmp(a, "--warmup-tokens")) {
            if (stepq_tool_int(TOOL, a, v, 1, 1 << 20, &n) < 0)
                return 2;
            o->warmup_tokens = (int)n;
        } else if (!strcmp(a, "--warmup")) {
            if (stepq_tool_int(TOOL, a, v, 0, MAX_RUNS, &n) < 0)
                return 2;
            o->warmup = (int)n;
        } else if (!strcmp(a, "--budget-gib")) {
            if (stepq_tool_real(TOOL, a, v, 0, 1 << 20, STEPQ_TOOL_OPEN_LO, &o->budget_gib) < 0)
                return 2;
            o->budget_given = 1;
        } else if (!strcmp(a, "--policy")) {
            o->policy_name = v;
        } else if (!strcmp(a, "--timeout-s")) {
            if (stepq_tool_real(TOOL, a, v, 0, 1e9, STEPQ_TOOL_OPEN_LO, &o->timeout_s) < 0)
                return 2;
        } else if (!strcmp(a, "--nccl-id")) {
            o->nccl_id = v;
        } else if (!strcmp(a, "--peer")) {
            o->peer_path = v;
        } else if (!strcmp(a, "--dtype")) {
            if (strcmp(v, "fp32") && strcmp(v, "bf16")) {
                fprintf(stderr, "stepq " TOOL ": --dtype '%s': want bf16 or fp32\n", v);
                return 2;
            }
            o->dtype = !strcmp(v, "fp32") ? STEPQ_DTYPE_FP32 : STEPQ_DTYPE_BF16;
        } else {
            fprintf(stderr, "stepq " TOOL ": unknown option '%s' (see stepq " TOOL " --help)\n", a);
            return 2;
        }
    }
    if (!o->n_targets) {
        usage(stderr);
        return 2;
    }
    /* A preset's widths, and the maps in all: every preset at each width, every map file once. */
    int presets = 0, maps = 0;
    for (int t = 0; t < o->n_targets; t++) {
        presets += is_preset_name(o->targets[t]);
        maps += is_preset_name(o->targets[t]) ? (o->n_bits ? o->n_bits : 1) : 1;
    }
    if (o->n_bits && !presets) {
        fprintf(stderr,
                "stepq " TOOL ": --bits %s: the widths of a PRESET's stepq layout map, and no "
                "PRESET is given (a MAP file has its own)\n",
                o->bits_text);
        return 2;
    }
    if (maps > MAX_MAPS) { /* without --bits there are at most MAX_MAPS targets */
        fprintf(stderr,
                "stepq " TOOL ": --bits %s: %d maps (each PRESET at each width, each MAP once), "
                "want up to %d\n",
                o->bits_text, maps, MAX_MAPS);
        return 2;
    }
    if (o->procs && o->rank >= 0) {
        fprintf(stderr, "stepq " TOOL ": --procs runs every rank: --rank is for one\n");
        return 2;
    }
    if (o->timeout_s > 0 && !o->procs) {
        fprintf(stderr, "stepq " TOOL ": --timeout-s limits a --procs run\n");
        return 2;
    }
    if (o->child && o->peer_path) {
        fprintf(stderr, "stepq " TOOL ": --peer is the parent's: a rank does not read it\n");
        return 2;
    }
    if (o->child && (o->rank < 0 || o->procs)) {
        fprintf(stderr, "stepq " TOOL ": --rank-child is --procs' own: it needs --rank\n");
        return 2;
    }
    return 0;
}

/* --- deterministic inputs ------------------------------------------------------ */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* In [0, 1). */
static double unit_rand(uint64_t *s)
{
    return (double)(splitmix64(s) >> 11) * (1.0 / 9007199254740992.0);
}

static void unit_vector(uint64_t *s, float *x, int n)
{
    double sum = 0;
    for (int i = 0; i < n; i++) {
        x[i] = (float)(2 * unit_rand(s) - 1);
        sum += (double)x[i] * x[i];
    }
    for (int i = 0; i < n; i++)
        x[i] = (float)(x[i] / sqrt(sum));
}

/*
 * The log retention (g, <= 0) of every unit of the timed layers: the map's
 * statistics where it has them, else the fallback half-lives. *from_map says
 * which. log_ret[l * upl + u].
 */
static double *unit_log_retention(const stepq_map_t *map, int layers, int *from_map)
{
    const int upl = stepq_map_units_per_layer(map);
    double *lr = malloc(sizeof(double) * (size_t)layers * (size_t)upl);
    stepq_unit_stats us = STEPQ_UNIT_STATS_INITIALIZER;
    uint64_t seed = 0x68616c666c696665ull; /* "halflife" */

    if (!lr)
        return NULL;
    *from_map = stepq_map_unit_stats(map, 0, 0, &us) == STEPQ_OK;
    for (int l = 0; l < layers; l++)
        for (int u = 0; u < upl; u++) {
            double g;
            if (*from_map && stepq_map_unit_stats(map, l, u, &us) == STEPQ_OK) {
                g = us.log_retention;
            } else {
                double hl = HALF_LIFE_MIN * pow(HALF_LIFE_MAX / HALF_LIFE_MIN, unit_rand(&seed));
                g = log(0.5) / hl;
            }
            lr[(size_t)l * upl + u] = g;
        }
    return lr;
}

/* Host copies of what the steps read; the CUDA backend copies them to the device once. */
struct inputs {
    int B, H, HV, K, V, gn; /* gn: gates per head (1 GDN, K KDA) */
    int layers;             /* of g and pattern */
    float *q[N_BANK], *k[N_BANK], *v[N_BANK], *beta[N_BANK];
    float **g;       /* [layers][B][HV][gn] */
    float **pattern; /* [layers][N_PATTERN][HV][K][V]: synthetic prompt states */
    size_t n_q, n_v, n_g, n_pat;
};

/* The per-batch part of the inputs: the token bank and the gates (remade for each batch). */
static void inputs_free_batch(struct inputs *in, int layers)
{
    for (int i = 0; i < N_BANK; i++) {
        free(in->q[i]);
        free(in->k[i]);
        free(in->v[i]);
        free(in->beta[i]);
    }
    for (int l = 0; in->g && l < layers; l++)
        free(in->g[l]);
}

static void inputs_free(struct inputs *in)
{
    const int layers = in->layers;
    inputs_free_batch(in, layers);
    for (int l = 0; in->pattern && l < layers; l++)
        free(in->pattern[l]);
    free(in->g);
    free(in->pattern);
    memset(in, 0, sizeof(*in));
}

/*
 * The prompt state of one head: sum over PROMPT_RANK of the prompt's P tokens
 * (ages a P / PROMPT_RANK) of beta k v^T decayed by the head's gate (KDA: each
 * key row by its own), scaled by sqrt(P / PROMPT_RANK) for the tokens left
 * out: the magnitude a prompt of P tokens gives a head of that half-life.
 */
static void prompt_state(uint64_t *s, float *S, int K, int V, const double *g, int gn, int P)
{
    float k[1024], v[1024];
    const double w0 = 0.5 * sqrt((double)P / PROMPT_RANK);

    memset(S, 0, sizeof(float) * (size_t)K * V);
    for (int a = 0; a < PROMPT_RANK; a++) {
        const double age = (double)a * P / PROMPT_RANK;
        unit_vector(s, k, K);
        for (int j = 0; j < V; j++)
            v[j] = (float)(2 * unit_rand(s) - 1);
        for (int i = 0; i < K; i++) {
            const float w = (float)(w0 * exp(g[gn > 1 ? i : 0] * age)) * k[i];
            for (int j = 0; j < V; j++)
                S[(size_t)i * V + j] += w * v[j];
        }
    }
}

/*
 * Makes every input of batch B for this rank's heads (first_head on), from a
 * seed that depends on nothing else, so that two runs read the same numbers.
 * The prompt states do not depend on B (made once, by the first call).
 */
static int inputs_make(struct inputs *in, const stepq_model_shape *sh, int tp, int first_head,
                       int B, int layers, int prompt, const double *log_ret)
{
    const int H = sh->num_k_heads / tp, HV = sh->num_v_heads / tp, K = sh->head_k_dim;
    const int V = sh->head_v_dim, gn = sh->arch == STEPQ_ARCH_KDA ? K : 1;
    const int upl = sh->arch == STEPQ_ARCH_KDA ? sh->num_v_heads * K : sh->num_v_heads;
    uint64_t seed = 0x7374657071ull + (uint64_t)B;

    inputs_free_batch(in, layers);
    in->B = B, in->H = H, in->HV = HV, in->K = K, in->V = V, in->gn = gn;
    in->n_q = (size_t)B * H * K;
    in->n_v = (size_t)B * HV * V;
    in->n_g = (size_t)B * HV * gn;
    in->n_pat = (size_t)N_PATTERN * HV * K * V;
    for (int i = 0; i < N_BANK; i++) {
        in->q[i] = malloc(sizeof(float) * in->n_q);
        in->k[i] = malloc(sizeof(float) * in->n_q);
        in->v[i] = malloc(sizeof(float) * in->n_v);
        in->beta[i] = malloc(sizeof(float) * (size_t)B * HV);
        if (!in->q[i] || !in->k[i] || !in->v[i] || !in->beta[i])
            return STEPQ_ENOMEM;
        for (size_t h = 0; h < (size_t)B * H; h++) {
            unit_vector(&seed, in->q[i] + h * K, K);
            unit_vector(&seed, in->k[i] + h * K, K);
        }
        for (size_t e = 0; e < in->n_v; e++)
            in->v[i][e] = (float)(2 * unit_rand(&seed) - 1);
        for (size_t e = 0; e < (size_t)B * HV; e++)
            in->beta[i][e] = (float)(0.2 + 0.6 * unit_rand(&seed));
    }
    if (!in->g && !(in->g = calloc((size_t)layers, sizeof(*in->g))))
        return STEPQ_ENOMEM;
    in->layers = layers;
    for (int l = 0; l < layers; l++) {
        if (!(in->g[l] = malloc(sizeof(float) * in->n_g)))
            return STEPQ_ENOMEM;
        for (int b = 0; b < B; b++)
            for (int h = 0; h < HV; h++)
                for (int i = 0; i < gn; i++) {
                    const int unit = (first_head + h) * gn + i;
                    /* each request's gate within +-50% of the unit's mean, as a token's would be */
                    in->g[l][((size_t)b * HV + h) * gn + i] =
                        (float)(log_ret[(size_t)l * upl + unit] * (0.5 + unit_rand(&seed)));
                }
    }
    if (in->pattern)
        return STEPQ_OK;
    if (!(in->pattern = calloc((size_t)layers, sizeof(*in->pattern))))
        return STEPQ_ENOMEM;
    uint64_t ps = 0x70726f6d7074ull; /* "prompt" */
    for (int l = 0; l < layers; l++) {
        if (!(in->pattern[l] = malloc(sizeof(float) * in->n_pat)))
            return STEPQ_ENOMEM;
        for (int e = 0; e < N_PATTERN; e++)
            for (int h = 0; h < HV; h++)
                prompt_state(&ps, in->pattern[l] + ((size_t)e * HV + h) * K * V, K, V,
                             log_ret + (size_t)l * upl + (size_t)(first_head + h) * gn, gn, prompt);
    }
    return STEPQ_OK;
}

/* --- the backends' buffers and clocks ------------------------------------------ */

/*
 * Where the steps read their tensors: copies in the server's dtype (--dtype)
 * in host memory on the host backend, in device memory on the CUDA backend,
 * all owned here. The prompt states stay fp32 (a chunk kernel's final states).
 */
struct dev {
    int cuda;
    void *stream;      /* cudaStream_t */
    stepq_dtype dtype; /* of q, k, v, g, beta and o */
    const void *q[N_BANK], *k[N_BANK], *v[N_BANK], *beta[N_BANK];
    const void **g, **pattern;
    void *o;
    int32_t *ids;
    int layers;
};

static double now_s(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The text of this tool's own failing CUDA call (cu_fail), "" when the library's failed. */
static char cu_msg[256];

/* What failed: this tool's CUDA call, or the library's last error; read once. */
static const char *fail_text(void)
{
    static char text[sizeof(cu_msg)];
    snprintf(text, sizeof(text), "%s", cu_msg[0] ? cu_msg : stepq_last_error());
    cu_msg[0] = 0;
    return text;
}

#if STEPQ_HAVE_CUDA
static int cu_fail(cudaError_t e, const char *what)
{
    snprintf(cu_msg, sizeof(cu_msg), "%s: %s", what, cudaGetErrorString(e));
    cudaGetLastError();
    return STEPQ_ECUDA;
}

#endif

/* bf16 of x, rounded to nearest even (NaN kept a NaN). */
static uint16_t bf16_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)(u >> 16 | 0x40);
    return (uint16_t)((u + 0x7fffu + (u >> 16 & 1)) >> 16);
}

static float float_of_bf16(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

static void dev_free(const struct dev *d, const void *p)
{
#if STEPQ_HAVE_CUDA
    if (d->cuda) {
        cudaFree((void *)p);
        return;
    }
#endif
    free((void *)p);
}

/* Backend memory for n elements of dtype (*dst), holding src (NULL: left as it is). */
static int dev_put(const struct dev *d, const void **dst, const float *src, size_t n,
                   stepq_dtype dtype)
{
    const size_t es = stepq_dtype_size(dtype);
    void *h = malloc(n * es);

    *dst = NULL;
    if (!h)
        return STEPQ_ENOMEM;
    for (size_t i = 0; src && es == 2 && i < n; i++)
        ((uint16_t *)h)[i] = bf16_of(src[i]);
    if (src && es == 4)
        memcpy(h, src, n * es);
    if (!d->cuda) {
        *dst = h;
        return STEPQ_OK;
    }
#if STEPQ_HAVE_CUDA
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, n * es);
    if (e != cudaSuccess) {
        free(h);
        return cu_fail(e, "cudaMalloc");
    }
    *dst = p;
    if (src && (e = cudaMemcpy(p, h, n * es, cudaMemcpyHostToDevice)) != cudaSuccess) {
        free(h);
        return cu_fail(e, "cudaMemcpy");
    }
    free(h);
    return STEPQ_OK;
#else
    free(h);
    return STEPQ_ENOTSUP;
#endif
}

static void dev_release(struct dev *d)
{
    for (int i = 0; i < N_BANK; i++) {
        dev_free(d, d->q[i]);
        dev_free(d, d->k[i]);
        dev_free(d, d->v[i]);
        dev_free(d, d->beta[i]);
    }
    for (int l = 0; d->g && l < d->layers; l++)
        dev_free(d, d->g[l]);
    for (int l = 0; d->pattern && l < d->layers; l++)
        dev_free(d, d->pattern[l]);
    dev_free(d, d->o);
    dev_free(d, d->ids);
    free(d->g);
    free(d->pattern);
    const struct dev keep = { .cuda = d->cuda, .stream = d->stream, .dtype = d->dtype };
    *d = keep;
}

/* Copies the inputs of one batch where the steps read them, in d->dtype. */
static int dev_load(struct dev *d, const struct inputs *in, int layers)
{
    const stepq_dtype dt = d->dtype;
    const void *ids = NULL;
    int ret = STEPQ_OK;

    dev_release(d);
    d->layers = layers;
    d->g = calloc((size_t)layers, sizeof(*d->g));
    d->pattern = calloc((size_t)layers, sizeof(*d->pattern));
    if (!d->g || !d->pattern)
        return STEPQ_ENOMEM;
    for (int i = 0; i < N_BANK && ret == STEPQ_OK; i++)
        if ((ret = dev_put(d, &d->q[i], in->q[i], in->n_q, dt)) < 0 ||
            (ret = dev_put(d, &d->k[i], in->k[i], in->n_q, dt)) < 0 ||
            (ret = dev_put(d, &d->v[i], in->v[i], in->n_v, dt)) < 0 ||
            (ret = dev_put(d, &d->beta[i], in->beta[i], (size_t)in->B * in->HV, dt)) < 0)
            return ret;
    for (int l = 0; l < layers; l++)
        if ((ret = dev_put(d, &d->g[l], in->g[l], in->n_g, dt)) < 0 ||
            (ret = dev_put(d, &d->pattern[l], in->pattern[l], in->n_pat, STEPQ_DTYPE_FP32)) < 0)
            return ret;
    if ((ret = dev_put(d, (const void **)&d->o, NULL, in->n_v, dt)) < 0)
        return ret;
    /* the slot ids: int32, as many bytes as B floats */
    ret = dev_put(d, &ids, NULL, (size_t)in->B, STEPQ_DTYPE_FP32);
    d->ids = (int32_t *)ids;
    return ret;
}

/* --- one timed configuration ----------------------------------------------------- */

/* The states compared: fp32, bf16, then the maps'. */
struct variant {
    char label[96];
    stepq_map_t *map;   /* owned by fp32 and bf16, the source's otherwise */
    const char *source; /* the MAP|PRESET it comes from, NULL for fp32 and bf16 */
    stepq_pool_plan_info plan;
    uint64_t state_bytes; /* the recurrent state of one request on this rank, as allocated */
    int32_t max_batch;    /* under the policy in the budget; -1: none */
};

/* Why a pool is not run: over --budget-gib, over what the machine has, or its backend lacks a step.
 */
enum { OVER_BUDGET = 1, OVER_MEMORY = 2, UNSUPPORTED = 3 };

static int over(double need, double budget, double machine)
{
    return need > budget ? OVER_BUDGET : machine > 0 && need > machine ? OVER_MEMORY : 0;
}

struct result {
    int ran, over;
    double run_s[MAX_RUNS];
    double median_s;
    double checksum; /* sum of |o| over the last token's last layer */
    uint32_t health;
};

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

struct bench {
    struct opts *o;
    stepq_pool_config base; /* map, backend, tp, rank, min_page_bytes, stream */
    const struct inputs *in;
    struct dev *d;
    int layers, tokens;
    struct stepq_tool_progress *prog;
    stepq_tp_comm_t *comm; /* --procs on CUDA with NCCL: every rank's, NULL otherwise */
};

/*
 * The progress of one run of batch B: its B x T request tokens (each through every timed layer,
 * the same layers in every run), the unit of the table's tokens/s. A run of B = 512 takes about
 * 16 times as long as one of B = 32: counting runs made the ETA after the small batches far too
 * short.
 */
static int64_t run_work(const struct bench *bn, int B)
{
    return (int64_t)B * bn->tokens;
}

/* A run's tokens: the warm-up runs generate --warmup-tokens (resolved to at most T), the rest T. */
static int run_tokens_of(const struct bench *bn, int run)
{
    return run < bn->o->warmup ? bn->o->warmup_tokens : bn->tokens;
}

/* The progress of batch B's warm-up and timed runs, in request tokens. */
static int64_t variant_work(const struct bench *bn, int B)
{
    return run_work(bn, B) * bn->o->runs + (int64_t)B * bn->o->warmup_tokens * bn->o->warmup;
}

/* Prefill: the synthetic prompt states packed into every slot of every timed layer. */
static int pack_prompt(const struct bench *bn, stepq_pool_t *pool, const int32_t *ids, int B)
{
    for (int l = 0; l < bn->layers; l++)
        for (int c = 0; c < B; c += N_PATTERN) {
            stepq_prefill_args pf = STEPQ_PREFILL_ARGS_INITIALIZER;
            pf.n = B - c < N_PATTERN ? B - c : N_PATTERN;
            pf.slot_ids = ids + c;
            pf.states = (void *)bn->d->pattern[l];
            pf.layout = STEPQ_STATE_LAYOUT_KV;
            int ret = stepq_pool_prefill_pack(pool, l, &pf, NULL);
            if (ret < 0)
                return ret;
        }
    return STEPQ_OK;
}

/* Token t: every timed layer's decode step, layer l on input set (t + l) mod N_BANK. */
static int token_steps(const struct bench *bn, stepq_pool_t *pool, const int32_t *ids, int B, int t)
{
    const struct dev *d = bn->d;
    stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
    int ret = STEPQ_OK;

    a.batch = B;
    a.slot_ids = ids;
    a.o = d->o;
    a.dtype = d->dtype;
    a.flags = STEPQ_STEP_L2NORM; /* as servers call it (the keys are unit-norm already) */
    for (int l = 0; l < bn->layers && ret == STEPQ_OK; l++) {
        const int s = (t + l) % N_BANK;
        a.q = d->q[s], a.k = d->k[s], a.v = d->v[s], a.beta = d->beta[s];
        a.g = d->g[l];
        ret = stepq_pool_decode_step(pool, l, &a, NULL);
    }
    return ret;
}

/*
 * One run of T tokens x every timed layer on the host backend; *seconds the
 * sum of the intervals between consecutive token starts and an end mark.
 */
static int run_tokens_host(const struct bench *bn, stepq_pool_t *pool, const int32_t *ids, int B,
                           int T, double *stamps, double *seconds)
{
    int ret = STEPQ_OK;

    for (int t = 0; t < T && ret == STEPQ_OK; t++) {
        stamps[t] = now_s();
        ret = token_steps(bn, pool, ids, B, t);
    }
    if (ret < 0)
        return ret;
    stamps[T] = now_s();
    *seconds = 0;
    for (int t = 0; t < T; t++)
        *seconds += stamps[t + 1] - stamps[t];
    return STEPQ_OK;
}

#if STEPQ_HAVE_CUDA
/*
 * The same on the CUDA backend: an event recorded on the pool's stream at
 * each token's start and after the last, the intervals summed (stream
 * order, so the gaps between steps count). With graphs (--graph), token t
 * replays graph t mod N_BANK instead of calling the steps.
 */
static int run_tokens_cuda(const struct bench *bn, stepq_pool_t *pool, const int32_t *ids, int B,
                           int T, cudaEvent_t *ev, const cudaGraphExec_t *graphs, double *seconds)
{
    cudaStream_t s = (cudaStream_t)bn->d->stream;
    cudaError_t e = cudaSuccess;
    int ret = STEPQ_OK;

    for (int t = 0; t < T && ret == STEPQ_OK; t++) {
        if ((e = cudaEventRecord(ev[t], s)) != cudaSuccess)
            return cu_fail(e, "cudaEventRecord");
        if (!graphs)
            ret = token_steps(bn, pool, ids, B, t);
        else if ((e = cudaGraphLaunch(graphs[t % N_BANK], s)) != cudaSuccess)
            return cu_fail(e, "cudaGraphLaunch");
    }
    if (ret < 0)
        return ret;
    *seconds = 0;
    e = cudaEventRecord(ev[T], s);
    if (e == cudaSuccess)
        e = cudaEventSynchronize(ev[T]);
    for (int t = 0; t < T && e == cudaSuccess; t++) {
        float ms = 0;
        e = cudaEventElapsedTime(&ms, ev[t], ev[t + 1]);
        *seconds += ms * 1e-3;
    }
    return e == cudaSuccess ? STEPQ_OK : cu_fail(e, "CUDA events");
}
#endif

/* One run on the pool's backend: marks are the host stamps or the CUDA events. */
static int run_tokens(const struct bench *bn, stepq_pool_t *pool, const int32_t *ids, int B, int T,
                      void *marks, void *graphs, double *seconds)
{
#if STEPQ_HAVE_CUDA
    if (bn->d->cuda)
        return run_tokens_cuda(bn, pool, ids, B, T, marks, graphs, seconds);
#endif
    (void)graphs;
    return run_tokens_host(bn, pool, ids, B, T, marks, seconds);
}

#if STEPQ_HAVE_CUDA
/*
 * --graph: token t's steps depend on t only through t mod N_BANK, so N_BANK
 * graphs of one token each (every timed layer's decode step, captured on the
 * pool's stream) replay the whole run; the pages, slot ids and inputs are read
 * at replay. *out: N_BANK cudaGraphExec_t.
 */
static int capture(const struct bench *bn, stepq_pool_t *pool, const int32_t *ids, int B,
                   void **out)
{
    cudaStream_t s = (cudaStream_t)bn->d->stream;
    cudaGraphExec_t *exec = calloc(N_BANK, sizeof(cudaGraphExec_t));
    int ret = STEPQ_OK;

    *out = exec;
    if (!exec)
        return STEPQ_ENOMEM;
    for (int i = 0; i < N_BANK && ret == STEPQ_OK; i++) {
        cudaGraph_t g = NULL;
        cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
        if (e != cudaSuccess)
            return cu_fail(e, "cudaStreamBeginCapture");
        ret = token_steps(bn, pool, ids, B, i);
        e = cudaStreamEndCapture(s, &g);
        if (ret == STEPQ_OK && e != cudaSuccess)
            ret = cu_fail(e, "cudaStreamEndCapture");
        if (ret == STEPQ_OK && (e = cudaGraphInstantiate(&exec[i], g, 0)) != cudaSuccess)
            ret = cu_fail(e, "cudaGraphInstantiate");
        if (g)
            cudaGraphDestroy(g);
    }
    return ret;
}
#endif

/* Opens the variant's pool of B slots, runs warm-up + runs, and fills *r. */
static int run_variant(const struct bench *bn, const struct variant *va, int B, struct result *r)
{
    stepq_pool_config cfg = bn->base;
    stepq_pool_t *pool = NULL;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)B);
    void *marks = NULL, *graphs = NULL;
    const int n_marks = bn->tokens + 1;
    int ret;

    memset(r, 0, sizeof(*r));
    cfg.map = va->map;
    cfg.num_slots = B;
    cfg.min_page_bytes = va->plan.page_bytes; /* every rank's page padded to the largest */
    if (!ids)
        return STEPQ_ENOMEM;
    if ((ret = stepq_pool_open(&cfg, &pool)) < 0 || (ret = stepq_pool_alloc(pool, B, ids)) < 0) {
        fprintf(stderr, "stepq " TOOL ": %s pool of %d slots: %s\n", va->label, B,
                stepq_last_error());
        goto out;
    }
    const int32_t *step_ids = ids;
    /* A backend without this pool's steps (stepq_pool_supports): the row says so, nothing fails. */
    {
        stepq_step_args a = STEPQ_STEP_ARGS_INITIALIZER;
        stepq_prefill_args pf = STEPQ_PREFILL_ARGS_INITIALIZER;
        a.batch = B;
        a.dtype = bn->d->dtype;
        a.flags = STEPQ_STEP_L2NORM;
        pf.n = N_PATTERN;
        if (stepq_pool_supports(pool, STEPQ_OP_DECODE_STEP, -1, &a) < 0 ||
            stepq_pool_supports(pool, STEPQ_OP_PREFILL_PACK, -1, &pf) < 0) {
            fprintf(stderr, "stepq " TOOL ": %s, batch %d: not run: %s\n", va->label, B,
                    stepq_pool_last_error(pool));
            r->over = UNSUPPORTED;
            stepq_tool_progress_add(bn->prog, variant_work(bn, B));
            ret = STEPQ_OK;
            goto out;
        }
    }
#if STEPQ_HAVE_CUDA
    if (bn->d->cuda) {
        cudaError_t e =
            cudaMemcpy(bn->d->ids, ids, sizeof(int32_t) * (size_t)B, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            ret = cu_fail(e, "cudaMemcpy");
            goto out;
        }
        step_ids = bn->d->ids;
        cudaEvent_t *ev = calloc((size_t)n_marks, sizeof(cudaEvent_t));
        marks = ev;
        for (int i = 0; ev && i < n_marks; i++)
            if ((e = cudaEventCreate(&ev[i])) != cudaSuccess) {
                ret = cu_fail(e, "cudaEventCreate");
                goto out;
            }
        /* Collective: every rank opens the same pools in the same order, so they meet here. */
        if (bn->comm && (ret = stepq_tp_check_pools(bn->comm, &cfg, pool, bn->d->stream)) < 0) {
            fprintf(stderr, "stepq " TOOL ": %s, batch %d: the ranks' pools: %s\n", va->label, B,
                    stepq_last_error());
            goto out;
        }
        if (bn->o->graph && (ret = capture(bn, pool, step_ids, B, &graphs)) < 0) {
            fprintf(stderr, "stepq " TOOL ": %s, batch %d: graph capture: %s\n", va->label, B,
                    fail_text());
            goto out;
        }
    } else
#endif
        marks = malloc(sizeof(double) * (size_t)n_marks);
    if (!marks) {
        ret = STEPQ_ENOMEM;
        goto out;
    }
    const int n_runs = bn->o->warmup + bn->o->runs;
    for (int run = 0; run < n_runs; run++) {
        double sec = 0;
        /* Every run starts from the same prompt states: the runs time the same work. */
        if ((ret = pack_prompt(bn, pool, step_ids, B)) < 0 || (ret = stepq_pool_sync(pool)) < 0 ||
            (ret = run_tokens(bn, pool, step_ids, B, run_tokens_of(bn, run), marks, graphs, &sec)) <
                0) {
            fprintf(stderr, "stepq " TOOL ": %s, batch %d: %s\n", va->label, B, fail_text());
            goto out;
        }
        if (run >= bn->o->warmup)
            r->run_s[run - bn->o->warmup] = sec;
        stepq_tool_progress_add(bn->prog, (int64_t)B * run_tokens_of(bn, run));
    }
    {
        double sorted[MAX_RUNS];
        const int n = bn->o->runs;
        memcpy(sorted, r->run_s, sizeof(double) * (size_t)n);
        qsort(sorted, (size_t)n, sizeof(double), cmp_double);
        r->median_s = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
    }
    /* What the last step wrote, and the slots' health: the work was done, and done the same. */
    {
        const size_t n_o = (size_t)B * bn->in->HV * bn->in->V;
        const size_t bytes = n_o * stepq_dtype_size(bn->d->dtype);
        void *o = bn->d->cuda ? malloc(bytes) : bn->d->o;
        stepq_pool_stats st;
        if (!o) {
            ret = STEPQ_ENOMEM;
            goto out;
        }
#if STEPQ_HAVE_CUDA
        if (bn->d->cuda) {
            cudaError_t e = cudaMemcpy(o, bn->d->o, bytes, cudaMemcpyDeviceToHost);
            if (e != cudaSuccess) {
                free(o);
                ret = cu_fail(e, "cudaMemcpy");
                goto out;
            }
        }
#endif
        for (size_t i = 0; i < n_o; i++)
            r->checksum += fabs(bn->d->dtype == STEPQ_DTYPE_BF16
                                    ? (double)float_of_bf16(((const uint16_t *)o)[i])
                                    : (double)((const float *)o)[i]);
        if (bn->d->cuda)
            free(o);
        if ((ret = stepq_pool_get_stats(pool, &st, sizeof(st))) < 0)
            goto out;
        r->health = st.health_any;
    }
    r->ran = 1;
out:
    if (ret < 0 && cu_msg[0]) /* a CUDA call of this tool, not said yet */
        fprintf(stderr, "stepq " TOOL ": %s, batch %d: %s\n", va->label, B, fail_text());
#if STEPQ_HAVE_CUDA
    if (bn->d->cuda && marks)
        for (int i = 0; i < n_marks; i++)
            if (((cudaEvent_t *)marks)[i])
                cudaEventDestroy(((cudaEvent_t *)marks)[i]);
    for (int i = 0; graphs && i < N_BANK; i++)
        if (((cudaGraphExec_t *)graphs)[i])
            cudaGraphExecDestroy(((cudaGraphExec_t *)graphs)[i]);
    free(graphs);
#endif
    free(marks);
    if (pool && stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE) < 0 && ret >= 0) {
        fprintf(stderr, "stepq " TOOL ": %s pool, batch %d: close: %s\n", va->label, B,
                stepq_last_error());
        ret = STEPQ_ECUDA;
    }
    free(ids);
    return ret;
}

/* Batch B's entry in the JSON's batches array (jb NULL: no JSON); its rows array, or NULL. */
static cJSON *json_batch(cJSON *jb, int B)
{
    if (!jb)
        return NULL;
    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "batch", B);
    cJSON_AddItemToArray(jb, e);
    return cJSON_AddArrayToObject(e, "rows");
}

/* Fields of a JSON object: 0 or "" where missing or of another type. */
static double jnum(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

static const char *jstr(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : "";
}

/* --- the peer (--peer) -------------------------------------------------------------- */

/* What a run times, as a peer file must have timed it too. */
struct peer_shape {
    char arch[8];
    int H, HV, K, V, layers, tokens;
    char dtype[8];
};

/* The peer's decode time per batch, from its file. */
struct peer {
    const char *file; /* NULL: no --peer */
    char device[128], kernel[160], launch[16];
    int n;
    int batch[PEER_MAX_BATCHES];
    double decode_s[PEER_MAX_BATCHES];
};

static int peer_fail(const char *file, const char *problem)
{
    fprintf(stderr, "stepq " TOOL ": --peer %s: %s\n", file, problem);
    return 2;
}

/* An integer field in [lo, hi], or lo - 1. */
static int peer_int(const cJSON *o, const char *key, int lo, int hi)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo && v->valuedouble <= hi) ||
        v->valuedouble != floor(v->valuedouble))
        return lo - 1;
    return (int)v->valuedouble;
}

static void peer_shape_text(const struct peer_shape *s, char *buf, size_t len)
{
    snprintf(buf, len, "%s, H=%d, HV=%d, %dx%d, %d layer%s, %d token%s, %s", s->arch, s->H, s->HV,
             s->K, s->V, s->layers, s->layers == 1 ? "" : "s", s->tokens, s->tokens == 1 ? "" : "s",
             s->dtype);
}

/* A string field copied into buf (len > 1), or -1 when it is missing or empty. */
static int peer_str(const cJSON *o, const char *key, char *buf, size_t len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(v) || !v->valuestring || !v->valuestring[0])
        return -1;
    snprintf(buf, len, "%s", v->valuestring);
    return 0;
}

/* The file's batches: each one's decode time; 0, or 2 after one line. */
static int peer_batches(struct peer *p, const cJSON *jb)
{
    char msg[256];
    int i = 0;

    if (!cJSON_IsArray(jb) || cJSON_GetArraySize(jb) < 1)
        return peer_fail(p->file, "batches: missing, or not a non-empty array");
    for (const cJSON *e = jb->child; e; e = e->next, i++) {
        const cJSON *ds = cJSON_GetObjectItemCaseSensitive(e, "decode_s");
        const int B = peer_int(e, "batch", 1, 65535);
        if (B < 1) {
            snprintf(msg, sizeof(msg), "batches[%d].batch: missing, or not an integer in 1..65535",
                     i);
            return peer_fail(p->file, msg);
        }
        if (!cJSON_IsNumber(ds) || !isfinite(ds->valuedouble) || ds->valuedouble <= 0) {
            snprintf(msg, sizeof(msg), "batches[%d].decode_s: missing, or not a finite number > 0",
                     i);
            return peer_fail(p->file, msg);
        }
        for (int k = 0; k < p->n; k++)
            if (p->batch[k] == B) {
                snprintf(msg, sizeof(msg), "batches[%d]: a second entry for batch %d", i, B);
                return peer_fail(p->file, msg);
            }
        if (p->n == PEER_MAX_BATCHES) {
            snprintf(msg, sizeof(msg), "batches: more than %d", PEER_MAX_BATCHES);
            return peer_fail(p->file, msg);
        }
        p->batch[p->n] = B;
        p->decode_s[p->n++] = ds->valuedouble;
    }
    return 0;
}

/*
 * Reads the JSON of tools/scripts/bench_peer_fla.py --decode: {"format": PEER_FORMAT,
 * "version": 1, "device": str, "shape": {"arch", "num_k_heads", "num_v_heads", "head_k_dim",
 * "head_v_dim", "layers"}, "tokens": int, "dtype": str, "batches": [{"batch": int,
 * "decode_s": number > 0, ...}, ...], ...}; other fields are ignored. The shape, tokens and
 * dtype must be the run's (want). Returns 0, or 2 after one line naming the file.
 */
static int peer_load(struct peer *p, const char *file, const struct peer_shape *want)
{
    cJSON *root = NULL;
    char msg[512];
    int rc;

    memset(p, 0, sizeof(*p));
    p->file = file;
    if ((rc = stepq_tool_json_file(TOOL, "--peer", file, PEER_MAX_BYTES, &root)) != 0)
        return rc;
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(root, "shape");
    struct peer_shape got;
    memset(&got, 0, sizeof(got));
    if (strcmp(jstr(root, "format"), PEER_FORMAT))
        rc = peer_fail(file, "not a bench decode peer file (format \"" PEER_FORMAT
                             "\": tools/scripts/bench_peer_fla.py --decode makes one)");
    else if (peer_int(root, "version", 1, 1) != 1)
        rc = peer_fail(file, "version: missing, or not 1");
    else if (peer_str(root, "device", p->device, sizeof(p->device)) < 0)
        rc = peer_fail(file, "device: missing, or not a non-empty string");
    else if (!cJSON_IsObject(sh) || peer_str(sh, "arch", got.arch, sizeof(got.arch)) < 0 ||
             (got.H = peer_int(sh, "num_k_heads", 1, 1 << 16)) < 1 ||
             (got.HV = peer_int(sh, "num_v_heads", 1, 1 << 16)) < 1 ||
             (got.K = peer_int(sh, "head_k_dim", 1, 1 << 16)) < 1 ||
             (got.V = peer_int(sh, "head_v_dim", 1, 1 << 16)) < 1 ||
             (got.layers = peer_int(sh, "layers", 1, 1 << 16)) < 1)
        rc = peer_fail(file, "shape: missing, or not {arch, num_k_heads, num_v_heads, head_k_dim, "
                             "head_v_dim, layers}");
    else if ((got.tokens = peer_int(root, "tokens", 1, 1 << 20)) < 1)
        rc = peer_fail(file, "tokens: missing, or not an integer in 1..1048576");
    else if (peer_str(root, "dtype", got.dtype, sizeof(got.dtype)) < 0)
        rc = peer_fail(file, "dtype: missing, or not a non-empty string");
    else if (strcmp(got.arch, want->arch) || got.H != want->H || got.HV != want->HV ||
             got.K != want->K || got.V != want->V || got.layers != want->layers ||
             got.tokens != want->tokens || strcmp(got.dtype, want->dtype)) {
        char a[160], b[160];
        peer_shape_text(&got, a, sizeof(a));
        peer_shape_text(want, b, sizeof(b));
        snprintf(msg, sizeof(msg),
                 "its shape (%s) is not this run's (%s): time the peer with this run's "
                 "(bench_peer_fla.py --decode or --heads, --layers, --tokens, --dtype)",
                 a, b);
        rc = peer_fail(file, msg);
    } else
        rc = peer_batches(p, cJSON_GetObjectItemCaseSensitive(root, "batches"));
    if (rc == 0) {
        if (peer_str(root, "kernel", p->kernel, sizeof(p->kernel)) < 0)
            snprintf(p->kernel, sizeof(p->kernel), "fla's fp32 kernels");
        if (peer_str(root, "launch", p->launch, sizeof(p->launch)) < 0)
            snprintf(p->launch, sizeof(p->launch), "eager");
    }
    cJSON_Delete(root);
    return rc;
}

/* The peer's decode time of batch B, 0 where it has none (or there is no peer). */
static double peer_decode_s(const struct peer *p, int B)
{
    for (int k = 0; p && p->file && k < p->n; k++)
        if (p->batch[k] == B)
            return p->decode_s[k];
    return 0;
}

/* " %8s" of tps over the peer's tokens/s for the "vs peer" column ("" without --peer). */
static void vs_peer_text(const struct peer *p, int B, int tokens, double tps, char *buf, size_t len)
{
    const double ds = peer_decode_s(p, B);
    char x[16] = "-";

    if (!p->file) {
        buf[0] = 0;
        return;
    }
    if (ds > 0 && tps > 0)
        snprintf(x, sizeof(x), "%.2fx", tps / ((double)B * tokens / ds));
    snprintf(buf, len, " %8s", x);
}

/*
 * The peer's table row of batch B: tokens/s, ms/step and vs fp32, or "-" where it lacks the
 * batch; tail: the rest of the row (the columns the peer has no number for).
 */
static void peer_table_row(FILE *t, const struct peer *p, int B, int tokens, double fp32_tps,
                           int lw, const char *tail)
{
    const double ds = peer_decode_s(p, B);
    char vs[16] = "-";

    if (ds <= 0) {
        stepq_tool_printf(t, "%6d  %-*s %12s %10s %8s %8s%s\n", B, lw, PEER_LABEL, "-", "-", "-",
                          "-", tail);
        return;
    }
    const double tps = (double)B * tokens / ds;
    if (fp32_tps > 0)
        snprintf(vs, sizeof(vs), "%.2fx", tps / fp32_tps);
    stepq_tool_printf(t, "%6d  %-*s %12.1f %10.3f %8s %8s%s\n", B, lw, PEER_LABEL, tps,
                      1e3 * ds / tokens, vs, "-", tail);
}

/* The peer's JSON row of batch B, and its "speedup_vs_peer" on the others (e: one of ours). */
static cJSON *peer_json_row(const struct peer *p, int B, int tokens, double fp32_tps)
{
    const double ds = peer_decode_s(p, B);
    cJSON *e = cJSON_CreateObject();

    cJSON_AddStringToObject(e, "label", PEER_LABEL);
    cJSON_AddBoolToObject(e, "ran", ds > 0);
    if (ds > 0) {
        const double tps = (double)B * tokens / ds;
        cJSON_AddNumberToObject(e, "tokens_per_s", tps);
        cJSON_AddNumberToObject(e, "ms_per_step", 1e3 * ds / tokens);
        cJSON_AddNumberToObject(e, "decode_s", ds);
        cJSON_AddNumberToObject(e, "speedup_vs_fp32", fp32_tps > 0 ? tps / fp32_tps : 0);
        cJSON_AddNumberToObject(e, "transitions", (double)B * tokens);
    } else
        cJSON_AddStringToObject(e, "not_run", "not in the peer file");
    cJSON_AddStringToObject(e, "source", "peer file");
    return e;
}

static void peer_json_speedup(const struct peer *p, cJSON *e, int B, int tokens, double tps)
{
    const double ds = peer_decode_s(p, B);
    if (p->file && tps > 0)
        cJSON_AddNumberToObject(e, "speedup_vs_peer", ds > 0 ? tps / ((double)B * tokens / ds) : 0);
}

/* The root's "peer" object: where the row comes from. */
static void peer_json(const struct peer *p, cJSON *root)
{
    if (!p->file)
        return;
    cJSON *e = cJSON_AddObjectToObject(root, "peer");
    cJSON_AddStringToObject(e, "label", PEER_LABEL);
    cJSON_AddStringToObject(e, "file", p->file);
    cJSON_AddStringToObject(e, "device", p->device);
    cJSON_AddStringToObject(e, "kernel", p->kernel);
    cJSON_AddStringToObject(e, "launch", p->launch);
    cJSON *jb = cJSON_AddArrayToObject(e, "batches");
    for (int k = 0; k < p->n; k++)
        cJSON_AddItemToArray(jb, cJSON_CreateNumber(p->batch[k]));
}

/* The header lines of the peer: what it ran, and where it differs from this run. */
static void peer_header(FILE *t, const struct peer *p, const char *device, int graph)
{
    const size_t n = strlen(p->device);

    if (!p->file)
        return;
    stepq_tool_printf(t, "%-8s " PEER_LABEL ": flash-linear-attention on %s, %s launches,\n",
                      "peer", p->device, p->launch);
    stepq_tool_printf(t, "%-8s %s\n%-8s (from %s, tools/scripts/bench_peer_fla.py --decode)\n", "",
                      p->kernel, "", p->file);
    /* this run's device text is the name and ", N SMs" */
    if (strncmp(device, p->device, n) || (device[n] && device[n] != ','))
        stepq_tool_printf(t, "%-8s NOTE: the peer ran on another device than this run's (%s)\n", "",
                          device);
    if (graph && !strcmp(p->launch, "eager"))
        stepq_tool_printf(t,
                          "%-8s NOTE: this run replays CUDA graphs, the peer launches one call "
                          "at a time\n",
                          "");
}

/* --- setup and report --------------------------------------------------------------- */

/* The table goes to tout: the output, or nowhere with --json. */
static FILE *tout;

/* One map of the run: a MAP file, or a PRESET's stepq layout map at one width. */
struct source {
    const char *target;  /* the MAP|PRESET as given */
    int is_preset, bits; /* bits: a preset's width */
    stepq_map_t *map;    /* owned */
    int row;             /* the variant of its rows: 0 / 1 for an fp32 / bf16 map, else its own */
    char label[96];      /* its rows' label */
};

/* A preset's stepq layout maps, one per width, appended to src. 0, or an exit status. */
static int load_preset(const char *target, const int *bits, int n_bits, struct source *src,
                       int *n_src)
{
    int ret;

    if (!stepq_tool_preset_find(target)) {
        fprintf(stderr, "stepq " TOOL ": unknown preset '%s' (presets: ", target);
        stepq_tool_preset_list(stderr);
        fprintf(stderr, "; or a map file)\n");
        return 2;
    }
    stepq_map_t *probe = NULL;
    /* the preset's unit count sets its pivots: 1 in PRESET_PIVOT_UNIT, as the bundled map */
    if ((ret = stepq_tool_mkmap_build(TOOL, target, STEPQ_METHOD_UNIFORM, PRESET_BITS, 0, NULL,
                                      &probe)) != 0)
        return ret;
    stepq_model_shape sh;
    stepq_map_shape(probe, &sh);
    const long long units = (long long)sh.n_layers * stepq_map_units_per_layer(probe);
    stepq_map_close(probe);
    const long long pivots = (units + PRESET_PIVOT_UNIT / 2) / PRESET_PIVOT_UNIT;
    for (int b = 0; b < n_bits; b++) {
        struct source *e = &src[*n_src];
        e->target = target;
        e->is_preset = 1;
        e->bits = bits[b];
        if ((ret = stepq_tool_mkmap_build(TOOL, target, STEPQ_METHOD_STEPQ, bits[b], pivots, NULL,
                                          &e->map)) != 0)
            return ret;
        (*n_src)++;
    }
    return 0;
}

/* Where shapes a and b differ, as "FIELD (A vs B)" in buf; 0 where they do not. */
static int shape_diff(const stepq_model_shape *a, const stepq_model_shape *b, char *buf, size_t len)
{
    if (a->arch != b->arch) {
        snprintf(buf, len, "arch (%s vs %s)", stepq_arch_name(a->arch), stepq_arch_name(b->arch));
        return 1;
    }
    const struct {
        const char *name;
        int x, y;
    } f[] = { { "recurrent layers", a->n_layers, b->n_layers },
              { "num_k_heads", a->num_k_heads, b->num_k_heads },
              { "num_v_heads", a->num_v_heads, b->num_v_heads },
              { "head_k_dim", a->head_k_dim, b->head_k_dim },
              { "head_v_dim", a->head_v_dim, b->head_v_dim },
              { "conv_rank", a->conv_rank, b->conv_rank } };
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++)
        if (f[i].x != f[i].y) {
            snprintf(buf, len, "%s (%d vs %d)", f[i].name, f[i].x, f[i].y);
            return 1;
        }
    for (int l = 0; l < a->n_layers; l++)
        if (a->layer_ids[l] != b->layer_ids[l]) {
            snprintf(buf, len, "recurrent layer %d's model layer (%d vs %d)", l, a->layer_ids[l],
                     b->layer_ids[l]);
            return 1;
        }
    for (int d = 0; d < a->conv_rank && d < STEPQ_CONV_MAX_RANK; d++)
        if (a->conv_shape[d] != b->conv_shape[d]) {
            snprintf(buf, len, "conv_shape[%d] (%" PRId64 " vs %" PRId64 ")", d, a->conv_shape[d],
                     b->conv_shape[d]);
            return 1;
        }
    if (a->conv_rank && a->conv_dtype != b->conv_dtype) {
        snprintf(buf, len, "conv_dtype (%s vs %s)", stepq_dtype_name(a->conv_dtype),
                 stepq_dtype_name(b->conv_dtype));
        return 1;
    }
    return 0;
}

/*
 * Every map of the run: each MAP file, each PRESET at each --bits width (PRESET_BITS without),
 * in the order given; all of the first one's shape. 0, or an exit status after one line.
 */
static int load_sources(const struct opts *o, struct source *src, int *n_src)
{
    const int def_bits = PRESET_BITS;
    int ret;

    *n_src = 0;
    for (int t = 0; t < o->n_targets; t++) {
        const char *target = o->targets[t];
        if (is_preset_name(target)) {
            if ((ret = load_preset(target, o->n_bits ? o->bits : &def_bits,
                                   o->n_bits ? o->n_bits : 1, src, n_src)) != 0)
                return ret;
            continue;
        }
        struct source *e = &src[*n_src];
        e->target = target;
        if ((ret = stepq_map_load_file(target, NULL, &e->map)) < 0) {
            stepq_tool_path_error(TOOL, target, NULL, stepq_last_error(), ret);
            return 1;
        }
        (*n_src)++;
    }
    stepq_model_shape s0, sk;
    stepq_map_shape(src[0].map, &s0);
    for (int k = 1; k < *n_src; k++) {
        char what[160];
        stepq_map_shape(src[k].map, &sk);
        if (shape_diff(&s0, &sk, what, sizeof(what))) {
            fprintf(stderr,
                    "stepq " TOOL ": %s and %s differ in %s: the maps of one run have one "
                    "model shape\n",
                    src[0].target, src[k].target, what);
            return 2;
        }
    }
    return 0;
}

/* A map's row label: its method, at its budget where it has one ("stepq@6", "fp8 (map)"). */
static void method_label(const stepq_map_t *map, int tag, char *buf, size_t len)
{
    const stepq_method m = stepq_map_method(map);
    if (stepq_method_is_dense(m) || m == STEPQ_METHOD_FP8)
        snprintf(buf, len, "%s%s", stepq_method_name(m), tag ? " (map)" : "");
    else
        snprintf(buf, len, "%s@%g", stepq_method_name(m), stepq_map_budget_bits(map));
}

/* The file name of a path (a preset: itself). */
static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/*
 * The rows of the maps: an fp32 or bf16 map's are the fp32 / bf16 rows (the same pools), every
 * other map gets one after them, va[2..]; *n_va the rows in all. Labels are the method's; two
 * equal ones get the map's file (or preset) name, and should those be equal too, its place.
 */
static void assign_rows(struct source *src, int n_src, struct variant *va, int *n_va)
{
    *n_va = 2;
    for (int k = 0; k < n_src; k++) {
        const stepq_method m = stepq_map_method(src[k].map);
        if (m == STEPQ_METHOD_FP32 || m == STEPQ_METHOD_BF16) {
            src[k].row = m == STEPQ_METHOD_FP32 ? 0 : 1;
            snprintf(src[k].label, sizeof(src[k].label), "%s", va[src[k].row].label);
            continue;
        }
        src[k].row = (*n_va)++;
        method_label(src[k].map, 1, src[k].label, sizeof(src[k].label));
    }
    for (int pass = 0; pass < 2; pass++) {
        int same[MAX_MAPS] = { 0 };
        for (int k = 0; k < n_src; k++)
            for (int j = 0; j < n_src; j++)
                same[k] |= j != k && src[j].row >= 2 && src[k].row >= 2 &&
                           !strcmp(src[j].label, src[k].label);
        for (int k = 0; k < n_src; k++) {
            char l[96];
            if (!same[k])
                continue;
            if (pass == 0) {
                char m[32];
                method_label(src[k].map, 0, m, sizeof(m));
                snprintf(l, sizeof(l), "%.20s (%.64s)", m, base_name(src[k].target));
            } else
                snprintf(l, sizeof(l), "%.80s #%d", src[k].label, k + 1);
            snprintf(src[k].label, sizeof(src[k].label), "%s", l);
        }
    }
    for (int k = 0; k < n_src; k++)
        if (src[k].row >= 2) {
            struct variant *v = &va[src[k].row];
            snprintf(v->label, sizeof(v->label), "%s", src[k].label);
            v->map = src[k].map;
            v->source = src[k].target;
        }
}

/* The root's "maps": every map of the run, where it comes from and the label of its rows. */
static void sources_json(cJSON *root, const struct source *src, int n_src)
{
    cJSON *jm = cJSON_AddArrayToObject(root, "maps");
    for (int k = 0; k < n_src; k++) {
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "source", src[k].target);
        cJSON_AddStringToObject(e, "kind", src[k].is_preset ? "preset" : "map");
        if (src[k].is_preset)
            cJSON_AddNumberToObject(e, "preset_bits", src[k].bits);
        cJSON_AddStringToObject(e, "method", stepq_method_name(stepq_map_method(src[k].map)));
        cJSON_AddStringToObject(e, "label", src[k].label);
        cJSON_AddBoolToObject(e, "own_rows", src[k].row >= 2); /* else fp32's or bf16's */
        cJSON_AddItemToArray(jm, e);
    }
}

/* The header's lines of the maps: where each comes from, and its rows where that is not plain. */
static void source_lines(FILE *t, const struct source *src, int n_src)
{
    for (int k = 0; k < n_src; k++) {
        char def[96], rows[160] = "";
        method_label(src[k].map, 1, def, sizeof(def));
        if (src[k].row < 2)
            snprintf(rows, sizeof(rows), ": %s %s map, timed as the %s rows",
                     src[k].row ? "a" : "an", src[k].label, src[k].label);
        else if (strcmp(def, src[k].label))
            snprintf(rows, sizeof(rows), ": row '%s'", src[k].label);
        if (src[k].is_preset)
            stepq_tool_printf(t, "%-8s %s (its stepq@%d layout map, as stepq mkmap makes it)%s\n",
                              "preset", src[k].target, src[k].bits, rows);
        else
            stepq_tool_printf(t, "%-8s %s%s\n", "map", src[k].target, rows);
    }
}

/* Whether the CUDA backend has a device, through the public API: a pool opens on it. */
static int cuda_available(const stepq_map_t *map, int device, char *why, size_t len)
{
    stepq_pool_config cfg = STEPQ_POOL_CONFIG_INITIALIZER;
    stepq_pool_t *pool = NULL;

    cfg.map = map;
    cfg.device = device;
    cfg.backend = STEPQ_POOL_BACKEND_CUDA;
    cfg.num_slots = 1;
    cfg.min_page_bytes = 0;
    int ret = stepq_pool_open(&cfg, &pool);
    if (ret < 0)
        snprintf(why, len, "%s", stepq_last_error());
    stepq_pool_close(pool, STEPQ_POOL_CLOSE_FORCE);
    return ret >= 0;
}

/*
 * The most a pool of the run may take on this machine (0: unknown): 3/4 of
 * the host's memory, or 9/10 of the device's free memory now (the inputs and
 * the kernels' own buffers take the rest).
 */
static double machine_bytes(int cuda)
{
#if STEPQ_HAVE_CUDA
    if (cuda) {
        size_t free_b = 0, total_b = 0;
        if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        return 0.9 * (double)free_b;
    }
#endif
    (void)cuda;
    long np = sysconf(_SC_PHYS_PAGES), ps = sysconf(_SC_PAGESIZE);
    return np > 0 && ps > 0 ? 0.75 * (double)np * (double)ps : 0;
}

/* --- one process per rank (--procs) -------------------------------------------- */

static int hex_to_id(const char *hex, stepq_tp_id *id)
{
    if (strlen(hex) != 2 * STEPQ_TP_ID_BYTES)
        return -1;
    for (int i = 0; i < STEPQ_TP_ID_BYTES; i++) {
        unsigned x;
        if (sscanf(hex + 2 * i, "%2x", &x) != 1)
            return -1;
        id->bytes[i] = (unsigned char)x;
    }
    return 0;
}

static void id_to_hex(const stepq_tp_id *id, char *hex)
{
    for (int i = 0; i < STEPQ_TP_ID_BYTES; i++)
        snprintf(hex + 2 * i, 3, "%02x", id->bytes[i]);
}

/*
 * The tests' way to make one rank fail where a real failure would: after its
 * setup, before the runs. STEPQ_BENCH_RANK_FAIL=R exits rank R with status 1,
 * R:kill kills it with SIGKILL, R:hang makes it wait until it is stopped.
 */
static int rank_fail_hook(int rank)
{
    const char *v = getenv("STEPQ_BENCH_RANK_FAIL");
    char *end;

    if (!v || !*v || strtol(v, &end, 10) != rank)
        return 0;
    if (!strcmp(end, ":kill"))
        raise(SIGKILL);
    if (!strcmp(end, ":hang"))
        for (;;)
            pause();
    fprintf(stderr, "stepq " TOOL ": rank %d fails, as STEPQ_BENCH_RANK_FAIL=%s asks\n", rank, v);
    return -1;
}

/* A rank's arguments: the parent's, less what only the parent does, plus the rank's. */
static char **child_argv(int argc, char **argv, const char *backend, char *rank_txt,
                         const char *id_hex)
{
    static const char *const flags[] = { "--json", "--full", "--graph", "--procs", NULL };
    char **a = calloc((size_t)argc + 16, sizeof(char *));
    int n = 0;

    if (!a)
        return NULL;
    a[n++] = NULL; /* the executable, set by stepq_tool_ranks_run */
    a[n++] = "bench";
    a[n++] = "decode";
    for (int i = 1; i < argc; i++) {
        int flag = argv[i][0] != '-';
        for (int f = 0; flags[f] && !flag; f++)
            flag = !strcmp(argv[i], flags[f]);
        const int drop = !strcmp(argv[i], "--procs") || !strcmp(argv[i], "--json") ||
                         !strcmp(argv[i], "-o") || !strcmp(argv[i], "--timeout-s") ||
                         !strcmp(argv[i], "--peer");
        if (!drop)
            a[n++] = argv[i];
        if (!flag && i + 1 < argc && !drop)
            a[n++] = argv[i + 1];
        if (!flag)
            i++;
    }
    a[n++] = "--json";
    a[n++] = "--backend";
    a[n++] = (char *)backend;
    a[n++] = "--rank";
    a[n++] = rank_txt;
    a[n++] = "--rank-child";
    if (id_hex) {
        a[n++] = "--nccl-id";
        a[n++] = (char *)id_hex;
    }
    a[n] = NULL;
    return a;
}

/* Row v of batch i of a rank's result, NULL when it has none. */
static const cJSON *rank_row(const cJSON *rank, int i, int v)
{
    const cJSON *b = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(rank, "batches"), i);
    return cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(b, "rows"), v);
}

/*
 * The ranks' results as one: per batch and state the slowest rank's decode
 * time (the median run of each rank, the largest of them), which is what a
 * token of the whole model waits for. j[r]: rank r's JSON. 0, or an exit status.
 */
static int report_procs(const struct opts *o, cJSON **j, int n, int n_dev, const char *nccl,
                        const struct peer *peer, const struct source *src, int n_src)
{
    const cJSON *j0 = j[0];
    const cJSON *states = cJSON_GetObjectItemCaseSensitive(j0, "states");
    const int n_v = cJSON_GetArraySize(states);
    const int n_b = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j0, "batches"));
    const int tokens = (int)jnum(j0, "generated_tokens");
    const int cuda = !strcmp(jstr(j0, "backend"), "cuda");
    struct stepq_tool_out of;
    cJSON *root = NULL, *jb = NULL;
    int rc = 1;

    if (!(of.f = stepq_tool_out_open(&of, TOOL, o->out_path)))
        return 1;
    FILE *t = o->json ? NULL : of.f;
    source_lines(t, src, n_src);
    stepq_tool_printf(t, "%-8s %s (%s, %d recurrent layers)\n", "model", jstr(j0, "model"),
                      jstr(j0, "arch"), (int)jnum(j0, "layers"));
    stepq_tool_printf(t, "%-8s %s (%s), %s, one process per rank\n", "backend", jstr(j0, "backend"),
                      jstr(j0, "device"), jstr(j0, "timing"));
    if (cuda)
        stepq_tool_printf(t, "%-8s rank R on device R mod %d%s; %s\n", "devices", n_dev,
                          n_dev < n ? " (ranks share devices: their times are not a TP run's)" : "",
                          nccl);
    stepq_tool_printf(
        t,
        "%-8s %s%d of %d layers, %d tokens after a %d-token prompt, %d warm-up + "
        "%d runs, median\n",
        "run", cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j0, "reduced")) ? "REDUCED: " : "",
        (int)jnum(j0, "layers_timed"), (int)jnum(j0, "layers"), tokens,
        (int)jnum(j0, "prompt_tokens"), (int)jnum(j0, "warmup"), (int)jnum(j0, "runs"));
    peer_header(t, peer, jstr(j0, "device"), o->graph);
    /* the state column: the longest label, at least 14 (and the peer's) */
    int lw = peer->file ? (int)strlen(PEER_LABEL) + 1 : 14, cw[MAX_VARIANTS];
    for (int v = 0; v < n_v && v < MAX_VARIANTS; v++) {
        const int len = (int)strlen(jstr(cJSON_GetArrayItem(states, v), "label"));
        cw[v] = len > 14 ? len : 14;
        lw = len > lw ? len : lw;
    }
    stepq_tool_printf(
        t, "\nthe state of one request on each rank (all layers), bytes:\n  %4s %8s %5s %5s",
        "rank", "pid", "q/k", "value");
    for (int v = 0; v < n_v; v++)
        stepq_tool_printf(t, " %*s", cw[v], jstr(cJSON_GetArrayItem(states, v), "label"));
    stepq_tool_printf(t, "\n");
    for (int r = 0; r < n; r++) {
        const cJSON *sr = cJSON_GetObjectItemCaseSensitive(j[r], "states");
        stepq_tool_printf(t, "  %4d %8d %5d %5d", r, (int)jnum(j[r], "pid"),
                          (int)jnum(j[r], "num_k_heads_rank"), (int)jnum(j[r], "num_v_heads_rank"));
        for (int v = 0; v < n_v; v++)
            stepq_tool_printf(t, " %*.0f", cw[v],
                              jnum(cJSON_GetArrayItem(sr, v), "state_bytes_per_request"));
        stepq_tool_printf(t, "\n");
    }
    stepq_tool_printf(t, "\n%6s  %-*s %12s %10s %8s%s %8s  %s\n", "batch", lw, "state", "tokens/s",
                      "ms/step", "vs fp32", peer->file ? "  vs peer" : "", "slowest",
                      "ms/step of each rank");
    if (o->json) {
        root = cJSON_CreateObject();
        cJSON_AddBoolToObject(root, "procs", 1);
        cJSON_AddNumberToObject(root, "tp", n);
        cJSON_AddStringToObject(root, "backend", jstr(j0, "backend"));
        cJSON_AddStringToObject(root, "decode_time",
                                "per batch and state the slowest rank's (the largest of the "
                                "ranks' median runs)");
        if (cuda) {
            cJSON_AddNumberToObject(root, "cuda_devices", n_dev);
            cJSON_AddStringToObject(root, "nccl", nccl);
        }
        sources_json(root, src, n_src);
        peer_json(peer, root);
        jb = cJSON_AddArrayToObject(root, "batches");
    }
    for (int i = 0; i < n_b; i++) {
        const int B = (int)jnum(
            cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j0, "batches"), i), "batch");
        double fp32_tps = 0;
        cJSON *jr = json_batch(jb, B);
        for (int v = 0; v < n_v; v++) {
            const char *label = jstr(rank_row(j0, i, v), "label");
            double worst = 0, each[1024];
            int slowest = -1, ran = 1;
            for (int r = 0; r < n; r++) {
                const cJSON *row = rank_row(j[r], i, v);
                ran = ran && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(row, "ran"));
                each[r] = jnum(row, "decode_s");
                if (each[r] > worst)
                    worst = each[r], slowest = r;
            }
            ran = ran && slowest >= 0;
            const double tps = ran ? (double)B * tokens / worst : 0;
            if (v == 0)
                fp32_tps = tps;
            char vs[16] = "-", vp[16];
            if (ran && fp32_tps > 0)
                snprintf(vs, sizeof(vs), "%.2fx", tps / fp32_tps);
            vs_peer_text(peer, B, tokens, tps, vp, sizeof(vp));
            if (ran) {
                stepq_tool_printf(t, "%6d  %-*s %12.1f %10.3f %8s%s %8d ", B, lw, label, tps,
                                  1e3 * worst / tokens, vs, vp, slowest);
                for (int r = 0; r < n; r++)
                    stepq_tool_printf(t, " %.3f", 1e3 * each[r] / tokens);
                stepq_tool_printf(t, "\n");
            } else
                stepq_tool_printf(t, "%6d  %-*s %12s\n", B, lw, label, "not run on every rank");
            if (jr) {
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "label", label);
                cJSON_AddBoolToObject(e, "ran", ran);
                if (ran) {
                    cJSON_AddNumberToObject(e, "decode_s", worst);
                    cJSON_AddNumberToObject(e, "slowest_rank", slowest);
                    cJSON_AddNumberToObject(e, "tokens_per_s", tps);
                    cJSON_AddNumberToObject(e, "ms_per_step", 1e3 * worst / tokens);
                    cJSON_AddNumberToObject(e, "speedup_vs_fp32",
                                            fp32_tps > 0 ? tps / fp32_tps : 0);
                    peer_json_speedup(peer, e, B, tokens, tps);
                }
                cJSON *er = cJSON_AddArrayToObject(e, "decode_s_per_rank");
                for (int r = 0; r < n; r++)
                    cJSON_AddItemToArray(er, cJSON_CreateNumber(each[r]));
                cJSON_AddItemToArray(jr, e);
            }
        }
        if (peer->file) {
            char tail[64];
            snprintf(tail, sizeof(tail), " %8s  one GPU, one rank's heads", "-");
            peer_table_row(t, peer, B, tokens, fp32_tps, lw, tail);
            if (jr)
                cJSON_AddItemToArray(jr, peer_json_row(peer, B, tokens, fp32_tps));
        }
    }
    stepq_tool_printf(
        t,
        "\ntokens/s = batch x generated tokens / the slowest rank's decode time (each "
        "rank's\nmedian run) over the %d timed layer(s); every rank steps all of the "
        "batch's requests\non its own heads. --json: every rank's own results too.\n",
        (int)jnum(j0, "layers_timed"));
    if (peer->file)
        stepq_tool_printf(t, "vs peer: tokens/s over " PEER_LABEL "'s (one GPU timing one rank's "
                             "heads); '-': a batch\nthe peer file lacks.\n");
    if (root) {
        cJSON *jranks = cJSON_AddArrayToObject(root, "ranks");
        for (int r = 0; r < n; r++) {
            cJSON_AddItemToArray(jranks, j[r]);
            j[r] = NULL; /* root owns it now */
        }
        char *text = cJSON_Print(root);
        if (text)
            fprintf(of.f, "%s\n", text);
        free(text);
        cJSON_Delete(root);
        if (!text) {
            stepq_tool_out_discard(&of);
            return 1;
        }
    }
    rc = stepq_tool_out_commit(&of, TOOL) < 0 ? 1 : 0;
    return rc;
}

/* --procs: the parent. Starts every rank, waits for all, reports. An exit status. */
static int run_procs(const struct opts *o, int argc, char **argv, int cuda, const struct peer *peer,
                     const struct source *src, int n_src)
{
    struct stepq_tool_rank *rk = calloc((size_t)o->tp, sizeof(*rk));
    cJSON **j = calloc((size_t)o->tp, sizeof(*j));
    char(*rank_txt)[16] = calloc((size_t)o->tp, sizeof(*rank_txt));
    char hex[2 * STEPQ_TP_ID_BYTES + 1], nccl[128] = "no NCCL: the ranks run alone";
    const char *id_hex = NULL;
    int n_dev = 0, rc = 1;

    if (!rk || !j || !rank_txt) {
        fprintf(stderr, "stepq " TOOL ": out of memory\n");
        goto out;
    }
#if STEPQ_HAVE_CUDA
    if (cuda && cudaGetDeviceCount(&n_dev) != cudaSuccess)
        cudaGetLastError();
#endif
    if (cuda) {
        stepq_tp_id id;
        const int ret = stepq_tp_unique_id(&id);
        if (ret == STEPQ_OK) {
            id_to_hex(&id, hex);
            id_hex = hex;
            snprintf(nccl, sizeof(nccl), "one NCCL communicator, pools checked before the timing");
        } else if (ret != STEPQ_ENOTSUP) {
            fprintf(stderr, "stepq " TOOL ": NCCL unique id: %s\n", stepq_last_error());
            goto out;
        } else
            snprintf(nccl, sizeof(nccl), "no NCCL in this build: the ranks run alone");
    }
    for (int r = 0; r < o->tp; r++) {
        snprintf(rank_txt[r], sizeof(rank_txt[r]), "%d", r);
        if (!(rk[r].argv = child_argv(argc, argv, cuda ? "cuda" : "host", rank_txt[r], id_hex))) {
            fprintf(stderr, "stepq " TOOL ": out of memory\n");
            goto out;
        }
    }
    if (stepq_tool_ranks_run(TOOL, rk, o->tp, o->timeout_s) < 0)
        goto out;
    int n_va = 2; /* the rows a rank times: fp32, bf16 and the maps' own */
    for (int k = 0; k < n_src; k++)
        n_va += src[k].row >= 2;
    for (int r = 0; r < o->tp; r++) {
        j[r] = rk[r].out ? cJSON_Parse(rk[r].out) : NULL;
        if (!j[r] || (int)jnum(j[r], "rank") != r ||
            cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j[r], "states")) != n_va ||
            cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j[r], "batches")) !=
                cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j[0], "batches"))) {
            fprintf(stderr, "stepq " TOOL ": rank %d: its output is not its JSON result\n", r);
            goto out;
        }
    }
    rc = report_procs(o, j, o->tp, n_dev, nccl, peer, src, n_src);
out:
    for (int r = 0; rk && r < o->tp; r++) {
        free(rk[r].argv);
        free(rk[r].out);
        cJSON_Delete(j ? j[r] : NULL);
    }
    free(rk);
    free(j);
    free(rank_txt);
    return rc;
}

int stepq_tool_bench_decode(int argc, char **argv)
{
    struct opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    /* A rank ends with its parent: a parent killed outright (no time to stop its ranks) leaves no
     * rank running, nor one waiting for peers that never come. A parent that died before the
     * request took effect shows as a parent pid other than the one the parent left in the
     * environment (comparing with 1 would refuse a parent that is a container's first process). */
    if (o.child) {
        const char *pp = getenv("STEPQ_RANK_PARENT_PID");
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || !pp || strtol(pp, NULL, 10) != (long)getppid())
            return 1;
    } else if (o.procs) {
        char pid[24];
        snprintf(pid, sizeof(pid), "%ld", (long)getpid());
        setenv("STEPQ_RANK_PARENT_PID", pid, 1);
    }

    stepq_pool_policy policy;
    if (stepq_pool_policy_from_name(o.policy_name, &policy) < 0) {
        fprintf(stderr, "stepq " TOOL ": --policy: %s\n", stepq_last_error());
        return 2;
    }
    const int per = stepq_pool_policy_slots(policy);

    struct variant va[MAX_VARIANTS];
    struct source src[MAX_MAPS];
    int n_src = 0, n_va = 2;
    memset(va, 0, sizeof(va));
    memset(src, 0, sizeof(src));
    if ((rc = load_sources(&o, src, &n_src)) != 0)
        goto out_maps;
    /* The first map: the shape, the CUDA probe, and the preset / map key of the JSON. */
    stepq_map_t *map = src[0].map;
    const int is_preset = src[0].is_preset;
    stepq_model_shape sh;
    stepq_map_shape(map, &sh);
    const char *model = stepq_map_model_name(map)[0] ? stepq_map_model_name(map) : "model";
    struct stepq_tool_out of;
    struct inputs in;
    struct dev d;
    double *log_ret = NULL;
    struct result *res = NULL; /* [batch][variant] */
    stepq_tp_comm_t *comm = NULL;
    struct peer peer;
    memset(&in, 0, sizeof(in));
    memset(&d, 0, sizeof(d));
    memset(&peer, 0, sizeof(peer));
    of.f = NULL;
    rc = 2;

    /* The head split of one rank. */
    if (sh.num_k_heads % o.tp || sh.num_v_heads % o.tp) {
        fprintf(stderr,
                "stepq " TOOL ": --tp %d: %s's %d q/k heads and %d value heads do not split "
                "%d ways\n",
                o.tp, model, sh.num_k_heads, sh.num_v_heads, o.tp);
        goto out;
    }
    if (o.rank >= o.tp) {
        fprintf(stderr, "stepq " TOOL ": --rank %d: want a rank below --tp %d\n", o.rank, o.tp);
        goto out;
    }

    /* A rank of --procs on CUDA: its own device (with NCCL the parent saw to it), else a shared
     * one. */
    int cuda_dev = 0;
#if STEPQ_HAVE_CUDA
    if (o.child && o.backend == STEPQ_POOL_BACKEND_CUDA) {
        int n_dev = 0;
        if (cudaGetDeviceCount(&n_dev) == cudaSuccess && n_dev > 0 &&
            cudaSetDevice(cuda_dev = o.rank % n_dev) != cudaSuccess) {
            fprintf(stderr, "stepq " TOOL ": rank %d: cannot use device %d\n", o.rank, cuda_dev);
            rc = 1;
            goto out;
        }
        cudaGetLastError();
    }
#endif

    /* Backend: cuda where a device exists, else the host with a reduced default. */
    char why[512] = "";
    const int have_cuda = cuda_available(map, cuda_dev, why, sizeof(why));
    if (o.backend == STEPQ_POOL_BACKEND_CUDA && !have_cuda) {
        fprintf(stderr, "stepq " TOOL ": --backend cuda: cannot open a CUDA pool: %s\n", why);
        rc = 1;
        goto out;
    }
    const int fell_back = o.backend < 0 && !have_cuda;
    if (o.backend < 0)
        o.backend = have_cuda ? STEPQ_POOL_BACKEND_CUDA : STEPQ_POOL_BACKEND_HOST;
    const int cuda = o.backend == STEPQ_POOL_BACKEND_CUDA;
    if (o.graph && !cuda) {
        fprintf(stderr, "stepq " TOOL ": --graph: CUDA graphs need the CUDA backend\n");
        goto out;
    }
#if STEPQ_HAVE_CUDA && STEPQ_HAVE_NCCL
    /* NCCL refuses two ranks of one communicator on one device, and only at comm init, after
     * every rank has started: say it here instead. Without NCCL the ranks run alone. */
    if (o.procs && cuda) {
        int n_dev = 0;
        if (cudaGetDeviceCount(&n_dev) != cudaSuccess) {
            cudaGetLastError();
            n_dev = 0;
        }
        if (n_dev < o.tp) {
            fprintf(stderr,
                    "stepq " TOOL ": --tp %d --procs: %d ranks need %d CUDA devices (one rank "
                    "per device for NCCL), this host has %d; without --procs, --tp %d times "
                    "one rank's share\n",
                    o.tp, o.tp, o.tp, n_dev, o.tp);
            goto out;
        }
    }
#endif
    const int reduce = !cuda && !o.full;
    if (!o.n_b) {
        const int *b = reduce ? host_batches : paper_batches;
        o.n_b = reduce ? 2 : 5;
        memcpy(o.batches, b, sizeof(int) * (size_t)o.n_b);
    }
    if (!o.tokens)
        o.tokens = reduce ? HOST_TOKENS : PAPER_TOKENS;
    if (!o.prompt)
        o.prompt = PAPER_PROMPT;
    if (!o.warmup_tokens || o.warmup_tokens > o.tokens)
        o.warmup_tokens = o.tokens;
    if (o.layers > sh.n_layers) {
        fprintf(stderr, "stepq " TOOL ": --layers %d: %s has %d recurrent layers\n", o.layers,
                model, sh.n_layers);
        goto out;
    }
    const int layers = o.layers > 0                ? o.layers
                       : o.layers < 0 || !reduce   ? sh.n_layers
                       : sh.n_layers < HOST_LAYERS ? sh.n_layers
                                                   : HOST_LAYERS;
    const int reduced = layers < sh.n_layers || o.tokens < PAPER_TOKENS;

    /* --peer: read and checked against what this run times, before any work. */
    if (o.peer_path) {
        struct peer_shape want;
        memset(&want, 0, sizeof(want));
        snprintf(want.arch, sizeof(want.arch), "%s", stepq_arch_name(sh.arch));
        snprintf(want.dtype, sizeof(want.dtype), "%s", stepq_dtype_name(o.dtype));
        want.H = sh.num_k_heads / o.tp, want.HV = sh.num_v_heads / o.tp;
        want.K = sh.head_k_dim, want.V = sh.head_v_dim;
        want.layers = layers, want.tokens = o.tokens;
        if (peer_load(&peer, o.peer_path, &want) != 0)
            goto out;
    }

    /* The dense maps of the same shape, and every variant's page on this rank. */
    int ret;
    if ((ret = stepq_map_create(&sh, STEPQ_METHOD_FP32, 32, &va[0].map)) < 0 ||
        (ret = stepq_map_create(&sh, STEPQ_METHOD_BF16, 16, &va[1].map)) < 0) {
        fprintf(stderr, "stepq " TOOL ": dense maps: %s\n", stepq_last_error());
        rc = 1;
        goto out;
    }
    snprintf(va[0].label, sizeof(va[0].label), "fp32");
    snprintf(va[1].label, sizeof(va[1].label), "bf16");
    assign_rows(src, n_src, va, &n_va);
    stepq_pool_config base = STEPQ_POOL_CONFIG_INITIALIZER;
    base.backend = cuda ? STEPQ_POOL_BACKEND_CUDA : STEPQ_POOL_BACKEND_HOST;
    base.device = cuda_dev;
    base.tp_size = o.tp;
    base.policy = policy;
    /* The rank timed: the one with the largest pages of the maps together (the slowest), unless
     * named. */
    {
        uint64_t best = 0;
        int best_rank = 0;
        for (int r = 0; r < o.tp; r++) {
            uint64_t pages = 0;
            for (int k = 0; k < n_src; k++) {
                stepq_pool_config c = base;
                stepq_pool_plan_info p;
                c.map = src[k].map;
                c.tp_rank = r;
                c.num_slots = 1;
                if ((ret = stepq_pool_plan(&c, &p)) < 0) {
                    fprintf(stderr, "stepq " TOOL ": --tp %d: %s: %s\n", o.tp, src[k].target,
                            stepq_last_error());
                    goto out;
                }
                pages += p.page_bytes;
            }
            if (pages > best)
                best = pages, best_rank = r;
        }
        if (o.rank < 0)
            o.rank = best_rank;
    }
    base.tp_rank = o.rank;
    const double budget = o.budget_gib * GIB;
    for (int v = 0; v < n_va; v++) {
        stepq_pool_config c = base;
        uint64_t max_page = 0;
        c.map = va[v].map;
        c.num_slots = 1;
        /* every rank's page padded to the largest, as the TP layer will */
        for (int r = 0; r < o.tp; r++) {
            stepq_pool_plan_info p;
            c.tp_rank = r;
            if ((ret = stepq_pool_plan(&c, &p)) < 0) {
                fprintf(stderr, "stepq " TOOL ": %s: %s\n", va[v].label, stepq_last_error());
                goto out;
            }
            if (p.page_bytes > max_page)
                max_page = p.page_bytes;
        }
        c.tp_rank = o.rank;
        c.min_page_bytes = max_page;
        if ((ret = stepq_pool_plan(&c, &va[v].plan)) < 0) {
            fprintf(stderr, "stepq " TOOL ": %s: %s\n", va[v].label, stepq_last_error());
            goto out;
        }
        va[v].state_bytes = va[v].plan.state_bytes;
        /* The largest batch under the policy: the pool's own sizing for the budget. */
        stepq_pool_plan_info fit;
        c.num_slots = 0;
        c.memory_budget_bytes = (uint64_t)budget;
        ret = stepq_pool_plan(&c, &fit);
        va[v].max_batch = ret >= 0 ? fit.slots / per : 0;
    }

    /* Every batch must fit: a map's pool of B slots (the smallest of the maps') in the budget and
     * on this machine; the maps' over it show so in their rows. */
    const double machine = machine_bytes(cuda);
    int smallest = src[0].row;
    for (int k = 1; k < n_src; k++)
        if (va[src[k].row].plan.page_bytes < va[smallest].plan.page_bytes)
            smallest = src[k].row;
    for (int i = 0; i < o.n_b; i++) {
        const double need = (double)(o.batches[i] + 1) * (double)va[smallest].plan.page_bytes;
        const int reason = over(need, budget, machine);
        if (reason == OVER_BUDGET)
            fprintf(stderr,
                    "stepq " TOOL ": --batch %d: the %s pool of %d slots + 1 needs %.2f GiB on "
                    "rank %d, more than --budget-gib %g\n",
                    o.batches[i], va[smallest].label, o.batches[i], need / GIB, o.rank,
                    o.budget_gib);
        else if (reason)
            fprintf(stderr,
                    "stepq " TOOL ": --batch %d: the %s pool of %d slots + 1 needs %.2f GiB, "
                    "more than the %.2f GiB %s\n",
                    o.batches[i], va[smallest].label, o.batches[i], need / GIB, machine / GIB,
                    cuda ? "free on the device (9/10 of it)" : "of 3/4 of this machine's memory");
        if (reason)
            goto out;
    }

    if (fell_back)
        fprintf(stderr, "stepq " TOOL ": the host backend (no CUDA pool: %s)\n", why);
    /* --procs: every check above passed here, before any rank starts. */
    if (o.procs) {
        rc = run_procs(&o, argc, argv, cuda, &peer, src, n_src);
        goto out;
    }

    /* Setup: gates (the first map's with statistics, if any) and inputs. */
    int from_map = 0, gate_src = 0;
    for (int k = n_src - 1; k >= 0; k--) {
        stepq_unit_stats us = STEPQ_UNIT_STATS_INITIALIZER;
        if (stepq_map_unit_stats(src[k].map, 0, 0, &us) == STEPQ_OK)
            gate_src = k;
    }
    rc = 1;
    if (!(log_ret = unit_log_retention(src[gate_src].map, layers, &from_map)) ||
        !(res = calloc((size_t)o.n_b * (size_t)n_va, sizeof(*res)))) {
        fprintf(stderr, "stepq " TOOL ": out of memory\n");
        goto out;
    }
    d.cuda = cuda;
    d.dtype = o.dtype;
#if STEPQ_HAVE_CUDA
    if (cuda) {
        cudaStream_t s;
        cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        if (e != cudaSuccess) {
            cu_fail(e, "cudaStreamCreate");
            fprintf(stderr, "stepq " TOOL ": %s\n", fail_text());
            goto out;
        }
        d.stream = s;
        base.stream = s;
    }
#endif
    if (o.child && o.nccl_id) {
        stepq_tp_id id;
        stepq_tp_comm_config cc = STEPQ_TP_COMM_CONFIG_INITIALIZER;
        cc.device = cuda_dev;
        if (hex_to_id(o.nccl_id, &id) < 0) {
            fprintf(stderr, "stepq " TOOL ": --nccl-id: want %d bytes in hex\n", STEPQ_TP_ID_BYTES);
            goto out;
        }
        if (stepq_tp_comm_init(&id, o.rank, o.tp, &cc, &comm) < 0) {
            fprintf(stderr, "stepq " TOOL ": rank %d of %d: NCCL: %s\n", o.rank, o.tp,
                    stepq_last_error());
            goto out;
        }
    }
    if (!(of.f = stepq_tool_out_open(&of, TOOL, o.out_path)))
        goto out;
    tout = o.json ? NULL : of.f;

    char device[320] = "C reference, one CPU thread";
#if STEPQ_HAVE_CUDA
    if (cuda) {
        struct cudaDeviceProp prop;
        int dev = 0;
        cudaGetDevice(&dev);
        if (cudaGetDeviceProperties(&prop, dev) == cudaSuccess)
            snprintf(device, sizeof(device), "%s, %d SMs", prop.name, prop.multiProcessorCount);
    }
#endif
    const int Hl = sh.num_k_heads / o.tp, HVl = sh.num_v_heads / o.tp;
    char batches_txt[256] = "";
    char wu_txt[48] = ""; /* " (N tokens)" for a short warm-up */
    if (o.warmup && o.warmup_tokens < o.tokens)
        snprintf(wu_txt, sizeof(wu_txt), " (%d tokens)", o.warmup_tokens);
    for (int i = 0, n = 0; i < o.n_b; i++)
        n += snprintf(batches_txt + n, sizeof(batches_txt) - (size_t)n, "%s%d", i ? "," : "",
                      o.batches[i]);
    source_lines(tout, src, n_src);
    stepq_tool_printf(tout, "%-8s %s (%s, %d recurrent layers, H=%d, HV=%d, %dx%d)\n", "model",
                      model, stepq_arch_name(sh.arch), sh.n_layers, sh.num_k_heads, sh.num_v_heads,
                      sh.head_k_dim, sh.head_v_dim);
    stepq_tool_printf(
        tout,
        "%-8s the recurrent-state path only: prefill pack, then per token every timed\n"
        "%-8s layer's stepq_pool_decode_step; no attention, MLP, conv or sampling work\n",
        "measures", "");
    stepq_tool_printf(tout, "%-8s %s (%s), %s\n", "backend", cuda ? "cuda" : "host", device,
                      !cuda     ? "CLOCK_MONOTONIC"
                      : o.graph ? "CUDA events, a CUDA graph per token"
                                : "CUDA events");
    stepq_tool_printf(tout, "%-8s tp %d, rank %d: %d q/k + %d value heads\n", "heads", o.tp, o.rank,
                      Hl, HVl);
    stepq_tool_printf(
        tout, "%-8s %s q, k, v, g, beta and o (as a server holds them), fp32 prompt states\n",
        "tensors", stepq_dtype_name(o.dtype));
    stepq_tool_printf(tout,
                      "%-8s %s%d of %d layers, batches %s, %d tokens after a %d-token prompt,\n"
                      "%-8s %d warm-up%s + %d runs, median\n",
                      "run", reduced ? "REDUCED: " : "", layers, sh.n_layers, batches_txt, o.tokens,
                      o.prompt, "", o.warmup, wu_txt, o.runs);
    if (reduced && !cuda)
        stepq_tool_printf(
            tout,
            "%-8s the host default (seconds on 2 cores); the paper's protocol: --full\n"
            "%-8s (hours on the host), or a CUDA build on a GPU (--backend cuda)\n",
            "", "");
    else if (reduced)
        stepq_tool_printf(tout, "%-8s the paper's protocol: every layer, --tokens %d\n", "",
                          PAPER_TOKENS);
    if (from_map && n_src == 1)
        stepq_tool_printf(tout, "%-8s the map's per-unit log retention, +-50%% per request\n",
                          "gates");
    else if (from_map)
        stepq_tool_printf(tout, "%-8s %s's per-unit log retention, +-50%% per request\n", "gates",
                          src[gate_src].target);
    else
        stepq_tool_printf(
            tout,
            "%-8s none in the map%s: half-lives log-uniform in [%g, %g] tokens per unit,\n"
            "%-8s +-50%% per request\n",
            "gates", n_src > 1 ? "s" : "", HALF_LIFE_MIN, HALF_LIFE_MAX, "");
    stepq_tool_printf(tout,
                      "\nmemory per request on rank %d (all %d layers) and the largest batch in "
                      "--budget-gib %g\nunder %s (%d slots per request + 1 sentinel):\n",
                      o.rank, sh.n_layers, o.budget_gib, stepq_pool_policy_name(policy), per);
    /* the state column: the longest label, at least 14 (and the peer's in the batch table) */
    int lw = 14;
    for (int v = 0; v < n_va; v++)
        if ((int)strlen(va[v].label) > lw)
            lw = (int)strlen(va[v].label);
    stepq_tool_printf(tout, "  %-*s %14s %12s %14s %10s\n", lw, "state", "state B", "state MiB",
                      "slot B", "max batch");
    for (int v = 0; v < n_va; v++)
        stepq_tool_printf(tout, "  %-*s %14" PRIu64 " %12.4f %14" PRIu64 " %10" PRId32 "\n", lw,
                          va[v].label, va[v].state_bytes, (double)va[v].state_bytes / MIB,
                          va[v].plan.page_bytes, va[v].max_batch);

    if (o.child && rank_fail_hook(o.rank) < 0)
        goto out;

    /* The runs. */
    struct stepq_tool_progress prog;
    struct bench bn = { &o, base, &in, &d, layers, o.tokens, &prog, comm };
    int64_t work = 0;
    for (int i = 0; i < o.n_b; i++)
        work += n_va * variant_work(&bn, o.batches[i]);
    stepq_tool_progress_begin(&prog, TOOL, "tokens", work);
    int failed = 0;
    for (int i = 0; i < o.n_b && !failed; i++) {
        const int B = o.batches[i];
        if ((ret = inputs_make(&in, &sh, o.tp, o.rank * HVl, B, layers, o.prompt, log_ret)) < 0 ||
            (ret = dev_load(&d, &in, layers)) < 0) {
            fprintf(stderr, "stepq " TOOL ": inputs for batch %d: %s\n", B,
                    ret == STEPQ_ENOMEM ? "out of memory" : fail_text());
            failed = 1;
            break;
        }
        for (int v = 0; v < n_va && !failed; v++) {
            struct result *r = &res[(size_t)i * n_va + v];
            const double need = (double)(B + 1) * (double)va[v].plan.page_bytes;
            if ((r->over = over(need, budget, machine))) {
                stepq_tool_progress_add(&prog, variant_work(&bn, B));
                continue; /* not run, said in the table */
            }
            failed = run_variant(&bn, &va[v], B, r) < 0;
        }
    }
    stepq_tool_progress_end(&prog);
    if (failed) {
        stepq_tool_out_discard(&of);
        goto out;
    }

    peer_header(tout, &peer, device, o.graph);
    if (peer.file && lw < (int)strlen(PEER_LABEL) + 1)
        lw = (int)strlen(PEER_LABEL) + 1;
    stepq_tool_printf(tout, "\n%6s  %-*s %12s %10s %8s%s %12s %12s %8s\n", "batch", lw, "state",
                      "tokens/s", "ms/step", "vs fp32", peer.file ? "  vs peer" : "", "state MiB",
                      "pool GiB", "fits");
    cJSON *root = o.json ? cJSON_CreateObject() : NULL, *jb = NULL;
    if (root) {
        cJSON_AddStringToObject(root, "measures",
                                "recurrent-state path only (prefill pack + every timed layer's "
                                "decode step); no attention or MLP layers");
        cJSON_AddStringToObject(root, is_preset ? "preset" : "map", src[0].target);
        sources_json(root, src, n_src);
        cJSON_AddStringToObject(root, "model", model);
        cJSON_AddStringToObject(root, "arch", stepq_arch_name(sh.arch));
        cJSON_AddStringToObject(root, "backend", cuda ? "cuda" : "host");
        cJSON_AddStringToObject(root, "device", device);
        cJSON_AddStringToObject(root, "timing", cuda ? "cuda events" : "clock_monotonic");
        cJSON_AddBoolToObject(root, "reduced", reduced);
        cJSON_AddBoolToObject(root, "graphs", o.graph);
        cJSON_AddStringToObject(root, "dtype", stepq_dtype_name(o.dtype));
        cJSON_AddNumberToObject(root, "tp", o.tp);
        cJSON_AddNumberToObject(root, "rank", o.rank);
        if (o.child) {
            cJSON_AddNumberToObject(root, "pid", (double)getpid());
            cJSON_AddNumberToObject(root, "cuda_device", cuda ? cuda_dev : -1);
            cJSON_AddBoolToObject(root, "nccl", comm != NULL);
        }
        cJSON_AddNumberToObject(root, "num_k_heads_rank", Hl);
        cJSON_AddNumberToObject(root, "num_v_heads_rank", HVl);
        cJSON_AddNumberToObject(root, "layers", sh.n_layers);
        cJSON_AddNumberToObject(root, "layers_timed", layers);
        cJSON_AddNumberToObject(root, "prompt_tokens", o.prompt);
        cJSON_AddNumberToObject(root, "generated_tokens", o.tokens);
        cJSON_AddNumberToObject(root, "warmup", o.warmup);
        cJSON_AddNumberToObject(root, "warmup_tokens", o.warmup_tokens);
        cJSON_AddNumberToObject(root, "runs", o.runs);
        cJSON_AddStringToObject(root, "gates", from_map ? "map statistics" : "fallback half-lives");
        if (from_map)
            cJSON_AddStringToObject(root, "gates_from", src[gate_src].target);
        cJSON_AddStringToObject(root, "policy", stepq_pool_policy_name(policy));
        cJSON_AddNumberToObject(root, "policy_slots", per);
        cJSON_AddNumberToObject(root, "budget_bytes", budget);
        peer_json(&peer, root);
        cJSON *jv = cJSON_AddArrayToObject(root, "states");
        for (int v = 0; v < n_va; v++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "label", va[v].label);
            if (va[v].source)
                cJSON_AddStringToObject(e, "source", va[v].source);
            cJSON_AddStringToObject(e, "method", stepq_method_name(stepq_map_method(va[v].map)));
            cJSON_AddNumberToObject(e, "bits", stepq_map_budget_bits(va[v].map));
            cJSON_AddNumberToObject(e, "state_bytes_per_request", (double)va[v].state_bytes);
            cJSON_AddNumberToObject(e, "state_bytes_compact_per_request",
                                    (double)va[v].plan.state_bytes_compact);
            cJSON_AddNumberToObject(e, "conv_bytes_per_request", (double)va[v].plan.conv_bytes);
            cJSON_AddNumberToObject(e, "slot_bytes", (double)va[v].plan.page_bytes);
            cJSON_AddNumberToObject(e, "max_batch", va[v].max_batch);
            cJSON_AddItemToArray(jv, e);
        }
        jb = cJSON_AddArrayToObject(root, "batches");
    }
    for (int i = 0; i < o.n_b; i++) {
        const int B = o.batches[i];
        const struct result *r0 = &res[(size_t)i * n_va];
        const double fp32_tps = r0->ran ? (double)B * o.tokens / r0->median_s : 0;
        cJSON *jr = json_batch(jb, B);
        for (int v = 0; v < n_va; v++) {
            const struct result *r = &res[(size_t)i * n_va + v];
            const double tps = r->ran ? (double)B * o.tokens / r->median_s : 0;
            const double state = (double)B * (double)va[v].state_bytes;
            const double pool = ((double)per * B + 1) * (double)va[v].plan.page_bytes;
            const int fits = B <= va[v].max_batch;
            char vp[16];
            vs_peer_text(&peer, B, o.tokens, r->ran ? tps : 0, vp, sizeof(vp));
            if (r->ran) {
                char vs[16] = "-";
                if (fp32_tps > 0)
                    snprintf(vs, sizeof(vs), "%.2fx", tps / fp32_tps);
                stepq_tool_printf(tout, "%6d  %-*s %12.1f %10.3f %8s%s %12.2f %12.2f %8s%s\n", B,
                                  lw, va[v].label, tps, 1e3 * r->median_s / o.tokens, vs, vp,
                                  state / MIB, pool / GIB, fits ? "yes" : "no",
                                  r->health ? "  (health words set)" : "");
            } else
                stepq_tool_printf(tout, "%6d  %-*s %12s %10s %8s%s %12.2f %12.2f %8s\n", B, lw,
                                  va[v].label,
                                  r->over == OVER_BUDGET   ? "over budget"
                                  : r->over == OVER_MEMORY ? "over memory"
                                                           : "unsupported",
                                  "-", "-", vp, state / MIB, pool / GIB, fits ? "yes" : "no");
            if (jr) {
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "label", va[v].label);
                cJSON_AddBoolToObject(e, "ran", r->ran);
                if (!r->ran)
                    cJSON_AddStringToObject(e, "not_run",
                                            r->over == OVER_BUDGET ? "pool over --budget-gib"
                                            : r->over == OVER_MEMORY
                                                ? "pool over the machine's memory"
                                                : "the backend lacks its steps");
                if (r->ran) {
                    cJSON_AddNumberToObject(e, "tokens_per_s", tps);
                    cJSON_AddNumberToObject(e, "ms_per_step", 1e3 * r->median_s / o.tokens);
                    cJSON_AddNumberToObject(e, "decode_s", r->median_s);
                    cJSON *rs = cJSON_AddArrayToObject(e, "run_s");
                    for (int k = 0; k < o.runs; k++)
                        cJSON_AddItemToArray(rs, cJSON_CreateNumber(r->run_s[k]));
                    cJSON_AddNumberToObject(e, "speedup_vs_fp32",
                                            fp32_tps > 0 ? tps / fp32_tps : 0);
                    peer_json_speedup(&peer, e, B, o.tokens, tps);
                    cJSON_AddNumberToObject(e, "output_checksum", r->checksum);
                    cJSON_AddNumberToObject(e, "health", r->health);
                }
                cJSON_AddNumberToObject(e, "transitions", (double)B * o.tokens);
                cJSON_AddNumberToObject(e, "state_bytes", state);
                cJSON_AddNumberToObject(e, "running_pool_bytes",
                                        (double)(B + 1) * (double)va[v].plan.page_bytes);
                cJSON_AddNumberToObject(e, "reserved_pool_bytes", pool);
                cJSON_AddBoolToObject(e, "fits_budget", fits);
                cJSON_AddItemToArray(jr, e);
            }
        }
        if (peer.file) {
            char tail[64];
            snprintf(tail, sizeof(tail), " %12s %12s %8s", "-", "-", "-");
            peer_table_row(tout, &peer, B, o.tokens, fp32_tps, lw, tail);
            if (jr)
                cJSON_AddItemToArray(jr, peer_json_row(&peer, B, o.tokens, fp32_tps));
        }
    }
    stepq_tool_printf(
        tout,
        "\ntokens/s = batch x generated tokens / decode time (the median run) over the %d "
        "timed\nlayer(s); ms/step: one token of all of them. state MiB: batch x the state "
        "of all %d\nlayers; pool GiB: (%d x batch + 1) slots; fits: within --budget-gib "
        "%g.\n",
        layers, sh.n_layers, per, o.budget_gib);
    if (peer.file)
        stepq_tool_printf(tout, "vs peer: tokens/s over " PEER_LABEL "'s (the same protocol on its "
                                "kernels); '-': a batch\nthe peer file lacks.\n");
    rc = 0;
    if (root) {
        char *text = cJSON_Print(root);
        if (text)
            fprintf(of.f, "%s\n", text);
        else
            rc = 1;
        free(text);
        cJSON_Delete(root);
    }
    if (stepq_tool_out_commit(&of, TOOL) < 0)
        rc = 1;
out:
    if (comm && stepq_tp_comm_close(comm) < 0 && rc == 0) {
        fprintf(stderr, "stepq " TOOL ": rank %d: NCCL close: %s\n", o.rank, stepq_last_error());
        rc = 1;
    }
    dev_release(&d);
#if STEPQ_HAVE_CUDA
    if (d.stream)
        cudaStreamDestroy((cudaStream_t)d.stream);
#endif
    inputs_free(&in);
    free(res);
    free(log_ret);
    for (int v = 0; v < 2; v++) /* the others are the sources' */
        stepq_map_close(va[v].map);
out_maps:
    for (int k = 0; k < n_src; k++)
        stepq_map_close(src[k].map);
    return rc;
}
