/*
 * What the tp/ tests share: the source root (argv[1], for the bundled maps),
 * loading a map below it, the message check, and a slot list for the page
 * exchange. Included by one test file each (static state, inline helpers).
 */
#ifndef STEPQ_TESTS_TP_TP_TEST_H
#define STEPQ_TESTS_TP_TP_TEST_H

#include <stdio.h>
#include <string.h>

#include "stepq/map.h"
#include "stepq/tp.h"

static const char *root;

/* The thread's last error holds needle (printed when it does not). */
static inline int has(const char *needle)
{
    if (strstr(stepq_last_error(), needle))
        return 1;
    print_error("\"%s\" is not in \"%s\"\n", needle, stepq_last_error());
    return 0;
}

/* The map at root/rel (the test fails when it does not load). */
static inline stepq_map_t *load(const char *rel)
{
    char path[4096];
    stepq_map_t *map = NULL;

    snprintf(path, sizeof(path), "%s/%s", root, rel);
    assert_int_equal(stepq_map_load_file(path, NULL, &map), STEPQ_OK);
    return map;
}

/* One side of a page exchange: n slots of pool, to or from peer. */
static inline stepq_tp_slots slots_of(stepq_pool_t *pool, uint64_t fp, int peer, const int32_t *ids,
                                      int32_t n)
{
    stepq_tp_slots s = STEPQ_TP_SLOTS_INITIALIZER;

    s.pool = pool;
    s.page_fingerprint = fp;
    s.peer = peer;
    s.slot_ids = ids;
    s.n = n;
    return s;
}

#endif /* STEPQ_TESTS_TP_TP_TEST_H */
