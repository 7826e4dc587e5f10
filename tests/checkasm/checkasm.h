/*
 * checkasm for the CUDA kernels (dav1d's tests/checkasm is the model): every
 * kernel family (decode step, pack, unpack, dense step: one file each) runs
 * its checks through the same loop:
 *
 *     if (!checkasm_check("decode gdn stepq@6 B=12 ...", ...)) continue;
 *     call_ref  the host pool (the C reference), or the reference entry
 *     call_new  the CUDA pool, or a CUDA entry chosen by an explicit argument
 *     compare   within the named tolerances; a failure names the element
 *     bench_new checkasm_bench(): the CUDA call timed with CUDA events
 *               (median after warm-up) when run with --bench
 *     checkasm_report(rc)
 *
 * Names are built from the parameters, so --test SUBSTRING selects by them
 * and --list prints them (without a device). Each check draws its random
 * numbers from a generator seeded by its name (and --seed), so a check gives
 * the same data alone as in the full run. SANITIZE=1 in the environment
 * selects the small mode for compute-sanitizer (fewer, smaller checks: the
 * sanitizers see each kernel once or twice). Without a CUDA device the
 * binary exits 77 (meson's skip).
 */
#ifndef STEPQ_TESTS_CHECKASM_CHECKASM_H
#define STEPQ_TESTS_CHECKASM_CHECKASM_H

#include <stdint.h>

#include "tests/checkasm/fixture.h"
#include "tests/checkasm/timing.h"

#if defined(__GNUC__)
#define CHECKASM_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define CHECKASM_PRINTF(f, a)
#endif

/* The families, in the order they run (decode.c, pack.c, unpack.c, dense.c). */
void checkasm_check_decode(void);
void checkasm_check_pack(void);
void checkasm_check_unpack(void);
void checkasm_check_dense(void);

/**
 * Starts the check named by fmt: returns 1 when it is to run (its name
 * contains --test's string and the run is not --list), 0 to skip it. A check
 * that runs ends with checkasm_report(). Seeds checkasm_rng() from the name.
 */
int checkasm_check(const char *fmt, ...) CHECKASM_PRINTF(1, 2);
/** Ends the running check: "ok" unless failed or checkasm_fail() was called in it. */
void checkasm_report(int failed);
/** Prints "FAIL <check> (file:line): <message>" and returns 1 (for `return checkasm_fail(...)`). */
int checkasm_fail(const char *file, int line, const char *fmt, ...) CHECKASM_PRINTF(3, 4);
/** An information line of the running check (counts of ties, errors measured). */
void checkasm_note(const char *fmt, ...) CHECKASM_PRINTF(1, 2);
/** The running check's random numbers. */
struct fx_rng *checkasm_rng(void);
/** SANITIZE=1: the small mode. */
int checkasm_small(void);
/** --bench: whether checks time their CUDA call. */
int checkasm_benchmarking(void);
/**
 * bench_new: times launch (on `stream`) with fx_time_us and prints the
 * median; 0, or 1 after checkasm_fail() when a launch failed.
 */
int checkasm_bench(fx_launch_fn launch, void *ctx, void *stream);

/* Fails the running check with a message when cond does not hold (compare functions). */
#define CA_CHECK(cond, ...)                                        \
    do {                                                           \
        if (!(cond))                                               \
            return checkasm_fail(__FILE__, __LINE__, __VA_ARGS__); \
    } while (0)

/* The same in a function that owns resources: rc = 1, then its `out:` label frees them. */
#define CA_TRY(cond, ...)                                        \
    do {                                                         \
        if (!(cond)) {                                           \
            rc = checkasm_fail(__FILE__, __LINE__, __VA_ARGS__); \
            goto out;                                            \
        }                                                        \
    } while (0)

/* A stepq call that must succeed (a fixture call, a reference call). */
#define CA_OK(call) CA_TRY((call) >= 0, "%s: %s", #call, stepq_last_error())

#endif /* STEPQ_TESTS_CHECKASM_CHECKASM_H */
