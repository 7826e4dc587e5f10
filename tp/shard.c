/*
 * The shard mapper: which heads a TP rank holds (stepq_tp_shard) and that
 * rank's slice of a precision map (stepq_map_shard).
 *
 * How the server splits the heads. SGLang builds the GDN and KDA layers, as
 * vLLM does, from column-parallel projections over the attention TP group:
 * each rank computes num_k_heads / tp q/k heads and num_v_heads / tp value
 * heads, rank r the contiguous block that starts at r * H / tp (q/k) and
 * r * HV / tp (value), with its slice of A_log, dt_bias and the gates. In
 * GDN the value heads of q/k head k are [k * G, (k + 1) * G), G = HV / H
 * (Qwen3-Next: 16 q/k heads, 32 value heads, G = 2), so a rank's value block
 * reads exactly its own q/k heads; KDA has H == HV. Both divisions must be
 * exact: a remainder would put one q/k head and the value heads reading it
 * on two ranks, and ranks with different head counts.
 *
 * The conv state of one layer is split by channels: GDN's [conv_dim, taps]
 * with conv_dim = 2 * H * d_k + HV * d_v (q, k and v channels, each split
 * over the ranks), KDA's [3, channels, taps] (three convolutions, q, k and
 * v, over H * d_k channels each). The channel dimension is the largest one
 * (taps are kernel - 1 = 3); a rank holds 1/tp of it, which is 1/tp of the
 * conv bytes the pool reserves per rank.
 *
 * The slice is built through the public map API only (the config layer
 * owns the map's internals), so it is checked by the same setters and
 * stepq_map_validate() as any map.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "plugin/err.h"
#include "pool/conv.h"
#include "stepq/tp.h"

/* Budgets a slice takes when the whole map's does not cover it: multiples of
 * 2^-16 bits per value, exact binary fractions the writer prints in full and
 * the budget rule's double arithmetic evaluates exactly for any real map. */
#define SHARD_BUDGET_STEP 65536

/* The provenance fields of config/SCHEMA.md. The public API reads them by
 * name; the tp = 1 identity test on the schema's full example (every field
 * set) fails when a field is added there and not here. */
static const char *const prov_strings[] = { "tool", "tool_version", "data", "notes",
                                            "method_detail" };
static const char *const prov_numbers[] = { "tokens", "segments", "segment_length", "horizon",
                                            "pivot_fraction" };
#define N_CANDIDATES_MAX 6

int stepq_tp_shard(const stepq_model_shape *shape, int tp_size, int tp_rank,
                   stepq_tp_shard_info *out, size_t out_size)
{
    stepq_tp_shard_info r;
    int d;

    if (!shape || !out)
        return stepq__error(STEPQ_EINVAL, "stepq_tp_shard: %s is NULL", shape ? "out" : "shape");
    if (out_size == 0 || out_size > sizeof(r))
        return stepq__error(STEPQ_EINVAL,
                            "stepq_tp_shard: out_size %zu (this library knows up to %zu)", out_size,
                            sizeof(r));
    if (tp_size < 1)
        return stepq__error(STEPQ_EINVAL, "stepq_tp_shard: tp_size %d, must be at least 1",
                            tp_size);
    if (tp_rank < 0 || tp_rank >= tp_size)
        return stepq__error(STEPQ_EINVAL, "stepq_tp_shard: tp_rank %d is not in 0..%d (tp_size %d)",
                            tp_rank, tp_size - 1, tp_size);
    if (shape->num_k_heads < 1 || shape->num_v_heads < 1 ||
        shape->num_v_heads % shape->num_k_heads || shape->conv_rank < 0 ||
        shape->conv_rank > STEPQ_CONV_MAX_RANK)
        return stepq__error(STEPQ_EINVAL,
                            "stepq_tp_shard: not a model shape (num_k_heads %d, num_v_heads %d, "
                            "conv rank %d)",
                            shape->num_k_heads, shape->num_v_heads, shape->conv_rank);
    if (shape->num_k_heads % tp_size)
        return stepq__error(STEPQ_EINVAL,
                            "num_k_heads %d does not split over tp_size %d (every rank holds "
                            "num_k_heads / tp_size whole q/k heads)",
                            shape->num_k_heads, tp_size);
    if (shape->num_v_heads % tp_size)
        return stepq__error(STEPQ_EINVAL,
                            "num_v_heads %d does not split over tp_size %d (every rank holds "
                            "num_v_heads / tp_size value heads)",
                            shape->num_v_heads, tp_size);
    memset(&r, 0, sizeof(r));
    d = stepq__conv_split_dim(shape);
    if (d >= 0 && shape->conv_shape[d] % tp_size)
        return stepq__error(STEPQ_EINVAL,
                            "conv_state.shape[%d] (channels) %" PRId64
                            " does not split over tp_size %d",
                            d, shape->conv_shape[d], tp_size);
    r.tp_size = tp_size;
    r.tp_rank = tp_rank;
    r.num_k_heads = shape->num_k_heads / tp_size;
    r.num_v_heads = shape->num_v_heads / tp_size;
    r.first_k_head = tp_rank * r.num_k_heads;
    r.first_v_head = tp_rank * r.num_v_heads;
    r.conv_rank = shape->conv_rank;
    r.conv_split_dim = d;
    for (int i = 0; i < shape->conv_rank; i++)
        r.conv_shape[i] = i == d ? shape->conv_shape[i] / tp_size : shape->conv_shape[i];
    memcpy(out, &r, out_size);
    return STEPQ_OK;
}

/*
 * The budget of a slice (stepq_map_shard's doc): the map's own when the
 * slice satisfies the rule under it, else the smallest multiple of
 * 1/SHARD_BUDGET_STEP it satisfies. The test is the one stepq_map_validate()
 * applies: code_bits <= budget * N - 8 * N_piv, in doubles.
 */
static int rule_holds(double budget, uint64_t code_bits, uint64_t n_values, uint64_t piv_values)
{
    return (double)code_bits <= budget * (double)n_values - 8.0 * (double)piv_values;
}

static double slice_budget(double nominal, uint64_t code_bits, uint64_t n_values,
                           uint64_t piv_values)
{
    /* What the slice spends, pivots counted as 8-bit units: in [2, 8]. */
    const uint64_t need = code_bits + 8 * piv_values;
    const uint64_t whole = need / n_values, rem = need % n_values;
    /* rem < n_values <= 2^48, so rem * 2^16 fits 64 bits. */
    const uint64_t frac = (rem * SHARD_BUDGET_STEP + n_values - 1) / n_values;
    double b;

    if (rule_holds(nominal, code_bits, n_values, piv_values))
        return nominal;
    b = (double)whole + (double)frac / SHARD_BUDGET_STEP;
    while (!rule_holds(b, code_bits, n_values, piv_values) && b < 8.0)
        b += 1.0 / SHARD_BUDGET_STEP;
    return b;
}

/* Copies the name and provenance of src into dst. */
static int copy_meta(const stepq_map_t *src, stepq_map_t *dst)
{
    int cand[N_CANDIDATES_MAX], n, ret;
    const char *name = stepq_map_model_name(src);

    if (name[0] && (ret = stepq_map_set_model_name(dst, name)) < 0)
        return ret;
    for (size_t i = 0; i < sizeof(prov_strings) / sizeof(prov_strings[0]); i++) {
        const char *v = stepq_map_provenance(src, prov_strings[i]);
        if (v && (ret = stepq_map_set_provenance(dst, prov_strings[i], v)) < 0)
            return ret;
    }
    for (size_t i = 0; i < sizeof(prov_numbers) / sizeof(prov_numbers[0]); i++) {
        double v;
        ret = stepq_map_provenance_number(src, prov_numbers[i], &v);
        if (ret == STEPQ_ENOENT)
            continue;
        if (ret < 0 || (ret = stepq_map_set_provenance_number(dst, prov_numbers[i], v)) < 0)
            return ret;
    }
    n = stepq_map_provenance_candidates(src, cand, N_CANDIDATES_MAX);
    if (n == STEPQ_ENOENT)
        return STEPQ_OK;
    if (n < 0)
        return n;
    if (n > N_CANDIDATES_MAX)
        return stepq__error(STEPQ_EINTERNAL, "stepq_map_shard: %d provenance candidates", n);
    return stepq_map_set_provenance_candidates(dst, cand, n);
}

/* Copies the widths, row impact and statistics of the rank's heads. */
static int copy_heads(const stepq_map_t *src, const stepq_model_shape *s,
                      const stepq_tp_shard_info *sh, stepq_map_t *dst)
{
    const int upu = s->arch == STEPQ_ARCH_KDA ? s->head_k_dim : 1;
    stepq_unit_stats probe = STEPQ_UNIT_STATS_INITIALIZER;
    /* Statistics are all-or-none: the first unit says whether the map has them. */
    const int has_stats = stepq_map_unit_stats(src, 0, 0, &probe) == STEPQ_OK;
    int ret;

    for (int l = 0; l < s->n_layers; l++) {
        for (int h = 0; h < sh->num_v_heads; h++) {
            const int g = sh->first_v_head + h;
            const float *w = stepq_map_row_impact(src, l, g);

            for (int u = 0; u < upu; u++) {
                int bits = stepq_map_unit_bits(src, l, g * upu + u);
                if (bits < 0)
                    return bits;
                if (bits == STEPQ_BITS_DENSE) /* dense and fp8: no units, no statistics */
                    break;
                if ((ret = stepq_map_set_unit_bits(dst, l, h * upu + u, bits)) < 0)
                    return ret;
                if (has_stats) {
                    stepq_unit_stats st = STEPQ_UNIT_STATS_INITIALIZER;
                    if ((ret = stepq_map_unit_stats(src, l, g * upu + u, &st)) < 0 ||
                        (ret = stepq_map_set_unit_stats(dst, l, h * upu + u, &st)) < 0)
                        return ret;
                }
            }
            if (w && (ret = stepq_map_set_row_impact(dst, l, h, w)) < 0)
                return ret;
        }
    }
    return STEPQ_OK;
}

int stepq_map_shard(const stepq_map_t *map, int tp_size, int tp_rank, stepq_map_t **out)
{
    stepq_model_shape s, local;
    stepq_tp_shard_info sh;
    stepq_method method;
    stepq_map_t *dst = NULL;
    double budget;
    int ret;

    if (out)
        *out = NULL;
    if (!out)
        return stepq__error(STEPQ_EINVAL, "stepq_map_shard: out is NULL");
    if ((ret = stepq_map_shape(map, &s)) < 0)
        return ret;
    if ((ret = stepq_tp_shard(&s, tp_size, tp_rank, &sh, sizeof(sh))) < 0)
        return ret;
    method = stepq_map_method(map);
    budget = stepq_map_budget_bits(map);
    local = s;
    local.num_k_heads = sh.num_k_heads;
    local.num_v_heads = sh.num_v_heads;
    memcpy(local.conv_shape, sh.conv_shape, sizeof(local.conv_shape));

    if (stepq_map_units_per_layer(map) > 0 && stepq_map_unit_bits(map, 0, 0) != STEPQ_BITS_DENSE) {
        /* Per-unit methods: what the slice spends under the budget rule. */
        const int upu = s.arch == STEPQ_ARCH_KDA ? s.head_k_dim : 1;
        const uint64_t vpu = (uint64_t)stepq_map_values_per_unit(map);
        uint64_t code_bits = 0, piv_values = 0, n_values;

        n_values = (uint64_t)s.n_layers * (uint64_t)sh.num_v_heads * (uint64_t)upu * vpu;
        for (int l = 0; l < s.n_layers; l++) {
            const uint8_t *bits = stepq_map_layer_bits(map, l);
            if (!bits)
                return stepq__error(STEPQ_EINTERNAL, "stepq_map_shard: layer %d has no widths", l);
            for (int u = sh.first_v_head * upu; u < (sh.first_v_head + sh.num_v_heads) * upu; u++) {
                if (bits[u] == STEPQ_BITS_PIVOT)
                    piv_values += vpu;
                else
                    code_bits += vpu * bits[u];
            }
        }
        budget = slice_budget(budget, code_bits, n_values, piv_values);
    }

    if ((ret = stepq_map_create(&local, method, budget, &dst)) < 0)
        return ret;
    if ((ret = stepq_map_set_row_split(dst, stepq_map_row_split(map))) < 0 ||
        (ret = stepq_map_set_decode_fit(dst, stepq_map_decode_fit(map))) < 0 ||
        (ret = stepq_map_set_arith(dst, stepq_map_arith(map))) < 0 || /* after the fit it needs */
        (ret = copy_meta(map, dst)) < 0 || (ret = copy_heads(map, &s, &sh, dst)) < 0)
        goto fail;
    if ((ret = stepq_map_validate(dst)) < 0) {
        char why[STEPQ__ERRLEN];
        snprintf(why, sizeof(why), "%s", stepq_last_error());
        ret = stepq__error(STEPQ_EINTERNAL,
                           "stepq_map_shard: the slice of rank %d of %d does not validate: %s",
                           tp_rank, tp_size, why);
        goto fail;
    }
    *out = dst;
    return STEPQ_OK;

fail:
    stepq_map_close(dst);
    return ret;
}
