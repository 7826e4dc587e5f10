/*
 * Prints what the Python bindings (plugin/python/stepq/_lib.py) must mirror,
 * as the C compiler sees the public headers: every struct's size, each
 * field's offset and size, the bytes of each versioned struct as its
 * INITIALIZER sets it, and the constants the bindings copy. Test-only
 * (tests/python/meson.build): plugin/python/tests/test_structs.py compares.
 *
 * Output, one item a line:
 *   struct NAME SIZE
 *   field NAME.FIELD OFFSET SIZE
 *   init NAME HEX          (static storage: the padding bytes are zero too)
 *   const NAME VALUE
 */
#include <stddef.h>
#include <stdio.h>

#include <stepq/stepq.h>

#define STRUCT(T)   printf("struct %s %zu\n", #T, sizeof(T))
#define FIELD(T, f) printf("field %s.%s %zu %zu\n", #T, #f, offsetof(T, f), sizeof(((T *)0)->f))
#define CONST(c)    printf("const %s %lld\n", #c, (long long)(c))

static void hex(const char *name, const void *p, size_t n)
{
    const unsigned char *b = p;

    printf("init %s ", name);
    for (size_t i = 0; i < n; i++)
        printf("%02x", b[i]);
    printf("\n");
}

static const stepq_map_load_config map_load_init = STEPQ_MAP_LOAD_CONFIG_INITIALIZER;
static const stepq_pool_config pool_init = STEPQ_POOL_CONFIG_INITIALIZER;
static const stepq_step_args step_init = STEPQ_STEP_ARGS_INITIALIZER;
static const stepq_prefill_args prefill_init = STEPQ_PREFILL_ARGS_INITIALIZER;

int main(void)
{
    STRUCT(stepq_map_load_config);
    FIELD(stepq_map_load_config, size);
    FIELD(stepq_map_load_config, magic);
    FIELD(stepq_map_load_config, version);
    FIELD(stepq_map_load_config, max_bytes);
    FIELD(stepq_map_load_config, max_values);

    STRUCT(stepq_model_shape);
    FIELD(stepq_model_shape, arch);
    FIELD(stepq_model_shape, n_layers);
    FIELD(stepq_model_shape, layer_ids);
    FIELD(stepq_model_shape, num_k_heads);
    FIELD(stepq_model_shape, num_v_heads);
    FIELD(stepq_model_shape, head_k_dim);
    FIELD(stepq_model_shape, head_v_dim);
    FIELD(stepq_model_shape, conv_rank);
    FIELD(stepq_model_shape, conv_shape);
    FIELD(stepq_model_shape, conv_dtype);

    STRUCT(stepq_unit_stats);
    FIELD(stepq_unit_stats, log_retention);
    FIELD(stepq_unit_stats, lambda);
    FIELD(stepq_unit_stats, distortion);

    STRUCT(stepq_map_memory);
    FIELD(stepq_map_memory, state_bytes_fp32);
    FIELD(stepq_map_memory, state_bytes_compact);
    FIELD(stepq_map_memory, conv_bytes);
    FIELD(stepq_map_memory, n_values);
    FIELD(stepq_map_memory, n_units);
    FIELD(stepq_map_memory, n_pivots);
    FIELD(stepq_map_memory, code_bytes);
    FIELD(stepq_map_memory, scale_bytes);
    FIELD(stepq_map_memory, pivot_bytes);
    FIELD(stepq_map_memory, dense_bytes);
    FIELD(stepq_map_memory, bits_per_value);
    FIELD(stepq_map_memory, ratio_vs_fp32);

    STRUCT(stepq_pool_config);
    FIELD(stepq_pool_config, size);
    FIELD(stepq_pool_config, magic);
    FIELD(stepq_pool_config, version);
    FIELD(stepq_pool_config, map);
    FIELD(stepq_pool_config, backend);
    FIELD(stepq_pool_config, device);
    FIELD(stepq_pool_config, stream);
    FIELD(stepq_pool_config, tp_rank);
    FIELD(stepq_pool_config, tp_size);
    FIELD(stepq_pool_config, min_page_bytes);
    FIELD(stepq_pool_config, page_align);
    FIELD(stepq_pool_config, block_align);
    FIELD(stepq_pool_config, policy);
    FIELD(stepq_pool_config, num_slots);
    FIELD(stepq_pool_config, max_running_requests);
    FIELD(stepq_pool_config, memory_budget_bytes);
    FIELD(stepq_pool_config, flags);

    STRUCT(stepq_pool_plan_info);
    FIELD(stepq_pool_plan_info, page_bytes);
    FIELD(stepq_pool_plan_info, state_bytes);
    FIELD(stepq_pool_plan_info, state_bytes_compact);
    FIELD(stepq_pool_plan_info, align_bytes);
    FIELD(stepq_pool_plan_info, conv_bytes);
    FIELD(stepq_pool_plan_info, pad_bytes);
    FIELD(stepq_pool_plan_info, slots);
    FIELD(stepq_pool_plan_info, pool_bytes);
    FIELD(stepq_pool_plan_info, meta_bytes);

    STRUCT(stepq_pool_buffer_info);
    FIELD(stepq_pool_buffer_info, ptr);
    FIELD(stepq_pool_buffer_info, bytes);
    FIELD(stepq_pool_buffer_info, item_bytes);
    FIELD(stepq_pool_buffer_info, name);

    STRUCT(stepq_pool_stats);
    FIELD(stepq_pool_stats, capacity);
    FIELD(stepq_pool_stats, in_use);
    FIELD(stepq_pool_stats, available);
    FIELD(stepq_pool_stats, high_water);
    FIELD(stepq_pool_stats, n_alloc);
    FIELD(stepq_pool_stats, n_free);
    FIELD(stepq_pool_stats, page_bytes);
    FIELD(stepq_pool_stats, pool_bytes);
    FIELD(stepq_pool_stats, in_use_bytes);
    FIELD(stepq_pool_stats, meta_bytes);
    FIELD(stepq_pool_stats, state_bytes);
    FIELD(stepq_pool_stats, state_bytes_compact);
    FIELD(stepq_pool_stats, conv_bytes);
    FIELD(stepq_pool_stats, pad_bytes);
    FIELD(stepq_pool_stats, health_any);
    FIELD(stepq_pool_stats, health_slots);

    STRUCT(stepq_pool_layout);
    FIELD(stepq_pool_layout, arch);
    FIELD(stepq_pool_layout, method);
    FIELD(stepq_pool_layout, n_layers);
    FIELD(stepq_pool_layout, n_local_heads);
    FIELD(stepq_pool_layout, first_head);
    FIELD(stepq_pool_layout, d_k);
    FIELD(stepq_pool_layout, d_v);
    FIELD(stepq_pool_layout, units_per_head);
    FIELD(stepq_pool_layout, page_bytes);
    FIELD(stepq_pool_layout, state_bytes);
    FIELD(stepq_pool_layout, state_bytes_compact);
    FIELD(stepq_pool_layout, conv_bytes);
    FIELD(stepq_pool_layout, conv_bytes_per_layer);
    FIELD(stepq_pool_layout, pad_bytes);
    FIELD(stepq_pool_layout, block_offset);
    FIELD(stepq_pool_layout, block_bytes);
    FIELD(stepq_pool_layout, block_compact);
    FIELD(stepq_pool_layout, unit_bits);
    FIELD(stepq_pool_layout, conv_offset);
    FIELD(stepq_pool_layout, n_blocks);
    FIELD(stepq_pool_layout, fingerprint);

    STRUCT(stepq_step_args);
    FIELD(stepq_step_args, size);
    FIELD(stepq_step_args, magic);
    FIELD(stepq_step_args, version);
    FIELD(stepq_step_args, batch);
    FIELD(stepq_step_args, slot_ids);
    FIELD(stepq_step_args, dtype);
    FIELD(stepq_step_args, q);
    FIELD(stepq_step_args, k);
    FIELD(stepq_step_args, v);
    FIELD(stepq_step_args, g);
    FIELD(stepq_step_args, beta);
    FIELD(stepq_step_args, o);
    FIELD(stepq_step_args, q_stride);
    FIELD(stepq_step_args, k_stride);
    FIELD(stepq_step_args, v_stride);
    FIELD(stepq_step_args, g_stride);
    FIELD(stepq_step_args, beta_stride);
    FIELD(stepq_step_args, o_stride);
    FIELD(stepq_step_args, flags);
    FIELD(stepq_step_args, scale);
    FIELD(stepq_step_args, A_log);
    FIELD(stepq_step_args, dt_bias);
    FIELD(stepq_step_args, param_dtype);
    FIELD(stepq_step_args, health_counts);
    FIELD(stepq_step_args, num_k_heads);
    FIELD(stepq_step_args, num_v_heads);
    FIELD(stepq_step_args, head_k_dim);
    FIELD(stepq_step_args, head_v_dim);

    STRUCT(stepq_prefill_args);
    FIELD(stepq_prefill_args, size);
    FIELD(stepq_prefill_args, magic);
    FIELD(stepq_prefill_args, version);
    FIELD(stepq_prefill_args, n);
    FIELD(stepq_prefill_args, slot_ids);
    FIELD(stepq_prefill_args, states);
    FIELD(stepq_prefill_args, state_stride);
    FIELD(stepq_prefill_args, dtype);
    FIELD(stepq_prefill_args, layout);
    FIELD(stepq_prefill_args, health_counts);
    FIELD(stepq_prefill_args, num_v_heads);
    FIELD(stepq_prefill_args, head_k_dim);
    FIELD(stepq_prefill_args, head_v_dim);

    STRUCT(stepq_conv_view);
    FIELD(stepq_conv_view, base);
    FIELD(stepq_conv_view, slot_stride);
    FIELD(stepq_conv_view, bytes);
    FIELD(stepq_conv_view, dtype);
    FIELD(stepq_conv_view, rank);
    FIELD(stepq_conv_view, shape);

    hex("stepq_map_load_config", &map_load_init, sizeof(map_load_init));
    hex("stepq_pool_config", &pool_init, sizeof(pool_init));
    hex("stepq_step_args", &step_init, sizeof(step_init));
    hex("stepq_prefill_args", &prefill_init, sizeof(prefill_init));

    CONST(STEPQ_CONFIG_MAGIC);
    CONST(STEPQ_VERSION_MAJOR);
    CONST(STEPQ_VERSION_MINOR);
    CONST(STEPQ_POOL_CONFIG_VERSION);
    CONST(STEPQ_MAP_LOAD_CONFIG_VERSION);
    CONST(STEPQ_STEP_ARGS_VERSION);
    CONST(STEPQ_PREFILL_ARGS_VERSION);
    CONST(STEPQ_POOL_SLOT_SENTINEL);
    CONST(STEPQ_POOL_SLOT_PAD);
    CONST(STEPQ_POOL_BACKEND_HOST);
    CONST(STEPQ_POOL_BACKEND_CUDA);
    CONST(STEPQ_POOL_POLICY_NO_CACHE);
    CONST(STEPQ_POOL_POLICY_NO_BUFFER);
    CONST(STEPQ_POOL_POLICY_LAZY);
    CONST(STEPQ_POOL_POLICY_EXTRA_BUFFER);
    CONST(STEPQ_POOL_FLAG_CLEAR_ON_ALLOC);
    CONST(STEPQ_POOL_CLOSE_FORCE);
    CONST(STEPQ_STEP_L2NORM);
    CONST(STEPQ_STEP_GATE_IN_KERNEL);
    CONST(STEPQ_STEP_BETA_SIGMOID);
    CONST(STEPQ_STATE_LAYOUT_KV);
    CONST(STEPQ_STATE_LAYOUT_VK);
    CONST(STEPQ_OP_DECODE_STEP);
    CONST(STEPQ_OP_PREFILL_PACK);
    CONST(STEPQ_OP_PREFILL_UNPACK);
    CONST(STEPQ_ARCH_GDN);
    CONST(STEPQ_ARCH_KDA);
    CONST(STEPQ_DTYPE_FP32);
    CONST(STEPQ_DTYPE_BF16);
    CONST(STEPQ_DTYPE_FP16);
    CONST(STEPQ_CONV_MAX_RANK);
    CONST(STEPQ_BITS_PIVOT);
    CONST(STEPQ_BITS_DENSE);
    CONST(STEPQ_HEALTH_INPUT);
    CONST(STEPQ_HEALTH_STATE);
    CONST(STEPQ_HEALTH_SATURATED);
    CONST(STEPQ_HEALTH_OUTPUT);
#define XX(name, value, text) CONST(STEPQ_##name);
    STEPQ_STATUS_MAP(XX)
#undef XX
    return 0;
}
