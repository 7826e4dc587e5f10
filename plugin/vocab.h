/*
 * Method properties the library's layers share (config, kernels, pool,
 * tools), generated from the public STEPQ_METHOD_MAP list (stepq/map.h)
 * like the public stepq_method_is_dense() and stepq_method_has_col_scales().
 */
#ifndef STEPQ_PLUGIN_VOCAB_H
#define STEPQ_PLUGIN_VOCAB_H

#include <stdbool.h>

#include "stepq/map.h"

/** The fit weighs rows by the map's row-impact factors (spatial, stepq). */
bool stepq__method_uses_row_impact(stepq_method method);
/** Units carry their own bit widths and may be fp16 pivots (temporal, stepq). */
bool stepq__method_has_pivots(stepq_method method);
/** A quantized method with one bit width for the whole map (uniform, dsq, spatial). */
bool stepq__method_single_width(stepq_method method);

#endif /* STEPQ_PLUGIN_VOCAB_H */
