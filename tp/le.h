/*
 * Little-endian integers of n bytes (n <= 8) in byte buffers: the wire format of
 * the page-message header and the replies of tp/ is little-endian whatever the
 * host, so that ranks of different byte orders read the same numbers.
 */
#ifndef STEPQ_TP_LE_H
#define STEPQ_TP_LE_H

#include <stdint.h>

static inline void stepq__le_put(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t stepq__le_get(const uint8_t *p, int n)
{
    uint64_t v = 0;

    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

#endif /* STEPQ_TP_LE_H */
