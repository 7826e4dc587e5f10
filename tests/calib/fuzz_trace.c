/*
 * Fuzz target for the trace reader (tools/calib/trace.c): parse one safetensors
 * image, and when it parses, open it as a one-file trace set and read every
 * head of every stream. Built as a libFuzzer binary with -Dfuzz=true and
 * linked into the corpus replay in every build.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "tools/calib/trace.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* 1 when the input loaded as a trace set (for the replay's ok-/bad- check). */
int stepq_fuzz_trace_last_ok;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct stepq__trace_file *f;
    struct stepq__trace_set *ts;
    stepq_fuzz_trace_last_ok = 0;
    if (stepq__trace_file_parse(data, size, "fuzz", &f) < 0)
        return 0;
    if (stepq__trace_set_from_files(&f, 1, &ts) < 0)
        return 0;
    const struct stepq__trace_info *I = stepq__trace_set_info(ts);
    size_t T = (size_t)I->T, K = (size_t)I->K, V = (size_t)I->V;
    if (T * (K + V) <= (1u << 22)) {
        float *q = malloc(sizeof(float) * T * K), *k = malloc(sizeof(float) * T * K);
        float *v = malloc(sizeof(float) * T * V), *g = malloc(sizeof(float) * T * K);
        float *b = malloc(sizeof(float) * T);
        if (q && k && v && g && b)
            for (int s = 0; s < I->n_streams; s++)
                for (int l = 0; l < I->n_layers; l++)
                    for (int h = 0; h < I->HV; h++)
                        stepq__trace_head(ts, s, l, h, 0, I->T, q, k, v, g, b, NULL);
        free(q);
        free(k);
        free(v);
        free(g);
        free(b);
    }
    stepq__trace_set_close(ts);
    stepq_fuzz_trace_last_ok = 1;
    return 0;
}
