/*
 * Method properties the library's layers share (config, kernels, pool,
 * tools), generated from the public STEPQ_METHOD_MAP list (stepq/map.h)
 * like the public stepq_method_is_dense() and stepq_method_has_col_scales().
 */
#ifndef STEPQ_PLUGIN_VOCAB_H
#define STEPQ_PLUGIN_VOCAB_H

#include <stdbool.h>

#include "stepq/map.h"

/**
 * fp8's scale tile: one fp32 scale per (head, STEPQ__FP8_TILE value channels)
 * over all key rows; the map's accounting and the kernels' block format
 * share it (kernels/format.h has the format).
 */
#define STEPQ__FP8_TILE 32

/** The fit weighs rows by the map's row-impact factors (spatial, stepq). */
bool stepq__method_uses_row_impact(stepq_method method);
/** Units carry their own bit widths and may be fp16 pivots (temporal, stepq). */
bool stepq__method_has_pivots(stepq_method method);
/** A quantized method with one bit width for the whole map (uniform, dsq, spatial). */
bool stepq__method_single_width(stepq_method method);
/**
 * The map lists a format per unit in `layers` (uniform .. stepq). fp32/bf16/fp16
 * and fp8 have one fixed format for every value: no `layers`, no unit widths.
 */
bool stepq__method_has_units(stepq_method method);
/**
 * The budget_bits of a method without units, which is its storage width
 * (fp32 32, bf16 / fp16 16, fp8 8); 0 for the methods with units.
 */
double stepq__method_fixed_bits(stepq_method method);

#endif /* STEPQ_PLUGIN_VOCAB_H */
