/*
 * The one hash of the library: 64-bit FNV-1a, for fingerprints that two
 * ends of a transfer compare (maps, page layouts). Not for security.
 */
#ifndef STEPQ_PLUGIN_HASH_H
#define STEPQ_PLUGIN_HASH_H

#include <stddef.h>
#include <stdint.h>

/** The FNV-1a offset basis: the hash of no bytes. */
#define STEPQ__FNV_OFFSET 0xcbf29ce484222325ull

/** Folds len bytes of data into h. */
static inline uint64_t stepq__fnv1a(uint64_t h, const void *data, size_t len)
{
    const uint8_t *p = (const uint8_t *)data;

    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

#endif /* STEPQ_PLUGIN_HASH_H */
