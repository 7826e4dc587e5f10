/*
 * Loads every map in config/examples (the folder is argv[1]) and checks its
 * memory numbers against a table written from first principles and the
 * paper; a file without an entry fails, so new examples must add one. Each
 * file must also be in canonical form: writing the loaded map gives back the
 * same bytes. The full example of config/SCHEMA.md (argv[2]) is checked the
 * same way, and so is every calibrated map (config/calibrated/<model>/, next
 * to the examples folder): a load + write through today's writer gives the
 * bytes their SHA256SUMS were taken of.
 */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "stepq/map.h"

static const char *examples_dir, *schema_md;

struct expect {
    const char *file;
    const char *model;
    stepq_method method;
    uint64_t fp32, compact, conv, pivots;
};

/*
 * GDN head of 128x128 at b bits: 2048*b code bytes + 256 B row scales
 * (+ 256 B column scales for dsq); KDA row of 128 at b bits: 16*b + 2 B,
 * plus 256 B of column scales per head for dsq.
 */
static const struct expect table[] = {
    { "qwen3.8-27b.fp32.json", "Qwen3.8-27B", STEPQ_METHOD_FP32, 150994944, 150994944, 2949120, 0 },
    { "qwen3.8-27b.uniform-4.json", "Qwen3.8-27B", STEPQ_METHOD_UNIFORM, 150994944,
      2304ull * (2048 * 4 + 256), 2949120, 0 },
    { "qwen3.8-27b.uniform-6.json", "Qwen3.8-27B", STEPQ_METHOD_UNIFORM, 150994944, 28901376,
      2949120, 0 },
    { "qwen3.8-27b.uniform-8.json", "Qwen3.8-27B", STEPQ_METHOD_UNIFORM, 150994944,
      2304ull * (2048 * 8 + 256), 2949120, 0 },
    { "qwen3.8-27b.dsq-6.json", "Qwen3.8-27B", STEPQ_METHOD_DSQ, 150994944, 29491200, 2949120, 0 },
    { "qwen3.8-27b.stepq-6-layout.json", "Qwen3.8-27B", STEPQ_METHOD_STEPQ, 150994944, 29999104,
      2949120, 32 },
    { "qwen3-next-80b-a3b.fp32.json", "Qwen3-Next-80B-A3B", STEPQ_METHOD_FP32, 75497472, 75497472,
      36ull * 8192 * 3 * 2, 0 },
    { "qwen3-next-80b-a3b.uniform-4.json", "Qwen3-Next-80B-A3B", STEPQ_METHOD_UNIFORM, 75497472,
      1152ull * (2048 * 4 + 256), 1769472, 0 },
    { "qwen3-next-80b-a3b.uniform-6.json", "Qwen3-Next-80B-A3B", STEPQ_METHOD_UNIFORM, 75497472,
      1152ull * (2048 * 6 + 256), 1769472, 0 },
    { "qwen3-next-80b-a3b.uniform-8.json", "Qwen3-Next-80B-A3B", STEPQ_METHOD_UNIFORM, 75497472,
      1152ull * (2048 * 8 + 256), 1769472, 0 },
    { "kimi-linear-48b-a3b.fp32.json", "Kimi-Linear-48B-A3B", STEPQ_METHOD_FP32, 41943040, 41943040,
      20ull * 3 * 4096 * 3 * 2, 0 },
    { "kimi-linear-48b-a3b.uniform-4.json", "Kimi-Linear-48B-A3B", STEPQ_METHOD_UNIFORM, 41943040,
      81920ull * (16 * 4 + 2), 1474560, 0 },
    { "kimi-linear-48b-a3b.uniform-6.json", "Kimi-Linear-48B-A3B", STEPQ_METHOD_UNIFORM, 41943040,
      81920ull * (16 * 6 + 2), 1474560, 0 },
    { "kimi-linear-48b-a3b.uniform-8.json", "Kimi-Linear-48B-A3B", STEPQ_METHOD_UNIFORM, 41943040,
      81920ull * (16 * 8 + 2), 1474560, 0 },
    { "kimi-linear-48b-a3b.dsq-4.json", "Kimi-Linear-48B-A3B", STEPQ_METHOD_DSQ, 41943040, 5570560,
      1474560, 0 },
    /* fp8: 1 B per value + 4 fp32 tile scales (16 B) per 128x128 head. */
    { "qwen3-next-80b-a3b.fp8.json", "Qwen3-Next-80B-A3B", STEPQ_METHOD_FP8, 75497472,
      1152ull * (16384 + 16), 1769472, 0 },
    { "kimi-linear-48b-a3b.fp8.json", "Kimi-Linear-48B-A3B", STEPQ_METHOD_FP8, 41943040,
      640ull * (16384 + 16), 1474560, 0 },
    { "tiny-gdn.fp32.json", "tiny-gdn", STEPQ_METHOD_FP32, 3145728, 3145728, 6ull * 2048 * 3 * 2,
      0 },
    { "tiny-gdn.uniform-4.json", "tiny-gdn", STEPQ_METHOD_UNIFORM, 3145728,
      48ull * (2048 * 4 + 256), 73728, 0 },
    { "tiny-gdn.uniform-6.json", "tiny-gdn", STEPQ_METHOD_UNIFORM, 3145728,
      48ull * (2048 * 6 + 256), 73728, 0 },
    { "tiny-gdn.uniform-8.json", "tiny-gdn", STEPQ_METHOD_UNIFORM, 3145728,
      48ull * (2048 * 8 + 256), 73728, 0 },
};
#define N_TABLE (sizeof(table) / sizeof(table[0]))

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    assert_true(n > 0);
    rewind(f);
    char *buf = malloc((size_t)n);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static void check_one(const char *name, const struct expect *e)
{
    char path[1024];
    stepq_map_t *map = NULL;
    stepq_map_memory m;

    snprintf(path, sizeof(path), "%s/%s", examples_dir, name);
    int st = stepq_map_load_file(path, NULL, &map);
    if (st < 0)
        print_error("%s: %s\n", name, stepq_last_error());
    assert_int_equal(st, STEPQ_OK);
    assert_int_equal(stepq_map_memory_info(map, &m), STEPQ_OK);
    if (m.state_bytes_fp32 != e->fp32 || m.state_bytes_compact != e->compact ||
        m.conv_bytes != e->conv || m.n_pivots != e->pivots)
        print_error("%s: fp32 %llu compact %llu conv %llu pivots %llu\n", name,
                    (unsigned long long)m.state_bytes_fp32,
                    (unsigned long long)m.state_bytes_compact, (unsigned long long)m.conv_bytes,
                    (unsigned long long)m.n_pivots);
    assert_int_equal(m.state_bytes_fp32, e->fp32);
    assert_int_equal(m.state_bytes_compact, e->compact);
    assert_int_equal(m.conv_bytes, e->conv);
    assert_int_equal(m.n_pivots, e->pivots);
    assert_int_equal(stepq_map_method(map), e->method);
    assert_string_equal(stepq_map_model_name(map), e->model);
    assert_non_null(stepq_map_provenance(map, "notes"));
    if (e->method == STEPQ_METHOD_STEPQ) /* a synthetic layout must say so */
        assert_non_null(strstr(stepq_map_provenance(map, "notes"), "not calibrated"));

    /* canonical form */
    size_t flen, wlen;
    char *file = slurp(path, &flen), *text;
    assert_int_equal(stepq_map_write_buffer(map, &text, &wlen), STEPQ_OK);
    assert_int_equal(wlen, flen);
    assert_memory_equal(text, file, flen);
    stepq_free(text);
    free(file);
    stepq_map_close(map);
}

static void every_example_map_loads_with_the_expected_numbers(void **state)
{
    DIR *d = opendir(examples_dir);
    struct dirent *ent;
    int seen[N_TABLE] = { 0 }, files = 0;

    assert_non_null(d);
    while ((ent = readdir(d))) {
        size_t n = strlen(ent->d_name);
        if (n < 5 || strcmp(ent->d_name + n - 5, ".json"))
            continue;
        size_t i;
        for (i = 0; i < N_TABLE; i++)
            if (!strcmp(table[i].file, ent->d_name))
                break;
        if (i == N_TABLE)
            print_error("%s has no entry in the table of this test\n", ent->d_name);
        assert_true(i < N_TABLE);
        check_one(ent->d_name, &table[i]);
        seen[i]++;
        files++;
    }
    closedir(d);
    for (size_t i = 0; i < N_TABLE; i++) {
        if (seen[i] != 1)
            print_error("%s is missing from %s\n", table[i].file, examples_dir);
        assert_int_equal(seen[i], 1);
    }
    print_message("%d example maps checked\n", files);
}

static void the_stepq_layout_example_is_the_paper_layout(void **state)
{
    char path[1024];
    stepq_map_t *map = NULL;
    stepq_map_memory m;
    int count[17] = { 0 };
    long sum = 0;

    snprintf(path, sizeof(path), "%s/qwen3.8-27b.stepq-6-layout.json", examples_dir);
    assert_int_equal(stepq_map_load_file(path, NULL, &map), STEPQ_OK);
    for (int l = 0; l < 48; l++) {
        for (int h = 0; h < 48; h++) {
            int b = stepq_map_unit_bits(map, l, h);
            assert_true(b == 4 || b == 6 || b == 8 || b == STEPQ_BITS_PIVOT);
            count[b]++;
            if (b != STEPQ_BITS_PIVOT)
                sum += b;
            const float *w = stepq_map_row_impact(map, l, h);
            assert_non_null(w);
            for (int r = 0; r < 128; r++)
                assert_true(w[r] == 1.0f);
        }
    }
    assert_int_equal(count[STEPQ_BITS_PIVOT], 32);
    assert_int_equal(sum, 6 * 2304 - 8 * 32);
    assert_int_equal(stepq_map_memory_info(map, &m), STEPQ_OK);
    assert_true(m.ratio_vs_fp32 > 5.03 && m.ratio_vs_fp32 < 5.04);
    int cand[8];
    assert_int_equal(stepq_map_provenance_candidates(map, cand, 8), 3);
    assert_int_equal(cand[0], 4);
    assert_int_equal(cand[2], 8);
    stepq_map_close(map);
}

/* The "Full example" of config/SCHEMA.md loads and is exactly the writer's output. */
static void the_schema_document_example_is_canonical(void **state)
{
    size_t len, wlen;
    char *md = slurp(schema_md, &len), *text;
    md = realloc(md, len + 1);
    assert_non_null(md);
    md[len] = '\0';
    char *sec = strstr(md, "## Full example");
    assert_non_null(sec);
    char *start = strstr(sec, "```json\n");
    assert_non_null(start);
    start += 8;
    char *end = strstr(start, "\n```");
    assert_non_null(end);
    end++; /* keep the final newline */

    stepq_map_t *map = NULL;
    int st = stepq_map_load_buffer(start, (size_t)(end - start), NULL, &map);
    if (st < 0)
        print_error("SCHEMA.md example: %s\n", stepq_last_error());
    assert_int_equal(st, STEPQ_OK);
    assert_int_equal(stepq_map_write_buffer(map, &text, &wlen), STEPQ_OK);
    assert_int_equal(wlen, (size_t)(end - start));
    assert_memory_equal(text, start, wlen);
    stepq_map_memory m;
    assert_int_equal(stepq_map_memory_info(map, &m), STEPQ_OK);
    assert_int_equal(m.state_bytes_compact, 112); /* the number SCHEMA.md quotes */
    assert_int_equal(m.state_bytes_fp32, 256);
    stepq_free(text);
    stepq_map_close(map);
    free(md);
}

/* Every config/calibrated/<model>/<map>.json: loads, and writing it back gives the same bytes. */
static void every_calibrated_map_is_canonical(void **state)
{
    char root[1024], dir[2048], path[3072];
    DIR *top, *d;
    struct dirent *ent, *m;
    int files = 0;

    snprintf(root, sizeof(root), "%s/../calibrated", examples_dir);
    top = opendir(root);
    assert_non_null(top);
    while ((ent = readdir(top))) {
        if (ent->d_name[0] == '.')
            continue;
        snprintf(dir, sizeof(dir), "%s/%s", root, ent->d_name);
        if (!(d = opendir(dir)))
            continue; /* README.md */
        while ((m = readdir(d))) {
            size_t n = strlen(m->d_name), flen, wlen;
            if (n < 5 || strcmp(m->d_name + n - 5, ".json"))
                continue;
            snprintf(path, sizeof(path), "%s/%s", dir, m->d_name);
            stepq_map_t *map = NULL;
            int st = stepq_map_load_file(path, NULL, &map);
            if (st < 0)
                print_error("%s: %s\n", path, stepq_last_error());
            assert_int_equal(st, STEPQ_OK);
            char *file = slurp(path, &flen), *text;
            assert_int_equal(stepq_map_write_buffer(map, &text, &wlen), STEPQ_OK);
            if (wlen != flen || memcmp(text, file, flen))
                print_error("%s: writing it back gives other bytes\n", path);
            assert_int_equal(wlen, flen);
            assert_memory_equal(text, file, flen);
            stepq_free(text);
            free(file);
            stepq_map_close(map);
            files++;
        }
        closedir(d);
    }
    closedir(top);
    assert_true(files > 0);
    print_message("%d calibrated maps checked\n", files);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_example_map_loads_with_the_expected_numbers),
        cmocka_unit_test(the_stepq_layout_example_is_the_paper_layout),
        cmocka_unit_test(the_schema_document_example_is_canonical),
        cmocka_unit_test(every_calibrated_map_is_canonical),
    };
    if (argc != 3) {
        fprintf(stderr, "usage: %s CONFIG_EXAMPLES_DIR SCHEMA_MD\n", argv[0]);
        return 2;
    }
    examples_dir = argv[1];
    schema_md = argv[2];
    return cmocka_run_group_tests(tests, NULL, NULL);
}
