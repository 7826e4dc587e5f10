/*
 * The trace reader and writer: round trips (values, dtypes, multi-file sets
 * joined by stream offset), and rejected files whose message names the
 * tensor or key at fault.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "stepq/stepq.h"
#include "tools/calib/trace.h"

static char dir[] = "/tmp/stepq-test-trace-XXXXXX";

/* Writes a GDN trace file: layers {0, 2}, H 1, HV 2, K 3, V 2, T 4; streams [s0, s0+ns) of
 * `total`; value of element = code(stream, layer, tensor, index). */
static float val(int s, int l, int t, int i)
{
    return (float)(s * 1000 + l * 100 + t * 10) + 0.125f * (float)(i % 8);
}

static void write_trace(const char *path, int s0, int ns, int total, stepq__trace_dtype dt,
                        const char *layers)
{
    static const char *tn[5] = { "q", "k", "v", "g", "beta" };
    struct stepq__trace_wtensor wt[10];
    char names[10][32];
    int lids[2] = { 0, 2 }, nl = strcmp(layers, "0,2") ? 1 : 2;
    if (!strcmp(layers, "2"))
        lids[0] = 2;
    for (int l = 0; l < nl; l++)
        for (int k = 0; k < 5; k++) {
            struct stepq__trace_wtensor *t = &wt[l * 5 + k];
            snprintf(names[l * 5 + k], 32, "layer%d.%s", lids[l], tn[k]);
            t->name = names[l * 5 + k];
            t->dtype = k == 3 ? STEPQ__TRACE_F32 : dt;
            int64_t sh[4] = { ns, 4, k < 2 ? 1 : 2, k < 2 ? 3 : 2 };
            t->ndim = k >= 3 ? 3 : 4;
            memcpy(t->shape, sh, sizeof(sh));
        }
    char so[16], n[16], tot[16];
    snprintf(so, sizeof(so), "%d", s0);
    snprintf(n, sizeof(n), "%d", ns);
    snprintf(tot, sizeof(tot), "%d", total);
    const char *meta[] = { "format",
                           "stepq-trace",
                           "version",
                           "1",
                           "arch",
                           "gdn",
                           "H",
                           "1",
                           "HV",
                           "2",
                           "K",
                           "3",
                           "V",
                           "2",
                           "qk_heads",
                           "H",
                           "qk_l2norm",
                           "1",
                           "scale",
                           "0.5",
                           "all_layers",
                           "0,2",
                           "layers",
                           layers,
                           "stream_offset",
                           so,
                           "n_streams",
                           n,
                           "streams_total",
                           tot,
                           "seq_len",
                           "4" };
    struct stepq__trace_writer *w;
    assert_int_equal(stepq__trace_writer_open(path, wt, nl * 5, meta, 16, &w), 0);
    for (int l = 0; l < nl; l++)
        for (int k = 0; k < 5; k++) {
            int64_t per =
                4 * wt[l * 5 + k].shape[2] * (wt[l * 5 + k].ndim == 4 ? wt[l * 5 + k].shape[3] : 1);
            for (int s = s0; s < s0 + ns; s++)
                for (int64_t i = 0; i < per; i++) {
                    float x = val(s, lids[l], k, (int)i);
                    assert_int_equal(stepq__trace_writer_put(w, &x, 1), 0);
                }
        }
    assert_int_equal(stepq__trace_writer_close(w), 0);
}

static void check_values_as(const struct stepq__trace_set *ts, int local, int s, int li, int lid,
                            int hv)
{
    float q[12], k[12], v[8], g[4], b[4];
    assert_int_equal(stepq__trace_head(ts, local, li, hv, 0, 4, q, k, v, g, b, NULL), 0);
    for (int t = 0; t < 4; t++) {
        for (int i = 0; i < 3; i++) {
            assert_true(q[t * 3 + i] == val(s, lid, 0, t * 3 + i));
            assert_true(k[t * 3 + i] == val(s, lid, 1, t * 3 + i));
        }
        for (int j = 0; j < 2; j++)
            assert_true(v[t * 2 + j] == val(s, lid, 2, (t * 2 + hv) * 2 + j));
        assert_true(g[t] == val(s, lid, 3, t * 2 + hv));
        assert_true(b[t] == val(s, lid, 4, t * 2 + hv));
    }
}

static void check_values(const struct stepq__trace_set *ts, int s, int li, int lid, int hv)
{
    check_values_as(ts, s, s, li, lid, hv);
}

/* Writes `name` under dir as the whole trace (layers 0,2, streams [0, ns) of `total`) and
 * opens it as a set of one file. */
static struct stepq__trace_set *write_and_open_one(const char *name, int ns, int total,
                                                   stepq__trace_dtype dt)
{
    char p[256];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    write_trace(p, 0, ns, total, dt, "0,2");
    const char *paths[1] = { p };
    struct stepq__trace_set *ts;
    assert_int_equal(stepq__trace_set_open(paths, 1, &ts), 0);
    return ts;
}

static void round_trip_fp32_and_bf16_values_exact(void **state)
{
    (void)state;
    /* Values are multiples of 1/8 below 2^8 * 8: exact in bf16 too when small; use fp32 here. */
    struct stepq__trace_set *ts = write_and_open_one("a.safetensors", 2, 2, STEPQ__TRACE_F32);
    const struct stepq__trace_info *I = stepq__trace_set_info(ts);
    assert_int_equal(I->n_streams, 2);
    assert_int_equal(I->n_layers, 2);
    assert_int_equal(I->layer_ids[1], 2);
    assert_true(I->scale == 0.5f);
    check_values(ts, 1, 1, 2, 1);
    check_values(ts, 0, 0, 0, 0);
    /* Out-of-range requests are refused. */
    float x[64];
    assert_int_equal(stepq__trace_head(ts, 2, 0, 0, 0, 1, x, NULL, NULL, NULL, NULL, NULL),
                     STEPQ_EINVAL);
    assert_int_equal(stepq__trace_head(ts, 0, 0, 0, 2, 3, x, NULL, NULL, NULL, NULL, NULL),
                     STEPQ_EINVAL);
    stepq__trace_set_close(ts);
}

/*
 * A trace file truncated after it was opened: the values read at open stay
 * readable (a mapped file killed the reader with SIGBUS here).
 */
static void a_file_truncated_after_open_stays_readable(void **state)
{
    (void)state;
    char p[256];
    snprintf(p, sizeof(p), "%s/trunc.safetensors", dir);
    write_trace(p, 0, 2, 2, STEPQ__TRACE_F32, "0,2");
    const char *paths[1] = { p };
    struct stepq__trace_set *ts;
    assert_int_equal(stepq__trace_set_open(paths, 1, &ts), 0);
    assert_int_equal(truncate(p, 0), 0);
    check_values(ts, 1, 1, 2, 1);
    check_values(ts, 0, 0, 0, 0);
    stepq__trace_set_close(ts);
}

static void set_joins_files_split_by_streams_and_layers(void **state)
{
    (void)state;
    char a[256], b[256], c[256];
    snprintf(a, sizeof(a), "%s/s0.safetensors", dir);
    snprintf(b, sizeof(b), "%s/s1l0.safetensors", dir);
    snprintf(c, sizeof(c), "%s/s1l2.safetensors", dir);
    write_trace(a, 0, 1, 2, STEPQ__TRACE_F32, "0,2");
    write_trace(b, 1, 1, 2, STEPQ__TRACE_F32, "0");
    write_trace(c, 1, 1, 2, STEPQ__TRACE_F32, "2");
    const char *paths[3] = { c, a, b };
    struct stepq__trace_set *ts;
    assert_int_equal(stepq__trace_set_open(paths, 3, &ts), 0);
    check_values(ts, 1, 1, 2, 0);
    check_values(ts, 1, 0, 0, 1);
    check_values(ts, 0, 1, 2, 1);
    stepq__trace_set_close(ts);
    /* A stream given twice, or missing, is an error naming it. */
    const char *dup[3] = { a, a, b };
    assert_int_equal(stepq__trace_set_open(dup, 3, &ts), STEPQ_ESCHEMA);
    assert_non_null(strstr(stepq_last_error(), "appears twice"));
    const char *miss[2] = { a, b };
    assert_int_equal(stepq__trace_set_open(miss, 2, &ts), STEPQ_ESCHEMA);
    assert_non_null(strstr(stepq_last_error(), "stream 1 of layer 2"));
    /* A subset of the streams is a set of its own, renumbered from 0. */
    const char *sub[2] = { c, b };
    assert_int_equal(stepq__trace_set_open(sub, 2, &ts), 0);
    assert_int_equal(stepq__trace_set_info(ts)->n_streams, 1);
    check_values_as(ts, 0, 1, 1, 2, 0);
    stepq__trace_set_close(ts);
}

static void bf16_storage_rounds_to_nearest(void **state)
{
    (void)state;
    struct stepq__trace_set *ts = write_and_open_one("b.safetensors", 1, 1, STEPQ__TRACE_BF16);
    float q[12];
    assert_int_equal(stepq__trace_head(ts, 0, 1, 0, 0, 4, q, NULL, NULL, NULL, NULL, NULL), 0);
    /* 200.125 is not representable in bf16 (8 significant bits): 200.0 */
    assert_true(q[1] == 200.0f);
    stepq__trace_set_close(ts);
}

/* Parses an in-memory image and expects status + a message fragment. */
static void expect_bad(const char *img, size_t len, int status, const char *frag)
{
    struct stepq__trace_file *f = NULL;
    int rc = stepq__trace_file_parse((const uint8_t *)img, len, "mem", &f);
    if (rc >= 0) {
        struct stepq__trace_set *ts;
        rc = stepq__trace_set_from_files(&f, 1, &ts);
        if (rc >= 0)
            stepq__trace_set_close(ts);
    }
    if (rc != status || !strstr(stepq_last_error(), frag))
        fail_msg("expected %d '%s', got %d '%s'", status, frag, rc, stepq_last_error());
}

static size_t mk(char *buf, const char *hdr, size_t data_len)
{
    size_t hl = strlen(hdr);
    for (int i = 0; i < 8; i++)
        buf[i] = (char)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, hdr, hl);
    memset(buf + 8 + hl, 0, data_len);
    return 8 + hl + data_len;
}

static void malformed_files_name_the_tensor(void **state)
{
    (void)state;
    char buf[4096];
    size_t n;
    n = mk(buf, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4);
    expect_bad(buf, n, STEPQ_ERANGE, "tensor 'a'");
    n = mk(buf, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4);
    expect_bad(buf, n, STEPQ_ERANGE, "'a': data_offsets span 4 bytes");
    n = mk(buf, "{\"a\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2);
    expect_bad(buf, n, STEPQ_ESCHEMA, "'a': dtype 'I8'");
    n = mk(buf,
           "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
           "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}",
           6);
    expect_bad(buf, n, STEPQ_ERANGE, "not aligned");
    n = mk(buf,
           "{\"a\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]},"
           "\"b\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[2,4]}}",
           4);
    expect_bad(buf, n, STEPQ_ERANGE, "overlaps");
    n = mk(buf, "{\"a\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[2,4]}}", 4);
    expect_bad(buf, n, STEPQ_ERANGE, "unused bytes before tensor 'a'");
    n = mk(buf, "{\"a\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]}}", 6);
    expect_bad(buf, n, STEPQ_ERANGE, "after the last tensor");
    n = mk(buf, "{\"a\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]}} x", 2);
    expect_bad(buf, n, STEPQ_EPARSE, "trailing");
    n = mk(buf, "{\"a\xff\":1}", 0);
    expect_bad(buf, n, STEPQ_EPARSE, "UTF-8");
    expect_bad(buf, 5, STEPQ_EPARSE, "shorter than the 8-byte");
    n = mk(buf, "{}", 0);
    buf[5] = 1; /* header length 2^40 + 2 */
    expect_bad(buf, n, STEPQ_ERANGE, "header of");
    n = mk(buf, "{\"__metadata__\":{\"format\":\"stepq-trace\"}}", 0);
    expect_bad(buf, n, STEPQ_ESCHEMA, "__metadata__.version");
}

static void missing_file_is_enoent(void **state)
{
    (void)state;
    const char *paths[1] = { "/nonexistent/x.safetensors" };
    struct stepq__trace_set *ts;
    assert_int_equal(stepq__trace_set_open(paths, 1, &ts), STEPQ_ENOENT);
    assert_non_null(strstr(stepq_last_error(), "/nonexistent/x.safetensors"));
}

int main(void)
{
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(round_trip_fp32_and_bf16_values_exact),
        cmocka_unit_test(set_joins_files_split_by_streams_and_layers),
        cmocka_unit_test(bf16_storage_rounds_to_nearest),
        cmocka_unit_test(malformed_files_name_the_tensor),
        cmocka_unit_test(missing_file_is_enoent),
        cmocka_unit_test(a_file_truncated_after_open_stays_readable),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
