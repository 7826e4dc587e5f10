/*
 * Replays the fuzz seed corpus through LLVMFuzzerTestOneInput in every build
 * (no libFuzzer needed), and checks the seeds' own promise: files named
 * ok-* must load, files named bad-* must be rejected.
 *   fuzz_map_replay CORPUS_DIR...
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepq/map.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *dir, const char *name, int *failures)
{
    char path[4096];
    FILE *f;
    long n;
    uint8_t *buf;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    f = fopen(path, "rb");
    if (!f || fseek(f, 0, SEEK_END) || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET)) {
        fprintf(stderr, "%s: cannot read\n", path);
        if (f)
            fclose(f);
        (*failures)++;
        return 0;
    }
    buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "%s: cannot read\n", path);
        fclose(f);
        free(buf);
        (*failures)++;
        return 0;
    }
    fclose(f);

    LLVMFuzzerTestOneInput(buf, (size_t)n); /* aborts on a broken property */

    stepq_map_t *map = NULL;
    int st = stepq_map_load_buffer((const char *)buf, (size_t)n, NULL, &map);
    stepq_map_close(map);
    free(buf);
    if (!strncmp(name, "ok-", 3) && st < 0) {
        fprintf(stderr, "%s: should load: %s\n", path, stepq_last_error());
        (*failures)++;
    } else if (!strncmp(name, "bad-", 4) && st >= 0) {
        fprintf(stderr, "%s: should be rejected but loads\n", path);
        (*failures)++;
    }
    return 1;
}

int main(int argc, char **argv)
{
    int files = 0, failures = 0;

    if (argc < 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR...\n", argv[0]);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        DIR *d = opendir(argv[i]);
        struct dirent *e;
        if (!d) {
            fprintf(stderr, "%s: cannot open\n", argv[i]);
            return 1;
        }
        while ((e = readdir(d)))
            if (e->d_name[0] != '.')
                files += replay_file(argv[i], e->d_name, &failures);
        closedir(d);
    }
    printf("%d corpus files replayed, %d failures\n", files, failures);
    return failures || files == 0 ? 1 : 0;
}
