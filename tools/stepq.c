/*
 * stepq: the command-line front end (inspect, mkmap, capacity, calibrate,
 * eval, synth, bench). Subcommands live in their own files; this file only
 * dispatches.
 */
#include <stdio.h>
#include <string.h>

#include "stepq/stepq.h"
#include "tools/commands.h"

static const struct stepq_tool_command commands[] = {
    { "inspect", "per-request memory of a precision map", stepq_tool_inspect },
    { "mkmap", "build an uncalibrated precision map for a model shape", stepq_tool_mkmap },
    { "capacity", "serving memory against batch size for a map (+ plot)", stepq_tool_capacity },
    { "simulate", "request-lifecycle simulation of the state pool", stepq_tool_simulate },
    { "synth", "synthetic GDN/KDA recurrent-kernel traces (safetensors)", stepq_tool_synth },
    { "calibrate", "precision map from recurrent-kernel traces", stepq_tool_calibrate },
    { "eval", "replay traces with maps in the loop vs fp32 (errors, plots)", stepq_tool_eval },
    { "bench", "benchmarks: bench reference (C reference on the CPU), ...", stepq_tool_bench },
};

static void usage(FILE *f)
{
    fprintf(f, "usage: stepq COMMAND [ARGS...]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
    fprintf(f,
            "\nCommands that report take --json (JSON on stdout instead of the table) and -o FILE\n"
            "(written whole, or not at all after a failure or Ctrl-C); messages and progress go\n"
            "to stderr (STEPQ_PROGRESS=off|bar|lines, STEPQ_PROGRESS_INTERVAL=SECONDS).\n"
            "`stepq COMMAND --help` describes a command. stepq %s\n",
            stepq_version_string());
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("stepq %s\n", stepq_version_string());
        return 0;
    }
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        if (!strcmp(argv[1], commands[i].name))
            return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "stepq: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}

int stepq_tool_missing_value(const char *tool, const char *opt, const char *const *value_opts)
{
    for (int i = 0; value_opts[i]; i++)
        if (!strcmp(opt, value_opts[i])) {
            fprintf(stderr, "stepq %s: %s needs a value\n", tool, opt);
            return 2;
        }
    fprintf(stderr, "stepq %s: unknown option '%s' (see stepq %s --help)\n", tool, opt, tool);
    return 2;
}
