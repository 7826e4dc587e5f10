/*
 * Lifecycle simulation: a radix-caching server's scheduler, driven by a
 * libuv event loop, exercising a pool the way SGLang's mamba radix cache
 * does. Shared by `stepq simulate` and tests/pool/test_pool_sim.c; not part
 * of the library (it needs libuv).
 *
 * Time is simulated: four zero-timeout uv_timers (arrival, prefill, decode,
 * completion) fire once per tick in that order, so a run takes as long as
 * its work, not as long as a real server would.
 *
 * What it models (per request):
 *   admission   reserves the policy's slots (no_cache/no_buffer: 1 working
 *               slot; extra_buffer: + 2 ping-pong track slots; lazy: + 1
 *               track slot taken at the first track point), evicting LRU
 *               unlocked cache nodes when the pool is short; waits otherwise.
 *   prefix hit  the deepest cached node of the request's prefix is locked and
 *               copied into the working slot at the first forward (deferred
 *               copy-on-write), then unlocked; a miss clears the working slot.
 *   tracking    every track_interval tokens (extra_buffer, lazy) the working
 *               state is copied into the next ping-pong slot.
 *   shared      the state at the system prompt's last track boundary is forked
 *   prefix      into a new cache node (cache of an unfinished request).
 *   finish      the last tracked state (extra_buffer, lazy) or the final state
 *               (no_buffer) is donated to a cache node; the rest is freed.
 *   abort       frees every slot of the request and unlocks its node.
 * Every tick it compares the pool with a shadow model (owner of every slot,
 * counters, high-water mark) and runs the allocator's own consistency check;
 * every state copy is verified through tags written into the pages (host
 * backend), so a lost or corrupted state is caught where it happens. Every
 * inject_every ticks it makes invalid calls (double free, slot 0, overlapping
 * copy, over-allocation) and checks they fail and change nothing.
 */
#ifndef STEPQ_TESTS_LIFECYCLE_SIM_H
#define STEPQ_TESTS_LIFECYCLE_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "stepq/pool.h"

struct stepq__sim_config {
    uint64_t seed;
    int64_t requests; /**< requests to run to completion or abort */
    int max_running;  /**< B: running requests at most */
    stepq_pool_policy policy;
    int track_interval;  /**< tokens between ping-pong tracks (256) */
    int chunk;           /**< prefill chunk, a multiple of track_interval */
    int prefill_tokens;  /**< prefill token budget per tick */
    int max_decode_step; /**< decode tokens per tick per request, at most (multi-step) */
    int max_new_prompt;  /**< new prompt tokens per turn, at most */
    int max_output;      /**< output tokens per request, at most */
    double abort_rate;   /**< fraction of requests aborted at a random time */
    double follow_rate;  /**< fraction of arrivals that continue a conversation */
    int n_sys;           /**< distinct system prompts */
    int inject_every;    /**< invalid-call injection period in ticks (0 = never) */
    /** Called after every tick with the requests completed or aborted so far (NULL: none). */
    void (*progress)(void *arg, int64_t finished, int64_t requests);
    void *progress_arg;
};

/** Defaults: 100,000 requests, B = 16, extra_buffer, 256-token tracking. */
#define STEPQ__SIM_CONFIG_DEFAULT                                                                 \
    {                                                                                             \
        1, 100000, 16, STEPQ_POOL_POLICY_EXTRA_BUFFER, 256, 1024, 8192, 32, 1024, 512, 0.02, 0.6, \
            8, 997, NULL, NULL                                                                    \
    }

struct stepq__sim_stats {
    int64_t ticks;
    int64_t arrived, completed, aborted;
    int64_t prefix_hits, prefix_misses;
    int64_t cow_copies, track_copies, forks, inserts, duplicate_inserts;
    int64_t evictions, admission_waits, track_skips;
    int64_t pool_ops, checks, injected_errors;
    int64_t tokens_prefilled, tokens_decoded;
    int32_t max_in_use, capacity;
    double seconds;
};

/**
 * Runs the simulation on an open host-backend pool with no slot allocated
 * (slot count >= policy slots x max_running recommended; smaller pools run
 * with fewer requests at a time). Ends with the cache flushed: every slot
 * free again. Returns STEPQ_OK, or STEPQ_EINTERNAL / the pool's status with
 * the first violated invariant in err.
 */
int stepq__sim_run(stepq_pool_t *pool, const struct stepq__sim_config *cfg,
                   struct stepq__sim_stats *stats, char *err, size_t errlen);

#endif /* STEPQ_TESTS_LIFECYCLE_SIM_H */
