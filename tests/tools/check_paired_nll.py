#!/usr/bin/env python3
"""paired_nll.py against the committed runs: on the served drift JSON of tiny-gdn it reproduces the
run's own paired column (minus_stepq) for every method that has one, pairs any two methods, and
refuses an unknown method and a JSON without per-stream values by name; --vs pairs across two runs
(a made-up second run whose per-stream values are the first's plus known offsets) and refuses runs of
other streams. Usage: check_paired_nll.py ROOT"""
import json
import os
import subprocess
import sys
import tempfile


def main():
    root = sys.argv[1]
    sys.path.insert(0, os.path.join(root, "tools", "scripts"))
    import paired_nll

    run = os.path.join(root, "tools", "results", "served-tiny-gdn", "drift-test.json")
    rows = paired_nll.rows_of(json.load(open(run)), run)
    fails, n = 0, 0
    for r in rows:
        if r.get("stepq_ref"):
            ((name, m, se, _),) = paired_nll.paired(rows, r["stepq_ref"], [r["method"]])
            if abs(m - r["minus_stepq"]) > 1e-12 or abs(se - r["minus_stepq_se"]) > 1e-12:
                print("FAIL: %s vs %s: %r +- %r, the run says %r +- %r" % (
                    name, r["stepq_ref"], m, se, r["minus_stepq"], r["minus_stepq_se"]))
                fails += 1
            n += 1
    if not fails:
        print("ok   %d paired columns of the run reproduced" % n)
    script = os.path.join(root, "tools", "scripts", "paired_nll.py")
    for args, want in (([run, "--against", "stepq@9"], "no method 'stepq@9'"),
                       ([os.path.join(root, "tools", "results", "tiny-gdn-test", "nll-test-4.json"), "--against",
                         "stepq@4"], "has no excess_per_stream")):
        p = subprocess.run([sys.executable, script] + args, capture_output=True, text=True, timeout=60)
        if p.returncode == 0 or want not in p.stderr:
            print("FAIL: %s: rc %d, %s" % (args, p.returncode, p.stderr.strip()))
            fails += 1
        else:
            print("ok   refused: " + p.stderr.strip())
    # --vs: OTHER in nll_eval.py's layout (top-level results and stream fields), each method's values
    # the served run's minus 0.001 * (stream index): the paired mean is the mean offset exactly and its
    # s.e. that of the offsets; the difference of means is the same number.
    doc = json.load(open(run))
    meta = doc["checks"]["drift"]["meta"]
    k = len(rows[0]["excess_per_stream"])
    off = [0.001 * i for i in range(k)]
    other = {"results": [dict(r, excess_per_stream=[x - o for x, o in zip(r["excess_per_stream"], off)])
                         for r in rows], "text": "/elsewhere/" + meta["text"], "streams": meta["streams"],
             "prefill": meta["prefill"], "decode": meta["decode"], "offset": meta["offset"]}
    om, ose = paired_nll.ms(off)
    with tempfile.TemporaryDirectory() as td:
        op = os.path.join(td, "other.json")
        json.dump(other, open(op, "w"))
        out = os.path.join(td, "vs.json")
        p = subprocess.run([sys.executable, script, run, "--vs", op, "--json", out], capture_output=True,
                           text=True, timeout=60)
        got = json.load(open(out))["pairs"] if p.returncode == 0 else []
        bad = [g["method"] for g in got if abs(g["paired_mean"] - om) > 1e-12 or abs(g["paired_se"] - ose) > 1e-12
               or abs(g["difference"] - om) > 1e-12]
        if p.returncode or bad or len(got) != len(rows) - 1:
            print("FAIL: --vs: rc %d, %d pairs, wrong: %s %s" % (p.returncode, len(got), bad, p.stderr.strip()))
            fails += 1
        else:
            print("ok   --vs: %d methods paired across two runs, offset %.6f +- %.6f recovered" % (len(got), om, ose))
        other["decode"] = meta["decode"] // 2
        json.dump(other, open(op, "w"))
        p = subprocess.run([sys.executable, script, run, "--vs", op], capture_output=True, text=True, timeout=60)
        if p.returncode == 0 or "not the same streams (decode" not in p.stderr:
            print("FAIL: --vs with other streams: rc %d, %s" % (p.returncode, p.stderr.strip()))
            fails += 1
        else:
            print("ok   refused: " + p.stderr.strip())
    return 1 if fails or n < 10 else 0


if __name__ == "__main__":
    sys.exit(main())
