/*
 * Shapes and map builders shared by the config tests.
 */
#ifndef STEPQ_TESTS_CONFIG_FIXTURES_H
#define STEPQ_TESTS_CONFIG_FIXTURES_H

#include "stepq/map.h"

/** Qwen3.8-27B (paper): 48 GDN layers (ids i % 4 != 3 of 64), H 16, HV 48, 128x128, conv [10240,
 * 3]. */
stepq_model_shape fx_shape_qwen27(void);
/** Qwen3-Next-80B-A3B: 36 GDN layers (of 48), H 16, HV 32, 128x128, conv [8192, 3]. */
stepq_model_shape fx_shape_qwen_next(void);
/** Kimi-Linear-48B-A3B: 20 KDA layers, 32 heads, 128x128, conv [3, 4096, 3]. */
stepq_model_shape fx_shape_kimi(void);
/** A small shape for quick tests: arch, layers ids 0,2,3, H 2, HV 4, d_k 8, d_v 4. */
stepq_model_shape fx_shape_small(stepq_arch arch);

/**
 * Makes a temporal/stepq map at an integer budget b hold `pivots` pivot
 * units (evenly spread) and a {b-2, b, b+2} mix whose bits sum exactly to
 * the budget. Returns the status of the last setter.
 */
int fx_layout_exact(stepq_map_t *map, int b, int pivots);

/** A deterministic pseudo-random generator for test data. */
double fx_rand(unsigned long long *state);

#endif
