/*
 * The strict loader: a table of malformed maps, each expecting one status
 * and a message that names the JSON path of the problem. Each base document
 * of the table is also loaded as is, so a case fails for its own mutation.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "config/map_internal.h"
#include "tests/config/fixtures.h"

#define FMT  "\"format\": \"stepq-precision-map\", \"schema_version\": 1, "
#define CONV ", \"conv_state\": {\"shape\": [12, 3], \"dtype\": \"bf16\"}"
#define GDN_MODEL_X(extra)                                                              \
    "\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": [0, 2], \"num_k_heads\": 1, " \
    "\"num_v_heads\": 2, \"head_k_dim\": 4, \"head_v_dim\": 4" extra "}, "
#define GDN_MODEL           GDN_MODEL_X(CONV)
#define U6                  "\"method\": \"uniform\", \"budget_bits\": 6, "
#define S6                  "\"method\": \"stepq\", \"budget_bits\": 6, "
#define H(b)                "{\"bits\": " #b "}"
#define W                   "\"row_impact\": [1, 1, 1, 1]"
#define HW(b)               "{\"bits\": " #b ", " W "}"
#define LAY(id, piv, heads) "{\"layer\": " #id ", \"pivots\": " piv ", \"heads\": [" heads "]}"
#define LAYERS(a, b)        "\"layers\": [" a ", " b "]"
#define DOC(...)            "{" FMT __VA_ARGS__ "}"

/* uniform@6, 2 layers x 2 heads of 4x4 */
#define U6_LAYERS LAYERS(LAY(0, "[]", H(6) ", " H(6)), LAY(2, "[]", H(6) ", " H(6)))
#define U6_DOC    DOC(GDN_MODEL U6 U6_LAYERS)
/* stepq@6 with one pivot (layer 0 head 1): 4 + 6 + 6 head-bits = 6*4 - 8*1 */
#define S6_LAYERS(l0h0, l0h1, l2h0) \
    LAYERS(LAY(0, "[1]", l0h0 ", " l0h1), LAY(2, "[]", l2h0 ", " HW(6)))
#define S6_DOC DOC(GDN_MODEL S6 S6_LAYERS(HW(4), HW(16), HW(6)))

/* GDN statistics */
#define ST       "\"stats\": {\"log_retention\": -0.1, \"lambda\": 2, \"distortion\": {\"4\": 0.1}}"
#define HS(b)    "{\"bits\": " #b ", " ST "}"
#define D6_STATS "\"method\": \"dsq\", \"budget_bits\": 6, "
#define STATS_DOC \
    DOC(GDN_MODEL D6_STATS LAYERS(LAY(0, "[]", HS(6) ", " HS(6)), LAY(2, "[]", HS(6) ", " HS(6))))

/* KDA: 1 layer (model layer 3), 2 heads of 2 rows x 4 */
#define KDA_MODEL                                                                    \
    "\"model\": {\"arch\": \"kda\", \"recurrent_layers\": [3], \"num_k_heads\": 2, " \
    "\"num_v_heads\": 2, \"head_k_dim\": 2, \"head_v_dim\": 4}, "
#define KU4                 "\"method\": \"uniform\", \"budget_bits\": 4, "
#define KR(a, b)            "{\"row_bits\": [" #a ", " #b "]}"
#define KDA_DOC             DOC(KDA_MODEL KU4 "\"layers\": [" LAY(3, "[]", KR(4, 4) ", " KR(4, 4)) "]")
#define KW                  "\"row_impact\": [1, 1]"
#define KRW(a, b)           "{\"row_bits\": [" #a ", " #b "], " KW "}"
#define KS6                 "\"method\": \"stepq\", \"budget_bits\": 6, "
#define KDA_S6(piv, h0, h1) DOC(KDA_MODEL KS6 "\"layers\": [" LAY(3, piv, h0 ", " h1) "]")
#define KST                                                                                     \
    "\"stats\": {\"log_retention\": [-0.1, -0.2], \"lambda\": [1, 2], \"distortion\": {\"4\": " \
    "[0.1, 0.2]}}"
#define KDA_STATS(st0, st1)                \
    DOC(KDA_MODEL KU4 "\"layers\": [" LAY( \
        3, "[]", "{\"row_bits\": [4, 4], " st0 "}, {\"row_bits\": [4, 4], " st1 "}") "]")

#define FP32_DOC DOC(GDN_MODEL "\"method\": \"fp32\", \"budget_bits\": 32")

/* The dual-axis fit's row split (dsq, spatial, stepq only). */
#define RS(v)       "\"row_split\": " v ", "
#define S6_SPLIT(v) DOC(GDN_MODEL S6 RS(v) S6_LAYERS(HW(4), HW(16), HW(6)))
#define KDA_DSQ_SPLIT                                                                      \
    DOC(KDA_MODEL "\"method\": \"dsq\", \"budget_bits\": 4, " RS("1") "\"layers\": [" LAY( \
        3, "[]", KR(4, 4) ", " KR(4, 4)) "]")

/* The decode step's fit (dsq, spatial, stepq only). */
#define DF(v)     "\"decode_fit\": " v ", "
#define S6_FIT(v) DOC(GDN_MODEL S6 DF(v) S6_LAYERS(HW(4), HW(16), HW(6)))
#define KDA_DSQ_FIT                                                   \
    DOC(KDA_MODEL "\"method\": \"dsq\", \"budget_bits\": 4, " RS("1") \
            DF("\"norefit\"") "\"layers\": [" LAY(3, "[]", KR(4, 4) ", " KR(4, 4)) "]")

/* The decode step's arithmetic (dsq, spatial, stepq only; fp16 with the exact fit or norefit). */
#define AR(v)                "\"arith\": " v ", "
#define S6_ARITH(v)          DOC(GDN_MODEL S6 AR(v) S6_LAYERS(HW(4), HW(16), HW(6)))
#define S6_FIT_ARITH(fit, v) DOC(GDN_MODEL S6 DF(fit) AR(v) S6_LAYERS(HW(4), HW(16), HW(6)))
#define S6_ARITH_FIT(v, fit) DOC(GDN_MODEL S6 AR(v) DF(fit) S6_LAYERS(HW(4), HW(16), HW(6)))
#define KDA_DSQ_ARITH                                                 \
    DOC(KDA_MODEL "\"method\": \"dsq\", \"budget_bits\": 4, " RS("1") \
            AR("\"fp16\"") "\"layers\": [" LAY(3, "[]", KR(4, 4) ", " KR(4, 4)) "]")

struct bad_case {
    const char *name;
    const char *doc;
    size_t len; /* 0: strlen(doc) */
    int status;
    const char *msg; /* substring of stepq_last_error() */
};

static const char *const good_docs[] = {
    U6_DOC,
    S6_DOC,
    STATS_DOC,
    KDA_DOC,
    KDA_S6("[[0, 1]]", KRW(4, 16), KRW(6, 6)),
    KDA_STATS(KST, KST),
    FP32_DOC,
    DOC(GDN_MODEL_X("") U6 U6_LAYERS), /* no conv state */
    S6_SPLIT("0.75"),
    KDA_DSQ_SPLIT,
    S6_SPLIT("0.5"), /* the default, written out: accepted (the writer leaves it out) */
    S6_FIT("\"norefit\""),
    S6_FIT("\"rows\""),
    KDA_DSQ_FIT,
    S6_FIT("\"exact\""), /* the default, written out: accepted (the writer leaves it out) */
    S6_ARITH("\"fp16\""),
    KDA_DSQ_ARITH,
    S6_FIT_ARITH("\"exact\"", "\"fp16\""),   /* fp16 with the exact fit, written out */
    S6_FIT_ARITH("\"norefit\"", "\"fp32\""), /* another fit with the default arithmetic */
    S6_FIT_ARITH("\"norefit\"", "\"fp16\""), /* fp16 with the fit norefit */
    S6_ARITH_FIT("\"fp16\"", "\"norefit\""), /* the same, the other order */
    S6_ARITH("\"fp32\""), /* the default, written out: accepted (the writer leaves it out) */
};

static const struct bad_case cases[] = {
    /* --- syntax and encoding --- */
    { "empty input", "", 0, STEPQ_EPARSE, "empty input" },
    { "whitespace only", " \n\t ", 0, STEPQ_EPARSE, "empty input" },
    { "truncated", DOC(GDN_MODEL U6 "\"layers\": [{\"layer\": 0"), 0, STEPQ_EPARSE,
      "unexpected end of input" },
    { "unclosed array", "[1, 2", 0, STEPQ_EPARSE, "line 1" },
    { "missing colon", "{\"format\" \"x\"}", 0, STEPQ_EPARSE, "line 1, column" },
    { "trailing garbage", U6_DOC " x", 0, STEPQ_EPARSE, "syntax error" },
    { "two documents", U6_DOC U6_DOC, 0, STEPQ_EPARSE, "syntax error" },
    { "NaN literal", "{\"budget_bits\": NaN}", 0, STEPQ_EPARSE, "syntax error" },
    { "invalid UTF-8 byte", "{\"format\": \"\xff\"}", 0, STEPQ_EPARSE,
      "line 1, column 13: invalid UTF-8 (byte 0xff)" },
    { "overlong UTF-8", "{\"format\": \"\xc0\xaf\"}", 0, STEPQ_EPARSE, "invalid UTF-8" },
    { "UTF-8 surrogate", "{\"format\": \"\xed\xa0\x80\"}", 0, STEPQ_EPARSE, "invalid UTF-8" },
    { "UTF-8 beyond U+10FFFF", "{\"format\": \"\xf4\x90\x80\x80\"}", 0, STEPQ_EPARSE,
      "invalid UTF-8" },
    { "truncated UTF-8", "{\"format\": \"\xe2\x82", 0, STEPQ_EPARSE, "truncated UTF-8" },
    { "NUL byte", "{\"a\"\0: 1}", 9, STEPQ_EPARSE, "NUL byte" },
    { "escaped NUL", "{\"format\\u0000x\": 1}", 0, STEPQ_EPARSE, "\\u0000" },
    { "raw tab in string", "{\"form\tat\": 1}", 0, STEPQ_EPARSE, "raw control character 0x09" },
    { "lone surrogate escape", "{\"format\": \"\\ud800\"}", 0, STEPQ_EPARSE, "syntax error" },
    { "error position is on its line", "{\n  \"format\": \"stepq-precision-map\",\n  oops\n}", 0,
      STEPQ_EPARSE, "line 3" },

    /* --- document, format and version --- */
    { "root is an array", "[]", 0, STEPQ_ESCHEMA, "(document): expected an object, got an array" },
    { "format missing", "{\"schema_version\": 1}", 0, STEPQ_ESCHEMA,
      "format: required field is missing" },
    { "format is a number", "{\"format\": 1}", 0, STEPQ_ESCHEMA, "format: expected a string" },
    { "other format", "{\"format\": \"gguf\", \"schema_version\": 1}", 0, STEPQ_EVERSION,
      "format: \"gguf\" is not \"stepq-precision-map\"" },
    { "newer schema version",
      "{\"format\": \"stepq-precision-map\", \"schema_version\": 2, "
      "\"future_field\": 1}",
      0, STEPQ_EVERSION, "schema_version: 2 is not supported" },
    { "schema version as string",
      "{\"format\": \"stepq-precision-map\", \"schema_version\": \"1\"}", 0, STEPQ_ESCHEMA,
      "schema_version: expected a number, got a string" },
    { "schema version fraction", "{\"format\": \"stepq-precision-map\", \"schema_version\": 1.5}",
      0, STEPQ_ESCHEMA, "schema_version: 1.5 is not an integer" },
    { "unknown top-level key", DOC("\"comment\": 1, " GDN_MODEL U6 U6_LAYERS), 0, STEPQ_ESCHEMA,
      "comment: unknown field" },
    { "duplicate key", DOC(GDN_MODEL U6 U6 U6_LAYERS), 0, STEPQ_ESCHEMA, "method: duplicate key" },
    { "duplicate extension key", DOC("\"x-a\": 1, \"x-a\": 2, " GDN_MODEL U6 U6_LAYERS), 0,
      STEPQ_ESCHEMA, "x-a: duplicate key" },
    { "keys are case-sensitive", DOC("\"Model\": {}, " GDN_MODEL U6 U6_LAYERS), 0, STEPQ_ESCHEMA,
      "Model: unknown field" },
    { "model missing", DOC(U6 U6_LAYERS), 0, STEPQ_ESCHEMA, "model: required field is missing" },
    { "method missing", DOC(GDN_MODEL "\"budget_bits\": 6, " U6_LAYERS), 0, STEPQ_ESCHEMA,
      "method: required field is missing" },
    { "unknown method", DOC(GDN_MODEL "\"method\": \"int4\", \"budget_bits\": 4, " U6_LAYERS), 0,
      STEPQ_ESCHEMA, "method: \"int4\" is not one of fp32, bf16" },
    { "budget missing", DOC(GDN_MODEL "\"method\": \"uniform\", " U6_LAYERS), 0, STEPQ_ESCHEMA,
      "budget_bits: required field is missing" },
    { "budget as string",
      DOC(GDN_MODEL "\"method\": \"uniform\", \"budget_bits\": \"6\", " U6_LAYERS), 0,
      STEPQ_ESCHEMA, "budget_bits: expected a number, got a string" },
    { "budget overflows to inf",
      DOC(GDN_MODEL "\"method\": \"stepq\", \"budget_bits\": 1e999, " U6_LAYERS), 0,
      STEPQ_ENONFINITE, "budget_bits: number is not finite" },
    { "uniform budget not a width",
      DOC(GDN_MODEL "\"method\": \"uniform\", \"budget_bits\": 7, " U6_LAYERS), 0, STEPQ_ERANGE,
      "budget_bits: 7 is not one of 2,3,4,5,6,8" },
    { "uniform budget huge (fuzz find: int conversion)",
      DOC(GDN_MODEL "\"method\": \"uniform\", "
                    "\"budget_bits\": "
                    "6888888888888888888888888888888888888888888888888888888888888, " U6_LAYERS),
      0, STEPQ_ERANGE, "budget_bits: 6.88888888888889e+60 is not one of 2,3,4,5,6,8" },
    { "stepq budget above 8",
      DOC(GDN_MODEL "\"method\": \"stepq\", \"budget_bits\": 9, " U6_LAYERS), 0, STEPQ_ERANGE,
      "budget_bits: 9 is out of range [2, 8]" },
    { "dense budget mismatch", DOC(GDN_MODEL "\"method\": \"fp32\", \"budget_bits\": 16"), 0,
      STEPQ_ERANGE, "budget_bits: 16 does not match method fp32 (must be 32)" },
    { "dense map with layers",
      DOC(GDN_MODEL "\"method\": \"bf16\", \"budget_bits\": 16, " U6_LAYERS), 0, STEPQ_ESCHEMA,
      "layers: not allowed for method bf16" },
    { "quantized map without layers", DOC(GDN_MODEL U6 "\"provenance\": {}"), 0, STEPQ_ESCHEMA,
      "layers: required field is missing" },

    /* --- model --- */
    { "model not an object", DOC("\"model\": [], " U6 U6_LAYERS), 0, STEPQ_ESCHEMA,
      "model: expected an object, got an array" },
    { "unknown arch", DOC("\"model\": {\"arch\": \"mamba2\"}, " U6 U6_LAYERS), 0, STEPQ_ESCHEMA,
      "model.arch: \"mamba2\" is not one of gdn, kda" },
    { "no recurrent layers",
      DOC("\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": []}, " U6 U6_LAYERS), 0,
      STEPQ_ESHAPE, "model.recurrent_layers: 0 entries, expected 1..4096" },
    { "layer ids not increasing",
      DOC("\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": [0, 0]}, " U6 U6_LAYERS), 0,
      STEPQ_ERANGE, "model.recurrent_layers[1]: 0 does not follow 0" },
    { "negative layer id",
      DOC("\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": [-1, 2]}, " U6 U6_LAYERS), 0,
      STEPQ_ERANGE, "model.recurrent_layers[0]: -1 is out of range 0..1000000" },
    { "fractional layer id",
      DOC("\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": [0, 2.5]}, " U6 U6_LAYERS), 0,
      STEPQ_ESCHEMA, "model.recurrent_layers[1]: 2.5 is not an integer" },
    { "layer id is null",
      DOC("\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": [null]}, " U6 U6_LAYERS), 0,
      STEPQ_ESCHEMA, "model.recurrent_layers[0]: expected a number, got null" },
    { "HV not a multiple of H",
      DOC("\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": [0, 2], \"num_k_heads\": 2, "
          "\"num_v_heads\": 3, \"head_k_dim\": 4, \"head_v_dim\": 4}, " U6 U6_LAYERS),
      0, STEPQ_ESHAPE, "model.num_v_heads: 3 is not a multiple of num_k_heads 2" },
    { "zero q/k heads",
      DOC("\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": [0, 2], \"num_k_heads\": 0}, " U6
              U6_LAYERS),
      0, STEPQ_ERANGE, "model.num_k_heads: 0 is out of range 1..4096" },
    { "head_k_dim missing",
      DOC("\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": [0, 2], \"num_k_heads\": 1, "
          "\"num_v_heads\": 2, \"head_v_dim\": 4}, " U6 U6_LAYERS),
      0, STEPQ_ESCHEMA, "model.head_k_dim: required field is missing" },
    { "head_v_dim infinite",
      DOC("\"model\": {\"arch\": \"gdn\", \"recurrent_layers\": [0, 2], \"num_k_heads\": 1, "
          "\"num_v_heads\": 2, \"head_k_dim\": 4, \"head_v_dim\": -1e400}, " U6 U6_LAYERS),
      0, STEPQ_ENONFINITE, "model.head_v_dim: number is not finite" },
    { "model name not a string", DOC("\"model\": {\"name\": 5}, " U6 U6_LAYERS), 0, STEPQ_ESCHEMA,
      "model.name: expected a string, got a number" },
    { "unknown model key", DOC("\"model\": {\"arch\": \"gdn\", \"layers\": 4}, " U6 U6_LAYERS), 0,
      STEPQ_ESCHEMA, "model.layers: unknown field" },
    { "conv shape empty",
      DOC(GDN_MODEL_X(", \"conv_state\": {\"shape\": [], \"dtype\": \"bf16\"}") U6 U6_LAYERS), 0,
      STEPQ_ESHAPE, "model.conv_state.shape: 0 entries, expected 1..4" },
    { "conv shape rank 5",
      DOC(GDN_MODEL_X(", \"conv_state\": {\"shape\": [1, 1, 1, 1, 1], "
                      "\"dtype\": \"bf16\"}") U6 U6_LAYERS),
      0, STEPQ_ESHAPE, "model.conv_state.shape: 5 entries" },
    { "conv dim zero",
      DOC(GDN_MODEL_X(", \"conv_state\": {\"shape\": [0, 3], \"dtype\": \"bf16\"}") U6 U6_LAYERS),
      0, STEPQ_ERANGE, "model.conv_state.shape[0]: 0 is out of range" },
    { "conv too large",
      DOC(GDN_MODEL_X(", \"conv_state\": {\"shape\": [2147483647, 2147483647], "
                      "\"dtype\": \"bf16\"}") U6 U6_LAYERS),
      0, STEPQ_ERANGE, "model.conv_state.shape: more than 1099511627776 elements per layer" },
    { "conv dtype unknown",
      DOC(GDN_MODEL_X(", \"conv_state\": {\"shape\": [12, 3], \"dtype\": "
                      "\"int8\"}") U6 U6_LAYERS),
      0, STEPQ_ESCHEMA, "model.conv_state.dtype: \"int8\" is not one of fp32, bf16, fp16" },
    { "conv dtype missing", DOC(GDN_MODEL_X(", \"conv_state\": {\"shape\": [12, 3]}") U6 U6_LAYERS),
      0, STEPQ_ESCHEMA, "model.conv_state.dtype: required field is missing" },

    /* --- layers and units --- */
    { "layers not an array", DOC(GDN_MODEL U6 "\"layers\": {}"), 0, STEPQ_ESCHEMA,
      "layers: expected an array, got an object" },
    { "too few layers", DOC(GDN_MODEL U6 "\"layers\": [" LAY(0, "[]", H(6) ", " H(6)) "]"), 0,
      STEPQ_ESHAPE, "layers: 1 entries, but model.recurrent_layers has 2" },
    { "layer entry not an object",
      DOC(GDN_MODEL U6 "\"layers\": [" LAY(0, "[]", H(6) ", " H(6)) ", 7]"), 0, STEPQ_ESCHEMA,
      "layers[1]: expected an object, got a number" },
    { "layer id mismatch",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", " H(6)), LAY(3, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ESHAPE, "layers[1].layer: 3 does not match model.recurrent_layers[1] = 2" },
    { "layer id missing",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", " H(6)), "{\"heads\": [" H(6) ", " H(6) "]}")),
      0, STEPQ_ESCHEMA, "layers[1].layer: required field is missing" },
    { "heads missing", DOC(GDN_MODEL U6 LAYERS("{\"layer\": 0}", LAY(2, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ESCHEMA, "layers[0].heads: required field is missing" },
    { "too many heads",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", " H(6) ", " H(6)),
                              LAY(2, "[]", H(6) ", " H(6)))),
      0, STEPQ_ESHAPE, "layers[0].heads: 3 entries, but model.num_v_heads is 2" },
    { "head not an object",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", 6"), LAY(2, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ESCHEMA, "layers[0].heads[1]: expected an object, got a number" },
    { "unknown layer key",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", " H(6)),
                              "{\"layer\": 2, \"bits\": 6, \"heads\": [" H(6) ", " H(6) "]}")),
      0, STEPQ_ESCHEMA, "layers[1].bits: unknown field" },
    { "bits 7",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", " H(6)), LAY(2, "[]", H(6) ", " H(7)))), 0,
      STEPQ_ERANGE, "layers[1].heads[1].bits: 7 is not one of 2,3,4,5,6,8" },
    { "bits 1",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(1) ", " H(6)), LAY(2, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ERANGE, "layers[0].heads[0].bits: 1 is not one of 2,3,4,5,6,8" },
    { "bits huge",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(1e300) ", " H(6)), LAY(2, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ERANGE, "layers[0].heads[0].bits: 1e+300 is out of range" },
    { "bits fractional",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6.5) ", " H(6)), LAY(2, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ESCHEMA, "layers[0].heads[0].bits: 6.5 is not an integer" },
    { "bits as string",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", "{\"bits\": \"6\"}, " H(6)),
                              LAY(2, "[]", H(6) ", " H(6)))),
      0, STEPQ_ESCHEMA, "layers[0].heads[0].bits: expected a number, got a string" },
    { "bits missing",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", "{}, " H(6)), LAY(2, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ESCHEMA, "layers[0].heads[0].bits: required field is missing" },
    { "uniform unit off budget",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", " H(4)), LAY(2, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ERANGE, "layers[0].heads[1].bits: 4 differs from budget_bits 6 (method uniform" },
    { "KDA key in a GDN head",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", {\"row_bits\": [6]}"),
                              LAY(2, "[]", H(6) ", " H(6)))),
      0, STEPQ_ESCHEMA, "layers[0].heads[1].row_bits: unknown field" },
    { "duplicate key in a head",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", {\"bits\": 6, \"bits\": 6}"),
                              LAY(2, "[]", H(6) ", " H(6)))),
      0, STEPQ_ESCHEMA, "layers[0].heads[1].bits: duplicate key" },

    /* --- pivots --- */
    { "pivots on a uniform map",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[1]", H(6) ", " H(6)), LAY(2, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ESCHEMA, "layers[0].pivots: method uniform has no pivots" },
    { "fp16 unit on a uniform map",
      DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", " H(16)), LAY(2, "[]", H(6) ", " H(6)))), 0,
      STEPQ_ERANGE, "layers[0].heads[1].bits: 16 (fp16 pivot) is not allowed for method uniform" },
    { "bits 16 without a pivot entry",
      DOC(GDN_MODEL S6 LAYERS(LAY(0, "[1]", HW(4) ", " HW(16)), LAY(2, "[]", HW(16) ", " HW(6)))),
      0, STEPQ_ERANGE,
      "layers[1].heads[0].bits: 16 (fp16 pivot) requires head 0 to be listed in layers[1].pivots" },
    { "pivot with integer bits", DOC(GDN_MODEL S6 S6_LAYERS(HW(4), HW(6), HW(6))), 0, STEPQ_ERANGE,
      "layers[0].heads[1].bits: 6, but head 1 is listed in layers[0].pivots" },
    { "pivot out of range",
      DOC(GDN_MODEL S6 LAYERS(LAY(0, "[2]", HW(4) ", " HW(16)), LAY(2, "[]", HW(6) ", " HW(6)))), 0,
      STEPQ_ERANGE, "layers[0].pivots[0]: 2 is out of range 0..1" },
    { "pivot negative",
      DOC(GDN_MODEL S6 LAYERS(LAY(0, "[-1]", HW(4) ", " HW(16)), LAY(2, "[]", HW(6) ", " HW(6)))),
      0, STEPQ_ERANGE, "layers[0].pivots[0]: -1 is out of range" },
    { "duplicate pivot",
      DOC(GDN_MODEL S6 LAYERS(LAY(0, "[1, 1]", HW(4) ", " HW(16)), LAY(2, "[]", HW(6) ", " HW(6)))),
      0, STEPQ_ESCHEMA, "layers[0].pivots[1]: duplicate pivot (also at pivots[0])" },
    { "pivots not an array",
      DOC(GDN_MODEL S6 LAYERS(LAY(0, "1", HW(4) ", " HW(16)), LAY(2, "[]", HW(6) ", " HW(6)))), 0,
      STEPQ_ESCHEMA, "layers[0].pivots: expected an array" },
    { "over the budget", DOC(GDN_MODEL S6 S6_LAYERS(HW(6), HW(16), HW(6))), 0, STEPQ_ERANGE,
      "layers: non-pivot units use 288 bits, over the budget budget_bits*N - 8*N_piv = 256" },

    /* --- row impact --- */
    { "row impact missing", DOC(GDN_MODEL S6 S6_LAYERS(H(4), HW(16), HW(6))), 0, STEPQ_ESCHEMA,
      "layers[0].heads[0].row_impact: required field is missing (required for method stepq)" },
    { "row impact too short",
      DOC(GDN_MODEL S6 S6_LAYERS(HW(4), HW(16), "{\"bits\": 6, \"row_impact\": [1, 1, 1]}")), 0,
      STEPQ_ESHAPE, "layers[1].heads[0].row_impact: 3 entries, expected 4" },
    { "row impact zero",
      DOC(GDN_MODEL S6 S6_LAYERS(HW(4), HW(16), "{\"bits\": 6, \"row_impact\": [1, 1, 0, 1]}")), 0,
      STEPQ_ERANGE, "layers[1].heads[0].row_impact[2]: 0 is not a positive float" },
    { "row impact beyond float",
      DOC(GDN_MODEL S6 S6_LAYERS(HW(4), HW(16), "{\"bits\": 6, \"row_impact\": [1e39, 1, 1, 1]}")),
      0, STEPQ_ERANGE, "layers[1].heads[0].row_impact[0]: 1e+39 is not a positive float" },
    { "row impact infinite",
      DOC(GDN_MODEL S6 S6_LAYERS(HW(4), HW(16), "{\"bits\": 6, \"row_impact\": [1, 1e400, 1, 1]}")),
      0, STEPQ_ENONFINITE, "layers[1].heads[0].row_impact[1]: number is not finite" },
    { "row impact geometric mean",
      DOC(GDN_MODEL S6 S6_LAYERS(HW(4), HW(16), "{\"bits\": 6, \"row_impact\": [2, 2, 2, 2]}")), 0,
      STEPQ_ERANGE, "layers[1].heads[0].row_impact: geometric mean is 2, must be 1" },
    { "row impact on dsq",
      DOC(GDN_MODEL "\"method\": \"dsq\", \"budget_bits\": 6, " LAYERS(
          LAY(0, "[]", H(6) ", " HW(6)), LAY(2, "[]", H(6) ", " H(6)))),
      0, STEPQ_ESCHEMA, "layers[0].heads[1].row_impact: not allowed for method dsq" },

    /* --- statistics --- */
    { "statistics on one head only",
      DOC(GDN_MODEL D6_STATS LAYERS(LAY(0, "[]", HS(6) ", " H(6)), LAY(2, "[]", HS(6) ", " HS(6)))),
      0, STEPQ_ESCHEMA,
      "layers[0].heads[1].stats: missing, but layers[0].heads[0] has statistics" },
    { "statistics missing before the first",
      DOC(GDN_MODEL D6_STATS LAYERS(LAY(0, "[]", H(6) ", " H(6)), LAY(2, "[]", HS(6) ", " HS(6)))),
      0, STEPQ_ESCHEMA,
      "layers[0].heads[0].stats: missing, but layers[1].heads[0] has statistics" },
    { "positive log retention",
      DOC(GDN_MODEL D6_STATS LAYERS(
          LAY(0, "[]", HS(6) ", " HS(6)),
          LAY(2, "[]",
              HS(6) ", {\"bits\": 6, \"stats\": {\"log_retention\": 0.5, \"lambda\": 2, "
                    "\"distortion\": {\"4\": 0.1}}}"))),
      0, STEPQ_ERANGE, "layers[1].heads[1].stats.log_retention: 0.5 is positive" },
    { "negative lambda",
      DOC(GDN_MODEL D6_STATS LAYERS(
          LAY(0, "[]", HS(6) ", " HS(6)),
          LAY(2, "[]",
              HS(6) ", {\"bits\": 6, \"stats\": {\"log_retention\": -0.1, \"lambda\": -2, "
                    "\"distortion\": {\"4\": 0.1}}}"))),
      0, STEPQ_ERANGE, "layers[1].heads[1].stats.lambda: -2 is negative" },
    { "distortion of width 7",
      DOC(GDN_MODEL D6_STATS LAYERS(
          LAY(0, "[]", HS(6) ", " HS(6)),
          LAY(2, "[]",
              HS(6) ", {\"bits\": 6, \"stats\": {\"log_retention\": -0.1, \"lambda\": 2, "
                    "\"distortion\": {\"4\": 0.1, \"7\": 0.1}}}"))),
      0, STEPQ_ESCHEMA, "layers[1].heads[1].stats.distortion.7: unknown field" },
    { "negative distortion",
      DOC(GDN_MODEL D6_STATS LAYERS(
          LAY(0, "[]", HS(6) ", " HS(6)),
          LAY(2, "[]",
              HS(6) ", {\"bits\": 6, \"stats\": {\"log_retention\": -0.1, \"lambda\": 2, "
                    "\"distortion\": {\"4\": -0.1}}}"))),
      0, STEPQ_ERANGE, "layers[1].heads[1].stats.distortion.4: -0.1 is negative" },
    { "distortion sets differ",
      DOC(GDN_MODEL D6_STATS LAYERS(
          LAY(0, "[]", HS(6) ", " HS(6)),
          LAY(2, "[]",
              HS(6) ", {\"bits\": 6, \"stats\": {\"log_retention\": -0.1, \"lambda\": 2, "
                    "\"distortion\": {\"4\": 0.1, \"8\": 0.01}}}"))),
      0, STEPQ_ESCHEMA,
      "layers[1].heads[1].stats.distortion: measures bits {4,8} but the first unit measures {4}" },
    { "duplicate distortion width",
      DOC(GDN_MODEL D6_STATS LAYERS(
          LAY(0, "[]", HS(6) ", " HS(6)),
          LAY(2, "[]",
              HS(6) ", {\"bits\": 6, \"stats\": {\"log_retention\": -0.1, \"lambda\": 2, "
                    "\"distortion\": {\"4\": 0.1, \"x-a\": 0, \"4\": 0.2}}}"))),
      0, STEPQ_ESCHEMA, "layers[1].heads[1].stats.distortion.4: duplicate key" },
    { "lambda missing",
      DOC(GDN_MODEL D6_STATS LAYERS(
          LAY(0, "[]", HS(6) ", " HS(6)),
          LAY(2, "[]",
              HS(6) ", {\"bits\": 6, \"stats\": {\"log_retention\": -0.1, "
                    "\"distortion\": {\"4\": 0.1}}}"))),
      0, STEPQ_ESCHEMA, "layers[1].heads[1].stats.lambda: required field is missing" },
    { "unknown statistics key",
      DOC(GDN_MODEL D6_STATS LAYERS(
          LAY(0, "[]", HS(6) ", " HS(6)),
          LAY(2, "[]",
              HS(6) ", {\"bits\": 6, \"stats\": {\"log_retention\": -0.1, \"lambda\": 2, "
                    "\"halflife\": 3, \"distortion\": {\"4\": 0.1}}}"))),
      0, STEPQ_ESCHEMA, "layers[1].heads[1].stats.halflife: unknown field" },

    /* --- KDA --- */
    { "KDA row_bits too short",
      DOC(KDA_MODEL KU4 "\"layers\": [" LAY(3, "[]", KR(4, 4) ", {\"row_bits\": [4]}") "]"), 0,
      STEPQ_ESHAPE, "layers[0].heads[1].row_bits: 1 entries, expected 2" },
    { "KDA row width 7",
      DOC(KDA_MODEL KU4 "\"layers\": [" LAY(3, "[]", KR(4, 4) ", " KR(7, 4)) "]"), 0, STEPQ_ERANGE,
      "layers[0].heads[1].row_bits[0]: 7 is not one of 2,3,4,5,6,8" },
    { "GDN key in a KDA head",
      DOC(KDA_MODEL KU4 "\"layers\": [" LAY(3, "[]", KR(4, 4) ", {\"bits\": 4}") "]"), 0,
      STEPQ_ESCHEMA, "layers[0].heads[1].row_bits: required field is missing" },
    { "KDA pivot not a pair", KDA_S6("[1]", KRW(4, 16), KRW(6, 6)), 0, STEPQ_ESCHEMA,
      "layers[0].pivots[0]: expected a [head, row] pair, got a number" },
    { "KDA pivot triple", KDA_S6("[[0, 1, 2]]", KRW(4, 16), KRW(6, 6)), 0, STEPQ_ESCHEMA,
      "layers[0].pivots[0]: 3 entries, expected a [head, row] pair" },
    { "KDA pivot row out of range", KDA_S6("[[0, 2]]", KRW(4, 16), KRW(6, 6)), 0, STEPQ_ERANGE,
      "layers[0].pivots[0][1]: 2 is out of range 0..1" },
    { "KDA duplicate pivot", KDA_S6("[[0, 1], [0, 1]]", KRW(4, 16), KRW(6, 6)), 0, STEPQ_ESCHEMA,
      "layers[0].pivots[1]: duplicate pivot (also at pivots[0])" },
    { "KDA fp16 row not listed", KDA_S6("[[0, 1]]", KRW(4, 16), KRW(16, 4)), 0, STEPQ_ERANGE,
      "layers[0].heads[1].row_bits[0]: 16 (fp16 pivot) requires row [1, 0] to be listed in "
      "layers[0].pivots" },
    { "KDA over the budget", KDA_S6("[[0, 1]]", KRW(6, 16), KRW(6, 6)), 0, STEPQ_ERANGE,
      "layers: non-pivot units use 72 bits, over the budget" },
    { "KDA row impact length",
      KDA_S6("[[0, 1]]", KRW(4, 16),
             "{\"row_bits\": [6, 6], "
             "\"row_impact\": [1]}"),
      0, STEPQ_ESHAPE, "layers[0].heads[1].row_impact: 1 entries, expected 2" },
    { "KDA statistics array length",
      KDA_STATS(KST, "\"stats\": {\"log_retention\": [-0.1, -0.2], "
                     "\"lambda\": [1], \"distortion\": {\"4\": [0.1, 0.2]}}"),
      0, STEPQ_ESHAPE, "layers[0].heads[1].stats.lambda: 1 entries, expected 2" },
    { "KDA distortion array length",
      KDA_STATS(KST, "\"stats\": {\"log_retention\": [-0.1, -0.2], "
                     "\"lambda\": [1, 2], \"distortion\": {\"4\": [0.1, 0.2, 0.3]}}"),
      0, STEPQ_ESHAPE, "layers[0].heads[1].stats.distortion.4: 3 entries, expected 2" },
    { "KDA statistics row value",
      KDA_STATS(KST, "\"stats\": {\"log_retention\": [-0.1, 0.2], "
                     "\"lambda\": [1, 2], \"distortion\": {\"4\": [0.1, 0.2]}}"),
      0, STEPQ_ERANGE, "layers[0].heads[1].stats.log_retention[1]: 0.2 is positive" },
    { "KDA statistics as numbers",
      KDA_STATS(KST, "\"stats\": {\"log_retention\": -0.1, "
                     "\"lambda\": [1, 2], \"distortion\": {\"4\": [0.1, 0.2]}}"),
      0, STEPQ_ESCHEMA, "layers[0].heads[1].stats.log_retention: expected an array, got a number" },

    /* --- provenance --- */
    { "negative token count", DOC(GDN_MODEL U6 "\"provenance\": {\"tokens\": -1}, " U6_LAYERS), 0,
      STEPQ_ERANGE, "provenance.tokens: -1 is out of range" },
    { "fractional token count", DOC(GDN_MODEL U6 "\"provenance\": {\"tokens\": 1.5}, " U6_LAYERS),
      0, STEPQ_ESCHEMA, "provenance.tokens: 1.5 is not an integer" },
    { "zero horizon", DOC(GDN_MODEL U6 "\"provenance\": {\"horizon\": 0}, " U6_LAYERS), 0,
      STEPQ_ERANGE, "provenance.horizon: 0 is out of range" },
    { "pivot fraction above 1",
      DOC(GDN_MODEL U6 "\"provenance\": {\"pivot_fraction\": 2}, " U6_LAYERS), 0, STEPQ_ERANGE,
      "provenance.pivot_fraction: 2 is out of range [0, 1]" },
    { "notes not a string", DOC(GDN_MODEL U6 "\"provenance\": {\"notes\": [\"a\"]}, " U6_LAYERS), 0,
      STEPQ_ESCHEMA, "provenance.notes: expected a string, got an array" },
    { "candidates repeat", DOC(GDN_MODEL U6 "\"provenance\": {\"candidates\": [4, 4]}, " U6_LAYERS),
      0, STEPQ_ERANGE, "provenance.candidates[1]: 4 does not follow 4" },
    { "candidate width 7", DOC(GDN_MODEL U6 "\"provenance\": {\"candidates\": [4, 7]}, " U6_LAYERS),
      0, STEPQ_ERANGE, "provenance.candidates[1]: 7 is not one of 2,3,4,5,6,8" },
    { "no candidates", DOC(GDN_MODEL U6 "\"provenance\": {\"candidates\": []}, " U6_LAYERS), 0,
      STEPQ_ESHAPE, "provenance.candidates: 0 entries, expected 1..6" },
    { "unknown provenance key",
      DOC(GDN_MODEL U6 "\"provenance\": {\"date\": \"today\"}, " U6_LAYERS), 0, STEPQ_ESCHEMA,
      "provenance.date: unknown field" },
    { "provenance not an object", DOC(GDN_MODEL U6 "\"provenance\": \"calibrated\", " U6_LAYERS), 0,
      STEPQ_ESCHEMA, "provenance: expected an object, got a string" },

    /* --- row split --- */
    { "row split 0", S6_SPLIT("0"), 0, STEPQ_ERANGE, "row_split: 0 is out of range (0, 1]" },
    { "row split above 1", S6_SPLIT("1.5"), 0, STEPQ_ERANGE,
      "row_split: 1.5 is out of range (0, 1]" },
    { "row split negative", S6_SPLIT("-0.25"), 0, STEPQ_ERANGE,
      "row_split: -0.25 is out of range (0, 1]" },
    { "row split as a string", S6_SPLIT("\"nan\""), 0, STEPQ_ESCHEMA,
      "row_split: expected a number, got a string" },
    { "row split null", S6_SPLIT("null"), 0, STEPQ_ESCHEMA,
      "row_split: expected a number, got null" },
    { "row split overflows", S6_SPLIT("1e999"), 0, STEPQ_ENONFINITE,
      "row_split: number is not finite" },
    { "row split twice", DOC(GDN_MODEL S6 RS("0.75") RS("0.75") S6_LAYERS(HW(4), HW(16), HW(6))), 0,
      STEPQ_ESCHEMA, "row_split: duplicate key" },
    { "row split on temporal",
      DOC(GDN_MODEL "\"method\": \"temporal\", \"budget_bits\": 6, " RS("0.75") U6_LAYERS), 0,
      STEPQ_ESCHEMA, "row_split: not allowed for method temporal" },
    { "row split 0.5 on uniform", DOC(GDN_MODEL U6 RS("0.5") U6_LAYERS), 0, STEPQ_ESCHEMA,
      "row_split: not allowed for method uniform" },
    { "row split on fp32",
      DOC(GDN_MODEL "\"method\": \"fp32\", \"budget_bits\": 32, " RS("0.75") "\"provenance\": {}"),
      0, STEPQ_ESCHEMA, "row_split: not allowed for method fp32" },

    /* --- decode fit --- */
    { "decode fit unknown", S6_FIT("\"fast\""), 0, STEPQ_ESCHEMA,
      "decode_fit: \"fast\" is not one of exact, norefit, rows" },
    { "decode fit rows upper case", S6_FIT("\"ROWS\""), 0, STEPQ_ESCHEMA,
      "decode_fit: \"ROWS\" is not one of exact, norefit, rows" },
    { "decode fit rows on uniform", DOC(GDN_MODEL U6 DF("\"rows\"") U6_LAYERS), 0, STEPQ_ESCHEMA,
      "decode_fit: not allowed for method uniform" },
    { "decode fit upper case", S6_FIT("\"NOREFIT\""), 0, STEPQ_ESCHEMA,
      "decode_fit: \"NOREFIT\" is not one of exact, norefit, rows" },
    { "decode fit empty", S6_FIT("\"\""), 0, STEPQ_ESCHEMA,
      "decode_fit: \"\" is not one of exact, norefit, rows" },
    { "decode fit as a number", S6_FIT("1"), 0, STEPQ_ESCHEMA,
      "decode_fit: expected a string, got a number" },
    { "decode fit as a bool", S6_FIT("true"), 0, STEPQ_ESCHEMA,
      "decode_fit: expected a string, got a bool" },
    { "decode fit null", S6_FIT("null"), 0, STEPQ_ESCHEMA,
      "decode_fit: expected a string, got null" },
    { "decode fit twice",
      DOC(GDN_MODEL S6 DF("\"norefit\"") DF("\"norefit\"") S6_LAYERS(HW(4), HW(16), HW(6))), 0,
      STEPQ_ESCHEMA, "decode_fit: duplicate key" },
    { "decode fit on temporal",
      DOC(GDN_MODEL "\"method\": \"temporal\", \"budget_bits\": 6, " DF("\"norefit\"") U6_LAYERS),
      0, STEPQ_ESCHEMA, "decode_fit: not allowed for method temporal" },
    { "decode fit exact on uniform", DOC(GDN_MODEL U6 DF("\"exact\"") U6_LAYERS), 0, STEPQ_ESCHEMA,
      "decode_fit: not allowed for method uniform" },
    { "decode fit on fp8",
      DOC(GDN_MODEL
          "\"method\": \"fp8\", \"budget_bits\": 8, " DF("\"norefit\"") "\"provenance\": {}"),
      0, STEPQ_ESCHEMA, "decode_fit: not allowed for method fp8" },

    /* --- decode arithmetic --- */
    { "arith unknown", S6_ARITH("\"fast\""), 0, STEPQ_ESCHEMA,
      "arith: \"fast\" is not one of fp32, fp16" },
    { "arith upper case", S6_ARITH("\"FP16\""), 0, STEPQ_ESCHEMA,
      "arith: \"FP16\" is not one of fp32, fp16" },
    { "arith bf16", S6_ARITH("\"bf16\""), 0, STEPQ_ESCHEMA,
      "arith: \"bf16\" is not one of fp32, fp16" },
    { "arith empty", S6_ARITH("\"\""), 0, STEPQ_ESCHEMA, "arith: \"\" is not one of fp32, fp16" },
    { "arith as a number", S6_ARITH("16"), 0, STEPQ_ESCHEMA,
      "arith: expected a string, got a number" },
    { "arith as a bool", S6_ARITH("true"), 0, STEPQ_ESCHEMA,
      "arith: expected a string, got a bool" },
    { "arith null", S6_ARITH("null"), 0, STEPQ_ESCHEMA, "arith: expected a string, got null" },
    { "arith as an array", S6_ARITH("[\"fp16\"]"), 0, STEPQ_ESCHEMA,
      "arith: expected a string, got an array" },
    { "arith twice",
      DOC(GDN_MODEL S6 AR("\"fp16\"") AR("\"fp16\"") S6_LAYERS(HW(4), HW(16), HW(6))), 0,
      STEPQ_ESCHEMA, "arith: duplicate key" },
    { "arith on temporal",
      DOC(GDN_MODEL "\"method\": \"temporal\", \"budget_bits\": 6, " AR("\"fp16\"") U6_LAYERS), 0,
      STEPQ_ESCHEMA, "arith: not allowed for method temporal" },
    { "arith fp32 on uniform", DOC(GDN_MODEL U6 AR("\"fp32\"") U6_LAYERS), 0, STEPQ_ESCHEMA,
      "arith: not allowed for method uniform" },
    { "arith fp16 on uniform", DOC(GDN_MODEL U6 AR("\"fp16\"") U6_LAYERS), 0, STEPQ_ESCHEMA,
      "arith: not allowed for method uniform" },
    { "arith on fp8",
      DOC(GDN_MODEL
          "\"method\": \"fp8\", \"budget_bits\": 8, " AR("\"fp16\"") "\"provenance\": {}"),
      0, STEPQ_ESCHEMA, "arith: not allowed for method fp8" },
    { "arith on fp32",
      DOC(GDN_MODEL
          "\"method\": \"fp32\", \"budget_bits\": 32, " AR("\"fp32\"") "\"provenance\": {}"),
      0, STEPQ_ESCHEMA, "arith: not allowed for method fp32" },
    { "arith fp16 with decode fit rows", S6_FIT_ARITH("\"rows\"", "\"fp16\""), 0, STEPQ_ESCHEMA,
      "arith: fp16 needs decode_fit exact or norefit, not rows" },
    { "arith fp16 before decode fit rows", S6_ARITH_FIT("\"fp16\"", "\"rows\""), 0, STEPQ_ESCHEMA,
      "arith: fp16 needs decode_fit exact or norefit, not rows" },
    { "arith fp16 with decode fit rows on KDA dsq",
      DOC(KDA_MODEL "\"method\": \"dsq\", \"budget_bits\": 4, " DF("\"rows\"")
              AR("\"fp16\"") "\"layers\": [" LAY(3, "[]", KR(4, 4) ", " KR(4, 4)) "]"),
      0, STEPQ_ESCHEMA, "arith: fp16 needs decode_fit exact or norefit, not rows" },
};

static void every_base_document_loads(void **state)
{
    for (size_t i = 0; i < sizeof(good_docs) / sizeof(good_docs[0]); i++) {
        stepq_map_t *m = NULL;
        int st = stepq_map_load_buffer(good_docs[i], strlen(good_docs[i]), NULL, &m);
        if (st < 0)
            print_error("base document %zu: %s\n%s\n", i, stepq_last_error(), good_docs[i]);
        assert_int_equal(st, STEPQ_OK);
        assert_int_equal(stepq_map_validate(m), STEPQ_OK);
        stepq_map_close(m);
    }
}

static void every_malformed_map_fails_with_its_status_and_path(void **state)
{
    int failed = 0;

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct bad_case *c = &cases[i];
        size_t len = c->len ? c->len : strlen(c->doc);
        stepq_map_t *m = (stepq_map_t *)&failed; /* must come back NULL */
        int st = stepq_map_load_buffer(c->doc, len, NULL, &m);
        const char *msg = stepq_last_error();
        if (st != c->status || !strstr(msg, c->msg) || m != NULL) {
            print_error("case \"%s\": got %s \"%s\", want %s containing \"%s\"\n", c->name,
                        stepq_status_name(st), msg, stepq_status_name(c->status), c->msg);
            failed++;
            if (st == STEPQ_OK && m != (stepq_map_t *)&failed)
                stepq_map_close(m);
        }
    }
    print_message("%zu malformed maps checked\n", sizeof(cases) / sizeof(cases[0]));
    assert_int_equal(failed, 0);
}

/* The exact message from the issue, on a full-size map edited with cJSON. */
static void bits_error_names_layer_and_head_exactly(void **state)
{
    stepq_model_shape s = fx_shape_qwen27();
    stepq_map_t *m = NULL;
    char *text;
    size_t len;

    assert_int_equal(stepq_map_create(&s, STEPQ_METHOD_UNIFORM, 6, &m), STEPQ_OK);
    assert_int_equal(stepq_map_write_buffer(m, &text, &len), STEPQ_OK);
    stepq_map_close(m);
    cJSON *doc = cJSON_Parse(text);
    stepq_free(text);
    assert_non_null(doc);
    cJSON *head = cJSON_GetArrayItem(
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(doc, "layers"), 3), "heads"), 7);
    cJSON_SetNumberValue(cJSON_GetObjectItem(head, "bits"), 7);
    char *edited = cJSON_PrintUnformatted(doc);
    cJSON_Delete(doc);

    m = NULL;
    assert_int_equal(stepq_map_load_buffer(edited, strlen(edited), NULL, &m), STEPQ_ERANGE);
    assert_null(m);
    assert_string_equal(stepq_last_error(), "layers[3].heads[7].bits: 7 is not one of 2,3,4,5,6,8");
    cJSON_free(edited);
}

/* After a syntax error, cJSON's global error pointer points into no freed stepq buffer. */
static void a_syntax_error_leaves_no_dangling_cjson_error_pointer(void **state)
{
    static const char bad[] = "{\"format\": \"stepq-precision-map\", oops}";
    stepq_map_t *m = NULL;

    assert_int_equal(stepq_map_load_buffer(bad, sizeof(bad) - 1, NULL, &m), STEPQ_EPARSE);
    assert_null(cJSON_GetErrorPtr());
}

static void size_limit_and_config_header_are_enforced(void **state)
{
    stepq_map_load_config cfg = STEPQ_MAP_LOAD_CONFIG_INITIALIZER;
    const char *doc = U6_DOC;
    stepq_map_t *m = NULL;

    cfg.max_bytes = strlen(doc) - 1;
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), &cfg, &m), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "over the limit"));
    cfg.max_bytes = strlen(doc);
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), &cfg, &m), STEPQ_OK);
    stepq_map_close(m);

    cfg.magic = 0;
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), &cfg, &m), STEPQ_EVERSION);
    cfg.magic = STEPQ_CONFIG_MAGIC;
    cfg.version = 99;
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), &cfg, &m), STEPQ_EVERSION);
    cfg.version = STEPQ_MAP_LOAD_CONFIG_VERSION;
    cfg.size = 4;
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), &cfg, &m), STEPQ_EVERSION);
    assert_null(m);

    assert_int_equal(stepq_map_load_buffer(NULL, 5, NULL, &m), STEPQ_EINVAL);
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), NULL, NULL), STEPQ_EINVAL);

    /* not NUL-terminated: only len bytes are read */
    char buf[1024];
    size_t n = strlen(doc);
    memcpy(buf, doc, n);
    memset(buf + n, '}', sizeof(buf) - n);
    assert_int_equal(stepq_map_load_buffer(buf, n, NULL, &m), STEPQ_OK);
    stepq_map_close(m);
    /* a UTF-8 byte-order mark is tolerated */
    buf[0] = (char)0xEF, buf[1] = (char)0xBB, buf[2] = (char)0xBF;
    memcpy(buf + 3, doc, n);
    assert_int_equal(stepq_map_load_buffer(buf, n + 3, NULL, &m), STEPQ_OK);
    stepq_map_close(m);
}

/* A document with an "x-pad" array of n zeros spliced in after its opening brace. */
static char *with_pad(const char *doc, size_t n)
{
    size_t len = strlen(doc);
    char *out = malloc(len + 16 + 2 * n);
    size_t o = 0;
    assert_non_null(out);
    assert_int_equal(doc[0], '{');
    o += (size_t)sprintf(out, "{\"x-pad\": [");
    for (size_t i = 0; i < n; i++) {
        out[o++] = '0';
        out[o++] = ',';
    }
    if (n)
        o--;
    o += (size_t)sprintf(out + o, "], ");
    memcpy(out + o, doc + 1, len); /* the rest, with its NUL */
    return out;
}

/* The values are counted before parsing (the parse tree costs ~80 B a value), so the memory
 * of a load is bounded by max_values whatever the file holds; the default passes every real
 * map and an old (version 1) config struct gets it too. */
static void the_value_count_bounds_a_load(void **state)
{
    stepq_map_load_config cfg = STEPQ_MAP_LOAD_CONFIG_INITIALIZER;
    stepq_map_t *m = NULL;
    char *doc = with_pad(U6_DOC, 2000);

    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), NULL, &m), STEPQ_OK);
    stepq_map_close(m);
    cfg.max_values = 2000;
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), &cfg, &m), STEPQ_ERANGE);
    assert_null(m);
    assert_non_null(strstr(stepq_last_error(), "more than 2000 JSON values (max_values"));
    free(doc);

    /* 4.2 M zeros (8.4 MB) are over the default: refused at once, before any tree exists;
     * they would have taken ~340 MB of parse tree. */
    doc = with_pad(U6_DOC, 4200000);
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), NULL, &m), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "more than 4194304 JSON values"));
    /* A version-1 caller (no max_values field) gets the default. */
    stepq_map_load_config v1 = STEPQ_MAP_LOAD_CONFIG_INITIALIZER;
    v1.size = offsetof(stepq_map_load_config, max_values);
    v1.version = 1;
    v1.max_values = 1; /* beyond its size: must not be read */
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), &v1, &m), STEPQ_ERANGE);
    assert_non_null(strstr(stepq_last_error(), "more than 4194304 JSON values"));
    free(doc);
    doc = with_pad(U6_DOC, 10);
    assert_int_equal(stepq_map_load_buffer(doc, strlen(doc), &v1, &m), STEPQ_OK);
    stepq_map_close(m);
    free(doc);
}

static void file_errors_name_the_file_and_content_errors_the_path(void **state)
{
    char dir[] = "/tmp/stepq-test-errors-XXXXXX";
    char path[256];
    stepq_map_t *m = NULL;

    assert_non_null(mkdtemp(dir));
    assert_int_equal(stepq_map_load_file("/nonexistent/stepq/map.json", NULL, &m), STEPQ_EIO);
    assert_non_null(strstr(stepq_last_error(), "/nonexistent/stepq/map.json: No such file"));
    assert_int_equal(stepq_map_load_file(dir, NULL, &m), STEPQ_EIO);
    assert_non_null(strstr(stepq_last_error(), "is a directory"));
    assert_int_equal(stepq_map_load_file(NULL, NULL, &m), STEPQ_EINVAL);

    snprintf(path, sizeof(path), "%s/bad.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(DOC(GDN_MODEL U6 LAYERS(LAY(0, "[]", H(6) ", " H(6)), LAY(2, "[]", H(6) ", " H(9)))), f);
    fclose(f);
    assert_int_equal(stepq_map_load_file(path, NULL, &m), STEPQ_ERANGE);
    assert_string_equal(stepq_last_error(), "layers[1].heads[1].bits: 9 is not one of 2,3,4,5,6,8");

    stepq_map_load_config cfg = STEPQ_MAP_LOAD_CONFIG_INITIALIZER;
    cfg.max_bytes = 100;
    assert_int_equal(stepq_map_load_file(path, &cfg, &m), STEPQ_ERANGE);
    assert_null(m);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(rmdir(dir), 0);
}

/* Writes the table as fuzz seeds: ok-base-N.json and bad-NNN-<case>.json. */
static int write_corpus(const char *dir)
{
    char path[1024];
    for (size_t i = 0;
         i < sizeof(good_docs) / sizeof(good_docs[0]) + sizeof(cases) / sizeof(cases[0]); i++) {
        const size_t n_good = sizeof(good_docs) / sizeof(good_docs[0]);
        const char *doc;
        size_t len;
        if (i < n_good) {
            snprintf(path, sizeof(path), "%s/ok-base-%02zu.json", dir, i);
            doc = good_docs[i];
            len = strlen(doc);
        } else {
            const struct bad_case *c = &cases[i - n_good];
            char slug[64];
            size_t k;
            for (k = 0; c->name[k] && k + 1 < sizeof(slug); k++)
                slug[k] = (c->name[k] >= 'a' && c->name[k] <= 'z') ||
                                  (c->name[k] >= 'A' && c->name[k] <= 'Z') ||
                                  (c->name[k] >= '0' && c->name[k] <= '9')
                              ? c->name[k]
                              : '-';
            slug[k] = '\0';
            snprintf(path, sizeof(path), "%s/bad-%03zu-%s.json", dir, i - n_good, slug);
            doc = c->doc;
            len = c->len ? c->len : strlen(doc);
        }
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(doc, 1, len, f) != len || fclose(f)) {
            fprintf(stderr, "%s: cannot write\n", path);
            return 1;
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_base_document_loads),
        cmocka_unit_test(the_value_count_bounds_a_load),
        cmocka_unit_test(every_malformed_map_fails_with_its_status_and_path),
        cmocka_unit_test(bits_error_names_layer_and_head_exactly),
        cmocka_unit_test(size_limit_and_config_header_are_enforced),
        cmocka_unit_test(a_syntax_error_leaves_no_dangling_cjson_error_pointer),
        cmocka_unit_test(file_errors_name_the_file_and_content_errors_the_path),
    };
    if (argc == 3 && !strcmp(argv[1], "--write-corpus"))
        return write_corpus(argv[2]);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
