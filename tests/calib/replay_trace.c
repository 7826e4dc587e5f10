/*
 * Replays the trace seed corpus through the fuzz target in every build and
 * checks each seed's promise: ok-* load as a trace set, bad-* are rejected
 * with a message. Usage: calib_trace_replay CORPUS_DIR
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepq/stepq.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern int stepq_fuzz_trace_last_ok;

int main(int argc, char **argv)
{
    int failures = 0, n = 0;
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    DIR *d = opendir(argv[1]);
    if (!d) {
        perror(argv[1]);
        return 1;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", argv[1], e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) {
            failures++;
            continue;
        }
        fseek(f, 0, SEEK_END);
        long len = ftell(f);
        fseek(f, 0, SEEK_SET);
        uint8_t *buf = malloc((size_t)len + 1);
        if (!buf || fread(buf, 1, (size_t)len, f) != (size_t)len) {
            fclose(f);
            free(buf);
            failures++;
            continue;
        }
        fclose(f);
        LLVMFuzzerTestOneInput(buf, (size_t)len);
        int want_ok = !strncmp(e->d_name, "ok-", 3);
        if (want_ok != stepq_fuzz_trace_last_ok) {
            fprintf(stderr, "FAIL %s: %s (%s)\n", e->d_name, want_ok ? "rejected" : "accepted",
                    stepq_last_error());
            failures++;
        } else {
            printf("%-45s %s\n", e->d_name, want_ok ? "loads" : stepq_last_error());
        }
        free(buf);
        n++;
    }
    closedir(d);
    printf("%d files, %d failures\n", n, failures);
    return failures || n == 0 ? 1 : 0;
}
