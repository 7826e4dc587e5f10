/*
 * Internals of the NCCL transport (tp/nccl.c) that tests reach without a
 * GPU: the one mapping of NCCL results to statuses, and a communicator
 * without an NCCL communicator behind it, for the argument checks that
 * come before any NCCL call. Built only with NCCL.
 */
#ifndef STEPQ_TP_NCCL_INTERNAL_H
#define STEPQ_TP_NCCL_INTERNAL_H

#include "stepq/tp.h"

/**
 * The status of an NCCL result (an ncclResult_t): ncclSuccess STEPQ_OK,
 * ncclInvalidArgument / ncclInvalidUsage STEPQ_EINVAL, ncclSystemError /
 * ncclRemoteError STEPQ_EIO, ncclUnhandledCudaError STEPQ_ECUDA, ncclInProgress
 * STEPQ_EBUSY (never returned for a finished call), the others STEPQ_ENCCL.
 */
int stepq__tp_nccl_status(int nccl_result);

/**
 * A communicator of rank / size with no NCCL communicator: every call on it
 * that gets past its argument checks returns STEPQ_EINVAL ("no NCCL
 * communicator"). For tests; released by stepq_tp_comm_close().
 */
int stepq__tp_comm_detached(int rank, int size, stepq_tp_comm_t **out);

/*
 * The record each rank contributes to the pool check's all-gather
 * (stepq_tp_check_pools): STEPQ__TP_REC_WORDS 64-bit words, sent
 * little-endian.
 */
enum {
    STEPQ__TP_REC_TAG,     /* STEPQ__TP_REC_TAG_V1 */
    STEPQ__TP_REC_STATUS,  /* this rank's own check: 0 or a negative status */
    STEPQ__TP_REC_VERSION, /* STEPQ_VERSION_NUMBER */
    STEPQ__TP_REC_TP_SIZE, /* from cfg, as planned */
    STEPQ__TP_REC_TP_RANK, /* from cfg, as planned */
    STEPQ__TP_REC_MAP,     /* the three fingerprints of cfg */
    STEPQ__TP_REC_GROUP,
    STEPQ__TP_REC_PAGE,
    STEPQ__TP_REC_PAGE_BYTES, /* the pool's page */
    STEPQ__TP_REC_SLOTS,      /* the pool's usable slots */
    STEPQ__TP_REC_WORDS
};
#define STEPQ__TP_REC_TAG_V1 0x314b435153ull /* "SQCK" "1", little-endian */

/**
 * The verdict of the pool check from the gathered records (rec: size x
 * STEPQ__TP_REC_WORDS, rank order), as every rank computes it: STEPQ_OK, or
 * the status and message of the first rank that cannot take part or that
 * differs from rank 0. me is the calling rank, own_why its own check's text
 * (named when it is the rank that failed).
 */
int stepq__tp_pool_verdict(const uint64_t *rec, int size, int me, const char *own_why);

#endif /* STEPQ_TP_NCCL_INTERNAL_H */
