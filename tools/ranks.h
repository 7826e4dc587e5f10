/*
 * One process per rank (libuv): a tool starts n copies of its own
 * executable, collects each one's standard output, passes each one's
 * standard error through prefixed with "[rank R] ", and stops every rank as
 * soon as one fails, so that no rank is left running or waiting for a peer
 * that is gone.
 */
#ifndef STEPQ_TOOLS_RANKS_H
#define STEPQ_TOOLS_RANKS_H

#include <stddef.h>

/* Seconds a rank has to end after SIGTERM before it gets SIGKILL. */
#define STEPQ_TOOL_RANKS_GRACE_S 5

/** One rank's process: argv in, pid and standard output back. */
struct stepq_tool_rank {
    char **argv; /**< NULL-terminated; argv[0] left NULL: this executable's path during the call */
    int pid;     /**< set once it started */
    char *out;   /**< its standard output, NUL-terminated (free()); NULL before it ran */
    size_t out_len;
};

/**
 * The path of the running executable (/proc/self/exe, through uv_exepath)
 * into buf. Returns 0, or -1 after "stepq TOOL: ..." on stderr.
 */
int stepq_tool_self_exe(const char *tool, char *buf, size_t len);

/**
 * Starts rank r's process for every r < n (standard input closed, the
 * environment inherited) and runs until every one has ended.
 *
 * A rank that exits with a non-zero status or dies by a signal fails the
 * run: the others get SIGTERM, and SIGKILL STEPQ_TOOL_RANKS_GRACE_S seconds
 * later if still running; timeout_s > 0 does the same once that many
 * seconds have passed. Only the first failure is said, after every rank has
 * ended, in one line on stderr: "stepq TOOL: rank R exited with status X:
 * LAST" or "stepq TOOL: rank R died (signal S)" (LAST: the last line the
 * rank wrote on stderr), or "stepq TOOL: --timeout-s T passed: ...".
 *
 * @return 0 when every rank exited with status 0 (each ranks[r].out then
 *         holds its output); -1 after the line above.
 */
int stepq_tool_ranks_run(const char *tool, struct stepq_tool_rank *ranks, int n, double timeout_s);

#endif /* STEPQ_TOOLS_RANKS_H */
