/*
 * Kernels on packed pages: the quantize-after-update decode step (paper
 * Eq. 4) for every method, pack/unpack in both layouts, padding slots,
 * argument checks and non-finite handling, each through the reference entry
 * that the host backend calls.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/dsp.h"
#include "kernels/quant.h"
#include "tests/kernels/problem.h"
#include "tests/kernels/util.h"

static const stepq_method all_methods[] = { STEPQ_METHOD_FP32,     STEPQ_METHOD_BF16,
                                            STEPQ_METHOD_FP16,     STEPQ_METHOD_UNIFORM,
                                            STEPQ_METHOD_DSQ,      STEPQ_METHOD_SPATIAL,
                                            STEPQ_METHOD_TEMPORAL, STEPQ_METHOD_STEPQ,
                                            STEPQ_METHOD_FP8 };
#define N_METHODS (sizeof(all_methods) / sizeof(all_methods[0]))

/* A pool of n_slots pages for one layer of HV heads, with per-head formats. */
struct pages {
    struct stepq__head_layout heads[8];
    size_t offset[8];
    float w[8 * 64];
    struct stepq__packed_layer pl;
    uint8_t *mem;
};

/* Head h gets `bits` (GDN) or a mix around it with a pivot row (KDA, mixed methods). */
static void pages_init(struct pages *p, stepq_method m, stepq_arch arch, int n_slots, int HV,
                       int dk, int dv, int bits)
{
    uint8_t rb[64];
    int mixed = m == STEPQ_METHOD_TEMPORAL || m == STEPQ_METHOD_STEPQ;
    size_t off = 0;
    uint64_t rng = 13;

    memset(p, 0, sizeof(*p));
    for (int h = 0; h < HV; h++) {
        for (int i = 0; i < dk; i++) {
            rb[i] = (uint8_t)bits;
            if (mixed && arch == STEPQ_ARCH_KDA)
                rb[i] = i == 1 ? STEPQ_BITS_PIVOT : (uint8_t)(i % 3 == 0 ? 8 : bits);
        }
        if (mixed && arch == STEPQ_ARCH_GDN && h == 1)
            memset(rb, STEPQ_BITS_PIVOT, (size_t)dk);
        assert_int_equal(stepq__head_layout_init(&p->heads[h], m, arch, dk, dv, rb, 0), STEPQ_OK);
        p->offset[h] = off;
        off += p->heads[h].block_bytes;
        double logsum = 0;
        for (int i = 0; i < dk; i++) {
            p->w[h * dk + i] = 0.3f + 2.0f * rng_unit(&rng);
            logsum += log(p->w[h * dk + i]);
        }
        for (int i = 0; i < dk; i++)
            p->w[h * dk + i] *= (float)exp(-logsum / dk);
    }
    size_t page = off + 8; /* a little slack: pages need not be tight */
    p->mem = calloc((size_t)n_slots, page);
    p->pl.base = p->mem;
    p->pl.page_stride = page;
    p->pl.n_slots = n_slots;
    p->pl.n_heads = HV;
    p->pl.heads = p->heads;
    p->pl.head_offset = p->offset;
    p->pl.row_impact = p->w;
}

static void pages_free(struct pages *p)
{
    for (int h = 0; h < p->pl.n_heads; h++)
        stepq__head_layout_free(&p->heads[h]);
    free(p->mem);
}

static size_t pages_bytes(const struct pages *p)
{
    return (size_t)p->pl.n_slots * p->pl.page_stride;
}

/* A copy of every page (to be freed), to compare the pages with later. */
static uint8_t *pages_snapshot(const struct pages *p)
{
    uint8_t *copy = malloc(pages_bytes(p));
    memcpy(copy, p->mem, pages_bytes(p));
    return copy;
}

/* Fills every slot with a packed random state. */
static void pages_fill(struct pages *p, uint64_t seed)
{
    int HV = p->pl.n_heads, dk = p->heads[0].d_k, dv = p->heads[0].d_v;
    size_t stride = (size_t)HV * dk * dv;
    float *x = malloc(sizeof(float) * stride * p->pl.n_slots);
    int32_t *slots = malloc(sizeof(int32_t) * p->pl.n_slots);
    uint64_t rng = seed;
    rng_fill(&rng, x, stride * p->pl.n_slots, 0.5f);
    for (int s = 0; s < p->pl.n_slots; s++)
        slots[s] = s;
    assert_int_equal(stepq__ref_pack(&p->pl, p->pl.n_slots, slots, x, stride, STEPQ__LAYOUT_KV,
                                     NULL, NULL, NULL),
                     STEPQ_OK);
    free(x);
    free(slots);
}

/*
 * NS pages of HV heads filled with a packed random state (seed_pages), and a
 * problem of B requests on the same arch and head shape (seed_problem).
 */
static void packed_problem_init(struct pages *p, struct problem *pr, stepq_method m,
                                stepq_arch arch, int B, int H, int HV, int dk, int dv, int NS,
                                int bits, uint64_t seed_pages, uint64_t seed_problem)
{
    pages_init(p, m, arch, NS, HV, dk, dv, bits);
    pages_fill(p, seed_pages);
    problem_init(pr, arch, B, H, HV, dk, dv, seed_problem);
}

static void packed_problem_free(struct pages *p, struct problem *pr)
{
    problem_free(pr);
    pages_free(p);
}

/*
 * Eq. 4: the packed step equals, page by page and byte by byte,
 * pack(step_dense(unpack(page))) with the same inputs, for every method and
 * both architectures; the outputs are the readout of the fp32 updated state.
 */
static void packed_step_is_quantize_of_update_of_dequantize(void **state)
{
    (void)state;
    enum { B = 3, H = 1, HV = 2, DK = 8, DV = 6, NS = 5 };
    for (int arch = 0; arch < 2; arch++) {
        for (size_t m = 0; m < N_METHODS; m++) {
            struct pages p;
            struct problem pr;
            packed_problem_init(&p, &pr, all_methods[m], (stepq_arch)arch, B, H, HV, DK, DV, NS, 4,
                                100 + m, 7 + m);
            pr.slots[0] = 4;
            pr.slots[1] = 1;
            pr.slots[2] = 2;
            pr.a.n_slots = NS;

            /* expected: unpack -> dense step -> pack, on a copy of the pages */
            uint8_t *expect = pages_snapshot(&p);
            size_t stride = (size_t)HV * DK * DV;
            float dense[B * HV * DK * DV], o_ref[B * HV * DV];
            int32_t idx[B] = { 0, 1, 2 };
            assert_int_equal(
                stepq__ref_unpack(&p.pl, B, pr.slots, dense, stride, STEPQ__LAYOUT_KV, NULL),
                STEPQ_OK);
            struct stepq__step_args a = pr.a;
            a.slots = idx;
            a.n_slots = B;
            a.o = o_ref;
            struct stepq__dense_states st = { dense, stride, STEPQ__LAYOUT_KV };
            assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_OK);
            struct stepq__packed_layer pe = p.pl;
            pe.base = expect;
            assert_int_equal(stepq__ref_pack(&pe, B, pr.slots, dense, stride, STEPQ__LAYOUT_KV,
                                             NULL, NULL, NULL),
                             STEPQ_OK);

            assert_int_equal(stepq__ref_step_packed(&pr.a, &p.pl), STEPQ_OK);
            assert_memory_equal(p.mem, expect, pages_bytes(&p));
            assert_memory_equal(pr.o, o_ref, sizeof(o_ref));
            free(expect);
            packed_problem_free(&p, &pr);
        }
    }
}

/* fp32 pages hold the state bit for bit: the packed step is the dense step. */
static void fp32_packed_step_equals_dense_step(void **state)
{
    (void)state;
    enum { B = 2, H = 2, HV = 4, DK = 8, DV = 8, NS = 3 };
    struct pages p;
    struct problem pr;
    packed_problem_init(&p, &pr, STEPQ_METHOD_FP32, STEPQ_ARCH_GDN, B, H, HV, DK, DV, NS, 0, 1, 2);
    size_t stride = (size_t)HV * DK * DV;
    float dense[NS * HV * DK * DV], o_ref[B * HV * DV];
    int32_t all[NS] = { 0, 1, 2 };
    assert_int_equal(stepq__ref_unpack(&p.pl, NS, all, dense, stride, STEPQ__LAYOUT_KV, NULL),
                     STEPQ_OK);
    struct stepq__step_args a = pr.a;
    a.o = o_ref;
    struct stepq__dense_states st = { dense, stride, STEPQ__LAYOUT_KV };
    assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_OK);
    assert_int_equal(stepq__ref_step_packed(&pr.a, &p.pl), STEPQ_OK);
    for (int s = 0; s < NS; s++)
        for (int h = 0; h < HV; h++)
            assert_memory_equal(p.mem + s * p.pl.page_stride + p.offset[h],
                                dense + s * stride + (size_t)h * DK * DV, sizeof(float) * DK * DV);
    assert_memory_equal(pr.o, o_ref, sizeof(o_ref));
    packed_problem_free(&p, &pr);
}

static void pack_and_unpack_accept_both_layouts(void **state)
{
    (void)state;
    enum { N = 2, HV = 2, DK = 5, DV = 7, NS = 3 };
    for (size_t m = 0; m < N_METHODS; m++) {
        struct pages a, b;
        pages_init(&a, all_methods[m], STEPQ_ARCH_KDA, NS, HV, DK, DV, 5);
        pages_init(&b, all_methods[m], STEPQ_ARCH_KDA, NS, HV, DK, DV, 5);
        size_t stride = (size_t)HV * DK * DV + 3; /* padded entries */
        float kv[N * (HV * DK * DV + 3)], vk[N * (HV * DK * DV + 3)];
        float kv2[N * (HV * DK * DV + 3)], vk2[N * (HV * DK * DV + 3)];
        uint64_t rng = 4;
        rng_fill(&rng, kv, sizeof(kv) / sizeof(float), 1.0f);
        for (int e = 0; e < N; e++)
            for (int h = 0; h < HV; h++)
                for (int i = 0; i < DK; i++)
                    for (int j = 0; j < DV; j++)
                        vk[e * stride + h * DK * DV + j * DK + i] =
                            kv[e * stride + h * DK * DV + i * DV + j];
        const int32_t slots[N] = { 2, 1 };
        assert_int_equal(
            stepq__ref_pack(&a.pl, N, slots, kv, stride, STEPQ__LAYOUT_KV, NULL, NULL, NULL),
            STEPQ_OK);
        assert_int_equal(
            stepq__ref_pack(&b.pl, N, slots, vk, stride, STEPQ__LAYOUT_VK, NULL, NULL, NULL),
            STEPQ_OK);
        assert_memory_equal(a.mem, b.mem, pages_bytes(&a));
        /* the sentinel page 0 was not in the list */
        for (size_t e = 0; e < a.pl.page_stride; e++)
            assert_int_equal(a.mem[e], 0);
        assert_int_equal(stepq__ref_unpack(&a.pl, N, slots, kv2, stride, STEPQ__LAYOUT_KV, NULL),
                         STEPQ_OK);
        assert_int_equal(stepq__ref_unpack(&a.pl, N, slots, vk2, stride, STEPQ__LAYOUT_VK, NULL),
                         STEPQ_OK);
        for (int e = 0; e < N; e++)
            for (int h = 0; h < HV; h++)
                for (int i = 0; i < DK; i++)
                    for (int j = 0; j < DV; j++)
                        assert_true(vk2[e * stride + h * DK * DV + j * DK + i] ==
                                    kv2[e * stride + h * DK * DV + i * DV + j]);
        if (all_methods[m] == STEPQ_METHOD_FP32)
            for (int e = 0; e < N; e++)
                assert_memory_equal(kv2 + e * stride, kv + e * stride,
                                    sizeof(float) * HV * DK * DV);
        pages_free(&a);
        pages_free(&b);
    }
}

static void packed_step_skips_padding_and_leaves_other_pages(void **state)
{
    (void)state;
    enum { B = 3, H = 1, HV = 2, DK = 8, DV = 8, NS = 5 };
    struct pages p;
    struct problem pr;
    packed_problem_init(&p, &pr, STEPQ_METHOD_STEPQ, STEPQ_ARCH_GDN, B, H, HV, DK, DV, NS, 6, 9,
                        10);
    pr.slots[0] = -1;
    pr.slots[1] = 3;
    pr.slots[2] = -1;
    pr.a.n_slots = NS;
    for (int e = 0; e < B * HV * DV; e++)
        pr.o[e] = 7.0f;
    uint8_t *before = pages_snapshot(&p);
    assert_int_equal(stepq__ref_step_packed(&pr.a, &p.pl), STEPQ_OK);
    size_t ps = p.pl.page_stride;
    for (int s = 0; s < NS; s++) {
        if (s == 3)
            assert_memory_not_equal(p.mem + s * ps, before + s * ps, ps);
        else
            assert_memory_equal(p.mem + s * ps, before + s * ps, ps);
    }
    for (int e = 0; e < HV * DV; e++) {
        assert_true(pr.o[e] == 7.0f);
        assert_true(pr.o[2 * HV * DV + e] == 7.0f);
    }
    free(before);
    packed_problem_free(&p, &pr);
}

static void packed_kernels_reject_bad_layers_without_writing(void **state)
{
    (void)state;
    enum { B = 1, H = 1, HV = 2, DK = 4, DV = 4, NS = 2 };
    struct pages p;
    struct problem pr;
    packed_problem_init(&p, &pr, STEPQ_METHOD_SPATIAL, STEPQ_ARCH_GDN, B, H, HV, DK, DV, NS, 4, 1,
                        1);
    pr.a.n_slots = NS;
    uint8_t *before = pages_snapshot(&p);
    float x[HV * DK * DV] = { 0 };
    const int32_t one = 1, dup[2] = { 1, 1 };

    p.w[5] = -1.0f; /* row impact must be > 0 */
    assert_int_equal(stepq__ref_step_packed(&pr.a, &p.pl), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "row impact of head 1 row 1"));
    assert_int_equal(
        stepq__ref_pack(&p.pl, 1, &one, x, HV * DK * DV, STEPQ__LAYOUT_KV, NULL, NULL, NULL),
        STEPQ_EINVAL);
    p.w[5] = 1.0f;
    p.offset[1] = p.pl.page_stride; /* block past the page end */
    assert_int_equal(stepq__ref_step_packed(&pr.a, &p.pl), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "exceeds the page"));
    p.offset[1] = p.heads[0].block_bytes;
    pr.a.arch = STEPQ_ARCH_KDA; /* pages laid out for GDN */
    assert_int_equal(stepq__ref_step_packed(&pr.a, &p.pl), STEPQ_EINVAL);
    pr.a.arch = STEPQ_ARCH_GDN;
    pr.slots[0] = NS;
    assert_int_equal(stepq__ref_step_packed(&pr.a, &p.pl), STEPQ_EINVAL);
    assert_int_equal(
        stepq__ref_pack(&p.pl, 2, dup, x, HV * DK * DV, STEPQ__LAYOUT_KV, NULL, NULL, NULL),
        STEPQ_EINVAL);
    assert_int_equal(stepq__ref_pack(&p.pl, 1, &one, x, 3, STEPQ__LAYOUT_KV, NULL, NULL, NULL),
                     STEPQ_EINVAL);
    assert_memory_equal(p.mem, before, pages_bytes(&p));
    free(before);
    packed_problem_free(&p, &pr);
}

/* A NaN input keeps the head's page bytes as they were; flag INPUT. */
static void non_finite_input_keeps_the_packed_page(void **state)
{
    (void)state;
    enum { B = 1, H = 1, HV = 2, DK = 4, DV = 4, NS = 2 };
    struct pages p;
    struct problem pr;
    packed_problem_init(&p, &pr, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, B, H, HV, DK, DV, NS, 4, 3, 4);
    pr.a.n_slots = NS;
    uint32_t health[NS] = { 0 };
    uint64_t counts[STEPQ__HEALTH_NCOUNTS] = { 0 };
    pr.a.health = health;
    pr.a.counts = counts;
    pr.q[1] = NAN; /* q/k head 0 feeds both value heads */
    uint8_t *before = pages_snapshot(&p);
    assert_int_equal(stepq__ref_step_packed(&pr.a, &p.pl), STEPQ_OK);
    assert_memory_equal(p.mem, before, pages_bytes(&p));
    for (int e = 0; e < HV * DV; e++)
        assert_true(pr.o[e] == 0.0f);
    assert_int_equal(health[1], STEPQ_HEALTH_INPUT);
    assert_int_equal(counts[0], 2);
    free(before);
    packed_problem_free(&p, &pr);
}

/* A page corrupted to hold fp16 Inf/NaN (pivot row) is repaired: the step
 * stores finite values only and flags STATE. */
static void corrupted_page_is_stored_finite_and_flagged(void **state)
{
    (void)state;
    enum { B = 1, H = 1, HV = 2, DK = 4, DV = 4, NS = 2 };
    struct pages p;
    struct problem pr;
    packed_problem_init(&p, &pr, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, B, H, HV, DK, DV, NS, 4, 3, 4);
    pr.a.n_slots = NS;
    uint32_t health[NS] = { 0 };
    pr.a.health = health;
    /* row 1 of every head is the pivot row: put +Inf and NaN halves into head 0's */
    uint8_t *blk = p.mem + p.pl.page_stride + p.offset[0] + p.heads[0].row_bitoff[1] / 8;
    const uint16_t inf = 0x7C00, nan = 0x7E00;
    memcpy(blk, &inf, 2);
    memcpy(blk + 2, &nan, 2);
    assert_int_equal(stepq__ref_step_packed(&pr.a, &p.pl), STEPQ_OK);
    assert_int_equal(health[1], STEPQ_HEALTH_STATE);
    float x[HV * DK * DV];
    const int32_t one = 1;
    assert_int_equal(stepq__ref_unpack(&p.pl, 1, &one, x, HV * DK * DV, STEPQ__LAYOUT_KV, NULL),
                     STEPQ_OK);
    for (int e = 0; e < HV * DK * DV; e++)
        assert_true(isfinite(x[e]));
    for (int e = 0; e < HV * DV; e++)
        assert_true(isfinite(pr.o[e]));
    packed_problem_free(&p, &pr);
}

/*
 * Quantized decode follows the fp32 decode from the same packed start: over
 * 200 tokens the readout error shrinks as bits grow, and at 8 bits it stays
 * within 5% for every quantized method (errors fed back through long-lived
 * gates accumulate: about 2% measured here, 7-8% at 6 bits, 30% at 4).
 */
static void quantized_decode_tracks_fp32_and_improves_with_bits(void **state)
{
    (void)state;
    static const stepq_method methods[] = { STEPQ_METHOD_UNIFORM, STEPQ_METHOD_DSQ,
                                            STEPQ_METHOD_SPATIAL, STEPQ_METHOD_STEPQ };
    static const int widths[] = { 4, 6, 8 };
    enum { T = 200, H = 1, HV = 2, DK = 16, DV = 16 };
    struct problem pr;
    problem_init(&pr, STEPQ_ARCH_GDN, T, H, HV, DK, DV, 77);
    float *oref = malloc(sizeof(float) * T * HV * DV), *oq = malloc(sizeof(float) * T * HV * DV);
    float s[HV * DK * DV] = { 0 };
    const int32_t slot0 = 0, slot1 = 1;
    struct stepq__dense_states st = { s, (size_t)HV * DK * DV, STEPQ__LAYOUT_KV };
    for (int t = 0; t < T; t++) {
        struct stepq__step_args a = problem_token(&pr, t, oref + t * HV * DV, &slot0);
        assert_int_equal(stepq__ref_step_dense(&a, &st), STEPQ_OK);
    }
    for (size_t m = 0; m < sizeof(methods) / sizeof(methods[0]); m++) {
        double prev = INFINITY;
        for (size_t b = 0; b < 3; b++) {
            struct pages p;
            pages_init(&p, methods[m], STEPQ_ARCH_GDN, 2, HV, DK, DV, widths[b]);
            for (int t = 0; t < T; t++) {
                struct stepq__step_args a = problem_token(&pr, t, oq + t * HV * DV, &slot1);
                a.n_slots = 2;
                assert_int_equal(stepq__ref_step_packed(&a, &p.pl), STEPQ_OK);
            }
            double e = rel_err(oq, oref, (size_t)T * HV * DV);
            if (getenv("STEPQ_TEST_VERBOSE"))
                print_message("method %d bits %d: readout rel err %.4g\n", (int)methods[m],
                              widths[b], e);
            assert_true(e < prev);
            prev = e;
            pages_free(&p);
        }
        assert_true(prev < 0.05);
    }
    free(oref);
    free(oq);
    problem_free(&pr);
}

/*
 * The packed step on the inputs as a server hands them (bf16, q|k|v views
 * into one fused projection row, padded g, beta and o rows, NaN in every
 * input gap; with the in-kernel gate A_log and dt_bias bf16 too): pages byte
 * for byte and health as the fp32 contiguous step on the same bf16-rounded
 * values, o its fp32 o rounded to bf16, o's gaps and the padding entry's row
 * untouched. GDN and KDA, with and without the gate, quantized and dense
 * pages.
 */
static void packed_step_bf16_strided_views_equal_fp32_contiguous_on_rounded_inputs(void **state)
{
    (void)state;
    static const stepq_method methods[] = { STEPQ_METHOD_STEPQ, STEPQ_METHOD_BF16 };
    for (int arch = 0; arch < 2; arch++)
        for (int gate = 0; gate < 2; gate++)
            for (size_t m = 0; m < 2; m++) {
                enum { B = 4, H = 2, HV = 4, DK = 8, DV = 8, NS = 6 };
                struct pages p1, p2;
                struct problem pr;
                packed_problem_init(&p1, &pr, methods[m], (stepq_arch)arch, B, H, HV, DK, DV, NS, 5,
                                    40 + m, 50 + 2 * arch + gate);
                pages_init(&p2, methods[m], (stepq_arch)arch, NS, HV, DK, DV, 5);
                memcpy(p2.mem, p1.mem, pages_bytes(&p1));
                pr.a.n_slots = NS;
                pr.slots[1] = -1;
                float A_log[HV], dt_bias[HV * DK];
                if (gate) {
                    int n_g = arch ? DK : 1;
                    uint64_t rng = 11;
                    for (int h = 0; h < HV; h++)
                        A_log[h] = rng_sym(&rng);
                    for (int e = 0; e < HV * n_g; e++)
                        dt_bias[e] = rng_sym(&rng);
                    for (int e = 0; e < B * HV * n_g; e++)
                        pr.g[e] = 4.0f * rng_sym(&rng);
                    for (int e = 0; e < B * HV; e++)
                        pr.beta[e] = 3.0f * rng_sym(&rng);
                    pr.a.A_log = A_log;
                    pr.a.dt_bias = dt_bias;
                    pr.a.opt.gate_in_kernel = 1;
                    pr.a.opt.beta_sigmoid = 1;
                }
                struct server_view w;
                struct stepq__step_args a =
                    server_view_init(&w, &pr, STEPQ_DTYPE_BF16, STEPQ_DTYPE_BF16,
                                     gate ? A_log : NULL, gate ? dt_bias : NULL);
                uint32_t h1[NS] = { 0 }, h2[NS] = { 0 };
                pr.a.health = h1;
                a.health = h2;
                assert_int_equal(stepq__ref_step_packed(&pr.a, &p1.pl), STEPQ_OK);
                assert_int_equal(stepq__ref_step_packed(&a, &p2.pl), STEPQ_OK);
                assert_memory_equal(p1.mem, p2.mem, pages_bytes(&p1));
                assert_memory_equal(h1, h2, sizeof(h1));
                for (int s = 0; s < NS; s++)
                    assert_false(h2[s] & STEPQ_HEALTH_INPUT); /* no NaN of a gap was read */
                assert_true(server_view_o_matches(&w, pr.o, pr.slots, B, HV, DV));
                server_view_free(&w);
                pages_free(&p2);
                packed_problem_free(&p1, &pr);
            }
}

/*
 * The packed step refuses what stepq__check_step_args refuses before any
 * page is touched: a stride one short of the packed row (STEPQ_EINVAL,
 * naming the field) and dtype / param_dtype fp16 (STEPQ_ENOTSUP). Pages
 * and o stay as they were.
 */
static void packed_step_rejects_short_strides_and_fp16_without_writing(void **state)
{
    (void)state;
    enum { B = 2, H = 1, HV = 2, DK = 4, DV = 4, NS = 3 };
    struct pages p;
    struct problem pr;
    packed_problem_init(&p, &pr, STEPQ_METHOD_STEPQ, STEPQ_ARCH_KDA, B, H, HV, DK, DV, NS, 4, 1, 2);
    pr.a.n_slots = NS;
    memset(pr.o, 0xA5, sizeof(float) * B * HV * DV);
    uint8_t *before = pages_snapshot(&p);
    struct stepq__step_args a;

    a = pr.a;
    a.q_stride = H * DK - 1;
    assert_int_equal(stepq__ref_step_packed(&a, &p.pl), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "q_stride"));
    a = pr.a;
    a.g_stride = HV * DK - 1; /* KDA: one gate per key channel */
    assert_int_equal(stepq__ref_step_packed(&a, &p.pl), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "g_stride"));
    a = pr.a;
    a.o_stride = HV * DV - 1;
    assert_int_equal(stepq__ref_step_packed(&a, &p.pl), STEPQ_EINVAL);
    assert_non_null(strstr(stepq_last_error(), "o_stride"));
    a = pr.a;
    a.dtype = STEPQ_DTYPE_FP16;
    assert_int_equal(stepq__ref_step_packed(&a, &p.pl), STEPQ_ENOTSUP);
    assert_non_null(strstr(stepq_last_error(), "dtype fp16 is not supported (fp32, bf16)"));
    a = pr.a;
    a.param_dtype = STEPQ_DTYPE_FP16;
    assert_int_equal(stepq__ref_step_packed(&a, &p.pl), STEPQ_ENOTSUP);
    assert_non_null(strstr(stepq_last_error(), "param_dtype fp16"));
    assert_memory_equal(p.mem, before, pages_bytes(&p));
    for (size_t e = 0; e < sizeof(float) * B * HV * DV; e++)
        assert_int_equal(((const uint8_t *)pr.o)[e], 0xA5);
    free(before);
    packed_problem_free(&p, &pr);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(packed_step_is_quantize_of_update_of_dequantize),
        cmocka_unit_test(fp32_packed_step_equals_dense_step),
        cmocka_unit_test(pack_and_unpack_accept_both_layouts),
        cmocka_unit_test(packed_step_skips_padding_and_leaves_other_pages),
        cmocka_unit_test(packed_kernels_reject_bad_layers_without_writing),
        cmocka_unit_test(non_finite_input_keeps_the_packed_page),
        cmocka_unit_test(corrupted_page_is_stored_finite_and_flagged),
        cmocka_unit_test(quantized_decode_tracks_fp32_and_improves_with_bits),
        cmocka_unit_test(packed_step_bf16_strided_views_equal_fp32_contiguous_on_rounded_inputs),
        cmocka_unit_test(packed_step_rejects_short_strides_and_fp16_without_writing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
