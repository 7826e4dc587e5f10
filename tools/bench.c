/*
 * stepq bench WHAT [ARGS...]: the benchmark family. Each benchmark lives in
 * its own file and adds one line to the table below.
 */
#include <stdio.h>
#include <string.h>

#include "tools/commands.h"

static const struct stepq_tool_command benches[] = {
    { "reference", "per-head decode-step time of the C reference, every method",
      stepq_tool_bench_reference },
    { "kernels",
      "CUDA decode step, pack and unpack of one layer: us, GB/s, copy-bandwidth fraction",
      stepq_tool_bench_kernels },
    { "decode",
      "decode throughput of the recurrent-state path, every layer: fp32 vs bf16 vs the map",
      stepq_tool_bench_decode },
    { "pool", "pool alloc/free ops/s; copy and clear GB/s for 1..512 slots (CUDA, host)",
      stepq_tool_bench_pool },
};

static void bench_usage(FILE *f)
{
    fprintf(f, "usage: stepq bench WHAT [ARGS...]\n\nbenchmarks:\n");
    for (size_t i = 0; i < sizeof(benches) / sizeof(benches[0]); i++)
        fprintf(f, "  %-10s %s\n", benches[i].name, benches[i].summary);
    fprintf(f, "\n`stepq bench WHAT --help` describes a benchmark.\n");
}

int stepq_tool_bench(int argc, char **argv)
{
    if (argc < 2) {
        bench_usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        bench_usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof(benches) / sizeof(benches[0]); i++)
        if (!strcmp(argv[1], benches[i].name))
            return benches[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "stepq bench: unknown benchmark '%s'\n\n", argv[1]);
    bench_usage(stderr);
    return 2;
}
