/*
 * The `stepq` command's subcommands. Each lives in its own file and has the
 * signature of main(); argv[0] is the subcommand name. They return a process
 * exit status: 0 success, 1 failure of the job, 2 bad usage.
 */
#ifndef STEPQ_TOOLS_COMMANDS_H
#define STEPQ_TOOLS_COMMANDS_H

typedef int (*stepq_tool_fn)(int argc, char **argv);

struct stepq_tool_command {
    const char *name;
    const char *summary;
    stepq_tool_fn fn;
};

int stepq_tool_inspect(int argc, char **argv);
int stepq_tool_mkmap(int argc, char **argv);
int stepq_tool_bench(int argc, char **argv);
int stepq_tool_bench_reference(int argc, char **argv);
int stepq_tool_bench_kernels(int argc, char **argv);
int stepq_tool_bench_decode(int argc, char **argv);
int stepq_tool_capacity(int argc, char **argv);
int stepq_tool_simulate(int argc, char **argv);
int stepq_tool_bench_pool(int argc, char **argv);
int stepq_tool_synth(int argc, char **argv);
int stepq_tool_calibrate(int argc, char **argv);
int stepq_tool_eval(int argc, char **argv);

/**
 * The error for an option given last, without its value: "needs a value"
 * when value_opts (NULL-terminated) names it, else "unknown option" (a typo
 * must not read as a missing value). Prints "stepq TOOL: ..." and returns 2.
 */
int stepq_tool_missing_value(const char *tool, const char *opt, const char *const *value_opts);

#endif /* STEPQ_TOOLS_COMMANDS_H */
