#!/usr/bin/env python3
"""stepq synth / calibrate / eval end to end on small synthetic traces:
determinism (byte-identical maps for 1 and 2 threads), the budget rule,
half-lives recovered from the gates, stepq beating uniform on the readout,
eval's fp32 row exactly zero, Spearman and the injection ratio in range, and
clean errors on a truncated trace and on one holding NaN or Inf. Usage: check_tools.py STEPQ_EXE"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile


def run(args, ok=True):
    p = subprocess.run(args, capture_output=True, text=True)
    if ok and p.returncode != 0:
        raise SystemExit("FAIL: %s\n%s%s" % (" ".join(args), p.stdout, p.stderr))
    return p


def poke(src, dst, tensor, index, value):
    """Copies a trace with one element of a tensor (index: a tuple into its shape) set to value."""
    blob = bytearray(open(src, "rb").read())
    n = struct.unpack("<Q", blob[:8])[0]
    t = json.loads(blob[8:8 + n])[tensor]
    flat = 0
    for i, d in zip(index, t["shape"]):
        flat = flat * d + i
    es = {"F32": 4, "BF16": 2, "F16": 2}[t["dtype"]]
    at = 8 + n + t["data_offsets"][0] + flat * es
    enc = {"F32": struct.pack("<f", value), "BF16": struct.pack("<f", value)[2:],
           "F16": struct.pack("<e", value)}[t["dtype"]]
    blob[at:at + es] = enc
    open(dst, "wb").write(bytes(blob))


def main():
    exe = sys.argv[1]
    d = tempfile.mkdtemp(prefix="stepq-calib-")
    tr = os.path.join(d, "t")
    run([exe, "synth", "--out", tr, "--layers", "2", "--H", "2", "--HV", "4", "--K", "32", "--V", "32",
         "--streams", "3", "--T", "256", "--streams-per-file", "2", "--halflife-min", "2",
         "--halflife-max", "2000", "--seed", "7"])
    traces = [tr + "-000.safetensors", tr + "-001.safetensors"]
    maps = {}
    for m, b in [("fp32", 4), ("uniform", 4), ("dsq", 4), ("spatial", 4), ("temporal", 4), ("stepq", 4),
                 ("stepq", 6), ("fp8", 4)]:
        out = os.path.join(d, "%s@%d.json" % (m, b))
        rep = os.path.join(d, "%s@%d.rep.json" % (m, b))
        run([exe, "calibrate", "--trace"] + traces + ["--method", m, "--budget", str(b), "--out", out,
                                                      "--report", rep, "--threads", "2", "--samples", "4",
                                                      "--prop-steps", "64", "--pivot-fraction", "0.07"])
        maps["%s@%d" % (m, b)] = out
    # Determinism: one thread gives the same bytes.
    one = os.path.join(d, "one.json")
    run([exe, "calibrate", "--trace"] + traces + ["--method", "stepq", "--budget", "4", "--out", one,
                                                  "--threads", "1", "--samples", "4", "--prop-steps", "64",
                                                  "--pivot-fraction", "0.07"])
    assert open(one, "rb").read() == open(maps["stepq@4"], "rb").read(), "calibrate is not deterministic"
    # Budget rule and pivots.
    for key in ("stepq@4", "stepq@6", "temporal@4"):
        m = json.load(open(maps[key]))
        bits = [h["bits"] for L in m["layers"] for h in L["heads"]]
        piv = sum(1 for b in bits if b == 16)
        assert piv == round(0.07 * len(bits)) == 1, (key, piv)
        assert sum(b for b in bits if b != 16) <= m["budget_bits"] * len(bits) - 8 * piv, key
        assert m["provenance"]["tool"] == "stepq calibrate" and "stats" in m["layers"][0]["heads"][0]
    m = json.load(open(maps["uniform@4"]))
    assert all(h["bits"] == 4 for L in m["layers"] for h in L["heads"])
    # fp8 has one format: no layers, budget_bits 8 whatever --budget said, as for fp32.
    m = json.load(open(maps["fp8@4"]))
    assert m["method"] == "fp8" and m["budget_bits"] == 8 and "layers" not in m, m
    # Half-lives: synth spreads them log-uniformly over [2, 2000]; the gates' mean recovers them.
    rep = json.load(open(os.path.join(d, "stepq@4.rep.json")))
    hl = sorted(u["half_life"] for u in rep["units"])
    assert abs(math.log(hl[0] / 2.0)) < 0.15 and abs(math.log(hl[-1] / 2000.0)) < 0.15, hl
    # Eval.
    ej = os.path.join(d, "eval.json")
    order = ["fp32@4", "uniform@4", "dsq@4", "spatial@4", "temporal@4", "stepq@4", "stepq@6", "fp8@4"]
    p = run([exe, "eval", "--map"] + [maps[k] for k in order] + ["--trace"] + traces +
            ["--json", ej, "--threads", "2"])
    e = json.load(open(ej))
    r = {x["name"]: x for x in e["methods"]}
    assert r["fp32@4"]["readout_rel"]["mean"] == 0.0  # names are the map files' names
    # Gains (<o^, o> / |o|^2, <Q(S), S> / |S|^2): exactly 1 for fp32; rint with a row absmax
    # scale is nearly unbiased, while the least-squares column refit of the dual-axis fits
    # shrinks what it stores (regression of x on noisy codes), on these traces by ~0.4-0.6%.
    g = {k: (r[k]["readout_gain"]["mean"], r[k]["store_gain"]["mean"]) for k in order}
    assert g["fp32@4"] == (1.0, 1.0), g
    assert abs(g["uniform@4"][1] - 1.0) < 1e-3 and abs(g["temporal@4"][1] - 1.0) < 1e-3, g
    assert all(g[k][1] < g["uniform@4"][1] - 2e-3 for k in ("dsq@4", "spatial@4", "stepq@4")), g
    # The decode fits: eval stores as the pool's decode step does, so a map with decode_fit norefit
    # or rows is evaluated with that fit. Without the least-squares refit (norefit) rint on the
    # small codes of the dual-axis split amplifies what it stores (store gain > 1: a value in
    # (0.5, 1) steps rounds up to 1, one in (0, 0.5) down to 0, and the energy-weighted mean is
    # above 1), which the recurrence compounds; the exact fit's refit shrinks instead (< 1).
    fits = {}
    for f in ("norefit", "rows"):
        m = json.load(open(maps["stepq@4"]))
        m["decode_fit"] = f
        fits[f] = os.path.join(d, "stepq-%s@4.json" % f)
        json.dump(m, open(fits[f], "w"))
    ejf = os.path.join(d, "eval-fits.json")
    run([exe, "eval", "--map", maps["stepq@4"], fits["norefit"], fits["rows"], "--trace"] + traces +
        ["--json", ejf, "--threads", "2"])
    rf = {x["name"]: x for x in json.load(open(ejf))["methods"]}
    ex, nr, ro = rf["stepq@4"], rf["stepq-norefit@4"], rf["stepq-rows@4"]
    assert ex["readout_rel"] == r["stepq@4"]["readout_rel"], (ex["readout_rel"], r["stepq@4"]["readout_rel"])
    assert nr["store_gain"]["mean"] > 1.0 > ex["store_gain"]["mean"], (nr["store_gain"], ex["store_gain"])
    assert len({ex["readout_rel"]["mean"], nr["readout_rel"]["mean"], ro["readout_rel"]["mean"]}) == 3
    # arith fp16: eval steps a map's GDN integer heads with the fp16 decode step (kernels/step_f16.c),
    # as the map's pool does, so its readout error differs from the fp32 map's, by a few percent on
    # these traces; the pivot heads and everything else are the same maps.
    f16 = {}
    for b in (4, 6):
        m = json.load(open(maps["stepq@%d" % b]))
        m["arith"] = "fp16"
        f16[b] = os.path.join(d, "stepq-fp16@%d.json" % b)
        json.dump(m, open(f16[b], "w"))
    ej16 = os.path.join(d, "eval-fp16.json")
    run([exe, "eval", "--map", maps["stepq@4"], f16[4], maps["stepq@6"], f16[6], "--trace"] + traces +
        ["--json", ej16, "--threads", "2"])
    r16 = {x["name"]: x["readout_rel"]["mean"] for x in json.load(open(ej16))["methods"]}
    for b in (4, 6):
        a, h = r16["stepq@%d" % b], r16["stepq-fp16@%d" % b]
        assert a == r["stepq@%d" % b]["readout_rel"]["mean"] and h != a and abs(h / a - 1) < 0.1, (b, a, h)
    print("arith fp16 on the synthetic traces: readout error stepq@4 %.5g -> %.5g, stepq@6 %.5g -> %.5g"
          % (r16["stepq@4"], r16["stepq-fp16@4"], r16["stepq@6"], r16["stepq-fp16@6"]))
    # The fit rows' fallback rate: counted where the map's fit is rows, null for the others; at
    # least every stream's first store falls back (a fresh zero page has no column scales), and
    # the rest is the growth trigger's decision, neither never nor always on these traces.
    assert ex["rows_fallback"] is None and nr["rows_fallback"] is None, (ex["rows_fallback"], nr["rows_fallback"])
    fb = ro["rows_fallback"]
    assert fb is not None and 1.0 / e["tokens"] <= fb < 1.0, (fb, e["tokens"])
    print("decode fits, stepq@4 on the synthetic traces: readout error exact %.4g, norefit %.4g, rows %.4g; "
          "store gain %.5f, %.5f, %.5f; rows fell back in %.1f%% of the stores"
          % (ex["readout_rel"]["mean"], nr["readout_rel"]["mean"], ro["readout_rel"]["mean"],
             ex["store_gain"]["mean"], nr["store_gain"]["mean"], ro["store_gain"]["mean"], 100 * fb))
    assert r["stepq@4"]["readout_rel_head"]["mean"] < r["uniform@4"]["readout_rel_head"]["mean"], p.stdout
    assert r["stepq@6"]["readout_rel_head"]["mean"] < r["stepq@4"]["readout_rel_head"]["mean"], p.stdout
    # fp8 (e4m3: 3 mantissa bits, ~2^-5 relative per value) sits between the 4-bit maps and exact.
    assert 0 < r["fp8@4"]["readout_rel_head"]["mean"] < r["uniform@4"]["readout_rel_head"]["mean"], p.stdout
    # Long-lived heads accumulate more error under uniform@6 (the paper's premise) on these traces.
    assert e["spearman_uniform6_halflife"]["pooled"] > 0.5, e["spearman_uniform6_halflife"]
    assert e["injection"]["int6_ratio"] > 1.0, e["injection"]
    assert e["streams"] == 3
    # The per-layer / per-head breakdown of that JSON (tools/scripts/eval_breakdown.py).
    bd = run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools",
                                           "scripts", "eval_breakdown.py"), ej, "--maps", "uniform@4,stepq@4",
              "--pair", "uniform@4,stepq@4", "--top", "2"])
    lines = bd.stdout.splitlines()
    assert sum(1 for x in lines if x.startswith("| 0 |") or x.startswith("| 1 |")) >= 2, bd.stdout
    heads_lost = [x for x in lines if x.startswith("uniform@4 has the larger readout error in")]
    assert heads_lost and " of %d heads" % len(e["heads"]) in heads_lost[0], bd.stdout
    bad = run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools",
                                            "scripts", "eval_breakdown.py"), ej, "--pair", "nope,stepq@4"], ok=False)
    assert bad.returncode != 0 and "no map named nope" in bad.stderr, bad.stderr
    # An injection at the last step has no error to measure: valid JSON, null and a reason.
    ej2 = os.path.join(d, "eval-last.json")
    run([exe, "eval", "--map", maps["stepq@4"], "--trace"] + traces +
        ["--json", ej2, "--threads", "2", "--inject-step", "255"])
    e2 = json.load(open(ej2))
    assert e2["injection"]["int6_ratio"] is None and "note" in e2["injection"], e2["injection"]
    # KDA: per-row widths within the budget, rows of one head may differ; eval runs.
    kt = os.path.join(d, "k")
    run([exe, "synth", "--arch", "kda", "--out", kt, "--layers", "2", "--H", "2", "--HV", "2", "--K", "16",
         "--V", "16", "--streams", "2", "--T", "96"])
    km = os.path.join(d, "kda.json")
    run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", "stepq", "--budget", "4", "--out", km,
         "--pivot-fraction", "0.02"])
    m = json.load(open(km))
    rows = [b for L in m["layers"] for h in L["heads"] for b in h["row_bits"]]
    piv = sum(1 for b in rows if b == 16)
    assert piv == round(0.02 * len(rows)) and sum(b for b in rows if b != 16) <= 4 * len(rows) - 8 * piv
    assert len(set(rows)) > 1
    # --row-split: the map records the split its distortions were measured with (other
    # widths' costs, so other stats), eval and inspect show it; 0.5 is the default, written
    # nowhere (the same bytes as without the option); a method without column scales refuses it.
    kr = os.path.join(d, "kda-rs.json")
    p = run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", "stepq", "--budget", "4",
             "--out", kr, "--pivot-fraction", "0.02", "--row-split", "0.75", "--json"])
    assert json.loads(p.stdout)["row_split"] == 0.75, p.stdout
    mr = json.load(open(kr))
    assert mr["row_split"] == 0.75 and "row_split=0.75" in mr["provenance"]["method_detail"], mr["provenance"]
    assert mr["layers"][0]["heads"][0]["stats"] != m["layers"][0]["heads"][0]["stats"]
    assert "row_split" not in m
    k5 = os.path.join(d, "kda-05.json")
    run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", "stepq", "--budget", "4", "--out", k5,
         "--pivot-fraction", "0.02", "--row-split", "0.5"])
    assert open(k5, "rb").read() == open(km, "rb").read(), "--row-split 0.5 is not the default"
    p = run([exe, "inspect", kr])
    assert "row split      0.75" in p.stdout, p.stdout
    assert json.loads(run([exe, "inspect", kr, "--json"]).stdout)["row_split"] == 0.75
    assert "row split" not in run([exe, "inspect", km]).stdout
    assert "row_split" not in json.loads(run([exe, "inspect", km, "--json"]).stdout)
    er = os.path.join(d, "eval-rs.json")
    run([exe, "eval", "--map", kr, km, "--trace", kt + "-000.safetensors", "--json", er])
    e3 = json.load(open(er))
    assert e3["row_split_override"] is None, e3["row_split_override"]
    assert [x["row_split"] for x in e3["methods"]] == [0.75, 0.5, None], e3["methods"]
    p = run([exe, "eval", "--map", kr, km, "--trace", kt + "-000.safetensors", "--json", er, "--row-split", "0.6"])
    e3 = json.load(open(er))
    assert e3["row_split_override"] == 0.6 and [x["row_split"] for x in e3["methods"]][:2] == [0.6, 0.6]
    assert "--row-split 0.6: the dual-axis fits use it in place of each map's row_split" in p.stderr, p.stderr
    for meth, split, want in (("temporal", "0.75", "method temporal has no column scales"),
                              ("stepq", "1.5", "--row-split '1.5': want a number in (0, 1]")):
        p = run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", meth, "--budget", "4",
                 "--out", os.path.join(d, "no.json"), "--row-split", split], ok=False)
        assert p.returncode == 2 and want in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
        assert not os.path.exists(os.path.join(d, "no.json"))
    # --decode-fit: recorded in the map (and its provenance), the distortions still measured with
    # the exact fit (the same statistics); exact is the default, written nowhere; inspect shows
    # norefit; a method without column scales refuses it, and so does another name.
    assert "decode_fit" not in m
    for fit, name, shown in (("norefit", "kda-nr.json", "decode fit     norefit"),
                             ("rows", "kda-rows.json",
                              "decode fit     rows (decode steps keep the page's column scales")):
        kf = os.path.join(d, name)
        p = run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", "stepq", "--budget", "4",
                 "--out", kf, "--pivot-fraction", "0.02", "--decode-fit", fit, "--json"])
        assert json.loads(p.stdout)["decode_fit"] == fit, p.stdout
        mf = json.load(open(kf))
        assert mf["decode_fit"] == fit and "decode_fit=" + fit in mf["provenance"]["method_detail"]
        assert mf["layers"] == m["layers"]
        assert shown in run([exe, "inspect", kf]).stdout
        assert json.loads(run([exe, "inspect", kf, "--json"]).stdout)["decode_fit"] == fit
    ke = os.path.join(d, "kda-exact.json")
    run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", "stepq", "--budget", "4", "--out", ke,
         "--pivot-fraction", "0.02", "--decode-fit", "exact"])
    assert open(ke, "rb").read() == open(km, "rb").read(), "--decode-fit exact is not the default"
    assert "decode fit" not in run([exe, "inspect", km]).stdout
    assert "decode_fit" not in json.loads(run([exe, "inspect", km, "--json"]).stdout)
    for meth, fit, want in (("temporal", "norefit", "--decode-fit norefit: method temporal has no column refit"),
                            ("uniform", "exact", "--decode-fit exact: method uniform has no column refit"),
                            ("temporal", "rows", "--decode-fit rows: method temporal has no column refit"),
                            ("stepq", "fast", "--decode-fit: 'fast' is not exact, norefit or rows")):
        p = run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", meth, "--budget", "4",
                 "--out", os.path.join(d, "no.json"), "--decode-fit", fit], ok=False)
        assert p.returncode == 2 and want in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
        assert not os.path.exists(os.path.join(d, "no.json"))
    # --arith: recorded in the map (and its provenance), the distortions still measured in fp32
    # (the same widths); fp32 is the default, written nowhere; inspect shows fp16; a method
    # without column scales refuses it, and so do another name and fp16 with another fit.
    assert "arith" not in m
    kf = os.path.join(d, "kda-fp16.json")
    p = run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", "stepq", "--budget", "4",
             "--out", kf, "--pivot-fraction", "0.02", "--arith", "fp16", "--json"])
    assert json.loads(p.stdout)["arith"] == "fp16", p.stdout
    mf = json.load(open(kf))
    assert mf["arith"] == "fp16" and "arith=fp16" in mf["provenance"]["method_detail"]
    assert "decode_fit" not in mf and mf["layers"] == m["layers"]
    assert "arith          fp16" in run([exe, "inspect", kf]).stdout
    assert json.loads(run([exe, "inspect", kf, "--json"]).stdout)["arith"] == "fp16"
    ke = os.path.join(d, "kda-fp32.json")
    run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", "stepq", "--budget", "4", "--out", ke,
         "--pivot-fraction", "0.02", "--arith", "fp32"])
    assert open(ke, "rb").read() == open(km, "rb").read(), "--arith fp32 is not the default"
    assert "arith" not in run([exe, "inspect", km]).stdout
    assert "arith" not in json.loads(run([exe, "inspect", km, "--json"]).stdout)
    # ... and eval replays a KDA map with arith fp16 through the fp16 decode step (kernels/step_f16.c:
    # per-row decays, widths and pivot rows; every head here has an integer row), as its pool does:
    # readout errors that differ from the fp32 map's, by a few percent (6% on this trace), finite.
    ek = os.path.join(d, "eval-kda-fp16.json")
    run([exe, "eval", "--map", km, kf, "--trace", kt + "-000.safetensors", "--json", ek])
    rk = {x["name"]: x for x in json.load(open(ek))["methods"]}
    a, h = rk["kda"]["readout_rel"]["mean"], rk["kda-fp16"]["readout_rel"]["mean"]
    assert 0 < a < 1 and 0 < h < 1 and h != a and abs(h / a - 1) < 0.15, (a, h)
    assert rk["kda-fp16"]["store_gain"]["mean"] != rk["kda"]["store_gain"]["mean"], rk
    print("arith fp16 on the synthetic KDA trace: readout error stepq@4 %.5g -> %.5g" % (a, h))
    for meth, extra, want in (("temporal", ["--arith", "fp16"], "--arith fp16: method temporal has no dual-axis decode step"),
                              ("uniform", ["--arith", "fp32"], "--arith fp32: method uniform has no dual-axis decode step"),
                              ("stepq", ["--arith", "half"], "--arith: 'half' is not fp32 or fp16"),
                              ("stepq", ["--arith", "fp16", "--decode-fit", "rows"],
                               "--arith fp16 needs --decode-fit exact or norefit, not rows")):
        p = run([exe, "calibrate", "--trace", kt + "-000.safetensors", "--method", meth, "--budget", "4",
                 "--out", os.path.join(d, "no.json")] + extra, ok=False)
        assert p.returncode == 2 and want in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
        assert not os.path.exists(os.path.join(d, "no.json"))
    # --plot creates its folder when missing and writes the chart specs there.
    pd = os.path.join(d, "plots-new")
    run([exe, "eval", "--map", km, "--trace", kt + "-000.safetensors", "--plot", pd])
    assert any(n.endswith(".spec.json") for n in os.listdir(pd)), os.listdir(pd)
    # KDA's units are key rows: eval's Spearman is over the 2 x 2 x 16 rows as well as the heads
    # (on these synthetic traces longer-lived rows accumulate more error); GDN has no row entry.
    kj = os.path.join(d, "eval-kda.json")
    p = run([exe, "eval", "--map", km, "--trace", kt + "-000.safetensors", "--json", kj])
    sr = json.load(open(kj))["spearman_uniform6_halflife"]
    assert sr["rows"]["n"] == 64 and 0.5 < sr["rows"]["pooled"] <= 1.0, sr
    assert "over key rows (KDA units)" in p.stdout and "(64 rows)" in p.stdout, p.stdout
    assert "rows" not in e["spearman_uniform6_halflife"], e["spearman_uniform6_halflife"]
    # --arith fp16 (the analysis of kernels/quant.h): the state through fp16 three times per store;
    # on these traces it moves the readout error, by under 5%, and the JSON says so; another
    # value is refused by name.
    assert json.load(open(kj))["arith"] == "fp32"
    k16 = os.path.join(d, "eval-kda-fp16.json")
    p = run([exe, "eval", "--map", km, "--trace", kt + "-000.safetensors", "--json", k16, "--arith", "fp16"])
    a32, a16 = json.load(open(kj)), json.load(open(k16))
    assert a16["arith"] == "fp16" and "--arith fp16" in p.stderr, p.stderr
    r32, r16 = a32["methods"][0]["readout_rel"]["mean"], a16["methods"][0]["readout_rel"]["mean"]
    assert r16 != r32 and abs(r16 / r32 - 1) < 0.05, (r32, r16)
    p = run([exe, "eval", "--map", km, "--trace", kt + "-000.safetensors", "--arith", "fp8"], ok=False)
    assert p.returncode == 2 and "--arith 'fp8': not fp32 or fp16" in p.stderr, p.stderr
    # Errors: a truncated trace and a bad option.
    bad = os.path.join(d, "bad.safetensors")
    with open(traces[0], "rb") as f:
        blob = f.read()
    with open(bad, "wb") as f:
        f.write(blob[:-100])
    p = run([exe, "calibrate", "--trace", bad, "--method", "stepq", "--budget", "4", "--out",
             os.path.join(d, "x.json")], ok=False)
    assert p.returncode == 1 and "bad.safetensors" in p.stderr and "truncated" in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(d, "x.json"))
    p = run([exe, "calibrate", "--trace", traces[0], "--method", "nope", "--budget", "4", "--out", "x"], ok=False)
    assert p.returncode == 2
    # Non-finite values: one NaN and one Inf in the second file (its streams are 2.. of the
    # capture), then an Inf alone; calibrate and eval refuse the set in one line that names
    # the file, the tensor, its layer and the first bad element, and write nothing.
    nan_inf = os.path.join(d, "nan-inf.safetensors")
    poke(traces[1], nan_inf, "layer1.v", (0, 37, 2, 5), float("nan"))
    poke(nan_inf, nan_inf, "layer1.beta", (0, 40, 1), float("inf"))
    only_inf = os.path.join(d, "inf.safetensors")
    poke(traces[1], only_inf, "layer0.g", (0, 3, 1), float("-inf"))
    for bad, want in ((nan_inf, "tensor 'layer1.v' (layer 1) holds nan at [0, 37, 2, 5] "
                                "(stream 2, token 37, head 2, element 5)"),
                      (only_inf, "tensor 'layer0.g' (layer 0) holds -inf at [0, 3, 1] "
                                 "(stream 2, token 3, head 1)")):
        out, ej = os.path.join(d, "nonfinite.json"), os.path.join(d, "nonfinite-eval.json")
        for cmd in (["calibrate", "--trace", traces[0], bad, "--method", "stepq", "--budget", "4",
                     "--out", out, "--report", ej],
                    ["eval", "--map", maps["stepq@4"], "--trace", traces[0], bad, "--json", ej]):
            p = run([exe] + cmd, ok=False)
            line = "stepq %s: %s: %s: a trace must be finite\n" % (cmd[0], bad, want)
            assert p.returncode == 1 and p.stderr == line and p.stdout == "", (cmd[0], p.stderr, line)
            assert not os.path.exists(out) and not os.path.exists(ej), cmd[0]
    subprocess.run(["rm", "-rf", d])
    print("ok")


if __name__ == "__main__":
    main()
