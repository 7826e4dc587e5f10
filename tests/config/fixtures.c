#include <stdint.h>
#include <string.h>

#include "tests/config/fixtures.h"

static int qwen27_ids[48], qwen_next_ids[36];
static const int kimi_ids[20] = { 0,  1,  2,  4,  5,  6,  8,  9,  10, 12,
                                  13, 14, 16, 17, 18, 20, 21, 22, 24, 25 };
static const int small_ids[3] = { 0, 2, 3 };

static int every_fourth(int *ids, int n_model)
{
    int n = 0;
    for (int i = 0; i < n_model; i++)
        if (i % 4 != 3)
            ids[n++] = i;
    return n;
}

stepq_model_shape fx_shape_qwen27(void)
{
    stepq_model_shape s;
    memset(&s, 0, sizeof(s));
    s.arch = STEPQ_ARCH_GDN;
    s.n_layers = every_fourth(qwen27_ids, 64);
    s.layer_ids = qwen27_ids;
    s.num_k_heads = 16;
    s.num_v_heads = 48;
    s.head_k_dim = 128;
    s.head_v_dim = 128;
    s.conv_rank = 2;
    s.conv_shape[0] = 10240;
    s.conv_shape[1] = 3;
    s.conv_dtype = STEPQ_DTYPE_BF16;
    return s;
}

stepq_model_shape fx_shape_qwen_next(void)
{
    stepq_model_shape s = fx_shape_qwen27();
    s.n_layers = every_fourth(qwen_next_ids, 48);
    s.layer_ids = qwen_next_ids;
    s.num_v_heads = 32;
    s.conv_shape[0] = 8192;
    return s;
}

stepq_model_shape fx_shape_kimi(void)
{
    stepq_model_shape s;
    memset(&s, 0, sizeof(s));
    s.arch = STEPQ_ARCH_KDA;
    s.n_layers = 20;
    s.layer_ids = kimi_ids;
    s.num_k_heads = 32;
    s.num_v_heads = 32;
    s.head_k_dim = 128;
    s.head_v_dim = 128;
    s.conv_rank = 3;
    s.conv_shape[0] = 3;
    s.conv_shape[1] = 4096;
    s.conv_shape[2] = 3;
    s.conv_dtype = STEPQ_DTYPE_BF16;
    return s;
}

stepq_model_shape fx_shape_small(stepq_arch arch)
{
    stepq_model_shape s;
    memset(&s, 0, sizeof(s));
    s.arch = arch;
    s.n_layers = 3;
    s.layer_ids = small_ids;
    s.num_k_heads = 2;
    s.num_v_heads = 4;
    s.head_k_dim = 8;
    s.head_v_dim = 4;
    s.conv_rank = 2;
    s.conv_shape[0] = 64;
    s.conv_shape[1] = 3;
    s.conv_dtype = STEPQ_DTYPE_FP16;
    return s;
}

int fx_layout_exact(stepq_map_t *map, int b, int pivots)
{
    stepq_model_shape s;
    stepq_map_shape(map, &s);
    const int upl = stepq_map_units_per_layer(map);
    const int total = s.n_layers * upl;
    const int rest = total - pivots;
    /* n_lo * 2 = (8 - b) * pivots + n_hi * 2 keeps the sum exact. */
    const int n_hi = rest / 10, n_lo = n_hi + (8 - b) * pivots / 2;
    int st = 0, k = 0;

    for (int u = 0; u < total && st >= 0; u++) {
        int w = b;
        if (pivots && u % (total / pivots) == 0 && u / (total / pivots) < pivots) {
            w = STEPQ_BITS_PIVOT;
        } else {
            if (k < n_lo)
                w = b - 2;
            else if (k < n_lo + n_hi)
                w = b + 2;
            k++;
        }
        st = stepq_map_set_unit_bits(map, u / upl, u % upl, w);
    }
    return st;
}

double fx_rand(unsigned long long *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0;
}
