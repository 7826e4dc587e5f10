#!/usr/bin/env python3
"""The stepq commands answer an option given last without its value: "needs a
value" for a real option, "unknown option" for a typo (it used to read as a
missing value), exit status 2 and one line naming the option either way.
Usage: check_cli.py STEPQ_EXE"""
import subprocess
import sys

CASES = [  # (command, a real value option, a typo)
    (["synth"], "--out", "--outt"),
    (["calibrate"], "--budget", "--bugdet"),
    (["eval"], "--threads", "--thread"),
    (["capacity"], "--tp", "--tpp"),
    (["simulate"], "--seed", "--sed"),
    (["bench", "pool"], "--slots", "--slot"),
    (["bench", "reference"], "--min-ms", "--min-m"),
    (["bench", "kernels"], "--batch", "--batches"),
    (["bench", "decode"], "--tp", "--tpp"),
    (["mkmap"], "--shape", "--shap"),
    (["inspect", "x.json"], "-o", "--o"),
    (["inspect", "x.json"], "--tp", "--tpp"),
]


def main():
    exe = sys.argv[1]
    bad = 0
    for cmd, real, typo in CASES:
        for opt, want in ((real, "needs a value"), (typo, "unknown option")):
            p = subprocess.run([exe] + cmd + [opt], capture_output=True, text=True)
            lines = p.stderr.strip().splitlines()
            ok = p.returncode == 2 and len(lines) == 1 and want in lines[0] and opt in lines[0]
            print("%s %s %s: rc %d, %r" % ("ok  " if ok else "FAIL", " ".join(cmd), opt,
                                           p.returncode, p.stderr.strip()))
            bad += not ok
    # Numbers that are not numbers are refused naming the option.
    for cmd in (["simulate", "--abort-rate", "nan"], ["simulate", "--abort-rate", ""],
                ["bench", "pool", "--min-ms", "-5"], ["bench", "pool", "--min-ms", "abc"]):
        p = subprocess.run([exe] + cmd, capture_output=True, text=True)
        ok = p.returncode == 2 and cmd[-2] in p.stderr
        print("%s %s: rc %d, %r" % ("ok  " if ok else "FAIL", " ".join(cmd), p.returncode,
                                    p.stderr.strip()))
        bad += not ok
    # mkmap --row-split: written into the map for a dual-axis method, refused elsewhere.
    import json
    base = [exe, "mkmap", "--shape", "tiny-gdn", "--bits", "6"]
    p = subprocess.run(base + ["--method", "stepq", "--row-split", "0.75"], capture_output=True,
                       text=True)
    ok = p.returncode == 0 and json.loads(p.stdout).get("row_split") == 0.75
    p0 = subprocess.run(base + ["--method", "stepq"], capture_output=True, text=True)
    ok = ok and p0.returncode == 0 and "row_split" not in json.loads(p0.stdout)
    for bad_args in (["--method", "temporal", "--row-split", "0.75"],
                     ["--method", "stepq", "--row-split", "0"],
                     ["--method", "stepq", "--row-split", "1.5"]):
        q = subprocess.run(base + bad_args, capture_output=True, text=True)
        ok = ok and q.returncode == 2 and "--row-split" in q.stderr and not q.stdout
    print("%s mkmap --row-split: written for stepq, absent by default, refused for temporal, 0, 1.5"
          % ("ok  " if ok else "FAIL"))
    bad += not ok
    # mkmap --decode-fit: written into the map for a dual-axis method, refused elsewhere and for
    # another name, each refusal one line naming the option.
    p = subprocess.run(base + ["--method", "stepq", "--decode-fit", "norefit"], capture_output=True,
                       text=True)
    ok = p.returncode == 0 and json.loads(p.stdout).get("decode_fit") == "norefit"
    p = subprocess.run(base + ["--method", "dsq", "--decode-fit", "norefit"], capture_output=True,
                       text=True)
    ok = ok and p.returncode == 0 and json.loads(p.stdout).get("decode_fit") == "norefit"
    p = subprocess.run(base + ["--method", "stepq", "--decode-fit", "rows"], capture_output=True,
                       text=True)
    ok = ok and p.returncode == 0 and json.loads(p.stdout).get("decode_fit") == "rows"
    p = subprocess.run(base + ["--method", "spatial", "--decode-fit", "rows"], capture_output=True,
                       text=True)
    ok = ok and p.returncode == 0 and json.loads(p.stdout).get("decode_fit") == "rows"
    p = subprocess.run(base + ["--method", "stepq", "--decode-fit", "exact"], capture_output=True,
                       text=True)
    ok = ok and p.returncode == 0 and p.stdout == p0.stdout
    ok = ok and "decode_fit" not in json.loads(p0.stdout)
    for bad_args in (["--method", "temporal", "--decode-fit", "norefit"],
                     ["--method", "temporal", "--decode-fit", "rows"],
                     ["--method", "stepq", "--decode-fit", "Rows"],
                     ["--method", "uniform", "--decode-fit", "exact"],
                     ["--method", "stepq", "--decode-fit", "fast"],
                     ["--method", "stepq", "--decode-fit"]):
        q = subprocess.run(base + bad_args, capture_output=True, text=True)
        ok = ok and q.returncode == 2 and "--decode-fit" in q.stderr and not q.stdout
        ok = ok and len(q.stderr.strip().splitlines()) == 1
    print("%s mkmap --decode-fit: norefit written for stepq and dsq, rows for stepq and spatial, "
          "exact = no option, refused for temporal, uniform, an unknown name, no value"
          % ("ok  " if ok else "FAIL"))
    bad += not ok
    # mkmap --arith: fp16 written into the map for a dual-axis method with the exact fit, fp32 the
    # default (written nowhere), refused elsewhere, with another fit and for another name, each
    # refusal one line naming the option.
    ok = True
    for meth in ("stepq", "dsq", "spatial"):
        p = subprocess.run(base + ["--method", meth, "--arith", "fp16"], capture_output=True,
                           text=True)
        ok = ok and p.returncode == 0 and json.loads(p.stdout).get("arith") == "fp16"
    p = subprocess.run(base + ["--method", "stepq", "--arith", "fp16", "--decode-fit", "exact"],
                       capture_output=True, text=True)
    ok = ok and p.returncode == 0 and json.loads(p.stdout).get("arith") == "fp16"
    p = subprocess.run(base + ["--method", "stepq", "--arith", "fp32"], capture_output=True,
                       text=True)
    ok = ok and p.returncode == 0 and p.stdout == p0.stdout and "arith" not in json.loads(p0.stdout)
    p = subprocess.run(base + ["--method", "stepq", "--arith", "fp32", "--decode-fit", "rows"],
                       capture_output=True, text=True)
    ok = ok and p.returncode == 0 and "arith" not in json.loads(p.stdout)
    for bad_args in (["--method", "temporal", "--arith", "fp16"],
                     ["--method", "uniform", "--arith", "fp32"],
                     ["--method", "stepq", "--arith", "FP16"],
                     ["--method", "stepq", "--arith", "bf16"],
                     ["--method", "stepq", "--arith", "fp16", "--decode-fit", "rows"],
                     ["--method", "stepq", "--decode-fit", "rows", "--arith", "fp16"],
                     ["--method", "stepq", "--arith"]):
        q = subprocess.run(base + bad_args, capture_output=True, text=True)
        ok = ok and q.returncode == 2 and "--arith" in q.stderr and not q.stdout
        ok = ok and len(q.stderr.strip().splitlines()) == 1
    q = subprocess.run(base + ["--method", "stepq", "--arith", "fp16", "--decode-fit", "rows"],
                       capture_output=True, text=True)
    ok = ok and "--decode-fit exact or norefit, not rows" in q.stderr
    q = subprocess.run(base + ["--method", "stepq", "--arith", "fp16", "--decode-fit", "norefit"],
                       capture_output=True, text=True)
    m = json.loads(q.stdout) if q.returncode == 0 else {}
    ok = ok and m.get("arith") == "fp16" and m.get("decode_fit") == "norefit"
    print("%s mkmap --arith: fp16 written for stepq, dsq and spatial, fp32 = no option, refused "
          "for temporal, uniform, an unknown name, another fit, no value"
          % ("ok  " if ok else "FAIL"))
    bad += not ok
    # inspect shows arith when it is not fp32, in its text and its JSON, and nowhere for fp32.
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        f16, f32 = os.path.join(d, "fp16.json"), os.path.join(d, "fp32.json")
        r16 = subprocess.run(base + ["--method", "stepq", "--arith", "fp16", "-o", f16],
                             capture_output=True, text=True)
        r32 = subprocess.run(base + ["--method", "stepq", "-o", f32], capture_output=True,
                             text=True)
        ok = r16.returncode == 0 and r32.returncode == 0
        t16 = subprocess.run([exe, "inspect", f16], capture_output=True, text=True)
        j16 = subprocess.run([exe, "inspect", f16, "--json"], capture_output=True, text=True)
        t32 = subprocess.run([exe, "inspect", f32], capture_output=True, text=True)
        j32 = subprocess.run([exe, "inspect", f32, "--json"], capture_output=True, text=True)
        ok = ok and all(x.returncode == 0 for x in (t16, j16, t32, j32))
        ok = ok and any(line.startswith("arith          fp16") for line in t16.stdout.splitlines())
        ok = ok and json.loads(j16.stdout).get("arith") == "fp16"
        ok = ok and "arith" not in t32.stdout and "arith" not in json.loads(j32.stdout)
    print("%s inspect: arith fp16 shown in text and JSON, fp32 shown nowhere"
          % ("ok  " if ok else "FAIL"))
    bad += not ok
    # bench pool --json: one JSON document on stdout, tables and messages elsewhere.
    p = subprocess.run([exe, "bench", "pool", "--backend", "host", "--page-bytes", "4096", "--slots",
                        "1,2", "--min-ms", "1", "--json"], capture_output=True, text=True)
    try:
        d = json.loads(p.stdout)
        ok = p.returncode == 0 and len(d["alloc_free"]) == 12 and len(d["host"]) == 2
    except (ValueError, KeyError):
        ok = False
    print("%s bench pool --json: rc %d" % ("ok  " if ok else "FAIL", p.returncode))
    bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
