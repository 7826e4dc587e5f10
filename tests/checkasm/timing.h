/*
 * Timing of one CUDA launch sequence with CUDA events: the checks' bench_new
 * (checkasm --bench) and `stepq bench kernels` use this one helper, so their
 * numbers are the same measurement.
 */
#ifndef STEPQ_TESTS_CHECKASM_TIMING_H
#define STEPQ_TESTS_CHECKASM_TIMING_H

/** Launches not timed before the timed ones (first-launch costs, clocks ramping up). */
#define FX_TIME_WARMUP 3
/** Timed launches; the median is reported. */
#define FX_TIME_RUNS 20

/** One launch: enqueues its work on the stream being timed; STEPQ_OK or a status < 0. */
typedef int (*fx_launch_fn)(void *ctx);

/**
 * Runs launch FX_TIME_WARMUP times, then FX_TIME_RUNS times each between two
 * events recorded on `stream` (a cudaStream_t, NULL the legacy default
 * stream), and sets *us to the median in microseconds (the mean of the two
 * middle times). A failing launch's status is returned with its message.
 */
int fx_time_us(fx_launch_fn launch, void *ctx, void *stream, double *us);

#endif /* STEPQ_TESTS_CHECKASM_TIMING_H */
