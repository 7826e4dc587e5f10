/*
 * libFuzzer target for the precision-map loader. Every input must either be
 * rejected with a status and a message, or load into a map that validates,
 * can be planned as a pool (the loader's limits are the pool's), writes, and
 * reads back into an equal map with the same fingerprint and the same bytes. A violated property
 * aborts (this is a test harness, not library code), which the fuzzer reports as a crash.
 *
 * Built with -Dfuzz=true and clang (tests/fuzz/meson.build); replay.c runs
 * the seed corpus through the same function in every build.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/map_internal.h"
#include "stepq/pool.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                               \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "fuzz_map_load: property violated: %s (%s)\n", #cond, \
                    stepq_last_error());                                          \
            abort();                                                              \
        }                                                                         \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    stepq_map_load_config cfg = STEPQ_MAP_LOAD_CONFIG_INITIALIZER;
    stepq_map_t *map = NULL, *back = NULL;
    stepq_map_memory mem;
    uint64_t f1, f2;
    char *t1 = NULL, *t2 = NULL;
    size_t n1, n2;

    cfg.max_bytes = 4 << 20;
    int st = stepq_map_load_buffer((const char *)data, size, &cfg, &map);
    if (st < 0) {
        CHECK(map == NULL);
        CHECK(stepq_last_error()[0] != '\0');
        CHECK(strcmp(stepq_status_name(st), "STEPQ_UNKNOWN") != 0);
        return 0;
    }
    CHECK(map != NULL);
    CHECK(stepq_map_validate(map) == STEPQ_OK);
    CHECK(stepq_map_memory_info(map, &mem) == STEPQ_OK);
    {
        /* The loader's limits are the pool's: what loads, opens (here: plans),
         * and the pool's compact state is the map's accounting. */
        stepq_pool_config pc = STEPQ_POOL_CONFIG_INITIALIZER;
        stepq_pool_plan_info plan;
        pc.map = map;
        pc.num_slots = 1;
        CHECK(stepq_pool_plan(&pc, &plan) == STEPQ_OK);
        CHECK(plan.state_bytes_compact == mem.state_bytes_compact);
    }
    CHECK(mem.state_bytes_compact > 0 && mem.state_bytes_compact <= mem.state_bytes_fp32 * 2);
    CHECK(stepq_map_fingerprint(map, &f1) == STEPQ_OK);
    CHECK(stepq_map_write_buffer(map, &t1, &n1) == STEPQ_OK);
    CHECK(stepq_map_load_buffer(t1, n1, NULL, &back) == STEPQ_OK);
    CHECK(stepq__map_equal(map, back));
    CHECK(stepq_map_fingerprint(back, &f2) == STEPQ_OK && f1 == f2);
    CHECK(stepq_map_write_buffer(back, &t2, &n2) == STEPQ_OK);
    CHECK(n1 == n2 && memcmp(t1, t2, n1) == 0);
    stepq_free(t1);
    stepq_free(t2);
    stepq_map_close(back);
    stepq_map_close(map);
    return 0;
}
