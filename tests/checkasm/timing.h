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

/** Launches captured into one graph by fx_time_graph_us. */
#define FX_TIME_GRAPH_LAUNCHES 20

/**
 * The steady-state time of one launch as a server's CUDA graph runs it: launch
 * runs FX_TIME_WARMUP times eagerly, then FX_TIME_GRAPH_LAUNCHES times under
 * stream capture into one graph (back to back, no host in between), which is
 * replayed once untimed and then FX_TIME_RUNS times between two events; *us is
 * the median replay time divided by FX_TIME_GRAPH_LAUNCHES. `stream` must be a
 * created stream (capture refuses the legacy default stream: STEPQ_EINVAL). A
 * launch that fails eagerly returns its own status; one that runs eagerly but
 * not under capture (a host synchronisation, a copy to the host) is
 * STEPQ_ENOTSUP with the reason. The capture is ended in every case and
 * nothing stays instantiated.
 */
int fx_time_graph_us(fx_launch_fn launch, void *ctx, void *stream, double *us);

#endif /* STEPQ_TESTS_CHECKASM_TIMING_H */
