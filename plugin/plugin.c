/*
 * The plugin tables (stepq/plugin.h): one static constant per ABI version,
 * each member the public function itself, so a server calling through a
 * table runs exactly the code a linked caller runs.
 *
 * Adding version 2: declare struct stepq_plugin_v2 in stepq/plugin.h as a
 * copy of v1's members followed by the new ones, add a table plugin_v2
 * below (v1's initializers copied, the new members added), list it in
 * tables[] and raise STEPQ_PLUGIN_VERSION. plugin_v1 stays as it is.
 */
#include <stddef.h>
#include <stdio.h>

#include "plugin/err.h"
#include "stepq/plugin.h"

static const struct stepq_plugin_v1 plugin_v1 = {
    .size = sizeof(struct stepq_plugin_v1),
    .version = 1,
    .name = "stepq",

    .version_number = stepq_version,
    .version_string = stepq_version_string,
    .status_name = stepq_status_name,
    .strerror = stepq_strerror,
    .last_error = stepq_last_error,
    .set_logger = stepq_set_logger,

    .map_load_file = stepq_map_load_file,
    .map_load_buffer = stepq_map_load_buffer,
    .map_close = stepq_map_close,
    .map_shape = stepq_map_shape,
    .map_budget_bits = stepq_map_budget_bits,
    .map_unit_stats = stepq_map_unit_stats,
    .map_fingerprint = stepq_map_fingerprint,
    .map_last_error = stepq_map_last_error,

    .pool_plan = stepq_pool_plan,
    .pool_open = stepq_pool_open,
    .pool_close = stepq_pool_close,
    .pool_alloc = stepq_pool_alloc,
    .pool_free = stepq_pool_free,
    .pool_clear = stepq_pool_clear,
    .pool_copy = stepq_pool_copy,
    .pool_copy_to_host = stepq_pool_copy_to_host,
    .pool_copy_from_host = stepq_pool_copy_from_host,
    .pool_sync = stepq_pool_sync,
    .pool_buffer_infos = stepq_pool_buffer_infos,
    .pool_health_words = stepq_pool_health_words,
    .pool_health_read = stepq_pool_health_read,
    .pool_get_stats = stepq_pool_get_stats,
    .pool_get_layout = stepq_pool_get_layout,
    .pool_is_allocated = stepq_pool_is_allocated,
    .pool_last_error = stepq_pool_last_error,

    .pool_supports = stepq_pool_supports,
    .pool_decode_step = stepq_pool_decode_step,
    .pool_prefill_pack = stepq_pool_prefill_pack,
    .pool_prefill_unpack = stepq_pool_prefill_unpack,
    .pool_conv_state = stepq_pool_conv_state,
};

/* tables[v - 1] is the table of version v; versions are 1, 2, ... without gaps. */
static const void *const tables[] = { &plugin_v1 };
#define N_VERSIONS (sizeof(tables) / sizeof(tables[0]))

_Static_assert(N_VERSIONS == STEPQ_PLUGIN_VERSION,
               "stepq/plugin.h's newest version is the newest table here");

const void *stepq_plugin_get(uint32_t version)
{
    char list[64];
    size_t at = 0;

    if (version >= 1 && version <= N_VERSIONS)
        return tables[version - 1];
    for (uint32_t v = 1; v <= N_VERSIONS && at < sizeof(list); v++)
        at += (size_t)snprintf(list + at, sizeof(list) - at, "%s%u", v > 1 ? ", " : "", v);
    stepq__error(STEPQ_EVERSION,
                 "stepq_plugin_get: plugin version %u is not provided; this stepq provides %s %s",
                 version, N_VERSIONS > 1 ? "versions" : "version", list);
    return NULL;
}
