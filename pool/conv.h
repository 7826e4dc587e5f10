/*
 * How a layer's conv state splits over tensor-parallel ranks, one rule for
 * the pool (the bytes and the shape it reports per rank) and tp/ (the shard
 * of a map): by channels, the largest dimension of the conv shape (GDN's
 * [conv_dim, taps], KDA's [3, channels, taps]; taps are kernel - 1 = 3), each
 * rank holding 1/tp of it, which must divide exactly. The first of equal
 * largest dimensions is taken.
 */
#ifndef STEPQ_POOL_CONV_H
#define STEPQ_POOL_CONV_H

#include "stepq/map.h"

/* The dimension that splits, or -1 without a conv state. */
static inline int stepq__conv_split_dim(const stepq_model_shape *s)
{
    int d = -1;

    for (int i = 0; i < s->conv_rank; i++)
        if (d < 0 || s->conv_shape[i] > s->conv_shape[d])
            d = i;
    return d;
}

#endif /* STEPQ_POOL_CONV_H */
