/*
 * stepq: compressed recurrent-state pool for hybrid linear-attention models.
 * Umbrella header: includes every public header.
 */
#ifndef STEPQ_STEPQ_H
#define STEPQ_STEPQ_H

#include "stepq/common.h"
#include "stepq/map.h"
#include "stepq/plugin.h"
#include "stepq/pool.h"
#include "stepq/step.h"
#include "stepq/tp.h"
#include "stepq/version.h"

#endif /* STEPQ_STEPQ_H */
