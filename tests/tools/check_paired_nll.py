#!/usr/bin/env python3
"""paired_nll.py against the committed runs: on the served drift JSON of tiny-gdn it reproduces the
run's own paired column (minus_stepq) for every method that has one, pairs any two methods, and
refuses an unknown method and a JSON without per-stream values by name. Usage: check_paired_nll.py ROOT"""
import json
import os
import subprocess
import sys


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
    return 1 if fails or n < 10 else 0


if __name__ == "__main__":
    sys.exit(main())
