/*
 * The header of a packed-pages message (stepq/tp.h has the byte table):
 * fixed size, little-endian, self-checking, so a receiver can refuse a
 * truncated, foreign, corrupted or mismatched header before it touches a
 * page. The decoder reads only the first STEPQ_TP_MSG_HEADER_BYTES bytes and
 * checks len first: any input gives a status.
 */
#include <inttypes.h>
#include <string.h>

#include "plugin/err.h"
#include "plugin/hash.h"
#include "stepq/tp.h"
#include "tp/le.h"

/* Byte offsets of the fields. */
enum {
    OFF_MAGIC = 0,
    OFF_VERSION = 4,
    OFF_HEADER_BYTES = 6,
    OFF_FINGERPRINT = 8,
    OFF_SLOTS = 16,
    OFF_RESERVED = 20,
    OFF_PAGE_BYTES = 24,
    OFF_PAYLOAD_BYTES = 32,
    OFF_CHECKSUM = 40,
};

static uint64_t checksum(const uint8_t *hdr)
{
    return stepq__fnv1a(STEPQ__FNV_OFFSET, hdr, OFF_CHECKSUM);
}

int stepq_tp_msg_encode(const stepq_tp_msg_header *h, void *buf, size_t cap)
{
    uint8_t b[STEPQ_TP_MSG_HEADER_BYTES];
    uint64_t payload;

    if (!h || !buf)
        return stepq__error(STEPQ_EINVAL, "stepq_tp_msg_encode: %s is NULL", h ? "buf" : "h");
    if (cap < STEPQ_TP_MSG_HEADER_BYTES)
        return stepq__error(STEPQ_ERANGE, "stepq_tp_msg_encode: cap %zu, a header is %d bytes", cap,
                            STEPQ_TP_MSG_HEADER_BYTES);
    if (h->page_bytes == 0)
        return stepq__error(STEPQ_EINVAL, "stepq_tp_msg_encode: page_bytes is 0");
    if (h->slot_count > INT32_MAX)
        return stepq__error(STEPQ_EINVAL,
                            "stepq_tp_msg_encode: slot_count %" PRIu32 " is over INT32_MAX",
                            h->slot_count);
    if (__builtin_mul_overflow((uint64_t)h->slot_count, h->page_bytes, &payload))
        return stepq__error(STEPQ_EINVAL,
                            "stepq_tp_msg_encode: %" PRIu32 " slots x %" PRIu64
                            " B is more than 2^64 bytes",
                            h->slot_count, h->page_bytes);
    memcpy(b + OFF_MAGIC, STEPQ_TP_MSG_MAGIC, 4);
    stepq__le_put(b + OFF_VERSION, STEPQ_TP_MSG_VERSION, 2);
    stepq__le_put(b + OFF_HEADER_BYTES, STEPQ_TP_MSG_HEADER_BYTES, 2);
    stepq__le_put(b + OFF_FINGERPRINT, h->fingerprint, 8);
    stepq__le_put(b + OFF_SLOTS, h->slot_count, 4);
    stepq__le_put(b + OFF_RESERVED, 0, 4);
    stepq__le_put(b + OFF_PAGE_BYTES, h->page_bytes, 8);
    stepq__le_put(b + OFF_PAYLOAD_BYTES, payload, 8);
    stepq__le_put(b + OFF_CHECKSUM, checksum(b), 8);
    memcpy(buf, b, sizeof(b));
    return STEPQ_OK;
}

int stepq_tp_msg_decode(const void *buf, size_t len, uint64_t want_fingerprint,
                        uint64_t want_page_bytes, stepq_tp_msg_header *out)
{
    uint8_t b[STEPQ_TP_MSG_HEADER_BYTES];
    stepq_tp_msg_header h;
    uint64_t version, hdr_bytes, sum, payload;

    if (!buf || !out)
        return stepq__error(STEPQ_EINVAL, "stepq_tp_msg_decode: %s is NULL", buf ? "out" : "buf");
    if (len < STEPQ_TP_MSG_HEADER_BYTES)
        return stepq__error(STEPQ_EPARSE,
                            "page message: truncated, %zu bytes where the header is %d", len,
                            STEPQ_TP_MSG_HEADER_BYTES);
    memcpy(b, buf, sizeof(b));
    if (memcmp(b + OFF_MAGIC, STEPQ_TP_MSG_MAGIC, 4))
        return stepq__error(STEPQ_EPARSE,
                            "page message: magic %02x %02x %02x %02x is not \"%s\" (not a stepq "
                            "page message)",
                            b[0], b[1], b[2], b[3], STEPQ_TP_MSG_MAGIC);
    version = stepq__le_get(b + OFF_VERSION, 2);
    if (version != STEPQ_TP_MSG_VERSION)
        return stepq__error(STEPQ_EVERSION,
                            "page message: version %" PRIu64 ", this library reads version %d",
                            version, STEPQ_TP_MSG_VERSION);
    hdr_bytes = stepq__le_get(b + OFF_HEADER_BYTES, 2);
    if (hdr_bytes != STEPQ_TP_MSG_HEADER_BYTES)
        return stepq__error(STEPQ_EPARSE,
                            "page message: header of %" PRIu64 " bytes, version %d's is %d",
                            hdr_bytes, STEPQ_TP_MSG_VERSION, STEPQ_TP_MSG_HEADER_BYTES);
    sum = stepq__le_get(b + OFF_CHECKSUM, 8);
    if (sum != checksum(b))
        return stepq__error(STEPQ_EPARSE,
                            "page message: header checksum %016" PRIx64 " is not %016" PRIx64
                            " (corrupted header)",
                            sum, checksum(b));
    if (stepq__le_get(b + OFF_RESERVED, 4))
        return stepq__error(STEPQ_EPARSE, "page message: reserved word %08" PRIx64 " is not 0",
                            stepq__le_get(b + OFF_RESERVED, 4));
    h.fingerprint = stepq__le_get(b + OFF_FINGERPRINT, 8);
    h.slot_count = (uint32_t)stepq__le_get(b + OFF_SLOTS, 4);
    h.page_bytes = stepq__le_get(b + OFF_PAGE_BYTES, 8);
    payload = stepq__le_get(b + OFF_PAYLOAD_BYTES, 8);
    if (h.page_bytes == 0)
        return stepq__error(STEPQ_EPARSE, "page message: page bytes 0");
    if (h.slot_count > INT32_MAX)
        return stepq__error(STEPQ_EPARSE, "page message: %" PRIu32 " slots, over INT32_MAX",
                            h.slot_count);
    if (__builtin_mul_overflow((uint64_t)h.slot_count, h.page_bytes, &h.payload_bytes) ||
        h.payload_bytes != payload)
        return stepq__error(STEPQ_EPARSE,
                            "page message: payload %" PRIu64 " bytes is not %" PRIu32
                            " slots x %" PRIu64 " B",
                            payload, h.slot_count, h.page_bytes);
    if (h.fingerprint != want_fingerprint)
        return stepq__error(STEPQ_ESHAPE,
                            "page message: the sender's page fingerprint %016" PRIx64
                            " is not this rank's %016" PRIx64
                            " (another map, shape, tp split, rank or page layout)",
                            h.fingerprint, want_fingerprint);
    if (h.page_bytes != want_page_bytes)
        return stepq__error(STEPQ_ESHAPE,
                            "page message: pages of %" PRIu64 " B, this rank's are %" PRIu64 " B",
                            h.page_bytes, want_page_bytes);
    *out = h;
    return STEPQ_OK;
}
