/*
 * The model-shape presets and the map builder of `stepq mkmap`, shared with
 * the commands that take a preset name (bench decode), so that a preset's map
 * is the one mkmap writes, built one way.
 */
#ifndef STEPQ_TOOLS_MKMAP_H
#define STEPQ_TOOLS_MKMAP_H

#include <stdio.h>

#include "stepq/map.h"

/** 1 when key names a shape preset (qwen3.8-27b, ...), else 0. */
int stepq_tool_preset_find(const char *key);

/** Prints the preset names, comma-separated, to f. */
void stepq_tool_preset_list(FILE *f);

/**
 * Builds the map `stepq mkmap --shape KEY --method M [--bits B] [--pivots P]
 * [--name N]` writes, provenance included (name NULL: the preset's). The
 * caller has checked the method / bits / pivots combination as mkmap does.
 * Returns 0 with *out owning the map, or 2 (unknown shape) / 1 (library
 * failure, a layout that does not fit) after one line "stepq TOOL: ..." on
 * stderr, *out NULL.
 */
int stepq_tool_mkmap_build(const char *tool, const char *shape_key, stepq_method method, int bits,
                           long long pivots, const char *name, stepq_map_t **out);

#endif /* STEPQ_TOOLS_MKMAP_H */
