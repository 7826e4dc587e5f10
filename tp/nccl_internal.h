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

#endif /* STEPQ_TP_NCCL_INTERNAL_H */
