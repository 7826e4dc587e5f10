/*
 * The checkasm framework (checkasm.h): the command line, the check names and
 * their seeds, pass/fail accounting, and bench_new.
 *
 * usage: checkasm [--bench] [--test SUBSTRING] [--list] [--seed N]
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda.h"
#include "plugin/hash.h"
#include "tests/checkasm/checkasm.h"

static struct {
    const char *test; /* --test: only checks whose name contains it */
    int list, bench, small;
    uint64_t seed;
    char name[256]; /* the running check */
    int failed;     /* checkasm_fail() was called in it */
    int n_pass, n_fail, n_listed;
    struct fx_rng rng;
} state;

int checkasm_check(const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(state.name, sizeof(state.name), fmt, ap);
    va_end(ap);
    if (state.test && !strstr(state.name, state.test))
        return 0;
    if (state.list) {
        printf("%s\n", state.name);
        state.n_listed++;
        return 0;
    }
    state.failed = 0;
    /* by name: a check's data does not depend on which other checks ran before it */
    state.rng.s = stepq__fnv1a(STEPQ__FNV_OFFSET ^ state.seed, state.name, strlen(state.name));
    if (!state.rng.s)
        state.rng.s = 1; /* xorshift's one fixed point */
    fflush(stdout);
    return 1;
}

void checkasm_report(int failed)
{
    failed = failed || state.failed;
    if (failed)
        state.n_fail++;
    else
        state.n_pass++;
    printf("%s %s\n", failed ? "FAIL" : "ok  ", state.name);
    fflush(stdout);
}

int checkasm_fail(const char *file, int line, const char *fmt, ...)
{
    va_list ap;

    printf("FAIL %s (%s:%d): ", state.name, file, line);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    state.failed = 1;
    return 1;
}

void checkasm_note(const char *fmt, ...)
{
    va_list ap;

    printf("  ");
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
}

struct fx_rng *checkasm_rng(void)
{
    return &state.rng;
}

int checkasm_small(void)
{
    return state.small;
}

int checkasm_benchmarking(void)
{
    return state.bench;
}

int checkasm_bench(fx_launch_fn launch, void *ctx, void *stream)
{
    double us;
    int ret = fx_time_us(launch, ctx, stream, &us);

    if (ret < 0)
        return checkasm_fail(__FILE__, __LINE__, "bench: %s", stepq_last_error());
    printf("  bench: %.1f us (CUDA events, median of %d after %d warm-up launches)\n", us,
           FX_TIME_RUNS, FX_TIME_WARMUP);
    return 0;
}

static int usage(FILE *f)
{
    fprintf(f, "usage: checkasm [--bench] [--test SUBSTRING] [--list] [--seed N]\n"
               "  Checks every CUDA kernel against the C reference (host pool vs CUDA pool\n"
               "  from the same map, or the internal entries where the pool does not reach).\n"
               "  --bench: also time each check's CUDA call (CUDA events, median).\n"
               "  --test: only the checks whose name contains SUBSTRING. --list: print the\n"
               "  names (no device needed). --seed: another seed for every check's data.\n"
               "  SANITIZE=1: the small mode for compute-sanitizer. Exit 77: no device.\n");
    return f == stdout ? 0 : 2;
}

int main(int argc, char **argv)
{
    static void (*const families[])(void) = {
        checkasm_check_decode,
        checkasm_check_pack,
        checkasm_check_unpack,
        checkasm_check_dense,
    };
    const char *san = getenv("SANITIZE");

    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--bench"))
            state.bench = 1;
        else if (!strcmp(argv[i], "--list"))
            state.list = 1;
        else if (!strcmp(argv[i], "--test") && i + 1 < argc)
            state.test = argv[++i];
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            state.seed = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return usage(stdout);
        else
            return usage(stderr);
    }
    state.small = san && atoi(san) > 0;
    if (!state.list && stepq__cuda_device_count() < 1) {
        printf("SKIP: no CUDA device (cudaGetDeviceCount found none)\n");
        return 77;
    }
    for (size_t f = 0; f < sizeof(families) / sizeof(families[0]); f++)
        families[f]();
    if (state.list) {
        printf("%d checks%s\n", state.n_listed, state.small ? " (SANITIZE=1)" : "");
        return 0;
    }
    if (state.n_pass + state.n_fail == 0) {
        printf("no check's name contains '%s'\n", state.test ? state.test : "");
        return 2;
    }
    printf("\n%d passed, %d failed%s\n", state.n_pass, state.n_fail,
           state.small ? " (SANITIZE=1 small mode)" : "");
    return state.n_fail ? 1 : 0;
}
